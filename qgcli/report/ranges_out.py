"""``report RUN --ranges-out ranges.h5``: the suggested range of every quantizer of a run file, written at the
run file's own group paths in the quantizer's own parameters, so that ``fakequant-grad RUN --ranges ranges.h5``
applies them and a few lines load them into the model (docs/inspect-report.md).

Per group, by family: TensorFlow's fake-quant ops get ``min`` and ``max`` (float32, a scalar or one per
channel, as the op takes them); PyTorch's ``fake_quantize_per_tensor_affine`` / ``..._per_channel_affine`` get
``scale`` (float32) and ``zero_point`` (int32) on the group's ``[quant_min, quant_max]``, from the range as
``torch.ao``'s observers compute them (:func:`torch_qparams`); torchao's integer quantizers
(``IntxFakeQuantizer``) get their own ``scale`` and ``zero_point`` in torchao's shapes and precisions, as
torchao computes them for a block whose smallest and largest values are the suggested range
(:func:`qgcli.ops.torchao_semantics.range_qparams`).  Each group's attributes say the op, the method and, for
PyTorch, quant_min, quant_max and the axis; for torchao, the group's config.  Other groups (torchao's float8,
ONNX, MX, batch norms ...) are listed in the file's ``skipped`` attribute with the reason.

The range is the method's best candidate (:mod:`qgcli.ops.ranges`): for TensorFlow groups exactly the
``suggested_min/max`` of ``report``; for PyTorch and torchao groups the candidate with the least error (per
channel, per block) under the framework's own fake quant with the parameters written.
"""
import json

import numpy as np

from qgcli.errors import QgcliError
from qgcli.families import groups, registry
from qgcli.families.tf_fake_quant import load_fake_quant_operands
from qgcli.ops import torch_semantics as ts
from qgcli.ops.analysis import channel_report, column_percentiles
from qgcli.ops.ranges import candidates
from qgcli.report.layers import _attr
from qgcli.storage import runfile
from qgcli.storage.operands import Operands

#: The ops whose ranges are written as PyTorch's scale / zero point.
TORCH_OPS = ("fake_quantize_per_tensor_affine", "fake_quantize_per_channel_affine")
FORMAT = "qgcli-ranges"


def torch_qparams(lo, hi, quant_min, quant_max):
    """``(scale float32, zero_point int32)`` of the range ``[lo, hi]`` as ``torch.ao``'s affine observers compute
    them (``_calculate_qparams``): the range widened to hold 0, ``scale = (hi - lo) / (quant_max - quant_min)``
    at least float32's eps, ``zero_point = quant_min - round(lo / scale)`` clamped to the integer range.

    >>> scale, zero_point = torch_qparams(np.float32(-1.0), np.float32(3.0), 0, 255)
    >>> float(scale), int(zero_point), scale.dtype.name, zero_point.dtype.name
    (0.01568627543747425, 64, 'float32', 'int32')
    """
    f32 = np.float32
    lo = np.minimum(np.asarray(lo, f32), f32(0))
    hi = np.maximum(np.asarray(hi, f32), f32(0))
    scale = ((hi - lo) / f32(quant_max - quant_min)).astype(f32)
    scale = np.maximum(scale, np.finfo(f32).eps).astype(f32)
    zero_point = (quant_min - np.rint(lo / scale)).astype(np.int64)  # torch.round: half to even, as rint
    return scale, np.clip(zero_point, quant_min, quant_max).astype(np.int32)


def suggested_ranges(target, *, options=(), percentiles, method="percentile"):
    """``(written, skipped)``: ``{group path: (attrs, {dataset: array})}`` for every quantizer of run file
    ``target`` whose parameters can be written, and ``[{path, op, reason}]`` for the others."""
    path, group, container = runfile.open_target(target, operand="BUNDLE",
                                                 not_a_run_file=f"{target} is not an HDF5 run file")
    written, skipped = {}, []
    options = dict(options)
    try:
        for layer in groups.discover(container._opened(), group, label=path):
            if layer.family is None or layer.kind != registry.FAKE_QUANT:
                if layer.op is not None:
                    skipped.append({"path": layer.path, "op": layer.op, "reason": layer.error or "not a fake-quant op"})
                continue
            reason = groups.validate(layer, "report")
            fam = registry.of(layer)
            torchao_config = getattr(fam, "ranges_config", None)
            if reason is None and torchao_config is not None:
                try:
                    torchao_config = torchao_config(layer)
                except QgcliError as exc:
                    reason = str(exc)
            elif (reason is None and not getattr(fam, "CHANNEL_ANALYSIS", False) and layer.op not in TORCH_OPS):
                reason = "no range parameters qgcli writes for this op (TensorFlow min/max, PyTorch scale/zero point)"
            if reason is not None:
                skipped.append({"path": layer.path, "op": layer.op, "reason": reason})
                continue
            operands = Operands.in_group(container, path, layer.path, groups.literal_specs(layer),
                                         literal_ok=("min", "max"), known=layer.datasets)
            try:
                if torchao_config is not None:
                    written[layer.path] = _torchao_group(layer, operands, torchao_config, percentiles, method)
                elif layer.op in TORCH_OPS:
                    written[layer.path] = _torch_group(layer, operands, options, percentiles, method)
                else:
                    written[layer.path] = _tf_group(layer, operands, options, percentiles, method)
            except (QgcliError, ValueError) as exc:
                skipped.append({"path": layer.path, "op": layer.op, "reason": str(exc)})
            finally:
                operands.close()
    finally:
        container.close()
    return written, skipped


def _tf_group(layer, operands, options, percentiles, method):
    _, x, mn, mx, variant = load_fake_quant_operands(operands, layer.variant, with_gradients=False)
    num_bits = int(_attr(layer, options, "num_bits", 8))
    narrow_range = bool(_attr(layer, options, "narrow_range", False))
    axis = int(_attr(layer, options, "axis", -1)) if variant == "per-channel" else -1
    report = channel_report(np.asarray(x), mn, mx, None, num_bits=num_bits, narrow_range=narrow_range,
                            variant=variant, axis=axis, percentiles=percentiles, range_method=method)
    lo = np.asarray(report.columns["suggested_min"], np.float32)
    hi = np.asarray(report.columns["suggested_max"], np.float32)
    if not report.per_channel:
        lo, hi = lo.reshape(()), hi.reshape(())
    attrs = {"op": layer.op, "num_bits": num_bits, "narrow_range": narrow_range, "range_method": method}
    if variant == "per-channel":
        attrs["axis"] = axis
    return attrs, {"min": lo, "max": hi}


def _torch_group(layer, operands, options, percentiles, method):
    x = np.asarray(operands.get("inputs"), np.float32)
    scale = np.asarray(operands.get("scale"))
    quant_min, quant_max = ts.check_quant_range(int(_attr(layer, options, "quant_min", 0)),
                                                int(_attr(layer, options, "quant_max", 255)))
    axis_attr = _attr(layer, options, "axis", None)
    from qgcli.families.torch import torch_layout

    axis, _ = torch_layout(scale.shape, x.shape, None if axis_attr is None else int(axis_attr))
    cols = (np.moveaxis(x, axis, -1) if axis is not None else x).reshape(-1, scale.size if axis is not None else 1)
    fin = np.isfinite(cols)
    counts = fin.sum(axis=0)
    ordered = np.sort(np.where(fin, cols, np.nan), axis=0)
    num_bits = max(1, int(np.ceil(np.log2(quant_max - quant_min + 1))))

    def scored():
        for lo, hi in candidates(method, ordered, counts, percentiles,
                                 lambda o, c, q: column_percentiles(o, c, q), num_bits):
            s, z = torch_qparams(lo, hi, quant_min, quant_max)
            if axis is None:
                s, z = s.reshape(()), z.reshape(())
            view = ts.quantized_view(x, s, z, quant_min, quant_max, axis=axis)
            out = np.asarray(view.outputs, np.float64).reshape(-1, cols.shape[1])
            ref = np.asarray(view.inputs, np.float64).reshape(-1, cols.shape[1])
            with np.errstate(all="ignore"):
                err = np.where(np.isfinite(ref), (out - ref) ** 2, 0.0).sum(axis=0)
            yield (s, z), err

    s, z = _least_error(scored())
    if axis is None:
        s, z = s.reshape(()), z.reshape(())
    attrs = {"op": layer.op, "quant_min": quant_min, "quant_max": quant_max, "range_method": method}
    if axis is not None:
        attrs["axis"] = axis
    return attrs, {"scale": s.astype(np.float32), "zero_point": z.astype(np.int32)}


def _torchao_group(layer, operands, config, percentiles, method):
    """An IntxFakeQuantizer's ``scale`` / ``zero_point`` (torchao's shapes): per block, the candidate range whose
    qparams (as torchao computes them from that range) give the least error under torchao's fake quant."""
    from qgcli.ops import torchao_semantics as tao

    x = np.asarray(operands.get("inputs"), np.float32)
    shape = tao.choose_qparams(x, config)[0].shape  # torchao's scale shape
    blocks = x.reshape(int(np.prod(shape)), -1)  # its blocks: rows of consecutive values (torchao_semantics)
    fin = np.isfinite(blocks.T)
    ordered = np.sort(np.where(fin, blocks.T, np.nan), axis=0)

    def scored():
        for lo, hi in candidates(method, ordered, fin.sum(axis=0), percentiles,
                                 lambda o, c, q: column_percentiles(o, c, q), tao.bit_width(config.dtype)):
            s, z = tao.range_qparams(lo, hi, config)
            out = np.asarray(tao.fake_quantize(x, config, qparams=(s, z)).outputs, np.float64).reshape(blocks.shape)
            with np.errstate(all="ignore"):
                err = np.where(np.isfinite(blocks), (out - blocks) ** 2, 0.0).sum(axis=1)
            yield (s, z), err

    s, z = (a.reshape(shape) for a in _least_error(scored()))
    attrs = {k: v for k, v in layer.attrs.items() if k not in ("framework", "module", "torchao_version")}
    attrs["range_method"] = method
    zero_point = z.astype(np.int32) if config.zero_point_precision == "int32" else z.astype(np.float32)
    return attrs, {"scale": s.astype(np.float32), "zero_point": zero_point}


def _least_error(scored):
    """Per channel (block), the parameters of the candidate with the least error, the earlier one on a tie:
    ``scored`` yields ``((scale, zero_point), error per channel)``; returns the 1-d arrays."""
    best, best_err = None, None
    for params, err in scored:
        params = [np.atleast_1d(a).ravel() for a in params]
        if best is None:
            best, best_err = [a.copy() for a in params], err
            continue
        better = err < best_err
        for kept, new in zip(best, params):
            kept[better] = new[better]
        best_err = np.where(better, err, best_err)
    return best


def write(dest, written, skipped, *, source, method):
    """Write the ranges file atomically (h5py): a group per quantizer at its run-file path."""
    import h5py

    from qgcli.storage.atomic import atomic_write

    def save(tmp):
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = FORMAT
            f.attrs["source"] = source
            f.attrs["range_method"] = method
            f.attrs["skipped"] = json.dumps(skipped)
            for path, (attrs, datasets) in written.items():
                g = f.require_group(path)
                for key, value in attrs.items():
                    g.attrs[key] = value
                for name, array in datasets.items():
                    g.create_dataset(name, data=array)

    atomic_write(dest, save)


def read_specs(path, *, option="--ranges"):
    """``((group path, ((operand, SPEC), ...)), ...)`` of a ranges file: each group's parameters as operand
    specs (``FILE:GROUP/min``) that replace the run file's (``fakequant-grad RUN --ranges FILE``)."""
    import h5py

    from qgcli.errors import FileFormatError, OperandError

    try:
        f = h5py.File(path, "r")
    except (OSError, ValueError) as exc:
        raise OperandError(f"cannot read {path}: {exc}", operand=option) from None
    with f:
        if f.attrs.get("format") != FORMAT:
            raise FileFormatError(f"{path} is not a ranges file (report RUN --ranges-out writes one)", operand=option)
        out = []

        def visit(name, obj):
            if isinstance(obj, h5py.Group) and "op" in obj.attrs:
                names = [n for n in ("min", "max", "scale", "zero_point") if n in obj]
                out.append((name, tuple((n, f"{path}:{name}/{n}") for n in names)))

        f.visititems(visit)
    return tuple(out)
