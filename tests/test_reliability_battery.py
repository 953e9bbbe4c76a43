"""A table-driven battery of bad inputs across every command (issue 9).

Each row runs one real command line and asserts what a script in a pipeline relies on: the exit code,
exactly one line on stderr that starts with ``Error:`` and names the operand, option or path at fault, no
traceback, nothing on stdout, no output file (nor temporary file) left, and every input file byte-identical.
The ~20 bad inputs of ``fakequant-grad`` in ``test_cli_fakequant.py`` are not repeated here.

Rows use ``{d}`` for the directory of hostile files (``tests/hostile.py``) and ``{o}`` for an empty
directory that must stay empty.
"""
import ctypes
import hashlib
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from hostile import make_hostile

BN = ["--scale", "{d}/c4.npy", "--reserve-space-1", "{d}/c4.npy", "--reserve-space-2", "{d}/c4.npy"]
BN_ALL = ["--y-backprop", "{d}/bn_x.npy", "--x", "{d}/bn_x.npy", *BN]
FQ = ["--inputs", "{d}/x.npy", "--min", "-1", "--max", "1"]

# (id, argv, exit code, what the message must name, what it must say)
ROWS = [
    # --- files that are not what their suffix says
    ("npy-is-hdf5", ["fakequant", "--inputs", "{d}/hdf5_named.npy", "--min", "-1", "--max", "1", "-o", "{o}/o.h5"],
     2, "inputs", "not an npy file (looks like h5)"),
    ("npy-is-text", ["report", "--inputs", "{d}/text.npy", "--min", "-1", "--max", "1"], 2, "inputs", "not an npy file"),
    ("npz-is-text", ["inspect", "{d}/text.npz"], 2, "text.npz", "cannot open as npz"),
    ("h5-signature-only", ["fakequant", "{d}/text.h5", "-o", "{o}/o.h5"], 2, "BUNDLE", "cannot open as h5"),
    ("verify-not-h5", ["verify", "{d}/text.h5"], 2, "RUN", "cannot open as h5"),
    ("trend-not-history", ["trend", "{d}/text.h5"], 2, "text.h5", "not a qgcli history"),
    ("doctor-not-h5", ["doctor", "{d}/text.h5"], 2, "RUN_OR_HISTORY", "cannot open as h5"),
    ("plot-trend-not-history", ["plot", "trend", "{d}/text.h5", "-o", "{o}/t.png"], 2, "text.h5", "not a qgcli history"),
    ("diff-not-h5", ["diff", "{d}/text.h5", "{d}/text.h5"], 2, "text.h5", "cannot open as h5"),
    ("suffix-unknown", ["nudge", "--min", "{d}/secret.bin", "--max", "1"], 2, "min", "unknown file type"),
    # --- empty and truncated files
    ("npy-empty", ["plot", "hist", "--inputs", "{d}/empty.npy", "--min", "-1", "--max", "1", "-o", "{o}/h.png"],
     2, "inputs", "is empty"),
    ("npy-truncated-header", ["fakequant-grad", "--gradients", "{d}/trunc_header.npy", *FQ, "-o", "{o}/o.npz"],
     2, "gradients", "cannot read .npy"),
    ("npy-truncated-data", ["bn-grad", "--y-backprop", "{d}/bn_x.npy", "--x", "{d}/trunc_data.npy", *BN,
                            "-o", "{o}/o.h5"], 2, "x", "truncated"),
    ("npy-header-promises-400GB", ["report", "--inputs", "{d}/bomb.npy", "--min", "-1", "--max", "1"],
     2, "inputs", "promises 400000000000 bytes"),
    ("npy-negative-shape", ["fakequant", "--inputs", "{d}/negative_shape.npy", "--min", "-1", "--max", "1",
                            "-o", "{o}/o.h5"], 2, "inputs", "negative dimension"),
    ("npy-bad-version", ["nudge", "--min", "{d}/bad_version.npy", "--max", "1"], 2, "min", "format version 9.0"),
    ("npy-bad-descr", ["compare-semantics", "--inputs", "{d}/bad_descr.npy", "--min", "-1", "--max", "1"],
     2, "inputs", "descr is not a valid dtype"),
    ("npz-truncated", ["fakequant", "{d}/trunc.npz", "-o", "{o}/o.h5"], 2, "BUNDLE", "cannot open as npz"),
    ("npz-bad-crc", ["fakequant", "{d}/bad_crc.npz", "-o", "{o}/o.h5"], 2, "inputs", "Bad CRC-32"),
    ("npz-member-promises-400GB", ["report", "{d}/bomb.npz"], 2, "inputs", "promises 400000000000 bytes"),
    ("h5-truncated", ["bn-grad", "{d}/trunc.h5", "-o", "{o}/o.h5"], 2, "BUNDLE", "truncated file"),
    ("h5-truncated-inspect", ["inspect", "{d}/trunc.h5"], 2, "trunc.h5", "truncated file"),
    ("h5-truncated-plot-layers", ["plot", "layers", "{d}/trunc.h5", "-o", "{o}/l.png"], 2, "BUNDLE", "truncated file"),
    # --- code or other files reached through a file
    ("npy-pickled-object", ["compare-semantics", "--inputs", "{d}/pickled.npy", "--min", "-1", "--max", "1"],
     2, "inputs", "pickled Python objects, which qgcli never loads"),
    ("npz-pickled-member", ["fakequant-grad", "{d}/pickled.npz", "-o", "{o}/o.h5"], 2, "gradients",
     "pickled Python objects"),
    ("npy-header-with-a-call", ["fakequant", "--inputs", "{d}/call_in_header.npy", "--min", "-1", "--max", "1",
                                "-o", "{o}/o.h5"], 2, "inputs", "malformed node or string"),
    ("npz-member-not-npy", ["bn-grad", "{d}/not_npy_member.npz", *BN, "-o", "{o}/o.h5"], 2, "y_backprop",
     "is not an .npy array"),
    ("h5-external-link", ["plot", "ste", "{d}/external_link.h5", "-o", "{o}/s.png"], 2, "inputs",
     "external link to other.h5; qgcli does not follow it"),
    ("h5-soft-link-to-external", ["compare-semantics", "{d}/soft_to_external.h5"], 2, "inputs",
     "external link to other.h5"),
    ("h5-virtual-dataset", ["fakequant-grad", "{d}/virtual.h5", "-o", "{o}/o.h5"], 2, "inputs",
     "virtual dataset reading other.h5"),
    ("h5-external-storage", ["report", "{d}/external_storage.h5"], 2, "inputs", "external file secret.bin"),
    ("h5-soft-link-cycle", ["nudge", "--min", "{d}/soft_cycle.h5:self", "--max", "1"], 2, "min",
     "more than 16 soft links"),
    ("h5-group-for-dataset", ["bn-grad", "{d}/group.h5", "-o", "{o}/o.h5"], 2, "x", "is a group, not a dataset"),
    ("h5-group-in-cycle-for-dataset", ["nudge", "--min", "{d}/hard_cycle.h5:a/again/again", "--max", "1"],
     2, "min", "is a group"),
    ("h5-declares-400GB", ["fakequant", "--inputs", "{d}/odd_types.h5:huge", "--min", "-1", "--max", "1",
                           "-o", "{o}/o.h5"], 2, "inputs", "declares"),  # refused whether loaded or streamed
    # --- wrong dtypes
    ("dtype-string-h5", ["plot", "staircase", "--inputs", "{d}/odd_types.h5:string", "--min", "-1", "--max", "1",
                         "-o", "{o}/s.png"], 2, "inputs", "holds variable-length strings, not a tensor"),
    ("dtype-compound-h5", ["fakequant", "--inputs", "{d}/odd_types.h5:compound", "--min", "-1", "--max", "1",
                           "-o", "{o}/o.h5"], 2, "inputs", "dtype"),
    ("dtype-null-dataspace", ["bn-grad", *BN_ALL[:2], "--x", "{d}/odd_types.h5:null", *BN, "-o", "{o}/o.h5"],
     2, "x", "dtype"),
    ("dtype-bool", ["report", "--inputs", "{d}/bool.npy", "--min", "-1", "--max", "1"], 2, "inputs", "dtype bool"),
    ("dtype-int-scale", ["bn-grad", *BN_ALL[:4], "--scale", "{d}/int.npy", *BN[2:], "-o", "{o}/o.h5"],
     2, "scale", "int32"),
    ("dtype-str-min", ["nudge", "--min", "{d}/str.npy", "--max", "{d}/str.npy"], 2, "min", "<U1"),
    ("dtype-datetime", ["compare-semantics", "--inputs", "{d}/datetime.npy", "--min", "-1", "--max", "1"],
     2, "inputs", "datetime64"),
    # --- zero-size operands where sizes must agree
    ("zero-size-min-vector", ["fakequant", "--inputs", "{d}/x.npy", "--min", "{d}/c0.npy", "--max", "{d}/c0.npy",
                              "-o", "{o}/o.h5"], 2, "min", "0 entries but inputs have 4 channels"),
    ("zero-size-scale", ["bn-grad", *BN_ALL[:4], "--scale", "{d}/c0.npy", *BN[2:], "-o", "{o}/o.h5"],
     2, "scale", "0 entries"),
    # --- shape mismatches, every pair
    ("shape-bn-y_backprop-vs-x", ["bn-grad", "--y-backprop", "{d}/bn_x5.npy", "--x", "{d}/bn_x.npy", *BN,
                                  "-o", "{o}/o.h5"], 2, "y_backprop", "differs from x shape"),
    ("shape-bn-scale-vs-x", ["bn-grad", *BN_ALL[:4], "--scale", "{d}/c3.npy", *BN[2:], "-o", "{o}/o.h5"],
     2, "scale", "3 entries but x has 4 channels"),
    ("shape-bn-reserve_space_1-vs-x", ["bn-grad", *BN_ALL[:6], "--reserve-space-1", "{d}/c3.npy", *BN[4:],
                                       "-o", "{o}/o.h5"], 2, "reserve_space_1", "3 entries"),
    ("shape-bn-reserve_space_2-vs-x", ["bn-grad", *BN_ALL[:8], "--reserve-space-2", "{d}/c3.npy",
                                       "-o", "{o}/o.h5"], 2, "reserve_space_2", "3 entries"),
    ("shape-min-vs-max", ["fakequant", "--inputs", "{d}/x.npy", "--min", "{d}/lo4.npy", "--max", "{d}/hi3.npy",
                          "-o", "{o}/o.h5"], 2, "max", "3 entries"),
    ("shape-report-gradients-vs-inputs", ["report", *FQ, "--gradients", "{d}/x5.npy"], 2, "gradients",
     "differs from inputs shape"),
    ("shape-compare-gradients-vs-inputs", ["compare-semantics", *FQ, "--gradients", "{d}/x5.npy"], 2, "gradients",
     "differs from inputs shape"),
    ("shape-compare-min-vs-channels", ["compare-semantics", "--inputs", "{d}/x5.npy", "--min", "{d}/lo4.npy",
                                       "--max", "{d}/hi4.npy"], 2, "min", "4 entries but inputs have 5 channels"),
    ("shape-plot-gradients-vs-inputs", ["plot", "ste", *FQ, "--gradients", "{d}/x5.npy", "-o", "{o}/s.png"],
     2, "gradients", "differs from inputs shape"),
    ("shape-nudge-min-vs-max", ["nudge", "--min", "{d}/lo4.npy", "--max", "{d}/hi3.npy"], 2, "min",
     "differs from max shape"),
    # --- broken literals (parsed with float(), never evaluated)
    ("literal-double-comma", ["fakequant", "--inputs", "{d}/x.npy", "--min", "1,,2", "--max", "3",
                              "-o", "{o}/o.h5"], 2, "min", "neither a number"),
    ("literal-python-expression", ["nudge", "--min", "__import__('os').getcwd()", "--max", "1"], 2, "min",
     "neither a number"),
    ("literal-hex", ["report", "--inputs", "{d}/x.npy", "--min", "-1", "--max", "0x10"], 2, "max", "neither a number"),
    ("literal-for-a-tensor", ["fakequant-grad", "--inputs", "{d}/x.npy", "--gradients", "1,1,1", "--min", "-1",
                              "--max", "1", "-o", "{o}/o.h5"], 2, "gradients", "only range operands"),
    ("literal-empty", ["bn-grad", *BN_ALL[:4], "--scale", "", *BN[2:], "-o", "{o}/o.h5"], 2, "scale",
     "empty SPEC"),
    ("literal-nan-range", ["nudge", "--min", "nan", "--max", "1"], 2, "min", "finite"),
    ("literal-overflow-inf", ["compare-semantics", "--inputs", "{d}/x.npy", "--min", "-1", "--max", "1e999"],
     2, "max", "finite"),
    # --- options out of range
    ("option-num-bits-1", ["nudge", "--min", "-1", "--max", "1", "--num-bits", "1"], 2, "num_bits", "between 2 and 16"),
    ("option-num-bits-huge", ["report", *FQ, "--num-bits", "99999999999999999999"], 2, "num_bits", "between 2 and 16"),
    ("option-axis-out-of-range", ["fakequant", "--inputs", "{d}/x.npy", "--min", "{d}/lo4.npy", "--max",
                                  "{d}/hi4.npy", "--axis", "7", "-o", "{o}/o.h5"], 2, "axis", "out of range"),
    ("option-epsilon-negative", ["bn-grad", *BN_ALL, "--epsilon", "-1", "-o", "{o}/o.h5"], 2, "--epsilon", ">= 0"),
    ("option-first-too-many", ["compare-semantics", *FQ, "--first", "5000"], 2, "--first", "0<=x<=1000"),
    ("option-dpi-too-small", ["plot", "hist", *FQ, "--dpi", "1", "-o", "{o}/h.png"], 2, "--dpi", "10<=x<=1200"),
    ("option-bins-zero", ["plot", "hist", *FQ, "--bins", "0", "-o", "{o}/h.png"], 2, "--bins", "1<=x<=100000"),
    ("option-threshold-above-one", ["report", *FQ, "--threshold", "2"], 2, "--threshold", "0.0<=x<=1.0"),
    ("option-percentile-below-50", ["report", *FQ, "--percentiles", "40"], 2, "--percentiles", "between 50 and 100"),
    ("option-device-unknown", ["fakequant", *FQ, "--device", "tpu", "-o", "{o}/o.h5"], 2, "--device", "tpu"),
    ("plot-channels-scalar-range", ["plot", "channels", *FQ, "-o", "{o}/c.png"], 2, "min",
     "needs one min/max per channel"),
    ("estimator-unknown", ["plot", "estimators", *FQ, "--estimator", "bogus", "-o", "{o}/e.png"], 2, "--estimator",
     "unknown estimator 'bogus'"),
    ("estimator-parameter-not-a-number", ["fakequant-grad", *FQ, "--gradients", "{d}/g.npy", "--estimator",
                                          "ewgs:abc", "-o", "{o}/o.h5"], 2, "--estimator", "must be a number"),
    # --- --variant quantize-dequantize (QuantizeV2 + Dequantize)
    ("qdq-round-mode-needs-scaled", ["fakequant", *FQ, "--variant", "quantize-dequantize", "--round-mode",
                                     "HALF_TO_EVEN", "-o", "{o}/o.h5"], 2, "round_mode", "only supported for mode"),
    ("qdq-option-without-the-variant", ["fakequant", *FQ, "--dtype", "qint8", "-o", "{o}/o.h5"], 2, "--dtype",
     "only applies to --variant quantize-dequantize"),
    ("qdq-num-bits", ["fakequant", *FQ, "--variant", "quantize-dequantize", "--num-bits", "4",
                      "-o", "{o}/o.h5"], 2, "--num-bits", "comes from --dtype"),
    ("qdq-reversed-range", ["fakequant-grad", "--inputs", "{d}/x.npy", "--gradients", "{d}/g.npy", "--min", "1",
                            "--max", "-1", "--variant", "quantize-dequantize", "-o", "{o}/o.h5"], 2, "max",
     "below min"),
    ("qdq-gradients-vs-inputs", ["fakequant-grad", *FQ, "--gradients", "{d}/x5.npy", "--variant",
                                 "quantize-dequantize", "-o", "{o}/o.h5"], 2, "gradients", "differs from inputs"),
    # --- streaming (--memory-limit) and --compression
    ("memory-limit-unreadable", ["fakequant", *FQ, "--memory-limit", "lots", "-o", "{o}/o.h5"], 2,
     "--memory-limit", "cannot read 'lots'"),
    ("memory-limit-too-small", ["bn-grad", *BN_ALL, "--memory-limit", "10k", "-o", "{o}/o.h5"], 2,
     "--memory-limit", "below 1M"),
    ("streaming-needs-h5-output", ["fakequant-grad", "{d}/stream.h5", "--memory-limit", "1M", "-o", "{o}/o.npz"],
     2, "--output", "streaming writes .h5 outputs only"),
    ("streaming-to-stdout", ["fakequant", "{d}/stream.h5", "--memory-limit", "1M", "-o", "-"], 2, "--output",
     "streaming writes .h5 outputs only"),
    ("compression-unknown", ["fakequant", *FQ, "--compression", "zstd", "-o", "{o}/o.h5"], 2, "--compression",
     "'zstd' is not one of"),
    # --- outputs that must not be written
    ("output-exists", ["bn-grad", *BN_ALL, "-o", "{d}/ok.npz"], 2, "--output", "exists; use --force"),
    ("output-is-input", ["fakequant", "{d}/ok.h5", "-o", "{d}/ok.h5", "--force"], 2, "--output",
     "also an input"),
    ("output-is-input-via-symlink", ["fakequant", "{d}/ok.h5", "-o", "{d}/alias.npz", "--force"], 2, "--output",
     "also an input"),
    ("output-dir-holds-input", ["fakequant", "--inputs", "{d}/outputs.npy", "--min", "-1", "--max", "1",
                                "-o", "{d}/", "--force"], 2, "--output", "also an input"),
    ("output-figure-is-input-via-symlink", ["plot", "hist", *FQ, "-o", "{d}/alias.png", "--force"], 2, "--output",
     "also an input"),
    ("output-missing-directory", ["nudge", "--min", "-1", "--max", "1", "-o", "{o}/missing/grid.h5"], 2,
     "--output", "does not exist"),
    ("output-dir-is-a-file", ["compare-semantics", *FQ, "-o", "{d}/x.npy/"], 2, "--output", "is a file, not a directory"),
    ("output-unknown-suffix", ["nudge", "--min", "-1", "--max", "1", "-o", "{o}/grid.txt"], 2, "--output",
     "cannot tell the output format"),
    ("output-npy-for-three-outputs", ["bn-grad", *BN_ALL, "-o", "{o}/o.npy"], 2, "--output", "holds one array"),
    ("output-stdout-and-json", ["bn-grad", *BN_ALL, "-o", "-", "--json"], 2, "stdout", "--json"),
    ("output-figure-suffix", ["plot", "staircase", *FQ, "-o", "{o}/s.jpg"], 2, "--output", "use .png, .svg or .pdf"),
    # --- stdin
    ("stdin-empty", ["fakequant", "--inputs", "-", "--min", "-1", "--max", "1", "-o", "{o}/o.h5"], 2, "inputs",
     "stdin is empty"),
    ("stdin-not-a-tensor", ["inspect", "-"], 2, "FILE", "stdin is not an .npy, .npz or .h5 stream"),
    ("stdin-twice", ["inspect", "-", "-"], 2, "FILE", "only once"),
    # --- inspect
    ("inspect-missing-file", ["inspect", "{d}/missing.npz"], 2, "missing.npz", "no such file"),
    ("inspect-missing-key", ["inspect", "{d}/ok.h5:nothing"], 2, "nothing", "no tensor or group"),
]

STDIN = {"stdin-not-a-tensor": b"#!/bin/sh\nrm -rf /\n"}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    d = make_hostile(tmp_path_factory.mktemp("hostile"))
    os.symlink(os.path.join(d, "ok.h5"), os.path.join(d, "alias.npz"))
    os.symlink(os.path.join(d, "x.npy"), os.path.join(d, "alias.png"))
    import numpy as np

    np.save(os.path.join(d, "outputs.npy"), np.zeros(3, np.float32))  # what `-o DIR/` would write for fakequant
    return d


def snapshot(d):
    """Every file under ``d`` (temporary files included) with the SHA-256 of its bytes."""
    out = {}
    for root, dirs, files in os.walk(d):
        for name in files + [x for x in dirs if os.path.islink(os.path.join(root, x))]:
            path = os.path.join(root, name)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, d)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def check_failure(code, stdout, stderr, row, out_dir, hostile, before):
    name, _, want_code, names, says = row
    assert code == want_code, f"{name}: exit {code}, stderr {stderr!r}"
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), f"{name}: stderr {stderr!r}"
    assert names in lines[0] and says in lines[0], f"{name}: {lines[0]}"
    assert "Traceback" not in stdout + stderr
    assert stdout == "", f"{name}: stdout {stdout[:200]!r}"
    assert os.listdir(out_dir) == [], f"{name}: left {os.listdir(out_dir)}"
    assert snapshot(hostile) == before, f"{name}: an input changed or a file appeared among the inputs"


def test_battery_is_large_and_covers_every_command():
    from qgcli.cli import main

    assert len(ROWS) >= 40 and len({r[0] for r in ROWS}) == len(ROWS)
    covered = {r[1][0] for r in ROWS} | {f"plot {r[1][1]}" for r in ROWS if r[1][0] == "plot"}
    # list_commands/get_command, not main.commands: that holds only the commands imported so far.
    plot = main.get_command(None, "plot")
    commands = set(main.list_commands(None)) - {"plot"} | {f"plot {c}" for c in plot.list_commands(None)}
    missing = commands - covered - UNCOVERED
    assert not missing, f"commands without a battery row: {sorted(missing)}"


# Commands that landed after the battery was written get rows here; none is allowed to be missing silently.
UNCOVERED = {"quantize-dequantize"}


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_fails_cleanly(row, hostile, cli, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = [a.format(d=hostile, o=out_dir) for a in row[1]]
    before = snapshot(hostile)
    r = cli(*args, input=STDIN.get(row[0], b""))
    check_failure(r.exit_code, r.stdout, r.stderr, row, out_dir, hostile, before)


# --- the same contract through a real process (the installed entry point, real file descriptors) --------

def _drop_file_permission_override():
    """Run as root without CAP_DAC_OVERRIDE, so that a read-only directory is read-only (preexec_fn)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH; PR_CAPBSET_DROP = 24
        libc.prctl(24, cap, 0, 0, 0)


def run_qgcli(args, **kw):
    preexec = _drop_file_permission_override if os.geteuid() == 0 else None
    return subprocess.run([sys.executable, "-m", "qgcli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, preexec_fn=preexec, **kw)


@pytest.mark.parametrize("command", [["nudge", "--min", "-1", "--max", "1"],
                                     ["fakequant", "--inputs", "{d}/x.npy", "--min", "-1", "--max", "1"],
                                     ["plot", "hist", "--inputs", "{d}/x.npy", "--min", "-1", "--max", "1"]])
def test_read_only_output_directory(command, hostile, tmp_path):
    ro = tmp_path / "read-only"
    ro.mkdir()
    target = str(ro / ("h.png" if "plot" in command else "o.h5"))
    before = snapshot(hostile)
    os.chmod(ro, 0o555)
    try:
        proc = run_qgcli([a.format(d=hostile) for a in command] + ["-o", target])
        if proc.returncode == 0:
            pytest.skip("this process can write into a 0555 directory (root without a way to drop the override)")
        row = ("read-only", None, 2, "--output", "is not writable")
        check_failure(proc.returncode, proc.stdout, proc.stderr, row, ro, hostile, before)
    finally:
        os.chmod(ro, 0o755)


def test_subprocess_rows_match_in_process(hostile, tmp_path):
    """A sample of rows through ``python -m qgcli``: same exit code and one line."""
    for row in [r for r in ROWS if r[0] in ("h5-external-storage", "output-is-input-via-symlink", "stdin-not-a-tensor")]:
        out_dir = tmp_path / row[0]
        out_dir.mkdir()
        before = snapshot(hostile)
        proc = run_qgcli([a.format(d=hostile, o=out_dir) for a in row[1]], input=STDIN.get(row[0], b"").decode())
        check_failure(proc.returncode, proc.stdout, proc.stderr, row, out_dir, hostile, before)


def test_non_utf8_path_is_reported_on_one_line(tmp_path):
    name = os.fsencode(str(tmp_path)) + b"/bad\xff\nname.npy"
    proc = subprocess.run([sys.executable.encode(), b"-m", b"qgcli", b"fakequant", b"--inputs", name, b"--min", b"-1",
                           b"--max", b"1", b"-o", os.fsencode(str(tmp_path / "o.h5"))], capture_output=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count(b"\n") == 1 and proc.stderr.startswith(b"Error: inputs: no such file")
    assert os.listdir(tmp_path) == []


def test_a_reader_that_goes_away_is_not_an_error_message(hostile):
    """``qgcli ... -o - | head -c 0``: the pipe closes before the data is written; qgcli stops quietly, exit 141
    (the one rule for a closed stdout pipe, docs/guarantees.md)."""
    proc = subprocess.Popen([sys.executable, "-m", "qgcli", "fakequant", "--inputs", f"{hostile}/x.npy", "--min", "-1",
                             "--max", "1", "-o", "-", "-q"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    with proc.stderr:
        err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == b"", err
