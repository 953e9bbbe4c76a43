"""Every option shared by more than one command, and the one way options travel: in groups.

:func:`option_group` declares options that reach the command function as ONE value (an
:class:`qgcli.jobs.OperandSpecs`, :class:`qgcli.jobs.OutputOptions`, ...), so a command takes a handful of
parameters whatever the number of its options.  This is the only module of ``qgcli.cli.commands`` that the
command modules import.  Only click (and, when a command runs, :mod:`qgcli.jobs`) is imported.
"""
import functools
import math

import click

OUTPUT_HELP = (
    "Where to write: FILE.h5 / FILE.npz (one dataset/key per output), FILE.npy (a single output), "
    "STORE.zarr (one array per output), DIR/ (one .npy per output), or - (npz on stdout)."
)
QD_VARIANT = "quantize-dequantize"
QDQ_VARIANTS = ("quantize-and-dequantize-v4", "quantize-and-dequantize-v3", "quantize-and-dequantize-v2")
DTYPES = ("quint8", "qint8", "quint16", "qint16", "qint32")
MODES = ("MIN_COMBINED", "MIN_FIRST", "SCALED")
ROUND_MODES = ("HALF_AWAY_FROM_ZERO", "HALF_TO_EVEN", "HALF_UP")  # HALF_UP: quantize-and-dequantize-v*
SEMANTICS = ("tf", "torch", "torchao", "mx", "nvfp4", "onnx")
#: ONNX QuantizeLinear's output types (--semantics onnx), accepted by the same --dtype option
ONNX_DTYPES = ("uint8", "int8", "uint16", "int16", "uint4", "int4", "float8e4m3fn", "float8e5m2", "float4e2m1")
MX_FORMATS = ("mxfp8-e4m3", "mxfp8-e5m2", "mxfp6-e2m3", "mxfp6-e3m2", "mxfp4", "mxint8")
MX_SCALE_MODES = ("floor", "rceil", "ceil", "even")
#: torchao's quantized dtypes (--semantics torchao), accepted by the same --dtype option as QuantizeV2's
TORCHAO_DTYPES = tuple(f"int{b}" for b in range(1, 9)) + tuple(f"uint{b}" for b in range(1, 9)) + (
    "float8_e4m3fn", "float8_e5m2")


class opt:
    """``click.option``'s arguments, kept: applied alone it is ``click.option``; in an :func:`option_group`
    with a help section it becomes an option of that section (click-option-group's ``OptionGroup.option``)."""

    def __init__(self, *param_decls, **attrs):
        self.param_decls, self.attrs = param_decls, attrs

    def __call__(self, f):
        return click.option(*self.param_decls, **self.attrs)(f)


#: The help section of each option group (``--help`` lists its options under the title; the text beside it
#: says what they share).  Named by the keyword argument the group's values reach the command as.
SECTIONS = {
    "operands": ("Operands", "Each a SPEC: FILE.npy, FILE.npz:KEY, FILE.h5:DATASET, FILE.safetensors:KEY, "
                 "FILE.pt:KEY (PyTorch), STORE.zarr, - (stdin), or a literal number or list (-6, -1,-2,3) where "
                 "one fits. BUNDLE: a file with tensors named as the operands (an option overrides one), or a "
                 "run file (one group per layer; qgcli.capture writes them)."),
    "attributes": ("TF fake-quant attributes", None),
    "quantize": ("Quantized types", "QuantizeV2/Dequantize (--variant quantize-dequantize); --dtype also for "
                 "torchao and ONNX."),
    "qdq": ("QuantizeAndDequantize", "V2/V3/V4: --variant quantize-and-dequantize-v*."),
    "semantics": ("Framework", "TensorFlow by default; PyTorch, torchao, MX, NVFP4, ONNX."),
    "torchao": ("torchao QAT", "--semantics torchao."),
    "formats": ("Block formats", "--semantics mx, nvfp4, onnx."),
    "estimator": ("Gradient estimator", None),
    "output": ("Output", None),
    "figure": ("Figure", None),
}


def option_group(target, build, *options):
    """Declare ``options`` (click decorators, in help order) whose values reach the command as one
    keyword argument ``target = build(**values)``, keyed by the options' parameter names.  When ``target``
    has a help section (:data:`SECTIONS`) and every option is an :class:`opt`, ``--help`` lists them under
    its title (arguments, e.g. BUNDLE, stay in the usage line)."""
    probe = _probe(options)

    def decorate(f):
        @functools.wraps(f)
        def command(*args, **kwargs):
            values = {name: kwargs.pop(name) for name in probe}
            kwargs[target] = build(**values)
            return f(*args, **kwargs)

        section = _section(target, options)
        for option in reversed(options):
            if section is not None and isinstance(option, opt):
                command = section.option(*option.param_decls, **option.attrs)(command)
            else:
                command = option(command)
        return command

    return decorate


def _section(target, options):
    """click-option-group's OptionGroup for ``target``'s section; None without one, or when an option of the
    group is a plain click decorator (a section cannot hold it)."""
    if target not in SECTIONS or any(not isinstance(o, opt) and _declares_option(o) for o in options):
        return None
    from click_option_group import OptionGroup

    title, text = SECTIONS[target]
    return OptionGroup(title, help=text)


def _declares_option(decorator):
    def nothing():
        pass

    decorator(nothing)
    return any(isinstance(p, click.Option) for p in nothing.__click_params__)


def _probe(options):
    """The parameter names the decorators declare, in help order."""

    def nothing():
        pass

    for option in reversed(options):
        option(nothing)
    return [p.name for p in reversed(nothing.__click_params__)]


def given(name):
    """True when option ``name`` was typed (or set from the environment), not left at its default."""
    from click.core import ParameterSource

    ctx = click.get_current_context(silent=True)
    return ctx is not None and ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)


# --- operands ---------------------------------------------------------------------------------------------

def bundle_argument(**attrs):
    return click.argument("bundle", required=False, metavar="[BUNDLE]", **attrs)


def spec_option(name, help, **attrs):
    """``--name SPEC`` for operand ``name`` (a TensorFlow name; a Python keyword gets a trailing ``_``)."""
    dest = name + "_" if name in ("min", "max", "x") else name
    return opt("--" + name.replace("_", "-"), dest, metavar="SPEC", help=help, **attrs)


def _operand_specs(bundle=None, **specs):
    from qgcli.jobs import OperandSpecs

    return OperandSpecs.of(bundle, **{name.rstrip("_"): text for name, text in specs.items()})


def operand_group(*options):
    """The BUNDLE argument and ``--name SPEC`` options, as ``operands`` (an OperandSpecs)."""
    return option_group("operands", _operand_specs, *options)


# --- fake-quant attributes ----------------------------------------------------------------------------------

def _fake_quant_attributes(num_bits=8, narrow_range=False, variant=None, axis=None):
    from qgcli.jobs import FakeQuantAttributes

    return FakeQuantAttributes(num_bits, narrow_range, variant, axis, num_bits_given=given("num_bits"))


def num_bits_option():
    return opt("--num-bits", type=int, default=8, show_default=True, help="Bit width, 2..16.")


def narrow_range_option(help="Use the grid [1, 2^num_bits - 1]."):
    return opt("--narrow-range", is_flag=True, help=help)


def attribute_group(*options):
    """--num-bits, --narrow-range, --variant, --axis (as the command declares them), as ``attributes``."""
    return option_group("attributes", _fake_quant_attributes, *options)


def fake_quant_attribute_options(f):
    """--num-bits, --narrow-range, --variant, --axis of fakequant and fakequant-grad, as ``attributes``."""
    return attribute_group(
        num_bits_option(),
        narrow_range_option("Use the grid [1, 2^num_bits - 1] (quantize-dequantize: SCALED's [T_min + 1, T_max])."),
        opt("--variant", type=click.Choice(["args", "vars", "per-channel", QD_VARIANT, *QDQ_VARIANTS]), default=None,
            help="TF op family; default: per-channel when min/max are vectors, else vars. "
                 "quantize-dequantize: the notebook's tf.quantize + tf.dequantize round trip "
                 "(QuantizeV2/Dequantize; see --dtype, --mode). quantize-and-dequantize-v4/-v3/-v2: "
                 "TF's QuantizeAndDequantizeV4/V3/V2 (see --signed-input, --range-given)."),
        opt("--axis", type=int, default=None,
            help="Channel axis for the per-channel variant (TF: the last axis, -1); for quantize-dequantize "
                 "QuantizeV2's axis (one min/max per slice)."),
    )(f)


# --- QuantizeAndDequantizeV2/V3/V4's attributes ----------------------------------------------------------------

def _qdq_attributes(signed_input=None, range_given=None):
    from qgcli.jobs import QdqAttributes

    return QdqAttributes(signed_input, range_given)


def qdq_options(f):
    """--signed-input/--no-signed-input, --range-given/--no-range-given (quantize-and-dequantize-v*), as ``qdq``."""
    only = " (--variant quantize-and-dequantize-v*)"
    return option_group(
        "qdq", _qdq_attributes,
        opt("--signed-input/--no-signed-input", "signed_input", default=None,
            help="Signed grid, symmetric around 0 [default: signed, as TF]" + only + "."),
        opt("--range-given/--no-range-given", "range_given", default=None,
            help="Use input_min/input_max (clamping) instead of the data's range [default: not given, as "
                 "V4; V3: given]" + only + "."),
    )(f)


# --- QuantizeV2's attributes --------------------------------------------------------------------------------

class _Choice(click.Choice):
    """A choice typed in any case, shown and returned as TensorFlow spells it."""

    def __init__(self, choices, fold):
        super().__init__(choices)
        self._fold = fold

    def convert(self, value, param, ctx):
        return super().convert(self._fold(value) if isinstance(value, str) else value, param, ctx)


def _quantize_attributes(**values):
    from qgcli.jobs import QuantizeAttributes

    return QuantizeAttributes(**values)


def quantize_options(f):
    """--dtype, --mode, --round-mode, --ensure-minimum-range (QuantizeV2's attributes), as ``quantize``."""
    only = " (--variant quantize-dequantize)"
    return option_group(
        "quantize", _quantize_attributes,
        opt("--dtype", type=_Choice(tuple(dict.fromkeys(DTYPES + TORCHAO_DTYPES + ONNX_DTYPES)), str.lower),
            default=None,
            help="Quantized type [default: quint8, the notebook's]" + only + "; with --semantics torchao "
                 "int1..int8, uint1..uint8, float8_e4m3fn, float8_e5m2; with --semantics onnx "
                 "QuantizeLinear's output type [default: uint8]: " + ", ".join(ONNX_DTYPES) + "."),
        opt("--mode", type=_Choice(MODES, str.upper), default=None,
            help="QuantizeV2/Dequantize mode [default: MIN_COMBINED, the notebook's]" + only + "."),
        opt("--round-mode", type=_Choice(ROUND_MODES, str.upper), default=None,
            help="Rounding [default: HALF_AWAY_FROM_ZERO]; HALF_TO_EVEN needs --mode SCALED" + only + "; "
                 "quantize-and-dequantize-v*: HALF_TO_EVEN (default) or HALF_UP."),
        opt("--ensure-minimum-range", type=float, default=None, metavar="EPS",
            help="QuantizeV2's ensure_minimum_range: the range is at least EPS * max(1, |min|, |max|) "
                 "wide [default: 0.01]" + only + "."),
    )(f)


def refuse_quantize_options(quantize):
    """Variants other than quantize-dequantize: the QuantizeV2 attributes do not apply."""
    from qgcli.families.common import refuse_quantize_options as refuse

    refuse(quantize)


# --- PyTorch semantics and gradient estimators --------------------------------------------------------------

_SEMANTICS_HELP = {
    "semantics": "Whose fake-quant: tf (TensorFlow's nudged min/max grid, the default), torch (PyTorch's "
                 "fake_quantize_per_{tensor,channel}_affine on --scale/--zero-point) or torchao (torchao's QAT "
                 "IntxFakeQuantizer/Float8FakeQuantizer, qparams from the data: --dtype, --granularity ...), mx (OCP "
                 "microscaling, torchao's to_mx: --mx-format, --block-size, --scale-mode), nvfp4 (torchao's NVFP4Tensor: "
                 "--no-per-tensor-scale) or onnx (QuantizeLinear + DequantizeLinear on x, y_scale, y_zero_point: --dtype, "
                 "--axis, --block-size, --no-saturate).",
    "scale": "PyTorch scale (--semantics torch): a scalar (per tensor) or one per channel.",
    "zero_point": "PyTorch zero point (--semantics torch): like scale; an integer dtype (or an integral literal) "
                  "uses the integer kernels, a float one PyTorch's float-zero-point kernels.",
    "quant_min": "PyTorch quant_min (--semantics torch); default 0, or 1 with --narrow-range.",
    "quant_max": "PyTorch quant_max (--semantics torch); default 2^num_bits - 1.",
}


class GradFactor(click.ParamType):
    """A finite float, or ``auto`` for LSQ's ``1/sqrt(N * quant_max)``."""

    name = "F|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, float) or value == "auto":
            return value
        text = str(value).strip().lower()
        if text == "auto":
            return "auto"
        try:
            number = float(text)
        except ValueError:
            self.fail(f"{value!r} is not a number or 'auto'", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not finite", param, ctx)
        return number


def _semantics_options(**values):
    from qgcli.jobs import SemanticsOptions

    return SemanticsOptions(**values)


def semantics_options(f):
    """--semantics, --scale, --zero-point, --quant-min, --quant-max, as ``semantics``."""
    return option_group(
        "semantics", _semantics_options,
        opt("--semantics", type=click.Choice(SEMANTICS), default="tf", show_default=True,
            help=_SEMANTICS_HELP["semantics"]),
        opt("--scale", metavar="SPEC", help=_SEMANTICS_HELP["scale"]),
        opt("--zero-point", "zero_point", metavar="SPEC", help=_SEMANTICS_HELP["zero_point"]),
        opt("--quant-min", type=int, default=None, help=_SEMANTICS_HELP["quant_min"]),
        opt("--quant-max", type=int, default=None, help=_SEMANTICS_HELP["quant_max"]),
    )(f)


def _torchao_options(**values):
    from qgcli.jobs import TorchaoOptions

    return TorchaoOptions(**values)


def torchao_options(f):
    """torchao's IntxFakeQuantizeConfig / Float8FakeQuantizeConfig fields (--semantics torchao), as ``torchao``."""
    only = " (--semantics torchao)"
    return option_group(
        "torchao", _torchao_options,
        opt("--granularity", metavar="per-group:G|per-channel|per-token|per-row|per-tensor", default=None,
            help="Blocks sharing a scale: integer dtypes per-group:G, per-channel, per-token; float8 per-row "
                 "(default) or per-tensor" + only + "."),
        opt("--mapping-type", type=click.Choice(["symmetric", "asymmetric"]), default=None,
            help="Integer mapping [default: symmetric]" + only + "."),
        opt("--scale-precision", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
            help="Scale dtype [default: float32]" + only + "."),
        opt("--zero-point-precision", type=click.Choice(["int32", "float32", "bfloat16", "float16"]),
            default=None, help="Zero point dtype [default: int32]" + only + "."),
        opt("--zero-point-domain", type=click.Choice(["int", "float", "none"]), default=None,
            help="Zero point domain [default: int]" + only + "."),
        opt("--eps", type=click.FloatRange(min=0.0), default=None,
            help="Smallest scale [default: torchao's: float32's smallest normal; 1e-6 asymmetric per "
                 "group]" + only + "."),
        opt("--hp-value-lb", type=float, default=None,
            help="float8: lower bound of max|x| for the scale" + only + "."),
        opt("--hp-value-ub", type=float, default=None,
            help="float8: upper bound of max|x| for the scale" + only + "."),
    )(f)


def _block_format_options(**values):
    from qgcli.jobs import BlockFormatOptions

    return BlockFormatOptions(**values)


def block_format_options(f):
    """The block formats' options (--semantics mx / nvfp4 / onnx), as ``formats``."""
    return option_group(
        "formats", _block_format_options,
        opt("--mx-format", type=_Choice(MX_FORMATS, str.lower), default=None,
            help="OCP MX element format (--semantics mx) [default: mxfp8-e4m3]."),
        opt("--block-size", type=click.IntRange(min=1), default=None,
            help="Elements per block along --axis: --semantics mx [default: 32, must divide the axis]; "
                 "--semantics onnx blocked QuantizeLinear [default: 0, none; a partial last block "
                 "allowed]. NVFP4 blocks are always 16."),
        opt("--scale-mode", type=_Choice(MX_SCALE_MODES, str.lower), default=None,
            help="MX scale rule, torchao's ScaleCalculationMode (--semantics mx) [default: floor, the "
                 "OCP spec's; torchao's QAT config uses rceil]."),
        opt("--no-per-tensor-scale", "per_tensor_scale", flag_value=False, default=None,
            help="NVFP4 without the FP32 per-tensor scale (--semantics nvfp4)."),
        opt("--no-saturate", "saturate", flag_value=False, default=None,
            help="float8 QuantizeLinear with saturate=0 (--semantics onnx, float8 --dtype)."),
    )(f)


def _estimator_options(estimator=None, grad_factor=None):
    from qgcli.jobs import EstimatorOptions

    return EstimatorOptions(estimator, grad_factor)


def estimator_options(f):
    """--estimator, --grad-factor (fakequant-grad), as ``estimator``."""
    return option_group(
        "estimator", _estimator_options,
        opt("--estimator", metavar="NAME[:PARAMS]", default=None,
            help="Gradient estimator: ste (default: the framework's clipped STE), identity, scaled:G[,E], "
                 "lsq, pact, ewgs:DELTA; --semantics mx/nvfp4/onnx: ste (the identity, default) or "
                 "masked-ste (onnx integer types). See docs/estimators.md for the formulas."),
        opt("--grad-factor", type=GradFactor(), default=None,
            help="LSQ gradient scale g for --estimator lsq: a number, or auto = 1/sqrt(N*quant_max) "
                 "(N: elements per step size). Default: 1.0 with --semantics torch (PyTorch's op), "
                 "auto with tf."),
    )(f)


# --- outputs --------------------------------------------------------------------------------------------------

def json_option(help="Print a machine-readable summary on stdout."):
    return opt("--json", "as_json", is_flag=True, help=help)


def table_out_options(with_force=False):
    """``--csv [FILE]`` and ``--parquet FILE``: the command's table, the records of its ``--json`` document
    (:mod:`qgcli.report.table_out`); bare ``--csv`` (or ``-``) prints the CSV on stdout instead of the table.
    ``with_force``: also ``--force`` to replace them, for a command that has no other output."""
    def decorate(f):
        if with_force:
            f = click.option("--force", is_flag=True, help="Replace an existing --csv or --parquet FILE.")(f)
        f = click.option("--parquet", "parquet", metavar="FILE", default=None,
                         help="Also write the table as a Parquet file, typed columns (- for stdout; "
                              "pip install 'qgcli[parquet]').")(f)
        return click.option("--csv", "csv_out", metavar="FILE", default=None, is_flag=False, flag_value="-",
                            help="Also write the table as CSV, one row per record of --json (bare --csv, or -: "
                                 "on stdout instead of the table).")(f)
    return decorate


def fail_on_option(command, also=None):
    """``--fail-on CONDITION,...``: exit 3 after printing when a condition holds (:mod:`qgcli.report.gates`);
    parsed when the command line is, so that a bad condition stops before any work.  ``also``: the gate of
    another input the command takes (``report`` of a history: ``trend``), whose conditions pass the parse and are
    refused (:func:`refuse_conditions`) once the input is known not to be one."""
    from qgcli.report.gates import GATES, names

    _, stats, _ = GATES[command]
    examples = ", ".join(names(command) + [f"{name}>N" for name in stats])
    shares = [name for name, (_, share) in stats.items() if share]
    if shares:
        examples += f" (shares in %, e.g. {shares[0]}>10%)"

    def parse(ctx, param, value):
        from qgcli.errors import OptionError
        from qgcli.report.gates import parse as parse_conditions

        try:
            return Conditions(parse_conditions(value, command), text=value)
        except OptionError as exc:
            if also is None:
                raise click.BadParameter(exc.message) from None
            try:  # a condition of the other kind of input the command takes: checked when the input is known
                parse_conditions(value, also)
            except OptionError:
                raise click.BadParameter(exc.message) from None
            return Conditions([], text=value, error=exc.message)

    return opt("--fail-on", "fail_on", metavar="CONDITION,...", default=None, callback=parse,
               help=f"Exit with code 3 (after printing) when a condition holds: {examples}; "
                    "for CI jobs.")


class Conditions(list):
    """The parsed ``--fail-on`` conditions, with the ``text`` they came from (``report HISTORY`` parses it again
    as ``trend`` does)."""

    def __init__(self, conditions, text=None, error=None):
        super().__init__(conditions)
        self.text, self.error = text, error


def refuse_conditions(conditions):
    """Stop (exit 2) when ``--fail-on`` named conditions only the command's other input offers."""
    if getattr(conditions, "error", None):
        raise click.BadParameter(conditions.error, param_hint="'--fail-on'")


def gate(doc, conditions):
    """The end of a command with ``--fail-on``: each condition that holds on one stderr line, then exit 3."""
    if not conditions:
        return
    from qgcli.report.gates import EXIT_CODE, failures

    held = failures(doc, conditions)
    for line in held:
        click.echo(f"fail-on {line}", err=True)
    if held:
        raise click.exceptions.Exit(EXIT_CODE)


def quiet_option(help="No summary on stderr."):
    return opt("-q", "--quiet", is_flag=True, help=help)


def device_option():
    return opt("--device", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True,
               help="Compute with NumPy (cpu) or CuPy (gpu).")


def scheduler_option(help="Compute the run file's layers on a Dask cluster (pip install 'qgcli[dask]'): a scheduler "
                          "address (tcp://host:8786), or local:N for N local worker processes. The workers open "
                          "the run file at the same path."):
    return opt("--scheduler", metavar="ADDRESS|local[:N]", default=None, help=help)


def force_option(help="Replace an existing output file."):
    return opt("--force", is_flag=True, help=help)


def report_options(f):
    """--json, --quiet, --device as three parameters (as_json, quiet, device)."""
    for option in reversed((json_option(), quiet_option(), device_option())):
        f = option(f)
    return f


def _output_options(output, force=False, memory_limit=None, compression=None, plot=None, as_json=False,
                    quiet=False, device="cpu", scheduler=None):
    from qgcli.jobs import OutputOptions

    if as_json and output == "-":  # refused before any work, not after the data went to stdout
        raise click.UsageError("--json and -o - both want stdout; write the data to a file or drop --json")
    return OutputOptions(output, force, compression, memory_limit, device, as_json, quiet, plot, scheduler)


def output_options(*, plot=False):
    """-o/--output, --force, --memory-limit, --compression (--plot), --json, --quiet, --device, as ``output``
    (an OutputOptions): the same meaning in every mode of a command, or refused there."""
    options = [
        opt("-o", "--output", "output", metavar="OUT", required=True, help=OUTPUT_HELP),
        force_option(),
        opt("--memory-limit", metavar="SIZE", default=None,
            help="Stream HDF5, .npy, stored .npz and .safetensors inputs block by block when they need more "
                 "than SIZE (e.g. 2G, 25%); default: a quarter of the machine's memory. A mode or input that "
                 "cannot stream refuses a limit below its inputs."),
        opt("--compression", type=click.Choice(["gzip", "lzf"]), default=None,
            help="Compress HDF5 outputs (chunked datasets), in every mode."),
    ]
    if plot:
        options.append(opt("--plot", metavar="FIG", default=None,
                           help="Also draw the STE figure to FIG (.png/.svg/.pdf)."))
    options += [json_option(), quiet_option(), device_option(),
                opt("--scheduler", metavar="ADDRESS|local[:N]", default=None,
                    help="Compute a run file's groups, or a Zarr tensor's row blocks, on a Dask cluster "
                         "(pip install 'qgcli[dask]'): a scheduler address (tcp://host:8786), or local:N "
                         "for N local worker processes. The same bits as without it.")]
    return option_group("output", _output_options, *options)


# --- run files ------------------------------------------------------------------------------------------------

#: Options a run file's groups answer themselves (their op names the variant, the semantics, the operands).
_RUN_FILE_REFUSED = {"variant": "--variant", "semantics": "--semantics", "scale": "--scale",
                     "zero_point": "--zero-point", "plot": "--plot", "mx_format": "--mx-format",
                     "block_size": "--block-size", "scale_mode": "--scale-mode",
                     "per_tensor_scale": "--no-per-tensor-scale", "saturate": "--no-saturate"}
_OPERAND_PARAMS = ("gradients", "inputs", "min_", "max_", "y_backprop", "x_", "scale", "reserve_space_1",
                   "reserve_space_2", "reserve_space_3", "y_scale", "y_zero_point")


def skip_invalid_option(f):
    """--skip-invalid, and the bounds on a run file's structure (:func:`hdf5_bound_options`)."""
    f = hdf5_bound_options(f)
    return opt("--skip-invalid", is_flag=True,
               help="Run file: run the valid groups and list the others (default: refuse the whole run "
                    "when any group of the command's kind is incomplete or invalid).")(f)


def _set_bound(ctx, param, value):
    from qgcli.storage.hdf5 import walk as h5walk

    h5walk.LIMITS[param.name] = getattr(h5walk, f"MAX_{param.name.upper()}") if value is None else value


def hdf5_bound_options(f):
    """--max-depth, --max-groups (or QGCLI_MAX_DEPTH / QGCLI_MAX_GROUPS): what an HDF5 file's structure may
    cost before it is refused (:mod:`qgcli.storage.hdf5.walk`); set for the command, nothing passed to it."""
    from qgcli.storage.hdf5.walk import MAX_DEPTH, MAX_GROUPS

    for name, default, what in (("depth", MAX_DEPTH, "groups nested deeper than N levels"),
                                ("groups", MAX_GROUPS, "more than N groups")):
        f = opt(f"--max-{name}", name, type=click.IntRange(min=1), default=None, metavar="N",
                envvar=f"QGCLI_MAX_{name.upper()}", show_envvar=True, expose_value=False,
                callback=_set_bound,
                help=f"HDF5: refuse a file with {what}, before any work (default {default:,}).")(f)
    return f


def refuse_missing_bundle(bundle):
    """BUNDLE's file missing is the error to report, before any about what a run file would allow."""
    import os

    if bundle is None or bundle == "-" or bundle.startswith("-:"):
        return
    from qgcli.errors import FileFormatError
    from qgcli.storage import io

    path = io.parse_spec(bundle).path
    if path is not None and not os.path.exists(path):
        raise FileFormatError(f"no such file: {path}", operand="BUNDLE")


def _refuse_missing_key(path, key):
    """``path:key`` as BUNDLE where the HDF5 file has no ``key``: blame the key (a typo, most often), naming
    what the file has at the top, rather than the options a run file's group would not take."""
    import difflib

    from qgcli.errors import FileFormatError
    from qgcli.storage import io

    refuse_missing_bundle(path)
    container = io.Container.open(path)
    try:
        handle = container._opened()
        if key in handle:
            return
        names = sorted(handle.keys())
    finally:
        container.close()
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
    held = f"{', '.join(names[:12])}{' ...' if len(names) > 12 else ''}" if names else "nothing"
    hint = f"; did you mean {' or '.join(repr(n) for n in close)}?" if close else ""
    raise FileFormatError(f"{path} has no group or dataset {key!r}{hint} (the file holds {held})", operand="BUNDLE")


def run_file_target(operands):
    """BUNDLE when it names a run file (``run.h5`` whose groups hold the operands, or ``run.h5:group``), else
    None (a single bundle, as always); refuses the options a run file's groups answer themselves."""
    bundle = operands.bundle
    if bundle is None or bundle == "-":
        return None
    from qgcli.storage import runfile

    target = runfile.split_target(bundle)
    if target is None:
        return None
    typed = [name for name in _OPERAND_PARAMS if given(name)]
    if target[1] is None and (typed or not runfile.is_run_file(bundle)):
        return None  # a whole file with operand options, or today's bundle
    if typed:
        _refuse_missing_key(*target)
    for name in typed:
        raise click.BadParameter("a run file's groups carry their own operands; drop the option or give one "
                                 "bundle file", param_hint=f"'--{name.rstrip('_').replace('_', '-')}'")
    for name, option in _RUN_FILE_REFUSED.items():
        if given(name):
            raise click.BadParameter("a run file's groups name their op in their 'op' attribute (see "
                                     "docs/whole-models.md)", param_hint=f"'{option}'")
    _refuse_torchao_options()
    return bundle


def _refuse_torchao_options():
    """A run file's torchao groups carry their config as attributes: torchao's options (and a torchao --dtype)
    would silently change nothing, so they are refused."""
    from qgcli.ops.torchao_semantics import FLOAT8_DTYPES, INT_DTYPES
    from qgcli.families.torchao import OPTION_NAMES

    for name, option in OPTION_NAMES.items():
        if given(name):
            raise click.BadParameter("a run file's torchao groups carry their config as attributes; drop the "
                                     "option or give one bundle file", param_hint=f"'{option}'")
    ctx = click.get_current_context(silent=True)
    dtype = ctx.params.get("dtype") if ctx is not None else None
    if given("dtype") and dtype in INT_DTYPES + FLOAT8_DTYPES:
        raise click.BadParameter(f"{dtype} is a torchao dtype; a run file's torchao groups carry their config as "
                                 "attributes", param_hint="'--dtype'")


def typed_overrides():
    """The attribute options typed on the command line (parameter name -> value): they override a run
    file's group attributes (:data:`qgcli.families.groups.OVERRIDABLE`, parameter name = job field)."""
    from qgcli.families.groups import OVERRIDABLE

    ctx = click.get_current_context()
    return {name: ctx.params[name] for name in OVERRIDABLE if name in ctx.params and given(name)}


def ranges_option(f):
    """``--ranges FILE.h5``: a run file's range parameters replaced by the ones ``report --ranges-out`` wrote."""
    return click.option("--ranges", "ranges", metavar="FILE.h5", default=None, type=click.Path(dir_okay=False),
                        help="Run files: replace each group's range (min/max, scale/zero_point) by the one at the "
                             "same group path of FILE.h5, written by report RUN --ranges-out FILE.h5.")(f)


def run_file_job(command, operands, output, *, skip_invalid=False, estimator=None, all_outputs=False, ranges=None):
    """A :class:`qgcli.jobs.RunFileJob` when BUNDLE is a run file (``run.h5`` whose groups hold the operands,
    or ``run.h5:group``), else None (a single bundle).  Options typed on the command line override the
    groups' attributes; those left at their defaults do not."""
    bundle = run_file_target(operands)
    if bundle is None:
        if ranges is not None:
            raise click.BadParameter("replaces the ranges of a run file's groups; give a run file as BUNDLE (or "
                                     "--min/--max for one tensor)", param_hint="'--ranges'")
        return None
    replaced = ()
    if ranges is not None:
        from qgcli.report.ranges_out import read_specs

        replaced = read_specs(ranges)
    explicit = tuple(typed_overrides().items())
    est, grad_factor = None, None
    if estimator is not None:
        from qgcli.ops.estimators import parse_estimator

        est = parse_estimator(estimator.estimator) if estimator.estimator is not None else None
        grad_factor = estimator.grad_factor
        if grad_factor is not None and (est is None or est.name != "lsq"):
            raise click.BadParameter("only applies to --estimator lsq", param_hint="'--grad-factor'")
    from qgcli.jobs import RunFileJob

    return RunFileJob(command, bundle, output, explicit, est, grad_factor, all_outputs, skip_invalid, ranges=replaced)


def table_options(f):
    """``--wide`` and ``--columns`` for a command whose result is a table; the command's signature is unchanged
    (the choice is kept in :data:`qgcli.report.tables.CHOICE` and applied by its ``print_table``)."""
    def keep(name):
        def callback(ctx, param, value):
            from qgcli.report import tables

            tables.CHOICE[name] = value
            return value
        return callback

    f = opt("--columns", metavar="NAME,...", default=None, expose_value=False, callback=keep("columns"),
            help="Table columns to show, in order (all: every column); the first column is always "
                 "shown. Unknown names list the choices.")(f)
    f = opt("--wide", is_flag=True, expose_value=False, callback=keep("wide"),
            help="Every table column, one record per block when the terminal is narrower than the table "
                 "(default: the columns that fit; off a terminal every column).")(f)
    return f
