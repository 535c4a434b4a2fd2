"""`flash-cce plot RUN_DIR`: a PNG of a run's loss, preference accuracy, margins
and memory curves (a GRPO run's: loss, mean reward, entropy, memory).

Drawn with numpy and written with zlib (no plotting library needed): four panels,
training steps as a thin light line, validation as a thick dark line, each panel
labelled with its value range and step range in a small pixel font.
"""

import math
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from .storage import writing

# 3x5 pixel glyphs, rows top to bottom.
_GLYPHS = dict(zip(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-/:()= ",
    """010101111101101 110101110101110 011100100100011 110101101101110 111100110100111
    111100110100100 011100101101011 101101111101101 111010010010111 001001001101010
    101101110101101 100100100100111 101111111101101 110101101101101 010101101101010
    110101110100100 010101101110011 110101110101101 011100010001110 111010010010010
    101101101101111 101101101101010 101101111111101 101101010101101 101101010010010
    111001010100111 111101101101111 010110010010111 110001010100111 110001010001110
    101101111001001 111100110001110 011100111101111 111001010010010 111101111101111
    111101111001110 000000000000010 000000111000000 001001010100100 000010000010000
    010100100100010 010001001001010 000111000111000 000000000000000""".split(),
))
TRAIN, VALID, AXIS, TEXT = (150, 180, 230), (20, 60, 170), (90, 90, 90), (30, 30, 30)
PANELS = (
    ("LOSS", "loss"),
    ("PREFERENCE ACCURACY", "rewards/accuracies"),
    ("REWARD MARGIN", "rewards/margins"),
    ("MEMORY GB  THIN: ACTIVE  THICK: PEAK", ("active_memory_gb", "peak_memory_gb")),
)
# GRPO runs (their records carry TRL's "reward"): rewards instead of preferences.
GRPO_PANELS = (
    ("LOSS", "loss"),
    ("MEAN REWARD", "reward"),
    ("ENTROPY", "entropy"),
    PANELS[3],
)


def _text(img, x, y, s, color=TEXT, scale=2):
    for ch in s.upper():
        g = _GLYPHS.get(ch, _GLYPHS[" "])
        for r in range(5):
            for c in range(3):
                if g[3 * r + c] == "1":
                    img[y + r * scale:y + (r + 1) * scale, x + c * scale:x + (c + 1) * scale] = color
        x += 4 * scale


def _line(img, x0, y0, x1, y1, color, width):
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    xs = np.linspace(x0, x1, n).round().astype(int)
    ys = np.linspace(y0, y1, n).round().astype(int)
    h = width // 2
    for dx in range(-h, width - h):
        for dy in range(-h, width - h):
            img[np.clip(ys + dy, 0, img.shape[0] - 1), np.clip(xs + dx, 0, img.shape[1] - 1)] = color


def _fmt(v):
    return f"{v:.3g}"


def _panel(img, box, title, series):
    x0, y0, w, h = box
    _text(img, x0, y0 - 16, title)
    pts = [(s, v) for _, steps, values, _ in series for s, v in zip(steps, values)]
    img[y0:y0 + h, x0] = AXIS
    img[y0 + h, x0:x0 + w] = AXIS
    if not pts:
        _text(img, x0 + 10, y0 + h // 2, "NO DATA")
        return
    s_lo, s_hi = min(p[0] for p in pts), max(p[0] for p in pts)
    v_lo, v_hi = min(p[1] for p in pts), max(p[1] for p in pts)
    if v_hi - v_lo < 1e-12:
        v_lo, v_hi = v_lo - 0.5, v_hi + 0.5
    s_hi = max(s_hi, s_lo + 1)
    sx = lambda s: x0 + 2 + (s - s_lo) / (s_hi - s_lo) * (w - 4)  # noqa: E731
    sy = lambda v: y0 + h - 2 - (v - v_lo) / (v_hi - v_lo) * (h - 4)  # noqa: E731
    for color, steps, values, width in series:
        xy = [(sx(s), sy(v)) for s, v in zip(steps, values)]
        for (a, b), (c, d) in zip(xy, xy[1:]):
            _line(img, a, b, c, d, color, width)
        if len(xy) == 1:
            _line(img, *xy[0], *xy[0], color, width + 2)
    _text(img, x0 + 6, y0 + 4, "MAX " + _fmt(v_hi))
    _text(img, x0 + 6, y0 + h - 16, "MIN " + _fmt(v_lo))
    _text(img, x0 + w - 4 * 2 * (len(f"STEP {s_lo}-{s_hi}")), y0 + h + 6, f"STEP {s_lo}-{s_hi}")


def write_png(path, img):
    """Writes an RGB uint8 array [H, W, 3] as a PNG file."""
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[r].tobytes() for r in range(h))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with writing(path):  # whole or not at all: an old plot stays when the disk is full
            tmp.write_bytes(png)
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _series(records, key, split):
    # A non-finite value (a skipped step's NaN loss) has no place on the axis: left out.
    rows = [r for r in records if r.get("split") == split and key in r and math.isfinite(r[key])]
    return [r["step"] for r in rows], [r[key] for r in rows]


def plot_run(run_dir, output=None, width=1000, height=700):
    """Draws RUN_DIR/metrics.jsonl into `output` (default RUN_DIR/plot.png); returns its path."""
    from .trainer import read_metrics

    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").exists():
        raise ValueError(f"run_dir: {run_dir} has no metrics.jsonl")
    records = read_metrics(run_dir)
    img = np.full((height, width, 3), 255, np.uint8)
    _text(img, 20, 12, f"FLASH-CCE RUN {run_dir.name}   THIN: TRAIN  THICK: VALID", scale=2)
    pw, ph = width // 2 - 70, height // 2 - 90
    panels = GRPO_PANELS if any("reward" in r for r in records) else PANELS
    for i, (title, key) in enumerate(panels):
        box = (50 + (i % 2) * (width // 2), 70 + (i // 2) * (height // 2), pw, ph)
        if isinstance(key, tuple):  # memory: both train-step curves
            series = [(TRAIN, *_series(records, key[0], "train"), 2),
                      (VALID, *_series(records, key[1], "train"), 3)]
        else:
            series = [(TRAIN, *_series(records, key, "train"), 1),
                      (VALID, *_series(records, key, "valid"), 3)]
        _panel(img, box, title, series)
    out = Path(output) if output else run_dir / "plot.png"
    write_png(out, img)
    return out


def plot_on_eval(run_dir, then=None):
    """An `on_eval` callback for `trainer.train` that redraws RUN_DIR/plot.png
    after each validation (written beside and renamed into place, so a reader
    never sees half a file), then calls `then(record)`."""
    run_dir = Path(run_dir)

    def on_eval(record):
        tmp = run_dir / ".plot.png.tmp"
        plot_run(run_dir, tmp)
        tmp.replace(run_dir / "plot.png")
        if then is not None:
            then(record)

    return on_eval
