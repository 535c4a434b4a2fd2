"""W indexing past 2^31 elements, emulated without the memory.

The last dW slab of a bfloat16 head with V = 2^25 + 32 rows and H = 64
(V H = 2^31 + 2048 elements, 4 GB) reads w rows from 2^25 on and writes dW
there: offsets that need 64-bit arithmetic (2^25 * 64 = 2^31). w and dW are
lazily mapped virtual buffers (metal_emu.Window) holding data only in that
slab, so only the plan's last two launches run (the slab's dW and its cast),
taken from the plan of the full shape. A kernel that forms such an offset in
32 bits (tested: the dense loader's row offset) reads far outside the rows and
fails. Tolerance as in test_metal_head.py's dW bound.
"""

import numpy as np
import pytest

import head_emu as he
import metal_emu
from test_metal_head import U32, UNIT

pytestmark = pytest.mark.skipif(metal_emu.find_compiler() is None, reason="needs clang++")

M, H, ROW0 = 8, 64, 2**25
V = ROW0 + 32
SLAB = 2**25  # two slabs: [0, 2^25) and the 32 rows from 2^25


def last_slab_plan():
    plan = he.plan("backward", M, H, V, h="bf16", w="bf16", compute_dw=True, dw_slab_rows=SLAB)
    last = plan["launches"][-2:]
    assert [l["kernel"] for l in last] == ["fcce_dwreg_hbf16_wbf16", "fcce_cast_bf16"]
    assert all(l["params"]["v_begin"] == ROW0 for l in last)
    return dict(plan, launches=last)


def run(program, seed=0):
    rng = np.random.default_rng(seed)
    h = he.to_storage(rng.standard_normal((M, H)) * 2, "bf16")
    w = he.to_storage(rng.standard_normal((32, H)) / 8, "bf16")  # rows ROW0 ... V - 1
    y = rng.integers(ROW0, V, M).astype(np.int32)
    y[1] = 5  # a target outside the slab
    lse = (rng.standard_normal(M) + 6).astype(np.float32)
    g = rng.standard_normal(M).astype(np.float32)
    g_lse = (rng.standard_normal(M) * 0.5).astype(np.float32)
    bytes_vh = V * H * 2
    dw = np.full((32, H), 0xFFFF, np.uint16)
    arrays = {"h": h, "targets": y, "lse": lse, "g": g, "g_lse": g_lse,
              "w": metal_emu.Window(w, bytes_vh, ROW0 * H * 2),
              "dw": metal_emu.Window(dw, bytes_vh, ROW0 * H * 2),
              # The float32 slab buffer: only this slab's 32 rows are touched.
              "dw_acc": metal_emu.Window(np.full(32 * H, np.nan, np.float32), SLAB * H * 4, 0)}
    he.run_plan(program, last_slab_plan(), arrays, seed=seed)

    H64, W64 = he.to_f64(h, "bf16"), he.to_f64(w, "bf16")
    P = np.exp(H64 @ W64.T - lse[:, None].astype(np.float64))
    onehot = (y[:, None] == ROW0 + np.arange(32)[None, :]).astype(np.float64)
    dS = g[:, None] * onehot + (g_lse - g)[:, None] * P
    ref = dS.T @ H64
    ds = (H + 2) * U32 * (np.abs(H64) @ np.abs(W64).T).max()
    tol = UNIT["bf16"] * np.abs(ref) + ((M + 4) * U32 + 4 * ds) * (np.abs(dS).T @ np.abs(H64))
    return np.abs(he.to_f64(dw, "bf16") - ref), tol


@pytest.fixture(scope="module")
def source():
    return he.kernel_source(he.plan_kernels(last_slab_plan()))


def test_dw_rows_past_two_to_the_31_elements(source):
    err, tol = run(he.build(source=source))
    np.testing.assert_array_less(err, tol + 1e-30)


def test_a_32_bit_row_offset_is_caught(source):
    # The offset of steel's BlockLoader tile (metal/loaders.h, steel_tile), which
    # a bfloat16 head's tiles take, formed in 32 bits.
    narrow = metal_emu.mutate(source, "src + size_t(r0) * size_t(cols) + c0,",
                              "src + r0 * cols + c0,")
    try:
        err, tol = run(he.build(source=narrow))
    except metal_emu.EmulationError:
        return  # read outside any mapping
    assert not (err < tol + 1e-30).all()
