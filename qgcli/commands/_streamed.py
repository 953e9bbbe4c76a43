"""Out-of-core runs of fakequant, fakequant-grad and bn-grad: when HDF5 inputs do not fit the budget.

The decision is made before anything is loaded: if every large operand is an HDF5 dataset and the
inputs plus outputs exceed ``--memory-limit``, the command streams (``qgcli.streaming``) into a
temporary .h5 file that is renamed over the output at the end, as every output is.
"""
import click


def streaming_plan(operands, names, memory_limit, output):
    """``(datasets, budget)`` when the named operands must be streamed, else None (work in memory)."""
    import os
    import shutil

    from qgcli import io, streaming
    from qgcli.errors import OperandError, OutputError

    budget = streaming.parse_memory_limit(memory_limit)
    datasets = {}
    for name in names:
        ds = operands.dataset(name)
        if ds is None:
            return None
        datasets[name] = ds
    # inputs as read plus float32 working copies and outputs of the same size
    need = sum(int(ds.size) * max(ds.dtype.itemsize, 4) for ds in datasets.values()) * 2
    if need <= budget:
        return None
    for name, ds in datasets.items():
        declared, stored = int(ds.size) * ds.dtype.itemsize, ds.id.get_storage_size()
        if ds.compression is None and stored < declared // 2:
            # A file can declare terabytes and store nothing: reading it would stream fill values for hours.
            raise OperandError(f"declares {declared / 2**30:.1f} GiB but stores {stored / 2**30:.3f} GiB; "
                               "refusing to stream unwritten data", operand=name)
    if output == "-" or io.output_kind(output) != "h5":
        raise OutputError(f"the inputs need about {need / 2**30:.1f} GiB, more than --memory-limit "
                          f"({budget / 2**30:.1f} GiB); streaming writes .h5 outputs only", operand="--output")
    out_bytes = int(datasets["x" if "x" in datasets else "inputs"].size) * 4
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(output))).free
    if free < out_bytes:
        raise OutputError(f"needs {out_bytes / 2**30:.1f} GiB but its file system has {free / 2**30:.1f} GiB free",
                          operand="--output")
    return datasets, budget


def write_streamed(output, operands, force, attrs, compute, *, quiet, total_bytes):
    """Check the target, then run ``compute(h5file, progress)`` into a temporary .h5 renamed over ``output``.

    ``compute`` returns the small outputs (name -> array) to store beside the streamed ones.
    """
    import numpy as np

    from qgcli import __version__, io
    from qgcli.progress import Progress

    io.check_output(output, inputs=operands.input_paths(), force=force)
    attrs = {"qgcli_version": __version__, **{k: v for k, v in attrs.items() if v is not None}}
    small = {}

    def write(path):
        with io.open_h5_for_writing(path) as out, Progress("streaming", total=total_bytes, unit="bytes", quiet=quiet) as bar:
            for key, value in attrs.items():
                out.attrs[key] = value
            small.update(compute(out, bar.advance))
            for name, value in small.items():
                ds = out.create_dataset(name, data=np.asarray(value))
                for key, v in attrs.items():
                    ds.attrs[key] = v

    try:
        io.atomic_write(output, write)
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc.strerror or exc}") from None
    return small


def run_fake_quant_streamed(command, operands, plan, *, variant, num_bits, narrow_range, axis, output, force,
                            compression, quiet, with_gradients, plot):
    """fakequant / fakequant-grad on HDF5 datasets too large for memory; returns the summary."""
    import numpy as np

    from qgcli import streaming
    from qgcli.commands._common import json_safe
    from qgcli.commands.fakequant import TF_OPS, infer_variant
    from qgcli.errors import OperandError
    from qgcli.ops.analysis import grid_summary
    from qgcli.ops.fake_quant import _args_grid, _prepare_per_channel, _prepare_per_tensor

    datasets, budget = plan
    if plot:
        raise click.BadParameter("cannot draw a figure of a tensor streamed from disk; drop --plot or raise "
                                 "--memory-limit", param_hint="'--plot'")
    x_ds = datasets["inputs"]
    g_ds = datasets.get("gradients")
    for name, ds in datasets.items():
        if ds.dtype.kind != "f":
            raise OperandError(f"dtype {ds.dtype} is not a real floating type", operand=name)
    if g_ds is not None and g_ds.shape != x_ds.shape:
        raise OperandError(f"shape {list(g_ds.shape)} differs from inputs shape {list(x_ds.shape)}",
                           operand="gradients")
    mn = operands.get("min", required=variant != "args")
    mx = operands.get("max", required=variant != "args")
    variant = infer_variant(variant, mn)
    if axis is not None and variant != "per-channel":
        raise click.BadParameter("only applies to --variant per-channel", param_hint="'--axis'")
    kind, divide, attrs = "flat", variant == "vars", {"num_bits": num_bits, "narrow_range": narrow_range}
    if variant == "args":
        mn = -6.0 if mn is None else float(np.asarray(mn))
        mx = 6.0 if mx is None else float(np.asarray(mx))
        grid, kind = _args_grid(mn, mx, num_bits, narrow_range), None
        attrs.update(min=mn, max=mx)
    elif variant == "vars":
        grid = _prepare_per_tensor(x_ds, mn, mx, num_bits, narrow_range, np)
    else:
        if axis not in (None, -1, x_ds.ndim - 1):
            raise click.BadParameter("a tensor streamed from disk needs its channels on the last axis",
                                     param_hint="'--axis'")
        grid, _ = _prepare_per_channel(x_ds, mn, mx, num_bits, narrow_range, -1, np)
        kind, attrs["axis"] = "chip", -1
    op = TF_OPS[variant] + ("Gradient" if with_gradients else "")
    attrs = {"op": op, "variant": variant, **attrs}

    def compute(out, advance):
        common = dict(attrs=attrs, compression=compression, budget=budget, progress=advance)
        if with_gradients:
            return streaming.fake_quant_gradient(g_ds, x_ds, grid, out, kind=kind, **common)
        streaming.fake_quant_forward(x_ds, grid, divide, out, per_channel=variant == "per-channel", **common)
        return {}

    total = sum(int(ds.size) * 4 for ds in datasets.values())
    small = write_streamed(output, operands, force, attrs, compute, quiet=quiet, total_bytes=total)
    big = "outputs" if not with_gradients else ("backprops" if variant == "args" else "backprops_wrt_input")
    outputs = {big: {"shape": list(x_ds.shape), "dtype": "float32"}}
    outputs.update({k: {"shape": list(np.shape(v)), "dtype": "float32"} for k, v in small.items()})
    return json_safe({
        "command": command, "op": op, "variant": variant, "attributes": attrs,
        "inputs": {n: {"shape": list(ds.shape), "dtype": str(ds.dtype), "source": operands.sources.get(n, n)}
                   for n, ds in datasets.items()},
        "grid": grid_summary(grid), "statistics": None, "outputs": outputs, "output": output,
        "notes": [f"streamed from disk in blocks: the inputs exceed --memory-limit ({budget / 2**30:.2f} GiB); "
                  "clipping statistics are not computed in this mode"],
    })


def run_bn_grad_streamed(operands, plan, *, epsilon, data_format, is_training, variance_kind, version,
                         all_outputs, output, force, compression, quiet):
    """bn-grad on HDF5 datasets too large for memory (two passes); returns the summary."""
    import numpy as np

    from qgcli import io, streaming
    from qgcli.commands._common import json_safe
    from qgcli.ops import batch_norm as bn

    datasets, budget = plan
    if variance_kind == "auto":
        raise click.BadParameter("is not available when x is streamed from disk; name the convention "
                                 "(variance or inv-std) or raise --memory-limit", param_hint="'--variance-kind auto'")
    x_ds, dy_ds = datasets["x"], datasets["y_backprop"]
    if data_format is None:
        data_format = "NDHWC" if x_ds.ndim == 5 else "NHWC"

    def dtype_of(ds):
        if io.tagged_bfloat16(ds):
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return ds.dtype

    bn.batch_norm_grad_version(version, x_dtype=dtype_of(x_ds), data_format=data_format,
                               y_backprop_dtype=dtype_of(dy_ds))
    small_in = {name: operands.get(name) for name in ("scale", "reserve_space_1", "reserve_space_2")}
    op = bn.VERSIONS[version].op
    attrs = {"op": op, "epsilon": epsilon, "data_format": data_format, "is_training": is_training,
             "version": version, "variance_kind": variance_kind}

    def compute(out, advance):
        small = streaming.batch_norm_gradient(
            dy_ds, x_ds, small_in["scale"], small_in["reserve_space_1"], small_in["reserve_space_2"], out,
            epsilon=epsilon, data_format=data_format, is_training=is_training, variance_kind=variance_kind,
            attrs=attrs, compression=compression, budget=budget, progress=advance)
        if all_outputs:
            small.update(bn.placeholder_outputs(version))
        return small

    total = 2 * sum(int(ds.size) * 4 for ds in datasets.values())
    small = write_streamed(output, operands, force, attrs, compute, quiet=quiet, total_bytes=total)
    channels = len(small["scale_backprop"])
    outputs = {"x_backprop": {"shape": list(x_ds.shape), "dtype": str(dtype_of(x_ds))},
               **{k: {"shape": list(np.shape(v)), "dtype": str(np.asarray(v).dtype)} for k, v in small.items()}}
    return json_safe({
        "command": "bn-grad", "op": op, "attributes": attrs,
        "convention": {"kind": None, "variance_kind": variance_kind,
                       "description": f"reserve_space_2 read as {'a variance' if variance_kind == 'variance' else '1/sqrt(var + eps)'}"},
        "inputs": {n: {"shape": list(ds.shape), "dtype": str(dtype_of(ds)), "source": operands.sources.get(n, n)}
                   for n, ds in datasets.items()},
        "channels": channels,
        "per_channel": {"x_backprop_norm": [None] * channels,
                        "scale_backprop": [float(v) for v in small["scale_backprop"]],
                        "offset_backprop": [float(v) for v in small["offset_backprop"]]},
        "norms": {"x_backprop": None,
                  "scale_backprop": float(np.linalg.norm(np.asarray(small["scale_backprop"], np.float64))),
                  "offset_backprop": float(np.linalg.norm(np.asarray(small["offset_backprop"], np.float64)))},
        "outputs": outputs, "output": output,
        "notes": [f"streamed from disk in two passes: the inputs exceed --memory-limit ({budget / 2**30:.2f} GiB); "
                  "x_backprop norms are not computed in this mode"],
    })
