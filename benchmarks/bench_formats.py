#!/usr/bin/env python
"""Time the MX, NVFP4 and ONNX QuantizeLinear ops (issue 38) against the memory floor, in one run.

The tensor is bench_ops.py's (32, 56, 56, 256) float32 activation (25.7 M elements, 103 MB), seeded.  Each op
runs twice over: **fresh** (the op allocates its outputs, whose first touch, the kernel zeroing fresh pages,
is part of its time) and **reused** (``out=`` an earlier result: the same arrays written again, as a caller
quantizing tensor after tensor does).  For each: the least wall time and the least process CPU time of
``--repeats`` calls, each over the floor.  The copy is timed before the ops and after them; the floor is the
faster of the two (the less disturbed).

**floor** is bench_ops.py's: ``np.copyto`` of the tensor into a touched buffer (it reads 4 bytes an element
and writes 4), scaled to the bytes the op must move, ``t_copy * bytes / 8``: it reads ``x`` (4 bytes an
element, plus ONNX's blocked scales) and writes ``outputs`` (4), ``quantized`` (1 or 2) and the block scales
(MX: 1 byte per 32 elements, NVFP4: 1 per 16).  The copy runs on one thread and the ops on the thread pool
(2 threads here), so CPU time over CPU floor is the work against the copy's work, and wall over wall floor
what a user waits; CPU time is the less noisy measure on a shared machine.

Usage (from the repository root)::

    python benchmarks/bench_formats.py [--repeats 3] [--shape 32,56,56,256] [--ops mx,nvfp4,onnx]

Benchmarks are not tests: nothing here fails on a timing.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qgcli.ops import blocked, mx, native, nvfp4, onnx_quantize  # noqa: E402


def timed(fn, repeats):
    """The least wall time and the least CPU time of ``repeats`` calls (each its own minimum: on a shared
    machine the call with the best wall time is not the one with the best CPU time)."""
    walls, cpus = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return min(walls), min(cpus)


def cases(x):
    """``(name, bytes moved per element, op(out=...))`` for each op timed."""
    shape = x.shape
    per_axis = np.full(shape[1], 0.02, np.float32)
    blocked_scales = np.full(shape[:-1] + (shape[-1] // 32,), 0.02, np.float32)
    rows = [(f"mx {f} {m}", 9 + 1 / 32, lambda f=f, m=m, **k: mx.mx_fake_quantize(x, format=f, scale_mode=m, **k))
            for f in mx.FORMATS for m in ("floor", "rceil")]
    rows += [
        ("nvfp4 per-tensor scale", 9 + 1 / 16, lambda **k: nvfp4.nvfp4_fake_quantize(x, **k)),
        ("nvfp4 block scales only", 9 + 1 / 16,
         lambda **k: nvfp4.nvfp4_fake_quantize(x, per_tensor_scale=False, **k)),
        ("onnx uint8 per-tensor", 9, lambda **k: onnx_quantize.onnx_fake_quantize(x, np.float32(0.02),
                                                                                 np.uint8(128), **k)),
        ("onnx int8 per-axis 1", 9, lambda **k: onnx_quantize.onnx_fake_quantize(x, per_axis, dtype="int8", **k)),
        ("onnx int16 per-tensor", 10, lambda **k: onnx_quantize.onnx_fake_quantize(x, np.float32(0.001),
                                                                                  dtype="int16", **k)),
        ("onnx int4 blocked 32", 9 + 4 / 32, lambda **k: onnx_quantize.onnx_fake_quantize(
            x, blocked_scales, dtype="int4", axis=-1, block_size=32, **k)),
        ("onnx float8e4m3fn per-tensor", 9, lambda **k: onnx_quantize.onnx_fake_quantize(
            x, np.float32(0.02), dtype="float8e4m3fn", **k)),
        ("onnx float4e2m1 per-tensor", 9, lambda **k: onnx_quantize.onnx_fake_quantize(
            x, np.float32(0.02), dtype="float4e2m1", **k)),
    ]
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shape", default="32,56,56,256")
    ap.add_argument("--ops", default="mx,nvfp4,onnx", help="comma list of op-name prefixes (default: all)")
    args = ap.parse_args()
    shape = tuple(int(s) for s in args.shape.split(","))
    prefixes = tuple(p for p in args.ops.split(",") if p)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    dst = np.ones_like(x)  # touched: page faults are not part of the floor
    load = os.getloadavg()[0]
    floor_w, floor_c = timed(lambda: np.copyto(dst, x), max(5, args.repeats))
    print(f"tensor {list(shape)} float32 ({x.nbytes / 1e6:.0f} MB); np.copyto {floor_w * 1e3:.1f} ms wall, "
          f"{floor_c * 1e3:.1f} ms CPU; kernels {native.variant()}, {blocked.workers()} threads, "
          f"{os.cpu_count()} CPUs; load average {load:.1f} at the start")
    rows = []
    with np.errstate(all="ignore"):
        for name, nbytes, op in cases(x):
            if not name.startswith(prefixes):
                continue
            fw, fc = timed(op, args.repeats)
            earlier = op()
            rw, rc = timed(lambda: op(out=earlier), args.repeats)
            del earlier
            rows.append((name, nbytes, fc, rc, fw, rw))
            print(f"  {name}: fresh {fc * 1e3:.1f} ms CPU, reused {rc * 1e3:.1f} ms CPU", file=sys.stderr, flush=True)
    end_w, end_c = timed(lambda: np.copyto(dst, x), max(5, args.repeats))
    # the floor is the less disturbed of the two copies, one before the ops and one after
    floor_w, floor_c = min(floor_w, end_w), min(floor_c, end_c)
    print(f"np.copyto again at the end: {end_w * 1e3:.1f} ms wall, {end_c * 1e3:.1f} ms CPU; load average "
          f"{os.getloadavg()[0]:.1f} at the end; floor from the faster copy: {floor_w * 1e3:.1f} ms wall, "
          f"{floor_c * 1e3:.1f} ms CPU")
    print("floor = copy time x bytes moved / 8; x floor: time over the floor (fresh: outputs allocated by the op; "
          "reused: out= an earlier result)\n")
    head = ["op", "B/elem", "fresh CPU ms", "x floor", "reused CPU ms", "x floor", "fresh wall ms", "x floor",
            "reused wall ms", "x floor"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for name, nbytes, fc, rc, fw, rw in rows:
        cf, wf = floor_c * nbytes / 8, floor_w * nbytes / 8
        print(f"| {name} | {nbytes:.3g} | {fc * 1e3:.1f} | {fc / cf:.2f} | {rc * 1e3:.1f} | {rc / cf:.2f} | "
              f"{fw * 1e3:.1f} | {fw / wf:.2f} | {rw * 1e3:.1f} | {rw / wf:.2f} |")

if __name__ == "__main__":
    main()
