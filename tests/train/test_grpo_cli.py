"""`flash-cce train --objective grpo` as a user runs it (a process per command):
TRL's metric names, adapters mlx-lm loads, exact resume (the sampler's random
state and a generation kept across steps included), Ctrl-C, and one-line
errors with nothing written."""

import json
import signal

import pytest

from runs import flash_cce, ok, one_line_error, same_weights, snapshot

from flash_cce.train.checkpoint import published_step
from flash_cce.train.demo import demo_records, demo_words
from flash_cce.train.rollout import SamplingSettings
from flash_cce.train.tiny import build_tiny_model

REWARDS = '''
import os, signal

def first_letter(completions, answer, **kwargs):
    return [float(c[:1] == a[:1]) for c, a in zip(completions, answer)]

def boom(completions, **kwargs):
    if any(c for c in completions):
        raise RuntimeError("no luck")
    return [0.0] * len(completions)

def late(completions, trainer_state, **kwargs):
    if trainer_state.global_step >= 1:  # the generation of step 2
        return ["x"] * len(completions)
    return [0.0] * len(completions)

def ctrl_c(completions, trainer_state, **kwargs):
    if trainer_state.global_step == 1:  # while step 2 runs
        os.kill(os.getpid(), signal.SIGINT)
    return [0.0] * len(completions)
'''


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo")
    model_dir = build_tiny_model(tmp / "model", demo_words(), seed=0)
    data = tmp / "data"
    data.mkdir()
    recs = demo_records()
    for split, n in (("train", 16), ("valid", 4)):
        rows = [{"prompt": r["prompt"], "answer": r["chosen"].split()[0]} for r in recs[split][:n]]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "my_rewards.py").write_text(REWARDS)
    return tmp, model_dir, data


def argv(env, run, iters, *extra):
    tmp, model_dir, data = env
    return ["train", "--objective", "grpo", "--model", model_dir, "--data", data, "--run-dir", run,
            "--iters", iters, "--batch-size", "2", "--num-generations", "4", "--max-completion-length", "3",
            "--num-layers", "-1", "--lora-rank", "4", "--learning-rate", "1e-2", "--lr-schedule", "constant",
            "--steps-per-eval", "2", "--save-every", "1", "--keep-checkpoints", "10", "--no-progress",
            "--reward", "exact_match", "--reward", f"{tmp / 'my_rewards.py'}:first_letter",
            "--reward-weights", "1.0", "--reward-weights", "0.5", *extra]


def records(run, split="train"):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


TIMES = ("step_time", "rollout_time", "update_time", "eval_time", "tokens_per_second", "active_memory_gb",
         "peak_memory_gb")


def same_records(a, b):
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMES}  # noqa: E731
    return [strip(r) for r in a] == [strip(r) for r in b]


@pytest.fixture(scope="module")
def straight(env):
    run = env[0] / "straight"
    proc = ok(flash_cce(*argv(env, run, 4)))
    return run, proc


def test_a_run_logs_trls_metrics_and_writes_adapters_mlx_lm_loads(env, straight):
    run, proc = straight
    train = records(run)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for key in ("loss", "reward", "reward_std", "rewards/exact_match/mean", "rewards/first_letter/mean",
                "rewards/first_letter/std", "frac_reward_zero_std", "completions/mean_length",
                "completions/clipped_ratio", "entropy", "clip_ratio/region_mean", "rollout_time",
                "update_time", "grad_norm"):
        assert key in train[0], key
    for r in train:  # the weighted sum of the two rewards (none skipped)
        assert r["reward"] == pytest.approx(r["rewards/exact_match/mean"] + 0.5 * r["rewards/first_letter/mean"])
        assert 1 <= r["completions/mean_length"] <= 3
    valid = records(run, "valid")
    assert [r["step"] for r in valid] == [0, 2, 4] and all("reward" in r for r in valid)
    best = max(valid[1:], key=lambda r: r["reward"])["step"]
    assert published_step(run / "best") == best
    from mlx_lm import load

    model, _ = load(str(env[1]), adapter_path=str(run / "adapters"))  # mlx-lm's adapter format
    assert "Try: mlx_lm.generate" in proc.stdout


def test_eval_of_the_best_checkpoint_repeats_its_validation(env, straight):
    """`flash-cce eval RUN/best --split valid` samples the validation prompts as the run's validation
    did (same settings and random stream): the same mean rewards; the test split is missing here."""
    run, _ = straight
    best = max(records(run, "valid")[1:], key=lambda r: r["reward"])
    proc = ok(flash_cce("eval", run / "best", "--split", "valid"))
    table = dict(line.split(None, 1) for line in proc.stdout.splitlines() if line.strip())
    assert table["split"] == "valid (4 prompts)"
    for key in ("reward", "rewards/exact_match/mean", "rewards/first_letter/mean", "completions/mean_length"):
        assert float(table[key]) == pytest.approx(best[key], abs=5e-5), key
    one_line_error(flash_cce("eval", run), "split: needs a non-empty test.jsonl")


def test_resume_equals_an_uninterrupted_run(env, straight, tmp_path):
    run = tmp_path / "r"
    ok(flash_cce(*argv(env, run, 2)))
    ok(flash_cce("train", "--resume", run, "--iters", "4"))
    assert same_records(records(run), records(straight[0]))
    assert same_records(records(run, "valid"), records(straight[0], "valid"))
    assert same_weights(run / "adapters", straight[0] / "adapters")


def test_micro_groups_train_as_the_whole_group(env, straight, tmp_path):
    """--micro-group 1: the same run, up to float32 rounding (the gradients sum
    in another order): losses and gradient norms within 1e-5 relative."""
    import math

    run = tmp_path / "r"
    ok(flash_cce(*argv(env, run, 4, "--micro-group", "1")))
    got, want = records(run), records(straight[0])
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want):
        for key in ("loss", "grad_norm", "reward", "entropy"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), (key, a[key], b[key])


def test_a_generation_serving_two_steps_resumes_between_them(env, tmp_path):
    """num_iterations 2: steps 1 and 2 train on one generation (the sampler's
    log-probs as the old ones); a resume after step 1 continues that generation."""
    extra = ("--num-iterations", "2")
    whole, part = tmp_path / "whole", tmp_path / "part"
    ok(flash_cce(*argv(env, whole, 4, *extra)))
    ok(flash_cce(*argv(env, part, 1, *extra)))
    ok(flash_cce("train", "--resume", part, "--iters", "4"))
    assert same_records(records(part), records(whole))
    assert same_weights(part / "adapters", whole / "adapters")
    train = records(whole)
    assert train[0]["rollout_time"] > 0 and train[1]["rollout_time"] == 0  # step 2 reuses step 1's generation
    assert train[0]["reward"] == train[1]["reward"]


def test_ctrl_c_checkpoints_and_the_resume_finishes_the_run(env, straight, tmp_path):
    run = tmp_path / "c"
    proc = flash_cce(*argv(env, run, 4, "--reward", f"{env[0] / 'my_rewards.py'}:ctrl_c",
                           "--reward-weights", "0.0"))
    assert proc.returncode == 130, proc.stderr
    assert "SIGINT: stopping after this step" in proc.stdout
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("flash-cce train: interrupted after step 2") and f"--resume {run}" in line
    assert not (run / "run.lock").exists()
    ok(flash_cce("train", "--resume", run))
    assert [r["step"] for r in records(run)] == [1, 2, 3, 4]


@pytest.mark.parametrize("reward,needles", [
    ("boom", ["reward boom: raised RuntimeError: no luck", "train.jsonl:"]),
    ("nope", ["has no function 'nope'"]),
])
def test_a_reward_that_cannot_run_stops_before_anything_is_written(env, tmp_path, reward, needles):
    run = tmp_path / "x"
    one_line_error(flash_cce(*argv(env, run, 2, "--reward", f"{env[0] / 'my_rewards.py'}:{reward}",
                                   "--reward-weights", "1.0")), *needles)
    assert snapshot(run) is None


def test_a_reward_failing_mid_run_writes_nothing_of_that_step(env, tmp_path):
    run = tmp_path / "late"
    one_line_error(flash_cce(*argv(env, run, 4, "--reward", f"{env[0] / 'my_rewards.py'}:late",
                                   "--reward-weights", "1.0")),
                   "reward late: returned \"x\" for record", "train.jsonl:", "expected a finite number or None")
    assert [r["step"] for r in records(run)] == [1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-0000001"]
    assert not (run / "run.lock").exists()


@pytest.mark.parametrize("extra,needles", [
    (("--loss-type", "sigmoid"), ["loss_type: got sigmoid; allowed for grpo: grpo, bnpo"]),
    (("--reward-weights", "1.0"), ["reward_weights: got 3 weights for 2 reward functions"]),
    (("--max-seq-length", "3"), ["max_seq_length: got 3; allowed for grpo: more than max_completion_length (3)"]),
    (("--num-generations", "1"), ["num_generations: got 1; allowed: an integer >= 2"]),
    (("--temperature", "0"), ["temperature: got 0.0; allowed: a number > 0"]),
    (("--micro-group", "0"), ["micro_group: got 0; allowed: an integer >= 1"]),
    (("--batch-size", "9", "--grad-accumulation-steps", "2"), ["batch_size: got 9", "(18)", "the 16 usable training prompts"]),
])
def test_bad_settings_are_one_line_before_writing(env, tmp_path, extra, needles):
    run = tmp_path / "bad"
    one_line_error(flash_cce(*argv(env, run, 2, *extra)), *needles)
    assert snapshot(run) is None


def test_without_a_reward_the_run_says_what_to_give(env, tmp_path):
    tmp, model_dir, data = env
    run = tmp_path / "none"
    one_line_error(flash_cce("train", "--objective", "grpo", "--model", model_dir, "--data", data,
                             "--run-dir", run), "reward_funcs: give at least one --reward")
    assert snapshot(run) is None


def test_bundled_demo_data_is_the_generator_output_with_unseen_validation_triples():
    from flash_cce.train.grpo_demo import GRPO_DATA_DIR, GRPO_SPLITS, grpo_records

    recs = grpo_records()
    for split, n in GRPO_SPLITS.items():
        lines = (GRPO_DATA_DIR / f"{split}.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == recs[split] and len(lines) == n
    triple = lambda r: (r["prompt"].split()[0], r["answer"], r["prompt"].split()[4])  # noqa: E731
    assert not {triple(r) for r in recs["train"]} & {triple(r) for r in recs["valid"]}
    assert all(r["answer"] in r["prompt"].split() for rs in recs.values() for r in rs)


def test_demo_learns_to_read_the_color(tmp_path):
    """The GRPO demo's first 100 steps (of 300): held-out mean reward from about
    chance (one word of 46: 0.02) to over half; `flash-cce demo --objective grpo` runs it."""
    run = tmp_path / "demo"
    proc = ok(flash_cce("demo", "--objective", "grpo", "--run-dir", run, "--iters", "100"))
    valid = records(run, "valid")
    assert [r["step"] for r in valid] == [0, 50, 100]
    assert valid[0]["reward"] <= 0.1 and valid[-1]["reward"] >= 0.5, [r["reward"] for r in valid]
    assert (run / "plot.png").exists() and (run / "adapters" / "adapters.safetensors").exists()
    assert "Held-out mean reward" in proc.stdout and "Try: mlx_lm.generate" in proc.stdout


def _two_ranks(*args):
    """`flash-cce ARGS` under mlx.launch: 2 ranks on the CPU (ring backend), checked to succeed."""
    import subprocess
    import sys

    from runs import console_script

    cmd = [*console_script("mlx.launch"), "-n", "2", "--backend", "ring", "--", sys.executable, "-m",
           "flash_cce.train.cli", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and "exited with code" not in out, out


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_ranks_equal_one_process(env, tmp_path, loss_type):
    """mlx.launch with 2 ranks on the CPU (ring backend): each rank samples and
    trains on half the groups of a generation, sampled as one process samples
    them, with the whole generation's advantages and loss-token count; the
    gradients sum (dapo) or average (grpo) over the ranks."""
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ("--iters", "3", "--loss-type", loss_type, "--scale-rewards", "batch")
    ok(flash_cce(*argv(env, one, 3), *extra))
    _two_ranks(*argv(env, two, 3), *extra)
    a, b = records(one), records(two)
    assert [r["step"] for r in b] == [1, 2, 3]
    # The ranks reduce float32 sums in another order than one process (see
    # test_distributed): 1e-5 relative is far below a step's change.
    for x, y in zip(a, b):
        assert x["completions/mean_length"] == y["completions/mean_length"]  # the same tokens sampled
        # Token means (entropy, clip ratios) are each rank's mean, then averaged, as TRL gathers
        # them over processes: they differ from one process's where the ranks hold unequal token counts.
        for k in ("loss", "reward", "reward_std", "rewards/exact_match/mean", "grad_norm"):
            assert y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-7), k


def test_two_ranks_keep_a_generation_across_steps_and_resume_inside_it(env, tmp_path):
    """num_iterations 2 on 2 ranks: the checkpoint after step 1 holds both ranks' parts of the
    generation that step 2 trains on; a resume on 2 ranks continues it (the same records and
    weights as the run without a break, and one process's losses), on 1 process it is refused."""
    extra = ("--num-iterations", "2")
    one, whole, part = tmp_path / "one", tmp_path / "whole", tmp_path / "part"
    ok(flash_cce(*argv(env, one, 4, *extra)))
    _two_ranks(*argv(env, whole, 4, *extra))
    _two_ranks(*argv(env, part, 1, *extra))
    one_line_error(flash_cce("train", "--resume", part, "--iters", "4"),
                   "resume: the checkpoint holds a generation that 2 process(es) sampled", "resume it with 2 (got 1)")
    _two_ranks("train", "--resume", part, "--iters", "4")
    assert same_records(records(part), records(whole))
    assert same_weights(part / "adapters", whole / "adapters")
    a, b = records(one), records(whole)
    assert b[1]["rollout_time"] == 0 and b[1]["reward"] == b[0]["reward"]  # step 2 reuses step 1's generation
    for x, y in zip(a, b):
        for k in ("loss", "reward", "grad_norm"):
            assert y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-7), k


# AdamW at learning rate 1e3 without clipping (decoupled decay 0.01 scales the
# weights by -9 a step) drives the tiny model's loss to NaN within a few steps,
# as in test_run_guards.py's preference runs.
DIVERGE = ("--learning-rate", "1e3", "--max-grad-norm", "null", "--max-nonfinite-steps", "3",
           "--weight-decay", "0.01")


def test_nonfinite_steps_are_skipped_and_the_run_stops_at_the_last_finite_checkpoint(env, tmp_path):
    import math

    import numpy as np
    from runs import weights

    run = tmp_path / "r"
    proc = flash_cce(*argv(env, run, 30, *DIVERGE, "--keep-checkpoints", "1"))
    train = records(run)
    bad = [r["step"] for r in train if not (math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]))]
    assert bad, "the run never diverged: the test needs a non-finite step"
    first = bad[0]
    # Three in a row stop the run, counted in the metrics.
    assert bad == [first, first + 1, first + 2] and train[-1]["step"] == first + 2
    assert [r["nonfinite/consecutive"] for r in train[-3:]] == [1, 2, 3]
    assert [r["nonfinite/skipped_steps"] for r in train[-3:]] == [1, 2, 3]
    assert all(r["nonfinite/skipped_steps"] == 0 for r in train[:-3])
    # A checkpoint a step (save_every 1): the last whose weights gave a finite
    # loss is step first - 2's, which step first - 1 trained from (a reward
    # says nothing of the loss, so no validation proves a later one).
    good = first - 2
    err = one_line_error(proc, f"stopped after step {first + 2}: 3 non-finite steps in a row",
                         f"step-{good:07d}", rc=3)
    assert "--resume" in err
    assert published_step(run / "adapters") == published_step(run) == good
    assert (run / "checkpoints" / f"step-{good:07d}").is_dir()  # kept though keep_checkpoints is 1
    assert not any((run / "checkpoints" / f"step-{s:07d}").exists() for s in bad)
    for where in (run / "adapters", run, run / "best"):
        assert all(np.isfinite(w).all() for w in weights(where).values())
    assert not (run / "run.lock").exists()
    # The command it names continues the run from there.
    ok(flash_cce("train", "--resume", run / "checkpoints" / f"step-{good:07d}", "--learning-rate", "1e-3",
                 "--max-grad-norm", "1", "--iters", str(first + 2)))
    assert published_step(run) == first + 2


def test_a_slow_first_generation_and_step_are_announced(env, tmp_path, monkeypatch, capsys):
    """With the notice due at once, the run says (once each) that its first generation, first
    validation and first step are still running, and how long each took; later steps say nothing."""
    from flash_cce.train import cli, notice

    monkeypatch.setattr(notice, "AFTER_SECONDS", 0.0)
    assert cli.main([str(a) for a in argv(env, tmp_path / "run", 2)]) in (0, None)
    out = capsys.readouterr().out.splitlines()
    for what in ("The first generation", "The first validation", "The first step"):
        assert sum(line.startswith(f"{what} is still running after 0 s") for line in out) == 1, what
        assert sum(line.startswith(f"{what} took") for line in out) == 1, what
    assert sum("still running" in line for line in out) == 3


def test_the_sampling_settings_reach_the_sampler():
    from flash_cce.train.grpo_trainer import sampling

    cfg = dict(max_completion_length=7, temperature=0.8, top_p=0.9, top_k=4, min_p=None, repetition_penalty=1.3)
    assert sampling(cfg) == SamplingSettings(max_completion_length=7, temperature=0.8, top_p=0.9, top_k=4,
                                             min_p=0.0, repetition_penalty=1.3)
