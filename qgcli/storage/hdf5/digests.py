"""A run file's digests: results kept as the SHA-256 of their C-order bytes (what ``qgcli.capture`` does for the
framework's bit-for-bit results, so that each tensor is stored once), which ``qgcli verify`` compares with its
own result: equal or not.

Two layouts, both read:

* one table per step, :data:`DIGESTS` at the step's root (a stepless file: at the file's root): a compound
  dataset with a row per result, ``group`` (the layer's path below the table's group), ``name`` (the result:
  ``outputs``, ``backprops_wrt_input``), ``sha256`` (32 ``uint8``), ``dtype`` (NumPy's ``str``: ``<f4``) and
  ``shape`` (variable-length int64), and the attribute ``digest = "sha256"``; written by capture since the
  table replaced the per-result datasets (one HDF5 object per step instead of a dataset and three attributes
  per result);
* files written before: a 32-byte ``uint8`` dataset under the result's name in the layer's ``reference/``,
  with attributes ``digest = "sha256"``, ``shape`` and ``dtype``.
"""
import weakref

import numpy as np

#: The digest table of a step (at the step's root).
DIGESTS = "qgcli_digests"
SHA256 = "sha256"


class Digest:
    """A result kept as the SHA-256 of its C-order bytes: ``sha256`` (32 bytes), ``shape``, ``dtype``."""

    def __init__(self, sha256, shape, dtype):
        self.sha256 = bytes(np.asarray(sha256, dtype=np.uint8))
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(_text(dtype))

    @classmethod
    def of_dataset(cls, dataset):
        """The digest an h5py Dataset of the earlier layout holds, or None when it holds none."""
        if _text(dataset.attrs.get("digest", "")) != SHA256:
            return None
        return cls(dataset[()], dataset.attrs["shape"], dataset.attrs["dtype"])


def _text(value):
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def table_dtype():
    """The row of a digest table."""
    import h5py

    text = h5py.string_dtype()
    return np.dtype([("group", text), ("name", text), ("sha256", np.uint8, (32,)), ("dtype", text),
                     ("shape", h5py.vlen_dtype(np.int64))])


def write_table(parent, rows):
    """The table :data:`DIGESTS` in the h5py Group ``parent``, from ``(group, name, shape, dtype, sha256)``
    rows (``group``: the layer's path below ``parent``)."""
    table = np.empty(len(rows), dtype=table_dtype())
    for i, (group, name, shape, dtype, sha256) in enumerate(rows):
        table[i] = (group, name, sha256, dtype, np.asarray(shape, dtype=np.int64))
    parent.create_dataset(DIGESTS, data=table).attrs["digest"] = SHA256


# The table read last: (the handle, as a weak reference; the table's path; {group: {name: Digest}}).  verify goes
# through a file layer by layer, step by step: each step's table is read once.
_LAST = [None, None, None]


def digests_of(handle, path):
    """``{name: Digest}`` of the layer at ``path`` (below the open h5py File ``handle``) in the nearest digest
    table above it (empty where there is none)."""
    parts = path.strip("/").split("/")
    for n in range(len(parts) - 1, -1, -1):
        where = "/".join(parts[:n])
        table = f"{where}/{DIGESTS}" if where else DIGESTS
        if table in handle:
            return _table(handle, table).get("/".join(parts[n:]), {})
    return {}


def _table(handle, table):
    ref, name, rows = _LAST
    if ref is not None and ref() is handle and name == table:
        return rows
    rows = {}
    for group, name, sha256, dtype, shape in handle[table][()]:
        rows.setdefault(_text(group), {})[_text(name)] = Digest(sha256, shape, dtype)
    _LAST[:] = [weakref.ref(handle), table, rows]
    return rows
