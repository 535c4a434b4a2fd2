"""Apple-GPU benchmark of the head: the Metal kernels against the pure-MLX
fallback and MLX's own composition (matmul or quantized_matmul, then
logsumexp over the [M, V] logits), dense bf16 and 4-bit heads.

Modes "fwd" (loss) and "fwd_bwd" (loss and the gradient for h). Prints a table
of milliseconds (median of --reps runs after warm-up) and peak device memory
over the inputs, beside the Metal kernels' time as the cost model of their
launch plan estimates it for this GPU (csrc/metal/cost.h; docs/metal.md), checks
that the Metal kernels' loss matches the fallback's, and writes everything, with
flash_cce.metal_status(), to --json.

    python bench/bench_metal.py --json metal.json
    python bench/bench_metal.py --shapes 512,2560,262144 --modes fwd --reps 3
"""

import argparse
import json
import os
import platform
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_head import mlx_case, mlx_inputs, mlx_loss, parse_shape, time_mlx  # noqa: E402

# Gemma-style vocabularies at training batch sizes a Mac holds.
SHAPES = [(512, 2560, 262144), (2048, 2560, 262144), (8192, 2560, 262144)]
MODES = ("fwd", "fwd_bwd")
VARIANTS = {"bf16": 0, "q4": 4}
GB = 1e9


def ours_loss(q, backend, fused):
    from flash_cce import flash_cce_forward

    def loss(hid, w, y):
        w_, s, b = (w, None, None) if q is None else q
        logp, _ = flash_cce_forward(hid, w_, y, s, b, group_size=64, backend=backend,
                                    validate_targets=False, fused_backward=fused)
        return -logp.mean()

    return loss


def providers(q, mode):
    fused = mode == "fwd_bwd"
    return {"metal": ours_loss(q, "native", fused),
            "fallback": ours_loss(q, "fallback", fused),
            "mlx": mlx_loss(None, q, False)}


def model_gpu(device_name):
    """The cost model's entry for this GPU (its name as MLX reports it), or None."""
    from flash_cce import _ext

    names = [g["name"] for g in _ext.metal_gpus()]
    return device_name if device_name in names else None


def model_ms(m, h, v, variant, mode, gpu):
    """The cost model's milliseconds for the Metal launches a case runs: the
    plain forward ("fwd"), or the fused forward and the fused dh ("fwd_bwd")."""
    from flash_cce import _ext

    kw = dict(h="bfloat16", w="bfloat16", sb="bfloat16")
    if VARIANTS[variant]:
        kw.update(quantized=True, bits=VARIANTS[variant], group_size=64)
    passes = [("forward", {})] if mode == "fwd" else [("forward", {"fused": True}),
                                                      ("fused_dh", {})]
    return 1e3 * sum(_ext.metal_cost(p, m, h, v, gpu=gpu, **kw, **x)["seconds"]
                     for p, x in passes)


def run(args, gpu=None):
    results = []
    for m, h, v in [parse_shape(s) for s in args.shapes] if args.shapes else SHAPES:
        print(f"shape M={m} H={h} V={v}", flush=True)
        for name in args.variants:
            hid, w, y, q = mlx_inputs(m, h, v, mx.bfloat16, VARIANTS[name])
            losses = {}
            for mode in args.modes:
                for prov, loss in providers(q, mode).items():
                    row = dict(M=m, H=h, V=v, variant=name, mode=mode, provider=prov)
                    if prov == "metal" and gpu:
                        row["model_ms"] = model_ms(m, h, v, name, mode, gpu)
                    try:
                        ms, peak = time_mlx(mlx_case(loss, mode, hid, w, y),
                                            args.warmup, args.reps)
                        row.update(ms=ms, peak_gb=peak / GB)
                        if mode == "fwd":
                            losses[prov] = loss(hid, w, y).item()
                    except Exception as e:  # a provider that fails is reported
                        row.update(ms=None, error=str(e))
                    results.append(row)
                    txt = ("fails: " + row["error"][:80] if row["ms"] is None
                           else f"{row['ms']:8.2f} ms {row['peak_gb']:7.3f} GB")
                    if "model_ms" in row:
                        txt += f" (cost model: {row['model_ms']:.1f} ms)"
                    print(f"  {name:>5s} {mode:>8s} {prov:>9s}: {txt}", flush=True)
            if "metal" in losses and "fallback" in losses:
                diff = abs(losses["metal"] - losses["fallback"])
                results.append(dict(M=m, H=h, V=v, variant=name, mode="check",
                                    loss_metal=losses["metal"],
                                    loss_fallback=losses["fallback"], abs_diff=diff))
                print(f"  {name:>5s} loss: metal {losses['metal']:.6f}, "
                      f"fallback {losses['fallback']:.6f} (|diff| {diff:.2e})", flush=True)
            del hid, w, y, q
            mx.clear_cache()
    return results


def table(results):
    """Markdown: one row per shape/variant/mode, providers as columns (ms / GB)."""
    cols = ("metal", "fallback", "mlx")
    rows = {}
    for r in results:
        if r["mode"] != "check":
            rows.setdefault((r["M"], r["H"], r["V"], r["variant"], r["mode"]), {})[
                r["provider"]] = r
    lines = ["| M,H,V | head | mode | " + " | ".join(cols) +
             " | fallback / metal | metal, cost model (ms) |",
             "|" + "---|" * (len(cols) + 5)]
    for (m, h, v, name, mode), row in rows.items():
        cells = []
        for c in cols:
            r = row.get(c)
            cells.append("" if r is None else "fails" if r["ms"] is None
                         else f"{r['ms']:.1f} / {r['peak_gb']:.2f}")
        ours, fb = row.get("metal", {}).get("ms"), row.get("fallback", {}).get("ms")
        ratio = f"{fb / ours:.2f}" if ours and fb else ""
        model = row.get("metal", {}).get("model_ms")
        model = "" if model is None else f"{model:.1f}"
        lines.append(f"| {m},{h},{v} | {name} | {mode} | " + " | ".join(cells) +
                     f" | {ratio} | {model} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="*", help="M,H,V triples (default: %s)" % SHAPES)
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    if not mx.metal.is_available():
        sys.exit("bench_metal.py measures the head on an Apple GPU, and this machine has "
                 "none (mx.metal.is_available() is False). On Linux/CUDA use "
                 "bench/bench_head.py.")
    import flash_cce

    mx.set_default_device(mx.gpu)
    status = flash_cce.metal_status()
    print(status, flush=True)
    try:
        info = {k: str(v) for k, v in mx.metal.device_info().items()}
    except Exception as e:  # the device description is optional
        info = {"error": str(e)}
    gpu = model_gpu(info.get("device_name", ""))
    print(f"cost model: {gpu}" if gpu else
          f"cost model: no published figures for {info.get('device_name')!r} in "
          "csrc/metal/cost.cpp; no estimates", flush=True)
    results = run(args, gpu)
    md = table(results)
    print("\nms / peak GB over the inputs\n" + md)
    if args.json:
        meta = dict(date=time.strftime("%Y-%m-%d"), host=platform.node(),
                    machine=platform.machine(), macos=platform.mac_ver()[0],
                    mlx=mx.__version__, device_info=info, metal_status=dict(status),
                    cost_model_gpu=gpu)
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=results, table=md), f, indent=1)


if __name__ == "__main__":
    main()
