"""CuPy kernels for the fake-quant ops: one fused pass each, TF-exact.

The element-wise chain is TensorFlow's, operation for operation, with explicitly rounded intrinsics
(``__fadd_rn``/``__fsub_rn``/``__fmul_rn``/``__fdiv_rn``) so the compiler cannot contract ``a * b + c`` into
an FMA, and the module is also compiled with ``--fmad=false``.  TF's CPU kernels run with FTZ/DAZ; the
kernels flush inputs explicitly where it matters, exactly as the NumPy path does.

``backprop_wrt_min/max`` keep Eigen's summation order: one thread per (leaf, accumulator slot, channel)
sums its slot sequentially, one thread per (leaf, channel) folds the slots, leftover packets and tail as
Eigen does, and the host adds the few leaf sums along the reduction plan (:mod:`qgcli.ops.reduction`).

The device functions in ``DEVICE_SOURCE`` are plain C: the test suite compiles them with the host C
compiler (with shims for the intrinsics) and checks them against TensorFlow's golden cases, so the GPU
arithmetic is verified even on machines without a GPU.
"""
import numpy as np

from qgcli.ops import reduction

DEVICE_SOURCE = r"""
#define QG_TINY 1.17549435e-38f

__device__ __forceinline__ float qg_flush(float v) {
    return fabsf(v) < QG_TINY ? copysignf(0.0f, v) : v;
}

/* TF: floor(((min(max(x, nmin), nmax) - nmin) * inv_scale - quant_zero) + 0.5) * scale ; Vars divides. */
__device__ __forceinline__ float qg_fq_forward_one(float x, float nmin, float nmax, float scale, float inv,
                                                   float qz, int divide, int flush, int passthrough) {
    if (passthrough) return 0.0f;
    float v = (nmax < x) ? nmax : x;      /* Eigen cwiseMin: a NaN input stays NaN */
    v = (v < nmin) ? nmin : v;            /* Eigen cwiseMax */
    if (flush) v = qg_flush(v);
    v = __fsub_rn(v, nmin);
    v = divide ? __fdiv_rn(v, scale) : __fmul_rn(v, inv);
    v = __fsub_rn(v, qz);
    v = __fadd_rn(v, 0.5f);
    v = floorf(v);
    return __fmul_rn(v, scale);
}

/* g * (lo <= x <= hi), the gradient copied untouched on min == max == 0 channels. */
__device__ __forceinline__ float qg_dx_one(float g, float x, float lo, float hi, int passthrough) {
    if (passthrough) return g;
    return __fmul_rn(qg_flush(g), (x >= lo && x <= hi) ? 1.0f : 0.0f);
}

__device__ __forceinline__ float qg_below(float g, float x, float lo) {
    return __fmul_rn(qg_flush(g), (x < lo) ? 1.0f : 0.0f);
}

__device__ __forceinline__ float qg_above(float g, float x, float hi) {
    return __fmul_rn(qg_flush(g), (x > hi) ? 1.0f : 0.0f);
}

/* Sequential sum of one accumulator slot (8 * q + lane) over the 32-value blocks of a leaf body. */
__device__ void qg_slot_sums(const float* g, const float* x, long long depth, long long start, long long body,
                             int slot, long long c, float lo, float hi, float* out_min, float* out_max) {
    float acc_min = 0.0f, acc_max = 0.0f;
    for (long long j = slot; j < body; j += 32) {
        long long k = (start + j) * depth + c;
        acc_min = __fadd_rn(acc_min, qg_below(g[k], x[k], lo));
        acc_max = __fadd_rn(acc_max, qg_above(g[k], x[k], hi));
    }
    *out_min = acc_min;
    *out_max = acc_max;
}

/* Eigen's packet reduction of one leaf, given its 32 slot sums (slots[slot * slot_stride]). */
__device__ float qg_leaf_finish(const float* slots, long long slot_stride, const float* g, const float* x,
                                long long depth, long long start, long long length, long long c,
                                float bound, int below) {
    float p0[8];
    long long body = length / 32 * 32, whole = length / 8 * 8;
    for (int l = 0; l < 8; ++l) {
        if (body > 0) {
            float a = __fadd_rn(slots[l * slot_stride], slots[(8 + l) * slot_stride]);
            a = __fadd_rn(a, slots[(16 + l) * slot_stride]);
            p0[l] = __fadd_rn(a, slots[(24 + l) * slot_stride]);
        } else {
            p0[l] = 0.0f;
        }
    }
    for (long long j = body; j < whole; ++j) {
        long long k = (start + j) * depth + c;
        float v = below ? qg_below(g[k], x[k], bound) : qg_above(g[k], x[k], bound);
        p0[j & 7] = __fadd_rn(p0[j & 7], v);
    }
    float tail = 0.0f;
    for (long long j = whole; j < length; ++j) {
        long long k = (start + j) * depth + c;
        tail = __fadd_rn(tail, below ? qg_below(g[k], x[k], bound) : qg_above(g[k], x[k], bound));
    }
    float h0 = __fadd_rn(p0[0], p0[4]), h1 = __fadd_rn(p0[1], p0[5]);
    float h2 = __fadd_rn(p0[2], p0[6]), h3 = __fadd_rn(p0[3], p0[7]);
    return __fadd_rn(tail, __fadd_rn(__fadd_rn(h0, h2), __fadd_rn(h1, h3)));
}
"""

# One function per kernel, called once per index: the GPU wraps them in grid-stride loops, the CPU test
# harness in plain loops.  (name, C parameter list, call arguments)
KERNELS = (
    ("qg_fq_forward",
     "const float* x, float* out, long long depth, const float* nmin, const float* nmax, const float* scale, "
     "const float* inv, const float* qz, const unsigned char* passthrough, int divide, int flush",
     "x, out, depth, nmin, nmax, scale, inv, qz, passthrough, divide, flush"),
    ("qg_fq_dx",
     "const float* g, const float* x, float* dx, long long depth, const float* lo, const float* hi, "
     "const unsigned char* passthrough",
     "g, x, dx, depth, lo, hi, passthrough"),
    ("qg_fq_slots",
     "const float* g, const float* x, long long depth, const long long* starts, const long long* lengths, "
     "const float* lo, const float* hi, float* slots_min, float* slots_max",
     "g, x, depth, starts, lengths, lo, hi, slots_min, slots_max"),
    ("qg_fq_leaves",
     "const float* g, const float* x, long long depth, const long long* starts, const long long* lengths, "
     "const float* lo, const float* hi, const float* slots_min, const float* slots_max, float* sums_min, "
     "float* sums_max",
     "g, x, depth, starts, lengths, lo, hi, slots_min, slots_max, sums_min, sums_max"),
)

DEVICE_SOURCE += r"""
__device__ __forceinline__ void qg_fq_forward_at(long long i, const float* x, float* out, long long depth,
        const float* nmin, const float* nmax, const float* scale, const float* inv, const float* qz,
        const unsigned char* passthrough, int divide, int flush) {
    long long c = i % depth;
    out[i] = qg_fq_forward_one(x[i], nmin[c], nmax[c], scale[c], inv[c], qz[c], divide, flush, passthrough[c]);
}

__device__ __forceinline__ void qg_fq_dx_at(long long i, const float* g, const float* x, float* dx,
        long long depth, const float* lo, const float* hi, const unsigned char* passthrough) {
    long long c = i % depth;
    dx[i] = qg_dx_one(g[i], x[i], lo[c], hi[c], passthrough[c]);
}

/* t indexes [leaves, 32, depth]: one thread per (leaf, accumulator slot, channel). */
__device__ __forceinline__ void qg_fq_slots_at(long long t, const float* g, const float* x, long long depth,
        const long long* starts, const long long* lengths, const float* lo, const float* hi,
        float* slots_min, float* slots_max) {
    long long c = t % depth, slot = (t / depth) % 32, leaf = t / (32 * depth);
    qg_slot_sums(g, x, depth, starts[leaf], lengths[leaf] / 32 * 32, (int)slot, c, lo[c], hi[c],
                 slots_min + t, slots_max + t);
}

/* t indexes [leaves, depth]. */
__device__ __forceinline__ void qg_fq_leaves_at(long long t, const float* g, const float* x, long long depth,
        const long long* starts, const long long* lengths, const float* lo, const float* hi,
        const float* slots_min, const float* slots_max, float* sums_min, float* sums_max) {
    long long c = t % depth, leaf = t / depth;
    long long base = leaf * 32 * depth + c;
    sums_min[t] = qg_leaf_finish(slots_min + base, depth, g, x, depth, starts[leaf], lengths[leaf], c, lo[c], 1);
    sums_max[t] = qg_leaf_finish(slots_max + base, depth, g, x, depth, starts[leaf], lengths[leaf], c, hi[c], 0);
}
"""

KERNEL_SOURCE = DEVICE_SOURCE + "".join(
    f"""
extern "C" __global__ void {name}(long long n, {params}) {{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)blockDim.x * gridDim.x)
        {name}_at(i, {args});
}}
"""
    for name, params, args in KERNELS
)


class CupyLauncher:
    """Runs the kernels on the current CUDA device."""

    def __init__(self):
        import cupy

        self.xp = cupy

    def __call__(self, name, n, *args):
        threads = 256
        blocks = int(max(1, min(-(-n // threads), 65535 * 8)))
        _kernels().get_function(name)((blocks,), (threads,), (np.int64(n), *args))

    def to_host(self, a):
        return a.get()


_module = None


def _kernels():  # compiled once per process, on first use
    global _module
    if _module is None:
        import cupy

        _module = cupy.RawModule(code=KERNEL_SOURCE, options=("--fmad=false", "-std=c++14"))
    return _module


def _per_channel(values, depth, xp, dtype=np.float32):
    return xp.asarray(np.broadcast_to(np.asarray(values, dtype), (depth,)).copy())


def quantize(x2, grid, divide, flush, launch=None):
    """Fake quantization of ``x2`` ([rows, depth] float32 on the device) on ``grid``."""
    launch = launch or CupyLauncher()
    xp = launch.xp
    rows, depth = x2.shape
    x2 = xp.ascontiguousarray(x2)
    out = xp.empty_like(x2)
    params = [_per_channel(getattr(grid, n), depth, xp)
              for n in ("nudged_min", "nudged_max", "scale", "inv_scale", "quant_zero")]
    passthrough = _per_channel(grid.passthrough, depth, xp, np.uint8)
    if x2.size:
        launch("qg_fq_forward", x2.size, x2, out, np.int64(depth), *params, passthrough,
               np.int32(divide), np.int32(flush))
    return out


def backprops(g2, x2, grid, *, reduce, kind, launch=None):
    """``(dx, dmin, dmax)`` (or ``dx``) for ``g2``/``x2`` ([rows, depth] float32 on the device) on ``grid``."""
    launch = launch or CupyLauncher()
    xp = launch.xp
    rows, depth = x2.shape
    g2, x2 = xp.ascontiguousarray(g2), xp.ascontiguousarray(x2)
    lo_h, hi_h = grid.mask_bounds()
    lo, hi = _per_channel(lo_h, depth, xp), _per_channel(hi_h, depth, xp)
    passthrough = _per_channel(grid.passthrough, depth, xp, np.uint8)
    dx = xp.empty_like(g2)
    if g2.size:
        launch("qg_fq_dx", g2.size, g2, x2, dx, np.int64(depth), lo, hi, passthrough)
    if not reduce:
        return dx
    if rows == 0:
        return dx, xp.zeros(depth, np.float32), xp.zeros(depth, np.float32)
    plan = reduction.plan(rows, kind=kind)
    starts = xp.asarray(np.array([s for s, _ in plan.leaves], np.int64))
    lengths = xp.asarray(np.array([n for _, n in plan.leaves], np.int64))
    leaves = len(plan.leaves)
    slots_min = xp.empty((leaves, 32, depth), np.float32)
    slots_max = xp.empty_like(slots_min)
    launch("qg_fq_slots", leaves * 32 * depth, g2, x2, np.int64(depth), starts, lengths, lo, hi,
           slots_min, slots_max)
    sums_min = xp.empty((leaves, depth), np.float32)
    sums_max = xp.empty_like(sums_min)
    launch("qg_fq_leaves", leaves * depth, g2, x2, np.int64(depth), starts, lengths, lo, hi,
           slots_min, slots_max, sums_min, sums_max)
    # The leaf sums are few: add them on the host along Eigen's tree/shard recipe.
    dmin = reduction.combine(plan, launch.to_host(sums_min), np).astype(np.float32)
    dmax = reduction.combine(plan, launch.to_host(sums_max), np).astype(np.float32)
    if grid.passthrough.any():
        dmin = np.where(grid.passthrough, np.float32(0), dmin)
        dmax = np.where(grid.passthrough, np.float32(0), dmax)
    return dx, xp.asarray(dmin), xp.asarray(dmax)
