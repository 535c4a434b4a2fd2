"""Calls of the flash-CCE head at one shape, for a kernel profiler.

Runs one warm-up call, then `--calls` more, so that a profiler can pick the
kernels of a later call, e.g. (ncu's hardware counters for the forward GEMM):

    ncu --clock-control none --kernel-name regex:fcce_fwd_ --launch-skip 1 \\
        --launch-count 1 --section SpeedOfLight python bench/profile_head.py

`--tuning key=value` (repeatable) sets the ops' tuning, e.g. `--tuning wgmma=false`
for the portable kernels or `--tuning quant_rs=false`; keys in docs/cuda.md.
"""

import argparse

import mlx.core as mx

from bench_head import mlx_inputs, ours_loss, parse_shape


def tuning_item(text):
    """`key=value` -> (key, bool or int) for the ops' tuning dict."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--tuning takes key=value, got {text!r}")
    low = value.lower()
    if low in ("true", "false"):
        return key, low == "true"
    try:
        return key, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--tuning {key}: value must be true, false or an integer, got {value!r}") from None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="8192,2560,262144", help="M,H,V")
    p.add_argument("--softcap", type=float, default=30.0, help="0: none")
    p.add_argument("--bits", type=int, default=0, choices=(0, 4, 8), help="0: bf16 head")
    p.add_argument("--mode", default="fwd", choices=("fwd", "fwd_bwd"),
                   help="forward only, or the fused forward and the gradient for h")
    p.add_argument("--calls", type=int, default=1)
    p.add_argument("--tuning", type=tuning_item, action="append", default=[],
                   help="key=value of the ops' tuning (repeatable)")
    args = p.parse_args()
    mx.set_default_device(mx.gpu)
    m, h, v = parse_shape(args.shape)
    hid, w, y, q = mlx_inputs(m, h, v, mx.bfloat16, args.bits)
    loss = ours_loss(args.softcap or None, q, args.mode == "fwd_bwd", dict(args.tuning))
    step = loss if args.mode == "fwd" else mx.grad(loss)
    for _ in range(1 + args.calls):
        mx.eval(step(hid, w, y))
    mx.synchronize()


if __name__ == "__main__":
    main()
