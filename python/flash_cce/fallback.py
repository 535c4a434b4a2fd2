"""Pure-MLX flash-CCE: online logsumexp over vocabulary blocks with an analytic VJP.

Runs on any device MLX supports. Memory is bounded by one `[M, block]` logits tile plus
one dequantized `[block, H]` weight slice. It is the portable path where no native kernel
exists and an independent reference for the kernels in the tests.
"""

from functools import lru_cache

import mlx.core as mx

# Logit elements per vocabulary block (M * block): 16M fp32 = 64 MB at most.
_BLOCK_ELEMENTS = 1 << 24


def _block_size(m, v, block):
    if block is not None:
        return max(1, min(block, v))
    return max(128, min(v, _BLOCK_ELEMENTS // max(m, 1)))


def dequantize_f32(w, scales, biases, group_size, bits):
    """Affine dequantization in float32.

    mx.dequantize rounds `scale * q + bias` to the scales' dtype even with
    dtype=float32, so take the integer codes from it (exact with unit scales)
    and apply scales and biases here.
    """
    unit = mx.ones(scales.shape, mx.float32)
    codes = mx.dequantize(w, unit, mx.zeros_like(unit), group_size=group_size, bits=bits)
    codes = codes.reshape(*scales.shape, group_size)
    out = codes * scales.astype(mx.float32)[..., None] + biases.astype(mx.float32)[..., None]
    return out.reshape(scales.shape[0], -1)


def _rows(w, scales, biases, idx, group_size, bits):
    """Rows `idx` (a slice or index array) of the head as float32."""
    if scales is None:
        return w[idx].astype(mx.float32)
    return dequantize_f32(w[idx], scales[idx], biases[idx], group_size, bits)


def _softcap(raw, cap):
    """Returns (s, ds/draw)."""
    if cap is None:
        return raw, None
    t = mx.tanh(raw / cap)
    return cap * t, 1.0 - t * t


def _valid(targets, v, ignore_index):
    keep = targets != ignore_index
    in_range = (targets >= 0) & (targets < v)
    return keep, keep & in_range


def _forward(h, w, scales, biases, targets, group_size, bits, cap, ignore_index, block):
    m, v = h.shape[0], w.shape[0]
    h32 = h.astype(mx.float32)
    bs = _block_size(m, v, block)
    run_max = mx.full((m,), -float("inf"), mx.float32)
    run_sum = mx.zeros((m,), mx.float32)
    for lo in range(0, v, bs):
        hi = min(v, lo + bs)
        s, _ = _softcap(h32 @ _rows(w, scales, biases, slice(lo, hi), group_size, bits).T, cap)
        new_max = mx.maximum(run_max, s.max(axis=1))
        run_sum = run_sum * mx.exp(run_max - new_max) + mx.exp(
            s - new_max[:, None]
        ).sum(axis=1)
        run_max = new_max
    lse = run_max + mx.log(run_sum)
    keep, ok = _valid(targets, v, ignore_index)
    safe = mx.where(ok, targets, 0).astype(mx.uint32)
    wy = _rows(w, scales, biases, safe, group_size, bits)
    sy, _ = _softcap((h32 * wy).sum(axis=1), cap)
    logp = mx.where(ok, sy - lse, mx.where(keep, float("nan"), 0.0))
    return logp, lse


def _backward(
    h, w, scales, biases, targets, lse, g, g_lse, group_size, bits, cap, ignore_index,
    block, want_dw,
):
    """dS = (g * onehot(y) + (g_lse - g) * softmax) * dcap; dh = dS @ W; dW = dS^T @ h."""
    m, v = h.shape[0], w.shape[0]
    h32 = h.astype(mx.float32)
    bs = _block_size(m, v, block)
    _, ok = _valid(targets, v, ignore_index)
    g = mx.where(ok, g.astype(mx.float32), 0.0)
    g_lse = mx.zeros((m,), mx.float32) if g_lse is None else g_lse.astype(mx.float32)
    coef = (g_lse - g)[:, None]
    dh = mx.zeros(h.shape, mx.float32)
    dw_blocks = []
    for lo in range(0, v, bs):
        hi = min(v, lo + bs)
        wb = _rows(w, scales, biases, slice(lo, hi), group_size, bits)
        s, dcap = _softcap(h32 @ wb.T, cap)
        ds = coef * mx.exp(s - lse[:, None])
        onehot = targets[:, None] == mx.arange(lo, hi)[None, :]
        ds = ds + mx.where(onehot, g[:, None], 0.0)
        if dcap is not None:
            ds = ds * dcap
        dh = dh + ds @ wb
        if want_dw:
            dw_blocks.append(ds.T @ h32)
    dw = mx.concatenate(dw_blocks, axis=0).astype(w.dtype) if want_dw else None
    return dh.astype(h.dtype), dw


@lru_cache(maxsize=None)
def _dense_fn(cap, ignore_index, block):
    @mx.custom_function
    def f(h, w, targets):
        return _forward(h, w, None, None, targets, 0, 0, cap, ignore_index, block)

    @f.vjp
    def f_vjp(primals, cotangents, outputs):
        h, w, targets = primals
        g, g_lse = cotangents
        dh, dw = _backward(
            h, w, None, None, targets, outputs[1], g, g_lse, 0, 0, cap, ignore_index,
            block, True,
        )
        return dh, dw, mx.zeros_like(targets)

    return f


@lru_cache(maxsize=None)
def _quant_fn(group_size, bits, cap, ignore_index, block):
    @mx.custom_function
    def f(h, w, scales, biases, targets):
        return _forward(
            h, w, scales, biases, targets, group_size, bits, cap, ignore_index, block
        )

    @f.vjp
    def f_vjp(primals, cotangents, outputs):
        h, w, scales, biases, targets = primals
        g, g_lse = cotangents
        dh, _ = _backward(
            h, w, scales, biases, targets, outputs[1], g, g_lse, group_size, bits, cap,
            ignore_index, block, False,
        )
        # A quantized head is frozen: its packed weight, scales and biases get zeros.
        zeros = [mx.zeros_like(a) for a in (w, scales, biases, targets)]
        return (dh, *zeros)

    return f


def forward(h, w, targets, scales=None, biases=None, *, group_size=64, bits=4,
            softcap=None, ignore_index=-100, block=None):
    """Fallback forward on 2-D `h[M, H]` and 1-D `targets[M]`; returns (logp, lse)."""
    if scales is None:
        return _dense_fn(softcap, ignore_index, block)(h, w, targets)
    return _quant_fn(group_size, bits, softcap, ignore_index, block)(
        h, w, scales, biases, targets
    )


def backward(h, w, targets, lse, g, scales=None, biases=None, *, g_lse=None,
             group_size=64, bits=4, softcap=None, ignore_index=-100, block=None,
             compute_dw=False):
    """Fallback backward on 2-D inputs; returns (dh, dw or None)."""
    return _backward(
        h, w, scales, biases, targets, lse, g, g_lse, group_size, bits, softcap,
        ignore_index, block, compute_dw and scales is None,
    )
