"""Watch a PyTorch QAT run: per-layer statistics every N steps into a history file.

    with qgcli.monitor.torch.monitor(model, "run.qgh", every=10, optimizer=optimizer):
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()          # the monitor counts steps by the optimizer's step hook

Without ``optimizer=``, call ``mon.step()`` after each optimizer step.  Steps count from 1; a sample is taken
at step 1 and at every multiple of ``every``.  Hooked: the modules capture hooks (``torch.ao`` fake-quantize
modules, learnable ones included; torchao QAT fake quantizers; batch norms), named by module path (a module
with hooked modules below it gets the leaf ``.fake_quant`` / ``.batch_norm``).  Only the first forward of a
module in a step counts, and only forwards with autograd on (an evaluation pass under ``no_grad`` is ignored).

Passive: forward hooks and autograd-node hooks that only read (the upstream gradient is the node's
``grad_outputs``, the framework's input gradient its ``grad_inputs``); the integer codes are computed from the
module's own ``scale`` / ``zero_point`` buffers with tensor math, never by calling a quantizer or an observer,
so a monitored run's weights equal an unmonitored run's bit for bit.  Statistics are computed on the tensors'
device: on the CPU (float32) one pass of a compiled kernel per tensor (the input and output, the upstream
gradient, the input gradient: every sum and count at once, in double, rounded to float32 like the torch ops'
values), elsewhere torch ops; one transfer of the scalars per sample.  Oscillation (Nagel et al. 2022) is tracked at
every step: each weight quantizer keeps its last integer codes, last move direction and the frequency
``f_t = m*o_t + (1-m)*f_(t-1)`` (``momentum`` m); a sample records the share of weights with f above
``threshold``.

Under ``torch.distributed`` every rank must run the monitor; the statistics are gathered to rank 0 (means of
shares and norms, sums of counts, the smallest minimum and the largest maximum) and only rank 0 writes.
"""
import contextlib
import math
import sys

from qgcli.errors import UsageProblem
from qgcli.monitor.history import HistoryWriter, as_stored
from qgcli.monitor.tensorboard import LiveEvents

#: statistic -> how ranks combine it (others: the mean)
_REDUCE = {"scale_min": min, "zero_point_min": min, "range_min": min, "scale_max": max, "zero_point_max": max,
           "range_max": max, "oscillation_max": max, "nan_inputs": sum, "nan_grads": sum,
           "fake_quant_enabled": min, "observer_enabled": min, "in_optimizer": min}


def _torch():
    try:
        import torch
    except ImportError:
        from qgcli.errors import QgcliError

        raise QgcliError("qgcli.monitor.torch needs PyTorch: pip install 'qgcli[torch]'") from None
    return torch


@contextlib.contextmanager
def monitor(model, path, *, every=10, optimizer=None, momentum=0.01, threshold=0.02, overwrite=False,
            durable=False, tensorboard=None):
    """Record ``model``'s quantizers and batch norms every ``every`` steps into history ``path``; yields a
    :class:`Monitor`.  The hooks are removed and the history closed when the block ends.  ``tensorboard``: a
    folder where each sample is also written as TensorBoard events as it is taken (qgcli.monitor.tensorboard;
    pip install 'qgcli[tensorboard]')."""
    mon = Monitor(model, path, every=every, optimizer=optimizer, momentum=momentum, threshold=threshold,
                  overwrite=overwrite, durable=durable, tensorboard=tensorboard)
    try:
        yield mon
    finally:
        mon.close()


class _Layer:
    def __init__(self, path, module, kind, framework):
        self.path, self.module, self.kind, self.framework = path, module, kind, framework
        self.role = "batch_norm" if kind == "batch_norm" else None
        self.info = {}
        self.lid = None
        self.order = None  # first forward call's rank among the layers: the history's layer ids follow it
        self.seen_step = 0
        self.stats = {}
        self.osc = None  # a weight quantizer's oscillation buffers (see Monitor._track_oscillation)
        self.mask = None  # the compiled statistics' per-element byte mask, reused (see Monitor._forward_kernel)


class Monitor:
    """The running monitor: ``step_count`` (completed steps), ``path``; :meth:`step` ends a step when no
    optimizer counts them."""

    def __init__(self, model, path, *, every=10, optimizer=None, momentum=0.01, threshold=0.02, overwrite=False,
                 durable=False, tensorboard=None):

        torch = self._t = _torch()
        if int(every) < 1:
            raise UsageProblem(f"every must be at least 1, not {every}")
        self.every, self.optimizer = int(every), optimizer
        self.momentum, self.threshold = float(momentum), float(threshold)
        self.step_count = 0
        self.path = path
        dist = torch.distributed
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        self.world = dist.get_world_size() if self._distributed else 1
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        self._layers = _find_layers(torch, model)
        self._calls = 0
        self._handles = []
        for layer in self._layers:
            m = layer.module
            if layer.kind == "batch_norm":
                self._handles.append(m.register_forward_pre_hook(self._bn_pre_hook(layer)))
                self._handles.append(m.register_forward_hook(self._bn_hook(layer)))
            else:
                self._handles.append(m.register_forward_hook(self._fq_hook(layer)))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_post_hook(lambda *_: self._end_step()))
        self._writer = self._events = None
        if self.rank == 0:
            try:
                self._writer = HistoryWriter(path, overwrite=overwrite, durable=durable, meta={
                    "framework": "torch", "torch_version": torch.__version__, "every": self.every,
                    "momentum": self.momentum, "threshold": self.threshold, "optimizer": optimizer is not None,
                    "world_size": self.world})
                if tensorboard is not None:
                    self._events = LiveEvents(tensorboard)
            except BaseException:
                self.close()  # no hook left behind, the history closed
                raise

    # --- steps ------------------------------------------------------------------------------------------

    @property
    def _current(self):
        return self.step_count + 1

    def _sampling(self, step=None):
        step = self._current if step is None else step
        return step == 1 or step % self.every == 0

    def step(self):
        """End the current step (call it after ``optimizer.step()`` when no ``optimizer=`` was given)."""
        if self.optimizer is not None:
            raise UsageProblem("this monitor counts steps by its optimizer's step hook: do not call step()")
        self._end_step()

    def _end_step(self):
        step = self._current
        self.step_count = step
        if self._sampling(step):
            self._flush(step)

    def close(self):
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._events is not None:
            self._events.close()
            self._events = None

    # --- hooks ------------------------------------------------------------------------------------------

    def _first_call(self, layer):
        """True for the layer's first autograd-on forward of this step."""
        if not self._t.is_grad_enabled() or layer.seen_step == self._current:
            return False
        layer.seen_step = self._current
        if layer.order is None:
            layer.order = self._calls
            self._calls += 1
        return True

    def _fq_hook(self, layer):
        torch = self._t

        def hook(module, args, output):
            if not args or not torch.is_tensor(args[0]) or not self._first_call(layer):
                return
            x = args[0]
            if layer.role is None:
                layer.role = "weight" if isinstance(x, torch.nn.Parameter) else "activation"
            sampling = self._sampling()
            if not sampling and layer.role != "weight":  # between samples only weights are watched (oscillation)
                return
            with torch.no_grad():
                qparams = _qparams(torch, layer, module, x)
                codes = None
                if sampling:
                    codes = self._forward_stats(layer, module, x, output, qparams)
                if layer.role == "weight" and qparams is not None:  # after: it clamps the codes in place
                    self._track_oscillation(layer, x.detach(), codes, qparams, sampling)

        return hook

    def _track_oscillation(self, layer, x, codes, qparams, sampling):
        """Every step, in place on integer buffers: the move ``s = sign(q - last)``, a flip where
        ``s * direction == -1``, the direction the last nonzero move, and the frequency
        ``f_t = (1-m) f_(t-1) + m o_t`` kept as ``f / (1-m)^k`` so that a step only adds to the flipped weights
        (rescaled at each sample).  On the CPU (float32 weights, blocks of contiguous weights, int16 codes) one
        pass of the compiled kernel ``qg_oscillation`` (codes included; the bits of the torch ops below);
        elsewhere torch ops, where comparisons and ``where`` cost more than arithmetic.  ``codes``: the
        unclamped codes when the caller computed them (a sample), else None."""
        torch = self._t
        qmin, qmax = qparams[2], qparams[3]
        osc = layer.osc
        first = osc is None or osc["last"].shape != x.shape
        kernel = _oscillation_kernel(torch, x, qparams)
        if first:
            small = torch.int16 if -2 ** 15 <= qmin and qmax < 2 ** 15 else torch.int32
            q = torch.zeros(x.shape, dtype=small, device=x.device)
            layer.osc = osc = {"last": q, "direction": torch.zeros(x.shape, dtype=torch.int8, device=x.device),
                               "frequency": torch.zeros(x.shape, device=x.device), "decay": 1.0}
        if not first:
            osc["decay"] *= 1 - self.momentum
        if kernel is not None:
            lib, blocks, inv, zp = kernel
            lib.qg_oscillation(x.data_ptr(), blocks, x.numel() // blocks, inv.data_ptr(), zp.data_ptr(), qmin, qmax,
                               osc["last"].data_ptr(), osc["direction"].data_ptr(), osc["frequency"].data_ptr(),
                               self.momentum / osc["decay"], int(first))
            q = osc["last"]
        else:
            if codes is None:
                codes = _codes(torch, x, *qparams)
            # a NaN weight makes no move (its code stays the last one), as in the kernel; the first step's last
            # codes are zeros there too
            q = torch.where(torch.isnan(codes), osc["last"], codes.clamp_(qmin, qmax).to(osc["last"].dtype))
            if first:
                osc["last"].copy_(q)
            else:
                direction = osc["direction"]
                move = torch.sub(q, osc["last"]).sign_().to(torch.int8)
                flip = torch.mul(move, direction).neg_().clamp_min_(0)  # 1 where the move reverses the last one
                direction.add_(move, alpha=2).sign_()
                osc["frequency"].add_(flip, alpha=self.momentum / osc["decay"])
                osc["last"].copy_(q)
        if first:
            osc["sample"] = q.clone()
        if sampling and kernel is not None:  # the same in one pass
            sums = _sums()
            kernel[0].qg_oscillation_sample(q.data_ptr(), osc["sample"].data_ptr(), osc["frequency"].data_ptr(),
                                            q.numel(), osc["decay"], self.threshold, sums.ctypes.data)
            osc["decay"] = 1.0
            changed, above, top = sums.tolist()[:3]
            layer.stats.update(codes_changed=changed / q.numel(), oscillating=above / q.numel(), oscillation_max=top)
        elif sampling:
            st = layer.stats
            frequency = osc["frequency"].mul_(osc["decay"])
            osc["decay"] = 1.0
            st["codes_changed"] = torch.count_nonzero(torch.ne(q, osc["sample"])) / q.numel()
            st["oscillating"] = torch.count_nonzero(frequency > self.threshold) / q.numel()
            st["oscillation_max"] = frequency.max()
            osc["sample"].copy_(q)

    def _forward_stats(self, layer, module, x, output, qparams):
        """The forward statistics; registers the gradient hooks.  Returns the unclamped integer codes when
        torch ops computed them (for :meth:`_track_oscillation`), else None."""
        torch = self._t
        s = layer.stats
        xd = x.detach()
        enabled = _enabled(torch, module)
        s["fake_quant_enabled"] = enabled
        if hasattr(module, "observer_enabled"):
            s["observer_enabled"] = module.observer_enabled[0]
        learnable = isinstance(getattr(module, "scale", None), torch.nn.Parameter) and module.scale.requires_grad
        layer.info["learnable"] = bool(learnable)
        if learnable and self.optimizer is not None:
            ids = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
            s["in_optimizer"] = float(id(module.scale) in ids)
        active = output is not x and torch.is_tensor(output)
        s["needs_grad"] = float(bool(active and output.requires_grad))
        outside = codes = compared = None  # outside: where the STE blocks the gradient (the code is clipped)
        n = xd.numel()
        dynamic = layer.framework == "torchao" and getattr(module.config, "is_dynamic", False)
        fast = qparams is not None and self._forward_kernel(layer, xd, output.detach() if active else None,
                                                             qparams, dynamic)
        if fast:  # one compiled pass; the mask's bit 0 is `outside`, bit 1 `compared`
            outside, compared = layer.mask, layer.mask if dynamic else None
        if qparams is not None:
            _qparam_stats(torch, s, *qparams[:4])
        if qparams is not None and not fast:
            qmin, qmax = qparams[2], qparams[3]
            codes = _codes(torch, xd, *qparams)
            # float arithmetic and sums only (comparisons, boolean masks and count_nonzero are several times
            # slower on the CPU): sign(codes - clamp(codes)) is -1 clipped low, +1 clipped high, 0 inside
            side = torch.clamp(codes, qmin, qmax).sub_(codes).neg_().sign_()
            net = side.sum()
            outside = side.abs_()  # 1 where the STE blocks the gradient
            clipped = outside.sum()
            s["clip_low"], s["clip_high"] = (clipped - net) / (2 * n), (clipped + net) / (2 * n)
        if not fast:
            power = _l2(torch, xd.float())
            s["nan_inputs"] = _nonfinite(torch, xd, power)
            if active:  # SQNR from two norms: |x| and |x - out| (one pass each)
                s["sqnr_db"] = 20 * torch.log10(power / torch.dist(xd.float(), output.detach().float())
                                                .clamp_min(1e-30))
        if not active or not output.requires_grad:
            return codes
        node = output.grad_fn
        if layer.framework == "torch.ao" and node is not None:
            node.register_hook(self._node_hook(layer, outside, learnable))
        else:  # torchao: a composite of ops, no one node; the input's gradient from its own tensor hook
            seen = {}
            # a scale computed from the input (dynamic) also passes gradient to each block's extremes: the STE
            # is compared on the other elements
            if outside is not None and dynamic and not fast:
                compared = _not_extreme(torch, xd, qparams[0].numel())

            def upstream(dy):
                seen["dy"] = dy
                seen["blocked"] = self._upstream(layer, dy, outside)

            output.register_hook(upstream)
            if x.requires_grad:
                _once(x, lambda dx: self._downstream(layer, dx, seen.get("dy"), seen.get("blocked"), compared))
            if learnable:
                _once(module.scale, lambda g: layer.stats.__setitem__("scale_grad_norm", g.float().norm()))
        return codes

    def _forward_kernel(self, layer, x, output, qparams, dynamic):
        """The forward statistics in one pass of the compiled ``qg_monitor_forward`` (float32 C-order CPU
        tensors, the blocks of ``qg_oscillation``): clipping shares, NaN/Inf (none), SQNR, and ``layer.mask``
        for the gradient hooks.  False where it does not apply or the input is not finite (torch ops then)."""
        torch = self._t
        kernel = _blocks_kernel(torch, x, qparams)
        if kernel is None or (output is not None and not _kernel_ready(torch, output, x.shape)):
            return False
        lib, blocks, inv, zp = kernel
        if layer.mask is None or layer.mask.shape != x.shape:
            layer.mask = torch.empty(x.shape, dtype=torch.int8)
        sums = _sums()
        lib.qg_monitor_forward(x.data_ptr(), None if output is None else output.data_ptr(), blocks,
                               x.numel() // blocks, inv.data_ptr(), zp.data_ptr(), qparams[2], qparams[3],
                               int(dynamic), layer.mask.data_ptr(), sums.ctypes.data)
        low, high, power, noise = sums.tolist()
        if not (math.isfinite(power) and math.isfinite(noise)):
            return False
        n, s = x.numel(), layer.stats
        s["clip_low"], s["clip_high"], s["nan_inputs"] = low / n, high / n, 0.0
        if output is not None:
            s["sqnr_db"] = _db(math.sqrt(power), max(math.sqrt(noise), _TINY_NOISE))
        return True

    def _node_hook(self, layer, outside, learnable):
        def hook(grad_inputs, grad_outputs):
            dy = grad_outputs[0] if grad_outputs else None
            if dy is None:
                return
            with self._t.no_grad():
                blocked = self._upstream(layer, dy, outside)
                dx = grad_inputs[0] if grad_inputs else None
                self._downstream(layer, dx, dy, blocked)
                if learnable and len(grad_inputs) >= 3:
                    for name, g in (("scale_grad_norm", grad_inputs[1]), ("zero_point_grad_norm", grad_inputs[2])):
                        if g is not None:
                            layer.stats[name] = g.float().norm()

        return hook

    def _upstream(self, layer, dy, outside):
        """The upstream gradient's statistics; returns ``(|dy|'s sum where the STE blocks it, |dy|'s sum,
        outside)`` for :meth:`_downstream`, or None without a mask."""
        torch = self._t
        with torch.no_grad():
            s = layer.stats
            fast = self._upstream_kernel(layer, dy.detach(), outside)
            if fast is not False:
                return fast
            if outside is not None and outside.dtype == torch.int8:
                outside = _mask_bit(torch, outside, 1)
            dyf = dy.detach().float()
            s["dy_norm"] = norm = _l2(torch, dyf)
            s["dy_zero"] = 1 - torch.sign(dyf).abs_().sum() / max(dyf.numel(), 1)  # faster than count_nonzero
            s["nan_grads"] = _nonfinite(torch, dyf, norm)
            if outside is None or outside.shape != dyf.shape:
                return None
            mass = dyf.abs().reshape(-1)
            l1_blocked, l1 = torch.dot(mass, outside.reshape(-1)), mass.sum()
            s["blocked"] = (l1_blocked / l1).clamp_max(1)  # two float32 sums: the ratio may exceed 1 by a rounding
            return l1_blocked, l1, outside

    def _upstream_kernel(self, layer, dy, mask):
        """:meth:`_upstream` in one pass of the compiled ``qg_monitor_upstream`` over a float32 C-order CPU
        ``dy`` (the sums in float); False where it does not apply or ``dy`` is not finite."""
        torch = self._t
        with_mask = mask is not None and mask.dtype == torch.int8 and mask.shape == dy.shape
        if not _kernel_ready(torch, dy) or (mask is not None and not with_mask):
            return False
        sums = _sums()
        n = dy.numel()
        _library().qg_monitor_upstream(dy.data_ptr(), mask.data_ptr() if with_mask else None, n, sums.ctypes.data)
        squares, nonzero, l1_blocked, l1 = sums.tolist()
        if not (math.isfinite(squares) and math.isfinite(l1)):
            return False
        s = layer.stats
        s["dy_norm"], s["dy_zero"], s["nan_grads"] = math.sqrt(squares), 1 - nonzero / max(n, 1), 0.0
        if not with_mask:
            return None
        s["blocked"] = min(_ratio(l1_blocked, l1), 1.0)
        return l1_blocked, l1, mask

    def _downstream(self, layer, dx, dy, blocked, compared=None):
        """The input gradient's norm, and ``ste_error``: sum |dx - dy*mask| / sum |dy*mask|, the mask 1 - outside
        (``dx - dy + dy*outside``: exactly 0 where dx is the STE's)."""
        torch = self._t
        if dx is None:
            return
        with torch.no_grad():
            if self._downstream_kernel(layer, dx.detach(), dy, blocked, compared):
                return
            if blocked is not None and blocked[2].dtype == torch.int8:  # the compiled mask, as the torch ops' floats
                mask = blocked[2]
                blocked = (torch.tensor(blocked[0], dtype=torch.float32),
                           torch.tensor(blocked[1], dtype=torch.float32), _mask_bit(torch, mask, 1))
                compared = None if compared is None else _mask_bit(torch, mask, 2)
            dxf = dx.detach().float()
            layer.stats["dx_norm"] = _l2(torch, dxf)
            if dy is None or blocked is None or not dxf.shape == dy.shape == blocked[2].shape:
                return
            l1_blocked, l1, outside = blocked
            dyf = dy.detach().float()
            error = torch.sub(dxf, dyf).addcmul_(dyf, outside)
            den = (l1 - l1_blocked).clamp_min(0)
            if compared is not None:  # only these elements' gradient is the STE's alone
                error.mul_(compared)
                den = torch.addcmul(dyf, dyf, outside, value=-1).mul_(compared).abs_().sum()
            den = torch.where(den > 0, den, dyf.abs().sum())
            layer.stats["ste_error"] = error.abs_().sum() / den

    def _downstream_kernel(self, layer, dx, dy, blocked, compared):
        """:meth:`_downstream` in one pass of the compiled ``qg_monitor_downstream`` (float32 C-order CPU
        tensors, ``blocked`` from :meth:`_upstream_kernel`); False where it does not apply or is not finite."""
        torch = self._t
        if not _kernel_ready(torch, dx):
            return False
        with_dy = dy is not None and blocked is not None
        if with_dy and blocked[2].dtype != torch.int8:  # the upstream statistics came from the torch ops
            return False
        if with_dy and not (_kernel_ready(torch, dy.detach(), dx.shape) and blocked[2].shape == dx.shape):
            return False
        sums = _sums()
        _library().qg_monitor_downstream(dx.data_ptr(), dy.detach().data_ptr() if with_dy else None,
                                         blocked[2].data_ptr() if with_dy else None, dx.numel(),
                                         int(compared is not None), sums.ctypes.data)
        squares, error, den = sums.tolist()[:3]
        if not (math.isfinite(squares) and math.isfinite(error)):
            return False
        layer.stats["dx_norm"] = math.sqrt(squares)
        if with_dy:
            l1_blocked, l1 = blocked[0], blocked[1]
            if compared is None:
                den = max(l1 - l1_blocked, 0.0)
            layer.stats["ste_error"] = _ratio(error, den if den > 0 else l1)
        return True

    def _bn_pre_hook(self, layer):
        torch = self._t

        def hook(module, args):
            if layer.order is None and torch.is_grad_enabled():  # before the observers its forward hooks call
                layer.order = self._calls
                self._calls += 1
            if self._sampling() and torch.is_grad_enabled() and module.training and module.running_mean is not None:
                layer.running = (module.running_mean.detach().clone(), module.running_var.detach().clone())

        return hook

    def _bn_hook(self, layer):
        torch = self._t

        def hook(module, args, output):
            running = getattr(layer, "running", None)
            layer.running = None
            if not self._sampling() or not args or not self._first_call(layer):
                return
            x = args[0]
            s = layer.stats
            with torch.no_grad():
                xd = x.detach()
                s["nan_inputs"] = _nonfinite(torch, xd, _l2(torch, xd.float()))
                s["needs_grad"] = float(bool(output.requires_grad))
                if running is not None and xd.dim() >= 2:
                    # the batch statistics from the running ones' update (r' = (1-m) r + m b, the variance
                    # unbiased): O(channels), not another pass over the activations
                    n = xd.numel() // xd.shape[1]
                    m = module.momentum if module.momentum is not None else 1 / float(module.num_batches_tracked)
                    rm, rv = running[0].float(), running[1].float()
                    mean = (module.running_mean.float() - (1 - m) * rm) / m
                    var = (module.running_var.float() - (1 - m) * rv) / m * ((n - 1) / n)
                    eps = float(module.eps)
                    s["bn_mean_shift"] = ((mean - rm).abs() / (rv + eps).sqrt()).mean()
                    s["bn_var_ratio"] = ((var + eps) / (rv + eps)).log().abs().mean()
            if output.requires_grad and output.grad_fn is not None:
                output.grad_fn.register_hook(self._node_hook(layer, None, False))

        return hook

    # --- samples ----------------------------------------------------------------------------------------

    def _flush(self, step):
        torch = self._t
        import numpy as np

        flat, pending, numbers = {}, {}, []
        for layer in self._layers:
            if not layer.stats:
                continue
            row = flat[layer.path] = {}
            for n, v in layer.stats.items():  # tensors in one transfer per device
                row[n] = None
                if torch.is_tensor(v):
                    pending.setdefault(v.device, []).append((row, n, v.detach().reshape(()).double()))
                else:
                    numbers.append((row, n, v))
            layer.stats = {}
        for items in pending.values():
            for (row, n, _), value in zip(items, torch.stack([v for _, _, v in items]).cpu().tolist()):
                row[n] = value
        # the compiled statistics' sums are doubles: rounded to float32, the torch ops' precision
        for (row, n, _), value in zip(numbers, np.array([v for *_, v in numbers], np.float32).tolist()):
            row[n] = value
        if self._distributed:
            gathered = [None] * self.world if self.rank == 0 else None
            torch.distributed.gather_object(flat, gathered, dst=0)
            if self.rank == 0:
                flat = _combine(gathered)
        if self._writer is None:
            return
        out = {}
        for layer in sorted(self._layers, key=lambda lay: (lay.order is None, lay.order or 0)):
            if layer.path not in flat:
                continue
            info = dict(layer.info)
            if layer.lid is None:
                layer.lid = self._writer.layer_id(layer.path, layer.kind, layer.role, type(layer.module).__name__,
                                                  info)
            out[layer.lid] = flat[layer.path]
        self._writer.add_sample(step, out, ranks=self.world)
        if self._events is not None:  # the values as the history holds them: the same as trend --tensorboard
            stored = as_stored(out)
            self._events.add_sample(step, {layer.path: stored[layer.lid] for layer in self._layers
                                           if layer.path in flat})


def _once(tensor, fn):
    """``fn(grad)`` at the next gradient of ``tensor`` only: a hook on a leaf (a weight) would otherwise stay
    for every later step."""
    handle = None

    def hook(grad):
        handle.remove()
        fn(grad)

    handle = tensor.register_hook(hook)


def _oscillation_kernel(torch, x, qparams):
    """``(library, blocks, 1/scale, zero point)`` for ``qg_oscillation`` when it applies to weight ``x``: int16
    codes and :func:`_blocks_kernel`; else None (the torch ops run)."""
    if qparams[2] < -2 ** 15 or qparams[3] >= 2 ** 15:
        return None
    return _blocks_kernel(torch, x, qparams)


def _blocks_kernel(torch, x, qparams):
    """``(library, blocks, 1/scale, zero point)`` for the compiled kernels that quantize ``x`` by contiguous
    blocks: a float32 C-order CPU tensor, per tensor, per channel along axis 0 or torchao's blocks; else None
    (the torch ops run)."""
    scale, zp, qmin, qmax, axis = qparams
    if not _kernel_ready(torch, x) or axis not in (None, 0, "blocks") or (axis == 0 and x.dim() == 0):
        return None
    lib = _library()
    blocks = scale.numel() if axis is not None else 1
    if lib is None or blocks < 1 or x.numel() % blocks or zp.numel() != scale.numel() or \
            (axis == 0 and blocks != x.shape[0]):
        return None
    inv = (1.0 / scale.float()).reshape(-1).contiguous().cpu()
    return lib, blocks, inv, zp.float().reshape(-1).contiguous().cpu()


def _library():
    from qgcli.ops.native import library

    return library()


def _kernel_ready(torch, t, shape=None):
    """Whether the compiled statistics read tensor ``t`` as it is: float32, C order, on the CPU, not empty (and
    shaped ``shape`` when given), with the kernels built."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.numel() > 0 and t.is_contiguous() and \
        (shape is None or t.shape == shape) and _library() is not None


def _sums():
    import numpy as np

    return np.zeros(4)


#: torch.dist's floor in the torch-ops SQNR (``clamp_min(1e-30)`` on a float32)
_TINY_NOISE = 1.0000000031710769e-30


def _db(power, noise):
    """``20 log10(power / noise)`` as torch computes it for a zero ``power``: -inf."""
    return 20 * math.log10(power / noise) if power > 0 else -math.inf


def _ratio(a, b):
    """``a / b`` with torch's division by zero: NaN for 0 / 0, else an infinity."""
    if b != 0:
        return a / b
    return math.nan if a == 0 or a != a else math.copysign(math.inf, a)


def _mask_bit(torch, mask, bit):
    """Bit ``bit`` of the compiled byte mask as the torch ops' float 0.0 / 1.0 tensor."""
    return torch.bitwise_and(mask, bit).ne_(0).float()


def _qparam_stats(torch, s, scale, zp, qmin, qmax):
    """The scale's min / median / max, the zero point's min / max and the range's ends into stats ``s``; on the
    CPU with NumPy (the same float32 arithmetic; a few microseconds where each small torch op costs more)."""
    sf, zf = scale.detach().float().flatten(), zp.detach().float().flatten()
    if sf.device.type == "cpu" and zf.device.type == "cpu" and sf.numel() > 0 and sf.shape == zf.shape:
        import numpy as np

        a, z = sf.numpy(), zf.numpy()
        low, high = (np.float32(qmin) - z) * a, (np.float32(qmax) - z) * a
        if np.isfinite(a).all() and np.isfinite(low).all() and np.isfinite(high).all():
            middle = (a.size - 1) // 2  # torch.median: the lower of the two middle values
            s.update(scale_min=a.min(), scale_median=np.partition(a, middle)[middle], scale_max=a.max(),
                     zero_point_min=z.min(), zero_point_max=z.max(), range_min=low.min(), range_max=high.max())
            return
    s["scale_min"], s["scale_median"], s["scale_max"] = sf.min(), sf.median(), sf.max()
    s["zero_point_min"], s["zero_point_max"] = zf.min(), zf.max()
    s["range_min"] = ((qmin - zf) * sf).min()
    s["range_max"] = ((qmax - zf) * sf).max()


def _l2(torch, x):
    """The L2 norm of float tensor ``x`` (a dot product: the fastest reduction on the CPU)."""
    flat = x.reshape(-1)
    return torch.dot(flat, flat).sqrt()


def _nonfinite(torch, x, norm):
    """NaN / Inf elements of ``x`` whose L2 ``norm`` is given: counted only when the norm is not finite (a check
    of one number on the CPU; on an accelerator the count, to keep the step free of a synchronisation)."""
    if norm.device.type == "cpu" and bool(torch.isfinite(norm)):
        return 0.0
    return (~torch.isfinite(x)).sum()


def _not_extreme(torch, x, blocks):
    """1.0 where an element of ``x`` is neither the smallest nor the largest of its block (``_codes``'s blocks),
    else 0.0: a scale computed from the block's min / max passes gradient to those alone.  Float arithmetic
    (``sign(max - x) * sign(x - min)``): comparisons and boolean masks are slower on the CPU."""
    xb = x.float().reshape(blocks, -1)
    above_min = torch.sub(xb, xb.amin(1, keepdim=True)).sign_()
    return torch.sub(xb.amax(1, keepdim=True), xb).sign_().mul_(above_min).reshape(x.shape)


def _combine(per_rank):
    """One sample from every rank's: see ``_REDUCE``; NaN (nothing measured) is left out of a mean."""
    paths = []
    for sample in per_rank:
        paths += [p for p in sample if p not in paths]
    out = {}
    for path in paths:
        names = []
        for sample in per_rank:
            names += [n for n in sample.get(path, {}) if n not in names]
        row = {}
        for n in names:
            vals = [sample[path][n] for sample in per_rank if n in sample.get(path, {})]
            vals = [v for v in vals if v == v]
            if vals:
                reduce = _REDUCE.get(n)
                row[n] = reduce(vals) if reduce else sum(vals) / len(vals)
        out[path] = row
    return out


# --- finding the layers and their quantization parameters ---------------------------------------------------

def _torchao_base():
    if "torchao" not in sys.modules:  # a model with torchao quantizers imported it already
        return None
    try:
        from torchao.quantization.qat.fake_quantizer import FakeQuantizerBase
    except ImportError:
        return None
    return FakeQuantizerBase


def _find_layers(torch, model):
    from torch.ao.quantization.fake_quantize import FakeQuantizeBase

    torchao = _torchao_base()
    bn = torch.nn.modules.batchnorm._BatchNorm
    found = []
    for name, m in model.named_modules():
        if isinstance(m, FakeQuantizeBase):
            found.append((name, m, "fake_quant", "torch.ao"))
        elif torchao is not None and isinstance(m, torchao):
            found.append((name, m, "fake_quant", "torchao"))
        elif isinstance(m, bn):
            found.append((name, m, "batch_norm", "torch"))
    names = [n for n, *_ in found]
    layers = []
    for name, m, kind, framework in found:
        # a module with hooked modules below it (prepare_qat puts bn1.activation_post_process under bn1)
        if not name or any(other.startswith(name + ".") for other in names):
            name = f"{name}.{kind}" if name else kind
        layers.append(_Layer(name, m, kind, framework))
    return layers


def _enabled(torch, module):
    flag = getattr(module, "fake_quant_enabled", None)
    if torch.is_tensor(flag):
        return flag[0]
    return float(bool(getattr(module, "enabled", True)))


def _qparams(torch, layer, module, x):
    """``(scale, zero_point, quant_min, quant_max, axis)`` as the module's forward used them (its buffers after
    the call), None for a quantizer without integer codes (float8)."""
    if not torch.is_floating_point(x):
        return None
    if layer.framework == "torch.ao":
        qmin = getattr(module, "quant_min", None)
        qmax = getattr(module, "quant_max", None)
        if qmin is None:
            obs = module.activation_post_process
            qmin, qmax = obs.quant_min, obs.quant_max
        qmin, qmax = int(qmin), int(qmax)
        scale, zp = module.scale, module.zero_point
        qscheme = getattr(module, "qscheme", None)
        per_channel = qscheme in (torch.per_channel_symmetric, torch.per_channel_affine,
                                  getattr(torch, "per_channel_affine_float_qparams", None))
        axis = int(module.ch_axis) % x.dim() if per_channel and x.dim() else None
        if zp.is_floating_point():  # LSQ's float zero point: its kernel rounds and clamps it
            zp = zp.detach().round().clamp(qmin, qmax)
        layer.info.update(quant_min=qmin, quant_max=qmax, per_channel=axis is not None, axis=axis)
        return scale.detach(), zp.detach(), qmin, qmax, axis
    scale = getattr(module, "scale", None)
    if not torch.is_tensor(scale) or not hasattr(module.config, "mapping_type"):
        return None
    from torchao.quantization.quant_primitives import _DTYPE_TO_QVALUE_BOUNDS

    bounds = _DTYPE_TO_QVALUE_BOUNDS.get(module.config.dtype)
    if bounds is None or x.numel() % max(scale.numel(), 1):
        return None
    zp = module.zero_point if torch.is_tensor(module.zero_point) else torch.zeros_like(scale)
    layer.info.update(quant_min=int(bounds[0]), quant_max=int(bounds[1]), per_channel=scale.numel() > 1,
                      dtype=str(module.config.dtype).rpartition(".")[2], granularity=str(module.config.granularity))
    return scale.detach(), zp.detach().float(), int(bounds[0]), int(bounds[1]), "blocks"


def _codes(torch, x, scale, zp, qmin, qmax, axis):
    """The integer codes before clamping, ``round(x * (1/scale)) + zero_point`` (the kernels' order), shaped
    like ``x``; torchao's blocks (groups, rows, tokens) are contiguous runs of ``x`` in ``scale``'s order."""
    xf = x.float()
    if axis == "blocks":
        q = (xf.reshape(scale.numel(), -1) * (1.0 / scale.float().reshape(-1, 1))).round_()
        return q.add_(zp.reshape(-1, 1)).reshape(x.shape)
    if axis is not None:
        shape = [1] * x.dim()
        shape[axis] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    return (xf * (1.0 / scale.float())).round_().add_(zp.float())
