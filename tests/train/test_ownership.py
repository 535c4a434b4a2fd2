"""Who may write a run directory, what a run is, and warm starts, as a user meets
them (a process per command): concurrent commands, changed data, spin outputs,
warm-start checks and references, settings that do not apply, degenerate data."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runs import flash_cce, metrics, ok, one_line_error, snapshot, train_argv
from test_trainer import tiny_setup

from flash_cce.train.demo import demo_records, demo_words
from flash_cce.train.identity import file_fingerprint, same_model
from flash_cce.train.tiny import build_tiny_model


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("own")
    model_dir, data_dir = tiny_setup(tmp)
    sft = tmp / "sft"
    ok(flash_cce(*train_argv(model_dir, data_dir, sft, 2, "--objective", "sft")))
    return tmp, model_dir, data_dir, sft


def _cli(*argv, **kw):
    return subprocess.Popen([sys.executable, "-m", "flash_cce.train.cli", *map(str, argv)], text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), **kw)


class Live:
    """A long `flash-cce train` that holds its run directory's lock while the test runs."""

    def __init__(self, argv, run):
        self.proc = _cli(*argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for _ in range(1200):
            if (run / "checkpoints").exists() or self.proc.poll() is not None:
                break
            time.sleep(0.05)
        assert self.proc.poll() is None and (run / "run.lock").exists(), self.proc.stderr.read()

    def __enter__(self):
        return self.proc

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


# 1. demo (and plot) into a directory a live run holds.
def test_demo_and_plot_leave_a_live_run_alone(env, tmp_path):
    _, model_dir, data_dir, _ = env
    demo = tmp_path / "demo"
    demo.mkdir()
    (demo / ".flash-cce-demo").write_text("made by flash-cce demo\n")  # a demo directory, resumed by train
    # No validation: the live run itself writes no plot.png (it draws one at each validation).
    with Live(train_argv(model_dir, data_dir, demo, 100000, "--val-batches", "0"), demo) as live:
        one_line_error(flash_cce("demo", "--run-dir", demo, "--iters", "2"), f"in use by process {live.pid}")
        assert (demo / "config.yaml").exists() and (demo / "run.lock").exists() and live.poll() is None
        one_line_error(flash_cce("plot", demo), f"in use by process {live.pid}", "--output")
        assert not (demo / "plot.png").exists()
        print(ok(flash_cce("plot", demo, "--output", tmp_path / "watch.png")).stdout)
        assert (tmp_path / "watch.png").stat().st_size > 0
        assert live.poll() is None


# 2. Two launches into one run directory: the one that takes the lock second writes nothing.
def test_two_launches_into_one_run_dir_the_loser_writes_nothing(env, tmp_path):
    _, model_dir, data_dir, _ = env
    for attempt in range(3):
        run = tmp_path / f"r{attempt}"
        # The loser passes its checks (it prints "Loading model" after them) and is
        # stopped before it takes the lock; the winner then runs to the end.
        loser = _cli(*train_argv(model_dir, data_dir, run, 4, "--learning-rate", "0.5"),
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for line in loser.stdout:
            if line.startswith("Loading model"):
                loser.send_signal(signal.SIGSTOP)
                break
        if not (run / "run.lock").exists():
            break
        loser.send_signal(signal.SIGCONT)  # it got the lock first: too fast to stop; try again
        loser.communicate()
    else:
        pytest.fail("could not stop the second launch before its lock in 3 attempts")
    try:
        ok(flash_cce(*train_argv(model_dir, data_dir, run, 4)))
        before = snapshot(run)
    finally:
        loser.send_signal(signal.SIGCONT)
    _, err = loser.communicate(timeout=300)
    assert loser.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert "already holds a run's checkpoints" in err or "changed while this command was starting" in err, err
    assert snapshot(run) == before
    assert "learning_rate: 0.003" in (run / "config.yaml").read_text()


# 5. config.yaml names the model and data wherever the run is used from.
def test_demo_config_holds_resolved_paths(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    ok(flash_cce("demo", "--run-dir", "rel", "--iters", "2", cwd=work))
    cfg = (work / "rel" / "config.yaml").read_text()
    assert f"model: {work / 'rel' / 'base_model'}\n" in cfg, cfg
    assert all(Path(line.split(": ", 1)[1]).is_absolute() for line in cfg.splitlines()
               if line.startswith(("data: ", "model: ", "run_dir: ")))
    (tmp_path / "elsewhere" / "rel" / "base_model").mkdir(parents=True)  # a decoy under the new cwd
    ok(flash_cce("eval", work / "rel", "--split", "valid", cwd=tmp_path / "elsewhere"))
    ok(flash_cce("train", "--resume", work / "rel", "--iters", "3", cwd=tmp_path / "elsewhere"))
    assert [s for sp, s, _ in metrics(work / "rel") if sp == "train"] == [1, 2, 3]


# 6. Resume on changed data.
def test_resume_refuses_changed_data_unless_accepted(env, tmp_path):
    _, model_dir, src, _ = env
    data = tmp_path / "data"
    shutil.copytree(src, data)
    run = tmp_path / "r"
    ok(flash_cce(*train_argv(model_dir, data, run, 2)))
    was = file_fingerprint(data / "train.jsonl")
    assert f"train: {was}" in (run / "config.yaml").read_text()
    extra = json.dumps(demo_records()["train"][40]) + "\n"
    (data / "train.jsonl").write_text((data / "train.jsonl").read_text() + extra)
    now = file_fingerprint(data / "train.jsonl")
    before = snapshot(run)
    one_line_error(flash_cce("train", "--resume", run, "--iters", "4"),
                   f"{data / 'train.jsonl'} changed since the run began", was, now, "--accept-data-change")
    assert snapshot(run) == before
    one_line_error(flash_cce(*train_argv(model_dir, data, tmp_path / "x", 2, "--accept-data-change")),
                   "accept_data_change: applies to a resumed run")
    proc = ok(flash_cce("train", "--resume", run, "--iters", "4", "--accept-data-change"))
    assert f"train.jsonl {was} -> {now}" in proc.stdout
    cfg = (run / "config.yaml").read_text()
    assert f"train: {now}" in cfg and f"step-0000002: train.jsonl {was} -> {now}" in cfg
    assert "accept_data_change: false" in cfg  # a one-time permission, not part of the recipe
    ok(flash_cce("train", "--resume", run, "--iters", "5"))  # the accepted data is the run's data now
    # A run from before fingerprints resumes and records the current data's.
    text = (run / "config.yaml").read_text()
    start = text.index("data_fingerprint:")
    end = text.index("\n", text.index("  valid:", start))
    (run / "config.yaml").write_text(text[:start] + text[end + 1:])
    proc = ok(flash_cce("train", "--resume", run, "--iters", "6"))
    assert "the run has none" in proc.stdout and f"train: {now}" in (run / "config.yaml").read_text()


# 7. spin's output is keyed by what shapes the generations.
def test_spin_refuses_other_settings_into_an_existing_out(env, tmp_path):
    _, model_dir, _, sft = env
    data = tmp_path / "sft.jsonl"
    recs = [{"prompt": r["prompt"], "completion": r["chosen"]} for r in demo_records()["train"][:4]]
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "pairs.jsonl"
    base = ["spin", "--model", model_dir, "--data", data, "--out", out, "--max-tokens", "3", "--no-progress"]
    ok(flash_cce(*base))
    before = snapshot(tmp_path)
    for flags, needle in ((["--seed", "1"], "seed 0, this command has 1"),
                          (["--temp", "0.2"], "temp 0.7, this command has 0.2"),
                          (["--adapter-path", sft / "adapters"], "adapter_path null, this command has")):
        one_line_error(flash_cce(*base, *flags), needle, "--restart")
        assert snapshot(tmp_path) == before
    ok(flash_cce(*base, "--seed", "1", "--restart"))
    assert json.loads(out.with_name(out.name + ".progress").read_text())["key"]["seed"] == 1
    ok(flash_cce(*base, "--seed", "1"))  # the same settings continue (here: nothing left to do)
    # A live process holding the output's lock keeps a second spin out.
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "pairs.jsonl.lock").write_text(json.dumps({"pid": holder.pid, "host": os.uname().nodename}))
        one_line_error(flash_cce(*base, "--seed", "1", "--restart"), f"{out} is in use by process {holder.pid}")
        assert out.exists()
    finally:
        holder.kill()
        holder.wait()


# 4 (and issue 41's run directories as warm starts). The adapters' scale, rank and model.
def test_init_adapters_checks_scale_and_model_and_takes_a_run_dir(env, tmp_path):
    tmp, model_dir, data_dir, sft = env
    one_line_error(flash_cce(*train_argv(model_dir, data_dir, tmp_path / "x", 2, "--init-adapters",
                                         sft / "adapters", "--lora-scale", "10")),
                   "the adapters have lora_parameters.scale 20.0, this run 10.0")
    other = build_tiny_model(tmp_path / "other", demo_words(), seed=1)  # one architecture, other weights
    one_line_error(flash_cce(*train_argv(other, data_dir, tmp_path / "x", 2, "--init-adapters", sft / "adapters")),
                   f"trained on model {model_dir}, this run's model is {other}")
    assert not (tmp_path / "x").exists()
    copy = shutil.copytree(model_dir, tmp_path / "copy")  # a copy is the same model
    assert same_model(copy, model_dir) and not same_model(other, model_dir)
    run = tmp_path / "r"
    proc = ok(flash_cce(*train_argv(copy, data_dir, run, 1, "--init-adapters", sft)))
    assert "fresh optimizer" in proc.stdout
    assert f"init_adapters: {sft / 'checkpoints' / 'step-0000002'}\n" in (run / "config.yaml").read_text()


# 8. A DPO warm start's reference is the model it starts from.
def test_dpo_warm_start_references_the_warm_started_model(env, tmp_path):
    _, model_dir, data_dir, sft = env

    def step0(run, *flags):
        proc = ok(flash_cce(*train_argv(model_dir, data_dir, run, 1, "--objective", "dpo",
                                        "--init-adapters", sft / "best", *flags)))
        rec = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][0]
        assert rec["step"] == 0 and rec["split"] == "valid"
        return proc.stdout, rec

    out, warm = step0(tmp_path / "warm")
    # Policy and reference are one model at step 0: every log-ratio is 0 (float32
    # sums of identical computations; 1e-5 leaves room for a different reduction order).
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(warm[k]) < 1e-5, (k, warm)
    assert "Reference: the warm-started model" in out
    out, base = step0(tmp_path / "base", "--warm-reference", "base")
    assert "not the warm start" in out
    assert abs(base["rewards/chosen"]) > 100 * 1e-5, base  # the SFT adapters moved the model from the base
    # eval of the warm-started run scores against its warm start too.
    out = ok(flash_cce("eval", tmp_path / "warm" / "checkpoints" / "step-0000001", "--split", "valid")).stdout
    assert "Reference: the warm-started model" in out


# 14. Settings that do not apply to the objective: one rule, refused.
@pytest.mark.parametrize("flags, yaml_text, needle", [
    (["--objective", "dpo", "--pref-weight", "3"], None, "pref_weight: applies to objective orpo, orpo_margin, cpo, not dpo"),
    (["--objective", "orpo", "--loss-type", "sigmoid"], None, "loss_type: applies to objective dpo, cpo, kto, grpo, not orpo"),
    (["--objective", "dpo"], "pref_weight: 1.0\n", "pref_weight: applies to objective orpo, orpo_margin, cpo, not dpo"),
    (["--objective", "simpo", "--warm-reference", "base"], None, "warm_reference: applies to objective dpo, kto, grpo, not simpo"),
])
def test_settings_of_other_objectives_are_refused(env, tmp_path, flags, yaml_text, needle):
    _, model_dir, data_dir, _ = env
    extra = []
    if yaml_text:
        (tmp_path / "c.yaml").write_text(yaml_text)
        extra = ["--config", tmp_path / "c.yaml"]
    one_line_error(flash_cce(*train_argv(model_dir, data_dir, tmp_path / "r", 2, *flags, *extra)), needle)
    assert not (tmp_path / "r").exists()


# 15. Degenerate data warns before training.
def test_degenerate_data_warns(env, tmp_path):
    _, model_dir, data_dir, _ = env
    same = tmp_path / "same"
    same.mkdir()
    recs = [dict(r, rejected=r["chosen"]) for r in demo_records()["train"][:8]]
    (same / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = ok(flash_cce(*train_argv(model_dir, same, tmp_path / "a", 1))).stdout
    lines = [x for x in out.splitlines() if x.startswith("Warning")]
    assert lines == ["Warning: train.jsonl: 8 of 8 pairs have chosen == rejected (nothing to prefer; check the data)"]
    long = tmp_path / "long"
    long.mkdir()
    recs = [dict(r, chosen=" ".join([r["chosen"]] * 8), rejected=" ".join([r["rejected"]] * 8))
            for r in demo_records()["train"][:8]]
    (long / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = ok(flash_cce(*train_argv(model_dir, long, tmp_path / "b", 1, "--max-seq-length", "8"))).stdout
    lines = [x for x in out.splitlines() if x.startswith("Warning")]
    assert len(lines) == 1 and "cut the whole prompt (BOS included) from 8 of 8 pairs" in lines[0], out
    assert out.index("Warning") < out.index("Trainable parameters")
