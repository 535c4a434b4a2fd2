"""Attention for training whose memory does not grow with the square of the length.

mlx-lm's layers call `mx.fast.scaled_dot_product_attention`; its gradient here
is that of the composed ops, which keep the `[B, heads, Lq, Lk]` scores and
several tensors of their size until the backward has used them. `attention`
computes the same function over blocks of queries: the forward keeps only the
output and each row's logsumexp, and its gradient (a custom VJP) recomputes one
block's scores at a time from q, k, v, the output and the logsumexp, the way
flash attention does. So at most one block's `[B, heads, block, Lk]` scores and
their gradient are alive at once.

Sliding-window layers: a query at position p sees only keys p - window + 1 .. p,
so with `window` each block computes scores over those keys only (at most
`window + block - 1` of them, rounded up to a multiple of `KEY_ALIGN`) instead of
all keys; see `attention` and `WindowMask`.

On NVIDIA GPUs each block's elementwise steps (mask, softmax, the scores'
gradient) run as one kernel each (`fused`) when the mask is causal, windowed
or absent.

`routed(model, block)` sends a model's attention calls through `attention` while
it is active (see `stats`).
"""

import sys

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from . import fused

# Queries per block. Larger blocks mean fewer, larger matmuls; the gradient's
# extra memory is that of about 8 float32 block-score arrays [B, heads, block, Lk]
# (q/k/v-sized arrays included; tests/stack/test_attention.py bounds it).
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


def _block_mask(mask, window, lq, lk, b0, b1, k0, k1):
    """The mask of queries [b0, b1) over keys [k0, k1): boolean (True: attend),
    additive, or None. `window` adds the band "key > position - window"."""
    off = lk - lq
    # Key positions; the band is needed only where some query of the block sees
    # fewer keys than [k0, k1) (its first visible key lies past k0).
    band = window is not None and b1 - 1 + off - window + 1 > k0
    causal = isinstance(mask, str)  # "causal", aligned at the last key as in MLX
    if not (causal or band):
        if mask is None:
            return None
        rows = mask[..., b0:b1, :] if mask.shape[-2] == lq else mask
        return rows[..., k0:k1] if mask.shape[-1] == lk else rows
    q = mx.arange(b0 + off, b1 + off)[:, None]
    k = mx.arange(k0, k1)[None]
    m = q >= k if causal else None
    if band:
        m = (q - k < window) if m is None else m & (q - k < window)
    if mask is None or causal:
        return m
    rows = mask[..., b0:b1, :] if mask.shape[-2] == lq else mask
    rows = rows[..., k0:k1] if mask.shape[-1] == lk else rows
    if rows.dtype == mx.bool_:
        return rows & m
    return mx.where(m, rows.astype(mx.float32), _NEG)


def _scores(qb, k, m):
    """float32 scores of a block: qb `[B, Hkv, g, n, D]` (scaled), k `[B, Hkv, 1, K, D]`."""
    s = (qb @ k.swapaxes(-1, -2)).astype(mx.float32)
    if m is None:
        return s
    if m.dtype == mx.bool_:
        return mx.where(m, s, _NEG)
    return s + m.astype(mx.float32)


def _kernels(kernels):
    """The `kernels` argument as a bool: None means where they run."""
    if kernels is None:
        return fused.available()
    if kernels not in (True, False):
        raise ValueError(f"kernels must be None, True or False, got {kernels!r}")
    if kernels and not fused.available():
        raise ValueError("kernels=True but the fused kernels need MLX's CUDA backend "
                         "as the default device")
    return kernels


def _fused(mask, kernels):
    # Masks made from positions only; an explicit mask array takes the MLX ops.
    return (mask is None or isinstance(mask, str)) and kernels


def _probs(qb, kb, mask, window, lq, lk, span, dtype, kernels):
    """`(p, lse)` of a block: probabilities in `dtype`, float32 row logsumexp."""
    b0, b1, k0, k1 = span
    if _fused(mask, kernels):
        return fused.softmax(
            qb @ kb.swapaxes(-1, -2), b0 + lk - lq, k0, isinstance(mask, str), window, dtype
        )
    s = _scores(qb, kb, _block_mask(mask, window, lq, lk, b0, b1, k0, k1))
    lse = mx.logsumexp(s, axis=-1, keepdims=True)
    return mx.exp(s - lse).astype(dtype), lse


def _score_grads(qb, kb, dob, vb, lse, delta, mask, window, lq, lk, span, kernels):
    """`(p, ds)` of a block in the queries' dtype: its probabilities and the
    gradient of its scores, `p * (dO V^T - delta)`."""
    b0, b1, k0, k1 = span
    if _fused(mask, kernels):
        return fused.score_grads(
            qb @ kb.swapaxes(-1, -2), dob @ vb.swapaxes(-1, -2), lse, delta,
            b0 + lk - lq, k0, isinstance(mask, str), window,
        )
    s = _scores(qb, kb, _block_mask(mask, window, lq, lk, b0, b1, k0, k1))
    p = mx.exp(s - lse)
    dp = (dob @ vb.swapaxes(-1, -2)).astype(mx.float32)
    return p.astype(qb.dtype), (p * (dp - delta)).astype(qb.dtype)


# A windowed block's key count is rounded up to a multiple of this (its first
# keys are masked): the scores' rows are then 16-byte aligned in bfloat16, which
# cuBLAS needs for its fast kernels (1023 keys took ones for unaligned rows).
KEY_ALIGN = 8


def spans(lq, lk, block, mask=None, window=None):
    """`(b0, b1, k0, k1)` per block: queries [b0, b1) and the keys [k0, k1) whose
    scores the block computes. Keys outside are masked for every query of the
    block: past the last query's position (causal) or at or before the first
    query's position minus `window` (k0 then moves back so that `k1 - k0` is a
    multiple of `KEY_ALIGN`; the keys it adds are masked)."""
    off = lk - lq
    out = []
    for b0 in range(0, lq, block):
        b1 = min(lq, b0 + block)
        k1 = min(lk, max(1, b1 + off)) if isinstance(mask, str) else lk
        k0 = 0 if window is None else min(k1 - 1, max(0, b0 + off - window + 1))
        k0 = max(0, k1 + (k0 - k1) // KEY_ALIGN * KEY_ALIGN)  # k1 - ceil to the multiple
        out.append((b0, b1, k0, k1))
    return out


def _forward(q, k, v, mask, window, scale, block, kernels):
    b, heads, lq, _ = q.shape
    groups, lk = k.shape[1], k.shape[2]
    qs = _grouped(q * scale, groups)
    k5, v5 = k[:, :, None], v[:, :, None]
    outs, lses = [], []
    for b0, b1, k0, k1 in spans(lq, lk, block, mask, window):
        qb = qs[:, :, :, b0:b1]
        if outs:  # one block at a time: the next starts after the last is done
            qb = mx.depends(qb, outs[-1])
        p, lse = _probs(qb, k5[:, :, :, k0:k1], mask, window, lq, lk, (b0, b1, k0, k1), v.dtype,
                        kernels)
        outs.append(p @ v5[:, :, :, k0:k1])
        lses.append(lse)
    o = mx.concatenate(outs, axis=3).reshape(b, heads, lq, v.shape[-1])
    return o, mx.concatenate(lses, axis=3)


def _add_keys(acc, x, k0):
    """`acc[:, :, k0:k0 + n] += x`: a block's gradient for the keys it saw."""
    n = x.shape[2]
    if n == acc.shape[2]:
        return acc + x
    part = acc[:, :, k0:k0 + n] + x
    return mx.slice_update(acc, part, mx.array([k0]), (2,))


def _backward(q, k, v, mask, window, scale, block, o, lse, do, kernels):
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
    for b0, b1, k0, k1 in spans(lq, lk, block, mask, window):
        n, kn = b1 - b0, k1 - k0
        qb, dob = qs[:, :, :, b0:b1], do5[:, :, :, b0:b1]
        if dqs:  # one block at a time, or the evaluation may keep every block alive
            qb = mx.depends(qb, [dqs[-1], dk, dv])
        kb, vb = k5[:, :, :, k0:k1], v5[:, :, :, k0:k1]
        p, ds = _score_grads(qb, kb, dob, vb, lse[:, :, :, b0:b1], delta[:, :, :, b0:b1],
                             mask, window, lq, lk, (b0, b1, k0, k1), kernels)
        dqs.append(ds @ kb)
        # The query heads of one KV head share its keys: sum over them in the matmul.
        p2 = p.reshape(b, groups, g * n, kn).swapaxes(-1, -2)
        ds2 = ds.reshape(b, groups, g * n, kn).swapaxes(-1, -2)
        dv = _add_keys(dv, p2 @ dob.reshape(b, groups, g * n, -1), k0)
        dk = _add_keys(dk, ds2 @ qb.reshape(b, groups, g * n, d), k0)
    dq = mx.concatenate(dqs, axis=3).reshape(b, heads, lq, d) * scale
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# Sliding-window layers: every block at once. A windowed block's keys are the
# `back` keys before its first query and its own `block`; for all blocks of a
# call those windows are views of one array at a stride of `block` keys, so one
# batched matmul computes every block's scores, one kernel their softmax, and the
# block loop's per-block matmuls, slices and updates (host work per kernel is
# most of a training step's time on a GPU) become a few ops per call.

# Blocks whose scores one batched call computes at most (elements of the
# `[B, Hq, blocks x block, keys]` scores): bounds the extra memory at long lengths.
MAX_WINDOW_SCORES = 1 << 26


def _reach(window, block):
    """Keys before its block that a block's window reaches, in whole blocks (see
    `_overlap_add`)."""
    return -(-(window - 1) // block) * block


class _Windows:
    """Geometry of a windowed call: `nb` blocks of `n` queries at positions
    off + j n + i; block j's keys are at first + j n + c for c < kw (those before
    position 0 are padding, masked). `key_start`: per batch row, the first key
    position it may see (None: 0 for every row)."""

    def __init__(self, lq, lk, block, window, key_start=None):
        self.window, self.key_start = window, key_start
        self.n = block
        self.back = _reach(window, block)
        self.kw = block + self.back
        self.nb = -(-lq // block)
        self.off = lk - lq
        self.first = self.off - self.back


def _batched_windows(lq, lk, block, mask, window):
    """Whether a call takes the batched windows: a causal window that leaves out
    keys, over more than one block."""
    if not (isinstance(mask, str) and window is not None and lq > block):
        return False
    return block + _reach(window, block) < lk


def _blocked(x, g, groups):
    """`[B, Hq, L, .]` -> `[B, Hkv, nb, g n, .]`: a block's rows by (query head, query)."""
    b, h, l, d = x.shape
    if g.nb * g.n != l:
        x = mx.pad(x, [(0, 0), (0, 0), (0, g.nb * g.n - l), (0, 0)])
    x = x.reshape(b, groups, h // groups, g.nb, g.n, d).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, groups, g.nb, (h // groups) * g.n, d)


def _unblocked(x, g, heads, lq):
    b, groups, nb, _, d = x.shape
    x = x.reshape(b, groups, nb, heads // groups, g.n, d).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, heads, nb * g.n, d)[:, :, :lq]


def _gathered(x, g):
    """Block j's keys `[B, Hkv, nb, kw, D]` of `x` `[B, Hkv, Lk, D]` (a strided view)."""
    front = max(0, -g.first)
    back = max(0, g.first + (g.nb - 1) * g.n + g.kw - x.shape[2])
    if front or back:
        x = mx.pad(x, [(0, 0), (0, 0), (front, back), (0, 0)])
    b, h, lp, d = x.shape
    return mx.as_strided(x, (b, h, g.nb, g.kw, d), (h * lp * d, lp * d, g.n * d, d, 1),
                         (g.first + front) * d)


def _overlap_add(xw, g, lk):
    """float32 `[B, Hkv, Lk, D]`: the sum of each key's rows in the windows
    `xw` `[B, Hkv, nb, kw, D]` (kw = r whole blocks: piece t of window j is key
    block j + t from `first`)."""
    b, h, nb, kw, d = xw.shape
    r = kw // g.n
    pieces = xw.astype(mx.float32).reshape(b, h, nb, r, g.n, d)
    acc = None
    for t in range(r):
        part = mx.pad(pieces[:, :, :, t], [(0, 0), (0, 0), (t, r - 1 - t), (0, 0), (0, 0)])
        acc = part if acc is None else acc + part
    acc = acc.reshape(b, h, (nb + r - 1) * g.n, d)
    lo, hi = g.first, g.first + acc.shape[2]
    acc = acc[:, :, max(0, -lo):acc.shape[2] - max(0, hi - lk)]
    if lo > 0 or hi < lk:
        acc = mx.pad(acc, [(0, 0), (0, 0), (max(0, lo), max(0, lk - hi)), (0, 0)])
    return acc


def _window_mask(g):
    """`[nb, 1, n, kw]` visibility of the batched windows (MLX-op path), or
    `[B, 1, nb, 1, n, kw]` with per-row `key_start`."""
    j = mx.arange(g.nb)[:, None, None, None]
    q = g.off + j * g.n + mx.arange(g.n)[:, None]
    k = g.first + j * g.n + mx.arange(g.kw)[None]
    seen = (k <= q) & (q - k < g.window)
    if g.key_start is None:
        return seen & (k >= 0)
    return seen & (k >= mx.array(g.key_start).reshape(-1, 1, 1, 1, 1, 1))


def _masked6(s, g):
    b, h, nb, rows, kw = s.shape
    s6 = s.astype(mx.float32).reshape(b, h, nb, rows // g.n, g.n, kw)
    return mx.where(_window_mask(g), s6, _NEG).reshape(s.shape)


def _kernel_args(g, rows):
    return dict(q_start=g.off, k_start=g.first, causal=True, window=g.window,
                blocks=(g.n, rows, g.nb, g.n), key_start=g.key_start)


def _window_forward(q, k, v, scale, block, window, kernels, key_start=None):
    b, heads, lq, _ = q.shape
    groups, lk = k.shape[1], k.shape[2]
    g = _Windows(lq, lk, block, window, key_start)
    qb = _blocked(q * scale, g, groups)
    kw, vw = _gathered(k, g), _gathered(v, g)
    if kernels:
        p, lse = fused.softmax(qb @ kw.swapaxes(-1, -2), dtype=v.dtype, **_kernel_args(g, qb.shape[3]))
    else:
        s = _masked6(qb @ kw.swapaxes(-1, -2), g)
        lse = mx.logsumexp(s, axis=-1, keepdims=True)
        p = mx.exp(s - lse).astype(v.dtype)
    return _unblocked(p @ vw, g, heads, lq), lse


def _window_backward(q, k, v, o, lse, do, scale, block, window, kernels, key_start=None):
    b, heads, lq, _ = q.shape
    groups, lk = k.shape[1], k.shape[2]
    g = _Windows(lq, lk, block, window, key_start)
    qb = _blocked(q * scale, g, groups)
    dob = _blocked(do.astype(q.dtype), g, groups)
    delta = _blocked((do.astype(mx.float32) * o.astype(mx.float32)).sum(-1, keepdims=True), g, groups)
    kw, vw = _gathered(k, g), _gathered(v, g)
    s, dp = qb @ kw.swapaxes(-1, -2), dob @ vw.swapaxes(-1, -2)
    if kernels:
        p, ds = fused.score_grads(s, dp, lse, delta, **_kernel_args(g, qb.shape[3]))
    else:
        p = mx.exp(_masked6(s, g) - lse)
        ds = (p * (dp.astype(mx.float32) - delta)).astype(q.dtype)
        p = p.astype(q.dtype)
    dq = _unblocked(ds @ kw, g, heads, lq) * scale
    # The query heads of one KV head share its keys: the matmuls sum over them.
    dk = _overlap_add(ds.swapaxes(-1, -2) @ qb, g, lk)
    dv = _overlap_add(p.swapaxes(-1, -2) @ dob, g, lk)
    return dq, dk, dv


def _window_chunks(q, k, block, window):
    """`(q0, q1, k0, k1)`: the calls of at most MAX_WINDOW_SCORES scores each,
    queries [q0, q1) over the keys [k0, k1) their windows reach."""
    b, heads, lq, _ = q.shape
    lk = k.shape[2]
    g = _Windows(lq, lk, block, window)
    per = max(1, MAX_WINDOW_SCORES // (b * heads * block * g.kw))
    out = []
    for j0 in range(0, g.nb, per):
        q0, q1 = j0 * block, min(lq, (j0 + per) * block)
        out.append((q0, q1, max(0, g.off + q0 - g.back), g.off + q1))
    return out


def _windowed(q, k, v, window, scale, block, kernels, key_start=None):
    """`attention` of a causal window, its blocks batched (see `_Windows`)."""
    chunks = _window_chunks(q, k, block, window)
    lk = k.shape[2]

    def keys(x, k1):
        return x if k1 == lk else x[:, :, :k1]

    @mx.custom_function
    def fn(q, k, v):
        outs, lses = [], []
        for q0, q1, _, k1 in chunks:
            qc = q[:, :, q0:q1]
            if outs:  # one call at a time, as the blocks of `_forward`
                qc = mx.depends(qc, outs[-1])
            o, lse = _window_forward(qc, keys(k, k1), keys(v, k1), scale, block, window, kernels,
                                     key_start)
            outs.append(o)
            lses.append(lse)
        if len(outs) == 1:
            return outs[0], lses[0]
        return mx.concatenate(outs, axis=2), mx.concatenate(lses, axis=2)

    @fn.vjp
    def fn_vjp(primals, cotangents, outputs):
        q, k, v = primals
        o, lse = outputs
        do = cotangents[0]
        dqs, dk, dv, j = [], None, None, 0
        for q0, q1, _, k1 in chunks:
            nb = -(-(q1 - q0) // block)
            qc = q[:, :, q0:q1]
            if dqs:
                qc = mx.depends(qc, [dqs[-1], dk, dv])
            dq, dkc, dvc = _window_backward(
                qc, keys(k, k1), keys(v, k1), o[:, :, q0:q1], lse[:, :, j:j + nb],
                do[:, :, q0:q1], scale, block, window, kernels, key_start,
            )
            j += nb
            dqs.append(dq)
            if k1 < lk:
                dkc, dvc = (mx.pad(x, [(0, 0), (0, 0), (0, lk - k1), (0, 0)]) for x in (dkc, dvc))
            dk, dv = (dkc, dvc) if dk is None else (dk + dkc, dv + dvc)
        dq = dqs[0] if len(dqs) == 1 else mx.concatenate(dqs, axis=2)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    return fn(q, k, v)[0]


def attention(q, k, v, *, scale, mask=None, block=DEFAULT_BLOCK, window=None, kernels=None,
              batch_windows=True):
    """`mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)` in
    blocks of `block` queries, with a gradient that recomputes the scores.

    q `[B, Hq, Lq, D]`, k/v `[B, Hkv, Lk, D]` (Hq a multiple of Hkv); mask None,
    "causal" (query i sees keys up to i + Lk - Lq) or an array broadcastable to
    `[B, Hq, Lq, Lk]`, boolean (True: attend) or additive. The mask gets no gradient.
    `window` (optional) masks in addition every key at or before the query's
    position (i + Lk - Lq) minus `window`, as mlx-lm's sliding-window masks do:
    `mask="causal", window=w` is `mask=create_causal_mask(Lq, Lk - Lq, window_size=w)`,
    and each block then computes the scores of at most `w + block - 1` keys
    (rounded up to a multiple of `KEY_ALIGN`). A `WindowMask` mask
    (`window_mask`) is taken that way.
    Scores and softmax are float32 whatever the input dtype; the matmuls run in it.
    `kernels`: None uses the softmax kernels of `fused` where they run (MLX's
    CUDA backend), False MLX's ops, True the kernels (an error where they do
    not run). `batch_windows=False` takes the block loop for sliding windows too.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of KV heads {k.shape[1]}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if window is not None and window < 1:
        raise ValueError(f"window must be None or >= 1, got {window}")
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"mask: unknown {mask!r}")
    kernels = _kernels(kernels)
    if window is None:
        mask, window = _as_window(mask, q.shape[2], k.shape[2])
    if batch_windows and _batched_windows(q.shape[2], k.shape[2], block, mask, window):
        return _windowed(q, k, v, window, scale, block, kernels)
    if isinstance(mask, mx.array):
        mask = _mask5(mask, q.shape[1], k.shape[1])

    @mx.custom_function
    def fn(q, k, v):
        return _forward(q, k, v, mask, window, scale, block, kernels)

    @fn.vjp
    def fn_vjp(primals, cotangents, outputs):
        q, k, v = primals
        o, lse = outputs
        return _backward(q, k, v, mask, window, scale, block, o, lse, cotangents[0], kernels)

    return fn(q, k, v)[0]


class WindowMask(mx.array):
    """mlx-lm's sliding-window causal mask that also says how it was built.

    An ordinary boolean array (mlx-lm's layers and attention use it as such) with
    `offset` and `window`: `create_causal_mask(n, offset, window_size=window)`.
    `attention` takes such a mask as `mask="causal", window=window`, which is the
    same mask, so each block skips the keys outside its window.

    Why not read the key range off the mask array itself: that needs its values
    on the host (an evaluation per layer call, and none at all inside
    `mx.compile`); the window is known in Python where the mask is built, and
    carrying it costs nothing. A mask that is not a `WindowMask` (or whose shape
    does not match the call) keeps every key, so this is exact by construction.
    """


def window_mask(n, offset, window):
    """`create_causal_mask(n, offset, window_size=window)` as a `WindowMask`."""
    m = WindowMask(create_causal_mask(n, offset, window_size=window))
    m.offset, m.window = offset, window
    return m


def _as_window(mask, lq, lk):
    """`("causal", window)` for a `WindowMask` built for `lq` queries over `lk`
    keys; `(mask, None)` for anything else."""
    if (
        isinstance(mask, WindowMask)
        and tuple(mask.shape) == (lq, lk)
        and getattr(mask, "offset", None) == lk - lq
        and getattr(mask, "window", None)
    ):
        return "causal", mask.window
    return mask, None


def causal_mask(n, offset, window):
    """Mask for `n` queries at positions offset.. over `offset + n` keys (mlx-lm's;
    a sliding window's is a `WindowMask`, which the blocked attention can skip by)."""
    if window is None or offset + n <= window:
        return "causal" if n > 1 else None
    return window_mask(n, offset, window)


class PackedMask:
    """The mask of a packed prefix batch (see `prefix`): row 0 holds a prompt of
    `prompt_len` tokens at positions 0.., every other row a continuation of it at
    positions prompt_len.. . Row 0 attends causally to itself; each other row to
    the prompt's keys (row 0's first `prompt_len`) and causally to its own.
    `window`: a sliding-window layer's window (None: global).

    Only `routed`'s attention understands it: mlx-lm's layers pass masks through
    untouched, and the routed call splits the rows into two ordinary calls, or,
    for a sliding window over more than one block, makes one batched-window call
    of every row over the prompt's last keys and its own (`_packed_windows`).
    """

    def __init__(self, prompt_len, window):
        self.prompt_len, self.window = prompt_len, window
        self.masks = {}  # width -> the two rows' masks, built once for every layer

    def _masks(self, n):
        if n not in self.masks:
            self.masks[n] = (causal_mask(n, 0, self.window),
                             causal_mask(n, self.prompt_len, self.window))
        return self.masks[n]

    def attend(self, q, k, v, scale, sdpa, block=None, batch_windows=True):
        """Attention of the packed rows through `sdpa(q, k, v, cache, scale, mask)`
        (or, unless `batch_windows` is False, the batched windows, with `block`
        queries a block)."""
        p, n = self.prompt_len, q.shape[2]
        if batch_windows and block and self.window and n > block:
            return self._packed_windows(q, k, v, scale, block)
        head_mask, rest_mask = self._masks(n)
        head = sdpa(q[:1], k[:1], v[:1], None, scale, head_mask)

        def with_prompt(x):
            rows, heads, _, dim = x.shape
            prompt = mx.broadcast_to(x[:1, :, :p], (rows - 1, heads, p, dim))
            return mx.concatenate([prompt, x[1:]], axis=2)

        rest = sdpa(q[1:], with_prompt(k), with_prompt(v), None, scale, rest_mask)
        return mx.concatenate([head, rest], axis=0)

    def _packed_windows(self, q, k, v, scale, block):
        # Every row's keys get the prompt's last `back` keys in front: the keys the
        # continuations' windows reach before their own. Row 0 (the prompt) masks
        # them (key_start), so one call serves all rows, where the split above
        # makes two calls and copies the whole prompt's keys for each continuation.
        p, window = self.prompt_len, self.window
        back = _reach(window, block)
        rows = q.shape[0]

        def extended(x):
            tail = x[:1, :, max(0, p - back):p]
            if tail.shape[2] < back:  # a prompt shorter than the window: padding, masked
                tail = mx.pad(tail, [(0, 0), (0, 0), (back - tail.shape[2], 0), (0, 0)])
            return mx.concatenate([mx.broadcast_to(tail, (rows,) + tail.shape[1:]), x], axis=2)

        starts = [back] + [max(0, back - p)] * (rows - 1)
        return _windowed(q, extended(k), extended(v), window, scale, block, fused.available(),
                         starts)


def _module_of(model):
    # mlx-lm's attention modules call the `scaled_dot_product_attention` of the
    # module that defines the model class.
    return sys.modules.get(type(model).__module__)


class routed:
    """Context manager: the attention of `model`'s layers runs through `attention`
    (in blocks of `block` queries) wherever the queries span more than one block,
    and packed prefix batches (`PackedMask`) are attended to row by row.

    mlx-lm's attention modules call the `scaled_dot_product_attention` their
    module imported from `mlx_lm.models.base`; that name is swapped for the
    duration and restored after. Sliding-window layers get a `WindowMask` (see
    `causal_mask`), so they compute only the scores inside their window.
    Calls it cannot serve the same way (quantized KV caches, attention
    sinks) and short ones go to the original; with `block=0`, all but the packed.
    """

    def __init__(self, model, block):
        self.block = block
        self.module = _module_of(model)
        if not hasattr(self.module, "scaled_dot_product_attention"):
            raise ValueError(
                f"model: {type(model).__module__} has no scaled_dot_product_attention to route"
            )

    def __enter__(self):
        original = self.saved = self.module.scaled_dot_product_attention
        block = self.block

        def plain(queries, keys, values, cache, scale, mask, sinks=None):
            if (block and sinks is None and not hasattr(cache, "bits")
                    and queries.shape[2] > block):
                return attention(queries, keys, values, scale=scale, mask=mask, block=block)
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

        def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
            if isinstance(mask, PackedMask):
                return mask.attend(queries, keys, values, scale, plain, block)
            return plain(queries, keys, values, cache, scale, mask, sinks)

        sdpa.packs, sdpa.block = True, block
        self.module.scaled_dot_product_attention = sdpa
        return self

    def __exit__(self, *exc):
        self.module.scaled_dot_product_attention = self.saved
        return False


def packs(model):
    """Whether `model`'s attention calls take `PackedMask`s now (inside `routed`)."""
    sdpa = getattr(_module_of(model), "scaled_dot_product_attention", None)
    return getattr(sdpa, "packs", False)


def routed_block(model):
    """The block size `routed` runs `model`'s attention with now (None: not routed)."""
    sdpa = getattr(_module_of(model), "scaled_dot_product_attention", None)
    return getattr(sdpa, "block", None)
