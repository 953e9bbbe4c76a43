"""A run file's groups as op-family layers: which family each group's ``op`` names, what keeps it from
running, and its job.

:mod:`qgcli.storage.runfile` walks the file and lists its groups (datasets, attributes); here each gets its
kind, family and variant from :mod:`qgcli.families.registry` (:func:`classify`), is validated from its
dataset shapes and attributes alone, nothing read (:func:`validate`), and becomes the job of its family
(:func:`job_from_group`): the group's attributes, except where an option was typed on the command line.
The layout is documented in docs/whole-models.md.
"""
import dataclasses
import math

import numpy as np

from qgcli.families import registry
from qgcli.jobs import OperandSpecs
from qgcli.storage import runfile

#: Command-line options that may override a group's attributes when typed: job field -> option.
OVERRIDABLE = {
    "num_bits": "--num-bits", "narrow_range": "--narrow-range", "axis": "--axis", "quant_min": "--quant-min",
    "quant_max": "--quant-max", "dtype": "--dtype", "mode": "--mode", "round_mode": "--round-mode",
    "ensure_minimum_range": "--ensure-minimum-range", "epsilon": "--epsilon", "data_format": "--data-format",
    "is_training": "--is-training", "variance_kind": "--variance-kind", "version": "--version",
}

#: The commands that compute gradients, by the dataset of upstream gradient each takes (a family may name its
#: own: ``UPSTREAM_GRADIENT``).  A group without it is forward only (see :func:`forward_only`).
GRADIENT_COMMANDS = ("fakequant-grad", "bn-grad")

_DATA_FORMATS = ("NHWC", "NCHW", "NDHWC", "NCDHW")
_VARIANCE_KINDS = ("variance", "inv-std", "auto")


# --- the groups' families ---------------------------------------------------------------------------------

def classify(layer):
    """``layer`` (a :class:`qgcli.storage.runfile.Layer`) with the kind, family and variant its op names, or
    the error of an op qgcli does not know."""
    if layer.error is not None:
        return layer
    if layer.op is None:
        layer.kind, layer.family, layer.variant = registry.bundle_family(layer.datasets, layer.attrs)
        return layer
    entry = registry.op_entry(layer.op)
    if entry is None:
        layer.error = f"unknown op {layer.op!r} (known: {', '.join(registry.op_table())})"
    else:
        layer.kind, layer.family, layer.variant = entry
    return layer


def discover(handle, group=None, *, label=None, operand="BUNDLE", prefetch=0):
    """The layers of an open h5py File (:func:`qgcli.storage.runfile.discover`), each with its family."""
    return [classify(layer) for layer in runfile.discover(handle, group, label=label, operand=operand,
                                                          prefetch=prefetch)]


def layer(path, attrs, datasets):
    """The classified Layer of one group (:func:`qgcli.storage.runfile.layer`), None when it is no layer."""
    found = runfile.layer(path, attrs, datasets)
    return None if found is None else classify(found)


def literal_specs(layer):
    """``{operand: literal text}`` of the operands a group carries as attributes (FakeQuantWithMinMaxArgs's
    min/max)."""
    literals = getattr(registry.of(layer), "group_literals", None) if layer.family else None
    return literals(layer) if literals else {}


def operand_specs(layer):
    """:class:`qgcli.jobs.OperandSpecs` of a group's literal operands."""
    return OperandSpecs(None, tuple(literal_specs(layer).items()))


# --- validation: from shapes and attributes, nothing read ----------------------------------------------------

def validate(layer, command):
    """The reason ``layer`` cannot run under ``command`` (None when it can); records it in ``layer.error``."""
    if layer.error is None:
        layer.error = problem(layer, command)
    return layer.error


def upstream_gradient(layer):
    """The name of the dataset holding a classified ``layer``'s upstream gradient (``gradients``; batch
    norm's ``y_backprop``)."""
    return getattr(registry.of(layer), "UPSTREAM_GRADIENT", "gradients")


def forward_only(layer, command):
    """Whether ``layer`` is a valid forward-only group that the gradient command ``command`` leaves out
    rather than refuses: it lacks only its upstream gradient (the model's first quantizer, whose input needs
    none; a capture with ``keep="forward"``), and nothing else keeps it from running."""
    if command not in GRADIENT_COMMANDS or layer.error is not None or layer.family is None:
        return False
    upstream = upstream_gradient(layer)
    data = next((n for n in ("inputs", "x") if n in layer.datasets), None)
    if upstream in layer.datasets or data is None:
        return False
    whole = dataclasses.replace(layer, datasets={**layer.datasets, upstream: layer.datasets[data]})
    return problem(whole, command) is None


def problem(layer, command):
    """What keeps a classified ``layer`` from running under ``command`` (None: nothing), without recording it."""
    fam = registry.of(layer)
    required, _ = fam.GROUP_OPERANDS.get(layer.variant, fam.GROUP_OPERANDS[None])
    missing = [n for n in required if n not in layer.datasets]
    upstream = upstream_gradient(layer)
    if command in GRADIENT_COMMANDS and upstream not in layer.datasets and upstream not in missing:
        missing.append(upstream)
    if missing:
        return f"missing operand{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
    a = layer.attrs
    for name in ("num_bits", "quant_min", "quant_max", "axis"):
        if name in a and not is_int(a[name]):
            return f"attribute {name}={a[name]!r} is not an integer"
    for name in ("narrow_range", "is_training"):
        if name in a and not is_bool(a[name]):
            return f"attribute {name}={a[name]!r} is not a boolean"
    if "num_bits" in a and not 2 <= int(a["num_bits"]) <= 16:
        return f"attribute num_bits={int(a['num_bits'])} is not in 2..16"
    for name in ("epsilon", "min", "max", "ensure_minimum_range"):
        if name in a and not is_real(a[name]):
            return f"attribute {name}={a[name]!r} is not a number"
    if hasattr(fam, "attribute_problem"):
        found = fam.attribute_problem(a)
        if found:
            return found
    if "data_format" in a and a["data_format"] not in _DATA_FORMATS:
        return f"attribute data_format={a['data_format']!r} is not one of {', '.join(_DATA_FORMATS)}"
    if "variance_kind" in a and a["variance_kind"] not in _VARIANCE_KINDS:
        return f"attribute variance_kind={a['variance_kind']!r} is not one of {', '.join(_VARIANCE_KINDS)}"
    shapes = {k: v[0] for k, v in layer.datasets.items()}
    data = "inputs" if "inputs" in shapes else "x"  # ONNX QuantizeLinear's groups may name it x
    if "gradients" in shapes and command == "fakequant-grad" and data in shapes and shapes["gradients"] != shapes[data]:
        return f"gradients shape {list(shapes['gradients'])} differs from {data} shape {list(shapes[data])}"
    if hasattr(fam, "group_problem"):
        return fam.group_problem(layer, shapes)
    return None


def size(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def is_bool(v):
    return isinstance(v, (bool, np.bool_)) or (isinstance(v, (int, np.integer)) and int(v) in (0, 1))


def is_real(v):
    return (isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
            and math.isfinite(float(v)))


# --- a group's job ---------------------------------------------------------------------------------------------

def plain(v):
    """An attribute as a Python value (NumPy scalars unwrapped)."""
    if isinstance(v, np.generic):
        return v.item()
    return v


class Picker:
    """A group's attribute, or the option typed on the command line in its place (recorded in ``overrides``:
    ``{attribute: {"group": value in the file, "option": value given}}``)."""

    def __init__(self, layer, given):
        self.layer, self.given, self.overrides = layer, given, {}

    def __call__(self, name, default):
        a = self.layer.attrs  # read at each call: a family may complete the attributes first (QuantizeV2's T)
        if name in self.given:
            if name in a and plain(a[name]) != self.given[name]:
                self.overrides[name] = {"group": plain(a[name]), "option": self.given[name]}
            return self.given[name]
        return plain(a[name]) if name in a else default


def job_from_group(run, layer, operand_specs, output):
    """The job (FakeQuantJob / BatchNormJob) that runs ``layer`` under the run-file job ``run``, and the
    overrides applied (see :class:`Picker`)."""
    pick = Picker(layer, dict(run.options))
    job = registry.of(layer).job_from_group(run, layer, operand_specs, output, pick)
    return job, pick.overrides


def fake_quant_basics(run, operand_specs, output, pick):
    """``(common job fields, narrow_range, axis)`` of a fake-quant group: what TensorFlow's, PyTorch's and
    QuantizeV2's groups read alike, picked in this order."""
    common = dict(command=run.command, with_gradients=run.with_gradients, operands=operand_specs, output=output,
                  estimator=run.estimator, grad_factor=run.grad_factor)
    narrow_range = bool(pick("narrow_range", False))
    axis = pick("axis", None)
    return common, narrow_range, None if axis is None else int(axis)
