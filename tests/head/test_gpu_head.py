"""GPU kernels of the flash-CCE head against the CPU kernels (and the pure-MLX
fallback). Skipped where MLX has no GPU or this build has no GPU kernels.

The GPU multiplies in bf16 (fp16 when h is fp16) with fp32 accumulation: fp32
operands and dequantized weights are rounded to that type in the loaders. The
CPU reference therefore runs on the same rounded operands, which makes every
product exact on both sides; what remains is fp32 summation order (~1e-6
relative) for the forward, and for the backward the rounding of dS to the
operand type (2^-9 relative for bf16, 2^-11 for fp16) plus the output dtype.
"""

import mlx.core as mx
import numpy as np
import pytest

from flash_cce import _ext, flash_cce_backward, flash_cce_forward
from reference import operand_type

pytestmark = pytest.mark.skipif(
    not (mx.is_available(mx.gpu) and _ext.has_gpu_kernels()),
    reason="needs an MLX GPU and a build with the CUDA kernels",
)

# logp/lse: fp32 sums of exact products over H <= 256 terms of size <= ~3,
# in different orders on both sides: a few 1e-6 relative, plus the exp/log
# approximations of the GPU epilogue (2^-22 relative each).
FWD_ATOL = 2e-4
# dh, dW: dS stored in bf16 (2^-9 relative per element), the output rounded to
# its dtype (2^-9 for bf16): a norm-wise error of a few 2^-9.
BWD_RTOL = {mx.float32: 6e-3, mx.bfloat16: 1.2e-2, mx.float16: 6e-3}


def rounded(a, dtype):
    """a as the GPU's tensor cores see it, in float32."""
    return a.astype(operand_type(dtype)).astype(mx.float32)


def make(m, h, v, dtype, seed, ignore=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    hid = mx.random.normal((m, h), key=k1).astype(dtype)
    w = (0.3 * mx.random.normal((v, h), key=k2)).astype(dtype)
    y = mx.random.randint(0, v, (m,), key=k3).astype(mx.int32)
    if ignore:
        y[:ignore] = -100
    return hid, w, y


def rel_err(a, b):
    a = np.array(a.astype(mx.float32), dtype=np.float64)
    b = np.array(b.astype(mx.float32), dtype=np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def cpu_ref(hid, w, y, dtype, g, g_lse, softcap, compute_dw):
    """CPU kernels on the operands the GPU sees, float32."""
    ct = operand_type(dtype)
    h32 = rounded(hid, ct)
    w32 = rounded(w, ct)
    logp, lse = flash_cce_forward(h32, w32, y, softcap=softcap, stream=mx.cpu)
    grads = flash_cce_backward(h32, w32, y, lse, g, g_lse=g_lse, softcap=softcap,
                               compute_dw=compute_dw, stream=mx.cpu)
    return logp, lse, grads


SHAPES = [(37, 64, 300), (130, 96, 1000), (257, 40, 515), (300, 256, 2100)]


@pytest.fixture(params=["default", "mma"])
def kernels(request):
    """The tuning that runs a test on the default kernels (wgmma on Hopper) or
    on the portable mma.sync kernels."""
    return {"wgmma": request.param != "mma"}


@pytest.fixture(params=["one", "many"])
def chunks(request, kernels):
    """`kernels`' tuning with the vocabulary in one chunk and the rows in one
    block, or with chunks of 256 columns over blocks of 100 rows (the loops of
    the backward and of the fused forward)."""
    many = request.param == "many"
    return {**kernels, "vocab_chunk": 256 if many else 1000000,
            "row_block": 100 if many else 1000000}


def test_launch_plan_follows_tuning():
    """The launch sizes come from the device's attributes unless the tuning
    sets them (plan.h; its arithmetic is tested in tests/cpp/test_plan.cpp)."""
    auto = _ext.gpu_launch_plan()
    assert auto["sms"] > 0 and auto["l2_bytes"] > 0
    assert auto["fwd_l2_bytes"] == max(auto["l2_bytes"] * 16 // 50, 1 << 20)
    assert (auto["row_block"], auto["dh_splits"], auto["vocab_chunk"]) == (4096, 4, 0)
    set_ = _ext.gpu_launch_plan({"row_block": 100, "fwd_l2_mb": 3, "dh_splits": 1,
                                 "vocab_chunk": 256, "chunk_mb": 96})
    assert (set_["row_block"], set_["fwd_l2_bytes"], set_["dh_splits"], set_["vocab_chunk"],
            set_["chunk_bytes"]) == (100, 3 << 20, 1, 256, 96 << 20)
    assert set_["sms"] == auto["sms"]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("shape", SHAPES)
def test_dense_matches_cpu(shape, dtype, softcap, chunks):
    m, h, v = shape
    hid, w, y = make(m, h, v, dtype, seed=m + h + v, ignore=3)
    g = mx.random.normal((m,))
    g_lse = mx.random.normal((m,))
    logp, lse = flash_cce_forward(hid, w, y, softcap=softcap, stream=mx.gpu, tuning=chunks)
    dh, dw = flash_cce_backward(hid, w, y, lse, g, g_lse=g_lse, softcap=softcap,
                                compute_dw=True, stream=mx.gpu, tuning=chunks)
    r_logp, r_lse, (r_dh, r_dw) = cpu_ref(hid, w, y, dtype, g, g_lse, softcap, True)
    assert dh.dtype == hid.dtype and dw.dtype == w.dtype
    np.testing.assert_allclose(np.array(lse), np.array(r_lse), atol=FWD_ATOL, rtol=0)
    np.testing.assert_allclose(np.array(logp), np.array(r_logp), atol=FWD_ATOL, rtol=0)
    assert np.all(np.array(logp)[:3] == 0.0)  # ignored rows
    assert rel_err(dh, r_dh) < BWD_RTOL[dtype]
    assert rel_err(dw, r_dw) < BWD_RTOL[dtype]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size,h", [(32, 288), (32, 384), (64, 320), (64, 256), (128, 384)])
@pytest.mark.parametrize("softcap,dtype", [(30.0, mx.bfloat16), (None, mx.bfloat16),
                                           (None, mx.float16)])
def test_quantized_matches_cpu(bits, group_size, h, softcap, dtype, kernels):
    # H = 288 leaves a partial 64-wide k-tile for the 32-wide groups. A row of
    # 12 (384 / 32) or 4 (256 / 64) groups lets the Hopper producer read a
    # k-step's groups in one load; 9 and 5 make it read them one by one. On
    # Hopper the 4- and 8-bit forward takes W as the register operand.
    m, v = 70, 777
    hid, w, y = make(m, h, v, dtype, seed=bits * group_size, ignore=2)
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    g = mx.random.normal((m,))
    logp, lse = flash_cce_forward(hid, wq, y, scales, biases, group_size=group_size,
                                  softcap=softcap, stream=mx.gpu, tuning=kernels)
    dh = flash_cce_backward(hid, wq, y, lse, g, scales, biases, group_size=group_size,
                            softcap=softcap, stream=mx.gpu, tuning=kernels)
    # The GPU rounds each dequantized weight to the compute type; so does the reference.
    w_dense = mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits)
    r_logp, r_lse, r_dh = cpu_ref(hid, w_dense, y, dtype, g, None, softcap, False)
    np.testing.assert_allclose(np.array(lse), np.array(r_lse), atol=FWD_ATOL, rtol=0)
    np.testing.assert_allclose(np.array(logp), np.array(r_logp), atol=FWD_ATOL, rtol=0)
    assert rel_err(dh, r_dh) < BWD_RTOL[dtype]


def test_out_of_range_target_is_nan_and_gets_no_gradient():
    m, h, v = 20, 64, 260
    hid, w, y = make(m, h, v, mx.bfloat16, seed=5)
    y[4] = v + 3
    y[5] = -7
    logp, lse = flash_cce_forward(hid, w, y, stream=mx.gpu, validate_targets=False)
    logp = np.array(logp)
    assert np.isnan(logp[4]) and np.isnan(logp[5])
    assert np.all(np.isfinite(np.delete(logp, [4, 5])))
    g = mx.ones((m,))
    dh = flash_cce_backward(hid, w, y, lse, g, stream=mx.gpu)
    h32, w32 = rounded(hid, mx.bfloat16), rounded(w, mx.bfloat16)
    _, r_lse = flash_cce_forward(h32, w32, y, stream=mx.cpu, validate_targets=False)
    r_dh = flash_cce_backward(h32, w32, y, r_lse, g, stream=mx.cpu)
    assert rel_err(dh, r_dh) < BWD_RTOL[mx.bfloat16]


def test_against_fallback_and_grad():
    """Native GPU vs the pure-MLX fallback on the GPU, through mx.grad."""
    m, h, v = 96, 128, 1500
    hid, w, y = make(m, h, v, mx.bfloat16, seed=11)

    def loss(hid, w, backend):
        logp, lse = flash_cce_forward(hid, w, y, softcap=30.0, backend=backend)
        return (logp * mx.arange(m) / m).sum() + 0.1 * lse.sum()

    with mx.stream(mx.gpu):
        val, (gh, gw) = mx.value_and_grad(loss, argnums=(0, 1))(hid, w, "native")
        rval, (rgh, rgw) = mx.value_and_grad(loss, argnums=(0, 1))(hid, w, "fallback")
    # The fallback multiplies fp32-upcast bf16 operands: the same exact products.
    assert abs(val.item() - rval.item()) < 1e-3 * abs(rval.item())
    assert rel_err(gh, rgh) < BWD_RTOL[mx.bfloat16]
    assert rel_err(gw, rgw) < BWD_RTOL[mx.bfloat16]


def test_large_grid_shapes():
    """More rows (65606) than a grid's y or z axis could give one block each (65535)."""
    m, h, v = 65536 + 70, 64, 1030
    hid, w, y = make(m, h, v, mx.bfloat16, seed=3)
    logp, lse = flash_cce_forward(hid, w, y, stream=mx.gpu)
    r_logp, r_lse, _ = cpu_ref(hid[-300:], w, y[-300:], mx.bfloat16, mx.ones((300,)),
                               None, None, False)
    np.testing.assert_allclose(np.array(logp[-300:]), np.array(r_logp), atol=FWD_ATOL, rtol=0)


@pytest.mark.parametrize("h_dtype,w_dtype", [(mx.bfloat16, mx.float32), (mx.float16, mx.bfloat16)])
def test_mixed_dtypes(h_dtype, w_dtype):
    """Operands of different types go through the converting loaders."""
    m, h, v = 90, 72, 650
    hid, w, y = make(m, h, v, h_dtype, seed=9)
    w = w.astype(w_dtype)
    g = mx.random.normal((m,))
    logp, lse = flash_cce_forward(hid, w, y, softcap=30.0, stream=mx.gpu)
    dh, dw = flash_cce_backward(hid, w, y, lse, g, softcap=30.0, compute_dw=True,
                                stream=mx.gpu)
    ct = operand_type(h_dtype)
    h32, w32 = rounded(hid, ct), rounded(w, ct)
    r_logp, r_lse = flash_cce_forward(h32, w32, y, softcap=30.0, stream=mx.cpu)
    r_dh, r_dw = flash_cce_backward(h32, w32, y, r_lse, g, softcap=30.0, compute_dw=True,
                                    stream=mx.cpu)
    np.testing.assert_allclose(np.array(logp), np.array(r_logp), atol=FWD_ATOL, rtol=0)
    assert rel_err(dh, r_dh) < BWD_RTOL[h_dtype]
    assert rel_err(dw, r_dw) < BWD_RTOL[mx.bfloat16]




def h_grad(hid, w, y, g, g_lse, softcap, stream, fused, scales=None, biases=None,
           group_size=64, tuning=None):
    """d/dh of sum(g logp + g_lse lse) through mx.grad: with a softcap and
    fused=True the GPU forward also emits the gradient state (two GEMMs). The
    backward runs with the forward's tuning."""

    def loss(hid):
        logp, lse = flash_cce_forward(hid, w, y, scales, biases, group_size=group_size,
                                      softcap=softcap, stream=stream, fused_backward=fused,
                                      tuning=tuning)
        return (logp * g).sum() + (lse * g_lse).sum(), (logp, lse)

    (_, (logp, lse)), dh = mx.value_and_grad(loss)(hid)
    return logp, lse, dh


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("shape", [(130, 96, 1000), (300, 256, 2100)])
@pytest.mark.parametrize("softcap", [None, 30.0, 50.0])
def test_fused_forward_gradient(shape, dtype, softcap, chunks):
    """The fused GPU forward (P = exp(s - r) dcap accumulated against W chunk
    by chunk; r = the cap for bf16 heads with caps <= 40, else a running row
    maximum) against the CPU kernels and against the GPU's three-GEMM path
    (fused_backward=False). fp16 P (fp16 heads) adds its rounding, 2^-11
    relative, like fp16 dS on the three-GEMM path, and loses weights below
    e^-16.6 of the row's largest, under 6e-8 each: inside BWD_RTOL."""
    m, h, v = shape
    hid, w, y = make(m, h, v, dtype, seed=m + v, ignore=3)
    g = mx.random.normal((m,), key=mx.random.key(1))
    g_lse = 0.1 * mx.random.normal((m,), key=mx.random.key(2))
    logp, lse, dh = h_grad(hid, w, y, g, g_lse, softcap, mx.gpu, True, tuning=chunks)
    p_logp, p_lse, p_dh = h_grad(hid, w, y, g, g_lse, softcap, mx.gpu, False, tuning=chunks)
    ct = operand_type(dtype)
    r_logp, r_lse, r_dh = h_grad(rounded(hid, ct), rounded(w, ct), y, g, g_lse, softcap,
                                 mx.cpu, True)
    for a in (logp, p_logp):
        np.testing.assert_allclose(np.array(a), np.array(r_logp), atol=FWD_ATOL, rtol=0)
    for a in (lse, p_lse):
        np.testing.assert_allclose(np.array(a), np.array(r_lse), atol=FWD_ATOL, rtol=0)
    assert rel_err(dh, r_dh) < BWD_RTOL[dtype]
    assert rel_err(p_dh, r_dh) < BWD_RTOL[dtype]
    if dtype != mx.float32:  # two paths, two roundings: the fused one ran
        assert not np.array_equal(np.array(dh.astype(mx.float32)), np.array(p_dh.astype(mx.float32)))


@pytest.mark.parametrize("bits", [4, 8, 3])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("m", [90, 91])  # odd: the last row's reference loads alone
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_fused_forward_gradient_quantized(bits, softcap, m, dtype, chunks):
    h, v, gs = 256, 1100, 64
    hid, w, y = make(m, h, v, dtype, seed=bits, ignore=2)
    wq, scales, biases = mx.quantize(w, group_size=gs, bits=bits)
    g = mx.random.normal((m,), key=mx.random.key(4))
    g_lse = 0.1 * mx.random.normal((m,), key=mx.random.key(5))
    logp, lse, dh = h_grad(hid, wq, y, g, g_lse, softcap, mx.gpu, True, scales, biases, gs,
                           tuning=chunks)
    w_dense = mx.dequantize(wq, scales, biases, group_size=gs, bits=bits)
    r_logp, r_lse, r_dh = h_grad(rounded(hid, dtype), rounded(w_dense, dtype),
                                 y, g, g_lse, softcap, mx.cpu, True)
    np.testing.assert_allclose(np.array(logp), np.array(r_logp), atol=FWD_ATOL, rtol=0)
    np.testing.assert_allclose(np.array(lse), np.array(r_lse), atol=FWD_ATOL, rtol=0)
    assert rel_err(dh, r_dh) < BWD_RTOL[dtype]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fused", [True, False])
def test_quantized_blocks_take_many_tiles(bits, fused):
    """The Hopper GEMM kernels walk tiles: with more tiles than an H100/H200 has
    multiprocessors (132), a block computes several, and the dequantization of a
    quantized W runs on across the tiles' boundaries. P / dS: 67 row tiles (one
    row block) x 11 vocabulary tiles per chunk; dh: 67 x 2 column tiles. The
    forward (W as the register operand): 34 row tiles of 256 x 47 vocabulary
    tiles of 128 over 24 splits, two tiles a block."""
    m, h, v, gs = 128 * 67, 512, 6000, 32
    hid, w, y = make(m, h, v, mx.bfloat16, seed=bits, ignore=2)
    wq, scales, biases = mx.quantize(w, group_size=gs, bits=bits)
    g = mx.random.normal((m,), key=mx.random.key(6))
    g_lse = 0.1 * mx.random.normal((m,), key=mx.random.key(7))
    logp, lse, dh = h_grad(hid, wq, y, g, g_lse, 30.0, mx.gpu, fused, scales, biases, gs,
                           tuning={"row_block": 1000000})
    w_dense = mx.dequantize(wq, scales, biases, group_size=gs, bits=bits)
    r_logp, r_lse, r_dh = h_grad(rounded(hid, mx.bfloat16), rounded(w_dense, mx.bfloat16),
                                 y, g, g_lse, 30.0, mx.cpu, True)
    np.testing.assert_allclose(np.array(logp), np.array(r_logp), atol=FWD_ATOL, rtol=0)
    np.testing.assert_allclose(np.array(lse), np.array(r_lse), atol=FWD_ATOL, rtol=0)
    assert rel_err(dh, r_dh) < BWD_RTOL[mx.bfloat16]


def check_split_tiles(hid, w, y, bits, fused, softcap, vocab_chunk):
    """dh with its short last round split in 4 pieces (twice) and unsplit:
    both match the CPU, and the split result is the same bit for bit."""
    gs = 64
    q = mx.quantize(w, group_size=gs, bits=bits) if bits else (w, None, None)
    w_dense = mx.dequantize(*q, group_size=gs, bits=bits) if bits else w
    m = hid.shape[0]
    g = mx.random.normal((m,), key=mx.random.key(8))
    g_lse = 0.1 * mx.random.normal((m,), key=mx.random.key(9))
    grads = []
    for splits in (4, 4, 1):
        tuning = {"dh_splits": splits, "vocab_chunk": vocab_chunk}
        grads.append(h_grad(hid, q[0], y, g, g_lse, softcap, mx.gpu, fused, q[1], q[2], gs,
                            tuning=tuning)[2])
    r_dh = h_grad(rounded(hid, mx.bfloat16), rounded(w_dense, mx.bfloat16), y, g, g_lse,
                  softcap, mx.cpu, True)[2]
    assert mx.array_equal(grads[0], grads[1])
    for dh in (grads[0], grads[2]):
        assert rel_err(dh, r_dh) < BWD_RTOL[mx.bfloat16]


# 1280 x 512 x 4000: every dh tile is in the short last round (bf16: 10 row
# tiles x 2 column tiles; 4-bit: 5 x 4) and becomes 4 pieces.
SPLIT_SHAPE = (1280, 512, 4000)


@pytest.mark.parametrize("bits", [0, 4])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("chunk", [1000000, 1024])
def test_split_tiles(bits, fused, softcap, chunk):
    """A dh launch whose last round would leave most multiprocessors idle
    splits those tiles along the chunk, and the pieces add into the
    accumulator in a fixed order: 16 k-steps a piece with one vocabulary
    chunk, 4 with four chunks, whose first, middle and last updates all meet
    pieces. Without a softcap the running reference stays within 16 of these
    logits' chunk maxima, so no row rescales (the next test has them)."""
    hid, w, y = make(*SPLIT_SHAPE, mx.bfloat16, seed=11, ignore=2)
    check_split_tiles(hid, w, y, bits, fused, softcap, chunk)


@pytest.mark.parametrize("bits", [0, 4])
@pytest.mark.parametrize("softcap", [None, 50.0])
def test_split_tiles_rescale(bits, softcap):
    """Split tiles where the fused forward's running reference moves: half
    the rows have a logit in the second vocabulary chunk 25-48 above the first
    chunk's maximum, so the third chunk's update rescales their old values
    (piece 0 reads, scales and writes; the later pieces add)."""
    m, h, v = SPLIT_SHAPE
    hid, w, y = make(m, h, v, mx.bfloat16, seed=12, ignore=2)
    w = w / 3  # logits ~ N(0, 2.3^2): chunk maxima near 8
    hid[: m // 2, 0] = 6.0
    w[1500, 0] = 8.0  # + 48 on column 1500 for the first half of the rows
    hid, w = hid.astype(mx.bfloat16), w.astype(mx.bfloat16)
    s = np.array(rounded(hid, mx.bfloat16) @ rounded(w, mx.bfloat16).T)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    jump = s[: m // 2, 1024:2048].max(axis=1) - s[: m // 2, :1024].max(axis=1)
    assert 16 < jump.min() and jump.max() < 64  # moves the reference, no second pass
    check_split_tiles(hid, w, y, bits, True, softcap, 1024)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_fused_forward_extreme_logits(dtype):
    """Rows whose logits all sit near -cap (the smallest exp(s - cap) the
    bf16 fused path keeps, ~e^-60; fp16 P takes a running reference) and rows
    with one logit near +cap: lse and the gradient stay finite and match the
    CPU."""
    m, h, v = 64, 64, 700
    _, w, y = make(m, h, v, dtype, seed=21)
    w = -mx.abs(w)
    w[0, :32] = mx.abs(w[0, :32])
    hid = mx.zeros((m, h))
    hid[:32, :32] = 10.0  # s_0 ~ +80, the rest ~ -80 before the softcap
    hid[32:, 32:] = 10.0  # every logit ~ -80
    hid = hid.astype(dtype)
    g = mx.ones((m,))
    logp, lse, dh = h_grad(hid, w, y, g, mx.zeros((m,)), 30.0, mx.gpu, True)
    r_logp, r_lse, r_dh = h_grad(rounded(hid, dtype), rounded(w, dtype), y, g,
                                 mx.zeros((m,)), 30.0, mx.cpu, True)
    assert float(r_lse[40]) < -20.0 and float(r_lse[0]) > 20.0  # the regime under test
    assert np.all(np.isfinite(np.array(dh.astype(mx.float32))))
    np.testing.assert_allclose(np.array(lse), np.array(r_lse), atol=FWD_ATOL, rtol=0)
    np.testing.assert_allclose(np.array(logp), np.array(r_logp), atol=FWD_ATOL, rtol=0)
    assert rel_err(dh, r_dh) < BWD_RTOL[dtype]


@pytest.mark.parametrize("late", [40.0, 200.0])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_fused_forward_running_reference(late, dtype, chunks):
    """No softcap: the first chunk's logits are small and a later column's are
    `late` larger. bf16: 40 stays within the running reference's headroom; 200
    outruns it, which must send the forward through its exact second pass.
    fp16 (headroom e^11): both outrun it, and the chunk holding column 900 must
    raise its rows' reference and run again. All must match the CPU kernels."""
    m, h, v = 96, 64, 1300
    hid, w, y = make(m, h, v, dtype, seed=31)
    hid = mx.abs(hid)
    w = 0.01 * mx.abs(w)  # every logit ~ +0.2
    w[900] = late / (0.8 * h) * mx.ones((h,))  # logit ~ late on column 900
    w = w.astype(dtype)
    g = mx.random.normal((m,), key=mx.random.key(7))
    g_lse = 0.1 * mx.random.normal((m,), key=mx.random.key(8))
    logp, lse, dh = h_grad(hid, w, y, g, g_lse, None, mx.gpu, True, tuning=chunks)
    r_logp, r_lse, r_dh = h_grad(rounded(hid, dtype), rounded(w, dtype), y, g,
                                 g_lse, None, mx.cpu, True)
    assert float(r_lse.max()) > late / 2  # the regime under test
    # Logits of size `late`: fp32 sums of 64 exact products in other orders
    # differ by up to 64 * 2^-24 * late on top of FWD_ATOL.
    atol = FWD_ATOL + 64 * 2.0**-24 * late
    np.testing.assert_allclose(np.array(lse), np.array(r_lse), atol=atol, rtol=0)
    np.testing.assert_allclose(np.array(logp), np.array(r_logp), atol=atol, rtol=0)
    assert np.all(np.isfinite(np.array(dh.astype(mx.float32))))
    assert rel_err(dh, r_dh) < BWD_RTOL[dtype]


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_extra_memory_is_bounded(softcap):
    """Forward + gradient for h at V = 131072: extra device memory beyond the
    inputs, the outputs and the [M, H] fp32 gradient state stays within the
    64 MB budget (the [M, chunk] P/dS buffer is capped at 48 MB), a sixteenth
    of the [M, V] fp32 logits this shape would take."""
    m, h, v = 2048, 256, 131072
    hid, w, y = make(m, h, v, mx.bfloat16, seed=41)
    mx.eval(hid, w, y)

    def loss(hid):
        return flash_cce_forward(hid, w, y, softcap=softcap, stream=mx.gpu)[0].sum()

    mx.eval(mx.grad(loss)(hid))  # warm-up: kernels loaded, graph built
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    dh = mx.grad(loss)(hid)
    mx.eval(dh)
    extra = mx.get_peak_memory() - base
    allowed = (64 << 20) + m * h * 4 + dh.nbytes + 2 * m * 4 * 4
    logits = m * v * 4
    assert extra <= allowed, (extra, allowed)
    assert extra < logits / 16, (extra, logits)


def test_kernel_image_routes_to_its_kernels():
    """The fatbin image the driver loaded decides the kernels: only an sm_90a
    SASS image holds the Hopper ones; PTX, JIT-compiled for a GPU without a
    matching SASS image, runs the portable ones. The parity tests above check
    whichever path this image routes to."""
    image = _ext.gpu_kernel_image()
    print(f"flash_cce CUDA kernels: {image}")
    device, rest = image.split(", ", 1)
    loaded, kernels = rest.rsplit(", ", 1)
    assert kernels in ("Hopper kernels", "portable kernels"), image
    if "PTX, JIT-compiled" in loaded or device != "device sm_90":
        assert kernels == "portable kernels", image
    else:
        assert (loaded, kernels) == ("image sm_90a SASS", "Hopper kernels"), image


# Temperature and entropy ------------------------------------------------------


def _head(w, bits):
    """(w, its quantization arguments, its dequantized weight) of a dense
    (bits = 0) or `bits`-bit head, group size 64."""
    if not bits:
        return w, {}, w
    wq, s, b = mx.quantize(w, group_size=64, bits=bits)
    return wq, dict(scales=s, biases=b, group_size=64), mx.dequantize(wq, s, b, group_size=64,
                                                                      bits=bits)


def _temperature_ref(hid, wd, y, dtype, softcap, temperature, g, ge=None, dw=False):
    """CPU kernels on what the GPU sees: the temperature folds into h (scaled in
    fp32, then rounded to the operand type by the loaders) and the cap;
    dh = d(..)/d(h / T) / T. With `ge` also the entropy's gradient; with `dw`
    also d(..)/dW, returned as (st, dh, dW)."""
    ct = operand_type(dtype)
    h_eff = rounded(hid.astype(mx.float32) * (1.0 / temperature), ct)
    w32 = rounded(wd, ct)
    cap = None if softcap is None else softcap / temperature

    def loss(h, w):
        st = flash_cce_forward(h, w, y, softcap=cap, entropy=True, stream=mx.cpu)
        return (g * st.logp + (0 if ge is None else ge * st.entropy)).sum(), st

    if dw:
        (_, st), (dh, d_w) = mx.value_and_grad(loss, argnums=(0, 1))(h_eff, w32)
        return st, dh / temperature, d_w
    (_, st), dh = mx.value_and_grad(loss)(h_eff, w32)
    return st, dh / temperature


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("softcap,temperature", [(None, 0.7), (30.0, 1.3)])
@pytest.mark.parametrize("bits", [0, 4, 8])
def test_temperature_matches_cpu(dtype, softcap, temperature, bits):
    m, h, v = 130, 128, 1000
    hid, w, y = make(m, h, v, dtype, seed=17 + bits, ignore=3)
    w, q, wd = _head(w, bits)
    g = mx.random.normal((m,))

    def loss(h):
        logp, lse = flash_cce_forward(h, w, y, softcap=softcap, temperature=temperature,
                                      stream=mx.gpu, **q)
        return (g * logp).sum(), (logp, lse)

    (_, (logp, lse)), dh = mx.value_and_grad(loss)(hid)
    st, r_dh = _temperature_ref(hid, wd, y, dtype, softcap, temperature, g)
    assert dh.dtype == hid.dtype
    np.testing.assert_allclose(np.array(lse), np.array(st.lse), atol=FWD_ATOL, rtol=0)
    np.testing.assert_allclose(np.array(logp), np.array(st.logp), atol=FWD_ATOL, rtol=0)
    # One more rounding of h / T than test_dense_matches_cpu's operands: within its bound.
    assert rel_err(dh, r_dh) < BWD_RTOL[dtype]


# The entropy's error: dH/dz_v = -p_v (z_v - zbar), so logit errors of at most
# d move it by at most max|z - zbar| d; here |z| < 25 (|z - zbar| < 50) and d
# is the forward's few 1e-6 (fp32 sums of exact products, tanh_fast within a
# few ulps of the cap), plus the exp approximations (2^-22 relative) of sums
# whose ratio r / l is below 50: well inside FWD_ATOL. The mean logit averages
# V such logits: the same bound.
ENT_ATOL = FWD_ATOL


def _entropy_case(m, h, v, dtype, bits, softcap, temperature, seed):
    """h, the head and targets of an entropy test: every odd row's target is its
    arg-max (so that is_top1 is true on some rows), two rows ignored."""
    hid, w, y = make(m, h, v, dtype, seed=seed, ignore=2)
    w, q, wd = _head(w, bits)
    ct = operand_type(dtype)
    # Softcap and temperature are monotone: the arg-max of the raw logits.
    z = np.array(rounded(hid, ct) @ rounded(wd, ct).T)
    y = np.array(y)
    y[3::2] = z.argmax(axis=1)[3::2]
    return hid, w, q, wd, mx.array(y), z


def _check_entropy(st, r_st, z, y):
    for name in ("logp", "lse", "entropy", "mean_logit"):
        np.testing.assert_allclose(np.array(getattr(st, name)), np.array(getattr(r_st, name)),
                                   atol=ENT_ATOL, rtol=0, err_msg=name)
    assert st.is_top1.dtype == mx.bool_ and st.entropy.dtype == mx.float32
    # Rows whose top two logits are apart by more than the forward's error agree.
    top2 = np.sort(z, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 4 * FWD_ATOL
    top1, r_top1 = np.array(st.is_top1), np.array(r_st.is_top1)
    np.testing.assert_array_equal(top1[clear], r_top1[clear])
    assert r_top1[clear].any() and not r_top1[clear].all()
    assert not top1[np.array(y) == -100].any()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("softcap,temperature", [(None, 1.0), (30.0, 1.0), (None, 0.7),
                                                 (30.0, 0.7)])
@pytest.mark.parametrize("bits", [0, 4, 8])
def test_entropy_matches_cpu(dtype, softcap, temperature, bits, kernels):
    """Every entropy output and the gradients of sum(g logp + ge entropy) for h
    and (dense heads) W on the GPU against the CPU kernels on the operands the
    GPU sees; `kernels` picks the backward's dS kernel (Hopper or portable)."""
    from flash_cce import ops
    from flash_cce.fallback import dequantize_f32

    m, h, v = 96, 128, 1500
    hid, w, q, wd, y, z = _entropy_case(m, h, v, dtype, bits, softcap, temperature, 23 + bits)
    g, ge = mx.random.normal((m,)), mx.random.normal((m,))
    native = ops.native_stats(mx.gpu)
    if bits and not native:
        # The fallback dequantizes in fp32 (mx.dequantize rounds to the scales' type).
        wd = dequantize_f32(w, q["scales"], q["biases"], 64, bits)

    def loss(h, w):
        st = flash_cce_forward(h, w, y, softcap=softcap, temperature=temperature,
                               entropy=True, stream=mx.gpu, tuning=kernels, **q)
        return (g * st.logp + ge * st.entropy).sum(), st

    (_, st), grads = mx.value_and_grad(loss, argnums=0 if bits else (0, 1))(hid, w)
    if bits:  # one argnum: mx.value_and_grad returns the gradient itself
        grads = (grads,)
    if native:
        r_st, r_dh, r_dw = _temperature_ref(hid, wd, y, dtype, softcap, temperature, g, ge,
                                            dw=True)
    else:
        def ref(h, w):
            r = flash_cce_forward(h, w, y, softcap=softcap, temperature=temperature,
                                  entropy=True, stream=mx.cpu)
            return (g * r.logp + ge * r.entropy).sum(), r

        (_, r_st), (r_dh, r_dw) = mx.value_and_grad(ref, argnums=(0, 1))(
            hid.astype(mx.float32), wd.astype(mx.float32))
    _check_entropy(st, r_st, z, y)
    assert grads[0].dtype == hid.dtype
    assert rel_err(grads[0], r_dh) < BWD_RTOL[dtype]
    if not bits:
        assert grads[1].dtype == w.dtype
        assert rel_err(grads[1], r_dw) < BWD_RTOL[dtype]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("bits", [0, 4])
def test_entropy_many_splits(dtype, bits):
    """4000 rows (32 row tiles) over 9000 columns: the forward splits the
    vocabulary into several splits of several tiles each (plan.h aims at 8
    waves of blocks), so the statistics merge within a thread across tiles and
    across splits; the backward runs 256-column chunks over 1000-row blocks."""
    m, h, v = 4000, 64, 9000
    softcap, temperature = 30.0, 0.7
    hid, w, q, wd, y, z = _entropy_case(m, h, v, dtype, bits, softcap, temperature, 31 + bits)
    g, ge = mx.random.normal((m,)), mx.random.normal((m,))
    tuning = {"vocab_chunk": 256, "row_block": 1000}

    def loss(h):
        st = flash_cce_forward(h, w, y, softcap=softcap, temperature=temperature,
                               entropy=True, stream=mx.gpu, tuning=tuning, **q)
        return (g * st.logp + ge * st.entropy).sum(), st

    (_, st), dh = mx.value_and_grad(loss)(hid)
    r_st, r_dh = _temperature_ref(hid, wd, y, dtype, softcap, temperature, g, ge)
    _check_entropy(st, r_st, z, y)
    assert rel_err(dh, r_dh) < BWD_RTOL[dtype]


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_entropy_top1_ties(softcap, kernels):
    """Two equal head rows (5 and 1400, in different vocabulary tiles and
    splits) give every row its largest logit twice: is_top1 holds for the first
    index only, as on the CPU, and never for an ignored row."""
    m, h, v = 64, 64, 1500
    hid, w, y = make(m, h, v, mx.bfloat16, seed=41, ignore=2)
    hid[:, 0] = 4.0
    tie = mx.zeros((h,)).astype(mx.bfloat16)
    tie[0] = 4.0
    w[5] = tie
    w[1400] = tie
    y = np.array(y)
    y[2::2], y[3::2] = 5, 1400
    y = mx.array(y)
    st = flash_cce_forward(hid, w, y, softcap=softcap, entropy=True, stream=mx.gpu,
                           tuning=kernels)
    r_st = flash_cce_forward(rounded(hid, mx.bfloat16), rounded(w, mx.bfloat16), y,
                             softcap=softcap, entropy=True, stream=mx.cpu)
    expect = np.zeros(m, bool)
    expect[2::2] = True
    np.testing.assert_array_equal(np.array(r_st.is_top1), expect)
    np.testing.assert_array_equal(np.array(st.is_top1), expect)
    np.testing.assert_allclose(np.array(st.entropy), np.array(r_st.entropy), atol=ENT_ATOL,
                               rtol=0)


def test_entropy_g_entropy_alone():
    """The gradient of the entropy alone (g = 0; fp32 h: the portable dS
    kernel), ignored rows included as on the CPU, against the CPU kernels."""
    m, h, v = 8, 32, 700
    hid, w, y = make(m, h, v, mx.float32, seed=43, ignore=2)
    w = rounded(w, mx.bfloat16)
    hid = rounded(hid, mx.bfloat16)
    ge = mx.random.normal((m,), key=mx.random.key(7))

    def ent(h):
        return (ge * flash_cce_forward(h, w, y, entropy=True, stream=mx.gpu).entropy).sum()

    dh = mx.grad(ent)(hid)
    r_dh = mx.grad(lambda h: (ge * flash_cce_forward(h, w, y, entropy=True,
                                                      stream=mx.cpu).entropy).sum())(hid)
    assert float(mx.abs(dh[:2]).sum()) > 0  # ignored rows take the entropy's gradient
    assert rel_err(dh, r_dh) < BWD_RTOL[mx.float32]
