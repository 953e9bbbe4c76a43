"""Many small groups: qgcli inspect / report / fakequant-grad against a plain h5py script (issue 27).

    python benchmarks/bench_groups.py [--groups 2000 20000] [--repeat 3] [--keep DIR]

Builds (seeded, in a temporary folder unless --keep) run files of N groups, each one small per-channel
FakeQuant layer (inputs (8, 4) float32, min/max (4,), gradients), nested ``step_S/block_B/layer_L/wq`` as
captured run files are.  For each command it times the CLI in-process (interpreter start-up not counted)
and the *h5py floor*: a plain script doing the least equivalent work, with the same ops on the same arrays:

* inspect:        ``visititems`` once, every object's attributes, shape/dtype of every dataset, then reading
                  each dataset and its statistics (``--no-stats``: no reading);
* report:         ``visititems`` once, the group attributes, reading the four operands, the per-group report;
* fakequant-grad: the same reading, the gradient op, and one HDF5 group with its datasets and provenance
                  attributes written per layer.

Old and new code can be compared in one process: ``--qgcli PATH`` puts another checkout first on sys.path.
Every figure is the best of --repeat runs; the ratio is qgcli / floor.
"""
import argparse
import os
import sys
import tempfile
import time


def make(path, groups, seed=0):
    import h5py
    import numpy as np

    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        for i in range(groups):
            w = rng.standard_normal((8, 4)).astype(np.float32)
            hi = (np.abs(w).max(axis=0) * 0.8).astype(np.float32)
            g = f.create_group(f"step_{i // 200:03d}/block_{(i // 10) % 20:02d}/layer_{i % 10}/wq")
            g.attrs["op"] = "FakeQuantWithMinMaxVarsPerChannel"
            g.attrs["num_bits"] = 8
            g["inputs"] = w
            g["min"] = -hi
            g["max"] = hi
            g["gradients"] = (rng.standard_normal(w.shape) * 1e-2).astype(np.float32)


def _walk(f):
    import h5py

    groups, datasets = [], []

    def visit(name, obj):
        (groups if isinstance(obj, h5py.Group) else datasets).append((name, obj))

    f.visititems(visit)
    return groups, datasets


def floor_inspect(path, stats=True):
    import h5py

    from qgcli.commands.inspect import tensor_stats

    with h5py.File(path, "r") as f:
        groups, datasets = _walk(f)
        out = [dict(g.attrs) for _, g in groups]
        for _, d in datasets:
            out.append((d.shape, d.dtype, dict(d.attrs)))
            if stats:
                tensor_stats(d[()])
    return out


def _layers(f):
    groups, _ = _walk(f)
    for name, g in groups:
        attrs = dict(g.attrs)
        if "op" in attrs:
            yield name, attrs, g["inputs"][()], g["min"][()], g["max"][()], g["gradients"][()]


def floor_report(path):
    import h5py

    from qgcli.ops.analysis import channel_report

    with h5py.File(path, "r") as f:
        return [channel_report(x, lo, hi, gr) for _, _, x, lo, hi, gr in _layers(f)]


def floor_grad(path, out):
    import h5py

    from qgcli import __version__, ops

    with h5py.File(path, "r") as f, h5py.File(out, "w") as o:
        for name, attrs, x, lo, hi, gr in _layers(f):
            dx, dmin, dmax = ops.fake_quant_with_min_max_vars_per_channel_gradient(gr, x, lo, hi)
            g = o.create_group(name)
            g["backprops_wrt_input"] = dx
            g["backprop_wrt_min"] = dmin
            g["backprop_wrt_max"] = dmax
            g.attrs["qgcli_version"] = __version__
            g.attrs["op"] = attrs["op"]
            g.attrs["num_bits"] = attrs["num_bits"]


def best(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, nargs="+", default=[2000, 20000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", help="build the files in DIR (kept; reused when present)")
    parser.add_argument("--only", nargs="+", choices=("inspect", "inspect-no-stats", "report", "fakequant-grad"))
    parser.add_argument("--qgcli", help="a checkout whose qgcli to time instead of this one")
    args = parser.parse_args()
    if args.qgcli:
        sys.path.insert(0, os.path.abspath(args.qgcli))
    from click.testing import CliRunner

    from qgcli.cli import main as cli

    runner = CliRunner()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        where = args.keep or tmp
        os.makedirs(where, exist_ok=True)
        for n in args.groups:
            path = os.path.join(where, f"groups_{n}.h5")
            if not os.path.exists(path):
                make(path, n)
            out = os.path.join(tmp, "out.h5")

            def run(argv):
                r = runner.invoke(cli, argv)
                assert r.exit_code == 0, r.output[-2000:]

            cases = {
                "inspect": (lambda: run(["inspect", path, "--json"]), lambda: floor_inspect(path)),
                "inspect-no-stats": (lambda: run(["inspect", path, "--json", "--no-stats"]),
                                     lambda: floor_inspect(path, stats=False)),
                "report": (lambda: run(["report", path, "--json", "-q"]), lambda: floor_report(path)),
                "fakequant-grad": (lambda: run(["fakequant-grad", path, "-o", out, "--force", "-q"]),
                                   lambda: floor_grad(path, os.path.join(tmp, "floor.h5"))),
            }
            for name, (mine, floor) in cases.items():
                if args.only and name not in args.only:
                    continue
                t_floor, t_mine = [], []
                for _ in range(args.repeat):  # interleaved, so that load on the machine hits both alike
                    t_floor.append(best(floor, 1))
                    t_mine.append(best(mine, 1))
                rows.append((name, n, min(t_mine), min(t_floor)))
                print(f"{name:17s} {n:6d} groups: qgcli {min(t_mine):7.2f} s  h5py floor {min(t_floor):7.2f} s  "
                      f"ratio {min(t_mine) / min(t_floor):5.2f}  overhead "
                      f"{(min(t_mine) - min(t_floor)) / n * 1e3:6.3f} ms/group", flush=True)
    print()
    print("| command | groups | qgcli s | h5py floor s | ratio |")
    print("|---|---|---|---|---|")
    for name, n, mine, floor in rows:
        print(f"| {name} | {n} | {mine:.2f} | {floor:.2f} | {mine / floor:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
