"""One sliding-window attention layer's forward + backward: time and peak memory.

    python bench/bench_attention.py                       # models A/B's sliding layer
    python bench/bench_attention.py --lengths 2048 4096 --window 512 --block 512

Shape of models A and B's sliding layers: 8 query heads over 1 KV head, head_dim
256, window 512; queries = keys (a prompt forward). Providers:
  window      flash_cce.stack.attention with the mask built as `window_mask` (each block
              computes the scores of the keys inside its window only)
  no_window   flash_cce.stack.attention with the same mask as a plain array (each block
              computes the scores of every key up to its last query)
  mlx         mx.fast.scaled_dot_product_attention with the plain mask,
              differentiated by MLX (the scores of the whole layer)
Peak memory is above the inputs (q, k, v, the output's cotangent).
"""

import argparse
import platform
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask

from flash_cce.stack.attention import attention, window_mask

PROVIDERS = ("window", "no_window", "mlx")


def make(name, n, window, block, scale):
    if name == "window":
        mask = window_mask(n, 0, window)
        return lambda q, k, v: attention(q, k, v, scale=scale, mask=mask, block=block)
    mask = create_causal_mask(n, 0, window_size=window)
    if name == "no_window":
        return lambda q, k, v: attention(q, k, v, scale=scale, mask=mask, block=block)
    return lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def measure(fn, n, args, dtype, repeats):
    rng = np.random.default_rng(0)
    normal = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)
    q, c = normal(1, args.heads, n, args.dim), normal(1, args.heads, n, args.dim)
    k, v = normal(1, args.kv_heads, n, args.dim), normal(1, args.kv_heads, n, args.dim)
    mx.eval(q, k, v, c)
    grad = mx.grad(lambda q, k, v: (fn(q, k, v) * c).sum(), argnums=(0, 1, 2))
    mx.eval(grad(q, k, v))  # warm-up
    times, peaks = [], []
    for _ in range(repeats):
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        t0 = time.perf_counter()
        mx.eval(grad(q, k, v))
        times.append(time.perf_counter() - t0)
        peaks.append(mx.get_peak_memory() - before)
    return statistics.median(times) * 1e3, max(peaks) / 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", nargs="*", type=int, default=[2048, 4096])
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--providers", nargs="*", default=list(PROVIDERS))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    print(f"device: {mx.default_device()}, {platform.machine()}, {args.dtype}; "
          f"heads {args.heads}/{args.kv_heads}, head_dim {args.dim}, window {args.window}, "
          f"block {args.block}; forward + backward: ms / peak MB above the inputs")
    print("| tokens | " + " | ".join(args.providers) + " |")
    print("|---|" + "---|" * len(args.providers))
    for n in args.lengths:
        cells = []
        for name in args.providers:
            fn = make(name, n, args.window, args.block, args.dim**-0.5)
            ms, mb = measure(fn, n, args, dtype, args.repeats)
            cells.append(f"{ms:.0f} / {mb:.0f}")
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
