"""What to run and what a run gives back: the contract between the commands, the executors and the runners.

A command parses its options once into one immutable job (:class:`FakeQuantJob`, :class:`BatchNormJob`):
the op family (a name of :data:`qgcli.families.registry.FAMILIES`), its attributes, the operand specs and
the output options.  An executor (:mod:`qgcli.execution.dispatch`) decides where the job runs (in memory, in
blocks, over a run file, on a cluster) and asks the runner of its family (:mod:`qgcli.families`), which
returns a :class:`Result` in memory or gives the per-block setup.  Nothing here imports more than the standard
library, so building a job costs
nothing at start-up.
"""
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Optional, Tuple

class OperandSpecs(NamedTuple):
    """Where each operand comes from: a positional bundle file and ``--name SPEC`` options (None: not given)."""

    bundle: Optional[str] = None
    specs: Tuple[Tuple[str, Optional[str]], ...] = ()

    @classmethod
    def of(cls, bundle=None, **specs):
        return cls(bundle, tuple(specs.items()))

    def get(self, name):
        return dict(self.specs).get(name)

    def as_dict(self):
        return dict(self.specs)

    def only(self, *names, **extra):
        """The same bundle with the specs of ``names`` (in that order) and ``extra`` specs."""
        given = self.as_dict()
        return OperandSpecs(self.bundle, tuple((n, given.get(n)) for n in names) + tuple(extra.items()))


class OutputOptions(NamedTuple):
    """Where and how results go: the same meaning in every mode, or refused there."""

    destination: Optional[str]
    force: bool = False
    compression: Optional[str] = None
    memory_limit: Optional[str] = None
    device: str = "cpu"
    as_json: bool = False
    quiet: bool = False
    plot: Optional[str] = None
    scheduler: Optional[str] = None  # --scheduler: a Dask scheduler address, or local[:N]

    @property
    def shows_summary(self):
        """Whether anyone sees the summary: --json prints it, and it is rendered unless --quiet.  Work that
        only feeds it (clipping statistics, norms) is skipped otherwise."""
        return self.as_json or not self.quiet


class FigureOptions(NamedTuple):
    """Where and how a figure is written, and the summary options."""

    destination: str  # a file, or "-" for stdout
    force: bool = False
    dpi: int = 100
    format: Optional[str] = None  # png, svg or pdf; None: from the file name (png on stdout)
    title: Optional[str] = None
    width: float = 6.4
    height: Optional[float] = None
    as_json: bool = False
    quiet: bool = False
    device: str = "cpu"


class FakeQuantAttributes(NamedTuple):
    """--num-bits, --narrow-range, --variant, --axis (``num_bits_given``: typed, not the default)."""

    num_bits: int = 8
    narrow_range: bool = False
    variant: Optional[str] = None
    axis: Optional[int] = None
    num_bits_given: bool = False


class QuantizeAttributes(NamedTuple):
    """QuantizeV2's attributes (--dtype, --mode, --round-mode, --ensure-minimum-range); None: not given."""

    dtype: Optional[str] = None
    mode: Optional[str] = None
    round_mode: Optional[str] = None
    ensure_minimum_range: Optional[float] = None

    OPTIONS = {"dtype": "--dtype", "mode": "--mode", "round_mode": "--round-mode",
               "ensure_minimum_range": "--ensure-minimum-range"}
    DEFAULTS = {"dtype": "quint8", "mode": "MIN_COMBINED", "round_mode": "HALF_AWAY_FROM_ZERO",
                "ensure_minimum_range": 0.01}

    def given(self):
        """``{option name: value}`` of the attributes given."""
        return {self.OPTIONS[k]: getattr(self, k) for k in self.OPTIONS if getattr(self, k) is not None}

    def resolved(self):
        """Every attribute, TensorFlow's default where none was given."""
        return {k: self.DEFAULTS[k] if getattr(self, k) is None else getattr(self, k) for k in self.DEFAULTS}


class QdqAttributes(NamedTuple):
    """QuantizeAndDequantizeV2/V3/V4's --signed-input, --range-given (None: not given)."""

    signed_input: Optional[bool] = None
    range_given: Optional[bool] = None


class SemanticsOptions(NamedTuple):
    """--semantics and PyTorch's parameters (--scale/--zero-point are operand specs)."""

    semantics: str = "tf"
    scale: Optional[str] = None
    zero_point: Optional[str] = None
    quant_min: Optional[int] = None
    quant_max: Optional[int] = None

    def torch_given(self):
        return {"--scale": self.scale, "--zero-point": self.zero_point, "--quant-min": self.quant_min,
                "--quant-max": self.quant_max}


class TorchaoOptions(NamedTuple):
    """torchao's config fields (--semantics torchao; --dtype is QuantizeAttributes.dtype); None: not given."""

    granularity: Optional[str] = None
    mapping_type: Optional[str] = None
    scale_precision: Optional[str] = None
    zero_point_precision: Optional[str] = None
    zero_point_domain: Optional[str] = None
    eps: Optional[float] = None
    hp_value_lb: Optional[float] = None
    hp_value_ub: Optional[float] = None

    def given(self):
        """``{field: value}`` of the fields given."""
        return {k: v for k, v in self._asdict().items() if v is not None}


class BlockFormatOptions(NamedTuple):
    """The block formats' options (--semantics mx / nvfp4 / onnx; --dtype and --axis are shared); None: not
    given."""

    mx_format: Optional[str] = None
    block_size: Optional[int] = None
    scale_mode: Optional[str] = None
    per_tensor_scale: Optional[bool] = None  # --no-per-tensor-scale: False
    saturate: Optional[bool] = None  # --no-saturate: False

    OPTIONS = {"mx_format": "--mx-format", "block_size": "--block-size", "scale_mode": "--scale-mode",
               "per_tensor_scale": "--no-per-tensor-scale", "saturate": "--no-saturate"}

    def given(self):
        """``{option name: value}`` of the options given."""
        return {self.OPTIONS[k]: v for k, v in self._asdict().items() if v is not None}


class EstimatorOptions(NamedTuple):
    """--estimator (text, None: the framework's STE) and --grad-factor."""

    estimator: Optional[str] = None
    grad_factor: Any = None


class FakeQuantOptions(NamedTuple):
    """The fakequant commands' options, parsed: :func:`qgcli.families.registry.job_from_options` makes
    the job of the family they choose."""

    command: str
    with_gradients: bool
    operands: OperandSpecs
    attributes: FakeQuantAttributes
    quantize: QuantizeAttributes
    semantics: SemanticsOptions
    estimator: EstimatorOptions
    output: OutputOptions
    qdq: Optional[QdqAttributes] = None
    torchao: TorchaoOptions = TorchaoOptions()
    formats: BlockFormatOptions = BlockFormatOptions()


class FakeQuantJob(NamedTuple):
    """One fake-quant run (``fakequant`` / ``fakequant-grad``) of one family, options resolved and checked."""

    command: str
    family: str
    with_gradients: bool
    operands: OperandSpecs
    output: OutputOptions
    num_bits: int = 8
    narrow_range: bool = False
    variant: Optional[str] = None
    axis: Optional[int] = None
    quantize: Optional[Mapping[str, Any]] = None  # quantize-dequantize: QuantizeV2's attributes, resolved
    qdq: Optional[Mapping[str, Any]] = None  # quantize-and-dequantize-v*: signed_input, range_given, round_mode
    quant_min: Optional[int] = None  # torch: the integer range, resolved
    quant_max: Optional[int] = None
    estimator: Any = None  # a qgcli.ops.estimators.Estimator, or None for the framework's STE
    grad_factor: Any = None  # LSQ's g: a float, "auto" or None
    torchao: Any = None  # torchao: a qgcli.ops.torchao_semantics config
    formats: Optional[Mapping[str, Any]] = None  # mx / nvfp4 / onnx: the op's attributes, resolved
    forward_too: bool = False  # with gradients, the forward's outputs as well (TensorFlow's family: one fused pass)

    @property
    def large_operands(self):
        """The operands as large as the tensor (the others are per channel at most): ``inputs``, or the name in
        ``formats["tensor"]`` (ONNX QuantizeLinear's ``x``, which may come as ``inputs``: :func:`large_operands_in`)."""
        x = (self.formats or {}).get("tensor", "inputs")
        return ("gradients", x) if self.with_gradients else (x,)


class BatchNormJob(NamedTuple):
    """One ``bn-grad`` run."""

    operands: OperandSpecs
    output: OutputOptions
    epsilon: float = 1e-4
    data_format: Optional[str] = None
    is_training: bool = True
    variance_kind: str = "variance"
    version: str = "v3"
    all_outputs: bool = False
    command: str = "bn-grad"
    family: str = "batch-norm"  # qgcli.families.batch_norm

    large_operands = ("y_backprop", "x")


class RunFileJob(NamedTuple):
    """A command (``fakequant``, ``fakequant-grad``, ``bn-grad``) over every group of its kind in a run file
    (``run.h5`` or ``run.h5:group``); :mod:`qgcli.storage.runfile` builds each group's own job from its attributes.

    ``options`` holds the attributes given explicitly on the command line (job field -> value): they
    override the groups' attributes; options left at their defaults do not.
    """

    command: str
    target: str
    output: OutputOptions
    options: Tuple[Tuple[str, Any], ...] = ()
    estimator: Any = None
    grad_factor: Any = None
    all_outputs: bool = False
    skip_invalid: bool = False
    family: str = "run-file"
    #: ``fakequant-grad --ranges``: ``((group path, ((operand, SPEC), ...)), ...)``, the range parameters that
    #: replace a group's own (qgcli.report.ranges_out.read_specs)
    ranges: Tuple[Tuple[str, Tuple[Tuple[str, str], ...]], ...] = ()

    @property
    def with_gradients(self):
        return self.command == "fakequant-grad"

    @property
    def mode(self):
        return "a run file"


@dataclass
class Result:
    """What a runner computed in memory: the outputs by TensorFlow name, the attributes written with them,
    the summary, and (for ``--plot``) a function drawing the figure."""

    outputs: dict
    attrs: dict
    summary: dict
    figure: Optional[Callable[[], Any]] = None


def large_operands_in(job, operands):
    """``job.large_operands`` as the open ``operands`` name them: ONNX's ``x`` given as ``inputs`` (a bundle
    holding ``inputs``, no ``x``) is ``inputs``."""
    return tuple("inputs" if name == "x" and not operands.has("x") and operands.has("inputs") else name
                 for name in job.large_operands)
