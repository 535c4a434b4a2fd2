"""Bad input raises ValueError naming the argument, on both backends."""

import mlx.core as mx
import pytest

import flash_cce as fc

BACKENDS = ["native", "fallback"]


def dense(M=4, H=32, V=20):
    return mx.random.normal((M, H)), mx.random.normal((V, H)), mx.random.randint(0, V, (M,))


def quant(M=4, H=64, V=20, group_size=32, bits=4):
    h, w, y = dense(M, H, V)
    q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    return h, q, y, s, b


CASES = {
    "h scalar": (lambda: (mx.array(1.0), dense()[1], mx.array(0)), {}, "h must have shape"),
    "h int": (lambda: (mx.zeros((4, 32), mx.int32), *dense()[1:]), {}, "h must be float32"),
    "w 1-D": (lambda: (dense()[0], mx.zeros((32,)), dense()[2]), {}, "w must be a 2-D"),
    "w hidden mismatch": (lambda: (dense()[0], mx.zeros((20, 31)), dense()[2]), {}, r"w must have shape \(V, 32\)"),
    "w int dense": (lambda: (dense()[0], mx.zeros((20, 32), mx.int32), dense()[2]), {}, "dense w must be float32"),
    "w empty vocab": (lambda: (dense()[0], mx.zeros((0, 32)), dense()[2]), {}, "at least one vocabulary row"),
    "targets shape": (lambda: (dense()[0], dense()[1], mx.zeros((5,), mx.int32)), {}, r"targets must have shape \(4,\)"),
    "targets float": (lambda: (dense()[0], dense()[1], mx.zeros((4,))), {}, "targets must be an integer"),
    "softcap zero": (lambda: dense(), {"softcap": 0.0}, "softcap must be a finite positive"),
    "softcap negative": (lambda: dense(), {"softcap": -30.0}, "softcap must be a finite positive"),
    "softcap inf": (lambda: dense(), {"softcap": float("inf")}, "softcap must be a finite positive"),
    "bits on dense": (lambda: dense(), {"bits": 4}, "bits was given but w is dense"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_dense_input(case, backend):
    make, kw, msg = CASES[case]
    with pytest.raises(ValueError, match=msg):
        fc.flash_cce_forward(*make(), backend=backend, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_targets_out_of_range(backend):
    h, w, y = dense(V=20)
    for bad in (20, -1, 1000):
        y[2] = bad
        with pytest.raises(ValueError, match=rf"targets must lie in \[0, 20\).*got {bad} at flat index 2"):
            fc.flash_cce_forward(h, w, y, backend=backend)


def test_targets_out_of_range_under_compile_give_nan():
    """Inside mx.compile the values can't be checked eagerly: such rows are NaN, never a crash."""
    h, w, y = dense(V=20)
    y[1] = 99
    logp = mx.compile(lambda h, y: fc.flash_cce_forward(h, w, y)[0])(h, y)
    assert mx.isnan(logp[1]).item() and not mx.isnan(logp[0]).item()


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda h, q, y, s, b: (h, q, y, s, None), "scales and biases must be given together"),
        (lambda h, q, y, s, b: (h, q.astype(mx.int32), y, s, b), "quantized w must be packed uint32"),
        (lambda h, q, y, s, b: (h, q, y, s[:, :1], b), r"scales must have shape \(20, 2\)"),
        (lambda h, q, y, s, b: (h, q, y, s, b[:5]), r"biases must have shape \(20, 2\)"),
        (lambda h, q, y, s, b: (h, q, y, s, b.astype(mx.float16)), "share a dtype"),
        (lambda h, q, y, s, b: (h, q, y, s.astype(mx.int32), b), "scales must be a floating dtype"),
        (lambda h, q, y, s, b: (h, q[:, :7], y, s, b), "does not hold a whole number of bits"),
        (lambda h, q, y, s, b: (mx.zeros((4, 256)), q, y, s, b), "bits must be one of"),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_quantization(mutate, msg, backend):
    args = mutate(*quant())
    with pytest.raises(ValueError, match=msg):
        fc.flash_cce_forward(*args, group_size=32, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bits_and_group_size_must_match_packing(backend):
    h, q, y, s, b = quant(group_size=32, bits=4)
    with pytest.raises(ValueError, match="bits=8 does not match the packed w"):
        fc.flash_cce_forward(h, q, y, s, b, group_size=32, bits=8, backend=backend)
    with pytest.raises(ValueError, match=r"scales must have shape \(20, 1\).*group_size=64"):
        fc.flash_cce_forward(h, q, y, s, b, group_size=64, backend=backend)
    with pytest.raises(ValueError, match="group_size must be 32, 64 or 128"):
        fc.flash_cce_forward(h, q, y, s, b, group_size=16, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_backward_input(backend):
    h, w, y = dense()
    logp, lse = fc.flash_cce_forward(h, w, y)
    with pytest.raises(ValueError, match=r"g must have shape \(4,\)"):
        fc.flash_cce_backward(h, w, y, lse, mx.ones((3,)), backend=backend)
    with pytest.raises(ValueError, match=r"lse must have shape \(4,\)"):
        fc.flash_cce_backward(h, w, y, lse[:2], mx.ones((4,)), backend=backend)
    h, q, y, s, b = quant()
    with pytest.raises(ValueError, match="compute_dw needs a dense w"):
        fc.flash_cce_backward(h, q, y, lse, mx.ones((4,)), s, b, group_size=32,
                              compute_dw=True, backend=backend)


def test_bad_backend_and_reduction():
    h, w, y = dense()
    with pytest.raises(ValueError, match="backend must be one of"):
        fc.flash_cce_forward(h, w, y, backend="metal")
    with pytest.raises(ValueError, match="reduction must be one of"):
        fc.linear_cross_entropy(h, w, y, reduction="avg")
    with pytest.raises(ValueError, match="head must be an mx.array"):
        fc.linear_logprobs(h, "lm_head", y)


TUNING_CASES = {
    "unknown key": ({"row_blocks": 4}, r"unknown tuning key 'row_blocks'; allowed: wgmma, .*num_threads"),
    "flag as int": ({"wgmma": 0}, r"tuning\['wgmma'\] must be True or False"),
    "size as bool": ({"row_block": True}, r"tuning\['row_block'\] must be an integer >= 1"),
    "negative size": ({"vocab_chunk": -256}, r"tuning\['vocab_chunk'\] must be an integer >= 1"),
    "size as float": ({"num_threads": 2.0}, r"tuning\['num_threads'\] must be a bool or an int"),
    "not a dict": ([("row_block", 4)], "tuning must be a dict or None"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(TUNING_CASES))
def test_bad_tuning(case, backend):
    """A bad `tuning` is rejected by both ops on either backend (the fallback
    has no kernels to tune, but a typo must not pass silently)."""
    tuning, msg = TUNING_CASES[case]
    h, w, y = dense()
    with pytest.raises(ValueError, match=msg):
        fc.flash_cce_forward(h, w, y, backend=backend, tuning=tuning)
    lse = mx.zeros(y.shape)
    with pytest.raises(ValueError, match=msg):
        fc.flash_cce_backward(h, w, y, lse, mx.ones(y.shape), backend=backend, tuning=tuning)
