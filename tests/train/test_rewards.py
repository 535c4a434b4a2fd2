"""GRPO reward functions as TRL calls them: loading by --reward, built-ins,
None, and one clear error for a function that fails; prompt data with columns."""

import math
import sys

import pytest

from flash_cce.train.data import DataError
from flash_cce.train.grpo_data import check_prompt_record, encode_prompts, read_prompt_splits
from flash_cce.train.rewards import (RewardError, TrainerState, as_completions, call_reward, load_reward,
                                     load_rewards)

PROMPTS = ["two plus two ?", [{"role": "user", "content": "three plus one ?"}]]
TEXTS = ["4", " 5 "]
IDS = [[7, 2], [8, 9, 10]]
COLUMNS = {"answer": ["4", "4"], "level": [1, 2]}
WHERE = ["train.jsonl:1", "train.jsonl:2"]


def _call(func, **kw):
    args = dict(prompts=PROMPTS, completions=as_completions(PROMPTS, TEXTS), completion_ids=IDS,
                columns=COLUMNS, where=WHERE)
    args.update(kw)
    return call_reward(func, args.pop("prompts"), args.pop("completions"), args.pop("completion_ids"),
                       args.pop("columns"), args.pop("where"), **args)


REWARDS_PY = '''
seen = {}

def spy(prompts, completions, completion_ids, trainer_state, **kwargs):
    seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids,
                step=trainer_state.global_step, kwargs=kwargs)
    return [float(len(c)) for c in completion_ids]

def skip_second(completions, **kwargs):
    return [1.0, None]

def explode(completions, level, **kwargs):
    if 2 in level:
        raise ZeroDivisionError("level two")
    return [0.0] * len(completions)

def short(completions, **kwargs):
    return [1.0]

def words(completions, **kwargs):
    return [1.0, "high"]

def infinite(completions, **kwargs):
    return [1.0, float("inf")]

not_a_function = 3
'''


@pytest.fixture
def module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARDS_PY)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    return tmp_path / "my_rewards.py"


def test_trl_signature_with_columns_and_trainer_state(module):
    spy = load_reward("my_rewards:spy")
    assert _call(spy, state=TrainerState(global_step=5, max_steps=9)) == [2.0, 3.0]
    seen = sys.modules["my_rewards"].seen
    assert seen["prompts"] == PROMPTS and seen["completion_ids"] == IDS and seen["step"] == 5
    # The conversation's completion is an assistant message, the string prompt's a string (TRL).
    assert seen["completions"] == ["4", [{"role": "assistant", "content": " 5 "}]]
    assert seen["kwargs"] == COLUMNS


def test_a_file_path_loads_as_a_module(module):
    assert _call(load_reward(f"{module}:spy")) == [2.0, 3.0]


def test_none_skips_as_nan(module):
    out = _call(load_reward("my_rewards:skip_second"))
    assert out[0] == 1.0 and math.isnan(out[1])


@pytest.mark.parametrize("func,needles", [
    ("explode", ["reward explode: raised ZeroDivisionError: level two", "record train.jsonl:2"]),
    ("short", ["reward short: returned 1 values for 2 completions", "train.jsonl:1"]),
    ("words", ["reward words: returned \"high\" for record train.jsonl:2", "finite number or None"]),
    ("infinite", ["reward infinite: returned", "record train.jsonl:2"]),
])
def test_a_failing_function_is_one_line_naming_it_and_the_record(module, func, needles):
    with pytest.raises(RewardError) as e:
        _call(load_reward(f"my_rewards:{func}"))
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)


@pytest.mark.parametrize("spec,needle", [
    ("my_rewards", "allowed: module:function"),
    ("my_rewards:missing", "has no function 'missing'"),
    ("my_rewards:not_a_function", "has no function 'not_a_function'"),
    ("no_such_module_xyz:f", "cannot import no_such_module_xyz (ModuleNotFoundError"),
    ("/no/such/file.py:f", "no such file /no/such/file.py"),
    ("format=(", "format=(: not a regular expression"),
    ("length=0", "length=0: expected a number of tokens from 1 to max_completion_length (8)"),
    ("length=x", "length=x: expected a number of tokens"),
])
def test_bad_specs(module, spec, needle):
    with pytest.raises(RewardError, match="reward") as e:
        load_reward(spec, max_completion_length=8)
    assert needle in str(e.value)


def test_weights_one_per_function(module):
    funcs, weights = load_rewards(["exact_match", "format"], None)
    assert [f.__name__ for f in funcs] == ["exact_match", "format"] and weights == [1.0, 1.0]
    with pytest.raises(RewardError, match="reward_weights: got 1 weights for 2 reward functions"):
        load_rewards(["exact_match", "format"], [0.5])
    with pytest.raises(RewardError, match="give at least one --reward"):
        load_rewards(None)


def test_exact_match_against_a_column():
    assert _call(load_reward("exact_match")) == [1.0, 0.0]  # " 5 " trimmed is still not "4"
    assert _call(load_reward("exact_match=level"), columns={"level": ["4", " 5"]}) == [1.0, 1.0]
    with pytest.raises(RewardError, match="no column 'solution'"):
        _call(load_reward("exact_match=solution"))


def test_format_matches_the_whole_completion():
    fmt = load_reward("format")  # one think block, then the answer
    texts = ["<think>a\nb</think> 4", "4 <think>x</think>"]
    assert _call(fmt, completions=as_completions(PROMPTS, texts)) == [1.0, 0.0]
    assert _call(load_reward(r"format=\d+"), completions=as_completions(PROMPTS, ["12", "1 2"])) == [1.0, 0.0]


def test_length_is_trls_soft_overlong_punishment():
    # max 10, cache 4: 0 up to 6 tokens, then -(n - 6) / 4, -1 from 10.
    reward = load_reward("length=4", max_completion_length=10)
    ids = [[0] * n for n in (3, 6, 7, 9, 10, 12)]
    got = _call(reward, prompts=["p"] * 6, completions=["x"] * 6, completion_ids=ids,
                columns={}, where=[f"r{i}" for i in range(6)])
    assert got == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]


def test_prompt_records(tmp_path):
    check_prompt_record({"prompt": "a", "answer": 3}, "f:1")
    check_prompt_record({"prompt": [{"role": "user", "content": "a"}]}, "f:1")
    for rec, needle in [({"question": "a"}, "missing key 'prompt'"), ({"prompt": ""}, "non-empty string"),
                        ({"prompt": [{"role": "user"}]}, "'prompt'[0] must be a message"),
                        ({"prompt": "a", "completions": 1}, "column 'completions' clashes")]:
        with pytest.raises(DataError, match="f:1: .*" + needle.replace("[", r"\[").replace("]", r"\]")):
            check_prompt_record(rec, "f:1")
    (tmp_path / "train.jsonl").write_text('{"prompt": "a b", "answer": "x"}\n{"prompt": "c", "k": 1}\n')
    splits = read_prompt_splits(tmp_path, ("train", "valid"))
    assert list(splits) == ["train"] and splits["train"][1][1].endswith("train.jsonl:2")


class Words:
    """A tokenizer of whitespace words (ids = word lengths), BOS 1."""

    eos_token_id = 2

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [len(w) for w in text.split()]


def test_prompt_ids_and_truncation():
    recs = [({"prompt": "aa bbb c", "answer": "x"}, "f:1"), ({"prompt": "dddd", "level": 2}, "f:2")]
    p, report = encode_prompts(recs, Words(), 3)
    assert p.ids == [[2, 3, 1], [1, 4]] and report == dict(records=2, truncated=1, dropped=0)  # keep_end
    assert p.columns([0, 1]) == {"answer": ["x", None], "level": [None, 2]}
    p, _ = encode_prompts(recs, Words(), 3, "keep_start")
    assert p.ids[0] == [1, 2, 3]
    p, report = encode_prompts(recs, Words(), 3, "drop")
    assert p.where == ["f:2"] and report["dropped"] == 1
    with pytest.raises(DataError, match="f:1: the prompt has 4 tokens"):
        encode_prompts(recs, Words(), 3, "error")


def test_settings_are_the_grpo_config_fields_with_its_defaults():
    """Every GRPOConfig field is a setting of the same name (the CLI passes them
    through, grad_accumulation_steps as gradient_accumulation_steps;
    repetition_penalty is not sampled, the vllm_* correction has no separate
    sampler to correct) and the default settings make the default GRPOConfig."""
    from dataclasses import asdict, fields

    from flash_cce.train import settings
    from flash_cce.train.grpo_config import GRPOConfig
    from flash_cce.train.grpo_trainer import grpo_config

    # The sampler is the policy itself (as TRL's own generation, not vLLM's): no sampler correction.
    vllm = {f.name for f in fields(GRPOConfig) if f.name.startswith("vllm_")}
    names = {f.name for f in fields(GRPOConfig)} - {"gradient_accumulation_steps", "repetition_penalty"} - vllm
    assert names <= set(settings.BY_NAME), names - set(settings.BY_NAME)
    ours = asdict(grpo_config(settings.resolve({"objective": "grpo"})))
    # TRL 1.16's GRPOConfig.max_completion_length defaults to 512.
    assert ours["max_completion_length"] == 512
    assert ours == asdict(GRPOConfig().validate())
