"""``qgcli inspect`` (what is in these files) and ``qgcli report`` (what the STE does to the gradients).

Both print their result on stdout: a rich table (plain text when stdout is not a terminal), one JSON
document with ``--json``, CSV with ``report --csv``.  Progress and notes go to stderr.  The JSON layouts are
documented in the README ("JSON output of inspect and report"); keys are always present, in a fixed
order, with ``null`` where a value does not exist (never NaN).
"""
import click

INSPECT_SCHEMA = 1
REPORT_SCHEMA = 1
# qgcli's provenance attributes (written by `-o out.h5`), shown as one plain line.
_PROVENANCE = ("qgcli_version", "op", "variant", "num_bits", "narrow_range", "axis", "min", "max")
_TABLE_ROWS = 20  # rows a terminal table shows without --top
# A SPEC is free text (file, file:key, -, literal); click.Path only so that shells complete file names.
_SPEC = click.Path(allow_dash=True)


# --- inspect: reading --------------------------------------------------------------------------------

def _plain(value, limit=64):
    """An attribute value as a JSON value: numbers, strings, booleans, lists; large arrays summarised."""
    import numpy as np

    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "biufSUO" and value.size <= limit:
            return [_plain(v) for v in value.tolist()] if value.ndim else _plain(value.item())
        return f"<array {value.dtype} {list(value.shape)}>"
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float):
        return value if np.isfinite(value) else None
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    return str(value)


def _attributes(obj):
    from qgcli.errors import QgcliError
    from qgcli.io import read_attributes

    try:
        return {key: _plain(value) for key, value in read_attributes(obj).items()}
    except QgcliError:
        raise
    except Exception as exc:  # noqa: BLE001 - a broken attribute table must not stop the listing
        return {"<unreadable>": f"{type(exc).__name__}: {exc}"}


def tensor_stats(array):
    """min/max/mean/std over the finite values (float64 accumulation), NaN/Inf/zero counts.

    Non-numeric arrays get None everywhere; complex arrays get counts only.
    """
    import numpy as np

    a = np.asarray(array)
    out = {"min": None, "max": None, "mean": None, "std": None, "nan": None, "inf": None, "zeros": None}
    if a.dtype.name == "bfloat16":
        a = a.astype(np.float32)
    kind = a.dtype.kind
    if kind not in "biufc":
        return out
    if kind == "b":
        a = a.astype(np.uint8)
    if kind in "fc":
        out["nan"] = int(np.count_nonzero(np.isnan(a)))
        out["inf"] = int(np.count_nonzero(np.isinf(a)))
    else:
        out["nan"] = out["inf"] = 0
    out["zeros"] = int(a.size - np.count_nonzero(a))
    if kind == "c" or a.size == 0:
        return out
    values = a if out["nan"] == out["inf"] == 0 else a[np.isfinite(a)]
    if values.size == 0:
        return out
    as_number = int if kind in "iu" else float
    out["min"] = as_number(values.min())
    out["max"] = as_number(values.max())
    with np.errstate(over="ignore", invalid="ignore"):
        mean = values.mean(dtype=np.float64)
        # std without a float64 copy of huge inputs: E[(x - mean)^2] blockwise.
        flat = values.reshape(-1)
        acc = 0.0
        block = 1 << 22
        for start in range(0, flat.size, block):
            d = flat[start:start + block].astype(np.float64) - mean
            acc += float(np.dot(d, d))
        std = (acc / flat.size) ** 0.5
    out["mean"] = float(mean) if np.isfinite(mean) else None
    out["std"] = float(std) if np.isfinite(std) else None
    return out


def _tensor_entry(name, shape, dtype, attributes, *, stats=None, error=None):
    import numpy as np

    size = int(np.prod(shape, dtype=np.int64)) if shape is not None else 0
    try:
        itemsize = np.dtype(dtype).itemsize if dtype != "bfloat16" else 2
    except TypeError:
        itemsize = 0
    entry = {"name": name, "shape": None if shape is None else [int(s) for s in shape], "dtype": str(dtype),
             "size": size, "nbytes": size * itemsize}
    entry.update(stats if stats is not None else dict.fromkeys(("min", "max", "mean", "std", "nan", "inf", "zeros")))
    entry["attributes"] = attributes
    entry["error"] = error
    return entry


def _npy_header(source, name):
    """Shape and dtype from an npz member's .npy header (never unpickling anything); (None, None) if unreadable."""
    import io as _io
    import zipfile

    import numpy as np

    try:
        with zipfile.ZipFile(_io.BytesIO(source) if isinstance(source, bytes) else source) as zf:
            with zf.open(name + ".npy") as fh:
                version = np.lib.format.read_magic(fh)
                reader = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                          else np.lib.format.read_array_header_2_0)
                shape, _, dtype = reader(fh)
        return shape, str(dtype)
    except Exception:  # noqa: BLE001 - only a better error message is at stake
        return None, None


def _read_entry(container, name, attributes, with_stats, shape=None, dtype=None, source=None):
    """One tensor's entry; a tensor that cannot be read gets its error recorded, not a failed command."""
    from qgcli.errors import FileFormatError

    if not with_stats and shape is not None:
        return _tensor_entry(name, shape, dtype, attributes)
    try:
        array = container.read(name or None)
    except FileFormatError as exc:
        if shape is None and source is not None:
            shape, dtype = _npy_header(source, name)
        return _tensor_entry(name, shape, dtype or "unknown", attributes, error=str(exc))
    stats = tensor_stats(array) if with_stats else None
    return _tensor_entry(name, array.shape, array.dtype, attributes, stats=stats)


def _h5_structure(path):
    """Groups (with attributes), datasets (path, shape, dtype, attributes) and non-hard links of an HDF5 file.

    Walks with HDF5's own link visitor, which descends through hard links only (each group once, so
    cycles end) and never opens a soft or external link's target.
    """
    import h5py

    from qgcli.io import tagged_bfloat16
    from qgcli.signals import deferred

    groups, datasets, links = [], [], []
    seen = {}
    with deferred(), h5py.File(path, "r") as f:
        groups.append({"path": "/", "attributes": _attributes(f)})
        seen[h5py.h5o.get_info(f.id).addr] = "/"
        found = []
        f.visititems_links(lambda name, link: found.append((name, link)))
        for name, link in found:
            if isinstance(link, h5py.ExternalLink):
                links.append({"path": name, "kind": "external", "target": f"{link.filename}:{link.path}"})
                continue
            if isinstance(link, h5py.SoftLink):
                links.append({"path": name, "kind": "soft", "target": link.path})
                continue
            try:
                obj = f[name]
                addr = h5py.h5o.get_info(obj.id).addr
            except Exception as exc:  # noqa: BLE001 - a damaged object: list it, don't stop
                datasets.append({"path": name, "shape": None, "dtype": "unknown", "attributes": {},
                                 "error": f"cannot open: {type(exc).__name__}: {exc}"})
                continue
            if addr in seen and isinstance(obj, h5py.Group):
                links.append({"path": name, "kind": "hard", "target": seen[addr]})
                continue
            seen.setdefault(addr, name)
            if isinstance(obj, h5py.Group):
                groups.append({"path": name, "attributes": _attributes(obj)})
            elif isinstance(obj, h5py.Dataset):
                attrs = _attributes(obj)
                dtype = "bfloat16" if tagged_bfloat16(obj) else str(obj.dtype)
                datasets.append({"path": name, "shape": obj.shape, "dtype": dtype, "attributes": attrs,
                                 "error": None})
            else:  # a committed datatype
                links.append({"path": name, "kind": "datatype", "target": str(getattr(obj, "dtype", ""))})
    return groups, datasets, links


def _matches(name, key):
    key = key.strip("/")
    return key == "" or name == key or name.startswith(key + "/")


def inspect_source(text, stdin, *, with_stats=True, progress=None):
    """The ``files[]`` entry of ``qgcli inspect --json`` for one FILE argument (path[:KEY] or -)."""
    import os

    from qgcli import io
    from qgcli.errors import FileFormatError, OperandError

    spec = io.parse_spec(text)
    try:
        container = io.Container.open(spec.path, stdin)
    except FileFormatError as exc:
        raise OperandError(str(exc), operand="FILE") from None
    label = "-" if spec.path is None else spec.path
    size = len(stdin.read()) if spec.path is None else os.path.getsize(spec.path)
    entry = {"file": label, "format": container.kind, "size_bytes": size, "key": spec.key, "attributes": {},
             "groups": [], "links": [], "tensors": []}
    npz_source = None
    with container:
        if container.kind == "npy":
            if spec.key is not None:
                raise OperandError(f"{label} is an .npy file with one array; it has no key {spec.key!r}",
                                   operand="FILE")
            todo = [("", None, None, {})]
        elif container.kind == "npz":
            todo = [(n, None, None, {}) for n in container.names() if spec.key is None or n == spec.key]
            npz_source = stdin.read() if spec.path is None else spec.path
        else:
            try:
                groups, datasets, links = _h5_structure(spec.path)
            except io.CORRUPT_FILE_ERRORS as exc:  # damaged HDF5 metadata: one clean error, not a traceback
                raise OperandError(f"{label}: cannot list its structure: {io._reason(exc)}", operand="FILE") from None
            entry["attributes"] = groups[0]["attributes"]
            entry["groups"] = [g for g in groups if spec.key is None or _matches(g["path"], spec.key)
                               or g["path"] == "/"]
            entry["links"] = [lk for lk in links if spec.key is None or _matches(lk["path"], spec.key)]
            todo = []
            for d in datasets:
                if spec.key is not None and not _matches(d["path"], spec.key):
                    continue
                if d["error"]:
                    entry["tensors"].append(_tensor_entry(d["path"], None, "unknown", {}, error=d["error"]))
                    continue
                if d["shape"] is None:  # an HDF5 empty (null dataspace) dataset: no values to read
                    entry["tensors"].append(_tensor_entry(d["path"], None, d["dtype"], d["attributes"]))
                    continue
                todo.append((d["path"], d["shape"], d["dtype"], d["attributes"]))
        if spec.key is not None and not todo and not entry["tensors"]:
            raise OperandError(f"{label} has no tensor or group {spec.key!r}", operand="FILE")
        if progress is not None:
            progress.update(total=(progress.total or 0) + len(todo))
        for name, shape, dtype, attrs in todo:
            if progress is not None:
                progress.update(description=f"{label}:{name}" if name else label)
            entry["tensors"].append(_read_entry(container, name, attrs, with_stats, shape, dtype,
                                                source=npz_source if container.kind == "npz" else None))
            if progress is not None:
                progress.advance()
    return entry


# --- inspect: rendering ------------------------------------------------------------------------------

def _human_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _num(v, digits=4):
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    return f"{v:.{digits}g}"


def _attr_text(attrs):
    return ", ".join(f"{k}={v}" for k, v in attrs.items())


def _provenance_line(attrs):
    if "qgcli_version" not in attrs:
        return None
    parts = [f"{k}={attrs[k]}" for k in _PROVENANCE[2:] if k in attrs]
    op = attrs.get("op", "an unnamed op")
    return f"written by qgcli {attrs['qgcli_version']}: {op}" + (f" ({', '.join(parts)})" if parts else "")


def render_inspect(console, doc):
    from rich.markup import escape
    from rich.table import Table

    for i, f in enumerate(doc["files"]):
        if i:
            console.print()
        kind = {"h5": "HDF5", "npz": "npz", "npy": "npy"}[f["format"]]
        count = len(f["tensors"])
        console.print(f"[bold]{escape(f['file'])}[/]  {kind}, {_human_bytes(f['size_bytes'])}, "
                      f"{count} tensor{'s' if count != 1 else ''}")
        file_attrs = dict(f["attributes"])
        line = _provenance_line(file_attrs)
        if line:
            console.print(f"  {escape(line)}")
            file_attrs = {k: v for k, v in file_attrs.items() if k not in _PROVENANCE}
        for k, v in file_attrs.items():
            console.print(f"  {escape(k)}: {escape(str(v))}")
        table = Table(show_edge=False, box=None, pad_edge=False, header_style="bold")
        for col, justify in (("name", "left"), ("shape", "left"), ("dtype", "left"), ("min", "right"),
                             ("max", "right"), ("mean", "right"), ("std", "right"), ("nan", "right"),
                             ("inf", "right"), ("zeros", "right"), ("size", "right")):
            table.add_column(col, justify=justify)
        notes = []
        for t in f["tensors"]:
            shape = "?" if t["shape"] is None else "[" + ", ".join(map(str, t["shape"])) + "]"
            bad = (t["nan"] or 0) + (t["inf"] or 0)
            style = "red" if t["error"] or bad else None
            table.add_row(escape(t["name"] or "(array)"), shape, t["dtype"], _num(t["min"]), _num(t["max"]),
                          _num(t["mean"]), _num(t["std"]), _num(t["nan"]), _num(t["inf"]), _num(t["zeros"]),
                          _human_bytes(t["nbytes"]), style=style)
            if t["error"]:
                notes.append(f"{t['name']}: {t['error']}")
            extra = {k: v for k, v in t["attributes"].items() if f["attributes"].get(k, object()) != v}
            if extra:
                notes.append(f"{t['name']}: {_attr_text(extra)}")
        if f["tensors"]:
            console.print(table)
        for g in f["groups"]:
            if g["path"] != "/":
                attrs = f"  ({escape(_attr_text(g['attributes']))})" if g["attributes"] else ""
                console.print(f"  group {escape(g['path'])}/{attrs}")
        for lk in f["links"]:
            how = {"external": "not followed", "soft": "not followed", "hard": "listed once"}.get(lk["kind"], "not a tensor")
            console.print(f"  {lk['kind']} link {escape(lk['path'])} -> {escape(lk['target'])} ({how})")
        for note in notes:
            console.print(f"  [yellow]{escape(note)}[/]")


def _stdout_console():
    import sys

    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        # Piped into less/grep/a file: plain text, and wide enough that tables are not squeezed.
        console = Console(highlight=False, width=max(160, console.width), no_color=True, file=sys.stdout)
    return console


def _dump_json(doc):
    import json
    import sys

    from qgcli.commands._common import _json_default, json_safe

    json.dump(json_safe(doc), sys.stdout, indent=2, allow_nan=False, default=_json_default)
    sys.stdout.write("\n")


_INSPECT_EPILOG = """\b
Examples:
  qgcli inspect samples/per_channel.h5
  qgcli inspect grads.h5:backprops_wrt_input --json | jq '.files[0].tensors[0].zeros'
  qgcli fakequant-grad samples/per_channel.h5 -o - | qgcli inspect - --json
"""


@click.command("inspect", epilog=_INSPECT_EPILOG, short_help="List tensors, shapes, dtypes, statistics, attributes.")
@click.argument("files", nargs=-1, required=True, metavar="FILE...", type=click.Path(allow_dash=True))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout (see the README).")
@click.option("--no-stats", is_flag=True, help="Names, shapes and dtypes only (HDF5: reads no data).")
@click.option("-q", "--quiet", is_flag=True, help="No progress or notes on stderr.")
def inspect(files, as_json, no_stats, quiet):
    """Show what is in .npy/.npz/.h5 files: every tensor with its shape, dtype, min/max/mean/std over
    finite values, NaN/Inf/zero counts and size; HDF5 groups, attributes and links (never followed).

    FILE is a path, PATH:KEY (one npz key, or one HDF5 dataset or group), or - (an .npy/.npz stream
    on stdin, e.g. from another qgcli command's -o -). Works on any such file, not only qgcli's.
    """
    from qgcli import __version__, io
    from qgcli.progress import Progress

    if sum(1 for f in files if f == "-" or f.startswith("-:")) > 1:
        raise click.BadParameter("stdin (-) can be read only once", param_hint="FILE")
    stdin = io.Stdin()
    doc = {"command": "inspect", "schema": INSPECT_SCHEMA, "qgcli_version": __version__, "files": []}
    with Progress("reading", total=0, quiet=quiet) as progress:
        for text in files:
            doc["files"].append(inspect_source(text, stdin, with_stats=not no_stats, progress=progress))
    if as_json:
        _dump_json(doc)
    else:
        render_inspect(_stdout_console(), doc)


# --- report ------------------------------------------------------------------------------------------

def _parse_percentiles(ctx, param, value):
    from qgcli.io import parse_literal

    values = parse_literal(value) if value else None
    if values is None or values.size == 0:
        raise click.BadParameter(f"expected comma-separated numbers, got {value!r}")
    values = [float(v) for v in values.reshape(-1)]
    for v in values:
        if not 50.0 <= v <= 100.0:
            raise click.BadParameter(f"{v:g} is not between 50 and 100 (p picks the range [P(100-p), P(p)])")
    return tuple(values)


def _flag_metric(report):
    return "gradient_blocked" if report.has_gradients else "clipped"


def verdict(report, threshold):
    """One line: which channels clip, how much gradient they lose, and what the suggested ranges give."""
    col, total = report.columns, report.total
    metric = _flag_metric(report)
    what = "of their gradient mass" if report.has_gradients else "of their values"
    order = report.order("worst")
    flagged = [c for c in order if col[metric][c] > threshold]
    sqnr, sug = total["sqnr_db"], total["suggested_sqnr_db"]
    gain = ""
    if sqnr is not None and sug is not None and sug > sqnr + 0.5:
        gain = f"; the suggested range{'s' if report.per_channel else ''} would raise the SQNR from " \
               f"{sqnr:.1f} to {sug:.1f} dB"
        if report.has_gradients and total["gradient_mass"] and total["suggested_gradient_blocked"] is not None:
            gain += f" and block {100 * total['suggested_gradient_blocked']:.1f}% of the gradient mass"
    blocked = (f"; {100 * total['gradient_blocked']:.1f}% of all gradient mass is blocked by the STE mask"
               if report.has_gradients else "")
    thr = f"{100 * threshold:g}%"
    if report.has_gradients and not total["gradient_mass"]:
        blocked = "; the gradient is zero everywhere, so no gradient mass can be blocked"
    if not report.per_channel:
        v = col[metric][0]
        share = f"{100 * v:.1f}%"
        clip = (f"{100 * col['clipped_below'][0]:.1f}% of values clip below the nudged range, "
                f"{100 * col['clipped_above'][0]:.1f}% above")
        if flagged:
            lost = "loses " + share + " of its gradient mass" if report.has_gradients else "clips " + share
            return f"Verdict: the tensor {lost} (more than {thr}): {clip}{gain}."
        lost = "loses " + share + " of its gradient mass" if report.has_gradients else "clips " + share
        return f"Verdict: OK, the tensor {lost}, not more than {thr} ({clip}){gain}."
    if flagged:
        names = ", ".join(f"ch {c} {100 * col[metric][c]:.1f}%" for c in flagged[:3])
        more = f" and {len(flagged) - 3} more" if len(flagged) > 3 else ""
        verb = "lose more than" if report.has_gradients else "clip more than"
        return (f"Verdict: {len(flagged)} of {report.channels} channels {verb} {thr} {what} "
                f"({names}{more}){blocked}{gain}.")
    worst = order[0] if order else None
    worst_text = f" (worst: ch {worst}, {100 * col[metric][worst]:.1f}%)" if worst is not None else ""
    verb = "loses more than" if report.has_gradients else "clips more than"
    what = "of its gradient mass" if report.has_gradients else "of its values"
    return f"Verdict: OK, no channel {verb} {thr} {what}{worst_text}{blocked}{gain}."


def build_report_doc(report, *, op, attrs, inputs, threshold, sort, top, notes):
    from qgcli import __version__
    from qgcli.ops.analysis import TOTAL_KEYS

    order = report.order(sort)
    metric = _flag_metric(report)
    flagged = [c for c in report.order("worst") if report.columns[metric][c] > threshold]
    shown = order if top is None else order[:top]
    rows = []
    for c in shown:
        row = report.row(c)
        row["flagged"] = c in flagged
        rows.append(row)
    return {
        "command": "report",
        "schema": REPORT_SCHEMA,
        "qgcli_version": __version__,
        "op": op,
        "variant": report.variant,
        "attributes": attrs,
        "inputs": inputs,
        "per_channel": report.per_channel,
        "channels": report.channels,
        "has_gradients": report.has_gradients,
        "percentiles": list(report.percentiles),
        "threshold": threshold,
        "sort": sort,
        "top": top,
        "total": {k: report.total[k] for k in TOTAL_KEYS},
        "flagged": flagged if report.per_channel else [None] * len(flagged),
        "rows": rows,
        "verdict": verdict(report, threshold),
        "notes": notes,
    }


def _pct(v):
    return "-" if v is None else f"{100 * v:.1f}%"


def _span(lo, hi):
    if lo is None or hi is None:
        return "-"
    return f"{lo:.3g}..{hi:.3g}"


def render_report(console, doc, limited):
    from rich.markup import escape
    from rich.table import Table

    a, t = doc["attributes"], doc["total"]
    src = ", ".join(f"{k} {v['shape']} {v['dtype']}" for k, v in doc["inputs"].items() if k in ("inputs", "gradients"))
    axis = f" axis={a['axis']}" if a.get("axis") is not None else ""
    console.print(f"[bold]{doc['op']}[/] num_bits={a['num_bits']} narrow_range={a['narrow_range']}{axis}  "
                  f"{escape(src)}")
    table = Table(show_edge=False, box=None, pad_edge=False, header_style="bold")
    # Primed columns: what the suggested range would give.
    for name in ("ch", "data", "range", "nudged", "clip<", "clip>", "blocked", "d/dmin", "d/dmax", "SQNR",
                 "suggested", "p", "SQNR'", "blocked'"):
        table.add_column(name, justify="right", no_wrap=name in ("data", "range", "nudged", "suggested"))
    for r in doc["rows"]:
        table.add_row("all" if r["channel"] is None else str(r["channel"]), _span(r["data_min"], r["data_max"]),
                      _span(r["min"], r["max"]), _span(r["nudged_min"], r["nudged_max"]), _pct(r["clipped_below"]),
                      _pct(r["clipped_above"]), _pct(r["gradient_blocked"]), _num(r["backprop_wrt_min"], 3),
                      _num(r["backprop_wrt_max"], 3), _db(r["sqnr_db"], r["mse"]),
                      _span(r["suggested_min"], r["suggested_max"]), _num(r["suggested_percentile"], 5),
                      _db(r["suggested_sqnr_db"], r["suggested_mse"]), _pct(r["suggested_gradient_blocked"]),
                      style="red" if r["flagged"] else None)
    console.print(table)
    if limited:
        console.print(f"... {doc['channels'] - len(doc['rows'])} more channels (--top K to show more, "
                      "--json or --csv for all)")
    if doc["per_channel"]:
        total = f"all {doc['channels']} channels: "
    else:
        total = "whole tensor: "
    total += f"clipped {_pct(t['clipped_below'])} below, {_pct(t['clipped_above'])} above"
    if doc["has_gradients"]:
        total += f"; gradient mass blocked {_pct(t['gradient_blocked'])}"
    total += (f"; SQNR {_db(t['sqnr_db'], t['mse'])} dB, with the suggested "
              f"range{'s' if doc['per_channel'] else ''} {_db(t['suggested_sqnr_db'], t['suggested_mse'])} dB")
    console.print(escape(total), soft_wrap=True)
    console.print("[dim]clip< clip>: values below/above the nudged range; blocked: gradient mass the STE mask zeroes; "
                  "d/dmin d/dmax: backprop_wrt_min/max; primed: with the suggested range [P(100-p), P(p)][/]",
                  soft_wrap=True)
    console.print(f"[bold]{escape(doc['verdict'])}[/]", soft_wrap=True)


def _db(v, mse=None):
    if v is None:
        return "inf" if mse == 0 else "-"
    return f"{v:.1f}"


def _write_csv(doc):
    import csv
    import sys

    from qgcli.ops.analysis import ROW_KEYS

    keys = list(ROW_KEYS) + ["flagged"]
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(keys)
    for row in doc["rows"]:
        writer.writerow(["" if row[k] is None else (repr(row[k]) if isinstance(row[k], float) else
                         str(row[k]).lower() if isinstance(row[k], bool) else row[k]) for k in keys])


_REPORT_EPILOG = """\b
Examples:
  qgcli report samples/per_channel.h5
  qgcli report samples/per_channel.h5 --top 3 --json | jq '.rows[] | {channel, gradient_blocked}'
  qgcli report samples/notebook.h5 --num-bits 2 --csv > report.csv
  qgcli report --inputs act.npy --gradients grad.npy --min -1,-2 --max 1,2 --sort sqnr
"""


@click.command("report", epilog=_REPORT_EPILOG, short_help="Per-channel clipping, blocked gradient, SQNR, ranges.")
@click.argument("bundle", required=False, metavar="[BUNDLE]", type=click.Path(allow_dash=True))
@click.option("--gradients", metavar="SPEC", type=_SPEC, help="Upstream gradient (optional: without it no gradient columns).")
@click.option("--inputs", metavar="SPEC", type=_SPEC, help="Forward inputs (TF operand 'inputs').")
@click.option("--min", "min_", metavar="SPEC", type=_SPEC, help="Range minimum: scalar (vars/args) or one per channel.")
@click.option("--max", "max_", metavar="SPEC", type=_SPEC, help="Range maximum: scalar (vars/args) or one per channel.")
@click.option("--num-bits", type=int, default=8, show_default=True, help="Bit width, 2..16.")
@click.option("--narrow-range", is_flag=True, help="Use the grid [1, 2^num_bits - 1].")
@click.option("--variant", type=click.Choice(["args", "vars", "per-channel"]), default=None,
              help="TF op family; default: per-channel when min/max are vectors, else vars.")
@click.option("--axis", type=int, default=None, help="Channel axis for the per-channel variant (TF: -1).")
@click.option("--top", type=click.IntRange(min=1), default=None, metavar="K", help="Show the K worst channels only.")
@click.option("--sort", "sort", type=click.Choice(["worst", "blocked", "clipped", "sqnr", "gain", "channel"]),
              default="worst", show_default=True,
              help="Row order: worst = most gradient mass blocked (most clipped without gradients), then lowest SQNR.")
@click.option("--threshold", type=click.FloatRange(0.0, 1.0), default=0.05, show_default=True,
              help="Flag channels losing more than this share of gradient mass (of values without gradients).")
@click.option("--percentiles", default="100,99.99,99.9,99.5,99,98,95", show_default=True,
              callback=_parse_percentiles, metavar="P,...",
              help="Percentiles searched for the suggested range [P(100-p), P(p)]; the best SQNR wins.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout (see the README).")
@click.option("--csv", "as_csv", is_flag=True, help="Print one CSV row per channel on stdout.")
@click.option("-q", "--quiet", is_flag=True, help="No progress or notes on stderr.")
@click.option("--device", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True,
              help="Compute with NumPy (cpu) or CuPy (gpu).")
def report(bundle, gradients, inputs, min_, max_, num_bits, narrow_range, variant, axis, top, sort, threshold,
           percentiles, as_json, as_csv, quiet, device):
    """Per channel (or per tensor): what a fake-quant range does to the data and to its gradient.

    Data range against the raw and nudged range, shares clipped below/above, the share of upstream
    gradient mass the STE mask blocks (sum|g|*(1-mask) / sum|g|), backprop_wrt_min/max from TensorFlow's
    op, the forward error (MSE, SQNR in dB) and a suggested percentile range with the SQNR it gives.
    Worst channels first, then a one-line verdict. Operands as for fakequant-grad: a BUNDLE and/or options.
    """
    from qgcli.commands._common import Operands, describe_arrays, to_device
    from qgcli.commands.fakequant import TF_OPS, load_fake_quant_operands
    from qgcli.progress import Progress

    if as_json and as_csv:
        raise click.UsageError("--json and --csv both want stdout; pick one")
    operands = Operands(bundle, {"gradients": gradients, "inputs": inputs, "min": min_, "max": max_},
                        literal_ok=("min", "max"))
    notes = []
    with Progress("reading operands", total=None, quiet=quiet) as progress:
        try:
            _, x_raw, mn, mx, variant = load_fake_quant_operands(operands, variant, with_gradients=False)
            progress.update(description="reading gradients")
            g_raw = operands.get("gradients", required=False)
        finally:
            operands.close()
        if axis is not None and variant != "per-channel":
            raise click.BadParameter("only applies to --variant per-channel", param_hint="'--axis'")
        for name, value in (("inputs", x_raw), ("gradients", g_raw)):
            if value is not None and str(value.dtype) != "float32":
                notes.append(f"{name} is {value.dtype}; computed in float32 as TensorFlow does")
        xp, (g_dev, x_dev) = to_device([g_raw, x_raw], device)
        from qgcli.ops.analysis import channel_report

        steps = 5 + len(percentiles)
        progress.update(total=steps, completed=0)

        def on_step(text):
            progress.update(description=text)
            progress.advance()

        result = channel_report(x_dev, mn, mx, g_dev, num_bits=num_bits, narrow_range=narrow_range,
                                variant=variant, axis=-1 if axis is None else axis, percentiles=percentiles,
                                on_step=on_step)
    attrs = {"num_bits": num_bits, "narrow_range": narrow_range,
             "axis": (-1 if axis is None else axis) if variant == "per-channel" else None}
    raw = {"inputs": x_raw, "gradients": g_raw, "min": mn, "max": mx}
    described = describe_arrays({k: v for k, v in raw.items() if v is not None and hasattr(v, "dtype")})
    for k, v in described.items():
        v["source"] = operands.sources.get(k, "default" if variant == "args" and k in ("min", "max") else None)
    limited = top is None and not as_json and not as_csv and result.channels > _TABLE_ROWS
    doc = build_report_doc(result, op=TF_OPS[variant], attrs=attrs, inputs=described, threshold=threshold,
                           sort=sort, top=_TABLE_ROWS if limited else top, notes=notes)
    if not quiet:
        for note in notes:
            click.echo(f"note: {note}", err=True)
    if as_json:
        _dump_json(doc)
    elif as_csv:
        _write_csv(doc)
        if not quiet:
            click.echo(doc["verdict"], err=True)
    else:
        render_report(_stdout_console(), doc, limited)
