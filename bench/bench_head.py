"""GPU benchmark of the linear cross-entropy head: flash-CCE against MLX's own
composition and the torch peers (Liger-Kernel's fused linear cross-entropy and
Apple's cut-cross-entropy), side by side in one process.

Modes: "fwd" (loss only), "fwd_bwd" (gradient for h, frozen head) and "fwd_bwd_dw"
(gradients for h and W); "fwd_fused" is our forward with fused_backward left on
but no backward (what a reference or evaluation call costs when it does not
turn it off; compare with "fwd"); "ent_fwd" and "ent_fwd_bwd" add the per-token
entropy at temperature --temperature (loss mean(-logp - 0.01 entropy)), beside
Liger's fused linear scaled cross-entropy (no softcap: the entropy modes always
run a cap=None row too, where it runs) and TRL's chunked log-prob kernel, where
installed (else their rows carry the import error). Prints a table of milliseconds (median of --reps timed runs after
warm-up) and extra device memory over the inputs, the ratios ent_fwd_bwd /
fwd_bwd and fwd_fused / fwd per shape, and writes everything to --json.

    python bench/bench_head.py --json results.json
    python bench/bench_head.py --shapes 8192,2560,262144 --modes fwd_bwd --reps 3
    python bench/bench_head.py --modes fwd fwd_fused fwd_bwd ent_fwd ent_fwd_bwd \
        --variants bf16 q4 --json entropy.json
"""

import argparse
import json
import platform
import statistics
import time

import mlx.core as mx

SHAPES = [
    (8192, 2560, 262144),
    (4096, 4096, 151936),
    (2048, 2560, 262144),
    (16384, 2048, 248320),
    (32768, 4096, 128256),
]
MODES = ("fwd", "fwd_bwd", "fwd_bwd_dw", "fwd_fused", "ent_fwd", "ent_fwd_bwd")
FORWARD_ONLY = ("fwd", "fwd_fused", "ent_fwd")
ENTROPY_WEIGHT = 0.01
GB = 1e9
# TRL's trainer calls ChunkedLogProbFunction with 32768-column chunks
# (_CHUNKED_LOGPROB_CHUNK_SIZE in trl/trainer/utils.py); of its optional outputs
# it is asked for those ours returns.
TRL_CHUNK = 32768
TRL_OUTPUTS = ("entropy", "mean_logits", "is_top1")


def parse_shape(s):
    m, h, v = (int(x) for x in s.split(","))
    return m, h, v


# Timing ---------------------------------------------------------------------


def time_mlx(fn, warmup, reps):
    """Median ms of fn() (returns arrays to evaluate) and peak bytes of one run."""
    for _ in range(warmup):
        mx.eval(fn())
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        mx.eval(out)
        mx.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        del out
    return statistics.median(times), mx.get_peak_memory() - base


def time_torch(fn, warmup, reps):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


# MLX providers ----------------------------------------------------------------


def mlx_inputs(m, h, v, dtype, bits):
    k1, k2, k3 = mx.random.split(mx.random.key(0), 3)
    hid = mx.random.normal((m, h), key=k1).astype(dtype)
    w = (mx.random.normal((v, h), key=k2) * h**-0.5).astype(dtype)
    y = mx.random.randint(0, v, (m,), key=k3).astype(mx.int32)
    q = None
    if bits:
        q = mx.quantize(w, group_size=64, bits=bits)
        w = None
    mx.eval(hid, w, y, q)
    return hid, w, y, q


def ours_loss(cap, q, fused, tuning=None):
    """fused: the forward also emits the gradient state for h (two GEMMs for
    forward + backward where the GPU supports it); off for forward-only and
    for dW, where that state would go unused. tuning: the ops' kernel choices."""
    from flash_cce import flash_cce_forward

    def loss(hid, w, y):
        if q is None:
            logp, _ = flash_cce_forward(hid, w, y, softcap=cap, validate_targets=False,
                                        fused_backward=fused, tuning=tuning)
        else:
            wq, s, b = q
            logp, _ = flash_cce_forward(hid, wq, y, s, b, group_size=64, softcap=cap,
                                        validate_targets=False, fused_backward=fused,
                                        tuning=tuning)
        return -logp.mean()

    return loss


def ours_entropy(cap, q, temperature, fused, tuning=None):
    """Per-token log-probs and entropy at `temperature`: the loss
    mean(-logp - 0.01 entropy) (or, forward only, both arrays). tuning: as
    `ours_loss`."""
    from flash_cce import flash_cce_forward

    def stats(hid, w, y):
        wq, s, b = q if q is not None else (w, None, None)
        return flash_cce_forward(hid, wq, y, s, b, group_size=64, softcap=cap,
                                 validate_targets=False, fused_backward=fused,
                                 temperature=temperature, entropy=True, tuning=tuning)

    def loss(hid, w, y):
        st = stats(hid, w, y)
        return (-st.logp - ENTROPY_WEIGHT * st.entropy).mean()

    return stats if not fused else loss


def mlx_loss(cap, q, fused_ce):
    def loss(hid, w, y):
        if q is None:
            logits = hid @ w.T
        else:
            wq, s, b = q
            logits = mx.quantized_matmul(hid, wq, s, b, transpose=True, group_size=64,
                                         bits=wq.shape[1] * 32 // hid.shape[1])
        if cap:
            logits = cap * mx.tanh(logits.astype(mx.float32) / cap)
        if fused_ce:
            return mx.fast.cross_entropy(logits, y).mean()
        logits = logits.astype(mx.float32)
        lse = mx.logsumexp(logits, axis=-1)
        tgt = mx.take_along_axis(logits, y[:, None], axis=-1)[:, 0]
        return (lse - tgt).mean()

    return loss


def mlx_case(loss, mode, hid, w, y):
    if mode in FORWARD_ONLY:
        return lambda: loss(hid, w, y)
    argnums = (0, 1) if mode == "fwd_bwd_dw" else 0
    step = mx.value_and_grad(loss, argnums=argnums)
    return lambda: step(hid, w, y)


# Torch providers ----------------------------------------------------------------


def torch_case(provider, m, h, v, cap, mode):
    import torch

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    hid = torch.randn(m, h, device=dev, generator=g, dtype=torch.bfloat16)
    w = (torch.randn(v, h, device=dev, generator=g) * h**-0.5).to(torch.bfloat16)
    y = torch.randint(0, v, (m,), device=dev, generator=g)
    hid.requires_grad_(mode != "fwd")
    w.requires_grad_(mode == "fwd_bwd_dw")
    if provider == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        ce = LigerFusedLinearCrossEntropyLoss(softcap=cap)
        loss = lambda: ce(w, hid, y)  # noqa: E731
    elif provider == "cce":
        from cut_cross_entropy import linear_cross_entropy

        loss = lambda: linear_cross_entropy(hid, w, y, softcap=cap)  # noqa: E731
    else:
        def loss():
            logits = (hid @ w.T).float()
            if cap:
                logits = cap * torch.tanh(logits / cap)
            return torch.nn.functional.cross_entropy(logits, y)

    def run():
        hid.grad = None
        w.grad = None
        out = loss()
        if mode != "fwd":
            out.backward()
        return out

    if mode == "fwd":
        def run_fwd():
            with torch.no_grad():
                return loss()
        return run_fwd, (hid, w, y)
    return run, (hid, w, y)


def torch_entropy_case(provider, m, h, v, cap, mode, temperature):
    """Liger 0.8.5's LigerFusedLinearScaledCrossEntropyFunction or TRL 1.16's
    ChunkedLogProbFunction: per-token log-probs (NLL) and entropy."""
    import torch

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    hid = torch.randn(m, h, device=dev, generator=g, dtype=torch.bfloat16)
    w = (torch.randn(v, h, device=dev, generator=g) * h**-0.5).to(torch.bfloat16)
    y = torch.randint(0, v, (m,), device=dev, generator=g)
    hid.requires_grad_(mode == "ent_fwd_bwd")
    if provider == "liger_scaled":
        if cap:
            raise ValueError("Liger's scaled cross-entropy has no softcap")
        from liger_kernel.ops import LigerFusedLinearScaledCrossEntropyFunction as F

        def loss():
            nll, ent = F.apply(hid, w, y, temperature, -100, 1, True)
            return (nll - ENTROPY_WEIGHT * ent.float()).mean()
    else:
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction as F

        def loss():
            logp, ent, _, _, _ = F.apply(hid, w, None, y, temperature, TRL_CHUNK, cap, 1.0,
                                         TRL_OUTPUTS)
            return (-logp - ENTROPY_WEIGHT * ent).mean()

    def run():
        hid.grad = None
        if mode == "ent_fwd":
            with torch.no_grad():
                return loss()
        out = loss()
        out.backward()
        return out

    return run, (hid, w, y)


# Driver ------------------------------------------------------------------------


def matmul_rate(warmup, reps):
    n = 8192
    a = mx.random.normal((n, n)).astype(mx.bfloat16)
    b = mx.random.normal((n, n)).astype(mx.bfloat16)
    ms, _ = time_mlx(lambda: a @ b, warmup, reps)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def save(args, rate, results):
    """Writes the JSON after every shape, so that a cut-short run keeps its data."""
    if not args.json:
        return
    meta = dict(date=time.strftime("%Y-%m-%d"), host=platform.node(), mlx=mx.__version__,
                device=str(mx.default_device()), matmul_tflops=rate)
    try:
        import torch

        meta["gpu"] = torch.cuda.get_device_name()
    except Exception:
        pass
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, results=results, table=table(rate, results),
                       ratios=ratios(results)), f, indent=1)


def run(args):
    results = []
    shapes = [parse_shape(s) for s in args.shapes] if args.shapes else SHAPES
    caps = [None, 30.0] if args.softcap == "both" else [None if args.softcap == "off" else 30.0]
    # The entropy modes run without a softcap too: Liger's scaled cross-entropy has none.
    all_caps = caps if None in caps else [None] + caps
    rate = matmul_rate(args.warmup, args.reps)
    print(f"bf16 matmul 8192^3 (MLX/cuBLAS): {rate:.0f} TFLOP/s", flush=True)

    def record(**kw):
        results.append(kw)
        ms = kw.get("ms")
        txt = "fails" if ms is None else f"{ms:8.2f} ms {kw['extra_gb']:7.3f} GB"
        print(f"  {kw['provider']:>14s} {kw['mode']:>10s} cap={kw['softcap']}: {txt}"
              + (f"  [{kw['error'][:80]}]" if kw.get("error") else ""), flush=True)

    for m, h, v in shapes:
        print(f"shape M={m} H={h} V={v}", flush=True)
        inputs = {}
        for name, dtype, bits in (("bf16", mx.bfloat16, 0), ("fp16", mx.float16, 0),
                                  ("q4", mx.bfloat16, 4), ("q8", mx.bfloat16, 8)):
            if name in args.variants:
                inputs[name] = mlx_inputs(m, h, v, dtype, bits)
        base = dict(M=m, H=h, V=v)
        hid, w, y, _ = inputs["bf16"]
        ms, extra = time_mlx(lambda: hid @ w.T, args.warmup, args.reps)
        record(**base, provider="cublas_gemm", variant="bf16", mode="gemm", softcap=None,
               ms=ms, extra_gb=extra / GB)
        for cap in all_caps:
            for mode in args.modes:
                if cap not in caps and not mode.startswith("ent_"):
                    continue
                for name, (hid, w, y, q) in inputs.items():
                    if mode == "fwd_bwd_dw" and q is not None:
                        continue
                    fused = mode in ("fwd_bwd", "fwd_fused")
                    if mode.startswith("ent_"):
                        providers = [("flash_cce", ours_entropy(cap, q, args.temperature,
                                                                mode == "ent_fwd_bwd", args.tuning))]
                    else:
                        providers = [("flash_cce", ours_loss(cap, q, fused, args.tuning))]
                    # The other providers run the loss modes only.
                    loss_mode = mode in ("fwd", "fwd_bwd", "fwd_bwd_dw")
                    if loss_mode and name == "bf16" and "mma" in args.providers:
                        # the portable mma.sync kernels instead of wgmma
                        providers.append(("flash_cce_mma",
                                          ours_loss(cap, q, fused, {"wgmma": False})))
                    if (loss_mode and name == "bf16" and fused and cap
                            and "3gemm" in args.providers):
                        # the same step with the logits recomputed in the backward
                        providers.append(("flash_cce_3gemm", ours_loss(cap, q, False)))
                    if loss_mode and name in ("bf16", "q4") and "mlx" in args.providers:
                        providers.append(("mlx", mlx_loss(cap, q, False)))
                        providers.append(("mlx_fast_ce", mlx_loss(cap, q, True)))
                    for prov, loss in providers:
                        try:
                            ms, extra = time_mlx(mlx_case(loss, mode, hid, w, y),
                                                 args.warmup, args.reps)
                            record(**base, provider=prov, variant=name, mode=mode,
                                   softcap=cap, ms=ms, extra_gb=extra / GB)
                        except Exception as e:  # a provider that fails is reported
                            record(**base, provider=prov, variant=name, mode=mode,
                                   softcap=cap, ms=None, error=str(e))
                peers = (("liger_scaled", "trl_chunked") if mode.startswith("ent_")
                         else ("liger", "cce", "torch") if mode != "fwd_fused" else ())
                for prov in peers:
                    if prov not in args.providers:
                        continue
                    try:
                        if mode.startswith("ent_"):
                            fn, keep = torch_entropy_case(prov, m, h, v, cap, mode,
                                                          args.temperature)
                        else:
                            fn, keep = torch_case(prov, m, h, v, cap, mode)
                        ms, extra = time_torch(fn, args.warmup, args.reps)
                        record(**base, provider=prov, variant="bf16", mode=mode, softcap=cap,
                               ms=ms, extra_gb=extra / GB)
                        del fn, keep
                    except Exception as e:
                        record(**base, provider=prov, variant="bf16", mode=mode, softcap=cap,
                               ms=None, error=str(e))
        del inputs
        save(args, rate, results)
        mx.clear_cache()
        try:
            import torch

            torch.cuda.empty_cache()
        except ImportError:
            pass
    return rate, results


def table(rate, results):
    """Markdown table: one row per shape/mode/softcap, providers as columns."""
    cols = ["flash_cce/bf16", "flash_cce_3gemm/bf16", "flash_cce_mma/bf16", "flash_cce/fp16",
            "flash_cce/q4", "flash_cce/q8",
            "mlx/bf16", "mlx_fast_ce/bf16", "mlx/q4", "liger/bf16", "cce/bf16", "torch/bf16",
            "liger_scaled/bf16", "trl_chunked/bf16"]
    gemm = {(r["M"], r["H"], r["V"]): r["ms"] for r in results if r["mode"] == "gemm"}
    rows = {}
    for r in results:
        if r["mode"] == "gemm":
            continue
        key = (r["M"], r["H"], r["V"], r["mode"], r["softcap"])
        rows.setdefault(key, {})[f"{r['provider']}/{r['variant']}"] = r
    lines = ["| M,H,V | mode | cap | cuBLAS logits GEMM | " + " | ".join(cols)
             + " | ours bf16 TFLOP/s | ours bf16 / fastest peer |",
             "|" + "---|" * (len(cols) + 6)]
    for key, row in rows.items():
        m, h, v, mode, cap = key
        cells = []
        for c in cols:
            r = row.get(c)
            if r is None:
                cells.append("")
            elif r["ms"] is None:
                cells.append("fails")
            else:
                cells.append(f"{r['ms']:.1f} / {r['extra_gb']:.2f}")
        ours = row.get("flash_cce/bf16")
        gemms = {"fwd": 2, "fwd_bwd": 4, "fwd_bwd_dw": 6, "fwd_fused": 2, "ent_fwd": 2,
                 "ent_fwd_bwd": 4}[mode]
        tf = (f"{gemms * m * v * h / (ours['ms'] * 1e-3) / 1e12:.0f}"
              if ours and ours["ms"] else "")
        names = ("liger/bf16", "cce/bf16", "liger_scaled/bf16", "trl_chunked/bf16")
        peers = [row[k]["ms"] for k in names if row.get(k, {}).get("ms")]
        vs = f"{ours['ms'] / min(peers):.2f}" if ours and ours["ms"] and peers else ""
        lines.append(f"| {m},{h},{v} | {mode} | {cap or '-'} | {gemm[(m, h, v)]:.1f} | "
                     + " | ".join(cells) + f" | {tf} | {vs} |")
    return "\n".join(lines)


def ratios(results):
    """Ours at bf16, per shape and softcap: ent_fwd_bwd / fwd_bwd (the entropy's
    cost in a training step) and fwd_fused / fwd (what a forward-only call pays
    for leaving fused_backward on)."""
    ms = {(r["M"], r["H"], r["V"], r["softcap"], r["mode"]): r["ms"] for r in results
          if r["provider"] == "flash_cce" and r["variant"] == "bf16" and r.get("ms")}
    out = []
    for (m, h, v, cap, mode), t in ms.items():
        for num, den in (("ent_fwd_bwd", "fwd_bwd"), ("fwd_fused", "fwd")):
            if mode == num and (m, h, v, cap, den) in ms:
                out.append(dict(M=m, H=h, V=v, softcap=cap, ratio=f"{num}/{den}",
                                value=t / ms[(m, h, v, cap, den)]))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="*", help="M,H,V triples (default: the issue's five)")
    p.add_argument("--modes", nargs="*", default=list(MODES[:3]), choices=MODES)
    p.add_argument("--softcap", default="both", choices=("on", "off", "both"))
    p.add_argument("--variants", nargs="*", default=["bf16", "fp16", "q4", "q8"])
    p.add_argument("--providers", nargs="*",
                   default=["mma", "3gemm", "mlx", "liger", "cce", "torch", "liger_scaled",
                            "trl_chunked"])
    p.add_argument("--temperature", type=float, default=0.7,
                   help="the entropy modes' temperature")
    p.add_argument("--tuning", type=json.loads, default=None,
                   help='the ops\' tuning for our modes, e.g. \'{"chunk_mb": 192}\'')
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    mx.set_default_device(mx.gpu)
    rate, results = run(args)
    md = table(rate, results)
    print("\nms / extra GB over inputs (fwd+bwd TFLOP/s count 4*M*V*H; fwd 2*M*V*H;"
          f" with dW 6*M*V*H). bf16 matmul rate: {rate:.0f} TFLOP/s")
    print(md)
    for r in ratios(results):
        print(f"{r['M']},{r['H']},{r['V']} cap={r['softcap']} {r['ratio']}: {r['value']:.3f}")
    save(args, rate, results)


if __name__ == "__main__":
    main()
