"""`flash-cce demo --objective grpo`: online RL of the tiny model, offline.

The verifiable task is the preference demo's: a prompt states an object's color
and asks for it ("tom has a red ball . what color is the ball ?"); the answer
is one word, and the built-in `exact_match` reward is 1 when it is the stated
color (the record's `answer` column), else 0. The randomly initialised 2-layer
llama samples any of its words at first (mean reward near 1/46, the chance of
one word), learns that colors pay, then to read the color from the prompt: the
validation prompts hold (name, color, object) triples that never occur in
training, so their mean reward near 1 means the model reads, not recalls.
"""

import json
import time
from pathlib import Path

from .demo import DATA_DIR, _fresh_run_dir, demo_records, demo_words

GRPO_DATA_DIR = DATA_DIR / "grpo"
GRPO_SPLITS = {"train": 400, "valid": 32}

# One-word completions (max_completion_length 1), 16 per prompt. The base is
# random, so the blocks' full weights train (as in the preference demo).
GRPO_DEMO_CONFIG = dict(
    objective="grpo",
    reward_funcs=["exact_match"],
    num_generations=16,
    max_completion_length=1,
    fine_tune_type="full",
    num_layers=-1,
    learning_rate=1e-4,
    lr_schedule="constant",
    weight_decay=0.0,
    batch_size=4,
    iters=300,
    steps_per_eval=50,
    save_every=100,
    max_seq_length=64,
    seed=0,
)


def grpo_records(seed=0):
    """{split: [{"prompt", "answer"}]}: the preference demo's prompts with the stated color as the answer."""
    return {split: [{"prompt": r["prompt"], "answer": r["chosen"].split()[0]} for r in recs[:GRPO_SPLITS[split]]]
            for split, recs in demo_records(seed).items() if split in GRPO_SPLITS}


def write_grpo_data(path, seed=0):
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for split, recs in grpo_records(seed).items():
        (path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def run_grpo_demo(run_dir="flash-cce-demo", iters=None, log=print):
    """Builds the tiny model, trains it with GRPO on the bundled prompts, prints
    the held-out mean reward curve and plots it; returns the validation records."""
    from .plot import plot_run
    from .grpo_trainer import run_grpo
    from .runner import resolve_config
    from .tiny import build_tiny_model

    tic = time.perf_counter()
    run_dir, lock = _fresh_run_dir(run_dir, log)
    try:
        model_dir = build_tiny_model(run_dir / "base_model", demo_words(), seed=0)
        cfg = dict(GRPO_DEMO_CONFIG, model=str(model_dir), data=str(GRPO_DATA_DIR), run_dir=str(run_dir))
        if iters is not None:
            cfg["iters"] = iters
        cfg = resolve_config({}, base=cfg)
        evals = []
        run_grpo(cfg, log=log, on_eval=evals.append, hint=False, own_files=(model_dir.name,), lock=lock)
        png = plot_run(run_dir)
    finally:
        lock.release()
    log("\nHeld-out mean reward (validation prompts, unseen triples; chance of one word: 1/46):")
    log("  " + "  ".join(f"step {r['step']}: {r['reward']:.2f}" for r in evals))
    prompt = grpo_records()["valid"][0]["prompt"]
    log(f"\nRun directory {run_dir}: metrics.jsonl, {png.name}, adapters/, best/, checkpoints/")
    log(f"Try: mlx_lm.generate --model {model_dir} --adapter-path {run_dir / 'adapters'} "
        f"--ignore-chat-template --prompt \"{prompt}\" --max-tokens 1")
    log(f"Demo finished in {time.perf_counter() - tic:.1f} s")
    return evals
