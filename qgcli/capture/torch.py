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

- every torchao QAT fake quantizer (``torchao.quantization.qat``: the ``weight_fake_quantizer`` and
  ``activation_fake_quantizer`` of ``FakeQuantizedLinear`` / ``FakeQuantizedEmbedding``, or any
  ``IntxFakeQuantizer`` / ``Float8FakeQuantizer`` module), as ``torchao.IntxFakeQuantizer`` /
  ``torchao.Float8FakeQuantizer``: ``inputs``, ``gradients``, the config as attributes named after torchao's
  fields (``dtype``, ``granularity`` with ``group_size``, ``mapping_type``, ``scale_precision``,
  ``zero_point_precision``, ``zero_point_domain``, ``eps``, ``is_dynamic``; float8: ``dtype``, ``granularity``,
  ``hp_value_lb`` / ``hp_value_ub``), and in ``reference/`` the module's ``outputs``, the autograd
  ``backprops_wrt_input`` of a fresh quantizer of the same config replayed on the stored operands, and the
  ``scale`` / ``zero_point`` it computed.  A config qgcli does not reproduce (static or learned qparams,
  non-float32 inputs, fnuz or float64 dtypes, other torchao quantizers) is not recorded: ``skipped`` says why.
- every torchao prototype MX QAT layer (``MXFakeQuantizedLinear``), as two ``op = "mx"`` groups,
  ``<path>.activation_fake_quantizer`` and ``<path>.weight_fake_quantizer`` (:func:`_mx_hook`); the NVFP4 one
  (``NVFP4FakeQuantizedLinear``, whose forward needs a Blackwell GPU) is listed in ``skipped``.

How: a forward hook per module copies its input, parameters and output, and hooks the output tensor for the
upstream gradient (``Tensor.register_hook``, which in-place ops after the module, like ``ReLU(inplace=True)``,
do not disturb, unlike module backward hooks).  The reference results (``reference/``) are the module's own
forward output and the gradients of its own kernel for exactly the stored operands: the step's own, taken
from the kernel's autograd node (a hook on ``output.grad_fn``: ``FusedMovingAvgObsFqHelperBackward0``,
``FakeQuantize*CachemaskBackward0``, ``FakeQuantizeLearnable*Backward0``, ``NativeBatchNormBackward0``, which
receives the upstream gradient and hands back the kernel's gradients), or, for another node or a gradient
the step does not compute, the kernel replayed on the recorded tensors (``fused_moving_avg_obs_fake_quant``
with the observer off, ``fake_quantize_per_*_affine``, ``_fake_quantize_learnable_per_*_affine``,
``native_batch_norm_backward``).
"""
import contextlib
import sys

import numpy as np

from qgcli.capture.runfile_writer import RunFileWriter, digest
from qgcli.capture.steps import StepCapture
from qgcli.errors import QgcliError
from qgcli.ops import torchao_semantics as ts

#: torch.ao results that verify compares bit for bit: stored as digests (the tensors are the step's, once).
_DIGESTED = ("outputs", "backprops_wrt_input")
_NO_GRADIENT = "no gradient flowed back through it (bn-grad needs y_backprop)"
_REPLAY_DIFFERS = "the module's output differs from its kernel replayed on the stored operands"


def _torch():
    try:
        import torch
    except ImportError:
        from qgcli.errors import QgcliError

        raise QgcliError("qgcli.capture.torch needs PyTorch: pip install 'qgcli[torch]'") from None
    return torch


class Capture(StepCapture):
    """What a capture recorded: ``groups`` (run-file group paths of the last step, below the step group),
    ``skipped`` (name -> why it was not recorded) and the ``writer``.  :meth:`step` marks the steps of a
    training loop; without it the whole block is one step."""

    def site(self, name, fx_sites):
        """The group name of this call of hooked module ``name`` (an FX observer: the node it follows) and
        the observer's own name (FX) or None."""
        k = self.calls.get(name, 0)
        self.calls[name] = k + 1
        if fx_sites and k < len(fx_sites):
            return fx_sites[k]
        return name, None


@contextlib.contextmanager
def capture(model, path, *, step=None, references=True, overwrite=False, layers=None, keep="all",
            compression=None, steps=None, every=None):
    """Record the fake-quantize and batch-norm modules of ``model`` during one forward + backward into run
    file ``path`` (under ``step_<N>/`` when ``step`` is given), writing each group as the step runs; yields a
    :class:`Capture`.  Written when the block (or :meth:`Capture.step`) ends without an exception.

    ``layers`` (glob patterns on group paths), ``keep`` (``"all"``, ``"forward"``, ``"weights"``) and
    ``compression``: see :class:`RunFileWriter`.  ``steps`` / ``every``: the steps of ``with cap.step(i):``
    that are captured (those in ``steps``, and with ``i % every == 0``)."""
    torch = _torch()
    writer = RunFileWriter(path, step=step, references=references, overwrite=overwrite, layers=layers, keep=keep,
                           compression=compression)
    cap = Capture(writer, steps=steps, every=every)
    handles = []
    fake_quant_types, bn_type = _module_types(torch)
    torchao_type = _torchao_type()
    fake_quant_types += (torchao_type,) if torchao_type else ()
    hooked = [(name, module) for name, module in model.named_modules() if isinstance(module, fake_quant_types)
              or isinstance(module, bn_type)]
    sites = _fx_sites(model, fake_quant_types)
    names = [name for name, _ in hooked] + [s for calls in sites.values() for s, _ in calls]
    if torchao_type:
        cap.skipped.update(_torchao_unseen(model))
    mx_type = _mx_linear_type()
    for name, module in model.named_modules() if mx_type else ():
        if isinstance(module, mx_type):
            handles.append(module.register_forward_hook(_mx_hook(torch, cap, name or "mx_linear")))
    for name, module in hooked:
        fake_quant = isinstance(module, fake_quant_types)
        leaf = "fake_quant" if fake_quant else "batch_norm"
        # A module with hooked modules below it (prepare_qat puts bn1.activation_post_process under bn1) is
        # the group <path>/batch_norm: a layer's group holds no other layer.
        if not name or any(other.startswith(name + ".") for other in names if other != name):
            name = f"{name}.{leaf}" if name else leaf
        if not fake_quant:
            make = _batch_norm_hook(torch, cap, name)
        elif torchao_type and isinstance(module, torchao_type):
            make = _torchao_hook(torch, cap, name)
        else:
            make = _fake_quant_hook(torch, cap, name, sites.get(id(module)))
        handles.append(module.register_forward_hook(make))
    try:
        yield cap
    except BaseException:
        writer.discard()
        raise
    finally:
        for h in handles:
            h.remove()
    if not cap.explicit:
        cap.end_step()
    writer.close()


def _module_types(torch):
    from torch.ao.quantization.fake_quantize import FakeQuantizeBase

    return (FakeQuantizeBase,), torch.nn.modules.batchnorm._BatchNorm


def _fx_sites(model, fake_quant_types):
    """An FX graph module's activation observers (``activation_post_process_N``, called from the graph): module
    id -> ``[(group name, observer name)]`` per call in graph order, named by the node each call follows (the
    module's path, or the function inside the module that called it: ``layer1.0.conv1.activation_post_process``,
    ``layer1.0.relu.activation_post_process``); an observer the graph calls at several sites has one name per
    site."""
    graph = getattr(model, "graph", None)
    if graph is None or not hasattr(graph, "nodes") or not hasattr(model, "get_submodule"):
        return {}
    sites = {}
    for node in graph.nodes:
        if node.op != "call_module" or not node.args or not hasattr(node.args[0], "op"):
            continue
        try:
            module = model.get_submodule(node.target)
        except AttributeError:
            continue
        if isinstance(module, fake_quant_types):
            follows = _node_path(node.args[0])
            sites.setdefault(id(module), []).append((f"{follows}.activation_post_process", str(node.target)))
    return sites


def _node_path(node):
    """An FX node as a module path: a module's own path, a function or method by the module whose forward
    called it (``layer1.0`` + ``relu``: tracing records the module stack), an input by its name."""
    if node.op in ("call_module", "placeholder", "get_attr"):
        return str(node.target)
    op = getattr(node.target, "__name__", None) or str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return op
    key, value = list(stack.items())[-1]
    scope = value[0] if isinstance(value, tuple) else key
    return f"{scope}.{op}" if scope else op


def _torchao_type():
    """torchao's quantizer base class, when the user's code imported torchao (else no module can be one:
    importing it here would cost seconds, and its log lines, for every torch.ao capture)."""
    if "torchao" not in sys.modules:
        return None
    try:
        from torchao.quantization.qat.fake_quantizer import FakeQuantizerBase
    except ImportError:
        return None
    return FakeQuantizerBase


def _torchao_unseen(model):
    """torchao's prototype NVFP4 QAT layer, whose forward runs on a Blackwell GPU only: path -> why it is not
    recorded (MX layers are: :func:`_mx_hook`)."""
    return {name: f"{type(m).__name__}: torchao's NVFP4 QAT forward needs a Blackwell GPU (an fp4 scaled mm); "
                  "qgcli captures no NVFP4 layer: write its groups (op = \"nvfp4\") from your own hooks"
            for name, m in model.named_modules()
            if type(m).__module__.startswith("torchao.prototype.") and type(m).__name__ == "NVFP4FakeQuantizedLinear"}


# --- torchao's prototype MX QAT layer (MXFakeQuantizedLinear) ------------------------------------------------

#: MXFakeQuantizeConfig.dtype (its torch name) -> qgcli's --mx-format
_MX_FORMATS = {"float4_e2m1fn_x2": "mxfp4", "float8_e4m3fn": "mxfp8-e4m3", "float8_e5m2": "mxfp8-e5m2"}


def _mx_linear_type():
    """torchao's MXFakeQuantizedLinear when the user's code loaded it (nothing is imported here)."""
    return getattr(sys.modules.get("torchao.prototype.qat.mx"), "MXFakeQuantizedLinear", None)


def _mx_hook(torch, cap, name):
    """MXFakeQuantizedLinear quantizes its input (viewed as ``[-1, in_features]``) and its weight with
    ``MXTensor.to_mx`` inside its forward: two groups ``<path>.activation_fake_quantizer`` /
    ``<path>.weight_fake_quantizer`` (``op = "mx"``, blocks along the last axis), ``reference/`` torchao's own
    ``to_mx(...).dequantize(float32)`` and scales; in the backward, the upstream gradient of each dequantized
    tensor as torchao's backward forms it (``grad_output @ W`` and ``grad_output^T @ x``), which it passes on
    unchanged (the identity STE): ``gradients`` and ``reference/backprops_wrt_input``."""
    def hook(module, args, output):
        if not cap.active:
            return
        x = args[0]
        groups, dequantized = {}, {}
        for part, t, config in (("activation", x.reshape(-1, x.shape[-1]), module.activation_config),
                                ("weight", module.weight, module.weight_config)):
            label, _ = cap.site(f"{name}.{part}_fake_quantizer", None)
            wanted = cap.writer.wants(label, weight=part == "weight")
            groups[part], dequantized[part] = _mx_quantize(torch, cap, label, module, t.detach(), config, wanted)
        if cap.writer.backward and any(g is not None for g in groups.values()):
            _on_gradient(output, lambda dy: _backward_mx(torch, groups, dequantized, dy))

    return hook


def _mx_quantize(torch, cap, label, module, t, config, record):
    """torchao's dequantized ``t`` (None where qgcli does not capture the config: the reason in ``skipped``)
    and, when ``record``, its group."""
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    fmt = _MX_FORMATS.get(_torch_dtype_name(config.dtype))
    why = (f"MX element dtype {_torch_dtype_name(config.dtype)} is not one qgcli captures" if fmt is None else
           f"inputs are {_torch_dtype_name(t.dtype)}: qgcli captures torchao's float32 path only"
           if t.dtype != torch.float32 else None)
    if why is not None:
        if record:
            cap.skipped[label] = why
        return None, None
    q = MXTensor.to_mx(t, elem_dtype=config.dtype, block_size=config.block_size, scaling_mode=config.scaling_mode,
                       kernel_preference=config.kernel_preference)
    y = q.dequantize(torch.float32)
    if not record:
        return None, y
    import torchao

    attrs = {"format": fmt, "block_size": int(config.block_size), "axis": -1,
             "scale_mode": config.scaling_mode.name.lower(), "framework": "torchao",
             "torchao_version": torchao.__version__, "module": type(module).__name__}
    group = cap.writer.open_group(label, "mx", attrs)
    group.put({"inputs": _numpy(t)})
    scales = _numpy(q.scale.view(torch.uint8)).reshape(t.shape[0], -1)
    group.put_reference({"outputs": _numpy(y), "scales": scales}, digest=("outputs",))
    return group, y


def _backward_mx(torch, groups, dequantized, dy):
    """The upstream gradient of each dequantized tensor of an MX layer as its backward forms it
    (``grad_output @ W`` for the input, ``grad_output^T @ x`` for the weight)."""
    dy2 = dy.reshape(-1, dy.shape[-1]).to(torch.float32)
    other = {"activation": "weight", "weight": "activation"}
    for part, group in groups.items():
        partner = dequantized[other[part]]
        if group is None or partner is None:
            continue
        g = torch.mm(dy2, partner) if part == "activation" else torch.mm(dy2.t(), partner)
        group.put({"gradients": _numpy(g)})
        group.put_reference({"backprops_wrt_input": _numpy(g)})


def _numpy(t):
    return t.detach().cpu().contiguous().numpy()


def _on_gradient(output, write):
    """Call ``write(dy)`` with the upstream gradient of ``output`` during the backward pass (a tensor hook,
    which in-place ops after the module do not disturb); False when nothing can flow back."""
    if not output.requires_grad:
        return False

    def hook(grad):
        write(grad.detach())

    output.register_hook(hook)
    return True


def _per_channel(torch, module):
    qscheme = getattr(module, "qscheme", None)
    return qscheme in (torch.per_channel_symmetric, torch.per_channel_affine,
                       getattr(torch, "per_channel_affine_float_qparams", None))


def _is_weight(name, x, torch):
    return name.rpartition(".")[2] in ("weight_fake_quant", "weight_fake_quantizer") or isinstance(
        x, torch.nn.Parameter)


def _fake_quant_hook(torch, cap, name, fx_sites):
    from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize
    from torch.ao.quantization.fake_quantize import FusedMovingAvgObsFakeQuantize

    def hook(module, args, output):
        if not cap.active:
            return
        label, observer = cap.site(name, fx_sites)
        x = args[0]
        writer = cap.writer
        if not writer.wants(label, weight=_is_weight(name, x, torch)):
            return
        if not bool(module.fake_quant_enabled[0]):
            cap.skipped[label] = "fake quant disabled"
            return
        if not torch.is_floating_point(x):
            cap.skipped[label] = f"inputs are {x.dtype}"
            return
        learnable = isinstance(module, _LearnableFakeQuantize)
        fused = isinstance(module, FusedMovingAvgObsFakeQuantize)
        per_channel = _per_channel(torch, module)
        if learnable or fused:
            qmin, qmax = int(module.quant_min), int(module.quant_max)
        else:
            qmin, qmax = int(module.activation_post_process.quant_min), int(module.activation_post_process.quant_max)
        axis = int(module.ch_axis) % x.dim() if per_channel else None
        grad_factor = None
        if learnable:
            grad_factor = 1.0 / (x.numel() * module.quant_max) ** 0.5 if module.use_grad_scaling else 1.0
        s = {"scale": module.scale.detach().clone(), "zero_point": module.zero_point.detach().clone(),
             "qmin": qmin, "qmax": qmax, "axis": axis, "learnable": learnable, "fused": fused,
             "grad_factor": grad_factor, "module": module}
        if fused:  # this call's own range: an observer that several FX sites share moves on before the backward
            obs = module.activation_post_process
            s["range"] = obs.min_val.detach().clone(), obs.max_val.detach().clone()
        scale = _numpy(s["scale"]).astype(np.float32)
        zp = s["zero_point"]
        if learnable:  # the kernel rounds and clamps LSQ's float zero point
            zp = zp.round().clamp(qmin, qmax)
        zp = _numpy(zp).astype(np.int32)
        if axis is None:
            scale, zp = scale.reshape(()), zp.reshape(())
        attrs = {"quant_min": qmin, "quant_max": qmax, "axis": axis, "framework": "torch",
                 "module": type(module).__name__, "observer": observer}
        qscheme = getattr(module, "qscheme", None)
        if qscheme is not None:  # how its observer picks scale and zero point (qgcli report's suggested ones)
            attrs["qscheme"] = str(qscheme).replace("torch.", "")
        if learnable:
            attrs.update(estimator="lsq", grad_factor=float(grad_factor))
        x = x.detach()
        backward = writer.backward and output.requires_grad
        if not backward:  # else the backward's replay checks the output (one replay, not two)
            with torch.no_grad():
                replayed, _ = _replay_fake_quant(torch, s, x, None)
            if not torch.equal(replayed, output):
                attrs["note"] = _REPLAY_DIFFERS
        op = "fake_quantize_per_tensor_affine" if axis is None else "fake_quantize_per_channel_affine"
        group = writer.open_group(label, op, attrs)
        group.put({"inputs": _numpy(x), "scale": scale, "zero_point": zp})
        out = _numpy(output)
        group.put_reference({"outputs": out}, digest=_DIGESTED)
        if backward:
            node = _kernel_node(output, _fake_quant_nodes(s))
            if node is not None:  # the step's own gradients, as its kernel's node hands them on: no replay
                node.register_hook(lambda dxs, dys: _live_fake_quant(torch, group, s, dxs, dys))
            else:
                s["outputs"] = digest(out)  # what the replay is checked against
                _on_gradient(output, lambda dy: _backward_fake_quant(torch, group, s, dy))

    return hook


def _kernel_node(output, names):
    """The autograd node of the kernel that made ``output`` (one of ``names``), whose hook receives the
    upstream gradient and the kernel's own gradients of the step; None for another node (a subclass's
    forward): the gradients are then replayed."""
    node = output.grad_fn
    return node if node is not None and type(node).__name__ in names else None


def _fake_quant_nodes(s):
    """The names of the autograd nodes of the kernel :func:`_replay_fake_quant` replays for ``s``."""
    if s["learnable"]:
        return ("FakeQuantizeLearnablePer" + ("Tensor" if s["axis"] is None else "Channel") + "AffineBackward0",)
    if s["fused"]:
        return ("FusedMovingAvgObsFqHelperBackward0",)
    if s["axis"] is None:
        return ("FakeQuantizePerTensorAffineCachemaskBackward0",
                "FakeQuantizePerTensorAffineCachemaskTensorQparamsBackward0")
    return ("FakeQuantizePerChannelAffineCachemaskBackward0",)


def _live_fake_quant(torch, group, s, grad_inputs, grad_outputs):
    """The kernel node's hook: the upstream gradient and the kernel's own input (LSQ: and scale, zero point)
    gradients of this step (a gradient missing, as for inputs that need none: replayed instead)."""
    dy = grad_outputs[0]
    if dy is None:
        return
    names = ("backprops_wrt_input",) + (("backprop_wrt_scale", "backprop_wrt_zero_point") if s["learnable"] else ())
    grads = grad_inputs[:len(names)]
    if len(grads) < len(names) or any(g is None for g in grads):
        _backward_fake_quant(torch, group, s, dy)
        return
    group.put({"gradients": _numpy(dy)})
    group.put_reference({k: _numpy(v) for k, v in zip(names, grads)}, digest=_DIGESTED)


def _backward_fake_quant(torch, group, s, dy):
    """The upstream gradient, and the module's own kernel's gradients on the stored operands."""
    x = torch.from_numpy(group.get("inputs"))
    replayed, grads = _replay_fake_quant(torch, s, x, dy)
    if "outputs" in s and not np.array_equal(digest(_numpy(replayed)), s["outputs"]):  # (a live node: its own)
        group.set_attrs(note=_REPLAY_DIFFERS)
    group.put({"gradients": _numpy(dy)})
    group.put_reference({k: _numpy(v) for k, v in grads.items()}, digest=_DIGESTED)


def _replay_fake_quant(torch, s, x, dy):
    """The module's own kernel on the recorded tensors: ``(outputs, {gradient name: tensor})``."""
    x = x.requires_grad_(dy is not None)  # the stored inputs read back (backward) or the call's own (no grad)
    scale, zp = s["scale"].clone(), s["zero_point"].clone()
    qmin, qmax, axis = s["qmin"], s["qmax"], s["axis"]
    grads = {}
    with torch.enable_grad() if dy is not None else contextlib.nullcontext():
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
                x, off, on, s["range"][0].clone(), s["range"][1].clone(), scale, zp,
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


def _batch_norm_hook(torch, cap, name):
    def hook(module, args, output):
        if not cap.active:
            return
        label, _ = cap.site(name, None)
        writer = cap.writer
        if not writer.wants(label):
            return
        batch_stats = module.training or module.running_mean is None
        if not batch_stats:
            cap.skipped[label] = "eval mode (running statistics): no batch statistics to differentiate"
            return
        x = args[0].detach()
        if x.dim() not in (2, 3, 4, 5):
            cap.skipped[label] = f"input of rank {x.dim()}"
            return
        eps, channels = float(module.eps), x.shape[1]
        weight = module.weight.detach() if module.weight is not None else torch.ones(channels, dtype=x.dtype)
        bias = module.bias.detach() if module.bias is not None else torch.zeros(channels, dtype=x.dtype)
        # What PyTorch's batch norm saves for its backward: the batch mean and 1/sqrt(biased var + eps).
        node = _kernel_node(output, ("NativeBatchNormBackward0",)) if module.weight is not None else None
        if node is not None and module.bias is not None:
            mean, invstd = node._saved_result1, node._saved_result2
        else:
            node = None
            with torch.no_grad():
                _, mean, invstd = torch.native_batch_norm(x, weight, bias, None, None, True, 0.0, eps)
        shape = tuple(x.shape)
        attrs = {"epsilon": eps, "data_format": "NCDHW" if len(shape) == 5 else "NCHW", "is_training": True,
                 "variance_kind": "inv-std", "framework": "torch", "module": type(module).__name__}
        if len(shape) < 4:
            attrs["framework_shape"] = np.asarray(shape, dtype=np.int64)
        group = writer.open_group(label, "FusedBatchNormV3", attrs)
        group.put({"x": _numpy(x).reshape(_as4(shape)), "scale": _numpy(weight).astype(np.float32),
                   "reserve_space_1": _numpy(mean), "reserve_space_2": _numpy(invstd)})
        if not writer.backward:
            return
        s = {"weight": weight.clone(), "mean": mean, "invstd": invstd, "eps": eps, "shape": shape,
             "bias": module.bias is not None, "done": False}
        if node is not None:  # the step's own gradients, from the kernel's node: no replay
            flows = True
            node.register_hook(lambda dxs, dys: _live_batch_norm(torch, group, s, dxs, dys))
        else:
            flows = _on_gradient(output, lambda dy: _backward_batch_norm(torch, group, s, dy))
        cap.pending.append((label, group.path, lambda: None if flows and s["done"] else _NO_GRADIENT))

    return hook


def _as4(shape):
    """A batch norm's input shape as the 4-D NCHW the op takes (BatchNorm1d: ``[N, C, L, 1]``)."""
    return tuple(shape) + (1,) * (4 - len(shape)) if len(shape) < 4 else tuple(shape)


def _live_batch_norm(torch, group, s, grad_inputs, grad_outputs):
    """NativeBatchNormBackward0's hook: the upstream gradient and the step's own x, weight and bias gradients
    (one missing, as for a frozen weight: replayed instead)."""
    dy = grad_outputs[0]
    if dy is None:
        return
    if len(grad_inputs) < 3 or any(g is None for g in grad_inputs[:3]):
        _backward_batch_norm(torch, group, s, dy)
        return
    dx, dw, db = grad_inputs[:3]
    _write_batch_norm_gradients(group, s, dy, dx, dw, db)


def _backward_batch_norm(torch, group, s, dy):
    shape = s["shape"]
    x = torch.from_numpy(group.get("x")).reshape(shape)
    dx, dw, db = torch.ops.aten.native_batch_norm_backward(dy, x, s["weight"], None, None, s["mean"], s["invstd"],
                                                           True, s["eps"], [True, True, True])
    _write_batch_norm_gradients(group, s, dy, dx, dw, db)


def _write_batch_norm_gradients(group, s, dy, dx, dw, db):
    shape = s["shape"]
    group.put({"y_backprop": _numpy(dy).reshape(_as4(shape))})
    reference = {"x_backprop": _numpy(dx).reshape(_as4(shape)), "scale_backprop": _numpy(dw)}
    if s["bias"]:
        reference["offset_backprop"] = _numpy(db)
    group.put_reference(reference)
    s["done"] = True


# --- torchao's QAT fake quantizers -------------------------------------------------------------------------

def _torch_dtype_name(dtype):
    """``int4`` of ``torch.int4`` (and of torchao's older ``TorchAODType.INT4``)."""
    return str(dtype).rpartition(".")[2].lower()


def _torchao_config(module, x):
    """qgcli's config of a torchao quantizer on float32 inputs ``x``; a QgcliError (its message one line) for a
    config qgcli does not reproduce."""
    from torchao.quantization.granularity import PerAxis, PerGroup, PerRow, PerTensor, PerToken
    from torchao.quantization.qat.fake_quantizer import Float8FakeQuantizer, IntxFakeQuantizer

    c = module.config
    gran = c.granularity
    if not isinstance(module, (Float8FakeQuantizer, IntxFakeQuantizer)):
        raise QgcliError(f"{type(module).__name__}: qgcli reproduces torchao's IntxFakeQuantizer and "
                         "Float8FakeQuantizer only")
    if isinstance(module, Float8FakeQuantizer):
        if isinstance(gran, PerRow) and gran.dim not in (-1, x.dim() - 1):
            raise QgcliError(f"PerRow(dim={gran.dim}): qgcli's per-row is the last dimension")
        text = "per-row" if isinstance(gran, PerRow) else "per-tensor" if isinstance(gran, PerTensor) else str(gran)
        return ts.float8_fake_quantize_config(_torch_dtype_name(c.dtype), text, c.hp_value_lb, c.hp_value_ub)
    if not c.is_dynamic or c.range_learning:
        raise QgcliError(f"{'range_learning=True' if c.range_learning else 'is_dynamic=False'}: qgcli computes "
                         "torchao's dynamic qparams only")
    if isinstance(gran, PerGroup):
        text = f"per-group:{gran.group_size}"
    elif isinstance(gran, PerAxis) and gran.axis == 0:
        text = "per-channel"
    elif isinstance(gran, PerToken):
        text = "per-token"
    else:
        text = str(gran)

    def precision(dtype):  # torchao's None: the input's dtype
        return _torch_dtype_name(x.dtype if dtype is None else dtype)

    return ts.intx_fake_quantize_config(_torch_dtype_name(c.dtype), text, c.mapping_type.name.lower(),
                                        precision(c.scale_precision), precision(c.zero_point_precision),
                                        c.zero_point_domain.name.lower(), c.eps)


def _torchao_hook(torch, cap, name):
    def hook(module, args, output):
        if not cap.active:
            return
        label, _ = cap.site(name, None)
        x = args[0]
        writer = cap.writer
        if not writer.wants(label, weight=_is_weight(name, x, torch)):
            return
        if not getattr(module, "enabled", True) or output is x:
            cap.skipped[label] = "fake quant disabled"
            return
        if x.dtype != torch.float32:
            cap.skipped[label] = (f"inputs are {_torch_dtype_name(x.dtype)}: qgcli reproduces torchao's float32 "
                                  "path only")
            return
        try:
            config = _torchao_config(module, x)
        except QgcliError as exc:
            cap.skipped[label] = f"torchao config not reproduced by qgcli: {exc}"
            return
        import torchao

        x = x.detach()
        attrs = {k: v for k, v in config.attributes().items() if v is not None}
        if getattr(config, "group_size", None) is not None:
            attrs["group_size"] = config.group_size
        attrs.update(framework="torchao", torchao_version=torchao.__version__, module=type(module).__name__)
        replayed, _, scale, zero_point = _replay_torchao(torch, module, x, None)
        if not torch.equal(replayed, output):
            attrs["note"] = "the module's output differs from a fresh quantizer of its config on the stored operands"
        group = writer.open_group(label, config.op, attrs)
        group.put({"inputs": _numpy(x)})
        group.put_reference({"outputs": _numpy(output), "scale": _qparam(torch, scale),
                             "zero_point": _qparam(torch, zero_point)}, digest=("outputs",))
        if writer.backward:
            _on_gradient(output, lambda dy: _backward_torchao(torch, group, module, dy))

    return hook


def _backward_torchao(torch, group, module, dy):
    x = torch.from_numpy(group.get("inputs"))
    _, dx, _, _ = _replay_torchao(torch, module, x, dy)
    group.put({"gradients": _numpy(dy)})
    group.put_reference({"backprops_wrt_input": _numpy(dx)})


def _replay_torchao(torch, module, x, dy):
    """A fresh quantizer of the module's config on the recorded tensors (the user's module keeps its state):
    ``(outputs, backprops_wrt_input or None, scale or None, zero_point or None)``."""
    from torchao.quantization.qat.fake_quantizer import Float8FakeQuantizer, IntxFakeQuantizer

    fresh = (Float8FakeQuantizer if isinstance(module, Float8FakeQuantizer) else IntxFakeQuantizer)(module.config)
    x = x.clone().requires_grad_(dy is not None)
    with torch.enable_grad() if dy is not None else torch.no_grad():
        y = fresh(x)
        dx = torch.autograd.grad(y, x, dy)[0] if dy is not None else None
    if isinstance(fresh, IntxFakeQuantizer):
        return y.detach(), dx, fresh.scale, fresh.zero_point
    scale = None
    try:  # torchao's own scale (a private function: absent from another version, the scale is not compared)
        from torchao.quantization.quant_primitives import _choose_scale_float8
        from torchao.quantization.utils import get_block_size

        c = module.config
        x = x.detach()
        scale = _choose_scale_float8(x, get_block_size(x.shape, c.granularity), c.dtype,
                                     hp_value_lb=c.hp_value_lb, hp_value_ub=c.hp_value_ub)
    except (ImportError, TypeError, RuntimeError):
        pass
    return y.detach(), dx, scale, None


def _qparam(torch, t):
    """A scale / zero point as qgcli writes it: float16 and int32 kept, other floats (bfloat16) as float32."""
    if t is None:
        return None
    t = t.detach()
    if t.dtype not in (torch.float16, torch.int32, torch.float32):
        t = t.to(torch.float32)
    return _numpy(t)
