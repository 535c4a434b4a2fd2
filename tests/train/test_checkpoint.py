"""Checkpoints: mlx-lm reads the adapters (load, generate, fuse); a crash at any
point of a write leaves the previous checkpoint loadable."""

import os
import subprocess
import sys

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load

from flash_cce.train import checkpoint
from flash_cce.train.trainer import TrainingArgs, train
from test_trainer import fresh, setup  # noqa: F401  (module fixture)

PROMPT = "tom has a red ball . what color is the ball ?"


def _logits(model, tok):
    return np.array(model(mx.array([tok.encode(PROMPT)])))


def _train(model_dir, pairs, run_dir, fine_tune_type, iters=2):
    model = fresh(model_dir, fine_tune_type)
    cfg = {"fine_tune_type": fine_tune_type, "num_layers": -1,
           "lora_parameters": {"rank": 4, "scale": 10.0, "dropout": 0.0}}
    args = TrainingArgs(batch_size=4, iters=iters, save_every=1, progress=False)
    train(model, optim.AdamW(learning_rate=1e-2), pairs, None, args, run_dir=run_dir,
          adapter_config=cfg, log=lambda *_: None)
    return model


@pytest.mark.parametrize("fine_tune_type", ["lora", "dora", "full"])
def test_adapters_load_in_mlx_lm(setup, tmp_path, fine_tune_type):  # noqa: F811
    model_dir, pairs, _ = setup
    trained = _train(model_dir, pairs, tmp_path, fine_tune_type)
    trained.eval()
    loaded, tok = load(str(model_dir), adapter_path=str(tmp_path / "adapters"))
    base, _ = load(str(model_dir))
    want = _logits(trained, tok)
    assert np.abs(want - _logits(base, tok)).max() > 1e-3  # training changed the model
    np.testing.assert_array_equal(_logits(loaded, tok), want)  # same weights, same ops


def test_mlx_lm_generate_and_fuse(setup, tmp_path):  # noqa: F811
    model_dir, pairs, _ = setup
    trained = _train(model_dir, pairs, tmp_path / "run", "lora")
    trained.eval()
    adapters = str(tmp_path / "run" / "adapters")
    gen = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--model", str(model_dir),
                          "--adapter-path", adapters, "--prompt", PROMPT, "--max-tokens", "3"],
                         capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    fused_dir = tmp_path / "fused"
    fuse = subprocess.run([sys.executable, "-m", "mlx_lm", "fuse", "--model", str(model_dir),
                           "--adapter-path", adapters, "--save-path", str(fused_dir)],
                          capture_output=True, text=True, timeout=120)
    assert fuse.returncode == 0, fuse.stderr
    fused, tok = load(str(fused_dir))
    # Fusing folds scale * B^T A^T into W: fp32 rounding of a sum of products of
    # O(1) values over 64 inputs, then 2 layers; 1e-4 is ~100x that rounding.
    np.testing.assert_allclose(_logits(fused, tok), _logits(trained, tok), atol=1e-4)


def _weights(path):
    return {k: np.array(v) for k, v in mx.load(str(path / checkpoint.ADAPTERS)).items()}


class Crash(Exception):
    pass


def _crash_in(monkeypatch, target, name, after=0):
    real = getattr(target, name)
    calls = []

    def boom(*args, **kwargs):
        calls.append(1)
        if len(calls) > after:
            raise Crash(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, boom)


# Every write step of save_checkpoint, in order: the tensors, the optimizer
# state, the JSON files, the rename into place, the link swap.
CRASH_POINTS = [
    (mx, "save_safetensors", 0),
    (mx, "save_safetensors", 1),
    (checkpoint, "_write_json", 0),
    (checkpoint, "_write_json", 1),
    (os, "rename", 0),
    (os, "replace", 0),
]


@pytest.mark.parametrize("target,name,after", CRASH_POINTS)
def test_crash_during_checkpoint_keeps_last_one(setup, tmp_path, monkeypatch, target, name, after):  # noqa: F811
    model_dir, pairs, _ = setup
    model = _train(model_dir, pairs, tmp_path, "lora", iters=1)
    good = _weights(tmp_path / "adapters")
    opt = optim.AdamW(learning_rate=1e-2)
    opt.init(model.trainable_parameters())
    model.update(tree_map_add(model.trainable_parameters(), 1.0))  # step 2 differs from step 1
    with monkeypatch.context() as m:
        _crash_in(m, target, name, after)
        with pytest.raises(Crash):
            checkpoint.save_checkpoint(tmp_path, 2, model, opt, {"position": 2}, {}, keep=5)
    # The run still resumes from step 1, whole.
    latest = checkpoint.find_checkpoint(tmp_path)
    weights = _weights(latest)
    assert latest.name == "step-0000001"
    assert weights.keys() == good.keys() and all(np.array_equal(weights[k], good[k]) for k in good)
    restored = fresh(model_dir)
    state, _ = checkpoint.load_checkpoint(tmp_path, restored, optim.AdamW(learning_rate=1e-2))
    assert state["step"] == 1
    # The next save finishes the job.
    checkpoint.save_checkpoint(tmp_path, 2, model, opt, {"position": 2}, {}, keep=5)
    assert checkpoint.find_checkpoint(tmp_path).name == "step-0000002"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def tree_map_add(params, x):
    from mlx.utils import tree_map

    return tree_map(lambda p: p + x, params)


def test_prune_keeps_newest_and_best(setup, tmp_path):  # noqa: F811
    model_dir, pairs, _ = setup
    model = fresh(model_dir)
    opt = optim.AdamW(learning_rate=1e-2)
    opt.init(model.trainable_parameters())
    for step in range(1, 6):
        checkpoint.save_checkpoint(tmp_path, step, model, opt, {}, {}, best=step == 2, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-0000002", "step-0000004", "step-0000005"]
    assert checkpoint.published_step(tmp_path / "best") == 2
    with pytest.raises(ValueError, match="neither a run directory"):
        checkpoint.find_checkpoint(tmp_path / "checkpoints")


def test_rng_state_round_trip():
    mx.random.seed(7)
    mx.random.uniform(shape=(3,))
    key = checkpoint.rng_state()
    want = mx.random.uniform(shape=(4,))
    mx.random.seed(123)
    checkpoint.set_rng_state(key)
    assert mx.array_equal(mx.random.uniform(shape=(4,)), want)


def test_trainable_parameters_are_what_is_saved(setup, tmp_path):  # noqa: F811
    model_dir, pairs, _ = setup
    model = _train(model_dir, pairs, tmp_path, "lora", iters=1)
    saved = _weights(tmp_path / "adapters")
    names = {k for k, _ in tree_flatten(model.trainable_parameters())}
    assert set(saved) == names and all(k.endswith(("lora_a", "lora_b")) for k in names)
