"""What qgcli.monitor costs a training run: time with and without the monitor, and history bytes.

Three models on the CPU: an eager QAT ResNet-18 (torch.ao prepare_qat, 32x32 inputs, batch 32; defined here,
torchvision is not needed), a small Llama-style block with torchao QAT (int8 per-token activations, int4
per-group weights), and a tf_keras + TF Model Optimization QAT CNN (32x32, batch 32) trained by ``model.fit``
with the ``qgcli.monitor.keras.Monitor`` callback.  Each is trained ``--steps`` steps without the monitor,
with ``every=10`` and with ``every=1``; the three runs are interleaved in ``--rounds`` rounds (the median per
configuration is reported) so that a busy machine slows them alike.  Both wall time and the process's CPU
time (all threads: ``time.process_time``) are reported: on a shared machine the CPU time is the steadier.
The first ``--warmup`` steps (tracing, allocator warm-up, the Keras monitor's retrace) are not timed.  Goals
(issue 37): every=10 at most 1.05x, every=1 at most 1.5x; the history grows by a few KB per sample per 100
layers, not with batch size.

    python benchmarks/bench_monitor.py --steps 200 --rounds 3
    python benchmarks/bench_monitor.py --models llama --steps 100 --interleave   # one process, CPU time
    python benchmarks/bench_monitor.py --models keras --steps 40 --interleave
    python benchmarks/bench_monitor.py --models keras-loop --steps 60 --interleave   # monitor() in a custom loop
"""
import argparse
import contextlib
import os
import statistics
import tempfile
import time
import warnings

import torch
import torch.nn as nn


# --- ResNet-18 (CIFAR-style stem), eager QAT ---------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu2 = nn.ReLU()
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        return self.relu2(y + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    def __init__(self, classes=10):
        import torch.ao.quantization as tq

        super().__init__()
        self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = self.layers(self.stem(self.quant(x)))
        return self.dequant(self.fc(torch.flatten(self.pool(x), 1)))


def resnet18_qat():
    import torch.ao.quantization as tq

    torch.manual_seed(0)
    model = ResNet18()
    model.qconfig = tq.get_default_qat_qconfig("x86")
    tq.prepare_qat(model.train(), inplace=True)
    return model, lambda g: (torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g))


# --- a Llama-style block, torchao QAT ---------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class LlamaBlock(nn.Module):
    def __init__(self, d=256, heads=4, hidden=704, vocab=512):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.heads = heads

    def forward(self, tokens):
        x = self.embed(tokens)
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(a)
        h = self.norm2(x)
        x = x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))
        return self.head(x)


def llama_qat():
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization import qat
    from torchao.quantization.granularity import PerGroup

    torch.manual_seed(0)
    model = LlamaBlock()
    config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))
    quantize_(model, qat.QATConfig(config, step="prepare"),
              filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != "head")
    vocab = model.head.out_features

    def batch(g):
        tokens = torch.randint(0, vocab, (8, 65), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    return model, batch


# --- timing -----------------------------------------------------------------------------------------------

def _history_size(path):
    """The history's bytes, samples and layers, and its growth per sample (the pages of its ``samples`` table,
    measured in a fresh Python: the SQLite that TensorFlow loads has no dbstat)."""
    import subprocess
    import sys

    from qgcli.monitor.history import read_history

    h = read_history(path)
    code = "import sys; from qgcli.monitor.history import sample_bytes; print(sample_bytes(sys.argv[1]))"
    per_sample = float(subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                                      check=True).stdout)
    return {"bytes": os.path.getsize(path), "samples": len(h.steps), "layers": len(h.layers),
            "per_sample": per_sample}


def _print_size(every, s):
    print(f"  every={every:<3} history {s['bytes'] / 1024:.0f} KiB, {s['samples']} samples x {s['layers']} layers: "
          f"{s['per_sample'] / 1024:.2f} KiB per sample, {s['per_sample'] / 1024 * 100 / s['layers']:.2f} KiB per "
          f"sample per 100 layers")


def train(make, steps, every, folder, warmup):
    """(wall s, CPU s) of ``steps`` steps after ``warmup`` untimed ones, and the history's size."""
    from qgcli.monitor.torch import monitor

    model, batch = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = [batch(g) for _ in range(min(steps, 8))]
    path = os.path.join(folder, f"h{every}_{time.monotonic_ns()}")
    clock = {}

    def loop():
        for i in range(warmup + steps):
            if i == warmup:
                clock["start"] = time.perf_counter(), time.process_time()
            x, y = data[i % len(data)]
            opt.zero_grad()
            out = model(x)
            nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
            opt.step()
        clock["end"] = time.perf_counter(), time.process_time()

    if every is None:
        loop()
        size = None
    else:
        with monitor(model, path, every=every, optimizer=opt):
            loop()
        size = _history_size(path)
    (w0, c0), (w1, c1) = clock["start"], clock["end"]
    return (w1 - w0, c1 - c0), size


def interleaved(make, steps, folder, warmup):
    """CPU s of ``steps`` steps without the monitor, with every=10 and with every=1 (and the histories' sizes),
    the three models stepped in turn in one process (a busy machine slows them alike; the statistics' kernels or,
    with QGCLI_NATIVE=0, the torch ops)."""
    from qgcli.monitor.torch import monitor

    g = torch.Generator().manual_seed(1)
    runs = {}
    for every in (None, 10, 1):
        model, batch = make()
        runs[every] = model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = [batch(g) for _ in range(min(steps, 8))]
    total = dict.fromkeys(runs, 0.0)
    paths = {every: os.path.join(folder, f"i{every}_{time.monotonic_ns()}") for every in (10, 1)}
    with contextlib.ExitStack() as stack:
        for every in (10, 1):
            stack.enter_context(monitor(runs[every][0], paths[every], every=every,
                                        optimizer=runs[every][1]))
        for i in range(warmup + steps):
            x, y = data[i % len(data)]
            for every, (model, opt) in runs.items():
                start = time.process_time()
                opt.zero_grad()
                out = model(x)
                nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
                opt.step()
                total[every] += (time.process_time() - start) if i >= warmup else 0.0
    return total, {every: _history_size(path) for every, path in paths.items()}


# --- tf_keras + tfmot, model.fit ----------------------------------------------------------------------------

def keras_model():
    """The tf_keras + tfmot QAT CNN, compiled, and its 8 batches of 32 (NumPy)."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf
    import tensorflow_model_optimization as tfmot

    tf.keras.backend.clear_session()
    tf.keras.utils.set_random_seed(0)
    layers = tf.keras.layers
    stack = [layers.Conv2D(32, 3, padding="same", input_shape=(32, 32, 3)), layers.BatchNormalization(),
             layers.ReLU()]
    for width in (64, 128, 128):
        stack += [layers.Conv2D(width, 3, strides=2, padding="same"), layers.BatchNormalization(), layers.ReLU()]
    stack += [layers.GlobalAveragePooling2D(), layers.Dense(10)]
    model = tfmot.quantization.keras.quantize_model(tf.keras.Sequential(stack))
    model.compile(tf.keras.optimizers.SGD(0.01, momentum=0.9),
                  tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.RandomState(1)
    return model, rng.randn(32 * 8, 32, 32, 3).astype("float32"), rng.randint(0, 10, 32 * 8)


def keras_fit(steps, every, folder, warmup):
    import tensorflow as tf

    from qgcli.monitor.keras import Monitor

    model, x, y = keras_model()
    total = warmup + steps
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat().take(total)
    clock = {}

    class Clock(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == warmup - 1:
                clock["start"] = time.perf_counter(), time.process_time()
            if batch == total - 1:
                clock["end"] = time.perf_counter(), time.process_time()

    path = os.path.join(folder, f"k{every}_{time.monotonic_ns()}")
    callbacks = [Clock()] if every is None else [Monitor(path, every=every), Clock()]
    model.fit(data, epochs=1, steps_per_epoch=total, verbose=0, callbacks=callbacks)
    (w0, c0), (w1, c1) = clock["start"], clock["end"]
    return (w1 - w0, c1 - c0), None if every is None else _history_size(path)


def keras_interleaved(steps, folder, warmup):
    """CPU s of ``steps`` calls of the unmonitored train step, of the callback's step between samples
    (``light``: the oscillation update only) and of its sampling step with the sample read back and written
    (``sample``), called in turn in one process; every=10 is 9 light steps and one sampling step in 10."""
    import tensorflow as tf

    from qgcli.monitor.keras import Monitor

    model, x, y = keras_model()
    batches = iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat())
    plain = model.make_train_function(force=True)
    path = os.path.join(folder, f"k_{time.monotonic_ns()}")
    callback = Monitor(path, every=1)
    callback.set_model(model)
    callback.on_train_begin()
    light, full = callback._steps["light"], callback._steps["full"]

    def sample():
        full(batches)
        callback.watch.end_step()

    calls = {"plain": lambda: plain(batches), "light": lambda: light(batches), "sample": sample}
    total = dict.fromkeys(calls, 0.0)
    for i in range(warmup + steps):
        for name, call in calls.items():
            start = time.process_time()
            call()
            total[name] += (time.process_time() - start) if i >= warmup else 0.0
    callback.on_train_end()
    return total, _history_size(path)


def keras_loop_interleaved(steps, folder, warmup):
    """CPU s of ``steps`` calls of an unmonitored custom ``tf.function`` train step and of the same step traced
    inside ``monitor(every=10)`` (every site's callback in the one trace) followed by ``mon.step()``, in turn."""
    import tensorflow as tf

    from qgcli.monitor.keras import monitor

    model, x, y = keras_model()
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = tf.keras.optimizers.SGD(0.01, momentum=0.9)

    def make_step():
        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                value = loss(yb, model(xb, training=True))
            grads = tape.gradient(value, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        return step

    xb, yb = tf.constant(x[:32]), tf.constant(y[:32])
    plain = make_step()
    plain(xb, yb)  # traced before the monitor is on: unmonitored
    path = os.path.join(folder, f"kl_{time.monotonic_ns()}")
    total = {"plain": 0.0, "loop": 0.0}
    with monitor(path, every=10) as mon:
        watched = make_step()

        def monitored():
            watched(xb, yb)
            mon.step()

        for i in range(warmup + steps):
            for name, call in (("plain", lambda: plain(xb, yb)), ("loop", monitored)):
                start = time.process_time()
                call()
                total[name] += (time.process_time() - start) if i >= warmup else 0.0
    return total, _history_size(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--models", default="resnet18,llama,keras")
    parser.add_argument("--interleave", action="store_true",
                        help="step the three configurations in turn in one process (Keras: the unmonitored "
                             "step, the monitor's step between samples and its sampling step; keras-loop: a "
                             "custom tf.function step without and with monitor(every=10))")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    makers = {"resnet18": resnet18_qat, "llama": llama_qat}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} steps after {args.warmup}, "
          f"{args.rounds} rounds, {os.cpu_count()} CPUs")
    if args.interleave:
        with tempfile.TemporaryDirectory() as folder:
            for name in args.models.split(","):
                if name == "keras-loop":
                    t, size = keras_loop_interleaved(args.steps, folder, args.warmup)
                    print(f"keras custom loop, interleaved, CPU s: without the monitor {t['plain']:.2f}, "
                          f"every=10 {t['loop']:.2f} {t['loop'] / t['plain']:.3f}x")
                    _print_size(10, size)
                    continue
                if name == "keras":
                    t, size = keras_interleaved(args.steps, folder, args.warmup)
                    base, every10 = t["plain"], (9 * t["light"] + t["sample"]) / 10
                    print(f"keras, interleaved, CPU s: without the monitor {base:.2f}, between samples "
                          f"{t['light']:.2f} {t['light'] / base:.3f}x, sampling {t['sample']:.2f} "
                          f"{t['sample'] / base:.3f}x; so every=10 {every10 / base:.3f}x, every=1 "
                          f"{t['sample'] / base:.3f}x")
                    _print_size(1, size)
                    continue
                total, sizes = interleaved(makers[name], args.steps, folder, args.warmup)
                print(f"{name}, interleaved, CPU s: without the monitor {total[None]:.2f}, " + ", ".join(
                    f"every={every} {total[every]:.2f} {total[every] / total[None]:.3f}x" for every in (10, 1)))
                for every in (10, 1):
                    _print_size(every, sizes[every])
        return
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            times = {None: [], 10: [], 1: []}
            sizes = {}
            for _ in range(args.rounds):
                for every in times:
                    if name == "keras":
                        took, size = keras_fit(args.steps, every, folder, args.warmup)
                    else:
                        took, size = train(makers[name], args.steps, every, folder, args.warmup)
                    times[every].append(took)
                    if size:
                        sizes[every] = size
            wall0 = statistics.median(t[0] for t in times[None])
            cpu0 = statistics.median(t[1] for t in times[None])
            print(f"{name}: without the monitor {wall0:.2f} s wall ({1000 * wall0 / args.steps:.1f} ms/step), "
                  f"{cpu0:.2f} s CPU")
            for every in (10, 1):
                wall = statistics.median(t[0] for t in times[every])
                cpu = statistics.median(t[1] for t in times[every])
                print(f"  every={every:<3} wall {wall:.2f} s {wall / wall0:.3f}x, CPU {cpu:.2f} s {cpu / cpu0:.3f}x")
                _print_size(every, sizes[every])


if __name__ == "__main__":
    main()
