"""Thousands of groups: qgcli inspect / report / fakequant-grad against a plain h5py script (issue 27).

    python benchmarks/bench_groups.py [--groups 2000 20000 200000] [--nested 500 1000 2000]
                                      [--small 2000 20000] [--repeat 3] [--keep DIR] [--only inspect report ...]
                                      [--cpu] [--base CHECKOUT]

Builds, seeded, in a temporary folder (or DIR, kept and reused), the two files of issue 27 as run files and
the many-small-groups file of issue 42:

* ``flat_N.h5``: N groups side by side, each one FakeQuantWithMinMaxArgs layer holding a (2,) float32
  ``inputs`` and its ``gradients`` (the issue's one dataset, and the gradient fakequant-grad needs);
* ``nested_N.h5``: N groups nested one inside the other, the same layer at the bottom;
* ``small_N.h5``: N groups side by side, each holding one (2,) float32 dataset and nothing else (no
  attributes, no layer: ``inspect`` only).  Its floor is h5py's own ``visititems`` reading every dataset
  (``d[()]``), nothing more, for ``inspect`` and ``inspect --no-stats`` alike.

Each command runs as a subprocess (``python -m qgcli ...``, output to /dev/null, so start-up, the JSON writing
and peak RSS are the real ones) alternated with its *h5py floor*, a plain script doing the least equivalent
work: ``visititems`` over the file with every object's attributes and every dataset's shape/dtype, then
reading each dataset (inspect: with its statistics; --no-stats: no reading), or reading each layer's operands
and running the op (report: the per-layer analysis; fakequant-grad: the gradient, written as one HDF5 group
with its datasets and attributes per layer).  The floor runs as a subprocess too.  Figures are the median of
--repeat runs; ratio = qgcli / floor; peak RSS the largest of the runs (the floor holds every object it
walked, as a plain ``visititems`` script does).  The slope is a least-squares fit of seconds against groups over the
flat sizes (microseconds per group), with the ratio of per-group cost between the largest and smallest
size (1.0 = linear).

``--cpu``: the figures are CPU seconds (user + system of the subprocess, the minimum of --repeat) instead of
wall seconds: on a machine shared with other work the CPU a run took moves less than its wall time.
``--base CHECKOUT``: the same qgcli command also run from another checkout (``PYTHONPATH=CHECKOUT``, e.g. a
worktree of ``main`` with its kernels built), alternated with the other two, for a before/after in one run;
its figure and its ratio to the floor are printed after qgcli's.

The nested file deeper than qgcli's default bound (512) is run with ``--max-depth``.  h5py's own visit
builds every full path name, so the floor is quadratic in the depth, and so is inspect's output (it lists
every path): the nested sizes stay in the thousands.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = ("inspect", "inspect --no-stats", "report", "fakequant-grad")


def make_flat(path, groups, seed=0):
    import h5py
    import numpy as np

    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        for i in range(groups):
            g = f.create_group(f"g{i:07d}")
            g.attrs["op"] = "FakeQuantWithMinMaxArgs"
            g["inputs"] = rng.standard_normal(2).astype(np.float32) * 4
            g["gradients"] = rng.standard_normal(2).astype(np.float32)


def make_small(path, groups, seed=0):
    import h5py
    import numpy as np

    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        for i in range(groups):
            f.create_group(f"g{i:07d}")["x"] = rng.standard_normal(2).astype(np.float32)


def make_nested(path, groups, seed=0):
    import h5py
    import numpy as np

    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        gid = f.id
        for _ in range(groups):
            gid = h5py.h5g.create(gid, b"g")  # relative to the last one: h5py's by-path create is quadratic
        g = h5py.Group(gid)
        g.attrs["op"] = "FakeQuantWithMinMaxArgs"
        g["inputs"] = rng.standard_normal(2).astype(np.float32) * 4
        g["gradients"] = rng.standard_normal(2).astype(np.float32)


# --- the floors (run as: python bench_groups.py --floor COMMAND FILE OUT) --------------------------------------

def _walk(f):
    import h5py

    groups, datasets = [], []
    f.visititems(lambda name, obj: (groups if isinstance(obj, h5py.Group) else datasets).append((name, obj)))
    return groups, datasets


def floor(command, path, out):
    import h5py

    if command == "read":  # h5py's own visit, reading every dataset
        with h5py.File(path, "r") as f:
            arrays = []
            f.visititems(lambda name, obj: arrays.append((name, obj[()])) if isinstance(obj, h5py.Dataset) else None)
        return arrays
    with h5py.File(path, "r") as f:
        groups, datasets = _walk(f)
        listing = [(name, dict(g.attrs)) for name, g in groups]
        listing += [(name, d.shape, d.dtype, dict(d.attrs)) for name, d in datasets]
        if command == "inspect":
            from qgcli.cli.commands.inspect import tensor_stats

            for _, d in datasets:
                tensor_stats(d[()])
        elif command == "report":
            from qgcli.ops.analysis import channel_report

            for _, g in groups:
                if "op" in g.attrs:
                    x = g["inputs"][()]
                    channel_report(x, -6.0, 6.0, g["gradients"][()], variant="args")
        elif command == "fakequant-grad":
            from qgcli import __version__, ops

            with h5py.File(out, "w") as o:
                for name, g in groups:
                    if "op" in g.attrs:
                        dx = ops.fake_quant_with_min_max_args_gradient(g["gradients"][()], g["inputs"][()])
                        og = o.create_group(name)
                        og["backprops_wrt_input"] = dx
                        og.attrs["qgcli_version"] = __version__
                        og.attrs["op"] = g.attrs["op"]
    return listing


# --- timing ------------------------------------------------------------------------------------------------------

def _timed(argv, env=None, cwd=None):
    """Wall seconds, CPU seconds (user + system) and peak RSS (MiB) of one subprocess run (GNU time's %M)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-f", "%M", *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       env=env, cwd=cwd, text=True)
    seconds = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {r.stderr[-2000:]}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return seconds, cpu, int(r.stderr.strip().splitlines()[-1]) / 1024


def measure(file, command, repeat, tmp, depth, floor_command=None, *, cpu=False, base=None):
    out = os.path.join(tmp, "out.h5")
    words = command.split()
    qgcli = [sys.executable, "-m", "qgcli", *words, file, *(("--json",) if words[0] != "fakequant-grad" else
                                                            ("-o", out, "--force", "-q")),
             "--max-depth", str(max(512, depth + 1))]
    floor_cmd = [sys.executable, os.path.abspath(__file__), "--floor",
                 floor_command or command.replace(" --no-stats", "-no-stats"), file, os.path.join(tmp, "floor.h5")]
    mine, floor_s, rss, floor_rss, before = [], [], [], [], []
    pick = 1 if cpu else 0
    # Each qgcli from its checkout, started in the temporary folder (a current directory holding a qgcli/ would
    # come first on sys.path): this script's own checkout, and --base's.
    here = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    base_env = None if base is None else {**os.environ, "PYTHONPATH": os.path.abspath(base)}
    for _ in range(repeat):  # alternated, so that load on the machine hits all alike
        *s, peak = _timed(floor_cmd)
        floor_s.append(s[pick])
        floor_rss.append(peak)
        *s, peak = _timed(qgcli, here, tmp)
        mine.append(s[pick])
        rss.append(peak)
        if base_env is not None:
            before.append(_timed(qgcli, base_env, tmp)[pick])
    figure = min if cpu else statistics.median
    return figure(mine), figure(floor_s), max(rss), max(floor_rss), (figure(before) if before else None)


def slope(points):
    """Least-squares seconds per group over (groups, seconds) points, in microseconds."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points) * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, nargs="*", default=[2000, 20000, 200000])
    parser.add_argument("--nested", type=int, nargs="*", default=[2000])
    parser.add_argument("--small", type=int, nargs="*", default=[2000, 20000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", help="build the files in DIR (kept; reused when present)")
    parser.add_argument("--only", nargs="+", choices=COMMANDS)
    parser.add_argument("--cpu", action="store_true", help="CPU seconds (min of --repeat), not wall (median)")
    parser.add_argument("--base", metavar="CHECKOUT", help="also run qgcli from this checkout, alternated")
    parser.add_argument("--floor", nargs=3, metavar=("COMMAND", "FILE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor:
        command, path, out = args.floor
        floor(command, path, out)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        where = os.path.abspath(args.keep or tmp)
        os.makedirs(where, exist_ok=True)
        files = [(f"flat_{n}.h5", n, make_flat, 1) for n in args.groups]
        files += [(f"nested_{n}.h5", n, make_nested, n) for n in args.nested]
        files += [(f"small_{n}.h5", n, make_small, 1) for n in args.small]
        unit = "CPU s" if args.cpu else "s"
        extra = f" base {unit} | base ratio |" if args.base else ""
        print(f"| file | command | qgcli {unit} | floor {unit} | ratio | qgcli peak RSS MiB | floor peak RSS MiB |{extra}")
        print("|---|---|---|---|---|---|---|" + ("---|---|" if args.base else ""))
        for name, n, make, depth in files:
            path = os.path.join(where, name)
            if not os.path.exists(path):
                make(path, n)
            small = name.startswith("small_")
            for command in COMMANDS:
                if args.only and command not in args.only or small and not command.startswith("inspect"):
                    continue
                mine, base, rss, floor_rss, before = measure(path, command, args.repeat, tmp, depth,
                                                             "read" if small else None, cpu=args.cpu, base=args.base)
                rows.append((name, n, command, mine, base))
                extra = f" {before:.2f} | {before / base:.2f}x |" if before is not None else ""
                print(f"| {name} | {command} | {mine:.2f} | {base:.2f} | {mine / base:.2f}x | {rss:.0f} | {floor_rss:.0f} |"
                      f"{extra}", flush=True)
    flat = [r for r in rows if r[0].startswith("flat_")]
    if len({r[1] for r in flat}) > 1:
        print()
        print("| command | slope, qgcli us/group | slope, floor us/group | per-group cost, largest / smallest |")
        print("|---|---|---|---|")
        for command in COMMANDS:
            pts = sorted((n, mine, base) for _, n, c, mine, base in flat if c == command)
            if len(pts) < 2:
                continue
            growth = (pts[-1][1] / pts[-1][0]) / (pts[0][1] / pts[0][0])
            print(f"| {command} | {slope([(n, m) for n, m, _ in pts]):.0f} | {slope([(n, b) for n, _, b in pts]):.0f} "
                  f"| {growth:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
