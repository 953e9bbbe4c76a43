"""What capture costs on real models (issue 36): a ResNet-18 in eager torch.ao QAT (32x32, batch 8) and a tf_keras
MobileNetV2 under tfmot (alpha 0.35, 32x32, batch 8, a compiled ``tf.function`` train step).

    python benchmarks/bench_capture.py [torch|tf|all] [--steps 3] [--repeat 5] [--threads 1]

Each model runs in two fresh processes (so that peak RSS is each one's own): one times --repeat plain steps
after a warm-up; the other captures --steps consecutive steps into one run file (``every=1``: each step
appended to the file the earlier ones made), timing each.  Printed, against the issue's goals:

* captured step / plain step (median plain; captured: the median of the captured steps) -- goal <= 2x; for
  the TF step the goal is the plain step plus 1.2x the time h5py alone needs to write the same bytes
  (measured here: the captured file's datasets written again with h5py, from memory);
* file bytes / operand bytes (the datasets outside ``reference/``, which the file must hold) -- goal <= 1.3x;
* peak RSS of the capturing process - peak RSS of the plain one, against the largest group (its bytes in
  the file) -- goal <= 1.5x the largest group; for torch also in one process (plain steps after capture's
  imports, then the captured steps: ru_maxrss before and after), the comparison that the imports and the
  allocator's state do not skew;
* each appended step's time / the first captured step's, wall and CPU (process), with the median and the worst
  -- goal <= 1.2x; and the disk floor: one step's bytes written and fsynced, against the captured steps' wall
  time beyond their CPU time (a disk-bound step waits; capture itself does not fsync a step).

``--against DIR`` (a checkout of other code, e.g. a worktree of main) compares the two codes in one run on a
busy machine: three processes (plain steps; captured steps with this checkout's qgcli; with DIR's) built
once, then stepped in turn, one step each per round for ``--steps`` rounds (the order rotated), so that the
load of the moment slows them alike; printed: the median wall and CPU time (process, all threads; the step's
thread) of each, each appended step against its first (wall and CPU), and for TF the goal from h5py writing
one captured step's datasets of each file:

    python benchmarks/bench_capture.py tf --against ../main-worktree --steps 15
"""
import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _torch_model():
    import warnings

    warnings.filterwarnings("ignore")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import torch
    from capture_models import eager_qat_resnet18

    model = eager_qat_resnet18(width=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def capture(path, **kw):
        from qgcli.capture.torch import capture as cap

        return cap(model, path, **kw)

    return step, capture


def _tf_model():
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import numpy as np
    import tensorflow as tf
    from capture_models import mobilenet_v2

    model = mobilenet_v2()
    opt, loss_fn = model.optimizer, model.loss
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((8, 32, 32, 3)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, 8))
    compiled = []

    def make():
        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return loss
        compiled[:] = [train_step]

    make()

    def step():
        compiled[0](x, y).numpy()

    def capture(path, **kw):
        import contextlib

        from qgcli.capture.tensorflow import capture as cap

        @contextlib.contextmanager
        def traced_inside():
            with cap(path, **kw) as c:
                make()  # traced (first call) inside the block: with the taps
                yield c
        return traced_inside()

    return step, capture


def _child(framework, mode, steps, repeat, path, threads):
    if framework == "torch":
        import torch

        torch.set_num_threads(threads)
    step, capture = (_torch_model if framework == "torch" else _tf_model)()
    result = {"framework": framework, "mode": mode}
    if mode == "plain":
        step()
        step()  # warm-up (TF: the trace)
        times, cpu = [], []
        for _ in range(repeat):
            t, c = time.perf_counter(), time.process_time()
            step()
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        result.update(times=times, cpu=cpu, peak_rss_mb=_rss_mb())
    else:
        if framework == "torch":
            import qgcli.capture.torch  # noqa: F401 (imported before the plain steps: their peak counts it)

            step()  # warm-up (TF: traced once only, with the taps, below: a plain trace would stay in memory)
            step()  # the plain step's peak in this process, with capture's imports: the fair baseline
            result["plain_peak_rss_mb"] = _rss_mb()
        times, cpu, main_cpu = [], [], []
        with capture(path, every=1) as cap:
            if framework == "tf":  # the trace with the taps, outside any captured step
                step()
            for i in range(steps):
                t, c, m = time.perf_counter(), time.process_time(), time.thread_time()
                with cap.step(i):
                    step()
                times.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
                main_cpu.append(time.thread_time() - m)
        result.update(times=times, cpu=cpu, main_cpu=main_cpu, peak_rss_mb=_rss_mb(), groups=len(cap.groups))
    print(json.dumps(result))


def _loop(framework, mode, path, threads):
    """A child of ``--against``: the model built (and, captured, the capture open: every step appended), then one
    step per line read (``step N``), its wall and CPU seconds printed; ``end`` closes the capture."""
    import qgcli

    if framework == "torch":
        import torch

        torch.set_num_threads(threads)
    step, capture = (_torch_model if framework == "torch" else _tf_model)()
    with contextlib.ExitStack() as stack:
        if mode == "plain":
            step()
            step()
        else:
            cap = stack.enter_context(capture(path, every=1))
            step()  # the warm-up (TF: the trace with the taps), not captured
        print(json.dumps({"ready": qgcli.__file__}), flush=True)
        for line in sys.stdin:
            if line.strip() == "end":
                break
            i = int(line.split()[1])
            t, c, m = time.perf_counter(), time.process_time(), time.thread_time()
            if mode == "plain":
                step()
            else:
                with cap.step(i):
                    step()
            print(json.dumps({"wall": time.perf_counter() - t, "cpu": time.process_time() - c,
                              "thread": time.thread_time() - m}), flush=True)


def _against(framework, args, directory):
    """Plain steps, captured steps with this checkout and captured steps with ``args.against``, in turn."""
    runs = {"plain": ROOT, "capture": ROOT, "capture, --against": os.path.abspath(args.against)}
    children = {}
    for name, code in runs.items():
        path = os.path.join(directory, f"{framework}-{len(children)}.h5")
        cmd = [sys.executable, os.path.abspath(__file__), "--loop", framework,
               "plain" if name == "plain" else "capture", "--path", path, "--threads", str(args.threads)]
        env = dict(os.environ, PYTHONPATH=code + os.pathsep + os.environ.get("PYTHONPATH", ""))
        children[name] = (subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                           cwd=code), path)
    for name, (child, _) in children.items():  # built side by side; each says which qgcli it imported
        line = child.stdout.readline()
        if not line:
            sys.exit(f"{framework} {name} failed to start")
        print(f"{name:20s} qgcli from {json.loads(line)['ready']}")
    times = {name: [] for name in children}
    names = list(children)
    first = None  # TF: the first captured step's datasets, which h5py alone writes in each round (the yardstick)
    for i in range(args.steps):
        for name in names[i % 3:] + names[:i % 3]:
            child = children[name][0]
            child.stdin.write(f"step {i}\n")
            child.stdin.flush()
            times[name].append(json.loads(child.stdout.readline()))
        if framework == "tf":
            if first is None:  # step 0, committed and flushed: read while the capture holds the file open
                first = _first_step(children["capture"][1])
            t, c = time.perf_counter(), time.process_time()
            _h5py_write_seconds(first, directory, repeat=1)
            times.setdefault("h5py alone", []).append({"wall": time.perf_counter() - t,
                                                       "cpu": time.process_time() - c})
    for child, _ in children.values():
        child.stdin.write("end\n")
        child.stdin.close()
        child.wait()
    medians = {name: {k: statistics.median(t.get(k, t["cpu"]) for t in steps) for k in ("wall", "cpu", "thread")}
               for name, steps in times.items()}
    plain = medians["plain"]
    print(f"== {framework}: {args.steps} rounds, one step of each per round, load {os.getloadavg()[0]:.1f} "
          "(median wall s / CPU s, process / CPU s, the step's thread)")
    for name, m in medians.items():
        print(f"{name:20s} {m['wall']:.3f} / {m['cpu']:.3f} / {m['thread']:.3f}  = {m['wall'] / plain['wall']:.2f}x / "
              f"{m['cpu'] / plain['cpu']:.2f}x / {m['thread'] / plain['cpu']:.2f}x plain")
    for name in ("capture", "capture, --against"):
        _appended([t["wall"] for t in times[name]], [t["cpu"] for t in times[name]], name)
    if framework == "tf":
        write = medians["h5py alone"]
        goal = {k: plain[k] + 1.2 * write[k] for k in ("wall", "cpu")}
        print(f"goal: plain + 1.2x h5py alone ({sum(a.nbytes for a in first) / 1e6:.1f} MB, {len(first)} datasets) "
              f"= {goal['wall']:.3f} s wall / {goal['cpu']:.3f} s CPU")
        for name in ("capture", "capture, --against"):
            print(f"{name:20s} {medians[name]['wall'] / goal['wall']:.2f}x / "
                  f"{medians[name]['cpu'] / goal['cpu']:.2f}x the goal (wall / CPU)")


def _first_step(path):
    """The datasets of the file's first step, as arrays (the file may be open for writing by a capture)."""
    import h5py

    arrays = []
    with h5py.File(path, "r", locking=False) as f:
        step = f[sorted(f)[0]]
        step.visititems(lambda name, obj: arrays.append(obj[()])
                        if isinstance(obj, h5py.Dataset) and "op" in obj.parent.attrs or
                        isinstance(obj, h5py.Dataset) and obj.parent.name.endswith("/reference") else None)
    return arrays


def _file_figures(path):
    """(operand bytes: the datasets outside reference/, the largest group's bytes in the file, the first
    step's datasets as arrays)."""
    import h5py

    operand, largest, first = 0, 0, []
    with h5py.File(path) as f:
        for n, step in enumerate(f):
            groups = []
            f[step].visititems(lambda name, obj: groups.append(obj) if "op" in obj.attrs else None)
            for g in groups:
                size = 0
                for name in _datasets(g):
                    d = g[name]
                    size += d.id.get_storage_size()
                    if not name.startswith("reference/"):
                        operand += d.nbytes
                    if n == 0:
                        first.append(d[()])
                largest = max(largest, size)
    return operand, largest, first


def _datasets(group):
    import h5py

    names = []
    group.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    return names


def _h5py_write_seconds(datasets, directory, repeat=3):
    import h5py

    best = float("inf")
    for _ in range(repeat):
        path = os.path.join(directory, "rewrite.h5")
        t = time.perf_counter()
        with h5py.File(path, "w") as f:
            for i, a in enumerate(datasets):
                f.create_dataset(f"d{i}", data=a)
            f.flush()
        best = min(best, time.perf_counter() - t)
        os.unlink(path)
    return best


def _run(framework, args, directory):
    path = os.path.join(directory, f"{framework}.h5")
    out = {}
    for mode in ("plain", "capture"):
        cmd = [sys.executable, __file__, "--child", framework, mode, "--steps", str(args.steps), "--repeat",
               str(args.repeat), "--path", path, "--threads", str(args.threads)]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if done.returncode:
            sys.exit(f"{framework} {mode} failed:\n{done.stderr[-3000:]}")
        out[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    plain = statistics.median(out["plain"]["times"])
    captured = out["capture"]["times"]
    file_bytes = os.path.getsize(path)
    operand, largest, first = _file_figures(path)
    per_step_bytes = file_bytes / args.steps
    rss = out["capture"]["peak_rss_mb"] - out["plain"]["peak_rss_mb"]
    print(f"== {framework}: {out['capture']['groups']} groups per step, {args.steps} steps captured, load "
          f"{os.getloadavg()[0]:.1f}")
    print(f"plain step          {plain:.3f} s (median of {args.repeat}: "
          f"{', '.join(f'{t:.3f}' for t in out['plain']['times'])})")
    print(f"captured steps      {', '.join(f'{t:.3f}' for t in captured)} s; median "
          f"{statistics.median(captured):.3f} = {statistics.median(captured) / plain:.2f}x plain (goal <= 2x)")
    cpu = statistics.median(out["plain"]["cpu"])
    print(f"CPU time            plain {cpu:.3f} s; captured (process, all threads) "
          f"{statistics.median(out['capture']['cpu']):.3f} s = {statistics.median(out['capture']['cpu']) / cpu:.2f}x, "
          f"its step's thread {statistics.median(out['capture']['main_cpu']):.3f} s = "
          f"{statistics.median(out['capture']['main_cpu']) / cpu:.2f}x (medians; the wall figures above are those of a "
          "machine that may be shared)")
    if framework == "tf":
        write = _h5py_write_seconds(first, directory)
        goal = plain + 1.2 * write
        print(f"h5py alone writes one step's {sum(a.nbytes for a in first) / 1e6:.1f} MB in {write:.3f} s: goal plain + 1.2x = "
              f"{goal:.3f} s; captured median {statistics.median(captured):.3f} s = "
              f"{statistics.median(captured) / goal:.2f}x the goal")
    print(f"file                {file_bytes / 1e6:.1f} MB for {operand / 1e6:.1f} MB of operands = "
          f"{file_bytes / operand:.3f}x (goal <= 1.3x)")
    print(f"peak RSS            plain {out['plain']['peak_rss_mb']:.0f} MB, capturing "
          f"{out['capture']['peak_rss_mb']:.0f} MB: +{rss:.0f} MB = {rss / (largest / 2**20):.2f}x the largest group "
          f"({largest / 2**20:.1f} MB) (goal <= 1.5x; two processes)")
    here = out["capture"].get("plain_peak_rss_mb")
    if here is not None:  # the same process: the same imports, the same allocator state before the capture
        rss = out["capture"]["peak_rss_mb"] - here
        print(f"peak RSS, 1 process plain steps {here:.0f} MB, then capturing {out['capture']['peak_rss_mb']:.0f} MB: "
              f"+{rss:.0f} MB = {rss / (largest / 2**20):.2f}x the largest group (goal <= 1.5x)")
    _appended(captured, out["capture"]["cpu"])
    _disk_floor(per_step_bytes, captured, out["capture"]["cpu"], directory)


def _appended(wall, cpu, name="appended steps"):
    """Each appended step's wall and CPU time against the first captured step's (goal <= 1.2x), and the worst."""
    ratios = {"wall": [t / wall[0] for t in wall[1:]], "CPU": [c / cpu[0] for c in cpu[1:]]}
    for kind, r in ratios.items():
        if r:
            print(f"{name + ' (' + kind + ')':27s} {', '.join(f'{x:.2f}' for x in r)} x the first; median "
                  f"{statistics.median(r):.2f}x, worst {max(r):.2f}x (goal <= 1.2x)")


def _disk_floor(step_bytes, wall, cpu, directory):
    """What the disk alone needs for one step's bytes (written and fsynced: the floor below which a disk-bound step
    cannot go; capture does not fsync a step, so it binds only when the kernel's dirty pages are full), against the
    captured steps' wall time beyond their CPU time (time spent waiting, for the disk or for a core)."""
    path = os.path.join(directory, "disk-floor.bin")
    block = os.urandom(1 << 20) * 4
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        left = int(step_bytes)
        while left > 0:
            left -= os.write(fd, block[:min(left, len(block))])
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(path)
    floor = time.perf_counter() - t
    waited = statistics.median(w - c for w, c in zip(wall, cpu))
    print(f"disk floor          one step's {step_bytes / 1e6:.1f} MB written and fsynced in {floor:.3f} s "
          f"({step_bytes / floor / 1e6:.0f} MB/s) = {floor / statistics.median(wall):.2f}x a captured step; the steps' "
          f"wall beyond their CPU time (waiting for the disk or a core): median {waited:.3f} s; "
          f"{'the disk may bind' if floor > 0.2 * statistics.median(wall) else 'not disk-bound'}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", nargs="?", default="all", choices=("torch", "tf", "all"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the machine may be shared)")
    parser.add_argument("--against", metavar="DIR", help="a checkout of other code: step it in turn with this one")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--loop", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], args.child[1], args.steps, args.repeat, args.path, args.threads)
        return
    if args.loop:
        _loop(args.loop[0], args.loop[1], args.path, args.threads)
        return
    with tempfile.TemporaryDirectory() as directory:
        for framework in (("torch", "tf") if args.which == "all" else (args.which,)):
            (_against if args.against else _run)(framework, args, directory)


if __name__ == "__main__":
    main()
