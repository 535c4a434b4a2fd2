"""take_rows equals MLX's gather to the bit (values and gradients, every dtype
and layout), gives zero rows for ids out of range, and `embed` equals mlx-lm's
embedding modules without building a gather. Runs on the default device (the
suite's GPU run: the CUDA kernel)."""

import os
import tempfile

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from flash_cce import _ext
from flash_cce.stack import embedding
from flash_cce.stack.embedding import embed, gpu_rows_check, native, take_rows

RNG = np.random.default_rng(0)


def _table(dtype, rows=37, width=24):
    if dtype == mx.uint32:
        return mx.array(RNG.integers(0, 2**32, (rows, width), dtype=np.uint64).astype(np.uint32))
    return mx.array(RNG.standard_normal((rows, width)).astype(np.float32)).astype(dtype)


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.array(a.view(mx.uint8) if a.dtype != mx.uint8 else a),
        np.array(b.view(mx.uint8) if b.dtype != mx.uint8 else b))


IDS = {
    "1-d": [3, 0, 36, 3, 17],
    "2-d": [[1, 2, 3], [36, 35, 0]],
    "one": [5],
    "empty": [],
}


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16, mx.uint32, mx.uint8, mx.int8])
@pytest.mark.parametrize("width", [24, 7, 1])
@pytest.mark.parametrize("case", sorted(IDS))
def test_rows_equal_the_gather(dtype, width, case):
    table = _table(dtype, width=width)
    ids = mx.array(IDS[case], mx.int32) if IDS[case] else mx.zeros((0,), mx.int32)
    assert _same(_ext.take_rows(table, ids), table[ids])
    assert _same(take_rows(table, ids), table[ids])


def test_layouts_and_id_dtypes():
    base = _table(mx.bfloat16, rows=40, width=48)
    ids = mx.array([[7, 1], [39, 0]])
    for table in (base[::2], base[:, 8:40], base.T[:24], base[3:30]):  # strided, offset, transposed, sliced
        assert _same(_ext.take_rows(table, ids[:, :1] % table.shape[0]), table[ids[:, :1] % table.shape[0]])
    for dtype in (mx.int64, mx.uint32, mx.int16, mx.uint8):
        assert _same(_ext.take_rows(base, ids.astype(dtype)), base[ids])


def test_ids_out_of_range_give_zero_rows():
    table = _table(mx.float32, rows=5, width=3) + 1.0
    out = np.array(_ext.take_rows(table, mx.array([0, 5, -1, 4, 2**31 - 1])))
    np.testing.assert_array_equal(out[[1, 2, 4]], 0.0)
    np.testing.assert_array_equal(out[[0, 3]], np.array(table)[[0, 4]])


@pytest.mark.parametrize("dtype,ids", [
    (np.int64, [2**32 + 1, -(2**32) + 2, 2**63 - 1, -(2**63), 3]),
    (np.uint64, [2**32 + 1, 2**64 - 1, 3]),
    (np.uint32, [2**31, 2**32 - 1, 3]),
])
def test_wide_ids_out_of_range_do_not_wrap_into_the_table(dtype, ids):
    table = _table(mx.float32, rows=5, width=3) + 1.0
    out = np.array(_ext.take_rows(table, mx.array(np.array(ids, dtype))))
    np.testing.assert_array_equal(out[:-1], 0.0)
    np.testing.assert_array_equal(out[-1], np.array(table)[3])


def test_bad_arguments_name_them():
    with pytest.raises(ValueError, match="table must be 2-D \\[rows, width\\], got 3 dimensions"):
        _ext.take_rows(mx.zeros((2, 2, 2)), mx.array([0]))
    with pytest.raises(ValueError, match="ids must be integers"):
        _ext.take_rows(mx.zeros((2, 2)), mx.array([0.0]))


def test_gradient_equals_the_gathers():
    table = _table(mx.float32, rows=11, width=6)
    ids = mx.array([[3, 3, 10], [0, 3, 7]])  # a repeated id sums its rows
    ct = mx.array(RNG.standard_normal((2, 3, 6)).astype(np.float32))

    def loss(take):
        return lambda t: (take(t) * ct).sum()

    ours = mx.grad(loss(lambda t: take_rows(t, ids)))(table)
    gather = mx.grad(loss(lambda t: t[ids]))(table)
    assert _same(ours, gather)


@pytest.mark.skipif(not native(), reason="out-of-range ids are defined where the kernels run")
def test_ids_out_of_range_get_no_gradient():
    table = _table(mx.float32, rows=6, width=4)
    ids = mx.array([[2, -1, 6], [0, 2, 2**31 - 1]])
    inside = mx.array([[1, 0, 0], [1, 1, 0]], mx.float32)[..., None]
    ct = mx.array(RNG.standard_normal((2, 3, 4)).astype(np.float32))
    ours = mx.grad(lambda t: (take_rows(t, ids) * ct).sum())(table)
    # The gather's gradient with the outside rows' cotangents zeroed and their ids at row 0.
    gather = mx.grad(lambda t: (t[mx.where(inside[..., 0] > 0, ids, 0)] * ct * inside).sum())(table)
    assert _same(ours, gather)
    assert _same(take_rows(table, ids) * inside, take_rows(table, ids))  # and zero rows forward


def _primitives(*arrays):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "graph.dot")
        mx.export_to_dot(path, *arrays)
        return open(path).read()


def _count(dot, primitive):
    return dot.count(f'label ="{primitive}"')


def _quantized(bits, group_size, mode, dtype):
    """A quantized embedding of a `dtype` table (bf16: bf16 scales and biases, as
    in mlx-lm's models), random codes for the affine mode."""
    dense = nn.Embedding(50, 128)
    dense.weight = dense.weight.astype(dtype)
    emb = nn.QuantizedEmbedding.from_embedding(dense, group_size, bits, mode=mode)
    if mode == "affine":
        emb.update({"weight": _table(mx.uint32, 50, 128 * bits // 32)})
    return emb


@pytest.mark.parametrize("bits,group_size,mode,dtype", [
    (4, 64, "affine", mx.float32), (8, 32, "affine", mx.float32), (4, 32, "affine", mx.float32),
    (8, 64, "affine", mx.float32), (4, 64, "affine", mx.bfloat16), (8, 32, "affine", mx.bfloat16),
    (4, 32, "mxfp4", mx.bfloat16), (8, 32, "mxfp8", mx.bfloat16), (4, 16, "nvfp4", mx.bfloat16),
])
def test_quantized_embedding_equals_the_module(bits, group_size, mode, dtype):
    emb = _quantized(bits, group_size, mode, dtype)
    tokens = mx.array([[4, 49, 0, 4], [7, 7, 1, 30]])
    out, theirs = embed(emb, tokens), emb(tokens)
    if native():  # the graphs before they are evaluated
        ours, module = _primitives(out), _primitives(theirs)
        rows = 2 if emb.get("biases") is None else 3
        # Each row gather of the module is a TakeRows; the fp4 modes' dequantize
        # gathers from its own table of values (on the CPU), the affine mode none.
        assert _count(ours, "TakeRows") == rows
        assert _count(ours, "Gather") == _count(module, "Gather") - rows
        assert mode != "affine" or _count(ours, "Gather") == 0
    assert _same(out, theirs)


def test_embedding_equals_the_module_and_other_modules_call_themselves():
    emb = nn.Embedding(30, 16)
    tokens = mx.array([0, 29, 3, 3])
    assert _same(embed(emb, tokens), emb(tokens))

    class Scaled(nn.Embedding):
        def __call__(self, x):
            return super().__call__(x) * 2

    scaled = Scaled(30, 16)
    assert _same(embed(scaled, tokens), scaled(tokens))


def test_routed_embeddings_send_module_calls_to_take_rows():
    """Inside the context, calls of exactly `Embedding` and `QuantizedEmbedding`
    (as mlx-lm's model code makes them, e.g. Gemma 4's per-layer embeddings)
    take their rows by `take_rows` with the module's result; subclasses and
    everything after the context compute as MLX defines them."""
    tokens = mx.array([[4, 49, 0], [7, 7, 1]])
    quantized = _quantized(4, 64, "affine", mx.bfloat16)
    dense = nn.Embedding(50, 16)

    class Scaled(nn.Embedding):
        def __call__(self, x):
            return super().__call__(x) * 2

    scaled = Scaled(50, 16)
    before = [m(tokens) for m in (quantized, dense, scaled)]
    with embedding.routed_embeddings():
        inside = [m(tokens) for m in (quantized, dense, scaled)]
    after = [m(tokens) for m in (quantized, dense, scaled)]
    if native():  # the graphs before they are evaluated
        assert [_count(_primitives(a), "TakeRows") for a in inside] == [3, 1, 0]
        assert [_count(_primitives(a), "TakeRows") for a in after] == [0, 0, 0]
    for b, i, a in zip(before, inside, after):
        assert _same(i, b) and _same(a, b)


def test_the_gpu_kernel_passes_its_check():
    if mx.default_device() != mx.gpu or not _ext.has_gpu_take_rows():
        pytest.skip("needs a GPU with the extension's CUDA kernels (the suite's GPU run)")
    assert gpu_rows_check() and native()


@pytest.fixture
def fresh_check():
    gpu_rows_check.cache_clear()
    yield
    gpu_rows_check.cache_clear()


def test_a_gpu_kernel_that_fails_its_check_leaves_the_gather(monkeypatch, fresh_check):
    class Broken:
        """A build whose GPU kernel copies the wrong row."""

        has_gpu_take_rows = staticmethod(lambda: True)

        @staticmethod
        def take_rows(table, ids, stream=None):
            ids = (ids + 1) % table.shape[0] if stream == mx.gpu else ids
            return _ext.take_rows(table, ids)

    monkeypatch.setattr(embedding, "_ext", Broken)
    with pytest.warns(RuntimeWarning, match="copied rows differently from the CPU's; embeddings use MLX's gather"):
        assert not native(mx.Device(mx.gpu))
    assert native(mx.Device(mx.cpu))
    gpu_rows_check.cache_clear()
    Broken.take_rows = staticmethod(lambda table, ids, stream=None: _ext.take_rows(table, ids))
    assert native(mx.Device(mx.gpu))  # a kernel that agrees passes


def test_a_gpu_kernel_that_raises_leaves_the_gather(monkeypatch, fresh_check):
    class Missing:
        """A build whose fatbin lacks the kernel."""

        has_gpu_take_rows = staticmethod(lambda: True)

        @staticmethod
        def take_rows(table, ids, stream=None):
            if stream == mx.gpu:
                raise RuntimeError("kernel fcce_take_rows: named symbol not found")
            return _ext.take_rows(table, ids)

    monkeypatch.setattr(embedding, "_ext", Missing)
    with pytest.warns(RuntimeWarning, match="kernel failed \\(kernel fcce_take_rows: named symbol not found\\); "
                                            "embeddings use MLX's gather"):
        assert not native(mx.Device(mx.gpu))
