"""Reference log-probs for DPO and KTO: a frozen model (full fine-tuning), a
precomputed table, and the table's fingerprint."""

import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map

from flash_cce.train import losses
from flash_cce.train.objectives import ObjectiveConfig, value_and_grad
from flash_cce.train.reference import (AdaptersOff, FrozenModel, Precomputed, fingerprint, load_table,
                                 pair_key, precompute, save_table)
from models import tiny_model
from test_objectives import _close, _grads_close, _pairs, _ref_stats, _ref_value_and_grad


def _moved(model, seed=1):
    """`model` with every weight moved a little: a policy some steps past its base."""
    mx.random.seed(seed)
    model.update(tree_map(lambda p: p + 0.02 * mx.random.normal(p.shape), model.parameters()))
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("loss_type, quantized", [("sigmoid", False), ("ipo", False), ("sigmoid", True)])
def test_frozen_model_is_the_reference_of_full_fine_tuning(loss_type, quantized):
    from flash_cce.train.preflight import quantize_model

    policy = _moved(tiny_model("llama"))
    base = tiny_model("llama")
    if quantized:  # a 4-bit reference: its own log-probs, whatever they lose to rounding
        quantize_model(base, {"bits": 4, "group_size": 32})
    pairs = _pairs(11)
    cfg = ObjectiveConfig(name="dpo", beta=0.3, loss_type=loss_type, reference=FrozenModel(base))
    loss, grads, metrics = value_and_grad(policy, pairs, cfg)
    ref = {k: mx.stop_gradient(v) for k, v in _ref_stats(base, pairs).items()}
    want_loss, want_grads = _ref_value_and_grad(policy, pairs, cfg, ref)
    _close(loss, want_loss)
    _grads_close(grads, want_grads)
    assert abs(metrics["rewards/margins"].item()) > 1e-4  # the policy has moved from its reference
    assert not tree_flatten(base.trainable_parameters())  # frozen


def test_precomputed_table_equals_adapters_off():
    model = tiny_model("qwen3", lora=True)
    pairs = _pairs(12)
    cfg = ObjectiveConfig(name="dpo", beta=0.2, loss_type="robust", label_smoothing=0.1)
    table = precompute(AdaptersOff(), model, pairs, cfg, losses.get("dpo"), log=lambda *a: None)
    assert set(table) == {pair_key(p) for p in pairs}
    live = value_and_grad(model, pairs, cfg)
    stored = value_and_grad(model, pairs, ObjectiveConfig(**{**cfg.__dict__, "reference": Precomputed(table)}))
    _close(stored[0], live[0])
    _grads_close(stored[1], live[1])
    other = _pairs(13)
    with pytest.raises(ValueError, match=r"pairs\[0\] is not among the precomputed"):
        value_and_grad(model, other, ObjectiveConfig(name="dpo", reference=Precomputed(table)))


def test_fingerprint_follows_model_settings_and_tokens(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"\x00" * 100)
    pairs = _pairs(14)
    settings = {"reference": "adapters_off"}
    base = fingerprint(model_dir, settings, pairs)
    assert fingerprint(model_dir, settings, list(reversed(pairs))) == base  # order does not matter
    changed = [pairs[0].__class__(pairs[0].chosen[:-1] + [1], *[getattr(pairs[0], k) for k in
                                                                ("rejected", "chosen_prompt_len",
                                                                 "rejected_prompt_len")])] + pairs[1:]
    assert fingerprint(model_dir, settings, changed) != base
    assert fingerprint(model_dir, {"reference": "model"}, pairs) != base
    (model_dir / "model.safetensors").write_bytes(b"\x00" * 99 + b"\x01")
    moved = fingerprint(model_dir, settings, pairs)
    assert moved != base
    table = {pair_key(p): (-1.5 * i, -2.25 * i) for i, p in enumerate(pairs)}
    save_table(tmp_path / "t.npz", table, moved)
    assert load_table(tmp_path / "t.npz", moved) == table
    assert load_table(tmp_path / "t.npz", base) is None
    assert load_table(tmp_path / "missing.npz", base) is None


def test_full_fine_tuning_dpo_through_the_cli(tmp_path, capsys):
    """dpo with fine_tune_type full: a frozen copy of the base is the reference;
    with precompute_ref_log_probs a table of every pair, reused on resume."""
    from flash_cce.train.cli import main
    from flash_cce.train.reference import TABLE
    from flash_cce.train.trainer import read_metrics
    from test_cli import _train_argv
    from test_trainer import tiny_setup

    model_dir, data_dir = tiny_setup(tmp_path, n_train=16, n_valid=4)
    full = ("--objective", "dpo", "--fine-tune-type", "full", "--beta", "0.5")
    live = tmp_path / "live"
    assert main(_train_argv(model_dir, data_dir, live, 4, *full)) == 0
    assert "Reference: the frozen model" in capsys.readouterr().out

    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert main(_train_argv(model_dir, data_dir, straight, 4, *full, "--precompute-ref-log-probs")) == 0
    assert "Reference log-probs of 20 pairs computed" in capsys.readouterr().out
    assert main(_train_argv(model_dir, data_dir, cut, 2, *full, "--precompute-ref-log-probs")) == 0
    table = (cut / TABLE).read_bytes()
    capsys.readouterr()
    assert main(["train", "--resume", str(cut), "--iters", "4"]) == 0
    assert f"Reference log-probs of 20 pairs read from {cut / TABLE}" in capsys.readouterr().out
    assert (cut / TABLE).read_bytes() == table

    def trace(run):
        return [(r["split"], r["step"], r["loss"], r["rewards/margins"]) for r in read_metrics(run)]

    assert trace(cut) == trace(straight)
    # The table holds what the live frozen model gives: the same run, within float32 rounding.
    for a, b in zip(trace(live), trace(straight)):
        assert a[:2] == b[:2] and abs(a[2] - b[2]) <= 1e-5 * max(1.0, abs(a[2]))
    assert trace(live)[-1][3] != 0.0  # the policy left its reference
    # eval of the full run: the trained weights against the base, as in training.
    capsys.readouterr()
    assert main(["eval", "--adapter-path", str(straight / "adapters"), "--split", "valid"]) == 0
    out = capsys.readouterr().out
    assert "Reference: the frozen model" in out
    last_valid = [r for r in read_metrics(straight) if r["split"] == "valid"][-1]
    shown = dict(line.split()[:2] for line in out.splitlines() if line.startswith(("loss ", "rewards/margins ")))
    assert float(shown["loss"]) == pytest.approx(last_valid["loss"], abs=1e-4)  # 4 decimals shown
    assert float(shown["rewards/margins"]) == pytest.approx(last_valid["rewards/margins"], abs=1e-4)
    # A 4-bit reference.
    assert main(_train_argv(model_dir, data_dir, tmp_path / "q", 1, *full,
                            "--reference-quantize-bits", "4", "--reference-quantize-group-size", "32")) == 0
    assert "(4-bit)" in capsys.readouterr().out


def test_kto_precomputed_references_equal_the_live_ones(tmp_path, capsys):
    """kto with precompute_ref_log_probs: one table entry per example (its
    completion and its KL completion, both fixed when the data is loaded); the run
    equals the live reference's within float32 rounding, and resumes exactly."""
    from flash_cce.train.cli import main
    from flash_cce.train.reference import TABLE
    from flash_cce.train.trainer import read_metrics
    from test_cli import _train_argv, _trim
    from test_trainer import tiny_setup

    model_dir, data_dir = tiny_setup(tmp_path)
    kto = ("--objective", "kto", "--beta", "0.5", "--batch-size", "4")
    unpaired = _trim(data_dir / "unpaired", 12)
    live, straight, cut = tmp_path / "live", tmp_path / "straight", tmp_path / "cut"
    assert main(_train_argv(model_dir, unpaired, live, 4, *kto)) == 0
    capsys.readouterr()
    assert main(_train_argv(model_dir, unpaired, straight, 4, *kto, "--precompute-ref-log-probs")) == 0
    n = sum(1 for split in ("train", "valid") for _ in open(unpaired / f"{split}.jsonl"))
    assert f"Reference log-probs of {n} pairs computed" in capsys.readouterr().out
    assert main(_train_argv(model_dir, unpaired, cut, 2, *kto, "--precompute-ref-log-probs")) == 0
    assert main(["train", "--resume", str(cut), "--iters", "4"]) == 0
    assert f"Reference log-probs of {n} pairs read from {cut / TABLE}" in capsys.readouterr().out

    def trace(run):
        return [(r["split"], r["step"], r["loss"], r["kl"]) for r in read_metrics(run)]

    assert trace(cut) == trace(straight)
    for a, b in zip(trace(live), trace(straight)):
        assert a[:2] == b[:2]
        assert abs(a[2] - b[2]) <= 1e-5 * max(1.0, abs(a[2])) and abs(a[3] - b[3]) <= 1e-5 * max(1.0, abs(a[3]))
    assert any(r[3] > 0 for r in trace(live))  # the KL estimate is not clamped away everywhere


def test_reference_settings_are_checked(tmp_path, capsys):
    from flash_cce.train.cli import main
    from test_cli import _train_argv
    from test_trainer import tiny_setup

    model_dir, data_dir = tiny_setup(tmp_path, n_train=8, n_valid=4)
    assert main(_train_argv(model_dir, data_dir, tmp_path / "r", 1, "--objective", "dpo",
                            "--fine-tune-type", "full", "--reference", "adapters_off")) == 2
    assert "reference: adapters_off needs fine_tune_type lora" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_fresh_run_accepts_a_directory_holding_only_its_reference_table(tmp_path):
    """A run stopped after the precompute, before its first checkpoint, starts again."""
    from flash_cce.train.cli import main
    from flash_cce.train.reference import TABLE
    from test_cli import _train_argv
    from test_trainer import tiny_setup

    model_dir, data_dir = tiny_setup(tmp_path, n_train=8, n_valid=4)
    run = tmp_path / "run"
    argv = _train_argv(model_dir, data_dir, run, 1, "--objective", "dpo", "--precompute-ref-log-probs")
    assert main(argv) == 0
    for p in run.iterdir():
        if p.name != TABLE:
            p.unlink() if p.is_symlink() or not p.is_dir() else shutil.rmtree(p)
    assert main(argv) == 0
