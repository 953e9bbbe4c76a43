"""JSON as ``json.dump(doc, indent=2, allow_nan=False, default=...)`` writes it, byte for byte, faster.

With ``indent`` set, the standard library encodes in pure Python through one generator per nesting level,
each token yielded on its own: a 20,000-group listing spent a third of its time there.  :func:`write`
walks the document once, appending the same tokens to one list (strings through the C escaper the
standard library uses itself) and writing it out in large blocks.
"""
import json
import math

_escape = json.encoder.encode_basestring_ascii  # the C one where the interpreter has it, as json uses
_float_repr = float.__repr__
_int_repr = int.__repr__
_BLOCK = 8192  # pieces per write


def write(doc, stream, *, default, nan_as_null=False):
    """Write ``doc`` to ``stream`` as ``json.dump(doc, stream, indent=2, allow_nan=False, default=default)``.

    ``nan_as_null``: a NaN or infinite value (not a key) is written as ``null``, what writing
    ``summaries.json_safe(doc)`` gives, without a copy of the document made first (a 20,000-group listing
    spent a tenth of its time there)."""
    number = _number_or_null if nan_as_null else _number
    out = []
    indents = ["\n"]

    def newline(level):
        while len(indents) <= level:
            indents.append("\n" + "  " * len(indents))
        return indents[level]

    def value(o, level):
        t = type(o)
        if t is str:
            out.append(_escape(o))
        elif o is None:
            out.append("null")
        elif o is True:
            out.append("true")
        elif o is False:
            out.append("false")
        elif t is int:
            out.append(_int_repr(o))
        elif t is float:
            out.append(number(o))
        elif t is list or t is tuple:
            array(o, level)
        elif t is dict:
            obj(o, level)
        elif isinstance(o, str):
            out.append(_escape(o))
        elif isinstance(o, int):
            out.append(_int_repr(o))
        elif isinstance(o, float):
            out.append(number(o))
        elif isinstance(o, (list, tuple)):
            array(o, level)
        elif isinstance(o, dict):
            obj(o, level)
        else:
            value(default(o), level)

    # array() and obj() share their shape; kept apart, each loop stays free of a per-item branch.
    def array(o, level):
        if not o:
            out.append("[]")
            return
        inner = newline(level + 1)
        out.append("[" + inner)
        separator = "," + inner
        first = True
        for item in o:
            if first:
                first = False
            else:
                out.append(separator)
            if type(item) is int:  # a shape's sizes, inline
                out.append(_int_repr(item))
            else:
                value(item, level + 1)
        out.append(newline(level) + "]")
        if len(out) >= _BLOCK:
            flush()

    def obj(o, level):
        if not o:
            out.append("{}")
            return
        inner = newline(level + 1)
        out.append("{" + inner)
        separator = "," + inner
        first = True
        for key, item in o.items():
            if first:
                first = False
            else:
                out.append(separator)
            key = keys.get(key) or _key_text(key)
            # The usual values inline (a listing's entries are mostly these): no call per value.
            t = type(item)
            if t is str:
                out.append(key + _escape(item))
            elif item is None:
                out.append(key + "null")
            elif t is int:
                out.append(key + _int_repr(item))
            elif t is float:
                out.append(key + number(item))
            else:
                out.append(key)
                value(item, level + 1)
        out.append(newline(level) + "}")
        if len(out) >= _BLOCK:
            flush()

    keys = {}  # a str key -> its JSON text with ": ", made once (a listing repeats a dozen keys thousands of times)

    def _key_text(key):
        text = _escape(key if type(key) is str else _key(key)) + ": "
        if type(key) is str:
            keys[key] = text
        return text

    def flush():
        stream.write("".join(out))
        out.clear()

    value(doc, 0)
    flush()


def _number(o):
    if math.isfinite(o):
        return _float_repr(o)
    raise ValueError("Out of range float values are not JSON compliant: " + repr(o))


def _number_or_null(o):
    return _float_repr(o) if math.isfinite(o) else "null"


def _key(key):
    """A dict key as json makes it a string."""
    if isinstance(key, str):
        return key
    if isinstance(key, float):
        return _number(key)
    if key is True:
        return "true"
    if key is False:
        return "false"
    if key is None:
        return "null"
    if isinstance(key, int):
        return _int_repr(key)
    raise TypeError(f"keys must be str, int, float, bool or None, not {key.__class__.__name__}")
