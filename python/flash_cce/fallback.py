"""Pure-MLX flash-CCE: online logsumexp over vocabulary blocks with an analytic VJP.

Runs on any device MLX supports. Memory is bounded by a few `[M, block]` logits tiles plus
one dequantized `[block, H]` weight slice: each block's inputs depend on the block before
(`_ordered`), because the blocks' matmuls are otherwise independent and MLX's breadth-first
scheduler computes many of them before any is reduced (2-4 times the whole `[M, V]` logits at
once, measured on the CPU). It is the portable path where no native kernel exists and an
independent reference for the kernels in the tests.
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


def _ordered(h, w, scales, biases, previous):
    """A block's inputs (h, w, scales, biases) made to wait for `previous` (what
    the block before reduced to), so that one block's tiles are alive at a time."""
    if not previous:
        return h, w, scales, biases
    given = [a for a in (h, w, scales, biases) if a is not None]
    it = iter(mx.depends(given, previous))
    return tuple(next(it) if a is not None else None for a in (h, w, scales, biases))


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


def _forward(h, w, scales, biases, targets, group_size, bits, cap, ignore_index, block,
             stats=False):
    """(logp, lse), or with `stats` (logp, lse, entropy, is_top1, mean_logit).

    The entropy is kept as log S - R / S with S = sum_v e^(s_v - m) and
    R = sum_v e^(s_v - m) (s_v - m) relative to the running maximum m: both
    terms are >= 0, so it never cancels against lse (which can be large)."""
    m, v = h.shape[0], w.shape[0]
    h32 = h.astype(mx.float32)
    bs = _block_size(m, v, block)
    run_max = mx.full((m,), -float("inf"), mx.float32)
    run_sum = mx.zeros((m,), mx.float32)
    if stats:
        run_r = mx.zeros((m,), mx.float32)
        total = mx.zeros((m,), mx.float32)
        arg = mx.zeros((m,), mx.int32)
    for lo in range(0, v, bs):
        hi = min(v, lo + bs)
        prev = [run_sum] + ([run_r, total, arg] if stats else []) if lo else []
        hb, wk, sk, bk = _ordered(h32, w, scales, biases, prev)
        s, _ = _softcap(hb @ _rows(wk, sk, bk, slice(lo, hi), group_size, bits).T, cap)
        bmax = s.max(axis=1)
        new_max = mx.maximum(run_max, bmax)
        shrink = mx.exp(run_max - new_max)
        e = mx.exp(s - new_max[:, None])
        if stats:
            # R relative to the new maximum: e^(m_old - m_new) (R + (m_old - m_new) S).
            # (The first block has S = 0 and m_old = -inf.)
            delta = mx.where(run_sum > 0, run_max - new_max, 0.0)
            run_r = shrink * (run_r + delta * run_sum) + (e * (s - new_max[:, None])).sum(axis=1)
            total = total + s.sum(axis=1)
            # Strictly greater: the first arg-max wins ties, as argmax does.
            arg = mx.where(bmax > run_max, mx.argmax(s, axis=1).astype(mx.int32) + lo, arg)
        run_sum = run_sum * shrink + e.sum(axis=1)
        run_max = new_max
    lse = run_max + mx.log(run_sum)
    keep, ok = _valid(targets, v, ignore_index)
    safe = mx.where(ok, targets, 0).astype(mx.uint32)
    wy = _rows(w, scales, biases, safe, group_size, bits)
    sy, _ = _softcap((h32 * wy).sum(axis=1), cap)
    logp = mx.where(ok, sy - lse, mx.where(keep, float("nan"), 0.0))
    if not stats:
        return logp, lse
    entropy = mx.log(run_sum) - run_r / run_sum
    is_top1 = ok & (arg == targets)
    return logp, lse, entropy, is_top1, total / v


def _backward(
    h, w, scales, biases, targets, lse, g, g_lse, group_size, bits, cap, ignore_index,
    block, want_dw, entropy=None, g_entropy=None,
):
    """dS = (g * onehot(y) + p * ((g_lse - g) - g_ent * (s - sum_u p_u s_u))) * dcap;
    dh = dS @ W; dW = dS^T @ h. sum_u p_u s_u = lse - entropy."""
    m, v = h.shape[0], w.shape[0]
    h32 = h.astype(mx.float32)
    bs = _block_size(m, v, block)
    _, ok = _valid(targets, v, ignore_index)
    g = mx.where(ok, g.astype(mx.float32), 0.0)
    g_lse = mx.zeros((m,), mx.float32) if g_lse is None else g_lse.astype(mx.float32)
    coef = (g_lse - g)[:, None]
    if g_entropy is not None:
        g_ent = g_entropy.astype(mx.float32)[:, None]
        mean_s = (lse - entropy.astype(mx.float32))[:, None]
    dh = mx.zeros(h.shape, mx.float32)
    dw_blocks = []
    for lo in range(0, v, bs):
        hi = min(v, lo + bs)
        hb, wk, sk, bk = _ordered(h32, w, scales, biases, [dh] + dw_blocks[-1:] if lo else [])
        wb = _rows(wk, sk, bk, slice(lo, hi), group_size, bits)
        s, dcap = _softcap(hb @ wb.T, cap)
        if g_entropy is None:
            ds = coef * mx.exp(s - lse[:, None])
        else:
            ds = mx.exp(s - lse[:, None]) * (coef - g_ent * (s - mean_s))
        onehot = targets[:, None] == mx.arange(lo, hi)[None, :]
        ds = ds + mx.where(onehot, g[:, None], 0.0)
        if dcap is not None:
            ds = ds * dcap
        dh = dh + ds @ wb
        if want_dw:
            dw_blocks.append(ds.T @ hb)
    dw = mx.concatenate(dw_blocks, axis=0).astype(w.dtype) if want_dw else None
    return dh.astype(h.dtype), dw


def _cotangents(cotangents, outputs, stats):
    """(g, g_lse, entropy, g_entropy) from the custom function's cotangents;
    is_top1 and mean_logit are statistics and take none."""
    g, g_lse = cotangents[0], cotangents[1]
    if not stats:
        return g, g_lse, None, None
    return g, g_lse, outputs[2], cotangents[2]


@lru_cache(maxsize=None)
def _dense_fn(cap, ignore_index, block, stats):
    @mx.custom_function
    def f(h, w, targets):
        return _forward(h, w, None, None, targets, 0, 0, cap, ignore_index, block, stats)

    @f.vjp
    def f_vjp(primals, cotangents, outputs):
        h, w, targets = primals
        g, g_lse, ent, g_ent = _cotangents(cotangents, outputs, stats)
        dh, dw = _backward(
            h, w, None, None, targets, outputs[1], g, g_lse, 0, 0, cap, ignore_index,
            block, True, ent, g_ent,
        )
        return dh, dw, mx.zeros_like(targets)

    return f


@lru_cache(maxsize=None)
def _quant_fn(group_size, bits, cap, ignore_index, block, stats):
    @mx.custom_function
    def f(h, w, scales, biases, targets):
        return _forward(
            h, w, scales, biases, targets, group_size, bits, cap, ignore_index, block, stats
        )

    @f.vjp
    def f_vjp(primals, cotangents, outputs):
        h, w, scales, biases, targets = primals
        g, g_lse, ent, g_ent = _cotangents(cotangents, outputs, stats)
        dh, _ = _backward(
            h, w, scales, biases, targets, outputs[1], g, g_lse, group_size, bits, cap,
            ignore_index, block, False, ent, g_ent,
        )
        # A quantized head is frozen: its packed weight, scales and biases get zeros.
        zeros = [mx.zeros_like(a) for a in (w, scales, biases, targets)]
        return (dh, *zeros)

    return f


def forward(h, w, targets, scales=None, biases=None, *, group_size=64, bits=4,
            softcap=None, ignore_index=-100, block=None, stats=False):
    """Fallback forward on 2-D `h[M, H]` and 1-D `targets[M]`; returns (logp, lse),
    or with `stats` (logp, lse, entropy, is_top1, mean_logit)."""
    if scales is None:
        return _dense_fn(softcap, ignore_index, block, stats)(h, w, targets)
    return _quant_fn(group_size, bits, softcap, ignore_index, block, stats)(
        h, w, scales, biases, targets
    )


def backward(h, w, targets, lse, g, scales=None, biases=None, *, g_lse=None,
             group_size=64, bits=4, softcap=None, ignore_index=-100, block=None,
             compute_dw=False, entropy=None, g_entropy=None):
    """Fallback backward on 2-D inputs; returns (dh, dw or None). `g_entropy`,
    the cotangent of the forward's entropy, needs that `entropy`."""
    return _backward(
        h, w, scales, biases, targets, lse, g, g_lse, group_size, bits, softcap,
        ignore_index, block, compute_dw and scales is None, entropy, g_entropy,
    )
