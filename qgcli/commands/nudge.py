"""Grids and semantics: ``qgcli nudge``, ``qgcli compare-semantics``, and what ``fakequant`` /
``fakequant-grad`` do with ``--semantics torch`` and ``--estimator``.

``nudge`` explains TensorFlow's grid for a range (and PyTorch's choice for the same range);
``compare-semantics`` runs one tensor under both frameworks' conventions and says where and why they
disagree; :func:`run_semantics` is the PyTorch / estimator branch of the fakequant commands (they call
it first and fall back to their TensorFlow path when it declines).  Only click is imported at module level.
"""
import click

from qgcli.commands._common import Operands, emit, json_safe, percent, report_options

SEMANTICS = ("tf", "torch")

_SEMANTICS_HELP = {
    "semantics": "Whose fake-quant: tf (TensorFlow's nudged min/max grid, the default) or torch (PyTorch's "
                 "fake_quantize_per_{tensor,channel}_affine on --scale/--zero-point).",
    "scale": "PyTorch scale (--semantics torch): a scalar (per tensor) or one per channel.",
    "zero_point": "PyTorch zero point (--semantics torch): like scale; an integer dtype (or an integral literal) "
                  "uses the integer kernels, a float one PyTorch's float-zero-point kernels.",
    "quant_min": "PyTorch quant_min (--semantics torch); default 0, or 1 with --narrow-range.",
    "quant_max": "PyTorch quant_max (--semantics torch); default 2^num_bits - 1.",
}


class GradFactor(click.ParamType):
    """A finite float, or ``auto`` for LSQ's ``1/sqrt(N * quant_max)``."""

    name = "F|auto"

    def convert(self, value, param, ctx):
        import math

        if isinstance(value, float) or value == "auto":
            return value
        text = str(value).strip().lower()
        if text == "auto":
            return "auto"
        try:
            number = float(text)
        except ValueError:
            self.fail(f"{value!r} is not a number or 'auto'", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not finite", param, ctx)
        return number


def semantics_options(f):
    """--semantics, --scale, --zero-point, --quant-min, --quant-max (for fakequant and fakequant-grad)."""
    f = click.option("--quant-max", type=int, default=None, help=_SEMANTICS_HELP["quant_max"])(f)
    f = click.option("--quant-min", type=int, default=None, help=_SEMANTICS_HELP["quant_min"])(f)
    f = click.option("--zero-point", "zero_point", metavar="SPEC", help=_SEMANTICS_HELP["zero_point"])(f)
    f = click.option("--scale", metavar="SPEC", help=_SEMANTICS_HELP["scale"])(f)
    f = click.option("--semantics", type=click.Choice(SEMANTICS), default="tf", show_default=True,
                     help=_SEMANTICS_HELP["semantics"])(f)
    return f


def estimator_options(f):
    """--estimator, --grad-factor (for fakequant-grad)."""
    f = click.option("--grad-factor", type=GradFactor(), default=None,
                     help="LSQ gradient scale g for --estimator lsq: a number, or auto = 1/sqrt(N*quant_max) "
                          "(N: elements per step size). Default: 1.0 with --semantics torch (PyTorch's op), "
                          "auto with tf.")(f)
    f = click.option("--estimator", metavar="NAME[:PARAMS]", default=None,
                     help="Gradient estimator: ste (default: the framework's clipped STE), identity, scaled:G[,E], "
                          "lsq, pact, ewgs:DELTA. See the README for the formulas.")(f)
    return f


# --- the --semantics torch / --estimator branch of fakequant and fakequant-grad --------------------------

def run_semantics(command, *, bundle, specs, semantics="tf", scale=None, zero_point=None, quant_min=None,
                  quant_max=None, estimator=None, grad_factor=None, output, force, num_bits, narrow_range, variant,
                  axis, as_json, quiet, device, with_gradients, plot=None):
    """Run ``command`` under PyTorch semantics or with a non-default estimator; return False (doing nothing)
    when TensorFlow's own op applies, so the caller runs its TensorFlow path."""
    from qgcli.ops.estimators import parse_estimator

    est = parse_estimator(estimator) if estimator is not None else None
    torch_given = {"--scale": scale, "--zero-point": zero_point, "--quant-min": quant_min, "--quant-max": quant_max}
    if semantics == "tf":
        for option, value in torch_given.items():
            if value is not None:
                raise click.BadParameter("only applies to --semantics torch", param_hint=f"'{option}'")
        if grad_factor is not None and (est is None or est.name != "lsq"):
            raise click.BadParameter("only applies to --estimator lsq", param_hint="'--grad-factor'")
        if est is None or est.name == "ste":
            return False
        if plot:
            raise click.BadParameter(f"draws TensorFlow's STE only; for --estimator {est.text} use "
                                     "'qgcli plot estimators'", param_hint="'--plot'")
        _run_tf_estimator(command, bundle, specs, est, grad_factor, output=output, force=force, num_bits=num_bits,
                          narrow_range=narrow_range, variant=variant, axis=axis, as_json=as_json, quiet=quiet,
                          device=device)
        return True
    if grad_factor is not None and (est is None or est.name != "lsq"):
        raise click.BadParameter("only applies to --estimator lsq", param_hint="'--grad-factor'")
    for name in ("min", "max"):
        if specs.get(name) is not None:
            raise click.BadParameter("is TensorFlow's operand; with --semantics torch give --scale and --zero-point "
                                     "(qgcli nudge -o writes TensorFlow's grid as scale/zero_point)",
                                     param_hint=f"'--{name}'")
    if variant is not None:
        raise click.BadParameter("chooses a TensorFlow op; PyTorch's op follows the shape of scale",
                                 param_hint="'--variant'")
    if plot:
        raise click.BadParameter("draws TensorFlow's STE only; use 'qgcli plot estimators --semantics torch'",
                                 param_hint="'--plot'")
    _run_torch(command, bundle, specs, scale, zero_point, quant_min, quant_max, est, grad_factor, output=output,
               force=force, num_bits=num_bits, narrow_range=narrow_range, axis=axis, as_json=as_json, quiet=quiet,
               device=device, with_gradients=with_gradients)
    return True


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


def _zero_point_from_literal(text, value):
    """An integral literal zero point (``--zero-point 128``) is an int32, as PyTorch's observers give it."""
    import numpy as np

    from qgcli import io

    if text is None or io.parse_spec(text, allow_literal=True).literal is None:
        return value
    value = np.asarray(value)
    if np.all(np.isfinite(value)) and np.all(value == np.round(value)) and np.all(np.abs(value) < 2**31):
        return value.astype(np.int32)
    return value


def _torch_op_name(per_channel, learnable):
    kind = "per_channel" if per_channel else "per_tensor"
    return f"torch.{'_' if learnable else ''}fake_quantize_{'learnable_' if learnable else ''}{kind}_affine"


def _run_torch(command, bundle, specs, scale_spec, zp_spec, quant_min, quant_max, est, grad_factor, *, output, force,
               num_bits, narrow_range, axis, as_json, quiet, device, with_gradients):
    import math

    import numpy as np

    from qgcli.commands._common import describe_arrays, to_device, write_outputs
    from qgcli.ops import estimators, fake_quant, torch_semantics as ts

    default_min, default_max = fake_quant.quant_range(num_bits, narrow_range)
    quant_min = default_min if quant_min is None else quant_min
    quant_max = default_max if quant_max is None else quant_max
    quant_min, quant_max = ts.check_quant_range(quant_min, quant_max)
    est = est or estimators.parse_estimator("ste")
    learnable = est.name == "lsq"
    operand_specs = {"inputs": specs.get("inputs"), "scale": scale_spec, "zero_point": zp_spec}
    if with_gradients:
        operand_specs["gradients"] = specs.get("gradients")
    operands = Operands(bundle, operand_specs, literal_ok=("scale", "zero_point"))
    notes = []
    try:
        gradients = operands.get("gradients") if with_gradients else None
        inputs = operands.get("inputs")
        scale = np.asarray(operands.get("scale"))
        zero_point = _zero_point_from_literal(zp_spec, operands.get("zero_point"))
        channel_axis, note = torch_layout(scale.shape, np.shape(inputs), axis)
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
        xp, (gradients, inputs) = to_device([gradients, inputs], device)
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
            "command": command, "op": op, "semantics": "torch", "estimator": details,
            "attributes": {k: v for k, v in attrs.items() if k != "op"},
            "inputs": {**describe_arrays({k: v for k, v in (("gradients", gradients), ("inputs", inputs),
                                                             ("scale", scale), ("zero_point", zero_point))
                                          if v is not None})},
            "grid": {"quant_min": quant_min, "quant_max": quant_max, "axis": channel_axis,
                     "scale": np.asarray(scale, np.float64).tolist(),
                     "zero_point": np.asarray(zero_point, np.float64).tolist()},
            "statistics": stats, "outputs": describe_arrays(out), "output": output, "notes": notes,
        })
        write_outputs(out, output, operands=operands, force=force, attrs=attrs)
    finally:
        operands.close()
    emit(summary, as_json=as_json, quiet=quiet, render=_render_torch, output=output)


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


def _render_torch(console, s):
    from rich.markup import escape

    grid = s["grid"]
    scale, zp = grid["scale"], grid["zero_point"]
    if isinstance(scale, list):
        shown = ", ".join(f"{a:.6g}/{b:g}" for a, b in list(zip(scale, zp))[:6])
        more = f" ... ({len(scale)} channels, axis {grid['axis']})" if len(scale) > 6 else f" (axis {grid['axis']})"
        params = f"scale/zero_point {shown}{more}"
    else:
        params = f"scale {scale:.7g}, zero_point {zp:g}"
    console.print(f"[bold]{s['op']}[/] quant_min={grid['quant_min']} quant_max={grid['quant_max']}  {params}",
                  soft_wrap=True)
    stats = s["statistics"]
    line = f"clipped below {percent(stats['clipped_below'])}, above {percent(stats['clipped_above'])} (rounded integer)"
    if "gradient_blocked" in stats:
        line += (f"; gradient mass blocked by the mask {percent(stats['gradient_blocked'])}, by the estimator "
                 f"{percent(stats['estimator_blocked'])}")
    console.print(line)
    est = s.get("estimator")
    if est:
        extra = f", grad_factor {est['grad_factor']:.7g}" if "grad_factor" in est else ""
        console.print(f"estimator {est['estimator']}{extra}")
    for note in s["notes"]:
        console.print(f"[yellow]note:[/] {escape(note)}")
    if s["output"] and s["output"] != "-":
        console.print(f"wrote {', '.join(s['outputs'])} to {escape(s['output'])}")


def _run_tf_estimator(command, bundle, specs, est, grad_factor, *, output, force, num_bits, narrow_range, variant,
                      axis, as_json, quiet, device):
    from qgcli.commands._common import to_device, write_outputs
    from qgcli.commands.fakequant import TF_OPS, build_summary, load_fake_quant_operands, render_summary
    from qgcli.ops import estimators
    from qgcli.ops.analysis import blocked_by
    from qgcli.ops.fake_quant import _args_grid, as_float32, nudge

    operands = Operands(bundle, specs, literal_ok=("min", "max"))
    try:
        gradients, inputs, mn, mx, variant = load_fake_quant_operands(operands, variant, with_gradients=True)
        if variant not in TF_OPS:
            raise click.BadParameter(f"--estimator {est.text} works on the fake-quant ops ({', '.join(TF_OPS)})",
                                     param_hint="'--variant'")
        if axis is not None and variant != "per-channel":
            raise click.BadParameter("only applies to --variant per-channel", param_hint="'--axis'")
        xp, (gradients, inputs) = to_device([gradients, inputs], device)
        view = estimators.tf_view(inputs, mn, mx, num_bits=num_bits, narrow_range=narrow_range, variant=variant,
                                  axis=-1 if axis is None else axis)
        gf = None
        if est.name == "lsq":
            gf = estimators.lsq_grad_factor(view) if grad_factor in (None, "auto") else float(grad_factor)
        outputs, details = estimators.apply_estimator(est, gradients, view, grad_factor=gf)
        op = TF_OPS[variant] + "Gradient"
        attrs = {"op": op, "variant": variant, "num_bits": num_bits, "narrow_range": narrow_range,
                 "estimator": est.text, "grad_factor": details.get("grad_factor")}
        if variant == "per-channel":
            attrs["axis"] = -1 if axis is None else axis
            grid = nudge(mn, mx, num_bits=num_bits, narrow_range=narrow_range)
        elif variant == "args":
            attrs.update(min=float(mn), max=float(mx))
            grid = _args_grid(float(mn), float(mx), num_bits, narrow_range)
        else:
            grid = nudge(mn, mx, num_bits=num_bits, narrow_range=narrow_range)
        g = as_float32(gradients, "gradients", xp)
        if view.axis is not None:
            g = xp.moveaxis(g, view.axis, -1)
        raw = {"gradients": gradients, "inputs": inputs, "min": mn, "max": mx}
        summary = build_summary(command, op, variant, operands, raw, outputs, grid, view.inputs, g, attrs, output)
        summary["estimator"] = json_safe(details)
        summary["statistics"]["estimator_blocked"] = blocked_by(gradients, outputs["backprops_wrt_input"])
        write_outputs(outputs, output, operands=operands, force=force, attrs=attrs)
    finally:
        operands.close()

    def render(console, s):
        render_summary(console, s)
        est_ = s["estimator"]
        extra = f", grad_factor {est_['grad_factor']:.7g}" if "grad_factor" in est_ else ""
        console.print(f"estimator {est_['estimator']}{extra} (TensorFlow's grid; outputs "
                      f"{', '.join(s['outputs'])}); it blocks {percent(s['statistics']['estimator_blocked'])} "
                      "of the gradient mass")

    emit(summary, as_json=as_json, quiet=quiet, render=render, output=output)


# --- qgcli nudge ------------------------------------------------------------------------------------------

def explain_grid(mn, mx, *, num_bits=8, narrow_range=False):
    """TF's grid for ``[mn, mx]`` (scalars or 1-d), PyTorch's observer grid beside it, and warnings.

    Returns a JSON-ready dict: ``grid`` (lists for per-channel), ``torch`` and ``warnings`` (each with
    ``channel``, ``kind`` and ``message``); kinds: ``zero-not-in-range``, ``reversed``, ``empty``,
    ``passthrough``, ``zero-point-tie``, ``zero-point-clamped``.
    """
    import numpy as np

    from qgcli.errors import OperandError
    from qgcli.ops import fake_quant, torch_semantics as ts

    for name, value in (("min", mn), ("max", mx)):
        dtype = np.asarray(value).dtype
        if dtype.kind not in "fiu" and dtype.name != "bfloat16":
            raise OperandError(f"dtype {dtype} is not a real number type", operand=name)
    mn32 = np.asarray(mn).astype(np.float32)
    mx32 = np.asarray(mx).astype(np.float32)
    for name, a in (("min", mn32), ("max", mx32)):
        if a.ndim > 1:
            raise OperandError(f"must be a scalar or 1-d (one per channel), got shape {list(a.shape)}", operand=name)
        if not np.isfinite(a).all():
            raise OperandError("must be finite", operand=name)
    if mn32.shape != mx32.shape:
        raise OperandError(f"shape {list(mn32.shape)} differs from max shape {list(mx32.shape)}", operand="min")
    grid = fake_quant.nudge(mn32, mx32, num_bits=num_bits, narrow_range=narrow_range)
    per_channel = mn32.ndim == 1
    qmin, qmax = grid.quant_min, grid.quant_max
    t_scale, t_zp = ts.observer_qparams(mn32, mx32, qmin, qmax)

    def plain(a, kind=float):
        a = np.asarray(a)
        return [kind(v) for v in a.tolist()] if a.ndim else kind(a)

    warnings = []
    flat = lambda a: np.atleast_1d(np.asarray(a))  # noqa: E731
    for c in range(flat(mn32).size):
        lo, hi = float(flat(mn32)[c]), float(flat(mx32)[c])
        where = c if per_channel else None
        zf = float(flat(grid.zero_point_from_min)[c])
        nlo, nhi = float(flat(grid.nudged_min)[c]), float(flat(grid.nudged_max)[c])

        def warn(kind, message, where=where):
            warnings.append({"channel": where, "kind": kind, "message": message})

        if lo == hi == 0:
            warn("passthrough", "min == max == 0: TensorFlow's forward gives zeros and the gradient passes through")
            continue
        if lo > hi:
            warn("reversed", f"min {lo:g} > max {hi:g}: TensorFlow returns meaningless values (qgcli fakequant "
                             "refuses the range)")
            continue
        if lo == hi:
            warn("empty", f"min == max == {lo:g}: an empty range; TensorFlow returns meaningless values (qgcli "
                          "fakequant refuses it)")
            continue
        if lo > 0 or hi < 0:
            warn("zero-not-in-range", f"[{lo:g}, {hi:g}] does not contain 0: TensorFlow shifts it to "
                                      f"[{nlo:g}, {nhi:g}] so that 0 is a grid point (tensorflow/tensorflow#16995); "
                                      "PyTorch's observers widen it to 0 instead")
        if zf - np.floor(zf) == 0.5 and qmin <= zf <= qmax:
            away, even = int(np.floor(zf + 0.5)), int(np.rint(zf))
            other = (f"gives {even}, one step of range shift" if even != away else f"gives the same {even} here")
            warn("zero-point-tie", f"zero point from min {zf:g} is exactly on a tie: TensorFlow (eager) rounds half "
                                   f"away from zero to {away}; half to even (XLA before tensorflow/tensorflow#117965, "
                                   f"PyTorch) {other}")
        if zf < qmin or zf > qmax:
            edge = qmin if zf < qmin else qmax
            warn("zero-point-clamped", f"zero point from min {zf:g} lies outside [{qmin}, {qmax}]: clamped to the "
                                       f"grid edge {edge}")
    return {
        "num_bits": grid.num_bits, "narrow_range": grid.narrow_range, "quant_min": qmin, "quant_max": qmax,
        "levels": qmax - qmin + 1, "per_channel": per_channel,
        "grid": {
            "min": plain(grid.min), "max": plain(grid.max), "scale": plain(grid.scale),
            "inv_scale": plain(grid.inv_scale), "zero_point_from_min": plain(grid.zero_point_from_min),
            "zero_point": plain(grid.zero_point, int), "nudged_min": plain(grid.nudged_min),
            "nudged_max": plain(grid.nudged_max),
        },
        "torch": {"scale": plain(t_scale), "zero_point": plain(t_zp, int),
                  "same_grid": plain((t_scale == grid.scale) & (t_zp == grid.zero_point), bool)},
        "warnings": warnings,
        "_grid": grid,
    }


def _render_nudge(console, doc):
    from rich.markup import escape
    from rich.table import Table

    g = doc["grid"]
    console.print(f"[bold]TensorFlow grid[/] num_bits={doc['num_bits']}"
                  f"{' narrow_range' if doc['narrow_range'] else ''}: integers [{doc['quant_min']}, "
                  f"{doc['quant_max']}], {doc['levels']} levels")
    cols = ("min", "max", "scale", "inv_scale", "zero_point_from_min", "zero_point", "nudged_min", "nudged_max")
    table = Table(show_edge=False, box=None, pad_edge=False)
    table.add_column("")
    for col in cols + ("torch scale", "torch zp"):
        table.add_column(col, justify="right")
    rows = list(range(len(g["min"]))) if doc["per_channel"] else [None]
    for c in rows:
        pick = (lambda v: v[c]) if c is not None else (lambda v: v)  # noqa: E731
        table.add_row(f"ch {c}" if c is not None else "range",
                      *(f"{pick(g[k]):.9g}" if isinstance(pick(g[k]), float) else str(pick(g[k])) for k in cols),
                      f"{pick(doc['torch']['scale']):.9g}", str(pick(doc["torch"]["zero_point"])))
    console.print(table)
    console.print("scale = (max - min) / (quant_max - quant_min); zero point = round_half_away(quant_min - min/scale) "
                  "clamped to [quant_min, quant_max]; nudged = (quant_min|quant_max - zero_point) * scale. "
                  "torch: MinMaxObserver's choice for the same range.", soft_wrap=True, markup=False)
    for w in doc["warnings"]:
        where = f"channel {w['channel']}: " if w["channel"] is not None else ""
        console.print(f"[yellow]warning:[/] {escape(where + w['message'])}", soft_wrap=True)
    if not doc["warnings"]:
        console.print("no warnings")
    if doc.get("output") and doc["output"] != "-":
        console.print(f"wrote {', '.join(doc['written'])} to {escape(doc['output'])}")


_NUDGE_EPILOG = """\b
Examples:
  qgcli nudge --min -6 --max 6 --num-bits 2
  qgcli nudge --min 0.1 --max 5 --json
  qgcli nudge --min -1,-2,0.5 --max 1,2,3 -o grid.h5     # scale, zero_point, ... per channel
  qgcli nudge samples/per_channel.h5
"""


@click.command("nudge", epilog=_NUDGE_EPILOG, short_help="Explain TensorFlow's nudged grid for a range, with warnings.")
@click.argument("bundle", required=False, metavar="[BUNDLE]")
@click.option("--min", "min_", metavar="SPEC", help="Range minimum: a number, a list (per channel) or a tensor SPEC.")
@click.option("--max", "max_", metavar="SPEC", help="Range maximum, like --min.")
@click.option("--num-bits", type=int, default=8, show_default=True, help="Bit width, 2..16.")
@click.option("--narrow-range", is_flag=True, help="Use the grid [1, 2^num_bits - 1].")
@click.option("-o", "--output", "output", metavar="OUT", default=None,
              help="Also write the grid (scale, inv_scale, zero_point int32, zero_point_from_min, nudged_min, "
                   "nudged_max) as .h5/.npz/DIR/ or - (usable as --scale/--zero-point of --semantics torch).")
@click.option("--force", is_flag=True, help="Replace an existing output file.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
def nudge(bundle, min_, max_, num_bits, narrow_range, output, force, as_json):
    """Explain TensorFlow's grid for [MIN, MAX]: scale, inv_scale, the zero point from min and rounded, the
    nudged bounds, the number of levels, and PyTorch's observer choice for the same range.

    Warns when the range does not contain 0, min >= max, the zero point sits exactly on a .5 tie, or it
    is clamped to the grid edge. Scalars or per-channel lists; MIN/MAX may also come from BUNDLE.
    The explanation goes to stdout (a table, or JSON with --json).
    """
    import numpy as np

    from qgcli.commands._common import write_outputs

    operands = Operands(bundle, {"min": min_, "max": max_}, literal_ok=("min", "max"))
    try:
        doc = explain_grid(operands.get("min"), operands.get("max"), num_bits=num_bits, narrow_range=narrow_range)
        grid = doc.pop("_grid")
        doc = {"command": "nudge", **doc, "output": output}
        if output is not None:
            if as_json and output == "-":
                raise click.UsageError("--json and -o - both want stdout; write the grid to a file or drop --json")
            arrays = {"scale": grid.scale, "inv_scale": grid.inv_scale,
                      "zero_point": grid.zero_point.astype(np.int32), "zero_point_from_min": grid.zero_point_from_min,
                      "nudged_min": grid.nudged_min, "nudged_max": grid.nudged_max}
            doc["written"] = list(arrays)
            write_outputs(arrays, output, operands=operands, force=force,
                          attrs={"op": "Nudge", "num_bits": num_bits, "narrow_range": narrow_range,
                                 "quant_min": grid.quant_min, "quant_max": grid.quant_max})
    finally:
        operands.close()
    if as_json:
        emit(json_safe(doc), as_json=True, quiet=False, render=None)
        return
    if output == "-":
        emit(json_safe(doc), as_json=False, quiet=False, render=_render_nudge)  # the table to stderr
        return
    from qgcli.commands.inspect import _stdout_console

    _render_nudge(_stdout_console(), json_safe(doc))


# --- qgcli compare-semantics ------------------------------------------------------------------------------

def _first_indices(mask, k):
    import numpy as np

    from qgcli.backend import to_numpy

    flat = np.flatnonzero(to_numpy(mask).reshape(-1))[:k]
    return [list(map(int, np.unravel_index(i, mask.shape))) for i in flat] if mask.ndim else [[] for _ in flat]


def summarise_comparison(result, first=10):
    """Counts, shares, first indices and reasons from :func:`qgcli.ops.torch_semantics.compare_with_tensorflow`."""
    import numpy as np

    from qgcli.backend import to_numpy
    from qgcli.ops.torch_semantics import FORWARD_REASONS, MASK_REASONS

    n = int(result["outputs_tf"].size)
    grids = result["grids"]
    doc = {"elements": n}
    for part, key, reasons in (("forward", "forward_reason", FORWARD_REASONS), ("mask", "mask_reason", MASK_REASONS)):
        codes = to_numpy(result[key])
        counts = np.bincount(codes.reshape(-1), minlength=len(reasons))
        differ = int(n - counts[0])
        doc[part] = {"differ": differ, "share": differ / n if n else 0.0,
                     "first": _first_indices(codes != 0, first),
                     "reasons": {reasons[c]: int(counts[c]) for c in range(1, len(reasons)) if counts[c]}}
    mtf, mpt = to_numpy(result["mask_tf"]).astype(bool), to_numpy(result["mask_torch"]).astype(bool)
    doc["mask"]["tf_only"] = int((mtf & ~mpt).sum())
    doc["mask"]["torch_only"] = int((~mtf & mpt).sum())
    if "backprops_wrt_input_tf" in result:
        # Only the gradients' magnitudes matter here; NaN/inf upstream values count as 0.
        g_tf = to_numpy(result["backprops_wrt_input_tf"]).astype(np.float64)
        g_pt = to_numpy(result["backprops_wrt_input_torch"]).astype(np.float64)
        with np.errstate(all="ignore"):
            mag = np.where(mtf, np.abs(g_tf), np.abs(g_pt))
            mag = np.where(np.isfinite(mag), mag, 0.0)
        total_tf = float(np.where(np.isfinite(g_tf), np.abs(g_tf), 0).sum())
        moved = float(np.where(mtf != mpt, mag, 0.0).sum())
        doc["gradient"] = {"mass_on_differing_mask": moved / total_tf if total_tf else 0.0}
    tf = grids["tf"]

    def plain(a, kind=float):
        a = np.asarray(a)
        return [kind(v) for v in a.tolist()] if a.ndim else kind(a)

    doc["grids"] = {
        "per_channel": grids["per_channel"], "axis": grids["axis"], "quant_min": grids["quant_min"],
        "quant_max": grids["quant_max"],
        "tf": {"scale": plain(tf.scale), "zero_point": plain(tf.zero_point, int), "nudged_min": plain(tf.nudged_min),
               "nudged_max": plain(tf.nudged_max)},
        "torch": {"scale": plain(grids["torch_scale"]), "zero_point": plain(grids["torch_zero_point"], int)},
        "differ": [bool(r) for r in grids["reasons"]],
        "reasons": [{"channel": c if grids["per_channel"] else None, "reasons": r}
                    for c, r in enumerate(grids["reasons"]) if r],
    }
    return doc


_WHY = {
    "grid": "the grids differ (see above)",
    "tie": "x/scale exactly on a half step: TF rounds half up (floor(v + 0.5)), PyTorch half to even",
    "arithmetic": "TF rounds (clamp(x) - nudged_min)/scale, PyTorch x*(1/scale): different float rounding next "
                  "to a half step",
    "nonfinite": "NaN/inf input: TF propagates NaN, PyTorch returns a grid edge",
    "rounded": "TF masks the float input on the nudged bounds, PyTorch the rounded integer: up to half a step "
               "outside the range still passes in PyTorch",
}


def _render_compare(console, s):
    from rich.markup import escape

    grids = s["grids"]
    console.print(f"[bold]TensorFlow vs PyTorch[/] on {s['elements']:,} elements, integers "
                  f"\\[{grids['quant_min']}, {grids['quant_max']}]"
                  + (f", per channel on axis {grids['axis']}" if grids["per_channel"] else ""))
    tf, pt = grids["tf"], grids["torch"]
    if grids["per_channel"]:
        same = sum(1 for d in grids["differ"] if not d)
        console.print(f"grids: {same} of {len(grids['differ'])} channels identical (scale and zero point)")
    else:
        console.print(f"grid TF: scale {tf['scale']:.7g}, zero point {tf['zero_point']} (nudged [{tf['nudged_min']:.7g},"
                      f" {tf['nudged_max']:.7g}]); PyTorch: scale {pt['scale']:.7g}, zero point {pt['zero_point']}",
                      markup=False)
    for r in grids["reasons"][:8]:
        where = f"channel {r['channel']}: " if r["channel"] is not None else ""
        for why in r["reasons"]:
            console.print(f"  {escape(where + why)}", soft_wrap=True)
    for part, label in (("forward", "forward values"), ("mask", "gradient masks")):
        d = s[part]
        console.print(escape(f"{label} differ at {d['differ']:,} elements ({percent(d['share'])})"
                             + (f"; first {', '.join(map(str, d['first'][:5]))}" if d["first"] else "")))
        for reason, count in d["reasons"].items():
            console.print(f"  {count:,} {reason}: {escape(_WHY[reason])}", soft_wrap=True)
    m = s["mask"]
    if m["differ"]:
        console.print(f"  pass in TF only: {m['tf_only']:,}; in PyTorch only: {m['torch_only']:,}")
    if "gradient" in s:
        console.print(f"upstream gradient mass where the masks differ: {percent(s['gradient']['mass_on_differing_mask'])}")
    if s.get("output") and s["output"] != "-":
        console.print(f"wrote {', '.join(s['written'])} to {escape(s['output'])}")


_COMPARE_EPILOG = """\b
Examples:
  qgcli compare-semantics samples/notebook.h5 --num-bits 2
  qgcli compare-semantics samples/per_channel.h5 --json | jq .mask
  qgcli compare-semantics --inputs x.npy --min 0.1 --max 5 -o diff.h5
"""


@click.command("compare-semantics", epilog=_COMPARE_EPILOG,
               short_help="Where TensorFlow's and PyTorch's fake quant disagree on a tensor, and why.")
@click.argument("bundle", required=False, metavar="[BUNDLE]")
@click.option("--inputs", metavar="SPEC", help="The tensor (operand 'inputs').")
@click.option("--gradients", metavar="SPEC", help="Optional upstream gradient: also the gradient mass affected.")
@click.option("--min", "min_", metavar="SPEC", help="Range minimum: scalar or one per channel.")
@click.option("--max", "max_", metavar="SPEC", help="Range maximum: scalar or one per channel.")
@click.option("--num-bits", type=int, default=8, show_default=True, help="Bit width, 2..16.")
@click.option("--narrow-range", is_flag=True, help="Use the grid [1, 2^num_bits - 1] (both frameworks).")
@click.option("--axis", type=int, default=None, help="Channel axis for per-channel min/max (default -1, TF's).")
@click.option("--first", type=click.IntRange(0, 1000), default=10, show_default=True,
              help="How many differing indices to list.")
@click.option("-o", "--output", "output", metavar="OUT", default=None,
              help="Also write outputs_tf/_torch, mask_tf/_torch, forward_reason, mask_reason (and "
                   "backprops_wrt_input_tf/_torch with gradients).")
@click.option("--force", is_flag=True, help="Replace an existing output file.")
@report_options
def compare_semantics(bundle, inputs, gradients, min_, max_, num_bits, narrow_range, axis, first, output, force,
                      as_json, quiet, device):
    """Run one tensor through TensorFlow's FakeQuantWithMinMaxVars(PerChannel) and PyTorch's
    fake_quantize_per_{tensor,channel}_affine, each deriving its grid from MIN/MAX as it would (TF
    nudges the range; PyTorch's MinMaxObserver widens it to 0 and rounds the zero point half to even),
    and report where forward values and gradient masks disagree: counts, shares, first indices and why
    (grid, tie rounding, float arithmetic, mask on the float vs the rounded value).
    """
    from qgcli.commands._common import to_device, write_outputs
    from qgcli.ops.torch_semantics import FORWARD_REASONS, MASK_REASONS, compare_with_tensorflow

    operands = Operands(bundle, {"inputs": inputs, "gradients": gradients, "min": min_, "max": max_},
                        literal_ok=("min", "max"))
    try:
        x = operands.get("inputs")
        g = operands.get("gradients", required=False) if (gradients is not None or bundle is not None) else None
        mn, mx = operands.get("min"), operands.get("max")
        import numpy as np

        if axis is not None and np.ndim(mn) != 1:
            raise click.BadParameter("only applies to per-channel (1-d) min/max", param_hint="'--axis'")
        xp, (g, x) = to_device([g, x], device)
        result = compare_with_tensorflow(x, mn, mx, num_bits=num_bits, narrow_range=narrow_range, axis=axis,
                                         gradients=g)
        doc = {"command": "compare-semantics", **summarise_comparison(result, first), "output": output}
        if output is not None:
            arrays = {k: v for k, v in result.items() if k != "grids"}
            doc["written"] = list(arrays)
            write_outputs(arrays, output, operands=operands, force=force, attrs={
                "op": "compare-semantics", "num_bits": num_bits, "narrow_range": narrow_range,
                "forward_reason_codes": ", ".join(f"{k}={v}" for k, v in FORWARD_REASONS.items()),
                "mask_reason_codes": ", ".join(f"{k}={v}" for k, v in MASK_REASONS.items())})
    finally:
        operands.close()
    emit(json_safe(doc), as_json=as_json, quiet=quiet, render=_render_compare, output=output)
