"""Option checks that several fake-quant families share when they build a job from the commands' options."""
from qgcli.errors import OptionError
from qgcli.ops.estimators import parse_estimator as parse

#: ``--variant`` of TensorFlow's QuantizeV2 + Dequantize round trip (:mod:`qgcli.families.quantize_v2`).
QD_VARIANT = "quantize-dequantize"


def parse_estimator(estimator):
    """The :class:`qgcli.ops.estimators.Estimator` that --estimator names, None for the framework's STE.
    (The estimators' module, 6 ms, is imported only where one is named.)"""
    if estimator.estimator is None:
        return None

    return parse(estimator.estimator)


def check_grad_factor(estimator, est):
    if estimator.grad_factor is not None and (est is None or est.name != "lsq"):
        raise OptionError("only applies to --estimator lsq", param_hint="'--grad-factor'")


def refuse_quantize_options(quantize):
    """Variants other than quantize-dequantize: the QuantizeV2 attributes do not apply."""
    for option in quantize.given():
        raise OptionError(f"only applies to --variant {QD_VARIANT}", param_hint=f"'{option}'")
