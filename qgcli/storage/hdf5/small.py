"""Many small HDF5 objects at HDF5's own speed: a run file's groups, their datasets and attributes.

A run file has thousands of groups of a few small tensors each.  h5py's high-level calls spend more time
in Python than HDF5 spends writing such an object (``create_dataset`` ~150 us, one attribute ~55 us); the
low-level calls here make the same objects (same datatypes, dataspaces, property lists and link-name
encoding as ``require_group``, ``create_dataset(name, data=...)`` and ``attrs[key] = value``) for a third of
that.  Anything they were not written for (a compressed or chunked dataset, a non-scalar attribute) is left
to h5py's own calls by the caller or here.
"""
import os

import numpy as np
from h5py import h5a, h5d, h5g, h5o, h5p, h5s, h5t
from h5py._hl import base


def pwrite_all(fd, data, offset):
    """Write all of ``data`` (a bytes-like object) at ``offset`` of ``fd``."""
    view = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes")
        view, offset = view[n:], offset + n


class SmallWriter:
    """Groups, plain datasets and scalar attributes of one open, writable h5py File."""

    def __init__(self, f):
        self.file = f
        self._dcpl = h5p.create(h5p.DATASET_CREATE)
        self._dcpl.set_obj_track_times(False)  # h5py's default (create_dataset's track_times=False)
        self._types = {}  # dtype -> (file type, memory type), as h5py derives them
        self._scalar = h5s.create(h5s.SCALAR)
        self._lcpl = {}  # coding -> h5py's link creation properties with that character set
        self._templates = None  # an in-memory HDF5 file of template groups, copied by attributed() and layer_written()
        self._copy = None  # the object copy properties of those copies
        self._made = {}  # the attributes of a template (as a hashable key) -> its name in that file
        self._seen = set()  # attribute sets met once by attributed(..., repeated=True), no template yet
        self._filled = {}  # layer_written()'s templates: (attributes, datasets) -> (name, [(DatasetID, file type)])
        self._seen_filled = set()  # (attributes, datasets) met once by layer_written(), no template yet
        self._parent = (None, None)  # the last parent group layer() made or opened: (path, GroupID)
        self._fd = None  # HDF5's own file descriptor (POSIX driver), for written_at()

    def link_name(self, name):
        """``name`` encoded as h5py encodes link names, with its link creation properties (parents created)."""
        name, coding = _encoded(name)
        lcpl = self._lcpl.get(coding)
        if lcpl is None:
            lcpl = self._lcpl[coding] = base.dlcpl.copy()  # h5py's own: parents created
            lcpl.set_char_encoding(coding)
        return name, lcpl

    def child(self, gid, name):
        """A new group ``name`` (a path: its missing parents are made) below the group ``gid``."""
        name, lcpl = self.link_name(name)
        return h5g.create(gid, name, lcpl=lcpl)

    def attributed(self, gid, name, attrs, *, repeated=False):
        """A new group ``name`` below the group ``gid`` with the scalar attributes ``attrs``: one copy (H5Ocopy)
        of a group made once with them, in an in-memory file (17 us where the group and 4 attributes made one by
        one take 68 us); the same objects as :meth:`child` and :meth:`attributes`.  ``repeated``: a template is
        made only for attributes met before (a run file's outputs whose attributes differ from group to group
        would pay a template each for one copy)."""
        key = _key(attrs)
        first = repeated and key is not None and key not in self._made and key not in self._seen
        if first and len(self._seen) < MAX_TEMPLATES:
            self._seen.add(key)
        if first or key is None or (key not in self._made and len(self._made) >= MAX_TEMPLATES):
            made = self.child(gid, name)
            self.attributes(made, attrs, new=True)
            return made
        template = self._made.get(key)
        if template is None:
            template = self._made[key] = f"t{len(self._made)}".encode()
            self.attributes(h5g.create(self._template_file(), template), attrs, new=True)
        link, lcpl = self.link_name(name)
        h5o.copy(self._templates.id, template, gid, link, copypl=self._copy, lcpl=lcpl)
        return h5g.open(gid, link)

    def _template_file(self):
        """The FileID of the in-memory file of templates, made on first use."""
        if self._templates is None:
            from h5py import File

            self._templates = File(f"qgcli-templates-{os.urandom(8).hex()}", "w", driver="core", backing_store=False)
            self._copy = h5p.create(h5p.OBJECT_COPY)
        return self._templates.id

    def layer(self, path, attrs):
        """A new group at ``path`` (text as h5py spells names; its missing parents made) with the scalar
        attributes ``attrs``, by :meth:`attributed`: its GroupID, or None where ``path`` exists already (a
        group made as the parent of one written before it) or names the root."""
        place = self._place(path)
        return None if place is None else self.attributed(place[0], place[1], attrs, repeated=True)

    def _place(self, path):
        """``(parent GroupID, leaf name)`` of a new group at ``path``, its parents made; None where ``path``
        exists or names the root."""
        parent, _, leaf = path.strip("/").rpartition("/")
        if not leaf:
            return None
        done, pid = self._parent
        if done != parent:
            pid = self.group(parent)
            self._parent = (parent, pid)  # the next group is often its sibling (one layer's quantizers)
        if pid.links.exists(self.link_name(leaf)[0]):
            return None
        return pid, leaf

    def layer_written(self, path, attrs, arrays):
        """:meth:`layer` with the small plain ``arrays`` (name -> array, as :meth:`written_at` takes them) written
        in it, in one H5Ocopy of a template group that holds the attributes and the datasets, each array first
        written into the template's dataset (in memory, no conversion): half the cost of making the datasets
        in the file one by one, or of opening the copies to write at their offsets.  The same objects as
        :meth:`layer` and :meth:`written_at` make (contiguous, allocated at creation, never filled).  A template
        is for one set of attributes and of dataset names, shapes and dtypes, and made only for a set met
        before (see :meth:`attributed`); False, with nothing made, for a set met for the first time, arrays
        over :data:`TEMPLATE_DATA_BYTES` or one written_at() does not take, a path that exists or the root."""
        if (not arrays or sum(array.nbytes for array in arrays.values()) > TEMPLATE_DATA_BYTES
                or not all(self._writable(array) for array in arrays.values())):
            return False
        template = self._filled_template(attrs, arrays)
        if template is None:
            return False
        place = self._place(path)
        if place is None:
            return False
        name, datasets = template
        for (dsid, ftype), array in zip(datasets, arrays.values()):
            dsid.write(h5s.ALL, h5s.ALL, array, mtype=ftype)  # the bytes as they are, as written_at() writes them
        link, lcpl = self.link_name(place[1])
        h5o.copy(self._templates.id, name, place[0], link, copypl=self._copy, lcpl=lcpl)
        return True

    def _filled_template(self, attrs, arrays):
        """``(name, [(DatasetID, file type)])`` of :meth:`layer_written`'s template for these attributes and
        arrays, made on their second meeting; None before it, or past :data:`MAX_FILLED_TEMPLATES`."""
        key = _key(attrs)
        if key is None:
            return None
        key = (key, tuple((name, array.shape, array.dtype) for name, array in arrays.items()))
        template = self._filled.get(key)
        if template is not None:
            return template
        if key not in self._seen_filled:
            if len(self._seen_filled) < MAX_TEMPLATES:
                self._seen_filled.add(key)
            return None
        if len(self._filled) >= MAX_FILLED_TEMPLATES:
            return None
        name = f"f{len(self._filled)}".encode()
        gid = h5g.create(self._template_file(), name)
        self.attributes(gid, attrs, new=True)
        datasets = [(self.allocated(gid, dname, array.shape, array.dtype, _allocated()), self._type(array.dtype)[0])
                    for dname, array in arrays.items()]
        template = self._filled[key] = (name, datasets)
        return template

    def written_at(self, gid, name, array):
        """``create_dataset(name, data=array)`` in the group ``gid`` for a non-empty C-contiguous array (or a
        scalar) of plain numbers in this machine's byte order: the dataset allocated at creation (contiguous,
        never filled by HDF5) and its bytes written at its offset in the file, past HDF5's write path (a
        third of a small group's writing); False (nothing made) for anything else, or a file driver other
        than the POSIX one."""
        if not self._writable(array):
            return False
        dsid = self.allocated(gid, name, array.shape, array.dtype, _allocated())
        try:
            offset = dsid.get_offset()
            pwrite_all(self._fd, array, offset)
        finally:
            dsid.close()
        return True

    def _writable(self, array):
        """Whether :meth:`written_at` writes ``array``: a non-empty C-contiguous array of plain numbers in this
        machine's byte order, and a file it can write at."""
        if self._fd is None:
            self._fd = self.file.id.get_vfd_handle() if self.file.driver == "sec2" else -1
        dtype = array.dtype
        return (self._fd >= 0 and array.size != 0 and dtype.kind in "biuf" and dtype.fields is None
                and dtype.isnative and array.flags.c_contiguous)

    def close(self):
        """Free the templates of :meth:`attributed` and :meth:`layer_written` and the parent group :meth:`layer`
        holds."""
        self._filled = {}  # (their datasets closed before their file)
        self._seen_filled = set()
        if self._templates is not None:
            self._templates.close()
            self._templates = None
        self._made = {}
        self._seen = set()
        self._parent = (None, None)

    def allocated(self, gid, name, shape, dtype, dcpl):
        """An empty dataset ``name`` of ``shape`` and ``dtype`` in the group ``gid``, made with ``dcpl`` (its
        storage allocated at once, where the caller writes it): its DatasetID."""
        ftype, _ = self._type(np.dtype(dtype))
        space = h5s.create_simple(tuple(shape)) if len(shape) else self._scalar
        return h5d.create(gid, self.link_name(name)[0], ftype, space, dcpl=dcpl)

    def group(self, path):
        """The GroupID at ``path`` (text as h5py spells names), created with its parents where missing."""
        if path.strip("/") == "":
            return self.file.id
        name, lcpl = self.link_name(path)  # h5py's _e(path, lcpl=True), without a property list copied each call
        try:
            return h5g.create(self.file.id, name, lcpl=lcpl)
        except ValueError:  # it exists (a layer nested in one written before it)
            return h5g.open(self.file.id, name)

    def dataset(self, gid, name, array):
        """``create_dataset(name, data=array)`` in the group ``gid`` for a non-empty array (or a scalar) of plain
        numbers; False (nothing made) for anything else, which the caller writes with h5py's own call."""
        if array.size == 0 or array.dtype.kind not in "biuf" or array.dtype.fields is not None:
            return False
        space = h5s.create_simple(array.shape) if array.ndim else self._scalar
        array = np.ascontiguousarray(array)  # (a 0-d array comes out 1-d: the space is the array's own)
        ftype, _ = self._type(array.dtype)
        dsid = h5d.create(gid, self.link_name(name)[0], ftype, space, dcpl=self._dcpl)
        dsid.write(h5s.ALL, h5s.ALL, array)
        return True

    def attributes(self, gid, attrs, *, new=False):
        """``attrs[key] = value`` for each item (scalars: numbers, bools, strings); others by h5py's own call.
        ``new``: the object has no attributes yet (the caller just made it; otherwise asked of HDF5)."""
        bare = new or not h5a.get_num_attrs(gid)  # a group just made: none to replace, no lookup per attribute
        for key, value in attrs.items():
            kind = _PLAIN.get(type(value))
            data = np.asarray(value, dtype=kind) if kind is not None else base.array_for_new_object(value)
            name = key.encode("utf-8") if isinstance(key, str) else key
            bare = bare and name is not key  # a bytes key may spell a str key's name: looked up
            if data.shape != () or data.dtype.subdtype is not None:
                from h5py import AttributeManager

                AttributeManager(_Parent(gid))[key] = value
                continue
            ftype, mtype = self._type(data.dtype)
            if not bare and h5a.exists(gid, name):
                h5a.delete(gid, name)
            attr = h5a.create(gid, name, ftype, self._scalar)
            try:
                attr.write(data, mtype=mtype)
            finally:
                attr.close()

    def _type(self, dtype):
        types = self._types.get(dtype)
        if types is None:
            types = self._types[dtype] = (h5t.py_create(dtype, logical=True), h5t.py_create(dtype))
        return types


_DCPL = []


def _allocated():
    """The creation properties of a dataset :meth:`SmallWriter.written_at` writes: contiguous, its storage
    allocated at creation (its offset known), never filled by HDF5, no times (h5py's ``track_times=False``)."""
    if not _DCPL:
        dcpl = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_layout(h5d.CONTIGUOUS)
        dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
        dcpl.set_obj_track_times(False)
        _DCPL.append(dcpl)
    return _DCPL[0]


#: Templates one writer keeps at most (one per distinct set of attributes; past it, groups are made one by one).
MAX_TEMPLATES = 4096

#: Templates with datasets (:meth:`SmallWriter.layer_written`) one writer keeps at most, each holding its datasets
#: open and its arrays' bytes: past it, groups are made as :meth:`SmallWriter.layer` makes them.
MAX_FILLED_TEMPLATES = 64

#: The most bytes of arrays a group written from a template holds (its copy in the template is memory; the
#: per-group cost it saves matters for small groups only).
TEMPLATE_DATA_BYTES = 256 << 10


def _key(attrs):
    """``attrs`` as a hashable key (the type of each value too: 1 and True make different attributes), None
    where a value is no scalar."""
    try:
        key = tuple((k, type(v), v) for k, v in sorted(attrs.items()))
        hash(key)
    except TypeError:
        return None
    return key


def _encoded(name):
    """A link name as h5py encodes it (``CommonStateObject._e``): ASCII where it can be, else UTF-8."""
    if isinstance(name, bytes):
        return name, h5t.CSET_ASCII
    try:
        return name.encode("ascii"), h5t.CSET_ASCII
    except UnicodeEncodeError:
        return name.encode("utf8"), h5t.CSET_UTF8


#: The dtype h5py gives a plain Python value (``base.guess_dtype``, then NumPy's own), looked up by its type.
_PLAIN = {str: h5t.string_dtype(), bool: np.dtype(bool), int: np.asarray(0).dtype, float: np.dtype(np.float64)}


class _Parent:
    """What h5py's AttributeManager needs of its parent: the low-level id."""

    def __init__(self, oid):
        self.id = oid
