"""``qgcli inspect``: what is in these files (any .npy/.npz/.h5, not only qgcli's).

The result goes to stdout: a rich table (plain text when stdout is not a terminal) or one JSON document
with ``--json``; progress and notes go to stderr.  The JSON layout is documented in docs/formats.md ("JSON
output of inspect and report"); keys are always present, in a fixed order, with ``null`` where a value does not
exist (never NaN).
"""
import functools

import click

from qgcli.cli.options import hdf5_bound_options, table_out_options
from qgcli.report.summaries import dump_json, number, stdout_console
from qgcli.report.text import counted
from qgcli.cli.options import table_options

INSPECT_SCHEMA = 1
# qgcli's provenance attributes (written by `-o out.h5`), shown as one plain line.
_PROVENANCE = ("qgcli_version", "op", "variant", "num_bits", "narrow_range", "axis", "min", "max")


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
    from qgcli.storage.h5 import read_attributes

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
    if a.size <= TINY and a.dtype.kind in "biuf" and a.dtype.itemsize <= 8 and a.dtype.names is None:
        out = _tiny_stats(a)
        if out is not None:
            return out
    out = {"min": None, "max": None, "mean": None, "std": None, "nan": None, "inf": None, "zeros": None}
    if a.dtype.name == "bfloat16" or (a.dtype.kind == "V" and a.dtype.name.startswith("float")):
        a = a.astype(np.float32)  # ml_dtypes' small floats (bfloat16, float8_*): their values, exactly
    kind = a.dtype.kind
    if kind not in "biufc":
        return out
    if kind == "b":
        a = a.astype(np.uint8)
    finite = None
    if kind == "f":
        # one pass where every value is finite (the usual case), a second only to tell NaN from Inf
        finite = np.isfinite(a)
        bad = a.size - int(np.count_nonzero(finite))
        out["nan"] = int(np.count_nonzero(np.isnan(a))) if bad else 0
        out["inf"] = bad - out["nan"]
    elif kind == "c":  # a complex value may be NaN and Inf at once
        out["nan"] = int(np.count_nonzero(np.isnan(a)))
        out["inf"] = int(np.count_nonzero(np.isinf(a)))
    else:
        out["nan"] = out["inf"] = 0
    out["zeros"] = int(a.size - np.count_nonzero(a))
    if kind == "c" or a.size == 0:
        return out
    values = a if out["nan"] == out["inf"] == 0 else a[np.isfinite(a) if finite is None else finite]
    if values.size == 0:
        return out
    as_number = int if kind in "iu" else float
    out["min"] = as_number(values.min())
    out["max"] = as_number(values.max())
    block = 1 << 22
    with np.errstate(over="ignore", invalid="ignore"):
        # values.mean(dtype=float64) without its wrapper: the same float64 sum, divided by the count
        mean = np.add.reduce(values, axis=None, dtype=np.float64) / values.size
        # std without a float64 copy of huge inputs: E[(x - mean)^2] blockwise.
        flat = values.reshape(-1)
        if flat.size <= block:  # one block (a run file's small tensors: no loop, no slice)
            d = flat.astype(np.float64) - mean
            acc = float(np.dot(d, d))
        else:
            acc = 0.0
            for start in range(0, flat.size, block):
                d = flat[start:start + block].astype(np.float64) - mean
                acc += float(np.dot(d, d))
        std = (acc / flat.size) ** 0.5
    out["mean"] = float(mean) if np.isfinite(mean) else None
    out["std"] = float(std) if np.isfinite(std) else None
    return out


#: Arrays of at most this many values take :func:`_tiny_stats`.  NumPy's float64 sum of fewer than 8 values adds
#: them one after the other from 0.0 (its pairwise summation starts at 8), which a Python loop repeats exactly.
TINY = 7


def _tiny_stats(a):
    """:func:`tensor_stats` of a tiny array of plain numbers (bool, int, float16/32/64), the same values to
    the bit, in one pass over its values as Python numbers: NumPy's calls cost about 5-10 us each whatever
    the size, and a file of thousands of two-value datasets is made of them.  The sum of squares stays
    ``np.dot``'s (its BLAS may fuse the multiply-adds).  None where the result could depend on NumPy's
    choice between equal values (a +0.0 and a -0.0 both present): the general path then decides."""
    import math

    import numpy as np

    kind = a.dtype.kind
    out = {"min": None, "max": None, "mean": None, "std": None, "nan": 0, "inf": 0, "zeros": 0}
    values = a.ravel().tolist()
    if kind == "f":
        finite = []
        for v in values:
            if v - v == 0.0:
                finite.append(v)
            elif v != v:
                out["nan"] += 1
            else:
                out["inf"] += 1
        zeros = [math.copysign(1.0, v) for v in finite if v == 0.0]
        if len(set(zeros)) > 1:
            return None
        out["zeros"] = len(zeros)
        values = finite
    else:
        if kind == "b":
            values = [float(v) for v in values]  # the general path's figures of a bool array are floats
        out["zeros"] = values.count(0)
    if not values:
        return out
    out["min"], out["max"] = min(values), max(values)
    total = 0.0
    for v in values:
        total += v  # an integer as float64 first, as NumPy's cast does
    mean = total / len(values)
    if not math.isfinite(mean):  # an overflowing sum: the general path's std is then not finite either
        return out
    deviations = [v - mean for v in values]
    d = np.array(deviations, dtype=np.float64)
    if max(deviations) < 1e150 and -min(deviations) < 1e150:  # no square overflows: no errstate (as costly as the dot)
        acc = float(np.dot(d, d))
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            acc = float(np.dot(d, d))
    std = (acc / len(values)) ** 0.5
    out["mean"] = mean
    out["std"] = std if math.isfinite(std) else None
    return out


#: The dtype column of a run file's digest table (:mod:`qgcli.storage.hdf5.digests`).
DIGEST_TABLE = "sha256 digests"


def _tensor_entry(name, shape, dtype, attributes, *, stats=None, error=None):
    import math

    import numpy as np

    size = math.prod(shape) if shape is not None else 0  # exact ints, without np.prod's fixed cost
    if isinstance(dtype, np.dtype):  # an array's: its name once per dtype
        itemsize, dtype = dtype.itemsize, _dtype_name(dtype)
    else:
        try:
            itemsize = np.dtype(dtype).itemsize if dtype != "bfloat16" else 2
        except (TypeError, ValueError):  # "unknown", or the str() of a subarray dtype, which np.dtype() cannot parse
            itemsize = 0
    entry = {"name": name, "shape": None if shape is None else [int(s) for s in shape], "dtype": str(dtype),
             "size": size, "nbytes": size * itemsize}
    entry.update(stats if stats is not None else dict.fromkeys(("min", "max", "mean", "std", "nan", "inf", "zeros")))
    entry["attributes"] = attributes
    entry["error"] = error
    return entry


def _read_entry(container, name, attributes, with_stats, shape=None, dtype=None):
    """One tensor's entry; a tensor that cannot be read gets its error recorded, not a failed command."""
    from qgcli.errors import FileFormatError

    if not with_stats and shape is not None:
        return _tensor_entry(name, shape, dtype, attributes)
    try:
        array = container.read(name or None)
    except FileFormatError as exc:
        if shape is None:
            shape, dtype = container.header(name)  # what the header says (an npz member's), if anything
        return _tensor_entry(name, shape, dtype or "unknown", attributes, error=str(exc))
    stats = tensor_stats(array) if with_stats else None
    return _tensor_entry(name, array.shape, array.dtype, attributes, stats=stats)


def _h5_structure(source, *, label="-", layers=None, reads=None):
    """Groups (with attributes), datasets (path, shape, dtype, attributes) and non-hard links of an HDF5 file.

    One walk (:func:`qgcli.storage.hdf5.walk.walk`: HDF5's own visiting order, each object opened once relative to its
    parent, the file's bounds on depth and group count enforced).  Attributes are read in batches of
    :data:`ATTRIBUTE_BATCH` objects as the walk goes (one guarded round trip per batch for their strings),
    and each object is closed once its batch is read: the walk holds a bounded number of objects open,
    whatever the size of the file.  ``layers``: a list that receives the file's run-file layers
    (:func:`qgcli.families.groups.layer`), from the same walk.  ``reads``: ``(the container's label, which paths)``
    to read each of those datasets while the walk has it open: its entry gets ``read``, ``(shape, dtype,
    statistics, None)`` or ``(None, None, None, the error)``, what the container's own read gives.
    """
    import h5py

    from qgcli.families import groups as run_groups_of
    from qgcli.storage.hdf5 import digests, walk as h5walk
    from qgcli.storage.h5 import read_plain_dataset as read_plain, tagged_bfloat16
    from qgcli.signals import deferred

    groups, datasets, links = [], [], []
    run_groups, children = [], {"/": []}  # (path, raw attributes) and path -> [(name, shape, dtype)]
    pending = []  # (entry, object, whether a group) whose attributes the next batch reads

    def flush():
        for (entry, _, group), (attrs, raw) in zip(pending, _attributes_many([o for _, o, _ in pending])):
            entry["attributes"] = attrs
            if group:
                run_groups.append(("/" + entry["path"], raw))
        pending.clear()

    import io

    path = io.BytesIO(source) if isinstance(source, bytes) else source  # bytes: an HDF5 stream from stdin
    with deferred(), h5py.File(path, "r") as f:
        groups.append({"path": "/", "attributes": _attributes(f)})  # before the walk, which may fail after it
        for node in h5walk.walk(f, label=label, datasets="ids"):  # datasets as ids: h5py's wrapper where needed
            # A name that is not UTF-8 ends the listing with the decoding error, as h5py's path check ends it.
            name, kind = node.raw.decode("utf-8"), node.kind
            if kind in ("external", "soft", "hard"):
                links.append({"path": name, "kind": kind, "target": node.target})
            elif kind == "broken":
                datasets.append({"path": name, "shape": None, "dtype": "unknown", "attributes": {},
                                 "error": node.error})
            elif kind == "group":
                groups.append({"path": name})
                pending.append((groups[-1], node.obj, True))
                children["/" + name] = []
            elif kind == "dataset":
                obj = node.obj  # its DatasetID
                shape, file_dtype = obj.shape, obj.dtype  # each an HDF5 round trip: asked once
                numpy_dtype = _dtype_name(file_dtype)
                dtype = ("bfloat16" if file_dtype.kind == "u" and tagged_bfloat16(h5py.Dataset(obj, readonly=True))
                         else numpy_dtype)
                datasets.append({"path": name, "shape": shape, "dtype": dtype, "attributes": None, "error": None})
                if file_dtype.names is not None and name.rpartition("/")[2] == digests.DIGESTS:
                    # capture's digest table (a row per result verify compares): listed as such, not a tensor
                    datasets[-1]["dtype"] = DIGEST_TABLE
                    datasets[-1]["read"] = (shape, DIGEST_TABLE, None, None)
                elif reads is not None and shape is not None and reads[1](name):
                    # a small plain dataset in one low-level read (the usual case, no call or import per dataset)
                    array = read_plain(obj, shape, file_dtype)
                    datasets[-1]["read"] = (_read_open(obj, name, reads[0], shape, file_dtype) if array is None
                                            else (array.shape, array.dtype, tensor_stats(array), None))
                pending.append((datasets[-1], obj, False))
                parent, _, leaf = name.rpartition("/")
                children.get("/" + parent, []).append((leaf, shape, numpy_dtype))
            else:  # a committed datatype
                links.append({"path": name, "kind": "datatype", "target": str(getattr(node.obj, "dtype", ""))})
            if len(pending) >= ATTRIBUTE_BATCH:
                flush()
        flush()
    if layers is not None:
        for group_path, raw in run_groups:
            if isinstance(raw, Exception):
                continue  # unreadable attributes: the group's entry says so
            layer = run_groups_of.layer(group_path, raw, children[group_path])
            if layer is not None:
                layers.append(layer)
    return groups, datasets, links


@functools.lru_cache(maxsize=256)
def _dtype_name(dtype):
    """``str(dtype)``, once per dtype (NumPy builds the name anew on every call; a listing asks for thousands)."""
    return str(dtype)


def _read_open(dsid, name, label, shape, dtype):
    """What :func:`_read_entry` reads of a dataset, from the open DatasetID (as ``Container.read`` reads it), where
    the one-call read of a small plain dataset (:func:`qgcli.storage.h5.read_plain_dataset`) gave None."""
    import h5py

    from qgcli.storage import h5
    from qgcli.errors import FileFormatError

    try:
        obj = h5py.Dataset(dsid, readonly=True)
        array = h5.read_dataset_node(h5.checked_dataset(obj, name, label), name, label)
    except FileFormatError as exc:
        return None, None, None, str(exc)
    return array.shape, array.dtype, tensor_stats(array), None


def _attributes_many(objs):
    """``(attributes as JSON values, as read)`` of each of ``objs``, in one batch; object by object (so that
    a broken attribute table spoils its own entry only) where the batch fails, with the exception in place
    of the attributes as read."""
    from qgcli.errors import QgcliError
    from qgcli.storage.h5 import read_attributes, read_attributes_many

    try:
        return [({key: _plain(value) for key, value in raw.items()}, raw) for raw in read_attributes_many(objs)]
    except QgcliError:
        raise
    except Exception:  # noqa: BLE001 - found again, and recorded, by the object's own read
        pass
    out = []
    for obj in objs:
        try:
            raw = read_attributes(obj)
            out.append(({key: _plain(value) for key, value in raw.items()}, raw))
        except QgcliError:
            raise
        except Exception as exc:  # noqa: BLE001 - a broken attribute table must not stop the listing
            out.append(({"<unreadable>": f"{type(exc).__name__}: {exc}"}, exc))
    return out


#: Objects whose attributes are read in one batch.  A batch keeps its string attributes open until they are
#: read, and HDF5 checks every attribute it opens against all those open: one batch for the whole file made
#: the listing quadratic in the number of groups (20,000 groups: minutes).
ATTRIBUTE_BATCH = 256


def _matches(name, key):
    key = key.strip("/")
    return key == "" or name == key or name.startswith(key + "/")


def inspect_source(text, stdin, *, with_stats=True, progress=None):
    """The ``files[]`` entry of ``qgcli inspect --json`` for one FILE argument (path[:KEY] or -)."""
    from qgcli.storage import formats, io
    from qgcli.storage.checks import CORRUPT_FILE_ERRORS, reason
    from qgcli.errors import FileFormatError, OperandError, QgcliError

    spec = io.parse_spec(text)
    try:
        container = io.Container.open(spec.path, stdin)
    except FileFormatError as exc:
        raise OperandError(str(exc), operand="FILE") from None
    label = "-" if spec.path is None else spec.path
    fmt = formats.get(container.kind)
    size = len(stdin.read()) if spec.path is None else formats.size(fmt, spec.path)
    entry = {"file": label, "format": container.kind, "size_bytes": size, "key": spec.key, "attributes": {},
             "groups": [], "links": [], "tensors": [], "layers": []}
    with container:
        if not fmt.holds_many:
            if spec.key is not None:
                raise OperandError(f"{label} is an .npy file with one array; it has no key {spec.key!r}",
                                   operand="FILE")
            todo = [("", None, None, {}, None)]
        elif not fmt.hierarchical:  # flat keys (npz, safetensors, a Zarr store's arrays)
            entry["attributes"] = {key: _plain(value) for key, value in container.attributes().items()}
            names = [""] if getattr(container, "one_array", False) and spec.key is None else container.names()
            todo = [(n, None, None, {}, None) for n in names if spec.key is None or n == spec.key]
        else:  # HDF5: groups, links and run-file layers from one walk
            layers = []
            try:
                reads = (container.label, lambda p: spec.key is None or _matches(p, spec.key)) if with_stats else None
                groups, datasets, links = _h5_structure(spec.path if spec.path is not None else stdin.read(),
                                                        label=label, layers=layers, reads=reads)
            except QgcliError:
                raise  # the bounds on depth and group count (qgcli.storage.hdf5.walk): already one clean error
            except CORRUPT_FILE_ERRORS as exc:  # damaged HDF5 metadata: one clean error, not a traceback
                raise OperandError(f"{label}: cannot list its structure: {reason(exc)}", operand="FILE") from None
            entry["attributes"] = groups[0]["attributes"]
            entry["groups"] = [g for g in groups if spec.key is None or _matches(g["path"], spec.key)
                               or g["path"] == "/"]
            entry["links"] = [lk for lk in links if spec.key is None or _matches(lk["path"], spec.key)]
            entry["layers"] = _layers(layers, spec.key)
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
                todo.append((d["path"], d["shape"], d["dtype"], d["attributes"], d.get("read")))
        if spec.key is not None and not todo and not entry["tensors"]:
            raise OperandError(f"{label} has no tensor or group {spec.key!r}", operand="FILE")
        if progress is not None:
            progress.update(total=(progress.total or 0) + len(todo))
        for name, shape, dtype, attrs, done in todo:
            if progress is not None:
                progress.update(description=f"{label}:{name}" if name else label)
            if done is not None:  # read during the walk
                array_shape, array_dtype, stats, error = done
                entry["tensors"].append(_tensor_entry(name, shape, dtype or "unknown", attrs, error=error) if error
                                        else _tensor_entry(name, array_shape, array_dtype, attrs, stats=stats))
            else:
                entry["tensors"].append(_read_entry(container, name, attrs, with_stats, shape, dtype))
            if progress is not None:
                progress.advance()
    return entry


def _layers(layers, key):
    """A run file's groups as layers (path, op, operand shapes, what keeps one from running); [] for a file
    whose groups hold no op (a plain bundle)."""
    from qgcli.families import groups, registry

    out = []
    for layer in layers:
        if layer.path == "/" or (key is not None and not _matches(layer.path, key.strip("/"))):
            continue
        command = "bn-grad" if layer.kind == registry.BATCH_NORM else "fakequant"
        out.append({"path": layer.path, "op": layer.op, "kind": layer.kind,
                    "operands": {name: list(shape) for name, (shape, _) in layer.datasets.items()},
                    "problem": groups.validate(layer, command)})
    return out


# --- inspect: rendering ------------------------------------------------------------------------------

def _human_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _attr_text(attrs):
    return ", ".join(f"{k}={v}" for k, v in attrs.items())


def _provenance_line(attrs):
    if "qgcli_version" not in attrs:
        return None
    parts = [f"{k}={attrs[k]}" for k in _PROVENANCE[2:] if k in attrs]
    op = attrs.get("op", "an unnamed op")
    return f"written by qgcli {attrs['qgcli_version']}: {op}" + (f" ({', '.join(parts)})" if parts else "")


_TENSOR_COLS = _LAYER_COLS = None


def _columns():
    global _TENSOR_COLS, _LAYER_COLS
    if _TENSOR_COLS is None:
        from qgcli.report.tables import Col

        _TENSOR_COLS = (Col("name", "left", priority=0), Col("shape", "left", priority=0),
                        Col("dtype", "left", priority=0), Col("min", priority=1), Col("max", priority=1),
                        Col("mean", priority=2), Col("std", priority=2), Col("nan", priority=1),
                        Col("inf", priority=1), Col("zeros", priority=3), Col("size", priority=3))
        _LAYER_COLS = (Col("layer", "left", priority=0), Col("op", "left", priority=0),
                       Col("operands", "left", priority=0))


def render_inspect(console, doc):
    from rich.markup import escape
    from rich.text import Text

    from qgcli.report.tables import print_items, print_lines, print_table
    from qgcli.storage import formats
    from qgcli.report.text import printable_doc

    _columns()

    doc = printable_doc(doc)  # names, attributes and messages from the file: no control characters
    for i, f in enumerate(doc["files"]):
        if i:
            console.print()
        kind = formats.get(f["format"]).title
        count = len(f["tensors"])
        print_items(console, f"[bold]{escape(f['file'])}[/]  {kind}, {_human_bytes(f['size_bytes'])}, "
                      f"{count} tensor{'s' if count != 1 else ''}")
        file_attrs = dict(f["attributes"])
        line = _provenance_line(file_attrs)
        if line:
            print_items(console, f"  {escape(line)}")
            file_attrs = {k: v for k, v in file_attrs.items() if k not in _PROVENANCE}
        for k, v in file_attrs.items():
            print_items(console, f"  {k}: {v}", markup=False)
        if f.get("layers"):
            rows = []
            for lay in f["layers"]:
                shapes = ", ".join(f"{n} [{', '.join(map(str, s))}]" for n, s in lay["operands"].items())
                cell = Text(shapes)
                if lay["problem"]:
                    cell.append("  " + lay["problem"], style="red")
                rows.append([lay["path"], lay["op"] or "(bundle)", cell])
            print_table(console, _LAYER_COLS, rows, title=f"{counted(len(f['layers']), 'layer')} (run file)")
        notes, rows, styles = [], [], []
        for t in f["tensors"]:
            shape = "?" if t["shape"] is None else "[" + ", ".join(map(str, t["shape"])) + "]"
            bad = (t["nan"] or 0) + (t["inf"] or 0)
            styles.append("red" if t["error"] or bad else None)
            rows.append([t["name"] or "(array)", shape, t["dtype"], number(t["min"]), number(t["max"]),
                         number(t["mean"]), number(t["std"]), number(t["nan"]), number(t["inf"]), number(t["zeros"]),
                         _human_bytes(t["nbytes"])])
            if t["error"]:
                notes.append(f"{t['name']}: {t['error']}")
            extra = {k: v for k, v in t["attributes"].items() if f["attributes"].get(k, object()) != v}
            if extra:
                notes.append(f"{t['name']}: {_attr_text(extra)}")
        if f["tensors"]:
            cols, rows = _without_absent_statistics(f["tensors"], rows)
            print_table(console, cols, rows, styles=styles, choice=True)
        # Plain text, not markup: names escaped one by one still form a tag together ("[" + "/  (]").
        print_lines(console, [f"  group {g['path']}/" + (f"  ({_attr_text(g['attributes'])})" if g["attributes"] else "")
                              for g in f["groups"] if g["path"] != "/"], indent=4)
        for lk in f["links"]:
            how = {"external": "not followed", "soft": "not followed", "hard": "listed once"}.get(lk["kind"], "not a tensor")
            print_items(console, f"  {lk['kind']} link {lk['path']} -> {lk['target']} ({how})", markup=False)
        for note in notes:
            print_items(console, f"  [yellow]{escape(note)}[/]")


_STATISTICS = ("min", "max", "mean", "std", "nan", "inf", "zeros")


def _without_absent_statistics(tensors, rows):
    """The tensor table's columns and rows, less the statistics when no tensor has any (--no-stats): a column
    of dashes per statistic says nothing.  A --columns choice keeps every column it may name."""
    from qgcli.report.tables import CHOICE

    if CHOICE["columns"] is not None or any(t[k] is not None for t in tensors for k in _STATISTICS):
        return _TENSOR_COLS, rows
    keep = [i for i, c in enumerate(_TENSOR_COLS) if c.name not in _STATISTICS]
    return tuple(_TENSOR_COLS[i] for i in keep), [[r[i] for i in keep] for r in rows]


_INSPECT_EPILOG = """\b
Examples:
  qgcli inspect samples/per_channel.h5
  qgcli inspect grads.h5:backprops_wrt_input --json | jq '.files[0].tensors[0].zeros'
  qgcli fakequant-grad samples/per_channel.h5 -o - | qgcli inspect - --json
"""


@click.command("inspect", epilog=_INSPECT_EPILOG, short_help="List tensors, shapes, dtypes, statistics, attributes.")
@click.argument("files", nargs=-1, required=True, metavar="FILE...", type=click.Path(allow_dash=True))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout (see docs/formats.md).")
@click.option("--no-stats", is_flag=True, help="Names, shapes and dtypes only (HDF5: reads no data).")
@table_out_options(with_force=True)
@click.option("-q", "--quiet", is_flag=True, help="No progress or notes on stderr.")
@table_options
@hdf5_bound_options
def inspect(files, as_json, csv_out, parquet, force, no_stats, quiet):
    """Show what is in .npy/.npz/.h5 files: every tensor with its shape, dtype, min/max/mean/std over
    finite values, NaN/Inf/zero counts and size; HDF5 groups, attributes and links (never followed).

    FILE is a path, PATH:KEY (one npz key, or one HDF5 dataset or group), or - (an .npy/.npz stream
    on stdin, e.g. from another qgcli command's -o -). Works on any such file, not only qgcli's.
    """
    from qgcli import __version__
    from qgcli.storage import io
    from qgcli.report.progress import Progress

    if sum(1 for f in files if f == "-" or f.startswith("-:")) > 1:
        raise click.BadParameter("stdin (-) can be read only once", param_hint="FILE")
    from qgcli.report import table_out

    paths = [f.split(":")[0] for f in files if f != "-"]
    table_out.check(csv_out, parquet, force=force, inputs=paths, as_json=as_json)
    stdin = io.Stdin()
    doc = {"command": "inspect", "schema": INSPECT_SCHEMA, "qgcli_version": __version__, "files": []}
    from qgcli import collector

    # A listing of thousands of objects builds thousands of entries and no cycles (qgcli.collector).
    with collector.paused():
        with Progress("reading", total=0, quiet=quiet) as progress:
            for text in files:
                doc["files"].append(inspect_source(text, stdin, with_stats=not no_stats, progress=progress))
        # --csv / --parquet: one row per tensor of every file (its file first)
        table_out.write([{"file": f["file"], **t} for f in doc["files"] for t in f["tensors"]], csv=csv_out,
                        parquet=parquet, force=force, inputs=paths)
        if as_json:
            dump_json(doc)
        elif "-" not in (csv_out, parquet):
            render_inspect(stdout_console(), doc)
