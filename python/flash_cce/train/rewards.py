"""GRPO reward functions with TRL's signature, and the prompt data they read.

A reward function is called once per batch of completions as TRL's GRPOTrainer
calls it:

    func(prompts=[...], completions=[...], completion_ids=[[...], ...],
         trainer_state=state, **columns) -> list of float or None

with one entry per completion (a group's prompt and columns repeated G times):
`prompts` as the data gives them (strings or message lists), `completions` the
decoded texts (without special tokens), as `[{"role": "assistant", "content":
text}]` when the prompt is a conversation, `completion_ids` the token ids, and
every other column of the JSON Lines record as a keyword argument. `None` skips
that completion for this function (TRL's NaN: the weighted sum of the others
counts). `trainer_state` has `global_step` and `max_steps`.

`--reward` takes `module:function` (an importable module or a .py file) or a
built-in: `exact_match[=COLUMN]`, `format[=REGEX]`, `length[=CACHE]`.
"""

import importlib
import importlib.util
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

BUILTINS = ("exact_match", "format", "length")
DEFAULT_FORMAT = r"<think>.*?</think>.*"  # TRL's think_format_reward: one think block, then the answer


class RewardError(ValueError):
    """A reward function that cannot be loaded or returned something unusable (one line)."""


@dataclass
class TrainerState:
    """What TRL's `trainer_state` offers reward shaping by progress."""

    global_step: int = 0
    max_steps: int = 0


def completion_text(completion):
    """The text of a completion as reward functions receive it (string or assistant message list)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def as_completions(prompts, texts):
    """Completions as TRL gives them: the text, or an assistant message where the prompt is a conversation."""
    return [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)]


def exact_match(column="answer"):
    """1.0 where the completion's text, whitespace-trimmed, equals the record's `column`, else 0.0."""

    def reward(completions, **kwargs):
        if column not in kwargs:
            raise KeyError(f"the data has no column {column!r} (exact_match={column})")
        return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, kwargs[column])]

    reward.__name__ = "exact_match"
    return reward


def format_reward(pattern=DEFAULT_FORMAT):
    """1.0 where the whole completion text matches `pattern` (dot matches newlines), else 0.0."""
    regex = re.compile(pattern, re.DOTALL)

    def reward(completions, **kwargs):
        return [float(regex.fullmatch(completion_text(c).strip()) is not None) for c in completions]

    reward.__name__ = "format"
    return reward


def length_reward(max_completion_length, cache=None):
    """TRL's soft overlong punishment: 0 up to max_completion_length - cache tokens, then falling
    linearly to -1 at max_completion_length (and -1 beyond)."""
    cache = max(1, max_completion_length // 4) if cache is None else cache

    def reward(completion_ids, **kwargs):
        start = max_completion_length - cache
        out = []
        for ids in completion_ids:
            n = len(ids)
            out.append(0.0 if n <= start else -1.0 if n >= max_completion_length else (start - n) / cache)
        return out

    reward.__name__ = "length"
    return reward


def _builtin(name, arg, max_completion_length):
    if name == "exact_match":
        return exact_match(arg or "answer")
    if name == "format":
        try:
            return format_reward(arg or DEFAULT_FORMAT)
        except re.error as e:
            raise RewardError(f"reward: format={arg}: not a regular expression ({e})") from None
    try:
        cache = None if arg is None else int(arg)
    except ValueError:
        cache = -1
    if cache is not None and not 0 < cache <= max_completion_length:
        raise RewardError(f"reward: length={arg}: expected a number of tokens from 1 to max_completion_length "
                          f"({max_completion_length})")
    return length_reward(max_completion_length, cache)


def _import(module, spec):
    if module.endswith(".py"):
        path = Path(module).expanduser()
        if not path.is_file():
            raise RewardError(f"reward: {spec}: no such file {module}")
        name = f"flash_cce_reward_{abs(hash(str(path.resolve())))}"
        loader = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(loader)
        sys.modules[name] = mod
        loader.loader.exec_module(mod)
        return mod
    return importlib.import_module(module)


def load_reward(spec, max_completion_length=256):
    """The reward function named by `spec` (see the module's docstring)."""
    name, _, arg = spec.partition("=")
    if name in BUILTINS:
        return _builtin(name, arg or None, max_completion_length)
    module, sep, func = spec.rpartition(":")
    if not sep or not module or not func:
        raise RewardError(f"reward: got {spec!r}; allowed: module:function, file.py:function or a built-in "
                          f"({', '.join(BUILTINS)})")
    try:
        mod = _import(module, spec)
    except RewardError:
        raise
    except Exception as e:  # an import error, or anything the module raises while loading
        raise RewardError(f"reward: {spec}: cannot import {module} ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0]})") from None
    fn = getattr(mod, func, None)
    if not callable(fn):
        raise RewardError(f"reward: {spec}: {module} has no function {func!r}")
    return fn


def reward_name(func):
    return getattr(func, "__name__", type(func).__name__)


def load_rewards(specs, weights=None, max_completion_length=256):
    """([functions], [weights]) of `specs`; weights default to 1 each."""
    if not specs:
        raise RewardError("reward: give at least one --reward (module:function or a built-in: "
                          f"{', '.join(BUILTINS)})")
    funcs = [load_reward(s, max_completion_length) for s in specs]
    if weights is None:
        weights = [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise RewardError(f"reward_weights: got {len(weights)} weights for {len(funcs)} reward functions; "
                          "give one per --reward")
    return funcs, [float(w) for w in weights]


def _number(v):
    if v is None:
        return math.nan
    if isinstance(v, (bool, int, float)) and math.isfinite(float(v)):
        return float(v)
    try:  # numpy / mlx scalars
        f = float(v.item())
    except Exception:
        return None
    return f if math.isfinite(f) else None


def call_reward(func, prompts, completions, completion_ids, columns, where, state=None):
    """[float or nan] of `func` on a batch; `where[i]` names completion i's record.
    RewardError (one line naming the function and the record) for anything unusable."""
    name = reward_name(func)
    state = state or TrainerState()

    def run(idx):
        return func(prompts=[prompts[i] for i in idx], completions=[completions[i] for i in idx],
                    completion_ids=[completion_ids[i] for i in idx], trainer_state=state,
                    **{k: [v[i] for i in idx] for k, v in columns.items()})

    everyone = list(range(len(prompts)))
    try:
        out = run(everyone)
    except Exception as e:
        first = everyone[0]
        for i in everyone:  # find a record it fails on alone
            try:
                run([i])
            except Exception:
                first = i
                break
        reason = (str(e).splitlines() or [""])[0]
        raise RewardError(f"reward {name}: raised {type(e).__name__}: {reason} (record {where[first]})") from None
    if not isinstance(out, (list, tuple)) and not hasattr(out, "tolist"):
        raise RewardError(f"reward {name}: returned {type(out).__name__}, expected a list of floats "
                          f"(records {where[0]}...)")
    out = list(out.tolist() if hasattr(out, "tolist") else out)
    if len(out) != len(prompts):
        raise RewardError(f"reward {name}: returned {len(out)} values for {len(prompts)} completions "
                          f"(records {where[0]}...)")
    values = []
    for i, v in enumerate(out):
        f = _number(v)
        if f is None:
            raise RewardError(f"reward {name}: returned {json.dumps(v, default=repr)[:40]} for record {where[i]}; "
                              "expected a finite number or None")
        values.append(f)
    return values
