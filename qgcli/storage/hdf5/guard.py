"""HDF5 reads that may never return, made on a worker thread with a time limit.

On a damaged global heap HDF5 spins for ever inside the read of a variable-length value (seen with
HDF5 2.0: ``H5HG__cache_heap_deserialize``).  h5py holds the GIL throughout, so no signal handler runs
and SIGTERM cannot stop the process.  Called through ctypes, which releases the GIL, the same read can
run on a worker thread while the main thread waits with a time limit and still answers signals.

HDF5 is not thread-safe: the worker holds h5py's lock while it reads (see :func:`_run`), and once a read is
stuck no HDF5 call may follow.  Under the CLI the process then ends at once with its one-line error; a library
caller gets a FileFormatError, and its next h5py call in that process waits for ever.
"""
import ctypes
import os
import queue
import sys
import threading
import time

from h5py._objects import phil

from qgcli import collector
from qgcli.errors import FileFormatError
from qgcli.ops.blocked import name_this_thread
from qgcli.signals import Terminated, cli_handlers_installed, pending

SECONDS = 5.0
_stuck = []
_library = []  # [ctypes.CDLL or None], found once
_worker = []  # [(requests, thread)]


def stuck():
    """Whether a guarded read never returned (HDF5 must not be called again)."""
    return bool(_stuck)


def read_string_attribute(attr, filename):
    """The value of a scalar variable-length string attribute (an h5py AttrID), or None where this
    platform's HDF5 library cannot be reached through ctypes or the attribute is no string."""
    value = read_string_attributes([attr], filename)[0]
    if isinstance(value, Exception):
        raise value
    return value


def read_string_attributes(attrs, filename):
    """:func:`read_string_attribute` of each of ``attrs`` (h5py AttrIDs), in one round trip to the worker
    thread: the time limit covers the whole batch (every read is tiny: a stuck one still ends the command
    within :data:`SECONDS`), and the message names the attribute whose read did not return."""
    import h5py

    lib = _hdf5_library()
    attrs = list(attrs)
    if lib is None or _stuck:
        return [None] * len(attrs)
    from qgcli.storage.hdf5.types import dtype_of

    todo = [i for i, a in enumerate(attrs) if h5py.check_string_dtype(dtype_of(a)) is not None]
    if not todo:
        return [None] * len(attrs)
    memtype = h5py.h5t.C_S1.copy()  # char *, NUL-terminated, allocated by HDF5
    memtype.set_size(h5py.h5t.VARIABLE)
    memtype.set_cset(h5py.h5t.CSET_UTF8)
    pointers = [ctypes.c_char_p() for _ in todo]
    # the names, for the message, read here: while the worker reads, it holds h5py's lock (see _run)
    names = {i: attrs[i].name.decode("utf-8", "replace") for i in todo}
    current = [None]  # the attribute being read

    def read_all():
        statuses = []
        for i, pointer in zip(todo, pointers):
            current[0] = i
            statuses.append(lib.H5Aread(attrs[i].id, memtype.id, ctypes.byref(pointer)))
        return statuses

    def describe():
        name = names.get(current[0], "?")
        return f"{filename}: HDF5 did not return from reading attribute {name!r} within {SECONDS:g} s (a damaged file?)"

    statuses = _run(read_all, describe)
    out = [None] * len(attrs)
    try:
        for i, pointer, status in zip(todo, pointers, statuses):
            out[i] = ValueError("HDF5 could not read the value") if status < 0 else \
                (pointer.value or b"").decode("utf-8", "replace")
    finally:
        with phil:  # an HDF5 call too, past h5py's lock
            for pointer, status in zip(pointers, statuses):
                if status >= 0:
                    lib.H5free_memory(pointer)
    return out


def _run(call, describe):
    """``call()`` on the worker thread; its result, or the end of the command if it does not return.

    The worker calls HDF5 through ctypes, past h5py's lock (``phil``), and HDF5 keeps one global API context: a
    second HDF5 call meanwhile (h5py on another thread, or an h5py object freed by the garbage collector on
    this one) interleaves with it, and HDF5 fails later in an unrelated call (seen: "ring type mismatch
    occurred for cache entry" in a write_direct_chunk, the likeliest cause of a CI failure on h5py 3.11).  So
    the worker holds ``phil`` while it reads, and this
    thread pauses the collector while it waits.  After a read that never returns the lock stays taken: an h5py
    call from then on waits for ever, where it used to run beside the spinning read (a library caller's
    ``inspect`` of tests/fuzz_regressions/h5_vlen_attribute_read_hangs.h5 crashed the process)."""
    def locked():
        with phil:
            return call()

    with collector.paused():
        return _wait(locked, describe)


def _wait(call, describe):
    requests = _requests()
    done = queue.Queue(1)
    requests.put((call, done))
    end = time.monotonic() + SECONDS
    while True:
        try:
            # Short waits: callers read HDF5 with signals deferred (qgcli.signals), so a signal is only
            # recorded meanwhile, and must still end a read that never returns.
            ok, value = done.get(timeout=0.05)
            break
        except queue.Empty:
            signum = pending()
            if signum is not None and done.empty():
                time.sleep(0.2)  # a read that is merely slow gets a moment; the caller stops at its next safe point
                if done.empty():
                    _give_up(Terminated(signum).describe(), 128 + signum)
            if time.monotonic() > end:
                _give_up(str(FileFormatError(describe(), operand="FILE")), 2)
        except Terminated as exc:  # signals not deferred: the same
            if done.empty():
                _give_up(exc.describe(), 128 + exc.signum)
            raise
    if not ok:
        raise value
    return value


def _requests():
    if not _worker:
        requests = queue.Queue()

        def serve():
            name_this_thread("qgcli-hdf5")
            while True:
                call, done = requests.get()
                try:
                    done.put((True, call()))
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    done.put((False, exc))

        thread = threading.Thread(target=serve, name="qgcli-hdf5", daemon=True)
        thread.start()
        _worker.append((requests, thread))
    return _worker[0][0]


def _give_up(message, code):
    _stuck.append(message)
    if cli_handlers_installed():
        sys.stderr.write(f"Error: {message}\n")
        sys.stderr.flush()
        os._exit(code)
    raise FileFormatError(message)


def _hdf5_library():
    """The HDF5 shared library h5py loaded (found in /proc/self/maps), through ctypes; None elsewhere."""
    if not _library:
        lib = None
        try:
            with open("/proc/self/maps") as fh:
                paths = {line.split()[-1] for line in fh if "libhdf5" in line}
            (path,) = [p for p in paths if os.path.basename(p).startswith(("libhdf5.", "libhdf5-"))]
            lib = ctypes.CDLL(path)
            lib.H5Aread.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
            lib.H5Aread.restype = ctypes.c_int
            lib.H5free_memory.argtypes = [ctypes.c_char_p]
        except (OSError, ValueError, AttributeError):
            lib = None
        _library.append(lib)
    return _library[0]
