"""qgcli: quantization-gradient analysis on saved tensors.

The public ops live in :mod:`qgcli.ops`; they are re-exported here lazily so that
``import qgcli`` (and so ``qgcli --help``) does not import NumPy.  :func:`qgcli.run` runs any command from
Python (:mod:`qgcli.cli.api`).
"""

__version__ = "0.1.0"

__all__ = ["__version__", "ops", "run"]


def __getattr__(name):
    if name == "run":  # qgcli.run("fakequant-grad", "run.h5", output="out.h5"): qgcli.cli.api
        from qgcli.cli.api import run

        return run
    if name == "ops":
        import importlib

        return importlib.import_module("qgcli.ops")
    from qgcli import ops

    try:
        return getattr(ops, name)
    except AttributeError:
        raise AttributeError(f"module 'qgcli' has no attribute {name!r}") from None
