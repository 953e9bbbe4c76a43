"""Compressed HDF5 outputs written chunk by chunk, the chunks compressed on every core.

HDF5 runs its filters on one thread, inside its global lock, and an output written in blocks that cut
through chunks makes it read, decompress, patch and recompress each chunk once per block.  Here the output's
chunk shape is chosen first (h5py's own guess, so the layout is the one ``chunks=True`` gives), blocks of
whole chunk rows are handed over, and each chunk is copied out and compressed in the thread pool
(``zlib.compress`` and the LZF compressors release the GIL) into reused slots, then stored with
``write_direct_chunk`` in chunk order while the pool compresses the next group.  The filters are HDF5's
built-in gzip (h5py's default level 4, the bytes the filter itself writes) and h5py's LZF (filter 32000):
LZF chunks come from qgcli's compiled compressor (``qg_lzf_compress``: the LZF format, other bytes than
h5py's, decoded by h5py's filter), else h5py's own routine, else HDF5 compresses as before (one thread).
Any h5py reads the file without a plugin.
"""
import ctypes
import zlib

import numpy as np

GZIP_LEVEL = 4  # h5py's default for compression="gzip"
_GROUP_BYTES = 8 << 20  # raw bytes of chunks compressed per round (two rounds' buffers are held)


def chunk_shape(shape, itemsize):
    """The chunk shape h5py picks for ``chunks=True`` (chunks of at most about 1 MiB)."""
    from h5py._hl.filters import guess_chunk

    return tuple(int(c) for c in guess_chunk(tuple(shape), None, itemsize))


def create(group, name, shape, dtype, compression, *, chunks=None):
    """An empty dataset: contiguous without ``compression``, else chunked (``chunks`` or h5py's guess) with
    that filter.  Scalars and empty arrays are never compressed."""
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


class ChunkWriter:
    """Writes blocks of whole chunk rows (first-axis items ``[start, start + len(block))``, ``start`` a
    multiple of the chunk's first extent, and the block ending on one or at the dataset's end) into the
    chunked, compressed dataset ``ds``."""

    def __init__(self, ds):
        self.ds = ds
        self.chunks = tuple(ds.chunks)
        self.compress = _compressor(ds)
        self._raw = self._out = None

    def write_rows(self, start, block):
        ds, chunks = self.ds, self.chunks
        if self.compress is None:  # no codec of our own: HDF5 compresses (still whole chunks per write)
            ds[start:start + len(block)] = block
            return
        block = np.asarray(block, dtype=ds.dtype)  # any strides: each chunk is copied out on its own
        if start % chunks[0] or (len(block) % chunks[0] and start + len(block) != ds.shape[0]):
            raise ValueError(f"items {start}:{start + len(block)} cut through chunks of {chunks[0]} items")
        from qgcli.ops.blocked import _map
        from qgcli.signals import raise_pending

        chunk_bytes = int(np.prod(chunks)) * block.itemsize
        per_group = max(1, _GROUP_BYTES // chunk_bytes)
        if self._raw is None:  # two groups' chunks as HDF5 stores them, and LZF's output: one group is written
            self._raw = np.empty((2, per_group) + chunks, block.dtype)  # while the next is compressed
            self._out = np.empty((2, per_group, chunk_bytes), np.uint8)
        corners = [tuple(i * c for i, c in zip(corner, chunks))
                   for corner in np.ndindex(*(-(-n // c) for n, c in zip(block.shape, chunks)))]
        done = []  # the group compressed last, (corner, (mask, bytes)) each: written while the next compresses

        def write_done():
            for at, (mask, data) in done:
                ds.id.write_direct_chunk((start + at[0],) + at[1:], data, filter_mask=mask)
            done.clear()
            raise_pending()

        for n, g in enumerate(range(0, len(corners), per_group)):
            group, half = range(g, min(g + per_group, len(corners))), n % 2

            def work(k, g=g, half=half):  # on the pool: the copy and the compression of chunk k
                slot = k - g
                return self.compress(_chunk(block, corners[k], chunks, self._raw[half, slot]), self._out[half, slot])

            stored = _map(work, group, meanwhile=write_done)
            done.extend(zip((corners[k] for k in group), stored))
        write_done()


def _chunk(block, at, chunks, slot):
    """The chunk of ``block`` at corner ``at`` copied into ``slot`` (a C-ordered array of the chunk's shape)
    as HDF5 stores it: an edge chunk padded with the fill value (0).  Into a reused slot: a fresh array per
    chunk cost as much as the copy."""
    part = block[tuple(slice(a, a + c) for a, c in zip(at, chunks))]
    if part.shape != chunks:
        slot[...] = 0
        slot[tuple(slice(0, n) for n in part.shape)] = part
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
