"""Train and eval runs from checked settings.

Everything that can be checked is checked before the first byte is written:
settings, the model path, the data splits, the run directory (writable, not in
use, not holding another run's checkpoints), resume and warm-start adapters
against the model. Then the run takes the directory's lock, writes config.yaml
and trains.
"""

import json
import os
import re
import signal
from pathlib import Path

from . import settings
from .checkpoint import ADAPTER_CONFIG, find_checkpoint, run_dir_of
from .rundir import CONFIG, Lock, check_lock, check_writable, foreign_files, has_checkpoints

# pad_to "auto": on a CUDA GPU, widths in multiples of 64, so that steps repeat
# the shapes of earlier ones: a new shape costs MLX's CUDA backend time.
# One H200, bench/bench_orpo.py --vary-prompt 8 (a new prompt length every step),
# model A 4-bit: 799 -> 389 ms at 1k tokens, 1050 -> 732 at 4k (README).
AUTO_PAD = 64

PATHS = ("data", "run_dir", "resume", "init_adapters", "gpu_capture")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
TRANSIENT = ("resume", "gpu_capture")  # not part of the recipe saved in config.yaml


class RunError(ValueError):
    """A run that cannot start as asked (one line)."""


def on_cuda():
    import mlx.core as mx

    return hasattr(mx, "cuda") and mx.cuda.is_available()


def pad_to(value):
    """ObjectiveConfig's pad_to for the setting `value` (auto, 0 or a multiple)."""
    if value == "auto":
        return AUTO_PAD if on_cuda() else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"pad_to: expected auto, 0 or a positive integer, got {value!r}")
    return value or None


def objective_config(cfg):
    from .objectives import ObjectiveConfig

    obj = ObjectiveConfig(name=cfg["objective"], beta=cfg["beta"], gamma=cfg["gamma"],
                          **{k: cfg[k] for k in ("loss_type", "label_smoothing", "cpo_alpha",
                                                 "desirable_weight", "undesirable_weight", "pref_weight")},
                          nll_on_prompt=cfg["nll_on_prompt"], prefix_sharing=cfg["prefix_sharing"],
                          flash_head=cfg["flash_head"], segment_size=cfg["segment_size"],
                          compiled_layers=cfg["compiled_layers"], pad_to=pad_to(cfg["pad_to"]),
                          attention_block=cfg["attention_block"])
    obj.validate()
    return obj


def reference_kind(cfg):
    if cfg["reference"] != "auto":
        return cfg["reference"]
    return "adapters_off" if cfg["fine_tune_type"] == "lora" else "model"


def with_reference(cfg, objective, model, log, pairs=None, run_dir=None):
    """`objective` with the source of its reference log-probs (for dpo and kto);
    with `pairs`, a precomputed table of theirs (kept in `run_dir`)."""
    from dataclasses import replace

    from . import reference
    from .losses import get

    if not get(objective.name).reference:
        return objective
    kind, ref_path = reference_kind(cfg), cfg["reference_model"] or cfg["model"]
    if kind == "model":
        from .trainer import quantize_model

        ref_model, _ = load_model(dict(cfg, model=ref_path))
        if cfg["reference_quantize"]:
            quantize_model(ref_model, cfg["reference_quantize"])
        source = reference.FrozenModel(ref_model)
        log(f"Reference: the frozen model {ref_path}"
            + (f" ({cfg['reference_quantize']['bits']}-bit)" if cfg["reference_quantize"] else ""))
    else:
        source = reference.AdaptersOff()
    if pairs is None:
        return replace(objective, reference=source)
    import mlx.core as mx

    from .lm import LM

    settings_ = {"reference": kind, "quantize": cfg["reference_quantize"], "model": ref_path}
    print_ = reference.fingerprint(ref_path, settings_, pairs)
    path = Path(run_dir) / reference.TABLE
    table = reference.load_table(path, print_)
    if table is None:
        table = reference.precompute(source, LM(model), pairs, objective, get(objective.name), log)
        if mx.distributed.init().rank() == 0:
            reference.save_table(path, table, print_)
    else:
        log(f"Reference log-probs of {len(table)} pairs read from {path}")
    return replace(objective, reference=reference.Precomputed(table))


def adaptive_weight(cfg, objective):
    """The controller of the preference weight, or None when adaptive_weight is off."""
    from .controller import for_objective

    return for_objective(objective, cfg["controller"]) if cfg["adaptive_weight"] else None


def training_args(cfg, progress=True):
    from .trainer import TrainingArgs

    args = TrainingArgs(**{k: cfg[k] for k in ("batch_size", "iters", "grad_accumulation_steps",
                                               "max_grad_norm", "steps_per_eval", "val_batches",
                                               "save_every", "keep_checkpoints", "seed")},
                        progress=cfg["progress"] and progress)
    args.validate()
    return args


def resolve_config(flags, config_path=None, base=None):
    """Checked settings: `flags` (None = unset) > YAML at `config_path` > `base` > defaults."""
    return settings.resolve(flags, config_path, base)


def _model_ref(ref):
    """A local model path made absolute; a hub id as given."""
    if ref is None:
        return None
    p = Path(ref).expanduser()
    return str(p.resolve()) if p.exists() else ref


def _absolute(cfg):
    cfg = dict(cfg)
    cfg["model"] = _model_ref(cfg["model"])
    for k in PATHS:
        if cfg[k] is not None:
            cfg[k] = str(Path(cfg[k]).expanduser().absolute())
    return cfg


def _flat(cfg):
    out = {}
    for k, v in cfg.items():
        if isinstance(v, dict):
            out.update({f"{k}.{f}": x for f, x in v.items()})
        else:
            out[k] = v
    return out


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
        flags["model"] = _model_ref(flags["model"])
    if not flags.get("resume"):
        return _absolute(resolve_config(flags, config_path))
    if flags.get("init_adapters"):
        raise RunError("init_adapters: give either resume (continue a run) or init_adapters (start a new one)")
    ckpt = find_checkpoint(flags["resume"])
    run_dir = run_dir_of(ckpt)
    if run_dir is None:
        raise RunError(f"resume: {ckpt} is not a checkpoint inside a run directory's checkpoints/")
    saved_file = run_dir / CONFIG
    if not saved_file.exists():
        raise RunError(f"resume: {run_dir} has no {CONFIG}; it is not a flash-cce run directory")
    try:
        saved = settings.check(settings.load_yaml(saved_file))
    except settings.SettingsError as e:
        raise RunError(f"resume: {saved_file}: {e}") from None
    init = saved.pop("init_adapters")  # applied when the run began; its checkpoints hold it since
    cfg = resolve_config(flags, config_path, base=saved)
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


# ---- checks before writing ------------------------------------------------


def check_model(ref, num_layers=None):
    """RunError unless `ref` is a model directory (or looks like a hub id) with
    at least `num_layers` blocks."""
    if ref is None:
        raise RunError("model: give --model (a local mlx-lm model directory or a Hugging Face id)")
    p = Path(ref).expanduser()
    if p.exists():
        if not p.is_dir():
            raise RunError(f"model: {ref!r} is a file; give an mlx-lm model directory")
        if not (p / "config.json").is_file():
            raise RunError(f"model: {ref!r} has no config.json; it is not an mlx-lm model directory")
        if not any(p.glob("*.safetensors")):
            raise RunError(f"model: {ref!r} has no *.safetensors weights")
        try:
            config = json.loads((p / "config.json").read_text())
        except (ValueError, OSError) as e:
            raise RunError(f"model: cannot read {p / 'config.json'}: {e}") from None
        blocks = config.get("num_hidden_layers") if isinstance(config, dict) else None
        if isinstance(blocks, int) and num_layers is not None and num_layers > blocks:
            raise RunError(f"num_layers: got {num_layers}; allowed: -1 or 1 to {blocks} "
                           f"(the model has {blocks} blocks)")
        return
    if not HUB_ID.match(ref) or ref.startswith((".", "~")):
        raise RunError(f"model: no such directory {ref!r}")


def load_model(cfg):
    """(model, tokenizer); a model that cannot be loaded is one RunError line."""
    from mlx_lm.utils import load

    check_model(cfg["model"])
    trust = bool(cfg["trust_remote_code"])
    try:
        return load(cfg["model"], tokenizer_config={"trust_remote_code": trust}, trust_remote_code=trust)
    except Exception as e:  # mlx_lm and huggingface_hub raise many types; one line for all
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if not Path(cfg["model"]).expanduser().exists():
            raise RunError(f"model: {cfg['model']!r} is not a local directory and could not be fetched "
                           f"from the Hugging Face hub (offline or unknown id?): {reason}") from None
        raise RunError(f"model: cannot load {cfg['model']!r}: {reason}") from None


def read_data(cfg, splits):
    """{split: records} after checking the files; RunError for what is missing."""
    from .data import read_splits

    if cfg["data"] is None:
        raise RunError("data: give --data (a directory with train.jsonl and valid.jsonl)")
    records = read_splits(cfg["data"], splits, unpaired=cfg["objective"] == "kto")
    for split in splits:
        if split == "valid":
            continue
        if split not in records:
            need = "--test needs" if split == "test" and "train" in splits else "needs"
            raise RunError(f"data: {need} {split}.jsonl in {cfg['data']}; there is none")
        if not records[split]:
            raise RunError(f"data: {Path(cfg['data']) / (split + '.jsonl')} holds no records")
    return records


def encode(cfg, tokenizer, records, log):
    from .data import encode_records, format_summary

    out = {}
    for split, recs in records.items():
        pairs, report = encode_records(recs, tokenizer, max_seq_length=cfg["max_seq_length"],
                                       truncation=cfg["truncation"], chat_template=cfg["chat_template"],
                                       enable_thinking=cfg["enable_thinking"],
                                       unpaired=cfg["objective"] == "kto")
        log(format_summary(split, pairs, report))
        if not pairs and split != "valid":
            raise RunError(f"data: {split}.jsonl has no usable pairs ({report['records']} records, all "
                           f"dropped at max_seq_length={cfg['max_seq_length']} with truncation={cfg['truncation']})")
        out[split] = pairs
    return out


def check_capture(path):
    if path is None:
        return
    import mlx.core as mx

    if not mx.metal.is_available():
        raise RunError("gpu_capture: needs MLX's Metal backend (an Apple GPU); this device has none")
    if not path.endswith(".gputrace"):
        raise RunError(f"gpu_capture: {path!r} must end in .gputrace (Xcode's trace format)")
    if Path(path).exists():
        raise RunError(f"gpu_capture: {path} exists; Metal writes a new trace")


def adapter_settings(path):
    """fine_tune_type, num_layers, lora_parameters of an adapter directory's adapter_config.json."""
    path = Path(path)
    file = path / ADAPTER_CONFIG
    if not file.is_file():
        raise RunError(f"init_adapters: {str(path)!r} has no {ADAPTER_CONFIG} (not an adapter directory)")
    try:
        saved = json.loads(file.read_text())
        out = {k: saved[k] for k in ("fine_tune_type", "num_layers") if k in saved}
        out.setdefault("fine_tune_type", "lora")
        if "lora_parameters" in saved:
            out["lora_parameters"] = saved["lora_parameters"]
        for k, v in out.items():
            out[k] = settings.check_value(settings.BY_NAME[k], v, f"{file}: {k}")
    except (ValueError, TypeError, AttributeError) as e:
        raise RunError(f"init_adapters: {e}") from None
    if "num_layers" not in out:
        raise RunError(f"init_adapters: {file} has no num_layers")
    return out


def check_init_adapters(cfg):
    path = cfg["init_adapters"]
    if path is None:
        return
    theirs = adapter_settings(path)
    if theirs["fine_tune_type"] == "full" or cfg["fine_tune_type"] == "full":
        keys = ("fine_tune_type", "num_layers")
    else:
        keys = ("fine_tune_type", "num_layers", "lora_parameters.rank", "lora_parameters.keys")
    mine, theirs = _flat(cfg), _flat(theirs)
    for k in keys:
        if k in theirs and mine[k] != theirs[k]:
            raise RunError(f"init_adapters: the adapters have {k} {settings.show(theirs[k])}, this run "
                           f"{settings.show(mine[k])}; set {k} to match them")


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


def _atomic_yaml(cfg, path):
    tmp = Path(path).with_name(CONFIG + ".tmp")
    settings.dump_yaml(cfg, tmp)
    os.replace(tmp, path)


def generate_hint(cfg, run_dir, records):
    """An mlx_lm.generate command that prompts the model as it was trained."""
    rec = records[0][0]
    strings = isinstance(rec["completion" if "completion" in rec else "chosen"], str)
    plain = strings and cfg["chat_template"] != True  # noqa: E712 (auto or False)
    prompt = rec.get("prompt") if strings else None
    cmd = f"mlx_lm.generate --model {cfg['model']} --adapter-path {run_dir / 'adapters'}"
    if plain:
        cmd += " --ignore-chat-template"  # trained as plain text, not as a chat turn
    if isinstance(prompt, str) and prompt and '"' not in prompt and "\n" not in prompt:
        cmd += f' --prompt "{prompt}"'
    return cmd


def run_train(cfg, log=print, on_eval=None, hint=True):
    """Trains with checked settings `cfg` (see `train_settings`); returns (run_dir, last validation record).
    Raises RunError (and nothing is written) when the run cannot start."""
    import mlx.core as mx
    import mlx.optimizers as optim

    from .checkpoint import Interrupted, check_adapter_shapes, load_adapters, read_adapters
    from .rundir import set_aside

    rank = mx.distributed.init().rank()
    if rank != 0:  # one voice and one writer: rank 0
        log = lambda *a, **k: None  # noqa: E731
    run_dir = Path(cfg["run_dir"])
    resume = cfg["resume"]
    if rank == 0:  # the writer; other ranks would see its lock
        check_writable(run_dir)
        if resume is None and has_checkpoints(run_dir):
            raise RunError(f"run_dir: {run_dir} already holds a run's checkpoints; continue it with "
                           f"--resume {run_dir}, or pick a new --run-dir")
        foreign = foreign_files(run_dir) if resume is None else []
        if foreign:
            raise RunError(f"run_dir: {run_dir} holds files a run does not write ({', '.join(foreign[:3])}"
                           f"{', ...' if len(foreign) > 3 else ''}); pick a new or empty --run-dir")
        check_lock(run_dir)
    check_model(cfg["model"], cfg["num_layers"])
    records = read_data(cfg, ("train", "valid", "test") if cfg["test"] else ("train", "valid"))
    check_capture(cfg["gpu_capture"])
    check_init_adapters(cfg)
    from .trainer import build_schedule, prepare_model, train, trainable_summary

    objective = objective_config(cfg)
    controller = adaptive_weight(cfg, objective)
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
    if resume is not None:
        check_adapter_shapes(read_adapters(resume, "resume"), model, "resume")
    log(trainable_summary(model))
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=cfg["weight_decay"])

    lock = Lock(run_dir)
    if rank == 0:
        stale = check_lock(run_dir)
        if stale:
            log(stale)
        run_dir.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    try:
        if rank == 0:
            _atomic_yaml({k: (None if k in TRANSIENT else v) for k, v in cfg.items()}, run_dir / CONFIG)
            if resume is not None:
                state = json.loads((Path(resume) / "trainer_state.json").read_text())
                set_aside(run_dir, state["step"], state.get("best_step"), log)
        pairs = [p for split in splits.values() for p in split] if cfg["precompute_ref_log_probs"] else None
        objective = with_reference(cfg, objective, model, log, pairs, run_dir)
        with Stop(log) as stop:
            try:
                last = train(model, optimizer, splits["train"], splits.get("valid"), args, objective,
                             run_dir=run_dir, adapter_config=cfg, resume=resume, on_eval=on_eval, log=log,
                             should_stop=stop, gpu_capture=cfg["gpu_capture"], controller=controller)
            except Interrupted as e:
                e.resume_command = f"flash-cce train --resume {run_dir}"
                raise
        if cfg["test"]:
            from .trainer import evaluate_pairs

            r = evaluate_pairs(model, splits["test"], objective, cfg["batch_size"])
            log(f"test: loss {r['loss']:.4f}, accuracy {r.get('rewards/accuracies', float('nan')):.3f}")
    finally:
        lock.release()
    best = f", best: {run_dir / 'best'}" if (run_dir / "best").exists() else ""
    log(f"Run directory: {run_dir} (adapters: {run_dir / 'adapters'}{best})")
    if hint:
        log(f"Try: {generate_hint(cfg, run_dir, records['train'])}")
    return run_dir, last


# ---- eval -----------------------------------------------------------------


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
            try:
                base = settings.check(settings.load_yaml(run / CONFIG))
            except settings.SettingsError as e:
                raise RunError(f"adapter_path: {run / CONFIG}: {e}") from None
        elif (p / "adapters.safetensors").exists():
            base = adapter_settings(p)
        else:
            raise RunError(f"adapter_path: {str(path)!r} is neither a run, a checkpoint nor an adapter directory")
    if flags.get("model") is not None:
        flags["model"] = _model_ref(flags["model"])
    cfg = resolve_config(flags, config_path, base)
    return dict(cfg, resume=None, init_adapters=None), adapters


def run_eval(cfg, adapters, split, log=print):
    """The objective's metrics of the model (with `adapters`) on `split`, as the run computed them."""
    from .checkpoint import load_adapters
    from .trainer import evaluate_pairs, prepare_model, quantize_model

    objective = objective_config(cfg)
    check_model(cfg["model"])
    records = read_data(cfg, (split,))
    model, tokenizer = load_model(cfg)
    pairs = encode(cfg, tokenizer, records, lambda *a: None)[split]
    try:
        if adapters is not None:
            prepare_model(model, cfg["fine_tune_type"], cfg["num_layers"], cfg["lora_parameters"], cfg["quantize"])
            load_adapters(adapters, model, "adapter_path")
        elif cfg["quantize"]:
            quantize_model(model, cfg["quantize"])
    except ValueError as e:
        raise RunError(str(e)) from None
    objective = with_reference(cfg, objective, model, log)
    r = evaluate_pairs(model, pairs, objective, cfg["batch_size"])
    log(format_table(cfg, adapters, split, len(pairs), r))
    return r


def format_table(cfg, adapters, split, n, metrics):
    rows = [("model", cfg["model"]), ("adapters", str(adapters) if adapters else "none"),
            ("split", f"{split} ({n} pairs)"), ("objective", f"{cfg['objective']} (beta {cfg['beta']:g})")]
    if cfg["quantize"]:
        rows.append(("quantize", f"{cfg['quantize']['bits']} bits, group {cfg['quantize']['group_size']}"))
    for k, v in sorted(metrics.items()):
        rows.append((k, str(int(v)) if k == "tokens" else f"{v:.4f}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
