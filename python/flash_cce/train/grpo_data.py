"""GRPO's prompt data: JSON Lines records with TRL's `prompt` (a string or a
conversation) and any extra columns, which reach the reward functions as keyword
arguments. Prompts are tokenised as `flash-cce train` tokenises a prompt before
its response (`data.Encoder`): strings as plain text with the tokenizer's
special tokens, conversations through the chat template with the generation prompt.
"""

from dataclasses import dataclass
from pathlib import Path

from .data import DataError, Encoder, _check_messages, read_jsonl

# Names the reward functions' own arguments take (TRL's); a column may not reuse them.
RESERVED = ("prompts", "completions", "completion_ids", "trainer_state")


def check_prompt_record(rec, where):
    """Raises DataError unless `rec` holds TRL's `prompt`; returns it."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "prompt" not in rec:
        raise DataError(f"{where}: missing key 'prompt' (grpo reads prompt and any extra columns)")
    p = rec["prompt"]
    if isinstance(p, list):
        _check_messages(p, "prompt", where)
    elif not isinstance(p, str) or not p.strip():
        raise DataError(f"{where}: 'prompt' must be a non-empty string or a list of messages")
    for k in RESERVED:
        if k in rec:
            raise DataError(f"{where}: column {k!r} clashes with a reward function argument; rename it")
    return rec


@dataclass
class Prompts:
    """A split's records, where each came from, and its prompts' token ids."""

    records: list
    where: list
    ids: list

    def __len__(self):
        return len(self.records)

    def columns(self, idx):
        """{column: [value of each record of idx]} of every column but prompt and completion (None where absent)."""
        keys = dict.fromkeys(k for i in idx for k in self.records[i] if k not in ("prompt", "completion"))
        return {k: [self.records[i].get(k) for i in idx] for k in keys}


def read_prompt_splits(data_dir, splits):
    """{split: [(record, where)]} for each `split`.jsonl in `data_dir`."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        what = "is a file" if data_dir.exists() else "does not exist"
        raise DataError(f"data: {str(data_dir)!r} {what}; give a directory with train.jsonl (and valid.jsonl)")
    return {s: read_jsonl(data_dir / f"{s}.jsonl", check_prompt_record)
            for s in splits if (data_dir / f"{s}.jsonl").is_file()}


def encode_prompts(records, tokenizer, max_prompt_length, truncation="keep_end", chat_template="auto",
                   enable_thinking=None):
    """(Prompts, report): each record's prompt ids, at most `max_prompt_length`
    tokens (keep_end: its end kept; keep_start: its start; drop; error)."""
    enc = Encoder(tokenizer, chat_template, enable_thinking)
    kept, where, ids = [], [], []
    truncated = dropped = 0
    for rec, w in records:
        p = enc.encode_prompt(rec["prompt"], w)
        if len(p) > max_prompt_length:
            if truncation == "error":
                raise DataError(f"{w}: the prompt has {len(p)} tokens, more than max_seq_length - "
                                f"max_completion_length = {max_prompt_length}")
            if truncation == "drop":
                dropped += 1
                continue
            p = p[-max_prompt_length:] if truncation == "keep_end" else p[:max_prompt_length]
            truncated += 1
        kept.append(rec)
        where.append(w)
        ids.append(p)
    return Prompts(kept, where, ids), dict(records=len(records), truncated=truncated, dropped=dropped)


def format_prompt_summary(name, prompts, report):
    lengths = sorted(len(p) for p in prompts.ids) or [0]
    return (f"{name}: {len(prompts)} prompts ({report['records']} records, {report['truncated']} truncated, "
            f"{report['dropped']} dropped); prompt tokens min {lengths[0]}, max {lengths[-1]}")
