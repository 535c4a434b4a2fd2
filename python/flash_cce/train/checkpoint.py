"""Atomic training checkpoints in mlx-lm's adapter format.

A run directory holds

    checkpoints/step-0000100/   adapters.safetensors, adapter_config.json  (mlx-lm's format)
                                optimizer.safetensors, trainer_state.json  (for --resume)
    adapters -> checkpoints/step-...   the latest checkpoint
    best     -> checkpoints/step-...   the best validation checkpoint

A checkpoint is written into a hidden temporary directory and renamed into place,
and the `adapters` / `best` links are replaced by rename, so a kill at any moment
leaves the previous complete checkpoint reachable. `adapters` and `best` are valid
`--adapter-path` arguments for `mlx_lm.generate` and `mlx_lm.fuse`.
"""

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

ADAPTERS = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
OPTIMIZER = "optimizer.safetensors"
TRAINER_STATE = "trainer_state.json"


class Interrupted(Exception):
    """Training stopped on request after `step`, whose checkpoint `ckpt` was written."""

    def __init__(self, step, ckpt):
        super().__init__(f"interrupted after step {step}")
        self.step, self.ckpt = step, ckpt


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_adapters(path, model, adapter_config):
    """adapters.safetensors (the trainable parameters) and adapter_config.json in `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / ADAPTERS), dict(tree_flatten(model.trainable_parameters())))
    _fsync_file(path / ADAPTERS)
    _write_json(path / ADAPTER_CONFIG, adapter_config)


def rng_state():
    """The global MLX PRNG key as two ints (restored by `set_rng_state`)."""
    return [int(x) for x in mx.random.state[0].tolist()]


def set_rng_state(key):
    hi, lo = key
    mx.random.seed((int(hi) << 32) | int(lo))  # seed(k) sets the key to [k >> 32, k & 0xffffffff]


def link(run_dir, name, target):
    tmp = run_dir / f".{name}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(os.path.relpath(target, run_dir), tmp)
    os.replace(tmp, run_dir / name)


def _target(run_dir, name):
    link = Path(run_dir) / name
    return link.resolve() if link.is_symlink() else None


def step_dir(run_dir, step):
    return Path(run_dir) / "checkpoints" / f"step-{step:07d}"


def save_checkpoint(run_dir, step, model, optimizer, trainer_state, adapter_config,
                    best=False, keep=2):
    """Writes checkpoint `step` atomically, points `adapters` (and `best` when
    `best`) at it and deletes all but the `keep` newest others and `best`."""
    run_dir = Path(run_dir)
    final = step_dir(run_dir, step)
    if not final.exists():
        tmp = final.parent / f".tmp-{final.name}"
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a run killed mid-write
        write_adapters(tmp, model, adapter_config)
        mx.save_safetensors(str(tmp / OPTIMIZER), dict(tree_flatten(optimizer.state)))
        _fsync_file(tmp / OPTIMIZER)
        _write_json(tmp / TRAINER_STATE, dict(trainer_state, step=step))
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
    link(run_dir, "adapters", final)
    if best:
        link(run_dir, "best", final)
    _prune(run_dir, keep)
    return final


def _prune(run_dir, keep):
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"))
    protected = {_target(run_dir, "adapters"), _target(run_dir, "best")}
    for old in ckpts[: max(len(ckpts) - keep, 0)]:
        if old.resolve() not in protected:
            shutil.rmtree(old)


def find_checkpoint(path):
    """The checkpoint directory for `path`: a checkpoint itself (also through a
    run's `adapters` or `best` link), or a run directory (its latest checkpoint)."""
    path = Path(path)
    if (path / TRAINER_STATE).exists():
        return path.resolve()
    if (path / "adapters" / TRAINER_STATE).exists():
        return (path / "adapters").resolve()
    if not path.exists():
        raise ValueError(f"resume: no such directory {str(path)!r}")
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
        raise ValueError(f"{what}: {str(path)!r} has no {ADAPTERS}")
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


def load_checkpoint(path, model, optimizer):
    """Loads weights and optimizer state from the checkpoint at `path` (see
    `find_checkpoint`) into `model` / `optimizer`; returns (trainer_state, dir)."""
    ckpt = find_checkpoint(path)
    load_adapters(ckpt, model, "resume")
    optimizer.state = tree_unflatten(list(mx.load(str(ckpt / OPTIMIZER)).items()))
    with open(ckpt / TRAINER_STATE) as f:
        state = json.load(f)
    mx.eval(model.parameters(), optimizer.state)
    return state, ckpt
