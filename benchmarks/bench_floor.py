#!/usr/bin/env python
"""The fake-quant ops on the big tensor against the copy floors, in CPU time, checkouts alternated.

    python benchmarks/bench_floor.py [--trees PATH ...] [--threads 1,2] [--rounds 3] [--calls 7]

Each op of ``bench_ops.py`` (the same seeded (32, 56, 56, 256) float32 tensors and calls) is timed in CPU
time of its process (``time.process_time``: every thread counts), the minimum of ``--calls`` calls after a
warm-up, best of ``--rounds`` rounds, two ways:

* ``out=``: its tensor-sized outputs in buffers kept from call to call, against the **floor**: ``np.copyto``
  of one tensor into a touched buffer, times (tensors read + written) / 2;
* fresh: a plain call, which allocates its outputs, against the **fresh floor**: the floor plus, per tensor
  written, what ``np.copy`` (a fresh array) costs beyond ``np.copyto`` (its page faults).

Each (checkout, thread count) runs in a subprocess of its own with ``PYTHONPATH`` at the checkout (each with
its compiled kernels built) and ``QGCLI_THREADS`` set; a round runs every pair, starting one later each round,
so that a load that comes and goes weighs on all alike.  The floors are NumPy's single-threaded copies in
every column: two threads that wait on memory both count CPU time, so a 2-thread figure above the 1-thread
one is the memory's share, not the kernels'.  Benchmarks are not tests: nothing fails on a timing.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OPS = ["fq_args", "fq_vars", "fq_per_channel", "fq_args_grad", "fq_vars_grad", "fq_per_channel_grad",
       "fq_vars_fwd+grad", "fq_per_channel_fwd+grad"]


def cpu_min(fn, calls):
    fn()
    best = float("inf")
    for _ in range(calls):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def worker(calls):
    """This checkout's figures (PYTHONPATH), as JSON on stdout: seconds by op and mode, and the two floors."""
    sys.path.insert(0, HERE)
    import bench_ops

    d = bench_ops.make_arrays("big")
    fresh, kept = bench_ops.qgcli_callables(d), bench_ops.qgcli_callables(d, kept=True)
    src, dst = np.ones_like(d["x"]), np.zeros_like(d["x"])
    result = {"copy": cpu_min(lambda: np.copyto(dst, src), calls), "np.copy": cpu_min(lambda: np.copy(src), calls)}
    for name in OPS:
        result[name] = {"out=": cpu_min(kept[name], calls), "fresh": cpu_min(fresh[name], calls)}
    result["copy"] = min(result["copy"], cpu_min(lambda: np.copyto(dst, src), calls))
    result["np.copy"] = min(result["np.copy"], cpu_min(lambda: np.copy(src), calls))
    from qgcli.ops import native

    result["kernels"] = native.variant()
    print(json.dumps(result))


def ratios(r):
    """``{op: {mode: ratio}}`` of one run: out= over the floor, fresh over the fresh floor."""
    faults = max(0.0, r["np.copy"] - r["copy"])
    table = {}
    for name in OPS:
        _, n_read, n_written, _, _ = OP_INFO[name]
        floor = r["copy"] * (n_read + n_written) / 2
        table[name] = {"out=": r[name]["out="] / floor, "fresh": r[name]["fresh"] / (floor + faults * n_written)}
    return table


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", nargs="+", default=[os.path.dirname(HERE)],
                   help="Checkouts to compare, each with its kernels built (default: this one).")
    p.add_argument("--threads", default="1,2", help="Comma list of QGCLI_THREADS values (default 1,2).")
    p.add_argument("--rounds", type=int, default=3, help="Rounds; each figure keeps its best (default 3).")
    p.add_argument("--calls", type=int, default=7, help="Timed calls per figure, the minimum kept (default 7).")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.calls)
    runs = [(tree, t) for t in args.threads.split(",") for tree in args.trees]
    best, kernels = {}, {}
    load = os.getloadavg()[0]
    start = time.strftime("%Y-%m-%d %H:%M")
    for rnd in range(args.rounds):
        for k in range(len(runs)):
            tree, threads = runs[(rnd + k) % len(runs)]
            env = dict(os.environ, PYTHONPATH=tree, QGCLI_THREADS=threads)
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--calls", str(args.calls)],
                                 env=env, capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            kernels[tree] = r.pop("kernels")
            key = (tree, threads)
            if key not in best:
                best[key] = r
            else:  # each figure its best over the rounds
                for name, v in r.items():
                    best[key][name] = (min(best[key][name], v) if not isinstance(v, dict)
                                       else {m: min(best[key][name][m], v[m]) for m in v})
            print(f"  round {rnd + 1}: {tree} threads={threads} done", file=sys.stderr)
    threads = args.threads.split(",")
    print(f"bench_floor {start}, load average {load:.2f} -> {os.getloadavg()[0]:.2f}, os.cpu_count()={os.cpu_count()},"
          f" CPU time, min of {args.calls} calls, best of {args.rounds} rounds")
    for tree in args.trees:
        r1 = best[(tree, threads[0])]
        print(f"\n{tree} (kernels {kernels[tree]}): np.copyto {r1['copy'] * 1e3:.2f} ms, "
              f"np.copy {r1['np.copy'] * 1e3:.2f} ms of CPU for one tensor")
        head = ["op"] + [f"{mode}, {t} thread{'s' if t != '1' else ''}" for t in threads for mode in ("fresh", "out=")]
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        table = {t: ratios(best[(tree, t)]) for t in threads}
        for name in OPS:
            cells = [f"{table[t][name][mode]:.2f}" for t in threads for mode in ("fresh", "out=")]
            print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


sys.path.insert(0, HERE)
from bench_ops import OP_INFO  # noqa: E402 - after the path to this directory

if __name__ == "__main__":
    sys.exit(main())
