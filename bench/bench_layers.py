"""A 4-bit linear layer over many rows: MLX's quantized matmul against
`flash_cce.stack.layers` (dequantize, then a dense matmul), forward and forward +
backward (input gradient), as in a training step's frozen base layers.

    python bench/bench_layers.py --json bench_layers.json
"""

import argparse
import json
import time

import mlx.core as mx
import mlx.nn as nn

from flash_cce.stack.layers import training_layers


def _ms(fn, reps=5):
    fn()
    fn()
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    mx.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=["1536,6144", "6144,1536"], help="in,out")
    ap.add_argument("--rows", nargs="*", type=int, default=[256, 1024, 4096])
    ap.add_argument("--json", default="bench_layers.json")
    args = ap.parse_args()
    print(f"device: {mx.default_device()}; bfloat16, 4-bit, group 64; ms, mean of 5 after 2 warm-ups")
    print("| in -> out | rows | quantized fwd | dense fwd | quantized fwd+bwd | dense fwd+bwd |")
    print("|---|---|---|---|---|---|")
    results = []
    for shape in args.shapes:
        d_in, d_out = map(int, shape.split(","))
        lin = nn.Linear(d_in, d_out, bias=False)
        lin.set_dtype(mx.bfloat16)
        layer = nn.QuantizedLinear.from_linear(lin, group_size=64, bits=4)
        mx.eval(layer.parameters())
        for rows in args.rows:
            x = mx.random.normal((rows, d_in)).astype(mx.bfloat16)
            c = mx.random.normal((rows, d_out)).astype(mx.bfloat16)
            mx.eval(x, c)
            grad = mx.grad(lambda x: (layer(x) * c).sum())
            r = {"in": d_in, "out": d_out, "rows": rows}
            r["quantized_fwd"] = _ms(lambda: mx.eval(layer(x)))
            r["quantized_fwd_bwd"] = _ms(lambda: mx.eval(grad(x)))
            with training_layers():
                r["dense_fwd"] = _ms(lambda: mx.eval(layer(x)))
                r["dense_fwd_bwd"] = _ms(lambda: mx.eval(grad(x)))
            results.append(r)
            print(f"| {d_in} -> {d_out} | {rows} | {r['quantized_fwd']:.3f} | {r['dense_fwd']:.3f} | "
                  f"{r['quantized_fwd_bwd']:.3f} | {r['dense_fwd_bwd']:.3f} |", flush=True)
    with open(args.json, "w") as f:
        json.dump({"device": str(mx.default_device()), "results": results}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
