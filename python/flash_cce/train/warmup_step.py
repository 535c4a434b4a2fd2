"""The warm-up's helper process (`warmup`): one training step of a run's
settings with the compiled layers, so that MLX builds their kernels into the
cache it is given, while the run itself trains without them.

    python -m flash_cce.train.warmup_step SETTINGS.json RUN_PID
"""

import ctypes
import json
import os
import signal
import sys
from pathlib import Path

from .runner import run_train

# The helper's own settings over the run's: one step, nothing else.
ONE_STEP = dict(resume=None, init_adapters=None, iters=1, warmup=0, lr_schedule="constant",
                val_batches=0, steps_per_eval=0, save_every=0, test=False,
                precompute_ref_log_probs=False, progress=False, gpu_capture=None,
                compiled_layers=True)


def die_with(parent):
    """Asks Linux to kill this process when `parent` (its parent's pid) ends;
    ends now if it already has. Elsewhere nothing (CUDA runs on Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


def main(argv=None):
    """The helper: one training step of the settings in the JSON file argv[0],
    with the compiled layers, in a run directory beside that file, writing no
    checkpoint; it ends with the run whose pid is argv[1]."""
    argv = sys.argv[1:] if argv is None else argv
    die_with(int(argv[1]))
    spec = Path(argv[0])
    cfg = dict(json.loads(spec.read_text()), run_dir=str(spec.parent / "run"), **ONE_STEP)
    run_train(cfg, hint=False, checkpoints=False)


if __name__ == "__main__":
    main()
