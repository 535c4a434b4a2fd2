"""The settings schema: YAML typing as mlx_lm reads it, checks, defaults, and
what derives from it (flags, TrainingArgs, config.yaml, the docs' table)."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from flash_cce.train import settings
from flash_cce.train.cli import build_parser
from flash_cce.train.trainer import TrainingArgs

NUMBERS = ["1e-4", "1E5", "-2e-3", "+3e2", "1.5e-5", "2.0", "10", "-7", ".5", "1_000", "0x1f", "1e", "e5", "1.2.3"]


def test_yaml_numbers_read_as_mlx_lm_reads_them(tmp_path):
    from mlx_lm.lora import yaml_loader  # mlx_lm.lora's own loader: the reference

    for text in NUMBERS:
        path = tmp_path / "c.yaml"
        path.write_text(f"value: {text}\n")
        ours = settings.load_yaml(path)["value"]
        theirs = yaml.load(path.read_text(), yaml_loader)["value"]
        assert ours == theirs and type(ours) is type(theirs), text
    assert isinstance(settings.load_yaml(_write(tmp_path, "learning_rate: 1e-4\n"))["learning_rate"], float)


def _write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_defaults_pass_their_own_checks_and_dataclasses_share_them():
    cfg = settings.check({})
    assert cfg == settings.defaults()
    for f in dataclasses.fields(TrainingArgs):
        if f.name in settings.BY_NAME:
            assert f.default == settings.BY_NAME[f.name].default, f.name
            assert f.metadata["help"] == settings.BY_NAME[f.name].help


def test_every_setting_has_a_flag_or_a_nested_flag_and_help_shows_its_default():
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]
    dests = {a.dest: a for a in train._actions}
    for s in settings.SETTINGS:
        if s.flag:
            assert s.name in dests, s.name
            assert f"(default: {settings.show(s.default)})" in dests[s.name].help
    for flag, (table, _) in settings.NESTED_FLAGS.items():
        assert flag in dests and table in settings.BY_NAME


def test_partial_tables_are_completed_and_misspelt_keys_refused():
    cfg = settings.check({"lora_parameters": {"rank": 4}, "quantize": {"bits": 8}})
    assert cfg["lora_parameters"] == {"rank": 4, "scale": 20.0, "dropout": 0.0, "keys": None}
    assert cfg["quantize"] == {"bits": 8, "group_size": 64}
    with pytest.raises(settings.SettingsError, match=r"lora_parameters: unknown key 'scal' \(did you mean 'scale'\?\)"):
        settings.check({"lora_parameters": {"scal": 2.0}})
    with pytest.raises(settings.SettingsError, match="lora_parameters.dropout: got 1.0; allowed: a number >= 0 and < 1"):
        settings.check({"lora_parameters": {"dropout": 1.0}})


@pytest.mark.parametrize("cfg, message", [
    ({"iters": 2.5}, "iters: got 2.5; allowed: an integer >= 1"),
    ({"iters": True}, "iters: got true; allowed: an integer >= 1"),
    ({"learning_rate": "1e-4"}, "learning_rate: got '1e-4' (a string); allowed: a number > 0"),
    ({"learning_rate": float("nan")}, "learning_rate: got nan; allowed: a number > 0"),
    ({"num_layers": 0}, "num_layers: got 0; allowed: an integer >= 1 or -1"),
    ({"chat_template": "yes"}, "chat_template: got 'yes' (a string); allowed: auto, true or false"),
    ({"pad_to": -1}, "pad_to: got -1; allowed: auto or an integer >= 0"),
    ({"model": ""}, "model: got '' (a string); allowed: a path or null"),
    ({"lora_parameters": None}, "lora_parameters: got null; allowed: a mapping with keys rank, scale, dropout, keys"),
    ({"lora_parameters": {"keys": []}}, "lora_parameters.keys: got [] (a list); allowed: a list of strings or null"),
    ({"quantize": {"bits": 7}}, "quantize.bits: got 7; allowed: one of 2, 3, 4, 5, 6, 8"),
    ({"fine_tune_type": "full", "quantize": {}}, "quantize: a quantized base needs fine_tune_type lora or dora"),
    ({"iters": 10, "warmup": 10}, "warmup: got 10; allowed: < iters (10)"),
    ({"resume": "a", "init_adapters": "b"}, "init_adapters: give either resume"),
])
def test_bad_values_name_key_value_and_allowed(cfg, message):
    with pytest.raises(settings.SettingsError) as e:
        settings.check(cfg)
    assert message in str(e.value)


def test_bad_yaml_files_are_one_line_errors(tmp_path):
    cases = [("iters: [1,\n", "invalid YAML"), ("- 1\n- 2\n", "must hold a mapping of settings, got list"),
             ("1: 2\n", "key 1 is not a setting name")]
    for text, message in cases:
        with pytest.raises(settings.SettingsError, match=message):
            settings.load_yaml(_write(tmp_path, text))
    (tmp_path / "bin.yaml").write_bytes(b"iters: \xff\n")
    with pytest.raises(settings.SettingsError, match="is not UTF-8"):
        settings.load_yaml(tmp_path / "bin.yaml")
    assert settings.load_yaml(_write(tmp_path, "")) == {}


def test_flags_override_yaml_over_base():
    cfg = settings.resolve({"lora_rank": 16, "iters": None}, None,
                           base={"lora_parameters": {"rank": 4, "scale": 2.0}, "iters": 7})
    assert cfg["lora_parameters"]["rank"] == 16 and cfg["lora_parameters"]["scale"] == 2.0
    assert cfg["iters"] == 7


def test_docs_reference_is_the_schema():
    """docs/training.md carries the table `reference_markdown` makes."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    assert settings.reference_markdown() in doc


def test_loss_types_are_the_objectives():
    """The schema's loss_type choices are the loss types the objectives take."""
    from flash_cce.train import losses

    want = {t for obj in losses.OBJECTIVES.values() for t in obj.loss_types}
    assert set(settings.LOSS_TYPES) == want
