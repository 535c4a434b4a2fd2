"""The layers of a training step (`flash_cce.stack.layers`) compute mlx-lm's functions."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.tuner.lora import LoRALinear

from flash_cce.stack import layers
from flash_cce.stack.layers import DENSE_FROM_ROWS, training_layers


def _quantized(d_in, d_out, bits, group_size, dtype=mx.float32, bias=True, seed=0):
    mx.random.seed(seed)
    lin = nn.Linear(d_in, d_out, bias=bias)
    lin.set_dtype(dtype)
    return nn.QuantizedLinear.from_linear(lin, group_size=group_size, bits=bits)


def _value_and_grad(layer, x, c):
    return mx.value_and_grad(lambda x: (layer(x).astype(mx.float32) * c).sum())(x)


def _rel(a, b):
    return (abs(a.astype(mx.float32) - b.astype(mx.float32)).max() / abs(b).max()).item()


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32), (4, 128)])
@pytest.mark.parametrize("bias", [True, False])
def test_dequantized_linear_float32(bits, group_size, bias):
    """float32: value and input gradient of the dense path against float64 sums
    of the same dequantized weight, and against MLX's quantized matmul on the
    CPU, whose float32 sums differ only in order. Bounds: the gradient's
    256-term sums, 1e-5 of its largest entry; the value sums 196608 terms that
    cancel, 2^-20 (16 float32 epsilons) of the sum of their magnitudes."""
    layer = _quantized(256, 96, bits, group_size, bias=bias)
    x = mx.random.normal((2, DENSE_FROM_ROWS, 256))
    c = mx.random.normal((2, DENSE_FROM_ROWS, 96))
    with training_layers():
        v, g = _value_and_grad(layer, x, c)
    w = np.array(mx.dequantize(layer.weight, layer.scales, layer.biases, group_size, bits,
                               stream=mx.cpu), np.float64)
    b = np.array(layer.bias, np.float64) if bias else 0.0
    x64, c64 = np.array(x, np.float64), np.array(c, np.float64)
    terms = (x64 @ w.T + b) * c64
    v_ref, g_ref = terms.sum(), c64 @ w
    assert abs(v.item() - v_ref) <= 2**-20 * np.abs(terms).sum()
    assert np.abs(np.array(g) - g_ref).max() <= 1e-5 * np.abs(g_ref).max()
    if mx.default_device() == mx.cpu:
        v0, g0 = _value_and_grad(layer, x, c)
        assert abs(v - v0).item() <= 2**-20 * np.abs(terms).sum()
        assert _rel(g, g0) <= 1e-5


def test_bfloat16_dequantized_linear_error():
    """bfloat16: against the float32 product of the same dequantized weight, the
    gradient's error stays within bfloat16 rounding (2^-8 of inputs and output,
    a few units over a 256-term sum: bound 2^-7 of the largest entry). Measured
    on the CPU: 0.004, where MLX's quantized matmul gave 0.033."""
    layer = _quantized(256, 96, 4, 64, dtype=mx.bfloat16)
    x = mx.random.normal((DENSE_FROM_ROWS, 256)).astype(mx.bfloat16)
    c = mx.random.normal((DENSE_FROM_ROWS, 96))
    w = mx.dequantize(layer.weight, layer.scales, layer.biases, 64, 4).astype(mx.float32)
    b = layer.bias.astype(mx.float32)
    _, g_true = mx.value_and_grad(lambda x: ((x @ w.T + b) * c).sum())(x.astype(mx.float32))
    with training_layers():
        _, g = _value_and_grad(layer, x, c)
    assert _rel(g, g_true) <= 2**-7


@pytest.mark.parametrize("cuda", [False, True])
def test_few_rows_keep_quantized_matmul(monkeypatch, cuda):
    """Below the threshold MLX's quantized matmul runs; on CUDA the threshold
    is the rows its compiled matrix-vector kernel takes."""
    monkeypatch.setattr(layers, "on_cuda", lambda: cuda)
    rows = layers.CUDA_DENSE_FROM_ROWS if cuda else DENSE_FROM_ROWS
    layer = _quantized(256, 96, 4, 64)
    calls = []
    real = layers.dequantized_linear
    monkeypatch.setattr(layers, "dequantized_linear", lambda *a: calls.append(1) or real(*a))
    with training_layers():
        layer(mx.zeros((rows - 1, 256)))
        assert not calls
        layer(mx.zeros((rows, 256)))
        assert calls


def test_backward_keeps_packed_weights_only():
    """Eight 1024 x 1024 layers: beyond the activations (36 MB), the gradient's
    peak holds a few float32 dense weights at a time (4 MB each), not all eight.
    Measured: 28.5 MB in all on the CPU, activations + 4 dense weights on an
    H200; x @ dequantize(w).T differentiated by MLX: 76 MB on the CPU."""
    stack = [_quantized(1024, 1024, 4, 64, bias=False, seed=i) for i in range(8)]
    x = mx.random.normal((DENSE_FROM_ROWS, 1024))
    mx.eval([l.parameters() for l in stack], x)

    def loss(x):
        for layer in stack:
            x = layer(x)
        return x.sum()

    with training_layers():
        mx.eval(mx.grad(loss)(x))  # compile caches, warm-up
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        mx.eval(mx.grad(loss)(x))
        extra = mx.get_peak_memory() - before
    dense, acts = 1024 * 1024 * 4, 9 * DENSE_FROM_ROWS * 1024 * 4
    assert extra <= acts + 5 * dense, (extra, acts, dense)


@pytest.mark.parametrize("quantized", [False, True])
def test_lora_equals_mlx_lm(quantized):
    """float32: the adapter term with the scale folded into B is mlx-lm's."""
    base = _quantized(128, 64, 4, 64) if quantized else nn.Linear(128, 64)
    lora = LoRALinear.from_base(base, r=8, scale=20.0)
    lora.lora_b = mx.random.normal(lora.lora_b.shape) * 0.1
    lora.freeze(keys=["linear"], strict=False)
    x = mx.random.normal((300, 128))
    c = mx.random.normal((300, 64))

    def run():
        return nn.value_and_grad(lora, lambda x: (lora(x) * c).sum())(x)

    v0, g0 = run()
    with training_layers():
        v1, g1 = run()
    assert abs(v1 - v0).item() <= 1e-5 * abs(v0).item()
    for k in ("lora_a", "lora_b"):
        assert _rel(g1[k], g0[k]) <= 1e-5, k


def test_lora_bfloat16_keeps_adapter_dtype():
    lora = LoRALinear.from_base(nn.Linear(64, 32), r=4)
    lora.linear.set_dtype(mx.bfloat16)
    x = mx.random.normal((10, 64)).astype(mx.bfloat16)
    with training_layers():
        y = lora(x)
        g = nn.value_and_grad(lora, lambda x: lora(x).astype(mx.float32).sum())(x)[1]
    assert y.dtype == mx.bfloat16
    assert g["lora_a"].dtype == mx.float32 and g["lora_b"].dtype == mx.float32


def test_gelu_approx_is_mlx_s():
    """Routed, `nn.gelu_approx` has MLX's value and gradient (here MLX's own
    gradient; the fused kernel is compared in test_fused.py), and is restored."""
    x = mx.array(np.linspace(-6, 6, 1001).astype(np.float32))
    f = lambda x: (nn.gelu_approx(x) * mx.cos(x)).sum()
    v0, g0 = mx.value_and_grad(f)(x)
    with training_layers():
        assert nn.gelu_approx is layers.gelu_approx
        v1, g1 = mx.value_and_grad(f)(x)
    assert nn.gelu_approx is layers._mlx_gelu_approx
    assert v1.item() == v0.item()
    assert _rel(g1, g0) <= 1e-6


def test_quantized_layers_alone(monkeypatch):
    """The forwards without gradient enter `quantized_layers`: the dense path
    for quantized layers, mlx-lm's LoRA and MLX's gelu_approx as they are."""
    layer = _quantized(256, 96, 4, 64)
    calls = []
    real = layers.dequantized_linear
    monkeypatch.setattr(layers, "dequantized_linear", lambda *a: calls.append(1) or real(*a))
    lora_call, gelu = LoRALinear.__call__, nn.gelu_approx
    with layers.quantized_layers():
        layer(mx.zeros((DENSE_FROM_ROWS, 256)))
        assert calls and LoRALinear.__call__ is lora_call and nn.gelu_approx is gelu
        assert not training_layers.active()
    calls.clear()
    layer(mx.zeros((DENSE_FROM_ROWS, 256)))
    assert not calls


def test_the_stacks_evaluation_takes_the_dense_path(monkeypatch):
    """`objectives.evaluate` (no gradient) computes quantized layers through the
    dense path, as the training steps do."""
    from models import random_pair, tiny_model
    from flash_cce.train.objectives import ObjectiveConfig, evaluate

    monkeypatch.setattr(layers, "DENSE_FROM_ROWS", 8)
    calls = []
    real = layers.dequantized_linear
    monkeypatch.setattr(layers, "dequantized_linear", lambda *a: calls.append(1) or real(*a))
    model = tiny_model("llama", lora=True, quantize=True)
    evaluate(model, [random_pair(np.random.default_rng(0), 6, 5, 4)], ObjectiveConfig())
    assert calls
