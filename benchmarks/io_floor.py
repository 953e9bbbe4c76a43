"""The I/O floor of a qgcli command: what any program reading its inputs and writing its outputs pays.

    python benchmarks/io_floor.py BUNDLE.h5 OUT.h5 --read A,B --big NAME [--small NAME,...] [--scalars NAME,...]
        [--compression gzip|lzf]

Reads the datasets ``--read`` names (whole, with h5py), writes the first of them as dataset ``--big`` (the op's
result is as large), float32 vectors ``--small`` of its last axis's length and float32 scalars ``--scalars``
to a temporary file beside OUT.h5, fsyncs it and renames it over OUT.h5: no op, no summary, no checks.
benchmarks/bench_cli.sh and bench_streaming.sh time qgcli against it.
"""
import argparse
import os

import h5py
import numpy as np


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("output")
    parser.add_argument("--read", required=True)
    parser.add_argument("--big", required=True)
    parser.add_argument("--small", default="")
    parser.add_argument("--scalars", default="")
    parser.add_argument("--compression", default=None)
    args = parser.parse_args()
    with h5py.File(args.bundle, "r") as f:
        arrays = [f[name][()] for name in args.read.split(",")]
    big = arrays[0]
    tmp = os.path.join(os.path.dirname(os.path.abspath(args.output)), ".floor.tmp")
    options = {"compression": args.compression, "chunks": True} if args.compression else {}
    with h5py.File(tmp, "w") as out:
        out.create_dataset(args.big, data=big, **options)
        for name in filter(None, args.small.split(",")):
            out.create_dataset(name, data=np.zeros(big.shape[-1], np.float32))
        for name in filter(None, args.scalars.split(",")):
            out.create_dataset(name, data=np.float32(0))
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, args.output)


if __name__ == "__main__":
    main()
