"""The settings of `flash-cce train` and `eval`: one schema for flags, YAML, the
run's config.yaml and the dataclasses built from them.

Each `Setting` names its type, default, allowed values and help. `check` turns a
mapping (from YAML, flags or a saved config.yaml) into typed settings or raises
`SettingsError` naming the key, the value and what is allowed. `resume` says
whether a resumed run may change the setting ("free") or not ("fixed": it shapes
the weights, the data or the optimizer's state).
"""

import argparse
import dataclasses
import functools
import math
import re
from dataclasses import dataclass
from typing import Optional


class SettingsError(ValueError):
    """A setting with a wrong type, an unknown key or a value out of range."""


AUTO = "auto"


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # int, float, bool, str, path, auto_int, auto_bool, str_list, table, schedule
    default: object
    help: str
    choices: Optional[tuple] = None
    low: Optional[float] = None  # smallest allowed value
    low_open: bool = False  # low itself excluded
    high: Optional[float] = None
    high_open: bool = False
    optional: bool = False  # None (YAML null) allowed
    special: tuple = ()  # values allowed besides the range (e.g. -1: all)
    commands: tuple = ("train",)  # sub-commands with a flag for it
    resume: str = "fixed"  # "free": a resumed run may change it
    fields: tuple = ()  # a table's settings
    flag: bool = True
    aliases: tuple = ()  # more flag names

    def allowed(self):
        """What is allowed, in words."""
        if self.kind == "table":
            return "a mapping with keys " + ", ".join(f.name for f in self.fields) + (
                " (or null)" if self.optional else "")
        if self.kind == "schedule":
            return schedule_allowed(self.choices)
        if self.choices is not None:
            text = "one of " + ", ".join(show(c) for c in self.choices)
        else:
            text = {"int": "an integer", "float": "a number", "bool": "true or false",
                    "str": "a string", "path": "a path", "str_list": "a list of strings",
                    "float_list": "a list of numbers",
                    "auto_int": "auto or an integer", "auto_bool": "auto, true or false"}[self.kind]
            bounds = []
            if self.low is not None:
                bounds.append(("> " if self.low_open else ">= ") + show(self.low))
            if self.high is not None:
                bounds.append(("< " if self.high_open else "<= ") + show(self.high))
            if bounds:
                text += " " + " and ".join(bounds)
            if self.special:
                text += " or " + ", ".join(show(s) for s in self.special)
        return text + (" or null" if self.optional and self.kind != "table" else "")

    @property
    def flag_name(self):
        return "--" + self.name.replace("_", "-")


def show(v):
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {show(x)}" for k, x in v.items()) + "}"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _bool(v):
    return isinstance(v, bool)


def _int(v):
    return isinstance(v, int) and not _bool(v)


def _number(v):
    return (isinstance(v, (int, float)) and not _bool(v))


S = Setting
BOTH = ("train", "eval")
LORA_FIELDS = (
    S("rank", "int", 8, "LoRA rank.", low=1),
    S("scale", "float", 20.0, "LoRA scale (alpha / rank).", low=0, low_open=True),
    S("dropout", "float", 0.0, "LoRA dropout.", low=0, high=1, high_open=True),
    S("keys", "str_list", None, "Module paths inside a block to adapt (default: mlx-lm's choice).",
      optional=True),
)
QUANTIZE_FIELDS = (
    S("bits", "int", 4, "Bits per weight.", choices=(2, 3, 4, 5, 6, 8)),
    S("group_size", "int", 64, "Weights per scale.", choices=(32, 64, 128)),
)

# TRL's loss types of dpo, cpo and kto (flash_cce.train.losses checks which objective takes which;
# this module is read before MLX is imported, so it keeps its own list).
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "nca_pair", "sppo_hard", "apo_zero", "apo_down",
              "exo_pair", "bco_pair", "discopop", "sigmoid_norm", "simpo", "alphapo", "kto",
              "apo_zero_unpaired")
FINGERPRINT_FIELDS = tuple(S(split, "str", None, f"{split}.jsonl's fingerprint.", optional=True)
                           for split in ("train", "valid", "test"))
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CONTROLLER_FIELDS = (
    S("law", "str", "pid", "Control law.", choices=("p", "pd", "pid")),
    S("scale", "str", "log", "Errors and weights as ratios (log: w = w0 exp(u), e = log(target / NLL)) "
      "or differences (linear: w = w0 + u, e = target - NLL).", choices=("log", "linear")),
    S("kp", "float", 2.0, "Proportional gain (log: log-weight per log-ratio of NLL; linear: weight per nat).", low=0),
    S("ki", "float", 0.2, "Integral gain.", low=0),
    S("kd", "float", 0.0, "Derivative gain.", low=0),
    S("smoothing", "float", 0.9, "Smoothing of the measured NLL over steps (0: each step's own).", low=0,
      high=1, high_open=True),
    S("target", "float", None, "NLL to hold (null: the initial NLL times 1 + tolerance).", low=0,
      low_open=True, optional=True),
    S("tolerance", "float", 0.05, "Target above the initial NLL, as a fraction.", low=0),
    S("target_steps", "int", 5, "Steps whose mean NLL is the initial NLL.", low=1),
    S("min_weight", "float", 0.001, "Lowest preference weight (> 0 with scale log).", low=0),
    S("max_weight", "float", 10.0, "Highest preference weight.", low=0),
    S("max_change", "float", 0.2, "The most the weight moves in one step (log: its log).", low=0,
      low_open=True),
)

SETTINGS = (
    # Where things are.
    S("model", "path", None, "Local mlx-lm model directory (or a Hugging Face id when online).",
      optional=True, commands=BOTH),
    S("data", "path", None, "Directory with train.jsonl, valid.jsonl (and test.jsonl) in TRL's preference format.",
      optional=True, commands=BOTH),
    S("run_dir", "path", "run", "Output directory: config.yaml, metrics.jsonl, checkpoints, adapters, best.",
      resume="free"),
    S("resume", "path", None, "Run directory, its adapters or best, or a checkpoint directory to continue from exactly.",
      optional=True, resume="free"),
    S("init_adapters", "path", None,
      "Start a new run from these adapters (an mlx_lm.lora adapter directory or one of ours) with a fresh optimizer.",
      optional=True),
    S("data_fingerprint", "table", None, "Fingerprints of the data files the run began on (written by the run; "
      "a resumed run checks them).", fields=FINGERPRINT_FIELDS, optional=True, flag=False, resume="free"),
    S("data_changes", "str_list", None, "Data changes a resumed run accepted (written by the run).",
      optional=True, flag=False, resume="free"),
    S("accept_data_change", "bool", False, "Resume on data files that changed since the run began "
      "(the change is recorded in data_changes).", resume="free"),
    # What is trained.
    S("fine_tune_type", "str", "lora", "Adapters (lora, dora) or the blocks' own weights (full).",
      choices=("lora", "dora", "full")),
    S("num_layers", "int", 16, "Fine-tuned blocks, counted from the last (-1: all).", low=1, special=(-1,)),
    S("lora_parameters", "table", {f.name: f.default for f in LORA_FIELDS}, "LoRA settings.",
      fields=LORA_FIELDS, flag=False),
    S("quantize", "table", None, "Quantize a dense base first (QLoRA).", fields=QUANTIZE_FIELDS,
      optional=True, flag=False),
    # The objective.
    S("objective", "str", "orpo", "Training objective (docs/objectives.md); kto reads unpaired data "
      "(prompt, completion, label), the others pairs.",
      choices=("orpo", "simpo", "orpo_margin", "dpo", "cpo", "kto", "sft", "grpo"), commands=BOTH),
    S("beta", "float", 0.1, "Objective strength (ORPO's lambda, SimPO/DPO/CPO/KTO's beta, GRPO's KL weight: "
      "0.0 by default for grpo, as TRL).", low=0, commands=BOTH),
    S("gamma", "float", 0.5, "Target margin of simpo / orpo_margin / cpo's simpo loss.", low=0, commands=BOTH),
    S("loss_type", "str", None, "TRL's loss_type of dpo, cpo, kto or grpo (null: sigmoid for dpo and cpo, kto "
      "for kto, dapo for grpo).", choices=tuple(dict.fromkeys(LOSS_TYPES + GRPO_LOSS_TYPES)), optional=True,
      commands=BOTH),
    S("label_smoothing", "float", 0.0, "Label noise of dpo's robust and cpo's sigmoid/simpo losses; "
      "dpo's exo_pair epsilon (> 0 there).", low=0, high=0.5, high_open=True, commands=BOTH),
    S("discopop_tau", "float", 0.05, "Temperature of dpo's discopop loss.", low=0, low_open=True,
      commands=BOTH),
    S("cpo_alpha", "float", 1.0, "Weight of cpo's chosen-response NLL (loss_type alphapo: 0).", low=0,
      commands=BOTH),
    S("alpha", "float", 0.0, "cpo's AlphaPO reward shape: rewards (1 - p^-alpha) / alpha of the "
      "responses' probabilities p (0: log-probs).", commands=BOTH),
    S("desirable_weight", "float", 1.0, "kto's weight of desirable examples.", low=0, low_open=True,
      commands=BOTH),
    S("undesirable_weight", "float", 1.0, "kto's weight of undesirable examples.", low=0, low_open=True,
      commands=BOTH),
    S("pref_weight", "float", 1.0, "Weight of the preference term of orpo / orpo_margin / cpo "
      "(where the controller starts).", low=0, commands=BOTH),
    S("reference", "str", "auto", "DPO/KTO's reference: the model with its LoRA adapters off, or a frozen "
      "model (auto: adapters_off for lora, model for dora and full).",
      choices=("auto", "adapters_off", "model"), commands=BOTH),
    S("reference_model", "path", None, "The frozen reference model (null: the base model loaded again).",
      optional=True, commands=BOTH),
    S("reference_quantize", "table", None, "Quantize the frozen reference model (saves memory).",
      fields=QUANTIZE_FIELDS, optional=True, flag=False, commands=BOTH),
    S("precompute_ref_log_probs", "bool", False, "Compute the reference log-probs of all pairs once before "
      "training, kept in the run directory (reference_logps.npz) and reused on resume; no reference model "
      "in memory while training."),
    S("adaptive_weight", "bool", False, "Adjust pref_weight every step to hold the chosen NLL near a "
      "target (the controller table)."),
    S("controller", "table", {f.name: f.default for f in CONTROLLER_FIELDS},
      "The adaptive preference weight's controller.", fields=CONTROLLER_FIELDS, flag=False),
    S("nll_on_prompt", "bool", True, "ORPO/SFT NLL over prompt and response (TRL's default) or the response only.",
      commands=BOTH),
    S("warm_reference", "str", "init", "DPO/KTO's reference with init_adapters: the warm-started model "
      "(init: the base with those adapters, TRL's SFT -> DPO recipe) or the base model (base).",
      choices=("init", "base")),
    # GRPO (objective grpo): TRL's GRPOConfig fields, names and defaults (docs/grpo.md).
    S("reward_funcs", "str_list", None, "Reward functions: module:function, file.py:function or a built-in "
      "(exact_match[=COLUMN], format[=REGEX], length[=CACHE]); the flag once per function.", optional=True,
      aliases=("--reward",)),
    S("reward_weights", "float_list", None, "Weight of each reward function (null: 1 each).", optional=True),
    S("num_generations", "int", 8, "Completions sampled per prompt (a group).", low=2),
    S("max_completion_length", "int", 512, "Longest completion (tokens).", low=1),
    S("temperature", "float", 1.0, "Sampling temperature (the log-probs are of logits / temperature).", low=0,
      low_open=True),
    S("top_p", "float", 1.0, "Nucleus sampling mass (1: off).", low=0, low_open=True, high=1),
    S("top_k", "int", 0, "Top-k sampling (0: off).", low=0),
    S("min_p", "float", None, "Min-p sampling (null: off).", low=0, high=1, high_open=True, optional=True),
    S("repetition_penalty", "float", 1.0, "Repetition penalty while sampling (transformers'): the logits of "
      "tokens already in the prompt or completion divided by it (multiplied where negative); 1: off.", low=0,
      low_open=True),
    S("epsilon", "float", 0.2, "Lower clip of the importance ratio.", low=0),
    S("epsilon_high", "float", None, "Upper clip (null: epsilon).", low=0, optional=True),
    S("delta", "float", None, "Two-sided clip: the ratio capped at delta (null: off).", low=0, optional=True),
    S("importance_sampling_level", "str", "token", "Importance ratios per token or per sequence.",
      choices=("token", "sequence")),
    S("scale_rewards", "str", "group", "Advantages divided by the group's or the batch's reward std, or not.",
      choices=("group", "batch", "none")),
    S("multi_objective_aggregation", "str", "sum_then_normalize", "Several reward functions: weighted sum "
      "then normalise, or normalise each then sum.", choices=("sum_then_normalize", "normalize_then_sum")),
    S("mask_truncated_completions", "bool", False, "Completions without EOS leave the loss."),
    S("top_entropy_quantile", "float", 1.0, "Keep the top quantile of tokens by entropy in the loss.", low=0,
      high=1),
    S("use_bias_correction_kl", "bool", True, "The KL term times the importance ratio (beta != 0)."),
    S("entropy_coef", "float", 0.0, "Weight of the entropy bonus subtracted from the loss."),
    S("off_policy_mask_threshold", "float", None, "Drop negative-advantage sequences whose mean old - current "
      "log-ratio exceeds it (null: off).", low=0, optional=True),
    S("sapo_temperature_neg", "float", 1.05, "sapo's gate temperature, advantages <= 0.", low=0, low_open=True),
    S("sapo_temperature_pos", "float", 1.0, "sapo's gate temperature, advantages > 0.", low=0, low_open=True),
    S("vespo_k_pos", "float", 2.0, "vespo's gamma weight k, positive advantages."),
    S("vespo_lambda_pos", "float", 3.0, "vespo's gamma weight lambda, positive advantages."),
    S("vespo_k_neg", "float", 3.0, "vespo's gamma weight k, other advantages."),
    S("vespo_lambda_neg", "float", 2.0, "vespo's gamma weight lambda, other advantages."),
    S("num_iterations", "int", 1, "Updates per generated batch (mu).", low=1),
    S("steps_per_generation", "int", None, "Micro-batches one generation serves (null: "
      "grad_accumulation_steps).", low=1, optional=True),
    # How it is computed (exact either way: a resumed run may change these).
    S("prefix_sharing", "bool", True, "Encode each prompt once for both responses.", commands=BOTH, resume="free"),
    S("flash_head", "bool", True, "Log-probs from the flash-CCE head (no [tokens, vocab] logits).",
      commands=BOTH, resume="free"),
    S("segment_size", "int", None, "Layers per gradient-checkpoint segment (0: off; null: by length).",
      low=0, optional=True, commands=BOTH, resume="free"),
    S("compiled_layers", "auto_bool", AUTO,
      "Gradients layer by layer through compiled layers where supported (auto: on a CUDA GPU from 8192 "
      "tokens per pair; `train` runs them once a second process has built their kernels).", commands=BOTH, resume="free"),
    S("pad_to", "auto_int", AUTO,
      "Round sequence widths up, and the shared prompt down, to a multiple (0: off; auto: 64 on a CUDA GPU, else off).",
      low=0, commands=BOTH, resume="free"),
    S("attention_block", "int", None, "Queries per block of the training attention (0: mlx-lm's attention).",
      low=0, optional=True, commands=BOTH, resume="free"),
    S("micro_group", "int", None, "grpo: completions of a group differentiated per pass around one prompt pass "
      "(null: all; fewer hold less memory, same result).", low=1, optional=True, resume="free"),
    # The optimizer.
    S("learning_rate", "float", 1e-5, "Peak AdamW learning rate.", low=0, low_open=True, resume="free"),
    S("min_learning_rate", "float", 0.0, "Learning rate at the end of the linear or cosine decay (<= learning_rate).",
      low=0, resume="free"),
    S("lr_schedule", "schedule", "linear", "Decay after the warmup to min_learning_rate (sft's default: "
      "constant), or mlx_lm.lora's mapping (then learning_rate, min_learning_rate and warmup are unused).",
      choices=("linear", "cosine", "constant"), resume="free"),
    S("warmup", "int", 0, "Linear warmup steps from 0 (< iters).", low=0, resume="free"),
    S("weight_decay", "float", 0.0, "AdamW weight decay (mlx_lm.lora's Adam and TRL: none).", low=0),
    S("max_grad_norm", "float", 1.0, "Gradient clipping threshold (global norm; null: no clipping).",
      low=0, low_open=True, optional=True, resume="free"),
    # Batches.
    S("batch_size", "int", 4, "Pairs per micro-batch.", low=1, commands=BOTH),
    S("grad_accumulation_steps", "int", 1, "Micro-batches per optimizer step.", low=1),
    S("max_seq_length", "int", 2048, "Longest sequence (tokens) of a pair's chosen or rejected side.", low=2,
      commands=BOTH),
    S("truncation", "str", "keep_end",
      "Over-long pairs: cut the prompt's start (keep_end), the response's end (keep_start), drop or error.",
      choices=("keep_end", "keep_start", "drop", "error"), commands=BOTH),
    S("chat_template", "auto_bool", AUTO, "auto: template for chat-message records; true: also for strings; false: never.",
      commands=BOTH),
    S("enable_thinking", "bool", None, "Passed to the chat template (Qwen3-style thinking switch).",
      optional=True, commands=BOTH),
    # The loop.
    S("iters", "int", 1000, "Optimizer steps.", low=1, resume="free"),
    S("steps_per_eval", "int", 100, "Steps between validations (0: only before and after; sft's default: 200).",
      low=0, resume="free"),
    S("val_batches", "int", -1, "Validation micro-batches per evaluation (-1: all; 0: no validation; "
      "sft's default: 25).", low=0, special=(-1,), resume="free"),
    S("steps_per_report", "int", 10, "Steps per printed report line (without a progress bar).", low=1,
      resume="free"),
    S("test_batches", "int", -1, "Test micro-batches of --test (-1: all).", low=1, special=(-1,),
      resume="free"),
    S("save_every", "int", 100, "Steps between checkpoints (0: only the last).", low=0, resume="free"),
    S("keep_checkpoints", "int", 2, "Newest checkpoints kept besides the best.", low=1, resume="free"),
    S("seed", "int", 0, "Seed of the data order and the initial adapters.", low=0),
    S("test", "bool", False, "Evaluate on test.jsonl after training.", resume="free"),
    S("gpu_capture", "path", None, "Record one training step into this Metal GPU trace file (for Xcode).",
      optional=True, resume="free"),
    S("trust_remote_code", "bool", False, "Trust remote code when loading the tokenizer/model.",
      commands=BOTH, resume="free"),
    S("progress", "bool", True, "Show a progress bar.", resume="free"),
    S("max_nonfinite_steps", "int", 5, "Non-finite (NaN/inf) loss or gradient steps in a row after which "
      "the run stops (each one's update is skipped).", low=1, resume="free"),
)

BY_NAME = {s.name: s for s in SETTINGS}
# Defaults that differ by objective (docs/cli.md, "Defaults"): sft follows
# mlx_lm.lora, whose users train SFT; the preference objectives follow TRL, and
# grpo TRL's GRPOConfig (beta 0.0).
OBJECTIVE_DEFAULTS = {"sft": {"lr_schedule": "constant", "val_batches": 25, "steps_per_eval": 200},
                      "grpo": {"beta": 0.0}}


def default(name, objective=None):
    """Setting `name`'s default for `objective`."""
    over = OBJECTIVE_DEFAULTS.get(objective, {}) if isinstance(objective, str) else {}  # a bad one: checked later
    return _copy(over[name] if name in over else BY_NAME[name].default)


# Flags that set one field of a table.
NESTED_FLAGS = {
    "lora_rank": ("lora_parameters", "rank"),
    "lora_scale": ("lora_parameters", "scale"),
    "lora_dropout": ("lora_parameters", "dropout"),
    "quantize_bits": ("quantize", "bits"),
    "quantize_group_size": ("quantize", "group_size"),
    **{f"controller_{f.name}": ("controller", f.name) for f in CONTROLLER_FIELDS},
    "reference_quantize_bits": ("reference_quantize", "bits"),
    "reference_quantize_group_size": ("reference_quantize", "group_size"),
}


def defaults():
    return {s.name: _copy(s.default) for s in SETTINGS}


def _copy(v):
    return dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v


# ---- checking -------------------------------------------------------------


def _fail(key, value, setting):
    raise SettingsError(f"{key}: got {_describe(value)}; allowed: {setting.allowed()}")


def _describe(value):
    if isinstance(value, str):
        text = repr(value) if len(value) <= 60 else repr(value[:57] + "...")
        return f"{text} (a string)"
    if isinstance(value, (dict, list)):
        text = repr(value)
        return (text if len(text) <= 60 else text[:57] + "...") + f" (a {'mapping' if isinstance(value, dict) else 'list'})"
    return show(value)


def check_value(setting, value, key=None):
    """`value` typed for `setting`, or SettingsError."""
    key = key or setting.name
    if value is None:
        if setting.optional:
            return None
        _fail(key, value, setting)
    kind = setting.kind
    if kind == "table":
        return _check_table(setting, value, key)
    if kind == "schedule":
        return check_schedule(value, key, setting.choices)
    if kind == "auto_bool":
        if value == AUTO or _bool(value):
            return value
        _fail(key, value, setting)
    if kind == "auto_int":
        if value == AUTO:
            return value
        kind = "int"
    if kind == "str_list":
        if isinstance(value, list) and value and all(isinstance(x, str) and x for x in value):
            return list(value)
        _fail(key, value, setting)
    if kind == "float_list":
        if isinstance(value, list) and value and all(_number(x) and math.isfinite(x) for x in value):
            return [float(x) for x in value]
        _fail(key, value, setting)
    ok = {"int": _int, "float": _number, "bool": _bool,
          "str": lambda v: isinstance(v, str), "path": lambda v: isinstance(v, str) and v != ""}[kind]
    if not ok(value):
        _fail(key, value, setting)
    if kind == "float":
        value = float(value)
        if not math.isfinite(value):
            _fail(key, value, setting)
    if setting.choices is not None and value not in setting.choices:
        _fail(key, value, setting)
    if value in setting.special:
        return value
    if setting.low is not None and (value < setting.low or setting.low_open and value == setting.low):
        _fail(key, value, setting)
    if setting.high is not None and (value > setting.high or setting.high_open and value == setting.high):
        _fail(key, value, setting)
    return value


def _check_table(setting, value, key):
    if not isinstance(value, dict):
        _fail(key, value, setting)
    fields = {f.name: f for f in setting.fields}
    for k in value:
        if k not in fields:
            raise SettingsError(f"{key}: unknown key {k!r}{_near(k, fields)}; allowed: {', '.join(fields)}")
    # Missing fields take their defaults, so a written adapter_config.json is complete.
    return {name: check_value(f, value.get(name, _copy(f.default)), f"{key}.{name}")
            for name, f in fields.items()}


def _near(name, known):
    import difflib

    close = difflib.get_close_matches(str(name), list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check(cfg):
    """Typed, complete settings from `cfg` (a mapping over SETTINGS), or SettingsError."""
    if not isinstance(cfg, dict):
        raise SettingsError(f"settings must be a mapping, got {type(cfg).__name__}")
    for k in cfg:
        if k not in BY_NAME:
            raise SettingsError(f"unknown key {k!r}{_near(k, BY_NAME)}; see `flash-cce train -h` for the settings")
    out = {}
    objective = cfg.get("objective")
    for s in SETTINGS:
        out[s.name] = check_value(s, cfg[s.name] if s.name in cfg else default(s.name, objective))
    _check_together(out)
    return out


def _check_together(cfg):
    if cfg["min_learning_rate"] > cfg["learning_rate"]:
        raise SettingsError(f"min_learning_rate: got {cfg['min_learning_rate']}; allowed: "
                            f"<= learning_rate ({cfg['learning_rate']})")
    if isinstance(cfg["lr_schedule"], dict) and cfg["warmup"]:
        raise SettingsError(f"warmup: got {cfg['warmup']} with lr_schedule as mlx_lm's mapping; set the "
                            "mapping's own warmup instead")
    if cfg["warmup"] >= cfg["iters"]:
        raise SettingsError(f"warmup: got {cfg['warmup']}; allowed: < iters ({cfg['iters']})")
    if cfg["quantize"] is not None and cfg["fine_tune_type"] == "full":
        raise SettingsError("quantize: a quantized base needs fine_tune_type lora or dora, not full")
    if cfg["reference"] == "adapters_off" and cfg["fine_tune_type"] != "lora":
        raise SettingsError(f"reference: adapters_off needs fine_tune_type lora (DoRA and full fine-tuning "
                            f"cannot switch their changes off), got {cfg['fine_tune_type']}; use model")
    if (cfg["reference"] == "adapters_off" and cfg["init_adapters"] is not None
            and cfg["warm_reference"] == "init" and cfg["objective"] in APPLIES_TO["warm_reference"]):
        raise SettingsError("reference: adapters_off is the base model, not the warm start of init_adapters; "
                            "use reference auto (or model), or warm_reference base")
    if cfg["resume"] is not None and cfg["init_adapters"] is not None:
        raise SettingsError("init_adapters: give either resume (continue a run) or init_adapters (start a new one)")


# ---- YAML -----------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _loader():
    """YAML 1.1's SafeLoader, reading `1e-4` (no dot) as a float as YAML 1.2 and mlx_lm do."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                    |\.[0-9_]+(?:[eE][-+][0-9]+)?
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$""", re.X),
        list("-+0123456789."),
    )
    return Loader


def load_yaml(path):
    """The mapping in the YAML file `path`, or SettingsError (missing file, bad YAML)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.load(f, Loader=_loader())
    except FileNotFoundError:
        raise SettingsError(f"config: no such file {str(path)!r}") from None
    except IsADirectoryError:
        raise SettingsError(f"config: {str(path)!r} is a directory, not a YAML file") from None
    except UnicodeDecodeError as e:
        raise SettingsError(f"config: {path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise SettingsError(f"config: cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SettingsError(f"config: {path}{where}: invalid YAML ({problem})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise SettingsError(f"config: {path} must hold a mapping of settings, got {type(loaded).__name__}")
    for k in loaded:
        if not isinstance(k, str):
            raise SettingsError(f"config: {path}: key {k!r} is not a setting name")
    return loaded


def dump_yaml(cfg, path):
    import yaml

    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg, f, sort_keys=True)


def resolve(flags, config_path=None, base=None, translate=None):
    """Checked settings: `flags` (None = unset) > YAML at `config_path` > `base` > defaults.
    `translate` maps the YAML file's keys to ours (the runner's: mlx_lm.lora's keys).
    A setting given in `flags` or the YAML file must apply to the objective (`check_applies`)."""
    cfg, given = {}, set()
    yaml_layer = load_yaml(config_path) if config_path else {}
    if translate is not None:
        yaml_layer = translate(yaml_layer)
    for layer in (base or {}), yaml_layer:
        for k, v in layer.items():
            cfg[k] = v
    given.update(yaml_layer)
    for k, v in flags.items():
        if v is None:
            continue
        if k in NESTED_FLAGS:
            table, name = NESTED_FLAGS[k]
            current = cfg.get(table, BY_NAME[table].default)
            cfg[table] = dict(current if isinstance(current, dict) else {}, **{name: v})
            given.add(table)
        elif k in BY_NAME:
            cfg[k] = v
            given.add(k)
    out = check(cfg)
    check_applies(out, given)
    return out


# GRPOConfig's fields (reward_funcs ... steps_per_generation in SETTINGS): grpo's alone.
_names = [x.name for x in SETTINGS]
GRPO_SETTINGS = tuple(_names[_names.index("reward_funcs"):_names.index("steps_per_generation") + 1])
del _names


def _objectives_but(*names):
    return tuple(o for o in BY_NAME["objective"].choices if o not in names)


# The objectives each objective-specific setting applies to (the rest apply to all).
APPLIES_TO = {
    "beta": _objectives_but("sft"),
    "gamma": ("simpo", "orpo_margin", "cpo"),
    "loss_type": ("dpo", "cpo", "kto", "grpo"),
    "label_smoothing": ("dpo", "cpo"),
    "discopop_tau": ("dpo",),
    "cpo_alpha": ("cpo",),
    "alpha": ("cpo",),
    "desirable_weight": ("kto",),
    "undesirable_weight": ("kto",),
    "pref_weight": ("orpo", "orpo_margin", "cpo"),
    "adaptive_weight": ("orpo", "orpo_margin", "cpo"),
    "controller": ("orpo", "orpo_margin", "cpo"),
    "reference": ("dpo", "kto", "grpo"),
    "reference_model": ("dpo", "kto", "grpo"),
    "reference_quantize": ("dpo", "kto", "grpo"),
    "precompute_ref_log_probs": ("dpo", "kto"),
    "warm_reference": ("dpo", "kto", "grpo"),
    "nll_on_prompt": ("orpo", "orpo_margin", "sft"),
    **{name: ("grpo",) for name in GRPO_SETTINGS},
    "micro_group": ("grpo",),
}


def check_applies(cfg, given):
    """SettingsError for a setting in `given` (set by the user, whatever its
    value) that the objective of `cfg` does not use: one rule, refusal, for all."""
    for name in SETTINGS:
        objectives = APPLIES_TO.get(name.name)
        if name.name in given and objectives and cfg["objective"] not in objectives:
            raise SettingsError(f"{name.name}: applies to objective {', '.join(objectives)}, not "
                                f"{cfg['objective']}; remove it or choose one of those objectives")


# ---- flags ----------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors; `-1e-3` is a value, not an option."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # a misspelt flag is an error, not a prefix
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}{near_flag(self, message)} (see {self.prog} -h)\n")


def flag_type(setting):
    kind = setting.kind

    def parse(text):
        low = text.lower()
        if setting.optional and low in ("none", "null"):
            return None
        if kind in ("auto_int", "auto_bool") and low == AUTO:
            return AUTO
        if kind == "auto_bool":
            if low in ("true", "false"):
                return low == "true"
            raise argparse.ArgumentTypeError(f"expected auto, true or false, got {text!r}")
        if kind in ("int", "auto_int"):
            try:
                return int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected {setting.allowed()}, got {text!r}") from None
        if kind == "float":
            try:
                return float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected {setting.allowed()}, got {text!r}") from None
        return text

    parse.__name__ = kind
    return parse


def _help(setting, default=None):
    default = setting.default if default is None else default
    text = setting.help
    if setting.kind not in ("bool", "path"):
        text += f" Allowed: {setting.allowed()}."
    return text + f" (default: {show(default)})"


def add_flags(parser, command):
    """A flag (default None: unset) for each setting of `command`."""
    for s in SETTINGS:
        if command not in s.commands or not s.flag:
            continue
        if s.kind == "bool":
            parser.add_argument(s.flag_name, dest=s.name, default=None,
                                action=argparse.BooleanOptionalAction, help=_help(s))
        elif s.kind in ("str_list", "float_list"):  # the flag once per item
            parser.add_argument(s.flag_name, *s.aliases, dest=s.name, default=None, action="append",
                                type=float if s.kind == "float_list" else str, metavar=s.name.upper(),
                                help=_help(s))
        elif s.kind == "auto_bool":  # the flag alone means true
            parser.add_argument(s.flag_name, dest=s.name, default=None, type=flag_type(s), nargs="?",
                                const=True, metavar=s.name.upper(), help=_help(s))
        else:
            parser.add_argument(s.flag_name, dest=s.name, default=None, type=flag_type(s),
                                metavar=s.name.upper(), help=_help(s))
    if command == "train":
        for flag, (table, name) in NESTED_FLAGS.items():
            field = next(f for f in BY_NAME[table].fields if f.name == name)
            parser.add_argument("--" + flag.replace("_", "-"), dest=flag, default=None,
                                type=flag_type(field), metavar=name.upper(),
                                help=f"{table}.{name}: {_help(field)}")


# ---- dataclasses ----------------------------------------------------------


def field(name, **kw):
    """A dataclass field with the setting's default and help."""
    s = BY_NAME[name]
    return dataclasses.field(default=_copy(s.default), metadata={"help": s.help}, **kw)


def reference_markdown():
    """The settings as a Markdown table (docs/training.md)."""
    rows = ["| setting | default | allowed | on resume | meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        default = s.default if not isinstance(s.default, dict) else ", ".join(
            f"{k}: {show(v)}" for k, v in s.default.items())
        rows.append(f"| `{s.name}` | {show(default)} | {s.allowed()} | "
                    f"{'may change' if s.resume == 'free' else 'fixed'} | {s.help} |")
        for f in s.fields:
            rows.append(f"| `{s.name}.{f.name}` | {show(f.default)} | {f.allowed()} | "
                        f"{'may change' if s.resume == 'free' else 'fixed'} | {f.help} |")
    return "\n".join(rows)


# mlx.optimizers schedules lr_schedule's mapping form may name: name -> (fewest, most) arguments.
SCHEDULES = {"cosine_decay": (2, 3), "linear_schedule": (3, 3), "exponential_decay": (2, 2),
             "step_decay": (3, 3)}


# ---- lr_schedule in mlx_lm's mapping form -----------------------------------


def check_schedule(value, key, names):
    """`value` of `lr_schedule`: one of `names` or mlx_lm's mapping
    `{name, arguments, warmup, warmup_init}`; SettingsError otherwise."""
    if isinstance(value, str) and value in names:
        return value
    if not isinstance(value, dict):
        raise SettingsError(f"{key}: got {_describe(value)}; allowed: {schedule_allowed(names)}")
    unknown = set(value) - {"name", "arguments", "warmup", "warmup_init"}
    if unknown:
        raise SettingsError(f"{key}: unknown key {sorted(unknown)[0]!r}; allowed: name, arguments, warmup, warmup_init")
    name = value.get("name")
    if name not in SCHEDULES:
        raise SettingsError(f"{key}.name: got {name!r}; allowed: one of {', '.join(SCHEDULES)}")
    args = value.get("arguments")
    low, high = SCHEDULES[name]
    if (not isinstance(args, list) or not low <= len(args) <= high
            or not all(_number(a) for a in args)):
        raise SettingsError(f"{key}.arguments: got {args!r}; allowed: a list of {low}"
                            f"{'' if low == high else f' or {high}'} numbers for {name} (mlx.optimizers.{name}'s)")
    if not args[0] > 0:
        raise SettingsError(f"{key}.arguments: got {args!r}; the first, the initial learning rate, must be > 0")
    warmup = value.get("warmup", 0)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise SettingsError(f"{key}.warmup: got {warmup!r}; allowed: an integer >= 0")
    init = value.get("warmup_init", 0.0)
    if not _number(init) or init < 0:
        raise SettingsError(f"{key}.warmup_init: got {init!r}; allowed: a number >= 0")
    return {"name": name, "arguments": [float(a) if isinstance(a, float) else a for a in args],
            "warmup": warmup, "warmup_init": float(init)}


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def schedule_allowed(names):
    return (f"one of {', '.join(names)}, or mlx_lm's mapping {{name, arguments, warmup, warmup_init}} "
            f"(name: {', '.join(SCHEDULES)})")


# ---- misspelt flags --------------------------------------------------------------


def near_flag(parser, message):
    """' (did you mean --x?)' for the first unrecognised flag of argparse's
    `message`, matched against the flags of `parser` and its sub-commands
    (underscores read as dashes, as mlx_lm.lora's YAML keys are written)."""
    import difflib

    marker = "unrecognized arguments: "
    if marker not in message:
        return ""
    words = [w for w in message.split(marker, 1)[1].split() if w.startswith("--")]
    if not words:
        return ""
    flags = set()
    for p in _parsers(parser):
        flags.update(s for a in p._actions for s in a.option_strings if s.startswith("--"))
    word = words[0].split("=", 1)[0]
    dashed = "--" + word[2:].replace("_", "-")
    if dashed in flags and dashed != word:
        return f" (did you mean {dashed}?)"
    close = difflib.get_close_matches(dashed, sorted(flags), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def _parsers(parser):
    out = [parser]
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for p in a.choices.values():
                out += _parsers(p)
    return out
