"""Strings from files, made safe for a terminal.

A dataset, group, link or attribute name, an attribute value or an error message quoting one can hold any
character, terminal control sequences included (``ESC ]0;title BEL`` retitles a window, ``ESC [2J`` clears the
screen), and rich markup (``[red]``, ``[link=...]``).  Text output passes every such string through
:func:`printable` (plain text) or :func:`markup` (inside a rich markup string); JSON output keeps the exact
strings, which JSON escapes itself.

Only the standard library is imported here: ``qgcli.cli`` uses :func:`one_line` for its ``Error:`` lines.

>>> printable("\\x1b]0;pwned\\x07\\x1b[2Jgradients")
'\\\\x1b]0;pwned\\\\x07\\\\x1b[2Jgradients'
>>> print(printable("tab\\there, DEL\\x7f, C1\\x9b, bidi\\u202e, a\\\\b stays"))
tab\\there, DEL\\x7f, C1\\x9b, bidi\\u202e, a\\b stays
"""
import re

_LAYOUT = re.compile(r"[ \t\r\n]+")


def printable(text):
    """``text`` with every non-printable character escaped visibly, as Python's ``repr`` writes it.

    Non-printable means what :meth:`str.isprintable` says: C0 and C1 controls, DEL, format characters
    (bidirectional overrides, zero-width joiners), separators other than the space, unassigned code points
    and lone surrogates (h5py's ``surrogateescape`` names).  Everything else, backslashes included, is kept
    as it is, so ordinary names print unchanged.  ``bytes`` are decoded as UTF-8 (undecodable bytes as
    ``\\xNN``); other objects go through ``str``.  Idempotent: its result is always printable.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", "backslashreplace")
    elif not isinstance(text, str):
        text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def markup(text):
    """:func:`printable`, with rich markup escaped too: for file strings inside a rich markup string.

    ``[red]`` then prints as ``[red]``.  Consoles that print file strings are made with ``emoji=False``
    (:mod:`qgcli.report.summaries`), so ``:smile:`` stays text as well.
    """
    from rich.markup import escape

    return escape(printable(text))


def counted(n, noun, plural=None, *, thousands=False):
    """``n`` and ``noun``, in the plural unless ``n`` is 1: every count a message prints goes through here.

    >>> counted(1, "group"), counted(0, "layer"), counted(2, "process", "processes"), counted(12345, "value", thousands=True)
    ('1 group', '0 layers', '2 processes', '12,345 values')
    """
    number = f"{n:,}" if thousands else f"{n}"
    return f"{number} {noun if n == 1 else plural or noun + 's'}"


def one_line(message):
    """An error message on one printable line: runs of spaces, tabs and line breaks become one space,
    every other non-printable character is escaped as :func:`printable` does."""
    return printable(_LAYOUT.sub(" ", str(message)).strip())


def printable_doc(value):
    """A JSON-like document (dicts, lists, strings, numbers) with :func:`printable` applied to every string,
    dictionary keys included: what a text renderer receives, so no control character reaches it.  Containers
    whose strings are all printable are returned as they are, not copied (an inspect listing of 20,000 groups
    is tens of MB), so a renderer must not change what it receives."""
    if isinstance(value, (str, bytes)):
        return printable(value)
    if isinstance(value, dict):
        items = [(printable(k) if isinstance(k, (str, bytes)) else k, printable_doc(v)) for k, v in value.items()]
        same = all(new_k is k and new_v is v for (new_k, new_v), (k, v) in zip(items, value.items()))
        return value if same else dict(items)
    if isinstance(value, (list, tuple)):
        out = [printable_doc(v) for v in value]
        if all(new is old for new, old in zip(out, value)):
            return value
        return out if isinstance(value, list) else tuple(out)
    return value
