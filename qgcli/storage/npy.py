"""The .npy format: one array per file (or stdin stream), its header checked before any data is allocated."""
import io as _io
import os
import warnings

import numpy as np

from qgcli.errors import FileFormatError, OutputError, QgcliError
from qgcli.storage import atomic, flat, targets
from qgcli.storage.checks import CORRUPT_FILE_ERRORS, check_memory, reason

MAGIC = b"\x93NUMPY"


def read_stream(fh, available, what):
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
            check_memory(nbytes, what)
            fh.seek(0)
            return fmt.read_array(fh, allow_pickle=False)
    except QgcliError:
        raise
    except CORRUPT_FILE_ERRORS as exc:
        raise FileFormatError(f"{what}: cannot read .npy: {reason(exc)}") from None


def header_of(fh):
    """``(shape, dtype as text)`` of the .npy stream ``fh`` from its header (never unpickling anything)."""
    shape, _, dtype = flat.npy_header(fh)
    return shape, str(dtype)


def load(source, label):
    """The array of an .npy file (a path) or stream (bytes)."""
    if isinstance(source, bytes):
        return read_stream(_io.BytesIO(source), len(source), label)
    try:
        with open(source, "rb") as fh:
            return read_stream(fh, os.fstat(fh.fileno()).st_size, label)
    except OSError as exc:
        raise FileFormatError(f"{label}: cannot read .npy: {exc.strerror or exc}") from None


def write(path, array):
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


class NpyFormat:
    """One array: no keys, no attributes."""

    name, title, suffixes, magic = "npy", "npy", (".npy",), MAGIC
    holds_many = hierarchical = False

    def open(self, source):
        return source  # read whole on demand; nothing to hold open

    def names(self, handle, label):
        return []

    def read(self, handle, key, label):
        if key is not None:
            raise FileFormatError(f"{label}: an .npy file holds one array; there is no key {key!r}")
        return load(handle, label)

    def has(self, handle, key, label):
        return False

    def flat(self, source, key, label):
        """The array as plain bytes at an offset of its file (:class:`qgcli.storage.flat.FlatTensor`, unread);
        None for a stream, or where it is not plain bytes."""
        return None if isinstance(source, bytes) else flat.npy(source, label)

    def header(self, handle, key):
        """``(shape, dtype)`` from the .npy header alone (nothing unpickled, no data read); (None, None) if
        unreadable."""
        try:
            with (_io.BytesIO(handle) if isinstance(handle, bytes) else open(handle, "rb")) as fh:
                return header_of(fh)
        except Exception:  # noqa: BLE001 - only a size estimate or a better error message is at stake
            return None, None

    def check_output(self, dest, *, inputs=(), force=False, names=()):
        targets.check_file(dest, inputs=inputs, force=force)

    def write(self, dest, arrays, *, attrs, compression=None, stdout=None):
        if len(arrays) != 1:
            raise OutputError(
                f"an .npy file holds one array but there are {len(arrays)} outputs ({', '.join(arrays)}); "
                "use .h5, .npz or a directory/",
                operand="--output",
            )
        (array,) = arrays.values()
        atomic.atomic_write(dest, lambda p: write(p, array))


FORMAT = NpyFormat()
