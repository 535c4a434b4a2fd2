"""The training loop: data order, schedule, accumulation, exact resume, best checkpoint."""

import math

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load

from flash_cce.train.demo import demo_records, demo_words, write_demo_data
from flash_cce.train.objectives import ObjectiveConfig
from flash_cce.train.objectives import value_and_grad as real_value_and_grad
from flash_cce.train.checkpoint import published_step
from flash_cce.train.tiny import build_tiny_model
from flash_cce.train.trainer import (MemoryCanary, TrainingArgs, batch_indices, build_schedule,
                               prepare_model, read_metrics, train)


def tiny_setup(tmp_path, n_train=32, n_valid=8):
    """A tiny model directory and a small demo data directory (equal-length pairs)."""
    model_dir = build_tiny_model(tmp_path / "model", demo_words(), seed=0)
    data_dir = write_demo_data(tmp_path / "data")
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_valid)):
        path = data_dir / f"{split}.jsonl"
        path.write_text("".join(path.read_text().splitlines(keepends=True)[:n]))
    return model_dir, data_dir


def tiny_pairs(tok, split, n):
    from flash_cce.train.data import Encoder

    enc = Encoder(tok)
    return [enc.encode(r) for r in demo_records()[split][:n]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    model_dir, _ = tiny_setup(tmp)
    tok = load(str(model_dir))[1]
    return model_dir, tiny_pairs(tok, "train", 32), tiny_pairs(tok, "valid", 8)


def fresh(model_dir, fine_tune_type="lora", dropout=0.0, seed=0):
    model, _ = load(str(model_dir))
    mx.random.seed(seed)
    prepare_model(model, fine_tune_type, -1, {"rank": 4, "scale": 10.0, "dropout": dropout})
    return model


def test_batch_indices_cover_each_epoch_and_shard():
    n, bs = 10, 3
    epoch0 = [batch_indices(n, bs, p, seed=1) for p in range(3)]  # 3 full batches, 1 left out
    flat = sum(epoch0, [])
    assert len(set(flat)) == 9 and set(flat) <= set(range(n))
    assert batch_indices(n, bs, 3, seed=1) != epoch0[0] or batch_indices(n, bs, 4, seed=1) != epoch0[1]
    assert batch_indices(n, bs, 2, seed=1) == epoch0[2]  # a position fixes the batch
    ranks = [batch_indices(n, 4, 1, seed=1, rank=r, world=2) for r in (0, 1)]
    assert sorted(ranks[0] + ranks[1]) == sorted(batch_indices(n, 4, 1, seed=1))
    with pytest.raises(ValueError, match="batch_size=11"):
        batch_indices(n, 11, 0, seed=1)


def test_schedule_warmup_then_cosine():
    lr, iters, warm, low = 1e-3, 20, 5, 1e-4
    f = build_schedule(lr, iters, warm, "cosine", low)
    for step in (0, 2, 5, 12, 19):
        if step < warm:
            want = lr * step / warm
        else:
            want = low + 0.5 * (lr - low) * (1 + math.cos(math.pi * (step - warm) / (iters - warm)))
        assert abs(f(mx.array(step)).item() - want) < 1e-9  # fp32 of values ~1e-3
    with pytest.raises(ValueError, match="warmup must be in"):
        build_schedule(lr, 5, 5)


def _params(model):
    return {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}


def test_grad_accumulation_equals_large_batch(setup):
    # All demo pairs have the same length, so the mean over two micro-batches of
    # 2 is the mean over the batch of 4 and SGD's update lr * g must agree up to
    # fp32 summation order (relative ~1e-6 of the update).
    model_dir, train_pairs, _ = setup
    out = []
    for bs, accum in ((4, 1), (2, 2)):
        model = fresh(model_dir)
        before = _params(model)
        args = TrainingArgs(batch_size=bs, grad_accumulation_steps=accum, iters=1, max_grad_norm=None,
                            progress=False)
        train(model, optim.SGD(learning_rate=1.0), train_pairs, None, args, log=lambda *_: None)
        out.append({k: v - before[k] for k, v in _params(model).items()})
    assert out[0].keys() == out[1].keys()
    scale = max(np.abs(v).max() for v in out[0].values())
    assert scale > 0
    for k in out[0]:
        np.testing.assert_allclose(out[1][k], out[0][k], atol=1e-5 * scale, err_msg=k)


class Interrupt(Exception):
    pass


def test_exact_resume(setup, tmp_path):
    """Killed after step 3's checkpoint, resumed: the same losses, grad norms and
    final weights, bit for bit (same ops in the same order on the same device),
    with dropout (the PRNG state), accumulation and a warmup+cosine schedule."""
    model_dir, train_pairs, val_pairs = setup
    args = TrainingArgs(batch_size=2, grad_accumulation_steps=2, iters=6, steps_per_eval=2,
                        save_every=3, progress=False)
    obj = ObjectiveConfig()

    def run(run_dir, value_and_grad=real_value_and_grad, resume=None):
        model = fresh(model_dir, dropout=0.1)
        opt = optim.AdamW(learning_rate=build_schedule(1e-3, 6, 2), weight_decay=0.01)
        train(model, opt, train_pairs, val_pairs, args, obj, run_dir=run_dir, resume=resume,
              value_and_grad=value_and_grad, log=lambda *_: None)
        return model

    full = run(tmp_path / "full")
    calls = []

    def dies_in_step_4(model, pairs, cfg):
        calls.append(1)
        if len(calls) > 3 * args.grad_accumulation_steps:
            raise Interrupt
        return real_value_and_grad(model, pairs, cfg)

    with pytest.raises(Interrupt):
        run(tmp_path / "cut", dies_in_step_4)
    resumed = run(tmp_path / "cut", resume=tmp_path / "cut")

    def trajectory(run_dir):
        return [(r["split"], r["step"], r["loss"], r.get("grad_norm")) for r in read_metrics(run_dir)]

    assert trajectory(tmp_path / "cut") == trajectory(tmp_path / "full")
    a, b = _params(full), _params(resumed)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_metrics_records_and_best_checkpoint(setup, tmp_path):
    model_dir, train_pairs, val_pairs = setup
    model = fresh(model_dir)
    args = TrainingArgs(batch_size=4, iters=6, steps_per_eval=2, save_every=0, keep_checkpoints=1,
                        progress=False)
    evals = []
    train(model, optim.AdamW(learning_rate=3e-3), train_pairs, val_pairs, args, run_dir=tmp_path,
          on_eval=evals.append, log=lambda *_: None)
    records = read_metrics(tmp_path)
    steps = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in steps] == list(range(1, 7))
    for key in ("loss", "rewards/accuracies", "rewards/margins", "nll_loss", "learning_rate",
                "grad_norm", "tokens", "tokens_per_second", "active_memory_gb", "peak_memory_gb"):
        assert all(math.isfinite(r[key]) for r in steps), key
    assert all(r["tokens"] == 4 * 32 for r in steps)  # 4 pairs of 2 x 16 tokens
    valid = [r for r in records if r["split"] == "valid"]
    assert [r["step"] for r in valid] == [0, 2, 4, 6] and valid == evals
    best_step = min(valid[1:], key=lambda r: r["loss"])["step"]
    assert published_step(tmp_path / "best") == best_step
    assert published_step(tmp_path / "adapters") == published_step(tmp_path) == 6
    with pytest.raises(ValueError, match="already holds checkpoints"):
        train(model, optim.AdamW(learning_rate=1e-3), train_pairs, val_pairs, args, run_dir=tmp_path,
              log=lambda *_: None)


def test_memory_canary():
    canary = MemoryCanary(0.25, settle=2)
    base = 100 * 2**20
    assert canary.check(1, 5 * base) is None  # before settling: ignored
    assert canary.check(2, base) is None
    assert canary.check(3, int(1.2 * base)) is None  # within 25% + 64 MiB
    msg = canary.check(4, 2 * base + 64 * 2**20)
    assert msg and "step 2" in msg and "step 4" in msg
    assert canary.check(5, 3 * base) is None  # warns once


def test_bad_training_args():
    with pytest.raises(ValueError, match="grad_accumulation_steps: got 0; allowed: an integer >= 1"):
        TrainingArgs(grad_accumulation_steps=0).validate()
    with pytest.raises(ValueError, match="max_grad_norm"):
        TrainingArgs(max_grad_norm=0).validate()


@pytest.mark.parametrize("name", ["orpo", "simpo", "orpo_margin", "dpo", "sft"])
def test_each_objective_trains(setup, name):
    model_dir, train_pairs, val_pairs = setup
    model = fresh(model_dir)
    before = _params(model)
    evals = []
    args = TrainingArgs(batch_size=4, iters=1, progress=False)
    train(model, optim.AdamW(learning_rate=1e-3), train_pairs, val_pairs, args,
          ObjectiveConfig(name=name), on_eval=evals.append, log=lambda *_: None)
    assert all(math.isfinite(r["loss"]) for r in evals) and len(evals) == 2
    assert any(not np.array_equal(v, before[k]) for k, v in _params(model).items())


def test_qlora_quantizes_the_base_and_trains_adapters(setup):
    import mlx.nn as nn

    model_dir, train_pairs, _ = setup
    model, _ = load(str(model_dir))
    prepare_model(model, "lora", -1, {"rank": 4, "scale": 10.0, "dropout": 0.0},
                  quantize={"bits": 4, "group_size": 32})
    q = model.layers[0].self_attn.q_proj
    assert isinstance(q.linear, nn.QuantizedLinear) and q.linear.bits == 4
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)  # the tied head too
    names = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert names and all(k.endswith(("lora_a", "lora_b")) for k in names)
    before = _params(model)
    train(model, optim.AdamW(learning_rate=1e-3), train_pairs, None,
          TrainingArgs(batch_size=4, iters=1, progress=False), log=lambda *_: None)
    assert any(not np.array_equal(v, before[k]) for k, v in _params(model).items())
    with pytest.raises(ValueError, match="needs fine_tune_type 'lora' or 'dora'"):
        prepare_model(load(str(model_dir))[0], "full", -1, quantize={"bits": 4})
