"""Gradient estimators: what the backward pass of a fake quantizer could have been.

Every estimator reads one forward pass, described by a :class:`Quantized` view (built by
:func:`tf_view` for TensorFlow's nudged grid or :func:`qgcli.ops.torch_semantics.quantized_view` for
PyTorch's), and the upstream gradient ``dy``.  Notation: ``x`` input, ``x_hat`` fake-quantized value,
``s`` step (scale), ``z`` zero point, ``[n, p]`` the integer grid (``quant_min``, ``quant_max``),
``[lo, hi]`` its float range (``(n - z)*s``, ``(p - z)*s``; TF: the nudged bounds), ``inside`` the
semantics' own gradient mask (TF: ``lo <= x <= hi`` on the float input; PyTorch: ``n <= q <= p`` on the
rounded integer), ``below``/``above`` the elements clipped to either side, ``1{.}`` an indicator.

========================  =========================================================================
``ste`` (default)         ``dx = dy * 1{inside}`` -- the frameworks' clipped straight-through estimator
``identity``              ``dx = dy`` -- no clipping (Bengio et al. 2013)
``scaled:G[,E]``          ``dx = dy * (G * 1{inside} + E * 1{outside})``; ``E`` defaults to ``G`` (the
                          notebook's leaky ``0.9 * dy`` is ``scaled:0.9``; ``scaled:1,0`` is ``ste``)
``lsq``                   LSQ / LSQ+ (Esser et al. 2020; Bhalgat et al. 2020), in PyTorch's affine form:
                          ``dx = dy * 1{inside}``; ``dscale = g * sum(dy * ((x_hat - x)/s if inside,
                          (n - z) if below, (p - z) if above))``; ``dzero_point = g * sum(dy * (0 if
                          inside, -s outside))``; ``g`` = ``--grad-factor`` (PyTorch: 1.0; TF grid:
                          ``1/sqrt(N * p)``, N elements per step size)
``pact``                  PACT (Choi et al. 2018), clip level ``alpha = hi``: ``dx = dy * 1{inside and
                          x < alpha}``; ``dalpha = sum(dy * 1{x >= alpha})``
``ewgs:DELTA``            EWGS (Lee et al. 2021): ``dx = dy * (1 + DELTA * sign(dy) * (x_n - x_q)) *
                          1{inside}`` with ``x_n - x_q = (x - x_hat) / (hi - lo)``, the rounding error
                          in the normalised [0, 1] domain of the reference code; ``ewgs:0`` is ``ste``
========================  =========================================================================

Sums run over the whole tensor (per-tensor grid) or over all axes but the channel axis (per-channel),
accumulated in float64 and rounded once to float32.  On TensorFlow's grid the upstream gradient and the
results are flushed to zero when subnormal, as TensorFlow's CPU threads do (``identity`` excepted: it
is ``tf.identity``, which does no arithmetic).
"""
import math
from dataclasses import dataclass

import numpy as np

from qgcli.backend import array_module
from qgcli.errors import OperandError, QgcliError
from qgcli.ops.fake_quant import (
    _args_grid,
    _masks,
    _prepare_per_channel,
    _prepare_per_tensor,
    _quantize,
    _quiet,
    as_float32,
    flush_subnormals,
)

_F32 = np.float32
_F64 = np.float64
OPTION = "--estimator"

#: Estimator names, their parameter syntax and a one-line formula (for --help and the README).
ESTIMATORS = {
    "ste": ("ste", "dx = dy * 1{inside}"),
    "identity": ("identity", "dx = dy"),
    "scaled": ("scaled:G[,E]", "dx = dy * (G inside, E outside; E defaults to G)"),
    "lsq": ("lsq", "dx = dy * 1{inside}; dscale = g*sum(dy*((x_hat-x)/s | n-z | p-z)); dzero_point = g*sum(dy*(0 | -s))"),
    "pact": ("pact", "dx = dy * 1{inside, x < alpha}; dalpha = sum(dy * 1{x >= alpha}), alpha = hi"),
    "ewgs": ("ewgs:DELTA", "dx = dy * (1 + DELTA*sign(dy)*(x - x_hat)/(hi - lo)) * 1{inside}"),
}

#: Extra outputs each estimator writes beside ``backprops_wrt_input``.
EXTRA_OUTPUTS = {
    "lsq": ("backprop_wrt_scale", "backprop_wrt_zero_point"),
    "pact": ("backprop_wrt_alpha",),
}


@dataclass(frozen=True)
class Estimator:
    """A parsed ``NAME[:PARAMS]``: ``gain``/``leak`` for ``scaled``, ``delta`` for ``ewgs``."""

    name: str
    text: str
    gain: float = 1.0
    leak: float = 0.0
    delta: float = 0.0

    @property
    def extra_outputs(self):
        return EXTRA_OUTPUTS.get(self.name, ())


def _number(text, what):
    try:
        value = float(text)
    except ValueError:
        raise QgcliError(f"{what} must be a number, got {text!r}", operand=OPTION) from None
    if not math.isfinite(value):
        raise QgcliError(f"{what} must be finite, got {text!r}", operand=OPTION)
    return value


def parse_estimator(text):
    """Parse ``NAME[:PARAMS]`` (``ste``, ``identity``, ``scaled:G[,E]``, ``lsq``, ``pact``, ``ewgs:DELTA``).

    >>> parse_estimator("scaled:0.9")
    Estimator(name='scaled', text='scaled:0.9', gain=0.9, leak=0.9, delta=0.0)
    >>> parse_estimator("ewgs:0.2").delta
    0.2
    """
    if not isinstance(text, str) or not text.strip():
        raise QgcliError("is empty; use one of " + ", ".join(v[0] for v in ESTIMATORS.values()), operand=OPTION)
    name, sep, params = text.strip().partition(":")
    name = name.strip().lower()
    if name not in ESTIMATORS:
        raise QgcliError(f"unknown estimator {name!r}; use one of " + ", ".join(v[0] for v in ESTIMATORS.values()),
                         operand=OPTION)
    parts = [p.strip() for p in params.split(",")] if sep else []
    if name in ("ste", "identity", "lsq", "pact"):
        if sep:
            raise QgcliError(f"{name} takes no parameters, got {text!r}", operand=OPTION)
        return Estimator(name, text)
    if name == "scaled":
        if not parts or not parts[0] or len(parts) > 2:
            raise QgcliError(f"write scaled:G or scaled:G,E (gain inside, outside), got {text!r}", operand=OPTION)
        gain = _number(parts[0], "the gain G")
        leak = _number(parts[1], "the outside gain E") if len(parts) == 2 else gain
        return Estimator(name, text, gain=gain, leak=leak)
    if len(parts) != 1 or not parts[0]:
        raise QgcliError(f"write ewgs:DELTA (the scaling factor, >= 0), got {text!r}", operand=OPTION)
    delta = _number(parts[0], "DELTA")
    if delta < 0:
        raise QgcliError(f"DELTA must be >= 0 (EWGS scales gradients by 1 + DELTA*...), got {delta}", operand=OPTION)
    return Estimator(name, text, delta=delta)


@dataclass(frozen=True)
class Quantized:
    """One fake-quant forward pass as an estimator sees it; element arrays have channels last.

    ``residual`` is ``x_hat - x`` computed as the semantics computes it; ``scale``, ``inv_scale``,
    ``zero_point``, ``lo``, ``hi`` are 0-d (per tensor) or one entry per channel; ``axis`` is the channel
    axis of the original layout (None per tensor); ``flush`` says TensorFlow's flush-to-zero applies.
    """

    inputs: object
    outputs: object
    residual: object
    inside: object
    below: object
    above: object
    scale: object
    inv_scale: object
    zero_point: object
    quant_min: int
    quant_max: int
    lo: object
    hi: object
    axis: int | None
    flush: bool
    semantics: str
    passthrough: bool = False

    @property
    def per_channel(self):
        return self.axis is not None

    def restore(self, a):
        """An element array back in the original layout (channel axis where it was)."""
        if self.axis is None or self.axis == a.ndim - 1:
            return a
        xp = array_module(a)
        return xp.ascontiguousarray(xp.moveaxis(a, -1, self.axis))

    def elements_per_step(self):
        """N of LSQ's gradient scale: the elements that share one step size."""
        n = int(self.inputs.size)
        return n // int(self.inputs.shape[-1]) if self.per_channel and self.inputs.ndim and self.inputs.shape[-1] else n


def tf_view(inputs, min, max, *, num_bits=8, narrow_range=False, variant="vars", axis=-1):
    """The :class:`Quantized` view of TensorFlow's ``FakeQuantWithMinMax{Args,Vars,VarsPerChannel}``.

    ``variant`` is ``args``, ``vars`` or ``per-channel``; the forward values, masks and nudged grid are
    exactly the TF op's (:mod:`qgcli.ops.fake_quant`).
    """
    xp = array_module(inputs)
    x = as_float32(inputs, "inputs", xp)
    channel_axis = None
    if variant == "args":
        grid = _args_grid(float(min), float(max), num_bits, narrow_range)
    elif variant == "vars":
        grid = _prepare_per_tensor(x, min, max, num_bits, narrow_range, xp)
    elif variant == "per-channel":
        grid, channel_axis = _prepare_per_channel(x, min, max, num_bits, narrow_range, axis, xp)
        x = xp.moveaxis(x, channel_axis, -1)
    else:
        raise OperandError(f"unknown variant {variant!r}", operand="variant")
    outputs = _quantize(x, grid, variant == "vars", xp)
    inside, below, above = _masks(x, grid, xp)
    if grid.passthrough.any():
        # min == max == 0: TF's gradient passes through (whatever _masks reports for statistics there).
        pt = xp.asarray(grid.passthrough)
        inside, below, above = inside | pt, below & ~pt, above & ~pt
    xf = flush_subnormals(x)
    with _quiet(xp):
        residual = xp.subtract(outputs, xf, dtype=_F32)
        inv = (_F32(1) / grid.scale).astype(_F32)
    return Quantized(
        inputs=xf, outputs=outputs, residual=residual, inside=inside, below=below, above=above,
        scale=xp.asarray(grid.scale), inv_scale=xp.asarray(inv), zero_point=xp.asarray(grid.zero_point),
        quant_min=grid.quant_min, quant_max=grid.quant_max,
        lo=xp.asarray(grid.nudged_min), hi=xp.asarray(grid.nudged_max), axis=channel_axis, flush=True,
        semantics="tf", passthrough=bool(np.any(grid.passthrough)),
    )


# --- the estimators -----------------------------------------------------------------------------------

def _upstream(gradients, view, xp):
    g = as_float32(gradients, "gradients", xp)
    if view.axis is not None:
        g = xp.moveaxis(g, view.axis, -1)
    if g.shape != view.inputs.shape:
        raise OperandError(f"shape {list(g.shape)} differs from inputs shape {list(view.inputs.shape)}",
                           operand="gradients")
    return g


def _finish(a, view, xp):
    return flush_subnormals(a) if view.flush else a


def _reduce(a, view, xp):
    """Float64 sum over all elements (per tensor) or per channel (last axis), rounded once to float32."""
    if not view.per_channel:
        return xp.asarray(a.sum(dtype=_F64)).astype(_F32)
    return a.reshape(-1, a.shape[-1]).sum(axis=0, dtype=_F64).astype(_F32)


def straight_through(gradients, view):
    """Clipped STE, the frameworks' own: ``dx = dy * 1{inside}``.

    >>> v = tf_view(np.array([-7.0, 0.0, 7.0], np.float32), -6.0, 6.0, num_bits=2)
    >>> straight_through(np.ones(3, np.float32), v).tolist()
    [1.0, 1.0, 0.0]
    """
    xp = array_module(view.inputs)
    g = _upstream(gradients, view, xp)
    with _quiet(xp):
        dy = flush_subnormals(g) if view.flush else g
        return view.restore(xp.multiply(dy, view.inside, dtype=_F32))


def identity(gradients, view):
    """Identity STE: ``dx = dy`` everywhere, clipped elements included (``tf.identity``: no arithmetic)."""
    xp = array_module(view.inputs)
    return view.restore(xp.array(_upstream(gradients, view, xp), dtype=_F32, copy=True))


def scaled(gradients, view, gain=1.0, leak=None):
    """Scaled / leaky STE: ``dx = dy * (G * 1{inside} + E * 1{outside})``, ``E`` defaulting to ``G``.

    ``G`` and ``E`` are float32 constants and each element is one float32 product, as
    ``0.9 * tf.identity(dy)`` computes it; ``scaled(1, 0)`` equals :func:`straight_through` bit for bit.

    >>> v = tf_view(np.array([-7.0, 0.0, 7.0], np.float32), -6.0, 6.0, num_bits=2)
    >>> scaled(np.full(3, 2.0, np.float32), v, 0.5, 0.25).tolist()
    [1.0, 1.0, 0.5]
    """
    leak = gain if leak is None else leak
    xp = array_module(view.inputs)
    g = _upstream(gradients, view, xp)
    with _quiet(xp):
        dy = flush_subnormals(g) if view.flush else g
        factor = xp.where(view.inside, _F32(gain), _F32(leak))
        return view.restore(_finish(xp.multiply(dy, factor, dtype=_F32), view, xp))


def ewgs(gradients, view, delta):
    """Element-wise gradient scaling (Lee, Kim, Ham, CVPR 2021; cvlab-yonsei/EWGS ``EWGS_discretizer``).

    ``dx = dy * (1 + delta * sign(dy) * (x_n - x_q)) * 1{inside}`` where ``x_n - x_q = (x - x_hat) / (hi -
    lo)`` is the rounding error in the reference code's normalised [0, 1] domain; the factor is evaluated as
    the reference does, ``1 + (delta * sign(dy)) * diff``.  ``delta = 0`` is the clipped STE.

    >>> v = tf_view(np.array([0.25, -0.25, 0.5], np.float32), 0.0, 3.0, num_bits=2)
    >>> ewgs(np.ones(3, np.float32), v, 3.0).tolist()
    [1.25, 0.0, 0.5]
    """
    xp = array_module(view.inputs)
    g = _upstream(gradients, view, xp)
    with _quiet(xp):
        dy = flush_subnormals(g) if view.flush else g
        width = xp.subtract(view.hi, view.lo, dtype=_F32)
        diff = xp.where(view.inside, xp.divide(-view.residual, width, dtype=_F32), _F32(0))
        factor = xp.add(_F32(1), xp.multiply(xp.multiply(_F32(delta), xp.sign(dy), dtype=_F32), diff, dtype=_F32),
                        dtype=_F32)
        dx = xp.multiply(xp.multiply(dy, factor, dtype=_F32), view.inside, dtype=_F32)
        return view.restore(_finish(dx, view, xp))


def pact(gradients, view):
    """PACT (Choi et al. 2018) with the clip level ``alpha = hi`` (TF: the nudged max).

    Returns ``(dx, dalpha)``: ``dx = dy * 1{inside and x < alpha}``, ``dalpha = sum(dy * 1{x >= alpha})``
    (per channel for a per-channel grid).  With ``min = 0`` (PACT's ReLU range) this is the paper's
    estimator exactly; below the range the semantics' own mask applies.

    >>> v = tf_view(np.array([1.0, 3.0, 5.0], np.float32), 0.0, 3.0, num_bits=2)
    >>> dx, da = pact(np.ones(3, np.float32), v)
    >>> dx.tolist(), float(da)
    ([1.0, 0.0, 0.0], 2.0)
    """
    xp = array_module(view.inputs)
    g = _upstream(gradients, view, xp)
    with _quiet(xp):
        dy = flush_subnormals(g) if view.flush else g
        top = view.inputs >= view.hi
        dx = xp.multiply(dy, view.inside & ~top, dtype=_F32)
        dalpha = _reduce(xp.multiply(dy, top, dtype=_F32), view, xp)
    return view.restore(dx), dalpha


def lsq_grad_factor(view):
    """LSQ's gradient scale ``1 / sqrt(N * Q_P)``: ``N`` elements per step size (per channel for a
    per-channel grid, as the paper and MQBench count; PyTorch's ``_LearnableFakeQuantize`` uses the whole
    tensor), ``Q_P = quant_max`` as PyTorch's ``_LearnableFakeQuantize(use_grad_scaling=True)``."""
    n = view.elements_per_step()
    return 1.0 / math.sqrt(n * view.quant_max) if n and view.quant_max > 0 else 1.0


def lsq(gradients, view, grad_factor=None):
    """LSQ / LSQ+ gradients in PyTorch's affine form (``torch._fake_quantize_learnable_*`` on its grid).

    Returns ``(dx, dscale, dzero_point)``, per element::

        inside:  dx = dy,  dscale = dy * (x_hat - x) * (1/s) * g,   dzero_point = 0
        below:   dx = 0,   dscale = dy * (n - z) * g,               dzero_point = -dy * s * g
        above:   dx = 0,   dscale = dy * (p - z) * g,               dzero_point = -dy * s * g

    summed per tensor or per channel; ``g = grad_factor`` (default: 1.0 on PyTorch's grid as its op,
    :func:`lsq_grad_factor` on TensorFlow's).  ``dzero_point`` is in integer units (LSQ+'s offset
    ``beta = -z * s`` has ``dbeta = dzero_point / -s``).  Where the input sits on a grid point inside the
    range, ``x_hat = x`` and both range gradients vanish.

    >>> v = tf_view(np.array([0.25, -9.0, 9.0], np.float32), -4.0, 3.0, num_bits=3)
    >>> dx, ds, dz = lsq(np.ones(3, np.float32), v, grad_factor=1.0)
    >>> dx.tolist(), float(ds), float(dz)
    ([1.0, 0.0, 0.0], -1.25, -2.0)
    """
    if grad_factor is None:
        grad_factor = 1.0 if view.semantics == "torch" else lsq_grad_factor(view)
    xp = array_module(view.inputs)
    g = _upstream(gradients, view, xp)
    gf = _F32(grad_factor)
    with _quiet(xp):
        dy = flush_subnormals(g) if view.flush else g
        dx = xp.multiply(dy, view.inside, dtype=_F32)
        small = xp.subtract(_F32(view.quant_min), view.zero_point, dtype=_F32)
        big = xp.subtract(_F32(view.quant_max), view.zero_point, dtype=_F32)
        ds_in = xp.multiply(xp.multiply(xp.multiply(dy, view.residual, dtype=_F32), view.inv_scale, dtype=_F32), gf,
                            dtype=_F32)
        ds_out = xp.multiply(xp.multiply(dy, xp.where(view.below, small, big), dtype=_F32), gf, dtype=_F32)
        dz_out = xp.multiply(xp.multiply(-dy, view.scale, dtype=_F32), gf, dtype=_F32)
        outside = view.below | view.above
        # Elements in no region (NaN on TF's grid) take no part in the sums, as in TF's min/max gradients.
        dscale = xp.where(view.inside, ds_in, xp.where(outside, ds_out, _F32(0)))
        dzero = xp.where(outside, dz_out, _F32(0))
        ds_sum, dz_sum = _reduce(dscale, view, xp), _reduce(dzero, view, xp)
    return view.restore(_finish(dx, view, xp)), _finish(ds_sum, view, xp), _finish(dz_sum, view, xp)


def apply_estimator(estimator, gradients, view, *, grad_factor=None):
    """Run ``estimator`` (an :class:`Estimator` or its text); returns ``(outputs, details)``.

    ``outputs`` maps output names (``backprops_wrt_input`` and the estimator's extras) to arrays in the
    original layout; ``details`` says what was used (``grad_factor`` for LSQ).
    """
    est = parse_estimator(estimator) if isinstance(estimator, str) else estimator
    if grad_factor is not None and est.name != "lsq":
        raise QgcliError("only applies to --estimator lsq", operand="--grad-factor")
    if grad_factor is not None and not (math.isfinite(grad_factor)):
        raise QgcliError(f"must be finite, got {grad_factor}", operand="--grad-factor")
    if view.passthrough and est.name in ("lsq", "pact", "ewgs"):
        raise OperandError(f"min == max == 0 has no step size for --estimator {est.name}", operand="min")
    details = {"estimator": est.text, "name": est.name}
    if est.name == "ste":
        return {"backprops_wrt_input": straight_through(gradients, view)}, details
    if est.name == "identity":
        return {"backprops_wrt_input": identity(gradients, view)}, details
    if est.name == "scaled":
        details.update(gain=est.gain, leak=est.leak)
        return {"backprops_wrt_input": scaled(gradients, view, est.gain, est.leak)}, details
    if est.name == "ewgs":
        details["delta"] = est.delta
        return {"backprops_wrt_input": ewgs(gradients, view, est.delta)}, details
    if est.name == "pact":
        dx, da = pact(gradients, view)
        return {"backprops_wrt_input": dx, "backprop_wrt_alpha": da}, details
    if grad_factor is None:
        grad_factor = 1.0 if view.semantics == "torch" else lsq_grad_factor(view)
    details["grad_factor"] = float(grad_factor)
    dx, ds, dz = lsq(gradients, view, grad_factor)
    return {"backprops_wrt_input": dx, "backprop_wrt_scale": ds, "backprop_wrt_zero_point": dz}, details
