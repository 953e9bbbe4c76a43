"""Python's cyclic garbage collector, paused around work that builds many objects and no cycles.

A listing of 20,000 HDF5 groups builds some 200,000 dicts and lists (entries, their attributes, the
walk's nodes) and keeps most of them: the collector, run every 700 new containers, walked the growing
document again and again for a tenth of ``inspect``'s time.  Nothing there makes cycles (h5py's ids and
qgcli's entries are plain trees), so the collector is paused for the loop and resumed as it was after;
what a pause leaves (a stored exception's traceback, say) is collected on the next pass after it.
Standard library only: the CLI's start-up may load it.
"""
import contextlib
import gc


@contextlib.contextmanager
def paused(when=True):
    """Pause the collector for the block (nested pauses are fine), then restore it as it was; ``when`` false:
    leave it alone (work shared with other threads, a Dask cluster's, which do make cycles)."""
    was = gc.isenabled()
    if not when:
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
