"""Calls of the flash-CCE head at one shape, for a kernel profiler.

Runs one warm-up call, then `--calls` more, so that a profiler can pick the
kernels of a later call, e.g. (ncu's hardware counters for the forward GEMM):

    ncu --clock-control none --kernel-name regex:fcce_fwd_ --launch-skip 1 \\
        --launch-count 1 --section SpeedOfLight python bench/profile_head.py

The kernel family follows the extension's environment switches
(FLASH_CCE_NO_WGMMA, FLASH_CCE_QUANT_RS, ...), read at each evaluation.
"""

import argparse

import mlx.core as mx

from bench_head import mlx_inputs, ours_loss, parse_shape


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="8192,2560,262144", help="M,H,V")
    p.add_argument("--softcap", type=float, default=30.0, help="0: none")
    p.add_argument("--bits", type=int, default=0, choices=(0, 4, 8), help="0: bf16 head")
    p.add_argument("--mode", default="fwd", choices=("fwd", "fwd_bwd"),
                   help="forward only, or the fused forward and the gradient for h")
    p.add_argument("--calls", type=int, default=1)
    args = p.parse_args()
    mx.set_default_device(mx.gpu)
    m, h, v = parse_shape(args.shape)
    hid, w, y, q = mlx_inputs(m, h, v, mx.bfloat16, args.bits)
    loss = ours_loss(args.softcap or None, q, args.mode == "fwd_bwd")
    step = loss if args.mode == "fwd" else mx.grad(loss)
    for _ in range(1 + args.calls):
        mx.eval(step(hid, w, y))
    mx.synchronize()


if __name__ == "__main__":
    main()
