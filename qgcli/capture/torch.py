"""Capture one PyTorch training step (forward + backward) into a run file.

    with qgcli.capture.torch.capture(model, "run.h5", step=300):
        loss = loss_fn(model(x), y)
        loss.backward()

Recorded, one group per call, named by module path (``conv1.weight_fake_quant`` ->
``conv1/weight_fake_quant``, a second call of the same module ``..._1``):

- every ``torch.ao.quantization`` fake-quantize module with fake quant enabled (``FakeQuantize``,
  ``FusedMovingAvgObsFakeQuantize``, ``_LearnableFakeQuantize``; per tensor and per channel), as
  ``fake_quantize_per_tensor_affine`` / ``fake_quantize_per_channel_affine``: ``inputs``, ``scale``,
  ``zero_point`` (int32; LSQ's float zero point rounded and clamped as its kernel does), ``gradients`` (the
  upstream gradient), attributes ``quant_min``, ``quant_max``, ``axis``; LSQ groups also carry
  ``estimator = "lsq"`` and ``grad_factor``;
- every batch-norm module (``_BatchNorm``: 1d/2d/3d, SyncBatchNorm) that normalises with batch statistics
  (training mode), as ``FusedBatchNormV3`` in NCHW (NCDHW for 3d; 2-d/3-d inputs of BatchNorm1d as
  ``[N, C, L, 1]``): ``x``, ``y_backprop``, ``scale`` (the weight, ones without affine),
  ``reserve_space_1`` = the batch mean and ``reserve_space_2`` = the inverse standard deviation
  ``1/sqrt(var + eps)`` that PyTorch's ``native_batch_norm`` saves for its backward, with
  ``variance_kind = "inv-std"``, so that ``qgcli bn-grad`` runs PyTorch's backward formula.

How: a forward hook per module copies its input, parameters and output, and hooks the output tensor for the
upstream gradient (``Tensor.register_hook``, which in-place ops after the module, like ``ReLU(inplace=True)``,
do not disturb, unlike module backward hooks).  After the step the reference results (``reference/``) are
the module's own forward output and the gradients of the module's own kernel replayed on the recorded tensors
(``fused_moving_avg_obs_fake_quant`` with the observer off, ``fake_quantize_per_*_affine``,
``_fake_quantize_learnable_per_*_affine``, ``native_batch_norm_backward``), so that they are this build's
results for exactly the stored operands.
"""
import contextlib

from qgcli.capture.runfile_writer import RunFileWriter


def _torch():
    try:
        import torch
    except ImportError:
        from qgcli.errors import QgcliError

        raise QgcliError("qgcli.capture.torch needs PyTorch: pip install 'qgcli[torch]'") from None
    return torch


class Capture:
    """What a capture recorded: ``groups`` (run-file group paths, below the step group), ``skipped``
    (group path -> why it was not recorded) and the ``writer``."""

    def __init__(self, writer):
        self.writer = writer
        self.records = []
        self.skipped = {}

    @property
    def groups(self):
        return list(self.writer.groups)


@contextlib.contextmanager
def capture(model, path, *, step=None, references=True, overwrite=False):
    """Record the fake-quantize and batch-norm modules of ``model`` during one forward + backward into run
    file ``path`` (under ``step_<N>/`` when ``step`` is given; see :class:`RunFileWriter`).  Written when the
    block ends without an exception; yields a :class:`Capture`."""
    torch = _torch()
    writer = RunFileWriter(path, step=step, references=references, overwrite=overwrite)
    cap = Capture(writer)
    handles = []
    fake_quant_types, bn_type = _module_types(torch)
    hooked = [(name, module) for name, module in model.named_modules() if isinstance(module, fake_quant_types)
              or isinstance(module, bn_type)]
    names = [name for name, _ in hooked]
    for name, module in hooked:
        fake_quant = isinstance(module, fake_quant_types)
        leaf = "fake_quant" if fake_quant else "batch_norm"
        # A module with hooked modules below it (prepare_qat puts bn1.activation_post_process under bn1) is
        # the group <path>/batch_norm: a layer's group holds no other layer.
        if not name or any(other.startswith(name + ".") for other in names if other != name):
            name = f"{name}.{leaf}" if name else leaf
        make = _fake_quant_hook if fake_quant else _batch_norm_hook
        handles.append(module.register_forward_hook(make(torch, cap, name)))
    try:
        yield cap
    except BaseException:
        writer.discard()
        raise
    finally:
        for h in handles:
            h.remove()
    for name, record in cap.records:
        reason = record(writer)
        if reason:
            cap.skipped[name] = reason
    writer.close()


def _module_types(torch):
    from torch.ao.quantization.fake_quantize import FakeQuantizeBase

    return (FakeQuantizeBase,), torch.nn.modules.batchnorm._BatchNorm


def _numpy(t):
    return t.detach().cpu().contiguous().numpy().copy()


def _grad_slot(output):
    """A one-item list that receives the upstream gradient of ``output`` (None when nothing flows back)."""
    slot = [None]
    if output.requires_grad:
        def hook(grad):
            slot[0] = grad.detach().clone()
        output.register_hook(hook)
    return slot


def _per_channel(torch, module):
    qscheme = getattr(module, "qscheme", None)
    return qscheme in (torch.per_channel_symmetric, torch.per_channel_affine,
                       getattr(torch, "per_channel_affine_float_qparams", None))


def _fake_quant_hook(torch, cap, name):
    from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize
    from torch.ao.quantization.fake_quantize import FusedMovingAvgObsFakeQuantize

    def hook(module, args, output):
        if not bool(module.fake_quant_enabled[0]):
            cap.skipped[name] = "fake quant disabled"
            return
        x = args[0]
        if not torch.is_floating_point(x):
            cap.skipped[name] = f"inputs are {x.dtype}"
            return
        learnable = isinstance(module, _LearnableFakeQuantize)
        fused = isinstance(module, FusedMovingAvgObsFakeQuantize)
        per_channel = _per_channel(torch, module)
        if learnable or fused:
            qmin, qmax = int(module.quant_min), int(module.quant_max)
        else:
            qmin, qmax = int(module.activation_post_process.quant_min), int(module.activation_post_process.quant_max)
        axis = int(module.ch_axis) % x.dim() if per_channel else None
        scale = module.scale.detach().clone()
        zero_point = module.zero_point.detach().clone()
        grad_factor = None
        if learnable:
            grad_factor = 1.0 / (x.numel() * module.quant_max) ** 0.5 if module.use_grad_scaling else 1.0
        state = {"x": x.detach().clone(), "scale": scale, "zero_point": zero_point, "out": output.detach().clone(),
                 "dy": _grad_slot(output), "qmin": qmin, "qmax": qmax, "axis": axis, "learnable": learnable,
                 "fused": fused, "grad_factor": grad_factor, "module": module, "class": type(module).__name__}
        cap.records.append((name, lambda writer: _write_fake_quant(torch, writer, name, state)))

    return hook


def _replay_fake_quant(torch, s, dy):
    """The module's own kernel on the recorded tensors: ``(outputs, {gradient name: tensor})``."""
    x = s["x"].clone().requires_grad_(dy is not None)
    scale, zp = s["scale"].clone(), s["zero_point"].clone()
    qmin, qmax, axis = s["qmin"], s["qmax"], s["axis"]
    grads = {}
    with torch.enable_grad():
        if s["learnable"]:
            scale.requires_grad_(dy is not None)
            zp.requires_grad_(dy is not None)
            if axis is None:
                y = torch._fake_quantize_learnable_per_tensor_affine(x, scale, zp, qmin, qmax, s["grad_factor"])
            else:
                y = torch._fake_quantize_learnable_per_channel_affine(x, scale, zp, axis, qmin, qmax,
                                                                     s["grad_factor"])
        elif s["fused"]:
            m = s["module"]
            obs = m.activation_post_process
            off = torch.zeros(1, dtype=torch.long)
            on = torch.ones(1, dtype=torch.long)
            y = torch.fused_moving_avg_obs_fake_quant(
                x, off, on, obs.min_val.detach().clone(), obs.max_val.detach().clone(), scale, zp,
                obs.averaging_constant, qmin, qmax, m.ch_axis, m.is_per_channel, m.is_symmetric_quant)
        elif axis is None:
            y = torch.fake_quantize_per_tensor_affine(x, scale, zp, qmin, qmax)
        else:
            y = torch.fake_quantize_per_channel_affine(x, scale, zp, axis, qmin, qmax)
        if dy is not None:
            inputs = [x] + ([scale, zp] if s["learnable"] else [])
            got = torch.autograd.grad(y, inputs, dy)
            grads["backprops_wrt_input"] = got[0]
            if s["learnable"]:
                grads["backprop_wrt_scale"], grads["backprop_wrt_zero_point"] = got[1], got[2]
    return y.detach(), grads


def _write_fake_quant(torch, writer, name, s):
    import numpy as np

    dy = s["dy"][0]
    replayed, grads = _replay_fake_quant(torch, s, dy)
    qmin, qmax, axis = s["qmin"], s["qmax"], s["axis"]
    scale = _numpy(s["scale"]).astype(np.float32)
    zp = s["zero_point"]
    if s["learnable"]:  # the kernel rounds and clamps LSQ's float zero point
        zp = zp.round().clamp(qmin, qmax)
    zp = _numpy(zp).astype(np.int32)
    if axis is None:
        scale, zp = scale.reshape(()), zp.reshape(())
    attrs = {"quant_min": qmin, "quant_max": qmax, "axis": axis, "framework": "torch", "module": s["class"]}
    if s["learnable"]:
        attrs.update(estimator="lsq", grad_factor=float(s["grad_factor"]))
    reference = {"outputs": _numpy(s["out"]), **{k: _numpy(v) for k, v in grads.items()}}
    if not torch.equal(replayed, s["out"]):
        attrs["note"] = "the module's output differs from its kernel replayed on the stored operands"
    op = "fake_quantize_per_tensor_affine" if axis is None else "fake_quantize_per_channel_affine"
    writer.add(name, op, {"inputs": _numpy(s["x"]), "scale": scale, "zero_point": zp,
                          "gradients": None if dy is None else _numpy(dy)}, attrs, reference)


def _batch_norm_hook(torch, cap, name):
    def hook(module, args, output):
        batch_stats = module.training or module.running_mean is None
        if not batch_stats:
            cap.skipped[name] = "eval mode (running statistics): no batch statistics to differentiate"
            return
        x = args[0]
        if x.dim() not in (2, 3, 4, 5):
            cap.skipped[name] = f"input of rank {x.dim()}"
            return
        state = {"x": x.detach().clone(), "eps": float(module.eps), "dy": _grad_slot(output),
                 "weight": None if module.weight is None else module.weight.detach().clone(),
                 "bias": None if module.bias is None else module.bias.detach().clone(), "class": type(module).__name__}
        cap.records.append((name, lambda writer: _write_batch_norm(torch, writer, name, state)))

    return hook


def _write_batch_norm(torch, writer, name, s):
    import numpy as np

    x, eps, dy = s["x"], s["eps"], s["dy"][0]
    channels = x.shape[1]
    weight = s["weight"] if s["weight"] is not None else torch.ones(channels, dtype=x.dtype)
    bias = s["bias"] if s["bias"] is not None else torch.zeros(channels, dtype=x.dtype)
    # What PyTorch's batch norm saves for its backward: the batch mean and 1/sqrt(biased var + eps).
    _, mean, invstd = torch.native_batch_norm(x, weight, bias, None, None, True, 0.0, eps)
    if dy is None:
        return "no gradient flowed back through it (bn-grad needs y_backprop)"
    dx, dw, db = torch.ops.aten.native_batch_norm_backward(dy, x, weight, None, None, mean, invstd, True, eps,
                                                           [True, True, True])
    shape = tuple(x.shape)
    as4 = (lambda t: t.reshape(shape + (1,) * (4 - len(shape)))) if len(shape) < 4 else (lambda t: t)
    reference = {"x_backprop": _numpy(as4(dx)), "scale_backprop": _numpy(dw)}
    if s["bias"] is not None:
        reference["offset_backprop"] = _numpy(db)
    attrs = {"epsilon": eps, "data_format": "NCDHW" if len(shape) == 5 else "NCHW", "is_training": True,
             "variance_kind": "inv-std", "framework": "torch", "module": s["class"]}
    if len(shape) < 4:
        attrs["framework_shape"] = np.asarray(shape, dtype=np.int64)
    writer.add(name, "FusedBatchNormV3",
               {"y_backprop": _numpy(as4(dy)), "x": _numpy(as4(x)), "scale": _numpy(weight).astype(np.float32),
                "reserve_space_1": _numpy(mean), "reserve_space_2": _numpy(invstd)}, attrs, reference)
