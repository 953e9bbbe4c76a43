"""ONNX ``QuantizeLinear`` then ``DequantizeLinear`` (``--semantics onnx``, opset 21 and later), bit for bit with
``onnx.reference.ReferenceEvaluator`` (the math is :mod:`qgcli.ops.onnx_quantize`; where onnxruntime differs
is in docs/formats-onnx.md).

Operands ``x`` (``inputs`` accepted too), ``y_scale``, ``y_zero_point`` (optional) and ``gradients``; attributes
``--dtype`` (default uint8, or the zero point's type when one is given, as ONNX takes the output type from it),
``--axis`` (default 1), ``--block-size`` (default 0), ``--no-saturate`` (float8).  Outputs ``outputs``
(float32) and ``quantized`` (the narrowest NumPy type; float8/float4 written as their bytes, the type in the
``quantized_dtype`` attribute).  Gradient: ``--estimator ste`` (default, the identity: ModelOpt
``pass_through_bwd=True``, torchao) or ``masked-ste`` (integer types: +0 where ``round(x / y_scale) + y_zero_point``
falls outside ``[qmin, qmax]``: ModelOpt ``pass_through_bwd=False``, onnxruntime training's FakeQuant mask).
Run-file groups: ``op = "QuantizeLinear"`` with ``dtype``, ``axis``, ``block_size``, ``saturate``.
"""
import numpy as np

from qgcli.errors import OperandError, OptionError
from qgcli.families import block_formats as bf
from qgcli.families import block_rows
from qgcli.families.groups import is_bool, is_int, plain
from qgcli.families.registry import FAKE_QUANT
from qgcli.jobs import Result
from qgcli.ops import onnx_quantize as ops
from qgcli.ops.onnx_quantize import DTYPES, INTEGER_TYPES
from qgcli.report.summaries import describe_arrays

NAME, KIND = "onnx", FAKE_QUANT
LITERAL_OK = ("y_scale", "y_zero_point")
RUN_FILE_OPS = {"QuantizeLinear": None}
GROUP_OPERANDS = {None: (("y_scale",), ("x", "inputs", "y_zero_point", "gradients"))}
VERIFY_BITWISE = ("outputs", "quantized", "backprops_wrt_input")
OPERANDS = ("x", "inputs", "y_scale", "y_zero_point", "gradients")
#: the zero point's stored type -> the dtype ONNX takes from it when --dtype is not given
_FROM_ZERO_POINT = {"uint8": "uint8", "int8": "int8", "uint16": "uint16", "int16": "int16",
                    "float8_e4m3fn": "float8e4m3fn", "float8_e5m2": "float8e5m2", "float4_e2m1fn": "float4e2m1"}


def claims(o):
    return o.semantics.semantics == "onnx"


def refuse_options_outside(o):
    bf.refuse_format_options(o, "onnx")
    for name in ("x", "y_scale", "y_zero_point"):
        if o.operands.get(name) is not None:
            raise OptionError("is ONNX QuantizeLinear's operand; it only applies to --semantics onnx",
                              param_hint=f"'--{name.replace('_', '-')}'")


def mode(job):
    return "--semantics onnx"


def job_from_options(o):
    bf.refuse_other_families(o, "onnx", operands_allowed=OPERANDS, dtype=True)
    dtype = o.quantize.dtype
    if dtype is not None and dtype not in DTYPES:
        raise OptionError(f"{dtype} is not a QuantizeLinear type ({', '.join(DTYPES)})", param_hint="'--dtype'")
    if o.operands.get("x") is not None and o.operands.get("inputs") is not None:
        raise OptionError("is QuantizeLinear's x given twice (--x and --inputs)", param_hint="'--inputs'")
    formats = {"semantics": "onnx", "dtype": dtype, "axis": 1 if o.attributes.axis is None else int(o.attributes.axis),
               "block_size": 0 if o.formats.block_size is None else int(o.formats.block_size),
               "saturate": o.formats.saturate is not False, "estimator": None, "tensor": "x"}
    if not formats["saturate"] and dtype is not None and dtype not in ("float8e4m3fn", "float8e5m2"):
        raise OptionError(f"applies to the float8 types (saturate is theirs), not --dtype {dtype}",
                          param_hint="'--no-saturate'")
    given = o.operands.as_dict()
    specs = {"x": given.get("x") if given.get("x") is not None else given.get("inputs"),
             "y_scale": given.get("y_scale"), "y_zero_point": given.get("y_zero_point")}
    return bf.job_of_options(o, NAME, formats, specs, masked_ok=dtype is None or dtype in INTEGER_TYPES,
                             why_not=f", not --dtype {dtype}")


# --- run files -----------------------------------------------------------------------------------------------

def _group_formats(attrs):
    a = {k: plain(v) for k, v in attrs.items()}
    dtype = a.get("dtype")
    if dtype is not None and str(dtype).lower().replace("_", "") not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    for name in ("axis", "block_size"):
        if name in a and not is_int(a[name]):
            raise ValueError(f"{name}={a[name]!r} is not an integer")
    if "saturate" in a and not is_bool(a["saturate"]):
        raise ValueError(f"saturate={a['saturate']!r} is not a boolean")
    dtype = None if dtype is None else str(dtype).lower().replace("_", "")
    # The group's own gradient: the identity (ModelOpt pass_through_bwd=True, torchao), or masked-ste where it
    # says so (integer types; with the type from the zero point, checked when the group runs)
    estimator = a.get("estimator", "ste")
    if estimator not in ("ste", "masked-ste"):
        raise ValueError(f"estimator={estimator!r} is not ste or masked-ste")
    if estimator == "masked-ste" and dtype is not None and dtype not in INTEGER_TYPES:
        raise ValueError(f"estimator='masked-ste' is for the integer types, not {dtype}")
    return {"semantics": "onnx", "dtype": dtype, "axis": int(a.get("axis", 1)),
            "block_size": int(a.get("block_size", 0)), "saturate": bool(a.get("saturate", True)),
            "estimator": estimator, "tensor": "x"}


group_formats = _group_formats  # a group's attributes as a job's formats (qgcli plot's per-group figures)


def attribute_problem(attrs):
    return bf.problem(_group_formats, attrs, errors=(ValueError, TypeError), prefix="attribute ")


def group_problem(layer, shapes):
    if "x" not in shapes and "inputs" not in shapes:
        return "missing operand x (or inputs)"
    return None


def job_from_group(run, layer, operand_specs, output, pick):
    return bf.job_of_group(run, NAME, _group_formats(layer.attrs), operand_specs, output, pick, masked_ok=True,
                           what="a QuantizeLinear group")


# --- computing -------------------------------------------------------------------------------------------------

def load(operands, formats):
    """``(x, y_scale, y_zero_point, dtype, note)``: the operands, and the dtype (ONNX's rule: the zero point's
    type when no --dtype was given, else uint8)."""
    x = operands.get("x") if operands.has("x") else operands.get("inputs", required=False)
    if x is None:
        raise OperandError("is missing: give --x (or --inputs), or a bundle dataset named x or inputs", operand="x")
    y_scale, zp, dtype, note = load_small(operands, formats)
    x = np.asarray(x)
    if x.dtype != np.float32 and x.dtype.kind == "f":
        raise OperandError(f"dtype {x.dtype}: qgcli's QuantizeLinear takes float32 x (ONNX computes float16 and "
                           "bfloat16 inputs in their own precision)", operand="x")
    return x, y_scale, zp, dtype, note


def load_small(operands, formats):
    """``(y_scale, y_zero_point, dtype, note)``: the dtype by ONNX's rule (the zero point's type when no --dtype
    was given, else uint8)."""
    y_scale = operands.get("y_scale")
    zp = operands.get("y_zero_point", required=False)
    dtype, note = formats["dtype"], None
    if dtype is None:
        if zp is not None and getattr(np.asarray(zp).dtype, "name", "") in _FROM_ZERO_POINT:
            dtype = _FROM_ZERO_POINT[np.asarray(zp).dtype.name]
            note = f"dtype {dtype}: the zero point's type (ONNX takes the output type from y_zero_point)"
        else:
            dtype = "uint8"
    return y_scale, zp, dtype, note


def _check_job(f, dtype):
    """What the options say that ``dtype`` (resolved) refuses: saturate=0 and masked-ste outside their types."""
    if not f["saturate"] and dtype not in ("float8e4m3fn", "float8e5m2"):
        raise OperandError(f"saturate=0 applies to the float8 types, not {dtype}", operand="saturate")
    if f["estimator"] == "masked-ste" and dtype not in ops.INTEGER_TYPES:
        raise OperandError(f"masked-ste is for the integer types, not {dtype}", operand="estimator")


def _gradient_note(est):
    return ("gradient: the identity (ModelOpt pass_through_bwd=True, torchao)" if est == "ste" else
            "gradient: masked-ste, +0 where round(x / y_scale) + y_zero_point is outside [qmin, qmax] "
            "(ModelOpt pass_through_bwd=False, onnxruntime training's FakeQuant)")


def attributes(formats, dtype):
    a = {"dtype": dtype, "axis": formats["axis"], "block_size": formats["block_size"]}
    if dtype in ("float8e4m3fn", "float8e5m2"):
        a["saturate"] = formats["saturate"]
    return a


#: Output arrays reused from run-file group to group (as :data:`qgcli.families.mx.REUSES_OUTPUTS`).
REUSES_OUTPUTS = True


def compute(job, operands, kept=None):
    f = job.formats
    x, y_scale, zp, dtype, note = load(operands, f)
    gradients = operands.get("gradients") if job.with_gradients else None
    _check_job(f, dtype)
    kw = dict(dtype=dtype, axis=f["axis"], block_size=f["block_size"])
    notes = [note] if note else []
    attrs = {"op": "QuantizeLinear", "semantics": "onnx", **attributes(f, dtype)}
    nan_in = job.output.shows_summary and dtype in ops.INTEGER_TYPES and bool(np.isnan(x).any())
    in_place = block_rows.in_place_ok(x, job)
    key = (NAME, np.shape(x), tuple(attributes(f, dtype).items()))
    res = None
    if not in_place and (not job.with_gradients or job.output.shows_summary):
        res = ops.onnx_fake_quantize(x, y_scale, zp, saturate=f["saturate"], out=block_rows.kept(kept, key), **kw)
        block_rows.keep(kept, key, res)
    if in_place:  # the outputs over the inputs, the statistics taken first
        out, stats = _in_place(job, x, y_scale, zp, dtype, attrs, kept, key)
    elif job.with_gradients:
        est = f["estimator"]
        dx = ops.onnx_fake_quantize_gradient(gradients, x, y_scale, zp, saturate=f["saturate"],
                                             estimator="masked" if est == "masked-ste" else "ste", **kw)
        out = {"backprops_wrt_input": dx}
        attrs["estimator"] = est
        notes.append(_gradient_note(est))
    else:
        out = bf.as_bytes({"outputs": res.outputs, "quantized": res.quantized}, attrs)
    if not in_place:
        stats = _statistics(x, res, y_scale, zp, dtype, f) if job.output.shows_summary else {}
    if job.output.shows_summary:
        if job.with_gradients:
            stats["gradient"] = bf.gradient_statistics(gradients, dx, f["estimator"])
        if nan_in:
            notes.append("NaN inputs quantize to qmin (onnxruntime's saturation; the reference's cast is undefined "
                         "there)")
    described = describe_arrays({k: v for k, v in (("gradients", gradients), ("x", x)) if v is not None})
    return Result(out, attrs, bf.summary(job, "QuantizeLinear + DequantizeLinear", attributes(f, dtype), described,
                                         out, stats, notes))


def _statistics(x, res, y_scale, zp, dtype, f):
    """Blocked quantization with whole blocks: per block; otherwise the tensor as one block.  ``clipped``: the
    share of elements at a saturated code (integer types: qmin or qmax; float types: the largest finite
    magnitude or beyond)."""
    bs = f["block_size"]
    whole = not _whole_blocks(np.shape(x), y_scale, f)
    if not whole:
        stats, _, _ = bf.block_statistics(x, res.outputs, bs, axis=f["axis"])
    else:
        stats, _, _ = bf.block_statistics(np.reshape(x, (1, -1)), np.reshape(res.outputs, (1, -1)),
                                          max(1, int(np.size(x))))
    return _with_clipped(stats, res.quantized, dtype, whole)


def _with_clipped(stats, quantized, dtype, whole):
    """The statistics with ``clipped`` (the share of codes at a saturated value, counted a million at a time:
    no tensor-sized temporary) and, for the tensor as one block, its size as the block size."""
    q = np.asarray(quantized).reshape(-1)
    if whole:
        stats["blocks"], stats["block_size"] = 1, int(q.size)
        stats.pop("worst_blocks", None)
    if dtype in ops.INTEGER_TYPES:
        _, lo, hi = ops.INTEGER_TYPES[dtype]

        def at_edge(part):
            part = part.astype(np.int64)
            return (part == lo) | (part == hi)
    else:
        fmax = ops.FLOAT_TYPES[dtype][1]

        def at_edge(part):
            return np.abs(part.astype(np.float32)) >= fmax
    step = block_rows.IN_PLACE_ELEMENTS
    edge = sum(int(np.count_nonzero(at_edge(q[i:i + step]))) for i in range(0, q.size, step))
    stats["clipped"] = edge / q.size if q.size else 0.0
    return stats


def _plan(job, f, datasets, x_name, y_scale, zp):
    """The row-block plan (:mod:`qgcli.families.block_rows`) of ``f`` (the dtype resolved) over ``datasets``:
    ``y_scale`` and ``y_zero_point`` are cut with the rows they apply to (:func:`rows`)."""
    shape = tuple(datasets[x_name].shape)
    ops._qparams(np, shape, y_scale, zp, f["dtype"], f["axis"], f["block_size"], expand=False)  # checked whole
    along = np.size(y_scale) > 1 or f["block_size"]
    axis = f["axis"] % len(shape) if along and shape else None
    return block_rows.plan(job._replace(formats=f), datasets, x_name=x_name, axis=axis,
                           block_size=f["block_size"] if np.size(y_scale) > 1 else 0,
                           small={"y_scale": np.asarray(y_scale), "y_zero_point": zp})


def _in_place(job, x, y_scale, zp, dtype, attrs, kept=None, key=None):
    """The forward over row blocks of ``x``, its outputs written over it, the statistics taken first
    (:func:`qgcli.families.block_rows.in_place`): ``(outputs as stored, statistics)``."""
    f = dict(job.formats, dtype=dtype)
    plan, dtype_attrs = _plan(job, f, {"x": x}, "x", y_scale, zp)
    attrs.update(dtype_attrs)
    whole = not _whole_blocks(x.shape, y_scale, f)
    show = job.output.shows_summary
    out, _, _, rows = block_rows.in_place(plan, x, statistics=bf.rows_statistics(
        f["block_size"], f["axis"], whole=whole) if show else None, into=block_rows.kept(kept, ("rows",) + key))
    block_rows.keep(kept, ("rows",) + key, {k: v for k, v in out.items() if k != "outputs"})
    if not show:
        return out, {}
    stats = bf.statistics_of_rows(rows, f["block_size"], x.shape, axis=f["axis"], whole=whole)[0]
    q = out["quantized"]
    if "quantized_dtype" in dtype_attrs:  # float8 / float4 codes stored as their bytes
        import ml_dtypes

        q = q.view(getattr(ml_dtypes, dtype_attrs["quantized_dtype"]))
    return out, _with_clipped(stats, q, dtype, whole)


render = bf.render


# --- in row blocks of the first axis (qgcli.families.block_rows) ------------------------------------------------

def block_setup(job, operands, datasets):
    """A tensor over --memory-limit in row blocks: ``y_scale`` and ``y_zero_point`` cut with the rows they
    apply to (per axis or blocked along the first axis; blocked along another axis, one row of blocks per
    row), whole quantization blocks along the first axis (the partial last one in the last rows)."""
    f = dict(job.formats)
    x_name = "x" if "x" in datasets else "inputs"
    y_scale, zp, dtype, note = load_small(operands, f)
    _check_job(f, dtype)
    f["dtype"] = dtype
    plan, dtype_attrs = _plan(job, f, datasets, x_name, y_scale, zp)
    attrs = {"op": "QuantizeLinear", "semantics": "onnx", **attributes(f, dtype), **dtype_attrs}
    notes = [note] if note else []
    if job.with_gradients:
        attrs["estimator"] = f["estimator"]
        notes.append(_gradient_note(f["estimator"]))
    setup = block_rows.setup(job, plan, attrs, "QuantizeLinear + DequantizeLinear")
    setup["notes"], setup["dtype"] = notes, dtype
    return setup


def _rows_of(a, f, ndim, i0, i1):
    """The part of ``y_scale`` or ``y_zero_point`` that rows ``[i0, i1)`` of x take."""
    if a is None or np.size(a) == 1:
        return a
    axis, bs = f["axis"] % ndim, f["block_size"]
    if axis:
        return a[i0:i1] if bs else a  # blocked along another axis: one row of blocks per row
    return a[i0 // bs:-(-i1 // bs)] if bs else a[i0:i1]


def rows(plan, x, g, i0, i1, out=None):
    """Rows ``[i0, i1)`` of x (:meth:`qgcli.families.block_rows.RowPlan.compute`)."""
    f, ndim = plan.formats, len(plan.shape)
    s, z = (_rows_of(plan.small.get(k), f, ndim, i0, i1) for k in ("y_scale", "y_zero_point"))
    kw = dict(dtype=f["dtype"], axis=f["axis"], block_size=f["block_size"], saturate=f["saturate"])
    if plan.gradient:
        est = "masked" if f["estimator"] == "masked-ste" else "ste"
        return {"backprops_wrt_input": ops.onnx_fake_quantize_gradient(g, x, s, z, estimator=est, **kw)}, None, {}
    res = ops.onnx_fake_quantize(x, s, z, out=out, **kw)
    return {"outputs": res.outputs, "quantized": res.quantized}, res, {}


def block_summary(job, operands, datasets, setup, small, notes):
    return block_rows.summary(job, operands, datasets, setup, small, notes, op=setup["op"],
                              attributes=attributes(job.formats, setup["dtype"]))


def _whole_blocks(shape, y_scale, f):
    """Whether blocked quantization covers the axis with whole blocks (else the tensor is one block)."""
    bs = f["block_size"]
    return bool(bs and np.size(y_scale) > 1 and len(shape) and shape[f["axis"]] % bs == 0)


def block_view(formats, operands):
    """``qgcli plot hist / channels``' view of the tensor under ``formats`` (a job's, or :func:`group_formats`)
    (:class:`qgcli.families.block_formats.BlockView`): blocked quantization per block, otherwise the tensor as
    one block."""
    f = formats
    x, y_scale, zp, dtype, _ = load(operands, f)
    _check_job(f, dtype)
    kw = dict(dtype=dtype, axis=f["axis"], block_size=f["block_size"])
    res = ops.onnx_fake_quantize(x, y_scale, zp, saturate=f["saturate"], **kw)
    sb, zb = ops.broadcast_qparams(np.shape(x), y_scale, zp, **kw)
    with np.errstate(all="ignore"):
        u = x.astype(np.float64) / sb + zb
        log2 = np.log2(np.asarray(y_scale, np.float64))
    blocked = _whole_blocks(np.shape(x), y_scale, f)
    axis = f["axis"] % x.ndim if blocked else None
    where = (f"blocks of {f['block_size']} along axis {f['axis']}" if blocked else
             "per tensor" if np.size(y_scale) == 1 else
             f"blocks of {f['block_size']} along axis {f['axis']}, the last one partial: drawn as one block"
             if f["block_size"] else f"per axis {f['axis']}")
    unit = "x / y_scale" + ("" if dtype in ops.FLOAT_TYPES else " + y_zero_point")

    def gradient(dy):
        return ops.onnx_fake_quantize_gradient(dy, x, y_scale, zp, saturate=f["saturate"], estimator="masked" if
                                               f.get("estimator") == "masked-ste" else "ste", **kw)

    return bf.block_view("QuantizeLinear", f"ONNX QuantizeLinear {dtype}, {where}", unit, x, res.outputs, u,
                         ops.grid_values(dtype), f["block_size"], axis,
                         log2_scales=log2 if blocked else log2.reshape(-1),
                         yu=np.asarray(res.quantized).astype(np.float64), gradient=gradient, scale=sb, zero=zb)


def report_analysis(formats, operands, inputs=None):
    """What ``qgcli report`` reads of ``operands`` (x, y_scale, y_zero_point) under ``formats``
    (:class:`qgcli.families.block_formats.BlockAnalysis`): clipped at qmin / qmax (integer types) or at the
    largest finite value (float types); the blocks of blocked quantization with whole blocks, else the tensor
    as one block; no scale saturates (y_scale is given)."""
    f = formats
    x, y_scale, zp, dtype, note = load(operands, f)
    res = ops.onnx_fake_quantize(x, y_scale, zp, dtype=dtype, axis=f["axis"], block_size=f["block_size"],
                                 saturate=f["saturate"])
    x64 = np.asarray(x, np.float64)
    y64 = np.asarray(res.outputs, np.float64)
    if dtype in ops.INTEGER_TYPES:
        _, lo, hi = ops.INTEGER_TYPES[dtype]
        q = np.asarray(res.quantized).astype(np.int64)
        with np.errstate(invalid="ignore"):
            clipped = ((q == lo) & (x64 < y64)) | ((q == hi) & (x64 > y64))
        bits = {"uint8": 8, "int8": 8, "uint16": 16, "int16": 16, "uint4": 4, "int4": 4}[dtype]
    else:
        fmax = ops.FLOAT_TYPES[dtype][1]
        qf = np.abs(np.asarray(res.quantized).astype(np.float32))
        with np.errstate(invalid="ignore"):
            clipped = (qf == fmax) & (np.abs(x64) > np.abs(y64))
        bits = 4 if dtype == "float4e2m1" else 8
    notes = [note] if note else []
    if dtype in ops.INTEGER_TYPES and np.isnan(x).any():
        notes.append("NaN inputs quantize to qmin (onnxruntime's saturation; the reference's cast is undefined "
                     "there)")
    a = bf.BlockAnalysis("QuantizeLinear + DequantizeLinear", attributes(f, dtype), bits, x, res.outputs, clipped,
                         f["block_size"], f["axis"], None, np.asarray(y_scale, np.float32).astype(np.float64),
                         tuple(notes))
    return a if _whole_blocks(np.shape(x), y_scale, f) else bf.whole_tensor(a)


def report_row(layer, operands, inputs, gradients, attr, num_bits, narrow_range, device):
    """``qgcli report``'s row of a QuantizeLinear group (:func:`report_analysis`); gradient blocked: none under
    the identity STE."""
    return bf.report_row(report_analysis(_group_formats(layer.attrs), operands), gradients)


def layer_report_doc(layer, operands, *, threshold, sort, top, device):
    """``qgcli report RUN --layer PATH`` of a group: one row per block, as ``report BUNDLE --semantics`` gives it."""
    return bf.layer_report_doc(report_analysis, layer, operands, threshold=threshold, sort=sort, top=top)
