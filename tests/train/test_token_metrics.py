"""TRL's token metrics (`entropy`, `mean_token_accuracy`, `logits/chosen|rejected`)
from the fused head against the same quantities computed in float64 from
mlx-lm's full logits, token means taken as TRL 1.16's trainers take them."""

import mlx.core as mx
import numpy as np
import pytest

from flash_cce.stack.batch import Example
from flash_cce.train.objectives import ObjectiveConfig, evaluate, value_and_grad
from models import random_pair, tiny_model

# The head's entropy and mean logit sum float32 terms over a vocabulary of a few
# hundred (error ~1e-6 relative); the float64 reference differs by that plus the
# model's own float32 forward (<= 5e-7 measured for log-probs, test_objectives).
# 1e-5 relative is ~100x float32 epsilon: far below what a wrong token or mask moves (>= 1e-2).
REL = 1e-5


def _token_table(model, seq):
    """Per predicted token of `seq` (targets seq[1:]): entropy, is-top-1, mean logit, float64."""
    logits = np.array(model(mx.array([seq[:-1]]))[0].astype(mx.float32), np.float64)
    z = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
    entropy = -(p * np.log(p)).sum(axis=-1)
    top1 = logits.argmax(axis=-1) == np.array(seq[1:])
    return entropy, top1, logits.mean(axis=-1)


def _close(got, want):
    assert abs(float(got) - want) <= REL * max(1.0, abs(want)), (float(got), want)


def _pairs():
    rng = np.random.default_rng(4)
    return [random_pair(rng, 9, 5, 3), random_pair(rng, 6, 2, 7)]


@pytest.mark.parametrize("flash", [True, False])
def test_pair_objective_token_metrics(flash):
    from dataclasses import replace

    model = tiny_model("llama", lora=True)
    pairs = _pairs()
    cfg = ObjectiveConfig(name="orpo")
    cfg = replace(cfg, stack=replace(cfg.stack, flash_head=flash))
    ent, n_ent, top1, n_c, lc, lr, n_r = 0.0, 0, 0, 0, 0.0, 0.0, 0
    for p in pairs:
        e, t, m = _token_table(model, p.chosen)
        er, _, mr = _token_table(model, p.rejected)
        c, r = slice(p.chosen_prompt_len - 1, None), slice(p.rejected_prompt_len - 1, None)
        ent += e[c].sum() + er[r].sum()
        n_ent += e[c].size + er[r].size
        top1 += t[c].sum()
        n_c += e[c].size
        lc += m[c].sum()
        lr += mr[r].sum()
        n_r += er[r].size
    _, metrics = evaluate(model, pairs, cfg)
    _close(metrics["entropy"], ent / n_ent)
    _close(metrics["mean_token_accuracy"], top1 / n_c)
    _close(metrics["logits/chosen"], lc / n_c)
    _close(metrics["logits/rejected"], lr / n_r)
    # The training step (on the CPU, whose kernels compute them) logs the same values.
    _, _, step = value_and_grad(model, pairs, cfg)
    for k in ("entropy", "mean_token_accuracy", "logits/chosen", "logits/rejected"):
        _close(step[k], float(metrics[k]))


def test_step_metrics_where_the_fused_forward_cannot_keep_them(monkeypatch):
    """As on a GPU, whose fused forward cannot keep the entropy statistics: the
    step takes them from a second head forward without gradient; its metrics,
    loss and gradients equal those of the CPU's fused forward that keeps them."""
    import flash_cce.stack.stats as stats
    from mlx.utils import tree_flatten

    model = tiny_model("llama", lora=True)
    pairs = _pairs()
    cfg = ObjectiveConfig(name="orpo")
    loss, grads, want = value_and_grad(model, pairs, cfg)
    calls = []
    monkeypatch.setattr(stats, "fused_stats", lambda device: calls.append(1) or False)
    loss2, grads2, got = value_and_grad(model, pairs, cfg)
    assert calls
    _close(loss2, float(loss))
    for k in ("entropy", "mean_token_accuracy", "logits/chosen", "logits/rejected"):
        _close(got[k], float(want[k]))
    for (k, a), (_, b) in zip(tree_flatten(grads2), tree_flatten(grads)):
        scale = float(mx.abs(b).max())
        # the same fused head computes the gradient either way (float32 sums)
        assert float(mx.abs(a - b).max()) <= REL * max(1.0, scale), k


def test_sft_token_metrics_are_over_its_loss_tokens():
    model = tiny_model("llama", lora=True)
    pairs = _pairs()
    for on_prompt in (True, False):
        cfg = ObjectiveConfig(name="sft", nll_on_prompt=on_prompt)
        ent = top1 = n = 0
        for p in pairs:
            e, t, _ = _token_table(model, p.chosen)
            s = slice(0 if on_prompt else p.chosen_prompt_len - 1, None)
            ent, top1, n = ent + e[s].sum(), top1 + t[s].sum(), n + e[s].size
        _, metrics = evaluate(model, pairs, cfg)
        _close(metrics["entropy"], ent / n)
        _close(metrics["mean_token_accuracy"], top1 / n)


def test_kto_logits_by_label():
    model = tiny_model("llama", lora=True)
    rng = np.random.default_rng(2)
    examples = [Example(p.chosen, p.chosen_prompt_len, lab)
                for p, lab in ((random_pair(rng, 5, 3, 1), True), (random_pair(rng, 6, 4, 1), False),
                               (random_pair(rng, 4, 2, 1), True))]
    sums = {True: [0.0, 0], False: [0.0, 0]}
    ent = n = 0
    for e in examples:
        h, _, m = _token_table(model, e.tokens)
        s = slice(e.prompt_len - 1, None)
        sums[e.label][0] += m[s].sum()
        sums[e.label][1] += m[s].size
        ent, n = ent + h[s].sum(), n + h[s].size
    _, metrics = evaluate(model, examples, ObjectiveConfig(name="kto", beta=0.2))
    _close(metrics["logits/chosen"], sums[True][0] / sums[True][1])
    _close(metrics["logits/rejected"], sums[False][0] / sums[False][1])
    _close(metrics["entropy"], ent / n)
