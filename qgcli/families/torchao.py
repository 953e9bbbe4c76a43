"""torchao's QAT fake quantizers (``--semantics torchao``): ``IntxFakeQuantizer`` / ``Float8FakeQuantizer``
with dynamic qparams, their full autograd input gradient, and the split of that gradient into the
straight-through part, the scale path and torch's rounding (per tensor in the summary, per block in
``qgcli report --semantics torchao``).  The math is :mod:`qgcli.ops.torchao_semantics`.
"""

import numpy as np

from qgcli import __version__
from qgcli.backend import to_numpy
from qgcli.errors import OptionError, QgcliError
from qgcli.families.groups import OVERRIDABLE
from qgcli.families.registry import FAKE_QUANT
from qgcli.jobs import FakeQuantJob, OperandSpecs, Result
from qgcli.ops import torchao_semantics as ts
from qgcli.ops.analysis import sqnr_db
from qgcli.ops.torchao_semantics import block_statistics, FLOAT8_DTYPES, INT_DTYPES, IntxFakeQuantizeConfig
from qgcli.report.summaries import describe_arrays, json_safe, number, percent, zero_gradient, ZERO_GRADIENT_LIMIT
from qgcli.report.tables import print_items, print_table
from qgcli.report.text import counted, markup, printable_doc
from qgcli.storage.operands import Operands, to_device

NAME, KIND = "torchao", FAKE_QUANT
LITERAL_OK = ()
#: Run-file ``op`` -> variant (qgcli.capture.torch): the config is the group's attributes, named after
#: torchao's config fields (:func:`config_from_attributes`).
RUN_FILE_OPS = {"torchao.IntxFakeQuantizer": "intx", "torchao.Float8FakeQuantizer": "float8"}
GROUP_OPERANDS = {None: (("inputs",), ("gradients",))}
#: ``qgcli verify``: what a group must reproduce bit for bit; its input gradient within rtol, with no
#: summation bound (the float8 gradient's scale path sums each block, in an order torch picks).
VERIFY_BITWISE = ("outputs", "scale", "zero_point")
VERIFY_SUMMATION_BOUND = False
TOP_BLOCKS = 5  # blocks with the largest scale-path share shown in the summary
#: --option -> TorchaoOptions field, for messages
OPTION_NAMES = {"granularity": "--granularity", "mapping_type": "--mapping-type",
                "scale_precision": "--scale-precision", "zero_point_precision": "--zero-point-precision",
                "zero_point_domain": "--zero-point-domain", "eps": "--eps", "hp_value_lb": "--hp-value-lb",
                "hp_value_ub": "--hp-value-ub"}
_INT_ONLY = ("mapping_type", "scale_precision", "zero_point_precision", "zero_point_domain", "eps")
_FLOAT8_ONLY = ("hp_value_lb", "hp_value_ub")


def refuse_outside(torchao, quantize_dtype):
    """Without --semantics torchao: its options do not apply (a torchao --dtype neither)."""
    for field, value in torchao.given().items():
        raise OptionError("only applies to --semantics torchao", param_hint=f"'{OPTION_NAMES[field]}'")
    if quantize_dtype is None:
        return  # (torchao's dtype lists not imported: most commands give no --dtype)

    if quantize_dtype in INT_DTYPES + FLOAT8_DTYPES:
        raise OptionError(f"{quantize_dtype} is a torchao dtype: it only applies to --semantics torchao",
                                 param_hint="'--dtype'")


def build_config(dtype, torchao):
    """The torchao config the options describe; OptionErrors for what torchao (or qgcli) refuses."""
    if dtype is None:
        raise OptionError("--semantics torchao needs the quantized dtype: int1..int8, uint1..uint8, "
                                 "float8_e4m3fn or float8_e5m2", param_hint="'--dtype'")
    given = torchao.given()
    float8 = dtype in ts.FLOAT8_DTYPES
    for field in (_INT_ONLY if float8 else _FLOAT8_ONLY):
        if field in given:
            kind = "IntxFakeQuantizeConfig (integer dtypes)" if float8 else "Float8FakeQuantizeConfig (float8 dtypes)"
            raise OptionError(f"is a field of torchao's {kind}, not of --dtype {dtype}",
                                     param_hint=f"'{OPTION_NAMES[field]}'")
    try:
        if float8:
            return ts.float8_fake_quantize_config(dtype, torchao.granularity or "per-row", torchao.hp_value_lb,
                                                  torchao.hp_value_ub)
        if torchao.granularity is None:
            raise OptionError(f"--dtype {dtype} needs a granularity (torchao: At least one of `granularity` "
                                     "or `group_size` must be set): per-group:G, per-channel or per-token",
                                     param_hint="'--granularity'")
        return ts.intx_fake_quantize_config(
            dtype, torchao.granularity, torchao.mapping_type or "symmetric", torchao.scale_precision or "float32",
            torchao.zero_point_precision or "int32", torchao.zero_point_domain or "int", torchao.eps)
    except QgcliError as e:
        option = {"dtype": "--dtype", **OPTION_NAMES}.get(e.operand, "--semantics")
        message = str(e)
        if e.operand and message.startswith(f"{e.operand}: "):
            message = message[len(e.operand) + 2:]
        raise OptionError(message, param_hint=f"'{option}'")


def config_from_attributes(attrs):
    """The config a run-file group's attributes describe (``op`` ``torchao.IntxFakeQuantizer`` /
    ``torchao.Float8FakeQuantizer`` and torchao's config fields, as :mod:`qgcli.capture.torch` and
    ``fakequant --semantics torchao`` write them); a QgcliError naming the attribute qgcli refuses."""
    a = {k: v.item() if isinstance(v, np.generic) else v for k, v in attrs.items()}
    a = {k: None if isinstance(v, str) and v == "none" else v for k, v in a.items()}  # None is written "none"
    if a.get("op") == "torchao.Float8FakeQuantizer":
        return ts.float8_fake_quantize_config(a.get("dtype") or "float8_e4m3fn", a.get("granularity") or "per-row",
                                              a.get("hp_value_lb"), a.get("hp_value_ub"))
    if "is_dynamic" in a and not a["is_dynamic"]:
        raise QgcliError("False: qgcli computes torchao's dynamic qparams only (static ones are state of the "
                         "quantizer, not of the tensor)", operand="is_dynamic")
    if a.get("dtype") is None or a.get("granularity") is None:
        raise QgcliError("a torchao.IntxFakeQuantizer group needs the attributes dtype and granularity",
                         operand="granularity" if a.get("dtype") else "dtype")
    granularity = str(a["granularity"])
    if granularity.replace("_", "-") == "per-group" and a.get("group_size") is not None:
        granularity = f"per-group:{int(a['group_size'])}"
    return ts.intx_fake_quantize_config(
        a["dtype"], granularity, a.get("mapping_type") or "symmetric", a.get("scale_precision") or "float32",
        a.get("zero_point_precision") or "int32", a.get("zero_point_domain") or "int", a.get("eps"))


def claims(o):
    return o.semantics.semantics == "torchao"


def refuse_options_outside(o):
    # --semantics onnx takes int8/uint8 too (QuantizeLinear's types): its family checks its own --dtype
    refuse_outside(o.torchao, None if o.semantics.semantics == "onnx" else o.quantize.dtype)


def mode(job):
    return "--semantics torchao"


def ranges_config(layer):
    """The config of a group whose quantizer's own ``scale`` / ``zero_point`` ``report --ranges-out`` writes
    (qgcli.report.ranges_out): an integer quantizer's; float8 has none (its scale follows each block's amax)."""
    config = config_from_attributes(layer.attrs)
    if isinstance(config, ts.Float8FakeQuantizeConfig):
        raise QgcliError("torchao's float8 quantizer computes its scale from each block's amax: no range to write")
    return config


def attribute_problem(attrs):
    """A group's config that torchao's quantizers cannot take."""
    try:
        config_from_attributes(attrs)
    except (ValueError, TypeError) as exc:
        return f"attribute {exc}"
    return None


def job_from_group(run, layer, operand_specs, output, pick):
    """A torchao group runs its own config: the options of the other families do not apply to it."""
    for name in pick.given:
        raise QgcliError(f"{OVERRIDABLE.get(name, name)} does not apply to a torchao group (its config is the "
                         "group's attributes)")
    if run.estimator is not None:
        raise QgcliError("--estimator does not apply to a torchao group (torchao's gradient is its own autograd)")
    return FakeQuantJob(command=run.command, family=NAME, with_gradients=run.with_gradients,
                        operands=operand_specs, output=output, torchao=config_from_attributes(layer.attrs))


def job_from_options(o):
    """A :class:`qgcli.jobs.FakeQuantJob` of the torchao family, every other family's option refused."""
    command, with_gradients, operands, attributes = o.command, o.with_gradients, o.operands, o.attributes
    quantize, semantics, estimator, output, torchao = o.quantize, o.semantics, o.estimator, o.output, o.torchao

    for option, value in semantics.torch_given().items():
        if value is not None:
            raise OptionError("only applies to --semantics torch (torchao computes its scale and zero point "
                                     "from the data)", param_hint=f"'{option}'")
    for name in ("min", "max", "input", "input_min", "input_max"):
        if operands.get(name) is not None:
            raise OptionError("is not an operand of torchao's fake quantizers (inputs, gradients)",
                                     param_hint=f"'--{name.replace('_', '-')}'")
    if attributes.variant is not None:
        raise OptionError("chooses a TensorFlow op; torchao's quantizer follows --dtype and --granularity",
                                 param_hint="'--variant'")
    for option, value in (("--num-bits", attributes.num_bits_given), ("--narrow-range", attributes.narrow_range),
                          ("--axis", attributes.axis is not None)):
        if value:
            raise OptionError("does not apply to --semantics torchao (the grid comes from --dtype, the blocks "
                                     "from --granularity)", param_hint=f"'{option}'")
    for option in {k: v for k, v in quantize.given().items() if k != "--dtype"}:
        raise OptionError("only applies to --variant quantize-dequantize", param_hint=f"'{option}'")
    if getattr(estimator, "estimator", None) is not None:
        raise OptionError("torchao's gradient is its own autograd; --estimator applies to --semantics tf/torch",
                                 param_hint="'--estimator'")
    if output.plot:
        raise OptionError("draws TensorFlow's STE only; the torchao summary (--json) and 'qgcli report "
                                 "--semantics torchao' give the gradient split", param_hint="'--plot'")
    config = build_config(quantize.dtype, torchao)
    specs = dict(inputs=operands.get("inputs"))
    if with_gradients:
        specs["gradients"] = operands.get("gradients")
    return FakeQuantJob(command=command, family=NAME, with_gradients=with_gradients,
                        operands=OperandSpecs.of(operands.bundle, **specs), output=output, torchao=config)


# --- computing -----------------------------------------------------------------------------------------

def _load(job, operands, with_gradients):
    inputs = operands.get("inputs")
    gradients = operands.get("gradients") if with_gradients else None
    notes = []
    for name, value in (("inputs", inputs), ("gradients", gradients)):
        dtype = getattr(value, "dtype", None)
        if dtype is not None and str(dtype) != "float32":
            notes.append(f"{name} is {dtype}; computed in float32 as torchao's float32 path")
    return inputs, gradients, notes


def _stored(res):
    """scale / zero_point as written: their precision's NumPy dtype (bfloat16 values as float32)."""
    c = res.config
    out = {}
    scale = to_numpy(res.scale)
    out["scale"] = scale.astype(np.float16) if getattr(c, "scale_precision", None) == "float16" else scale
    if res.zero_point is not None:
        z = to_numpy(res.zero_point)
        zp = c.zero_point_precision
        out["zero_point"] = z.astype(np.int32) if zp == "int32" else z.astype(np.float16) if zp == "float16" else z
    return out


def compute(job, operands):
    config = job.torchao
    inputs, gradients, notes = _load(job, operands, job.with_gradients)
    xp, (gradients, inputs) = to_device([gradients, inputs], job.output.device)
    qparams = None
    if job.operands.get("scale") is not None:  # fakequant-grad RUN --ranges: the quantizer's scale / zero point set
        qparams = (to_numpy(operands.get("scale")), to_numpy(operands.get("zero_point")))
        notes.append("scale and zero_point from --ranges (an IntxFakeQuantizer whose qparams are set), not from "
                     "the data")
    res = ts.fake_quantize(inputs, config, gradients, qparams)
    out = {"backprops_wrt_input": res.backprops_wrt_input} if job.with_gradients else {"outputs": res.outputs}
    out.update(_stored(res))
    attrs = {"op": config.op, "semantics": "torchao", **{k: ("none" if v is None else v)
                                                         for k, v in config.attributes().items()}}
    stats = statistics(res, gradients, xp)
    notes += _notes(res, stats)
    summary = json_safe({
        "command": job.command, "op": config.op, "semantics": "torchao",
        "attributes": config.attributes(),
        "inputs": describe_arrays({k: v for k, v in (("gradients", gradients), ("inputs", inputs)) if v is not None}),
        "blocks": {"count": res.blocks[0], "size": res.blocks[1], "scale_shape": list(res.scale.shape),
                   "scale_min": float(to_numpy(xp.nanmin(res.scale))) if xp.isfinite(res.scale).any() else None,
                   "scale_max": float(to_numpy(xp.nanmax(res.scale))) if xp.isfinite(res.scale).any() else None},
        "statistics": stats, "outputs": describe_arrays(out), "output": job.output.destination, "notes": notes,
    })
    return Result(out, attrs, summary)


def _notes(res, stats):
    notes = []
    c = res.config
    if stats.get("nonfinite_scale_blocks"):
        notes.append(f"{stats['nonfinite_scale_blocks']} block(s) have a NaN, infinite or zero scale (NaN/inf "
                     "inputs, or all-zero float8 blocks): their outputs are NaN, as torchao's")
    if isinstance(c, IntxFakeQuantizeConfig):
        if res.backprops_wrt_input is not None:
            notes.append("torchao computes integer scales and zero points under torch.no_grad(): no gradient "
                         "flows through the scale; what differs from dy on unclipped elements is torch's float32 "
                         "rounding of (dy * s) * (1/s)")
        if c.granularity == "per-token" and c.zero_point_domain != "int":
            notes.append("torchao's per-token path ignores zero_point_domain (always int)")
        if c.dtype.startswith("uint") and c.mapping_type == "symmetric":
            notes.append(f"torchao's symmetric scale uses the signed {c.dtype[1:]} range with zero point 0, then "
                         f"clamps to {c.dtype}'s [0, 2^b - 1]: negative values clip to 0")
        if c.mapping_type == "asymmetric" and c.granularity != "per-token":
            notes.append("torchao's asymmetric per-group/per-channel zero point is its float-domain one "
                         "(min + s * 2^(b-1)) cast to zero_point_precision, used in the integer domain")
        if "bfloat16" in (c.scale_precision, c.zero_point_precision):
            notes.append("bfloat16 scale/zero_point are written as float32 (their values are bfloat16)")
    elif res.backprops_wrt_input is not None:
        notes.append("torchao rounds dy * s to float8 in the backward (the cast back of the float8 tensor): "
                     "that rounding is the 'rounding' share")
    if stats.get("zero_gradient", 0.0) > ZERO_GRADIENT_LIMIT:
        notes.append(_zero_gradient_note(stats, c))
    return notes


def _zero_gradient_note(stats, config):
    """Why most of the input gradient is exactly 0 (the share above ZERO_GRADIENT_LIMIT)."""
    said = (f"{stats['zero_gradient_elements']} of the {stats['nonzero_upstream_elements']} elements with a "
            f"non-zero dy ({percent(stats['zero_gradient'])}) get an input gradient of exactly 0")
    if isinstance(config, IntxFakeQuantizeConfig):
        return f"{said}: the mask zeroes the gradient of clipped elements ({percent(stats['clipped'])} clipped)"
    e = ts.float8_underflow_exponent(config.dtype)
    return (f"{said}: torchao rounds dy * s to {config.dtype} in the backward, and |dy * s| <= 2^{e} rounds to 0 "
            f"(a larger loss scale keeps such gradients); {percent(stats['clipped'])} clipped")


def statistics(res, gradients, xp):
    """Clipped share, non-finite scales and, with gradients, the split of the input gradient's mass."""
    nb, length = res.blocks
    n = nb * length
    b = block_statistics(res, xp)
    stats = {"elements": n, "blocks": nb, "block_size": length,
             "clipped": float(to_numpy(b["clipped"].sum())) / n,
             "nonfinite_scale_blocks": int(to_numpy((~(xp.isfinite(res.scale) & (res.scale > 0))).sum()))}
    if gradients is None:
        return stats
    g = xp.abs(xp.asarray(gradients).astype(np.float64))
    g = xp.where(xp.isfinite(g), g, 0.0)
    total = float(to_numpy(g.sum()))
    inside = xp.asarray(res.inside)
    stats["gradient_mass"] = total
    stats["gradient_blocked"] = float(to_numpy(xp.where(inside, 0.0, g).sum())) / total if total else 0.0
    parts = {k: float(to_numpy(b[k].sum())) for k in ("straight_through", "scale_path", "rounding")}
    mass = sum(parts.values())
    stats["split"] = {k: (v / mass if mass else 0.0) for k, v in parts.items()}
    dx, dy = res.backprops_wrt_input, xp.asarray(gradients).astype(np.float32)
    stats["unchanged"] = float(to_numpy((dx == dy).sum())) / n
    stats["zeroed"] = float(to_numpy((dx == 0).sum())) / n
    # the share the verdict weighs: exactly-zero dx where dy was not (clipping, float8's underflowing backward)
    stats["zero_gradient"], stats["zero_gradient_elements"], stats["nonzero_upstream_elements"] = \
        zero_gradient(dx, dy, xp)
    shares = block_rows(res, gradients, xp, b=b)
    shares.sort(key=lambda r: (-(r["scale_path"] or 0.0), -(r["clipped"] or 0.0), r["block"]))
    stats["top_scale_path_blocks"] = [{k: r[k] for k in ("block", "index", "scale_path", "straight_through",
                                                         "rounding", "clipped")} for r in shares[:TOP_BLOCKS]]
    return stats


def block_rows(res, gradients, xp, b=None):
    """One dict per block: its index (in torchao's scale shape), scale, zero point, data range, clipped share
    and, with gradients, the straight-through / scale-path / rounding shares of its gradient mass and the
    |dy| mass its mask blocks."""
    b = b or block_statistics(res, xp)
    nb, length = res.blocks
    scale = to_numpy(res.scale).reshape(-1).astype(np.float64)
    zp = None if res.zero_point is None else to_numpy(res.zero_point).reshape(-1).astype(np.float64)
    clipped = to_numpy(b["clipped"]) / length
    has_g = gradients is not None and "straight_through" in b
    if has_g:
        st, sp, rd = (to_numpy(b[k]) for k in ("straight_through", "scale_path", "rounding"))
        mass = st + sp + rd
        g = xp.abs(xp.asarray(gradients).astype(np.float64)).reshape(nb, length)
        g = xp.where(xp.isfinite(g), g, 0.0)
        gm = to_numpy(g.sum(axis=1))
        blocked = to_numpy(xp.where(xp.asarray(res.inside).reshape(nb, length), 0.0, g).sum(axis=1))
    rows = []
    shape = tuple(res.scale.shape)
    for i in range(nb):
        row = {"block": i, "index": [int(v) for v in np.unravel_index(i, shape)] if shape else [],
               "scale": float(scale[i]), "zero_point": None if zp is None else float(zp[i]),
               "clipped": float(clipped[i]), "straight_through": None, "scale_path": None, "rounding": None,
               "gradient_blocked": None}
        if has_g:
            m = mass[i]
            row.update(straight_through=float(st[i] / m) if m else 0.0, scale_path=float(sp[i] / m) if m else 0.0,
                       rounding=float(rd[i] / m) if m else 0.0,
                       gradient_blocked=float(blocked[i] / gm[i]) if gm[i] else 0.0)
        rows.append(row)
    return rows


# --- rendering -------------------------------------------------------------------------------------------

def render(console, s):
    """The fakequant / fakequant-grad summary on stderr."""
    s = printable_doc(s)
    a, blocks, st = s["attributes"], s["blocks"], s["statistics"]
    fields = " ".join(f"{k}={v}" for k, v in a.items() if v is not None)
    console.print(f"[bold]{markup(s['op'])}[/] {markup(fields)}", soft_wrap=True)
    scale = ("-" if blocks["scale_min"] is None else f"{blocks['scale_min']:.6g}..{blocks['scale_max']:.6g}")
    console.print(f"{counted(blocks['count'], 'block')} of {blocks['size']} (scale shape {tuple(blocks['scale_shape'])}), "
                  f"scale {scale}; clipped {percent(st['clipped'])}", soft_wrap=True)
    if "split" in st:
        sp = st["split"]
        console.print(f"gradient mass: straight-through {percent(sp['straight_through'])}, scale path "
                      f"{percent(sp['scale_path'])}, rounding {percent(sp['rounding'])}; blocked by the mask "
                      f"{percent(st['gradient_blocked'])}; dx == dy at {percent(st['unchanged'])}, zero at "
                      f"{percent(st['zeroed'])}", soft_wrap=True)
        top = [r for r in st["top_scale_path_blocks"] if r["scale_path"]]
        if top:
            shown = ", ".join(f"{tuple(r['index'])} {percent(r['scale_path'])}" for r in top)
            console.print(f"largest scale-path share: {shown}", soft_wrap=True)
    for note in s["notes"]:
        console.print(f"[yellow]note:[/] {markup(note)}", soft_wrap=True)
    if s["output"] and s["output"] != "-":
        console.print(f"wrote {', '.join(s['outputs'])} to {markup(s['output'])}", soft_wrap=True)


# --- qgcli report --semantics torchao --------------------------------------------------------------------

REPORT_SCHEMA = 1
ROW_KEYS = ("block", "index", "scale", "zero_point", "clipped", "straight_through", "scale_path", "rounding",
            "gradient_blocked", "flagged")


def report_doc(operands_specs, config, *, threshold, sort, top, device):
    """The per-block report (a JSON-safe dict): rows worst first (largest scale-path share, then most
    clipped; without gradients most clipped), the split over the whole tensor, a verdict."""
    return report_doc_of(Operands.of(operands_specs, literal_ok=()), config, threshold=threshold, sort=sort,
                         top=top, device=device)


def layer_report_doc(layer, operands, *, threshold, sort, top, device):
    """``qgcli report RUN --layer PATH`` of a torchao group: :func:`report_doc` on its datasets (``operands``,
    open; closed here) with the config its attributes give."""
    return report_doc_of(operands, config_from_attributes(layer.attrs), threshold=threshold, sort=sort, top=top,
                         device=device)


def report_doc_of(operands, config, *, threshold, sort, top, device):
    """:func:`report_doc` of open ``operands`` (closed here)."""
    try:
        inputs = operands.get("inputs")
        gradients = operands.get("gradients", required=False)
        described = describe_arrays({k: v for k, v in (("inputs", inputs), ("gradients", gradients))
                                     if v is not None})
    finally:
        operands.close()
    xp, (gradients, inputs) = to_device([gradients, inputs], device)
    res = ts.fake_quantize(inputs, config, gradients)
    stats = statistics(res, gradients, xp)
    rows = block_rows(res, gradients, xp)
    has_g = gradients is not None
    metric = "scale_path" if has_g else "clipped"
    for r in rows:
        r["flagged"] = bool((r[metric] or 0.0) > threshold)
    if sort == "block":
        pass
    elif sort == "clipped" or not has_g:
        rows.sort(key=lambda r: (-r["clipped"], r["block"]))
    elif sort == "blocked":
        rows.sort(key=lambda r: (-(r["gradient_blocked"] or 0.0), r["block"]))
    else:  # worst: the scale path first
        rows.sort(key=lambda r: (-(r["scale_path"] or 0.0), -r["clipped"], r["block"]))
    flagged = sum(r["flagged"] for r in rows)
    if has_g:
        sp = stats["split"]
        verdict = (f"{flagged} of {len(rows)} blocks take more than {100 * threshold:g}% of their gradient "
                   f"mass through the scale; over the tensor straight-through {100 * sp['straight_through']:.1f}%, "
                   f"scale path {100 * sp['scale_path']:.1f}%, rounding {100 * sp['rounding']:.1f}%, "
                   f"{100 * stats['gradient_blocked']:.1f}% of |dy| blocked by the mask.")
        zero = stats["zero_gradient"]
        verdict = "Verdict: " + verdict if zero <= ZERO_GRADIENT_LIMIT else (
            f"Verdict: not OK, the input gradient is exactly 0 at {100 * zero:.1f}% of the elements whose dy is not "
            f"({stats['zero_gradient_elements']} of {stats['nonzero_upstream_elements']}, over the "
            f"{100 * ZERO_GRADIENT_LIMIT:g}% limit); {verdict}")
    else:
        verdict = (f"Verdict: {flagged} of {len(rows)} blocks clip more than {100 * threshold:g}% of their values "
                   f"({100 * stats['clipped']:.1f}% over the tensor).")
    return json_safe({"command": "report", "schema": REPORT_SCHEMA, "qgcli_version": __version__,
                      "semantics": "torchao", "op": config.op, "attributes": config.attributes(),
                      "inputs": described, "has_gradients": has_g, "blocks": len(rows),
                      "block_size": res.blocks[1], "threshold": threshold, "sort": sort, "top": top,
                      "total": stats, "rows": rows if top is None else rows[:top], "verdict": verdict,
                      "notes": _notes(res, stats)})


_REPORT_COLS = None


def _report_cols():
    global _REPORT_COLS
    if _REPORT_COLS is None:
        from qgcli.report.tables import Col

        # Priority: 0 always shown, higher numbers dropped first to fit the terminal (qgcli.report.tables).
        _REPORT_COLS = (
            Col("block", priority=0), Col("scale", priority=0), Col("zero_point", priority=1),
            Col("clipped", priority=1), Col("straight", priority=2), Col("scale path", priority=2),
            Col("rounding", priority=3), Col("blocked", priority=0),
        )
    return _REPORT_COLS


def render_report(console, doc, limit):
    doc = printable_doc(doc)
    fields = " ".join(f"{k}={v}" for k, v in doc["attributes"].items() if v is not None)
    print_items(console, f"[bold]{markup(doc['op'])}[/] {markup(fields)}")

    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    rows = doc["rows"] if limit is None else doc["rows"][:limit]
    cells = [[",".join(map(str, r["index"])) or "all", number(r["scale"], 5), number(r["zero_point"], 5),
              pct(r["clipped"]), pct(r["straight_through"]), pct(r["scale_path"]), pct(r["rounding"]),
              pct(r["gradient_blocked"])] for r in rows]
    print_table(console, _report_cols(), cells, styles=["red" if r["flagged"] else None for r in rows],
                choice=True)
    if len(rows) < len(doc["rows"]):
        print_items(console, f"... {counted(len(doc['rows']) - len(rows), 'more block')} (--top K, --json or --csv for all)")
    print_items(console, "[dim]straight / scale path / rounding: shares of the block's input-gradient mass (dy on "
                "unclipped elements / through the scale / torch's rounding); blocked: |dy| the mask zeroes[/]")
    for note in doc["notes"]:
        print_items(console, f"[yellow]note:[/] {markup(note)}")
    print_items(console, f"[bold]{markup(doc['verdict'])}[/]")


# --- qgcli report's row of a run-file group -----------------------------------------------------------------

def report_row(layer, operands, inputs, gradients, attr, num_bits, narrow_range, device):
    """``qgcli report``'s row of a run-file group: torchao's own quantizer (the group's config): clipped
    shares, the gradient mass its mask blocks, and the split of the input gradient (straight-through / scale
    path / rounding, as ``report --semantics torchao`` gives it over one tensor); worst channel: the block
    whose mask blocks most of its gradient."""
    config = config_from_attributes(layer.attrs)
    xp, (g, x) = to_device([gradients, inputs], device)
    res = ts.fake_quantize(x, config, g)
    nb, length = res.blocks
    n = nb * length
    x = to_numpy(x).astype(np.float64).reshape(nb, length)
    y = to_numpy(res.outputs).astype(np.float64).reshape(nb, length)
    clipped = ~to_numpy(res.inside).reshape(nb, length)
    fin = np.isfinite(x)
    err = np.where(fin & np.isfinite(y), y - x, 0.0)
    bits = 8 if isinstance(config, ts.Float8FakeQuantizeConfig) else ts.bit_width(config.dtype)
    row = {"num_bits": bits, "channels": nb, "clipped_below": float((clipped & (x < y)).sum()) / n,
           "clipped_above": float((clipped & (x > y)).sum()) / n,
           "sqnr_db": float(sqnr_db(float(np.sum(np.where(fin, x, 0.0) ** 2)), float(np.sum(err * err)))),
           "exact": not err.any()}
    row["clipped"] = row["clipped_below"] + row["clipped_above"]
    if not np.isfinite(row["sqnr_db"]):
        row["sqnr_db"] = None
    if gradients is None:
        return row
    b = {k: to_numpy(v) for k, v in ts.block_statistics(res, xp).items() if k != "elements"}
    mag = np.abs(to_numpy(g).astype(np.float64)).reshape(nb, length)
    mag = np.where(np.isfinite(mag), mag, 0.0)
    blocked = np.where(clipped, mag, 0.0).sum(axis=1)
    per_block = np.divide(blocked, mag.sum(axis=1), out=np.zeros(nb), where=mag.sum(axis=1) > 0)
    total = float(mag.sum())
    mass = sum(float(b[k].sum()) for k in ("straight_through", "scale_path", "rounding"))
    worst = int(np.argmax(per_block))
    row.update(gradient_blocked=float(blocked.sum()) / total if total else 0.0, worst_channel=worst,
               zero_gradient=zero_gradient(to_numpy(res.backprops_wrt_input), to_numpy(g).astype(np.float32), np)[0],
               worst_channel_gradient_blocked=float(per_block[worst]),
               worst_channel_clipped=float(clipped[worst].sum()) / length,
               **{k: float(b[k].sum()) / mass if mass else 0.0 for k in ("straight_through", "scale_path", "rounding")})
    return row


# --- qgcli plot ste / hist / channels / staircase of a run-file group -------------------------------------------

def plot_problem(layer, kind):
    """Why ``qgcli plot KIND`` cannot draw the group (None: it can): the integer quantizer is drawn per block."""
    if layer.op == "torchao.Float8FakeQuantizer":
        return f"plot {kind} draws integer grids; a torchao float8 group's grid is float8's (see report --layer)"
    return None


def plot_data(attrs, operands, *, with_gradients):
    """The arguments of :func:`qgcli.report.plots.level_data` for a torchao IntxFakeQuantizer group, on its own
    config: per block (group, token, channel) the scale and zero point torchao computes from the data, the
    outputs of torchao's forward, its gradient fed with ones (the gradient function) and, with gradients, fed
    with them; the blocks last (``--channel K`` draws block K on its own grid)."""
    config = config_from_attributes(attrs)
    x = np.asarray(operands.get("inputs"), np.float32)
    g = operands.get("gradients", required=False) if with_gradients else None
    g = None if g is None else np.asarray(g, np.float32)
    res = ts.fake_quantize(x, config, np.ones_like(x))
    nb, length = res.blocks
    bp = None if g is None else ts.fake_quantize(x, config, g).backprops_wrt_input
    blocks = lambda a: None if a is None else np.asarray(to_numpy(a)).reshape(nb, length).T  # noqa: E731
    qmin, qmax = ts.dtype_bounds(config.dtype)
    scale = to_numpy(res.scale).reshape(nb).astype(np.float32)
    z = to_numpy(res.zero_point).reshape(nb).astype(np.float64)
    domain = "int" if config.granularity == "per-token" else config.zero_point_domain
    zero_level = z if domain == "int" else (qmax + qmin + 1) / 2 - z / scale.astype(np.float64)
    inside = blocks(res.inside)
    xb = blocks(x)
    v = np.where(inside, 0.0, np.sign(xb - (blocks(res.outputs))))  # outside the grid: below or above
    return dict(op=config.op, grid=dict(scale=scale, zero_level=zero_level, quant_min=qmin, quant_max=qmax,
                                        label=f"torchao {config.dtype} {config.granularity_text}", slices="block"),
                x=xb, outputs=blocks(res.outputs), mask=blocks(res.backprops_wrt_input), backprops=blocks(bp),
                gradients=blocks(g), below=~inside & (v < 0), above=~inside & (v > 0))
