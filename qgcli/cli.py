"""The ``qgcli`` command group: error handling and command registration.

Each command is a short adapter (parse -> load -> one op call -> save -> render) living in
``qgcli/commands/``.  Errors a user can cause end as one line on stderr and exit code 2; runtime failures
(a full disk, say) exit 1; Ctrl-C exits 130, SIGTERM 143 and SIGHUP 129, each after removing temporary
files.  No traceback reaches the user unless QGCLI_DEBUG=1.
"""
import os
import signal
import sys

import click

from qgcli import __version__

_EPILOG = """\b
Examples:
  qgcli fakequant-grad samples/per_channel.h5 -o grads.h5
  qgcli fakequant samples/notebook.h5 --num-bits 2 -o - | qgcli inspect -
  qgcli bn-grad samples/batch_norm.h5 -o bn_grads.h5 --json
"""


class QgcliGroup(click.Group):
    """A click group that turns every failure into one line on stderr and a meaningful exit code."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        restore = _trap_termination()
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except Terminated as exc:
            if exc.signum == signal.SIGINT:
                _fail("interrupted; no output was left half-written", 130)
            _fail(f"terminated by {exc.name}; no output was left half-written", 128 + exc.signum)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            _fail(exc.format_message(), 2, exc.ctx)
        except click.ClickException as exc:
            _fail(exc.format_message(), exc.exit_code)
        except (click.exceptions.Abort, KeyboardInterrupt):
            _fail("interrupted; no output was left half-written", 130)
        except BrokenPipeError:
            # The reader went away (e.g. `| head`); stop quietly, as Unix tools do.
            _silence_stdout()
            sys.exit(1)
        except ValueError as exc:
            from qgcli.errors import QgcliError

            if not isinstance(exc, QgcliError):
                _internal(exc)
            _fail(str(exc), 2)
        except MemoryError:
            _fail("out of memory (try a smaller tensor or --device gpu)", 1)
        except OSError as exc:
            name = f" {exc.filename}" if getattr(exc, "filename", None) else ""
            _fail(f"I/O error{name}: {exc.strerror or exc}", 1)
        except Exception as exc:  # noqa: BLE001 - the last line of defence: no traceback for users
            _internal(exc)
        finally:
            restore()
        if isinstance(rv, int):
            sys.exit(rv)
        sys.exit(0)

    def invoke(self, ctx):
        # Ctrl-C inside a command: click would print an empty line and raise Abort; one line is ours to print.
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Terminated(signal.SIGINT) from None


class Terminated(BaseException):
    """SIGTERM, SIGHUP (or SIGINT inside a command), raised like KeyboardInterrupt so that temporary files
    are removed on the way out."""

    def __init__(self, signum):
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(self.name)


def _trap_termination():
    """Turn SIGTERM/SIGHUP (``timeout``, a closed terminal, a job scheduler) into :class:`Terminated`;
    returns a function that puts the previous handlers back."""

    def raise_terminated(signum, frame):
        raise Terminated(signum)

    previous = {}
    for sig in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)):
        if sig is None:
            continue
        try:
            if signal.getsignal(sig) in (signal.SIG_DFL, None):  # an ignored signal stays ignored (nohup)
                previous[sig] = signal.signal(sig, raise_terminated)
        except (ValueError, OSError):  # not the main thread: leave signals alone
            pass

    def restore():
        for sig, handler in previous.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, OSError):
                pass

    return restore


def _silence_stdout():
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _fail(message, code, ctx=None):
    message = " ".join(str(message).split())  # one line, whatever the source
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None and code == 2 else ""
    click.echo(f"Error: {message}{hint}", err=True)
    sys.exit(code)


def _internal(exc):
    if os.environ.get("QGCLI_DEBUG"):
        raise exc
    _fail(f"internal error: {type(exc).__name__}: {exc} (set QGCLI_DEBUG=1 for a traceback, and please report it)", 1)


@click.group(cls=QgcliGroup, epilog=_EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qgcli")
def main():
    """Quantization-gradient analysis on saved tensors (.npy, .npz, .h5).

    TensorFlow-exact fake-quant and batch-norm gradients, gradient estimators, plots and reports,
    on the CPU (NumPy) or the GPU (CuPy). Results go to files or stdout; diagnostics to stderr.
    """


def _register():
    from qgcli.commands import fakequant

    main.add_command(fakequant.fakequant)
    main.add_command(fakequant.fakequant_grad)
    import importlib

    # Optional command modules added by later features register themselves here.
    for module_name, names in (
        ("qgcli.commands.batch_norm", ("bn_grad",)),
        ("qgcli.commands.plot", ("plot",)),
        ("qgcli.commands.inspect", ("inspect", "report")),
        ("qgcli.commands.nudge", ("nudge", "compare_semantics")),
    ):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        for name in names:
            if hasattr(module, name):
                main.add_command(getattr(module, name))


_register()
