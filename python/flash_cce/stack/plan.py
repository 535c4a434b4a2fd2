"""How the stack runs a pair or a group: the choices of `StackConfig`, resolved
once per shape into a `Plan` that every part of the stack then follows.

A `Plan` fixes the prompt encoded once for both responses and its layout
(`prefix`), the checkpoint segments (`segmented`) or the compiled layers
(`compiled`), the attention's query blocks (`attention`), the rounding of
widths (`pad_to`) and the head. It depends on the pair only through its
lengths, so pairs of one shape share a plan (and the traces of compiled layers).
"""

from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx

from .attention import DEFAULT_BLOCK
from .prefix import packed_layout

# Tokens per pair (chosen + rejected) from which the default checkpoints the
# stack, one layer per segment: of 1, 2 and 3 layers per segment, 1 keeps the
# least memory at about the same time (docs/benchmarks.md); shorter pairs skip
# the recomputation.
SEGMENT_FROM_TOKENS = 1024
DEFAULT_SEGMENT_SIZE = 1

# Tokens per pair from which the default runs the compiled layers on a CUDA GPU,
# where they make long steps faster for a little more memory (docs/stack.md);
# below it the saving is small and each new pair shape costs a trace.
COMPILED_FROM_TOKENS = 8192


@dataclass(frozen=True)
class StackConfig:
    """What the stack may do; None picks (see `plan`)."""

    prefix_sharing: bool = True  # encode a shared prompt once for both responses
    prefix_packing: Optional[bool] = None  # shared-prompt layout: True packed rows, False two passes
    flash_head: bool = True  # log-probs from `linear_logprobs` (no [tokens, V] logits)
    segment_size: Optional[int] = None  # layers per checkpoint segment; 0: off
    compiled_layers: Optional[bool] = None  # gradients layer by layer through compiled layers where supported
    # With compiled_layers None: the default takes them only once this says True
    # (their kernels being built elsewhere, `train.warmup`); None: no condition
    compiled_when: Optional[Callable[[], bool]] = None
    # Round sequence widths up to a multiple and the shared prompt down to one
    # (exact, see `prefix.sequence_hidden`), so that pairs of nearby lengths share shapes
    pad_to: Optional[int] = None
    max_length: Optional[int] = None  # longest sequence accepted (tokens); None: any
    attention_block: Optional[int] = None  # queries per block of the training attention; 0: mlx-lm's

    def validate(self):
        for name in ("prefix_sharing", "flash_head"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("prefix_packing", "compiled_layers"):
            if not (getattr(self, name) is None or isinstance(getattr(self, name), bool)):
                raise ValueError(f"{name} must be None, True or False, got {getattr(self, name)!r}")
        for name, low in (("segment_size", 0), ("pad_to", 1), ("max_length", 2), ("attention_block", 0)):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= low):
                raise ValueError(f"{name} must be None or an integer >= {low}, got {value!r}")
        if not (self.compiled_when is None or callable(self.compiled_when)):
            raise ValueError(f"compiled_when must be None or a function, got {self.compiled_when!r}")


@dataclass(frozen=True)
class Scoring:
    """Which log-probs of a pair its statistics hold (an objective's needs)."""

    rejected: bool = True  # the rejected response runs and is scored
    nll: bool = False  # the chosen sequence's negative log-likelihood
    nll_on_prompt: bool = True  # that NLL over prompt and response, else the response only
    entropy: bool = False  # also the entropy of each scored response token (same head pass)
    token_stats: bool = False  # also the head's entropy, top-1 and mean-logit sums (metrics only)


@dataclass(frozen=True)
class Plan:
    """How one pair runs. `prompt_len`: tokens encoded once for both sequences
    (None: each sequence its own forward); `packed`: their layout (see
    `prefix`); `segment_size`: layers per checkpoint segment (0: none);
    `compiled`: gradients through `compiled`'s layers."""

    prompt_len: Optional[int]
    packed: bool
    pad_to: Optional[int]
    segment_size: int
    compiled: bool
    attention_block: int
    flash_head: bool


def sequences(pair, scoring):
    return [pair.chosen, pair.rejected] if scoring.rejected else [pair.chosen]


def shares(pair, config, scoring):
    """Whether the pair's prompt is encoded once for both responses."""
    return (config.prefix_sharing and scoring.rejected and pair.chosen_prompt_len > 0
            and pair.shares_prompt())


def plan(lm, config, pair, scoring, compiles):
    """The `Plan` of `pair` under `config`, made where the stack runs it (inside
    `attention.routed`, which the packed layout needs). `compiles`: a function
    saying whether `lm` can take `compiled`'s layers, asked only where the plan
    would run them (it walks the model's parameters)."""
    prompt_len = pair.chosen_prompt_len if shares(pair, config, scoring) else None
    return _plan(lm, config, sequences(pair, scoring), prompt_len,
                 len(pair.chosen) + len(pair.rejected), compiles)


def group_plan(lm, config, group, compiles):
    """The `Plan` of a `Group` (as `plan`): its prompt is encoded once for all
    its completions where `config.prefix_sharing` and it has more than one."""
    seqs = group.sequences()
    shared = config.prefix_sharing and len(seqs) > 1
    return _plan(lm, config, seqs, len(group.prompt) if shared else None,
                 sum(map(len, seqs)), compiles)


def _plan(lm, config, seqs, prompt_len, tokens, compiles):
    # `tokens`: the sequences' tokens, the measure of the default thresholds.
    if prompt_len and config.pad_to:
        prompt_len -= prompt_len % config.pad_to
    packed = bool(prompt_len) and packed_layout(lm, seqs, prompt_len, config.prefix_packing)
    segment_size = config.segment_size
    if segment_size is None:
        segment_size = DEFAULT_SEGMENT_SIZE if tokens >= SEGMENT_FROM_TOKENS else 0
    compiled = config.compiled_layers
    if compiled is None:
        compiled = (on_cuda() and tokens >= COMPILED_FROM_TOKENS
                    and (config.compiled_when is None or config.compiled_when()))
    return Plan(prompt_len=prompt_len or None, packed=packed, pad_to=config.pad_to,
                segment_size=segment_size, compiled=bool(compiled and compiles()),
                attention_block=attention_block(config), flash_head=config.flash_head)


def on_cuda():
    """Whether the stack runs on an NVIDIA GPU (MLX's CUDA backend)."""
    return mx.default_device() == mx.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()


def attention_block(config):
    """Queries per block of the training attention (0: mlx-lm's attention)."""
    return DEFAULT_BLOCK if config.attention_block is None else config.attention_block
