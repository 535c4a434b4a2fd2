"""Where DPO's and KTO's reference log-probs come from.

- `AdaptersOff`: the trained model itself with its LoRA/DoRA adapters switched
  off (the base model; no second model in memory). The default for adapters.
- `FrozenModel`: a second, frozen model (by default the base model loaded again,
  optionally quantized to save memory). What full fine-tuning needs, since its
  weights leave the base behind.
- `Precomputed`: a table of every pair's reference log-probs, computed in one
  pass over the data before training (TRL's `precompute_ref_log_probs`), stored
  in the run directory and reused on resume. The table's fingerprint covers the
  reference model's files, the reference settings and every pair's tokens, so a
  changed model, data set or tokenisation computes it anew.

Each gives, per pair, `{"ref_c": c_sum, "ref_r": r_sum}` (see `losses`).
"""

import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..stack import statistics
from ..stack.lm import adapters_off
from .data import mismatched
from .losses import get, scoring
from .storage import writing

TABLE = "reference_logps.npz"  # in the run directory


# The objective whose statistics hold both sides of a pair (c_sum, r_sum), no NLL.
SIDES = get("dpo")


def reference_stats(model, pairs, cfg, obj):
    """Reference log-probs (`ref_c`, `ref_r`) of `pairs` for objective `obj` from
    `cfg.reference` (default: the model with its adapters off), without gradients."""
    return (cfg.reference or AdaptersOff()).stats(model, pairs, cfg, obj)


def _sums(model, pairs, cfg, obj):
    return [{"ref_c": s["c_sum"], "ref_r": s["r_sum"]}
            for s in statistics(model, pairs, scoring(cfg, obj), cfg.stack)]


class AdaptersOff:
    """The trained model with its adapters off."""

    def stats(self, model, pairs, cfg, obj):
        with adapters_off(model):
            return _sums(model, pairs, cfg, obj)


class FrozenModel:
    """A separate model that never trains."""

    def __init__(self, model):
        model.freeze()
        model.eval()
        self.model = model

    def stats(self, model, pairs, cfg, obj):
        return _sums(self.model, pairs, cfg, obj)


def pair_key(pair):
    """A pair's identity in a `Precomputed` table: the hash of its tokens and prompt lengths."""
    h = hashlib.sha256()
    for seq in (pair.chosen, pair.rejected, [pair.chosen_prompt_len, pair.rejected_prompt_len]):
        h.update(np.asarray(seq, np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:32]


class Precomputed:
    """Reference log-probs looked up by `pair_key`."""

    def __init__(self, table):
        self.table = table  # key -> (ref_c, ref_r)

    def stats(self, model, pairs, cfg, obj):
        out = []
        for i, p in enumerate(pairs):
            got = self.table.get(pair_key(p))
            if got is None:
                raise ValueError(f"reference: pairs[{i}] is not among the precomputed reference "
                                 "log-probs (precompute_ref_log_probs covers the run's data only)")
            out.append({"ref_c": mx.array(got[0], mx.float32), "ref_r": mx.array(got[1], mx.float32)})
        return out


def precompute(source, model, pairs, cfg, obj, log=print):
    """{pair_key: (ref_c, ref_r)} of `pairs` from `source`, in one pass."""
    table = {}
    for start in range(0, len(pairs), 16):
        chunk = pairs[start:start + 16]
        for p, s in zip(chunk, source.stats(model, chunk, cfg, obj)):
            table[pair_key(p)] = (s["ref_c"].item(), s["ref_r"].item())
    log(f"Reference log-probs of {len(pairs)} pairs computed")
    return table


def fingerprint(model_path, settings, pairs):
    """Hash of the reference model's files, the reference settings and the pairs."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    path = Path(model_path).expanduser()
    files = sorted(path.glob("*.safetensors")) + sorted(path.glob("config.json")) if path.is_dir() else []
    h.update(str(model_path if not files else "").encode())
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    for key in sorted(pair_key(p) for p in pairs):
        h.update(key.encode())
    return h.hexdigest()


def save_table(path, table, print_):
    keys = sorted(table)
    tmp = Path(path).with_name(Path(path).name + ".tmp.npz")
    with writing(path):
        try:
            np.savez(tmp, keys=np.array(keys), values=np.array([table[k] for k in keys], np.float64).reshape(-1, 2),
                     fingerprint=np.array(print_))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def load_table(path, print_):
    """The table at `path` if its fingerprint is `print_`, else None."""
    path = Path(path)
    if not path.exists():
        return None
    with np.load(path) as f:
        if str(f["fingerprint"]) != print_:
            return None
        return {str(k): (float(v[0]), float(v[1])) for k, v in zip(f["keys"], f["values"])}


def warm_start(cfg):
    """The init_adapters a DPO/KTO reference starts from (the warm-started model,
    TRL's SFT -> DPO recipe), or None: the base model (warm_reference base, or
    a reference_model given)."""
    if cfg.get("init_adapters") and cfg.get("warm_reference", "init") == "init" and not cfg["reference_model"]:
        return cfg["init_adapters"]
    return None


def _kind(cfg):
    if cfg["reference"] != "auto":
        return cfg["reference"]
    # Adapters switched off give the base, not a warm start: that needs a frozen copy.
    return "adapters_off" if cfg["fine_tune_type"] == "lora" and not warm_start(cfg) else "model"


def _warm_model(cfg, ref_model, adapters):
    """`ref_model` with the warm start's adapters, as the trained model began."""
    from .checkpoint import load_adapters
    from .preflight import prepare_model

    prepare_model(ref_model, cfg["fine_tune_type"], cfg["num_layers"], cfg["lora_parameters"], cfg["quantize"])
    load_adapters(adapters, ref_model, "init_adapters")
    return ref_model


def _adapters_print(adapters):
    if adapters is None:
        return None
    from .identity import file_fingerprint

    return file_fingerprint(Path(adapters) / "adapters.safetensors")


def reference_source(cfg, log):
    """`AdaptersOff()` or a `FrozenModel` of the reference model (with a warm
    start's adapters, see `warm_start`), as the settings `cfg` ask."""
    if _kind(cfg) != "model":
        if cfg.get("init_adapters"):
            log("Reference: the base model (adapters off), not the warm start (warm_reference base)")
        return AdaptersOff()
    from .preflight import load_model, quantize_model

    ref_path, warm = cfg["reference_model"] or cfg["model"], warm_start(cfg)
    ref_model, _ = load_model(dict(cfg, model=ref_path))
    if warm:
        ref_model = _warm_model(cfg, ref_model, warm)
    if cfg["reference_quantize"]:
        quantize_model(ref_model, cfg["reference_quantize"])
    what = f"the warm-started model ({ref_path} with the adapters of {warm})" if warm else f"the frozen model {ref_path}"
    log(f"Reference: {what}" + (f" ({cfg['reference_quantize']['bits']}-bit)" if cfg["reference_quantize"] else ""))
    return FrozenModel(ref_model)


def with_reference(cfg, objective, model, log, pairs=None, run_dir=None):
    """`objective` with the source of its reference log-probs as the settings
    `cfg` ask (for dpo and kto); with `pairs` (kto: examples with their KL
    completions), a precomputed table of theirs, kept in `run_dir`."""
    from dataclasses import replace

    if not get(objective.name).reference:
        return objective
    kind, ref_path = _kind(cfg), cfg["reference_model"] or cfg["model"]
    warm = warm_start(cfg)
    source = reference_source(cfg, log)
    if pairs is None:
        return replace(objective, reference=source)
    obj = get(objective.name)
    if objective.name == "kto":
        # KTO looks up its examples' mismatched pairs (each example and its KL
        # completion, fixed when the data was loaded), both sides at once.
        pairs, obj = mismatched(pairs), SIDES
    print_ = fingerprint(ref_path, {"reference": kind, "quantize": cfg["reference_quantize"],
                                    "model": ref_path, **({"warm": _adapters_print(warm)} if warm else {})}, pairs)
    path = Path(run_dir) / TABLE
    table = load_table(path, print_)
    if table is None:
        table = precompute(source, model, pairs, objective, obj, log)
        if mx.distributed.init().rank() == 0:
            save_table(path, table, print_)
    else:
        log(f"Reference log-probs of {len(table)} pairs read from {path}")
    return replace(objective, reference=Precomputed(table))
