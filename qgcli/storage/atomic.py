"""Atomic commit: every output is written under a hidden temporary name beside its target, synced, and
renamed into place, so the target is either absent, the old file, or complete.

The temporary names (``.qgcli-*.tmp`` files, ``.qgcli-*.tmpdir`` folders) are chosen before the file exists,
so that cleanup on any failure or interrupt always knows them; only a SIGKILL, which no process can catch,
can leave one behind, never a partial target.
"""
import contextlib
import errno
import os
import re
import shutil
import sys

from qgcli.errors import OutputError
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
    the block ends without an error (removed otherwise).  An existing ``dest`` is replaced only with
    ``--force`` (:func:`may_replace`): if another process wrote it since the checks, this output fails with
    :class:`Appeared`."""
    replace = may_replace(dest)
    mode, made = _mode_for(dest), []
    with _cleanup(made, dest):
        tmp = _new_temp(dest, made)
        yield tmp
        _finish(tmp, mode)
    commit([(tmp, dest)], replace=replace)


_checked = {}  # absolute output path -> whether its checks allowed replacing it (--force)


def checked(dest, force):
    """Record that the output ``dest`` passed its checks, with ``force`` or not (:func:`may_replace`)."""
    _checked[os.path.abspath(dest.rstrip("/") or dest)] = bool(force)


def may_replace(dest):
    """Whether the commit may replace an existing ``dest``: only with ``--force`` (as its checks recorded,
    :func:`checked`): a target that was absent when checked and appeared before the commit was written by
    someone else meanwhile, and is left alone.  Unchecked (a library call): when it exists already."""
    allowed = _checked.get(os.path.abspath(dest.rstrip("/") or dest))
    return os.path.lexists(dest) if allowed is None else allowed


class Appeared(OutputError):
    """An output that did not exist when qgcli checked it was created by someone else (another run writing
    the same new file) before this run's commit: this run fails, the other's output stays."""

    def __init__(self, dest):
        super().__init__(f"{dest} appeared while this run was writing it (made by another process), and was "
                         "left as it is; use --force to replace it", operand="--output")


# renameat2(2) flags (Linux 3.15+; ext4, xfs, btrfs, tmpfs ...).
_AT_FDCWD, _RENAME_NOREPLACE, _RENAME_EXCHANGE = -100, 1, 2
_renameat2 = []


def _renameat2_call(src, dst, flags):
    """renameat2(src, dst, flags) through libc; False when this system or file system has no such call
    (then the caller falls back, as documented in docs/guarantees.md), else True or an OSError."""
    if not _renameat2:
        function = None
        if sys.platform.startswith("linux"):
            import ctypes

            try:
                function = ctypes.CDLL(None, use_errno=True).renameat2
                function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            except (OSError, AttributeError):  # glibc before 2.28, musl before 1.2.1
                function = None
        _renameat2.append(function)
    function = _renameat2[0]
    if function is None:
        return False
    import ctypes

    if function(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    number = ctypes.get_errno()
    if number in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # the file system does not support the flag
    if number == errno.EEXIST:
        raise Appeared(dst)
    raise OSError(number, os.strerror(number), src, None, dst)


def rename_noreplace(src, dst):
    """Rename ``src`` (a file or directory) to ``dst`` only if ``dst`` does not exist, atomically:
    ``renameat2(RENAME_NOREPLACE)``; where that is missing, a file is hard-linked to ``dst`` (which fails
    if ``dst`` exists) and its temporary name removed, and a directory is renamed after checking that
    ``dst`` is absent (``rename`` itself never replaces a non-empty directory).  Raises :class:`Appeared`
    when ``dst`` exists."""
    if _renameat2_call(src, dst, _RENAME_NOREPLACE):
        return
    if os.path.lexists(dst):
        raise Appeared(dst)
    if not os.path.isdir(src):
        try:
            os.link(src, dst)
        except FileExistsError:
            raise Appeared(dst) from None
        except OSError:  # no hard links here (FAT, some network file systems): a plain rename
            os.rename(src, dst)
            return
        os.unlink(src)
        return
    os.rename(src, dst)


def exchange(a, b):
    """Swap the names ``a`` and ``b`` (two existing directories) in one step (``renameat2(RENAME_EXCHANGE)``);
    False, with nothing done, where the system or file system cannot."""
    return _renameat2_call(a, b, _RENAME_EXCHANGE)


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


def commit(staged, *, sync=True, replace=True):
    """Rename each staged ``(tmp, dest)`` into place, then sync the directories (so the renames survive a
    power cut; not when ``sync`` is false); on failure the temporaries not yet renamed are removed.
    ``replace=False``: a ``dest`` that exists by now (another process wrote it since the checks) is never
    replaced; that output fails with :class:`Appeared` (:func:`rename_noreplace`)."""
    try:
        raise_pending()  # a Ctrl-C that Python swallowed in a __del__ still stops the output
        for tmp, dest in staged:
            if replace:
                os.replace(tmp, dest)
            else:
                rename_noreplace(tmp, dest)
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
            hold(made[0])  # a concurrent run's sweep() leaves it alone
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


# --- whole directories (DIR/, .zarr stores, figure folders) ------------------------------------------

_OLD = ".old~"  # a replaced directory moved aside: ``.qgcli-TOKEN.old~NAME`` (NAME: the target it was)
_LEFTOVER = re.compile(r"^\.qgcli-[0-9a-f]{16}\.(tmpdir|tmp\.zarr|old(~.*)?)$", re.DOTALL)
_held = {}  # path of a directory this process is building or moving -> the open fd holding its lock


def hold(path):
    """Take an exclusive ``flock`` on the directory ``path`` for as long as this process works on it (or
    until :func:`release`): a later run's :func:`sweep` then knows it is alive and leaves it alone.  The
    lock follows the directory through renames and ends with the process, however it ends."""
    try:
        import fcntl

        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except (ImportError, OSError):
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return
    _held[path] = fd


def release(path):
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def _abandoned(path):
    """Whether nobody holds the directory ``path`` (its writer is gone); False when it cannot tell."""
    try:
        import fcntl

        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except (ImportError, OSError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops the probe's lock


def sweep(parent):
    """Tidy what a killed run (SIGKILL, a power cut) left in ``parent``: an unfinished ``.qgcli-*.tmpdir`` or
    ``.qgcli-*.tmp.zarr`` is removed; a ``.qgcli-*.old~NAME`` (a replaced directory moved aside) is renamed
    back to NAME when NAME is missing (the replacement never arrived), else removed.  Only directories no
    live process holds (:func:`hold`) are touched.  Returns the names recovered."""
    recovered = []
    try:
        names = os.listdir(parent)
    except OSError:
        return recovered
    for name in names:
        match = _LEFTOVER.match(name)
        path = os.path.join(parent, name)
        if match is None or os.path.islink(path) or not os.path.isdir(path) or not _abandoned(path):
            continue
        target = name.split(_OLD, 1)[1] if _OLD in name else ""
        if target and target not in (".", "..") and "/" not in target and not os.path.lexists(
                os.path.join(parent, target)):
            try:
                rename_noreplace(path, os.path.join(parent, target))
                recovered.append(target)
                continue
            except OSError:
                pass
        shutil.rmtree(path, ignore_errors=True)
    return recovered


def _merge_into(staging, old):
    """Hard-link into ``staging`` every file of the directory ``old`` that ``staging`` does not have (the
    files of ``DIR/`` that the run does not write stay, as they did when outputs were renamed in one by one)."""
    for root, dirs, files in os.walk(old):
        rel = os.path.relpath(root, old)
        here = staging if rel == "." else os.path.join(staging, rel)
        for name in dirs:
            if not os.path.lexists(os.path.join(here, name)):
                os.mkdir(os.path.join(here, name), os.stat(os.path.join(root, name)).st_mode & 0o7777)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))
                   and os.path.isdir(os.path.join(here, d))]
        for name in files + [d for d in os.listdir(root) if os.path.islink(os.path.join(root, d))]:
            src, dst = os.path.join(root, name), os.path.join(here, name)
            if os.path.lexists(dst):
                continue
            try:
                os.link(src, dst, follow_symlinks=False)
            except OSError:  # no hard links here: a copy
                shutil.copy2(src, dst, follow_symlinks=False)


def commit_directory(staging, dest, *, replace, merge=False, sync=True):
    """Put the complete directory ``staging`` (beside ``dest``) at ``dest``.

    An absent ``dest``: ``staging`` is renamed to it only if it is still absent (:func:`rename_noreplace`).
    An existing one is replaced only when ``replace`` (``--force``), or, with ``merge`` (``DIR/``, which may be
    an existing directory), when it holds none of ``staging``'s files; else :class:`Appeared`.  ``merge``
    first links the old directory's other files into the new one.  The two are then swapped in one step
    (``renameat2(RENAME_EXCHANGE)``), so ``dest`` names the old directory or the new one at every instant,
    and the old one is removed.  Where the swap is missing the old directory is renamed aside to
    ``.qgcli-*.old~NAME`` and the new one renamed in: between the two renames ``dest`` is absent, and a run
    killed there leaves the old one aside, which the next run's :func:`sweep` puts back."""
    parent = os.path.dirname(os.path.abspath(dest))
    raise_pending()
    if not os.path.lexists(dest):
        rename_noreplace(staging, dest)
        release(staging)
        if sync:
            fsync_directory(parent)
        return
    if not os.path.isdir(dest) or not (replace or merge):
        raise Appeared(dest)
    if merge and not replace:
        for root, _, files in os.walk(staging):
            for name in files:
                there = os.path.join(dest, os.path.relpath(os.path.join(root, name), staging))
                if os.path.lexists(there):
                    raise Appeared(there)
    mode = os.stat(dest).st_mode & 0o7777
    if merge:
        _merge_into(staging, dest)
    os.chmod(staging, mode)
    if sync:
        fsync_directory(staging)
    if exchange(staging, dest):
        old = staging  # the swap left the old directory at the staging name
    else:
        name = os.path.basename(dest.rstrip(os.sep))
        old = os.path.join(parent, f".qgcli-{temp_token()}{_OLD}{name}")
        if len(os.path.basename(old).encode()) > 255:
            old = os.path.join(parent, f".qgcli-{temp_token()}.old")
        hold(dest)  # the old directory, aside: a concurrent sweep() must not put it back meanwhile
        try:
            os.rename(dest, old)
            try:
                os.rename(staging, dest)
            except BaseException:
                os.rename(old, dest)
                raise
        finally:
            release(dest)
    if sync:
        fsync_directory(parent)
    shutil.rmtree(old, ignore_errors=True)
    release(staging)


def discard_directory(path):
    """Remove a staging directory that will not be committed, and drop its lock."""
    shutil.rmtree(path, ignore_errors=True)
    release(path)
