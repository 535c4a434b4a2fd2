"""The Metal head's kernels, emulated on the CPU through the launch plan the
Metal host encodes, against the float64 reference (tests/reference.py).

Tolerances, as in tests/head/test_head.py: inputs are rounded to their dtype first
and the reference uses the rounded values, so the differences are the
kernels' float32 arithmetic and the rounding of outputs. With u = 2^-24 and
B = |h| @ |W|^T:
  - a logit is a length-H fp32 dot product of the operands as the kernels'
    tiles hold them: |ds| <= (H + 2) u B, plus, for a quantized head, the
    dequantization's error per weight. MLX's QuantizedBlockLoader computes
    scale q + bias in the tile type T (the common type of h and the scales:
    bfloat16 for a bfloat16 h with bfloat16 scales), two roundings of unit
    u_T: |w~ - w| <= u_T |scale q| + u_T |scale q + bias| (1 + u_T)
    <= (2 + u_T) u_T (|scale q| + |bias|) =: u_deq Wabs. A dense head's tiles
    hold its inputs exactly (T is their dtype, or float32);
  - lse and logp add V u relative from the sums of V exponentials and a few u
    from exp/log: |dlse| <= 2 ds + (V + 16) u (1 + |lse|);
  - dh, dW and gsum sum V (or M) products of factors with relative error
    <= 4 ds (+ the error of the lse they were given) plus fp32 accumulation,
    then round once to the output dtype (half its subnormal spacing more
    where the result is subnormal there):
    |d dh| <= u_out |dh| + tiny_out + ((V + 4) u + 4 ds + e_lse) (|dS| @ |W|),
    plus u_deq (|dS| @ Wabs) for the dequantized weights' own error;
  - the fused dh, (g_lse - g) gsum + g dcap_y W_y, carries gsum's error times
    |g_lse - g|, and with a softcap dcap_y = 1 - t^2 from t = (logp + lse) / cap
    moves by at most 2 e_sy / cap, e_sy the error of logp + lse.
The backward is given the reference lse rounded to float32 (e_lse = u (1 + |lse|)).
"""

import os

import mlx.core as mx
import numpy as np
import pytest

import head_emu as he
import metal_emu
from reference import dequantize, forward_backward

U32 = 2.0**-24
UNIT = {"f32": 2.0**-24, "bf16": 2.0**-8, "f16": 2.0**-11}
# Rounding into a dtype's subnormal range errs by up to half its subnormal
# spacing, which no relative bound covers (a float16 dh entry below 2^-14 can
# be off by 2^-25 = 3.0e-8); added to the bounds of outputs in that dtype.
TINY = {"f32": 2.0**-150, "bf16": 2.0**-134, "f16": 2.0**-25}
DTYPES = ["f32", "f16", "bf16"]
# The full sweep (quantized heads with float16 and bfloat16 h too) is opt-in.
SWEEP = os.environ.get("FLASH_CCE_METAL_SWEEP") == "1"

pytestmark = pytest.mark.skipif(metal_emu.find_compiler() is None, reason="needs clang++")


# --- Problems ---------------------------------------------------------------

class Head:
    """One head problem: host arrays in storage form and float64 values."""

    def __init__(self, M, H, V, dtype="f32", w_dtype=None, ignore=(), scale=2.0, seed=0,
                 quant=None, sb_dtype="f32", out_of_range=(), ignore_index=-100):
        rng = np.random.default_rng(seed)
        self.ignore_index = ignore_index
        self.M, self.H, self.V, self.dtype = M, H, V, dtype
        self.h = he.to_storage(rng.standard_normal((M, H)) * scale, dtype)
        self.H64 = he.to_f64(self.h, dtype)
        w = rng.standard_normal((V, H)) / np.sqrt(H)
        self.quant = quant
        if quant:
            bits, gs = quant
            self.w_dtype, self.sb_dtype = None, sb_dtype
            mxdt = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}[sb_dtype]
            q, s, b = mx.quantize(mx.array(w.astype(np.float32)).astype(mxdt), group_size=gs,
                                  bits=bits)
            self.w = np.array(q)
            self.scales = he.to_storage(np.array(s.astype(mx.float32)), sb_dtype)
            self.biases = he.to_storage(np.array(b.astype(mx.float32)), sb_dtype)
            self.W64 = dequantize(q, s, b, gs)
            # |scale q| + |bias| per weight: the dequantization's rounding scale.
            self.Wabs = dequantize(q, mx.abs(s), mx.abs(b), gs)
            # The kernels' tile type and the dequantization's error per unit
            # of Wabs (module docstring).
            u_tile = UNIT[dtype if dtype == sb_dtype else "f32"]
            self.u_deq = (2 + u_tile) * u_tile
        else:
            self.w_dtype = w_dtype or dtype
            self.w = he.to_storage(w, self.w_dtype)
            self.W64 = he.to_f64(self.w, self.w_dtype)
            self.Wabs = np.abs(self.W64)
            self.u_deq = 0.0
        self.y = rng.integers(0, V, M).astype(np.int32)
        for i in ignore:
            self.y[i] = ignore_index
        for i in out_of_range:
            self.y[i] = V + 3
        self.g = rng.standard_normal(M).astype(np.float32)
        self.g_lse = (rng.standard_normal(M) * 0.5).astype(np.float32)

    def kw(self, **extra):
        kw = dict(h=self.dtype, ignore_index=self.ignore_index)
        if self.quant:
            kw.update(quantized=True, bits=self.quant[0], group_size=self.quant[1],
                      sb=self.sb_dtype)
        else:
            kw.update(w=self.w_dtype)
        kw.update(extra)
        return kw

    def operands(self):
        a = {"h": self.h, "w": self.w, "targets": self.y}
        if self.quant:
            a.update(scales=self.scales, biases=self.biases)
        return a

    def ds(self):
        """Worst-case error of one logit."""
        B = np.abs(self.H64) @ np.abs(self.W64).T
        Bq = np.abs(self.H64) @ self.Wabs.T if self.quant else 0.0
        return (self.H + 2) * U32 * B.max() + self.u_deq * np.max(Bq)


def reference(p: Head, softcap, g=None, g_lse=None):
    y = p.y.astype(np.int64)
    valid = (y >= 0) & (y < p.V) | (y == p.ignore_index)
    y_ref = np.where(valid, y, p.ignore_index)  # out-of-range rows: compared separately
    return forward_backward(p.H64, p.W64, y_ref, g, g_lse, softcap, p.ignore_index)


def ref_logits(p: Head, softcap):
    """float64 final logits s and the softcap's derivative dcap."""
    raw = p.H64 @ p.W64.T
    if softcap:
        t = np.tanh(raw / softcap)
        return softcap * t, 1 - t * t
    return raw, np.ones_like(raw)


def ref_ds(p: Head, softcap, g, g_lse, lse):
    s, dcap = ref_logits(p, softcap)
    keep = (p.y != p.ignore_index) & (p.y >= 0) & (p.y < p.V)
    gm = np.where(keep, g, 0.0)
    P = np.exp(s - lse[:, None])
    onehot = np.zeros_like(s)
    onehot[np.arange(p.M)[keep], p.y[keep]] = 1
    return (gm[:, None] * onehot + (g_lse - gm)[:, None] * P) * dcap, s, dcap


# --- Runs -------------------------------------------------------------------

def run_forward(prog, p: Head, softcap, fused, seed=0, **plan_kw):
    plan = he.plan("forward", p.M, p.H, p.V, softcap=softcap or 0.0, fused=fused,
                   **p.kw(**plan_kw))
    a = p.operands()
    a.update(logp=np.zeros(p.M, np.float32), lse=np.zeros(p.M, np.float32),
             gsum=np.zeros((p.M, p.H), np.float32))
    he.run_plan(prog, plan, a, seed=seed)
    return a


def run_backward(prog, p: Head, softcap, lse, compute_dw, seed=0, **plan_kw):
    plan = he.plan("backward", p.M, p.H, p.V, softcap=softcap or 0.0, compute_dw=compute_dw,
                   **p.kw(**plan_kw))
    a = p.operands()
    a.update(lse=lse.astype(np.float32), g=p.g, g_lse=p.g_lse,
             dh=np.zeros((p.M, p.H), he.STORAGE[p.dtype]))
    if compute_dw:
        a["dw"] = np.zeros((p.V, p.H), he.STORAGE[p.w_dtype])
    he.run_plan(prog, plan, a, seed=seed)
    return a


def run_fused_dh(prog, p: Head, softcap, gsum, logp, lse, seed=0):
    plan = he.plan("fused_dh", p.M, p.H, p.V, softcap=softcap or 0.0, out=p.dtype, **p.kw())
    a = p.operands()
    del a["h"]
    a.update(gsum=gsum, logp=logp, lse=lse, g=p.g, g_lse=p.g_lse,
             dh=np.zeros((p.M, p.H), he.STORAGE[p.dtype]))
    he.run_plan(prog, plan, a, seed=seed)
    return a


def plans_for(p: Head, softcap, compute_dw=False, **kw):
    """The launch plans a full check of p runs (for building their kernels)."""
    c = softcap or 0.0
    # Both kernels of the fused forward and of dh, whichever the plan picks.
    out = [he.plan("forward", p.M, p.H, p.V, softcap=c, fused=f, **p.kw(**kw, acc_registers=r))
           for f, r in ((False, 0), (True, 1), (True, -1))]
    for regs in (1, -1):
        out.append(he.plan("backward", p.M, p.H, p.V, softcap=c, compute_dw=compute_dw,
                           **p.kw(**kw, acc_registers=regs)))
    out.append(he.plan("fused_dh", p.M, p.H, p.V, softcap=c, out=p.dtype, **p.kw()))
    return out


# --- Checks -----------------------------------------------------------------

def check_backward(prog, p: Head, softcap, ref_lse, compute_dw=False, seed=0, **plan_kw):
    """The backward (dh, dW) from the float32-rounded reference lse."""
    cap = softcap or None
    ds = p.ds()
    lse32 = ref_lse.astype(np.float32)
    e_lse = U32 * (1 + np.abs(ref_lse).max())
    g, g_lse = p.g.astype(np.float64), p.g_lse.astype(np.float64)
    dS, _, _ = ref_ds(p, cap, g, g_lse, lse32.astype(np.float64))
    ref_dh = dS @ p.W64
    bw = run_backward(prog, p, softcap, lse32, compute_dw, seed=seed, **plan_kw)
    dh = he.to_f64(bw["dh"], p.dtype)
    tol_dh = UNIT[p.dtype] * np.abs(ref_dh) + TINY[p.dtype] + \
        ((p.V + 4) * U32 + 4 * ds + e_lse) * (np.abs(dS) @ np.abs(p.W64)) + \
        p.u_deq * (np.abs(dS) @ p.Wabs)
    np.testing.assert_array_less(np.abs(dh - ref_dh), tol_dh + 1e-30)
    if compute_dw:
        ref_dw = dS.T @ p.H64
        dw = he.to_f64(bw["dw"], p.w_dtype)
        tol_dw = UNIT[p.w_dtype] * np.abs(ref_dw) + TINY[p.w_dtype] + \
            ((p.M + 4) * U32 + 4 * ds + e_lse) * (np.abs(dS).T @ np.abs(p.H64))
        np.testing.assert_array_less(np.abs(dw - ref_dw), tol_dw + 1e-30)


def check_all(prog, p: Head, softcap, compute_dw=False, seed=0, **plan_kw):
    """Forward (plain and fused), backward (dh, dW) and the fused dh against
    the reference."""
    cap = softcap or None
    ref_logp, ref_lse, _, _, _ = reference(p, cap)
    ds = p.ds()
    tol_lse = 2 * ds + (p.V + 16) * U32 * (1 + np.abs(ref_lse).max())

    plain = run_forward(prog, p, softcap, fused=False, seed=seed, **plan_kw)
    fused = run_forward(prog, p, softcap, fused=True, seed=seed + 1, **plan_kw)
    ok = (p.y >= 0) & (p.y < p.V) | (p.y == p.ignore_index)
    for out in (plain, fused):
        np.testing.assert_allclose(out["lse"], ref_lse, rtol=0, atol=tol_lse)
        np.testing.assert_allclose(out["logp"][ok], ref_logp[ok], rtol=0, atol=tol_lse)
        assert np.isnan(out["logp"][~ok]).all()
        assert (out["logp"][p.y == p.ignore_index] == 0).all()

    # gsum = sum_v p_v dcap_v W_v: the gradient with g = 0, g_lse = 1.
    P_dcap, _, _ = ref_ds(p, cap, np.zeros(p.M), np.ones(p.M), ref_lse)
    ref_gsum = P_dcap @ p.W64
    tol_gsum = ((p.V + 4) * U32 + 4 * ds + tol_lse) * (np.abs(P_dcap) @ np.abs(p.W64)) + \
        p.u_deq * (np.abs(P_dcap) @ p.Wabs)
    np.testing.assert_array_less(np.abs(fused["gsum"] - ref_gsum), tol_gsum + 1e-30)

    check_backward(prog, p, softcap, ref_lse, compute_dw, seed + 2, **plan_kw)
    g, g_lse = p.g.astype(np.float64), p.g_lse.astype(np.float64)

    # The fused backward from the kernels' own forward outputs.
    fd = run_fused_dh(prog, p, softcap, fused["gsum"], fused["logp"], fused["lse"], seed + 3)
    keep = (p.y != p.ignore_index) & ok
    gm = np.where(keep, g, 0.0)
    coef = (g_lse - gm)[:, None]
    Wy = p.W64[np.where(keep, p.y, 0)] * keep[:, None]
    _, s, dcap = ref_ds(p, cap, g, g_lse, ref_lse)
    dcap_y = dcap[np.arange(p.M), np.where(keep, p.y, 0)]
    ref_fd = coef * ref_gsum + (gm * dcap_y)[:, None] * Wy
    e_sy = ds + 4 * U32 * (np.abs(ref_logp) + np.abs(ref_lse) + 1)
    e_dcap = 2 * e_sy / softcap if softcap else 0.0 * e_sy
    tol_fd = UNIT[p.dtype] * np.abs(ref_fd) + TINY[p.dtype] + np.abs(coef) * tol_gsum + \
        (np.abs(gm) * e_dcap)[:, None] * np.abs(Wy) + \
        2 * U32 * (np.abs(coef * ref_gsum) + np.abs(gm[:, None] * Wy))
    got = he.to_f64(fd["dh"], p.dtype)
    rows = ok  # rows with an out-of-range target have no defined gradient
    np.testing.assert_array_less(np.abs(got - ref_fd)[rows], (tol_fd + 1e-30)[rows])


# --- Builds -----------------------------------------------------------------

_PROGRAMS = {}


def program(kernels, mode="run"):
    key = (frozenset(kernels), mode)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = he.build(kernels, mode=mode)
    return _PROGRAMS[key]


def dense_kernels():
    """Every kernel the dense tests below use, built once together."""
    names = set()
    for dt in DTYPES:
        p = Head(2, 8, 40, dt)
        for plan in plans_for(p, 0.0, compute_dw=True, dw_slab_rows=32):
            names |= he.plan_kernels(plan)
    mixed = Head(2, 8, 40, "bf16", w_dtype="f32")
    for plan in plans_for(mixed, 0.0, compute_dw=True):
        names |= he.plan_kernels(plan)
    return names


def quant_kernels(bits_list, dtypes):
    # Kernels are per (tile type, bits, group size); scales of another dtype
    # than h's add the widening kernels.
    names = set()
    for bits in bits_list:
        for dt in dtypes:
            for gs in (32, 64, 128):
                p = Head(2, gs, 40, dt, quant=(bits, gs))
                for plan in plans_for(p, 0.0):
                    names |= he.plan_kernels(plan)
    for sb in ("f16", "bf16"):
        names |= he.plan_kernels(he.plan("forward", 2, 32, 40, quantized=True, group_size=32,
                                          sb=sb))
    return names


@pytest.fixture(scope="module")
def dense():
    return program(dense_kernels())


ALL_BITS = [2, 3, 4, 5, 6, 8]


@pytest.fixture(scope="module")
def quant():
    return program(quant_kernels(ALL_BITS, DTYPES if SWEEP else ["f32"]))


# --- Tests ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_dense(dense, dtype, softcap):
    # Two m tiles (the second partial), H in three BK steps (the last partial),
    # V in 11 blocks over 3 splits (multi-block splits, a partial last block),
    # two dW slabs for half-precision weights.
    p = Head(37, 70, 333, dtype, ignore=(0, 5), seed=hash((dtype, softcap)) % 1000)
    check_all(dense, p, softcap, compute_dw=True, max_splits=3, dw_slab_rows=192)


@pytest.mark.parametrize("M,H,V", [(1, 16, 10), (7, 3, 1), (32, 32, 32), (33, 33, 65),
                                   (5, 40, 97)])
def test_tile_edges(dense, M, H, V):
    p = Head(M, H, V, "f32", seed=M * 1000 + V)
    check_all(dense, p, None, compute_dw=True)


def test_one_split_many_blocks(dense):
    # All 10 vocabulary blocks in one split: the online maximum moves across blocks.
    p = Head(9, 24, 300, "f32", scale=4.0, seed=3)
    check_all(dense, p, 5.0, compute_dw=True, max_splits=1)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_rounds(dense, dtype):
    # Bounded launches at a small shape: each split's 6 blocks in rounds of 2
    # (resuming the online statistics and partial sums), one m tile per
    # launch, and dW in 64-row slabs walked one m tile per launch; dh on the
    # grouped kernel (the partials per group of blocks).
    p = Head(70, 40, 333, dtype, ignore=(3,), scale=4.0, seed=21)
    check_all(dense, p, 3.0, compute_dw=True, max_splits=2, round_blocks=2, round_m_tiles=1,
              dw_slab_rows=64, acc_registers=-1)


def test_dw_groups_of_m_tiles(dense):
    # Nine m tiles: dW's groups of four (rows read and written once per
    # group), a last group of one, and a launch boundary inside the tiles.
    p = Head(280, 24, 70, "f32", ignore=(5,), seed=23)
    check_all(dense, p, None, compute_dw=True, round_m_tiles=6)


def test_mixed_dtypes(dense):
    p = Head(11, 40, 300, "bf16", w_dtype="f32", seed=4)
    check_all(dense, p, None, compute_dw=True)


def test_ignored_and_out_of_range_targets(dense):
    p = Head(10, 24, 90, "f32", ignore=(0, 3, 9), out_of_range=(4,), seed=5)
    check_all(dense, p, None, compute_dw=True)
    # Without an lse cotangent, ignored rows take no gradient at all.
    p.g_lse[:] = 0
    bw = run_backward(dense, p, None, reference(p, None)[1], False)
    assert (bw["dh"][[0, 3, 9]] == 0).all()
    assert (bw["dh"][[1, 2]] != 0).any()


def test_ignore_index_inside_the_vocabulary(dense):
    # Targets equal to a custom ignore_index (a real token id) are ignored.
    p = Head(12, 24, 50, "f32", ignore=(1, 4), ignore_index=7, seed=6)
    check_all(dense, p, 2.0, compute_dw=True)


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES if SWEEP else ["f32"])
def test_quantized(quant, bits, group_size, dtype):
    p = Head(9, 128, 150, dtype, quant=(bits, group_size), sb_dtype="f32", seed=bits * 7 + group_size)
    check_all(quant, p, 30.0, max_splits=2)


def test_quantized_rounds(quant):
    # One block per round: a quantized split resumed at every block (dh on the
    # grouped kernel).
    p = Head(40, 64, 200, "f32", quant=(4, 32), seed=22)
    check_all(quant, p, 30.0, max_splits=2, round_blocks=1, round_m_tiles=1, acc_registers=-1)


@pytest.mark.parametrize("sb_dtype", ["f16", "bf16"])
def test_quantized_half_scales(quant, sb_dtype):
    p = Head(5, 64, 77, "f32", quant=(4, 32), sb_dtype=sb_dtype, seed=11)
    check_all(quant, p, None)


@pytest.mark.parametrize("dtype,sb_dtype", [("f16", "f16"), ("bf16", "bf16"), ("f16", "bf16")])
def test_quantized_tile_types(dtype, sb_dtype):
    # Every pass of a 4-bit head (group 64) with float16 and bfloat16 tiles
    # (h and scales of one dtype: MLX's loaders and dequantization in that
    # dtype, bounded by u_deq), and with float32 tiles behind the widening of
    # both a float16 h and bfloat16 scales.
    p = Head(9, 128, 150, dtype, quant=(4, 64), sb_dtype=sb_dtype, ignore=(2,), seed=41)
    kernels = set()
    for plan in plans_for(p, 30.0):
        kernels |= he.plan_kernels(plan)
    tile = dtype if dtype == sb_dtype else "f32"
    assert f"fcce_fwd_h{tile}_q4_g64" in kernels
    assert ("fcce_widen_f16" in kernels) == (dtype != sb_dtype)
    check_all(program(kernels), p, 30.0, max_splits=2)


# --- dh with its accumulator in registers ------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_acc_registers_dense(dense, dtype, softcap):
    # H = 300: two chunks of H (the second walks the staged dS tiles), the
    # second of 44 columns (its last BK piece partial, the rest of its pieces
    # past H); 11 blocks in 2 splits in rounds of 2 (each launch resumes the
    # register accumulator from the partial its predecessor wrote), one m tile
    # per launch (the second partial). dW likewise in registers: two slabs, each
    # m tile in its own launch (the second continues the float32 rows the
    # first wrote), the second chunk from each m tile's staged dS tile.
    p = Head(37, 300, 333, dtype, ignore=(0, 5), seed=31 + len(dtype))
    ref_lse = reference(p, softcap)[1]
    check_backward(dense, p, softcap, ref_lse, compute_dw=True, seed=1, max_splits=2,
                   round_blocks=2, round_m_tiles=1, acc_registers=1, dw_slab_rows=192)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_fused_forward_registers(dense, dtype):
    # Every pass at H = 300 (two chunks): the fused forward's register gsum
    # replays each block's staged coefficients and row-maximum factors for
    # the second chunk, and resumes statistics and partial across rounds of
    # two blocks; a large logit scale moves the row maximum across blocks.
    p = Head(37, 300, 333, dtype, ignore=(4,), scale=4.0, seed=34)
    check_all(dense, p, 3.0, max_splits=2, round_blocks=2)


def test_acc_registers_custom_ignore_index(dense):
    # One chunk (nothing staged), a custom ignore_index that is a real token
    # id, one split walked in one launch.
    p = Head(20, 200, 150, "bf16", ignore=(1, 4), ignore_index=7, seed=32)
    assert he.plan_kernels(he.plan("backward", p.M, p.H, p.V, **p.kw())) == \
        {"fcce_dhreg_hbf16_wbf16", "fcce_reduce_dh_bf16"}
    check_backward(dense, p, 2.0, reference(p, 2.0)[1], seed=2, max_splits=1)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_acc_registers_quantized(dh_regs_quant, dtype):
    # 4-bit, group 64, H = 320: two chunks (the second of two pieces), a
    # softcap, ignored rows, rounds of three blocks.
    p = Head(33, 320, 200, dtype, quant=(4, 64), sb_dtype="bf16", ignore=(2,), seed=33)
    ref_lse = reference(p, 30.0)[1]
    check_backward(dh_regs_quant, p, 30.0, ref_lse, seed=3, max_splits=2, round_blocks=3,
                   acc_registers=1)


@pytest.fixture(scope="module")
def dh_regs_quant():
    # 4-bit, group 64, bfloat16 scales: the float32 h's kernel reads them
    # widened to float32 (fcce_widen_bf16), the bfloat16 h's in bfloat16.
    return program(he.plan_kernels(*(
        he.plan("backward", 2, 64, 40, h=dt, quantized=True, bits=4, group_size=64, sb="bf16")
        for dt in ("f32", "bf16"))))


def test_every_plan_kernel_is_in_the_source():
    text = he.SOURCE.read_text()
    assert sorted(he.host_names(text)) == sorted(he.kernel_names())


def test_params_layout_matches_the_plan():
    plan = he.plan("forward", 3, 8, 10)
    fields = he.param_fields()
    assert [n for _, n in fields] == list(plan["launches"][0]["params"])
    assert plan["params_bytes"] == 4 * len(fields)


@pytest.mark.parametrize("seed", [11, 23, 37])
def test_dense_under_other_schedules(dense, seed):
    # Other random thread orders (and threadgroup orders) of the same launches.
    p = Head(37, 70, 333, "bf16", ignore=(2,), seed=seed)
    check_all(dense, p, 3.0, compute_dw=True, seed=seed, max_splits=3, dw_slab_rows=192)


@pytest.mark.skipif(not SWEEP, reason="larger emulated problems: set FLASH_CCE_METAL_SWEEP=1")
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_plan_defaults_larger(dense, dtype):
    # The plan's own split choice: 10 m tiles x 55 vocabulary blocks give
    # splits of two blocks (forward) or three (passes with partials).
    p = Head(300, 64, 1733, dtype, ignore=(0, 299), seed=12)
    check_all(dense, p, 30.0, compute_dw=True)


@pytest.mark.skipif(not SWEEP, reason="every dtype pair: set FLASH_CCE_METAL_SWEEP=1")
@pytest.mark.parametrize("h_dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", DTYPES)
def test_dense_dtype_pairs(h_dtype, w_dtype):
    p = Head(33, 40, 70, h_dtype, w_dtype=w_dtype, ignore=(3,), seed=13)
    kernels = set()
    for plan in plans_for(p, 3.0, compute_dw=True, dw_slab_rows=32):
        kernels |= he.plan_kernels(plan)
    check_all(program(kernels), p, 3.0, compute_dw=True, max_splits=2, dw_slab_rows=32)
