"""The command line: click lives here and nowhere else in qgcli.

``main`` is the ``qgcli`` command group (:mod:`qgcli.cli.app`); each command is a short adapter in
:mod:`qgcli.cli.commands` that parses its options into a job, runs it through the library and renders the
result.
"""
from qgcli.cli.app import QgcliGroup, main

__all__ = ["QgcliGroup", "main"]
