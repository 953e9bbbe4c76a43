"""``python -m qgcli`` started from the repository checkout, as many tests do (the subprocess's cwd or
PYTHONPATH is the checkout). CI installs qgcli into a fresh venv and runs the tests from a clean checkout, which
holds no compiled kernels: such a command runs on the NumPy kernels (the same bits) and ends with a note saying
the kernels are not built (qgcli.ops.native.take_fallback_note). Tests that read a command's terminal or stderr
whole choose the NumPy kernels deliberately there, as tests/conftest.py does in-process."""
import importlib.machinery
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def kernels_built():
    """Whether the checkout holds compiled kernels this Python can load."""
    ops = ROOT / "qgcli" / "ops"
    return any((ops / f"_kernels{suffix}").exists() for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def checkout_env(env=None):
    """``env`` (default: this process's environment) for a command run from the checkout: QGCLI_NATIVE=0 where
    the checkout has no kernels and nobody chose (the note's own test leaves QGCLI_NATIVE unset)."""
    env = dict(os.environ if env is None else env)
    if "QGCLI_NATIVE" not in env and not kernels_built():
        env["QGCLI_NATIVE"] = "0"
    return env
