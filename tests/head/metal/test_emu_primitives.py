"""The emulated MSL operations against their specification: SIMD-group
shuffles and reductions, simdgroup_matrix, half/bfloat rounding, atomics.

References are numpy (SIMD semantics as Apple's Metal Shading Language
specification states them), numpy's float16 and MLX's bfloat16 conversion.
"""

from pathlib import Path

import numpy as np
import pytest

import metal_emu as me
from emu_env import build

PRIMITIVES = Path(__file__).parent / "samples" / "primitives.metal"


@pytest.fixture(scope="module")
def prog():
    return build(PRIMITIVES)


def simd_reference(x):
    """Rows as simd_ops writes them, for one SIMD group of 32 lanes."""
    lane = np.arange(32)
    quad = lane & ~3
    fill_down = np.where(lane + 4 < 32, x[np.minimum(lane + 4, 31)], -x[(lane + 4) % 32])
    fill_up = np.where(lane >= 4, x[lane - 4], -x[(lane - 4) % 32])
    return np.stack([
        x[(lane * 7 + 3) % 32],
        x[lane ^ 5],
        np.where(lane + 3 < 32, x[np.minimum(lane + 3, 31)], x),
        np.where(lane >= 3, x[lane - 3], x),
        np.full(32, x[9]),
        np.full(32, x.sum()),
        np.full(32, x.max()),
        np.full(32, x.min()),
        np.cumsum(x),
        np.cumsum(x) - x,
        x[quad + ((lane ^ 1) & 3)],
        x.reshape(8, 4).sum(1).repeat(4),
        x[quad + 2],
        x[(lane + 5) % 32],
        fill_down,
        fill_up,
    ])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simd_operations(prog, seed):
    threads = 64
    x = np.random.default_rng(seed).integers(-1000, 1000, threads).astype(np.int32)
    out = np.zeros((16, threads), np.int32)
    prog.run(me.Dispatch("simd_ops", {0: x, 1: out}, threads=(threads, 1, 1)), seed=seed)
    for g in range(threads // 32):
        lanes = slice(32 * g, 32 * g + 32)
        np.testing.assert_array_equal(out[:, lanes], simd_reference(x[lanes]))


def test_simdgroup_matrix_multiply_load_store(prog):
    rng = np.random.default_rng(6)
    a, b, c = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(3))
    d = np.zeros((8, 8), np.float32)
    e = np.zeros((8, 8), np.float32)
    prog.run(me.Dispatch("matrix_ops", {0: a, 1: b, 2: c, 3: d, 4: e}, threads=(32, 1, 1)))
    ref = a.astype(np.float64) @ b + c
    # Products and sums in double, one rounding to float32.
    assert np.all(np.abs(d - ref) <= 2.0**-24 * np.abs(ref))
    np.testing.assert_array_equal(e, a.T)


def test_half_and_bfloat_rounding(prog):
    """Round to nearest even, subnormals, overflow to inf, NaN."""
    import mlx.core as mx

    rng = np.random.default_rng(7)
    x = np.concatenate([
        np.float32([0.0, -0.0, 1.0, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 2.98e-8, 1e-5,
                    np.nan, np.inf, -np.inf, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8,
                    1 + 3 * 2.0**-8, 3.0e38]),
        (rng.standard_normal(45) * 10.0 ** rng.integers(-6, 6, 45)).astype(np.float32),
    ])
    n = len(x)
    h = np.zeros(n, np.float16)
    bf = np.zeros(n, np.uint16)
    prod = np.zeros(n, np.float16)
    back = np.zeros(n, np.float32)
    prog.run(me.Dispatch("convert", {0: x, 1: h, 2: bf, 3: prod, 4: back}, threads=(n, 1, 1)))
    with np.errstate(over="ignore"):
        hx = x.astype(np.float16)
    np.testing.assert_array_equal(h.view(np.uint16), hx.view(np.uint16))
    ref_bf = np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))
    nan = np.isnan(x)
    np.testing.assert_array_equal(bf[~nan], ref_bf[~nan])
    assert np.all(np.isnan((bf[nan].astype(np.uint32) << 16).view(np.float32)))
    i = np.arange(n)
    with np.errstate(all="ignore"):
        ref_prod = hx * hx[(i + 1) % n] + hx[(i + 2) % n]  # numpy rounds each float16 op
    np.testing.assert_array_equal(prod.view(np.uint16)[~np.isnan(ref_prod)],
                                  ref_prod.view(np.uint16)[~np.isnan(ref_prod)])
    assert np.all(np.isnan(prod[np.isnan(ref_prod)]))


def test_atomics(prog):
    total = np.zeros(1, np.int32)
    per_group = np.zeros(5, np.int32)
    prog.run(me.Dispatch("atomics", {0: total, 1: per_group}, threadgroups=(5, 1, 1),
                         threads=(96, 1, 1)))
    assert total[0] == 5 * sum(range(96))
    np.testing.assert_array_equal(per_group, 96)


def test_lanes_that_returned_drop_out(prog):
    out = np.full(64, -1, np.int32)
    prog.run(me.Dispatch("early_exit", {0: out, 1: np.array([20, 1], np.int32)}))
    np.testing.assert_array_equal(out[:20], sum(range(20)))
    np.testing.assert_array_equal(out[32:52], np.arange(20) ^ 1)
    np.testing.assert_array_equal(out[20:32], -1)
    # Lanes 4 to 15 would read lanes 20 to 31, which returned.
    with pytest.raises(me.EmulationError,
                       match=r"reads lane (2\d|3[01]), which is inactive or has returned"):
        prog.run(me.Dispatch("early_exit", {0: out, 1: np.array([20, 16], np.int32)}))


def test_scalar_functions(prog):
    rng = np.random.default_rng(9)
    x = np.concatenate([np.int32([0, 1, -1, 2**30, 65535, 65536]),
                        rng.integers(-2**31, 2**31 - 1, 26, dtype=np.int64).astype(np.int32)])
    f = rng.standard_normal(32).astype(np.float32)
    n = 32
    out = np.zeros(4 * n, np.int32)
    fout = np.zeros(4 * n, np.float32)
    prog.run(me.Dispatch("scalar_ops", {0: x, 1: f, 2: out, 3: fout}, threads=(n, 1, 1)))
    u = x.view(np.uint32).astype(np.int64)
    bits = lambda v, w: np.array([w - int(b).bit_length() for b in v])  # noqa: E731
    np.testing.assert_array_equal(out[:n], bits(u, 32))
    trailing = [32 if b == 0 else (int(b) & -int(b)).bit_length() - 1 for b in u]
    np.testing.assert_array_equal(out[n:2 * n], trailing)
    np.testing.assert_array_equal(out[2 * n:3 * n], [bin(int(b)).count("1") for b in u])
    np.testing.assert_array_equal(out[3 * n:], bits(u & 0xFFFF, 16))
    i = np.arange(n)
    trio = np.stack([f, f[(i + 1) % n], f[(i + 2) % n]])
    np.testing.assert_array_equal(fout[:n], trio.max(0))
    np.testing.assert_array_equal(fout[n:2 * n], trio.min(0))
    np.testing.assert_array_equal(fout[2 * n:3 * n], np.median(trio, 0))
    np.testing.assert_array_equal(fout[3 * n:], (f >= f[(i + 1) % n]).astype(np.float32))
