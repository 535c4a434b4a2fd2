"""A run's identity: which model and which data it trains on.

config.yaml keeps the model and the data as absolute resolved paths and a
fingerprint of each data file (`data_fingerprint`), so that a resumed run
continues on the data it began with, or says that the data changed. A warm
start (`init_adapters`) is checked against the model its adapters were trained on.
"""

import hashlib
import json
from pathlib import Path

from . import settings
from .checkpoint import ADAPTER_CONFIG, find_checkpoint
from .preflight import RunError, model_ref

SPLITS = ("train", "valid", "test")


# What a run's config.yaml meant when a setting did not exist yet.
LEGACY = {"warm_reference": "base"}  # the reference was the base model before warm starts kept theirs


def read_run_config(path, what):
    """The checked settings of a run's config.yaml at `path` (RunError naming `what`)."""
    try:
        loaded = settings.load_yaml(path)
        return settings.check({**LEGACY, **loaded} if isinstance(loaded, dict) else loaded)
    except settings.SettingsError as e:
        raise RunError(f"{what}: {path}: {e}") from None


def file_fingerprint(path):
    """sha256 of a file's bytes, shortened to 16 hex digits (64 bits: a changed file, not an attacker)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()[:16]


def data_fingerprint(data_dir, test):
    """{split: fingerprint or None} of the split files a run reads (test.jsonl only with `test`)."""
    out = {}
    for split in SPLITS:
        f = Path(data_dir) / f"{split}.jsonl"
        out[split] = file_fingerprint(f) if f.is_file() and (split != "test" or test) else None
    return out


def data_changes(saved, now):
    """[(split, fingerprint then, fingerprint now)] of the files that the run
    fingerprinted and that differ now (a removed file is "missing")."""
    return [(s, saved[s], now[s] or "missing") for s in SPLITS if saved.get(s) and saved[s] != now[s]]


def check_data(cfg, saved, ckpt_name, log=print):
    """The data fingerprint `cfg` records for a resumed run whose config.yaml
    held `saved`: RunError when a data file changed, unless `accept_data_change`
    (then the change is added to `data_changes`). Runs from before fingerprints
    (`saved` None) record the current data's."""
    now = data_fingerprint(cfg["data"], cfg["test"])
    if saved is None:
        log("Data fingerprint: the run has none (made before flash-cce recorded them); "
            "recording the current data's")
        return dict(cfg, data_fingerprint=now)
    changes = data_changes(saved, now)
    if changes and not cfg["accept_data_change"]:
        split, was, new = changes[0]
        raise RunError(f"data: {Path(cfg['data']) / (split + '.jsonl')} changed since the run began "
                       f"(fingerprint then {was}, now {new}); a resumed run continues on its own data. "
                       "Pass --accept-data-change to continue on the changed data (recorded in config.yaml), "
                       "or start a new run with --init-adapters RUN_DIR")
    notes = [f"{ckpt_name}: {s}.jsonl {was} -> {new}" for s, was, new in changes]
    for note in notes:
        log(f"Data changed (accepted): {note}")
    merged = {s: now[s] if now[s] else saved.get(s) for s in SPLITS}
    return dict(cfg, data_fingerprint=merged, data_changes=(cfg["data_changes"] or []) + notes or None)


def adapter_dir(path):
    """The adapter directory a warm start reads, resolved: the checkpoint that a
    run directory's latest adapters (or its `adapters`, `best`) come from, so that
    config.yaml names adapters that later steps of that run leave alone; else
    `path` itself (a checkpoint, or adapters saved by mlx_lm)."""
    path = Path(path).expanduser()
    try:
        return str(find_checkpoint(path))
    except ValueError:
        pass
    return str(path.resolve()) if path.exists() else str(path.absolute())


SAMPLE = 1 << 20  # bytes read from each end of a weights file


def _model_files(ref):
    """A local model's identity: its config.json, and the names, sizes and both
    ends of its weights files (two models of one architecture differ there;
    reading every byte of a large model would take minutes)."""
    p = Path(ref).expanduser()
    if not (p / "config.json").is_file():
        return None
    h = hashlib.sha256((p / "config.json").read_bytes())
    for f in sorted(p.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(SAMPLE))
            fh.seek(max(size - SAMPLE, 0))
            h.update(fh.read(SAMPLE))
    return h.hexdigest()


def _hub_cache_of(path, hub_id):
    """True when `path` is the Hugging Face cache's snapshot of `hub_id`."""
    return f"models--{hub_id.replace('/', '--')}" in Path(path).parts


def same_model(a, b):
    """True when the model references `a` and `b` name one model: the same
    path or hub id, copies of one directory, or a hub id and its cached snapshot."""
    a, b = model_ref(a), model_ref(b)
    if a == b:
        return True
    fa, fb = _model_files(a), _model_files(b)
    if fa is not None and fb is not None:
        return fa == fb
    return _hub_cache_of(a, b) or _hub_cache_of(b, a)


def check_adapter_model(path, model):
    """RunError when the adapters in `path` were trained on another model than `model`."""
    try:
        theirs = json.loads((Path(path) / ADAPTER_CONFIG).read_text()).get("model")
    except (OSError, ValueError, AttributeError):
        return  # adapter_settings reports an unreadable adapter_config.json
    if isinstance(theirs, str) and theirs and not same_model(theirs, model):
        raise RunError(f"init_adapters: the adapters were trained on model {theirs}, this run's model is "
                       f"{model}; give --model {theirs} (a warm start continues the model it began on)")
