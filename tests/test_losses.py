"""The objectives of flash_cce.losses against numpy transcriptions of their formulas."""

import math

import mlx.core as mx
import numpy as np
import pytest

from flash_cce import losses
from flash_cce.objectives import ObjectiveConfig

# Inputs are O(1) and each formula is a handful of float32 ops: 1e-6 relative is
# ~10 float32 roundings, far below any formula mistake (>= 1e-2 here).
RTOL, ATOL = 1e-6, 1e-6


def _logsigmoid(x):
    return -np.logaddexp(0.0, -x)


def trl_orpo(c_logps, r_logps, nll, beta):
    """TRL ORPOTrainer.odds_ratio_loss + get_batch_loss_metrics, in float64 numpy."""
    log_odds = (c_logps - r_logps) - (np.log1p(-np.exp(c_logps)) - np.log1p(-np.exp(r_logps)))
    ratio = _logsigmoid(log_odds)
    losses_ = beta * ratio
    chosen_rewards, rejected_rewards = beta * c_logps, beta * r_logps
    return nll - losses_.mean(), {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/rejected": r_logps.mean(),
        "logps/chosen": c_logps.mean(),
        "nll_loss": nll,
        "log_odds_ratio": ratio.mean(),
        "log_odds_chosen": log_odds.mean(),
    }


FIXED = {  # four pairs: sums and counts as the objectives see them
    "c_sum": np.array([-12.0, -3.5, -40.0, -0.02]),
    "c_n": np.array([6.0, 5.0, 10.0, 4.0]),
    "r_sum": np.array([-9.0, -8.0, -41.0, -5.0]),
    "r_n": np.array([3.0, 4.0, 10.0, 2.0]),
    "nll_sum": np.array([30.0, 11.0, 52.0, 4.0]),
    "nll_n": np.array([12.0, 9.0, 15.0, 7.0]),
    "ref_c": np.array([-11.0, -4.0, -39.0, -0.5]),
    "ref_r": np.array([-9.5, -7.0, -42.0, -4.0]),
}


def _stats():
    return {k: mx.array(v.astype(np.float32)) for k, v in FIXED.items()}


def _check(got, want):
    np.testing.assert_allclose(np.array(got), want, rtol=RTOL, atol=ATOL)


def test_log1mexp_matches_float64_on_both_branches():
    x = -np.concatenate([np.logspace(-6, 2, 200), [math.log(2.0)]])
    want = np.log(-np.expm1(x))
    got = np.array(losses.log1mexp(mx.array(x.astype(np.float32))))
    # Near 0, log(1 - e^x) ~ log|x|: rounding x to float32 (relative 6e-8) moves
    # the result by ~6e-8 absolute; elsewhere a few float32 roundings of |y| <= 16.
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


def test_log1mexp_finite_value_and_gradient_at_zero():
    x = mx.array([0.0, -1e-12, -1e-9, -6e-8, -1e-7])
    val = losses.log1mexp(x)
    grad = mx.grad(lambda v: losses.log1mexp(v).sum())(x)
    assert np.isfinite(np.array(val)).all()
    assert np.isfinite(np.array(grad)).all()


def test_orpo_no_nan_as_chosen_logp_reaches_zero():
    cfg = ObjectiveConfig(name="orpo")
    for c in (0.0, -1e-9, -1e-6):
        stats = _stats()
        stats["c_sum"] = mx.array([c, -3.5, -40.0, -0.02], mx.float32)

        def loss(s):
            return losses.orpo(dict(stats, c_sum=s), cfg)[0].sum()

        value, grad = mx.value_and_grad(loss)(stats["c_sum"])
        assert np.isfinite(value.item())
        assert np.isfinite(np.array(grad)).all()


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_orpo_matches_trl(beta):
    cfg = ObjectiveConfig(name="orpo", beta=beta)
    terms, metrics = losses.orpo(_stats(), cfg)
    lw, ll = FIXED["c_sum"] / FIXED["c_n"], FIXED["r_sum"] / FIXED["r_n"]
    nll = FIXED["nll_sum"].sum() / FIXED["nll_n"].sum()
    want_loss, want_metrics = trl_orpo(lw, ll, nll, beta)
    _check(terms.sum(), want_loss)
    assert set(want_metrics) <= set(metrics)
    for k, v in want_metrics.items():
        _check(metrics[k], v)


def test_orpo_margin_reduces_to_orpo_and_shifts_by_gamma():
    stats = _stats()
    orpo = losses.orpo(stats, ObjectiveConfig(name="orpo", beta=0.2))[0].sum()
    same = losses.orpo_margin(stats, ObjectiveConfig(name="orpo_margin", beta=0.2, gamma=0.0))
    _check(same[0].sum(), orpo.item())
    gamma = 0.7
    got = losses.orpo_margin(stats, ObjectiveConfig(name="orpo_margin", beta=0.2, gamma=gamma))
    lw, ll = FIXED["c_sum"] / FIXED["c_n"], FIXED["r_sum"] / FIXED["r_n"]
    log_odds = (lw - ll) - (np.log1p(-np.exp(lw)) - np.log1p(-np.exp(ll)))
    nll = FIXED["nll_sum"].sum() / FIXED["nll_n"].sum()
    _check(got[0].sum(), nll - 0.2 * _logsigmoid(log_odds - gamma).mean())


def test_simpo_and_dpo_and_sft():
    beta, gamma = 2.0, 0.5
    lw, ll = FIXED["c_sum"] / FIXED["c_n"], FIXED["r_sum"] / FIXED["r_n"]
    cfg = ObjectiveConfig(name="simpo", beta=beta, gamma=gamma)
    _check(losses.simpo(_stats(), cfg)[0].sum(),
           -_logsigmoid(beta * (lw - ll) - gamma).mean())
    cfg = ObjectiveConfig(name="dpo", beta=0.1)
    margin = (FIXED["c_sum"] - FIXED["ref_c"]) - (FIXED["r_sum"] - FIXED["ref_r"])
    terms, metrics = losses.dpo(_stats(), cfg)
    _check(terms.sum(), -_logsigmoid(0.1 * margin).mean())
    _check(metrics["rewards/chosen"], (0.1 * (FIXED["c_sum"] - FIXED["ref_c"])).mean())
    cfg = ObjectiveConfig(name="sft")
    _check(losses.sft(_stats(), cfg)[0].sum(), FIXED["nll_sum"].sum() / FIXED["nll_n"].sum())


def test_per_pair_terms_sum_to_batch_loss():
    """Differentiating pair by pair relies on this decomposition."""
    for name in losses.OBJECTIVES:
        cfg = ObjectiveConfig(name=name)
        stats = _stats()
        whole = losses.get(name).fn(stats, cfg)[0].sum().item()
        total_tokens = float(FIXED["nll_n"].sum())
        parts = sum(
            losses.get(name).fn({k: v[i:i + 1] for k, v in stats.items()}, cfg,
                                4, total_tokens)[0].sum().item()
            for i in range(4)
        )
        assert abs(parts - whole) <= 1e-5 * max(1.0, abs(whole)), name


def test_unknown_objective_raises():
    with pytest.raises(ValueError, match="objective name"):
        losses.get("kto")
