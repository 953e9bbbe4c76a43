"""Watch a TensorFlow QAT run (tf_keras + TF Model Optimization): per-layer statistics into a history file.

    model.fit(x, y, epochs=3, callbacks=[qgcli.monitor.keras.Monitor("run.qgh", every=10)])

or, for a custom loop (the step may be a ``tf.function``; nothing is forced eager)::

    with qgcli.monitor.keras.monitor("run.qgh", every=10) as mon:
        for x, y in dataset:
            train_step(x, y)      # a tf.function: forward, tf.GradientTape, apply_gradients
            mon.step()            # after each step, in Python

Steps count from 1; a sample is taken at step 1 and every multiple of ``every``.  Hooked: every call of
``tf.quantization.fake_quant_with_min_max_vars`` / ``..._per_channel`` / ``..._args`` made while the monitor is
on (tfmot's QAT wrappers look them up at call time), named by the call's name scope (``quant_conv2d/
LastValueQuant``; a second call in the same scope ``..._1``).  The functions traced while the monitor is on
carry it: ``Monitor`` rebuilds the model's train function at ``on_train_begin``; a custom loop's
``tf.function`` must be first called inside the ``with`` block.

How, in the graph: the statistics are computed by TensorFlow ops on the tensors' device and written, with the
step they belong to, into small float64 variables (one per layer and site: forward, upstream gradient, input
gradient, range gradient, oscillation); at a sample step ``mon.step()`` (or the callback) reads them all back in
one call, one host transfer per sample.  The upstream gradient and the input gradient are seen by identity
``tf.custom_gradient`` taps on the op's output and input (values unchanged: passive).  Weight quantizers (inputs
read from a variable) keep their last integer codes, last move direction and oscillation frequency in variables
updated at every step (element-wise, no branch).  ``Monitor`` traces the train step twice: a sampling one with
every statistic and a plain one with the oscillation update only, and hands ``model.fit`` the one the next step
needs, so that a step between samples runs no statistic, no branch and no host transfer; validation and
prediction run unmonitored.  A custom loop's ``tf.function`` is traced once, with each statistic inside a
``tf.cond`` on the step number (a variable set in Python between steps).  A learnable range (min and max passed
as trainable variables) records its gradient's norm as ``scale_grad_norm``.  A quantizer sampled before that does
not run at a later sample step (a ``tf.cond`` that skips it) is recorded there with ``fake_quant_enabled`` 0 only.
Batch norms (``tf.compat.v1.nn.fused_batch_norm`` with ``is_training``: tf_keras ``BatchNormalization`` on 4-D
and 5-D inputs, kept as ``quant_batch_normalization`` by tfmot's ``quantize_model``) record ``bn_mean_shift`` and
``bn_var_ratio`` (the batch statistics of its input against the running ones before the step's update) and
NaN/Inf inputs; not their gradient (a tap on the op's output would undo its fusion with the ReLU after it,
whose gradient rounds differently: the monitor would not be passive).  Not monitored: Keras 3.
"""
import contextlib
import inspect

from qgcli.errors import UsageProblem
from qgcli.monitor.history import HistoryWriter, as_stored
from qgcli.monitor.tensorboard import LiveEvents

_OPS = ("fake_quant_with_min_max_vars", "fake_quant_with_min_max_vars_per_channel", "fake_quant_with_min_max_args")
_BN = "fused_batch_norm"


def _tf():
    """TensorFlow, imported without its CUDA start-up noise when qgcli is the first to import it."""
    from qgcli.monitor.quiet_tensorflow import import_tensorflow

    return import_tensorflow("qgcli.monitor.keras")


class _Watch:
    """What one monitor shares between its wrapped ops, the step counter and the history.

    ``mode``, read when a function is traced: ``cond`` (a custom loop: statistics behind a ``tf.cond`` on the step
    number), ``full`` (every statistic, no branch), ``light`` (the oscillation update only), ``off`` (the
    original ops: ``Monitor`` between its train steps, so validation and prediction are not monitored)."""

    def __init__(self, path, every, momentum, threshold, overwrite, durable, tensorboard=None, mode="cond"):
        tf = self.tf = _tf()
        if int(every) < 1:
            raise UsageProblem(f"every must be at least 1, not {every}")
        self.every, self.momentum, self.threshold = int(every), float(momentum), float(threshold)
        self.mode = mode
        self.step_count = 0
        self.clock = tf.Variable(1.0, dtype=tf.float64, trainable=False, name="qgcli_monitor_step")  # the step run
        self.sinks = {}  # (layer, site, statistic names) -> float64 variable [step, *statistics]
        self._reader = None
        self.layers = {}  # layer -> (kind, role, info)
        self.state = {}  # layer -> oscillation variables
        self.counts = {}  # (graph, scope) -> calls seen in that graph
        self.patched = []
        self.writer = HistoryWriter(path, overwrite=overwrite, durable=durable, meta={
            "framework": "tensorflow", "tensorflow_version": tf.__version__, "every": self.every,
            "momentum": self.momentum, "threshold": self.threshold, "optimizer": False, "world_size": 1})
        self.events = None
        if tensorboard is not None:
            try:
                self.events = LiveEvents(tensorboard)
            except BaseException:
                self.writer.close()
                raise
        self.ids = {}

    # --- steps ------------------------------------------------------------------------------------------

    def is_sample(self, step):
        return step == 1 or step % self.every == 0

    def end_step(self):
        step = self.step_count = self.step_count + 1
        if self.is_sample(step) and self.sinks:
            self._write(step, self._collect(step))
        if self.mode == "cond":
            self.clock.assign(step + 1)
        if self.tf.executing_eagerly():
            self.counts = {k: v for k, v in self.counts.items() if k[0] != "eager"}

    def _collect(self, step):
        """``{layer: {statistic: value}}`` written at ``step``: every sink read back in one call."""
        if self._reader is None or len(self._reader[0]) != len(self.sinks):
            keys = list(self.sinks)
            variables = [self.sinks[k] for k in keys]
            self._reader = keys, self.tf.function(lambda: self.tf.concat([v.read_value() for v in variables], 0),
                                                  autograph=False)
        keys, read = self._reader
        values = read().numpy()
        pending, at = {}, 0
        for name, _, names in keys:
            if values[at] == step:
                pending.setdefault(name, {}).update(zip(names, values[at + 1:at + 1 + len(names)].tolist()))
            at += 1 + len(names)
        return pending

    def _write(self, step, pending):
        if not pending:
            return
        rows = {}
        for name, stats in pending.items():
            kind, role, info = self.layers[name]
            module = "tf.nn" if kind == "batch_norm" else "tf.quantization"
            lid = self.ids.get(name) or self.writer.layer_id(name, kind, role, module, info)
            self.ids[name] = lid
            rows[lid] = stats
        # a quantizer sampled before that did not run at this sample step: its fake quant was skipped
        # (a tf.cond around it, a retraced step without it)
        rows.update({lid: {"fake_quant_enabled": 0.0} for name, lid in self.ids.items()
                     if name not in pending and self.layers[name][0] == "fake_quant"})
        self.writer.add_sample(step, rows)
        if self.events is not None:  # the values as the history holds them: the same as trend --tensorboard
            stored = as_stored(rows)
            self.events.add_sample(step, {name: stored[self.ids[name]] for name in pending})

    # --- the wrapped ops --------------------------------------------------------------------------------

    def install(self):
        tf = self.tf
        modules = [tf.quantization] + [m for m in (getattr(tf.compat.v1, "quantization", None),)
                                       if m is not None and m is not tf.quantization]
        targets = [(m, attr, self._wrapper) for m in modules for attr in _OPS]
        targets.append((tf.compat.v1.nn, _BN, self._bn_wrapper))
        for module, attr, wrap in targets:
            original = getattr(module, attr, None)
            if original is not None and not getattr(original, "_qgcli_monitor", False):
                self.patched.append((module, attr, original))
                wrapped = wrap(attr, original)
                wrapped._qgcli_monitor = True
                wrapped.__wrapped__ = original
                setattr(module, attr, wrapped)

    def uninstall(self):
        for module, attr, original in reversed(self.patched):
            setattr(module, attr, original)
        self.patched = []

    def close(self):
        self.uninstall()
        self.writer.close()
        if self.events is not None:
            self.events.close()

    def _name(self, given):
        tf = self.tf
        scope = tf.get_current_name_scope().strip("/")
        base = "/".join(p for p in (scope, given) if p) or "fake_quant"
        graph = "eager" if tf.executing_eagerly() else id(tf.compat.v1.get_default_graph())
        n = self.counts.get((graph, base), 0)
        self.counts[(graph, base)] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def _slot(self):
        """Forward tensors the gradient taps read (a variable read in a gradient function fails under a
        ``tf.cond``: cond_v2 cannot capture the eager variable's handle there): the step, and in ``cond`` mode
        whether it is a sample step."""
        tf = self.tf
        stamp = tf.identity(self.clock)
        slot = {"stamp": stamp}
        if self.mode == "cond":
            slot["sampling"] = tf.logical_or(tf.equal(stamp, 1.0), tf.equal(tf.math.floormod(stamp, self.every), 0.0))
        return slot

    def _sink(self, name, site, names):
        tf = self.tf
        key = (name, site, tuple(names))
        if key not in self.sinks:
            with tf.init_scope():  # step -1: never written
                self.sinks[key] = tf.Variable(tf.fill([len(names) + 1], tf.constant(-1.0, tf.float64)),
                                              trainable=False)
        return self.sinks[key]

    def _gradient_sinks(self, slot, name, **sites):
        """The gradient taps' variables, made now, their handles forward tensors in ``slot``: a gradient built
        under a ``tf.cond`` cannot capture a variable itself."""
        handles = slot.setdefault("handles", {})
        for site, names in sites.items():
            if names is not None:
                handles[site, tuple(names)] = self.tf.identity(self._sink(name, site, names).handle)

    def _sampled(self, slot, name, site, make_stats, names):
        """``make_stats()`` (statistic -> scalar tensor, for ``names``) written with the step into this site's
        variable: at every call in ``full`` mode, at sample steps in ``cond`` mode (built inside the branch, so
        nothing of it runs at other steps).  Returns an op to depend on."""
        tf = self.tf
        sink = self._sink(name, site, names)

        def write():
            stats = make_stats()
            vector = tf.stack([v if v.dtype == tf.float32 else tf.cast(v, tf.float32)
                               for v in (tf.convert_to_tensor(stats[n]) for n in names)])
            values = tf.concat([tf.reshape(slot["stamp"], [1]), tf.cast(vector, tf.float64)], 0)
            handle = slot.get("handles", {}).get((site, tuple(names)))
            assign = (sink.assign(values, read_value=False) if handle is None else
                      tf.raw_ops.AssignVariableOp(resource=handle, value=values))
            with tf.control_dependencies([assign]):
                return tf.constant(0)

        if self.mode == "full":
            return write()
        return tf.cond(slot["sampling"], write, lambda: tf.constant(0))

    def _wrapper(self, attr, original):
        tf = self.tf
        signature = inspect.signature(original)

        def wrapper(*args, **kwargs):
            if self.mode == "off":
                return original(*args, **kwargs)
            a = signature.bind(*args, **kwargs)
            a.apply_defaults()
            a = dict(a.arguments)
            x = tf.convert_to_tensor(a["inputs"])
            if x.dtype != tf.float32:
                return original(**a)
            name = self._name(a.get("name"))
            bits, narrow = int(a["num_bits"]), bool(a["narrow_range"])
            if attr == "fake_quant_with_min_max_args":
                lo, hi = tf.constant(float(a["min"])), tf.constant(float(a["max"]))
            else:
                lo, hi = tf.convert_to_tensor(a["min"]), tf.convert_to_tensor(a["max"])
            role = "weight" if _reads_variable(x) else "activation"
            per_channel = attr.endswith("per_channel")
            # a learnable range (trainable variables, as tfmot passes them): its gradient's norm
            learnable = attr != "fake_quant_with_min_max_args" and all(
                isinstance(v, tf.Variable) and v.trainable for v in (a["min"], a["max"]))
            self.layers.setdefault(name, ("fake_quant", role, {
                "quant_min": int(narrow), "quant_max": 2 ** bits - 1, "per_channel": per_channel,
                "num_bits": bits, "narrow_range": narrow, "op": attr, "learnable": learnable}))
            geometry = _nudged(tf, lo, hi, bits, narrow)
            if self.mode == "light":  # between samples: the oscillation counts only
                y = original(**a)
                if role == "weight":
                    with tf.control_dependencies(self._oscillation(name, x, geometry, None)):
                        y = tf.identity(y)
                return y
            slot = self._slot()
            a["inputs"] = self._tap_dx(name, x, slot)
            if learnable:
                a["min"], a["max"] = self._tap_range(name, lo, hi, slot)
            y = original(**a)
            self._gradient_sinks(slot, name, dx=_DX if y.shape == x.shape else _DX[:1], dy=_DY + ("blocked",),
                                 range=("scale_grad_norm",) if learnable else None)
            done = []
            if role == "weight":
                done += self._oscillation(name, x, geometry, slot)
            done.append(self._sampled(slot, name, "forward", lambda: _forward_stats(tf, x, y, lo, hi, geometry),
                                      _FORWARD))
            with tf.control_dependencies(done):
                y = tf.identity(y)
            if self.mode == "full":  # the STE mask, once for both gradient taps
                inside = geometry["mask"](x)
                slot["mask"] = lambda: inside
            else:  # built inside the gradient taps' sampling branches
                slot["mask"] = lambda: geometry["mask"](x)
            return self._tap_dy(name, y, slot)

        return wrapper

    def _bn_wrapper(self, attr, original):
        tf = self.tf
        signature = inspect.signature(original)

        def wrapper(*args, **kwargs):
            if self.mode in ("off", "light"):
                return original(*args, **kwargs)
            a = signature.bind(*args, **kwargs)
            a.apply_defaults()
            a = dict(a.arguments)
            factor = a.get("exponential_avg_factor", 1.0)
            x = tf.convert_to_tensor(a["x"])
            if (a["is_training"] is not True or a["mean"] is None or a["variance"] is None or x.dtype != tf.float32
                    or not isinstance(factor, (int, float)) or factor <= 0):
                return original(**a)
            name = self._name(a.get("name") or "batch_norm")
            fmt = a.get("data_format") or "NHWC"
            self.layers.setdefault(name, ("batch_norm", "batch_norm", {
                "op": "FusedBatchNormV3", "epsilon": float(a["epsilon"]), "data_format": fmt,
                "exponential_avg_factor": float(factor)}))
            # the running statistics as the op reads them, before the step's update
            running = tf.convert_to_tensor(a["mean"]), tf.convert_to_tensor(a["variance"])
            out = original(**a)
            # nothing is added on the op's output: an op between it and its ReLU would undo the fusion of the two
            # (oneDNN), whose gradient rounds otherwise; a variable's assignment runs in a tf.function unasked
            self._sampled(self._slot(), name, "forward", lambda: _bn_stats(
                tf, x, running, fmt, float(a["epsilon"])), _BN_FORWARD)
            return out

        return wrapper

    def _tap_dy(self, name, y, slot):
        tf = self.tf
        names = _DY + (("blocked",) if "mask" in slot else ())

        @tf.custom_gradient
        def identity(t):
            def grad(dy):
                slot["dy"] = dy

                def stats():
                    squares = 2 * tf.nn.l2_loss(dy)  # one kernel: the sum of squares / 2
                    out = {"dy_norm": tf.sqrt(squares),
                           "dy_zero": tf.reduce_mean(tf.cast(tf.equal(dy, 0), tf.float32)),
                           "nan_grads": _nonfinite(tf, dy, squares),
                           "needs_grad": tf.constant(1.0)}
                    if "mask" in slot:
                        mass = tf.abs(dy)
                        total = tf.reduce_sum(mass)
                        out["blocked"] = tf.reduce_sum(mass * (1 - slot["mask"]())) / total
                        if self.mode == "full":  # no branch: the input gradient's tap reuses it
                            slot["dy_mass"] = total
                    return out

                done = self._sampled(slot, name, "dy", stats, names)
                with tf.control_dependencies([done]):
                    return tf.identity(dy)
            return tf.identity(t), grad

        return identity(y)

    def _tap_dx(self, name, x, slot):
        tf = self.tf

        @tf.custom_gradient
        def identity(t):
            def grad(dx):
                dy = slot.get("dy")
                compared = dy is not None and dy.shape == dx.shape
                names = _DX if compared else _DX[:1]

                def stats():
                    out = {"dx_norm": tf.sqrt(2 * tf.nn.l2_loss(dx))}
                    if compared:
                        reference = dy * slot["mask"]()
                        den = tf.reduce_sum(tf.abs(reference))
                        total = slot["dy_mass"] if "dy_mass" in slot else tf.reduce_sum(tf.abs(dy))
                        den = tf.where(den > 0, den, total)
                        out["ste_error"] = tf.reduce_sum(tf.abs(dx - reference)) / den
                    return out

                done = self._sampled(slot, name, "dx", stats, names)
                with tf.control_dependencies([done]):
                    return tf.identity(dx)
            return tf.identity(t), grad

        return identity(x)

    def _tap_range(self, name, lo, hi, slot):
        """``lo`` and ``hi`` unchanged; their gradient's norm (``scale_grad_norm``) at sample steps."""
        tf = self.tf

        @tf.custom_gradient
        def identity(low, high):
            def grad(dlow, dhigh):
                def stats():
                    parts = [tf.reshape(tf.cast(g, tf.float32), [-1]) for g in (dlow, dhigh) if g is not None]
                    return {"scale_grad_norm": tf.norm(tf.concat(parts, 0)) if parts else tf.constant(0.0)}

                done = self._sampled(slot, name, "range", stats, ("scale_grad_norm",))
                with tf.control_dependencies([done]):
                    return tf.identity(dlow), tf.identity(dhigh)
            return (tf.identity(low), tf.identity(high)), grad

        return identity(lo, hi)

    def _oscillation(self, name, x, geometry, slot):
        """Every step: this weight quantizer's codes against its last ones (variables made outside any graph),
        element-wise with no branch; with ``slot`` (a sampling trace) also the sample's statistics.  Returns
        the ops to depend on."""
        tf = self.tf
        if name not in self.state:
            with tf.init_scope():
                zeros = tf.zeros(x.shape, tf.float32)
                self.state[name] = {k: tf.Variable(zeros, trainable=False) for k in ("codes", "direction",
                                                                                     "frequency", "sample")}
                self.state[name]["started"] = tf.Variable(False, trainable=False)
        s = self.state[name]
        started = s["started"].read_value()
        codes = geometry["codes"](x)
        # the first step only stores the codes (no move yet)
        move = tf.sign(codes - s["codes"].read_value()) * tf.cast(started, tf.float32)
        direction = s["direction"].read_value()
        flipped = tf.nn.relu(-move * direction)  # 1 where the move reverses the last one
        frequency = s["frequency"].read_value() * (1 - self.momentum) + self.momentum * flipped
        direction = tf.sign(2 * move + direction)
        ops = [s["frequency"].assign(frequency, read_value=False), s["direction"].assign(direction, read_value=False),
               s["codes"].assign(codes, read_value=False), s["started"].assign(True, read_value=False)]
        if slot is None:
            return ops
        last = s["sample"].read_value()
        emitted = self._sampled(slot, name, "oscillation", lambda: {
            "codes_changed": tf.where(started, tf.reduce_mean(tf.cast(tf.not_equal(codes, last), tf.float32)), 0.0),
            "oscillating": tf.reduce_mean(tf.cast(frequency > self.threshold, tf.float32)),
            "oscillation_max": tf.reduce_max(frequency)}, _OSCILLATION)
        with tf.control_dependencies([emitted]):
            if self.mode == "full":
                ops.append(s["sample"].assign(codes, read_value=False))
            else:
                ops.append(tf.cond(slot["sampling"], lambda: _assigned(tf, s["sample"], codes), lambda: tf.constant(0)))
        return ops


_FORWARD = ("clip_low", "clip_high", "scale_min", "scale_median", "scale_max", "zero_point_min", "zero_point_max",
            "range_min", "range_max", "nan_inputs", "sqnr_db", "fake_quant_enabled")
_BN_FORWARD = ("bn_mean_shift", "bn_var_ratio", "nan_inputs")
_DY = ("dy_norm", "dy_zero", "nan_grads", "needs_grad")
_DX = ("dx_norm", "ste_error")
_OSCILLATION = ("codes_changed", "oscillating", "oscillation_max")


def _assigned(tf, variable, value):
    with tf.control_dependencies([variable.assign(value, read_value=False)]):
        return tf.constant(0)


def _bn_stats(tf, x, running, data_format, epsilon):
    """A fused batch norm's batch statistics (of its input, the variance biased, in float32 as the op computes
    them) against the running ones it read (tf_keras: the layer's ``moving_mean`` and ``moving_variance``), as
    the torch monitor reports them (bn_mean_shift, bn_var_ratio)."""
    axes = [0, 2, 3, 4][:x.shape.rank - 1] if data_format.startswith("NC") else list(range(x.shape.rank - 1))
    mean, var = tf.nn.moments(x, axes)
    f64 = tf.float64
    mean, var = tf.cast(mean, f64), tf.cast(var, f64)
    rm, rv = (tf.cast(t, f64) for t in running)
    return {"bn_mean_shift": tf.reduce_mean(tf.abs(mean - rm) / tf.sqrt(rv + epsilon)),
            "bn_var_ratio": tf.reduce_mean(tf.abs(tf.math.log((var + epsilon) / (rv + epsilon)))),
            "nan_inputs": _nonfinite(tf, x, tf.reduce_sum(mean))}


def _reads_variable(x):
    """Whether graph tensor ``x`` is read from a variable (a weight), through identities."""
    try:
        op = x.op
    except AttributeError:  # eager: no graph to look at
        return False
    for _ in range(4):
        if op.type in ("ReadVariableOp", "VarHandleOp"):
            return True
        if op.type not in ("Identity",) or not op.inputs:
            return False
        op = op.inputs[0].op
    return False


def _nudged(tf, lo, hi, bits, narrow):
    """TensorFlow's nudged range (tf_semantics: zero point rounded half away from zero) and two functions of
    the inputs: the STE mask (inclusive, on the nudged bounds) and the integer codes."""
    qmin, qmax = float(int(narrow)), float(2 ** bits - 1)
    lo, hi = tf.cast(lo, tf.float32), tf.cast(hi, tf.float32)
    # the kernel's float32 operations, each done in float64 and rounded back (the same result, float32 having
    # under half float64's digits): a graph's optimizer turns a float32 division by the constant 255 into a
    # multiplication by its reciprocal, which moves a zero point of x.5 (a symmetric range) by one
    f64 = tf.float64

    def f32(t):
        return tf.cast(t, tf.float32)

    scale = f32(tf.cast(hi - lo, f64) / (qmax - qmin))
    zp_from_min = f32(qmin - tf.cast(f32(tf.cast(lo, f64) / tf.cast(scale, f64)), f64))
    zp = f32(tf.clip_by_value(tf.floor(tf.cast(zp_from_min, f64) + 0.5), qmin, qmax))
    nmin, nmax = (qmin - zp) * scale, (qmax - zp) * scale

    def mask(x):
        return tf.cast((x >= nmin) & (x <= nmax), tf.float32)

    def codes(x):
        return tf.floor((tf.clip_by_value(x, nmin, nmax) - nmin) / scale + 0.5)

    return {"scale": scale, "zero_point": zp, "min": nmin, "max": nmax, "mask": mask, "codes": codes}


def _forward_stats(tf, x, y, lo, hi, g):
    flat = tf.reshape(g["scale"], [-1])
    ordered = tf.sort(flat)
    zp = tf.reshape(g["zero_point"], [-1])
    noise = 2 * tf.nn.l2_loss(x - y)
    signal = 2 * tf.nn.l2_loss(x)
    return {"clip_low": tf.reduce_mean(tf.cast(x < g["min"], tf.float32)),
            "clip_high": tf.reduce_mean(tf.cast(x > g["max"], tf.float32)),
            "scale_min": ordered[0], "scale_median": ordered[tf.size(ordered) // 2], "scale_max": ordered[-1],
            "zero_point_min": tf.reduce_min(zp), "zero_point_max": tf.reduce_max(zp),
            "range_min": tf.reduce_min(lo), "range_max": tf.reduce_max(hi),
            "nan_inputs": _nonfinite(tf, x, signal),
            "sqnr_db": 10.0 * tf.math.log(signal / tf.maximum(noise, 1e-30)) / tf.math.log(10.0),
            "fake_quant_enabled": tf.constant(1.0)}


def _nonfinite(tf, t, total):
    """The count of NaN and +-inf elements of ``t``, counted only when ``total`` (a sum over ``t`` computed
    anyway) is not finite: a finite sum has no such element, and the pass over ``t`` is saved."""
    return tf.cond(tf.math.is_finite(total), lambda: tf.constant(0.0),
                   lambda: tf.reduce_sum(tf.cast(~tf.math.is_finite(t), tf.float32)))


@contextlib.contextmanager
def monitor(path, *, every=10, momentum=0.01, threshold=0.02, overwrite=False, durable=False, tensorboard=None):
    """Watch every fake-quant call traced or run inside the block; yields an object whose ``step()`` ends a
    step (call it after each training step, in Python).  ``tensorboard``: a folder where each sample is also
    written as TensorBoard events as it is taken (qgcli.monitor.tensorboard)."""
    watch = _Watch(path, every, momentum, threshold, overwrite, durable, tensorboard)
    watch.install()
    try:
        yield _Loop(watch)
    finally:
        watch.close()


class _Loop:
    def __init__(self, watch):
        self._watch = watch

    @property
    def step_count(self):
        return self._watch.step_count

    def step(self):
        """End the current step."""
        self._watch.end_step()


def Monitor(path, every=10, *, momentum=0.01, threshold=0.02, overwrite=False, durable=False, tensorboard=None):
    """A tf_keras callback for ``model.fit``: every ``every`` steps into history ``path`` (and as TensorBoard
    events into folder ``tensorboard``, when given)."""
    tf = _tf()

    class _Callback(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self._supports_tf_logs = True  # the logs are not read: no per-batch conversion to NumPy for us

        def on_train_begin(self, logs=None):
            watch = self.watch = _Watch(path, every, momentum, threshold, overwrite, durable, tensorboard, mode="off")
            watch.install()
            model = self.model
            # two train steps, traced again with the monitor's ops at their first call: one that samples, one
            # with the oscillation update only; the mode is what the wrapped ops see while a step is traced
            self._steps = {}
            for mode in ("full", "light"):
                function = model.make_train_function(force=True)
                self._steps[mode] = _in_mode(watch, mode, function)
            model.train_function = self._steps["full"]  # step 1 is a sample

        def on_train_batch_end(self, batch, logs=None):
            watch = self.watch
            watch.end_step()
            self.model.train_function = self._steps["full" if watch.is_sample(watch.step_count + 1) else "light"]

        def on_train_end(self, logs=None):
            self.model.train_function = None  # the next fit traces its own, unmonitored unless asked
            self.watch.close()

    return _Callback()


def _in_mode(watch, mode, function):
    """``function`` (a traced train step) called with the wrapped ops in ``mode``; a sampling step is stamped
    with its step number."""
    def step(iterator):
        watch.mode = mode
        try:
            if mode == "full":
                watch.clock.assign(watch.step_count + 1)
            return function(iterator)
        finally:
            watch.mode = "off"

    return step
