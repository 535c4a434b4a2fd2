"""KTO's batch statistics from outside each example's own forward.

TRL's KTOTrainer compares each example's log-ratio (policy against reference)
with an estimate of the batch's KL divergence: the mean log-ratio of mismatched
prompt-completion pairs, clamped at 0 and held constant in the gradient. The
mismatched pairs rotate the completions by one ((x_1, y_n), (x_2, y_1), ...,
(x_n, y_{n-1})): within runs of `batch_size` examples of a data split when it is
loaded (each example's `kl_completion`, as TRL's KTOTrainer prepares its data),
so that their reference log-probs can be computed before training, or else over
the batch. This module computes, before the gradient pass, the reference
log-probs of the examples and that KL estimate; the loss is `losses.kto`. Loss
types without the estimate (`apo_zero_unpaired`) run no mismatched pass and log
`kl` 0, as TRL does.

Each example and its mismatched sequence share the prompt, so the reference
pass encodes the prompt once for both (see `prefix`).
"""

import mlx.core as mx

from ..stack import Example, check_pairs, statistics
from .data import mismatched
from .losses import get, loss_type, scoring
from .reference import SIDES, Precomputed, reference_stats


def uses_kl(cfg):
    """Whether `cfg`'s KTO loss type reads the batch's KL estimate (TRL: all but apo_zero_unpaired)."""
    return loss_type(cfg) != "apo_zero_unpaired"


def _check(examples, training):
    if not isinstance(examples, (list, tuple)) or not examples:
        raise ValueError("examples must be a non-empty list of flash_cce.stack.batch.Example")
    for i, e in enumerate(examples):
        if not isinstance(e, Example):
            raise ValueError(f"examples[{i}] must be a flash_cce.stack.batch.Example, got {type(e).__name__}")
        e.validate(f"examples[{i}]")
    fixed = all(e.kl_completion is not None for e in examples)
    if training and len(examples) < 2 and not fixed:
        raise ValueError("kto needs at least 2 examples per batch: the KL estimate pairs each "
                         "prompt with another example's completion")


def prepare(model, examples, cfg, group=None, training=True):
    """(pairs, extras) for `objectives`: each example as a one-sided Pair, and
    per example its reference log-prob `ref_c`, `label` and the batch's `kl`.

    With a distributed `group` the KL estimate is the mean over every rank's
    examples. A training batch of examples without fixed KL completions needs two
    (a single one would be its own mismatched pair); an evaluation batch, as
    TRL's last one, may have one.
    """
    _check(examples, training and uses_kl(cfg))
    pairs = [e.as_pair() for e in examples]
    if not uses_kl(cfg):
        return pairs, _without_kl(model, examples, pairs, cfg)
    kl_pairs = mismatched(examples)
    check_pairs(kl_pairs, model.args.vocab_size, cfg.stack.max_length)
    ref = reference_stats(model, kl_pairs, cfg, SIDES)
    kl_sides = [Example(p.rejected, p.rejected_prompt_len, True).as_pair() for p in kl_pairs]
    policy_kl = [s["c_sum"] for s in statistics(model, kl_sides, scoring(cfg), cfg.stack)]
    ratio = mx.stack([k - r["ref_r"] for k, r in zip(policy_kl, ref)])
    total = mx.stack([ratio.sum(), mx.array(float(len(examples)))])
    if group is not None and group.size() > 1:
        total = mx.distributed.all_sum(total, group=group)
    kl = mx.maximum(total[0] / total[1], 0.0)
    mx.eval(kl)
    extras = [{"ref_c": r["ref_c"], "label": mx.array(float(e.label)), "kl": kl}
              for r, e in zip(ref, examples)]
    return pairs, extras


def _without_kl(model, examples, pairs, cfg):
    """`prepare`'s extras with `kl` 0 and the examples' own reference log-probs
    (a precomputed table is keyed by the mismatched pairs it was made from: looked up, not run)."""
    if isinstance(cfg.reference, Precomputed):
        ref = reference_stats(model, mismatched(examples), cfg, SIDES)
    else:
        ref = reference_stats(model, pairs, cfg, get("kto"))
    zero = mx.array(0.0)
    return [{"ref_c": r["ref_c"], "label": mx.array(float(e.label)), "kl": zero} for r, e in zip(ref, examples)]
