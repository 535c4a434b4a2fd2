"""Sample kernels under emulation against fp64 references.

The error bounds: a float32 sum of k terms carries at most k * u * sum|x|
(u = 2^-24, Higham's gamma_k to first order); inputs are rounded to the
kernel's dtype first, so the reference sees exactly what the kernel reads.
"""

import os
from pathlib import Path

import numpy as np
import pytest

import metal_emu as me
from emu_env import build

SAMPLES = Path(__file__).parent / "samples"
U32 = 2.0**-24
DTYPES = ["float", "half", "bfloat"]
# Larger problems are opt-in (the project's switch for the Metal sweeps).
SWEEP = os.environ.get("FLASH_CCE_METAL_SWEEP") == "1"


def to_dtype(x, dtype):
    """x rounded to the kernel's dtype, as the array to upload (bfloat as uint16 bits)."""
    x = np.asarray(x, np.float32)
    if dtype == "float":
        return x.copy()
    if dtype == "half":
        return x.astype(np.float16)
    bits = x.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return rounded


def as_f64(a, dtype):
    if dtype == "bfloat":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [256, 48])
def test_row_sum(dtype, threads):
    """48 threads: a second SIMD group of 16 lanes."""
    prog = build(SAMPLES / "reduce.metal")
    rng = np.random.default_rng(1)
    rows, n = 3, 1000
    x = to_dtype(rng.standard_normal((rows, n)), dtype)
    out = np.zeros(rows, np.float32)
    prog.run(me.Dispatch(f"row_sum_{dtype}", {0: x, 1: out, 2: np.int32(n)},
                         threadgroups=(rows, 1, 1), threads=(threads, 1, 1)))
    xf = as_f64(x, dtype)
    # Per thread ceil(n / threads) adds, 31 in the SIMD sum, 3 over the 8 SIMD groups.
    k = -(-n // threads) + 31 + 3
    bound = k * U32 * np.abs(xf).sum(1)
    assert np.all(np.abs(out - xf.sum(1)) <= bound)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,threads", [(1000, 256), (7, 64), (300, 96)])
def test_row_logsumexp(dtype, n, threads):
    """Online logsumexp combined with simd_shuffle_xor; fewer elements than
    threads leaves lanes with the sentinel; 96 threads is three SIMD groups."""
    prog = build(SAMPLES / "logsumexp.metal")
    rng = np.random.default_rng(5)
    rows = 3
    x = to_dtype(rng.standard_normal((rows, n)) * 4, dtype)
    lse = np.zeros(rows, np.float32)
    prog.run(me.Dispatch(f"row_logsumexp_{dtype}", {0: x, 1: lse, 2: np.int32(n)},
                         threadgroups=(rows, 1, 1), threads=(threads, 1, 1)))
    xf = as_f64(x, dtype)
    mx_ = xf.max(1)
    ref = mx_ + np.log(np.exp(xf - mx_[:, None]).sum(1))
    # Each combine rescales by exp (within 2u with its argument's rounding)
    # and adds (u): a sum passes through at most k combines, relative 4u each;
    # the final log adds u and m + log(s) rounds once more (u |lse|).
    k = -(-n // threads) + 5 + -(-threads // 32)
    bound = (4 * k + 2) * U32 + U32 * np.abs(ref)
    assert np.all(np.abs(lse - ref) <= bound)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mnk", [(37, 45, 50), (32, 32, 16), (1, 70, 9)])
def test_steel_gemm_tile(dtype, mnk):
    """steel's BlockLoader + BlockMMA: the simdgroup_matrix lane layout is right."""
    prog = build(SAMPLES / "gemm_nt.metal")
    m, n, k = mnk
    rng = np.random.default_rng(2)
    a = to_dtype(rng.standard_normal((m, k)), dtype)
    b = to_dtype(rng.standard_normal((n, k)), dtype)
    c = np.full((m, n), np.nan, np.float32)
    mnk_bytes = np.array([m, n, k, 0], np.int32)
    prog.run(me.Dispatch(f"gemm_nt_{dtype}", {0: a, 1: b, 2: c, 3: mnk_bytes},
                         threadgroups=(-(-n // 32), -(-m // 32), 1), threads=(128, 1, 1)))
    af, bf = as_f64(a, dtype), as_f64(b, dtype)
    # Each 8x8 product rounds once to float32 and adds to a float32 accumulator:
    # about k / 8 + 1 roundings of partial sums bounded by sum |a||b|.
    bound = (k / 8 + 2) * U32 * (np.abs(af) @ np.abs(bf).T)
    assert np.all(np.abs(c - af @ bf.T) <= bound)


QMM = [("float", 64, 2), ("float", 64, 3), ("float", 64, 4), ("float", 64, 5), ("float", 64, 6),
       ("float", 64, 8), ("float", 32, 4), ("float", 128, 4), ("half", 64, 4), ("bfloat", 64, 4)]


@pytest.mark.parametrize("dtype,group_size,bits", QMM)
def test_mlx_qmm_t(dtype, group_size, bits):
    """MLX's qmm_t_impl (QuantizedBlockLoader + BlockMMA) against MLX's CPU
    dequantize: x [5, 128] @ W [45, 128]^T, partial tiles in M and N."""
    import mlx.core as mx

    prog = build(SAMPLES / "qmm_t.metal")
    m, n, k = 5, 45, 128
    rng = np.random.default_rng(4)
    mxdt = {"float": mx.float32, "half": mx.float16, "bfloat": mx.bfloat16}[dtype]
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32)).astype(mxdt)
    q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    wq = mx.dequantize(q, s, b, group_size=group_size, bits=bits).astype(mx.float32)
    wabs = mx.dequantize(q, mx.abs(s), mx.abs(b), group_size=group_size, bits=bits)
    x = to_dtype(rng.standard_normal((m, k)), dtype)
    host = lambda a: to_dtype(np.array(a.astype(mx.float32)), dtype)  # noqa: E731
    y = np.zeros((m, n), x.dtype)
    prog.run(me.Dispatch(f"qmm_t_{dtype}_{group_size}_{bits}",
                         {0: np.array(q), 1: host(s), 2: host(b), 3: x, 4: y,
                          5: np.int32(k), 6: np.int32(n), 7: np.int32(m)},
                         threadgroups=(-(-n // 32), -(-m // 32), 1), threads=(128, 1, 1)))
    xf = as_f64(x, dtype)
    ref = xf @ np.array(wq, np.float64).T
    # The loader dequantizes in the dtype (one rounding of scale * q + bias,
    # u_T relative to |scale q| + |bias|); the MMA accumulates in float32;
    # the output rounds once to the dtype.
    u = {"float": U32, "half": 2.0**-11, "bfloat": 2.0**-8}[dtype]
    bound = (2 * u * np.abs(xf) @ np.array(wabs.astype(mx.float32), np.float64).T
             + (k / 8 + 2) * U32 * np.abs(xf) @ np.abs(np.array(wq, np.float64)).T
             + u * np.abs(ref))
    assert np.all(np.abs(as_f64(y, dtype) - ref) <= bound)


@pytest.mark.skipif(not SWEEP, reason="larger emulated problems: set FLASH_CCE_METAL_SWEEP=1")
@pytest.mark.parametrize("mode,seed", [("run", 0), ("run", 1), ("run", 2), ("asan", 0)])
def test_steel_gemm_large(mode, seed):
    """256 x 256 x 256: 64 threadgroups of 128 threads, every schedule."""
    prog = build(SAMPLES / "gemm_nt.metal", mode=mode)
    m = n = k = 256
    rng = np.random.default_rng(8)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k)).astype(np.float32)
    c = np.full((m, n), np.nan, np.float32)
    prog.run(me.Dispatch("gemm_nt_float", {0: a, 1: b, 2: c, 3: np.array([m, n, k, 0], np.int32)},
                         threadgroups=(8, 8, 1), threads=(128, 1, 1)), seed=seed)
    bound = (k / 8 + 2) * U32 * (np.abs(a).astype(np.float64) @ np.abs(b).T)
    assert np.all(np.abs(c - a.astype(np.float64) @ b.T) <= bound)
