"""Statistics about what a quantization grid does to a tensor and its gradient (for summaries and reports)."""
from dataclasses import dataclass, field

import numpy as np

from qgcli.backend import array_module, to_numpy
from qgcli.errors import QgcliError
from qgcli.ops import fake_quant as fq, native
from qgcli.ops.blocked import _map, _row_ranges, _table
from qgcli.ops.fake_quant import _masks, nudge
from qgcli.ops.ranges import candidates as range_candidates


def _share(count, total):
    return float(count) / float(total) if total else 0.0


_STAT_BLOCK = 1 << 18  # elements per block: masks and float64 magnitudes stay small


def add_nonfinite(counts, x):
    """Add the NaN, +inf and -inf of the float block ``x`` to ``counts`` (a list of three ints, changed in
    place), as a tensor streamed from disk is read.  One summing pass over a block whose values are all finite
    (their float32 sum is then finite, or overflows and the block is counted exactly); the elementwise count
    only for a block that holds some."""
    with np.errstate(over="ignore", invalid="ignore"):  # inf - inf, or a sum past float32: no warning
        if x.size == 0 or np.isfinite(np.add.reduce(x, axis=None)):
            return counts
    counts[0] += int(np.count_nonzero(np.isnan(x)))
    counts[1] += int(np.count_nonzero(x == np.inf))
    counts[2] += int(np.count_nonzero(x == -np.inf))
    return counts


def clip_statistics(inputs, grid, gradients=None):
    """Shares of elements below / above the nudged range and of gradient mass the STE mask blocks.

    ``inputs`` (and ``gradients``) are float32 with channels last for a per-channel ``grid``.  Returns a
    dict of plain floats for the whole tensor, plus per-channel lists for a per-channel grid.
    Blocked gradient mass is ``sum(|g| * (1 - mask)) / sum(|g|)`` over finite gradients (0 when the
    gradient is all zero).  Works block by block: no full-size temporary.
    """
    xp = array_module(inputs)
    depth = inputs.shape[-1] if grid.per_channel and inputs.ndim else 1
    x2 = inputs.reshape(-1, depth)
    g2 = None if gradients is None else gradients.reshape(-1, depth)
    rows = x2.shape[0]
    lib = native.for_arrays(xp, x2, g2)
    if lib is not None:
        counts, mass = _native_clip_statistics(lib, x2, g2, grid)
    else:
        counts, mass = _clip_statistics_blocks(xp, x2, g2, grid)
    n = inputs.size
    stats = {
        "elements": int(n),
        "clipped_below": _share(int(counts[0].sum()), n),
        "clipped_above": _share(int(counts[1].sum()), n),
        "nan": _share(int(counts[2].sum()), n),
    }
    if grid.per_channel:
        stats["channel_clipped_below"] = [c / rows if rows else 0.0 for c in counts[0].tolist()]
        stats["channel_clipped_above"] = [c / rows if rows else 0.0 for c in counts[1].tolist()]
    if g2 is not None:
        total = float(mass[0].sum())
        stats["gradient_blocked"] = float(mass[1].sum()) / total if total else 0.0
        if grid.per_channel:
            stats["channel_gradient_blocked"] = [float(b / t) if t else 0.0 for t, b in zip(*mass.tolist())]
    return stats


#: Columns a per-tensor statistics pass lays its values out in: the kernel's per-row work is paid once per
#: 64 values (8 columns took 25 ms, 64 columns 19 ms on 25.7 M values; 256 columns 24 ms).
_LANES = 64


def _native_clip_statistics(lib, x2, g2, grid):
    """(counts [3, depth], mass [2, depth]) with the compiled kernel, row blocks on the thread pool."""
    lo, hi = grid.mask_bounds()
    bounds = (lo, hi, grid.passthrough.astype(np.float32))
    rows, depth = x2.shape
    if depth > 1 or rows < _LANES:
        return _native_clip_matrix(lib, x2, g2, _table(bounds, depth))
    # One grid for every value: lay them out _LANES wide, so the kernel's loop over columns vectorizes.
    main = rows - rows % _LANES
    wide = _native_clip_matrix(lib, x2[:main].reshape(-1, _LANES),
                               None if g2 is None else g2[:main].reshape(-1, _LANES), _table(bounds, _LANES))
    rest = _native_clip_matrix(lib, x2[main:], None if g2 is None else g2[main:], _table(bounds, 1))
    return tuple(w.sum(axis=1, keepdims=True) + r for w, r in zip(wide, rest))


def _native_clip_matrix(lib, x2, g2, bounds):
    """``qg_clip_stats`` over row blocks of ``x2`` (and ``g2``) on the thread pool; sums in block order."""
    address = native.address
    rows, depth = x2.shape
    x_at, bounds_at = address(x2, np.float32), address(bounds, np.float32)
    g_at = None if g2 is None else address(g2, np.float32)

    def run(rng):
        r0, r1 = rng
        counts, mass = np.zeros((3, depth), np.int64), np.zeros((2, depth), np.float64)
        offset = 4 * r0 * depth
        lib.qg_clip_stats(x_at + offset, None if g_at is None else g_at + offset, r1 - r0, depth, bounds_at,
                          address(counts, np.int64), address(mass, np.float64))
        return counts, mass

    counts, mass = np.zeros((3, depth), np.int64), np.zeros((2, depth), np.float64)
    for part_counts, part_mass in _map(run, _row_ranges(rows, depth)):  # the same figures on any thread count
        counts += part_counts
        mass += part_mass
    return counts, mass


def _clip_statistics_blocks(xp, x2, g2, grid):
    rows, depth = x2.shape
    counts = np.zeros((3, depth), np.int64)  # below, above, nan
    mass = np.zeros((2, depth), np.float64)  # total |g|, blocked |g|
    step = max(1, _STAT_BLOCK // max(depth, 1)) if xp is np else max(rows, 1)
    for r in range(0, rows, step):
        xb = x2[r:r + step]
        inside, below, above = _masks(xb, grid, xp)
        counts[0] += to_numpy(below.sum(axis=0))
        counts[1] += to_numpy(above.sum(axis=0))
        counts[2] += to_numpy(xp.isnan(xb).sum(axis=0))
        if g2 is not None:
            mag = xp.abs(g2[r:r + step].astype(np.float64))
            mag[~xp.isfinite(mag)] = 0.0
            mass[0] += to_numpy(mag.sum(axis=0))
            mag[inside] = 0.0
            mass[1] += to_numpy(mag.sum(axis=0))
    return counts, mass


def blocked_by(gradients, backprops):
    """Share of the finite ``|gradients|`` mass at elements whose ``backprops`` is exactly 0: what a gradient
    estimator blocks (TF's STE: the mask; a leaky estimator: nothing).  0 for an all-zero gradient."""
    xp = array_module(gradients)
    g, dx = gradients.reshape(-1), backprops.reshape(-1)
    total = blocked = 0.0
    for i in range(0, g.size, _STAT_BLOCK):  # float64 magnitudes a block at a time
        mag = xp.abs(g[i:i + _STAT_BLOCK].astype(np.float64))
        mag[~xp.isfinite(mag)] = 0.0
        total += float(mag.sum())
        blocked += float(mag[dx[i:i + _STAT_BLOCK] == 0].sum())
    return blocked / total if total else 0.0


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


# --- per-channel report ------------------------------------------------------------------------------

#: Percentiles searched for a suggested range: ``[P(100 - p), P(p)]`` of each channel's finite values.
DEFAULT_PERCENTILES = (100.0, 99.99, 99.9, 99.5, 99.0, 98.0, 95.0)

#: Keys of one report row, in the order reports print them (JSON and CSV keep this order).
ROW_KEYS = (
    "channel", "elements", "nonfinite", "data_min", "data_max", "min", "max", "nudged_min", "nudged_max",
    "scale", "zero_point", "clipped_below", "clipped_above", "clipped", "gradient_mass", "gradient_blocked",
    "backprop_wrt_min", "backprop_wrt_max", "mse", "sqnr_db", "suggested_percentile", "suggested_min",
    "suggested_max", "suggested_mse", "suggested_sqnr_db", "suggested_clipped", "suggested_gradient_blocked",
    "suggested_scale", "suggested_zero_point",
)

#: Keys of the whole-tensor totals.
TOTAL_KEYS = (
    "elements", "channels", "nonfinite", "clipped_below", "clipped_above", "clipped", "gradient_mass",
    "gradient_blocked", "mse", "sqnr_db", "suggested_mse", "suggested_sqnr_db", "suggested_clipped", "suggested_gradient_blocked",
)

SORT_KEYS = ("worst", "blocked", "clipped", "sqnr", "gain", "channel")

_BLOCK_ELEMENTS = 1 << 20  # rows are processed in blocks of about this many values (bounded temporaries)


@dataclass
class ChannelReport:
    """What a fake-quant grid does to each channel of a tensor and of its upstream gradient.

    ``columns`` maps every name in :data:`ROW_KEYS` to a 1-d NumPy float64 array with one entry per
    channel (one entry in all for a per-tensor grid); NaN marks a value that does not exist (no
    gradients, no finite data, an Args op without range gradients).  ``total`` holds the same
    quantities for the whole tensor.  :meth:`row` gives one channel as plain Python values.
    """

    variant: str
    axis: object
    grid: object
    suggested_grid: object
    percentiles: tuple
    has_gradients: bool
    columns: dict
    total: dict = field(default_factory=dict)

    @property
    def channels(self):
        return int(self.columns["channel"].shape[0])

    @property
    def per_channel(self):
        return self.variant == "per-channel" or ((self.variant.startswith("quantize-and-dequantize-v")
                                                  or self.variant == "torch") and self.axis is not None)

    def row(self, c):
        """Channel ``c`` as a dict of plain Python numbers (None for NaN or infinite values)."""
        out = {}
        for key in ROW_KEYS:
            value = float(self.columns[key][c])
            if key in ("channel", "elements", "nonfinite", "zero_point", "suggested_zero_point"):
                out[key] = int(value) if np.isfinite(value) else None
            else:
                out[key] = value if np.isfinite(value) else None
        if not self.per_channel:
            out["channel"] = None
        return out

    def order(self, by="worst"):
        """Channel indices, worst first.

        ``worst``: most gradient mass blocked (most clipped without gradients), then lowest SQNR;
        ``blocked``, ``clipped``: largest share first; ``sqnr``: lowest SQNR first; ``gain``: largest SQNR
        gain of the suggested range first; ``channel``: by index.  Missing values sort last.
        """
        if by not in SORT_KEYS:
            raise QgcliError(f"unknown sort key {by!r}; use one of {', '.join(SORT_KEYS)}", operand="sort")
        col = self.columns

        def down(v):  # larger first, NaN last
            return np.where(np.isfinite(v) | (v == np.inf), -v, np.inf)

        def up(v):  # smaller first, NaN last
            return np.where(np.isnan(v), np.inf, v)

        keys = {  # the sort keys, most significant first; ties go to the lower channel
            "worst": lambda: (down(col["gradient_blocked"] if self.has_gradients else col["clipped"]),
                              up(col["sqnr_db"])),
            "blocked": lambda: (down(col["gradient_blocked"]),),
            "clipped": lambda: (down(col["clipped"]),),
            "sqnr": lambda: (up(col["sqnr_db"]),),
            "gain": lambda: (down(col["suggested_sqnr_db"] - col["sqnr_db"]),),
            "channel": lambda: (),
        }
        with np.errstate(invalid="ignore"):
            # one vectorised sort (np.lexsort: its last key first) where a Python key per channel cost a
            # report row ~0.3 ms on 64 channels; -0.0 and 0.0 tie as they did in tuples
            columns = [np.asarray(k, dtype=np.float64) for k in keys[by]()]
            return np.lexsort([np.arange(self.channels), *columns[::-1]]).tolist()


def sqnr_db(signal, error):
    """Signal-to-quantization-noise ratio ``10 log10(signal / error)`` in dB, from sums of squares.

    ``+inf`` when the error is zero (exact), ``-inf`` for a zero signal with an error, NaN when there is
    nothing to measure (negative or NaN sums).

    >>> float(sqnr_db(100.0, 1.0)), float(sqnr_db(1.0, 0.0))
    (20.0, inf)
    """
    signal = np.asarray(signal, np.float64)
    error = np.asarray(error, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = 10.0 * np.log10(signal / error)
    out = np.where(error == 0, np.where(signal >= 0, np.inf, np.nan), out)
    return np.where((signal < 0) | (error < 0), np.nan, out)


def column_percentiles(sorted_columns, counts, q, xp=None):
    """Percentile ``q`` (0..100) of each column, as ``numpy.percentile`` ('linear') computes it.

    ``sorted_columns`` is sorted along axis 0 with the ``counts[c]`` finite values of column ``c`` first
    (NaN sorts last, so sorting with non-finite values replaced by NaN gives that).  Columns without
    values give NaN.  Results are float64.

    >>> s = np.sort(np.array([[3.0, 1.0], [1.0, np.nan], [2.0, np.nan]]), axis=0)
    >>> column_percentiles(s, np.array([3, 1]), 50.0).tolist()
    [2.0, 1.0]
    """
    xp = xp or array_module(sorted_columns)
    counts = xp.asarray(counts)
    last = xp.maximum(counts - 1, 0)
    pos = last.astype(np.float64) * (float(q) / 100.0)
    i0 = xp.minimum(xp.floor(pos).astype(np.int64), last)
    i1 = xp.minimum(i0 + 1, last)
    t = pos - i0
    a = xp.take_along_axis(sorted_columns, i0[None, :], axis=0)[0].astype(np.float64)
    b = xp.take_along_axis(sorted_columns, i1[None, :], axis=0)[0].astype(np.float64)
    diff = b - a
    # numpy's _lerp: approach from the nearer end so that t == 1 gives b exactly.
    value = xp.where(t >= 0.5, b - diff * (1.0 - t), a + diff * t)
    return xp.where(counts > 0, value, xp.nan)


def _row_blocks(rows, depth):
    step = max(1, _BLOCK_ELEMENTS // max(depth, 1))
    return [slice(s, min(s + step, rows)) for s in range(0, rows, step)]


def _report_ops(variant, num_bits, narrow_range):
    """The TF forward op of ``variant`` on a [rows, channels] block, and the grid builder for a range."""
    attrs = dict(num_bits=num_bits, narrow_range=narrow_range)
    if variant == "per-channel":
        def forward(xb, lo, hi):
            return fq.fake_quant_with_min_max_vars_per_channel(xb, lo, hi, axis=-1, **attrs)

        def grid_for(lo, hi):
            return nudge(lo, hi, **attrs)
    elif variant == "vars":
        def forward(xb, lo, hi):
            return fq.fake_quant_with_min_max_vars(xb, lo.reshape(()), hi.reshape(()), **attrs)

        def grid_for(lo, hi):
            return nudge(lo.reshape(()), hi.reshape(()), **attrs)
    else:
        def forward(xb, lo, hi):
            return fq.fake_quant_with_min_max_args(xb, float(lo.reshape(())), float(hi.reshape(())), **attrs)

        def grid_for(lo, hi):
            return fq._args_grid(float(lo.reshape(())), float(hi.reshape(())), num_bits, narrow_range)
    return forward, grid_for


def channel_report(inputs, min, max, gradients=None, *, num_bits=8, narrow_range=False, variant=None, axis=-1,
                   percentiles=DEFAULT_PERCENTILES, on_step=None, qdq=None, range_method="percentile", torch=None):
    """Per-channel (or per-tensor) report of a fake-quant grid on ``inputs`` and the gradient's fate.

    For each channel (each entry of ``min``/``max`` along ``axis`` for the per-channel op; the whole tensor
    for ``vars``/``args``): the data range, the raw and nudged range, the shares of values clipped below and
    above the nudged range (TensorFlow's inclusive mask), the share of upstream gradient mass the STE mask
    blocks ``sum(|g| * (1 - mask)) / sum(|g|)`` (0 for an all-zero gradient), ``backprop_wrt_min/max`` from
    TensorFlow's gradient op, the forward error ``mean((fq(x) - x)**2)`` and ``SQNR = 10 log10(sum x**2 /
    sum (fq(x) - x)**2)`` over finite values, and a suggested range.

    The suggested range is searched among ``[P(100 - p), P(p)]`` for each ``p`` in ``percentiles`` (finite
    values of the channel; widened to include 0, as TensorFlow's grid always holds 0) and is the one with
    the best SQNR under the same op; ties go to the earlier percentile.  ``range_method`` ``mse`` searches
    ``alpha * [min, max]`` instead, ``kl`` takes TensorRT's entropy-calibrated range (:mod:`qgcli.ops.ranges`).

    Parameters
    ----------
    inputs, gradients : array (NumPy or CuPy)
        Forward inputs and upstream gradient (same shape; ``gradients`` optional).
    min, max : scalar or 1-d array
        The raw range, as TensorFlow's op takes it.
    variant : {"per-channel", "vars", "args"}, optional
        TF op family; default per-channel for 1-d ``min``, else vars.
    on_step : callable, optional
        Called with a short description before each pass over the data (for progress displays).
    qdq : dict, optional
        ``variant="quantize-and-dequantize-v4|-v3|-v2"``: ``signed_input``, ``range_given``, ``round_mode``.
        There ``axis`` is TF's (-1: per tensor, K: one range per slice), "nudged" is the grid's ends
        ``[lo, hi]`` (clipped: outside them), the mask V4Grad's on the given range (V2/V3: TF's pass-through
        gradient, nothing blocked), ``backprop_wrt_min/max`` V4Grad's zeros (V2/V3: none), and a suggested
        range is one to give with ``range_given``.
    torch : dict, optional
        ``variant="torch"``: PyTorch's fake quant (``fake_quantize_per_{tensor,channel}_affine``) with
        ``scale``, ``zero_point`` (0-d per tensor, one per channel along ``axis``; ``axis=None`` per tensor),
        ``quant_min``, ``quant_max`` and ``symmetric`` (``min``/``max`` unused).  "nudged" is the range the
        grid spans, clipped what PyTorch's mask zeroes (its rounded integer outside the range), no range
        gradients; a suggested range comes with the ``suggested_scale`` / ``suggested_zero_point`` PyTorch's
        min/max observer picks for it (:func:`qgcli.ops.torch_semantics.observer_qparams`).

    Returns
    -------
    ChannelReport

    Examples
    --------
    >>> x = np.array([[-3.0, 0.5], [0.25, 4.0]], np.float32)
    >>> r = channel_report(x, [-1.5, -1.5], [1.5, 1.5], num_bits=2)
    >>> r.row(0)["clipped_below"], r.row(1)["clipped_above"], r.row(0)["nudged_min"]
    (0.5, 0.5, -2.0)
    """

    step = on_step or (lambda text: None)
    xp = array_module(inputs, gradients)
    x = fq.as_float32(inputs, "inputs", xp)
    g = None if gradients is None else fq.as_float32(gradients, "gradients", xp)
    if g is not None:
        fq._check_same_shape(g, x)
    if variant is None:
        variant = "per-channel" if np.ndim(to_numpy(min)) >= 1 else "vars"
    attrs = dict(num_bits=num_bits, narrow_range=narrow_range)
    dmin = dmax = None
    step("checking the range")
    masks = lambda xb, grid_: _masks(xb, grid_, xp)  # noqa: E731
    now = {}
    if variant.startswith("quantize-and-dequantize-v"):
        from qgcli.ops import quantize_and_dequantize as qad

        q = dict(qdq or {})
        version = variant.rsplit("-", 1)[1]
        qaxis = None if axis is None or axis == -1 else axis
        x, qgrid, axis = qad.prepare(x, 0.0 if min is None else min, 0.0 if max is None else max, num_bits=num_bits,
                                     narrow_range=narrow_range, axis=qaxis, version=version, **q)
        grid = qad.plot_grid(qgrid, num_bits=num_bits, narrow_range=narrow_range, op=f"QuantizeAndDequantize"
                             f"{version.upper()}", **q)
        given = None
        if version == "v4":
            given = qad.grad_bounds(min, max, x.shape, axis)
            if g is not None:
                step("input_min/max_backprop (TensorFlow's op)")
                _, dmin, dmax = qad.quantize_and_dequantize_v4_grad(g, x, min, max, axis=axis)

        def qdq_masks(xb, grid_):  # V4Grad's mask on the given range for the op's own grid
            bounds = given if grid_ is grid else None
            return qad.report_masks(xb, grid_, version, xp, given=bounds)

        masks = qdq_masks

        now = {"given": bool(q.get("range_given"))}
        if axis is not None:
            x, g = (None if a is None else xp.moveaxis(a, axis, -1) for a in (x, g))
    elif variant == "per-channel":
        grid, axis = fq._prepare_per_channel(x, min, max, num_bits, narrow_range, axis, xp)
        if g is not None:
            step("backprop_wrt_min/max (TensorFlow's op)")
            _, dmin, dmax = fq.fake_quant_with_min_max_vars_per_channel_gradient(g, x, min, max, axis=axis, **attrs)
        x, g = (None if a is None else xp.moveaxis(a, axis, -1) for a in (x, g))
    elif variant == "vars":
        grid = fq._prepare_per_tensor(x, min, max, num_bits, narrow_range, xp)
        axis = None
        if g is not None:
            step("backprop_wrt_min/max (TensorFlow's op)")
            _, dmin, dmax = fq.fake_quant_with_min_max_vars_gradient(g, x, min, max, **attrs)
    elif variant == "torch":
        from qgcli.ops import torch_semantics as ts

        t = dict(torch)
        axis = None if axis is None or np.size(to_numpy(t["scale"])) == 1 and axis == -1 else axis
        torch_forward, torch_grid_for, torch_masks = ts.report_ops(t["quant_min"], t["quant_max"],
                                                                   symmetric=bool(t.get("symmetric")))
        scale = np.asarray(to_numpy(t["scale"]), np.float32)
        zero_point = np.asarray(to_numpy(t["zero_point"]))
        grid = ts.ReportGrid(scale.reshape(-1) if axis is not None else scale.reshape(()),
                             zero_point.reshape(-1) if axis is not None else zero_point.reshape(()),
                             t["quant_min"], t["quant_max"])
        masks = lambda xb, grid_: torch_masks(xb, grid_)  # noqa: E731
        now = {"grid": grid}
        if axis is not None:
            x, g = (None if a is None else xp.moveaxis(a, axis, -1) for a in (x, g))
    elif variant == "args":
        mn, mx = (float(np.asarray(to_numpy(v)).reshape(())) for v in (min, max))
        grid = fq._args_grid(mn, mx, num_bits, narrow_range)
        axis = None
    else:
        raise QgcliError(f"unknown variant {variant!r}; use per-channel, vars or args", operand="variant")
    per_slice = variant == "per-channel" or ((variant.startswith("quantize-and-dequantize-v") or variant == "torch")
                                             and axis is not None)
    depth = x.shape[-1] if per_slice else 1
    x2 = x.reshape(-1, depth)
    g2 = None if g is None else g.reshape(-1, depth)
    rows = x2.shape[0]
    blocks = _row_blocks(rows, depth)
    if variant == "torch":
        forward, grid_for = torch_forward, torch_grid_for
    elif variant.startswith("quantize-and-dequantize-v"):
        forward, grid_for = qad.report_ops(version=version, num_bits=num_bits, narrow_range=narrow_range, **q)
    else:
        forward, grid_for = _report_ops(variant, num_bits, narrow_range)
    f64 = np.float64

    def mask_pass(grid_):
        """Clipped counts and blocked/total gradient mass per channel under ``grid_``."""
        below_c = xp.zeros(depth, f64)
        above_c = xp.zeros(depth, f64)
        blocked_c = xp.zeros(depth, f64)
        mass_c = xp.zeros(depth, f64)
        for sl in blocks:
            inside, below, above = masks(x2[sl], grid_)
            below_c += below.sum(axis=0)
            above_c += above.sum(axis=0)
            if g2 is not None:
                mag = xp.abs(g2[sl].astype(f64))
                mag = xp.where(xp.isfinite(mag), mag, 0.0)
                mass_c += mag.sum(axis=0)
                blocked_c += xp.where(inside, 0.0, mag).sum(axis=0)
        return below_c, above_c, blocked_c, mass_c

    def error_pass(lo, hi, **kw):
        err = xp.zeros(depth, f64)
        for sl in blocks:
            xb = x2[sl]
            q = forward(xb, lo, hi, **kw)
            with fq._quiet(xp):
                d = xp.where(xp.isfinite(xb), q.astype(f64) - xb.astype(f64), 0.0)
            err += (d * d).sum(axis=0)
        return to_numpy(err)

    step("clipping and gradient mass")
    below_c, above_c, blocked_c, mass_c = mask_pass(grid)
    finite_c = xp.zeros(depth, f64)
    signal_c = xp.zeros(depth, f64)
    data_min = xp.full(depth, np.inf)
    data_max = xp.full(depth, -np.inf)
    for sl in blocks:
        xb = x2[sl]
        fin = xp.isfinite(xb)
        finite_c += fin.sum(axis=0)
        xf = xp.where(fin, xb, 0).astype(f64)
        signal_c += (xf * xf).sum(axis=0)
        if xb.shape[0]:
            data_min = xp.minimum(data_min, xp.where(fin, xb, np.inf).min(axis=0))
            data_max = xp.maximum(data_max, xp.where(fin, xb, -np.inf).max(axis=0))
    step("forward quantization error")
    mn32 = np.asarray(grid.min, np.float32).reshape(-1)
    mx32 = np.asarray(grid.max, np.float32).reshape(-1)
    err_now = error_pass(mn32, mx32, **now)

    # Percentiles of each channel's finite values from one sort (NaN sorts last on NumPy and CuPy).
    step("suggested range: sorting")
    counts = finite_c.astype(np.int64)
    ordered = xp.sort(xp.where(xp.isfinite(x2), x2, xp.nan), axis=0) if rows else x2
    signal = to_numpy(signal_c)
    candidates = []
    ranges = range_candidates(range_method, ordered, counts, percentiles,
                              lambda o, c, q: to_numpy(column_percentiles(o, c, q, xp)), num_bits)
    for n, (lo, hi) in enumerate(ranges):
        step(f"suggested range: percentile {percentiles[n]:g}" if range_method == "percentile" else
             f"suggested range: {range_method} candidate {n + 1} of {len(ranges)}")
        if variant == "args" and not lo[0] < hi[0]:
            candidates.append((lo, hi, np.full(depth, np.nan)))
            continue
        with np.errstate(all="ignore"):
            candidates.append((lo, hi, error_pass(lo, hi)))
    del ordered
    if candidates:
        scores = np.stack([sqnr_db(signal, err) for _, _, err in candidates])
        scores = np.where(np.isnan(scores), -np.inf, scores)
        best = np.argmax(scores, axis=0)
        usable = np.isfinite(np.stack([err for _, _, err in candidates])).any(axis=0)
    else:
        best = np.zeros(depth, np.int64)
        usable = np.zeros(depth, bool)
    pick = np.arange(depth)
    sug_lo = np.array([candidates[b][0][c] for c, b in zip(pick, best)], np.float32) if candidates else None
    sug_hi = np.array([candidates[b][1][c] for c, b in zip(pick, best)], np.float32) if candidates else None
    sug_err = np.array([candidates[b][2][c] for c, b in zip(pick, best)], np.float64) if candidates else None
    sug_p = (np.array([percentiles[b] if range_method == "percentile" else np.nan for b in best], np.float64)
             if candidates else None)
    suggested_grid = None
    s_below = s_above = s_blocked = None
    if candidates and usable.all():
        step("suggested range: clipping and gradient mass")
        suggested_grid = grid_for(sug_lo, sug_hi)
        s_below, s_above, s_blocked, _ = (to_numpy(a) for a in mask_pass(suggested_grid))

    nan = np.full(depth, np.nan)
    below_c, above_c, blocked_c, mass_c = (to_numpy(a) for a in (below_c, above_c, blocked_c, mass_c))
    finite_n, data_min, data_max = (to_numpy(a) for a in (finite_c, data_min, data_max))
    with np.errstate(divide="ignore", invalid="ignore"):
        share = (lambda a: a / rows) if rows else (lambda a: np.zeros_like(a))
        blocked_share = np.where(mass_c > 0, blocked_c / np.where(mass_c > 0, mass_c, 1.0), 0.0)
        mse = np.where(finite_n > 0, err_now / np.where(finite_n > 0, finite_n, 1.0), np.nan)
        sug_mse = (np.where(finite_n > 0, sug_err / np.where(finite_n > 0, finite_n, 1.0), np.nan)
                   if candidates else nan)

    def per_channel(a):
        return np.asarray(to_numpy(a), np.float64).reshape(-1) if a is not None else nan

    columns = {
        "channel": np.arange(depth, dtype=np.float64),
        "elements": np.full(depth, float(rows)),
        "nonfinite": rows - finite_n,
        "data_min": np.where(finite_n > 0, data_min, np.nan),
        "data_max": np.where(finite_n > 0, data_max, np.nan),
        "min": per_channel(grid.min),
        "max": per_channel(grid.max),
        "nudged_min": per_channel(grid.nudged_min),
        "nudged_max": per_channel(grid.nudged_max),
        "scale": per_channel(grid.scale),
        "zero_point": per_channel(grid.zero_point),
        "clipped_below": share(below_c),
        "clipped_above": share(above_c),
        "clipped": share(below_c + above_c),
        "gradient_mass": mass_c if g is not None else nan,
        "gradient_blocked": blocked_share if g is not None else nan,
        "backprop_wrt_min": per_channel(dmin),
        "backprop_wrt_max": per_channel(dmax),
        "mse": mse,
        "sqnr_db": sqnr_db(signal, err_now),
        "suggested_percentile": np.where(usable, sug_p, np.nan) if candidates else nan,
        "suggested_min": np.where(usable, sug_lo, np.nan) if candidates else nan,
        "suggested_max": np.where(usable, sug_hi, np.nan) if candidates else nan,
        "suggested_mse": np.where(usable, sug_mse, np.nan),
        "suggested_sqnr_db": np.where(usable, sqnr_db(signal, sug_err), np.nan) if candidates else nan,
        "suggested_clipped": share(s_below + s_above) if s_below is not None else nan,
        "suggested_gradient_blocked": (
            np.where(mass_c > 0, s_blocked / np.where(mass_c > 0, mass_c, 1.0), 0.0)
            if s_blocked is not None and g is not None else nan
        ),
        "suggested_scale": per_channel(getattr(suggested_grid, "scale", None)),
        "suggested_zero_point": per_channel(getattr(suggested_grid, "zero_point", None)),
    }
    n_all = rows * depth
    finite_all = float(finite_n.sum())
    mass_all = float(mass_c.sum())

    def whole(a):
        return float(a.sum()) / n_all if n_all else 0.0

    total = {
        "elements": n_all,
        "channels": depth,
        "nonfinite": int(n_all - finite_all),
        "clipped_below": whole(below_c),
        "clipped_above": whole(above_c),
        "clipped": whole(below_c + above_c),
        "gradient_mass": mass_all if g is not None else None,
        "gradient_blocked": (float(blocked_c.sum()) / mass_all if mass_all else 0.0) if g is not None else None,
        "mse": float(err_now.sum()) / finite_all if finite_all else None,
        "sqnr_db": float(sqnr_db(signal.sum(), err_now.sum())),
        "suggested_mse": float(sug_err.sum()) / finite_all if candidates and usable.all() and finite_all else None,
        "suggested_sqnr_db": float(sqnr_db(signal.sum(), sug_err.sum())) if candidates and usable.all() else None,
        "suggested_clipped": whole(s_below + s_above) if s_below is not None else None,
        "suggested_gradient_blocked": (
            (float(s_blocked.sum()) / mass_all if mass_all else 0.0) if s_blocked is not None and g is not None
            else None
        ),
    }
    total = {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in total.items()}
    return ChannelReport(variant=variant, axis=axis, grid=grid, suggested_grid=suggested_grid,
                         percentiles=tuple(float(p) for p in percentiles), has_gradients=g is not None,
                         columns=columns, total=total)
