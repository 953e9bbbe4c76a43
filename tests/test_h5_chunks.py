"""Compressed .h5 outputs written chunk by chunk (qgcli.storage.hdf5.chunks): the bytes HDF5's own filters write, chunks
of whole trailing dimensions, and streamed blocks that write each chunk once."""
import h5py
import numpy as np
import pytest

from qgcli.storage.hdf5 import chunks as h5_chunks
from qgcli.ops import native


def _tensor(shape, seed):
    a = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    a.reshape(-1)[: a.size // 4] = 0.0  # a compressible stretch beside near-incompressible noise
    return a


def _chunks_of(ds):
    """Every stored chunk of ``ds``: offset -> (filter mask, bytes)."""
    out = {}
    for i in range(ds.id.get_num_chunks()):
        offset = ds.id.get_chunk_info(i).chunk_offset
        out[offset] = ds.id.read_direct_chunk(offset)
    return out


@pytest.mark.parametrize("compression", ["gzip", "lzf"])
@pytest.mark.parametrize("shape", [(9, 70, 33), (3, 5000), (17,), (16, 64, 256)])  # edge chunks, or none
def test_chunks_are_the_bytes_hdf5_writes(tmp_path, compression, shape):
    a = _tensor(shape, 1)
    with h5py.File(tmp_path / "hdf5.h5", "w") as f:
        f.create_dataset("x", data=a, compression=compression, chunks=h5_chunks.chunk_shape(shape, 4))
    with h5py.File(tmp_path / "qgcli.h5", "w") as f:
        h5_chunks.write(h5_chunks.create(f, "x", a.shape, a.dtype, compression), a)
    with h5py.File(tmp_path / "hdf5.h5", "r") as f, h5py.File(tmp_path / "qgcli.h5", "r") as g:
        want, got = f["x"], g["x"]
        assert (got.chunks, got.compression, got.compression_opts) == (want.chunks, want.compression,
                                                                       want.compression_opts)
        assert np.array_equal(got[()].view(np.uint32), a.view(np.uint32))
        if compression == "gzip":
            assert _chunks_of(got) == _chunks_of(want)  # edge chunks padded as HDF5 pads them
        else:  # qgcli's own LZF bytes: the chunks decode to what HDF5's decode to, padding included
            assert _decoded(got) == _decoded(want)


def _decoded(ds):
    """Every stored chunk of ``ds`` decoded by HDF5 (edge chunks whole, with their padding)."""
    out = {}
    with h5py.File("decode.h5", "w", driver="core", backing_store=False) as scratch:
        for k, (offset, (mask, data)) in enumerate(_chunks_of(ds).items()):
            if mask:  # stored raw
                out[offset] = (mask, bytes(data))
                continue
            one = scratch.create_dataset(str(k), shape=ds.chunks, dtype=ds.dtype, chunks=ds.chunks, compression="lzf")
            one.id.write_direct_chunk((0,) * len(ds.chunks), data, filter_mask=mask)
            out[offset] = (mask, one[()].tobytes())
    return out


def test_lzf_chunk_that_does_not_shrink_is_stored_raw(tmp_path):
    noise = np.random.default_rng(2).integers(0, 2**32, (64, 1024), dtype=np.uint32).view(np.float32)
    with h5py.File(tmp_path / "o.h5", "w") as f:
        h5_chunks.write(h5_chunks.create(f, "x", noise.shape, noise.dtype, "lzf"), noise)
    with h5py.File(tmp_path / "o.h5", "r") as f:
        masks = {mask for mask, _ in _chunks_of(f["x"]).values()}
        assert masks == {1}  # LZF (an optional filter) skipped, as h5py's filter does
        assert np.array_equal(f["x"][()].view(np.uint32), noise.view(np.uint32))


def _bundle(path, shape):
    with h5py.File(path, "w") as f:
        f["inputs"], f["gradients"] = _tensor(shape, 3) * 2, _tensor(shape, 4)
        f["min"], f["max"] = np.full(shape[-1], -2.5, np.float32), np.full(shape[-1], 3.0, np.float32)


@pytest.mark.parametrize("compression", ["gzip", "lzf"])
def test_streamed_compressed_output_is_the_in_memory_file(cli, tmp_path, compression):
    # 4 MiB tensors, chunks (4, 64, 16, 64): with an 8M budget blocks of one item would cut through every
    # chunk; here blocks are whole chunk rows (4 items; ChunkWriter refuses any other), each chunk written
    # once, compressed by qgcli, and the file holds the same chunks as the one written in memory.
    bundle, streamed, in_memory = tmp_path / "b.h5", tmp_path / "s.h5", tmp_path / "m.h5"
    _bundle(bundle, (16, 64, 16, 64))
    for out, limit in ((streamed, "8M"), (in_memory, "8G")):
        r = cli("fakequant-grad", bundle, "-o", out, "--memory-limit", limit, "--compression", compression, "--json")
        assert r.exit_code == 0, r.output
        assert ("streamed from disk" in r.stdout) == (out == streamed)
    with h5py.File(streamed, "r") as s, h5py.File(in_memory, "r") as m:
        assert sorted(s) == sorted(m)
        for name in m:
            assert (s[name].chunks, s[name].compression) == (m[name].chunks, m[name].compression)
            assert np.array_equal(s[name][()].view(np.uint32), m[name][()].view(np.uint32))
        got, want = _chunks_of(s["backprops_wrt_input"]), _chunks_of(m["backprops_wrt_input"])
        if compression == "gzip" or native.library() is not None:  # qgcli's LZF is deterministic
            assert got == want
        else:
            # h5py's LZF leaves its hash table uninitialised (INIT_HTAB 0), so the same chunk may compress to
            # other (valid) bytes from one call to the next (1 run in 20 here): the same chunks, masks and
            # data, and about the same size; a chunk written twice would leave the file larger.
            assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
            assert abs(sum(len(v[1]) for v in got.values()) / sum(len(v[1]) for v in want.values()) - 1) < 0.01
    assert abs(streamed.stat().st_size / in_memory.stat().st_size - 1) < 0.01


def test_a_chunk_row_over_the_budget_gets_one_item_per_chunk(cli, tmp_path):
    bundle, streamed, in_memory = tmp_path / "b.h5", tmp_path / "s.h5", tmp_path / "m.h5"
    _bundle(bundle, (16, 64, 16, 64))  # chunk rows of 4 items x 256 KiB x 6 working copies: over 1M
    for out, limit in ((streamed, "1M"), (in_memory, "8G")):
        r = cli("fakequant-grad", bundle, "-o", out, "--memory-limit", limit, "--compression", "lzf")
        assert r.exit_code == 0, r.output
    with h5py.File(streamed, "r") as s, h5py.File(in_memory, "r") as m:
        got, want = s["backprops_wrt_input"], m["backprops_wrt_input"]
        assert want.chunks == h5_chunks.chunk_shape(want.shape, 4) and want.chunks[0] == 4
        assert got.chunks == (1,) + want.chunks[1:]
        assert np.array_equal(got[()].view(np.uint32), want[()].view(np.uint32))


@pytest.mark.parametrize("shape, itemsize, want", [
    ((64, 64, 64, 256), 4, (1, 16, 64, 256)),  # 1 MiB of whole rows of the second axis
    ((16, 64, 16, 64), 4, (4, 64, 16, 64)),  # items of 256 KiB: four per chunk
    ((3, 5000), 4, (3, 5000)),  # smaller than a chunk: one
    ((2, 300_000), 4, (1, 262_144)),  # an item over 1 MiB: the last axis is cut
    ((7, 100, 1000), 8, (1, 100, 1000)),  # 800 kB items: one per chunk, not two
    ((5, 1, 3), 2, (5, 1, 3)),
])
def test_chunks_are_whole_trailing_dimensions_up_to_1_mib(shape, itemsize, want):
    got = h5_chunks.chunk_shape(shape, itemsize)
    assert got == want
    assert int(np.prod(got)) * itemsize <= h5_chunks.CHUNK_BYTES
    assert all(1 <= c <= n for c, n in zip(got, shape))


def _rows_written_from_two_buffers(ds, data, rows):
    """Blocks of ``data`` handed to a ChunkWriter from two buffers used in turn, each scribbled over as soon
    as the writer may no longer read it (once the write after next returns): the contract streaming keeps."""
    writer = h5_chunks.ChunkWriter(ds)
    buffers = [np.empty((rows,) + data.shape[1:], data.dtype) for _ in range(2)]
    for n, start in enumerate(range(0, len(data), rows)):
        buf = buffers[n % 2][:len(data[start:start + rows])]
        buf[...] = data[start:start + rows]
        writer.write_rows(start, buf)
        buffers[(n + 1) % 2][...] = np.nan  # the block before this one: the writer is done with it
    writer.flush()


@pytest.mark.parametrize("compression", ["gzip", "lzf"])
@pytest.mark.parametrize("threads", ["1", "2"])
def test_blocks_are_compressed_behind_the_callers_back_but_never_read_late(tmp_path, monkeypatch,
                                                                            compression, threads):
    monkeypatch.setenv("QGCLI_THREADS", threads)
    data = _tensor((24, 48, 64, 32), 5)  # chunks (2, 48, 64, 32): 12 chunk rows, 1.5 per group
    with h5py.File(tmp_path / "o.h5", "w") as f:
        ds = h5_chunks.create(f, "x", data.shape, data.dtype, compression)
        assert ds.chunks == (2, 48, 64, 32)
        _rows_written_from_two_buffers(ds, data, rows=4)
    with h5py.File(tmp_path / "o.h5", "r") as f:
        assert np.array_equal(f["x"][()].view(np.uint32), data.view(np.uint32))


def test_a_chunk_that_fails_to_compress_stops_the_write_and_leaves_no_work_behind(tmp_path):
    data = _tensor((24, 48, 64, 32), 6)
    with h5py.File(tmp_path / "o.h5", "w") as f:
        writer = h5_chunks.ChunkWriter(h5_chunks.create(f, "x", data.shape, data.dtype, "gzip"))
        compress, calls = writer.compress, []

        def failing(chunk, out):
            calls.append(1)
            if len(calls) == 9:
                raise MemoryError("no room for this chunk")
            return compress(chunk, out)

        writer.compress = failing
        with pytest.raises(MemoryError, match="no room"):
            for start in range(0, 24, 4):
                writer.write_rows(start, data[start:start + 4])
            writer.flush()
        assert not writer._flight  # nothing left compressing into the writer's buffers


def _chunk_bytes(rng, kind, n):
    if kind == "random":
        return rng.integers(0, 256, n, dtype=np.uint8)
    if kind == "runs":
        return np.repeat(rng.integers(0, 4, n // 7 + 1, dtype=np.uint8), 7)[:n]
    if kind == "gradient":
        g = rng.standard_normal(n // 4 + 1).astype(np.float32)
        g[rng.random(g.size) < 0.3] = 0
        return g.view(np.uint8)[:n]
    period = rng.integers(1, 9000)  # repeats nearer and farther than LZF's 8192-byte reach
    return np.tile(rng.integers(0, 256, period, dtype=np.uint8), n // period + 1)[:n]


@pytest.mark.skipif(native.library() is None, reason="the compiled kernels are not built")
@pytest.mark.parametrize("kind", ["random", "runs", "gradient", "periodic"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 31, 32, 33, 300, 70_000, 1 << 20])
@pytest.mark.parametrize("step", [1, 4, 8])
def test_qgcli_lzf_chunks_decode_with_h5py_and_repeat(tmp_path, kind, n, step):
    """qgcli's LZF compressor (matches starting at every byte, or at item boundaries of 4 or 8 bytes) writes
    streams HDF5's LZF filter decodes to the same bytes, the same bytes on every call, and 0 (the chunk is
    stored raw) where the stream would not be shorter."""
    rng = np.random.default_rng(n)
    data = _chunk_bytes(rng, kind, n)
    native_lzf = native.library().qg_lzf_compress

    def lzf(src, length, dst, cap):
        return native_lzf(src, length, dst, cap, step)

    out, again = np.empty(n, np.uint8), np.empty(n, np.uint8)
    size = lzf(data.ctypes.data, n, out.ctypes.data, n)
    assert 0 <= size <= n and lzf(data.ctypes.data, n, again.ctypes.data, n) == size
    assert out[:size].tobytes() == again[:size].tobytes()
    if (kind, step) in (("runs", 1), ("gradient", 1), ("gradient", 4)) and n >= 300:
        assert 0 < size < n * (0.7 if kind == "runs" else 0.9)  # repeats, and a gradient's zeros, do compress
    with h5py.File(tmp_path / "c.h5", "w") as f:
        ds = f.create_dataset("c", shape=(n,), dtype=np.uint8, chunks=(n,), compression="lzf")
        ds.id.write_direct_chunk((0,), out[:size] if size else data, filter_mask=0 if size else 1)
    with h5py.File(tmp_path / "c.h5", "r") as f:
        assert f["c"][()].tobytes() == data.tobytes()
    if size > 8:
        assert lzf(data.ctypes.data, n, out.ctypes.data, size - 1) == 0  # one byte short: does not fit
