"""Prefix sharing: encode a prompt once, continue each of its responses from it
(a pair's two, or a group's G).

Two layouts, both exact (the same function as a forward per sequence):

- Packed (one pass over the stack): a batch of n + 1 rows for n responses, the
  prompt at positions 0.. and each response at positions P.. (per-row RoPE
  offsets), padded to one width. Each response row attends to the prompt row's
  keys/values plus its own (`attention.PackedMask`, which `attention.routed`
  serves). The layers run once on (n + 1) x width tokens, so this is the layout
  when the prompt and the responses are of similar length (width = the longest
  row) and the attention is routed.
- Two passes: a forward over the prompt alone (batch 1) records every layer's
  keys and values; the responses then run as one batch of n padded rows at
  positions P.., attending to the recorded prompt keys/values plus their own
  (the mlx-lm KV-cache protocol, `caches.PrefixCache`, so stock mlx-lm
  attention layers, sliding windows and Gemma 4's shared KV layers work
  unchanged). Its caches are functional: they concatenate instead of
  writing into a buffer, so the gradient of the responses' loss flows back into
  the prompt's keys and values, and from there into the prompt forward.

Padding sits at the end of a shorter row, where causal attention keeps it from
every real token.
"""

from functools import partial

import mlx.core as mx

from .attention import packs
from .segmented import run_stack


def packing_pays(prompt_len, widths):
    """Whether the packed layout runs no more tokens than separate forwards:
    n + 1 rows of max(P, responses) vs n rows of P + the longest response, for
    n responses (a pair: 3 rows against 2)."""
    widths = list(widths)
    width = max([prompt_len] + widths)
    return (len(widths) + 1) * width <= len(widths) * (prompt_len + max(widths))


def _packable(lm):
    # The one mlx-lm RoPE that does arithmetic on its offset in Python.
    return all(
        type(getattr(getattr(layer, "self_attn", None), "rope", None)).__name__
        != "DynamicNTKScalingRoPE"
        for layer in lm.layers
    )


def _padded(seqs, multiple=None):
    width = max(len(s) for s in seqs)
    if multiple and width:
        width = -(-width // multiple) * multiple
    return mx.array([s + [0] * (width - len(s)) for s in seqs]), width


def packed_layout(lm, seqs, prompt_len, pack=None):
    """Whether `seqs`, sharing their first `prompt_len` tokens, take the packed
    layout: `pack`, or where None, when the attention is routed and `packing_pays`."""
    conts = [s[prompt_len:-1] for s in seqs]
    can_pack = packs(lm.model) and _packable(lm)
    if pack is None:
        return can_pack and packing_pays(prompt_len, map(len, conts))
    if pack and not can_pack:
        raise ValueError(
            "pack=True needs the model's attention routed (attention.routed) and a RoPE "
            "that takes per-row offsets"
        )
    return pack


def sequence_hidden(lm, seqs, prompt_len=None, *, segment_size=0, pack=None, stack=None,
                    pad_to=None):
    """Hidden states (before the final norm) that predict every token of `seqs`.

    Returns `(H, rows)`: `H` is `[rows, d]` and `rows[b][j]` is the row of `H`
    whose output predicts `seqs[b][j + 1]`. With `prompt_len` the sequences share
    their first `prompt_len` tokens and the prompt is encoded once; without it each
    sequence gets its own forward (one padded batch). `pack` picks the layout
    with a shared prompt (see `packed_layout`). `stack` (a `compiled.Stack`) runs
    the layers instead of `run_stack`. `pad_to` rounds the padded widths up to a
    multiple and the shared prompt down to one (its last tokens go with each
    sequence; none shared below one multiple), so that pairs of nearby lengths
    share every shape, the prompt's keys included.
    """
    if prompt_len and pad_to:
        prompt_len -= prompt_len % pad_to

    def layers(tokens, **kw):
        run = stack.forward if stack is not None else partial(run_stack, lm,
                                                              segment_size=segment_size)
        return run(*lm.embed(tokens), **kw)

    if not prompt_len:
        tokens, width = _padded([s[:-1] for s in seqs], pad_to)
        h, _ = layers(tokens)
        rows = [[b * width + j for j in range(len(s) - 1)] for b, s in enumerate(seqs)]
        return h.reshape(-1, h.shape[-1]), rows
    p = prompt_len
    conts = [s[p:-1] for s in seqs]
    if packed_layout(lm, seqs, p, pack):
        tokens, width = _padded([seqs[0][:p]] + conts, pad_to)
        h, _ = layers(tokens, packed=p)
        rows = [
            list(range(p)) + [(1 + b) * width + k for k in range(len(c))]
            for b, c in enumerate(conts)
        ]
        return h.reshape(-1, h.shape[-1]), rows
    hp, kv = layers(mx.array([seqs[0][:p]]), keep_kv=True)
    parts = [hp[0]]
    tokens, width = _padded(conts, pad_to)
    if width:
        hc, _ = layers(tokens, offset=p, prompt_kv=kv)
        parts.append(hc.reshape(-1, hc.shape[-1]))
    rows = [
        list(range(p)) + [p + b * width + k for k in range(len(c))]
        for b, c in enumerate(conts)
    ]
    return mx.concatenate(parts, axis=0), rows
