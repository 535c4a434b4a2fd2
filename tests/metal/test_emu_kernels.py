"""Sample kernels under emulation against fp64 references.

The error bounds: a float32 sum of k terms carries at most k * u * sum|x|
(u = 2^-24, Higham's gamma_k to first order); inputs are rounded to the
kernel's dtype first, so the reference sees exactly what the kernel reads.
"""

from pathlib import Path

import numpy as np
import pytest

import metal_emu as me
from emu_env import build

SAMPLES = Path(__file__).parent / "samples"
U32 = 2.0**-24
DTYPES = ["float", "half", "bfloat"]


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
def test_row_sum(dtype):
    prog = build(SAMPLES / "reduce.metal")
    rng = np.random.default_rng(1)
    rows, n, threads = 3, 1000, 256
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
@pytest.mark.parametrize("mnk", [(37, 45, 50), (32, 32, 16), (1, 70, 9)])
def test_steel_gemm_tile(dtype, mnk):
    """steel's BlockLoader + BlockMMA: the simdgroup_matrix lane layout is right."""
    prog = build(SAMPLES / "gemm_nt.metal")
    m, n, k = mnk
    rng = np.random.default_rng(2)
    a = to_dtype(rng.standard_normal((m, k)), dtype)
    b = to_dtype(rng.standard_normal((n, k)), dtype)
    c = np.full((m, n), np.nan, np.float32)
    prog.run(me.Dispatch(f"gemm_nt_{dtype}", {0: a, 1: b, 2: c, 3: np.array([m, n, k, 0], np.int32)},
                         threadgroups=(-(-n // 32), -(-m // 32), 1), threads=(128, 1, 1)))
    af, bf = as_f64(a, dtype), as_f64(b, dtype)
    # Each 8x8 product rounds once to float32 and adds to a float32 accumulator:
    # about k / 8 + 1 roundings of partial sums bounded by sum |a||b|.
    bound = (k / 8 + 2) * U32 * (np.abs(af) @ np.abs(bf).T)
    assert np.all(np.abs(c - af @ bf.T) <= bound)
