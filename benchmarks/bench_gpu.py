#!/usr/bin/env python
"""GPU benchmark and exactness check of qgcli's ops on CuPy (run by ``benchmarks/gpu_check.sh``).

1. **Bandwidth.**  Every op of ``bench_ops.py`` on CuPy arrays of ``--gib`` GiB per tensor (float32 NHWC,
   256 channels; default 1 GiB), timed end to end (wall clock between device synchronisations, host work
   included, after warm-up; median of ``--repeats``), against a device-to-device copy of one tensor:
   achieved bandwidth = (tensors read + tensors written) * bytes / time, and that as a percentage of the
   copy's bandwidth (goal of issue 8: at least 70 %).  The data tensors live on the device, the small
   per-channel vectors on the host, as ``qgcli ... --device gpu`` passes them.
2. **PyTorch** on the same GPU and the same bytes (DLPack, no copy): ``fake_quantize_per_tensor_affine`` and
   ``fake_quantize_per_channel_affine`` forward and forward+backward (autograd), and
   ``aten.native_batch_norm_backward`` (training, channels_last); qgcli/torch < 1 means qgcli is faster.
3. **Exactness.**  On a medium tensor with NaN, +-Inf, subnormals and values on the nudged bounds: CuPy's
   results against the CPU (NumPy) path, which the golden tests pin to TensorFlow.  Forward values and
   input gradients must be bit-identical (NaN matching NaN); min/max gradients are reported bitwise and as
   relative error; batch-norm outputs as relative error.

Usage (from the repository root, on a machine with CuPy and a CUDA device)::

    python benchmarks/bench_gpu.py --out OUTDIR          # OUTDIR/bench_gpu.json, OUTDIR/bench_gpu.txt

Without CuPy or a device it stops with exit code 2 and says so.  ``--cpu-dry-run`` runs the same code
with NumPy standing in for CuPy (and PyTorch on the CPU if it imports) on a small tensor, to check the
script itself on a machine without a GPU; its numbers mean nothing.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout

from bench_ops import ARGS_MAX, ARGS_MIN, EPSILON, NUM_BITS, OPS, qgcli_callables, torch_grid  # noqa: E402

CHANNELS = 256
MEDIUM = (16, 28, 28, 128)
EXACT_OPS = ["fq_args", "fq_args_grad", "fq_vars", "fq_vars_grad", "fq_per_channel", "fq_per_channel_grad"]


class Device:
    """The array module and how to wait for it: CuPy on a GPU, or NumPy for --cpu-dry-run."""

    def __init__(self, dry_run):
        self.dry_run = dry_run
        if dry_run:
            self.xp = np
            self.info = {"device": "CPU dry run (NumPy standing in for CuPy)"}
            return
        try:
            import cupy
        except Exception as exc:  # ImportError, or a CUDA library that fails to load
            raise SystemExit(f"bench_gpu.py: needs CuPy with a CUDA device, and CuPy does not import "
                             f"({type(exc).__name__}: {exc}); install cupy-cuda12x/cupy-cuda13x, or use "
                             f"--cpu-dry-run to exercise the script without a GPU") from None
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:
            raise SystemExit(f"bench_gpu.py: CuPy found no usable CUDA device ({exc})") from None
        if count < 1:
            raise SystemExit("bench_gpu.py: CuPy found no CUDA device")
        self.xp = cupy
        props = cupy.cuda.runtime.getDeviceProperties(0)
        self.info = {
            "device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
            "memory_gib": round(props["totalGlobalMem"] / 2 ** 30, 1),
            "multiprocessors": props["multiProcessorCount"],
            "cupy": cupy.__version__,
            "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "cuda_driver": cupy.cuda.runtime.driverGetVersion(),
        }

    def sync(self):
        if not self.dry_run:
            self.xp.cuda.Device().synchronize()

    def free(self):
        if not self.dry_run:
            self.xp.get_default_memory_pool().free_all_blocks()


def measure(dev, fn, repeats, warmup=3):
    """Median and minimum wall time of ``fn()`` between device synchronisations."""
    for _ in range(warmup):  # the first call compiles the kernels (NVRTC)
        fn()
    dev.sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        dev.sync()
        times.append(time.perf_counter() - t0)
        del out
    return {"median": statistics.median(times), "min": min(times), "n": len(times)}


def device_data(dev, shape, seed=11):
    """Seeded tensors made on the device (no host round trip); small vectors on the host."""
    xp = dev.xp
    try:
        rng = xp.random.default_rng(seed)
        x = rng.standard_normal(shape, dtype=np.float32)
        g = rng.standard_normal(shape, dtype=np.float32)
    except (AttributeError, TypeError, NotImplementedError):  # an older CuPy's Generator
        rng = xp.random.RandomState(seed)
        x = rng.standard_normal(shape, dtype=np.float32)
        g = rng.standard_normal(shape, dtype=np.float32)
    x *= np.float32(3.0)
    c = shape[-1]
    hrng = np.random.default_rng(seed)
    axes = tuple(range(len(shape) - 1))
    mean = x.mean(axis=axes, dtype=np.float64)
    var = ((x - mean.astype(np.float32)) ** 2).mean(axis=axes, dtype=np.float64)
    host = lambda a: np.asarray(a.get() if hasattr(a, "get") else a)  # noqa: E731
    return dict(x=x, g=g, pc_min=(-hrng.uniform(4.0, 8.0, c)).astype(np.float32),
                pc_max=hrng.uniform(4.0, 8.0, c).astype(np.float32),
                bn_scale=hrng.uniform(0.5, 1.5, c).astype(np.float32),
                bn_mean=host(mean).astype(np.float32), bn_var=host(var).astype(np.float32))


def torch_calls(dev, d):
    """PyTorch's counterparts on the same memory (DLPack), or (None, reason)."""
    try:
        import torch
    except Exception as exc:
        return None, f"PyTorch does not import ({type(exc).__name__}: {exc})"
    if dev.dry_run:
        tdev = "cpu"
        to_t = torch.from_numpy
    else:
        if not torch.cuda.is_available():
            return None, "PyTorch sees no CUDA device"
        tdev = "cuda"
        to_t = torch.from_dlpack
    x, g = to_t(d["x"]), to_t(d["g"])
    xg = x.clone().requires_grad_(True)
    s, z, qmin, qmax = torch_grid(ARGS_MIN, ARGS_MAX)
    s, z = float(s), int(z)
    ps, pz, _, _ = torch_grid(d["pc_min"], d["pc_max"])
    ps = torch.from_numpy(ps.astype(np.float32)).to(tdev)
    pz = torch.from_numpy(pz).to(tdev)
    axis = x.dim() - 1
    x_cl, g_cl = x.permute(0, 3, 1, 2), g.permute(0, 3, 1, 2)  # NHWC bytes as channels_last NCHW
    weight = torch.from_numpy(d["bn_scale"]).to(tdev)
    mean = torch.from_numpy(d["bn_mean"]).to(tdev)
    invstd = torch.from_numpy((1.0 / np.sqrt(d["bn_var"].astype(np.float64) + EPSILON)).astype(np.float32)).to(tdev)

    def no_grad(f):
        def run():
            with torch.no_grad():
                return f()
        return run

    def fwd_bwd(f):
        def run():
            xg.grad = None
            y = f(xg)
            y.backward(g)
            return y, xg.grad
        return run

    per_tensor = lambda t: torch.fake_quantize_per_tensor_affine(t, s, z, qmin, qmax)  # noqa: E731
    per_channel = lambda t: torch.fake_quantize_per_channel_affine(t, ps, pz, axis, qmin, qmax)  # noqa: E731
    calls = {
        "fq_args": no_grad(lambda: per_tensor(x)),
        "fq_vars": no_grad(lambda: per_tensor(x)),
        "fq_vars_fwd+grad": fwd_bwd(per_tensor),
        "fq_per_channel": no_grad(lambda: per_channel(x)),
        "fq_per_channel_fwd+grad": fwd_bwd(per_channel),
        "bn_grad": no_grad(lambda: torch.ops.aten.native_batch_norm_backward(
            g_cl, x_cl, weight, None, None, mean, invstd, True, EPSILON, [True, True, True])),
    }
    return (calls, {"version": torch.__version__, "device": tdev}), None


def bandwidth(dev, shape, repeats, use_torch):
    xp = dev.xp
    n_bytes = int(np.prod(shape)) * 4
    src = xp.ones(shape, np.float32)
    dst = xp.zeros(shape, np.float32)
    copy = measure(dev, lambda: xp.copyto(dst, src), repeats)
    del src, dst
    dev.free()
    copy_bw = 2 * n_bytes / copy["median"]

    d = device_data(dev, shape)
    calls = qgcli_callables(d)
    torch_result, note = torch_calls(dev, d) if use_torch else (None, "PyTorch skipped (--no-torch)")
    rows, errors = [], {}
    for name, n_read, n_written, _, torch_label in OPS:
        moved = (n_read + n_written) * n_bytes
        row = {"op": name, "gib_moved": moved / 2 ** 30, "torch_op": torch_label}
        try:
            t = measure(dev, calls[name], repeats)
            row.update(qgcli_ms=t["median"] * 1e3, qgcli_min_ms=t["min"] * 1e3,
                       gb_s=moved / t["median"] / 1e9, pct_copy=100 * moved / t["median"] / copy_bw)
        except Exception as exc:  # noqa: BLE001 - one failing op must not hide the others
            errors[f"qgcli {name}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        dev.free()
        if torch_result and name in torch_result[0]:
            try:
                tt = measure(dev, torch_result[0][name], repeats)
                row.update(torch_ms=tt["median"] * 1e3)
                if "qgcli_ms" in row:
                    row["qgcli_over_torch"] = row["qgcli_ms"] / row["torch_ms"]
            except Exception as exc:  # noqa: BLE001
                errors[f"torch {name}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        rows.append(row)
    return {"shape": list(shape), "tensor_gib": n_bytes / 2 ** 30, "copy_ms": copy["median"] * 1e3,
            "copy_gb_s": copy_bw / 1e9, "rows": rows, "errors": errors, "torch_note": note,
            "torch": torch_result[1] if torch_result else None}


def special_inputs(shape, seed=5):
    """Medium host tensors salted with the values where TF-exactness is hardest."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    k = flat.size // 50
    idx = rng.choice(flat.size, size=8 * k, replace=False).reshape(8, k)
    tiny = np.finfo(np.float32).tiny
    flat[idx[0]] = np.nan
    flat[idx[1]] = np.inf
    flat[idx[2]] = -np.inf
    flat[idx[3]] = rng.uniform(-tiny, tiny, k).astype(np.float32)  # subnormals
    flat[idx[4]] = np.float32(ARGS_MIN)
    flat[idx[5]] = np.float32(ARGS_MAX)
    # Values on the grid's half-steps: where floor(v + 0.5) and a contracted FMA would disagree.
    scale = np.float32((ARGS_MAX - ARGS_MIN) / (2 ** NUM_BITS - 1))
    flat[idx[6]] = (rng.integers(-120, 120, k) + np.float32(0.5)).astype(np.float32) * scale
    flat[idx[7]] = -0.0
    g.reshape(-1)[idx[3][: k // 2]] = rng.uniform(-tiny, tiny, k // 2).astype(np.float32)
    c = shape[-1]
    pc_min = (-rng.uniform(0.5, 8.0, c)).astype(np.float32)
    pc_max = rng.uniform(0.5, 8.0, c).astype(np.float32)
    pc_min[:2], pc_max[:2] = 0.0, 0.0  # min == max == 0: TF's pass-through channels
    return x, g, pc_min, pc_max


def exactness(dev, shape):
    from qgcli.backend import to_numpy

    x, g, pc_min, pc_max = special_inputs(shape)
    axes = tuple(range(len(shape) - 1))
    finite = np.where(np.isfinite(x), x, 0).astype(np.float32)
    mean = finite.mean(axis=axes, dtype=np.float64).astype(np.float32)
    var = ((finite - mean) ** 2).mean(axis=axes, dtype=np.float64).astype(np.float32)
    scale = np.random.default_rng(3).uniform(0.5, 1.5, shape[-1]).astype(np.float32)
    host = dict(x=x, g=g, pc_min=pc_min, pc_max=pc_max, bn_scale=scale, bn_mean=mean, bn_var=var)
    bn_host = dict(host, x=finite)
    on_dev = dict(host, x=dev.xp.asarray(x), g=dev.xp.asarray(g))
    bn_dev = dict(on_dev, x=dev.xp.asarray(finite))
    cpu_calls, dev_calls = qgcli_callables(host), qgcli_callables(on_dev)
    cpu_bn, dev_bn = qgcli_callables(bn_host)["bn_grad"], qgcli_callables(bn_dev)["bn_grad"]
    results = []
    for name in EXACT_OPS + ["bn_grad"]:
        try:
            ref = cpu_bn() if name == "bn_grad" else cpu_calls[name]()
            got = dev_bn() if name == "bn_grad" else dev_calls[name]()
        except Exception as exc:  # noqa: BLE001
            results.append({"op": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
            continue
        ref = ref if isinstance(ref, tuple) else (ref,)
        got = got if isinstance(got, tuple) else (got,)
        outs, ok = [], True
        for i, (a, b) in enumerate(zip(got, ref)):
            a, b = np.asarray(to_numpy(a), np.float32), np.asarray(b, np.float32)
            both_nan = np.isnan(a) & np.isnan(b)
            same = (a.view(np.uint32) == b.view(np.uint32)) | both_nan
            fin = np.isfinite(b) & np.isfinite(a)
            denom = float(np.max(np.abs(b[fin]))) if fin.any() else 0.0
            rel = float(np.max(np.abs(a[fin].astype(np.float64) - b[fin])) / denom) if denom else 0.0
            must = name != "bn_grad" and (i == 0)  # forward values and input gradients: bit for bit
            if must and not bool(same.all()):
                ok = False
            outs.append({"output": i, "elements": int(a.size), "bit_identical": int(same.sum()),
                         "max_rel_diff": rel, "must_be_bitwise": must})
        results.append({"op": name, "ok": ok, "outputs": outs})
    return {"shape": list(shape), "results": results}


def render(report):
    lines = []
    m = report["machine"]
    extra = ", ".join(f"{k} {v}" for k, v in m["device"].items() if k != "device")
    lines.append(f"# bench_gpu: {m['device'].get('device')}" + (f" | {extra}" if extra else "")
                 + f" | numpy {m['numpy']} | qgcli {m['qgcli']} | host CPUs {m['host_cpus']}")
    b = report["bandwidth"]
    lines.append(f"tensors: float32 NHWC {tuple(b['shape'])}, {b['tensor_gib']:.2f} GiB each; device-to-device copy "
                 f"of one: {b['copy_ms']:.3f} ms = {b['copy_gb_s']:.0f} GB/s (read + write); medians of "
                 f"{report['repeats']} after 3 warm-ups")
    if b.get("torch"):
        lines.append(f"PyTorch {b['torch']['version']} on {b['torch']['device']}")
    elif b.get("torch_note"):
        lines.append(f"PyTorch: {b['torch_note']}")
    lines.append("")
    head = ["op", "GiB moved", "qgcli ms", "GB/s", "% of copy", "torch ms", "qgcli/torch"]
    body = []
    for r in b["rows"]:
        body.append([r["op"], f"{r['gib_moved']:.2f}", f"{r['qgcli_ms']:.3f}" if "qgcli_ms" in r else "error",
                     f"{r['gb_s']:.0f}" if "gb_s" in r else "-", f"{r['pct_copy']:.0f} %" if "pct_copy" in r else "-",
                     f"{r['torch_ms']:.3f}" if "torch_ms" in r else "-",
                     f"{r['qgcli_over_torch']:.2f}" if "qgcli_over_torch" in r else "-"])
    widths = [max(len(c) for c in col) for col in zip(head, *body)]
    fmt = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    lines += [fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(r) for r in body]
    lines.append("GiB moved = (tensors read + written once) x tensor size; % of copy = achieved bandwidth / "
                 "copy bandwidth (goal >= 70 %). torch: " + "; ".join(
                     f"{o[0]} = {o[4]}" for o in OPS if o[4]))
    for k, v in b["errors"].items():
        lines.append(f"error: {k}: {v}")
    e = report["exactness"]
    lines.append("")
    lines.append(f"Exactness, device vs CPU path, {tuple(e['shape'])} with NaN/Inf/subnormals/bounds/half-steps:")
    for r in e["results"]:
        if "error" in r:
            lines.append(f"  {r['op']:<22} ERROR {r['error']}")
            continue
        parts = [f"out{o['output']} {o['bit_identical']}/{o['elements']} bitwise"
                 + ("" if o["bit_identical"] == o["elements"] else f" (max rel {o['max_rel_diff']:.1e})")
                 for o in r["outputs"]]
        lines.append(f"  {r['op']:<22} {'OK  ' if r['ok'] else 'FAIL'} " + "; ".join(parts))
    lines.append(f"total {report['seconds']:.1f} s")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="GiB per tensor for the bandwidth runs (default 1).")
    p.add_argument("--repeats", type=int, default=20, help="Timed calls per op (default 20).")
    p.add_argument("--out", metavar="DIR", help="Write DIR/bench_gpu.json and DIR/bench_gpu.txt.")
    p.add_argument("--no-torch", action="store_true", help="Skip PyTorch.")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="NumPy instead of CuPy on a small tensor: checks the script, measures nothing useful.")
    args = p.parse_args(argv)
    try:
        dev = Device(args.cpu_dry_run)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    from qgcli import __version__

    started = time.time()
    n = max(1, round(args.gib * 2 ** 28 / (64 * 64 * CHANNELS)))
    shape = (n, 64, 64, CHANNELS) if not args.cpu_dry_run else (4, 32, 32, CHANNELS)
    repeats = args.repeats if not args.cpu_dry_run else 3
    print(f"bench_gpu: {dev.info.get('device')}, tensors {shape}", file=sys.stderr, flush=True)
    report = {"machine": {"device": dev.info, "numpy": np.__version__, "qgcli": __version__,
                          "python": platform.python_version(), "host_cpus": os.cpu_count()},
              "repeats": repeats, "dry_run": args.cpu_dry_run}
    report["bandwidth"] = bandwidth(dev, shape, repeats, not args.no_torch)
    dev.free()
    report["exactness"] = exactness(dev, MEDIUM if not args.cpu_dry_run else (2, 8, 8, 16))
    report["seconds"] = time.time() - started
    text = render(report)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_gpu.json"), "w") as fh:
            json.dump(report, fh, indent=1)
        with open(os.path.join(args.out, "bench_gpu.txt"), "w") as fh:
            fh.write(text + "\n")
    return 0 if all(r["ok"] for r in report["exactness"]["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
