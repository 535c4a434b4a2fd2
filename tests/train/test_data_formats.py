"""TRL's data formats read by `flash-cce train`, with TRL 1.16's own tokenisation
as the reference: the functions `trl_*` below transcribe what TRL 1.16's
`extract_prompt`, `unpair_preference_dataset` and the DPO, SFT and KTO trainers'
`_prepare_dataset` do to a record (written here; TRL itself is not needed), and
each test compares the token ids flash-cce trains on with theirs."""

import json

import pytest
from mlx_lm.utils import load

from flash_cce.train.data import UNPAIR_BLOCK, load_pairs, unpair
from flash_cce.train.demo import demo_words
from flash_cce.train.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), demo_words())
    return load(str(path))[1]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ---- TRL 1.16, transcribed -------------------------------------------------------


def trl_is_conversational(example):
    for key in ("prompt", "chosen", "rejected", "completion", "messages"):
        if key in example:
            v = example[key]
            return isinstance(v, list) and isinstance(v[0], dict) and "role" in v[0]
    return False


def trl_tokenize(hf, x, **kw):
    """trl.data_utils._tokenize for a text-only tokenizer."""
    if isinstance(x, list):
        return list(hf.apply_chat_template(x, tokenize=True, return_dict=True, **kw)["input_ids"])
    return list(hf(text=x)["input_ids"])


def trl_common_prefix_length(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def trl_extract_prompt(example):
    chosen, rejected = example["chosen"], example["rejected"]
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # the space goes with the responses
                idx -= 1
            break
    return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def trl_dpo(hf, example):
    """DPOTrainer._prepare_dataset: (prompt_ids, chosen_ids, rejected_ids)."""
    if "prompt" not in example:
        example = trl_extract_prompt(example)
    example = dict(example)
    if not trl_is_conversational(example):
        for k in ("chosen", "rejected"):
            if not example[k].endswith(hf.eos_token):
                example[k] = example[k] + hf.eos_token
    gen = {"add_generation_prompt": True} if trl_is_conversational(example) else {}
    prompt_ids = trl_tokenize(hf, example["prompt"], **gen)
    pc = trl_tokenize(hf, example["prompt"] + example["chosen"])
    pr = trl_tokenize(hf, example["prompt"] + example["rejected"])
    n = min(trl_common_prefix_length(prompt_ids, pc), trl_common_prefix_length(prompt_ids, pr))
    return prompt_ids[:n], pc[n:], pr[n:]


def trl_sft(hf, example):
    """SFTTrainer._prepare_dataset: (input_ids, completion_mask or None)."""
    example = dict(example)
    if not trl_is_conversational(example):
        if "text" in example and not example["text"].endswith(hf.eos_token):
            example["text"] += hf.eos_token
        elif "completion" in example and not example["completion"].endswith(hf.eos_token):
            example["completion"] += hf.eos_token
    if "prompt" in example:
        gen = {"add_generation_prompt": True} if trl_is_conversational(example) else {}
        prompt_ids = trl_tokenize(hf, example["prompt"], **gen)
        ids = trl_tokenize(hf, example["prompt"] + example["completion"])
        n = trl_common_prefix_length(prompt_ids, ids)
        return ids, [0] * n + [1] * (len(ids) - n)
    return trl_tokenize(hf, example["messages"] if "messages" in example else example["text"]), None


def trl_unpair(rows, block=1000):
    """unpair_preference_dataset (a batched `datasets` map of 1000 rows per batch)."""
    out = []
    for start in range(0, len(rows), block):
        b = rows[start:start + block]
        out += [{"prompt": r["prompt"], "completion": r["chosen"], "label": True} for r in b]
        out += [{"prompt": r["prompt"], "completion": r["rejected"], "label": False} for r in b]
    return out


def trl_kto(hf, rows, batch_size):
    """KTOTrainer._prepare_dataset: [(prompt_ids, completion_ids, label, KL_completion_ids)]."""
    if "prompt" not in rows[0]:
        rows = [trl_extract_prompt(r) for r in rows]
    if "chosen" in rows[0]:
        rows = trl_unpair(rows)
    out = []
    for r in rows:
        r = dict(r)
        if not trl_is_conversational(r) and not r["completion"].endswith(hf.eos_token):
            r["completion"] += hf.eos_token
        gen = {"add_generation_prompt": True} if trl_is_conversational(r) else {}
        prompt_ids = trl_tokenize(hf, r["prompt"], **gen)
        ids = trl_tokenize(hf, r["prompt"] + r["completion"])
        n = trl_common_prefix_length(prompt_ids, ids)
        out.append([prompt_ids[:n], ids[n:], r["label"]])
    for start in range(0, len(out), batch_size):  # add_kl_completion_ids, batched by batch_size
        b = out[start:start + batch_size]
        kl = [b[-1][1]] + [x[1] for x in b[:-1]]
        for x, k in zip(b, kl):
            x.append(k)
    return [tuple(x) for x in out]


# ---- records ------------------------------------------------------------------

Q = "tom has a red ball . what color is the ball ?"
USER = [{"role": "user", "content": Q}]
RED = [{"role": "assistant", "content": "red ."}]
BLUE = [{"role": "assistant", "content": "blue ."}]


def _parts(messages):
    return [dict(m, content=[{"type": "text", "text": w + " "} for w in m["content"].split()[:-1]]
                 + [{"type": "text", "text": m["content"].split()[-1]}]) for m in messages]


PAIRS = [
    {"prompt": Q, "chosen": " red .", "rejected": " blue ."},  # TRL's standard form (responses open with a space)
    {"chosen": Q + " red .", "rejected": Q + " blue ."},  # implicit prompt, strings (Anthropic-HH style)
    {"prompt": USER, "chosen": RED, "rejected": BLUE},  # conversational
    {"chosen": USER + RED, "rejected": USER + BLUE},  # implicit prompt, conversations
    {"prompt": _parts(USER), "chosen": _parts(RED), "rejected": BLUE},  # content as text parts
]


@pytest.mark.parametrize("rec", PAIRS, ids=["strings", "implicit-strings", "messages", "implicit-messages",
                                            "text-parts"])
def test_preference_records_tokenise_as_trl_dpo(tok, tmp_path, rec):
    (pair,), _ = load_pairs(_write(tmp_path / "p.jsonl", [rec]), tok)
    prompt, chosen, rejected = trl_dpo(tok._tokenizer, json.loads(json.dumps(_plain(rec))))
    assert pair.chosen == prompt + chosen and pair.rejected == prompt + rejected
    assert pair.chosen_prompt_len == pair.rejected_prompt_len == len(prompt)


def _plain(rec):
    """`rec` with text parts joined (TRL hands parts to the template; the tiny template reads strings)."""
    def join(v):
        if isinstance(v, list):
            return [dict(m, content="".join(p["text"] for p in m["content"])) if isinstance(m["content"], list)
                    else m for m in v]
        return v
    return {k: join(v) for k, v in rec.items()}


def test_implicit_string_prompt_is_trl_extract_prompt(tok, tmp_path):
    rec = {"chosen": "Human: hi . Assistant: red .", "rejected": "Human: hi . Assistant: blue ."}
    want = trl_extract_prompt(rec)
    assert want == {"prompt": "Human: hi . Assistant:", "chosen": " red .", "rejected": " blue ."}
    from flash_cce.train.data import implicit_prompt

    assert implicit_prompt(rec["chosen"], rec["rejected"]) == (want["prompt"], want["chosen"], want["rejected"])


SFT = [
    {"messages": USER + RED},
    {"prompt": Q, "completion": " red ."},
    {"prompt": USER, "completion": RED},
    {"text": Q + " red ."},
    {"messages": _parts(USER) + RED},
    {"messages": USER + RED + [{"role": "user", "content": "what color is the ball ?"}] + BLUE},
]


@pytest.mark.parametrize("rec", SFT, ids=["messages", "prompt-completion", "prompt-completion-messages",
                                         "text", "messages-text-parts", "messages-two-turns"])
def test_sft_records_tokenise_as_trl_sft(tok, tmp_path, rec):
    (pair,), report = load_pairs(_write(tmp_path / "s.jsonl", [rec]), tok, kind="sft")
    ids, mask = trl_sft(tok._tokenizer, _plain(rec))
    assert pair.chosen == ids and report["records"] == 1
    if mask is not None:  # TRL's completion mask: the prompt is what nll_on_prompt false leaves out
        assert pair.chosen_prompt_len == mask.index(1)
    elif "text" in rec:
        assert pair.chosen_prompt_len == 0  # all of it trained, as TRL
    else:  # messages: the turns before the last, as mlx_lm's mask_prompt
        before = _plain(rec)["messages"][:-1]
        assert pair.chosen_prompt_len == len(trl_tokenize(tok._tokenizer, before, add_generation_prompt=True))


def test_sft_needs_no_rejected_and_reads_pairs(tok, tmp_path):
    recs = [{"prompt": Q, "chosen": " red ."}, {"prompt": Q, "chosen": " red .", "rejected": " blue ."}]
    a, b = load_pairs(_write(tmp_path / "s.jsonl", recs), tok, kind="sft")[0]
    ids, mask = trl_sft(tok._tokenizer, {"prompt": Q, "completion": " red ."})
    assert a.chosen == b.chosen == ids and a.chosen_prompt_len == mask.index(1)
    bad = _write(tmp_path / "b.jsonl", [{"messages": USER}])
    with pytest.raises(ValueError, match="b.jsonl:1: 'messages' must be a conversation ending with an assistant turn"):
        load_pairs(bad, tok, kind="sft")
    with pytest.raises(ValueError, match="b.jsonl:1: 'text' must be a non-empty string"):
        load_pairs(_write(bad, [{"text": " "}]), tok, kind="sft")


def test_non_text_parts_are_refused(tok, tmp_path):
    rec = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
           "chosen": RED, "rejected": BLUE}
    with pytest.raises(ValueError, match=r"p.jsonl:1: 'prompt'\[0\].content\[0\]: a part of type 'image'"):
        load_pairs(_write(tmp_path / "p.jsonl", [rec]), tok)


@pytest.mark.parametrize("rows", [
    [{"prompt": Q, "chosen": " red .", "rejected": " blue ."},
     {"prompt": "sam has a black bell . what color is the bell ?", "chosen": " black .", "rejected": " red ."},
     {"chosen": Q + " green .", "rejected": Q + " blue ."}],
    [{"prompt": USER, "completion": RED, "label": True}, {"prompt": USER, "completion": BLUE, "label": False},
     {"prompt": USER, "completion": [{"role": "assistant", "content": "green ."}], "label": True}],
], ids=["paired", "unpaired-messages"])
@pytest.mark.parametrize("batch_size", [2, 4])
def test_kto_examples_and_kl_completions_as_trl(tok, tmp_path, rows, batch_size):
    examples, _ = load_pairs(_write(tmp_path / "k.jsonl", rows), tok, kind="unpaired", kl_chunk=batch_size)
    rows = [dict(r, prompt=trl_extract_prompt(r)["prompt"], chosen=trl_extract_prompt(r)["chosen"],
                 rejected=trl_extract_prompt(r)["rejected"]) if "prompt" not in r and "chosen" in r else r
            for r in rows]
    want = trl_kto(tok._tokenizer, rows, batch_size)
    got = [(e.tokens[:e.prompt_len], e.completion(), e.label, e.kl_completion) for e in examples]
    assert got == want


def test_unpair_keeps_trl_block_order():
    recs = [({"prompt": str(i), "chosen": f"c{i}", "rejected": f"r{i}"}, f"f:{i}") for i in range(UNPAIR_BLOCK + 2)]
    out = [r["completion"] for r, _ in unpair(recs)]
    rows = [r for r, _ in recs]
    assert out == [r["completion"] for r in trl_unpair(rows)]
    assert out[UNPAIR_BLOCK - 1:UNPAIR_BLOCK + 1] == [f"c{UNPAIR_BLOCK - 1}", "r0"]
