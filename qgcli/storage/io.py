"""Tensor specs, containers to read them from, and the outputs of a command: the storage package's face.

A SPEC names one tensor: ``file.npy``, ``file.npz:key``, ``file.h5:group/dataset``, ``-`` (an .npy or .npz
stream on stdin; ``-:key`` picks a key of an npz stream), or, where the caller allows it, a literal number
or comma-separated list (``-6``, ``-1,-2.5,3``).  A BUNDLE is a whole .npz/.h5 file (or ``-``) whose
keys/datasets carry TensorFlow's operand names.

Each format is a module of its own, chosen in :mod:`qgcli.storage.formats`; this module parses SPECs and
dispatches to the format.  Safety rules kept by the formats: nothing is ever unpickled
(``allow_pickle=False``), literals are parsed with ``float()`` (never evaluated), HDF5 external links and
virtual datasets that point outside their file are refused, outputs are written to a temporary file next to
the target and renamed into place (:mod:`qgcli.storage.atomic`), an existing output is replaced only with
``force``, and an input is never an output.
"""
import os
import re
import stat
from dataclasses import dataclass

import numpy as np

from qgcli.errors import FileFormatError, OperandError, OutputError, QgcliError
from qgcli.signals import deferred
from qgcli.storage import formats
# The package's public face: what commands, families, executors and reports take from storage.
from qgcli.storage.atomic import atomic_write  # noqa: F401 - plots, capture
from qgcli.storage.checks import CORRUPT_FILE_ERRORS, physical_memory, reason  # noqa: F401 - executors
from qgcli.storage.h5 import tagged_bfloat16  # noqa: F401 - families, executors
from qgcli.storage.stdio import Stdin  # noqa: F401 - commands

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
    if lower.endswith(formats.KNOWN_SUFFIXES):
        return Spec(text, path=text, literal_ok=allow_literal)
    # Split at the last ':' that follows a container suffix, so 'a:b.h5:x/y' is file 'a:b.h5', key 'x/y'.
    for i in range(len(text) - 1, -1, -1):
        if text[i] == ":" and lower[:i].endswith(formats.CONTAINER_SUFFIXES):
            return Spec(text, path=text[:i], key=text[i + 1 :] or None, literal_ok=allow_literal)
    return Spec(text, path=text, literal_ok=allow_literal)


def file_kind(path):
    """'npy', 'npz', 'h5', 'safetensors' or 'zarr' from the file name; a clear error for anything else."""
    return formats.for_input(path).name


class Container:
    """A readable tensor file (or stdin stream): ``names()`` and ``read(name)``; use as a context manager.

    What to do with the bytes is the format's (``self.format``, from :mod:`qgcli.storage.formats`)."""

    def __init__(self, source, label, fmt):
        self.label = label
        self.format = fmt
        self.kind = fmt.name
        self._source = source
        self._handle = None

    @classmethod
    def open(cls, path=None, stdin=None):
        """Open ``path`` (or the stdin stream when ``path`` is None), checking that the bytes match the type."""
        if path == "":
            raise FileFormatError("an empty SPEC names no tensor")
        if path is None:
            data = (stdin if stdin is not None else Stdin()).read()
            fmt = formats.sniff(data)
            if fmt is None:
                raise FileFormatError("stdin is not an .npy, .npz or .h5 stream")
            container = cls(data, "<stdin>", fmt)
            container._opened()  # a damaged stream fails here, as a FileFormatError
            return container
        fmt = formats.for_input(path)
        if hasattr(fmt, "open_container"):  # a store: its own container
            return fmt.open_container(path)
        kind = fmt.name
        if not os.path.exists(path):
            raise FileFormatError(f"no such file: {path}")
        if os.path.isdir(path):
            raise FileFormatError(f"is a directory, not a {kind} file: {path}")
        _refuse_special(path)
        try:
            with open(path, "rb") as fh:
                head = fh.read(8)
        except OSError as exc:
            raise FileFormatError(f"cannot read {path}: {exc.strerror or exc}") from None
        if not formats.head_fits(fmt, head):
            found = formats.sniff(head)
            what = "empty" if not head else f"not an {kind} file" + (f" (looks like {found.name})" if found else "")
            raise FileFormatError(f"{path} is {what}")
        container = cls(path, path, fmt)
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

    def _opened(self):
        if self._handle is None:
            try:
                self._handle = self.format.open(self._source)
            except QgcliError:
                raise
            except CORRUPT_FILE_ERRORS as exc:
                raise FileFormatError(f"{self.label}: cannot open as {self.kind}: {reason(exc)}") from None
        return self._handle

    def names(self):
        """The tensor names (npz keys; HDF5 dataset paths through hard links, never soft or external links)."""
        return self.format.names(self._opened(), self.label)

    def read(self, key=None):
        """The array under ``key`` (None: the .npy itself, or the only tensor of a container)."""
        handle = self._opened()
        if key is None and self.format.holds_many:
            names = self.names()
            if len(names) != 1:
                raise FileFormatError(f"{self.label}: holds {len(names)} tensors ({', '.join(names[:8])}); "
                                      "name one with :KEY")
            key = names[0]
        return self.format.read(handle, key, self.label)

    def dataset(self, key):
        """The h5py Dataset under ``key``, unread (for streaming); None for formats that do not stream."""
        if not hasattr(self.format, "dataset"):
            return None
        return self.format.dataset(self._opened(), key, self.label)

    def flat(self, key):
        """The tensor under ``key`` as plain bytes at an offset of the file (:class:`qgcli.storage.flat.FlatTensor`,
        unread, for streaming; the caller closes it); None where the format, a stream or the member (a
        compressed .npz member) does not hold it so."""
        if not hasattr(self.format, "flat") or not isinstance(self._source, str):
            return None
        if key is None and self.format.holds_many:
            names = self.names()
            if len(names) != 1:
                return None  # reading it says which to name
            key = names[0]
        return self.format.flat(self._source, key, self.label)

    def has(self, key):
        return self.format.has(self._opened(), key, self.label)

    def attributes(self):
        """The file's own attributes where the format keeps them apart from the tensors' (a safetensors
        header's metadata); {} otherwise.  (HDF5's, on every object, are read by walking the file.)"""
        if not hasattr(self.format, "attributes"):
            return {}
        return self.format.attributes(self._opened(), self.label)

    def header(self, key):
        """``(shape, dtype)`` of a tensor from its header alone, where the format can tell; else (None, None)."""
        if not hasattr(self.format, "header"):
            return None, None
        return self.format.header(self._opened(), key)


_SPECIAL = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
            (stat.S_ISBLK, "a block device"))


def _refuse_special(path):
    """Refuse what is not a regular file (a FIFO would block the read forever, a device never ends): a stream
    is read from stdin, as ``-``."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise FileFormatError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        what = next((name for test, name in _SPECIAL if test(mode)), "not a regular file")
        raise FileFormatError(f"{path} is {what}, not a regular file; pipe a stream to stdin and name it -")


def load_spec(spec, stdin=None, default_key=None):
    """The array a :class:`Spec` names (``default_key``: key to use in a container when the SPEC has none)."""
    if spec.literal is not None:
        return spec.literal
    if (spec.literal_ok and spec.path and not spec.path.lower().endswith(formats.KNOWN_SUFFIXES)
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
    """'stdout', 'dir', 'zarr', 'h5', 'npz', 'npy' or 'safetensors' for an ``-o`` target."""
    return formats.for_output(dest).name


def check_output(dest, *, inputs=(), force=False, names=()):
    """Refuse an output that is an input, exists (without ``force``) or lies in a missing or read-only
    directory; for ``DIR/`` the same for each ``DIR/name.npy`` of ``names``.  Returns the format's name."""
    try:
        fmt = formats.for_output(dest)
    except FileFormatError:
        raise OutputError(f"cannot tell the output format of {dest!r}: use FILE.h5, FILE.npz, FILE.npy (one output), "
                          "STORE.zarr, DIR/ or -",
                          operand="--output") from None
    fmt.check_output(dest, inputs=inputs, force=force, names=names)
    return fmt.name


def save_outputs(arrays, dest, *, attrs=None, stdout=None, compression=None):
    """Write ``arrays`` (name -> array) to ``dest`` in its format (:func:`qgcli.storage.formats.for_output`):
    .h5 and .npz keep the exact names, ``DIR/`` gets one .npy per name (:mod:`qgcli.storage.directory`),
    ``-`` an npz on stdout.

    Call :func:`check_output` first; this function assumes the target is allowed.
    """
    formats.for_output(dest).write(dest, arrays, attrs=attrs or {}, compression=compression, stdout=stdout)
