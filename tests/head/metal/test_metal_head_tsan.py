"""ThreadSanitizer over every pass of the Metal head (forward, fused forward,
backward with dW and the dW slab cast, fused dh; dense float32 and bfloat16
heads and a 4-bit head), and the races it must catch.

In the `tsan` build only barriers (with a memory flag) and dispatch ends order
accesses (tests/head/metal/README.md): a pair of accesses inside a threadgroup
that no barrier orders is reported whatever the fiber schedule, which the
`run` build's schedules can miss. The head kernels run 128 threads per
threadgroup, within the ~240 threads ThreadSanitizer keeps apart; races
between threadgroups of the larger dispatches may go unreported (the warning
Program.run gives for those is expected here).
"""

import re
import warnings

import pytest

import head_emu as he
import metal_emu
from test_metal_head import Head, check_all, plans_for

pytestmark = [pytest.mark.skipif(metal_emu.find_compiler() is None, reason="needs clang++"),
              pytest.mark.filterwarnings("ignore:.*ThreadSanitizer keeps about")]

# Two m tiles (the second partial), a partial k tile, 3 vocabulary blocks in
# two splits, two dW slabs for the bfloat16 head.
SHAPE = dict(M=33, H=36, V=70)


def head_kernels():
    names = set()
    for dt in ("f32", "bf16"):
        for plan in plans_for(Head(2, 8, 40, dt), 0.0, compute_dw=True, dw_slab_rows=32):
            names |= he.plan_kernels(plan)
    for plan in plans_for(Head(2, 32, 40, quant=(4, 32)), 0.0):
        names |= he.plan_kernels(plan)
    return names


@pytest.fixture(scope="module")
def source():
    return he.kernel_source(head_kernels())


def check_every_pass(prog, acc_registers=(1, -1)):
    # The fused forward and dh with their accumulator in registers (regs.h,
    # the plan's choice) and forced to the grouped kernels (head.h).
    for regs in acc_registers:
        check_all(prog, Head(**SHAPE, ignore=(1,), seed=9), 3.0, compute_dw=True, max_splits=2,
                  acc_registers=regs)
        check_all(prog, Head(**SHAPE, dtype="bf16", seed=10), None, compute_dw=True,
                  max_splits=2, dw_slab_rows=32, acc_registers=regs)
        check_all(prog, Head(5, 64, 45, quant=(4, 32), seed=4), 30.0, max_splits=1,
                  acc_registers=regs)


def test_every_pass_is_race_free(source):
    check_every_pass(he.build(source=source, mode="tsan"))


# The accumulate pass (fused forward, dh): its w tile is reloaded while other
# SIMD groups may still multiply the previous one unless a barrier orders it.
# Found as the barrier right before a `w.load(` (the logits tile loads h
# first), once in each kernel family's header: the grouped kernels (head.h)
# and the register kernels (regs.h). family -> (header, the acc_registers
# value that makes the plan run it).
ACC_BARRIER = r"threadgroup_barrier\(mem_flags::mem_threadgroup\);(\s*w\.load\()"
FAMILIES = {"grouped": ("head.h", -1), "registers": ("regs.h", 1)}


def test_each_acc_barrier_belongs_to_one_family(source):
    # Every match is one family's, so no accumulate pass escapes the mutations.
    assert len(re.findall(ACC_BARRIER, source)) == len(FAMILIES)


def weaken_acc_barrier(source, family, replacement):
    header = FAMILIES[family][0]
    text = (he.METAL / header).read_text()
    if source.count(text) != 1:
        raise AssertionError(f"{header} is not inlined once in the kernel source")
    found = len(re.findall(ACC_BARRIER, text))
    if found != 1:
        raise AssertionError(f"the accumulate pass's barrier before its w load matches {found} "
                             f"times in {header}; the kernels changed: update ACC_BARRIER")
    start = source.index(text)
    return (source[:start] + re.sub(ACC_BARRIER, replacement + r"\1", text)
            + source[start + len(text):])


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("change", ["removed", "mem_none"])
def test_accumulate_barrier_defect_is_a_race(source, family, change):
    # Removed, or kept as an execution barrier that orders no memory (mem_none):
    # both leave the tile's reads and the next load unordered.
    new = "" if change == "removed" else "threadgroup_barrier(mem_flags::mem_none);"
    prog = he.build(source=weaken_acc_barrier(source, family, new), mode="tsan")
    with pytest.raises(metal_emu.EmulationError, match="ThreadSanitizer: data race"):
        check_every_pass(prog, acc_registers=(FAMILIES[family][1],))


def test_a_barrier_with_a_memory_flag_orders_accesses(source):
    # mem_device in place of mem_threadgroup orders the tile too in this model
    # (either flag orders all memory): no race, the results still correct.
    for family in FAMILIES:
        source = weaken_acc_barrier(source, family, "threadgroup_barrier(mem_flags::mem_device);")
    prog = he.build(source=source, mode="tsan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_every_pass(prog)
