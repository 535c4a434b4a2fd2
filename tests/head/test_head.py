"""flash-CCE head against an independent float64 reference, for both backends.

Tolerances. Inputs are rounded to their dtype first and the reference uses the
rounded values, so the only differences are the kernel's fp32 arithmetic and
the rounding of outputs to the input dtype. With u = 2^-24:
  - a logit is a length-H fp32 dot product (plus one rounding for dequant):
    |ds| <= (H + 2) u B, where B = sum_i |h_i w_i| (worst case, Higham 3.1);
  - lse and logp add at most V u relative error from summing V exponentials
    and a few u from the exp/log approximations: |dlogp| <= 2 ds + (V + 16) u (1 + |lse|);
  - dh and dW sum V (or M) products whose factors carry relative error <= 2 ds
    (softmax) plus fp32 accumulation, then round once to the output dtype:
    |d dh| <= u_out |dh| + ((V + 4) u + 4 ds) (|dS| @ |W|).
These are worst-case bounds, not fitted constants.

On the GPU (FLASH_CCE_TEST_DEVICE=gpu) the native kernels multiply bf16 (fp16
for fp16 h) operands. The inputs are then drawn bf16-exact where the test
allows it, the reference multiplies the operands the kernels see, and the
gradients gain one rounding of dS to the operand type: + u_op (|dS| @ |W|).
The epilogue's exp/log/tanh approximations (~2^-22 relative) are within the
(V + 16) u term above.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import flash_cce as fc
from flash_cce import _ext
from conftest import DEVICE
from reference import forward_backward, head_weight, operand_type, to64

U32 = 2.0**-24
UNIT = {mx.float32: 2.0**-24, mx.bfloat16: 2.0**-8, mx.float16: 2.0**-11}
BACKENDS = ["native", "fallback"]
GPU = DEVICE == "gpu" and _ext.has_gpu_kernels()


def gpu_native(backend=None):
    """Whether the head runs on the GPU kernels (bf16/fp16 operands)."""
    return GPU and backend != "fallback"


def as_seen(a, h_dtype, backend=None):
    """An operand (mx or float64 numpy) as the head's multiplier sees it, in
    float64: on the GPU rounded to fp32 (the dequantizer's fma) and then to
    the operand type."""
    if not gpu_native(backend):
        return a if isinstance(a, np.ndarray) else to64(a)
    a = mx.array(np.asarray(a, np.float32)) if isinstance(a, np.ndarray) else a
    return to64(a.astype(operand_type(h_dtype)))


def op_unit(h_dtype, backend=None):
    """Relative rounding of dS (or P) to the operand type: 0 on the CPU."""
    return UNIT[operand_type(h_dtype)] if gpu_native(backend) else 0.0


def bf16_exact(a):
    """On the GPU, values the bf16 multiplier takes unrounded (dtype kept)."""
    return a.astype(mx.bfloat16).astype(a.dtype) if GPU and a.dtype == mx.float32 else a


def make_inputs(M, H, V, dtype=mx.float32, w_dtype=None, ignore=(), scale=1.0):
    h = bf16_exact((mx.random.normal((M, H)) * scale).astype(dtype))
    w = bf16_exact((mx.random.normal((V, H)) / np.sqrt(H)).astype(w_dtype or dtype))
    y = mx.random.randint(0, V, (M,)).astype(mx.int32)
    if ignore:
        y[mx.array(list(ignore))] = -100
    return h, w, y


def quantize(w, group_size, bits):
    q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    return q, s, b


def check(h, w, y, scales=None, biases=None, group_size=64, bits=None,
          softcap=None, backend="native", g_lse=None, want_dw=False):
    """Runs forward + backward and compares everything with the reference."""
    M, H = h.shape
    V = w.shape[0]
    W = as_seen(head_weight(w, scales, biases, group_size), h.dtype, backend)
    H64, y64 = as_seen(h, h.dtype, backend), np.array(y)
    uop = op_unit(h.dtype, backend)
    g = mx.random.normal((M,))
    ref_logp, ref_lse, ref_dh, ref_dw, B = forward_backward(
        H64, W, y64, to64(g), None if g_lse is None else to64(g_lse), softcap
    )
    kw = dict(group_size=group_size, bits=bits, softcap=softcap, backend=backend)
    logp, lse = fc.flash_cce_forward(h, w, y, scales, biases, **kw)
    ds = (H + 2) * U32 * B.max()
    tol = 2 * ds + (V + 16) * U32 * (1 + np.abs(ref_lse).max())
    np.testing.assert_allclose(np.array(lse), ref_lse, rtol=0, atol=tol)
    np.testing.assert_allclose(np.array(logp), ref_logp, rtol=0, atol=tol)

    out = fc.flash_cce_backward(
        h, w, y, lse, g, scales, biases, g_lse=g_lse, compute_dw=want_dw, **kw
    )
    dh, dw = out if want_dw else (out, None)
    assert dh.shape == h.shape and dh.dtype == h.dtype
    dS = _ref_ds(H64, W, y64, to64(g), g_lse, softcap)
    bound_dh = np.abs(dS) @ np.abs(W)
    tol_dh = UNIT[h.dtype] * np.abs(ref_dh) + ((V + 4) * U32 + 4 * ds + uop) * bound_dh
    # 1e-12 lets exact zeros (ignored rows) compare with "less than".
    np.testing.assert_array_less(np.abs(to64(dh) - ref_dh), tol_dh + 1e-12)
    if want_dw:
        assert dw.shape == w.shape and dw.dtype == w.dtype
        bound_dw = np.abs(dS).T @ np.abs(H64)
        tol_dw = UNIT[w.dtype] * np.abs(ref_dw) + ((M + 4) * U32 + 4 * ds + uop) * bound_dw
        np.testing.assert_array_less(np.abs(to64(dw) - ref_dw), tol_dw + 1e-12)
    return logp, lse


def grad_slack(h, w, y, g, g_lse=None, softcap=None, backend=None):
    """Two roundings of dS (or the fused forward's P) to the operand type, as
    an absolute bound per dh element: 2 u_op (|dS| @ |W|); 0 on the CPU."""
    uop = op_unit(h.dtype, backend)
    if not uop:
        return 0.0
    W = as_seen(w, h.dtype, backend)
    dS = _ref_ds(as_seen(h, h.dtype, backend), W, np.array(y), to64(g), g_lse, softcap)
    return 2 * uop * (np.abs(dS) @ np.abs(W))


def assert_finite_differences(L, x, directions=3):
    """Central differences of the scalar L along random unit directions d
    against mx.grad(L)(x) . d. In fp32 with step e = 1e-2 the truncation error
    is O(e^2 |L'''|) ~ 1e-4 and the rounding error ~ u |L| / e ~ 1e-5 for
    |L| ~ 10: we allow 2e-3 of |dL . d|."""
    dx = mx.grad(L)(x)
    for _ in range(directions):
        d = mx.random.normal(x.shape)
        d = d / mx.linalg.norm(d)
        e = 1e-2
        fd = (L(x + e * d).item() - L(x - e * d).item()) / (2 * e)
        an = (dx * d).sum().item()
        assert abs(fd - an) <= 2e-3 * max(1.0, abs(an)), (fd, an)


def _ref_ds(H64, W, y, g, g_lse, softcap, ignore_index=-100):
    raw = H64 @ W.T
    if softcap:
        t = np.tanh(raw / softcap)
        s, dcap = softcap * t, 1 - t * t
    else:
        s, dcap = raw, 1.0
    lse = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)
    keep = y != ignore_index
    g = np.where(keep, g, 0.0)
    gl = np.zeros_like(g) if g_lse is None else to64(g_lse)
    p = np.exp(s - lse[:, None])
    onehot = np.zeros_like(s)
    onehot[np.arange(len(y))[keep], y[keep]] = 1
    return (g[:, None] * onehot + (gl - g)[:, None] * p) * dcap


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_dense_dtypes(backend, dtype, softcap):
    h, w, y = make_inputs(29, 70, 333, dtype, scale=2.0)
    check(h, w, y, softcap=softcap, backend=backend, want_dw=True)


@pytest.mark.parametrize(
    "M,H,V",
    [(1, 16, 10), (7, 3, 1), (1, 1, 1), (13, 129, 257), (6, 16, 128), (50, 33, 1000)],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_odd_shapes(M, H, V, backend):
    h, w, y = make_inputs(M, H, V)
    check(h, w, y, backend=backend, want_dw=True)


def test_mixed_dtypes_native():
    h, w, y = make_inputs(11, 40, 300, mx.bfloat16, w_dtype=mx.float32)
    check(h, w, y, want_dw=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantized(bits, group_size, backend):
    h, w, y = make_inputs(9, 128, 150)
    q, s, b = quantize(w, group_size, bits)
    check(h, q, y, s, b, group_size=group_size, bits=bits, softcap=30.0, backend=backend)


@pytest.mark.parametrize("sb_dtype", [mx.bfloat16, mx.float16])
def test_quantized_half_scales(sb_dtype):
    h, w, y = make_inputs(5, 64, 77, mx.bfloat16, w_dtype=sb_dtype)
    q, s, b = quantize(w, 32, 4)
    check(h, q, y, s, b, group_size=32)


def test_bits_inferred_from_packed_width():
    h, w, y = make_inputs(4, 64, 20)
    q, s, b = quantize(w, 64, 8)
    a = fc.flash_cce_forward(h, q, y, s, b)[0]
    c = fc.flash_cce_forward(h, q, y, s, b, bits=8)[0]
    assert mx.array_equal(a, c)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignore_index_rows(backend):
    h, w, y = make_inputs(10, 24, 90, ignore=(0, 3, 9))
    logp, _ = check(h, w, y, backend=backend, want_dw=True)
    assert (np.array(logp)[[0, 3, 9]] == 0).all()
    g = mx.ones((10,))
    lse = fc.flash_cce_forward(h, w, y, backend=backend)[1]
    dh = fc.flash_cce_backward(h, w, y, lse, g, backend=backend)
    assert (np.array(dh)[[0, 3, 9]] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_rows_ignored(backend):
    h, w, _ = make_inputs(4, 8, 30)
    y = mx.full((4,), -100, mx.int32)
    logp, lse = fc.flash_cce_forward(h, w, y, backend=backend)
    assert (np.array(logp) == 0).all()
    dh, dw = mx.grad(lambda h, w: fc.flash_cce_forward(h, w, y, backend=backend)[0].sum(),
                     argnums=(0, 1))(h, w)
    assert not np.array(dh).any() and not np.array(dw).any()
    loss = fc.linear_cross_entropy(h, w, y)
    assert loss.item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_ignore_index(backend):
    h, w, y = make_inputs(6, 8, 30)
    y[2] = 7
    logp = fc.flash_cce_forward(h, w, y, ignore_index=7, backend=backend)[0]
    assert np.array(logp)[2] == 0 and (np.array(logp)[[0, 1, 3, 4, 5]] < 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_cotangent(backend):
    """A z-loss style objective differentiates lse too: dS gains g_lse * softmax."""
    h, w, y = make_inputs(12, 20, 64)
    check(h, w, y, backend=backend, g_lse=mx.random.normal((12,)), want_dw=True)

    def f(h):
        logp, lse = fc.flash_cce_forward(h, w, y, backend=backend)
        return (logp - 0.1 * lse**2).sum()

    dh = mx.grad(f)(h)
    lse = fc.flash_cce_forward(h, w, y)[1]
    ref = fc.flash_cce_backward(h, w, y, lse, mx.ones((12,)), g_lse=-0.2 * lse)
    slack = grad_slack(h, w, y, mx.ones((12,)), -0.2 * lse)  # ref: the default backend
    np.testing.assert_array_less(np.abs(to64(dh) - to64(ref)),
                                 1e-5 * np.abs(to64(ref)) + 1e-6 + slack)


# Closed forms ---------------------------------------------------------------


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_zero_weight_is_uniform(softcap):
    """W = 0: every logit is 0, so logp = -log V, lse = log V and dh = g * (W_y - mean W) = 0."""
    V = 37
    h = mx.random.normal((5, 16))
    w = mx.zeros((V, 16))
    y = mx.array([0, 5, 36, 2, 9])
    logp, lse = fc.flash_cce_forward(h, w, y, softcap=softcap)
    # A few ulp; on the GPU, log(sum exp(s - cap)) + cap goes through the fast
    # exp/log approximations (~2^-22 relative each).
    rtol = 2e-6 if GPU else 2e-7
    np.testing.assert_allclose(np.array(lse), np.log(V), rtol=rtol)
    np.testing.assert_allclose(np.array(logp), -np.log(V), rtol=rtol)
    dh = fc.flash_cce_backward(h, w, y, lse, mx.ones((5,)), softcap=softcap)
    assert not np.array(dh).any()


def test_two_token_vocabulary_is_logsigmoid():
    """V = 2 with W = [[a], [0]] on H = 1: logp(y=0) = log sigmoid(a h), d/dh = a (1 - sigmoid(a h)).

    a and h are exact in bf16, so the GPU's multiplier sees them unrounded."""
    a = 1.6875
    h = mx.array([[-3.0], [-0.5], [0.0], [0.25], [4.0]])
    w = mx.array([[a], [0.0]])
    y = mx.zeros((5,), mx.int32)
    logp, lse = fc.flash_cce_forward(h, w, y)
    x = a * np.array(h)[:, 0].astype(np.float64)
    # logp = s_y - lse cancels: its absolute error is a few ulp of lse (on the
    # GPU a few 2^-22 from the fast exp/log).
    atol = 4 * (2.0**-21 if GPU else U32) * (1 + np.abs(np.array(lse)).max())
    np.testing.assert_allclose(np.array(logp), -np.log1p(np.exp(-x)), rtol=0, atol=atol)
    dh = fc.flash_cce_backward(h, w, y, lse, mx.ones((5,)))
    # dh = a (1 - p_y): the same absolute error through p_y = exp(logp), plus
    # on the GPU the rounding of dS (|dS| <= 1) to bf16.
    atol_dh = 2 * a * atol + (a * 2.0**-8 if GPU else 0.0)
    np.testing.assert_allclose(np.array(dh)[:, 0], a / (1 + np.exp(x)), rtol=0, atol=atol_dh)


def test_softcap_bounds_logits():
    """With a tiny cap every logit lies in (-cap, cap): lse <= cap + log V."""
    h, w, y = make_inputs(8, 32, 50, scale=100.0)
    logp, lse = fc.flash_cce_forward(h, w, y, softcap=0.5)
    assert (np.array(lse) <= 0.5 + np.log(50) + 1e-6).all()
    assert (np.array(logp) >= -1.0 - np.log(50) - 1e-6).all()


def test_v_equals_one_gives_zero_logp():
    h, w, _ = make_inputs(3, 5, 1)
    logp, lse = fc.flash_cce_forward(h, w, mx.zeros((3,), mx.int32))
    np.testing.assert_allclose(np.array(logp), 0.0, atol=1e-7)


# Gradients: finite differences and transforms --------------------------------


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("quantized", [False, True])
def test_finite_differences(softcap, quantized):
    """Central differences of L(h) = sum(g * logp) (assert_finite_differences).

    Differences need a smooth L: the GPU kernels round h to bf16 (steps of
    2^-8 |h|, larger than e |d|), so these run on the CPU kernels there; the
    GPU's gradients are checked against the CPU's in test_gpu_head.py.
    """
    M, H, V = 6, 64, 100
    h, w, y = make_inputs(M, H, V)
    extra = {}
    if quantized:
        w, s, b = quantize(w, 32, 4)
        extra = dict(scales=s, biases=b, group_size=32)
    g = mx.random.normal((M,))

    def L(h):
        return (g * fc.flash_cce_forward(h, w, y, softcap=softcap, stream=mx.cpu,
                                         **extra)[0]).sum()

    assert_finite_differences(L, h)


def test_dw_finite_differences():
    M, H, V = 5, 8, 12
    h, w, y = make_inputs(M, H, V)

    def L(w):  # on the CPU kernels: see test_finite_differences
        return fc.flash_cce_forward(h, w, y, softcap=4.0, stream=mx.cpu)[0].sum()

    assert_finite_differences(L, w, directions=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_through_compile(backend):
    h, w, y = make_inputs(9, 32, 70)

    def loss(h, w):
        return fc.linear_cross_entropy(h, w, y, softcap=10.0, backend=backend)

    eager = mx.value_and_grad(loss, argnums=(0, 1))(h, w)
    compiled = mx.compile(mx.value_and_grad(loss, argnums=(0, 1)))(h, w)
    np.testing.assert_allclose(eager[0].item(), compiled[0].item(), rtol=1e-6)
    for a, b in zip(eager[1], compiled[1]):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_matches_loop(backend):
    B, M, H, V = 3, 5, 16, 40
    h = mx.random.normal((B, M, H))
    y = mx.random.randint(0, V, (B, M))
    w = mx.random.normal((V, H)) * 0.3

    def f(h, y):
        return fc.flash_cce_forward(h, w, y, backend=backend, validate_targets=False)[0]

    out = mx.vmap(f)(h, y)
    loop = mx.stack([f(h[i], y[i]) for i in range(B)])
    np.testing.assert_allclose(np.array(out), np.array(loop), rtol=1e-6, atol=1e-6)

    def loss(h, y):
        return f(h, y).sum()

    g = mx.vmap(mx.grad(loss))(h, y)
    g_loop = mx.stack([mx.grad(loss)(h[i], y[i]) for i in range(B)])
    np.testing.assert_allclose(np.array(g), np.array(g_loop), rtol=1e-5, atol=1e-6)


def test_vmap_broadcasts_unbatched_targets():
    h = mx.random.normal((4, 3, 8))
    w = mx.random.normal((10, 8))
    y = mx.array([1, 2, 3])
    out = mx.vmap(lambda h: fc.flash_cce_forward(h, w, y)[0])(h)
    loop = mx.stack([fc.flash_cce_forward(h[i], w, y)[0] for i in range(4)])
    np.testing.assert_allclose(np.array(out), np.array(loop), rtol=1e-6)


def test_vmap_over_weight_is_refused():
    h = mx.random.normal((3, 8))
    w = mx.random.normal((2, 10, 8))
    y = mx.array([1, 2, 3])
    with pytest.raises(ValueError, match="head weight"):
        mx.eval(mx.vmap(lambda w: fc.flash_cce_forward(h, w, y)[0])(w))


def test_backends_agree_on_large_vocab_blocks():
    """Several fallback blocks and many kernel blocks: same results."""
    h, w, y = make_inputs(16, 48, 3000)
    a = fc.flash_cce_forward(h, w, y, softcap=30.0)
    b = fc.flash_cce_forward(h, w, y, softcap=30.0, backend="fallback")
    for x, z in zip(a, b):
        np.testing.assert_allclose(np.array(x), np.array(z), rtol=1e-5, atol=1e-5)


# Empty input and leading dims -------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_rows(backend):
    h = mx.zeros((0, 16))
    w = mx.random.normal((10, 16))
    y = mx.zeros((0,), mx.int32)
    logp, lse = fc.flash_cce_forward(h, w, y, backend=backend)
    assert logp.shape == (0,) and lse.shape == (0,)
    dh = fc.flash_cce_backward(h, w, y, lse, mx.zeros((0,)), backend=backend)
    assert dh.shape == (0, 16)
    h3 = mx.zeros((2, 0, 16))
    y3 = mx.zeros((2, 0), mx.int32)
    assert fc.flash_cce_forward(h3, w, y3, backend=backend)[0].shape == (2, 0)
    assert fc.linear_cross_entropy(h3, w, y3).item() == 0.0


def test_leading_dims():
    h = mx.random.normal((2, 3, 16))
    w = mx.random.normal((20, 16))
    y = mx.random.randint(0, 20, (2, 3))
    logp, lse = fc.flash_cce_forward(h, w, y)
    assert logp.shape == (2, 3)
    flat = fc.flash_cce_forward(h.reshape(6, 16), w, y.reshape(6))[0]
    np.testing.assert_array_equal(np.array(logp).reshape(6), np.array(flat))
    dh = mx.grad(lambda h: fc.flash_cce_forward(h, w, y)[0].sum())(h)
    assert dh.shape == h.shape


# nn heads ---------------------------------------------------------------------


def _dense_ce(h, W, y, softcap=None):
    logits = h.astype(mx.float32) @ W.astype(mx.float32).T
    if softcap:
        logits = softcap * mx.tanh(logits / softcap)
    return nn.losses.cross_entropy(logits, y)


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Linear(32, 50, bias=False),
        lambda: nn.Embedding(50, 32),
        lambda: nn.QuantizedLinear(32, 50, bias=False, group_size=32, bits=4),
        lambda: nn.QuantizedEmbedding(50, 32, group_size=32, bits=8),
    ],
)
def test_nn_heads(make):
    head = make()
    h = bf16_exact(mx.random.normal((2, 4, 32)))
    y = mx.random.randint(0, 50, (2, 4))
    if isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        W = mx.dequantize(head.weight, head.scales, head.biases, head.group_size, head.bits)
        W = bf16_exact(W.astype(mx.float32))  # what the GPU's multiplier sees
    else:
        head.weight = bf16_exact(head.weight)
        W = head.weight
    ref = _dense_ce(h, W, y, softcap=30.0)
    for reduction, expect in (("none", ref), ("sum", ref.sum()), ("mean", ref.mean())):
        out = fc.linear_cross_entropy(h, head, y, reduction=reduction, softcap=30.0)
        np.testing.assert_allclose(np.array(out), np.array(expect), rtol=1e-5, atol=1e-5)


def test_mean_skips_ignored_tokens():
    h = bf16_exact(mx.random.normal((6, 8)))
    w = bf16_exact(mx.random.normal((12, 8)))
    y = mx.array([1, -100, 3, 4, -100, 5])
    keep = np.array(y) != -100
    ref = _dense_ce(h[mx.array(np.where(keep)[0])], w, y[mx.array(np.where(keep)[0])]).mean()
    np.testing.assert_allclose(fc.linear_cross_entropy(h, w, y).item(), ref.item(), rtol=1e-5)


def test_head_with_bias_is_refused():
    with pytest.raises(ValueError, match="bias"):
        fc.linear_logprobs(mx.zeros((1, 4)), nn.Linear(4, 3), mx.array([0]))


def test_nonaffine_mode_is_refused():
    head = nn.QuantizedLinear(32, 8, bias=False, group_size=32, bits=4, mode="mxfp4")
    with pytest.raises(ValueError, match="affine"):
        fc.linear_logprobs(mx.zeros((1, 32)), head, mx.array([0]))


# Memory -------------------------------------------------------------------------


def test_extra_memory_flat_in_vocab():
    """Peak memory of forward + backward grows by the inputs only when V grows 8x."""
    if mx.default_device() != mx.cpu:
        pytest.skip("measures the CPU kernel; the GPU suite has its own memory test")
    M, H = 64, 64

    def extra(V):
        h, w, y = make_inputs(M, H, V)
        mx.eval(h, w, y)
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        logp, lse = fc.flash_cce_forward(h, w, y)
        dh = fc.flash_cce_backward(h, w, y, lse, mx.ones((M,)))
        mx.eval(dh)
        return mx.get_peak_memory() - base

    small, large = extra(1024), extra(8192)
    logits_small = M * 1024 * 4
    # 8x the vocabulary would add 7 * M * 1024 * 4 bytes of logits; the kernel's
    # scratch depends on M, H and its block size only.
    assert abs(large - small) < logits_small // 4, (small, large)


# Fused backward ------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,quant,softcap",
    [(mx.float32, None, None), (mx.bfloat16, None, 30.0), (mx.float16, None, 2.0),
     (mx.bfloat16, (32, 4), 30.0), (mx.float32, (64, 8), None)],
)
def test_fused_backward_matches_recompute(dtype, quant, softcap):
    """The forward's softmax-weighted rows give the same dh as the recompute pass."""
    h, w, y = make_inputs(21, 64, 700, dtype, ignore=(4,))
    y[7] = 0  # target in the first vocabulary block
    kw = dict(softcap=softcap)
    if quant:
        w, s, b = quantize(w, *quant)
        kw.update(scales=s, biases=b, group_size=quant[0])
    g = mx.random.normal((21,))
    g_lse = mx.random.normal((21,))
    g_lse[4] = 0.0  # the ignored row then has no gradient at all

    def loss(h, fused):
        logp, lse = fc.flash_cce_forward(h, w, y, fused_backward=fused, **kw)
        return (g * logp + g_lse * lse).sum()

    fused = mx.grad(lambda h: loss(h, True))(h)
    plain = mx.grad(lambda h: loss(h, False))(h)
    assert fused.dtype == h.dtype
    # Both are fp32 sums over V of the same terms in another order (error up to
    # (V + H) u of the largest term), each rounded once to the output dtype: they
    # may differ by two output roundings.
    # On the GPU each also rounds its dS (or P) to the operand type once.
    ref = np.abs(to64(plain))
    tol = 2 * UNIT[dtype] * ref + (700 + 64) * U32 * ref.max()
    if quant is None:
        tol = tol + grad_slack(h, w, y, g, g_lse, softcap)
    else:
        W = mx.dequantize(w, s, b, group_size=quant[0], bits=quant[1])
        tol = tol + grad_slack(h, W, y, g, g_lse, softcap)
    np.testing.assert_array_less(np.abs(to64(fused) - to64(plain)), tol + 1e-12)
    assert not to64(fused)[4].any()


def test_backend_routing():
    """A device without a native kernel runs the pure-MLX fallback automatically."""
    from flash_cce import ops

    assert ops._use_native(None, mx.cpu) and ops._use_native("native", mx.cpu)
    assert not ops._use_native("fallback", mx.cpu)
    gpu = mx.Device(mx.gpu, 0)
    assert ops._use_native(None, gpu) == _ext.has_gpu_kernels()
    if not _ext.has_gpu_kernels():
        with pytest.raises(ValueError, match="has no flash-CCE kernel"):
            ops._use_native("native", gpu)


def test_backend_from_environment(monkeypatch):
    h, w, y = make_inputs(4, 16, 30)
    monkeypatch.setenv("FLASH_CCE_BACKEND", "fallback")
    assert not fc.ops._use_native(None, mx.cpu)
    assert fc.ops._use_native("native", mx.cpu)  # an explicit backend wins
    monkeypatch.setenv("FLASH_CCE_BACKEND", "fast")
    with pytest.raises(ValueError, match="FLASH_CCE_BACKEND"):
        fc.flash_cce_forward(h, w, y)


def test_explicit_cpu_stream():
    h, w, y = make_inputs(4, 16, 30)
    a = fc.flash_cce_forward(h, w, y, stream=mx.cpu)[0]
    b = fc.flash_cce_forward(h, w, y, stream=mx.cpu, backend="fallback")[0]
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)


def test_tuning_keys_and_defaults():
    """Every tuning key with its default; None keeps a default, and a set key
    comes back as given."""
    defaults = _ext.check_tuning()
    assert defaults == {"wgmma": True, "quant_rs": True, "gather_targets": True, "row_block": 0,
                        "vocab_chunk": 0, "chunk_mb": 0, "fwd_l2_mb": 0, "dh_splits": 0, "num_threads": 0}
    assert _ext.check_tuning({"row_block": None}) == defaults
    assert _ext.check_tuning({"wgmma": False, "num_threads": 3}) == {
        **defaults, "wgmma": False, "num_threads": 3}


@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_thread_count_from_tuning(threads):
    """tuning={"num_threads": n} reaches the forward and, through the VJP that
    keeps the forward's tuning, the backward. More or fewer threads only
    reorder fp32 sums over V = 700 terms: results agree with the default to a
    few fp32 roundings."""
    h, w, y = make_inputs(6, 24, 700)

    def run(tuning):
        def loss(h, w):
            logp, lse = fc.flash_cce_forward(h, w, y, stream=mx.cpu, backend="native",
                                             tuning=tuning)
            return (logp * mx.arange(6)).sum() + lse.sum()

        return mx.value_and_grad(loss, argnums=(0, 1))(h, w)

    a_val, (a_dh, a_dw) = run(None)
    b_val, (b_dh, b_dw) = run({"num_threads": threads})
    for a, b in ((a_val, b_val), (a_dh, b_dh), (a_dw, b_dw)):
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-5, atol=1e-6)
