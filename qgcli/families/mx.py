"""OCP Microscaling fake quant (``--semantics mx``): torchao 0.18's ``to_mx`` then its dequantization, bit for
bit (the math is :mod:`qgcli.ops.mx`; the formulas, sources and where torchao and the spec differ are in
docs/formats-mx.md).

Operand ``inputs`` (and ``gradients``); outputs ``outputs`` (float32), ``scales`` (the E8M0 codes, uint8, the
block axis divided by the block size) and ``quantized`` (the element codes; float8 written as its bytes, the
type in the ``quantized_dtype`` attribute).  The gradient is the identity (torchao's MX QAT).  Run-file groups:
``op = "mx"`` with the attributes ``format``, ``block_size``, ``axis``, ``scale_mode``.
"""
import numpy as np

from qgcli.errors import OperandError, QgcliError
from qgcli.families import block_formats as bf
from qgcli.families import block_rows
from qgcli.families.groups import plain
from qgcli.families.registry import FAKE_QUANT
from qgcli.jobs import Result
from qgcli.ops import mx as ops
from qgcli.report.summaries import describe_arrays

NAME, KIND = "mx", FAKE_QUANT
LITERAL_OK = ()
RUN_FILE_OPS = {"mx": None}
GROUP_OPERANDS = {None: (("inputs",), ("gradients",))}
VERIFY_BITWISE = ("outputs", "scales", "quantized", "backprops_wrt_input")
DEFAULTS = {"format": "mxfp8-e4m3", "block_size": 32, "axis": -1, "scale_mode": "floor"}
_GRADIENT_NOTE = ("gradient: the identity (torchao's MX QAT backward multiplies grad_output by the dequantized "
                  "tensors: no mask, no scale path)")


def claims(o):
    return o.semantics.semantics == "mx"


def refuse_options_outside(o):
    bf.refuse_format_options(o, "mx")


def mode(job):
    return "--semantics mx"


def _check(formats, shape=None):
    """The attributes checked (format, scale mode; the block size against the axis when the shape is known)."""
    if formats["format"] not in ops.FORMATS:
        raise OperandError(f"{formats['format']!r} is not one of {', '.join(ops.FORMATS)}", operand="format")
    if formats["scale_mode"] not in ops.SCALE_MODES:
        raise OperandError(f"{formats['scale_mode']!r} is not one of {', '.join(ops.SCALE_MODES)}",
                           operand="scale_mode")
    if int(formats["block_size"]) < 1:
        raise OperandError(f"{formats['block_size']} is not a positive block size", operand="block_size")
    if shape is not None:
        ops.check_blocks(shape, int(formats["axis"]), int(formats["block_size"]))


def job_from_options(o):
    bf.refuse_other_families(o, "mx", operands_allowed=("inputs", "gradients"))
    f = o.formats
    formats = {"semantics": "mx", "format": f.mx_format or DEFAULTS["format"],
               "block_size": DEFAULTS["block_size"] if f.block_size is None else int(f.block_size),
               "axis": -1 if o.attributes.axis is None else int(o.attributes.axis),
               "scale_mode": f.scale_mode or DEFAULTS["scale_mode"], "estimator": None}
    return bf.job_of_options(o, NAME, formats, {"inputs": o.operands.get("inputs")}, masked_ok=False,
                             why_not=" (--semantics onnx); torchao's MX QAT backward is the identity")


# --- run files -----------------------------------------------------------------------------------------------

def _group_formats(attrs):
    a = {k: plain(v) for k, v in attrs.items()}
    return {"semantics": "mx", "format": str(a.get("format", DEFAULTS["format"])).lower(),
            "block_size": int(a.get("block_size", DEFAULTS["block_size"])), "axis": int(a.get("axis", -1)),
            "scale_mode": str(a.get("scale_mode", DEFAULTS["scale_mode"])).lower(), "estimator": "ste"}


group_formats = _group_formats  # a group's attributes as a job's formats (qgcli plot's per-group figures)


def attribute_problem(attrs):
    return bf.problem(lambda: _check(_group_formats(attrs)), errors=(QgcliError, ValueError, TypeError),
                      prefix="attribute ")


def group_problem(layer, shapes):
    return bf.problem(lambda: _check(_group_formats(layer.attrs), shapes["inputs"]))


def job_from_group(run, layer, operand_specs, output, pick):
    return bf.job_of_group(run, NAME, _group_formats(layer.attrs), operand_specs, output, pick, masked_ok=False,
                           what="an mx group")


# --- computing -------------------------------------------------------------------------------------------------

def attributes(formats):
    return {k: formats[k] for k in ("format", "block_size", "axis", "scale_mode")}


def forward(inputs, formats, out=None):
    """:func:`qgcli.ops.mx.mx_fake_quantize` with the job's attributes (``out``: an earlier result to write over)."""
    return ops.mx_fake_quantize(inputs, format=formats["format"], block_size=int(formats["block_size"]),
                                axis=int(formats["axis"]), scale_mode=formats["scale_mode"], out=out)


def saturated_scales(codes, formats):
    """Blocks whose E8M0 code sits at a clamp: 0 (2^-127, every value halved or flushed) or 254/255."""
    c = np.asarray(codes)
    return (c == 0) | (c >= 254)


#: A run-file executor whose sink writes a group's outputs when it adds them passes ``kept``: the output arrays
#: of the last groups, reused for the next ones of the same shapes (:func:`qgcli.families.block_rows.keep`).
REUSES_OUTPUTS = True


def compute(job, operands, kept=None):
    f = job.formats
    inputs = bf.float32_operand(operands.get("inputs"), "inputs")
    gradients = operands.get("gradients") if job.with_gradients else None
    _check(f, tuple(np.shape(inputs)))
    described = describe_arrays({k: v for k, v in (("gradients", gradients), ("inputs", inputs)) if v is not None})
    attrs = {"op": "mx", "semantics": "mx", **attributes(f)}
    notes = []
    in_place = block_rows.in_place_ok(inputs, job)
    key = (NAME, np.shape(inputs), tuple(attributes(f).items()))
    res = None
    if not in_place and (not job.with_gradients or job.output.shows_summary):
        res = forward(inputs, f, out=block_rows.kept(kept, key))
        block_rows.keep(kept, key, res)
    if in_place:  # the outputs over the inputs, row block by row block, the statistics taken first
        out, stats = _in_place(job, inputs, attrs, kept, key)
    elif job.with_gradients:
        dx = ops.mx_fake_quantize_gradient(gradients, inputs, format=f["format"], block_size=int(f["block_size"]),
                                           axis=int(f["axis"]), scale_mode=f["scale_mode"])
        out = {"backprops_wrt_input": dx}
        attrs["estimator"] = "ste"
        notes.append(_GRADIENT_NOTE)
    else:
        out = bf.as_bytes({"outputs": res.outputs, "scales": res.scales, "quantized": res.quantized}, attrs)
    if str(getattr(inputs, "dtype", "")) not in ("float32", "bfloat16"):
        notes.append(f"inputs is {inputs.dtype}; computed on its float32 values (torchao takes float32 or bfloat16)")
    if not in_place:
        stats = bf.block_statistics(inputs, res.outputs, int(f["block_size"]), axis=int(f["axis"]),
                                    saturated=saturated_scales(res.scales, f))[0] if job.output.shows_summary else {}
    if job.output.shows_summary:
        if job.with_gradients:
            stats["gradient"] = bf.gradient_statistics(gradients, dx, "ste (identity)")
        if stats.get("saturated_scale_blocks"):
            notes.append("a saturated scale: E8M0 code 0 (torchao quantizes with 2^-126 and dequantizes with "
                         "2^-127: the block comes back halved) or 254/255 (Inf/NaN inputs)")
    return Result(out, attrs, bf.summary(job, f"MX {f['format']}", attributes(f), described, out, stats, notes))


render = bf.render


def _in_place(job, x, attrs, kept=None, key=None):
    """The forward over row blocks of ``x``, its outputs written over it (:func:`qgcli.families.block_rows.in_place`):
    ``(outputs as stored, statistics)``; ``attrs`` takes the small-float type names; ``kept``: as for
    :func:`compute`."""
    f = job.formats
    bs, axis = int(f["block_size"]), int(f["axis"])
    plan, dtype_attrs = block_rows.plan(job, {"inputs": x}, x_name="inputs", axis=axis % x.ndim, block_size=bs)
    attrs.update(dtype_attrs)
    show = job.output.shows_summary
    out, _, _, rows = block_rows.in_place(plan, x, statistics=bf.rows_statistics(bs, axis) if show else None,
                                          into=block_rows.kept(kept, ("rows",) + key))
    block_rows.keep(kept, ("rows",) + key, {k: v for k, v in out.items() if k != "outputs"})
    stats = bf.statistics_of_rows(rows, bs, x.shape, axis=axis, saturated=saturated_scales(out["scales"], f))[0] \
        if show else {}
    return out, stats


# --- in row blocks of the first axis (qgcli.families.block_rows) ------------------------------------------------

def block_setup(job, operands, datasets):
    """A tensor over --memory-limit in row blocks: its blocks are whole along the first axis when it is the
    block axis (:mod:`qgcli.families.block_rows`)."""
    f = job.formats
    shape = tuple(datasets["inputs"].shape)
    _check(f, shape)
    axis = int(f["axis"]) % len(shape)
    plan, dtype_attrs = block_rows.plan(job, datasets, x_name="inputs", axis=axis, block_size=int(f["block_size"]),
                                        needs_x=False)
    attrs = {"op": "mx", "semantics": "mx", **attributes(f), **dtype_attrs}
    if job.with_gradients:
        attrs["estimator"] = "ste"
    setup = block_rows.setup(job, plan, attrs, f"MX {f['format']}")
    setup["notes"] = [_GRADIENT_NOTE] if job.with_gradients else []
    return setup


def rows(plan, x, g, i0, i1, out=None):
    """Rows ``[i0, i1)`` of the tensor (:meth:`qgcli.families.block_rows.RowPlan.compute`)."""
    f = plan.formats
    kw = dict(format=f["format"], block_size=int(f["block_size"]), axis=int(f["axis"]), scale_mode=f["scale_mode"])
    if plan.gradient:
        return {"backprops_wrt_input": ops.mx_fake_quantize_gradient(g, None, **kw)}, None, {}
    res = ops.mx_fake_quantize(x, out=out, **kw)
    return {"outputs": res.outputs, "scales": res.scales, "quantized": res.quantized}, res, {}


def block_summary(job, operands, datasets, setup, small, notes):
    return block_rows.summary(job, operands, datasets, setup, small, notes, op=setup["op"],
                              attributes=attributes(job.formats))


def _element_scales(codes, block_size, axis):
    """Each element's block scale 2^(code - 127) (float64; NaN for code 255)."""
    e = np.asarray(codes).astype(np.float64)
    return np.exp2(np.repeat(np.where(e == 255, np.nan, e), block_size, axis=axis) - 127)


def block_view(formats, operands):
    """``qgcli plot hist / channels``' view of the tensor under ``formats`` (a job's, or :func:`group_formats`) (:class:`qgcli.families.block_formats.BlockView`)."""
    f = formats
    x = np.asarray(bf.float32_operand(operands.get("inputs"), "inputs"), np.float32)
    _check(f, tuple(np.shape(x)))
    res = forward(x, f)
    axis, bs = f["axis"] % x.ndim, int(f["block_size"])
    with np.errstate(all="ignore"):
        scales = _element_scales(res.scales, bs, axis)
        u, yu = x / scales, res.outputs / scales  # powers of 2: yu is each output's element value exactly
        log2 = np.where(res.scales == 255, np.nan, res.scales.astype(np.float64) - 127)

    def gradient(dy):
        return ops.mx_fake_quantize_gradient(dy, x, format=f["format"], block_size=bs, axis=int(f["axis"]),
                                             scale_mode=f["scale_mode"])

    return bf.block_view("mx", f"MX {f['format']}, scale mode {f['scale_mode']}, blocks of {bs} along axis "
                         f"{f['axis']}", "x / block scale 2^(E8M0 - 127)", x, res.outputs, u,
                         ops.element_values(f["format"]), bs, axis, log2_scales=log2,
                         saturated=saturated_scales(res.scales, f), yu=yu, gradient=gradient, scale=scales)


def report_analysis(formats, operands=None, inputs=None):
    """What ``qgcli report`` reads of the tensor (``inputs``, else ``operands``' ``inputs``) under ``formats``
    (:class:`qgcli.families.block_formats.BlockAnalysis`): elements beyond F times their block's scale as clipped,
    the block scales ``2^(E8M0 - 127)`` (NaN for code 255)."""
    f = formats
    x = bf.float32_operand(operands.get("inputs") if inputs is None else inputs, "inputs")
    _check(f, tuple(np.shape(x)))
    res = forward(x, f)
    axis, bs = f["axis"] % max(1, np.ndim(x)), int(f["block_size"])
    clipped = bf.saturated_elements(x, res.outputs, ops.FORMATS[f["format"]].max_pos *
                                    _element_scales(res.scales, bs, axis))
    saturated = saturated_scales(res.scales, f)
    notes = []
    if saturated.any():
        notes.append("a saturated scale: E8M0 code 0 (torchao quantizes with 2^-126 and dequantizes with 2^-127: "
                     "the block comes back halved) or 254/255 (Inf/NaN inputs)")
    codes = res.scales.astype(np.float64)
    return bf.BlockAnalysis(f"MX {f['format']}", attributes(f),
                            {"fp8": 8, "fpx": 6 if "fp6" in f["format"] else 4, "int8": 8}[ops.FORMATS[f["format"]].kind],
                            x, res.outputs, clipped, bs, axis, saturated,
                            np.exp2(np.where(codes == 255, np.nan, codes) - 127), tuple(notes))


def report_row(layer, operands, inputs, gradients, attr, num_bits, narrow_range, device):
    """``qgcli report``'s row of an mx group: blocks as channels, saturated elements as clipped, SQNR."""
    return bf.report_row(report_analysis(_group_formats(layer.attrs), inputs=inputs), gradients)


def layer_report_doc(layer, operands, *, threshold, sort, top, device):
    """``qgcli report RUN --layer PATH`` of a group: one row per block, as ``report BUNDLE --semantics`` gives it."""
    return bf.layer_report_doc(report_analysis, layer, operands, threshold=threshold, sort=sort, top=top)
