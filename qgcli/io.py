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
import io as _io
import os
import re
import sys
import tempfile
import zipfile
from dataclasses import dataclass

import numpy as np

from qgcli.errors import FileFormatError, OperandError, OutputError

H5_SUFFIXES = (".h5", ".hdf5")
NPZ_SUFFIXES = (".npz",)
NPY_SUFFIXES = (".npy",)
_CONTAINER_SUFFIXES = H5_SUFFIXES + NPZ_SUFFIXES
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
    if not isinstance(text, str) or not text:
        raise OperandError("an empty SPEC names no tensor", operand="spec")
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
        return Spec(text, path=text)
    # Split at the last ':' that follows a container suffix, so 'a:b.h5:x/y' is file 'a:b.h5', key 'x/y'.
    for i in range(len(text) - 1, -1, -1):
        if text[i] == ":" and lower[:i].endswith(_CONTAINER_SUFFIXES):
            return Spec(text, path=text[:i], key=text[i + 1 :] or None)
    return Spec(text, path=text)


def file_kind(path):
    """'npy', 'npz' or 'h5' from the file name; a clear error for anything else."""
    lower = path.lower()
    if lower.endswith(NPY_SUFFIXES):
        return "npy"
    if lower.endswith(NPZ_SUFFIXES):
        return "npz"
    if lower.endswith(H5_SUFFIXES):
        return "h5"
    raise FileFormatError(f"unknown file type (expected .npy, .npz, .h5 or .hdf5): {path}")


def _sniff(data):
    for kind, magic in _MAGIC.items():
        if data.startswith(magic):
            return kind
    return None


class Stdin:
    """Standard input read once, on first use, and kept (several operands may come from one npz stream)."""

    def __init__(self, stream=None):
        self._stream = stream
        self._data = None

    def read(self):
        if self._data is None:
            stream = self._stream if self._stream is not None else sys.stdin.buffer
            self._data = stream.read()
            if not self._data:
                raise FileFormatError("stdin is empty (expected an .npy or .npz stream)")
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
        if path is None:
            data = stdin.read()
            kind = _sniff(data)
            if kind not in ("npy", "npz"):
                raise FileFormatError("stdin is not an .npy or .npz stream")
            return cls(data, "<stdin>", kind)
        kind = file_kind(path)
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
        if found != kind:
            what = "empty" if not head else f"not an {kind} file" + (f" (looks like {found})" if found else "")
            raise FileFormatError(f"{path} is {what}")
        return cls(path, path, kind)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self._handle is not None and hasattr(self._handle, "close"):
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

                    self._handle = h5py.File(src, "r")
                elif self.kind == "npz":
                    self._handle = np.load(src, allow_pickle=False)
                else:
                    self._handle = "npy"
            except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
                self._fail(f"cannot open as {self.kind}: {_reason(exc)}")
        return self._handle

    def names(self):
        """The tensor names (npz keys; HDF5 dataset paths, walking groups but never external links)."""
        handle = self._opened()
        if self.kind == "npy":
            return []
        if self.kind == "npz":
            return list(handle.files)
        names = []

        def walk(group, prefix):
            for name in group:
                link = group.get(name, getlink=True)
                import h5py

                if isinstance(link, h5py.ExternalLink):
                    continue
                obj = group.get(name)
                if isinstance(obj, h5py.Dataset):
                    names.append(prefix + name)
                elif isinstance(obj, h5py.Group):
                    walk(obj, prefix + name + "/")

        walk(handle, "")
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
        if self.kind == "npz":
            if key not in handle.files:
                self._fail(f"has no key {key!r} (keys: {', '.join(handle.files) or 'none'})")
            try:
                return handle[key]
            except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
                self._fail(f"key {key!r} cannot be read: {_reason(exc)}")
        return _read_h5_dataset(handle, key, self.label)

    def has(self, key):
        if self.kind == "npz":
            return key in self._opened().files
        if self.kind == "h5":
            handle = self._opened()
            try:
                return key in handle
            except Exception:
                return False
        return False


def _reason(exc):
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "allow_pickle" in text or "Object arrays" in text:
        return "it holds pickled Python objects, which qgcli never loads"
    return text


def _load_npy(source, label):
    try:
        if isinstance(source, bytes):
            return np.load(_io.BytesIO(source), allow_pickle=False)
        return np.load(source, allow_pickle=False, mmap_mode=None)
    except (ValueError, OSError, EOFError) as exc:
        raise FileFormatError(f"{label}: cannot read .npy: {_reason(exc)}") from None


def _read_h5_dataset(handle, key, label):
    import h5py

    # Walk the path link by link: an external link would silently read another file.
    node = handle
    for part in [p for p in key.split("/") if p]:
        if not isinstance(node, h5py.Group) or part not in node:
            raise FileFormatError(f"{label}: has no dataset {key!r}")
        link = node.get(part, getlink=True)
        if isinstance(link, h5py.ExternalLink):
            raise FileFormatError(f"{label}: {key!r} is an external link to {link.filename}; qgcli does not follow it")
        node = node[part]
    if not isinstance(node, h5py.Dataset):
        raise FileFormatError(f"{label}: {key!r} is a group, not a dataset")
    if node.is_virtual:
        for source in node.virtual_sources():
            if source.file_name not in (".", handle.filename):
                raise FileFormatError(
                    f"{label}: {key!r} is a virtual dataset reading {source.file_name}; qgcli does not follow it"
                )
    try:
        data = node[()]
    except (OSError, ValueError, TypeError) as exc:
        raise FileFormatError(f"{label}: dataset {key!r} cannot be read: {_reason(exc)}") from None
    if node.attrs.get("dtype") in ("bfloat16", b"bfloat16") and data.dtype == np.uint16:
        import ml_dtypes

        data = data.view(ml_dtypes.bfloat16)
    return np.asarray(data)


def load_spec(spec, stdin=None, default_key=None):
    """The array a :class:`Spec` names (``default_key``: key to use in a container when the SPEC has none)."""
    if spec.literal is not None:
        return spec.literal
    with Container.open(spec.path, stdin) as container:
        key = spec.key
        if key is None and default_key is not None and container.has(default_key):
            key = default_key
        return container.read(key)


# --- writing -------------------------------------------------------------------------------------

def output_kind(dest):
    """'stdout', 'dir', 'h5', 'npz' or 'npy' for an ``-o`` target."""
    if dest == "-":
        return "stdout"
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
    """Refuse an output that is an input, exists (without ``force``) or lies in a missing directory."""
    kind = output_kind(dest)
    if kind == "stdout":
        return kind
    targets = [os.path.join(dest, n + ".npy") for n in names] if kind == "dir" else [dest]
    for target in targets:
        for source in inputs:
            if source and os.path.exists(source) and os.path.exists(target) and _same_file(source, target):
                raise OutputError(f"{target} is also an input; qgcli never overwrites its inputs", operand="--output")
    if kind == "dir":
        parent = os.path.dirname(os.path.abspath(dest.rstrip("/") or "."))
        if not os.path.isdir(dest) and not os.path.isdir(parent):
            raise OutputError(f"directory {parent} does not exist", operand="--output")
        existing = [t for t in targets if os.path.exists(t)]
        if existing and not force:
            raise OutputError(f"{existing[0]} exists; use --force to replace it", operand="--output")
        return kind
    parent = os.path.dirname(os.path.abspath(dest))
    if not os.path.isdir(parent):
        raise OutputError(f"directory {parent} does not exist", operand="--output")
    if os.path.isdir(dest):
        raise OutputError(f"{dest} is a directory; end it with / to write one .npy per output", operand="--output")
    if os.path.exists(dest) and not force:
        raise OutputError(f"{dest} exists; use --force to replace it", operand="--output")
    if not os.access(parent, os.W_OK):
        raise OutputError(f"directory {parent} is not writable", operand="--output")
    return kind


def _write_h5(fh, arrays, attrs, compression=None):
    import h5py

    with h5py.File(fh, "w") as f:
        for key, value in attrs.items():
            f.attrs[key] = value
        for name, array in arrays.items():
            array = np.asarray(array)
            options = {}
            if compression and array.ndim and array.size:
                options = {"compression": compression, "chunks": True}
            if array.dtype.name == "bfloat16":
                ds = f.create_dataset(name, data=array.view(np.uint16), **options)
                ds.attrs["dtype"] = "bfloat16"
            else:
                ds = f.create_dataset(name, data=array, **options)
            for key, value in attrs.items():
                ds.attrs[key] = value


def _write_npz(fh, arrays):
    np.savez(fh, **{k: np.asarray(v) for k, v in arrays.items()})


def atomic_write(dest, writer):
    """Run ``writer(path)`` on a temporary file beside ``dest``, then rename it over ``dest``.

    The temporary file is removed on any failure or interrupt, so ``dest`` is either absent, the old
    file, or complete.
    """
    parent = os.path.dirname(os.path.abspath(dest))
    fd, tmp = tempfile.mkstemp(prefix=".qgcli-", suffix=".tmp", dir=parent)
    os.close(fd)
    try:
        writer(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes the file 0600; outputs get the usual mode
        os.replace(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def save_outputs(arrays, dest, *, attrs=None, stdout=None, compression=None):
    """Write ``arrays`` (name -> array) to ``dest`` as .h5 / .npz / a directory of .npy / npz on stdout.

    Call :func:`check_output` first; this function assumes the target is allowed.
    """
    attrs = attrs or {}
    kind = output_kind(dest)
    if kind == "stdout":
        buf = _io.BytesIO()
        _write_npz(buf, arrays)
        out = stdout if stdout is not None else sys.stdout.buffer
        out.write(buf.getvalue())
        out.flush()
        return
    if kind == "h5":
        atomic_write(dest, lambda p: _write_h5(p, arrays, attrs, compression))
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
    else:
        os.makedirs(dest, exist_ok=True)
        for name, array in arrays.items():
            atomic_write(os.path.join(dest, name + ".npy"), lambda p, a=array: _write_npy(p, a))


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_npy(path, array):
    with open(path, "wb") as fh:  # a file object: np.save would append ".npy" to a path
        np.save(fh, np.asarray(array), allow_pickle=False)
