"""`flash-cce train --objective grpo`: online RL on the device.

Each generation samples G completions of a batch of prompts with the current
policy (`rollout`), scores them with the reward functions (`rewards`) and
trains on them with TRL's GRPO objective (`grpo.grpo_value_and_grad`). The
schedule is TRL's: a generation holds `batch_size` prompts (groups) per
micro-batch for `steps_per_generation` micro-batches (default
`grad_accumulation_steps`) and serves `num_iterations` passes over them; an
optimizer step sums `grad_accumulation_steps` micro-batches. Where a
generation serves more than one optimizer step, the sampler's log-probs are
the behaviour ("old") log-probs, and the generation is kept in the checkpoint
so that a resumed run continues it exactly.

The run is as safe as a preference run: every check before anything is written
(settings, model, data, reward functions called once on a training prompt), the
run directory's lock, exact resume (weights, optimizer, data order, the
sampler's random state), a checkpoint on Ctrl-C, the non-finite guard
(`guard.Guard`), validation as the mean reward
on valid.jsonl's prompts (the best checkpoint: the highest), and adapters in
mlx-lm's format. Under `mlx.launch` each rank takes every world-th group of a
generation and the whole generation's advantages (`share`).
"""

import json
import time

import numpy as np
from dataclasses import asdict, fields
from pathlib import Path

from .notice import SlowStart
from .preflight import RunError
from .rollout import RolloutRng, SamplingSettings

TRAIN_STREAM, VALID_STREAM = 0, 1  # the sampler's random streams


def grpo_config(cfg):
    """The GRPOConfig of the settings `cfg` (its fields are settings of the same names)."""
    from .grpo_config import GRPOConfig

    names = {f.name for f in fields(GRPOConfig)}
    given = {k: cfg[k] for k in names if k in cfg}
    given["gradient_accumulation_steps"] = cfg["grad_accumulation_steps"]
    given["loss_type"] = cfg["loss_type"] or "dapo"
    try:
        return GRPOConfig(**given).validate()
    except ValueError as e:
        raise RunError(str(e)) from None


def sampling(cfg):
    return SamplingSettings(max_completion_length=cfg["max_completion_length"], temperature=cfg["temperature"],
                            top_p=cfg["top_p"], top_k=cfg["top_k"], min_p=cfg["min_p"] or 0.0,
                            repetition_penalty=cfg["repetition_penalty"])


def stack_config(cfg):
    from ..stack import StackConfig
    from .runner import pad_to

    return StackConfig(pad_to=pad_to(cfg["pad_to"]),
                       compiled_layers=None if cfg["compiled_layers"] == "auto" else cfg["compiled_layers"],
                       **{k: cfg[k] for k in ("prefix_sharing", "flash_head", "segment_size", "attention_block")})


def check_settings(cfg):
    """RunError for settings grpo cannot use (before anything is written)."""
    if cfg["loss_type"] is not None and cfg["loss_type"] not in _loss_types():
        raise RunError(f"loss_type: got {cfg['loss_type']}; allowed for grpo: {', '.join(_loss_types())}")
    if not cfg["reward_funcs"]:
        raise RunError("reward_funcs: give at least one --reward (module:function, file.py:function or a "
                       "built-in: exact_match, format, length)")
    if cfg["max_seq_length"] <= cfg["max_completion_length"]:
        raise RunError(f"max_seq_length: got {cfg['max_seq_length']}; allowed for grpo: more than "
                       f"max_completion_length ({cfg['max_completion_length']}), to leave room for the prompt")
    for key in ("precompute_ref_log_probs", "adaptive_weight", "gpu_capture"):
        if cfg[key]:
            raise RunError(f"{key}: not available with objective grpo")
    return grpo_config(cfg)


def _loss_types():
    from .grpo_config import LOSS_TYPES

    return LOSS_TYPES


class Scorer:
    """Decodes a generation's completions and scores them with the reward functions."""

    def __init__(self, tokenizer, funcs, names, max_steps):
        self.tokenizer, self.funcs, self.names, self.max_steps = tokenizer, funcs, names, max_steps

    @classmethod
    def of(cls, tokenizer, funcs, cfg):
        """The run's scorer: the functions under their names, `iters` as TRL's max_steps."""
        from .rewards import reward_name

        return cls(tokenizer, funcs, [reward_name(f) for f in funcs], cfg["iters"])

    def __call__(self, prompts, idx, completions, step):
        """rewards[group][generation][function] (None: skipped) of `completions` of prompts `idx`."""
        from .rewards import TrainerState, as_completions, call_reward

        G = len(completions[0])
        rep = [i for i in idx for _ in range(G)]
        ids = [c for cs in completions for c in cs]
        texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in ids]
        given = [prompts.records[i]["prompt"] for i in rep]
        cols = prompts.columns(rep)
        where = [prompts.where[i] for i in rep]
        state = TrainerState(global_step=step, max_steps=self.max_steps)
        table = [call_reward(f, given, as_completions(given, texts), ids, cols, where, state) for f in self.funcs]
        flat = [[None if v != v else v for v in row] for row in zip(*table)]  # NaN (skipped) -> None
        return [flat[g * G:(g + 1) * G] for g in range(len(idx))]


def generate(model, prompts, idx, gcfg, sample, eos, rng, scorer, step, keep_logps, group_ids=None):
    """The Rollouts of prompts `idx` (G completions each, scored); `group_ids`:
    their places in the generation batch (data-parallel ranks sample parts of it)."""
    from .grpo_rollouts import Rollouts
    from .rollout import rollout

    r = rollout(model, [prompts.ids[i] for i in idx], gcfg.num_generations, sample, eos, rng, group_ids)
    rewards = scorer(prompts, idx, r.completions, step)
    old = [[lp.tolist() for lp in lps] for lps in r.logprobs] if keep_logps else None
    return Rollouts(r.prompts, r.completions, rewards, list(scorer.names), r.truncated, old_logps=old)


def evaluate(model, prompts, gcfg, sample, eos, scorer, seed, batch_size, num_batches, step):
    """Mean reward metrics over the validation prompts (same sampler settings, a
    validation random stream that every evaluation repeats)."""
    from .grpo_rollouts import advantages, completion_metrics

    rng = RolloutRng(seed, stream=VALID_STREAM)
    starts = list(range(0, len(prompts), batch_size))
    if num_batches != -1:
        starts = starts[:num_batches]
    sums, total = {}, 0
    for s in starts:
        idx = list(range(s, min(s + batch_size, len(prompts))))
        r = generate(model, prompts, idx, gcfg, sample, eos, rng, scorer, step, False)
        metrics = dict(advantages(r, gcfg)[1], **completion_metrics(r))
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v * len(idx)
        total += len(idx)
    return {k: v / total for k, v in sums.items()}


def share(model, prompts, idx, gcfg, sample, eos, rng, scorer, step, keep_logps, world):
    """This rank's part of the generation of prompts `idx`: every world-th group,
    sampled as one process samples it, carrying the advantages and the loss-token
    count of the whole generation (TRL's gathered rewards and num_items_in_batch)."""
    import mlx.core as mx

    from .grpo_rollouts import loss_mask_counts, reward_table

    rank, size = world.rank(), world.size()
    mine = generate(model, prompts, idx[rank::size], gcfg, sample, eos, rng, scorer, step, keep_logps,
                    range(rank, len(idx), size))
    if size == 1:
        return mine
    G, n = gcfg.num_generations, len(mine.prompts)
    table = np.concatenate([reward_table(mine), mine.lengths()[:, None], mine.flat_truncated()[:, None]], axis=1)
    every = np.array(mx.distributed.all_gather(mx.array(table.astype(np.float32)), group=world))
    every = every.reshape(size, n, G, -1).transpose(1, 0, 2, 3).reshape(len(idx) * G, -1)  # in group order
    whole = _Gathered(every[:, :-2], every[:, -2], every[:, -1], mine.reward_names)
    adv = generation_advantages(whole, gcfg)[0].reshape(len(idx), G)[rank::size]
    items = mx.distributed.all_sum(mx.array(int(loss_mask_counts(mine, gcfg).sum())), group=world).item()
    mine.advantages, mine.num_items_in_batch = adv.tolist(), int(items)
    mine.whole = whole
    return mine


class _Gathered:
    """A whole generation's rewards, lengths and truncation flags: what the
    advantages and TRL's reward and completion metrics read of Rollouts."""

    def __init__(self, rewards, lengths, truncated, reward_names):
        self.rewards = [[None if v != v else float(v) for v in row] for row in rewards.tolist()]
        self.rewards = [[r] for r in self.rewards]  # [completion][1][function]: one group of all
        self._lengths, self._truncated = lengths.astype(np.int64), truncated.astype(bool)
        self.reward_names, self.advantages = reward_names, None

    def lengths(self):
        return self._lengths

    def flat_truncated(self):
        return self._truncated


def generation_advantages(rollouts, gcfg):
    """(advantages, TRL's reward and completion metrics) of a whole generation."""
    from .grpo_rollouts import advantages, completion_metrics

    adv, metrics = advantages(rollouts, gcfg)
    return adv, dict(metrics, **completion_metrics(rollouts))


def _to_json(rollouts):
    return {k: v for k, v in asdict(rollouts).items() if k in ("prompts", "completions", "rewards",
                                                                "reward_names", "truncated", "old_logps")}


def _pending(whole, metrics, world):
    """What a checkpoint keeps of a generation that serves later optimizer steps: one process's
    Rollouts; with several ranks, every rank's part (its groups, the whole generation's advantages
    and loss-token count) gathered in rank order, and TRL's metrics of the whole generation."""
    if world.size() == 1:
        return _to_json(whole)
    part = dict(_to_json(whole), advantages=whole.advantages, num_items_in_batch=whole.num_items_in_batch)
    return {"parts": _gather_json(part, world), "metrics": metrics}


def _resumed_generation(pending, spg, gcfg, world):
    """(micro-batches, metrics) of this rank's part of a checkpoint's pending generation."""
    if "parts" in pending:
        part = _from_json(pending["parts"][world.rank()])
        return part.split(spg, gcfg), pending["metrics"]
    whole = _from_json(pending)
    return whole.split(spg, gcfg), generation_advantages(whole, gcfg)[1]


def _check_pending_ranks(pending, size):
    """RunError unless a resume runs on as many ranks as sampled the checkpoint's pending generation."""
    if pending is None:
        return
    sampled = len(pending["parts"]) if "parts" in pending else 1
    if sampled != size:
        raise RunError(f"resume: the checkpoint holds a generation that {sampled} process(es) sampled for the "
                       f"steps after it; resume it with {sampled} (got {size})")


def _gather_json(obj, world):
    """Every rank's `obj` (JSON-serialisable), in rank order, on every rank."""
    import mlx.core as mx

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8).astype(np.int32)
    sizes = np.array(mx.distributed.all_gather(mx.array([data.size], mx.int32), group=world))
    padded = np.zeros(int(sizes.max()), np.int32)
    padded[:data.size] = data
    every = np.array(mx.distributed.all_gather(mx.array(padded), group=world)).reshape(world.size(), -1)
    return [json.loads(row[:n].astype(np.uint8).tobytes()) for row, n in zip(every, sizes)]


def _from_json(d):
    from .grpo_rollouts import Rollouts

    return Rollouts(**d)


def first_generation(model, tokenizer, prompts, cfg, gcfg, scorer, seed, batch_size, world):
    """(Rollouts, seconds) of a fresh run's first generation: made before the run
    writes anything, so that a reward function that fails on it stops the run clean."""
    from .trainer import batch_indices

    tic = time.perf_counter()
    idx = batch_indices(len(prompts), batch_size * (gcfg.steps_per_generation or gcfg.gradient_accumulation_steps),
                        0, seed)
    rng = RolloutRng(seed, stream=TRAIN_STREAM)
    r = share(model, prompts, idx, gcfg, sampling(cfg), sorted(tokenizer.eos_token_ids), rng, scorer, 0,
              gcfg.needs_old_logps(), world)
    return r, time.perf_counter() - tic


def train_grpo(model, tokenizer, optimizer, train_prompts, valid_prompts, cfg, gcfg, scorer, args, stack,
               reference=None, run_dir=None, resume=None, on_eval=None, log=print, should_stop=None, first=None):
    """Trains `model` with GRPO on `train_prompts` (grpo_data.Prompts); returns
    the last validation record. `first`: `first_generation`'s result (fresh runs)."""
    import mlx.core as mx
    from mlx.utils import tree_map

    from . import checkpoint
    from .checkpoint import Interrupted
    from .grpo import grpo_value_and_grad
    from .guard import Guard
    from .trainer import (GB, MetricsLog, _progress, apply_update, batch_indices, report_step, stop_requested,
                          sum_over_ranks)

    world = mx.distributed.init()
    rank = world.rank()
    writer = rank == 0 and run_dir is not None
    run_dir = Path(run_dir) if run_dir is not None else None
    accum, spg = gcfg.gradient_accumulation_steps, gcfg.steps_per_generation or gcfg.gradient_accumulation_steps
    per_generation = args.batch_size * spg
    sample = sampling(cfg)
    eos = sorted(tokenizer.eos_token_ids)
    state = dict(step=0, micro=0, position=0, best_val=None, best_step=None, seed=args.seed,
                 sampler=RolloutRng(args.seed, stream=TRAIN_STREAM).state(), generation=None,
                 nonfinite_steps=0, finite_checkpoint=None)
    mx.random.seed(args.seed)
    ckpt = None  # the newest checkpoint
    if resume is not None:
        loaded, ckpt = checkpoint.load_checkpoint(resume, model, optimizer)
        loaded.pop("training_args", None)
        state.update(loaded)
        checkpoint.set_rng_state(state.pop("rng"))
        log(f"Resumed from {ckpt} at step {state['step']}")
    rng = RolloutRng.from_state(state["sampler"])
    guard = Guard(state, args.max_nonfinite_steps, run_dir, writer, resumed=resume is not None)
    buffer, generation_metrics = None, {}
    if state["generation"] is not None:
        buffer, generation_metrics = _resumed_generation(state["generation"], spg, gcfg, world)
    log_file = MetricsLog(run_dir / "metrics.jsonl", state["step"] if resume else -1) if writer else None

    def emit(record):
        if log_file is not None:
            log_file.write(record)

    def validate_now(step):
        if not valid_prompts or args.val_batches == 0:
            return None
        tic = time.perf_counter()
        values = evaluate(model, valid_prompts, gcfg, sample, eos, scorer, args.seed, args.batch_size,
                          args.val_batches, step)
        record = dict(split="valid", step=step, eval_time=time.perf_counter() - tic, **values)
        emit(record)
        if on_eval is not None:
            on_eval(record)
        return record

    def save(step, best=False):
        if not writer:
            return None
        trainer_state = dict(state, sampler=rng.state(), rng=checkpoint.rng_state(), training_args=asdict(args))
        return checkpoint.save_checkpoint(run_dir, step, model, optimizer, trainer_state, cfg, best=best,
                                          keep=args.keep_checkpoints, protect=guard.protect())

    with SlowStart("The first validation", log if rank == 0 else None):
        last_eval = validate_now(0) if state["step"] == 0 else None
    model.train()
    bar = _progress(args, state["step"], rank, log)
    slow = SlowStart("The first step", None if rank else bar.write).start()  # stopped after the first step
    try:
        for step in range(state["step"] + 1, args.iters + 1):
            tic = time.perf_counter()
            mx.reset_peak_memory()
            grads, sums, rollout_time, tokens = None, {}, 0.0, 0
            for _ in range(accum):
                if state["micro"] % gcfg.generate_every == 0:
                    t0 = time.perf_counter()
                    idx = batch_indices(len(train_prompts), per_generation, state["position"], args.seed)
                    state["position"] += 1
                    if first is not None:  # made before the run wrote anything, with the same draw
                        (whole, seconds), first = first, None
                        rng.draws += 1
                        t0 -= seconds
                    else:  # TRL's trainer_state.global_step: the optimizer steps done
                        whole = share(model, train_prompts, idx, gcfg, sample, eos, rng, scorer, step - 1,
                                      gcfg.needs_old_logps(), world)
                    buffer = whole.split(spg, gcfg)
                    # TRL logs these over the whole (gathered) generation
                    generation_metrics = generation_advantages(getattr(whole, "whole", whole), gcfg)[1]
                    state["generation"] = (_pending(whole, generation_metrics, world)
                                           if gcfg.generate_every > accum else None)
                    rollout_time += time.perf_counter() - t0
                part = buffer[state["micro"] % spg]
                state["micro"] += 1
                loss, g, metrics = grpo_value_and_grad(model, part, gcfg, reference, stack,
                                                       micro_group=cfg.get("micro_group"))
                grads = g if grads is None else tree_map(mx.add, grads, g)
                mx.eval(grads, loss)
                tokens += int(sum(len(c) for cs in part.completions for c in cs))
                for k, v in dict(metrics, loss=loss.item()).items():
                    sums[k] = sums.get(k, 0.0) + v / accum
            if world.size() > 1:  # TRL: dapo's family sums over the whole batch, the others average
                grads = sum_over_ranks(grads, world)
                if gcfg.loss_type not in ("dapo", "cispo", "vespo"):
                    grads = tree_map(lambda x: x / world.size(), grads)
                sums = _mean_over_ranks(sums, world)
                if gcfg.loss_type in ("dapo", "cispo", "vespo"):  # each rank's loss is its share of the sum
                    sums["loss"] *= world.size()
            sums.update(generation_metrics)
            finite, norm = apply_update(model, optimizer, grads, sums["loss"], args.max_grad_norm, guard, world)
            slow.stop()
            del grads
            state["step"] = step
            elapsed = time.perf_counter() - tic
            record = dict(split="train", step=step, **sums, grad_norm=float(norm.item()),
                          learning_rate=float(optimizer.learning_rate.item()), tokens=tokens,
                          rollout_time=rollout_time, update_time=elapsed - rollout_time, step_time=elapsed,
                          active_memory_gb=mx.get_active_memory() / GB, peak_memory_gb=mx.get_peak_memory() / GB,
                          **guard.record())
            report_step(record, emit, bar, guard, finite, log)
            is_best = False
            if args.steps_per_eval and step % args.steps_per_eval == 0 or step == args.iters:
                last_eval = validate_now(step)
                if last_eval is not None:
                    better = state["best_val"] is None or last_eval["reward"] > state["best_val"]
                    if better and not guard.suspect:  # weights that gave a non-finite loss are never best
                        state["best_val"], state["best_step"], is_best = last_eval["reward"], step, True
                    line = f"step {step}: val reward {last_eval['reward']:.4f}"
                    (bar.write if bar is not None else log)(line)
            stop = stop_requested(should_stop, world)
            due = is_best or (args.save_every and step % args.save_every == 0) or step == args.iters or stop
            if due and not guard.suspect:  # checkpoints hold weights that gave a finite loss last
                ckpt = save(step, best=is_best)
                guard.saved(step, proven=False)  # a reward says nothing of the loss: the next step proves it
            if stop and step < args.iters:
                raise Interrupted(step, ckpt)
        guard.finish(log)
    finally:
        slow.stop(report=False)  # nothing to say unless the first step was cut short
        if bar is not None:
            bar.close()
        if log_file is not None:
            log_file.close()
    return last_eval


def _mean_over_ranks(metrics, world):
    import mlx.core as mx

    keys = sorted(metrics)
    total = mx.distributed.all_sum(mx.array([metrics[k] for k in keys], mx.float32), group=world).tolist()
    return {k: v / world.size() for k, v in zip(keys, total)}


def reward_funcs(cfg, gcfg):
    """The run's reward functions, loaded (a function that cannot load is a RunError), their
    weights set in `gcfg`."""
    from .rewards import RewardError, load_rewards

    try:
        funcs, gcfg.reward_weights = load_rewards(cfg["reward_funcs"], cfg["reward_weights"],
                                                  cfg["max_completion_length"])
    except RewardError as e:
        raise RunError(str(e)) from None
    return funcs


def encode_split(records, tokenizer, cfg):
    """(Prompts, report) of one split's records, each prompt leaving room for a completion."""
    from .grpo_data import encode_prompts

    return encode_prompts(records, tokenizer, cfg["max_seq_length"] - cfg["max_completion_length"],
                          cfg["truncation"], cfg["chat_template"], cfg["enable_thinking"])


def run_grpo(cfg, log=print, on_eval=None, hint=True, own_files=(), lock=None):
    """`runner.run_train` for objective grpo: the same checks before writing, lock and resume;
    `lock`, the run directory's lock when the caller holds it already."""
    import mlx.core as mx
    import mlx.optimizers as optim

    from .checkpoint import Interrupted, check_adapter_shapes, load_adapters, read_adapters
    from .grpo_data import format_prompt_summary, read_prompt_splits
    from .preflight import check_init_adapters, check_model, load_model
    from .reference import reference_source
    from .rewards import RewardError
    from .identity import check_data, data_fingerprint
    from .runner import Stop, _absolute, _check_run_dir, training_args, writing_run
    from .rundir import check_lock
    from .rundir import state as run_dir_state
    from .trainer import build_schedule, prepare_model, trainable_summary

    world = mx.distributed.init()
    rank = world.rank()
    if rank != 0:  # one voice and one writer: rank 0
        log = lambda *a, **k: None  # noqa: E731
    cfg = _absolute(cfg)
    run_dir, resume = Path(cfg["run_dir"]), cfg["resume"]
    if rank == 0:  # the writer; other ranks would see its lock
        _check_run_dir(run_dir, resume, own_files)
        check_lock(run_dir)
        seen = run_dir_state(run_dir)
    gcfg = check_settings(cfg)
    check_model(cfg["model"], cfg["num_layers"])
    if cfg["data"] is None:
        raise RunError("data: give --data (a directory with train.jsonl and valid.jsonl of prompts)")
    splits = ("train", "valid", "test") if cfg["test"] else ("train", "valid")
    records = read_prompt_splits(cfg["data"], splits)
    for split in ("train", "test") if cfg["test"] else ("train",):
        if not records.get(split):
            raise RunError(f"data: needs a non-empty {split}.jsonl in {cfg['data']}")
    if resume is None:
        cfg["data_fingerprint"] = data_fingerprint(cfg["data"], cfg["test"])
    else:
        cfg = check_data(cfg, cfg["data_fingerprint"], Path(resume).name, log)
    check_init_adapters(cfg)
    funcs = reward_funcs(cfg, gcfg)
    args = training_args(cfg, progress=rank == 0)
    schedule = build_schedule(cfg["learning_rate"], cfg["iters"], cfg["warmup"], cfg["lr_schedule"],
                              cfg["min_learning_rate"])
    log(f"Loading model {cfg['model']}")
    model, tokenizer = load_model(cfg)
    prompts = {}
    for split, recs in records.items():
        prompts[split], report = encode_split(recs, tokenizer, cfg)
        log(format_prompt_summary(split, prompts[split], report))
    need = cfg["batch_size"] * (gcfg.steps_per_generation or gcfg.gradient_accumulation_steps)
    if need % world.size():
        raise RunError(f"batch_size: got {cfg['batch_size']}; allowed: batch_size x steps_per_generation ({need}) "
                       f"divisible by the {world.size()} ranks")
    if len(prompts["train"]) < need:
        raise RunError(f"batch_size: got {cfg['batch_size']}; allowed: batch_size x steps_per_generation ({need}) "
                       f"at most the {len(prompts['train'])} usable training prompts")
    scorer = Scorer.of(tokenizer, funcs, cfg)
    mx.random.seed(cfg["seed"])  # LoRA's initial weights
    try:
        prepare_model(model, cfg["fine_tune_type"], cfg["num_layers"], cfg["lora_parameters"], cfg["quantize"])
    except ValueError as e:
        raise RunError(str(e)) from None
    if cfg["init_adapters"] is not None:
        load_adapters(cfg["init_adapters"], model, "init_adapters")
        log(f"Starting from the adapters in {cfg['init_adapters']} (fresh optimizer)")
    if resume is not None:
        check_adapter_shapes(read_adapters(resume, "resume"), model, "resume")
    log(trainable_summary(model))
    reference = reference_source(cfg, log) if gcfg.beta != 0.0 else None
    first = None
    if resume is None:
        try:
            with SlowStart("The first generation", log if rank == 0 else None):
                first = first_generation(model, tokenizer, prompts["train"], cfg, gcfg, scorer, cfg["seed"],
                                         cfg["batch_size"], world)
        except RewardError as e:
            raise RunError(str(e)) from None
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=cfg["weight_decay"])

    saved = json.loads((Path(resume) / "trainer_state.json").read_text()) if resume is not None else None
    if saved is not None:
        _check_pending_ranks(saved.get("generation"), world.size())
    with writing_run(run_dir, cfg, resume, saved, own_files, seen if rank == 0 else None, lock, rank, log):
        with Stop(log) as stop:
            try:
                last = train_grpo(model, tokenizer, optimizer, prompts["train"], prompts.get("valid"), cfg, gcfg,
                                  scorer, args, stack_config(cfg), reference, run_dir, resume, on_eval, log, stop,
                                  first)
            except Interrupted as e:
                e.resume_command = f"flash-cce train --resume {run_dir}"
                raise
            except RewardError as e:
                raise RunError(str(e)) from None
        if cfg["test"]:
            r = evaluate(model, prompts["test"], gcfg, sampling(cfg), sorted(tokenizer.eos_token_ids), scorer,
                         cfg["seed"], cfg["batch_size"], -1, cfg["iters"])
            log(f"test: reward {r['reward']:.4f}")
    best = f", best: {run_dir / 'best'}" if (run_dir / "best").exists() else ""
    log(f"Run directory: {run_dir} (adapters: {run_dir / 'adapters'}{best})")
    if hint:
        log(f"Try: mlx_lm.generate --model {cfg['model']} --adapter-path {run_dir / 'adapters'}")
    return run_dir, last
