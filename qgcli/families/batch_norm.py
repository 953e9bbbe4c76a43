"""TensorFlow's FusedBatchNormGrad (V1/V2/V3) on a job's operands, in memory or in blocks (two passes).

The statistics convention (what reserve_space_2 holds: the variance or cuDNN's inverse std, or found out
from x with ``auto``), the dtype rules of each version and the summary with per-channel norms.
"""
import numpy as np

from qgcli.backend import to_numpy
from qgcli.errors import OptionError

from qgcli.families.registry import BATCH_NORM
from qgcli.jobs import BatchNormJob, Result
from qgcli.ops import batch_norm as bn
from qgcli.ops.batch_norm import channel_norms, placeholder_outputs, VERSIONS
from qgcli.ops.out_array import can_take
from qgcli.report.tables import Col, print_items, print_table
from qgcli.storage.operands import to_device
from qgcli.report.summaries import describe_arrays, json_safe

NAME, KIND = "batch-norm", BATCH_NORM
LITERAL_OK = ("scale", "reserve_space_1", "reserve_space_2", "reserve_space_3")
#: Run-file ``op`` -> version (``FusedBatchNormGrad...`` spellings too: :func:`qgcli.families.registry.op_entry`).
RUN_FILE_OPS = {"FusedBatchNorm": "v1", "FusedBatchNormV2": "v2", "FusedBatchNormV3": "v3"}
GROUP_OPERANDS = {None: (("y_backprop", "x", "scale", "reserve_space_1", "reserve_space_2"), ("reserve_space_3",))}
#: The upstream gradient's dataset (a group without it is forward only: bn-grad leaves it out).
UPSTREAM_GRADIENT = "y_backprop"
#: ``report`` reports quantizers only.
REPORT_SKIP = "not a quantizer"
#: In row blocks the statistics need a pass of their own before the gradients (qgcli.execution.zarr_batch_norm).
TWO_PASS_BLOCKS = True

OPERANDS = ("y_backprop", "x", "scale", "reserve_space_1", "reserve_space_2", "reserve_space_3")
OUTPUTS = ("x_backprop", "scale_backprop", "offset_backprop")

_CONVENTION_WORDS = {
    "variance": "reserve_space_2 read as the biased batch variance (TensorFlow's CPU convention, --variance-kind "
                "variance; try --variance-kind auto to check it against x)",
    "inv-std": "reserve_space_2 read as 1/sqrt(variance + epsilon) (cuDNN's saved inverse std, --variance-kind "
               "inv-std); epsilon does not enter the result",
}


def _load(operands, version, variance_kind, is_training, explicit_rs3):
    """The raw operands (NumPy) and notes about what was ignored."""
    notes = []
    raw = {name: operands.get(name) for name in OPERANDS[:5]}
    if version != "v3" and explicit_rs3:
        raise OptionError(f"only --version v3 (FusedBatchNormGradV3) takes it, not {version}",
                                 param_hint="'--reserve-space-3'")
    if version == "v3" and operands.has("reserve_space_3"):
        raw["reserve_space_3"] = operands.get("reserve_space_3")
        notes.append("reserve_space_3 is ignored, as on TensorFlow's CPU")
    elif operands.has("reserve_space_3"):
        notes.append(f"the bundle's reserve_space_3 is ignored: {version} has no such input")
    if variance_kind == "auto" and not is_training:
        raise OptionError("needs --is-training: population statistics cannot be recomputed from x",
                                 param_hint="'--variance-kind auto'")
    return raw, notes


def _dtype_notes(raw):
    notes = []
    for name in ("x", "y_backprop"):
        dtype = str(getattr(raw[name], "dtype", ""))
        if dtype == "float64":
            notes.append(f"{name} is float64, which TensorFlow's kernels do not take: computed as float32")
    for name in ("scale", "reserve_space_1", "reserve_space_2"):
        dtype = str(getattr(raw[name], "dtype", "float32"))
        if dtype not in ("float32",) and getattr(raw[name], "ndim", 0) > 0:
            notes.append(f"{name} is {dtype}; rounded to float32 (TensorFlow's type for it)")
    return notes


def run_bn_grad(raw, *, epsilon, data_format, is_training, variance_kind, version, device, overwrite=False):
    """Detect the convention if asked, run the op; returns (outputs, convention dict).  ``overwrite``:
    ``raw["y_backprop"]`` is this job's own array, read by nothing afterwards, so x_backprop may take its
    buffer."""
    bn.batch_norm_grad_version(version, x_dtype=getattr(raw["x"], "dtype", None), data_format=data_format,
                               y_backprop_dtype=getattr(raw["y_backprop"], "dtype", None))
    convention = {"kind": None, "variance_kind": variance_kind}
    rs2 = raw["reserve_space_2"]
    # CuPy has no bfloat16: widen on the host, compute, round back on the host.
    bf16 = device == "gpu" and any(getattr(raw[k], "dtype", None) is not None and raw[k].dtype.name == "bfloat16"
                                   for k in ("x", "y_backprop"))
    dy, x = raw["y_backprop"], raw["x"]
    if bf16:
        dy, x = np.asarray(dy, np.float32), np.asarray(x, np.float32)
    xp, (dy, x) = to_device([dy, x], device)
    if variance_kind == "auto":
        found = bn.detect_variance_convention(x, raw["reserve_space_1"], rs2, epsilon=epsilon,
                                              data_format=data_format)
        rs2 = found.reserve_space_2
        convention.update(kind=found.kind, variance_kind=found.variance_kind, description=found.description,
                          n=found.n, mismatch={k: v for k, v in found.mismatch.items()})
    elif not is_training:
        convention["description"] = (
            "reserve_space_1/2 read as the population mean and variance (is_training=False)"
            if variance_kind == "variance" else
            "reserve_space_1 read as the population mean, reserve_space_2 as 1/sqrt(variance + epsilon) "
            "(--variance-kind inv-std)")
    else:
        convention["description"] = _CONVENTION_WORDS[variance_kind]
    # Widened bfloat16: x_backprop rounded to odd in float32, so that narrowing it below rounds only once.
    op = bn.fused_batch_norm_grad_to_odd if bf16 else bn.fused_batch_norm_grad
    reuse = overwrite and dy.dtype == x.dtype and dy.dtype.itemsize <= 4 and can_take(dy, x)
    dx, dscale, doffset = op(
        dy, x, raw["scale"], raw["reserve_space_1"], rs2, epsilon=epsilon, data_format=data_format,
        is_training=is_training, variance_kind=convention["variance_kind"], out=dy if reuse else None)
    dx, dscale, doffset = to_numpy(dx), to_numpy(dscale), to_numpy(doffset)
    if bf16:
        dx = dx.astype(raw["x"].dtype)
    return {"x_backprop": dx, "scale_backprop": dscale, "offset_backprop": doffset}, convention


def nonfinite_notes(counts):
    """A note per output holding NaN or inf (``counts``: output name -> how many), in memory and streamed."""
    return [f"{name} has {count} non-finite values (NaN/inf propagate as in TensorFlow)"
            for name, count in counts.items() if count]


def nonfinite_counts(arrays):
    """The NaN/inf count of each array (name -> count)."""
    return {k: int(np.size(v) - np.isfinite(np.asarray(v, np.float32)).sum()) for k, v in arrays.items()}


def build_summary(op, attrs, operands, raw, outputs, convention, notes, output, *, with_norms=True):
    """The summary; without ``with_norms`` (nobody will see it) x_backprop is not read again: no norms, and
    its non-finite values are not counted."""
    dx, norms = outputs["x_backprop"], None
    if with_norms:
        norms = channel_norms(dx, attrs["data_format"]) if dx.size else np.zeros(outputs["scale_backprop"].shape)
    # A NaN or inf in a channel makes its float64 sum of squares non-finite: with every norm finite,
    # x_backprop holds none, and its full-size isfinite pass (a third of the summary's time) is skipped.
    nonfinite = nonfinite_counts({k: v for k, v in outputs.items() if k != "x_backprop" or (
        norms is not None and not np.isfinite(norms).all())})
    notes = list(notes) + nonfinite_notes({k: nonfinite.get(k, 0) for k in outputs})
    inputs = describe_arrays({k: v for k, v in raw.items() if v is not None})
    for name, source in operands.sources.items():
        if name in inputs:
            inputs[name]["source"] = source
    per_channel = {
        "x_backprop_norm": None if norms is None else [float(v) for v in norms],
        "scale_backprop": [float(v) for v in outputs["scale_backprop"]],
        "offset_backprop": [float(v) for v in outputs["offset_backprop"]],
    }
    return json_safe({
        "command": "bn-grad",
        "op": op,
        "attributes": attrs,
        "convention": convention,
        "inputs": inputs,
        "channels": len(per_channel["scale_backprop"]),
        "per_channel": per_channel,
        "norms": {
            "x_backprop": None if norms is None else float(np.sqrt(np.sum(norms.astype(np.float64) ** 2))),
            "scale_backprop": float(np.linalg.norm(outputs["scale_backprop"].astype(np.float64))),
            "offset_backprop": float(np.linalg.norm(outputs["offset_backprop"].astype(np.float64))),
        },
        "outputs": describe_arrays(outputs),
        "output": output,
        "notes": notes,
    })


def compute(job, operands):
    raw, notes = _load(operands, job.version, job.variance_kind, job.is_training,
                       job.operands.get("reserve_space_3") is not None)
    data_format = job.data_format
    if data_format is None:
        data_format = "NDHWC" if getattr(raw["x"], "ndim", 0) == 5 else "NHWC"
    notes += _dtype_notes(raw)
    if not job.is_training and data_format in ("NCHW", "NCDHW"):
        notes.append(f"TensorFlow's CPU kernel refuses {data_format} with is_training=False; computed as its "
                     "registered gradient does (transposed to channels-last)")
    outputs, convention = run_bn_grad(raw, epsilon=job.epsilon, data_format=data_format, is_training=job.is_training,
                                      variance_kind=job.variance_kind, version=job.version, device=job.output.device,
                                      overwrite=True)

    op = VERSIONS[job.version].op
    attrs = {"op": op, "epsilon": job.epsilon, "data_format": data_format, "is_training": job.is_training,
             "version": job.version, "variance_kind": convention["variance_kind"]}
    if convention.get("kind"):
        attrs["variance_convention"] = convention["kind"]
    summary = build_summary(op, attrs, operands, raw, outputs, convention, notes, job.output.destination,
                            with_norms=job.output.shows_summary)
    if job.all_outputs:
        outputs.update(placeholder_outputs(job.version))
        summary["outputs"] = describe_arrays(outputs)
    return Result(outputs, attrs, summary)


def dtype_of(ds):
    """The dtype of an unread HDF5 dataset or Zarr array, bfloat16 where qgcli's tag says so."""
    from qgcli.storage import io

    if io.tagged_bfloat16(ds):
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return ds.dtype


def block_setup(job, operands, datasets):
    """What bn-grad computed block by block (:mod:`qgcli.execution.blocks`) needs besides the blocks (HDF5
    datasets or Zarr arrays, unread): the block algorithm (``blocks``: two passes), ``data_format``, the
    per-channel operands ``small_in`` (read), the op's parameters, ``attrs``, ``op``, the large ``output``'s
    name, the ``extra_outputs`` (V3's placeholders) and what the summary lacks (``not_computed``)."""
    if job.variance_kind == "auto":
        raise OptionError("is not available when x is streamed from disk; name the convention "
                                 "(variance or inv-std) or raise --memory-limit", param_hint="'--variance-kind auto'")
    x_ds, dy_ds = datasets["x"], datasets["y_backprop"]
    data_format = job.data_format
    if data_format is None:
        data_format = "NDHWC" if x_ds.ndim == 5 else "NHWC"
    bn.batch_norm_grad_version(job.version, x_dtype=dtype_of(x_ds), data_format=data_format,
                               y_backprop_dtype=dtype_of(dy_ds))
    small_in = {name: operands.get(name) for name in ("scale", "reserve_space_1", "reserve_space_2")}
    op = bn.VERSIONS[job.version].op
    attrs = {"op": op, "epsilon": job.epsilon, "data_format": data_format, "is_training": job.is_training,
             "version": job.version, "variance_kind": job.variance_kind}
    return {"blocks": "two-pass", "data_format": data_format, "small_in": small_in, "epsilon": job.epsilon,
            "is_training": job.is_training, "variance_kind": job.variance_kind, "attrs": attrs, "op": op,
            "output": "x_backprop", "extra_outputs": bn.placeholder_outputs(job.version) if job.all_outputs else {},
            "not_computed": "x_backprop norms"}


def block_summary(job, operands, datasets, setup, small, notes):
    """The summary of bn-grad computed block by block (:func:`block_setup`; ``small``: the per-channel outputs)."""
    x_ds, op, attrs = datasets["x"], setup["op"], setup["attrs"]
    channels = len(small["scale_backprop"])
    outputs = {"x_backprop": {"shape": list(x_ds.shape), "dtype": str(dtype_of(x_ds))},
               **{k: {"shape": list(np.shape(v)), "dtype": str(np.asarray(v).dtype)} for k, v in small.items()}}
    kind = "a variance" if job.variance_kind == "variance" else "1/sqrt(var + eps)"
    return json_safe({
        "command": "bn-grad", "op": op, "attributes": attrs,
        "convention": {"kind": None, "variance_kind": job.variance_kind,
                       "description": f"reserve_space_2 read as {kind}"},
        "inputs": {n: {"shape": list(ds.shape), "dtype": str(dtype_of(ds)), "source": operands.sources.get(n, n)}
                   for n, ds in datasets.items()},
        "channels": channels,
        "per_channel": {"x_backprop_norm": [None] * channels,
                        "scale_backprop": [float(v) for v in small["scale_backprop"]],
                        "offset_backprop": [float(v) for v in small["offset_backprop"]]},
        "norms": {"x_backprop": None,
                  "scale_backprop": float(np.linalg.norm(np.asarray(small["scale_backprop"], np.float64))),
                  "offset_backprop": float(np.linalg.norm(np.asarray(small["offset_backprop"], np.float64)))},
        "outputs": outputs, "output": job.output.destination,
        # x_backprop's NaN/inf counted block by block as it was written; the per-channel outputs here
        "notes": list(notes) + nonfinite_notes({"x_backprop": sum(setup.get("nonfinite", ())),
                                                **nonfinite_counts({k: small[k] for k in OUTPUTS[1:]})}),
    })


# --- the job of a run-file group, its checks, its summary ---------------------------------------------------

def group_problem(layer, shapes):
    x = shapes["x"]
    if shapes["y_backprop"] != x:
        return f"y_backprop shape {list(shapes['y_backprop'])} differs from x shape {list(x)}"
    if len(x) not in (4, 5):
        return f"x has rank {len(x)}; FusedBatchNormGrad takes 4-D (or 5-D) x"
    fmt = layer.attrs.get("data_format") or ("NDHWC" if len(x) == 5 else "NHWC")
    depth = x[1] if fmt.startswith("NC") else x[-1]
    for name in ("scale", "reserve_space_1", "reserve_space_2"):
        if shapes[name] != (depth,):
            return f"{name} has shape {list(shapes[name])}, expected [{depth}] (the channels of x, {fmt})"
    return None


def job_from_group(run, layer, operand_specs, output, pick):
    version = pick("version", layer.variant or "v3")
    return BatchNormJob(operand_specs, output, epsilon=float(pick("epsilon", 1e-4)),
                        data_format=pick("data_format", None), is_training=bool(pick("is_training", True)),
                        variance_kind=pick("variance_kind", "variance"), version=version,
                        all_outputs=run.all_outputs)


def mode(job):
    return "bn-grad"


def render(console, s):
    from rich.markup import escape

    a = s["attributes"]
    x = s["inputs"].get("x", {})
    phase = "training" if a["is_training"] else "inference"
    print_items(console, f"[bold]{s['op']}[/] epsilon={a['epsilon']:g} {a['data_format']} {phase}  "
                  f"x {x.get('shape', [])} {escape(str(x.get('dtype', '')))}", soft_wrap=True)
    print_items(console, f"convention: {escape(s['convention']['description'])}", soft_wrap=True)
    pc = s["per_channel"]
    count = s["channels"]
    rows = [[f"ch {c}", *(_fmt(pc[k][c]) for k in ("x_backprop_norm", "scale_backprop", "offset_backprop"))]
            for c in range(min(count, 8))]
    if count > 8:
        rows.append([f"... {count - 8} more", "", "", ""])
    n = s["norms"]
    rows.append(["L2 norm", _fmt(n["x_backprop"]), _fmt(n["scale_backprop"]), _fmt(n["offset_backprop"])])
    cols = (Col("", "left", priority=0), Col("|x_backprop|", priority=0), Col("scale_backprop", priority=0),
            Col("offset_backprop", priority=0))
    print_table(console, cols, rows)
    for note in s["notes"]:
        print_items(console, f"[yellow]note:[/] {escape(note)}", soft_wrap=True)
    if s["output"] and s["output"] != "-":
        print_items(console, f"wrote {', '.join(s['outputs'])} to {escape(s['output'])}", soft_wrap=True)


def _fmt(v):
    return "nan" if v is None else f"{v:.7g}"
