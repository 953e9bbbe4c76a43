"""The ``qgcli`` command group: error handling and command registration.

Each command is a short adapter (parse -> load -> one op call -> save -> render) living in
``qgcli/cli/commands/``.  Errors a user can cause end as one line on stderr and exit code 2; runtime failures
(a full disk, say) exit 1; Ctrl-C exits 130, SIGTERM 143 and SIGHUP 129, each after removing temporary
files.  No traceback reaches the user unless QGCLI_DEBUG=1.
"""
import gc
import os
import signal
import sys

import click

from qgcli import __version__
from qgcli.errors import RuntimeFailure
from qgcli.signals import Terminated, install as install_signal_handlers, pending, raise_pending

_EPILOG = """\b
Examples:
  qgcli fakequant-grad samples/per_channel.h5 -o grads.h5
  qgcli fakequant samples/notebook.h5 --num-bits 2 -o - | qgcli inspect -
  qgcli bn-grad samples/batch_norm.h5 -o bn_grads.h5 --json
"""


#: Click 8.2+ raises this UsageError for a group or command called without arguments; click 8.1 prints the
#: help itself and exits 0 (an empty tuple catches nothing).
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class QgcliContext(click.Context):
    """A command's context: the library's usage errors (:class:`qgcli.errors.UsageProblem`) become click's, so
    that they read as click's own and point at the command's ``--help``."""

    def invoke(self, callback, *args, **kwargs):
        from qgcli.errors import OptionError, UsageProblem

        try:
            return super().invoke(callback, *args, **kwargs)
        except OptionError as exc:
            raise click.BadParameter(exc.message, ctx=self, param_hint=exc.param_hint) from None
        except UsageProblem as exc:
            raise click.UsageError(exc.message, ctx=self) from None


def _in_qgcli_context(command):
    """``command`` (and, for a group, its subcommands) run in a :class:`QgcliContext`."""
    command.context_class = QgcliContext
    for sub in getattr(command, "commands", {}).values():
        _in_qgcli_context(sub)
    return command


class QgcliGroup(click.Group):
    """A click group that turns every failure into one line on stderr and a meaningful exit code."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        restore = install_signal_handlers()
        native = sys.modules.get("qgcli.ops.native")
        if native is not None:  # in one process (tests, qgcli.run) a command notes its own fallback only
            native.take_fallback_note()
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            _note_fallback()
            raise_pending()  # a signal Python swallowed (in a __del__) still ends in exit 128 + N
        except Terminated as exc:
            _fail(exc.describe(), 128 + exc.signum)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except _NO_ARGS_IS_HELP as exc:
            # `qgcli` (or `qgcli plot`) alone: click 8.2+ shows the help as this error (on stderr, exit 2);
            # click's own display keeps its lines, which the one-line handler below would flatten.
            exc.show()
            _exit(exc.exit_code)
        except click.UsageError as exc:
            _fail(exc.format_message(), 2, exc.ctx)
        except click.ClickException as exc:
            _fail(exc.format_message(), exc.exit_code)
        except RuntimeFailure as exc:
            _fail(str(exc), exc.exit_code)
        except (click.exceptions.Abort, KeyboardInterrupt):
            _fail("interrupted; no output was left half-written", 130)
        except (BrokenPipeError, _ClosedPipe):
            _closed_pipe()
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
            restore(exiting=args is None)  # args None: the real command line, not an in-process caller
            if args is None:
                # The process is about to end: spare it the collector's last passes over every object
                # (a second after Dask is imported, enough to break "SIGTERM ends it within a second").
                gc.freeze()
        _exit(rv if isinstance(rv, int) else 0)

    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in self.commands and name in COMMANDS:  # imported when first asked for
            module, attr = COMMANDS[name]
            self.add_command(_in_qgcli_context(getattr(_command_module(module), attr)))
        return super().get_command(ctx, name)

    def invoke(self, ctx):
        # Ctrl-C inside a command: click would print an empty line and raise Abort; one line is ours to print.
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Terminated(signal.SIGINT) from None
        except BrokenPipeError:  # before click's own handler, which would exit 1
            raise _ClosedPipe() from None


#: The exit code when the reader of stdout went away (``| head``): 128 + SIGPIPE, what a shell reports for a
#: Unix tool that SIGPIPE ended; nothing is printed (docs/guarantees.md).
CLOSED_PIPE = 141


class _ClosedPipe(Exception):
    """A BrokenPipeError on its way out of a command (click would turn the OSError into exit 1)."""


def _closed_pipe():
    """The reader of stdout went away, whatever was being written (an ``-o -`` stream, a figure, a table):
    stop quietly with :data:`CLOSED_PIPE`."""
    _silence_stdout()
    _exit(CLOSED_PIPE)


def _silence_stdout():
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _fail(message, code, ctx=None):
    from qgcli.report.text import one_line

    signum = pending()
    if signum is not None and code != 128 + signum:
        # The error is the signal's doing: raised inside an import or a class body, Python reports it as
        # another exception ("Error calling __set_name__ ..."), and the command would say "internal error".
        message, code, ctx = Terminated(signum).describe(), 128 + signum, None
    # One line, whatever the source; a name from a file cannot send control characters to the terminal.
    message = one_line(message)
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None and code == 2 else ""
    click.echo(f"Error: {message}{hint}", err=True)
    _exit(code)


def _exit(code):
    try:  # what is still buffered for stdout: a reader that went away is found here, not at interpreter exit
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
        code = CLOSED_PIPE if code == 0 else code
    except (OSError, ValueError):
        pass
    atomic = sys.modules.get("qgcli.storage.atomic")
    if atomic is not None and atomic.hdf5_left_open():
        # A full disk left HDF5 unable to close the file it was writing (its temporary file is already
        # removed); HDF5's own exit handler would then crash with SIGSEGV, so leave without it.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


def _note_fallback():
    """One note on stderr when an op of this command ran on the NumPy kernels because the compiled ones are
    missing (qgcli.ops.native.take_fallback_note); a command that ran no op never imported that module."""
    native = sys.modules.get("qgcli.ops.native")
    note = native.take_fallback_note() if native is not None else None
    if note:
        click.echo(f"note: {note}", err=True)


def _show_version(ctx, param, value):
    """``qgcli --version``: the version and the kernels the ops run on (compiled C, or NumPy and why)."""
    if not value or ctx.resilient_parsing:
        return
    from qgcli.ops import native

    click.echo(f"qgcli, version {__version__}\nkernels: {native.kind()}")
    ctx.exit()


def _internal(exc):
    if os.environ.get("QGCLI_DEBUG"):
        raise exc
    _fail(f"internal error: {type(exc).__name__}: {exc} (set QGCLI_DEBUG=1 for a traceback, and please report it)", 1)


@click.group(cls=QgcliGroup, epilog=_EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_show_version,
              help="Show the version and the kernels in use, and exit.")
def main():
    """Quantization-gradient analysis on saved tensors (.npy, .npz, .h5, .safetensors, PyTorch .pt, Zarr).

    TensorFlow-exact fake-quant and batch-norm gradients; PyTorch's, torchao's, MX, NVFP4 and ONNX
    QuantizeLinear fake quant, bit for bit with each framework; gradient estimators, plots and reports, on the
    CPU (NumPy) or the GPU (CuPy). Results go to files or stdout; diagnostics to stderr.

    An operand is a SPEC: FILE.npy, FILE.npz:KEY, FILE.h5:DATASET, FILE.safetensors:KEY, FILE.pt:KEY,
    STORE.zarr, - (stdin) or a literal number or list. Whole models: capture a training step into a run
    file from Python (qgcli.capture.torch, qgcli.capture.tensorflow; see docs/capture.md), then verify,
    report or plot every layer.
    """


#: Command name -> (module in qgcli.cli.commands, attribute).  A command's run imports its own module only:
#: importing all nine cost ~30 ms of every start-up.
COMMANDS = {
    "fakequant": ("fakequant", "fakequant"), "fakequant-grad": ("fakequant", "fakequant_grad"),
    "bn-grad": ("batch_norm", "bn_grad"), "plot": ("plot", "plot"), "inspect": ("inspect", "inspect"),
    "report": ("report", "report"), "nudge": ("nudge", "nudge"),
    "compare-semantics": ("compare_semantics", "compare_semantics"), "verify": ("verify", "verify"),
    "trend": ("trend", "trend"), "doctor": ("doctor", "doctor"), "diff": ("diff", "diff"),
}


def _command_module(module):
    # Spelled out, one import each, so that the import graph (tests/test_import_cycles.py) sees them.
    if module == "fakequant":
        from qgcli.cli.commands import fakequant as found
    elif module == "batch_norm":
        from qgcli.cli.commands import batch_norm as found
    elif module == "plot":
        from qgcli.cli.commands import plot as found
    elif module == "inspect":
        from qgcli.cli.commands import inspect as found
    elif module == "report":
        from qgcli.cli.commands import report as found
    elif module == "nudge":
        from qgcli.cli.commands import nudge as found
    elif module == "compare_semantics":
        from qgcli.cli.commands import compare_semantics as found
    elif module == "verify":
        from qgcli.cli.commands import verify as found
    elif module == "diff":
        from qgcli.cli.commands import diff as found
    elif module == "trend":
        from qgcli.cli.commands import trend as found
    elif module == "doctor":
        from qgcli.cli.commands import doctor as found
    else:
        raise KeyError(module)
    return found

