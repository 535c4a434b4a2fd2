"""Prefix sharing, in both layouts (packed rows, or a prompt forward and a
batched continuation), equals two forwards."""

import mlx.core as mx
import numpy as np
import pytest

from flash_cce.stack import StackConfig
from flash_cce.stack import caches, prefix
from flash_cce.stack.attention import routed
from flash_cce.stack.batch import Pair
from flash_cce.stack.lm import LM
from flash_cce.train.objectives import ObjectiveConfig, value_and_grad
from flash_cce.stack.prefix import sequence_hidden
from models import ARCHS, max_diff, random_pair, tiny_model

# float32 rounding: the continuation's attention sums the same terms as the
# one-shot forward but in another order (prompt keys and new keys in separate
# blocks); measured |diff| <= 5e-7 on O(1) values. 1e-5 relative (+1e-6) is
# ~100 float32 epsilons, far below a wrong position or mask (>= 1e-2).
REL, ABS = 1e-5, 1e-6


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_hidden_states_equal_mlx_lm_forward(arch):
    """Prompt 9 tokens > sliding window 4, so windowed layers see a clipped prompt."""
    model = tiny_model(arch)
    lm = LM(model)
    pair = random_pair(np.random.default_rng(0), 9, 6, 3)
    seqs = [pair.chosen, pair.rejected]
    for prompt_len in (9, None):
        h, rows = sequence_hidden(lm, seqs, prompt_len)
        for seq, r in zip(seqs, rows):
            got = lm.norm(h[mx.array(r)])
            want = model.model(mx.array([seq[:-1]]))[0]
            diff = float(mx.abs(got - want).max())
            assert diff <= REL * max(1.0, float(mx.abs(want).max())) + ABS, (prompt_len, diff)


@pytest.mark.parametrize("block", [0, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_hidden_states_equal_mlx_lm_forward(arch, block):
    """The packed layout with MLX's attention (block 0) and the blocked one (4),
    prompt 9 > window 4, responses shorter and longer than the prompt."""
    model = tiny_model(arch)
    lm = LM(model)
    pair = random_pair(np.random.default_rng(0), 9, 6, 12)
    seqs = [pair.chosen, pair.rejected]
    with routed(model, block):
        h, rows = sequence_hidden(lm, seqs, 9, pack=True)
    for seq, r in zip(seqs, rows):
        got = lm.norm(h[mx.array(r)])
        want = model.model(mx.array([seq[:-1]]))[0]
        diff = float(mx.abs(got - want).max())
        assert diff <= REL * max(1.0, float(mx.abs(want).max())) + ABS, diff


def test_packed_layout_needs_routed_attention():
    model = tiny_model("llama")
    pair = random_pair(np.random.default_rng(0), 4, 4, 4)
    with pytest.raises(ValueError, match="pack=True needs"):
        sequence_hidden(LM(model), [pair.chosen, pair.rejected], 4, pack=True)
    with pytest.raises(ValueError, match="prefix_packing"):
        value_and_grad(model, [pair], ObjectiveConfig(stack=StackConfig(prefix_packing="yes")))


def test_packing_pays():
    assert prefix.packing_pays(8, [8, 7])  # 24 tokens packed vs 32
    assert prefix.packing_pays(6, [8, 2])  # 24 vs 28
    assert not prefix.packing_pays(2, [8, 8])  # 24 vs 20
    assert not prefix.packing_pays(20, [4, 3])  # 60 vs 48
    assert not prefix.packing_pays(5, [0, 0])


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_loss_and_grads_equal_two_forwards(arch, monkeypatch):
    """Prompt and responses of similar length: value_and_grad packs them, also
    under segments (a Gemma 4 layer reading shared keys/values of another segment)."""
    model = tiny_model(arch, lora=True)
    rng = np.random.default_rng(4)
    pairs = [random_pair(rng, 7, 8, 6), random_pair(rng, 5, 5, 5)]
    packed = []
    monkeypatch.setattr(caches.PackedCache, "__init__",
                        lambda self, offsets: packed.append(1) or setattr(self, "offset", offsets))
    two = value_and_grad(model, pairs, ObjectiveConfig(stack=StackConfig(prefix_sharing=False)))
    assert not packed
    for seg in (0, 1):
        shared = value_and_grad(model, pairs, ObjectiveConfig(stack=StackConfig(segment_size=seg)))
        assert abs(shared[0].item() - two[0].item()) <= REL * abs(two[0].item()) + ABS
        diff, scale = max_diff(shared[1], two[1])
        assert diff <= REL * max(1.0, scale) + ABS, (seg, diff)
    assert packed


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_loss_and_grads_equal_two_forwards(arch):
    model = tiny_model(arch, lora=True)
    rng = np.random.default_rng(1)
    pairs = [random_pair(rng, 9, 5, 3), random_pair(rng, 6, 1, 4), random_pair(rng, 5, 1, 1)]
    shared = value_and_grad(model, pairs, ObjectiveConfig(stack=StackConfig(prefix_sharing=True)))
    two = value_and_grad(model, pairs, ObjectiveConfig(stack=StackConfig(prefix_sharing=False)))
    assert abs(shared[0].item() - two[0].item()) <= REL * abs(two[0].item()) + ABS
    diff, scale = max_diff(shared[1], two[1])
    assert diff <= REL * max(1.0, scale) + ABS, diff
    assert shared[2]["prefix_fallbacks"].item() == 0
    assert two[2]["prefix_fallbacks"].item() == 0  # sharing was off: nothing fell back


def test_fallback_is_per_pair_and_counted():
    model = tiny_model("gemma3_text", lora=True)
    p = random_pair(np.random.default_rng(2), 6, 3, 3)
    longer = Pair(p.chosen, p.chosen[:6] + [1] + p.rejected[6:], 6, 7)  # prompts differ in length
    pairs = [p, longer, random_pair(np.random.default_rng(3), 6, 2, 2, same_prompt=False)]
    shared = value_and_grad(model, pairs, ObjectiveConfig())
    two = value_and_grad(model, pairs, ObjectiveConfig(stack=StackConfig(prefix_sharing=False)))
    assert shared[2]["prefix_fallbacks"].item() == 2
    diff, scale = max_diff(shared[1], two[1])
    assert diff <= REL * max(1.0, scale) + ABS
