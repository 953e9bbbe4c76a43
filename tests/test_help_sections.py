"""Help that is a guide (issue 40, item 7): a command's options in sections (click-option-group), SPEC defined
in the help, every input format and capture named in the top-level help, no command's line cut short.  On an
80-column pseudo-terminal and on pipes; the run on the floor constraints checks click 8.1, the newest run the
newest click."""
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from terminal import run_on_terminal

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
#: fakequant-grad's sections, in order, each with an option it must hold.
SECTIONS = [("Operands", "--gradients"), ("TF fake-quant attributes", "--num-bits"), ("Quantized types", "--dtype"),
            ("QuantizeAndDequantize", "--signed-input"), ("Framework", "--scale"), ("torchao QAT", "--granularity"),
            ("Block formats", "--mx-format"), ("Gradient estimator", "--estimator"), ("Output", "--output")]


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR")}
    env["TERM"] = "xterm-256color"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _help(args, where, tmp_path):
    argv = [sys.executable, "-m", "qgcli", *args, "--help"]
    if where == "terminal":
        code, data = run_on_terminal(argv, width=80, cwd=tmp_path, env=_env())
        return code, ANSI.sub("", data.decode().replace("\r\n", "\n"))
    r = subprocess.run(argv, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=60)
    assert r.stderr == ""
    return r.returncode, r.stdout


@pytest.mark.parametrize("where", ["terminal", "pipe"])
def test_options_are_listed_in_sections(where, tmp_path):
    code, text = _help(["fakequant-grad"], where, tmp_path)
    assert code == 0
    lines = text.splitlines()
    start = lines.index("Options:")
    lines = lines[start:lines.index("", start)]  # the options, up to the epilog
    titles = [i for i, line in enumerate(lines) if re.match(r"^  [^ -][^:]*:( |$)", line)]
    assert [lines[i].split(":")[0].strip() for i in titles] == [t for t, _ in SECTIONS], lines
    for (title, option), start, end in zip(SECTIONS, titles, titles[1:] + [len(lines)]):
        assert any(re.match(rf"^    (-\w, )?{option}\b", line) for line in lines[start:end]), (title, option)
    operands = "\n".join(lines[titles[0]:titles[1]])
    for spec in ("SPEC", "FILE.npz:KEY", "FILE.h5:DATASET", "FILE.safetensors:KEY", "FILE.pt:KEY", "STORE.zarr"):
        assert spec in operands, spec


@pytest.mark.parametrize("where", ["terminal", "pipe"])
def test_top_level_help_names_every_format_and_capture_and_cuts_no_line(where, tmp_path):
    code, text = _help([], where, tmp_path)
    assert code == 0
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines) or where == "pipe"
    flat = " ".join(text.split())
    for word in (".npy", ".npz", ".h5", ".safetensors", ".pt", "Zarr", "SPEC", "qgcli.capture.torch",
                 "qgcli.capture.tensorflow"):
        assert word in flat, word
    commands = flat[flat.index("Commands:"):]
    assert "..." not in commands.split("Examples:")[0], commands  # click marks a cut short help with '...'
    assert "verify A captured run file recomputed: qgcli vs the framework, per layer." in commands


@pytest.mark.parametrize("where", ["terminal", "pipe"])
def test_compare_semantics_help_names_every_framework_it_compares(where, tmp_path):
    """Its one-line help named TF and PyTorch only, long after --with added torchao and ONNX QuantizeLinear."""
    from qgcli.ops.cross_semantics import FRAMEWORKS

    spoken = {"tf": "TF", "torch": "PyTorch", "torchao": "torchao", "onnx": "ONNX"}
    assert set(spoken) == set(FRAMEWORKS)  # a framework added to --with is named here too
    code, text = _help([], where, tmp_path)
    assert code == 0
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  compare-semantics "))
    entry = [lines[start]] + [line for line in lines[start + 1:start + 3] if line.startswith(" " * 19)]
    assert len(entry) <= 2 and all(len(line) <= 80 for line in entry) or where == "pipe", entry
    one_line = " ".join(" ".join(entry).split())
    for name in spoken.values():
        assert name in one_line, (name, one_line)
    code, own = _help(["compare-semantics"], where, tmp_path)
    assert code == 0
    flat = " ".join(own.split())
    for name in ("TensorFlow", "PyTorch", "torchao", "ONNX QuantizeLinear"):
        assert name in flat.split("Options:")[0], name


#: How the top-level help names each fake-quant family (the registry's keys; batch norm is bn-grad's).
FAMILY_WORDS = {"tf": "TF", "estimator": "estimators", "torch": "PyTorch", "quantize-dequantize": "QuantizeV2",
                "torchao": "torchao", "quantize-and-dequantize": "QDQ", "mx": "MX", "nvfp4": "NVFP4", "onnx": "ONNX"}


@pytest.mark.parametrize("where", ["terminal", "pipe"])
def test_fakequant_one_liners_name_every_family_they_run(where, tmp_path):
    """Their one-line help said "TF fake-quant forward (Args/Vars/PerChannel)" long after they ran PyTorch,
    torchao, QDQ, QuantizeV2, MX, NVFP4 and ONNX groups too."""
    from qgcli.families import registry

    assert set(FAMILY_WORDS) == set(registry.FAMILIES) - {"batch-norm"}  # a new family is named here too
    code, text = _help([], where, tmp_path)
    assert code == 0
    lines = text.splitlines()
    for command in ("fakequant", "fakequant-grad"):
        start = next(i for i, line in enumerate(lines) if line.startswith(f"  {command} "))
        entry = [lines[start]] + list(itertools.takewhile(lambda line: line.startswith(" " * 19),
                                                          lines[start + 1:]))
        assert len(entry) <= 2 and all(len(line) <= 80 for line in entry) or where == "pipe", entry
        one_line = " ".join(" ".join(entry).split())
        words = [w for f, w in FAMILY_WORDS.items() if f != "estimator" or command == "fakequant-grad"]
        assert [w for w in words if not re.search(rf"\b{w}\b", one_line)] == [], one_line
