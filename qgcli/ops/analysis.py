"""Statistics about what a quantization grid does to a tensor and its gradient (for summaries and reports)."""
import numpy as np

from qgcli.backend import array_module, to_numpy
from qgcli.ops.fake_quant import _masks


def _share(count, total):
    return float(count) / float(total) if total else 0.0


def clip_statistics(inputs, grid, gradients=None):
    """Shares of elements below / above the nudged range and of gradient mass the STE mask blocks.

    ``inputs`` (and ``gradients``) are float32 with channels last for a per-channel ``grid``.  Returns a
    dict of plain floats for the whole tensor, plus per-channel lists for a per-channel grid.
    Blocked gradient mass is ``sum(|g| * (1 - mask)) / sum(|g|)`` (0 when the gradient is all zero).
    """
    xp = array_module(inputs)
    inside, below, above = _masks(inputs, grid, xp)
    axes = tuple(range(inputs.ndim - 1)) if grid.per_channel else None
    n = inputs.size
    stats = {
        "elements": int(n),
        "clipped_below": _share(int(below.sum()), n),
        "clipped_above": _share(int(above.sum()), n),
        "nan": _share(int(xp.isnan(inputs).sum()), n),
    }
    per_rows = n // inputs.shape[-1] if grid.per_channel and inputs.ndim else n
    if grid.per_channel:
        stats["channel_clipped_below"] = [c / per_rows if per_rows else 0.0 for c in to_numpy(below.sum(axis=axes)).tolist()]
        stats["channel_clipped_above"] = [c / per_rows if per_rows else 0.0 for c in to_numpy(above.sum(axis=axes)).tolist()]
    if gradients is not None:
        mag = xp.abs(gradients.astype(np.float64))
        mag = xp.where(xp.isfinite(mag), mag, 0.0)
        blocked = xp.where(inside, 0.0, mag)
        total = float(mag.sum())
        stats["gradient_blocked"] = float(blocked.sum()) / total if total else 0.0
        if grid.per_channel:
            tot_c = to_numpy(mag.sum(axis=axes))
            blk_c = to_numpy(blocked.sum(axis=axes))
            stats["channel_gradient_blocked"] = [
                float(b / t) if t else 0.0 for b, t in zip(blk_c.tolist(), tot_c.tolist())
            ]
    return stats


def grid_summary(grid):
    """The grid as plain Python numbers (lists for per-channel grids), for JSON and tables."""
    def plain(a, kind=float):
        a = np.asarray(a)
        return [kind(v) for v in a.tolist()] if a.ndim else kind(a)

    return {
        "num_bits": grid.num_bits,
        "narrow_range": grid.narrow_range,
        "quant_min": grid.quant_min,
        "quant_max": grid.quant_max,
        "min": plain(grid.min),
        "max": plain(grid.max),
        "nudged_min": plain(grid.nudged_min),
        "nudged_max": plain(grid.nudged_max),
        "scale": plain(grid.scale),
        "zero_point": plain(grid.zero_point, int),
    }
