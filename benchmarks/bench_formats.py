#!/usr/bin/env python
"""Time the MX, NVFP4 and ONNX QuantizeLinear ops (issue 38) against the memory floor, in one run.

The tensor is bench_ops.py's (32, 56, 56, 256) float32 activation (25.7 M elements, 103 MB), seeded.  For each
op: the least wall time and the least process CPU time of ``--repeats`` calls, and both over the floor
measured in the same run, ``np.copyto`` of the tensor into a touched buffer (a copy reads one tensor and writes
one).  ``x floor``: CPU time over bench_ops.py's floor, the copy scaled to the bytes the op must move
(``t_copy * bytes / 8``: it reads 4 bytes an element and writes 4 of outputs plus 1 or 2 of codes).  CPU time
is the less noisy measure on a shared machine.  The ops allocate their outputs: the first touch of those pages
is part of their time, not of the copy's.

Usage (from the repository root)::

    python benchmarks/bench_formats.py [--repeats 3] [--shape 32,56,56,256]

Benchmarks are not tests: nothing here fails on a timing.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qgcli.ops import mx, nvfp4, onnx_quantize  # noqa: E402


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shape", default="32,56,56,256")
    args = ap.parse_args()
    shape = tuple(int(s) for s in args.shape.split(","))
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    out = np.empty_like(x)
    floor_w, floor_c = timed(lambda: np.copyto(out, x), max(5, args.repeats))
    channels = shape[-1]
    per_axis = np.full(shape[1], 0.02, np.float32)
    blocked = np.full(shape[:-1] + (channels // 32,), 0.02, np.float32)
    ops = [(f"mx {f} {m}", 1, lambda f=f, m=m: mx.mx_fake_quantize(x, format=f, scale_mode=m))
           for f in mx.FORMATS for m in ("floor", "rceil")]
    ops += [("nvfp4 per-tensor scale", 1, lambda: nvfp4.nvfp4_fake_quantize(x)),
            ("nvfp4 block scales only", 1, lambda: nvfp4.nvfp4_fake_quantize(x, per_tensor_scale=False)),
            ("onnx uint8 per-tensor", 1, lambda: onnx_quantize.onnx_fake_quantize(x, np.float32(0.02),
                                                                                 np.uint8(128))),
            ("onnx int8 per-axis 1", 1, lambda: onnx_quantize.onnx_fake_quantize(x, per_axis, dtype="int8")),
            ("onnx int16 per-tensor", 2, lambda: onnx_quantize.onnx_fake_quantize(x, np.float32(0.001),
                                                                                 dtype="int16")),
            ("onnx int4 blocked 32", 1, lambda: onnx_quantize.onnx_fake_quantize(x, blocked, dtype="int4", axis=-1,
                                                                                block_size=32)),
            ("onnx float8e4m3fn per-tensor", 1, lambda: onnx_quantize.onnx_fake_quantize(x, np.float32(0.02),
                                                                                       dtype="float8e4m3fn"))]
    print(f"tensor {list(shape)} float32 ({x.nbytes / 1e6:.0f} MB); np.copyto {floor_w * 1e3:.1f} ms wall, "
          f"{floor_c * 1e3:.1f} ms CPU; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'op':34s} {'wall ms':>9s} {'x copy':>7s} {'CPU ms':>9s} {'x copy CPU':>10s} {'x floor':>8s}")
    for name, code_bytes, fn in ops:
        w, c = timed(fn, args.repeats)
        floor = max(floor_c, 1e-9) * (8 + code_bytes) / 8
        print(f"{name:34s} {w * 1e3:9.1f} {w / floor_w:7.1f} {c * 1e3:9.1f} {c / max(floor_c, 1e-9):10.1f} "
              f"{c / floor:8.1f}")


if __name__ == "__main__":
    main()
