"""Per-configuration compilation: the Metal host compiles, per launch plan,
the embedded source cut down to the plan's kernels (csrc/metal/kernel_source.h).

Here that cut is made by the host's own code (through plan_dump --select)
from the source the build embeds (cmake/metal_inline.py over metal/*.metal and
MLX's headers), then compiled by the emulation and run through the plans of
each configuration against the float64 reference: what Metal compiles for a
configuration holds every kernel its plans launch, and only those.
"""

import importlib.util
import re

import pytest

import emu_env
import head_emu as he
import metal_emu
from test_metal_head import Head, check_all, plans_for

pytestmark = pytest.mark.skipif(metal_emu.find_compiler() is None, reason="needs clang++")

_spec = importlib.util.spec_from_file_location("metal_inline", he.ROOT / "cmake" / "metal_inline.py")
metal_inline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(metal_inline)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The source the module embeds, as the build writes it."""
    inc = emu_env.mlx_include()
    source, _ = metal_inline.inline_sources([str(he.SOURCE)], [str(inc)])
    path = tmp_path_factory.mktemp("metal") / "flash_cce.metal"
    path.write_text(source)
    return path


def instantiated(text):
    return set(re.findall(r'^template \[\[host_name\("([^"]+)"\)\]\]', text, re.M))


CONFIGS = {
    "f32": (Head(33, 36, 70, "f32", ignore=(1,), seed=3), 3.0),
    "bf16-4bit": (Head(5, 64, 45, "bf16", quant=(4, 32), seed=4), 30.0),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_a_configuration_compiles_and_runs_only_its_kernels(shipped, config):
    p, cap = CONFIGS[config]
    dense = p.quant is None
    plans = plans_for(p, cap, compute_dw=dense, max_splits=2)
    kernels = he.plan_kernels(*plans)
    text = he.select_kernels(shipped, kernels)
    every = instantiated(shipped.read_text())
    assert len(every) > 90
    # Exactly the plan's template kernels; the plain ones stay as they are.
    assert instantiated(text) == kernels & every
    assert len(text) < len(shipped.read_text())
    check_all(he.build(source=text), p, cap, compute_dw=dense, max_splits=2)


def test_a_kernel_missing_from_the_source_is_named(shipped):
    with pytest.raises(ValueError, match="no kernel fcce_fwd_hf64_wf64"):
        he.select_kernels(shipped, {"fcce_fwd_hf32_wf32", "fcce_fwd_hf64_wf64"})


def test_the_entropy_variants_compile_only_when_asked(shipped):
    # A configuration's logp plans cut no entropy kernel; its entropy plans
    # cut exactly theirs (combine_ent is a template: not kept like a plain
    # kernel), which compile and run against float64.
    from test_metal_entropy import check_backward, check_forward, ent_plans, g_ent_of

    p, cap = CONFIGS["bf16-4bit"]
    plain = he.plan_kernels(*plans_for(p, cap, max_splits=2))
    assert not any("_ent" in k for k in instantiated(he.select_kernels(shipped, plain)))
    kernels = he.plan_kernels(*ent_plans(p, cap, compute_dw=False, max_splits=2))
    text = he.select_kernels(shipped, kernels)
    assert instantiated(text) == kernels
    prog = he.build(source=text)
    check_forward(prog, p, cap, max_splits=2)
    check_backward(prog, p, cap, g_ent_of(p, 6), max_splits=2)
