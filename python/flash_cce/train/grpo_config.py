"""The settings of GRPO, named as the fields of TRL 1.16.0's `GRPOConfig` with its defaults.

Only the fields that the objective, the advantages or the rollouts use are
here; `validate` raises one ValueError naming the field and its allowed values.
"""

import math
from dataclasses import dataclass, fields
from typing import Optional, Union

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

# Loss types whose loss TRL divides by the gradient accumulation steps; the
# others divide by the generation batch's token count rescaled to one
# accumulation window (`Totals.items` times `window_share`).
PER_STEP_MEAN = ("grpo", "sapo", "bnpo", "dr_grpo", "luspo")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the PPO clip, its clip ratios


@dataclass
class GRPOConfig:
    """GRPO settings; every field is the TRL `GRPOConfig` field of that name
    with TRL's default (docs/grpo.md has the table)."""

    # The objective
    loss_type: str = "dapo"
    beta: float = 0.0  # weight of the k3 KL to the reference; 0: no reference runs
    epsilon: float = 0.2  # lower clip: ratios below 1 - epsilon
    epsilon_high: Optional[float] = None  # upper clip 1 + epsilon_high (cispo: the ratio's cap); None: epsilon
    delta: Optional[float] = None  # two-sided clip: the ratio capped at delta (INTELLECT-2)
    importance_sampling_level: str = "token"
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    use_bias_correction_kl: bool = True  # the KL times the importance ratio (DeepSeek-V3.2)
    off_policy_mask_threshold: Optional[float] = None  # drop negative-advantage sequences whose KL exceeds it
    top_entropy_quantile: float = 1.0  # keep the top quantile of tokens by entropy in the policy term
    mask_truncated_completions: bool = False  # completions without EOS leave the loss
    entropy_coef: float = 0.0  # weight of the mean entropy subtracted from the loss (the bonus)
    # The sampler-vs-trainer correction, where the rollouts carry the sampler's
    # log-probs (TRL applies it to vLLM's): the loss weighted by exp(old - sampler)
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: Optional[float] = 3.0
    vllm_importance_sampling_clip_min: Optional[float] = None
    # Rewards and advantages
    reward_weights: Optional[list] = None  # one per reward function; None: all 1
    multi_objective_aggregation: str = "sum_then_normalize"
    scale_rewards: Union[str, bool] = "group"  # True is "group", False "none" (as TRL maps them)
    # Rollouts and their reuse
    num_generations: int = 8  # completions per prompt (G)
    max_completion_length: int = 512
    temperature: float = 1.0  # sampling temperature; log-probs are of logits / temperature
    top_p: float = 1.0
    top_k: int = 0
    min_p: Optional[float] = None
    repetition_penalty: float = 1.0
    num_iterations: int = 1  # updates per generated batch (mu)
    steps_per_generation: Optional[int] = None  # None: gradient_accumulation_steps
    gradient_accumulation_steps: int = 1  # (TrainingArguments) micro-batches per optimizer step

    def validate(self):
        """Raises ValueError naming the first bad field; maps scale_rewards
        True/False to "group"/"none" as TRL does."""
        if self.scale_rewards is True or self.scale_rewards is False:
            self.scale_rewards = "group" if self.scale_rewards else "none"
        _choice(self, "loss_type", LOSS_TYPES)
        _choice(self, "importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS)
        _choice(self, "scale_rewards", SCALE_REWARDS)
        _choice(self, "multi_objective_aggregation", AGGREGATIONS)
        _choice(self, "vllm_importance_sampling_mode", IS_MODES)
        for name in ("mask_truncated_completions", "use_bias_correction_kl", "vllm_importance_sampling_correction"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        _number(self, "beta", low=0.0)
        _number(self, "epsilon", low=0.0)
        for name in ("epsilon_high", "delta", "off_policy_mask_threshold", "min_p",
                     "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min"):
            if getattr(self, name) is not None:
                _number(self, name, low=0.0, optional=True)
        for name in ("sapo_temperature_neg", "sapo_temperature_pos", "temperature"):
            _number(self, name, low=0.0, strict=True)
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "repetition_penalty"):
            _number(self, name)
        _number(self, "top_entropy_quantile", low=0.0, high=1.0)
        _number(self, "top_p", low=0.0, high=1.0, strict=True)
        _number(self, "entropy_coef")
        for name, low in (("num_generations", 2), ("max_completion_length", 1), ("top_k", 0),
                          ("num_iterations", 1), ("gradient_accumulation_steps", 1)):
            _integer(self, name, low)
        if self.steps_per_generation is not None:
            _integer(self, "steps_per_generation", 1)
        if self.reward_weights is not None and not (
                isinstance(self.reward_weights, (list, tuple))
                and all(_is_number(w) for w in self.reward_weights)):
            raise ValueError(f"reward_weights must be None or a list of numbers, got {self.reward_weights!r}")
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ValueError(f"vllm_importance_sampling_clip_min ({low}) must be less than "
                             f"vllm_importance_sampling_clip_max ({high})")
        truncate = self.vllm_importance_sampling_mode.endswith("truncate")
        if self.vllm_importance_sampling_correction and truncate and low is None and high is None:
            raise ValueError("vllm_importance_sampling_clip_min or vllm_importance_sampling_clip_max must be "
                             "set when vllm_importance_sampling_mode is a *_truncate mode")
        return self

    @property
    def epsilon_low(self):
        return self.epsilon

    @property
    def upper(self):
        """TRL's `epsilon_high`: the upper clip, epsilon where unset."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def window_share(self):
        """gradient_accumulation_steps / steps_per_generation: TRL's rescaling of
        the generation batch's token count (dapo, cispo, vespo) to one
        accumulation window."""
        return self.gradient_accumulation_steps / (self.steps_per_generation or self.gradient_accumulation_steps)

    @property
    def generate_every(self):
        """Optimizer micro-steps one generated batch serves (TRL's `generate_every`)."""
        return (self.steps_per_generation or self.gradient_accumulation_steps) * self.num_iterations

    def needs_old_logps(self):
        """Whether the behaviour policy's log-probs differ from the current ones at
        some update of a generated batch (TRL then computes them after generation;
        otherwise the objective takes the current log-probs, detached)."""
        return self.gradient_accumulation_steps % self.generate_every != 0


def field_names():
    return [f.name for f in fields(GRPOConfig)]


def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _choice(cfg, name, allowed):
    value = getattr(cfg, name)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _number(cfg, name, low=None, high=None, strict=False, optional=False):
    value = getattr(cfg, name)
    ok = _is_number(value)
    if ok and low is not None:
        ok = value > low if strict else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        what = "a finite number"
        if low is not None:
            what += f" {'>' if strict else '>='} {low}"
        if high is not None:
            what += f" and <= {high}"
        raise ValueError(f"{name} must be {'None or ' if optional else ''}{what}, got {value!r}")


def _integer(cfg, name, low):
    value = getattr(cfg, name)
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
