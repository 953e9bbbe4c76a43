"""The storage registry: every format qgcli reads or writes, and the one place a format is chosen, by a
path's suffix (:func:`for_input`, :func:`for_output`) or a stream's magic bytes (:func:`sniff`).

A format is one module with a ``FORMAT`` object; adding one is that module plus a line in :data:`FILES`
(or :data:`STORES`).  What a format object has (each only where it applies):

``name``, ``title``
    The short name (``--json``'s ``format``, messages) and how ``inspect`` titles it.
``suffixes``, ``magic``
    The file-name endings that choose it, and the bytes its files start with (None: no magic number;
    ``head_fits(head)`` then says whether the first 8 bytes can start one).
``holds_many``, ``hierarchical``
    Whether a SPEC may name one of its tensors with ``:KEY``; whether it has groups, links and run-file
    layers (``inspect`` walks those).
``open(source)`` -> handle; ``names(handle, label)``, ``read(handle, key, label)``, ``has(handle, key, label)``;
``dataset(handle, key, label)``, ``flat(source, key, label)``
    Reading, for :class:`qgcli.storage.io.Container` (``source``: a path, or the bytes of a stdin stream;
    ``dataset`` an unread HDF5 dataset for streaming, ``flat`` a tensor that is plain bytes at an offset of
    its file, also for streaming: :mod:`qgcli.storage.flat`).  A store opens its own container:
    ``open_container(path)``.
``attributes(handle, label)``, ``header(handle, key)``, ``size(path)`` (optional)
    What ``inspect`` shows besides the tensors: the file's own attributes, a tensor's shape and dtype from
    its header when its data cannot be read, the bytes of a store.
``check_output(dest, inputs=, force=, names=)``, ``write(dest, arrays, attrs=, compression=, stdout=)``
    A single command's outputs: checked before anything is computed, then written atomically
    (:mod:`qgcli.storage.atomic`) with the provenance attributes the caller built (:mod:`qgcli.storage.provenance`).
``group_sink(dest, compression=)``
    A run file's outputs: a context manager giving a sink (``begin(path)``, ``add(path, arrays, op_attrs)``,
    ``discard(path)``, ``streams``: whether a group can be computed into the file); committed when the
    block ends without an error.
"""
import os

from qgcli.errors import FileFormatError
from qgcli.storage import directory, h5, npy, npz, pt, safetensors, stdio, zarr_store

#: Stores claimed by name before any other rule (a Zarr store is a directory, but one output).
STORES = (zarr_store.FORMAT,)
#: One-file formats, by suffix; stdin streams are told apart by their magic bytes, in this order.
FILES = (npy.FORMAT, npz.FORMAT, h5.FORMAT, safetensors.FORMAT, pt.FORMAT)
DIRECTORY = directory.FORMAT
STDOUT = stdio.FORMAT
_BY_NAME = {f.name: f for f in STORES + FILES + (DIRECTORY, STDOUT)}

KNOWN_SUFFIXES = tuple(s for f in FILES + STORES for s in f.suffixes)
_FILE_SUFFIXES = [s for f in FILES for s in f.suffixes]
_EXPECTED = ", ".join(_FILE_SUFFIXES[:-1]) + " or " + _FILE_SUFFIXES[-1]  # ".npy, .npz, .h5, .hdf5, ... or .pth"
#: Suffixes after which a SPEC may go on with ``:KEY``.
CONTAINER_SUFFIXES = tuple(s for f in FILES + STORES if f.holds_many for s in f.suffixes)


def get(name):
    """The format called ``name`` (a ``Container``'s ``kind``, ``--json``'s ``format``)."""
    return _BY_NAME[name]


def for_input(path):
    """The format of a file or store to read, from its name; a clear error for anything else."""
    for fmt in STORES:
        if fmt.claims(path):
            return fmt
    lower = path.lower()
    for fmt in FILES:
        if lower.endswith(fmt.suffixes):
            return fmt
    raise FileFormatError(f"unknown file type (expected {_EXPECTED}): {path}")


def for_output(dest):
    """The format of an ``-o`` target: ``-`` stdout, a store, ``DIR/``, a file by its suffix (``-o x.h5``
    where ``x.h5`` is a directory is refused by the file's checks), or an existing directory."""
    if dest == "-":
        return STDOUT
    for fmt in STORES:
        if fmt.claims(dest):  # a directory, but one store, written as a whole
            return fmt
    if dest.endswith(("/", os.sep)):
        return DIRECTORY
    lower = dest.lower()
    for fmt in FILES:  # a file's name: an existing directory of that name is refused, never written into
        if lower.endswith(fmt.suffixes):
            return fmt
    if directory.is_directory(dest):
        return DIRECTORY
    return for_input(dest)


def sniff(head):
    """The one-file format whose magic bytes ``head`` starts with; None when none matches."""
    for fmt in FILES:
        if fmt.magic is not None and head.startswith(fmt.magic):
            return fmt
    return None


def head_fits(fmt, head):
    """Whether ``head`` (a file's first 8 bytes) can start a file of ``fmt``: its magic, or for a format
    without one, its own test and none of the others' magic but those it shares (a .pt is a zip, as .npz)."""
    found = sniff(head)
    if fmt.magic is None and fmt.head_fits(head) and (found is None or found.magic in getattr(fmt, "shared_magic", ())):
        return True
    return found is fmt


def size(fmt, path):
    """Bytes of a file (or of a store's files)."""
    return fmt.size(path) if hasattr(fmt, "size") else os.path.getsize(path)
