"""Token embeddings looked up by the extension's own kernels.

On CUDA, MLX compiles its gather kernels at run time, seconds each on a
machine whose kernel cache is empty, and a quantized embedding's lookup takes
two (the packed weights, and the scales and biases). `take_rows` copies the
rows with a kernel the extension ships compiled (and on the CPU with its own
loop); on a Metal GPU it is MLX's gather. Before a process first uses the GPU
kernel it checks it against the CPU's on every copy width it has, and takes
MLX's gather (with a warning) if they differ. `embed` calls it for mlx-lm's
embedding modules exactly as they call the gather, and `routed_embeddings`
sends every such module's call to `embed` (Gemma 4's per-layer embeddings are
called inside mlx-lm's model code).
"""

import functools
import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import _ext


def native(device=None):
    """Whether `take_rows` runs the extension's kernels on `device` (default:
    MLX's default device): the CPU, and a GPU in a CUDA build whose kernel
    passed `gpu_rows_check`."""
    device = device or mx.default_device()
    return device.type == mx.cpu or (_ext.has_gpu_take_rows() and gpu_rows_check())


@functools.cache
def gpu_rows_check():
    """Whether the GPU's rows equal the CPU's to the byte: rows copied 16, 4, 2
    and 1 bytes at a time, short rows and rows longer than a warp's stride,
    blocks of rows after the first, an unaligned table, ids out of range. A
    kernel that fails or raises leaves the gather (with a warning)."""
    ids = mx.array([[6, 0, 7, 2, 5, 1, 4, 3, 6, 6, 0], [-1, 3, 3, 1, 2, 9, 5, 0, 4, 2, 1]])
    tables = []
    for width in (8, 200):  # 32- and 800-byte rows, aligned or not
        flat = mx.arange(7 * width + 1, dtype=mx.uint32)
        tables += [flat[:-1].reshape(7, width), flat[1:].reshape(7, width)]
    tables += [mx.arange(7 * w, dtype=mx.float32).astype(t).reshape(7, w)
               for t in (mx.float32, mx.bfloat16, mx.uint8) for w in (3, 67)]
    try:
        same = all(np.array_equal(np.array(_ext.take_rows(t, ids, stream=mx.gpu).view(mx.uint8)),
                                  np.array(_ext.take_rows(t, ids, stream=mx.cpu).view(mx.uint8)))
                   for t in tables)
    except RuntimeError as e:
        same, why = False, f"failed ({e})"
    else:
        why = "copied rows differently from the CPU's"
    if not same:
        warnings.warn(f"flash_cce: the CUDA take_rows kernel {why}; embeddings use MLX's gather",
                      RuntimeWarning, stacklevel=2)
    return same


def take_rows(table, ids):
    """`table[ids]` for a 2-D `table` [rows, width] and integer `ids` of any
    shape: shape `ids.shape + (width,)`, `table`'s dtype. Where the kernels run
    (`native`), an id outside [0, rows) gives a zero row and no gradient;
    elsewhere it is MLX's gather, which leaves such ids undefined. The gradient
    for `table` adds each cotangent row at its id."""
    if not native():
        return table[ids]

    @mx.custom_function
    def rows(t):
        return _ext.take_rows(t, ids)

    @rows.vjp
    def rows_vjp(primals, cotangent, output):
        # A scatter's ids out of range are undefined: send those rows' zeros to row 0.
        inside = ((ids >= 0) & (ids < table.shape[0])).reshape(-1)
        flat = mx.where(inside[:, None], cotangent.reshape(-1, table.shape[1]), 0)
        at = mx.where(inside, ids.reshape(-1), 0)
        return mx.zeros(table.shape, cotangent.dtype).at[at].add(flat)

    return rows(table)


def embed(module, tokens):
    """`module(tokens)` for an embedding module of mlx-lm's models, its rows
    taken by `take_rows` where the module is MLX's `Embedding` or
    `QuantizedEmbedding` (any mode: the module's own dequantize call, on the
    rows); subclasses may compute otherwise, so they call themselves."""
    if type(module) is nn.Embedding:
        return take_rows(module.weight, tokens)
    if type(module) is nn.QuantizedEmbedding:
        biases = module.get("biases")
        return mx.dequantize(
            take_rows(module["weight"], tokens),
            scales=take_rows(module["scales"], tokens),
            biases=None if biases is None else take_rows(biases, tokens),
            group_size=module.group_size, bits=module.bits, mode=module.mode)
    return module(tokens)


def _routed_call(original, kind):
    def __call__(module, tokens):
        return embed(module, tokens) if type(module) is kind else original(module, tokens)

    return __call__


class routed_embeddings:
    """Context manager: modules that are exactly MLX's `Embedding` or
    `QuantizedEmbedding` look their rows up through `embed` while it is active,
    wherever the model calls them; as MLX defines them after."""

    def __enter__(self):
        self.saved = (nn.Embedding.__call__, nn.QuantizedEmbedding.__call__)
        nn.Embedding.__call__ = _routed_call(self.saved[0], nn.Embedding)
        nn.QuantizedEmbedding.__call__ = _routed_call(self.saved[1], nn.QuantizedEmbedding)
        return self

    def __exit__(self, *exc):
        nn.Embedding.__call__, nn.QuantizedEmbedding.__call__ = self.saved
        return False
