"""TensorFlow's fake-quant ops (Args, Vars, VarsPerChannel; forward and gradient), in memory or streamed.

The operand rules of each op family (:func:`load_fake_quant_operands`, also used by ``plot`` and
``report``), the op call (:func:`run_fake_quant`) and the summary (grid, clipped shares, gradient mass the
STE mask blocks).  Streamed, the summary gives the grid but no clipping statistics.
"""
from qgcli.errors import OptionError

from qgcli.jobs import Result, Streamed
from qgcli.storage.operands import to_device
from qgcli.report.summaries import describe_arrays, json_safe

LITERAL_OK = ("min", "max")

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
                raise OptionError(f"must be a scalar for --variant args, got shape {list(np.shape(value))}",
                                         param_hint=f"'--{name}'")
    return gradients, inputs, mn, mx, variant


def run_fake_quant(variant, gradients, inputs, mn, mx, *, num_bits, narrow_range, axis, xp, overwrite=False,
                   statistics=True):
    """Call the op for ``variant``; returns (outputs dict, grid, clipping statistics, or None without
    ``statistics``).

    ``overwrite``: ``gradients`` is this job's own array and nothing reads it afterwards, so the backprops may
    take its buffer (no second tensor-sized array to allocate and fault in); the statistics, which need the
    gradients, are taken before the op.
    """
    from qgcli import ops
    from qgcli.ops import fake_quant as fq
    from qgcli.ops.analysis import clip_statistics
    from qgcli.ops.out_array import can_take

    attrs = dict(num_bits=num_bits, narrow_range=narrow_range)
    x = fq.as_float32(inputs, "inputs", xp)
    g = None if gradients is None else fq.as_float32(gradients, "gradients", xp)
    if g is not None:
        fq._check_same_shape(g, x)
    # The op's own checks, in its order, before the statistics read anything.
    if variant == "args":
        lo, hi = float(mn), float(mx)
        grid = fq._args_grid(lo, hi, num_bits, narrow_range)
    elif variant == "vars":
        grid = fq._prepare_per_tensor(x, mn, mx, num_bits, narrow_range, xp)
    else:
        grid, axis = fq._prepare_per_channel(x, mn, mx, num_bits, narrow_range, -1 if axis is None else axis, xp)
    stats = None
    if statistics:
        x_last, g_last = x, g
        if variant == "per-channel":  # the statistics take channels last
            x_last, g_last = (None if a is None else xp.moveaxis(a, axis, -1) for a in (x, g))
        stats = clip_statistics(x_last, grid, g_last)
    out = g if overwrite and can_take(g, x) else None
    if variant == "args":
        if g is None:
            outputs = {"outputs": ops.fake_quant_with_min_max_args(x, lo, hi, **attrs)}
        else:
            outputs = {"backprops": ops.fake_quant_with_min_max_args_gradient(g, x, lo, hi, out=out, **attrs)}
        return outputs, grid, stats
    if variant == "vars":
        forward, gradient = ops.fake_quant_with_min_max_vars, ops.fake_quant_with_min_max_vars_gradient
    else:
        attrs["axis"] = axis
        forward = ops.fake_quant_with_min_max_vars_per_channel
        gradient = ops.fake_quant_with_min_max_vars_per_channel_gradient
    if g is None:
        return {"outputs": forward(x, mn, mx, **attrs)}, grid, stats
    res = gradient(g, x, mn, mx, out=out, **attrs)
    return dict(zip(("backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"), res)), grid, stats


def range_warnings(grid):
    """A note when nudging moves a range further than a user would expect: TensorFlow moves a range holding
    0 by half a grid step at most (rounding the zero point), and more, by up to the whole range, only when 0
    lies outside it (the zero point clamps and the range shifts onto 0); the note names the ranges asked for
    and run.  The grid alone: no data read."""
    import numpy as np

    flat = lambda a: np.atleast_1d(np.asarray(a, np.float64))  # noqa: E731
    lo, hi, nlo, nhi = (flat(getattr(grid, k)) for k in ("min", "max", "nudged_min", "nudged_max"))
    used = ~flat(grid.passthrough).astype(bool)
    no_zero = used & ((lo > 0) | (hi < 0))
    per_channel = bool(grid.per_channel)

    def ranges(which):
        picked = np.flatnonzero(which)
        text = ", ".join(f"{f'ch {c} ' if per_channel else ''}[{lo[c]:g}, {hi[c]:g}] runs as [{nlo[c]:g}, {nhi[c]:g}]"
                         for c in picked[:3])
        return text + (f" and {len(picked) - 3} more" if len(picked) > 3 else "")

    notes = []
    if no_zero.any():
        n = int(no_zero.sum())
        what = f"{n} of {lo.size} channel ranges {'does' if n == 1 else 'do'}" if per_channel else "the range does"
        notes.append(f"{what} not contain 0 ({ranges(no_zero)}): TensorFlow shifts a range so that 0 is a grid "
                     "point, and the inputs beyond it clip (qgcli nudge explains)")
    return notes


def nan_warnings(stats):
    """A note when the inputs hold NaN (from the statistics already taken: no extra pass over the data)."""
    if not stats or not stats.get("nan"):
        return []
    return [f"inputs hold NaN ({100 * stats['nan']:.2f}% of the elements): their outputs are NaN, as TensorFlow's"]


def build_summary(command, op, variant, operands, raw, outputs, grid, stats, attrs, output):
    from qgcli.ops.analysis import grid_summary

    notes = []
    for name, value in raw.items():
        dtype = getattr(value, "dtype", None)
        if dtype is not None and str(dtype) not in ("float32",) and name in ("inputs", "gradients"):
            notes.append(f"{name} is {dtype}; computed in float32 as TensorFlow does")
    notes += range_warnings(grid) + nan_warnings(stats)
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


def compute(job, operands):
    """The job in memory: outputs, file attributes, summary and the --plot figure."""
    with_gradients = job.with_gradients
    gradients, inputs, mn, mx, variant = load_fake_quant_operands(operands, job.variant, with_gradients=with_gradients)
    axis = job.axis
    if axis is not None and variant != "per-channel":
        raise OptionError("only applies to --variant per-channel", param_hint="'--axis'")
    xp, (gradients, inputs) = to_device([gradients, inputs], job.output.device)
    op = TF_OPS[variant] + ("Gradient" if with_gradients else "")
    # The figure draws the gradients, so they are only overwritten without one.
    outputs, grid, stats = run_fake_quant(variant, gradients, inputs, mn, mx, num_bits=job.num_bits,
                                          narrow_range=job.narrow_range, axis=axis, xp=xp,
                                          overwrite=not job.output.plot, statistics=job.output.shows_summary)
    attrs = {"op": op, "variant": variant, "num_bits": job.num_bits, "narrow_range": job.narrow_range}
    if variant == "per-channel":
        attrs["axis"] = -1 if axis is None else axis
    if variant == "args":
        attrs.update(min=float(mn), max=float(mx))
    raw = {"gradients": gradients, "inputs": inputs, "min": mn, "max": mx}
    summary = build_summary(job.command, op, variant, operands, raw, outputs, grid, stats, attrs,
                            job.output.destination)

    def figure():
        """The STE figure of this run (staircase, mask, backprops); per-channel data drawn flattened."""
        from qgcli.report import plots

        return plots.ste(inputs, mn, mx, gradients=gradients, variant=variant, num_bits=job.num_bits,
                         narrow_range=job.narrow_range, axis=-1 if axis is None else axis)

    return Result(outputs, attrs, summary, figure)


def stream(job, operands, datasets, budget):
    """The job over HDF5 datasets too large for memory: channels on the last axis, float inputs."""
    import numpy as np

    from qgcli.execution import streaming
    from qgcli.ops.analysis import grid_summary

    setup = block_setup(job, operands, datasets)
    with_gradients, x_ds, g_ds = job.with_gradients, datasets["inputs"], datasets.get("gradients")
    variant, kind, divide, grid, attrs, op = (setup[k] for k in ("variant", "kind", "divide", "grid", "attrs", "op"))

    def compute(out, advance):
        common = dict(attrs=attrs, compression=job.output.compression, budget=budget, progress=advance)
        if with_gradients:
            return streaming.fake_quant_gradient(g_ds, x_ds, grid, out, kind=kind, **common)
        streaming.fake_quant_forward(x_ds, grid, divide, out, per_channel=variant == "per-channel", **common)
        return {}

    def summarise(small):
        return block_summary(job, operands, datasets, setup, small, [
            f"streamed from disk in blocks: the inputs exceed --memory-limit ({budget / 2**30:.2f} GiB); "
            "clipping statistics are not computed in this mode"])

    total = sum(int(ds.size) * 4 for ds in datasets.values())
    return Streamed(attrs, compute, total, summarise)


def block_setup(job, operands, datasets):
    """What a job computed block by block needs besides the blocks (HDF5 datasets or Zarr arrays, unread):
    ``variant``, ``kind`` of the min/max sums ("flat", "chip", or None for Args), ``divide``, ``grid``,
    ``attrs``, ``op``; channels on the last axis, float inputs (the operands are checked here)."""
    import numpy as np

    from qgcli.errors import OperandError
    from qgcli.ops.fake_quant import _args_grid, _prepare_per_channel, _prepare_per_tensor

    with_gradients, num_bits, narrow_range, axis = job.with_gradients, job.num_bits, job.narrow_range, job.axis
    x_ds = datasets["inputs"]
    g_ds = datasets.get("gradients")
    for name, ds in datasets.items():
        if ds.dtype.kind != "f":
            raise OperandError(f"dtype {ds.dtype} is not a real floating type", operand=name)
    if g_ds is not None and g_ds.shape != x_ds.shape:
        raise OperandError(f"shape {list(g_ds.shape)} differs from inputs shape {list(x_ds.shape)}",
                           operand="gradients")
    mn = operands.get("min", required=job.variant != "args")
    mx = operands.get("max", required=job.variant != "args")
    variant = infer_variant(job.variant, mn)
    if axis is not None and variant != "per-channel":
        raise OptionError("only applies to --variant per-channel", param_hint="'--axis'")
    kind, divide, attrs = "flat", variant == "vars", {"num_bits": num_bits, "narrow_range": narrow_range}
    if variant == "args":
        mn = -6.0 if mn is None else float(np.asarray(mn))
        mx = 6.0 if mx is None else float(np.asarray(mx))
        grid, kind = _args_grid(mn, mx, num_bits, narrow_range), None
        attrs.update(min=mn, max=mx)
    elif variant == "vars":
        grid = _prepare_per_tensor(x_ds, mn, mx, num_bits, narrow_range, np)
    else:
        if axis not in (None, -1, x_ds.ndim - 1):
            raise OptionError("a tensor streamed from disk needs its channels on the last axis",
                                     param_hint="'--axis'")
        grid, _ = _prepare_per_channel(x_ds, mn, mx, num_bits, narrow_range, -1, np)
        kind, attrs["axis"] = "chip", -1
    op = TF_OPS[variant] + ("Gradient" if with_gradients else "")
    attrs = {"op": op, "variant": variant, **attrs}
    return {"variant": variant, "kind": kind, "divide": divide, "grid": grid, "attrs": attrs, "op": op}


def big_output(job, variant):
    """The name of the output as large as the tensor."""
    return "outputs" if not job.with_gradients else ("backprops" if variant == "args" else "backprops_wrt_input")


def block_summary(job, operands, datasets, setup, small, notes):
    """The summary of a job computed block by block (:func:`block_setup`; ``small``: the per-channel outputs)."""
    import numpy as np

    from qgcli.ops.analysis import grid_summary

    x_ds = datasets["inputs"]
    outputs = {big_output(job, setup["variant"]): {"shape": list(x_ds.shape), "dtype": "float32"}}
    outputs.update({k: {"shape": list(np.shape(v)), "dtype": "float32"} for k, v in small.items()})
    return json_safe({
        "command": job.command, "op": setup["op"], "variant": setup["variant"], "attributes": setup["attrs"],
        "inputs": {n: {"shape": list(ds.shape), "dtype": str(ds.dtype), "source": operands.sources.get(n, n)}
                   for n, ds in datasets.items()},
        "grid": grid_summary(setup["grid"]), "statistics": None, "outputs": outputs,
        "output": job.output.destination, "notes": notes,
    })
