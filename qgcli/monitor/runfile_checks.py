"""The doctor's checks on a run file (one captured step): what one step shows without a history.

Per fake-quant group: ``nan`` (NaN/Inf in inputs or gradients), ``no_gradient`` (a stored upstream gradient
that is all zero; an absent one is not a finding, an input quantizer of data has none by design),
``observer_default`` (PyTorch scale 1 and zero point 0), ``range_collapse`` (a scale <= 0, TensorFlow min > max)
and ``ste_broken`` (the framework's input gradient in ``reference/backprops_wrt_input`` against the STE's:
qgcli's TensorFlow gradient, or PyTorch's mask times the upstream gradient; not torchao, whose input gradient
also flows through data-dependent scales).  Batch-norm groups: ``nan`` and ``no_gradient`` on ``y_backprop``.
"""
import re

import numpy as np

from qgcli import ops
from qgcli.families import groups, registry
from qgcli.storage import runfile

#: relative L1 difference of the input gradient against the STE's above which the estimator is broken
STE_TOLERANCE = 1e-3
_STEP = re.compile(r"^step_(\d+)(?:/|$)")


def run_file_findings(target):
    """``[(kind, layer, step, evidence)]`` of run file ``target`` (``run.h5`` or ``run.h5:group``)."""
    path, group, container = runfile.open_target(
        target, operand="RUN_OR_HISTORY",
        not_a_run_file=f"{target}: doctor takes a history (qgcli.monitor) or a run file (.h5, or file.h5:group)")
    findings = []
    try:
        handle = container._opened()
        for layer in groups.discover(handle, group, label=path, operand="RUN_OR_HISTORY"):
            if layer.error or layer.kind is None:
                continue
            g = handle[layer.path] if layer.path != "/" else handle
            match = _STEP.match(layer.path)
            step = int(match.group(1)) if match else None
            name = layer.path[match.end():] if match else layer.path
            for kind, evidence in _checks(layer, g).items():
                findings.append((kind, name or layer.path, step, evidence))
    finally:
        container.close()
    return findings


def _read(g, name):
    import h5py

    node = g.get(name)
    return np.asarray(node[()]) if isinstance(node, h5py.Dataset) else None


def _checks(layer, g):
    out = {}
    if layer.kind == registry.BATCH_NORM:
        x, dy = _read(g, "x"), _read(g, "y_backprop")
    else:
        x, dy = _read(g, "inputs"), _read(g, "gradients")
    bad = [(n, int(np.size(a) - np.isfinite(a).sum())) for n, a in (("inputs", x), ("gradients", dy))
           if a is not None and np.issubdtype(a.dtype, np.floating)]
    if any(count for _, count in bad):
        out["nan"] = ", ".join(f"{count} NaN/Inf {n}" for n, count in bad)
    if dy is not None and dy.size and not np.any(dy):
        out["no_gradient"] = "the captured upstream gradient is all zero"
    if layer.kind == registry.BATCH_NORM:
        return out
    if _integer_grid(g):  # PyTorch's quantizers: scale and zero point
        scale, zp = _read(g, "scale"), _read(g, "zero_point")
        if scale is not None and np.any(scale <= 0):
            out["range_collapse"] = f"scale {float(np.min(scale)):.4g} (<= 0)"
        elif scale is not None and zp is not None and np.all(scale == 1) and not np.any(zp):
            out["observer_default"] = "scale 1 and zero point 0, the observer's defaults"
    elif _tf_range(g, layer) and layer.variant != "args":
        lo, hi = _read(g, "min"), _read(g, "max")
        if lo is not None and hi is not None and np.any(lo > hi):
            out["range_collapse"] = f"min {float(np.max(lo)):.4g} > max {float(np.min(hi)):.4g}"
    framework_dx = _read(g, "reference/backprops_wrt_input")
    if framework_dx is None:
        framework_dx = _read(g, "reference/backprops")
    ste = _ste_input_gradient(layer, g, x, dy)
    if framework_dx is not None and ste is not None and ste.shape == framework_dx.shape:
        den = float(np.abs(ste).sum()) or float(np.abs(dy).sum())
        err = float(np.abs(framework_dx.astype(np.float64) - ste).sum()) / den if den else 0.0
        if err > STE_TOLERANCE:
            out["ste_broken"] = (f"the framework's input gradient differs from the STE's by {err:.0%} (L1, relative "
                                 "to the STE's)")
    return out


def _ste_input_gradient(layer, g, x, dy):
    """The straight-through estimator's input gradient for this group, None where it is not defined here."""
    if x is None or dy is None or x.dtype != np.float32:
        return None
    a = layer.attrs
    if _integer_grid(g):
        scale, zp = _read(g, "scale"), _read(g, "zero_point")
        axis = a.get("axis")
        if axis is not None and np.ndim(scale):
            shape = [1] * x.ndim
            shape[int(axis)] = -1
            scale, zp = scale.reshape(shape), zp.reshape(shape)
        inv = (np.float32(1) / scale.astype(np.float32)).astype(np.float32)
        q = np.rint((x * inv).astype(np.float32)) + zp
        mask = (q >= int(a["quant_min"])) & (q <= int(a["quant_max"]))
        return (dy * mask).astype(np.float64)
    if not _tf_range(g, layer):
        return None
    kw = {"num_bits": int(a.get("num_bits", 8)), "narrow_range": bool(a.get("narrow_range", False))}
    if layer.variant == "args":
        return np.asarray(ops.fake_quant_with_min_max_args_gradient(dy, x, float(a.get("min", -6.0)),
                                                                    float(a.get("max", 6.0)), **kw), np.float64)
    lo, hi = _read(g, "min"), _read(g, "max")
    if layer.variant == "per-channel":
        got = ops.fake_quant_with_min_max_vars_per_channel_gradient(dy, x, lo, hi, **kw)
    else:
        got = ops.fake_quant_with_min_max_vars_gradient(dy, x, lo, hi, **kw)
    return np.asarray(got[0], np.float64)


def _integer_grid(g):
    """A PyTorch quantizer's group: its grid is a scale and a zero point (``quant_min``/``quant_max``)."""
    return "scale" in g and "zero_point" in g and "quant_min" in g.attrs


def _tf_range(g, layer):
    """One of TensorFlow's fake-quant groups: its range is min/max (datasets, or attributes for Args)."""
    return layer.variant in ("args", "vars", "per-channel") and not _integer_grid(g)
