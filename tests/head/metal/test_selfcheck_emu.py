"""The run-time self-check (flash_cce.selfcheck, through flash_cce.metal's
Gate) run against the emulated Metal kernels: the unmodified kernels pass it,
and each planted defect is refused.

Defects are planted as the other mutation tests plant theirs: one edit of the
kernel source that the emulation builds (head_emu.kernel_source), located by a
pattern that raises, naming the defect, when the kernels no longer contain it.
Each defect runs the shipped problem that targets it (the same inputs as in
the full list: a problem's seed is its own), through the gate's self_check.
"""

import re

import mlx.core as mx
import pytest

import head_emu as he
import metal_emu
from emu_native import EmuNative
from flash_cce import metal
from flash_cce.selfcheck import PROBLEMS, HeadSpec, self_check

pytestmark = pytest.mark.skipif(metal_emu.find_compiler() is None, reason="needs clang++")

LIB_OK = {"source": "source", "path": None, "error": None}
F32 = HeadSpec("float32", "float32")
Q4 = HeadSpec("bfloat16", "uint32", 4, 64, "bfloat16")
# The problem with float32 inputs off the bfloat16 grid, H = 200, a custom
# ignore_index and one split of 65 blocks.
OFF_GRID = [p for p in PROBLEMS if p.off_grid]


SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # HeadSpec's -> head_emu's


def spec_kernels(spec):
    """Every kernel the self-check's plans use for `spec`."""
    kw = dict(h=SHORT[spec.h_dtype])
    if spec.bits is None:
        kw["w"] = SHORT[spec.w_dtype]
        H = 8
    else:
        kw.update(quantized=True, bits=spec.bits, group_size=spec.group_size,
                  sb=SHORT[spec.sb_dtype])
        H = spec.group_size
    dense = spec.bits is None
    plans = [he.plan("forward", 2, H, 40, fused=f, **kw) for f in (False, True)]
    plans.append(he.plan("backward", 2, H, 40, compute_dw=dense, dw_slab_rows=32 if dense else 0,
                         **kw))
    plans.append(he.plan("fused_dh", 2, H, 40, out=kw["h"], **kw))
    # The entropy variants (the check runs them where the native path has them).
    plans.append(he.plan("forward", 2, H, 40, stats=True, **kw))
    plans.append(he.plan("backward", 2, H, 40, compute_dw=dense, dw_slab_rows=32 if dense else 0,
                         stats=True, **kw))
    return he.plan_kernels(*plans)


def gate(source, problems=PROBLEMS):
    log = []
    g = metal.Gate(load_library=lambda: LIB_OK, native=EmuNative(he.build(source=source)),
                   stream=mx.cpu, warn=log.append, problems=problems)
    return g, log


# name -> (what it does, [(pattern, replacement)]) on the kernel source. A
# pattern must match exactly once.
DEFECTS = {
    # The dense operands' path: steel's BlockLoader (metal/loaders.h,
    # steel_tile), which the float32 head takes for h and w. The rounding is
    # planted after the load, in the tile the GEMM reads.
    "bf16_loader": (
        "the dense tile loader rounds its float32 operands to bfloat16",
        [(r"(ld\.load_safe\(short2\(short\(min\(FCCE_BK, cols - c0\)\), "
          r"short\(min\(FCCE_BM, rows - r0\)\)\)\);\n  \})",
          r"\1\n  for (short j = 0; j < 8; ++j) {"
          r" ld.dst[j] = T(float(bfloat(float(ld.dst[j])))); }")]),
    "no_h_tail_guard": (
        "the dense tile loader reads columns past H (its tail guard removed: the edge "
        "tiles' column count is always BK)",
        [(r"short\(min\(FCCE_BK, cols - c0\)\)", "short(FCCE_BK)")]),
    "ignore_index_constant": (
        "the tile loop's row targets compare with -100 instead of p.ignore_index",
        [(r"t\.y != p\.ignore_index", "t.y != -100")]),
    "no_sum_rescale": (
        "the online softmax's running sum is not rescaled when the row maximum moves",
        [(r"run_sum = run_sum \* f \+", "run_sum = run_sum +")]),
    # In the register kernel (regs.h), the one the plan runs for the fused
    # forward; the grouped kernel's rescale (head.h) runs only when a problem
    # forces it (acc_registers = -1), which the gate's plans never do.
    "no_partial_rescale": (
        "the fused forward's partial gsum is not rescaled when the row maximum moves",
        [(r"mma\.Ctile\.frag_at\(a, b\) \*= f;", "(void)f;")]),
    "no_entropy_rescale": (
        "the entropy's running sum r is not moved to the new row maximum",
        [(r"ent\.r = f \* \(ent\.r \+ \(run_max - new_max\) \* run_sum\) \+",
          "ent.r = ent.r +")]),
    "no_entropy_share": (
        "the backward's dS drops the entropy's share -g_ent p (s - zbar)",
        [(r"c -= r\.ge \* \(s\[j\] - r\.zbar\);", "(void)c;")]),
    "no_round_resume": (
        "a launch round after the first restarts the split's running maximum and sum",
        [(r"if \(MODE != FCCE_MODE_DH && p\.block_begin > 0 && t\.ok\)", "if (false)")]),
}


ENTROPY_DEFECTS = {"no_entropy_rescale", "no_entropy_share"}
ENT = F32.key + ", entropy"  # the gate's key of F32's entropy check


def plant(source, name):
    what, edits = DEFECTS[name]
    for pattern, replacement in edits:
        found = len(re.findall(pattern, source))
        if found != 1:
            raise AssertionError(
                f"defect {name!r} ({what}): pattern {pattern!r} matches {found} times in the "
                f"kernel source (metal/*.metal, metal/*.h); the kernels changed: update DEFECTS")
        source = re.sub(pattern, replacement, source)
    return source


@pytest.fixture(scope="module")
def f32_source():
    return he.kernel_source(spec_kernels(F32))


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: f"M{p.M}-V{p.V}")
def test_unmodified_kernels_pass_the_shipped_self_check(f32_source, problem):
    # One problem per test (seconds each); each problem has its own seed, so
    # passing each alone is passing the list.
    native = EmuNative(he.build(source=f32_source))
    g = metal.Gate(load_library=lambda: LIB_OK, native=native, stream=mx.cpu,
                   warn=pytest.fail, problems=[problem])
    assert g.allows(F32), g.checks[F32.key].detail
    assert 0 < g.checks[F32.key].worst <= 1
    # The native path ran: forward twice, backward, the fused dh; no entropy
    # kernel until a call asks for the entropy.
    assert native.launches >= 4
    assert not any("_ent" in k for k in native.kernels)
    assert g.allows(F32, entropy=True), g.checks[ENT].detail
    assert 0 < g.checks[ENT].worst <= 1
    assert {"fcce_fwd_ent_hf32_wf32", "fcce_dhreg_ent_hf32_wf32"} <= native.kernels


def test_unmodified_quantized_kernels_pass_the_long_split():
    src = he.kernel_source(spec_kernels(Q4))
    for entropy in (False, True):
        result = self_check(Q4, EmuNative(he.build(source=src)), mx.cpu, OFF_GRID, entropy=entropy)
        assert result.passed, result.detail


def test_the_long_split_problem_runs_one_split_of_65_blocks_in_rounds():
    (p,) = OFF_GRID
    plan = he.plan("forward", p.M, p.hidden, p.V, max_splits=p.max_splits,
                   round_blocks=p.round_blocks, ignore_index=p.ignore_index)
    rounds = [l["params"] for l in plan["launches"] if l["kernel"].startswith("fcce_fwd_")]
    assert all(r["splits"] == 1 and r["blocks_per_split"] >= 64 for r in rounds)
    assert [r["block_begin"] for r in rounds] == [0, 16, 32, 48, 64]
    assert p.hidden % 32 and p.ignore_index not in (-100,) and 0 <= p.ignore_index < p.V


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_planted_defect_is_refused(f32_source, defect):
    g, log = gate(plant(f32_source, defect), OFF_GRID)
    # A defect of the entropy variants is refused by the entropy's check only:
    # calls without the entropy keep the (unaffected) kernels.
    entropy = defect in ENTROPY_DEFECTS
    assert g.allows(F32) == entropy
    assert not g.allows(F32, entropy=True)
    key = ENT if entropy else F32.key
    result = g.checks[key]
    print(f"{defect}: refused at {result.worst:.3g} x the bound ({result.detail})")
    assert result.worst > 1 and len(log) == 1 and key in log[0]
