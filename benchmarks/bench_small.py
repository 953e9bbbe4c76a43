#!/usr/bin/env python
"""Small calls: qgcli's per-call cost on the small tensor (8, 14, 14, 64) against TensorFlow's and PyTorch's.

    python benchmarks/bench_small.py [--repeats 7] [--calls 200] [--threads N] [--cpu] [--no-tf] [--no-torch]

Each op is called ``--calls`` times in a row (after warm-up) and the mean of that run is one sample;
``--repeats`` samples are taken, qgcli, TensorFlow and PyTorch alternated, and the minimum sample is
reported (min-of-N: on a shared machine the minimum is the figure least disturbed by other load).  The
ratios are taken in the same run.  TensorFlow and PyTorch run in this process (eager ``tf.raw_ops``, results
forced with ``.numpy()``; PyTorch under ``no_grad`` except the fwd+grad rows) with the same op calls as
``bench_ops.py``; ``--threads`` (default: the CPU count) is qgcli's pool (``QGCLI_THREADS``), TensorFlow's
intra-op threads and PyTorch's threads alike.  On a machine shared with other work, ``--threads 1`` keeps
the frameworks' spinning worker threads from measuring the other load.  Benchmarks are not tests:
nothing here fails on a timing.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_ops  # noqa: E402


def sample(fn, calls, clock=time.perf_counter):
    t0 = clock()
    for _ in range(calls):
        fn()
    return (clock() - t0) / calls


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--no-tf", action="store_true")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--ops", default=",".join(bench_ops.OP_NAMES))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cpu", action="store_true",
                        help="CPU time of the process (time.process_time) instead of wall time: with --threads 1, "
                             "what a call costs whatever else the machine runs")
    args = parser.parse_args()
    d = bench_ops.make_arrays("small")
    threads = args.threads
    os.environ["QGCLI_THREADS"] = str(threads)
    sides = {"qgcli": bench_ops.qgcli_callables(d)}
    if not args.no_tf:
        sides["TF"] = bench_ops.tf_callables(d, threads)[0]
    if not args.no_torch:
        sides["torch"] = bench_ops.torch_callables(d, threads)[0]
    print(f"small tensor {bench_ops.SIZES['small']}, min of {args.repeats} samples of {args.calls} calls, "
          f"{threads} thread(s), {'CPU' if args.cpu else 'wall'} time, load average {os.getloadavg()[0]:.2f}")
    head = f"{'op':24s} " + " ".join(f"{s + ' us':>9s}" for s in sides)
    head += "".join(f" {'qgcli/' + s:>12s}" for s in sides if s != "qgcli")
    print(head)
    for name in args.ops.split(","):
        best = {}
        for side, calls in sides.items():
            if name in calls:
                for _ in range(3):
                    calls[name]()
        for _ in range(args.repeats):
            for side, calls in sides.items():
                if name in calls:
                    t = sample(calls[name], args.calls, time.process_time if args.cpu else time.perf_counter)
                    best[side] = min(best.get(side, t), t)
        row = f"{name:24s} " + " ".join(f"{best[s] * 1e6:9.1f}" if s in best else f"{'-':>9s}" for s in sides)
        row += "".join(f" {best['qgcli'] / best[s]:12.2f}" if s in best else f" {'-':>12s}"
                       for s in sides if s != "qgcli")
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
