"""GRPO rollouts on the device: greedy tokens equal mlx-lm generating one
sequence at a time, the sampler's log-probs equal the model's, seeded draws
repeat (and resume), each prompt is prefilled once for its whole group."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load

from flash_cce.train.demo import demo_words
from flash_cce.train.rollout import Rollout, RolloutRng, SamplingSettings, rollout
from flash_cce.train.tiny import build_tiny_model
from flash_cce.train.trainer import prepare_model

G = 3
# Prompts of different lengths, so the batched cache is left-padded.
PROMPTS = ["tom has a red ball . what color is the ball ?", "ana has a cup .", "bob", "zoe has a gold kite ."]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """The tiny model with LoRA adapters whose B is random: the adapters change
    the tokens, so sampling "with the policy" is tested, not the base alone."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("rollout") / "model", demo_words(), seed=0)
    model, tok = load(str(model_dir))
    prepare_model(model, "lora", -1, {"rank": 4, "scale": 20.0, "dropout": 0.0})
    mx.random.seed(1)
    model.update({k: v for k, v in _lora_b(model, 1.0)})
    mx.eval(model.parameters())
    prompts = [tok.encode(p) for p in PROMPTS]
    return model, tok, prompts


def _lora_b(model, scale):
    from mlx.utils import tree_flatten, tree_unflatten

    flat = [(k, mx.random.normal(v.shape) * scale) for k, v in tree_flatten(model.trainable_parameters())
            if k.endswith("lora_b")]
    return tree_unflatten(flat).items()


def _one_at_a_time(model, prompt, n, eos):
    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)):
        out.append(int(tok))
        if out[-1] in eos:
            break
    return out


def test_greedy_equals_one_sequence_at_a_time(policy):
    model, tok, prompts = policy
    s = SamplingSettings(max_completion_length=10, temperature=0)
    ref = [_one_at_a_time(model, p, 10, ()) for p in prompts]
    assert len({tuple(r) for r in ref}) == len(ref) and any(len(set(r)) > 2 for r in ref)  # varied tokens
    eos = [ref[1][4]]  # a token that ends prompt 1's completion early
    ref = [_one_at_a_time(model, p, 10, eos) for p in prompts]
    r = rollout(model, prompts, G, s, eos)
    for group, want in zip(r.completions, ref):
        assert group == [want] * G
    assert r.truncated[1] == [False] * G and r.completions[1][0][-1] == eos[0]
    assert all(t == (c[-1] != eos[0]) for ts, cs in zip(r.truncated, r.completions) for t, c in zip(ts, cs))


def _teacher_forced(model, prompt, completion, temperature):
    """log_softmax(logits / T) at the completion's tokens, one full forward pass."""
    x = mx.array(prompt + completion)[None]
    logits = model(x)[0, len(prompt) - 1:-1].astype(mx.float32) / temperature
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array(mx.take_along_axis(lp, mx.array(completion)[:, None], axis=-1)[:, 0])


@pytest.mark.parametrize("temperature,top_p,top_k,min_p", [(1.0, 1.0, 0, 0.0), (0.7, 0.9, 0, 0.0),
                                                           (1.3, 1.0, 5, 0.05)])
def test_sampler_logprobs_are_the_models(policy, temperature, top_p, top_k, min_p):
    model, tok, prompts = policy
    s = SamplingSettings(max_completion_length=8, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    r = rollout(model, prompts, G, s, [tok.eos_token_id], RolloutRng(3))
    # Bound: both sides are float32 evaluations of the same 2-layer, width-64
    # model whose logits are O(10) here; a dot product of <= 128 terms rounds
    # to within 128 * 2^-24 ~ 8e-6 relative, so the incremental (cached,
    # left-padded) and the full forward pass differ by well under 1e-4 / T
    # in the log-probs after two layers and the head.
    for p, comps, lps in zip(prompts, r.completions, r.logprobs):
        for c, lp in zip(comps, lps):
            assert lp.dtype == np.float32 and lp.shape == (len(c),)
            np.testing.assert_allclose(lp, _teacher_forced(model, p, c, temperature), atol=1e-4 / temperature,
                                       rtol=0)


def test_top_k_one_is_greedy_and_logprobs_are_before_the_filter(policy):
    model, tok, prompts = policy
    greedy = rollout(model, prompts, G, SamplingSettings(max_completion_length=6, temperature=0), [])
    top1 = rollout(model, prompts, G, SamplingSettings(max_completion_length=6, temperature=1.0, top_k=1), [],
                   RolloutRng(5))
    assert top1.completions == greedy.completions
    # After the filter (renormalised) every log-prob would be 0; they are the tempered model's.
    assert max(float(lp.max()) for lps in top1.logprobs for lp in lps) < -1e-3


def test_same_seed_same_rollouts_and_resume(policy):
    model, tok, prompts = policy
    s = SamplingSettings(max_completion_length=8, temperature=1.0)
    a = RolloutRng(7)
    first, second = rollout(model, prompts, G, s, [], a), rollout(model, prompts, G, s, [], a)
    again = RolloutRng(7)
    assert rollout(model, prompts, G, s, [], again).completions == first.completions
    resumed = RolloutRng.from_state(again.state())  # a checkpoint's state after the first draw
    assert rollout(model, prompts, G, s, [], resumed).completions == second.completions
    assert second.completions != first.completions
    other = rollout(model, prompts, G, s, [], RolloutRng(8))
    assert other.completions != first.completions
    # A group's G completions are different draws.
    assert any(len({tuple(c) for c in group}) > 1 for group in first.completions)


def test_a_groups_draws_do_not_depend_on_the_others(policy):
    """Data-parallel ranks sample parts of a step: group 2 alone (with its
    global index) draws what it drew among all four."""
    model, tok, prompts = policy
    s = SamplingSettings(max_completion_length=8, temperature=1.0)
    whole = rollout(model, prompts, G, s, [], RolloutRng(11))
    part = rollout(model, prompts[2:3], G, s, [], RolloutRng(11), group_ids=[2])
    assert part.completions[0] == whole.completions[2]


class Counting:
    """The model, recording the input shape of each call."""

    def __init__(self, model):
        self.model, self.shapes = model, []

    def __call__(self, x, cache=None):
        self.shapes.append(tuple(x.shape))
        return self.model(x, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_each_prompt_is_prefilled_once_per_group(policy):
    model, tok, prompts = policy
    counting = Counting(model)
    r = rollout(counting, prompts, G, SamplingSettings(max_completion_length=5, temperature=1.0), [], RolloutRng(2))
    prefill = [s for s in counting.shapes if s[1] > 1 or s[0] == 1]
    decode = [s for s in counting.shapes if s not in prefill]
    assert prefill == [(1, len(p)) for p in prompts]  # once each, not G times
    assert r.prefill_tokens == sum(len(p) for p in prompts)
    assert decode == [(len(prompts) * G, 1)] * 4 and r.decode_steps == 4  # token 1 comes from the prefill
    assert isinstance(r, Rollout) and all(len(c) == 5 for g in r.completions for c in g)


@pytest.mark.parametrize("field,value,allowed", [("temperature", -1.0, ">= 0"), ("top_p", 0.0, "> 0"),
                                                 ("top_k", -1, ">= 0"), ("min_p", 1.0, "< 1"),
                                                 ("max_completion_length", 0, ">= 1"),
                                                 ("repetition_penalty", 0.0, "> 0")])
def test_bad_settings_name_the_field(policy, field, value, allowed):
    model, tok, prompts = policy
    with pytest.raises(ValueError, match=f"{field}: got .*allowed: .*{allowed}"):
        rollout(model, prompts, G, SamplingSettings(**{field: value}), [])


@pytest.mark.parametrize("settings", [SamplingSettings(temperature=1.0), SamplingSettings(temperature=0.0),
                                      SamplingSettings(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05),
                                      SamplingSettings(temperature=0.9, top_p=0.95, repetition_penalty=1.3),
                                      SamplingSettings(temperature=0.0, repetition_penalty=1.3)])
def test_the_compiled_sampler_draws_what_its_ops_draw_eagerly(settings):
    """The sampler runs as one compiled function; its tokens and log-probs equal, bit for bit, the
    same ops run one by one: log_softmax(logits / T), the repetition penalty and TRL's filters on
    the draw, Gumbel noise from the row's key (high word, step), arg-max."""
    from flash_cce.train.rollout import _filtered, _gumbel_rows, _penalized, _sample

    B, V = 6, 3000
    logits = (mx.random.normal((B, V), key=mx.random.key(3)) * 4).astype(mx.bfloat16)
    high = mx.array(np.arange(B) * 7919 + 11, dtype=mx.uint32)
    penalty = settings.repetition_penalty != 1
    seen = mx.random.bernoulli(0.1, (B, V), key=mx.random.key(4)) if penalty else None
    for t in (0, 1, 77):
        tokens, logps = _sample(logits, settings, high, t, seen)
        x = logits.astype(mx.float32) * (1.0 / (settings.temperature or 1.0))
        lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        d = logits.astype(mx.float32)
        d = _penalized(d, seen, settings.repetition_penalty) if penalty else d
        if settings.temperature == 0:
            want = mx.argmax(d, axis=-1)
        else:
            d = d * (1.0 / settings.temperature)
            d = d - mx.logsumexp(d, axis=-1, keepdims=True)
            keys = mx.stack([high, mx.full(high.shape, t, mx.uint32)], axis=1)
            want = mx.argmax(_filtered(d, settings) + _gumbel_rows(keys, V), axis=-1)
        assert tokens.tolist() == want.tolist()
        assert np.array_equal(np.array(logps), np.array(mx.take_along_axis(lp, want[:, None], axis=-1)[:, 0]))


def _penalized_greedy(model, prompt, n, penalty):
    """Greedy decoding with transformers' repetition penalty, one full forward pass a token, float64:
    the logits of every token in the prompt or the completion so far divided by `penalty`
    (multiplied where negative), then the arg-max."""
    out = []
    for _ in range(n):
        logits = np.array(model(mx.array(prompt + out)[None])[0, -1].astype(mx.float32), dtype=np.float64)
        seen = sorted(set(prompt + out))
        logits[seen] = np.where(logits[seen] < 0, logits[seen] * penalty, logits[seen] / penalty)
        out.append(int(np.argmax(logits)))
    return out


def test_repetition_penalty_shapes_the_draw_not_the_logprobs(policy):
    """Greedy with a penalty picks what transformers' RepetitionPenaltyLogitsProcessor would (a
    float64 transcription over the whole prompt and completion); the log-probs returned stay those
    of logits / T, what TRL's trainer computes for the tokens."""
    model, tok, prompts = policy
    plain = rollout(model, prompts, G, SamplingSettings(max_completion_length=8, temperature=0), [])
    r = rollout(model, prompts, G, SamplingSettings(max_completion_length=8, temperature=0,
                                                    repetition_penalty=2.5), [])
    assert r.completions != plain.completions  # the penalty changed some draws
    for p, group, lps in zip(prompts, r.completions, r.logprobs):
        want = _penalized_greedy(model, p, 8, 2.5)
        assert group == [want] * G
        np.testing.assert_allclose(lps[0], _teacher_forced(model, p, want, 1.0), atol=1e-4)
