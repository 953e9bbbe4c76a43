"""A sample's statistics of TensorFlow's fake quant and fused batch norm, from host arrays (qgcli.monitor.keras).

The Keras monitor hands each site's tensors to one host callback (``tf.numpy_function``: a CPU tensor is read
in place, a GPU one copied to the host first); these functions compute that site's statistics, on float32
C-order arrays in one pass of a compiled kernel (``qgcli/ops/_kernels.c``: ``qg_tf_monitor_forward``,
``qg_tf_monitor_upstream``, ``qg_tf_monitor_downstream``, ``qg_tf_oscillation``, ``qg_oscillation_sample``,
``qg_bn_sums``), with NumPy where the kernels are not built or a sum is not finite (NaN's own rules).  Sums are
taken in float64; the history rounds them to float32 (float16 for the shares).  The range is TensorFlow's
nudged one (:func:`qgcli.ops.fake_quant.nudge`, the grid of the op's own kernel): the clipping shares and the
STE mask use its inclusive mask bounds, the integer codes its ``floor((clamp(x) - nudged_min) / scale + 0.5)``.
"""
import math

import numpy as np

from qgcli.ops import native
from qgcli.ops.fake_quant import _NUDGED, nudge, quant_range

_F32 = np.float32
_WIDTH = 1024  # one range spread over this many channels: the kernels' rows stay long enough to vectorize
_ROWS = {name: i for i, name in enumerate(_NUDGED)}


class _Fields:
    """The fields of a :class:`qgcli.ops.fake_quant.Grid` that these statistics read, as rows of the compiled
    ``qg_nudge``'s output (what :func:`~qgcli.ops.fake_quant.nudge` computes, without its checks and record:
    a fifth of its time, at every step for each weight quantizer)."""

    def __init__(self, fields):
        self._fields = fields

    def __getattr__(self, name):
        return self._fields[_ROWS[name], ...]


def grid(lo, hi, bits, narrow):
    """TensorFlow's grid for the raw range ``lo``, ``hi`` (0-d, or 1-d per channel of the last axis)."""
    lib = native.library()
    mn, mx = np.ascontiguousarray(lo, _F32), np.ascontiguousarray(hi, _F32)
    if lib is None or mn.shape != mx.shape:
        return nudge(mn, mx, num_bits=bits, narrow_range=narrow)
    fields = np.empty((len(_NUDGED),) + mn.shape, _F32)
    lib.qg_nudge(_at(mn), _at(mx), mn.size, *quant_range(bits, narrow), _at(fields))
    return _Fields(fields)


def _library(*arrays):
    """The compiled kernels when they are built and ``arrays`` are float32 C-order and not empty; else None."""
    if any(a.dtype != _F32 or not a.flags.c_contiguous or not a.size for a in arrays):
        return None
    return native.library()


def _runs(n, bounds):
    """``[(start, rows, depth, bounds)]``: ``n`` inputs as the kernels' ``[rows][depth]`` runs, ``bounds`` (float32
    arrays) one value per channel of the last axis, or one for all (then spread over up to 1024 copies, the rest
    of ``n`` a run of its own)."""
    depth = bounds[0].size
    if depth > 1 or n <= 1:
        return [(0, n // max(depth, 1), depth, [np.ascontiguousarray(b, _F32).reshape(-1) for b in bounds])]
    width = min(n, _WIDTH)
    spread = [np.full(width, b.reshape(-1)[0], _F32) for b in bounds]
    rows, tail = divmod(n, width)
    runs = [(0, rows, width, spread)]
    if tail:
        runs.append((rows * width, 1, tail, [s[:tail] for s in spread]))
    return runs


def _at(a, start=0):
    return native.addresses(a)[0] + start * a.itemsize


def _ratio(a, b):
    """``a / b`` with float division's NaN for 0 / 0 and an infinity for a / 0 (TensorFlow's)."""
    if b != 0:
        return a / b
    return math.nan if a == 0 or a != a else math.copysign(math.inf, a)


def _db(signal, noise):
    """``10 log10(signal / max(noise, 1e-30))``: -inf for no signal, NaN for NaN."""
    noise = max(noise, 1e-30) if noise == noise else noise
    ratio = _ratio(signal, noise)
    return -math.inf if ratio == 0 else (10 * math.log10(ratio) if ratio == ratio and ratio > 0 else math.nan)


def _nonfinite(a):
    return float(a.size - np.count_nonzero(np.isfinite(a)))


def forward(x, y, g, mask):
    """The forward statistics of fake quant ``y = fq(x)`` on grid ``g`` (``y`` None: no SQNR): clipping shares,
    NaN/Inf inputs, SQNR; ``mask`` (int8, ``x``'s shape) receives 1 where the STE blocks the gradient."""
    n = x.size
    lib = _library(x, *(() if y is None else (y,)))
    if lib is not None and (y is None or y.shape == x.shape):
        total = np.zeros(4)
        sums = np.zeros(4)
        for start, rows, depth, (lo, hi) in _runs(n, (g.mask_lo, g.mask_hi)):
            lib.qg_tf_monitor_forward(_at(x, start), None if y is None else _at(y, start), rows, depth, _at(lo),
                                      _at(hi), _at(mask, start), _at(sums))
            total += sums
        low, high, power, noise = total.tolist()
        if math.isfinite(power) and math.isfinite(noise):
            out = {"clip_low": low / n, "clip_high": high / n, "nan_inputs": 0.0}
            if y is not None:
                out["sqnr_db"] = _db(power, noise)
            return out
    with np.errstate(all="ignore"):
        lo, hi = g.mask_lo, g.mask_hi
        mask[...] = ~((x >= lo) & (x <= hi))
        x64 = x.astype(np.float64)
        power = float(np.sum(x64 * x64))
        out = {"clip_low": np.count_nonzero(x < lo) / n, "clip_high": np.count_nonzero(x > hi) / n,
               "nan_inputs": 0.0 if math.isfinite(power) else _nonfinite(x)}
        if y is not None and y.shape == x.shape:
            out["sqnr_db"] = _db(power, float(np.sum(np.square(x64 - y.astype(np.float64)))))
    return out


def qparams(g, lo, hi):
    """The scale (min, median, max over channels), the zero point (min, max) and the raw range's ends."""
    ordered = np.sort(np.asarray(g.scale, _F32).reshape(-1))
    zp = np.asarray(g.zero_point, _F32).reshape(-1)
    return {"scale_min": ordered[0], "scale_median": ordered[ordered.size // 2], "scale_max": ordered[-1],
            "zero_point_min": zp.min(), "zero_point_max": zp.max(),
            "range_min": np.min(lo), "range_max": np.max(hi)}


def upstream(dy, mask):
    """The upstream gradient's statistics, and ``(sum |dy| where blocked, sum |dy|)`` for :func:`downstream` (None
    without ``mask``, the forward's)."""
    n = dy.size
    with_mask = mask is not None and mask.shape == dy.shape
    lib = _library(dy)
    if lib is not None:
        sums = np.zeros(4)
        lib.qg_tf_monitor_upstream(_at(dy), _at(mask) if with_mask else None, n, _at(sums))
        squares, nonzero, blocked, mass = sums.tolist()
        nan = 0.0 if math.isfinite(squares) and math.isfinite(mass) else None
    if lib is None or nan is None:
        with np.errstate(all="ignore"):
            d64 = dy.astype(np.float64)
            squares, nonzero = float(np.sum(d64 * d64)), np.count_nonzero(dy)
            magnitude = np.abs(d64)
            mass = float(np.sum(magnitude))
            blocked = float(np.sum(magnitude[mask.astype(bool)])) if with_mask else 0.0
        nan = 0.0 if math.isfinite(squares) else _nonfinite(dy)
    out = {"dy_norm": math.sqrt(squares), "dy_zero": 1 - nonzero / max(n, 1), "nan_grads": nan, "needs_grad": 1.0}
    if not with_mask:
        return out, None
    out["blocked"] = min(_ratio(blocked, mass), 1.0)  # two sums: the ratio may pass 1 by a rounding
    return out, (blocked, mass)


def downstream(dx, dy, mask, blocked):
    """The input gradient's norm and, with the upstream gradient ``dy``, ``mask`` and ``blocked`` (from
    :func:`upstream`), ``ste_error``: sum |dx - dy*inside| / sum |dy*inside| (sum |dy| when that is 0)."""
    compared = dy is not None and blocked is not None and mask is not None and dy.shape == mask.shape == dx.shape
    lib = _library(dx, *((dy,) if compared else ()))
    done = False
    if lib is not None:
        sums = np.zeros(4)
        lib.qg_tf_monitor_downstream(_at(dx), _at(dy) if compared else None, _at(mask) if compared else None,
                                     dx.size, _at(sums))
        squares, error = sums.tolist()[:2]
        done = math.isfinite(squares) and math.isfinite(error)
    if not done:
        with np.errstate(all="ignore"):
            d64 = dx.astype(np.float64)
            squares = float(np.sum(d64 * d64))
            if compared:
                reference = np.where(mask.astype(bool), 0.0, dy.astype(np.float64))
                error = float(np.sum(np.abs(d64 - reference)))
    out = {"dx_norm": math.sqrt(squares)}
    if compared:
        l1_blocked, l1 = blocked
        den = l1 - l1_blocked
        out["ste_error"] = _ratio(error, den if den > 0 else l1)
    return out


def gradient_norm(*gradients):
    """The L2 norm of the gradients together (a learnable range's min and max)."""
    return math.sqrt(sum(float(np.sum(np.square(g.astype(np.float64)))) for g in gradients))


class Oscillation:
    """One weight quantizer's integer codes at the last step (uint16), last move direction (int8), oscillation
    frequency (float32, f_t = (1 - m) f_(t-1) + m o_t) and codes at the last sample, kept on the host."""

    def __init__(self):
        self.last = self.direction = self.frequency = self.sample = None

    def update(self, x, g, momentum):
        """One step's weights ``x`` on grid ``g``."""
        first = self.last is None or self.last.shape != x.shape
        if first:
            self.last = np.zeros(x.shape, np.uint16)
            self.direction = np.zeros(x.shape, np.int8)
            self.frequency = np.zeros(x.shape, _F32)
        keep, add = _F32(1 - momentum), _F32(momentum)
        lib = _library(x)
        if lib is not None:
            for start, rows, depth, (lo, hi, scale) in _runs(x.size, (g.nudged_min, g.nudged_max, g.scale)):
                lib.qg_tf_oscillation(_at(x, start), rows, depth, _at(lo), _at(hi), _at(scale),
                                      _at(self.last, start), _at(self.direction, start), _at(self.frequency, start),
                                      keep, add, int(first))
        else:
            with np.errstate(all="ignore"):
                clamped = np.maximum(np.minimum(x, g.nudged_max), g.nudged_min)
                q = np.floor((clamped - g.nudged_min) / g.scale + _F32(0.5))
                now = np.where((q >= 0) & (q <= 65535), q, self.last).astype(np.uint16)
            if not first:
                move = np.sign(now.astype(np.int32) - self.last).astype(np.int8)
                flipped = move * self.direction < 0
                self.frequency *= keep
                self.frequency[flipped] += add
                self.direction = np.where(move != 0, move, self.direction)
            self.last = now
        if first:
            self.sample = self.last.copy()

    def take(self, threshold):
        """The sample's statistics: codes changed since the last sample, the share of weights whose frequency is
        above ``threshold``, the largest frequency."""
        n = self.last.size
        if not n:
            return {}
        lib = native.library()
        if lib is not None:
            sums = np.zeros(4)
            lib.qg_oscillation_sample(_at(self.last), _at(self.sample), _at(self.frequency), n, 1.0, threshold,
                                      _at(sums))
            changed, above, top = sums.tolist()[:3]
        else:
            changed = np.count_nonzero(self.last != self.sample)
            above, top = np.count_nonzero(self.frequency > _F32(threshold)), float(self.frequency.max())
            self.sample[...] = self.last
        return {"codes_changed": changed / n, "oscillating": above / n, "oscillation_max": top}


def batch_norm(x, mean, variance, data_format, epsilon):
    """A fused batch norm's batch statistics (of its input ``x``, the variance biased) against the running
    ``mean`` and ``variance`` it read: bn_mean_shift, bn_var_ratio, and NaN/Inf inputs."""
    channels = mean.size
    if data_format.startswith("NC"):
        a, b = x.shape[0], x.size // max(x.shape[0] * channels, 1)
    else:
        a, b = x.size // max(channels, 1), 1
    count = a * b
    lib = _library(x)
    if lib is not None:
        sums = np.zeros(2 * channels)
        lib.qg_bn_sums(_at(x), _at(x), a, channels, b, _at(np.zeros(channels)), _at(sums))  # sum x, sum x*x
        total, squares = sums[:channels], sums[channels:]
    else:
        x64 = x.astype(np.float64).reshape(a, channels, b)
        total, squares = x64.sum((0, 2)), np.square(x64).sum((0, 2))
    with np.errstate(all="ignore"):
        batch_mean = total / count
        batch_var = np.maximum(squares / count - batch_mean * batch_mean, 0.0)
        rm, rv = mean.astype(np.float64), variance.astype(np.float64)
        shift = np.mean(np.abs(batch_mean - rm) / np.sqrt(rv + epsilon))
        ratio = np.mean(np.abs(np.log((batch_var + epsilon) / (rv + epsilon))))
    finite = math.isfinite(float(np.sum(total)))
    return {"bn_mean_shift": float(shift), "bn_var_ratio": float(ratio),
            "nan_inputs": 0.0 if finite else _nonfinite(x)}
