"""bench/bench_metal.py: refuses cleanly without an Apple GPU; its table."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_metal.py"


@pytest.mark.skipif(mx.metal.is_available(), reason="this machine has a Metal GPU")
def test_exits_with_a_clear_message_without_metal(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, str(BENCH), "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "Apple GPU" in r.stderr and "bench_head.py" in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()


def test_table_puts_providers_side_by_side():
    spec = importlib.util.spec_from_file_location("bench_metal", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(BENCH.parent))
    base = dict(M=512, H=2560, V=262144, variant="q4", mode="fwd_bwd")
    results = [dict(base, provider="metal", ms=100.0, peak_gb=0.5, model_ms=80.25),
               dict(base, provider="fallback", ms=250.0, peak_gb=1.25),
               dict(base, provider="mlx", ms=None, error="out of memory"),
               dict(base, mode="check", abs_diff=1e-6)]
    lines = bench.table(results).splitlines()
    assert len(lines) == 3
    assert lines[2] == "| 512,2560,262144 | q4 | fwd_bwd | 100.0 / 0.50 | 250.0 / 1.25 | fails | 2.50 | 80.2 |"
