"""GRPO on recorded rollouts: TRL 1.16.0 GRPOTrainer's objective through the stack.

    loss, grads, metrics = grpo_value_and_grad(model, rollouts, GRPOConfig(...))

`rollouts` (`Rollouts`) holds per group a prompt's tokens, its G completions'
tokens, their rewards per reward function and their truncation flags (and
optionally the behaviour policy's and a reference's per-token log-probs). The
function computes the advantages from the rewards as TRL does, runs each group
through the stack (the prompt encoded once for its G completions, the flash
head on the completion tokens, log-probs and entropies of logits /
temperature), and differentiates TRL's loss for `config.loss_type` with respect
to `model.trainable_parameters()`. The metrics carry TRL's names. One call is
one micro-batch of TRL's with one process: docs/grpo.md says how the settings,
the micro-batches and the normalizers map.
"""

import mlx.core as mx
import numpy as np

from ..stack import StackConfig
from ..stack.groups import group_logprobs, group_value_and_grad
from ..stack.lm import adapters_off, lora_modules
from . import grpo_loss
from .grpo_config import PER_STEP_MEAN, GRPOConfig
from .grpo_rollouts import Rollouts, advantages, completion_metrics, loss_mask_counts
from .reference import AdaptersOff, FrozenModel, Precomputed

__all__ = ["GRPOConfig", "Rollouts", "grpo_value_and_grad", "grpo_loss_and_metrics",
           "behaviour_logps", "reference_logps"]


def _check(model, rollouts, config, stack):
    config = GRPOConfig() if config is None else config
    if not isinstance(config, GRPOConfig):
        raise ValueError(f"config must be a flash_cce.train.grpo.GRPOConfig, got {type(config).__name__}")
    config.validate()
    if not isinstance(rollouts, Rollouts):
        raise ValueError(f"rollouts must be a flash_cce.train.grpo.Rollouts, got {type(rollouts).__name__}")
    if not isinstance(stack, StackConfig):
        raise ValueError(f"stack must be a flash_cce.stack.StackConfig, got {type(stack).__name__}")
    stack.validate()
    rollouts.validate(config, model.args.vocab_size)
    return config


def _padded(rows, G, width):
    """`[G, width]` float32 of G lists, zero past each list's end."""
    out = np.zeros((G, width), np.float32)
    for g, r in enumerate(rows):
        out[g, :len(r)] = r
    return mx.array(out)


def _source(reference, model):
    if reference is None:
        if not lora_modules(model):
            raise ValueError("reference: beta != 0 needs reference log-probs, and the model has no LoRA "
                             "adapters to switch off; pass reference=FrozenModel(...) or Rollouts.ref_logps")
        return AdaptersOff()
    if isinstance(reference, Precomputed):
        raise ValueError("reference: a Precomputed table holds pairs' summed log-probs; give GRPO's "
                         "precomputed reference as Rollouts.ref_logps (per completion token)")
    if not isinstance(reference, (AdaptersOff, FrozenModel)):
        raise ValueError("reference must be None, flash_cce.train.reference.AdaptersOff or FrozenModel, "
                         f"got {type(reference).__name__}")
    return reference


def reference_logps(model, rollouts, config, reference=None, stack=StackConfig()):
    """The reference's per-token log-probs of the completions (of logits /
    temperature, as TRL), per group `[G][tokens]`: for `Rollouts.ref_logps`, so
    that several updates of one generated batch compute them once. `reference`:
    None (the model with its adapters off), `AdaptersOff` or `FrozenModel`."""
    config = _check(model, rollouts, config, stack)
    return _reference(model, rollouts, config, _source(reference, model), stack)


def behaviour_logps(model, rollouts, config, stack=StackConfig()):
    """The current policy's per-token log-probs of the completions, per group
    `[G][tokens]`: `Rollouts.old_logps` for the updates after the first of a
    generated batch (where `config.needs_old_logps()`, as TRL computes them)."""
    config = _check(model, rollouts, config, stack)
    return _unpadded(rollouts, group_logprobs(model, rollouts.groups(), stack,
                                              temperature=config.temperature))


def _unpadded(rollouts, outs):
    return [[np.array(o["logps"][g, :len(c)]).tolist() for g, c in enumerate(cs)]
            for o, cs in zip(outs, rollouts.completions)]


def _reference(model, rollouts, config, source, stack):
    groups = rollouts.groups()
    if isinstance(source, FrozenModel):
        outs = group_logprobs(source.model, groups, stack, temperature=config.temperature)
    else:
        with adapters_off(model):
            outs = group_logprobs(model, groups, stack, temperature=config.temperature)
    return _unpadded(rollouts, outs)


def _check_sampler(config, rollouts):
    """Whether the sampler correction applies; ValueError for a mode the loss type cannot take."""
    if rollouts.sampling_logps is None or not config.vllm_importance_sampling_correction:
        return False
    mode = config.vllm_importance_sampling_mode
    if config.loss_type == "vespo" and mode.startswith("sequence"):
        raise ValueError("vllm_importance_sampling_mode must be 'token_truncate' or 'token_mask' for "
                         f"loss_type 'vespo', got {mode!r}")
    return True


def _prepare(model, rollouts, config, reference, stack):
    """(config, groups, per-group inputs of the loss, batch totals, metrics
    of the rollouts) before any group runs with gradients."""
    config = _check(model, rollouts, config, stack)
    correct = _check_sampler(config, rollouts)
    source = _source(reference, model) if config.beta != 0.0 and rollouts.ref_logps is None else None
    groups, G = rollouts.groups(), config.num_generations
    adv, metrics = advantages(rollouts, config)
    metrics.update(completion_metrics(rollouts))
    counts = loss_mask_counts(rollouts, config).reshape(len(groups), G)
    ref = rollouts.ref_logps if source is None else _reference(model, rollouts, config, source, stack)
    old, entropy_masks = rollouts.old_logps, None
    # TRL computes the old log-probs after generation whenever it corrects; the
    # entropy mask needs the batch's entropies before any gradient: one forward.
    needs_old, needs_entropy = correct and old is None, config.top_entropy_quantile < 1.0
    if needs_old or needs_entropy:
        outs = group_logprobs(model, groups, stack, temperature=config.temperature, entropy=needs_entropy)
        if needs_old:
            old = _unpadded(rollouts, outs)
        if needs_entropy:
            entropy_masks = _entropy_masks(outs, counts, config)
    items, lengths = int(counts.sum()), rollouts.lengths()
    totals = grpo_loss.Totals(
        sequences=len(lengths), tokens=items,
        items=items if rollouts.num_items_in_batch is None else rollouts.num_items_in_batch,
        width=int(lengths.max()),
        entropy_tokens=items if entropy_masks is None else int(sum(float(m.sum()) for m in entropy_masks)))
    data = []
    for i, cs in enumerate(rollouts.completions):
        width = max(map(len, cs))
        mask = (np.arange(width)[None, :] < counts[i][:, None]).astype(np.float32)
        d = {"mask": mx.array(mask), "adv": mx.array(adv[i * G:(i + 1) * G].astype(np.float32))[:, None],
             "entropy_mask": None if entropy_masks is None else entropy_masks[i]}
        for name, rows in (("old", old), ("sampling", rollouts.sampling_logps), ("ref", ref)):
            d[name] = None if rows is None else _padded(rows[i], G, width)
        d["is_ratio"] = grpo_loss.sampler_ratio(config, d["old"], d["sampling"], d["mask"]) if correct else None
        data.append(d)
    if correct:
        metrics.update(_sampler_metrics(data))
    return config, groups, data, totals, metrics


def _entropy_masks(outs, counts, config):
    """TRL's `get_high_entropy_mask` over the batch: per group, 1 where a loss
    token's entropy is at least the (1 - top_entropy_quantile) quantile of the
    batch's loss tokens' entropies. The entropies come from a forward without
    gradients (the mask carries none); the loss pass's metric recomputes them."""
    ents = [np.array(o["entropy"]) for o in outs]
    masks = [np.arange(e.shape[1])[None, :] < counts[i][:, None] for i, e in enumerate(ents)]
    pool = np.concatenate([e[m] for e, m in zip(ents, masks)]).astype(np.float32)
    if pool.size == 0:
        return [mx.zeros(e.shape, mx.float32) for e in ents]
    threshold = np.quantile(pool, 1.0 - config.top_entropy_quantile)
    return [mx.array(((e * m >= threshold) & m).astype(np.float32)) for e, m in zip(ents, masks)]


def _sampler_metrics(data):
    """TRL's `sampling/*` metrics: |old - sampler| over the loss tokens, and the
    correction's ratios (per sequence, or per loss token); 0 where there are none."""
    diffs, ratios = [], []
    for d in data:
        mask = np.array(d["mask"]) > 0
        diffs.append(np.abs(np.array(d["old"]) - np.array(d["sampling"]))[mask])
        r = np.array(d["is_ratio"])
        ratios.append(r[:, 0] if r.shape[-1] == 1 else r[mask])
    diffs, ratios = np.concatenate(diffs), np.concatenate(ratios)

    def stat(fn, x):
        return float(fn(x)) if x.size else 0.0

    return {"sampling/sampling_logp_difference/mean": stat(np.mean, diffs),
            "sampling/sampling_logp_difference/max": stat(np.max, diffs),
            "sampling/importance_sampling_ratio/min": stat(np.min, ratios),
            "sampling/importance_sampling_ratio/mean": stat(np.mean, ratios),
            "sampling/importance_sampling_ratio/max": stat(np.max, ratios)}


def _group_loss(config, d, out, totals):
    """(the group's share of the loss, its policy term's share, the parts its metrics read)."""
    lp = out["logps"]
    old = mx.stop_gradient(lp) if d["old"] is None else d["old"]
    loss, parts = grpo_loss.per_token(config, lp, old, d["ref"], d["mask"], d["adv"], d["entropy_mask"],
                                      d["sampling"], d["is_ratio"], totals.width)
    policy = grpo_loss.share(config, loss, d["mask"], totals)
    if config.entropy_coef == 0.0:
        return policy, policy, parts
    bonus = grpo_loss.entropy_share(config, out["entropy"], d["mask"], d["entropy_mask"], totals)
    return policy - config.entropy_coef * bonus, policy, parts


def grpo_value_and_grad(model, rollouts, config=None, reference=None, stack=StackConfig(), micro_group=None):
    """(loss, gradients, metrics) of TRL's GRPO objective on `rollouts`.

    - `config`: a `GRPOConfig` (TRL's field names and defaults; default dapo, beta 0),
    - `reference`: where the KL's reference log-probs come from when `beta != 0`
      and `rollouts.ref_logps` is None: None (the model with its LoRA adapters
      off), `reference.AdaptersOff()` or `reference.FrozenModel(model)`,
    - `stack`: how the model runs (`flash_cce.stack.StackConfig`),
    - `micro_group`: completions per pass of a group (None: all G), the prompt
      still encoded once; the peak then holds one micro-group's activations
      (`flash_cce.stack.micro`). The results are the same.

    The loss is an `mx.array` scalar (TRL's loss of the batch as one micro-batch
    of one process), the gradients the tree of `model.trainable_parameters()`,
    the metrics a dict of floats named as TRL logs them: `reward`,
    `reward_std`, `rewards/<name>/mean` and `/std`, `frac_reward_zero_std`,
    `completions/*`, `kl` (beta != 0), `entropy`, and per loss type
    `clip_ratio/low_mean`, `/high_mean`, `/region_mean`, `/low_min`,
    `/high_max` (grpo, bnpo, dr_grpo, dapo, luspo), `cispo_clip_ratio`,
    `vespo/phi_seq_mean`.
    """
    config, groups, data, totals, metrics = _prepare(model, rollouts, config, reference, stack)

    def loss(i, out):
        return _group_loss(config, data[i], out, totals)[0]

    # The entropy is a metric unless the loss has TRL's entropy bonus.
    outs, grads = group_value_and_grad(model, groups, loss, stack, temperature=config.temperature,
                                       entropy=True, entropy_grad=config.entropy_coef != 0.0,
                                       micro_group=micro_group)
    total, loss_metrics = _reduce(config, data, outs, totals)
    metrics.update(loss_metrics)
    return total, grads, metrics


def grpo_loss_and_metrics(model, rollouts, config=None, reference=None, stack=StackConfig()):
    """(loss, metrics) of `grpo_value_and_grad`, without gradients (evaluation)."""
    config, groups, data, totals, metrics = _prepare(model, rollouts, config, reference, stack)
    outs = group_logprobs(model, groups, stack, temperature=config.temperature, entropy=True)
    total, loss_metrics = _reduce(config, data, outs, totals)
    metrics.update(loss_metrics)
    return total, metrics


def _reduce(config, data, outs, totals):
    """The batch loss (the sum of the group shares) and TRL's loss metrics."""
    total, policy = mx.array(0.0), mx.array(0.0)
    sums, seq = {}, {"seq_low": [], "seq_high": []}
    for d, out in zip(data, outs):
        share, policy_share, parts = _group_loss(config, d, out, totals)
        total, policy = total + share, policy + policy_share
        for name, value in grpo_loss.metric_sums(config, parts, d["mask"], d["adv"], out["entropy"]).items():
            if name in seq:
                seq[name].append(np.array(value))
            else:
                s, n = sums.get(name, (0.0, 0.0))
                v = np.array(value)  # on the host: an integer index is a gather on the GPU
                sums[name] = (s + float(v[0]), n + float(v[1]))
    metrics = {name: s / max(n, 1.0) for name, (s, n) in sums.items()}
    if config.entropy_coef != 0.0:
        # TRL logs the policy term before its division by the accumulation steps.
        steps = config.gradient_accumulation_steps if config.loss_type in PER_STEP_MEAN else 1
        metrics["policy_loss"] = policy.item() * steps
        metrics["entropy_coef"] = float(config.entropy_coef)
    if seq["seq_low"]:
        low, high = np.concatenate(seq["seq_low"]), np.concatenate(seq["seq_high"])
        metrics["clip_ratio/low_min"] = float(np.nanmin(low)) if not np.isnan(low).all() else float("nan")
        metrics["clip_ratio/high_max"] = float(np.nanmax(high)) if not np.isnan(high).all() else float("nan")
    return total, metrics
