"""PyTorch's fake quant (``--semantics torch``): fake_quantize_per_{tensor,channel}_affine, their STE
gradients, LSQ's learnable ops and the other estimators on PyTorch's grid (scale and zero point).

:func:`torch_layout` and :func:`zero_point_from_literal` are PyTorch's operand rules, also used by
``qgcli plot estimators --semantics torch``.
"""
import math

import numpy as np

from qgcli.backend import to_numpy
from qgcli.errors import OperandError, OptionError
from qgcli.families.common import check_grad_factor
from qgcli.families.groups import fake_quant_basics, size
from qgcli.families.registry import FAKE_QUANT
from qgcli.families.tf_fake_quant import common_fields, TF_OPS
from qgcli.jobs import FakeQuantJob, OperandSpecs, Result
from qgcli.ops.analysis import channel_report as channel_report_of
from qgcli.ops import estimators, fake_quant, torch_semantics, torch_semantics as ts
from qgcli.storage.operands import to_device
from qgcli.report.tables import print_items
from qgcli.report.summaries import describe_arrays, json_safe, percent, render_closing_lines

NAME, KIND = "torch", FAKE_QUANT
LITERAL_OK = ("scale", "zero_point")
#: Run-file ``op`` -> variant (PyTorch's op follows the shape of scale).
RUN_FILE_OPS = {"fake_quantize_per_tensor_affine": None, "fake_quantize_per_channel_affine": None}
GROUP_OPERANDS = {None: (("inputs", "scale", "zero_point"), ("gradients",))}


def torch_layout(scale_shape, inputs_shape, axis):
    """``(axis or None, note)``: per tensor for a 0-d scale (or one value without --axis), else the channel
    axis: ``--axis`` when given, otherwise the one axis of ``inputs`` whose length equals the scale's."""
    if len(scale_shape) == 0:
        return None, ("--axis ignored: a scalar scale is per tensor" if axis is not None else None)
    if len(scale_shape) != 1:
        raise OperandError(f"must be a scalar or 1-d (one per channel), got shape {list(scale_shape)}", operand="scale")
    depth = scale_shape[0]
    ndim = len(inputs_shape)
    if axis is not None:
        if not -ndim <= axis < ndim:
            raise OperandError(f"{axis} is out of range for inputs of rank {ndim}", operand="axis")
        if inputs_shape[axis] != depth:
            raise OperandError(f"has {depth} entries but inputs have {inputs_shape[axis]} channels on axis {axis}",
                               operand="scale")
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


def _is_literal(text):
    from qgcli.storage import io

    return text is not None and io.parse_spec(text, allow_literal=True).literal is not None


def zero_point_from_literal(text, value):
    """An integral literal zero point (``--zero-point 128``) is an int32, as PyTorch's observers give it."""
    if not _is_literal(text):
        return value
    value = np.asarray(value)
    if np.all(np.isfinite(value)) and np.all(value == np.round(value)) and np.all(np.abs(value) < 2**31):
        return value.astype(np.int32)
    return value


def _torch_op_name(per_channel, learnable):
    kind = "per_channel" if per_channel else "per_tensor"
    return f"torch.{'_' if learnable else ''}fake_quantize_{'learnable_' if learnable else ''}{kind}_affine"


def compute(job, operands):
    with_gradients, quant_min, quant_max, grad_factor = job.with_gradients, job.quant_min, job.quant_max, job.grad_factor
    est = job.estimator or estimators.parse_estimator("ste")
    learnable = est.name == "lsq"
    notes = []
    gradients = operands.get("gradients") if with_gradients else None
    inputs = operands.get("inputs")
    scale = np.asarray(operands.get("scale"))
    if _is_literal(job.operands.get("scale")):
        scale = scale.astype(np.float32)  # torch.tensor([0.1, 0.2]) is float32
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
    notes += _nonfinite_notes(inputs, out.get("outputs"), lambda: ts.fake_quantize_per_tensor_affine(
        inputs, scale, zero_point, quant_min, quant_max) if channel_axis is None else
        ts.fake_quantize_per_channel_affine(inputs, scale, zero_point, channel_axis, quant_min, quant_max), xp)
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


def _nonfinite_notes(inputs, outputs, forward, xp):
    """PyTorch's fake quant turns NaN and +-inf inputs into finite outputs without a word (NaN to a level, +inf
    to quant_max's per tensor but quant_min's per channel): say how many, and into what.  ``forward()`` gives
    the outputs when the command computed none (the gradients); only called when such inputs are there."""
    x = xp.asarray(inputs)
    kinds = [(name, where, int(where.sum())) for name, where in
             (("NaN", xp.isnan(x)), ("+inf", x == np.inf), ("-inf", x == -np.inf))]
    if not any(count for *_, count in kinds):
        return []
    y = xp.asarray(forward() if outputs is None else outputs)
    parts = []
    for name, where, count in kinds:
        if count:
            values = np.unique(to_numpy(y[where]))
            parts.append(f"{count} {name} -> " + (f"{float(values[0]):g}" if values.size == 1 else
                                                 f"{values.size} different values"))
    return [f"inputs hold non-finite values, which PyTorch's fake quant turns into finite outputs without a word "
            f"({', '.join(parts)}); their gradient is 0"]


def _view_statistics(view, gradients, xp):
    """Clipped shares (on the semantics' own masks) and the gradient mass the mask blocks."""
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


# --- the job: from the commands' options, from a run-file group --------------------------------------------

def claims(o):
    """--semantics torch (a --variant of TensorFlow's fake-quant ops is refused by :func:`job_from_options`)."""
    return o.semantics.semantics == "torch" and (o.attributes.variant is None or o.attributes.variant in TF_OPS)


def job_from_options(o):
    est, common = common_fields(o)
    operands, attributes, semantics = o.operands, o.attributes, o.semantics
    check_grad_factor(o.estimator, est)
    for name in ("min", "max"):
        if operands.get(name) is not None:
            raise OptionError("is TensorFlow's operand; with --semantics torch give --scale and --zero-point "
                              "(qgcli nudge -o writes TensorFlow's grid as scale/zero_point)",
                              param_hint=f"'--{name}'")
    if attributes.variant is not None:
        raise OptionError("chooses a TensorFlow op; PyTorch's op follows the shape of scale",
                          param_hint="'--variant'")
    if o.output.plot:
        raise OptionError("draws TensorFlow's STE only; use 'qgcli plot estimators --semantics torch'",
                          param_hint="'--plot'")

    default_min, default_max = fake_quant.quant_range(attributes.num_bits, attributes.narrow_range)
    quant_min, quant_max = torch_semantics.check_quant_range(
        default_min if semantics.quant_min is None else semantics.quant_min,
        default_max if semantics.quant_max is None else semantics.quant_max)
    specs = dict(inputs=operands.get("inputs"), scale=semantics.scale, zero_point=semantics.zero_point)
    if o.with_gradients:
        specs["gradients"] = operands.get("gradients")
    common["operands"] = OperandSpecs.of(operands.bundle, **specs)
    return FakeQuantJob(family=NAME, quant_min=quant_min, quant_max=quant_max, **common)


def group_problem(layer, shapes):
    if shapes["scale"] != shapes["zero_point"] and (len(shapes["scale"]) > 1 or len(shapes["zero_point"]) > 1
                                                    or size(shapes["scale"]) != size(shapes["zero_point"])):
        return f"zero_point shape {list(shapes['zero_point'])} differs from scale shape {list(shapes['scale'])}"
    if layer.op and "per_channel" in layer.op and size(shapes["scale"]) > 1 and "axis" not in layer.attrs:
        return "a per-channel PyTorch op needs the attribute axis"
    return None


def job_from_group(run, layer, operand_specs, output, pick):
    common, narrow_range, axis = fake_quant_basics(run, operand_specs, output, pick)
    num_bits = int(pick("num_bits", 8))
    lo, hi = fake_quant.quant_range(num_bits, narrow_range)
    quant_min, quant_max = torch_semantics.check_quant_range(int(pick("quant_min", lo)), int(pick("quant_max", hi)))
    return FakeQuantJob(family=NAME, num_bits=num_bits, narrow_range=narrow_range, axis=axis,
                        quant_min=quant_min, quant_max=quant_max, **common)


def mode(job):
    return "--semantics torch"


# --- the summary on stderr ------------------------------------------------------------------------------

def render(console, s):
    grid = s["grid"]
    scale, zp = grid["scale"], grid["zero_point"]
    if isinstance(scale, list):
        shown = ", ".join(f"{a:.6g}/{b:g}" for a, b in list(zip(scale, zp))[:6])
        more = f" ... ({len(scale)} channels, axis {grid['axis']})" if len(scale) > 6 else f" (axis {grid['axis']})"
        params = f"scale/zero_point {shown}{more}"
    else:
        params = f"scale {scale:.7g}, zero_point {zp:g}"
    print_items(console, f"[bold]{s['op']}[/] quant_min={grid['quant_min']} quant_max={grid['quant_max']}  {params}",
                  soft_wrap=True)
    stats = s["statistics"]
    line = f"clipped below {percent(stats['clipped_below'])}, above {percent(stats['clipped_above'])} (rounded integer)"
    if "gradient_blocked" in stats:
        line += (f"; gradient mass blocked by the mask {percent(stats['gradient_blocked'])}, by the estimator "
                 f"{percent(stats['estimator_blocked'])}")
    print_items(console, line)
    est = s.get("estimator")
    if est:
        extra = f", grad_factor {est['grad_factor']:.7g}" if "grad_factor" in est else ""
        print_items(console, f"estimator {est['estimator']}{extra}")
    render_closing_lines(console, s)


# --- qgcli report's analysis of a run-file group --------------------------------------------------------------

def channel_report(layer, operands, inputs, gradients, attr, num_bits, narrow_range, *, percentiles, device):
    """``(ChannelReport, attributes)``: ``qgcli report``'s per-channel (or per-tensor) analysis of a run-file
    group on PyTorch's own grid, its scale and zero point (:func:`qgcli.ops.analysis.channel_report`,
    ``variant="torch"``), the suggested range with the scale and zero point PyTorch's observer picks for it
    (symmetric when the group's ``qscheme`` says so, or, without one, for a signed range whose zero points are
    all 0); ``attr(name, default)``: an attribute, or the option typed for it."""
    lo, hi = fake_quant.quant_range(num_bits, narrow_range)
    quant_min, quant_max = ts.check_quant_range(int(attr("quant_min", lo)), int(attr("quant_max", hi)))
    scale = np.asarray(operands.get("scale"))
    zero_point = np.asarray(operands.get("zero_point"))
    axis_attr = attr("axis", None)
    axis, _ = torch_layout(scale.shape, np.shape(inputs), None if axis_attr is None else int(axis_attr))
    qscheme = str(attr("qscheme", ""))
    symmetric = "symmetric" in qscheme if qscheme else bool(quant_min < 0 and not np.any(zero_point))
    xp, (g, x) = to_device([gradients, inputs], device)
    result = channel_report_of(x, None, None, g, variant="torch", axis=axis, percentiles=percentiles,
                               torch=dict(scale=scale, zero_point=zero_point, quant_min=quant_min,
                                          quant_max=quant_max, symmetric=symmetric))
    attrs = {"quant_min": quant_min, "quant_max": quant_max, "axis": axis,
             "qscheme": qscheme or ("symmetric" if symmetric else "affine") + " (inferred)"}
    return result, attrs


def summation_bound(g, a, name, dy):
    """``qgcli verify``: float32's worst-case error of the reduction ``name`` (LSQ's scale / zero-point
    gradient) over the terms of group ``g`` (attributes ``a``; ``dy``: |gradients| in float64)."""
    x = np.asarray(g["inputs"][()], dtype=np.float64)
    scale = np.asarray(g["scale"][()], dtype=np.float64)
    zp = np.asarray(g["zero_point"][()], dtype=np.float64)
    if scale.ndim == 1 and scale.size > 1:
        shape = [1] * x.ndim
        shape[int(a.get("axis", 0))] = scale.size
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    qmin, qmax = float(a.get("quant_min", 0)), float(a.get("quant_max", 255))
    gf = float(a.get("grad_factor", 1.0))
    q = np.round(x / scale) + zp
    if name.endswith("zero_point"):
        term = np.where((q < qmin) | (q > qmax), scale, 0.0)
    else:  # LSQ's scale gradient: the rounding residue inside, the clipped level outside
        term = np.where(q < qmin, qmin - zp, np.where(q > qmax, qmax - zp, np.clip(q, qmin, qmax) - zp - x / scale))
    terms = dy * np.abs(term) * gf
    n = dy.size if scale.size == 1 else dy.size // scale.size
    return float(n * 2.0 ** -23 * terms.sum())


# --- qgcli plot ste / hist / channels / staircase of a run-file group -------------------------------------------

def plot_problem(layer, kind):
    """Why ``qgcli plot KIND`` cannot draw the group (None: it can): ``channels`` draws a grid per channel."""
    shape = layer.datasets.get("scale", ((),))[0]
    if kind == "channels" and int(np.prod(shape, dtype=np.int64)) <= 1:
        return "plot channels draws per-channel groups only (this scale is per tensor)"
    return None


def plot_data(attrs, operands, *, with_gradients):
    """The arguments of :func:`qgcli.report.plots.level_data` for a run-file group, on PyTorch's own grid (its
    scale, zero point and quant_min/quant_max; half-to-even rounding): the forward op, the gradient function
    (the gradient op fed with ones), with gradients the op's ``backprops_wrt_input``, the clip masks on the
    rounded integer, channels last; ``grid`` the keyword arguments of :class:`qgcli.report.plots.LevelGrid`.
    ``attrs``: the group's attributes (with the options typed over them)."""
    attr = attrs.get
    num_bits = int(attr("num_bits", 8))
    lo, hi = fake_quant.quant_range(num_bits, bool(attr("narrow_range", False)))
    quant_min, quant_max = ts.check_quant_range(int(attr("quant_min", lo)), int(attr("quant_max", hi)))
    x = np.asarray(operands.get("inputs"), np.float32)
    scale = np.asarray(operands.get("scale"), np.float32)
    zero_point = np.asarray(operands.get("zero_point"))
    axis_attr = attr("axis", None)
    axis, _ = torch_layout(scale.shape, x.shape, None if axis_attr is None else int(axis_attr))
    g = operands.get("gradients", required=False) if with_gradients else None
    g = None if g is None else np.asarray(g, np.float32)
    if axis is None:
        scale, zero_point = scale.reshape(()), zero_point.reshape(())
        args = (scale, zero_point, quant_min, quant_max)
        forward, gradient = ts.fake_quantize_per_tensor_affine, ts.fake_quantize_per_tensor_affine_gradient
    else:
        args = (scale, zero_point, axis, quant_min, quant_max)
        forward, gradient = ts.fake_quantize_per_channel_affine, ts.fake_quantize_per_channel_affine_gradient
    outputs = forward(x, *args)
    mask = gradient(np.ones_like(x), x, *args)
    backprops = None if g is None else gradient(g, x, *args)
    view = ts.quantized_view(x, scale, zero_point, quant_min, quant_max, axis=axis)
    last = (lambda a: a) if axis is None else (lambda a: None if a is None else np.moveaxis(a, axis, -1))
    op = _torch_op_name(axis is not None, False)
    return dict(op=op, grid=dict(scale=scale, zero_level=zero_point, quant_min=quant_min, quant_max=quant_max,
                                 label=op, num_bits=num_bits),
                x=last(x), outputs=last(outputs), mask=last(mask), backprops=last(backprops), gradients=last(g),
                below=np.asarray(view.below), above=np.asarray(view.above),
                mask_range=_mask_edges(gradient, args, scale.shape, axis))


def _ordered(f):
    """float32 -> int64 keys in the floats' order (and back with :func:`_unordered`)."""
    i = np.asarray(f, np.float32).view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def _unordered(k):
    k = np.asarray(k, np.int64)
    return np.where(k < 0, (-k) | 0x80000000, k).astype(np.uint32).view(np.float32)


def _mask_edges(gradient, args, shape, axis):
    """``(lo, hi)``: the least and the greatest float32 input whose gradient (the op fed with ones) is 1, per
    channel, found by bisection on the float32 line with the op itself (the mask is one interval: the rounded
    integer grows with the input); -inf / inf where it reaches the end of the finite floats."""
    depth = int(np.prod(shape, dtype=np.int64))
    scale = np.asarray(args[0], np.float64).reshape(-1)
    zp = np.asarray(args[1], np.float64).reshape(-1)
    qmin, qmax = args[-2:]

    def inside(values):
        x = np.asarray(values, np.float32).reshape(1, depth) if axis is not None else np.float32(values[0])
        a = args if axis is None else args[:2] + (1,) + args[3:]
        return np.asarray(gradient(np.ones_like(x), x, *a)).reshape(-1) == 1

    centre = np.float32(((qmin + qmax) / 2 - zp) * scale)
    if not inside(centre).all():
        return None
    top = _ordered(np.float32(np.finfo(np.float32).max))
    edges = []
    for far in (-top, top):
        a, b = _ordered(centre), np.full(depth, far, np.int64)  # inside at a; b outside unless the op never clips
        whole = inside(_unordered(b))
        for _ in range(33):
            mid = (a + b) // 2
            ok = inside(_unordered(mid))
            a, b = np.where(ok, mid, a), np.where(ok, b, mid)
        edge = np.where(whole, np.inf if far > 0 else -np.inf, _unordered(a)).astype(np.float32)
        edges.append(edge.reshape(()) if axis is None else edge)
    return tuple(edges)
