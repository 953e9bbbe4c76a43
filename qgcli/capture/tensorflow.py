"""Capture TensorFlow training steps (forward + ``tf.GradientTape`` backward) into a run file, eagerly or inside
a ``tf.function`` (tf_keras ``model.fit`` included), without forcing eager execution.

    with qgcli.capture.tensorflow.capture("run.h5", step=300):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))

    with qgcli.capture.tensorflow.capture("run.h5", every=100) as cap:      # model.fit: one group per step
        model.fit(x, y, epochs=3, callbacks=[cap.keras_callback()])

Recorded, one group per call, named by the name scope of the call (tf_keras layers open one per layer:
``sequential/quant_conv/LastValueQuant``; a second call in the same scope ``..._1``; a group that would
hold another gets the leaf ``fake_quant`` / ``batch_norm``):

- every call of ``tf.quantization.fake_quant_with_min_max_args`` / ``_vars`` / ``_vars_per_channel`` (what
  TF Model Optimization's QAT wrappers call; they look the function up on ``tf.quantization`` at call time,
  so replacing the module attribute for the block sees every call; ``tf.compat.v1`` spellings too), as
  ``FakeQuantWithMinMaxArgs`` / ``...Vars`` / ``...VarsPerChannel``: ``inputs``, ``min`` and ``max``
  (datasets, or attributes for ``...Args``), ``gradients`` (the upstream gradient), attributes
  ``num_bits``, ``narrow_range``; the reference's input gradient is ``backprops_wrt_input`` (``backprops``
  for ``...Args``, TF's and qgcli's name);
- every ``tf.compat.v1.nn.fused_batch_norm`` call with ``is_training=True``: the path of tf_keras
  ``BatchNormalization`` (``fused`` left at its default on 4-D/5-D inputs, or ``fused=True``), and of code
  calling it directly, as ``FusedBatchNormV3``: ``x``, ``y_backprop``, ``scale`` (gamma; ones without
  ``scale``), ``reserve_space_1`` / ``reserve_space_2`` (the batch mean and biased variance that TF's CPU
  kernel saves, ``variance_kind = "variance"``), attributes ``epsilon`` (as the op gets it: at least
  1.001e-5), ``data_format``, ``is_training``.

Not captured: the unfused batch-norm arithmetic (tf_keras ``fused=False``, 2-D/3-D inputs such as a batch
norm after ``Dense``, ``virtual_batch_size``/``renorm``, and Keras 3's ``BatchNormalization``, which is
``tf.nn.moments`` + ``tf.nn.batch_normalization`` with no fused op to name); ``tf.raw_ops`` calls; inference
batch norm (running statistics: nothing to differentiate; listed in ``skipped``); XLA-compiled steps
(``jit_compile=True``: XLA cannot run the Python callbacks).

How: each wrapped call runs the original op and adds taps to the computation, the same in eager mode and in a
graph being traced: a ``tf.numpy_function`` that receives the operands and the output, and, through a
``tf.custom_gradient`` identity on the output, one that receives the upstream gradient ``dy`` together with
TF's own gradient kernel run on the same tensors (``tf.raw_ops.FakeQuantWithMinMax*Gradient``,
``FusedBatchNormGradV3`` on the reserve spaces of the step's own ``FusedBatchNormV3`` when traced, of the op
rerun on ``x`` eagerly): those are the reference results (``reference/``); eagerly, a third tap on the op's
input checks the step's own input gradient against the reference.  Each callback hands its arrays to the file
at once (TF runs them on its own threads); in a ``tf.function`` the step does not wait for them, only the
function's end does (:func:`_after`).  The taps sit under a ``tf.cond`` on one boolean variable, on only
while a captured step runs, so a compiled step costs about nothing outside captured steps.  A ``tf.function``
is traced with the taps only when its first trace happens inside a capture block (``cap.keras_callback()``
rebuilds ``model.fit``'s train function for that); a graph traced before runs without them.
"""
import contextlib
import inspect

import numpy as np

from qgcli.capture.runfile_writer import RunFileWriter, ancestors
from qgcli.capture.steps import StepCapture
from qgcli.monitor.quiet_tensorflow import import_tensorflow

_FAKE_QUANT = {
    "fake_quant_with_min_max_args": "FakeQuantWithMinMaxArgs",
    "fake_quant_with_min_max_vars": "FakeQuantWithMinMaxVars",
    "fake_quant_with_min_max_vars_per_channel": "FakeQuantWithMinMaxVarsPerChannel",
}
#: Results verify compares bit for bit: stored as digests.
_DIGESTED = ("outputs", "backprops_wrt_input", "backprops")
_NO_GRADIENT = "no gradient flowed back through it (bn-grad needs y_backprop)"
_active = []  # the capture running now (taps traced under an earlier one record into it)
_flag = []  # the one tf.Variable(bool) the taps' tf.cond reads: on while a captured step runs


def _tf():
    """TensorFlow, imported without its CUDA start-up noise when qgcli is the first to import it."""
    return import_tensorflow("qgcli.capture.tensorflow")


class Capture(StepCapture):
    """What a capture recorded: ``groups`` (run-file group paths of the last step, below the step group),
    ``skipped`` (name -> why it was not recorded) and the ``writer``.  :meth:`step` marks the steps of a
    training loop (:meth:`keras_callback` those of ``model.fit``); without it the whole block is one step."""

    def __init__(self, tf, writer, **kwargs):
        super().__init__(writer, **kwargs)
        self.tf = tf
        self.open = {}  # tap site -> the group of its last forward call in this step
        self.raw = {}  # group path as opened -> (name by scope, leaf): named when the step ends

    def begin(self, step):
        chosen = super().begin(step)
        self.open = {}
        self._switch()
        return chosen

    def finish(self):
        super().finish()
        self._switch()

    def abort(self):
        super().abort()
        self._switch()

    def _switch(self):
        _flag[0].assign(bool(self.active))

    def end_step(self):
        """Name the step's groups, in the order they were opened, as the scopes of all of them allow: a group
        whose name another lies below gets its leaf (a layer's group holds no other layer)."""
        super().end_step()
        w = self.writer
        with w.lock:
            opened = [(path, w.groups.pop(path)) for path in list(w.groups)]
            names = [self.raw[path] for path, _ in opened]
            inner = {p for other, _ in names for p in ancestors(other)}  # the names with another below them
            for (_, staged), (name, leaf) in zip(opened, names):
                if name in inner:
                    name = f"{name}/{leaf}"
                w.groups[w.unique(name)] = staged
        self.open, self.raw = {}, {}

    def keras_callback(self):
        """A tf_keras callback for ``model.fit``: each training batch is a step (numbered by the optimizer's
        ``iterations``), captured as ``steps=`` / ``every=`` choose; it rebuilds the model's train function
        when training begins, so that the graph is traced with the taps."""
        import tensorflow as tf

        cap = self

        class QgcliCapture(tf.keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                self.model.make_train_function(force=True)

            def on_train_batch_begin(self, batch, logs=None):
                iterations = getattr(getattr(self.model, "optimizer", None), "iterations", None)
                cap.begin(int(iterations.numpy()) if iterations is not None else batch)

            def on_train_batch_end(self, batch, logs=None):
                cap.finish()

        return QgcliCapture()


@contextlib.contextmanager
def capture(path, *, step=None, references=True, overwrite=False, layers=None, keep="all", compression=None,
            steps=None, every=None):
    """Record every fake-quant and training-mode fused batch-norm call of one step into run file ``path``
    (under ``step_<N>/`` when ``step`` is given), each group written as the step runs; yields a
    :class:`Capture`.  Written when the block (or :meth:`Capture.step`) ends without an exception.

    ``layers`` (glob patterns on group paths), ``keep`` (``"all"``, ``"forward"``, ``"weights"``: the fake
    quants of variables) and ``compression``: see :class:`RunFileWriter`.  ``steps`` / ``every``: the steps of
    ``with cap.step(i):`` (or of ``cap.keras_callback()``) that are captured."""
    tf = _tf()
    if _active:
        raise RuntimeError("a TensorFlow capture is already running")
    writer = RunFileWriter(path, step=step, references=references, overwrite=overwrite, layers=layers, keep=keep,
                           compression=compression)
    cap = Capture(tf, writer, steps=steps, every=every)
    if not _flag:
        with tf.init_scope():
            _flag.append(tf.Variable(False, trainable=False, name="qgcli_capture_on"))
    patched = []
    for module in _modules(tf, "quantization"):
        for attr, op in _FAKE_QUANT.items():
            original = getattr(module, attr, None)
            if original is not None:
                patched.append((module, attr, original))
                setattr(module, attr, _fake_quant_wrapper(tf, op, original))
    for module in _modules(tf, "nn"):
        original = getattr(module, "fused_batch_norm", None)
        if original is not None:
            patched.append((module, "fused_batch_norm", original))
            setattr(module, "fused_batch_norm", _batch_norm_wrapper(tf, original))
    _active.append(cap)
    cap._switch()
    try:
        yield cap
        if not cap.explicit:
            cap.active = False
            cap.end_step()
    except BaseException:
        writer.discard()
        raise
    finally:
        cap.active = False
        cap._switch()
        _active.pop()
        for module, attr, original in reversed(patched):
            setattr(module, attr, original)
    writer.close()


def _modules(tf, sub):
    """The distinct API modules that export the ops: ``tf.<sub>``, ``tf.compat.v1.<sub>`` (and
    ``tf.compat.v1`` itself, which has the fake-quant functions at its top level)."""
    found = []
    for parent in (tf, getattr(tf.compat, "v1", None), getattr(tf.compat, "v2", None)):
        module = getattr(parent, sub, None) if parent is not None else None
        if module is not None and all(module is not m for m in found):
            found.append(module)
    if sub == "quantization" and getattr(tf.compat, "v1", None) is not None:
        found.append(tf.compat.v1)
    return found


def _name(tf, given, leaf):
    scope = tf.get_current_name_scope().strip("/")
    parts = [p for p in (scope, given) if p]
    return "/".join(parts) or leaf


def _bind(original, args, kwargs):
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _recording():
    """The capture whose step is being recorded now, or None."""
    cap = _active[-1] if _active else None
    return cap if cap is not None and cap.active else None


class _Site:
    """One wrapped call as traced (eager: each call is its own site): its name and what its callbacks write.

    ``check_dx``: whether a third tap, on the op's input, compares the step's own input gradient with the
    reference kernel's (a group ``note`` when they differ).  Eagerly only: in a traced step the reference is
    the gradient TF registers for the op (the same kernel on the same tensors: for a batch norm, the reserve
    spaces of the step's own op, :func:`_reserve_spaces`), and each tap costs the trace a ``tf.cond`` (two
    branch functions, kept by TensorFlow: about 0.3 MB and 25 ms each; a MobileNetV2 has 170 sites)."""

    def __init__(self, name, leaf, op, attrs, weight, check_dx):
        self.name, self.leaf, self.op, self.attrs, self.weight = name, leaf, op, attrs, weight
        self.check_dx = check_dx


def _when_recording(tf, callback, tensors):
    """Run ``callback(*arrays)`` on the tensors that ``tensors()`` makes, from inside the computation, while a
    captured step runs (the tensors are computed then only); returns a tensor to hang control dependencies on."""
    def record():
        return tf.numpy_function(tf.autograph.experimental.do_not_convert(callback), list(tensors()), tf.int32,
                                 stateful=True, name="qgcli_capture")

    return tf.cond(_flag[0], record, lambda: tf.constant(0, tf.int32))


def _after(tf, done, tensor):
    """``tensor``, made to wait for the tap ``done`` only where nothing else would run it: a graph without
    automatic control dependencies (TF1's).  Eagerly the tap has run already; in a ``tf.function``, automatic
    control dependencies run every stateful op (each tap's ``tf.cond`` holds one), those without a resource input
    one after the other in the order they were made (a group's backward taps after its forward one), and the
    function returns once they are done (before the step's commit).  So the step does not wait for each
    callback: the callbacks copy their arrays into the writer's ring and write them beside the rest of the step,
    where a core is free."""
    if tf.executing_eagerly() or getattr(tf.compat.v1.get_default_graph(), "_add_control_dependencies", False):
        return tensor
    with tf.control_dependencies([done]):
        return tf.identity(tensor)


def _tap(tf, tensor, on_gradient):
    """``tensor`` through an identity whose gradient hands ``dy`` to ``on_gradient(dy)`` (a tap: see
    :func:`_after`)."""
    @tf.custom_gradient
    def identity(t):
        def grad(dy):
            return _after(tf, on_gradient(dy), tf.identity(dy))
        return tf.identity(t), grad

    return identity(tensor)


def _group(site):
    """The group of ``site``'s current call in the capture recording now (opened by its forward callback)."""
    cap = _recording()
    return cap, (cap.open.get(site) if cap is not None else None)


def _forward(site, write):
    """A forward callback: open the site's group in the capture recording now and let ``write(group)`` fill it."""
    def callback(*arrays):
        cap = _recording()
        if cap is None or not cap.writer.wants(site.name, weight=site.weight):
            return np.int32(0)
        # opened under a stand-in path: the step's groups are named when it ends (Capture.end_step)
        group = cap.writer.open_group(f"op{len(cap.raw)}", site.op, site.attrs)
        cap.raw[group.path] = (site.name, site.leaf)
        cap.open[site] = group
        write(cap, group, *arrays)
        return np.int32(0)

    return callback


def _backward(site, write):
    def callback(*arrays):
        cap, group = _group(site)
        if group is not None and cap.writer.backward:
            write(cap, group, *arrays)
        return np.int32(0)

    return callback


def _is_variable(tf, value):
    if isinstance(value, tf.Variable):
        return True
    op = getattr(value, "op", None)
    return op is not None and getattr(op, "type", None) == "ReadVariableOp"


def _fake_quant_wrapper(tf, op, original):
    def wrapper(*args, **kwargs):
        a = _bind(original, args, kwargs)
        name = _name(tf, a.get("name"), "fake_quant")
        cap = _active[-1] if _active else None
        x = tf.convert_to_tensor(a["inputs"])
        if x.dtype != tf.float32:
            if cap is not None:
                cap.skipped[name] = f"inputs are {x.dtype.name}"
            return original(*args, **kwargs)
        common = {"num_bits": int(a["num_bits"]), "narrow_range": bool(a["narrow_range"])}
        attrs = {**common, "framework": "tensorflow"}
        a = dict(a)
        if op == "FakeQuantWithMinMaxArgs":
            attrs.update(min=float(a["min"]), max=float(a["max"]))
            bounds = []
        else:
            a["min"], a["max"] = (tf.cast(tf.convert_to_tensor(a[k]), tf.float32) for k in ("min", "max"))
            bounds = [a["min"], a["max"]]
        site = _Site(name, "fake_quant", op, attrs, _is_variable(tf, args[0] if args else kwargs.get("inputs")),
                     tf.executing_eagerly())
        grad_name = "backprops" if op == "FakeQuantWithMinMaxArgs" else "backprops_wrt_input"

        def write_forward(cap, group, x, out, *bounds):
            operands = {"inputs": x}
            if bounds:
                lo, hi = bounds
                if op == "FakeQuantWithMinMaxVars":
                    lo, hi = lo.reshape(()), hi.reshape(())
                operands.update(min=lo, max=hi)
            group.put(operands)
            group.put_reference({"outputs": out}, digest=_DIGESTED)

        def write_backward(cap, group, dy, *grads):
            group.put({"gradients": dy})
            names = [grad_name] + (["backprop_wrt_min", "backprop_wrt_max"] if len(grads) == 3 else [])
            group.put_reference(dict(zip(names, grads)), digest=_DIGESTED)
            if site.check_dx:
                group.dx = grads[0]  # TF's array (it holds the tensor): compared, not hashed, and dropped

        def write_dx(cap, group, dx):  # the step's own input gradient against TF's kernel on the stored operands
            if not _same(group, dx):
                group.set_attrs(note="the step's input gradient differs from TF's gradient kernel on the stored "
                                     "operands")

        def reference_gradients(dy):
            if op == "FakeQuantWithMinMaxArgs":
                got = [tf.raw_ops.FakeQuantWithMinMaxArgsGradient(gradients=dy, inputs=x, min=attrs["min"],
                                                                  max=attrs["max"], **common)]
            else:
                got = list(getattr(tf.raw_ops, op + "Gradient")(gradients=dy, inputs=x, min=a["min"], max=a["max"],
                                                                **common))
            return [dy] + got

        def record_dy(dy):
            return _when_recording(tf, _backward(site, write_backward), lambda: reference_gradients(dy))

        if site.check_dx:
            a["inputs"] = _tap(tf, x, lambda dx: _when_recording(tf, _backward(site, write_dx), lambda: [dx]))
        out = original(**a)
        out = _after(tf, _when_recording(tf, _forward(site, write_forward), lambda: [x, out] + bounds), out)
        return _tap(tf, out, record_dy)

    wrapper.__wrapped__ = original
    return _plain_python(tf, wrapper)


def _plain_python(tf, wrapper):
    """``wrapper`` as AutoGraph leaves it: tfmot's layers call it from code that ``tf.function`` converts, and a
    converted wrapper would convert its callbacks too (each of the ~500 calls of a MobileNetV2 step then ran
    through ``converted_call``, its logging and its ``isinstance`` checks: most of their profiled time).  It holds no
    control flow on tensors (its ``tf.cond`` is explicit)."""
    plain = tf.autograph.experimental.do_not_convert(wrapper)
    plain.__wrapped__ = wrapper.__wrapped__
    return plain


def _same(group, dx):
    """Whether the step's own ``dx`` equals the kernel's, kept by the backward callback (True when it was not)."""
    kernel = getattr(group, "dx", None)
    group.dx = None
    return kernel is None or (kernel.shape == dx.shape and kernel.dtype == dx.dtype and np.array_equal(
        *(np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in (kernel, dx))))  # bit for bit


def _batch_norm_wrapper(tf, original):
    def wrapper(*args, **kwargs):
        a = _bind(original, args, kwargs)
        name = _name(tf, a.get("name"), "batch_norm")
        cap = _active[-1] if _active else None
        training = a["is_training"]
        if tf.is_tensor(training) and not hasattr(training, "numpy"):
            reason = "is_training is a graph tensor: not captured"
        elif not bool(training.numpy() if hasattr(training, "numpy") else training):
            reason = "inference (running statistics): no batch statistics to differentiate"
        else:
            reason = None
        x = tf.convert_to_tensor(a["x"])
        if reason is None and (x.dtype != tf.float32 or x.shape.rank not in (4, 5)):
            reason = f"x is {x.dtype.name} of rank {x.shape.rank}: not captured"
        if reason is not None:
            if cap is not None:
                cap.skipped[name] = reason
            return original(*args, **kwargs)
        a = dict(a)
        fmt = a["data_format"]
        fmt = fmt.decode() if isinstance(fmt, bytes) else str(fmt)
        epsilon = max(float(a["epsilon"]), 1.001e-5)  # what fused_batch_norm hands the op
        scale = tf.cast(tf.convert_to_tensor(a["scale"]), tf.float32)
        offset = tf.cast(tf.convert_to_tensor(a["offset"]), tf.float32)
        attrs = {"epsilon": float(np.float32(epsilon)), "data_format": fmt, "is_training": True,
                 "variance_kind": "variance", "framework": "tensorflow"}
        site = _Site(name, "batch_norm", "FusedBatchNormV3", attrs, False, tf.executing_eagerly())
        empty = tf.zeros((0,), tf.float32)

        def rerun():  # TF's forward on the same x: its reserve spaces, which the gradient kernel takes
            return tf.raw_ops.FusedBatchNormV3(x=x, scale=scale, offset=offset, mean=empty, variance=empty,
                                               epsilon=epsilon, exponential_avg_factor=1.0, data_format=fmt,
                                               is_training=True)

        def write_forward(cap, group, x, scale, rs1, rs2, rs3, *rerun):
            operands = {"x": x, "scale": scale, "reserve_space_1": rs1, "reserve_space_2": rs2}
            if rs3.size:
                operands["reserve_space_3"] = rs3
            group.put(operands)
            if rerun and not np.array_equal(*rerun):  # (the step's y, the rerun's)
                group.note = "the step's output differs from FusedBatchNormV3 rerun on the stored x"
                group.set_attrs(note=group.note)
            if cap.writer.backward:
                group.done = False
                cap.pending.append((site.name, group.path, lambda: None if group.done else _NO_GRADIENT))

        def write_backward(cap, group, dy, dx, dscale, doffset):
            group.put({"y_backprop": dy})
            group.put_reference({"x_backprop": dx, "scale_backprop": dscale, "offset_backprop": doffset})
            if site.check_dx:
                group.dx = dx
            group.done = True

        def write_dx(cap, group, dx):
            if not _same(group, dx):
                note = "the step's x gradient differs from FusedBatchNormGradV3 on the stored operands"
                previous = getattr(group, "note", None)
                group.set_attrs(note=f"{previous}; {note}" if previous else note)

        if site.check_dx:
            a["x"] = _tap(tf, x, lambda dx: _when_recording(tf, _backward(site, write_dx), lambda: [dx]))
        y, mean, variance = original(**a)
        own = _reserve_spaces(tf, y, epsilon, fmt)

        def reserve_spaces():  # the step's own (traced), or those of a rerun (eager: the op is gone)
            return own if own is not None else rerun()[3:]

        def record_dy(dy):
            rs1, rs2, rs3 = reserve_spaces()
            grad = tf.raw_ops.FusedBatchNormGradV3(
                y_backprop=dy, x=x, scale=scale, reserve_space_1=rs1, reserve_space_2=rs2, reserve_space_3=rs3,
                epsilon=epsilon, data_format=fmt, is_training=True)
            return [dy, grad.x_backprop, grad.scale_backprop, grad.offset_backprop]

        def forward_tensors():  # a rerun's output is checked against the step's
            if own is not None:
                return [x, scale, *own]
            fwd = rerun()
            return [x, scale, fwd.reserve_space_1, fwd.reserve_space_2, fwd.reserve_space_3, y, fwd.y]

        y = _after(tf, _when_recording(tf, _forward(site, write_forward), forward_tensors), y)
        y = _tap(tf, y, lambda dy: _when_recording(tf, _backward(site, write_backward), lambda: record_dy(dy)))
        return y, mean, variance

    wrapper.__wrapped__ = original
    return _plain_python(tf, wrapper)


def _reserve_spaces(tf, y, epsilon, fmt):
    """In a graph being traced, the reserve spaces of the ``FusedBatchNormV3`` op that made ``y`` (the batch mean
    and variance its gradient reads, whatever its running averages), so that the taps need not rerun the op on
    ``x`` twice (forward and backward) for them; None eagerly (the op is not kept) or for another op."""
    if tf.executing_eagerly():
        return None
    op = getattr(y, "op", None)
    if op is None or op.type != "FusedBatchNormV3" or len(op.outputs) != 6:
        return None
    try:
        same = (op.get_attr("is_training") and op.get_attr("data_format").decode() == fmt
                and np.float32(op.get_attr("epsilon")) == np.float32(epsilon))
    except (ValueError, AttributeError):
        return None
    return list(op.outputs[3:]) if same else None
