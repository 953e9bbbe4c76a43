"""Capture one TensorFlow training step (forward + ``tf.GradientTape`` backward) into a run file.

    with qgcli.capture.tensorflow.capture("run.h5", step=300):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))

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
batch norm (running statistics: nothing to differentiate; listed in ``skipped``).

How: each wrapped call runs the original op, copies its operands and output, and passes the output through a
``tf.custom_gradient`` identity whose gradient function copies the upstream gradient ``dy``.  That needs
eager execution: the block turns on ``tf.config.run_functions_eagerly(True)`` (restored after), so a
``tf.function`` training step (or ``model.fit``'s) runs eagerly and is captured too; a call seen while
building a graph anyway (``tf.compat.v1`` sessions) is listed in ``skipped``, not recorded.  After the step
the reference results (``reference/``) are TF's own: the forward output as the step computed it, and the
gradients of TF's gradient kernels (``tf.raw_ops.FakeQuantWithMinMax*Gradient``, ``FusedBatchNormGradV3``
on the reserve spaces of ``FusedBatchNormV3`` rerun on the stored ``x``) on exactly the stored operands.
"""
import contextlib

from qgcli.capture.runfile_writer import RunFileWriter

_FAKE_QUANT = {
    "fake_quant_with_min_max_args": "FakeQuantWithMinMaxArgs",
    "fake_quant_with_min_max_vars": "FakeQuantWithMinMaxVars",
    "fake_quant_with_min_max_vars_per_channel": "FakeQuantWithMinMaxVarsPerChannel",
}
_active = []


def _tf():
    try:
        import tensorflow as tf
    except ImportError:
        from qgcli.errors import QgcliError

        raise QgcliError("qgcli.capture.tensorflow needs TensorFlow: pip install 'qgcli[tensorflow]'") from None
    return tf


class Capture:
    """What a capture recorded: ``groups`` (run-file group paths, below the step group), ``skipped``
    (name -> why it was not recorded) and the ``writer``."""

    def __init__(self, writer):
        self.writer = writer
        self.records = []  # [name, leaf, write(writer, name) -> reason or None]
        self.skipped = {}

    @property
    def groups(self):
        return list(self.writer.groups)


@contextlib.contextmanager
def capture(path, *, step=None, references=True, overwrite=False):
    """Record every fake-quant and training-mode fused batch-norm call of one step into run file ``path``
    (under ``step_<N>/`` when ``step`` is given; see :class:`RunFileWriter`).  Written when the block ends
    without an exception; yields a :class:`Capture`."""
    tf = _tf()
    if _active:
        raise RuntimeError("a TensorFlow capture is already running")
    writer = RunFileWriter(path, step=step, references=references, overwrite=overwrite)
    cap = Capture(writer)
    patched = []
    for module in _modules(tf, "quantization"):
        for attr, op in _FAKE_QUANT.items():
            original = getattr(module, attr, None)
            if original is not None:
                patched.append((module, attr, original))
                setattr(module, attr, _fake_quant_wrapper(tf, cap, op, original))
    for module in _modules(tf, "nn"):
        original = getattr(module, "fused_batch_norm", None)
        if original is not None:
            patched.append((module, "fused_batch_norm", original))
            setattr(module, "fused_batch_norm", _batch_norm_wrapper(tf, cap, original))
    eager_before = tf.config.functions_run_eagerly()
    tf.config.run_functions_eagerly(True)
    _active.append(cap)
    try:
        yield cap
    except BaseException:
        writer.discard()
        raise
    finally:
        _active.pop()
        tf.config.run_functions_eagerly(eager_before)
        for module, attr, original in reversed(patched):
            setattr(module, attr, original)
    names = [r[0] for r in cap.records]
    for name, leaf, write in cap.records:
        if any(other.startswith(name + "/") for other in names):  # a layer's group holds no other layer
            name = f"{name}/{leaf}"
        reason = write(writer, name)
        if reason:
            cap.skipped[name] = reason
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


def _tap(tf, tensor, slot):
    """``tensor`` through an identity whose gradient stores the upstream gradient in ``slot[0]``."""
    @tf.custom_gradient
    def identity(t):
        def grad(dy):
            slot[0] = dy.numpy().copy()
            return dy
        return tf.identity(t), grad

    return identity(tensor)


def _bind(original, args, kwargs):
    import inspect

    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _value(v):
    import numpy as np

    return np.asarray(v.numpy() if hasattr(v, "numpy") else v).copy()


def _fake_quant_wrapper(tf, cap, op, original):
    def wrapper(*args, **kwargs):
        if not tf.executing_eagerly():
            cap.skipped[_name(tf, kwargs.get("name"), "fake_quant")] = "called while building a graph: not captured"
            return original(*args, **kwargs)
        a = _bind(original, args, kwargs)
        x = tf.convert_to_tensor(a["inputs"])
        if x.dtype != tf.float32:
            cap.skipped[_name(tf, a.get("name"), "fake_quant")] = f"inputs are {x.dtype.name}"
            return original(*args, **kwargs)
        name = _name(tf, a.get("name"), "fake_quant")
        x_slot = [None]
        a = dict(a)
        a["inputs"] = _tap(tf, x, x_slot)
        out = original(**a)
        dy = [None]
        s = {"op": op, "x": x.numpy().copy(), "out": out.numpy().copy(), "dy": dy, "dx": x_slot,
             "num_bits": int(a["num_bits"]), "narrow_range": bool(a["narrow_range"])}
        if op == "FakeQuantWithMinMaxArgs":
            s["min"], s["max"] = float(a["min"]), float(a["max"])
        else:
            s["min"], s["max"] = _value(a["min"]).astype("float32"), _value(a["max"]).astype("float32")
        cap.records.append([name, "fake_quant", lambda writer, path: _write_fake_quant(tf, writer, path, s)])
        return _tap(tf, out, dy)

    wrapper.__wrapped__ = original
    return wrapper


def _write_fake_quant(tf, writer, path, s):
    import numpy as np

    op, dy = s["op"], s["dy"][0]
    attrs = {"num_bits": s["num_bits"], "narrow_range": s["narrow_range"], "framework": "tensorflow"}
    operands = {"inputs": s["x"], "gradients": dy}
    reference = {"outputs": s["out"]}
    common = dict(num_bits=s["num_bits"], narrow_range=s["narrow_range"])
    if op == "FakeQuantWithMinMaxArgs":
        attrs.update(min=s["min"], max=s["max"])
        if dy is not None:
            reference["backprops"] = tf.raw_ops.FakeQuantWithMinMaxArgsGradient(
                gradients=dy, inputs=s["x"], min=s["min"], max=s["max"], **common).numpy()
    else:
        lo, hi = s["min"], s["max"]
        if op == "FakeQuantWithMinMaxVars":
            lo, hi = lo.reshape(()), hi.reshape(())
        operands.update(min=lo, max=hi)
        if dy is not None:
            grad_op = getattr(tf.raw_ops, op + "Gradient")
            got = grad_op(gradients=dy, inputs=s["x"], min=lo, max=hi, **common)
            reference.update(backprops_wrt_input=got[0].numpy(), backprop_wrt_min=got[1].numpy(),
                             backprop_wrt_max=got[2].numpy())
    dx, ref_dx = s["dx"][0], reference.get("backprops_wrt_input", reference.get("backprops"))
    if dx is not None and ref_dx is not None and not np.array_equal(dx.view(np.uint32), ref_dx.view(np.uint32)):
        attrs["note"] = "the step's input gradient differs from TF's gradient kernel on the stored operands"
    writer.add(path, op, operands, attrs, reference)
    return None


def _batch_norm_wrapper(tf, cap, original):
    def wrapper(*args, **kwargs):
        a = _bind(original, args, kwargs)
        training = a["is_training"]
        name = _name(tf, a.get("name"), "batch_norm")
        if not tf.executing_eagerly():
            cap.skipped[name] = "called while building a graph: not captured"
            return original(*args, **kwargs)
        if not bool(_value(training)):
            cap.skipped[name] = "inference (running statistics): no batch statistics to differentiate"
            return original(*args, **kwargs)
        x = tf.convert_to_tensor(a["x"])
        if x.dtype != tf.float32 or x.shape.rank not in (4, 5):
            cap.skipped[name] = f"x is {x.dtype.name} of rank {x.shape.rank}: not captured"
            return original(*args, **kwargs)
        x_slot, dy = [None], [None]
        a = dict(a)
        a["x"] = _tap(tf, x, x_slot)
        y, mean, variance = original(**a)
        fmt = a["data_format"]
        fmt = fmt.decode() if isinstance(fmt, bytes) else str(fmt)
        s = {"x": x.numpy().copy(), "scale": _value(a["scale"]).astype("float32"),
             "offset": _value(a["offset"]).astype("float32"), "y": y.numpy().copy(),
             "epsilon": max(float(a["epsilon"]), 1.001e-5),  # what fused_batch_norm hands the op
             "data_format": fmt, "dy": dy, "dx": x_slot}
        cap.records.append([name, "batch_norm", lambda writer, path: _write_batch_norm(tf, writer, path, s)])
        return _tap(tf, y, dy), mean, variance

    wrapper.__wrapped__ = original
    return wrapper


def _write_batch_norm(tf, writer, path, s):
    import numpy as np

    dy = s["dy"][0]
    if dy is None:
        return "no gradient flowed back through it (bn-grad needs y_backprop)"
    empty = np.zeros((0,), np.float32)
    fwd = tf.raw_ops.FusedBatchNormV3(x=s["x"], scale=s["scale"], offset=s["offset"], mean=empty, variance=empty,
                                      epsilon=s["epsilon"], exponential_avg_factor=1.0,
                                      data_format=s["data_format"], is_training=True)
    rs1, rs2, rs3 = fwd.reserve_space_1.numpy(), fwd.reserve_space_2.numpy(), fwd.reserve_space_3.numpy()
    grad = tf.raw_ops.FusedBatchNormGradV3(y_backprop=dy, x=s["x"], scale=s["scale"], reserve_space_1=rs1,
                                           reserve_space_2=rs2, reserve_space_3=rs3, epsilon=s["epsilon"],
                                           data_format=s["data_format"], is_training=True)
    reference = {"x_backprop": grad.x_backprop.numpy(), "scale_backprop": grad.scale_backprop.numpy(),
                 "offset_backprop": grad.offset_backprop.numpy()}
    attrs = {"epsilon": float(np.float32(s["epsilon"])), "data_format": s["data_format"], "is_training": True,
             "variance_kind": "variance", "framework": "tensorflow"}
    notes = []
    if not np.array_equal(fwd.y.numpy(), s["y"]):
        notes.append("the step's output differs from FusedBatchNormV3 rerun on the stored x")
    dx = s["dx"][0]
    if dx is not None and not np.array_equal(dx, reference["x_backprop"]):
        notes.append("the step's x gradient differs from FusedBatchNormGradV3 on the stored operands")
    if notes:
        attrs["note"] = "; ".join(notes)
    operands = {"y_backprop": dy, "x": s["x"], "scale": s["scale"], "reserve_space_1": rs1, "reserve_space_2": rs2}
    if rs3.size:
        operands["reserve_space_3"] = rs3
    writer.add(path, "FusedBatchNormV3", operands, attrs, reference)
    return None
