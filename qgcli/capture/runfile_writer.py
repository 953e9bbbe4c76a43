"""Write a run file from NumPy arrays as a training step runs: one group per op, its operands as datasets, the
op and its attributes as group attributes (docs/whole-models.md), and the framework's own results in a
``reference/`` subgroup under qgcli's output names (``outputs``, ``backprops_wrt_input``, ``x_backprop`` ...),
which ``qgcli verify`` compares with qgcli's recomputation.

Framework-free: the capture helpers hand it arrays, group by group, and each array goes to the file at once
(memory: the group being written, not the step): its dataset is created with its storage allocated and its
bytes written there by a background thread (:mod:`qgcli.capture.background_writes`), beside the step.
Results that ``verify`` compares bit for bit can be kept as a digest (``digest=`` of :meth:`RunFileWriter.add`:
the SHA-256 of the array's C-order bytes), so that each tensor of the step is stored once.  The digests of a
step are one table at the step's root (:mod:`qgcli.storage.hdf5.digests`), written when the step is committed:
one HDF5 object per step rather than a dataset and three attributes per result.
Groups, attributes and datasets are made with HDF5's low-level calls (:mod:`qgcli.storage.hdf5.small`): a
step makes thousands of them, and h5py's high-level calls cost three times as much.

Atomic, step by step: a step is written into an anonymous HDF5 group (reachable from no link, so invisible to
every reader) and linked under its name (``step_000300``) only when it is complete, then flushed; a new file is
a hidden temporary file renamed into place at its first commit.  An exception (or a kill) during a step leaves
the earlier steps as they were; appending costs the step's own bytes (no copy of the file).
"""
import fnmatch
import os
import re
import threading

import numpy as np

from qgcli import __version__
from qgcli.capture.background_writes import BackgroundWrites, sha256

REFERENCE = "reference"
#: Operands and results that belong to the backward pass (``keep="forward"`` drops them).
GRADIENT_OPERANDS = ("gradients", "y_backprop")
FORWARD_REFERENCES = ("outputs", "scale", "zero_point")
KEEP = ("all", "forward", "weights")
# Below this many elements an array is stored uncompressed (HDF5 cannot chunk a scalar; tiny ones gain nothing).
_COMPRESS_MIN = 256
_STAGING = ".qgcli_staging"

_STEP_GROUP = re.compile(r"^(step|epoch|iter)_\d+$")
#: How far the resident memory may grow past the process's earlier peak before a capture hands the freed heap
#: memory back to the system again (:func:`release_freed_memory`).
RELEASE_BYTES = 8 << 20
#: Bytes handed over between two readings of the resident memory (each reads ``/proc``: not once per array).
CHECK_BYTES = 1 << 20
#: HDF5's blocks of metadata (its default: 2 KiB).  A step's small datasets are allocated one after the other
#: unless a new block of metadata comes between them; with blocks this large their bytes mostly follow one another,
#: and :class:`BackgroundWrites` gathers them into few ``pwrite`` calls (a MobileNetV2 step's 1,121 datasets: 111
#: calls, 579 with HDF5's 2 KiB blocks, 1,121 before the gathering).  Each time the file is opened for writing it
#: costs at most one such block, part of which may stay unused.
META_BLOCK_BYTES = 32 << 10


def _malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere)."""
    try:
        import ctypes

        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = []


_STATM = []  # (pid, descriptor of its /proc/self/statm, page size): opened once per process


def resident_bytes():
    """The process's resident memory now (Linux's ``/proc/self/statm``, read again at offset 0 from a descriptor
    opened once per process: opening it each time cost a captured ResNet-18 step 0.08 s on a busy machine; None
    elsewhere)."""
    try:
        if not _STATM or _STATM[0][0] != os.getpid():  # (a forked child reads its own)
            _STATM[:] = [(os.getpid(), os.open("/proc/self/statm", os.O_RDONLY), os.sysconf("SC_PAGE_SIZE"))]
        _, fd, page = _STATM[0]
        return int(os.pread(fd, 256, 0).split()[1]) * page
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def peak_resident_bytes():
    """The process's peak resident memory so far (``VmHWM``; None where unknown)."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def release_freed_memory():
    """Hand the heap memory freed since back to the system (glibc: ``malloc_trim(0)``; elsewhere nothing).

    Capture copies every tensor it writes (a few MB each, freed at once); glibc's dynamic mmap threshold then
    serves such sizes from the heap, whose freed pages stay in the process: without this, a captured
    ResNet-18 step (batch 8) grew the peak RSS by 340 MB over a plain step's for 18 MB in its largest group."""
    if not _TRIM:
        _TRIM.append(_malloc_trim())
    if _TRIM[0] is not None:
        _TRIM[0](0)


def step_group(step):
    """The first-level group of a training step: ``step_000300`` for 300; a string is taken as given."""
    if step is None:
        return None
    if isinstance(step, str):
        name = step.strip("/")
        if not name or "/" in name:
            raise ValueError(f"step {step!r} must be one group name")
        return name
    if isinstance(step, bool) or int(step) != step or step < 0:
        raise ValueError(f"step {step!r} must be a non-negative integer or a group name")
    return f"step_{int(step):06d}"


def clean_path(name):
    """A group path from a framework's name: dots and slashes separate levels (``features.0.weight_fake_quant``
    -> ``features/0/weight_fake_quant``), ``:0`` tensor suffixes and empty parts go."""
    parts = []
    for part in re.split(r"[/.]", str(name)):
        part = part.split(":")[0].strip()
        if part:
            parts.append(part)
    return "/".join(parts) or "op"


def digest(array):
    """The SHA-256 of ``array``'s C-order bytes (what a digest dataset holds), as 32 ``uint8``."""
    return sha256(np.asarray(array))


_DCPL = []


def _allocated():
    """The creation properties of a dataset whose bytes :class:`BackgroundWrites` writes: contiguous, its
    storage allocated at creation (its offset known), never filled by HDF5 (made once: HDF5 copies them)."""
    import h5py

    if not _DCPL:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.CONTIGUOUS)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        dcpl.set_obj_track_times(False)  # as h5py's create_dataset
        _DCPL.append(dcpl)
    return _DCPL[0]


def _background(value):
    """Whether ``value`` goes to the file through :class:`BackgroundWrites`: a non-empty numeric array (or scalar)
    in native byte order (h5py stores it as it is in memory); the others through h5py."""
    return value.size > 0 and value.dtype.kind in "biufc" and value.dtype.isnative


def ancestors(path):
    """The groups above a group path, outermost first: ``a``, ``a/b`` for ``a/b/c``."""
    parts = path.split("/")
    return ["/".join(parts[:n]) for n in range(1, len(parts))]


class Paths(dict):
    """A step's groups (path -> staged name) and ``inner``: the count of groups below each path that has some
    (so that :meth:`RunFileWriter.unique` looks up a name's neighbours instead of scanning every group)."""

    def __init__(self):
        super().__init__()
        self.inner = {}

    def __setitem__(self, path, staged):
        if path not in self:
            for p in ancestors(path):
                self.inner[p] = self.inner.get(p, 0) + 1
        super().__setitem__(path, staged)

    def pop(self, path, *default):
        if path in self:
            for p in ancestors(path):
                self.inner[p] -= 1
                if not self.inner[p]:
                    del self.inner[p]
        return super().pop(path, *default)


def _patterns(layers):
    if layers is None:
        return None
    return (layers,) if isinstance(layers, str) else tuple(layers)


class RunFileWriter:
    """Writes op groups into a run file as they come, one step at a time.

    Parameters
    ----------
    path : str
        The run file (``.h5``).
    step : int or str, optional
        The step the groups go under (``step_<N>/``, zero-padded to 6 digits) until :meth:`begin_step` names
        another.  With steps, an existing file is kept and each step is added to it (refused when that step is
        already there); without, the groups go to the top of a new file, and an existing file is refused unless
        ``overwrite``.
    references : bool
        Store the framework's own results under ``<group>/reference/`` (default True).
    overwrite : bool
        Replace an existing file (without ``step``).
    compression : str or int, optional
        HDF5 compression of the arrays (``"gzip"``, ``"lzf"``, or a gzip level 0-9), with the byte shuffle.
    layers : str or list of str, optional
        Glob patterns (``fnmatch``) on group paths below the step: only matching groups are kept.
    keep : ``"all"``, ``"forward"`` or ``"weights"``
        ``"forward"``: the forward operands and results only (no upstream gradient, no gradient references);
        ``"weights"``: only the groups the capture marks as weight quantizers.

    Examples
    --------
    >>> import numpy as np, tempfile, os
    >>> w = RunFileWriter(os.path.join(tempfile.mkdtemp(), "run.h5"))
    >>> x = np.linspace(-1, 1, 8, dtype=np.float32)
    >>> w.add("layer/act_quant", "FakeQuantWithMinMaxArgs", {"inputs": x},
    ...       {"min": -0.5, "max": 0.5, "num_bits": 8, "narrow_range": False})
    'layer/act_quant'
    >>> w.close()
    """

    def __init__(self, path, *, step=None, references=True, overwrite=False, description=None, compression=None,
                 layers=None, keep="all"):
        self.path = os.fspath(path)
        self.step = step_group(step)
        self.references = references
        self.overwrite = overwrite
        self.description = description
        self.layers = _patterns(layers)
        if keep not in KEEP:
            raise ValueError(f"keep={keep!r}: one of {', '.join(KEEP)}")
        self.keep = keep
        self.compression = self._compression(compression)
        self.groups = Paths()  # path below the step -> staged group name, for the step being written
        self.steps = []  # the steps committed so far
        self.bytes_written = 0
        self._unchecked = 0  # bytes handed over since the resident memory was last read
        self._rss_base = None  # the process's peak resident bytes before its first captured step
        self._rss_limit = None  # resident bytes above which the freed heap memory is handed back (this step)
        self.lock = threading.RLock()  # TensorFlow runs its graph callbacks on several threads
        self._file = None
        self._small = None  # the low-level maker of the file's groups, datasets and attributes
        self._opened = 0  # groups opened in the file so far (their staged names)
        self._digests = []  # the step's digest rows: (staged group, name, shape, dtype, 32 bytes filled later)
        self._writes = None  # the background writes of the file's arrays (opened with the file)
        self._tmp = None  # the new file's temporary name until its first commit
        self._staging = None
        self._closed = False
        if not self.path.lower().endswith((".h5", ".hdf5")):
            raise ValueError(f"{self.path}: a run file is an HDF5 file (.h5)")
        if os.path.exists(self.path) and self.step is None and not overwrite:
            raise FileExistsError(f"{self.path} exists; give step=N to add a step to it, or overwrite=True")
        self._refuse_existing_step()

    def _refuse_existing_step(self):
        """Refuse a step the file already holds now, not at its first group (inside a training step)."""
        import h5py

        if self.step is None:
            return
        if self._file is not None:
            present = self.step in self._file
        elif os.path.exists(self.path):
            with h5py.File(self.path, "r") as f:
                present = self.step in f
        else:
            present = False
        if present:
            raise FileExistsError(f"{self.path} already holds the step {self.step}")

    @staticmethod
    def _compression(compression):
        if compression is None or compression is False:
            return {}
        if isinstance(compression, bool) or compression is True:
            compression = "gzip"
        if isinstance(compression, int):
            return {"compression": "gzip", "compression_opts": compression, "shuffle": True}
        if compression not in ("gzip", "lzf"):
            raise ValueError(f"compression={compression!r}: gzip, lzf or a gzip level 0-9")
        return {"compression": compression, "shuffle": True}

    # --- what to keep ---------------------------------------------------------------------------------

    def wants(self, name, *, weight=False):
        """Whether a group called ``name`` (before :meth:`unique`) is kept: the ``layers`` patterns and
        ``keep="weights"``.  Capture helpers ask before copying anything."""
        if self._closed:
            return False
        if self.keep == "weights" and not weight:
            return False
        if self.layers is None:
            return True
        path = clean_path(name)
        return any(fnmatch.fnmatchcase(path, p.strip("/")) for p in self.layers)

    @property
    def backward(self):
        """Whether upstream gradients and gradient references are kept (not ``keep="forward"``)."""
        return self.keep != "forward"

    def unique(self, name):
        """``name`` as a group path not used yet in this step, and neither inside nor above another group (a
        layer holds no layer): ``name``, ``name_1``, ``name_2`` ... (an op called twice)."""
        base = clean_path(name)
        path, n = base, 0
        with self.lock:
            groups = self.groups
            while path in groups or path in groups.inner or any(p in groups for p in ancestors(path)):
                n += 1
                above = [p for p in ancestors(base) if p in groups]
                # a group above: its level takes the suffix (``a/b`` under a group ``a``: ``a_1/b``)
                path = f"{above[0]}_{n}{base[len(above[0]):]}" if above else f"{base}_{n}"
        return path

    # --- steps ----------------------------------------------------------------------------------------

    def begin_step(self, step):
        """Write the next groups under ``step`` (the previous step must be committed or discarded)."""
        with self.lock:
            if self._staging is not None:
                raise RuntimeError(f"step {self.step} is not committed yet")
            self.step = step_group(step)
            self.groups = Paths()
            self._refuse_existing_step()
        self.release_memory(now=True)  # what the uncaptured steps before left on the heap

    def _open(self):
        """The file and the staging group of this step, made on the first group (nothing is written for a
        step without groups)."""
        import h5py

        if self._staging is not None:
            return self._staging
        if self._file is None:
            if self.step is not None and os.path.exists(self.path):
                self._file = h5py.File(self.path, "a", meta_block_size=META_BLOCK_BYTES)
            else:
                parent = os.path.dirname(os.path.abspath(self.path))  # hidden, as every qgcli temporary
                self._tmp = os.path.join(parent, f".qgcli-{os.urandom(8).hex()}.tmp")
                self._file = h5py.File(self._tmp, "w", meta_block_size=META_BLOCK_BYTES)
            self._writes = BackgroundWrites(self._file.id.get_vfd_handle())
            from qgcli.storage.hdf5.small import SmallWriter

            self._small = SmallWriter(self._file)
        f = self._file
        if self.step is None:
            if self.steps:
                raise RuntimeError("without a step, a run file holds one set of groups")
            self._staging = f.create_group(_STAGING)
        else:
            if self.step in f:
                raise FileExistsError(f"{self.path} already holds the step {self.step}")
            self._staging = h5py.Group(h5py.h5g.create(f.id, None))  # anonymous until the commit links it
        return self._staging

    def add(self, name, op, operands, attrs=None, reference=None, *, digest=(), weight=False):
        """Write one op group (``name`` made unique) of the current step; returns its path below the step, or
        None when the group is not kept (:meth:`wants`).  ``digest``: names in ``reference`` stored as their
        SHA-256 only (results verify compares bit for bit)."""
        if not self.wants(name, weight=weight):
            return None
        group = self.open_group(name, op, attrs)
        group.put(operands)
        if reference:
            group.put_reference(reference, digest=digest)
        return group.path

    def open_group(self, name, op, attrs=None):
        """Start one op group (``name`` made unique) of the current step; its arrays are written with
        :meth:`Group.put` as they come (a forward part now, the gradients in the backward pass)."""
        if self._closed:
            raise RuntimeError("the run file is already written")
        clean = {"op": op}
        for key, value in (attrs or {}).items():
            if value is None:
                continue
            if isinstance(value, np.generic):
                value = value.item()
            clean[key] = value
        with self.lock:
            staging = self._open()
            path = self.unique(name)
            staged = f".g{self._opened:05d}"  # flat until the commit names it
            self._opened += 1
            self.groups[path] = staged
            gid = self._small.attributed(staging.id, staged, clean)
        return Group(self, path, gid, staged)

    def drop(self, path):
        """Remove group ``path`` from the step being written (an incomplete one: its space stays unused)."""
        with self.lock:
            staged = self.groups.pop(path, None)
            if staged is not None and self._staging is not None:
                self.wait()  # its space may be reused once freed
                del self._staging[staged]

    def _dataset(self, parent, key, value):
        """Dataset ``key`` of ``value`` in the group ``parent`` (a GroupID)."""
        value = np.asarray(value)
        options = self.compression if value.size >= _COMPRESS_MIN else {}
        if options:
            h5py_group(parent).create_dataset(key, data=value, **options)
        elif _background(value):  # its bytes copied (the step may change the tensor) and written beside the step
            d = self._small.allocated(parent, key, value.shape, value.dtype, _allocated())
            self._writes.write(value, d.get_offset())
        elif not self._small.dataset(parent, key, value):
            h5py_group(parent).create_dataset(key, data=value)
        self.bytes_written += value.nbytes
        self._unchecked += value.nbytes

    def _digest(self, staged, key, value):
        """A row of the step's digest table for ``value`` (its SHA-256 computed beside the step)."""
        value = np.asarray(value)
        row = np.empty(32, dtype=np.uint8)
        self._digests.append((staged, key, value.shape, value.dtype.str, row))
        self._writes.write(value, None, digest_into=row)
        self._unchecked += value.nbytes

    def _digest_table(self, staging):
        """Write the step's digest rows (of the groups it keeps) as one table in ``staging``."""
        named = {staged: path for path, staged in self.groups.items()}
        rows = [(named[staged], key, shape, dtype, row) for staged, key, shape, dtype, row in self._digests
                if staged in named]
        self._digests = []
        if rows:
            from qgcli.storage.hdf5 import digests

            digests.write_table(staging, rows)

    def wait(self, *, raise_error=True):
        """Return when every array handed over is in the file (before HDF5 reads, frees or flushes)."""
        if self._writes is not None:
            self._writes.wait(raise_error=raise_error)

    def release_memory(self, *, now=False):
        """:func:`release_freed_memory` when the resident memory passes the process's peak before the step (then
        :data:`RELEASE_BYTES` above what is left after each hand-back), or ``now``.  Not every few MB
        written: each hand-back costs the step the page faults of the memory it hands back; and the memory read
        only every :data:`CHECK_BYTES` handed over."""
        if now:
            release_freed_memory()
            self._rss_limit = None
            return
        if self._unchecked < CHECK_BYTES:
            return
        self._unchecked = 0
        rss = resident_bytes()
        if rss is None:
            return
        if self._rss_base is None:
            self._rss_base = max(peak_resident_bytes() or 0, rss + RELEASE_BYTES)
        if self._rss_limit is None:
            self._rss_limit = self._rss_base
        if rss > self._rss_limit:
            release_freed_memory()
            self._rss_limit = max(self._rss_base, (resident_bytes() or rss) + RELEASE_BYTES)

    def commit_step(self):
        """Link the step written so far into the file, under its name, and flush it to disk."""
        with self.lock:
            if self._staging is None:
                return
            f, staging = self._file, self._staging
            self.wait()  # a failed write fails the step: nothing of it is linked
            self._digest_table(staging)
            links = staging.id.links
            for path, staged in self.groups.items():
                # a hard link (its parents made) and an unlink, not H5Lmove (which crashes inside an anonymous
                # group)
                name, lcpl = self._small.link_name(path)
                links.create_hard(name, staging.id, staged.encode(), lcpl=lcpl)
                staging.id.unlink(staged.encode())
            if self.step is None:
                for name in list(staging):
                    f.move(f"{_STAGING}/{name}", name)
                del f[_STAGING]

            f.attrs["qgcli_capture_version"] = __version__
            if self.description and "description" not in f.attrs:
                f.attrs["description"] = self.description
            if self.step is not None:
                f[self.step] = staging
            f.flush()
            self._staging = None
            self.steps.append(self.step)
            if self._tmp is not None:  # a new file: its first step makes it appear, whole
                os.fsync(f.id.get_vfd_handle())
                os.replace(self._tmp, self.path)
                self._tmp = None
            self.release_memory(now=True)  # what the step left on the heap

    def discard_step(self):
        """Forget the step being written: nothing of it is linked (its space in the file stays unused)."""
        with self.lock:
            self.wait(raise_error=False)  # before the step's space is freed and reused
            staging, self._staging = self._staging, None
            self.groups = Paths()
            self._digests = []
            if staging is not None and self.step is None:
                del self._file[_STAGING]

    def __len__(self):
        return len(self.groups)

    def close(self):
        """Commit the step being written and close the file."""
        if self._closed:
            return
        try:
            self.commit_step()
        finally:
            self._finish()

    def discard(self):
        """Forget the step being written and close the file (a new file is removed)."""
        if self._closed:
            return
        try:
            self.discard_step()
        finally:
            self._finish()

    def _finish(self):
        self._closed = True
        if self._writes is not None:
            self._writes.wait(raise_error=False)
            self._writes.close()
            self._writes = None
        if self._small is not None:
            self._small.close()
            self._small = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tmp is not None:
            try:
                os.unlink(self._tmp)
            except FileNotFoundError:
                pass
            self._tmp = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.discard()
        return False


class Group:
    """One op group being written: :meth:`put` its operands, :meth:`put_reference` the framework's results."""

    def __init__(self, writer, path, gid, staged):
        self.writer, self.path, self.gid, self.staged = writer, path, gid, staged
        self._reference = None  # the GroupID of reference/, made at its first dataset

    def put(self, operands):
        """Write operands (None values skipped; the upstream gradients too under ``keep="forward"``)."""
        w = self.writer
        with w.lock:
            for key, value in operands.items():
                if value is None or (key in GRADIENT_OPERANDS and not w.backward):
                    continue
                w._dataset(self.gid, key, value)
            w.release_memory()

    def put_reference(self, reference, *, digest=()):
        """Write the framework's results under ``reference/`` (``digest``: names kept as their SHA-256 in the
        step's digest table, computed beside the step)."""
        w = self.writer
        if not w.references:
            return
        kept = {k: v for k, v in reference.items()
                if v is not None and (w.backward or k in FORWARD_REFERENCES)}
        if not kept:
            return
        with w.lock:
            for key, value in kept.items():
                if key in digest:
                    w._digest(self.staged, key, value)
                else:
                    if self._reference is None:
                        self._reference = w._small.child(self.gid, REFERENCE)
                    w._dataset(self._reference, key, value)
            w.release_memory()

    def get(self, key):
        """An operand written before, read back (the backward pass replays kernels on the stored inputs)."""
        with self.writer.lock:
            self.writer.wait()
            return h5py_group(self.gid)[key][()]

    def set_attrs(self, **attrs):
        with self.writer.lock:
            self.writer._small.attributes(self.gid, {k: v for k, v in attrs.items() if v is not None})


def h5py_group(gid):
    """The h5py Group of a low-level GroupID."""
    import h5py

    return h5py.Group(gid)
