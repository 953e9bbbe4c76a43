"""The block formats (--semantics mx, nvfp4, onnx) beyond --memory-limit: computed in row blocks of the first axis
(issue 38), from HDF5 datasets, .npy files and Zarr stores, every output bit for bit the in-memory run's.

The tensors (1024 x 192 float32, 0.75 MiB: more than --memory-limit 1M allows with its working copies) stream in
blocks of a few dozen rows, so a block size along the first axis (16, 32, ONNX's 14 with a partial last block)
must be respected by the cut for the scales to come out the same; NVFP4's per-tensor scale takes a pass of its
own first.  The real CLI in-process (and in a subprocess for the peak RSS)."""
import h5py
import numpy as np
import pytest

ROWS, COLS = 1024, 192


def _tensor(rng):
    """Rows of very different magnitudes (scales from 2^-8 to 2^7), zeros, subnormals and values beyond fp4/fp8's
    range: every branch of the encoders, finite (a NaN or an infinity makes NVFP4's per-tensor scale NaN)."""
    x = rng.standard_normal((ROWS, COLS)).astype(np.float32) * np.exp2(rng.integers(-8, 8, (ROWS, 1))).astype(
        np.float32)
    x[5, :32] = 0
    x[9, 40:48] = np.float32(1e-40)
    x[13, 7] = 1e6
    return x


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    folder = tmp_path_factory.mktemp("block-streams")
    rng = np.random.default_rng(38)
    x = _tensor(rng)
    g = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    with h5py.File(folder / "b.h5", "w") as f:
        f["inputs"] = x
        f["x"] = x
        f["gradients"] = g
        f["scale"] = np.float32(0.05)
        f["zp"] = np.uint8(3)
        f["scale_rows"] = (np.abs(rng.standard_normal(ROWS)) + 0.01).astype(np.float32)  # per axis 0
        f["zp_rows"] = rng.integers(-5, 5, ROWS).astype(np.int8)
        f["scale_blocks0"] = (np.abs(rng.standard_normal((-(-ROWS // 14), COLS))) + 0.01).astype(np.float32)
        f["scale_blocks1"] = (np.abs(rng.standard_normal((ROWS, COLS // 12))) + 0.01).astype(np.float32)
    nan = x.copy()
    nan[100, 3] = np.nan
    np.save(folder / "x.npy", x)
    np.save(folder / "nan.npy", nan)
    return folder


def _digest(a):
    """The sha256 of an array's bytes: bit for bit comparisons with short assertion messages.  NaN matched with
    NaN, as the golden cases match them: which NaN a float32 multiply of two NaNs gives depends on NumPy's SIMD
    loops and the arrays' alignment on NumPy 1.x (NVFP4's outputs under a NaN per-tensor scale)."""
    import hashlib

    a = np.atleast_1d(np.asarray(a))
    if a.dtype.kind == "f":
        a = np.where(np.isnan(a), np.array(np.nan, a.dtype), a)
    return hashlib.sha256(a.tobytes()).hexdigest()


def _datasets(path):
    """Each dataset's shape, dtype, :func:`_digest` and small-float type attributes."""
    with h5py.File(path, "r") as f:
        return {k: (f[k].shape, f[k].dtype, _digest(f[k][()]),
                    {a: f[k].attrs[a] for a in f[k].attrs if a.endswith("_dtype")}) for k in f}


#: (name, command, options): each in memory and over --memory-limit 1M
CASES = [
    ("mx-last-axis", "fakequant", ("--semantics", "mx")),
    ("mx-axis0-fp4-rceil", "fakequant", ("--semantics", "mx", "--axis", "0", "--block-size", "16",
                                         "--mx-format", "mxfp4", "--scale-mode", "rceil")),
    ("mx-axis0-e5m2", "fakequant", ("--semantics", "mx", "--axis", "0", "--mx-format", "mxfp8-e5m2")),
    ("nvfp4-two-passes", "fakequant", ("--semantics", "nvfp4",)),
    ("nvfp4-axis0", "fakequant", ("--semantics", "nvfp4", "--axis", "0")),
    ("nvfp4-no-tensor-scale", "fakequant", ("--semantics", "nvfp4", "--no-per-tensor-scale")),
    ("onnx-per-tensor", "fakequant", ("--semantics", "onnx", "--y-scale", "b.h5:scale", "--y-zero-point",
                                      "b.h5:zp")),
    ("onnx-per-axis0", "fakequant", ("--semantics", "onnx", "--y-scale", "b.h5:scale_rows", "--y-zero-point",
                                     "b.h5:zp_rows", "--axis", "0")),
    ("onnx-blocked-axis0-partial", "fakequant", ("--semantics", "onnx", "--y-scale", "b.h5:scale_blocks0",
                                                 "--axis", "0", "--block-size", "14", "--dtype", "float8e4m3fn")),
    ("onnx-blocked-axis1", "fakequant", ("--semantics", "onnx", "--y-scale", "b.h5:scale_blocks1", "--axis", "1",
                                         "--block-size", "12", "--dtype", "int4")),
    ("mx-grad", "fakequant-grad", ("--semantics", "mx", "--axis", "0")),
    ("nvfp4-grad", "fakequant-grad", ("--semantics", "nvfp4")),
    ("onnx-grad-masked", "fakequant-grad", ("--semantics", "onnx", "--y-scale", "b.h5:scale_rows", "--axis", "0",
                                            "--dtype", "int8", "--estimator", "masked-ste")),
]


@pytest.mark.parametrize("name,command,options", CASES, ids=[c[0] for c in CASES])
def test_hdf5_beyond_the_limit_streams_with_the_in_memory_bits(cli, bundle, monkeypatch, name, command, options):
    monkeypatch.chdir(bundle)
    memory = cli(command, "b.h5", *options, "-o", f"{name}-memory.h5", "-q")
    assert memory.exit_code == 0, memory.output
    streamed = cli(command, "b.h5", *options, "-o", f"{name}-streamed.h5", "--memory-limit", "1M", "--json")
    assert streamed.exit_code == 0, streamed.output
    assert "streamed from disk" in streamed.output
    # NVFP4's per-tensor scale (the forward's) takes the tensor's amax first
    assert ("two passes" in streamed.output) == (name in ("nvfp4-two-passes", "nvfp4-axis0"))
    expected = _datasets(bundle / f"{name}-memory.h5")
    got = _datasets(bundle / f"{name}-streamed.h5")
    assert sorted(got) == sorted(expected)
    for key in expected:
        assert got[key] == expected[key], key


@pytest.mark.parametrize("compression", ["gzip", "lzf"])
def test_compressed_streams_write_whole_chunk_rows_of_every_output(cli, bundle, monkeypatch, compression):
    """Outputs, scales (a row per 32 rows along axis 0) and codes each in whole chunk rows, compressed."""
    monkeypatch.chdir(bundle)
    options = ("--semantics", "mx", "--axis", "0", "--compression", compression)
    assert cli("fakequant", "b.h5", *options, "-o", f"c-{compression}-memory.h5", "-q").exit_code == 0
    r = cli("fakequant", "b.h5", *options, "-o", f"c-{compression}-streamed.h5", "-q", "--memory-limit", "1M")
    assert r.exit_code == 0, r.output
    assert _datasets(bundle / f"c-{compression}-streamed.h5") == _datasets(bundle / f"c-{compression}-memory.h5")
    with h5py.File(bundle / f"c-{compression}-streamed.h5", "r") as f:
        assert f["scales"].compression == compression and f["scales"].chunks[0] * 32 == f["outputs"].chunks[0]


def test_npy_inputs_stream_and_nvfp4_nan_note_counts_the_whole_tensor(cli, bundle, monkeypatch):
    """A .npy tensor streams too; a NaN makes torchao's per-tensor scale NaN: every output NaN, said once for
    the whole tensor as in memory."""
    monkeypatch.chdir(bundle)
    memory = cli("fakequant", "--inputs", "nan.npy", "--semantics", "nvfp4", "-o", "nan-memory.h5", "--json")
    streamed = cli("fakequant", "--inputs", "nan.npy", "--semantics", "nvfp4", "-o", "nan-streamed.h5", "--json",
                   "--memory-limit", "1M")
    assert memory.exit_code == 0 and streamed.exit_code == 0, streamed.output
    assert _datasets(bundle / "nan-streamed.h5") == _datasets(bundle / "nan-memory.h5")
    note = f"gives NaN for {ROWS * COLS - 1} of {ROWS * COLS} elements whose input is not NaN (every output is NaN)"
    assert note in memory.output and note in streamed.output


def test_quantization_blocks_too_tall_for_the_limit_are_refused_in_one_line(cli, tmp_path):
    """Along the first axis a row block holds whole blocks: 32 rows of 2^16 values (8 MiB with the outputs) do
    not fit 1M; refused before any output is written."""
    np.save(tmp_path / "wide.npy", np.ones((64, 1 << 14), np.float32))
    out = tmp_path / "out.h5"
    r = cli("fakequant", "--inputs", tmp_path / "wide.npy", "--semantics", "mx", "--axis", "0", "-o", out,
            "--memory-limit", "1M")
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "--memory-limit" in lines[0] and "32 whole rows" in lines[0], r.output
    assert "Traceback" not in r.output and not out.exists()


@pytest.mark.parametrize("name,options", [
    ("mx-axis0", ("--semantics", "mx", "--axis", "0", "--block-size", "32")),
    ("nvfp4", ("--semantics", "nvfp4")),
    ("onnx-blocked-axis0", ("--semantics", "onnx", "--y-scale", "b.h5:scale_blocks0", "--axis", "0",
                            "--block-size", "14")),
], ids=lambda v: v if isinstance(v, str) else None)
def test_zarr_beyond_the_limit_runs_in_row_blocks_with_the_in_memory_bits(cli, bundle, monkeypatch, name, options):
    zarr = pytest.importorskip("zarr")
    monkeypatch.chdir(bundle)
    with h5py.File("b.h5", "r") as f:
        x = f["x"][()]
    store = bundle / f"{name}.zarr"
    root = zarr.open_group(str(store), mode="w")
    root.create_array("inputs" if name != "onnx-blocked-axis0" else "x", data=x, chunks=(100, COLS))
    assert cli("fakequant", store, *options, "-o", f"{name}-zarr-memory.h5", "-q").exit_code == 0
    r = cli("fakequant", store, *options, "-o", f"{name}-blocks.zarr", "--memory-limit", "1M", "--json")
    assert r.exit_code == 0, r.output
    assert "blocks of" in r.output
    expected = _datasets(bundle / f"{name}-zarr-memory.h5")
    got = zarr.open_group(str(bundle / f"{name}-blocks.zarr"), mode="r")
    assert sorted(got.array_keys()) == sorted(expected)
    for key, (shape, dtype, digest, _) in expected.items():
        a = np.asarray(got[key][()])
        assert (a.shape, a.dtype) == (shape, dtype), key
        assert _digest(a) == digest, key


def test_a_64_mib_tensor_streams_in_bounded_memory(tmp_path):
    """NVFP4 (two passes) of a 64 MiB .npy under --memory-limit 16M: the peak RSS stays within twice the limit
    of a run on a tiny tensor (the in-memory run holds the tensor and its outputs: 64 MiB more at least), and
    every output is the in-memory run's."""
    from test_declared_sizes import qgcli

    rng = np.random.default_rng(38)
    x = rng.standard_normal((2048, 8192), dtype=np.float32)  # 64 MiB
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "tiny.npy", x[:1, :16])
    runs = {}
    for name, inputs, limit in (("tiny", "tiny.npy", ()), ("memory", "x.npy", ()),
                                ("streamed", "x.npy", ("--memory-limit", "16M"))):
        code, _, lines, rss, _ = qgcli("fakequant", "--inputs", inputs, "--semantics", "nvfp4", "-o", f"{name}.h5",
                                       "-q", *limit, cwd=tmp_path)
        assert code == 0, lines
        runs[name] = rss
    print(f"nvfp4 64 MiB: peak RSS {runs['streamed']:.0f} MiB streamed, {runs['memory']:.0f} MiB in memory, "
          f"{runs['tiny']:.0f} MiB on a tiny input")
    assert runs["memory"] > runs["tiny"] + 56, runs
    assert runs["streamed"] < runs["tiny"] + 2 * 16, runs
    assert _datasets(tmp_path / "streamed.h5") == _datasets(tmp_path / "memory.h5")


# --- in memory: the outputs written over the inputs read (issue 38, item 2) --------------------------------------

IN_PLACE_CASES = [
    ("mx", ("--semantics", "mx")),
    ("mx-axis0-fp4", ("--semantics", "mx", "--axis", "0", "--mx-format", "mxfp4")),
    ("nvfp4", ("--semantics", "nvfp4")),
    ("nvfp4-nan", ("--semantics", "nvfp4", "--inputs", "nan.npy")),
    ("onnx-per-tensor-fp8", ("--semantics", "onnx", "--y-scale", "0.01", "--dtype", "float8e4m3fn")),
    ("onnx-blocked-int4", ("--semantics", "onnx", "--y-scale", "scales.npy", "--block-size", "64", "--dtype",
                           "int4")),
    ("onnx-per-axis0-nan", ("--semantics", "onnx", "--y-scale", "rows.npy", "--axis", "0", "--dtype", "int8",
                            "--inputs", "nan.npy")),
]


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    """A 2 Mi-value tensor (more than block_rows.IN_PLACE_ELEMENTS: written over in row blocks) with a NaN copy."""
    folder = tmp_path_factory.mktemp("in-place")
    rng = np.random.default_rng(382)
    x = rng.standard_normal((1024, 2048)).astype(np.float32) * np.exp2(rng.integers(-8, 8, (1024, 1))).astype(
        np.float32)
    x[3, :64] = 0
    x[4, 5] = 1e30
    np.save(folder / "x.npy", x)
    x[7, 7] = np.nan
    np.save(folder / "nan.npy", x)
    np.save(folder / "scales.npy", (np.abs(rng.standard_normal((1024, 32))) + 0.01).astype(np.float32))
    np.save(folder / "rows.npy", (np.abs(rng.standard_normal(1024)) + 0.01).astype(np.float32))
    return folder


@pytest.mark.parametrize("name,options", IN_PLACE_CASES, ids=[c[0] for c in IN_PLACE_CASES])
def test_outputs_written_over_the_inputs_are_the_fresh_runs_bit_for_bit(cli, large, monkeypatch, name, options):
    """The outputs over the inputs' array, row block by row block (statistics taken from each block first): the
    same files and the same summary (statistics, notes) as the one-call path with fresh arrays."""
    import json

    from qgcli.families import block_rows

    monkeypatch.chdir(large)
    calls = []
    real = block_rows.in_place
    monkeypatch.setattr(block_rows, "in_place", lambda *a, **k: calls.append(1) or real(*a, **k))
    args = ("fakequant", "--inputs", "x.npy", *options) if "--inputs" not in options else ("fakequant", *options)
    over = cli(*args, "-o", f"{name}-over.h5", "--json")
    assert over.exit_code == 0, over.output
    assert calls == [1]
    monkeypatch.setattr(block_rows, "IN_PLACE_ELEMENTS", 1 << 40)  # the one-call path, fresh outputs
    fresh = cli(*args, "-o", f"{name}-fresh.h5", "--json")
    assert fresh.exit_code == 0 and calls == [1], fresh.output
    assert _datasets(large / f"{name}-over.h5") == _datasets(large / f"{name}-fresh.h5")
    a, b = json.loads(over.stdout), json.loads(fresh.stdout)
    assert a["statistics"] == b["statistics"] and a["notes"] == b["notes"] and a["outputs"] == b["outputs"]
    with h5py.File(large / f"{name}-over.h5", "r") as f, h5py.File(large / f"{name}-fresh.h5", "r") as g:
        assert dict(f.attrs).keys() == dict(g.attrs).keys()
        assert {k: str(v) for k, v in f.attrs.items() if k.endswith("_dtype")} == \
            {k: str(v) for k, v in g.attrs.items() if k.endswith("_dtype")}


def test_an_in_memory_forward_holds_the_tensor_once(tmp_path):
    """MX of a 64 MiB .npy in memory: the inputs' array takes the outputs, so with --quiet the peak holds the
    tensor, its 16 MiB of codes and row-block temporaries (the fresh outputs held the tensor twice); with the
    summary the statistics work a row block at a time and keep their per-block sums (48 bytes a block of 32:
    96 MiB), where the whole tensor's float64 copies took about a GiB."""
    from test_declared_sizes import qgcli

    rng = np.random.default_rng(38)
    np.save(tmp_path / "x.npy", rng.standard_normal((2048, 8192), dtype=np.float32))
    np.save(tmp_path / "tiny.npy", np.ones((1, 32), np.float32))
    rss = {}
    for name, inputs, quiet in (("tiny", "tiny", ()), ("quiet", "x", ("-q",)), ("summary", "x", ())):
        code, _, lines, rss[name], _ = qgcli("fakequant", "--inputs", f"{inputs}.npy", "--semantics", "mx", "-o",
                                             f"{name}.h5", *quiet, cwd=tmp_path)
        assert code == 0, lines
    print(f"mx 64 MiB in memory: peak RSS {rss['quiet']:.0f} MiB quiet, {rss['summary']:.0f} MiB with the summary, "
          f"{rss['tiny']:.0f} MiB on a tiny input")
    assert rss["quiet"] < rss["tiny"] + 64 + 16 + 16, rss
    assert rss["summary"] < rss["tiny"] + 64 + 16 + 96 + 24, rss


# --- run files: the output arrays reused from group to group (issue 38, item 3) ----------------------------------

@pytest.mark.parametrize("out_suffix", [".h5", ".zarr"])
def test_run_file_groups_of_equal_shapes_reuse_their_output_arrays(cli, tmp_path, monkeypatch, out_suffix):
    """Six groups of equal shapes, two per family (small ones, in one call each, and MX groups over
    block_rows.IN_PLACE_ELEMENTS, written over their inputs): from the third group of a kind on, its outputs are
    the arrays an earlier group of the same kind wrote (each sink writes a group when it adds it), and every
    group's outputs are what the group gives alone."""
    if out_suffix == ".zarr":
        pytest.importorskip("zarr")
    from qgcli.storage import h5, zarr_store

    rng = np.random.default_rng(383)
    run = tmp_path / "run.h5"
    big = (1024, 1280)  # 1.25 Mi values: quantized in row blocks, in place
    with h5py.File(run, "w") as f:
        for i in range(3):
            for name, attrs, shape in (("mx", dict(op="mx", format="mxfp4"), (64, 96)),
                                       ("nvfp4", dict(op="nvfp4"), (64, 96)),
                                       ("onnx", dict(op="QuantizeLinear", dtype="int8", axis=0), (64, 96)),
                                       ("mxbig", dict(op="mx", format="mxfp8-e5m2"), big)):
                g = f.create_group(f"step_{i}/{name}")
                g.attrs.update(attrs)
                g["x" if name == "onnx" else "inputs"] = (rng.standard_normal(shape) * (i + 1)).astype(np.float32)
                if name == "onnx":
                    g["y_scale"] = (np.abs(rng.standard_normal(shape[0])) + 0.01).astype(np.float32)
    seen = {}
    sink = (h5.GroupSink if out_suffix == ".h5" else zarr_store._GroupSink)
    real_add = sink.add

    held = []  # every group's arrays stay alive: an address seen again is an array reused, not malloc's reuse

    def add(self, path, arrays, attrs):
        held.append(dict(arrays))
        seen[path] = {k: np.asarray(v).__array_interface__["data"][0] for k, v in arrays.items()}
        return real_add(self, path, arrays, attrs)

    monkeypatch.setattr(sink, "add", add)
    out = tmp_path / f"out{out_suffix}"
    r = cli("fakequant", run, "-o", out, "-q")
    assert r.exit_code == 0, r.output
    kinds = ("mx", "nvfp4", "onnx", "mxbig")
    for name in kinds:
        for i in (1, 2):  # the second group takes the first's arrays, the third the second's (kept the latest)
            now, before = seen[f"step_{i}/{name}"], seen[f"step_{i - 1}/{name}"]
            reused = {k for k in now if now[k] == before[k]}
            # mxbig's outputs are its inputs' array (read for each group), NVFP4's tensor_scale a new scalar
            assert reused == set(now) - {"tensor_scale"} - ({"outputs"} if name == "mxbig" else set()), \
                (name, i, reused)
    assert len(seen) == 12
    # every group's outputs are those of the group run alone (fresh arrays)
    for i in range(3):
        for name in kinds:
            alone = tmp_path / f"alone-{i}-{name}.h5"
            assert cli("fakequant", f"{run}:step_{i}/{name}", "-o", alone, "-q").exit_code == 0  # the first group
            with h5py.File(alone, "r") as f:
                g = f[f"step_{i}/{name}"]
                expected = {k: _digest(g[k][()]) for k in g}
            if out_suffix == ".h5":
                with h5py.File(out, "r") as f:
                    got = {k: _digest(f[f"step_{i}/{name}/{k}"][()]) for k in expected}
            else:
                import zarr

                g = zarr.open_group(str(out), mode="r")[f"step_{i}/{name}"]
                got = {k: _digest(g[k][()]) for k in expected}
            assert got == expected, (i, name)


def test_run_file_groups_over_the_limit_stream_into_their_groups(cli, tmp_path):
    """An mx group along axis 0, an nvfp4 group (two passes) and a QuantizeLinear group per axis 0, each over
    --memory-limit 1M: streamed into their groups of the .h5 output, every dataset and the small-float type
    attributes as the in-memory run writes them."""
    rng = np.random.default_rng(384)
    run = tmp_path / "run.h5"
    with h5py.File(run, "w") as f:
        for name, attrs, operand in (("mx", dict(op="mx", axis=0, format="mxfp8-e4m3"), "inputs"),
                                     ("nv", dict(op="nvfp4"), "inputs"),
                                     ("q", dict(op="QuantizeLinear", axis=0, dtype="float8e5m2"), "x")):
            g = f.create_group(f"step/{name}")
            g.attrs.update(attrs)
            g[operand] = _tensor(rng)
            if name == "q":
                g["y_scale"] = np.full(ROWS, 0.03, np.float32)
    assert cli("fakequant", run, "-o", tmp_path / "memory.h5", "-q").exit_code == 0
    r = cli("fakequant", run, "-o", tmp_path / "streamed.h5", "--memory-limit", "1M")
    assert r.exit_code == 0, r.output
    assert r.output.count("streamed from disk") == 3 and "two passes" in r.output

    def walk(path):
        found = {}
        with h5py.File(path, "r") as f:
            f.visititems(lambda n, o: found.__setitem__(n, _digest(o[()]) if isinstance(
                o, h5py.Dataset) else {k: str(v) for k, v in o.attrs.items() if k.endswith("_dtype")}))
        return found

    assert walk(tmp_path / "streamed.h5") == walk(tmp_path / "memory.h5")


# --- run files: what is kept counts against --memory-limit; streamed groups fail like the others (issue 38g) --------

def _mx_run(path, shapes, rng, **attrs):
    with h5py.File(path, "w") as f:
        for i, shape in enumerate(shapes):
            g = f.create_group(f"g{i}")
            g.attrs.update(dict(op="mx", format="mxfp8-e4m3", **attrs))
            g["inputs"] = rng.standard_normal(shape).astype(np.float32)
            g["gradients"] = rng.standard_normal(shape).astype(np.float32)


def _kept_at_each_group(monkeypatch):
    """The bytes the run-file executor holds for reuse (``kept``) when each group computes."""
    from qgcli.execution import runfile
    from qgcli.families.block_rows import held_bytes

    real, held = runfile._compute, []

    def compute(job, layer, group_job, runner, operands, skipped, kept=None):
        held.append(held_bytes(kept))
        return real(job, layer, group_job, runner, operands, skipped, kept)

    monkeypatch.setattr(runfile, "_compute", compute)
    return held


def test_run_file_arrays_kept_for_reuse_count_against_the_memory_limit(cli, tmp_path, monkeypatch):
    """Five mx groups of different shapes, each 0.5 MiB (1 MiB by the memory plan's count: fits --memory-limit 1M
    alone): the results kept for the next groups (0.6 MiB a group, up to 4 shapes) are dropped before a group
    that would not fit beside them, so what is held never exceeds the limit; under a roomy limit they are kept."""
    shapes = [(128, 1024), (256, 512), (512, 256), (1024, 128), (64, 2048)]
    _mx_run(tmp_path / "run.h5", shapes, np.random.default_rng(5))
    held = _kept_at_each_group(monkeypatch)
    r = cli("fakequant", tmp_path / "run.h5", "-o", tmp_path / "out.h5", "-q", "--memory-limit", "1M")
    assert r.exit_code == 0, r.output
    need = 128 * 1024 * 4 * 2
    assert len(held) == 5 and all(h + need <= 1 << 20 for h in held), held
    held.clear()
    r = cli("fakequant", tmp_path / "run.h5", "-o", tmp_path / "roomy.h5", "-q", "--memory-limit", "64M")
    assert r.exit_code == 0, r.output
    assert held[0] == 0 and held[-1] > 4 * 128 * 1024 * 4, held  # four shapes' results kept
    with h5py.File(tmp_path / "out.h5", "r") as a, h5py.File(tmp_path / "roomy.h5", "r") as b:
        for i in range(5):
            for k in ("outputs", "scales", "quantized"):
                assert _digest(a[f"g{i}/{k}"][()]) == _digest(b[f"g{i}/{k}"][()]), (i, k)


def test_a_gradient_run_file_keeps_no_forward_results(cli, tmp_path, monkeypatch):
    """fakequant-grad computes the forward only for its summary: nothing of it is kept for the next groups."""
    _mx_run(tmp_path / "run.h5", [(64, 96), (32, 96), (64, 96)], np.random.default_rng(6))
    held = _kept_at_each_group(monkeypatch)
    r = cli("fakequant-grad", tmp_path / "run.h5", "-o", tmp_path / "out.h5")
    assert r.exit_code == 0, r.output
    assert held == [0, 0, 0]


def test_a_streamed_group_that_cannot_run_is_named_or_skipped(cli, tmp_path):
    """Three mx groups, the middle one along axis 0 with rows of 2^13 values: its 32-row blocks do not fit
    --memory-limit 1M.  Refused in one line naming the group, nothing written; with --skip-invalid skipped and
    listed, the others written."""
    rng = np.random.default_rng(7)
    run = tmp_path / "run.h5"
    with h5py.File(run, "w") as f:
        for name, shape, axis in (("a", (64, 96), -1), ("b", (64, 8192), 0), ("c", (32, 64), -1)):
            g = f.create_group(name)
            g.attrs.update(dict(op="mx", axis=axis))
            g["inputs"] = rng.standard_normal(shape).astype(np.float32)
    out = tmp_path / "out.h5"
    r = cli("fakequant", run, "-o", out, "--memory-limit", "1M")
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: b: ") and "32 whole rows" in lines[0], r.output
    assert "Traceback" not in r.output and not out.exists()
    r = cli("fakequant", run, "-o", out, "--memory-limit", "1M", "--skip-invalid", "--json")
    assert r.exit_code == 0, r.output
    import json

    s = json.loads(r.stdout)
    assert s["ran"] == 2 and [i["path"] for i in s["invalid"]] == ["b"] and "32 whole rows" in s["invalid"][0]["reason"]
    with h5py.File(out, "r") as f:
        assert sorted(f) == ["a", "c"]


def test_zarr_row_blocks_too_tall_for_the_limit_are_refused_as_from_npy(cli, tmp_path, monkeypatch):
    """A (64, 65536) tensor along axis 0 under --memory-limit 1M: its 32-row blocks (8 MiB of inputs) are refused
    from a Zarr store in the same line as from a .npy, before any output."""
    zarr = pytest.importorskip("zarr")
    x = np.ones((64, 1 << 16), np.float32)
    np.save(tmp_path / "t.npy", x)
    zarr.open_group(str(tmp_path / "t.zarr"), mode="w").create_array("inputs", data=x, chunks=(8, 1 << 16))
    monkeypatch.chdir(tmp_path)
    said = []
    for source, out in (("--inputs=t.npy", "a.h5"), ("t.zarr", "b.zarr")):
        r = cli("fakequant", source, "--semantics", "mx", "--axis", "0", "-o", tmp_path / out,
                "--memory-limit", "1M")
        assert r.exit_code == 2, (source, r.output)
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and "32 whole rows" in lines[0] and not (tmp_path / out).exists(), (source, r.output)
        said.append(lines[0])
    assert said[0] == said[1]


def test_nvfp4_row_blocks_leave_the_warning_filters_alone():
    """NVFP4's row blocks (and a run file's groups) run on Dask's worker threads: they must not change the
    process-wide warning filters (warnings.catch_warnings is not thread-safe), even where the per-tensor scale
    makes the outputs NaN (the note counts those itself, in the op's words).  The filters made immutable: a block that changed them would fail."""
    import warnings

    from qgcli.families import block_rows, nvfp4
    from qgcli.ops import nvfp4 as nvfp4_ops

    x = np.zeros((64, 32), np.float32)
    job = type("Job", (), {"family": "nvfp4", "formats": {"per_tensor_scale": True, "axis": -1},
                           "with_gradients": False})()
    plan, _ = block_rows.plan(job, {"inputs": x}, x_name="inputs", axis=1, block_size=16, amax_pass=True)
    plan = plan.with_amax([np.float32(0)])  # tensor scale 0: every output NaN
    nan = x.copy()
    nan[3, 5] = np.nan  # the whole tensor in memory (a run-file group on a worker): a NaN amax, every output NaN
    filters = warnings.filters
    warnings.filters = tuple(filters)
    try:
        blocks, _, counts = plan.compute(x, None, 0, 64)
        res, notes = nvfp4.forward(nan, {"per_tensor_scale": True, "axis": -1})
    except AttributeError as exc:  # 'tuple' object has no attribute 'insert' / 'remove'
        changed = exc
    else:
        changed = None
    finally:
        warnings.filters = filters
    assert changed is None, f"a row block changed the warning filters: {changed}"
    assert counts == {"nan_introduced": 64 * 32, "nan_outputs": 64 * 32}
    assert np.isnan(blocks["outputs"]).all() and np.isnan(res.outputs).all()
    with pytest.warns(RuntimeWarning) as caught:  # the note is the op's warning, word for word
        nvfp4_ops.nvfp4_fake_quantize(nan, per_tensor_scale=True, axis=-1)
    assert notes == [str(w.message) for w in caught] and f"NaN for {64 * 32 - 1} of {64 * 32}" in notes[0]


def test_nvfp4_amax_pass_buffers_are_freed_before_the_encode_pass(cli, bundle, tmp_path, monkeypatch):
    """NVFP4 streamed in two passes: the amax pass's read buffers are gone when the encode pass computes its
    first block (only the encode reader's buffers are held then)."""
    import weakref

    from qgcli.execution.blocks import hdf5
    from qgcli.families import nvfp4

    buffers, alive = [], []

    class Reader(hdf5._Reader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            buffers.append([weakref.ref(b) for b in self.buffers])

    real_rows = nvfp4.rows

    def rows(plan, x, g, i0, i1, out=None):
        if len(buffers) == 2 and not alive:  # the encode pass's first block (not the plan's probe)
            alive.append(sum(r() is not None for r in buffers[0]))
        return real_rows(plan, x, g, i0, i1, out)

    monkeypatch.setattr(hdf5, "_Reader", Reader)
    monkeypatch.setattr(nvfp4, "rows", rows)
    r = cli("fakequant", bundle / "b.h5", "--semantics", "nvfp4", "-o", tmp_path / "o.h5", "--memory-limit", "1M",
            "-q")
    assert r.exit_code == 0, r.output
    assert len(buffers) == 2 and alive == [0], (len(buffers), alive)


def test_run_file_discovery_reads_ahead_within_the_memory_limit(cli, tmp_path, monkeypatch):
    """Discovery's read-ahead is held until each group runs: under --memory-limit 1M it reads at most an eighth
    of it (twenty 64 KiB groups are 1.25 MiB), without the option its 32 MiB as before."""
    from qgcli.storage import runfile

    rng = np.random.default_rng(9)
    with h5py.File(tmp_path / "run.h5", "w") as f:
        for i in range(20):
            g = f.create_group(f"g{i}")
            g.attrs["op"] = "mx"
            g["inputs"] = rng.standard_normal((128, 128)).astype(np.float32)
    real, read = runfile.discover, []

    def discover(*args, **kwargs):
        layers = real(*args, **kwargs)
        read.append(sum(a.nbytes for layer in layers for a in (layer.arrays or {}).values()))
        return layers

    monkeypatch.setattr(runfile, "discover", discover)
    for limit, most in (("1M", (1 << 20) // 8), (None, runfile.PREFETCH_BYTES)):
        options = ("--memory-limit", limit) if limit else ()
        r = cli("fakequant", tmp_path / "run.h5", "-o", tmp_path / f"out{limit}.h5", "-q", *options)
        assert r.exit_code == 0, r.output
        assert 0 < read[-1] <= most, (limit, read)
    assert read[-1] == 20 * 128 * 128 * 4


def test_a_group_the_memory_plan_refuses_is_named_or_skipped(cli, tmp_path):
    """Writing an .npz nothing streams: a group over --memory-limit is refused by the memory plan, in one line
    naming it (nothing written), or skipped and listed with --skip-invalid, as any other invalid group."""
    run = tmp_path / "run.h5"
    with h5py.File(run, "w") as f:
        for name, shape in (("a", (64, 96)), ("big", (512, 1024)), ("c", (32, 64))):
            g = f.create_group(name)
            g.attrs["op"] = "mx"
            g["inputs"] = np.ones(shape, np.float32)
    out = tmp_path / "out.npz"
    r = cli("fakequant", run, "-o", out, "--memory-limit", "1M")
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("Error: big: --memory-limit:"), r.output
    assert "cannot stream" in lines[0] and not out.exists()
    r = cli("fakequant", run, "-o", out, "--memory-limit", "1M", "--skip-invalid")
    assert r.exit_code == 0, r.output
    assert "skipped big: --memory-limit:" in r.output and "2 of 3 groups ran" in r.output
    with np.load(out) as z:
        assert sorted(z.files) == ["a/outputs", "a/quantized", "a/scales", "c/outputs", "c/quantized", "c/scales"]
