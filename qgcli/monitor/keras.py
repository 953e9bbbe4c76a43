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

How, in the graph: the statistics are computed by TensorFlow ops on the tensors' device, inside a ``tf.cond``
on a ``sampling`` variable (set in Python between steps), and handed out through ``tf.py_function`` at sample
steps only.  The upstream gradient and the input gradient are seen by identity ``tf.custom_gradient`` taps on
the op's output and input (values unchanged: passive).  Weight quantizers (inputs read from a variable) keep
their last integer codes, last move direction and oscillation frequency in variables updated at every step.
A learnable range (min and max passed as trainable variables) records its gradient's norm as ``scale_grad_norm``.
A quantizer sampled before that does not run at a later sample step (a ``tf.cond`` that skips it) is recorded
there with ``fake_quant_enabled`` 0 only.  Not monitored: batch norms (use qgcli.capture for one step), Keras 3.
"""
import contextlib
import inspect

from qgcli.errors import UsageProblem
from qgcli.monitor.history import HistoryWriter
from qgcli.monitor.tensorboard import LiveEvents

_OPS = ("fake_quant_with_min_max_vars", "fake_quant_with_min_max_vars_per_channel", "fake_quant_with_min_max_args")


def _tf():
    """TensorFlow, imported without its CUDA start-up noise when qgcli is the first to import it."""
    from qgcli.monitor.quiet_tensorflow import import_tensorflow

    return import_tensorflow("qgcli.monitor.keras")


class _Watch:
    """What one monitor shares between its wrapped ops, the step counter and the history."""

    def __init__(self, path, every, momentum, threshold, overwrite, durable, tensorboard=None):
        tf = self.tf = _tf()
        if int(every) < 1:
            raise UsageProblem(f"every must be at least 1, not {every}")
        self.every, self.momentum, self.threshold = int(every), float(momentum), float(threshold)
        self.step_count = 0
        self.sampling = tf.Variable(True, trainable=False, name="qgcli_monitor_sampling")
        self.pending = {}  # layer -> {stat: value}, filled by py_function callbacks during a sample step
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
        if self.is_sample(step) and self.pending:
            rows = {}
            for name, stats in self.pending.items():
                kind, role, info = self.layers[name]
                lid = self.ids.get(name) or self.writer.layer_id(name, kind, role, "tf.quantization", info)
                self.ids[name] = lid
                rows[lid] = stats
            # a quantizer sampled before that did not run at this sample step: its fake quant was skipped
            # (a tf.cond around it, a retraced step without it)
            rows.update({lid: {"fake_quant_enabled": 0.0} for name, lid in self.ids.items()
                         if name not in self.pending})
            self.writer.add_sample(step, rows)
            if self.events is not None:
                self.events.add_sample(step, dict(self.pending))
        self.pending = {}
        self.sampling.assign(self.is_sample(step + 1))
        if self.tf.executing_eagerly():
            self.counts = {k: v for k, v in self.counts.items() if k[0] != "eager"}

    # --- the wrapped ops --------------------------------------------------------------------------------

    def install(self):
        tf = self.tf
        modules = [tf.quantization] + [m for m in (getattr(tf.compat.v1, "quantization", None),)
                                       if m is not None and m is not tf.quantization]
        for module in modules:
            for attr in _OPS:
                original = getattr(module, attr, None)
                if original is not None and not getattr(original, "_qgcli_monitor", False):
                    self.patched.append((module, attr, original))
                    setattr(module, attr, self._wrapper(attr, original))

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

    def _record(self, name, names):
        """A py_function body: stores one call's statistics for the current sample."""
        def record(*values):
            row = self.pending.setdefault(name, {})
            for n, v in zip(names, values):
                row[n] = float(v.numpy())
            return 0
        return record

    def _emit(self, name, make_stats):
        """In the graph: a branch for ``tf.cond`` on the sampling flag that computes ``make_stats()`` (name ->
        scalar tensor; inside the branch, so nothing of it runs at other steps) and hands it to Python."""
        tf = self.tf

        def out():
            stats = make_stats()
            names = list(stats)
            return tf.py_function(self._record(name, names), [tf.cast(stats[n], tf.float32) for n in names],
                                  Tout=tf.int32)
        return out

    def _when_sampling(self, slot, name, make_stats):
        """``make_stats`` computed and recorded at sample steps only (a dummy tensor to depend on)."""
        return self.tf.cond(slot["sampling"], self._emit(name, make_stats), lambda: self.tf.constant(0))

    def _wrapper(self, attr, original):
        tf = self.tf
        signature = inspect.signature(original)

        def wrapper(*args, **kwargs):
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
            # the gradient taps read the sampling flag as a forward tensor: a variable read in a gradient function
            # fails under a tf.cond (cond_v2 cannot capture the eager variable's handle there)
            slot = {"sampling": tf.identity(self.sampling)}
            a["inputs"] = self._tap_dx(name, x, slot)
            if learnable:
                a["min"], a["max"] = self._tap_range(name, lo, hi, slot)
            y = original(**a)
            geometry = _nudged(tf, lo, hi, bits, narrow)
            done = []
            if role == "weight":
                done.append(self._oscillation(name, x, geometry))
            done.append(self._when_sampling(slot, name, lambda: _forward_stats(tf, x, y, lo, hi, geometry)))
            with tf.control_dependencies(done):
                y = tf.identity(y)
            slot["mask"] = lambda: geometry["mask"](x)  # built inside the gradient taps' sampling branches
            return self._tap_dy(name, y, slot)

        wrapper._qgcli_monitor = True
        wrapper.__wrapped__ = original
        return wrapper

    def _tap_dy(self, name, y, slot):
        tf = self.tf

        @tf.custom_gradient
        def identity(t):
            def grad(dy):
                slot["dy"] = dy

                def stats():
                    mass = tf.abs(dy)
                    return {"dy_norm": tf.norm(dy),
                            "dy_zero": tf.reduce_mean(tf.cast(tf.equal(dy, 0), tf.float32)),
                            "nan_grads": tf.reduce_sum(tf.cast(~tf.math.is_finite(dy), tf.float32)),
                            "needs_grad": tf.constant(1.0),
                            "blocked": tf.reduce_sum(mass * (1 - slot["mask"]())) / tf.reduce_sum(mass)}

                done = self._when_sampling(slot, name, stats)
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

                def stats():
                    out = {"dx_norm": tf.norm(dx)}
                    if dy is not None and dy.shape == dx.shape:
                        reference = dy * slot["mask"]()
                        den = tf.reduce_sum(tf.abs(reference))
                        den = tf.where(den > 0, den, tf.reduce_sum(tf.abs(dy)))
                        out["ste_error"] = tf.reduce_sum(tf.abs(dx - reference)) / den
                    return out

                done = self._when_sampling(slot, name, stats)
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

                done = self._when_sampling(slot, name, stats)
                with tf.control_dependencies([done]):
                    return tf.identity(dlow), tf.identity(dhigh)
            return (tf.identity(low), tf.identity(high)), grad

        return identity(lo, hi)

    def _oscillation(self, name, x, geometry):
        """Every step: this weight quantizer's codes against its last ones (variables made outside any graph)."""
        tf = self.tf
        if name not in self.state:
            with tf.init_scope():
                zeros = tf.zeros(x.shape, tf.float32)
                self.state[name] = {k: tf.Variable(zeros, trainable=False) for k in ("codes", "direction",
                                                                                     "frequency", "sample")}
                self.state[name]["started"] = tf.Variable(False, trainable=False)
        s = self.state[name]
        m = self.momentum
        codes = geometry["codes"](x)

        def first():
            ops = [s["codes"].assign(codes), s["sample"].assign(codes), s["started"].assign(True)]
            with tf.control_dependencies(ops):
                return tf.identity(tf.constant(True))

        def update():
            move = tf.sign(codes - s["codes"])
            flipped = tf.nn.relu(-move * s["direction"])  # 1 where the move reverses the last one
            ops = [s["frequency"].assign(s["frequency"] * (1 - m) + m * flipped),
                   s["direction"].assign(tf.sign(2 * move + s["direction"])), s["codes"].assign(codes)]
            with tf.control_dependencies(ops):
                return tf.identity(tf.constant(True))

        started = tf.cond(s["started"], update, first)

        def sample():
            emitted = self._emit(name, lambda: {
                "codes_changed": tf.reduce_mean(tf.cast(tf.not_equal(codes, s["sample"]), tf.float32)),
                "oscillating": tf.reduce_mean(tf.cast(s["frequency"] > self.threshold, tf.float32)),
                "oscillation_max": tf.reduce_max(s["frequency"])})()
            with tf.control_dependencies([emitted]):
                assigned = s["sample"].assign(codes)
            with tf.control_dependencies([assigned]):
                return tf.identity(emitted)

        with tf.control_dependencies([started]):
            return tf.cond(self.sampling, sample, lambda: tf.constant(0))


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
    noise = tf.reduce_sum(tf.square(x - y))
    return {"clip_low": tf.reduce_mean(tf.cast(x < g["min"], tf.float32)),
            "clip_high": tf.reduce_mean(tf.cast(x > g["max"], tf.float32)),
            "scale_min": ordered[0], "scale_median": ordered[tf.size(ordered) // 2], "scale_max": ordered[-1],
            "zero_point_min": tf.reduce_min(zp), "zero_point_max": tf.reduce_max(zp),
            "range_min": tf.reduce_min(lo), "range_max": tf.reduce_max(hi),
            "nan_inputs": tf.reduce_sum(tf.cast(~tf.math.is_finite(x), tf.float32)),
            "sqnr_db": 10.0 * tf.math.log(tf.reduce_sum(tf.square(x)) / tf.maximum(noise, 1e-30)) / tf.math.log(10.0),
            "fake_quant_enabled": tf.constant(1.0)}


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
        def on_train_begin(self, logs=None):
            self.watch = _Watch(path, every, momentum, threshold, overwrite, durable, tensorboard)
            self.watch.install()
            self.model.make_train_function(force=True)  # traced again, with the monitor's ops

        def on_train_batch_end(self, batch, logs=None):
            self.watch.end_step()

        def on_test_begin(self, logs=None):
            self._was = bool(self.watch.sampling.numpy())
            self.watch.sampling.assign(False)  # validation batches are no samples

        def on_test_end(self, logs=None):
            self.watch.sampling.assign(self._was)
            self.watch.pending = {}

        def on_train_end(self, logs=None):
            self.watch.close()

    return _Callback()
