"""`flash-cce train` as a user runs it (a process per command) when training
diverges, the disk fills up or a checkpoint is damaged: one line, the right exit
status, and the run left with a usable checkpoint."""

import errno
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from runs import (console_script, flash_cce, metrics, ok, one_line_error, same_weights, snapshot, train_argv,
                  weights)
from test_cli_runs import copy_run, env  # noqa: F401 (module fixture: a finished 6-step run)

from flash_cce.train.checkpoint import published_step


def train_records(run):
    return [r for r in map(json.loads, (Path(run) / "metrics.jsonl").read_text().splitlines())
            if r["split"] == "train"]


# ---- non-finite steps ------------------------------------------------------

# On the tiny model a learning rate of 1e3 without clipping drives the loss to
# NaN after a few steps (step 8 on a 2-core x86-64 CPU); 1e8 at step 3.
# AdamW's decoupled decay at learning rate 1e3 scales the weights by 1 - 1e3 * 0.01 = -9 a
# step: they overflow within a few steps (Adam's own steps alone stay bounded by the rate).
DIVERGE = ("--learning-rate", "1e3", "--max-grad-norm", "null", "--max-nonfinite-steps", "3",
           "--weight-decay", "0.01")


def test_nonfinite_steps_are_skipped_and_the_run_stops_at_the_last_finite_checkpoint(env, tmp_path):
    _, model_dir, data_dir, _ = env
    run = tmp_path / "r"
    proc = flash_cce(*train_argv(model_dir, data_dir, run, 30, *DIVERGE, "--keep-checkpoints", "1",
                                 "--save-every", "1"))
    records = train_records(run)
    bad = [r["step"] for r in records if not math.isfinite(r["loss"])]
    assert bad, "the run never diverged: the test needs a non-finite step"
    first = bad[0]
    # Three in a row stop the run, counted in the metrics with TRL-style names.
    assert bad == [first, first + 1, first + 2] and records[-1]["step"] == first + 2
    assert [r["nonfinite/consecutive"] for r in records[-3:]] == [1, 2, 3]
    assert [r["nonfinite/skipped_steps"] for r in records[-3:]] == [1, 2, 3]
    assert all(r["nonfinite/skipped_steps"] == 0 for r in records[:-3])
    # The last checkpoint (one per step) whose weights gave a finite loss: those of
    # step first - 2, used by step first - 1; or first - 1's when its validation
    # (every 2 steps) was finite and the best so far.
    valid = {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if r["split"] == "valid" and r["step"] > 0}
    earlier = [v for s, v in valid.items() if s < first - 1 and math.isfinite(v)]
    last = valid.get(first - 1, math.nan)
    good = first - 1 if math.isfinite(last) and (not earlier or last < min(earlier)) else first - 2
    err = one_line_error(proc, f"stopped after step {first + 2}: 3 non-finite steps in a row",
                         f"step-{good:07d}", rc=3)
    assert "--resume" in err
    assert published_step(run / "adapters") == published_step(run) == good
    assert (run / "checkpoints" / f"step-{good:07d}").is_dir()  # kept though keep_checkpoints is 1
    for where in (run / "adapters", run, run / "best"):
        assert all(np.isfinite(w).all() for w in weights(where).values())
    assert same_weights(run, run / "checkpoints" / f"step-{good:07d}")
    assert valid[published_step(run / "best")] == min(v for v in valid.values() if math.isfinite(v))
    assert not (run / "run.lock").exists()
    # The command it names continues the run from there.
    ok(flash_cce("train", "--resume", run / "checkpoints" / f"step-{good:07d}", "--learning-rate", "1e-3",
                 "--max-grad-norm", "1", "--iters", str(first + 4)))
    assert published_step(run) == first + 4


def test_a_non_finite_first_validation_never_becomes_best(env, tmp_path):
    _, model_dir, data_dir, _ = env
    run = tmp_path / "r"
    proc = flash_cce(*train_argv(model_dir, data_dir, run, 30, *DIVERGE[2:], "--learning-rate", "1e8"))
    valid = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if r["split"] == "valid" and r["step"] > 0]
    assert valid and not math.isfinite(valid[0]["loss"]), "the first validation must be non-finite here"
    one_line_error(proc, "no checkpoint gave a finite loss", rc=3)
    assert not (run / "best").exists() and not (run / "adapters").exists()
    assert not (run / "adapters.safetensors").exists()


# ---- the run directory as folders -----------------------------------------


def test_adapters_best_and_the_run_itself_are_adapter_folders(env, tmp_path):
    from mlx_lm.utils import load

    _, model_dir, _, ref = env
    for name in ("adapters", "best"):
        assert (ref / name).is_dir() and not (ref / name).is_symlink()
    copied = tmp_path / "copied"
    subprocess.run(["cp", "-r", str(ref / "adapters"), str(copied)], check=True)
    assert not any(p.is_symlink() for p in copied.iterdir())
    latest = ref / "checkpoints" / f"step-{published_step(ref):07d}"
    assert published_step(ref) == published_step(ref / "adapters") == 6
    tokens = mx.array([[1, 2, 3, 4]])
    want = np.array(load(str(model_dir), adapter_path=str(latest))[0](tokens))
    for path in (ref, copied, ref / "adapters"):  # mlx_lm.generate --adapter-path PATH loads these
        model, _ = load(str(model_dir), adapter_path=str(path))
        np.testing.assert_array_equal(np.array(model(tokens)), want)
    gen = subprocess.run([*console_script("mlx_lm.generate"), "--model", str(model_dir), "--adapter-path",
                          str(ref), "--prompt", "tom has", "--max-tokens", "2"],
                         capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0 and "==========" in gen.stdout, gen.stderr[-2000:]


def test_a_run_with_links_of_an_older_version_resumes_into_folders(env, tmp_path):
    _, _, _, ref = env
    run = copy_run(ref, tmp_path / "r")
    best = published_step(run / "best")
    for name, step in (("adapters", 6), ("best", best)):
        shutil.rmtree(run / name)
        (run / name).symlink_to(Path("checkpoints") / f"step-{step:07d}")
    for f in ("adapters.safetensors", "adapter_config.json"):
        (run / f).unlink()
    ok(flash_cce("train", "--resume", run, "--iters", "8"))
    assert not (run / "adapters").is_symlink() and not (run / "best").is_symlink()
    assert published_step(run) == published_step(run / "adapters") == 8
    assert metrics(run)[:len(metrics(ref))] == metrics(ref)


# ---- storage faults --------------------------------------------------------


def test_a_full_disk_at_the_start_leaves_no_lock(env, tmp_path):
    _, model_dir, data_dir, _ = env
    run = tmp_path / "r"
    argv = train_argv(model_dir, data_dir, run, 2)
    proc = flash_cce(*argv, file_size_limit=16)  # smaller than the lock's JSON
    one_line_error(proc, f"cannot write {run / 'run.lock'}: file too large")
    assert not (run / "run.lock").exists() and not list(run.glob(".run.lock*"))
    assert "stale lock" not in ok(flash_cce(*argv)).stdout


def test_an_empty_lock_of_an_older_version_is_taken_over_by_name(env, tmp_path):
    _, _, _, ref = env
    run = copy_run(ref, tmp_path / "r")
    (run / "run.lock").write_text("")
    out = ok(flash_cce("train", "--resume", run, "--iters", "7")).stdout
    assert f"found an unreadable lock file {run / 'run.lock'}; taking it over" in out and "process None" not in out
    assert not (run / "run.lock").exists()


@pytest.mark.parametrize("file, limit", [
    ("config.yaml", lambda run: 400),  # the lock fits, config.yaml does not
    ("metrics.jsonl", lambda run: (run / "metrics.jsonl").stat().st_size + 100),  # one more record does not
    ("checkpoints/step-0000008/optimizer.safetensors",  # the adapters fit, the optimizer state does not
     lambda run: (run / "adapters" / "adapters.safetensors").stat().st_size + 1000),
])
def test_a_full_disk_while_training_is_one_line_and_keeps_the_last_checkpoint(env, tmp_path, file, limit):
    _, _, _, ref = env
    run = copy_run(ref, tmp_path / "r")
    before = {p: snapshot(run / p) for p in ("checkpoints", "adapters", "best", "adapters.safetensors")}
    proc = flash_cce("train", "--resume", run, "--iters", "8", file_size_limit=limit(run))
    err = one_line_error(proc, f"cannot write {run / file}: ")
    if "checkpoints" in file:
        assert "the last complete checkpoint is" in err and "step-0000006" in err
    assert {p: snapshot(run / p) for p in before} == before  # the last checkpoint as it was
    assert not (run / "run.lock").exists() and not list(run.rglob(".tmp-*")) and not list(run.glob("*.tmp"))
    # It resumes from there as if nothing had happened.
    ok(flash_cce("train", "--resume", run, "--iters", "8"))
    assert published_step(run) == 8 and metrics(run)[:len(metrics(ref))] == metrics(ref)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EROFS])
def test_each_kind_of_failed_checkpoint_write_is_one_line(env, tmp_path, monkeypatch, capsys, code):
    """In this process (the same `main`): MLX's tensor write fails as the OS says."""
    from flash_cce.train.cli import main
    from flash_cce.train.storage import REASONS

    _, model_dir, data_dir, _ = env
    run = tmp_path / "r"
    real = mx.save_safetensors

    def failing(path, *a, **k):
        if "step-0000004" in path:
            raise OSError(code, os.strerror(code))
        return real(path, *a, **k)

    monkeypatch.setattr(mx, "save_safetensors", failing)
    assert main([str(a) for a in train_argv(model_dir, data_dir, run, 6)]) == 2
    err = capsys.readouterr().err.strip()
    ckpts = run / "checkpoints"
    assert err == (f"flash-cce train: error: cannot write {ckpts / 'step-0000004' / 'adapters.safetensors'}: "
                   f"{REASONS[code]}; the last complete checkpoint is {ckpts / 'step-0000002'}")
    assert published_step(run) == published_step(run / "adapters") == 2
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-0000002"] and not (run / "run.lock").exists()


def test_a_full_disk_while_plotting_is_one_line(env, tmp_path):
    _, _, _, ref = env
    run = copy_run(ref, tmp_path / "r")
    before = (run / "plot.png").read_bytes() if (run / "plot.png").exists() else None  # drawn at validation
    one_line_error(flash_cce("plot", run, file_size_limit=100), f"cannot write {run / 'plot.png'}: ")
    after = (run / "plot.png").read_bytes() if (run / "plot.png").exists() else None
    assert after == before and not list(run.glob(".plot.png*"))


# ---- resume from a damaged checkpoint -------------------------------------


def _damage(run, case):
    """Damages run's latest checkpoint (step 6) as `case` says; returns the file named."""
    ckpt = run / "checkpoints" / "step-0000006"
    if case == "optimizer missing":
        (ckpt / "optimizer.safetensors").unlink()
        return ckpt / "optimizer.safetensors"
    if case == "optimizer truncated":
        path = ckpt / "optimizer.safetensors"
        data = path.read_bytes()
        path.unlink()  # a file of its own (not the adapters' links)
        path.write_bytes(data[: len(data) // 2])
        return path
    if case == "trainer state empty":
        (ckpt / "trainer_state.json").write_text("")
        return ckpt / "trainer_state.json"
    if case == "adapters mismatched":
        path = ckpt / "adapters.safetensors"
        tensors = mx.load(str(path))
        name = sorted(tensors)[0]
        tensors[name] = mx.zeros((3, 3))
        path.unlink()
        mx.save_safetensors(str(path), tensors)
        return path
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["optimizer missing", "optimizer truncated", "trainer state empty",
                                  "adapters mismatched"])
def test_resume_from_a_damaged_checkpoint_names_the_file_and_writes_nothing(env, tmp_path, case):
    _, _, _, ref = env
    run = copy_run(ref, tmp_path / "r")
    named = _damage(run, case)
    before = snapshot(run)
    one_line_error(flash_cce("train", "--resume", run, "--iters", "8"), "resume: ", str(named))
    assert snapshot(run) == before


def test_resume_with_iters_below_the_checkpoint_is_refused(env, tmp_path):
    _, _, _, ref = env
    run = copy_run(ref, tmp_path / "r")
    before = snapshot(run)
    one_line_error(flash_cce("train", "--resume", run, "--iters", "4"), "iters: got 4, below step 6")
    assert snapshot(run) == before
    ok(flash_cce("train", "--resume", run, "--iters", "6"))  # at its step: nothing left to train
    assert metrics(run) == metrics(ref) and published_step(run) == 6
