"""Gradients through the compiled layers (`compiled`) equal MLX's autodiff."""

import mlx.nn as nn
import numpy as np
import pytest

from flash_cce.stack import compiled, layers

from flash_cce.stack import stats
from flash_cce.stack.lm import LM, lora_modules
from flash_cce.train.objectives import evaluate, value_and_grad
from models import ARCHS, max_diff, objective, random_pair, tiny_model

# The compiled layers run the same float32 operations, fused: on the CPU the
# results are equal bit for bit except where quantized layers dequantize (about
# 1e-6 relative), so the segments' tolerance holds: 1e-5 relative (+1e-6).
REL, ABS = 1e-5, 1e-6


def _pairs(seed):
    rng = np.random.default_rng(seed)
    # By default the first takes the two-pass prefix layout, the second packs.
    return [random_pair(rng, 9, 5, 3), random_pair(rng, 4, 3, 6)]


def _near(got, want):
    assert abs(got.item() - want.item()) <= REL * abs(want.item()) + ABS


def _layer_calls(monkeypatch, model):
    """A list that gets an entry each time one of `model`'s layers runs in Python."""
    calls = []
    cls = type(model.layers[0])
    original = cls.__call__
    monkeypatch.setattr(
        cls, "__call__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    )
    return calls


def _close(got, want):
    """(loss, grads, metrics) of `value_and_grad` (grads None: `evaluate`'s pair)."""
    _near(got[0], want[0])
    if want[1] is not None:
        diff, scale = max_diff(got[1], want[1])
        assert diff <= REL * max(1.0, scale) + ABS, diff
    for k, v in want[2].items():
        _near(got[2][k], v)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("share,pack", [(False, None), (True, None), (True, True), (True, False)])
@pytest.mark.parametrize("quantize", [False, True])
def test_compiled_equals_autodiff(arch, share, pack, quantize):
    model = tiny_model(arch, lora=True, quantize=quantize)
    pairs = _pairs(0)
    cfg = dict(prefix_sharing=share, prefix_packing=pack, segment_size=0)
    want = value_and_grad(model, pairs, objective(**cfg))
    got = value_and_grad(model, pairs, objective(compiled_layers=True, **cfg))
    _close(got, want)
    assert compiled.supported(LM(model))


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gemma4_text"])
@pytest.mark.parametrize("share", [True, False])
def test_dequantized_layers(arch, share, monkeypatch):
    """Quantized layers over many rows take `layers.dequantized_linear`, whose
    custom VJP reads the layer's weights when the backward is built: the
    compiled VJP must still hold the layer's own weights then."""
    monkeypatch.setattr(layers, "DENSE_FROM_ROWS", 8)
    model = tiny_model(arch, lora=True, quantize=True)
    pairs = _pairs(5)
    cfg = dict(prefix_sharing=share, segment_size=0)
    want = value_and_grad(model, pairs, objective(**cfg))
    got = value_and_grad(model, pairs, objective(compiled_layers=True, **cfg))
    _close(got, want)


@pytest.mark.parametrize("arch,frozen", [("llama", 1), ("gemma3_text", 1), ("gemma4_text", 3)])
def test_frozen_layer(arch, frozen):
    """A layer without trainable parameters passes the cotangents through (Gemma
    4's layer 3 shares its keys/values with layer 4)."""
    model = tiny_model(arch, lora=True)
    model.layers[frozen].freeze()
    pairs = _pairs(4)
    want = value_and_grad(model, pairs, objective(prefix_sharing=False))
    got = value_and_grad(model, pairs, objective(prefix_sharing=False, compiled_layers=True))
    _close(got, want)
    assert abs(got[1]["model"]["layers"][0]["self_attn"]["q_proj"]["lora_a"]).max() > 0


def test_traced_once_per_shape(monkeypatch):
    """Layers alike share one compiled function, traced on the first step only:
    a second step with the same shapes runs no layer code in Python."""
    model = tiny_model("gemma3_text", lora=True)
    pairs = _pairs(2)
    cfg = objective(prefix_sharing=False, compiled_layers=True)
    value_and_grad(model, pairs, cfg)
    calls = _layer_calls(monkeypatch, model)
    value_and_grad(model, pairs, cfg)
    assert calls == []
    # Sliding-window and global layers: two groups for the model's layers.
    assert len(compiled.stack_for(LM(model)).groups) == 2


def test_trace_keyed_by_attention_routing(monkeypatch):
    """A trace made under one attention routing is not reused under another: the
    layers run in Python again (a new trace), and the results stay exact."""
    model = tiny_model("gemma3_text", lora=True)
    pairs = _pairs(3)
    calls = _layer_calls(monkeypatch, model)
    for block, traces in ((0, True), (4, True), (0, False)):
        cfg = dict(prefix_sharing=False, attention_block=block)
        want = value_and_grad(model, pairs, objective(segment_size=0, **cfg))
        calls.clear()
        got = value_and_grad(model, pairs, objective(compiled_layers=True, **cfg))
        assert bool(calls) == traces, block
        _close(got, want)


def test_full_fine_tuning_takes_autodiff():
    """Trainable parameters outside the layers (here the embeddings): the
    compiled layers cannot give their gradients, so the step keeps autodiff."""
    model = tiny_model("gemma3_text")
    assert not compiled.supported(LM(model))
    pairs = _pairs(6)
    want = value_and_grad(model, pairs, objective(segment_size=0))
    got = value_and_grad(model, pairs, objective(compiled_layers=True, segment_size=0))
    _close(got, want)


@pytest.mark.parametrize("arch", ["llama", "gemma4_text"])
def test_prompt_without_continuation(arch):
    """Responses of one token each: the two-pass layout runs the prompt alone,
    and the keys/values it records get zero cotangents."""
    model = tiny_model(arch, lora=True)
    rng = np.random.default_rng(7)
    pairs = [random_pair(rng, 6, 1, 1)]
    cfg = dict(prefix_packing=False, segment_size=0)
    want = value_and_grad(model, pairs, objective(**cfg))
    got = value_and_grad(model, pairs, objective(compiled_layers=True, **cfg))
    _close(got, want)


def test_failed_step_leaves_nothing(monkeypatch):
    """A step that fails after the layers' forward does not leak its passes
    into the next step's backward."""
    model = tiny_model("llama", lora=True)
    pairs = _pairs(8)
    cfg = objective(compiled_layers=True)
    want = value_and_grad(model, pairs, cfg)

    def fail(*a, **k):
        raise RuntimeError("loss failed")

    with monkeypatch.context() as m:
        m.setattr(stats, "_from_hidden", fail)
        with pytest.raises(RuntimeError):
            value_and_grad(model, pairs, cfg)
    _close(value_and_grad(model, pairs, cfg), want)


def test_settings_are_part_of_the_trace():
    """Python numbers the layers read (here the LoRA scales) are baked into a
    trace: a change makes new traces, so the gradients follow it."""
    model = tiny_model("gemma3_text", lora=True)
    pairs = _pairs(9)
    cfg = dict(prefix_sharing=False, segment_size=0)
    value_and_grad(model, pairs, objective(compiled_layers=True, **cfg))
    for m in lora_modules(model):
        m.scale = 0.5
    want = value_and_grad(model, pairs, objective(**cfg))
    got = value_and_grad(model, pairs, objective(compiled_layers=True, **cfg))
    _close(got, want)


def test_dropout_takes_autodiff():
    model = tiny_model("llama", lora=True)
    lm = LM(model)
    assert compiled.supported(lm)
    model.layers[0].self_attn.q_proj.dropout = nn.Dropout(0.1)
    assert not compiled.supported(lm)
    model.eval()
    assert compiled.supported(lm)


@pytest.mark.parametrize("arch", ["gemma3_text", "gemma4_text"])
def test_evaluate_and_dpo_reference(arch):
    """Forwards without gradients (`evaluate`, DPO's reference with the adapters
    off) through the compiled layers equal MLX's."""
    model = tiny_model(arch, lora=True)
    pairs = _pairs(10)
    for name in ("orpo", "dpo"):
        cfg = dict(name=name, segment_size=0)
        loss, metrics = evaluate(model, pairs, objective(**cfg))
        got_loss, got_metrics = evaluate(model, pairs, objective(compiled_layers=True, **cfg))
        _close((got_loss, None, got_metrics), (loss, None, metrics))
        want = value_and_grad(model, pairs, objective(**cfg))
        got = value_and_grad(model, pairs, objective(compiled_layers=True, **cfg))
        _close(got, want)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("pack", [None, False])
def test_padded_widths_are_exact(arch, pack):
    """`pad_to` rounds the padded widths up (after every real token): the same
    loss, metrics and gradients, through autodiff and the compiled layers."""
    model = tiny_model(arch, lora=True)
    pairs = _pairs(11)
    want = value_and_grad(model, pairs, objective(prefix_packing=pack, segment_size=0))
    for compiled_layers in (False, True):
        got = value_and_grad(model, pairs, objective(
            prefix_packing=pack, segment_size=0, pad_to=8, compiled_layers=compiled_layers))
        _close(got, want)


@pytest.mark.parametrize("pack", [True, False])
def test_prompt_lengths_in_one_multiple_share_traces(monkeypatch, pack):
    """With `pad_to` the shared prompt is rounded down to a multiple (its last
    tokens go with each response): pairs whose prompts differ in length inside
    one multiple take the same shapes, and reuse one trace."""
    model = tiny_model("llama", lora=True)
    rng = np.random.default_rng(13)
    cfg = objective(compiled_layers=True, pad_to=8, prefix_packing=pack)
    first = random_pair(rng, 17, 5, 6)
    value_and_grad(model, [first], cfg)
    calls = _layer_calls(monkeypatch, model)
    second = random_pair(rng, 21, 2, 3)
    got = value_and_grad(model, [second], cfg)
    assert calls == []
    _close(got, value_and_grad(model, [second], objective(prefix_packing=pack)))


def test_padded_widths_share_traces(monkeypatch):
    """Pairs whose widths round to the same multiple reuse one trace."""
    model = tiny_model("llama", lora=True)
    rng = np.random.default_rng(12)
    cfg = objective(prefix_sharing=False, compiled_layers=True, pad_to=16)
    value_and_grad(model, [random_pair(rng, 5, 4, 3)], cfg)
    calls = _layer_calls(monkeypatch, model)
    value_and_grad(model, [random_pair(rng, 6, 7, 2)], cfg)
    assert calls == []


def test_layers_start_evaluating_as_built(monkeypatch):
    """Each layer's results go to `mx.async_eval` as its call is built (forward and
    backward); inside a transformation, where MLX refuses that, the layers still run."""
    import mlx.core as mx

    model = tiny_model("gemma3_text", lora=True)
    pairs = _pairs(10)
    cfg = objective(compiled_layers=True, prefix_sharing=False, segment_size=0)
    want = value_and_grad(model, pairs, objective(prefix_sharing=False, segment_size=0))
    started = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: started.append(len(a)) or real(*a))
    _close(value_and_grad(model, pairs, cfg), want)
    # two pairs, one forward each: a call per layer forward and per layer backward
    assert len(started) == 2 * 2 * len(model.layers)

    stack = compiled.stack_for(LM(model), backward=False)
    h = mx.array(np.random.default_rng(0).standard_normal((1, 6, model.args.hidden_size)),
                 mx.float32)
    outside = stack.forward(h)[0].sum()
    inside, _ = mx.value_and_grad(lambda h: stack.forward(h)[0].sum())(h)
    _near(inside, outside)
