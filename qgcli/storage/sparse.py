"""Tensors a file declares but does not hold: HDF5 chunks never written, Zarr chunks absent from their store.

A 4 KB HDF5 file can declare 2 x 512 MiB of chunked data that was never written, and a Zarr store can be
its metadata alone: both libraries read the missing part as the fill value, so reading such a tensor costs
what it declares, in memory and time, for bytes the file never held.  The rule, for every reader (the
compute commands, ``report``, ``plot``, ``inspect``, streaming and blocks alike): the unwritten part of a
tensor counts as what it is, fill values, and is read only up to :data:`UNWRITTEN_BYTES`; above that the
tensor is refused in one line (exit 2) before anything is allocated.  Compressed data that is there is
data: it is read (within ``--memory-limit``).

Imports nothing heavy; asks the libraries only what they know without reading data (HDF5's chunk index,
the Zarr store's listing).
"""
from qgcli.errors import FileFormatError

#: The most never-written data (fill values) qgcli reads of one tensor.
UNWRITTEN_BYTES = 64 << 20


def _mib(n):
    return f"{n / (1 << 20):,.1f} MiB" if n < (1 << 30) else f"{n / (1 << 30):,.1f} GiB"


def _refuse(label, key, declared, unwritten, held):
    raise FileFormatError(f"{label}: {key!r} declares {_mib(declared)} but {held}: {_mib(unwritten)} were never "
                          f"written (they would read as the fill value); qgcli reads at most "
                          f"{_mib(UNWRITTEN_BYTES)} of unwritten data")


def check_hdf5(node, key, label):
    """Refuse the h5py Dataset ``node`` when more than :data:`UNWRITTEN_BYTES` of it was never written:
    chunks HDF5 never allocated, or a contiguous dataset without storage.  Cheap: small datasets are not
    looked at, and HDF5 counts allocated chunks from its index, reading no data."""
    from h5py import h5d

    declared = int(node.size or 0) * node.dtype.itemsize
    if declared <= UNWRITTEN_BYTES:
        return
    dsid = node.id
    layout = dsid.get_create_plist().get_layout()
    if layout == h5d.CHUNKED:
        chunks = node.chunks
        total = 1
        for extent, chunk in zip(node.shape, chunks):
            total *= -(-extent // chunk)
        allocated = dsid.get_num_chunks()
        unwritten = declared * (total - allocated) // max(total, 1)
        held = f"HDF5 holds {allocated:,} of its {total:,} chunks"
    elif layout == h5d.CONTIGUOUS:
        if dsid.get_storage_size():
            return
        unwritten, held = declared, "HDF5 holds no storage for it"
    else:  # compact data is in the header; virtual datasets map other datasets (checked where they are read)
        return
    if unwritten > UNWRITTEN_BYTES:
        _refuse(label, key, declared, unwritten, held)


def check_zarr(node, key, label):
    """Refuse the zarr Array ``node`` when more than :data:`UNWRITTEN_BYTES` of it is in chunks its store
    does not hold (counted from the store's listing, reading no chunk)."""
    declared = int(node.size) * node.dtype.itemsize
    if declared <= UNWRITTEN_BYTES:
        return
    try:
        total, stored = int(node.nchunks), int(node.nchunks_initialized)
    except (ArithmeticError, ValueError, OSError):  # a malformed chunk grid: the read says what is wrong
        return
    unwritten = declared * (total - stored) // max(total, 1)
    if unwritten > UNWRITTEN_BYTES:
        _refuse(label, key, declared, unwritten, f"the store holds {stored:,} of its {total:,} chunks")
