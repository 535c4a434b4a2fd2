"""Prefix sharing: encode a pair's prompt once, continue both responses from it.

Design: a forward over the prompt alone (batch 1) records every layer's keys and
values; the chosen and rejected responses then run as one batch of two padded
rows at positions P.., attending to the recorded prompt keys/values plus their
own (the mlx-lm KV-cache protocol: `offset` and `update_and_fetch`, so stock
mlx-lm attention layers, sliding windows and Gemma 4's shared KV layers work
unchanged). The caches here are functional: they concatenate instead of writing
into a buffer, so the gradient of the responses' loss flows back into the prompt's
keys and values, and from there into the prompt forward. Padding sits at the end
of the shorter response, where causal attention keeps it from every real token.
"""

import mlx.core as mx


class RecordCache:
    """Cache for a forward from position 0 that keeps the keys/values it sees."""

    offset = 0

    def __init__(self):
        self.kv = None

    def update_and_fetch(self, keys, values):
        self.kv = (keys, values)
        return keys, values


class PrefixCache:
    """Cache holding a prompt's keys/values `[1, heads, P, d]` for a continuation."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values
        self.offset = keys.shape[2]

    def update_and_fetch(self, keys, values):
        def join(prompt, new):
            prompt = mx.broadcast_to(prompt, (new.shape[0],) + prompt.shape[1:])
            return mx.concatenate([prompt, new], axis=2)

        return join(self.keys, keys), join(self.values, values)


def _padded(seqs):
    width = max(len(s) for s in seqs)
    return mx.array([s + [0] * (width - len(s)) for s in seqs]), width


def sequence_hidden(lm, seqs, prompt_len=None, *, segment_size=0):
    """Hidden states (before the final norm) that predict every token of `seqs`.

    Returns `(H, rows)`: `H` is `[rows, d]` and `rows[b][j]` is the row of `H`
    whose output predicts `seqs[b][j + 1]`. With `prompt_len` the sequences share
    their first `prompt_len` tokens and the prompt is encoded once; without it each
    sequence gets its own forward (one padded batch).
    """
    from .segmented import run_stack  # segmented uses this module's caches

    if not prompt_len:
        tokens, width = _padded([s[:-1] for s in seqs])
        h, _ = run_stack(lm, *lm.embed(tokens), segment_size=segment_size)
        rows = [[b * width + j for j in range(len(s) - 1)] for b, s in enumerate(seqs)]
        return h.reshape(-1, h.shape[-1]), rows
    p = prompt_len
    hp, kv = run_stack(
        lm, *lm.embed(mx.array([seqs[0][:p]])), keep_kv=True, segment_size=segment_size
    )
    parts = [hp[0]]
    conts = [s[p:-1] for s in seqs]
    tokens, width = _padded(conts)
    if width:
        hc, _ = run_stack(
            lm, *lm.embed(tokens), offset=p, prompt_kv=kv, segment_size=segment_size
        )
        parts.append(hc.reshape(-1, hc.shape[-1]))
    rows = [
        list(range(p)) + [p + b * width + k for k in range(len(c))]
        for b, c in enumerate(conts)
    ]
    return mx.concatenate(parts, axis=0), rows
