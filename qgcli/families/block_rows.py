"""The block formats (``--semantics mx``, ``nvfp4``, ``onnx``) in row blocks of the first axis: a tensor larger than
``--memory-limit`` computed block by block (:mod:`qgcli.execution.blocks`, HDF5 and flat files streamed, Zarr
stores here or on a Dask cluster), each output bit for bit as in memory.

A row block is independent of the others when the quantization axis is not the first one: its blocks, scales
and codes are those of its rows.  Along the first axis a row block holds whole quantization blocks (its rows a
multiple of the block size: :attr:`RowPlan.align`; ONNX's partial last block stays the last rows) and the
scales' first axis is cut with it (``div``).  ONNX's per-axis and blocked ``y_scale`` / ``y_zero_point`` are cut
with the rows they apply to.  NVFP4's per-tensor scale needs the whole tensor's amax first: a pass of its own
over the blocks (:attr:`RowPlan.amax_pass`), then the encode pass with that scale (:meth:`RowPlan.with_amax`).

The family says what one row block computes (its ``rows(plan, x, g, i0, i1, out)``: the outputs of rows
``[i0, i1)``, small floats in ml_dtypes' types (:meth:`RowPlan.stored` gives their bytes), the op's result to
reuse as ``out`` for the next block of the same shape, and counts to add up); this module plans the outputs and
checks the operands before anything is read.  In memory the same plan quantizes a large tensor in row blocks
written over its own array (:func:`in_place`), and a run file's forward groups keep their output arrays for the
next group of the same shapes (:func:`kept`, :func:`keep`; the executor counts them against --memory-limit:
:func:`held_bytes`).
"""
import dataclasses
from dataclasses import dataclass, field

import numpy as np

from qgcli.errors import OperandError, QgcliError
from qgcli.families import block_formats as bf
from qgcli.families import registry


@dataclass(frozen=True)
class RowPlan:
    """What every row block of one run shares (small: shipped with each Zarr task)."""

    family: str  # the family whose ``rows`` computes a block
    formats: dict  # the job's attributes (the family's formats, the dtype resolved)
    shape: tuple  # the tensor's
    gradient: bool
    x_name: str  # "inputs", or ONNX's "x"
    needs_x: bool  # the gradient of the identity STE reads the gradients alone
    align: int = 1  # a row block's first-axis items: a multiple of this (the block size along the first axis)
    small: dict = field(default_factory=dict)  # the small operands (ONNX's y_scale, y_zero_point) and NVFP4's t
    outputs: dict = field(default_factory=dict)  # name -> (shape, stored dtype, div: input rows per output row)
    amax_pass: bool = False  # NVFP4 with its per-tensor scale: the tensor's amax first

    def compute(self, x, g, i0, i1, out=None):
        """``(outputs of rows [i0, i1) by name, the op's result to pass as ``out`` next time, counts)``."""
        return registry.family(self.family).rows(self, x, g, i0, i1, out)

    def output_rows(self, name, i0, i1):
        """The first-axis range of output ``name`` that input rows ``[i0, i1)`` write."""
        div = self.outputs[name][2]
        return i0 // div, -(-i1 // div)

    def stored(self, name, a):
        """Output ``name`` of a block as it is stored: small floats (ml_dtypes) as their bytes."""
        a = np.asarray(a)
        dtype = np.dtype(self.outputs[name][1])
        return a if a.dtype == dtype else a.view(dtype)

    def amax(self, x):
        """NVFP4's first pass over one block: its ``max |x|`` (:func:`qgcli.ops.nvfp4.tensor_amax`)."""
        from qgcli.ops import nvfp4

        return nvfp4.tensor_amax(np.ascontiguousarray(x, np.float32))

    def with_amax(self, amaxes):
        """This plan with the per-tensor scale of the tensor whose blocks' amaxes are ``amaxes`` (NVFP4's first
        pass, :func:`qgcli.ops.nvfp4.combined_amax`)."""
        from qgcli.ops import nvfp4

        t = nvfp4.tensor_scale_of(nvfp4.combined_amax(amaxes))
        return dataclasses.replace(self, small={**self.small, "tensor_scale": t}, amax_pass=False)

    def small_outputs(self):
        """The outputs no block writes: NVFP4's ``tensor_scale`` (float32, 0-d)."""
        t = self.small.get("tensor_scale")
        return {} if t is None or self.gradient else {"tensor_scale": np.asarray(t, np.float32)}


#: Elements per row block of a tensor quantized in place in memory (:func:`in_place`), and the size from which
#: a tensor is: the temporaries (the op's outputs of a row block, the statistics' float64 copies) stay this
#: size whatever the tensor's, and smaller tensors (most run-file groups) keep the one-call path.
IN_PLACE_ELEMENTS = 1 << 20


def in_place_ok(x, job):
    """Whether the forward may write its ``outputs`` over ``x``: the inputs array is its own (float32, C order,
    writeable: :func:`qgcli.ops.out_array.can_take`) and large enough to gain from it."""
    from qgcli.ops.out_array import can_take

    return (not job.with_gradients and isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim >= 1
            and x.size > IN_PLACE_ELEMENTS and can_take(x))


#: Results a run file's groups keep for the next groups of the same shapes (:func:`keep`): that many shapes.
KEPT_SHAPES = 4


def kept(store, key):
    """What an earlier run-file group of the same shapes and attributes (``key``) left in ``store`` for this one
    to write over (the executor's ``kept``, None outside a run file: fresh arrays), or None."""
    return None if store is None else store.get(key)


def keep(store, key, value):
    """Leave ``value`` (the op's result, or the outputs of :func:`in_place`) in ``store`` for the next group:
    the arrays of the last :data:`KEPT_SHAPES` keys, the oldest dropped."""
    if store is None or value is None:
        return
    store.pop(key, None)
    store[key] = value
    while len(store) > KEPT_SHAPES:
        store.pop(next(iter(store)))


def held_bytes(store):
    """The bytes of the NumPy arrays ``store`` holds (:func:`keep`'s values: results, tuples, dicts)."""
    def size(v):
        if isinstance(v, np.ndarray):
            return v.nbytes
        if isinstance(v, dict):
            v = tuple(v.values())
        return sum(size(a) for a in v) if isinstance(v, (tuple, list)) else 0

    return size(tuple(store.values())) if store else 0


def in_place(plan_, x, *, statistics=None, into=None):
    """The forward of ``plan_`` over row blocks of the in-memory ``x`` (:func:`in_place_ok`), each block's
    ``outputs`` written over its rows of ``x`` once the statistics have taken them (``statistics(x rows, y
    rows)``, :func:`qgcli.families.block_formats.rows_statistics`); the other outputs into new arrays, as stored.
    No tensor-sized array besides those (``into``: an earlier call's outputs, written over where they fit).
    Returns ``(outputs by name, the plan (with NVFP4's per-tensor scale), counts, the statistics' row blocks)``."""
    rows = x.shape[0]
    per_row = max(1, x.size // max(rows, 1))
    step = max(plan_.align, IN_PLACE_ELEMENTS // per_row // plan_.align * plan_.align)
    sub = max(plan_.align, IN_PLACE_ELEMENTS // 8 // per_row // plan_.align * plan_.align)
    if plan_.amax_pass:
        plan_ = plan_.with_amax([plan_.amax(x)])
    into = into or {}
    outs = {name: into[name] if name in into and into[name].shape == shape and into[name].dtype == np.dtype(d)
            else np.empty(shape, np.dtype(d)) for name, (shape, d, _) in plan_.outputs.items() if name != "outputs"}
    counts, parts, prev = {}, [], None
    for i in range(0, rows, step):
        j = min(i + step, rows)
        blocks, prev, found = plan_.compute(x[i:j], None, i, j, out=prev if prev is not None and len(prev[0]) == j - i
                                            else None)
        for key, n in found.items():
            counts[key] = counts.get(key, 0) + n
        for name, a in blocks.items():
            if name == "outputs":
                if statistics is not None:  # in smaller row blocks: the statistics' float64 temporaries
                    for k in range(i, j, sub):
                        parts.append(statistics(x[k:min(k + sub, j)], a[k - i:min(k + sub, j) - i]))
                x[i:j] = a
            else:
                lo, hi = plan_.output_rows(name, i, j)
                outs[name][lo:hi] = plan_.stored(name, a)
    return {name: x if name == "outputs" else outs[name] for name in plan_.outputs}, plan_, counts, parts


def plan(job, datasets, *, x_name, axis, block_size, small=None, amax_pass=False, needs_x=True):
    """The :class:`RowPlan` of ``job`` over its unread ``datasets`` (``axis``: the quantization axis,
    normalised, None where there is none: per tensor): the gradients' shape checked against the tensor's, the
    outputs planned by computing the first rows of zeros (which checks the operands' dtypes and the family's
    attributes as the op does, before anything is read).  Returns the plan and the attributes that name the
    small-float types of its outputs (``quantized_dtype`` ...)."""
    from qgcli.families.batch_norm import dtype_of  # bfloat16 where qgcli's tag says so

    x_ds = datasets[x_name]
    shape = tuple(x_ds.shape)
    g_ds = datasets.get("gradients")
    if g_ds is not None and tuple(g_ds.shape) != shape:
        raise OperandError(f"shape {list(g_ds.shape)} differs from {x_name} shape {list(shape)}",
                           operand="gradients")
    align = int(block_size) if axis == 0 and block_size else 1
    p = RowPlan(job.family, dict(job.formats), shape, job.with_gradients, x_name, needs_x or not job.with_gradients,
                align, dict(small or {}), {}, amax_pass)
    rows = min(shape[0], align)
    probe = p if not amax_pass else p.with_amax([np.float32(2688)])
    x = np.zeros((rows,) + shape[1:], dtype_of(x_ds)) if p.needs_x else None
    g = np.zeros((rows,) + shape[1:], dtype_of(g_ds)) if g_ds is not None else None
    first, _, _ = probe.compute(x, g, 0, rows)
    attrs = {}
    outputs = {}
    for name, a in bf.as_bytes(first, attrs).items():
        div = align if np.shape(a)[0] != rows else 1
        outputs[name] = ((-(-shape[0] // div),) + tuple(np.shape(a)[1:]), np.asarray(a).dtype.str, div)
    return dataclasses.replace(p, outputs=outputs), attrs


def row_bytes(plan, gradients):
    """A row's bytes in a row block: as read (float32 working copies of the inputs, of the ``gradients`` when
    they are read) and as written, for every output."""
    per_item = int(np.prod(plan.shape[1:], dtype=np.int64))
    return per_item * 4 * (1 + bool(gradients) + plan.needs_x) + sum(
        int(np.prod(s[1:], dtype=np.int64)) * np.dtype(d).itemsize / div for s, d, div in plan.outputs.values())


def check_rows_fit(plan, budget, per_row_bytes):
    """Refuse in one line a tensor whose smallest row block (``align`` rows) does not fit ``budget``."""
    need = plan.align * per_row_bytes
    if plan.align > 1 and need > budget:
        raise QgcliError(f"quantization blocks along the first axis need row blocks of {plan.align} whole rows "
                         f"({need / 2**20:.1f} MiB with their outputs), more than {budget / 2**20:.1f} MiB: raise "
                         "--memory-limit or quantize along another axis", operand="--memory-limit")


def setup(job, plan_, attrs, op):
    """The ``block_setup`` dict of a block-format job (:mod:`qgcli.execution.blocks`)."""
    big = "backprops_wrt_input" if job.with_gradients else "outputs"
    return {"blocks": "rows", "plan": plan_, "attrs": attrs, "op": op, "output": big, "gradient": job.with_gradients,
            "passes": 2 if plan_.amax_pass else 1, "counts": {},
            "not_computed": "the per-block statistics (SQNR, flushed, dynamic range)"}


def summary(job, operands, datasets, setup_, small, notes, *, op, attributes):
    """The summary of a block-format job computed in row blocks: the inputs and outputs described, the notes."""
    from qgcli.families.batch_norm import dtype_of
    from qgcli.report.summaries import json_safe

    p = setup_["plan"]
    outputs = {name: {"shape": list(shape), "dtype": np.dtype(dtype).name} for name, (shape, dtype, _) in
               p.outputs.items()}
    outputs.update({k: {"shape": list(np.shape(v)), "dtype": str(np.asarray(v).dtype)} for k, v in small.items()})
    described = {n: {"shape": list(ds.shape), "dtype": str(dtype_of(ds)), "source": operands.sources.get(n, n)}
                 for n, ds in datasets.items()}
    s = bf.summary(job, op, attributes, described, {}, {}, list(notes) + list(setup_.get("notes", ())))
    s["outputs"] = outputs
    s["statistics"] = None
    return json_safe(s)
