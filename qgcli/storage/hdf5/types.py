"""HDF5 types to NumPy dtypes, converted once per distinct type: h5py's conversion is most of what ``.dtype``
costs on an object just opened, and a run file's thousands of datasets and attributes hold a handful of types.

Low level (h5py only): :mod:`qgcli.storage.h5` and :mod:`qgcli.storage.hdf5.guard` both use it.
"""
import functools


def memory_type(dtype):
    """The HDF5 memory type h5py's read derives from the array's dtype (``h5t.py_create``) on every call (half
    of an 8-byte read's cost), made once per dtype (for datasets' and attributes' reads).  A dtype carrying
    h5py's metadata (an HDF5 enum's integers) is made each time: NumPy compares it equal to its plain one."""
    if dtype.metadata:
        from h5py import h5t

        return h5t.py_create(dtype)
    return _plain_memory_type(dtype)


@functools.lru_cache(maxsize=64)
def _plain_memory_type(dtype):
    from h5py import h5t

    return h5t.py_create(dtype)


def dtype_of(oid):
    """``oid.dtype`` of a low-level DatasetID or AttrID, h5py's conversion of its HDF5 type made once per
    distinct type (:func:`stored_as`)."""
    return stored_as(oid)[0]


def stored_as(oid):
    """``(dtype, as_is)`` of a low-level DatasetID or AttrID: ``oid.dtype``, and whether its HDF5 type is the
    memory type h5py reads that dtype with (the stored bytes are the array's: :func:`read_plain_dataset` may
    read them at their offset).  Worked out once per distinct type: a number, enum or string type equal to one
    met before (``H5Tequal``: size, byte order, precision, an enum's members, a fixed string's length; and
    the character set, which HDF5 leaves out of a variable-length string's comparison) gives that one's; other
    classes are converted each time.  The conversion is most of what ``.dtype`` costs on an object just opened
    (9 of 13 us), and a run file's thousands of datasets and attributes hold a handful of types."""
    from h5py import h5t

    ftype = oid.get_type()
    kind = ftype.get_class()
    if kind not in (h5t.INTEGER, h5t.FLOAT, h5t.ENUM, h5t.STRING):
        return ftype.dtype, False
    cset = ftype.get_cset() if kind == h5t.STRING else None
    for known, known_cset, dtype, as_is in _TYPES_MET:
        if known_cset == cset and ftype.equal(known):
            return dtype, as_is
    dtype = ftype.dtype
    as_is = dtype.kind in "iuf" and not dtype.metadata and ftype.equal(memory_type(dtype))
    if len(_TYPES_MET) < MAX_TYPES_MET:
        _TYPES_MET.append((ftype.copy(), cset, dtype, as_is))  # a copy: a committed type would keep its file open
    return dtype, as_is


#: Distinct HDF5 types whose dtype :func:`dtype_of` keeps (each lookup compares a type with each of them).
MAX_TYPES_MET = 16
_TYPES_MET = []  # (a copy of the type, its character set or None, its dtype, whether stored as is)
