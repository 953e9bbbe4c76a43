"""Atomic commit: every output is written under a hidden temporary name beside its target, synced, and
renamed into place, so the target is either absent, the old file, or complete.

The temporary names (``.qgcli-*.tmp`` files, ``.qgcli-*.tmpdir`` folders) are chosen before the file exists,
so that cleanup on any failure or interrupt always knows them; only a SIGKILL, which no process can catch,
can leave one behind, never a partial target.
"""
import contextlib
import os
import re
import sys

from qgcli.signals import raise_pending
from qgcli.storage.hdf5 import guard as hdf5_guard


def temp_token():
    """16 random hex digits for a temporary name: ``secrets.token_hex(8)``'s bytes (``os.urandom``), without
    importing secrets (hashlib, hmac, random: 6 ms of every start)."""
    return os.urandom(8).hex()


def atomic_write(dest, writer):
    """Run ``writer(path)`` on a temporary file beside ``dest``, then rename it over ``dest``."""
    with staging(dest) as tmp:
        writer(tmp)


@contextlib.contextmanager
def staging(dest):
    """``with staging(dest) as tmp``: a temporary file beside ``dest`` to write, renamed over ``dest`` when
    the block ends without an error (removed otherwise)."""
    mode, made = _mode_for(dest), []
    with _cleanup(made, dest):
        tmp = _new_temp(dest, made)
        yield tmp
        _finish(tmp, mode)
    commit([(tmp, dest)])


def stage_in(directory, writer, made, *, sync=True):
    """Write a future file with ``writer(path)`` to a new temporary file in ``directory`` (synced unless
    ``sync`` is false, given the usual 0666 & ~umask); returns its path, for :func:`commit`, and appends it
    to ``made`` (the caller's list of what to remove if the output fails) before anything can interrupt."""
    mine = []
    with _cleanup(mine, directory):
        tmp = _new_temp(os.path.join(directory, "-"), mine)
        made.append(tmp)
        writer(tmp)
        _finish(tmp, 0o666 & ~umask(), sync=sync)
    return tmp


def keep_mode(tmp, dest):
    """--force keeps the mode of the file it replaces: give it to ``tmp`` when ``dest`` exists."""
    try:
        os.chmod(tmp, os.stat(dest).st_mode & 0o777)
    except FileNotFoundError:
        pass


def _mode_for(dest):
    try:  # --force keeps the mode of the file it replaces; a new file gets the usual 0666 & ~umask
        return os.stat(dest).st_mode & 0o777
    except OSError:
        return 0o666 & ~umask()


def _new_temp(dest, made):
    """A new empty temporary file beside ``dest``, its name appended to ``made`` before it exists."""
    parent = os.path.dirname(os.path.abspath(dest))
    # Not tempfile.mkstemp: its name is known only after the file exists, and an interrupt in between
    # would leave the file behind.  Here the name is set first, so cleanup always knows it.
    for _ in range(100):
        made[:] = [os.path.join(parent, f".qgcli-{temp_token()}.tmp")]
        try:
            os.close(os.open(made[0], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            return made[0]
        except FileExistsError:
            made.clear()  # someone else's: never removed
    raise FileExistsError(f"no free temporary file name in {parent}")


def _finish(tmp, mode, *, sync=True):
    if sync:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the data is on disk before the rename makes it visible
        finally:
            os.close(fd)
    os.chmod(tmp, mode)  # created 0600 while being written


@contextlib.contextmanager
def _cleanup(made, dest):
    """Remove the temporary file named in ``made`` when the block fails; a failed write is reported as the
    OSError it is."""
    hdf5_files = _open_hdf5_files()
    try:
        yield
    except BaseException as exc:
        for tmp in made:
            unlink(tmp)
        if _open_hdf5_files() > hdf5_files:
            # HDF5 could not close the file it failed to write (a full disk).  Touching its objects again
            # (even freeing them) can crash HDF5 2.0, so they are kept, and the CLI exits with os._exit.
            _hdf5_left_open.append(exc)
        error = as_os_error(exc, dest)
        if error is not None and error is not exc:
            raise error from None
        raise


_hdf5_left_open = []


def _open_hdf5_files():
    """How many files HDF5 holds open (0 when h5py was never imported)."""
    h5py = sys.modules.get("h5py")
    if h5py is None:
        return 0
    try:
        return h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE)
    except Exception:  # noqa: BLE001 - HDF5 in a bad state: count it as one more
        return 1 << 30


def hdf5_left_open():
    """True when a failed write left an HDF5 file that HDF5 could not close, or HDF5 is stuck in a
    guarded read: the process should end with ``os._exit`` (HDF5's exit handler would crash on it)."""
    return bool(_hdf5_left_open) or hdf5_guard.stuck()


def commit(staged, *, sync=True):
    """Rename each staged ``(tmp, dest)`` into place, then sync the directories (so the renames survive a
    power cut; not when ``sync`` is false); on failure the temporaries not yet renamed are removed."""
    try:
        raise_pending()  # a Ctrl-C that Python swallowed in a __del__ still stops the output
        for tmp, dest in staged:
            os.replace(tmp, dest)
    except BaseException:
        for tmp, _ in staged:
            unlink(tmp)
        raise
    if sync:
        for parent in {os.path.dirname(os.path.abspath(d)) for _, d in staged}:
            fsync_directory(parent)


def new_temp_dir(parent, made):
    """A new, empty, private ``.qgcli-*.tmpdir`` in ``parent``, its name appended to ``made`` before it
    exists (a signal that lands as it is made still finds it removed)."""
    for _ in range(100):
        made[:] = [os.path.join(parent, f".qgcli-{temp_token()}.tmpdir")]
        try:
            os.mkdir(made[0], 0o700)
            return made[0]
        except FileExistsError:
            made.clear()  # someone else's: never removed
    raise FileExistsError(f"no free temporary directory name in {parent}")


def fsync_directory(path):
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; a rename is still atomic


def unlink(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def as_os_error(exc, dest):
    """An OSError for a failed write (HDF5 reports a full disk as RuntimeError/OSError "... errno = 28 ...");
    None when ``exc`` is no I/O failure."""
    match = re.search(r"errno = (\d+)", str(exc)) if isinstance(exc, (OSError, RuntimeError)) else None
    if match and not (isinstance(exc, OSError) and exc.errno):
        number = int(match.group(1))
        return OSError(number, os.strerror(number), dest)
    return exc if isinstance(exc, OSError) else None


def umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path, text):
    with open(path, "w", encoding="ascii") as fh:
        fh.write(text)
