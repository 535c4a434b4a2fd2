"""The harness's interface: bindings, explicit template entries, dynamic
threadgroup memory, thread positions, and the errors it reports."""

from pathlib import Path

import numpy as np
import pytest

import metal_emu as me
from emu_env import build

PRIMITIVES = Path(__file__).parent / "samples" / "primitives.metal"


@pytest.fixture(scope="module")
def prog():
    return build(PRIMITIVES, entries=["fill<float>", "fill<int>"])


def test_threadgroup_memory_argument(prog):
    x = np.arange(96, dtype=np.float32)
    x.setflags(write=False)  # inputs may be read-only
    y = np.zeros(96, np.float32)
    prog.run(me.Dispatch("reverse_groups", {0: x, 1: y}, threadgroups=(3, 1, 1),
                         threads=(32, 1, 1), threadgroup_memory={0: 128}))
    np.testing.assert_array_equal(y, x.reshape(3, 32)[:, ::-1].ravel())


def test_thread_positions(prog):
    groups, threads = (2, 3, 2), (4, 2, 3)
    n = int(np.prod(threads))
    out = np.zeros((int(np.prod(groups)), n, 4), np.uint32)
    prog.run(me.Dispatch("positions", {0: out}, threadgroups=groups, threads=threads))
    for gz in range(groups[2]):
        for gy in range(groups[1]):
            for gx in range(groups[0]):
                g = (gz * groups[1] + gy) * groups[0] + gx
                for lz in range(threads[2]):
                    for ly in range(threads[1]):
                        for lx in range(threads[0]):
                            i = (lz * threads[1] + ly) * threads[0] + lx
                            want = [gx * threads[0] + lx, gy * threads[1] + ly,
                                    lx + 10 * ly + 100 * lz, g]
                            assert list(out[g, i]) == want


def test_explicit_template_entries(prog):
    f = np.zeros(40, np.float32)
    i = np.zeros(40, np.int32)
    prog.run(me.Dispatch("fill<float>", {0: f}, threads=(40, 1, 1)),
             me.Dispatch("fill<int>", {0: i}, threads=(40, 1, 1)))
    np.testing.assert_array_equal(f, np.arange(40))
    np.testing.assert_array_equal(i, np.arange(40))
    build(PRIMITIVES, entries=["fill<float>"], mode="typecheck")


def test_same_array_is_the_same_buffer_across_dispatches(prog):
    x = np.arange(64, dtype=np.float32)
    tmp = np.zeros(64, np.float32)
    y = np.zeros(64, np.float32)
    prog.run(me.Dispatch("reverse_groups", {0: x, 1: tmp}, threads=(64, 1, 1),
                         threadgroup_memory={0: 256}),
             me.Dispatch("reverse_groups", {0: tmp, 1: y}, threads=(64, 1, 1),
                         threadgroup_memory={0: 256}))
    np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("dispatch,message", [
    (dict(buffers={0: "x"}, threadgroup_memory={0: 128}),
     r"parameter 'y' \[\[buffer\(1\)\]\] is not set"),
    (dict(buffers={0: "x", 1: "y", 2: "x"}, threadgroup_memory={0: 128}),
     r"sets buffer 2 but the kernel has no \[\[buffer\(2\)\]\]"),
    (dict(buffers={0: "x", 1: "y"}), r"'buf' \[\[threadgroup\(0\)\]\] has no threadgroup memory"),
    (dict(buffers={0: "x", 1: "y"}, threadgroup_memory={0: 100}), "not a multiple of 16"),
    (dict(buffers={0: "x", 1: "y"}, threadgroup_memory={0: 32768 + 16}), "exceeds the 32 KB"),
    (dict(buffers={0: "x", 1: "y"}, threadgroup_memory={0: 128}, threads=(1025, 1, 1)),
     "1025 threads per threadgroup"),
])
def test_dispatch_errors(prog, dispatch, message):
    x = np.zeros(2048, np.float32)
    y = np.zeros(2048, np.float32)
    buffers = {i: {"x": x, "y": y}[v] for i, v in dispatch.pop("buffers").items()}
    d = me.Dispatch("reverse_groups", buffers, **{"threads": (32, 1, 1), **dispatch})
    with pytest.raises(me.EmulationError, match=message):
        prog.run(d)


def test_interface_errors(prog):
    with pytest.raises(ValueError, match="entry 'nope' is not in this build"):
        prog.run(me.Dispatch("nope", {}))
    with pytest.raises(ValueError, match="compiles only"):
        build(PRIMITIVES, mode="typecheck").run(me.Dispatch("fill<float>", {}))
    with pytest.raises(ValueError, match="mode must be one of"):
        me.build(PRIMITIVES, mode="fast")
    with pytest.raises(me.CompileError, match="no \\[\\[kernel\\]\\] function 'nothing'"):
        build(PRIMITIVES, entries=["nothing<float>"])


def test_constant_parameter_larger_than_its_buffer():
    prog = build(Path(__file__).parent / "samples" / "reduce.metal")
    x = np.zeros((1, 32), np.float32)
    with pytest.raises(me.EmulationError,
                       match=r"'n' \(buffer 2\) needs 4 bytes, the buffer has 2"):
        prog.run(me.Dispatch("row_sum_float", {0: x, 1: np.zeros(1, np.float32),
                                               2: np.int16(32)}, threads=(32, 1, 1)))


def test_threadgroup_declaration_it_cannot_share_is_refused():
    """Two threadgroup arrays in one declaration would silently become one copy
    per thread; the build refuses instead."""
    src = me.mutate((Path(__file__).parent / "samples" / "reduce.metal").read_text(),
                    "threadgroup float partial[32];", "threadgroup float partial[32], other[4];")
    with pytest.raises(me.CompileError, match="cannot rewrite the threadgroup declaration"):
        build(src)


def test_kernel_that_never_finishes_times_out(prog):
    with pytest.raises(me.EmulationError, match="did not finish within 2 s"):
        prog.run(me.Dispatch("spin", {0: np.zeros(1, np.int32)}), timeout=2)


def test_source_with_mlx_headers_inlined():
    """A build-time inlined source carries MLX's headers as `// ---- NAME`
    sections with include guards; those the emulator shadows are swapped for
    the shadows (their own text cannot compile as C++)."""
    from emu_env import mlx_include

    inc = mlx_include()
    sections = []
    for i, name in enumerate(["mlx/backend/metal/kernels/bf16_math.h",
                              "mlx/backend/metal/kernels/complex.h",
                              "mlx/backend/metal/kernels/logging.h",
                              "mlx/backend/metal/kernels/steel/utils/type_traits.h"]):
        text = (inc / name).read_text().replace("#pragma once", "")
        sections.append(f"// ---- {name}\n#ifndef GUARD_{i}\n#define GUARD_{i}\n{text}\n"
                        f"#endif // GUARD_{i}")
    body = (Path(__file__).parent / "samples" / "reduce.metal").read_text()
    src = "#include <metal_stdlib>\n" + "\n".join(sections) + "\n" + body
    prog = build(src)
    x = np.ones((1, 100), np.float32)
    out = np.zeros(1, np.float32)
    prog.run(me.Dispatch("row_sum_float", {0: x, 1: out, 2: np.int32(100)}, threads=(64, 1, 1)))
    assert out[0] == 100
    build(src, mode="typecheck")
