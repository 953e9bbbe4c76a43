"""PyTorch's fake quant (``--semantics torch``): fake_quantize_per_{tensor,channel}_affine, their STE
gradients, LSQ's learnable ops and the other estimators on PyTorch's grid (scale and zero point).

:func:`torch_layout` and :func:`zero_point_from_literal` are PyTorch's operand rules, also used by
``qgcli plot estimators --semantics torch``.
"""
from qgcli.jobs import Result
from qgcli.storage.operands import to_device
from qgcli.report.summaries import describe_arrays, json_safe

LITERAL_OK = ("scale", "zero_point")


def torch_layout(scale_shape, inputs_shape, axis):
    """``(axis or None, note)``: per tensor for a 0-d scale (or one value without --axis), else the channel
    axis: ``--axis`` when given, otherwise the one axis of ``inputs`` whose length equals the scale's."""
    from qgcli.errors import OperandError

    if len(scale_shape) == 0:
        return None, ("--axis ignored: a scalar scale is per tensor" if axis is not None else None)
    if len(scale_shape) != 1:
        raise OperandError(f"must be a scalar or 1-d (one per channel), got shape {list(scale_shape)}", operand="scale")
    depth = scale_shape[0]
    ndim = len(inputs_shape)
    if axis is not None:
        if not -ndim <= axis < ndim:
            raise OperandError(f"{axis} is out of range for inputs of rank {ndim}", operand="axis")
        return axis % ndim, None
    if depth == 1:
        return None, "one scale value without --axis: per tensor"
    matches = [i for i, n in enumerate(inputs_shape) if n == depth]
    if not matches:
        raise OperandError(f"has {depth} entries but no axis of inputs {list(inputs_shape)} has that length",
                           operand="scale")
    if len(matches) > 1:
        raise OperandError(f"has {depth} entries, matching axes {matches} of inputs {list(inputs_shape)}; "
                           "give --axis", operand="scale")
    return matches[0], f"channel axis {matches[0]} inferred from the length of scale"


def zero_point_from_literal(text, value):
    """An integral literal zero point (``--zero-point 128``) is an int32, as PyTorch's observers give it."""
    import numpy as np

    from qgcli.storage import io

    if text is None or io.parse_spec(text, allow_literal=True).literal is None:
        return value
    value = np.asarray(value)
    if np.all(np.isfinite(value)) and np.all(value == np.round(value)) and np.all(np.abs(value) < 2**31):
        return value.astype(np.int32)
    return value


def _torch_op_name(per_channel, learnable):
    kind = "per_channel" if per_channel else "per_tensor"
    return f"torch.{'_' if learnable else ''}fake_quantize_{'learnable_' if learnable else ''}{kind}_affine"


def compute(job, operands):
    import math

    import numpy as np

    from qgcli.ops import estimators, torch_semantics as ts

    with_gradients, quant_min, quant_max, grad_factor = job.with_gradients, job.quant_min, job.quant_max, job.grad_factor
    est = job.estimator or estimators.parse_estimator("ste")
    learnable = est.name == "lsq"
    notes = []
    gradients = operands.get("gradients") if with_gradients else None
    inputs = operands.get("inputs")
    scale = np.asarray(operands.get("scale"))
    zero_point = zero_point_from_literal(job.operands.get("zero_point"), operands.get("zero_point"))
    channel_axis, note = torch_layout(scale.shape, np.shape(inputs), job.axis)
    if note:
        notes.append(note)
    scale_shape = scale.shape  # the learnable gradients keep it (PyTorch's per-tensor scale is [1])
    if channel_axis is None and scale.ndim == 1:
        scale = scale.reshape(())
        zero_point = np.asarray(zero_point).reshape(()) if np.size(zero_point) == 1 else zero_point
    for name, value in (("inputs", inputs), ("gradients", gradients)):
        dtype = getattr(value, "dtype", None)
        if dtype is not None and str(dtype) != "float32":
            notes.append(f"{name} is {dtype}; computed in float32 as PyTorch's float32 kernels")
    if not learnable and np.asarray(zero_point).dtype.kind == "f" and channel_axis is None:
        notes.append("float zero point: PyTorch's per-tensor op truncates it toward zero")
    xp, (gradients, inputs) = to_device([gradients, inputs], job.output.device)
    op = _torch_op_name(channel_axis is not None, learnable)
    attrs = {"op": op, "semantics": "torch", "quant_min": quant_min, "quant_max": quant_max,
             "axis": channel_axis}
    view = ts.quantized_view(inputs, scale, zero_point, quant_min, quant_max, axis=channel_axis,
                             learnable=learnable)
    details = None
    if not with_gradients:
        if channel_axis is None:
            out = {"outputs": ts.fake_quantize_per_tensor_affine(inputs, scale, zero_point, quant_min, quant_max)}
        else:
            out = {"outputs": ts.fake_quantize_per_channel_affine(inputs, scale, zero_point, channel_axis,
                                                                  quant_min, quant_max)}
    elif learnable:
        if grad_factor == "auto":
            n = view.elements_per_step()
            gf = 1.0 / math.sqrt(n * quant_max) if n and quant_max > 0 else 1.0
        else:
            gf = 1.0 if grad_factor is None else float(grad_factor)
        zf = np.asarray(zero_point).astype(np.float32)
        if channel_axis is None:
            res = ts.fake_quantize_learnable_per_tensor_affine_gradient(gradients, inputs, scale.reshape(scale_shape),
                                                                       zf, quant_min, quant_max, gf)
        else:
            res = ts.fake_quantize_learnable_per_channel_affine_gradient(gradients, inputs, scale, zf,
                                                                        channel_axis, quant_min, quant_max, gf)
        out = dict(zip(("backprops_wrt_input", "backprop_wrt_scale", "backprop_wrt_zero_point"), res))
        details = {"estimator": est.text, "name": est.name, "grad_factor": gf}
        attrs["grad_factor"] = gf
    elif est.name == "ste":
        if channel_axis is None:
            dx = ts.fake_quantize_per_tensor_affine_gradient(gradients, inputs, scale, zero_point, quant_min,
                                                             quant_max)
        else:
            dx = ts.fake_quantize_per_channel_affine_gradient(gradients, inputs, scale, zero_point, channel_axis,
                                                              quant_min, quant_max)
        out = {"backprops_wrt_input": dx}
        details = {"estimator": est.text, "name": est.name}
    else:
        out, details = estimators.apply_estimator(est, gradients, view, grad_factor=(
            None if grad_factor in (None, "auto") else grad_factor))
    if with_gradients:
        attrs["estimator"] = est.text
    stats = _view_statistics(view, gradients, xp)
    if with_gradients:
        from qgcli.ops.analysis import blocked_by

        stats["estimator_blocked"] = blocked_by(gradients, out["backprops_wrt_input"])
    summary = json_safe({
        "command": job.command, "op": op, "semantics": "torch", "estimator": details,
        "attributes": {k: v for k, v in attrs.items() if k != "op"},
        "inputs": {**describe_arrays({k: v for k, v in (("gradients", gradients), ("inputs", inputs),
                                                         ("scale", scale), ("zero_point", zero_point))
                                      if v is not None})},
        "grid": {"quant_min": quant_min, "quant_max": quant_max, "axis": channel_axis,
                 "scale": np.asarray(scale, np.float64).tolist(),
                 "zero_point": np.asarray(zero_point, np.float64).tolist()},
        "statistics": stats, "outputs": describe_arrays(out), "output": job.output.destination, "notes": notes,
    })
    return Result(out, attrs, summary)


def _view_statistics(view, gradients, xp):
    """Clipped shares (on the semantics' own masks) and the gradient mass the mask blocks."""
    import numpy as np

    n = int(view.inputs.size)
    stats = {"elements": n,
             "clipped_below": float(view.below.sum()) / n if n else 0.0,
             "clipped_above": float(view.above.sum()) / n if n else 0.0}
    if gradients is not None:
        g = xp.asarray(gradients)
        if view.axis is not None:
            g = xp.moveaxis(g, view.axis, -1)
        mag = xp.abs(g.astype(np.float64))
        mag = xp.where(xp.isfinite(mag), mag, 0.0)
        total = float(mag.sum())
        stats["gradient_blocked"] = float(xp.where(view.inside, 0.0, mag).sum()) / total if total else 0.0
    return stats
