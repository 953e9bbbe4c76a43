"""``-o DIR/``: one .npy per output, at the path :func:`qgcli.storage.paths.group_file_paths` gives its name
(a ``/`` in a name is a sub-folder; ``..``, separators, control characters, device names and over-long names
never reach the file system as they are) and, when some name had to change, ``DIR/index.json`` mapping every
exact name to its file.  A run file's outputs are named ``group/name``: one folder per group.

DIR is built as a hidden ``.qgcli-*.tmpdir`` beside it and put in place in one step, so it appears with all
its files or not at all (even after a SIGKILL); an existing DIR (``--force``) is swapped with its new version,
which holds the old one's other files too (hard links), so DIR is the old directory or the new one at every
instant (:func:`qgcli.storage.atomic.commit_directory`).
"""
import contextlib
import os

from qgcli.errors import OutputError
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
    path does not depend on their order) and the whole directory lands at once (:func:`qgcli.storage.atomic.
    commit_directory`: a new DIR only if it is still absent, an existing one swapped with its new version,
    which keeps the old one's other files).  ``sync``: each file and directory is synced before the renames
    (a run file's thousands of files skip it, as they always have)."""
    directory = os.path.abspath(dest.rstrip("/") or dest)
    replace = atomic.may_replace(directory)
    if os.path.islink(directory) and os.path.isdir(directory):
        directory = os.path.realpath(directory)  # the directory a link names is replaced, not the link
    parent = os.path.dirname(directory)
    existed = os.path.isdir(directory)
    made, temps, staged = [], [], {}  # the staging folder; every temporary file; name -> its own
    try:
        if not existed:
            os.makedirs(parent, exist_ok=True)
        staging = atomic.new_temp_dir(parent, made)

        def put(name, array):
            staged[name] = atomic.stage_in(staging, lambda p: npy.write(p, array), temps, sync=sync)

        yield put
        layout = group_file_paths(staged, suffix=".npy")
        if layout.changed:
            staged[None] = atomic.stage_in(staging, lambda p: atomic.write_text(p, layout.index_json()), temps,
                                           sync=sync)
        for name, tmp in staged.items():
            rel = INDEX_NAME if name is None else layout[name]
            old, target = os.path.join(directory, *rel.split("/")), os.path.join(staging, *rel.split("/"))
            if existed and os.path.isdir(old) and not os.path.islink(old):
                raise OutputError(f"{old} is a directory", operand="--output")
            if existed:
                atomic.keep_mode(tmp, old)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(tmp, target)
        temps.clear()
        if not existed:
            os.chmod(staging, 0o777 & ~atomic.umask())
        if sync:
            atomic.fsync_directory(staging)
        atomic.commit_directory(staging, directory, replace=replace, merge=True, sync=sync)
        made.clear()
    except BaseException as exc:
        for tmp in temps:
            atomic.unlink(tmp)
        for tmpdir in made:
            atomic.discard_directory(tmpdir)
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
        atomic.sweep(os.path.dirname(os.path.abspath(directory)))  # what a killed run left: first put back
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
        atomic.checked(directory, force)

    def write(self, dest, arrays, *, attrs, compression=None, stdout=None):
        with writing(dest) as put:
            for name, array in arrays.items():
                put(name, array)

    @contextlib.contextmanager
    def group_sink(self, dest, *, compression=None):
        with writing(dest, sync=False) as put:
            yield FlatSink(put)


FORMAT = DirectoryFormat()
