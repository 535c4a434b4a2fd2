"""Data-parallel scaling of an ORPO training step: tokens/s and peak memory per rank.

Each rank runs `--pairs-per-rank` pairs per optimizer step through
`flash_cce.train.objectives.value_and_grad` (normalised by the whole batch), the
gradients are all-reduced (`trainer.sum_over_ranks`) and AdamW updates the LoRA
weights: the trainer's step, without data loading. Launch one process per GPU:

    python bench/bench_dp.py --json dp1.json                                      # 1 GPU
    mlx.launch -n 2 --backend nccl -- python bench/bench_dp.py --json dp2.json     # 2 GPUs
    python bench/bench_dp.py --compare dp1.json dp2.json                          # table

Weak scaling: the global batch grows with the ranks, so efficiency =
tokens/s(N) / tokens/s(1) (ideal: N).
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
import mlx.optimizers as optim

from bench_orpo import FULL_MODELS, SMALL_MODELS, build, make_pair
from flash_cce.train.objectives import ObjectiveConfig, value_and_grad
from flash_cce.train.trainer import sum_over_ranks


def run(args):
    world = mx.distributed.init()
    rank, size = world.rank(), world.size()
    kind, overrides, bits = (FULL_MODELS if args.full else SMALL_MODELS)[args.model]
    model = build(kind, overrides, bits, mx.bfloat16 if args.full else mx.float32)
    vocab = model.args.vocab_size
    pairs = [make_pair(args.length, vocab, seed=rank * 1000 + i) for i in range(args.pairs_per_rank)]
    opt = optim.AdamW(learning_rate=1e-5)
    cfg = ObjectiveConfig()
    group = world if size > 1 else None

    def step():
        loss, grads, _ = value_and_grad(model, pairs, cfg, group=group)
        grads = sum_over_ranks(grads, world)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)

    step()  # warm up (compiles kernels, allocates)
    times = []
    mx.reset_peak_memory()
    for _ in range(args.steps):
        tic = time.perf_counter()
        step()
        times.append(time.perf_counter() - tic)
    tokens = size * sum(len(p.chosen) + len(p.rejected) for p in pairs)
    t = statistics.median(times)
    peak = mx.distributed.all_gather(mx.array([mx.get_peak_memory() / 1e9]), group=world) \
        if size > 1 else mx.array([mx.get_peak_memory() / 1e9])
    result = dict(ranks=size, model=args.model, length=args.length, pairs_per_rank=args.pairs_per_rank,
                  step_ms=t * 1e3, tokens_per_step=tokens, tokens_per_s=tokens / t,
                  peak_gb_per_rank=peak.tolist(), device=str(mx.default_device()),
                  date=time.strftime("%Y-%m-%d"))
    if rank == 0:
        print(json.dumps(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)


def compare(paths):
    rows = [json.load(open(p)) for p in paths]
    base = min(rows, key=lambda r: r["ranks"])
    print("| ranks | model | tokens/seq | pairs/rank | step ms | tokens/s | speed-up | peak GB per rank |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: r["ranks"]):
        peaks = ", ".join(f"{p:.1f}" for p in r["peak_gb_per_rank"])
        print(f"| {r['ranks']} | {r['model']} | {r['length']} | {r['pairs_per_rank']} | "
              f"{r['step_ms']:.0f} | {r['tokens_per_s']:.0f} | "
              f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | {peaks} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the real model A (else a small one for CPUs)")
    ap.add_argument("--model", default="A4")
    ap.add_argument("--length", type=int, default=4096, help="tokens per sequence (prompt = half)")
    ap.add_argument("--pairs-per-rank", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--compare", nargs="+", help="print the table of earlier --json results")
    args = ap.parse_args()
    if args.compare:
        compare(args.compare)
    else:
        run(args)


if __name__ == "__main__":
    main()
