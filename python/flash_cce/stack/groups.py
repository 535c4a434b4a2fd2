"""Groups through the stack: one prompt encoded once for its G completions.

`group_logprobs(model, groups, config)` returns, per `Group`, the per-token
log-probs of its completions (and their entropies), and
`group_value_and_grad(model, groups, loss, config)` also differentiates
`loss(i, out)`, group i's share of an objective, summing the gradients of
`model.trainable_parameters()`. A group runs as a pair does (a pair is a group
of two): the prompt once, the completions as one batch after it (or packed
rows), checkpointed segments or compiled layers, the flash head on the
completion tokens only; one group's activations are held at a time.

Per group the output is a dict of float32 arrays `[G, T]`, T its longest
completion, zero past each completion's end:

- `logps`: `log softmax(logits / temperature)` of each completion token,
- `entropy` (with `entropy=True`): the entropy of that softmax at each position
  (differentiable unless `entropy_grad=False`, where it is a statistic: on a
  device whose head kernels have no entropy statistics the log-probs then keep
  the native head and the entropies take a forward without gradient).
"""

import functools

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from .batch import Group
from .compiled import draws_random
from .micro import micro_value_and_grad
from .plan import Scoring, StackConfig
from .rows import take_rows
from .stats import _Run, differentiated, evaluated, token_logprobs, validated


def check_groups(groups, vocab, max_length=None):
    """ValueError naming the group and the problem, before anything runs."""
    for where, grp in validated(groups, "groups", Group):
        for g, seq in enumerate(grp.sequences()):
            if max_length is not None and len(seq) > max_length:
                raise ValueError(f"{where}: completion {g} makes {len(seq)} tokens with the prompt, "
                                 f"more than max_length={max_length}")
            bad = [t for t in seq if not (isinstance(t, (int, np.integer)) and 0 <= t < vocab)]
            if bad:
                raise ValueError(f"{where}: tokens must be ints in [0, {vocab}), got {bad[0]!r}")


def _check_temperature(temperature):
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
            and np.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def _units(run, groups, temperature, entropy, backward, entropy_grad=True):
    for grp in groups:
        plan = run.group_plan(grp)
        yield plan, grp.sequences(), functools.partial(
            _from_hidden, run.lm, group=grp, flash=plan.flash_head, temperature=temperature,
            entropy=entropy, backward=backward, entropy_grad=entropy_grad)


def group_logprobs(model, groups, config=StackConfig(), *, temperature=1.0, entropy=False):
    """Per group, its outputs (see the module), evaluated, without gradients."""
    check_groups(groups, model.args.vocab_size, config.max_length)
    _check_temperature(temperature)
    with _Run(model, config, Scoring(), training=False) as run:
        return evaluated(run, _units(run, groups, temperature, entropy, backward=False))


def group_value_and_grad(model, groups, loss, config=StackConfig(), *, temperature=1.0, entropy=False,
                         entropy_grad=True, micro_group=None):
    """(outputs per group, gradients): the gradients of the sum over the groups
    of `loss(i, out)` with respect to `model.trainable_parameters()`.
    `entropy_grad=False`: the loss takes no gradient through the entropies.
    `micro_group`: completions per pass (None: all of a group's), the prompt
    still encoded once (`micro`); the loss must then be a sum of per-completion
    terms, as GRPO's is. A model with active dropout runs whole groups."""
    check_groups(groups, model.args.vocab_size, config.max_length)
    _check_temperature(temperature)
    if micro_group is not None and not (isinstance(micro_group, int) and not isinstance(micro_group, bool)
                                        and micro_group >= 1):
        raise ValueError(f"micro_group must be None or an integer >= 1, got {micro_group!r}")
    with _Run(model, config, Scoring(), training=True) as run:
        units = _units(run, groups, temperature, entropy, True, entropy_grad)
        if micro_group is None:
            return differentiated(run, units, loss)
        outs, grads = [], None
        for i, (grp, (plan, seqs, stats_of)) in enumerate(zip(groups, units)):
            # Micro-groups continue the prompt's keys/values (two passes, checkpointed
            # autodiff); the prompt runs twice, so dropout would draw two masks.
            if micro_group >= len(grp.completions) or not plan.prompt_len or draws_random(run.lm):
                (out,), g = differentiated(run, [(plan, seqs, stats_of)], lambda _, o, i=i: loss(i, o))
            else:
                out, g = micro_value_and_grad(run, grp, plan, lambda o, i=i: loss(i, o), micro_group,
                                              functools.partial(_outputs_of, stats_of, grp.prompt))
            grads = g if grads is None else tree_map(mx.add, grads, g)
            outs.append(out)
            mx.eval(grads)
        return outs, grads


def _outputs_of(stats_of, prompt, h, rows, completions, width):
    """The outputs of `completions` (after `prompt`), padded to `width` columns."""
    out = stats_of(h, rows, group=Group(prompt, completions))
    return {k: mx.pad(v, [(0, 0), (0, width - v.shape[1])]) for k, v in out.items()}


def _from_hidden(lm, h, rows, *, group, flash, temperature, entropy, backward, entropy_grad):
    p = len(group.prompt)
    width = max(map(len, group.completions))
    idx, tgt = [], []
    for b, c in enumerate(group.completions):
        # rows[b][j] predicts token j + 1 of sequence b: completion token k is j = p + k - 1.
        idx.extend(rows[b][p - 1:p - 1 + len(c)])
        tgt.extend(c)
    lp, ent, _, _ = token_logprobs(lm, take_rows(h, idx), mx.array(tgt), flash, temperature,
                                   entropy, backward, entropy_grad)
    lengths = [len(c) for c in group.completions]
    starts = np.cumsum([0] + lengths[:-1]).tolist()

    def padded(x):
        # [G, width]: each completion's tokens, then zeros (slices and pads: as
        # take_rows, no gather or scatter to build at run time).
        return mx.stack([mx.pad(x[s:s + n], (0, width - n)) for s, n in zip(starts, lengths)])

    out = {"logps": padded(lp)}
    if entropy:
        out["entropy"] = padded(ent)
    return out
