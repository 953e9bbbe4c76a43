"""What every run in row blocks over Zarr stores shares (:mod:`qgcli.execution.zarr_blocks`, :mod:`qgcli.execution.zarr_batch_norm`):
the arrays a block opens, the output check made before any work, blocks run here, and their timing.

A block's ``work`` (a frozen dataclass) names its inputs (``sources``: operand -> (store, key)), the
temporary output store (``output``) and its large array (``name``).
"""
import threading

from qgcli.errors import OptionError


def open_array(source, *, mode="r"):
    """A zarr Array opened by its own metadata (the client checked it; a worker lists no group)."""
    import zarr

    from qgcli.storage.zarr_store import open_store

    path, key = source
    return zarr.open_array(store=open_store(path, read_only=mode == "r"), path=key or "", mode=mode)


_opened = {}  # this process's arrays of the run in progress, by its temporary output store (unique per run)
_opened_lock = threading.Lock()


def arrays_of(work):
    """The input arrays and the output array of ``work``, opened once per process and run: opening reads
    the array's metadata, which costs as much as reading a small chunk."""
    with _opened_lock:
        if _opened.get("run") != work.output:
            _opened.clear()
            _opened["inputs"] = {n: open_array(s) for n, s in work.sources.items()}
            _opened["output"] = open_array((work.output, work.name), mode="r+")
            _opened["run"] = work.output
        return _opened["inputs"], _opened["output"]


def check_destination(job, operands):
    """Refuse what a run in blocks cannot write (a figure, any output but a Zarr store) before any work."""
    from qgcli.storage import io
    from qgcli.storage import zarr_store
    from qgcli.errors import OutputError

    out = job.output
    if out.plot:
        raise OptionError("cannot draw a figure of a tensor computed in blocks; drop --plot",
                                 param_hint="'--plot'")
    if out.destination == "-" or io.output_kind(out.destination) != "zarr":
        raise OutputError("a tensor computed in blocks is written chunk by chunk into a Zarr store: "
                          "use -o OUT.zarr", operand="--output")
    io.check_output(out.destination, inputs=operands.input_paths(), force=out.force)
    zarr_store.codecs(out.compression)


def timing(results, items, elapsed):
    """The summary's ``blocks``: how many, their rows, the wall time and the seconds the blocks spent
    reading, computing and writing (summed over blocks: worker time)."""
    seconds = {k: round(sum(r["seconds"][k] for r in results), 6) for k in ("read", "compute", "write")}
    return {"count": len(results), "items": items, "wall_s": round(elapsed, 6), "seconds": seconds}


def here(function, work, blocks):
    """``function(work, block)`` for each block, one after another in this process."""
    from qgcli.signals import raise_pending

    results = []
    for block in blocks:
        raise_pending()
        results.append(function(work, block))
    return results
