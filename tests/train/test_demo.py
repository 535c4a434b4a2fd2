"""The demo: its bundled data, its deterministic tiny model, and that it learns."""

import json
import shlex
import subprocess

import pytest
from runs import console_script

from flash_cce.train.demo import (DATA_DIR, MARKER, SPLITS, UNPAIRED_DIR, demo_records, demo_words, run_demo,
                            unpaired_records)
from flash_cce.train.tiny import build_tiny_model


def test_bundled_data_is_the_generator_output():
    records = demo_records()
    for split, n in SPLITS.items():
        lines = (DATA_DIR / f"{split}.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == records[split] and len(lines) == n
        lines = (UNPAIRED_DIR / f"{split}.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == unpaired_records(records[split])
        assert [r["label"] for r in map(json.loads, lines[:4])] == [True, False, True, False]


def test_held_out_triples_are_unseen():
    def triple(r):
        w = r["prompt"].split()  # name has a(n) color object . what color is the object ?
        return w[0], w[3], w[4]

    records = demo_records()
    seen = {triple(r) for r in records["train"]}
    for split in ("valid", "test"):
        assert not seen & {triple(r) for r in records[split]}
    assert all(r["chosen"] != r["rejected"] for rs in records.values() for r in rs)


def test_tiny_model_is_deterministic(tmp_path):
    a = build_tiny_model(tmp_path / "a", demo_words(), seed=0)
    b = build_tiny_model(tmp_path / "b", demo_words(), seed=0)
    c = build_tiny_model(tmp_path / "c", demo_words(), seed=1)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="unknown config keys"):
        build_tiny_model(tmp_path / "d", demo_words(), hiden_size=8)


def test_demo_learns_the_preference(tmp_path):
    """The full demo (150 steps, ~20 s here): held-out accuracy from chance to >= 0.9."""
    lines = []
    evals = run_demo(tmp_path / "demo", log=lines.append)
    assert evals[0]["step"] == 0 and evals[0]["rewards/accuracies"] <= 0.7
    assert evals[-1]["step"] == 150 and evals[-1]["rewards/accuracies"] >= 0.9
    run = tmp_path / "demo"
    for name in ("metrics.jsonl", "plot.png", "adapters/adapters.safetensors",
                 "adapters/adapter_config.json", "best/adapters.safetensors", MARKER):
        assert (run / name).exists(), name
    text = "\n".join(lines)
    assert "before" in text and "after" in text
    # The printed command answers as the demo's own greedy answer after training:
    # the color the prompt states.
    (cmd,) = [line.split("Try: ", 1)[1] for line in text.splitlines() if line.startswith("Try: ")]
    argv = shlex.split(cmd)
    proc = subprocess.run([*console_script(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    answer = proc.stdout.split("==========")[1].strip()
    first = demo_records()["test"][0]
    assert argv[argv.index("--prompt") + 1] == first["prompt"]
    assert answer.split()[0] == first["chosen"].split()[0], (answer, first)
    # A rerun replaces its own directory but refuses anyone else's.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not a demo directory"):
        run_demo(tmp_path / "other", iters=1, log=lines.append)
