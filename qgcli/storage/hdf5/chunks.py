"""Compressed HDF5 outputs written chunk by chunk, the chunks compressed on every core.

HDF5 runs its filters on one thread, inside its global lock, and an output written in blocks that cut
through chunks makes it read, decompress, patch and recompress each chunk once per block.  Here the output's
chunk shape is chosen first (:func:`chunk_shape`: up to 1 MiB of whole trailing dimensions, the same in
memory and streamed), blocks of whole chunk rows are handed over, and each chunk is compressed where it lies
(copied out only where it is not contiguous, or an edge chunk to pad) on a pool of its own
(``zlib.compress`` and the LZF compressors release the GIL), then stored with ``write_direct_chunk`` in
chunk order while the pool compresses the next groups and the caller reads and computes the next block.
The filters are HDF5's built-in gzip (h5py's default level 4, the bytes the filter itself writes) and
h5py's LZF (filter 32000): LZF chunks come from qgcli's compiled compressor (``qg_lzf_compress``: the LZF
format, other bytes than h5py's, decoded by h5py's filter), else h5py's own routine, else HDF5 compresses
as before (one thread).  Any h5py reads the file without a plugin.
"""
import ctypes
import zlib
from collections import deque

import numpy as np

from qgcli.ops.blocked import abandon, submit
from qgcli.signals import raise_pending

GZIP_LEVEL = 4  # h5py's default for compression="gzip"
CHUNK_BYTES = 1 << 20  # the largest chunk h5py guesses, and HDF5's default chunk cache: a chunk read is cached
_GROUP_BYTES = 8 << 20  # raw bytes of chunks compressed per group
_RING = 4  # groups on their way at once: the pool compresses a block's worth while the next one is read


def chunk_shape(shape, itemsize):
    """Chunks of whole trailing dimensions, as many as fit in ``CHUNK_BYTES``: ``(1, .., 1, k, n_j+1, ..)``.

    Each chunk is then one contiguous run of a C-ordered block (compressed where it lies, no gathering
    copy), a streamed block can be a single first-axis item, and HDF5 writes 1 MiB per chunk: each
    ``write_direct_chunk`` costs about 15-50 us besides its bytes, and h5py's own guess (``chunks=True``:
    64 KiB chunks for a 256 MiB tensor) took 4096 of them, 0.2-0.3 s, where 256 take 0.07 s."""
    chunk, size = [1] * len(shape), itemsize
    for axis in reversed(range(len(shape))):
        n = max(int(shape[axis]), 1)
        if size * n > CHUNK_BYTES:
            chunk[axis] = max(1, CHUNK_BYTES // size)
            break
        chunk[axis], size = n, size * n
    return tuple(chunk)


def create(group, name, shape, dtype, compression, *, chunks=None):
    """An empty dataset: contiguous without ``compression``, else chunked (``chunks`` or
    :func:`chunk_shape`) with that filter.  Scalars and empty arrays are never compressed."""
    shape, dtype = tuple(shape), np.dtype(dtype)
    if not compression or not shape or not int(np.prod(shape)):
        return group.create_dataset(name, shape=shape, dtype=dtype)
    return group.create_dataset(name, shape=shape, dtype=dtype, compression=compression,
                                chunks=chunks or chunk_shape(shape, dtype.itemsize))


def write(ds, array):
    """``ds[...] = array`` for a whole dataset made by :func:`create`."""
    if ds.chunks is None or ds.compression is None:
        ds[...] = array
        return
    writer = ChunkWriter(ds)
    writer.write_rows(0, np.asarray(array))
    writer.flush()


class ChunkWriter:
    """Writes blocks of whole chunk rows (first-axis items ``[start, start + len(block))``, ``start`` a
    multiple of the chunk's first extent, and the block ending on one or at the dataset's end) into the
    chunked, compressed dataset ``ds``.

    The chunks are compressed on the pool in groups, up to ``_RING`` groups at a time, while the caller
    goes on (reads the next block): a block must stay as it is until the next :meth:`write_rows` returns,
    and :meth:`flush` writes what is still on its way.  HDF5 is only called from the caller's thread, in
    chunk order (the same file whatever the threads)."""

    def __init__(self, ds):
        self.ds = ds
        self.chunks = tuple(ds.chunks)
        self.compress = _compressor(ds)
        self._raw = self._out = None  # per ring slot: the group's chunks as HDF5 stores them, and LZF's output
        self._free = deque(range(_RING))
        self._flight = deque()  # (slot, chunk positions, futures of (mask, bytes)), oldest first

    def write_rows(self, start, block):
        ds, chunks = self.ds, self.chunks
        if self.compress is None:  # no codec of our own: HDF5 compresses (still whole chunks per write)
            ds[start:start + len(block)] = block
            return
        block = np.asarray(block, dtype=ds.dtype)  # any strides: each chunk is copied out on its own
        if start % chunks[0] or (len(block) % chunks[0] and start + len(block) != ds.shape[0]):
            raise ValueError(f"items {start}:{start + len(block)} cut through chunks of {chunks[0]} items")

        chunk_bytes = int(np.prod(chunks)) * block.itemsize
        per_group = max(1, _GROUP_BYTES // chunk_bytes)
        if self._raw is None:
            self._raw = np.empty((_RING, per_group) + chunks, block.dtype)
            self._out = np.empty((_RING, per_group, chunk_bytes), np.uint8)
        corners = [tuple(i * c for i, c in zip(corner, chunks))
                   for corner in np.ndindex(*(-(-n // c) for n, c in zip(block.shape, chunks)))]
        earlier = len(self._flight)  # groups of the blocks before this one: written before this call returns
        try:
            for g in range(0, len(corners), per_group):
                if not self._free:
                    self._retire()
                    earlier = max(0, earlier - 1)
                slot, group = self._free.popleft(), corners[g:g + per_group]

                def work(k, slot=slot, group=group):  # on the pool: the copy and the compression of one chunk
                    return self.compress(_chunk(block, group[k], chunks, self._raw[slot, k]), self._out[slot, k])

                futures = submit(work, range(len(group)), pool="qgcli-codec")
                self._flight.append((slot, [(start + at[0],) + at[1:] for at in group], futures))
            for _ in range(earlier):
                self._retire()
            while self._flight and all(f.done() for f in self._flight[0][2]):
                self._retire()
        except BaseException:
            self._abandon()
            raise

    def flush(self):
        """Write every chunk still being compressed."""
        try:
            while self._flight:
                self._retire()
        except BaseException:
            self._abandon()
            raise

    def _abandon(self):
        abandon([f for _, _, futures in self._flight for f in futures])
        self._flight.clear()
        self._free = deque(range(_RING))

    def _retire(self):
        """Wait for the oldest group and write its chunks; a signal deferred meanwhile stops the run here."""
        slot, positions, futures = self._flight[0]
        for at, future in zip(positions, futures):
            mask, data = future.result()
            self.ds.id.write_direct_chunk(at, data, filter_mask=mask)
        self._flight.popleft()
        self._free.append(slot)
        raise_pending()


def _chunk(block, at, chunks, slot):
    """The chunk of ``block`` at corner ``at`` as HDF5 stores it (a C-ordered array of the chunk's shape):
    where it lies when it is contiguous there (the chunks of :func:`chunk_shape` in a C-ordered block),
    else copied into ``slot``, an edge chunk padded with the fill value (0).  Into a reused slot: a fresh
    array per chunk cost as much as the copy."""
    part = block[tuple(slice(a, a + c) for a, c in zip(at, chunks))]
    if part.shape != chunks:
        slot[...] = 0
        slot[tuple(slice(0, n) for n in part.shape)] = part
    elif part.flags.c_contiguous:
        return part
    else:
        np.copyto(slot, part)
    return slot


def _compressor(ds):
    """``(chunk, out) -> (filter mask, bytes)`` for the dataset's one filter, or None; ``out``: a scratch
    buffer of the chunk's size the compressed bytes may go to (valid until the next group)."""
    from h5py import h5z

    plist = ds.id.get_create_plist()
    filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
    if filters == [h5z.FILTER_DEFLATE]:
        level = plist.get_filter_by_id(h5z.FILTER_DEFLATE)[1][0]
        return lambda chunk, out: (0, zlib.compress(chunk.data, level))
    if filters == [h5z.FILTER_LZF]:
        lzf = _lzf_compress()
        if lzf is None:
            return None

        def compress(chunk, out):
            # h5py's filter: an output buffer (``out``, the writer's) as long as the input; a chunk that does
            # not shrink is stored raw, its (optional) filter marked skipped in the mask.  No copies:
            # write_direct_chunk takes any contiguous buffer.
            size = lzf(chunk.ctypes.data, chunk.nbytes, out.ctypes.data, chunk.nbytes, chunk.itemsize)
            return (0, out[:size]) if size else (1, chunk)

        return compress
    return None


_lzf = []


def _lzf_compress():
    """An LZF compressor ``(in, n, out, cap, itemsize) -> length or 0``: qgcli's compiled one (deterministic,
    1.4-40x faster: its hash table is small and cleared, it looks less often where nothing matches, and
    matches start at item boundaries), else h5py's own routine (``lzf_compress``, exported by its h5z
    extension; every byte), else None."""
    if not _lzf:
        from qgcli.ops import native

        lib = native.library()
        if lib is not None:
            _lzf.append(lib.qg_lzf_compress)
            return _lzf[0]
        try:
            from h5py import h5z

            fn = ctypes.CDLL(h5z.__file__).lzf_compress
            fn.restype = ctypes.c_uint
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint]
            _lzf.append(lambda src, n, dst, cap, itemsize: fn(src, n, dst, cap))
        except (OSError, AttributeError):
            _lzf.append(None)
    return _lzf[0]
