"""The CUDA take_rows kernel (embedding rows) against MLX's gather and the CPU,
to the byte: every copy width the kernel picks (16, 4, 2 and 1 bytes), rows
wider than a warp's one pass, more ids than one block holds, ids out of range,
and mlx-lm's embedding modules. Skipped where MLX has no GPU or this build has
no CUDA kernels."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from flash_cce import _ext
from flash_cce.stack.embedding import embed, gpu_rows_check, take_rows

pytestmark = pytest.mark.skipif(
    not (mx.is_available(mx.gpu) and _ext.has_gpu_take_rows()),
    reason="needs an MLX GPU and a build with the CUDA kernels",
)

RNG = np.random.default_rng(1)


def _bytes(a):
    return np.array(a.view(mx.uint8) if a.dtype != mx.uint8 else a)


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(_bytes(a), _bytes(b))


def _table(dtype, rows, width):
    if dtype == mx.uint32:
        return mx.array(RNG.integers(0, 2**32, (rows, width), dtype=np.uint64).astype(np.uint32))
    return mx.array(RNG.standard_normal((rows, width)).astype(np.float32)).astype(dtype)


# (dtype, width) -> the copy width the kernel picks on an aligned table.
WIDTHS = [
    (mx.bfloat16, 2560, 16), (mx.float32, 12, 16), (mx.uint32, 320, 16), (mx.float16, 24, 16),
    (mx.float32, 3, 4), (mx.uint32, 5, 4), (mx.bfloat16, 6, 4),
    (mx.bfloat16, 3, 2), (mx.float16, 1, 2),
    (mx.uint8, 7, 1), (mx.uint8, 1, 1),
]


@pytest.mark.parametrize("dtype,width,unit", WIDTHS)
@pytest.mark.parametrize("shape", [(5,), (3, 4), (1000,), (2, 301)])
def test_rows_equal_the_gather_and_the_cpu(dtype, width, unit, shape):
    rows = 97
    table = _table(dtype, rows, width)
    ids = mx.array(RNG.integers(0, rows, shape).astype(np.int32))
    gpu = _ext.take_rows(table, ids, stream=mx.gpu)
    assert _same(gpu, mx.take(table, ids, axis=0, stream=mx.gpu))
    assert _same(gpu, _ext.take_rows(table, ids, stream=mx.cpu))


@pytest.mark.parametrize("offset", [1, 2, 3])
def test_a_table_inside_its_buffer(offset):
    flat = mx.array(np.arange(40 * 64 + 16, dtype=np.uint8))
    table = flat[offset:offset + 40 * 64].reshape(40, 64)  # rows of 64 bytes, unaligned start
    ids = mx.array([[39, 0, 5], [5, 17, 38]])
    assert _same(_ext.take_rows(table, ids, stream=mx.gpu), _ext.take_rows(table, ids, stream=mx.cpu))
    wide = flat[4:4 + 40 * 64].reshape(40, 64).view(mx.uint32)  # 4-byte aligned, not 16
    assert _same(_ext.take_rows(wide, ids, stream=mx.gpu), mx.take(wide, ids, axis=0, stream=mx.gpu))


def test_strided_tables_and_ids_out_of_range():
    base = _table(mx.bfloat16, 64, 96)
    ids = mx.array([0, 31, -1, 32, 2**31 - 1, 7, 7])
    for table in (base[::2], base[:32, 8:72], base.T[:32], base[3:35]):  # 32 rows each
        gpu = np.array(_ext.take_rows(table, ids, stream=mx.gpu).astype(mx.float32))
        np.testing.assert_array_equal(gpu[[2, 3, 4]], 0.0)
        want = np.array(table.astype(mx.float32))[[0, 31, 7, 7]]
        np.testing.assert_array_equal(gpu[[0, 1, 5, 6]], want)
    for dtype in (mx.int64, mx.uint64):
        wide = mx.array([2**32 + 1, 3], dtype)
        gpu = np.array(_ext.take_rows(base, wide, stream=mx.gpu).astype(mx.float32))
        np.testing.assert_array_equal(gpu[0], 0.0)
        np.testing.assert_array_equal(gpu[1], np.array(base.astype(mx.float32))[3])


def test_no_ids_and_no_width():
    table = _table(mx.float32, 9, 4)
    empty = _ext.take_rows(table, mx.zeros((0,), mx.int32), stream=mx.gpu)
    assert empty.shape == (0, 4) and np.array(empty).size == 0
    narrow = _ext.take_rows(mx.zeros((9, 0)), mx.array([1, 2]), stream=mx.gpu)
    assert narrow.shape == (2, 0)


def test_the_kernel_passes_its_check():
    assert gpu_rows_check()


def test_gradient_equals_the_cpus():
    """Row 3 gets three cotangent rows, summed in an order each device picks:
    float32 sums of three terms in any order differ by at most 2 roundings of
    the partial sums, 2^-23 times the sum of the terms' magnitudes. The other
    rows are copies, equal bit for bit."""
    table = _table(mx.float32, 50, 64)
    ids = mx.array([[3, 3, 49], [0, 3, 7]])
    ct = mx.array(RNG.standard_normal((2, 3, 64)).astype(np.float32))

    def grad(stream, cot):
        with mx.stream(stream):
            return mx.grad(lambda t: (take_rows(t, ids) * cot).sum())(table)

    gpu, cpu = np.array(grad(mx.gpu, ct)), np.array(grad(mx.cpu, ct))
    magnitude = np.array(grad(mx.cpu, mx.abs(ct)))
    assert np.all(np.abs(gpu - cpu) <= 2.0**-23 * magnitude)
    single = [0, 7, 49]
    assert np.array_equal(gpu[single], cpu[single])
    assert np.count_nonzero(gpu[3]) == 64 and not np.any(gpu[[1, 2, 4, 5, 6]])


@pytest.mark.parametrize("bits,group_size", [(4, 64), (4, 32), (8, 64), (8, 32)])
def test_embeddings_equal_the_modules(bits, group_size):
    dense = nn.Embedding(300, 256)
    dense.weight = dense.weight.astype(mx.bfloat16)
    quantized = nn.QuantizedEmbedding.from_embedding(dense, group_size, bits)
    tokens = mx.array(RNG.integers(0, 300, (4, 33)).astype(np.int32))
    with mx.stream(mx.gpu):
        for module in (dense, quantized):
            assert _same(embed(module, tokens), module(tokens))
