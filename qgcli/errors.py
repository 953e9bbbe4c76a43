"""One error family for the whole library.

Every error a user can cause is a :class:`QgcliError` (a ``ValueError``) whose message names the
operand, the file or the attribute at fault; the CLI turns it into a one-line message and exit code 2.
"""


class QgcliError(ValueError):
    """Bad input: an operand, a file, an attribute or an option that qgcli cannot use."""

    def __init__(self, message, *, operand=None):
        self.operand = operand
        super().__init__(f"{operand}: {message}" if operand else message)


class OperandError(QgcliError):
    """An operand has the wrong shape, dtype or value."""


class FileFormatError(QgcliError):
    """A file cannot be read as the tensor container its name promises."""


class OutputError(QgcliError):
    """The output path cannot be written safely (exists, is an input, directory missing...)."""


class DeviceError(QgcliError):
    """The requested device (GPU) is not available."""


class UsageProblem(QgcliError):
    """Options that cannot go together, or that do not apply here.  The CLI prints it as click prints a usage
    error, pointing at the command's ``--help``; ``message`` is the text without any prefix."""

    def __init__(self, message):
        self.message, self.operand = message, None
        ValueError.__init__(self, message)


class OptionError(UsageProblem):
    """One option's (or argument's) value that qgcli cannot use; ``param_hint`` names it (``'--axis'``).
    The text reads as click's own: ``Invalid value for '--axis': ...``."""

    def __init__(self, message, *, param_hint=None):
        self.message, self.param_hint, self.operand = message, param_hint, None
        hint = " / ".join(param_hint) if isinstance(param_hint, (list, tuple)) else param_hint
        ValueError.__init__(self, f"Invalid value for {hint}: {message}" if hint else f"Invalid value: {message}")


class RuntimeFailure(Exception):
    """A failure that is nobody's bad input (a full disk, a cluster that stopped answering): exit code 1."""

    exit_code = 1
