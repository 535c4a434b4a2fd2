"""Loss, gradients and metrics of a preference objective on an mlx-lm model.

`value_and_grad(model, pairs, cfg)` is what a trainer calls each step. The
stack (`flash_cce.stack`) turns the pairs into log-probability statistics as
`cfg.stack` allows; the objective is a loss over those statistics (the pure
functions of `losses`), with whatever comes from outside the pair's own forward
(reference log-probs, KTO's KL estimate) added to them.

Each pair's share of the loss needs only the batch totals (pair count, NLL
token count), so the stack differentiates the pairs one at a time and the loss
and gradients equal those of the whole batch.
"""

from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx

from .. import stack
from ..stack import StackConfig
from . import kto, losses
from .losses import scoring
from .reference import reference_stats


@dataclass
class ObjectiveConfig:
    name: str = "orpo"  # a key of losses.OBJECTIVES
    beta: float = 0.1
    gamma: float = 0.5  # SimPO / ORPO+margin / CPO-simpo target margin
    loss_type: Optional[str] = None  # TRL's loss_type of dpo / cpo / kto; None: the default
    label_smoothing: float = 0.0  # DPO robust / exo_pair, CPO sigmoid/simpo
    discopop_tau: float = 0.05  # DPO discopop's temperature
    cpo_alpha: float = 1.0  # weight of CPO's NLL term
    alpha: float = 0.0  # CPO's AlphaPO reward shape (0: log-prob rewards)
    pref_weight: float = 1.0  # weight of the preference term of orpo / orpo_margin / cpo
    desirable_weight: float = 1.0  # KTO's weights of desirable / undesirable examples
    undesirable_weight: float = 1.0
    nll_on_prompt: bool = True  # ORPO/SFT NLL over prompt+response (TRL) or response only
    # Where DPO's / KTO's reference log-probs come from (see `reference`); None: adapters off
    reference: Optional[object] = None
    stack: StackConfig = field(default_factory=StackConfig)  # how the model runs

    def validate(self):
        losses.validate(self)
        if not isinstance(self.stack, StackConfig):
            raise ValueError(f"stack must be a flash_cce.stack.StackConfig, got {type(self.stack).__name__}")
        self.stack.validate()


def _prepare(model, items, cfg, group=None, training=True):
    """(objective, pairs, extras): `extras[i]` (or None) holds pair i's
    statistics that come from outside its own forward (reference log-probs, ...)."""
    cfg.validate()
    obj = losses.get(cfg.name)
    if cfg.name == "kto":
        pairs, extras = kto.prepare(model, items, cfg, group, training)
        return obj, pairs, extras
    stack.check_pairs(items, model.args.vocab_size, cfg.stack.max_length)
    return obj, items, reference_stats(model, items, cfg, obj) if obj.reference else None


def _batch_totals(pairs, cfg, obj):
    """Pair count and NLL token count of the batch (known from the lengths)."""
    nll_tokens = 0
    if obj.nll:
        on_prompt = scoring(cfg, obj).nll_on_prompt
        for p in pairs:
            skip = 1 if on_prompt else max(p.chosen_prompt_len, 1)
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
        sum(cfg.stack.prefix_sharing and obj.rejected and not p.shares_prompt() for p in pairs),
        sum(len(p.chosen) + len(p.rejected) * obj.rejected for p in pairs),
    ])
    if _distributed(group):
        stats = {k: mx.distributed.all_gather(v, group=group) for k, v in stats.items()}
        counts = mx.distributed.all_sum(counts, group=group)
    terms, metrics = obj.fn(stats, cfg, *totals)
    if "c_top1_sum" in stats:
        metrics.update(losses.token_metrics(cfg.name, stats))
    # Sliced, not indexed: MLX takes an integer index by a gather, a kernel that
    # the CUDA backend builds at run time (seconds of a fresh machine's first step).
    metrics["prefix_fallbacks"] = counts[0:1].reshape(())
    metrics["tokens"] = counts[1:2].reshape(())
    return terms.sum(), metrics


def _native_stats():
    """TRL's token metrics in a training step where the device's own kernels
    compute them (on a GPU from a forward without gradient beside the fused
    head, `stack.stats`; elsewhere the head would take its slower fallback);
    evaluation always has them."""
    from ..ops import native_stats

    return native_stats(None)


def value_and_grad(model, pairs, cfg, group=None):
    """Loss (mean over the pairs), gradients (the tree of
    `model.trainable_parameters()`) and metrics (str -> scalar) of `cfg`'s objective.

    With a distributed `group`, `pairs` is this rank's share of a batch spread over
    the group: the loss and metrics are those of the whole batch, and the
    gradients are this rank's share of the batch's, so that their sum over the
    ranks (an all-reduce) is the gradient of the whole batch.
    """
    obj, pairs, extras = _prepare(model, pairs, cfg, group)
    totals = _global_totals(_batch_totals(pairs, cfg, obj), group)

    def share(i, stats):
        one = {k: v[None] for k, v in _with_extras(stats, extras, i).items()}
        return obj.fn(one, cfg, *totals)[0].sum()

    all_stats, grads = stack.value_and_grad(model, pairs, scoring(cfg, obj, _native_stats()), share, cfg.stack)
    all_stats = [_with_extras(s, extras, i) for i, s in enumerate(all_stats)]
    loss, metrics = _metrics(obj, cfg, pairs, all_stats, totals, group)
    return loss, grads, metrics


def evaluate(model, pairs, cfg):
    """Loss and metrics of `cfg`'s objective without gradients."""
    obj, pairs, extras = _prepare(model, pairs, cfg, training=False)
    all_stats = stack.statistics(model, pairs, scoring(cfg, obj, token_stats=True), cfg.stack)
    all_stats = [_with_extras(s, extras, i) for i, s in enumerate(all_stats)]
    return _metrics(obj, cfg, pairs, all_stats, _batch_totals(pairs, cfg, obj))
