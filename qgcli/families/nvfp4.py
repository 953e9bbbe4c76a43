"""NVFP4 fake quant (``--semantics nvfp4``): torchao 0.18's ``NVFP4Tensor.to_nvfp4(...).dequantize(float32)``,
bit for bit (the math is :mod:`qgcli.ops.nvfp4`; formulas and sources in docs/formats-nvfp4.md).

Blocks of 16 along ``--axis`` (default -1), E4M3 block scales and, unless ``--no-per-tensor-scale``, the FP32
per-tensor scale ``max|x| / 2688``.  Operand ``inputs`` (and ``gradients``); outputs ``outputs``,
``block_scales`` (float8 e4m3fn, written as its bytes with ``block_scales_dtype``), ``tensor_scale`` and
``quantized`` (uint8 fp4 codes, one per element).  Where torchao's per-tensor scale turns the tensor into NaN
(all zero, a NaN or Inf) qgcli does the same and says so in a note.  The gradient is the identity (torchao's
NVFP4 QAT).  Run-file groups: ``op = "nvfp4"`` with ``axis`` and ``per_tensor_scale``.
"""

import numpy as np

from qgcli.families import block_formats as bf
from qgcli.families import block_rows
from qgcli.families.groups import is_bool, plain
from qgcli.families.registry import FAKE_QUANT
from qgcli.jobs import Result
from qgcli.ops import nvfp4 as ops
from qgcli.ops.mx import check_blocks, element_values
from qgcli.report.summaries import describe_arrays

NAME, KIND = "nvfp4", FAKE_QUANT
LITERAL_OK = ()
RUN_FILE_OPS = {"nvfp4": None}
GROUP_OPERANDS = {None: (("inputs",), ("gradients",))}
VERIFY_BITWISE = ("outputs", "block_scales", "tensor_scale", "quantized", "backprops_wrt_input")
BLOCK_SIZE = 16
_GRADIENT_NOTE = ("gradient: the identity (torchao's NVFP4 QAT backward multiplies grad_output by the dequantized "
                  "tensors)")


def claims(o):
    return o.semantics.semantics == "nvfp4"


def refuse_options_outside(o):
    bf.refuse_format_options(o, "nvfp4")


def mode(job):
    return "--semantics nvfp4"


def job_from_options(o):
    bf.refuse_other_families(o, "nvfp4", operands_allowed=("inputs", "gradients"))
    formats = {"semantics": "nvfp4", "block_size": BLOCK_SIZE,
               "axis": -1 if o.attributes.axis is None else int(o.attributes.axis),
               "per_tensor_scale": o.formats.per_tensor_scale is not False, "estimator": None}
    return bf.job_of_options(o, NAME, formats, {"inputs": o.operands.get("inputs")}, masked_ok=False,
                             why_not=" (--semantics onnx); torchao's NVFP4 QAT backward is the identity")


# --- run files -----------------------------------------------------------------------------------------------

def _group_formats(attrs):
    a = {k: plain(v) for k, v in attrs.items()}
    pts = a.get("per_tensor_scale", True)
    if not is_bool(pts):
        raise ValueError(f"per_tensor_scale={pts!r} is not a boolean")
    return {"semantics": "nvfp4", "block_size": BLOCK_SIZE, "axis": int(a.get("axis", -1)),
            "per_tensor_scale": bool(pts), "estimator": "ste"}


group_formats = _group_formats  # a group's attributes as a job's formats (qgcli plot's per-group figures)


def attribute_problem(attrs):
    return bf.problem(_group_formats, attrs, errors=(ValueError, TypeError), prefix="attribute ")


def group_problem(layer, shapes):
    return bf.problem(lambda: check_blocks(shapes["inputs"], _group_formats(layer.attrs)["axis"], BLOCK_SIZE,
                                           what="NVFP4 block size"))


def job_from_group(run, layer, operand_specs, output, pick):
    return bf.job_of_group(run, NAME, _group_formats(layer.attrs), operand_specs, output, pick, masked_ok=False,
                           what="an nvfp4 group")


# --- computing -------------------------------------------------------------------------------------------------

def attributes(formats):
    return {"block_size": BLOCK_SIZE, "axis": formats["axis"], "per_tensor_scale": formats["per_tensor_scale"]}


def forward(inputs, formats, out=None):
    """:func:`qgcli.ops.nvfp4.nvfp4_fake_quantize` with the job's attributes, and the notes: its warning's
    (torchao's NaN outputs), counted here rather than caught (no process-wide warning filter changed: a run
    file's groups compute on Dask's worker threads)."""
    res = ops.nvfp4_fake_quantize(inputs, per_tensor_scale=formats["per_tensor_scale"], axis=formats["axis"],
                                  out=out, warn=False)
    return res, _nan_note(res.tensor_scale, _nan_counts(res.tensor_scale, inputs, res.outputs), int(np.size(inputs)))


def _nan_counts(t, x, y):
    """``nan_introduced`` / ``nan_outputs`` of outputs ``y`` of ``x`` where the per-tensor scale ``t`` is one
    torchao cannot use (zero, NaN, infinite or too small to invert), else {}."""
    if t is None:
        return {}
    t = np.float32(float(t))
    with np.errstate(all="ignore"):
        if np.isfinite(t) and t > 0 and np.isfinite(np.float32(1) / t):
            return {}
    from qgcli.backend import to_numpy

    nan_y = np.isnan(np.asarray(to_numpy(y)))
    return {"nan_introduced": int(np.count_nonzero(nan_y & ~np.isnan(np.asarray(to_numpy(x), np.float32)))),
            "nan_outputs": int(np.count_nonzero(nan_y))}


def saturated_scales(block_scales, per_tensor=False):
    """Blocks whose E4M3 scale sits at its clamp: 2^-6 (the smallest, code 0x08) or 448 (0x7E).  With the
    per-tensor scale only 2^-6 counts: that scale maps the tensor's amax to exactly 448 x 6, so the blocks
    holding the largest values (those whose amax is within E4M3's rounding of the tensor's) reach 448 by
    design, unclamped; below 2^-6 a block's scale is clamped up (its amax under 1/28672 of the tensor's)."""
    c = np.asarray(block_scales).view(np.uint8) & 0x7F
    return (c == 0x08) if per_tensor else (c == 0x08) | (c == 0x7E)


#: Output arrays reused from run-file group to group (as :data:`qgcli.families.mx.REUSES_OUTPUTS`).
REUSES_OUTPUTS = True


def compute(job, operands, kept=None):
    f = job.formats
    inputs = bf.float32_operand(operands.get("inputs"), "inputs")
    gradients = operands.get("gradients") if job.with_gradients else None
    check_blocks(tuple(np.shape(inputs)), f["axis"], BLOCK_SIZE, what="NVFP4 block size")
    attrs = {"op": "nvfp4", "semantics": "nvfp4", **attributes(f)}
    described = describe_arrays({k: v for k, v in (("gradients", gradients), ("inputs", inputs)) if v is not None})
    key = (NAME, np.shape(inputs), tuple(attributes(f).items()))
    if block_rows.in_place_ok(inputs, job):  # the outputs over the inputs, the statistics taken first
        out, stats, notes = _in_place(job, inputs, attrs, kept, key)
        return Result(out, attrs, bf.summary(job, "NVFP4", attributes(f), described, out, stats, notes))
    res, notes = None, []
    if not job.with_gradients or job.output.shows_summary:
        res, notes = forward(inputs, f, out=block_rows.kept(kept, key))
        block_rows.keep(kept, key, res)
    if job.with_gradients:
        dx = ops.nvfp4_fake_quantize_gradient(gradients, inputs, per_tensor_scale=f["per_tensor_scale"],
                                              axis=f["axis"])
        out = {"backprops_wrt_input": dx}
        attrs["estimator"] = "ste"
        notes.append(_GRADIENT_NOTE)
    else:
        parts = {"outputs": res.outputs, "block_scales": res.block_scales}
        if res.tensor_scale is not None:
            parts["tensor_scale"] = np.asarray(res.tensor_scale, np.float32)
        parts["quantized"] = res.quantized
        out = bf.as_bytes(parts, attrs)
    stats = {}
    if job.output.shows_summary:
        stats, _, _ = bf.block_statistics(inputs, res.outputs, BLOCK_SIZE, axis=f["axis"],
                                          saturated=saturated_scales(res.block_scales,
                                                                     res.tensor_scale is not None))
        if res.tensor_scale is not None:
            stats["tensor_scale"] = float(res.tensor_scale)
        if job.with_gradients:
            stats["gradient"] = bf.gradient_statistics(gradients, dx, "ste (identity)")
    return Result(out, attrs, bf.summary(job, "NVFP4", attributes(f), described, out, stats, notes))


render = bf.render


def _in_place(job, x, attrs, kept=None, key=None):
    """The forward over row blocks of ``x``, its outputs written over it, the per-tensor scale from a pass of its
    own first (:func:`qgcli.families.block_rows.in_place`): ``(outputs as stored, statistics, notes)``."""
    f = job.formats
    axis = check_blocks(x.shape, f["axis"], BLOCK_SIZE, what="NVFP4 block size")
    plan, dtype_attrs = block_rows.plan(job, {"inputs": x}, x_name="inputs", axis=axis, block_size=BLOCK_SIZE,
                                        amax_pass=f["per_tensor_scale"])
    attrs.update(dtype_attrs)
    show = job.output.shows_summary
    out, plan, counts, rows = block_rows.in_place(plan, x, statistics=bf.rows_statistics(BLOCK_SIZE, axis)
                                                  if show else None, into=block_rows.kept(kept, ("rows",) + key))
    block_rows.keep(kept, ("rows",) + key, {k: v for k, v in out.items() if k != "outputs"})
    small = plan.small_outputs()
    if small:  # the file's order: outputs, block_scales, tensor_scale, quantized
        out = {k: out[k] for k in ("outputs", "block_scales")} | small | {"quantized": out["quantized"]}
    stats = {}
    if show:
        stats = bf.statistics_of_rows(rows, BLOCK_SIZE, x.shape, axis=axis, saturated=saturated_scales(
            out["block_scales"], bool(small)))[0]
        if small:
            stats["tensor_scale"] = float(small["tensor_scale"])
    return out, stats, _nan_note(small.get("tensor_scale"), counts, x.size)


def _nan_note(t, counts, n):
    """The note of torchao's NaN outputs (a per-tensor scale it cannot use), from the blocks' ``counts``."""
    if not counts.get("nan_introduced"):
        return []
    every = " (every output is NaN)" if counts["nan_outputs"] == n else ""
    return [f"NVFP4 per-tensor scale {float(t)!r} (tensor amax / 2688) is zero, NaN, infinite or too small to "
            f"invert: torchao's to_nvfp4(...).dequantize() gives NaN for {counts['nan_introduced']} of {n} elements "
            f"whose input is not NaN{every}; qgcli does the same (per_tensor_scale=False avoids it)"]


# --- in row blocks of the first axis (qgcli.families.block_rows) ------------------------------------------------

def block_setup(job, operands, datasets):
    """A tensor over --memory-limit in row blocks; with the per-tensor scale in two passes: the tensor's amax,
    then the blocks encoded with its scale (:mod:`qgcli.families.block_rows`)."""
    f = job.formats
    shape = tuple(datasets["inputs"].shape)
    axis = check_blocks(shape, f["axis"], BLOCK_SIZE, what="NVFP4 block size")
    two = f["per_tensor_scale"] and not job.with_gradients
    plan, dtype_attrs = block_rows.plan(job, datasets, x_name="inputs", axis=axis, block_size=BLOCK_SIZE,
                                        amax_pass=two, needs_x=False)
    attrs = {"op": "nvfp4", "semantics": "nvfp4", **attributes(f), **dtype_attrs}
    if job.with_gradients:
        attrs["estimator"] = "ste"
    setup = block_rows.setup(job, plan, attrs, "NVFP4")
    setup["notes"] = [_GRADIENT_NOTE] if job.with_gradients else []
    return setup


def rows(plan, x, g, i0, i1, out=None):
    """Rows ``[i0, i1)`` of the tensor with the whole tensor's per-tensor scale (counts: ``nan_introduced``,
    ``nan_outputs`` where that scale makes torchao's outputs NaN)."""
    f = plan.formats
    if plan.gradient:
        dx = ops.nvfp4_fake_quantize_gradient(g, None, per_tensor_scale=f["per_tensor_scale"], axis=f["axis"])
        return {"backprops_wrt_input": dx}, None, {}
    t = plan.small.get("tensor_scale")
    # no warning: the note counts the whole tensor's NaN (block_summary); and no warning filter changed, which
    # is process-wide state the row blocks on Dask's worker threads would race on
    res = ops.nvfp4_fake_quantize(x, per_tensor_scale=f["per_tensor_scale"], axis=f["axis"], out=out,
                                  tensor_scale=t, warn=False)
    return ({"outputs": res.outputs, "block_scales": res.block_scales, "quantized": res.quantized}, res,
            _nan_counts(t, x, res.outputs))


def block_summary(job, operands, datasets, setup, small, notes):
    extra = _nan_note(small.get("tensor_scale"), setup["counts"],
                      int(np.prod(datasets["inputs"].shape, dtype=np.int64)))
    return block_rows.summary(job, operands, datasets, setup, small, list(notes) + extra, op="NVFP4",
                              attributes=attributes(job.formats))


#: The magnitudes of the fp4 e2m1 codes 0..7 (its element values, as ``element_values("mxfp4")`` lists them).
_FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def block_view(formats, operands):
    """``qgcli plot hist / channels``' view of the tensor under ``formats`` (a job's, or :func:`group_formats`) (:class:`qgcli.families.block_formats.BlockView`)."""
    f = formats
    x = np.asarray(bf.float32_operand(operands.get("inputs"), "inputs"), np.float32)
    axis = check_blocks(tuple(np.shape(x)), f["axis"], BLOCK_SIZE, what="NVFP4 block size")
    res, _ = forward(x, f)
    t = 1.0 if res.tensor_scale is None else float(res.tensor_scale)
    scale = np.asarray(res.block_scales).astype(np.float64) * t
    with np.errstate(all="ignore"):
        element_scales = np.repeat(scale, BLOCK_SIZE, axis=axis)
        u = x / element_scales
        log2 = np.log2(scale)
    q = np.asarray(res.quantized)  # fp4 e2m1 codes: the sign bit 8, the magnitude 0..7
    yu = np.where(q & 8, -1.0, 1.0) * _FP4_VALUES[q & 7]

    def gradient(dy):
        return ops.nvfp4_fake_quantize_gradient(dy, x, per_tensor_scale=f["per_tensor_scale"], axis=f["axis"])

    tensor = f"per-tensor scale {t:.4g}" if res.tensor_scale is not None else "no per-tensor scale"
    return bf.block_view("nvfp4", f"NVFP4, blocks of {BLOCK_SIZE} along axis {f['axis']}, {tensor}",
                         "x / (E4M3 block scale x tensor scale)", x, res.outputs, u, element_values("mxfp4"),
                         BLOCK_SIZE, axis, log2_scales=log2,
                         saturated=saturated_scales(res.block_scales, res.tensor_scale is not None),
                         yu=yu, gradient=gradient, scale=element_scales)


def report_analysis(formats, operands=None, inputs=None):
    """What ``qgcli report`` reads of the tensor (``inputs``, else ``operands``' ``inputs``) under ``formats``
    (:class:`qgcli.families.block_formats.BlockAnalysis`): elements at fp4's 6 beyond it as clipped, the block
    scales the E4M3 scale times the per-tensor scale."""
    f = formats
    x = bf.float32_operand(operands.get("inputs") if inputs is None else inputs, "inputs")
    axis = check_blocks(tuple(np.shape(x)), f["axis"], BLOCK_SIZE, what="NVFP4 block size")
    res, notes = forward(x, f)
    clipped = ((np.asarray(res.quantized) & 7) == 7) & (np.abs(np.asarray(x, np.float64)) >
                                                        np.abs(np.asarray(res.outputs, np.float64)))
    t = 1.0 if res.tensor_scale is None else float(res.tensor_scale)
    return bf.BlockAnalysis("NVFP4", attributes(f), 4, x, res.outputs, clipped, BLOCK_SIZE, axis,
                            saturated_scales(res.block_scales, res.tensor_scale is not None),
                            np.asarray(res.block_scales).astype(np.float64) * t,
                            tuple(notes))


def report_row(layer, operands, inputs, gradients, attr, num_bits, narrow_range, device):
    """``qgcli report``'s row of an nvfp4 group: blocks as channels, elements at fp4's 6 beyond it as clipped."""
    return bf.report_row(report_analysis(_group_formats(layer.attrs), inputs=inputs), gradients)


def layer_report_doc(layer, operands, *, threshold, sort, top, device):
    """``qgcli report RUN --layer PATH`` of a group: one row per block, as ``report BUNDLE --semantics`` gives it."""
    return bf.layer_report_doc(report_analysis, layer, operands, threshold=threshold, sort=sort, top=top)
