"""Errors that point at the cause (issue 40, item 6): a missing file, a mistyped layer or key, an output
name qgcli cannot place."""
import os
import re

import pytest

from conftest import ROOT

RUN = os.path.join(ROOT, "samples", "run.h5")
NOTEBOOK = os.path.join(ROOT, "samples", "notebook.h5")


@pytest.mark.parametrize("args", [("plot", "ste", "nonexistent.h5", "--layer", "a/b", "-o", "x.png"),
                                  ("report", "nonexistent.h5", "--layer", "a/b")])
def test_a_missing_bundle_is_said_so_before_the_layer(cli, args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = cli(*args)
    assert r.exit_code == 2
    assert "BUNDLE: no such file: nonexistent.h5" in r.output and "--layer" not in r.output


def test_a_mistyped_layer_lists_the_closest_ones(cli):
    r = cli("report", RUN, "--layer", "step_000100/head/act_qant")
    assert r.exit_code == 2
    assert "has no layer 'step_000100/head/act_qant'" in r.output
    assert "the closest: step_000100/head/act_quant" in r.output
    r = cli("report", RUN, "--layer", "zzzz")  # nothing close: the layers themselves
    assert r.exit_code == 2 and "its layers: step_000100/backbone/conv1/act_quant" in r.output


def test_a_mistyped_key_is_blamed_not_the_options(cli, tmp_path):
    r = cli("fakequant-grad", f"{NOTEBOOK}:inputz", "--min", "-6", "--max", "6", "-o", tmp_path / "g.h5")
    assert r.exit_code == 2
    assert "--min" not in r.output
    assert "has no group or dataset 'inputz'; did you mean 'inputs'?" in r.output
    assert "(the file holds gradients, inputs, max, min)" in r.output


def _help_kinds(cli):
    r = cli("fakequant-grad", "--help")
    text = " ".join(r.stdout.split())
    part = text[text.index("Where to write:"):]
    part = part[:part.index("[required]")]
    return part, r


def test_output_kinds_in_the_error_are_those_the_help_names(cli, tmp_path):
    part, _ = _help_kinds(cli)
    kinds = ["FILE.h5", "FILE.npz", "FILE.npy", "STORE.zarr", "DIR/", "-"]
    for kind in kinds:
        assert kind in part, (kind, part)
    r = cli("fakequant-grad", NOTEBOOK, "-o", tmp_path / "x.txt")
    assert r.exit_code == 2
    said = r.output[r.output.index("use "):]
    named = re.findall(r"FILE\.\w+|STORE\.zarr|DIR/|(?<= or )-", said)
    assert sorted(named) == sorted(kinds), said
    # and each is accepted: FILE.npy for a single output
    r = cli("fakequant", NOTEBOOK, "-o", tmp_path / "one.npy")
    assert r.exit_code == 0, r.output
