"""Tables in 80 columns (issue 40, item 3): verify's table and the run-file summaries of fakequant-grad and
bn-grad keep the columns a reader needs, layer paths shorten from the middle and never to two equal texts,
``verify --wide`` gives the whole table, and off a terminal every column and every path is whole."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from terminal import run_on_terminal

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
LONG = "backbone.layer4.1.downsample.0.weight_fake_quant"
NAMES = ("backbone.conv1.act_quant", LONG, "backbone.layer4.1.downsample.1.weight_fake_quant", "head.logits_quant")


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR")}
    env["TERM"] = "xterm-256color"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """A run file as qgcli.capture writes it: references of every layer, long layer paths, one batch norm."""
    from qgcli import ops
    from qgcli.capture.runfile_writer import RunFileWriter

    path = str(tmp_path_factory.mktemp("captured") / "run.h5")
    rng = np.random.default_rng(40)
    w = RunFileWriter(path, step=100, references=True)
    for name in NAMES:
        x = rng.standard_normal((4, 6)).astype(np.float32)
        g = rng.standard_normal((4, 6)).astype(np.float32)
        lo, hi = np.float32(-1.0), np.float32(0.8)
        dx, dmin, dmax = ops.fake_quant_with_min_max_vars_gradient(g, x, lo, hi, num_bits=8, narrow_range=False)
        out = ops.fake_quant_with_min_max_vars(x, lo, hi, num_bits=8, narrow_range=False)
        w.add(name, "FakeQuantWithMinMaxVars", {"inputs": x, "min": lo, "max": hi, "gradients": g},
              {"num_bits": 8, "narrow_range": False},
              {"outputs": out, "backprops_wrt_input": dx, "backprop_wrt_min": dmin, "backprop_wrt_max": dmax})
    xb = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    dy = rng.standard_normal(xb.shape).astype(np.float32)
    scale = np.float32([0.5, 1.0, 2.0])
    mean = xb.mean(axis=(0, 2, 3), dtype=np.float64).astype(np.float32)
    inv = (1 / np.sqrt(xb.var(axis=(0, 2, 3), dtype=np.float64) + 1e-5)).astype(np.float32)
    bx, bs, bo = ops.fused_batch_norm_grad(dy, xb, scale, mean, inv, epsilon=1e-5, data_format="NCHW",
                                          is_training=True, variance_kind="inv-std")[:3]
    w.add("backbone/layer4/1/bn2", "FusedBatchNormV3",
          {"y_backprop": dy, "x": xb, "scale": scale, "reserve_space_1": mean, "reserve_space_2": inv},
          {"epsilon": 1e-5, "data_format": "NCHW", "is_training": True, "variance_kind": "inv-std"},
          {"x_backprop": bx * np.float32(1.000001), "scale_backprop": bs, "offset_backprop": bo})
    w.close()
    return path


def _pty(args, width, cwd):
    code, data = run_on_terminal([sys.executable, "-m", "qgcli", *map(str, args)], width=width, cwd=cwd, env=_env())
    return code, ANSI.sub("", data.decode().replace("\r\n", "\n")).splitlines()


def _table(lines, first):
    start = next(k for k, ln in enumerate(lines) if ln.split()[:1] == [first])
    rows = []
    for ln in lines[start + 1:]:
        if not ln.startswith("step_"):
            break
        rows.append(ln)
    return lines[start].split(), rows


def test_shorten_paths_from_the_middle_never_ambiguous():
    from qgcli.report.tables import shorten_middle, shorten_paths

    assert shorten_middle("a/b", 10) == "a/b"
    short = shorten_middle("step_000100/backbone/layer4/1/downsample/0/weight_fake_quant", 34)
    assert short == "step_000100/…/0/weight_fake_quant" and len(short) <= 34
    paths = ["step_000100/backbone/layer4/1/downsample/0/weight_fake_quant",
             "step_000100/backbone/layer4/2/downsample/0/weight_fake_quant",
             "step_000100/head/logits_quant"]
    out = shorten_paths(paths, 34)
    assert len(set(out)) == 3 and out[2] == paths[2]
    for full, s in zip(paths, out):  # each keeps the start and the end of its path
        head, _, tail = s.partition("…")
        assert full.startswith(head) and full.endswith(tail)
    assert len(shorten_middle("x" * 100, 20)) == 20  # one segment too long: characters from its middle


def test_verify_fits_80_columns_with_paths_shortened_from_the_middle(captured, tmp_path):
    code, lines = _pty(["verify", captured], 80, tmp_path)
    assert code == 0, lines
    assert all(len(ln) <= 80 for ln in lines), lines
    assert lines[0].startswith("verify ") and "4 bit-identical" in lines[0] + lines[1]  # a line, not a cut one
    header, rows = _table(lines, "layer")
    assert header[:2] == ["layer", "status"] and "max" in header and "held" in header
    assert len(rows) == 5
    cells = [r.split()[0] for r in rows]
    assert len(set(cells)) == 5  # the two downsample paths stay apart
    assert any("…" in c for c in cells)
    for c in cells:
        head, _, tail = c.partition("…")
        assert c.startswith("step_000100/") and (not tail or tail.endswith(("quant", "bn2")))
    text = "\n".join(lines)
    assert "marks a path's middle" in text and "--wide" in text and "not shown to fit 80 columns: op" in text
    assert "within-rtol" in text and "rtol 1e-05" in text  # the batch norm's count and the rule it was held to


def test_verify_wide_and_pipes_show_every_column_and_whole_paths(captured, tmp_path, cli):
    code, lines = _pty(["verify", captured, "--wide"], 80, tmp_path)
    assert code == 0
    text = "\n".join(lines)
    assert "…" not in text and f"step_000100/{LONG.replace('.', '/')}" in text and "worst output" in text
    r = subprocess.run([sys.executable, "-m", "qgcli", "verify", captured], capture_output=True, text=True,
                       env=dict(_env(), COLUMNS="40"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout and "\x1b" not in r.stdout
    header = [ln for ln in r.stdout.splitlines() if ln.startswith("layer")][0].split()
    assert header == ["layer", "op", "status", "max", "ulps", "held", "to", "rel", "worst", "output"]
    r = cli("verify", captured, "--columns", "status,rel")
    assert r.exit_code == 0, r.output
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("layer")][0].split() == ["layer", "status", "rel"]


@pytest.mark.parametrize("command", ["fakequant-grad", "bn-grad"])
def test_run_file_summaries_fit_80_columns(captured, tmp_path, command):
    code, lines = _pty([command, captured, "-o", "out.h5"], 80, tmp_path)
    assert code == 0, lines
    assert all(len(ln) <= 80 for ln in lines), lines
    header, rows = _table(lines, "group")
    assert rows and all("…" not in r.split()[0] or r.split()[0].startswith("step_000100/") for r in rows)
    assert header[-1] == ("|scale_backprop|" if command == "bn-grad" else "blocked")
    # the first line is broken between items, never inside a word
    assert lines[0].startswith(f"{command} over ") and "skipped" in "\n".join(lines[:2])
    assert not any(ln.startswith(("ipped", "kipped")) for ln in lines)


def test_inspect_records_and_group_lines_fit_80_columns(tmp_path, cli):
    """`inspect RUN --no-stats` lists a layer per record when its table is too wide: an operands list of 109
    columns (a batch norm's five) went past the terminal's edge, broken there mid-name, and a group's attributes
    ran to column 83; now broken between items, the next line under the value's first character.  Off a
    terminal every line is whole."""
    run = ROOT / "samples" / "run.h5"
    code, lines = _pty(["inspect", run, "--no-stats"], 80, tmp_path)
    assert code == 0, lines
    assert all(len(ln) <= 80 for ln in lines), [ln for ln in lines if len(ln) > 80]
    k = lines.index("step_000100/backbone/conv1/bn")
    value = lines[k + 2].index("reserve_space_1")
    assert lines[k + 2].startswith("  operands  ") and lines[k + 3].startswith(" " * value + "x [4, 8, 8, 16]")
    assert " ".join(" ".join(lines[k + 2:k + 4]).split()) == ("operands reserve_space_1 [16], reserve_space_2 [16], "
                                                              "scale [16], x [4, 8, 8, 16], y_backprop [4, 8, 8, 16]")
    g = next(i for i, ln in enumerate(lines) if ln.startswith("  group step_000100/head/logits_quant/"))
    assert lines[g + 1].startswith("    ") and "op=FakeQuantWithMinMaxArgs)" in lines[g + 1]
    r = cli("inspect", run, "--no-stats")
    assert r.exit_code == 0
    assert ("  group step_000100/head/logits_quant/  (max=6.0, min=-6.0, narrow_range=False, num_bits=8, "
            "op=FakeQuantWithMinMaxArgs)") in r.output.splitlines()


def test_a_run_of_block_formats_shows_their_numbers_not_empty_columns(tmp_path, cli):
    """fakequant over MX / NVFP4 / QuantizeLinear groups printed TensorFlow's clip<, clip> and blocked, "-" in
    every row, and left out op and shape to fit them; now their clipped share and SQNR, and no column that no
    group has a value for."""
    from test_block_staircase import _write

    run = _write(tmp_path / "blocks.h5")
    r = cli("fakequant", run, "-o", tmp_path / "j.h5", "--json")
    assert r.exit_code == 0, r.output
    import json

    sqnr = {layer["path"]: layer["statistics"]["sqnr_db"] for layer in json.loads(r.stdout)["layers"]}
    code, lines = _pty(["fakequant", "blocks.h5", "-o", "out.h5"], 80, tmp_path)  # relative: a long temp path
    assert code == 0 and all(len(ln) <= 80 for ln in lines), lines
    header = next(ln for ln in lines if ln.startswith("group ")).split()
    assert header[:1] == ["group"] and "dB" in header and not {"clip<", "clip>", "blocked"} & set(header), header
    rows = {ln.split()[0]: ln.split() for ln in lines if ln.split()[:1] and ln.split()[0] in sqnr}
    assert len(rows) == len(sqnr)
    at = header.index("SQNR")
    for path, value in sqnr.items():
        assert rows[path][at] == f"{value:.1f}", (path, rows[path])
    assert all(any(row[k] != "-" for row in rows.values()) for k in range(1, at + 1))
