"""The safetensors format (.safetensors): tensors read lazily through the ``safetensors`` package (an
optional dependency); written with the op's string attributes in its metadata.  There is no magic number:
a file starts with its header's length (8 bytes, little-endian), then JSON."""
import contextlib

import numpy as np

from qgcli.errors import FileFormatError
from qgcli.storage import atomic, targets
from qgcli.storage.checks import CORRUPT_FILE_ERRORS, reason
from qgcli.storage.sinks import FlatSink


def _package():
    try:
        import safetensors.numpy
    except ImportError:
        raise FileFormatError(".safetensors files need the safetensors package: pip install safetensors") from None
    return safetensors.numpy


def write(path, arrays, attrs=None):
    """``arrays`` as one .safetensors file; string attributes (the op's) go to its metadata."""
    st = _package()
    tensors = {name: np.ascontiguousarray(np.asarray(a)) for name, a in arrays.items()}
    metadata = {str(k): str(v) for k, v in (attrs or {}).items() if v is not None}
    st.save_file(tensors, path, metadata=metadata or None)


class SafetensorsFormat:
    name, title, suffixes, magic = "safetensors", "safetensors", (".safetensors",), None
    holds_many, hierarchical = True, False

    def head_fits(self, head):
        """Whether a file's first 8 bytes can start a safetensors file (checked further when opened)."""
        return len(head) == 8

    def open(self, source):
        """A safetensors file's tensors as NumPy arrays, read lazily (``keys()``, ``get_tensor(key)``)."""
        _package()
        from safetensors import safe_open

        if not isinstance(source, str):
            raise FileFormatError("a .safetensors stream on stdin is not supported; give the file")
        try:
            return safe_open(source, framework="np")
        except Exception as exc:  # noqa: BLE001 - SafetensorError (a Rust error type) and OSError: damaged bytes
            raise FileFormatError(f"{source}: cannot open as safetensors: {exc}") from None

    def names(self, handle, label):
        return list(handle.keys())

    def read(self, handle, key, label):
        if key not in handle.keys():
            raise FileFormatError(f"{label}: has no key {key!r} (keys: {', '.join(list(handle.keys())[:8]) or 'none'})")
        try:
            return handle.get_tensor(key)
        except CORRUPT_FILE_ERRORS as exc:
            raise FileFormatError(f"{label}: cannot read {key!r}: {reason(exc)}") from None

    def attributes(self, handle, label):
        """The header's ``__metadata__`` (string to string): where qgcli writes the op's attributes."""
        try:
            return dict(sorted((handle.metadata() or {}).items()))  # the header keeps no order
        except Exception:  # noqa: BLE001 - a damaged header was refused when opened; nothing more to say
            return {}

    def has(self, handle, key, label):
        return key in handle.keys()

    def header(self, handle, key):
        """``(shape, dtype as safetensors names it: F32, BF16 ...)`` from the header alone; (None, None) if
        unknown."""
        try:
            view = handle.get_slice(key)
            return tuple(view.get_shape()), view.get_dtype()
        except Exception:  # noqa: BLE001 - only a size estimate or a better error message is at stake
            return None, None

    def check_output(self, dest, *, inputs=(), force=False, names=()):
        targets.check_file(dest, inputs=inputs, force=force)

    def write(self, dest, arrays, *, attrs, compression=None, stdout=None):
        atomic.atomic_write(dest, lambda p: write(p, arrays, attrs))

    @contextlib.contextmanager
    def group_sink(self, dest, *, compression=None):
        """One flat file, keys ``group/name`` as in .npz; written at the end (the package writes a whole dict)."""
        arrays = {}
        yield FlatSink(arrays.__setitem__)
        atomic.atomic_write(dest, lambda tmp: write(tmp, arrays))

    def flat(self, source, key, label):
        """Tensor ``key`` as plain bytes at its header's offsets (:mod:`qgcli.storage.flat`), unread."""
        from qgcli.storage import flat

        return flat.safetensors_tensor(source, key, label)


FORMAT = SafetensorsFormat()
