#!/usr/bin/env python
"""Time qgcli's ops in-process against the memory floor, TensorFlow and PyTorch, in one run.

Every op runs on the same seeded float32 NHWC tensors: by default the (32, 56, 56, 256) activation of
issue 7 (25.7 M elements, 103 MB) and a small (8, 14, 14, 64) one.  For each op the script reports the
median wall time (after warm-up, at least ``--repeats`` timed calls) and ratios measured in the same run:

* **floor**: ``np.copyto`` of one tensor, scaled to the bytes the op must at least move:
  ``floor = t_copy(one tensor) * (tensors read + tensors written) / 2`` (a copy reads one tensor and
  writes one).  ``x floor`` is qgcli's time over that.  The block formats (``mx_*``, ``nvfp4``, ``onnx_*``)
  write a fraction of a tensor more: their 1-byte codes and block scales.
* **fresh floor**: the same with ``np.copy`` (a fresh destination per call, whose pages the kernel faults in and
  zeroes: what an op that allocates its output pays too).  ``x fresh floor`` compares the fresh-output column
  with it, like with like; ``x floor`` (touched destination) is the stricter ratio, and the one for ``out=``.
* **out=**: qgcli again with its tensor-sized output written into a buffer kept from call to call (``out=``,
  touched once before timing), where the fresh-output column allocates it on every call and pays its page
  faults (the fused rows keep both of theirs: ``out=`` and ``outputs_out=``).
* ``--cpu`` times everything (qgcli, the floors, the frameworks) in CPU time of the process
  (``time.process_time``: all its threads) instead of wall time: on a machine other work shares, wall
  times measure the other work as much as the op.
* **TensorFlow** (``tf.raw_ops``, eager, results forced with ``.numpy()``) and **PyTorch** (CPU) on the same
  tensors.  Each framework is used in-process when it imports in this interpreter; otherwise
  ``--tf-python`` / ``--torch-python`` name an interpreter (a throwaway venv) in which this script re-runs
  itself in worker mode, reading the same tensors from ``.npy`` files, on the same machine, in the same run.
  Neither framework is needed: missing ones are skipped with a note.

It also checks that qgcli agrees with TensorFlow on the small tensor (forward values and input gradients
bit for bit, reductions to float32 summation error), and measures each qgcli op's peak memory on the big
tensor in a fresh subprocess (``ru_maxrss`` growth and the ``tracemalloc`` peak, against the bytes of the
outputs the op must allocate).

Usage (from the repository root)::

    python benchmarks/bench_ops.py --tf-python /tmp/tfvenv/bin/python \\
        --torch-python /tmp/torchvenv/bin/python --json bench_ops.json

Benchmarks are not tests: nothing here fails on a timing.  Only the standard library and NumPy are
imported at module level, so the worker mode runs in a venv that holds TensorFlow or PyTorch but not qgcli.
"""
import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

SIZES = {"big": (32, 56, 56, 256), "small": (8, 14, 14, 64)}
SEED = 7
NUM_BITS = 8
ARGS_MIN, ARGS_MAX = -6.0, 6.0
EPSILON = 1e-3  # Keras' BatchNormalization default

# name, tensors read, tensors written (full-size), TF ops, what the PyTorch column times
OPS = [
    ("fq_args", 1, 1, "FakeQuantWithMinMaxArgs", "fake_quantize_per_tensor_affine fwd"),
    ("fq_args_grad", 2, 1, "FakeQuantWithMinMaxArgsGradient", None),
    ("fq_vars", 1, 1, "FakeQuantWithMinMaxVars", "fake_quantize_per_tensor_affine fwd"),
    ("fq_vars_grad", 2, 1, "FakeQuantWithMinMaxVarsGradient", None),
    ("fq_vars_fwd+grad", 2, 2, "FakeQuantWithMinMaxVars + ...Gradient",
     "fake_quantize_per_tensor_affine fwd+bwd (autograd)"),
    ("fq_per_channel", 1, 1, "FakeQuantWithMinMaxVarsPerChannel", "fake_quantize_per_channel_affine fwd"),
    ("fq_per_channel_grad", 2, 1, "FakeQuantWithMinMaxVarsPerChannelGradient", None),
    ("fq_per_channel_fwd+grad", 2, 2, "FakeQuantWithMinMaxVarsPerChannel + ...Gradient",
     "fake_quantize_per_channel_affine fwd+bwd (autograd)"),
    ("bn_grad", 2, 1, "FusedBatchNormGradV3 (training, NHWC)",
     "aten.native_batch_norm_backward (training, channels_last)"),
    # the block formats of issue 38 (no TF or PyTorch counterpart timed here): written = outputs + the codes
    # (1 byte an element: 1/4 of a float32 tensor) + the block scales (1 byte per block)
    ("mx_e4m3", 1, 1 + 1 / 4 + 1 / 128, None, None),
    ("mxfp4_rceil", 1, 1 + 1 / 4 + 1 / 128, None, None),
    ("nvfp4", 1, 1 + 1 / 4 + 1 / 64, None, None),
    ("onnx_uint8", 1, 1 + 1 / 4, None, None),
    ("onnx_e4m3", 1, 1 + 1 / 4, None, None),
]
OP_NAMES = [o[0] for o in OPS]
OP_INFO = {o[0]: o for o in OPS}
# Ops whose outputs are compared with TensorFlow's (the fwd+grad rows are their two parts again).
CHECKED = ["fq_args", "fq_args_grad", "fq_vars", "fq_vars_grad", "fq_per_channel", "fq_per_channel_grad",
           "bn_grad"]


# ---------------------------------------------------------------------------------------------- data

def make_arrays(size):
    """The seeded tensors of one size: inputs, gradients, per-channel ranges, batch-norm statistics."""
    shape = SIZES[size]
    rng = np.random.default_rng([SEED, len(shape)] + list(shape))
    c = shape[-1]
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= np.float32(3.0)  # ~4.6 % of the values fall outside [-6, 6]
    g = rng.standard_normal(shape, dtype=np.float32)
    pc_min = (-rng.uniform(4.0, 8.0, c)).astype(np.float32)
    pc_max = rng.uniform(4.0, 8.0, c).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, c).astype(np.float32)
    axes = tuple(range(len(shape) - 1))
    mean = x.mean(axis=axes, dtype=np.float64)
    var = ((x - mean.astype(np.float32)) ** 2).mean(axis=axes, dtype=np.float64)  # biased, as TF's CPU
    return dict(x=x, g=g, pc_min=pc_min, pc_max=pc_max, bn_scale=scale,
                bn_mean=mean.astype(np.float32), bn_var=var.astype(np.float32))


def make_data(directory, sizes):
    """Write the seeded tensors of each size as .npy files (the workers read exactly these bytes)."""
    for size in sizes:
        for name, a in make_arrays(size).items():
            np.save(os.path.join(directory, f"{size}_{name}.npy"), a)


def load_data(directory, size, names=None):
    names = names or ["x", "g", "pc_min", "pc_max", "bn_scale", "bn_mean", "bn_var"]
    return {n: np.load(os.path.join(directory, f"{size}_{n}.npy")) for n in names}


def torch_grid(mn, mx):
    """Scale and zero point for PyTorch's affine fake quant from [min, max] (about TF's grid; for timing only)."""
    qmin, qmax = 0, 2 ** NUM_BITS - 1
    scale = (np.asarray(mx, np.float64) - np.asarray(mn, np.float64)) / (qmax - qmin)
    zero = np.clip(np.round(qmin - np.asarray(mn, np.float64) / scale), qmin, qmax)
    return scale, zero.astype(np.int32), qmin, qmax


# ---------------------------------------------------------------------------------------------- timing

CLOCK = {"clock": time.perf_counter}  # time.process_time under --cpu (and in workers asked for CPU time)


def measure(fn, repeats, min_time, warmup=2):
    """Median (and minimum) time of ``fn()`` over at least ``repeats`` calls and ``min_time`` seconds of wall
    time, on ``CLOCK["clock"]`` (wall time, or CPU time under ``--cpu``).

    The first warm-up call pays for first-touch page faults, thread pools and lazy set-up; a second one
    follows only when a call is short (a second of warm-up on a 1 s op buys nothing).
    """
    clock = CLOCK["clock"]
    for i in range(warmup):
        t0 = time.perf_counter()
        fn()
        if time.perf_counter() - t0 > 0.25:
            break
    times = []
    start = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start < min_time and len(times) < 2000):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return {"median": statistics.median(times), "min": min(times), "n": len(times)}


def copy_time(shape, repeats, min_time):
    src = np.ones(shape, np.float32)
    dst = np.zeros(shape, np.float32)  # touched: page faults are not part of the floor
    return measure(lambda: np.copyto(dst, src), repeats, min_time)


def fresh_copy_time(shape, repeats, min_time):
    """``np.copy``: the destination allocated by each call (a big one is mapped afresh: its page faults count)."""
    src = np.ones(shape, np.float32)
    return measure(lambda: np.copy(src), repeats, min_time)


# ---------------------------------------------------------------------------------------------- qgcli

def qgcli_callables(d, kept=False):
    """The qgcli op calls on data ``d``: name -> function.  ``kept``: each op writes its tensor-sized output
    into a buffer of its own allocated (and touched) here once, ``out=``, instead of a fresh array per call."""
    from qgcli import ops

    x, g = d["x"], d["g"]
    buffers = {}

    def out(name):
        return buffers.setdefault(name, np.zeros_like(x)) if kept else None

    y_out = out("outputs of fwd+grad")  # the fused rows' second output (their ops run one at a time)

    mn, mx = np.float32(ARGS_MIN), np.float32(ARGS_MAX)
    pmn, pmx = d["pc_min"], d["pc_max"]
    calls = {
        "fq_args": lambda o=out("fq_args"): ops.fake_quant_with_min_max_args(x, ARGS_MIN, ARGS_MAX,
                                                                             num_bits=NUM_BITS, out=o),
        "fq_args_grad": lambda o=out("fq_args_grad"): ops.fake_quant_with_min_max_args_gradient(
            g, x, ARGS_MIN, ARGS_MAX, num_bits=NUM_BITS, out=o),
        "fq_vars": lambda o=out("fq_vars"): ops.fake_quant_with_min_max_vars(x, mn, mx, num_bits=NUM_BITS, out=o),
        "fq_vars_grad": lambda o=out("fq_vars_grad"): ops.fake_quant_with_min_max_vars_gradient(
            g, x, mn, mx, num_bits=NUM_BITS, out=o),
        "fq_per_channel": lambda o=out("fq_per_channel"): ops.fake_quant_with_min_max_vars_per_channel(
            x, pmn, pmx, num_bits=NUM_BITS, out=o),
        "fq_per_channel_grad": lambda o=out("fq_per_channel_grad"):
            ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, pmn, pmx, num_bits=NUM_BITS, out=o),
        "bn_grad": lambda o=out("bn_grad"): ops.fused_batch_norm_grad(
            g, x, d["bn_scale"], d["bn_mean"], d["bn_var"], epsilon=EPSILON, data_format="NHWC", is_training=True,
            out=o),
        # qgcli's forward + gradient is one fused pass (the two ops' bits)
        "fq_vars_fwd+grad": lambda o=out("fq_vars_fwd+grad"): ops.fake_quant_with_min_max_vars_and_gradient(
            g, x, mn, mx, num_bits=NUM_BITS, out=o, outputs_out=y_out),
        "fq_per_channel_fwd+grad": lambda o=out("fq_per_channel_fwd+grad"):
            ops.fake_quant_with_min_max_vars_per_channel_and_gradient(g, x, pmn, pmx, num_bits=NUM_BITS, out=o,
                                                                      outputs_out=y_out),
    }
    def kept_result(f):
        """A block-format op (several results): with ``kept``, each call writes into the last call's results."""
        held = {}

        def call():
            held["r"] = f(out=held.get("r"))
            return held["r"]
        return call if kept else f

    calls["mx_e4m3"] = kept_result(lambda out=None: ops.mx_fake_quantize(x, format="mxfp8-e4m3", out=out))
    calls["mxfp4_rceil"] = kept_result(lambda out=None: ops.mx_fake_quantize(x, format="mxfp4", scale_mode="rceil",
                                                                            out=out))
    calls["nvfp4"] = kept_result(lambda out=None: ops.nvfp4_fake_quantize(x, out=out))
    calls["onnx_uint8"] = kept_result(lambda out=None: ops.onnx_fake_quantize(x, np.float32(0.05), np.uint8(128),
                                                                             out=out))
    calls["onnx_e4m3"] = kept_result(lambda out=None: ops.onnx_fake_quantize(x, np.float32(0.05),
                                                                            dtype="float8e4m3fn", out=out))
    return calls


def output_bytes(name, shape):
    """Bytes of the full-size outputs an op has to allocate (per-channel vectors are negligible)."""
    return OP_INFO[name][2] * int(np.prod(shape)) * 4


def input_bytes(name, shape):
    return OP_INFO[name][1] * int(np.prod(shape)) * 4


# ---------------------------------------------------------------------------------------------- frameworks

def tf_callables(d, threads):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
    except RuntimeError:  # already initialised (in-process use after another TF call)
        pass
    raw = tf.raw_ops
    x, g = tf.constant(d["x"]), tf.constant(d["g"])
    mn, mx = tf.constant(np.float32(ARGS_MIN)), tf.constant(np.float32(ARGS_MAX))
    pmn, pmx = tf.constant(d["pc_min"]), tf.constant(d["pc_max"])
    scale, mean, var = (tf.constant(d[k]) for k in ("bn_scale", "bn_mean", "bn_var"))
    empty = tf.zeros([0], tf.float32)  # V3's reserve_space_3, unused on the CPU

    def done(r):
        return [t.numpy() for t in r] if isinstance(r, (list, tuple)) else r.numpy()

    calls = {
        "fq_args": lambda: done(raw.FakeQuantWithMinMaxArgs(inputs=x, min=ARGS_MIN, max=ARGS_MAX,
                                                             num_bits=NUM_BITS)),
        "fq_args_grad": lambda: done(raw.FakeQuantWithMinMaxArgsGradient(
            gradients=g, inputs=x, min=ARGS_MIN, max=ARGS_MAX, num_bits=NUM_BITS)),
        "fq_vars": lambda: done(raw.FakeQuantWithMinMaxVars(inputs=x, min=mn, max=mx, num_bits=NUM_BITS)),
        "fq_vars_grad": lambda: done(raw.FakeQuantWithMinMaxVarsGradient(gradients=g, inputs=x, min=mn, max=mx,
                                                                          num_bits=NUM_BITS)),
        "fq_per_channel": lambda: done(raw.FakeQuantWithMinMaxVarsPerChannel(inputs=x, min=pmn, max=pmx,
                                                                             num_bits=NUM_BITS)),
        "fq_per_channel_grad": lambda: done(raw.FakeQuantWithMinMaxVarsPerChannelGradient(
            gradients=g, inputs=x, min=pmn, max=pmx, num_bits=NUM_BITS)),
        "bn_grad": lambda: done(raw.FusedBatchNormGradV3(
            y_backprop=g, x=x, scale=scale, reserve_space_1=mean, reserve_space_2=var, reserve_space_3=empty,
            epsilon=EPSILON, data_format="NHWC", is_training=True))[:3],
    }
    calls["fq_vars_fwd+grad"] = lambda: (calls["fq_vars"](), calls["fq_vars_grad"]())
    calls["fq_per_channel_fwd+grad"] = lambda: (calls["fq_per_channel"](), calls["fq_per_channel_grad"]())
    info = {"version": tf.__version__, "intra_op_threads": threads,
            "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default (on)")}
    return calls, info


def torch_callables(d, threads):
    import torch

    torch.set_num_threads(threads)
    x, g = torch.from_numpy(d["x"]), torch.from_numpy(d["g"])
    xg = x.clone().requires_grad_(True)
    s, z, qmin, qmax = torch_grid(ARGS_MIN, ARGS_MAX)
    s, z = float(s), int(z)
    ps, pz, _, _ = torch_grid(d["pc_min"], d["pc_max"])
    ps, pz = torch.from_numpy(ps.astype(np.float32)), torch.from_numpy(pz)
    axis = x.dim() - 1  # NHWC: channels last, as TF's per-channel op

    def per_tensor_fwd_bwd():
        xg.grad = None
        y = torch.fake_quantize_per_tensor_affine(xg, s, z, qmin, qmax)
        y.backward(g)
        return y, xg.grad

    def per_channel_fwd_bwd():
        xg.grad = None
        y = torch.fake_quantize_per_channel_affine(xg, ps, pz, axis, qmin, qmax)
        y.backward(g)
        return y, xg.grad

    # NHWC data seen as NCHW in channels_last memory format: the same bytes, PyTorch's fast CPU path.
    x_cl, g_cl = x.permute(0, 3, 1, 2), g.permute(0, 3, 1, 2)
    weight, mean = torch.from_numpy(d["bn_scale"]), torch.from_numpy(d["bn_mean"])
    invstd = torch.from_numpy((1.0 / np.sqrt(d["bn_var"].astype(np.float64) + EPSILON)).astype(np.float32))

    def bn_backward():
        with torch.no_grad():
            return torch.ops.aten.native_batch_norm_backward(g_cl, x_cl, weight, None, None, mean, invstd, True,
                                                            EPSILON, [True, True, True])

    calls = {
        "fq_args": lambda: torch.fake_quantize_per_tensor_affine(x, s, z, qmin, qmax),
        "fq_vars": lambda: torch.fake_quantize_per_tensor_affine(x, s, z, qmin, qmax),
        "fq_per_channel": lambda: torch.fake_quantize_per_channel_affine(x, ps, pz, axis, qmin, qmax),
    }
    calls = {k: _no_grad(torch, f) for k, f in calls.items()}
    calls["fq_vars_fwd+grad"] = per_tensor_fwd_bwd
    calls["fq_per_channel_fwd+grad"] = per_channel_fwd_bwd
    calls["bn_grad"] = bn_backward
    info = {"version": torch.__version__, "threads": torch.get_num_threads()}
    return calls, info


def _no_grad(torch, f):
    def run():
        with torch.no_grad():
            return f()
    return run


class LocalRunner:
    """Times one framework's ops in this process; the callables of one size are kept at a time."""

    def __init__(self, kind, data_dir, threads):
        self.kind, self.data_dir, self.threads = kind, data_dir, threads
        self.size, self.calls, self.info = None, None, None

    def _calls(self, size):
        if size != self.size:
            self.calls = None
            gc.collect()
            d = load_data(self.data_dir, size)
            self.calls, self.info = (tf_callables if self.kind == "tf" else torch_callables)(d, self.threads)
            self.size = size
        return self.calls

    def request(self, req):
        """``{"cmd": "time"|"save"|"info", ...}`` -> reply dict (``error`` on failure, ``fatal`` if unusable)."""
        try:
            if req["cmd"] == "info":
                self._calls(req["size"])
                return {"info": self.info}
            calls = self._calls(req["size"])
        except Exception as exc:  # noqa: BLE001 - a broken install is reported, not fatal
            return {"error": f"{type(exc).__name__}: {exc}", "fatal": True}
        name = req["op"]
        if name not in calls:
            return {"absent": True}
        try:
            if req["cmd"] == "time":
                CLOCK["clock"] = time.process_time if req.get("cpu") else time.perf_counter
                return measure(calls[name], req["repeats"], req["min_time"])
            out = calls[name]()
            out = out if isinstance(out, list) else [out]
            np.savez(req["path"], *[np.asarray(o) for o in out])
            return {"saved": req["path"]}
        except Exception as exc:  # noqa: BLE001
            return {"error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"}

    def close(self):
        self.calls = None


class WorkerRunner:
    """The same requests, answered by this script in worker mode under another interpreter (a venv)."""

    def __init__(self, kind, python, data_dir, threads):
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [python, os.path.abspath(__file__), "--worker", kind, "--data", data_dir, "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)

    def request(self, req):
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            for line in self.proc.stdout:  # skip anything a library prints on stdout
                if line.startswith(_REPLY):
                    return json.loads(line[len(_REPLY):])
        except (BrokenPipeError, OSError):
            pass
        self.log.seek(0)
        tail = [ln for ln in self.log.read().strip().splitlines() if ln.strip()][-1:] or ["no output"]
        return {"error": f"worker exited ({self.proc.poll()}): {tail[0]}", "fatal": True}

    def close(self):
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001
            self.proc.kill()


_REPLY = "@@bench_ops@@ "


def serve(kind, data_dir, threads):
    """Worker mode: answer one JSON request per line on stdin, one reply line on stdout."""
    runner = LocalRunner(kind, data_dir, threads)
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints must not corrupt the replies
    for line in sys.stdin:
        if line.strip():
            out.write(_REPLY + json.dumps(runner.request(json.loads(line))) + "\n")
            out.flush()
    return 0


def open_runner(kind, python, data_dir, threads, first_size):
    """A runner for ``kind`` (in-process if it imports here, else a worker under ``python``), or a note."""
    module = "tensorflow" if kind == "tf" else "torch"
    if python:
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            return None, None, f"--{kind}-python {python}: not an executable file; {module} skipped"
        runner, where = WorkerRunner(kind, python, data_dir, threads), python
    else:
        import importlib.util

        if importlib.util.find_spec(module) is None:
            return None, None, f"{module} is not importable here and --{kind}-python was not given; skipped"
        runner, where = LocalRunner(kind, data_dir, threads), sys.executable + " (in-process)"
    reply = runner.request({"cmd": "info", "size": first_size})
    if "error" in reply:
        runner.close()
        return None, None, f"{module} under {where}: {reply['error']}; skipped"
    return runner, dict(reply["info"], python=where), None


# ---------------------------------------------------------------------------------------------- checks

def check_against_tf(data_dir, check_dir):
    """Compare qgcli's small-size outputs with TensorFlow's: bitwise where TF-exactness is promised."""
    d = load_data(data_dir, "small")
    calls = qgcli_callables(d)
    lines = []
    for name in CHECKED:
        path = os.path.join(check_dir, f"tf_{name}.npz")
        if not os.path.exists(path):
            continue
        with np.load(path) as z:
            theirs = [z[f"arr_{i}"] for i in range(len(z.files))]
        ours = calls[name]()
        ours = [np.asarray(o) for o in (ours if isinstance(ours, tuple) else (ours,))]
        parts = []
        for i, (a, b) in enumerate(zip(ours, theirs)):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            if a.shape != b.shape:
                parts.append(f"out{i}: shape {a.shape} vs TF {b.shape}")
                continue
            same = int(np.count_nonzero(a.view(np.uint32) == b.view(np.uint32)))
            denom = max(float(np.max(np.abs(b))), np.finfo(np.float32).tiny) if b.size else 1.0
            rel = float(np.max(np.abs(a.astype(np.float64) - b)) / denom) if b.size else 0.0
            parts.append(f"out{i}: {same}/{a.size} bit-identical, max|diff|/max|TF| {rel:.2e}")
        lines.append({"op": name, "result": "; ".join(parts)})
    return lines


# ---------------------------------------------------------------------------------------------- memory

def memory_worker(data_dir, size, name):
    """One qgcli op, once, in this fresh process: peak RSS growth and tracemalloc peak (bytes)."""
    import tracemalloc

    from qgcli import ops  # noqa: F401 - imported before the baseline

    d = load_data(data_dir, size)
    calls = qgcli_callables(d)
    gc.collect()
    base = _peak_rss()
    tracemalloc.start()
    out = calls[name]()
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    peak = _peak_rss()
    del out
    return {"rss_growth": peak - base, "traced_peak": traced_peak}


def _peak_rss():
    """This process's peak resident set size in bytes.

    ``VmHWM`` belongs to the address space, which ``exec`` replaces; ``ru_maxrss`` survives ``fork`` +
    ``exec`` and would report the (larger) parent's peak, so it is only the fallback off Linux.
    """
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def measure_memory(data_dir, size, ops):
    rows = []
    shape = SIZES[size]
    for name in ops:
        result_path = os.path.join(data_dir, f"mem_{name}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "mem", "--data", data_dir,
               "--result", result_path, "--sizes", size, "--ops", name]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            rows.append({"op": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]})
            continue
        with open(result_path) as fh:
            m = json.load(fh)
        out_b, in_b = output_bytes(name, shape), input_bytes(name, shape)
        rows.append({"op": name, "size": size, "inputs_bytes": in_b, "outputs_bytes": out_b,
                     "rss_growth_bytes": m["rss_growth"], "traced_peak_bytes": m["traced_peak"],
                     "extra_over_outputs_bytes": max(m["rss_growth"], m["traced_peak"]) - out_b})
    return rows


# ---------------------------------------------------------------------------------------------- report

def fmt_s(v):
    return "-" if v is None else f"{v:.4g}"


def fmt_r(v):
    return "-" if v is None else f"{v:.2f}"


def build_rows(sizes, ops, qg, floor, tf, torch, qg_out=None, floor_fresh=None):
    rows = []
    for size in sizes:
        for name in ops:
            _, n_read, n_written, _, _ = OP_INFO[name]
            q = qg.get(name, {}).get(size)
            fl = floor[size]["median"] * (n_read + n_written) / 2
            fresh = (floor_fresh or {}).get(size)
            ff = fresh["median"] * (n_read + n_written) / 2 if fresh else None
            t = (tf or {}).get("times", {}).get(name, {}).get(size)
            p = (torch or {}).get("times", {}).get(name, {}).get(size)
            qs = q["median"] if q else None
            k = (qg_out or {}).get(name, {}).get(size)
            rows.append({
                "qgcli_out_s": k["median"] if k else None, "x_floor_out": k["median"] / fl if k else None,
                "op": name, "size": size, "shape": list(SIZES[size]), "qgcli_s": qs,
                "floor_s": fl, "x_floor": qs / fl if qs else None,
                "fresh_floor_s": ff, "x_fresh_floor": qs / ff if (qs and ff) else None,
                "tf_s": t["median"] if t else None, "qgcli_over_tf": qs / t["median"] if (t and qs) else None,
                "torch_s": p["median"] if p else None,
                "qgcli_over_torch": qs / p["median"] if (p and qs) else None,
                "qgcli_min_s": q["min"] if q else None, "qgcli_n": q["n"] if q else None,
                "tensors_read": n_read, "tensors_written": n_written,
            })
    return rows


def table(rows):
    head = ["op", "size", "qgcli s", "floor s", "x floor", "x fresh floor", "out= s", "out= x floor", "TF s",
            "qgcli/TF", "torch s", "qgcli/torch"]
    body = [[r["op"], r["size"], fmt_s(r["qgcli_s"]), fmt_s(r["floor_s"]), fmt_r(r["x_floor"]),
             fmt_r(r.get("x_fresh_floor")),
             fmt_s(r.get("qgcli_out_s")), fmt_r(r.get("x_floor_out")), fmt_s(r["tf_s"]),
             fmt_r(r["qgcli_over_tf"]), fmt_s(r["torch_s"]), fmt_r(r["qgcli_over_torch"])] for r in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(b) for b in body])


def mb(b):
    return f"{b / 1e6:.1f} MB"


# ---------------------------------------------------------------------------------------------- main

def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tf-python", metavar="PATH", help="Python interpreter with TensorFlow (worker mode).")
    p.add_argument("--torch-python", metavar="PATH", help="Python interpreter with PyTorch (worker mode).")
    p.add_argument("--sizes", default="big,small", help="Comma list of: " + ", ".join(
        f"{k}={'x'.join(map(str, v))}" for k, v in SIZES.items()) + " (default: both).")
    p.add_argument("--ops", default=",".join(OP_NAMES), help="Comma list of ops (default: all).")
    p.add_argument("--repeats", type=int, default=7, help="Timed calls at least (default 7; minimum 5).")
    p.add_argument("--min-time", type=float, default=0.5,
                   help="Keep timing an op until this many seconds have passed (default 0.5).")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="TensorFlow intra-op / PyTorch threads (default: os.cpu_count()).")
    p.add_argument("--rounds", type=int, default=1,
                   help="Repeat the whole measurement; each op keeps its fastest median (default 1).")
    p.add_argument("--cpu", action="store_true",
                   help="Time in CPU time of the process (all its threads; the workers' too) instead of wall time.")
    p.add_argument("--no-memory", action="store_true", help="Skip the peak-memory subprocesses.")
    p.add_argument("--no-check", action="store_true", help="Skip the comparison with TensorFlow's outputs.")
    p.add_argument("--json", metavar="PATH", help="Also save the results as JSON.")
    p.add_argument("--worker", choices=["tf", "torch", "mem"], help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sizes = [s for s in args.sizes.split(",") if s]
    args.ops = [o for o in args.ops.split(",") if o]
    for s in args.sizes:
        if s not in SIZES:
            p.error(f"--sizes: unknown size {s!r}; use {', '.join(SIZES)}")
    for o in args.ops:
        if o not in OP_INFO:
            p.error(f"--ops: unknown op {o!r}; use {', '.join(OP_NAMES)}")
    if args.repeats < 5 and not args.worker:
        p.error("--repeats: at least 5")
    return args


def worker_main(args):
    if args.worker != "mem":
        return serve(args.worker, args.data, args.threads)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = memory_worker(args.data, args.sizes[0], args.ops[0])
    with open(args.result, "w") as fh:
        json.dump(result, fh)
    return 0


def _keep_best(table_, name, size, m):
    """Across rounds, keep each op's least disturbed median."""
    old = table_.setdefault(name, {}).get(size)
    if old is None or m["median"] < old["median"]:
        table_[name][size] = m


def main(argv=None):
    args = parse(argv)
    if args.worker:
        return worker_main(args)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
    from qgcli import __version__
    from qgcli.ops import blocked, native

    load_start = os.getloadavg()
    started = time.time()
    if args.cpu:
        CLOCK["clock"] = time.process_time
    data_dir = tempfile.mkdtemp(prefix="qgcli_bench_")
    check_dir = None if args.no_check or "small" not in args.sizes else os.path.join(data_dir, "check")
    if check_dir:
        os.makedirs(check_dir)
    notes, runners, infos = [], {}, {}
    times = {"qgcli": {}, "qgcli_out": {}, "tf": {}, "torch": {}}
    floor = {}
    try:
        print(f"# bench_ops: qgcli {__version__}, NumPy {np.__version__}, Python {platform.python_version()}, "
              f"os.cpu_count()={os.cpu_count()}, qgcli threads={blocked.workers()}, "
              f"kernels={native.variant()}, loadavg {load_start[0]:.2f}", file=sys.stderr)
        make_data(data_dir, args.sizes)
        for kind, python in (("tf", args.tf_python), ("torch", args.torch_python)):
            runners[kind], infos[kind], note = open_runner(kind, python, data_dir, args.threads, args.sizes[0])
            if note:
                notes.append(note)

        # Per op, qgcli, TensorFlow and PyTorch run back to back, so a change in the machine's load
        # between ops disturbs all three alike; the ratios are of timings seconds apart.
        for rnd in range(args.rounds):
            for size in args.sizes:
                _keep_best(floor, "copy", size, copy_time(SIZES[size], args.repeats, args.min_time))
                _keep_best(floor, "fresh", size, fresh_copy_time(SIZES[size], args.repeats, args.min_time))
                d = load_data(data_dir, size)
                calls, kept = qgcli_callables(d), qgcli_callables(d, kept=True)
                for name in args.ops:
                    _keep_best(times["qgcli"], name, size, measure(calls[name], args.repeats, args.min_time))
                    _keep_best(times["qgcli_out"], name, size, measure(kept[name], args.repeats, args.min_time))
                    line = (f"  round {rnd + 1} {size:<5} {name:<24} qgcli {times['qgcli'][name][size]['median']:.4g}"
                            f" out= {times['qgcli_out'][name][size]['median']:.4g}")
                    for kind, runner in runners.items():
                        if runner is None:
                            continue
                        reply = runner.request({"cmd": "time", "size": size, "op": name, "repeats": args.repeats,
                                                "min_time": args.min_time, "cpu": args.cpu})
                        if "error" in reply:
                            notes.append(f"{kind} {name}/{size}: {reply['error']}")
                            if reply.get("fatal"):
                                runner.close()
                                runners[kind] = None
                        elif "median" in reply:
                            _keep_best(times[kind], name, size, reply)
                            line += f" | {kind} {reply['median']:.4g}"
                    print(line, file=sys.stderr)
                del calls, kept, d
                gc.collect()
                # The copy again after the ops: the floor is the faster (less disturbed) reading.
                _keep_best(floor, "copy", size, copy_time(SIZES[size], args.repeats, args.min_time))
                _keep_best(floor, "fresh", size, fresh_copy_time(SIZES[size], args.repeats, args.min_time))
        floor, floor_fresh = floor.get("copy", {}), floor.get("fresh", {})

        checks = []
        if check_dir and runners.get("tf"):
            for name in CHECKED:
                if name in args.ops:
                    runners["tf"].request({"cmd": "save", "size": "small", "op": name,
                                           "path": os.path.join(check_dir, f"tf_{name}.npz")})
            checks = check_against_tf(data_dir, check_dir)
        for runner in runners.values():
            if runner is not None:
                runner.close()
        memory = [] if args.no_memory or "big" not in args.sizes else measure_memory(data_dir, "big", args.ops)
    finally:
        for runner in runners.values():
            if runner is not None:
                runner.close()
        shutil.rmtree(data_dir, ignore_errors=True)

    frameworks = {k: ({"times": times[k], "info": infos.get(k)} if infos.get(k) else None) for k in ("tf", "torch")}
    rows = build_rows(args.sizes, args.ops, times["qgcli"], floor, frameworks["tf"], frameworks["torch"],
                      times["qgcli_out"], floor_fresh)
    load_end = os.getloadavg()
    machine = {
        "cpu_count": os.cpu_count(), "qgcli_threads": blocked.workers(), "kernels": native.variant(),
        "platform": platform.platform(),
        "processor": _cpu_model(), "python": platform.python_version(), "numpy": np.__version__,
        "qgcli": __version__, "loadavg_start": load_start, "loadavg_end": load_end,
        "tf": (frameworks["tf"] or {}).get("info"), "torch": (frameworks["torch"] or {}).get("info"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(time.time() - started, 1),
        "rounds": args.rounds, "repeats": args.repeats, "min_time": args.min_time,
        "clock": "cpu (time.process_time)" if args.cpu else "wall (time.perf_counter)",
    }

    print(f"\nqgcli {__version__} | NumPy {np.__version__} | {machine['processor']} | "
          f"os.cpu_count()={os.cpu_count()} | qgcli threads {blocked.workers()} | kernels {native.variant()} | "
          f"loadavg {load_start[0]:.2f} -> {load_end[0]:.2f}")
    for kind, label in (("tf", "TensorFlow"), ("torch", "PyTorch")):
        info = machine[kind]
        if info:
            print(f"{label} {info.get('version')} ({', '.join(f'{k}={v}' for k, v in info.items() if k != 'version')})")
    print("floor: np.copyto of one tensor: " + ", ".join(
        f"{s} {floor[s]['median']:.4g} s ({mb(np.prod(SIZES[s]) * 4)})" for s in args.sizes)
          + "; floor = t_copy * (tensors read + written) / 2; fresh floor: the same with np.copy (a fresh "
          "destination: " + ", ".join(f"{s} {floor_fresh[s]['median']:.4g} s" for s in args.sizes if s in floor_fresh)
          + ")")
    print("clock: " + machine["clock"] + ("" if not args.cpu else ", all threads of the process counted"))
    print(f"medians of >= {args.repeats} timed calls (>= {args.min_time:g} s) after warm-up"
          + (f"; best median of {args.rounds} rounds per op" if args.rounds > 1 else "")
          + "; per op, qgcli, TF and PyTorch timed back to back")
    print()
    print(table(rows))
    print("\nqgcli s: a fresh output array per call (what a plain call does); out= s: the tensor-sized output "
          "written into a buffer kept from call to call (the fused rows: both of theirs). TF, PyTorch and every "
          "ratio but 'out= x floor' are of the fresh column; x fresh floor: the fresh column over the fresh floor.")
    print("\nPyTorch column: " + "; ".join(f"{o[0]} = {o[4]}" for o in OPS if o[4] and o[0] in args.ops)
          + ". Rows without a PyTorch counterpart show '-'.")
    if checks:
        print("\nqgcli vs TensorFlow outputs on the small tensor:")
        for c in checks:
            print(f"  {c['op']:<22} {c['result']}")
    if memory:
        print("\nPeak memory of one qgcli call on the big tensor (fresh process; inputs already loaded):")
        head = f"  {'op':<24} {'inputs':>10} {'outputs':>10} {'RSS growth':>11} {'traced peak':>12} {'extra':>10}"
        print(head)
        for m in memory:
            if "error" in m:
                print(f"  {m['op']:<24} error: {m['error']}")
                continue
            print(f"  {m['op']:<24} {mb(m['inputs_bytes']):>10} {mb(m['outputs_bytes']):>10} "
                  f"{mb(m['rss_growth_bytes']):>11} {mb(m['traced_peak_bytes']):>12} "
                  f"{mb(m['extra_over_outputs_bytes']):>10}")
        print("  extra = max(RSS growth, traced peak) - outputs: temporaries beyond the outputs the op returns")
    for n in notes:
        print(f"note: {n}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine, "floor": floor, "fresh_floor": floor_fresh, "rows": rows, "checks": checks,
                       "memory": memory, "notes": notes, "torch_column": {o[0]: o[4] for o in OPS}}, fh, indent=1)
        print(f"saved {args.json}", file=sys.stderr)
    return 0


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
