"""Byte-compare the files two qgcli revisions write for the same command lines.

    python benchmarks/same_outputs.py [--base 5fc9586] [--groups 200] [--size 4000000]

Checks out ``--base`` into a temporary git worktree (its compiled kernels built in place), then runs each
command line below once with the base's sources and once with this checkout's (``python -m qgcli``, each
tree first on PYTHONPATH), every output into a folder of its own, and compares the two folders file by file:
the same bytes (``filecmp.cmp(shallow=False)``), or the command line is listed as differing.  A .safetensors
file compares its header as JSON and its data bytes, since the safetensors writer orders ``__metadata__``
differently from run to run.  The inputs are the samples, a weight run file of ``--groups`` groups
(benchmarks/weight_runs.py) and bundles of ``--size`` float32 values, in memory and streamed
(``--memory-limit``), uncompressed and compressed.  Exit status 1 when any output differs.

``--h5-content``: an HDF5 output whose bytes differ is compared object by object (paths in visiting order,
kinds, shapes, dtypes, data bytes, layout, chunks, filters, fill value, attributes with their values and
types) and listed as "same objects" when they all match: for a change that makes the same objects in
another order in the file (run-file output groups copied from templates since issue 42, items 3-4).

Only written tensors are compared: summaries and ``--json`` documents gained fields on purpose since the base
(upstream_gradient, notes), so they are not expected to stay the same.
"""
import argparse
import filecmp
import json
import os
import struct
import subprocess
import sys
import tempfile

import h5py
import numpy as np

from weight_runs import make_weight_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = os.path.join(ROOT, "samples")

# (label, argv after "qgcli", output name); {in} is the inputs folder, {out} the command's output path.
COMMANDS = [
    ("fakequant notebook", ["fakequant", "{samples}/notebook.h5", "-o", "{out}"], "out.h5"),
    ("fakequant-grad notebook 2 bits", ["fakequant-grad", "{samples}/notebook.h5", "--num-bits", "2", "-o", "{out}"],
     "out.h5"),
    ("fakequant-grad per-channel npz", ["fakequant-grad", "{samples}/per_channel.h5", "-o", "{out}"], "out.npz"),
    ("fakequant-grad per-channel dir", ["fakequant-grad", "{samples}/per_channel.h5", "-o", "{out}"], "out/"),
    ("fakequant-grad per-channel safetensors", ["fakequant-grad", "{samples}/per_channel.h5", "-o", "{out}"],
     "out.safetensors"),
    ("fakequant-grad per-channel zarr", ["fakequant-grad", "{samples}/per_channel.h5", "-o", "{out}"], "out.zarr"),
    ("bn-grad sample", ["bn-grad", "{samples}/batch_norm.h5", "-o", "{out}"], "out.h5"),
    ("fakequant-grad run.h5 sample", ["fakequant-grad", "{samples}/run.h5", "-o", "{out}", "--skip-invalid"], "out.h5"),
    ("bn-grad run.h5 sample", ["bn-grad", "{samples}/run.h5", "-o", "{out}", "--skip-invalid"], "out.h5"),
    ("fakequant-grad weight run", ["fakequant-grad", "{in}/weights.h5", "-o", "{out}"], "out.h5"),
    ("fakequant weight run", ["fakequant", "{in}/weights.h5", "-o", "{out}"], "out.h5"),
    ("fakequant-grad weight run npz", ["fakequant-grad", "{in}/weights.h5", "-o", "{out}"], "out.npz"),
    ("fakequant-grad weight run dir", ["fakequant-grad", "{in}/weights.h5", "-o", "{out}"], "out/"),
    ("fakequant-grad big in memory", ["fakequant-grad", "{in}/fq.h5", "-o", "{out}"], "out.h5"),
    ("fakequant-grad big streamed", ["fakequant-grad", "{in}/fq.h5", "-o", "{out}", "--memory-limit", "8M"], "out.h5"),
    ("fakequant-grad big gzip", ["fakequant-grad", "{in}/fq.h5", "-o", "{out}", "--compression", "gzip"], "out.h5"),
    ("fakequant-grad big lzf streamed",
     ["fakequant-grad", "{in}/fq.h5", "-o", "{out}", "--compression", "lzf", "--memory-limit", "8M"], "out.h5"),
    ("bn-grad big in memory", ["bn-grad", "{in}/bn.h5", "-o", "{out}", "--epsilon", "1e-3"], "out.h5"),
    ("bn-grad big streamed", ["bn-grad", "{in}/bn.h5", "-o", "{out}", "--epsilon", "1e-3", "--memory-limit", "8M"],
     "out.h5"),
    ("bn-grad big gzip", ["bn-grad", "{in}/bn.h5", "-o", "{out}", "--epsilon", "1e-3", "--compression", "gzip"],
     "out.h5"),
]


def make_inputs(folder, groups, size):
    """The weight run file and two bundles of about ``size`` float32 values (NHWC, 64 channels)."""
    make_weight_run(os.path.join(folder, "weights.h5"), groups)
    rng = np.random.default_rng(0)
    shape = (max(1, size // (16 * 16 * 64)), 16, 16, 64)
    x = rng.standard_normal(shape, dtype=np.float32)
    with h5py.File(os.path.join(folder, "fq.h5"), "w") as f:
        f["inputs"] = x
        f["gradients"] = rng.standard_normal(shape, dtype=np.float32)
        f["min"] = np.linspace(-3, -0.5, 64, dtype=np.float32)
        f["max"] = np.linspace(0.5, 3, 64, dtype=np.float32)
    with h5py.File(os.path.join(folder, "bn.h5"), "w") as f:
        f["y_backprop"] = rng.standard_normal(shape, dtype=np.float32)
        f["x"] = x
        f["scale"] = rng.uniform(0.5, 1.5, 64).astype(np.float32)
        f["reserve_space_1"] = x.mean(axis=(0, 1, 2))
        f["reserve_space_2"] = x.var(axis=(0, 1, 2))


def run_all(tree, inputs, outputs):
    """Each command line with ``tree``'s qgcli; returns {label: exit code}."""
    env = dict(os.environ, PYTHONPATH=tree, QGCLI_NO_PROGRESS="1")
    codes = {}
    for i, (label, argv, out_name) in enumerate(COMMANDS):
        out = os.path.join(outputs, str(i), out_name)
        os.makedirs(os.path.join(outputs, str(i)))
        args = [a.format(samples=SAMPLES, out=out, **{"in": inputs}) for a in argv]
        done = subprocess.run([sys.executable, "-m", "qgcli", *args, "-q"], cwd=tree, env=env,
                              capture_output=True, text=True)
        codes[label] = done.returncode
        if done.returncode:
            print(f"{label}: exit {done.returncode} with {tree}: {done.stderr.strip()}", file=sys.stderr)
    return codes


def same_file(a, b):
    """The same bytes; for .safetensors, the same header as JSON and the same data (the safetensors writer
    orders its ``__metadata__`` differently from run to run)."""
    if not a.endswith(".safetensors"):
        return filecmp.cmp(a, b, shallow=False)
    halves = []
    for path in (a, b):
        with open(path, "rb") as f:
            data = f.read()
        n = struct.unpack("<Q", data[:8])[0]
        halves.append((json.loads(data[8:8 + n]), data[8 + n:]))
    return halves[0] == halves[1]


def h5_objects(path):
    """Every object of an HDF5 file as h5py reads it, in HDF5's visiting order (see ``--h5-content``)."""
    def attrs(o):
        return [(k, repr(o.attrs[k]), type(o.attrs[k]), o.attrs.get_id(k).dtype) for k in o.attrs]

    with h5py.File(path, "r") as f:
        out = [("/", attrs(f))]

        def visit(name, o):
            if isinstance(o, h5py.Group):
                out.append((name, attrs(o), list(o)))
            else:
                dcpl = o.id.get_create_plist()
                out.append((name, o.shape, o.dtype, o[()].tobytes() if o.size else b"", dcpl.get_layout(),
                            o.chunks, [dcpl.get_filter(i)[0] for i in range(dcpl.get_nfilters())], o.fillvalue,
                            attrs(o)))
        f.visititems(visit)
    return out


def same_tree(a, b, h5_content=False):
    """The relative paths whose bytes differ (or that exist on one side only), and those of them that are
    HDF5 files holding the same objects (with ``h5_content``)."""
    differ, objects = [], []
    for top, _dirs, files in os.walk(a):
        for name in files:
            path = os.path.join(top, name)
            other = os.path.join(b, os.path.relpath(path, a))
            if not os.path.exists(other) or not same_file(path, other):
                if h5_content and path.endswith(".h5") and os.path.exists(other) \
                        and h5_objects(path) == h5_objects(other):
                    objects.append(os.path.relpath(path, a))
                else:
                    differ.append(os.path.relpath(path, a))
    for top, _dirs, files in os.walk(b):
        differ += [os.path.relpath(os.path.join(top, n), b) for n in files
                   if not os.path.exists(os.path.join(a, os.path.relpath(os.path.join(top, n), b)))]
    return differ, objects


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="5fc9586", help="the revision to compare with (default: %(default)s)")
    parser.add_argument("--groups", type=int, default=200)
    parser.add_argument("--size", type=int, default=4_000_000, help="float32 values per big tensor")
    parser.add_argument("--h5-content", action="store_true",
                        help="HDF5 outputs whose bytes differ are compared object by object")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", base, args.base], check=True)
        try:
            subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=base, check=True,
                           capture_output=True)
            inputs = os.path.join(tmp, "inputs")
            os.makedirs(inputs)
            make_inputs(inputs, args.groups, args.size)
            codes = {}
            for side, tree in (("base", base), ("head", ROOT)):
                codes[side] = run_all(tree, inputs, os.path.join(tmp, side))
            failed = 0
            for i, (label, _argv, _out) in enumerate(COMMANDS):
                if codes["base"][label] or codes["head"][label]:
                    status = f"exit {codes['base'][label]} / {codes['head'][label]}"
                    failed += 1
                else:
                    differ, objects = same_tree(os.path.join(tmp, "base", str(i)), os.path.join(tmp, "head", str(i)),
                                                args.h5_content)
                    n = sum(len(f) for _t, _d, f in os.walk(os.path.join(tmp, "head", str(i))))
                    status = f"{n - len(objects)} of {n} file{'s' if n != 1 else ''} identical" if not differ \
                        else f"DIFFER: {differ}"
                    if objects and not differ:
                        status += f", the same objects in other bytes: {', '.join(objects)}"
                    failed += bool(differ)
                print(f"{label:40s} {status}")
            same = "the same bytes (or HDF5 objects)" if args.h5_content else "the same bytes"
            print(f"{len(COMMANDS) - failed} of {len(COMMANDS)} command lines wrote {same} as {args.base}")
            return 1 if failed else 0
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base], check=False)


if __name__ == "__main__":
    sys.exit(main())
