"""TRL preference records -> Pairs: formats, chat templates, truncation, errors."""

import json

import pytest
from mlx_lm.utils import load

from flash_cce.stack.batch import Pair
from flash_cce.train.data import format_summary, length_summary, load_pairs, load_splits, truncate
from flash_cce.train.demo import demo_words
from flash_cce.train.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), demo_words())
    return load(str(path))[1]


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def ids(tok, text):
    return [tok.vocab[w] for w in text.split()]


# Responses open with a space, as in TRL's data: TRL tokenises `prompt + chosen` as one string.
STR_REC = {"prompt": "tom has a red ball .", "chosen": " red .", "rejected": " blue ."}


def test_string_record_layout(tok, tmp_path):
    (pair,), report = load_pairs(_write(tmp_path / "a.jsonl", [STR_REC]), tok)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    prompt = [bos] + ids(tok, "tom has a red ball .")
    assert pair.chosen == prompt + ids(tok, "red .") + [eos]
    assert pair.rejected == prompt + ids(tok, "blue .") + [eos]
    assert pair.chosen_prompt_len == pair.rejected_prompt_len == len(prompt)
    assert report == dict(records=1, truncated=0, dropped=0, prompt_cut=0, merged=0)


def _chat_ids(tok, turns, generation_prompt):
    """The tiny template written out by hand: '<|role|> content <|end|> ' per turn."""
    out = []
    for role, content in turns:
        out += [tok.vocab[f"<|{role}|>"]] + ids(tok, content) + [tok.vocab["<|end|>"]]
    if generation_prompt:
        out.append(tok.vocab["<|assistant|>"])
    return out


def test_chat_messages_and_implicit_prompt(tok, tmp_path):
    user = [{"role": "user", "content": "what color is the ball ?"}]
    a = [{"role": "assistant", "content": "red ."}]
    b = [{"role": "assistant", "content": "blue ."}]
    recs = [{"prompt": user, "chosen": a, "rejected": b}, {"chosen": user + a, "rejected": user + b}]
    pairs, _ = load_pairs(_write(tmp_path / "c.jsonl", recs), tok)
    q = ("user", "what color is the ball ?")
    for pair in pairs:
        # The prompt is the user turn plus the generation prompt; the reply's
        # <|end|> closes the response.
        assert pair.chosen == _chat_ids(tok, [q, ("assistant", "red .")], False)
        assert pair.rejected == _chat_ids(tok, [q, ("assistant", "blue .")], False)
        assert pair.chosen_prompt_len == len(_chat_ids(tok, [q], True))
        assert pair.shares_prompt()


def test_chat_template_true_wraps_strings(tok, tmp_path):
    (pair,), _ = load_pairs(_write(tmp_path / "a.jsonl", [STR_REC]), tok, chat_template=True)
    assert pair.chosen == _chat_ids(tok, [("user", STR_REC["prompt"]), ("assistant", "red .")], False)


MALFORMED = [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"prompt": "a", "chosen": "red ."}, "missing key 'rejected'"),
    ({"prompt": "a", "chosen": 3, "rejected": "b"}, "'chosen' must be a string or a list of messages"),
    ({"prompt": "a", "chosen": "  ", "rejected": "b"}, "'chosen' is an empty string"),
    ({"prompt": "a", "chosen": [{"role": "assistant"}], "rejected": [{"role": "assistant", "content": "x"}]},
     "'chosen'[0] must be a message"),
    ({"prompt": "a", "chosen": [{"role": "assistant", "content": "x"}], "rejected": "b"}, "mix of strings"),
    ({"chosen": "red .", "rejected": "blue ."}, "without 'prompt', chosen and rejected must begin with the same text"),
    ({"chosen": "tom red .", "rejected": "tom red ."}, "must begin with the same text (the prompt) and differ"),
]


@pytest.mark.parametrize("bad,message", MALFORMED)
def test_malformed_record_names_file_and_line(tok, tmp_path, bad, message):
    path = _write(tmp_path / "bad.jsonl", [STR_REC, "", bad])
    with pytest.raises(ValueError) as e:
        load_pairs(path, tok)
    assert str(e.value).startswith(f"{path}:3: ")
    assert message in str(e.value)


def _pair(prompt, chosen, rejected):
    return Pair(list(range(prompt + chosen)), list(range(prompt + rejected)), prompt, prompt)


def test_truncation_modes():
    p = _pair(6, 4, 3)  # chosen 10 tokens, rejected 9
    assert truncate(p, 10, "error") is p
    kept = truncate(p, 8, "keep_end")  # 2 leading prompt tokens go from both sides
    assert (kept.chosen, kept.rejected, kept.chosen_prompt_len) == (p.chosen[2:], p.rejected[2:], 4)
    start = truncate(p, 8, "keep_start")  # the chosen response loses its last 2 tokens
    assert (start.chosen, start.rejected, start.chosen_prompt_len) == (p.chosen[:8], p.rejected[:8], 6)
    assert truncate(p, 8, "drop") is None
    assert truncate(p, 6, "keep_start") is None  # no response token would be left
    with pytest.raises(ValueError, match="max_seq_length=8"):
        truncate(p, 8, "error")


def test_truncation_counts_and_errors(tok, tmp_path):
    path = _write(tmp_path / "t.jsonl", [STR_REC, dict(STR_REC, prompt="tom")])
    pairs, report = load_pairs(path, tok, max_seq_length=6, truncation="drop")
    assert len(pairs) == 1 and report == dict(records=2, truncated=0, dropped=1, prompt_cut=0, merged=0)
    pairs, report = load_pairs(path, tok, max_seq_length=6, truncation="keep_end")
    assert [len(p.chosen) for p in pairs] == [6, 5] and report["truncated"] == 1
    with pytest.raises(ValueError, match=r"t.jsonl:1: .*max_seq_length=6"):
        load_pairs(path, tok, max_seq_length=6, truncation="error")
    with pytest.raises(ValueError, match="truncation must be one of"):
        load_pairs(path, tok, truncation="cut")


def test_splits_and_summary(tok, tmp_path):
    _write(tmp_path / "train.jsonl", [STR_REC] * 3)
    _write(tmp_path / "valid.jsonl", [STR_REC])
    splits = load_splits(tmp_path, tok)
    assert sorted(splits) == ["train", "valid"] and len(splits["train"][0]) == 3
    stats = length_summary(splits["train"][0])
    assert stats["prompt"]["max"] == 7 and stats["pair"]["mean"] == 20.0  # BOS + 6 words; 2 x (7 + 3)
    assert "3 pairs" in format_summary("train", *splits["train"])
    with pytest.raises(ValueError, match="data: .*missing. does not exist; give a directory"):
        load_splits(tmp_path / "missing", tok)


UNPAIRED = {"prompt": "tom has a red ball .", "completion": "red .", "label": True}


def test_unpaired_record_layout_and_truncation(tok, tmp_path):
    recs = [UNPAIRED, dict(UNPAIRED, completion="blue .", label=False)]
    examples, report = load_pairs(_write(tmp_path / "u.jsonl", recs), tok, unpaired=True)
    prompt = [tok.bos_token_id] + ids(tok, "tom has a red ball .")
    assert examples[0].tokens == prompt + ids(tok, "red .") + [tok.eos_token_id]
    assert examples[1].tokens == prompt + ids(tok, "blue .") + [tok.eos_token_id]
    assert [e.label for e in examples] == [True, False]
    assert examples[0].prompt_len == len(prompt) and report["truncated"] == 0
    cut, report = load_pairs(tmp_path / "u.jsonl", tok, unpaired=True, max_seq_length=6)
    assert cut[0].tokens == examples[0].tokens[4:] and cut[0].prompt_len == len(prompt) - 4
    assert report == dict(records=2, truncated=2, dropped=0, prompt_cut=0, merged=0)
    assert "2 examples (1 desirable)" in format_summary("train", examples, report)
    # KTO's KL completions, fixed at loading: each the completion of the example before it.
    assert examples[1].kl_completion == examples[0].completion()
    assert examples[0].kl_completion == examples[1].completion()
    assert cut[0].kl_completion == cut[1].completion()


def test_unpaired_chat_messages(tok, tmp_path):
    user = [{"role": "user", "content": "what color is the ball ?"}]
    rec = {"prompt": user, "completion": [{"role": "assistant", "content": "red ."}], "label": False}
    (example,), _ = load_pairs(_write(tmp_path / "c.jsonl", [rec]), tok, unpaired=True)
    q = ("user", "what color is the ball ?")
    assert example.tokens == _chat_ids(tok, [q, ("assistant", "red .")], False)
    assert example.prompt_len == len(_chat_ids(tok, [q], True)) and example.label is False


UNPAIRED_MALFORMED = [
    ({"prompt": "a", "completion": "red ."}, "missing key 'label'"),
    ({"prompt": "a", "completion": "red .", "label": 1}, "'label' must be true or false, got 1"),
    ({"prompt": "a", "completion": "red .", "label": "yes"}, "'label' must be true or false"),
    ({"prompt": "a", "label": True}, "missing key 'completion'"),
    ({"prompt": "a", "completion": " ", "label": True}, "'completion' is an empty string"),
    ({"prompt": "a", "completion": [{"role": "assistant", "content": "x"}], "label": True}, "mix of strings"),
    (STR_REC, "a paired record in a split of unpaired ones; use one form per file"),
]


@pytest.mark.parametrize("bad,message", UNPAIRED_MALFORMED)
def test_malformed_unpaired_record_names_file_and_line(tok, tmp_path, bad, message):
    path = _write(tmp_path / "bad.jsonl", [UNPAIRED, "", bad])
    with pytest.raises(ValueError) as e:
        load_pairs(path, tok, unpaired=True)
    assert str(e.value).startswith(f"{path}:3: ")
    assert message in str(e.value)
