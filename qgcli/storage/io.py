"""Tensor specs, loading and saving of .npy / .npz / .h5 files, atomic writes.

A SPEC names one tensor: ``file.npy``, ``file.npz:key``, ``file.h5:group/dataset``, ``-`` (an .npy or .npz
stream on stdin; ``-:key`` picks a key of an npz stream), or, where the caller allows it, a literal number
or comma-separated list (``-6``, ``-1,-2.5,3``).  A BUNDLE is a whole .npz/.h5 file (or ``-``) whose
keys/datasets carry TensorFlow's operand names.

Safety rules kept here: nothing is ever unpickled (``allow_pickle=False``), literals are parsed with
``float()`` (never evaluated), HDF5 external links and virtual datasets that point outside their file are
refused, outputs are written to a temporary file next to the target and renamed into place, an existing
output is replaced only with ``force``, and an input is never an output.
"""
import contextlib
import io as _io
import os
import re
import sys
import tokenize
import warnings
import zipfile
import zlib
from dataclasses import dataclass

import numpy as np

from qgcli.errors import FileFormatError, OperandError, OutputError, QgcliError
from qgcli.storage.hdf5 import contiguous as h5_contiguous
from qgcli.storage.hdf5 import guard as hdf5_guard
from qgcli.signals import deferred, raise_pending

H5_SUFFIXES = (".h5", ".hdf5")
NPZ_SUFFIXES = (".npz",)
NPY_SUFFIXES = (".npy",)
SAFETENSORS_SUFFIXES = (".safetensors",)
ZARR_SUFFIXES = (".zarr",)  # a store (directory or URL): qgcli.storage.zarr_store
_CONTAINER_SUFFIXES = H5_SUFFIXES + NPZ_SUFFIXES + SAFETENSORS_SUFFIXES + ZARR_SUFFIXES
_KNOWN_SUFFIXES = _CONTAINER_SUFFIXES + NPY_SUFFIXES
_MAGIC = {"npy": b"\x93NUMPY", "npz": b"PK", "h5": b"\x89HDF\r\n\x1a\n"}
_NUMBER = r"[-+]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|inf|infinity|nan)"
_LITERAL = re.compile(rf"^\s*{_NUMBER}\s*(?:,\s*{_NUMBER}\s*)*,?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Spec:
    """A parsed SPEC: a file (``path``, or None for stdin) with an optional ``key``, or a ``literal``."""

    text: str
    path: str | None = None
    key: str | None = None
    literal: np.ndarray | None = None
    literal_ok: bool = False  # a literal was allowed here (for a better message when the text is neither)

    @property
    def is_stdin(self):
        return self.path is None and self.literal is None


def parse_literal(text):
    """A float64 array from ``"1.5"`` (0-d) or ``"1,2,3"`` / ``"1,"`` (1-d); None when ``text`` is no literal."""
    if not _LITERAL.match(text):
        return None
    parts = [p.strip() for p in text.split(",")]
    if len(parts) == 1:
        return np.array(float(parts[0]))
    return np.array([float(p) for p in parts if p])


def parse_spec(text, *, allow_literal=False):
    """Parse a SPEC string (see the module doc); never touches the file system except to tell
    a literal from an existing file of the same name."""
    if not isinstance(text, str):
        raise OperandError("a SPEC must be a string", operand="spec")
    if not text:
        return Spec(text, path="")  # refused when loaded, where the error can name the operand
    if text == "-":
        return Spec(text)
    if text.startswith("-:"):
        return Spec(text, key=text[2:] or None)
    if allow_literal and not os.path.exists(text):
        literal = parse_literal(text)
        if literal is not None:
            return Spec(text, literal=literal)
    lower = text.lower()
    if lower.endswith(_KNOWN_SUFFIXES):
        return Spec(text, path=text, literal_ok=allow_literal)
    # Split at the last ':' that follows a container suffix, so 'a:b.h5:x/y' is file 'a:b.h5', key 'x/y'.
    for i in range(len(text) - 1, -1, -1):
        if text[i] == ":" and lower[:i].endswith(_CONTAINER_SUFFIXES):
            return Spec(text, path=text[:i], key=text[i + 1 :] or None, literal_ok=allow_literal)
    return Spec(text, path=text, literal_ok=allow_literal)


def file_kind(path):
    """'npy', 'npz' or 'h5' from the file name; a clear error for anything else."""
    from qgcli.storage import zarr_store

    if zarr_store.is_zarr(path):
        return "zarr"
    lower = path.lower()
    if lower.endswith(NPY_SUFFIXES):
        return "npy"
    if lower.endswith(NPZ_SUFFIXES):
        return "npz"
    if lower.endswith(H5_SUFFIXES):
        return "h5"
    if lower.endswith(SAFETENSORS_SUFFIXES):
        return "safetensors"
    raise FileFormatError(f"unknown file type (expected .npy, .npz, .h5, .hdf5 or .safetensors): {path}")


def _sniff(data):
    for kind, magic in _MAGIC.items():
        if data.startswith(magic):
            return kind
    return None


class Stdin:
    """Standard input read once, on first use, and kept (several operands may come from one stream).

    At most ``limit`` bytes are held (default: a quarter of the machine's memory, as --memory-limit): a
    longer stream is refused with its size so far, not read to the end."""

    def __init__(self, stream=None, limit=None):
        self._stream = stream
        self._limit = limit
        self._data = None

    def read(self):
        if self._data is None:
            stream = self._stream if self._stream is not None else sys.stdin.buffer
            limit = self._limit if self._limit is not None else physical_memory() // 4
            chunks, size = [], 0
            while True:
                chunk = stream.read(min(1 << 24, limit + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise FileFormatError(f"stdin holds more than {_gib(limit)} (the memory limit); "
                                          "pass the file by name or raise --memory-limit")
            self._data = b"".join(chunks)
            if not self._data:
                raise FileFormatError("stdin is empty (expected an .npy, .npz or .h5 stream)")
        return self._data


class Container:
    """A readable tensor file (or stdin stream): ``names()`` and ``read(name)``; use as a context manager."""

    def __init__(self, source, label, kind):
        self.label = label
        self.kind = kind
        self._source = source
        self._handle = None

    @classmethod
    def open(cls, path=None, stdin=None):
        """Open ``path`` (or the stdin stream when ``path`` is None), checking that the bytes match the type."""
        if path == "":
            raise FileFormatError("an empty SPEC names no tensor")
        if path is None:
            data = (stdin if stdin is not None else Stdin()).read()
            kind = _sniff(data)
            if kind is None:
                raise FileFormatError("stdin is not an .npy, .npz or .h5 stream")
            container = cls(data, "<stdin>", kind)
            container._opened()  # a damaged stream fails here, as a FileFormatError
            return container
        kind = file_kind(path)
        if kind == "zarr":
            from qgcli.storage.zarr_store import ZarrContainer

            return ZarrContainer.open(path)
        if not os.path.exists(path):
            raise FileFormatError(f"no such file: {path}")
        if os.path.isdir(path):
            raise FileFormatError(f"is a directory, not a {kind} file: {path}")
        try:
            with open(path, "rb") as fh:
                head = fh.read(8)
        except OSError as exc:
            raise FileFormatError(f"cannot read {path}: {exc.strerror or exc}") from None
        found = _sniff(head)
        if kind == "safetensors" and found is None and len(head) == 8:
            found = kind  # an 8-byte little-endian header length, then JSON (checked when opened)
        if found != kind:
            what = "empty" if not head else f"not an {kind} file" + (f" (looks like {found})" if found else "")
            raise FileFormatError(f"{path} is {what}")
        container = cls(path, path, kind)
        container._opened()  # a damaged .npz/.h5 fails here, as a FileFormatError naming the file
        return container

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self._handle is not None and hasattr(self._handle, "close"):
            with deferred():
                self._handle.close()
        self._handle = None

    def _fail(self, message):
        raise FileFormatError(f"{self.label}: {message}")

    def _opened(self):
        if self._handle is None:
            src = _io.BytesIO(self._source) if isinstance(self._source, bytes) else self._source
            try:
                if self.kind == "h5":
                    import h5py

                    with deferred():
                        self._handle = h5py.File(src, "r")
                elif self.kind == "npz":
                    # zipfile itself, not np.load: each member is then read by the checked .npy reader.
                    self._handle = zipfile.ZipFile(src)
                elif self.kind == "safetensors":
                    self._handle = _open_safetensors(src)
                else:
                    self._handle = "npy"
            except QgcliError:
                raise
            except CORRUPT_FILE_ERRORS as exc:
                self._fail(f"cannot open as {self.kind}: {_reason(exc)}")
        return self._handle

    def names(self):
        """The tensor names (npz keys; HDF5 dataset paths through hard links, never soft or external links)."""
        handle = self._opened()
        if self.kind == "npy":
            return []
        if self.kind == "npz":
            return list(_npz_members(handle))
        if self.kind == "safetensors":
            return list(handle.keys())
        import h5py

        names = []
        try:
            # HDF5's object visitor follows hard links only and visits each object once (so cycles end).
            with deferred():
                handle.visititems(lambda name, obj: names.append(
                name.decode("utf-8", "surrogateescape") if isinstance(name, bytes) else name)
                if isinstance(obj, h5py.Dataset) else None)
        except CORRUPT_FILE_ERRORS as exc:
            self._fail(f"cannot list its datasets: {_reason(exc)}")
        return names

    def read(self, key=None):
        """The array under ``key`` (None: the .npy itself, or the only tensor of a container)."""
        handle = self._opened()
        if self.kind == "npy":
            if key is not None:
                self._fail(f"an .npy file holds one array; there is no key {key!r}")
            return _load_npy(self._source, self.label)
        if key is None:
            names = self.names()
            if len(names) != 1:
                self._fail(f"holds {len(names)} tensors ({', '.join(names[:8])}); name one with :KEY")
            key = names[0]
        if self.kind == "safetensors":
            if key not in handle.keys():
                self._fail(f"has no key {key!r} (keys: {', '.join(list(handle.keys())[:8]) or 'none'})")
            try:
                return handle.get_tensor(key)
            except CORRUPT_FILE_ERRORS as exc:
                self._fail(f"cannot read {key!r}: {_reason(exc)}")
        if self.kind == "npz":
            members = _npz_members(handle)
            if key not in members:
                self._fail(f"has no key {key!r} (keys: {', '.join(members) or 'none'})")
            return _read_npz_member(handle, members[key], key, self.label)
        with deferred():
            return _read_h5_dataset(handle, key, self.label)

    def dataset(self, key):
        """The h5py Dataset under ``key``, unread (for streaming); None for npy/npz containers."""
        if self.kind != "h5":
            return None
        with deferred():
            return _h5_dataset(self._opened(), key, self.label)

    def has(self, key):
        if self.kind == "safetensors":
            return key in self._opened().keys()
        if self.kind == "npz":
            return key in _npz_members(self._opened())
        if self.kind == "h5":
            try:
                with deferred():
                    _h5_resolve(self._opened(), key, self.label)
                return True
            except FileFormatError as exc:
                # Present but unreadable (an external link, say): say so when it is read, not "missing".
                return not isinstance(exc, _NoSuchObject)
        return False


# Exceptions that damaged or hostile bytes raise from zipfile, zlib, NumPy's header parser and h5py
# (HDF5 errors surface as OSError, KeyError, ValueError, RuntimeError, TypeError or IndexError).
# Readers turn them into a FileFormatError naming the file; a MemoryError is not among them.
CORRUPT_FILE_ERRORS = (OSError, EOFError, ValueError, KeyError, IndexError, TypeError, RuntimeError,
                       NotImplementedError, OverflowError, SyntaxError, zipfile.BadZipFile, zlib.error,
                       tokenize.TokenError,  # NumPy re-tokenizes a header it cannot parse (Python 2 files)
                       SystemError)  # h5py: an HDF5 error inside a link-visit callback leaks out as SystemError


class _NoSuchObject(FileFormatError):
    """A key names nothing in an HDF5 file."""


def _reason(exc):
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "allow_pickle" in text or "Object arrays" in text:
        return "it holds pickled Python objects, which qgcli never loads"
    if isinstance(exc, RecursionError):
        return "its structure nests too deeply (a cycle?)"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)  # ast's "<ast.Call object at 0x7f...>": no addresses


def physical_memory():
    """Bytes of physical memory: a tensor declaring more cannot be read, whatever the file claims."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return 1 << 62


def _gib(n):
    return f"{n / (1 << 30):.1f} GiB"


def _check_memory(nbytes, what):
    limit = physical_memory()
    if nbytes > limit:
        raise FileFormatError(f"{what} declares {_gib(nbytes)} of data, more than this machine's memory ({_gib(limit)})")


def _npy_stream(fh, available, what):
    """Read one .npy array from the binary stream ``fh`` holding ``available`` bytes.

    The header is checked before any data is allocated: no object dtype (that would mean unpickling),
    no negative dimension, and no more data promised than the stream holds, so a 100-byte file cannot
    make qgcli allocate terabytes.  NumPy parses the header with ``ast.literal_eval`` (never ``eval``).
    """
    fmt = np.lib.format
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # NumPy warns about Python-2 headers; one line on stderr is ours
            version = fmt.read_magic(fh)
            if version == (1, 0):
                shape, _, dtype = fmt.read_array_header_1_0(fh)
            elif version in ((2, 0), (3, 0)):
                # 3.0 differs from 2.0 only in the header's text encoding: same shape, same item size.
                shape, _, dtype = fmt.read_array_header_2_0(fh)
            else:
                raise ValueError(f"unsupported .npy format version {version[0]}.{version[1]}")
            if dtype.hasobject:
                raise FileFormatError(f"{what} holds pickled Python objects, which qgcli never loads")
            if any(d < 0 for d in shape):
                raise ValueError(f"the header gives a negative dimension in shape {list(shape)}")
            nbytes = dtype.itemsize
            for d in shape:
                nbytes *= d
            have = available - fh.tell()
            if nbytes > have:
                raise ValueError(f"truncated: the header promises {nbytes} bytes of data, the file holds {max(have, 0)}")
            _check_memory(nbytes, what)
            fh.seek(0)
            return fmt.read_array(fh, allow_pickle=False)
    except QgcliError:
        raise
    except CORRUPT_FILE_ERRORS as exc:
        raise FileFormatError(f"{what}: cannot read .npy: {_reason(exc)}") from None


def _load_npy(source, label):
    if isinstance(source, bytes):
        return _npy_stream(_io.BytesIO(source), len(source), label)
    try:
        with open(source, "rb") as fh:
            return _npy_stream(fh, os.fstat(fh.fileno()).st_size, label)
    except OSError as exc:
        raise FileFormatError(f"{label}: cannot read .npy: {exc.strerror or exc}") from None


def _npz_members(zf):
    """key -> member name, as np.load names them (``x.npy`` is key ``x``)."""
    try:
        names = zf.namelist()
    except CORRUPT_FILE_ERRORS:
        return {}
    return {(n[:-4] if n.endswith(".npy") else n): n for n in names}


def _read_npz_member(zf, member, key, label):
    what = f"{label}: key {key!r}"
    try:
        info = zf.getinfo(member)
        with zf.open(info) as fh:
            if fh.read(6) != _MAGIC["npy"]:
                raise FileFormatError(f"{what} is not an .npy array")
            fh.seek(0)
            return _npy_stream(fh, info.file_size, what)
    except QgcliError:
        raise
    except CORRUPT_FILE_ERRORS as exc:
        raise FileFormatError(f"{what} cannot be read: {_reason(exc)}") from None


_MAX_SOFT_LINKS = 16  # HDF5's own limit on soft-link hops (H5L_NUM_LINKS)


def _h5_resolve(handle, key, label):
    """The object at ``key``, walking the path one link at a time so that nothing outside the file is opened.

    Hard links are followed, soft links by their target path within the file (at most 16 hops, so a
    cycle ends), and an external link is refused before HDF5 would open the file it names.
    """
    import h5py
    from h5py import h5l

    if isinstance(key, bytes):  # a link name that is not UTF-8 (h5py hands those out as bytes)
        key = key.decode("utf-8", "surrogateescape")
    todo = [p for p in reversed(key.split("/")) if p and p != "."]
    node, hops = handle, 0
    try:
        while todo:
            part = todo.pop()
            name = part.encode("utf-8", "surrogateescape")
            if not isinstance(node, h5py.Group) or not node.id.links.exists(name):
                raise _NoSuchObject(f"{label}: has no dataset {key!r}")
            kind = node.id.links.get_info(name).type
            if kind == h5l.TYPE_EXTERNAL:
                target = node.id.links.get_val(name)[0].decode("utf-8", "replace")
                raise FileFormatError(f"{label}: {key!r} is an external link to {target}; qgcli does not follow it")
            if kind == h5l.TYPE_SOFT:
                hops += 1
                if hops > _MAX_SOFT_LINKS:
                    raise FileFormatError(f"{label}: {key!r} goes through more than {_MAX_SOFT_LINKS} soft links")
                target = node.id.links.get_val(name).decode("utf-8", "surrogateescape")
                if target.startswith("/"):
                    node = handle
                todo.extend(p for p in reversed(target.split("/")) if p and p != ".")
                continue
            if kind != h5l.TYPE_HARD:
                raise FileFormatError(f"{label}: {key!r} is a user-defined link; qgcli does not follow it")
            node = node[name]
    except QgcliError:
        raise
    except CORRUPT_FILE_ERRORS as exc:
        raise FileFormatError(f"{label}: cannot resolve {key!r}: {_reason(exc)}") from None
    return node


def _h5_dataset(handle, key, label):
    """The checked h5py Dataset under ``key``: no group, no virtual or external data outside the file."""
    return _checked_dataset(_h5_resolve(handle, key, label), key, label)


def _checked_dataset(node, key, label):
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
    except QgcliError:
        raise
    except CORRUPT_FILE_ERRORS as exc:
        raise FileFormatError(f"{label}: dataset {key!r} cannot be read: {_reason(exc)}") from None
    return node


def _read_h5_dataset(handle, key, label):
    return _read_dataset_node(_h5_dataset(handle, key, label), key, label)


def _read_dataset_node(node, key, label):
    """The array of a checked Dataset (:func:`_checked_dataset`)."""
    try:
        if node.dtype.hasobject:
            # Variable-length strings and sequences and references live in HDF5's global heap; no tensor
            # is stored that way, and a damaged heap made HDF5 loop forever on the read (fuzzing found it).
            raise FileFormatError(f"{label}: {key!r} holds {_h5_object_kind(node.dtype)}, not a tensor; "
                                  "qgcli does not read it")
        _check_memory(int(node.size or 0) * node.dtype.itemsize, f"{label}: {key!r}")
        data = h5_contiguous.read(node, f"{label}: dataset {key!r}")
        if data is None:
            data = node[()]
        bfloat16 = getattr(data, "dtype", None) == np.uint16 and tagged_bfloat16(node)
    except QgcliError:
        raise
    except CORRUPT_FILE_ERRORS as exc:
        raise FileFormatError(f"{label}: dataset {key!r} cannot be read: {_reason(exc)}") from None
    if bfloat16:
        import ml_dtypes

        data = data.view(ml_dtypes.bfloat16)
    return np.asarray(data)


#: Datasets up to this size take :func:`read_plain_dataset`'s one-call read (a run file's many small tensors).
PLAIN_READ_BYTES = 1 << 20


def read_plain_dataset(dsid, shape, dtype):
    """What ``_read_dataset_node(_checked_dataset(node, ...))`` gives of a small Dataset of plain numbers kept
    in its own file (``dsid``: its low-level DatasetID; ``shape``, ``dtype``: its own, already asked), in one
    low-level read without h5py's per-read layers; None for anything else, and on any error (the checked
    read then says why)."""
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
        dcpl = dsid.get_create_plist()
        if dcpl.get_layout() == h5d.VIRTUAL or dcpl.get_external_count():
            return None  # data outside this file: the checked read refuses it
        array = np.empty(shape, dtype=dtype)
        dsid.read(h5s.ALL, h5s.ALL, array)
    except CORRUPT_FILE_ERRORS:
        return None
    return array


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
    """:func:`read_attributes` of each of ``objs`` (a run file's groups), with every scalar string attribute
    of all of them read in one guarded batch (one round trip to :mod:`qgcli.storage.hdf5.guard`'s worker thread)."""
    from h5py import h5a

    outs, strings = [], []  # strings: (dict, key, AttrID)
    for obj in objs:
        out = {}
        outs.append(out)
        for key in _attribute_names(obj.id):
            key_text = key.decode("utf-8", "surrogateescape")
            try:
                attr = h5a.open(obj.id, key)
                dtype = attr.dtype
                if dtype.kind == "O":
                    out[key_text] = f"<{_h5_object_kind(dtype)}: not read>"
                    if attr.shape == ():
                        # the file's name only for the first (the message of a stuck read names it)
                        strings.append((out, key_text, attr, None if strings else obj.file.filename))
                elif dtype.kind in "biuf" and dtype.subdtype is None and attr.shape == ():
                    out[key_text] = _scalar_attribute(attr, dtype)  # what obj.attrs[key] gives, opened once
                else:
                    value = obj.attrs[key]
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
    from h5py import h5t

    value = np.zeros((), dtype=dtype)
    attr.read(value, mtype=h5t.py_create(dtype))
    return value[()]


def _h5_object_kind(dtype):
    import h5py

    if h5py.check_string_dtype(dtype) is not None:
        return "variable-length strings"
    if h5py.check_vlen_dtype(dtype) is not None:
        return "variable-length sequences"
    return "HDF5 references" if h5py.check_ref_dtype(dtype) is not None else f"objects ({dtype})"


def load_spec(spec, stdin=None, default_key=None):
    """The array a :class:`Spec` names (``default_key``: key to use in a container when the SPEC has none)."""
    if spec.literal is not None:
        return spec.literal
    if (spec.literal_ok and spec.path and not spec.path.lower().endswith(_KNOWN_SUFFIXES)
            and not os.path.exists(spec.path)):
        raise FileFormatError(f"{spec.text!r} is neither a number, a comma-separated list of numbers nor a tensor "
                              "file (.npy, .npz:KEY, .h5:DATASET)")
    with Container.open(spec.path, stdin) as container:
        key = spec.key
        if key is None and default_key is not None and container.has(default_key):
            key = default_key
        return container.read(key)


# --- writing -------------------------------------------------------------------------------------

def output_kind(dest):
    """'stdout', 'dir', 'h5', 'npz' or 'npy' for an ``-o`` target."""
    from qgcli.storage import zarr_store

    if dest == "-":
        return "stdout"
    if zarr_store.is_zarr(dest):  # a directory, but one store, written as a whole
        return "zarr"
    if dest.endswith(os.sep) or dest.endswith("/") or os.path.isdir(dest):
        return "dir"
    kind = file_kind(dest)
    return kind


def _same_file(a, b):
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_output(dest, *, inputs=(), force=False, names=()):
    """Refuse an output that is an input, exists (without ``force``) or lies in a missing or read-only
    directory; for ``DIR/`` the same for each ``DIR/name.npy`` of ``names``."""
    try:
        kind = output_kind(dest)
    except FileFormatError:
        raise OutputError(f"cannot tell the output format of {dest!r}: use FILE.h5, FILE.npz, FILE.npy (one output), "
                          "STORE.zarr, DIR/ or -",
                          operand="--output") from None
    if kind == "stdout":
        return kind
    if kind == "zarr":
        from qgcli.storage import zarr_store

        zarr_store.check_output(dest, inputs=inputs, force=force)
        return kind
    targets = _dir_targets(dest, names) if kind == "dir" else [dest]
    for target in targets:
        for source in inputs:
            if source and os.path.exists(source) and os.path.exists(target) and _same_file(source, target):
                raise OutputError(f"{target} is also an input; qgcli never overwrites its inputs", operand="--output")
    if kind == "dir":
        directory = dest.rstrip("/") or "/"
        if os.path.lexists(directory) and not os.path.isdir(directory):
            raise OutputError(f"{directory} is a file, not a directory", operand="--output")
        parent = os.path.dirname(os.path.abspath(directory))
        if not os.path.isdir(directory) and not os.path.isdir(parent):
            raise OutputError(f"directory {parent} does not exist", operand="--output")
        existing = [t for t in targets if os.path.lexists(t)]
        if existing and not force:
            raise OutputError(f"{existing[0]} exists; use --force to replace it", operand="--output")
        for target in existing:
            if os.path.isdir(target):
                raise OutputError(f"{target} is a directory", operand="--output")
        writable = directory if os.path.isdir(directory) else parent
        if not os.access(writable, os.W_OK | os.X_OK):
            raise OutputError(f"directory {writable} is not writable", operand="--output")
        return kind
    parent = os.path.dirname(os.path.abspath(dest))
    if not os.path.isdir(parent):
        raise OutputError(f"directory {parent} does not exist", operand="--output")
    if os.path.isdir(dest):
        raise OutputError(f"{dest} is a directory; end it with / to write one .npy per output", operand="--output")
    if os.path.lexists(dest) and not force:
        raise OutputError(f"{dest} exists; use --force to replace it", operand="--output")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"directory {parent} is not writable", operand="--output")
    return kind


@contextlib.contextmanager
def open_h5_for_writing(path):
    """``with h5py.File(path, "w")``, without a chunk cache and with signals deferred until the file is
    closed (a signal inside an HDF5 call would leave HDF5 half-way; the writer calls
    :func:`qgcli.signals.raise_pending` where it can stop).  Outputs are written once, so the cache buys
    nothing, and with HDF5 2.0 a write that fails while the cache holds chunks (a full disk) crashes the
    process with SIGSEGV instead of raising."""
    import h5py

    with deferred(), h5py.File(path, "w", rdcc_nbytes=0) as f:
        yield f


def _write_h5(fh, arrays, attrs, compression=None):
    with open_h5_for_writing(fh) as f:
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


def _write_npz(fh, arrays):
    """np.savez's layout, with the zip file closed on every failure (NumPy 1.x's savez leaves it open when a
    write fails, and its __del__ then reports an error on stderr)."""
    with zipfile.ZipFile(fh, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for k, v in arrays.items():
            with zf.open(k + ".npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asarray(v), allow_pickle=False)


def temp_token():
    """16 random hex digits for a temporary name: ``secrets.token_hex(8)``'s bytes (``os.urandom``), without
    importing secrets (hashlib, hmac, random: 6 ms of every start)."""
    return os.urandom(8).hex()


def atomic_write(dest, writer):
    """Run ``writer(path)`` on a temporary file beside ``dest``, then rename it over ``dest``.

    The temporary file (``.qgcli-*.tmp``, hidden) is removed on any failure or interrupt, so ``dest`` is
    either absent, the old file, or complete; only a SIGKILL, which no process can catch, can leave a
    temporary file (or ``.qgcli-*.tmpdir``) behind, never a partial ``dest``.
    """
    tmp = _stage(dest, writer)
    _commit([(tmp, dest)])


def _stage(dest, writer):
    """Write ``dest``'s future content to a synced temporary file in its directory; returns its path."""
    parent = os.path.dirname(os.path.abspath(dest))
    try:  # --force keeps the mode of the file it replaces; a new file gets the usual 0666 & ~umask
        mode = os.stat(dest).st_mode & 0o777
    except OSError:
        mode = 0o666 & ~_umask()
    tmp = None
    hdf5_files = _open_hdf5_files()
    try:
        # Not tempfile.mkstemp: its name is known only after the file exists, and an interrupt in between
        # would leave the file behind.  Here the name is set first, so cleanup always knows it.
        for _ in range(100):
            tmp = os.path.join(parent, f".qgcli-{temp_token()}.tmp")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                break
            except FileExistsError:
                tmp = None
        else:
            raise FileExistsError(f"no free temporary file name in {parent}")
        os.close(fd)
        writer(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the data is on disk before the rename makes it visible
        finally:
            os.close(fd)
        os.chmod(tmp, mode)  # created 0600 while being written
    except BaseException as exc:
        if tmp is not None:
            _unlink(tmp)
        if _open_hdf5_files() > hdf5_files:
            # HDF5 could not close the file it failed to write (a full disk).  Touching its objects again
            # (even freeing them) can crash HDF5 2.0, so they are kept, and the CLI exits with os._exit.
            _hdf5_left_open.append(exc)
        error = _as_os_error(exc, dest)
        if error is not None and error is not exc:
            raise error from None
        raise
    return tmp


_hdf5_left_open = []


def _open_hdf5_files():
    """How many files HDF5 holds open (0 when h5py was never imported)."""
    h5py = sys.modules.get("h5py")
    if h5py is None:
        return 0
    try:
        return h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE)
    except Exception:  # noqa: BLE001 - HDF5 in a bad state: count it as one more
        return 1 << 30


def hdf5_left_open():
    """True when a failed write left an HDF5 file that HDF5 could not close, or HDF5 is stuck in a
    guarded read: the process should end with ``os._exit`` (HDF5's exit handler would crash on it)."""
    return bool(_hdf5_left_open) or hdf5_guard.stuck()


def _commit(staged):
    """Rename each staged ``(tmp, dest)`` into place, then sync the directories (so the renames survive a
    power cut); on failure the temporaries not yet renamed are removed."""
    try:
        raise_pending()  # a Ctrl-C that Python swallowed in a __del__ still stops the output
        for tmp, dest in staged:
            os.replace(tmp, dest)
    except BaseException:
        for tmp, _ in staged:
            _unlink(tmp)
        raise
    for parent in {os.path.dirname(os.path.abspath(d)) for _, d in staged}:
        _fsync_directory(parent)


def _fsync_directory(path):
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; a rename is still atomic


def _unlink(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def _as_os_error(exc, dest):
    """An OSError for a failed write (HDF5 reports a full disk as RuntimeError/OSError "... errno = 28 ...");
    None when ``exc`` is no I/O failure."""
    match = re.search(r"errno = (\d+)", str(exc)) if isinstance(exc, (OSError, RuntimeError)) else None
    if match and not (isinstance(exc, OSError) and exc.errno):
        number = int(match.group(1))
        return OSError(number, os.strerror(number), dest)
    return exc if isinstance(exc, OSError) else None


def _safetensors_numpy():
    try:
        import safetensors.numpy
    except ImportError:
        raise FileFormatError(".safetensors files need the safetensors package: pip install safetensors") from None
    return safetensors.numpy


def _open_safetensors(path):
    """A safetensors file's tensors as NumPy arrays, read lazily (``keys()``, ``get_tensor(key)``)."""
    _safetensors_numpy()
    from safetensors import safe_open

    if not isinstance(path, str):
        raise FileFormatError("a .safetensors stream on stdin is not supported; give the file")
    try:
        return safe_open(path, framework="np")
    except Exception as exc:  # noqa: BLE001 - SafetensorError (a Rust error type) and OSError: damaged bytes
        raise FileFormatError(f"{path}: cannot open as safetensors: {exc}") from None


def _write_safetensors(path, arrays, attrs=None):
    """``arrays`` as one .safetensors file; string attributes (the op's) go to its metadata."""
    st = _safetensors_numpy()
    tensors = {name: np.ascontiguousarray(np.asarray(a)) for name, a in arrays.items()}
    metadata = {str(k): str(v) for k, v in (attrs or {}).items() if v is not None}
    st.save_file(tensors, path, metadata=metadata or None)


def save_outputs(arrays, dest, *, attrs=None, stdout=None, compression=None):
    """Write ``arrays`` (name -> array) to ``dest`` as .h5 / .npz / a directory of .npy / npz on stdout.

    .h5 and .npz keep the exact names.  ``DIR/`` gets one .npy per name at the path
    :func:`qgcli.storage.paths.group_file_paths` gives it (a ``/`` in a name is a sub-folder; ``..``, separators,
    control characters, device names and over-long names never reach the file system as they are) and,
    when some name had to change, ``DIR/index.json`` mapping every exact name to its file.

    Call :func:`check_output` first; this function assumes the target is allowed.
    """
    attrs = attrs or {}
    kind = output_kind(dest)
    if kind == "stdout":
        buf = _io.BytesIO()
        _write_npz(buf, arrays)
        out = stdout if stdout is not None else sys.stdout.buffer
        raise_pending()
        out.write(buf.getvalue())
        out.flush()
        return
    if kind == "zarr":
        from qgcli.storage import zarr_store

        zarr_store.save(dest, arrays, attrs=attrs, compression=compression)
        return
    if kind == "h5":
        atomic_write(dest, lambda p: _write_h5(p, arrays, attrs, compression))
    elif kind == "safetensors":
        atomic_write(dest, lambda p: _write_safetensors(p, arrays, attrs))
    elif kind == "npz":
        def write(path):
            with open(path, "wb") as fh:
                _write_npz(fh, arrays)
        atomic_write(dest, write)
    elif kind == "npy":
        if len(arrays) != 1:
            raise OutputError(
                f"an .npy file holds one array but there are {len(arrays)} outputs ({', '.join(arrays)}); "
                "use .h5, .npz or a directory/",
                operand="--output",
            )
        (array,) = arrays.values()
        atomic_write(dest, lambda p: _write_npy(p, array))
    elif not os.path.isdir(dest):
        _write_new_directory(dest, arrays)
    else:
        # An existing directory: every file is written and synced first, then all are renamed together.
        staged = []
        try:
            for target, writer in _dir_files(dest, arrays):
                os.makedirs(os.path.dirname(target), exist_ok=True)
                staged.append((_stage(target, writer), target))
            _commit(staged)
        except BaseException:
            for tmp, _ in staged:
                _unlink(tmp)
            raise


def _dir_targets(dest, names):
    """The files ``-o DIR/`` writes for ``names``: one .npy each (paths from :mod:`qgcli.storage.paths`), and the
    index when a name had to change."""
    from qgcli.storage.paths import INDEX_NAME, group_file_paths

    layout = group_file_paths(names, suffix=".npy")
    return [layout.target(dest, n) for n in layout] + ([os.path.join(dest, INDEX_NAME)] if layout.changed else [])


def _dir_files(directory, arrays):
    """(path, writer) for each file of ``-o DIR/``: ``name.npy`` per output as :func:`qgcli.storage.paths.group_file_paths`
    names it (a ``/`` in a name makes a sub-folder; a name from a file never leaves ``directory``), then
    ``index.json`` when some name had to change."""
    from qgcli.storage.paths import INDEX_NAME, group_file_paths

    layout = group_file_paths(arrays, suffix=".npy")
    files = [(layout.target(directory, n), lambda p, a=arrays[n]: _write_npy(p, a)) for n in layout]
    if layout.changed:
        files.append((os.path.join(directory, INDEX_NAME), lambda p: _write_text(p, layout.index_json())))
    return files


def write_index(directory, layout, *, always=False):
    """Write ``layout.index_json()`` (a :class:`qgcli.storage.paths.FileLayout`) as ``directory/index.json``, atomically,
    when ``layout.changed`` or ``always``: for outputs that :func:`save_outputs` does not write (figures,
    Zarr groups).  Returns the path written, or None."""
    from qgcli.storage.paths import INDEX_NAME

    if not (always or layout.changed):
        return None
    target = os.path.join(directory, INDEX_NAME)
    atomic_write(target, lambda p: _write_text(p, layout.index_json()))
    return target


def _write_text(path, text):
    with open(path, "w", encoding="ascii") as fh:
        fh.write(text)


def _write_new_directory(dest, arrays):
    """``DIR/`` that does not exist yet: built as a hidden ``.qgcli-*.tmpdir`` beside it and renamed into
    place in one step, so DIR appears with all its files or not at all (even after a SIGKILL)."""
    directory = os.path.abspath(dest.rstrip("/") or dest)
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmpdir = None
    try:
        for _ in range(100):
            tmpdir = os.path.join(parent, f".qgcli-{temp_token()}.tmpdir")  # named before it exists
            try:
                os.mkdir(tmpdir, 0o700)
                break
            except FileExistsError:
                tmpdir = None
        else:
            raise FileExistsError(f"no free temporary directory name in {parent}")
        staged = []
        for target, writer in _dir_files(tmpdir, arrays):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            staged.append((_stage(target, writer), target))
        for tmp, target in staged:
            os.replace(tmp, target)
        os.chmod(tmpdir, 0o777 & ~_umask())
        _fsync_directory(tmpdir)
        raise_pending()
        os.rename(tmpdir, directory)  # atomic; fails if DIR appeared meanwhile and is not empty
        tmpdir = None
        _fsync_directory(parent)
    except BaseException as exc:
        if tmpdir is not None:
            import shutil

            shutil.rmtree(tmpdir, ignore_errors=True)
        error = _as_os_error(exc, dest)
        if error is not None and error is not exc:
            raise error from None
        raise


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_npy(path, array):
    """An .npy file written with plain ``write`` calls, so that a full disk raises OSError(ENOSPC/EFBIG)
    (``np.save`` uses ``tofile``, whose short write says only "N requested and M written")."""
    fmt = np.lib.format
    array = np.asarray(array)
    if array.dtype.hasobject:
        raise OutputError("object arrays are never written", operand="--output")
    header = fmt.header_data_from_array_1_0(array)
    data = array.T if header["fortran_order"] else array
    data = np.ascontiguousarray(data).reshape(-1)
    with open(path, "wb") as fh:
        try:
            fmt.write_array_header_1_0(fh, header)
        except ValueError:  # a header over 64 KiB (thousands of dimensions) needs format 2.0
            fmt.write_array_header_2_0(fh, header)
        fh.write(data.view(np.uint8).data)
