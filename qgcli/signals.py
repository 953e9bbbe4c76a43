"""Signals for the CLI: Ctrl-C, SIGTERM and SIGHUP end a command cleanly, even when Python swallows them.

Python runs a signal handler between two bytecodes of the main thread, wherever that is.  If that is a
``__del__`` method or a weakref callback (h5py releases its objects there), the exception the handler
raises is printed as "Exception ignored in ..." and dropped: the command would go on and publish its
output after the user pressed Ctrl-C.  So the handlers here also *record* the signal, and the atomic
writers call :func:`raise_pending` just before they rename a finished file into place.

Inside HDF5 a raised exception is worse than a swallowed one: a KeyboardInterrupt landing in the middle of
an h5py call leaves HDF5's state half-updated, and the clean-up on the way out then fails with an unrelated
error.  Code that calls h5py runs :func:`deferred`: a signal is only recorded there, and raised at the
next :func:`raise_pending` (the streaming loops call it between blocks) or when the region ends.

Imports nothing heavy: ``qgcli --help`` loads it.
"""
import os
import signal
import sys

_pending = []
_deferring = [0]  # depth of nested deferred() regions
_installed = [0]  # install() calls not yet restored


def cli_handlers_installed():
    """Whether the CLI's handlers are in place (this process is a qgcli command, not a library user)."""
    return bool(_installed[0])


class Terminated(BaseException):
    """SIGINT, SIGTERM or SIGHUP, raised like KeyboardInterrupt so that temporary files are removed on the
    way out; ``signum`` and ``name`` say which."""

    def __init__(self, signum):
        self.signum = int(signum)
        self.name = signal.Signals(signum).name
        super().__init__(self.name)

    def describe(self):
        """The CLI's one line for this signal (without "Error: ")."""
        if self.signum == signal.SIGINT:
            return "interrupted; no output was left half-written"
        return f"terminated by {self.name}; no output was left half-written"


def pending():
    """The first signal received and not yet acted on (an int), or None."""
    return _pending[0] if _pending else None


def raise_pending():
    """Raise :class:`Terminated` for a signal whose exception was swallowed; a no-op outside the CLI."""
    if _pending:
        raise Terminated(_pending[0])


class deferred:
    """A region in which a signal is recorded, not raised; on a normal exit a recorded signal is raised.

    Re-entrant, cheap, and a no-op outside the CLI (where Python's own handlers are in place)."""

    def __enter__(self):
        _deferring[0] += 1
        return self

    def __exit__(self, exc_type, exc, tb):
        _deferring[0] -= 1
        if exc_type is None and not _deferring[0]:
            raise_pending()
        return False


def _handler(signum, frame):
    _pending.append(signum)
    if not _deferring[0]:
        raise Terminated(signum)


def install():
    """Handle SIGINT, SIGTERM and SIGHUP (each unless it is ignored, as under ``nohup`` or ``cmd &``) and
    silence "Exception ignored in ..." reports (no traceback reaches the user; ``QGCLI_DEBUG=1`` keeps
    them).  Returns a function that restores the previous state."""
    previous = {}
    _pending.clear()
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        try:
            current = signal.getsignal(sig)
            if current in (signal.SIG_DFL, signal.default_int_handler):
                previous[sig] = signal.signal(sig, _handler)
        except (ValueError, OSError):  # not the main thread: leave signals alone
            pass
    old_hook = sys.unraisablehook

    def hook(unraisable):
        if os.environ.get("QGCLI_DEBUG") and not isinstance(unraisable.exc_value, Terminated):
            old_hook(unraisable)
        # else: a swallowed Terminated is already in _pending; other noise from __del__ is not for users

    sys.unraisablehook = hook
    _installed[0] += 1

    def restore(*, exiting=False):
        """Put the previous handlers back; ``exiting``: the process is about to exit with its result, so
        ignore these signals instead (a signal during the interpreter's exit would otherwise kill it, or
        print a KeyboardInterrupt traceback, after the command has done its work)."""
        for sig, handler in previous.items():
            try:
                signal.signal(sig, signal.SIG_IGN if exiting else handler)
            except (ValueError, OSError):
                pass
        if not exiting:  # at exit, objects freed by the interpreter's shutdown must stay quiet too
            sys.unraisablehook = old_hook
        _pending.clear()
        _deferring[0] = 0
        _installed[0] -= 1

    return restore
