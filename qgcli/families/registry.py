"""The op families, one line each; a family's module is imported the first time it is asked for.

A family module says, in one place, everything qgcli does with its ops (see docs/op-families.md):

- ``NAME`` (the ``family`` of its jobs) and ``KIND`` (:data:`FAKE_QUANT` or :data:`BATCH_NORM`: which commands run it);
- ``RUN_FILE_OPS``: the run-file ``op`` attributes it owns -> variant (or version), and ``GROUP_OPERANDS``:
  variant -> (required, optional) datasets of a group (key None: every other variant);
- ``job_from_group(run, layer, specs, output, pick)``: the job of one run-file group (``pick`` reads an
  attribute, the command line's value where one was typed, :class:`qgcli.families.groups.Picker`);
  ``group_problem(layer, shapes)`` (and ``attribute_problem(attrs)``): what keeps a group from running;
  ``group_literals(layer)``: operands a group carries as attributes;
- ``claims(options)`` / ``job_from_options(options)``: the job of the fakequant commands' options
  (:class:`qgcli.jobs.FakeQuantOptions`); ``refuse_options_outside(options)``: its own options, refused when
  another family runs;
- ``LITERAL_OK``, ``compute(job, operands) -> Result``; ``stream`` / ``block_setup`` where it computes in blocks;
- ``render(console, summary)``: its summary on stderr; ``mode(job)``: the job in the words of its options.

Adding a family is one module and one line of :data:`FAMILIES`.  Nothing here imports more than the
standard library.
"""
import importlib

#: The kinds of op, by the commands that run them (a run file's groups of the other kind are left alone).
FAKE_QUANT, BATCH_NORM = "fake-quant", "batch-norm"
KIND_OF_COMMAND = {"fakequant": FAKE_QUANT, "fakequant-grad": FAKE_QUANT, "bn-grad": BATCH_NORM, "report": FAKE_QUANT}

#: family name -> its module, in the order run-file ops are listed and the families' options are refused.
FAMILIES = {
    "tf": "qgcli.families.tf_fake_quant",  # TensorFlow's FakeQuantWithMinMax* (the STE)
    "estimator": "qgcli.families.estimators",  # TensorFlow's grid with another gradient estimator
    "torch": "qgcli.families.torch",  # PyTorch's fake_quantize_per_{tensor,channel}_affine
    "quantize-dequantize": "qgcli.families.quantize_v2",  # TensorFlow's QuantizeV2 + Dequantize
    "batch-norm": "qgcli.families.batch_norm",  # FusedBatchNormGrad V1/V2/V3
    "torchao": "qgcli.families.torchao",  # torchao's QAT fake quantizers
    "quantize-and-dequantize": "qgcli.families.qdq",  # TensorFlow's QuantizeAndDequantizeV2/V3/V4
    "mx": "qgcli.families.mx",  # OCP microscaling (torchao's to_mx)
    "nvfp4": "qgcli.families.nvfp4",  # NVFP4 (torchao's NVFP4Tensor)
    "onnx": "qgcli.families.onnx_quantize",  # ONNX QuantizeLinear + DequantizeLinear
}


_MODULES = {}  # family name -> its module, once imported (asked several times per run-file group)


def family(name):
    """The module of family ``name``."""
    try:
        return _MODULES[name]
    except KeyError:
        pass
    if name not in FAMILIES:
        raise ValueError(f"no runner for the family {name!r}")
    mod = _MODULES[name] = importlib.import_module(FAMILIES[name])
    return mod


def of(job):
    """The module of a job's (or a run-file layer's) family."""
    return family(job.family)


def families():
    """Every family's module, in :data:`FAMILIES` order."""
    return [family(name) for name in FAMILIES]


def mode(job):
    """The job in the words of its options, for messages (``--semantics torch``, ``bn-grad`` ...)."""
    return of(job).mode(job)


def job_from_options(options):
    """The fake-quant job the fakequant commands' options describe: the family that claims them builds it,
    after every other family refused its own options (:class:`qgcli.jobs.FakeQuantOptions`)."""
    mods = families()
    chosen = next((m for m in mods if hasattr(m, "claims") and m.claims(options)), None)
    if chosen is None:
        raise ValueError(f"no family takes --semantics {options.semantics.semantics} with --variant "
                         f"{options.attributes.variant}")
    for m in mods:
        if m is not chosen and hasattr(m, "refuse_options_outside"):
            m.refuse_options_outside(options)
    return chosen.job_from_options(options)


_OPS = {}


def op_table():
    """``op`` attribute -> ``(kind, family, variant)``, every family's ``RUN_FILE_OPS`` in family order."""
    if not _OPS:
        for name in FAMILIES:
            mod = family(name)
            for op, variant in getattr(mod, "RUN_FILE_OPS", {}).items():
                _OPS[op] = (mod.KIND, name, variant)
    return _OPS


def op_entry(op):
    """``(kind, family, variant)`` of an ``op`` attribute, or None when qgcli does not know it.
    ``...Gradient`` / ``...Grad`` spellings and a ``torch.`` prefix are accepted too."""
    if op is None:
        return None
    ops = op_table()
    name = op[len("torch."):] if op.startswith("torch.") else op
    for suffix in ("Gradient", "Grad"):
        if name not in ops and name.endswith(suffix):
            name = name[: -len(suffix)]
    if name.startswith("FusedBatchNormGrad"):
        name = "FusedBatchNorm" + name[len("FusedBatchNormGrad"):]
    return ops.get(name)


def bundle_family(datasets, attrs):
    """``(kind, family, variant)`` of a run-file group without an ``op`` attribute (read as a plain bundle),
    by its operands: batch norm's, PyTorch's, else TensorFlow's (the variant inferred as for a bundle)."""
    if "y_backprop" in datasets or "x" in datasets:
        return BATCH_NORM, "batch-norm", attrs.get("version")
    if "scale" in datasets or "zero_point" in datasets:
        return FAKE_QUANT, "torch", None
    return FAKE_QUANT, "tf", None


def computes_in_blocks(job):
    """Whether the job's family computes Zarr (or HDF5) tensors in row blocks."""
    return hasattr(of(job), "block_setup")
