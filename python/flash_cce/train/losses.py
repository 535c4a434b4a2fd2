"""Preference objectives as pure functions of per-pair log-probability statistics.

Every objective reads a dict of float32 vectors over the pairs of a batch:

- `c_sum`, `r_sum`: summed log-probs of the chosen / rejected response tokens,
- `c_n`, `r_n`: their token counts,
- `nll_sum`, `nll_n`: summed negative log-likelihood and token count of the
  chosen sequence (prompt + response, or the response only),
- `ref_c`, `ref_r`: the reference model's `c_sum` / `r_sum` (DPO, KTO),
- `label`, `kl` (KTO): 1 for a desirable example, 0 for an undesirable one, and
  the batch's KL estimate (see `kto`).

With `l_w = c_sum / c_n`, `l_l = r_sum / r_n` (length-normalised log-probs),
`NLL = sum(nll_sum) / sum(nll_n)` (token mean over the batch, as TRL) and
`mean` over the pairs:

- orpo:        `NLL - w * beta * mean(logsigmoid(log_odds))`,
               `log_odds = (l_w - l_l) - (log1mexp(l_w) - log1mexp(l_l))` (TRL's ORPOTrainer)
- orpo_margin: `NLL - w * beta * mean(logsigmoid(log_odds - gamma))` (ORPO when gamma = 0)
- simpo:       `-mean(logsigmoid(beta * (l_w - l_l) - gamma))`
- dpo:         by `loss_type` (TRL's DPOTrainer), on the log-ratios
               `c = c_sum - ref_c`, `r = r_sum - ref_r`; sigmoid:
               `-mean(logsigmoid(beta * (c - r)))` (docs/objectives.md lists the others)
- cpo:         `w` times a reference-free `loss_type` plus `cpo_alpha * NLL` (TRL's CPOTrainer)
- kto:         unpaired examples, `1 - sigmoid(beta * (ratio - kl))` for desirable
               ones and `1 - sigmoid(beta * (kl - ratio))` for the others, weighted
               (TRL's KTOTrainer)
- sft:         `NLL`

`w` is `cfg.pref_weight` (1 in TRL), the preference weight that `controller`
can adjust during training; `PREF_WEIGHTED` names the objectives that have one.

Each returns `(terms, metrics)`: `terms[i]` is pair i's share of the loss, so the
loss is `terms.sum()` and a batch can be differentiated one pair at a time when
the batch totals (`n_pairs`, `nll_tokens`) are passed in.
"""

import math
from dataclasses import dataclass

import mlx.core as mx

_LN2 = math.log(2.0)
# float32 epsilon: exp(x) rounds to 1 for |x| below ~6e-8, so log(1 - exp(x))
# is -inf there; clamping x <= -eps keeps it (and its gradient) finite.
_EPS = 2.0**-23


# mlx.nn's log_sigmoid and relu are compiled functions; on CUDA each compiled
# function is a kernel that MLX builds at run time, seconds of a fresh
# machine's first step for a few scalars' worth of work. The same ops, uncompiled:
def log_sigmoid(x):
    return -mx.logaddexp(-x, 0.0)


def relu(x):
    return mx.maximum(x, 0.0)


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
    ratio = log_sigmoid(log_odds - gamma)
    nll = _nll(stats, nll_tokens)
    terms = nll - cfg.pref_weight * cfg.beta * ratio / n
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
    terms = -log_sigmoid(cfg.beta * (lw - ll) - cfg.gamma) / n
    metrics = _reward_metrics(cfg.beta * lw, cfg.beta * ll)
    metrics.update({"logps/chosen": lw.mean(), "logps/rejected": ll.mean()})
    return terms, metrics


def _sigmoid_smoothed(x, eps):
    """`-(1 - eps) logsigmoid(x) - eps logsigmoid(-x)` (conservative labels)."""
    return -(1 - eps) * log_sigmoid(x) - eps * log_sigmoid(-x)


def _dpo_terms(stats, cfg):
    """Per-pair loss of DPO's `cfg.loss_type` (TRL's DPOTrainer, reverse KL)."""
    beta, eps = cfg.beta, cfg.label_smoothing
    chosen = stats["c_sum"] - stats["ref_c"]  # log-ratios against the reference
    rejected = stats["r_sum"] - stats["ref_r"]
    delta = chosen - rejected
    kind = loss_type(cfg)
    if kind == "sigmoid":
        return -log_sigmoid(beta * delta)
    if kind == "hinge":
        return relu(1 - beta * delta)
    if kind == "ipo":
        # Log-ratios averaged over the response tokens, so beta means the same at any length.
        avg = chosen / mx.maximum(stats["c_n"], 1.0) - rejected / mx.maximum(stats["r_n"], 1.0)
        return (avg - 1 / (2 * beta)) ** 2
    if kind == "robust":
        # Unbiased under labels flipped with probability eps (rDPO).
        return (-(1 - eps) * log_sigmoid(beta * delta)
                + eps * log_sigmoid(-beta * delta)) / (1 - 2 * eps)
    if kind == "nca_pair":
        return (-log_sigmoid(beta * chosen) - 0.5 * log_sigmoid(-beta * chosen)
                - 0.5 * log_sigmoid(-beta * rejected))
    if kind == "sppo_hard":
        return (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2
    if kind == "apo_zero":
        return 1 - mx.sigmoid(beta * chosen) + mx.sigmoid(beta * rejected)
    if kind == "apo_down":
        return mx.sigmoid(beta * chosen) + 1 - mx.sigmoid(beta * delta)
    if kind == "exo_pair":
        # KL from the model's two-way preference to labels smoothed by eps (EXO).
        x = beta * delta
        return (mx.sigmoid(x) * (log_sigmoid(x) - math.log1p(-eps))
                + mx.sigmoid(-x) * (log_sigmoid(-x) - math.log(eps)))
    if kind == "bco_pair":
        return -log_sigmoid(beta * chosen) - log_sigmoid(-beta * rejected)
    if kind == "discopop":
        # Logistic where the margin is negative, exponential where positive, mixed by sigmoid(x / tau).
        x = beta * delta
        mix = mx.sigmoid(x / cfg.discopop_tau)
        return -log_sigmoid(x) * (1 - mix) + mx.exp(-x) * mix
    if kind == "sigmoid_norm":
        avg = chosen / mx.maximum(stats["c_n"], 1.0) - rejected / mx.maximum(stats["r_n"], 1.0)
        return -log_sigmoid(beta * avg)
    raise ValueError(f"loss_type for dpo must be one of {DPO_LOSS_TYPES}, got {kind!r}")


def dpo(stats, cfg, n_pairs=None, nll_tokens=None):
    n = stats["c_sum"].size if n_pairs is None else n_pairs
    terms = _dpo_terms(stats, cfg) / n
    chosen = cfg.beta * (stats["c_sum"] - stats["ref_c"])
    rejected = cfg.beta * (stats["r_sum"] - stats["ref_r"])
    metrics = _reward_metrics(chosen, rejected)
    metrics.update({
        "logps/chosen": stats["c_sum"].mean(), "logps/rejected": stats["r_sum"].mean(),
    })
    return terms, metrics


def cpo(stats, cfg, n_pairs=None, nll_tokens=None):
    """TRL's CPOTrainer: a reference-free preference loss plus `cpo_alpha` times
    the chosen response's NLL (with loss_type simpo: SFT + SimPO in one stage)."""
    n = stats["c_sum"].size if n_pairs is None else n_pairs
    beta, kind = cfg.beta, loss_type(cfg)
    cpo_alpha = 0.0 if kind == "alphapo" else cfg.cpo_alpha  # TRL: alphapo is simpo without the NLL
    kind = "simpo" if kind == "alphapo" else kind
    if kind in ("ipo", "simpo"):  # length-averaged log-probs
        logps_w, logps_l = stats["c_sum"] / stats["c_n"], stats["r_sum"] / stats["r_n"]
    else:
        logps_w, logps_l = stats["c_sum"], stats["r_sum"]
    lw, ll = logps_w, logps_l  # the rewards
    if cfg.alpha != 0:
        # AlphaPO's rewards (1 - p^-alpha) / alpha of p = exp(log-prob), written with expm1.
        lw, ll = -mx.expm1(-cfg.alpha * lw) / cfg.alpha, -mx.expm1(-cfg.alpha * ll) / cfg.alpha
    logits = lw - ll
    if kind == "simpo":
        pref = _sigmoid_smoothed(beta * (logits - cfg.gamma / beta), cfg.label_smoothing)
    elif kind == "sigmoid":
        pref = _sigmoid_smoothed(beta * logits, cfg.label_smoothing)
    elif kind == "hinge":
        pref = relu(1 - beta * logits)
    elif kind == "ipo":
        pref = (logits - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"loss_type for cpo must be one of {CPO_LOSS_TYPES}, got {kind!r}")
    nll = _nll(stats, nll_tokens)
    terms = cfg.pref_weight * pref / n + cpo_alpha * nll
    metrics = _reward_metrics(beta * lw, beta * ll)
    # TRL computes no NLL when its weight is 0 and logs 0.0; the chosen NLL itself
    # is `chosen_nll` (what the adaptive weight holds).
    metrics.update({"logps/chosen": logps_w.mean(), "logps/rejected": logps_l.mean(),
                    "nll_loss": nll.sum() if cpo_alpha != 0 else mx.zeros(()), "chosen_nll": nll.sum()})
    return terms, metrics


def kto(stats, cfg, n_pairs=None, nll_tokens=None):
    """TRL's KTOTrainer (loss_type kto / apo_zero_unpaired) on unpaired examples.

    Reads `c_sum` (the completion's summed log-probs), `ref_c`, `label` (1:
    desirable, 0: undesirable) and `kl`, the batch's KL estimate (the same value
    in every row, a constant: TRL detaches it and clamps it at 0).
    """
    n = stats["c_sum"].size if n_pairs is None else n_pairs
    beta, label = cfg.beta, stats["label"]
    ratio = stats["c_sum"] - stats["ref_c"]
    kl = mx.stop_gradient(stats["kl"])
    kind = loss_type(cfg)
    if kind == "kto":
        good, bad = 1 - mx.sigmoid(beta * (ratio - kl)), 1 - mx.sigmoid(beta * (kl - ratio))
    elif kind == "apo_zero_unpaired":
        good, bad = 1 - mx.sigmoid(beta * ratio), mx.sigmoid(beta * ratio)
    else:
        raise ValueError(f"loss_type for kto must be one of {KTO_LOSS_TYPES}, got {kind!r}")
    terms = mx.where(label > 0, cfg.desirable_weight * good, cfg.undesirable_weight * bad) / n
    rewards = beta * ratio
    n_good, n_bad = label.sum(), (1 - label).sum()
    metrics = {"kl": kl.mean()}
    # TRL logs a side's means only when the batch has examples of that side.
    good_mean = lambda v: (v * label).sum() / mx.maximum(n_good, 1.0)  # noqa: E731
    bad_mean = lambda v: (v * (1 - label)).sum() / mx.maximum(n_bad, 1.0)  # noqa: E731
    metrics.update({
        "rewards/chosen": good_mean(rewards), "logps/chosen": good_mean(stats["c_sum"]),
        "rewards/rejected": bad_mean(rewards), "logps/rejected": bad_mean(stats["c_sum"]),
    })
    metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return terms, metrics


def sft(stats, cfg, n_pairs=None, nll_tokens=None):
    nll = _nll(stats, nll_tokens)
    return nll, {"nll_loss": nll.sum(), "logps/chosen": (stats["c_sum"] / stats["c_n"]).mean()}


DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "nca_pair", "sppo_hard", "apo_zero", "apo_down",
                  "exo_pair", "bco_pair", "discopop", "sigmoid_norm")
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo", "alphapo")
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
PREF_WEIGHTED = ("orpo", "orpo_margin", "cpo")  # an NLL term and a weighted preference term


@dataclass(frozen=True)
class Objective:
    """What an objective computes and which statistics it needs."""

    fn: object
    rejected: bool = True  # needs the rejected response
    nll: bool = False  # uses the chosen NLL
    reference: bool = False  # needs reference log-probs (DPO)
    loss_types: tuple = ()  # accepted `loss_type` values, the first the default
    nll_on_prompt: object = None  # None: as configured; False: the response only (TRL's CPO)


OBJECTIVES = {
    "orpo": Objective(orpo, nll=True),
    "orpo_margin": Objective(orpo_margin, nll=True),
    "simpo": Objective(simpo),
    "dpo": Objective(dpo, reference=True, loss_types=DPO_LOSS_TYPES),
    "cpo": Objective(cpo, nll=True, loss_types=CPO_LOSS_TYPES, nll_on_prompt=False),
    "kto": Objective(kto, rejected=False, reference=True, loss_types=KTO_LOSS_TYPES),
    "sft": Objective(sft, rejected=False, nll=True),
}


def get(name):
    """The objective called `name` (the one place that maps names to objectives)."""
    if name not in OBJECTIVES:
        raise ValueError(f"objective name must be one of {sorted(OBJECTIVES)}, got {name!r}")
    return OBJECTIVES[name]


def scoring(cfg, obj=None, token_stats=False):
    """What the stack scores of each pair (`flash_cce.stack.Scoring`) for the
    objective of `cfg` (an ObjectiveConfig); `token_stats` adds what
    `token_metrics` reads."""
    from ..stack import Scoring

    obj = obj or get(cfg.name)
    on_prompt = cfg.nll_on_prompt if obj.nll_on_prompt is None else obj.nll_on_prompt
    return Scoring(rejected=obj.rejected, nll=obj.nll, nll_on_prompt=on_prompt, token_stats=token_stats)


def token_metrics(name, stats):
    """TRL's `entropy`, `mean_token_accuracy` and `logits/chosen|rejected` from the
    stack's token statistics (`Scoring.token_stats`), token means as TRL takes
    them: sft over its loss tokens; kto over the completions (logits by label);
    the pair objectives' entropy over both responses, accuracy over the chosen."""
    def mean(num, den):
        return num.sum() / mx.maximum(den.sum(), 1.0)

    if name == "sft":
        return {"entropy": mean(stats["nll_ent_sum"], stats["nll_n"]),
                "mean_token_accuracy": mean(stats["nll_top1_sum"], stats["nll_n"])}
    out = {"logits/chosen": mean(stats["c_logit_sum"], stats["c_n"]),
           "logits/rejected": mean(stats["r_logit_sum"], stats["r_n"])}
    if name == "kto":
        good = stats["label"]
        out = {"entropy": mean(stats["c_ent_sum"], stats["c_n"]),
               "logits/chosen": mean(stats["c_logit_sum"] * good, stats["c_n"] * good),
               "logits/rejected": mean(stats["c_logit_sum"] * (1 - good), stats["c_n"] * (1 - good))}
        return out
    out["entropy"] = mean(stats["c_ent_sum"] + stats["r_ent_sum"], stats["c_n"] + stats["r_n"])
    out["mean_token_accuracy"] = mean(stats["c_top1_sum"], stats["c_n"])
    return out


def loss_type(cfg):
    """`cfg.loss_type`, or where None the objective's default (its first)."""
    types = get(cfg.name).loss_types
    return cfg.loss_type if cfg.loss_type is not None else (types[0] if types else None)


def validate(cfg):
    """Raises ValueError naming the setting of `cfg` that `cfg.name` cannot use."""
    obj = get(cfg.name)
    if cfg.loss_type is not None and cfg.loss_type not in obj.loss_types:
        if not obj.loss_types:
            raise ValueError(f"loss_type: objective {cfg.name!r} has no loss types, got {cfg.loss_type!r}")
        raise ValueError(f"loss_type for {cfg.name} must be one of {list(obj.loss_types)}, got {cfg.loss_type!r}")
    if obj.loss_types and not cfg.beta > 0:
        raise ValueError(f"beta must be > 0 for {cfg.name}, got {cfg.beta}")
    if not 0 <= cfg.label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {cfg.label_smoothing}")
    if loss_type(cfg) == "exo_pair" and not cfg.label_smoothing > 0:
        raise ValueError("label_smoothing must be > 0 for loss_type exo_pair (EXO's epsilon; the paper "
                         f"uses 1e-3), got {cfg.label_smoothing}")
    if not math.isfinite(cfg.alpha) or (cfg.alpha != 0 and cfg.name != "cpo"):
        raise ValueError(f"alpha (AlphaPO) is a cpo setting, a finite number; got {cfg.alpha} for {cfg.name}")
    if not cfg.discopop_tau > 0:
        raise ValueError(f"discopop_tau must be > 0, got {cfg.discopop_tau}")
    if not cfg.pref_weight >= 0:
        raise ValueError(f"pref_weight must be >= 0, got {cfg.pref_weight}")
    if not cfg.cpo_alpha >= 0:
        raise ValueError(f"cpo_alpha must be >= 0, got {cfg.cpo_alpha}")
    for name in ("desirable_weight", "undesirable_weight"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"{name} must be > 0, got {getattr(cfg, name)}")
