"""Blocked training attention equals plain attention; its gradient's memory is linear."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base, gemma3_text
from mlx_lm.models.base import create_causal_mask

import flash_cce.attention as attn
from flash_cce.attention import attention, routed
from flash_cce.objectives import ObjectiveConfig, value_and_grad
from models import ARCHS, max_diff, random_pair, tiny_model


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
        ObjectiveConfig(attention_block=-1).validate()


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
    assert p2 > 4 * b2, (p2, b2)


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
        calls.append(args[0].shape)
        return counted(*args, **kw)

    monkeypatch.setattr(attn, "attention", counting)
    model = tiny_model(arch, lora=True)
    rng = np.random.default_rng(0)
    pairs = [random_pair(rng, 9, 5, 3), random_pair(rng, 4, 3, 6)]
    for share in (True, False):
        for seg in (0, 1):
            kw = dict(prefix_sharing=share, segment_size=seg)
            plain = value_and_grad(model, pairs, ObjectiveConfig(attention_block=0, **kw))
            assert not calls
            # Block 3 < every query count here (>= 4): every layer is routed.
            got = value_and_grad(model, pairs, ObjectiveConfig(attention_block=3, **kw))
            assert len(calls) >= len(model.layers), kw
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
