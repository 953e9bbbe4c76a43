"""One tensor and one range under TensorFlow's fake quant, PyTorch's and ONNX's QuantizeLinear (the deployed
kernel): the integer each gives every element, where two of them differ, how many, why, and each one's error in
units of its scale (``qgcli compare-semantics --with tf,torch,onnx``).

The grids, from ``[min, max]``:

* **tf**: TensorFlow's ``FakeQuantWithMinMaxVars(PerChannel)`` nudges the range (its scale, nudged zero point);
  it rounds ``(clamp(x, nudged_min, nudged_max) - nudged_min) * (1/scale) + 0.5`` down: half up, the zero point
  inside the rounded value (float32, so the subtraction itself rounds).  Integer ``q = that + quant_min``.
* **torch**: PyTorch's ``MinMaxObserver`` widens the range to 0 and rounds its zero point half to even;
  ``fake_quantize_per_{tensor,channel}_affine`` gives ``clamp(nearbyint(x * (1/scale)) + zero_point)``: half to
  even, the zero point added after rounding, a multiply by the float32 reciprocal.
* **torchao**: torchao's QAT ``IntxFakeQuantizer`` (``IntxFakeQuantizeConfig(torch.uint<b>, per-token,
  asymmetric)``, :mod:`qgcli.ops.torchao_semantics`) with the range standing for the data's min/max: the
  scale ``(max(max, 0) - min(min, 0)) / (2^b - 1)`` (clamped to eps = 2^-126, PyTorch's observer clamps to
  float32's epsilon), the zero point ``clamp(-rint(min(min, 0) / scale))``, ``clamp(rint(x * (1/scale)) + z)``
  in ``[0, 2^b - 1]`` (torchao has no narrow range; 1 to 8 bits).  Where its scale and zero point equal
  PyTorch's it gives PyTorch's integers: the same arithmetic.
* **onnx**: ``QuantizeLinear`` with the scale and zero point of the framework it is deployed from (the first of
  tf / torch / torchao named before or after it; TensorFlow's when none is): ``saturate(rint(x / y_scale) + zero_point)``
  (:mod:`qgcli.ops.onnx_quantize`): half to even, a true division, the zero point after rounding, saturating to
  its type (uint4 / uint8 / uint16 for 4, 8, 16 bits: ONNX has no other width, no narrow range).

Reasons for two integers that differ (first that applies): ``nonfinite`` (NaN/Inf input: TF propagates NaN,
the others give a grid edge), ``grid`` (their scales or zero points differ), ``range`` (one integer lies outside
the other's range: narrow range, or ONNX's type range), ``tie`` (``x / scale`` exactly on a half step, in float64:
half up, half to even), ``zero point`` (TF rounds the float32 ``x - nudged_min``: adding the zero point before
rounding moves values next to a half step) and ``arithmetic`` (``x * (1/scale)`` against ``x / scale``, each
rounded to float32, on either side of a half step).
"""
import numpy as np

from qgcli.errors import OperandError
from qgcli.ops import onnx_quantize, torchao_semantics
from qgcli.ops.torch_semantics import compare_with_tensorflow

FRAMEWORKS = ("tf", "torch", "onnx", "torchao")
REASONS = ("nonfinite", "grid", "range", "tie", "zero point", "arithmetic")
_ONNX_TYPES = {4: "uint4", 8: "uint8", 16: "uint16"}


def _shape_for(values, ndim, axis):
    a = np.asarray(values, np.float64)
    if a.ndim == 0 or axis is None:
        return a.reshape(())
    shape = [1] * ndim
    shape[axis] = -1
    return a.reshape(shape)


def codes(inputs, min, max, *, frameworks=("tf", "torch", "onnx"), num_bits=8, narrow_range=False, axis=None):
    """Each framework's integers (int64; NaN inputs: -1 for TF, which has none), dequantized outputs (float32),
    scale and zero point (float64, broadcast against the inputs), integer range and, for onnx, the grid it took.

    >>> import numpy as np
    >>> c = codes(np.array([0.5, 1.5, -3.0], np.float32), -4.0, 4.0, num_bits=4)
    >>> c["tf"]["q"].tolist(), c["torch"]["q"].tolist(), c["onnx"]["q"].tolist()
    ([8, 10, 1], [8, 10, 1], [8, 10, 1])
    """
    bad = [f for f in frameworks if f not in FRAMEWORKS]
    if bad or not frameworks:
        raise OperandError(f"{','.join(bad) or 'nothing'}: choose from {', '.join(FRAMEWORKS)}", operand="--with")
    x = np.asarray(inputs)
    result = compare_with_tensorflow(x, min, max, num_bits=num_bits, narrow_range=narrow_range, axis=axis)
    grids = result["grids"]
    ax = grids["axis"]
    x = np.asarray(x, np.float32)
    tf = grids["tf"]
    out = {}
    with np.errstate(all="ignore"):
        s_tf = _shape_for(tf.scale, x.ndim, ax)
        nmin = _shape_for(tf.nudged_min, x.ndim, ax)
        y_tf = np.asarray(result["outputs_tf"], np.float32)
        q_tf = np.rint((y_tf.astype(np.float64) - nmin) / s_tf) + grids["quant_min"]
        out["tf"] = {"q": np.where(np.isfinite(q_tf), q_tf, -1).astype(np.int64), "y": y_tf, "scale": s_tf,
                     "zero_point": _shape_for(tf.zero_point, x.ndim, ax), "qmin": grids["quant_min"],
                     "qmax": grids["quant_max"], "grid": "tf"}
        s_pt = _shape_for(grids["torch_scale"], x.ndim, ax)
        z_pt = _shape_for(grids["torch_zero_point"], x.ndim, ax)
        y_pt = np.asarray(result["outputs_torch"], np.float32)
        q_pt = np.rint(y_pt.astype(np.float64) / s_pt) + z_pt
        out["torch"] = {"q": np.where(np.isfinite(q_pt), q_pt, -1).astype(np.int64), "y": y_pt, "scale": s_pt,
                        "zero_point": z_pt, "qmin": grids["quant_min"], "qmax": grids["quant_max"], "grid": "torch"}
    if "torchao" in frameworks:
        out["torchao"] = _torchao(x, min, max, num_bits, ax)
    if "onnx" in frameworks:
        dtype = _ONNX_TYPES.get(num_bits)
        if dtype is None:
            raise OperandError(f"--num-bits {num_bits}: ONNX QuantizeLinear has 4-, 8- and 16-bit integers only",
                               operand="--with")
        others = [f for f in frameworks if f != "onnx"]
        base = others[0] if others else "tf"
        g = out[base]
        scale = np.asarray(g["scale"], np.float32).reshape(-1)
        zp = np.asarray(g["zero_point"]).reshape(-1)
        kw = dict(dtype=dtype, axis=ax if ax is not None else 1)
        store = onnx_quantize.INTEGER_TYPES[dtype][0]
        if scale.size == 1:
            scale, zp = scale.reshape(()), zp.reshape(())
        r = onnx_quantize.onnx_fake_quantize(x, scale, np.rint(zp).astype(store), **kw)
        _, lo, hi = onnx_quantize.INTEGER_TYPES[dtype]
        out["onnx"] = {"q": np.asarray(r.quantized).astype(np.int64), "y": r.outputs, "scale": g["scale"],
                       "zero_point": g["zero_point"], "qmin": lo, "qmax": hi, "grid": base, "dtype": dtype}
    out["grids"] = grids
    return {k: v for k, v in out.items() if k in frameworks or k == "grids"}


def _torchao(x, min, max, num_bits, axis):
    """torchao's IntxFakeQuantizer (uint<num_bits>, asymmetric, per token) with ``[min, max]`` (per channel along
    ``axis``) as each block's min/max: its qparams from a block holding exactly those two values, then its
    int-domain forward."""
    if not 1 <= num_bits <= 8:
        raise OperandError(f"--num-bits {num_bits}: torchao's IntxFakeQuantizer takes uint1 to uint8",
                           operand="--with")
    config = torchao_semantics.intx_fake_quantize_config(f"uint{num_bits}", "per-token", "asymmetric")
    mn = np.asarray(min, np.float32).reshape(-1)
    mx = np.asarray(max, np.float32).reshape(-1)
    mn, mx = np.broadcast_arrays(mn, mx)
    scale, zero_point = torchao_semantics.choose_qparams(np.stack([mn, mx], axis=-1), config)
    s = _shape_for(scale, x.ndim, axis).astype(np.float32)
    z = _shape_for(zero_point, x.ndim, axis).astype(np.float32)
    qmin, qmax = torchao_semantics.dtype_bounds(config.dtype)
    with np.errstate(all="ignore"):
        v = np.rint(x * (np.float32(1) / s)) + z
        q = np.where(np.isnan(v), v, np.clip(v, np.float32(qmin), np.float32(qmax)))
        y = ((q - z) * s).astype(np.float32)
    return {"q": np.where(np.isfinite(q), q, -1).astype(np.int64), "y": y, "scale": s.astype(np.float64),
            "zero_point": z.astype(np.float64), "qmin": qmin, "qmax": qmax, "grid": "torchao"}


def _reasons(x, a, b, names):
    """Reason code (index into :data:`REASONS`, -1 where the integers agree) of each element for the pair."""
    with np.errstate(all="ignore"):
        differ = a["q"] != b["q"]
        finite = np.isfinite(x)
        same_grid = np.broadcast_to((a["scale"] == b["scale"]) & (a["zero_point"] == b["zero_point"]), x.shape)
        outside = ((a["q"] < b["qmin"]) | (a["q"] > b["qmax"]) | (b["q"] < a["qmin"]) | (b["q"] > a["qmax"]))
        v = x.astype(np.float64) / a["scale"]
        tie = np.isfinite(v) & (v - np.floor(v) == 0.5)
        tf_in = "tf" in names
    code = np.where(~finite, 0, np.where(~same_grid, 1, np.where(outside, 2, np.where(tie, 3, 4 if tf_in else 5))))
    return np.where(differ, code, -1).astype(np.int8)


def compare(inputs, min, max, *, frameworks=("tf", "torch", "onnx"), num_bits=8, narrow_range=False, axis=None,
            first=10):
    """The comparison as a JSON-safe dict: per framework its grid and error in units of its scale (over the
    elements inside its range, and overall), per pair the integers that differ, their largest difference, the
    reasons and the first indices; plus the arrays (``q_<fw>``, ``reason_<a>_<b>``) for ``-o``."""
    c = codes(inputs, min, max, frameworks=frameworks, num_bits=num_bits, narrow_range=narrow_range, axis=axis)
    x = np.asarray(inputs, np.float32)
    n = int(x.size)
    doc = {"elements": n, "num_bits": num_bits, "narrow_range": narrow_range, "frameworks": {}, "pairs": []}
    arrays = {}
    for f in frameworks:
        d = c[f]
        with np.errstate(all="ignore"):
            err = (d["y"].astype(np.float64) - x) / d["scale"]
            inside = np.isfinite(err) & (d["q"] > d["qmin"]) & (d["q"] < d["qmax"])
            fin = np.isfinite(err)
        scale = np.asarray(d["scale"]).reshape(-1)
        zp = np.asarray(d["zero_point"]).reshape(-1)
        doc["frameworks"][f] = {
            "grid_of": d["grid"], "quant_min": int(d["qmin"]), "quant_max": int(d["qmax"]),
            "scale": float(scale[0]) if scale.size == 1 else [float(s) for s in scale],
            "zero_point": int(zp[0]) if zp.size == 1 else [int(z) for z in zp],
            "max_abs_error_steps_inside": float(np.abs(err[inside]).max()) if inside.any() else None,
            "mean_abs_error_steps_inside": float(np.abs(err[inside]).mean()) if inside.any() else None,
            "max_abs_error_steps": float(np.abs(err[fin]).max()) if fin.any() else None,
            **({"dtype": d["dtype"]} if "dtype" in d else {})}
        arrays[f"q_{f}"] = d["q"]
        arrays[f"outputs_{f}"] = d["y"]
    for i, fa in enumerate(frameworks):
        for fb in frameworks[i + 1:]:
            a, b = c[fa], c[fb]
            reason = _reasons(x, a, b, (fa, fb))
            differ = reason >= 0
            counts = np.bincount(reason[differ].astype(np.int64), minlength=len(REASONS)) if differ.any() else \
                np.zeros(len(REASONS), np.int64)
            flat = np.flatnonzero(differ.reshape(-1))[:first]
            delta = np.abs(a["q"] - b["q"])[differ & np.isfinite(x)]
            doc["pairs"].append({
                "a": fa, "b": fb, "differ": int(differ.sum()), "share": float(differ.sum()) / n if n else 0.0,
                "max_integer_difference": int(delta.max()) if delta.size else 0,
                "reasons": {REASONS[k]: int(counts[k]) for k in range(len(REASONS)) if counts[k]},
                "first": [list(map(int, np.unravel_index(j, x.shape))) for j in flat] if x.ndim else
                [[] for _ in flat]})
            arrays[f"reason_{fa}_{fb}"] = reason
    return doc, arrays
