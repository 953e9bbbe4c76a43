#!/usr/bin/env python3
"""Generate ``tests/golden/torch.h5``: golden cases for PyTorch's fake-quantize ops and gradients.

The expected values come from a REAL PyTorch (CPU wheel).  PyTorch is not a dependency of qgcli; only this
generator imports it.  Regenerate with:

    python3 -m venv /tmp/torchvenv
    /tmp/torchvenv/bin/pip install "torch==2.13.0+cpu" h5py numpy
    /tmp/torchvenv/bin/python tests/golden/make_golden_torch.py

(PyPI's plain ``torch==2.13.0`` wheel gives the same CPU kernels but pulls in the CUDA libraries.)

Layout: one HDF5 group per case.  Group attributes: ``op`` (the PyTorch op), ``quant_min``,
``quant_max``, ``axis`` (per-channel ops), ``grad_factor`` (learnable ops), ``cpu_capability`` (``AVX2``,
``AVX512`` or ``DEFAULT``: which of PyTorch's CPU kernels ran -- DEFAULT has no fused multiply-add),
``description``, and ``error`` (PyTorch's message) for cases PyTorch refuses.  Datasets: the operands
(``inputs``, ``gradients``, ``scale``, ``zero_point``; ``min``/``max`` for observer cases) and the results
(``outputs``, ``backprops_wrt_input``, ``backprop_wrt_scale``, ``backprop_wrt_zero_point``; observer:
``scale``/``zero_point`` as outputs).  File attributes: torch version, generator, seed.

The DEFAULT-kernel cases are made by re-running this script in a child process with
``ATEN_CPU_CAPABILITY=default`` (``--child``), since PyTorch picks its kernels once at start-up.
"""
import json
import os
import subprocess
import sys

import numpy as np
import torch

f32 = np.float32
SEED = 20250613
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "torch.h5")
GENERATOR = "tests/golden/make_golden_torch.py"

PT = "fake_quantize_per_tensor_affine"
PC = "fake_quantize_per_channel_affine"
LPT = "_fake_quantize_learnable_per_tensor_affine"
LPC = "_fake_quantize_learnable_per_channel_affine"
OBS = "MinMaxObserver"

RANGES = [(0, 255), (-128, 127), (0, 15), (-8, 7), (1, 255), (-127, 127), (0, 1), (-1, 1), (0, 65535),
          (-32768, 32767), (2, 9)]
SCALES = [0.1, 1 / 3, 2.0**-4, 0.0235, 1e-3, 7.7, 1.0, 0.047058823529411764, 3e-6, 123.456]


def specials():
    tiny = np.finfo(f32).tiny
    return np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e30, -1e30, 3e38, -3e38, tiny / 4, -tiny / 4, tiny,
                     1e-40, 9.2e18, -9.3e18, 1.7e38], f32)


def probe_inputs(rng, n, scale, zp, qmin, qmax, with_specials=True):
    """Random values over 1.5x the range, exact half steps, grid points and edges (with ulp neighbours)."""
    s = np.float64(scale)
    lo, hi = (qmin - zp) * s, (qmax - zp) * s
    width = max(hi - lo, s)
    parts = [rng.uniform(lo - 0.25 * width, hi + 0.25 * width, n)]
    k = rng.integers(qmin - 2, qmax + 3, n // 2) - zp
    parts.append((k + 0.5) * s)                                   # ties in x / scale
    parts.append(k * s)                                           # grid points
    parts.append(np.array([(qmin - zp - 0.5) * s, (qmax - zp + 0.5) * s, lo, hi, (qmin - zp - 1) * s,
                           (qmax - zp + 1) * s]))
    x = np.concatenate(parts).astype(f32)
    near = rng.choice(x.size, min(x.size, n // 2), replace=False)
    ulps = np.concatenate([np.nextafter(x[near], f32(np.inf)), np.nextafter(x[near], f32(-np.inf))])
    x = np.concatenate([x, ulps])
    if with_specials:
        x = np.concatenate([x, specials()])
    rng.shuffle(x)
    return x


def probe_gradients(rng, shape, specials_=True):
    g = rng.standard_normal(shape).astype(f32)
    if specials_ and g.size > 8:
        flat = g.reshape(-1)
        idx = rng.choice(flat.size, 6, replace=False)
        flat[idx] = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-41], f32)
    return g


def fma_probes(rng, scale, zp, n=60):
    """Inputs whose ``zp + x * (1/scale)`` lies within a few ulps of a half-integer: FMA-sensitive."""
    s = f32(scale)
    k = rng.integers(-200, 200, n)
    base = ((k + 0.5 - np.float64(zp)) * np.float64(s)).astype(f32)
    xs = [base]
    up, down = base, base
    for _ in range(2):
        up = np.nextafter(up, f32(np.inf))
        down = np.nextafter(down, f32(-np.inf))
        xs += [up, down]
    return np.concatenate(xs).astype(f32)


class Cases:
    def __init__(self):
        self.items = []

    def add(self, name, op, attrs, data):
        self.items.append((name, op, attrs, data))


def run_forward_backward(op, x, g, scale, zp, qmin, qmax, axis=None):
    xt = torch.from_numpy(x.copy()).requires_grad_(True)
    if op == PT:
        y = torch.fake_quantize_per_tensor_affine(xt, scale, zp, qmin, qmax)
    elif op == PT + "[tensor_qparams]":
        y = torch.fake_quantize_per_tensor_affine(xt, torch.tensor(scale), torch.from_numpy(np.asarray(zp)), qmin, qmax)
    else:
        y = torch.fake_quantize_per_channel_affine(xt, torch.from_numpy(scale), torch.from_numpy(zp), axis, qmin, qmax)
    y.backward(torch.from_numpy(g))
    return y.detach().numpy(), xt.grad.numpy()


def run_learnable(op, x, g, scale, zp, qmin, qmax, grad_factor, axis=None):
    xt = torch.from_numpy(x.copy()).requires_grad_(True)
    st = torch.from_numpy(np.asarray(scale, f32).copy()).requires_grad_(True)
    zt = torch.from_numpy(np.asarray(zp, f32).copy()).requires_grad_(True)
    if op == LPT:
        y = torch._fake_quantize_learnable_per_tensor_affine(xt, st, zt, qmin, qmax, grad_factor)
    else:
        y = torch._fake_quantize_learnable_per_channel_affine(xt, st, zt, axis, qmin, qmax, grad_factor)
    y.backward(torch.from_numpy(g))
    return y.detach().numpy(), xt.grad.numpy(), st.grad.numpy(), zt.grad.numpy()


def per_tensor_cases(cases, rng, fma_only=False):
    i = 0
    for qmin, qmax in RANGES:
        for scale in (SCALES if not fma_only else SCALES[:3]):
            zp = int(rng.integers(qmin, qmax + 1)) if rng.random() < 0.7 else int((qmin + qmax) // 2)
            if fma_only:
                continue
            x = probe_inputs(rng, 48, scale, zp, qmin, qmax, with_specials=(i % 3 == 0))
            if i % 4 == 1:
                x = x[: x.size // 6 * 6].reshape(-1, 6)
            g = probe_gradients(rng, x.shape)
            out, dx = run_forward_backward(PT, x, g, scale, zp, qmin, qmax)
            cases.add(f"pt_{i:03d}", PT, dict(quant_min=qmin, quant_max=qmax, api="scalar",
                                             description=f"scale {scale:.6g}, zero point {zp}"),
                      dict(inputs=x, gradients=g, scale=np.asarray(scale, np.float64), zero_point=np.asarray(zp, np.int32),
                           outputs=out, backprops_wrt_input=dx))
            i += 1
    # float zero points through the tensor-qparams overload: PyTorch truncates them to int
    for zp in (3.7, -3.7, 2.5, 0.49, 200.99):
        qmin, qmax = (-10, 255)
        scale = 0.25
        x = probe_inputs(rng, 40, scale, int(zp), qmin, qmax)
        g = probe_gradients(rng, x.shape)
        out, dx = run_forward_backward(PT + "[tensor_qparams]", x, g, scale, np.float32(zp), qmin, qmax)
        cases.add(f"pt_floatzp_{i:03d}", PT, dict(quant_min=qmin, quant_max=qmax, api="tensor_qparams",
                                                 description=f"float zero point {zp} (truncated by PyTorch)"),
                  dict(inputs=x, gradients=g, scale=np.asarray(scale, f32), zero_point=np.asarray(zp, f32),
                       outputs=out, backprops_wrt_input=dx))
        i += 1


PC_SHAPES = [((5, 7), 0), ((5, 7), 1), ((3, 4, 6), 2), ((2, 3, 4, 5), 1), ((2, 3, 4, 5), 3), ((9,), 0),
             ((4, 1, 3), 1)]


def per_channel_cases(cases, rng, fma_only=False):
    i = 0
    for qmin, qmax in RANGES:
        for shape, axis in PC_SHAPES:
            for zdtype in ((np.int32, np.float32) if not fma_only else (np.float32,)):
                if fma_only and i % 3:
                    i += 1
                    continue
                c = shape[axis]
                scale = np.array([SCALES[j % len(SCALES)] for j in rng.integers(0, len(SCALES), c)], f32)
                if zdtype is np.int32:
                    zp = rng.integers(qmin, qmax + 1, c).astype(np.int32)
                else:
                    zp = (rng.uniform(qmin - 1, qmax + 1, c)).astype(f32)
                    integral = rng.random(c) < 0.3
                    zp[integral] = np.round(zp[integral])
                n = int(np.prod(shape))
                x = np.empty(shape, f32)
                moved = np.moveaxis(x, axis, -1)
                for ch in range(c):
                    vals = probe_inputs(rng, max(n // c, 8), scale[ch], float(np.round(zp[ch])), qmin, qmax,
                                        with_specials=(ch == 0))
                    if zdtype is np.float32:
                        vals = np.concatenate([vals, fma_probes(rng, scale[ch], zp[ch], 4)])
                    moved[..., ch] = rng.choice(vals, moved[..., ch].shape)
                g = probe_gradients(rng, shape)
                try:
                    out, dx = run_forward_backward(PC, x, g, scale, zp, qmin, qmax, axis)
                except RuntimeError as exc:
                    cases.add(f"pc_{i:03d}", PC, dict(quant_min=qmin, quant_max=qmax, axis=axis, error=str(exc)[:300],
                                                     description="refused by PyTorch"),
                              dict(inputs=x, gradients=g, scale=scale, zero_point=zp))
                    i += 1
                    continue
                cases.add(f"pc_{i:03d}", PC, dict(quant_min=qmin, quant_max=qmax, axis=axis,
                                                 description=f"shape {shape} axis {axis} zero point {np.dtype(zdtype).name}"),
                          dict(inputs=x, gradients=g, scale=scale, zero_point=zp, outputs=out, backprops_wrt_input=dx))
                i += 1


LEARN_RANGES = [(0, 255), (-128, 127), (0, 15), (-8, 7), (-1, 1), (0, 1), (-127, 127), (-32768, 32767)]


def learnable_cases(cases, rng, fma_only=False):
    i = 0
    for qmin, qmax in LEARN_RANGES:
        for zp in (None, "tie", "neg", "out"):
            if zp is None:
                z = float(rng.uniform(qmin, qmax))
            elif zp == "tie":
                z = float(np.floor(rng.uniform(qmin, qmax))) + 0.5     # nearbyint vs (int)(z + 0.5)
            elif zp == "neg":
                z = float(qmin) + 0.7 if qmin < 0 else -0.3
            else:
                z = float(qmax) + 2.2                                   # clamped to the grid
            for grad_factor in (1.0, 0.5, "lsq"):
                if fma_only and grad_factor != 1.0:
                    continue
                scale = SCALES[int(rng.integers(0, len(SCALES)))]
                zr = float(np.clip(np.round(z), qmin, qmax))
                x = np.concatenate([probe_inputs(rng, 40, scale, zr, qmin, qmax, with_specials=(i % 2 == 0)),
                                    fma_probes(rng, scale, np.trunc(np.clip(z + 0.5, qmin, qmax)), 8)])
                gf = 1.0 / np.sqrt(x.size * qmax) if grad_factor == "lsq" else grad_factor
                if qmax == 0:
                    gf = 1.0
                g = probe_gradients(rng, x.shape, specials_=(i % 3 == 0))
                out, dx, ds, dz = run_learnable(LPT, x, g, np.array([scale], f32), np.array([z], f32), qmin, qmax, gf)
                cases.add(f"lpt_{i:03d}", LPT, dict(quant_min=qmin, quant_max=qmax, grad_factor=gf,
                                                   description=f"scale {scale:.6g}, zero point {z}"),
                          dict(inputs=x, gradients=g, scale=np.array([scale], f32), zero_point=np.array([z], f32),
                               outputs=out, backprops_wrt_input=dx, backprop_wrt_scale=ds, backprop_wrt_zero_point=dz))
                i += 1
    for qmin, qmax in LEARN_RANGES:
        for shape, axis in PC_SHAPES[:5]:
            if fma_only and i % 2:
                i += 1
                continue
            c = shape[axis]
            scale = np.array([SCALES[j] for j in rng.integers(0, len(SCALES), c)], f32)
            z = rng.uniform(qmin - 1.5, qmax + 1.5, c).astype(f32)
            z[: c // 2] = np.floor(z[: c // 2]) + f32(0.5)             # ties: round half to even
            x = np.empty(shape, f32)
            moved = np.moveaxis(x, axis, -1)
            for ch in range(c):
                zr = float(np.clip(np.round(z[ch]), qmin, qmax))
                vals = np.concatenate([probe_inputs(rng, 16, scale[ch], zr, qmin, qmax, with_specials=(ch == 1)),
                                       fma_probes(rng, scale[ch], zr, 4)])
                moved[..., ch] = rng.choice(vals, moved[..., ch].shape)
            g = probe_gradients(rng, shape)
            gf = float(rng.choice([1.0, 0.25, 1.0 / np.sqrt(x.size / c * max(qmax, 1))]))
            out, dx, ds, dz = run_learnable(LPC, x, g, scale, z, qmin, qmax, gf, axis)
            cases.add(f"lpc_{i:03d}", LPC, dict(quant_min=qmin, quant_max=qmax, axis=axis, grad_factor=gf,
                                               description=f"shape {shape} axis {axis}"),
                      dict(inputs=x, gradients=g, scale=scale, zero_point=z, outputs=out, backprops_wrt_input=dx,
                           backprop_wrt_scale=ds, backprop_wrt_zero_point=dz))
            i += 1


def refused_cases(cases, rng):
    x = rng.standard_normal(16).astype(f32)
    g = rng.standard_normal(16).astype(f32)
    attempts = [
        ("refused_qmin_gt_qmax", PT, dict(quant_min=10, quant_max=5), 0.1, 7),
        ("refused_zp_outside", PT, dict(quant_min=0, quant_max=255), 0.1, 300),
        ("refused_learnable_qmin_positive", LPT, dict(quant_min=1, quant_max=255), 0.1, 3.0),
    ]
    for name, op, attrs, scale, zp in attempts:
        try:
            if op == PT:
                run_forward_backward(PT, x, g, scale, zp, attrs["quant_min"], attrs["quant_max"])
            else:
                run_learnable(LPT, x, g, np.array([scale], f32), np.array([zp], f32), attrs["quant_min"],
                              attrs["quant_max"], 1.0)
            raise SystemExit(f"{name}: PyTorch accepted it")
        except RuntimeError as exc:
            cases.add(name, op, dict(attrs, error=str(exc).splitlines()[0][:300], description="refused by PyTorch"),
                      dict(inputs=x, gradients=g, scale=np.asarray(scale, f32 if op == LPT else np.float64),
                           zero_point=np.asarray(zp, f32 if op == LPT else np.int32)))


def observer_cases(cases, rng):
    from torch.ao.quantization.observer import MinMaxObserver

    pairs = [(-1.0, 1.0), (-6.0, 6.0), (0.1, 5.0), (-5.0, -0.1), (-0.1275, 63.6225), (0.0, 0.0), (-3.0, 0.0),
             (0.0, 2.5), (-1e-9, 1e-9)] + [tuple(sorted(rng.normal(0, 4, 2))) for _ in range(40)]
    for dtype, (qmin, qmax) in ((torch.quint8, (0, 255)), (torch.qint8, (-128, 127)), (torch.quint8, (0, 15))):
        scales, zps = [], []
        for mn, mx in pairs:
            obs = MinMaxObserver(dtype=dtype, quant_min=qmin, quant_max=qmax)
            obs(torch.tensor([mn, mx], dtype=torch.float32))
            scale, zp = obs.calculate_qparams()
            scales.append(float(scale[0]))
            zps.append(int(zp[0]))
        # One group per grid: entry j is a separate observer that saw the values [min[j], max[j]].
        cases.add(f"obs_{qmin}_{qmax}", OBS, dict(quant_min=qmin, quant_max=qmax, dtype=str(dtype),
                                                 description="MinMaxObserver per_tensor_affine, one observer per entry"),
                  dict(min=np.array([p[0] for p in pairs], f32), max=np.array([p[1] for p in pairs], f32),
                       scale=np.array(scales, f32), zero_point=np.array(zps, np.int32)))


def build(child):
    rng = np.random.default_rng(SEED + (1 if child else 0))
    cases = Cases()
    per_tensor_cases(cases, rng, fma_only=child)
    per_channel_cases(cases, rng, fma_only=child)
    learnable_cases(cases, rng, fma_only=child)
    if not child:
        refused_cases(cases, rng)
        observer_cases(cases, rng)
    return cases


def dump_child(path):
    """Write this process's (DEFAULT-kernel) cases to an npz + json sidecar for the parent."""
    cases = build(child=True)
    arrays, meta = {}, []
    for n, (name, op, attrs, data) in enumerate(cases.items):
        meta.append((name, op, attrs, list(data)))
        for k, v in data.items():
            arrays[f"{n}/{k}"] = v
    np.savez(path, **arrays)
    with open(path + ".json", "w") as f:
        json.dump(meta, f)


def load_child(path):
    items = []
    with np.load(path) as z, open(path + ".json") as f:
        for n, (name, op, attrs, keys) in enumerate(json.load(f)):
            items.append((name + "_default", op, attrs, {k: z[f"{n}/{k}"] for k in keys}))
    return items


def main():
    if "--child" in sys.argv:
        dump_child(sys.argv[sys.argv.index("--child") + 1])
        return
    import h5py

    capability = torch.backends.cpu.get_cpu_capability()
    cases = build(child=False)
    tmp = os.path.join(HERE, ".torch_default_cases.npz")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--child", tmp], check=True, env=env)
    child = load_child(tmp)
    os.remove(tmp)
    os.remove(tmp + ".json")
    all_items = [(n, op, dict(a, cpu_capability=capability), d) for n, op, a, d in cases.items]
    all_items += [(n, op, dict(a, cpu_capability="DEFAULT"), d) for n, op, a, d in child]
    with h5py.File(OUT + ".tmp", "w") as f:
        f.attrs["torch_version"] = str(torch.__version__)
        f.attrs["generator"] = GENERATOR
        f.attrs["seed"] = SEED
        f.attrs["numpy_version"] = np.__version__
        for name, op, attrs, data in all_items:
            grp = f.create_group(name)
            grp.attrs["op"] = op
            for k, v in attrs.items():
                grp.attrs[k] = v
            for k, v in data.items():
                grp.create_dataset(k, data=v)
    os.replace(OUT + ".tmp", OUT)
    counts = {}
    for _, op, attrs, _ in all_items:
        key = (op, attrs["cpu_capability"], "error" in attrs)
        counts[key] = counts.get(key, 0) + 1
    print(f"wrote {OUT} with {len(all_items)} cases (torch {torch.__version__}, {capability}):")
    for (op, cap, err), n in sorted(counts.items()):
        print(f"  {op:45s} {cap:8s} {'refused' if err else 'ok':8s} {n}")


if __name__ == "__main__":
    main()
