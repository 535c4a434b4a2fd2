"""grpo_value_and_grad against a float64 transcription of TRL's GRPOTrainer.

The reference below is written after TRL's `GRPOTrainer._generate_and_score_completions`
(rewards, advantages, completion metrics) and `_compute_loss` (the loss of each
loss type and its metrics), read in TRL 1.16.0's `trl/trainer/grpo_trainer.py`
(its wheel) and `grpo_config.py` (the defaults). It runs on
TRL's own layout, a `[sequences, T]` batch padded to the longest completion,
with per-token log-probs from mlx-lm's `model(tokens)` logits, and shares
nothing with flash_cce but the model. Gradients are checked against plain MLX
autodiff of the same transcription (`xp = mx`) through `model(tokens)`.
"""

import math
import warnings
from dataclasses import asdict

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from flash_cce.stack import StackConfig
from flash_cce.train.grpo import (GRPOConfig, Rollouts, behaviour_logps, grpo_loss_and_metrics,
                                  grpo_value_and_grad, reference_logps)
from flash_cce.train.reference import AdaptersOff, FrozenModel, Precomputed
from flash_cce.stack.lm import adapters_off
from models import VOCAB, max_diff, tiny_model

# Values: the stack's log-probs differ from the full forward's by float32
# reorderings (<= 5e-7 measured, tests/stack/test_groups.py); the loss and the
# metrics are means of O(1) terms with O(1) weights (advantages <= ~2, ratios
# near 1), so they inherit ~1e-6; 1e-5 relative (+1e-6) is ~100 float32
# epsilons and far below a wrong normalizer, mask or sign (>= 1e-2).
REL, ABS = 1e-5, 1e-6
G = 4
STACK = StackConfig()  # the flash head: log-probs and entropies without [tokens, V] logits


# ----------------------------------------------------------------- the data

def _rollouts(seed=0, with_none=False, names=("acc", "fmt")):
    rng = np.random.default_rng(seed)
    lengths = [(5, 1, 8, 3), (2, 7, 4, 7), (6, 6, 2, 5)]
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (7, 5, 9)]
    comps = [[rng.integers(0, VOCAB, n).tolist() for n in ls] for ls in lengths]
    rewards = [[[float(rng.integers(0, 3)) for _ in names] for _ in range(G)] for _ in prompts]
    rewards[2] = [[1.0, 0.5]] * G  # a group with equal rewards (zero std)
    if with_none:
        rewards[0][1] = [None, 2.0]
        rewards[1][2] = [None, None]  # unscorable
    truncated = [[False, True, False, False], [False, False, False, True], [True, False, False, False]]
    return Rollouts(prompts, comps, rewards, list(names), truncated)


def _perturbed(rollouts, seed, scale):
    rng = np.random.default_rng(seed)
    return lambda base: [[(np.array(x) + scale * rng.normal(size=len(x))).tolist() for x in grp]
                         for grp in base]


# ------------------------------------------------- TRL, transcribed (float64)

def _full_logps(model, rollouts, temperature):
    """TRL's `_get_per_token_logps_and_entropies` on mlx-lm's logits: per group,
    per completion (log-probs, entropies) of logits / temperature, as mx float32."""
    out = []
    for p, cs in zip(rollouts.prompts, rollouts.completions):
        row = []
        for c in cs:
            logits = model(mx.array([p + c[:-1]]))[0].astype(mx.float32)[len(p) - 1:] / temperature
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            row.append((mx.take_along_axis(lp, mx.array(c)[:, None], axis=-1)[:, 0],
                        -(mx.exp(lp) * lp).sum(-1)))
        out.append(row)
    return out


def _pad(rows, T, xp):
    """TRL's right padding: `[B, T]`, zeros after each row."""
    if xp is np:
        out = np.zeros((len(rows), T))
        for b, r in enumerate(rows):
            out[b, :len(r)] = np.asarray(r, np.float64)
        return out
    return mx.stack([mx.concatenate([r, mx.zeros((T - r.shape[0],))]) for r in rows])


def _nanstd(x, axis=None):
    mean = np.nanmean(x, axis=axis, keepdims=True)
    var = np.nanmean((x - mean) ** 2, axis=axis, keepdims=True)
    count = np.sum(~np.isnan(x), axis=axis, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        var = var * np.where(count > 1, count / (count - 1), np.nan)
    return np.sqrt(var)


def trl_advantages(cfg, rewards_per_func, names, G):
    """TRL's rewards, advantages and reward metrics (`_generate_and_score_completions`)."""
    scale = {True: "group", False: "none"}.get(cfg.scale_rewards, cfg.scale_rewards)
    w = np.ones(len(names)) if cfg.reward_weights is None else np.array(cfg.reward_weights, float)
    unscorable = np.isnan(rewards_per_func).all(axis=1)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices are NaN, as in torch
        if cfg.multi_objective_aggregation == "sum_then_normalize":
            rewards = np.nansum(rewards_per_func * w[None], axis=1)
            rewards[unscorable] = np.nan
            mean = np.repeat(np.nanmean(rewards.reshape(-1, G), axis=1), G)
            if scale in ("group", "none"):
                std = np.repeat(_nanstd(rewards.reshape(-1, G), axis=1)[:, 0], G)
            else:
                std = np.full_like(rewards, _nanstd(rewards).item())
            adv = rewards - mean
            if scale != "none":
                adv = adv / (std + 1e-4)
        else:
            grouped = rewards_per_func.reshape(-1, G, len(names))
            mean_k = np.nanmean(grouped, axis=1, keepdims=True)
            std_k = _nanstd(grouped, axis=1)
            reward_k = ((grouped - mean_k) / (std_k + 1e-4)).reshape(-1, len(names))
            rewards = np.nansum(reward_k * w[None], axis=1)
            rewards[unscorable] = np.nan
            std = np.full_like(rewards, _nanstd(rewards).item())
            adv = (rewards - np.nanmean(rewards)) / (std + 1e-4)
        is_std_zero = np.isclose(std, 0.0, rtol=1e-5, atol=1e-8)  # torch.isclose's defaults
        adv = np.nan_to_num(adv, nan=0.0)
        m = {}
        for i, name in enumerate(names):
            m[f"rewards/{name}/mean"] = np.nanmean(rewards_per_func[:, i])
            m[f"rewards/{name}/std"] = _nanstd(rewards_per_func[:, i]).item()
        logged = np.nansum(rewards_per_func * w[None], axis=1)
        logged[unscorable] = np.nan
        m["reward"] = np.nanmean(logged)
        m["reward_std"] = _nanstd(logged).item()
        m["frac_reward_zero_std"] = is_std_zero.astype(float).mean()
    return adv, m


def trl_completion_metrics(lengths, truncated):
    lengths = np.asarray(lengths, float)
    term = lengths[~truncated]
    if term.size == 0:
        term = np.zeros(1)
    return {"completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(),
            "completions/clipped_ratio": truncated.astype(float).mean(),
            "completions/mean_terminated_length": term.mean(),
            "completions/min_terminated_length": term.min(),
            "completions/max_terminated_length": term.max()}


def trl_sampler_ratio(cfg, old, sampling, mask):
    """TRL's vLLM importance-sampling ratio (`_generate_and_score_completions`)."""
    diff = (old - sampling) * mask
    if cfg.vllm_importance_sampling_mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(-1, keepdims=True)
    ratio = np.exp(diff)
    low, high = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    if cfg.vllm_importance_sampling_mode.endswith("truncate"):
        return np.clip(ratio, low, high)
    low = -math.inf if low is None else low
    high = math.inf if high is None else high
    return np.where((ratio < low) | (ratio > high), 0.0, ratio)


def trl_sampler_metrics(cfg, old, sampling, mask, ratio):
    b = mask.astype(bool)
    delta = np.abs(old - sampling)[b]
    flat = ratio.ravel() if ratio.shape[1] == 1 else ratio[b]
    f = lambda fn, x: fn(x) if x.size else 0.0
    return {"sampling/sampling_logp_difference/mean": f(np.mean, delta),
            "sampling/sampling_logp_difference/max": f(np.max, delta),
            "sampling/importance_sampling_ratio/min": f(np.min, flat),
            "sampling/importance_sampling_ratio/mean": f(np.mean, flat),
            "sampling/importance_sampling_ratio/max": f(np.max, flat)}


def trl_loss(xp, cfg, lp, old, ref, mask, adv, entropies, num_items, entropy_mask=None, sampling=None,
             is_ratio=None):
    """TRL's `_compute_loss` after the forward, on `[B, T]` arrays of module `xp`
    (numpy float64 for values, mlx for gradients). Returns (loss, metrics)."""
    sg = (lambda x: x) if xp is np else mx.stop_gradient
    eps_low = cfg.epsilon
    eps_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    adv = adv[:, None]
    old = sg(lp) if old is None else old

    def row_mean(x):
        return (x * mask).sum(-1, keepdims=True) / xp.maximum(mask.sum(-1, keepdims=True), 1.0)

    if cfg.off_policy_mask_threshold is not None:
        avg_seq_kl = row_mean((old if sampling is None else sampling) - sg(lp))
        opm = ((adv >= 0) | (avg_seq_kl <= cfg.off_policy_mask_threshold)).astype(mask.dtype)
    log_ratio = lp - old
    liw = log_ratio if cfg.importance_sampling_level == "token" else row_mean(log_ratio)
    coef_1 = xp.exp(liw)
    if cfg.beta != 0.0:
        kl = xp.exp(ref - lp) - (ref - lp) - 1
        if cfg.use_bias_correction_kl:
            kl = kl * coef_1
    if cfg.loss_type == "cispo":
        ptl = -sg(xp.minimum(coef_1, eps_high)) * adv * lp
    elif cfg.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        coef_2 = xp.clip(coef_1, 1 - eps_low, 1 + eps_high)
        if cfg.delta is not None:
            coef_1 = xp.minimum(coef_1, cfg.delta)
        ptl = -xp.minimum(coef_1 * adv, coef_2 * adv)
    elif cfg.loss_type == "sapo":
        t = xp.where(adv > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        ptl = -(1 / (1 + xp.exp(-t * (coef_1 - 1)))) * 4 / t * adv
    else:  # vespo, get_gamma_weights without vLLM's ratio
        seq = (xp.clip(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdims=True)
        if is_ratio is not None:
            with np.errstate(divide="ignore"):  # a masked ratio's log is -inf, clamped
                seq = seq + xp.clip(xp.log(is_ratio), math.log(1e-8), 20.0).sum(-1, keepdims=True)
        log_w = xp.clip(seq, math.log(1e-8), 20.0)
        k = xp.where(adv >= 0, cfg.vespo_k_pos, cfg.vespo_k_neg)
        lam = xp.maximum(xp.where(adv >= 0, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg), 1e-4)
        phi = xp.exp(lam + k * log_w - lam * xp.exp(log_w))
        phi = sg(xp.where(xp.isfinite(phi), phi, 0.0))
        ptl = -phi * adv * lp
    if cfg.off_policy_mask_threshold is not None:
        ptl = ptl * opm
    if entropy_mask is not None:
        ptl = ptl * entropy_mask
    if is_ratio is not None and cfg.loss_type != "vespo":
        ptl = ptl * is_ratio
    if cfg.beta != 0.0:
        ptl = ptl + cfg.beta * kl
    B, steps = mask.shape[0], cfg.gradient_accumulation_steps
    if cfg.loss_type in ("grpo", "sapo"):
        loss = ((ptl * mask).sum(-1) / xp.maximum(mask.sum(-1), 1.0)).mean()
    elif cfg.loss_type == "bnpo":
        loss = (ptl * mask).sum() / xp.maximum(mask.sum(), 1.0)
    elif cfg.loss_type == "dr_grpo":
        loss = (ptl * mask).sum() / (B * cfg.max_completion_length)
    elif cfg.loss_type in ("cispo", "dapo", "vespo"):
        # num_items_in_batch spans the generation batch: rescaled to one window
        spg = cfg.steps_per_generation or steps
        loss = (ptl * mask).sum() / (max(num_items, 1.0) * steps / spg)
        steps = None
    else:  # luspo: masked before the per-sequence sum
        loss = (ptl * mask).sum(-1).mean()
    policy_loss = loss
    if steps is not None:
        loss = loss / steps
    if cfg.entropy_coef != 0.0:  # the mean entropy whatever the loss type, over the accumulation steps
        eff = mask if entropy_mask is None else mask * entropy_mask
        entropy_loss = (entropies * eff).sum() / xp.maximum(eff.sum(), 1.0) / cfg.gradient_accumulation_steps
        loss = loss - cfg.entropy_coef * entropy_loss
    if xp is not np:
        return loss, {}

    def global_masked_mean(x):
        if x.shape[1] == 1:
            return x.sum() / max(float(x.shape[0]), 1.0)
        return (x * mask).sum() / max(mask.sum(), 1.0)

    def masked_seq_mean(x):
        if x.shape[1] == 1:
            return x[:, 0]
        with np.errstate(invalid="ignore"):
            return (x * mask).sum(-1) / mask.sum(-1)

    m = {"entropy": global_masked_mean(entropies)}
    if cfg.entropy_coef != 0.0:
        m["policy_loss"], m["entropy_coef"] = policy_loss, cfg.entropy_coef
    if cfg.beta != 0.0:
        m["kl"] = global_masked_mean(kl)
    if cfg.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        low = ((coef_1 < 1 - eps_low) & (adv < 0)).astype(float)
        high = ((coef_1 > 1 + eps_high) & (adv > 0)).astype(float)
        m["clip_ratio/low_mean"] = global_masked_mean(low)
        m["clip_ratio/high_mean"] = global_masked_mean(high)
        m["clip_ratio/region_mean"] = global_masked_mean(np.maximum(low, high))
        m["clip_ratio/low_min"] = np.nanmin(masked_seq_mean(low))
        m["clip_ratio/high_max"] = np.nanmax(masked_seq_mean(high))
    elif cfg.loss_type == "cispo":
        m["cispo_clip_ratio"] = global_masked_mean(((coef_1 > eps_high) & (adv > 0)).astype(float))
    else:
        if cfg.loss_type == "vespo":
            m["vespo/phi_seq_mean"] = global_masked_mean(phi)
    return loss, m


def trl_entropy_mask(entropies, mask, quantile):
    """TRL's `get_high_entropy_mask` with threshold 1 - top_entropy_quantile."""
    local = entropies[mask.astype(bool)].astype(np.float32)
    if local.size == 0:
        return np.zeros_like(entropies)
    threshold = np.quantile(local, 1 - quantile)
    return ((entropies * mask >= threshold) & mask.astype(bool)).astype(float)


def trl_batch(model, rollouts, cfg, old=None, ref=None, xp=np, sampling=None):
    """TRL's loss and metrics of `rollouts` as one micro-batch (xp: np or mx)."""
    per_group = _full_logps(model, rollouts, cfg.temperature)
    flat = [x for grp in per_group for x in grp]
    lengths = [len(c) for cs in rollouts.completions for c in cs]
    truncated = np.array([t for ts in rollouts.truncated for t in ts])
    T = max(lengths)
    mask = _pad([np.ones(n) for n in lengths], T, np)
    if cfg.mask_truncated_completions:
        mask = mask * (~truncated)[:, None]
    num_items = mask.sum() if rollouts.num_items_in_batch is None else rollouts.num_items_in_batch
    rewards = np.array([[np.nan if r is None else r for r in row] for rows in rollouts.rewards for row in rows])
    adv, m = trl_advantages(cfg, rewards, rollouts.reward_names, cfg.num_generations)
    if rollouts.advantages is not None:
        adv = np.array([a for row in rollouts.advantages for a in row])
    m.update(trl_completion_metrics(lengths, truncated))
    if xp is np:
        lp = _pad([np.array(x[0]) for x in flat], T, np)
        ent = _pad([np.array(x[1]) for x in flat], T, np)
    else:
        lp, ent = _pad([x[0] for x in flat], T, mx), _pad([x[1] for x in flat], T, mx)
    flat_rows = lambda v: None if v is None else _pad([np.array(r) for grp in v for r in grp], T, np)
    old_, ref_, sampling_ = flat_rows(old), flat_rows(ref), flat_rows(sampling)
    is_ratio = None
    if sampling is not None and cfg.vllm_importance_sampling_correction:
        if old_ is None:  # TRL computes the old log-probs whenever it corrects
            old_ = _pad([np.array(x[0]) for x in flat], T, np)
        is_ratio = trl_sampler_ratio(cfg, old_, sampling_, mask)
        m.update(trl_sampler_metrics(cfg, old_, sampling_, mask, is_ratio))
    emask = None
    if cfg.top_entropy_quantile < 1.0:
        emask = trl_entropy_mask(_pad([np.array(x[1]) for x in flat], T, np), mask,
                                 cfg.top_entropy_quantile)
    if xp is not np:
        cast = lambda v: None if v is None else mx.array(v.astype(np.float32))
        mask, old_, ref_, emask = cast(mask), cast(old_), cast(ref_), cast(emask)
        sampling_, is_ratio = cast(sampling_), cast(is_ratio)
        adv = mx.array(adv.astype(np.float32))
    loss, lm_ = trl_loss(xp, cfg, lp, old_, ref_, mask, adv, ent, float(num_items), emask, sampling_, is_ratio)
    m.update(lm_)
    return loss, m


# ---------------------------------------------------------------- the checks

def _close(got, want, what):
    got, want = float(got), float(want)
    if math.isnan(want):
        assert math.isnan(got), (what, got)
        return
    assert abs(got - want) <= REL * max(1.0, abs(want)) + ABS, (what, got, want)


def _check(model, rollouts, cfg, old=None, ref=None, sampling=None, **kw):
    if old is not None:
        rollouts.old_logps = old
    if ref is not None:
        rollouts.ref_logps = ref
    if sampling is not None:
        rollouts.sampling_logps = sampling
    loss, grads, metrics = grpo_value_and_grad(model, rollouts, cfg, stack=STACK, **kw)
    want_loss, want_metrics = trl_batch(model, rollouts, cfg, old, ref, sampling=sampling)
    _close(loss, want_loss, "loss")
    assert set(metrics) == set(want_metrics), set(metrics) ^ set(want_metrics)
    for k, v in want_metrics.items():
        _close(metrics[k], v, k)
    return loss, grads, metrics


def _current(model, rollouts, cfg):
    return [[np.array(lp).tolist() for lp, _ in grp] for grp in _full_logps(model, rollouts, cfg.temperature)]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", lora=True)


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo"]


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES + ["luspo"])
def test_loss_types_off_policy_match_trl(model, loss_type, level):
    """Old log-probs ~0.3 away from the current ones: ratios spread over both
    clip bounds, so each loss type's clipped and unclipped branches count."""
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, loss_type=loss_type,
                     importance_sampling_level=level, epsilon_high=0.28 if loss_type != "cispo" else 1.1)
    rollouts = _rollouts()
    old = _perturbed(rollouts, 5, 0.3)(_current(model, rollouts, cfg))
    _, _, metrics = _check(model, rollouts, cfg, old=old)
    if loss_type in ("grpo", "dapo") and level == "token":
        assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("loss_type", LOSS_TYPES + ["luspo"])
def test_loss_types_on_policy_match_trl(model, loss_type, steps):
    """On-policy (no old log-probs: the ratio is 1); `steps` accumulation steps
    divide the loss types TRL divides."""
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, loss_type=loss_type,
                     importance_sampling_level="sequence" if loss_type == "luspo" else "token",
                     gradient_accumulation_steps=steps)
    _check(model, _rollouts(), cfg)


@pytest.mark.parametrize("loss_type", ["dapo", "luspo"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_kl_to_a_precomputed_reference_matches_trl(model, level, bias, loss_type):
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, beta=0.04, importance_sampling_level=level,
                     use_bias_correction_kl=bias, loss_type=loss_type)
    rollouts = _rollouts(1)
    cur = _current(model, rollouts, cfg)
    old, ref = _perturbed(rollouts, 6, 0.1)(cur), _perturbed(rollouts, 7, 0.3)(cur)
    _, _, metrics = _check(model, rollouts, cfg, old=old, ref=ref)
    assert metrics["kl"] > 0


@pytest.mark.parametrize("source", ["adapters_off", "frozen"])
def test_kl_to_a_reference_model_matches_trl(model, source):
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, beta=0.1, loss_type="grpo")
    rollouts = _rollouts(2)
    if source == "adapters_off":
        reference = AdaptersOff()
        with adapters_off(model):
            ref = _current(model, rollouts, cfg)
    else:
        frozen = tiny_model("llama", seed=9)
        reference = FrozenModel(frozen)
        ref = _current(frozen, rollouts, cfg)
    loss, _, metrics = grpo_value_and_grad(model, rollouts, cfg, reference=reference, stack=STACK)
    want_loss, want = trl_batch(model, rollouts, cfg, ref=ref)
    _close(loss, want_loss, "loss")
    _close(metrics["kl"], want["kl"], "kl")
    got_ref = reference_logps(model, rollouts, cfg, reference, stack=STACK)
    for a, b in zip(got_ref, ref):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, rtol=REL, atol=ABS)


@pytest.mark.parametrize("scale", ["group", "batch", "none", True, False])
@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_reward_scaling_and_aggregation_match_trl(model, scale, aggregation):
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, scale_rewards=scale,
                     multi_objective_aggregation=aggregation, reward_weights=[1.0, 0.5])
    _check(model, _rollouts(3, with_none=True), cfg)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_masked_truncated_completions_match_trl(model, loss_type):
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, mask_truncated_completions=True,
                     loss_type=loss_type)
    rollouts = _rollouts(4)
    _check(model, rollouts, cfg, old=_perturbed(rollouts, 8, 0.15)(_current(model, rollouts, cfg)))


@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5])
@pytest.mark.parametrize("loss_type", ["dapo", "luspo"])
def test_top_entropy_quantile_matches_trl(model, quantile, loss_type):
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, top_entropy_quantile=quantile,
                     loss_type=loss_type, mask_truncated_completions=True,
                     importance_sampling_level="sequence" if loss_type == "luspo" else "token")
    rollouts = _rollouts(5)
    _check(model, rollouts, cfg, old=_perturbed(rollouts, 9, 0.15)(_current(model, rollouts, cfg)))


@pytest.mark.parametrize("kw", [dict(loss_type="dapo"), dict(loss_type="bnpo", top_entropy_quantile=0.3),
                                dict(loss_type="grpo", gradient_accumulation_steps=2),
                                dict(loss_type="cispo", gradient_accumulation_steps=2, steps_per_generation=4),
                                dict(loss_type="luspo", top_entropy_quantile=0.5)])
def test_entropy_bonus_matches_trl(model, kw):
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, entropy_coef=0.05, **kw)
    rollouts = _rollouts(12)
    _check(model, rollouts, cfg, old=_perturbed(rollouts, 2, 0.2)(_current(model, rollouts, cfg)))


@pytest.mark.parametrize("with_old", [False, True])
@pytest.mark.parametrize("kw", [
    dict(),  # sequence_mask, clip_max 3
    dict(vllm_importance_sampling_mode="sequence_truncate", vllm_importance_sampling_clip_max=1.5),
    dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=0.9,
         vllm_importance_sampling_clip_max=1.1),
    dict(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=1.2,
         loss_type="grpo", off_policy_mask_threshold=0.0),
    dict(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.5,
         vllm_importance_sampling_clip_max=0.9, loss_type="vespo"),
    dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=1.02,
         vllm_importance_sampling_clip_max=2.0, loss_type="vespo"),
    dict(vllm_importance_sampling_correction=False, off_policy_mask_threshold=0.0),
    dict(vllm_importance_sampling_mode="token_truncate", top_entropy_quantile=0.4),
    dict(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=1.2, loss_type="luspo"),
])
def test_sampler_correction_matches_trl(model, kw, with_old):
    """The sampler's log-probs 0.2 from the trainer's: ratios on both sides of
    the clip bounds (a masked ratio 1 pads vespo's sum over the batch width)."""
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, mask_truncated_completions=True, **kw)
    rollouts = _rollouts(13)
    cur = _current(model, rollouts, cfg)
    old = _perturbed(rollouts, 4, 0.1)(cur) if with_old else None
    _, _, metrics = _check(model, rollouts, cfg, old=old, sampling=_perturbed(rollouts, 5, 0.2)(cur))
    if cfg.vllm_importance_sampling_correction:
        assert metrics["sampling/importance_sampling_ratio/min"] < metrics["sampling/importance_sampling_ratio/max"]


def test_temperature_matches_trl(model):
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, temperature=0.7, beta=0.04)
    rollouts = _rollouts(6)
    cur = _current(model, rollouts, cfg)
    _check(model, rollouts, cfg, old=_perturbed(rollouts, 1, 0.1)(cur), ref=_perturbed(rollouts, 2, 0.2)(cur))


@pytest.mark.parametrize("kw", [dict(delta=1.1), dict(epsilon=0.1, epsilon_high=0.3),
                                dict(off_policy_mask_threshold=0.01), dict(gradient_accumulation_steps=3),
                                dict(sapo_temperature_pos=2.0, sapo_temperature_neg=0.5, loss_type="sapo"),
                                dict(vespo_k_pos=1.0, vespo_lambda_neg=4.0, loss_type="vespo")])
def test_clip_and_mask_settings_match_trl(model, kw):
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, **{"loss_type": "bnpo", **kw})
    rollouts = _rollouts(7)
    _check(model, rollouts, cfg, old=_perturbed(rollouts, 3, 0.2)(_current(model, rollouts, cfg)))


def test_micro_batches_carry_the_generation_batch(model):
    """steps_per_generation: each part of `split` keeps the whole batch's
    advantages and dapo's token count, as TRL's buffered micro-batches."""
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, steps_per_generation=3)
    rollouts = _rollouts(8)
    parts = rollouts.split(3, cfg)
    whole_adv, _ = trl_advantages(cfg, np.array([r for rows in rollouts.rewards for r in rows], float),
                                  rollouts.reward_names, G)
    total = 0.0
    for k, part in enumerate(parts):
        assert part.num_items_in_batch == sum(len(c) for cs in rollouts.completions for c in cs)
        np.testing.assert_allclose(np.ravel(part.advantages), whole_adv[k * G:(k + 1) * G])
        loss, _, _ = _check(model, part, cfg)
        total += float(loss)
    # The micro-batches' dapo losses sum to the whole batch's.
    _close(total, trl_batch(model, rollouts, cfg)[0], "sum of micro-batch losses")


def test_behaviour_logps_are_the_current_policy(model):
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, num_iterations=2, temperature=0.9)
    assert cfg.needs_old_logps() and not GRPOConfig().needs_old_logps()
    rollouts = _rollouts(9)
    got = behaviour_logps(model, rollouts, cfg, stack=STACK)
    for a, b in zip(got, _current(model, rollouts, cfg)):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, rtol=REL, atol=ABS)


def test_evaluation_equals_the_differentiated_values(model):
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, loss_type="grpo", beta=0.02)
    rollouts = _rollouts(10)
    rollouts.ref_logps = _perturbed(rollouts, 4, 0.2)(_current(model, rollouts, cfg))
    loss, _, m = grpo_value_and_grad(model, rollouts, cfg, stack=STACK)
    loss2, m2 = grpo_loss_and_metrics(model, rollouts, cfg, stack=STACK)
    _close(loss2, loss, "loss")
    assert m2.keys() == m.keys()


# ----------------------------------------------------------------- gradients

GRADIENT_CASES = [
    dict(loss_type="dapo"),
    dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.05),
    dict(loss_type="bnpo", delta=1.2, beta=0.05, use_bias_correction_kl=True),
    dict(loss_type="dr_grpo", mask_truncated_completions=True),
    dict(loss_type="cispo", epsilon_high=1.05),
    dict(loss_type="sapo", temperature=0.8),
    dict(loss_type="vespo"),
    dict(loss_type="luspo", importance_sampling_level="sequence", off_policy_mask_threshold=0.01),
    dict(loss_type="luspo", beta=0.05),
    dict(loss_type="dapo", entropy_coef=0.3, top_entropy_quantile=0.5),
    dict(loss_type="grpo", entropy_coef=0.2, gradient_accumulation_steps=2),
    dict(loss_type="dapo", vllm_importance_sampling_mode="token_truncate"),
    dict(loss_type="vespo", vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=1.1),
]


def _off_policy(model, cfg, sampler=False):
    """Rollouts with old log-probs (and with `cfg.beta` reference, with
    `sampler` sampler log-probs) perturbed from the current policy's."""
    rollouts = _rollouts(11)
    cur = _current(model, rollouts, cfg)
    rollouts.old_logps = _perturbed(rollouts, 12, 0.15)(cur)
    if cfg.beta:
        rollouts.ref_logps = _perturbed(rollouts, 13, 0.3)(cur)
    if sampler:
        rollouts.sampling_logps = _perturbed(rollouts, 14, 0.2)(cur)
    return rollouts


# Every case through the flash head; the first three also through full logits.
@pytest.mark.parametrize("kw, flash", [(kw, True) for kw in GRADIENT_CASES]
                         + [(kw, False) for kw in GRADIENT_CASES[:3]])
def test_gradients_equal_plain_autodiff_of_trl(model, kw, flash):
    """The gradient of TRL's loss (the transcription in MLX, through
    `model(tokens)` of each sequence) equals grpo_value_and_grad's."""
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, **kw)
    rollouts = _off_policy(model, cfg, sampler="vllm_importance_sampling_mode" in kw)
    stack = StackConfig(flash_head=flash, prefix_packing=False)
    _, grads, _ = grpo_value_and_grad(model, rollouts, cfg, stack=stack)

    def plain():
        return trl_batch(model, rollouts, cfg, rollouts.old_logps, rollouts.ref_logps, xp=mx,
                         sampling=rollouts.sampling_logps)[0]

    _, want = nn.value_and_grad(model, plain)()
    diff, scale = max_diff(grads, want)
    assert diff <= REL * max(1.0, scale) + ABS, (diff, scale)


@pytest.fixture
def cuda_like_head(monkeypatch):
    """The head as on a device whose kernels have no entropy statistics: a
    call with them runs the pure-MLX fallback, and the fused forward cannot
    keep them. Yields the fallback backward's call count."""
    import flash_cce.fallback as fallback
    import flash_cce.ops as ops
    import flash_cce.stack.stats as stats

    calls = []
    backward = fallback._backward
    monkeypatch.setattr(ops, "native_stats", lambda device: False)
    monkeypatch.setattr(stats, "fused_stats", lambda device: False)
    monkeypatch.setattr(fallback, "_backward", lambda *a, **k: calls.append(1) or backward(*a, **k))
    return calls


@pytest.mark.parametrize("kw", [dict(loss_type="dapo", beta=0.05), dict(loss_type="grpo", entropy_coef=0.2)])
def test_without_native_entropy_statistics_the_update_is_unchanged(model, cuda_like_head, kw):
    """Where the head has no native entropy statistics, the log-probs keep the
    native head and the entropy metric takes a forward without gradient: no
    backward over the vocabulary in pure MLX (the GPU update's memory), unless
    the loss has an entropy bonus. Loss, metrics (TRL's) and gradients are
    those of TRL's loss."""
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, **kw)
    rollouts = _rollouts(11)
    cur = _current(model, rollouts, cfg)
    old = _perturbed(rollouts, 12, 0.15)(cur)
    ref = _perturbed(rollouts, 13, 0.3)(cur) if cfg.beta else None
    _, grads, _ = _check(model, rollouts, cfg, old=old, ref=ref)
    assert bool(cuda_like_head) == (cfg.entropy_coef != 0.0)

    def plain():
        return trl_batch(model, rollouts, cfg, old, ref, xp=mx)[0]

    _, want = nn.value_and_grad(model, plain)()
    diff, scale = max_diff(grads, want)
    assert diff <= REL * max(1.0, scale) + ABS, (diff, scale)


@pytest.mark.parametrize("kw", [dict(loss_type="dapo", beta=0.05), dict(loss_type="grpo", entropy_coef=0.2),
                                dict(loss_type="vespo", importance_sampling_level="sequence")])
def test_micro_groups_give_the_whole_groups_update(model, kw):
    """Completions one or three at a time around one prompt pass: the loss, the
    metrics and the gradients of the whole groups."""
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, **kw)
    rollouts = _off_policy(model, cfg)
    loss, grads, metrics = grpo_value_and_grad(model, rollouts, cfg, stack=STACK)
    for micro in (1, 3):
        loss2, grads2, metrics2 = grpo_value_and_grad(model, rollouts, cfg, stack=STACK, micro_group=micro)
        _close(loss2, loss, "loss")
        assert metrics2.keys() == metrics.keys()
        for k, v in metrics.items():
            _close(metrics2[k], v, k)
        diff, scale = max_diff(grads2, grads)
        assert diff <= REL * max(1.0, scale) + ABS, (micro, diff, scale)


def _update_peak(model, n, length, micro):
    """Peak memory (bytes above what is held before) of one update of a group of
    `n` completions of `length` tokens, one layer per checkpoint segment."""
    rng = np.random.default_rng(1)
    rollouts = Rollouts([rng.integers(0, VOCAB, 8).tolist()],
                        [[rng.integers(0, VOCAB, length).tolist() for _ in range(n)]],
                        [[[float(g % 2)] for g in range(n)]], ["r"], [[True] * n])
    cfg = GRPOConfig(loss_type="grpo", num_generations=n, max_completion_length=length)
    mx.eval(model.parameters())
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    loss, grads, _ = grpo_value_and_grad(model, rollouts, cfg, stack=StackConfig(segment_size=1),
                                         micro_group=micro)
    mx.eval(loss, grads)
    return mx.get_peak_memory() - before


def test_micro_groups_keep_the_peak_flat_as_g_grows(model):
    """With one completion a pass the peak holds one completion's activations,
    the prompt's keys/values and the gradients: from G = 4 to 16 only the [G, T]
    outputs grow (kilobytes; measured +4% of 1.1 MB on a 2-core x86-64 CPU), so
    25% bounds it, while the whole group's peak grows with G (measured 4.1x)."""
    flat = [_update_peak(model, n, 64, 1) for n in (4, 16)]
    whole = [_update_peak(model, n, 64, None) for n in (4, 16)]
    assert flat[1] <= 1.25 * flat[0], flat
    assert whole[1] >= 2.0 * whole[0], whole
    assert whole[1] >= 4.0 * flat[1], (whole, flat)


def test_on_policy_bias_corrected_kl_gradient_matches_trl(model):
    """On-policy (no old log-probs) the ratio is 1 but carries the policy's
    gradient, so TRL 1.16's default `use_bias_correction_kl=True` changes the
    KL's gradient: ours equals plain autodiff of the transcription and differs
    from the uncorrected one by far more than the tolerance."""
    rollouts = _rollouts(11)
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, beta=0.5, loss_type="grpo")
    rollouts.ref_logps = _perturbed(rollouts, 13, 0.3)(_current(model, rollouts, cfg))
    grads = {}
    for bias in (True, False):
        cfg.use_bias_correction_kl = bias
        _, grads[bias], _ = grpo_value_and_grad(model, rollouts, cfg, stack=STACK)

        def plain():
            return trl_batch(model, rollouts, cfg, None, rollouts.ref_logps, xp=mx)[0]

        _, want = nn.value_and_grad(model, plain)()
        diff, scale = max_diff(grads[bias], want)
        assert diff <= REL * max(1.0, scale) + ABS, (bias, diff, scale)
    diff, scale = max_diff(grads[True], grads[False])
    assert diff > 100 * (REL * max(1.0, scale) + ABS), (diff, scale)


# TRL 1.16.0's GRPOConfig defaults of the fields GRPOConfig carries (read in its
# grpo_config.py; gradient_accumulation_steps is TrainingArguments').
TRL_116_DEFAULTS = dict(
    loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=None, delta=None, importance_sampling_level="token",
    sapo_temperature_neg=1.05, sapo_temperature_pos=1.0, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
    vespo_k_neg=3.0, vespo_lambda_neg=2.0, use_bias_correction_kl=True, off_policy_mask_threshold=None,
    top_entropy_quantile=1.0, mask_truncated_completions=False, entropy_coef=0.0,
    vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="sequence_mask",
    vllm_importance_sampling_clip_max=3.0, vllm_importance_sampling_clip_min=None, reward_weights=None,
    multi_objective_aggregation="sum_then_normalize", scale_rewards="group", num_generations=8,
    max_completion_length=512, temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
    num_iterations=1, steps_per_generation=None, gradient_accumulation_steps=1)


def test_defaults_are_trl_1_16():
    assert asdict(GRPOConfig()) == TRL_116_DEFAULTS


# ----------------------------------------------------------------- bad input

@pytest.mark.parametrize("kw, match", [
    (dict(loss_type="ppo"), r"loss_type must be one of \['grpo', 'bnpo'"),
    (dict(importance_sampling_level="seq"), r"importance_sampling_level must be one of \['token', 'sequence'\]"),
    (dict(scale_rewards="std"), r"scale_rewards must be one of \['group', 'batch', 'none'\]"),
    (dict(multi_objective_aggregation="max"), "multi_objective_aggregation must be one of"),
    (dict(beta=-1.0), "beta must be a finite number >= 0.0"),
    (dict(epsilon_high=float("nan")), "epsilon_high must be None or a finite number"),
    (dict(temperature=0.0), "temperature must be a finite number > 0.0"),
    (dict(top_entropy_quantile=1.5), r"top_entropy_quantile must be a finite number >= 0.0 and <= 1.0"),
    (dict(num_generations=1), "num_generations must be an integer >= 2"),
    (dict(max_completion_length=0), "max_completion_length must be an integer >= 1"),
    (dict(num_iterations=0), "num_iterations must be an integer >= 1"),
    (dict(mask_truncated_completions="yes"), "mask_truncated_completions must be True or False"),
    (dict(reward_weights="1"), "reward_weights must be None or a list of numbers"),
    (dict(entropy_coef=float("inf")), "entropy_coef must be a finite number"),
])
def test_bad_settings_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**kw).validate()


def _bad(field, value):
    r = _rollouts()
    setattr(r, field, value)
    return r


@pytest.mark.parametrize("make, match", [
    (lambda: _bad("prompts", []), "rollouts.prompts must be a non-empty list"),
    (lambda: _bad("reward_names", []), "rollouts.reward_names must be a non-empty list"),
    (lambda: _bad("completions", _rollouts().completions[:2]), "rollouts.completions must be a list of 3 groups"),
    (lambda: _bad("truncated", [[False] * 3] * 3), "rollouts group 0: truncated has 3 entries"),
    (lambda: _bad("prompts", [[]] + _rollouts().prompts[1:]), "rollouts group 0: the prompt must be a non-empty"),
    (lambda: _bad("completions", [[[1], [], [2], [3]]] + _rollouts().completions[1:]),
     "rollouts group 0, completion 1: must be a non-empty list"),
    (lambda: _bad("completions", [[[1] * 11, [1], [2], [3]]] + _rollouts().completions[1:]),
     "completion 0: 11 tokens, more than max_completion_length=10"),
    (lambda: _bad("completions", [[[VOCAB], [1], [2], [3]]] + _rollouts().completions[1:]),
     r"completion 0: tokens must be ints in \[0, 97\)"),
    (lambda: _bad("rewards", [[[1.0]] * 4] + _rollouts().rewards[1:]), "completion 0: rewards must be 2 numbers"),
    (lambda: _bad("old_logps", [[[0.0]] * 4] * 3), "completion 0: old_logps must be 5 finite log-probs"),
])
def test_bad_rollouts_are_named(model, make, match):
    cfg = GRPOConfig(num_generations=G, max_completion_length=10)
    with pytest.raises(ValueError, match=match):
        grpo_value_and_grad(model, make(), cfg)


def test_bad_reference_and_weights_are_named(model):
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, beta=0.1)
    with pytest.raises(ValueError, match="reference: a Precomputed table holds pairs"):
        grpo_value_and_grad(model, _rollouts(), cfg, reference=Precomputed({}))
    with pytest.raises(ValueError, match="the model has no LoRA adapters to switch off"):
        grpo_value_and_grad(tiny_model("llama"), _rollouts(), cfg)
    rollouts = _rollouts()
    rollouts.sampling_logps = [[[-1.0] * len(c) for c in cs] for cs in rollouts.completions]
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, loss_type="vespo",
                     vllm_importance_sampling_mode="sequence_mask")
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode must be .* for loss_type 'vespo'"):
        grpo_value_and_grad(model, rollouts, cfg)
    cfg = GRPOConfig(num_generations=G, max_completion_length=10, reward_weights=[1.0])
    with pytest.raises(ValueError, match=r"reward_weights has 1 weights for 2 reward functions"):
        grpo_value_and_grad(model, _rollouts(), cfg)
