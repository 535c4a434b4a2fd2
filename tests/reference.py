"""Independent float64 numpy reference for the flash-CCE head.

Dequantization here reads MLX's packed layout directly (an LSB-first bit stream
per row, value = scale * q + bias per group) instead of calling mx.dequantize.
"""

import mlx.core as mx
import numpy as np


def operand_type(h_dtype):
    """The type the GPU kernels multiply in: fp16 for fp16 h, else bf16."""
    return mx.float16 if h_dtype == mx.float16 else mx.bfloat16


def to64(a):
    return np.array(a.astype(mx.float32), dtype=np.float64)


def dequantize(w, scales, biases, group_size):
    packed = np.array(w).view(np.uint8)
    stream = np.unpackbits(packed, axis=1, bitorder="little")
    v, h = scales.shape[0], scales.shape[1] * group_size
    bits = w.shape[1] * 32 // h
    q = stream[:, : h * bits].reshape(v, h, bits).astype(np.int64)
    q = (q << np.arange(bits)).sum(-1)
    s = np.repeat(to64(scales), group_size, axis=1)
    b = np.repeat(to64(biases), group_size, axis=1)
    return q * s + b


def head_weight(w, scales=None, biases=None, group_size=64):
    if scales is None:
        return to64(w)
    return dequantize(w, scales, biases, group_size)


def forward_backward(h, W, y, g=None, g_lse=None, softcap=None, ignore_index=-100):
    """h [M, H], W [V, H] float64, y [M]. Returns logp, lse, dh, dW, |h||W| row bound."""
    raw = h @ W.T
    if softcap:
        t = np.tanh(raw / softcap)
        s, dcap = softcap * t, 1.0 - t * t
    else:
        s, dcap = raw, np.ones_like(raw)
    mx_ = s.max(axis=1, keepdims=True)
    lse = (mx_ + np.log(np.exp(s - mx_).sum(axis=1, keepdims=True)))[:, 0]
    M, V = s.shape
    keep = y != ignore_index
    safe = np.where(keep, y, 0)
    logp = np.where(keep, s[np.arange(M), safe] - lse, 0.0)
    g = np.ones(M) if g is None else g
    g = np.where(keep, g, 0.0)
    g_lse = np.zeros(M) if g_lse is None else g_lse
    p = np.exp(s - lse[:, None])
    onehot = np.zeros_like(s)
    onehot[np.arange(M)[keep], y[keep]] = 1.0
    ds = (g[:, None] * onehot + (g_lse - g)[:, None] * p) * dcap
    bound = np.abs(h) @ np.abs(W).T
    return logp, lse, ds @ W, ds.T @ h, bound
