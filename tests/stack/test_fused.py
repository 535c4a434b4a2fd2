"""The fused kernels (NVIDIA GPUs) equal the composed MLX ops they replace.

Run with FLASH_CCE_TEST_DEVICE=gpu on a machine with MLX's CUDA backend; skipped
elsewhere. float32 inputs: the two paths differ only in the order of each row's
sums (exp and log are the same float32 functions), so the bound is a few float32
epsilons of the largest value: 1e-5.
"""

import mlx.core as mx
import numpy as np
import pytest

from flash_cce.stack import attention as attn
from flash_cce.stack import fused as ak
from flash_cce.stack.attention import attention, window_mask

pytestmark = pytest.mark.skipif(not ak.available(), reason="needs MLX's CUDA backend")

TOL = 1e-5

# (queries in the block, keys, query offset, first key, causal, window)
CASES = [
    (64, 64, 0, 0, True, None),
    (64, 192, 128, 0, True, None),  # a later block of a causal sequence
    (32, 100, 70, 8, True, 40),  # windowed, keys from 8 on
    (48, 80, 0, 0, False, None),  # no mask
    (16, 40, 30, 0, False, 12),  # window without causality
    (8, 16, 0, 100, True, None),  # every key masked: the composed path's uniform row
    (16, 1024, 1000, 0, True, 512),  # rows of many 16-byte pieces a lane
    (8, 1037, 1100, 60, True, None),  # a length no vector divides: single values
]


def _rel(a, b):
    return (abs(a.astype(mx.float32) - b.astype(mx.float32)).max() / max(abs(b).max().item(), 1e-30)).item()


def _composed_mask(n, kn, q0, k0, causal, window):
    q = mx.arange(q0, q0 + n)[:, None]
    k = mx.arange(k0, k0 + kn)[None]
    m = mx.ones((n, kn), mx.bool_)
    if causal:
        m = m & (k <= q)
    if window:
        m = m & (q - k < window)
    return m


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_softmax_and_score_grads(case, dtype):
    n, kn, q0, k0, causal, window = case
    rng = np.random.default_rng(0)
    shape = (2, 1, 3, n, kn)
    s = mx.array(rng.standard_normal(shape).astype(np.float32) * 4).astype(dtype)
    dp = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    delta = mx.array(rng.standard_normal(shape[:-1] + (1,)).astype(np.float32))
    m = _composed_mask(n, kn, q0, k0, causal, window)
    sf = mx.where(m, s.astype(mx.float32), attn._NEG)
    lse_ref = mx.logsumexp(sf, axis=-1, keepdims=True)
    p_ref = mx.exp(sf - lse_ref)
    ds_ref = p_ref * (dp.astype(mx.float32) - delta)

    p, lse = ak.softmax(s, q0, k0, causal, window, mx.float32)
    assert p.dtype == mx.float32 and lse.shape == lse_ref.shape
    assert _rel(lse, lse_ref) <= TOL
    assert _rel(p, p_ref) <= TOL
    tol = TOL if dtype == mx.float32 else 2**-8  # one bfloat16 rounding of the outputs
    p1, _ = ak.softmax(s, q0, k0, causal, window, dtype)  # as the model calls it
    assert p1.dtype == dtype and _rel(p1, p_ref) <= tol
    p2, ds = ak.score_grads(s, dp, lse_ref, delta, q0, k0, causal, window)
    assert p2.dtype == dtype and ds.dtype == dtype
    assert _rel(p2, p_ref) <= tol
    assert _rel(ds, ds_ref) <= tol


@pytest.mark.parametrize("key_start", [None, (0, 7)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_batched_blocks(dtype, key_start):
    """Rows of batched blocks (`blocks`, as the batched windows of `attention`
    lay them out): block j's queries and keys sit j * n positions later, its rows
    are (query head, query), keys before position 0 are masked, and with
    `key_start` those before each batch row's own first key."""
    n, heads, nb, kn, q0, k0, window = 16, 3, 4, 32, 8, -16, 20
    rng = np.random.default_rng(2)
    shape = (2, 1, nb, heads * n, kn)
    s = mx.array(rng.standard_normal(shape).astype(np.float32) * 4).astype(dtype)
    dp = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    delta = mx.array(rng.standard_normal(shape[:-1] + (1,)).astype(np.float32))
    j = mx.arange(nb)[:, None, None, None]
    q = q0 + j * n + mx.arange(n)[:, None]
    k = k0 + j * n + mx.arange(kn)[None]
    first = mx.array(key_start or (0, 0)).reshape(2, 1, 1, 1, 1, 1)
    m = (k >= first) & (k <= q) & (q - k < window)  # [2, 1, nb, 1, n, kn]: query heads alike
    assert m.any(axis=-1).all()  # no row fully masked: lse stays on the scale of the scores
    sf = mx.where(m, s.astype(mx.float32).reshape(2, 1, nb, heads, n, kn), attn._NEG).reshape(shape)
    lse_ref = mx.logsumexp(sf, axis=-1, keepdims=True)
    p_ref = mx.exp(sf - lse_ref)
    ds_ref = p_ref * (dp.astype(mx.float32) - delta)
    args = dict(blocks=(n, heads * n, nb, n), key_start=key_start)
    p, lse = ak.softmax(s, q0, k0, True, window, mx.float32, **args)
    assert _rel(lse, lse_ref) <= TOL and _rel(p, p_ref) <= TOL
    tol = TOL if dtype == mx.float32 else 2**-8
    p2, ds = ak.score_grads(s, dp, lse_ref, delta, q0, k0, True, window, **args)
    assert _rel(p2, p_ref) <= tol and _rel(ds, ds_ref) <= tol

@pytest.mark.parametrize("mask", ["causal", "window", None])
def test_attention_with_and_without_kernels(mask, monkeypatch):
    """The whole blocked attention, forward and gradients, with the kernels and
    with MLX's ops (kernels=False), over several blocks."""
    rng = np.random.default_rng(1)
    b, hq, hkv, lq, lk, d = 1, 4, 1, 96, 160, 32
    q = mx.array(rng.standard_normal((b, hq, lq, d)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((b, hkv, lk, d)).astype(np.float32)) for _ in range(2))
    c = mx.array(rng.standard_normal((b, hq, lq, d)).astype(np.float32))
    m = window_mask(lq, lk - lq, 48) if mask == "window" else mask

    def run(kernels):
        f = lambda q, k, v: (attention(q, k, v, scale=0.2, mask=m, block=32, kernels=kernels) * c).sum()
        return mx.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

    calls = []
    real = ak.softmax
    monkeypatch.setattr(ak, "softmax", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    v1, g1 = run(None)
    assert calls  # the kernels ran
    calls.clear()
    v0, g0 = run(False)
    assert not calls
    assert abs(v1 - v0).item() <= TOL * max(1.0, abs(v0).item())
    for a, b_ in zip(g1, g0):
        assert _rel(a, b_) <= TOL


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gelu_approx_grad(dtype):
    """Against MLX's gradient of `nn.gelu_approx` (float32: same formula up to
    rounding, 1e-5 of the largest; bfloat16: MLX differentiates in bfloat16, the
    kernel in float32, so within a few bfloat16 roundings: 2^-6)."""
    import mlx.nn as nn

    rng = np.random.default_rng(2)
    x = mx.array((rng.standard_normal((300, 257)) * 3).astype(np.float32)).astype(dtype)
    g = mx.array(rng.standard_normal((300, 257)).astype(np.float32)).astype(dtype)
    ref = mx.vjp(nn.gelu_approx, [x], [g])[1][0]
    got = ak.gelu_approx_grad(x, g)
    assert got.dtype == dtype
    assert _rel(got, ref) <= (TOL if dtype == mx.float32 else 2**-6)
