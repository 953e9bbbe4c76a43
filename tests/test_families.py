"""The op-family registry (qgcli.families.registry): a family is one module and one line of FAMILIES.

The toy family below (``tests/toy_family.py``: halves its inputs) is registered for one test by adding its
line, and runs from a run file through ``qgcli fakequant`` like any family: discovered by its op, validated,
built from the group, computed, written and listed, with no other module told about it.
"""
import json
import pathlib

import h5py
import numpy as np
import pytest

from qgcli.families import groups, registry


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))
    monkeypatch.setitem(registry.FAMILIES, "toy", "toy_family")  # the one registry line
    registry._OPS.clear()
    yield
    registry._OPS.clear()
    registry._MODULES.pop("toy", None)


def test_a_new_family_runs_from_a_run_file_with_one_registry_line(toy, cli, tmp_path):
    run = tmp_path / "run.h5"
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    with h5py.File(run, "w") as f:
        g = f.create_group("layer0")
        g.attrs["op"] = "ToyHalve"
        g["inputs"] = x
        g = f.create_group("layer1")
        g.attrs["op"] = "FakeQuantWithMinMaxVars"
        g["inputs"], g["min"], g["max"] = x, np.float32(-6), np.float32(6)
    out = tmp_path / "out.h5"
    result = cli("fakequant", run, "-o", out, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [(l["path"], l["family"]) for l in doc["layers"]] == [("layer0", "toy"), ("layer1", "tf")]
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["layer0/outputs"][()], x / 2)


def test_a_group_of_a_new_family_is_validated_by_its_operands(toy, tmp_path):
    run = tmp_path / "run.h5"
    with h5py.File(run, "w") as f:
        f.create_group("layer0").attrs["op"] = "ToyHalve"
    with h5py.File(run, "r") as f:
        (layer,) = groups.discover(f)
    assert (layer.kind, layer.family) == (registry.FAKE_QUANT, "toy")
    assert groups.validate(layer, "fakequant") == "missing operand inputs"


def test_an_unknown_op_lists_every_family_s_ops_in_registry_order():
    from qgcli.storage.runfile import Layer

    layer = groups.classify(Layer("g", "NoSuchOp", None, None, None, {"op": "NoSuchOp"}, {}))
    assert layer.error == (
        "unknown op 'NoSuchOp' (known: FakeQuantWithMinMaxVarsPerChannel, FakeQuantWithMinMaxVars, "
        "FakeQuantWithMinMaxArgs, fake_quantize_per_tensor_affine, fake_quantize_per_channel_affine, QuantizeV2, "
        "FusedBatchNorm, FusedBatchNormV2, FusedBatchNormV3, torchao.IntxFakeQuantizer, "
        "torchao.Float8FakeQuantizer, mx, nvfp4, QuantizeLinear)")


@pytest.mark.parametrize("op, entry", [
    ("FakeQuantWithMinMaxVarsGradient", ("fake-quant", "tf", "vars")),
    ("torch.fake_quantize_per_channel_affine", ("fake-quant", "torch", None)),
    ("FusedBatchNormGradV3", ("batch-norm", "batch-norm", "v3")),
    ("torchao.Float8FakeQuantizer", ("fake-quant", "torchao", "float8")),
    ("QuantizeV2", ("fake-quant", "quantize-dequantize", None)),
    ("Conv2D", None),
])
def test_op_entries(op, entry):
    assert registry.op_entry(op) == entry


def test_one_list_of_overridable_options():
    """The options a run file's groups take from the command line: one list, the job fields' names."""
    assert list(groups.OVERRIDABLE) == ["num_bits", "narrow_range", "axis", "quant_min", "quant_max", "dtype", "mode",
                                        "round_mode", "ensure_minimum_range", "epsilon", "data_format",
                                        "is_training", "variance_kind", "version"]
    assert all(option == "--" + name.replace("_", "-") for name, option in groups.OVERRIDABLE.items())


def test_one_infer_variant_keeps_each_caller_s_rule_without_min():
    from qgcli.ops.fake_quant import infer_variant

    assert infer_variant("args", np.zeros(3)) == "args"
    assert infer_variant(None, np.zeros(3)) == infer_variant(None, [1.0, 2.0]) == "per-channel"
    assert infer_variant(None, np.float32(1)) == infer_variant(None, 1.0) == "vars"
    assert infer_variant(None, None) == "args"  # the commands: FakeQuantWithMinMaxArgs, its range an attribute
    assert infer_variant(None, None, without_min="vars") == "vars"  # the plots
