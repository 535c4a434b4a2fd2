"""Data-parallel training: 2 ranks over MLX's ring backend on localhost equal one
process at the same global batch, and a 2-rank checkpoint resumes in 1 process.

The pairs have different lengths, so the ORPO NLL's token mean only matches when
the ranks normalise by the whole batch's token count (not their own).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runs import console_script
from test_trainer import tiny_setup

STEPS = 4
# The ranks reduce float32 sums in another order than one process (pairs split
# across ranks, then an all-reduce): measured <= 1e-7 relative over these steps.
# Adam turns such differences into up to lr-sized updates of parameters whose
# gradients are near zero, so the learning rate is kept moderate (at 1e-2 the
# runs part by 2e-4 within 3 steps); 1e-5 is far below a step's loss change (~1e-1).
RTOL = 1e-5


def vary_lengths(data_dir):
    """Repeat the prompt sentence of every third record: pairs of unequal length."""
    path = Path(data_dir) / "train.jsonl"
    lines = []
    for i, line in enumerate(path.read_text().splitlines()):
        rec = json.loads(line)
        if i % 3 == 0:
            first = rec["prompt"].split(" . ")[0]
            rec["prompt"] = f"{first} . {rec['prompt']}"
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")


def train_cmd(model_dir, data_dir, run_dir, *extra):
    return [
        sys.executable, "-m", "flash_cce.train.cli", "train", "--model", str(model_dir),
        "--data", str(data_dir), "--run-dir", str(run_dir), "--iters", str(STEPS),
        "--batch-size", "4", "--grad-accumulation-steps", "2", "--learning-rate", "1e-3",
        "--num-layers", "-1", "--steps-per-eval", "0", "--save-every", "2",
        "--seed", "3", "--no-progress", *extra,
    ]


def run(cmd, ranks=1):
    if ranks > 1:
        cmd = [*console_script("mlx.launch"), "-n", str(ranks), "--backend", "ring", "--", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    # mlx.launch exits 0 even when a rank fails: require a clean report too.
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and "exited with code" not in out, out
    return proc


def train_records(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["split"] == "train"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    model_dir, data_dir = tiny_setup(tmp, n_train=32, n_valid=8)
    vary_lengths(data_dir)
    one, two = tmp / "one", tmp / "two"
    run(train_cmd(model_dir, data_dir, one))
    run(train_cmd(model_dir, data_dir, two), ranks=2)
    return model_dir, data_dir, one, two


def close(a, b):
    for k in ("loss", "nll_loss", "grad_norm", "rewards/chosen", "rewards/rejected",
              "rewards/accuracies"):
        assert a[k] == pytest.approx(b[k], rel=RTOL), k
    # A margin is a difference of two rewards: its error scales with theirs.
    scale = max(abs(a["rewards/chosen"]), abs(a["rewards/rejected"]))
    assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], abs=RTOL * scale)


def test_two_ranks_equal_one_process(runs):
    _, _, one, two = runs
    a, b = train_records(one), train_records(two)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        close(a[step], b[step])
        assert a[step]["tokens"] == b[step]["tokens"]  # the whole batch's, summed over ranks
    assert a[STEPS]["loss"] != a[1]["loss"]  # it trained


def test_only_rank_zero_writes(runs):
    _, _, _, two = runs
    lines = (two / "metrics.jsonl").read_text().splitlines()
    assert len([ln for ln in lines if '"split": "train"' in ln]) == STEPS
    assert (two / "adapters" / "adapters.safetensors").exists()


def test_two_rank_checkpoint_resumes_in_one_process(runs, tmp_path):
    model_dir, data_dir, one, two = runs
    resumed = tmp_path / "resumed"
    shutil.copytree(two, resumed, symlinks=True)
    shutil.rmtree(resumed / "checkpoints" / "step-0000004")
    shutil.rmtree(resumed / "adapters")
    run(train_cmd(model_dir, data_dir, resumed, "--resume", str(resumed / "checkpoints" / "step-0000002")))
    a, c = train_records(one), train_records(resumed)
    for step in (3, 4):
        close(a[step], c[step])


def test_batch_must_divide_over_ranks(runs, tmp_path):
    model_dir, data_dir, _, _ = runs
    cmd = train_cmd(model_dir, data_dir, tmp_path / "odd")
    cmd[cmd.index("--batch-size") + 1] = "3"
    proc = subprocess.run([*console_script("mlx.launch"), "-n", "2", "--backend", "ring", "--", *cmd],
                          capture_output=True, text=True, timeout=300)
    # mlx.launch itself exits 0 here; each rank's own exit code is in its report.
    out = proc.stdout + proc.stderr
    assert "batch_size=3 is not divisible by the 2 ranks" in out
    assert "exited with code 2" in out
    assert not (tmp_path / "odd" / "metrics.jsonl").exists()
