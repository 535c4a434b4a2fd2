"""The training loop: preference objective steps with gradient accumulation and
clipping, JSONL metrics, periodic evaluation, atomic checkpoints, exact resume.

Shaped like mlx-lm's `tuner.trainer`: `TrainingArgs` holds the loop's settings and
`train` takes the model, optimizer and data; the objective comes from
`flash_cce.train.objectives` and can be swapped through `train`'s arguments.
"""

import json
import math
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from . import checkpoint, settings
from .checkpoint import Interrupted, NonFinite  # noqa: F401 (raised here and by the guard, caught by the CLI)
from .objectives import ObjectiveConfig
from .preflight import prepare_model, quantize_model  # noqa: F401 (prepare_model: the trainer's API)
from .objectives import evaluate as objective_evaluate
from .objectives import value_and_grad as objective_value_and_grad
from .guard import Guard
from .notice import SlowStart
from .storage import WriteError, writing

GB = 1e9


@dataclass
class TrainingArgs:
    """The loop's settings; defaults and help come from `flash_cce.train.settings`."""

    batch_size: int = settings.field("batch_size")
    iters: int = settings.field("iters")
    grad_accumulation_steps: int = settings.field("grad_accumulation_steps")
    max_grad_norm: Optional[float] = settings.field("max_grad_norm")
    steps_per_eval: int = settings.field("steps_per_eval")
    val_batches: int = settings.field("val_batches")
    save_every: int = settings.field("save_every")
    keep_checkpoints: int = settings.field("keep_checkpoints")
    seed: int = settings.field("seed")
    memory_canary: float = field(default=0.25, metadata={"help": "Warn when active memory grows by this fraction after the first steps."})
    progress: bool = settings.field("progress")
    max_nonfinite_steps: int = settings.field("max_nonfinite_steps")
    steps_per_report: int = settings.field("steps_per_report")

    def validate(self):
        for f in fields(self):
            if f.name in settings.BY_NAME:
                settings.check_value(settings.BY_NAME[f.name], getattr(self, f.name))


def build_schedule(learning_rate, iters, warmup=0, schedule="cosine", min_learning_rate=0.0):
    """Linear warmup from 0 over `warmup` steps, then cosine or linear decay to
    `min_learning_rate` at `iters` (or a constant rate); `schedule` may also be
    mlx_lm.lora's mapping, built as mlx_lm builds it (the other arguments unused)."""
    if isinstance(schedule, dict):
        from mlx_lm.tuner.utils import build_schedule as mlx_lm_schedule

        return mlx_lm_schedule(schedule)
    if schedule not in ("cosine", "linear", "constant"):
        raise ValueError(f"lr_schedule must be 'cosine', 'linear' or 'constant', got {schedule!r}")
    if not 0 <= warmup < iters:
        raise ValueError(f"warmup must be in [0, iters={iters}), got {warmup}")
    if schedule == "cosine":
        main = optim.cosine_decay(learning_rate, iters - warmup, min_learning_rate)
    elif schedule == "linear":
        main = optim.linear_schedule(learning_rate, min_learning_rate, iters - warmup)
    else:
        main = lambda step: mx.array(learning_rate, mx.float32)  # noqa: E731
    if warmup == 0:
        return main
    ramp = optim.linear_schedule(0.0, learning_rate, warmup)
    return optim.join_schedules([ramp, main], [warmup])


def batch_indices(n, batch_size, position, seed, rank=0, world=1):
    """Indices of micro-batch `position` of an endless shuffled stream over `n`
    examples: epoch e is a permutation seeded by (seed, e); a partial last batch
    of an epoch is skipped. Rank `rank` of `world` takes every world-th index."""
    per_epoch = n // batch_size
    if per_epoch == 0:
        raise ValueError(f"batch_size={batch_size} is larger than the {n} training pairs")
    epoch, b = divmod(position, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return order[b * batch_size:(b + 1) * batch_size][rank::world].tolist()


def sum_over_ranks(grads, group):
    """All-reduce sum of a gradient tree (mlx's bucketed average, times the size)."""
    if group.size() == 1:
        return grads
    from mlx.nn.utils import average_gradients

    n = group.size()
    return tree_map(lambda g: g * n, average_gradients(grads, group))


def _floats(metrics):
    return {k: float(v.item()) if isinstance(v, mx.array) else float(v) for k, v in metrics.items()}


def evaluate_pairs(model, pairs, objective, batch_size, num_batches=-1, evaluate=objective_evaluate):
    """Validation metrics: every metric of the objective averaged over the
    micro-batches weighted by their pair counts ("loss" included)."""
    model.eval()
    total, sums = 0, {}
    starts = range(0, len(pairs), batch_size)
    if num_batches != -1:
        starts = list(starts)[:num_batches]
    for s in starts:
        batch = pairs[s:s + batch_size]
        loss, metrics = evaluate(model, batch, objective)
        values = _floats(dict(metrics, loss=loss))
        for k, v in values.items():
            sums[k] = sums.get(k, 0.0) + v * len(batch)
        total += len(batch)
    model.train()
    out = {k: v / total for k, v in sums.items()}
    if "tokens" in out:
        out["tokens"] *= total  # a count, not a mean
    return out


class MetricsLog:
    """Appends one JSON object per line to run_dir/metrics.jsonl."""

    def __init__(self, path, after_step=None):
        self.path = Path(path)
        with writing(self.path):
            if after_step is not None and self.path.exists():
                # A resumed run rewrites what the interrupted run logged after its checkpoint.
                keep = [line for line in self.path.read_text().splitlines()
                        if line.strip() and json.loads(line)["step"] <= after_step]
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text("".join(line + "\n" for line in keep))
                tmp.replace(self.path)
            self.file = open(self.path, "a")

    def write(self, record):
        with writing(self.path):
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self):
        try:
            self.file.close()
        except OSError:  # the flush of a failed write again: that write's error is the one reported
            pass


def read_metrics(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MemoryCanary:
    """Warns once when active memory rises above its level after `settle` steps."""

    def __init__(self, growth, settle=3):
        self.growth, self.settle, self.base, self.warned = growth, settle, None, False

    def check(self, step, active):
        if self.base is None:
            if step >= self.settle:
                self.base = (step, active)
            return None
        limit = self.base[1] * (1 + self.growth) + 64 * 2**20
        if active > limit and not self.warned:
            self.warned = True
            return (f"active memory grew from {self.base[1] / GB:.3f} GB at step {self.base[0]} "
                    f"to {active / GB:.3f} GB at step {step}: something keeps arrays alive across steps")
        return None


def _progress(args, start, rank, log):
    """A bar on a terminal, else a line per `steps_per_report` steps (rank 0 only)."""
    if rank != 0:
        return None
    from .report import Reporter, use_bar

    return Reporter(args.iters, start, args.steps_per_report, use_bar(args.progress), log)


def apply_update(model, optimizer, grads, loss, max_grad_norm, guard, world):
    """Clips `grads` (the step's, summed over ranks) to `max_grad_norm` (None:
    no clipping) and applies them unless the guard finds the loss or their norm
    non-finite, in which case the weights stay as they were. Returns (finite,
    the gradient norm as an array)."""
    if max_grad_norm is not None:
        grads, norm = optim.clip_grad_norm(grads, max_grad_norm)
    else:
        norm = mx.sqrt(sum((g.astype(mx.float32) ** 2).sum() for _, g in tree_flatten(grads)))
    finite = guard.check(loss, norm.item(), world)
    if finite:
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state)
    return finite, norm


def report_step(record, emit, bar, guard, finite, log):
    """Writes a step's record, shows it, and after a skipped (non-finite) step says so."""
    emit(record)
    if bar is not None:
        bar.step(record)
    if not finite:
        guard.after(record["step"], f"loss {record['loss']:.4g}, grad_norm {record['grad_norm']:.4g}",
                    lambda line: (bar.write if bar is not None else log)(f"[warning] {line}"))


def stop_requested(should_stop, world):
    """Whether `should_stop()` asks to stop after this step, on any rank (every
    rank then stops after the same step)."""
    stop = should_stop is not None and should_stop()
    if should_stop is not None and world.size() > 1:
        stop = mx.distributed.all_sum(mx.array(int(stop)), group=world).item() > 0
    return stop


def train(model, optimizer, train_pairs, val_pairs, args, objective=None, run_dir=None,
          adapter_config=None, resume=None, value_and_grad=objective_value_and_grad,
          evaluate=objective_evaluate, on_eval=None, log=print, should_stop=None, gpu_capture=None,
          controller=None, on_step=None):
    """Trains `model`'s trainable parameters on `train_pairs` (list of Pair).

    Writes run_dir/metrics.jsonl (a record per step and per evaluation) and
    checkpoints (see `checkpoint`) when `run_dir` is given. `resume` is a run or
    checkpoint directory to continue from exactly. `on_eval(record)` sees each
    evaluation and `on_step(record)` each step's record. `should_stop()` is
    asked after each step: when true, a checkpoint is written and `Interrupted`
    raised. `gpu_capture` is a Metal trace file that records this session's
    first step. `controller` (a `controller.Controller`) sets the objective's
    preference weight each step. Returns the last evaluation record (or None).
    """
    args.validate()
    objective = objective or ObjectiveConfig()
    world = mx.distributed.init()
    rank, size = world.rank(), world.size()
    if args.batch_size % size:
        raise ValueError(f"batch_size={args.batch_size} is not divisible by the {size} ranks")
    # Each rank takes its share of every micro-batch; the objective normalises
    # by the whole micro-batch, so the summed gradients equal a single process's.
    step_fn = value_and_grad
    if size > 1:
        step_fn = lambda m, p, o: value_and_grad(m, p, o, group=world)  # noqa: E731
    writer = rank == 0 and run_dir is not None
    run_dir = Path(run_dir) if run_dir is not None else None
    if writer:
        run_dir.mkdir(parents=True, exist_ok=True)

    if writer and resume is None and any((run_dir / "checkpoints").glob("step-*")):
        raise ValueError(f"run_dir: {run_dir} already holds checkpoints; pass resume or a new run_dir")
    # nonfinite_steps: updates skipped so far; finite_checkpoint: the newest
    # checkpoint whose weights a later step found to give a finite loss.
    state = dict(step=0, position=0, best_val=None, best_step=None, seed=args.seed, nonfinite_steps=0,
                 finite_checkpoint=None, num_tokens=0)
    mx.random.seed(args.seed)
    last_ckpt = None  # the newest checkpoint
    if resume is not None:
        loaded, last_ckpt = checkpoint.load_checkpoint(resume, model, optimizer)
        loaded.pop("training_args", None)
        state.update(loaded)
        checkpoint.set_rng_state(state.pop("rng"))
        controller = _resumed_controller(state, controller)
        log(f"Resumed from {last_ckpt} at step {state['step']}")
    guard = Guard(state, args.max_nonfinite_steps, run_dir, writer, resumed=resume is not None)
    log_file = MetricsLog(run_dir / "metrics.jsonl", state["step"] if resume else -1) if writer else None

    def emit(record):
        if log_file is not None:
            log_file.write(record)

    def validate_now(step):
        if not val_pairs or args.val_batches == 0:
            return None
        tic = time.perf_counter()
        values = evaluate_pairs(model, val_pairs, objective, args.batch_size, args.val_batches, evaluate)
        record = dict(split="valid", step=step, eval_time=time.perf_counter() - tic,
                      **{k: v for k, v in values.items()})
        record.update({f"eval_{k}": v for k, v in values.items()})  # TRL's names of validation metrics
        emit(record)
        if on_eval is not None:
            on_eval(record)
        return record

    def save(step, best=False):
        if not writer:
            return None
        trainer_state = dict(state, rng=checkpoint.rng_state(), training_args=asdict(args))
        if controller is not None:
            trainer_state["controller"] = controller.state()
        return checkpoint.save_checkpoint(run_dir, step, model, optimizer, trainer_state,
                                   adapter_config or {}, best=best, keep=args.keep_checkpoints,
                                   protect=guard.protect())

    def after_eval(record, step):
        loss = record["loss"]
        if state["best_val"] is None or loss < state["best_val"]:
            state["best_val"], state["best_step"] = loss, step
            return True
        return False

    # The step-0 evaluation is logged but never "best": best points at a checkpoint.
    with SlowStart("The first validation", log if rank == 0 else None):
        last_eval = validate_now(0) if state["step"] == 0 else None
    model.train()
    canary = MemoryCanary(args.memory_canary)
    bar = _progress(args, state["step"], rank, log)
    accum = args.grad_accumulation_steps
    slow = SlowStart("The first step", None if rank else bar.write).start()  # stopped after the first step
    try:
        first = state["step"] + 1
        for step in range(first, args.iters + 1):
            if gpu_capture is not None and step == first:
                mx.metal.start_capture(str(gpu_capture))
            tic = time.perf_counter()
            mx.reset_peak_memory()
            grads, sums, tokens = None, {}, 0
            if controller is not None:
                objective = replace(objective, pref_weight=controller.weight)
            for _ in range(accum):
                idx = batch_indices(len(train_pairs), args.batch_size, state["position"],
                                    args.seed, rank, size)
                state["position"] += 1
                loss, g, metrics = step_fn(model, [train_pairs[i] for i in idx], objective)
                grads = g if grads is None else tree_map(mx.add, grads, g)
                mx.eval(grads, loss, metrics)
                values = _floats(dict(metrics, loss=loss))
                tokens += values.pop("tokens", 0)
                for k, v in values.items():
                    sums[k] = sums.get(k, 0.0) + v / accum
            grads = sum_over_ranks(tree_map(lambda x: x / accum, grads), world)
            finite, norm = apply_update(model, optimizer, grads, sums["loss"], args.max_grad_norm, guard, world)
            slow.stop()
            if gpu_capture is not None and step == first:
                mx.metal.stop_capture()
                log(f"Recorded step {step} into {gpu_capture}")
            del grads
            state["step"] = step
            elapsed = time.perf_counter() - tic
            active = mx.get_active_memory()
            state["num_tokens"] = state.get("num_tokens", 0) + int(tokens)  # TRL's num_tokens: all so far
            record = dict(split="train", step=step, **sums, grad_norm=float(norm.item()),
                          learning_rate=float(optimizer.learning_rate.item()), tokens=int(tokens),
                          num_tokens=state["num_tokens"],
                          tokens_per_second=tokens / elapsed, step_time=elapsed,
                          active_memory_gb=active / GB, peak_memory_gb=mx.get_peak_memory() / GB)
            record.update(guard.record())
            if controller is not None:
                record["pref_weight"] = objective.pref_weight
                if finite:
                    controller.update(sums.get("chosen_nll", sums["nll_loss"]))
            warning = canary.check(step, active)
            if warning:
                record["memory_warning"] = warning
                log(f"[warning] {warning}")
            report_step(record, emit, bar, guard, finite, log)
            if on_step is not None:
                on_step(record)
            is_best = False
            if args.steps_per_eval and step % args.steps_per_eval == 0 or step == args.iters:
                last_eval = validate_now(step)
                if last_eval is not None:
                    guard.suspect = guard.suspect or not math.isfinite(last_eval["loss"])
                    is_best = not guard.suspect and after_eval(last_eval, step)
                    if bar is not None:
                        bar.write(_eval_line(last_eval))
                    elif rank == 0:
                        log(_eval_line(last_eval))
            stop = stop_requested(should_stop, world)
            due = is_best or (args.save_every and step % args.save_every == 0) or step == args.iters or stop
            if due and not guard.suspect:  # checkpoints hold weights that gave a finite loss last
                if is_best:  # its finite validation loss proves it
                    state["finite_checkpoint"] = step
                last_ckpt = save(step, best=is_best)
                guard.saved(step, proven=is_best)
            if stop and step < args.iters:
                raise Interrupted(step, last_ckpt)
        guard.finish(log)
    except WriteError as e:
        where = f"; the last complete checkpoint is {last_ckpt}" if last_ckpt is not None else ""
        raise WriteError(e.filename, e.strerror + where, e.errno) from None
    finally:
        slow.stop(report=False)  # nothing to say unless the first step was cut short
        if bar is not None:
            bar.close()
        if log_file is not None:
            log_file.close()
    return last_eval


def _resumed_controller(state, controller):
    """The controller as the checkpoint left it (None when it had none)."""
    saved = state.pop("controller", None)
    if controller is None or saved is None:
        if (controller is None) != (saved is None):
            raise ValueError("resume: the checkpoint was made "
                             + ("with" if saved is not None else "without")
                             + " an adaptive preference weight; resume it the same way")
        return controller
    from .controller import Controller

    return Controller.from_state(saved)


def _eval_line(r):
    acc = r.get("rewards/accuracies")
    margin = r.get("rewards/margins")
    parts = [f"step {r['step']}: val loss {r['loss']:.4f}"]
    if acc is not None:
        parts.append(f"accuracy {acc:.3f}")
    if margin is not None:
        parts.append(f"margin {margin:.4f}")
    return ", ".join(parts)


def trainable_summary(model):
    from mlx_lm.utils import get_total_parameters

    total = get_total_parameters(model)
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    return f"Trainable parameters: {100 * trainable / total:.3f}% ({trainable / 1e6:.3f}M/{total / 1e6:.3f}M)"
