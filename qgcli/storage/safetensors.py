"""The safetensors format (.safetensors): tensors read lazily through the ``safetensors`` package (an
optional dependency); written with the op's string attributes in its metadata.  There is no magic number:
a file starts with its header's length (8 bytes, little-endian), then JSON."""
import contextlib
import os
import re

import numpy as np

from qgcli.errors import FileFormatError
from qgcli.storage import atomic, flat, targets
from qgcli.storage.checks import CORRUPT_FILE_ERRORS, check_memory, reason
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
    from safetensors import SafetensorError

    try:
        st.save_file(tensors, path, metadata=metadata or None)
    except SafetensorError as exc:  # the package's Rust I/O errors end in "(os error N)": a full disk is an OSError
        match = re.search(r"os error (\d+)|code: (\d+)", str(exc))  # newer releases / 0.4's Debug form
        if match is None:
            raise
        number = int(match.group(1) or match.group(2))
        raise OSError(number, os.strerror(number), path) from None


#: safetensors dtypes NumPy has no type for, read as ml_dtypes' (which qgcli depends on anyway); the package's
#: NumPy reader fails on the float8 ones (``numpy.float8_e4m3fn``), and on BF16 in older releases.
ML_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
             "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz"}
#: Sub-byte dtypes: several values per byte, and the format names only their width, not their order.
_PACKED = {"F4": "4-bit", "F6_E2M3": "6-bit", "F6_E3M2": "6-bit"}


def _dtypes_newer_than_the_package(path):
    """The dtypes of a header the package refused that older safetensors releases do not know (the small floats
    and packed types); empty when the header cannot be read either (then it is damaged)."""
    found = flat.safetensors_header(path)
    if found is None:
        return []  # a damaged header: the package's own message says so
    dtypes = {entry.get("dtype") for key, entry in found[1].items() if key != "__metadata__" and isinstance(entry, dict)}
    return sorted(d for d in dtypes if d in ML_DTYPES or d in _PACKED)


class _Handle:
    """The package's ``safe_open`` handle, and the file's path (for the dtypes read here)."""

    def __init__(self, path, handle):
        self.path, self._handle = path, handle

    def __getattr__(self, name):
        return getattr(self._handle, name)


def read_raw(path, key, type_name, label):
    """Tensor ``key`` of the safetensors file ``path`` as the ml_dtypes type ``type_name``, read from the
    header's offsets (the package checked the header, the offsets and the sizes when it opened the file)."""
    import ml_dtypes

    if not hasattr(ml_dtypes, type_name):  # an older ml_dtypes than the type
        raise FileFormatError(f"{label}: {key!r} is {type_name}, which this ml_dtypes ({ml_dtypes.__version__}) "
                              "has no type for; pip install -U ml_dtypes")
    dtype = np.dtype(getattr(ml_dtypes, type_name))
    length, header = flat.safetensors_header(path)  # the package read the same header when it opened the file
    entry = header[key]
    with open(path, "rb") as fh:
        begin, end = (int(v) for v in entry["data_offsets"])
        shape = tuple(int(v) for v in entry["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dtype.itemsize:
            raise FileFormatError(f"{label}: {key!r} holds {end - begin} bytes, not the {count * dtype.itemsize} "
                                  f"its shape {list(shape)} needs")
        check_memory(end - begin, f"{label}: {key!r}")
        fh.seek(8 + length + begin)
        data = bytearray(end - begin)
        if fh.readinto(data) != len(data):
            raise FileFormatError(f"{label}: {key!r} is truncated")
    codes = np.frombuffer(data, dtype=f"<u{dtype.itemsize}").astype(f"=u{dtype.itemsize}", copy=False)
    return codes.view(dtype).reshape(shape)  # the file is little-endian; the codes in this machine's order


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
            return _Handle(source, safe_open(source, framework="np"))
        except Exception as exc:  # noqa: BLE001 - SafetensorError (a Rust error type) and OSError: damaged bytes
            newer = _dtypes_newer_than_the_package(source)
            if newer:
                import safetensors

                raise FileFormatError(f"{source}: holds {', '.join(newer)} tensors, which this safetensors package "
                                      f"({safetensors.__version__}) cannot open; pip install -U safetensors") from None
            raise FileFormatError(f"{source}: cannot open as safetensors: {exc}") from None

    def names(self, handle, label):
        return list(handle.keys())

    def read(self, handle, key, label):
        if key not in handle.keys():
            raise FileFormatError(f"{label}: has no key {key!r} (keys: {', '.join(list(handle.keys())[:8]) or 'none'})")
        try:
            dtype = handle.get_slice(key).get_dtype()
        except Exception:  # noqa: BLE001 - an old package without get_dtype: its own reader says what fails
            dtype = None
        if dtype in _PACKED:
            raise FileFormatError(f"{label}: {key!r} is {dtype}, {_PACKED[dtype]} values packed in an element order "
                                  "the safetensors format does not fix; qgcli does not guess it")
        try:
            if dtype in ML_DTYPES:
                return read_raw(handle.path, key, ML_DTYPES[dtype], label)
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
        return flat.safetensors_tensor(source, key, label)


FORMAT = SafetensorsFormat()
