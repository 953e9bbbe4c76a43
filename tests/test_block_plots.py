"""``qgcli plot hist`` and ``qgcli plot channels`` per block (``--semantics mx|nvfp4|onnx``, and the ``mx`` /
``nvfp4`` / ``QuantizeLinear`` groups of a run file): real PNGs through matplotlib, and the numbers drawn are
the op's own (checked here against fakequant's outputs, block by block, computed independently with NumPy).
"""
import json

import h5py
import numpy as np
import pytest

from qgcli.ops import mx as mx_ops


def png_size(path):
    from PIL import Image

    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as im:
        pixels = np.asarray(im.convert("RGB"))
        size = im.size
    assert pixels.std() > 10 and (pixels < 100).any(), "a blank image"
    return size


@pytest.fixture
def tensor(tmp_path):
    """Rows of 64 values at scales 2^-6 .. 2^5, one half-zero row and one tiny value (flushed)."""
    r = np.random.default_rng(1)
    x = (r.standard_normal((8, 64)) * np.exp2(r.integers(-6, 6, (8, 1)))).astype(np.float32)
    x[0, :32] = 0
    x[1, 5] = 1e-6
    path = tmp_path / "x.npy"
    np.save(path, x)
    return x, path


def _plot(cli, tmp_path, kind, *args, name="fig.png"):
    """``qgcli plot KIND ... --json -o FIG``: its summary and FIG's path (the run succeeded)."""
    out = tmp_path / name
    r = cli("plot", kind, *args, "--json", "-o", out)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout), out


def _blocks(a, bs):
    return np.asarray(a, np.float64).reshape(-1, bs)


def test_hist_mx_is_the_ops_grid_and_flushed_share(cli, tmp_path, tensor):
    x, path = tensor
    s, out = _plot(cli, tmp_path, "hist", "--inputs", path, "--semantics", "mx", "--mx-format", "mxfp4")
    assert png_size(out) == tuple(s["size_px"]) == (640, 660)
    res = mx_ops.mx_fake_quantize(x, format="mxfp4", block_size=32)
    xb, yb = _blocks(x, 32), _blocks(res.outputs, 32)
    assert s["blocks"] == 16 and s["block_size"] == 32 and s["points"] == x.size
    # fp4 rounds |x / scale| <= 0.25 to zero: the shaded zone holds exactly the inputs that came back 0
    assert s["in_flush_zone"] * x.size == np.sum((xb != 0) & (yb == 0))
    assert s["flushed"] == pytest.approx(np.sum((xb != 0) & (yb == 0)) / np.sum(xb != 0))
    # beyond the grid: |x| over 6 times the block's scale 2^(code - 127)
    scale = np.exp2(res.scales.astype(np.float64) - 127).reshape(-1, 1)
    assert s["beyond_grid"] == pytest.approx(np.mean(np.abs(xb / scale) > 6))
    assert s["format_range_bits"] == pytest.approx(np.log2(6 / 0.5))
    sat = np.mean((res.scales == 0) | (res.scales >= 254))
    assert s["saturated_scale_blocks"] == pytest.approx(sat)


def test_hist_of_one_block_and_out_of_range(cli, tmp_path, tensor):
    x, path = tensor
    s, out = _plot(cli, tmp_path, "hist", "--inputs", path, "--semantics", "nvfp4", "--channel", "5")
    assert s["channel"] == 5 and s["points"] == 16 and s["blocks"] == 32
    assert png_size(out) == (640, 480)  # one panel for one block
    bad = tmp_path / "bad.png"
    r = cli("plot", "hist", "--inputs", path, "--semantics", "nvfp4", "--channel", "32", "-o", bad)
    assert r.exit_code == 2 and "block 32 is out of range" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not bad.exists()


def _sqnr(xb, yb):
    with np.errstate(all="ignore"):
        err = ((yb - xb) ** 2).sum(axis=1)
        return np.where(err > 0, 10 * np.log10((xb ** 2).sum(axis=1) / err), np.inf)


@pytest.mark.parametrize("semantics, extra, bs", [("mx", ("--mx-format", "mxfp6-e2m3", "--block-size", "16"), 16),
                                                  ("nvfp4", (), 16)])
def test_channels_are_the_blocks_sqnr_and_flushed(cli, tmp_path, tensor, semantics, extra, bs):
    x, path = tensor
    ops_out = tmp_path / "fq.npz"
    r = cli("fakequant", "--inputs", path, "--semantics", semantics, *extra, "-o", ops_out, "--quiet")
    assert r.exit_code == 0, r.output
    with np.load(ops_out) as f:
        y = f["outputs"]
    s, out = _plot(cli, tmp_path, "channels", "--inputs", path, "--semantics", semantics, *extra)
    assert png_size(out) == (800, 820)
    xb, yb = _blocks(x, bs), _blocks(y, bs)
    want = _sqnr(xb, yb)
    got = np.array([np.inf if v is None else v for v in s["sqnr_db"]])
    assert s["channels"] == x.size // bs and np.allclose(got, want, rtol=0, atol=1e-9)
    nz = (xb != 0).sum(axis=1)
    flushed = np.divide(((xb != 0) & (yb == 0)).sum(axis=1), nz, out=np.zeros(len(nz)), where=nz > 0)
    assert np.array_equal(s["flushed"], flushed)
    assert s["worst_block"] == int(np.argmin(want))


def test_onnx_blocked_and_per_tensor(cli, tmp_path, tensor):
    x, path = tensor
    scales = tmp_path / "s.npy"
    np.save(scales, np.full((8, 2), 0.05, np.float32))
    s, _ = _plot(cli, tmp_path, "channels", "--x", path, "--y-scale", scales, "--semantics", "onnx", "--dtype",
                 "int4", "--axis", "1", "--block-size", "32")
    assert s["channels"] == 16 and s["op"] == "QuantizeLinear"
    s, _ = _plot(cli, tmp_path, "hist", "--x", path, "--y-scale", "0.05", "--y-zero-point", "0", "--semantics",
                 "onnx", "--dtype", "int8", name="t.png")
    # per tensor: one block; the grid is int8's, so beyond it is |x / 0.05| past -128 / 127
    u = x.astype(np.float64) / np.float32(0.05)
    assert s["blocks"] == 1 and s["beyond_grid"] == pytest.approx(np.mean((u < -128) | (u > 127)))


@pytest.mark.parametrize("args, says", [
    (("--mx-format", "mxfp4"), "only applies to --semantics mx / nvfp4 / onnx"),
    (("--semantics", "mx", "--min", "-1", "--max", "1"), "is not an operand of --semantics mx"),
    (("--semantics", "nvfp4", "--mx-format", "mxfp4"), "only applies to --semantics mx"),
    (("--semantics", "mx", "--num-bits", "4"), "does not apply to --semantics mx"),
    (("--semantics", "mx", "--block-size", "5"), "not a multiple of the block size 5"),
])
def test_refusals(cli, tmp_path, tensor, args, says):
    _, path = tensor
    out = tmp_path / "no.png"
    r = cli("plot", "hist", "--inputs", path, *args, "-o", out)
    assert r.exit_code == 2, r.output
    assert says in r.stderr and "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()


def test_run_file_groups_drawn_per_block(cli, tmp_path, tensor):
    x, _ = tensor
    run = tmp_path / "run.h5"
    with h5py.File(run, "w") as f:
        g = f.create_group("fc1/weight")
        g.attrs.update(op="mx", format="mxfp8-e5m2", block_size=32, scale_mode="rceil")
        g["inputs"] = x
        g = f.create_group("fc2/act")
        g.attrs.update(op="nvfp4", per_tensor_scale=False)
        g["inputs"] = x
        g = f.create_group("fc3/q")
        g.attrs.update(op="QuantizeLinear", dtype="uint8", axis=0)
        g["x"], g["y_scale"], g["y_zero_point"] = x, np.full(8, 0.05, np.float32), np.full(8, 128, np.uint8)
    for kind in ("hist", "channels", "staircase"):  # staircase on the element grid (tests/test_block_staircase.py)
        d = tmp_path / kind
        r = cli("plot", kind, run, "-o", f"{d}/", "--json")
        assert r.exit_code == 0, r.output
        s = json.loads(r.stdout)
        assert s["figures"] == 3 and not s["skipped"]
        for layer in s["layers"]:
            png_size(d / layer["file"])
    s, _ = _plot(cli, tmp_path, "hist", run, "--layer", "fc1/weight")
    assert s["op"] == "mx" and s["blocks"] == x.size // 32
    r = cli("plot", "hist", run, "--semantics", "mx", "-o", tmp_path / "x.png")
    assert r.exit_code == 2 and "name their op" in r.stderr


def test_channels_of_many_blocks_draw_each_runs_worst():
    """Above MAX_BLOCKS blocks, each point is a run of consecutive blocks drawn with its lowest SQNR and its
    largest flushed share."""
    from qgcli.families import mx as mx_family
    from qgcli.report import block_plots

    class Given:  # the operands a family reads, as a bundle would give them
        def __init__(self, **arrays):
            self.arrays = arrays

        def get(self, name, required=True):
            return self.arrays[name]

    x = np.random.default_rng(2).standard_normal((64, 2048)).astype(np.float32)
    formats = mx_family.group_formats({"format": "mxfp4", "block_size": 32})
    view = mx_family.block_view(formats, Given(inputs=x))
    fig = block_plots.channels(view)
    s = fig.qgcli_summary
    assert s["channels"] == 4096 and s["blocks_per_point"] == 2 and s["points"] == 2048
    res = mx_ops.mx_fake_quantize(x, format="mxfp4", block_size=32)
    sqnr = _sqnr(_blocks(x, 32), _blocks(res.outputs, 32)).reshape(-1, 2).min(axis=1)
    drawn = next(a for a in fig.axes[0].get_children() if a.get_gid() == "sqnr")
    assert np.allclose(drawn.get_data().values, sqnr, rtol=0, atol=1e-9)
