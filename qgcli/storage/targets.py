"""Checks on an output target before anything is computed: never an input, never an existing file without
``force``, never a missing or read-only directory.  (Each format's ``check_output`` calls these.)"""
import os

from qgcli.errors import OutputError
from qgcli.storage import atomic


def same_file(a, b):
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def refuse_inputs(targets, inputs, option="--output"):
    """Refuse any of ``targets`` that is one of ``inputs``, or lies inside an input that is a directory (a
    Zarr store: ``-o in.zarr/x.h5`` would add a file to it)."""
    for target in targets:
        for source in inputs:
            if not source or not os.path.exists(source):
                continue
            if os.path.exists(target) and same_file(source, target):
                raise OutputError(f"{target} is also an input; qgcli never overwrites its inputs", operand=option)
            if os.path.isdir(source) and _within(target, source):
                raise OutputError(f"{target} lies inside the input {source}; qgcli never writes into its inputs",
                                  operand=option)


def _within(target, directory):
    """Whether ``target`` (existing or not) would land inside ``directory``, through any links."""
    base = os.path.realpath(directory)
    real = os.path.realpath(target)
    return real.startswith(base.rstrip(os.sep) + os.sep)


def check_file(dest, *, inputs=(), force=False):
    """The checks for a one-file output (.h5, .npz, .npy, .safetensors)."""
    refuse_inputs([dest], inputs)
    parent = os.path.dirname(os.path.abspath(dest))
    if not os.path.isdir(parent):
        raise OutputError(f"directory {parent} does not exist", operand="--output")
    if os.path.isdir(dest):
        raise OutputError(f"{dest} is a directory; end it with / to write one .npy per output", operand="--output")
    if os.path.lexists(dest) and not force:
        raise OutputError(f"{dest} exists; use --force to replace it", operand="--output")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"directory {parent} is not writable", operand="--output")
    atomic.checked(dest, force)
