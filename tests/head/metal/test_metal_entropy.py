"""The Metal head's entropy statistics, emulated on the CPU through the launch
plans the Metal host encodes (Problem::stats), against float64.

Forward: logp, lse, entropy = lse - sum_v p_v s_v, is_top1 (the target is the
first arg-max and not ignored), mean_logit = mean_v s_v over the final logits
s. Backward: dS = (g [v == y] + (g_lse - g) p_v - g_ent p_v (s_v - zbar)) dcap_v
with zbar = lse - entropy, for dh and dW.

Bounds, with u = 2^-24, ds the worst-case error of one logit (test_metal_head's
Head.ds(): an fp32 dot product of length H) and B_row = max_v |s_v - zbar|:
  - entropy = log S - R / S with S = sum e_v, R = sum e_v (s_v - max) (all
    terms of R share a sign, so both sums carry (V + 16) u relative error, as
    lse's does), plus the logits' error carried by dE/ds_v = -p_v (s_v - zbar):
      |dE| <= 2 ds B_row + (V + 16) u (1 + 2 |R / S| + |E|),   R / S = zbar - max;
  - mean_logit sums V logits: |d| <= ds + (V + 4) u max_v |s_v|;
  - is_top1 is exact where the gap between the two largest logits exceeds 2 ds
    (rows with a smaller gap are not compared; the tests make none);
  - dh, dW: as test_metal_head's bounds with |dS| replaced by
    A = (|g| [v = y] + (|g_lse - g| + |g_ent| |s_v - zbar|) p_v) dcap_v, plus the
    entropy coefficient's own error |g_ent| p_v dcap_v (ds + e_zbar + 2 u |s_v - zbar|),
    e_zbar the float32 rounding of the lse and entropy the backward is given.
"""

import mlx.core as mx
import numpy as np
import pytest

import head_emu as he
import metal_emu
from test_metal_head import TINY, U32, UNIT, Head, program, ref_logits

pytestmark = pytest.mark.skipif(metal_emu.find_compiler() is None, reason="needs clang++")


def ref_stats(p: Head, softcap):
    """float64 logits, dcap, lse, softmax, entropy, first arg-max, mean logit."""
    s, dcap = ref_logits(p, softcap)
    top = s.max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(s - top).sum(axis=1))
    P = np.exp(s - lse[:, None])
    ent = lse - (P * s).sum(axis=1)
    return s, dcap, lse, P, ent, s.argmax(axis=1), s.mean(axis=1)


def ent_kw(p: Head, **kw):
    return p.kw(stats=True, **kw)


def run_forward(prog, p: Head, softcap, seed=0, **plan_kw):
    plan = he.plan("forward", p.M, p.H, p.V, softcap=softcap or 0.0, **ent_kw(p, **plan_kw))
    a = p.operands()
    a.update(logp=np.full(p.M, np.nan, np.float32), lse=np.full(p.M, np.nan, np.float32),
             entropy=np.full(p.M, np.nan, np.float32), mean_logit=np.full(p.M, np.nan, np.float32),
             is_top1=np.full(p.M, 7, np.uint8))  # 7: neither bool, shows an unwritten row
    he.run_plan(prog, plan, a, seed=seed)
    return a


def run_backward(prog, p: Head, softcap, lse, ent, g_ent, compute_dw, seed=0, stats=True,
                 **plan_kw):
    kw = ent_kw(p, **plan_kw) if stats else p.kw(**plan_kw)
    plan = he.plan("backward", p.M, p.H, p.V, softcap=softcap or 0.0, compute_dw=compute_dw,
                   **kw)
    a = p.operands()
    a.update(lse=lse.astype(np.float32), g=p.g, g_lse=p.g_lse,
             dh=np.zeros((p.M, p.H), he.STORAGE[p.dtype]))
    if stats:
        a.update(entropy=ent.astype(np.float32), g_ent=g_ent.astype(np.float32))
    if compute_dw:
        a["dw"] = np.zeros((p.V, p.H), he.STORAGE[p.w_dtype])
    he.run_plan(prog, plan, a, seed=seed)
    return a


def check_forward(prog, p: Head, softcap, seed=0, **plan_kw):
    s, _, lse, P, ent, arg, mean = ref_stats(p, softcap)
    out = run_forward(prog, p, softcap, seed=seed, **plan_kw)
    ds = p.ds()
    u = U32
    tol_lse = 2 * ds + (p.V + 16) * u * (1 + np.abs(lse).max())
    ok = (p.y >= 0) & (p.y < p.V) | (p.y == p.ignore_index)
    np.testing.assert_allclose(out["lse"], lse, rtol=0, atol=tol_lse)
    logp = np.where(p.y == p.ignore_index, 0.0, s[np.arange(p.M), np.clip(p.y, 0, p.V - 1)] - lse)
    np.testing.assert_allclose(out["logp"][ok], logp[ok], rtol=0, atol=tol_lse)
    assert np.isnan(out["logp"][~ok]).all()

    zbar = lse - ent
    spread = np.abs(s - zbar[:, None]).max(axis=1)
    r_over_s = zbar - s.max(axis=1)
    tol_ent = 2 * ds * spread + (p.V + 16) * u * (1 + 2 * np.abs(r_over_s) + np.abs(ent))
    np.testing.assert_array_less(np.abs(out["entropy"] - ent), tol_ent)
    tol_mean = ds + (p.V + 4) * u * np.abs(s).max(axis=1)
    np.testing.assert_array_less(np.abs(out["mean_logit"] - mean), tol_mean)

    top2 = np.sort(s, axis=1)[:, -2:] if p.V > 1 else np.stack([s[:, 0] - 1, s[:, 0]], 1)
    clear = (top2[:, 1] - top2[:, 0]) > 2 * ds
    want = (p.y == arg) & (p.y != p.ignore_index)
    assert set(np.unique(out["is_top1"])) <= {0, 1}
    np.testing.assert_array_equal(out["is_top1"][clear].astype(bool), want[clear])
    return out, (s, lse, P, ent)


def check_backward(prog, p: Head, softcap, g_ent, compute_dw=False, seed=0, **plan_kw):
    s, dcap, lse, _, ent, _, _ = ref_stats(p, softcap)
    lse32, ent32 = lse.astype(np.float32), ent.astype(np.float32)
    lse_in, ent_in = lse32.astype(np.float64), ent32.astype(np.float64)
    ds, u = p.ds(), U32
    e_lse = u * (1 + np.abs(lse).max())
    e_zbar = 2 * u * (np.abs(lse) + np.abs(ent) + 1)
    keep = (p.y != p.ignore_index) & (p.y >= 0) & (p.y < p.V)
    g, g_lse = np.where(keep, p.g, 0.0), p.g_lse.astype(np.float64)
    ge = g_ent.astype(np.float32).astype(np.float64)
    zbar = lse_in - ent_in
    P = np.exp(s - lse_in[:, None])
    rel = s - zbar[:, None]
    onehot = np.zeros_like(s)
    onehot[np.arange(p.M)[keep], p.y[keep]] = 1
    dS = (g[:, None] * onehot + ((g_lse - g)[:, None] - ge[:, None] * rel) * P) * dcap
    A = (np.abs(g)[:, None] * onehot +
         (np.abs(g_lse - g)[:, None] + np.abs(ge)[:, None] * np.abs(rel)) * P) * dcap
    own = np.abs(ge)[:, None] * P * dcap * (ds + e_zbar[:, None] + 2 * u * np.abs(rel))

    bw = run_backward(prog, p, softcap, lse32, ent32, g_ent, compute_dw, seed=seed, **plan_kw)
    ref_dh = dS @ p.W64
    tol_dh = UNIT[p.dtype] * np.abs(ref_dh) + TINY[p.dtype] + \
        (((p.V + 4) * u + 4 * ds + e_lse) * A + own) @ np.abs(p.W64)
    np.testing.assert_array_less(np.abs(he.to_f64(bw["dh"], p.dtype) - ref_dh), tol_dh + 1e-30)
    if compute_dw:
        ref_dw = dS.T @ p.H64
        tol_dw = UNIT[p.w_dtype] * np.abs(ref_dw) + TINY[p.w_dtype] + \
            (((p.M + 4) * u + 4 * ds + e_lse) * A + own).T @ np.abs(p.H64)
        np.testing.assert_array_less(np.abs(he.to_f64(bw["dw"], p.w_dtype) - ref_dw),
                                     tol_dw + 1e-30)
    return bw


def g_ent_of(p: Head, seed):
    return np.random.default_rng(seed).standard_normal(p.M).astype(np.float32)


def with_top1_targets(p: Head, softcap, rows):
    """Targets at the arg-max for `rows`, so that is_top1 holds somewhere."""
    arg = ref_stats(p, softcap)[5]
    for i in rows:
        p.y[i] = arg[i]
    return p


# --- Builds -----------------------------------------------------------------

QUANT = [(4, "f32"), (8, "f32"), (4, "bf16")]  # (bits, dtype of h and the scales)

def ent_plans(p: Head, softcap=0.0, compute_dw=True, **kw):
    c = softcap or 0.0
    return [he.plan("forward", p.M, p.H, p.V, softcap=c, **ent_kw(p, **kw)),
            he.plan("backward", p.M, p.H, p.V, softcap=c, compute_dw=compute_dw,
                    **ent_kw(p, **kw))]


def ent_kernels():
    names = set()
    for dt in ("f32", "f16", "bf16"):
        names |= he.plan_kernels(*ent_plans(Head(2, 8, 40, dt), dw_slab_rows=32))
        # the same head without the entropy, for the g_ent = 0 comparison
        names |= he.plan_kernels(he.plan("backward", 2, 8, 40, compute_dw=True,
                                         **Head(2, 8, 40, dt).kw(dw_slab_rows=32)))
    for bits, dt in QUANT:
        names |= he.plan_kernels(*ent_plans(Head(2, 64, 40, dt, quant=(bits, 64), sb_dtype=dt),
                                            compute_dw=False))
    return names


@pytest.fixture(scope="module")
def ent():
    return program(ent_kernels())


# --- Tests ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_entropy_dense(ent, dtype, softcap):
    # Two m tiles (the second partial), H in three BK steps, V in 11 blocks
    # over 3 splits (statistics merged by the combine), two dW slabs for a
    # half-precision w, ignored rows.
    p = Head(37, 70, 333, dtype, ignore=(0, 5), seed=40 + len(dtype) + int(softcap or 0))
    with_top1_targets(p, softcap, (1, 2, 3))
    out, _ = check_forward(ent, p, softcap, max_splits=3)
    assert out["is_top1"][[1, 2, 3]].all() and not out["is_top1"][[0, 5]].any()
    check_backward(ent, p, softcap, g_ent_of(p, 1), compute_dw=True, seed=1, max_splits=3,
                   dw_slab_rows=192)


def test_entropy_rounds_move_the_maximum(ent):
    # A large logit scale and one split of 11 blocks walked in rounds of two:
    # the running maximum moves across blocks and across launches, so r is
    # rescaled (and resumed from part_ent) many times; dh and dW at H = 300 (two
    # register chunks, the second's coefficients read from the stage).
    p = Head(37, 300, 333, "f32", ignore=(4,), scale=4.0, seed=44)
    with_top1_targets(p, 3.0, (5, 6))
    check_forward(ent, p, 3.0, max_splits=1, round_blocks=2, round_m_tiles=1)
    check_backward(ent, p, 3.0, g_ent_of(p, 2), compute_dw=True, seed=2, max_splits=2,
                   round_blocks=2, round_m_tiles=1, dw_slab_rows=64)


def test_entropy_ignore_index_and_out_of_range(ent):
    # A custom ignore_index that is a real token id (never top-1), an
    # out-of-range target (NaN logp); the entropy and its gradient exist for
    # every row regardless of its target.
    p = Head(12, 24, 90, "bf16", ignore=(1, 4), out_of_range=(6,), ignore_index=7, seed=46)
    # Row 1's largest logit is at token 7, its (ignored) target: not top-1.
    p.w[7] = he.to_storage(he.to_f64(p.h[1:2], "bf16")[0] / 4, "bf16")
    p.W64 = he.to_f64(p.w, "bf16")
    p.Wabs = np.abs(p.W64)
    assert ref_stats(p, None)[5][1] == 7
    with_top1_targets(p, None, (2, 3))
    out, _ = check_forward(ent, p, None)
    assert out["is_top1"][[2, 3]].all() and not out["is_top1"][[1, 4, 6]].any()
    p.g[:], p.g_lse[:] = 0, 0
    bw = check_backward(ent, p, None, g_ent_of(p, 3), compute_dw=True, seed=3)
    assert (bw["dh"][[1, 4]] != 0).any()  # ignored rows: the entropy's gradient only


def test_entropy_first_arg_max_on_ties(ent):
    # Two identical rows of w (vocabulary 3 and 300, in different splits) hold
    # the largest logit of rows 0 and 1 (h[1] = h[0]): the first copy is the
    # arg-max, so the target 3 is top-1 and the target 300 is not.
    p = Head(4, 40, 333, "f32", seed=47)
    p.h[1] = p.h[0]
    p.H64 = he.to_f64(p.h, "f32")
    w = (p.H64[0] / np.linalg.norm(p.H64[0]) * 2).astype(np.float32)
    p.w[3] = p.w[300] = w
    p.W64 = he.to_f64(p.w, "f32")
    p.Wabs = np.abs(p.W64)
    p.y[:2] = [3, 300]
    s = ref_stats(p, None)[0]
    assert s[0, 3] == s[0, 300] and s[0].argmax() == 3
    out = run_forward(ent, p, None, max_splits=3)
    assert out["is_top1"][0] == 1 and out["is_top1"][1] == 0


@pytest.mark.parametrize("bits,dtype", QUANT)
def test_entropy_quantized(ent, bits, dtype):
    # float32 tiles, and bfloat16 ones (h and scales in bfloat16).
    p = Head(9, 128, 150, dtype, quant=(bits, 64), sb_dtype=dtype, ignore=(2,),
             seed=48 + bits + len(dtype))
    with_top1_targets(p, 30.0, (0, 1))
    check_forward(ent, p, 30.0, max_splits=2)
    check_backward(ent, p, 30.0, g_ent_of(p, 4), seed=4, max_splits=2)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_entropy_zero_cotangent_matches_the_plain_backward(ent, dtype):
    # With g_ent = 0 the entropy kernels' dS is the plain kernels' dS bit for
    # bit (c = coef - 0 (s - zbar) = coef): dh and dW are identical.
    p = Head(37, 70, 333, dtype, ignore=(3,), seed=49)
    _, _, lse, _, e, _, _ = ref_stats(p, 3.0)
    zero = np.zeros(p.M, np.float32)
    a = run_backward(ent, p, 3.0, lse, e, zero, True, max_splits=3, dw_slab_rows=192)
    b = run_backward(ent, p, 3.0, lse, e, zero, True, stats=False, max_splits=3,
                     dw_slab_rows=192)
    np.testing.assert_array_equal(a["dh"], b["dh"])
    np.testing.assert_array_equal(a["dw"], b["dw"])


def test_entropy_plans():
    # The entropy's forward is the plain one with its statistics (never the
    # fused forward), its backward the register kernel; both ask for their
    # kernels only when asked, and keep three more [splits, M] scratch rows.
    p = Head(37, 70, 333, "bf16")
    fwd, bwd = ent_plans(p, max_splits=3)
    assert he.plan_kernels(fwd) == {"fcce_fwd_ent_hbf16_wbf16", "fcce_combine_ent"}
    assert he.plan_kernels(bwd) == {"fcce_dhreg_ent_hbf16_wbf16", "fcce_reduce_dh_bf16",
                                    "fcce_dw_ent_hbf16_wbf16", "fcce_cast_bf16"}
    plain = he.plan("forward", p.M, p.H, p.V, **p.kw(max_splits=3))
    assert not any("ent" in k for k in he.plan_kernels(plain))
    roles = {s["role"]: s["bytes"] for s in fwd["scratch"]}
    assert roles["part_ent"] == roles["part_lsum"] == roles["part_arg"] == roles["part_max"]
    for bad in (dict(fused=True), dict(acc_registers=-1)):
        pass_ = "forward" if "fused" in bad else "backward"
        with pytest.raises(ValueError, match="entropy"):
            he.plan(pass_, 3, 8, 10, stats=True, **bad)
    with pytest.raises(ValueError, match="entropy"):
        he.plan("fused_dh", 3, 8, 10, stats=True)


# --- Mutations ----------------------------------------------------------------
# Each variant is one exact edit of the kernel source (metal_emu.mutate raises
# when the text is missing or ambiguous); the unmodified kernels pass the same
# checks above.

MUTATIONS = {
    # r kept relative to a maximum that has moved on: the online rescale dropped
    "r_not_rescaled": ("ent.r = f * (ent.r + (run_max - new_max) * run_sum) + row_sum4(part_r);",
                       "ent.r = ent.r + row_sum4(part_r);", "forward"),
    # the combine adds the splits' r without moving them to the global maximum
    "combine_not_rescaled": ("r += f * (parts.r[at] + (part_max[at] - gmax) * part_sum[at]);",
                             "r += parts.r[at];", "forward"),
    # a resumed round restarts r, the logit sum and the arg-max
    "ent_not_resumed": ("ent = RowEnt{ent_parts.r[at], ent_parts.lsum[at], ent_parts.arg[at]};",
                        "(void)0;", "forward"),
    # the backward's dS loses the entropy's share
    "no_entropy_share": ("c -= r.ge * (s[j] - r.zbar);", "(void)c;", "backward"),
}


@pytest.fixture(scope="module")
def rounds_head():
    # One split walked in rounds of two blocks with large logits (the
    # maximum moves across blocks and rounds), three splits for the combine.
    return Head(37, 40, 333, "f32", ignore=(4,), scale=4.0, seed=50)


def _mutant(name):
    old, new, _ = MUTATIONS[name]
    fwd, bwd = ent_plans(Head(2, 8, 40), compute_dw=False)
    source = he.kernel_source(he.plan_kernels(fwd, bwd))
    return he.build(source=metal_emu.mutate(source, old, new))


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_entropy_mutation_is_caught(rounds_head, name):
    prog = _mutant(name)
    p = rounds_head
    with pytest.raises(AssertionError):
        if MUTATIONS[name][2] == "forward":
            kw = dict(max_splits=3) if name == "combine_not_rescaled" else \
                dict(max_splits=1, round_blocks=2)
            check_forward(prog, p, 3.0, **kw)
        else:
            check_backward(prog, p, 3.0, g_ent_of(p, 5), max_splits=3)
