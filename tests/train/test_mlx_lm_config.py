"""mlx_lm.lora's YAML files and flags read by `flash-cce train`, flash-cce -h,
misspelt flags, the defaults per objective and the run summary."""

import re
from pathlib import Path

import pytest
import yaml

from flash_cce.train import mlx_lm_config, settings
from flash_cce.train.cli import build_parser, main
from flash_cce.train.mlx_lm_config import from_flags
from flash_cce.train.report import run_summary
from flash_cce.train.runner import resolve_config


def _yaml(tmp_path, cfg):
    path = tmp_path / "lora_config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train_flags(*argv):
    return from_flags({k: v for k, v in vars(build_parser().parse_args(["train", *argv])).items()
                       if k not in ("command", "config")})


def test_every_mlx_lm_key_is_ours_or_mapped():
    """mlx_lm.lora's defaults (the installed version's own table) name no key we do not know."""
    from mlx_lm.lora import CONFIG_DEFAULTS

    unknown = [k for k in CONFIG_DEFAULTS if k not in settings.BY_NAME and k not in mlx_lm_config.KEYS]
    assert unknown == []


def test_mlx_lm_defaults_file_trains_as_mlx_lm_would(tmp_path):
    """A YAML file holding every key of mlx_lm.lora's defaults resolves to the settings mlx_lm would use."""
    from mlx_lm.lora import CONFIG_DEFAULTS

    cfg = resolve_config({}, _yaml(tmp_path, dict(CONFIG_DEFAULTS)))
    want = {"run_dir": "adapters", "weight_decay": 0.0, "val_batches": 25, "steps_per_eval": 200,
            "steps_per_report": 10, "test_batches": 500, "lr_schedule": "constant", "nll_on_prompt": True,
            "iters": 1000, "learning_rate": 1e-5, "num_layers": 16, "segment_size": None,
            "init_adapters": None, "max_seq_length": 2048, "batch_size": 4}
    assert {k: cfg[k] for k in want} == want
    assert cfg["lora_parameters"] == {"rank": 8, "dropout": 0.0, "scale": 20.0, "keys": None}


# mlx_lm's examples/lora_config.yaml's settings, its commented-out lr_schedule and
# optimizer_config switched on.
EXAMPLE = dict(
    model="mlx_model", train=True, fine_tune_type="lora", optimizer="adamw",
    optimizer_config={"adamw": {"betas": [0.9, 0.999], "weight_decay": 0.05}}, data="/path/to/training/data",
    seed=0, num_layers=16, batch_size=4, iters=1000, val_batches=25, learning_rate=1e-5, steps_per_report=10,
    steps_per_eval=200, grad_accumulation_steps=1, resume_adapter_file=None, adapter_path="adapters",
    save_every=100, test=False, test_batches=100, max_seq_length=2048, grad_checkpoint=True, mask_prompt=True,
    lora_parameters={"keys": ["self_attn.q_proj", "self_attn.v_proj"], "rank": 8, "scale": 20.0, "dropout": 0.0},
    lr_schedule={"name": "cosine_decay", "warmup": 100, "warmup_init": 1e-7, "arguments": [1e-5, 1000, 1e-7]},
)


def test_example_config_with_schedule_and_adamw(tmp_path):
    path = _yaml(tmp_path, EXAMPLE)
    cfg = resolve_config({}, path)
    assert cfg["weight_decay"] == 0.05 and cfg["segment_size"] == 1 and cfg["nll_on_prompt"] is False
    assert cfg["test_batches"] == 100 and cfg["run_dir"] == "adapters"
    assert cfg["lora_parameters"]["keys"] == ["self_attn.q_proj", "self_attn.v_proj"]
    sched = cfg["lr_schedule"]
    assert sched == {"name": "cosine_decay", "warmup": 100, "warmup_init": 1e-7, "arguments": [1e-5, 1000, 1e-7]}

    # The schedule is mlx_lm's: the same learning rate at every step.
    from mlx_lm.tuner.utils import build_schedule as theirs

    from flash_cce.train.trainer import build_schedule

    ours = build_schedule(cfg["learning_rate"], cfg["iters"], cfg["warmup"], sched, cfg["min_learning_rate"])
    ref = theirs(dict(sched))
    assert [ours(s).item() for s in (0, 1, 50, 100, 101, 600, 1100)] == \
        [ref(s).item() for s in (0, 1, 50, 100, 101, 600, 1100)]
    assert "mlx_lm.lora's cosine_decay(1e-05, 1000, 1e-07)" in run_summary(cfg)
    assert "linear warmup 1e-07 -> 1e-05 over 100 steps" in run_summary(cfg)
    # adamw without options: MLX's own weight decay.
    path.write_text("optimizer: adamw\n")
    assert resolve_config({}, path)["weight_decay"] == mlx_lm_config.ADAMW_WEIGHT_DECAY


@pytest.mark.parametrize("text, message", [
    ("optimizer: sgd\n", "optimizer: got 'sgd'; flash-cce trains with AdamW (MLX's), so allowed: adam"),
    ("train: 1\n", "train: got 1; allowed: true or false"),
    ("report_to: wandb\n", "report_to: got 'wandb'; flash-cce writes its metrics to RUN_DIR/metrics.jsonl"),
    ("project_name: p\n", "project_name: got 'p'"),
    ("clear_cache_threshold: 1000\n", "clear_cache_threshold: got 1000; flash-cce does not clear"),
    ("hf_dataset: {path: billsum}\n", "hf_dataset: got {'path': 'billsum'}; flash-cce reads a local directory"),
    ("config: other.yaml\n", "config: a config file cannot name another"),
    ("optimizer: adamw\noptimizer_config: {adamw: {eps: 1.0e-6}}\n",
     "optimizer_config.adamw.eps: got 1e-06; flash-cce's AdamW keeps MLX's eps 1e-08: remove it"),
    ("optimizer: adam\noptimizer_config: {adam: {weight_decay: 0.1}}\n", "Adam has none; use optimizer: adamw"),
    ("resume_adapter_file: a/0000100_adapters.safetensors\n", "give it as init_adapters"),
    ("adapter_path: a\nrun_dir: b\n", "run_dir: set twice"),
    ("lr_schedule: {name: cosine_decay, arguments: [1e-5]}\n", "lr_schedule.arguments: got [1e-05]; allowed: a list of 2 or 3"),
    ("lr_schedule: {name: warmup_cosine, arguments: [1e-5, 10]}\n", "lr_schedule.name: got 'warmup_cosine'"),
    ("lr_schedule: {name: cosine_decay, arguments: [1e-5, 10], warmup: -1}\n", "lr_schedule.warmup: got -1"),
    ("lr_schedule: {name: cosine_decay, arguments: [1e-5, 10]}\nwarmup: 5\n", "warmup: got 5 with lr_schedule"),
    ("lr_schedule: step\n", "lr_schedule: got 'step' (a string); allowed: one of linear, cosine, constant, or mlx_lm's"),
])
def test_what_has_no_meaning_here_is_refused_in_one_line(tmp_path, text, message, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(settings.SettingsError) as e:
        resolve_config({}, path)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flash-cce train: error: ") and len(err.strip().splitlines()) == 1


def test_resume_adapter_file_is_a_warm_start_from_its_directory(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("resume_adapter_file: old/adapters.safetensors\n")
    assert resolve_config({}, path)["init_adapters"] == "old"


def test_mlx_lm_flags_are_aliases():
    flags = _train_flags("--train", "--adapter-path", "out", "--mask-prompt", "--grad-checkpoint",
                         "--steps-per-report", "5", "--test-batches", "3", "--optimizer", "adamw",
                         "--resume-adapter-file", "prev/adapters.safetensors", "--learning-rate", "2e-5")
    cfg = resolve_config(flags)
    assert (cfg["run_dir"], cfg["nll_on_prompt"], cfg["segment_size"], cfg["steps_per_report"],
            cfg["test_batches"], cfg["weight_decay"], cfg["init_adapters"], cfg["learning_rate"]) == \
        ("out", False, 1, 5, 3, 0.01, "prev", 2e-5)
    cfg = resolve_config(_train_flags())  # unset aliases change nothing
    assert (cfg["run_dir"], cfg["nll_on_prompt"], cfg["segment_size"], cfg["weight_decay"]) == ("run", True, None, 0.0)
    with pytest.raises(settings.SettingsError, match="run_dir: set twice"):
        _train_flags("--adapter-path", "a", "--run-dir", "b")
    with pytest.raises(settings.SettingsError, match="optimizer: got 'sgd'"):
        _train_flags("--optimizer", "sgd")
    with pytest.raises(settings.SettingsError, match="clear_cache_threshold: got 2147483648; flash-cce does not"):
        _train_flags("--clear-cache-threshold", "2GB")
    assert _train_flags("--clear-cache-threshold", "0")["segment_size"] is None


def test_top_level_help_lists_the_train_flags(capsys):
    with pytest.raises(SystemExit):
        main(["-h"])
    out = capsys.readouterr().out
    for flag in ("--learning-rate", "--objective", "--lora-rank", "--steps-per-report", "--adapter-path",
                 "--mask-prompt"):
        assert re.search(rf"(^|\s){flag}(\s|$)", out), flag


@pytest.mark.parametrize("flag, want", [("--learning_rate", "--learning-rate"),
                                        ("--lerning-rate", "--learning-rate"),
                                        ("--steps_per_report", "--steps-per-report"),
                                        ("--grad_checkpoint", "--grad-checkpoint")])
def test_misspelt_flag_gets_did_you_mean(flag, want, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", flag, "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {flag}" in err and f"(did you mean {want}?)" in err


def test_defaults_per_objective():
    pref = settings.check({"objective": "dpo"})
    sft = settings.check({"objective": "sft"})
    assert (pref["lr_schedule"], pref["val_batches"], pref["steps_per_eval"]) == ("linear", -1, 100)
    assert (sft["lr_schedule"], sft["val_batches"], sft["steps_per_eval"]) == ("constant", 25, 200)
    assert pref["weight_decay"] == sft["weight_decay"] == 0.0
    assert settings.check({"objective": "sft", "lr_schedule": "cosine"})["lr_schedule"] == "cosine"  # set wins
    summary = run_summary(sft)
    assert "Schedule: constant 1e-05; 1000 steps of 4 x 1 micro-batches" in summary
    assert "Optimizer: AdamW (weight decay 0, betas 0.9, 0.999, eps 1e-8), gradient norm clipped at 1" in summary
    assert "Validation: at step 0, every 200 steps and at the end, over at most 25 micro-batches" in summary
    assert "linear decay 1e-05 -> 0 over 990 steps" in run_summary(settings.check({"warmup": 10}))


def test_linear_schedule_decays_to_min_learning_rate():
    from flash_cce.train.trainer import build_schedule

    f = build_schedule(1.0, 12, warmup=2, schedule="linear", min_learning_rate=0.0)
    # warmup 0 -> 1 over 2 steps, then linear to 0 over the other 10 (TRL's linear schedule)
    assert [round(f(s).item(), 6) for s in range(13)] == [0.0, 0.5, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3,
                                                          0.2, 0.1, 0.0]


def test_docs_table_is_the_mapping():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    assert mlx_lm_config.table_markdown() in doc


def test_an_mlx_lm_config_trains_sft_on_trl_messages(tmp_path, capsys):
    """mlx_lm's example file (model and data pointed at the tiny ones, fewer steps) trains with
    only the objective added, on TRL's conversational SFT records."""
    import json

    from test_trainer import tiny_setup

    model_dir, data_dir = tiny_setup(tmp_path, n_train=8, n_valid=4)
    for split in ("train", "valid"):
        recs = [json.loads(line) for line in (data_dir / f"{split}.jsonl").read_text().splitlines()]
        (data_dir / f"{split}.jsonl").write_text("".join(
            json.dumps({"messages": [{"role": "user", "content": r["prompt"]},
                                     {"role": "assistant", "content": r["chosen"]}]}) + "\n" for r in recs))
    path = _yaml(tmp_path, dict(
        EXAMPLE, model=str(model_dir), data=str(data_dir), adapter_path=str(tmp_path / "adapters"), num_layers=2,
        iters=4, learning_rate=1e-3, steps_per_report=2, steps_per_eval=2, save_every=2, grad_checkpoint=False,
        mask_prompt=False, lr_schedule={"name": "cosine_decay", "warmup": 1, "warmup_init": 1e-7,
                                        "arguments": [1e-3, 4, 1e-7]},
        objective="sft"))
    assert main(["train", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "train: 8 sequences" in out and "mlx_lm.lora's cosine_decay(0.001, 4, 1e-07)" in out
    saved = json.loads((tmp_path / "adapters" / "adapters" / "adapter_config.json").read_text())
    assert saved["lora_parameters"]["keys"] == ["self_attn.q_proj", "self_attn.v_proj"]
