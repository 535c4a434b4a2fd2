"""value_and_grad / evaluate against references built on mlx-lm's own forward.

The references call `model(tokens)` (mlx-lm's full forward and logits, one
sequence at a time) and write each objective in plain MLX ops (for gradients) or
numpy after TRL's ORPOTrainer (for the loss and metrics). They share nothing with
flash_cce but the model.
"""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from flash_cce.stack import StackConfig
from flash_cce.stack.batch import Example, Pair
from flash_cce.stack.lm import lora_modules
from flash_cce.train import losses
from flash_cce.train.objectives import ObjectiveConfig, evaluate, value_and_grad
from models import ARCHS, max_diff, random_pair, tiny_model
from test_losses import trl_orpo

# Tolerance: the flash head, the prefix continuation and the per-pair summation
# reorder float32 sums over <= 100 terms through <= 6 layers; measured differences
# are <= 5e-7 on values and gradients of size ~1. 1e-5 relative to the reference's
# largest entry (plus 1e-6) is ~100x float32 epsilon: loose for rounding, tight
# for any real mistake (a dropped token or layer moves values by >= 1e-2).
REL, ABS = 1e-5, 1e-6


def _close(got, want):
    got, want = float(got), float(want)
    assert abs(got - want) <= REL * max(1.0, abs(want)) + ABS, (got, want)


def _grads_close(got, want):
    diff, scale = max_diff(got, want)
    assert diff <= REL * max(1.0, scale) + ABS, (diff, scale)


def _pairs(seed=1):
    rng = np.random.default_rng(seed)
    return [random_pair(rng, 9, 5, 3), random_pair(rng, 6, 2, 7)]


def _logps(model, seq):
    """Per-token log-probs of seq[1:] from mlx-lm's full logits, float32."""
    logits = model(mx.array([seq[:-1]]))[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.take_along_axis(lp, mx.array(seq[1:])[:, None], axis=-1)[:, 0]


def _ref_stats(model, pairs, nll_on_prompt=True):
    out = {k: [] for k in ("c_sum", "c_n", "r_sum", "r_n", "nll_sum", "nll_n")}
    for p in pairs:
        lc, lr = _logps(model, p.chosen), _logps(model, p.rejected)
        # target j + 1 is a response token when j + 1 >= prompt_len
        c_resp, r_resp = lc[p.chosen_prompt_len - 1:], lr[p.rejected_prompt_len - 1:]
        nll = lc if nll_on_prompt else c_resp
        for k, v in (("c_sum", c_resp.sum()), ("c_n", c_resp.size), ("r_sum", r_resp.sum()),
                     ("r_n", r_resp.size), ("nll_sum", -nll.sum()), ("nll_n", nll.size)):
            out[k].append(v if isinstance(v, mx.array) else mx.array(float(v)))
    return {k: mx.stack(v) for k, v in out.items()}


def _ref_loss(model, pairs, cfg, ref=None):
    s = _ref_stats(model, pairs, cfg.nll_on_prompt)
    lw, ll = s["c_sum"] / s["c_n"], s["r_sum"] / s["r_n"]
    nll = s["nll_sum"].sum() / s["nll_n"].sum()
    if cfg.name in ("orpo", "orpo_margin"):
        gamma = cfg.gamma if cfg.name == "orpo_margin" else 0.0
        log_odds = (lw - ll) - (mx.log1p(-mx.exp(lw)) - mx.log1p(-mx.exp(ll)))
        return nll - cfg.beta * nn.log_sigmoid(log_odds - gamma).mean()
    if cfg.name == "simpo":
        return -nn.log_sigmoid(cfg.beta * (lw - ll) - cfg.gamma).mean()
    if cfg.name == "dpo":
        return _ref_dpo(s, ref, cfg).mean()
    if cfg.name == "cpo":
        kind, nll_weight = cfg.loss_type, cfg.cpo_alpha
        if kind == "alphapo":
            kind, nll_weight = "simpo", 0.0
        cw, rw = (lw, ll) if kind in ("ipo", "simpo") else (s["c_sum"], s["r_sum"])
        if cfg.alpha:
            cw, rw = (1 - mx.exp(cw) ** -cfg.alpha) / cfg.alpha, (1 - mx.exp(rw) ** -cfg.alpha) / cfg.alpha
        x, b = cw - rw, cfg.beta
        per = {"sigmoid": lambda: -nn.log_sigmoid(b * x),
               "simpo": lambda: -nn.log_sigmoid(b * x - cfg.gamma),
               "hinge": lambda: mx.maximum(1 - b * x, 0.0),
               "ipo": lambda: (x - 1 / (2 * b)) ** 2}[kind]()
        return per.mean() + nll_weight * nll
    return nll


def _ref_dpo(s, ref, cfg):
    """DPO's per-pair losses by loss_type, in plain MLX ops."""
    b, e = cfg.beta, cfg.label_smoothing
    c, r = s["c_sum"] - ref["c_sum"], s["r_sum"] - ref["r_sum"]
    return {
        "sigmoid": lambda: -nn.log_sigmoid(b * (c - r)),
        "hinge": lambda: mx.maximum(1 - b * (c - r), 0.0),
        "ipo": lambda: (c / s["c_n"] - r / s["r_n"] - 0.5 / b) ** 2,
        "robust": lambda: (-(1 - e) * nn.log_sigmoid(b * (c - r))
                           + e * nn.log_sigmoid(-b * (c - r))) / (1 - 2 * e),
        "nca_pair": lambda: -nn.log_sigmoid(b * c) - 0.5 * nn.log_sigmoid(-b * c) - 0.5 * nn.log_sigmoid(-b * r),
        "sppo_hard": lambda: (c - 0.5 / b) ** 2 + (r + 0.5 / b) ** 2,
        "apo_zero": lambda: 1 - mx.sigmoid(b * c) + mx.sigmoid(b * r),
        "apo_down": lambda: mx.sigmoid(b * c) + 1 - mx.sigmoid(b * (c - r)),
        "exo_pair": lambda: (mx.sigmoid(b * (c - r)) * (nn.log_sigmoid(b * (c - r)) - math.log(1 - e))
                             + mx.sigmoid(b * (r - c)) * (nn.log_sigmoid(b * (r - c)) - math.log(e))),
        "bco_pair": lambda: -nn.log_sigmoid(b * c) - nn.log_sigmoid(-b * r),
        "discopop": lambda: (-nn.log_sigmoid(b * (c - r)) * (1 - mx.sigmoid(b * (c - r) / cfg.discopop_tau))
                             + mx.exp(-b * (c - r)) * mx.sigmoid(b * (c - r) / cfg.discopop_tau)),
        "sigmoid_norm": lambda: -nn.log_sigmoid(b * (c / s["c_n"] - r / s["r_n"])),
    }[cfg.loss_type or "sigmoid"]()


def _ref_value_and_grad(model, pairs, cfg, ref=None):
    return nn.value_and_grad(model, lambda: _ref_loss(model, pairs, cfg, ref))()


def _matches_reference(model, pairs, cfg):
    """Asserts loss and gradients equal the reference's; returns the metrics."""
    loss, grads, metrics = value_and_grad(model, pairs, cfg)
    want_loss, want_grads = _ref_value_and_grad(model, pairs, cfg)
    _close(loss, want_loss)
    _grads_close(grads, want_grads)
    return metrics


@pytest.mark.parametrize("arch", ARCHS)
def test_orpo_matches_trl_on_mlx_lm_logits(arch):
    model = tiny_model(arch, lora=True)
    pairs = _pairs()
    cfg = ObjectiveConfig(name="orpo", beta=0.25)
    loss, grads, metrics = value_and_grad(model, pairs, cfg)
    # Loss and metrics: TRL's formulas in float64 numpy on mlx-lm's log-probs.
    s = {k: np.array(v, np.float64) for k, v in _ref_stats(model, pairs).items()}
    want_loss, want_metrics = trl_orpo(
        s["c_sum"] / s["c_n"], s["r_sum"] / s["r_n"], s["nll_sum"].sum() / s["nll_n"].sum(), 0.25
    )
    _close(loss, want_loss)
    for k, v in want_metrics.items():
        _close(metrics[k], v)
    assert metrics["tokens"].item() == sum(len(p.chosen) + len(p.rejected) for p in pairs)
    assert metrics["prefix_fallbacks"].item() == 0
    # Gradients: the same formulas in MLX ops, differentiated through mlx-lm.
    _, want_grads = _ref_value_and_grad(model, pairs, cfg)
    assert [k for k, _ in tree_flatten(grads)] == [
        k for k, _ in tree_flatten(model.trainable_parameters())
    ]
    _grads_close(grads, want_grads)


@pytest.mark.parametrize("name", ["orpo_margin", "simpo", "sft"])
def test_other_objectives_match_reference(name):
    model = tiny_model("qwen3", lora=True)
    pairs = _pairs(2)
    cfg = ObjectiveConfig(name=name, beta=0.5, gamma=0.3, nll_on_prompt=False)
    _matches_reference(model, pairs, cfg)


def _adapters_off_stats(model, pairs):
    mods = lora_modules(model)
    scales = [m.scale for m in mods]
    for m in mods:
        m.scale = 0.0
    ref = {k: mx.stop_gradient(v) for k, v in _ref_stats(model, pairs).items()}
    for m, sc in zip(mods, scales):
        m.scale = sc
    return ref, mods, scales


@pytest.mark.parametrize("loss_type", losses.DPO_LOSS_TYPES)
def test_dpo_reference_is_the_model_without_adapters(loss_type):
    model = tiny_model("gemma3_text", lora=True)
    pairs = _pairs(3)
    # beta large enough that hinge's 1 - beta * delta changes sign nowhere near 0.
    # discopop's curvature grows as 1/tau^2 (its mixing sigmoid of x/tau), and with it the
    # gradients' sensitivity to the rounding of the log-prob sums; at tau 0.5 it is of the
    # order of the other losses', for which REL holds (test_losses checks tau 0.05 in float64).
    cfg = ObjectiveConfig(name="dpo", beta=0.3, loss_type=loss_type,
                          label_smoothing={"robust": 0.2, "exo_pair": 1e-3}.get(loss_type, 0.0),
                          discopop_tau=0.5)
    loss, grads, metrics = value_and_grad(model, pairs, cfg)
    ref, mods, scales = _adapters_off_stats(model, pairs)
    want_loss, want_grads = _ref_value_and_grad(model, pairs, cfg, ref)
    _close(loss, want_loss)
    _grads_close(grads, want_grads)
    assert [m.scale for m in mods] == scales  # adapters switched back on
    # With adapters this far from zero the policy differs from its reference.
    assert abs(metrics["rewards/margins"].item()) > 1e-4


@pytest.mark.parametrize("loss_type, alpha", [(t, 0.0) for t in losses.CPO_LOSS_TYPES]
                         + [("alphapo", 0.3), ("sigmoid", -0.05)])
def test_cpo_matches_reference(loss_type, alpha):
    """CPO's NLL covers the chosen response only (TRL masks the prompt's labels),
    whatever nll_on_prompt says."""
    model = tiny_model("llama", lora=True)
    pairs = _pairs(9)
    cfg = ObjectiveConfig(name="cpo", beta=0.5, gamma=0.3, loss_type=loss_type, cpo_alpha=0.7, alpha=alpha)
    loss, grads, metrics = value_and_grad(model, pairs, cfg)
    want_loss, want_grads = _ref_value_and_grad(
        model, pairs, ObjectiveConfig(name="cpo", beta=0.5, gamma=0.3, loss_type=loss_type,
                                      cpo_alpha=0.7, alpha=alpha, nll_on_prompt=False))
    _close(loss, want_loss)
    _grads_close(grads, want_grads)


def _examples(seed):
    rng = np.random.default_rng(seed)
    shapes = [(5, 3, True), (7, 4, False), (4, 6, True), (6, 2, False)]
    return [Example(p.chosen, p.chosen_prompt_len, label)
            for p, label in ((random_pair(rng, n, m, 1), lab) for n, m, lab in shapes)]


def _completion_logps(model, seqs_and_plens):
    return mx.stack([_logps(model, s)[n - 1:].sum() for s, n in seqs_and_plens])


@pytest.mark.parametrize("loss_type, frozen", [("kto", False), ("apo_zero_unpaired", False),
                                               ("kto", True)])
def test_kto_matches_reference(loss_type, frozen):
    """KTO's loss and gradients against mlx-lm's logits: the reference is the
    model without adapters (or a frozen base for full fine-tuning), the KL
    estimate the mean log-ratio of each prompt with the previous example's
    completion, clamped at 0, held constant."""
    from flash_cce.train.reference import FrozenModel
    from mlx.utils import tree_map

    examples = _examples(10)
    cfg = ObjectiveConfig(name="kto", beta=0.4, loss_type=loss_type,
                          desirable_weight=1.3, undesirable_weight=0.8)
    own = [(e.tokens, e.prompt_len) for e in examples]
    kl_seqs = [(e.tokens[:e.prompt_len] + examples[i - 1].tokens[examples[i - 1].prompt_len:],
                e.prompt_len) for i, e in enumerate(examples)]
    if frozen:
        base = tiny_model("qwen3")
        model = tiny_model("qwen3")
        model.update(tree_map(lambda p: p + 0.02 * mx.random.normal(p.shape), model.parameters()))
        cfg.reference = FrozenModel(base)
        ref_own, ref_kl = _completion_logps(base, own), _completion_logps(base, kl_seqs)
    else:
        model = tiny_model("qwen3", lora=True)
        mods = lora_modules(model)
        scales = [m.scale for m in mods]
        for m in mods:
            m.scale = 0.0
        ref_own, ref_kl = _completion_logps(model, own), _completion_logps(model, kl_seqs)
        for m, sc in zip(mods, scales):
            m.scale = sc
    loss, grads, metrics = value_and_grad(model, examples, cfg)
    kl = mx.maximum((_completion_logps(model, kl_seqs) - ref_kl).mean(), 0.0)
    if loss_type == "apo_zero_unpaired":
        kl = mx.array(0.0)  # TRL computes no estimate for it and logs 0.0
    label = mx.array([float(e.label) for e in examples])

    def ref_loss():
        ratio = _completion_logps(model, own) - ref_own
        if loss_type == "kto":
            good, bad = 1 - mx.sigmoid(0.4 * (ratio - kl)), 1 - mx.sigmoid(0.4 * (kl - ratio))
        else:
            good, bad = 1 - mx.sigmoid(0.4 * ratio), mx.sigmoid(0.4 * ratio)
        return mx.where(label > 0, 1.3 * good, 0.8 * bad).mean()

    want_loss, want_grads = nn.value_and_grad(model, ref_loss)()
    _close(loss, want_loss)
    _grads_close(grads, want_grads)
    _close(metrics["kl"], kl)
    assert metrics["tokens"].item() == sum(len(e.tokens) for e in examples)
    e_loss, e_metrics = evaluate(model, examples, cfg)
    _close(e_loss, loss)


def test_kto_runs_no_kl_pass_for_apo_zero_unpaired(monkeypatch):
    """apo_zero_unpaired reads no KL estimate: no mismatched sequence is run (TRL's
    calculate_KL is off for it), so a batch of one trains."""
    from flash_cce.train import kto

    seen = []
    real = kto.reference_stats
    monkeypatch.setattr(kto, "statistics", lambda *a, **k: seen.append("policy KL") or [])
    monkeypatch.setattr(kto, "reference_stats", lambda m, pairs, *a: seen.append(len(pairs[0].rejected))
                        or real(m, pairs, *a))
    examples = _examples(3)
    cfg = ObjectiveConfig(name="kto", beta=0.4, loss_type="apo_zero_unpaired")
    loss, _, metrics = value_and_grad(tiny_model("llama", lora=True), examples[:1], cfg)
    assert seen == [len(examples[0].tokens)]  # one reference pass over the example itself
    assert metrics["kl"].item() == 0.0 and math.isfinite(loss.item())


def test_kto_batch_of_one_raises():
    with pytest.raises(ValueError, match="at least 2 examples"):
        value_and_grad(tiny_model("llama", lora=True), _examples(1)[:1], ObjectiveConfig(name="kto"))
    with pytest.raises(ValueError, match=r"examples\[0\] must be a flash_cce.stack.batch.Example"):
        value_and_grad(tiny_model("llama", lora=True), _pairs(), ObjectiveConfig(name="kto"))


def test_dpo_without_adapters_raises():
    with pytest.raises(ValueError, match="LoRA"):
        value_and_grad(tiny_model("llama"), _pairs(), ObjectiveConfig(name="dpo"))


@pytest.mark.parametrize("arch", ["gemma4_text", "minicpm"])
def test_flash_head_matches_full_logits(arch):
    model = tiny_model(arch, lora=True)
    pairs = _pairs(4)
    flash = value_and_grad(model, pairs, ObjectiveConfig(stack=StackConfig(flash_head=True)))
    full = value_and_grad(model, pairs, ObjectiveConfig(stack=StackConfig(flash_head=False)))
    _close(flash[0], full[0])
    _grads_close(flash[1], full[1])


@pytest.mark.parametrize("arch", ["llama", "gemma4_text"])
def test_quantized_base_with_lora(arch):
    model = tiny_model(arch, lora=True, quantize=True)
    pairs = _pairs(5)
    cfg = ObjectiveConfig(stack=StackConfig(segment_size=1))
    _matches_reference(model, pairs, cfg)


def test_full_fine_tuning_tied_head():
    """No adapters: every parameter, the tied embedding/head included, gets its gradient."""
    model = tiny_model("llama", tied=True)
    pairs = _pairs(6)
    cfg = ObjectiveConfig()
    _matches_reference(model, pairs, cfg)


def test_evaluate_equals_value_and_grad():
    model = tiny_model("gemma3_text", lora=True)
    pairs = _pairs(7)
    cfg = ObjectiveConfig()
    loss, _, metrics = value_and_grad(model, pairs, cfg)
    e_loss, e_metrics = evaluate(model, pairs, cfg)
    _close(e_loss, loss)
    assert e_metrics.keys() == metrics.keys()
    for k in metrics:
        _close(e_metrics[k], metrics[k])


def test_prompts_that_tokenise_differently_fall_back():
    rng = np.random.default_rng(8)
    pairs = [random_pair(rng, 5, 3, 4, same_prompt=False), random_pair(rng, 5, 3, 4)]
    model = tiny_model("llama", lora=True)
    cfg = ObjectiveConfig()
    metrics = _matches_reference(model, pairs, cfg)
    assert metrics["prefix_fallbacks"].item() == 1


@pytest.mark.parametrize("pair, match", [
    (Pair([1, 2, 3], [1, 2, 4], 3, 2), "chosen response is empty"),
    (Pair([1, 2, 3], [1, 2, 4], 2, 5), "rejected_prompt_len=5"),
    (Pair([1, 2, 3], [1, 2, 4], -1, 2), "chosen_prompt_len=-1"),
    (Pair([1], [1, 2, 4], 0, 2), "no predicted token"),
    (Pair([1, 2, 500], [1, 2, 4], 2, 2), r"tokens must be ints in \[0, 97\)"),
    (Pair([1, 2, 3.0], [1, 2, 4], 2, 2), "tokens must be ints"),
])
def test_malformed_pairs_raise(pair, match):
    with pytest.raises(ValueError, match=match):
        value_and_grad(tiny_model("llama"), [pair], ObjectiveConfig())


def test_malformed_batch_and_config_raise():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="non-empty list"):
        value_and_grad(model, [], ObjectiveConfig())
    with pytest.raises(ValueError, match=r"pairs\[0\] must be a flash_cce.stack.batch.Pair"):
        value_and_grad(model, [([1, 2], [1, 3])], ObjectiveConfig())
    with pytest.raises(ValueError, match="max_length=8"):
        value_and_grad(model, [Pair(list(range(9)), [1, 2], 1, 1)],
                       ObjectiveConfig(stack=StackConfig(max_length=8)))
    with pytest.raises(ValueError, match="objective name"):
        value_and_grad(model, _pairs(), ObjectiveConfig(name="ipo"))
    with pytest.raises(ValueError, match="loss_type for dpo"):
        value_and_grad(model, _pairs(), ObjectiveConfig(name="dpo", loss_type="ipo2"))
    with pytest.raises(ValueError, match="segment_size"):
        value_and_grad(model, _pairs(), ObjectiveConfig(stack=StackConfig(segment_size=-1)))
