"""bench/ptx_cache.py: the GPU suite's kernel-cache archive keeps whole entries
only, and gives them back only to the MLX version that wrote them."""

import importlib.util
import tarfile
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
spec = importlib.util.spec_from_file_location("ptx_cache", BENCH / "ptx_cache.py")
ptx_cache = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ptx_cache)

PTX = ".version 8.0\n.target sm_90\n.visible .entry k()\n{\n\tret;\n}\n"


def _entry(root, name, ptx=PTX, txt=True):
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".ptx").write_text(ptx)
    if txt:
        path.with_suffix(".txt").write_text("k\tk\n")


def test_merge_keeps_whole_entries_once_and_seed_returns_them(tmp_path):
    a, b = tmp_path / "gw0", tmp_path / "gw1"
    _entry(a, "shared")
    _entry(b, "shared")
    _entry(a, "sub/only_a")
    _entry(b, "cut_short", ptx=PTX[:30])  # a process stopped while writing
    _entry(b, "no_names", txt=False)
    out = tmp_path / "cache.tar.xz"
    assert ptx_cache.merge(out, [a, b], "0.32.4") == (2, 2)
    with tarfile.open(out) as tar:
        assert sorted(tar.getnames()) == ["mlx-version", "shared.ptx", "shared.txt",
                                          "sub/only_a.ptx", "sub/only_a.txt"]
    fresh = [tmp_path / "new0", tmp_path / "new1"]
    assert ptx_cache.seed(out, fresh, "0.32.4") == 2
    for d in fresh:
        assert (d / "sub" / "only_a.ptx").read_text() == PTX
        assert (d / "shared.txt").read_text() == "k\tk\n"
    other = tmp_path / "other"
    assert ptx_cache.seed(out, [other], "0.33.0") == 0
    assert not other.exists()
