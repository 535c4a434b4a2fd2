"""Friendly layer over the ops: accepts mlx.nn heads and leading batch dimensions."""

import mlx.core as mx
import mlx.nn as nn

from .ops import flash_cce_forward

_REDUCTIONS = ("mean", "sum", "none")


def unpack_head(head, scales=None, biases=None, group_size=64, bits=None):
    """Returns `dict(w, scales, biases, group_size, bits)` for the ops.

    `head` is a weight array `[V, H]` (dense, or packed with `scales`/`biases`),
    or an `nn.Linear`, `nn.QuantizedLinear`, `nn.Embedding` or
    `nn.QuantizedEmbedding` (a tied embedding used as the output head).
    """
    if isinstance(head, mx.array):
        return dict(w=head, scales=scales, biases=biases, group_size=group_size, bits=bits)
    if isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        mode = getattr(head, "mode", "affine")
        if mode != "affine":
            raise ValueError(f"[flash_cce] quantization mode {mode!r} is not supported (affine only)")
        if "bias" in head:
            raise ValueError("[flash_cce] a head with a bias vector is not supported")
        return dict(
            w=head["weight"], scales=head["scales"], biases=head["biases"],
            group_size=head.group_size, bits=head.bits,
        )
    if isinstance(head, (nn.Linear, nn.Embedding)):
        if "bias" in head:
            raise ValueError("[flash_cce] a head with a bias vector is not supported")
        return dict(w=head["weight"], scales=None, biases=None, group_size=group_size, bits=None)
    raise ValueError(
        "[flash_cce] head must be an mx.array, nn.Linear, nn.QuantizedLinear, "
        f"nn.Embedding or nn.QuantizedEmbedding, got {type(head).__name__}"
    )


def linear_logprobs(h, head, targets, *, softcap=None, ignore_index=-100, scales=None,
                    biases=None, group_size=64, bits=None, backend=None, stream=None,
                    validate_targets=True, tuning=None, temperature=1.0, entropy=False,
                    fused_backward=True):
    """`log softmax(softcap(h @ W^T) / temperature)[targets]` per token, shape
    `targets.shape`, float32.

    Rows whose target is `ignore_index` give 0. The `[tokens, V]` logits are
    never built. `validate_targets=False` skips the range check, which reads the
    targets' values (an evaluation), for callers that checked them already.
    With `entropy=True` returns a `TokenStats` (`logp`, `entropy`, `lse`,
    `is_top1`, `mean_logit`). `fused_backward=False` for calls no gradient flows
    through (reference log-probs, evaluation) saves the native forward the work
    it does for the backward. `tuning` overrides the native kernels' choices
    (see `flash_cce_forward`).
    """
    parts = unpack_head(head, scales, biases, group_size, bits)
    out = flash_cce_forward(
        h, parts["w"], targets, parts["scales"], parts["biases"],
        group_size=parts["group_size"], bits=parts["bits"], softcap=softcap,
        ignore_index=ignore_index, backend=backend, stream=stream,
        validate_targets=validate_targets, tuning=tuning, temperature=temperature,
        entropy=entropy, fused_backward=fused_backward,
    )
    return out if entropy else out[0]


def linear_cross_entropy(h, head, targets, reduction="mean", **kwargs):
    """Cross-entropy `-logp` of a linear head; `mean` averages over non-ignored tokens.

    Takes `linear_logprobs`'s keyword arguments. An input whose tokens are all
    ignored gives 0 for `mean` and `sum`.
    """
    if "entropy" in kwargs:
        raise ValueError("[flash_cce] linear_cross_entropy takes no entropy argument; "
                         "use linear_logprobs(..., entropy=True)")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"[flash_cce] reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    nll = -linear_logprobs(h, head, targets, **kwargs)
    if reduction == "none":
        return nll
    total = nll.sum()
    if reduction == "sum":
        return total
    count = (targets != kwargs.get("ignore_index", -100)).sum()
    return total / mx.maximum(count, 1).astype(mx.float32)
