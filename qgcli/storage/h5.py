"""The HDF5 format (.h5, .hdf5): reading with every link checked (nothing outside the file is opened),
attributes read under :mod:`qgcli.storage.hdf5.guard`, and writing single outputs (one dataset per output,
the provenance on the file and on each dataset) and run-file outputs (one group per run-file group, written
by :class:`qgcli.storage.hdf5.small.SmallWriter` at HDF5's own speed).

The low-level helpers live in :mod:`qgcli.storage.hdf5` (walk, guard, contiguous, chunks, small).
"""
import contextlib
import io as _io
import os

import numpy as np

from qgcli.errors import FileFormatError, QgcliError
from qgcli.signals import deferred, raise_pending
from qgcli.storage import atomic, provenance, sparse, targets
from qgcli.storage.checks import CORRUPT_FILE_ERRORS, check_memory, reason
from qgcli.storage.hdf5 import contiguous as h5_contiguous
from qgcli.storage.hdf5 import guard as hdf5_guard
from qgcli.storage.hdf5.types import dtype_of, memory_type, stored_as  # noqa: F401 (h5.dtype_of, h5.stored_as)

MAGIC = b"\x89HDF\r\n\x1a\n"


class NoSuchObject(FileFormatError):
    """A key names nothing in an HDF5 file."""


_MAX_SOFT_LINKS = 16  # HDF5's own limit on soft-link hops (H5L_NUM_LINKS)


def resolve(handle, key, label, *, low_level=False):
    """The object at ``key``, walking the path one link at a time so that nothing outside the file is opened.

    Hard links are followed, soft links by their target path within the file (at most 16 hops, so a
    cycle ends), and an external link is refused before HDF5 would open the file it names.  The walk goes
    through HDF5's object ids (``h5o.open``, a third of the cost of h5py's ``group[name]``, which looks up
    the file's mode for every dataset); the object found is wrapped as h5py's ``group[name]`` wraps it, or,
    with ``low_level``, returned as its id (a run file's small operands are read from it straight away).
    """
    import h5py
    from h5py import h5g, h5l, h5o

    if isinstance(key, bytes):  # a link name that is not UTF-8 (h5py hands those out as bytes)
        key = key.decode("utf-8", "surrogateescape")
    todo = [p for p in reversed(key.split("/")) if p and p != "."]
    node, hops = handle.id, 0
    try:
        while todo:
            part = todo.pop()
            name = part.encode("utf-8", "surrogateescape")
            if not isinstance(node, h5g.GroupID) or not node.links.exists(name):
                raise NoSuchObject(f"{label}: has no dataset {key!r}")
            kind = node.links.get_info(name).type
            if kind == h5l.TYPE_EXTERNAL:
                target = node.links.get_val(name)[0].decode("utf-8", "replace")
                raise FileFormatError(f"{label}: {key!r} is an external link to {target}; qgcli does not follow it")
            if kind == h5l.TYPE_SOFT:
                hops += 1
                if hops > _MAX_SOFT_LINKS:
                    raise FileFormatError(f"{label}: {key!r} goes through more than {_MAX_SOFT_LINKS} soft links")
                target = node.links.get_val(name).decode("utf-8", "surrogateescape")
                if target.startswith("/"):
                    node = handle.id
                todo.extend(p for p in reversed(target.split("/")) if p and p != ".")
                continue
            if kind != h5l.TYPE_HARD:
                raise FileFormatError(f"{label}: {key!r} is a user-defined link; qgcli does not follow it")
            node = h5o.open(node, name)
        if low_level:
            return node
        if node is handle.id:
            return handle
        if isinstance(node, h5g.GroupID):
            return h5py.Group(node)
        if isinstance(node, h5py.h5d.DatasetID):
            return h5py.Dataset(node, readonly=(handle.file.mode == "r"))
        return h5py.Datatype(node)
    except QgcliError:
        raise
    except CORRUPT_FILE_ERRORS as exc:
        raise FileFormatError(f"{label}: cannot resolve {key!r}: {reason(exc)}") from None


def checked_at(handle, key, label):
    """The checked h5py Dataset under ``key``: no group, no virtual or external data outside the file."""
    return checked_dataset(resolve(handle, key, label), key, label)


def checked_dataset(node, key, label):
    """``node`` (resolved from ``key``) when it is a Dataset whose data lies in its own file."""
    import h5py

    try:
        if not isinstance(node, h5py.Dataset):
            raise FileFormatError(f"{label}: {key!r} is a group, not a dataset")
        if node.is_virtual:
            for source in node.virtual_sources():
                if source.file_name not in (".", node.file.filename):
                    raise FileFormatError(
                        f"{label}: {key!r} is a virtual dataset reading {source.file_name}; qgcli does not follow it"
                    )
        if node.external:
            # Raw data in other files ("external storage") would let a file read /etc/passwd as uint8.
            raise FileFormatError(f"{label}: {key!r} keeps its data in the external file {node.external[0][0]}; "
                                  "qgcli does not follow it")
        sparse.check_hdf5(node, key, label)  # declared, never written: not read above a bound
    except QgcliError:
        raise
    except CORRUPT_FILE_ERRORS as exc:
        raise FileFormatError(f"{label}: dataset {key!r} cannot be read: {reason(exc)}") from None
    return node


def read_at(handle, key, label):
    return read_dataset_node(checked_at(handle, key, label), key, label)


def read_dataset_node(node, key, label):
    """The array of a checked Dataset (:func:`checked_dataset`)."""
    try:
        if node.dtype.hasobject:
            # Variable-length strings and sequences and references live in HDF5's global heap; no tensor
            # is stored that way, and a damaged heap made HDF5 loop forever on the read (fuzzing found it).
            raise FileFormatError(f"{label}: {key!r} holds {object_kind(node.dtype)}, not a tensor; "
                                  "qgcli does not read it")
        check_memory(int(node.size or 0) * node.dtype.itemsize, f"{label}: {key!r}")
        data = h5_contiguous.read(node, f"{label}: dataset {key!r}")
        if data is None:
            data = _read_in_slabs(node)
        bfloat16 = getattr(data, "dtype", None) == np.uint16 and tagged_bfloat16(node)
    except QgcliError:
        raise
    except CORRUPT_FILE_ERRORS as exc:
        raise FileFormatError(f"{label}: dataset {key!r} cannot be read: {reason(exc)}") from None
    if bfloat16:
        import ml_dtypes

        data = data.view(ml_dtypes.bfloat16)
    return np.asarray(data)


#: A dataset larger than this is read in first-axis slabs of about this size, a pending signal acted on
#: between two (a SIGTERM ends a read of gigabytes of compressed chunks within one slab, not at its end).
SLAB_BYTES = 32 << 20


def _read_in_slabs(node):
    """``node[()]``, a large dataset read slab by slab (:data:`SLAB_BYTES`) with
    :func:`qgcli.signals.raise_pending` between two reads (HDF5 is in a clean state there)."""
    nbytes = int(node.size or 0) * node.dtype.itemsize
    if not node.shape or nbytes <= SLAB_BYTES:
        return node[()]
    out = np.empty(node.shape, node.dtype)
    step = max(1, node.shape[0] * SLAB_BYTES // nbytes)
    if node.chunks:  # whole chunk rows: no chunk is decompressed twice
        step = max(node.chunks[0], step // node.chunks[0] * node.chunks[0])
    for start in range(0, node.shape[0], step):
        raise_pending()
        rows = np.s_[start:min(start + step, node.shape[0])]
        node.read_direct(out, rows, rows)
    return out


#: Datasets up to this size take :func:`read_plain_dataset`'s one-call read (a run file's many small tensors).
PLAIN_READ_BYTES = 1 << 20


def open_walked(handle, path, *, low_level=False):
    """The object at ``path`` below the open h5py Group or File ``handle``, opened by HDF5 in one call, for a path
    that :mod:`qgcli.storage.hdf5.walk` reached through hard links only (a run file's groups and their datasets,
    found by discovery): :func:`resolve`'s link-by-link checks were made by the walk (a fifth of its cost on
    a run file's four-level group paths).  The object wrapped as :func:`resolve` wraps a group, or, with
    ``low_level``, its id; None where it cannot be opened (then :func:`resolve` says why)."""
    import h5py
    from h5py import h5o

    try:
        node = h5o.open(handle.id, path.encode("utf-8", "surrogateescape"))
    except CORRUPT_FILE_ERRORS:
        return None
    if low_level:
        return node
    return h5py.Group(node) if isinstance(node, h5py.h5g.GroupID) else None


def read_plain_dataset(dsid, shape, dtype, fd=-1):
    """What ``read_dataset_node(checked_dataset(node, ...))`` gives of a small Dataset of plain numbers kept
    in its own file (``dsid``: its low-level DatasetID; ``shape``, ``dtype``: its own, already asked), in one
    low-level read without h5py's per-read layers; None for anything else, and on any error (the checked
    read then says why).  ``fd``: HDF5's own descriptor of the file (:func:`file_descriptor`), given where the
    dataset's type stores ``dtype`` as is (:func:`stored_as`): its bytes are then read at their offset, past
    HDF5's read path (a quarter of a small read's cost)."""
    from h5py import h5d, h5s

    # uint16 may be a bfloat16-tagged tensor; empty, object, compound and exotic types take the checked read.
    if (dtype.kind not in "fiu" or dtype.itemsize > 8 or (dtype.kind == "u" and dtype.itemsize == 2)
            or dtype.fields is not None or dtype.subdtype is not None):
        return None
    size = 1
    for d in shape:
        size *= d
    if not 0 < size * dtype.itemsize <= PLAIN_READ_BYTES:
        return None
    try:
        # An offset in this file: contiguous data here (HDF5 gives none for external, virtual, chunked and compact
        # layouts), asked at a sixth of the creation property list's cost; the others ask that list.
        offset = dsid.get_offset()
        if offset is None:
            dcpl = dsid.get_create_plist()
            if dcpl.get_layout() == h5d.VIRTUAL or dcpl.get_external_count():
                return None  # data outside this file: the checked read refuses it
        array = np.empty(shape, dtype=dtype)
        if offset is None or fd < 0 or not _read_at(fd, offset, array):
            dsid.read(h5s.ALL, h5s.ALL, array, mtype=memory_type(dtype))
    except CORRUPT_FILE_ERRORS:
        return None
    return array


def _read_at(fd, offset, array):
    """Fill ``array`` with the bytes at ``offset`` of ``fd``; False where the file ends before them (HDF5's
    read then decides)."""
    view = memoryview(array.reshape(-1).view(np.uint8))
    return os.preadv(fd, [view], offset) == view.nbytes


def file_descriptor(handle):
    """HDF5's own descriptor of the file of an open h5py object, for :func:`read_plain_dataset`; -1 for a file
    driver other than the POSIX one (a file in memory, a Python file object)."""
    f = handle.file
    return f.id.get_vfd_handle() if f.driver == "sec2" else -1


def tagged_bfloat16(dataset):
    """Whether an HDF5 dataset carries qgcli's ``dtype=bfloat16`` tag (bfloat16 stored as uint16).

    The one attribute qgcli reads even when it is a variable-length string (h5py's default for ``str``,
    so that is how users tag their files), and only on integer datasets."""
    return dataset.dtype.kind == "u" and dataset.attrs.get("dtype") in ("bfloat16", b"bfloat16")


def h5_open(parent_id, name, *, readonly=True):
    """The h5py object (Group, Dataset or Datatype) that ``name`` (bytes, relative to the low-level
    ``parent_id``) names: what ``group[name]`` gives, without its per-call path checks (a walk over
    thousands of groups calls this once per object).  Raises as ``group[name]`` does."""
    import h5py
    from h5py import h5i, h5o

    oid = h5o.open(parent_id, name)
    otype = h5i.get_type(oid)
    if otype == h5i.GROUP:
        return h5py.Group(oid)
    if otype == h5i.DATASET:
        return h5py.Dataset(oid, readonly=readonly)
    if otype == h5i.DATATYPE:
        return h5py.Datatype(oid)
    raise TypeError("Unknown object type")


def read_attributes(obj):
    """An HDF5 object's attributes, name -> value (strings as ``str``).

    On a damaged global heap HDF5 spins for ever inside the read of a variable-length value, holding the
    GIL, so that no signal can stop it.  Scalar variable-length strings (h5py's default for ``str``: every
    qgcli provenance attribute) are therefore read by :mod:`qgcli.storage.hdf5.guard`, which gives up after a few
    seconds; other variable-length and object-typed values are never read and appear as ``"<KIND: not
    read>"`` (the kind, as for such datasets).
    """
    return read_attributes_many([obj])[0]


def read_attributes_many(objs):
    """:func:`read_attributes` of each of ``objs`` (h5py objects, or their low-level ids: a run file's groups,
    a listing's objects), with every scalar string attribute of all of them read in one guarded batch (one
    round trip to :mod:`qgcli.storage.hdf5.guard`'s worker thread)."""
    from h5py import h5a, h5f
    from h5py._objects import ObjectID

    outs, strings = [], []  # strings: (dict, key, AttrID)
    for obj in objs:
        out = {}
        outs.append(out)
        oid = obj if isinstance(obj, ObjectID) else obj.id
        # Most objects have none: one call, not the attribute table's walk (H5Aget_num_attrs: the count alone, at
        # half of H5Oget_info's cost, which fills in the object's whole header info).
        if not h5a.get_num_attrs(oid):
            continue
        for key in _attribute_names(oid):
            key_text = key.decode("utf-8", "surrogateescape")
            try:
                attr = h5a.open(oid, key)
                dtype = dtype_of(attr)
                if dtype.kind == "O":
                    out[key_text] = f"<{object_kind(dtype)}: not read>"
                    if attr.shape == ():
                        # the file's name only for the first (the message of a stuck read names it)
                        strings.append((out, key_text, attr, None if strings else os.fsdecode(h5f.get_name(oid))))
                elif dtype.kind in "biuf" and dtype.subdtype is None and attr.shape == ():
                    out[key_text] = _scalar_attribute(attr, dtype)  # what obj.attrs[key] gives, opened once
                else:
                    value = (obj if oid is not obj else _wrapped(oid)).attrs[key]
                    out[key_text] = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            except FileFormatError:
                raise
            except Exception as exc:  # noqa: BLE001 - an unsupported or damaged attribute must not stop the listing
                out[key_text] = f"<unreadable: {type(exc).__name__}>"
    if strings:
        try:
            values = hdf5_guard.read_string_attributes([s[2] for s in strings], strings[0][3])
        except FileFormatError:
            raise
        except Exception as exc:  # noqa: BLE001 - as above, for every attribute of the batch
            values = [exc] * len(strings)
        for (out, key_text, _, _), value in zip(strings, values):
            if isinstance(value, Exception):
                out[key_text] = f"<unreadable: {type(value).__name__}>"
            elif value is not None:
                out[key_text] = value
    return outs


def _wrapped(oid):
    """The h5py object of a low-level id (read-only), for the rare attribute h5py's own reader reads."""
    import h5py
    from h5py import h5i

    kind = h5i.get_type(oid)
    return h5py.Group(oid) if kind == h5i.GROUP else (h5py.Dataset(oid, readonly=True) if kind == h5i.DATASET
                                                      else h5py.Datatype(oid))


def _attribute_names(oid):
    """The raw names of an object's attributes in ``obj.attrs.keys()``'s order (creation order where the
    object tracks it, else by name), without h5py's per-call layers."""
    from h5py import h5, h5a, h5p

    tracked = oid.get_create_plist().get_attr_creation_order() & h5p.CRT_ORDER_TRACKED
    names = []
    h5a.iterate(oid, lambda name, *_: names.append(name), index_type=h5.INDEX_CRT_ORDER if tracked else h5.INDEX_NAME)
    return names


def _scalar_attribute(attr, dtype):
    """A scalar numeric attribute's value as h5py's ``attrs[key]`` reads it (a NumPy scalar), from its AttrID."""
    value = np.zeros((), dtype=dtype)
    attr.read(value, mtype=memory_type(dtype))
    return value[()]


def object_kind(dtype):
    import h5py

    if h5py.check_string_dtype(dtype) is not None:
        return "variable-length strings"
    if h5py.check_vlen_dtype(dtype) is not None:
        return "variable-length sequences"
    return "HDF5 references" if h5py.check_ref_dtype(dtype) is not None else f"objects ({dtype})"


@contextlib.contextmanager
def open_for_writing(path):
    """``with h5py.File(path, "w")``, without a chunk cache and with signals deferred until the file is
    closed (a signal inside an HDF5 call would leave HDF5 half-way; the writer calls
    :func:`qgcli.signals.raise_pending` where it can stop).  Outputs are written once, so the cache buys
    nothing, and with HDF5 2.0 a write that fails while the cache holds chunks (a full disk) crashes the
    process with SIGSEGV instead of raising."""
    import h5py

    with deferred(), h5py.File(path, "w", rdcc_nbytes=0) as f:
        yield f


def write_file(fh, arrays, attrs, compression=None):
    with open_for_writing(fh) as f:
        for key, value in attrs.items():
            f.attrs[key] = value
        for name, array in arrays.items():
            raise_pending()  # between two datasets HDF5 is in a clean state: stop here on a signal
            array = np.asarray(array)
            data = array.view(np.uint16) if array.dtype.name == "bfloat16" else array
            if compression and array.ndim and array.size:
                from qgcli.storage.hdf5 import chunks as h5_chunks  # chunks compressed on every core

                ds = h5_chunks.create(f, name, data.shape, data.dtype, compression)
                h5_chunks.write(ds, data)
            else:
                ds = f.create_dataset(name, data=data)
            if array.dtype.name == "bfloat16":
                ds.attrs["dtype"] = "bfloat16"
            for key, value in attrs.items():
                ds.attrs[key] = value


def dataset_names(handle, label):
    """Dataset paths through hard links, never soft or external links."""
    import h5py

    names = []
    try:
        # HDF5's object visitor follows hard links only and visits each object once (so cycles end).
        with deferred():
            handle.visititems(lambda name, obj: names.append(
            name.decode("utf-8", "surrogateescape") if isinstance(name, bytes) else name)
            if isinstance(obj, h5py.Dataset) else None)
    except CORRUPT_FILE_ERRORS as exc:
        raise FileFormatError(f"{label}: cannot list its datasets: {reason(exc)}") from None
    return names


class GroupSink:
    """A run file's outputs in one open HDF5 file: a group per run-file group, the op's attributes (with the
    provenance) on the group.  ``begin(path)`` makes the group (a streamed group is computed into it),
    ``add`` writes its outputs and attributes, ``discard`` removes a group that failed.  The arrays given to
    ``add`` are written when it returns (``writes_on_add``): a runner may reuse them for the next group."""

    streams = True
    writes_on_add = True

    def __init__(self, f, compression):
        from qgcli.storage.hdf5.small import SmallWriter

        self.file = f
        self.compression = compression
        self.writer = SmallWriter(f)  # thousands of small groups: HDF5's low-level calls, same objects
        self._begun = (None, None)

    def begin(self, path):
        import h5py

        self._begun = (path, h5py.Group(self.writer.group(path)))
        return self._begun[1]

    def add(self, path, arrays, attrs):
        """Write a group's outputs and attributes: a group not begun (computed in memory) is made with its
        attributes in one template copy and its plain arrays written at their offsets (``SmallWriter.layer``
        and ``written_at``), the same objects h5py's calls make, for a run file's thousands of small groups."""
        import h5py

        begun, grp = self._begun
        attrs = provenance.attributes(attrs)
        if begun != path:
            arrays = {name: np.asarray(array) for name, array in arrays.items()}
            if not self.compression and self.writer.layer_written(path, attrs, arrays):
                self._begun = (path, None)
                return
            gid = self.writer.layer(path, attrs)
            if gid is not None:
                self._begun = (path, None)
                for name, array in arrays.items():
                    if self.compression or not self.writer.written_at(gid, name, array):
                        self._put(h5py.Group(gid), name, array)
                return
            grp = self.begin(path)
        for name, array in arrays.items():
            self._put(grp, name, np.asarray(array))
        self.writer.attributes(grp.id, attrs)

    def _put(self, grp, name, array):
        compression = self.compression
        options = {"compression": compression, "chunks": True} if compression and array.ndim and array.size else {}
        if array.dtype.name == "bfloat16":
            ds = grp.create_dataset(name, data=array.view(np.uint16), **options)
            ds.attrs["dtype"] = "bfloat16"
        elif options or not self.writer.dataset(grp.id, name, array):
            grp.create_dataset(name, data=array, **options)  # the op's attributes live on the group

    def discard(self, path):
        if path in self.file:
            del self.file[path]

    def close(self):
        self.writer.close()


class H5Format:
    name, title, suffixes, magic = "h5", "HDF5", (".h5", ".hdf5"), MAGIC
    holds_many = hierarchical = True  # groups, links and run-file layers: inspect walks them

    def open(self, source):
        import h5py

        with deferred():
            return h5py.File(_io.BytesIO(source) if isinstance(source, bytes) else source, "r")

    def names(self, handle, label):
        return dataset_names(handle, label)

    def read(self, handle, key, label):
        with deferred():
            return read_at(handle, key, label)

    def dataset(self, handle, key, label):
        with deferred():
            return checked_at(handle, key, label)

    def has(self, handle, key, label):
        try:
            with deferred():
                resolve(handle, key, label)
            return True
        except FileFormatError as exc:
            # Present but unreadable (an external link, say): say so when it is read, not "missing".
            return not isinstance(exc, NoSuchObject)

    def check_output(self, dest, *, inputs=(), force=False, names=()):
        targets.check_file(dest, inputs=inputs, force=force)

    def write(self, dest, arrays, *, attrs, compression=None, stdout=None):
        atomic.atomic_write(dest, lambda p: write_file(p, arrays, attrs, compression))

    @contextlib.contextmanager
    def group_sink(self, dest, *, compression=None):
        with atomic.staging(dest) as tmp, open_for_writing(tmp) as f:
            sink = GroupSink(f, compression)
            try:
                yield sink
            finally:
                sink.close()


FORMAT = H5Format()
