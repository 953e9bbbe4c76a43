"""``qgcli verify``: recompute every group of a run file with qgcli and compare with the framework's own
results stored beside it (``<group>/reference/``, and those kept as digests in the step's digest table,
:mod:`qgcli.storage.hdf5.digests`; written by :mod:`qgcli.capture`).

Each group runs through the runner of its family exactly as ``fakequant`` / ``fakequant-grad`` / ``bn-grad``
run it over a run file (:func:`qgcli.families.groups.job_from_group`, the group's attributes; no option overrides), and
every output that the reference holds is compared: bitwise, the largest difference in units in the last
place (ulps) and the largest absolute difference relative to the largest reference value.

Pass rules: a fake-quant layer's element-wise outputs (``outputs``, ``backprops_wrt_input``) must be bit
for bit the framework's; every batch-norm output must be within ``rtol`` of the largest reference value or,
element by element, within float32's summation bound of its sums (:func:`_batch_norm_bound`; ``bound`` in
``--json`` gives its largest value).
A fake-quant layer's reductions (``backprop_wrt_min/max``, LSQ's ``backprop_wrt_scale`` /
``backprop_wrt_zero_point``) are sums whose order the framework picks, and they cancel (a batch norm after
the quantizer makes the upstream gradient sum to about zero): they pass within ``rtol`` of the largest value
or within float32's worst-case summation error ``n * 2**-23 * sum(|term|)`` (``n`` terms per sum: the
gradient for TensorFlow's min/max, LSQ's per-element terms recomputed from the stored operands), whichever
is larger; ``bound`` in ``--json`` gives it.

torchao groups (``torchao.IntxFakeQuantizer`` / ``torchao.Float8FakeQuantizer``): ``outputs`` and the computed
``scale`` / ``zero_point`` bit for bit; ``backprops_wrt_input`` within ``rtol`` of the largest reference value
(the float8 gradient's scale path sums each block, in an order torch picks).
"""

import hashlib

import numpy as np

from qgcli.backend import to_numpy
from qgcli.errors import QgcliError
from qgcli.execution.dispatch import runner_for
from qgcli.families import groups, registry, tf_fake_quant
from qgcli.jobs import OutputOptions, RunFileJob
from qgcli.report.summaries import json_safe
from qgcli.storage import runfile
from qgcli.storage.hdf5.digests import Digest, digests_of
from qgcli.storage.operands import Operands

#: Fake-quant outputs computed element by element: bit-identical or failed (``backprops``: the input gradient
#: of FakeQuantWithMinMaxArgs, under TensorFlow's name).
ELEMENTWISE = ("outputs", "backprops_wrt_input", "backprops")
REFERENCE = "reference"
DEFAULT_RTOL = 1e-5


def _compare_digest(ours, theirs):
    out = {"shape": list(theirs.shape), "dtype": str(theirs.dtype), "identical": False, "max_ulps": None,
           "max_abs": None, "rel": None, "largest": None, "mismatches": None, "digest": "sha256"}
    a = np.asarray(ours)
    if a.size != int(np.prod(theirs.shape, dtype=np.int64)):
        out["error"] = f"shape {list(a.shape)} differs from the reference's {list(theirs.shape)}"
        return out
    a = np.ascontiguousarray(a.reshape(theirs.shape).astype(theirs.dtype, copy=False))
    if hashlib.sha256(memoryview(a).cast("B")).digest() == theirs.sha256:
        out.update(identical=True, max_ulps=0, max_abs=0.0, rel=0.0, mismatches=0)
    else:
        out["error"] = "differs from the reference's SHA-256 (the values are not stored)"
    return out


def compare(ours, theirs):
    """Differences between qgcli's array ``ours`` and the reference ``theirs`` (a JSON-safe dict)."""
    if isinstance(theirs, Digest):
        return _compare_digest(ours, theirs)
    a, b = np.asarray(ours), np.asarray(theirs)
    out = {"shape": list(b.shape), "dtype": str(b.dtype), "identical": False, "max_ulps": None,
           "max_abs": None, "rel": None, "largest": None, "mismatches": None}
    if a.shape != b.shape:
        if a.size == b.size:
            a = a.reshape(b.shape)
        else:
            out["error"] = f"shape {list(a.shape)} differs from the reference's {list(b.shape)}"
            return out
    dtype = b.dtype if b.dtype.kind == "f" else np.dtype(np.float32)
    a = a.astype(dtype, copy=False)
    b = b.astype(dtype, copy=False)
    if a.dtype.kind != "f":
        a, b = a.astype(np.float64), b.astype(np.float64)
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    av, bv = a.view(bits), b.view(bits)
    both_nan = np.isnan(a) & np.isnan(b)
    differs = (av != bv) & ~both_nan
    out["identical"] = not bool(differs.any())
    out["mismatches"] = int(differs.sum())
    finite = np.isfinite(b)
    largest = float(np.abs(b[finite]).max()) if finite.any() else 0.0
    out["largest"] = largest
    if out["identical"]:
        out.update(max_ulps=0, max_abs=0.0, rel=0.0)
        return out
    if (np.isnan(a) != np.isnan(b)).any() or (np.isinf(a) != np.isinf(b)).any():
        out["error"] = "NaN or Inf where the reference has none (or the other way round)"
        out.update(max_ulps=None, max_abs=float("inf"), rel=float("inf"))
        return out
    signed = {2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]
    ai, bi = _ordered(a.view(signed)), _ordered(b.view(signed))
    ok = finite & ~both_nan
    ulps = np.abs(ai[ok] - bi[ok]) if ok.any() else np.zeros(1, dtype=np.int64)
    diff = np.abs(a[ok].astype(np.float64) - b[ok].astype(np.float64)) if ok.any() else np.zeros(1)
    out["max_ulps"] = int(ulps.max())
    out["max_abs"] = float(diff.max())
    out["rel"] = float(diff.max() / largest) if largest > 0 else (0.0 if diff.max() == 0 else float("inf"))
    return out


def _ordered(i):
    """Float bit patterns (a signed-integer view) as int64 in the order of the floats they encode: sign and
    magnitude become one number line, -0.0 and +0.0 both 0, neighbouring floats one apart."""
    width = np.dtype(i.dtype).itemsize * 8
    wide = i.astype(np.int64)
    if width == 64:  # the magnitude of a negative int64 view: the pattern with its sign bit cleared
        return np.where(wide < 0, -(wide & np.int64(0x7FFFFFFFFFFFFFFF)), wide)
    return np.where(wide < 0, -(wide + np.int64(1 << (width - 1))), wide)


def verify(target, *, rtol=DEFAULT_RTOL, scheduler=None):
    """Verify run file ``target`` (``run.h5`` or ``run.h5:group``); returns the summary (JSON-safe dict):
    ``layers`` worst first, each with ``path``, ``op``, ``kind``, ``status`` (``identical``, ``within-rtol``,
    ``differs``, ``failed``, ``no-reference``), ``passed``, ``max_ulps``, ``rel`` and per-output ``outputs``.
    ``scheduler``: verify the layers on that Dask cluster (:class:`qgcli.execution.cluster.Cluster`; the summary
    then has ``cluster``)."""
    path, group, container = runfile.open_target(
        target, operand="RUN", not_a_run_file=f"{target}: verify takes a run file (.h5, or file.h5:group)")
    rows = []
    try:
        handle = container._opened()
        layers = groups.discover(handle, group, label=path)
        if not layers:
            raise QgcliError(f"{target}: no group of this file is a layer (a group with an op attribute)")
        if scheduler is None:
            rows = [_verify_layer(container, handle, path, layer, rtol) for layer in layers]
        else:
            from qgcli.execution.dispatch import cluster as cluster_at

            with cluster_at(scheduler) as cluster:
                rows = cluster.map_layers(_verify_layer, path, layers, rtol)
                described = cluster.describe()
    finally:
        container.close()
    checked = [r for r in rows if r["status"] != "no-reference"]
    if not checked:
        raise QgcliError(f"{target}: no group holds a {REFERENCE}/ subgroup of the framework's results to compare "
                         "with (capture with references=True)")
    order = {"failed": 0, "differs": 1, "within-rtol": 2, "identical": 3, "no-reference": 4}
    rows.sort(key=lambda r: (order[r["status"]], -(r["rel"] or 0.0), -(r["max_ulps"] or 0), r["path"]))
    failed = [r for r in rows if not r["passed"]]
    return json_safe({
        "command": "verify", "run_file": f"{path}:{group}" if group else path, "rtol": rtol,
        "groups": len(rows), "verified": len(checked), "passed": len(checked) - len(failed),
        "failed": len(failed), "identical": sum(r["status"] == "identical" for r in rows),
        "no_reference": len(rows) - len(checked), "ok": not failed, "layers": rows,
        **({"cluster": described} if scheduler is not None else {}),
    })


def _reference_of(handle, layer):
    """The layer's references: the arrays of its ``reference/``, and its digests (the step's digest table, or
    the 32-byte datasets of ``reference/`` in files written before the table)."""
    import h5py

    g = handle[layer.path] if layer.path != "/" else handle
    ref = g.get(REFERENCE)
    found = {}
    if isinstance(ref, h5py.Group):
        for k, v in ref.items():
            if isinstance(v, h5py.Dataset):
                found[k] = Digest.of_dataset(v) or np.asarray(v[()])
    if layer.path != "/":
        found.update(digests_of(handle, layer.path))
    return found or None


def _verify_layer(container, handle, path, layer, rtol):
    row = {"path": layer.path, "op": layer.op, "kind": layer.kind, "shape": None, "status": "no-reference",
           "passed": True, "max_ulps": None, "rel": None, "outputs": {}, "error": None}
    shape = layer.datasets.get("inputs") or layer.datasets.get("x")
    row["shape"] = list(shape[0]) if shape else None
    reference = _reference_of(handle, layer)
    if not reference:
        return row
    if layer.error is not None or layer.kind is None:
        return _failed(row, layer.error or "unknown op")
    commands = []
    if layer.kind == registry.BATCH_NORM:
        commands.append("bn-grad")
    else:
        if "outputs" in reference:
            commands.append("fakequant")
        if "gradients" in layer.datasets and set(reference) - {"outputs"}:
            commands.append("fakequant-grad")
    for command in commands:
        problem = _validate(layer, command)
        if problem:
            return _failed(row, problem)
    if commands == ["fakequant", "fakequant-grad"]:
        commands = ["fakequant+grad"]  # one run where the family computes both in one pass (else the two)
    computed = {}
    for command in commands:
        try:
            computed.update(_run(container, path, layer, command))
        except Exception as exc:  # noqa: BLE001 - a layer that qgcli refuses is a failed layer, not a crash
            from qgcli.errors import QgcliError, RuntimeFailure

            if not isinstance(exc, (QgcliError, RuntimeFailure, ValueError)):
                raise
            message = str(exc)
            return _failed(row, message)
    worst_ulps, worst_rel, passed, identical = 0, 0.0, True, True
    for name, theirs in sorted(reference.items()):
        if name not in computed:
            row["outputs"][name] = {"compared": False, "note": "qgcli computes no such output for this op"}
            continue
        c = compare(computed[name], theirs)
        fam = registry.of(layer)
        strict = layer.kind == registry.FAKE_QUANT and name in getattr(fam, "VERIFY_BITWISE", ELEMENTWISE)
        c["rule"] = "bitwise" if strict else f"rtol {rtol:g}"
        if strict:
            c["passed"] = c["identical"]
        elif layer.kind == registry.BATCH_NORM:
            bound = _batch_norm_bound(handle, layer, name, theirs.shape)
            c["bound"] = None if bound is None else float(bound.max())
            c["passed"] = "error" not in c and c["rel"] is not None and (
                c["rel"] <= rtol or (bound is not None and _within(computed[name], theirs, bound)))
        else:
            bounded = layer.kind == registry.FAKE_QUANT and getattr(fam, "VERIFY_SUMMATION_BOUND", True)
            bound = _summation_bound(handle, layer, name) if bounded else None
            c["bound"] = bound
            c["passed"] = "error" not in c and c["rel"] is not None and (
                c["rel"] <= rtol or (bound is not None and c["max_abs"] <= bound))
        row["outputs"][name] = c
        passed &= c["passed"]
        identical &= c["identical"]
        if c["max_ulps"] is not None:
            worst_ulps = max(worst_ulps, c["max_ulps"])
        worst_rel = max(worst_rel, c["rel"] if c["rel"] is not None else float("inf"))
    compared = [c for c in row["outputs"].values() if c.get("compared", True)]
    if not compared:
        return _failed(row, "the reference holds no output qgcli computes for this op")
    row.update(passed=bool(passed), max_ulps=worst_ulps, rel=worst_rel,
               status="identical" if identical else ("within-rtol" if passed else "differs"))
    return row


def _summation_bound(handle, layer, name):
    """float32's worst-case error of fake-quant reduction ``name`` over this group's terms (see the module)."""
    g = handle[layer.path]
    if "gradients" not in g or "inputs" not in g:
        return None
    dy = np.abs(np.asarray(g["gradients"][()], dtype=np.float64))
    if not hasattr(registry.of(layer), "summation_bound"):
        return float(dy.size * 2.0 ** -23 * dy.sum())
    return registry.of(layer).summation_bound(g, layer.attrs, name, dy)


def _within(ours, theirs, bound):
    """Every element of ``ours`` within its ``bound`` of ``theirs`` (NaN where both are NaN)."""
    a, b = np.asarray(ours, np.float64).reshape(np.shape(theirs)), np.asarray(theirs, np.float64)
    both_nan = np.isnan(a) & np.isnan(b)
    return bool(np.all(both_nan | (np.abs(a - b) <= bound)))


def _batch_norm_bound(handle, layer, name, shape):
    """float32's worst-case error of a batch norm's output ``name``, element by element (None: not known).

    ``offset_backprop`` and ``scale_backprop`` are sums of ``n`` terms per channel (``n``: the elements of a
    channel) in an order the framework picks: ``n * 2**-23 * sum(|term|)``, the terms ``dy`` and
    ``dy * (x - mean) * inv_std``.  ``x_backprop`` in training subtracts the two sums divided by ``n`` from
    ``dy``: their bounds carry over through ``scale * inv_std``, plus a few roundings of each term.  A sum of
    gradients that cancels to about zero (a batch norm after a quantizer) is then judged against what its terms
    allow, not against its own small value.
    """
    g = handle[layer.path]
    if not all(k in g for k in ("y_backprop", "x", "scale", "reserve_space_1", "reserve_space_2")):
        return None
    a = layer.attrs
    dy = np.asarray(g["y_backprop"][()], dtype=np.float64)
    x = np.asarray(g["x"][()], dtype=np.float64)
    fmt = str(a.get("data_format", "NHWC"))
    fmt = fmt.decode() if isinstance(fmt, bytes) else fmt
    axis = 1 if fmt.startswith("NC") else x.ndim - 1
    reduce = tuple(i for i in range(x.ndim) if i != axis)
    n = x.size // x.shape[axis]
    shape_c = [1] * x.ndim
    shape_c[axis] = x.shape[axis]
    eps = float(a.get("epsilon", 1e-4))
    scale = np.asarray(g["scale"][()], dtype=np.float64).reshape(-1)
    if bool(a.get("is_training", True)):
        mean, var = x.mean(axis=reduce), x.var(axis=reduce)
    else:
        mean, var = np.asarray(g["reserve_space_1"][()], np.float64), np.asarray(g["reserve_space_2"][()], np.float64)
        if str(a.get("variance_kind", "variance")) == "inv-std":
            var = 1.0 / np.square(var) - eps
    inv_std = 1.0 / np.sqrt(np.maximum(var, 0.0) + eps)
    xhat = (x - mean.reshape(shape_c)) * inv_std.reshape(shape_c)
    unit = 2.0 ** -23
    sum_off = n * unit * np.abs(dy).sum(axis=reduce)
    sum_scale = n * unit * np.abs(dy * xhat).sum(axis=reduce)
    if name == "offset_backprop":
        return (sum_off + unit * np.abs(dy.sum(axis=reduce))).reshape(shape)
    if name == "scale_backprop":
        return (sum_scale + 4 * unit * np.abs(dy * xhat).sum(axis=reduce)).reshape(shape)
    if name != "x_backprop":
        return None
    k = np.abs(scale * inv_std).reshape(shape_c)
    own = 8 * unit * k * (np.abs(dy) + np.abs(dy.mean(axis=reduce)).reshape(shape_c)
                          + np.abs(xhat) * np.abs((dy * xhat).mean(axis=reduce)).reshape(shape_c))
    if not bool(a.get("is_training", True)):
        return (8 * unit * k * np.abs(dy)).reshape(shape)
    carried = k * (sum_off.reshape(shape_c) + np.abs(xhat) * sum_scale.reshape(shape_c)) / n
    return (carried + own).reshape(shape)


def _failed(row, message):
    row.update(status="failed", passed=False, error=message)
    return row


def _validate(layer, command):
    saved = layer.error
    problem = groups.problem(layer, command)
    layer.error = saved
    return problem


def _run(container, path, layer, command):
    """qgcli's outputs of ``layer`` under ``command`` (NumPy arrays by output name); "fakequant+grad": both
    commands' outputs, from one fused run where the family has one (TensorFlow's fake quant with its STE)."""
    if command == "fakequant+grad":
        both = _run(container, path, layer, "fakequant-grad+outputs")
        return both if "outputs" in both else {**_run(container, path, layer, "fakequant"), **both}
    forward_too = command == "fakequant-grad+outputs"
    command = "fakequant-grad" if forward_too else command
    estimator, grad_factor = None, None
    if layer.attrs.get("estimator") == "lsq" and command == "fakequant-grad":
        from qgcli.ops.estimators import parse_estimator

        estimator = parse_estimator("lsq")
        grad_factor = float(layer.attrs.get("grad_factor", 1.0))
    output = OutputOptions(destination=None, quiet=True)
    run = RunFileJob(command=command, target=path, output=output, estimator=estimator, grad_factor=grad_factor)
    specs = groups.operand_specs(layer)  # e.g. FakeQuantWithMinMaxArgs's min/max, group attributes
    job, _ = groups.job_from_group(run, layer, specs, output)
    if forward_too and getattr(job, "family", None) == tf_fake_quant.NAME:  # the STE, not an estimator
        job = job._replace(forward_too=True)
    runner = runner_for(job)
    operands = Operands.in_group(container, path, layer.path, specs.as_dict(), literal_ok=runner.LITERAL_OK)
    try:
        result = runner.compute(job, operands)
    finally:
        operands.close()
    return {k: to_numpy(v) for k, v in result.outputs.items()}
