"""GRPO rollout and update, timed apart, with peak memory: flash_cce against
mlx-lm-lora 5.10.2's GRPO and (rollouts) mlx-lm's `batch_generate`, in one
process on one model (bench_orpo's model A: gemma3_text, LoRA rank 16 on every
linear layer of every block, random weights).

    python bench/bench_grpo.py                 # small shapes, fits a 2-core CPU
    python bench/bench_grpo.py --full          # model A, G = 8, prompt 512, completions 1k and 4k
    python bench/bench_grpo.py --full --completions 4096 --json out.json

Rollout providers (G completions of each prompt, every completion exactly
`--completions` tokens: no EOS stops them; temperature 1, no filters):
  flash_cce        `flash_cce.train.rollout.rollout`: each prompt prefilled once,
                   its cache copied to its G rows, one batched decode
  mlx-lm           mlx-lm 0.32.2 `batch_generate` of the G x prompts rows
  mlx-lm-lora      mlx-lm-lora 5.10.2 `generate_grpo` (shared prompt prefill,
                   mlx-lm's BatchGenerator)
Update providers (one optimizer micro-step's loss and gradients, evaluated, on
the same recorded rollouts: loss_type grpo, beta 0, on-policy):
  flash_cce        `flash_cce.train.grpo.grpo_value_and_grad` (groups through the
                   stack: the prompt encoded once for its G completions)
  mlx-lm-lora      mlx-lm-lora 5.10.2 `grpo_loss` under `nn.value_and_grad` (every
                   row prompt + completion, full logits)
A provider that is missing or fails is reported with its reason. Results: JSON
(`--json`) with median ms, peak GB and, for rollouts, generated tokens per second.
"""

import argparse
import json
import os
import platform
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_orpo import FULL_MODELS, SMALL_MODELS, build, measure  # noqa: E402

from flash_cce.train.grpo import GRPOConfig, Rollouts, grpo_value_and_grad  # noqa: E402
from flash_cce.train.rollout import RolloutRng, SamplingSettings, rollout  # noqa: E402

SMALL = dict(model="A4", generations=4, groups=2, prompt=64, completions=(32, 64), repeats=3)
FULL = dict(model="A4", generations=8, groups=1, prompt=512, completions=(1024, 4096), repeats=3)


class NoEos:
    """The tokenizer surface the generators read: no EOS, so every completion
    runs its full length; ids decode to a placeholder (no reward reads them)."""

    eos_token_ids = []
    eos_token_id = None

    def decode(self, ids, **kwargs):
        return " ".join(map(str, ids))

    def encode(self, text, add_special_tokens=True):
        return []


def make_prompts(groups, length, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for _ in range(groups)]


def make_rollouts(prompts, G, length, vocab, seed=1):
    rng = np.random.default_rng(seed)
    comps = [[rng.integers(0, vocab, length).tolist() for _ in range(G)] for _ in prompts]
    rewards = [[[float(rng.integers(0, 2))] for _ in range(G)] for _ in prompts]
    return Rollouts(prompts, comps, rewards, ["r"], [[True] * G for _ in prompts])


def rollout_steps(model, prompts, G, length):
    s = SamplingSettings(max_completion_length=length, temperature=1.0)
    rng = RolloutRng(0)

    def ours():
        return lambda: rollout(model, prompts, G, s, [], rng)

    def mlx_lm():
        from mlx_lm.generate import batch_generate
        from mlx_lm.sample_utils import make_sampler

        rows = [p for p in prompts for _ in range(G)]
        return lambda: batch_generate(model, NoEos(), rows, max_tokens=length, sampler=make_sampler(temp=1.0),
                                      completion_batch_size=len(rows), prefill_batch_size=len(rows))

    def lora():
        from mlx_lm_lora.trainer.grpo_trainer import generate_grpo

        return lambda: generate_grpo(model, NoEos(), prompts, length, G, len(prompts), None, 1.0, 1.0, 0, 0.0)

    return {"flash_cce": ours, "mlx-lm": mlx_lm, "mlx-lm-lora": lora}


def update_steps(model, rolls, length):
    cfg = GRPOConfig(loss_type="grpo", beta=0.0, num_generations=len(rolls.completions[0]),
                     max_completion_length=length)

    def ours():
        def step():
            loss, grads, _ = grpo_value_and_grad(model, rolls, cfg)
            mx.eval(loss, grads)
        return step

    def lora():
        from mlx_lm_lora.trainer.grpo_trainer import grpo_loss

        G = len(rolls.completions[0])
        idx = [i for i in range(len(rolls.prompts)) for _ in range(G)]
        comps = [mx.array(c, dtype=mx.int32) for cs in rolls.completions for c in cs]
        batch = (rolls.prompts, None, None, None, None)
        r = np.array([x[0] for rs in rolls.rewards for x in rs], np.float32).reshape(-1, G)
        adv = mx.array(((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-4)).reshape(-1))
        loss_and_grad = nn.value_and_grad(model, lambda m: grpo_loss(
            m, None, batch, comps, None, idx, adv, beta=0.0, epsilon=0.2, max_tokens=length,
            grpo_loss_type="grpo")[0])

        def step():
            loss, grads = loss_and_grad(model)
            mx.eval(loss, grads)
        return step

    return {"flash_cce": ours, "mlx-lm-lora": lora}


def available(steps):
    """`steps` without mlx-lm-lora when it is not installed (printed with the reason)."""
    try:
        import mlx_lm_lora  # noqa: F401
    except ImportError as e:
        print(f"mlx-lm-lora: skipped ({e}; pip install mlx-lm-lora==5.10.2 --no-deps)")
        return {k: v for k, v in steps.items() if k != "mlx-lm-lora"}
    return steps


def row(result, tokens=None):
    if isinstance(result, Exception):
        return {"error": f"{type(result).__name__}: {str(result).splitlines()[0][:200] if str(result) else ''}"}
    ms, gb, first = result
    out = {"ms": round(ms, 2), "peak_gb": round(gb, 4), "first_ms": round(first, 1)}
    if tokens:
        out["tokens_per_s"] = round(tokens / (ms / 1e3), 1)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="model A, G = 8, prompt 512, completions 1k and 4k (a GPU)")
    ap.add_argument("--completions", nargs="*", type=int, help="completion lengths (tokens)")
    ap.add_argument("--generations", type=int, help="G, completions per prompt")
    ap.add_argument("--groups", type=int, help="prompts per step")
    ap.add_argument("--prompt", type=int, help="prompt length (tokens)")
    ap.add_argument("--repeats", type=int, help="timed runs per provider (median)")
    ap.add_argument("--phases", nargs="+", default=["rollout", "update"], choices=("rollout", "update"),
                    help="what to time")
    ap.add_argument("--rollout-completions", nargs="*", type=int,
                    help="completion lengths whose rollouts are timed (default: all of --completions)")
    ap.add_argument("--providers", nargs="+", help="only these providers (default: all)")
    ap.add_argument("--json", default="bench_grpo.json", help="where to write results")
    args = ap.parse_args()
    shape = dict(FULL if args.full else SMALL)
    for k in ("generations", "groups", "prompt", "repeats"):
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    if args.completions:
        shape["completions"] = tuple(args.completions)
    kind, overrides, bits = (FULL_MODELS if args.full else SMALL_MODELS)[shape["model"]]
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    model = build(kind, overrides, bits, dtype)
    vocab = model.args.vocab_size
    G, prompts = shape["generations"], make_prompts(shape["groups"], shape["prompt"], vocab)
    results = dict(device=str(mx.default_device()), machine=platform.machine(), mlx=mx.__version__,
                   shape={k: v for k, v in shape.items()}, rows=[])

    def chosen(steps):
        steps = available(steps)
        return {k: v for k, v in steps.items() if not args.providers or k in args.providers}

    rollout_lengths = shape["completions"] if args.rollout_completions is None else args.rollout_completions
    for length in shape["completions"]:
        tokens = G * len(prompts) * length
        gen, upd = {}, {}
        if "rollout" in args.phases and length in rollout_lengths:
            print(f"rollout, completions of {length}: {list(chosen(rollout_steps(model, prompts, G, length)))}",
                  flush=True)
            gen = measure(chosen(rollout_steps(model, prompts, G, length)), shape["repeats"])
            print({k: row(v, tokens) for k, v in gen.items()}, flush=True)
        if "update" in args.phases:
            print(f"update, completions of {length}", flush=True)
            upd = measure(chosen(update_steps(model, make_rollouts(prompts, G, length, vocab), length)),
                          shape["repeats"])
            print({k: row(v) for k, v in upd.items()}, flush=True)
        r = dict(completion=length, rollout={k: row(v, tokens) for k, v in gen.items()},
                 update={k: row(v) for k, v in upd.items()})
        for phase in ("rollout", "update"):
            ours = r[phase].get("flash_cce", {})
            for k, v in r[phase].items():
                if k != "flash_cce" and "ms" in v and "ms" in ours:
                    v["flash_cce_time_ratio"] = round(ours["ms"] / v["ms"], 3)
                    v["flash_cce_memory_ratio"] = round(ours["peak_gb"] / v["peak_gb"], 3) if v["peak_gb"] else None
        results["rows"].append(r)
        print(json.dumps(r))
        with open(args.json, "w") as f:  # after every length: a run cut short keeps what it measured
            json.dump(results, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
