"""Zarr stores (zarr-python 3; Zarr formats 2 and 3) as tensor inputs and outputs.

A store is a ``.zarr`` directory or an fsspec URL ending in ``.zarr`` (``file:///data/a.zarr``,
``s3://bucket/a.zarr`` with s3fs installed, ``gs://`` with gcsfs).  As a SPEC, ``a.zarr:group/array`` names
one array; ``a.zarr`` is a bundle (its arrays by TensorFlow name) or, when the store's root is an array,
that array.  Outputs go to a new store (``-o a.zarr``; Zarr format 3, or 2 under zarr's own setting
``ZARR_DEFAULT_ZARR_FORMAT=2``, for readers on zarr-python 2) built under a hidden temporary name
beside the target and renamed into place, so a failed run leaves no partial store.  Object-store URLs have
no rename: the temporary store is moved there at the end (not atomic; said in docs/scaling-out.md).

Nothing of zarr is imported until a store is opened.
"""
import contextlib
import os
import re
import stat

import numpy as np

from qgcli.errors import FileFormatError, OutputError
from qgcli.signals import raise_pending
from qgcli.storage import atomic, provenance
from qgcli.storage.checks import check_memory
from qgcli.storage.sparse import check_zarr

SUFFIX = ".zarr"
#: The rows of one output chunk (and of one block on a cluster) hold about this much: whole chunks are
#: what workers write without ever sharing one.
CHUNK_BYTES = 16 << 20
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_MARKERS = ("zarr.json", ".zgroup", ".zarray")  # a directory holding one of these is a Zarr store


def is_zarr(path):
    """Whether ``path`` (a path or URL) names a Zarr store, by its name."""
    return isinstance(path, str) and path.lower().rstrip("/").endswith(SUFFIX)


def locations(operands, names):
    """``{name: (store, key)}`` when every one of ``names`` comes from a Zarr store, else None: whether a job
    runs in row blocks over Zarr (:func:`qgcli.execution.zarr_blocks.plan_for`), asked before that module loads."""
    found = {name: operands.location(name) for name in names}
    return found if all(loc is not None and is_zarr(loc[0]) for loc in found.values()) else None


def local_path(path):
    """The file-system path of a local store (a plain path or a ``file://`` URL); None for other URLs."""
    match = _URL.match(path)
    if match is None:
        return path.rstrip("/") or path
    if match.group(1).lower() != "file":
        return None
    rest = path[match.end():]
    if rest.startswith("localhost/"):
        rest = rest[len("localhost"):]
    return rest.rstrip("/") or "/"


def _zarr():
    try:
        import zarr
    except ImportError:
        raise FileFormatError("Zarr stores need zarr-python 3 (Python 3.11 or newer): pip install 'qgcli[dask]'") \
            from None
    return zarr


# What damaged or hostile stores raise from zarr, its codecs and JSON parsing (qgcli.storage.checks has the list
# for the one-file formats, which adds zip, zlib and NumPy-header errors).
_CORRUPT = (OSError, EOFError, ValueError, KeyError, IndexError, TypeError, RuntimeError, NotImplementedError,
            ArithmeticError, SystemError)


def _errors():
    return _CORRUPT + (_zarr().errors.BaseZarrError,)


def _reason(exc):
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def open_store(path, *, read_only):
    """The zarr Store behind ``path``: a LocalStore for paths and ``file://``, else fsspec's.  A store read
    from the local file system (also through fsspec: ``local://``, ``simplecache::file://``) reads no file
    that resolves outside it (:func:`confined`)."""
    zarr = _zarr()
    local = local_path(path)
    if local is not None:
        if read_only:
            return confined(zarr.storage.LocalStore)(local, read_only=True)
        return zarr.storage.LocalStore(local, read_only=read_only)
    try:
        store = zarr.storage.FsspecStore.from_url(path, read_only=read_only)
    except ImportError as exc:  # fsspec names the package its protocol needs (s3fs, gcsfs)
        raise FileFormatError(f"{path}: {_reason(exc)}") from None
    except (ValueError, OSError) as exc:
        raise FileFormatError(f"{path}: cannot open the store: {_reason(exc)}") from None
    if _on_local_disk(store.fs):
        store = confined(zarr.storage.FsspecStore)(fs=store.fs, path=store.path, read_only=store.read_only)
    return store


class OutsideStore(FileFormatError):
    """A key of a store that qgcli does not read: it resolves, through a symbolic link, to a file outside the
    store, or names no regular file (a FIFO)."""


def inside(root, key):
    """Refuse ``key`` of the store at ``root`` (a local path) when the file it names resolves (through any
    symbolic link, of a chunk, an array's or a group's directory) outside the store's own real directory.
    A store that is itself a link is the store it points to; links that stay inside it are followed."""
    base = os.path.realpath(root)
    real = os.path.realpath(os.path.join(base, key))
    if real != base and not real.startswith(base.rstrip(os.sep) + os.sep):
        raise OutsideStore(f"{root}: {key!r} is a link to {real}, outside the store; qgcli reads nothing outside "
                           "a Zarr store")
    try:
        special = not stat.S_ISREG(os.stat(real).st_mode) and not os.path.isdir(real)
    except OSError:
        special = False  # absent: zarr reads it as missing (a fill value, or no such node)
    if special:  # a FIFO would block the read forever
        raise OutsideStore(f"{root}: {key!r} is not a regular file (a FIFO, socket or device); qgcli does not read it")
    return key


_CONFINED = {}


def confined(base):
    """``base`` (zarr's LocalStore or FsspecStore on the local disk) whose reads refuse keys that resolve
    outside the store (:func:`inside`); the check runs before every read of metadata and chunks."""
    cls = _CONFINED.get(base)
    if cls is None:
        class Confined(base):
            def _root(self):
                return str(self.root) if hasattr(self, "root") else self.path

            async def get(self, key, prototype=None, byte_range=None):
                return await super().get(inside(self._root(), key), prototype, byte_range)

            def get_sync(self, key, *args, **kwargs):
                return super().get_sync(inside(self._root(), key), *args, **kwargs)

            async def get_partial_values(self, prototype, key_ranges):
                key_ranges = [(inside(self._root(), key), byte_range) for key, byte_range in key_ranges]
                return await super().get_partial_values(prototype, key_ranges)

        cls = _CONFINED[base] = Confined
    return cls


def _on_local_disk(fs):
    """Whether an fsspec file system (or one it wraps: async wrappers, caches) is the local disk."""
    from fsspec.implementations.local import LocalFileSystem

    for _ in range(8):
        if isinstance(fs, LocalFileSystem):
            return True
        fs = getattr(fs, "sync_fs", None) or getattr(fs, "fs", None)
        if fs is None:
            return False
    return False


class ZarrContainer:
    """A Zarr store read as a tensor container (the interface of :class:`qgcli.storage.io.Container`)."""

    kind = "zarr"

    def __init__(self, path, node):
        self.label, self._node = path, node

    @classmethod
    def open(cls, path):
        local = local_path(path)
        if local is not None and not os.path.isdir(local):
            what = "no such Zarr store" if not os.path.exists(local) else "not a Zarr store (not a directory)"
            raise FileFormatError(f"{what}: {path}")
        zarr = _zarr()
        try:
            node = zarr.open(store=open_store(path, read_only=True), mode="r")
        except FileFormatError:
            raise
        except _errors() as exc:
            raise FileFormatError(f"{path}: cannot open as a Zarr store: {_reason(exc)}") from None
        return cls(path, node)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        pass  # a zarr store holds no open file between reads

    @property
    def one_array(self):
        """The store's root is one array (read with no key, as an .npy is)."""
        return self._is_array()

    def _is_array(self):
        return isinstance(self._node, _zarr().Array)

    def names(self):
        if self._is_array():
            return []
        try:
            return [name for name, node in self._node.members(max_depth=None) if isinstance(node, _zarr().Array)]
        except OutsideStore:
            raise
        except _errors() as exc:
            raise FileFormatError(f"{self.label}: cannot list its arrays: {_reason(exc)}") from None

    def array(self, key=None):
        """The zarr Array under ``key`` (None: the root array, or the store's only array), checked to hold
        numbers, unread."""
        if self._is_array():
            if key is not None:
                raise FileFormatError(f"{self.label}: the store is one array; there is no key {key!r}")
            node, key = self._node, "(root)"
        else:
            if key is None:
                names = self.names()
                if len(names) != 1:
                    raise FileFormatError(f"{self.label}: holds {len(names)} arrays ({', '.join(names[:8])}); "
                                          "name one with :KEY")
                key = names[0]
            try:
                node = self._node[key.strip("/")]
            except KeyError:
                raise FileFormatError(f"{self.label}: has no array {key!r}") from None
            except OutsideStore:
                raise
            except _errors() as exc:
                raise FileFormatError(f"{self.label}: cannot open {key!r}: {_reason(exc)}") from None
            if not isinstance(node, _zarr().Array):
                raise FileFormatError(f"{self.label}: {key!r} is a group, not an array")
        _check_chunks(node, self.label, key)
        dtype = node.dtype
        if not isinstance(dtype, np.dtype) or dtype.kind not in "biufc":
            # object arrays would be unpickled (numcodecs' Pickle codec); strings are no tensor
            raise FileFormatError(f"{self.label}: {key!r} holds {dtype}, not numbers; qgcli does not read it")
        check_zarr(node, key, self.label)  # chunks the store does not hold: not read above a bound
        return node

    def has(self, key):
        if self._is_array():
            return False
        try:
            self._node[key.strip("/")]
            return True
        except KeyError:
            return False
        except _errors():
            return True  # present but damaged: said when it is read

    def read(self, key=None):
        node = self.array(key)
        what = f"{self.label}: {key or '(root)'!r}"
        check_memory(int(node.size) * node.dtype.itemsize, what)
        try:
            data = np.asarray(node[...])
        except OutsideStore:
            raise
        except _errors() as exc:
            raise FileFormatError(f"{what} cannot be read: {_reason(exc)}") from None
        return as_tagged(node, data)

    def dataset(self, key):
        return None  # not an HDF5 dataset: the HDF5 streaming executor does not take it

    def attributes(self):
        """The root's attributes (a qgcli output's provenance)."""
        try:
            return json_attrs(dict(self._node.attrs))
        except _errors() as exc:
            raise FileFormatError(f"{self.label}: cannot read its attributes: {_reason(exc)}") from None

    def header(self, key):
        return None, None  # no header to read apart from the array's metadata: the read says what failed


def _check_chunks(node, label, key):
    """Refuse an array whose chunk (or shard) shape has a zero or negative extent: no grid can cover it."""
    for what in ("chunks", "shards"):
        try:
            shape = getattr(node, what)
        except _errors() + (ZeroDivisionError,) as exc:
            raise FileFormatError(f"{label}: {key!r} has no usable {what[:-1]} shape: {_reason(exc)}") from None
        if shape is not None and any(int(extent) <= 0 for extent in shape):
            raise FileFormatError(f"{label}: {key!r} has the {what[:-1]} shape {list(shape)}; every extent must be "
                                  "at least 1")


def as_tagged(node, data):
    """``data`` read from ``node``, bfloat16 restored from its uint16 storage (qgcli's ``dtype`` tag)."""
    if data.dtype == np.uint16 and node.attrs.get("dtype") == "bfloat16":
        import ml_dtypes

        return data.view(ml_dtypes.bfloat16)
    return data


# --- writing -------------------------------------------------------------------------------------

def check_output(dest, *, inputs=(), force=False):
    """Refuse a store that is an input (or holds one), exists without ``force``, is a directory that is no
    Zarr store, or lies in a missing or read-only directory (the rules of :func:`qgcli.storage.targets.check_file`)."""
    local = local_path(dest)
    if local is None:
        fs, root = _fsspec(dest)
        if fs.exists(root) and not force:
            raise OutputError(f"{dest} exists; use --force to replace it", operand="--output")
        return
    target = os.path.realpath(local)
    atomic.sweep(os.path.dirname(target))  # what a killed run left: first put back (or removed)
    for source in inputs:
        where = local_path(source) if source else None
        if where and os.path.exists(where):
            real = os.path.realpath(where)
            if real == target or real.startswith(target + os.sep):
                raise OutputError(f"{dest} is also an input; qgcli never overwrites its inputs", operand="--output")
            if os.path.isdir(real) and target.startswith(real.rstrip(os.sep) + os.sep):
                raise OutputError(f"{dest} lies inside the input {source}; qgcli never writes into its inputs",
                                  operand="--output")
    parent = os.path.dirname(os.path.abspath(local))
    if not os.path.isdir(parent):
        raise OutputError(f"directory {parent} does not exist", operand="--output")
    if os.path.lexists(local):
        if not force:
            raise OutputError(f"{dest} exists; use --force to replace it", operand="--output")
        if not os.path.isdir(local) or not any(os.path.exists(os.path.join(local, m)) for m in _MARKERS):
            raise OutputError(f"{dest} exists and is not a Zarr store; qgcli replaces only Zarr stores",
                              operand="--output")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"directory {parent} is not writable", operand="--output")
    atomic.checked(local, force)


def _fsspec(url):
    try:
        import fsspec
    except ImportError:
        raise FileFormatError(f"{url}: URLs need fsspec: pip install fsspec") from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as exc:
        raise FileFormatError(f"{url}: {_reason(exc)}") from None


def chunks_for(shape, itemsize, chunk_bytes=CHUNK_BYTES):
    """Output chunks: whole along every axis but the first, about ``chunk_bytes`` of rows each."""
    if not shape:
        return ()
    per_item = max(1, int(np.prod(shape[1:], dtype=np.int64)) * itemsize)
    return (max(1, min(int(shape[0]), chunk_bytes // per_item)), *(max(1, int(s)) for s in shape[1:]))


def output_format():
    """The Zarr format outputs are written in: zarr's own ``default_zarr_format`` setting (3 unless
    ``ZARR_DEFAULT_ZARR_FORMAT`` or zarr's config says 2)."""
    return int(_zarr().config.get("default_zarr_format"))


def codecs(compression):
    """zarr ``compressors`` for ``--compression`` (None: stored raw, as .h5 outputs are by default), for the
    output format: zarr's GzipCodec in format 3, numcodecs' GZip (what format 2 names) in format 2."""
    if compression is None:
        return None
    if compression != "gzip":
        raise OutputError(f"{compression} is an HDF5 filter; a Zarr store takes --compression gzip",
                          operand="--compression")
    if output_format() == 2:
        import numcodecs

        return numcodecs.GZip(level=4)
    return _zarr().codecs.GzipCodec(level=4)


def json_attrs(attrs):
    """Attributes as JSON values (NumPy scalars and arrays become numbers and lists)."""
    return {str(k): (v.tolist() if isinstance(v, (np.ndarray, np.generic)) else v) for k, v in attrs.items()
            if v is not None}


def create_array(group, name, shape, dtype, *, attrs, compression, chunks=None):
    """An empty output array (bfloat16 stored as uint16 with qgcli's ``dtype`` tag, as in .h5 outputs)."""
    dtype = np.dtype(dtype)
    attrs = json_attrs(attrs)
    if dtype.name == "bfloat16":
        dtype, attrs = np.dtype(np.uint16), {**attrs, "dtype": "bfloat16"}
    return group.create_array(name, shape=tuple(shape), dtype=dtype,
                              chunks=chunks or chunks_for(tuple(shape), dtype.itemsize),
                              compressors=codecs(compression), fill_value=0, attributes=attrs)


def put(group, name, array, *, attrs, compression):
    """Write ``array`` as a new array of ``group``."""
    array = np.asarray(array)
    node = create_array(group, name, array.shape, array.dtype, attrs=attrs, compression=compression)
    node[...] = array.view(np.uint16) if array.dtype.name == "bfloat16" else array


@contextlib.contextmanager
def staged(dest):
    """``with staged(dest) as stage``: a new Zarr group (``stage.group``, in :func:`output_format`) at
    ``stage.path``, a temporary store beside ``dest`` renamed over it when the block ends without an error,
    removed otherwise."""
    zarr = _zarr()
    stage = _Stage(dest)
    try:
        stage.group = zarr.create_group(store=open_store(stage.path, read_only=False),
                                         zarr_format=output_format())
        yield stage
        stage.commit()
    except BaseException:
        stage.remove()
        raise


class _Stage:
    def __init__(self, dest):
        self.dest = dest
        self.local = local_path(dest)
        name = f".qgcli-{atomic.temp_token()}.tmp.zarr"
        if self.local is not None:
            if os.path.islink(self.local) and os.path.isdir(self.local):
                self.local = os.path.realpath(self.local)  # --force over a linked store replaces the store
            parent = os.path.dirname(os.path.abspath(self.local))
            self.replace = atomic.may_replace(self.local)  # an existing store is replaced only with --force
            self.path = os.path.join(parent, name)
            os.mkdir(self.path, 0o700)  # named before it exists, so cleanup always knows it
            atomic.hold(self.path)
        else:
            self.path = f"{dest.rstrip('/').rsplit('/', 1)[0]}/{name}"
            self.fs, self.root = _fsspec(dest.rstrip("/"))
            self.tmp_root = _fsspec(self.path)[1]

    def commit(self):
        raise_pending()
        if self.local is None:
            if self.fs.exists(self.root):
                self.fs.rm(self.root, recursive=True)
            self.fs.mv(self.tmp_root, self.root, recursive=True)
            return
        os.chmod(self.path, 0o777 & ~atomic.umask())
        # A new store lands only where none appeared meanwhile; --force swaps the old store with the new one.
        atomic.commit_directory(self.path, self.local, replace=self.replace)

    def remove(self):
        if self.local is not None:
            atomic.discard_directory(self.path)
        else:
            try:
                self.fs.rm(self.tmp_root, recursive=True)
            except (OSError, FileNotFoundError):
                pass


def save(dest, arrays, *, attrs=None, compression=None):
    """Write ``arrays`` (name -> array) as a new store at ``dest``: the attributes on the root group and on
    every array, as .h5 outputs carry them."""
    write_groups(dest, [("", arrays, attrs or {})], compression=compression, array_attrs=True)


def write_groups(dest, groups, *, compression=None, array_attrs=False):
    """A new store at ``dest`` with one group per ``(path, arrays, attrs)`` of ``groups`` (an iterable: a
    run file's groups as they are computed; the attributes on the group, as a run file's .h5 output)."""
    with _group_sink(dest, compression=compression, array_attrs=array_attrs) as sink:
        for path, arrays, attrs in groups:
            sink.add(path, arrays, attrs)


@contextlib.contextmanager
def _group_sink(dest, *, compression=None, array_attrs=False, provenance=None):
    codecs(compression)  # a refused --compression before anything is computed
    with staged(dest) as stage:
        yield _GroupSink(stage, compression, array_attrs, provenance)


class _GroupSink:
    """``add(path, arrays, attrs)`` writes one group of a new store (see :func:`write_groups`), done when it
    returns (``writes_on_add``: a runner may reuse the arrays for the next group)."""

    streams = False
    writes_on_add = True

    def __init__(self, stage, compression, array_attrs, provenance):
        self.stage, self.compression, self.array_attrs = stage, compression, array_attrs
        self.provenance = provenance or (lambda attrs: attrs)

    def begin(self, path):
        return None

    def discard(self, path):
        pass

    def add(self, path, arrays, attrs):
        attrs = self.provenance(attrs)
        check_group_paths([path])
        group = self.stage.group.require_group(path) if path else self.stage.group
        group.attrs.update(json_attrs(attrs))
        for name, array in arrays.items():
            put(group, name, array, attrs=attrs if self.array_attrs else {}, compression=self.compression)


def check_group_paths(paths):
    """Refuse group paths a Zarr store cannot hold: zarr forbids ``.`` and ``..`` segments (HDF5 takes them
    as plain names); write such a run file's outputs to .h5, which keeps every name, or to ``DIR/``."""
    for path in paths:
        if any(part in (".", "..") for part in path.split("/")):
            raise OutputError(f"the group {path!r} cannot be a Zarr group name (Zarr forbids '.' and '..' in "
                              "paths); write .h5, which keeps every name, or DIR/", operand="--output")


def _store_size(path):
    """Bytes under a local store (what ``inspect`` reports as its size); 0 for a URL."""
    local = local_path(path)
    if local is None:
        return 0
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(local) for f in files)


class ZarrFormat:
    """Zarr stores, claimed by name (``.zarr``, a directory or URL), before any directory rule."""

    name, title, suffixes, magic = "zarr", "Zarr", (SUFFIX,), None
    holds_many, hierarchical = True, False

    def claims(self, path):
        return is_zarr(path)

    def open_container(self, path):
        return ZarrContainer.open(path)

    def size(self, path):
        return _store_size(path)

    def check_output(self, dest, *, inputs=(), force=False, names=()):
        check_output(dest, inputs=inputs, force=force)

    def write(self, dest, arrays, *, attrs, compression=None, stdout=None):
        save(dest, arrays, attrs=attrs, compression=compression)

    def group_sink(self, dest, *, compression=None):
        return _group_sink(dest, compression=compression, provenance=provenance.attributes)

    def check_group_paths(self, paths):
        check_group_paths(paths)


FORMAT = ZarrFormat()
