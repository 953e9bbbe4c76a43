"""Tensors stored as plain bytes at a known offset of a file, handed out unread as block sources.

An .npy file, a stored (uncompressed) .npz member and a .safetensors tensor are their values in C order at
one offset of one file: the block executor (:mod:`qgcli.execution.blocks`) reads row blocks of them with
``os.preadv`` (:func:`qgcli.storage.hdf5.contiguous.read_bytes`) without reading the whole tensor, as it
reads a contiguous HDF5 dataset.  A :class:`FlatTensor` has what the block executor asks of an unread
dataset (``shape``, ``ndim``, ``size``, ``dtype``, ``attrs``, ``name``) and :meth:`FlatTensor.extent`.

What is not plain bytes is not handed out (None): a compressed .npz member (its bytes must be inflated in
order), a Fortran-ordered array, a byte order other than this machine's, a dtype the kernels do not take
(object, structured, or a safetensors type NumPy has no type for), stdin.  Those are read whole.
"""
import json
import os
import struct
import warnings

import numpy as np

from qgcli.errors import FileFormatError

#: safetensors dtypes that are NumPy types, stored little-endian.  BF16 is bfloat16 kept as its uint16 codes,
#: tagged as qgcli tags an HDF5 dataset (``attrs["dtype"] = "bfloat16"``: :func:`qgcli.storage.h5.tagged_bfloat16`).
SAFETENSORS_DTYPES = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "BF16": "<u2", "I8": "i1", "I16": "<i2",
                      "I32": "<i4", "I64": "<i8", "U8": "u1", "U16": "<u2", "U32": "<u4", "U64": "<u8"}
#: The largest safetensors header the package itself accepts.
_MAX_HEADER = 100_000_000


class FlatTensor:
    """``shape``/``dtype`` values at byte ``offset`` of the file ``path``, opened for reading until :meth:`close`."""

    compression = None

    def __init__(self, path, offset, shape, dtype, name, *, attrs=None):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.name = name
        self.attrs = dict(attrs or {})
        self.offset = int(offset)
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        end = self.offset + self.size * self.dtype.itemsize
        have = os.fstat(self._fd).st_size
        if end > have:
            self.close()
            raise FileFormatError(f"{name}: truncated: its data end at byte {end}, the file holds {have}")

    def extent(self):
        """``(fd, offset)``: what :func:`qgcli.storage.hdf5.contiguous.read_bytes` reads blocks from."""
        return self._fd, self.offset

    def __getitem__(self, key):
        """The whole tensor (``t[()]``): for a 0-d tensor, which no block cuts."""
        if key != ():
            raise TypeError("a FlatTensor is read whole with [()] or in blocks through extent()")
        from qgcli.storage.hdf5.contiguous import read_bytes

        array = np.empty(self.shape, self.dtype)
        read_bytes(self.extent(), 0, memoryview(array.reshape(-1).view(np.uint8)), self.name)
        return array

    def close(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _streamable(dtype):
    return dtype.kind in "fiu" and dtype.isnative and dtype.fields is None and not dtype.hasobject


def npy_header(fh):
    """``(shape, fortran_order, dtype)`` of the .npy stream ``fh`` from its header (never unpickling anything),
    ``fh`` left at the first data byte."""
    fmt = np.lib.format
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        version = fmt.read_magic(fh)
        return (fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0)(fh)


def npy_at(fh, path, name):
    """The FlatTensor of the .npy that ``fh`` (a file object of ``path``) is at the first byte of."""
    try:
        shape, fortran, dtype = npy_header(fh)
    except Exception:  # noqa: BLE001 - not a readable header: the whole read says what is wrong
        return None
    if not _streamable(dtype) or (fortran and len(shape) > 1):
        return None
    return FlatTensor(path, fh.tell(), shape, dtype, name)


def npy(path, label):
    """The tensor of the .npy file ``path``, or None where it is not plain bytes."""
    with open(path, "rb") as fh:
        return npy_at(fh, path, label)


def safetensors_header(path):
    """``(header length, header as a dict)`` of the .safetensors file ``path``; None when it cannot be read
    (more than the package accepts, or not JSON)."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else _MAX_HEADER + 1
        if length > _MAX_HEADER:
            return None
        try:
            header = json.loads(fh.read(length))
        except ValueError:
            return None
    return (length, header) if isinstance(header, dict) else None


def safetensors_tensor(path, key, label):
    """Tensor ``key`` of the .safetensors file ``path`` (from the header's ``data_offsets``), or None where its
    dtype is not one of :data:`SAFETENSORS_DTYPES`."""
    found = safetensors_header(path)
    if found is None:
        return None  # the package refused it when the file was opened
    length, header = found
    entry = header.get(key)
    if not isinstance(entry, dict) or entry.get("dtype") not in SAFETENSORS_DTYPES:
        return None
    dtype = np.dtype(SAFETENSORS_DTYPES[entry["dtype"]])
    shape = tuple(int(d) for d in entry["shape"])
    begin, end = (int(v) for v in entry["data_offsets"])
    needed = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if end - begin != needed:
        raise FileFormatError(f"{label}: {key!r} holds {end - begin} bytes, not the {needed} its shape "
                              f"{list(shape)} needs")
    if not dtype.isnative:
        return None
    attrs = {"dtype": "bfloat16"} if entry["dtype"] == "BF16" else None
    return FlatTensor(path, 8 + length + begin, shape, dtype, f"{label}:{key}", attrs=attrs)
