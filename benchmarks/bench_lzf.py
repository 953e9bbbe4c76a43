"""qgcli's LZF compressor against h5py's own routine, on 1 MiB chunks of five kinds of float32 data.

    python benchmarks/bench_lzf.py [--repeat 10]

Prints MB/s and the compressed share for each (0.000: the stream would not be shorter, the chunk is stored
raw), and checks that HDF5's LZF filter decodes qgcli's chunks to the same bytes.
"""
import argparse
import ctypes
import os
import sys
import tempfile
import time

import h5py
import numpy as np


def chunks(rng, n=1 << 18):
    gradient = rng.standard_normal(n).astype(np.float32)
    gradient[rng.random(n) < 0.3] = 0
    return {"gradient, 30% zeros": gradient, "random floats": rng.standard_normal(n).astype(np.float32),
            "zeros": np.zeros(n, np.float32), "16-level quantized": (rng.integers(-8, 8, n) * 0.125).astype(np.float32),
            "ramp": np.arange(n, dtype=np.float32)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    from qgcli.ops import native

    lib = native.library()
    if lib is None:
        raise SystemExit("the compiled kernels are not built")
    from h5py import h5z

    theirs = ctypes.CDLL(h5z.__file__).lzf_compress
    theirs.restype, theirs.argtypes = ctypes.c_uint, [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint]
    data = chunks(np.random.default_rng(0))
    print("| chunk | qgcli MB/s | h5py MB/s | qgcli share | h5py share |")
    print("|---|---|---|---|---|")
    mine = {}
    for name, chunk in data.items():
        row = []
        for fn in (lambda *a: lib.qg_lzf_compress(*a, chunk.itemsize), theirs):  # qgcli: matches at item boundaries
            out = np.empty(chunk.nbytes, np.uint8)
            t = time.perf_counter()
            for _ in range(args.repeat):
                size = fn(chunk.ctypes.data, chunk.nbytes, out.ctypes.data, chunk.nbytes)
            row.append((chunk.nbytes * args.repeat / (time.perf_counter() - t) / 1e6, size / chunk.nbytes))
            if fn is not theirs:
                mine[name] = out[:size].copy()
        print(f"| {name} | {row[0][0]:.0f} | {row[1][0]:.0f} | {row[0][1]:.3f} | {row[1][1]:.3f} |")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "lzf.h5")
        with h5py.File(path, "w") as f:
            for k, (name, chunk) in enumerate(data.items()):
                ds = f.create_dataset(str(k), shape=chunk.shape, dtype=chunk.dtype, chunks=chunk.shape, compression="lzf")
                stream = mine[name]
                ds.id.write_direct_chunk((0,), stream if stream.size else chunk, filter_mask=0 if stream.size else 1)
        with h5py.File(path, "r") as f:
            for k, chunk in enumerate(data.values()):
                assert np.array_equal(f[str(k)][()].view(np.uint32), chunk.view(np.uint32))
    print("HDF5's LZF filter decodes every qgcli chunk to its bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
