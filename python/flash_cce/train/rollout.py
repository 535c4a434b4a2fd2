"""GRPO rollouts on the device: G completions for each of a step's prompts,
sampled with the current policy (adapters applied).

Each prompt is prefilled once, at batch size 1 with mlx-lm's own KV cache; its
cache and last logits are then copied to its G completions (mlx-lm's cache
`merge` into one left-padded batch) and all groups of the step decode together,
one token per model call. The sampler draws from `softmax(logits / temperature)`
after transformers' repetition penalty (before the temperature) and TRL's
filters (transformers' order: top_k, then top_p, then min_p, each from mlx-lm's
`sample_utils`); the log-probs returned are those of the tempered distribution
*before* the penalty and the filters, `log_softmax(logits / temperature)` at the
sampled token: what TRL's trainer computes for the same tokens (it divides the
logits by the temperature and never filters), so with `num_iterations` > 1 they
serve as the behaviour ("old") log-probs.

Randomness is counter-based: token t of row r in draw d uses the key
(hash(seed, stream, d, r), t), a Gumbel-max draw per row. A rollout is a function of the
seed, the draw counter and the rows' global ids, so `RolloutRng.state()` (two
integers) restores it exactly on resume, and data-parallel ranks that take parts
of a step sample what one process would.
"""

from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class SamplingSettings:
    """TRL's GRPOConfig generation fields (same names and defaults, min_p 0 for None)."""

    max_completion_length: int = 256
    temperature: float = 1.0  # 0: greedy (log-probs then at temperature 1)
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off

    def validate(self):
        if not isinstance(self.max_completion_length, int) or self.max_completion_length < 1:
            raise ValueError(f"max_completion_length: got {self.max_completion_length!r}; allowed: an integer >= 1")
        if not self.temperature >= 0:
            raise ValueError(f"temperature: got {self.temperature!r}; allowed: a number >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: got {self.top_p!r}; allowed: a number > 0 and <= 1")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: got {self.top_k!r}; allowed: an integer >= 0")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p: got {self.min_p!r}; allowed: a number >= 0 and < 1")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty: got {self.repetition_penalty!r}; allowed: a number > 0")


@dataclass
class Rollout:
    """One step's completions, `[group][generation]`."""

    prompts: list  # [P] prompt token ids
    completions: list  # [P][G] token ids, the EOS token included when one was sampled
    logprobs: list  # [P][G] float32 arrays: the sampler's log-prob of each completion token
    truncated: list  # [P][G] True when no EOS came within max_completion_length
    prefill_tokens: int = 0  # prompt tokens run through the model (each prompt once)
    decode_steps: int = 0  # batched one-token model calls


class RolloutRng:
    """The rollouts' random state: a seed and a draw counter (see the module's docstring)."""

    def __init__(self, seed=0, draws=0, stream=0):
        self.seed, self.draws, self.stream = int(seed), int(draws), int(stream)  # stream: e.g. training, validation

    def state(self):
        return {"seed": self.seed, "draws": self.draws, "stream": self.stream}

    @classmethod
    def from_state(cls, state):
        return cls(state["seed"], state["draws"], state.get("stream", 0))

    def next_keys(self, rows):
        """The high key words of global rows `rows` for the next draw (uint32 [len(rows)])."""
        d = self.draws
        self.draws += 1
        return np.array([np.random.SeedSequence([self.seed, self.stream, d, int(r)]).generate_state(1)[0] for r in rows],
                        dtype=np.uint32)


def _filtered(logprobs, s):
    """`logprobs` with the tokens that top_k, top_p and min_p exclude at -inf."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    if 0 < s.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, s.top_k)
    if s.top_p < 1:
        logprobs = apply_top_p(logprobs, s.top_p)
    if s.min_p > 0:
        logprobs = apply_min_p(logprobs, s.min_p)
    return logprobs


def _gumbel_rows(keys, vocab):
    """Gumbel noise [B, vocab], row b from its own key keys[b]."""
    return mx.vmap(lambda key: mx.random.gumbel(shape=(vocab,), key=key))(keys)


def _penalized(logits, seen, penalty):
    """transformers' repetition penalty: the logits of the tokens in `seen` (bool
    [B, V]: in the prompt or the completion so far) divided by `penalty`, or
    multiplied where negative."""
    return mx.where(seen, mx.where(logits < 0, logits * penalty, logits / penalty), logits)


@lru_cache(maxsize=16)
def _sampler(temperature, top_p, top_k, min_p, repetition_penalty):
    """The sampler of these settings as one compiled function (logits [B, V],
    high keys [B], step t, seen tokens [B, V] or None) -> (tokens [B], log-probs
    [B]): its dozen small ops over [B, V] run as a few kernels at every decode
    step. The penalty and the filters shape the draw, not the log-probs."""
    s = SamplingSettings(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                         repetition_penalty=repetition_penalty)

    def sample(logits, high, t, seen=None):
        logits = logits.astype(mx.float32)
        drawn = logits if seen is None else _penalized(logits, seen, s.repetition_penalty)
        if s.temperature == 0:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            tokens = mx.argmax(drawn, axis=-1)
        else:
            scaled = logits * (1.0 / s.temperature)
            logprobs = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
            drawn = drawn * (1.0 / s.temperature)
            drawn = drawn - mx.logsumexp(drawn, axis=-1, keepdims=True)
            keys = mx.stack([high, mx.broadcast_to(t, high.shape)], axis=1)
            tokens = mx.argmax(_filtered(drawn, s) + _gumbel_rows(keys, logprobs.shape[-1]), axis=-1)
        return tokens, mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]

    return mx.compile(sample)


def _sample(logits, s, high, t, seen=None):
    """(tokens [B], sampler log-probs [B]) from last-position logits [B, V];
    `seen`: the tokens the repetition penalty applies to (None: no penalty)."""
    f = _sampler(s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty)
    t = mx.array(t, mx.uint32)
    return f(logits, high, t) if seen is None else f(logits, high, t, seen)


def _prefill(model, prompt, step_size):
    """(cache, last-position logits [1, V]) of one prompt."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    tokens = mx.array(prompt)[None]
    while tokens.shape[1] > step_size:
        model(tokens[:, :step_size], cache=cache)
        mx.eval([c.state for c in cache])
        tokens = tokens[:, step_size:]
    logits = model(tokens, cache=cache)[:, -1, :]
    mx.eval(logits, [c.state for c in cache])
    return cache, logits


def _batch_cache(caches, copies):
    """One batched cache per layer holding each cache of `caches` `copies` times."""
    rows = [c for c in caches for _ in range(copies)]
    out = []
    for layer in range(len(caches[0])):
        first = rows[0][layer]
        if not hasattr(first, "merge"):
            raise ValueError(f"rollout: the model's {type(first).__name__} cannot be batched by mlx-lm")
        out.append(first.merge([r[layer] for r in rows]))
    return out


def _prompt_tokens(prompts, copies, vocab):
    """bool [len(prompts) * copies, vocab]: which tokens each row's prompt holds."""
    seen = np.zeros((len(prompts), vocab), bool)
    for i, p in enumerate(prompts):
        seen[i, [t for t in p if 0 <= t < vocab]] = True
    return mx.repeat(mx.array(seen), copies, axis=0)


def rollout(model, prompts, num_generations, settings, eos_ids, rng=None, group_ids=None,
            prefill_step_size=2048):
    """`num_generations` completions of each prompt of `prompts` (lists of token ids).

    `eos_ids`: the tokens that end a completion. `rng` (a RolloutRng; None: a
    fresh one with seed 0) draws once per call; `group_ids` are the prompts'
    global indices in the step (default 0..P-1), row r = group * G + g.
    """
    settings.validate()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("rollout: every prompt needs at least one token")
    rng = rng or RolloutRng()
    G, P, T = num_generations, len(prompts), settings.max_completion_length
    group_ids = list(range(P)) if group_ids is None else list(group_ids)
    rows = [g * G + j for g in group_ids for j in range(G)]
    high = mx.array(rng.next_keys(rows))
    eos = np.array(sorted(set(int(e) for e in eos_ids)), dtype=np.int64)

    was_training = model.training
    model.eval()  # no adapter dropout while sampling
    try:
        prefilled = [_prefill(model, p, prefill_step_size) for p in prompts]
        cache = _batch_cache([c for c, _ in prefilled], G)
        logits = mx.repeat(mx.concatenate([x for _, x in prefilled], axis=0), G, axis=0)
        del prefilled
        seen = _prompt_tokens(prompts, G, logits.shape[-1]) if settings.repetition_penalty != 1 else None
        vocab_ids = mx.arange(logits.shape[-1])[None] if seen is not None else None
        y, lp = _sample(logits, settings, high, 0, seen)
        mx.async_eval(y, lp)
        tokens, logps = [], []
        B = P * G
        done, length = np.zeros(B, bool), np.full(B, T)
        steps = 0
        for t in range(T):
            if t + 1 < T:  # the next token's graph is built while this one computes
                if seen is not None:
                    seen = seen | (vocab_ids == y[:, None])
                ny, nlp = _sample(model(y[:, None], cache=cache)[:, -1, :], settings, high, t + 1, seen)
                mx.async_eval(ny, nlp)
                steps += 1
            tok = np.array(y)
            tokens.append(tok)
            logps.append(lp)
            ended = ~done & np.isin(tok, eos)
            length[ended] = t + 1
            done |= ended
            if done.all() or t + 1 == T:
                break
            y, lp = ny, nlp
    finally:
        model.train(was_training)
    ids = np.stack(tokens, axis=1)
    lps = np.array(mx.stack(logps, axis=1)).astype(np.float32)
    completions = [[ids[g * G + j, :length[g * G + j]].tolist() for j in range(G)] for g in range(P)]
    logprobs = [[lps[g * G + j, :length[g * G + j]] for j in range(G)] for g in range(P)]
    truncated = [[not done[g * G + j] for j in range(G)] for g in range(P)]
    return Rollout([list(p) for p in prompts], completions, logprobs, truncated,
                   prefill_tokens=sum(len(p) for p in prompts), decode_steps=steps)
