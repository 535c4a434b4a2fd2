"""`flash-cce` end to end on the tiny model: train, resume, eval, plot; config precedence."""

import json
import os
import re
import struct
import subprocess
import sys
import zlib

import pytest

import mlx.core as mx

from flash_cce.train import settings
from flash_cce.train.cli import build_parser, main
from flash_cce.train.runner import AUTO_PAD, objective_config, resolve_config
from flash_cce.train.trainer import read_metrics
from test_trainer import tiny_setup


def test_precedence_flags_over_yaml_over_defaults(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("learning_rate: 2.0e-4\nbatch_size: 3\nlora_parameters: {rank: 4, scale: 5.0, dropout: 0.1}\n")
    flags = {"batch_size": 7, "lora_rank": 16, "iters": None, "learning_rate": None}
    cfg = resolve_config(flags, cfg_file)
    assert cfg["batch_size"] == 7  # flag
    assert cfg["learning_rate"] == 2.0e-4  # YAML
    assert cfg["iters"] == settings.BY_NAME["iters"].default  # default
    assert cfg["lora_parameters"] == {"rank": 16, "scale": 5.0, "dropout": 0.1, "keys": None}  # flag into a YAML table
    cfg_file.write_text("lerning_rate: 1\n")
    with pytest.raises(ValueError, match="unknown key 'lerning_rate' \\(did you mean 'learning_rate'\\?\\)"):
        resolve_config({}, cfg_file)


def test_pad_to_settings(tmp_path):
    def pad_to(*argv):
        args = build_parser().parse_args(["train", *argv])
        return objective_config(resolve_config(vars(args), None)).stack.pad_to

    on_cuda = hasattr(mx, "cuda") and mx.cuda.is_available()
    assert pad_to() == (AUTO_PAD if on_cuda else None)  # auto by default
    assert pad_to("--pad-to", "32") == 32
    assert pad_to("--pad-to", "0") is None
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("pad_to: -3\n")
    with pytest.raises(ValueError, match="pad_to: got -3; allowed: auto or an integer >= 0"):
        objective_config(resolve_config({}, cfg_file))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--pad-to", "wide"])


def test_compiled_layers_settings(tmp_path):
    def compiled_layers(*argv, yaml=None):
        args = build_parser().parse_args(["train", *argv])
        cfg_file = None
        if yaml is not None:
            cfg_file = tmp_path / "c.yaml"
            cfg_file.write_text(yaml)
        return objective_config(resolve_config(vars(args), cfg_file)).stack.compiled_layers

    assert compiled_layers() is None  # auto: the stack's plan decides
    assert compiled_layers("--compiled-layers") is True  # the flag alone
    assert compiled_layers("--compiled-layers", "false") is False
    assert compiled_layers("--compiled-layers", "auto") is None
    assert compiled_layers(yaml="compiled_layers: true\n") is True
    with pytest.raises(ValueError, match="compiled_layers: got 'on' \\(a string\\); allowed: auto, true or false"):
        compiled_layers(yaml="compiled_layers: 'on'\n")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--compiled-layers", "on"])


def _train_argv(model_dir, data_dir, run_dir, iters, *extra):
    return ["train", "--model", str(model_dir), "--data", str(data_dir), "--run-dir", str(run_dir),
            "--iters", str(iters), "--batch-size", "4", "--num-layers", "-1", "--lora-rank", "4",
            "--learning-rate", "3e-3", "--lr-schedule", "constant", "--steps-per-eval", "2",
            "--save-every", "2", "--no-progress", *extra]


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", data[16:24])
    idat = data.index(b"IDAT")
    (length,) = struct.unpack(">I", data[idat - 4:idat])
    raw = zlib.decompress(data[idat + 4:idat + 4 + length])
    assert len(raw) == h * (3 * w + 1)  # 8-bit RGB rows, each with a filter byte
    return w, h, raw


def test_train_resume_eval_plot(tmp_path, capsys):
    model_dir, data_dir = tiny_setup(tmp_path)
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert main(_train_argv(model_dir, data_dir, straight, 4)) == 0
    # Stop after 2 steps, then continue to 4 from the run directory alone (its
    # config.yaml supplies the settings; the flag raises iters).
    assert main(_train_argv(model_dir, data_dir, cut, 2)) == 0
    assert main(["train", "--resume", str(cut), "--iters", "4"]) == 0

    def losses(run):
        return [(r["split"], r["step"], r["loss"]) for r in read_metrics(run)]

    assert losses(cut) == losses(straight)
    assert [r[1] for r in losses(cut) if r[0] == "train"] == [1, 2, 3, 4]
    saved = json.loads((cut / "adapters" / "adapter_config.json").read_text())
    assert saved["fine_tune_type"] == "lora" and saved["lora_parameters"]["rank"] == 4

    capsys.readouterr()
    assert main(["eval", "--adapter-path", str(cut / "best"), "--split", "valid"]) == 0
    out = capsys.readouterr().out
    assert "rewards/accuracies" in out and "loss" in out

    assert main(["plot", str(cut)]) == 0
    w, h, raw = _png_size(cut / "plot.png")
    assert (w, h) == (1000, 700)
    from flash_cce.train.plot import TRAIN, VALID

    assert bytes(VALID) in raw and bytes(TRAIN) in raw  # both kinds of curve were drawn


def test_malformed_data_reports_file_and_line(tmp_path, capsys):
    model_dir, data_dir = tiny_setup(tmp_path)
    with open(data_dir / "train.jsonl", "a") as f:
        f.write('{"prompt": "tom", "chosen": "red ."}\n')
    assert main(_train_argv(model_dir, data_dir, tmp_path / "run", 1)) == 2
    err = capsys.readouterr().err
    assert f"{data_dir / 'train.jsonl'}:33: missing key 'rejected'" in err


def test_bad_settings_are_named(tmp_path, capsys):
    model_dir, data_dir = tiny_setup(tmp_path)
    assert main(_train_argv(model_dir, data_dir, tmp_path / "r", 1, "--num-layers", "9")) == 2
    assert "num_layers: got 9; allowed: -1 or 1 to 2 (the model has 2 blocks)" in capsys.readouterr().err
    assert main(_train_argv(model_dir, data_dir, tmp_path / "r", 1, "--warmup", "5")) == 2
    assert "warmup: got 5; allowed: < iters (1)" in capsys.readouterr().err
    assert main(["train", "--objective", "kpo"]) == 2
    assert ("objective: got 'kpo' (a string); allowed: one of orpo, simpo, orpo_margin, dpo, cpo, kto, sft"
            in capsys.readouterr().err)
    assert not (tmp_path / "r").exists()
    assert main(_train_argv(model_dir, data_dir, tmp_path / "r", 1, "--objective", "dpo",
                            "--loss-type", "kto")) == 2
    assert "loss_type for dpo must be one of ['sigmoid'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_objective_names_are_the_registry():
    from flash_cce.train.losses import OBJECTIVES
    from flash_cce.train.settings import BY_NAME

    # grpo trains on its own rollouts (grpo_trainer), not through the pair objectives' registry.
    assert set(BY_NAME["objective"].choices) == set(OBJECTIVES) | {"grpo"}


def _trim(data_dir, n):
    for path in data_dir.glob("*.jsonl"):
        path.write_text("".join(path.read_text().splitlines(keepends=True)[:n]))
    return data_dir


def test_train_and_eval_kto_on_the_unpaired_demo_split(tmp_path, capsys):
    model_dir, data_dir = tiny_setup(tmp_path)
    unpaired = _trim(data_dir / "unpaired", 16)
    run = tmp_path / "kto"
    assert main(_train_argv(model_dir, unpaired, run, 2, "--objective", "kto",
                            "--desirable-weight", "1.2")) == 0
    records = read_metrics(run)
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in records:
        assert {"loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins",
                "logps/chosen", "logps/rejected"} <= set(r)
        assert r["kl"] >= 0.0
    assert "16 examples (8 desirable)" in capsys.readouterr().out
    assert main(["eval", "--adapter-path", str(run / "adapters"), "--split", "valid"]) == 0
    assert re.search(r"^kl +\d", capsys.readouterr().out, re.M)
    # Paired records are unpaired, as TRL's KTOTrainer does: each pair two examples.
    assert main(_train_argv(model_dir, _trim(data_dir, 8), tmp_path / "paired", 1, "--objective", "kto")) == 0
    assert "train: 16 examples (8 desirable) (16 records" in capsys.readouterr().out


# The command's process with the command replaced: prints MLX_MAX_MB_PER_BUFFER as
# it stood when MLX was first imported (MLX reads it then) and after.
GRAPH_LIMIT_PROBE = """
import builtins, os, sys
from flash_cce.train import cli

assert "mlx.core" not in sys.modules, "importing the CLI imported MLX"
seen = {}
real_import = builtins.__import__


def watch(name, *args, **kwargs):
    if name.split(".")[0] == "mlx":
        seen.setdefault("at import", os.environ.get("MLX_MAX_MB_PER_BUFFER"))
    return real_import(name, *args, **kwargs)


builtins.__import__ = watch
cli._run = lambda args, argv: None
cli.main(sys.argv[1:])
print(seen["at import"], os.environ.get("MLX_MAX_MB_PER_BUFFER"))
"""


@pytest.mark.parametrize("command, preset", [("train", None), ("eval", "50"), ("plot", None)])
def test_graph_limit_is_set_before_mlx_is_imported(command, preset):
    """train and eval on Linux run with MLX_MAX_MB_PER_BUFFER=GRAPH_MB unless it is
    set, in place before MLX is imported (MLX reads it then), in the same process."""
    from flash_cce.train import cli

    env = {k: v for k, v in os.environ.items() if k != "MLX_MAX_MB_PER_BUFFER"}
    if preset:
        env["MLX_MAX_MB_PER_BUFFER"] = preset
    argv = {"train": ["train", "--model", "nowhere"], "eval": ["eval", "--model", "nowhere"],
            "plot": ["plot", "nowhere"]}[command]
    proc = subprocess.run([sys.executable, "-c", GRAPH_LIMIT_PROBE, *argv], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    at_import, value = proc.stdout.split()
    want = preset or (cli.GRAPH_MB if command != "plot" and sys.platform.startswith("linux") else "None")
    assert at_import == value == want, proc.stdout


def test_eval_takes_as_many_batches_as_the_runs_validation(tmp_path, capsys):
    """sft's default val_batches is mlx_lm.lora's 25; here 1: eval of the run's valid split
    scores the same micro-batch its validation scored."""
    model_dir, data_dir = tiny_setup(tmp_path, n_train=8, n_valid=8)
    run = tmp_path / "sft"
    assert main(_train_argv(model_dir, data_dir, run, 2, "--objective", "sft", "--val-batches", "1")) == 0
    last = [r for r in read_metrics(run) if r["split"] == "valid"][-1]
    capsys.readouterr()
    assert main(["eval", str(run), "--split", "valid"]) == 0
    rows = dict(line.split(None, 1) for line in capsys.readouterr().out.strip().splitlines())
    assert rows["split"] == "valid (4 pairs)" and int(rows["tokens"]) == int(last["tokens"])
    assert float(rows["loss"]) == pytest.approx(last["loss"], abs=1e-4)  # printed to 4 places
