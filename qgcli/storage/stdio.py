"""Standard input and output: ``-`` as a SPEC or BUNDLE reads an .npy, .npz or .h5 stream (its format told
by its magic bytes, :func:`qgcli.storage.formats.sniff`); ``-o -`` writes an .npz stream."""
import contextlib
import io as _io
import sys

from qgcli.errors import FileFormatError
from qgcli.signals import raise_pending
from qgcli.storage import npz
from qgcli.storage.checks import gib, physical_memory
from qgcli.storage.sinks import FlatSink


class Stdin:
    """Standard input read once, on first use, and kept (several operands may come from one stream).

    At most ``limit`` bytes are held (default: a quarter of the machine's memory, as --memory-limit): a
    longer stream is refused with its size so far, not read to the end."""

    def __init__(self, stream=None, limit=None):
        self._stream = stream
        self._limit = limit
        self._data = None

    def read(self):
        if self._data is None:
            stream = self._stream if self._stream is not None else sys.stdin.buffer
            limit = self._limit if self._limit is not None else physical_memory() // 4
            chunks, size = [], 0
            while True:
                chunk = stream.read(min(1 << 24, limit + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise FileFormatError(f"stdin holds more than {gib(limit)} (the memory limit); "
                                          "pass the file by name or raise --memory-limit")
            self._data = b"".join(chunks)
            if not self._data:
                raise FileFormatError("stdin is empty (expected an .npy, .npz or .h5 stream)")
        return self._data


class StdoutFormat:
    """``-o -``: every output as one .npz stream on stdout."""

    name, title, suffixes, magic = "stdout", "stdout", (), None

    def check_output(self, dest, *, inputs=(), force=False, names=()):
        pass

    def write(self, dest, arrays, *, attrs, compression=None, stdout=None):
        with self._stream(stdout) as put:
            for key, array in arrays.items():
                put(key, array)

    @contextlib.contextmanager
    def group_sink(self, dest, *, compression=None):
        with self._stream(None) as put:
            yield FlatSink(put)

    @contextlib.contextmanager
    def _stream(self, stdout):
        """Built in memory, written whole at the end: a failure leaves stdout untouched."""
        buf = _io.BytesIO()
        with npz.writing(buf) as put:
            yield put
        out = stdout if stdout is not None else sys.stdout.buffer
        raise_pending()
        write_all(out, buf.getvalue())


def write_all(stream, data):
    """Write all of ``data`` to a binary stream and flush it.  A pipe whose reader went away can take part of a
    large write and return a short count (no error yet); the next write then raises BrokenPipeError, which the
    CLI turns into exit 141 (:mod:`qgcli.cli.app`), where one ``write`` would silently end the output early."""
    view = memoryview(data)
    while view:
        written = stream.write(view)
        view = view[len(view) if written is None else written:]
    stream.flush()


FORMAT = StdoutFormat()
