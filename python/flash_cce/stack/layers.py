"""How mlx-lm's layers compute during a training step over many tokens.

While `training_layers()` is active (see `stats.value_and_grad`; the stack's
forwards without gradient enter `quantized_layers()`, the first point alone):

- A quantized layer (`nn.QuantizedLinear`) given at least `dense_from_rows()`
  rows dequantizes its weight to the activation dtype and runs a dense matmul.
  Over thousands of rows the dequantization is a small fraction of the matmul,
  and the dense GEMM runs far closer to the device's peak than MLX's quantized
  matmul (`bench/bench_layers.py`, docs/stack.md). The gradient dequantizes
  again instead of keeping the dense weight, so the step keeps only the packed
  weights, as before.
- LoRA adapters (`LoRALinear`) multiply in the activation dtype, as mixed
  precision training does: the adapter weights and their gradients stay in
  their own dtype (float32 from mlx-lm), but bfloat16 activations are no longer
  copied to float32 and the `[tokens, out]` adapter term is not built in
  float32. The LoRA scale multiplies the `[rank, out]` matrix, not the
  `[tokens, out]` product.
- `nn.gelu_approx` (Gemma's MLP) gets its gradient from one fused kernel on
  NVIDIA GPUs (`fused.gelu_approx_grad`); elsewhere MLX's.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tuner.lora import LoRALinear

from . import fused
from .plan import on_cuda

_mlx_gelu_approx = nn.gelu_approx

# Rows (tokens) from which a quantized layer dequantizes; fewer go to MLX's
# quantized matmul: below it the dense path stops paying for its dequantization
# (`bench/bench_layers.py`).
DENSE_FROM_ROWS = 1024

# On CUDA, MLX builds its quantized matrix-matrix kernels at run time, about
# half a minute each the first time a machine runs them, and a step needs two
# (the product and its input gradient). Its matrix-vector kernel, which takes
# fewer than 8 rows, comes compiled.
CUDA_DENSE_FROM_ROWS = 8


def dense_from_rows():
    """Rows from which a quantized layer takes the dense path on the default device."""
    return CUDA_DENSE_FROM_ROWS if on_cuda() else DENSE_FROM_ROWS


def _dense_weight(layer, dtype, after):
    # `after` orders the dequantization after the data that needs it, or the
    # scheduler may dequantize many layers' weights ahead of time.
    w, scales = mx.depends([layer["weight"], layer["scales"]], after)
    return mx.dequantize(
        w, scales, layer.get("biases"),
        group_size=layer.group_size, bits=layer.bits, mode=layer.mode, dtype=dtype,
    )


def dequantized_linear(layer, x):
    """`layer(x)` for an `nn.QuantizedLinear` through a dense matmul."""

    @mx.custom_function
    def matmul(x):
        return x @ _dense_weight(layer, x.dtype, [x]).T

    @matmul.vjp
    def matmul_vjp(primals, cotangents, outputs):
        dy = cotangents  # one input, one output: arrays, not lists
        return dy @ _dense_weight(layer, dy.dtype, [dy])

    y = matmul(x)
    if "bias" in layer:
        y = y + layer["bias"]
    return y


def _quantized_call(original):
    def __call__(self, x):
        if x.size // max(x.shape[-1], 1) >= dense_from_rows():
            return dequantized_linear(self, x)
        return original(self, x)

    return __call__


def _lora_call(self, x):
    a = self.lora_a.astype(x.dtype)
    b = (self.scale * self.lora_b).astype(x.dtype)
    # Rows as one matrix: each matmul of [B, L, d] by a matrix would flatten and
    # unflatten its input (two more ops per matmul, and their gradients).
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    y = self.linear(x) + (self.dropout(x) @ a) @ b
    return y.reshape(*lead, y.shape[-1])


@mx.custom_function
def gelu_approx(x):
    """`nn.gelu_approx(x)`, whose gradient is one kernel where `fused` runs."""
    return _mlx_gelu_approx(x)


@gelu_approx.vjp
def _gelu_approx_vjp(x, g, out):  # one input, one output: arrays, not lists
    if fused.available():
        return fused.gelu_approx_grad(x, g)
    return mx.vjp(_mlx_gelu_approx, [x], [g])[1][0]


class quantized_layers:
    """Context manager: quantized linear layers compute as described in this
    module while it is active (the stack's forwards without gradient too, so
    that they compute the layers as its training steps do), and as MLX
    defines them after."""

    def __enter__(self):
        self.saved = nn.QuantizedLinear.__call__
        nn.QuantizedLinear.__call__ = _quantized_call(self.saved)
        return self

    def __exit__(self, *exc):
        nn.QuantizedLinear.__call__ = self.saved
        return False


class training_layers:
    """Context manager: quantized and LoRA linear layers and `nn.gelu_approx`
    compute as described in this module while it is active, and as mlx-lm and
    MLX define them after."""

    def __enter__(self):
        self.quantized = quantized_layers().__enter__()
        self.saved = (LoRALinear.__call__, nn.gelu_approx)
        LoRALinear.__call__ = _lora_call
        nn.gelu_approx = gelu_approx
        return self

    def __exit__(self, *exc):
        LoRALinear.__call__, nn.gelu_approx = self.saved
        return self.quantized.__exit__(*exc)

    @staticmethod
    def active():
        return nn.gelu_approx is gelu_approx
