"""Run files: an HDF5 file whose groups each hold one op's operands ("a layer"), the op and its attributes
as group attributes, with the framework's own names.

:func:`is_run_file` tells a run file from a plain bundle, :func:`discover` lists the layers of a file (or of
one group of it) with their op, attributes and datasets' shapes and dtypes.  Which family a layer's op names, what keeps it
from running and its job are the families' (:mod:`qgcli.families.groups`).  The layout is documented in
docs/whole-models.md.
"""
import os
from dataclasses import dataclass, field
from typing import Optional

from qgcli.errors import FileFormatError, QgcliError
from qgcli.signals import deferred
from qgcli.storage.checks import reason
from qgcli.storage.dtypes import dtype_name
from qgcli.storage.hdf5 import walk as h5walk

#: Datasets that make a group without ``op`` a layer (read as today's bundle).
_MARKERS = ("inputs", "x", "y_backprop")


@dataclass
class Layer:
    """One group of a run file that holds (or should hold) one op's operands."""

    path: str
    op: Optional[str]
    # set by qgcli.families.groups.classify from the op (None until then, and for an unknown op)
    kind: Optional[str]  # qgcli.families.registry.FAKE_QUANT or BATCH_NORM
    family: Optional[str]
    variant: Optional[str]
    attrs: dict
    datasets: dict  # name -> (shape tuple, dtype str)
    error: Optional[str] = None
    notes: list = field(default_factory=list)
    # datasets discovery read while its walk had them open (``discover(prefetch=...)``): name -> array, taken
    # by the run's read of the group (:class:`qgcli.storage.operands.GroupView`) instead of opening them again
    arrays: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def label(self):
        return self.op or "(bundle)"


def split_target(text):
    """``(path, group or None)`` of ``run.h5`` / ``run.h5:group/path``; None when ``text`` is no .h5 file."""
    from qgcli.storage import h5, io

    if text is None or text == "-" or text.startswith("-:"):
        return None
    spec = io.parse_spec(text)
    if spec.path is None or not spec.path.lower().endswith(h5.FORMAT.suffixes):
        return None
    group = spec.key.strip("/") if spec.key else None
    return spec.path, group or None


def open_target(target, *, operand, not_a_run_file):
    """``(path, group, container)`` of a run-file target (``run.h5`` or ``run.h5:group``), the container open;
    a QgcliError naming ``operand`` (``not_a_run_file`` when the target is no .h5 file)."""
    from qgcli.storage import io

    where = split_target(target)
    if where is None:
        raise QgcliError(not_a_run_file, operand=operand)
    path, group = where
    try:
        return path, group, io.Container.open(path)
    except FileFormatError as exc:
        raise QgcliError(str(exc), operand=operand) from None


def is_run_file(text):
    """Whether BUNDLE ``text`` names a run file: ``file.h5:group`` always (the group must exist), a whole
    ``file.h5`` when its root holds no operands and some group below is a layer."""
    target = split_target(text)
    if target is None:
        return False
    path, group = target
    if group is not None:
        return True

    if not os.path.isfile(path):
        return False
    from qgcli.storage import io

    try:
        with io.Container.open(path) as container:
            root = container._opened()
            if any(name in root for name in _MARKERS if _is_dataset(root, name)):
                return False
            return _has_layer(root, path)
    except FileFormatError:
        return False  # the single-bundle path reports it in its words
    except QgcliError:
        raise  # the bounds on depth and group count (qgcli.storage.hdf5.walk)
    except io.CORRUPT_FILE_ERRORS:
        return False  # damaged structure: the same


def _has_layer(root, label):
    """Whether some group below ``root`` is a layer: a walk over the groups (datasets unopened) that ends at
    the first one with an ``op`` attribute or a marker dataset."""
    found = []

    def layer(node):
        if node.kind == "group" and "op" in node.obj.attrs:
            found.append(node.path)
        elif node.kind == "dataset" and b"/" in node.raw and node.raw.rpartition(b"/")[2].decode("utf-8", "replace") \
                in _MARKERS:
            found.append(node.path)
        return bool(found)

    with deferred():
        for _ in h5walk.walk(root, label=label, operand="BUNDLE", datasets=False, stop=layer):
            pass
    return bool(found)


def _is_dataset(group, name):
    return _dataset(group, name) is not None


def _dataset(group, name, readonly=None):
    """The Dataset hard-linked as ``name`` in ``group`` (opened once), or None.  Low-level: one link
    lookup and one open (``group.get(name, getlink=True)`` then ``group[name]`` cost five times that)."""
    import h5py
    from h5py import h5l

    from qgcli.storage.h5 import h5_open

    try:
        raw = group._e(name)
        links = group.id.links
        if not links.exists(raw) or links.get_info(raw).type != h5l.TYPE_HARD:
            return None
        if readonly is None:
            readonly = group.file.mode == "r"
        obj = h5_open(group.id, raw, readonly=readonly)
    except Exception:  # noqa: BLE001 - damaged: not an operand
        return None
    return obj if isinstance(obj, h5py.Dataset) else None


def discover(handle, group=None, *, label=None, operand="BUNDLE", prefetch=0):
    """The layers of an open h5py File (under ``group`` when given), each with its op, attributes and the
    shapes of its datasets; a group that names no group is a FileFormatError.  One walk
    (:mod:`qgcli.storage.hdf5.walk`, whose bounds it enforces), the groups' attributes read in batches as it goes.
    Nothing stays open (holding every layer's open objects made memory grow with the file: 20,000 groups,
    1.2 GB): running a layer opens its group again, and reads the small datasets found here in one call each.

    ``prefetch``: bytes of the op groups' small plain datasets (:func:`qgcli.storage.h5.read_plain_dataset`'s)
    read while the walk has them open, in file order until that many are held (``Layer.arrays``): a run
    that reads every group then opens none of them again (five HDF5 opens of a four-operand group)."""
    import h5py
    import numpy as np
    from h5py import h5a

    from qgcli.storage import h5

    label = label or handle.filename
    top = handle
    if group:
        node = h5.resolve(handle, group, label)
        if not isinstance(node, h5py.Group):
            raise FileFormatError(f"{label}: {group!r} is a dataset, not a group of a run file")
        top = node
    # Per group, in file order: [path, its attributes (or the error reading them), its open Group until
    # they are read].  A group with an op is read in batches as the walk goes and then closed, so that the
    # walk holds a bounded number of objects open (an open group costs ~17 KB, 20,000 of them 400 MB).
    groups, children, pending = [], {}, []
    arrays, budget = {}, [prefetch]  # group path -> {name: array read by the walk}; the bytes left to read
    fd = h5.file_descriptor(handle) if prefetch > 0 else -1

    def flush():
        for entry, attrs in zip(pending, _attributes_of([e[2] for e in pending])):
            entry[1], entry[2] = attrs, None
        pending.clear()

    def add(path, g):
        # the attribute first: such a group needs no look at its datasets (h5a.exists: `"op" in g.attrs`, a
        # third of its cost)
        has_op = path != "/" and h5a.exists(g.id, b"op")
        groups.append([path, None, g if has_op else None])
        children[path] = []
        if has_op:
            if budget[0] > 0:
                arrays[path] = {}
            pending.append(groups[-1])
            if len(pending) >= ATTRIBUTE_BATCH:
                flush()

    with deferred():
        add(top.name, top)
        for node in h5walk.walk(top, label=label, operand=operand, datasets="ids"):
            if node.kind == "group":
                add("/" + _text(node.raw), node.obj)
            elif node.kind == "dataset":
                parent, _, name = node.raw.rpartition(b"/")
                ds = node.obj  # a DatasetID, closed again at once: an open HDF5 dataset costs tens of KB
                where = "/" + _text(parent) if parent else "/"
                shape, (dtype, as_is) = ds.shape, h5.stored_as(ds)  # each an HDF5 round trip: asked once
                children[where].append((_text(name), shape, dtype_name(dtype)))
                if where in arrays and shape is not None and 0 < budget[0] and dtype.kind in "fiu":
                    # read as the run reads it: by its dtype's name (an HDF5 enum's integers as plain ones)
                    array = h5.read_plain_dataset(ds, shape, np.dtype(children[where][-1][2]), fd if as_is else -1)
                    if array is not None:
                        arrays[where][_text(name)] = array
                        budget[0] -= array.nbytes
        flush()
        layers = []
        for path, attrs, _ in groups:
            datasets = children[path]
            if attrs is None:  # no op: a layer by its operands only, read now (today's bundles, rare in run files)
                if not any(name in _MARKERS for name, _, _ in datasets):
                    continue
                attrs = _attributes_of([top if path == top.name else handle.file[path]])[0]
            if isinstance(attrs, Exception):
                layers.append(Layer(path.lstrip("/") or "/", None, None, None, None, {}, {},
                                    error=f"cannot be read: {reason(attrs)}"))
            else:
                found = layer(path, attrs, datasets)
                if found is not None and path in arrays:
                    found.arrays = arrays.pop(path)
                layers.append(found)
    return layers


def _text(raw):
    return raw.decode("utf-8", "surrogateescape")


#: Bytes of small datasets a run's discovery reads as it walks (``discover(prefetch=...)``): the run takes
#: them group by group; what is past them is read when its group runs, as before.
PREFETCH_BYTES = 32 << 20

#: Groups whose attributes are read in one batch: a batch holds its string attributes open until they are
#: read, and HDF5 checks each attribute it opens against every open one (one batch for 20,000 groups took
#: minutes; 32 made 500 groups' reads 25% faster than 256, and costs 16 round trips to the guard thread).
ATTRIBUTE_BATCH = 32


def _attributes_of(groups):
    """Each group's attributes as read (one guarded round trip for their strings), group by group where the
    batch fails, with the error in place of the attributes of a group that cannot be read."""
    from qgcli.storage import h5, io

    try:
        return h5.read_attributes_many(groups)
    except FileFormatError:
        raise
    except io.CORRUPT_FILE_ERRORS:
        pass
    out = []
    for g in groups:
        try:
            out.append(h5.read_attributes(g))
        except FileFormatError:
            raise
        except io.CORRUPT_FILE_ERRORS as exc:
            out.append(exc)
    return out


def layer(path, attrs, datasets):
    """The Layer of the group at ``path`` (absolute in the file) given its attributes as read and the
    datasets hard-linked in it (``[(name, shape, dtype)]``, in file order); None when the group is no layer
    (no ``op`` attribute, no marker dataset)."""
    name = path.lstrip("/") or "/"
    if not ((path != "/" and "op" in attrs) or any(n in _MARKERS for n, _, _ in datasets)):
        return None
    shapes = {n: (tuple(int(s) for s in shape), dtype) for n, shape, dtype in datasets
              if shape is not None}  # an HDF5 empty (null dataspace) dataset: no tensor
    return _layer(name, attrs, shapes)


def _layer(path, attrs, datasets):
    op = attrs.get("op")
    if op is not None and not isinstance(op, str):
        return Layer(path, str(op), None, None, None, attrs, datasets, error=f"op attribute {op!r} is not a string")
    return Layer(path, op, None, None, None, attrs, datasets)
