"""Attention for training whose memory does not grow with the square of the length.

mlx-lm's layers call `mx.fast.scaled_dot_product_attention`; its gradient here
is that of the composed ops, which keep the `[B, heads, Lq, Lk]` scores and
several tensors of their size until the backward has used them. `attention`
computes the same function over blocks of queries: the forward keeps only the
output and each row's logsumexp, and its gradient (a custom VJP) recomputes one
block's scores at a time from q, k, v, the output and the logsumexp, the way
flash attention does. So at most one block's `[B, heads, block, Lk]` scores and
their gradient are alive at once.

`routed(model, block)` sends a model's attention calls through `attention` while
it is active (see `objectives.value_and_grad`).
"""

import sys

import mlx.core as mx

# Queries per block. Larger blocks mean fewer, larger matmuls; the gradient's
# extra memory is that of about 8 float32 block-score arrays [B, heads, block, Lk]
# (measured on the CPU with q/k/v-sized arrays included, tests/test_attention.py).
DEFAULT_BLOCK = 512

_NEG = -3.0e38  # masked score: finite, so a fully masked row stays a number


def _grouped(x, groups):
    """`[B, Hq, L, D]` -> `[B, Hkv, Hq / Hkv, L, D]` (query heads by KV head)."""
    b, h, n, d = x.shape
    return x.reshape(b, groups, h // groups, n, d)


def _mask5(mask, heads, groups):
    """An explicit mask broadcastable to `[B, Hq, Lq, Lk]` as 5-d, like `_grouped`."""
    while mask.ndim < 4:
        mask = mask[None]
    if mask.shape[1] == heads and heads != groups:
        b, _, n, k = mask.shape
        return mask.reshape(b, groups, heads // groups, n, k)
    return mask[:, :, None]


def _key_end(mask, lq, lk, b1):
    """Keys past this index are masked for every query before `b1` (causal)."""
    if isinstance(mask, str):
        return min(lk, b1 + lk - lq)
    return lk


def _block_mask(mask, lq, lk, b0, b1, kend):
    if mask is None:
        return None
    if isinstance(mask, str):  # "causal", aligned at the last key as in MLX
        q = mx.arange(b0 + lk - lq, b1 + lk - lq)
        return q[:, None] >= mx.arange(kend)[None]
    rows = mask[..., b0:b1, :] if mask.shape[-2] == lq else mask
    return rows[..., :kend]


def _scores(qb, k, m):
    """float32 scores of a block: qb `[B, Hkv, g, n, D]` (scaled), k `[B, Hkv, 1, K, D]`."""
    s = (qb @ k.swapaxes(-1, -2)).astype(mx.float32)
    if m is None:
        return s
    if m.dtype == mx.bool_:
        return mx.where(m, s, _NEG)
    return s + m.astype(mx.float32)


def _blocks(lq, block):
    return [(b0, min(lq, b0 + block)) for b0 in range(0, lq, block)]


def _forward(q, k, v, mask, scale, block):
    b, heads, lq, _ = q.shape
    groups, lk = k.shape[1], k.shape[2]
    qs = _grouped(q * scale, groups)
    k5, v5 = k[:, :, None], v[:, :, None]
    outs, lses = [], []
    for b0, b1 in _blocks(lq, block):
        qb = qs[:, :, :, b0:b1]
        if outs:  # one block at a time: the next starts after the last is done
            qb = mx.depends(qb, outs[-1])
        kend = _key_end(mask, lq, lk, b1)
        s = _scores(qb, k5[:, :, :, :kend], _block_mask(mask, lq, lk, b0, b1, kend))
        lse = mx.logsumexp(s, axis=-1, keepdims=True)
        p = mx.exp(s - lse).astype(v.dtype)
        outs.append(p @ v5[:, :, :, :kend])
        lses.append(lse)
    o = mx.concatenate(outs, axis=3).reshape(b, heads, lq, v.shape[-1])
    return o, mx.concatenate(lses, axis=3)


def _pad_keys(x, lk):
    """Zero rows for the keys a block skipped, so the block adds into `[.., Lk, D]`."""
    n = x.shape[2]
    return x if n == lk else mx.pad(x, [(0, 0), (0, 0), (0, lk - n), (0, 0)])


def _backward(q, k, v, mask, scale, block, o, lse, do):
    b, heads, lq, d = q.shape
    groups, lk = k.shape[1], k.shape[2]
    g = heads // groups
    qs = _grouped(q * scale, groups)
    do5 = _grouped(do.astype(q.dtype), groups)
    delta = _grouped((do.astype(mx.float32) * o.astype(mx.float32)).sum(-1, keepdims=True), groups)
    k5, v5 = k[:, :, None], v[:, :, None]
    dk = mx.zeros(k.shape, mx.float32)
    dv = mx.zeros(v.shape, mx.float32)
    dqs = []
    for b0, b1 in _blocks(lq, block):
        n = b1 - b0
        qb, dob = qs[:, :, :, b0:b1], do5[:, :, :, b0:b1]
        if dqs:  # one block at a time, or the evaluation may keep every block alive
            qb = mx.depends(qb, [dqs[-1], dk, dv])
        kend = _key_end(mask, lq, lk, b1)
        kb, vb = k5[:, :, :, :kend], v5[:, :, :, :kend]
        s = _scores(qb, kb, _block_mask(mask, lq, lk, b0, b1, kend))
        p = mx.exp(s - lse[:, :, :, b0:b1])
        dp = (dob @ vb.swapaxes(-1, -2)).astype(mx.float32)
        ds = (p * (dp - delta[:, :, :, b0:b1])).astype(q.dtype)
        dqs.append(ds @ kb)
        # The query heads of one KV head share its keys: sum over them in the matmul.
        p2 = p.astype(q.dtype).reshape(b, groups, g * n, kend).swapaxes(-1, -2)
        ds2 = ds.reshape(b, groups, g * n, kend).swapaxes(-1, -2)
        dv = dv + _pad_keys(p2 @ dob.reshape(b, groups, g * n, -1), lk)
        dk = dk + _pad_keys(ds2 @ qb.reshape(b, groups, g * n, d), lk)
    dq = mx.concatenate(dqs, axis=3).reshape(b, heads, lq, d) * scale
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def attention(q, k, v, *, scale, mask=None, block=DEFAULT_BLOCK):
    """`mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)` in
    blocks of `block` queries, with a gradient that recomputes the scores.

    q `[B, Hq, Lq, D]`, k/v `[B, Hkv, Lk, D]` (Hq a multiple of Hkv); mask None,
    "causal" (query i sees keys up to i + Lk - Lq) or an array broadcastable to
    `[B, Hq, Lq, Lk]`, boolean (True: attend) or additive. The mask gets no gradient.
    Scores and softmax are float32 whatever the input dtype; the matmuls run in it.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of KV heads {k.shape[1]}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"mask: unknown {mask!r}")
    if isinstance(mask, mx.array):
        mask = _mask5(mask, q.shape[1], k.shape[1])

    @mx.custom_function
    def fn(q, k, v):
        return _forward(q, k, v, mask, scale, block)

    @fn.vjp
    def fn_vjp(primals, cotangents, outputs):
        q, k, v = primals
        o, lse = outputs
        return _backward(q, k, v, mask, scale, block, o, lse, cotangents[0])

    return fn(q, k, v)[0]


class routed:
    """Context manager: the attention of `model`'s layers runs through `attention`
    (in blocks of `block` queries) wherever the queries span more than one block.

    mlx-lm's attention modules call the `scaled_dot_product_attention` their
    module imported from `mlx_lm.models.base`; that name is swapped for the
    duration and restored after. Calls it cannot serve the same way (quantized KV
    caches, attention sinks) and short ones go to the original. `block=0` does nothing.
    """

    def __init__(self, model, block):
        self.block = block
        self.module = sys.modules.get(type(model).__module__)
        if block and not hasattr(self.module, "scaled_dot_product_attention"):
            raise ValueError(
                f"model: {type(model).__module__} has no scaled_dot_product_attention to route"
            )

    def __enter__(self):
        if not self.block:
            return self
        original = self.saved = self.module.scaled_dot_product_attention
        block = self.block

        def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
            if sinks is None and not hasattr(cache, "bits") and queries.shape[2] > block:
                return attention(queries, keys, values, scale=scale, mask=mask, block=block)
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

        self.module.scaled_dot_product_attention = sdpa
        return self

    def __exit__(self, *exc):
        if self.block:
            self.module.scaled_dot_product_attention = self.saved
        return False
