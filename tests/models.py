"""Tiny random mlx-lm models for tests: one factory per architecture, float32 on CPU.

Every model is small enough that a forward and backward over ~40 tokens takes
milliseconds, yet keeps what makes its architecture special: GQA, sliding-window
layers shorter than the test prompts, Gemma's embedding scale and final softcap,
Gemma 4's per-layer inputs and KV-shared layers, MiniCPM's embedding and head scales.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models import gemma3_text, gemma4_text, llama, minicpm, qwen3
from mlx_lm.tuner.utils import linear_to_lora_layers

from flash_cce.stack import StackConfig
from flash_cce.train.objectives import ObjectiveConfig

VOCAB = 97  # odd on purpose: not a multiple of any block or group size

ARCHS = ("llama", "qwen3", "gemma3_text", "gemma4_text", "minicpm")


def _llama(tied):
    return llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        vocab_size=VOCAB, tie_word_embeddings=tied,
    ))


def _qwen3(tied):
    return qwen3.Model(qwen3.ModelArgs(
        model_type="qwen3", hidden_size=64, num_hidden_layers=3, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        vocab_size=VOCAB, max_position_embeddings=512, head_dim=16,
        tie_word_embeddings=tied, rope_theta=10000.0,
    ))


def _gemma3(tied):
    # Window 4 with pattern 2: every other layer slides over fewer tokens than the prompts.
    model = gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=4,
        intermediate_size=96, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        query_pre_attn_scalar=32, vocab_size=VOCAB, sliding_window=4,
        sliding_window_pattern=2,
    ))
    if tied:
        model.sanitize({})  # no lm_head in the weights: mlx-lm ties the head
    return model


def _gemma4(tied, softcap=2.0):
    # A softcap of 2 bends the tiny model's logits (|s| ~ 1-3); 30 would be a no-op.
    return gemma4_text.Model(gemma4_text.ModelArgs(
        hidden_size=64, num_hidden_layers=6, intermediate_size=96,
        num_attention_heads=2, head_dim=32, global_head_dim=64, num_key_value_heads=1,
        num_kv_shared_layers=2, hidden_size_per_layer_input=32, vocab_size=VOCAB,
        vocab_size_per_layer_input=VOCAB, sliding_window=4, sliding_window_pattern=3,
        final_logit_softcapping=softcap, tie_word_embeddings=tied,
    ))


def _minicpm(tied):
    return minicpm.Model(minicpm.ModelArgs(
        model_type="minicpm", hidden_size=64, dim_model_base=16, num_hidden_layers=3,
        intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-5, vocab_size=VOCAB, scale_depth=1.4, scale_emb=12.0,
        tie_word_embeddings=tied,
    ))


_FACTORIES = {
    "llama": _llama, "qwen3": _qwen3, "gemma3_text": _gemma3,
    "gemma4_text": _gemma4, "minicpm": _minicpm,
}


def tiny_model(arch, *, tied=None, seed=0, lora=False, quantize=False):
    """A random float32 model; `tied` defaults to the architecture's usual choice.

    `quantize` makes the base 4-bit (group 32) before LoRA; `lora` adds rank-4
    adapters on every linear layer of every block, with random B so that the
    adapters change the output, and freezes everything else.
    """
    if tied is None:
        tied = arch in ("gemma3_text", "gemma4_text")
    mx.random.seed(seed)
    model = _FACTORIES[arch](tied)
    # Norm weights start at 0 or 1; jitter them so gradients through them are generic.
    params = tree_map(lambda p: p + 0.1 * mx.random.normal(p.shape), model.parameters())
    model.update(params)
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
    if lora:
        model.freeze()
        linear_to_lora_layers(
            model, len(model.layers), {"rank": 4, "scale": 2.0, "dropout": 0.0}
        )
        # LoRA starts with B = 0 (adapters are a no-op); random B makes them count.
        model.update(tree_map(
            lambda p: 0.05 * mx.random.normal(p.shape), model.trainable_parameters()
        ))
    mx.eval(model.parameters())
    return model


def random_pair(rng, prompt_len, chosen_len, rejected_len, *, vocab=VOCAB, same_prompt=True):
    """A `Pair` with random tokens; responses of the given lengths."""
    from flash_cce.stack.batch import Pair

    prompt = rng.integers(0, vocab, prompt_len).tolist()
    other = prompt if same_prompt else rng.integers(0, vocab, prompt_len).tolist()
    chosen = prompt + rng.integers(0, vocab, chosen_len).tolist()
    rejected = other + rng.integers(0, vocab, rejected_len).tolist()
    return Pair(chosen, rejected, prompt_len, prompt_len)


def max_diff(a, b):
    """Max |a - b| over two parameter trees, and max |b| (the scale of the reference)."""
    from mlx.utils import tree_flatten

    fa, fb = dict(tree_flatten(a)), dict(tree_flatten(b))
    assert fa.keys() == fb.keys()
    diff = max(float(mx.abs(fa[k] - fb[k]).max()) for k in fa)
    scale = max(float(mx.abs(fb[k]).max()) for k in fb)
    return diff, scale


def objective(name="orpo", **stack):
    """The ObjectiveConfig of objective `name` whose stack takes the other arguments."""
    return ObjectiveConfig(name=name, stack=StackConfig(**stack))
