"""The adaptive preference weight on the demo task: a fixed weight against the
controller, on the chosen response's NLL.

The tiny demo model is first fine-tuned with SFT (150 steps), then trained with
CPO's simpo loss and a small NLL weight (cpo_alpha 0.05) from those weights,
once with a fixed preference weight of 1 and once with the PID controller
(starting at 1). Writes a PNG (chosen NLL of both runs with the controller's
target, and the controller's weight) and prints the NLL peaks and the steps
above the target.

    python bench/adaptive_weight.py --out docs/adaptive_weight.png
"""

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from flash_cce.cli import main
from flash_cce.demo import DATA_DIR, demo_words
from flash_cce.plot import TEXT, TRAIN, VALID, _panel, _text, write_png
from flash_cce.tiny import build_tiny_model
from flash_cce.trainer import read_metrics

COMMON = ["--fine-tune-type", "full", "--num-layers", "-1", "--batch-size", "8", "--max-seq-length", "64",
          "--no-progress", "--lr-schedule", "constant", "--weight-decay", "0", "--steps-per-eval", "1000",
          "--save-every", "1000", "--learning-rate", "1e-3"]
PREFERENCE = ["--objective", "cpo", "--loss-type", "simpo", "--beta", "2.5", "--gamma", "1.0",
              "--cpo-alpha", "0.05", "--pref-weight", "1.0"]
CONTROLLER = ["--adaptive-weight", "--controller-law", "pid", "--controller-kp", "20", "--controller-ki", "2",
              "--controller-max-change", "0.5", "--controller-target-steps", "3",
              "--controller-tolerance", "0.05"]


def _train(root, name, iters, *extra):
    run = root / name
    assert main(["train", "--model", str(root / "model"), "--data", str(DATA_DIR), "--run-dir", str(run),
                 "--iters", str(iters), *COMMON, *extra]) == 0
    return [r for r in read_metrics(run) if r["split"] == "train"]


def _plot(path, fixed, adaptive, target):
    steps = [r["step"] for r in fixed]
    img = np.full((520, 1000, 3), 255, np.uint8)
    _text(img, 20, 12, "CPO SIMPO, CPO_ALPHA 0.05, FROM SFT   THIN: FIXED WEIGHT 1  THICK: PID", scale=2)
    box = (50, 70, 430, 380)
    series = [(TRAIN, steps, [r["nll_loss"] for r in fixed], 1),
              (VALID, steps, [r["nll_loss"] for r in adaptive], 3),
              (TEXT, [steps[0], steps[-1]], [target, target], 1)]
    _panel(img, box, "CHOSEN NLL  (FLAT LINE: TARGET)", series)
    _panel(img, (550, 70, 430, 380), "PREFERENCE WEIGHT",
           [(TRAIN, steps, [1.0] * len(steps), 1), (VALID, steps, [r["pref_weight"] for r in adaptive], 3)])
    write_png(path, img)


def main_(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="adaptive_weight.png")
    p.add_argument("--iters", type=int, default=150)
    args = p.parse_args(argv)
    tic = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="flash-cce-adaptive-"))
    try:
        build_tiny_model(root / "model", demo_words(), seed=0)
        _train(root, "sft", 150, "--objective", "sft", "--warmup", "10")
        init = ["--init-adapters", str(root / "sft" / "adapters")]
        fixed = _train(root, "fixed", args.iters, *PREFERENCE, *init)
        adaptive = _train(root, "adaptive", args.iters, *PREFERENCE, *CONTROLLER, *init)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # The controller's target: the mean NLL of its first 3 steps (the weight is 1
    # until then in both runs) times 1.05.
    target = float(np.mean([r["nll_loss"] for r in adaptive[:3]]) * 1.05)
    _plot(args.out, fixed, adaptive, target)
    summary = {}
    for name, rec in (("fixed", fixed), ("adaptive", adaptive)):
        nll = np.array([r["nll_loss"] for r in rec])
        summary[name] = dict(peak_nll=float(nll.max()), peak_step=int(nll.argmax()) + 1,
                             steps_above_target=int((nll > target).sum()),
                             final_nll=float(nll[-1]),
                             final_accuracy=rec[-1]["rewards/accuracies"])
    summary["target"] = target
    summary["seconds"] = time.perf_counter() - tic
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main_()
