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
from test_metal_head import U32, Head, check_all, check_backward, plans_for, reference

pytestmark = pytest.mark.skipif(metal_emu.find_compiler() is None, reason="needs clang++")

# Two m tiles, three splits of several blocks: every barrier of the tile loop matters.
PROBLEM = dict(M=37, H=70, V=333)
# Under AddressSanitizer (slower): still two m tiles, partial k and vocabulary tiles.
SMALL = dict(M=33, H=36, V=70)


def forward_plan(p, fused, regs=-1):
    # The grouped fused forward unless regs = 1 (the accumulator in registers).
    return he.plan("forward", p.M, p.H, p.V, fused=fused, max_splits=3,
                   **p.kw(acc_registers=regs))


def forward_error(program, p, fused, seed=0, scratch_short=None, regs=-1):
    """Largest |lse - reference| over the rows, relative to its derived bound."""
    plan = forward_plan(p, fused, regs)
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


def source_for(fused=None):
    """The kernels of the forward plans (one build serves them all)."""
    p = Head(2, 8, 40)
    return he.kernel_source(he.plan_kernels(forward_plan(p, False), forward_plan(p, True),
                                            forward_plan(p, True, regs=1)))


@pytest.fixture(scope="module")
def head():
    return Head(**PROBLEM, seed=7)


@pytest.fixture(scope="module")
def small():
    return Head(**SMALL, seed=8)


def test_unmodified_passes(head, small):
    prog = he.build(source=source_for())
    for fused in (False, True):
        assert forward_error(prog, head, fused) <= 1
    asan = he.build(source=source_for(), mode="asan")
    for fused in (False, True):
        assert forward_error(asan, small, fused) <= 1


def test_every_pass_clean_under_asan():
    # Buffers and threadgroup arrays of exact size: no access outside them in
    # any pass of a dense float32 head or a 3- and 4-bit head.
    kernels = set()
    for plan in plans_for(Head(2, 8, 40), 0.0, compute_dw=True):
        kernels |= he.plan_kernels(plan)
    for bits in (3, 4):
        for plan in plans_for(Head(2, 32, 40, quant=(bits, 32)), 0.0):
            kernels |= he.plan_kernels(plan)
    prog = he.build(kernels, mode="asan")
    check_all(prog, Head(**SMALL, ignore=(1,), seed=9), 3.0, compute_dw=True, max_splits=2)
    for bits in (3, 4):
        check_all(prog, Head(5, 64, 45, quant=(bits, 32), seed=bits), 30.0, max_splits=1)


# The three barriers of the logits tile: before loading the next h and w
# tiles (a SIMD group overwrites tiles others still multiply), between loading
# and multiplying (one multiplies a tile others have not finished loading), and
# between storing the logits and the row epilogue (rows read before written).
BARRIERS = {
    "before_load": ("    threadgroup_barrier(mem_flags::mem_threadgroup);\n"
                    "    DenseTile<HT, T>::load(h, p.M, p.H, m0,",
                    "    DenseTile<HT, T>::load(h, p.M, p.H, m0,"),
    "before_mma": ("threadgroup_barrier(mem_flags::mem_threadgroup);\n    mma.mma(sm.hs, sm.ws);",
                   "mma.mma(sm.hs, sm.ws);"),
    "before_epilogue": ("      cs + mma.sm * kLdC + mma.sn);\n  threadgroup_barrier(mem_flags::mem_threadgroup);",
                        "      cs + mma.sm * kLdC + mma.sn);"),
}


@pytest.mark.parametrize("barrier", sorted(BARRIERS))
def test_barrier_removed_is_caught(head, barrier):
    # A race shows under some thread schedules: four seeded schedules, one must fail.
    src = metal_emu.mutate(source_for(), *BARRIERS[barrier])
    prog = he.build(source=src)
    assert max(forward_error(prog, head, False, seed=s) for s in range(4)) > 1


@pytest.mark.parametrize("regs", [-1, 1])
def test_threadgroup_memory_one_float_short_is_caught(small, regs):
    # Both fused forwards write their last float (the row factors' last entry).
    src = source_for()
    size, kernel = ("FCCE_REG_SMEM_FLOATS", "head_fwd_fused_regs(") if regs > 0 else \
        ("FCCE_SMEM_FLOATS", "head_fwd_fused(")
    decl = f"threadgroup float smem[{size}(sizeof(T))];"
    at = src[: src.index(f"void {kernel}")].count(decl)  # that kernel's own
    src = metal_emu.mutate(src, decl, f"threadgroup float smem[{size}(sizeof(T)) - 1];",
                           occurrence=at)
    prog = he.build(source=src, mode="asan")
    assert forward_error(he.build(source=source_for(), mode="asan"), small, True, regs=regs) <= 1
    with pytest.raises(metal_emu.EmulationError, match="AddressSanitizer|out of bounds"):
        forward_error(prog, small, True, regs=regs)


# The loaders' fast path (metal/loaders.h): steel's unpredicated load_unsafe
# only for tiles wholly inside the operand. Taken for every tile, the last m
# tile, the last columns of H and the last vocabulary block read past their
# buffers (dense); the last vocabulary block past the packed rows (quantized).
FAST_PATH = {
    "dense": ("if (r0 + FCCE_BM <= rows && c0 + FCCE_BK <= cols) {", "if (true) {"),
    "quantized": ("if (v0 + FCCE_BN <= p.V) {", "if (true) {"),
}


@pytest.mark.parametrize("loader", sorted(FAST_PATH))
def test_loader_fast_path_at_an_edge_is_caught(small, loader):
    p = small if loader == "dense" else Head(5, 64, 45, quant=(4, 32), seed=4)
    src = he.kernel_source(he.plan_kernels(forward_plan(p, False)))
    prog = he.build(source=metal_emu.mutate(src, *FAST_PATH[loader]), mode="asan")
    with pytest.raises(metal_emu.EmulationError, match="AddressSanitizer|out of bounds"):
        forward_error(prog, p, False)


def test_scratch_buffer_one_float_short_is_caught(small):
    prog = he.build(source=source_for(), mode="asan")
    with pytest.raises(metal_emu.EmulationError, match="AddressSanitizer|out of bounds"):
        forward_error(prog, small, False, scratch_short="part_sum")


def test_wrong_buffer_index_is_caught(head):
    # part_max and part_sum swapped: every buffer still bound, the values wrong.
    src = source_for()
    src = metal_emu.mutate(src, "device float* part_max [[buffer(8)]],",
                           "device float* part_max [[buffer(9)]],", occurrence=0)
    src = metal_emu.mutate(src, "device float* part_sum [[buffer(9)]],",
                           "device float* part_sum [[buffer(8)]],", occurrence=0)
    prog = he.build(source=src)
    assert forward_error(prog, head, False) > 1


def test_address_spaces_type_check():
    # Every kernel compiles with device / constant / threadgroup as distinct
    # clang address spaces; a threadgroup pointer used as a device pointer does not.
    he.build(mode="typecheck")
    src = metal_emu.mutate(he.kernel_source(), "    device float* dst = part + i0;",
                           "    device float* dst = sm.cs + i0;")
    with pytest.raises(metal_emu.CompileError, match="address_space"):
        he.build(source=src, mode="typecheck")


# The barriers of the group accumulation (accumulate_cw): before loading a
# block's w tile (a SIMD group overwrites the tile others still multiply) and
# between loading and multiplying. ThreadSanitizer reports the unordered pair
# under any schedule.
GROUP_BARRIERS = {
    "before_w_load": ("      threadgroup_barrier(mem_flags::mem_threadgroup);\n"
                      "      w.load(p, (vb + b) * FCCE_BN, i0, sm.ws, sgid, lane);",
                      "      w.load(p, (vb + b) * FCCE_BN, i0, sm.ws, sgid, lane);"),
    "before_acc_mma": ("      w.load(p, (vb + b) * FCCE_BN, i0, sm.ws, sgid, lane);\n"
                       "      threadgroup_barrier(mem_flags::mem_threadgroup);",
                       "      w.load(p, (vb + b) * FCCE_BN, i0, sm.ws, sgid, lane);"),
}


def group_source():
    p = Head(2, 8, 40)
    return he.kernel_source(he.plan_kernels(
        forward_plan(p, True), he.plan("backward", 2, 8, 40, **p.kw(acc_registers=-1))))


def run_fused_passes(prog):
    # Five blocks in one split: a group of four and a group of one.
    p = Head(9, 36, 150, seed=10)
    fwd = he.plan("forward", p.M, p.H, p.V, fused=True, **p.kw(max_splits=1, acc_registers=-1))
    a = p.operands()
    a.update(logp=np.zeros(p.M, np.float32), lse=np.zeros(p.M, np.float32),
             gsum=np.zeros((p.M, p.H), np.float32))
    he.run_plan(prog, fwd, a)
    bwd = he.plan("backward", p.M, p.H, p.V, **p.kw(max_splits=1, acc_registers=-1))
    b = p.operands()
    b.update(lse=a["lse"], g=p.g, g_lse=p.g_lse, dh=np.zeros((p.M, p.H), np.float32))
    he.run_plan(prog, bwd, b)


def race_is_reported(source, edit, check):
    """`check` run on the `tsan` build of `source` with `edit` (a barrier
    removed) reports a data race."""
    src = metal_emu.mutate(source, *edit)
    with pytest.raises(metal_emu.EmulationError, match="ThreadSanitizer: data race"):
        check(he.build(source=src, mode="tsan"))


def test_group_accumulation_clean_under_tsan():
    run_fused_passes(he.build(source=group_source(), mode="tsan"))


@pytest.mark.parametrize("barrier", sorted(GROUP_BARRIERS))
def test_group_barrier_removed_is_caught_under_tsan(barrier):
    race_is_reported(group_source(), GROUP_BARRIERS[barrier], run_fused_passes)


# dh with the accumulator in registers (metal/regs.h): the barriers around
# staging a W piece (before it, the coefficients must be complete and the
# previous piece multiplied; after it, loaded) and before a later chunk
# reloads its dS tile (the previous block's pieces still read it); and each
# piece's fragments in their own accumulator and columns, each block's dS tile
# at its own place in the stage.
REG_BARRIERS = {
    "before_piece_load": ("          threadgroup_barrier(mem_flags::mem_threadgroup);\n"
                          "          w.load(p, v0, i0, sm.ws, sgid, lane);",
                          "          w.load(p, v0, i0, sm.ws, sgid, lane);"),
    "before_piece_mma": ("          w.load(p, v0, i0, sm.ws, sgid, lane);\n"
                         "          threadgroup_barrier(mem_flags::mem_threadgroup);",
                         "          w.load(p, v0, i0, sm.ws, sgid, lane);"),
    "before_ds_reload": ("        threadgroup_barrier(mem_flags::mem_threadgroup);\n"
                         "        for (int k = 0; k < 8; ++k) {\n"
                         "          crow[k] = st[er * FCCE_BN + ec + k];",
                         "        for (int k = 0; k < 8; ++k) {\n"
                         "          crow[k] = st[er * FCCE_BN + ec + k];"),
}
# Two chunks of H (the second partial), three blocks in rounds of two (a
# launch that resumes the accumulator), two m tiles.
REG_PROBLEM = dict(M=37, H=264, V=70)
REG_PLAN = dict(max_splits=1, round_blocks=2)


def regs_source():
    return he.kernel_source({"fcce_dhreg_hf32_wf32", "fcce_reduce_dh_f32"})


def check_regs(prog, seed=0):
    p = Head(**REG_PROBLEM, ignore=(3,), seed=12)
    check_backward(prog, p, 3.0, reference(p, 3.0)[1], seed=seed, **REG_PLAN)


def test_acc_registers_clean_under_tsan():
    check_regs(he.build(source=regs_source(), mode="tsan"))


@pytest.mark.parametrize("barrier", sorted(REG_BARRIERS))
def test_acc_registers_barrier_removed_is_caught_under_tsan(barrier):
    race_is_reported(regs_source(), REG_BARRIERS[barrier], check_regs)


REG_EDITS = {
    # a piece's accumulator stored to another piece's columns
    "stored_to_other_columns": ("      mma.Ctile = acc[j];\n      mma.store_result_safe",
                                "      mma.Ctile = acc[j ^ 1];\n      mma.store_result_safe"),
    # a block's W piece multiplied into the next piece's accumulator
    "wrong_accumulator": ("          acc[j] = mma.Ctile;",
                          "          acc[(j + 1) % FCCE_REG_PIECES] = mma.Ctile;"),
    # a resumed round starting from zero, not from its predecessor's partial
    "resume_dropped": ("start_chunk(acc, mma, part, p.H, c0, rows, p.block_begin > 0);",
                       "start_chunk(acc, mma, part, p.H, c0, rows, false);"),
    # a later chunk reading another block's staged dS tile
    "wrong_stage_tile": ("          crow[k] = st[er * FCCE_BN + ec + k];",
                         "          crow[k] = (vb > vb0 ? st - FCCE_STAGE_FLOATS : st)"
                         "[er * FCCE_BN + ec + k];"),
}


def test_acc_registers_unmodified_passes():
    check_regs(he.build(source=regs_source()))


@pytest.mark.parametrize("edit", sorted(REG_EDITS))
def test_acc_registers_wrong_fragment_is_caught(edit):
    prog = he.build(source=metal_emu.mutate(regs_source(), *REG_EDITS[edit]))
    with pytest.raises(AssertionError, match="Mismatched elements"):
        check_regs(prog)


# dW with its accumulator in registers (metal/dw.h, dw_regs_tiles): two chunks
# of H (the second partial), three m tiles in one launch and, in the second
# plan, one per launch (each continuing the float32 rows). ThreadSanitizer
# reports the barriers before staging an h piece and before a later chunk
# reloads an m tile's dS tile removed; the float64 dW comparison catches a
# launch that restarts the rows from zero and a later chunk reading the
# previous m tile's staged dS (its chunks start and end in regs.h's
# start_chunk and store_chunk, whose edits REG_EDITS covers).
DW_PROBLEM = dict(M=70, H=264, V=40)
DW_PLANS = [dict(), dict(round_m_tiles=1)]
DW_BARRIERS = {
    "before_piece_load": ("          threadgroup_barrier(mem_flags::mem_threadgroup);\n"
                          "          DenseTile<HT, T>::load(h, p.M, p.H, m0, i0,",
                          "          DenseTile<HT, T>::load(h, p.M, p.H, m0, i0,"),
    "before_ds_reload": ("        threadgroup_barrier(mem_flags::mem_threadgroup);\n"
                         "        for (int k = 0; k < 8; ++k) {\n"
                         "          ds_row[k] =",
                         "        for (int k = 0; k < 8; ++k) {\n"
                         "          ds_row[k] ="),
}
DW_EDITS = {
    "rows_not_continued": ("start_chunk(rows_sum, mma, out, p.H, c0, rw.rows, p.m_tile_begin > 0);",
                           "start_chunk(rows_sum, mma, out, p.H, c0, rw.rows, false);"),
    "wrong_stage_tile": ("          ds_row[k] = ds_stage[er * FCCE_BN + ec + k];",
                         "          ds_row[k] = (mt > p.m_tile_begin ? ds_stage - FCCE_BM * FCCE_BN"
                         " : ds_stage)[er * FCCE_BN + ec + k];"),
}


def dw_source():
    return he.kernel_source({"fcce_dhreg_hf32_wf32", "fcce_reduce_dh_f32",
                             "fcce_dwreg_hf32_wf32"})


def check_dw(prog, seed=0):
    p = Head(**DW_PROBLEM, ignore=(3,), seed=14)
    for plan in DW_PLANS:
        check_backward(prog, p, 3.0, reference(p, 3.0)[1], compute_dw=True, seed=seed, **plan)


def test_dw_registers_clean_under_tsan():
    check_dw(he.build(source=dw_source(), mode="tsan"))


@pytest.mark.parametrize("barrier", sorted(DW_BARRIERS))
def test_dw_registers_barrier_removed_is_caught_under_tsan(barrier):
    race_is_reported(dw_source(), DW_BARRIERS[barrier], check_dw)


@pytest.mark.parametrize("edit", sorted(DW_EDITS))
def test_dw_registers_wrong_rows_are_caught(edit):
    prog = he.build(source=metal_emu.mutate(dw_source(), *DW_EDITS[edit]))
    check_dw(he.build(source=dw_source()))
    with pytest.raises(AssertionError, match="Mismatched elements"):
        check_dw(prog)


# The fused forward with its accumulator in registers: the online-softmax
# rescale of the accumulator dropped, and a later chunk replaying no factors
# (the first chunk's last ones) are caught by the float64 gsum comparison;
# ThreadSanitizer runs it clean.
FUSED_EDITS = {
    "rescale_dropped": ("                mma.Ctile.frag_at(a, b) *= f;",
                        "                mma.Ctile.frag_at(a, b) *= 1.0f;"),
    "factor_not_replayed": ("          factor[er] = st[FCCE_BM * FCCE_BN + er];",
                            "          factor[er] = factor[er];"),
}


def fused_regs_source():
    p = Head(2, 264, 40)
    return he.kernel_source(he.plan_kernels(*plans_for(p, 3.0)))


def check_fused_regs(prog, acc_registers=1):
    # Two chunks, rounds of two blocks, a logit scale that moves the maximum.
    p = Head(9, 264, 150, scale=4.0, seed=14)
    check_all(prog, p, 3.0, max_splits=1, round_blocks=2, acc_registers=acc_registers)


def test_fused_forward_registers_clean_under_tsan():
    check_fused_regs(he.build(source=fused_regs_source(), mode="tsan"))


@pytest.mark.parametrize("edit", sorted(FUSED_EDITS))
def test_fused_forward_registers_mutation_is_caught(edit):
    prog = he.build(source=metal_emu.mutate(fused_regs_source(), *FUSED_EDITS[edit]))
    with pytest.raises(AssertionError, match="Mismatched elements"):
        check_fused_regs(prog)


def test_fused_forward_grouped_rescale_dropped_is_caught():
    # The same defect in the grouped kernel (head.h), which runs when forced.
    edit = ("              acc.Ctile.frag_at(i, j) *= f;",
            "              acc.Ctile.frag_at(i, j) *= 1.0f;")
    prog = he.build(source=metal_emu.mutate(fused_regs_source(), *edit))
    with pytest.raises(AssertionError, match="Mismatched elements"):
        check_fused_regs(prog, acc_registers=-1)
