"""A run's summary: built JSON-safe, printed as JSON on stdout (``--json``) or rendered with rich on stderr.

Kept free of heavy imports at module level so that ``qgcli --help`` stays fast.
"""
import errno
import os
import sys
from contextvars import ContextVar

from qgcli.errors import UsageProblem
from qgcli.storage.dtypes import dtype_name

#: Set by :func:`qgcli.run` (:mod:`qgcli.cli.api`): a list that takes the JSON documents a command would print.
CAPTURED = ContextVar("qgcli_captured_documents", default=None)


#: The share of a quantizer's elements with a non-zero upstream gradient whose input gradient is exactly 0 above
#: which a verdict says so (torchao's groups): most of what the loss asks of the tensor then never reaches it,
#: whatever else the verdict finds. Half, like the other verdict limits a round number a reader can check:
#: clipping or an underflowing backward (float8's dy * s) above it is no longer a tail but the rule.
ZERO_GRADIENT_LIMIT = 0.5


def zero_gradient(dx, dy, xp):
    """``(share, zeroed, live)``: of the ``live`` elements whose upstream gradient ``dy`` is finite and non-zero,
    the ``zeroed`` ones whose input gradient ``dx`` is exactly 0, and their share (0.0 with no live element)."""
    live = (dy != 0) & xp.isfinite(dy)
    n = int(live.sum())
    z = int((live & (dx == 0)).sum())
    return (z / n if n else 0.0), z, n


def describe_arrays(arrays):
    """Shape and dtype of each array, read from the array itself: a CuPy array is not copied to the host."""
    import numpy as np

    def describe(a):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):  # a Python scalar or list
            a = np.asarray(a)
        return {"shape": list(a.shape), "dtype": dtype_name(a.dtype)}

    return {name: describe(a) for name, a in arrays.items()}


def nonfinite_notes(arrays, xp=None):
    """One note per array (name -> array) holding NaN or +-inf, with how many of each: what a report leaves
    out of its finite ranges or clips, said rather than silent."""
    import numpy as np

    xp = np if xp is None else xp
    notes = []
    for name, a in arrays.items():
        if a is None or getattr(a, "dtype", np.dtype("f4")).kind != "f":
            continue
        a = xp.asarray(a)
        counts = [(int(xp.isnan(a).sum()), "NaN"), (int((a == np.inf).sum()), "+inf"),
                  (int((a == -np.inf).sum()), "-inf")]
        found = ", ".join(f"{n} {what}" for n, what in counts if n)
        if found:
            notes.append(f"{name} hold non-finite values: {found} (of {int(a.size)} elements)")
    return notes


def json_safe(value):
    """Replace NaN/inf floats (not valid JSON) by None, recursively."""
    import math

    # Exact built-in types first (a run file's summary holds hundreds of thousands of values); subclasses
    # such as NumPy's float64 take the general path below, as before.
    t = type(value)
    if t is str or t is int or t is bool or value is None:
        return value
    if t is list or t is tuple:
        isfinite = math.isfinite
        try:
            if all(map(isfinite, value)):  # every item a finite number (per-channel statistics): unchanged
                return list(value)
        except TypeError:  # an item that is no number
            pass
        return [v if (type(v) is float and isfinite(v)) or type(v) is int or type(v) is str else json_safe(v)
                for v in value]
    if t is dict:
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def render_closing_lines(console, s):
    """The notes and the "wrote OUTPUTS to FILE" line that end a command's summary (names already printable)."""
    from rich.markup import escape

    from qgcli.report.tables import print_items

    for note in s["notes"]:
        print_items(console, f"[yellow]note:[/] {escape(note)}")
    if s["output"] and s["output"] != "-":
        print_items(console, f"wrote {', '.join(s['outputs'])} to {escape(s['output'])}")
    if s.get("figure"):
        print_items(console, f"wrote the figure to {escape(s['figure'])}")


def percent(x):
    return f"{100.0 * x:.2f}%"


def emit(summary, *, as_json, quiet, render, output=None):
    """Print the summary: JSON on stdout with --json, else a rich rendering on stderr unless --quiet."""
    if as_json:
        if output == "-":
            raise UsageProblem("--json and -o - both want stdout; write the data to a file or drop --json")
        dump_json(summary, safe=False)
        return
    if quiet:
        return
    from qgcli.report.text import printable_doc

    # Names and messages from files reach the renderer without control characters (qgcli.report.text); emoji off
    # so that ":name:" in them stays text.
    render(stderr_console(), printable_doc(summary))


def dump_json(doc, *, safe=True):
    """One JSON document on stdout (NaN/inf as null when ``safe``), as ``json.dump(indent=2)`` writes it
    (:mod:`qgcli.report.json_out`: the same bytes, in large blocks and several times faster)."""
    from qgcli.report import json_out

    captured = CAPTURED.get()
    if captured is not None:  # qgcli.run(): the document as Python objects, as a JSON reader would see it
        import json

        captured.append(json.loads(json.dumps(json_safe(doc) if safe else doc, default=_json_default)))
        return
    json_out.write(doc, sys.stdout, default=_json_default, nan_as_null=safe)  # json_safe(doc)'s bytes
    sys.stdout.write("\n")


def _json_default(value):
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def stdout_console():
    """A rich console on stdout; plain text, wide enough for tables, when stdout is not a terminal.

    Renderers pass what they print through :func:`qgcli.report.text.printable_doc` and :func:`qgcli.report.text.markup`."""
    return _console(stderr=False)


def stderr_console():
    """The same on stderr: the summaries, notes and ``wrote`` lines of the commands that write data."""
    return _console(stderr=True)


# Off a terminal lines are never wrapped (qgcli.report.tables prints tables at their full width too).
_PLAIN_WIDTH = 10_000


def _console(*, stderr):
    from rich.console import Console

    console = Console(highlight=False, emoji=False, stderr=stderr)
    if not console.is_terminal:
        # Piped into less/grep/a log file: plain text, full lines whatever the width.
        console = Console(highlight=False, emoji=False, width=_PLAIN_WIDTH, no_color=True,
                          file=sys.stderr if stderr else sys.stdout)
    console.on_broken_pipe = _broken_pipe  # rich would exit 1 itself; the CLI has one rule for a closed pipe
    return console


def _broken_pipe():
    raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


def number(v, digits=4):
    """A table cell: ``-`` for None, integers and booleans as they are, floats to ``digits`` significant digits."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    return f"{v:.{digits}g}"


def fmt_value(v):
    """A grid value in a summary table: 7 significant digits, nan for None (a NaN made JSON-safe)."""
    if v is None:
        return "nan"
    return f"{v:.7g}" if isinstance(v, float) else str(v)
