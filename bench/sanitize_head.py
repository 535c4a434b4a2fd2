"""A small flash-CCE forward + backward on the GPU for compute-sanitizer:
dense bf16 with dW, fp32 and fp16 operands, and 4-, 8- (a partial 64-column
block of H) and 3-bit weights, a 4-bit head of 6 x 2 W x h tiles and an 8-bit
fp16 one, all on ragged shapes (partial tiles in every dimension); then the
fused forward with its gradient (softcap and running reference, 256-column
chunks, and a late logit that sends it through its exact second pass). The
small shapes leave the dh kernels few tiles, so they split them along the
chunk (one wide chunk of 33 k-steps below takes four pieces a tile). Last, the
entropy statistics and their gradient (dense with dW and 4-bit on the Hopper
kernels, fp32 operands on the portable ones)."""

import mlx.core as mx

from flash_cce import flash_cce_backward, flash_cce_forward


def run(m, h, v, dtype, bits=None, softcap=30.0, group_size=64):
    k1, k2, k3 = mx.random.split(mx.random.key(m + h + v), 3)
    hid = mx.random.normal((m, h), key=k1).astype(dtype)
    w = (0.2 * mx.random.normal((v, h), key=k2)).astype(dtype)
    y = mx.random.randint(0, v, (m,), key=k3).astype(mx.int32)
    q = mx.quantize(w, group_size=group_size, bits=bits) if bits else (w, None, None)
    logp, lse = flash_cce_forward(hid, q[0], y, q[1], q[2], group_size=group_size,
                                  softcap=softcap, stream=mx.gpu)
    out = flash_cce_backward(hid, q[0], y, lse, mx.ones((m,)), q[1], q[2], group_size=group_size,
                             softcap=softcap, compute_dw=bits is None, stream=mx.gpu)
    mx.eval(logp, lse, out)
    print(m, h, v, dtype, bits, float(logp.sum()))


def run_fused(m, h, v, softcap, late=0.0, bits=None, tuning=None):
    k1, k2, k3 = mx.random.split(mx.random.key(m + v), 3)
    hid = mx.random.normal((m, h), key=k1).astype(mx.bfloat16)
    w = 0.2 * mx.random.normal((v, h), key=k2)
    if late:
        hid = mx.abs(hid)
        w[v - 5] = late / h
    w = w.astype(mx.bfloat16)
    y = mx.random.randint(0, v, (m,), key=k3).astype(mx.int32)
    q = mx.quantize(w, group_size=64, bits=bits) if bits else (w, None, None)

    def loss(hid):
        logp, lse = flash_cce_forward(hid, q[0], y, q[1], q[2], softcap=softcap, stream=mx.gpu,
                                      tuning=tuning)
        return logp.sum() + 0.1 * lse.sum()

    val, dh = mx.value_and_grad(loss)(hid)
    mx.eval(val, dh)
    print("fused", m, h, v, softcap, late, bits, float(val))


def run_entropy(m, h, v, dtype, bits=None, softcap=30.0, tuning=None):
    k1, k2, k3 = mx.random.split(mx.random.key(m + h + v), 3)
    hid = mx.random.normal((m, h), key=k1).astype(dtype)
    w = (0.2 * mx.random.normal((v, h), key=k2)).astype(dtype)
    y = mx.random.randint(0, v, (m,), key=k3).astype(mx.int32)
    q = mx.quantize(w, group_size=64, bits=bits) if bits else (w, None, None)

    def loss(hid, w):
        st = flash_cce_forward(hid, w, y, q[1], q[2], softcap=softcap, temperature=0.7,
                               entropy=True, stream=mx.gpu, tuning=tuning)
        return (st.logp + 0.1 * st.entropy).sum() + st.mean_logit.sum()

    val, grads = mx.value_and_grad(loss, argnums=(0,) if bits else (0, 1))(hid, q[0])
    mx.eval(val, grads)
    print("entropy", m, h, v, dtype, bits, tuning, float(val))


if __name__ == "__main__":
    run(150, 136, 700, mx.bfloat16)
    run(70, 64, 300, mx.float32)
    run(70, 72, 300, mx.float16)
    run(150, 128, 700, mx.bfloat16, bits=4)
    run(150, 96, 700, mx.bfloat16, bits=8, group_size=32)
    run(40, 128, 260, mx.bfloat16, bits=3)
    run(300, 512, 700, mx.bfloat16, bits=4)
    run(150, 256, 300, mx.float16, bits=8, group_size=32)
    run_fused(150, 136, 2100, None)
    narrow = {"vocab_chunk": 256}
    run_fused(150, 136, 700, 30.0, tuning=narrow)
    run_fused(150, 136, 700, None, tuning=narrow)
    run_fused(70, 128, 600, None, late=300.0, tuning=narrow)
    run_fused(70, 128, 600, 30.0, bits=4, tuning=narrow)
    run_fused(71, 128, 600, None, bits=4, tuning=narrow)
    run_entropy(150, 136, 700, mx.bfloat16)
    run_entropy(150, 128, 700, mx.bfloat16, bits=4, softcap=None)
    run_entropy(70, 72, 300, mx.float32)  # the portable kernels
