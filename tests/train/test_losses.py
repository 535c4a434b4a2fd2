"""The objectives of flash_cce.train.losses against numpy transcriptions of their formulas."""

import math
import os
import tempfile

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from flash_cce.train import losses
from flash_cce.train.objectives import ObjectiveConfig

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
        stats = _kto_stats(0.5) if name == "kto" else _stats()
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
        losses.get("kpo")


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def trl_dpo(loss_type, beta, eps=0.0, f=FIXED, tau=0.05):
    """TRL DPOTrainer._compute_loss (reverse KL, one loss_type), float64 numpy."""
    cl, rl = f["c_sum"] - f["ref_c"], f["r_sum"] - f["ref_r"]
    d = cl - rl
    x = beta * d
    per = {
        "exo_pair": lambda: (_sigmoid(x) * (_logsigmoid(x) - np.log1p(-eps))
                             + _sigmoid(-x) * (_logsigmoid(-x) - np.log(eps))),
        "bco_pair": lambda: -_logsigmoid(beta * cl) - _logsigmoid(-beta * rl),
        "discopop": lambda: (-_logsigmoid(x) * (1 - _sigmoid(x / tau)) + np.exp(-x) * _sigmoid(x / tau)),
        "sigmoid_norm": lambda: -_logsigmoid(beta * (cl / f["c_n"] - rl / f["r_n"])),
        "sigmoid": lambda: -_logsigmoid(beta * d),
        "hinge": lambda: np.maximum(0.0, 1 - beta * d),
        "ipo": lambda: (cl / f["c_n"] - rl / f["r_n"] - 1 / (2 * beta)) ** 2,
        "robust": lambda: (-(1 - eps) * _logsigmoid(beta * d) + eps * _logsigmoid(-beta * d)) / (1 - 2 * eps),
        "nca_pair": lambda: (-_logsigmoid(beta * cl) - 0.5 * _logsigmoid(-beta * cl)
                             - 0.5 * _logsigmoid(-beta * rl)),
        "sppo_hard": lambda: (cl - 0.5 / beta) ** 2 + (rl + 0.5 / beta) ** 2,
        "apo_zero": lambda: (1 - _sigmoid(beta * cl)) + _sigmoid(beta * rl),
        "apo_down": lambda: _sigmoid(beta * cl) + (1 - _sigmoid(beta * d)),
    }[loss_type]()
    cr, rr = beta * cl, beta * rl
    return per.mean(), {
        "rewards/chosen": cr.mean(), "rewards/rejected": rr.mean(),
        "rewards/accuracies": (cr > rr).mean(), "rewards/margins": (cr - rr).mean(),
        "logps/chosen": f["c_sum"].mean(), "logps/rejected": f["r_sum"].mean(),
    }


def trl_cpo(loss_type, beta, cpo_alpha, gamma=0.5, eps=0.0, f=FIXED, alpha=0.0):
    """TRL CPOTrainer.cpo_loss + get_batch_loss_metrics, float64 numpy. The NLL
    is the chosen response's token mean (prompt labels masked)."""
    if loss_type == "alphapo":  # CPOConfig.__post_init__
        loss_type, cpo_alpha = "simpo", 0.0
    avg = loss_type in ("ipo", "simpo")
    logps_c = f["c_sum"] / f["c_n"] if avg else f["c_sum"]
    logps_r = f["r_sum"] / f["r_n"] if avg else f["r_sum"]
    cw, rw = logps_c, logps_r
    if alpha != 0:
        cw, rw = (1 - np.exp(logps_c) ** -alpha) / alpha, (1 - np.exp(logps_r) ** -alpha) / alpha
    logits = cw - rw
    if loss_type == "simpo":
        logits = logits - gamma / beta
    if loss_type in ("simpo", "sigmoid"):
        per = -_logsigmoid(beta * logits) * (1 - eps) - _logsigmoid(-beta * logits) * eps
    elif loss_type == "hinge":
        per = np.maximum(0.0, 1 - beta * logits)
    else:
        per = (logits - 1 / (2 * beta)) ** 2
    nll = f["nll_sum"].sum() / f["nll_n"].sum() if cpo_alpha != 0 else 0.0  # TRL: none when unweighted
    cr, rr = beta * cw, beta * rw
    return per.mean() + cpo_alpha * nll, {
        "rewards/chosen": cr.mean(), "rewards/rejected": rr.mean(),
        "rewards/accuracies": (cr > rr).mean(), "rewards/margins": (cr - rr).mean(),
        "logps/chosen": logps_c.mean(), "logps/rejected": logps_r.mean(), "nll_loss": nll,
    }


def trl_kto(loss_type, beta, logps, ref_logps, labels, kl_logps, ref_kl_logps, wd=1.0, wu=1.0):
    """TRL KTOTrainer._compute_loss, float64 numpy."""
    kl = max((kl_logps - ref_kl_logps).mean(), 0.0)
    good, bad = labels.astype(bool), ~labels.astype(bool)
    cl, rl = logps[good] - ref_logps[good], logps[bad] - ref_logps[bad]
    if loss_type == "kto":
        cls, rls = 1 - _sigmoid(beta * (cl - kl)), 1 - _sigmoid(beta * (kl - rl))
    else:
        cls, rls = 1 - _sigmoid(beta * cl), _sigmoid(beta * rl)
    loss = np.concatenate([wd * cls, wu * rls]).mean()
    metrics = {"kl": kl, "rewards/chosen": (beta * cl).sum() / good.sum(),
               "logps/chosen": logps[good].sum() / good.sum(),
               "rewards/rejected": (beta * rl).sum() / bad.sum(),
               "logps/rejected": logps[bad].sum() / bad.sum()}
    metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return loss, metrics


def _check_all(got_terms, got_metrics, want_loss, want_metrics):
    _check(got_terms.sum(), want_loss)
    assert set(want_metrics) <= set(got_metrics)
    for k, v in want_metrics.items():
        _check(got_metrics[k], v)


@pytest.mark.parametrize("loss_type", losses.DPO_LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.1, 0.7])
def test_dpo_loss_types_match_trl(loss_type, beta):
    eps = {"robust": 0.2, "exo_pair": 1e-3}.get(loss_type, 0.0)
    cfg = ObjectiveConfig(name="dpo", beta=beta, loss_type=loss_type, label_smoothing=eps)
    _check_all(*losses.dpo(_stats(), cfg), *trl_dpo(loss_type, beta, eps))


@pytest.mark.parametrize("loss_type, eps, tau", [("exo_pair", 0.3, 0.05), ("discopop", 0.0, 0.7)])
def test_dpo_loss_type_settings(loss_type, eps, tau):
    """EXO's epsilon and DiscoPOP's temperature reach the loss."""
    cfg = ObjectiveConfig(name="dpo", beta=0.2, loss_type=loss_type, label_smoothing=eps, discopop_tau=tau)
    _check_all(*losses.dpo(_stats(), cfg), *trl_dpo(loss_type, 0.2, eps, tau=tau))


def test_dpo_default_loss_type_is_sigmoid():
    got = losses.dpo(_stats(), ObjectiveConfig(name="dpo", beta=0.3))[0].sum()
    _check(got, trl_dpo("sigmoid", 0.3)[0])


@pytest.mark.parametrize("loss_type", losses.CPO_LOSS_TYPES)
@pytest.mark.parametrize("alpha", [0.0, 0.25, -0.1])  # AlphaPO's reward shape, 0: log-probs
def test_cpo_loss_types_match_trl(loss_type, alpha):
    eps = 0.1 if loss_type in ("sigmoid", "simpo") else 0.0
    cfg = ObjectiveConfig(name="cpo", beta=0.4, gamma=0.3, loss_type=loss_type,
                          label_smoothing=eps, cpo_alpha=0.6, alpha=alpha)
    _check_all(*losses.cpo(_stats(), cfg), *trl_cpo(loss_type, 0.4, 0.6, 0.3, eps, alpha=alpha))


def test_cpo_without_nll_weight_logs_nll_as_trl():
    """cpo_alpha 0: TRL logs nll_loss 0.0; the chosen NLL itself stays as chosen_nll."""
    cfg = ObjectiveConfig(name="cpo", beta=0.4, cpo_alpha=0.0)
    _check_all(*losses.cpo(_stats(), cfg), *trl_cpo("sigmoid", 0.4, 0.0))
    _, metrics = losses.cpo(_stats(), cfg)
    _check(metrics["chosen_nll"], FIXED["nll_sum"].sum() / FIXED["nll_n"].sum())


def _kto_stats(kl_value):
    f = FIXED
    return {"c_sum": mx.array(f["c_sum"].astype(np.float32)),
            "ref_c": mx.array(f["ref_c"].astype(np.float32)),
            "label": mx.array([1.0, 0.0, 1.0, 0.0]),
            "kl": mx.full((4,), kl_value, mx.float32)}


@pytest.mark.parametrize("loss_type", losses.KTO_LOSS_TYPES)
@pytest.mark.parametrize("kl_shift", [0.8, -3.0])  # a positive KL and one clamped to 0
def test_kto_matches_trl(loss_type, kl_shift):
    kl_logps = FIXED["r_sum"] + kl_shift
    ref_kl_logps = FIXED["r_sum"]
    labels = np.array([1, 0, 1, 0])
    want = trl_kto(loss_type, 0.3, FIXED["c_sum"], FIXED["ref_c"], labels, kl_logps, ref_kl_logps,
                   wd=1.5, wu=0.7)
    cfg = ObjectiveConfig(name="kto", beta=0.3, loss_type=loss_type,
                          desirable_weight=1.5, undesirable_weight=0.7)
    kl = max(kl_shift, 0.0)
    _check_all(*losses.kto(_kto_stats(kl), cfg), *want)


def test_kto_kl_carries_no_gradient():
    cfg = ObjectiveConfig(name="kto", beta=0.3)
    g = mx.grad(lambda kl: losses.kto(dict(_kto_stats(0.0), kl=kl), cfg)[0].sum())(mx.full((4,), 0.5))
    assert np.all(np.array(g) == 0.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="dpo", loss_type="aot"), r"loss_type for dpo must be one of \['sigmoid'"),
    (dict(name="dpo", loss_type="exo_pair"), "label_smoothing must be > 0 for loss_type exo_pair"),
    (dict(name="dpo", loss_type="discopop", discopop_tau=0.0), "discopop_tau must be > 0"),
    (dict(name="simpo", alpha=0.5), r"alpha \(AlphaPO\) is a cpo setting"),
    (dict(name="cpo", alpha=float("nan")), r"alpha \(AlphaPO\) is a cpo setting, a finite number"),
    (dict(name="orpo", loss_type="sigmoid"), "objective 'orpo' has no loss types"),
    (dict(name="cpo", loss_type="simpo", beta=0.0), "beta must be > 0 for cpo"),
    (dict(name="dpo", loss_type="robust", label_smoothing=0.5), r"label_smoothing must be in \[0, 0.5\)"),
    (dict(name="cpo", cpo_alpha=-1.0), "cpo_alpha must be >= 0"),
    (dict(name="kto", undesirable_weight=0.0), "undesirable_weight must be > 0"),
])
def test_bad_objective_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ObjectiveConfig(**kwargs).validate()


@pytest.mark.parametrize("w", [0.0, 2.5])
def test_pref_weight_scales_the_preference_term(w):
    nll = FIXED["nll_sum"].sum() / FIXED["nll_n"].sum()
    want_orpo, _ = trl_orpo(FIXED["c_sum"] / FIXED["c_n"], FIXED["r_sum"] / FIXED["r_n"], nll, 0.2)
    got = losses.orpo(_stats(), ObjectiveConfig(name="orpo", beta=0.2, pref_weight=w))[0].sum()
    _check(got, nll + w * (want_orpo - nll))
    want_cpo, _ = trl_cpo("simpo", 0.4, 0.6, 0.3)
    got = losses.cpo(_stats(), ObjectiveConfig(name="cpo", beta=0.4, gamma=0.3, loss_type="simpo",
                                               cpo_alpha=0.6, pref_weight=w))[0].sum()
    _check(got, 0.6 * nll + w * (want_cpo - 0.6 * nll))



def _graph(*arrays):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "graph.dot")
        mx.export_to_dot(path, *arrays)
        return open(path).read()


@pytest.mark.parametrize("name, loss_type", [("orpo", None), ("orpo_margin", None), ("simpo", None),
                                             ("sft", None)]
                         + [("dpo", t) for t in losses.DPO_LOSS_TYPES]
                         + [("cpo", t) for t in losses.CPO_LOSS_TYPES])
def test_objectives_build_no_compiled_function_or_gather(name, loss_type):
    """On CUDA, MLX builds a compiled function's kernel and a gather's at run
    time (seconds each on a fresh machine); the objectives need neither."""
    eps = 1e-3 if loss_type == "exo_pair" else 0.0
    cfg = ObjectiveConfig(name=name, beta=0.2, loss_type=loss_type, label_smoothing=eps)
    x = _stats()
    terms, metrics = losses.get(name).fn(x, cfg)
    grads = mx.grad(lambda c: losses.get(name).fn(dict(x, c_sum=c), cfg)[0].sum())(x["c_sum"])
    graph = _graph(terms, grads, *[v for v in metrics.values() if isinstance(v, mx.array)])
    assert "Compiled" not in graph and "Gather" not in graph
    assert "Compiled" in _graph(nn.log_sigmoid(x["c_sum"]))  # the check sees one
