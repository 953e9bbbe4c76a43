"""What the block-format families share (:mod:`qgcli.families.mx`, :mod:`qgcli.families.nvfp4`,
:mod:`qgcli.families.onnx_quantize`): their options, refused where another family runs; the gradient estimators
(``ste``, the identity, and ``masked-ste``); small-float codes written as their bytes; the per-block analysis
(elements flushed to zero, saturated scales, dynamic range in bits, SQNR) and the summary on stderr.
"""
from typing import Any, NamedTuple, Optional

import numpy as np

from qgcli.errors import OperandError, OptionError, QgcliError
from qgcli.families import registry
from qgcli.families.groups import OVERRIDABLE
from qgcli.families.torchao import OPTION_NAMES
from qgcli.jobs import FakeQuantJob, OperandSpecs
from qgcli.report.summaries import describe_arrays, json_safe, percent, render_closing_lines
from qgcli.report.tables import print_items
from qgcli.report.text import counted, markup, printable_doc

#: --semantics -> the block-format options it takes
OPTIONS_OF = {"mx": ("--mx-format", "--block-size", "--scale-mode"), "nvfp4": ("--no-per-tensor-scale",),
              "onnx": ("--block-size", "--no-saturate")}
#: --estimator names of these families: ste and identity are the same identity STE
ESTIMATORS = ("ste", "identity", "masked-ste")
WORST_BLOCKS = 5  # worst blocks (lowest SQNR) in the summary


def refuse_format_options(o, own):
    """Each block-format option given that ``--semantics`` (``own``: this family's) does not take."""
    semantics = o.semantics.semantics
    for option in o.formats.given():
        takers = [s for s, opts in OPTIONS_OF.items() if option in opts]
        if semantics not in takers and own in takers and own == takers[0]:
            raise OptionError(f"only applies to --semantics {' / '.join(takers)}", param_hint=f"'{option}'")


def refuse_other_families(o, semantics, *, operands_allowed, dtype=False, axis=True):
    """The other families' options, refused for ``--semantics`` ``semantics``."""
    for option, value in o.semantics.torch_given().items():
        if value is not None:
            raise OptionError(f"only applies to --semantics torch; not to --semantics {semantics}",
                              param_hint=f"'{option}'")
    for field, value in o.torchao.given().items():

        raise OptionError("only applies to --semantics torchao", param_hint=f"'{OPTION_NAMES[field]}'")
    if o.attributes.variant is not None:
        raise OptionError(f"chooses a TensorFlow op; it does not apply to --semantics {semantics}",
                          param_hint="'--variant'")
    for option, value in (("--num-bits", o.attributes.num_bits_given), ("--narrow-range", o.attributes.narrow_range),
                          ("--axis", not axis and o.attributes.axis is not None)):
        if value:
            raise OptionError(f"does not apply to --semantics {semantics}", param_hint=f"'{option}'")
    for option in o.quantize.given():
        if option == "--dtype" and dtype:
            continue
        raise OptionError(f"does not apply to --semantics {semantics}", param_hint=f"'{option}'")
    if o.qdq is not None:
        for option, value in (("--signed-input", o.qdq.signed_input), ("--range-given", o.qdq.range_given)):
            if value is not None:
                raise OptionError(f"does not apply to --semantics {semantics}", param_hint=f"'{option}'")
    for name, spec in o.operands.specs:
        if spec is not None and name not in operands_allowed:
            raise OptionError(f"is not an operand of --semantics {semantics} ({', '.join(operands_allowed)})",
                              param_hint=f"'--{name.replace('_', '-')}'")
    if o.output.plot:
        raise OptionError(f"draws TensorFlow's STE only; 'qgcli plot hist/channels' draw --semantics {semantics} "
                          "tensors per block", param_hint="'--plot'")
    if o.estimator.grad_factor is not None:
        raise OptionError("only applies to --estimator lsq", param_hint="'--grad-factor'")


def estimator_name(o, *, masked_ok, why_not=""):
    """The estimator text of the fakequant-grad options: ``ste`` (default; ``identity`` is the same) or
    ``masked-ste`` (where ``masked_ok``)."""
    text = o.estimator.estimator
    if text is None:
        return "ste"
    name = str(text).strip().lower()
    if name not in ESTIMATORS:
        raise OptionError(f"{text!r}: --semantics {o.semantics.semantics} takes ste (the identity, the default) "
                          "or masked-ste", param_hint="'--estimator'")
    if name == "masked-ste" and not masked_ok:
        raise OptionError(f"masked-ste is for the integer types{why_not}", param_hint="'--estimator'")
    return "ste" if name == "identity" else name


def run_file_estimator(run, masked_ok, own="ste"):
    """A run file's --estimator for a block-format group: None (the group's ``own``: ste, or masked-ste where a
    QuantizeLinear group says so) or ste/identity (the identity STE) only (masked-ste typed: one bundle)."""
    est = run.estimator
    if est is None:
        return own
    if est.name in ("ste", "identity"):
        return "ste"
    raise QgcliError(f"--estimator {est.text} does not apply to a {run.command} block-format group (the "
                     "identity STE, or masked-ste where a QuantizeLinear group's estimator attribute says so; "
                     "--estimator masked-ste runs on one bundle)")


def job_of_options(o, family, formats, specs, *, masked_ok, why_not):
    """The job of the fakequant commands' options: ``formats`` with the estimator (fakequant-grad; --estimator
    is refused for fakequant) and ``specs`` (name -> SPEC) with ``gradients`` added for fakequant-grad."""
    if o.with_gradients:
        formats["estimator"] = estimator_name(o, masked_ok=masked_ok, why_not=why_not)
        specs["gradients"] = o.operands.get("gradients")
    elif o.estimator.estimator is not None:
        raise OptionError("only applies to fakequant-grad", param_hint="'--estimator'")
    return FakeQuantJob(command=o.command, family=family, with_gradients=o.with_gradients,
                        operands=OperandSpecs.of(o.operands.bundle, **specs), output=o.output,
                        axis=formats["axis"], formats=formats)


def job_of_group(run, family, formats, operand_specs, output, pick, *, masked_ok, what):
    """The job of a run-file group (``formats`` read from its attributes); the command line's attribute options
    are refused (``what``: the group's name in the message)."""
    for name in pick.given:
        raise QgcliError(f"{OVERRIDABLE.get(name, name)} does not apply to {what} (its attributes say it)")
    formats["estimator"] = (run_file_estimator(run, masked_ok, formats.get("estimator") or "ste")
                            if run.with_gradients else None)
    return FakeQuantJob(command=run.command, family=family, with_gradients=run.with_gradients,
                        operands=operand_specs, output=output, axis=formats["axis"], formats=formats)


def problem(check, *args, errors=(QgcliError,), prefix=""):
    """The one-line message of ``check(*args)``'s error (of the types ``errors``), or None when it passes."""
    try:
        check(*args)
    except errors as exc:
        return f"{prefix}{exc}"
    return None


def gradient_statistics(gradients, dx, estimator):
    """The summary's gradient part: shares of the elements passed unchanged and zeroed."""
    g = np.asarray(gradients, np.float32)
    return {"estimator": estimator, "unchanged": float((dx == g).mean()) if g.size else 1.0,
            "zeroed": float((dx == 0).mean()) if g.size else 0.0}


def float32_operand(value, name):
    """An operand as float32 (bfloat16 and float16 values exactly), or an OperandError."""
    a = np.asarray(value) if not hasattr(value, "dtype") else value
    if getattr(a.dtype, "kind", "f") not in "fV" and a.dtype.name != "bfloat16":
        raise OperandError(f"dtype {a.dtype} is not a floating type", operand=name)
    return a


def as_bytes(arrays, attrs):
    """Small-float arrays (ml_dtypes float8 / float4) as their uint8 bytes, the type in ``attrs``
    (``<name>_dtype``): every storage format keeps uint8, none keeps ml_dtypes' types."""
    out = {}
    for name, a in arrays.items():
        dt = getattr(a, "dtype", None)
        if dt is not None and dt.itemsize == 1 and dt.kind == "V" or (dt is not None and dt.name.startswith("float")
                                                                      and dt.itemsize == 1):
            attrs[f"{name}_dtype"] = dt.name
            a = np.asarray(a).view(np.uint8)
        out[name] = a
    return out


# --- the per-block analysis ------------------------------------------------------------------------------------

def block_statistics(x, y, block_size, *, axis=-1, saturated=None, scale_shape=None):
    """Per block of ``block_size`` along ``axis`` (``x`` the inputs, ``y`` the dequantized outputs): dict of
    per-block arrays (float64) and the totals.

    - ``flushed``: share of the block's nonzero finite inputs that come back 0;
    - ``dynamic_range_bits``: log2 max|x| - log2 of the smallest nonzero |x| (NaN for an all-zero block);
    - ``sqnr_db``: 10 log10(sum x^2 / sum (y - x)^2) over the finite elements (inf when exact);
    - ``saturated``: the per-block booleans given (the block's scale at its clamp, shaped like the scales or
      already in block order), else None.
    """
    return parts_statistics(block_parts(x, y, block_size, axis=axis), block_size, np.shape(x), axis=axis,
                            saturated=saturated, scale_shape=scale_shape)


def block_parts(x, y, block_size, *, axis=-1):
    """What :func:`block_statistics` sums per block of ``x`` (or of rows of it: :func:`joined_parts` puts the
    rows' parts together): ``flushed`` and ``nonzero`` counts, ``amax``, ``amin`` (smallest nonzero), ``sig``
    and ``err`` (sums of squares), each one per block in block order, and ``nan`` (NaN outputs)."""
    x = np.asarray(x, np.float32)
    y = np.asarray(y, np.float32)
    ax = axis % x.ndim if x.ndim else 0
    if x.ndim:
        x = np.moveaxis(x, ax, -1)
        y = np.moveaxis(y, ax, -1)
    xb = x.reshape(-1, block_size).astype(np.float64)
    yb = y.reshape(-1, block_size).astype(np.float64)
    fin = np.isfinite(xb) & np.isfinite(yb)
    ax_ = np.where(np.isfinite(xb), np.abs(xb), 0.0)
    nonzero = fin & (ax_ > 0)
    with np.errstate(all="ignore"):
        return {"flushed": (nonzero & (yb == 0)).sum(axis=1), "nonzero": nonzero.sum(axis=1),
                "amax": ax_.max(axis=1) if xb.size else np.zeros(0),
                "amin": np.where(nonzero, ax_, np.inf).min(axis=1) if xb.size else np.zeros(0),
                "sig": (np.where(fin, xb, 0.0) ** 2).sum(axis=1),
                "err": (np.where(fin, yb - xb, 0.0) ** 2).sum(axis=1),
                "nan": int(np.isnan(yb).sum())}


_REDUCE = {"flushed": np.sum, "nonzero": np.sum, "amax": np.max, "amin": np.min, "sig": np.sum, "err": np.sum}


def joined_parts(parts, grids=None, axis=0, whole=False):
    """The :func:`block_parts` of row blocks of one tensor as the whole tensor's: the blocks of each row block
    (``grids``: each one's blocks' grid, block axis last) joined along ``axis`` of that grid (where the tensor's
    first axis lies), or, ``whole``, every row block's one block as one."""
    if whole:
        out = {k: np.array([reduce(np.concatenate([p[k] for p in parts]))]) for k, reduce in _REDUCE.items()}
    else:
        out = {k: np.concatenate([p[k].reshape(g) for p, g in zip(parts, grids)], axis=axis).reshape(-1)
               for k in _REDUCE}
    out["nan"] = sum(p["nan"] for p in parts)
    return out


def rows_statistics(block_size, axis, *, whole=False):
    """What the statistics take of one row block (``x`` rows, ``y`` rows) of a tensor quantized in row blocks
    (:func:`qgcli.families.block_rows.in_place`): its :func:`block_parts` and its blocks' grid (``whole``: the
    tensor is one block)."""
    def parts(x, y):
        if whole:
            return block_parts(np.reshape(x, (1, -1)), np.reshape(y, (1, -1)), max(1, np.size(x))), None
        moved = np.moveaxis(np.empty(np.shape(x), np.bool_), axis % np.ndim(x), -1).shape
        return block_parts(x, y, block_size, axis=axis), moved[:-1] + (moved[-1] // block_size,)

    return parts


def statistics_of_rows(rows, block_size, shape, *, axis=-1, whole=False, saturated=None):
    """:func:`block_statistics` of the tensor of ``shape`` from its row blocks' ``rows`` (each
    ``(parts, grid)`` of :func:`rows_statistics`, in order): the same numbers, but for ``whole`` (the tensor as
    one block), whose sums of squares are added row block by row block (the last bits of its SQNR may differ)."""
    parts, grids = zip(*rows)
    ndim = len(shape)
    if whole:
        size = int(np.prod(shape))
        return parts_statistics(joined_parts(parts, whole=True), max(1, size), (1, size))
    ax = axis % ndim
    joined = joined_parts(parts, grids, axis=0 if ax != 0 else ndim - 1)
    return parts_statistics(joined, block_size, shape, axis=axis, saturated=saturated)


def parts_statistics(parts, block_size, shape, *, axis=-1, saturated=None, scale_shape=None):
    """:func:`block_statistics` of the tensor of ``shape`` from its :func:`block_parts`."""
    ndim = len(shape)
    ax = axis % ndim if ndim else 0
    moved = tuple(np.moveaxis(np.empty(shape, np.bool_), ax, -1).shape) if ndim else ()
    flushed_n, nz, amax, amin = parts["flushed"], parts["nonzero"], parts["amax"], parts["amin"]
    sig_b, err_b = parts["sig"], parts["err"]
    with np.errstate(all="ignore"):
        dyn = np.where(nz > 0, np.log2(amax) - np.log2(amin), np.nan)
        sqnr = np.where(err_b > 0, 10 * np.log10(sig_b / err_b), np.inf)
        total_sqnr = float(10 * np.log10(sig_b.sum() / err_b.sum())) if err_b.sum() > 0 else float("inf")
    n_blocks = len(sig_b)
    stats = {"blocks": n_blocks, "block_size": int(block_size),
             "flushed": float(flushed_n.sum() / nz.sum()) if nz.sum() else 0.0,
             "sqnr_db": total_sqnr,
             "nan_outputs": int(parts["nan"]),
             "dynamic_range_bits_max": float(np.nanmax(dyn)) if np.isfinite(dyn).any() else None,
             "dynamic_range_bits_median": float(np.nanmedian(dyn)) if np.isfinite(dyn).any() else None}
    sat = None
    if saturated is not None:
        sat = np.asarray(saturated)
        if ndim and sat.ndim == ndim:  # shaped like the scales: the block axis last, as the blocks are
            sat = np.moveaxis(sat, ax, -1)
        sat = sat.reshape(-1)
        stats["saturated_scale_blocks"] = float(sat.mean()) if sat.size else 0.0
    per_block = {"flushed": np.divide(flushed_n, nz, out=np.zeros(n_blocks), where=nz > 0),
                 "dynamic_range_bits": dyn, "sqnr_db": sqnr, "saturated": sat}
    shape = scale_shape if scale_shape is not None else (moved[:-1] + (moved[-1] // block_size,) if ndim
                                                         else ())
    order = np.lexsort((np.arange(n_blocks), -per_block["flushed"], sqnr))  # lowest SQNR first
    per_block["order"] = order
    stats["worst_blocks"] = [block_row(per_block, int(i), shape, ax if ndim else None) for i in
                             order[:WORST_BLOCKS] if np.isfinite(sqnr[i]) or per_block["flushed"][i] > 0]
    return stats, per_block, shape


def block_row(per_block, i, shape, axis):
    """One block's statistics as a JSON-safe dict (``index``: its place in the scales' shape, block axis last
    before it was moved back)."""
    index = [int(v) for v in np.unravel_index(i, shape)] if shape else []
    if axis is not None and index:
        index.insert(axis, index.pop())  # the block axis back in its place
    sat = per_block["saturated"]
    dyn = float(per_block["dynamic_range_bits"][i])
    return {"block": i, "index": index, "flushed": float(per_block["flushed"][i]),
            "dynamic_range_bits": dyn if np.isfinite(dyn) else None,
            "sqnr_db": float(per_block["sqnr_db"][i]), "saturated": None if sat is None else bool(sat[i])}


# --- what qgcli plot hist / channels draw per block -------------------------------------------------------------

class BlockView(NamedTuple):
    """A block-format tensor as ``qgcli plot hist`` / ``plot channels`` draw it (:mod:`qgcli.report.block_plots`):
    ``x`` and ``y`` (inputs and dequantized outputs, float32), ``u`` (each input in its element grid's units:
    divided by its block's scale, plus the zero point), ``levels`` (the values that grid holds), the per-block
    statistics of :func:`block_statistics` (``stats``, ``per_block``, ``shape``: the blocks' grid) and each
    block's ``log2_scales`` (None where there is no scale per block).  For ``plot staircase`` / ``plot ste``:
    ``yu``, the op's outputs in the same units (the element values of its codes), and ``gradient``, the op's own
    gradient as a function of the upstream gradient (None where the family gives none); ``scale`` and ``zero``,
    each element's block scale and zero point (shaped like ``x``: ``x = (u - zero) * scale``), for the staircase
    of a block in the data's own units (None where the family gives none)."""

    op: str
    title: str
    unit: str
    x: Any
    y: Any
    u: Any
    levels: Any
    block_size: int
    axis: Optional[int]
    stats: dict
    per_block: dict
    shape: tuple
    log2_scales: Any = None
    yu: Any = None
    gradient: Any = None
    scale: Any = None
    zero: Any = None


def block_view(op, title, unit, x, y, u, levels, block_size, axis, *, log2_scales=None, saturated=None, yu=None,
               gradient=None, scale=None, zero=0.0):
    """A :class:`BlockView`; ``axis`` None: the tensor is one block; ``log2_scales`` and ``saturated`` shaped
    like the scales (the block axis in its place), put in the order of :func:`block_statistics`' blocks."""
    x = np.asarray(x, np.float32)
    y = np.asarray(y, np.float32)

    def ordered(a):
        if a is None:
            return None
        a = np.asarray(a)
        return (np.moveaxis(a, axis, -1) if axis is not None and a.ndim else a).reshape(-1)

    if axis is None:
        stats, per_block, shape = block_statistics(x.reshape(1, -1), y.reshape(1, -1), max(1, x.size),
                                                   saturated=saturated)
    else:
        stats, per_block, shape = block_statistics(x, y, block_size, axis=axis, saturated=saturated)
    return BlockView(op, title, unit, x, y, np.asarray(u, np.float64), np.asarray(levels, np.float64),
                     int(block_size if axis is not None else max(1, x.size)), axis, stats, per_block, shape,
                     ordered(log2_scales), None if yu is None else np.asarray(yu, np.float64), gradient,
                     None if scale is None else np.broadcast_to(np.asarray(scale, np.float64), x.shape),
                     None if scale is None else np.broadcast_to(np.asarray(zero, np.float64), x.shape))


# --- the summary -------------------------------------------------------------------------------------------------

def summary(job, op, attrs, operands_described, outputs, stats, notes):
    return json_safe({"command": job.command, "op": op, "semantics": job.formats["semantics"],
                      "attributes": attrs, "inputs": operands_described, "statistics": stats,
                      "outputs": describe_arrays(outputs), "output": job.output.destination, "notes": notes})


def render(console, s):
    """The fakequant / fakequant-grad summary of a block format, on stderr."""
    s = printable_doc(s)
    fields = " ".join(f"{k}={v}" for k, v in s["attributes"].items() if v is not None)
    print_items(console, f"[bold]{markup(s['op'])}[/] {markup(fields)}", soft_wrap=True)
    st = s["statistics"]
    if st is None:  # computed in row blocks: no per-block statistics (the notes say so)
        render_closing_lines(console, s)
        return
    sqnr = st.get("sqnr_db")
    line = (f"{counted(st['blocks'], 'block')} of {st['block_size']}: flushed to zero {percent(st['flushed'])} of "
            f"the nonzero inputs, SQNR {'exact' if sqnr is None and not st.get('nan_outputs') else sqnr if sqnr is None else f'{sqnr:.2f} dB'}")
    if st.get("saturated_scale_blocks") is not None:
        line += f"; scale saturated in {percent(st['saturated_scale_blocks'])} of the blocks"
    if st.get("clipped") is not None:
        line += f"; clipped {percent(st['clipped'])}"
    print_items(console, line, soft_wrap=True)
    if st.get("dynamic_range_bits_max") is not None:
        print_items(console, f"block dynamic range (log2 max|x| - log2 min nonzero |x|): median "
                             f"{st['dynamic_range_bits_median']:.1f} bits, largest {st['dynamic_range_bits_max']:.1f}")
    worst = [r for r in st.get("worst_blocks", []) if r["sqnr_db"] is not None]
    if worst:
        shown = ", ".join(f"{tuple(r['index'])} {r['sqnr_db']:.1f} dB" for r in worst)
        print_items(console, f"worst blocks (SQNR): {shown}", soft_wrap=True)
    if "gradient" in st:
        g = st["gradient"]
        print_items(console, f"gradient: {g['estimator']}; passed unchanged {percent(g['unchanged'])}, zeroed "
                             f"{percent(g['zeroed'])}")
    render_closing_lines(console, s)


# --- qgcli report: a run-file group's row, and one tensor per block ----------------------------------------------

def saturated_elements(x, y, limit):
    """Elements whose dequantized magnitude sits at the format's largest value (``limit``, broadcast against ``y``:
    F times the block's scale) while the input lies beyond it: clipped, as the fake-quant families count it."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    with np.errstate(all="ignore"):
        return np.isfinite(x) & np.isfinite(y) & (np.abs(y) == np.asarray(limit, np.float64)) & (np.abs(x) > np.abs(y))


class BlockAnalysis(NamedTuple):
    """What ``qgcli report`` reads of a block-format tensor (each family's ``report_analysis``), the same for a
    run-file group and for one tensor (``report BUNDLE --semantics mx|nvfp4|onnx``): ``x`` and ``y`` (inputs and
    dequantized outputs), ``clipped`` (the elements that saturated), the blocks (``block_size`` along ``axis``;
    a tensor without blocks is one block of ``x.size``), ``saturated`` (per block, shaped like the scales: the
    scale at its clamp; None where no scale saturates) and ``scales`` (each block's scale, shaped like the
    scales; None where there is none per block)."""

    op: str
    attributes: dict
    num_bits: int
    x: Any
    y: Any
    clipped: Any
    block_size: int
    axis: int
    saturated: Any = None
    scales: Any = None
    notes: tuple = ()
    whole: bool = False  # the tensor as one block (it has no blocks)


def whole_tensor(a):
    """``a`` with the tensor as one block (ONNX per tensor or per axis, or a partial last block)."""
    n = max(1, int(np.size(a.x)))
    return a._replace(x=np.reshape(a.x, (1, -1)), y=np.reshape(a.y, (1, -1)), clipped=np.reshape(a.clipped, (1, -1)),
                      block_size=n, axis=-1, whole=True,
                      scales=None if a.scales is None or np.size(a.scales) != 1 else np.reshape(a.scales, (1, 1)))


def _in_block_order(a, values):
    """Per-block ``values`` shaped like the scales, as one vector in the order of :func:`block_statistics`."""
    v = np.asarray(values)
    if np.ndim(a.x) and v.ndim == np.ndim(a.x):
        v = np.moveaxis(v, a.axis % np.ndim(a.x), -1)
    return v.reshape(-1)


def block_report(a, gradients=None, passed=None):
    """``(row, per_block, shape)`` of :class:`BlockAnalysis` ``a``: ``row`` is ``qgcli report``'s row
    (:data:`qgcli.report.layers.LAYER_KEYS`): channels are the blocks, clipped the saturated elements (below:
    negative), SQNR over the tensor, the worst block the one of lowest SQNR (``worst_channel_sqnr_db``), the share
    of nonzero inputs flushed to zero, the blocks' dynamic range in bits (median, largest) and the share of
    blocks whose scale saturates; ``passed``: the estimator's mask (None: the identity STE passes every
    element).  ``per_block`` holds :func:`block_statistics`' arrays, ``order`` (worst first), ``clipped`` /
    ``clipped_below`` (shares per block) and ``scale``."""
    x64 = np.asarray(a.x, np.float64)
    n = x64.size
    clipped = np.asarray(a.clipped, bool)
    below = clipped & (x64 < 0)
    row = {"clipped_below": float(below.sum()) / n if n else 0.0,
           "clipped_above": float((clipped & ~below).sum()) / n if n else 0.0}
    row["clipped"] = row["clipped_below"] + row["clipped_above"]
    stats, per_block, shape = block_statistics(a.x, a.y, a.block_size, axis=a.axis, saturated=a.saturated)
    nb = stats["blocks"]
    row["channels"] = nb
    row["sqnr_db"] = stats["sqnr_db"] if np.isfinite(stats["sqnr_db"]) else None
    row["exact"] = stats["sqnr_db"] == np.inf  # no error on any finite element
    row.update(flushed=stats["flushed"], saturated_scale_blocks=stats.get("saturated_scale_blocks"),
               dynamic_range_bits_median=stats["dynamic_range_bits_median"],
               dynamic_range_bits_max=stats["dynamic_range_bits_max"])

    def blocked(v):
        return (np.moveaxis(v, a.axis % v.ndim, -1) if v.ndim else v).reshape(nb, -1)

    per_block["clipped"] = blocked(clipped).mean(axis=1) if nb and a.block_size else np.zeros(nb)
    per_block["clipped_below"] = blocked(below).mean(axis=1) if nb and a.block_size else np.zeros(nb)
    per_block["scale"] = None if a.scales is None else _in_block_order(a, np.asarray(a.scales, np.float64))
    if nb > 1:
        worst = int(per_block["order"][0])
        row["worst_channel_sqnr_db"] = float(per_block["sqnr_db"][worst]) if np.isfinite(
            per_block["sqnr_db"][worst]) else None
        row.update(worst_channel=worst, worst_channel_clipped=float(per_block["clipped"][worst]))
    if gradients is not None:
        mag = np.abs(np.asarray(gradients, np.float64))
        mag = np.where(np.isfinite(mag), mag, 0.0)
        total = float(mag.sum())
        lost = 0.0 if passed is None else float(np.where(passed, 0.0, mag).sum())
        row["gradient_blocked"] = lost / total if total else 0.0
        if "worst_channel" in row:
            row["worst_channel_gradient_blocked"] = 0.0 if passed is None else None
    return row, per_block, shape


def report_row(a, gradients=None, passed=None):
    """``qgcli report``'s row of a run-file group (:func:`block_report`), with its ``num_bits``."""
    return {"num_bits": a.num_bits, **block_report(a, gradients, passed)[0]}


#: The schema number of ``report BUNDLE --semantics mx|nvfp4|onnx --json``'s document.
REPORT_SCHEMA = 1
#: The rows of that report (one per block), as --json, --csv and --parquet give them.
ROW_KEYS = ("block", "index", "scale", "flushed", "clipped_below", "clipped_above", "clipped", "saturated_scale",
            "dynamic_range_bits", "sqnr_db", "flagged")
SORTS = ("worst", "sqnr", "clipped", "channel")


#: Standard-normal blocks in the sample that gives a block format's inherent flushing and clipping
#: (:func:`inherent_shares`); seeded, so the limits are the same from run to run.
REFERENCE_BLOCKS = 8192
REFERENCE_SEED = 38
_inherent = {}  # (analyse, block size, formats) -> inherent_shares' dict


def inherent_shares(analyse, formats, block_size):
    """What the element format does to well-behaved data: the largest share of nonzero inputs flushed to zero
    and of elements clipped among :data:`REFERENCE_BLOCKS` seeded standard-normal blocks of ``block_size``
    quantized with the same ``formats`` (``analyse``: the family's ``report_analysis``; the blocks along the
    last axis).  fp4's grid spans 3.6 bits below the block's largest value (6 down to 0.5), so a Gaussian
    block of 32 flushes 9% of its values on average and up to about a third; with ``floor`` a block's
    largest values can also exceed F after scaling (as many again of a block of 32 under fp4).  Those are
    the format working as designed, not a bad block: :func:`report_doc` flags a block only beyond them."""
    key = (analyse, int(block_size), tuple(sorted((k, str(v)) for k, v in formats.items())))
    if key not in _inherent:
        rng = np.random.default_rng(REFERENCE_SEED)
        # two blocks a row: an even row length, as fp4's packing needs, whatever the block size
        sample = rng.standard_normal((REFERENCE_BLOCKS // 2, 2 * int(block_size))).astype(np.float32)
        _, per_block, _ = block_report(analyse(dict(formats, axis=-1), inputs=sample))
        _inherent[key] = {"flushed": float(per_block["flushed"].max()), "clipped": float(per_block["clipped"].max())}
    return _inherent[key]


def report_doc(a, *, semantics, inputs, threshold, sort, top, inherent=None):
    """``report BUNDLE --semantics mx|nvfp4|onnx``: one row per block (:data:`ROW_KEYS`, worst first: lowest
    SQNR, then most flushed; ``sort`` ``clipped``: most clipped; ``channel``: block order), the totals (the
    row a run-file group of the same tensor gets, :func:`block_report`), a verdict.  A block is flagged when
    its scale saturates, or when more of its nonzero inputs flush to zero, or of its elements clip, than
    ``threshold`` above the format's own share (``inherent``, from :func:`inherent_shares`: the most a
    standard-normal block loses under the same format; None, as for ONNX whose scales are given: 0)."""
    from qgcli import __version__

    inherent = inherent or {"flushed": 0.0, "clipped": 0.0}
    limits = {k: min(1.0, threshold + inherent[k]) for k in ("flushed", "clipped")}
    total, per_block, shape = block_report(a)
    total = {"num_bits": a.num_bits, "blocks": total["channels"], "block_size": int(a.block_size), **total}
    for key in ("worst_channel", "worst_channel_sqnr_db", "worst_channel_clipped"):  # one block: no worst one
        total.setdefault(key, None)
    axis = a.axis % np.ndim(a.x) if np.ndim(a.x) else None
    rows = []
    for i in range(total["blocks"]):
        r = block_row(per_block, i, () if a.whole else shape, axis)
        sat = r.pop("saturated")
        below = float(per_block["clipped_below"][i])
        scale = None if per_block["scale"] is None else float(per_block["scale"][i])
        r = {"block": r["block"], "index": r["index"], "scale": scale, "flushed": r["flushed"],
             "clipped_below": below, "clipped_above": float(per_block["clipped"][i]) - below,
             "clipped": float(per_block["clipped"][i]), "saturated_scale": sat,
             "dynamic_range_bits": r["dynamic_range_bits"], "sqnr_db": r["sqnr_db"]}
        r["flagged"] = bool(r["flushed"] > limits["flushed"] or r["clipped"] > limits["clipped"] or sat)
        rows.append(r)
    if sort == "clipped":
        rows.sort(key=lambda r: (-r["clipped"], r["block"]))
    elif sort != "channel":  # worst, sqnr: the order of block_statistics
        rows = [rows[int(i)] for i in per_block["order"]]
    flagged = [r for r in rows if r["flagged"]]
    verdict = _verdict(total, flagged, threshold, inherent, limits)
    return json_safe({"command": "report", "schema": REPORT_SCHEMA, "qgcli_version": __version__,
                      "semantics": semantics, "op": a.op, "attributes": a.attributes, "inputs": inputs,
                      "blocks": total["blocks"], "block_size": total["block_size"], "threshold": threshold,
                      "inherent": inherent, "limits": limits,
                      "sort": sort, "top": top, "total": total, "rows": rows if top is None else rows[:top],
                      "verdict": verdict, "notes": list(a.notes)})


def report_doc_of(analyse, formats, operands, *, semantics, threshold, sort, top):
    """:func:`report_doc` of the tensor in open ``operands`` (closed here) under ``formats``: ``analyse`` is the
    family's ``report_analysis``.  ``report BUNDLE --semantics ...`` and ``report RUN --layer PATH`` of a
    block-format group both come here."""
    if sort not in SORTS + ("block",):
        raise OptionError(f"{sort} does not apply to a block format's report; use {', '.join(SORTS)}",
                          param_hint="'--sort'")
    try:
        a = analyse(formats, operands)
        x_name = "x" if semantics == "onnx" and operands.has("x") else "inputs"
        described = describe_arrays({x_name: np.reshape(a.x, np.shape(operands.get(x_name))),
                                     **{k: operands.get(k) for k in ("y_scale", "y_zero_point")
                                        if semantics == "onnx" and operands.has(k)}})
    finally:
        operands.close()
    inherent = None if a.whole or semantics == "onnx" else inherent_shares(analyse, formats, a.block_size)
    return report_doc(a, semantics=semantics, inputs=described, threshold=threshold,
                      sort="channel" if sort == "block" else sort, top=top, inherent=inherent)


def layer_report_doc(analyse, layer, operands, *, threshold, sort, top):
    """``report RUN --layer PATH`` of a block-format group: :func:`report_doc_of` with its attributes."""
    fam = registry.of(layer)
    return report_doc_of(analyse, fam.group_formats(layer.attrs), operands, semantics=fam.NAME, threshold=threshold,
                         sort=sort, top=top)


def _block_name(r):
    return "block " + (",".join(map(str, r["index"])) if r["index"] else "all")


def _verdict(total, flagged, threshold, inherent, limits):
    sqnr = total["sqnr_db"]
    over = f"SQNR {'exact' if sqnr is None else f'{sqnr:.1f} dB'} over the tensor"
    if total.get("worst_channel_sqnr_db") is not None:
        over += f", {total['worst_channel_sqnr_db']:.1f} dB in the worst block"
    names = ", ".join(_block_name(r) for r in flagged[:3]) + (f" and {len(flagged) - 3} more" if len(flagged) > 3
                                                                else "")
    if inherent["flushed"] or inherent["clipped"]:  # the limits are the format's own shares plus the threshold
        fl, cl = (f"{100 * limits[k]:.3g}%" for k in ("flushed", "clipped"))
        why = f"the most a Gaussian block loses to this format, plus {100 * threshold:g}%"
        if not flagged:
            return (f"Verdict: OK, no block flushes more than {fl} of its values to zero or clips more than {cl} "
                    f"({why}) or saturates its scale; {over}.")
        return (f"Verdict: {len(flagged)} of {counted(total['blocks'], 'block')} flagged, more than {fl} of the "
                f"values flushed to zero or {cl} clipped ({why}), or the scale saturated ({names}); {over}.")
    thr = f"{100 * threshold:g}%"
    if not flagged:
        return (f"Verdict: OK, no block flushes or clips more than {thr} of its values or saturates its scale; "
                f"{over}.")
    return (f"Verdict: {len(flagged)} of {counted(total['blocks'], 'block')} flagged, more than {thr} of the values "
            f"flushed to zero or clipped, or the scale saturated ({names}); {over}.")


_REPORT_COLS = None


def _report_cols():
    global _REPORT_COLS
    if _REPORT_COLS is None:
        from qgcli.report.tables import Col

        # Priority: 0 always shown, higher numbers dropped first to fit the terminal (qgcli.report.tables).
        _REPORT_COLS = (
            Col("block", priority=0), Col("scale", priority=1),
            Col("flushed", help="share of the block's nonzero inputs that come back 0", priority=0),
            Col("clip<", help="elements saturated below / above", priority=2), Col("clip>", priority=2),
            Col("sat", help="the block's scale at its clamp", priority=1),
            Col("range", help="log2 max|x| - log2 min nonzero |x|, bits", priority=1),
            Col("SQNR", help="dB", priority=0),
        )
    return _REPORT_COLS


def render_report(console, doc, limit):
    """The table of :func:`report_doc` (``limit``: rows shown), the totals, the notes and the verdict."""
    from qgcli.report.summaries import number
    from qgcli.report.tables import print_table

    doc = printable_doc(doc)
    fields = " ".join(f"{k}={v}" for k, v in doc["attributes"].items() if v is not None)
    src = ", ".join(f"{k} {v['shape']} {v['dtype']}" for k, v in doc["inputs"].items())
    print_items(console, f"[bold]{markup(doc['op'])}[/] {markup(fields)}  {markup(src)}")
    rows = doc["rows"] if limit is None else doc["rows"][:limit]

    def db(v):
        return "exact" if v is None else f"{v:.1f}"

    def pct(v):
        return f"{100 * v:.1f}%"

    cells = [[",".join(map(str, r["index"])) or "all", number(r["scale"], 4), pct(r["flushed"]),
              pct(r["clipped_below"]), pct(r["clipped_above"]),
              "-" if r["saturated_scale"] is None else "yes" if r["saturated_scale"] else "",
              "-" if r["dynamic_range_bits"] is None else f"{r['dynamic_range_bits']:.1f}", db(r["sqnr_db"])]
             for r in rows]
    print_table(console, _report_cols(), cells, styles=["red" if r["flagged"] else None for r in rows], choice=True)
    if len(rows) < len(doc["rows"]) or len(doc["rows"]) < doc["blocks"]:
        print_items(console, f"... {counted(doc['blocks'] - len(rows), 'more block')} (--top K, --json or --csv "
                             "for all)")
    t = doc["total"]
    parts = [f"all {counted(t['blocks'], 'block')} of {t['block_size']}: flushed to zero {percent(t['flushed'])} of "
             f"the nonzero inputs", f"clipped {percent(t['clipped_below'])} below, {percent(t['clipped_above'])} above"]
    if t.get("saturated_scale_blocks") is not None:
        parts.append(f"scale saturated in {percent(t['saturated_scale_blocks'])} of the blocks")
    if t.get("dynamic_range_bits_max") is not None:
        parts.append(f"block dynamic range median {t['dynamic_range_bits_median']:.1f}, largest "
                     f"{t['dynamic_range_bits_max']:.1f} bits")
    print_items(console, "; ".join(parts))
    for note in doc["notes"]:
        print_items(console, f"[yellow]note:[/] {markup(note)}")
    print_items(console, f"[bold]{markup(doc['verdict'])}[/]")
