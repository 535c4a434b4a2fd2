"""Preference data in TRL's formats -> `Pair`s and `Example`s.

Paired: one JSON object per line with `prompt`, `chosen` and `rejected`, each a
string or a list of chat messages (`{"role": ..., "content": ...}`). Without
`prompt`, `chosen` and `rejected` are whole conversations and their common
leading messages are the prompt (TRL's implicit prompt). Unpaired (KTO): one
object per line with `prompt`, `completion` and a boolean `label`. Message lists
go through the tokenizer's chat template; strings are tokenised as plain text,
with the tokenizer's special tokens on the prompt and EOS after each response.
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
    if not value:
        raise DataError(f"{where}: '{key}' is empty")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise DataError(
                f"{where}: '{key}'[{i}] must be a message {{\"role\": str, \"content\": str}}, "
                f"got {json.dumps(m)[:80]}"
            )


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
        raise DataError(f"{where}: a paired record (chosen/rejected); kto reads prompt, completion, label")
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
        if isinstance(rec["chosen"], str):
            raise DataError(f"{where}: missing key 'prompt' (needed when chosen/rejected are strings)")
        n = _common_prefix(rec["chosen"], rec["rejected"])
        if n == 0 or n == len(rec["chosen"]) or n == len(rec["rejected"]):
            raise DataError(f"{where}: without 'prompt', chosen and rejected must share leading messages and differ after them")
    return rec


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


class Encoder:
    """Tokenises records into Pairs.

    `chat_template`: "auto" uses the template for message records only, True also
    wraps string records as a user turn and an assistant turn, False never uses
    it (messages are then an error). `enable_thinking` is passed to the template
    when not None (Qwen3-style templates).
    """

    def __init__(self, tokenizer, chat_template="auto", enable_thinking=None):
        if chat_template not in ("auto", True, False):
            raise ValueError(f"chat_template must be 'auto', true or false, got {chat_template!r}")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}

    def _template(self, messages, prompt):
        return list(self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=prompt, tokenize=True, return_dict=False,
            **self.template_kwargs,
        ))

    def _text(self, prompt, response):
        tok = self.tokenizer
        p = list(tok.encode(prompt)) if prompt else []
        r = list(tok.encode(response, add_special_tokens=False))
        if tok.eos_token_id is not None and (not r or r[-1] != tok.eos_token_id):
            r.append(tok.eos_token_id)
        return p + r, len(p)

    def _chat(self, prompt, response, where):
        p = self._template(prompt, True)
        full = self._template(prompt + response, False)
        if full[: len(p)] != p:
            # The template renders the prompt differently once a reply follows
            # (some templates do); the prompt is then the common prefix.
            n = _common_prefix(p, full)
            if n == 0:
                raise DataError(f"{where}: the chat template shares no prefix between prompt and conversation")
            return full, n
        return full, len(p)

    def encode_one(self, prompt, response, where="record"):
        """(tokens, prompt_len) of a prompt and one response (strings or messages)."""
        messages = isinstance(response, list)
        if messages and self.chat_template is False:
            raise DataError(f"{where}: chat messages need chat_template 'auto' or true")
        if not messages and self.chat_template is True:
            prompt = [{"role": "user", "content": prompt}]
            response = [{"role": "assistant", "content": response}]
            messages = True
        if messages:
            return self._chat(prompt, response, where)
        return self._text(prompt, response)

    def encode_prompt(self, prompt, where="record"):
        """The token ids of a prompt alone, as `encode_one` begins a sequence
        (a conversation with the chat template's generation prompt)."""
        if isinstance(prompt, list) and self.chat_template is False:
            raise DataError(f"{where}: chat messages need chat_template 'auto' or true")
        if isinstance(prompt, str) and self.chat_template is True:
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, list):
            return self._template(prompt, True)
        return list(self.tokenizer.encode(prompt)) if prompt else []

    def encode_example(self, rec, where="record"):
        """The Example of an unpaired record."""
        tokens, n = self.encode_one(rec["prompt"], rec["completion"], where)
        example = Example(tokens, n, rec["label"])
        try:
            example.validate(where)
        except ValueError as e:
            raise DataError(str(e)) from None
        return example

    def encode(self, rec, where="record"):
        if "prompt" not in rec:
            n = _common_prefix(rec["chosen"], rec["rejected"])
            rec = dict(prompt=rec["chosen"][:n], chosen=rec["chosen"][n:], rejected=rec["rejected"][n:])
        chosen, cp = self.encode_one(rec["prompt"], rec["chosen"], where)
        rejected, rp = self.encode_one(rec["prompt"], rec["rejected"], where)
        pair = Pair(chosen, rejected, cp, rp)
        try:
            pair.validate(where)
        except ValueError as e:
            raise DataError(str(e)) from None
        return pair


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
                   chat_template="auto", enable_thinking=None, unpaired=False):
    """(pairs, report) from `read_jsonl`'s records, or with `unpaired`
    (examples, report) from unpaired ones (prompt, completion, label).

    `report` counts the records read, truncated and dropped by `truncation`
    (one of TRUNCATION_MODES) at `max_seq_length` tokens per sequence.
    """
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
    if max_seq_length is None or max_seq_length < 2:
        raise ValueError(f"max_seq_length must be an int >= 2, got {max_seq_length!r}")
    enc = Encoder(tokenizer, chat_template, enable_thinking)
    pairs, truncated, dropped, prompt_cut = [], 0, 0, 0
    for rec, where in records:
        pair = enc.encode_example(rec, where) if unpaired else enc.encode(rec, where)
        try:
            fit = _fit_example if unpaired else truncate
            fitted = fit(pair, max_seq_length, truncation)
        except ValueError as e:
            raise DataError(f"{where}: {e}") from None
        if fitted is None:
            dropped += 1
        else:
            truncated += fitted is not pair
            prompt_cut += _prompt_len(fitted) == 0 < _prompt_len(pair)
            pairs.append(fitted)
    if unpaired:
        pairs = with_kl_completions(pairs)
    return pairs, dict(records=len(records), truncated=truncated, dropped=dropped, prompt_cut=prompt_cut)


def _prompt_len(item):
    return item.prompt_len if isinstance(item, Example) else min(item.chosen_prompt_len, item.rejected_prompt_len)


def mismatched(examples):
    """KTO's mismatched pairs: each example's prompt with another example's
    completion, its `kl_completion` where loading fixed one (`with_kl_completions`),
    else the previous example's in `examples` (TRL's rotation)."""
    if all(e.kl_completion is not None for e in examples):
        return [e.as_pair(e.kl_completion) for e in examples]
    return [e.as_pair(examples[i - 1].completion()) for i, e in enumerate(examples)]


def with_kl_completions(examples):
    """`examples`, each with the completion of the one before it (the last one's
    for the first) as its fixed KL completion (see `kto`), as TRL pairs them when
    it prepares its data: the mismatched pairs, and so their reference
    log-probs, are known before training."""
    return [replace(e, kl_completion=examples[i - 1].completion()) for i, e in enumerate(examples)]


def load_pairs(path, tokenizer, unpaired=False, **kwargs):
    """(pairs, report) from a TRL preference JSONL file, or with `unpaired`
    (examples, report) from a TRL unpaired one (see `encode_records`)."""
    return encode_records(read_jsonl(path, _checker(unpaired)), tokenizer, unpaired=unpaired, **kwargs)


def _checker(unpaired):
    return check_unpaired_record if unpaired else check_record


def read_splits(data_dir, splits=("train", "valid", "test"), unpaired=False):
    """{split: records} for each `split`.jsonl present in `data_dir`."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        what = "is a file" if data_dir.exists() else "does not exist"
        raise DataError(f"data: {str(data_dir)!r} {what}; give a directory with train.jsonl and valid.jsonl")
    return {s: read_jsonl(data_dir / f"{s}.jsonl", _checker(unpaired))
            for s in splits if (data_dir / f"{s}.jsonl").is_file()}


def load_splits(data_dir, tokenizer, splits=("train", "valid", "test"), unpaired=False, **kwargs):
    """{split: (pairs, report)} for each `split`.jsonl present in `data_dir`."""
    return {s: encode_records(recs, tokenizer, unpaired=unpaired, **kwargs)
            for s, recs in read_splits(data_dir, splits, unpaired).items()}


def _unpaired(items):
    return bool(items) and isinstance(items[0], Example)


def length_summary(pairs):
    """Token-length statistics (min, mean, p50, p95, max) of prompts, responses and
    pairs (of prompts, completions and sequences for unpaired examples)."""
    if _unpaired(pairs):
        cols = {
            "prompt": [e.prompt_len for e in pairs],
            "complete": [len(e.tokens) - e.prompt_len for e in pairs],
            "sequence": [len(e.tokens) for e in pairs],
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
            else "pairs")
    lines = [f"{name}: {len(pairs)} {what} ({report['records']} records, "
             f"{report['truncated']} truncated, {report['dropped']} dropped)"]
    for col, s in length_summary(pairs).items():
        lines.append(f"  {col:<8} tokens min {s['min']:>5}  mean {s['mean']:>7.1f}  "
                     f"p50 {s['p50']:>6.0f}  p95 {s['p95']:>6.0f}  max {s['max']:>5}")
    return "\n".join(lines)
