"""Helpers for tests that run `flash-cce` as a user does: a subprocess per command."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np


def flash_cce(*argv, cwd=None, env=None, timeout=300, file_size_limit=None):
    """`flash-cce ARGV` in a fresh Python process; the CompletedProcess (text).
    `file_size_limit` (bytes): no file of the process grows past it (RLIMIT_FSIZE),
    so writes fail as on a full disk."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "flash_cce.train.cli", *map(str, argv)], cwd=cwd,
                          env=full_env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=None if file_size_limit is None else lambda: _limit_files(file_size_limit))


def _limit_files(size):
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))


# Console scripts the tests run, and the function each one calls.
SCRIPTS = {"mlx_lm.generate": "mlx_lm.generate", "mlx.launch": "mlx._distributed_utils.launch"}


def console_script(name):
    """The command of console script `name`: the script beside this Python or on
    PATH, else (packages put on PYTHONPATH without their scripts) its entry point
    run through this Python."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if found:
        return [found]
    code = f"import sys; from {SCRIPTS[name]} import main; sys.argv[0] = {name!r}; sys.exit(main())"
    return [sys.executable, "-c", code]


def train_argv(model_dir, data_dir, run_dir, iters, *extra):
    return ["train", "--model", model_dir, "--data", data_dir, "--run-dir", run_dir,
            "--iters", iters, "--batch-size", "4", "--num-layers", "-1", "--lora-rank", "4",
            "--learning-rate", "3e-3", "--lr-schedule", "constant", "--steps-per-eval", "2",
            "--save-every", "2", "--no-progress", *extra]


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc


def one_line_error(proc, *needles, rc=2):
    """Asserts `proc` failed with exit status `rc` and one error line holding every needle."""
    err = proc.stderr.strip()
    assert proc.returncode == rc, (proc.returncode, proc.stdout[-1000:], err[-2000:])
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("flash-cce") and ": error: " in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


def snapshot(path):
    """{relative path: content hash or link target} of everything under `path` (None: absent)."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return None
    out = {}
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            st = p.stat()
            out[rel] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mtime_ns)
        else:
            out[rel] = "dir"
    return out


def metrics(run_dir, keys=("split", "step", "loss")):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [tuple(r.get(k) for k in keys) for r in map(json.loads, lines)]


def weights(path):
    import mlx.core as mx

    return {k: np.array(v) for k, v in mx.load(str(Path(path) / "adapters.safetensors")).items()}


def same_weights(a, b):
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)


def last_valid(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "valid"][-1]
