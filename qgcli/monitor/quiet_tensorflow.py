"""Import TensorFlow for qgcli without its start-up noise on stderr.

The ``tensorflow`` wheel (the one ``qgcli[tensorflow]`` installs: tf_keras, which TF Model Optimization needs,
requires it) is built with CUDA support, and on a machine with no NVIDIA driver or device its C++ runtime says
so on every start, at ERROR level: ``failed call to cuInit: ... UNKNOWN ERROR (303)``, with a few more lines
(no CUDA drivers, the CPU instruction banner, oneDNN's note).  None of them is about the user's model, and
``TF_CPP_MIN_LOG_LEVEL=3``, the only level that hides the cuInit line, would hide TensorFlow's real errors
too.  So when qgcli is the one that imports TensorFlow, the import and the device scan write to a temporary
file in place of descriptor 2, and every line but the known start-up ones (:data:`NOISE`) is passed on.  A
program that imported TensorFlow itself has its own stderr: nothing is filtered then.
"""
import contextlib
import os
import re
import sys
import tempfile

from qgcli.errors import QgcliError

#: TensorFlow's start-up lines that say nothing about the model (matched anywhere in the line).
NOISE = re.compile(
    r"failed call to cuInit|Could not find cuda drivers|Unable to register cu(?:DNN|FFT|BLAS) factory"
    r"|cpu_feature_guard\.cc|^To enable the following instructions:|oneDNN custom operations are on"
    r"|All log messages before absl::InitializeLog\(\) is called|TF-TRT Warning: Could not find TensorRT"
)


def without_noise(text):
    """``text`` without the lines :data:`NOISE` matches (line ends kept)."""
    return "".join(line for line in text.splitlines(keepends=True) if not NOISE.search(line))


@contextlib.contextmanager
def _stderr_filtered():
    """Descriptor 2 goes to a temporary file for the block; then what was written there, less the noise."""
    try:
        fd = sys.__stderr__.fileno() if sys.__stderr__ is not None else 2
    except (AttributeError, ValueError, OSError):
        fd = 2
    for stream in (sys.stderr, sys.__stderr__):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), fd)
        try:
            yield
        finally:
            for stream in (sys.stderr, sys.__stderr__):
                with contextlib.suppress(AttributeError, ValueError, OSError):
                    stream.flush()
            os.dup2(saved, fd)
            os.close(saved)
            held.seek(0)
            kept = without_noise(held.read().decode("utf-8", "replace"))
            if kept:
                os.write(fd, kept.encode("utf-8"))


def import_tensorflow(needed_by):
    """The ``tensorflow`` module; imported (with its devices scanned) quietly when no one has imported it yet.
    ``needed_by`` names the qgcli module for the error a missing TensorFlow gives."""
    tf = sys.modules.get("tensorflow")
    if tf is not None:
        return tf
    try:
        with _stderr_filtered():
            import tensorflow as tf

            tf.config.list_physical_devices()  # the device scan, where cuInit fails without a GPU
    except ImportError:
        raise QgcliError(f"{needed_by} needs TensorFlow: pip install 'qgcli[tensorflow]'") from None
    return tf
