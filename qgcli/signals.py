"""Signals for the CLI: Ctrl-C, SIGTERM and SIGHUP end a command cleanly, even when Python swallows them.

Python runs a signal handler between two bytecodes of the main thread, wherever that is.  If that is a
``__del__`` method or a weakref callback (h5py releases its objects there), the exception the handler
raises is printed as "Exception ignored in ..." and dropped: the command would go on and publish its
output after the user pressed Ctrl-C.  So the handlers here also *record* the signal, and the atomic
writers call :func:`raise_pending` just before they rename a finished file into place.

Imports nothing heavy: ``qgcli --help`` loads it.
"""
import os
import signal
import sys

_pending = []


class Terminated(BaseException):
    """SIGINT, SIGTERM or SIGHUP, raised like KeyboardInterrupt so that temporary files are removed on the
    way out; ``signum`` and ``name`` say which."""

    def __init__(self, signum):
        self.signum = int(signum)
        self.name = signal.Signals(signum).name
        super().__init__(self.name)


def pending():
    """The first signal received and not yet acted on (an int), or None."""
    return _pending[0] if _pending else None


def raise_pending():
    """Raise :class:`Terminated` for a signal whose exception was swallowed; a no-op outside the CLI."""
    if _pending:
        raise Terminated(_pending[0])


def _handler(signum, frame):
    _pending.append(signum)
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

    def restore():
        for sig, handler in previous.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, OSError):
                pass
        sys.unraisablehook = old_hook
        _pending.clear()

    return restore
