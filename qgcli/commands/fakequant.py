"""``qgcli fakequant`` and ``qgcli fakequant-grad``: TensorFlow's fake-quant ops on saved tensors."""
import click

from qgcli.commands._common import (
    Operands,
    emit,
    fake_quant_attribute_options,
    json_safe,
    output_options,
    percent,
    report_options,
    streaming_options,
    to_device,
    write_outputs,
)
from qgcli.commands.nudge import estimator_options, run_semantics, semantics_options
from qgcli.commands.quantize_dequantize import VARIANT as QD_VARIANT
from qgcli.commands.quantize_dequantize import quantize_options, refuse_quantize_options, run_quantize_dequantize

TF_OPS = {
    "args": "FakeQuantWithMinMaxArgs",
    "vars": "FakeQuantWithMinMaxVars",
    "per-channel": "FakeQuantWithMinMaxVarsPerChannel",
}


def infer_variant(variant, min_value):
    """Explicit ``--variant`` wins; else rank-1 min -> per-channel, rank-0 -> vars (the notebook's op)."""
    if variant is not None:
        return variant
    if min_value is None:
        return "args"
    return "per-channel" if getattr(min_value, "ndim", 0) >= 1 else "vars"


def load_fake_quant_operands(operands, variant, *, with_gradients):
    """Raw arrays (gradients, inputs, min, max) and the variant, by TF's rules for each op family."""
    import numpy as np

    gradients = operands.get("gradients") if with_gradients else None
    inputs = operands.get("inputs")
    need_range = variant != "args"
    mn = operands.get("min", required=need_range)
    mx = operands.get("max", required=need_range)
    variant = infer_variant(variant, mn)
    if variant == "args":
        mn = np.array(-6.0) if mn is None else mn
        mx = np.array(6.0) if mx is None else mx
        for name, value in (("min", mn), ("max", mx)):
            dtype = np.asarray(value).dtype
            if dtype.kind not in "fiu" and dtype.name != "bfloat16":
                from qgcli.errors import OperandError

                raise OperandError(f"dtype {dtype} is not a real number type", operand=name)
            if np.ndim(value) != 0:
                raise click.BadParameter(f"must be a scalar for --variant args, got shape {list(np.shape(value))}",
                                         param_hint=f"'--{name}'")
    return gradients, inputs, mn, mx, variant


def run_fake_quant(variant, gradients, inputs, mn, mx, *, num_bits, narrow_range, axis, xp):
    """Call the op for ``variant``; returns (outputs dict, grid, inputs as float32 channels-last, gradients likewise)."""
    from qgcli import ops
    from qgcli.ops.fake_quant import _args_grid, as_float32, nudge

    attrs = dict(num_bits=num_bits, narrow_range=narrow_range)
    x = as_float32(inputs, "inputs", xp)
    if variant == "args":
        lo, hi = float(mn), float(mx)
        grid = _args_grid(lo, hi, num_bits, narrow_range)
        if gradients is None:
            out = {"outputs": ops.fake_quant_with_min_max_args(x, lo, hi, **attrs)}
        else:
            out = {"backprops": ops.fake_quant_with_min_max_args_gradient(gradients, x, lo, hi, **attrs)}
    elif variant == "vars":
        if gradients is None:
            out = {"outputs": ops.fake_quant_with_min_max_vars(x, mn, mx, **attrs)}
        else:
            res = ops.fake_quant_with_min_max_vars_gradient(gradients, x, mn, mx, **attrs)
            out = dict(zip(("backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"), res))
        grid = nudge(mn, mx, **attrs)
    else:
        axis = -1 if axis is None else axis
        if gradients is None:
            out = {"outputs": ops.fake_quant_with_min_max_vars_per_channel(x, mn, mx, axis=axis, **attrs)}
        else:
            res = ops.fake_quant_with_min_max_vars_per_channel_gradient(gradients, x, mn, mx, axis=axis, **attrs)
            out = dict(zip(("backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"), res))
        grid = nudge(mn, mx, **attrs)
        x = xp.moveaxis(x, axis, -1)
        if gradients is not None:
            gradients = xp.moveaxis(as_float32(gradients, "gradients", xp), axis, -1)
    if gradients is not None and variant != "per-channel":
        gradients = as_float32(gradients, "gradients", xp)
    return out, grid, x, gradients


def build_summary(command, op, variant, operands, raw, outputs, grid, x, g, attrs, output):
    from qgcli.commands._common import describe_arrays
    from qgcli.ops.analysis import clip_statistics, grid_summary

    stats = clip_statistics(x, grid, g)
    notes = []
    for name, value in raw.items():
        dtype = getattr(value, "dtype", None)
        if dtype is not None and str(dtype) not in ("float32",) and name in ("inputs", "gradients"):
            notes.append(f"{name} is {dtype}; computed in float32 as TensorFlow does")
    return json_safe({
        "command": command,
        "op": op,
        "variant": variant,
        "attributes": attrs,
        "inputs": {**describe_arrays({k: v for k, v in raw.items() if v is not None}),
                   **{k: {**describe_arrays({k: raw[k]})[k], "source": s} for k, s in operands.sources.items() if raw.get(k) is not None}},
        "grid": grid_summary(grid),
        "statistics": stats,
        "outputs": describe_arrays(outputs),
        "output": output,
        "notes": notes,
    })


def render_summary(console, s):
    from rich.table import Table

    stats, grid = s["statistics"], s["grid"]
    shapes = ", ".join(f"{k} {tuple(v['shape'])} {v['dtype']}" for k, v in s["inputs"].items())
    console.print(f"[bold]{s['op']}[/] num_bits={grid['num_bits']} narrow_range={grid['narrow_range']}  {shapes}")
    table = Table(show_edge=False, box=None, pad_edge=False)
    for col in ("", "min", "max", "nudged_min", "nudged_max", "scale", "zero_point"):
        table.add_column(col, justify="right")
    if isinstance(grid["min"], list):
        rows = list(range(len(grid["min"])))
        shown = rows[:8]
        for c in shown:
            table.add_row(f"ch {c}", *(_fmt(grid[k][c]) for k in ("min", "max", "nudged_min", "nudged_max", "scale", "zero_point")))
        if len(rows) > len(shown):
            table.add_row(f"... {len(rows) - len(shown)} more", "", "", "", "", "", "")
    else:
        table.add_row("range", *(_fmt(grid[k]) for k in ("min", "max", "nudged_min", "nudged_max", "scale", "zero_point")))
    console.print(table)
    if stats is not None:
        line = f"clipped below {percent(stats['clipped_below'])}, above {percent(stats['clipped_above'])}"
        if "gradient_blocked" in stats:
            line += f"; gradient mass blocked by the STE mask {percent(stats['gradient_blocked'])}"
        console.print(line)
    for note in s["notes"]:
        console.print(f"[yellow]note:[/] {note}")
    if s["output"] and s["output"] != "-":
        console.print(f"wrote {', '.join(s['outputs'])} to {s['output']}")


def _fmt(v):
    if v is None:
        return "nan"
    return f"{v:.7g}" if isinstance(v, float) else str(v)


def _fake_quant_command(command, bundle, specs, output, force, num_bits, narrow_range, variant, axis,
                        as_json, quiet, device, with_gradients, plot=None, memory_limit=None, compression=None):
    operands = Operands(bundle, specs, literal_ok=("min", "max"))
    try:
        plan = None
        if device == "cpu":
            from qgcli.commands._streamed import run_fake_quant_streamed, streaming_plan

            plan = streaming_plan(operands, ["gradients", "inputs"] if with_gradients else ["inputs"],
                                  memory_limit, output)
        if plan is not None:
            summary = run_fake_quant_streamed(command, operands, plan, variant=variant, num_bits=num_bits,
                                              narrow_range=narrow_range, axis=axis, output=output, force=force,
                                              compression=compression, quiet=quiet, with_gradients=with_gradients,
                                              plot=plot)
            return emit(summary, as_json=as_json, quiet=quiet, render=render_summary, output=output)
        gradients, inputs, mn, mx, variant = load_fake_quant_operands(operands, variant, with_gradients=with_gradients)
        if axis is not None and variant != "per-channel":
            raise click.BadParameter("only applies to --variant per-channel", param_hint="'--axis'")
        xp, (gradients, inputs) = to_device([gradients, inputs], device)
        op = TF_OPS[variant] + ("Gradient" if with_gradients else "")
        outputs, grid, x, g = run_fake_quant(variant, gradients, inputs, mn, mx, num_bits=num_bits,
                                             narrow_range=narrow_range, axis=axis, xp=xp)
        attrs = {"op": op, "variant": variant, "num_bits": num_bits, "narrow_range": narrow_range}
        if variant == "per-channel":
            attrs["axis"] = -1 if axis is None else axis
        if variant == "args":
            attrs.update(min=float(mn), max=float(mx))
        raw = {"gradients": gradients, "inputs": inputs, "min": mn, "max": mx}
        summary = build_summary(command, op, variant, operands, raw, outputs, grid, x, g, attrs, output)
        if plot:  # refuse a bad figure path before any output is written
            from qgcli.commands.plot import check_figure_output

            check_figure_output(plot, inputs=operands.input_paths(), force=force, option="--plot")
        write_outputs(outputs, output, operands=operands, force=force, attrs=attrs, compression=compression)
        if plot:
            from qgcli.commands.plot import write_ste_plot_for

            write_ste_plot_for(plot, inputs=inputs, gradients=gradients, mn=mn, mx=mx, variant=variant,
                               num_bits=num_bits, narrow_range=narrow_range, axis=axis, force=force,
                               operands=operands)
    finally:
        operands.close()
    emit(summary, as_json=as_json, quiet=quiet, render=render_summary, output=output)


_FQ_EPILOG = """\b
Examples:
  qgcli fakequant samples/notebook.h5 --num-bits 2 -o out.h5
  qgcli fakequant --inputs x.npy --min -6 --max 6 -o out.npz
  qgcli fakequant act.h5 --inputs act.h5:layer1/x --min -1,-2,-3 --max 1,2,3 -o out/
  qgcli fakequant samples/notebook.h5 --variant quantize-dequantize --dtype quint8 -o qdq.h5
"""

_FQG_EPILOG = """\b
Examples:
  qgcli fakequant-grad samples/per_channel.h5 -o grads.h5
  qgcli fakequant-grad samples/notebook.h5 --num-bits 2 -o - | qgcli inspect -
  qgcli fakequant-grad --gradients g.npy --inputs x.npy --min -6 --max 6 -o grads.npz --json
  qgcli fakequant-grad samples/notebook.h5 --variant quantize-dequantize --estimator scaled:0.9 -o g.h5
"""


@click.command("fakequant", epilog=_FQ_EPILOG, short_help="TF fake-quant forward (Args/Vars/PerChannel), bit-exact.")
@click.argument("bundle", required=False, metavar="[BUNDLE]")
@click.option("--inputs", metavar="SPEC", help="Tensor to fake-quantize (TF operand 'inputs').")
@click.option("--min", "min_", metavar="SPEC", help="Range minimum: scalar (vars/args) or one per channel.")
@click.option("--max", "max_", metavar="SPEC", help="Range maximum: scalar (vars/args) or one per channel.")
@fake_quant_attribute_options
@quantize_options
@semantics_options
@output_options
@streaming_options
@report_options
def fakequant(bundle, inputs, min_, max_, num_bits, narrow_range, variant, axis, output, force, as_json, quiet, device,
              semantics, scale, zero_point, quant_min, quant_max, dtype, mode, round_mode, ensure_minimum_range,
              memory_limit, compression):
    """Run FakeQuantWithMinMax{Args,Vars,VarsPerChannel} as TensorFlow 2.21 does, bit for bit.

    Operands come from BUNDLE (an .h5/.npz whose datasets are named inputs, min, max) or from the
    options, which override the bundle. Writes the output 'outputs'. With --semantics torch: PyTorch's
    fake_quantize_per_{tensor,channel}_affine on the operands inputs, scale, zero_point. With
    --variant quantize-dequantize: the notebook's tf.quantize + tf.dequantize (QuantizeV2 + Dequantize, --dtype,
    --mode, --round-mode), writing outputs, quantized, output_min, output_max.
    """
    qd = dict(dtype=dtype, mode=mode, round_mode=round_mode, ensure_minimum_range=ensure_minimum_range)
    if variant == QD_VARIANT:
        run_quantize_dequantize("fakequant", bundle=bundle, specs={"inputs": inputs, "min": min_, "max": max_},
                                output=output, force=force, narrow_range=narrow_range, axis=axis, as_json=as_json,
                                quiet=quiet, device=device, with_gradients=False, **qd,
                                refuse={"--semantics": semantics, "--scale": scale, "--zero-point": zero_point,
                                        "--quant-min": quant_min, "--quant-max": quant_max})
        return
    refuse_quantize_options(**qd)
    if run_semantics("fakequant", bundle=bundle, specs={"inputs": inputs, "min": min_, "max": max_},
                     semantics=semantics, scale=scale, zero_point=zero_point, quant_min=quant_min,
                     quant_max=quant_max, output=output, force=force, num_bits=num_bits, narrow_range=narrow_range,
                     variant=variant, axis=axis, as_json=as_json, quiet=quiet, device=device, with_gradients=False):
        return
    _fake_quant_command("fakequant", bundle, {"inputs": inputs, "min": min_, "max": max_}, output, force,
                        num_bits, narrow_range, variant, axis, as_json, quiet, device, with_gradients=False,
                        memory_limit=memory_limit, compression=compression)


@click.command("fakequant-grad", epilog=_FQG_EPILOG, short_help="TF fake-quant gradients (STE masks, min/max sums).")
@click.argument("bundle", required=False, metavar="[BUNDLE]")
@click.option("--gradients", metavar="SPEC", help="Upstream gradient (TF operand 'gradients').")
@click.option("--inputs", metavar="SPEC", help="Forward inputs (TF operand 'inputs').")
@click.option("--min", "min_", metavar="SPEC", help="Range minimum: scalar (vars/args) or one per channel.")
@click.option("--max", "max_", metavar="SPEC", help="Range maximum: scalar (vars/args) or one per channel.")
@fake_quant_attribute_options
@quantize_options
@semantics_options
@estimator_options
@output_options
@streaming_options
@click.option("--plot", metavar="FIG", default=None, help="Also draw the STE figure to FIG (.png/.svg/.pdf).")
@report_options
def fakequant_grad(bundle, gradients, inputs, min_, max_, num_bits, narrow_range, variant, axis, output, force,
                   plot, as_json, quiet, device, semantics, scale, zero_point, quant_min, quant_max, estimator,
                   grad_factor, dtype, mode, round_mode, ensure_minimum_range, memory_limit, compression):
    """Run FakeQuantWithMinMax{Args,Vars,VarsPerChannel}Gradient as TensorFlow 2.21 does.

    Writes backprops_wrt_input, backprop_wrt_min, backprop_wrt_max (Args: backprops). The summary
    gives the nudged range, the clipped shares and the share of gradient mass the STE mask blocks.
    --estimator picks another backward pass (backprops_wrt_input plus backprop_wrt_scale/_zero_point
    for lsq, backprop_wrt_alpha for pact); --semantics torch runs PyTorch's op (lsq: its learnable op).
    --variant quantize-dequantize: the estimator over QuantizeV2's adjusted range [output_min, output_max] of
    the notebook's round trip (its custom gradient 0.9 * dy is --estimator scaled:0.9).
    """
    qd = dict(dtype=dtype, mode=mode, round_mode=round_mode, ensure_minimum_range=ensure_minimum_range)
    if variant == QD_VARIANT:
        run_quantize_dequantize("fakequant-grad", bundle=bundle,
                                specs={"gradients": gradients, "inputs": inputs, "min": min_, "max": max_},
                                output=output, force=force, narrow_range=narrow_range, axis=axis,
                                estimator=estimator, grad_factor=grad_factor, plot=plot, as_json=as_json, quiet=quiet,
                                device=device, with_gradients=True, **qd,
                                refuse={"--semantics": semantics, "--scale": scale, "--zero-point": zero_point,
                                        "--quant-min": quant_min, "--quant-max": quant_max})
        return
    refuse_quantize_options(**qd)
    if run_semantics("fakequant-grad", bundle=bundle,
                     specs={"gradients": gradients, "inputs": inputs, "min": min_, "max": max_},
                     semantics=semantics, scale=scale, zero_point=zero_point, quant_min=quant_min,
                     quant_max=quant_max, estimator=estimator, grad_factor=grad_factor, output=output, force=force,
                     num_bits=num_bits, narrow_range=narrow_range, variant=variant, axis=axis, as_json=as_json,
                     quiet=quiet, device=device, with_gradients=True, plot=plot):
        return
    _fake_quant_command("fakequant-grad", bundle, {"gradients": gradients, "inputs": inputs, "min": min_, "max": max_},
                        output, force, num_bits, narrow_range, variant, axis, as_json, quiet, device,
                        with_gradients=True, plot=plot, memory_limit=memory_limit, compression=compression)
