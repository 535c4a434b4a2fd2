"""Where one ORPO bench step's time goes: host graph building against evaluation,
and (on an NVIDIA GPU, with torch installed) how long the device was busy, how
many kernels ran and the CUDA API calls that cost the host most. One provider
per process, so that no other provider's shapes sit in MLX's caches.

    python bench/profile_orpo.py flash_cce 4096            # model A 4-bit, 4k tokens
    python bench/profile_orpo.py no_prefix 4096 --steps 4
    python bench/profile_orpo.py pad=64 1024 --vary-prompt 8 --json out.json
    python bench/profile_orpo.py flash_cce 256 --small      # small shapes, fits a CPU

Providers and models are those of `bench_orpo.py` (the step is built the same
way). "build": from the step's start to its first `mx.eval` (objectives evaluate
once a pair); "evaluation": time inside `mx.eval`. The kernel trace comes from
CUPTI through `torch.profiler` over `--traced` more steps; "busy" is the union of
the kernels' intervals (kernels of concurrent graph branches overlap, so the sum
of their durations is larger).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_orpo  # noqa: E402


class EvalClock:
    """Records the (start, end) of each `mx.eval` while installed."""

    def __init__(self):
        self.calls, self.real = [], mx.eval

    def __enter__(self):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            self.real(*args, **kwargs)
            self.calls.append((t0, time.perf_counter()))

        mx.eval = timed
        return self

    def __exit__(self, *exc):
        mx.eval = self.real
        return False


def timed_steps(step, count, clock):
    out = []
    for _ in range(count):
        clock.calls.clear()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        first = clock.calls[0][0] if clock.calls else t1
        out.append(dict(ms=(t1 - t0) * 1e3, build_ms=(first - t0) * 1e3,
                        eval_ms=sum(b - a for a, b in clock.calls) * 1e3,
                        peak_gb=mx.get_peak_memory() / 1e9))
    return out


def busy_ms(intervals):
    """Length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def kernel_trace(step, count, clock):
    """Per step: kernels, busy ms, kernels by name, the costliest CUDA API calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps = timed_steps(step, count, clock)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    by_name, api = {}, {}
    for e in kernels:
        d = by_name.setdefault(e["name"][:100], [0, 0.0])
        d[0] += 1
        d[1] += e["dur"]
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            d = api.setdefault(e["name"], [0, 0.0])
            d[0] += 1
            d[1] += e["dur"]
    per = lambda table: sorted(([n, c / count, t / 1e3 / count] for n, (c, t) in table.items()),
                               key=lambda r: -r[2])
    return dict(traced_steps=steps, kernels=len(kernels) / count,
                busy_ms=busy_ms((e["ts"], e["ts"] + e["dur"]) for e in kernels) / 1e3 / count,
                kernels_by_name=per(by_name), api_calls=per(api)[:15])


class _Built(Exception):
    pass


def profile_build(step, top):
    """cProfile of one step's graph build: the step stops at its first `mx.eval`."""
    import cProfile
    import pstats

    def stop(*args, **kwargs):
        raise _Built

    real, mx.eval = mx.eval, stop
    prof = cProfile.Profile()
    try:
        prof.enable()
        step()
    except _Built:
        pass
    finally:
        prof.disable()
        mx.eval = real
    for order in ("cumulative", "tottime"):
        pstats.Stats(prof, stream=sys.stdout).sort_stats(order).print_stats(top)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("provider", help="a provider of bench_orpo.py (e.g. flash_cce, no_prefix, pad=64)")
    ap.add_argument("tokens", type=int, help="tokens per sequence")
    ap.add_argument("--model", default="A4", choices=sorted(bench_orpo.FULL_MODELS))
    ap.add_argument("--small", action="store_true",
                    help="bench_orpo.py's small models in float32 (a CPU check of the script)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    ap.add_argument("--traced", type=int, default=3, help="steps under the kernel trace (0: none)")
    ap.add_argument("--vary-prompt", type=int, default=0, metavar="K",
                    help="a new pair every step, its prompt K tokens shorter than the last's")
    ap.add_argument("--profile-build", type=int, default=0, metavar="N",
                    help="print the N Python functions that took the graph build longest, with and "
                         "without their callees (cProfile of one more step, stopped at its "
                         "first mx.eval)")
    ap.add_argument("--json", default="profile_orpo.json")
    args = ap.parse_args()

    models = bench_orpo.SMALL_MODELS if args.small else bench_orpo.FULL_MODELS
    kind, overrides, bits = models[args.model]
    model = bench_orpo.build(kind, overrides, bits, mx.float32 if args.small else mx.bfloat16)
    pairs = bench_orpo.make_pairs(args.tokens, model.args.vocab_size,
                                  1 + args.steps + args.traced, args.vary_prompt)
    step = bench_orpo.make_step(args.provider, model, pairs)
    t0 = time.perf_counter()
    step()  # warm-up: kernels, caches, traces
    warmup_ms = (time.perf_counter() - t0) * 1e3
    mx.clear_cache()
    with EvalClock() as clock:
        steps = timed_steps(step, args.steps, clock)
        trace = {}
        if args.traced and mx.default_device() == mx.gpu:
            try:
                trace = kernel_trace(step, args.traced, clock)
            except ImportError:
                print("no torch: kernel trace skipped", file=sys.stderr)
    if args.profile_build:
        profile_build(step, args.profile_build)
    med = lambda key: statistics.median(s[key] for s in steps)
    result = dict(provider=args.provider, model=args.model, tokens=args.tokens,
                  vary_prompt=args.vary_prompt, warmup_ms=warmup_ms, steps=steps,
                  ms=med("ms"), build_ms=med("build_ms"), eval_ms=med("eval_ms"),
                  peak_gb=max(s["peak_gb"] for s in steps), device=str(mx.default_device()),
                  environment={k: v for k, v in os.environ.items()
                               if k.startswith(("MLX_", "FLASH_CCE_"))}, **trace)
    print("| provider | tokens | step (ms) | build (ms) | evaluation (ms) | peak GB | "
          "device busy (ms) | kernels |")
    print("|---|---|---|---|---|---|---|---|")
    busy = f"{trace['busy_ms']:.1f} | {trace['kernels']:,.0f}" if trace else "- | -"
    print(f"| {args.provider} | {args.tokens} | {result['ms']:.0f} | {result['build_ms']:.0f} | "
          f"{result['eval_ms']:.0f} | {result['peak_gb']:.2f} | {busy} |")
    if trace:
        print("costliest CUDA API calls a step (calls, ms): " + ", ".join(
            f"{n} {c:.0f} {t:.1f}" for n, c, t in trace["api_calls"][:6]))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
