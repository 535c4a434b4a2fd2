"""A small flash-CCE forward + backward on the GPU for compute-sanitizer:
dense bf16 with dW, fp32 and fp16 operands, and 4-bit and 3-bit weights, all
on ragged shapes (partial tiles in every dimension)."""

import mlx.core as mx

from flash_cce import flash_cce_backward, flash_cce_forward


def run(m, h, v, dtype, bits=None, softcap=30.0):
    k1, k2, k3 = mx.random.split(mx.random.key(m + h + v), 3)
    hid = mx.random.normal((m, h), key=k1).astype(dtype)
    w = (0.2 * mx.random.normal((v, h), key=k2)).astype(dtype)
    y = mx.random.randint(0, v, (m,), key=k3).astype(mx.int32)
    q = mx.quantize(w, group_size=64, bits=bits) if bits else (w, None, None)
    logp, lse = flash_cce_forward(hid, q[0], y, q[1], q[2], softcap=softcap, stream=mx.gpu)
    out = flash_cce_backward(hid, q[0], y, lse, mx.ones((m,)), q[1], q[2], softcap=softcap,
                             compute_dw=bits is None, stream=mx.gpu)
    mx.eval(logp, lse, out)
    print(m, h, v, dtype, bits, float(logp.sum()))


if __name__ == "__main__":
    run(150, 136, 700, mx.bfloat16)
    run(70, 64, 300, mx.float32)
    run(70, 72, 300, mx.float16)
    run(150, 128, 700, mx.bfloat16, bits=4)
    run(40, 128, 260, mx.bfloat16, bits=3)
