"""The stack's entry point: preference pairs in, log-probability statistics out.

`statistics(model, pairs, scoring, config)` runs each pair through the model as
its `Plan` says and returns, per pair, float32 scalars:

- `c_sum`, `c_n`: summed log-probs and count of the chosen response's tokens,
- `r_sum`, `r_n`: the same of the rejected response (0 unless `scoring.rejected`),
- `nll_sum`, `nll_n`: the chosen sequence's summed negative log-likelihood and
  its token count (0 unless `scoring.nll`),
- with `scoring.entropy`: `c_ent`, `r_ent`, the entropy of the softmax at each
  scored token of the chosen (rejected) response, float32 `[c_n]` (`[r_n]`),
  and their sums `c_ent_sum`, `r_ent_sum`; differentiable, from the same head
  call as the log-probs (the fused head returns both in one pass),
- with `scoring.token_stats`, for each token group (`c`, `r`, `nll`), without
  gradient: `*_ent_sum`, the summed entropy, `*_top1_sum`, the number of tokens
  that are the arg-max, and `*_logit_sum`, the summed mean logit (over the
  vocabulary), from the same head call (what TRL's token metrics read).

`value_and_grad(model, pairs, scoring, loss, config)` also differentiates
`loss(i, stats)`, pair i's share of an objective's loss, and returns the summed
gradients of `model.trainable_parameters()`. Pairs run one at a time, so the
step holds one pair's activations; a loss over the whole batch is a sum of
per-pair shares when each share knows the batch totals (pair count, NLL tokens).
"""

import contextlib
import functools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

from ..head import linear_logprobs
from ..ops import fused_stats
from . import compiled
from .attention import routed
from .batch import Pair
from .embedding import routed_embeddings
from .layers import quantized_layers, training_layers
from .lm import LM
from .plan import StackConfig, attention_block, group_plan, plan, sequences
from .prefix import sequence_hidden
from .rows import take_rows

def validated(items, name, kind):
    """(where, item) of a non-empty list of `kind` (`Pair`, `Group`), each
    validated; ValueError naming the list `name`, the item and the problem."""
    what = f"flash_cce.stack.batch.{kind.__name__}"
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"{name} must be a non-empty list of {what}")
    for i, item in enumerate(items):
        where = f"{name}[{i}]"
        if not isinstance(item, kind):
            raise ValueError(f"{where} must be a {what}, got {type(item).__name__}")
        item.validate(where)
        yield where, item


def check_pairs(pairs, vocab, max_length=None):
    """ValueError naming the pair and the problem, before anything runs."""
    for where, p in validated(pairs, "pairs", Pair):
        for name, seq, n in (("chosen", p.chosen, p.chosen_prompt_len),
                             ("rejected", p.rejected, p.rejected_prompt_len)):
            if max_length is not None and len(seq) > max_length:
                raise ValueError(f"{where}: {name} has {len(seq)} tokens, more than max_length={max_length}")
            if n == 0 and len(seq) < 2:
                raise ValueError(
                    f"{where}: the {name} response has no predicted token (a sequence's "
                    "first token is never predicted; give a prompt or a longer response)"
                )
            bad = [t for t in seq if not (isinstance(t, (int, np.integer)) and 0 <= t < vocab)]
            if bad:
                raise ValueError(f"{where}: {name} tokens must be ints in [0, {vocab}), got {bad[0]!r}")


class _Run(contextlib.ExitStack):
    """One call's view of the model, with its plans (one per pair shape), inside
    the routed attention and embeddings and the training layers (without
    gradients, their quantized layers alone)."""

    def __init__(self, model, config, scoring, training):
        super().__init__()
        config.validate()
        self.lm, self.config, self.scoring = LM(model), config, scoring
        self.contexts = [routed(model, attention_block(config)), routed_embeddings()]
        self.contexts.append(training_layers() if training else quantized_layers())
        self.plans = {}

    def __enter__(self):
        super().__enter__()
        for c in self.contexts:
            self.enter_context(c)
        return self

    @functools.cached_property
    def compiles(self):
        return compiled.supported(self.lm)

    def plan(self, pair):
        key = (len(pair.chosen), len(pair.rejected), pair.chosen_prompt_len, pair.rejected_prompt_len,
               pair.shares_prompt())
        if key not in self.plans:
            self.plans[key] = plan(self.lm, self.config, pair, self.scoring, lambda: self.compiles)
        return self.plans[key]

    def group_plan(self, group):
        key = ("group", len(group.prompt), tuple(map(len, group.completions)))
        if key not in self.plans:
            self.plans[key] = group_plan(self.lm, self.config, group, lambda: self.compiles)
        return self.plans[key]

    def hidden(self, seqs, plan, stack=None):
        """`sequence_hidden` of `seqs` as `plan` lays them out."""
        return sequence_hidden(self.lm, seqs, plan.prompt_len, segment_size=plan.segment_size,
                               pack=plan.packed, stack=stack, pad_to=plan.pad_to)

    def pair(self, pair, training=True):
        """(plan, sequences, statistics of the hidden states) of a pair."""
        plan = self.plan(pair)
        return plan, sequences(pair, self.scoring), functools.partial(
            _from_hidden, self.lm, pair=pair, plan=plan, scoring=self.scoring, training=training)


def statistics(model, pairs, scoring, config=StackConfig()):
    """Per pair, its statistics (see the module), evaluated, without gradients."""
    with _Run(model, config, scoring, training=False) as run:
        return evaluated(run, (run.pair(pair, training=False) for pair in pairs))


def value_and_grad(model, pairs, scoring, loss, config=StackConfig()):
    """(statistics per pair, gradients): the gradients of the sum over the pairs
    of `loss(i, stats)` with respect to `model.trainable_parameters()` (a tree of
    theirs). Each pair's statistics and the running sum are evaluated before the
    next pair runs."""
    with _Run(model, config, scoring, training=True) as run:
        return differentiated(run, map(run.pair, pairs), loss)


def evaluated(run, units):
    """Per unit `(plan, sequences, stats_of_hidden)`, its statistics, evaluated."""
    out = []
    for plan, seqs, stats_of in units:
        stack = compiled.stack_for(run.lm, backward=False) if plan.compiled else None
        stats = stats_of(*run.hidden(seqs, plan, stack))
        mx.eval(stats)
        out.append(stats)
    return out


def differentiated(run, units, loss):
    """(statistics per unit, gradients of the sum over the units of
    `loss(i, stats)`), one unit at a time (see `value_and_grad`)."""
    grads, out = None, []
    for i, (plan, seqs, stats_of) in enumerate(units):
        if plan.compiled:
            # The loss's autodiff reaches the last hidden states; the compiled
            # layers take their cotangent through the stack.
            stack = compiled.stack_for(run.lm)
            h, rows = run.hidden(seqs, plan, stack)

            def of_hidden(h):
                stats = stats_of(h, rows)
                return loss(i, stats), stats

            (_, stats), ct = mx.value_and_grad(of_hidden)(h)
            g = stack.backward(ct)
        else:
            def of_model():
                # The backward (and a segment's recomputed forward) is built here.
                stats = stats_of(*run.hidden(seqs, plan))
                return loss(i, stats), stats

            (_, stats), g = nn.value_and_grad(run.lm.model, of_model)()
        grads = g if grads is None else tree_map(mx.add, grads, g)
        out.append(tree_map(mx.stop_gradient, stats))
        mx.eval(grads, out[-1])
    return out, grads


def _from_hidden(lm, h, rows, *, pair, plan, scoring, training=True):
    """The statistics of `pair` from the hidden states `h` of `sequence_hidden` and
    its rows. Without `training` no gradient flows: the head skips the state it
    keeps for the backward."""
    seqs = sequences(pair, scoring)
    plens = [pair.chosen_prompt_len, pair.rejected_prompt_len]
    idx, tgt, groups = [], [], []
    for b, seq in enumerate(seqs):
        for j in range(len(seq) - 1):
            resp = j + 1 >= plens[b]
            nll = b == 0 and scoring.nll and (resp or scoring.nll_on_prompt)
            if resp or nll:
                idx.append(rows[b][j])
                tgt.append(seq[j + 1])
                groups.append((b == 0 and resp, b == 1 and resp, nll))
    g = np.array(groups, np.float32)
    lp, ent, top1, mean_logit = token_logprobs(lm, take_rows(h, idx), mx.array(tgt), plan.flash_head,
                                               entropy=scoring.entropy or scoring.token_stats,
                                               entropy_grad=scoring.entropy,
                                               backward=training)
    stats = {}
    for k, (name, sign) in enumerate((("c", 1.0), ("r", 1.0), ("nll", -1.0))):
        mask = mx.array(g[:, k])
        stats[f"{name}_sum"] = sign * (lp * mask).sum()
        stats[f"{name}_n"] = mx.array(float(g[:, k].sum()))
        if scoring.token_stats:
            for key, v in (("ent", ent), ("top1", top1), ("logit", mean_logit)):
                stats[f"{name}_{key}_sum"] = mx.stop_gradient((v.astype(mx.float32) * mask).sum())
    if scoring.entropy:
        for k, name in enumerate(("c", "r")):
            rows_k = np.nonzero(g[:, k])[0]
            stats[f"{name}_ent"] = take_rows(ent, rows_k.tolist()) if rows_k.size else mx.zeros((0,))
            stats[f"{name}_ent_sum"] = stats[f"{name}_ent"].sum()
    return stats


def token_logprobs(lm, h, targets, flash, temperature=1.0, entropy=False, backward=True,
                   entropy_grad=True):
    """(log-probs of `targets`, entropies, is-top-1, mean logits) of the final
    hidden states `h` `[tokens, d]`, of the head's logits divided by
    `temperature`; the last three None without `entropy`. `backward=False`: no
    gradient flows (the flash head skips its preparation). `entropy_grad=False`:
    the entropies are statistics (no gradient flows through them)."""
    h = lm.norm(h)
    if flash:
        # The targets are the batch's tokens, range-checked on the host
        # (`check_pairs`, `check_groups`); the head's own check would evaluate
        # them mid-step.
        x = lm.head_input(h)
        head = functools.partial(linear_logprobs, head=lm.head, targets=targets, softcap=lm.softcap,
                                 validate_targets=False, temperature=temperature)
        if entropy and backward and not entropy_grad and not fused_stats(None):
            # Where the fused forward cannot keep the statistics (the GPU
            # kernels, or the pure-MLX head where a device has none, which on
            # an H200 held 17 of a GRPO update's 21 GB), the log-probs take the
            # fused native head and the statistics a forward without gradient.
            out = head(mx.stop_gradient(x), entropy=True, fused_backward=False)
            return (head(x), mx.stop_gradient(out.entropy), out.is_top1,
                    mx.stop_gradient(out.mean_logit))
        out = head(x, entropy=entropy, fused_backward=backward)
        return (out.logp, out.entropy, out.is_top1, out.mean_logit) if entropy else (out, None, None, None)
    logits = lm.logits(h).astype(mx.float32)
    if temperature != 1.0:
        logits = logits / temperature
    lse = mx.logsumexp(logits, axis=-1)
    picked = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0] - lse
    if not entropy:
        return picked, None, None, None
    # Here the logits exist already (flash_head off): the statistics from them.
    p = mx.softmax(logits, axis=-1)
    return (picked, lse - (p * logits).sum(axis=-1), mx.argmax(logits, axis=-1) == targets,
            logits.mean(axis=-1))
