"""Run-file overhead: 500 small groups (64x64 per-channel weights) through fakequant-grad and report.

    python benchmarks/bench_runfile.py [--groups 500] [--repeat 5]

Prints the time (median of --repeat, the ops and the CLI alternated) of the ops alone (the library calls on arrays already in memory), of the CLI over the run
file (in-process, so interpreter start-up is not counted), and the overhead per group beyond the ops; then
the same in CPU time (``time.process_time``, the minimum of --repeat: on a machine shared with other work
the CPU time a run took moves less than its wall time).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

from weight_runs import make_weight_run


def timed(fn):
    """(wall, CPU) seconds of one call."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    from click.testing import CliRunner

    from qgcli import ops
    from qgcli.cli import main as cli
    from qgcli.ops.analysis import channel_report

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.h5")
        arrays = make_weight_run(path, args.groups)
        runner = CliRunner()

        def grad_ops():
            for g, x, lo, hi in arrays:
                ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, lo, hi)

        def grad_cli():
            r = runner.invoke(cli, ["fakequant-grad", path, "-o", os.path.join(tmp, "out.h5"), "--force", "-q"])
            assert r.exit_code == 0, r.output

        def report_ops():
            for g, x, lo, hi in arrays:
                channel_report(x, lo, hi, g)

        def report_cli():
            r = runner.invoke(cli, ["report", path, "--json", "-q"])
            assert r.exit_code == 0, r.output

        n = args.groups
        for name, op_fn, cli_fn in (("fakequant-grad", grad_ops, grad_cli), ("report", report_ops, report_cli)):
            ops_times, cli_times = [], []
            for _ in range(args.repeat):  # alternated, so that load on the machine hits both alike
                ops_times.append(timed(op_fn))
                cli_times.append(timed(cli_fn))
            t_ops, t_cli = (statistics.median(t[0] for t in times) for times in (ops_times, cli_times))
            c_ops, c_cli = (min(t[1] for t in times) for times in (ops_times, cli_times))
            print(f"{name:15s} {n} groups: ops {t_ops * 1e3:8.1f} ms, CLI {t_cli * 1e3:8.1f} ms, "
                  f"overhead {(t_cli - t_ops) / n * 1e3:.2f} ms/group; CPU: ops {c_ops * 1e3:8.1f} ms, "
                  f"CLI {c_cli * 1e3:8.1f} ms, overhead {(c_cli - c_ops) / n * 1e3:.2f} ms/group", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
