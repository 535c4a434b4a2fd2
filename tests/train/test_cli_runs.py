"""`flash-cce train/eval/demo` as a user runs them (a process per command): the
repros of "a user's run is never lost, corrupted or silently wrong", item by item."""

import json
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runs import (console_script, flash_cce, last_valid, metrics, ok, one_line_error, same_weights,
                  snapshot, train_argv)
from test_trainer import tiny_setup

from flash_cce.train.checkpoint import published_step


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny model, data, and a finished 6-step run with every checkpoint kept."""
    tmp = tmp_path_factory.mktemp("runs")
    model_dir, data_dir = tiny_setup(tmp)
    ref = tmp / "ref"
    ok(flash_cce(*train_argv(model_dir, data_dir, ref, 6, "--keep-checkpoints", "5")))
    return tmp, model_dir, data_dir, ref


def copy_run(src, dst):
    shutil.copytree(src, dst, symlinks=True)
    return dst


# 1. Resume accepts changed weight-shaping settings.
@pytest.mark.parametrize("flags, key, old, new", [
    (["--lora-rank", "8"], "lora_parameters.rank", "4", "8"),
    (["--fine-tune-type", "full"], "fine_tune_type", "lora", "full"),
    (["--num-layers", "1"], "num_layers", "-1", "1"),
    (["--quantize-bits", "4"], "quantize", "null", "{bits: 4, group_size: 64}"),
    (["--max-seq-length", "64"], "max_seq_length", "2048", "64"),
])
def test_resume_refuses_weight_and_data_changes(env, flags, key, old, new):
    _, _, _, ref = env
    before = snapshot(ref)
    proc = flash_cce("train", "--resume", ref, "--iters", "8", *flags)
    one_line_error(proc, f"{key} may not change when resuming (the run: {old}, now: {new})", "--init-adapters")
    assert snapshot(ref) == before


def test_resume_from_best_continues_the_run_in_place(env, tmp_path):
    tmp, model_dir, data_dir, ref = env
    run = copy_run(ref, tmp_path / "r")
    # best/adapters/a checkpoint resume the run itself, with its saved settings,
    # also when --model and --data are repeated.
    ok(flash_cce("train", "--resume", run / "best", "--model", model_dir, "--data", data_dir, "--iters", "8"))
    assert not (run / "checkpoints" / "step-0000006" / "checkpoints").exists()
    assert [s for sp, s, _ in metrics(run) if sp == "train"] == list(range(1, 9))
    cfg = (run / "config.yaml").read_text()
    assert "iters: 8" in cfg and "lora_parameters:\n  dropout: 0.0\n  keys: null\n  rank: 4" in cfg
    other = tmp_path / "other-model"
    shutil.copytree(model_dir, other)
    proc = flash_cce("train", "--resume", run / "adapters", "--model", other, "--iters", "9")
    one_line_error(proc, "model may not change", str(model_dir), str(other))


# 2. A second run into a run directory.
def test_fresh_run_into_a_finished_run_dir_touches_nothing(env):
    tmp, model_dir, data_dir, ref = env
    before = snapshot(ref)
    proc = flash_cce(*train_argv(model_dir, data_dir, ref, 3, "--learning-rate", "0.5"))
    one_line_error(proc, "already holds a run's checkpoints", f"--resume {ref}")
    assert snapshot(ref) == before


def test_lock_keeps_a_second_process_out_and_a_stale_lock_is_reported(env, tmp_path):
    _, model_dir, data_dir, _ = env
    run = tmp_path / "r"
    first = subprocess.Popen([sys.executable, "-m", "flash_cce.train.cli",
                              *map(str, train_argv(model_dir, data_dir, run, 100000))],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            if (run / "checkpoints").exists():
                break
            time.sleep(0.05)
        else:
            pytest.fail("the first run did not start")
        one_line_error(flash_cce("train", "--resume", run), f"in use by process {first.pid}")
        one_line_error(flash_cce(*train_argv(model_dir, data_dir, run, 4)), "already holds a run's checkpoints")
        first.kill()  # kill -9: the lock stays behind
        first.wait()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert (run / "run.lock").exists()
    steps_before = [s for sp, s, _ in metrics(run) if sp == "train"]
    proc = ok(flash_cce("train", "--resume", run, "--iters", str(max(steps_before) + 2)))
    assert f"stale lock of process {first.pid}" in proc.stdout
    assert not (run / "run.lock").exists()


# 3. Resuming from an older checkpoint.
def test_resume_from_an_older_checkpoint_sets_later_work_aside(env, tmp_path):
    _, _, _, ref = env
    run = copy_run(ref, tmp_path / "r")
    old_metrics = (run / "metrics.jsonl").read_text()
    ok(flash_cce("train", "--resume", run / "checkpoints" / "step-0000002"))
    # The retrained steps equal the first run's (exact resume), the links name
    # the new checkpoints, and the replaced ones are kept aside.
    assert metrics(run) == metrics(ref)
    assert same_weights(run / "adapters", ref / "adapters")
    assert published_step(run / "adapters") == published_step(run) == 6
    (aside,) = (run / "superseded").iterdir()
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step-0000004", "step-0000006"]
    moved = (aside / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in moved] == [3, 4, 4, 5, 6, 6]
    assert len(old_metrics.splitlines()) == len((run / "metrics.jsonl").read_text().splitlines())


# 4. YAML values are typed and checked.
def test_yaml_numbers_are_floats_and_partial_lora_is_completed(env, tmp_path):
    _, model_dir, data_dir, _ = env
    cfg = tmp_path / "c.yaml"
    cfg.write_text("learning_rate: 1e-4\nmin_learning_rate: 1e-5\nlora_parameters: {rank: 4}\n")
    run = tmp_path / "r"
    proc = ok(flash_cce("train", "-c", cfg, "--model", model_dir, "--data", data_dir, "--run-dir", run,
                        "--iters", "2", "--num-layers", "-1", "--no-progress"))
    # The command it prints works as printed.
    (cmd,) = [line.split("Try: ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("Try: ")]
    argv = shlex.split(cmd)
    assert argv[0] == "mlx_lm.generate" and "--ignore-chat-template" in argv  # string records: plain text
    gen = subprocess.run([*console_script(argv[0]), *argv[1:], "--max-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0 and "==========" in gen.stdout, gen.stderr[-2000:]
    saved = json.loads((run / "adapters" / "adapter_config.json").read_text())
    assert saved["learning_rate"] == 1e-4 and isinstance(saved["learning_rate"], float)
    assert saved["lora_parameters"] == {"rank": 4, "scale": 20.0, "dropout": 0.0, "keys": None}
    # The adapters load where mlx_lm loads them; flash-cce eval takes them too.
    from mlx_lm.utils import load

    load(str(model_dir), adapter_path=str(run / "adapters"))
    ok(flash_cce("eval", run / "adapters", "--split", "valid"))


@pytest.mark.parametrize("yaml_text, message", [
    ('batch_size: "8"\n', "batch_size: got '8' (a string); allowed: an integer >= 1"),
    ("quantize: 4\n", "quantize: got 4; allowed: a mapping with keys bits, group_size (or null)"),
    ('nll_on_prompt: "false"\n', "nll_on_prompt: got 'false' (a string); allowed: true or false"),
    ("lora_parameters: {rnak: 4}\n", "lora_parameters: unknown key 'rnak' (did you mean 'rank'?)"),
    ("lerning_rate: 1e-4\n", "unknown key 'lerning_rate' (did you mean 'learning_rate'?)"),
    ("quantize: {bits: 4, group_size: 48}\n", "quantize.group_size: got 48; allowed: one of 32, 64, 128"),
])
def test_yaml_wrong_types_and_keys_are_refused(env, tmp_path, yaml_text, message):
    _, model_dir, data_dir, _ = env
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text)
    proc = flash_cce("train", "-c", cfg, "--model", model_dir, "--data", data_dir, "--run-dir", tmp_path / "r")
    one_line_error(proc, message)
    assert not (tmp_path / "r").exists()


# 5. Nonsense values; --val-batches 0; demo --iters 5.
@pytest.mark.parametrize("flags, message", [
    (["--learning-rate", "-1e-3"], "learning_rate: got -0.001; allowed: a number > 0"),
    (["--learning-rate", "1e-4", "--min-learning-rate", "1e-3"], "min_learning_rate: got 0.001; allowed: <= learning_rate (0.0001)"),
    (["--beta", "-1"], "beta: got -1.0; allowed: a number >= 0"),
    (["--lora-rank", "0"], "lora_parameters.rank: got 0; allowed: an integer >= 1"),
    (["--weight-decay", "-1"], "weight_decay: got -1.0; allowed: a number >= 0"),
    (["--val-batches", "-2"], "val_batches: got -2; allowed: an integer >= 0 or -1"),
    (["--iters", "many"], "argument --iters: expected an integer >= 1, got 'many'"),
])
def test_nonsense_values_are_refused(env, tmp_path, flags, message):
    _, model_dir, data_dir, _ = env
    proc = flash_cce(*train_argv(model_dir, data_dir, tmp_path / "r", 4, *flags))
    one_line_error(proc, message)
    assert not (tmp_path / "r").exists()


def test_val_batches_zero_means_no_validation(env, tmp_path):
    _, model_dir, data_dir, _ = env
    run = tmp_path / "r"
    proc = ok(flash_cce(*train_argv(model_dir, data_dir, run, 4, "--val-batches", "0")))
    assert proc.stdout.count("No validation (val_batches 0)") == 1
    assert "best" not in proc.stdout.split("No validation")[1].split("\n", 1)[1]
    assert not (run / "best").exists() and (run / "adapters" / "adapters.safetensors").exists()
    assert {sp for sp, _, _ in metrics(run)} == {"train"}


def test_demo_with_few_iters(tmp_path):
    proc = ok(flash_cce("demo", "--iters", "5", "--run-dir", tmp_path / "demo"))
    assert "step 5:" in proc.stdout and (tmp_path / "demo" / "adapters").exists()


# 6. Silent gaps in the data.
def _data(src, dst, **edit):
    shutil.copytree(src, dst)
    for name, text in edit.items():
        path = dst / f"{name}.jsonl"
        if text is None:
            path.unlink()
        else:
            path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return dst


def _long(line, words=40):
    rec = json.loads(line)
    rec["prompt"] = " ".join(["tom"] * words) + " " + rec["prompt"]
    return json.dumps(rec) + "\n"


@pytest.mark.parametrize("case", ["missing", "empty", "all dropped"])
def test_without_usable_validation_the_run_says_so_and_writes_no_best(env, tmp_path, case):
    _, model_dir, data_dir, _ = env
    valid = (data_dir / "valid.jsonl").read_text()
    text = {"missing": None, "empty": "", "all dropped": "".join(map(_long, valid.splitlines(True)))}[case]
    data = _data(data_dir, tmp_path / "d", valid=text)
    run = tmp_path / "r"
    proc = ok(flash_cce(*train_argv(model_dir, data, run, 2, "--max-seq-length", "24", "--truncation", "drop")))
    assert proc.stdout.count("No validation") == 1 and "best:" not in proc.stdout
    assert not (run / "best").exists() and (run / "adapters").exists()


@pytest.mark.parametrize("case, message", [
    ("test missing", "data: --test needs test.jsonl in"),
    ("train empty", "train.jsonl holds no records"),
    ("train dropped", "data: train.jsonl has no usable pairs (32 records, all dropped at max_seq_length=24"),
    ("not utf-8", "train.jsonl:3: not UTF-8 text (byte 13 of the line is 0xff)"),
    ("small train", "batch_size: got 4; allowed: at most the 3 usable training pairs"),
])
def test_data_gaps_are_one_line_errors_before_writing(env, tmp_path, case, message):
    _, model_dir, data_dir, _ = env
    train = (data_dir / "train.jsonl").read_text()
    lines = train.splitlines(True)
    edit = {
        "test missing": dict(test=None),
        "train empty": dict(train=""),
        "train dropped": dict(train="".join(map(_long, lines))),
        "not utf-8": dict(train=("".join(lines[:2]) + '{"prompt": "').encode() + b"\xff\"}\n"),
        "small train": dict(train="".join(lines[:3])),
    }[case]
    data = _data(data_dir, tmp_path / "d", **edit)
    proc = flash_cce(*train_argv(model_dir, data, tmp_path / "r", 2, "--max-seq-length", "24",
                                 "--truncation", "drop", "--test"))
    one_line_error(proc, message)
    assert not (tmp_path / "r").exists()


def test_utf8_bom_is_accepted(env, tmp_path):
    _, model_dir, data_dir, _ = env
    data = _data(data_dir, tmp_path / "d", train=b"\xef\xbb\xbf" + (data_dir / "train.jsonl").read_bytes())
    proc = ok(flash_cce(*train_argv(model_dir, data, tmp_path / "r", 2)))
    assert "train: 32 pairs" in proc.stdout


# 7. Interrupts and environment errors.
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_checkpoints_and_prints_a_resume_command_that_works(env, tmp_path, signum):
    _, model_dir, data_dir, ref = env
    run = tmp_path / "r"
    argv = train_argv(model_dir, data_dir, run, 6, "--keep-checkpoints", "5", "--save-every", "100")
    proc = subprocess.Popen([sys.executable, "-m", "flash_cce.train.cli", *map(str, argv)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Until the first step is logged (its kernels may take a while to compile).
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (run / "metrics.jsonl").exists() and '"split": "train"' in (run / "metrics.jsonl").read_text():
            break
        time.sleep(0.01)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.fail("the run finished before the signal; it must take longer than this wait")
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert f"{signal.Signals(signum).name}: stopping after this step" in out
    line = err.strip().splitlines()[-1]
    assert line.startswith("flash-cce train: interrupted after step ") and f"--resume {run}" in line
    step = int(line.split("after step ")[1].split(";")[0])
    assert (run / "checkpoints" / f"step-{step:07d}").is_dir() and not (run / "run.lock").exists()
    command = line.split("Resume with: ")[1].split()
    assert command[:2] == ["flash-cce", "train"]
    ok(flash_cce(*command[1:]))
    assert metrics(run) == metrics(ref)
    assert same_weights(run / "adapters", ref / "adapters")


def test_environment_errors_are_one_line(env, tmp_path):
    _, model_dir, data_dir, _ = env
    empty = tmp_path / "empty-model"
    empty.mkdir()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    broken = tmp_path / "broken.yaml"
    broken.write_text("iters: [1,\n")
    cases = [
        (["-c", tmp_path / "nope.yaml"], "config: no such file"),
        (["-c", broken], "invalid YAML"),
        (["--model", tmp_path / "nowhere"], "model: no such directory"),
        (["--model", empty], "has no config.json; it is not an mlx-lm model directory"),
        (["--run-dir", a_file / "run"], "is not a directory"),
        (["--model", "nobody-here/no-such-model"], "could not be fetched from the Hugging Face hub"),
    ]
    base = ["train", "--model", model_dir, "--data", data_dir, "--run-dir", tmp_path / "r", "--no-progress"]
    for flags, message in cases:
        one_line_error(flash_cce(*base, *flags, env={"HF_HUB_OFFLINE": "1"}), message)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    one_line_error(flash_cce(*base, "--run-dir", tmp_path / "mine"), "holds files a run does not write (notes.txt)")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    if Path("/proc/self").exists():  # writes fail there even for root
        one_line_error(flash_cce(*base, "--run-dir", "/proc/flash-cce-run"), "cannot be created in '/proc'")
    assert not (tmp_path / "r").exists()


def test_relative_model_resumes_from_another_directory(env, tmp_path):
    _, model_dir, data_dir, _ = env
    work = tmp_path / "work"
    shutil.copytree(model_dir, work / "model")
    shutil.copytree(data_dir, work / "data")
    ok(flash_cce(*train_argv("model", "data", "run", 2), cwd=work))
    ok(flash_cce("train", "--resume", work / "run", "--iters", "4", cwd=tmp_path))
    assert [s for sp, s, _ in metrics(work / "run") if sp == "train"] == [1, 2, 3, 4]


# 9. eval reads the run.
@pytest.mark.parametrize("flags", [["--objective", "sft", "--no-nll-on-prompt"],
                                   ["--objective", "simpo", "--quantize-bits", "4", "--quantize-group-size", "32"]])
def test_eval_of_a_run_matches_its_validation(env, tmp_path, flags):
    _, model_dir, data_dir, _ = env
    run = tmp_path / "r"
    ok(flash_cce(*train_argv(model_dir, data_dir, run, 4, *flags)))
    expected = last_valid(run)
    for target in (["--split", "valid", run], ["--split", "valid", "--adapter-path", run / "adapters"],
                   ["--split", "valid", run / "checkpoints" / "step-0000004"]):
        out = ok(flash_cce("eval", *target)).stdout
        rows = dict(line.split(None, 1) for line in out.strip().splitlines())
        assert float(rows["loss"]) == pytest.approx(expected["loss"], abs=1e-4)  # printed to 4 places
        assert rows["tokens"] == str(int(expected["tokens"]))
        assert rows["objective"].startswith(flags[1])
        # A short table: at most 20 lines, each short but for the paths it names.
        assert len(out.splitlines()) <= 20
        assert max(len(line.replace(str(tmp_path), "")) for line in out.splitlines()) < 120


# Warm start.
def test_init_adapters_starts_from_given_adapters_with_a_fresh_optimizer(env, tmp_path):
    _, model_dir, data_dir, ref = env
    run = tmp_path / "orpo"
    sft = tmp_path / "sft"
    ok(flash_cce(*train_argv(model_dir, data_dir, sft, 2, "--objective", "sft")))
    proc = ok(flash_cce(*train_argv(model_dir, data_dir, run, 2, "--init-adapters", sft / "adapters")))
    assert "fresh optimizer" in proc.stdout
    # Step 0 of the new run scores the SFT adapters: eval of them under ORPO says the same.
    step0 = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["step"] == 0][0]
    out = ok(flash_cce("eval", sft, "--objective", "orpo", "--split", "valid")).stdout
    assert float(dict(x.split(None, 1) for x in out.splitlines())["loss"]) == pytest.approx(step0["loss"], abs=1e-4)
    one_line_error(flash_cce(*train_argv(model_dir, data_dir, tmp_path / "x", 2, "--lora-rank", "8",
                                         "--init-adapters", ref / "adapters")),
                   "init_adapters: the adapters have lora_parameters.rank 4, this run 8")
    one_line_error(flash_cce(*train_argv(model_dir, data_dir, tmp_path / "x", 2, "--init-adapters", data_dir)),
                   "has no adapter_config.json")
    assert not (tmp_path / "x").exists()


def test_init_adapters_from_an_mlx_lm_adapter_dir(env, tmp_path):
    """An adapter directory as mlx_lm.lora writes it: its trainable parameters and its args."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    _, model_dir, data_dir, _ = env
    model, _ = load(str(model_dir))
    model.freeze()
    linear_to_lora_layers(model, 2, {"rank": 4, "dropout": 0.0, "scale": 20.0})
    params = dict(tree_flatten(model.trainable_parameters()))
    params = {k: v + 0.01 if k.endswith("lora_b") else v for k, v in params.items()}  # not zero
    adapters = tmp_path / "mlx-lm-adapters"
    adapters.mkdir()
    mx.save_safetensors(str(adapters / "adapters.safetensors"), params)
    (adapters / "adapter_config.json").write_text(json.dumps(dict(
        model=str(model_dir), fine_tune_type="lora", num_layers=2, iters=2, batch_size=2,
        learning_rate=1e-5, lora_parameters={"rank": 4, "dropout": 0.0, "scale": 20.0})))
    run = tmp_path / "r"
    ok(flash_cce(*train_argv(model_dir, data_dir, run, 2, "--num-layers", "2", "--init-adapters", adapters)))
    fresh = tmp_path / "fresh"
    ok(flash_cce(*train_argv(model_dir, data_dir, fresh, 2, "--num-layers", "2")))
    assert metrics(run)[0] != metrics(fresh)[0]  # step 0 saw the given adapters
    # eval takes the mlx_lm directory too: its step-0 score is the run's step 0.
    out = ok(flash_cce("eval", adapters, "--model", model_dir, "--data", data_dir, "--split", "valid")).stdout
    assert float(dict(x.split(None, 1) for x in out.splitlines())["loss"]) == pytest.approx(metrics(run)[0][2], abs=1e-4)


def test_gpu_capture_needs_metal(env, tmp_path):
    import mlx.core as mx

    _, model_dir, data_dir, _ = env
    proc = flash_cce(*train_argv(model_dir, data_dir, tmp_path / "r", 2, "--gpu-capture", tmp_path / "t.gputrace"))
    if mx.metal.is_available():
        ok(proc)
        assert (tmp_path / "t.gputrace").exists()
    else:
        one_line_error(proc, "gpu_capture: needs MLX's Metal backend")
        assert not (tmp_path / "r").exists()


def test_version_and_help_with_defaults():
    out = ok(flash_cce("--version")).stdout
    assert out.startswith("flash-cce ") and out.split()[1][0].isdigit()
    text = " ".join(ok(flash_cce("train", "-h")).stdout.split())
    assert "Peak AdamW learning rate. Allowed: a number > 0. (default: 1e-05)" in text
    assert "--lora-rank RANK lora_parameters.rank: LoRA rank. Allowed: an integer >= 1. (default: 8)" in text


# kill -9 at random points of real runs: resuming gives the uninterrupted run.
KILL_ITERS = 12


def _kill_argv(model_dir, data_dir, run):
    return train_argv(model_dir, data_dir, run, KILL_ITERS, "--save-every", "1", "--steps-per-eval", "4",
                      "--grad-accumulation-steps", "2")


@pytest.fixture(scope="module")
def straight(env):
    tmp, model_dir, data_dir, _ = env
    run = tmp / "straight"
    ok(flash_cce(*_kill_argv(model_dir, data_dir, run)))
    return run


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kill_9_at_random_points_then_resume_equals_an_uninterrupted_run(env, straight, tmp_path, seed):
    import random

    _, model_dir, data_dir, _ = env
    rng = random.Random(seed)
    run = tmp_path / "killed"
    kills = []
    for _ in range(2):
        argv = ["train", "--resume", run] if (run / "adapters").exists() else _kill_argv(model_dir, data_dir, run)
        proc = subprocess.Popen([sys.executable, "-m", "flash_cce.train.cli", *map(str, argv)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        metrics_file = run / "metrics.jsonl"
        while proc.poll() is None and not (metrics_file.exists() and metrics_file.stat().st_size):
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.4))
        proc.kill()
        _, err = proc.communicate()
        assert "Traceback" not in err, err
        kills.append(proc.returncode)
    argv = ["train", "--resume", run] if (run / "adapters").exists() else _kill_argv(model_dir, data_dir, run)
    ok(flash_cce(*argv))
    assert metrics(run) == metrics(straight)
    assert same_weights(run / "adapters", straight / "adapters")
    assert same_weights(run / "best", straight / "best")
    assert kills.count(-signal.SIGKILL) >= 1  # at least one kill landed before the run's end


def test_unwritable_run_dir_and_full_disk_are_one_line(env, tmp_path, monkeypatch, capsys):
    """In this process (the same `main`): a run directory where writes fail (a
    read-only one; as root only a stand-in shows it) and a disk that fills up
    while a checkpoint is written."""
    import errno
    import tempfile

    from flash_cce.train import checkpoint
    from flash_cce.train.cli import main

    _, model_dir, data_dir, _ = env
    argv = [str(a) for a in train_argv(model_dir, data_dir, tmp_path / "r", 4)]

    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    with monkeypatch.context() as m:
        m.setattr(tempfile, "TemporaryFile", refuse)
        assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("cannot be created in " + repr(str(tmp_path)) + " (Permission denied)") and "\n" not in err
    assert not (tmp_path / "r").exists()

    real = checkpoint.write_adapters

    def fill_up(path, *a):
        if "step-0000004" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, *a)

    with monkeypatch.context() as m:
        m.setattr(checkpoint, "write_adapters", fill_up)
        assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flash-cce train: error: file: ") and err.endswith(": no space left on the device")
    assert published_step(tmp_path / "r" / "adapters") == 2  # the last whole checkpoint
    assert not (tmp_path / "r" / "run.lock").exists()


def test_without_the_train_extra_the_cli_says_what_to_install():
    script = (
        "import importlib.util, sys\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n in ('mlx_lm', 'yaml') else real(n, *a)\n"
        "from flash_cce.train.cli import main\n"
        "sys.exit(main(['train', '--model', 'm']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    one_line_error(proc, "needs the train extra (mlx_lm, yaml missing): pip install 'mlx-flash-cce[train]'")
