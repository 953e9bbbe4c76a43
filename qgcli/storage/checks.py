"""What every reader guards against: damaged bytes, and sizes a file declares but no machine holds.

Shared by the format modules (:mod:`qgcli.storage.formats`), so that each turns the same exceptions into
one :class:`qgcli.errors.FileFormatError` naming the file, with the same wording.
"""
import os
import re
import tokenize
import zipfile
import zlib

from qgcli.errors import FileFormatError

# Exceptions that damaged or hostile bytes raise from zipfile, zlib, NumPy's header parser and h5py
# (HDF5 errors surface as OSError, KeyError, ValueError, RuntimeError, TypeError or IndexError).
# Readers turn them into a FileFormatError naming the file; a MemoryError is not among them.
CORRUPT_FILE_ERRORS = (OSError, EOFError, ValueError, KeyError, IndexError, TypeError, RuntimeError,
                       NotImplementedError, OverflowError, SyntaxError, zipfile.BadZipFile, zlib.error,
                       tokenize.TokenError,  # NumPy re-tokenizes a header it cannot parse (Python 2 files)
                       SystemError)  # h5py: an HDF5 error inside a link-visit callback leaks out as SystemError


def reason(exc):
    """One line saying why ``exc`` (one of :data:`CORRUPT_FILE_ERRORS`) was raised, without addresses."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "allow_pickle" in text or "Object arrays" in text:
        return "it holds pickled Python objects, which qgcli never loads"
    if isinstance(exc, RecursionError):
        return "its structure nests too deeply (a cycle?)"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)  # ast's "<ast.Call object at 0x7f...>": no addresses


def physical_memory():
    """Bytes of physical memory: a tensor declaring more cannot be read, whatever the file claims."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return 1 << 62


def gib(n):
    return f"{n / (1 << 30):.1f} GiB"


def check_memory(nbytes, what):
    """Refuse a tensor that declares more bytes than this machine's memory, before allocating it."""
    limit = physical_memory()
    if nbytes > limit:
        raise FileFormatError(f"{what} declares {gib(nbytes)} of data, more than this machine's memory ({gib(limit)})")
