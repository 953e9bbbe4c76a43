"""TensorFlow's fake-quant ops (Args, Vars, VarsPerChannel; forward and gradient), in memory or streamed.

The operand rules of each op family (:func:`load_fake_quant_operands`, also used by ``plot`` and
``report``), the op call (:func:`run_fake_quant`) and the summary (grid, clipped shares, gradient mass the
STE mask blocks).  In blocks (:func:`block_setup`), the summary gives the grid but no clipping statistics.
"""
import numpy as np

from qgcli import ops
from qgcli.backend import array_module
from qgcli.errors import OperandError, OptionError

from qgcli.families.common import check_grad_factor, parse_estimator, refuse_quantize_options
from qgcli.families.groups import fake_quant_basics
from qgcli.families.registry import FAKE_QUANT
from qgcli.jobs import FakeQuantJob, Result
from qgcli.ops import fake_quant as fq
from qgcli.ops.analysis import clip_statistics, grid_summary
from qgcli.ops.fake_quant import _args_grid, _prepare_per_channel, _prepare_per_tensor, infer_variant
from qgcli.ops.out_array import can_take
from qgcli.report.tables import Col, print_items, print_table
from qgcli.storage.operands import to_device
from qgcli.report.summaries import describe_arrays, fmt_value as _fmt, json_safe, percent, render_closing_lines

NAME, KIND = "tf", FAKE_QUANT
#: TensorFlow's grid with another gradient estimator: the family of :mod:`qgcli.families.estimators`, whose
#: jobs this module's options and groups build when --estimator names one.
ESTIMATOR = "estimator"
LITERAL_OK = ("min", "max")

TF_OPS = {
    "args": "FakeQuantWithMinMaxArgs",
    "vars": "FakeQuantWithMinMaxVars",
    "per-channel": "FakeQuantWithMinMaxVarsPerChannel",
}
#: Its groups get qgcli.ops.analysis's per-channel report and figures (report --layer, plot hist/ste/channels).
CHANNEL_ANALYSIS = True
#: Run-file ``op`` -> variant.
RUN_FILE_OPS = {op: variant for variant, op in reversed(TF_OPS.items())}
_RANGE = (("inputs", "min", "max"), ("gradients",))
#: A group's datasets (required, optional) by variant; a group without op: vars's.
GROUP_OPERANDS = {"per-channel": _RANGE, "vars": _RANGE, "args": (("inputs",), ("gradients",)), None: _RANGE}


def load_fake_quant_operands(operands, variant, *, with_gradients):
    """Raw arrays (gradients, inputs, min, max) and the variant, by TF's rules for each op family."""
    gradients = operands.get("gradients") if with_gradients else None
    inputs = operands.get("inputs")
    need_range = variant != "args"
    mn = operands.get("min", required=need_range)
    mx = operands.get("max", required=need_range)
    variant = infer_variant(variant, mn)  # no min: FakeQuantWithMinMaxArgs
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
                   statistics=True, forward_too=False, infinities=None):
    """Call the op for ``variant``; returns (outputs dict, grid, clipping statistics, or None without
    ``statistics``).

    ``overwrite``: the arrays read for this job are its own and nothing reads them afterwards, so the op's
    tensor-sized result may take the buffer of one (no second tensor-sized array to allocate and fault in):
    the backprops the gradients', the forward's outputs (no gradients) the inputs'.  What the summary needs
    of them is taken before the op: the statistics, and, where the inputs are overwritten, their counts of
    +inf and -inf, put in the dict ``infinities`` (key "inputs", see :func:`input_infinities`).
    ``forward_too``: with gradients, the forward's ``outputs`` as well, from the fused op (one pass over
    inputs and gradients).
    """

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
    if g is None and overwrite and can_take(x):  # the forward writes its outputs over the inputs
        out = x
        if infinities is not None:
            infinities["inputs"] = input_infinities(stats, x)
    forward_too = forward_too and g is not None
    if variant == "args":
        if forward_too:
            y, dx = ops.fake_quant_with_min_max_args_and_gradient(g, x, lo, hi, out=out, **attrs)
            return {"outputs": y, "backprops": dx}, grid, stats
        if g is None:
            outputs = {"outputs": ops.fake_quant_with_min_max_args(x, lo, hi, out=out, **attrs)}
        else:
            outputs = {"backprops": ops.fake_quant_with_min_max_args_gradient(g, x, lo, hi, out=out, **attrs)}
        return outputs, grid, stats
    if variant == "vars":
        forward, gradient = ops.fake_quant_with_min_max_vars, ops.fake_quant_with_min_max_vars_gradient
        both = ops.fake_quant_with_min_max_vars_and_gradient
    else:
        attrs["axis"] = axis
        forward = ops.fake_quant_with_min_max_vars_per_channel
        gradient = ops.fake_quant_with_min_max_vars_per_channel_gradient
        both = ops.fake_quant_with_min_max_vars_per_channel_and_gradient
    if forward_too:
        res = both(g, x, mn, mx, out=out, **attrs)
        return dict(zip(("outputs", "backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"), res)), grid, stats
    if g is None:
        return {"outputs": forward(x, mn, mx, out=out, **attrs)}, grid, stats
    res = gradient(g, x, mn, mx, out=out, **attrs)
    return dict(zip(("backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"), res)), grid, stats


def range_warnings(grid):
    """A note when nudging moves a range further than a user would expect: TensorFlow moves a range holding
    0 by half a grid step at most (rounding the zero point), and more, by up to the whole range, only when 0
    lies outside it (the zero point clamps and the range shifts onto 0); the note names the ranges asked for
    and run.  The grid alone: no data read."""
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


def input_infinities(stats, inputs):
    """``(+inf count, -inf count)`` of ``inputs``, which the statistics count as clipped: a pass over them only
    when some value clipped on that side."""
    pos = neg = 0
    if stats and inputs is not None and getattr(inputs, "dtype", None) is not None and inputs.dtype.kind == "f":
        xp = array_module(inputs)
        pos = int(xp.count_nonzero(inputs == np.inf)) if stats.get("clipped_above") else 0
        neg = int(xp.count_nonzero(inputs == -np.inf)) if stats.get("clipped_below") else 0
    return pos, neg


def nan_warnings(stats, inputs=None, grid=None, variant=None, infinities=None):
    """A note when the inputs hold NaN or +-inf: NaN from the statistics already taken; +-inf from
    ``infinities`` (counted before the inputs were overwritten) or :func:`input_infinities` of ``inputs``."""
    if not stats:
        return []
    n = stats["elements"]
    nan = round(stats.get("nan", 0.0) * n)
    pos, neg = infinities if infinities is not None else input_infinities(stats, inputs)
    return nonfinite_note(n, nan, pos, neg, grid, variant)


def nonfinite_note(n, nan, pos, neg, grid=None, variant=None):
    """The note of :func:`nan_warnings` from the counts of ``n`` inputs: ``nan`` NaN, ``pos`` +inf, ``neg`` -inf
    (in memory from the statistics, streamed from disk counted block by block as they are read)."""
    if not (pos or neg):
        return [] if not nan else [f"inputs hold NaN ({nan} of {n} elements): their outputs are NaN, as "
                                   "TensorFlow's"]
    found = ", ".join(f"{k} {what}" for k, what in ((nan, "NaN"), (pos, "+inf"), (neg, "-inf")) if k)
    signs = [s for s, k in (("+inf", pos), ("-inf", neg)) if k]
    if grid is not None and not grid.per_channel:
        edge = {"+inf": f"{float(grid.nudged_max):g}", "-inf": f"{float(grid.nudged_min):g}"}
    else:
        edge = {"+inf": "its channel's nudged max", "-inf": "its channel's nudged min"}
    to = {"+inf": "max", "-inf": "min"}
    to_vars = "" if variant == "args" else "; their dy goes to the gradient of " + " and of ".join(
        f"{to[s]} ({s})" for s in signs)
    return [f"inputs hold non-finite values ({found} of {n} elements): TensorFlow's op "
            + ("outputs NaN for NaN and " if nan else "") + "clips " + " and ".join(signs) + " to the nudged range ("
            + ", ".join(f"{s} -> {edge[s]}" for s in signs) + f"; counted as clipped), with an input gradient of "
            f"0{to_vars}"]


def build_summary(command, op, variant, operands, raw, outputs, grid, stats, attrs, output, infinities=None):
    notes = []
    for name, value in raw.items():
        dtype = getattr(value, "dtype", None)
        if dtype is not None and str(dtype) not in ("float32",) and name in ("inputs", "gradients"):
            notes.append(f"{name} is {dtype}; computed in float32 as TensorFlow does")
    notes += range_warnings(grid) + nan_warnings(stats, raw.get("inputs"), grid, variant, infinities)
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
    # The figure draws the gradients and the inputs, so they are only overwritten without one.
    infinities = {}
    outputs, grid, stats = run_fake_quant(variant, gradients, inputs, mn, mx, num_bits=job.num_bits,
                                          narrow_range=job.narrow_range, axis=axis, xp=xp,
                                          overwrite=not job.output.plot, statistics=job.output.shows_summary,
                                          forward_too=job.forward_too, infinities=infinities)
    attrs = {"op": op, "variant": variant, "num_bits": job.num_bits, "narrow_range": job.narrow_range}
    if variant == "per-channel":
        attrs["axis"] = -1 if axis is None else axis
    if variant == "args":
        attrs.update(min=float(mn), max=float(mx))
    raw = {"gradients": gradients, "inputs": inputs, "min": mn, "max": mx}
    # Nobody sees the summary (--quiet, or a run-file group past the table): its op only, the one thing the
    # run file's record keeps of it.
    summary = build_summary(job.command, op, variant, operands, raw, outputs, grid, stats, attrs,
                            job.output.destination, infinities.get("inputs")
                            ) if job.output.shows_summary else {"op": op}

    def figure():
        """The STE figure of this run (staircase, mask, backprops); per-channel data drawn flattened."""
        from qgcli.report import plots

        return plots.ste(inputs, mn, mx, gradients=gradients, variant=variant, num_bits=job.num_bits,
                         narrow_range=job.narrow_range, axis=-1 if axis is None else axis)

    return Result(outputs, attrs, summary, figure)


def block_setup(job, operands, datasets):
    """What a job computed block by block (:mod:`qgcli.execution.blocks`) needs besides the blocks (HDF5
    datasets or Zarr arrays, unread): the block algorithm (``blocks``: the leaf reduction), ``variant``,
    ``kind`` of the min/max sums ("flat", "chip", or None for Args), ``gradient``, ``divide``, ``grid``,
    ``attrs``, ``op``, the large ``output``'s name and what the summary lacks (``not_computed``); channels on
    the last axis, float inputs (the operands are checked here)."""
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
    return {"blocks": "leaves", "variant": variant, "kind": kind, "gradient": with_gradients, "divide": divide,
            "grid": grid, "attrs": attrs, "op": op, "output": big_output(job, variant),
            "not_computed": "clipping statistics"}


def big_output(job, variant):
    """The name of the output as large as the tensor."""
    return "outputs" if not job.with_gradients else ("backprops" if variant == "args" else "backprops_wrt_input")


def block_summary(job, operands, datasets, setup, small, notes):
    """The summary of a job computed block by block (:func:`block_setup`; ``small``: the per-channel outputs)."""
    x_ds = datasets["inputs"]
    n = int(np.prod(x_ds.shape, dtype=np.int64))
    nan, pos, neg = setup.get("nonfinite", (0, 0, 0))
    outputs = {big_output(job, setup["variant"]): {"shape": list(x_ds.shape), "dtype": "float32"}}
    outputs.update({k: {"shape": list(np.shape(v)), "dtype": "float32"} for k, v in small.items()})
    return json_safe({
        "command": job.command, "op": setup["op"], "variant": setup["variant"], "attributes": setup["attrs"],
        "inputs": {n: {"shape": list(ds.shape), "dtype": str(ds.dtype), "source": operands.sources.get(n, n)}
                   for n, ds in datasets.items()},
        # what the blocks counted as they were read, as in memory (the clipped shares are not computed)
        "grid": grid_summary(setup["grid"]), "statistics": {"elements": n, "nan": nan / n if n else 0.0},
        "outputs": outputs, "output": job.output.destination,
        "notes": list(notes) + range_warnings(setup["grid"]) + nonfinite_note(n, nan, pos, neg, setup["grid"],
                                                                             setup["variant"]),
    })


# --- the job: from the commands' options, from a run-file group --------------------------------------------

def claims(o):
    """TensorFlow's semantics on one of its fake-quant ops (--variant args/vars/per-channel, or none)."""
    return o.semantics.semantics == "tf" and (o.attributes.variant is None or o.attributes.variant in TF_OPS)


def common_fields(o):
    """``(estimator, job fields)`` that TensorFlow's and PyTorch's fake-quant jobs share, QuantizeV2's
    options refused first."""
    refuse_quantize_options(o.quantize)
    est = parse_estimator(o.estimator)
    a = o.attributes
    return est, dict(command=o.command, with_gradients=o.with_gradients, operands=o.operands, output=o.output,
                     num_bits=a.num_bits, narrow_range=a.narrow_range, variant=a.variant, axis=a.axis,
                     estimator=est, grad_factor=o.estimator.grad_factor)


def job_from_options(o):
    """TensorFlow's op with its STE, or (--estimator) :mod:`qgcli.families.estimators`' job on its grid."""
    est, common = common_fields(o)
    for option, value in o.semantics.torch_given().items():
        if value is not None:
            raise OptionError("only applies to --semantics torch", param_hint=f"'{option}'")
    check_grad_factor(o.estimator, est)
    if est is None or est.name == "ste":
        return FakeQuantJob(family=NAME, **common)
    if o.output.plot:
        raise OptionError(f"draws TensorFlow's STE only; for --estimator {est.text} use "
                          "'qgcli plot estimators'", param_hint="'--plot'")
    return FakeQuantJob(family=ESTIMATOR, **common)


def group_literals(layer):
    """FakeQuantWithMinMaxArgs carries min/max as attributes (TensorFlow's default -6..6)."""
    if layer.variant == "args":
        return {"min": repr(float(layer.attrs.get("min", -6.0))), "max": repr(float(layer.attrs.get("max", 6.0)))}
    return {}


def group_problem(layer, shapes):
    a = layer.attrs
    if layer.variant == "per-channel":
        x = shapes["inputs"]
        axis = int(a.get("axis", -1))
        if not x or not -len(x) <= axis < len(x):
            return f"axis {axis} is out of range for inputs of shape {list(x)}"
        depth = x[axis]
        for name in ("min", "max"):
            if shapes[name] != (depth,):
                return f"{name} has shape {list(shapes[name])}, expected [{depth}] (one per channel of axis {axis})"
    if layer.variant == "vars":
        for name in ("min", "max"):
            if shapes[name] not in ((), (1,)):
                return f"{name} has shape {list(shapes[name])}; FakeQuantWithMinMaxVars takes a scalar"
    if layer.variant == "args":
        for name in ("min", "max"):
            if name in shapes:
                return f"FakeQuantWithMinMaxArgs takes {name} as an attribute, not a dataset"
    return None


def job_from_group(run, layer, operand_specs, output, pick):
    """The group's op with the STE, or the run's --estimator on its grid; --axis concerns per-channel groups."""
    common, narrow_range, axis = fake_quant_basics(run, operand_specs, output, pick)
    est = run.estimator
    family = NAME if est is None or est.name == "ste" else ESTIMATOR
    if family == NAME:
        common["estimator"] = None
    variant = layer.variant
    if variant != "per-channel":
        axis = None  # --axis concerns the per-channel groups only
        pick.overrides.pop("axis", None)
    return FakeQuantJob(family=family, num_bits=int(pick("num_bits", 8)), narrow_range=narrow_range,
                        variant=variant, axis=axis, **common)


def mode(job):
    return "TensorFlow's fake-quant op"


# --- the summary on stderr ------------------------------------------------------------------------------

def render(console, s):
    from rich.markup import escape

    stats, grid = s["statistics"], s["grid"]
    shapes = ", ".join(f"{k} {tuple(v['shape'])} {v['dtype']}" for k, v in s["inputs"].items())
    print_items(console, f"[bold]{s['op']}[/] num_bits={grid['num_bits']} narrow_range={grid['narrow_range']}  {escape(shapes)}")
    keys = ("min", "max", "nudged_min", "nudged_max", "scale", "zero_point")
    cols = (Col("", "left", priority=0), Col("min", priority=2), Col("max", priority=2), Col("nudged_min", priority=0),
            Col("nudged_max", priority=0), Col("scale", priority=1), Col("zero_point", priority=1))
    if isinstance(grid["min"], list):
        worst = _worst_channels(stats, len(grid["min"]))
        channels = range(len(grid["min"])) if worst is None else worst[1]
        rows = [[f"ch {c}", *(_fmt(grid[k][c]) for k in keys)] for c in channels[:8]]
        if worst is not None:
            name, _, share = worst
            cols = (Col("worst first", "left", priority=0), *cols[1:], Col(name, priority=0))
            rows = [row + [percent(share[c])] for row, c in zip(rows, channels)]
        if len(grid["min"]) > 8:
            rows.append([f"... {len(grid['min']) - 8} more"] + [""] * (len(cols) - 1))
    else:
        rows = [["range", *(_fmt(grid[k]) for k in keys)]]
    print_table(console, cols, rows, hint="--json for every value")
    if stats is not None and "clipped_below" in stats:  # streamed from disk: no clipped shares
        line = f"clipped below {percent(stats['clipped_below'])}, above {percent(stats['clipped_above'])}"
        if "gradient_blocked" in stats:
            line += f"; gradient mass blocked by the STE mask {percent(stats['gradient_blocked'])}"
        print_items(console, line)
    render_closing_lines(console, s)


def _worst_channels(stats, depth):
    """``(column name, channels worst first, share per channel)``: by the share of gradient mass the STE mask
    blocks, or without gradients by the share clipped; None without per-channel statistics.  Ties keep the
    channel order."""
    if stats is None:
        return None
    if stats.get("channel_gradient_blocked") is not None:
        name, share = "blocked", stats["channel_gradient_blocked"]
    elif stats.get("channel_clipped_below") is not None and stats.get("channel_clipped_above") is not None:
        name = "clipped"
        share = [b + a for b, a in zip(stats["channel_clipped_below"], stats["channel_clipped_above"])]
    else:
        return None
    if len(share) != depth:
        return None
    return name, sorted(range(depth), key=lambda c: -(share[c] if share[c] is not None else -1.0)), share
