"""No silent surprises (issue 40, item 5): a range nudged away from what was asked, and NaN inputs, are said
on stderr (a note of the summary, in --json's notes too), not only by `qgcli nudge`."""
import json
import os

import numpy as np

from conftest import ROOT

NOTEBOOK = os.path.join(ROOT, "samples", "notebook.h5")
PER_CHANNEL = os.path.join(ROOT, "samples", "per_channel.h5")


def _doc(cli, *args):
    r = cli(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _notes(cli, *args):
    return _doc(cli, *args)["notes"]


def test_a_range_without_zero_is_said(cli, tmp_path):
    args = ("fakequant-grad", "--inputs", f"{NOTEBOOK}:inputs", "--gradients", f"{NOTEBOOK}:gradients",
            "--min", "0.1", "--max", "0.5", "-o")
    r = cli(*args, tmp_path / "a.h5")
    assert r.exit_code == 0, r.output
    (line,) = [ln for ln in r.stderr.splitlines() if "does not contain 0" in ln]
    assert line.startswith("note: the range does not contain 0 ([0.1, 0.5] runs as [0, 0.4])")
    assert any("does not contain 0" in n for n in _notes(cli, *args, tmp_path / "b.h5"))
    r = cli(*args, tmp_path / "c.h5", "-q")
    assert r.exit_code == 0 and r.stderr == ""  # --quiet: nothing


def test_per_channel_ranges_without_zero_are_counted(cli, tmp_path):
    notes = _notes(cli, "fakequant-grad", PER_CHANNEL, "-o", tmp_path / "g.h5")
    (note,) = [n for n in notes if "does not contain 0" in n]
    assert note.startswith("1 of 16 channel ranges does not contain 0 (ch 0 [-0.958231, -0.0513664] runs as ")


def test_an_ordinary_range_says_nothing(cli, tmp_path):
    assert _notes(cli, "fakequant-grad", NOTEBOOK, "-o", tmp_path / "g.h5") == []


def test_nudging_moves_a_range_by_more_than_half_a_step_only_when_it_lacks_zero():
    # Why one note covers both surprises of the issue: a range holding 0 moves by half a step at most.
    from qgcli import ops
    from qgcli.families.tf_fake_quant import range_warnings

    rng = np.random.default_rng(3)
    lo = -rng.uniform(0, 5, 2000).astype(np.float32)
    hi = rng.uniform(1e-3, 5, 2000).astype(np.float32)
    for bits in (2, 8):
        grid = ops.nudge(lo, hi, num_bits=bits)
        moved = np.maximum(np.abs(grid.nudged_min - lo), np.abs(grid.nudged_max - hi))
        assert np.all(moved <= 0.5 * grid.scale * (1 + 1e-5))
        assert range_warnings(grid) == []
    shifted = range_warnings(ops.nudge(np.float32(2.0), np.float32(3.0), num_bits=8))
    assert shifted and "[2, 3] runs as [0, 1]" in shifted[0]


def test_nan_inputs_are_said(cli, tmp_path):
    x = np.array([1.0, np.nan, -2.0, 3.0], np.float32)
    np.save(tmp_path / "x.npy", x)
    notes = _notes(cli, "fakequant", "--inputs", tmp_path / "x.npy", "--min", "-1", "--max", "1",
                   "-o", tmp_path / "o.npy")
    assert notes == ["inputs hold NaN (1 of 4 elements): their outputs are NaN, as TensorFlow's"]


def test_pytorch_turning_nan_and_inf_into_numbers_is_said(cli, tmp_path):
    # PyTorch's fake quant outputs finite values for NaN and +-inf (per tensor +inf -> quant_max's level, per
    # channel quant_min's): the note says how many and into what, in the forward and in the gradient run.
    x = np.array([1.0, np.nan, -2.0, np.inf, -np.inf, 0.5], np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "g.npy", np.ones_like(x))
    torch_args = ("--semantics", "torch", "--scale", "0.1", "--zero-point", "0")
    notes = _notes(cli, "fakequant", "--inputs", tmp_path / "x.npy", *torch_args, "-o", tmp_path / "o.npy")
    assert notes == ["inputs hold non-finite values, which PyTorch's fake quant turns into finite outputs without a "
                     "word (1 NaN -> 0, 1 +inf -> 25.5, 1 -inf -> 0); their gradient is 0"]
    np.save(tmp_path / "x2.npy", np.stack([x, x]))
    np.save(tmp_path / "g2.npy", np.ones((2, 6), np.float32))
    notes = _notes(cli, "fakequant-grad", "--inputs", tmp_path / "x2.npy", "--gradients", tmp_path / "g2.npy",
                   "--semantics", "torch", "--scale", "0.1,0.2", "--zero-point", "0,0", "--axis", "0",
                   "-o", tmp_path / "o.npz")
    assert [n for n in notes if "non-finite" in n] == [
        "inputs hold non-finite values, which PyTorch's fake quant turns into finite outputs without a word "
        "(2 NaN -> 0, 2 +inf -> 0, 2 -inf -> 0); their gradient is 0"]
    assert _notes(cli, "fakequant", "--inputs", NOTEBOOK + ":inputs", *torch_args, "-o", tmp_path / "n.npy") == []


def test_pytorch_reference_for_the_nonfinite_note():
    torch = __import__("pytest").importorskip("torch")
    x = torch.tensor([float("nan"), float("inf"), float("-inf")], requires_grad=True)
    y = torch.fake_quantize_per_tensor_affine(x, 0.1, 0, 0, 255)
    y.sum().backward()
    assert y.tolist() == [0.0, 25.5, 0.0] and x.grad.tolist() == [0.0, 0.0, 0.0]
    pc = torch.fake_quantize_per_channel_affine(torch.stack([x.detach()] * 2), torch.tensor([0.1, 0.2]),
                                                torch.zeros(2, dtype=torch.int32), 0, 0, 255)
    assert pc.tolist() == [[0.0, 0.0, 0.0]] * 2


def test_a_range_without_zero_is_said_when_streamed_and_in_a_run_file(cli, tmp_path):
    import shutil

    import h5py

    rng = np.random.default_rng(0)
    with h5py.File(tmp_path / "big.h5", "w") as f:  # 4 MiB of inputs: past --memory-limit 1M, streamed
        f["inputs"] = rng.uniform(0, 1, (1024, 1024)).astype(np.float32)
        f["gradients"] = np.ones((1024, 1024), np.float32)
        f["min"], f["max"] = np.float32(0.1), np.float32(0.5)
    notes = _notes(cli, "fakequant-grad", tmp_path / "big.h5", "--memory-limit", "1M", "-o", tmp_path / "g.h5")
    assert any(n.startswith("streamed from disk") for n in notes)
    assert any("the range does not contain 0 ([0.1, 0.5] runs as [0, 0.4])" in n for n in notes)
    shutil.copy(os.path.join(ROOT, "samples", "run.h5"), tmp_path / "run.h5")
    with h5py.File(tmp_path / "run.h5", "a") as f:
        f["step_000100/head/logits_quant"].attrs.update({"min": 0.1, "max": 0.5})
    r = cli("fakequant-grad", tmp_path / "run.h5", "-o", tmp_path / "r.h5")
    assert r.exit_code == 0, r.output
    assert "note: step_000100/head/logits_quant: the range does not contain 0 ([0.1, 0.5] runs as [0, 0.4])" in r.stderr
    assert _notes(cli, "fakequant-grad", os.path.join(ROOT, "samples", "run.h5"), "-o", tmp_path / "s.h5") == []


def test_report_says_non_finite_inputs_and_a_range_without_zero(cli, tmp_path):
    x = np.array([1.0, np.nan, -2.0, np.inf, -np.inf, 0.5], np.float32)
    np.save(tmp_path / "x.npy", x)
    r = cli("report", "--inputs", tmp_path / "x.npy", "--min", "-1", "--max", "1")
    assert r.exit_code == 0, r.output
    assert "note: inputs hold non-finite values: 1 NaN, 1 +inf, 1 -inf (of 6 elements)" in r.stderr
    r = cli("report", "--inputs", tmp_path / "x.npy", "--min", "0.1", "--max", "0.5", "--json")
    assert any(n.startswith("the range does not contain 0 ([0.1, 0.5] runs as [0, 0.4])")
               for n in json.loads(r.stdout)["notes"])
    r = cli("report", NOTEBOOK, "--json")
    assert json.loads(r.stdout)["notes"] == []


def test_tensorflow_clipping_infinities_is_said(cli, tmp_path):
    # +-inf inputs count as clipped; the note gives how many NaN and +-inf there are and what TensorFlow's op
    # makes of them (checked against TensorFlow below), on stderr and in --json, not with --quiet.
    x = np.array([np.nan, np.inf, -np.inf, 0.5, np.inf], np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "g.npy", np.ones_like(x))
    grad = ("fakequant-grad", "--inputs", tmp_path / "x.npy", "--gradients", tmp_path / "g.npy", "--min", "-1",
            "--max", "1")
    said = ("inputs hold non-finite values (1 NaN, 2 +inf, 1 -inf of 5 elements): TensorFlow's op outputs NaN for "
            "NaN and clips +inf and -inf to the nudged range (+inf -> 1.00392, -inf -> -0.996078; counted as "
            "clipped), with an input gradient of 0")
    assert _notes(cli, *grad, "--variant", "args", "-o", tmp_path / "a.npy") == [said]
    assert _notes(cli, *grad, "--variant", "vars", "-o", tmp_path / "v.npz") == [
        said + "; their dy goes to the gradient of max (+inf) and of min (-inf)"]
    with np.load(tmp_path / "v.npz") as v:
        assert v["backprops_wrt_input"].tolist() == [0, 0, 0, 1, 0]
        assert float(v["backprop_wrt_max"]) == 2 and float(v["backprop_wrt_min"]) == 1
    r = cli(*grad, "--variant", "vars", "-o", tmp_path / "s.npz")
    assert r.exit_code == 0 and said in " ".join(r.stderr.split())
    r = cli(*grad, "--variant", "vars", "-o", tmp_path / "q.npz", "--quiet")
    assert r.exit_code == 0 and r.stderr == ""
    # per channel: the edges are each channel's; one sign only
    np.save(tmp_path / "x2.npy", np.array([[0.5, -np.inf], [0.25, 0.5]], np.float32))
    notes = _notes(cli, "fakequant", "--inputs", tmp_path / "x2.npy", "--min", "-1,-2", "--max", "1,2",
                   "-o", tmp_path / "o2.npy")
    assert notes == ["inputs hold non-finite values (1 -inf of 4 elements): TensorFlow's op clips -inf to the "
                     "nudged range (-inf -> its channel's nudged min; counted as clipped), with an input gradient "
                     "of 0; their dy goes to the gradient of min (-inf)"]
    # finite inputs that clip say nothing of infinities
    np.save(tmp_path / "x3.npy", np.array([5.0, -5.0, 0.5], np.float32))
    assert _notes(cli, "fakequant", "--inputs", tmp_path / "x3.npy", "--min", "-1", "--max", "1",
                  "-o", tmp_path / "o3.npy") == []


def test_tensorflow_reference_for_the_infinity_note():
    tf = __import__("pytest").importorskip("tensorflow")
    x = tf.constant([np.nan, np.inf, -np.inf, 0.5, np.inf], tf.float32)
    y = tf.quantization.fake_quant_with_min_max_args(x, -1.0, 1.0).numpy()
    assert np.isnan(y[0]) and y[1:3].tolist() == [np.float32(1.0039216), np.float32(-0.9960785)]
    dx = tf.raw_ops.FakeQuantWithMinMaxArgsGradient(gradients=tf.ones(5), inputs=x, min=-1.0, max=1.0).numpy()
    assert dx.tolist() == [0, 0, 0, 1, 0]
    dx, dmin, dmax = tf.raw_ops.FakeQuantWithMinMaxVarsGradient(gradients=tf.ones(5), inputs=x,
                                                                min=tf.constant(-1.0), max=tf.constant(1.0))
    assert dx.numpy().tolist() == [0, 0, 0, 1, 0] and float(dmin) == 1 and float(dmax) == 2


def _nonfinite_bundle(folder, kinds):
    """4 MiB of inputs (past --memory-limit 1M) with NaN (and +-inf) at block edges, as .h5 and as a Zarr store."""
    import h5py

    rng = np.random.default_rng(5)
    x = rng.uniform(-1.5, 1.5, (1024, 1024)).astype(np.float32)
    x[[0, 16, 32, 511, 1023], [0, 0, 0, 1023, 5]] = np.nan  # rows 16, 32: first rows of a Zarr block
    if kinds == "nan and inf":
        x[[17, 700, 1023], [3, 3, 1023]] = (np.inf, np.inf, -np.inf)
    arrays = {"inputs": x, "gradients": rng.standard_normal(x.shape).astype(np.float32),
              "min": np.float32(-1), "max": np.float32(1),
              "channel_min": -rng.uniform(0.5, 1, 1024).astype(np.float32),
              "channel_max": rng.uniform(0.5, 1, 1024).astype(np.float32)}
    with h5py.File(folder / "big.h5", "w") as f:
        for name, value in arrays.items():
            f[name] = value
    try:
        import zarr
    except ImportError:  # the CI floor: the HDF5 half only
        return str(folder / "big.h5"), None
    group = zarr.create_group(str(folder / "big.zarr"), zarr_format=3)
    for name in ("inputs", "gradients"):
        group.create_array(name, data=arrays[name], chunks=(16, 1024))
    return str(folder / "big.h5"), str(folder / "big.zarr")


@__import__("pytest").mark.parametrize("kinds", ["nan and inf", "nan"])
@__import__("pytest").mark.parametrize("command, variant", [("fakequant-grad", "vars"),
                                                            ("fakequant-grad", "per-channel"),
                                                            ("fakequant-grad", "args"), ("fakequant", "vars")])
def test_streamed_tensors_say_their_nan_and_inf_as_in_memory(cli, tmp_path, command, variant, kinds):
    # Streamed from disk in blocks (HDF5 read in order, Zarr blocks computed apart), the inputs' NaN and +-inf
    # are counted as each block is read: the same note as in memory, not silence.
    h5, store = _nonfinite_bundle(tmp_path, kinds)
    ranges = {"vars": ("--min", f"{h5}:min", "--max", f"{h5}:max"),
              "per-channel": ("--min", f"{h5}:channel_min", "--max", f"{h5}:channel_max"),
              "args": ("--min", "-1", "--max", "1")}[variant]
    args = ["--variant", variant, *ranges]

    def operands(where):
        src = h5 if where == "h5" else store
        return ["--inputs", f"{src}:inputs"] + (["--gradients", f"{src}:gradients"] if command != "fakequant" else [])

    def said(notes):
        return [n for n in notes if n.startswith("inputs hold")]

    def counted(doc):  # --json's statistics that a stream counts too (the clipped shares it does not)
        return {k: doc["statistics"][k] for k in ("elements", "nan")}

    memory_doc = _doc(cli, command, *operands("h5"), *args, "-o", tmp_path / "m.h5")
    in_memory = memory_doc["notes"]
    assert not any(n.startswith(("streamed", "computed in")) for n in in_memory)
    expected = said(in_memory)
    assert len(expected) == 1 and ("(5 NaN, 2 +inf, 1 -inf of 1048576 elements)" if kinds != "nan" else
                                     "(5 of 1048576 elements)") in expected[0]
    assert counted(memory_doc) == {"elements": 1048576, "nan": 5 / 1048576}
    streamed_doc = _doc(cli, command, *operands("h5"), *args, "--memory-limit", "1M", "-o", tmp_path / "s.h5")
    streamed = streamed_doc["notes"]
    assert any(n.startswith("streamed from disk") for n in streamed)
    assert said(streamed) == expected and counted(streamed_doc) == counted(memory_doc)
    if store is None:
        return
    blocks_doc = _doc(cli, command, *operands("zarr"), *args, "--memory-limit", "1M", "-o", tmp_path / "b.zarr")
    blocks = blocks_doc["notes"]
    assert any(n.startswith("computed in") and "block" in n for n in blocks), blocks
    assert said(blocks) == expected and counted(blocks_doc) == counted(memory_doc)


def test_streamed_inputs_with_both_infinities_in_one_block_are_counted_without_a_warning(cli, tmp_path):
    # The per-block check summed the block: +inf and -inf in one block (inf - inf) or values whose float32 sum
    # overflows printed numpy's RuntimeWarning on stderr (an error under pytest) instead of just counting.
    import h5py

    x = np.full((1024, 1024), 3e38, np.float32)  # every block's sum overflows
    x[3, 3], x[3, 4], x[900, 1] = np.inf, -np.inf, np.nan
    with h5py.File(tmp_path / "b.h5", "w") as f:
        f["inputs"], f["min"], f["max"] = x, np.float32(-1), np.float32(1)
    streamed = _notes(cli, "fakequant", str(tmp_path / "b.h5"), "--memory-limit", "1M", "-o", tmp_path / "s.h5")
    assert any(n.startswith("streamed from disk") for n in streamed)
    in_memory = _notes(cli, "fakequant", str(tmp_path / "b.h5"), "-o", tmp_path / "m.h5")
    said = [n for n in in_memory if n.startswith("inputs hold")]
    assert said and "(1 NaN, 1 +inf, 1 -inf of 1048576 elements)" in said[0]
    assert [n for n in streamed if n.startswith("inputs hold")] == said


def _bn_bundle(folder):
    """bn-grad operands of 2 MiB (past --memory-limit 1M) whose x holds a NaN and an inf, y_backprop a NaN, as .h5
    and as a Zarr store (None on the CI floor)."""
    import h5py

    rng = np.random.default_rng(3)
    x = rng.standard_normal((512, 4, 4, 64)).astype(np.float32)
    x[3, 2, 1, 5], x[400, 1, 0, 7] = np.nan, np.inf
    dy = rng.standard_normal(x.shape).astype(np.float32)
    dy[200, 0, 0, 9] = np.nan  # x_backprop's NaN in inference too (it does not depend on x there)
    arrays = {"y_backprop": dy, "x": x,
              "scale": np.ones(64, np.float32), "reserve_space_1": np.zeros(64, np.float32),
              "reserve_space_2": np.ones(64, np.float32)}
    with h5py.File(folder / "bn.h5", "w") as f:
        for name, value in arrays.items():
            f[name] = value
    try:
        import zarr
    except ImportError:
        return str(folder / "bn.h5"), None
    group = zarr.create_group(str(folder / "bn.zarr"), zarr_format=3)
    for name, value in arrays.items():
        group.create_array(name, data=value, chunks=(32, 4, 4, 64) if value.ndim == 4 else value.shape)
    return str(folder / "bn.h5"), str(folder / "bn.zarr")


@__import__("pytest").mark.parametrize("training", [True, False])
def test_streamed_bn_grad_says_its_nan_and_inf_as_in_memory(cli, tmp_path, training):
    # bn-grad in memory notes the NaN/inf of x_backprop and of the per-channel outputs; streamed from disk in
    # blocks (HDF5 in order, Zarr blocks computed apart) it said nothing.  Counted as its blocks are written.
    h5, store = _bn_bundle(tmp_path)
    mode = [] if training else ["--no-is-training"]

    def said(notes):
        return [n for n in notes if "non-finite" in n]

    in_memory = _notes(cli, "bn-grad", h5, *mode, "-o", tmp_path / "m.h5")
    assert not any(n.startswith(("streamed", "computed in")) for n in in_memory)
    expected = said(in_memory)
    with __import__("h5py").File(tmp_path / "m.h5") as f:  # the counts are those of the outputs written
        counts = {k: int((~np.isfinite(f[k][()])).sum()) for k in ("x_backprop", "scale_backprop", "offset_backprop")}
    assert expected == [f"{k} has {v} non-finite values (NaN/inf propagate as in TensorFlow)"
                        for k, v in counts.items() if v]
    assert counts["x_backprop"] > 0 and counts["scale_backprop"] > 0
    streamed = _notes(cli, "bn-grad", h5, *mode, "--memory-limit", "1M", "-o", tmp_path / "s.h5")
    assert any(n.startswith("streamed from disk") for n in streamed), streamed
    assert said(streamed) == expected
    if store is None:
        return
    blocks = _notes(cli, "bn-grad", store, *mode, "--memory-limit", "1M", "-o", tmp_path / "b.zarr")
    assert any(n.startswith("computed in") for n in blocks), blocks
    assert said(blocks) == expected
