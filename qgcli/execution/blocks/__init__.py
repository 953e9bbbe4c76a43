"""The block driver: a job whose large operands exceed memory (or run on a cluster), computed in blocks of
their first axis from any block source.

The family says what the blocks compute: its ``block_setup(job, operands, tensors)`` checks the operands
(unread) and returns the block algorithm by name (``"leaves"``: TensorFlow's fake-quant ops, whose
``backprop_wrt_min/max`` keep Eigen's reduction order, :mod:`~qgcli.execution.blocks.leaves`; ``"two-pass"``:
bn-grad's per-channel sums then ``x_backprop``, :mod:`~qgcli.execution.blocks.two_pass`; ``"rows"``: the block
formats, each row block computed on its own, :mod:`qgcli.families.block_rows`) with its parameters; its
``block_summary`` renders the result.  The source says how blocks are read and written:

- :mod:`~qgcli.execution.blocks.hdf5`: HDF5 datasets, and tensors that are plain bytes at an offset of a
  file (.npy, stored .npz members, .safetensors: :mod:`qgcli.storage.flat`), streamed in order into an .h5
  output (read ahead, reused buffers, chunk rows compressed on a thread pool): :func:`run_streamed`;
- :mod:`~qgcli.execution.blocks.zarr`: Zarr arrays as independent blocks writing their own output chunks,
  here or as tasks on a Dask cluster: :func:`qgcli.execution.blocks.zarr.plan_for`.
"""
from dataclasses import dataclass
from typing import Any, Callable

from qgcli.errors import OptionError


@dataclass
class Streamed:
    """A job's plan over HDF5 blocks: ``compute(h5file, advance)`` writes the large outputs and returns the
    small ones; ``summarise(small)`` gives the summary afterwards."""

    attrs: dict
    compute: Callable[[Any, Callable[[int], None]], dict]
    total_bytes: int
    summarise: Callable[[dict], dict]


def stream(runner, job, operands, datasets, budget):
    """The :class:`Streamed` plan of ``job`` over its ``datasets`` (HDF5 datasets or flat tensors, too large for
    ``budget``)."""
    from qgcli.execution.blocks import hdf5

    setup = runner.block_setup(job, operands, datasets)
    attrs, compression = setup["attrs"], job.output.compression
    if setup["blocks"] == "leaves":
        grid, kind, passes, how = setup["grid"], setup["kind"], 1, "in blocks"
        setup["nonfinite"] = [0, 0, 0]  # the inputs' NaN, +inf, -inf, counted as the blocks are read

        def compute(out, advance):
            common = dict(attrs=attrs, compression=compression, budget=budget, progress=advance,
                          nonfinite=setup["nonfinite"])
            if setup["gradient"]:
                return hdf5.fake_quant_gradient(datasets["gradients"], datasets["inputs"], grid, out, kind=kind,
                                                **common)
            hdf5.fake_quant_forward(datasets["inputs"], grid, setup["divide"], out, per_channel=kind == "chip",
                                    **common)
            return {}
    elif setup["blocks"] == "rows":  # the block formats (qgcli.families.block_rows)
        passes = setup["passes"]
        how = "in two passes (the tensor's amax, then the blocks)" if passes == 2 else "in blocks"

        def compute(out, advance):
            return hdf5.row_blocks(datasets, setup, out, compression=compression, budget=budget, progress=advance)
    else:
        small_in = setup["small_in"]
        setup["nonfinite"] = [0, 0, 0]  # x_backprop's NaN, +inf, -inf, counted as its blocks are written
        passes = 2 if setup["is_training"] else 1  # inference: x_backprop does not wait for the sums
        how = "in two passes" if passes == 2 else "in one pass"

        def compute(out, advance):
            small = hdf5.batch_norm_gradient(
                datasets["y_backprop"], datasets["x"], small_in["scale"], small_in["reserve_space_1"],
                small_in["reserve_space_2"], out, epsilon=setup["epsilon"], data_format=setup["data_format"],
                is_training=setup["is_training"], variance_kind=setup["variance_kind"], attrs=attrs,
                compression=compression, budget=budget, progress=advance, nonfinite=setup["nonfinite"])
            small.update(setup["extra_outputs"])
            return small

    def summarise(small):
        return runner.block_summary(job, operands, datasets, setup, small, [
            f"streamed from disk {how}: the inputs exceed --memory-limit ({budget / 2**30:.2f} GiB); "
            f"{setup['not_computed']} are not computed in this mode"])

    total = passes * sum(int(ds.size) * 4 for ds in datasets.values())
    return Streamed(attrs, compute, total, summarise)


def run_streamed(runner, job, operands, datasets, budget):
    """Stream the large operands block by block into a temporary .h5 renamed over the output."""
    from qgcli.execution.blocks.hdf5 import write_streamed

    out = job.output
    if out.plot:
        raise OptionError("cannot draw a figure of a tensor streamed from disk; drop --plot or raise "
                          "--memory-limit", param_hint="'--plot'")
    plan = stream(runner, job, operands, datasets, budget)
    small = write_streamed(out.destination, operands, out.force, plan.attrs, plan.compute, quiet=out.quiet,
                           total_bytes=plan.total_bytes, compression=out.compression)
    return plan.summarise(small)
