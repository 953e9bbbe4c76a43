"""Out-of-core streaming gives bit-for-bit the in-memory results, with blocks far smaller than the tensor."""
import h5py
import numpy as np
import pytest

from qgcli import ops
from qgcli.execution import memory
from qgcli.execution.blocks import hdf5 as streaming
from qgcli.errors import QgcliError
from qgcli.ops import fake_quant
from qgcli.storage.io import physical_memory

f32 = np.float32


def _file(tmp_path, **arrays):
    path = tmp_path / "in.h5"
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            f[k] = v
    return path


@pytest.mark.parametrize("shape, per_channel", [((37, 29, 61), False), ((9, 13, 11, 48), True),
                                                ((5001, 3), True), ((60001,), False)])
def test_streamed_gradient_equals_in_memory(kernels, tmp_path, shape, per_channel):
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * 2).astype(f32)
    g = (rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, shape))).astype(f32)
    depth = shape[-1] if per_channel else None
    mn = -rng.uniform(0.5, 2, depth).astype(f32) if per_channel else f32(-1.5)
    mx = rng.uniform(0.5, 2, depth).astype(f32) if per_channel else f32(1.0)
    if per_channel:
        want = ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, mn, mx)
        grid, _ = fake_quant._prepare_per_channel(x, mn, mx, 8, False, -1, np)
    else:
        want = ops.fake_quant_with_min_max_vars_gradient(g, x, mn, mx)
        grid = fake_quant._prepare_per_tensor(x, mn, mx, 8, False, np)
    src = _file(tmp_path, gradients=g, inputs=x)
    with h5py.File(src, "r") as f, h5py.File(tmp_path / "out.h5", "w") as out:
        sums = streaming.fake_quant_gradient(f["gradients"], f["inputs"], grid, out,
                                             kind="chip" if per_channel else "flat", attrs={}, compression=None,
                                             budget=1 << 20)  # ~1 MiB: dozens of blocks
        dx = out["backprops_wrt_input"][()]
    np.testing.assert_array_equal(dx.view(np.uint32), want[0].view(np.uint32))
    np.testing.assert_array_equal(np.asarray(sums["backprop_wrt_min"]).view(np.uint32), want[1].view(np.uint32))
    np.testing.assert_array_equal(np.asarray(sums["backprop_wrt_max"]).view(np.uint32), want[2].view(np.uint32))


def test_streamed_forward_equals_in_memory(kernels, tmp_path):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((41, 7, 5, 16)) * 3).astype(f32)
    mn, mx = -np.linspace(0.5, 2, 16).astype(f32), np.linspace(0.7, 3, 16).astype(f32)
    grid, _ = fake_quant._prepare_per_channel(x, mn, mx, 4, True, -1, np)
    src = _file(tmp_path, inputs=x)
    with h5py.File(src, "r") as f, h5py.File(tmp_path / "out.h5", "w") as out:
        streaming.fake_quant_forward(f["inputs"], grid, False, out, per_channel=True, attrs={"op": "x"},
                                     compression="gzip", budget=1 << 20)
        got = out["outputs"][()]
        assert out["outputs"].compression == "gzip"
    want = ops.fake_quant_with_min_max_vars_per_channel(x, mn, mx, num_bits=4, narrow_range=True)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("text, expected", [("2G", 2 << 30), ("512m", 512 << 20), ("1.5GiB", int(1.5 * (1 << 30))),
                                            ("3000000", 3000000)])
def test_memory_limit_parsing(text, expected):
    assert memory.parse_memory_limit(text) == expected


def test_memory_limit_default_and_percent():
    assert memory.parse_memory_limit(None) == physical_memory() // 4
    assert memory.parse_memory_limit("50%") == physical_memory() // 2


@pytest.mark.parametrize("text", ["lots", "-1G", "2X", "10"])
def test_memory_limit_errors_name_the_option(text):
    with pytest.raises(QgcliError, match="--memory-limit"):
        memory.parse_memory_limit(text)


def test_one_memory_rule_for_opened_datasets_and_discovered_shapes(tmp_path):
    """The single-bundle plan (opened datasets) and the run file's check (shapes from discovery) ask the same
    rule: the large operands as read, at least 4 bytes an element, twice over."""
    path = _file(tmp_path, gradients=np.zeros((10, 6), np.float16), inputs=np.zeros((10, 6), f32))
    with h5py.File(path, "r") as f:
        need = memory.need(memory.sizes([f["gradients"], f["inputs"]]))
        shapes = {name: (f[name].shape, f[name].dtype.str) for name in f}
    assert need == 2 * (60 * 4 + 60 * 4)
    assert memory.shapes_fit(shapes, ("gradients", "inputs"), need) is True
    assert memory.shapes_fit(shapes, ("gradients", "inputs"), need - 1) is False
    assert memory.shapes_fit(shapes, ("gradients", "x"), need) is None  # not known there: the plan decides


@pytest.mark.parametrize("data_format, training, dtype", [("NHWC", True, f32), ("NCHW", True, f32),
                                                          ("NHWC", False, f32), ("NCDHW", True, np.float16)])
def test_streamed_batch_norm_equals_in_memory(kernels, tmp_path, data_format, training, dtype):
    rng = np.random.default_rng(7)
    shape = (23, 5, 9, 7) if len(data_format) == 4 else (11, 5, 3, 4, 6)
    channels = shape[1] if data_format[1] == "C" else shape[-1]
    x = (rng.standard_normal(shape) * 2 + 1).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    axes = tuple(i for i in range(len(shape)) if i != (1 if data_format[1] == "C" else len(shape) - 1))
    mean = x.astype(np.float64).mean(axis=axes).astype(f32)
    var = x.astype(np.float64).var(axis=axes).astype(f32)
    scale = rng.uniform(0.5, 2, channels).astype(f32)
    kw = dict(epsilon=1e-3, data_format=data_format, is_training=training)
    want = ops.fused_batch_norm_grad(dy, x, scale, mean, var, **kw)
    src = _file(tmp_path, y_backprop=dy, x=x)
    with h5py.File(src, "r") as f, h5py.File(tmp_path / "out.h5", "w") as out:
        small = streaming.batch_norm_gradient(f["y_backprop"], f["x"], scale, mean, var, out,
                                              variance_kind="variance", attrs={}, compression=None,
                                              budget=1 << 20, **kw)
        dx = out["x_backprop"][()]
    assert dx.dtype == want[0].dtype
    # float64 channel sums are added in another grouping than in memory: equal to the last float64 bit,
    # so the float32 results agree to within one unit in the last place (almost always exactly).
    np.testing.assert_array_max_ulp(dx.astype(f32), want[0].astype(f32), maxulp=1)
    np.testing.assert_array_max_ulp(small["scale_backprop"], want[1], maxulp=1)
    np.testing.assert_array_equal(small["offset_backprop"], want[2])


# --- through the CLI -------------------------------------------------------------------------------------

@pytest.fixture
def big_bundle(tmp_path):
    """Per-channel fake-quant and batch-norm operands of 2 MiB each: above a 1M memory limit."""
    rng = np.random.default_rng(11)
    shape = (64, 16, 32, 16)
    x = (rng.standard_normal(shape) * 2).astype(f32)
    g = rng.standard_normal(shape).astype(f32)
    path = tmp_path / "big.h5"
    with h5py.File(path, "w") as f:
        f["inputs"], f["gradients"], f["x"], f["y_backprop"] = x, g, x, g
        f["min"], f["max"] = -np.linspace(0.5, 3, 16).astype(f32), np.linspace(0.5, 3, 16).astype(f32)
        f["scale"] = np.linspace(0.5, 1.5, 16).astype(f32)
        f["reserve_space_1"] = x.mean(axis=(0, 1, 2)).astype(f32)
        f["reserve_space_2"] = x.var(axis=(0, 1, 2)).astype(f32)
    return path


def _read(path):
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in f}, {k: f[k].compression for k in f}


@pytest.mark.parametrize("command", ["fakequant", "fakequant-grad"])
def test_cli_streams_when_inputs_exceed_the_limit(cli, big_bundle, tmp_path, command):
    import json

    streamed, memory = tmp_path / "s.h5", tmp_path / "m.h5"
    r = cli(command, big_bundle, "-o", streamed, "--memory-limit", "1M", "--json", "--compression", "gzip")
    assert r.exit_code == 0, r.output
    assert "streamed" in json.loads(r.stdout)["notes"][0]
    r = cli(command, big_bundle, "-o", memory, "-q")
    assert r.exit_code == 0, r.output
    (a, comp), (b, _) = _read(streamed), _read(memory)
    assert set(a) == set(b)
    for name in b:
        np.testing.assert_array_equal(a[name].view(np.uint32), b[name].view(np.uint32), err_msg=name)
    assert "gzip" in comp.values()


def test_cli_streams_bn_grad(cli, big_bundle, tmp_path):
    r = cli("bn-grad", big_bundle, "-o", tmp_path / "s.h5", "--memory-limit", "1M", "-q")
    assert r.exit_code == 0, r.output
    r = cli("bn-grad", big_bundle, "-o", tmp_path / "m.h5", "-q")
    assert r.exit_code == 0, r.output
    (a, _), (b, _) = _read(tmp_path / "s.h5"), _read(tmp_path / "m.h5")
    for name in b:
        np.testing.assert_array_max_ulp(a[name], b[name], maxulp=1)


def test_cli_streaming_needs_an_h5_output(cli, big_bundle, tmp_path):
    r = cli("fakequant-grad", big_bundle, "-o", tmp_path / "s.npz", "--memory-limit", "1M")
    assert r.exit_code == 2 and "--output" in r.stderr and ".h5" in r.stderr
    assert not (tmp_path / "s.npz").exists()
    r = cli("fakequant-grad", big_bundle, "-o", tmp_path / "s.h5", "--memory-limit", "a lot")
    assert r.exit_code == 2 and "--memory-limit" in r.stderr


@pytest.mark.parametrize("args", [("fakequant-grad",), ("fakequant",), ("bn-grad",),
                                  ("fakequant-grad", "--variant", "vars", "--min", "-2", "--max", "2"),
                                  ("fakequant-grad", "--variant", "args", "--min", "-2", "--max", "2")])
def test_a_compressed_stream_never_hands_over_a_buffer_still_being_compressed(cli, big_bundle, tmp_path,
                                                                              monkeypatch, args):
    """A compressed output reads each block until the write after it returns (qgcli.storage.hdf5.chunks.ChunkWriter),
    so two blocks written one after the other must never share memory: the next block is read elsewhere."""
    handed = []
    write = streaming._Output.write

    def recording(self, start, block):
        if self.keeps_blocks and handed:
            assert not np.shares_memory(handed[-1], block), f"block at {start} overwrote the one before"
        handed.append(block)
        return write(self, start, block)

    monkeypatch.setattr(streaming._Output, "write", recording)
    r = cli(*args, big_bundle, "-o", tmp_path / "s.h5", "--memory-limit", "1M", "--compression", "lzf", "-q")
    assert r.exit_code == 0, r.output
    assert len(handed) > 2


@pytest.mark.parametrize("layout", [{}, {"chunks": (3, 16, 32, 16), "compression": "gzip"}])
@pytest.mark.parametrize("command", ["fakequant-grad", "bn-grad"])
def test_streams_read_plain_and_chunked_inputs_alike(cli, big_bundle, tmp_path, layout, command):
    """Plain (contiguous) inputs are read one block ahead with os.preadv; chunked, compressed ones by h5py
    in turn: the same outputs, bit for bit."""
    bundle = tmp_path / "copy.h5"
    with h5py.File(big_bundle, "r") as src, h5py.File(bundle, "w") as dst:
        for name in src:
            data = src[name][()]
            dst.create_dataset(name, data=data, **(layout if data.ndim == 4 else {}))
        assert (dst["x"].chunks is None) == (not layout)
    outs = []
    for source, limit in ((bundle, "1M"), (big_bundle, "8G")):
        outs.append(tmp_path / f"{len(outs)}.h5")
        r = cli(command, source, "-o", outs[-1], "--memory-limit", limit, "-q")
        assert r.exit_code == 0, r.output
    (a, _), (b, _) = _read(outs[0]), _read(outs[1])
    for name in b:
        if command == "bn-grad":
            np.testing.assert_array_max_ulp(a[name], b[name], maxulp=1)  # float64 sums grouped otherwise
        else:
            np.testing.assert_array_equal(a[name].view(np.uint32), b[name].view(np.uint32), err_msg=name)


def test_a_file_cut_while_it_is_streamed_fails_on_the_block_it_lost(tmp_path):
    """A file that shrinks under a run (another process truncates it) gives a FileFormatError naming the
    dataset when the block read ahead comes up short, not zeros."""
    path = _file(tmp_path, x=np.arange(64 * 1024, dtype=f32).reshape(64, 1024))
    with h5py.File(path, "r") as f:
        read = streaming._Reader(f["x"], 8)
        assert read.where is not None  # a plain dataset: read ahead with os.preadv
        assert np.array_equal(read(0, 8), np.arange(8 * 1024, dtype=f32).reshape(8, 1024))
        read.ahead[2].result()  # block [8, 16) is in; the rest of the file goes
        with open(path, "r+b") as fh:
            fh.truncate(f["x"].id.get_offset() + 20 * 1024 * 4)
        assert read(8, 16)[0, 0] == 8 * 1024
        with pytest.raises(QgcliError, match="'/x'.*ends inside its data"):
            read(16, 24)


@pytest.mark.parametrize("training, passes", [(True, 2), (False, 1)])
def test_inference_batch_norm_streams_in_one_pass(cli, big_bundle, tmp_path, monkeypatch, training, passes):
    """Inference's x_backprop does not depend on the per-channel sums: both inputs are read once, the sums
    taken block by block before x_backprop overwrites dy; training reads them twice."""
    read = {}
    call = streaming._Reader.__call__

    def counting(self, start, stop):
        block = call(self, start, stop)
        read[self.ds.name] = read.get(self.ds.name, 0) + len(block)
        return block

    monkeypatch.setattr(streaming._Reader, "__call__", counting)
    mode = "--is-training" if training else "--no-is-training"
    r = cli("bn-grad", big_bundle, mode, "-o", tmp_path / "s.h5", "--memory-limit", "1M", "--json")
    assert r.exit_code == 0, r.output
    assert ("one pass" if passes == 1 else "two passes") in r.stdout
    assert read == {"/x": 64 * passes, "/y_backprop": 64 * passes}
    monkeypatch.setattr(streaming._Reader, "__call__", call)
    r = cli("bn-grad", big_bundle, mode, "-o", tmp_path / "m.h5", "-q")
    assert r.exit_code == 0, r.output
    (a, _), (b, _) = _read(tmp_path / "s.h5"), _read(tmp_path / "m.h5")
    for name in b:
        np.testing.assert_array_max_ulp(a[name], b[name], maxulp=1)
