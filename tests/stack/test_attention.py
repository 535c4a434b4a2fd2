"""Blocked training attention equals plain attention; its gradient's memory is linear."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base, gemma3_text
from mlx_lm.models.base import create_causal_mask

import flash_cce.stack.attention as attn
from flash_cce.stack.attention import PackedMask, KEY_ALIGN, WindowMask, attention, routed, spans, window_mask
from flash_cce.stack import StackConfig
from flash_cce.train.objectives import value_and_grad
from models import ARCHS, max_diff, objective, random_pair, tiny_model


def composed(q, k, v, scale, mask):
    """The textbook attention in float32 ops: scores, mask, softmax, values."""
    q, k, v = (x.astype(mx.float32) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    s = (q * scale) @ k.swapaxes(-1, -2)
    lq, lk = s.shape[-2:]
    if isinstance(mask, str):
        mask = mx.arange(lk - lq, lk)[:, None] >= mx.arange(lk)[None]
    if mask is not None:
        s = mx.where(mask, s, -mx.inf) if mask.dtype == mx.bool_ else s + mask
    return mx.softmax(s, axis=-1) @ v


# (batch, query heads, KV heads, queries, keys, mask); block 8 in the tests.
CASES = {
    "causal": (2, 4, 4, 40, 40, "causal"),
    "causal_gqa_ragged": (2, 4, 2, 37, 37, "causal"),  # 37 = 4 blocks + 5
    "continuation": (2, 4, 1, 21, 50, "causal"),  # queries at positions 29..49
    "window": (1, 2, 1, 33, 33, create_causal_mask(33, 0, window_size=5)),
    "window_continuation": (2, 4, 2, 19, 40, create_causal_mask(19, 21, window_size=7)),
    "no_mask": (1, 4, 2, 30, 45, None),
    "additive_per_head": (2, 4, 2, 20, 20, "additive"),
}


def _inputs(case, dtype, seed=0):
    b, hq, hkv, lq, lk, mask = CASES[case]
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    if isinstance(mask, str) and mask == "additive":
        mask = mx.array(rng.standard_normal((b, hq, lq, lk)).astype(np.float32))
    d = 16
    return normal(b, hq, lq, d), normal(b, hkv, lk, d), normal(b, hkv, lk, d), normal(b, hq, lq, d), mask


def _value_and_grads(fn, q, k, v, c):
    loss = lambda q, k, v: (fn(q, k, v).astype(mx.float32) * c.astype(mx.float32)).sum()
    out = fn(q, k, v)
    return [out] + list(mx.grad(loss, argnums=(0, 1, 2))(q, k, v))


def _rel_err(got, want):
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return float(mx.abs(got - want).max()) / max(1.0, float(mx.abs(want).max()))


@pytest.mark.parametrize("case", sorted(CASES))
def test_float32_equals_composed(case):
    q, k, v, c, mask = _inputs(case, mx.float32)
    got = _value_and_grads(lambda q, k, v: attention(q, k, v, scale=0.3, mask=mask, block=8), q, k, v, c)
    want = _value_and_grads(lambda q, k, v: composed(q, k, v, 0.3, mask), q, k, v, c)
    # Both sum the same float32 products in other orders (blocks, the backward's
    # row sum from dO.O rather than P.dP); measured <= 5e-7 of the largest entry.
    # 2e-5 is ~170 float32 epsilons; a wrong mask, offset or block edge is >= 1e-2.
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert _rel_err(g, w) <= 2e-5, (name, _rel_err(g, w))


@pytest.mark.parametrize("case", sorted(CASES))
def test_bfloat16_as_accurate_as_mlx(case):
    """In bfloat16 the blocked attention is compared with the exact (float32)
    attention of the same bfloat16 inputs, next to MLX's own bfloat16 attention."""
    q, k, v, c, mask = _inputs(case, mx.bfloat16)
    exact = _value_and_grads(lambda q, k, v: composed(q, k, v, 0.3, mask), q, k, v, c)
    got = _value_and_grads(lambda q, k, v: attention(q, k, v, scale=0.3, mask=mask, block=8), q, k, v, c)
    mlx_mask = mask.astype(mx.bfloat16) if isinstance(mask, mx.array) and mask.dtype != mx.bool_ else mask
    mlx = _value_and_grads(
        lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mlx_mask),
        q, k, v, c,
    )
    for name, g, m, e in zip(("out", "dq", "dk", "dv"), got, mlx, exact):
        assert g.dtype == mx.bfloat16
        # Outputs and gradients are rounded to bfloat16 (2^-8 relative) and the
        # matmuls take bfloat16 operands, as in MLX's own path: the error may be
        # a few bfloat16 roundings, and must not exceed MLX's own by more than 2x.
        err, ref_err = _rel_err(g, e), _rel_err(m, e)
        assert err <= max(2 * ref_err, 4 * 2.0**-8), (name, err, ref_err)


def test_block_larger_than_queries_and_errors():
    q, k, v, c, mask = _inputs("continuation", mx.float32)
    one = attention(q, k, v, scale=0.3, mask=mask, block=1000)
    assert _rel_err(one, composed(q, k, v, 0.3, mask)) <= 2e-5
    with pytest.raises(ValueError, match="multiple"):
        k2, v2 = mx.concatenate([k, k], axis=1), mx.concatenate([v, v], axis=1)
        attention(q[:, :3], k2, v2, scale=0.3)  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError, match="block"):
        attention(q, k, v, scale=0.3, block=0)
    with pytest.raises(ValueError, match="attention_block"):
        StackConfig(attention_block=-1).validate()


# (batch, query heads, KV heads, queries, keys, window, block): sliding windows.
WINDOWS = {
    "window_lt_block": (1, 2, 1, 40, 40, 5, 16),
    "window_gt_block": (2, 4, 2, 45, 45, 20, 8),  # GQA, 20 = 2.5 blocks
    "window_multiple_of_block": (1, 4, 4, 48, 48, 16, 8),
    "window_continuation": (2, 4, 1, 19, 60, 7, 8),  # queries at positions 41..59
    "window_continuation_gt_block": (1, 4, 2, 30, 70, 25, 8),
    "window_covers_all_keys": (1, 2, 1, 20, 30, 40, 8),  # nothing to skip
}


def _window_inputs(case, seed=0):
    b, hq, hkv, lq, lk, w, block = WINDOWS[case]
    rng = np.random.default_rng(seed)
    normal = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))
    d = 16
    q, k, v, c = normal(b, hq, lq, d), normal(b, hkv, lk, d), normal(b, hkv, lk, d), normal(b, hq, lq, d)
    return q, k, v, c, lq, lk, w, block


@pytest.mark.parametrize("case", sorted(WINDOWS))
def test_window_restriction_is_exact(case):
    """Blocks that compute only their window's keys give what blocks over every
    key give (the same mask as a plain array) and the textbook attention."""
    q, k, v, c, lq, lk, w, block = _window_inputs(case)
    plain = create_causal_mask(lq, lk - lq, window_size=w)  # a plain array: every key
    tagged = window_mask(lq, lk - lq, w)
    assert isinstance(tagged, WindowMask) and mx.array_equal(tagged, plain)
    full = _value_and_grads(lambda q, k, v: attention(q, k, v, scale=0.3, mask=plain, block=block), q, k, v, c)
    want = _value_and_grads(lambda q, k, v: composed(q, k, v, 0.3, plain), q, k, v, c)
    for mask, window in ((tagged, None), ("causal", w), (plain, w)):
        got = _value_and_grads(
            lambda q, k, v: attention(q, k, v, scale=0.3, mask=mask, block=block, window=window),
            q, k, v, c,
        )
        # The restricted and the unrestricted blocks add the same nonzero terms (a
        # masked score's exp is exactly 0), only over shorter rows: measured equal
        # bit for bit on the CPU; 2e-6 (~17 float32 epsilons) leaves room for
        # reductions grouped by row length. Against the textbook attention the
        # bound of test_float32_equals_composed holds (measured <= 4.5e-7).
        for name, g, f, x in zip(("out", "dq", "dk", "dv"), got, full, want):
            assert _rel_err(g, f) <= 2e-6, (name, window, _rel_err(g, f))
            assert _rel_err(g, x) <= 2e-5, (name, window, _rel_err(g, x))


@pytest.mark.parametrize("additive", (False, True))
def test_window_with_other_masks(additive):
    """`window` adds its band to any mask: None, boolean or additive arrays."""
    q, k, v, c, lq, lk, w, block = _window_inputs("window_continuation_gt_block")
    rng = np.random.default_rng(3)
    if additive:
        mask = mx.array(rng.standard_normal((1, 4, lq, lk)).astype(np.float32))
    else:  # random, but every row keeps its own key so no row is fully masked
        mask = mx.array(rng.random((1, 1, lq, lk)) < 0.5) | create_causal_mask(lq, lk - lq, window_size=1)
    band = create_causal_mask(lq, lk - lq, window_size=w) | (mx.arange(lk)[None] > mx.arange(lk - lq, lk)[:, None])
    both = mx.where(band, mask, -mx.inf) if additive else mask & band
    for m in (mask, None):
        ref = both if m is not None else band
        got = _value_and_grads(lambda q, k, v: attention(q, k, v, scale=0.3, mask=m, block=block, window=w), q, k, v, c)
        want = _value_and_grads(lambda q, k, v: composed(q, k, v, 0.3, ref), q, k, v, c)
        for name, g, x in zip(("out", "dq", "dk", "dv"), got, want):
            assert _rel_err(g, x) <= 2e-5, (name, m is None, _rel_err(g, x))


def test_window_mask_only_where_it_fits():
    """A WindowMask for another shape or offset is used as a plain array (all keys).
    MLX's ops and the block loop: keys counted in `_scores`."""
    q, k, v, c, lq, lk, w, block = _window_inputs("window_continuation")
    loop = dict(kernels=False, batch_windows=False)
    seen = []
    real = attn._scores
    try:
        attn._scores = lambda qb, kb, m: seen.append(kb.shape[-2]) or real(qb, kb, m)
        wrong = window_mask(lq, lk - lq, w)
        wrong.offset = lk - lq - 1  # says another offset than the call's
        attention(q, k, v, scale=0.3, mask=wrong, block=block, **loop)
        assert set(seen) == {lk}
        seen.clear()
        attention(q, k, v, scale=0.3, mask=window_mask(lq, lk - lq, w), block=block, **loop)
        assert max(seen) <= w + block - 1 + KEY_ALIGN - 1 < lk
    finally:
        attn._scores = real
    with pytest.raises(ValueError, match="window"):
        attention(q, k, v, scale=0.3, window=0)


def test_window_key_columns():
    """The work saved, counted: the key columns of the scores the blocks compute
    (forward and backward) at model A/B's window 512 and block 512 on 8192 tokens.
    Each block sees at most window + block - 1 keys rounded up to a multiple of
    KEY_ALIGN (aligned rows for cuBLAS), whatever the length (the block loop; the
    batched windows: `test_batched_windows_key_columns`)."""
    n, w, block = 8192, 512, 512
    windowed = spans(n, n, block, "causal", w)
    causal = spans(n, n, block, "causal")
    assert all(k1 - k0 <= w + block - 1 + KEY_ALIGN - 1 for _, _, k0, k1 in windowed)
    assert all((k1 - k0) % KEY_ALIGN == 0 for _, _, k0, k1 in windowed)
    cols = lambda s: sum((b1 - b0) * (k1 - k0) for b0, b1, k0, k1 in s)
    # 16 blocks of 512 queries over 512, then 15 x 1024 keys, against 512 x
    # (1 + 2 + ... + 16) for causal blocks over every earlier key: 4.4x fewer
    # (and the gap grows with the length: the windowed count is linear in it).
    assert cols(windowed) == 512 * (512 + 15 * 1024)
    assert cols(causal) == 512 * 512 * 136
    assert cols(causal) / cols(windowed) > 4.3

    # The same count from the computation itself (small sizes: 8 blocks of 8).
    q, k, v, c, *_ = _window_inputs("window_lt_block")
    seen = []
    real = attn._scores
    try:
        attn._scores = lambda qb, kb, m: seen.append(kb.shape[-2]) or real(qb, kb, m)
        # MLX's ops and the block loop: keys counted in `_scores`
        mx.eval(mx.grad(lambda q: (attention(q, k, v, scale=0.3, mask=window_mask(40, 0, 5), block=8,
                                             kernels=False, batch_windows=False) * c).sum())(q))
    finally:
        attn._scores = real
    expect = [k1 - k0 for *_, k0, k1 in spans(40, 40, 8, "causal", 5)]
    assert seen == expect * 2  # forward, then backward
    assert expect == [8, 16, 16, 16, 16]  # 12 keys a block, rounded up to KEY_ALIGN = 8



# More windowed calls for the batched windows: lengths that are no multiple of
# the block, long prompts before the queries, windows of many blocks.
BATCHED = dict(WINDOWS, **{
    "ragged_queries": (2, 4, 1, 45, 45, 9, 8),  # 6 blocks, the last of 5 queries
    "long_prompt": (2, 8, 1, 24, 96, 8, 8),  # queries at 72..95, keys before 56 unseen
    "window_of_many_blocks": (1, 2, 1, 64, 64, 30, 8),  # 3 blocks back (kw = 32)
    "window_plus_one": (1, 4, 2, 40, 40, 9, 8),  # 9 = one block and one key
})


@pytest.mark.parametrize("chunked", (False, True))
@pytest.mark.parametrize("case", sorted(BATCHED))
def test_batched_windows_equal_block_loop(case, chunked, monkeypatch):
    """Every block's window at once (one strided view of the keys, one matmul)
    gives what the block loop gives, forward and gradients, also split into
    calls of a few blocks (MAX_WINDOW_SCORES) and with padded key windows at the
    start of the sequence."""
    if case in WINDOWS:
        q, k, v, c, lq, lk, w, block = _window_inputs(case)
    else:
        b, hq, hkv, lq, lk, w, block = BATCHED[case]
        rng = np.random.default_rng(5)
        normal = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))
        q, k, v, c = normal(b, hq, lq, 16), normal(b, hkv, lk, 16), normal(b, hkv, lk, 16), normal(b, hq, lq, 16)
    if chunked:  # two blocks a call
        monkeypatch.setattr(attn, "MAX_WINDOW_SCORES", 2 * q.shape[0] * q.shape[1] * block * attn._Windows(lq, lk, block, w).kw)
    calls = []
    real = attn._window_forward
    monkeypatch.setattr(attn, "_window_forward", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    run = lambda batch=True: _value_and_grads(
        lambda q, k, v: attention(q, k, v, scale=0.3, mask=window_mask(lq, lk - lq, w), block=block,
                                  batch_windows=batch), q, k, v, c)
    got = run()
    batched = attn._batched_windows(lq, lk, block, "causal", w)
    assert bool(calls) == batched, (calls, batched)
    if batched:
        per_run = -(-lq // (2 * block)) if chunked else 1
        assert sum(calls) == 2 * lq and len(calls) == 2 * per_run  # output, then gradients
    loop = run(batch=False)
    want = _value_and_grads(
        lambda q, k, v: composed(q, k, v, 0.3, create_causal_mask(lq, lk - lq, window_size=w)), q, k, v, c)
    # The same nonzero terms as the block loop (masked scores' exp is exactly 0),
    # over rows of another length and grouped otherwise in the key gradients
    # (window pieces added once more): within the bounds of
    # test_window_restriction_is_exact.
    for name, g, f, x in zip(("out", "dq", "dk", "dv"), got, loop, want):
        assert _rel_err(g, f) <= 2e-6, (name, _rel_err(g, f))
        assert _rel_err(g, x) <= 2e-5, (name, _rel_err(g, x))


def test_batched_windows_key_columns(monkeypatch):
    """The batched windows compute, for each block, its block and the whole
    blocks before it that its window reaches: 2 x 512 keys at models A/B's window
    512 and block 512, as many as the block loop's aligned spans; and which calls
    take them (a window that hides no key does not)."""
    g = attn._Windows(8192, 8192, 512, 512)
    assert (g.kw, g.nb, g.back) == (1024, 16, 512)
    assert max(k1 - k0 for *_, k0, k1 in spans(8192, 8192, 512, "causal", 512)) == g.kw
    assert attn._batched_windows(8192, 8192, 512, "causal", 512)
    assert not attn._batched_windows(512, 512, 512, "causal", 100)  # one block
    assert not attn._batched_windows(1024, 1024, 512, "causal", 600)  # 512 + 1024 keys >= all
    assert not attn._batched_windows(8192, 8192, 512, "causal", None)
    assert not attn._batched_windows(8192, 8192, 512, None, 512)  # not causal
    shapes = []
    real = attn._masked6
    monkeypatch.setattr(attn, "_masked6", lambda s, g: shapes.append(s.shape) or real(s, g))
    q, k, v, c, *_ = _window_inputs("window_lt_block")  # 40 queries, window 5, block 8
    mx.eval(mx.grad(lambda q: (attention(q, k, v, scale=0.3, mask=window_mask(40, 0, 5), block=8,
                                         kernels=False) * c).sum())(q))  # MLX's ops: `_masked6`
    # forward and backward: [B, Hkv, 5 blocks, 2 heads x 8 queries, 8 + 8 keys]
    assert shapes == [(1, 1, 5, 16, 16)] * 2


@pytest.mark.parametrize("prompt_len", (5, 20))
def test_packed_windows_equal_split_rows(prompt_len, monkeypatch):
    """A packed prefix batch's sliding-window layer in one batched call (every
    row over the prompt's last keys and its own; the prompt row masks the former)
    gives what the two calls of the split rows give, and the textbook attention
    of each row; with a prompt shorter (5) and longer (20) than the 8 keys the
    windows reach back."""
    rng = np.random.default_rng(7)
    normal = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))
    n, w, block = 24, 7, 8
    q, k, v, c = normal(3, 4, n, 16), normal(3, 1, n, 16), normal(3, 1, n, 16), normal(3, 4, n, 16)
    calls = []
    real = attn.PackedMask._packed_windows
    monkeypatch.setattr(attn.PackedMask, "_packed_windows", lambda *a: calls.append(1) or real(*a))

    def run(batch):
        def sdpa(q, k, v, cache, scale, mask):
            return attention(q, k, v, scale=scale, mask=mask, block=block, batch_windows=batch)
        return _value_and_grads(
            lambda q, k, v: PackedMask(prompt_len, w).attend(q, k, v, 0.3, sdpa, block,
                                                             batch_windows=batch), q, k, v, c)

    got = run(True)
    assert len(calls) == 2  # output, gradients
    split = run(False)
    assert len(calls) == 2

    def textbook(q, k, v):
        p = prompt_len
        head = composed(q[:1], k[:1], v[:1], 0.3, create_causal_mask(n, 0, window_size=w))
        keys = lambda x: mx.concatenate([mx.broadcast_to(x[:1, :, :p], (2,) + x.shape[1:2] + (p, 16)), x[1:]], axis=2)
        rest = composed(q[1:], keys(k), keys(v), 0.3, create_causal_mask(n, p, window_size=w))
        return mx.concatenate([head, rest], axis=0)

    want = _value_and_grads(textbook, q, k, v, c)
    for name, g, s, x in zip(("out", "dq", "dk", "dv"), got, split, want):
        assert _rel_err(g, s) <= 2e-6, (name, _rel_err(g, s))  # as test_batched_windows_equal_block_loop
        assert _rel_err(g, x) <= 2e-5, (name, _rel_err(g, x))

def _grad_peak(fn, n, heads=4, d=16):
    rng = np.random.default_rng(1)
    q, c = (mx.array(rng.standard_normal((1, heads, n, d)).astype(np.float32)) for _ in range(2))
    k, v = (mx.array(rng.standard_normal((1, 1, n, d)).astype(np.float32)) for _ in range(2))
    mx.eval(q, k, v, c)
    grad = mx.grad(lambda q, k, v: (fn(q, k, v) * c).sum(), argnums=(0, 1, 2))
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(grad(q, k, v))
    return mx.get_peak_memory() - before


def test_gradient_memory_grows_linearly():
    """Doubling the length (queries = keys, causal) doubles one block's scores
    [1, 4, 128, L] and the q/k/v-sized arrays, but quadruples the full scores.

    The blocked gradient keeps a few block-score tensors and q-sized arrays at a
    time, so its extra peak memory should double; the composed one (mlx's
    attention differentiated by MLX) keeps several full-score tensors, so it
    should quadruple. The threshold 3 sits halfway between the two. At these
    sizes (1024, 2048) the blocked peak measured ~2.2x, the composed ~3.9x.
    """
    blocked = lambda q, k, v: attention(q, k, v, scale=0.25, mask="causal", block=128)
    plain = lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    b1, b2 = _grad_peak(blocked, 1024), _grad_peak(blocked, 2048)
    p1, p2 = _grad_peak(plain, 1024), _grad_peak(plain, 2048)
    assert b2 / b1 < 3.0, (b1, b2)
    assert p2 / p1 > 3.0, (p1, p2)  # the measurement can tell the two apart
    block_scores = 4 * 128 * 2048 * 4  # bytes of one block's float32 scores at 2048
    assert b2 < 16 * block_scores, (b2, block_scores)  # measured ~8 (4 q-sized ~ 0.5)
    # The composed gradient keeps at least the scores, the probabilities and their
    # gradient, [1, 4, L, L] each (measured 3.4 of them, CPU and H200), which is
    # more than 3x the blocked bound above (16 block scores = one full score tensor).
    full_scores = 4 * 2048 * 2048 * 4
    assert p2 > 3 * full_scores, (p2, full_scores)


@pytest.mark.parametrize("batched", (False, True))
def test_window_gradient_memory_independent_of_keys(batched, monkeypatch):
    """With a window the gradient keeps a few [1, 4, 128, window + 127] block
    scores, whatever the length, plus q/k/v-sized arrays: from 2048 to 4096 tokens
    its peak grows by a few q-sized arrays (measured ~5 of 4096 x 64 floats);
    blocks over every earlier key grow by their scores (measured ~69). Batched
    windows keep up to MAX_WINDOW_SCORES scores at once (here two blocks' worth,
    so that the bound below applies; by default 2^26, blocks of model A at 8k)."""
    if mx.default_device() != mx.cpu:
        # MLX's CUDA backend frees a kernel's inputs when a worker thread sees its
        # graph done, so a peak also counts frees still pending, which depend on
        # timing: on an H200 the growth below measured -1.5 to 8.6 MB in three
        # repeats (bound 4.2 MB, 2.6 on the CPU) and the peak at 4096 up to 26.6 MB.
        pytest.skip("peak memory counts MLX's pending frees on this device")
    w, block = 64, 128
    monkeypatch.setattr(attn, "MAX_WINDOW_SCORES", 2 * 4 * block * 2 * block)
    windowed = lambda q, k, v: attention(q, k, v, scale=0.25, mask=window_mask(q.shape[2], 0, w), block=block,
                                         batch_windows=batched)
    causal = lambda q, k, v: attention(q, k, v, scale=0.25, mask="causal", block=block)
    w2, w4 = _grad_peak(windowed, 2048), _grad_peak(windowed, 4096)
    q_bytes = lambda n: 4 * n * 16 * 4
    assert w4 - w2 <= 8 * (q_bytes(4096) - q_bytes(2048)), (w2, w4)
    window_scores = 4 * block * (w + block - 1) * 4
    # measured 7.3 MB at 4096 (8.3 batched) against this bound's 14.6 MB; the causal blocks: 69 MB
    bound = 8 * q_bytes(4096) + 16 * window_scores
    assert w4 <= bound, (w4, bound)
    assert _grad_peak(causal, 4096) > 2 * bound  # the measurement tells them apart


# The blocked backward forms softmax's row sum as rowsum(dO * O) instead of
# rowsum(P * dP); the softmax gradient P * (dP - rowsum) then cancels two nearly
# equal numbers, so the two roundings differ by more than in a plain reordering,
# and the difference grows through the layers of the backward: measured <= 1e-5
# of the largest gradient (Gemma's layer 0). 5e-5 is still ~400 float32 epsilons,
# far below a wrong mask or position (>= 1e-2).
REL, ABS = 5e-5, 1e-6


@pytest.mark.parametrize("arch", ARCHS)
def test_objective_with_blocked_attention_equals_mlx_attention(arch, monkeypatch):
    calls = []
    counted = attn.attention

    def counting(*args, **kw):
        calls.append(isinstance(kw.get("mask"), attn.WindowMask))
        return counted(*args, **kw)

    monkeypatch.setattr(attn, "attention", counting)
    model = tiny_model(arch, lora=True)
    rng = np.random.default_rng(0)
    pairs = [random_pair(rng, 9, 5, 3), random_pair(rng, 4, 3, 6)]
    for share in (True, False):
        for seg in (0, 1):
            kw = dict(prefix_sharing=share, segment_size=seg)
            plain = value_and_grad(model, pairs, objective(attention_block=0, **kw))
            assert not calls
            # Block 3 < every query count here (>= 4): every layer is routed.
            got = value_and_grad(model, pairs, objective(attention_block=3, **kw))
            assert len(calls) >= len(model.layers), kw
            # Sliding layers (window 4, prompts longer) skip keys outside it.
            assert any(calls) == (arch in ("gemma3_text", "gemma4_text")), kw
            calls.clear()
            assert abs(got[0].item() - plain[0].item()) <= REL * abs(plain[0].item()) + ABS
            diff, scale = max_diff(got[1], plain[1])
            assert diff <= REL * max(1.0, scale) + ABS, (kw, diff, scale)


def test_routing_is_undone():
    model = tiny_model("gemma3_text")
    with routed(model, 4):
        assert gemma3_text.scaled_dot_product_attention is not base.scaled_dot_product_attention
    assert gemma3_text.scaled_dot_product_attention is base.scaled_dot_product_attention
    with pytest.raises(RuntimeError):
        with routed(model, 4):
            raise RuntimeError("inside")
    assert gemma3_text.scaled_dot_product_attention is base.scaled_dot_product_attention


def test_kernels_argument():
    """`kernels` is None, True or False; True where the fused kernels do not run
    is an error, not a silent fallback to MLX's ops."""
    q = k = v = mx.zeros((1, 1, 8, 16))
    with pytest.raises(ValueError, match="kernels must be None, True or False"):
        attention(q, k, v, scale=1.0, mask="causal", block=4, kernels="yes")
    if not attn.fused.available():
        with pytest.raises(ValueError, match="kernels=True but the fused kernels need"):
            attention(q, k, v, scale=1.0, mask="causal", block=4, kernels=True)
    out = attention(q, k, v, scale=1.0, mask="causal", block=4, kernels=False)
    assert out.shape == q.shape
