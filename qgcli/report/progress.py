"""Progress display on stderr for work that may take more than about a second.

A :class:`Progress` shows nothing at first; only when the work is still running after ``delay`` seconds
(default 1 s, ``QGCLI_PROGRESS_DELAY`` overrides it) does a rich progress bar appear on stderr, and it is
removed when the work ends.  It stays off when stderr is not a terminal (pipes, CI logs, files), with
``--quiet``, or with ``QGCLI_NO_PROGRESS=1``: progress never mixes with data on stdout or with logs.

rich is imported only when the bar is actually shown, so short commands pay nothing for it.

>>> with Progress("reading", total=3, enabled=False) as p:
...     for _ in range(3):
...         p.advance()
>>> p.completed
3
"""
import os
import sys
import threading

from qgcli.report.text import printable

DEFAULT_DELAY = 1.0


def progress_enabled(quiet=False, stream=None):
    """True when a progress bar may be drawn on ``stream`` (stderr): a terminal, not ``--quiet``."""
    if quiet or os.environ.get("QGCLI_NO_PROGRESS", "") not in ("", "0"):
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # closed or replaced streams
        return False


def _delay_from_env():
    try:
        return max(0.0, float(os.environ.get("QGCLI_PROGRESS_DELAY", DEFAULT_DELAY)))
    except ValueError:
        return DEFAULT_DELAY


class Progress:
    """A context manager for one piece of work: ``advance(n)``, ``update(description=..., total=...)``.

    Parameters
    ----------
    description : str
        What is being done ("reading inputs").
    total : float, optional
        Units of work (elements, bytes, steps); None for a spinner without a bar.
    unit : {"steps", "bytes"}
        How to print the counts.
    quiet : bool
        ``--quiet`` was given: show nothing.
    enabled : bool, optional
        Force the display on or off (default: :func:`progress_enabled`).
    delay : float, optional
        Seconds of silence before the bar appears (default 1, or ``QGCLI_PROGRESS_DELAY``).
    console : rich.console.Console, optional
        Where to draw (default: a console on stderr).

    Examples
    --------
    >>> with Progress("steps", total=2, enabled=False) as p:
    ...     p.update(description="half-way")
    ...     p.advance(2)
    >>> p.description, p.completed
    ('half-way', 2)
    """

    def __init__(self, description, total=None, *, unit="steps", quiet=False, enabled=None, delay=None,
                 console=None):
        self.description = description
        self.total = total
        self.completed = 0
        self.unit = unit
        self.enabled = progress_enabled(quiet) if enabled is None else bool(enabled)
        self.delay = _delay_from_env() if delay is None else float(delay)
        self.shown = False
        self._console = console
        self._lock = threading.Lock()
        self._timer = None
        self._rich = None
        self._task = None

    def __enter__(self):
        if self.enabled:
            if self.delay <= 0:
                self._show()
            else:
                self._timer = threading.Timer(self.delay, self._show)
                self._timer.daemon = True
                self._timer.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Stop the timer and remove the bar (safe to call twice)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        with self._lock:
            if self._rich is not None:
                self._rich.stop()
                self._rich = None
            self.enabled = False

    def advance(self, amount=1):
        with self._lock:
            self.completed += amount
            if self._rich is not None:
                self._rich.update(self._task, completed=self.completed)

    def update(self, *, description=None, total=None, completed=None):
        with self._lock:
            if description is not None:
                self.description = description
            if total is not None:
                self.total = total
            if completed is not None:
                self.completed = completed
            if self._rich is not None:
                self._rich.update(self._task, description=printable(self.description), total=self.total,
                                  completed=self.completed)

    def _show(self):
        with self._lock:
            if not self.enabled or self._rich is not None:
                return
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress as RichProgress,
                                       SpinnerColumn, TextColumn, TimeElapsedColumn)

            console = self._console if self._console is not None else Console(stderr=True)
            count = DownloadColumn() if self.unit == "bytes" else MofNCompleteColumn()
            # A description may hold a file's name: plain text (no markup), control characters escaped.
            self._rich = RichProgress(SpinnerColumn(), TextColumn("{task.description}", markup=False), BarColumn(), count,
                                      TimeElapsedColumn(), console=console, transient=True)
            self._task = self._rich.add_task(printable(self.description), total=self.total, completed=self.completed)
            self._rich.start()
            self.shown = True
