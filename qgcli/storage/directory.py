"""``-o DIR/``: one .npy per output, at the path :func:`qgcli.storage.paths.group_file_paths` gives its name
(a ``/`` in a name is a sub-folder; ``..``, separators, control characters, device names and over-long names
never reach the file system as they are) and, when some name had to change, ``DIR/index.json`` mapping every
exact name to its file.  A run file's outputs are named ``group/name``: one folder per group.

A new DIR is built as a hidden ``.qgcli-*.tmpdir`` beside it and renamed into place in one step, so it
appears with all its files or not at all (even after a SIGKILL); into an existing DIR every file is written
first, then all are renamed together.
"""
import contextlib
import os
import shutil

from qgcli.errors import OutputError
from qgcli.signals import raise_pending
from qgcli.storage import atomic, npy, targets
from qgcli.storage.paths import INDEX_NAME, group_file_paths
from qgcli.storage.sinks import FlatSink


def is_directory(dest):
    """Whether an ``-o`` target names a directory (a trailing separator, or an existing directory)."""
    return dest.endswith(os.sep) or dest.endswith("/") or os.path.isdir(dest)


@contextlib.contextmanager
def writing(dest, *, sync=True):
    """``with writing(dest) as put``: ``put(name, array)`` writes one .npy under a temporary name as it comes;
    when the block ends the names are laid out (all of them known: which of two clashing names keeps the plain
    path does not depend on their order) and every file lands at once.  ``sync``: each file and directory is
    synced before the renames (a run file's thousands of files skip it, as they always have)."""
    directory = os.path.abspath(dest.rstrip("/") or dest)
    parent = os.path.dirname(directory)
    new = not os.path.isdir(directory)
    made, temps, staged = [], [], {}  # the staging folder of a new DIR; every temporary file; name -> its own
    try:
        if new:
            os.makedirs(parent, exist_ok=True)
            atomic.new_temp_dir(parent, made)
        staging = made[0] if new else None
        where = staging if new else directory

        def put(name, array):
            staged[name] = atomic.stage_in(where, lambda p: npy.write(p, array), temps, sync=sync)

        yield put
        layout = group_file_paths(staged, suffix=".npy")
        if layout.changed:
            staged[None] = atomic.stage_in(where, lambda p: atomic.write_text(p, layout.index_json()), temps,
                                           sync=sync)
        root = staging if new else directory
        moves = [(tmp, os.path.join(root, INDEX_NAME) if name is None else layout.target(root, name))
                 for name, tmp in staged.items()]
        for tmp, target in moves:
            if not new:
                if os.path.isdir(target):
                    raise OutputError(f"{target} is a directory", operand="--output")
                atomic.keep_mode(tmp, target)
            os.makedirs(os.path.dirname(target), exist_ok=True)
        if not new:
            atomic.commit(moves, sync=sync)
            temps.clear()
            return
        for tmp, target in moves:
            os.replace(tmp, target)
        temps.clear()
        os.chmod(staging, 0o777 & ~atomic.umask())
        if sync:
            atomic.fsync_directory(staging)
        raise_pending()
        os.rename(staging, directory)  # atomic; fails if DIR appeared meanwhile and is not empty
        made.clear()
        if sync:
            atomic.fsync_directory(parent)
    except BaseException as exc:
        for tmp in temps:
            atomic.unlink(tmp)
        for tmpdir in made:
            shutil.rmtree(tmpdir, ignore_errors=True)
        error = atomic.as_os_error(exc, dest)
        if error is not None and error is not exc:
            raise error from None
        raise


def targets_of(dest, names):
    """The files ``-o DIR/`` writes for ``names``: one .npy each, and the index when a name had to change."""
    layout = group_file_paths(names, suffix=".npy")
    return [layout.target(dest, n) for n in layout] + ([os.path.join(dest, INDEX_NAME)] if layout.changed else [])


def write_index(directory, layout, *, always=False):
    """Write ``layout.index_json()`` (a :class:`qgcli.storage.paths.FileLayout`) as ``directory/index.json``,
    atomically, when ``layout.changed`` or ``always``: for outputs that :func:`writing` does not write (figures,
    Zarr groups).  Returns the path written, or None."""
    if not (always or layout.changed):
        return None
    target = os.path.join(directory, INDEX_NAME)
    atomic.atomic_write(target, lambda p: atomic.write_text(p, layout.index_json()))
    return target


class DirectoryFormat:
    name, title, suffixes, magic = "dir", "directory", (), None

    def check_output(self, dest, *, inputs=(), force=False, names=()):
        """For ``DIR/``, the checks of a file output for each ``DIR/name.npy`` of ``names``."""
        files = targets_of(dest, names)
        targets.refuse_inputs(files, inputs)
        directory = dest.rstrip("/") or "/"
        if os.path.lexists(directory) and not os.path.isdir(directory):
            raise OutputError(f"{directory} is a file, not a directory", operand="--output")
        parent = os.path.dirname(os.path.abspath(directory))
        if not os.path.isdir(directory) and not os.path.isdir(parent):
            raise OutputError(f"directory {parent} does not exist", operand="--output")
        existing = [t for t in files if os.path.lexists(t)]
        if existing and not force:
            raise OutputError(f"{existing[0]} exists; use --force to replace it", operand="--output")
        for target in existing:
            if os.path.isdir(target):
                raise OutputError(f"{target} is a directory", operand="--output")
        writable = directory if os.path.isdir(directory) else parent
        if not os.access(writable, os.W_OK | os.X_OK):
            raise OutputError(f"directory {writable} is not writable", operand="--output")

    def write(self, dest, arrays, *, attrs, compression=None, stdout=None):
        with writing(dest) as put:
            for name, array in arrays.items():
                put(name, array)

    @contextlib.contextmanager
    def group_sink(self, dest, *, compression=None):
        with writing(dest, sync=False) as put:
            yield FlatSink(put)


FORMAT = DirectoryFormat()
