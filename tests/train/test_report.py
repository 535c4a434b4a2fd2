"""What a run prints and writes as it goes: report lines instead of a bar when
stderr is no terminal (or with --no-progress), the run summary, shell-quoted
commands, TRL's metric names and plot.png after each validation."""

import io
import shlex

import pytest

from flash_cce.train import runner
from flash_cce.train.cli import build_parser, main
from flash_cce.train.report import Reporter, use_bar
from flash_cce.train.runner import run_train, train_settings
from flash_cce.train.trainer import read_metrics
from test_trainer import tiny_setup


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_bar_only_on_a_terminal():
    assert use_bar(True, _Stream(True)) and not use_bar(True, _Stream(False)) and not use_bar(False, _Stream(True))


def _record(step, loss):
    return dict(step=step, loss=loss, learning_rate=1e-3, step_time=0.5, tokens=100, peak_memory_gb=0.25,
                **{"rewards/accuracies": 0.5})


def test_report_lines_average_the_steps_since_the_last():
    lines = []
    r = Reporter(iters=5, start=0, steps_per_report=2, bar=False, log=lines.append)
    for step, loss in zip(range(1, 6), (1.0, 3.0, 5.0, 7.0, 9.0)):
        r.step(_record(step, loss))
    assert lines == [
        "step 2/5: loss 2.0000, accuracy 0.500, lr 1.000e-03, 2.00 steps/s, 200 tokens/s, peak 0.25 GB",
        "step 4/5: loss 6.0000, accuracy 0.500, lr 1.000e-03, 2.00 steps/s, 200 tokens/s, peak 0.25 GB",
        "step 5/5: loss 9.0000, accuracy 0.500, lr 1.000e-03, 2.00 steps/s, 200 tokens/s, peak 0.25 GB",
    ]


def _argv(model_dir, data_dir, run_dir, *extra):
    return ["train", "--model", str(model_dir), "--data", str(data_dir), "--run-dir", str(run_dir),
            "--iters", "4", "--batch-size", "4", "--num-layers", "-1", "--lora-rank", "4",
            "--learning-rate", "3e-3", "--lr-schedule", "constant", "--steps-per-eval", "2",
            "--steps-per-report", "2", *extra]


def test_a_run_in_a_log_file_prints_lines_quoted_commands_and_trl_metrics(tmp_path, capsys):
    model_dir, data_dir = tiny_setup(tmp_path, n_train=8, n_valid=4)
    run_dir = tmp_path / "my run"  # a space: printed commands must quote it
    assert main(_argv(model_dir, data_dir, run_dir)) == 0  # progress on, but stderr is no terminal here
    out, err = capsys.readouterr()
    assert "\r" not in out + err
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("step ") and "/" in line] == \
        ["step 2/4", "step 4/4"]
    assert "Schedule: constant 0.003; 4 steps of 4 x 1 micro-batches" in out
    assert "Validation: at step 0, every 2 steps and at the end, over all micro-batches" in out
    hint = next(line for line in out.splitlines() if line.startswith("Try: "))
    argv = shlex.split(hint[len("Try: "):])
    assert argv[argv.index("--adapter-path") + 1] == str(run_dir.absolute() / "adapters")
    assert argv[argv.index("--prompt") + 1].endswith("?")

    records = read_metrics(run_dir)
    train = [r for r in records if r["split"] == "train"]
    assert [r["num_tokens"] for r in train] == [sum(t["tokens"] for t in train[:i + 1]) for i in range(4)]
    for r in (r for r in records if r["split"] == "valid"):
        assert r["eval_loss"] == r["loss"] and r["eval_rewards/accuracies"] == r["rewards/accuracies"]
    assert not any(k.startswith("eval_") for r in train for k in r if k != "eval_time")


def test_plot_is_redrawn_at_each_validation(tmp_path):
    model_dir, data_dir = tiny_setup(tmp_path, n_train=8, n_valid=4)
    args = build_parser().parse_args(_argv(model_dir, data_dir, tmp_path / "r", "--no-progress"))
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config") and not k.startswith("mlx_lm.")}
    seen = []

    def on_eval(record):
        plot = tmp_path / "r" / "plot.png"
        seen.append((record["step"], plot.read_bytes()))

    run_train(train_settings(flags), log=lambda *a: None, on_eval=on_eval, hint=False)
    assert [s for s, _ in seen] == [0, 2, 4]
    pngs = [p for _, p in seen]
    assert all(p.startswith(b"\x89PNG") for p in pngs) and len(set(pngs)) == 3  # drawn anew each time


def test_resume_command_is_shell_quoted(tmp_path, capsys, monkeypatch):
    from flash_cce.train.checkpoint import Interrupted

    def stop(*args, **kwargs):
        raise Interrupted(1, "ckpt")

    monkeypatch.setattr("flash_cce.train.trainer.train", stop)
    model_dir, data_dir = tiny_setup(tmp_path, n_train=8, n_valid=4)
    run_dir = tmp_path / "it's a run"
    assert main(_argv(model_dir, data_dir, run_dir, "--no-progress")) == 130
    err = capsys.readouterr().err
    command = err.split("Resume with: ", 1)[1].strip()
    assert shlex.split(command) == ["flash-cce", "train", "--resume", str(run_dir.absolute())]


def test_generate_hint_quotes_any_single_line_prompt(tmp_path):
    cfg = {"model": "/m dir", "chat_template": "auto"}
    recs = [({"prompt": 'say "hi" & $HOME', "chosen": "a", "rejected": "b"}, "f:1")]
    argv = shlex.split(runner.generate_hint(cfg, tmp_path / "r x", recs))
    assert argv[argv.index("--prompt") + 1] == 'say "hi" & $HOME' and argv[argv.index("--model") + 1] == "/m dir"
    text = [({"text": "a b"}, "f:1")]
    assert "--ignore-chat-template" in runner.generate_hint(cfg, tmp_path, text)
    long = [({"prompt": "w " * runner.HINT_PROMPT_CHARS, "chosen": "a", "rejected": "b"}, "f:1")]
    assert "--prompt" not in shlex.split(runner.generate_hint(cfg, tmp_path, long))
