"""A command's table as CSV or Parquet (``--csv FILE``, ``--parquet FILE``): the rows of the document ``--json``
prints, one row per record, nested records flattened into dotted column names (``a.blocked``, ``change.sqnr_db``).

CSV cells: empty for null, ``true``/``false``, floats as Python's ``repr`` (every digit), a list of integers
joined by ``x`` (a shape: ``16x8``), other lists as JSON text.  Parquet (pyarrow, ``pip install
'qgcli[parquet]'``) keeps the types: nulls, booleans, integers, doubles, lists; a column whose values have no
common type is written as JSON text.  ``-`` writes to stdout.  Files are written atomically and checked before
the work as every output is (``--force`` to replace; never an input).

>>> flatten({"path": "a", "change": {"blocked": 0.5, "sqnr_db": None}, "shape": [4, 3]})
{'path': 'a', 'change.blocked': 0.5, 'change.sqnr_db': None, 'shape': [4, 3]}
>>> [csv_cell(v) for v in (None, True, 0.1, [4, 3], ["a", "b"], 7)]
['', 'true', '0.1', '4x3', '["a", "b"]', '7']
"""
import io
import json
import sys

from qgcli.errors import OptionError, OutputError, RuntimeFailure

#: What ``--parquet`` needs, and the extra that installs it.
PARQUET_HINT = "needs pyarrow: pip install 'qgcli[parquet]'"


def flatten(row, prefix=""):
    """One record as flat columns: a nested dict's keys joined with dots, in the order the record holds them."""
    flat = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def columns(rows, keys=None):
    """The flat rows and their columns: ``keys`` (a command's documented order) or every column in the order
    of first appearance."""
    flat = [flatten(r) for r in rows]
    if keys is None:
        seen = {}
        for r in flat:
            seen.update(dict.fromkeys(r))
        keys = list(seen)
    return flat, list(keys)


def csv_cell(value):
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        if value and all(type(v) is int for v in value):
            return "x".join(map(str, value))
        return json.dumps(value)
    return str(value)


def check(csv=None, parquet=None, *, force=False, inputs=(), as_json=False):
    """Refuse, before any work, what cannot be written: two outputs on stdout, a missing pyarrow, a path that
    exists (without ``force``), is an input, or lies in a missing directory."""
    from qgcli.storage.outputs import check_figure_output

    if as_json and "-" in (csv, parquet):
        option = "--csv" if csv == "-" else "--parquet"
        raise OptionError(f"--json and {option} both want stdout; name a file", param_hint=f"'{option}'")
    if csv == "-" and parquet == "-":
        raise OptionError("--csv and --parquet both want stdout; name a file for one", param_hint="'--parquet'")
    if parquet is not None:
        _pyarrow()
    for option, dest in (("--csv", csv), ("--parquet", parquet)):
        if dest is not None and not (dest == "-" and option == "--csv"):  # CSV is text: a terminal may show it
            check_figure_output(dest, inputs=[i for i in inputs if i], force=force, option=option, format=option[2:])


def write(rows, keys=None, *, csv=None, parquet=None, force=False, inputs=()):
    """Write ``rows`` (the records of a ``--json`` document, ``keys`` their columns) to ``csv`` and/or
    ``parquet`` (paths, or ``-`` for stdout)."""
    if csv is None and parquet is None:
        return
    from qgcli.report.summaries import json_safe

    check(csv, parquet, force=force, inputs=inputs)
    flat, keys = columns(json_safe(list(rows)), keys)  # NaN/inf as null, as --json prints them
    if csv is not None:
        _commit(csv, _csv_bytes(flat, keys), "--csv")
    if parquet is not None:
        _commit(parquet, _parquet_bytes(flat, keys), "--parquet")


def _csv_bytes(flat, keys):
    import csv

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(keys)
    for r in flat:
        writer.writerow([csv_cell(r.get(k)) for k in keys])
    return buf.getvalue().encode("utf-8")


def _parquet_bytes(flat, keys):
    pa = _pyarrow()
    import pyarrow.parquet as pq

    arrays = []
    for k in keys:
        values = [r.get(k) for r in flat]
        try:
            arrays.append(pa.array(values))
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # no common type (a number here, a word there): JSON text
            arrays.append(pa.array([None if v is None else v if isinstance(v, str) else json.dumps(v)
                                    for v in values], type=pa.string()))
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_arrays(arrays, names=keys) if keys else pa.table({}), buf)
    return buf.getvalue()


def _commit(dest, data, option):
    from qgcli.storage.atomic import atomic_write

    if dest == "-":
        from qgcli.signals import raise_pending

        raise_pending()
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return

    def save(target):
        with open(target, "wb") as fh:
            fh.write(data)

    try:
        atomic_write(dest, save)
    except OSError as exc:
        raise RuntimeFailure(f"cannot write {dest}: {exc.strerror or exc}") from None


def _pyarrow():
    try:
        import pyarrow
    except ImportError:
        raise OutputError(PARQUET_HINT, operand="--parquet") from None
    return pyarrow
