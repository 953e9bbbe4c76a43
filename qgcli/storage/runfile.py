"""Run files: an HDF5 file whose groups each hold one op's operands ("a layer"), the op and its attributes
as group attributes, with the framework's own names.

:func:`is_run_file` tells a run file from a plain bundle, :func:`discover` lists the layers of a file (or of
one group of it) with their op, kind and attributes, and :func:`validate` finds what keeps a layer from
running, from the dataset shapes alone (nothing is read).  :func:`layer_job` turns a layer and the
command's options into the job of its family (:mod:`qgcli.jobs`): the group's attributes, except where an
option was given on the command line.  The layout is documented in docs/whole-models.md.
"""
from dataclasses import dataclass, field
from typing import Optional

FAKE_QUANT, BATCH_NORM = "fake-quant", "batch-norm"

#: ``op`` attribute -> (kind, family, variant or version).  ``...Gradient`` / ``...Grad`` spellings and a
#: ``torch.`` prefix are accepted too (see :func:`op_entry`).
OPS = {
    "FakeQuantWithMinMaxVarsPerChannel": (FAKE_QUANT, "tf", "per-channel"),
    "FakeQuantWithMinMaxVars": (FAKE_QUANT, "tf", "vars"),
    "FakeQuantWithMinMaxArgs": (FAKE_QUANT, "tf", "args"),
    "fake_quantize_per_tensor_affine": (FAKE_QUANT, "torch", None),
    "fake_quantize_per_channel_affine": (FAKE_QUANT, "torch", None),
    "QuantizeV2": (FAKE_QUANT, "quantize-dequantize", None),
    "FusedBatchNorm": (BATCH_NORM, "batch-norm", "v1"),
    "FusedBatchNormV2": (BATCH_NORM, "batch-norm", "v2"),
    "FusedBatchNormV3": (BATCH_NORM, "batch-norm", "v3"),
    # torchao's QAT fake quantizers (qgcli.capture.torch, fakequant --semantics torchao): the config is the
    # group's attributes, named after torchao's config fields (qgcli.families.torchao.config_from_attributes).
    "torchao.IntxFakeQuantizer": (FAKE_QUANT, "torchao", "intx"),
    "torchao.Float8FakeQuantizer": (FAKE_QUANT, "torchao", "float8"),
}

#: Operands (datasets) of each family: required, optional.
OPERANDS = {
    ("tf", "per-channel"): (("inputs", "min", "max"), ("gradients",)),
    ("tf", "vars"): (("inputs", "min", "max"), ("gradients",)),
    ("tf", "args"): (("inputs",), ("gradients",)),
    ("torch", None): (("inputs", "scale", "zero_point"), ("gradients",)),
    ("quantize-dequantize", None): (("inputs", "min", "max"), ("gradients",)),
    ("torchao", None): (("inputs",), ("gradients",)),
    ("batch-norm", None): (("y_backprop", "x", "scale", "reserve_space_1", "reserve_space_2"), ("reserve_space_3",)),
}

#: Datasets that make a group without ``op`` a layer (read as today's bundle).
_MARKERS = ("inputs", "x", "y_backprop")

KIND_OF_COMMAND = {"fakequant": FAKE_QUANT, "fakequant-grad": FAKE_QUANT, "bn-grad": BATCH_NORM,
                   "report": FAKE_QUANT}

_DATA_FORMATS = ("NHWC", "NCHW", "NDHWC", "NCDHW")
_VARIANCE_KINDS = ("variance", "inv-std", "auto")


def op_entry(op):
    """``(kind, family, variant)`` of an ``op`` attribute, or None when qgcli does not know it."""
    if op is None:
        return None
    name = op[len("torch."):] if op.startswith("torch.") else op
    for suffix in ("Gradient", "Grad"):
        if name not in OPS and name.endswith(suffix):
            name = name[: -len(suffix)]
    if name.startswith("FusedBatchNormGrad"):
        name = "FusedBatchNorm" + name[len("FusedBatchNormGrad"):]
    return OPS.get(name)


@dataclass
class Layer:
    """One group of a run file that holds (or should hold) one op's operands."""

    path: str
    op: Optional[str]
    kind: Optional[str]  # FAKE_QUANT, BATCH_NORM, or None (unknown op)
    family: Optional[str]
    variant: Optional[str]
    attrs: dict
    datasets: dict  # name -> (shape tuple, dtype str)
    error: Optional[str] = None
    notes: list = field(default_factory=list)

    @property
    def label(self):
        return self.op or "(bundle)"


def split_target(text):
    """``(path, group or None)`` of ``run.h5`` / ``run.h5:group/path``; None when ``text`` is no .h5 file."""
    from qgcli.storage import h5, io

    if text is None or text == "-" or text.startswith("-:"):
        return None
    spec = io.parse_spec(text)
    if spec.path is None or not spec.path.lower().endswith(h5.FORMAT.suffixes):
        return None
    group = spec.key.strip("/") if spec.key else None
    return spec.path, group or None


def open_target(target, *, operand, not_a_run_file):
    """``(path, group, container)`` of a run-file target (``run.h5`` or ``run.h5:group``), the container open;
    a QgcliError naming ``operand`` (``not_a_run_file`` when the target is no .h5 file)."""
    from qgcli.storage import io
    from qgcli.errors import FileFormatError, QgcliError

    where = split_target(target)
    if where is None:
        raise QgcliError(not_a_run_file, operand=operand)
    path, group = where
    try:
        return path, group, io.Container.open(path)
    except FileFormatError as exc:
        raise QgcliError(str(exc), operand=operand) from None


def is_run_file(text):
    """Whether BUNDLE ``text`` names a run file: ``file.h5:group`` always (the group must exist), a whole
    ``file.h5`` when its root holds no operands and some group below is a layer."""
    target = split_target(text)
    if target is None:
        return False
    path, group = target
    if group is not None:
        return True
    import os

    if not os.path.isfile(path):
        return False
    from qgcli.storage import io
    from qgcli.errors import FileFormatError, QgcliError

    try:
        with io.Container.open(path) as container:
            root = container._opened()
            if any(name in root for name in _MARKERS if _is_dataset(root, name)):
                return False
            return _has_layer(root, path)
    except FileFormatError:
        return False  # the single-bundle path reports it in its words
    except QgcliError:
        raise  # the bounds on depth and group count (qgcli.storage.hdf5.walk)
    except io.CORRUPT_FILE_ERRORS:
        return False  # damaged structure: the same


def _has_layer(root, label):
    """Whether some group below ``root`` is a layer: a walk over the groups (datasets unopened) that ends at
    the first one with an ``op`` attribute or a marker dataset."""
    from qgcli.storage.hdf5 import walk as h5walk
    from qgcli.signals import deferred

    found = []

    def layer(node):
        if node.kind == "group" and "op" in node.obj.attrs:
            found.append(node.path)
        elif node.kind == "dataset" and b"/" in node.raw and node.raw.rpartition(b"/")[2].decode("utf-8", "replace") \
                in _MARKERS:
            found.append(node.path)
        return bool(found)

    with deferred():
        for _ in h5walk.walk(root, label=label, operand="BUNDLE", datasets=False, stop=layer):
            pass
    return bool(found)


def _is_dataset(group, name):
    return _dataset(group, name) is not None


def _dataset(group, name, readonly=None):
    """The Dataset hard-linked as ``name`` in ``group`` (opened once), or None.  Low-level: one link
    lookup and one open (``group.get(name, getlink=True)`` then ``group[name]`` cost five times that)."""
    import h5py
    from h5py import h5l

    from qgcli.storage.h5 import h5_open

    try:
        raw = group._e(name)
        links = group.id.links
        if not links.exists(raw) or links.get_info(raw).type != h5l.TYPE_HARD:
            return None
        if readonly is None:
            readonly = group.file.mode == "r"
        obj = h5_open(group.id, raw, readonly=readonly)
    except Exception:  # noqa: BLE001 - damaged: not an operand
        return None
    return obj if isinstance(obj, h5py.Dataset) else None


def discover(handle, group=None, *, label=None, operand="BUNDLE"):
    """The layers of an open h5py File (under ``group`` when given), each with its op, attributes and the
    shapes of its datasets; a group that names no group is a FileFormatError.  One walk
    (:mod:`qgcli.storage.hdf5.walk`, whose bounds it enforces), the groups' attributes read in batches as it goes.
    Nothing stays open (holding every layer's open objects made memory grow with the file: 20,000 groups,
    1.2 GB): running a layer opens its group again, and reads the small datasets found here in one call each."""
    import h5py

    from qgcli.storage.hdf5 import walk as h5walk
    from qgcli.storage import h5
    from qgcli.storage.checks import reason
    from qgcli.errors import FileFormatError
    from qgcli.signals import deferred
    from qgcli.report.summaries import dtype_name

    label = label or handle.filename
    top = handle
    if group:
        node = h5.resolve(handle, group, label)
        if not isinstance(node, h5py.Group):
            raise FileFormatError(f"{label}: {group!r} is a dataset, not a group of a run file")
        top = node
    # Per group, in file order: [path, its attributes (or the error reading them), its open Group until
    # they are read].  A group with an op is read in batches as the walk goes and then closed, so that the
    # walk holds a bounded number of objects open (an open group costs ~17 KB, 20,000 of them 400 MB).
    groups, children, pending = [], {}, []

    def flush():
        for entry, attrs in zip(pending, _attributes_of([e[2] for e in pending])):
            entry[1], entry[2] = attrs, None
        pending.clear()

    def add(path, g):
        has_op = path != "/" and "op" in g.attrs  # the attribute first: such a group needs no look at its datasets
        groups.append([path, None, g if has_op else None])
        children[path] = []
        if has_op:
            pending.append(groups[-1])
            if len(pending) >= ATTRIBUTE_BATCH:
                flush()

    with deferred():
        add(top.name, top)
        for node in h5walk.walk(top, label=label, operand=operand, datasets="ids"):
            if node.kind == "group":
                add("/" + _text(node.raw), node.obj)
            elif node.kind == "dataset":
                parent, _, name = node.raw.rpartition(b"/")
                ds = node.obj  # a DatasetID, closed again at once: an open HDF5 dataset costs tens of KB
                where = "/" + _text(parent) if parent else "/"
                children[where].append((_text(name), ds.shape, dtype_name(ds.dtype)))
        flush()
        layers = []
        for path, attrs, _ in groups:
            datasets = children[path]
            if attrs is None:  # no op: a layer by its operands only, read now (today's bundles, rare in run files)
                if not any(name in _MARKERS for name, _, _ in datasets):
                    continue
                attrs = _attributes_of([top if path == top.name else handle.file[path]])[0]
            if isinstance(attrs, Exception):
                layers.append(Layer(path.lstrip("/") or "/", None, None, None, None, {}, {},
                                    error=f"cannot be read: {reason(attrs)}"))
            else:
                layers.append(layer(path, attrs, datasets))
    return layers


def _text(raw):
    return raw.decode("utf-8", "surrogateescape")


#: Groups whose attributes are read in one batch: a batch holds its string attributes open until they are
#: read, and HDF5 checks each attribute it opens against every open one (one batch for 20,000 groups took
#: minutes; 32 made 500 groups' reads 25% faster than 256, and costs 16 round trips to the guard thread).
ATTRIBUTE_BATCH = 32


def _attributes_of(groups):
    """Each group's attributes as read (one guarded round trip for their strings), group by group where the
    batch fails, with the error in place of the attributes of a group that cannot be read."""
    from qgcli.storage import h5, io
    from qgcli.errors import FileFormatError

    try:
        return h5.read_attributes_many(groups)
    except FileFormatError:
        raise
    except io.CORRUPT_FILE_ERRORS:
        pass
    out = []
    for g in groups:
        try:
            out.append(h5.read_attributes(g))
        except FileFormatError:
            raise
        except io.CORRUPT_FILE_ERRORS as exc:
            out.append(exc)
    return out


def layer(path, attrs, datasets):
    """The Layer of the group at ``path`` (absolute in the file) given its attributes as read and the
    datasets hard-linked in it (``[(name, shape, dtype)]``, in file order); None when the group is no layer
    (no ``op`` attribute, no marker dataset)."""
    name = path.lstrip("/") or "/"
    if not ((path != "/" and "op" in attrs) or any(n in _MARKERS for n, _, _ in datasets)):
        return None
    shapes = {n: (tuple(int(s) for s in shape), dtype) for n, shape, dtype in datasets
              if shape is not None}  # an HDF5 empty (null dataspace) dataset: no tensor
    return _layer(name, attrs, shapes)


def _layer(path, attrs, datasets):
    op = attrs.get("op")
    if op is not None and not isinstance(op, str):
        return Layer(path, str(op), None, None, None, attrs, datasets, error=f"op attribute {op!r} is not a string")
    if op is None:
        if "y_backprop" in datasets or "x" in datasets:
            return Layer(path, None, BATCH_NORM, "batch-norm", attrs.get("version"), attrs, datasets)
        if "scale" in datasets or "zero_point" in datasets:
            return Layer(path, None, FAKE_QUANT, "torch", None, attrs, datasets)
        return Layer(path, None, FAKE_QUANT, "tf", None, attrs, datasets)  # variant inferred as today
    entry = op_entry(op)
    if entry is None:
        known = ", ".join(OPS)
        return Layer(path, op, None, None, None, attrs, datasets, error=f"unknown op {op!r} (known: {known})")
    kind, family, variant = entry
    return Layer(path, op, kind, family, variant, attrs, datasets)


# --- validation: from shapes and attributes, nothing read ----------------------------------------------------

def validate(layer, command):
    """The reason ``layer`` cannot run under ``command`` (None when it can); records it in ``layer.error``."""
    if layer.error is None:
        layer.error = _problem(layer, command)
    return layer.error


def _problem(layer, command):
    fam = layer.family
    key = ("batch-norm", None) if fam == "batch-norm" else (fam, layer.variant if fam == "tf" else None)
    if fam == "tf" and layer.variant is None:
        key = ("tf", "vars")
    required, _ = OPERANDS[key]
    missing = [n for n in required if n not in layer.datasets]
    if command == "fakequant-grad" and "gradients" not in layer.datasets:
        missing.append("gradients")
    if missing:
        return f"missing operand{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
    a = layer.attrs
    for name in ("num_bits", "quant_min", "quant_max", "axis"):
        if name in a and not _is_int(a[name]):
            return f"attribute {name}={a[name]!r} is not an integer"
    for name in ("narrow_range", "is_training"):
        if name in a and not _is_bool(a[name]):
            return f"attribute {name}={a[name]!r} is not a boolean"
    if "num_bits" in a and not 2 <= int(a["num_bits"]) <= 16:
        return f"attribute num_bits={int(a['num_bits'])} is not in 2..16"
    for name in ("epsilon", "min", "max", "ensure_minimum_range"):
        if name in a and not _is_real(a[name]):
            return f"attribute {name}={a[name]!r} is not a number"
    if fam == "torchao":
        from qgcli.families.torchao import config_from_attributes

        try:
            config_from_attributes(a)
        except (ValueError, TypeError) as exc:
            return f"attribute {exc}"
    if "data_format" in a and a["data_format"] not in _DATA_FORMATS:
        return f"attribute data_format={a['data_format']!r} is not one of {', '.join(_DATA_FORMATS)}"
    if "variance_kind" in a and a["variance_kind"] not in _VARIANCE_KINDS:
        return f"attribute variance_kind={a['variance_kind']!r} is not one of {', '.join(_VARIANCE_KINDS)}"
    shapes = {k: v[0] for k, v in layer.datasets.items()}
    if "gradients" in shapes and command == "fakequant-grad" and shapes["gradients"] != shapes["inputs"]:
        return f"gradients shape {list(shapes['gradients'])} differs from inputs shape {list(shapes['inputs'])}"
    if fam == "tf" and layer.variant == "per-channel":
        x = shapes["inputs"]
        axis = int(a.get("axis", -1))
        if not x or not -len(x) <= axis < len(x):
            return f"axis {axis} is out of range for inputs of shape {list(x)}"
        depth = x[axis]
        for name in ("min", "max"):
            if shapes[name] != (depth,):
                return f"{name} has shape {list(shapes[name])}, expected [{depth}] (one per channel of axis {axis})"
    if fam == "tf" and layer.variant == "vars":
        for name in ("min", "max"):
            if shapes[name] not in ((), (1,)):
                return f"{name} has shape {list(shapes[name])}; FakeQuantWithMinMaxVars takes a scalar"
    if fam == "tf" and layer.variant == "args":
        for name in ("min", "max"):
            if name in shapes:
                return f"FakeQuantWithMinMaxArgs takes {name} as an attribute, not a dataset"
    if fam == "torch":
        if shapes["scale"] != shapes["zero_point"] and (len(shapes["scale"]) > 1 or len(shapes["zero_point"]) > 1
                                                        or _size(shapes["scale"]) != _size(shapes["zero_point"])):
            return f"zero_point shape {list(shapes['zero_point'])} differs from scale shape {list(shapes['scale'])}"
        if layer.op and "per_channel" in layer.op and _size(shapes["scale"]) > 1 and "axis" not in a:
            return "a per-channel PyTorch op needs the attribute axis"
    if fam == "batch-norm":
        x = shapes["x"]
        if shapes["y_backprop"] != x:
            return f"y_backprop shape {list(shapes['y_backprop'])} differs from x shape {list(x)}"
        if len(x) not in (4, 5):
            return f"x has rank {len(x)}; FusedBatchNormGrad takes 4-D (or 5-D) x"
        fmt = a.get("data_format") or ("NDHWC" if len(x) == 5 else "NHWC")
        depth = x[1] if fmt.startswith("NC") else x[-1]
        for name in ("scale", "reserve_space_1", "reserve_space_2"):
            if shapes[name] != (depth,):
                return f"{name} has shape {list(shapes[name])}, expected [{depth}] (the channels of x, {fmt})"
    return None


def _size(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _is_int(v):
    import numpy as np

    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_bool(v):
    import numpy as np

    return isinstance(v, (bool, np.bool_)) or (isinstance(v, (int, np.integer)) and int(v) in (0, 1))


def _is_real(v):
    import math

    import numpy as np

    return (isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
            and math.isfinite(float(v)))


# --- a layer's job ---------------------------------------------------------------------------------------------

#: Command-line options that may override a group's attributes: job field -> option.
OVERRIDABLE = {
    "num_bits": "--num-bits", "narrow_range": "--narrow-range", "axis": "--axis", "quant_min": "--quant-min",
    "quant_max": "--quant-max", "epsilon": "--epsilon", "data_format": "--data-format",
    "is_training": "--is-training", "variance_kind": "--variance-kind", "version": "--version",
    "dtype": "--dtype", "mode": "--mode", "round_mode": "--round-mode", "ensure_minimum_range": "--ensure-minimum-range",
}


def layer_job(run, layer, operand_specs, output):
    """The job (FakeQuantJob / BatchNormJob) that runs ``layer`` under the run-file job ``run``, and the
    overrides applied: ``{attribute: {"group": value in the file, "option": value given}}``."""
    from qgcli.jobs import BatchNormJob, FakeQuantJob

    a, given = layer.attrs, dict(run.options)
    overrides = {}

    def pick(name, default):
        if name in given:
            if name in a and _plain(a[name]) != given[name]:
                overrides[name] = {"group": _plain(a[name]), "option": given[name]}
            return given[name]
        return _plain(a[name]) if name in a else default

    if layer.family == "batch-norm":
        version = pick("version", layer.variant or "v3")
        job = BatchNormJob(operand_specs, output, epsilon=float(pick("epsilon", 1e-4)),
                           data_format=pick("data_format", None), is_training=bool(pick("is_training", True)),
                           variance_kind=pick("variance_kind", "variance"), version=version,
                           all_outputs=run.all_outputs)
        return job, overrides
    if layer.family == "torchao":
        return _torchao_job(run, layer, operand_specs, output, given), overrides
    from qgcli.jobs import ESTIMATOR, QUANTIZE_DEQUANTIZE, TF, TORCH

    est = run.estimator
    common = dict(command=run.command, with_gradients=run.with_gradients, operands=operand_specs, output=output,
                  estimator=est, grad_factor=run.grad_factor)
    narrow_range = bool(pick("narrow_range", False))
    axis = pick("axis", None)
    axis = None if axis is None else int(axis)
    if layer.family == "torch":
        from qgcli.ops import fake_quant, torch_semantics

        num_bits = int(pick("num_bits", 8))
        lo, hi = fake_quant.quant_range(num_bits, narrow_range)
        quant_min, quant_max = torch_semantics.check_quant_range(int(pick("quant_min", lo)), int(pick("quant_max", hi)))
        return FakeQuantJob(family=TORCH, num_bits=num_bits, narrow_range=narrow_range, axis=axis,
                            quant_min=quant_min, quant_max=quant_max, **common), overrides
    if layer.family == "quantize-dequantize":
        from qgcli.jobs import QuantizeAttributes

        if "dtype" not in a and "T" in a:
            a = {**a, "dtype": a["T"]}
            layer.attrs = a
        dtype = pick("dtype", None)
        emr = pick("ensure_minimum_range", None)
        quantize = QuantizeAttributes(dtype=None if dtype is None else str(dtype).lower().replace("dt_", ""),
                                      mode=pick("mode", None), round_mode=pick("round_mode", None),
                                      ensure_minimum_range=None if emr is None else float(emr))
        if est is not None and est.name == "ste":
            common["estimator"] = None
        return FakeQuantJob(family=QUANTIZE_DEQUANTIZE, narrow_range=narrow_range, variant="quantize-dequantize",
                            axis=axis, quantize=quantize.resolved(), **common), overrides
    family = TF if est is None or est.name == "ste" else ESTIMATOR
    if family == TF:
        common["estimator"] = None
    variant = layer.variant
    if variant != "per-channel":
        axis = None  # --axis concerns the per-channel groups only
        overrides.pop("axis", None)
    return FakeQuantJob(family=family, num_bits=int(pick("num_bits", 8)), narrow_range=narrow_range, variant=variant,
                        axis=axis, **common), overrides


def _torchao_job(run, layer, operand_specs, output, given):
    """A torchao group runs its own config: the options of the other families do not apply to it."""
    from qgcli.errors import QgcliError
    from qgcli.jobs import TORCHAO, FakeQuantJob
    from qgcli.families.torchao import config_from_attributes

    for name in given:
        raise QgcliError(f"{OVERRIDABLE.get(name, name)} does not apply to a torchao group (its config is the "
                         "group's attributes)")
    if run.estimator is not None:
        raise QgcliError("--estimator does not apply to a torchao group (torchao's gradient is its own autograd)")
    return FakeQuantJob(command=run.command, family=TORCHAO, with_gradients=run.with_gradients,
                        operands=operand_specs, output=output, torchao=config_from_attributes(layer.attrs))


def _plain(v):
    import numpy as np

    if isinstance(v, np.generic):
        return v.item()
    return v
