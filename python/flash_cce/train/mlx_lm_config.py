"""`mlx_lm.lora`'s settings read by `flash-cce train`: its YAML keys and flags.

An `mlx_lm.lora` config file trains with `flash-cce train --config` unchanged:
each of its keys either means one of our settings (`KEYS` says which, and
docs/cli.md has the table) or, where it has no meaning here, is refused in one
line saying why and what to use instead. The same holds for its flags
(`add_flags`). Keys that are ours already (`iters`, `lora_parameters`, ...)
pass through untouched; `lr_schedule` may be mlx_lm's mapping
(`{name, arguments, warmup, warmup_init}`), checked by `check_schedule`.
"""

import argparse
import math
from pathlib import Path

from .settings import SCHEDULES, SettingsError

# MLX's AdamW defaults (mlx.optimizers.AdamW): what an `optimizer: adamw` file
# without `optimizer_config` trains with under mlx_lm.lora.
ADAMW_WEIGHT_DECAY = 0.01
ADAM_DEFAULTS = {"betas": [0.9, 0.999], "eps": 1e-8, "bias_correction": False}

# mlx.optimizers' schedules that mlx_lm's `lr_schedule: {name: ...}` may name,
# with the number of arguments each takes (at least, at most).

def _same(ours):
    def put(value, out):
        out[ours] = value
    return put


def _nothing_unless(allowed, why):
    """Accepts the values in `allowed` (mlx_lm's defaults, meaning nothing here); refuses others with `why`."""
    def put(value, out, key):
        if value not in allowed:
            raise SettingsError(f"{key}: got {value!r}; {why}")
    return put


def _train(value, out, key):
    # mlx_lm.lora's switch between training and testing is the command here;
    # its files say `train: false` and pass `--train` on the command line.
    if value is not None and not isinstance(value, bool):
        raise SettingsError(f"{key}: got {value!r}; allowed: true or false")


def _optimizer(value, out, key, config=None):
    if value not in ("adam", "adamw"):
        raise SettingsError(f"optimizer: got {value!r}; flash-cce trains with AdamW (MLX's), so allowed: "
                            "adam (weight_decay 0) or adamw")
    options = dict((config or {}).get(value) or {})
    for name, default in ADAM_DEFAULTS.items():
        if name in options:
            given = options.pop(name)
            if (list(given) if isinstance(given, (list, tuple)) else given) != default:
                raise SettingsError(f"optimizer_config.{value}.{name}: got {given!r}; flash-cce's AdamW keeps "
                                    f"MLX's {name} {default!r}: remove it")
    decay = options.pop("weight_decay", None)
    if options:
        raise SettingsError(f"optimizer_config.{value}: unknown key {next(iter(options))!r}; "
                            "allowed: weight_decay, betas, eps, bias_correction")
    if value == "adam":
        if decay is not None:
            raise SettingsError("optimizer_config.adam.weight_decay: Adam has none; use optimizer: adamw")
        decay = 0.0
    out["weight_decay"] = ADAMW_WEIGHT_DECAY if decay is None else decay


def _optimizer_config(value, out, key):
    if not isinstance(value, dict) or not all(isinstance(v, dict) or v is None for v in value.values()):
        raise SettingsError(f"optimizer_config: got {value!r}; allowed: a mapping of optimizer name to its "
                            "options, as mlx_lm.lora reads it")
    # Read with `optimizer` (mlx_lm uses only the chosen optimizer's entry).


def _resume_adapter_file(value, out, key):
    if value is None:
        return
    path = Path(str(value))
    if path.suffix == ".safetensors":
        if path.name != "adapters.safetensors":
            raise SettingsError(f"resume_adapter_file: got {str(value)!r}; flash-cce starts from an adapter "
                                "directory (adapters.safetensors and adapter_config.json): give it as init_adapters")
        path = path.parent
    out["init_adapters"] = str(path)


def _grad_checkpoint(value, out, key):
    if not isinstance(value, bool):
        raise SettingsError(f"grad_checkpoint: got {value!r}; allowed: true or false")
    if value:
        out["segment_size"] = 1  # every block its own checkpoint, as mlx_lm's grad_checkpoint
    # false: segment_size stays null (checkpoint segments chosen by length; 0 turns them off)


def _mask_prompt(value, out, key):
    if not isinstance(value, bool):
        raise SettingsError(f"mask_prompt: got {value!r}; allowed: true or false")
    out["nll_on_prompt"] = not value


def _config(value, out, key):
    if value is not None:
        raise SettingsError("config: a config file cannot name another; give one file with --config")


NO_REPORTS = "flash-cce writes its metrics to RUN_DIR/metrics.jsonl (TRL's names) and reports to no service: remove it"

# mlx_lm.lora's keys (0.32's CONFIG_DEFAULTS and what its data loader reads) that
# are not ours: what each becomes, and the table in docs/cli.md.
KEYS = {
    "train": (_train, "read, unused: the command decides (`flash-cce train` trains, `flash-cce eval --split test` tests)"),
    "optimizer": (None, "`adam`: `weight_decay: 0`; `adamw`: `weight_decay` from `optimizer_config.adamw` "
                        "(MLX's 0.01 if unset); others refused (flash-cce trains with AdamW)"),
    "optimizer_config": (_optimizer_config, "the chosen optimizer's `weight_decay`; `betas`, `eps`, "
                                            "`bias_correction` only at MLX's defaults"),
    "steps_per_report": (_same("steps_per_report"), "`steps_per_report`"),
    "resume_adapter_file": (_resume_adapter_file, "`init_adapters` (its directory: a warm start with a fresh "
                                                  "optimizer, as mlx_lm's)"),
    "adapter_path": (_same("run_dir"), "`run_dir` (adapters in `RUN_DIR/adapters`)"),
    "test_batches": (_same("test_batches"), "`test_batches`"),
    "config": (_config, "null only (one file per command)"),
    "grad_checkpoint": (_grad_checkpoint, "`true`: `segment_size: 1` (each block recomputed); `false`: "
                                          "`segment_size` unchanged (null: checkpointing from a length on)"),
    "clear_cache_threshold": (_nothing_unless((0, None), "flash-cce does not clear MLX's cache between steps: "
                                                         "remove it"), "0 only"),
    "mask_prompt": (_mask_prompt, "`nll_on_prompt: false` (`true` unset: both train on the prompt)"),
    "report_to": (_nothing_unless((None, ""), NO_REPORTS), "null only (see metrics.jsonl)"),
    "project_name": (_nothing_unless((None, ""), NO_REPORTS), "null only"),
    "hf_dataset": (_nothing_unless((None,), "flash-cce reads a local directory of JSONL files: save the "
                                            "splits as DATA/train.jsonl and DATA/valid.jsonl and set data"),
                   "refused: local JSONL splits only"),
}


def table_markdown():
    """docs/cli.md's table of mlx_lm.lora's keys that are not ours."""
    rows = ["| `mlx_lm.lora` key | in flash-cce |", "|---|---|"]
    rows += [f"| `{k}` | {doc} |" for k, (_, doc) in KEYS.items()]
    return "\n".join(rows)


def from_mlx_lm(loaded, known):
    """`loaded` (a YAML file's mapping) with mlx_lm.lora's keys that are not in
    `known` (our settings) replaced by ours; SettingsError for what cannot be."""
    out = {k: v for k, v in loaded.items() if k in known or k not in KEYS}
    if "lr_schedule" in out and out["lr_schedule"] is None:
        out["lr_schedule"] = "constant"  # mlx_lm.lora's default: learning_rate throughout
    mapped = {}
    for key, value in loaded.items():
        if key in known or key not in KEYS:
            continue
        if key == "optimizer":
            _optimizer(value, mapped, key, loaded.get("optimizer_config"))
            continue
        put = KEYS[key][0]
        if put.__code__.co_argcount == 2:
            put(value, mapped)
        else:
            put(value, mapped, key)
    for key, value in mapped.items():
        if key in out and out[key] != value:
            raise SettingsError(f"{key}: set twice, as {key} ({out[key]!r}) and through an mlx_lm.lora key "
                                f"({value!r}); keep one")
        out[key] = value
    return out


# ---- flags --------------------------------------------------------------------

# mlx_lm.lora's flags that are not ours: dest -> (argparse kwargs, help).
FLAGS = {
    "train": dict(action="store_true", help="mlx_lm.lora's --train: flash-cce train always trains."),
    "adapter_path": dict(metavar="RUN_DIR", help="mlx_lm.lora's name of --run-dir."),
    "resume_adapter_file": dict(metavar="FILE", help="mlx_lm.lora's: --init-adapters with the file's directory."),
    "mask_prompt": dict(action="store_true", help="mlx_lm.lora's name of --no-nll-on-prompt."),
    "grad_checkpoint": dict(action="store_true", help="mlx_lm.lora's: --segment-size 1."),
    "optimizer": dict(metavar="NAME", help="mlx_lm.lora's: adam (--weight-decay 0) or adamw."),
    "clear_cache_threshold": dict(metavar="BYTES", help="mlx_lm.lora's; refused unless 0."),
    "report_to": dict(metavar="SERVICE", help="mlx_lm.lora's; refused (metrics go to metrics.jsonl)."),
    "project_name": dict(metavar="NAME", help="mlx_lm.lora's; refused."),
}
PREFIX = "mlx_lm."  # the flags' dests, apart from ours


def add_flags(parser):
    """mlx_lm.lora's flags that are not ours, in an argument group of `parser`."""
    group = parser.add_argument_group("mlx_lm.lora's flags")
    for dest, kwargs in FLAGS.items():
        kwargs = dict(kwargs)
        if kwargs.get("action") != "store_true":
            kwargs["type"] = str
        group.add_argument("--" + dest.replace("_", "-"), dest=PREFIX + dest, default=None, **kwargs)


def from_flags(flags):
    """`flags` (argparse's, None: unset) with mlx_lm.lora's flags turned into ours."""
    out = {k: v for k, v in flags.items() if not k.startswith(PREFIX)}
    given = {k[len(PREFIX):]: v for k, v in flags.items() if k.startswith(PREFIX) and v not in (None, False)}
    if "clear_cache_threshold" in given:
        given["clear_cache_threshold"] = _size(given["clear_cache_threshold"])
    mapped = from_mlx_lm(given, ())
    for key, value in mapped.items():
        if out.get(key) is not None and out[key] != value:
            flag = next(k for k in given if k in FLAGS)
            raise SettingsError(f"{key}: set twice, by --{key.replace('_', '-')} and by --{flag.replace('_', '-')}; "
                                "keep one")
        out[key] = value
    return out


def _size(text):
    """mlx_lm's size strings (`0`, `2GB`, `512MB`) as bytes."""
    units = {"": 1, "B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}
    t = str(text).strip().upper()
    num = t.rstrip("KMGB")
    try:
        return int(float(num) * units[t[len(num):]])
    except (ValueError, KeyError):
        raise SettingsError(f"clear_cache_threshold: got {text!r}; allowed: a size such as 0 or 2GB") from None


# ---- help and misspelt flags ----------------------------------------------------


def train_summary():
    """`flash-cce -h`'s summary of the train flags."""
    from .settings import NESTED_FLAGS, SETTINGS

    ours = [s.flag_name for s in SETTINGS if "train" in s.commands and s.flag]
    ours += ["--" + f.replace("_", "-") for f in NESTED_FLAGS]
    return ("train flags (flash-cce train -h explains each; -c/--config FILE reads them from YAML, "
            "mlx_lm.lora's files too):\n" + _wrapped(ours)
            + "\nmlx_lm.lora's flags, read as ours:\n" + _wrapped(["--" + d.replace("_", "-") for d in FLAGS]))


def _wrapped(words, width=98):
    import textwrap

    return "\n".join(textwrap.wrap(" ".join(words), width, initial_indent="  ", subsequent_indent="  ",
                                    break_on_hyphens=False))
