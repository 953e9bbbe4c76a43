"""Generate tests/golden/torchao.h5 with REAL torchao (QAT fake quantizers) and torch on the CPU.

torchao and torch are never qgcli dependencies; run this in a throwaway venv::

    python3 -m venv /tmp/aovenv
    /tmp/aovenv/bin/pip install torch==2.13.0 torchao==0.18.0 numpy h5py
    /tmp/aovenv/bin/python tests/golden/make_golden_torchao.py

Each case is a group ``cases/<name>`` holding ``inputs``, ``gradients`` and torchao's ``outputs`` (forward of
``IntxFakeQuantizer`` / ``Float8FakeQuantizer`` with ``is_dynamic=True``), ``backprops_wrt_input`` (torch
autograd through the whole quantizer, scale computation included), ``scale`` and (integer) ``zero_point``;
the config is in the group's attributes.  ``refusals/<name>`` records configs torchao refuses (attribute
``error``: the exception type and message).  bfloat16 scales/zero points are stored as float32 values.
"""
import os
import sys
import warnings

import h5py
import numpy as np
import torch

warnings.filterwarnings("ignore")
import torchao  # noqa: E402
from torchao.quantization.granularity import PerAxis, PerGroup, PerRow, PerTensor, PerToken  # noqa: E402
from torchao.quantization.qat import Float8FakeQuantizeConfig, IntxFakeQuantizeConfig  # noqa: E402
from torchao.quantization.qat.fake_quantizer import Float8FakeQuantizer, IntxFakeQuantizer  # noqa: E402
from torchao.quantization.quant_primitives import MappingType, ZeroPointDomain  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchao.h5")
SHAPE = (4, 64)
INT_DTYPES = [f"int{b}" for b in range(1, 9)] + [f"uint{b}" for b in range(1, 9)]
PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
              "int32": torch.int32}


def data(kind, rng, shape=SHAPE):
    """float32 test tensors: every kind a user's tensors can be."""
    n = int(np.prod(shape))
    if kind == "normal":
        x = rng.standard_normal(n)
    elif kind == "heavy":  # heavy tails: a few huge values set the scale of their block
        x = rng.standard_t(1.5, n)
    elif kind == "zeros":
        x = np.zeros(n)
        x[n // 2:] = rng.standard_normal(n - n // 2)
    elif kind == "const":  # constant blocks (nonzero and zero): the scale falls to eps or to |c|/range
        x = rng.standard_normal(n).reshape(shape[0], -1)
        x[0, :] = 0.0
        x[1, :] = 0.75
        x[2, : x.shape[1] // 2] = -3.0
        x = x.reshape(-1)
    elif kind == "extremes":  # values on the block extremes, ties for the max, exact half steps
        x = np.round(rng.standard_normal(n) * 4) / 4
        x = x.reshape(shape[0], -1)
        x[:, 0] = x.max(axis=1)
        x[:, 1] = -x.max(axis=1)
        x[:, 2] = x.max(axis=1)
        x[:, 3] = x.max(axis=1) / 2
        x = x.reshape(-1)
    elif kind == "positive":
        x = np.abs(rng.standard_normal(n)) + 0.5
    elif kind == "tiny":  # subnormal scale region
        x = rng.standard_normal(n) * 1e-39
    elif kind == "nan":
        x = rng.standard_normal(n)
        x[5] = np.nan
    elif kind == "inf":
        x = rng.standard_normal(n)
        x[n - 3] = np.inf
        x[n // 2 + 1] = -np.inf
    else:
        raise ValueError(kind)
    return x.reshape(shape).astype(np.float32)


def intx_config(dtype, granularity, mapping, scale_precision="float32", zero_point_precision="int32",
                zero_point_domain="int", eps=None):
    if granularity.startswith("per-group:"):
        gran = PerGroup(int(granularity.split(":")[1]))
    elif granularity == "per-channel":
        gran = PerAxis(0)
    elif granularity == "per-token":
        gran = PerToken()
    elif granularity == "per-tensor":
        gran = PerTensor()
    elif granularity == "per-row":
        gran = PerRow()
    else:
        raise ValueError(granularity)
    mapping_type = {"symmetric": MappingType.SYMMETRIC, "asymmetric": MappingType.ASYMMETRIC,
                    "symmetric-no-clipping-err": MappingType.SYMMETRIC_NO_CLIPPING_ERR}[mapping]
    domain = {"int": ZeroPointDomain.INT, "float": ZeroPointDomain.FLOAT, "none": ZeroPointDomain.NONE}[
        zero_point_domain]
    return IntxFakeQuantizeConfig(getattr(torch, dtype), gran, mapping_type, scale_precision=PRECISIONS[scale_precision],
                                  zero_point_precision=PRECISIONS[zero_point_precision], zero_point_domain=domain,
                                  eps=eps)


def float8_config(dtype, granularity, lb=None, ub=None):
    gran = {"per-row": PerRow(), "per-tensor": PerTensor(), "per-token": PerToken(),
            "per-group:32": PerGroup(32)}[granularity]
    return Float8FakeQuantizeConfig(getattr(torch, dtype), gran, hp_value_lb=lb, hp_value_ub=ub)


def as_float32(t):
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.to(torch.float32).numpy(), str(t.dtype).replace("torch.", "")
    return t.numpy(), str(t.dtype).replace("torch.", "")


def run_case(quantizer, x, g):
    xt = torch.from_numpy(x.copy()).requires_grad_(True)
    y = quantizer(xt)
    y.backward(torch.from_numpy(g.copy()))
    out = {"outputs": y.detach().numpy(), "backprops_wrt_input": xt.grad.numpy()}
    if isinstance(quantizer, IntxFakeQuantizer):
        out["scale"], sdt = as_float32(quantizer.scale)
        out["zero_point"], zdt = as_float32(quantizer.zero_point)
        dtypes = {"scale_dtype": sdt, "zero_point_dtype": zdt}
    else:
        # Float8FakeQuantizer keeps no scale: recompute torchao's own _choose_scale_float8 for the record.
        from torchao.quantization.quant_primitives import _choose_scale_float8
        from torchao.quantization.utils import get_block_size

        c = quantizer.config
        with torch.no_grad():
            s = _choose_scale_float8(torch.from_numpy(x.copy()), get_block_size(x.shape, c.granularity), c.dtype,
                                     hp_value_lb=c.hp_value_lb, hp_value_ub=c.hp_value_ub)
        out["scale"] = s.numpy()
        dtypes = {"scale_dtype": "float32"}
    return out, dtypes


def main():
    rng = np.random.default_rng(20261201)
    cases = []

    def intx(name, kind, shape=SHAPE, **cfg):
        cases.append((name, "intx", kind, shape, cfg))

    def fp8(name, kind, shape=SHAPE, **cfg):
        cases.append((name, "float8", kind, shape, cfg))

    for dt in INT_DTYPES:
        intx(f"{dt}_g32_sym", "normal", dtype=dt, granularity="per-group:32", mapping="symmetric")
        intx(f"{dt}_g32_asym", "normal", dtype=dt, granularity="per-group:32", mapping="asymmetric")
        intx(f"{dt}_token_asym", "normal", dtype=dt, granularity="per-token", mapping="asymmetric")
    for mapping in ("symmetric", "asymmetric"):
        m = mapping[:4]
        intx(f"int4_channel_{m}", "normal", dtype="int4", granularity="per-channel", mapping=mapping)
        intx(f"int8_channel_{m}", "heavy", dtype="int8", granularity="per-channel", mapping=mapping)
        intx(f"int4_g16_{m}_positive", "positive", dtype="int4", granularity="per-group:16", mapping=mapping)
        for kind in ("heavy", "zeros", "const", "extremes", "tiny", "nan", "inf"):
            intx(f"int4_g32_{m}_{kind}", kind, dtype="int4", granularity="per-group:32", mapping=mapping)
            intx(f"uint4_g32_{m}_{kind}", kind, dtype="uint4", granularity="per-group:32", mapping=mapping)
        for sp in ("bfloat16", "float16"):
            intx(f"int4_g32_{m}_scale_{sp}", "heavy", dtype="int4", granularity="per-group:32", mapping=mapping,
                 scale_precision=sp)
        for zp in ("float32", "bfloat16"):
            intx(f"int4_g32_{m}_zp_{zp}", "normal", dtype="int4", granularity="per-group:32", mapping=mapping,
                 zero_point_precision=zp)
        intx(f"int4_g32_{m}_domain_float", "normal", dtype="int4", granularity="per-group:32", mapping=mapping,
             zero_point_domain="float")
        intx(f"int4_g32_{m}_eps", "const", dtype="int4", granularity="per-group:32", mapping=mapping, eps=1e-3)
    for kind in ("heavy", "zeros", "const", "extremes", "tiny", "nan", "inf"):
        intx(f"int8_token_asym_{kind}", kind, dtype="int8", granularity="per-token", mapping="asymmetric")
    intx("int8_token_asym_3d", "normal", shape=(2, 3, 16), dtype="int8", granularity="per-token",
         mapping="asymmetric")
    intx("int8_token_asym_scale_bfloat16", "heavy", dtype="int8", granularity="per-token", mapping="asymmetric",
         scale_precision="bfloat16")
    intx("int8_token_asym_zp_float32", "normal", dtype="int8", granularity="per-token", mapping="asymmetric",
         zero_point_precision="float32")
    intx("int8_token_asym_eps", "const", dtype="int8", granularity="per-token", mapping="asymmetric", eps=1e-2)
    for dt in ("float8_e4m3fn", "float8_e5m2"):
        short = "e4m3" if dt.endswith("fn") else "e5m2"
        for gran in ("per-row", "per-tensor"):
            g = gran.split("-")[1]
            for kind in ("normal", "heavy", "zeros", "const", "extremes", "tiny", "nan", "inf"):
                fp8(f"{short}_{g}_{kind}", kind, dtype=dt, granularity=gran)
        fp8(f"{short}_row_3d", "normal", shape=(2, 3, 16), dtype=dt, granularity="per-row")
        fp8(f"{short}_row_lb", "const", dtype=dt, granularity="per-row", lb=1e-2)
        fp8(f"{short}_row_ub", "heavy", dtype=dt, granularity="per-row", ub=2.0)
        fp8(f"{short}_tensor_lb_ub", "heavy", dtype=dt, granularity="per-tensor", lb=0.5, ub=3.0)

    refusal_configs = {
        "int8_token_sym": dict(kind="intx", dtype="int8", granularity="per-token", mapping="symmetric"),
        "int4_tensor": dict(kind="intx", dtype="int4", granularity="per-tensor", mapping="symmetric"),
        "int4_row": dict(kind="intx", dtype="int4", granularity="per-row", mapping="symmetric"),
        "int4_no_clipping_err": dict(kind="intx", dtype="int4", granularity="per-group:32",
                                     mapping="symmetric-no-clipping-err"),
        "int4_domain_none": dict(kind="intx", dtype="int4", granularity="per-group:32", mapping="symmetric",
                                 zero_point_domain="none"),
        "int4_g48": dict(kind="intx", dtype="int4", granularity="per-group:48", mapping="symmetric"),
        "int4_g128": dict(kind="intx", dtype="int4", granularity="per-group:128", mapping="symmetric"),
        "int4_g1": dict(kind="intx", dtype="int4", granularity="per-group:1", mapping="symmetric"),
        "int4_g32_3d": dict(kind="intx", dtype="int4", granularity="per-group:16", mapping="symmetric",
                            shape=(2, 2, 32)),
        "float8_token": dict(kind="float8", dtype="float8_e4m3fn", granularity="per-token"),
        "float8_group": dict(kind="float8", dtype="float8_e4m3fn", granularity="per-group:32"),
    }

    with h5py.File(OUT + ".tmp", "w") as f:
        f.attrs["torch"] = str(torch.__version__)
        f.attrs["torchao"] = torchao.__version__
        f.attrs["generator"] = "tests/golden/make_golden_torchao.py"
        for name, family, kind, shape, cfg in cases:
            x = data(kind, rng, shape)
            g = rng.standard_normal(shape).astype(np.float32)
            if family == "intx":
                q = IntxFakeQuantizer(intx_config(**cfg))
            else:
                q = Float8FakeQuantizer(float8_config(cfg["dtype"], cfg["granularity"], cfg.get("lb"), cfg.get("ub")))
            out, dtypes = run_case(q, x, g)
            grp = f.create_group(f"cases/{name}")
            for k, v in {"inputs": x, "gradients": g, **out}.items():
                grp.create_dataset(k, data=v)
            grp.attrs["family"], grp.attrs["data"] = family, kind
            for k, v in {**cfg, **dtypes}.items():
                if k in ("lb", "ub"):
                    k = {"lb": "hp_value_lb", "ub": "hp_value_ub"}[k]
                grp.attrs[k] = "none" if v is None else v
        for name, cfg in refusal_configs.items():
            cfg = dict(cfg)
            family, shape = cfg.pop("kind"), cfg.pop("shape", SHAPE)
            x = data("normal", rng, shape)
            try:
                if family == "intx":
                    q = IntxFakeQuantizer(intx_config(**cfg))
                else:
                    q = Float8FakeQuantizer(float8_config(cfg["dtype"], cfg["granularity"]))
                q(torch.from_numpy(x))
                error = "none"
            except Exception as e:  # what torchao raises is the record
                error = f"{type(e).__name__}: {e}"
            grp = f.create_group(f"refusals/{name}")
            grp.create_dataset("inputs", data=x)
            grp.attrs["family"] = family
            for k, v in cfg.items():
                grp.attrs[k] = v
            grp.attrs["error"] = error
    os.replace(OUT + ".tmp", OUT)
    print(f"wrote {len(cases)} cases and {len(refusal_configs)} refusals to {OUT} "
          f"(torch {torch.__version__}, torchao {torchao.__version__})", file=sys.stderr)


if __name__ == "__main__":
    main()
