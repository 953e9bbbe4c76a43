"""Reading a large contiguous HDF5 dataset on every core.

h5py copies a dataset out of the page cache on one thread while it holds its lock (29-35 ms for 103 MB
here).  A plain dataset stored contiguously in its own file is only bytes at one offset, so the pool's
threads read it with ``os.preadv`` straight into the array, through HDF5's own file descriptor (20 ms on
two cores).  Anything else (chunked, filtered, external, virtual, unallocated, a byte order other than
this machine's, a file driver other than the POSIX one, a small dataset) is left to h5py.
"""
import os

import numpy as np

from qgcli.errors import FileFormatError

#: Below this many bytes h5py's single call costs less than handing pieces to the pool.
MIN_BYTES = 16 << 20
_PIECE_BYTES = 8 << 20


def read(node, what):
    """What ``node[()]`` gives for an h5py Dataset, read on the pool; None where h5py must read it.
    ``what`` names the dataset in the error for a file that ends inside the data."""
    from h5py import h5d

    from qgcli.ops.blocked import _map

    dtype = node.dtype
    nbytes = int(node.size or 0) * dtype.itemsize
    if (nbytes < MIN_BYTES or dtype.kind not in "fiu" or not dtype.isnative or dtype.fields is not None
            or node.file.driver != "sec2"):
        return None
    dsid = node.id
    dcpl = dsid.get_create_plist()
    if dcpl.get_layout() != h5d.CONTIGUOUS or dcpl.get_external_count() or dcpl.get_nfilters():
        return None
    offset = dsid.get_offset()  # from the start of the file, user block included
    if offset is None or dsid.get_storage_size() != nbytes:
        return None
    fd = node.file.id.get_vfd_handle()
    array = np.empty(node.shape, dtype)
    data = memoryview(array.reshape(-1).view(np.uint8))

    def read_piece(start):
        end = min(start + _PIECE_BYTES, nbytes)
        while start < end:
            got = os.preadv(fd, [data[start:end]], offset + start)
            if got == 0:  # HDF5 itself would have read zeros past the end of the file
                raise FileFormatError(f"{what} cannot be read: the file ends inside its data")
            start += got

    _map(read_piece, range(0, nbytes, _PIECE_BYTES))
    return array
