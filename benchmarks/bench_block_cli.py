"""The block formats through the CLI on a 103 MB .npy, in memory and streamed, against copying the file.

Each command runs as its own process (``python -m qgcli fakequant --inputs x.npy --semantics ... -o out.h5
-q``), in memory and with ``--memory-limit`` below the tensor (streamed in row blocks), and the floors are
``cp x.npy`` and a Python process that loads the .npy and saves ``np.copy`` of it to an .npy; the figure is
each process's CPU time (user + system, ``os.wait4``; the machine may be shared: CPU time moves less than wall
time), the least of ``--repeats`` runs, with its wall time and peak RSS.  Usage::

    python benchmarks/bench_block_cli.py [--repeats 3] [--limit 64M] [--folder DIR]
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

SHAPE = (32, 56, 56, 256)  # float32: 102.8 MB, bench_ops.py's "big"
CASES = {
    "mx mxfp8-e4m3": ("--semantics", "mx"),
    "mx mxfp4 rceil": ("--semantics", "mx", "--mx-format", "mxfp4", "--scale-mode", "rceil"),
    "nvfp4": ("--semantics", "nvfp4"),
    "onnx uint8": ("--semantics", "onnx", "--y-scale", "0.02", "--y-zero-point", "128"),
    "onnx float8e4m3fn": ("--semantics", "onnx", "--y-scale", "0.02", "--dtype", "float8e4m3fn"),
}


def timed(cmd, cwd, env=None):
    """(CPU seconds, wall seconds, peak RSS MiB) of one process."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    err = proc.stderr.read().decode()
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(cmd)} failed: {err}")
    return usage.ru_utime + usage.ru_stime, wall, usage.ru_maxrss / 1024


def best(cmd, cwd, repeats, env=None):
    runs = [timed(cmd, cwd, env) for _ in range(repeats)]
    return min(runs, key=lambda r: r[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--limit", default="64M", help="--memory-limit of the streamed runs (default 64M)")
    ap.add_argument("--folder", help="where the files go (default: a temporary folder)")
    args = ap.parse_args()
    folder = args.folder or tempfile.mkdtemp(prefix="qgcli-block-cli-")
    py = sys.executable
    # in a process of its own: a child's peak RSS counts the parent's pages at the fork
    subprocess.run([py, "-c", f"import numpy as np; np.save('x.npy', np.random.default_rng(38).standard_normal("
                    f"{SHAPE}, dtype=np.float32))"], cwd=folder, check=True)
    env = dict(os.environ, QGCLI_NO_PROGRESS="1")
    floors = {"cp": best(["cp", "x.npy", "copy.npy"], folder, args.repeats),
              "np.copy": best([py, "-c", "import numpy as np; np.save('copy.npy', np.copy(np.load('x.npy')))"],
                              folder, args.repeats)}
    print(f"# {np.prod(SHAPE) * 4 / 1e6:.1f} MB float32 .npy, least CPU time of {args.repeats}, "
          f"loadavg {os.getloadavg()[0]:.2f}")
    print("| command | CPU s | wall s | peak RSS MiB | CPU x cp | CPU x np.copy |")
    print("|---|---|---|---|---|---|")
    for name, (cpu, wall, rss) in floors.items():
        print(f"| {name} | {cpu:.3f} | {wall:.3f} | {rss:.0f} | | |")
    base = floors["np.copy"][0]
    for name, options in CASES.items():
        for how, extra in (("in memory", ()), (f"streamed ({args.limit})", ("--memory-limit", args.limit))):
            cmd = [py, "-m", "qgcli", "fakequant", "--inputs", "x.npy", *options, "-o", "out.h5", "--force", "-q",
                   *extra]
            cpu, wall, rss = best(cmd, folder, args.repeats, env)
            print(f"| {name}, {how} | {cpu:.3f} | {wall:.3f} | {rss:.0f} | {cpu / floors['cp'][0]:.2f} | "
                  f"{cpu / base:.2f} |")
    print(f"# loadavg {os.getloadavg()[0]:.2f}")
    if not args.folder:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
