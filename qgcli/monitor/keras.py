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

How, in the graph: each site (the op's input and output, the upstream gradient, the input gradient, a learnable
range's gradient, a batch norm's input) hands its tensors to one host callback (``tf.numpy_function``, stateful:
it runs in the traced step unasked, in program order with the other callbacks, off the step's data path),
which computes the site's statistics (:mod:`qgcli.monitor.keras_stats`: one pass of a compiled kernel, or
NumPy) and writes them into the running step's pending sample in Python; ``mon.step()`` (or the callback)
writes that to the history at a sample step.  A CPU tensor is read in place, a GPU one copied to the host.  The
forward callback leaves the STE mask to the gradient callbacks, which take its scalar token as an input so that
they run after it.  The upstream gradient and the input gradient are seen by identity ``tf.custom_gradient``
taps on the op's output and input (values unchanged: passive).  Weight quantizers (inputs read from a variable)
keep their last integer codes, last move direction and oscillation frequency on the host, updated at every step
by their callback.  ``Monitor`` traces the train step twice: a sampling one with every callback and a plain one
with one callback that updates all the weights' oscillation (``model.train_step`` wrapped while it is traced; a
weight quantizer in another graph, a ``tf.cond`` branch, keeps a callback of its own), and hands ``model.fit``
the one the next step needs; validation and prediction run unmonitored.  A custom loop's ``tf.function`` is
traced once with every callback, each of which looks at the step counter and returns at once between samples (a
weight's still updates its codes).
A learnable range (min and max passed as trainable variables) records its gradient's norm as ``scale_grad_norm``. A
quantizer sampled before that does not run at a later sample step (a ``tf.cond`` that skips it) is recorded there
with ``fake_quant_enabled`` 0 only. Batch norms (``tf.compat.v1.nn.fused_batch_norm`` with ``is_training``:
tf_keras ``BatchNormalization`` on 4-D and 5-D inputs, kept as ``quant_batch_normalization`` by tfmot's
``quantize_model``) record ``bn_mean_shift`` and ``bn_var_ratio`` (the batch statistics of its input against the
running ones before the step's update) and NaN/Inf inputs; not their gradient (a tap on the op's output would undo
its fusion with the ReLU after it, whose gradient rounds differently: the monitor would not be passive). Not
monitored: Keras 3.
"""
import contextlib
import inspect

import numpy as np

from qgcli.errors import UsageProblem
from qgcli.monitor import keras_stats as _stats
from qgcli.monitor.history import HistoryWriter, as_stored
from qgcli.monitor.tensorboard import LiveEvents

def _tf():
    """TensorFlow, imported without its CUDA start-up noise when qgcli is the first to import it."""
    from qgcli.monitor.quiet_tensorflow import import_tensorflow

    return import_tensorflow("qgcli.monitor.keras")


class _Watch:
    """What one monitor shares between its wrapped ops, the step counter and the history.

    ``mode``, read when a function is traced: ``loop`` (a custom loop: every site's host callback, which looks
    at the step counter and returns at once between samples, but for a weight's oscillation update), ``full``
    (every site's callback), ``light`` (the weights' oscillation update only), ``off`` (the original ops:
    ``Monitor`` between its train steps, so validation and prediction are not monitored)."""

    def __init__(self, path, every, momentum, threshold, overwrite, durable, tensorboard=None, mode="loop"):
        tf = self.tf = _tf()
        if int(every) < 1:
            raise UsageProblem(f"every must be at least 1, not {every}")
        self.every, self.momentum, self.threshold = int(every), float(momentum), float(threshold)
        self.mode = mode
        self.step_count = 0
        self.closed = False
        self.layers = {}  # layer -> (kind, role, info)
        self.pending = {}  # layer -> {statistic: value}: the running step's sample, written by the callbacks
        self.work = {}  # layer -> what its forward callback leaves to its gradient callbacks in the running step
        self.state = {}  # layer -> keras_stats.Oscillation (a weight quantizer's codes and frequencies)
        self.masks = {}  # layer -> its STE mask buffer (int8), reused from sample to sample
        self.counts = {}  # (graph, scope) -> calls seen in that graph
        self.gathered = None  # a step being traced between samples: its graph's weight quantizers, one callback
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

    def sampling(self):
        """Whether the running step (the one the callbacks see) is a sample."""
        return not self.closed and self.is_sample(self.step_count + 1)

    def end_step(self):
        step = self.step_count = self.step_count + 1
        pending, self.pending, self.work = self.pending, {}, {}
        if self.is_sample(step):
            self._write(step, pending)
        if self.tf.executing_eagerly():
            self.counts = {k: v for k, v in self.counts.items() if k[0] != "eager"}

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
        self.closed = True  # a function traced with the monitor and called after it: its callbacks do nothing
        self.state, self.masks, self.work, self.pending = {}, {}, {}, {}  # the graphs keep the callbacks, not these
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

    def _callback(self, method, *args):
        """A host callback in the graph: ``method(*args[:k], *arrays)`` with the tensors at the end of ``args``
        as NumPy arrays, when the graph runs; stateful (it always runs, in program order with the other
        callbacks) and returns a scalar token that a later callback takes to be ordered after it.  In a sampling
        step of model.fit (``gathering``) the call joins the step's gathered ones instead and returns None."""
        tf = self.tf
        split = next(i for i, a in enumerate(args) if tf.is_tensor(a))
        head, tensors = args[:split], list(args[split:])
        gathered = self.gathered
        if gathered is not None and self.mode == "full" and gathered.holds(*tensors):
            return gathered.add(method, head, tensors)

        def call(*arrays):
            if not self.closed:
                method(*head, *arrays)
            return _TOKEN

        return tf.numpy_function(call, tensors, tf.int32, stateful=True, name="qgcli_monitor")

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
            role = "weight" if isinstance(a["inputs"], tf.Variable) or _reads_variable(x) else "activation"
            per_channel = attr.endswith("per_channel")
            # a learnable range (trainable variables, as tfmot passes them): its gradient's norm
            learnable = attr != "fake_quant_with_min_max_args" and all(
                isinstance(v, tf.Variable) and v.trainable for v in (a["min"], a["max"]))
            self.layers.setdefault(name, ("fake_quant", role, {
                "quant_min": int(narrow), "quant_max": 2 ** bits - 1, "per_channel": per_channel,
                "num_bits": bits, "narrow_range": narrow, "op": attr, "learnable": learnable}))
            if self.mode == "light":  # between samples: the oscillation counts only
                y = original(**a)
                if role == "weight":
                    self._light_weight(name, bits, narrow, x, lo, hi)
                return y
            slot = {}
            a["inputs"] = self._tap_dx(name, x, slot)
            if learnable:
                a["min"], a["max"] = self._tap_range(name, lo, hi)
            y = original(**a)
            slot["token"] = self._callback(self._forward, name, role, bits, narrow, x, y, lo, hi)
            return self._tap_dy(name, y, slot)

        return wrapper

    @contextlib.contextmanager
    def gathering(self):
        """While model.fit's step is traced, the host callbacks of the sites traced in the step's own graph are
        gathered (a callback's call costs TensorFlow's executor more than its body).  Between samples: the
        weight quantizers' oscillation updates, in one callback added when the trace ends.  In a sampling step:
        the forward statistics in one callback, added when the first gradient is traced, and the gradients' in
        one more when the trace ends, ordered after the first (they read its masks).  A callback runs when its
        last tensor is computed: the host callbacks are ordered among themselves only, not against the step's
        variable updates."""
        if self.gathered is not None or self.tf.executing_eagerly():
            yield
            return
        gathered = self.gathered = _Gathered(self.tf)
        try:
            yield
            if gathered.specs:
                self._callback(self._oscillations, tuple(gathered.specs), *gathered.tensors)
            elif gathered.forward_token is None and gathered.calls:  # a step without gradients
                self._flush_forward()
            elif gathered.calls:
                self._gathered_call(gathered.calls, gathered.tensors)
        finally:
            self.gathered = None

    def _flush_forward(self):
        """The token of the sampling step's gathered forward callback (made at the first call: the step's forward
        is traced by then), or None outside a gathered step.  The callbacks gathered after it are the gradients'."""
        gathered = self.gathered
        if gathered is None or gathered.forward_token is not None:
            return None if gathered is None else gathered.forward_token
        calls, tensors = gathered.calls, gathered.tensors
        gathered.calls, gathered.tensors = [], []
        gathered.forward_token = self._gathered_call(calls, tensors) if calls else self.tf.constant(0)
        gathered.tensors.append(gathered.forward_token)  # the gradients' callback runs after it
        return gathered.forward_token

    def _gathered_call(self, calls, tensors):
        gathered, self.gathered = self.gathered, None  # this one callback is not gathered itself
        try:
            return self._callback(self._calls, tuple(calls), *tensors)
        finally:
            self.gathered = gathered

    def _calls(self, calls, *arrays):
        """A gathered callback: each ``(method, head, first, count)`` called, in the order traced, with its
        arrays ``arrays[first:first + count]``."""
        for method, head, first, count in calls:
            method(*head, *arrays[first:first + count])

    def _light_weight(self, name, bits, narrow, x, lo, hi):
        """A weight quantizer between samples: its oscillation update gathered into the step's callback, or one
        of its own when traced in another graph (a ``tf.cond`` branch, a loop's body) or outside a gathered step."""
        gathered = self.gathered
        if gathered is not None and gathered.holds(x, lo, hi):
            gathered.specs.append((name, bits, narrow))
            gathered.tensors.extend((x, lo, hi))
        else:
            self._callback(self._oscillation, name, bits, narrow, x, lo, hi)

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
            # (oneDNN), whose gradient rounds otherwise; the callback runs in a tf.function unasked (stateful)
            self._callback(self._batch_norm, name, fmt, float(a["epsilon"]), x, *running)
            return out

        return wrapper

    def _tap_dy(self, name, y, slot):
        tf = self.tf

        @tf.custom_gradient
        def identity(t):
            def grad(dy):
                slot["dy"] = dy
                token = slot["token"] if slot["token"] is not None else self._flush_forward()
                slot["dy_token"] = self._callback(self._upstream, name, dy, token)
                return tf.identity(dy)
            return tf.identity(t), grad

        return identity(y)

    def _tap_dx(self, name, x, slot):
        tf = self.tf

        @tf.custom_gradient
        def identity(t):
            def grad(dx):
                self._flush_forward()
                dy = slot.get("dy")
                # dy and its callback's token (none when that callback was gathered: called before this one)
                after = () if dy is None else (dy,) if slot["dy_token"] is None else (dy, slot["dy_token"])
                self._callback(self._downstream, name, dx, *after)
                return tf.identity(dx)
            return tf.identity(t), grad

        return identity(x)

    def _tap_range(self, name, lo, hi):
        """``lo`` and ``hi`` unchanged; their gradient's norm (``scale_grad_norm``) at sample steps."""
        tf = self.tf

        @tf.custom_gradient
        def identity(low, high):
            def grad(dlow, dhigh):
                self._flush_forward()
                parts = [g for g in (dlow, dhigh) if g is not None]
                if parts:
                    self._callback(self._range_gradient, name, *parts)
                else:
                    self._note(name, scale_grad_norm=0.0)
                return tf.identity(dlow), tf.identity(dhigh)
            return (tf.identity(low), tf.identity(high)), grad

        return identity(lo, hi)

    # --- the host callbacks (NumPy arrays; qgcli.monitor.keras_stats) -------------------------------------

    def _note(self, name, **stats):
        self.pending.setdefault(name, {}).update(stats)

    def _oscillation(self, name, bits, narrow, x, lo, hi, grid=None):
        """Every step: a weight quantizer's codes against its last ones; returns the grid."""
        grid = _stats.grid(lo, hi, bits, narrow) if grid is None else grid
        self.state.setdefault(name, _stats.Oscillation()).update(x, grid, self.momentum)
        return grid

    def _oscillations(self, specs, *arrays):
        """Every step between samples: the gathered weight quantizers' codes, each with its ``x``, ``lo``, ``hi``."""
        for i, (name, bits, narrow) in enumerate(specs):
            self._oscillation(name, bits, narrow, *arrays[3 * i:3 * i + 3])

    def _forward(self, name, role, bits, narrow, x, y, lo, hi):
        sampling = self.sampling()
        if role != "weight" and not sampling:
            return
        grid = _stats.grid(lo, hi, bits, narrow)
        if role == "weight":
            self._oscillation(name, bits, narrow, x, lo, hi, grid)
        if not sampling:
            return
        mask = self.masks.get(name)
        if mask is None or mask.shape != x.shape:
            mask = self.masks[name] = np.empty(x.shape, np.int8)
        stats = _stats.forward(x, y, grid, mask)
        stats.update(_stats.qparams(grid, lo, hi), fake_quant_enabled=1.0)
        if role == "weight":
            stats.update(self.state[name].take(self.threshold))
        self.work[name] = {"mask": mask}
        self._note(name, **stats)

    def _upstream(self, name, dy, _token):
        if not self.sampling():
            return
        work = self.work.setdefault(name, {})
        stats, work["blocked"] = _stats.upstream(dy, work.get("mask"))
        self._note(name, **stats)

    def _downstream(self, name, dx, dy=None, _token=None):
        if not self.sampling():
            return
        work = self.work.get(name, {})
        self._note(name, **_stats.downstream(dx, dy, work.get("mask"), work.get("blocked")))

    def _range_gradient(self, name, *gradients):
        if self.sampling():
            self._note(name, scale_grad_norm=_stats.gradient_norm(*gradients))

    def _batch_norm(self, name, fmt, epsilon, x, mean, variance):
        if self.sampling():
            self._note(name, **_stats.batch_norm(x, mean, variance, fmt, epsilon))


class _Gathered:
    """What a step's graph (the default one when made) gathers into few host callbacks.  Between samples: its
    weight quantizers, ``(name, bits, narrow)`` each in ``specs``, and their ``x``, ``lo``, ``hi`` tensors in that
    order in ``tensors``.  In a sampling step: ``calls``, each ``(method, head, first, count)`` with its
    tensors at ``tensors[first:first + count]``, first the forward's, then (once ``forward_token`` is made)
    the gradients'."""

    def __init__(self, tf):
        self._default_graph = tf.compat.v1.get_default_graph
        self.graph = self._default_graph()
        self.specs = []
        self.tensors = []
        self.calls = []
        self.forward_token = None

    def add(self, method, head, tensors):
        """A sampling step's callback gathered; returns None: no token (the gathered callbacks are called in
        the order traced, the gradients' after the forward's)."""
        self.calls.append((method, head, len(self.tensors), len(tensors)))
        self.tensors.extend(tensors)

    def holds(self, *tensors):
        """Whether ``tensors`` and the op being traced are in the step's graph itself: not in a branch (a
        ``tf.cond``'s, whose callbacks run only when it is taken) nor in a loop's body."""
        graph = self.graph
        return self._default_graph() is graph and all(getattr(t, "graph", None) is graph for t in tensors)


_TOKEN = np.int32(0)
_OPS = ("fake_quant_with_min_max_vars", "fake_quant_with_min_max_vars_per_channel", "fake_quant_with_min_max_args")
_BN = "fused_batch_norm"


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
            if getattr(self.model, "_jit_compile", False):
                raise UsageProblem("the monitor's host callbacks cannot run inside an XLA-compiled train step: "
                                   "compile the model with jit_compile=False to monitor it")
            watch = self.watch = _Watch(path, every, momentum, threshold, overwrite, durable, tensorboard, mode="off")
            watch.install()
            model = self.model
            self._restore_train_step = _gather_in_train_step(watch, model)
            # two train steps, traced again with the monitor's ops at their first call: one that samples, one
            # with the oscillation update only; the mode is what the wrapped ops see while a step is traced
            self._steps = {}
            for mode in ("full", "light"):
                function = model.make_train_function(force=True)
                self._steps[mode] = _in_mode(watch, mode, function, on_error=self.on_train_end)
            model.train_function = self._steps["full"]  # step 1 is a sample

        def on_train_batch_end(self, batch, logs=None):
            watch = self.watch
            watch.end_step()
            self.model.train_function = self._steps["full" if watch.is_sample(watch.step_count + 1) else "light"]

        def on_train_end(self, logs=None):
            """Also when a step raises (fit then ends without calling this): the model and tf.quantization as
            they were, the history closed, so that a later fit, monitored or not, starts clean."""
            if getattr(self, "watch", None) is None or self.watch.closed:
                return
            self.model.train_function = None  # the next fit traces its own, unmonitored unless asked
            self._restore_train_step()
            self.watch.close()

    return _Callback()


def _gather_in_train_step(watch, model):
    """``model.train_step``, which the train function traces, made to gather the weights' oscillation updates of a
    step between samples into one callback (``_Watch.gathering``); returns what puts the original back."""
    original = model.train_step
    own = "train_step" in vars(model)  # set on the model itself, not its class's method

    def train_step(data):
        with watch.gathering() if watch.mode in ("light", "full") else contextlib.nullcontext():
            return original(data)

    model.train_step = train_step

    def restore():
        if own:
            model.train_step = original
        else:
            del model.train_step

    return restore


def _in_mode(watch, mode, function, on_error):
    """``function`` (a traced train step) called with the wrapped ops in ``mode``; ``on_error()`` before an
    exception of the step (its data, its ops, an interrupt) leaves it: model.fit calls no callback then."""
    def step(iterator):
        watch.mode = mode
        try:
            return function(iterator)
        except BaseException:
            on_error()
            raise
        finally:
            watch.mode = "off"

    return step
