"""``fakequant`` / ``fakequant-grad --variant quantize-dequantize``: TensorFlow's QuantizeV2 + Dequantize round trip.

The tutorial notebook's own fake quant (``tf.quantization.quantize`` then ``tf.quantization.dequantize`` with
the range QuantizeV2 hands back) and its custom gradient.  The forward writes ``outputs`` (dequantized
float32), ``quantized`` (the integers, in the natural NumPy dtype of ``--dtype``), ``output_min`` and
``output_max``; the gradient is an estimator over the adjusted range ``[output_min, output_max]`` (default: the
clipped straight-through estimator; the notebook's ``0.9 * dy`` is ``--estimator scaled:0.9``).
Only click is imported at module level.
"""
import click

from qgcli.commands._common import Operands, describe_arrays, emit, json_safe, percent, to_device, write_outputs

VARIANT = "quantize-dequantize"
OP = "QuantizeV2+Dequantize"
DTYPES = ("quint8", "qint8", "quint16", "qint16", "qint32")
MODES = ("MIN_COMBINED", "MIN_FIRST", "SCALED")
ROUND_MODES = ("HALF_AWAY_FROM_ZERO", "HALF_TO_EVEN")
_OPTIONS = {"dtype": "--dtype", "mode": "--mode", "round_mode": "--round-mode",
            "ensure_minimum_range": "--ensure-minimum-range"}


class _Choice(click.Choice):
    """A choice typed in any case, shown and returned as TensorFlow spells it."""

    def __init__(self, choices, fold):
        super().__init__(choices)
        self._fold = fold

    def convert(self, value, param, ctx):
        return super().convert(self._fold(value) if isinstance(value, str) else value, param, ctx)


def quantize_options(f):
    """--dtype, --mode, --round-mode, --ensure-minimum-range (the QuantizeV2 attributes)."""
    only = " (--variant quantize-dequantize)"
    f = click.option("--ensure-minimum-range", type=float, default=None, metavar="EPS",
                     help="QuantizeV2's ensure_minimum_range: the range is at least EPS * max(1, |min|, |max|) "
                          "wide [default: 0.01]" + only + ".")(f)
    f = click.option("--round-mode", type=_Choice(ROUND_MODES, str.upper), default=None,
                     help="Rounding [default: HALF_AWAY_FROM_ZERO]; HALF_TO_EVEN needs --mode SCALED" + only + ".")(f)
    f = click.option("--mode", type=_Choice(MODES, str.upper), default=None,
                     help="QuantizeV2/Dequantize mode [default: MIN_COMBINED, the notebook's]" + only + ".")(f)
    f = click.option("--dtype", type=_Choice(DTYPES, str.lower), default=None,
                     help="Quantized type [default: quint8, the notebook's]" + only + ".")(f)
    return f


def refuse_quantize_options(**given):
    """Other variants: the QuantizeV2 attributes do not apply."""
    for name, value in given.items():
        if value is not None:
            raise click.BadParameter(f"only applies to --variant {VARIANT}", param_hint=f"'{_OPTIONS[name]}'")


def _given_on_command_line(name):
    from click.core import ParameterSource

    ctx = click.get_current_context(silent=True)
    return ctx is not None and ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)


def quantize_dequantize_gradients(gradients, inputs, lo, hi):
    """The gradient path of the variant: ``(gradients, inputs, lo, hi) -> dict`` of outputs.

    The clipped STE over the adjusted range (``lo``/``hi`` broadcastable against ``inputs``); estimators
    other than ``ste`` run on :func:`qgcli.ops.quantize.quantize_dequantize_view` instead.
    """
    from qgcli.ops.quantize import quantize_dequantize_backprops

    return quantize_dequantize_backprops(gradients, inputs, lo, hi)


def run_quantize_dequantize(command, *, bundle, specs, output, force, dtype, mode, round_mode, ensure_minimum_range,
                            narrow_range, axis, estimator=None, grad_factor=None, plot=None, as_json, quiet, device,
                            with_gradients, refuse=None):
    """Run ``fakequant``/``fakequant-grad --variant quantize-dequantize``.

    ``refuse`` maps options of the other variants (``--semantics``, ``--scale``...) to their values; any given
    is a usage error.
    """
    for option, value in (refuse or {}).items():
        if value not in (None, False, "tf"):
            raise click.BadParameter(f"does not apply to --variant {VARIANT} (TensorFlow's QuantizeV2 + Dequantize)",
                                     param_hint=f"'{option}'")
    if _given_on_command_line("num_bits"):
        raise click.BadParameter(f"the bit width of --variant {VARIANT} comes from --dtype", param_hint="'--num-bits'")
    attrs = {"dtype": (dtype or "quint8").lower(), "mode": (mode or "MIN_COMBINED").upper(),
             "round_mode": (round_mode or "HALF_AWAY_FROM_ZERO").upper(), "narrow_range": bool(narrow_range),
             "ensure_minimum_range": 0.01 if ensure_minimum_range is None else float(ensure_minimum_range)}
    est = None
    if with_gradients:
        from qgcli.ops.estimators import parse_estimator

        est = parse_estimator(estimator) if estimator is not None else None
        if grad_factor is not None and (est is None or est.name != "lsq"):
            raise click.BadParameter("only applies to --estimator lsq", param_hint="'--grad-factor'")
        if plot and est is not None and est.name != "ste":
            raise click.BadParameter(f"draws the STE only; for --estimator {est.text} use 'qgcli plot estimators "
                                     f"--variant {VARIANT}'", param_hint="'--plot'")
    operands = Operands(bundle, specs, literal_ok=("min", "max"))
    try:
        import numpy as np

        gradients = operands.get("gradients") if with_gradients else None
        inputs = operands.get("inputs")
        mn, mx = operands.get("min"), operands.get("max")
        if axis is None and (np.size(mn) > 1 or np.size(mx) > 1):
            raise click.BadParameter(f"min/max have {max(np.size(mn), np.size(mx))} entries: give --axis K for one "
                                     "range per slice of axis K (QuantizeV2's axis)", param_hint="'--axis'")
        xp, (gradients, inputs) = to_device([gradients, inputs], device)
        outputs, summary = _compute(command, operands, gradients, inputs, mn, mx, attrs, axis, est, grad_factor,
                                    xp, output)
        op = OP + ("Gradient" if with_gradients else "")
        file_attrs = {"op": op, "variant": VARIANT, **attrs, "axis": axis}
        if est is not None:
            file_attrs["estimator"] = est.text
            file_attrs["grad_factor"] = summary.get("estimator", {}).get("grad_factor")
        if plot:  # refuse a bad figure path before any output is written
            from qgcli.commands.plot import check_figure_output

            check_figure_output(plot, inputs=operands.input_paths(), force=force, option="--plot")
        write_outputs(outputs, output, operands=operands, force=force, attrs=file_attrs)
        if plot:
            from qgcli.commands.plot import save_checked
            from qgcli import plots

            fig = plots.ste(inputs, mn, mx, gradients=gradients, variant=VARIANT, narrow_range=narrow_range,
                            axis=-1 if axis is None else axis, quantize=_plot_options(attrs))
            save_checked(fig, plot, 100)
    finally:
        operands.close()
    emit(summary, as_json=as_json, quiet=quiet, render=render_summary, output=output)


def _plot_options(attrs):
    return {k: attrs[k] for k in ("dtype", "mode", "round_mode", "ensure_minimum_range")}


def _compute(command, operands, gradients, inputs, mn, mx, attrs, axis, est, grad_factor, xp, output):
    from qgcli.ops import quantize as q
    from qgcli.ops.estimators import apply_estimator, lsq_grad_factor

    kw = dict(dtype=attrs["dtype"], mode=attrs["mode"], round_mode=attrs["round_mode"],
              narrow_range=attrs["narrow_range"], axis=axis, ensure_minimum_range=attrs["ensure_minimum_range"])
    details = None
    x = q.as_float32(inputs, "inputs", xp)
    if gradients is None:
        result = q.quantize_dequantize(x, mn, mx, **kw)
        outputs = result.as_dict()
    elif est is None or est.name == "ste":
        result = q.quantize_dequantize(x, mn, mx, **kw)
        lo, hi = q.range_bounds(result.output_min, result.output_max, x.ndim, axis, xp)
        outputs = quantize_dequantize_gradients(gradients, x, lo, hi)
        if est is not None:
            details = {"estimator": est.text, "name": est.name}
    else:
        view, result = q.quantize_dequantize_view(x, mn, mx, **kw)
        gf = None
        if est.name == "lsq":
            gf = lsq_grad_factor(view) if grad_factor in (None, "auto") else float(grad_factor)
        outputs, details = apply_estimator(est, gradients, view, grad_factor=gf)
    summary = build_summary(command, operands, {"gradients": gradients, "inputs": inputs, "min": mn, "max": mx},
                            x, gradients, result, attrs, axis, outputs, output, xp)
    if details is not None:
        summary["estimator"] = json_safe(details)
    return outputs, summary


def build_summary(command, operands, raw, x, gradients, result, attrs, axis, outputs, output, xp):
    """The summary dict (JSON-safe): attributes, ranges, clipped shares, gradient mass blocked, notes."""
    import numpy as np

    from qgcli.backend import to_numpy
    from qgcli.ops import quantize as q

    mn, mx = q._slice_ranges(raw["min"], raw["max"], x.shape, q._normalise_axis(axis, x.ndim))
    grid = q.round_trip_grid(mn, mx, dtype=attrs["dtype"], mode=attrs["mode"], round_mode=attrs["round_mode"],
                             narrow_range=attrs["narrow_range"], ensure_minimum_range=attrs["ensure_minimum_range"])
    lo, hi = q.range_bounds(result.output_min, result.output_max, x.ndim, axis, xp)
    inside = q.range_mask(x, lo, hi, xp)
    n = int(x.size)
    nan = int(xp.isnan(x).sum())
    below = int((x < lo).sum()) if n else 0
    above = int((x > hi).sum()) if n else 0
    stats = {"elements": n, "clipped_below": below / n if n else 0.0, "clipped_above": above / n if n else 0.0,
             "nan": nan / n if n else 0.0}
    if gradients is not None:
        mag = xp.abs(q.as_float32(gradients, "gradients", xp).astype(np.float64))
        mag = xp.where(xp.isfinite(mag), mag, 0.0)
        total = float(mag.sum())
        stats["gradient_blocked"] = float(xp.where(inside, 0.0, mag).sum()) / total if total else 0.0
    notes = []
    for name in ("inputs", "gradients"):
        dtype = getattr(raw.get(name), "dtype", None)
        if dtype is not None and str(dtype) != "float32":
            notes.append(f"{name} is {dtype}; computed in float32 as TensorFlow does")
    quantized = to_numpy(result.quantized)
    if attrs["dtype"] == "qint32" and attrs["mode"] != "MIN_FIRST":
        # The bottom of the range legitimately gives -2**31; above the middle it is TF's wrap.
        middle = (to_numpy(lo).astype(np.float64) + to_numpy(hi)) / 2
        wrapped = int(np.count_nonzero((quantized == np.iinfo(np.int32).min) & (to_numpy(x) > middle)))
        if wrapped:
            notes.append(f"{wrapped} inputs at the top of the range quantized to -2147483648: TensorFlow's qint32 "
                         "cast wraps there, and qgcli reproduces it")
    if nan:
        notes.append(f"{nan} NaN inputs: quantized as TensorFlow's x86 casts do (0, or the type's minimum in whole "
                     "packets), never clipped, and their gradient is 0")

    def plain(a):
        a = np.asarray(to_numpy(a), np.float64)
        return a.tolist()

    return json_safe({
        "command": command,
        "op": OP + ("Gradient" if gradients is not None else ""),
        "variant": VARIANT,
        "attributes": {**attrs, "axis": axis},
        "inputs": {k: {**describe_arrays({k: v})[k],
                       **({"source": operands.sources[k]} if k in operands.sources else {})}
                   for k, v in raw.items() if v is not None},
        "range": {"min": plain(grid.min), "max": plain(grid.max), "output_min": plain(result.output_min),
                  "output_max": plain(result.output_max), "step": plain(grid.scale),
                  "levels": grid.quant_max - grid.quant_min + 1,
                  "quantized_min": int(quantized.min()) if quantized.size else None,
                  "quantized_max": int(quantized.max()) if quantized.size else None},
        "statistics": stats,
        "outputs": describe_arrays(outputs),
        "output": output,
        "notes": notes,
    })


def render_summary(console, s):
    from rich.markup import escape
    from rich.table import Table

    a, r, stats = s["attributes"], s["range"], s["statistics"]
    shapes = ", ".join(f"{k} {tuple(v['shape'])} {v['dtype']}" for k, v in s["inputs"].items())
    rounding = f" round_mode={a['round_mode']}" if a["mode"] == "SCALED" else ""
    console.print(f"[bold]{s['op']}[/] dtype={a['dtype']} mode={a['mode']}{rounding} narrow_range={a['narrow_range']} "
                  f"ensure_minimum_range={a['ensure_minimum_range']:g}  {escape(shapes)}")
    table = Table(show_edge=False, box=None, pad_edge=False)
    for col in ("", "min", "max", "output_min", "output_max", "step"):
        table.add_column(col, justify="right")
    keys = ("min", "max", "output_min", "output_max", "step")
    if isinstance(r["min"], list):
        for c in range(min(len(r["min"]), 8)):
            table.add_row(f"slice {c}", *(_fmt(r[k][c]) for k in keys))
        if len(r["min"]) > 8:
            table.add_row(f"... {len(r['min']) - 8} more", "", "", "", "", "")
    else:
        table.add_row("range", *(_fmt(r[k]) for k in keys))
    console.print(table)
    line = (f"{r['levels']} levels; quantized values {r['quantized_min']}..{r['quantized_max']}; clipped below "
            f"{percent(stats['clipped_below'])}, above {percent(stats['clipped_above'])}")
    if "gradient_blocked" in stats:
        line += f"; gradient mass blocked by the STE mask {percent(stats['gradient_blocked'])}"
    console.print(line)
    if "estimator" in s:
        est = s["estimator"]
        extra = f", grad_factor {est['grad_factor']:.7g}" if est.get("grad_factor") is not None else ""
        console.print(escape(f"estimator {est['estimator']}{extra} over the adjusted range [output_min, output_max]"))
    for note in s["notes"]:
        console.print(f"[yellow]note:[/] {escape(note)}")
    if s["output"] and s["output"] != "-":
        console.print(f"wrote {', '.join(s['outputs'])} to {escape(s['output'])}")


def _fmt(v):
    if v is None:
        return "nan"
    return f"{v:.7g}" if isinstance(v, float) else str(v)
