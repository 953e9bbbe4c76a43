"""1 vs 2 Dask workers (issue 20): a run file of 200 groups and a Zarr tensor of 1 GiB, through the CLI.

    flock /tmp/qgcli-bench.lock python benchmarks/bench_dask.py [--groups 200] [--tensor-mib 1024]
                                                               [--repeat 3] [--keep DIR]

Builds (seeded, in a temporary folder unless --keep) a run file of N per-channel fake-quant groups (inputs
and gradients 256 x 256 float32 each) and a Zarr store holding a (rows, 1024) float32 tensor of
--tensor-mib MiB with its gradients (16 MiB chunks: 64 blocks for 1 GiB).  Each case runs
``fakequant-grad`` in-process (interpreter start-up not counted) with the clusters started beforehand
(their ~3 s start-up not counted either): here without --scheduler, on a LocalCluster of 1 worker process,
of 2 (one thread each); the modes alternate within each repeat and the median of --repeat is printed.

* run file: the client discovers the groups, workers compute them (reading the file themselves), results
  travel back and the client writes the .h5.  "waited" is the share of the wall time the client spent
  waiting for results (workers' compute plus the transfer); the rest is its own work, mostly writing.
* Zarr tensor: workers read their input chunks, compute and write their output chunks; printed are the
  wall time, GiB/s of input, and the worker time per block split into read / compute / write.

Every output is checked against the local run's, bit for bit.
"""
import argparse
import contextlib
import io
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from weight_runs import make_weight_run  # noqa: E402 - beside this script


def make_store(path, mib, seed=0):
    import zarr

    rows = max(1, (mib << 20) // (1024 * 4))
    group = zarr.create_group(path, zarr_format=3)
    chunk = (16 << 20) // (1024 * 4)
    rng = np.random.default_rng(seed)
    for name in ("inputs", "gradients"):
        array = group.create_array(name, shape=(rows, 1024), dtype="float32", chunks=(chunk, 1024), compressors=None)
        for r in range(0, rows, chunk):
            array[r:r + chunk] = rng.standard_normal((min(chunk, rows - r), 1024), dtype=np.float32)
    group.create_array("min", data=np.full(1024, -1.5, np.float32))
    group.create_array("max", data=np.full(1024, 1.5, np.float32))


def cli(*args):
    """The CLI in-process; returns (seconds, its --json summary)."""
    from qgcli.cli import main

    out = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(out):
        main([str(a) for a in args] + ["--json", "--force"], standalone_mode=False)
    return time.perf_counter() - started, json.loads(out.getvalue())


def same_outputs(a, b):
    if a.endswith(".h5"):
        import h5py

        with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
            items = []
            fa.visititems(lambda n, o: items.append(n) if isinstance(o, h5py.Dataset) else None)
            return all(fa[n][()].tobytes() == fb[n][()].tobytes() for n in items) and len(items) > 0
    import zarr

    za, zb = zarr.open_group(a, mode="r"), zarr.open_group(b, mode="r")
    names = sorted(za.array_keys())
    return names == sorted(zb.array_keys()) and all(
        np.array_equal(za[n][...].view(np.uint32), zb[n][...].view(np.uint32)) for n in names)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=200)
    parser.add_argument("--tensor-mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", help="build the inputs in this folder and keep them")
    args = parser.parse_args()
    import distributed

    folder = args.keep or tempfile.mkdtemp(prefix="qgcli-bench-dask-")
    os.makedirs(folder, exist_ok=True)
    run, store = os.path.join(folder, "run.h5"), os.path.join(folder, "big.zarr")
    if not os.path.exists(run):
        make_weight_run(run, args.groups, side=256)
    if not os.path.exists(store):
        make_store(store, args.tensor_mib)
    print(f"{os.cpu_count()} CPU cores; run file {os.path.getsize(run) / 2**20:.0f} MiB ({args.groups} groups), "
          f"Zarr tensor {args.tensor_mib} MiB (+ its gradients)", flush=True)
    clusters = {n: distributed.LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                            dashboard_address=":0", silence_logs=logging.ERROR) for n in (1, 2)}
    try:
        modes = {"here": (), "1 worker": ("--scheduler", clusters[1].scheduler_address),
                 "2 workers": ("--scheduler", clusters[2].scheduler_address)}
        cases = {"run file": (run, ".h5"), "Zarr tensor": (store, ".zarr")}
        for case, (source, suffix) in cases.items():
            modes_here = dict(modes)
            if case == "Zarr tensor":  # the same blocks without Dask: what the cluster adds
                modes_here = {"here": (), "blocks here": ("--memory-limit", f"{args.tensor_mib * 2}M"),
                              **{k: v for k, v in modes.items() if k != "here"}}
            times = {m: [] for m in modes_here}
            summaries = {}
            for _ in range(args.repeat):
                for mode, extra in modes_here.items():
                    out = os.path.join(folder, f"out-{mode.replace(' ', '-')}{suffix}")
                    seconds, summaries[mode] = cli("fakequant-grad", source, "-o", out, "-q", *extra)
                    times[mode].append(seconds)
            want = os.path.join(folder, f"out-here{suffix}")
            print(f"\n{case}: fakequant-grad {os.path.basename(source)} (median of {args.repeat})")
            for mode in modes_here:
                out = os.path.join(folder, f"out-{mode.replace(' ', '-')}{suffix}")
                wall = statistics.median(times[mode])
                s = summaries[mode]
                line = f"  {mode:11s} {wall:7.2f} s  x{statistics.median(times['here']) / wall:4.2f}"
                if case == "run file":
                    line += f"  {args.groups / wall:6.1f} groups/s"
                    if "cluster" in s:
                        line += f"  waited {s['cluster']['wait_s'] / times[mode][-1]:4.0%} (compute+transfer)"
                else:
                    line += f"  {args.tensor_mib / wall:6.1f} MiB/s of tensor"
                    if "blocks" in s:
                        b = s["blocks"]
                        per = {k: v / b["count"] * 1e3 for k, v in b["seconds"].items()}
                        total = sum(b["seconds"].values())
                        line += (f"  {b['count']} blocks; per block read {per['read']:.0f} ms, compute "
                                 f"{per['compute']:.0f} ms, write {per['write']:.0f} ms"
                                 f" (write {b['seconds']['write'] / total:.0%} of worker time)")
                print(line + ("" if same_outputs(want, out) else "  OUTPUT DIFFERS"), flush=True)
    finally:
        logging.getLogger("distributed").setLevel(logging.ERROR)  # no INFO lines as the clusters close
        for cluster in clusters.values():
            cluster.close()
        if not args.keep:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
