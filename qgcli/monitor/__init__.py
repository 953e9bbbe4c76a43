"""Watching a training run: a monitor you leave on, and the history file it writes.

:mod:`qgcli.monitor.torch` (``monitor(model, path, every=10, optimizer=None)``) and :mod:`qgcli.monitor.keras`
(a tf_keras callback, and a context for custom loops) record, every N steps, a small fixed set of statistics
per quantizer and batch norm into a history (:mod:`qgcli.monitor.history`: SQLite, readable without qgcli);
:mod:`qgcli.monitor.trends` turns a history into per-layer series and events (``qgcli trend``) and
:mod:`qgcli.monitor.doctor` into findings (``qgcli doctor``).  Each imports its framework only when called.
"""
