"""Checks of a run's inputs before anything is written: the model directory,
the data splits, warm-start adapters, a GPU capture file. Each failure is one
`RunError` line naming the setting."""

import json
import re
from pathlib import Path

from . import settings
from .checkpoint import ADAPTER_CONFIG

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class RunError(ValueError):
    """A run that cannot start as asked (one line)."""


def model_ref(ref):
    """A local model path made absolute; a hub id as given."""
    if ref is None:
        return None
    p = Path(ref).expanduser()
    return str(p.resolve()) if p.exists() else ref


def flat(cfg):
    out = {}
    for k, v in cfg.items():
        if isinstance(v, dict):
            out.update({f"{k}.{f}": x for f, x in v.items()})
        else:
            out[k] = v
    return out


def check_model(ref, num_layers=None):
    """RunError unless `ref` is a model directory (or looks like a hub id) with
    at least `num_layers` blocks."""
    if ref is None:
        raise RunError("model: give --model (a local mlx-lm model directory or a Hugging Face id)")
    p = Path(ref).expanduser()
    if p.exists():
        if not p.is_dir():
            raise RunError(f"model: {ref!r} is a file; give an mlx-lm model directory")
        if not (p / "config.json").is_file():
            raise RunError(f"model: {ref!r} has no config.json; it is not an mlx-lm model directory")
        if not any(p.glob("*.safetensors")):
            raise RunError(f"model: {ref!r} has no *.safetensors weights")
        try:
            config = json.loads((p / "config.json").read_text())
        except (ValueError, OSError) as e:
            raise RunError(f"model: cannot read {p / 'config.json'}: {e}") from None
        blocks = config.get("num_hidden_layers") if isinstance(config, dict) else None
        if isinstance(blocks, int) and num_layers is not None and num_layers > blocks:
            raise RunError(f"num_layers: got {num_layers}; allowed: -1 or 1 to {blocks} "
                           f"(the model has {blocks} blocks)")
        return
    if not HUB_ID.match(ref) or ref.startswith((".", "~")):
        raise RunError(f"model: no such directory {ref!r}")


def load_model(cfg):
    """(model, tokenizer); a model that cannot be loaded is one RunError line."""
    from mlx_lm.utils import load

    check_model(cfg["model"])
    trust = bool(cfg["trust_remote_code"])
    try:
        return load(cfg["model"], tokenizer_config={"trust_remote_code": trust}, trust_remote_code=trust)
    except Exception as e:  # mlx_lm and huggingface_hub raise many types; one line for all
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if not Path(cfg["model"]).expanduser().exists():
            raise RunError(f"model: {cfg['model']!r} is not a local directory and could not be fetched "
                           f"from the Hugging Face hub (offline or unknown id?): {reason}") from None
        raise RunError(f"model: cannot load {cfg['model']!r}: {reason}") from None


def read_data(cfg, splits):
    """{split: records} after checking the files; RunError for what is missing."""
    from .data import data_kind, read_splits

    if cfg["data"] is None:
        raise RunError("data: give --data (a directory with train.jsonl and valid.jsonl)")
    records = read_splits(cfg["data"], splits, kind=data_kind(cfg["objective"]))
    for split in splits:
        if split == "valid":
            continue
        if split not in records:
            need = "--test needs" if split == "test" and "train" in splits else "needs"
            raise RunError(f"data: {need} {split}.jsonl in {cfg['data']}; there is none")
        if not records[split]:
            raise RunError(f"data: {Path(cfg['data']) / (split + '.jsonl')} holds no records")
    return records


def encode(cfg, tokenizer, records, log):
    from .data import data_kind, encode_records, format_summary

    out = {}
    for split, recs in records.items():
        pairs, report = encode_records(recs, tokenizer, max_seq_length=cfg["max_seq_length"],
                                       truncation=cfg["truncation"], chat_template=cfg["chat_template"],
                                       enable_thinking=cfg["enable_thinking"],
                                       kind=data_kind(cfg["objective"]), kl_chunk=cfg["batch_size"],
                                       objective=cfg["objective"])
        log(format_summary(split, pairs, report))
        for line in degenerate(split, pairs, report, cfg):
            log(line)
        if not pairs and split != "valid":
            raise RunError(f"data: {split}.jsonl has no usable pairs ({report['records']} records, all "
                           f"dropped at max_seq_length={cfg['max_seq_length']} with truncation={cfg['truncation']})")
        out[split] = pairs
    return out


def degenerate(split, pairs, report, cfg):
    """Warnings (one line each) about data that trains without a signal or not
    as written: pairs whose chosen and rejected sides are one sequence, prompts
    whose last tokens merged into the response, prompts that truncation cut away."""
    out = []
    if cfg["objective"] not in ("kto", "sft"):  # the objectives that compare two responses
        same = sum(p.chosen == p.rejected for p in pairs)
        if same:
            out.append(f"Warning: {split}.jsonl: {same} of {len(pairs)} pairs have chosen == rejected "
                       "(nothing to prefer; check the data)")
    if report.get("merged"):
        out.append(f"Warning: {split}.jsonl: in {report['merged']} of {report['records']} records the prompt's "
                   "tokens are no prefix of the prompt and response's (a token merges across the boundary, or "
                   "the chat template renders the prompt alone differently); as TRL does, the response starts "
                   "where they differ (docs/cli.md, Data format)")
    if report.get("prompt_cut"):
        out.append(f"Warning: {split}.jsonl: truncation {cfg['truncation']} cut the whole prompt (BOS "
                   f"included) from {report['prompt_cut']} of {len(pairs)} pairs at max_seq_length="
                   f"{cfg['max_seq_length']}; raise max_seq_length or use truncation keep_start or drop")
    return out


def check_capture(path):
    if path is None:
        return
    import mlx.core as mx

    if not mx.metal.is_available():
        raise RunError("gpu_capture: needs MLX's Metal backend (an Apple GPU); this device has none")
    if not path.endswith(".gputrace"):
        raise RunError(f"gpu_capture: {path!r} must end in .gputrace (Xcode's trace format)")
    if Path(path).exists():
        raise RunError(f"gpu_capture: {path} exists; Metal writes a new trace")


def adapter_settings(path):
    """fine_tune_type, num_layers, lora_parameters of an adapter directory's adapter_config.json."""
    path = Path(path)
    file = path / ADAPTER_CONFIG
    if not file.is_file():
        raise RunError(f"init_adapters: {str(path)!r} has no {ADAPTER_CONFIG} (not an adapter directory)")
    try:
        saved = json.loads(file.read_text())
        out = {k: saved[k] for k in ("fine_tune_type", "num_layers") if k in saved}
        out.setdefault("fine_tune_type", "lora")
        if "lora_parameters" in saved:
            out["lora_parameters"] = saved["lora_parameters"]
        for k, v in out.items():
            out[k] = settings.check_value(settings.BY_NAME[k], v, f"{file}: {k}")
    except (ValueError, TypeError, AttributeError) as e:
        raise RunError(f"init_adapters: {e}") from None
    if "num_layers" not in out:
        raise RunError(f"init_adapters: {file} has no num_layers")
    return out


def check_init_adapters(cfg):
    path = cfg["init_adapters"]
    if path is None:
        return
    theirs = adapter_settings(path)
    if theirs["fine_tune_type"] == "full" or cfg["fine_tune_type"] == "full":
        keys = ("fine_tune_type", "num_layers")
    else:
        keys = ("fine_tune_type", "num_layers", "lora_parameters.rank", "lora_parameters.scale",
                "lora_parameters.keys")
    mine, theirs = flat(cfg), flat(theirs)
    for k in keys:
        if k in theirs and mine[k] != theirs[k]:
            raise RunError(f"init_adapters: the adapters have {k} {settings.show(theirs[k])}, this run "
                           f"{settings.show(mine[k])}; set {k} to match them")


def quantize_model(model, quantize):
    """Quantizes `model`'s dense layers ({"bits", "group_size"}) as `trainer.prepare_model` does."""
    import mlx.nn as nn

    gs, bits = quantize.get("group_size", 64), quantize.get("bits", 4)
    nn.quantize(model, group_size=gs, bits=bits,
                class_predicate=lambda _, m: hasattr(m, "to_quantized")
                and not hasattr(m, "bits") and m.weight.shape[-1] % gs == 0)


def prepare_model(model, fine_tune_type="lora", num_layers=16, lora_parameters=None, quantize=None):
    """Freezes `model` and makes its fine-tuned part trainable, mlx-lm style:
    LoRA/DoRA layers on the last `num_layers` blocks (-1: all) or, for "full",
    those blocks' own weights. `quantize` ({"bits", "group_size"}) quantizes a
    dense base first (QLoRA)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    if fine_tune_type not in ("lora", "dora", "full"):
        raise ValueError(f"fine_tune_type must be 'lora', 'dora' or 'full', got {fine_tune_type!r}")
    if num_layers > len(model.layers) or num_layers == 0 or num_layers < -1:
        raise ValueError(f"num_layers: got {num_layers}; allowed: -1 or 1 to {len(model.layers)} "
                         f"(the model has {len(model.layers)} blocks)")
    if quantize:
        if fine_tune_type == "full":
            raise ValueError("quantize: a quantized base needs fine_tune_type 'lora' or 'dora', not 'full'")
        quantize_model(model, quantize)
    model.freeze()
    if fine_tune_type == "full":
        for layer in model.layers[-max(num_layers, 0):]:
            layer.unfreeze()
    else:
        params = dict(lora_parameters or {})
        params.setdefault("rank", 8)
        params.setdefault("scale", 20.0)
        params.setdefault("dropout", 0.0)
        linear_to_lora_layers(model, num_layers, params, use_dora=fine_tune_type == "dora")
    return model
