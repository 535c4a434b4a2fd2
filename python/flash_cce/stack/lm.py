"""An mlx-lm model seen as embed -> layers -> norm -> head, one layer at a time.

The objectives need what `model(tokens)` hides: the final hidden states (for the
flash head), each layer's keys and values (for prefix sharing) and the layer loop
itself (for checkpointing over segments). `LM` exposes those pieces for the
architectures below and calls mlx-lm's own modules for every layer, so a model
update in mlx-lm changes nothing here unless the loop itself changes.
"""

import mlx.core as mx
import mlx.nn as nn

from .embedding import embed


SUPPORTED = ("llama", "qwen3", "minicpm", "gemma3_text", "gemma4_text")


def model_type(model):
    args = getattr(model, "args", None)
    return getattr(model, "model_type", None) or getattr(args, "model_type", None)


class LM:
    """A layer-by-layer view of an mlx-lm causal LM (see `SUPPORTED`)."""

    def __init__(self, model):
        kind = model_type(model)
        if kind not in SUPPORTED:
            raise ValueError(
                f"model: architecture {kind!r} is not supported; expected one of {SUPPORTED}"
            )
        self.model, self.kind, self.inner = model, kind, model.model
        self.layers = self.inner.layers
        args = model.args
        n = len(self.layers)
        self.windows = [None] * n
        self.sources = [None] * n  # Gemma 4: the layer whose keys/values layer i reuses
        if kind == "llama":
            self.windows = [args.sliding_window if l.use_sliding else None for l in self.layers]
        elif kind == "gemma3_text":
            p = args.sliding_window_pattern
            self.windows = [None if i % p == p - 1 else args.sliding_window for i in range(n)]
        elif kind == "gemma4_text":
            self.windows = [
                args.sliding_window if t == "sliding_attention" else None
                for t in args.layer_types[:n]
            ]
            self.sources = [j if j != i else None for i, j in enumerate(self.inner.previous_kvs)]
        # MiniCPM scales hidden states before an untied head (its tied head does not).
        tied = "lm_head" not in model
        self.head = self.inner.embed_tokens if tied else model.lm_head
        self.head_scale = None
        if kind == "minicpm" and not tied:
            self.head_scale = args.dim_model_base / args.hidden_size
        self.softcap = getattr(model, "final_logit_softcapping", None)
        if self.softcap is None:
            self.softcap = getattr(args, "final_logit_softcapping", None)

    def has_cache(self, i):
        """Whether layer i computes its own keys/values (Gemma 4 shares some)."""
        return self.sources[i] is None

    def embed(self, tokens):
        """Returns `(h, aux)`: the first hidden state and Gemma 4's per-layer inputs
        `[B, L, layers, d]` (None for the others). Both are per-token functions."""
        inner, args = self.inner, self.model.args
        e = embed(inner.embed_tokens, tokens)
        if self.kind == "minicpm":
            return e * args.scale_emb, None
        if self.kind == "gemma3_text":
            # mlx-lm rounds the scale to bfloat16 first; so must we to match it.
            return e * mx.array(args.hidden_size**0.5, mx.bfloat16).astype(e.dtype), None
        if self.kind == "gemma4_text":
            h = e * inner.embed_scale
            aux = None
            if inner.hidden_size_per_layer_input:
                aux = inner._project_per_layer_inputs(h, inner._get_per_layer_inputs(tokens, e))
            return h, aux
        return e, None

    def layer(self, i, h, mask, cache, aux, shared, offset):
        """Runs layer i at position `offset`; returns `(h, kv)`, kv being the keys
        and values later layers may reuse (Gemma 4; None for the others)."""
        if self.kind != "gemma4_text":
            return self.layers[i](h, mask, cache), None
        h, kv, _ = self.layers[i](
            h, mask, cache, per_layer_input=aux, shared_kv=shared,
            offset=mx.array(offset),
        )
        return h, kv

    def norm(self, h):
        return self.inner.norm(h)

    def head_input(self, h):
        return h if self.head_scale is None else h * self.head_scale

    def logits(self, h):
        """Full `[.., V]` logits the way mlx-lm computes them (the non-flash path)."""
        h = self.head_input(h)
        if isinstance(self.head, (nn.Embedding, nn.QuantizedEmbedding)):
            out = self.head.as_linear(h)
        else:
            out = self.head(h)
        if self.softcap is not None:
            out = mx.tanh(out / self.softcap) * self.softcap
        return out


def lora_modules(model):
    """The LoRA adapter modules of `model` (anything with lora_a, lora_b and a scale)."""
    found = []
    for _, m in model.named_modules():
        if "lora_a" in m and "lora_b" in m and hasattr(m, "scale"):
            found.append(m)
    return found


class adapters_off:
    """Context manager: the model computes with its LoRA adapters switched off.

    Sets each adapter's scale to 0 and restores it; DoRA layers are refused
    because a zero scale does not give back their base weight.
    """

    def __init__(self, model):
        self.mods = lora_modules(model)
        if not self.mods:
            raise ValueError(
                "model: the DPO reference is the model with its LoRA adapters switched "
                "off, but the model has no LoRA adapters"
            )
        for m in self.mods:
            if "m" in m and type(m).__name__.startswith("DoRA"):
                raise ValueError("model: DoRA adapters cannot be switched off for DPO")

    def __enter__(self):
        self.saved = [m.scale for m in self.mods]
        for m in self.mods:
            m.scale = 0.0
        return self

    def __exit__(self, *exc):
        for m, s in zip(self.mods, self.saved):
            m.scale = s
        return False
