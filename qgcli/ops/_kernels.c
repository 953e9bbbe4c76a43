/* Compiled CPU kernels for qgcli (optional: without them the NumPy path in blocked.py runs, same bits).
 *
 * Plain C functions called through ctypes (which releases the GIL, so Python's thread pool keeps both
 * cores busy).  Each call handles one block of rows in a single pass: the fake-quant gradient writes
 * backprops_wrt_input *and* accumulates Eigen's packet sums of the below/above products while the block is
 * in cache.  The arithmetic is TensorFlow's operation for operation in float32 (tf_semantics.md §1),
 * compiled with -ffp-contract=off so no a * b + c becomes an FMA.  On x86-64 the file is built twice,
 * for baseline x86-64 and with -mavx2 (the loader picks the one the CPU runs): the same bits, but only
 * AVX2's roundps and wider vectors keep the forward pass at memory speed.  The module init at the end
 * only exists so setuptools can build this as an extension; Python never imports it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QG_TINY 1.17549435e-38f           /* the smallest normal float32 */
#define QG_MAX_SUBNORMAL 0x1.fffffcp-127f /* the largest subnormal float32 */
#define QG_INTEGRAL 8388608.0f            /* 2**23: every float32 at or above it is an integer */

/* x86 FTZ/DAZ, as TF's threads run: a subnormal becomes a zero of the same sign. */
static inline float qg_flush(float v) { return fabsf(v) < QG_TINY ? copysignf(0.0f, v) : v; }

/* floorf as one instruction where the target has SSE4.1's roundps; otherwise the same value without a
 * libm call (an exact trunc-and-correct), so the loops still vectorize on baseline x86-64. */
static inline float qg_floor(float v) {
#if defined(__SSE4_1__) || !defined(__x86_64__)
    return floorf(v);
#else
    int small = fabsf(v) < QG_INTEGRAL; /* larger floats, infinities and NaN are their own floor */
    float c = small ? v : 0.0f;
    float t = (float)(int32_t)c;
    t = t > c ? t - 1.0f : t;
    return small ? copysignf(t, v) : v;
#endif
}

/* TF: floor(((clamp(x) - nudged_min) * inv_scale - quant_zero) + 0.5) * scale; Vars divides by scale. */
static inline float qg_forward(float x, float nmin, float nmax, float scale, float inv, float qz,
                               float passthrough, int divide, int flush) {
    float v = (nmax < x) ? nmax : x; /* Eigen cwiseMin: a NaN input stays NaN */
    v = (v < nmin) ? nmin : v;       /* cwiseMax */
    if (flush) v = qg_flush(v);
    v = v - nmin;
    v = divide ? v / scale : v * inv;
    v = qg_floor((v - qz) + 0.5f) * scale;
    return passthrough != 0.0f ? 0.0f : v;
}

/* The loops with `divide`, `flush` and `pt` (some channel is 0..0) constant, so each variant vectorizes
 * without branches (and without a passthrough blend where no channel needs one).  out may be x itself (the
 * outputs written over the inputs): neither is restrict, each x[k] is read before out[k] is written, and
 * ivdep spares the vectoriser a run-time overlap check (as in qg_backprop_rows below). */
static inline __attribute__((always_inline)) void qg_quantize_rows(
    const float *x, float *out, int64_t rows, int64_t depth, const float *restrict nmin,
    const float *restrict nmax, const float *restrict scale, const float *restrict inv,
    const float *restrict qz, const float *restrict passthrough, const int divide, const int flush, const int pt) {
    if (depth == 1) {
        float a = nmin[0], b = nmax[0], s = scale[0], i = inv[0], q = qz[0], p = passthrough[0];
#pragma GCC ivdep
        for (int64_t k = 0; k < rows; ++k) out[k] = qg_forward(x[k], a, b, s, i, q, p, divide, flush);
        return;
    }
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * depth;
        float *orow = out + r * depth;
#pragma GCC ivdep
        for (int64_t c = 0; c < depth; ++c)
            orow[c] = qg_forward(xr[c], nmin[c], nmax[c], scale[c], inv[c], qz[c], pt ? passthrough[c] : 0.0f,
                                 divide, flush);
    }
}

/* Whether any of the n values is not 0 (a passthrough row holding a 1.0: some channel is 0..0). */
static inline int qg_any(const float *restrict v, int64_t n) {
    int any = 0;
    for (int64_t k = 0; k < n; ++k) any |= v[k] != 0.0f;
    return any;
}

/* params: [6][depth] rows nudged_min, nudged_max, scale, inv_scale, quant_zero, passthrough (1.0 or 0.0);
 * out may be x. */
void qg_quantize(const float *x, float *out, int64_t rows, int64_t depth,
                 const float *restrict params, int divide, int flush) {
    const float *nmin = params, *nmax = params + depth, *scale = params + 2 * depth, *inv = params + 3 * depth,
                *qz = params + 4 * depth, *passthrough = params + 5 * depth;
#define QG_Q(d, fl, p) qg_quantize_rows(x, out, rows, depth, nmin, nmax, scale, inv, qz, passthrough, d, fl, p)
#define QG_MODES(p)                    \
    if (divide && flush) QG_Q(1, 1, p); \
    else if (divide) QG_Q(1, 0, p);     \
    else if (flush) QG_Q(0, 1, p);      \
    else QG_Q(0, 0, p);
    if (depth > 1 && qg_any(passthrough, depth)) {
        QG_MODES(1)
    } else {
        QG_MODES(0)
    }
#undef QG_MODES
#undef QG_Q
}

/* TF's Nudge() of n ranges in float32 under FTZ/DAZ (the NumPy version: fake_quant.nudge).  out: [11][n]
 * rows min, max (flushed), scale, inv_scale, zero_point_from_min, zero_point, nudged_min, nudged_max,
 * quant_zero, and the gradient mask's bounds: a nudged bound of 0 moved out by one subnormal, so that
 * lo <= x <= hi equals TF's nudged_min <= flush(x) <= nudged_max. */
void qg_nudge(const float *restrict min, const float *restrict max, int64_t n, float quant_min, float quant_max,
              float *restrict out) {
    float levels = quant_max - quant_min;
    for (int64_t i = 0; i < n; ++i) {
        float mn = qg_flush(min[i]), mx = qg_flush(max[i]);
        float width = qg_flush(mx - mn);
        float scale = qg_flush(width / levels), inv = qg_flush(levels / width);
        float zp_from_min = qg_flush(quant_min - qg_flush(mn / scale));
        /* std::round of a value >= quant_min >= 0 is floor(v + 0.5), exact in double; clamping the rounded
         * value equals TF's clamp-then-round since the bounds are integers; NaN (0 / 0) becomes 0. */
        double zp = floor((double)zp_from_min + 0.5);
        zp = zp < quant_min ? quant_min : zp;
        zp = zp > quant_max ? quant_max : zp;
        float zero_point = zp == zp ? (float)zp : 0.0f;
        float nudged_min = qg_flush((quant_min - zero_point) * scale);
        float nudged_max = qg_flush((quant_max - zero_point) * scale);
        float values[11] = {mn, mx, scale, inv, zp_from_min, zero_point, nudged_min, nudged_max,
                            qg_floor(qg_flush(qg_flush(-nudged_min * inv) + 0.5f)),
                            nudged_min == 0.0f ? -QG_MAX_SUBNORMAL : nudged_min,
                            nudged_max == 0.0f ? QG_MAX_SUBNORMAL : nudged_max};
        for (int k = 0; k < 11; ++k) out[k * n + i] = values[k];
    }
}

/* g * (lo <= x <= hi) as a product (g * 0 keeps -0.0 and NaN, as TF); min == max == 0 channels copy g. */
static inline float qg_dx(float g, float x, float lo, float hi, float passthrough) {
    float v = qg_flush(g) * ((x >= lo && x <= hi) ? 1.0f : 0.0f);
    return passthrough != 0.0f ? g : v;
}

static inline float qg_below(float g, float x, float lo) { return qg_flush(g) * ((x < lo) ? 1.0f : 0.0f); }
static inline float qg_above(float g, float x, float hi) { return qg_flush(g) * ((x > hi) ? 1.0f : 0.0f); }

/* bounds: [3][depth] rows lo, hi (the DAZ-adjusted mask bounds) and passthrough (1.0 or 0.0).
 * In this function and the leaf functions below, dx may be g itself (the gradient written into its own
 * buffer, one allocation and 100 MB of page faults fewer end to end): g and dx are not restrict, each value of
 * g is read once, into a local, before dx at the same place is written, and ivdep tells the vectoriser that
 * no iteration reads what another writes (without it, gcc would check for overlap at run time and run the
 * aliased case scalar). */
/* The forward's parameters ([6][depth] rows as qg_quantize takes them) with `divide` and `flush` constant:
 * the fused kernels below write the forward's outputs in the same pass as the gradient (`fwd` 1), or not
 * (`fwd` 0: the gradient alone, the forward's code compiled away). */
typedef struct {
    const float *nmin, *nmax, *scale, *inv, *qz, *passthrough;
} qg_fparams;

static inline qg_fparams qg_fparams_of(const float *params, int64_t depth) {
    qg_fparams f = {params, params + depth, params + 2 * depth, params + 3 * depth, params + 4 * depth,
                    params + 5 * depth};
    return f;
}

#define QG_FWD(xv, c) qg_forward(xv, f.nmin[c], f.nmax[c], f.scale[c], f.inv[c], f.qz[c], f.passthrough[c], \
                                 divide, flush)
/* one value per row: the parameters held in locals (f1 = qg_scalars(f)), out of the loops */
typedef struct {
    float nmin, nmax, scale, inv, qz, passthrough;
} qg_fscalars;
static inline qg_fscalars qg_scalars(qg_fparams f, const int fwd) {
    qg_fscalars v = {0};
    if (fwd) v = (qg_fscalars){f.nmin[0], f.nmax[0], f.scale[0], f.inv[0], f.qz[0], f.passthrough[0]};
    return v;
}
#define QG_FWD1(xv) qg_forward(xv, f1.nmin, f1.nmax, f1.scale, f1.inv, f1.qz, f1.passthrough, divide, flush)

static inline __attribute__((always_inline)) void qg_backprop_rows(
    const float *g, const float *restrict x, float *dx, float *restrict out, int64_t rows, int64_t depth,
    const float *restrict bounds, qg_fparams f, const int fwd, const int divide, const int flush) {
    const float *lo = bounds, *hi = bounds + depth, *passthrough = bounds + 2 * depth;
    if (depth == 1) {
        const qg_fscalars f1 = qg_scalars(f, fwd);
#pragma GCC ivdep
        for (int64_t k = 0; k < rows; ++k) {
            float gv = g[k], xv = x[k];
            if (fwd) out[k] = QG_FWD1(xv);
            dx[k] = qg_dx(gv, xv, lo[0], hi[0], passthrough[0]);
        }
        return;
    }
    for (int64_t r = 0; r < rows; ++r) {
        const float *gr = g + r * depth, *xr = x + r * depth;
        float *dr = dx + r * depth, *restrict orow = fwd ? out + r * depth : NULL;
#pragma GCC ivdep
        for (int64_t c = 0; c < depth; ++c) {
            float gv = gr[c], xv = xr[c];
            if (fwd) orow[c] = QG_FWD(xv, c);
            dr[c] = qg_dx(gv, xv, lo[c], hi[c], passthrough[c]);
        }
    }
}

void qg_backprop(const float *g, const float *restrict x, float *dx, int64_t rows, int64_t depth,
                 const float *restrict bounds) {
    qg_fparams none = {0};
    qg_backprop_rows(g, x, dx, NULL, rows, depth, bounds, none, 0, 0, 0);
}

/* Eigen's end of a leaf: p0 = ((acc0 + acc1) + acc2) + acc3 lane by lane (0 without a 32-value body),
 * leftover whole packets added to p0, the scalar tail summed alone, then
 * tail + (((p0[0] + p0[4]) + (p0[2] + p0[6])) + ((p0[1] + p0[5]) + (p0[3] + p0[7]))). */
static inline float qg_leaf_total(const float *restrict p0, float tail) {
    float h0 = p0[0] + p0[4], h1 = p0[1] + p0[5], h2 = p0[2] + p0[6], h3 = p0[3] + p0[7];
    return tail + ((h0 + h2) + (h1 + h3));
}

/* One value per row (per-tensor gradient, or a single channel): a leaf is `length` consecutive values. */
static inline __attribute__((always_inline)) void qg_leaf_flat(
    const float *g, const float *restrict x, float *dx, float *restrict out, int64_t length, float lo, float hi,
    float passthrough, float *restrict sum_min, float *restrict sum_max, qg_fparams f, const int fwd,
    const int divide, const int flush) {
    float acc_min[32] = {0}, acc_max[32] = {0};
    int64_t body = length / 32 * 32, whole = length / 8 * 8;
    const qg_fscalars f1 = qg_scalars(f, fwd);
    for (int64_t j = 0; j < body; j += 32)
#pragma GCC ivdep
        for (int s = 0; s < 32; ++s) {
            float gv = g[j + s], xv = x[j + s];
            if (fwd) out[j + s] = QG_FWD1(xv);
            dx[j + s] = qg_dx(gv, xv, lo, hi, passthrough);
            acc_min[s] += qg_below(gv, xv, lo);
            acc_max[s] += qg_above(gv, xv, hi);
        }
    float p_min[8], p_max[8];
    for (int l = 0; l < 8; ++l) {
        p_min[l] = body ? ((acc_min[l] + acc_min[8 + l]) + acc_min[16 + l]) + acc_min[24 + l] : 0.0f;
        p_max[l] = body ? ((acc_max[l] + acc_max[8 + l]) + acc_max[16 + l]) + acc_max[24 + l] : 0.0f;
    }
    float t_min = 0.0f, t_max = 0.0f;
    for (int64_t j = body; j < length; ++j) {
        float gv = g[j], xv = x[j];
        if (fwd) out[j] = QG_FWD1(xv);
        dx[j] = qg_dx(gv, xv, lo, hi, passthrough);
        float b = qg_below(gv, xv, lo), a = qg_above(gv, xv, hi);
        if (j < whole) {
            p_min[j & 7] += b;
            p_max[j & 7] += a;
        } else {
            t_min += b;
            t_max += a;
        }
    }
    *sum_min = qg_leaf_total(p_min, t_min);
    *sum_max = qg_leaf_total(p_max, t_max);
}

#ifdef __AVX2__
#include <immintrin.h>
/* One row of the column leaves 8 channels at a time, written out in AVX2 (GCC's own vectorisation of the
 * loop below reloads the bounds after each store and keeps a passthrough blend every channel pays for): the
 * operations of qg_dx, qg_below, qg_above and qg_forward on each lane, each value the same bits.  The blends
 * take g * 1 as g and g * 0 as fg * 0, as GCC compiles those products (-fno-signaling-nans: a NaN stays a
 * NaN).  Returns the channels done (a multiple of 8); the caller does the rest. */
static inline __attribute__((always_inline)) int64_t qg_row_avx2(
    const float *g, const float *restrict x, float *dx, float *restrict out, int64_t depth,
    const float *restrict lo, const float *restrict hi, const float *restrict passthrough, float *restrict am,
    float *restrict ax, qg_fparams f, const int fwd, const int divide, const int flush, const int pt) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 signmask = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    const __m256 tiny = _mm256_set1_ps(QG_TINY), zero = _mm256_setzero_ps(), half = _mm256_set1_ps(0.5f);
    int64_t c = 0;
    for (; c + 8 <= depth; c += 8) {
        const __m256 gv = _mm256_loadu_ps(g + c), xv = _mm256_loadu_ps(x + c);
        const __m256 l = _mm256_loadu_ps(lo + c), h = _mm256_loadu_ps(hi + c);
        if (fwd) {
            __m256 v = _mm256_min_ps(_mm256_loadu_ps(f.nmax + c), xv); /* (nmax < x) ? nmax : x */
            const __m256 nmin = _mm256_loadu_ps(f.nmin + c);
            v = _mm256_max_ps(nmin, v); /* (v < nmin) ? nmin : v */
            if (flush) {
                __m256 small = _mm256_cmp_ps(_mm256_and_ps(v, absmask), tiny, _CMP_LT_OQ);
                v = _mm256_blendv_ps(v, _mm256_and_ps(v, signmask), small);
            }
            v = _mm256_sub_ps(v, nmin);
            v = divide ? _mm256_div_ps(v, _mm256_loadu_ps(f.scale + c)) : _mm256_mul_ps(v, _mm256_loadu_ps(f.inv + c));
            v = _mm256_add_ps(_mm256_sub_ps(v, _mm256_loadu_ps(f.qz + c)), half);
            v = _mm256_round_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
            v = _mm256_mul_ps(v, _mm256_loadu_ps(f.scale + c));
            if (pt) v = _mm256_and_ps(v, _mm256_cmp_ps(_mm256_loadu_ps(f.passthrough + c), zero, _CMP_EQ_OQ));
            _mm256_storeu_ps(out + c, v);
        }
        const __m256 small = _mm256_cmp_ps(_mm256_and_ps(gv, absmask), tiny, _CMP_LT_OQ);
        const __m256 fg = _mm256_blendv_ps(gv, _mm256_and_ps(gv, signmask), small); /* qg_flush(g) */
        const __m256 z = _mm256_mul_ps(fg, zero);                                   /* fg * 0 */
        const __m256 below = _mm256_cmp_ps(xv, l, _CMP_LT_OQ), above = _mm256_cmp_ps(xv, h, _CMP_GT_OQ);
        const __m256 inside = _mm256_and_ps(_mm256_cmp_ps(xv, l, _CMP_GE_OQ), _mm256_cmp_ps(xv, h, _CMP_LE_OQ));
        __m256 d = _mm256_blendv_ps(z, fg, inside);
        if (pt) d = _mm256_blendv_ps(d, gv, _mm256_cmp_ps(_mm256_loadu_ps(passthrough + c), zero, _CMP_NEQ_UQ));
        _mm256_storeu_ps(dx + c, d);
        _mm256_storeu_ps(am + c, _mm256_add_ps(_mm256_loadu_ps(am + c), _mm256_blendv_ps(z, fg, below)));
        _mm256_storeu_ps(ax + c, _mm256_add_ps(_mm256_loadu_ps(ax + c), _mm256_blendv_ps(z, fg, above)));
    }
    return c;
}
#define QG_ROW(gr, xr, dr, orow, am, ax) \
    qg_row_avx2(gr, xr, dr, orow, depth, lo, hi, passthrough, am, ax, f, fwd, divide, flush, pt)
#else
#define QG_ROW(gr, xr, dr, orow, am, ax) ((int64_t)0)
#endif

/* Rows of `depth` channels: the same packet sums, down each column.  `acc` holds 2 * 41 * depth floats. */
static inline __attribute__((always_inline)) void qg_leaf_columns(
    const float *g, const float *restrict x, float *dx, float *restrict out, int64_t length, int64_t depth,
    const float *restrict lo, const float *restrict hi, const float *restrict passthrough, float *restrict acc,
    float *restrict sums_min, float *restrict sums_max, qg_fparams f, const int fwd, const int divide,
    const int flush, const int pt) {
    float *restrict acc_min = acc, *acc_max = acc + 32 * depth;           /* [32][depth] each */
    float *restrict p_min = acc + 64 * depth, *p_max = acc + 72 * depth;  /* [8][depth] each */
    float *restrict t_min = acc + 80 * depth, *t_max = acc + 81 * depth;  /* [depth] each */
    int64_t body = length / 32 * 32, whole = length / 8 * 8;
    memset(acc, 0, sizeof(float) * 82 * (size_t)depth);
    for (int64_t j = 0; j < body; ++j) {
        const float *gr = g + j * depth, *restrict xr = x + j * depth;
        float *dr = dx + j * depth, *am = acc_min + (j & 31) * depth, *ax = acc_max + (j & 31) * depth;
        float *restrict orow = fwd ? out + j * depth : NULL;
        int64_t c0 = QG_ROW(gr, xr, dr, orow, am, ax);
#pragma GCC ivdep
        for (int64_t c = c0; c < depth; ++c) {
            float gv = gr[c], xv = xr[c];
            if (fwd) orow[c] = QG_FWD(xv, c);
            dr[c] = qg_dx(gv, xv, lo[c], hi[c], passthrough[c]);
            am[c] += qg_below(gv, xv, lo[c]);
            ax[c] += qg_above(gv, xv, hi[c]);
        }
    }
    if (body)
        for (int l = 0; l < 8; ++l)
            for (int64_t c = 0; c < depth; ++c) {
                const float *restrict m = acc_min + c, *a = acc_max + c;
                int64_t q0 = l * depth, q1 = (8 + l) * depth, q2 = (16 + l) * depth, q3 = (24 + l) * depth;
                p_min[l * depth + c] = ((m[q0] + m[q1]) + m[q2]) + m[q3];
                p_max[l * depth + c] = ((a[q0] + a[q1]) + a[q2]) + a[q3];
            }
    for (int64_t j = body; j < length; ++j) {
        const float *gr = g + j * depth, *restrict xr = x + j * depth;
        float *dr = dx + j * depth, *restrict orow = fwd ? out + j * depth : NULL;
        float *restrict pm = j < whole ? p_min + (j & 7) * depth : t_min;
        float *restrict pa = j < whole ? p_max + (j & 7) * depth : t_max;
        int64_t c0 = QG_ROW(gr, xr, dr, orow, pm, pa);
#pragma GCC ivdep
        for (int64_t c = c0; c < depth; ++c) {
            float gv = gr[c], xv = xr[c];
            if (fwd) orow[c] = QG_FWD(xv, c);
            dr[c] = qg_dx(gv, xv, lo[c], hi[c], passthrough[c]);
            pm[c] += qg_below(gv, xv, lo[c]);
            pa[c] += qg_above(gv, xv, hi[c]);
        }
    }
    for (int64_t c = 0; c < depth; ++c) {
        float lanes_min[8], lanes_max[8];
        for (int l = 0; l < 8; ++l) {
            lanes_min[l] = p_min[l * depth + c];
            lanes_max[l] = p_max[l * depth + c];
        }
        sums_min[c] = qg_leaf_total(lanes_min, t_min[c]);
        sums_max[c] = qg_leaf_total(lanes_max, t_max[c]);
    }
}

/* backprops_wrt_input for the rows of `n_leaves` consecutive leaves (lengths in rows) starting at g/x/dx,
 * and each leaf's Eigen sums of the below/above products into sums ([2][n_leaves][depth]); bounds as in
 * qg_backprop (dx may be g).
 * Returns 0, or -1 when scratch memory could not be allocated. */
static inline __attribute__((always_inline)) int qg_leaves(
    const float *g, const float *restrict x, float *dx, float *restrict out, int64_t depth, int64_t n_leaves,
    const int64_t *restrict lengths, const float *restrict bounds, float *restrict sums, qg_fparams f,
    const int fwd, const int divide, const int flush) {
    const int pt = depth > 1 && qg_any(bounds + 2 * depth, depth); /* some channel is 0..0 */
    const float *lo = bounds, *hi = bounds + depth, *passthrough = bounds + 2 * depth;
    float *sums_min = sums, *sums_max = sums + n_leaves * depth;
    float *restrict acc = NULL;
    if (depth > 1 && !(acc = malloc(sizeof(float) * 82 * (size_t)depth))) return -1;
    for (int64_t i = 0; i < n_leaves; ++i) {
        if (depth == 1)
            qg_leaf_flat(g, x, dx, out, lengths[i], lo[0], hi[0], passthrough[0], sums_min + i, sums_max + i, f,
                         fwd, divide, flush);
        else
            qg_leaf_columns(g, x, dx, out, lengths[i], depth, lo, hi, passthrough, acc, sums_min + i * depth,
                            sums_max + i * depth, f, fwd, divide, flush, pt);
        g += lengths[i] * depth;
        x += lengths[i] * depth;
        dx += lengths[i] * depth;
        if (fwd) out += lengths[i] * depth;
    }
    free(acc);
    return 0;
}

int qg_backprop_leaves(const float *g, const float *restrict x, float *dx, int64_t depth,
                       int64_t n_leaves, const int64_t *restrict lengths, const float *restrict bounds,
                       float *restrict sums) {
    qg_fparams none = {0};
    return qg_leaves(g, x, dx, NULL, depth, n_leaves, lengths, bounds, sums, none, 0, 0, 0);
}

/* --- fused forward + gradient: one pass reads x and g and writes the forward's outputs, backprops_wrt_input
 * and (qg_fused_leaves) the leaf sums; each output the same bits as qg_quantize and qg_backprop(_leaves)
 * give apart.  params as in qg_quantize, bounds as in qg_backprop; dx may be g, out is an array of its own. */
#define QG_FUSED_MODES(call)                                      \
    if (divide && flush) return call(1, 1);                       \
    if (divide) return call(1, 0);                                \
    if (flush) return call(0, 1);                                 \
    return call(0, 0);

int qg_fused_leaves(const float *g, const float *restrict x, float *dx, float *restrict out, int64_t depth,
                    int64_t n_leaves, const int64_t *restrict lengths, const float *restrict params,
                    const float *restrict bounds, float *restrict sums, int divide, int flush) {
    qg_fparams f = qg_fparams_of(params, depth);
#define QG_CALL(d, fl) qg_leaves(g, x, dx, out, depth, n_leaves, lengths, bounds, sums, f, 1, d, fl)
    QG_FUSED_MODES(QG_CALL)
#undef QG_CALL
}

int qg_fused(const float *g, const float *restrict x, float *dx, float *restrict out, int64_t rows, int64_t depth,
             const float *restrict params, const float *restrict bounds, int divide, int flush) {
    qg_fparams f = qg_fparams_of(params, depth);
#define QG_CALL(d, fl) (qg_backprop_rows(g, x, dx, out, rows, depth, bounds, f, 1, d, fl), 0)
    QG_FUSED_MODES(QG_CALL)
#undef QG_CALL
}

/* Eigen's tree over leaf sums (reduction.combine): values is [rows][cols] float32, the leaf sums first and a
 * zero row last; each step (target, left, right), in the order given (by height), sets row target to
 * (0 + left) + right, each add rounded to float32 as NumPy's float32 arrays round it. */
void qg_combine(float *restrict values, int64_t cols, const int64_t *restrict steps, int64_t n_steps) {
    for (int64_t s = 0; s < n_steps; ++s) {
        float *t = values + steps[3 * s] * cols;
        const float *l = values + steps[3 * s + 1] * cols, *r = values + steps[3 * s + 2] * cols;
        for (int64_t c = 0; c < cols; ++c) t[c] = (0.0f + l[c]) + r[c];
    }
}

/* Summary statistics of a block ([rows][depth]; bounds as in qg_backprop; g may be NULL), added to
 * counts ([3][depth]: x below lo, x above hi, x NaN; none on passthrough channels) and mass ([2][depth]:
 * sum |g| over finite g, and the part of it where x is not inside [lo, hi]), in float64.
 * Columns go in tiles whose counts run in int32 lanes (8 to an AVX2 register, where int64 counters cost a
 * widening per value: 3.5x the time) and join the int64 totals once per tile and run of rows; each
 * float64 sum still adds its column's values row by row, so every figure is unchanged. */
#define QG_STAT_TILE 256
#define QG_STAT_ROWS ((int64_t)1 << 20) /* rows per int32 run: a column's counts stay below 2**31 */
void qg_clip_stats(const float *restrict x, const float *restrict g, int64_t rows, int64_t depth,
                   const float *restrict bounds, int64_t *restrict counts, double *restrict mass) {
    const float *lo = bounds, *hi = bounds + depth, *passthrough = bounds + 2 * depth;
    double *total = mass, *blocked = mass + depth;
    for (int64_t c0 = 0; c0 < depth; c0 += QG_STAT_TILE) {
        int64_t width = depth - c0 < QG_STAT_TILE ? depth - c0 : QG_STAT_TILE;
        for (int64_t r0 = 0; r0 < rows; r0 += QG_STAT_ROWS) {
            int64_t r1 = rows - r0 < QG_STAT_ROWS ? rows : r0 + QG_STAT_ROWS;
            int32_t below[QG_STAT_TILE] = {0}, above[QG_STAT_TILE] = {0}, nan[QG_STAT_TILE] = {0};
            for (int64_t r = r0; r < r1; ++r) {
                const float *restrict xr = x + r * depth + c0;
                for (int64_t k = 0; k < width; ++k) {
                    float v = xr[k];
                    int32_t keep = passthrough[c0 + k] == 0.0f;
                    below[k] += keep & (v < lo[c0 + k]);
                    above[k] += keep & (v > hi[c0 + k]);
                    nan[k] += v != v;
                }
                if (g) {
                    const float *restrict gr = g + r * depth + c0;
                    for (int64_t k = 0; k < width; ++k) {
                        float v = xr[k];
                        int keep = passthrough[c0 + k] == 0.0f;
                        double m = fabs((double)gr[k]);
                        m = m < INFINITY ? m : 0.0; /* NaN and infinities carry no mass */
                        total[c0 + k] += m;
                        blocked[c0 + k] += (keep && v >= lo[c0 + k] && v <= hi[c0 + k]) ? 0.0 : m;
                    }
                }
            }
            for (int64_t k = 0; k < width; ++k) {
                counts[c0 + k] += below[k];
                counts[depth + c0 + k] += above[k];
                counts[2 * depth + c0 + k] += nan[k];
            }
        }
    }
}

/* --- FusedBatchNormGrad on [A, C, B] float32 blocks (channels-last: B == 1), float64 arithmetic ------ */

/* qg_bn_sums' channels-last loop on AVX2 takes 16 channels at a time, their running sums kept in registers
 * across the rows (4 ymm each for sum(dy), sum(dy * xc) and the mean): GCC keeps neither a plain array of
 * sums in registers nor vectorizes it well.  Other builds run the plain loop, with the same bits. */
#ifdef __AVX2__
#include <immintrin.h>
#define QG_BN_CB 16
#endif

/* Adds this block's per-channel sum(dy) and sum(dy * (x - mean)) to sums[0] and sums[1] ([2][C]).  Each
 * channel's sums run over the rows in order, whatever the register blocking. */
void qg_bn_sums(const float *restrict dy, const float *restrict x, int64_t a_len, int64_t c_len, int64_t b_len,
                const double *restrict mean, double *restrict sums) {
    double *sum_dy = sums, *sum_dyxc = sums + c_len;
    if (b_len == 1) { /* channels last: run along the channels of each row */
        int64_t c0 = 0;
#ifdef QG_BN_CB
        for (; c0 + QG_BN_CB <= c_len; c0 += QG_BN_CB) {
            __m256d s[QG_BN_CB / 4], sx[QG_BN_CB / 4], m[QG_BN_CB / 4];
            for (int j = 0; j < QG_BN_CB / 4; ++j) {
                s[j] = _mm256_loadu_pd(sum_dy + c0 + 4 * j);
                sx[j] = _mm256_loadu_pd(sum_dyxc + c0 + 4 * j);
                m[j] = _mm256_loadu_pd(mean + c0 + 4 * j);
            }
            for (int64_t a = 0; a < a_len; ++a) {
                const float *d = dy + a * c_len + c0, *v = x + a * c_len + c0;
                for (int j = 0; j < QG_BN_CB / 4; ++j) {
                    __m256d dd = _mm256_cvtps_pd(_mm_loadu_ps(d + 4 * j));
                    s[j] = _mm256_add_pd(s[j], dd);
                    sx[j] = _mm256_add_pd(sx[j],
                                          _mm256_mul_pd(dd, _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(v + 4 * j)), m[j])));
                }
            }
            for (int j = 0; j < QG_BN_CB / 4; ++j) {
                _mm256_storeu_pd(sum_dy + c0 + 4 * j, s[j]);
                _mm256_storeu_pd(sum_dyxc + c0 + 4 * j, sx[j]);
            }
        }
#endif
        if (c0 < c_len)
            for (int64_t a = 0; a < a_len; ++a)
                for (int64_t c = c0; c < c_len; ++c) {
                    double d = (double)dy[a * c_len + c];
                    sum_dy[c] += d;
                    sum_dyxc[c] += d * ((double)x[a * c_len + c] - mean[c]);
                }
        return;
    }
    for (int64_t a = 0; a < a_len; ++a)
        for (int64_t c = 0; c < c_len; ++c) {
            const float *restrict d = dy + (a * c_len + c) * b_len, *v = x + (a * c_len + c) * b_len;
            double s = 0.0, sx = 0.0, m = mean[c];
            for (int64_t b = 0; b < b_len; ++b) {
                s += (double)d[b];
                sx += (double)d[b] * ((double)v[b] - m);
            }
            sum_dy[c] += s;
            sum_dyxc[c] += sx;
        }
}

/* x_backprop = coef1 * ((dy - dy_mean) - (x - mean) * coef2) in training, coef1 * dy in inference; each
 * value rounded once to float32, the same operations in the same order as the NumPy path.  coefs: [4][C]
 * rows coef1, coef2, dy_mean, mean (the last three unused in inference).  dx may be dy itself, as in
 * qg_backprop. */
void qg_bn_dx(const float *dy, const float *restrict x, float *dx, int64_t a_len, int64_t c_len,
              int64_t b_len, const double *restrict coefs, int training) {
    const double *coef1 = coefs, *coef2 = coefs + c_len, *dy_mean = coefs + 2 * c_len, *mean = coefs + 3 * c_len;
    if (b_len == 1) {
        if (training)
            for (int64_t a = 0; a < a_len; ++a)
#pragma GCC ivdep
                for (int64_t c = 0; c < c_len; ++c) {
                    double d = (double)dy[a * c_len + c], v = (double)x[a * c_len + c];
                    dx[a * c_len + c] = (float)(((d - dy_mean[c]) - (v - mean[c]) * coef2[c]) * coef1[c]);
                }
        else
            for (int64_t a = 0; a < a_len; ++a)
#pragma GCC ivdep
                for (int64_t c = 0; c < c_len; ++c)
                    dx[a * c_len + c] = (float)((double)dy[a * c_len + c] * coef1[c]);
        return;
    }
    for (int64_t a = 0; a < a_len; ++a)
        for (int64_t c = 0; c < c_len; ++c) {
            int64_t base = (a * c_len + c) * b_len;
            double c1 = coef1[c], c2 = training ? coef2[c] : 0.0, dm = training ? dy_mean[c] : 0.0,
                   m = training ? mean[c] : 0.0;
#pragma GCC ivdep
            for (int64_t b = 0; b < b_len; ++b) {
                double d = (double)dy[base + b];
                dx[base + b] = (float)(training ? ((d - dm) - ((double)x[base + b] - m) * c2) * c1 : d * c1);
            }
        }
}

/* The whole FusedBatchNormGrad of a tensor small enough for one block ([A, C, B] float32, C order), in one
 * call: qg_bn_sums from zero, the per-channel coefficients in float64 as batch_norm.gradient_coefficients
 * computes them (the same operations in the same order, so the same bits), then qg_bn_dx.  scale, mean and
 * var are the float32 per-channel operands (var holds 1/sqrt(var + eps) when inv_std); scale_bp and
 * offset_bp receive the float32 scale_backprop and offset_backprop.  dx may be dy itself: every sum is
 * taken before dx is written.  Returns 0; 1, writing nothing, when a variance is negative (an inverse std
 * not > 0); -1 when the C scratch could not be allocated. */
int qg_bn_grad(const float *dy, const float *x, float *dx, int64_t a_len, int64_t c_len, int64_t b_len,
               const float *restrict scale, const float *restrict mean, const float *restrict var, double eps,
               int training, int inv_std, float *restrict scale_bp, float *restrict offset_bp) {
    for (int64_t c = 0; c < c_len; ++c) /* a bad variance: the caller's general path names it, nothing written */
        if (inv_std ? !(var[c] > 0) && !isnan(var[c]) : var[c] < 0)
            return 1;
    double *work = calloc((size_t)(6 * (c_len > 0 ? c_len : 1)), sizeof(double));
    if (!work)
        return -1;
    double *sums = work, *table = work + 2 * c_len; /* table: rows coef1, coef2, dy_mean, mean */
    double *mean64 = table + 3 * c_len;
    for (int64_t c = 0; c < c_len; ++c)
        mean64[c] = (double)mean[c];
    qg_bn_sums(dy, x, a_len, c_len, b_len, mean64, sums);
    double n = (double)(a_len * b_len);
    for (int64_t c = 0; c < c_len; ++c) {
        double sum_dy = sums[c], sum_dyxc = sums[c_len + c];
        double inv = inv_std ? (double)var[c] : 1.0 / sqrt((double)var[c] + eps);
        table[c] = (double)scale[c] * inv;
        scale_bp[c] = (float)(sum_dyxc * inv);
        offset_bp[c] = (float)sum_dy;
        if (training) {
            table[c_len + c] = inv * inv * (sum_dyxc / n);
            table[2 * c_len + c] = sum_dy / n;
        }
    }
    qg_bn_dx(dy, x, dx, a_len, c_len, b_len, table, training);
    free(work);
    return 0;
}

/* --- LZF compression (the format HDF5's LZF filter 32000 decodes), deterministic ----------------------
 *
 * The stream is a sequence of literal runs (a byte c < 32, then c + 1 bytes) and back references (a byte
 * holding (length - 2) << 5 when length - 2 < 7, else 7 << 5 and one more byte length - 9, both with the
 * distance - 1's high 5 bits, then the low 8 bits): lengths 3..264, distances 1..8192.  Greedy matching
 * on a hash of 3 bytes, looking at fewer positions the longer nothing matches; the table (16 K positions,
 * 64 KB: it stays in cache) cleared on every call so that the same chunk always gives the same bytes.
 * Matches start only at multiples of `step` (the chunk's item size) and, for items of 4 bytes or more, cover
 * at least 4 bytes (hashed and compared as one 32-bit word): the repeats of typed data (a float32 zero, a
 * repeated value) start at item boundaries, and looking at every byte took 2.5x the time on float32
 * gradients.  A match may end anywhere (found 8 bytes at a time); the search goes on at the next boundary.
 * Returns the stream's length, or 0 where it would not fit in `cap` bytes (the caller then stores the chunk
 * raw, as h5py's filter does). */
#define QG_LZF_HLOG 14
#define QG_LZF_MAX_OFF 8192
#define QG_LZF_MAX_LEN 264
#define QG_LZF_MAX_LIT 32

static inline uint32_t qg_load32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t qg_load64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* Literal runs of in[start, end) (in: n bytes) at out + *o; 0 when they do not fit.  Where both buffers have
 * room, a run is copied as a fixed 32 bytes (no call, no branch on its length); the bytes past it are
 * overwritten by what follows or lie past the stream's end. */
static inline int qg_lzf_literals(const uint8_t *in, int64_t n, int64_t start, int64_t end, uint8_t *out,
                                  int64_t *o, int64_t cap) {
    while (start < end) {
        int64_t run = end - start < QG_LZF_MAX_LIT ? end - start : QG_LZF_MAX_LIT;
        if (*o + 1 + run > cap) return 0;
        out[(*o)++] = (uint8_t)(run - 1);
        if (*o + QG_LZF_MAX_LIT <= cap && start + QG_LZF_MAX_LIT <= n)
            memcpy(out + *o, in + start, QG_LZF_MAX_LIT);
        else
            memcpy(out + *o, in + start, (size_t)run);
        *o += run;
        start += run;
    }
    return 1;
}

/* How far a[0, limit) equals b[0, limit), given the first `len` bytes do. */
static inline int64_t qg_lzf_extend(const uint8_t *a, const uint8_t *b, int64_t len, int64_t limit) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    while (len + 8 <= limit) {
        uint64_t diff = qg_load64(a + len) ^ qg_load64(b + len);
        if (diff) return len + (__builtin_ctzll(diff) >> 3);
        len += 8;
    }
#endif
    while (len < limit && a[len] == b[len]) ++len;
    return len;
}

/* The compressor for one item size: `step` and `width` are constants at each call below, so that the
 * compiler specialises the loop (the alignment a shift, the compare one width).  The table holds
 * position + 8193, so that an empty slot (0) is a candidate out of reach. */
static inline __attribute__((always_inline)) int64_t qg_lzf_items(
    const uint8_t *restrict in, int64_t n, uint8_t *restrict out, int64_t cap, uint32_t *restrict table,
    const int64_t step, const int width) {
    int64_t ip = 0, lit = 0, o = 0, misses = 0;
    while (ip + width <= n) {
        uint32_t v = width == 4 ? qg_load32(in + ip)
                                : (uint32_t)in[ip] | (uint32_t)in[ip + 1] << 8 | (uint32_t)in[ip + 2] << 16;
        uint32_t h = (v * 2654435761u) >> (32 - QG_LZF_HLOG);
        int64_t cand = (int64_t)table[h] - (QG_LZF_MAX_OFF + 1);
        table[h] = (uint32_t)(ip + QG_LZF_MAX_OFF + 1);
        if (ip - cand > QG_LZF_MAX_OFF
            || (width == 4 ? qg_load32(in + cand) != v
                           : in[cand] != in[ip] || in[cand + 1] != in[ip + 1] || in[cand + 2] != in[ip + 2])) {
            ip += step * (1 + (misses++ >> 5)); /* incompressible bytes (random mantissas): look less often */
            continue;
        }
        misses = 0;
        int64_t limit = n - ip < QG_LZF_MAX_LEN ? n - ip : QG_LZF_MAX_LEN;
        int64_t len = qg_lzf_extend(in + cand, in + ip, width, limit);
        if (!qg_lzf_literals(in, n, lit, ip, out, &o, cap) || o + 3 > cap) return 0;
        int64_t off = ip - cand - 1, code = len - 2;
        if (code < 7) {
            out[o++] = (uint8_t)((code << 5) | (off >> 8));
        } else {
            out[o++] = (uint8_t)((7 << 5) | (off >> 8));
            out[o++] = (uint8_t)(code - 7);
        }
        out[o++] = (uint8_t)(off & 0xff);
        lit = ip + len;
        ip = (lit + step - 1) / step * step;
    }
    return qg_lzf_literals(in, n, lit, n, out, &o, cap) ? o : 0;
}

/* `step`: the item size (1, 2, 4 or 8; any other size compresses as bytes).  Chunks of 2 GiB or more (the
 * table's positions are 32-bit) are left raw. */
int64_t qg_lzf_compress(const uint8_t *restrict in, int64_t n, uint8_t *restrict out, int64_t cap, int64_t step) {
    if (n >= ((int64_t)1 << 31)) return 0;
    uint32_t *table = calloc((size_t)1 << QG_LZF_HLOG, sizeof(uint32_t));
    if (!table) return 0;
    int64_t size = step == 8 ? qg_lzf_items(in, n, out, cap, table, 8, 4)  /* a match: at least one item */
                 : step == 4 ? qg_lzf_items(in, n, out, cap, table, 4, 4)  /* (4 bytes of it) */
                 : step == 2 ? qg_lzf_items(in, n, out, cap, table, 2, 3)
                             : qg_lzf_items(in, n, out, cap, table, 1, 3);
    free(table);
    return size;
}

/* --- MX and NVFP4 blocks (qgcli/ops/mx.py, nvfp4.py; docs/formats-mx-nvfp4-onnx.md) ------------------
 *
 * One pass per run of blocks: the block's max |x|, its scale code, the element codes and the dequantized
 * values, the same float32 operations as the NumPy path.  Blocks whose max is NaN are left to the NumPy
 * path (the kernels return 1 and Python redoes the whole run there): NaN bits reach the codes through
 * torchao's bit tricks, which only the NumPy code reproduces.  Inf blocks are handled here.  Every lane is
 * 32 bits wide and every choice a select, so that the element loops vectorize (8 lanes with AVX2).  The AVX2
 * build writes the hot loops out in intrinsics (QG_SIMD: the amax of blocks of 16 and 32, the fp8/fp6/fp4
 * element encode 32 elements at a time), the same operations lane for lane: gcc's own vectors of these loops
 * ran 32 lanes wide because of the byte codes, spilled registers and masked every lane before packing them
 * (callgrind: 10 instructions an element before, 3.7 after, for MX blocks of 32; NVFP4 11.4 before, 4.7
 * after).  Block size 32 is compiled as a constant (MX's default). */

static inline uint32_t qg_bits(float v) { uint32_t u; memcpy(&u, &v, 4); return u; }
static inline float qg_float(uint32_t u) { float v; memcpy(&v, &u, 4); return v; }

/* torchao's _f32_to_floatx_unpacked of a non-NaN float32 (_small_floats.f32_to_floatx): nearest, ties to
 * even, subnormals by the float-add trick, saturation at max_normal.  ebits/mbits are constants at every
 * call, so the constants fold.  The int32 sums of the Python code are done in uint32 (no overflow UB): the
 * 8 bits kept after the shift are the same. */
static inline __attribute__((always_inline)) uint32_t qg_floatx_code(float v, const int ebits, const int mbits) {
    const int exp_bias = (1 << (ebits - 1)) - 1;
    const float max_normal = ldexpf((float)((1 << (mbits + 1)) - 1) / (float)(1 << mbits),
                                    (1 << ebits) - 1 - exp_bias);
    const float min_normal = ldexpf(1.0f, 1 - exp_bias);
    const uint32_t denorm_int = (uint32_t)((127 - exp_bias) + (23 - mbits) + 1) << 23;
    const uint32_t val_to_add = (uint32_t)((exp_bias - 127) * (1 << 23)) + ((1u << (23 - mbits - 1)) - 1);
    uint32_t bits = qg_bits(v), sign = bits & 0x80000000u, a_bits = bits ^ sign;
    float a = qg_float(a_bits);
    uint32_t den = (qg_bits(a + qg_float(denorm_int)) - denorm_int) & 0xFFu;
    uint32_t nor = ((a_bits + val_to_add + ((a_bits >> (23 - mbits)) & 1u)) >> (23 - mbits)) & 0xFFu;
    uint32_t out = a >= max_normal ? (uint32_t)((1 << (ebits + mbits)) - 1) : (a < min_normal ? den : nor);
    return out | (sign >> (31 - ebits - mbits));
}

/* The float32 value of a code qg_floatx_code gives (torchao's _floatx_unpacked_to_f32, ml_dtypes' float8
 * values: equal on every such code; NaN codes never get here). */
static inline __attribute__((always_inline)) float qg_floatx_value(uint32_t c, const int ebits, const int mbits) {
    const int exp_bias = (1 << (ebits - 1)) - 1;
    uint32_t e = (c >> mbits) & ((1u << ebits) - 1), m = c & ((1u << mbits) - 1);
    float normal = qg_float(((e + 127 - exp_bias) << 23) | (m << (23 - mbits)));
    float subnormal = (float)(int32_t)m * ldexpf(1.0f, 1 - exp_bias - mbits); /* exact */
    uint32_t sign = (c >> (ebits + mbits)) << 31;
    return qg_float(qg_bits(e ? normal : subnormal) | sign);
}

static inline float qg_clampf(float v, float bound) { return v < -bound ? -bound : (v > bound ? bound : v); }

/* qg_floatx_code(clip(v, -bound, bound)) of a non-NaN v, 0 < bound <= max_normal: |v| at or above the bound
 * takes the bound's code, with v's sign (a float clamp before the cast cost 2.5x the time of the loop; the
 * codes are the same).  With bound == max_normal (fp6, fp4) the clamp changes nothing at all. */
static inline __attribute__((always_inline)) uint32_t qg_floatx_code_clipped(float v, const int ebits,
                                                                            const int mbits, const float bound) {
    uint32_t c = qg_floatx_code(v, ebits, mbits), top = qg_floatx_code(bound, ebits, mbits);
    return fabsf(v) >= bound ? top | (c & (1u << (ebits + mbits))) : c;
}

/* qg_floatx_code_clipped's code of a non-NaN v and, in *value, that code's value (qg_floatx_value) without
 * decoding it, on the float32 bits and with no branch: |v| is clamped to the bound (an unsigned min on the bits,
 * the bound being on the grid: 0 < bound <= max_normal), then rounded to the format's grid by the float-add
 * trick, m = (a + B) - B with B = 2^(E + 23 - mbits), E the exponent of a but at least the format's smallest
 * normal exponent: the sum's ulp is the grid's step at a (2^(E - mbits)), so the add rounds a to it, ties to
 * even, exactly as the cast does, subnormals included, and a rounding up into the next binade comes out right.
 * The code is the sum's bits less B's, the step count 2^mbits + mantissa above 2^E (below it for subnormals),
 * plus (E - emin) << mbits, the exponent field above the smallest.  The old formulation (the float32 mantissa
 * rounded by an integer add, the subnormal float-add trick and two selects) gave the same bits in twice the
 * instructions. */
static inline __attribute__((always_inline)) uint32_t qg_floatx_round(float v, const int ebits, const int mbits,
                                                                     const float bound, float *value) {
    const int exp_bias = (1 << (ebits - 1)) - 1, shift = 23 - mbits;
    const uint32_t min_exp = (uint32_t)(128 - exp_bias) << 23, bound_bits = qg_bits(bound);
    uint32_t bits = qg_bits(v), a = bits & 0x7FFFFFFFu, sign = bits ^ a;
    a = a < bound_bits ? a : bound_bits;
    uint32_t e = a & 0x7F800000u;
    e = e > min_exp ? e : min_exp;
    uint32_t big = e + ((uint32_t)shift << 23);
    float sum = qg_float(a) + qg_float(big);
    uint32_t m = qg_bits(sum - qg_float(big));
    uint32_t c = qg_bits(sum) - big + ((e - min_exp) >> shift);
    *value = qg_float(m | sign);
    return c | (sign >> (31 - ebits - mbits));
}

#if defined(__AVX2__)
#include <immintrin.h>
#define QG_SIMD 1
/* qg_floatx_round on 8 lanes (the same operations, written out: gcc's own vectors of the byte codes ran 32
 * lanes at a time, spilled registers and masked each lane before packing) */
static inline __attribute__((always_inline)) __m256i qg_floatx_round8(__m256 v, const int ebits, const int mbits,
                                                                     const float bound, __m256 *value) {
    const int exp_bias = (1 << (ebits - 1)) - 1, shift = 23 - mbits;
    const uint32_t min_exp = (uint32_t)(128 - exp_bias) << 23;
    const __m256i vmin_exp = _mm256_set1_epi32((int)min_exp);
    __m256i bits = _mm256_castps_si256(v);
    __m256i a = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
    __m256i sign = _mm256_xor_si256(bits, a);
    a = _mm256_min_epu32(a, _mm256_set1_epi32((int)qg_bits(bound)));
    __m256i e = _mm256_max_epu32(_mm256_and_si256(a, _mm256_set1_epi32(0x7F800000)), vmin_exp);
    __m256i big = _mm256_add_epi32(e, _mm256_set1_epi32(shift << 23));
    __m256 sum = _mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(big));
    __m256 m = _mm256_sub_ps(sum, _mm256_castsi256_ps(big));
    __m256i c = _mm256_add_epi32(_mm256_sub_epi32(_mm256_castps_si256(sum), big),
                                 _mm256_srli_epi32(_mm256_sub_epi32(e, vmin_exp), shift));
    *value = _mm256_or_ps(m, _mm256_castsi256_ps(sign));
    return _mm256_or_si256(c, _mm256_srli_epi32(sign, 31 - ebits - mbits));
}

/* 32 elements: codes into q, outputs into y; elements 0-15 multiplied by f0 and dequantized with s0, 16-31 by
 * f1 and s1 */
static inline __attribute__((always_inline)) void qg_floatx_32(const float *restrict x, uint8_t *restrict q,
                                                               float *restrict y, float f0, float f1, float s0,
                                                               float s1, const int ebits, const int mbits,
                                                               const float bound) {
    __m256i c[4];
    for (int k = 0; k < 4; ++k) {
        __m256 value, f = _mm256_set1_ps(k < 2 ? f0 : f1), s = _mm256_set1_ps(k < 2 ? s0 : s1);
        c[k] = qg_floatx_round8(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), f), ebits, mbits, bound, &value);
        _mm256_storeu_ps(y + 8 * k, _mm256_mul_ps(value, s));
    }
    /* codes fit a byte: the saturating packs keep them, and the dword shuffle undoes the packs' lane order */
    __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, b);
}

/* mxint8's 32 elements (the generic loop's operations: v = x * f clamped to +-127/64, t = rint(64 v) clamped to
 * +-127, the code t as int8, the value (t + 0) / 64 times s) */
static inline __attribute__((always_inline)) void qg_int8_32(const float *restrict x, uint8_t *restrict q,
                                                             float *restrict y, float f, float s, float fmax) {
    const __m256 vf = _mm256_set1_ps(f), vs = _mm256_set1_ps(s);
    const __m256 hi = _mm256_set1_ps(fmax), lo = _mm256_set1_ps(-fmax);
    const __m256 top = _mm256_set1_ps(127.0f), bottom = _mm256_set1_ps(-127.0f);
    __m256i c[4];
    for (int k = 0; k < 4; ++k) {
        __m256 v = _mm256_max_ps(_mm256_min_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), vf), hi), lo);
        __m256 t = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(64.0f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        t = _mm256_max_ps(_mm256_min_ps(t, top), bottom);
        c[k] = _mm256_cvtps_epi32(t);
        __m256 value = _mm256_mul_ps(_mm256_add_ps(t, _mm256_setzero_ps()), _mm256_set1_ps(0x1p-6f));
        _mm256_storeu_ps(y + 8 * k, _mm256_mul_ps(value, vs));
    }
    /* codes within +-127: the signed saturating packs keep them */
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, b);
}
#endif

/* float32 2^n for n in [-127, 127] (2^-127 is subnormal), as np.ldexp gives it */
static inline float qg_pow2(int n) { return qg_float(n >= -126 ? (uint32_t)(n + 127) << 23 : 0x00400000u); }

/* max |x| of a block on the bits (0x7F800001 and above: NaN) */
static inline __attribute__((always_inline)) uint32_t qg_amax_bits_of(const float *restrict x, int64_t n) {
#ifdef QG_SIMD
    if (n == 16 || n == 32) { /* the blocks of MX and NVFP4: whole vectors, then across the lanes */
        const __m256i abs = _mm256_set1_epi32(0x7FFFFFFF);
        __m256i m = _mm256_max_epu32(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)x), abs),
                                     _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + 8)), abs));
        if (n == 32)
            m = _mm256_max_epu32(m, _mm256_max_epu32(
                    _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + 16)), abs),
                    _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + 24)), abs)));
        __m128i h = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
        h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4E));
        h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0xB1));
        return (uint32_t)_mm_cvtsi128_si32(h);
    }
#endif
    uint32_t amax = 0;
    for (int64_t i = 0; i < n; ++i) {
        uint32_t m = qg_bits(x[i]) & 0x7FFFFFFFu;
        amax = m > amax ? m : amax;
    }
    return amax;
}

enum { QG_E4M3, QG_E5M2, QG_E2M3, QG_E3M2, QG_E2M1, QG_INT8 };
enum { QG_FLOOR, QG_RCEIL, QG_CEIL, QG_EVEN };

/* rceil's code of d = amax / F where the float32 log2 decides it (d subnormal or zero, or just above a power
 * of two): torch's float32 log2, then ceil */
static int qg_rceil_code_by_log2(float d) {
    double k = ceil((double)(float)log2((double)d));
    k = k < -127.0 ? -127.0 : (k > 127.0 ? 127.0 : k);
    return (int)k + 127;
}

/* One block's E8M0 code (amax not NaN), the factor its elements are multiplied by (rceil: the reciprocal r;
 * else 1 / s, which rounds as dividing by s) and its dequantizing scale.  rceil: *by_log2 is set where the
 * code is to be redone by qg_rceil_code_by_log2 (then factor and scale are to be redone from it). */
static inline __attribute__((always_inline)) int qg_mx_scale(uint32_t amax_bits, float fmax, int mbits, int emax,
                                                             const int mode, float *factor, float *s_out,
                                                             uint32_t *by_log2) {
    int code;
    if (mode == QG_RCEIL) {
        float d = qg_float(amax_bits) / fmax;
        uint32_t d_bits = qg_bits(d), mantissa = d_bits & 0x7FFFFFu;
        int e = (int)(d_bits >> 23) - 127;
        /* ceil(float32(log2 d)) without the log2: 2^e is its own log2; from 2^-13 above it log2(d) - e >
         * 1.7e-4 is far more than half a float32 ulp at |e| < 128 (2^-18), so the rounded log2 stays above e
         * and its ceiling is e + 1.  Inf (e 128, no mantissa) clamps to 127: code 254. */
        int k = mantissa ? e + 1 : e;
        code = (k > 127 ? 127 : k) + 127;
        *by_log2 = (e == -127) | ((mantissa != 0) & (mantissa < (1u << 10)));
        *factor = code == 0 ? 1.0f : qg_pow2(127 - code);
    } else {
        uint32_t a = amax_bits;
        if (mode == QG_EVEN) a = (a + (1u << (23 - mbits - 1))) & 0xFF800000u;
        int e = (int)((a >> 23) & 0xFF) - 127;
        if (mode == QG_CEIL) e += (a & 0x7FFFFFu) != 0;
        int k = e - emax;
        code = (k < -127 ? -127 : (k > 128 ? 128 : k)) + 127;
        float s = qg_float((uint32_t)code << 23);
        /* 1 / s is exact (s a power of two, 2^-126 to 2^127; Inf, code 255, gives 0, and x * 0 is x / Inf for
         * every x), so x * (1 / s) rounds as x / s does: one multiply instead of a divide per element */
        *factor = 1.0f / (s > 0x1p-126f ? s : 0x1p-126f);
        *by_log2 = 0;
    }
    *s_out = code == 255 ? NAN : qg_pow2(code - 127);
    return code;
}

/* The run of blocks for one format (fmt: QG_E4M3...) and scale mode, both constants. */
static inline __attribute__((always_inline)) int qg_mx_run(
    const float *restrict x, uint8_t *restrict q, uint8_t *restrict codes, float *restrict y, int64_t blocks,
    int64_t size, const int fmt, const int mode) {
    const int ebits = fmt == QG_E4M3 ? 4 : fmt == QG_E5M2 ? 5 : fmt == QG_E3M2 ? 3 : fmt == QG_INT8 ? 0 : 2;
    const int mbits = fmt == QG_E4M3 || fmt == QG_E2M3 ? 3 : fmt == QG_E5M2 || fmt == QG_E3M2 ? 2
                    : fmt == QG_E2M1 ? 1 : 6;
    const int emax = fmt == QG_E4M3 ? 8 : fmt == QG_E5M2 ? 15 : fmt == QG_E3M2 ? 4 : fmt == QG_INT8 ? 0 : 2;
    const float fmax = fmt == QG_E4M3 ? 448.0f : fmt == QG_E5M2 ? 57344.0f : fmt == QG_E2M3 ? 7.5f
                     : fmt == QG_E3M2 ? 28.0f : fmt == QG_E2M1 ? 6.0f : 127.0f / 64.0f;
    /* groups of blocks in three loops: the blocks' maxima, their scales (lane-wise across blocks except
     * rceil's log2), then the elements */
    enum { GROUP = 64 };
    uint32_t amax[GROUP], by_log2[GROUP];
    float factor[GROUP], scale[GROUP];
    for (int64_t b0 = 0; b0 < blocks; b0 += GROUP) {
        const int nb = blocks - b0 < GROUP ? (int)(blocks - b0) : GROUP;
        uint32_t top = 0;
        for (int b = 0; b < nb; ++b) amax[b] = qg_amax_bits_of(x + (b0 + b) * size, size);
        for (int b = 0; b < nb; ++b) top = amax[b] > top ? amax[b] : top;
        if (top > 0x7F800000u) return 1; /* NaN: the NumPy path */
        uint32_t slow = 0;
        for (int b = 0; b < nb; ++b) {
            codes[b0 + b] = (uint8_t)qg_mx_scale(amax[b], fmax, mbits, emax, mode, factor + b, scale + b,
                                                 by_log2 + b);
            slow |= by_log2[b];
        }
        if (mode == QG_RCEIL && slow)
            for (int b = 0; b < nb; ++b)
                if (by_log2[b]) {
                    int code = qg_rceil_code_by_log2(qg_float(amax[b]) / fmax);
                    codes[b0 + b] = (uint8_t)code;
                    factor[b] = code == 0 ? 1.0f : qg_pow2(127 - code);
                    scale[b] = qg_pow2(code - 127);
                }
        for (int b = 0; b < nb; ++b) {
            const float *restrict xb = x + (b0 + b) * size;
            const float f = factor[b], s_out = scale[b];
            uint8_t *restrict qb = q + (b0 + b) * size;
            float *restrict yb = y + (b0 + b) * size;
            if (fmt == QG_INT8 && codes[b0 + b] == 255) { /* an Inf block (s = Inf): x / s is 0 or NaN: code 0 */
                memset(qb, 0, (size_t)size);
                for (int64_t i = 0; i < size; ++i) yb[i] = NAN;
                continue;
            }
#ifdef QG_SIMD
            if (size % 32 == 0) {
                for (int64_t j = 0; j < size; j += 32) {
                    if (fmt == QG_INT8) qg_int8_32(xb + j, qb + j, yb + j, f, s_out, fmax);
                    else qg_floatx_32(xb + j, qb + j, yb + j, f, f, s_out, s_out, ebits, mbits, fmax);
                }
                continue;
            }
#endif
            for (int64_t i = 0; i < size; ++i) {
                /* clamped to +-fmax (fp8, rceil; fp6/fp4 floor saturate in the cast, at fmax: the same codes) */
                float v = xb[i] * f;
                uint32_t c;
                float value;
                if (fmt == QG_INT8) {
                    float t = qg_clampf(rintf(qg_clampf(v, fmax) * 64.0f), 127.0f); /* not NaN: s is finite */
                    c = (uint32_t)(int32_t)t;
                    /* the code's value: rint(-0.3) is -0.0, code 0 is +0 (gcc folds a conversion round trip
                     * into t with AVX2, so the sign is cleared by adding +0, which no flag here lets it drop) */
                    value = (t + 0.0f) * 0x1p-6f;
                } else {
                    c = qg_floatx_round(v, ebits, mbits, fmax, &value);
                }
                qb[i] = (uint8_t)c;
                yb[i] = value * s_out;
            }
        }
    }
    return 0;
}

#define QG_MX_MODES(fmt)                                                                          \
    if (size == 32) switch (mode) {                                                               \
    case QG_FLOOR: return qg_mx_run(x, q, codes, y, blocks, 32, fmt, QG_FLOOR);                   \
    case QG_RCEIL: return qg_mx_run(x, q, codes, y, blocks, 32, fmt, QG_RCEIL);                   \
    case QG_CEIL: return qg_mx_run(x, q, codes, y, blocks, 32, fmt, QG_CEIL);                     \
    default: return qg_mx_run(x, q, codes, y, blocks, 32, fmt, QG_EVEN);                          \
    }                                                                                             \
    switch (mode) {                                                                               \
    case QG_FLOOR: return qg_mx_run(x, q, codes, y, blocks, size, fmt, QG_FLOOR);                 \
    case QG_RCEIL: return qg_mx_run(x, q, codes, y, blocks, size, fmt, QG_RCEIL);                 \
    case QG_CEIL: return qg_mx_run(x, q, codes, y, blocks, size, fmt, QG_CEIL);                   \
    default: return qg_mx_run(x, q, codes, y, blocks, size, fmt, QG_EVEN);                        \
    }

/* MX fake quantization of `blocks` blocks of `size` float32 (x: [blocks][size]) into element codes q (uint8;
 * int8 bytes for mxint8), scale codes (one per block) and outputs y.  fmt: 0 e4m3, 1 e5m2, 2 e2m3, 3 e3m2,
 * 4 e2m1, 5 int8; mode: 0 floor, 1 rceil, 2 ceil, 3 even.  Returns 0, or 1 at the first block whose max is
 * NaN (what it wrote is to be redone). */
int qg_mx_blocks(const float *restrict x, uint8_t *restrict q, uint8_t *restrict codes, float *restrict y,
                 int64_t blocks, int64_t size, int fmt, int mode) {
    switch (fmt) {
    case QG_E4M3: QG_MX_MODES(QG_E4M3)
    case QG_E5M2: QG_MX_MODES(QG_E5M2)
    case QG_E2M3: QG_MX_MODES(QG_E2M3)
    case QG_E3M2: QG_MX_MODES(QG_E3M2)
    case QG_E2M1: QG_MX_MODES(QG_E2M1)
    default: QG_MX_MODES(QG_INT8)
    }
}

/* max |x| of n float32 on the bits (NVFP4's per-tensor amax: no |x| temporary; a NaN's bits sort above
 * Inf's, and the caller turns any NaN into torch's) */
uint32_t qg_amax_bits(const float *restrict x, int64_t n) { return qg_amax_bits_of(x, n); }

/* NVFP4 blocks of 16 (nvfp4._quantize_blocks): per_tensor with the tensor scale t and its reciprocal inv_t
 * (finite, t > 0).  Returns 0, or 1 where a block's max is NaN or its reciprocal scale is not finite (the
 * NumPy path redoes the run). */
int qg_nvfp4_blocks(const float *restrict x, uint8_t *restrict q, uint8_t *restrict s8, float *restrict y,
                    int64_t blocks, int per_tensor, float t, float inv_t) {
    /* groups of blocks in three loops: the blocks' maxima, their scales (lane-wise across blocks: one block's
     * scale alone was most of the time), then the elements */
    enum { GROUP = 64 };
    uint32_t amax[GROUP], flag[GROUP];
    float r[GROUP], s_out[GROUP], r_el[GROUP * 16], s_el[GROUP * 16];
    for (int64_t b0 = 0; b0 < blocks; b0 += GROUP) {
        const int nb = blocks - b0 < GROUP ? (int)(blocks - b0) : GROUP;
        const float *restrict xg = x + b0 * 16;
        for (int b = 0; b < nb; ++b) amax[b] = qg_amax_bits_of(xg + b * 16, 16);
        for (int b = 0; b < nb; ++b) {
            uint32_t bad = amax[b] > 0x7F800000u ? 1u : 0u;
            float bscale = qg_float(amax[b]) / 6.0f;
            if (per_tensor) bscale = bscale / t;
            bscale = bscale < 0x1p-6f ? 0x1p-6f : (bscale > 448.0f ? 448.0f : bscale);
            float s32; /* bscale is a normal e4m3 value or rounds to one */
            uint32_t code = qg_floatx_round(bscale, 4, 3, 448.0f, &s32);
            float rb = per_tensor ? inv_t / s32 : (1.0f / s32) * 1.0f;
            bad |= fabsf(rb) <= 0x1.fffffep127f ? 0u : 1u; /* not finite */
            flag[b] = bad;
            r[b] = rb;
            s_out[b] = per_tensor ? t * s32 : s32;
            s8[b0 + b] = (uint8_t)code;
        }
        uint32_t bad = 0;
        for (int b = 0; b < nb; ++b) bad |= flag[b];
        if (bad) return 1;
        uint8_t *restrict qg = q + b0 * 16;
        float *restrict yg = y + b0 * 16;
#ifdef QG_SIMD /* two blocks a step, each with its factor and scale in its half of the 32 lanes */
        for (int b = 0; b + 1 < nb; b += 2)
            qg_floatx_32(xg + b * 16, qg + b * 16, yg + b * 16, r[b], r[b + 1], s_out[b], s_out[b + 1], 2, 1, 6.0f);
        if (!(nb & 1)) continue;
        const int first = nb - 1;
#else
        const int first = 0;
#endif
        /* the (other) blocks' factors spread over their elements, so that the element loop runs over the whole
         * group (block by block gcc ran it 16 lanes wide, spilling registers: 1.3x the time) */
        for (int b = first; b < nb; ++b)
            for (int i = 0; i < 16; ++i) {
                r_el[b * 16 + i] = r[b];
                s_el[b * 16 + i] = s_out[b];
            }
        for (int i = first * 16; i < nb * 16; ++i) {
            float value; /* clip(.., -6, 6): fp4 saturates at 6 anyway */
            qg[i] = (uint8_t)qg_floatx_round(xg[i] * r_el[i], 2, 1, 6.0f, &value);
            yg[i] = value * s_el[i];
        }
    }
    return 0;
}

/* ONNX QuantizeLinear + DequantizeLinear (onnx_quantize._quantize / _dequantize, the same float32 operations).
 * Integer types: q = NaN ? lo : clamp(rint(x / s) + z, lo, hi), stored in 1 or 2 bytes (two's complement for
 * the signed types), y = (q - z) * s.  Float types (saturating e4m3fn / e5m2, e2m1): v = x / s, clamped to
 * +-F, cast to the nearest code, ties to even (qg_floatx_code_clipped: ml_dtypes' codes on every non-NaN
 * value up to F), y = value(code) * s.  What ml_dtypes does past F without saturation or to NaN and Inf
 * (NaN codes, Inf, float4's NaN to -0) is left to the NumPy path: the kernel returns 1 where it met one. */
enum { QG_ONNX_INT8, QG_ONNX_INT16, QG_ONNX_E4M3, QG_ONNX_E5M2, QG_ONNX_E4M3_RAW, QG_ONNX_E5M2_RAW, QG_ONNX_E2M1 };

static inline __attribute__((always_inline)) int qg_onnx_span(
    const float *restrict x, uint8_t *restrict q, float *restrict y, int64_t len, const float *restrict s,
    const float *restrict z, const int vec, float lo, float hi, const int kind) {
    int bad = 0;
    for (int64_t i = 0; i < len; ++i) {
        const float sj = s[vec ? i : 0];
        float v = x[i] / sj;
        if (kind <= QG_ONNX_INT16) {
            const float zj = z ? z[vec ? i : 0] : 0.0f;
            float w = rintf(v) + zj;
            w = w != w ? lo : (w < lo ? lo : (w > hi ? hi : w));
            int32_t qv = (int32_t)w;
            y[i] = ((float)qv - zj) * sj;
            if (kind == QG_ONNX_INT8) q[i] = (uint8_t)qv;
            else ((uint16_t *)q)[i] = (uint16_t)qv;
        } else {
            const int eb = kind == QG_ONNX_E4M3 || kind == QG_ONNX_E4M3_RAW ? 4 : kind == QG_ONNX_E2M1 ? 2 : 5;
            const int mb = eb == 4 ? 3 : eb == 2 ? 1 : 2;
            const float fmax = eb == 4 ? 448.0f : eb == 2 ? 6.0f : 57344.0f;
            /* raw: past F ml_dtypes rounds to F up to half a step above it, then to NaN (e4m3fn) or Inf */
            const float limit = kind == QG_ONNX_E4M3_RAW ? 464.0f : kind == QG_ONNX_E5M2_RAW ? 61440.0f
                              : kind == QG_ONNX_E2M1 ? INFINITY : 0.0f;
            bad |= kind == QG_ONNX_E4M3 || kind == QG_ONNX_E5M2 ? v != v : !(fabsf(v) < limit);
            float value;
            q[i] = (uint8_t)qg_floatx_round(v, eb, mb, fmax, &value);
            y[i] = value * sj;
        }
    }
    return bad;
}

/* x as [rows] rows of row_len elements, each [n] spans of `inner` elements (the last one `tail` long); span
 * (r, j) takes its scale and zero point (z NULL: none) at r * s_rstride + (j / jdiv) * s_jstride, one for the
 * span (vec 0) or one per element (vec 1).  Per tensor: n 1, no strides; per axis: span j is the axis' j-th
 * slice; blocked along the last axis: span j is block j; along another axis: vec, jdiv the block size.
 * kind: QG_ONNX_*, q's element 1 byte (2 for QG_ONNX_INT16).  Returns 1 where the NumPy path must redo it. */
int qg_onnx_q(const float *restrict x, uint8_t *restrict q, float *restrict y, int64_t rows, int64_t n,
              int64_t inner, int64_t tail, int64_t row_len, const float *restrict s, const float *restrict z,
              int64_t s_rstride, int64_t s_jstride, int64_t jdiv, int vec, float lo, float hi, int kind) {
    int bad = 0;
    const int64_t qb = kind == QG_ONNX_INT16 ? 2 : 1;
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < n; ++j) {
            const int64_t at = r * row_len + j * inner, len = j == n - 1 ? tail : inner;
            const int64_t k = r * s_rstride + (j / jdiv) * s_jstride;
            const float *restrict zk = z ? z + k : NULL;
#define QG_ONNX_CASE(K)                                                                                   \
    case K:                                                                                               \
        bad |= vec ? qg_onnx_span(x + at, q + qb * at, y + at, len, s + k, zk, 1, lo, hi, K)              \
                   : qg_onnx_span(x + at, q + qb * at, y + at, len, s + k, zk, 0, lo, hi, K);             \
        break;
            switch (kind) {
            QG_ONNX_CASE(QG_ONNX_INT8)
            QG_ONNX_CASE(QG_ONNX_INT16)
            QG_ONNX_CASE(QG_ONNX_E4M3)
            QG_ONNX_CASE(QG_ONNX_E5M2)
            QG_ONNX_CASE(QG_ONNX_E4M3_RAW)
            QG_ONNX_CASE(QG_ONNX_E5M2_RAW)
            default: QG_ONNX_CASE(QG_ONNX_E2M1)
            }
#undef QG_ONNX_CASE
        }
    }
    return bad;
}

/* --- oscillation tracking of a weight quantizer (qgcli.monitor.torch), one pass per training step ------- */

/* `blocks` runs of `width` contiguous weights, run b quantized with inv[b] (1 / scale, as float32) and zero
 * point zp[b]: the integer code q = clamp(rint(x * inv) + zp, qmin, qmax) (torch.round's ties to even, in
 * torch's order).  With `first`, last = q only.  Otherwise, per weight: the move m = sign(q - last); where
 * m * direction < 0 (the code moves opposite to its last move) frequency += add; direction = m where m != 0;
 * last = q.  A NaN weight keeps its last code.  Branch-free so that it vectorizes (int16 codes, int8
 * directions, float32 frequencies). */
void qg_oscillation(const float *restrict x, int64_t blocks, int64_t width, const float *restrict inv,
                    const float *restrict zp, float qmin, float qmax, int16_t *restrict last,
                    int8_t *restrict direction, float *restrict frequency, float add, int first) {
    for (int64_t b = 0; b < blocks; ++b) {
        const float s = inv[b], z = zp[b];
        const float *restrict xb = x + b * width;
        int16_t *restrict lb = last + b * width;
        int8_t *restrict db = direction + b * width;
        float *restrict fb = frequency + b * width;
        for (int64_t k = 0; k < width; ++k) {
            float q = rintf(xb[k] * s) + z;
            q = q < qmin ? qmin : q;
            q = q > qmax ? qmax : q;
            int16_t before = lb[k];
            int16_t now = q == q ? (int16_t)q : before; /* NaN: no move */
            int8_t m = (int8_t)((now > before) - (now < before));
            int8_t d = db[k];
            if (!first) {
                fb[k] += (m * d < 0) ? add : 0.0f;
                db[k] = m != 0 ? m : d;
            }
            lb[k] = now;
        }
    }
}

/* At a sample, over qg_oscillation's buffers (n weights): frequency *= decay (the lazy decay applied), and
 * sums: [0] codes that differ from `sample` (the codes at the last sample), [1] frequencies above
 * `threshold`, [2] the largest frequency; then sample = last. */
void qg_oscillation_sample(const int16_t *restrict last, int16_t *restrict sample, float *restrict frequency,
                           int64_t n, float decay, float threshold, double *restrict sums) {
    int64_t changed = 0, above = 0;
    float top = -INFINITY;
    for (int64_t k = 0; k < n; ++k) {
        const float f = frequency[k] * decay;
        frequency[k] = f;
        changed += last[k] != sample[k];
        above += f > threshold;
        top = f > top ? f : top;
        sample[k] = last[k];
    }
    sums[0] = (double)changed, sums[1] = (double)above, sums[2] = top;
}

/* --- a sample's statistics of one quantizer (qgcli.monitor.torch): each tensor read once ------------------
 * Sums in double; these functions alone may reorder them (QG_SUMS) so that the loops vectorize: the values
 * are those of float32 sums up to a rounding.  A non-finite input makes the caller redo the layer with
 * torch ops (NaN's own rules). */
#if defined(__clang__) || !defined(__GNUC__)
#define QG_SUMS
#else
#define QG_SUMS __attribute__((optimize("associative-math", "no-signed-zeros", "no-trapping-math")))
#endif

/* `blocks` runs of `width` contiguous inputs x (the integer code rint(x * inv[b]) + zp[b], as qg_oscillation),
 * `out` the quantizer's output (NULL: none).  sums: [0] codes below qmin, [1] above qmax, [2] sum x^2,
 * [3] sum (x - out)^2.  mask (one byte per input): bit 0 where the code is clipped (the STE blocks the
 * gradient), with `extremes` bit 1 where x is neither its block's smallest nor largest. */
QG_SUMS void qg_monitor_forward(const float *restrict x, const float *restrict out, int64_t blocks, int64_t width,
                                const float *restrict inv, const float *restrict zp, float qmin, float qmax,
                                int extremes, int8_t *restrict mask, double *restrict sums) {
    int64_t low = 0, high = 0;
    double power = 0, noise = 0;
    for (int64_t b = 0; b < blocks; ++b) {
        const float s = inv[b], z = zp[b];
        const float *restrict xb = x + b * width;
        int8_t *restrict mb = mask + b * width;
        float lo = xb[0], hi = xb[0];
        if (extremes)
            for (int64_t k = 1; k < width; ++k) {
                lo = xb[k] < lo ? xb[k] : lo;
                hi = xb[k] > hi ? xb[k] : hi;
            }
        const int8_t inner = extremes ? 2 : 0;
        int32_t below = 0, above = 0;
        for (int64_t k = 0; k < width; ++k) {
            const float v = xb[k];
            const float q = rintf(v * s) + z;
            const int8_t l = q < qmin, h = q > qmax;
            below += l;
            above += h;
            mb[k] = (int8_t)((l | h) | ((v > lo && v < hi) ? inner : 0));
            power += (double)v * (double)v;
        }
        low += below, high += above;
        if (out) {
            const float *restrict ob = out + b * width;
            for (int64_t k = 0; k < width; ++k) {
                const double d = xb[k] - ob[k];
                noise += d * d;
            }
        }
    }
    sums[0] = (double)low, sums[1] = (double)high, sums[2] = power, sums[3] = noise;
}

/* The upstream gradient dy (n values); mask from qg_monitor_forward or NULL.  sums: [0] sum dy^2, [1] nonzero
 * dy, [2] sum |dy| where bit 0 (blocked), [3] sum |dy|. */
QG_SUMS void qg_monitor_upstream(const float *restrict dy, const int8_t *restrict mask, int64_t n,
                                 double *restrict sums) {
    double squares = 0, blocked = 0, mass = 0;
    int64_t nonzero = 0;
    for (int64_t k = 0; k < n; ++k) {
        const float v = dy[k];
        squares += (double)v * (double)v;
        mass += fabsf(v);
        nonzero += v != 0.0f;
    }
    if (mask)
        for (int64_t k = 0; k < n; ++k) blocked += (mask[k] & 1) ? fabsf(dy[k]) : 0.0f;
    sums[0] = squares, sums[1] = (double)nonzero, sums[2] = blocked, sums[3] = mass;
}

/* The input gradient dx against the STE's dy * (1 - blocked) (n values; dy and mask NULL: the norm only).
 * sums: [0] sum dx^2, [1] sum |dx - dy + dy * blocked| (with `extremes` only where bit 1), [2] with
 * `extremes` sum |dy - dy * blocked| where bit 1. */
QG_SUMS void qg_monitor_downstream(const float *restrict dx, const float *restrict dy, const int8_t *restrict mask,
                                   int64_t n, int extremes, double *restrict sums) {
    double squares = 0, error = 0, den = 0;
    for (int64_t k = 0; k < n; ++k) squares += (double)dx[k] * (double)dx[k];
    if (dy) {
        const int8_t need = extremes ? 2 : 0;
        for (int64_t k = 0; k < n; ++k) {
            const int8_t bits = mask[k];
            const float g = dy[k], o = (bits & 1) ? 1.0f : 0.0f;
            const float keep = (bits & need) == need ? 1.0f : 0.0f;
            error += fabsf((dx[k] - g + g * o) * keep);
            den += fabsf((g - g * o) * keep);
        }
    }
    sums[0] = squares, sums[1] = error, sums[2] = den;
}

/* --- a sample's statistics of TensorFlow's fake quant (qgcli.monitor.keras) ------------------------------
 * float64 sums, like the functions above; on AVX2 16 values at a time in four independent 4-lane chains (one
 * chain waits on the adder's latency at every value: the plain loops run at a third of the speed). */
#ifdef __AVX2__
#define QG_TF_LANES 16
/* QG_SUMS as their callers: GCC inlines no function whose optimize attributes differ */
#define QG_TF_INLINE static inline __attribute__((always_inline)) QG_SUMS
/* the 16 values at p as four float64 vectors */
QG_TF_INLINE void qg_tf_load16(const float *p, __m256d v[4]) {
    const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
    v[0] = _mm256_cvtps_pd(_mm256_castps256_ps128(a)), v[1] = _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1));
    v[2] = _mm256_cvtps_pd(_mm256_castps256_ps128(b)), v[3] = _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1));
}
/* all ones in the float64 lanes of the 4 mask bytes at p whose bit 0 is set (blocked) */
QG_TF_INLINE __m256d qg_tf_blocked4(const int8_t *p) {
    int32_t bytes;
    memcpy(&bytes, p, sizeof bytes);
    const __m256i one = _mm256_set1_epi64x(1);
    const __m256i bits = _mm256_and_si256(_mm256_cvtepi8_epi64(_mm_cvtsi32_si128(bytes)), one);
    return _mm256_castsi256_pd(_mm256_cmpeq_epi64(bits, one));
}
QG_TF_INLINE double qg_tf_total(const __m256d s[4]) {
    double lanes[4], t = 0;
    for (int i = 0; i < 4; ++i) {
        _mm256_storeu_pd(lanes, s[i]);
        t += (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    }
    return t;
}
#endif

/* Inputs [rows][depth] float32, channel c's inclusive STE mask bounds lo[c] and hi[c] (TF's nudged range: the
 * caller spreads one range over `depth` copies).  x and out (the op's output; NULL: none).  sums: [0] x below
 * lo, [1] x above hi, [2] sum x^2, [3] sum (x - out)^2.  mask (one byte per input): 1 where x is not inside
 * [lo, hi], where the STE blocks the gradient (bit 0, which qg_tf_monitor_upstream and _downstream read). */
QG_SUMS void qg_tf_monitor_forward(const float *restrict x, const float *restrict out, int64_t rows, int64_t depth,
                                   const float *restrict lo, const float *restrict hi, int8_t *restrict mask,
                                   double *restrict sums) {
    int64_t low = 0, high = 0;
    for (int64_t r = 0; r < rows; ++r) {
        const float *restrict xr = x + r * depth;
        int8_t *restrict mr = mask + r * depth;
        int32_t below = 0, above = 0;
        for (int64_t c = 0; c < depth; ++c) {
            const float v = xr[c];
            below += v < lo[c];
            above += v > hi[c];
            mr[c] = (int8_t)!(v >= lo[c] && v <= hi[c]);
        }
        low += below, high += above;
    }
    const int64_t n = rows * depth;
    double power = 0, noise = 0;
    int64_t k = 0;
#ifdef QG_TF_LANES
    __m256d p[4], q[4], v[4], o[4];
    for (int i = 0; i < 4; ++i) p[i] = q[i] = _mm256_setzero_pd();
    for (; k + QG_TF_LANES <= n; k += QG_TF_LANES) {
        qg_tf_load16(x + k, v);
        for (int i = 0; i < 4; ++i) p[i] = _mm256_add_pd(p[i], _mm256_mul_pd(v[i], v[i]));
        if (out) {
            qg_tf_load16(out + k, o);
            for (int i = 0; i < 4; ++i) {
                const __m256d d = _mm256_sub_pd(v[i], o[i]);
                q[i] = _mm256_add_pd(q[i], _mm256_mul_pd(d, d));
            }
        }
    }
    power = qg_tf_total(p), noise = qg_tf_total(q);
#endif
    for (; k < n; ++k) {
        const double v = x[k], d = out ? v - (double)out[k] : 0.0;
        power += v * v;
        noise += d * d;
    }
    sums[0] = (double)low, sums[1] = (double)high, sums[2] = power, sums[3] = noise;
}

/* The upstream gradient dy (n values) and the forward's mask (NULL: none).  sums: [0] sum dy^2, [1] nonzero dy,
 * [2] sum |dy| where blocked, [3] sum |dy| (qg_monitor_upstream's figures). */
QG_SUMS void qg_tf_monitor_upstream(const float *restrict dy, const int8_t *restrict mask, int64_t n,
                                    double *restrict sums) {
    double squares = 0, blocked = 0, mass = 0;
    int64_t nonzero = 0, k = 0;
#ifdef QG_TF_LANES
    const __m256d bits = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffLL));
    __m256d sq[4], ms[4], bl[4], v[4];
    for (int i = 0; i < 4; ++i) sq[i] = ms[i] = bl[i] = _mm256_setzero_pd();
    for (; k + QG_TF_LANES <= n; k += QG_TF_LANES) {
        qg_tf_load16(dy + k, v);
        const __m256 zero = _mm256_setzero_ps();
        nonzero += __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(dy + k), zero,
                                                                                  _CMP_NEQ_UQ)));
        nonzero += __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(dy + k + 8), zero,
                                                                                  _CMP_NEQ_UQ)));
        for (int i = 0; i < 4; ++i) {
            const __m256d a = _mm256_and_pd(v[i], bits);
            sq[i] = _mm256_add_pd(sq[i], _mm256_mul_pd(v[i], v[i]));
            ms[i] = _mm256_add_pd(ms[i], a);
            if (mask) bl[i] = _mm256_add_pd(bl[i], _mm256_and_pd(a, qg_tf_blocked4(mask + k + 4 * i)));
        }
    }
    squares = qg_tf_total(sq), mass = qg_tf_total(ms), blocked = qg_tf_total(bl);
#endif
    for (; k < n; ++k) {
        const double v = dy[k], a = fabs(v);
        squares += v * v;
        mass += a;
        nonzero += dy[k] != 0.0f;
        blocked += (mask && (mask[k] & 1)) ? a : 0.0;
    }
    sums[0] = squares, sums[1] = (double)nonzero, sums[2] = blocked, sums[3] = mass;
}

/* The input gradient dx against the STE's, dy where not blocked (n values; dy and mask NULL: the norm only).
 * sums: [0] sum dx^2, [1] sum |dx - dy * (1 - blocked)|. */
QG_SUMS void qg_tf_monitor_downstream(const float *restrict dx, const float *restrict dy,
                                      const int8_t *restrict mask, int64_t n, double *restrict sums) {
    double squares = 0, error = 0;
    int64_t k = 0;
#ifdef QG_TF_LANES
    const __m256d bits = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffLL));
    __m256d sq[4], er[4], v[4], g[4];
    for (int i = 0; i < 4; ++i) sq[i] = er[i] = _mm256_setzero_pd();
    for (; k + QG_TF_LANES <= n; k += QG_TF_LANES) {
        qg_tf_load16(dx + k, v);
        for (int i = 0; i < 4; ++i) sq[i] = _mm256_add_pd(sq[i], _mm256_mul_pd(v[i], v[i]));
        if (dy) {
            qg_tf_load16(dy + k, g);
            for (int i = 0; i < 4; ++i) {
                const __m256d passed = _mm256_andnot_pd(qg_tf_blocked4(mask + k + 4 * i), g[i]);
                er[i] = _mm256_add_pd(er[i], _mm256_and_pd(_mm256_sub_pd(v[i], passed), bits));
            }
        }
    }
    squares = qg_tf_total(sq), error = qg_tf_total(er);
#endif
    for (; k < n; ++k) {
        const double v = dx[k];
        squares += v * v;
        error += dy ? fabs(v - ((mask[k] & 1) ? 0.0 : (double)dy[k])) : 0.0;
    }
    sums[0] = squares, sums[1] = error;
}
#undef QG_SUMS

/* Every training step, over a TensorFlow weight quantizer's [rows][depth] float32 weights x: the integer code
 * q = floor((clamp(x, nmin[c], nmax[c]) - nmin[c]) / scale[c] + 0.5) (TF's Vars kernel's code, counted from
 * quant_min); with `first` last = q only.  Otherwise the move m = sign(q - last); frequency = frequency * keep,
 * plus add where m * direction < 0 (the move reverses the last one); direction = m where m != 0; last = q.  A
 * NaN weight, or a code outside 0..65535 (a range of zero width), keeps its last code.  At a sample,
 * qg_oscillation_sample reads the buffers (its int16 codes compared and copied bit for bit, decay 1). */
void qg_tf_oscillation(const float *restrict x, int64_t rows, int64_t depth, const float *restrict nmin,
                       const float *restrict nmax, const float *restrict scale, uint16_t *restrict last,
                       int8_t *restrict direction, float *restrict frequency, float keep, float add, int first) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *restrict xr = x + r * depth;
        uint16_t *restrict lr = last + r * depth;
        int8_t *restrict dr = direction + r * depth;
        float *restrict fr = frequency + r * depth;
        if (first) /* two loops, so that each is branch-free and vectorizes */
            for (int64_t c = 0; c < depth; ++c) {
                float v = xr[c] > nmax[c] ? nmax[c] : xr[c]; /* NaN stays NaN */
                v = v < nmin[c] ? nmin[c] : v;
                const float q = qg_floor((v - nmin[c]) / scale[c] + 0.5f);
                const int ok = q >= 0.0f && q <= 65535.0f;
                lr[c] = ok ? (uint16_t)(int32_t)(ok ? q : 0.0f) : lr[c];
            }
        else
            for (int64_t c = 0; c < depth; ++c) {
                float v = xr[c] > nmax[c] ? nmax[c] : xr[c];
                v = v < nmin[c] ? nmin[c] : v;
                const float q = qg_floor((v - nmin[c]) / scale[c] + 0.5f);
                const int ok = q >= 0.0f && q <= 65535.0f;
                const int32_t before = lr[c];
                const int32_t now = ok ? (int32_t)(ok ? q : 0.0f) : before;
                const int32_t m = (now > before) - (now < before), d = dr[c];
                fr[c] = fr[c] * keep + ((m * d < 0) ? add : 0.0f);
                dr[c] = (int8_t)(m != 0 ? m : d);
                lr[c] = (uint16_t)now;
            }
    }
}

/* Bumped whenever a signature above changes: qgcli/ops/native.py refuses a stale build (say, an editable
 * install whose C file changed without a rebuild) instead of calling it with the wrong arguments. */
int qg_abi_version(void) { return 25; }

/* Whether this CPU runs the AVX2 build of these kernels (asked of the baseline build). */
int qg_cpu_has_avx2(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

/* Only so that setuptools can build this file as an extension module; qgcli loads it with ctypes. */
#include <Python.h>
#ifndef QG_MODULE
#define QG_MODULE _kernels
#endif
#define QG_CAT(a, b) a##b
#define QG_INIT(module) QG_CAT(PyInit_, module)
#define QG_STR(module) #module
#define QG_NAME(module) QG_STR(module)
static struct PyModuleDef qg_module = {PyModuleDef_HEAD_INIT, QG_NAME(QG_MODULE), NULL, -1, NULL};
PyMODINIT_FUNC QG_INIT(QG_MODULE)(void) { return PyModule_Create(&qg_module); }
