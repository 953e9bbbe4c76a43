"""Candidate ranges for a quantizer, by method: the ranges ``report`` searches for its suggested range
(``--range-method``), each channel's best candidate being the one whose fake quant of the data has the least
squared error (qgcli.ops.analysis.channel_report).

- ``percentile``: ``[P(100 - p), P(p)]`` of each channel's finite values for each ``p`` searched (numpy's
  'linear' percentile), as qgcli always did;
- ``mse``: ``alpha * [min(x, 0), max(x, 0)]`` for ``alpha`` = 1/100, 2/100, ..., 1 (:data:`MSE_STEPS`): the range
  minimising the quantization error ``sum (fq(x) - x)^2`` of the channel's own values, as AIMET's and TensorRT's
  MSE calibrations pick a clipping range (they estimate the error from a histogram; qgcli computes it exactly);
- ``kl``: TensorRT's entropy calibration (NVIDIA pytorch-quantization's ``compute_amax(method="entropy")``):
  a 2048-bin histogram of ``|x|`` over ``[0, max|x|]`` (its first bin set to the second's), and for each
  ``i`` from ``2^(bits-1)`` to 2048 the reference ``P`` (bins ``0..i-1``, the outliers added to the last) against
  ``Q`` (the same bins merged into ``2^(bits-1)`` levels and spread back over the bins that were not empty);
  ``amax`` is the upper edge of bin ``i`` with the least ``KL(P||Q) = sum P log(P/Q)`` (the last such ``i`` on a
  tie), and the range ``[-amax, amax]`` (``[0, amax]`` for data without negatives).
"""
import numpy as np

METHODS = ("percentile", "mse", "kl")
MSE_STEPS = 100
KL_BINS = 2048


def kl_amax(values, num_bits=8, bins=KL_BINS):
    """TensorRT's entropy-calibrated ``amax`` of ``values`` (finite), for a signed ``num_bits`` grid.

    >>> x = np.concatenate([np.random.default_rng(0).standard_normal(100000), [20.0] * 10])  # outliers far out
    >>> 2.5 < kl_amax(x) < 4.5, float(np.abs(x).max())
    (True, 20.0)
    """
    a = np.abs(np.asarray(values, np.float64).ravel())
    top = float(a.max()) if a.size else 0.0
    if top == 0.0:
        return 0.0
    hist, edges = np.histogram(a, bins=bins, range=(0.0, top))
    hist = hist.astype(np.float64)
    hist[0] = hist[1]  # as pytorch-quantization does: the spike at zero (ReLU, padding) is not information
    levels = 2 ** (num_bits - 1)
    if bins <= levels:
        return top
    total = hist.sum()
    best, best_i = np.inf, bins
    cumulative_tail = np.concatenate([np.cumsum(hist[::-1])[::-1], [0.0]])  # tail[i] = sum(hist[i:])
    for i in range(levels, bins + 1):
        chunk = np.digitize(np.arange(i), np.linspace(0, i, num=levels + 1)) - 1
        nonzero = hist[:i] != 0
        sums = np.bincount(chunk[nonzero], weights=hist[:i][nonzero], minlength=levels)
        counts = np.bincount(chunk[nonzero], minlength=levels)
        q = np.where(nonzero, (sums / np.maximum(counts, 1))[chunk], 0.0)
        p = hist[:i].copy()
        p[-1] += cumulative_tail[i]
        if total == 0 or q.sum() == 0:
            continue
        p, q = p / p.sum(), q / q.sum()
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0) / np.where(q > 0, q, 0.0)), 0.0)
        divergence = float(terms.sum())
        if divergence <= best:  # the last minimum, as pytorch-quantization's argmin over the reversed list
            best, best_i = divergence, i
    return float(edges[best_i]) if best_i < len(edges) else top


def candidates(method, ordered, counts, percentiles, column_percentiles, num_bits):
    """``[(lo, hi)]`` float32 arrays, one value per column, of the ranges ``method`` offers.

    ``ordered``: the columns sorted (NaN last), ``counts`` each column's finite values, ``column_percentiles``:
    :func:`qgcli.ops.analysis.column_percentiles` bound to the array module.  Every range holds 0, as
    TensorFlow's grid does (a range beside 0 would be moved onto it by the nudge anyway).
    """
    depth = len(counts)
    rows = ordered.shape[0] if ordered.ndim else 0

    def holding_zero(lo, hi):
        lo = np.where(np.isnan(lo), 0.0, np.minimum(lo, 0.0)).astype(np.float32)
        hi = np.where(np.isnan(hi), 0.0, np.maximum(hi, 0.0)).astype(np.float32)
        return lo, hi

    if not rows:
        return [holding_zero(np.full(depth, np.nan), np.full(depth, np.nan))] if method != "percentile" else \
            [holding_zero(np.full(depth, np.nan), np.full(depth, np.nan)) for _ in percentiles]
    if method == "percentile":
        return [holding_zero(np.asarray(column_percentiles(ordered, counts, 100.0 - p), np.float64),
                             np.asarray(column_percentiles(ordered, counts, p), np.float64)) for p in percentiles]
    low = np.asarray(column_percentiles(ordered, counts, 0.0), np.float64)
    high = np.asarray(column_percentiles(ordered, counts, 100.0), np.float64)
    if method == "mse":
        return [holding_zero(low * (k / MSE_STEPS), high * (k / MSE_STEPS)) for k in range(1, MSE_STEPS + 1)]
    if method == "kl":
        host = np.asarray(ordered.get() if hasattr(ordered, "get") else ordered)
        amax = np.array([kl_amax(host[:int(n), c], num_bits) if n else np.nan for c, n in enumerate(counts)])
        return [holding_zero(np.where(low < 0, -amax, 0.0), np.where(high > 0, amax, 0.0))]
    raise ValueError(f"unknown range method {method!r}; use {', '.join(METHODS)}")
