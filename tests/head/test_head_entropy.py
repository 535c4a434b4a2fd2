"""Entropy, temperature and the per-token statistics of the head, against a
float64 oracle written here (the logits are built in full, which the head never
does), finite differences and closed forms, on every backend.

Tolerances extend test_head.py's worst-case bounds (u = 2^-24):
  - temperature folds into h (scaled once in fp32) and the cap, so a final
    logit z carries |dz| <= (H + 3) u B / T plus the tanh/exp approximations'
    few ulp of |z| (8 u max|z|), B = sum_i |h_i w_i|;
  - entropy = log S - R / S (S = sum_v e^(z_v - m), R = sum_v e^(z_v - m)(z_v - m)):
    a logit error dz moves it by at most sum_v p_v |z_v - sum_u p_u z_u| dz <= A dz,
    fp32 sums of V terms add (V + 16) u (1 + A_m), A_m = sum_v p_v |z_v - m|;
  - the entropy's share of dS, p_v g_e (z_v - sum_u p_u z_u) dcap_v, carries the
    absolute error of (z_v - sum p z), at most 2 dz + tol(lse) + tol(entropy),
    on top of test_head.py's bound for the rest of dS;
  - mean_logit sums V fp32 logits: dz + V u max|z|.
On the GPU the operands are rounded as test_head.py describes (as_seen): the
reference then multiplies what the kernels see.
"""

import mlx.core as mx
import numpy as np
import pytest

import flash_cce as fc
from flash_cce import metal, ops
from reference import head_weight, to64
from test_head import (GPU, U32, UNIT, as_seen, assert_finite_differences, make_inputs, op_unit,
                       quantize)

BACKENDS = ["native", "fallback"]


def oracle(H64, W, y, softcap=None, temperature=1.0, g=None, g_lse=None, g_ent=None,
           ignore_index=-100):
    """Everything in float64 from the full logits: a dict of the forward's values,
    dS, dh, dW and the quantities the bounds need."""
    raw = H64 @ W.T
    if softcap:
        t = np.tanh(raw / softcap)
        z, dcap = softcap * t, 1.0 - t * t
    else:
        z, dcap = raw, np.ones_like(raw)
    z, dcap = z / temperature, dcap / temperature
    M, V = z.shape
    m = z.max(1)
    lse = m + np.log(np.exp(z - m[:, None]).sum(1))
    p = np.exp(z - lse[:, None])
    mean_z = (p * z).sum(1)
    keep = y != ignore_index
    safe = np.where(keep, y, 0)
    out = dict(
        logp=np.where(keep, z[np.arange(M), safe] - lse, 0.0),
        lse=lse,
        entropy=lse - mean_z,
        is_top1=keep & (z.argmax(1) == safe),
        mean_logit=z.mean(1),
        z=z,
        A=(p * np.abs(z - mean_z[:, None])).sum(1),
        A_m=(p * np.abs(z - m[:, None])).sum(1),
    )
    g = np.where(keep, np.ones(M) if g is None else g, 0.0)
    gl = np.zeros(M) if g_lse is None else g_lse
    ge = np.zeros(M) if g_ent is None else g_ent
    onehot = np.zeros_like(z)
    onehot[np.arange(M)[keep], y[keep]] = 1.0
    ent_part = p * ge[:, None] * (z - mean_z[:, None]) * dcap
    ds = (g[:, None] * onehot + (gl - g)[:, None] * p) * dcap - ent_part
    # The fused backward keeps the entropy's rows relative to the maximum m:
    # p |g_e| dcap (|z - m| + |sum p z - m|) bounds the terms it sums and subtracts.
    ent_rel = p * np.abs(ge)[:, None] * dcap * (np.abs(z - m[:, None])
                                                + np.abs(mean_z - m)[:, None])
    out.update(dS=ds, dh=ds @ W, dW=ds.T @ H64, ent_part=ent_part, ent_rel=ent_rel)
    return out


def stats_backend(backend):
    """The backend an entropy call takes: a GPU without entropy kernels runs
    the fallback (fp32 on unrounded operands) even when asked for "native"."""
    if backend == "native" and not ops.native_stats(mx.default_device()):
        return "fallback"
    return backend


def check_stats(h, w, y, scales=None, biases=None, group_size=64, softcap=None,
                temperature=1.0, backend="native", want_dw=False, ignore_index=-100):
    backend_seen = stats_backend(backend)
    M, H = h.shape
    V = w.shape[0]
    W = as_seen(head_weight(w, scales, biases, group_size), h.dtype, backend_seen)
    if temperature != 1.0 and op_unit(h.dtype, backend_seen):
        # The GPU's multiplier sees h / T in fp32, rounded to the operand type.
        H64 = as_seen(h.astype(mx.float32) * (1.0 / temperature), h.dtype,
                      backend_seen) * temperature
    else:
        H64 = as_seen(h, h.dtype, backend_seen)
    y64 = np.array(y)
    g, g_lse, g_ent = (mx.random.normal((M,)) for _ in range(3))
    ref = oracle(H64, W, y64, softcap, temperature, to64(g), to64(g_lse), to64(g_ent),
                 ignore_index)
    kw = dict(group_size=group_size, softcap=softcap, temperature=temperature,
              backend=backend, ignore_index=ignore_index)
    st = fc.flash_cce_forward(h, w, y, scales, biases, entropy=True, **kw)
    assert isinstance(st, fc.TokenStats)
    assert st.is_top1.dtype == mx.bool_ and st.entropy.dtype == mx.float32

    B = (np.abs(H64) @ np.abs(W).T).max() / temperature
    zmax = np.abs(ref["z"]).max()
    dz = (H + 3) * U32 * B + 8 * U32 * zmax
    tol = 2 * dz + (V + 16) * U32 * (1 + np.abs(ref["lse"]).max())
    tol_ent = dz * (1 + ref["A"].max()) + (V + 16) * U32 * (1 + ref["A_m"].max())
    for name, t in (("logp", tol), ("lse", tol), ("entropy", tol_ent),
                    ("mean_logit", dz + V * U32 * zmax)):
        np.testing.assert_allclose(np.array(getattr(st, name)), ref[name], rtol=0, atol=t,
                                   err_msg=name)
    # is_top1 is exact where the top two logits are further apart than 2 dz.
    zs = np.sort(ref["z"], axis=1)
    clear = (zs[:, -1] - zs[:, -2] > 2 * dz) if V > 1 else np.ones(M, bool)
    assert (np.array(st.is_top1)[clear] == ref["is_top1"][clear]).all()

    out = fc.flash_cce_backward(h, w, y, st.lse, g, scales, biases, g_lse=g_lse,
                                entropy=st.entropy, g_entropy=g_ent, compute_dw=want_dw,
                                **kw)
    dh, dw = out if want_dw else (out, None)
    assert dh.shape == h.shape and dh.dtype == h.dtype
    uop = op_unit(h.dtype, backend_seen)
    dS, ent = np.abs(ref["dS"]), np.abs(ref["ent_part"])
    coef_err = 2 * dz + tol + tol_ent  # absolute error of (z_v - sum p z)
    safe_z = np.maximum(np.abs(ref["z"] - (ref["lse"] - ref["entropy"])[:, None]), 1e-30)
    ent_err = ent / safe_z * coef_err  # p |g_e| dcap times that error
    rel = (V + 4) * U32 + 4 * dz + uop
    tol_dh = UNIT[h.dtype] * np.abs(ref["dh"]) + rel * (dS @ np.abs(W)) + ent_err @ np.abs(W)
    np.testing.assert_array_less(np.abs(to64(dh) - ref["dh"]), tol_dh + 1e-12)

    # The same gradient through autodiff: the fused backward where the native
    # forward keeps its state (one more rounding of P and of the fp32 sums of
    # the entropy's rows relative to the maximum: ent_rel).
    def loss(h):
        st = fc.flash_cce_forward(h, w, y, scales, biases, entropy=True, **kw)
        return (g * st.logp + g_lse * st.lse + g_ent * st.entropy).sum()

    auto = mx.grad(loss)(h)
    tol_auto = tol_dh + (uop + (V + H + 8) * U32) * (ref["ent_rel"] @ np.abs(W))
    np.testing.assert_array_less(np.abs(to64(auto) - ref["dh"]), tol_auto + 1e-12)
    if want_dw:
        assert dw.shape == w.shape and dw.dtype == w.dtype
        rel_w = (M + 4) * U32 + 4 * dz + uop
        tol_dw = (UNIT[w.dtype] * np.abs(ref["dW"]) + rel_w * (dS.T @ np.abs(H64))
                  + ent_err.T @ np.abs(H64))
        np.testing.assert_array_less(np.abs(to64(dw) - ref["dW"]), tol_dw + 1e-12)
    return st, ref


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("softcap,temperature", [(None, 1.0), (3.0, 1.0), (None, 0.7),
                                                 (3.0, 2.5)])
def test_dense_stats(backend, dtype, softcap, temperature):
    h, w, y = make_inputs(29, 70, 333, dtype, scale=2.0, ignore=(3,))
    st, ref = check_stats(h, w, y, softcap=softcap, temperature=temperature,
                          backend=backend, want_dw=True)
    assert np.array(st.logp)[3] == 0 and not np.array(st.is_top1)[3]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32), (3, 128)])
def test_quantized_stats(backend, bits, group_size):
    h, w, y = make_inputs(9, 128, 150, mx.bfloat16)
    q, s, b = quantize(w, group_size, bits)
    check_stats(h, q, y, s, b, group_size=group_size, softcap=30.0, temperature=0.8,
                backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_top1_targets_and_many_blocks(backend):
    """Targets set to each row's arg-max (so is_top1 is True) and V long enough
    for several of the fallback's and the kernels' vocabulary blocks."""
    h, w, y = make_inputs(12, 40, 2100, scale=3.0)
    top = mx.argmax(h @ w.T, axis=1).astype(mx.int32)
    y = mx.where(mx.arange(12) % 2 == 0, top, y)
    st, ref = check_stats(h, w, y, backend=backend)
    assert ref["is_top1"][::2].all() and np.array(st.is_top1)[::2].all()
    if backend == "fallback":
        # Seven blocks of 300: the running entropy terms are rescaled as the
        # maximum moves; the same values as one block up to two fp32 sums of
        # V terms in different orders (test_head.py's (V + 16) u bound, twice).
        tol = 2 * (2100 + 16) * U32 * (1 + np.abs(ref["lse"]).max() + ref["A_m"].max())
        from flash_cce import fallback
        blocks = fallback.forward(h, w, y, stats=True, block=300)
        names = ("logp", "lse", "entropy", "is_top1", "mean_logit")
        for name, a in zip(names, blocks):
            want = np.array(getattr(st, name))
            if name == "is_top1":
                assert np.array_equal(np.array(a), want)
            else:
                np.testing.assert_allclose(np.array(a), want, rtol=0, atol=tol, err_msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_ignore_index_keeps_entropy(backend):
    """An ignored row has logp 0, no logp gradient, is_top1 False, and still its
    entropy (which does not depend on the target) and its gradient."""
    h, w, y = make_inputs(6, 16, 40)
    y[2] = 7
    st, ref = check_stats(h, w, y, backend=backend, ignore_index=7)
    assert np.array(st.logp)[2] == 0 and not np.array(st.is_top1)[2]
    assert np.array(st.entropy)[2] > 0


# Closed forms -----------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_zero_weight_is_uniform(backend, temperature):
    """W = 0: every logit is 0, so entropy = log V, mean_logit = 0, and the
    entropy's gradient -p_v (z_v - sum p z) vanishes: dh = 0 for g = 0."""
    V = 37
    h = mx.random.normal((5, 16))
    w = mx.zeros((V, 16))
    y = mx.array([0, 5, 36, 2, 9])
    st = fc.flash_cce_forward(h, w, y, entropy=True, temperature=temperature, softcap=5.0,
                              backend=backend)
    np.testing.assert_allclose(np.array(st.entropy), np.log(V), rtol=4e-7)
    assert not np.array(st.mean_logit).any()
    dh = mx.grad(lambda h: fc.flash_cce_forward(h, w, y, entropy=True, backend=backend,
                                                temperature=temperature).entropy.sum())(h)
    assert not np.array(dh).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_token_entropy_is_binary(backend):
    """V = 2, W = [[a], [0]], H = 1: z = (a h / T, 0), p = sigmoid(x), x = a h / T;
    entropy = -p log p - (1-p) log(1-p), d entropy / dh = -(a / T) x p (1 - p)."""
    a, T = 1.6875, 0.5
    h = mx.array([[-3.0], [-0.5], [0.0], [0.25], [4.0]])
    w = mx.array([[a], [0.0]])
    y = mx.zeros((5,), mx.int32)
    x = a * np.array(h)[:, 0].astype(np.float64) / T
    p = 1 / (1 + np.exp(-x))
    ent = -(p * np.log(p) + (1 - p) * np.log1p(-p))
    st = fc.flash_cce_forward(h, w, y, entropy=True, temperature=T, backend=backend)
    # A few ulp of lse (<= |x| + 1): the entropy is log S - R/S, both O(1).
    np.testing.assert_allclose(np.array(st.entropy), ent, rtol=0, atol=16 * U32 * (1 + np.abs(x).max()))
    dh = mx.grad(lambda h: fc.flash_cce_forward(h, w, y, entropy=True, temperature=T,
                                                backend=backend).entropy.sum())(h)
    want = -(a / T) * x * p * (1 - p)
    np.testing.assert_allclose(np.array(dh)[:, 0], want, rtol=0, atol=64 * U32 * (1 + np.abs(x).max()) * a / T)


# Gradients: finite differences and transforms ------------------------------------


@pytest.mark.parametrize("softcap,temperature", [(None, 1.0), (2.0, 0.6)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_finite_differences(softcap, temperature, backend):
    """Central differences of L(h) = sum(g logp + g_e entropy + g_l lse)
    (test_head.assert_finite_differences)."""
    M, H, V = 6, 64, 100
    h, w, y = make_inputs(M, H, V)
    g, ge, gl = (mx.random.normal((M,)) for _ in range(3))

    def L(h):
        st = fc.flash_cce_forward(h, w, y, softcap=softcap, temperature=temperature,
                                  entropy=True, stream=mx.cpu, backend=backend)
        return (g * st.logp + ge * st.entropy + gl * st.lse).sum()

    assert_finite_differences(L, h)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dw_finite_differences(backend):
    M, H, V = 5, 8, 12
    h, w, y = make_inputs(M, H, V)

    def L(w):
        st = fc.flash_cce_forward(h, w, y, softcap=4.0, temperature=1.5, entropy=True,
                                  stream=mx.cpu, backend=backend)
        return (st.logp + 0.5 * st.entropy).sum()

    assert_finite_differences(L, w, directions=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_compile_vmap(backend):
    B, M, H, V = 3, 5, 16, 40
    h = mx.random.normal((B, M, H))
    y = mx.random.randint(0, V, (B, M))
    w = mx.random.normal((V, H)) * 0.3

    def loss(h, w, y):
        st = fc.flash_cce_forward(h, w, y, entropy=True, temperature=0.9, softcap=6.0,
                                  backend=backend, validate_targets=False)
        return (st.logp - 0.1 * st.entropy).sum()

    eager = mx.value_and_grad(loss, argnums=(0, 1))(h, w, y)
    compiled = mx.compile(mx.value_and_grad(loss, argnums=(0, 1)))(h, w, y)
    np.testing.assert_allclose(eager[0].item(), compiled[0].item(), rtol=1e-6)
    for a, b in zip(eager[1], compiled[1]):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-7)

    per = mx.vmap(mx.grad(loss), in_axes=(0, None, 0))(h, w, y)
    loop = mx.stack([mx.grad(loss)(h[i], w, y[i]) for i in range(B)])
    np.testing.assert_allclose(np.array(per), np.array(loop), rtol=1e-5, atol=1e-6)
    ent = mx.vmap(lambda h, y: fc.flash_cce_forward(h, w, y, entropy=True, backend=backend,
                                                    validate_targets=False).entropy)(h, y)
    ent_loop = mx.stack([fc.flash_cce_forward(h[i], w, y[i], entropy=True,
                                              backend=backend).entropy for i in range(B)])
    np.testing.assert_allclose(np.array(ent), np.array(ent_loop), rtol=1e-6, atol=1e-6)


def test_backends_agree():
    """The native kernels and the fallback on the same call (parity)."""
    h, w, y = make_inputs(16, 48, 3000, mx.bfloat16)
    kw = dict(softcap=30.0, temperature=0.7, entropy=True)
    a = fc.flash_cce_forward(h, w, y, **kw)
    b = fc.flash_cce_forward(h, w, y, backend="fallback", **kw)
    for name in ("logp", "entropy", "lse", "mean_logit"):
        np.testing.assert_allclose(np.array(getattr(a, name)), np.array(getattr(b, name)),
                                   rtol=1e-5, atol=1e-5, err_msg=name)
    assert np.array_equal(np.array(a.is_top1), np.array(b.is_top1))


def test_linear_logprobs_result_and_temperature_one_unchanged():
    """linear_logprobs(entropy=True) gives the TokenStats; entropy off and
    temperature 1 are today's call (the same values, bit for bit)."""
    h, w, y = make_inputs(7, 32, 90)
    st = fc.linear_logprobs(h, w, y, entropy=True, temperature=1.0)
    assert st._fields == ("logp", "entropy", "lse", "is_top1", "mean_logit")
    plain = fc.linear_logprobs(h, w, y)
    assert np.array_equal(np.array(plain), np.array(fc.linear_logprobs(h, w, y, temperature=1)))
    # Two fp32 computations of logp = s_y - lse (on a GPU one of them the
    # fallback): sums of V = 90 exponentials in two orders, (V + 16) u (1 + |lse|)
    # each, and the GPU's exp/log approximations (a few 2^-22 relative).
    unit = 2.0**-21 if GPU else U32
    atol = (2 * (90 + 16) * U32 + 4 * unit) * (1 + np.abs(np.array(st.lse)).max())
    np.testing.assert_allclose(np.array(st.logp), np.array(plain), rtol=0, atol=atol)


# Bad input and routing ----------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1", True, None])
def test_bad_temperature(bad):
    h, w, y = make_inputs(2, 8, 10)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        fc.flash_cce_forward(h, w, y, temperature=bad)
    with pytest.raises(ValueError, match="temperature"):
        fc.flash_cce_backward(h, w, y, mx.zeros((2,)), mx.ones((2,)), temperature=bad)


def test_bad_entropy_arguments():
    h, w, y = make_inputs(2, 8, 10)
    with pytest.raises(ValueError, match="entropy must be True or False"):
        fc.flash_cce_forward(h, w, y, entropy="yes")
    with pytest.raises(ValueError, match="fused_backward must be True or False"):
        fc.flash_cce_forward(h, w, y, fused_backward=None)
    with pytest.raises(ValueError, match="g_entropy and entropy"):
        fc.flash_cce_backward(h, w, y, mx.zeros((2,)), mx.ones((2,)), g_entropy=mx.ones((2,)))
    with pytest.raises(ValueError, match="entropy must have shape"):
        fc.flash_cce_backward(h, w, y, mx.zeros((2,)), mx.ones((2,)), entropy=mx.ones((3,)),
                              g_entropy=mx.ones((2,)))
    with pytest.raises(ValueError, match="linear_logprobs"):
        fc.linear_cross_entropy(h, w, y, entropy=True)


def test_metal_gpu_runs_entropy_natively_where_the_gate_allows(monkeypatch):
    """On a Metal GPU (a gated device, injected here as the CPU) calls that
    request the entropy run the native kernels where the configuration passed
    its self-check (which covers the entropy path), else the fallback; a
    device whose kernels lack the statistics (CUDA's) runs the fallback."""
    monkeypatch.setattr(metal, "gated", lambda device: device.type == mx.cpu)
    allowed, asked = [], []
    monkeypatch.setattr(metal.GATE, "allows",
                        lambda spec, entropy=False: asked.append(entropy) or allowed[-1])
    calls = []
    real = ops.fallback.forward
    monkeypatch.setattr(ops.fallback, "forward",
                        lambda *a, **k: calls.append(k.get("stats")) or real(*a, **k))
    h, w, y = make_inputs(4, 16, 30)
    want = fc.flash_cce_forward(h, w, y, entropy=True, backend="fallback")
    assert calls == [True]
    allowed.append(True)
    st = fc.flash_cce_forward(h, w, y, entropy=True, stream=mx.cpu)
    assert calls == [True] and ops.native_stats(mx.cpu)
    assert asked == [True]  # the gate's entropy check, not only the logp one
    fc.flash_cce_forward(h, w, y, stream=mx.cpu)
    assert asked == [True, False]
    np.testing.assert_allclose(np.array(st.entropy), np.array(want.entropy), rtol=1e-5, atol=1e-5)
    allowed.append(False)
    fc.flash_cce_forward(h, w, y, entropy=True, stream=mx.cpu)
    assert calls == [True, True]
    allowed.append(True)
    monkeypatch.setattr(ops._ext, "supports_stats", lambda device: False)
    fc.flash_cce_forward(h, w, y, entropy=True, stream=mx.cpu)
    assert calls == [True, True, True]


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_rows_and_leading_dims(backend):
    w = mx.random.normal((10, 16))
    st = fc.flash_cce_forward(mx.zeros((2, 0, 16)), w, mx.zeros((2, 0), mx.int32),
                              entropy=True, backend=backend)
    assert all(a.shape == (2, 0) for a in st) and st.is_top1.dtype == mx.bool_
    h = mx.random.normal((2, 3, 16))
    y = mx.random.randint(0, 10, (2, 3))
    st = fc.flash_cce_forward(h, w, y, entropy=True, backend=backend)
    flat = fc.flash_cce_forward(h.reshape(6, 16), w, y.reshape(6), entropy=True, backend=backend)
    for a, b in zip(st, flat):
        assert a.shape == (2, 3)
        assert np.array_equal(np.array(a).reshape(6), np.array(b))
