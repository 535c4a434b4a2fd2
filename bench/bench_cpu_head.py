"""CPU benchmark of the flash-CCE head against MLX's composition and numpy's sgemm.

Providers, measured in one process:
  flash_cce       our CPU kernel (forward, and forward + backward for dh)
  mlx_compose     matmul / quantized_matmul + softcap + logsumexp + gather (fp32 logits)
  mlx_fast_ce     mx.fast.cross_entropy on materialised logits
  numpy_sgemm     one fp32 GEMM of the same size through numpy's BLAS: the
                  practical GEMM ceiling of the machine

Modes (--modes): `fwd` (fused_backward=False, forward-only use), `fwd-fused`
(the training forward, fused_backward=True, evaluated without a backward: what
a reference or evaluation call wastes when it leaves fused_backward on),
`fwd+bwd` (dh through mx.grad), and the same with entropy=True: `ent-fwd`,
`ent-fwd+bwd` (loss sum(logp + 0.1 entropy)). Only flash_cce runs the
fwd-fused and ent-* modes.

GFLOP/s counts 2*M*V*H per GEMM the algorithm performs: 1 for a forward
(fused_backward=False), 2 for forward + backward through mx.grad (the fused
forward also forms sum_v p_v dcap_v W_v, so dh needs no second pass). Extra
memory is MLX's peak minus what was active before the call (inputs excluded);
the kernel's scratch comes from MLX's allocator, so it is included.

  python bench/bench_cpu_head.py                 # both shapes, JSON to bench/results/
  python bench/bench_cpu_head.py --shapes 512,1024,32768 --repeats 1
  python bench/bench_cpu_head.py --gemm-kernels all   # each GEMM micro-kernel
  python bench/bench_cpu_head.py --interleave --repeats 9 --kinds fp32 \
      --modes fwd fwd+bwd ent-fwd+bwd --gemm-kernels all   # ratios on a shared machine

--interleave runs the providers of a shape and weight kind round-robin, each
repetition once per provider, and reports the min and median of each and the
ratios of their mins (entropy over logp-only forward + backward, our forward
over numpy's sgemm): a load that comes and goes then hits every provider alike.
It measures time only: wall time, and the process's CPU time (all threads),
which leaves out the time a thread waited for a core that other work held.
"""

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import flash_cce as fc
from flash_cce import _ext

SOFTCAP = 30.0
GROUP_SIZE, BITS = 64, 4


def make(M, H, V, kind):
    dt = mx.float32 if kind == "fp32" else mx.bfloat16
    h = mx.random.normal((M, H)).astype(dt)
    w = (mx.random.normal((V, H)) / H**0.5).astype(dt)
    y = mx.random.randint(0, V, (M,))
    q = dict(scales=None, biases=None)
    if kind == "4bit":
        w, s, b = mx.quantize(w, group_size=GROUP_SIZE, bits=BITS)
        q = dict(scales=s, biases=b)
    mx.eval(h, w, y, *[a for a in q.values() if a is not None])
    return h, w, y, q


def measure(fn, repeats):
    """Median seconds and extra peak bytes of fn() (which returns arrays to eval)."""
    mx.eval(fn())  # warm up
    times, peak = [], 0
    for _ in range(repeats):
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
        peak = max(peak, mx.get_peak_memory() - base)
    return statistics.median(times), peak


MODES = ("fwd", "fwd-fused", "fwd+bwd", "ent-fwd", "ent-fwd+bwd")
GEMMS = {"fwd": 1, "fwd-fused": 2, "fwd+bwd": 2, "ent-fwd": 1, "ent-fwd+bwd": 2}


def ours(h, w, y, q, mode):
    kw = dict(group_size=GROUP_SIZE, softcap=SOFTCAP, **q)
    if mode in ("fwd", "fwd-fused"):
        return lambda: fc.flash_cce_forward(h, w, y, fused_backward=mode == "fwd-fused", **kw)
    if mode == "ent-fwd":
        return lambda: list(fc.flash_cce_forward(h, w, y, fused_backward=False, entropy=True,
                                                 **kw))
    if mode == "ent-fwd+bwd":
        def loss(h):
            st = fc.flash_cce_forward(h, w, y, entropy=True, **kw)
            return (st.logp + 0.1 * st.entropy).sum()
    else:
        def loss(h):
            return fc.flash_cce_forward(h, w, y, **kw)[0].sum()
    grad = mx.grad(loss)
    return lambda: grad(h)


def logits_of(h, w, q):
    if q["scales"] is None:
        z = h.astype(mx.float32) @ w.astype(mx.float32).T
    else:
        z = mx.quantized_matmul(h, w, q["scales"], q["biases"], transpose=True,
                                group_size=GROUP_SIZE, bits=BITS).astype(mx.float32)
    return SOFTCAP * mx.tanh(z / SOFTCAP)


def compose(h, w, y, q, mode, fast_ce):
    def loss(h):
        z = logits_of(h, w, q)
        if fast_ce:
            return mx.fast.cross_entropy(z, y).sum()
        lse = mx.logsumexp(z, axis=-1)
        return (lse - mx.take_along_axis(z, y[:, None], axis=-1)[:, 0]).sum()

    if mode == "fwd":
        return lambda: loss(h)
    return lambda: mx.grad(loss)(h)


def numpy_gemm_fn(M, H, V):
    a = np.random.randn(M, H).astype(np.float32)
    b = np.random.randn(V, H).astype(np.float32)
    return lambda: a @ b.T


def numpy_sgemm(M, H, V, repeats):
    fn = numpy_gemm_fn(M, H, V)
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def interleaved(providers, repeats):
    """({name: [wall seconds]}, {name: [CPU seconds]}): every provider once per
    round (after one warm-up round), `repeats` rounds. A provider is (name, fn,
    kernel or None); fn's result is evaluated when it is an MLX array or a list
    of them. CPU seconds are the process's, all threads: on a machine that
    other work shares they leave out the time a thread waited for a core."""
    def once(fn, kernel):
        if kernel is not None:
            _ext.cpu_gemm_select(kernel)
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        if not isinstance(out, np.ndarray):
            mx.eval(out)
        return time.perf_counter() - t, time.process_time() - c

    for _, fn, kernel in providers:
        once(fn, kernel)
    wall = {name: [] for name, _, _ in providers}
    cpu = {name: [] for name, _, _ in providers}
    for _ in range(repeats):
        for name, fn, kernel in providers:
            w, c = once(fn, kernel)
            wall[name].append(w)
            cpu[name].append(c)
    return wall, cpu


def ratio_rows(shape, kind, times, kernels, clock):
    """Ratios of min times: entropy over logp-only forward + backward, and
    numpy's sgemm over our forward (>= 1 means ours is faster)."""
    out = []
    best = {name: min(ts) for name, ts in times.items()}
    for k in kernels:
        tag = f"[{k}]"
        pairs = [("ent-fwd+bwd / fwd+bwd", f"ent-fwd+bwd{tag}", f"fwd+bwd{tag}"),
                 ("ent-fwd / fwd", f"ent-fwd{tag}", f"fwd{tag}"),
                 ("numpy_sgemm / fwd", "numpy_sgemm", f"fwd{tag}")]
        for what, num, den in pairs:
            if num in best and den in best:
                out.append(dict(shape=shape, kind=kind, kernel=k, ratio=what, clock=clock,
                                value=best[num] / best[den]))
    return out


def run_interleaved(args, kernels):
    rows, ratios = [], []
    for shape in args.shapes:
        M, H, V = map(int, shape.split(","))
        flops = 2 * M * V * H
        for kind in args.kinds:
            h, w, y, q = make(M, H, V, kind)
            providers = [(f"{mode}[{k}]", ours(h, w, y, q, mode), k)
                         for mode in args.modes for k in kernels]
            if kind == "fp32":
                providers.insert(0, ("numpy_sgemm", numpy_gemm_fn(M, H, V), None))
            times, cpu = interleaved(providers, args.repeats)
            for name, ts in times.items():
                mode = name.split("[")[0]
                gemms = GEMMS.get(mode, 1)
                rows.append(dict(shape=shape, kind=kind, provider=name, ms_min=min(ts) * 1e3,
                                 ms_median=statistics.median(ts) * 1e3,
                                 gflops_min=gemms * flops / min(ts) / 1e9,
                                 cpu_ms_min=min(cpu[name]) * 1e3,
                                 cpu_ms_median=statistics.median(cpu[name]) * 1e3))
                r = rows[-1]
                print(f"{shape:>16} {kind:>5} {name:>22} min {r['ms_min']:9.1f} ms  median "
                      f"{r['ms_median']:9.1f} ms  {r['gflops_min']:7.1f} GFLOP/s  CPU min "
                      f"{r['cpu_ms_min']:9.1f} median {r['cpu_ms_median']:9.1f} ms", flush=True)
            ratios += ratio_rows(shape, kind, times, kernels, "wall")
            ratios += ratio_rows(shape, kind, cpu, kernels, "cpu")
            del h, w, y, q
    print("\n| shape M,H,V | weights | provider | min ms | median ms | GFLOP/s (min) "
          "| CPU min ms | CPU median ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['kind']} | {r['provider']} | {r['ms_min']:.1f} | "
              f"{r['ms_median']:.1f} | {r['gflops_min']:.1f} | {r['cpu_ms_min']:.1f} | "
              f"{r['cpu_ms_median']:.1f} |")
    print("\n| shape M,H,V | weights | kernel | ratio of mins | clock | value |")
    print("|---|---|---|---|---|---|")
    for r in ratios:
        print(f"| {r['shape']} | {r['kind']} | {r['kernel']} | {r['ratio']} | {r['clock']} | "
              f"{r['value']:.3f} |")
    return rows, ratios


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["512,1024,32768", "2048,2048,65536"])
    ap.add_argument("--kinds", nargs="+", default=["fp32", "bf16", "4bit"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--compose-max-mvh", type=float, default=2e10,
                    help="run MLX's composition only up to this M*V*H (it is slow on CPU)")
    ap.add_argument("--gemm-kernels", nargs="+", default=None,
                    help="our GEMM micro-kernels to measure (names of _ext.cpu_gemm_kernels(), "
                         "or 'all'); default: the one chosen for this processor")
    ap.add_argument("--interleave", action="store_true",
                    help="run the providers round-robin and report min/median and ratios "
                         "(time only; no MLX composition)")
    ap.add_argument("--out", default="bench/results/cpu_head.json")
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    available = _ext.cpu_gemm_kernels()
    kernels = args.gemm_kernels or [_ext.cpu_gemm_kernel()]
    if kernels == ["all"]:
        kernels = available
    unknown = [k for k in kernels if k not in available]
    if unknown:
        ap.error(f"--gemm-kernels: {unknown} not among this processor's {available}")
    chosen = _ext.cpu_gemm_kernel()
    meta = dict(
        date=time.strftime("%Y-%m-%d"), machine=platform.processor() or platform.machine(),
        cpus=os.cpu_count(), mlx=mx.__version__, numpy=np.__version__,
        gemm_kernel=chosen, gemm_kernels=kernels, softcap=SOFTCAP, repeats=args.repeats,
    )
    if args.interleave:
        rows, ratios = run_interleaved(args, kernels)
        _ext.cpu_gemm_select(chosen)
        write(args.out, dict(meta=meta, rows=rows, ratios=ratios))
        return

    rows = []
    for shape in args.shapes:
        M, H, V = map(int, shape.split(","))
        flops = 2 * M * V * H
        t_np = numpy_sgemm(M, H, V, args.repeats)
        rows.append(dict(shape=shape, kind="fp32", provider="numpy_sgemm", mode="gemm",
                         ms=t_np * 1e3, gflops=flops / t_np / 1e9, extra_mb=None))
        for kind in args.kinds:
            h, w, y, q = make(M, H, V, kind)
            for mode in args.modes:
                gemms = GEMMS[mode]
                providers = [(f"flash_cce[{k}]" if len(kernels) > 1 else "flash_cce",
                              ours(h, w, y, q, mode), args.repeats, k) for k in kernels]
                if mode in ("fwd", "fwd+bwd") and M * V * H <= args.compose_max_mvh:
                    providers += [
                        ("mlx_compose", compose(h, w, y, q, mode, False), 1, chosen),
                        ("mlx_fast_ce", compose(h, w, y, q, mode, True), 1, chosen),
                    ]
                for name, fn, reps, kernel in providers:
                    _ext.cpu_gemm_select(kernel)
                    t, extra = measure(fn, reps)
                    rows.append(dict(shape=shape, kind=kind, provider=name, mode=mode,
                                     ms=t * 1e3, gflops=gemms * flops / t / 1e9,
                                     extra_mb=extra / 2**20))
                    r = rows[-1]
                    print(f"{shape:>16} {kind:>5} {mode:>8} {name:>12} {r['ms']:10.1f} ms "
                          f"{r['gflops']:7.1f} GFLOP/s {r['extra_mb']:9.1f} MB extra", flush=True)
            del h, w, y, q
    _ext.cpu_gemm_select(chosen)

    print("\n| shape M,H,V | weights | mode | provider | ms | GFLOP/s | extra peak MB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        extra = "" if r["extra_mb"] is None else f"{r['extra_mb']:.1f}"
        print(f"| {r['shape']} | {r['kind']} | {r['mode']} | {r['provider']} | "
              f"{r['ms']:.1f} | {r['gflops']:.1f} | {extra} |")
    write(args.out, dict(meta=meta, rows=rows))


def write(out, result):
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
