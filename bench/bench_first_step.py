"""A training run's first steps on a machine whose MLX kernel cache is empty,
through `flash-cce train` as a user runs it:

    python bench/bench_first_step.py --model B4 --tokens 8192 --compiled auto false true

Builds a bench model (`bench_orpo`'s A4 or B4, random weights, 4-bit) as an
mlx-lm model directory with a word-level tokenizer, and ORPO pairs of
`--tokens` tokens (chosen + rejected) whose prompts change length from pair to
pair (`--vary`), then runs `--steps` steps per `compiled_layers` setting, each
in a process of its own with an empty kernel cache (`MLX_PTX_CACHE_DIR`), and
reads the steps' times from the run's metrics.jsonl. Prints a table (first
step, the median of the steps after the first and of the last quarter, and for
`auto` the step from which the compiled layers ran) and writes JSON.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_orpo import FULL_MODELS, SMALL_MODELS  # noqa: E402

WORDS = [f"w{i}" for i in range(2000)]


def build_model(path, name, small):
    """The bench model `name` as an mlx-lm directory (4-bit if the bench's is)."""
    from mlx_lm.models import gemma3_text, gemma4_text
    from mlx_lm.utils import save_config, save_model

    from flash_cce.train.tiny import _write_tokenizer

    import mlx.nn as nn

    kind, overrides, bits = (SMALL_MODELS if small else FULL_MODELS)[name]
    path.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(path, WORDS)
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(dict(tok_cfg, model_max_length=1 << 20)))
    config = dict(model_type=kind, bos_token_id=1, eos_token_id=2, **overrides)
    module = gemma3_text if kind == "gemma3_text" else gemma4_text
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    if kind == "gemma3_text":
        model.sanitize({})
    model.set_dtype(mx.bfloat16)
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
        config["quantization"] = {"group_size": 64, "bits": bits}
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(config, path / "config.json")
    return path


def write_data(path, tokens, count, vary, seed=0):
    """`count` pairs of `tokens` tokens (both sides), prompts shorter by `vary`
    words from one pair to the next (cycling through 16 lengths)."""
    rng = np.random.default_rng(seed)
    side = tokens // 2 - 1  # the tokenizer's BOS

    def words(n):
        return " ".join(rng.choice(WORDS, n))

    path.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", count), ("valid", 2)):
        with open(path / f"{split}.jsonl", "w") as f:
            for i in range(n):
                p = side // 2 - vary * (i % 16)
                f.write(json.dumps(dict(prompt=words(p), chosen=words(side - p), rejected=words(side - p))) + "\n")


def run(model, data, run_dir, steps, tokens, compiled, cache, log):
    argv = [sys.executable, "-m", "flash_cce.train.cli", "train", "--model", str(model), "--data", str(data),
            "--run-dir", str(run_dir), "--iters", str(steps), "--batch-size", "1", "--val-batches", "0",
            "--save-every", "0", "--no-progress", "--lr-schedule", "constant", "--steps-per-report", "1",
            "--max-seq-length", str(tokens // 2), "--num-layers", "-1", "--compiled-layers", compiled]
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(cache))
    tic = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - tic
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"compiled_layers={compiled}: exit {proc.returncode}, see {log}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time"] * 1000 for r in records if r["split"] == "train"]
    peaks = [r["peak_memory_gb"] for r in records if r["split"] == "train"]
    ready = next((line for line in proc.stdout.splitlines() if "kernels ready after" in line), None)
    switch = None
    if ready is not None:  # the first step reported after that line
        after = proc.stdout[proc.stdout.index(ready):]
        step_lines = [line for line in after.splitlines() if line.startswith("step ")]
        switch = int(step_lines[0].split()[1].split("/")[0].rstrip(":")) if step_lines else None
    tail = times[-max(1, len(times) // 4):]
    return dict(compiled_layers=compiled, first_ms=times[0], median_ms=statistics.median(times[1:]),
                last_quarter_ms=statistics.median(tail), peak_gb=max(peaks), switch_step=switch,
                ready_line=ready, wall_s=wall, times_ms=times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="B4", choices=("A4", "B4"))
    ap.add_argument("--small", action="store_true", help="the bench's small models (a CPU)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per pair (chosen + rejected)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--vary", type=int, default=8, help="prompt words fewer per pair (0: one shape)")
    ap.add_argument("--compiled", nargs="+", default=["auto", "false", "true"])
    ap.add_argument("--cache", default=None, help="MLX kernel cache of every run, kept (default: an empty one per run)")
    ap.add_argument("--work", default=None, help="directory for the model, data and runs (default: a temporary one)")
    ap.add_argument("--json", default="bench_first_step.json")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-first-step-"))
    model = work / f"model-{args.model}"
    if not (model / "config.json").exists():
        build_model(model, args.model, args.small)
    data = work / f"data-{args.tokens}"
    write_data(data, args.tokens, args.steps, args.vary)
    rows = []
    for compiled in args.compiled:
        run_dir = work / f"run-{compiled}"
        shutil.rmtree(run_dir, ignore_errors=True)
        cache = Path(args.cache) if args.cache else work / f"ptx-{compiled}"
        if not args.cache:
            shutil.rmtree(cache, ignore_errors=True)
        rows.append(run(model, data, run_dir, args.steps, args.tokens, compiled, cache, work / f"log-{compiled}.txt"))
        r = rows[-1]
        print(f"{args.model} {args.tokens} compiled_layers={compiled}: first {r['first_ms']:.0f} ms, "
              f"median {r['median_ms']:.0f} ms, last quarter {r['last_quarter_ms']:.0f} ms, "
              f"peak {r['peak_gb']:.2f} GB, compiled from step {r['switch_step']}, wall {r['wall_s']:.0f} s",
              flush=True)
    print("\n| model | tokens | compiled_layers | first step ms | median ms | last quarter ms | peak GB | compiled from |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {args.model} | {args.tokens} | {r['compiled_layers']} | {r['first_ms']:.0f} | {r['median_ms']:.0f} | "
              f"{r['last_quarter_ms']:.0f} | {r['peak_gb']:.2f} | {r['switch_step'] or '-'} |")
    meta = dict(model=args.model, tokens=args.tokens, steps=args.steps, vary=args.vary, warm_cache=bool(args.cache),
                mlx=mx.__version__,
                device=str(mx.default_device()), date=time.strftime("%Y-%m-%d"))
    Path(args.json).write_text(json.dumps(dict(meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
