"""Atomic training checkpoints in mlx-lm's adapter format.

A run directory holds

    checkpoints/step-0000100/   adapters.safetensors, adapter_config.json  (mlx-lm's format)
                                optimizer.safetensors, trainer_state.json  (for --resume)
    adapters/                   the latest checkpoint's adapters.safetensors and adapter_config.json
    best/                       the best validation checkpoint's
    adapters.safetensors, adapter_config.json   the latest again, at the run's root

A checkpoint is written into a hidden temporary directory and renamed into place,
so a kill at any moment leaves the previous complete checkpoint reachable.
`adapters`, `best` and the root files are real files (hard links to the
checkpoint's where the file system allows, else copies), so `cp -r` copies
them, and the run directory itself, `adapters` and `best` are valid
`--adapter-path` arguments for `mlx_lm.generate` and `mlx_lm.fuse`. Each file is
replaced by rename, the weights before adapter_config.json, whose "step" names
the checkpoint they belong to: at any moment they are some complete checkpoint's.
"""

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .storage import WriteError, writing

ADAPTERS = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
OPTIMIZER = "optimizer.safetensors"
TRAINER_STATE = "trainer_state.json"


class Interrupted(Exception):
    """Training stopped on request after `step`, whose checkpoint `ckpt` was written."""

    def __init__(self, step, ckpt):
        super().__init__(f"interrupted after step {step}")
        self.step, self.ckpt = step, ckpt


class NonFinite(Exception):
    """Training stopped after `streak` non-finite steps in a row, at `step`; `ckpt`
    is the last checkpoint whose weights gave a finite loss (None: there is none)."""

    def __init__(self, step, streak, ckpt, detail):
        super().__init__(f"stopped after step {step}: {streak} non-finite steps in a row")
        self.step, self.streak, self.ckpt, self.detail = step, streak, ckpt, detail


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path, obj, name=None):
    """`obj` as JSON in `path`, on disk; a failed write names `name` (default: `path`)."""
    with writing(name or path), open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_adapters(path, model, adapter_config, name=None):
    """adapters.safetensors (the trainable parameters) and adapter_config.json in
    `path`; a failed write names the files in `name` (default: `path`)."""
    path, name = Path(path), Path(name or path)
    with writing(name):
        path.mkdir(parents=True, exist_ok=True)
    with writing(name / ADAPTERS):
        mx.save_safetensors(str(path / ADAPTERS), dict(tree_flatten(model.trainable_parameters())))
        _fsync_file(path / ADAPTERS)
    _write_json(path / ADAPTER_CONFIG, adapter_config, name / ADAPTER_CONFIG)


def rng_state():
    """The global MLX PRNG key as two ints (restored by `set_rng_state`)."""
    return [int(x) for x in mx.random.state[0].tolist()]


def set_rng_state(key):
    hi, lo = key
    mx.random.seed((int(hi) << 32) | int(lo))  # seed(k) sets the key to [k >> 32, k & 0xffffffff]


PUBLISHED = (ADAPTERS, ADAPTER_CONFIG)  # weights first: the config's "step" names them


def _place(src, dest):
    """`dest` becomes `src`'s content by one rename: a hard link, or a copy where links fail."""
    if dest.exists() and os.path.samefile(src, dest):
        return  # (rename would leave the temporary name: both are one file)
    tmp = dest.with_name(f".{dest.name}.tmp")
    tmp.unlink(missing_ok=True)
    with writing(dest):
        try:
            os.link(src, tmp)
        except OSError:  # no hard links here (or across devices): a copy
            shutil.copyfile(src, tmp)
            _fsync_file(tmp)
        os.replace(tmp, dest)


def link(run_dir, name, target):
    """Makes run_dir/`name` (adapters, best) hold checkpoint `target`'s adapter
    files; `adapters` also puts them at the run's root."""
    run_dir, target = Path(run_dir), Path(target)
    dests = [run_dir / name] + ([run_dir] if name == "adapters" else [])
    for dest in dests:
        if dest.is_symlink():  # a run directory of an older version: links, not folders
            dest.unlink()
        with writing(dest):
            dest.mkdir(exist_ok=True)
        for f in PUBLISHED:
            _place(target / f, dest / f)
        _fsync_dir(dest)


def unlink(run_dir, name):
    """Removes run_dir/`name` (adapters, best) when present; `adapters` also at the run's root."""
    path = Path(run_dir) / name
    if name == "adapters":
        for f in reversed(PUBLISHED):
            (Path(run_dir) / f).unlink(missing_ok=True)
    if path.is_symlink():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def published_step(path):
    """The checkpoint step whose adapters `path` (a run's adapters, best or root) holds, or None."""
    try:
        step = json.loads((Path(path) / ADAPTER_CONFIG).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def _target(run_dir, name):
    """The checkpoint directory run_dir/`name` stands for, or None."""
    path = Path(run_dir) / name
    if path.is_symlink():
        return path.resolve()
    step = published_step(path) if path.is_dir() else None
    return step_dir(run_dir, step).resolve() if step is not None else None


def step_dir(run_dir, step):
    return Path(run_dir) / "checkpoints" / f"step-{step:07d}"


def save_checkpoint(run_dir, step, model, optimizer, trainer_state, adapter_config,
                    best=False, keep=2, protect=()):
    """Writes checkpoint `step` atomically, points `adapters` (and `best` when
    `best`) at it and deletes all but the `keep` newest others, `best` and the
    checkpoint directories in `protect`."""
    run_dir = Path(run_dir)
    final = step_dir(run_dir, step)
    if not final.exists():
        tmp = final.parent / f".tmp-{final.name}"
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a run killed mid-write
        try:
            write_adapters(tmp, model, dict(adapter_config, step=step), final)
            with writing(final / OPTIMIZER):
                mx.save_safetensors(str(tmp / OPTIMIZER), dict(tree_flatten(optimizer.state)))
                _fsync_file(tmp / OPTIMIZER)
            _write_json(tmp / TRAINER_STATE, dict(trainer_state, step=step), final / TRAINER_STATE)
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(final.parent)
        except WriteError:
            shutil.rmtree(tmp, ignore_errors=True)  # a full disk gets its space back
            raise
    link(run_dir, "adapters", final)
    if best:
        link(run_dir, "best", final)
    _prune(run_dir, keep, protect)
    return final


def _prune(run_dir, keep, protect=()):
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"))
    protected = {_target(run_dir, "adapters"), _target(run_dir, "best")}
    protected |= {Path(p).resolve() for p in protect}
    for old in ckpts[: max(len(ckpts) - keep, 0)]:
        if old.resolve() not in protected:
            shutil.rmtree(old)


def find_checkpoint(path):
    """The checkpoint directory for `path`: a checkpoint itself, a run's
    `adapters` or `best`, or a run directory (its latest checkpoint)."""
    path = Path(path)
    if (path / TRAINER_STATE).exists():
        return path.resolve()
    if not path.exists():
        raise ValueError(f"resume: no such directory {str(path)!r}")
    for run, name in ((path, "adapters"), (path.parent, path.name)):
        if name in ("adapters", "best") and (run / "checkpoints").is_dir():
            target = _target(run, name)
            if target is not None:
                if not target.is_dir():
                    raise ValueError(f"resume: {run / name} holds the adapters of checkpoint {target}, "
                                     "which is gone")
                if not (target / TRAINER_STATE).exists():
                    raise ValueError(f"resume: {target / TRAINER_STATE} is missing")
                return target
    raise ValueError(
        f"resume: {str(path)!r} is neither a run directory with a checkpoint nor a "
        f"checkpoint directory (no {TRAINER_STATE})"
    )


def run_dir_of(ckpt):
    """The run directory holding checkpoint directory `ckpt` (None when outside one)."""
    ckpt = Path(ckpt).resolve()
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None


def read_adapters(path, what="adapters"):
    """{name: array} of adapters.safetensors in `path`, or ValueError."""
    file = Path(path) / ADAPTERS
    if not file.exists():
        raise ValueError(f"{what}: {file} is missing" if (Path(path) / TRAINER_STATE).exists()
                         else f"{what}: {str(path)!r} has no {ADAPTERS}")
    try:
        return mx.load(str(file))
    except Exception as e:  # a torn or foreign file: MLX raises RuntimeError/ValueError
        raise ValueError(f"{what}: cannot read {file}: {str(e).splitlines()[0]}") from None


def check_adapter_shapes(weights, model, what="adapters"):
    """ValueError unless `weights` are exactly `model`'s trainable parameters, shape for shape."""
    own = dict(tree_flatten(model.trainable_parameters()))
    missing = sorted(set(own) - set(weights))
    extra = sorted(set(weights) - set(own))
    if extra or missing:
        name = (extra or missing)[0]
        kind = "not a trainable parameter of this model" if extra else "missing from the file"
        raise ValueError(f"{what}: {name} is {kind} ({len(extra)} unexpected, {len(missing)} missing): "
                         "fine_tune_type, num_layers or lora_parameters differ from the run that wrote them")
    for name, w in weights.items():
        if tuple(w.shape) != tuple(own[name].shape):
            raise ValueError(f"{what}: {name} has shape {tuple(w.shape)}, this model's "
                             f"{tuple(own[name].shape)}: lora_parameters or the model differ")


def load_adapters(path, model, what="adapters"):
    """Loads adapters.safetensors of `path` into `model`'s trainable parameters after checking them."""
    weights = read_adapters(path, what)
    check_adapter_shapes(weights, model, what)
    model.load_weights(list(weights.items()), strict=False)
    mx.eval(model.parameters())


def _is_int(v, low=0):
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


STATE_FIELDS = (  # (key, check, what is expected)
    ("step", _is_int, "an integer >= 0"),
    ("position", _is_int, "an integer >= 0"),
    ("rng", lambda v: isinstance(v, list) and len(v) == 2 and all(_is_int(x) and x < 2**32 for x in v),
     "two integers in [0, 2**32)"),
    ("best_val", lambda v: v is None or isinstance(v, (int, float)) and not isinstance(v, bool),
     "a number or null"),
    ("best_step", lambda v: v is None or _is_int(v), "an integer >= 0 or null"),
)


def read_trainer_state(ckpt):
    """The trainer_state.json of checkpoint directory `ckpt`, checked; ValueError naming the file."""
    file = Path(ckpt) / TRAINER_STATE
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"resume: {file} is missing") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"resume: cannot read {file}: {getattr(e, 'strerror', None) or e}") from None
    try:
        state = json.loads(text)
    except ValueError as e:
        why = "it is empty" if not text.strip() else str(e)
        raise ValueError(f"resume: {file} is not valid JSON ({why}); the checkpoint is damaged") from None
    if not isinstance(state, dict):
        raise ValueError(f"resume: {file} holds {type(state).__name__}, not a trainer state object")
    for key, ok, want in STATE_FIELDS:
        if key not in state:
            raise ValueError(f"resume: {file} has no {key!r}; the checkpoint is damaged")
        if not ok(state[key]):
            raise ValueError(f"resume: {file}: {key} is {json.dumps(state[key])[:40]}; expected {want}")
    name = Path(ckpt).name
    if name.startswith("step-") and name[5:].isdigit() and int(name[5:]) != state["step"]:
        raise ValueError(f"resume: {file} is of step {state['step']}, its directory {name}")
    return state


def read_optimizer(ckpt, model, optimizer):
    """{name: array} of checkpoint `ckpt`'s optimizer.safetensors after checking it
    against `optimizer`'s state for `model`'s trainable parameters; ValueError naming the file."""
    file = Path(ckpt) / OPTIMIZER
    if not file.exists():
        raise ValueError(f"resume: {file} is missing")
    try:
        saved = mx.load(str(file))
    except Exception as e:  # a torn file: MLX raises RuntimeError/ValueError
        raise ValueError(f"resume: cannot read {file}: {str(e).splitlines()[0]}") from None
    want = {"step": (), "learning_rate": ()}
    for name, p in tree_flatten(model.trainable_parameters()):
        per_param = {}
        optimizer.init_single(mx.zeros(p.shape, p.dtype), per_param)
        want.update({f"{name}.{k}": tuple(v.shape) for k, v in per_param.items()})
    missing, extra = sorted(set(want) - set(saved)), sorted(set(saved) - set(want))
    if missing or extra:
        name = (missing or extra)[0]
        raise ValueError(f"resume: {file}: {name} is {'missing' if missing else 'unexpected'} "
                         f"({len(missing)} missing, {len(extra)} unexpected); the file does not belong "
                         "to these adapters")
    for name, shape in want.items():
        if tuple(saved[name].shape) != shape:
            raise ValueError(f"resume: {file}: {name} has shape {tuple(saved[name].shape)}, expected {shape}")
    return saved


def check_checkpoint(path, model, optimizer):
    """(trainer_state, dir) of the checkpoint at `path` after reading every file of
    it against `model` and `optimizer`; ValueError naming the first damaged file."""
    ckpt = find_checkpoint(path)
    state = read_trainer_state(ckpt)
    check_adapter_shapes(read_adapters(ckpt, "resume"), model, f"resume: {ckpt / ADAPTERS}")
    read_optimizer(ckpt, model, optimizer)
    return state, ckpt


def load_checkpoint(path, model, optimizer):
    """Loads weights and optimizer state from the checkpoint at `path` (see
    `find_checkpoint`) into `model` / `optimizer`; returns (trainer_state, dir)."""
    ckpt = find_checkpoint(path)
    state = read_trainer_state(ckpt)
    load_adapters(ckpt, model, "resume")
    optimizer.state = tree_unflatten(list(read_optimizer(ckpt, model, optimizer).items()))
    mx.eval(model.parameters(), optimizer.state)
    return state, ckpt
