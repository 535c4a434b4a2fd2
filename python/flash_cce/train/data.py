"""Training data in TRL's formats -> `Pair`s and `Example`s.

Paired: one JSON object per line with `prompt`, `chosen` and `rejected`, each a
string or a list of chat messages (`{"role": ..., "content": ...}`, the content
a string or a list of text parts `{"type": "text", "text": ...}`). Without
`prompt`, the prompt is what `chosen` and `rejected` begin with (TRL's
`extract_prompt`: their common leading messages, or for strings their common
leading characters, a space before the difference going with the responses).
Unpaired (KTO): `prompt`, `completion` and a boolean `label`, or paired records,
which are unpaired as TRL's KTOTrainer does. SFT: TRL's `messages`,
`prompt`/`completion` and `text` records (or pairs, whose `rejected` is unused).
Message lists go through the tokenizer's chat template; strings are tokenised as
plain text, with the tokenizer's special tokens on the prompt and EOS after each
response. Prompt and response are tokenised together, as the TRL 1.16 trainer of
the objective does (`Encoder`).
"""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..stack.batch import Example, Pair

TRUNCATION_MODES = ("keep_end", "keep_start", "drop", "error")


class DataError(ValueError):
    """A malformed record; the message starts with `file:line:`."""


def _check_messages(value, key, where):
    """Checks a message list and joins each content given as text parts into
    one string (what text-only chat templates render), in place."""
    if not value:
        raise DataError(f"{where}: '{key}' is empty")
    for i, m in enumerate(value):
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            m["content"] = _joined_parts(m["content"], f"{where}: '{key}'[{i}].content")
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise DataError(
                f"{where}: '{key}'[{i}] must be a message {{\"role\": str, \"content\": str or text parts}}, "
                f"got {json.dumps(m)[:80]}"
            )


def _joined_parts(parts, where):
    """The text of a content given as parts (`[{"type": "text", "text": ...}]`)."""
    texts = []
    for j, part in enumerate(parts):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise DataError(f"{where}[{j}]: a part of type {kind!r}; allowed: {{\"type\": \"text\", "
                            "\"text\": str}} (the models trained here read text only)")
        texts.append(part["text"])
    return "".join(texts)


def _check_texts(rec, keys, expected, where):
    """Each of `keys` present, a non-empty string (the prompt may be empty) or a
    message list, all of one form."""
    for key in keys:
        if key not in rec:
            raise DataError(f"{where}: missing key '{key}' (expected {expected})")
        value = rec[key]
        if isinstance(value, str):
            if key != "prompt" and not value.strip():
                raise DataError(f"{where}: '{key}' is an empty string")
        elif isinstance(value, list):
            _check_messages(value, key, where)
        else:
            raise DataError(
                f"{where}: '{key}' must be a string or a list of messages, got {type(value).__name__}"
            )
    kinds = {isinstance(rec[k], str) for k in keys}
    if len(kinds) > 1:
        raise DataError(f"{where}: mix of strings and message lists; use one form for {', '.join(keys)}")


def check_unpaired_record(rec, where):
    """Raises DataError unless `rec` is a TRL unpaired record; returns it."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "chosen" in rec or "rejected" in rec:
        return check_record(rec, where)  # unpaired when the split is read (`unpair`)
    _check_texts(rec, ("prompt", "completion"), "prompt, completion, label", where)
    if "label" not in rec:
        raise DataError(f"{where}: missing key 'label' (expected prompt, completion, label)")
    if not isinstance(rec["label"], bool):
        raise DataError(f"{where}: 'label' must be true or false, got {json.dumps(rec['label'])[:40]}")
    return rec


def check_record(rec, where):
    """Raises DataError unless `rec` is a TRL preference record; returns it."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    keys = ("prompt", "chosen", "rejected") if "prompt" in rec else ("chosen", "rejected")
    _check_texts(rec, keys, "prompt, chosen, rejected", where)
    if "prompt" not in rec:
        prompt, chosen, rejected = implicit_prompt(rec["chosen"], rec["rejected"])
        if not prompt or not (chosen.strip() if isinstance(chosen, str) else chosen) or not (
                rejected.strip() if isinstance(rejected, str) else rejected):
            what = "messages" if isinstance(rec["chosen"], list) else "text"
            raise DataError(f"{where}: without 'prompt', chosen and rejected must begin with the same {what} "
                            "(the prompt) and differ after it")
    return rec


def implicit_prompt(chosen, rejected):
    """(prompt, chosen, rejected) of a record without `prompt`, as TRL's
    `extract_prompt`: the common leading messages, or for strings the common
    leading characters less a space just before the first difference."""
    n = _common_prefix(chosen, rejected)
    if isinstance(chosen, str) and 0 < n < min(len(chosen), len(rejected)) and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def check_sft_record(rec, where):
    """Raises DataError unless `rec` is one of TRL's SFT records: `messages` (a
    conversation), `prompt` and `completion`, `text`, or a preference pair (its
    `rejected` unused); returns it as {"text"} or {"prompt", "completion"}, the
    prompt of `messages` being the turns before its last (what `nll_on_prompt:
    false` leaves out, as mlx_lm's `mask_prompt`)."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "chosen" in rec:
        check_record(dict(rec, rejected=rec.get("rejected", rec["chosen"])), where)
        prompt, chosen = (rec["prompt"], rec["chosen"]) if "prompt" in rec else implicit_prompt(
            rec["chosen"], rec.get("rejected", rec["chosen"]))[:2]
        return {"prompt": prompt, "completion": chosen}
    if "messages" in rec:
        _check_texts(rec, ("messages",), "messages", where)
        msgs = rec["messages"]
        if isinstance(msgs, str) or len(msgs) < 2 or msgs[-1]["role"] != "assistant":
            raise DataError(f"{where}: 'messages' must be a conversation ending with an assistant turn "
                            "after at least one other")
        return {"prompt": msgs[:-1], "completion": msgs[-1:]}
    if "text" in rec and "prompt" not in rec:
        if not isinstance(rec["text"], str) or not rec["text"].strip():
            raise DataError(f"{where}: 'text' must be a non-empty string")
        return {"text": rec["text"]}
    _check_texts(rec, ("prompt", "completion"), "messages, prompt and completion, text, or prompt and chosen",
                 where)
    return {"prompt": rec["prompt"], "completion": rec["completion"]}


def _common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def read_jsonl(path, check=check_record):
    """The records of a JSONL file (UTF-8, a leading BOM allowed), each passed
    through `check(record, where)`; DataError names the file and line of a bad one."""
    path = Path(path)
    records = []
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    for lineno, line in enumerate(raw.split(b"\n"), 1):
        where = f"{path}:{lineno}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not UTF-8 text (byte {e.start + 1} of the line is 0x{line[e.start]:02x})") from None
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise DataError(f"{where}: invalid JSON (nested too deeply)") from None
        records.append((check(rec, where), where))
    return records


# The TRL 1.16 trainer whose tokenisation each objective reproduces (TRL's SimPO
# is a CPO loss type; ORPO tokenises as CPO does): "cpo" for these, "dpo" (the
# DPO, KTO and SFT trainers') for the others.
TOKENISATION = {"orpo": "cpo", "orpo_margin": "cpo", "simpo": "cpo", "cpo": "cpo"}
TOKENISATIONS = ("dpo", "cpo")


def tokenisation(objective):
    """The TRL trainer ("dpo" or "cpo") whose tokenisation `objective` reproduces."""
    return TOKENISATION.get(objective, "dpo")


class Encoder:
    """Tokenises records into Pairs as TRL 1.16's trainers tokenise them.

    `tokenisation` "dpo" (DPOTrainer, KTOTrainer, SFTTrainer): the prompt alone
    and the prompt followed by each response (a string response with EOS text
    appended) are tokenised; each sequence is the latter, and the prompt is their
    common leading tokens (for a pair, the fewer of the two sides'). Where a token
    merges across the boundary the prompt ends before it and the merged token
    belongs to the response. "cpo" (CPOTrainer, ORPOTrainer): conversations are
    rendered to text first; the prompt and the prompt followed by each response
    are tokenised without special tokens, the response starts where the prompt's
    tokens end, one token earlier where the prompt's tokens are not a prefix of
    the joint ones; then BOS goes before each prompt and EOS after each response
    (as ids, where missing).

    `chat_template`: "auto" uses the template for message records only, True also
    wraps string records as a user turn and an assistant turn, False never uses
    it (messages are then an error). `enable_thinking` is passed to the template
    when not None (Qwen3-style templates).
    """

    def __init__(self, tokenizer, chat_template="auto", enable_thinking=None, tokenisation="dpo"):
        if chat_template not in ("auto", True, False):
            raise ValueError(f"chat_template must be 'auto', true or false, got {chat_template!r}")
        if tokenisation not in TOKENISATIONS:
            raise ValueError(f"tokenisation must be one of {TOKENISATIONS}, got {tokenisation!r}")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.tokenisation = tokenisation
        # Records whose prompt's own tokens are no prefix of the joint ones (TRL warns of them).
        self.merged = 0
        self.template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}

    def _template(self, messages, prompt, tokenize=True, **kwargs):
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=prompt, tokenize=tokenize, return_dict=False,
            **kwargs, **self.template_kwargs,
        )
        return list(out) if tokenize else out

    def _with_eos(self, text):
        eos = self.tokenizer.eos_token
        return text if eos is None or text.endswith(eos) else text + eos

    def _forms(self, prompt, responses, where):
        """(prompt, responses, messages): string records as turns under chat_template true."""
        messages = isinstance(responses[0], list)
        if messages and self.chat_template is False:
            raise DataError(f"{where}: chat messages need chat_template 'auto' or true")
        if not messages and self.chat_template is True:
            prompt = [{"role": "user", "content": prompt}]
            responses = [[{"role": "assistant", "content": r}] for r in responses]
            messages = True
        return prompt, responses, messages

    def encode_responses(self, prompt, responses, where="record"):
        """[(tokens, prompt_len)] of `prompt` followed by each of `responses`
        (strings or message lists), as the trainer of `tokenisation` makes them."""
        prompt, responses, messages = self._forms(prompt, responses, where)
        if self.tokenisation == "cpo":
            if messages:
                prompt, responses = self._rendered(prompt, responses, where)
            return self._cpo(prompt, responses, where)
        if messages:
            p = self._template(prompt, True)
            fulls = [self._template(prompt + r, False) for r in responses]
        else:
            p = list(self.tokenizer.encode(prompt))
            fulls = [list(self.tokenizer.encode(prompt + self._with_eos(r))) for r in responses]
        n = min(_common_prefix(p, f) for f in fulls)
        self.merged += n < len(p)
        if p and n == 0:
            raise DataError(f"{where}: the prompt's tokens share no leading token with the prompt followed by "
                            "its response (check the chat template or the tokenizer's special tokens)")
        return [(f, n) for f in fulls]

    def _rendered(self, prompt, responses, where):
        """TRL's `apply_chat_template` of a record for CPO and ORPO: the prompt's
        text (with the generation prompt, or continuing a final assistant turn) cut
        to what it shares with every prompt-and-response text, and each response's
        text after it."""
        role = prompt[-1]["role"] if prompt else None
        if role not in ("user", "tool", "assistant"):
            raise DataError(f"{where}: the prompt's last message has role {role!r}; cpo, orpo and simpo read a "
                            "prompt ending with a user, tool or assistant turn (as TRL's CPO and ORPO trainers)")
        last = role == "assistant"
        text = self._template(prompt, not last, tokenize=False, continue_final_message=last)
        fulls = [self._template(prompt + r, False, tokenize=False) for r in responses]
        for f in fulls:
            text = text[:_common_prefix(text, f)]
        return text, [f[len(text):] for f in fulls]

    def _cpo(self, prompt, responses, where):
        """TRL's CPO/ORPO `build_tokenized_answer` and `tokenize_row` of string texts."""
        tok = self.tokenizer
        p = list(tok.encode(prompt, add_special_tokens=False))
        parts = []
        for r in responses:
            full = list(tok.encode(prompt + r, add_special_tokens=False))
            if len(full) < len(p):
                raise DataError(f"{where}: the prompt followed by its response has fewer tokens than the prompt "
                                "alone (TRL's CPO and ORPO trainers refuse such a record)")
            start = len(p) - (full[:len(p)] != p)  # the merged last prompt token goes with the response
            parts.append((full[:start], full[start:]))
        if len(parts) == 2:
            (a, _), (b, _) = parts
            if sum(x != y for x, y in zip(a, b)) > 1 or abs(len(a) - len(b)) > 1:
                raise DataError(f"{where}: the prompt tokenises differently before chosen and before rejected in "
                                "more than its last token (TRL's CPO and ORPO trainers refuse such a pair)")
        self.merged += any(len(a) < len(p) for a, _ in parts)
        bos, eos = tok.bos_token_id, tok.eos_token_id
        out = []
        for prompt_ids, answer in parts:
            if bos is not None and prompt_ids[:1] != [bos]:
                prompt_ids = [bos] + prompt_ids
            if eos is not None and answer[-1:] != [eos]:
                answer = answer + [eos]
            out.append((prompt_ids + answer, len(prompt_ids)))
        return out

    def encode_one(self, prompt, response, where="record"):
        """(tokens, prompt_len) of a prompt and one response (strings or messages)."""
        return self.encode_responses(prompt, [response], where)[0]

    def encode_prompt(self, prompt, where="record"):
        """The token ids of a prompt alone, as TRL's GRPOTrainer tokenises it for
        generation: a string with the tokenizer's special tokens, a conversation
        through the chat template with the generation prompt."""
        if isinstance(prompt, list) and self.chat_template is False:
            raise DataError(f"{where}: chat messages need chat_template 'auto' or true")
        if isinstance(prompt, str) and self.chat_template is True:
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, list):
            return self._template(prompt, True)
        return list(self.tokenizer.encode(prompt))

    def encode_text(self, text, where="record"):
        """(tokens, 0) of a `text` record: the text with EOS text appended, with
        the tokenizer's special tokens (TRL's language-modelling records)."""
        if self.chat_template is True:
            raise DataError(f"{where}: a 'text' record has no turns for chat_template true; use auto or false")
        return list(self.tokenizer.encode(self._with_eos(text))), 0

    def encode_sft(self, rec, where="record"):
        """The Pair of an SFT record (`check_sft_record`'s form): the sequence on
        both sides, as the sft objective reads only the chosen one."""
        if "text" in rec:
            tokens, n = self.encode_text(rec["text"], where)
        else:
            tokens, n = self.encode_one(rec["prompt"], rec["completion"], where)
        pair = Pair(tokens, tokens, n, n)
        return _valid(pair, where)

    def encode_example(self, rec, where="record"):
        """The Example of an unpaired record."""
        tokens, n = self.encode_one(rec["prompt"], rec["completion"], where)
        return _valid(Example(tokens, n, rec["label"]), where)

    def encode(self, rec, where="record"):
        if "prompt" not in rec:
            rec = dict(zip(("prompt", "chosen", "rejected"), implicit_prompt(rec["chosen"], rec["rejected"])))
        (chosen, cp), (rejected, rp) = self.encode_responses(rec["prompt"], [rec["chosen"], rec["rejected"]], where)
        return _valid(Pair(chosen, rejected, cp, rp), where)


def _valid(item, where):
    """`item` (a Pair or an Example) once its `validate` passes; DataError otherwise."""
    try:
        item.validate(where)
    except ValueError as e:
        raise DataError(str(e)) from None
    return item


def truncate(pair, max_len, mode):
    """`pair` fitted to `max_len` tokens per sequence, or None to drop it.

    keep_end: drop leading prompt tokens (the same number from both prompts),
    then trailing response tokens if still too long; keep_start: drop trailing
    response tokens; drop: skip the pair; error: raise.
    """
    over = max(len(pair.chosen), len(pair.rejected)) - max_len
    if over <= 0:
        return pair
    if mode == "error":
        raise ValueError(f"a pair has {max_len + over} tokens, more than max_seq_length={max_len}")
    if mode == "drop":
        return None
    chosen, rejected = pair.chosen, pair.rejected
    cp, rp = pair.chosen_prompt_len, pair.rejected_prompt_len
    if mode == "keep_end":
        cut = min(over, cp, rp)
        chosen, rejected, cp, rp = chosen[cut:], rejected[cut:], cp - cut, rp - cut
    chosen, rejected = chosen[:max_len], rejected[:max_len]
    if len(chosen) <= cp or len(rejected) <= rp or (cp == 0 and min(len(chosen), len(rejected)) < 2):
        return None  # nothing of a response would be left to score
    return Pair(chosen, rejected, cp, rp)


def _fit_example(example, max_len, mode):
    """`truncate` for an unpaired example (its one sequence on both sides)."""
    if len(example.tokens) <= max_len:
        return example
    fitted = truncate(example.as_pair(), max_len, mode)
    return None if fitted is None else Example(fitted.chosen, fitted.chosen_prompt_len, example.label)


def encode_records(records, tokenizer, max_seq_length=2048, truncation="keep_end",
                   chat_template="auto", enable_thinking=None, unpaired=False, kind=None, kl_chunk=None,
                   objective=None):
    """(pairs, report) from `read_jsonl`'s records, or with `unpaired` (or `kind`
    "unpaired") (examples, report) from unpaired ones (prompt, completion, label);
    `kind` "sft" reads `check_sft_record`'s records. The token ids are those the
    TRL trainer of `objective` makes of the records (`Encoder`; None: DPO's).

    `report` counts the records read, truncated and dropped by `truncation`
    (one of TRUNCATION_MODES) at `max_seq_length` tokens per sequence, those
    whose whole prompt truncation cut (`prompt_cut`) and those whose prompt's
    tokens are no prefix of the prompt and response's (`merged`).
    `kl_chunk`: KTO's KL completions rotate within chunks of this many examples
    (see `with_kl_completions`).
    """
    kind = kind or ("unpaired" if unpaired else "pairs")
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
    if max_seq_length is None or max_seq_length < 2:
        raise ValueError(f"max_seq_length must be an int >= 2, got {max_seq_length!r}")
    enc = Encoder(tokenizer, chat_template, enable_thinking, tokenisation(objective))
    encode = {"unpaired": enc.encode_example, "sft": enc.encode_sft, "pairs": enc.encode}[kind]
    fit = _fit_example if kind == "unpaired" else truncate
    pairs, truncated, dropped, prompt_cut = [], 0, 0, 0
    for rec, where in records:
        pair = encode(rec, where)
        try:
            fitted = fit(pair, max_seq_length, truncation)
        except ValueError as e:
            raise DataError(f"{where}: {e}") from None
        if fitted is None:
            dropped += 1
        else:
            truncated += fitted is not pair
            prompt_cut += _prompt_len(fitted) == 0 < _prompt_len(pair)
            pairs.append(fitted)
    if kind == "unpaired":
        pairs = with_kl_completions(pairs, kl_chunk)
    return pairs, dict(records=len(records), truncated=truncated, dropped=dropped, prompt_cut=prompt_cut,
                       merged=enc.merged)


def _prompt_len(item):
    return item.prompt_len if isinstance(item, Example) else min(item.chosen_prompt_len, item.rejected_prompt_len)


def mismatched(examples):
    """KTO's mismatched pairs: each example's prompt with another example's
    completion, its `kl_completion` where loading fixed one (`with_kl_completions`),
    else the previous example's in `examples` (TRL's rotation)."""
    if all(e.kl_completion is not None for e in examples):
        return [e.as_pair(e.kl_completion) for e in examples]
    return [e.as_pair(examples[i - 1].completion()) for i, e in enumerate(examples)]


def with_kl_completions(examples, chunk=None):
    """`examples`, each with a fixed KL completion (see `kto`) as TRL's KTOTrainer
    prepares its data: within each run of `chunk` consecutive examples (its
    per-device batch size; None: all), the completion of the one before it, the
    first taking the last's. The mismatched pairs, and so their reference
    log-probs, are known before training."""
    chunk = chunk or len(examples) or 1
    out = []
    for start in range(0, len(examples), chunk):
        block = examples[start:start + chunk]
        out += [replace(e, kl_completion=block[i - 1].completion()) for i, e in enumerate(block)]
    return out


# TRL unpairs a preference dataset with `datasets`' batched map, whose default
# batch holds 1000 rows: each block's chosen examples, then its rejected ones.
UNPAIR_BLOCK = 1000


def unpair(records):
    """KTO's examples from paired records (`read_jsonl`'s (record, where)), as
    TRL's `unpair_preference_dataset` orders them: per block of UNPAIR_BLOCK
    records, every chosen response as a desirable example, then every rejected
    one as an undesirable example. Unpaired records pass through; a split mixing
    the two forms is an error at the first record of the other form."""
    if not records:
        return records
    paired = "chosen" in records[0][0]
    for rec, where in records:
        if ("chosen" in rec) != paired:
            raise DataError(f"{where}: a {'unpaired' if paired else 'paired'} record in a split of "
                            f"{'paired' if paired else 'unpaired'} ones; use one form per file")
    if not paired:
        return records
    out = []
    for start in range(0, len(records), UNPAIR_BLOCK):
        block = records[start:start + UNPAIR_BLOCK]
        split = [(dict(zip(("prompt", "chosen", "rejected"), implicit_prompt(r["chosen"], r["rejected"])))
                  if "prompt" not in r else r, where) for r, where in block]
        for side, label in (("chosen", True), ("rejected", False)):
            out += [({"prompt": r["prompt"], "completion": r[side], "label": label}, where) for r, where in split]
    return out


def data_kind(objective):
    """The records an objective reads: "unpaired" (kto), "sft" or "pairs"."""
    return {"kto": "unpaired", "sft": "sft"}.get(objective, "pairs")


def read_records(path, kind="pairs"):
    """`read_jsonl` with the check of `kind`'s records (paired KTO data unpaired)."""
    check = {"unpaired": check_unpaired_record, "sft": check_sft_record, "pairs": check_record}[kind]
    records = read_jsonl(path, check)
    return unpair(records) if kind == "unpaired" else records


def load_pairs(path, tokenizer, unpaired=False, kind=None, **kwargs):
    """(pairs, report) from a TRL preference JSONL file, or with `unpaired`
    (examples, report) from a TRL unpaired one (see `encode_records`)."""
    kind = kind or ("unpaired" if unpaired else "pairs")
    return encode_records(read_records(path, kind), tokenizer, kind=kind, **kwargs)


def read_splits(data_dir, splits=("train", "valid", "test"), unpaired=False, kind=None):
    """{split: records} for each `split`.jsonl present in `data_dir`."""
    kind = kind or ("unpaired" if unpaired else "pairs")
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        what = "is a file" if data_dir.exists() else "does not exist"
        raise DataError(f"data: {str(data_dir)!r} {what}; give a directory with train.jsonl and valid.jsonl")
    return {s: read_records(data_dir / f"{s}.jsonl", kind)
            for s in splits if (data_dir / f"{s}.jsonl").is_file()}


def load_splits(data_dir, tokenizer, splits=("train", "valid", "test"), unpaired=False, kind=None, **kwargs):
    """{split: (pairs, report)} for each `split`.jsonl present in `data_dir`."""
    kind = kind or ("unpaired" if unpaired else "pairs")
    return {s: encode_records(recs, tokenizer, kind=kind, **kwargs)
            for s, recs in read_splits(data_dir, splits, kind=kind).items()}


def _unpaired(items):
    return bool(items) and isinstance(items[0], Example)


def _single(items):
    """SFT's items: one sequence on both sides of each pair (`Encoder.encode_sft`)."""
    return bool(items) and all(p.chosen == p.rejected and p.chosen_prompt_len == p.rejected_prompt_len
                               for p in items)


def length_summary(pairs):
    """Token-length statistics (min, mean, p50, p95, max) of prompts, responses and
    pairs (of prompts, completions and sequences for unpaired examples)."""
    if _unpaired(pairs):
        cols = {
            "prompt": [e.prompt_len for e in pairs],
            "complete": [len(e.tokens) - e.prompt_len for e in pairs],
            "sequence": [len(e.tokens) for e in pairs],
        }
    elif _single(pairs):
        cols = {
            "prompt": [p.chosen_prompt_len for p in pairs],
            "response": [len(p.chosen) - p.chosen_prompt_len for p in pairs],
            "sequence": [len(p.chosen) for p in pairs],
        }
    else:
        cols = {
            "prompt": [p.chosen_prompt_len for p in pairs],
            "chosen": [len(p.chosen) - p.chosen_prompt_len for p in pairs],
            "rejected": [len(p.rejected) - p.rejected_prompt_len for p in pairs],
            "pair": [len(p.chosen) + len(p.rejected) for p in pairs],
        }
    out = {}
    for name, v in cols.items():
        a = np.array(v or [0])
        out[name] = dict(min=int(a.min()), mean=float(a.mean()), p50=float(np.percentile(a, 50)),
                         p95=float(np.percentile(a, 95)), max=int(a.max()))
    return out


def format_summary(name, pairs, report):
    what = (f"examples ({sum(e.label for e in pairs)} desirable)" if _unpaired(pairs)
            else "sequences" if _single(pairs) else "pairs")
    lines = [f"{name}: {len(pairs)} {what} ({report['records']} records, "
             f"{report['truncated']} truncated, {report['dropped']} dropped)"]
    for col, s in length_summary(pairs).items():
        lines.append(f"  {col:<8} tokens min {s['min']:>5}  mean {s['mean']:>7.1f}  "
                     f"p50 {s['p50']:>6.0f}  p95 {s['p95']:>6.0f}  max {s['max']:>5}")
    return "\n".join(lines)
