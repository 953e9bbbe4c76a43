#!/usr/bin/env python3
"""Generate ``tests/golden/batch_norm.h5``: golden cases for FusedBatchNormGrad / V2 / V3.

The outputs come from a REAL TensorFlow (2.21, CPU, eager ``tf.raw_ops``).  TensorFlow is not a
dependency of qgcli; only this generator imports it.  Regenerate with (see README.md):

    python3 -m venv /tmp/tfvenv
    /tmp/tfvenv/bin/pip install tensorflow-cpu==2.21.0 h5py numpy ml_dtypes
    /tmp/tfvenv/bin/python tests/golden/make_golden_batchnorm.py

Every input case is run twice, in two subprocesses (oneDNN has to be chosen before TensorFlow is
imported): with TF_ENABLE_ONEDNN_OPTS=1 (group ``vN_NNNN``) and with TF_ENABLE_ONEDNN_OPTS=0
(group ``vN_NNNN_eigen``).  For training cases the reserve spaces are what the CPU forward
FusedBatchNormV3 (is_training=True, run in the oneDNN-on process) produced for ``x``; both runs get
the same inputs.  The parent process never imports TensorFlow.
"""
import os
import pickle
import subprocess
import sys
import tempfile
import time

import numpy as np

try:
    import ml_dtypes
    BF16 = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover - ml_dtypes comes with tensorflow
    BF16 = None

f32 = np.float32
SEED = 20250522
INTRA_OP_THREADS = 2   # the per-channel sums of large tensors are split per thread block (notes section 2.4)
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "batch_norm.h5")
GENERATOR = "tests/golden/make_golden_batchnorm.py"

V1, V2, V3 = "FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3"
VSHORT = {V1: "v1", V2: "v2", V3: "v3"}
CHANNELS = [1, 2, 3, 5, 7, 8, 9, 13, 16, 32, 64, 65]
EPSILONS = [1e-4, 1e-3, 1e-5, 0.1, 1e-7]
BIG_REF_ELEMENTS = 100000   # ref64_x_backprop of larger cases is stored rounded to BIG_REF_BITS bits
BIG_REF_BITS = 32
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": BF16}


# ----------------------------------------------------------------------------------------------
# worker (runs inside a subprocess with TF_ENABLE_ONEDNN_OPTS set)
# ----------------------------------------------------------------------------------------------
def _clean_error(e):
    import re
    msg = str(e)
    msg = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", msg)
    msg = re.sub(r"\s*\[Op:[^\]]*\](\s*name:\s*\S*)?\s*$", "", msg)
    return type(e).__name__, msg.strip()


def worker(mode, in_path, out_path):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(INTRA_OP_THREADS)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    raw = tf.raw_ops
    with open(in_path, "rb") as fh:
        cases = pickle.load(fh)
    results = {}
    for c in cases:
        a = c["inputs"]
        r = {}
        if mode == "forward_and_grad" and c.get("forward"):
            # reserve spaces as the CPU forward produces them
            fw = c["forward"]
            try:
                t = raw.FusedBatchNormV3(x=a["x"], scale=fw["scale"], offset=fw["offset"], mean=fw["mean"],
                                         variance=fw["variance"], epsilon=float(f32(c["epsilon"])),
                                         data_format=c["data_format"], is_training=bool(fw["is_training"]))
                r["forward"] = {"reserve_space_1": t[3].numpy(), "reserve_space_2": t[4].numpy(),
                                "reserve_space_3": t[5].numpy()}
            except Exception as e:  # noqa: BLE001 - recorded, then the parent decides
                r["forward_error"] = _clean_error(e)
            a = dict(a)
            if "forward" in r:
                if c["is_training"]:
                    a["reserve_space_1"] = r["forward"]["reserve_space_1"]
                    a["reserve_space_2"] = r["forward"]["reserve_space_2"]
                if c["op"] == V3:
                    a["reserve_space_3"] = r["forward"]["reserve_space_3"]
            r["inputs"] = a
        kw = dict(y_backprop=a["y_backprop"], x=a["x"], scale=a["scale"], reserve_space_1=a["reserve_space_1"],
                  reserve_space_2=a["reserve_space_2"], epsilon=float(f32(c["epsilon"])),
                  data_format=c["data_format"], is_training=bool(c["is_training"]))
        if c["op"] == V3:
            kw["reserve_space_3"] = a["reserve_space_3"]
        try:
            t = getattr(raw, c["op"])(**kw)
            names = (["x_backprop", "scale_backprop", "offset_backprop"] +
                     (["reserve_space_4", "reserve_space_5"] if c["op"] == V3 else
                      ["out_reserve_space_3", "out_reserve_space_4"]))
            r["outputs"] = {k: v.numpy() for k, v in zip(names, t)}
        except Exception as e:  # noqa: BLE001
            r["error"] = _clean_error(e)
        results[c["name"]] = r
    with open(out_path, "wb") as fh:
        pickle.dump({"tensorflow_version": tf.__version__, "results": results}, fh)


def run_worker(mode, onednn, cases, tmpdir):
    inp = os.path.join(tmpdir, "in_%s_%d.pkl" % (mode, onednn))
    out = os.path.join(tmpdir, "out_%s_%d.pkl" % (mode, onednn))
    with open(inp, "wb") as fh:
        pickle.dump(cases, fh)
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=str(onednn), TF_CPP_MIN_LOG_LEVEL="3")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", mode, inp, out], env=env, check=True)
    with open(out, "rb") as fh:
        return pickle.load(fh)


# ----------------------------------------------------------------------------------------------
# case construction (parent)
# ----------------------------------------------------------------------------------------------
CASES = []
_COUNT = {}


def channels_of(shape, fmt):
    return shape[1] if fmt in ("NCHW", "NCDHW") else shape[-1]


def make_shape(rng, fmt, C, max_rest=48):
    nd = 5 if fmt in ("NDHWC", "NCDHW") else 4
    for _ in range(1000):
        sp = [int(rng.integers(1, 5))] + [int(rng.integers(1, 5)) for _ in range(nd - 2)]
        rest = int(np.prod(sp))
        if 2 <= rest <= max(max_rest, 2) and rest * C <= 2600:
            break
    return channels_first(sp, C, fmt)


def channels_first(sp, C, fmt):
    """sp = [N, spatial...] -> full shape in the given format."""
    if fmt in ("NCHW", "NCDHW"):
        return [sp[0], C] + list(sp[1:])
    return list(sp) + [C]


def to_dtype(a, dtype):
    return np.asarray(a, np.float32).astype(DTYPES[dtype])


def add_case(op, dtype, fmt, is_training, eps, x, dy, scale, description, pop_mean=None, pop_var=None,
             offset=None, rs=None, rs3=None, forward=True, ref=True, rng=None):
    """x, dy in float32 (rounded to dtype here).  Training: reserve spaces from the forward (unless rs given).
    Inference: reserve_space_1/2 = population mean / variance."""
    fam = VSHORT[op]
    n = _COUNT.get(fam, 0)
    _COUNT[fam] = n + 1
    x = to_dtype(x, dtype)
    dy = to_dtype(dy, dtype)
    scale = np.asarray(scale, f32)
    C = scale.shape[0] if scale.ndim == 1 else 1
    inputs = {"y_backprop": dy, "x": x, "scale": scale}
    fw = None
    if is_training:
        if rs is not None:
            inputs["reserve_space_1"], inputs["reserve_space_2"] = np.asarray(rs[0], f32), np.asarray(rs[1], f32)
        else:
            inputs["reserve_space_1"] = np.zeros(C, f32)     # replaced by the forward's outputs
            inputs["reserve_space_2"] = np.zeros(C, f32)
            if forward:
                off = offset if offset is not None else rng.standard_normal(C).astype(f32)
                fw = dict(scale=scale, offset=np.asarray(off, f32), mean=np.zeros(0, f32),
                          variance=np.zeros(0, f32), is_training=True)
    else:
        inputs["reserve_space_1"] = np.asarray(pop_mean, f32)
        inputs["reserve_space_2"] = np.asarray(pop_var, f32)
        if op == V3 and rs3 is None and forward:
            off = offset if offset is not None else rng.standard_normal(C).astype(f32)
            fw = dict(scale=scale, offset=np.asarray(off, f32), mean=np.asarray(pop_mean, f32),
                      variance=np.asarray(pop_var, f32), is_training=False)
    if op == V3:
        inputs["reserve_space_3"] = np.asarray(rs3 if rs3 is not None else np.zeros(0, f32), f32)
    c = dict(name="%s_%04d" % (fam, n), op=op, dtype=dtype, data_format=fmt, is_training=int(bool(is_training)),
             epsilon=f32(eps), description=description, inputs=inputs, forward=fw, ref=ref)
    CASES.append(c)
    return c


def rand_data(rng, shape, fmt, C, dtype, big=False):
    """x with per-channel offsets/scales, dy standard normal (values exact in float32)."""
    ch_axis = 1 if fmt in ("NCHW", "NCDHW") else len(shape) - 1
    bshape = [1] * len(shape)
    bshape[ch_axis] = C
    loc = (rng.standard_normal(C) * 2).reshape(bshape)
    sc = (10 ** rng.uniform(-1, 1, C)).reshape(bshape)
    x = (loc + sc * rng.standard_normal(shape)).astype(f32)
    dy = rng.standard_normal(shape).astype(f32)
    if big:   # values from per-channel pools of 256 bfloat16-representable numbers: the file compresses,
        # the float32 sums stay inexact
        def pooled(a):
            a = np.moveaxis(a, ch_axis, -1).copy()
            for ch in range(C):
                pool = (a[..., ch].ravel()[:256].view(np.uint32) & np.uint32(0xFFFF0000)).view(f32)
                a[..., ch] = pool[rng.integers(0, len(pool), size=a[..., ch].shape)]
            return np.moveaxis(a, -1, ch_axis)
        x, dy = pooled(x), pooled(dy)
    scale = (rng.standard_normal(C) * 1.5).astype(f32)
    return x, dy, scale


def pop_stats(rng, C):
    mean = (rng.standard_normal(C) * 2).astype(f32)
    var = rng.uniform(0.05, 4.0, C).astype(f32)
    return mean, var


def build_cases(rng):
    # 1. systematic grid: version x dtype x format x mode, two random (C, epsilon) draws each
    k = 0
    for rep in range(2):
        for op in (V1, V2, V3):
            dtypes = ["float32"] if op == V1 else ["float32", "float16", "bfloat16"]
            fmts = ["NHWC", "NCHW"] + (["NDHWC", "NCDHW"] if op == V3 else [])
            for dtype in dtypes:
                for fmt in fmts:
                    for is_training in (1, 0):
                        C = CHANNELS[(k * 5 + rep) % len(CHANNELS)]
                        eps = EPSILONS[k % len(EPSILONS)]
                        k += 1
                        if (not is_training and rep == 1 and fmt in ("NCHW", "NCDHW")
                                and (dtype != "float32" or fmt == "NCDHW")):
                            # the Eigen freeze grad refuses channels-first; recorded once (rep 0) only
                            fmt = {"NCHW": "NHWC", "NCDHW": "NDHWC"}[fmt]
                        shape = make_shape(rng, fmt, C)
                        x, dy, scale = rand_data(rng, shape, fmt, C, dtype)
                        desc = "grid: %s %s %s %s, C=%d, shape %s, eps %g" % (
                            op, dtype, fmt, "training" if is_training else "inference", C, shape, eps)
                        if is_training:
                            add_case(op, dtype, fmt, 1, eps, x, dy, scale, desc, rng=rng)
                        else:
                            m, v = pop_stats(rng, C)
                            add_case(op, dtype, fmt, 0, eps, x, dy, scale, desc + "; random population mean/variance",
                                     pop_mean=m, pop_var=v, rng=rng)
    # 2. every channel count for every version (float32 plus one other dtype), random format/mode/eps
    for op in (V1, V2, V3):
        for i, C in enumerate(CHANNELS):
            dtype = "float32" if (op == V1 or i % 2 == 0) else ["float16", "bfloat16"][(i // 2) % 2]
            fmts = ["NHWC", "NCHW"] + (["NDHWC", "NCDHW"] if op == V3 else [])
            fmt = fmts[int(rng.integers(len(fmts)))]
            is_training = int(rng.random() < 0.65)
            eps = EPSILONS[int(rng.integers(len(EPSILONS)))]
            shape = make_shape(rng, fmt, C)
            x, dy, scale = rand_data(rng, shape, fmt, C, dtype)
            desc = "channel sweep C=%d: %s %s %s %s, shape %s, eps %g" % (
                C, op, dtype, fmt, "training" if is_training else "inference", shape, eps)
            if is_training:
                add_case(op, dtype, fmt, 1, eps, x, dy, scale, desc, rng=rng)
            else:
                m, v = pop_stats(rng, C)
                add_case(op, dtype, fmt, 0, eps, x, dy, scale, desc + "; random population mean/variance",
                         pop_mean=m, pop_var=v, rng=rng)
    # 3. special shapes
    for op in (V1, V2, V3):
        for is_training in (1, 0):
            # n = 1 (N*H*W = 1): biased variance 0 in training
            x = np.array([1.0, 2.0, 3.0], f32).reshape(1, 1, 1, 3)
            dy = np.array([0.5, -1.0, 2.0], f32).reshape(1, 1, 1, 3)
            scale = np.array([1.0, -0.5, 2.0], f32)
            desc = "n = 1 (N*H*W = 1), x = [1,2,3] as [1,1,1,3], eps 0.001 (notes section 2.8)"
            if is_training:
                add_case(op, "float32", "NHWC", 1, 1e-3, x, dy, scale, desc + ", training", rng=rng)
            else:
                add_case(op, "float32", "NHWC", 0, 1e-3, x, dy, scale, desc + ", inference",
                         pop_mean=[0.5, 1.0, -1.0], pop_var=[0.25, 2.0, 0.0], rng=rng)
            # empty batch: reserve spaces given as zeros (the forward's are zeros or uninitialised)
            for fmt, shape in (("NHWC", [0, 3, 3, 4]), ("NCHW", [0, 4, 3, 3])):
                if not is_training and fmt == "NCHW" and op != V3:
                    continue
                dt = "float32" if op == V1 else ("float16" if fmt == "NCHW" else "float32")
                z = np.zeros(shape, f32)
                sc = np.array([1.0, 2.0, -1.0, 0.5], f32)
                desc = "empty batch %s %s %s, reserve spaces zeros" % (shape, fmt, dt)
                if is_training:
                    add_case(op, dt, fmt, 1, 1e-4, z, z, sc, desc + ", training", rs=(np.zeros(4, f32), np.ones(4, f32)))
                else:
                    add_case(op, dt, fmt, 0, 1e-4, z, z, sc, desc + ", inference", pop_mean=np.zeros(4, f32),
                             pop_var=np.ones(4, f32), rng=rng)
    # zero-variance channel in training (constant channel), tiny epsilon
    for op, eps in ((V2, 1e-7), (V3, 1e-5), (V1, 0.1)):
        shape = [2, 3, 2, 5]
        x, dy, scale = rand_data(rng, shape, "NHWC", 5, "float32")
        x[..., 2] = f32(1.25)
        add_case(op, "float32", "NHWC", 1, eps, x, dy, scale,
                 "training with a constant channel (biased variance 0), eps %g" % eps, rng=rng)
    # channel count above 32 * threads (column-wise sum path) and a larger mid-size case
    for shape, C, dtype in (([2, 4, 4, 128], 128, "float32"), ([1, 3, 2, 65], 65, "bfloat16"),
                            ([2, 8, 8, 32], 32, "float32")):
        x, dy, scale = rand_data(rng, shape, "NHWC", C, dtype)
        add_case(V3, dtype, "NHWC", 1, 1e-3, x, dy, scale,
                 "C=%d > 32*threads or mid-size, shape %s %s, training" % (C, shape, dtype), rng=rng)
    # 4. large cases: per-channel sums split into per-thread blocks (rest*C >= ~124k with 2 threads)
    for op, shape, fmt, C, dtype in ((V3, [8, 16, 16, 64], "NHWC", 64, "float32"),
                                     (V3, [32, 32, 32, 4], "NHWC", 4, "float16")):
        x, dy, scale = rand_data(rng, shape, fmt, C, dtype, big=True)
        add_case(op, dtype, fmt, 1, 1e-3, x, dy, scale,
                 "large %s %s %s training: per-channel sums split into 2 thread blocks (intra-op threads = 2); "
                 "x, dy bfloat16-representable" % (shape, fmt, dtype), rng=rng)
    # 5. TF's own tests
    build_tf_tests(rng)
    # 6. errors
    build_errors(rng)


def build_tf_tests(rng):
    # fused_batch_norm_op_test.cc FusedBatchNormGradOpTest.Simple (literal reserve spaces)
    dy = np.array([2, 2, 9, 9, -4, -4, 5, 5, 8, 8, 7, 7], f32).reshape(1, 1, 6, 2)
    x = np.array([1, 1, 7, 7, 4, 4, -3, -3, -11, -11, 13, 13], f32).reshape(1, 1, 6, 2)
    add_case(V1, "float32", "NHWC", 1, 1e-3, x, dy, [4.0, 4.0],
             "tf unit test FusedBatchNormGradOpTest.Simple (literal rs1 = 1.833, rs2 = 57.472)",
             rs=([1.833, 1.833], [57.472, 57.472]))
    # nn_fused_batchnorm_test.py testBatchNormGradGradConfig2 data, first-order gradient (wrapper eps 0.001)
    xg = np.array([0.417022, 0.7203245, 0.000114374816, 0.30233258, 0.14675589, 0.09233859, 0.18626021,
                   0.34556073, 0.39676747, 0.53881675, 0.41919452, 0.6852195, 0.20445225, 0.87811744,
                   0.027387593, 0.6704675, 0.4173048, 0.55868983, 0.14038694, 0.19810149, 0.8007446,
                   0.9682616, 0.31342417, 0.6923226], f32).reshape(2, 3, 2, 2)
    gy = np.array([0.87638915, 0.89460665, 0.08504421, 0.039054785, 0.16983043, 0.8781425, 0.09834684,
                   0.42110762, 0.95788956, 0.5331653, 0.6918771, 0.31551564, 0.6865009, 0.83462566,
                   0.018288277, 0.7501443, 0.9888611, 0.74816567, 0.280444, 0.78927934, 0.103226006,
                   0.44789353, 0.9085955, 0.29361415], f32).reshape(2, 3, 2, 2)
    sc = np.array([0.28777534, 0.13002858], f32)
    off = np.array([0.019366957, 0.6788355], f32)
    add_case(V3, "float32", "NHWC", 1, 1e-3, xg, gy, sc,
             "tf test nn_fused_batchnorm_test testBatchNormGradGradConfig2 data, first-order grad, training",
             offset=off, rng=rng)
    add_case(V3, "float32", "NHWC", 0, 1e-3, xg, gy, sc,
             "tf test nn_fused_batchnorm_test testBatchNormGradGradConfig2 data, first-order grad, inference",
             pop_mean=[0.21162811, 0.26554665], pop_var=[0.49157315, 0.053362545], offset=off, rng=rng)
    # testBatchNormGrad{Training,Inference}Shape1..7: x/scale/offset(/mean/var) from np.random.seed(1)
    # random_sample as in the test; the upstream gradient is ours (the test uses a numeric Jacobian).
    shapes = {1: [1, 1, 6, 1], 2: [1, 1, 6, 2], 3: [1, 2, 1, 6], 4: [5, 7, 11, 4], 5: [0, 7, 11, 4],
              6: [1, 1, 1, 1], 7: [1, 2, 6, 1, 3]}
    for sid, shape in shapes.items():
        fmts = ["NCDHW", "NDHWC"] if len(shape) == 5 else ["NHWC", "NCHW"]
        for fmt in fmts:
            for is_training in (1, 0):
                C = channels_of(shape, fmt)
                legacy = np.random.RandomState(1)
                x = legacy.random_sample(shape).astype(f32)
                scale = legacy.random_sample([C]).astype(f32)
                offset = legacy.random_sample([C]).astype(f32)
                dy = rng.standard_normal(shape).astype(f32)
                desc = ("tf test nn_fused_batchnorm_test testBatchNormGrad%sShape%d data (np.random.seed(1)), %s, "
                        "eps 0.001, random upstream gradient" % ("Training" if is_training else "Inference", sid, fmt))
                rsd = ((np.zeros(C, f32), np.ones(C, f32)) if shape[0] == 0 else None)
                if is_training:
                    add_case(V3, "float32", fmt, 1, 1e-3, x, dy, scale, desc, offset=offset, rs=rsd, rng=rng)
                else:
                    mean = legacy.random_sample([C]).astype(f32)
                    var = legacy.random_sample([C]).astype(f32)
                    add_case(V3, "float32", fmt, 0, 1e-3, x, dy, scale, desc, pop_mean=mean, pop_var=var,
                             offset=offset, rng=rng)


def build_errors(rng):
    x, dy, scale = rand_data(rng, [2, 2, 2, 3], "NHWC", 3, "float32")
    m, v = pop_stats(rng, 3)
    add_case(V3, "float32", "NHWC", 1, 1e-4, x, dy, np.ones(2, f32), "error: scale size != channels",
             rs=(m, v), ref=False)
    add_case(V3, "float32", "NHWC", 1, 1e-4, x, dy, scale, "error: reserve_space_1 size != channels",
             rs=(m[:2], v), ref=False)
    add_case(V2, "float32", "NHWC", 1, 1e-4, x, dy, scale, "error: reserve_space_2 size != channels",
             rs=(m, v[:2]), ref=False)
    add_case(V2, "float32", "NHWC", 1, 1e-4, x, dy[:1], scale, "error: x and y_backprop shapes differ",
             rs=(m, v), ref=False)
    add_case(V3, "float32", "NHWC", 1, 1e-4, x[0], dy[0], scale, "error: 3-D input", rs=(m, v), ref=False)
    x5, dy5, s5 = rand_data(rng, [2, 2, 2, 3, 3], "NHWC", 3, "float32")
    add_case(V2, "float32", "NHWC", 1, 1e-4, x5, dy5, s5,
             "5-D input with NHWC for V2: oneDNN rejects (4-D only), Eigen reshapes and accepts", rs=(m, v))
    add_case(V1, "float32", "NHWC", 1, 1e-4, x5, dy5, s5,
             "5-D input with NHWC for V1: oneDNN rejects (4-D only), Eigen reshapes and accepts", rs=(m, v))
    add_case(V1, "float16", "NHWC", 1, 1e-4, x, dy, scale, "error: V1 accepts float32 only", rs=(m, v), ref=False)


# ----------------------------------------------------------------------------------------------
# float64 reference (research notes section 2.4), from the exact (rounded) inputs
# ----------------------------------------------------------------------------------------------
def _rows(t, fmt):
    t = np.asarray(t).astype(np.float64)
    if fmt in ("NCHW", "NCDHW"):
        t = np.moveaxis(t, 1, -1)
    return t.reshape(-1, t.shape[-1])


def _unrows(r, shape, fmt):
    if fmt in ("NCHW", "NCDHW"):
        tmp = r.reshape([shape[0]] + list(shape[2:]) + [shape[1]])
        return np.moveaxis(tmp, -1, 1)
    return r.reshape(shape)


def ref64(c):
    a = c["inputs"]
    fmt = c["data_format"]
    shape = a["x"].shape
    scale = a["scale"].astype(np.float64)
    C = scale.shape[0]
    if a["x"].size == 0:
        return np.zeros(shape), np.zeros(C), np.zeros(C)
    dy, x = _rows(a["y_backprop"], fmt), _rows(a["x"], fmt)
    mean = a["reserve_space_1"].astype(np.float64)
    var = a["reserve_space_2"].astype(np.float64)
    eps = np.float64(f32(c["epsilon"]))
    n = dy.shape[0]
    with np.errstate(all="ignore"):
        inv = 1.0 / np.sqrt(var + eps)
        xc = x - mean
        offset_bp = dy.sum(0)
        if c["is_training"]:
            scale_bp = (dy * xc).sum(0) * inv
            dx = scale * inv * (dy - dy.sum(0) / n - xc * inv ** 2 * ((dy * xc).sum(0) / n))
        else:
            scale_bp = inv * (dy * xc).sum(0)
            dx = dy * (scale * inv)
    return _unrows(dx, shape, fmt), scale_bp, offset_bp


# ----------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------
def write_ds(h5py, g, name, arr):
    arr = np.asarray(arr)
    is_bf16 = BF16 is not None and arr.dtype == np.dtype(BF16)
    data = arr.view(np.uint16) if is_bf16 else arr
    if data.size >= 4096:
        ds = g.create_dataset(name, data=data, compression="gzip", compression_opts=9, shuffle=True, chunks=True,
                              track_times=False)
    else:
        ds = g.create_dataset(name, data=data, track_times=False)
    if is_bf16:
        ds.attrs["dtype"] = "bfloat16"
    return ds


def round_significand(v, bits):
    """Round float64 values to `bits` significant bits (nearest, ties away), so that the large
    reference arrays compress; 32 bits are 256 times finer than a float32 ulp."""
    u = np.ascontiguousarray(v, np.float64).view(np.uint64)
    drop = 53 - bits
    r = (u + np.uint64(1 << (drop - 1))) & ~np.uint64((1 << drop) - 1)
    finite = np.isfinite(v)
    return np.where(finite, r.view(np.float64), v)


def _bit_identical(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def kernel_of(outputs, op):
    dummy = outputs["reserve_space_4" if op == V3 else "out_reserve_space_3"]
    return "onednn" if dummy.ndim == 0 else "eigen"


def open_h5_deterministic(h5py, path):
    """A new HDF5 file (libver latest) whose bytes depend only on the content: no object timestamps."""
    fcpl = h5py.h5p.create(h5py.h5p.FILE_CREATE)
    fcpl.set_obj_track_times(False)
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    return h5py.File(h5py.h5f.create(path.encode(), h5py.h5f.ACC_TRUNC, fcpl=fcpl, fapl=fapl))


def new_group(h5py, parent, name):
    gcpl = h5py.h5p.create(h5py.h5p.GROUP_CREATE)
    gcpl.set_obj_track_times(False)
    return h5py.Group(h5py.h5g.create(parent.id, name.encode(), gcpl=gcpl))


def main():
    import h5py
    rng = np.random.default_rng(SEED)
    build_cases(rng)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="golden_bn_") as tmp:
        on = run_worker("forward_and_grad", 1, CASES, tmp)
        for c in CASES:
            r = on["results"][c["name"]]
            if "inputs" in r:
                c["inputs"] = r["inputs"]
            if "forward_error" in r:
                raise RuntimeError("forward failed for %s: %s" % (c["name"], r["forward_error"]))
        off = run_worker("grad", 0, CASES, tmp)
    tf_version = on["tensorflow_version"]
    assert off["tensorflow_version"] == tf_version
    stats = {}
    tmp_out = OUT + ".tmp"
    with open_h5_deterministic(h5py, tmp_out) as f:
        f.attrs["tensorflow_version"] = tf_version
        f.attrs["generator"] = GENERATOR
        f.attrs["seed"] = SEED
        f.attrs["intra_op_parallelism_threads"] = INTRA_OP_THREADS
        f.attrs["numpy_version"] = np.__version__
        f.attrs["cpu"] = _cpu_name()
        f.attrs["format"] = "one group per case and oneDNN setting; see tests/golden/README.md"
        for c in CASES:
            refs = None
            if c["ref"]:
                refs = ref64(c)
            first = None
            for onednn, res, suffix in ((1, on["results"][c["name"]], ""), (0, off["results"][c["name"]], "_eigen")):
                g = new_group(h5py, f, c["name"] + suffix)
                g.attrs["op"] = c["op"]
                g.attrs["epsilon"] = f32(c["epsilon"])
                g.attrs["data_format"] = c["data_format"]
                g.attrs["is_training"] = c["is_training"]
                g.attrs["onednn"] = onednn
                g.attrs["dtype"] = c["dtype"]
                g.attrs["description"] = c["description"]
                names = ["y_backprop", "x", "scale", "reserve_space_1", "reserve_space_2"] + (
                    ["reserve_space_3"] if c["op"] == V3 else [])
                if first is None:
                    for k in names:
                        write_ds(h5py, g, k, c["inputs"][k])
                    if refs is not None:
                        for k, v in zip(("ref64_x_backprop", "ref64_scale_backprop", "ref64_offset_backprop"), refs):
                            v = np.asarray(v, np.float64)
                            if v.size > BIG_REF_ELEMENTS:
                                ds = write_ds(h5py, g, k, round_significand(v, BIG_REF_BITS))
                                ds.attrs["significant_bits"] = BIG_REF_BITS
                            else:
                                write_ds(h5py, g, k, v)
                    first = g
                else:   # the same inputs / reference: hard links to the oneDNN-on group's datasets
                    for k in first.keys():
                        if k in names or k.startswith("ref64_"):
                            g[k] = first[k]
                if "error" in res:
                    g.attrs["error"] = res["error"][1]
                    g.attrs["error_type"] = res["error"][0]
                    g.attrs["kernel"] = ""
                    kind = "error"
                else:
                    prev = on["results"][c["name"]].get("outputs") if onednn == 0 else None
                    for k, v in res["outputs"].items():
                        if prev is not None and _bit_identical(prev[k], v):
                            g[k] = first[k]      # identical to the oneDNN-on run: hard link
                        else:
                            write_ds(h5py, g, k, v)
                    g.attrs["kernel"] = kernel_of(res["outputs"], c["op"])
                    kind = "ok"
                key = (c["op"], onednn, kind)
                stats[key] = stats.get(key, 0) + 1
    os.replace(tmp_out, OUT)
    print("wrote %s: %d input cases, %d groups, %.1f KiB, %.1f s" % (
        OUT, len(CASES), 2 * len(CASES), os.path.getsize(OUT) / 1024, time.time() - t0))
    for op in (V1, V2, V3):
        for onednn in (1, 0):
            print("  %-22s onednn=%d  ok %3d  error %3d" % (op, onednn, stats.get((op, onednn, "ok"), 0),
                                                           stats.get((op, onednn, "error"), 0)))
    return 0


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(main())
