"""`flash-cce`: train, eval, plot and demo sub-commands.

Settings come from flags > `--config` YAML > CONFIG_DEFAULTS, as in `mlx_lm.lora`;
YAML keys are the flags' names with underscores.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import yaml

CONFIG_DEFAULTS = {
    "model": None,
    "data": None,
    "run_dir": "run",
    "resume": None,
    "fine_tune_type": "lora",
    "num_layers": 16,
    "lora_parameters": {"rank": 8, "scale": 20.0, "dropout": 0.0},
    "quantize": None,
    "objective": "orpo",
    "beta": 0.1,
    "gamma": 0.5,
    "loss_type": None,
    "label_smoothing": 0.0,
    "cpo_alpha": 1.0,
    "desirable_weight": 1.0,
    "undesirable_weight": 1.0,
    "pref_weight": 1.0,
    "adaptive_weight": False,
    "controller": {},
    "nll_on_prompt": True,
    "prefix_sharing": True,
    "flash_head": True,
    "segment_size": None,
    "compiled_layers": False,
    "pad_to": "auto",
    "attention_block": None,
    "learning_rate": 1e-5,
    "min_learning_rate": 0.0,
    "lr_schedule": "cosine",
    "warmup": 0,
    "weight_decay": 0.01,
    "batch_size": 4,
    "grad_accumulation_steps": 1,
    "max_grad_norm": 1.0,
    "iters": 1000,
    "steps_per_eval": 100,
    "val_batches": -1,
    "save_every": 100,
    "keep_checkpoints": 2,
    "max_seq_length": 2048,
    "truncation": "keep_end",
    "chat_template": "auto",
    "enable_thinking": None,
    "seed": 0,
    "test": False,
    "trust_remote_code": False,
    "progress": True,
}

# Flags that set one field of a nested YAML table.
NESTED_FLAGS = {
    "lora_rank": ("lora_parameters", "rank"),
    "lora_scale": ("lora_parameters", "scale"),
    "lora_dropout": ("lora_parameters", "dropout"),
    "quantize_bits": ("quantize", "bits"),
    "quantize_group_size": ("quantize", "group_size"),
    **{f"controller_{k}": ("controller", k) for k in (
        "law", "kp", "ki", "kd", "target", "tolerance", "target_steps", "min_weight",
        "max_weight", "max_change")},
}


# The objectives' names, as in flash_cce.losses (kept here so --help imports no MLX).
OBJECTIVE_NAMES = ("orpo", "simpo", "orpo_margin", "dpo", "cpo", "kto", "sft")


def _flag(p, name, **kw):
    p.add_argument("--" + name.replace("_", "-"), dest=name, default=None, **kw)


def _switch(p, name, help):
    p.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                   action=argparse.BooleanOptionalAction, help=help)


def _bool_or_auto(v):
    low = v.lower()
    if low in ("auto", "true", "false"):
        return {"auto": "auto", "true": True, "false": False}[low]
    raise argparse.ArgumentTypeError(f"expected auto, true or false, got {v!r}")


def _int_or_auto(v):
    if v.lower() == "auto":
        return "auto"
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or an integer, got {v!r}") from None


# pad_to "auto": on a CUDA GPU, widths in multiples of 64, so that steps repeat
# the shapes of earlier ones: a new shape costs MLX's CUDA backend time.
# One H200, bench/bench_orpo.py --vary-prompt 8 (a new prompt length every step),
# model A 4-bit: 799 -> 389 ms at 1k tokens, 1050 -> 732 at 4k (README).
AUTO_PAD = 64


def _on_cuda():
    import mlx.core as mx

    return hasattr(mx, "cuda") and mx.cuda.is_available()


def _pad_to(value):
    """ObjectiveConfig's pad_to for the setting `value` (auto, 0 or a multiple)."""
    if value == "auto":
        return AUTO_PAD if _on_cuda() else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"pad_to: expected auto, 0 or a positive integer, got {value!r}")
    return value or None


def _add_model_data_flags(p):
    p.add_argument("-c", "--config", default=None, help="YAML file with any of the settings below.")
    _flag(p, "model", help="Local mlx-lm model directory (or a Hugging Face id when online).")
    _flag(p, "data", help="Directory with train.jsonl, valid.jsonl (and test.jsonl) in TRL's preference format.")
    _flag(p, "objective", choices=list(OBJECTIVE_NAMES),
          help="kto reads unpaired data (prompt, completion, label); the others pairs.")
    _flag(p, "beta", type=float, help="Objective strength (ORPO's lambda, SimPO/DPO/CPO/KTO's beta).")
    _flag(p, "gamma", type=float, help="Target margin of simpo / orpo_margin / cpo's simpo loss.")
    _flag(p, "loss_type", help="TRL's loss_type of dpo, cpo or kto (docs/objectives.md).")
    _flag(p, "label_smoothing", type=float, help="Label noise of dpo's robust and cpo's sigmoid/simpo losses, in [0, 0.5).")
    _flag(p, "cpo_alpha", type=float, help="Weight of cpo's chosen-response NLL.")
    _flag(p, "desirable_weight", type=float, help="kto's weight of desirable examples.")
    _flag(p, "undesirable_weight", type=float, help="kto's weight of undesirable examples.")
    _switch(p, "nll_on_prompt", "ORPO/SFT NLL over prompt and response (TRL's default) or the response only.")
    _switch(p, "prefix_sharing", "Encode each prompt once for both responses.")
    _switch(p, "flash_head", "Log-probs from the flash-CCE head (no [tokens, vocab] logits).")
    _flag(p, "segment_size", type=int, help="Layers per gradient-checkpoint segment (0: off; default: by length).")
    _switch(p, "compiled_layers", "Gradients layer by layer through compiled layers where supported (see flash_cce.compiled).")
    _flag(p, "pad_to", type=_int_or_auto,
          help="Round sequence widths up, and the shared prompt down, to a multiple (exact), so that steps share shapes (0: off; auto: 64 on a CUDA GPU, else off).")
    _flag(p, "attention_block", type=int, help="Queries per block of the training attention (0: mlx-lm's attention).")
    _flag(p, "batch_size", type=int, help="Pairs per micro-batch.")
    _flag(p, "max_seq_length", type=int, help="Longest sequence (tokens) of a pair's chosen or rejected side.")
    _flag(p, "truncation", choices=["keep_end", "keep_start", "drop", "error"],
          help="Over-long pairs: cut the prompt's start (keep_end), cut the response's end (keep_start), drop or error.")
    _flag(p, "chat_template", type=_bool_or_auto,
          help="auto: template for chat-message records; true: also for strings; false: never.")
    _switch(p, "enable_thinking", "Passed to the chat template (Qwen3-style thinking switch).")
    _switch(p, "trust_remote_code", "Trust remote code when loading the tokenizer/model.")


def build_parser():
    parser = argparse.ArgumentParser(prog="flash-cce", description="Preference fine-tuning of mlx-lm models with a flash-CCE head.")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="Fine-tune a model on preference pairs.")
    _add_model_data_flags(t)
    _flag(t, "run_dir", help="Output directory: metrics.jsonl, checkpoints, adapters, best, plot.png.")
    _flag(t, "resume", help="Run or checkpoint directory to continue from exactly.")
    _flag(t, "fine_tune_type", choices=["lora", "dora", "full"])
    _flag(t, "num_layers", type=int, help="Fine-tuned blocks, counted from the last (-1: all).")
    _flag(t, "lora_rank", type=int)
    _flag(t, "lora_scale", type=float)
    _flag(t, "lora_dropout", type=float)
    _flag(t, "quantize_bits", type=int, help="Quantize a dense base to this many bits first (QLoRA).")
    _flag(t, "quantize_group_size", type=int)
    _flag(t, "pref_weight", type=float, help="Weight of the preference term of orpo / orpo_margin / cpo (the controller's start).")
    _switch(t, "adaptive_weight", "Adjust pref_weight each step to hold the chosen NLL near a target (see flash_cce.controller).")
    _flag(t, "controller_law", choices=["p", "pd", "pid"])
    for name, kind, text in (
            ("kp", float, "Proportional gain (weight per nat of NLL error)."),
            ("ki", float, "Integral gain."), ("kd", float, "Derivative gain."),
            ("target", float, "NLL to hold (default: the initial NLL times 1 + tolerance)."),
            ("tolerance", float, "Target above the initial NLL, as a fraction."),
            ("target_steps", int, "Steps whose mean NLL is the initial NLL."),
            ("min_weight", float, "Lowest preference weight."), ("max_weight", float, "Highest preference weight."),
            ("max_change", float, "Most the weight moves in one step.")):
        _flag(t, f"controller_{name}", type=kind, help=text)
    _flag(t, "learning_rate", type=float, help="Peak AdamW learning rate.")
    _flag(t, "min_learning_rate", type=float, help="Learning rate at the end of the cosine decay.")
    _flag(t, "lr_schedule", choices=["cosine", "constant"])
    _flag(t, "warmup", type=int, help="Linear warmup steps from 0.")
    _flag(t, "weight_decay", type=float)
    _flag(t, "grad_accumulation_steps", type=int)
    _flag(t, "max_grad_norm", type=float, help="Gradient clipping threshold (global norm).")
    _flag(t, "iters", type=int, help="Optimizer steps.")
    _flag(t, "steps_per_eval", type=int)
    _flag(t, "val_batches", type=int, help="Validation micro-batches per evaluation (-1: all).")
    _flag(t, "save_every", type=int, help="Steps between checkpoints.")
    _flag(t, "keep_checkpoints", type=int, help="Newest checkpoints kept besides the best.")
    _flag(t, "seed", type=int)
    _switch(t, "test", "Evaluate on test.jsonl after training.")
    _switch(t, "progress", "Show a progress bar.")

    e = sub.add_parser("eval", help="Objective loss and preference accuracy of a model (and adapters) on a split.")
    _add_model_data_flags(e)
    e.add_argument("--adapter-path", default=None, help="Adapters to apply (a run's adapters or best).")
    e.add_argument("--split", default="test", choices=["train", "valid", "test"])

    p = sub.add_parser("plot", help="PNG of a run's curves.")
    p.add_argument("run_dir")
    p.add_argument("--output", default=None, help="PNG path (default RUN_DIR/plot.png).")

    d = sub.add_parser("demo", help="Train a tiny model offline and watch preference accuracy rise.")
    d.add_argument("--run-dir", default="flash-cce-demo")
    d.add_argument("--iters", type=int, default=None)
    return parser


def resolve_config(flags, config_path=None, base=None):
    """Settings: `flags` (None = unset) > YAML at `config_path` > `base` > defaults."""
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in CONFIG_DEFAULTS.items()}
    layers = [base or {}]
    if config_path:
        with open(config_path) as f:
            loaded = yaml.safe_load(f) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config: {config_path} must hold a YAML mapping of settings")
        layers.append(loaded)
    for layer in layers:
        for k, v in layer.items():
            if k not in CONFIG_DEFAULTS:
                raise ValueError(f"config: unknown key {k!r} (known: {', '.join(sorted(CONFIG_DEFAULTS))})")
            cfg[k] = v
    for k, v in flags.items():
        if v is None:
            continue
        if k in NESTED_FLAGS:
            table, field = NESTED_FLAGS[k]
            cfg[table] = dict(cfg[table] or {}, **{field: v})
        elif k in CONFIG_DEFAULTS:
            cfg[k] = v
    return cfg


def _objective(cfg):
    from .objectives import ObjectiveConfig

    obj = ObjectiveConfig(name=cfg["objective"], beta=cfg["beta"], gamma=cfg["gamma"],
                          loss_type=cfg["loss_type"], label_smoothing=cfg["label_smoothing"],
                          cpo_alpha=cfg["cpo_alpha"], desirable_weight=cfg["desirable_weight"],
                          undesirable_weight=cfg["undesirable_weight"], pref_weight=cfg["pref_weight"],
                          nll_on_prompt=cfg["nll_on_prompt"], prefix_sharing=cfg["prefix_sharing"],
                          flash_head=cfg["flash_head"], segment_size=cfg["segment_size"],
                          compiled_layers=cfg["compiled_layers"], pad_to=_pad_to(cfg["pad_to"]),
                          attention_block=cfg["attention_block"])
    obj.validate()
    return obj


def _load_model(cfg, adapter_path=None):
    from mlx_lm.utils import load

    if not cfg["model"]:
        raise ValueError("model: give --model (a local mlx-lm model directory or a Hugging Face id)")
    trust = bool(cfg["trust_remote_code"])
    return load(cfg["model"], tokenizer_config={"trust_remote_code": trust},
                adapter_path=adapter_path, trust_remote_code=trust)


def _load_data(cfg, tokenizer, splits, log):
    from .data import format_summary, load_splits

    if not cfg["data"]:
        raise ValueError("data: give --data (a directory with train.jsonl and valid.jsonl)")
    data = load_splits(cfg["data"], tokenizer, splits, max_seq_length=cfg["max_seq_length"],
                       truncation=cfg["truncation"], chat_template=cfg["chat_template"],
                       enable_thinking=cfg["enable_thinking"], unpaired=cfg["objective"] == "kto")
    for name, (pairs, report) in data.items():
        log(format_summary(name, pairs, report))
    return {k: v[0] for k, v in data.items()}


def _run_dir_of(resume):
    path = Path(resume)
    return path.parent.parent if path.parent.name == "checkpoints" else path


def run_train(cfg, log=print, on_eval=None):
    """Trains with resolved settings `cfg`; returns (run_dir, last validation record)."""
    import mlx.core as mx
    import mlx.optimizers as optim

    from .controller import for_objective
    from .trainer import TrainingArgs, build_schedule, prepare_model, train, trainable_summary

    rank = mx.distributed.init().rank()
    if rank != 0:  # one voice and one writer: rank 0
        log = lambda *a, **k: None  # noqa: E731
    run_dir = Path(cfg["run_dir"])
    objective = _objective(cfg)
    controller = for_objective(objective, cfg["controller"]) if cfg["adaptive_weight"] else None
    args = TrainingArgs(batch_size=cfg["batch_size"], iters=cfg["iters"],
                        grad_accumulation_steps=cfg["grad_accumulation_steps"],
                        max_grad_norm=cfg["max_grad_norm"], steps_per_eval=cfg["steps_per_eval"],
                        val_batches=cfg["val_batches"], save_every=cfg["save_every"],
                        keep_checkpoints=cfg["keep_checkpoints"], seed=cfg["seed"],
                        progress=cfg["progress"] and rank == 0)
    args.validate()
    schedule = build_schedule(cfg["learning_rate"], cfg["iters"], cfg["warmup"], cfg["lr_schedule"],
                              cfg["min_learning_rate"])
    log(f"Loading model {cfg['model']}")
    model, tokenizer = _load_model(cfg)
    splits = _load_data(cfg, tokenizer, ("train", "valid", "test") if cfg["test"] else ("train", "valid"), log)
    if "train" not in splits:
        raise ValueError(f"data: {cfg['data']} has no train.jsonl")
    mx.random.seed(cfg["seed"])  # LoRA's initial weights
    prepare_model(model, cfg["fine_tune_type"], cfg["num_layers"], cfg["lora_parameters"], cfg["quantize"])
    log(trainable_summary(model))
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=cfg["weight_decay"])
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "config.yaml", "w") as f:
            yaml.safe_dump(cfg, f, sort_keys=True)
    last = train(model, optimizer, splits["train"], splits.get("valid"), args, objective,
                 controller=controller,
                 run_dir=run_dir, adapter_config=cfg, resume=cfg["resume"], on_eval=on_eval, log=log)
    if cfg["test"] and splits.get("test"):
        from .trainer import evaluate_pairs

        r = evaluate_pairs(model, splits["test"], objective, cfg["batch_size"])
        log(f"test: loss {r['loss']:.4f}, accuracy {r.get('rewards/accuracies', float('nan')):.3f}")
    log(f"Run directory: {run_dir} (adapters: {run_dir / 'adapters'}, best: {run_dir / 'best'})")
    return run_dir, last


def run_eval(cfg, adapter_path, split, log=print):
    from .trainer import evaluate_pairs

    model, tokenizer = _load_model(cfg, adapter_path)
    pairs = _load_data(cfg, tokenizer, (split,), log).get(split)
    if not pairs:
        raise ValueError(f"data: {cfg['data']} has no {split}.jsonl")
    r = evaluate_pairs(model, pairs, _objective(cfg), cfg["batch_size"])
    log(" ".join(f"{k}={v:.4f}" for k, v in sorted(r.items())))
    return r


# MLX_MAX_MB_PER_BUFFER for training on NVIDIA GPUs: MLX frees a kernel's inputs
# only once its CUDA graph has run, so smaller graphs lower the peak. One H200,
# bench/bench_orpo.py, 8k-token pair: model B 18.5 -> 11.8 GB and 1495 -> 1360 ms,
# model A 14.9 -> 8.2 GB and 1136 -> 1212 ms (README).
GRAPH_MB = "300"


def _restart_with_graph_limit(argv):
    """Runs this command again with `GRAPH_MB` unless MLX_MAX_MB_PER_BUFFER is set
    or there is no CUDA GPU. MLX reads it when it creates its GPU stream, at
    import, hence the restart (once: the new process has it set)."""
    if "MLX_MAX_MB_PER_BUFFER" in os.environ or not _on_cuda():
        return
    os.environ["MLX_MAX_MB_PER_BUFFER"] = GRAPH_MB
    os.execv(sys.executable, [sys.executable, "-m", "flash_cce.cli", *argv])


def main(argv=None):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.command in ("train", "eval"):
        _restart_with_graph_limit(argv)
    try:
        if args.command == "plot":
            from .plot import plot_run

            print(plot_run(args.run_dir, args.output))
            return 0
        if args.command == "demo":
            from .demo import run_demo

            run_demo(args.run_dir, iters=args.iters)
            return 0
        flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
        base = None
        if args.command == "train" and flags.get("resume") and not args.config:
            saved = _run_dir_of(flags["resume"]) / "config.yaml"
            if saved.exists():
                with open(saved) as f:
                    base = yaml.safe_load(f)
        cfg = resolve_config(flags, args.config, base)
        if args.command == "train":
            if flags.get("resume") and flags.get("run_dir") is None:
                cfg["run_dir"] = str(_run_dir_of(flags["resume"]))
            tic = time.perf_counter()
            run_train(cfg)
            print(f"Done in {time.perf_counter() - tic:.1f} s")
        else:
            run_eval(cfg, args.adapter_path, args.split)
        return 0
    except ValueError as e:
        print(f"flash-cce {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
