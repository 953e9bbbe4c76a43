"""The .npz format: a zip of .npy members, read with zipfile itself (each member then by the checked .npy
reader, never by ``np.load``) and written in ``np.savez``'s layout."""
import contextlib
import io as _io
import struct
import zipfile

import numpy as np

from qgcli.errors import FileFormatError, QgcliError
from qgcli.storage import atomic, flat, npy, targets
from qgcli.storage.checks import CORRUPT_FILE_ERRORS, reason
from qgcli.storage.sinks import FlatSink

MAGIC = b"PK"


def members(zf):
    """key -> member name, as np.load names them (``x.npy`` is key ``x``)."""
    try:
        names = zf.namelist()
    except CORRUPT_FILE_ERRORS:
        return {}
    return {(n[:-4] if n.endswith(".npy") else n): n for n in names}


#: Deflate expands at most 1032 times (RFC 1951: a 258-byte match costs at least 2 bits).
DEFLATE_RATIO = 1032


def check_member(zf, info, what):
    """A member's sizes checked against its archive before anything is allocated: its compressed bytes lie
    inside the archive, and they can expand to what its header promises (stored: as many bytes; deflate: at
    most :data:`DEFLATE_RATIO` times; another method: counted by decompressing it once, in small pieces).
    A 300-byte .npz whose header promises 4 GB is then "corrupt or truncated", not an out-of-memory."""
    fp = zf.fp
    here = fp.tell()
    try:
        archive = fp.seek(0, 2)
    finally:
        fp.seek(here)
    promised, packed = info.file_size, info.compress_size
    if info.header_offset + packed > archive:
        raise FileFormatError(f"{what}: truncated: its zip entry holds {packed} compressed bytes at offset "
                              f"{info.header_offset}, the archive ends at {archive}")
    if info.compress_type == zipfile.ZIP_STORED:
        possible = packed
    elif info.compress_type == zipfile.ZIP_DEFLATED:
        possible = packed * DEFLATE_RATIO + 1024
    else:
        possible = 0
        with zf.open(info) as fh:
            while possible <= promised:
                piece = fh.read(1 << 20)
                if not piece:
                    break
                possible += len(piece)
    if promised > possible:
        raise FileFormatError(f"{what}: corrupt or truncated: its zip entry promises {promised} bytes from "
                              f"{packed} compressed bytes, which cannot hold them")


def read_member(zf, member, key, label):
    what = f"{label}: key {key!r}"
    try:
        info = zf.getinfo(member)
        check_member(zf, info, what)
        with zf.open(info) as fh:
            if fh.read(6) != npy.MAGIC:
                raise FileFormatError(f"{what} is not an .npy array")
            fh.seek(0)
            return npy.read_stream(fh, info.file_size, what)
    except QgcliError:
        raise
    except CORRUPT_FILE_ERRORS as exc:
        raise FileFormatError(f"{what} cannot be read: {reason(exc)}") from None


#: Bytes of a zip entry's local header before its file name (APPNOTE 4.3.7).
_LOCAL_HEADER = 30


def stored_member(path, key, label):
    """Member ``key`` of the .npz file ``path`` as a :class:`qgcli.storage.flat.FlatTensor` where it is stored
    (not compressed, not encrypted) and its .npy is plain bytes; else None."""
    with open(path, "rb") as raw, zipfile.ZipFile(raw) as zf:
        member = members(zf).get(key)
        if member is None:
            return None
        info = zf.getinfo(member)
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
            return None
        what = f"{label}: key {key!r}"
        check_member(zf, info, what)
        raw.seek(info.header_offset)
        local = raw.read(_LOCAL_HEADER)  # ends with the lengths of the name and extra field the data follow
        if len(local) != _LOCAL_HEADER or local[:4] != b"PK\x03\x04":
            raise FileFormatError(f"{what}: corrupt: no zip entry at offset {info.header_offset}")
        start = info.header_offset + _LOCAL_HEADER + sum(struct.unpack_from("<HH", local, 26))
        raw.seek(start)
        tensor = flat.npy_at(raw, path, f"{label}:{key}")
        if tensor is not None and tensor.offset + tensor.size * tensor.dtype.itemsize > start + info.file_size:
            tensor.close()
            raise FileFormatError(f"{what}: truncated: its .npy header promises more data than its zip entry holds")
        return tensor


@contextlib.contextmanager
def writing(fh):
    """``with writing(fh) as put``: ``put(key, array)`` adds ``key.npy``.  np.savez's layout, with the zip file
    closed on every failure (NumPy 1.x's savez leaves it open when a write fails, and its __del__ then reports
    an error on stderr)."""
    with zipfile.ZipFile(fh, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        def put(key, array):
            with zf.open(key + ".npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asarray(array), allow_pickle=False)
        yield put


def write_zip(fh, arrays):
    with writing(fh) as put:
        for key, array in arrays.items():
            put(key, array)


class NpzFormat:
    name, title, suffixes, magic = "npz", "npz", (".npz",), MAGIC
    holds_many, hierarchical = True, False

    def open(self, source):
        return zipfile.ZipFile(_io.BytesIO(source) if isinstance(source, bytes) else source)

    def names(self, handle, label):
        return list(members(handle))

    def read(self, handle, key, label):
        found = members(handle)
        if key not in found:
            raise FileFormatError(f"{label}: has no key {key!r} (keys: {', '.join(found) or 'none'})")
        return read_member(handle, found[key], key, label)

    def has(self, handle, key, label):
        return key in members(handle)

    def flat(self, source, key, label):
        """Member ``key`` as plain bytes at an offset of the file (:class:`qgcli.storage.flat.FlatTensor`,
        unread) where it is stored; None for a stream or a compressed member (inflated only in order)."""
        return None if isinstance(source, bytes) else stored_member(source, key, label)

    def header(self, handle, key):
        """Shape and dtype from the member's .npy header (never unpickling anything); (None, None) if
        unreadable: what ``inspect`` shows of a member it cannot read."""
        try:
            with handle.open(members(handle).get(key, f"{key}.npy")) as fh:
                return npy.header_of(fh)
        except Exception:  # noqa: BLE001 - only a better error message is at stake
            return None, None

    def check_output(self, dest, *, inputs=(), force=False, names=()):
        targets.check_file(dest, inputs=inputs, force=force)

    def write(self, dest, arrays, *, attrs, compression=None, stdout=None):
        with self.group_sink(dest) as sink:
            for key, array in arrays.items():
                sink.put(key, array)

    @contextlib.contextmanager
    def group_sink(self, dest, *, compression=None):
        """A run file's outputs as keys ``group/name`` of one .npz, written as the groups are computed."""
        with atomic.staging(dest) as tmp, open(tmp, "wb") as fh, writing(fh) as put:
            yield FlatSink(put)


FORMAT = NpzFormat()
