"""TensorFlow's QuantizeAndDequantizeV2/V3/V4 forward and QuantizeAndDequantizeV4Grad
(``--variant quantize-and-dequantize-v4|-v3|-v2``).

Operands under TF's names ``input``, ``input_min``, ``input_max`` (``inputs``/``min``/``max`` accepted too) and
``gradients``; outputs ``output`` (forward), ``input_backprop``, ``input_min_backprop``, ``input_max_backprop``
(V4Grad; V2/V3 register a pass-through gradient in TF: ``input_backprop = gradients`` only).  Another
``--estimator`` runs on this grid, masking on the given ``[input_min, input_max]`` as V4Grad does.
"""
import numpy as np

from qgcli.backend import to_numpy
from qgcli.errors import OptionError

from qgcli.families.registry import FAKE_QUANT
from qgcli.jobs import FakeQuantJob, OperandSpecs, Result
from qgcli.ops import quantize_and_dequantize as ops
from qgcli.ops.estimators import Quantized
from qgcli.ops.subnormals import flush_subnormals
from qgcli.storage.operands import Operands, to_device
from qgcli.report.summaries import describe_arrays, json_safe, render_closing_lines

NAME, KIND = "quantize-and-dequantize", FAKE_QUANT
LITERAL_OK = ("input_min", "input_max", "min", "max")
ALIASES = {"input": "inputs", "input_min": "min", "input_max": "max"}
OPS = {"quantize-and-dequantize-v4": "QuantizeAndDequantizeV4", "quantize-and-dequantize-v3": "QuantizeAndDequantizeV3",
       "quantize-and-dequantize-v2": "QuantizeAndDequantizeV2"}


def claims(o):
    return o.attributes.variant in OPS and o.semantics.semantics != "torchao"


def refuse_options_outside(o):
    """Other variants: QuantizeAndDequantize's operand names and attributes do not apply."""
    for name in ("input", "input_min", "input_max"):
        if o.operands.get(name) is not None:
            raise OptionError("is QuantizeAndDequantize's operand; give --variant quantize-and-dequantize-v4 "
                              "(or -v3/-v2), or use --inputs/--min/--max", param_hint=f"'--{name.replace('_', '-')}'")
    for option, value in (("--signed-input", getattr(o.qdq, "signed_input", None)),
                          ("--range-given", getattr(o.qdq, "range_given", None))):
        if value is not None:
            raise OptionError("only applies to --variant quantize-and-dequantize-v4/-v3/-v2",
                              param_hint=f"'{option}'")


def mode(job):
    return f"--variant {job.variant}"


def job_from_options(o):
    """The FakeQuantJob of this family, options checked (called by the fakequant commands)."""
    command, with_gradients, operands, attributes = o.command, o.with_gradients, o.operands, o.attributes
    quantize, semantics, estimator, output, qdq = o.quantize, o.semantics, o.estimator, o.output, o.qdq
    variant = attributes.variant
    for option, value in {"--semantics": semantics.semantics, **semantics.torch_given()}.items():
        if value not in (None, False, "tf"):
            raise OptionError(f"does not apply to --variant {variant}", param_hint=f"'{option}'")
    for option in quantize.given():
        if option != "--round-mode":
            raise OptionError(f"is QuantizeV2's; it does not apply to --variant {variant}",
                                     param_hint=f"'{option}'")
    round_mode = quantize.round_mode or "HALF_TO_EVEN"
    if round_mode not in ("HALF_TO_EVEN", "HALF_UP"):
        raise OptionError(f"--variant {variant} rounds HALF_TO_EVEN or HALF_UP", param_hint="'--round-mode'")
    version = variant.rsplit("-", 1)[1]
    if version == "v3" and round_mode != "HALF_TO_EVEN":
        raise OptionError("QuantizeAndDequantizeV3 has no round_mode (always HALF_TO_EVEN)",
                                 param_hint="'--round-mode'")
    range_given = qdq.range_given if qdq is not None and qdq.range_given is not None else version == "v3"
    signed = qdq.signed_input if qdq is not None and qdq.signed_input is not None else True

    try:
        ops.check_attributes(signed_input=signed, num_bits=attributes.num_bits, round_mode=round_mode, version=version)
    except ValueError as exc:
        raise OptionError(str(exc).split(": ", 1)[-1], param_hint="'--num-bits'") from None
    est = None
    if with_gradients and estimator.estimator is not None:
        from qgcli.ops.estimators import parse_estimator

        est = parse_estimator(estimator.estimator)
    if output.plot and est is not None and est.name != "ste":
        raise OptionError(f"draws the STE only (TensorFlow's gradient); no figure for --estimator "
                                 f"{est.text} on --variant {variant}", param_hint="'--plot'")
    if estimator.grad_factor is not None and (est is None or est.name != "lsq"):
        raise OptionError("only applies to --estimator lsq", param_hint="'--grad-factor'")
    given = operands.as_dict()
    specs = {}
    for name, alias in ALIASES.items():
        specs[name] = given.get(name) if given.get(name) is not None else given.get(alias)
    if with_gradients:
        specs["gradients"] = given.get("gradients")
    return FakeQuantJob(command=command, family=NAME, with_gradients=with_gradients,
                        operands=OperandSpecs.of(operands.bundle, **specs), output=output,
                        num_bits=attributes.num_bits, narrow_range=attributes.narrow_range, variant=variant,
                        axis=attributes.axis, estimator=est, grad_factor=estimator.grad_factor,
                        qdq={"signed_input": signed, "range_given": range_given, "round_mode": round_mode})


def _get(operands, name, required=True):
    """Operand ``name`` from its option, else the bundle under TF's name or the FakeQuant alias."""
    if operands.has(name):
        return operands.get(name)
    alias = ALIASES.get(name)
    if alias is not None and operands.has(alias):
        return operands.get(alias)
    return operands.get(name, required=required)


def attributes(job):
    a = {"signed_input": bool(job.qdq["signed_input"]), "num_bits": int(job.num_bits),
         "range_given": bool(job.qdq["range_given"]), "narrow_range": bool(job.narrow_range),
         "axis": -1 if job.axis is None else int(job.axis)}
    if job.variant != "quantize-and-dequantize-v3":
        a["round_mode"] = job.qdq["round_mode"]
    return a


def compute(job, operands):
    attrs = attributes(job)
    version = job.variant.rsplit("-", 1)[1]
    x_raw = _get(operands, "input")
    mn_raw = _get(operands, "input_min", required=attrs["range_given"] or job.with_gradients)
    mx_raw = _get(operands, "input_max", required=attrs["range_given"] or job.with_gradients)
    g_raw = operands.get("gradients") if job.with_gradients else None
    xp, (g, x) = to_device([g_raw, x_raw], job.output.device)
    mn = np.float32(0) if mn_raw is None else mn_raw
    mx = np.float32(0) if mx_raw is None else mx_raw
    x32, grid, axis = ops.prepare(x, mn, mx, signed_input=attrs["signed_input"], num_bits=attrs["num_bits"],
                                  range_given=attrs["range_given"], round_mode=job.qdq["round_mode"],
                                  narrow_range=attrs["narrow_range"], axis=job.axis, version=version)
    out = ops.forward(x32, grid, range_given=attrs["range_given"], round_mode=job.qdq["round_mode"], axis=axis, xp=xp)
    notes, details = [], None
    op = OPS[job.variant]
    if not job.with_gradients:
        outputs = {"output": out}
    else:
        if job.estimator is None and version != "v4":
            from qgcli.ops.fake_quant import as_float32

            outputs = {"input_backprop": as_float32(g, "gradients", xp)}
            op += "Gradient (pass-through)"
            notes.append(f"TensorFlow registers a pass-through gradient for {OPS[job.variant]}: input_backprop = "
                         "gradients, no gradient for input_min/input_max")
        else:
            ib, imn, imx = ops.quantize_and_dequantize_v4_grad(g, x32, mn, mx, axis=axis)
            op = "QuantizeAndDequantizeV4Grad"
            outputs = {"input_backprop": ib, "input_min_backprop": imn, "input_max_backprop": imx}
            if job.estimator is not None and job.estimator.name != "ste":
                from qgcli.errors import OperandError
                from qgcli.ops.estimators import apply_estimator, lsq_grad_factor

                why = ops.estimator_refusal(job.estimator.name, grid, mn, mx, range_given=attrs["range_given"])
                if why is not None:
                    raise OperandError(why, operand="--estimator")
                view = _view(x32, out, grid, mn, mx, axis, xp)
                gf = None
                if job.estimator.name == "lsq":
                    gf = lsq_grad_factor(view) if job.grad_factor in (None, "auto") else float(job.grad_factor)
                outputs, details = apply_estimator(job.estimator, g, view, grad_factor=gf)
                op = f"QuantizeAndDequantize grid + --estimator {job.estimator.text}"
    summary = build_summary(job, op, attrs, operands, x32, g, grid, mn, mx, outputs, notes, xp)
    if details is not None:
        summary["estimator"] = json_safe(details)
    file_attrs = {"op": op, "variant": job.variant, **attrs}

    def figure():
        """The STE figure of this run: staircase, TF's gradient with ones (V4Grad, or V2/V3's pass-through)."""
        from qgcli.report import plots

        return plots.ste(x, mn, mx, gradients=g, variant=job.variant, num_bits=attrs["num_bits"],
                         narrow_range=attrs["narrow_range"], axis=attrs["axis"],
                         quantize={"signed_input": attrs["signed_input"], "range_given": attrs["range_given"],
                                   "round_mode": job.qdq["round_mode"]})

    return Result(outputs, file_attrs, summary, figure)


def _view(x, out, grid, mn, mx, axis, xp):
    """The estimators' :class:`Quantized` view of this grid, masking on the given range as V4Grad does."""
    lo = np.asarray(mn, np.float32)
    hi = np.asarray(mx, np.float32)
    last = (lambda a: a) if axis is None else (lambda a: xp.moveaxis(a, axis, -1))  # noqa: E731
    xf = last(flush_subnormals(x))
    o = last(out)
    inside = last(ops.grad_mask(x, lo, hi, axis, xp))
    with np.errstate(all="ignore"):
        residual = xp.subtract(o, xf, dtype=np.float32)
    lo_d, hi_d = xp.asarray(lo), xp.asarray(hi)
    return Quantized(inputs=xf, outputs=o, residual=residual, inside=inside, below=xf < lo_d, above=xf > hi_d,
                     scale=xp.asarray(grid.step), inv_scale=xp.asarray(grid.scale),
                     zero_point=xp.zeros(grid.step.shape, np.float32), quant_min=grid.quant_min,
                     quant_max=grid.quant_max, lo=lo_d, hi=hi_d, axis=axis, flush=True, semantics="tf")


def build_summary(job, op, attrs, operands, x, g, grid, mn, mx, outputs, notes, xp):
    n = int(x.size)
    xh = np.asarray(to_numpy(x))
    lo = grid.lo if job.axis is None else grid.lo.reshape((-1,) + (1,) * (x.ndim - job.axis - 1))
    hi = grid.hi if job.axis is None else grid.hi.reshape((-1,) + (1,) * (x.ndim - job.axis - 1))
    with np.errstate(all="ignore"):
        below = int((xh < lo).sum()) if n else 0
        above = int((xh > hi).sum()) if n else 0
    stats = {"elements": n, "clipped_below": below / n if n else 0.0, "clipped_above": above / n if n else 0.0}
    gmn, gmx = np.asarray(mn, np.float32), np.asarray(mx, np.float32)
    if attrs["range_given"]:
        outside = np.asarray((grid.lo < gmn) | (grid.hi > gmx))
        if outside.any():
            notes.append("the grid reaches outside [input_min, input_max] (TF picks the scale from the bound that "
                         "allows the finer step and extends the other side): outputs can fall outside the given range, "
                         "and V4Grad's mask still uses the given range")
        if (gmn > gmx).any():
            notes.append("some slices have input_min > input_max: TensorFlow accepts that per axis (not per tensor) "
                         "and builds the grid from the positive side alone")
    else:
        notes.append("range_given=false: the range comes from the data; input_min/input_max are not used by the "
                     "forward" + ("; V4Grad still masks on them, as TensorFlow does" if job.with_gradients else ""))
        if not attrs["signed_input"] and n and bool(np.nanmin(np.where(np.isnan(xh), 0, xh)) < 0):
            notes.append("signed_input=false with negative data and no given range: TensorFlow does not clamp, so "
                         "outputs below 0 appear; qgcli reproduces that")
    if g is not None:
        mask = np.asarray(to_numpy(outputs.get("input_backprop")))
        gh = np.abs(np.asarray(to_numpy(g), np.float64))
        gh = np.where(np.isfinite(gh), gh, 0.0)
        total = float(gh.sum())
        stats["gradient_blocked"] = float(np.where(mask == 0, gh, 0.0).sum()) / total if total else 0.0

    def plain(a):
        return np.asarray(a, np.float64).tolist()

    return json_safe({
        "command": job.command, "op": op, "variant": job.variant, "attributes": attrs,
        "inputs": describe_arrays({"input": xh} if g is None else {"gradients": to_numpy(g), "input": xh}),
        "grid": {"input_min": plain(grid.min), "input_max": plain(grid.max), "lo": plain(grid.lo),
                 "hi": plain(grid.hi), "step": plain(grid.step), "scale": plain(grid.scale),
                 "decided_by": np.where(grid.from_min, "input_min", "input_max").tolist(),
                 "quant_min": grid.quant_min, "quant_max": grid.quant_max},
        "statistics": stats, "outputs": describe_arrays(outputs), "output": job.output.destination, "notes": notes,
    })


def render(console, s):
    from rich.markup import escape

    a, gr, st = s["attributes"], s["grid"], s["statistics"]
    console.print(f"[bold]{escape(s['op'])}[/] " + " ".join(f"{k}={v}" for k, v in a.items()))
    rows = list(zip(*(gr[k] if isinstance(gr[k], list) else [gr[k]]
                      for k in ("input_min", "input_max", "lo", "hi", "step", "decided_by"))))
    for i, (mn, mx, lo, hi, step, by) in enumerate(rows[:8]):
        label = "range" if len(rows) == 1 and not isinstance(gr["lo"], list) else f"slice {i}"
        console.print(f"{label}: [{mn:.7g}, {mx:.7g}] -> grid [{lo:.7g}, {hi:.7g}] step {step:.7g} "
                      f"(q {gr['quant_min']}..{gr['quant_max']}, decided by {by})")
    if len(rows) > 8:
        console.print(f"... {len(rows) - 8} more slices")
    line = f"outside the grid: below {st['clipped_below']:.2%}, above {st['clipped_above']:.2%}"
    if "gradient_blocked" in st:
        line += f"; gradient mass blocked {st['gradient_blocked']:.2%}"
    console.print(line)
    render_closing_lines(console, s)


def nudge_doc(bundle, min_, max_, *, num_bits, narrow_range, variant, signed_input):
    """``qgcli nudge --variant quantize-and-dequantize-v*``: ``(doc, arrays to write, file attributes, operands)``.

    ``--min``/``--max`` (or the bundle's ``input_min``/``input_max``, else ``min``/``max``) are the given range;
    the caller closes ``operands``.
    """
    signed = True if signed_input is None else bool(signed_input)
    version = variant.rsplit("-", 1)[1]
    operands = Operands(bundle, {"input_min": min_, "input_max": max_}, literal_ok=("input_min", "input_max"))
    try:
        try:
            ops.check_attributes(signed_input=signed, num_bits=num_bits, version=version)
        except ValueError as exc:
            raise OptionError(str(exc).split(": ", 1)[-1], param_hint="'--num-bits'") from None
        for name in ("input_min", "input_max"):
            if not (operands.has(name) or operands.has(ALIASES[name])):
                flag = "--min" if name == "input_min" else "--max"
                raise OptionError(f"missing: give {flag} (or a BUNDLE holding {name} or "
                                         f"{ALIASES[name]})", param_hint=f"'{flag}'")
        doc = ops.explain_grid(_get(operands, "input_min"), _get(operands, "input_max"), signed_input=signed,
                               num_bits=num_bits, narrow_range=narrow_range)
    except BaseException:
        operands.close()
        raise
    grid = doc.pop("_grid")
    doc = {"command": "nudge", "variant": variant, "op": OPS[variant], **doc}
    arrays = {"scale": grid.scale, "step": grid.step, "lo": grid.lo, "hi": grid.hi,
              "decided_by_min": grid.from_min.astype(np.int8)}
    attrs = {"op": f"{OPS[variant]} grid", "variant": variant, "num_bits": int(num_bits), "signed_input": signed,
             "narrow_range": bool(narrow_range), "quant_min": grid.quant_min, "quant_max": grid.quant_max}
    return doc, arrays, attrs, operands


def plot_operands(operands, variant, qdq, quantize, axis, channel):
    """``plot staircase|ste --variant quantize-and-dequantize-v*``: ``(input, input_min, input_max, attrs)``.

    ``attrs`` (signed_input, range_given, round_mode) for :func:`qgcli.report.plots.run_variant`'s ``quantize``;
    options are checked as ``fakequant`` checks them.  The range is needed with range_given and for V4's
    mask (V4Grad masks on it); V2/V3 without a given range draw without one.
    """
    for option in quantize.given():
        if option != "--round-mode":
            raise OptionError(f"is QuantizeV2's; it does not apply to --variant {variant}",
                                     param_hint=f"'{option}'")
    return load_operands(operands, variant, qdq, quantize.round_mode, axis, channel, "V4Grad, the gradient drawn")


def load_operands(operands, variant, qdq, round_mode, axis, channel=None, why_range="V4Grad masks on it"):
    """``(input, input_min, input_max, attrs)`` for plots and ``qgcli report`` (see :func:`plot_operands`)."""
    version = variant.rsplit("-", 1)[1]
    round_mode = round_mode or "HALF_TO_EVEN"
    if round_mode not in ("HALF_TO_EVEN", "HALF_UP") or (version == "v3" and round_mode != "HALF_TO_EVEN"):
        raise OptionError(f"--variant {variant} rounds " + ("HALF_TO_EVEN only" if version == "v3" else
                                                                   "HALF_TO_EVEN or HALF_UP"),
                                 param_hint="'--round-mode'")
    range_given = qdq.range_given if qdq is not None and qdq.range_given is not None else version == "v3"
    signed = qdq.signed_input if qdq is not None and qdq.signed_input is not None else True
    need = range_given or version == "v4"
    if need and not (operands.has("input_min") or operands.has("min")):
        why = "--range-given clamps to it" if range_given else why_range
        raise OptionError(f"--variant {variant} needs the range ({why}): give --min and --max",
                                 param_hint="'--min'")
    x = _get(operands, "input")
    mn = _get(operands, "input_min", required=need)
    mx = _get(operands, "input_max", required=need)
    if (mn is None) != (mx is None):
        raise OptionError("give both --min and --max (or neither)", param_hint="'--min'")
    if axis is None and channel is None and mn is not None and np.ndim(mn) == 1:
        raise OptionError("input_min/input_max are vectors: give --axis K (TF's axis; -1 = per tensor)",
                                 param_hint="'--axis'")
    return x, mn, mx, {"signed_input": bool(signed), "range_given": bool(range_given), "round_mode": round_mode}


def report_notes(variant, report):
    """What ``qgcli report`` says about this grid beside the table (the columns keep FakeQuant's names)."""
    notes = ["columns for QuantizeAndDequantize: 'nudged' is the grid's ends [lo, hi] (clip< clip>: outside them), "
             "'range' the range the grid was built from, scale its step; d/dmin d/dmax are V4Grad's zeros"]
    if variant != "quantize-and-dequantize-v4":
        notes.append(f"TensorFlow registers a pass-through gradient for {OPS[variant]}: nothing is blocked")
    grid = report.grid
    if bool(np.any((np.asarray(grid.nudged_min) < np.asarray(grid.min)) |
                   (np.asarray(grid.nudged_max) > np.asarray(grid.max)))):
        notes.append("the grid reaches outside the range (the scale comes from the bound that allows the coarser "
                     "step): outputs can fall outside [input_min, input_max] (qgcli nudge --variant "
                     f"{variant} explains it)")
    return notes
