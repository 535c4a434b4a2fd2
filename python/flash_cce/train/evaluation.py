"""`flash-cce eval`: a model, or a run's adapters, scored as the run computed its validation."""

from pathlib import Path

from .checkpoint import find_checkpoint, run_dir_of
from .identity import read_run_config
from .preflight import RunError, adapter_settings, check_model, encode, load_model, model_ref, read_data
from .rundir import CONFIG
from .runner import objective_config, resolve_config

def eval_settings(flags, config_path=None, path=None):
    """Settings of `flash-cce eval`: a run's config.yaml when `path` is a run,
    its adapters/best or a checkpoint; flags and YAML over it."""
    flags = dict(flags)
    base, adapters = None, None
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise RunError(f"adapter_path: no such directory {str(path)!r}")
        try:
            adapters = find_checkpoint(p)
        except ValueError:
            adapters = p.resolve()
        run = run_dir_of(adapters)
        if run is not None and (run / CONFIG).exists():
            base = read_run_config(run / CONFIG, "adapter_path")
        elif (p / "adapters.safetensors").exists():
            base = adapter_settings(p)
        else:
            raise RunError(f"adapter_path: {str(path)!r} is neither a run, a checkpoint nor an adapter directory")
    if flags.get("model") is not None:
        flags["model"] = model_ref(flags["model"])
    cfg = resolve_config(flags, config_path, base)
    # init_adapters stays: a warm-started DPO/KTO run's reference is its warm start.
    return dict(cfg, resume=None), adapters


def run_eval(cfg, adapters, split, log=print):
    """The objective's metrics of the model (with `adapters`) on `split`, as the run computed them
    (a GRPO run: its reward metrics of completions sampled as its validation samples them)."""
    from .reference import with_reference
    from .trainer import evaluate_pairs

    if cfg["objective"] == "grpo":
        return _run_grpo_eval(cfg, adapters, split, log)
    objective = objective_config(cfg)
    check_model(cfg["model"])
    records = read_data(cfg, (split,))
    model, tokenizer = load_model(cfg)
    pairs = encode(cfg, tokenizer, records, lambda *a: None)[split]
    with_adapters(model, cfg, adapters)
    objective = with_reference(cfg, objective, model, log)
    limit = batch_limit(cfg, split)
    r = evaluate_pairs(model, pairs, objective, cfg["batch_size"], limit)
    n = len(pairs) if limit == -1 else min(len(pairs), limit * cfg["batch_size"])
    log(format_table(cfg, adapters, split, n, r))
    return r


def with_adapters(model, cfg, adapters):
    """`model` as the run trained it: its adapters loaded (or quantized as the run's base was)."""
    from .checkpoint import load_adapters
    from .preflight import quantize_model
    from .trainer import prepare_model

    try:
        if adapters is not None:
            prepare_model(model, cfg["fine_tune_type"], cfg["num_layers"], cfg["lora_parameters"], cfg["quantize"])
            load_adapters(adapters, model, "adapter_path")
        elif cfg["quantize"]:
            quantize_model(model, cfg["quantize"])
    except ValueError as e:
        raise RunError(str(e)) from None


def batch_limit(cfg, split):
    """As many micro-batches as the run's validation (valid) or --test (test) took; -1: all."""
    return {"valid": cfg["val_batches"], "test": cfg["test_batches"]}.get(split, -1) or -1


def format_table(cfg, adapters, split, n, metrics, unit="pairs"):
    rows = [("model", cfg["model"]), ("adapters", str(adapters) if adapters else "none"),
            ("split", f"{split} ({n} {unit})"), ("objective", f"{cfg['objective']} (beta {cfg['beta']:g})")]
    if cfg["quantize"]:
        rows.append(("quantize", f"{cfg['quantize']['bits']} bits, group {cfg['quantize']['group_size']}"))
    for k, v in sorted(metrics.items()):
        rows.append((k, str(int(v)) if k == "tokens" else f"{v:.4f}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _run_grpo_eval(cfg, adapters, split, log=print):
    """`flash-cce eval` of a GRPO run: TRL's reward metrics of `split`'s prompts, sampled with the
    run's settings and its validation's random stream (so `valid` repeats the run's validation of
    these adapters), `val_batches` / `test_batches` micro-batches for valid / test."""
    from .grpo_data import read_prompt_splits
    from .grpo_trainer import Scorer, check_settings, encode_split, evaluate, reward_funcs, sampling
    from .rewards import RewardError

    gcfg = check_settings(cfg)
    check_model(cfg["model"])
    if cfg["data"] is None:
        raise RunError("data: give --data (a directory with the split's JSON Lines of prompts)")
    records = read_prompt_splits(cfg["data"], (split,))
    if not records.get(split):
        raise RunError(f"split: needs a non-empty {split}.jsonl in {cfg['data']}")
    funcs = reward_funcs(cfg, gcfg)
    model, tokenizer = load_model(cfg)
    prompts, _ = encode_split(records[split], tokenizer, cfg)
    if not len(prompts):
        raise RunError(f"split: every prompt of {split}.jsonl is too long for max_seq_length {cfg['max_seq_length']}")
    with_adapters(model, cfg, adapters)
    scorer = Scorer.of(tokenizer, funcs, cfg)
    limit = batch_limit(cfg, split)
    try:
        r = evaluate(model, prompts, gcfg, sampling(cfg), sorted(tokenizer.eos_token_ids), scorer, cfg["seed"],
                     cfg["batch_size"], limit, cfg["iters"])
    except RewardError as e:
        raise RunError(str(e)) from None
    n = len(prompts) if limit == -1 else min(len(prompts), limit * cfg["batch_size"])
    log(format_table(cfg, adapters, split, n, r, unit="prompts"))
    return r
