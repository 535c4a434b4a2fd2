"""`flash-cce train` runs from checked settings.

Everything that can be checked is checked before the first byte is written:
settings, the model path, the data splits (see `preflight`), the run directory
(writable, not in use, not holding another run's checkpoints), resume and
warm-start adapters against the model. Then the run takes the directory's lock,
writes config.yaml and trains.
"""

import contextlib
import os
import shlex
import signal
from dataclasses import replace
from pathlib import Path

from . import settings
from .checkpoint import find_checkpoint, read_trainer_state, run_dir_of
from .identity import adapter_dir, check_adapter_model, check_data, data_fingerprint, read_run_config
from .plot import plot_on_eval
from .preflight import (RunError, check_capture, check_init_adapters, check_model, encode, load_model,
                        model_ref, read_data)
from .rundir import (CONFIG, Lock, check_lock, check_unchanged, check_writable, foreign_files, has_checkpoints,
                     set_aside, state as run_dir_state)
from .storage import writing
from .warmup import Warmup, wanted
from .warmup import tokens as warmup_tokens

# pad_to "auto": on a CUDA GPU, widths in multiples of 64, so that steps repeat
# the shapes of earlier ones: a new shape costs MLX's CUDA backend time
# (docs/benchmarks.md, `bench_orpo.py --vary-prompt`).
AUTO_PAD = 64

# A longer first prompt is left out of the hint: one line of the terminal, not pages.
HINT_PROMPT_CHARS = 200

PATHS = ("data", "run_dir", "resume", "init_adapters", "gpu_capture")
TRANSIENT = ("resume", "gpu_capture", "accept_data_change")  # not part of the recipe saved in config.yaml


def pad_to(value):
    """ObjectiveConfig's pad_to for the setting `value` (auto, 0 or a multiple)."""
    if value == "auto":
        from ..stack.plan import on_cuda

        return AUTO_PAD if on_cuda() else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"pad_to: expected auto, 0 or a positive integer, got {value!r}")
    return value or None


def objective_config(cfg):
    from ..stack import StackConfig
    from .objectives import ObjectiveConfig

    stack = StackConfig(pad_to=pad_to(cfg["pad_to"]),
                        compiled_layers=None if cfg["compiled_layers"] == "auto" else cfg["compiled_layers"],
                        **{k: cfg[k] for k in ("prefix_sharing", "flash_head", "segment_size",
                                               "attention_block")})
    obj = ObjectiveConfig(name=cfg["objective"], beta=cfg["beta"], gamma=cfg["gamma"], stack=stack,
                          **{k: cfg[k] for k in ("loss_type", "label_smoothing", "discopop_tau", "cpo_alpha", "alpha",
                                                 "desirable_weight", "undesirable_weight", "pref_weight",
                                                 "nll_on_prompt")})
    obj.validate()
    return obj


def training_args(cfg, progress=True):
    from .trainer import TrainingArgs

    args = TrainingArgs(**{k: cfg[k] for k in ("batch_size", "iters", "grad_accumulation_steps",
                                               "max_grad_norm", "steps_per_eval", "val_batches",
                                               "save_every", "keep_checkpoints", "seed",
                                               "max_nonfinite_steps", "steps_per_report")},
                        progress=cfg["progress"] and progress)
    args.validate()
    return args


def resolve_config(flags, config_path=None, base=None):
    """Checked settings: `flags` (None = unset) > YAML at `config_path` > `base` > defaults."""
    from .mlx_lm_config import from_mlx_lm

    return settings.resolve(flags, config_path, base, lambda m: from_mlx_lm(m, settings.BY_NAME))


def _absolute(cfg):
    """`cfg` with absolute paths; the model and the data resolved (config.yaml
    names them wherever the run is resumed or evaluated from), a warm start's
    run directory as its adapters."""
    cfg = dict(cfg)
    cfg["model"] = model_ref(cfg["model"])
    for k in PATHS:
        if cfg[k] is not None:
            cfg[k] = str(Path(cfg[k]).expanduser().absolute())
    if cfg["data"] is not None:
        cfg["data"] = str(Path(cfg["data"]).resolve())
    if cfg["init_adapters"] is not None:
        cfg["init_adapters"] = adapter_dir(cfg["init_adapters"])
    return cfg


def _fixed_changes(saved, cfg):
    """[(key, saved value, new value)] of the settings a resumed run may not change."""
    out = []
    for s in settings.SETTINGS:
        was, now = saved[s.name], cfg[s.name]
        if s.resume != "fixed" or was == now:
            continue
        if isinstance(was, dict) and isinstance(now, dict):
            out += [(f"{s.name}.{k}", was[k], now[k]) for k in was if was[k] != now[k]]
        else:
            out.append((s.name, was, now))
    return out


def train_settings(flags, config_path=None):
    """Checked settings of `flash-cce train`; with `resume`, the run's own
    config.yaml under `flags` and `config_path`, whose "fixed" settings must agree."""
    flags = dict(flags)
    if flags.get("model") is not None:
        flags["model"] = model_ref(flags["model"])
    if not flags.get("resume"):
        if flags.get("accept_data_change"):
            raise RunError("accept_data_change: applies to a resumed run (--resume) only")
        return _absolute(resolve_config(flags, config_path))
    if flags.get("init_adapters"):
        raise RunError("init_adapters: give either resume (continue a run) or init_adapters (start a new one)")
    ckpt = find_checkpoint(flags["resume"])
    state = read_trainer_state(ckpt)
    run_dir = run_dir_of(ckpt)
    if run_dir is None:
        raise RunError(f"resume: {ckpt} is not a checkpoint inside a run directory's checkpoints/")
    saved_file = run_dir / CONFIG
    if not saved_file.exists():
        raise RunError(f"resume: {run_dir} has no {CONFIG}; it is not a flash-cce run directory")
    saved = read_run_config(saved_file, "resume")
    init = saved.pop("init_adapters")  # applied when the run began; its checkpoints hold it since
    cfg = resolve_config(flags, config_path, base=saved)
    if cfg["iters"] < state["step"]:
        raise RunError(f"iters: got {cfg['iters']}, below step {state['step']} of the checkpoint {ckpt}; "
                       f"give --iters {state['step']} or more, or resume an earlier checkpoint")
    given = flags.get("run_dir")
    if given is not None and Path(given).absolute() != run_dir:
        raise RunError(f"run_dir: a resumed run continues in its own directory {run_dir}, not {given}")
    cfg = _absolute(dict(cfg, run_dir=str(run_dir), resume=str(ckpt), init_adapters=init))
    saved = _absolute(dict(saved, init_adapters=init))
    for key, was, now in _fixed_changes(saved, cfg):
        raise RunError(
            f"resume: {key} may not change when resuming (the run: {settings.show(was)}, now: "
            f"{settings.show(now)}); it shapes the weights, the data or the optimizer. "
            f"Start a new run from these weights with --init-adapters {ckpt}")
    return cfg


class Stop:
    """SIGINT/SIGTERM: finish the step, checkpoint, stop; a second signal stops at once."""

    def __init__(self, log):
        self.signum, self.log, self.saved = None, log, {}

    def __call__(self):
        return self.signum is not None

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        self.log(f"\n{signal.Signals(signum).name}: stopping after this step (again: at once, "
                 "without a checkpoint)")

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            self.saved[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self.saved.items():
            signal.signal(s, h)


@contextlib.contextmanager
def writing_run(run_dir, cfg, resume, resume_state, own_files, seen, lock, rank, log):
    """The run directory taken for writing, after every check: its lock (unless
    `lock`, which the caller holds), the checks again under it (another command
    may have written since), config.yaml, and on resume the checkpoints after
    `resume_state`'s set aside; the lock is released on the way out."""
    own_lock = lock is None
    lock = lock or Lock(run_dir)
    if rank == 0 and own_lock:
        stale = check_lock(run_dir)
        if stale:
            log(stale)
        run_dir.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    try:
        if rank == 0:
            _check_run_dir(run_dir, resume, own_files)
            check_unchanged(run_dir, seen)
            _atomic_yaml(recipe(cfg), run_dir / CONFIG)
            if resume is not None:
                set_aside(run_dir, resume_state["step"], resume_state.get("best_step"), log)
        yield
    finally:
        if own_lock:
            lock.release()


def recipe(cfg):
    """`cfg` as config.yaml keeps it: the transient settings at their defaults."""
    return {k: (settings.BY_NAME[k].default if k in TRANSIENT else v) for k, v in cfg.items()}


def _atomic_yaml(cfg, path):
    tmp = Path(path).with_name(CONFIG + ".tmp")
    try:
        with writing(path):
            settings.dump_yaml(cfg, tmp)
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _during_steps(cfg, log):
    """`log` for lines printed while steps run: through tqdm where it draws a bar."""
    from .report import use_bar

    if log is print and use_bar(cfg["progress"]):
        from tqdm import tqdm

        return tqdm.write
    return log


def generate_hint(cfg, run_dir, records):
    """An mlx_lm.generate command that prompts the model as it was trained."""
    rec = records[0][0]
    strings = isinstance(rec[next(k for k in ("completion", "chosen", "text") if k in rec)], str)
    plain = strings and cfg["chat_template"] != True  # noqa: E712 (auto or False)
    prompt = rec.get("prompt") if strings else None
    cmd = ["mlx_lm.generate", "--model", cfg["model"], "--adapter-path", str(run_dir / "adapters")]
    if plain:
        cmd.append("--ignore-chat-template")  # trained as plain text, not as a chat turn
    if isinstance(prompt, str) and prompt and "\n" not in prompt and len(prompt) <= HINT_PROMPT_CHARS:
        cmd += ["--prompt", prompt]
    return shlex.join(cmd)


def _check_run_dir(run_dir, resume, own_files):
    """What a run needs of its directory; checked before the lock and again under it."""
    check_writable(run_dir)
    if resume is None and has_checkpoints(run_dir):
        raise RunError(f"run_dir: {run_dir} already holds a run's checkpoints; continue it with "
                       f"--resume {run_dir}, or pick a new --run-dir")
    foreign = [f for f in foreign_files(run_dir) if f not in own_files] if resume is None else []
    if foreign:
        raise RunError(f"run_dir: {run_dir} holds files a run does not write ({', '.join(foreign[:3])}"
                       f"{', ...' if len(foreign) > 3 else ''}); pick a new or empty --run-dir")


def run_train(cfg, log=print, on_eval=None, hint=True, own_files=(), lock=None, checkpoints=True):
    """Trains with checked settings `cfg` (see `train_settings`); returns (run_dir, last validation record).
    Raises RunError (and nothing is written) when the run cannot start. `own_files`
    are names in the run directory that the caller put there (not foreign);
    `lock`, the run directory's lock when the caller holds it already. Without
    `checkpoints` the run writes only its config.yaml (the warm-up's helper)."""
    if cfg["objective"] == "grpo":
        raise ValueError("objective grpo: online RL has a loop of its own, grpo_trainer.run_grpo")
    import mlx.core as mx
    import mlx.optimizers as optim

    from .checkpoint import Interrupted, check_checkpoint, load_adapters
    from .controller import for_settings
    from .reference import with_reference

    rank = mx.distributed.init().rank()
    if rank != 0:  # one voice and one writer: rank 0
        log = lambda *a, **k: None  # noqa: E731
    cfg = _absolute(cfg)
    run_dir = Path(cfg["run_dir"])
    resume = cfg["resume"]
    if rank == 0:  # the writer; other ranks would see its lock
        _check_run_dir(run_dir, resume, own_files)
        check_lock(run_dir)
        seen = run_dir_state(run_dir)
    check_model(cfg["model"], cfg["num_layers"])
    records = read_data(cfg, ("train", "valid", "test") if cfg["test"] else ("train", "valid"))
    if resume is None:
        cfg["data_fingerprint"] = data_fingerprint(cfg["data"], cfg["test"])
    else:
        cfg = check_data(cfg, cfg["data_fingerprint"], Path(resume).name, log)
    check_capture(cfg["gpu_capture"])
    check_init_adapters(cfg)
    if cfg["init_adapters"] is not None:
        check_adapter_model(cfg["init_adapters"], cfg["model"])
    from .trainer import build_schedule, prepare_model, train, trainable_summary

    objective = objective_config(cfg)
    controller = for_settings(cfg, objective)
    args = training_args(cfg, progress=rank == 0)
    schedule = build_schedule(cfg["learning_rate"], cfg["iters"], cfg["warmup"], cfg["lr_schedule"],
                              cfg["min_learning_rate"])

    log(f"Loading model {cfg['model']}")
    model, tokenizer = load_model(cfg)
    splits = encode(cfg, tokenizer, records, log)
    if len(splits["train"]) < cfg["batch_size"]:
        raise RunError(f"batch_size: got {cfg['batch_size']}; allowed: at most the {len(splits['train'])} "
                       "usable training pairs")
    if cfg["val_batches"] == 0:
        log("No validation (val_batches 0): best is not written; adapters is the latest checkpoint")
    elif not splits.get("valid"):
        why = "no valid.jsonl" if "valid" not in records else "valid.jsonl has no usable pairs"
        log(f"No validation ({why}): best is not written; adapters is the latest checkpoint")
    mx.random.seed(cfg["seed"])  # LoRA's initial weights
    try:
        prepare_model(model, cfg["fine_tune_type"], cfg["num_layers"], cfg["lora_parameters"], cfg["quantize"])
    except ValueError as e:
        raise RunError(str(e)) from None
    if cfg["init_adapters"] is not None:
        load_adapters(cfg["init_adapters"], model, "init_adapters")
        log(f"Starting from the adapters in {cfg['init_adapters']} (fresh optimizer)")
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=cfg["weight_decay"])
    resume_state = None
    if resume is not None:  # every file of the checkpoint, before anything is written
        resume_state, _ = check_checkpoint(resume, model, optimizer)
    log(trainable_summary(model))
    from .report import run_summary

    log(run_summary(cfg))

    seen = seen if rank == 0 else None
    warm = None
    if wanted(cfg, splits["train"], mx.distributed.init().size()):
        largest = cfg["batch_size"] * max(map(warmup_tokens, splits["train"]))
        warm = Warmup(cfg, _during_steps(cfg, log), largest_tokens=largest)  # its helper: after the first step
        objective = replace(objective, stack=replace(objective.stack, compiled_when=warm.ready))
    with writing_run(run_dir, cfg, resume, resume_state, own_files, seen, lock, rank, log), \
            warm or contextlib.nullcontext():
        pairs = [p for split in splits.values() for p in split] if cfg["precompute_ref_log_probs"] else None
        objective = with_reference(cfg, objective, model, log, pairs, run_dir)
        with Stop(log) as stop:
            try:
                last = train(model, optimizer, splits["train"], splits.get("valid"), args, objective,
                             run_dir=run_dir if checkpoints else None, adapter_config=cfg, resume=resume,
                             on_eval=plot_on_eval(run_dir, on_eval) if rank == 0 else on_eval, log=log,
                             should_stop=stop, gpu_capture=cfg["gpu_capture"],
                             controller=controller, on_step=warm and warm.after_step)
            except Interrupted as e:
                e.resume_command = shlex.join(["flash-cce", "train", "--resume", str(run_dir)])
                raise
        if cfg["test"]:
            from .trainer import evaluate_pairs

            r = evaluate_pairs(model, splits["test"], objective, cfg["batch_size"], cfg["test_batches"])
            log(f"test: loss {r['loss']:.4f}, accuracy {r.get('rewards/accuracies', float('nan')):.3f}")
    best = f", best: {run_dir / 'best'}" if (run_dir / "best").exists() else ""
    log(f"Run directory: {run_dir} (adapters: {run_dir / 'adapters'}{best})")
    if hint:
        log(f"Try: {generate_hint(cfg, run_dir, records['train'])}")
    return run_dir, last
