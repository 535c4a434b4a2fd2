"""Groups (one prompt, G completions) through the stack equal G independent
forwards of mlx-lm's own model, in values and gradients, in every layout."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from flash_cce.stack import StackConfig, compiled
from flash_cce.stack.batch import Group
from flash_cce.stack.groups import check_groups, group_logprobs, group_value_and_grad
from flash_cce.stack.prefix import packing_pays
from flash_cce.stack.stats import statistics
from flash_cce.stack.plan import Scoring
from flash_cce.stack.batch import Pair
from models import ARCHS, VOCAB, max_diff, tiny_model

# Tolerance as tests/train/test_objectives.py: the shared prompt, the packed or
# continued layout and the flash head reorder float32 sums over <= 100 terms
# through <= 6 layers (measured differences <= 5e-7 on values ~1); 1e-5
# relative to the largest reference entry, plus 1e-6, is ~100 float32 epsilons
# and far below a wrong position, mask or token (>= 1e-2).
REL, ABS = 1e-5, 1e-6


def _group(rng, prompt_len, lengths):
    return Group(rng.integers(0, VOCAB, prompt_len).tolist(),
                 [rng.integers(0, VOCAB, n).tolist() for n in lengths])


def _groups(seed=0):
    # A prompt longer than the sliding windows (4); completions shorter and
    # longer than the prompt, one of a single token.
    rng = np.random.default_rng(seed)
    return [_group(rng, 9, (5, 1, 12, 3)), _group(rng, 6, (2, 7, 4))]


def _full(model, grp, temperature=1.0):
    """Per completion: log-probs and entropies of its tokens from mlx-lm's full
    forward over prompt + completion (one sequence at a time), float32."""
    out = []
    p = len(grp.prompt)
    for seq in grp.sequences():
        logits = model(mx.array([seq[:-1]]))[0].astype(mx.float32)[p - 1:] / temperature
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(lp, mx.array(seq[p:])[:, None], axis=-1)[:, 0]
        ent = -(mx.exp(lp) * lp).sum(-1)
        out.append((picked, ent))
    return out


def _close(got, want):
    got, want = np.array(got), np.array(want)
    diff = float(np.abs(got - want).max())
    assert diff <= REL * max(1.0, float(np.abs(want).max())) + ABS, diff


LAYOUTS = {
    "packed": dict(prefix_packing=True),
    "two_passes": dict(prefix_packing=False),
    "segmented": dict(prefix_packing=False, segment_size=1),
    "unshared": dict(prefix_sharing=False),
    "compiled": dict(compiled_layers=True, segment_size=0),
}


# Every architecture in both shared layouts; the other layouts on one (they
# change how layers run, not what an architecture computes).
CASES = [(a, l) for a in ARCHS for l in ("packed", "two_passes")] + [
    ("llama", l) for l in ("segmented", "unshared", "compiled")] + [("gemma4_text", "compiled")]


@pytest.mark.parametrize("arch, layout", CASES)
def test_group_logprobs_equal_independent_forwards(arch, layout):
    model = tiny_model(arch)
    groups = _groups()
    outs = group_logprobs(model, groups, StackConfig(**LAYOUTS[layout]))
    for grp, out in zip(groups, outs):
        assert out["logps"].shape == (len(grp.completions), max(map(len, grp.completions)))
        for g, (lp, _) in enumerate(_full(model, grp)):
            n = lp.shape[0]
            _close(out["logps"][g, :n], lp)
            assert float(mx.abs(out["logps"][g, n:]).max() if n < out["logps"].shape[1] else 0) == 0.0


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_group_entropy_and_temperature_equal_full_logits(temperature, flash):
    model = tiny_model("gemma4_text")  # softcap: temperature divides the capped logits
    groups = _groups(1)
    outs = group_logprobs(model, groups, StackConfig(flash_head=flash), temperature=temperature,
                          entropy=True)
    for grp, out in zip(groups, outs):
        for g, (lp, ent) in enumerate(_full(model, grp, temperature)):
            n = lp.shape[0]
            _close(out["logps"][g, :n], lp)
            _close(out["entropy"][g, :n], ent)


def _weights(groups, seed=3):
    rng = np.random.default_rng(seed)
    return [mx.array(rng.normal(size=(len(g.completions), max(map(len, g.completions)))).astype(np.float32))
            for g in groups]


@pytest.mark.parametrize("arch, layout", [("llama", l) for l in LAYOUTS] + [
    ("gemma4_text", "packed"), ("gemma4_text", "compiled")])
def test_group_gradients_equal_independent_forwards(arch, layout):
    """A nonlinear loss of each group's per-token log-probs: its gradient through
    the groups (one at a time) equals plain autodiff through G forwards each."""
    model = tiny_model(arch, lora=True)
    groups = _groups(2)
    weights = _weights(groups)

    def loss_of(i, lp):
        return (weights[i] * mx.tanh(lp)).sum() / 7.0

    def loss(i, out):
        return loss_of(i, out["logps"])

    outs, grads = group_value_and_grad(model, groups, loss, StackConfig(**LAYOUTS[layout]))

    def plain():
        total = mx.array(0.0)
        for i, grp in enumerate(groups):
            width = weights[i].shape[1]
            rows = [mx.concatenate([lp, mx.zeros((width - lp.shape[0],))]) for lp, _ in _full(model, grp)]
            total = total + loss_of(i, mx.stack(rows))
        return total

    _, want = nn.value_and_grad(model, plain)()
    diff, scale = max_diff(grads, want)
    assert diff <= REL * max(1.0, scale) + ABS, (diff, scale)


@pytest.mark.parametrize("arch, micro, layout", [("llama", 1, "two_passes"), ("llama", 3, "segmented"),
                                                 ("gemma4_text", 2, "packed"), ("qwen3", 2, "compiled"),
                                                 ("gemma4_text", 1, "compiled")])
def test_micro_groups_equal_the_whole_group(arch, micro, layout, monkeypatch):
    """Completions a few at a time around one prompt pass: the same outputs and
    gradients (of a loss that sums per-completion terms) as plain autodiff.
    With compiled layers each continuation is taken back through them alone
    (Gemma 4: layers sharing keys/values; micro-groups of one: a one-token
    completion has no continuation pass)."""
    model = tiny_model(arch, lora=True)
    groups = _groups(2)
    weights = _weights(groups)
    taken_back = []
    latest = compiled.Stack.backward_latest
    monkeypatch.setattr(compiled.Stack, "backward_latest",
                        lambda self, ct: taken_back.append(ct.shape) or latest(self, ct))

    def loss(i, out):
        return (weights[i] * mx.tanh(out["logps"])).sum() / 7.0

    outs, grads = group_value_and_grad(model, groups, loss, StackConfig(**LAYOUTS[layout]), micro_group=micro)
    # One continuation per micro-group with a token to continue from.
    want_passes = sum(any(len(c) > 1 for c in grp.completions[lo:lo + micro])
                      for grp in groups for lo in range(0, len(grp.completions), micro))
    assert len(taken_back) == (want_passes if layout == "compiled" else 0)

    def plain():
        total = mx.array(0.0)
        for i, grp in enumerate(groups):
            width = weights[i].shape[1]
            rows = [mx.concatenate([lp, mx.zeros((width - lp.shape[0],))]) for lp, _ in _full(model, grp)]
            total = total + (weights[i] * mx.tanh(mx.stack(rows))).sum() / 7.0
        return total

    _, want = nn.value_and_grad(model, plain)()
    diff, scale = max_diff(grads, want)
    assert diff <= REL * max(1.0, scale) + ABS, (diff, scale)
    for grp, out in zip(groups, outs):
        for g, (lp, _) in enumerate(_full(model, grp)):
            _close(out["logps"][g, :lp.shape[0]], lp)


def test_micro_groups_leave_dropout_to_whole_groups(monkeypatch):
    """With active dropout the prompt's two runs would draw two masks: whole groups."""
    import flash_cce.stack.groups as groups_module

    model = tiny_model("llama", lora=True)
    called = []
    monkeypatch.setattr(groups_module, "micro_value_and_grad", lambda *a, **k: called.append(1))
    loss = lambda i, out: out["logps"].sum()  # noqa: E731
    for dropout, want in ((0.0, True), (0.5, False)):
        for _, m in model.named_modules():
            if isinstance(m, nn.Dropout):
                m._p_1 = 1 - dropout
        called.clear()
        try:
            group_value_and_grad(model, _groups(2)[:1], loss, micro_group=1)
        except (TypeError, ValueError):  # the stand-in returns nothing
            pass
        assert bool(called) == want, dropout


def test_a_pair_is_a_group_of_two():
    """The pair path's summed log-probs equal the group path's for G = 2."""
    model = tiny_model("qwen3")
    rng = np.random.default_rng(4)
    grp = _group(rng, 7, (4, 6))
    pair = Pair(*grp.sequences(), 7, 7)
    (stats,) = statistics(model, [pair], Scoring())
    (out,) = group_logprobs(model, [grp])
    _close(out["logps"][0].sum(), stats["c_sum"])
    _close(out["logps"][1].sum(), stats["r_sum"])


def test_packing_pays_generalises_the_pair_rule():
    # A pair: 3 rows of the widest against 2 forwards of prompt + longest.
    for p, w in [(8, [8, 8]), (8, [2, 30]), (30, [2, 3]), (5, [5, 4])]:
        assert packing_pays(p, w) == (3 * max([p] + w) <= 2 * (p + max(w)))
    # G = 8 completions as long as the prompt: 9 rows of P against 8 of 2P.
    assert packing_pays(16, [16] * 8)
    assert not packing_pays(40, [4] * 8)  # 9 x 40 > 8 x 44
    assert packing_pays(30, [5] * 8)  # 9 x 30 <= 8 x 35, where the pair rule (3 x 30 > 2 x 35) would not


@pytest.mark.parametrize("bad, match", [
    ([], "non-empty list"),
    ([Group([], [[1]])], "prompt must be a non-empty"),
    ([Group([1], [])], "completions must be a non-empty"),
    ([Group([1], [[2], []])], r"completions\[1\] must be a non-empty"),
    ([Group([1], [[VOCAB]])], r"tokens must be ints in \[0, 97\)"),
    ([Pair([1, 2], [1, 3], 1, 1)], "must be a flash_cce.stack.batch.Group"),
])
def test_bad_groups_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        check_groups(bad, VOCAB)


def test_bad_temperature_is_named():
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        group_logprobs(tiny_model("llama"), _groups(), temperature=0.0)
