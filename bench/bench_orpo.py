"""ORPO step time and peak memory: flash_cce.train.objectives against its own switches
and mlx-lm-lora's ORPO, on one pair (prompt = half of each sequence), LoRA rank 16
on every linear layer of every block, random weights.

    python bench/bench_orpo.py                # small shapes, fits a 2-core CPU
    python bench/bench_orpo.py --full         # the issue's shapes: models A/B, 1k/4k/8k
    python bench/bench_orpo.py --full --models A4 --lengths 8192 --json out.json
    python bench/bench_orpo.py --full --models A4 --lengths 1024 --providers flash_cce no_prefix \
        --rounds --repeats 8     # A/B: the two steps alternate

Providers (each a full step: forward, backward, gradients evaluated):
  flash_cce             flash head + prefix sharing + segmented backward + blocked
                        attention (defaults; on a CUDA GPU from 8192 tokens per pair
                        also the compiled layers)
  no_flash_head         same with the full-logits head
  no_prefix             same with two forwards instead of one prompt forward
  two_pass              prefix sharing as a prompt forward + a continuation of both
                        responses, instead of one packed pass (not in the default set)
  no_segments           same with the plain backward
  no_block_attn         same with mlx-lm's attention (scores of a whole layer in memory)
  mlx-lm-lora           mlx-lm-lora 5.10.2 `orpo_loss_from_model`, plain
  mlx-lm-lora ckpt      the same with its `grad_checkpoint` (every block checkpointed)
  seg=K                 flash_cce with K layers per checkpoint segment (not in the default set)
  block=N               flash_cce with N queries per attention block (not in the default set)
  compiled              flash_cce with the compiled layers at every length (not in the default set)
  uncompiled            flash_cce without the compiled layers (not in the default set)
  pad=N                 flash_cce with `pad_to=N`: widths rounded up, the shared prompt
                        down, to multiples of N (not in the default set)
  X+Y                   switches combined, e.g. block=64+no_prefix
A provider that fails (e.g. out of memory) is reported with its error; `no_flash_head`
runs last in each row (see LAST). `--vary-prompt K` gives every step of a row its own
pair, the prompt K tokens shorter each time (the sequence length kept), as real batches
change shape from step to step: steps then include what MLX and the compiled layers
redo for a new shape.
"""

import argparse
import gc
import itertools
import json
import os
import platform
import statistics
import sys
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import gemma3_text, gemma4_text
from mlx_lm.tuner.utils import linear_to_lora_layers

from flash_cce.stack import Pair, StackConfig
from flash_cce.train.objectives import ObjectiveConfig, value_and_grad

FULL_MODELS = {
    # model A: gemma3_text, hidden 1536, 35 layers, tied V=262144
    "A4": ("gemma3_text", dict(hidden_size=1536, num_hidden_layers=35, intermediate_size=6144,
                               num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                               vocab_size=262144), 4),
    "Abf16": ("gemma3_text", dict(hidden_size=1536, num_hidden_layers=35,
                                  intermediate_size=6144, num_attention_heads=8,
                                  num_key_value_heads=1, head_dim=256, vocab_size=262144), None),
    # model B: mlx-lm 0.32.2's default gemma4_text.ModelArgs()
    "B4": ("gemma4_text", {}, 4),
}
SMALL_MODELS = {  # same architectures, scaled down for a 2-core CPU
    "A4": ("gemma3_text", dict(hidden_size=128, num_hidden_layers=4, intermediate_size=512,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                               query_pre_attn_scalar=64, vocab_size=8192, sliding_window=64,
                               sliding_window_pattern=2), 4),
    "B4": ("gemma4_text", dict(hidden_size=128, num_hidden_layers=6, intermediate_size=512,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                               global_head_dim=128, num_kv_shared_layers=2,
                               hidden_size_per_layer_input=64, vocab_size=8192,
                               vocab_size_per_layer_input=8192, sliding_window=64,
                               sliding_window_pattern=3), 4),
}
FULL_LENGTHS = (1024, 4096, 8192)
SMALL_LENGTHS = (128, 256, 512)
PROVIDERS = ("flash_cce", "no_flash_head", "no_prefix", "no_segments", "no_block_attn",
             "mlx-lm-lora", "mlx-lm-lora ckpt")
# Run after the others of a row: with MLX 0.32.4's CUDA backend a full-logits step
# at 8k tokens fails (cudaGraphAddKernelNode: invalid argument) and leaves the
# process unable to launch kernels.
LAST = ("no_flash_head",)


def build(kind, overrides, bits, dtype, seed=0):
    mx.random.seed(seed)
    module = gemma3_text if kind == "gemma3_text" else gemma4_text
    args = module.ModelArgs(model_type=kind, **overrides)
    model = module.Model(args)
    if kind == "gemma3_text":
        model.sanitize({})  # tied head, as the real checkpoints
    model.set_dtype(dtype)  # before quantizing, or activations stay float32
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 16, "scale": 20.0, "dropout": 0.0})
    mx.eval(model.parameters())
    return model


def make_pair(length, vocab, seed=0, prompt_len=None):
    rng = np.random.default_rng(seed)
    p = length // 2 if prompt_len is None else prompt_len
    prompt = rng.integers(0, vocab, p).tolist()
    chosen = prompt + rng.integers(0, vocab, length - p).tolist()
    rejected = prompt + rng.integers(0, vocab, length - p).tolist()
    return Pair(chosen, rejected, p, p)


def make_pairs(length, vocab, count, vary, first=0, every=1):
    """`count` pairs: one, reused, or with `vary` one per step (see --vary-prompt),
    prompts shorter by vary * (first, first + every, ...): providers timed in one
    process get lengths of their own, so none finds a shape another left in MLX's
    caches."""
    if not vary:
        return [make_pair(length, vocab)]
    cuts = [vary * (first + every * k) for k in range(count)]
    if cuts[-1] >= length // 2:
        raise ValueError(f"--vary-prompt {vary}: {count} steps would empty the prompt")
    return [make_pair(length, vocab, seed=c, prompt_len=length // 2 - c) for c in cuts]


def cycling(pairs):
    """The next of `pairs` at each call, round and round."""
    it = itertools.cycle(pairs)
    return lambda: next(it)


def ours(model, pairs, **switches):
    cfg = ObjectiveConfig(name="orpo", stack=StackConfig(**switches))
    pairs = cycling(pairs)

    def step():
        loss, grads, metrics = value_and_grad(model, [pairs()], cfg)
        mx.eval(loss, grads, metrics)

    return step


def mlx_lm_lora(model, pairs, checkpoint):
    from mlx_lm_lora.trainer.orpo_trainer import orpo_loss_from_model
    from mlx_lm_lora.trainer.sft_trainer import grad_checkpoint

    layer_type = type(model.layers[0])
    original = layer_type.__call__
    scores = mx.ones((1,))

    def inputs(pair):
        n = len(pair.chosen)
        mask = mx.array([[0.0] * pair.chosen_prompt_len + [1.0] * (n - pair.chosen_prompt_len)])
        return mx.array([pair.chosen]), mx.array([pair.rejected]), mask

    batches = cycling([inputs(pair) for pair in pairs])

    def loss_fn(model, chosen, rejected, mask):
        return orpo_loss_from_model(model, chosen, rejected, mask, mask, scores, beta=0.1)[0]

    grad = nn.value_and_grad(model, loss_fn)

    def step():
        chosen, rejected, mask = batches()
        if checkpoint:
            grad_checkpoint(model.layers[0])  # patches the block class itself...
        try:
            loss, grads = grad(model, chosen, rejected, mask)
            mx.eval(loss, grads)
        finally:
            layer_type.__call__ = original  # ...so undo it for the other providers

    return step


SWITCHES = {
    "flash_cce": {},
    "no_flash_head": dict(flash_head=False),
    "no_prefix": dict(prefix_sharing=False),
    "two_pass": dict(prefix_packing=False),
    "no_segments": dict(segment_size=0),
    "compiled": dict(compiled_layers=True),
    "uncompiled": dict(compiled_layers=False),
    "no_block_attn": dict(attention_block=0),
}


def make_step(name, model, pairs):
    if name.startswith("mlx-lm-lora"):
        return mlx_lm_lora(model, pairs, checkpoint=name.endswith("ckpt"))
    switches = {}
    for part in name.split("+"):
        if part.startswith("seg="):
            switches["segment_size"] = int(part[4:])
        elif part.startswith("block="):
            switches["attention_block"] = int(part[6:])
        elif part.startswith("pad="):
            switches["pad_to"] = int(part[4:])
        elif part in SWITCHES:
            switches.update(SWITCHES[part])
        else:
            raise ValueError(f"provider: unknown {part!r}")
    return ours(model, pairs, **switches)


def measure(steps, repeats, warmup=True):
    """Median ms and peak GB of each step (`steps`: name -> a function that
    builds the step) after a warm-up run (`warmup`; else the builder's own),
    timed in rounds that run each step once,
    so that with several steps slow drifts of the machine (clocks, other load)
    fall on every step alike. A step that fails is reported and left out of
    later rounds. Returns {name: (ms, GB, warm-up ms) or the exception}; the
    warm-up includes tracing and kernel compilation."""
    out, runs, times, peaks, first = {}, {}, {}, {}, {}
    for name, build_step in steps.items():
        try:
            if warmup:
                runs[name] = build_step()
                t0 = time.perf_counter()
                runs[name]()  # warm-up: kernels, caches, traces
            else:  # the builder warms its step up
                t0 = time.perf_counter()
                runs[name] = build_step()
            first[name] = (time.perf_counter() - t0) * 1e3
            times[name], peaks[name] = [], 0.0
        except Exception as err:  # noqa: BLE001 - report and go on
            out[name] = err
    mx.clear_cache()
    for _ in range(repeats):
        for name in list(times):
            mx.reset_peak_memory()
            try:
                t0 = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - t0)
                peaks[name] = max(peaks[name], mx.get_peak_memory() / 1e9)
            except Exception as err:  # noqa: BLE001
                out[name] = err
                del times[name]
    for name, ts in times.items():
        out[name] = (statistics.median(ts) * 1e3, peaks[name], first[name])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="the issue's shapes (needs a big GPU)")
    ap.add_argument("--models", nargs="*", help="subset of A4, Abf16, B4")
    ap.add_argument("--lengths", nargs="*", type=int, help="tokens per sequence")
    ap.add_argument("--providers", nargs="*", help=f"subset of {PROVIDERS}, or seg=K, block=N")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"),
                    help="activations (default: bfloat16 with --full, else float32: "
                         "bfloat16 made this step 5-7x slower on MLX's CPU backend)")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps (median)")
    ap.add_argument("--rounds", action="store_true",
                    help="time the providers in rounds, one step each per round, instead of "
                         "one provider after the other (for A/B comparisons in one process)")
    ap.add_argument("--vary-prompt", type=int, default=0, metavar="K",
                    help="a new pair every step, its prompt K tokens shorter than the last's")
    ap.add_argument("--json", default="bench_orpo.json", help="where to write results")
    args = ap.parse_args()
    models = FULL_MODELS if args.full else SMALL_MODELS
    lengths = args.lengths or (FULL_LENGTHS if args.full else SMALL_LENGTHS)
    providers = args.providers or PROVIDERS
    repeats = args.repeats or (3 if args.full else 2)
    dtype = getattr(mx, args.dtype or ("bfloat16" if args.full else "float32"))
    results = []
    env = {k: v for k, v in os.environ.items() if k.startswith(("MLX_", "FLASH_CCE_"))}
    print(f"device: {mx.default_device()}, {platform.machine()}, {dtype}; ms / peak GB; one pair")
    if env:  # settings that change the measurement (MLX's graph size, scheduling, ...)
        print("environment: " + " ".join(f"{k}={v}" for k, v in sorted(env.items())))
    print(f"| model | tokens | " + " | ".join(providers) + " |")
    print("|---|---|" + "---|" * len(providers))
    for key in args.models or models:
        kind, overrides, bits = models[key]
        model = build(kind, overrides, bits, dtype)
        for length in lengths:
            order = sorted(providers, key=lambda n: n in LAST)
            pairs = {n: make_pairs(length, model.args.vocab_size, repeats + 1, args.vary_prompt,
                                   j, len(order)) for j, n in enumerate(order)}
            builders = {n: (lambda n=n: make_step(n, model, pairs[n])) for n in order}
            if args.rounds:
                measured = measure(builders, repeats)
            else:  # one provider after the other, memory released in between
                measured = {}
                for name in order:
                    measured.update(measure({name: builders[name]}, repeats))
                    gc.collect()
                    mx.clear_cache()
            cells, warm = {}, []
            for name in order:
                got = measured[name]
                if isinstance(got, Exception):
                    cells[name] = "fails"
                    results.append(dict(model=key, tokens=length, provider=name,
                                        error=f"{type(got).__name__}: {got}"[:300]))
                else:
                    cells[name] = f"{got[0]:.0f} / {got[1]:.2f}"
                    results.append(dict(model=key, tokens=length, provider=name, ms=got[0],
                                        peak_gb=got[1], warmup_ms=got[2]))
                    warm.append(f"{name} {got[2]:.0f}")
            gc.collect()
            mx.clear_cache()
            row = " | ".join(cells[n] for n in providers)
            print(f"| {key} | {length} | {row} |", flush=True)
            print(f"  warm-up step (ms): {', '.join(warm)}", file=sys.stderr, flush=True)
        del model
        gc.collect()
        mx.clear_cache()
    with open(args.json, "w") as f:
        json.dump(dict(device=str(mx.default_device()), machine=platform.machine(),
                       dtype=str(dtype), full=args.full, repeats=repeats, rounds=args.rounds,
                       vary_prompt=args.vary_prompt,
                       environment=env,
                       results=results), f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
