"""The adaptive preference weight on the demo task: a fixed large weight against
the PID controller (its default settings), on the chosen response's NLL.

The tiny demo model is fine-tuned with SFT (150 steps), then trained from those
weights with CPO's simpo loss whose target margin (gamma 20) is never reached,
so the preference term keeps pushing, and a small NLL weight (cpo_alpha 0.05):
once with a fixed preference weight of 5, once with the controller starting at
5 (target: the mean NLL of the first 5 steps times 1.05). A 30-step warmup
keeps the optimizer restart from moving the NLL. Per data seed, prints the
chosen NLL over steps 101 on (after a settling window), smoothed as the
controller measures it, against the target (the share of steps within 10 % and
25 % of it) and writes a JSON summary; the PNG shows the first seed (log10 of
the smoothed NLL with the target and the 25 % band, and the weight).

    python bench/adaptive_weight.py --out docs/adaptive_weight.png --json adaptive_weight.json
"""

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from flash_cce.train.cli import main
from flash_cce.train.controller import ControllerConfig
from flash_cce.train.demo import DATA_DIR, demo_words
from flash_cce.train.plot import AXIS, TEXT, TRAIN, VALID, _panel, _text, write_png
from flash_cce.train.tiny import build_tiny_model
from flash_cce.train.trainer import read_metrics

COMMON = ["--fine-tune-type", "full", "--num-layers", "-1", "--batch-size", "8", "--max-seq-length", "64",
          "--no-progress", "--lr-schedule", "constant", "--weight-decay", "0", "--steps-per-eval", "1000",
          "--save-every", "1000"]
WEIGHT = 5.0
PREFERENCE = ["--objective", "cpo", "--loss-type", "simpo", "--beta", "2.5", "--gamma", "20",
              "--cpo-alpha", "0.05", "--pref-weight", str(WEIGHT), "--learning-rate", "3e-4", "--warmup", "30"]
DEFAULTS = ControllerConfig()  # the controller as `--adaptive-weight` alone sets it
SETTLE = 100  # steps left out of the summary
BANDS = (0.10, 0.25)  # relative distances from the target that the summary counts steps within


def _train(root, name, iters, *extra):
    run = root / name
    assert main(["train", "--model", str(root / "model"), "--data", str(DATA_DIR), "--run-dir", str(run),
                 "--iters", str(iters), *COMMON, *extra]) == 0
    return [r for r in read_metrics(run) if r["split"] == "train"]


def smoothed(rec):
    """The chosen NLL per step as the controller measures it (its smoothing)."""
    out, m = [], None
    for r in rec:
        x = r["nll_loss"]
        m = x if m is None else DEFAULTS.smoothing * m + (1 - DEFAULTS.smoothing) * x
        out.append(m)
    return np.array(out)


def _plot(path, fixed, adaptive, target):
    steps = [r["step"] for r in fixed]
    ends = [steps[0], steps[-1]]
    img = np.full((460, 1000, 3), 255, np.uint8)
    _text(img, 20, 12, f"CPO SIMPO GAMMA 20, FROM SFT   THIN: FIXED WEIGHT {WEIGHT:g}  THICK: PID", scale=2)
    series = [(TRAIN, steps, list(np.log10(smoothed(fixed))), 1),
              (VALID, steps, list(np.log10(smoothed(adaptive))), 3),
              (TEXT, ends, [np.log10(target)] * 2, 1)]
    series += [(AXIS, ends, [np.log10(target * (1 + b))] * 2, 1) for b in (-BANDS[1], BANDS[1])]
    _panel(img, (50, 70, 430, 340), "LOG10 SMOOTHED CHOSEN NLL  (TARGET AND 25 PCT BAND)", series)
    _panel(img, (550, 70, 430, 340), "LOG10 PREFERENCE WEIGHT",
           [(TRAIN, steps, [np.log10(WEIGHT)] * len(steps), 1),
            (VALID, steps, [float(np.log10(r["pref_weight"])) for r in adaptive], 3)])
    write_png(path, img)


def _summary(rec, target):
    nll = smoothed(rec)[SETTLE:]
    off = np.abs(nll / target - 1)
    return dict(median_nll=float(np.median(nll)), max_nll=float(nll.max()),
                median_raw_nll=float(np.median([r["nll_loss"] for r in rec[SETTLE:]])), steps=len(nll),
                **{f"within_{round(b * 100)}pct": float(np.mean(off <= b)) for b in BANDS},
                median_weight=float(np.median([r.get("pref_weight", WEIGHT) for r in rec[SETTLE:]])),
                accuracy=float(np.mean([r["rewards/accuracies"] for r in rec[SETTLE:]])))


def main_(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="adaptive_weight.png")
    p.add_argument("--json", default="adaptive_weight.json")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = p.parse_args(argv)
    tic = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="flash-cce-adaptive-"))
    results = []
    try:
        build_tiny_model(root / "model", demo_words(), seed=0)
        _train(root, "sft", 150, "--objective", "sft", "--warmup", "10", "--learning-rate", "1e-3")
        init = ["--init-adapters", str(root / "sft" / "adapters")]
        for seed in args.seeds:
            runs = {}
            for name, extra in (("fixed", []), ("pid", ["--adaptive-weight"])):
                runs[name] = _train(root, f"{name}{seed}", args.iters, *PREFERENCE, *extra, *init,
                                    "--seed", str(seed))
            # The controller's own target (the weight is the same in both runs until it is set).
            start = [r["nll_loss"] for r in runs["pid"][:DEFAULTS.target_steps]]
            target = float(np.mean(start) * (1 + DEFAULTS.tolerance))
            if seed == args.seeds[0]:
                _plot(args.out, runs["fixed"], runs["pid"], target)
            results.append(dict(seed=seed, target=target, **{k: _summary(v, target) for k, v in runs.items()}))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"steps {SETTLE + 1}-{args.iters}; chosen NLL smoothed by {DEFAULTS.smoothing}; target = first "
          f"{DEFAULTS.target_steps} steps x {1 + DEFAULTS.tolerance}")
    print("| seed | run | target | median NLL | max NLL | within 10 % | within 25 % | median raw NLL "
          "| median weight | accuracy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for name in ("fixed", "pid"):
            s = r[name]
            print(f"| {r['seed']} | {name} | {r['target']:.4f} | {s['median_nll']:.4f} | {s['max_nll']:.3f} | "
                  f"{s['within_10pct']:.2f} | {s['within_25pct']:.2f} | {s['median_raw_nll']:.4f} | "
                  f"{s['median_weight']:.4f} | {s['accuracy']:.2f} |")
    seconds = time.perf_counter() - tic
    print(f"{seconds:.0f} s")
    Path(args.json).write_text(json.dumps(dict(results=results, seconds=seconds), indent=1))


if __name__ == "__main__":
    main_()
