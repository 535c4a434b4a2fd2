"""bench/bench_grpo.py at a tiny size: the rollout comparison (ours against
mlx-lm's batch_generate) and the torch + TRL 1.16 update each produce a row of
finite numbers; without torch the TRL row says why it is missing."""

import importlib
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
TINY = ["--completions", "4", "--generations", "3", "--groups", "2", "--prompt", "6", "--repeats", "1"]


@pytest.fixture(scope="module")
def bench_grpo():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("bench_grpo")
    finally:
        sys.path.remove(str(BENCH))


def run(bench_grpo, tmp_path, monkeypatch, *args):
    out = tmp_path / "grpo.json"
    monkeypatch.setattr(sys, "argv", ["bench_grpo.py", *TINY, *args, "--json", str(out)])
    bench_grpo.main()
    return json.loads(out.read_text())


def finite_positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_rollouts_against_batch_generate(bench_grpo, tmp_path, monkeypatch):
    got = run(bench_grpo, tmp_path, monkeypatch, "--phases", "rollout", "--providers", "flash_cce", "mlx-lm")
    (r,) = got["rows"]
    assert r["rollout_tokens"] == 3 * 2 * 4 and r["update"] == {}
    assert set(r["rollout"]) == {"flash_cce", "mlx-lm"}
    for name, cell in r["rollout"].items():
        # every row runs its full length (no EOS): the counted tokens are all of them
        assert cell["tokens"] == r["rollout_tokens"], (name, cell)
        for key in ("ms", "peak_gb", "first_ms", "tokens_per_s"):
            assert finite_positive(cell[key]), (name, key, cell)
        assert cell["tokens_per_s"] == pytest.approx(cell["tokens"] / (cell["ms"] / 1e3), rel=1e-3)
    peer = r["rollout"]["mlx-lm"]
    ours = r["rollout"]["flash_cce"]
    assert peer["flash_cce_time_ratio"] == pytest.approx(ours["ms"] / peer["ms"], abs=1e-3)


def test_trl_row_says_why_it_is_missing(bench_grpo, tmp_path, monkeypatch):
    import grpo_torch

    monkeypatch.setattr(grpo_torch, "missing", lambda liger=False: "torch does not import (test)")
    got = run(bench_grpo, tmp_path, monkeypatch, "--phases", "update", "--providers", "trl", "--loss-types", "grpo")
    assert got["rows"][0]["update"] == {"grpo": {"trl": {"not_available": "torch does not import (test)"}}}


def test_trl_update(bench_grpo, tmp_path, monkeypatch):
    import grpo_torch

    reason = grpo_torch.missing()
    if reason:
        pytest.skip(f"the torch peer cannot run here: {reason}")
    got = run(bench_grpo, tmp_path, monkeypatch, "--phases", "update", "--providers", "trl")
    (r,) = got["rows"]
    assert set(r["update"]) == {"dapo", "grpo"}
    for loss_type, cells in r["update"].items():
        cell = cells["trl"]
        assert "error" not in cell and "not_available" not in cell, cell
        # the recorded rewards (seeded) are 1, 0, 0 in both groups: advantages
        # nonzero, so the adapters get a gradient
        for key in ("ms", "first_ms", "grad_norm"):
            assert finite_positive(cell[key]), (loss_type, key, cell)
        # On-policy every ratio is 1, so each token's loss is -A; the completions
        # have equal lengths and the advantages of a group sum to zero, so both
        # aggregations give 0 up to float32 rounding of the advantages (|A| <=
        # 2 / sqrt(3) here; a few ulps of 1 per token).
        assert math.isfinite(cell["loss"]) and abs(cell["loss"]) < 1e-5, (loss_type, cell)


def test_unknown_provider_is_refused(bench_grpo, tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run(bench_grpo, tmp_path, monkeypatch, "--phases", "update", "--providers", "trl", "tlr")
    assert exit_info.value.code == 2
    assert "--providers: unknown tlr; allowed: flash_cce, mlx-lm, mlx-lm-lora, trl, trl-liger" in capsys.readouterr().err
    assert not (tmp_path / "grpo.json").exists()
