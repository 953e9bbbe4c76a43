"""In memory, and the one memory rule that decides whether a job may run there.

The rule (:func:`need` against :func:`parse_memory_limit`): a job's large operands, as read, plus float32
working copies and outputs of the same size, must fit under ``--memory-limit`` (default: a quarter of the
machine's memory).  A job over the limit runs in blocks (:mod:`qgcli.execution.blocks`) where its family and
its storage allow, else it is refused: an explicit limit is never ignored.  The single-bundle executor, the
run-file executor (which decides from the shapes discovery found, before opening a dataset) and the Zarr
block planner all ask this module.
"""
import math
import os
import re
import shutil

import numpy as np

from qgcli.errors import OperandError, OutputError, QgcliError
from qgcli.storage.outputs import check_figure_output, save_checked, write_outputs

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_memory_limit(text):
    """Bytes from ``"2G"``, ``"512M"``, ``"1.5g"``, ``"1000000"`` or a fraction of RAM like ``"25%"``.

    None or "" gives the default: a quarter of the machine's memory.
    """
    from qgcli.storage.io import physical_memory

    if text is None or text == "":
        return physical_memory() // 4
    value = str(text).strip().lower()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(%|[kmgt]?)i?b?", value)
    if not match:
        raise QgcliError(f"cannot read {text!r}; use a size like 512M, 2G or 25%", operand="--memory-limit")
    number, unit = float(match.group(1)), match.group(2)
    limit = int(physical_memory() * number / 100) if unit == "%" else int(number * _UNITS[unit])
    if limit < (1 << 20):
        raise QgcliError(f"{text!r} is below 1M; qgcli needs room for a few blocks", operand="--memory-limit")
    return limit


def need(tensors):
    """The bytes a job over ``tensors`` (``(element count, itemsize)`` pairs) needs in memory: the inputs as
    read plus float32 working copies and outputs of the same size."""
    return sum(int(size) * max(int(itemsize), 4) for size, itemsize in tensors) * 2


def sizes(arrays):
    """``(element count, itemsize)`` of arrays or unread datasets (anything with ``size`` and ``dtype``; an HDF5
    dataset with a null dataspace has no size: nothing to read, and its reader refuses it)."""
    return [(a.size or 0, a.dtype.itemsize) for a in arrays]


def shapes_fit(datasets, names, budget):
    """Whether the large operands ``names``, by their shapes and dtypes as a run file's discovery found them
    (``datasets``: name -> (shape, dtype)), fit ``budget`` by :func:`need`; None when one is not known there
    (then the memory plan decides from the opened datasets)."""
    tensors = []
    for name in names:
        if name not in datasets:
            return None
        shape, dtype = datasets[name]
        try:
            itemsize = np.dtype(dtype).itemsize
        except (TypeError, ValueError):
            return None
        if shape is None:  # a null dataspace: the memory plan decides from the opened dataset
            return None
        tensors.append((math.prod(shape), itemsize))  # exact ints, without np.prod's fixed cost (a group's third)
    return need(tensors) <= budget


def plan(job, operands, *, streams, mode=None):
    """``(datasets, budget)`` when the job's large operands must be streamed from disk, else None (it works in
    memory).  They stream from HDF5 datasets and from files that hold them as plain bytes at an offset
    (.npy, stored .npz members, .safetensors: :mod:`qgcli.storage.flat`).

    A job that cannot stream (``mode`` says why: its family, or the GPU) is refused when an explicit
    ``--memory-limit`` is below what its inputs need; without the option it works in memory as always.
    """
    from qgcli.storage import io

    limit, output = job.output.memory_limit, job.output.destination
    if not streams and limit is None:
        return None
    budget = parse_memory_limit(limit)
    from qgcli.jobs import large_operands_in

    datasets, whole = {}, {}
    for name in large_operands_in(job, operands):
        ds = operands.dataset(name)
        if ds is None:  # .npy, a stored .npz member, .safetensors: plain bytes at an offset, streamed as well
            ds = operands.flat(name)
        if ds is None:  # a compressed .npz member, stdin: read whole
            whole[name] = operands.declared(name)
        else:
            datasets[name] = ds
    if whole:
        _check_whole(limit, budget, sizes(datasets.values()), whole, operands)
        return None
    needed = need(sizes(datasets.values()))
    if needed <= budget:
        return None
    if not streams:
        raise QgcliError(f"the inputs need about {_size(needed)}, more than {_size(budget)}, and {mode} cannot stream "
                         "them from disk (only TensorFlow's fake-quant ops, bn-grad and the block formats mx, nvfp4, "
                         "onnx stream, on the CPU); raise --memory-limit or drop it", operand="--memory-limit")
    for name, ds in datasets.items():
        if not hasattr(ds, "id"):
            continue  # plain bytes of a file, which holds them all (qgcli.storage.flat)
        declared, stored = int(ds.size) * ds.dtype.itemsize, ds.id.get_storage_size()
        if ds.compression is None and stored < declared // 2:
            # A file can declare terabytes and store nothing: reading it would stream fill values for hours.
            raise OperandError(f"declares {declared / 2**30:.1f} GiB but stores {stored / 2**30:.3f} GiB; "
                               "refusing to stream unwritten data", operand=name)
    if output == "-" or io.output_kind(output) != "h5":
        raise OutputError(f"the inputs need about {_size(needed)}, more than --memory-limit ({_size(budget)}); "
                          "streaming writes .h5 outputs only", operand="--output")
    out_bytes = int(datasets["x" if "x" in datasets else "inputs"].size) * 4
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(output))).free
    if free < out_bytes:
        raise OutputError(f"needs {out_bytes / 2**30:.1f} GiB but its file system has {free / 2**30:.1f} GiB free",
                          operand="--output")
    return datasets, budget


def _check_whole(limit, budget, streamable, whole, operands):
    """Operands that cannot be streamed (a compressed .npz member, stdin) are read whole: under an explicit
    ``--memory-limit`` their size, from their headers, must fit it with the others (``streamable``), else the job
    is refused in one line (exit 2) before anything is read.  Without the option they are read as always
    (a file declaring more than the machine's memory is refused by its reader)."""
    if limit is None or any(v is None for v in whole.values()):
        return  # no explicit limit, or a size no header tells: the read says what is wrong with it
    needed = need(list(streamable) + list(whole.values()))
    if needed <= budget:
        return
    names = ", ".join(f"{name} ({operands.sources.get(name) or name})" for name in whole)
    raise QgcliError(f"the inputs need about {_size(needed)}, more than {_size(budget)}, and {names} "
                     "cannot be streamed from disk (a compressed .npz member or stdin is read whole; HDF5, .npy, "
                     "stored .npz members and .safetensors stream, Zarr stores run in blocks); convert it to .h5, "
                     ".npy or .zarr, or raise --memory-limit", operand="--memory-limit")


def _size(n):
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def run_in_memory(runner, job, operands):
    """Load, compute, write the outputs (and the figure); returns the summary."""
    out = job.output
    result = runner.compute(job, operands)
    if out.plot:  # refuse a bad figure path before any output is written
        check_figure_output(out.plot, inputs=operands.input_paths(), force=out.force, option="--plot")
    write_outputs(result.outputs, out.destination, operands=operands, force=out.force, attrs=result.attrs,
                  compression=out.compression)
    if out.plot:
        check_figure_output(out.plot, inputs=operands.input_paths(), force=out.force, option="--plot")
        save_checked(result.figure(), out.plot, 100)
        result.summary["figure"] = out.plot  # said in the summary's "wrote" lines (stderr) and its JSON
    return result.summary
