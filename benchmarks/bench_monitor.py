"""What qgcli.monitor.torch costs a training run: wall time with and without the monitor, and history bytes.

Two models on the CPU: an eager QAT ResNet-18 (torch.ao prepare_qat, 32x32 inputs, batch 32; defined here,
torchvision is not needed) and a small Llama-style block with torchao QAT (int8 per-token activations, int4
per-group weights).  Each is trained ``--steps`` steps without the monitor, with ``every=10`` and with
``every=1``; the three runs are interleaved in ``--rounds`` rounds (the median per configuration is reported)
so that a busy machine slows them alike.  Goals (issue 37): every=10 at most 1.05x, every=1 at most 1.5x; the
history grows by a few KB per sample per 100 layers.

    python benchmarks/bench_monitor.py --steps 200 --rounds 3
"""
import argparse
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

def train(make, steps, every, folder):
    from qgcli.monitor.torch import monitor

    model, batch = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = [batch(g) for _ in range(min(steps, 8))]
    path = os.path.join(folder, f"h{every}_{time.monotonic_ns()}")

    def loop():
        for i in range(steps):
            x, y = data[i % len(data)]
            opt.zero_grad()
            out = model(x)
            nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
            opt.step()

    t0 = time.perf_counter()
    if every is None:
        loop()
        return time.perf_counter() - t0, None
    with monitor(model, path, every=every, optimizer=opt) as mon:
        loop()
    wall = time.perf_counter() - t0
    from qgcli.monitor.history import read_history

    h = read_history(path)
    layers = len(h.layers)
    size = os.path.getsize(path)
    del mon
    return wall, {"bytes": size, "samples": len(h.steps), "layers": layers}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="resnet18,llama")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    makers = {"resnet18": resnet18_qat, "llama": llama_qat}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} steps, {args.rounds} rounds")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            times = {None: [], 10: [], 1: []}
            sizes = {}
            for _ in range(args.rounds):
                for every in times:
                    wall, size = train(makers[name], args.steps, every, folder)
                    times[every].append(wall)
                    if size:
                        sizes[every] = size
            base = statistics.median(times[None])
            print(f"{name}: without the monitor {base:.2f} s ({1000 * base / args.steps:.1f} ms/step)")
            for every in (10, 1):
                t = statistics.median(times[every])
                s = sizes[every]
                per_sample = (s["bytes"] - 4096 * 3) / max(s["samples"], 1)
                print(f"  every={every:<3} {t:.2f} s  {t / base:.3f}x   history {s['bytes'] / 1024:.0f} KiB, "
                      f"{s['samples']} samples x {s['layers']} layers: {per_sample / 1024:.1f} KiB per sample, "
                      f"{per_sample / 1024 * 100 / s['layers']:.1f} KiB per sample per 100 layers")


if __name__ == "__main__":
    main()
