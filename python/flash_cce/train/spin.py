"""Self-play preference pairs (SPIN): single-answer data -> TRL preference pairs
whose rejected answer is the model's own generation.

Input records (JSONL): `prompt` and `completion` (strings, or message lists as
TRL's prompt-completion format), or `messages` (a conversation whose last turn,
the assistant's, is the completion). Each output line is
`{"prompt", "chosen": completion, "rejected": generation}` in the input's form,
ready for `flash-cce train`. Prompts are tokenised as `flash-cce train` will
tokenise them (`data.Encoder`), generated in batches by mlx-lm's
`batch_generate`, and written a batch at a time. A progress file beside the
output (`OUT.progress`) records how many records are done, so an interrupted
run continues where it stopped and gives the same file: each batch samples from
its own seed. It also records what shapes the generations (the data's hash,
the sampling settings, the model and the adapters): a command with others is
refused, or with `restart` makes the output anew. `OUT.lock` keeps a second
command out while one writes.
"""

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .data import DataError, Encoder, _check_texts, read_jsonl
from .report import use_bar
from .storage import writing


@dataclass
class SpinSettings:
    max_tokens: int = 256  # longest generation
    temp: float = 0.7
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    batch_size: int = 8
    seed: int = 0
    chat_template: object = "auto"

    def validate(self):
        for name in ("max_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temp < 0:
            raise ValueError(f"temp must be >= 0, got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


def check_sft_record(rec, where):
    """Raises DataError unless `rec` is a prompt-completion or messages record;
    returns it as {"prompt", "completion"}."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "messages" in rec and "prompt" not in rec:
        msgs = rec["messages"]
        _check_texts(rec, ("messages",), "messages, or prompt and completion", where)
        if isinstance(msgs, str) or len(msgs) < 2 or msgs[-1]["role"] != "assistant":
            raise DataError(f"{where}: 'messages' must be a conversation ending with an assistant turn "
                            "(the completion) after at least one other")
        return {"prompt": msgs[:-1], "completion": msgs[-1:]}
    _check_texts(rec, ("prompt", "completion"), "prompt and completion, or messages", where)
    return {"prompt": rec["prompt"], "completion": rec["completion"]}


def _sampler(s):
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(temp=s.temp, top_p=s.top_p if s.top_p < 1 else 0.0, min_p=s.min_p, top_k=s.top_k)


def _file_hash(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def progress_key(data, settings, model=None, adapter_path=None):
    """What shapes the generations written to an output: the data, the sampling
    settings, the model and the adapters (path and content)."""
    key = {"data": _file_hash(data), **dataclasses.asdict(settings), "model": model and str(model),
           "adapter_path": None, "adapters": None}
    if adapter_path is not None:
        weights = Path(adapter_path) / "adapters.safetensors"
        key["adapter_path"] = str(Path(adapter_path).resolve())
        key["adapters"] = _file_hash(weights) if weights.is_file() else None
    return key


def _show(v):
    return v[:12] if isinstance(v, str) and len(v) == 64 else json.dumps(v)


def check_progress(out, key, restart=False):
    """ValueError when `out` was made with another `key` (unless `restart`)."""
    out = Path(out)
    progress = out.with_name(out.name + ".progress")
    if restart or not out.exists() or not progress.exists():
        return
    try:
        state = json.loads(progress.read_text())
        saved = state.get("key") or {"data": state["data"]}  # older files keep the data's hash only
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        raise ValueError(f"out: {progress} is unreadable; pass --restart to make {out} anew") from None
    for name, value in key.items():
        if name in saved and saved[name] != value:
            raise ValueError(f"out: {out} was made with {name} {_show(saved[name])}, this command has "
                             f"{_show(value)}; pick a new --out, or pass --restart to make it anew")


def _start(out, progress, key, total, log, restart):
    """Records already done (0 for a new output); trims lines written after
    the last recorded batch."""
    if restart:
        for p in (out, progress):
            p.unlink(missing_ok=True)
    if not out.exists():
        return 0
    if not progress.exists():
        raise ValueError(f"out: {out} exists and has no {progress.name} beside it; "
                         "pick a new --out, or pass --restart to make it anew")
    check_progress(out, key)
    state = json.loads(progress.read_text())
    lines = out.read_text(encoding="utf-8").splitlines(keepends=True)
    if len(lines) < state["lines"]:
        raise ValueError(f"out: {out} has {len(lines)} lines, fewer than the {state['lines']} recorded")
    if len(lines) > state["lines"]:
        with writing(out):
            out.write_text("".join(lines[:state["lines"]]), encoding="utf-8")
    if state["records"] < total:
        log(f"Continuing {out} after {state['records']} of {total} records")
    return state["records"]


def _save_progress(prog, records, lines, key):
    """Records `records` done, `out` holding `lines` whole lines; written whole (rename)."""
    tmp = prog.with_name(prog.name + ".tmp")
    with writing(prog):
        try:
            tmp.write_text(json.dumps({"records": records, "lines": lines, "data": key["data"], "key": key}))
            os.replace(tmp, prog)
        finally:
            tmp.unlink(missing_ok=True)


def _rejected(completion, text):
    return [{"role": "assistant", "content": text}] if isinstance(completion, list) else text


def spin(model, tokenizer, data, out, settings=None, log=print, progress=True, key=None, restart=False):
    """Writes the self-play pairs of the records in `data` to `out`; returns
    (records done, pairs written). Records whose generation is empty are skipped.
    `key` (see `progress_key`; default: the data and `settings`) is what an
    existing `out` must have been made with; `restart` makes it anew."""
    import mlx.core as mx
    from mlx_lm.generate import batch_generate

    s = settings or SpinSettings()
    s.validate()
    data, out = Path(data), Path(out)
    records = read_jsonl(data, check_sft_record)
    if not records:
        raise ValueError(f"data: {data} holds no records")
    enc = Encoder(tokenizer, s.chat_template)
    prompts = [enc.encode_prompt(rec["prompt"], where) for rec, where in records]
    prog = out.with_name(out.name + ".progress")
    key = key or progress_key(data, s)
    done = _start(out, prog, key, len(records), log, restart)
    lines = len(out.read_text(encoding="utf-8").splitlines()) if out.exists() else 0
    bar = None
    if use_bar(progress):  # a terminal: no carriage returns into log files
        from tqdm import tqdm

        bar = tqdm(total=len(records), initial=done, desc="spin", unit="record", dynamic_ncols=True)
    skipped = 0
    try:
        _save_progress(prog, done, lines, key)  # first, so that a failed first write can be continued
        with writing(out):
            f = open(out, "a", encoding="utf-8")
        try:
            for start in range(done, len(records), s.batch_size):
                batch = range(start, min(start + s.batch_size, len(records)))
                mx.random.seed(s.seed * 1_000_003 + start)  # one seed per batch: resumable
                texts = batch_generate(model, tokenizer, [prompts[i] for i in batch],
                                       max_tokens=s.max_tokens, sampler=_sampler(s)).texts
                for i, text in zip(batch, texts):
                    rec = records[i][0]
                    if not text.strip():
                        skipped += 1
                        continue
                    with writing(out):  # a torn line is cut away on the next run (the progress file)
                        f.write(json.dumps({"prompt": rec["prompt"], "chosen": rec["completion"],
                                            "rejected": _rejected(rec["completion"], text)}) + "\n")
                    lines += 1
                with writing(out):
                    f.flush()
                    os.fsync(f.fileno())
                _save_progress(prog, batch.stop, lines, key)
                if bar is not None:
                    bar.update(len(batch))
        except BaseException:
            try:
                f.close()
            except OSError:
                pass  # its buffer held the write that failed, which is what is reported
            raise
        with writing(out):
            f.close()
    finally:
        if bar is not None:
            bar.close()
    if skipped:
        log(f"{skipped} records skipped: the model generated nothing for them")
    log(f"{out}: {lines} pairs from {len(records)} records")
    return len(records), lines
