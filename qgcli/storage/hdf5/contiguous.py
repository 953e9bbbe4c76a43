"""Reading contiguous HDF5 datasets as bytes at an offset, without HDF5.

h5py copies a dataset out of the page cache on one thread while it holds its lock (29-35 ms for 103 MB
here).  A plain dataset stored contiguously in its own file is only bytes at one offset (:func:`extent`),
so the pool's threads read a large one with ``os.preadv`` straight into the array, through HDF5's own file
descriptor (20 ms on two cores), and streaming reads its next block on a thread of its own while HDF5
serves the main thread.  Anything else (chunked, filtered, external, virtual, unallocated, a byte order
other than this machine's, a file driver other than the POSIX one, a small dataset) is left to h5py.
"""
import os

import numpy as np

from qgcli.errors import FileFormatError
from qgcli.ops.blocked import _map

#: Below this many bytes h5py's single call costs less than handing pieces to the pool.
MIN_BYTES = 16 << 20
_PIECE_BYTES = 8 << 20


def extent(node):
    """``(fd, offset)`` of an h5py Dataset whose data are its bytes in C order at one offset of a POSIX
    file (HDF5's own descriptor), or None where h5py must read it."""
    from h5py import h5d

    dtype = node.dtype
    if dtype.kind not in "fiu" or not dtype.isnative or dtype.fields is not None or node.file.driver != "sec2":
        return None
    dsid = node.id
    dcpl = dsid.get_create_plist()
    if dcpl.get_layout() != h5d.CONTIGUOUS or dcpl.get_external_count() or dcpl.get_nfilters():
        return None
    offset = dsid.get_offset()  # from the start of the file, user block included
    if offset is None or dsid.get_storage_size() != int(node.size or 0) * dtype.itemsize:
        return None
    return node.file.id.get_vfd_handle(), offset


def read_bytes(where, start, data, what):
    """Bytes ``[start, start + len(data))`` of the dataset at ``where`` (:func:`extent`) into ``data``, a
    writable byte memoryview; ``what`` names the dataset in the error for a file that ends inside them."""
    fd, offset = where
    done = 0
    while done < len(data):
        got = os.preadv(fd, [data[done:]], offset + start + done)
        if got == 0:  # HDF5 itself would have read zeros past the end of the file
            raise FileFormatError(f"{what} cannot be read: the file ends inside its data")
        done += got


def read(node, what):
    """What ``node[()]`` gives for an h5py Dataset, read on the pool; None where h5py must read it.
    ``what`` names the dataset in the error for a file that ends inside the data."""
    nbytes = int(node.size or 0) * node.dtype.itemsize
    where = extent(node) if nbytes >= MIN_BYTES else None
    if where is None:
        return None
    array = np.empty(node.shape, node.dtype)
    data = memoryview(array.reshape(-1).view(np.uint8))

    def read_piece(start):
        read_bytes(where, start, data[start:min(start + _PIECE_BYTES, nbytes)], what)

    _map(read_piece, range(0, nbytes, _PIECE_BYTES))
    return array
