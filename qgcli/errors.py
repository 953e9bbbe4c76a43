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
