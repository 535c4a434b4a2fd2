"""The harness must be able to fail: each standard mutation of a correct sample
kernel is caught (a wrong result against the fp64 reference, or an error).

The same mutations apply to any kernel source through metal_emu.mutate.
"""

from pathlib import Path

import numpy as np
import pytest

import metal_emu as me
from emu_env import build

SAMPLES = Path(__file__).parent / "samples"
PRIMITIVES = SAMPLES / "primitives.metal"
BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"
ROWS, N = 3, 1000


def reduce_source():
    return (SAMPLES / "reduce.metal").read_text()


def row_sum(prog, seed=0, out=None):
    x = np.random.default_rng(0).standard_normal((ROWS, N)).astype(np.float32)
    out = np.zeros(ROWS, np.float32) if out is None else out
    prog.run(me.Dispatch("row_sum_float", {0: x, 1: out, 2: np.int32(N)},
                         threadgroups=(ROWS, 1, 1), threads=(256, 1, 1)), seed=seed)
    # test_row_sum's bound for this shape.
    ok = np.abs(out - x.astype(np.float64).sum(1)) <= 38 * 2.0**-24 * np.abs(x).sum(1)
    return bool(np.all(ok))


def test_unmutated_passes_every_build():
    src = reduce_source()
    assert all(row_sum(build(src), seed) for seed in range(4))
    assert row_sum(build(src, mode="asan"))
    with pytest.warns(UserWarning, match="ThreadSanitizer keeps about 256 threads apart"):
        assert row_sum(build(src, mode="tsan"))  # 3 x 256 threads
    build(src, mode="typecheck")


def test_removed_barrier_gives_wrong_results():
    # The barrier ending each step of the tree over SIMD-group partials.
    prog = build(me.mutate(reduce_source(), BARRIER, "", occurrence=1))
    assert not any(row_sum(prog, seed) for seed in range(3))


@pytest.mark.parametrize("occurrence", [0, 1])
def test_removed_barrier_in_steel_gemm_gives_wrong_results(occurrence):
    """0: before loading the next tiles (a thread overwrites a tile others still
    read); 1: between loading the tiles and the MMA (a thread reads a tile
    others have not written). Both run-ahead schedules (seeds 0 and 1) catch
    each; the uniform random schedule (seed 2) may not."""
    src = me.mutate((SAMPLES / "gemm_nt.metal").read_text(), BARRIER, "", occurrence=occurrence)
    prog = build(src)
    m, n, k = 32, 32, 48
    rng = np.random.default_rng(3)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k)).astype(np.float32)
    for seed in (0, 1):
        c = np.zeros((m, n), np.float32)
        prog.run(me.Dispatch("gemm_nt_float",
                             {0: a, 1: b, 2: c, 3: np.array([m, n, k, 0], np.int32)},
                             threadgroups=(1, 1, 1), threads=(128, 1, 1)), seed=seed)
        assert not np.allclose(c, a.astype(np.float64) @ b.T, atol=1e-3)


@pytest.mark.parametrize("occurrence", [0, 1])
def test_removed_barrier_is_a_race_under_thread_sanitizer(occurrence):
    """ThreadSanitizer orders only what a barrier orders, so the race is
    reported under the uniform schedule (seed 2) that may miss the wrong
    result."""
    src = me.mutate((SAMPLES / "gemm_nt.metal").read_text(), BARRIER, "", occurrence=occurrence)
    prog = build(src, mode="tsan")
    m, n, k = 32, 32, 48
    a = np.ones((m, k), np.float32)
    b = np.ones((n, k), np.float32)
    c = np.zeros((m, n), np.float32)
    with pytest.raises(me.EmulationError, match="ThreadSanitizer: .*data race"):
        prog.run(me.Dispatch("gemm_nt_float",
                             {0: a, 1: b, 2: c, 3: np.array([m, n, k, 0], np.int32)},
                             threadgroups=(1, 1, 1), threads=(128, 1, 1)), seed=2)


def test_benign_barrier_removal_is_not_a_race():
    """Without the barrier after the SIMD sums, the tree's first step (stride
    16 reads nothing with 8 SIMD groups) still ends in a barrier: no race, and
    ThreadSanitizer reports none."""
    prog = build(me.mutate(reduce_source(), BARRIER, "", occurrence=0), mode="tsan")
    with pytest.warns(UserWarning, match="ThreadSanitizer keeps"):
        assert row_sum(prog)


def test_two_threadgroups_writing_one_element_is_a_race():
    """Threadgroups of one dispatch are unordered. (ThreadSanitizer keeps about
    240 threads apart: 3 x 64 threads here; 2 x 128 would go unreported.)"""
    src = me.mutate(reduce_source(), "out[row] = partial[0];", "out[0] = partial[0];")
    x = np.ones((3, 100), np.float32)
    with pytest.raises(me.EmulationError, match="ThreadSanitizer: .*data race"):
        build(src, mode="tsan").run(me.Dispatch(
            "row_sum_float", {0: x, 1: np.zeros(3, np.float32), 2: np.int32(100)},
            threadgroups=(3, 1, 1), threads=(64, 1, 1)))


def test_output_buffer_one_element_short():
    prog = build(reduce_source(), mode="asan")
    with pytest.raises(me.EmulationError, match="AddressSanitizer: .*heap-buffer-overflow"):
        row_sum(prog, out=np.zeros(ROWS - 1, np.float32))


def test_threadgroup_array_one_element_short():
    # 256 threads are 8 SIMD groups; partial[7] holds 7. The array's type
    # carries its size, so UndefinedBehaviorSanitizer's bounds check reports
    # it first; through a pointer (a [[threadgroup(n)]] buffer) AddressSanitizer does.
    src = me.mutate(reduce_source(), "threadgroup float partial[32];",
                    "threadgroup float partial[7];")
    with pytest.raises(me.EmulationError, match="index 7 out of bounds for type 'float\\[7\\]'"):
        row_sum(build(src, mode="asan"))


def test_threadgroup_buffer_one_element_short():
    prog = build(PRIMITIVES, mode="asan")
    x = np.arange(64, dtype=np.float32)
    y = np.zeros(64, np.float32)
    d = me.Dispatch("reverse_groups", {0: x, 1: y}, threads=(64, 1, 1),
                    threadgroup_memory={0: 256})
    prog.run(d)
    np.testing.assert_array_equal(y, x[::-1])
    d.threadgroup_memory = {0: 240}
    with pytest.raises(me.EmulationError, match="AddressSanitizer: .*heap-buffer-overflow"):
        prog.run(d)


def test_buffer_index_not_set_by_the_dispatch():
    src = me.mutate(reduce_source(), "[[buffer(2)]]", "[[buffer(3)]]")
    with pytest.raises(me.EmulationError, match=r"parameter 'n' \[\[buffer\(3\)\]\] is not set"):
        row_sum(build(src))


def test_buffer_indices_swapped_give_wrong_results():
    src = me.mutate(reduce_source(), "x [[buffer(0)]]", "x [[buffer(1)]]")
    src = me.mutate(src, "out [[buffer(1)]]", "out [[buffer(0)]]")
    assert not row_sum(build(src))


def test_barrier_under_thread_dependent_branch():
    src = me.mutate(reduce_source(), "  " + BARRIER + "\n  // Tree",
                    "  if (tid < 64) " + BARRIER + "\n  // Tree")
    with pytest.raises(me.EmulationError, match="divergent threadgroup_barrier"):
        row_sum(build(src))


def test_simd_operation_under_thread_dependent_branch():
    src = me.mutate(reduce_source(), "acc = simd_sum(acc);",
                    "if (lane < 16) acc = simd_sum(acc);")
    with pytest.raises(me.EmulationError, match="SIMD-group operation|deadlock"):
        row_sum(build(src))


def test_simd_operations_at_different_sites_in_branches():
    """Both branches reduce once (the counts agree); the lanes meet at different
    calls, which MSL leaves undefined."""
    src = me.mutate(reduce_source(), "acc = simd_sum(acc);",
                    "if (lane < 16) {\n    acc = simd_sum(acc);\n  } else {\n"
                    "    acc = simd_sum(acc + 1.0f);\n  }")
    with pytest.raises(me.EmulationError, match=r"divergent SIMD-group operation: this thread "
                       r"is at source.metal:\d+ \(its call #1\)"):
        row_sum(build(src))


def test_threadgroup_pointer_assigned_to_device_pointer():
    src = me.mutate(reduce_source(), "  if (lane == 0) {\n",
                    "  device float* p = partial;\n  if (lane == 0) {\n")
    with pytest.raises(me.CompileError, match="address_space\\(1\\).*address_space\\(3\\)"):
        build(src, mode="typecheck")


def test_buffer_argument_without_address_space():
    src = me.mutate(reduce_source(), "const device T* x [[buffer(0)]]", "const T* x [[buffer(0)]]")
    with pytest.raises(me.CompileError, match="buffer argument 'x' must be in the device or "
                                              "constant address space"):
        build(src, mode="typecheck")


def test_mutate_refuses_missing_or_ambiguous_text():
    with pytest.raises(ValueError, match="does not occur"):
        me.mutate("abc", "x", "y")
    with pytest.raises(ValueError, match="occurs 2 times"):
        me.mutate("xx", "x", "y")
