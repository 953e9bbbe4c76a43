"""One figure per layer: 200 groups (64x64 per-channel weights) drawn into a folder, in this process and on
worker processes (``qgcli plot staircase RUN -o DIR/``).

    python benchmarks/bench_layer_figures.py [--groups 200] [--kind staircase] [--repeat 2]

Prints the best-of-N wall time for jobs=1 (in-process) and for every core (worker processes, start-up
included), and the figures per second.
"""
import argparse
import os
import sys
import tempfile
import time

from weight_runs import make_weight_run


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=200)
    parser.add_argument("--kind", default="staircase", choices=("staircase", "ste", "hist", "channels"))
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    from qgcli.report import layer_figures

    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.h5")
        make_weight_run(path, args.groups)
        tasks, _ = layer_figures.plan(path, args.kind)
        results = {}
        for jobs in sorted({1, cores}):
            times = []
            for r in range(args.repeat):
                out = os.path.join(tmp, f"figs_{jobs}_{r}")
                t = time.perf_counter()
                _, _, used = layer_figures.write_all(tasks, out + "/", jobs=jobs)
                times.append(time.perf_counter() - t)
            results[jobs] = min(times)
            print(f"plot {args.kind}: {len(tasks)} figures, jobs={jobs} ({used} worker processes): "
                  f"best of {args.repeat} {min(times):.2f} s, {len(tasks) / min(times):.1f} figures/s")
        if len(results) > 1:
            print(f"speed-up on {cores} cores: {results[1] / results[cores]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
