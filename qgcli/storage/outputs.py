"""Writing a run's results: tensor outputs with their provenance, figures (written by :mod:`qgcli.storage.figures`).

Every write is atomic (temporary file + rename) and checked first: an existing output needs ``force``, an
input is never overwritten.  Nothing heavy is imported at module level.
"""
import os
import sys

from qgcli.backend import to_numpy
from qgcli.errors import OutputError, RuntimeFailure
from qgcli.storage import atomic
from qgcli.storage.figures import save_figure
from qgcli.storage.targets import refuse_inputs

FIGURE_SUFFIXES = (".png", ".svg", ".pdf")


def write_outputs(outputs, dest, *, operands, force, attrs, compression=None):
    """Check the target, then write every output (NumPy arrays) atomically."""
    from qgcli.storage import io, provenance

    io.check_output(dest, inputs=operands.input_paths(), force=force, names=list(outputs))
    attrs = provenance.attributes(attrs)
    try:
        io.save_outputs({k: to_numpy(v) for k, v in outputs.items()}, dest, attrs=attrs, compression=compression)
    except BrokenPipeError:
        raise  # `-o - | head`: the reader went away; the CLI stops quietly, as Unix tools do
    except OSError as exc:
        raise RuntimeFailure(f"cannot write {dest}: {exc.strerror or exc}") from None


def check_figure_output(dest, *, inputs=(), force=False, option="--output", format=None):
    """Refuse a figure path that has no .png/.svg/.pdf suffix (unless ``format`` names one), is an input,
    exists without ``force``, is a directory or lies in a missing or read-only directory (the rules of
    ``qgcli.storage.targets.check_file``); ``-`` (stdout) is refused when stdout is a terminal."""
    if not dest:
        raise OutputError("a figure needs a file name ending in .png, .svg or .pdf, or - for stdout", operand=option)
    if dest == "-":
        if sys.stdout.isatty():
            raise OutputError("refusing to write a binary figure to a terminal; redirect stdout or name a file",
                              operand=option)
        return
    if format is None and not dest.lower().endswith(FIGURE_SUFFIXES):
        ext = os.path.splitext(dest)[1] or "no extension"
        raise OutputError(f"cannot tell the figure format from {ext!r} in {dest}; use .png, .svg or .pdf",
                          operand=option)
    refuse_inputs([dest], inputs, option)
    if os.path.isdir(dest):
        raise OutputError(f"{dest} is a directory", operand=option)
    parent = os.path.dirname(os.path.abspath(dest))
    if not os.path.isdir(parent):
        raise OutputError(f"directory {parent} does not exist", operand=option)
    if os.path.exists(dest) and not force:
        raise OutputError(f"{dest} exists; use --force to replace it", operand=option)
    if not os.access(parent, os.W_OK):
        raise OutputError(f"directory {parent} is not writable", operand=option)
    atomic.checked(dest, force)


def save_checked(fig, dest, dpi, format=None):
    """Save ``fig`` (checked path, or ``-``: stdout, PNG unless ``format`` says otherwise) atomically; a
    failing disk is a runtime error (exit 1)."""
    if dest == "-":
        from qgcli.signals import raise_pending

        raise_pending()
        return save_figure(fig, sys.stdout.buffer, dpi=dpi, format=format or "png")
    try:
        return save_figure(fig, dest, dpi=dpi, format=format)
    except OSError as exc:
        raise RuntimeFailure(f"cannot write {dest}: {exc.strerror or exc}") from None
