"""GRPO rollout and update, timed apart, with peak memory: flash_cce against
mlx-lm-lora 5.10.2's GRPO, (rollouts) mlx-lm's `batch_generate` and (updates)
torch + TRL 1.16's GRPOTrainer, on one model (bench_orpo's model A: gemma3_text,
LoRA rank 16 on every linear layer of every block, random weights).

    python bench/bench_grpo.py                 # small shapes, fits a 2-core CPU
    python bench/bench_grpo.py --full          # model A, G = 8, prompt 512, completions 1k and 4k
    python bench/bench_grpo.py --full --completions 4096 --json out.json
    python bench/bench_grpo.py --full --phases rollout --rollout-completions 256 1024

Rollout providers (G completions of each prompt, every completion exactly
`--completions` tokens: no EOS stops them; temperature 1, no filters; the
tokens each provider returned are counted and give its tokens per second):
  flash_cce        `flash_cce.train.rollout.rollout`: each prompt prefilled once,
                   its cache copied to its G rows, one batched decode; returns
                   the sampler's log-probs too
  mlx-lm           mlx-lm 0.32.2 `batch_generate` of the G x prompts rows (each
                   row prefilled), token ids returned, not its log-probs (they
                   cost it a host sync per token)
  mlx-lm-lora      mlx-lm-lora 5.10.2 `generate_grpo` (shared prompt prefill,
                   mlx-lm's BatchGenerator)
Update providers (one micro-step's loss and gradients, evaluated, on the same
recorded rollouts: beta 0, on-policy, each of `--loss-types`):
  flash_cce        `flash_cce.train.grpo.grpo_value_and_grad` (groups through the
                   stack: the prompt encoded once for its G completions)
  mlx-lm-lora      mlx-lm-lora 5.10.2 `grpo_loss` under `nn.value_and_grad` (every
                   row prompt + completion, full logits); loss type grpo only
  trl              TRL 1.16 GRPOTrainer's `compute_loss` + backward on transformers'
                   Gemma 3 with model A's shapes, bf16, PEFT LoRA, gradient
                   checkpointing, TRL's fused LM head (bench/grpo_torch.py), timed
                   with CUDA events, torch's peak memory
  trl-liger        the same with `use_liger_kernel` (Liger's layer kernels; TRL
                   1.16 keeps its own head for GRPO)
A provider that is missing is reported as not available, one that fails with its
reason. Results: JSON (`--json`) with median ms, peak GB and, for rollouts,
generated tokens per second; written after every phase, so a run cut short keeps
what it measured.
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
LOSS_TYPES = ("dapo", "grpo")  # TRL 1.16's default, and the one every peer has
LORA_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo")  # mlx-lm-lora 5.10.2's
TORCH_PROVIDERS = ("trl", "trl-liger")
PROVIDERS = ("flash_cce", "mlx-lm", "mlx-lm-lora") + TORCH_PROVIDERS


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


def rollout_steps(model, prompts, G, generated):
    """name -> builder of a rollout step of completions of a given length; each
    step records in `generated[name]` how many tokens it returned."""
    rng = RolloutRng(0)

    def ours(length):
        s = SamplingSettings(max_completion_length=length, temperature=1.0)

        def step():
            out = rollout(model, prompts, G, s, [], rng)
            generated["flash_cce"] = sum(len(c) for cs in out.completions for c in cs)
        return step

    def mlx_lm(length):
        from mlx_lm.generate import batch_generate
        from mlx_lm.sample_utils import make_sampler

        rows = [p for p in prompts for _ in range(G)]

        def step():
            out = batch_generate(model, NoEos(), rows, max_tokens=length, sampler=make_sampler(temp=1.0),
                                 completion_batch_size=len(rows), prefill_batch_size=len(rows),
                                 return_token_ids=True)
            generated["mlx-lm"] = sum(len(t) for t in out.token_ids)
        return step

    def lora(length):
        from mlx_lm_lora.trainer.grpo_trainer import generate_grpo

        def step():
            completions = generate_grpo(model, NoEos(), prompts, length, G, len(prompts), None, 1.0, 1.0, 0, 0.0)[0]
            generated["mlx-lm-lora"] = sum(len(c) for c in completions)
        return step

    return {"flash_cce": ours, "mlx-lm": mlx_lm, "mlx-lm-lora": lora}


def warmed(build, length, warmup):
    """A builder of `build`'s step at `length`, which first runs one step at
    `warmup` tokens when that is given."""
    def make():
        if warmup:
            build(warmup)()
        return build(length)
    return make


def update_steps(model, rolls, length, loss_type, micro_group=None):
    cfg = GRPOConfig(loss_type=loss_type, beta=0.0, num_generations=len(rolls.completions[0]),
                     max_completion_length=length)

    def ours():
        def step():
            loss, grads, _ = grpo_value_and_grad(model, rolls, cfg, micro_group=micro_group)
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
            grpo_loss_type=loss_type)[0])

        def step():
            loss, grads = loss_and_grad(model)
            mx.eval(loss, grads)
        return step

    steps = {"flash_cce": ours}
    if loss_type in LORA_LOSS_TYPES:
        steps["mlx-lm-lora"] = lora
    return steps


def torch_update(overrides, vocab, rolls, length, loss_type, repeats, liger):
    """The `trl` (or `trl-liger`) row: TRL 1.16 GRPOTrainer's update on the same
    rollouts, or why it is not available."""
    import grpo_torch

    reason = grpo_torch.missing(liger)
    if reason:
        return {"not_available": reason}
    try:
        trainer = grpo_torch.build_trainer(overrides, vocab, len(rolls.completions[0]), len(rolls.prompts),
                                           length, loss_type, liger)
        rewards = [[x[0] for x in rs] for rs in rolls.rewards]
        inputs = grpo_torch.trainer_inputs(rolls.prompts, rolls.completions, rewards, trainer.model.device)
        ms, gb, first, loss = grpo_torch.measure(grpo_torch.update_step(trainer, inputs), repeats)
        norm = grpo_torch.grad_norm(trainer, inputs)
    except Exception as err:  # noqa: BLE001 - reported in the row
        return row(err)
    finally:
        trainer = inputs = None
        grpo_torch.release()
    return {"ms": round(ms, 2), "peak_gb": None if gb is None else round(gb, 4), "first_ms": round(first, 1),
            "loss": loss, "grad_norm": norm}


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
    if tokens is not None:
        out["tokens"] = tokens
        out["tokens_per_s"] = round(tokens / (ms / 1e3), 1)
    return out


def add_ratios(cells):
    """flash_cce's time and memory over each peer's, in the peer's cell."""
    ours = cells.get("flash_cce", {})
    for k, v in cells.items():
        if k != "flash_cce" and "ms" in v and "ms" in ours:
            v["flash_cce_time_ratio"] = round(ours["ms"] / v["ms"], 3)
            v["flash_cce_memory_ratio"] = round(ours["peak_gb"] / v["peak_gb"], 3) if v.get("peak_gb") else None


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
                    help="completion lengths whose rollouts are timed (default: those of --completions)")
    ap.add_argument("--rollout-warmup", type=int, default=None,
                    help="warm each rollout provider up with completions of this many tokens instead of a "
                         "rollout of the timed length (same kernels; saves time at long completions)")
    ap.add_argument("--loss-types", nargs="+", default=list(LOSS_TYPES), choices=LOSS_TYPES,
                    help="the updates' loss types")
    ap.add_argument("--providers", nargs="+", help="only these providers (default: all)")
    ap.add_argument("--micro-group", type=int, default=None,
                    help="our update's completions per pass of a group (default: all G)")
    ap.add_argument("--json", default="bench_grpo.json", help="where to write results")
    args = ap.parse_args()
    if args.rollout_warmup is not None and args.rollout_warmup < 1:
        ap.error(f"--rollout-warmup: got {args.rollout_warmup}; allowed: an integer >= 1")
    unknown = set(args.providers or ()) - set(PROVIDERS)
    if unknown:
        ap.error(f"--providers: unknown {', '.join(sorted(unknown))}; allowed: {', '.join(PROVIDERS)}")
    shape = dict(FULL if args.full else SMALL)
    for k in ("generations", "groups", "prompt", "repeats"):
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    if args.completions:
        shape["completions"] = tuple(args.completions)
    kind, overrides, bits = (FULL_MODELS if args.full else SMALL_MODELS)[shape["model"]]
    vocab = overrides.get("vocab_size", 262144)
    wanted = (lambda name: not args.providers or name in args.providers)
    model = None
    if not args.providers or set(args.providers) - set(TORCH_PROVIDERS):  # an MLX provider runs
        dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
        model = build(kind, overrides, bits, dtype)
        assert model.args.vocab_size == vocab
    G, prompts = shape["generations"], make_prompts(shape["groups"], shape["prompt"], vocab)
    results = dict(device=str(mx.default_device()), machine=platform.machine(), mlx=mx.__version__,
                   shape={k: v for k, v in shape.items()}, loss_types=args.loss_types, rows=[])

    def save():  # after every phase: a run cut short keeps what it measured
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)

    def chosen(steps):
        steps = available(steps) if model is not None else {}
        return {k: v for k, v in steps.items() if wanted(k)}

    rollout_lengths = shape["completions"] if args.rollout_completions is None else args.rollout_completions
    timed = lambda length: (("rollout" in args.phases and length in rollout_lengths)  # noqa: E731
                            or ("update" in args.phases and length in shape["completions"]))
    for length in sorted(filter(timed, set(shape["completions"]) | set(rollout_lengths))):
        r = dict(completion=length, rollout={}, update={})
        results["rows"].append(r)
        if "rollout" in args.phases and length in rollout_lengths:
            generated = {}
            steps = chosen(rollout_steps(model, prompts, G, generated))
            steps = {k: warmed(b, length, args.rollout_warmup) for k, b in steps.items()}
            print(f"rollout, completions of {length}: {list(steps)}", flush=True)
            r["rollout_tokens"] = G * len(prompts) * length  # what each provider should return
            r["rollout_warmup"] = args.rollout_warmup or length
            measured = measure(steps, shape["repeats"], warmup=args.rollout_warmup is None)
            r["rollout"] = {k: row(v, generated.get(k)) for k, v in measured.items()}
            add_ratios(r["rollout"])
            print(json.dumps(r["rollout"]), flush=True)
            save()
        if "update" in args.phases and length in shape["completions"]:
            rolls = make_rollouts(prompts, G, length, vocab)
            for loss_type in args.loss_types:
                steps = chosen(update_steps(model, rolls, length, loss_type, args.micro_group)) if model is not None else {}
                print(f"update {loss_type}, completions of {length}: {list(steps)}", flush=True)
                cells = {k: row(v) for k, v in measure(steps, shape["repeats"]).items()}
                for name in TORCH_PROVIDERS:
                    if wanted(name):
                        cells[name] = torch_update(overrides, vocab, rolls, length, loss_type, shape["repeats"],
                                                   liger=name == "trl-liger")
                        print(f"{name}: {json.dumps(cells[name])}", flush=True)
                add_ratios(cells)
                r["update"][loss_type] = cells
                print(json.dumps(cells), flush=True)
                save()
    save()
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
