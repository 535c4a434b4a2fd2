"""KTO's batch statistics from outside each example's own forward.

TRL's KTOTrainer compares each example's log-ratio (policy against reference)
with an estimate of the batch's KL divergence: the mean log-ratio of mismatched
prompt-completion pairs, the completions of the batch rotated by one
((x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1})), clamped at 0 and held constant
in the gradient. This module computes, before the gradient pass, the reference
log-probs of the examples and that KL estimate; the loss is `losses.kto`.

Each example and its mismatched sequence share the prompt, so the reference
pass encodes the prompt once for both (see `prefix`).
"""

import mlx.core as mx

from ..stack import Example, check_pairs, statistics
from . import losses

# The objective whose statistics give a pair's two sides (c_sum, r_sum) without NLL.
_PAIRED = losses.get("dpo")


def mismatched(examples):
    """Each example's prompt with the previous example's completion (TRL's rotation)."""
    return [e.as_pair(examples[i - 1].completion()) for i, e in enumerate(examples)]


def _check(examples, training):
    if not isinstance(examples, (list, tuple)) or not examples:
        raise ValueError("examples must be a non-empty list of flash_cce.stack.batch.Example")
    for i, e in enumerate(examples):
        if not isinstance(e, Example):
            raise ValueError(f"examples[{i}] must be a flash_cce.stack.batch.Example, got {type(e).__name__}")
        e.validate(f"examples[{i}]")
    if training and len(examples) < 2:
        raise ValueError("kto needs at least 2 examples per batch: the KL estimate pairs each "
                         "prompt with another example's completion")


def prepare(model, examples, cfg, group=None, training=True):
    """(pairs, extras) for `objectives`: each example as a one-sided Pair, and
    per example its reference log-prob `ref_c`, `label` and the batch's `kl`.

    With a distributed `group` the KL estimate is the mean over every rank's
    examples. A training batch needs two examples (a single one would be its own
    mismatched pair); an evaluation batch, as TRL's last one, may have one.
    """
    from .objectives import _reference, scoring

    _check(examples, training)
    pairs = [e.as_pair() for e in examples]
    kl_pairs = mismatched(examples)
    check_pairs(kl_pairs, model.args.vocab_size, cfg.stack.max_length)
    ref = _reference(model, kl_pairs, cfg, _PAIRED)
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
