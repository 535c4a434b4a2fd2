"""GRPO's loss as TRL's GRPOTrainer computes it (`_compute_loss`), one group at a time.

Every function here reads one group's arrays `[G, T]` (T: its longest
completion): the current per-token log-probs `lp`, the behaviour policy's `old`,
the reference's `ref`, the loss `mask` (1 on a completion's tokens, 0 past its
end and on a masked truncated completion), the advantages `adv` `[G, 1]` and
an optional entropy mask. `share` is the group's share of the batch loss, which
needs only the batch totals (`Totals`), so the groups can be differentiated one
at a time and the sum of the shares equals TRL's loss over the whole batch.
"""

import math
from dataclasses import dataclass

import mlx.core as mx

from .grpo_config import CLIPPED


@dataclass(frozen=True)
class Totals:
    """What a group's share needs of the whole batch."""

    sequences: int  # completions in the batch (TRL's micro-batch size)
    tokens: int  # loss tokens in the batch (bnpo's normalizer)
    items: int  # loss tokens of the generation batch (dapo / cispo / vespo: num_items_in_batch)
    width: int  # the batch's longest completion (TRL's padded width; vespo's sampler ratio sums over it)
    entropy_tokens: int  # loss tokens the entropy mask keeps (all of them without one)


def _masked_mean_rows(x, mask):
    return (x * mask).sum(-1, keepdims=True) / mx.maximum(mask.sum(-1, keepdims=True), 1.0)


def gamma_weights(cfg, adv, log_ratio, mask, is_ratio=None, width=None):
    """VESPO's phi(w) per sequence `[G, 1]` (TRL's `get_gamma_weights`), no
    gradient; `is_ratio`: the sampler correction's per-token ratio, which TRL
    sums over the batch's padded `width` (its padding holds the ratio of a zero
    log difference)."""
    lower = math.log(1e-8)
    seq = (mx.clip(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdims=True)
    if is_ratio is not None:
        seq = seq + mx.clip(mx.log(is_ratio), lower, 20.0).sum(-1, keepdims=True)
        pad = mx.clip(mx.log(_bounded(cfg, mx.array(1.0))), lower, 20.0)
        seq = seq + (width - is_ratio.shape[-1]) * pad
    log_w = mx.clip(seq, lower, 20.0)
    w = mx.exp(log_w)
    nonneg = adv >= 0
    k = mx.where(nonneg, cfg.vespo_k_pos, cfg.vespo_k_neg)
    lam = mx.maximum(mx.where(nonneg, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg), 1e-4)
    phi = mx.exp(lam + k * log_w - lam * w)
    phi = mx.where(mx.isfinite(phi), phi, 0.0)
    return mx.stop_gradient(phi)


def sampler_ratio(cfg, old, sampling, mask):
    """TRL's importance-sampling ratio of the behaviour policy to the sampler,
    `[G, T]` (token modes) or `[G, 1]` (sequence modes: exp of the summed log
    difference), truncated or masked to [clip_min, clip_max]."""
    diff = (old - sampling) * mask
    if cfg.vllm_importance_sampling_mode.startswith("sequence"):
        diff = diff.sum(-1, keepdims=True)
    return _bounded(cfg, mx.exp(diff))


def _bounded(cfg, ratio):
    low, high = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    if cfg.vllm_importance_sampling_mode.endswith("truncate"):
        return mx.clip(ratio, low, high)
    low = -math.inf if low is None else low
    high = math.inf if high is None else high
    return mx.where((ratio < low) | (ratio > high), 0.0, ratio)


def per_token(cfg, lp, old, ref, mask, adv, entropy_mask=None, sampling=None, is_ratio=None, width=None):
    """(per-token loss, parts): TRL's `per_token_loss` (`[G, T]`, or `[G, 1]` for a
    sequence-level ratio without a token-level term) and the arrays its metrics
    read: `coef_1` (the ratio, capped at `delta` where set), `kl`, `phi`.
    `sampling`: the sampler's log-probs (the off-policy mask reads them);
    `is_ratio`: `sampler_ratio`, which weights the loss; `width`: the batch's
    longest completion."""
    log_ratio = lp - old
    if cfg.importance_sampling_level == "token":
        log_w = log_ratio
    else:
        log_w = _masked_mean_rows(log_ratio, mask)
    coef_1 = mx.exp(log_w)
    kl = None
    if cfg.beta != 0.0:
        d = ref - lp
        kl = mx.exp(d) - d - 1  # k3 estimator of KL(policy || reference)
        if cfg.use_bias_correction_kl:
            kl = kl * coef_1
    phi = None
    if cfg.loss_type == "cispo":
        loss = -mx.stop_gradient(mx.minimum(coef_1, cfg.upper)) * adv * lp
    elif cfg.loss_type in CLIPPED:
        coef_2 = mx.clip(coef_1, 1 - cfg.epsilon_low, 1 + cfg.upper)
        if cfg.delta is not None:
            coef_1 = mx.minimum(coef_1, cfg.delta)
        loss = -mx.minimum(coef_1 * adv, coef_2 * adv)
    elif cfg.loss_type == "sapo":
        t = mx.where(adv > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        loss = -(mx.sigmoid(t * (coef_1 - 1)) * 4 / t) * adv
    else:  # vespo
        phi = gamma_weights(cfg, adv, log_ratio, mask, is_ratio, width)
        loss = -phi * adv * lp
    if cfg.off_policy_mask_threshold is not None:
        # DeepSeek-V3.2's off-policy sequence mask: keep a sequence with a
        # non-negative advantage or a mean KL(old || current) within the threshold.
        seq_kl = _masked_mean_rows((old if sampling is None else sampling) - mx.stop_gradient(lp), mask)
        keep = (adv >= 0) | (seq_kl <= cfg.off_policy_mask_threshold)
        loss = loss * keep.astype(mx.float32)
    if entropy_mask is not None:
        loss = loss * entropy_mask
    if is_ratio is not None and cfg.loss_type != "vespo":
        loss = loss * is_ratio
    if kl is not None:
        loss = loss + cfg.beta * kl
    return loss, {"coef_1": coef_1, "kl": kl, "phi": phi}


def share(cfg, loss, mask, totals):
    """The group's share of the batch loss, aggregated per `cfg.loss_type` as TRL
    (one process; the loss types TRL divides by the accumulation steps are)."""
    kind, steps = cfg.loss_type, cfg.gradient_accumulation_steps
    if kind in ("grpo", "sapo"):
        per_seq = (loss * mask).sum(-1) / mx.maximum(mask.sum(-1), 1.0)
        return per_seq.sum() / totals.sequences / steps
    if kind == "bnpo":
        return (loss * mask).sum() / max(totals.tokens, 1) / steps
    if kind == "dr_grpo":
        return (loss * mask).sum() / (totals.sequences * cfg.max_completion_length) / steps
    if kind in ("dapo", "cispo", "vespo"):
        # num_items_in_batch spans the generation batch: rescaled to one window
        return (loss * mask).sum() / (max(totals.items, 1) * cfg.window_share)
    # luspo: each sequence's masked loss summed over its tokens (a loss of one
    # value per sequence: times its length), a mean over sequences.
    return (loss * mask).sum() / totals.sequences / steps


def entropy_share(cfg, entropy, mask, entropy_mask, totals):
    """The group's share of TRL's entropy bonus term (before `-entropy_coef`):
    the micro-batch's mean entropy over the tokens the policy term keeps, over
    the accumulation steps, whatever the loss type's normalizer."""
    kept = mask if entropy_mask is None else mask * entropy_mask
    return (entropy * kept).sum() / max(totals.entropy_tokens, 1) / cfg.gradient_accumulation_steps


def metric_sums(cfg, parts, mask, adv, entropy):
    """The group's sums behind TRL's loss metrics: name -> (sum, count) of a
    batch mean, and `clip_ratio/low_min` / `high_max`'s per-sequence means."""

    def masked(x):
        if x.shape[-1] == 1:  # one value per sequence: a mean over sequences
            return x.sum(), float(x.shape[0])
        return (x * mask).sum(), mask.sum()

    out = {}
    if parts["kl"] is not None:
        out["kl"] = masked(parts["kl"])
    if entropy is not None:
        out["entropy"] = masked(entropy)
    coef_1 = parts["coef_1"]
    if cfg.loss_type in CLIPPED:
        low = ((coef_1 < 1 - cfg.epsilon_low) & (adv < 0)).astype(mx.float32)
        high = ((coef_1 > 1 + cfg.upper) & (adv > 0)).astype(mx.float32)
        region = mx.maximum(low, high)
        out["clip_ratio/low_mean"] = masked(low)
        out["clip_ratio/high_mean"] = masked(high)
        out["clip_ratio/region_mean"] = masked(region)

        def per_seq(x):  # NaN for a sequence without loss tokens, as TRL's 0 / 0
            return x[:, 0] if x.shape[-1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

        out["seq_low"], out["seq_high"] = per_seq(low), per_seq(high)
    elif cfg.loss_type == "cispo":
        out["cispo_clip_ratio"] = masked(((coef_1 > cfg.upper) & (adv > 0)).astype(mx.float32))
    elif cfg.loss_type == "vespo":
        out["vespo/phi_seq_mean"] = masked(parts["phi"])
    return out
