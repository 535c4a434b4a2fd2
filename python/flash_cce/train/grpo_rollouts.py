"""Recorded rollouts, and what TRL's GRPOTrainer computes from them before the
loss: rewards, advantages and the completion and reward metrics.

`Rollouts` holds, per group (one prompt and its G completions), token ids,
rewards per reward function and whether each completion was truncated;
optionally the behaviour policy's and a reference's per-token log-probs.
`advantages` follows TRL's `_generate_and_score_completions` (float64 here).
"""

import math
import numbers
import warnings
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from ..stack.batch import Group


@dataclass
class Rollouts:
    """A batch of groups as token ids, rewards and flags.

    - `prompts[i]`: group i's prompt tokens,
    - `completions[i][g]`: its g-th completion's tokens (G = `num_generations`),
    - `rewards[i][g][k]`: reward function k's reward of that completion (None or
      NaN: the function did not score it), `reward_names[k]` its name,
    - `truncated[i][g]`: whether the completion ended without EOS,
    - `old_logps[i][g]` (optional): the behaviour policy's log-prob of each
      completion token (of logits / temperature); None: the current policy's
      (on-policy; TRL's `old_per_token_logps` = current, detached),
    - `sampling_logps[i][g]` (optional): the sampler's per-token log-probs, where
      they may differ from the trainer's (TRL's `sampling_per_token_logps`):
      the loss is then corrected by their ratio to the old ones (the
      `vllm_importance_sampling_*` settings),
    - `ref_logps[i][g]` (optional): the reference's per-token log-probs,
      precomputed; None: computed from the `reference` the objective is given,
    - `advantages[i][g]` (optional): advantages computed over a larger generation
      batch (`split`); None: computed from these rewards,
    - `num_items_in_batch` (optional): loss tokens of that generation batch,
      TRL's normalizer of dapo, cispo and vespo; None: these rollouts' own.
    """

    prompts: list
    completions: list
    rewards: list
    reward_names: list
    truncated: list
    old_logps: Optional[list] = None
    sampling_logps: Optional[list] = None
    ref_logps: Optional[list] = None
    advantages: Optional[list] = None
    num_items_in_batch: Optional[int] = None

    def groups(self):
        return [Group(list(p), [list(c) for c in cs]) for p, cs in zip(self.prompts, self.completions)]

    def lengths(self):
        """Completion lengths, flat in group order."""
        return np.array([len(c) for cs in self.completions for c in cs], np.int64)

    def flat_truncated(self):
        return np.array([bool(t) for ts in self.truncated for t in ts])

    def validate(self, cfg, vocab=None):
        """ValueError naming the field, group and completion at fault."""
        n = len(self.prompts) if isinstance(self.prompts, (list, tuple)) else -1
        if n < 1:
            raise ValueError("rollouts.prompts must be a non-empty list (one prompt per group)")
        if not isinstance(self.reward_names, (list, tuple)) or not self.reward_names or not all(
                isinstance(x, str) for x in self.reward_names):
            raise ValueError("rollouts.reward_names must be a non-empty list of strings")
        k = len(self.reward_names)
        if cfg.reward_weights is not None and len(cfg.reward_weights) != k:
            raise ValueError(f"reward_weights has {len(cfg.reward_weights)} weights for {k} reward functions "
                             f"{list(self.reward_names)}")
        per_group = ["completions", "rewards", "truncated"]
        per_group += [f for f in ("old_logps", "sampling_logps", "ref_logps", "advantages")
                      if getattr(self, f) is not None]
        for f in per_group:
            v = getattr(self, f)
            if not isinstance(v, (list, tuple)) or len(v) != n:
                raise ValueError(f"rollouts.{f} must be a list of {n} groups, like prompts")
        G = cfg.num_generations
        for i in range(n):
            where = f"rollouts group {i}"
            p = self.prompts[i]
            if not isinstance(p, (list, tuple)) or not p:
                raise ValueError(f"{where}: the prompt must be a non-empty list of token ids")
            _tokens(p, vocab, f"{where}: prompt")
            for f in per_group:
                if len(getattr(self, f)[i]) != G:
                    raise ValueError(f"{where}: {f} has {len(getattr(self, f)[i])} entries, "
                                     f"expected num_generations={G}")
            for g in range(G):
                c = self.completions[i][g]
                at = f"{where}, completion {g}"
                if not isinstance(c, (list, tuple)) or not c:
                    raise ValueError(f"{at}: must be a non-empty list of token ids")
                if len(c) > cfg.max_completion_length:
                    raise ValueError(f"{at}: {len(c)} tokens, more than max_completion_length="
                                     f"{cfg.max_completion_length}")
                _tokens(c, vocab, at)
                r = self.rewards[i][g]
                if not isinstance(r, (list, tuple)) or len(r) != k or not all(
                        x is None or (isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))
                                      and not math.isinf(x)) for x in r):
                    raise ValueError(f"{at}: rewards must be {k} numbers or None (one per reward function "
                                     f"{list(self.reward_names)}), got {r!r}")
                if not isinstance(self.truncated[i][g], (bool, np.bool_)):
                    raise ValueError(f"{at}: truncated must be True or False, got {self.truncated[i][g]!r}")
                for f in ("old_logps", "sampling_logps", "ref_logps"):
                    v = getattr(self, f)
                    if v is not None and (len(v[i][g]) != len(c) or not np.all(np.isfinite(v[i][g]))):
                        raise ValueError(f"{at}: {f} must be {len(c)} finite log-probs, one per completion token")
                if self.advantages is not None and not math.isfinite(self.advantages[i][g]):
                    raise ValueError(f"{at}: advantages must be finite numbers")
        if self.num_items_in_batch is not None and not (
                isinstance(self.num_items_in_batch, int) and self.num_items_in_batch >= 0):
            raise ValueError(f"rollouts.num_items_in_batch must be None or an integer >= 0, "
                             f"got {self.num_items_in_batch!r}")

    def split(self, n, cfg):
        """`n` parts of whole groups (the micro-batches of `steps_per_generation`),
        each carrying the advantages and loss-token count of the whole batch, as
        TRL's buffered micro-batches do."""
        groups = len(self.prompts)
        if not (isinstance(n, int) and 1 <= n <= groups and groups % n == 0):
            raise ValueError(f"n must divide the {groups} groups, got {n!r}")
        adv, _ = advantages(self, cfg)
        G = cfg.num_generations
        adv = adv.reshape(groups, G).tolist()
        items = self.num_items_in_batch
        if items is None:
            items = int(loss_mask_counts(self, cfg).sum())
        size = groups // n
        out = []
        for s in range(0, groups, size):
            part = {f: (getattr(self, f)[s:s + size] if getattr(self, f) is not None else None)
                    for f in ("prompts", "completions", "rewards", "truncated", "old_logps", "sampling_logps",
                              "ref_logps")}
            out.append(replace(self, **part, advantages=adv[s:s + size], num_items_in_batch=items))
        return out


def _tokens(seq, vocab, where):
    for t in seq:
        if not (isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0
                and (vocab is None or t < vocab)):
            raise ValueError(f"{where}: tokens must be ints in [0, {vocab}), got {t!r}")


def loss_mask_counts(rollouts, cfg):
    """Loss tokens per completion: its length, 0 when truncated and masked."""
    n = rollouts.lengths()
    if cfg.mask_truncated_completions:
        n = np.where(rollouts.flat_truncated(), 0, n)
    return n


def _nanstd(x, axis=None):
    # TRL's nanstd: Bessel-corrected over the non-NaN values, NaN for fewer than two.
    mean = _nanmean(x, axis=axis, keepdims=True)
    var = _nanmean((x - mean) ** 2, axis=axis, keepdims=True)
    count = np.sum(~np.isnan(x), axis=axis, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        var = var * np.where(count > 1, count / (count - 1), np.nan)
    return np.sqrt(var)  # keeps the reduced axes


def _nanmean(x, axis=None, keepdims=False):
    with warnings.catch_warnings():  # an all-NaN slice is NaN, as in torch
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(x, axis=axis, keepdims=keepdims)


def reward_table(rollouts):
    """float64 `[completions, functions]`, NaN where a function gave None."""
    return np.array([[np.nan if r is None else float(r) for r in row]
                     for rows in rollouts.rewards for row in rows], np.float64)


def advantages(rollouts, cfg):
    """(advantages `[completions]` float64 in group order, reward metrics), as TRL.

    Uses `rollouts.advantages` where given (a part of a larger batch, `split`)."""
    per_func = reward_table(rollouts)
    G = cfg.num_generations
    weights = np.ones(per_func.shape[1]) if cfg.reward_weights is None else np.array(cfg.reward_weights, np.float64)
    unscorable = np.isnan(per_func).all(axis=1)
    if cfg.multi_objective_aggregation == "sum_then_normalize":
        rewards = np.nansum(per_func * weights[None], axis=1)
        rewards[unscorable] = np.nan
        mean = np.repeat(_nanmean(rewards.reshape(-1, G), axis=1), G)
        if cfg.scale_rewards in ("group", "none"):
            std = np.repeat(_nanstd(rewards.reshape(-1, G), axis=1)[:, 0], G)
        elif rewards.size > 1:
            std = np.broadcast_to(_nanstd(rewards).reshape(()), rewards.shape)
        else:
            std = np.zeros_like(rewards)
        adv = rewards - mean
        if cfg.scale_rewards != "none":
            adv = adv / (std + 1e-4)
    else:  # normalize_then_sum
        grouped = per_func.reshape(-1, G, per_func.shape[1])
        mean_k = _nanmean(grouped, axis=1, keepdims=True)
        std_k = _nanstd(grouped, axis=1)
        rewards = np.nansum(((grouped - mean_k) / (std_k + 1e-4)).reshape(-1, per_func.shape[1])
                            * weights[None], axis=1)
        rewards[unscorable] = np.nan
        std = np.broadcast_to(_nanstd(rewards).reshape(()), rewards.shape) if rewards.size > 1 \
            else np.zeros_like(rewards)
        adv = (rewards - _nanmean(rewards)) / (std + 1e-4)
    adv = np.nan_to_num(adv, nan=0.0)
    # torch.isclose(std, 0): |std| <= 1e-8 (its default atol); NaN std is not close.
    zero_std = np.abs(std) <= 1e-8
    metrics = {}
    for k, name in enumerate(rollouts.reward_names):
        metrics[f"rewards/{name}/mean"] = _nanmean(per_func[:, k])
        metrics[f"rewards/{name}/std"] = _nanstd(per_func[:, k]).item()
    logged = np.nansum(per_func * weights[None], axis=1)
    logged[unscorable] = np.nan
    metrics["reward"] = _nanmean(logged)
    metrics["reward_std"] = _nanstd(logged).item()
    metrics["frac_reward_zero_std"] = zero_std.astype(np.float64).mean()
    if rollouts.advantages is not None:
        adv = np.array([a for row in rollouts.advantages for a in row], np.float64)
    return adv, {k: float(v) for k, v in metrics.items()}


def completion_metrics(rollouts):
    """TRL's `completions/*` metrics of the batch (lengths in tokens)."""
    n = rollouts.lengths().astype(np.float64)
    truncated = rollouts.flat_truncated()
    term = n[~truncated]
    if term.size == 0:  # as TRL: no terminated completion logs zeros
        term = np.zeros(1)
    return {k: float(v) for k, v in {
        "completions/mean_length": n.mean(),
        "completions/min_length": n.min(),
        "completions/max_length": n.max(),
        "completions/clipped_ratio": truncated.astype(np.float64).mean(),
        "completions/mean_terminated_length": term.mean(),
        "completions/min_terminated_length": term.min(),
        "completions/max_terminated_length": term.max(),
    }.items()}
