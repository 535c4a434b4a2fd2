"""The stack's per-token entropy (Scoring(entropy=True)) and the head's fused
backward state, which the no-gradient statistics leave off."""

import mlx.core as mx
import numpy as np
import pytest

from flash_cce.stack import StackConfig, stats as stack_stats
from flash_cce.stack.plan import Scoring
from models import max_diff, random_pair, tiny_model


def _pairs(seed):
    rng = np.random.default_rng(seed)
    return [random_pair(rng, 6, 5, 3), random_pair(rng, 4, 4, 6, same_prompt=False)]


def _entropies(model, seq, prompt_len):
    """float64 entropy of the model's own next-token softmax at each response token."""
    logits = np.array(model(mx.array([seq]))[0].astype(mx.float32), np.float64)
    z = logits[prompt_len - 1:len(seq) - 1]
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    return -(p * np.log(p)).sum(1), np.abs(z).max()


@pytest.mark.parametrize("arch", ["llama", "gemma4_text"])
@pytest.mark.parametrize("flash", [True, False])
def test_entropy_matches_the_full_logits(arch, flash):
    model = tiny_model(arch)
    pairs = _pairs(0)
    out = stack_stats.statistics(model, pairs, Scoring(entropy=True),
                                 StackConfig(flash_head=flash))
    for pair, st in zip(pairs, out):
        for side, seq, plen in (("c", pair.chosen, pair.chosen_prompt_len),
                                ("r", pair.rejected, pair.rejected_prompt_len)):
            want, zmax = _entropies(model, seq, plen)
            got = np.array(st[f"{side}_ent"])
            assert got.shape == want.shape == (int(st[f"{side}_n"].item()),)
            # The stack's logits agree with the plain forward's to 1e-5 relative
            # (+1e-6; test_prefix's bound for its reorderings): dz <= 1e-5 zmax + 1e-6,
            # and the entropy moves by at most sum_v p_v |z_v - E z| dz <= 2 zmax dz,
            # plus its own fp32 sums over V = 97 terms ((V + 16) u (1 + 2 zmax)).
            dz = 1e-5 * zmax + 1e-6
            tol = 2 * zmax * dz + 113 * 2.0**-24 * (1 + 2 * zmax)
            np.testing.assert_allclose(got, want, rtol=0, atol=tol)
            np.testing.assert_allclose(st[f"{side}_ent_sum"].item(), got.sum(), rtol=1e-6)


def test_entropy_gradient_matches_the_composed_head():
    """A loss with an entropy term: the fused head and the composed logits
    (flash_head=False) give the same gradients. Both are fp32 computations of
    the same function whose sums over V = 97 and H = 64 terms are ordered
    differently: a few (V + H) u relative, 1e-4 with the margin of the layers'
    backward propagating it."""
    model = tiny_model("gemma4_text", lora=True)
    pairs = _pairs(1)

    def loss(i, st):
        return st["c_sum"] - 0.3 * st["c_ent_sum"] + 0.2 * st["r_ent_sum"]

    grads = {}
    for flash in (True, False):
        _, grads[flash] = stack_stats.value_and_grad(
            model, pairs, Scoring(entropy=True), loss, StackConfig(flash_head=flash))
    diff, scale = max_diff(grads[True], grads[False])
    assert scale > 0 and diff <= 1e-4 * max(1.0, scale), diff

    def no_entropy(i, st):
        return st["c_sum"]

    _, plain = stack_stats.value_and_grad(model, pairs, Scoring(entropy=True), no_entropy,
                                          StackConfig())
    diff, _ = max_diff(grads[True], plain)
    assert diff > 1e-3 * scale  # the entropy terms do reach the gradients


def test_statistics_without_gradients_skip_the_fused_state(monkeypatch):
    """statistics() (reference log-probs, evaluation) runs the head with
    fused_backward off; value_and_grad keeps it on."""
    seen = []
    real = stack_stats.linear_logprobs

    def spy(*a, **k):
        seen.append(k["fused_backward"])
        return real(*a, **k)

    monkeypatch.setattr(stack_stats, "linear_logprobs", spy)
    model = tiny_model("llama", lora=True)
    pairs = _pairs(2)
    stack_stats.statistics(model, pairs, Scoring())
    assert seen and not any(seen)
    seen.clear()
    stack_stats.value_and_grad(model, pairs, Scoring(), lambda i, st: st["c_sum"])
    assert seen and all(seen)
