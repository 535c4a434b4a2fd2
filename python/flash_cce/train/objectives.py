"""Loss, gradients and metrics of a preference objective on an mlx-lm model.

`value_and_grad(model, pairs, cfg)` is what a trainer calls each step. Per pair it
runs the decoder (the prompt once when both responses share it, see `prefix`;
checkpointed over layer segments, see `segmented`), takes the final hidden states
of the tokens it scores, and gets their log-probs from the flash head
(`linear_logprobs`: the `[tokens, V]` logits are never built). The objectives
themselves are the pure functions of `losses`.

Pairs are differentiated one at a time and their gradients summed: each pair's
share of the loss only needs the batch totals (pair count, NLL token count), so
the loss and gradients equal those of the whole batch while activation memory
stays that of one pair.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

from ..stack import compiled

from . import losses
from ..stack.attention import DEFAULT_BLOCK, routed
from ..stack.batch import Pair
from ..head import linear_logprobs
from ..stack.layers import training_layers
from ..stack.lm import LM
from ..stack.prefix import sequence_hidden

# Tokens per pair (chosen + rejected) from which the default checkpoints the
# stack, one layer per segment: of 1, 2 and 3 layers per segment, 1 kept the
# least memory at about the same time (README); shorter pairs skip the recompute.
SEGMENT_FROM_TOKENS = 1024
DEFAULT_SEGMENT_SIZE = 1


@dataclass
class ObjectiveConfig:
    name: str = "orpo"  # a key of losses.OBJECTIVES
    beta: float = 0.1
    gamma: float = 0.5  # SimPO / ORPO+margin / CPO-simpo target margin
    loss_type: Optional[str] = None  # TRL's loss_type of dpo / cpo / kto; None: the default
    label_smoothing: float = 0.0  # DPO robust, CPO sigmoid/simpo
    cpo_alpha: float = 1.0  # weight of CPO's NLL term
    pref_weight: float = 1.0  # weight of the preference term of orpo / orpo_margin / cpo
    desirable_weight: float = 1.0  # KTO's weights of desirable / undesirable examples
    undesirable_weight: float = 1.0
    nll_on_prompt: bool = True  # ORPO/SFT NLL over prompt+response (TRL) or response only
    prefix_sharing: bool = True
    # Shared-prompt layout (see `prefix`): None picks; True packed rows; False two passes
    prefix_packing: Optional[bool] = None
    flash_head: bool = True
    segment_size: Optional[int] = None  # layers per checkpoint segment; None: default; 0: off
    # Gradients layer by layer through compiled layers (see `compiled`) where supported
    compiled_layers: bool = False
    # Round sequence widths up to a multiple and the shared prompt down to one (exact, see
    # `prefix.sequence_hidden`), so that pairs of nearby lengths share shapes; None: no rounding
    pad_to: Optional[int] = None
    max_length: Optional[int] = None  # longest sequence accepted (tokens); None: any
    # Queries per block of the training attention (see `attention`); None: default; 0: mlx-lm's
    attention_block: Optional[int] = None
    # Where DPO's / KTO's reference log-probs come from (see `reference`); None: adapters off
    reference: Optional[object] = None

    def validate(self):
        losses.validate(self)
        if self.segment_size is not None and self.segment_size < 0:
            raise ValueError(f"segment_size must be None or >= 0, got {self.segment_size}")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length must be None or >= 2, got {self.max_length}")
        if self.prefix_packing not in (None, True, False):
            raise ValueError(f"prefix_packing must be None, True or False, got {self.prefix_packing!r}")
        if self.pad_to is not None and self.pad_to < 1:
            raise ValueError(f"pad_to must be None or >= 1, got {self.pad_to}")
        if self.attention_block is not None and self.attention_block < 0:
            raise ValueError(f"attention_block must be None or >= 0, got {self.attention_block}")


def _check(pairs, cfg, vocab):
    if not isinstance(pairs, (list, tuple)) or not pairs:
        raise ValueError("pairs must be a non-empty list of flash_cce.stack.batch.Pair")
    for i, p in enumerate(pairs):
        where = f"pairs[{i}]"
        if not isinstance(p, Pair):
            raise ValueError(f"{where} must be a flash_cce.stack.batch.Pair, got {type(p).__name__}")
        p.validate(where)
        for name, seq, n in (("chosen", p.chosen, p.chosen_prompt_len),
                             ("rejected", p.rejected, p.rejected_prompt_len)):
            if cfg.max_length is not None and len(seq) > cfg.max_length:
                raise ValueError(
                    f"{where}: {name} has {len(seq)} tokens, more than "
                    f"max_length={cfg.max_length}"
                )
            if n == 0 and len(seq) < 2:
                raise ValueError(
                    f"{where}: the {name} response has no predicted token (a sequence's "
                    "first token is never predicted; give a prompt or a longer response)"
                )
            bad = [t for t in seq if not (isinstance(t, (int, np.integer)) and 0 <= t < vocab)]
            if bad:
                raise ValueError(
                    f"{where}: {name} tokens must be ints in [0, {vocab}), got {bad[0]!r}"
                )


def _segment_size(cfg, pair):
    if cfg.segment_size is not None:
        return cfg.segment_size
    tokens = len(pair.chosen) + len(pair.rejected)
    return DEFAULT_SEGMENT_SIZE if tokens >= SEGMENT_FROM_TOKENS else 0


def _attention_block(cfg):
    return DEFAULT_BLOCK if cfg.attention_block is None else cfg.attention_block


def _logprobs(lm, h, targets, flash):
    h = lm.norm(h)
    if flash:
        # The targets are the pair's tokens, range-checked on the host (`_check`);
        # the head's own check would evaluate them in the middle of the step.
        return linear_logprobs(lm.head_input(h), lm.head, targets, softcap=lm.softcap,
                               validate_targets=False)
    logits = lm.logits(h).astype(mx.float32)
    picked = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return picked - mx.logsumexp(logits, axis=-1)


def _seqs(pair, obj):
    return [pair.chosen, pair.rejected] if obj.rejected else [pair.chosen]


def pair_stats(lm, pair, cfg, obj=None, *, share=None, segment_size=0, stack=None):
    """Log-prob statistics (see `losses`) of one pair, as float32 scalars.

    `share` (default: whether the config asks for prefix sharing and the prompts
    tokenise alike) encodes the prompt once for both responses.
    """
    obj = obj or losses.get(cfg.name)
    h, rows = _pair_hidden(lm, pair, cfg, obj, share, segment_size, stack)
    return hidden_stats(lm, h, rows, pair, cfg, obj)


def _pair_hidden(lm, pair, cfg, obj, share=None, segment_size=0, stack=None):
    """`sequence_hidden` of the pair's sequences as `cfg` lays them out."""
    if share is None:
        share = can_share(pair, cfg, obj)
    return sequence_hidden(
        lm, _seqs(pair, obj), pair.chosen_prompt_len if share else None,
        segment_size=segment_size, pack=cfg.prefix_packing, stack=stack, pad_to=cfg.pad_to,
    )


def hidden_stats(lm, h, rows, pair, cfg, obj):
    """`pair_stats` from the hidden states `h` of `sequence_hidden` and its rows."""
    seqs = _seqs(pair, obj)
    plens = [pair.chosen_prompt_len, pair.rejected_prompt_len]
    idx, tgt, groups = [], [], []
    for b, seq in enumerate(seqs):
        for j in range(len(seq) - 1):
            resp = j + 1 >= plens[b]
            nll = b == 0 and obj.nll and (resp or _nll_on_prompt(cfg, obj))
            if resp or nll:
                idx.append(rows[b][j])
                tgt.append(seq[j + 1])
                groups.append((b == 0 and resp, b == 1 and resp, nll))
    g = np.array(groups, np.float32)
    lp = _logprobs(lm, h[mx.array(idx)], mx.array(tgt), cfg.flash_head)
    stats = {}
    for k, (name, sign) in enumerate((("c", 1.0), ("r", 1.0), ("nll", -1.0))):
        stats[f"{name}_sum"] = sign * (lp * mx.array(g[:, k])).sum()
        stats[f"{name}_n"] = mx.array(float(g[:, k].sum()))
    return stats


def can_share(pair, cfg, obj):
    return cfg.prefix_sharing and obj.rejected and pair.chosen_prompt_len > 0 and pair.shares_prompt()


def _reference(lm, pairs, cfg, obj):
    """Reference log-probs of `pairs` from `cfg.reference` (default: the model
    with its adapters off), without gradients."""
    from .reference import AdaptersOff

    return (cfg.reference or AdaptersOff()).stats(lm, pairs, cfg, obj)


def _prepare(model, items, cfg, group=None, training=True):
    """(lm, objective, pairs, extras): `extras[i]` (or None) holds pair i's
    statistics that come from outside its own forward (reference log-probs, ...)."""
    cfg.validate()
    lm = LM(model)
    obj = losses.get(cfg.name)
    if cfg.name == "kto":
        from .kto import prepare

        pairs, extras = prepare(lm, items, cfg, group, training)
        return lm, obj, pairs, extras
    _check(items, cfg, model.args.vocab_size)
    return lm, obj, items, _reference(lm, items, cfg, obj) if obj.reference else None


def _nll_on_prompt(cfg, obj):
    return cfg.nll_on_prompt if obj.nll_on_prompt is None else obj.nll_on_prompt


def _batch_totals(pairs, cfg, obj):
    """Pair count and NLL token count of the batch (known from the lengths)."""
    nll_tokens = 0
    if obj.nll:
        for p in pairs:
            skip = 1 if _nll_on_prompt(cfg, obj) else max(p.chosen_prompt_len, 1)
            nll_tokens += len(p.chosen) - skip
    return len(pairs), nll_tokens


def _with_extras(stats, extras, i):
    return stats if extras is None else dict(stats, **extras[i])


def _stack(all_stats):
    return {k: mx.stack([s[k] for s in all_stats]) for k in all_stats[0]}


def _distributed(group):
    return group is not None and group.size() > 1


def _global_totals(totals, group):
    """Batch totals over every rank's pairs (a data-parallel step's batch)."""
    if not _distributed(group):
        return totals
    return tuple(int(v) for v in mx.distributed.all_sum(mx.array(totals), group=group).tolist())


def _metrics(obj, cfg, pairs, all_stats, totals, group=None):
    """Loss and metrics of the batch; with a group, of the pairs of all its ranks."""
    stats = _stack(all_stats)
    counts = mx.array([
        sum(cfg.prefix_sharing and obj.rejected and not p.shares_prompt() for p in pairs),
        sum(len(p.chosen) + len(p.rejected) * obj.rejected for p in pairs),
    ])
    if _distributed(group):
        stats = {k: mx.distributed.all_gather(v, group=group) for k, v in stats.items()}
        counts = mx.distributed.all_sum(counts, group=group)
    terms, metrics = obj.fn(stats, cfg, *totals)
    metrics["prefix_fallbacks"] = counts[0]
    metrics["tokens"] = counts[1]
    return terms.sum(), metrics


def value_and_grad(model, pairs, cfg, group=None):
    """Loss (mean over the pairs), gradients (the tree of
    `model.trainable_parameters()`) and metrics (str -> scalar) of `cfg`'s objective.

    With a distributed `group`, `pairs` is this rank's share of a batch spread over
    the group: the loss and metrics are those of the whole batch, and the
    gradients are this rank's share of the batch's, so that their sum over the
    ranks (an all-reduce) is the gradient of the whole batch.
    """
    lm, obj, pairs, extras = _prepare(model, pairs, cfg, group)
    totals = _global_totals(_batch_totals(pairs, cfg, obj), group)
    grads, all_stats = None, []
    for i, pair in enumerate(pairs):
        seg = _segment_size(cfg, pair)

        def loss_of(stats):
            stats = _with_extras(stats, extras, i)
            one = {k: v[None] for k, v in stats.items()}
            terms, _ = obj.fn(one, cfg, *totals)
            return terms.sum(), stats

        with routed(model, _attention_block(cfg)), training_layers():
            if _compiles(lm, cfg):
                stats, g = _compiled_pair(lm, pair, cfg, obj, loss_of)
            else:
                # The backward (and a segment's recomputed forward) is built here.
                (_, stats), g = nn.value_and_grad(
                    model, lambda: loss_of(pair_stats(lm, pair, cfg, obj, segment_size=seg))
                )()
        grads = g if grads is None else tree_map(mx.add, grads, g)
        all_stats.append(tree_map(mx.stop_gradient, stats))
        mx.eval(grads, all_stats[-1])
    loss, metrics = _metrics(obj, cfg, pairs, all_stats, totals, group)
    return loss, grads, metrics


def _compiles(lm, cfg):
    """Whether gradients go through `compiled`."""
    return cfg.compiled_layers and compiled.supported(lm)


def _forward_stack(lm, cfg):
    """The compiled layers for a forward without gradients, or None."""
    return compiled.stack_for(lm, backward=False) if _compiles(lm, cfg) else None


def _compiled_pair(lm, pair, cfg, obj, loss_of):
    """(stats, gradients) of one pair: the objective's autodiff reaches the last
    hidden states, the compiled stack takes their cotangent through the layers."""
    stack = compiled.stack_for(lm)
    h, rows = _pair_hidden(lm, pair, cfg, obj, stack=stack)
    (_, stats), ct = mx.value_and_grad(
        lambda h: loss_of(hidden_stats(lm, h, rows, pair, cfg, obj)))(h)
    return stats, stack.backward(ct)


def evaluate(model, pairs, cfg):
    """Loss and metrics of `cfg`'s objective without gradients."""
    lm, obj, pairs, extras = _prepare(model, pairs, cfg, training=False)
    all_stats = []
    with routed(model, _attention_block(cfg)):
        for i, pair in enumerate(pairs):
            stats = _with_extras(
                pair_stats(lm, pair, cfg, obj, stack=_forward_stack(lm, cfg)), extras, i)
            mx.eval(stats)
            all_stats.append(stats)
    return _metrics(obj, cfg, pairs, all_stats, _batch_totals(pairs, cfg, obj))
