"""Token ids where prompt and response merge into one token: each objective
tokenises records as the TRL 1.16 trainer it mirrors (DPO, KTO and SFT: the
prompt ends where the prompt's tokens and the joint tokens first differ; CPO
and ORPO, whose loss types include SimPO: `build_tokenized_answer`'s one-token
step back, BOS and EOS ids). The references are transcriptions of TRL's code
written here (`trl_cpo` below, `trl_dpo`, `trl_sft`, `trl_kto` in
test_data_formats) on a small BPE tokenizer whose merges straddle the
boundary; with `trl` importable, the last tests run TRL's own functions on the
same rows."""

import json
import string
from itertools import takewhile

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from test_data_formats import trl_dpo, trl_extract_prompt, trl_is_conversational, trl_kto, trl_sft

from flash_cce.train.data import DataError, Encoder, load_pairs

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
# Merges in rank order, each there for a case below.
MERGES = [
    ("t", "h"), ("th", "e"), (" ", "the"),  # "x th" + "en": the prompt's last two tokens re-merge (" the")
    ("q", " the"),  # "q th" + "em.": a merged token that swallows the prompt's first token too
    (" ", "r"), (" r", "e"), (" re", "d"),  # "a: " + "red": the prompt's trailing space joins the word
    ("?", " "),  # "?" + " blue": the response's leading space joins the prompt's last character
    ("b", "l"), (" ", "bl"),
]
# A template whose generation prompt ends in a space, so a reply's first word takes it.
TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


def _bpe(path, bos=True):
    """The BPE tokenizer of MERGES in `path`, its plain-text encodes starting with BOS if `bos`."""
    from tokenizers import Tokenizer, models, processors

    vocab = {t: i for i, t in enumerate(SPECIAL + list(string.ascii_lowercase + string.digits + " ?.:\n"))}
    for a, b in MERGES:
        vocab.setdefault(a + b, len(vocab))
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=MERGES, unk_token="<unk>"))  # no pre-tokenizer: merges cross spaces
    bpe.add_special_tokens(SPECIAL)
    if bos:
        bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    bpe.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", chat_template=TEMPLATE)))
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return _bpe(tmp_path_factory.mktemp("bpe"))


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _pieces(tok, ids):
    return tok._tokenizer.convert_ids_to_tokens(ids)


# ---- TRL 1.16's CPOTrainer / ORPOTrainer, transcribed ------------------------------


def trl_apply_chat_template(hf, example):
    """data_utils.apply_chat_template of a preference example with a prompt."""
    last = example["prompt"][-1]["role"]
    if last not in ("user", "tool", "assistant"):
        raise ValueError(f"Invalid role in the last message: {last}")
    prompt = hf.apply_chat_template(example["prompt"], tokenize=False, add_generation_prompt=last != "assistant",
                                    continue_final_message=last == "assistant")
    joint = {k: hf.apply_chat_template(example["prompt"] + example[k], tokenize=False) for k in ("chosen", "rejected")}
    for k in ("chosen", "rejected"):
        prompt = "".join(x for x, _ in takewhile(lambda x: x[0] == x[1], zip(prompt, joint[k])))
    return {"prompt": prompt, "chosen": joint["chosen"][len(prompt):], "rejected": joint["rejected"][len(prompt):]}


def trl_build_tokenized_answer(hf, prompt, answer):
    full = hf(prompt + answer, add_special_tokens=False)["input_ids"]
    prompt_ids = hf(prompt, add_special_tokens=False)["input_ids"]
    if len(full) < len(prompt_ids):  # len(enc(a) + enc(a + b)[len(enc(a)):]) != len(enc(a + b))
        raise ValueError("Prompt input ids and answer input ids should have the same length.")
    start = len(prompt_ids)
    if prompt_ids != full[:start]:
        start -= 1
    return full[:start], full[start:]


def trl_cpo(hf, example):
    """CPOTrainer (and ORPOTrainer, the same code): maybe_extract_prompt,
    maybe_apply_chat_template, tokenize_row -> ((chosen ids, prompt len), (rejected ids, prompt len))."""
    if "prompt" not in example:
        example = trl_extract_prompt(example)
    if trl_is_conversational(example):
        example = trl_apply_chat_template(hf, example)
    cp, ca = trl_build_tokenized_answer(hf, example["prompt"], example["chosen"])
    rp, ra = trl_build_tokenized_answer(hf, example["prompt"], example["rejected"])
    if sum(a != b for a, b in zip(cp, rp)) > 1 or abs(len(cp) - len(rp)) > 1:
        raise ValueError("Chosen and rejected prompt_input_ids might only differ on the last token due to "
                         "tokenizer merge ops.")
    out = []
    for p, a in ((cp, ca), (rp, ra)):
        if hf.bos_token_id is not None and (len(p) == 0 or p[0] != hf.bos_token_id):
            p = [hf.bos_token_id] + p
        if len(a) == 0 or a[-1] != hf.eos_token_id:
            a = a + [hf.eos_token_id]
        out.append((p + a, len(p)))
    return tuple(out)


# ---- records --------------------------------------------------------------------

USER = [{"role": "user", "content": "what color?"}]
RED = [{"role": "assistant", "content": "red."}]
FOUR = [{"role": "assistant", "content": "4."}]
PAIRS = {
    "standard": {"prompt": "what color?", "chosen": " red.", "rejected": " blue."},  # "? " merges for blue only
    "trailing-space": {"prompt": "q: what color? a: ", "chosen": "red.", "rejected": "blue."},
    "remerged": {"prompt": "x th", "chosen": "en.", "rejected": " no."},  # chosen: " the" takes two prompt tokens
    "implicit": {"chosen": "a: red.", "rejected": "a: blue."},  # TRL's prompt "a:", responses " red." / " blue."
    "chat": {"prompt": USER, "chosen": RED, "rejected": FOUR},  # " red" takes the space, "4" does not
    "chat-implicit": {"chosen": USER + RED, "rejected": USER + FOUR},
    "chat-continued": {"prompt": USER + [{"role": "assistant", "content": "it is"}],
                       "chosen": [{"role": "assistant", "content": "red."}], "rejected": FOUR},
}


def test_the_tokenizer_merges_across_the_boundary(tok):
    """The cases are what they claim: the prompt's own tokens are no prefix of the joint ones."""
    hf = tok._tokenizer
    p, joint = hf("x th")["input_ids"], hf("x then.")["input_ids"]
    assert _pieces(tok, p) == ["<s>", "x", " ", "th"] and _pieces(tok, joint) == ["<s>", "x", " the", "n", "."]
    assert _pieces(tok, hf("q: what color? a: red.")["input_ids"])[-3:] == [":", " red", "."]
    assert _pieces(tok, hf("what color? blue.")["input_ids"])[-5:] == ["? ", "bl", "u", "e", "."]
    assert _pieces(tok, hf("what color? red.")["input_ids"])[-3:] == ["?", " red", "."]


# The TRL trainer of each pair objective (docs/objectives.md): SimPO is a CPO loss
# type, orpo_margin is ORPO with a margin, and ORPOTrainer tokenises as CPOTrainer.
TRL_TRAINER = {"dpo": "dpo", "cpo": "cpo", "orpo": "cpo", "simpo": "cpo", "orpo_margin": "cpo"}


@pytest.mark.parametrize("name", PAIRS)
@pytest.mark.parametrize("objective", TRL_TRAINER)
def test_pairs_tokenise_as_the_objectives_trl_trainer(tok, tmp_path, name, objective):
    rec = PAIRS[name]
    (pair,), _ = load_pairs(_write(tmp_path / "p.jsonl", [rec]), tok, objective=objective)
    hf = tok._tokenizer
    if TRL_TRAINER[objective] == "cpo":
        (chosen, cp), (rejected, rp) = trl_cpo(hf, dict(rec))
        assert (pair.chosen, pair.chosen_prompt_len, pair.rejected, pair.rejected_prompt_len) == (
            chosen, cp, rejected, rp)
    else:
        prompt, chosen, rejected = trl_dpo(hf, dict(rec))
        assert pair.chosen == prompt + chosen and pair.rejected == prompt + rejected
        assert pair.chosen_prompt_len == pair.rejected_prompt_len == len(prompt)


def test_where_the_merged_token_goes(tok, tmp_path):
    """The layouts spelt out: DPO's prompt stops at the first differing token
    (both sides, the shorter), CPO's one token before the prompt's own end."""
    recs = [PAIRS["remerged"], PAIRS["chat"]]
    path = _write(tmp_path / "p.jsonl", recs)
    (dpo, dpo_chat), _ = load_pairs(path, tok, objective="dpo")
    (cpo, cpo_chat), _ = load_pairs(path, tok, objective="cpo")
    assert _pieces(tok, dpo.chosen[:dpo.chosen_prompt_len]) == ["<s>", "x"]
    assert _pieces(tok, dpo.chosen[dpo.chosen_prompt_len:]) == [" the", "n", ".", "</s>"]
    assert dpo.rejected_prompt_len == 2  # " ", "th", " ", "n", ... all response, as TRL's min over the pair
    assert _pieces(tok, cpo.chosen[:cpo.chosen_prompt_len]) == ["<s>", "x", " the"]  # holds the response's "e"
    assert _pieces(tok, cpo.rejected[:cpo.rejected_prompt_len]) == ["<s>", "x", " ", "th"]
    # Chat: " red" takes the generation prompt's space, "4" does not.
    assert _pieces(tok, dpo_chat.chosen[dpo_chat.chosen_prompt_len:])[:1] == [" red"]
    assert _pieces(tok, dpo_chat.rejected[dpo_chat.rejected_prompt_len:])[:2] == [" ", "4"]
    assert dpo_chat.chosen[0] != tok.bos_token_id  # the template renders no BOS; DPO adds none
    assert cpo_chat.chosen[0] == cpo_chat.rejected[0] == tok.bos_token_id  # CPO adds the BOS id
    assert cpo_chat.rejected_prompt_len == cpo_chat.chosen_prompt_len + 1


def test_cpo_refuses_what_trl_refuses(tok, tmp_path):
    # "q th" + "em." -> ["q the", "m", "."]: the prompt's first token merged away on the chosen side only.
    two = {"prompt": "q th", "chosen": "em.", "rejected": " no."}
    with pytest.raises(ValueError, match="only differ on the last token"):
        trl_cpo(tok._tokenizer, two)
    with pytest.raises(DataError, match="p.jsonl:1: the prompt tokenises differently before chosen and before "
                                        "rejected in more than its last token"):
        load_pairs(_write(tmp_path / "p.jsonl", [two]), tok, objective="orpo")
    shorter = {"prompt": "x th th", "chosen": "e", "rejected": " no."}  # 5 prompt tokens, 4 joint ones
    with pytest.raises(ValueError, match="should have the same length"):
        trl_cpo(tok._tokenizer, shorter)
    with pytest.raises(DataError, match="p.jsonl:1: the prompt followed by its response has fewer tokens"):
        load_pairs(_write(tmp_path / "p.jsonl", [shorter]), tok, objective="cpo")
    system = {"prompt": [{"role": "system", "content": "be brief"}], "chosen": RED, "rejected": FOUR}
    with pytest.raises(ValueError, match="Invalid role"):
        trl_cpo(tok._tokenizer, system)
    with pytest.raises(DataError, match="p.jsonl:1: the prompt's last message has role 'system'"):
        load_pairs(_write(tmp_path / "p.jsonl", [system]), tok, objective="simpo")
    # DPO tokenises both without complaint, as TRL's DPOTrainer does.
    (pair,), _ = load_pairs(_write(tmp_path / "p.jsonl", [two]), tok, objective="dpo")
    prompt, chosen, _ = trl_dpo(tok._tokenizer, dict(two))
    assert pair.chosen == prompt + chosen


def test_a_prompt_merged_whole_is_refused(tmp_path):
    """Without BOS, "?" + " blue." shares not one token with "?" alone ("? " merges): TRL would
    train it with an empty prompt; flash-cce names the record instead."""
    tok = _bpe(tmp_path, bos=False)
    rec = {"prompt": "?", "chosen": " blue.", "rejected": " 4."}
    prompt, chosen, _ = trl_dpo(tok._tokenizer, dict(rec))
    assert prompt == [] and _pieces(tok, chosen)[0] == "? "
    with pytest.raises(DataError, match="p.jsonl:1: the prompt's tokens share no leading token with the prompt "
                                        "followed by its response"):
        load_pairs(_write(tmp_path / "p.jsonl", [rec]), tok, objective="dpo")


def test_a_response_that_begins_the_other_is_refused(tok, tmp_path):
    """TRL's extract_prompt finds no difference and takes the shorter less its last character."""
    rec = {"chosen": "a: red.", "rejected": "a: red. no."}
    assert trl_extract_prompt(rec) == {"prompt": "a: red", "chosen": ".", "rejected": ". no."}
    with pytest.raises(DataError, match="p.jsonl:1: without 'prompt', chosen and rejected must begin with the same "
                                        "text"):
        load_pairs(_write(tmp_path / "p.jsonl", [rec]), tok)


SFT = {
    "trailing-space": {"prompt": "q: what color? a: ", "completion": "red."},
    "remerged": {"prompt": "x th", "completion": "en."},
    "chat": {"prompt": USER, "completion": RED},
    "text": {"text": "q: what color? a: red."},
    "messages": {"messages": USER + RED},
}


@pytest.mark.parametrize("name", SFT)
def test_sft_tokenises_as_trl_sft(tok, tmp_path, name):
    rec = SFT[name]
    (pair,), _ = load_pairs(_write(tmp_path / "s.jsonl", [rec]), tok, kind="sft", objective="sft")
    ids, mask = trl_sft(tok._tokenizer, dict(rec))
    assert pair.chosen == ids
    if mask is not None:  # the completion mask starts where the prompt ends
        assert pair.chosen_prompt_len == mask.index(1)


KTO = {
    "paired": [PAIRS["trailing-space"], PAIRS["remerged"], PAIRS["standard"]],
    "implicit": [PAIRS["implicit"], {"chosen": "x then.", "rejected": "x th no."}],
    "unpaired": [{"prompt": "q: what color? a: ", "completion": "red.", "label": True},
                 {"prompt": "x th", "completion": "en.", "label": False},
                 {"prompt": "what color?", "completion": " blue.", "label": True}],
    "chat": [PAIRS["chat"], PAIRS["chat-continued"]],
}


@pytest.mark.parametrize("name", KTO)
@pytest.mark.parametrize("batch_size", [2, 3])
def test_kto_tokenises_as_trl_kto(tok, tmp_path, name, batch_size):
    rows = KTO[name]
    examples, _ = load_pairs(_write(tmp_path / "k.jsonl", rows), tok, kind="unpaired", kl_chunk=batch_size,
                             objective="kto")
    got = [(e.tokens[:e.prompt_len], e.completion(), e.label, e.kl_completion) for e in examples]
    assert got == trl_kto(tok._tokenizer, rows, batch_size)
    # The KL pairs join one example's cut prompt to another's completion, merged token and all (TRL's collator).
    assert any(e.completion()[0] in tok._tokenizer.convert_tokens_to_ids([" red", " the", "? "]) for e in examples)


def test_grpo_prompts_tokenise_as_trl_grpo(tok):
    """GRPOTrainer._tokenize_prompts: a string with the special tokens, a conversation
    with the generation prompt (the completions are generated ids: no boundary to merge)."""
    enc, hf = Encoder(tok), tok._tokenizer
    assert enc.encode_prompt("q: what color? a: ") == hf(text=["q: what color? a: "])["input_ids"][0]
    assert enc.encode_prompt(USER) == hf.apply_chat_template([USER], add_generation_prompt=True, tokenize=True,
                                                             return_dict=True)["input_ids"][0]


# ---- TRL 1.16 itself (opt-in: skipped unless `trl` is importable) ------------------


def _trainer(cls, **attrs):
    """An instance of a TRL trainer class without its __init__ (no model), with
    the attributes its data preparation reads."""
    obj = object.__new__(cls)
    obj.__dict__.update(attrs)
    return obj


def _args(**kw):
    from types import SimpleNamespace

    return SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_end", **kw)


@pytest.mark.parametrize("name", PAIRS)
def test_pairs_against_trl_itself(tok, tmp_path, name):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl.data_utils import maybe_apply_chat_template, maybe_extract_prompt
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer
    from trl.trainer.dpo_trainer import DPOTrainer

    rec, hf = PAIRS[name], tok._tokenizer
    path = _write(tmp_path / "p.jsonl", [rec])
    row = DPOTrainer._prepare_dataset(_trainer(DPOTrainer, _tokenizer=hf), Dataset.from_list([rec]), hf, _args(),
                                      "train")[0]
    (pair,), _ = load_pairs(path, tok, objective="dpo")
    assert pair.chosen == row["prompt_ids"] + row["chosen_ids"]
    assert pair.rejected == row["prompt_ids"] + row["rejected_ids"]
    assert pair.chosen_prompt_len == pair.rejected_prompt_len == len(row["prompt_ids"])
    for cls, objective in ((CPOTrainer, "cpo"), (ORPOTrainer, "orpo")):
        trainer = _trainer(cls, processing_class=hf, is_encoder_decoder=False, max_length=10_000)
        row = trainer.tokenize_row(maybe_apply_chat_template(maybe_extract_prompt(dict(rec)), hf))
        (pair,), _ = load_pairs(path, tok, objective=objective)
        assert pair.chosen == row["chosen_input_ids"] and pair.rejected == row["rejected_input_ids"]
        assert pair.chosen_prompt_len == row["chosen_labels"].count(-100)
        assert pair.rejected_prompt_len == row["rejected_labels"].count(-100)


def test_cpo_refusals_against_trl_itself(tok):
    pytest.importorskip("trl")
    from trl.experimental.cpo import CPOTrainer

    trainer = _trainer(CPOTrainer, processing_class=tok._tokenizer, is_encoder_decoder=False, max_length=10_000)
    with pytest.raises(ValueError, match="only differ on the last token"):
        trainer.tokenize_row({"prompt": "q th", "chosen": "em.", "rejected": " no."})
    with pytest.raises(ValueError, match="should have the same length"):
        trainer.tokenize_row({"prompt": "x th th", "chosen": "e", "rejected": " no."})


@pytest.mark.parametrize("name", SFT)
def test_sft_against_trl_itself(tok, tmp_path, name):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl.trainer.sft_trainer import SFTTrainer

    rec, hf = SFT[name], tok._tokenizer
    trainer = _trainer(SFTTrainer, _tokenizer=hf, completion_only_loss=True, chat_template=None)
    args = _args(dataset_text_field="text", assistant_only_loss=False, shuffle_dataset=False)
    row = trainer._prepare_dataset(Dataset.from_list([rec]), hf, args, False, None, "train")[0]
    (pair,), _ = load_pairs(_write(tmp_path / "s.jsonl", [rec]), tok, kind="sft", objective="sft")
    assert pair.chosen == row["input_ids"]
    if "prompt" in rec:
        assert pair.chosen_prompt_len == row["labels"].count(-100)


@pytest.mark.parametrize("name", KTO)
@pytest.mark.parametrize("batch_size", [2, 3])
def test_kto_against_trl_itself(tok, tmp_path, name, batch_size):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl.trainer.kto_trainer import KTOTrainer

    rows = KTO[name]
    hf = tok._tokenizer
    trainer = _trainer(KTOTrainer, _tokenizer=hf, calculate_KL=True)
    data = trainer._prepare_dataset(Dataset.from_list(rows), hf, _args(per_device_train_batch_size=batch_size),
                                    "eval")
    examples, _ = load_pairs(_write(tmp_path / "k.jsonl", rows), tok, kind="unpaired", kl_chunk=batch_size,
                             objective="kto")
    assert [(e.tokens[:e.prompt_len], e.completion(), e.label, e.kl_completion) for e in examples] == [
        (r["prompt_ids"], r["completion_ids"], r["label"], r["KL_completion_ids"]) for r in data]


def test_grpo_prompts_against_trl_itself(tok):
    pytest.importorskip("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer

    hf = tok._tokenizer
    trainer = _trainer(GRPOTrainer, _is_vlm=False, environment_factories=None, processing_class=hf, tools=None,
                       chat_template=None, chat_template_kwargs={})
    enc = Encoder(tok)
    for prompts in (["q: what color? a: ", "x th"], [USER, USER + RED + USER]):
        ids, _, _ = trainer._tokenize_prompts(prompts)
        assert [enc.encode_prompt(p) for p in prompts] == [list(i) for i in ids]


def test_train_tokenises_by_its_objective(tok):
    """`flash-cce train`'s data step hands the objective to the encoder."""
    from flash_cce.train.preflight import encode

    cfg = dict(max_seq_length=64, truncation="keep_end", chat_template="auto", enable_thinking=None, batch_size=2)
    records = {"train": [(PAIRS["remerged"], "train.jsonl:1")]}
    hf = tok._tokenizer
    for objective in TRL_TRAINER:
        (pair,) = encode(dict(cfg, objective=objective), tok, records, lambda line: None)["train"]
        want = trl_cpo(hf, dict(PAIRS["remerged"]))[0] if TRL_TRAINER[objective] == "cpo" else None
        if want is None:
            prompt, chosen, _ = trl_dpo(hf, dict(PAIRS["remerged"]))
            want = (prompt + chosen, len(prompt))
        assert (pair.chosen, pair.chosen_prompt_len) == want


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_train_warns_of_merged_prompts_as_trl(tok, objective):
    """TRL warns where the prompt's tokens are no prefix of the joint ones; so does the data step, with a count."""
    from flash_cce.train.preflight import encode

    cfg = dict(max_seq_length=64, truncation="keep_end", chat_template="auto", enable_thinking=None, batch_size=2,
               objective=objective)
    recs = [PAIRS["remerged"], PAIRS["chat"], {"prompt": "x y", "chosen": " red.", "rejected": " 4."}]
    lines = []
    encode(cfg, tok, {"train": [(r, f"train.jsonl:{i}") for i, r in enumerate(recs, 1)]}, lines.append)
    assert [line for line in lines if "merges across the boundary" in line] == [
        "Warning: train.jsonl: in 2 of 3 records the prompt's tokens are no prefix of the prompt and response's (a "
        "token merges across the boundary, or the chat template renders the prompt alone differently); as TRL "
        "does, the response starts where they differ (docs/cli.md, Data format)"]
