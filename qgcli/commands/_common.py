"""Plumbing shared by the commands: operand resolution, output writing, summaries.

Kept free of heavy imports at module level so that ``qgcli --help`` stays fast.
"""
import json
import os
import sys

import click

OUTPUT_HELP = (
    "Where to write: FILE.h5 / FILE.npz (one dataset/key per output), DIR/ (one .npy per output), "
    "or - (npz on stdout)."
)


def output_options(f):
    """-o/--output, --force."""
    f = click.option("--force", is_flag=True, help="Replace an existing output file.")(f)
    f = click.option("-o", "--output", "output", metavar="OUT", required=True, help=OUTPUT_HELP)(f)
    return f


def report_options(f):
    """--json, --quiet, --device."""
    f = click.option("--device", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True,
                     help="Compute with NumPy (cpu) or CuPy (gpu).")(f)
    f = click.option("-q", "--quiet", is_flag=True, help="No summary on stderr.")(f)
    f = click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")(f)
    return f


def streaming_options(f):
    """--memory-limit, --compression."""
    f = click.option("--compression", type=click.Choice(["gzip", "lzf"]), default=None,
                     help="Compress HDF5 outputs (chunked datasets).")(f)
    f = click.option("--memory-limit", metavar="SIZE", default=None,
                     help="Stream HDF5 inputs block by block when they need more than SIZE (e.g. 2G, 25%); "
                          "default: a quarter of the machine's memory.")(f)
    return f


def fake_quant_attribute_options(f):
    """--num-bits, --narrow-range, --variant, --axis."""
    f = click.option("--axis", type=int, default=None,
                     help="Channel axis for the per-channel variant (TF: the last axis, -1); for quantize-dequantize "
                          "QuantizeV2's axis (one min/max per slice).")(f)
    f = click.option("--variant", type=click.Choice(["args", "vars", "per-channel", "quantize-dequantize"]),
                     default=None,
                     help="TF op family; default: per-channel when min/max are vectors, else vars. "
                          "quantize-dequantize: the notebook's tf.quantize + tf.dequantize round trip "
                          "(QuantizeV2/Dequantize; see --dtype, --mode).")(f)
    f = click.option("--narrow-range", is_flag=True,
                     help="Use the grid [1, 2^num_bits - 1] (quantize-dequantize: SCALED's [T_min + 1, T_max]).")(f)
    f = click.option("--num-bits", type=int, default=8, show_default=True, help="Bit width, 2..16.")(f)
    return f


class Operands:
    """Operands by TensorFlow name, from ``--name SPEC`` options or else from a positional bundle file."""

    def __init__(self, bundle, specs, *, literal_ok=(), stdin=None):
        from qgcli import io

        self._io = io
        self.stdin = stdin if stdin is not None else io.Stdin()
        self.bundle_text = bundle
        self.bundle_path = None
        self._bundle_container = None
        if bundle is not None:
            spec = io.parse_spec(bundle)
            if spec.key is not None:
                raise click.BadParameter("a bundle is a whole .npz/.h5 file (or -), without :KEY", param_hint="BUNDLE")
            self.bundle_path = spec.path
            from qgcli.errors import FileFormatError

            try:
                self._bundle_container = io.Container.open(spec.path, self.stdin)
            except FileFormatError as exc:
                raise self._error("BUNDLE", str(exc)) from None
            if self._bundle_container.kind == "npy":
                raise self._error("BUNDLE", "a bundle must be an .npz or .h5 file with named tensors, not .npy")
        self._specs = {}
        for name, text in specs.items():
            if text is not None:
                self._specs[name] = io.parse_spec(text, allow_literal=name in literal_ok)
        self.sources = {}
        self._opened = []  # containers kept open for streamed datasets

    @staticmethod
    def _error(operand, message):
        from qgcli.errors import OperandError

        return OperandError(message, operand=operand)

    def input_paths(self):
        paths = [self.bundle_path] + [s.path for s in self._specs.values()]
        return [p for p in paths if p]

    def dataset(self, name):
        """The unread h5py Dataset behind operand ``name``, or None when it is not in an HDF5 file."""
        from qgcli.errors import FileFormatError

        try:
            if name in self._specs:
                spec = self._specs[name]
                if spec.path is None or self._io.file_kind(spec.path) != "h5":
                    return None
                container = self._io.Container.open(spec.path, self.stdin)
                self._opened.append(container)
                key = spec.key or (name if container.has(name) else None)
                if key is None:
                    return None
                self.sources[name] = spec.text
                return container.dataset(key)
            if self._bundle_container is not None and self._bundle_container.has(name):
                self.sources[name] = f"{self.bundle_text}:{name}"
                return self._bundle_container.dataset(name)
        except FileFormatError as exc:
            raise self._error(name, str(exc)) from None
        return None

    def has(self, name):
        if name in self._specs:
            return True
        return self._bundle_container is not None and self._bundle_container.has(name)

    def get(self, name, *, required=True):
        """The raw array for operand ``name`` (None when absent and not required)."""
        from qgcli.errors import FileFormatError

        try:
            if name in self._specs:
                spec = self._specs[name]
                self.sources[name] = spec.text
                return self._io.load_spec(spec, self.stdin, default_key=name)
            if self._bundle_container is not None and self._bundle_container.has(name):
                self.sources[name] = f"{self.bundle_text}:{name}"
                return self._bundle_container.read(name)
        except FileFormatError as exc:
            raise self._error(name, str(exc)) from None
        if required:
            where = f" and {self.bundle_text} has no dataset {name!r}" if self.bundle_text else ""
            option = "--" + name.replace("_", "-")
            raise self._error(name, f"missing operand: give {option} SPEC{where}")
        return None

    def close(self):
        if self._bundle_container is not None:
            self._bundle_container.close()
        for container in self._opened:
            container.close()


def to_device(arrays, device):
    from qgcli.backend import get_xp

    xp = get_xp(device)
    return xp, [None if a is None else xp.asarray(a) for a in arrays]


def write_outputs(outputs, dest, *, operands, force, attrs, compression=None):
    """Check the target, then write every output (NumPy arrays) atomically."""
    from qgcli import __version__, io
    from qgcli.backend import to_numpy

    io.check_output(dest, inputs=operands.input_paths(), force=force, names=list(outputs))
    attrs = {"qgcli_version": __version__, **{k: v for k, v in attrs.items() if v is not None}}
    try:
        io.save_outputs({k: to_numpy(v) for k, v in outputs.items()}, dest, attrs=attrs, compression=compression)
    except BrokenPipeError:
        raise  # `-o - | head`: the reader went away; the CLI stops quietly, as Unix tools do
    except OSError as exc:
        raise click.ClickException(f"cannot write {dest}: {exc.strerror or exc}") from None


def describe_arrays(arrays):
    from qgcli.backend import to_numpy

    return {name: {"shape": list(to_numpy(a).shape), "dtype": str(to_numpy(a).dtype)} for name, a in arrays.items()}


def emit(summary, *, as_json, quiet, render, output=None):
    """Print the summary: JSON on stdout with --json, else a rich rendering on stderr unless --quiet."""
    if as_json:
        if output == "-":
            raise click.UsageError("--json and -o - both want stdout; write the data to a file or drop --json")
        json.dump(summary, sys.stdout, indent=2, allow_nan=False, default=_json_default)
        sys.stdout.write("\n")
        return
    if quiet:
        return
    from rich.console import Console

    console = Console(stderr=True, highlight=False)
    render(console, summary)


def _json_default(value):
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def json_safe(value):
    """Replace NaN/inf floats (not valid JSON) by None, recursively."""
    import math

    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def percent(x):
    return f"{100.0 * x:.2f}%"


def env_flag(name):
    return os.environ.get(name, "") not in ("", "0", "false", "no")
