"""`flash-cce demo`: preference-tune a tiny model offline and watch it learn.

The task: a prompt states an object's color and asks for it ("tom has a red ball .
what color is the ball ?"); the chosen answer is the stated color, the rejected
one another color. Validation and test pairs use (name, color, object) triples
that never occur in training, so accuracy above chance means the model learned
to read the color from the prompt, not to recall pairs. A randomly initialised
2-layer llama starts at chance; with ORPO it answers held-out pairs right after
about 75 steps (see the README for measured runs).
"""

import random
import shlex
import shutil
import time
from pathlib import Path

NAMES = "tom ana bob eva sam lia max zoe ben mia".split()
COLORS = "red blue green black white pink brown gray gold orange".split()
OBJECTS = "ball cup hat box car kite book lamp sock bell".split()
GLUE = "has a an . what color is the ?".split()
SPLITS = {"train": 800, "valid": 100, "test": 100}
DATA_DIR = Path(__file__).parent / "demo_data"
UNPAIRED_DIR = DATA_DIR / "unpaired"  # the same pairs unpaired (TRL's format for KTO)
MARKER = ".flash-cce-demo"

# The base is random, so LoRA has no features to adapt: the demo trains the
# blocks' full weights (embeddings stay frozen). LoRA/DoRA are `--fine-tune-type`.
DEMO_CONFIG = dict(
    fine_tune_type="full",
    num_layers=-1,
    objective="orpo",
    learning_rate=1e-3,
    min_learning_rate=1e-4,
    warmup=10,
    lr_schedule="cosine",  # the schedule the README's and docs/cli.md's demo numbers were measured with
    weight_decay=0.0,
    batch_size=8,
    iters=150,
    steps_per_eval=25,
    save_every=50,
    max_seq_length=64,
    seed=0,
    test=True,
)


def demo_words():
    return NAMES + COLORS + OBJECTS + GLUE


def demo_records(seed=0):
    """{split: [TRL record]}: every (name, color, object) triple once, shuffled."""
    rng = random.Random(seed)
    triples = [(n, c, o) for n in NAMES for c in COLORS for o in OBJECTS]
    rng.shuffle(triples)
    out, start = {}, 0
    for split, count in SPLITS.items():
        recs = []
        for name, color, obj in triples[start:start + count]:
            wrong = rng.choice([c for c in COLORS if c != color])
            article = "an" if color[0] in "aeiou" else "a"
            recs.append(dict(prompt=f"{name} has {article} {color} {obj} . what color is the {obj} ?",
                             chosen=f"{color} .", rejected=f"{wrong} ."))
        out[split] = recs
        start += count
    return out


def unpaired_records(records):
    """Each pair as two unpaired records: the chosen answer desirable, the
    rejected one not (as TRL's unpair_preference_dataset)."""
    return [dict(prompt=r["prompt"], completion=r[side], label=side == "chosen")
            for r in records for side in ("chosen", "rejected")]


def write_demo_data(path, seed=0):
    """The demo's pairs in path/{split}.jsonl and unpaired in path/unpaired/."""
    import json

    path = Path(path)
    (path / "unpaired").mkdir(parents=True, exist_ok=True)
    for split, recs in demo_records(seed).items():
        (path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        (path / "unpaired" / f"{split}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in unpaired_records(recs)))
    return path


def _fresh_run_dir(run_dir, log=print):
    """`run_dir` emptied for a new demo, and its lock, held: taken before
    anything is deleted, so a live run there (a demo resumed with train) is
    left alone."""
    from .rundir import LOCK, Lock, check_lock, check_writable

    run_dir = Path(run_dir).absolute()
    check_writable(run_dir)
    if run_dir.exists() and any(p.name != LOCK for p in run_dir.iterdir()) and not (run_dir / MARKER).exists():
        raise ValueError(f"run_dir: {run_dir} exists and is not a demo directory; pick another --run-dir")
    stale = check_lock(run_dir)  # in use: one line before anything is written
    if stale:
        log(stale)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = Lock(run_dir).acquire()
    try:
        if any(p.name != LOCK for p in run_dir.iterdir()) and not (run_dir / MARKER).exists():
            raise ValueError(f"run_dir: {run_dir} exists and is not a demo directory; pick another --run-dir")
        for p in run_dir.iterdir():
            if p.name == LOCK:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        (run_dir / MARKER).write_text("made by flash-cce demo; rerunning the demo replaces this directory\n")
    except BaseException:
        lock.release()
        raise
    return run_dir, lock


def _answers(model_dir, adapter_path, prompts):
    """Greedy answers to plain-text prompts, as the string records were trained
    (and as `mlx_lm.generate --ignore-chat-template` prompts)."""
    from mlx_lm import generate, load

    model, tok = load(str(model_dir), adapter_path=adapter_path and str(adapter_path))
    return [generate(model, tok, p, max_tokens=4, verbose=False).strip() for p in prompts]


def run_demo(run_dir="flash-cce-demo", iters=None, log=print):
    """Builds the tiny model, trains it on the bundled pairs, prints the held-out
    accuracy curve and before/after answers; returns the validation records."""
    tic = time.perf_counter()
    run_dir, lock = _fresh_run_dir(run_dir, log)
    try:
        return _demo(run_dir, lock, iters, log, tic)
    finally:
        lock.release()


def _demo(run_dir, lock, iters, log, tic):
    from .plot import plot_run
    from .runner import resolve_config, run_train
    from .tiny import build_tiny_model

    model_dir = build_tiny_model(run_dir / "base_model", demo_words(), seed=0)
    cfg = dict(DEMO_CONFIG, model=str(model_dir), data=str(DATA_DIR), run_dir=str(run_dir))
    if iters is not None:
        cfg.update(iters=iters, warmup=min(DEMO_CONFIG["warmup"], iters // 5))
    cfg = resolve_config({}, base=cfg)
    tests = demo_records()["test"][:4]
    prompts = [r["prompt"] for r in tests]
    before = _answers(model_dir, None, prompts)

    evals = []
    run_train(cfg, log=log, on_eval=evals.append, hint=False, own_files=(model_dir.name,), lock=lock)
    after = _answers(model_dir, run_dir / "adapters", prompts)
    png = plot_run(run_dir)

    log("\nHeld-out preference accuracy (validation pairs, unseen triples):")
    log("  " + "  ".join(f"step {r['step']}: {r['rewards/accuracies']:.2f}" for r in evals))
    log("\nGreedy answers before -> after training:")
    for r, b, a in zip(tests, before, after):
        log(f"  {r['prompt']}\n      expected {r['chosen']!r:12} before {b!r:24} after {a!r}")
    log(f"\nRun directory {run_dir}: metrics.jsonl, {png.name}, adapters/, best/, checkpoints/")
    # String records train as plain text, so the command skips the chat template.
    log("Try: " + shlex.join(["mlx_lm.generate", "--model", str(model_dir), "--adapter-path",
                              str(run_dir / "adapters"), "--ignore-chat-template", "--prompt", prompts[0],
                              "--max-tokens", "4"]))
    log(f"Demo finished in {time.perf_counter() - tic:.1f} s")
    return evals
