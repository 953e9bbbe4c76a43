"""``qgcli bn-grad``: TensorFlow's FusedBatchNormGrad (V1/V2/V3) on saved tensors."""
import click

from qgcli.commands._common import (
    Operands,
    describe_arrays,
    emit,
    json_safe,
    output_options,
    report_options,
    streaming_options,
    to_device,
    write_outputs,
)

OPERANDS = ("y_backprop", "x", "scale", "reserve_space_1", "reserve_space_2", "reserve_space_3")
OUTPUTS = ("x_backprop", "scale_backprop", "offset_backprop")

_CONVENTION_WORDS = {
    "variance": "reserve_space_2 read as the biased batch variance (TensorFlow's CPU convention, --variance-kind "
                "variance; try --variance-kind auto to check it against x)",
    "inv-std": "reserve_space_2 read as 1/sqrt(variance + epsilon) (cuDNN's saved inverse std, --variance-kind "
               "inv-std); epsilon does not enter the result",
}


def _epsilon(ctx, param, value):
    import math

    if value is not None and (not math.isfinite(value) or value < 0):
        raise click.BadParameter(f"must be a finite number >= 0, got {value!r}")
    return value


def _load(operands, version, variance_kind, is_training, explicit_rs3):
    """The raw operands (NumPy) and notes about what was ignored."""
    notes = []
    raw = {name: operands.get(name) for name in OPERANDS[:5]}
    if version != "v3" and explicit_rs3:
        raise click.BadParameter(f"only --version v3 (FusedBatchNormGradV3) takes it, not {version}",
                                 param_hint="'--reserve-space-3'")
    if version == "v3" and operands.has("reserve_space_3"):
        raw["reserve_space_3"] = operands.get("reserve_space_3")
        notes.append("reserve_space_3 is ignored, as on TensorFlow's CPU")
    elif operands.has("reserve_space_3"):
        notes.append(f"the bundle's reserve_space_3 is ignored: {version} has no such input")
    if variance_kind == "auto" and not is_training:
        raise click.BadParameter("needs --is-training: population statistics cannot be recomputed from x",
                                 param_hint="'--variance-kind auto'")
    return raw, notes


def _dtype_notes(raw):
    notes = []
    for name in ("x", "y_backprop"):
        dtype = str(getattr(raw[name], "dtype", ""))
        if dtype == "float64":
            notes.append(f"{name} is float64, which TensorFlow's kernels do not take: computed as float32")
    for name in ("scale", "reserve_space_1", "reserve_space_2"):
        dtype = str(getattr(raw[name], "dtype", "float32"))
        if dtype not in ("float32",) and getattr(raw[name], "ndim", 0) > 0:
            notes.append(f"{name} is {dtype}; rounded to float32 (TensorFlow's type for it)")
    return notes


def run_bn_grad(raw, *, epsilon, data_format, is_training, variance_kind, version, device):
    """Detect the convention if asked, run the op; returns (outputs, convention dict, x for norms)."""
    import numpy as np

    from qgcli.backend import to_numpy
    from qgcli.ops import batch_norm as bn

    bn.batch_norm_grad_version(version, x_dtype=getattr(raw["x"], "dtype", None), data_format=data_format,
                               y_backprop_dtype=getattr(raw["y_backprop"], "dtype", None))
    convention = {"kind": None, "variance_kind": variance_kind}
    rs2 = raw["reserve_space_2"]
    # CuPy has no bfloat16: widen on the host, compute, round back on the host.
    bf16 = device == "gpu" and any(getattr(raw[k], "dtype", None) is not None and raw[k].dtype.name == "bfloat16"
                                   for k in ("x", "y_backprop"))
    dy, x = raw["y_backprop"], raw["x"]
    if bf16:
        dy, x = np.asarray(dy, np.float32), np.asarray(x, np.float32)
    xp, (dy, x) = to_device([dy, x], device)
    if variance_kind == "auto":
        found = bn.detect_variance_convention(x, raw["reserve_space_1"], rs2, epsilon=epsilon,
                                              data_format=data_format)
        rs2 = found.reserve_space_2
        convention.update(kind=found.kind, variance_kind=found.variance_kind, description=found.description,
                          n=found.n, mismatch={k: v for k, v in found.mismatch.items()})
    elif not is_training:
        convention["description"] = (
            "reserve_space_1/2 read as the population mean and variance (is_training=False)"
            if variance_kind == "variance" else
            "reserve_space_1 read as the population mean, reserve_space_2 as 1/sqrt(variance + epsilon) "
            "(--variance-kind inv-std)")
    else:
        convention["description"] = _CONVENTION_WORDS[variance_kind]
    dx, dscale, doffset = bn.fused_batch_norm_grad(
        dy, x, raw["scale"], raw["reserve_space_1"], rs2, epsilon=epsilon, data_format=data_format,
        is_training=is_training, variance_kind=convention["variance_kind"])
    dx, dscale, doffset = to_numpy(dx), to_numpy(dscale), to_numpy(doffset)
    if bf16:
        dx = dx.astype(raw["x"].dtype)
    return {"x_backprop": dx, "scale_backprop": dscale, "offset_backprop": doffset}, convention


def build_summary(op, attrs, operands, raw, outputs, convention, notes, output):
    import numpy as np

    from qgcli.ops.batch_norm import channel_norms

    dx = outputs["x_backprop"]
    norms = channel_norms(dx, attrs["data_format"]) if dx.size else np.zeros(outputs["scale_backprop"].shape)
    nonfinite = {k: int(np.size(v) - np.isfinite(np.asarray(v, np.float32)).sum()) for k, v in outputs.items()}
    notes = list(notes)
    for name, count in nonfinite.items():
        if count:
            notes.append(f"{name} has {count} non-finite values (NaN/inf propagate as in TensorFlow)")
    inputs = describe_arrays({k: v for k, v in raw.items() if v is not None})
    for name, source in operands.sources.items():
        if name in inputs:
            inputs[name]["source"] = source
    per_channel = {
        "x_backprop_norm": [float(v) for v in norms],
        "scale_backprop": [float(v) for v in outputs["scale_backprop"]],
        "offset_backprop": [float(v) for v in outputs["offset_backprop"]],
    }
    return json_safe({
        "command": "bn-grad",
        "op": op,
        "attributes": attrs,
        "convention": convention,
        "inputs": inputs,
        "channels": len(per_channel["scale_backprop"]),
        "per_channel": per_channel,
        "norms": {
            "x_backprop": float(np.sqrt(np.sum(norms.astype(np.float64) ** 2))),
            "scale_backprop": float(np.linalg.norm(outputs["scale_backprop"].astype(np.float64))),
            "offset_backprop": float(np.linalg.norm(outputs["offset_backprop"].astype(np.float64))),
        },
        "outputs": describe_arrays(outputs),
        "output": output,
        "notes": notes,
    })


def render_summary(console, s):
    from rich.table import Table

    a = s["attributes"]
    x = s["inputs"].get("x", {})
    mode = "training" if a["is_training"] else "inference"
    console.print(f"[bold]{s['op']}[/] epsilon={a['epsilon']:g} {a['data_format']} {mode}  "
                  f"x {x.get('shape', [])} {x.get('dtype', '')}", soft_wrap=True)
    console.print(f"convention: {s['convention']['description']}", soft_wrap=True)
    table = Table(show_edge=False, box=None, pad_edge=False)
    for col in ("", "|x_backprop|", "scale_backprop", "offset_backprop"):
        table.add_column(col, justify="right")
    pc = s["per_channel"]
    count = s["channels"]
    for c in range(min(count, 8)):
        table.add_row(f"ch {c}", *(_fmt(pc[k][c]) for k in ("x_backprop_norm", "scale_backprop", "offset_backprop")))
    if count > 8:
        table.add_row(f"... {count - 8} more", "", "", "")
    n = s["norms"]
    table.add_row("L2 norm", _fmt(n["x_backprop"]), _fmt(n["scale_backprop"]), _fmt(n["offset_backprop"]))
    console.print(table)
    for note in s["notes"]:
        console.print(f"[yellow]note:[/] {note}", soft_wrap=True)
    if s["output"] and s["output"] != "-":
        console.print(f"wrote {', '.join(s['outputs'])} to {s['output']}", soft_wrap=True)


def _fmt(v):
    return "nan" if v is None else f"{v:.7g}"


_EPILOG = """\b
Examples:
  qgcli bn-grad samples/batch_norm.h5 -o grads.h5
  qgcli bn-grad samples/batch_norm.h5 --variance-kind auto -o grads.npz --json
  qgcli bn-grad --y-backprop dy.npy --x x.npy --scale 1,1,1 --reserve-space-1 m.npy \\
      --reserve-space-2 v.npy --epsilon 1e-3 --data-format NCHW -o out/
  qgcli bn-grad run.h5 --no-is-training --version v2 --all-outputs -o grads.h5
"""


@click.command("bn-grad", epilog=_EPILOG, short_help="TF FusedBatchNormGrad V1/V2/V3 (batch-norm gradients).")
@click.argument("bundle", required=False, metavar="[BUNDLE]")
@click.option("--y-backprop", metavar="SPEC", help="Upstream gradient dL/dy (TF operand 'y_backprop').")
@click.option("--x", "x_", metavar="SPEC", help="Forward input (TF operand 'x').")
@click.option("--scale", metavar="SPEC", help="gamma, one per channel (a literal like 1,1,1 works).")
@click.option("--reserve-space-1", metavar="SPEC", help="Batch mean (training) or population mean (inference).")
@click.option("--reserve-space-2", metavar="SPEC",
              help="Batch variance (training; see --variance-kind) or population variance (inference).")
@click.option("--reserve-space-3", metavar="SPEC", help="V3 only; ignored, as on TensorFlow's CPU.")
@click.option("--epsilon", type=float, default=1e-4, show_default=True, callback=_epsilon,
              help="Added to the variance (TF's op default; Keras layers use 1e-3).")
@click.option("--data-format", type=click.Choice(["NHWC", "NCHW", "NDHWC", "NCDHW"]), default=None,
              help="Layout of x [default: NHWC for 4-D x, NDHWC for 5-D].")
@click.option("--is-training/--no-is-training", default=True, show_default=True,
              help="Batch statistics (training) or population statistics (inference).")
@click.option("--variance-kind", type=click.Choice(["variance", "inv-std", "auto"]), default="variance",
              show_default=True,
              help="What reserve_space_2 holds: the variance (TF CPU), 1/sqrt(var + eps) (cuDNN), or auto: "
                   "recompute the statistics from x and find out (training only).")
@click.option("--version", type=click.Choice(["v1", "v2", "v3"]), default="v3", show_default=True,
              help="FusedBatchNormGrad, ...V2 or ...V3: dtype rules and placeholder outputs.")
@click.option("--all-outputs", is_flag=True,
              help="Also write TF's unused placeholder outputs (reserve_space_3/4, V3: 4/5), shaped [0].")
@output_options
@streaming_options
@report_options
def bn_grad(bundle, y_backprop, x_, scale, reserve_space_1, reserve_space_2, reserve_space_3, epsilon, data_format,
            is_training, variance_kind, version, all_outputs, output, force, as_json, quiet, device, memory_limit,
            compression):
    """Run TensorFlow's FusedBatchNormGrad{,V2,V3}: gradients of batch normalisation.

    Operands come from BUNDLE (an .h5/.npz with datasets y_backprop, x, scale, reserve_space_1,
    reserve_space_2) or from the options, which override the bundle. Writes x_backprop,
    scale_backprop and offset_backprop, within float32 rounding of TensorFlow 2.21. The summary
    gives per-channel norms of the three and the statistics convention applied.
    """
    if as_json and output == "-":  # refuse before any work, not after the data went to stdout
        raise click.UsageError("--json and -o - both want stdout; write the data to a file or drop --json")
    specs = {"y_backprop": y_backprop, "x": x_, "scale": scale, "reserve_space_1": reserve_space_1,
             "reserve_space_2": reserve_space_2, "reserve_space_3": reserve_space_3}
    operands = Operands(bundle, specs, literal_ok=("scale", "reserve_space_1", "reserve_space_2", "reserve_space_3"))
    try:
        from qgcli.commands._streamed import run_bn_grad_streamed, streaming_plan

        plan = streaming_plan(operands, ["y_backprop", "x"], memory_limit, output) if device == "cpu" else None
        if plan is not None:
            summary = run_bn_grad_streamed(operands, plan, epsilon=epsilon, data_format=data_format,
                                           is_training=is_training, variance_kind=variance_kind, version=version,
                                           all_outputs=all_outputs, output=output, force=force,
                                           compression=compression, quiet=quiet)
            return emit(summary, as_json=as_json, quiet=quiet, render=render_summary, output=output)
        raw, notes = _load(operands, version, variance_kind, is_training, reserve_space_3 is not None)
        if data_format is None:
            data_format = "NDHWC" if getattr(raw["x"], "ndim", 0) == 5 else "NHWC"
        notes += _dtype_notes(raw)
        if not is_training and data_format in ("NCHW", "NCDHW"):
            notes.append(f"TensorFlow's CPU kernel refuses {data_format} with is_training=False; computed as its "
                         "registered gradient does (transposed to channels-last)")
        outputs, convention = run_bn_grad(raw, epsilon=epsilon, data_format=data_format, is_training=is_training,
                                          variance_kind=variance_kind, version=version, device=device)
        from qgcli.ops.batch_norm import VERSIONS, placeholder_outputs

        op = VERSIONS[version].op
        attrs = {"op": op, "epsilon": epsilon, "data_format": data_format, "is_training": is_training,
                 "version": version, "variance_kind": convention["variance_kind"]}
        if convention.get("kind"):
            attrs["variance_convention"] = convention["kind"]
        summary = build_summary(op, attrs, operands, raw, outputs, convention, notes, output)
        if all_outputs:
            outputs.update(placeholder_outputs(version))
        write_outputs(outputs, output, operands=operands, force=force, attrs=attrs, compression=compression)
    finally:
        operands.close()
    if all_outputs:
        summary["outputs"] = describe_arrays(outputs)
    emit(summary, as_json=as_json, quiet=quiet, render=render_summary, output=output)
