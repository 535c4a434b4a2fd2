"""A native head checked against the pure-MLX fallback on a few small problems.

Used once per process and head configuration before the Metal kernels are
trusted (see metal.py): they were verified by CPU emulation, never on the
hardware that runs them. Each problem runs the native forward (plain and with
the fused-backward state), its backward (dh, and dW for a dense head) and the
gradient through the fused state, and compares every output with the
fallback computed on the CPU from the same inputs. The entropy statistics and
the backward with the entropy's cotangent are checked apart
(`self_check(..., entropy=True)`, bounds in _check_entropy), the first time a
call asks for them.

Most problems' inputs lie on grids exact in float16, bfloat16 and float32 (at
most 8 significant bits; quantized heads get power-of-two scales and biases
-scale * 2^(bits-1), so every dequantized weight is exact too): whatever type a
kernel rounds its operands to, they stay exact. One problem ("off-grid") is
exact only in float32 (and in the head's own dtypes after conversion): every
value is a grid value g times (1 + e), e = 7 * 2^-12, which keeps 20
significant bits (exact in float32) while bfloat16 rounds it back to g
exactly (g e stays below half a bfloat16 ulp of g). A kernel that rounds a
float32 head's operands to bfloat16 computes every logit s as s / (1 + e)^2,
off by (2 e + e^2) |s| ~ 3.4e-3 |s|, and logp by about 3.4e-3 |s_y - E_p s|;
the bound below is about 2 (V + 16) u |lse| + 4 (H + 2) u B ~ 3e-4 |lse| at
V = 2070, H = 72 with logits of standard deviation ~8, so such a loader
misses it by an order of magnitude (tests/head/metal/test_selfcheck_emu.py
measures it). Bounds follow from fp32 arithmetic (both paths against exact
arithmetic, added; u = 2^-24, as in the derivation at the top of
tests/head/test_head.py):
  - a logit is an fp32 dot product of length H: |ds| <= 2 (H + 2) u B, with
    B = |h| @ |W|^T;
  - lse and logp: |d| <= 2 max_v |ds| + 2 (V + 16) u (1 + |lse|);
  - dh and dW sum V (or M) products whose coefficients carry relative error
    <= 2 |d lse| (softmax and softcap derivative) and one rounding to the
    operand type (u_op, the type of h), accumulate in fp32, then round once to
    the output dtype:
    |d dh| <= 2 u_out |dh| + (2 (V + 4) u + u_op + 4 |d lse|) (|dS| @ |W|).
The problems between them cover: tile edges in M, V and a dense H (72, a
partial 32-column tile), one row, softcap on and off, ignored rows with the
default and with a custom ignore_index (a real token id), vocabulary splits of
several blocks merged by the combine, one split of 65 blocks (the online
softmax rescaling across many blocks) run in launch rounds of 16 blocks that
resume the split's statistics and partial sums, and two dW slabs of a
half-precision head. Split and round limits are set on the native path per
problem where the problem asks for them (`metal_plan_limits`), so that the
kernels' long-split code runs at sizes the CPU fallback checks in about a
second.
A wrong kernel (a lost tile, a wrong index, a missing barrier) misses these by
orders of magnitude; rounding stays inside them.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import fallback

U32 = 2.0**-24
UNIT = {mx.float32: U32, mx.bfloat16: 2.0**-8, mx.float16: 2.0**-11}
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass(frozen=True)
class Problem:
    """One self-check problem. `hidden` is a dense head's H; a quantized
    head's is rounded up to a multiple of QUANT_H_UNIT. `max_splits` and
    `round_blocks` (0: the plan's choice) cap the native path's vocabulary
    splits and the blocks of a split per launch; `off_grid`
    perturbs the inputs off the bfloat16 grid (see the module docstring)."""

    M: int
    V: int
    softcap: float | None = None
    ignored: tuple = ()
    hidden: int = 256
    ignore_index: int = -100
    max_splits: int = 0
    round_blocks: int = 0
    off_grid: bool = False
    seed: int = 0


QUANT_H_UNIT = 128  # every group size (32, 64, 128) divides it
OFF_GRID = 7 * 2.0**-12  # below 2^-9: bfloat16 rounds g (1 + e) back to g

PROBLEMS = (
    # two m tiles (the second partial), 17 vocabulary blocks in 3 splits of 6
    Problem(37, 517, None, (3, 20), hidden=128, max_splits=3, seed=0),
    Problem(1, 131, 5.0, (), seed=1),  # one row, the plan's own splits
    Problem(70, 300, 5.0, (0,), hidden=128, seed=2),
    # float32 values off the bfloat16 grid, H = 72 (a partial 32-column
    # tile), a custom ignore_index inside the vocabulary, one split of 65
    # blocks (the last partial) in rounds of 16 with large logits: the row
    # maximum moves often, also across rounds
    Problem(24, 2070, None, (2, 9, 17), hidden=72, ignore_index=5, max_splits=1,
            round_blocks=16, off_grid=True, seed=3),
    # 8230 vocabulary rows: two dW slabs of a half-precision head
    Problem(8, 8230, None, (2,), hidden=32, seed=4),
)

@dataclass(frozen=True)
class HeadSpec:
    """What selects a kernel variant: the dtypes and the quantization."""

    h_dtype: str
    w_dtype: str  # "uint32" for a quantized head
    bits: int | None = None
    group_size: int | None = None
    sb_dtype: str | None = None

    @property
    def key(self):
        w = self.w_dtype if self.bits is None else (
            f"{self.bits}-bit/{self.group_size} ({self.sb_dtype} scales)")
        return f"h={self.h_dtype}, w={w}"

    @staticmethod
    def of(h, w, scales=None, bits=None, group_size=64):
        if scales is None:
            return HeadSpec(_name(h.dtype), _name(w.dtype))
        return HeadSpec(_name(h.dtype), "uint32", bits, group_size, _name(scales.dtype))


def _name(dtype):
    return str(dtype).rsplit(".", 1)[-1]  # mlx.core.bfloat16 -> bfloat16


@dataclass
class CheckResult:
    passed: bool
    worst: float = float("nan")  # largest |native - fallback| / bound
    detail: str = ""


def _grid(rng, shape, scale):
    """Normal values times `scale` (a power of two) with at most 7 significant
    bits: exact in float16, bfloat16 and float32."""
    return np.clip(np.round(rng.standard_normal(shape) * 32), -127, 127) * (scale / 32)


def _hidden(spec, prob):
    # A quantized head's H: the dense H rounded up to a multiple of every group size.
    return prob.hidden if spec.bits is None else -(-prob.hidden // QUANT_H_UNIT) * QUANT_H_UNIT


def _inputs(spec, prob):
    rng = np.random.default_rng(prob.seed)
    M, V, H = prob.M, prob.V, _hidden(spec, prob)
    # Off the grid: large logits too (w on the scale of h), so that a loader
    # rounding to bfloat16 shows in logp (module docstring).
    off = 1 + OFF_GRID if prob.off_grid else 1.0
    h = _grid(rng, (M, H), 1.0) * off
    w = _grid(rng, (V, H), 1.0 if prob.off_grid else 1 / 8) * off
    h = mx.array(h.astype(np.float32)).astype(DTYPES[spec.h_dtype])
    w = w.astype(np.float32)
    y = rng.integers(0, V, M).astype(np.int32)
    y[list(prob.ignored)] = prob.ignore_index
    g = mx.array(_grid(rng, M, 1.0).astype(np.float32))
    g_lse = mx.array(_grid(rng, M, 1.0).astype(np.float32))
    if spec.bits is None:
        return h, mx.array(w).astype(DTYPES[spec.w_dtype]), None, None, mx.array(y), g, g_lse
    # Random codes from mx.quantize, then exact scales and centred biases.
    sb = DTYPES[spec.sb_dtype]
    q, _, _ = mx.quantize(mx.array(w), group_size=spec.group_size, bits=spec.bits)
    groups = (V, H // spec.group_size)
    scales = 2.0 ** -rng.integers(4, 7, groups).astype(np.float32) / 2 ** (spec.bits - 2)
    biases = -scales * 2 ** (spec.bits - 1)
    return h, q, mx.array(scales).astype(sb), mx.array(biases).astype(sb), mx.array(y), g, g_lse


def _f64(a):
    return np.array(a.astype(mx.float32), dtype=np.float64)


def _logits64(spec, h, w, scales, biases, cap):
    """fp64 h, W, the final logits s and the softcap's derivative dcap."""
    with mx.stream(mx.cpu):
        W = _f64(w) if scales is None else _f64(fallback.dequantize_f32(
            w, scales, biases, spec.group_size, spec.bits))
    H = _f64(h)
    raw = H @ W.T
    s = raw if cap is None else cap * np.tanh(raw / cap)
    dcap = np.ones_like(s) if cap is None else 1.0 - (s / cap) ** 2
    return H, W, s, dcap


def _magnitudes(spec, h, w, scales, biases, y, g, g_lse, cap, ignore_index):
    """fp64 |dS| @ |W|, |dS|^T @ |h| and B = |h| @ |W|^T of the problem."""
    H, W, s, dcap = _logits64(spec, h, w, scales, biases, cap)
    top = s.max(axis=1, keepdims=True)
    p = np.exp(s - top) / np.exp(s - top).sum(axis=1, keepdims=True)
    yy = np.array(y)
    keep = yy != ignore_index
    gg = np.where(keep, _f64(g), 0.0)
    onehot = np.zeros_like(s)
    onehot[np.arange(len(yy))[keep], yy[keep]] = 1.0
    ds = np.abs((gg[:, None] * onehot + (_f64(g_lse) - gg)[:, None] * p) * dcap)
    return ds @ np.abs(W), ds.T @ np.abs(H), np.abs(H) @ np.abs(W).T


class _Compare:
    """Collects the worst ratio |native - reference| / bound over outputs."""

    def __init__(self):
        self.worst, self.where = 0.0, ""

    def __call__(self, name, got, want, bound):
        got, want = _f64(got), _f64(want)
        if got.shape != want.shape:
            self.worst, self.where = float("inf"), f"{name}: shape {got.shape} != {want.shape}"
            return
        nan_ok = np.isnan(got) == np.isnan(want)
        err = np.where(np.isnan(want), 0.0, np.abs(got - want))
        err = np.where(nan_ok, err, np.inf)
        err = np.where(np.isnan(err), np.inf, err)  # NaN where the fallback is finite
        ratio = err / np.maximum(bound, np.finfo(np.float64).tiny)
        i = np.unravel_index(int(np.argmax(ratio)), ratio.shape) if ratio.size else ()
        r = float(ratio[i]) if ratio.size else 0.0
        if r > self.worst:
            self.worst = r
            self.where = (f"{name}{[int(k) for k in i]}: native {got[i]:.6g}, fallback {want[i]:.6g}, "
                          f"bound {bound[i]:.3g}")


def _check_problem(spec, native, stream, prob, cmp):
    h, w, scales, biases, y, g, g_lse = _inputs(spec, prob)
    dense = scales is None
    M, V, H, cap = prob.M, prob.V, _hidden(spec, prob), prob.softcap
    q = dict(group_size=spec.group_size or 64, bits=spec.bits, softcap=cap,
             ignore_index=prob.ignore_index)
    with mx.stream(mx.cpu):
        logp_r, lse_r = fallback.forward(h, w, y, scales, biases, **q)
        dh_r, dw_r = fallback.backward(h, w, y, lse_r, g, scales, biases, g_lse=g_lse,
                                       compute_dw=dense, **q)
        mx.eval(logp_r, lse_r, dh_r, dw_r)

    u_op = UNIT[DTYPES[spec.h_dtype]]  # also the unit of dh's dtype
    dsW, dsH, B = _magnitudes(spec, h, w, scales, biases, y, g, g_lse, cap, prob.ignore_index)
    ds = 2 * (H + 2) * U32 * B
    lse64 = _f64(lse_r)
    row = 2 * ds.max(axis=1) + 2 * (V + 16) * U32 * (1 + np.abs(lse64))
    grad_unit = 2 * (V + 4) * U32 + u_op
    dh_bound = 2 * u_op * np.abs(_f64(dh_r)) + (grad_unit + 4 * row[:, None]) * dsW

    for fused in (False, True):
        logp, lse = native.forward(h, w, y, scales, biases, fused_backward=fused,
                                   stream=stream, **q)
        cmp(f"logp(fused={fused})", logp, logp_r, row)
        cmp(f"lse(fused={fused})", lse, lse_r, row)

    out = native.backward(h, w, y, lse_r, g, g_lse, scales, biases,
                          compute_dw=dense, stream=stream, **q)
    cmp("dh(backward)", out[0], dh_r, dh_bound)
    if dense:
        u_dw = UNIT[DTYPES[spec.w_dtype]]
        grad_m = 2 * (M + 4) * U32 + u_op
        dw_bound = 2 * u_dw * np.abs(_f64(dw_r)) + (grad_m + 4 * row.max()) * dsH
        cmp("dW(backward)", out[1], dw_r, dw_bound)

    # The gradient through the forward's fused state (where the backend keeps one).
    def f(h_):
        return native.forward(h_, w, y, scales, biases, fused_backward=True,
                              stream=stream, **q)

    _, (dh_v,) = mx.vjp(f, [h], [g, g_lse])
    cmp("dh(vjp)", dh_v, dh_r, dh_bound)


def _supports_stats(native, stream):
    """Whether `native` computes the entropy statistics on `stream`'s device."""
    supports = getattr(native, "supports_stats", None)
    device = stream.device if isinstance(stream, mx.Stream) else mx.Device(stream) \
        if isinstance(stream, mx.DeviceType) else stream
    return supports is not None and bool(supports(device))


def _check_entropy(spec, native, stream, prob, cmp):
    """The entropy statistics and the entropy's gradient (dh, dW) against the
    fallback. With ds_v = 2 (H + 2) u B the logits' error (both paths), zbar =
    sum_v p_v s_v = lse - entropy and spread = max_v |s_v - zbar| (dE/ds_v =
    -p_v (s_v - zbar)), entropy = log S - R / S summed over V terms of one
    sign: |dE| <= 2 max ds spread + 2 (V + 16) u (1 + 2 |zbar - max s| + |E|);
    the mean logit: |d| <= 2 (max ds + (V + 4) u max |s|); is_top1 agrees where
    the two largest logits are more than 2 max ds apart. dh and dW as the
    logp's, with |dS| including |g_ent| p_v |s_v - zbar| dcap_v, plus the
    entropy coefficient's own error |g_ent| p_v dcap_v (2 ds_v + 4 u (|s_v -
    zbar| + |zbar|))."""
    h, w, scales, biases, y, g, g_lse = _inputs(spec, prob)
    dense = scales is None
    M, V = prob.M, prob.V
    q = dict(group_size=spec.group_size or 64, bits=spec.bits, softcap=prob.softcap,
             ignore_index=prob.ignore_index)
    g_ent = mx.array(_grid(np.random.default_rng(prob.seed + 1000), M, 1.0).astype(np.float32))
    with mx.stream(mx.cpu):
        ref = fallback.forward(h, w, y, scales, biases, **q, stats=True)
        lse_r, ent_r = ref[1], ref[2]
        dh_r, dw_r = fallback.backward(h, w, y, lse_r, g, scales, biases, g_lse=g_lse,
                                       compute_dw=dense, entropy=ent_r, g_entropy=g_ent, **q)
        mx.eval(ref, dh_r, dw_r)
    out = native.forward(h, w, y, scales, biases, fused_backward=True, stream=stream,
                         stats=True, **q)
    H, W, s, dcap = _logits64(spec, h, w, scales, biases, q["softcap"])
    ds = 2 * (H.shape[1] + 2) * U32 * (np.abs(H) @ np.abs(W).T)
    lse, ent = _f64(lse_r), _f64(ent_r)
    # The logp bound per row and the gradients' unit, as in _check_problem.
    row = 2 * ds.max(axis=1) + 2 * (V + 16) * U32 * (1 + np.abs(lse))
    u_op = UNIT[DTYPES[spec.h_dtype]]
    grad_unit = 2 * (V + 4) * U32 + u_op
    zbar = lse - ent
    rel = s - zbar[:, None]
    spread = np.abs(rel).max(axis=1)
    ent_bound = 2 * ds.max(axis=1) * spread + 2 * (V + 16) * U32 * (
        1 + 2 * np.abs(zbar - s.max(axis=1)) + np.abs(ent))
    mean_bound = 2 * (ds.max(axis=1) + (V + 4) * U32 * np.abs(s).max(axis=1))
    cmp("logp(stats)", out[0], ref[0], row)
    cmp("lse(stats)", out[1], lse_r, row)
    cmp("entropy", out[2], ent_r, ent_bound)
    cmp("mean_logit", out[4], ref[4], mean_bound)
    top2 = np.sort(s, axis=1)[:, -2:] if V > 1 else np.zeros((M, 2))
    clear = (top2[:, 1] - top2[:, 0]) > 2 * ds.max(axis=1)
    agree = np.array(out[3]) == np.array(ref[3])
    # A disagreement where the arg-max is clear counts twice its bound.
    cmp("is_top1", mx.array(np.where(clear & ~agree, 1.0, 0.0)), mx.zeros((M,)), np.full(M, 0.5))

    P = np.exp(s - lse[:, None])
    yy = np.array(y)
    keep = yy != prob.ignore_index
    gg = np.where(keep, _f64(g), 0.0)
    ge = np.abs(_f64(g_ent))[:, None]
    onehot = np.zeros_like(s)
    onehot[np.arange(M)[keep], yy[keep]] = 1.0
    A = (np.abs(gg)[:, None] * onehot + (np.abs(_f64(g_lse) - gg)[:, None] + ge * np.abs(rel))
         * P) * dcap
    own = ge * P * dcap * (2 * ds + 4 * U32 * (np.abs(rel) + np.abs(zbar)[:, None]))
    res = native.backward(h, w, y, lse_r, g, g_lse, scales, biases, compute_dw=dense,
                          stream=stream, entropy=ent_r, g_entropy=g_ent, **q)
    dh_bound = 2 * u_op * np.abs(_f64(dh_r)) + ((grad_unit + 4 * row[:, None]) * A + own) @ \
        np.abs(W)
    cmp("dh(entropy)", res[0], dh_r, dh_bound)
    if dense:
        u_dw = UNIT[DTYPES[spec.w_dtype]]
        grad_m = 2 * (M + 4) * U32 + u_op
        dw_bound = 2 * u_dw * np.abs(_f64(dw_r)) + \
            ((grad_m + 4 * row.max()) * A + own).T @ np.abs(H)
        cmp("dW(entropy)", res[1], dw_r, dw_bound)


def _limit_plan(native, stream, max_splits=0, round_blocks=0):
    """Caps the native path's vocabulary splits and blocks per launch round
    on `stream` (0: the plan's choice), where the native path has them (the
    Metal kernels)."""
    limit = getattr(native, "metal_plan_limits", None)
    if limit is not None:
        limit(max_splits, round_blocks, stream=stream)


def self_check(spec, native, stream, problems=PROBLEMS, entropy=False):
    """Runs `problems` for `spec` on `native` (an object with the signature of
    flash_cce._ext's forward and backward, and optionally its
    metal_plan_limits and supports_stats) on `stream`; with `entropy`, their
    entropy statistics and the entropy's gradient instead (_check_entropy).
    Never raises: an error of the native path is a failed check."""
    if entropy and not _supports_stats(native, stream):
        return CheckResult(False, float("inf"), "the native kernels have no entropy statistics")
    check = _check_entropy if entropy else _check_problem
    cmp = _Compare()
    try:
        for prob in problems:
            _limit_plan(native, stream, prob.max_splits, prob.round_blocks)
            try:
                check(spec, native, stream, prob, cmp)
            finally:
                _limit_plan(native, stream)
    except Exception as err:  # noqa: BLE001 - a failing kernel may raise anything
        return CheckResult(False, float("inf"), f"{type(err).__name__}: {err}".strip())
    if cmp.worst <= 1.0:
        return CheckResult(True, cmp.worst, f"largest error {cmp.worst:.2g} of its bound")
    return CheckResult(False, cmp.worst, cmp.where)
