"""Preference objectives as pure functions of per-pair log-probability statistics.

Every objective reads a dict of float32 vectors over the pairs of a batch:

- `c_sum`, `r_sum`: summed log-probs of the chosen / rejected response tokens,
- `c_n`, `r_n`: their token counts,
- `nll_sum`, `nll_n`: summed negative log-likelihood and token count of the
  chosen sequence (prompt + response, or the response only),
- `ref_c`, `ref_r`: DPO's reference `c_sum` / `r_sum`.

With `l_w = c_sum / c_n`, `l_l = r_sum / r_n` (length-normalised log-probs),
`NLL = sum(nll_sum) / sum(nll_n)` (token mean over the batch, as TRL) and
`mean` over the pairs:

- orpo:        `NLL - beta * mean(logsigmoid(log_odds))`,
               `log_odds = (l_w - l_l) - (log1mexp(l_w) - log1mexp(l_l))` (TRL's ORPOTrainer)
- orpo_margin: `NLL - beta * mean(logsigmoid(log_odds - gamma))` (ORPO when gamma = 0)
- simpo:       `-mean(logsigmoid(beta * (l_w - l_l) - gamma))`
- dpo:         `-mean(logsigmoid(beta * ((c_sum - ref_c) - (r_sum - ref_r))))`
- sft:         `NLL`

Each returns `(terms, metrics)`: `terms[i]` is pair i's share of the loss, so the
loss is `terms.sum()` and a batch can be differentiated one pair at a time when
the batch totals (`n_pairs`, `nll_tokens`) are passed in.
"""

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

_LN2 = math.log(2.0)
# float32 epsilon: exp(x) rounds to 1 for |x| below ~6e-8, so log(1 - exp(x))
# is -inf there; clamping x <= -eps keeps it (and its gradient) finite.
_EPS = 2.0**-23


def log1mexp(x):
    """`log(1 - exp(x))` for x <= 0, accurate on both sides of -ln 2 (Maechler 2012)."""
    x = mx.minimum(x, -_EPS)
    return mx.where(x < -_LN2, mx.log1p(-mx.exp(x)), mx.log(-mx.expm1(x)))


def _reward_metrics(chosen, rejected):
    return {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracies": (chosen > rejected).astype(mx.float32).mean(),
        "rewards/margins": (chosen - rejected).mean(),
    }


def _nll(stats, nll_tokens):
    total = stats["nll_n"].sum() if nll_tokens is None else nll_tokens
    return stats["nll_sum"] / mx.maximum(mx.array(total, mx.float32), 1.0)


def _odds_ratio(stats, cfg, n_pairs, nll_tokens, gamma):
    n = stats["c_sum"].size if n_pairs is None else n_pairs
    lw = stats["c_sum"] / stats["c_n"]
    ll = stats["r_sum"] / stats["r_n"]
    log_odds = (lw - ll) - (log1mexp(lw) - log1mexp(ll))
    ratio = nn.log_sigmoid(log_odds - gamma)
    nll = _nll(stats, nll_tokens)
    terms = nll - cfg.beta * ratio / n
    metrics = _reward_metrics(cfg.beta * lw, cfg.beta * ll)
    metrics.update({
        "logps/chosen": lw.mean(), "logps/rejected": ll.mean(), "nll_loss": nll.sum(),
        "log_odds_ratio": ratio.mean(), "log_odds_chosen": log_odds.mean(),
    })
    return terms, metrics


def orpo(stats, cfg, n_pairs=None, nll_tokens=None):
    return _odds_ratio(stats, cfg, n_pairs, nll_tokens, 0.0)


def orpo_margin(stats, cfg, n_pairs=None, nll_tokens=None):
    return _odds_ratio(stats, cfg, n_pairs, nll_tokens, cfg.gamma)


def simpo(stats, cfg, n_pairs=None, nll_tokens=None):
    n = stats["c_sum"].size if n_pairs is None else n_pairs
    lw = stats["c_sum"] / stats["c_n"]
    ll = stats["r_sum"] / stats["r_n"]
    terms = -nn.log_sigmoid(cfg.beta * (lw - ll) - cfg.gamma) / n
    metrics = _reward_metrics(cfg.beta * lw, cfg.beta * ll)
    metrics.update({"logps/chosen": lw.mean(), "logps/rejected": ll.mean()})
    return terms, metrics


def dpo(stats, cfg, n_pairs=None, nll_tokens=None):
    n = stats["c_sum"].size if n_pairs is None else n_pairs
    chosen = cfg.beta * (stats["c_sum"] - stats["ref_c"])
    rejected = cfg.beta * (stats["r_sum"] - stats["ref_r"])
    terms = -nn.log_sigmoid(chosen - rejected) / n
    metrics = _reward_metrics(chosen, rejected)
    metrics.update({
        "logps/chosen": stats["c_sum"].mean(), "logps/rejected": stats["r_sum"].mean(),
    })
    return terms, metrics


def sft(stats, cfg, n_pairs=None, nll_tokens=None):
    nll = _nll(stats, nll_tokens)
    return nll, {"nll_loss": nll.sum(), "logps/chosen": (stats["c_sum"] / stats["c_n"]).mean()}


@dataclass(frozen=True)
class Objective:
    """What an objective computes and which statistics it needs."""

    fn: object
    rejected: bool = True  # needs the rejected response
    nll: bool = False  # uses the chosen NLL
    reference: bool = False  # needs reference log-probs (DPO)


OBJECTIVES = {
    "orpo": Objective(orpo, nll=True),
    "orpo_margin": Objective(orpo_margin, nll=True),
    "simpo": Objective(simpo),
    "dpo": Objective(dpo, reference=True),
    "sft": Objective(sft, rejected=False, nll=True),
}


def get(name):
    """The objective called `name` (the one place that maps names to objectives)."""
    if name not in OBJECTIVES:
        raise ValueError(f"objective name must be one of {sorted(OBJECTIVES)}, got {name!r}")
    return OBJECTIVES[name]
