"""Checks on an output target before anything is computed: never an input, never an existing file without
``force``, never a missing or read-only directory.  (Each format's ``check_output`` calls these.)"""
import os

from qgcli.errors import OutputError


def same_file(a, b):
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def refuse_inputs(targets, inputs):
    """Refuse any of ``targets`` that is one of ``inputs``."""
    for target in targets:
        for source in inputs:
            if source and os.path.exists(source) and os.path.exists(target) and same_file(source, target):
                raise OutputError(f"{target} is also an input; qgcli never overwrites its inputs", operand="--output")


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
