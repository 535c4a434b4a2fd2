"""bench/ptx_cache.py: the GPU suite's kernel-cache archive keeps whole entries
only, and gives them back only to the MLX version that wrote them."""

import importlib.util
import struct
import tarfile
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
spec = importlib.util.spec_from_file_location("ptx_cache", BENCH / "ptx_cache.py")
ptx_cache = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ptx_cache)

PTX = ".version 8.0\n.target sm_90\n.visible .entry k()\n{\n\tret;\n}\n\0"  # as NVRTC ends it


def _cubin(code=b"\x01" * 40, table_first=False):
    """An ELF64 image laid out as nvcc's cubins are: header, section contents,
    then the section header table (a null section, one holding `code` and a
    shared-memory one, which occupies no bytes of the file); or, as ELF also
    allows, the table before the contents."""
    table = 3 * 64
    shoff, at = (64, 64 + table) if table_first else (64 + len(code), 64)
    header = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9) + struct.pack(
        "<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, shoff, 0, 64, 56, 0, 64, 3, 0)
    sections = (bytes(64) + struct.pack("<IIQQQQIIQQ", 0, 1, 0, 0, at, len(code), 0, 0, 1, 0)
                + struct.pack("<IIQQQQIIQQ", 0, 8, 3, 0, at + len(code), 4096, 0, 0, 16, 0))
    return header + (sections + code if table_first else code + sections)


def _entry(root, name, ptx=PTX, txt=True):
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".ptx").write_bytes(ptx.encode() if isinstance(ptx, str) else ptx)
    if txt:
        path.with_suffix(".txt").write_text("k\tk\n")


def test_merge_keeps_whole_entries_once_and_seed_returns_them(tmp_path):
    a, b = tmp_path / "gw0", tmp_path / "gw1"
    _entry(a, "shared")
    _entry(b, "shared")
    _entry(a, "sub/only_a")
    _entry(b, "cut_short", ptx=PTX[:30])  # a process stopped while writing
    _entry(b, "no_names", txt=False)
    _entry(a, "cubin", ptx=_cubin())
    for cut in (-1, -192, -214):  # into its section header table, all of it, into the code
        _entry(b, f"cubin_cut{-cut}", ptx=_cubin()[:cut])
    _entry(b, "cubin_table_first_cut", ptx=_cubin(table_first=True)[:-1])  # into the code
    out = tmp_path / "cache.tar.xz"
    assert ptx_cache.merge(out, [a, b], "0.32.4") == (3, 6)
    with tarfile.open(out) as tar:
        assert sorted(tar.getnames()) == ["cubin.ptx", "cubin.txt", "mlx-version", "shared.ptx",
                                          "shared.txt", "sub/only_a.ptx", "sub/only_a.txt"]
    fresh = [tmp_path / "new0", tmp_path / "new1"]
    assert ptx_cache.seed(out, fresh, "0.32.4") == 3
    for d in fresh:
        assert (d / "sub" / "only_a.ptx").read_text() == PTX
        assert (d / "cubin.ptx").read_bytes() == _cubin()
        assert (d / "shared.txt").read_text() == "k\tk\n"
    other = tmp_path / "other"
    assert ptx_cache.seed(out, [other], "0.33.0") == 0
    assert not other.exists()
