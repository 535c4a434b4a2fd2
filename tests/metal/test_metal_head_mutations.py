"""The emulation catches broken variants of the head kernels: a barrier
removed, a buffer one element short (threadgroup memory in the kernel, a
scratch buffer of the plan), a wrong buffer index. Each variant is built from
metal/flash_cce.metal with one exact edit (metal_emu.mutate raises when the
text to edit is missing, so these tests cannot silently test nothing), and
the unmodified source passes the same check in the same mode.
"""

import numpy as np
import pytest

import head_emu as he
import metal_emu
from test_metal_head import U32, Head, reference

pytestmark = pytest.mark.skipif(metal_emu.find_compiler() is None, reason="needs clang++")

# Two m tiles, three splits of several blocks: every barrier of the tile loop matters.
PROBLEM = dict(M=37, H=70, V=333)


def forward_plan(p, fused):
    return he.plan("forward", p.M, p.H, p.V, fused=fused, max_splits=3, **p.kw())


def forward_error(program, p, fused, seed=0, scratch_short=None):
    """Largest |lse - reference| over the rows, relative to its derived bound."""
    plan = forward_plan(p, fused)
    if scratch_short:
        for s in plan["scratch"]:
            if s["role"] == scratch_short:
                s["bytes"] -= 4
    a = p.operands()
    a.update(logp=np.zeros(p.M, np.float32), lse=np.zeros(p.M, np.float32),
             gsum=np.zeros((p.M, p.H), np.float32))
    he.run_plan(program, plan, a, seed=seed)
    _, ref_lse, _, _, _ = reference(p, None)
    tol = 2 * p.ds() + (p.V + 16) * U32 * (1 + np.abs(ref_lse).max())
    err = np.abs(a["lse"] - ref_lse).max()
    return err / tol if np.isfinite(err) else np.inf


def source_for(fused):
    p = Head(2, 8, 40)
    return he.kernel_source(he.plan_kernels(forward_plan(p, fused)))


@pytest.fixture(scope="module")
def head():
    return Head(**PROBLEM, seed=7)


def test_unmodified_passes_in_run_and_asan(head):
    for mode in ("run", "asan"):
        for fused in (False, True):
            prog = he.build(source=source_for(fused), mode=mode)
            assert forward_error(prog, head, fused) <= 1


# The three barriers of the logits tile: before loading the next h and w
# tiles (a SIMD group overwrites tiles others still multiply), between loading
# and multiplying (one multiplies a tile others have not finished loading), and
# between storing the logits and the row epilogue (rows read before written).
BARRIERS = {
    "before_load": ("    threadgroup_barrier(mem_flags::mem_threadgroup);\n    load_dense_tile(h,",
                    "    load_dense_tile(h,"),
    "before_mma": ("threadgroup_barrier(mem_flags::mem_threadgroup);\n    mma.mma(sm.hs, sm.ws);",
                   "mma.mma(sm.hs, sm.ws);"),
    "before_epilogue": ("      sm.cs + mma.sm * kLdC + mma.sn);\n  threadgroup_barrier(mem_flags::mem_threadgroup);",
                        "      sm.cs + mma.sm * kLdC + mma.sn);"),
}


@pytest.mark.parametrize("barrier", sorted(BARRIERS))
def test_barrier_removed_is_caught(head, barrier):
    # A race shows under some thread schedules: four seeded schedules, one must fail.
    src = metal_emu.mutate(source_for(False), *BARRIERS[barrier])
    prog = he.build(source=src)
    assert max(forward_error(prog, head, False, seed=s) for s in range(4)) > 1


def test_threadgroup_memory_one_float_short_is_caught(head):
    # The fused forward writes the last float (the row factors' last entry).
    src = source_for(True)
    decl = "threadgroup float smem[FCCE_SMEM_FLOATS];"
    at = src[: src.index("void head_fwd_fused(")].count(decl)  # the fused forward's own
    src = metal_emu.mutate(src, decl, "threadgroup float smem[FCCE_SMEM_FLOATS - 1];",
                           occurrence=at)
    prog = he.build(source=src, mode="asan")
    with pytest.raises(metal_emu.EmulationError, match="AddressSanitizer"):
        forward_error(prog, head, True)


def test_scratch_buffer_one_float_short_is_caught(head):
    prog = he.build(source=source_for(False), mode="asan")
    with pytest.raises(metal_emu.EmulationError, match="AddressSanitizer"):
        forward_error(prog, head, False, scratch_short="part_sum")


def test_wrong_buffer_index_is_caught(head):
    # part_max and part_sum swapped: every buffer still bound, the values wrong.
    src = source_for(False)
    src = metal_emu.mutate(src, "device float* part_max [[buffer(8)]],",
                           "device float* part_max [[buffer(9)]],", occurrence=0)
    src = metal_emu.mutate(src, "device float* part_sum [[buffer(9)]],",
                           "device float* part_sum [[buffer(8)]],", occurrence=0)
    prog = he.build(source=src)
    assert forward_error(prog, head, False) > 1
