"""Real architectures for the capture tests and benchmarks/bench_capture.py: a ResNet-18 (eager torch.ao QAT with
fused conv-bn-relu, QuantStub and FloatFunctional skip adds, or plain for FX), a Llama-style decoder for
torchao QAT, a tf_keras MobileNetV2 under tfmot.  Frameworks are imported inside the builders."""


def resnet18(width=64, classes=10, fx=False):
    """ResNet-18 for 32x32 inputs (a 3x3 stem, no max pool), ``width`` channels in the first stage;
    ``fx=False``: ready for eager QAT (QuantStub/DeQuantStub, FloatFunctional skip adds, fuse with
    :func:`fuse_resnet`); ``fx=True``: plain ``+`` and ``relu`` for ``prepare_qat_fx``."""
    import torch
    from torch import nn
    from torch.ao import quantization as tq

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
            self.relu1 = nn.ReLU()
            self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
            self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else None)
            self.skip = torch.ao.nn.quantized.FloatFunctional()

        def forward(self, x):
            y = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
            identity = self.down(x) if self.down is not None else x
            return torch.relu(y + identity) if fx else self.skip.add_relu(y, identity)

    class ResNet18(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
            self.conv1, self.bn1, self.relu = nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
            layers, cin = [], width
            for i, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
                layers.append(nn.Sequential(Block(cin, cout, 1 if i == 0 else 2), Block(cout, cout, 1)))
                cin = cout
            self.layer1, self.layer2, self.layer3, self.layer4 = layers
            self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(cin, classes)

        def forward(self, x):
            if not fx:
                x = self.quant(x)
            x = self.relu(self.bn1(self.conv1(x)))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            x = self.fc(torch.flatten(self.pool(x), 1))
            return x if fx else self.dequant(x)

    return ResNet18()


def eager_qat_resnet18(width=64):
    """ResNet-18 fused (conv-bn-relu, conv-bn) and prepared for eager QAT (x86 qconfig), in training mode."""
    import torch
    from torch.ao import quantization as tq

    torch.manual_seed(0)
    model = resnet18(width).train()
    groups = [["conv1", "bn1", "relu"]]
    for name, module in model.named_modules():
        if hasattr(module, "skip"):
            groups += [[f"{name}.conv1", f"{name}.bn1", f"{name}.relu1"], [f"{name}.conv2", f"{name}.bn2"]]
            if module.down is not None:
                groups.append([f"{name}.down.0", f"{name}.down.1"])
    tq.fuse_modules_qat(model, groups, inplace=True)
    model.qconfig = tq.get_default_qat_qconfig("x86")
    return tq.prepare_qat(model)


def fx_qat_resnet18(width=64, size=32):
    """ResNet-18 through ``prepare_qat_fx`` (x86 QAT qconfig mapping), in training mode."""
    import torch
    from torch.ao.quantization import get_default_qat_qconfig_mapping
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    torch.manual_seed(0)
    model = resnet18(width, fx=True).train()
    return prepare_qat_fx(model, get_default_qat_qconfig_mapping("x86"), example_inputs=(torch.randn(2, 3, size, size),))


def llama(layers=4, dim=64, heads=4, hidden=128, vocab=128):
    """A Llama-style decoder (RMSNorm, causal multi-head attention with rotary positions, SwiGLU MLP), every
    Linear under torchao QAT: int4 weights per group of 32, int8 per-token activations."""
    import torch
    from torch import nn
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.qat import QATConfig

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    def rotary(x):  # x: [batch, heads, seq, head_dim]
        half = x.shape[-1] // 2
        freq = 1.0 / 10000 ** (torch.arange(half, dtype=torch.float32) / half)
        angle = torch.arange(x.shape[-2], dtype=torch.float32)[:, None] * freq
        cos, sin = angle.cos(), angle.sin()
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm, self.mlp_norm = RMSNorm(), RMSNorm()
            self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
            self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
            self.down = nn.Linear(hidden, dim, bias=False)

        def forward(self, x):
            b, t, _ = x.shape
            h = self.attn_norm(x)
            q, k, v = (m(h).view(b, t, heads, dim // heads).transpose(1, 2) for m in (self.q, self.k, self.v))
            a = nn.functional.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, dim))
            h = self.mlp_norm(x)
            return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.norm, self.head = RMSNorm(), nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    model = Decoder().train()
    config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))
    quantize_(model, QATConfig(config, step="prepare"), filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
    return model


def mobilenet_v2(alpha=0.35, size=32, classes=10):
    """tf_keras MobileNetV2 (random weights) under ``tfmot.quantization.keras.quantize_model``, compiled for
    ``fit`` (SGD, sparse cross-entropy).  TF_USE_LEGACY_KERAS=1 must be set before TensorFlow is imported."""
    import tensorflow as tf
    import tensorflow_model_optimization as tfmot
    import tf_keras

    tf.random.set_seed(0)
    base = tf_keras.applications.MobileNetV2(weights=None, input_shape=(size, size, 3), alpha=alpha, classes=classes,
                                             classifier_activation=None)
    model = tfmot.quantization.keras.quantize_model(base)
    model.compile(optimizer=tf_keras.optimizers.SGD(0.01),
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def tfmot_quantizer_calls(model):
    """How many fake-quant ops one training step of a tfmot-quantized model calls: one per quantized weight,
    activation and output of each wrapper, one per QuantizeLayer."""
    import tensorflow_model_optimization as tfmot

    keras = tfmot.quantization.keras
    calls = 0
    for layer in model.layers:
        if isinstance(layer, keras.QuantizeWrapper):
            calls += len(layer._weight_vars) + sum(_quantizes(a) for a in layer._quantize_activations)
            calls += 1 if layer._output_quantizers else 0
        elif type(layer).__name__ == "QuantizeLayer" and layer.quantizer is not None:
            calls += 1
    return calls


def _quantizes(activation):
    """How many fake quants a tfmot QuantizeAwareActivation calls: one before a softmax, one after linear/relu/
    swish/gelu, none for NoOpActivation (a conv whose batch norm quantizes after it)."""
    return int(activation._should_pre_quantize()) + int(activation._should_post_quantize())
