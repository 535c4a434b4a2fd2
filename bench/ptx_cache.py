"""The GPU suite's cache of the kernels that MLX's CUDA backend compiles at run
time (one folder per test process, `MLX_PTX_CACHE_DIR`), kept between runs as one
archive (`bench/run_gpu.sh suite` writes it; FLASH_CCE_PTX_SEED gives it back):

    python bench/ptx_cache.py merge OUT.tar.xz CACHE_DIR...
    python bench/ptx_cache.py seed ARCHIVE CACHE_DIR...

MLX names an entry after what it compiles (a compiled graph's operations, a
custom kernel's name and source hash), stores it as NAME.ptx and NAME.txt (the
kernels' mangled names), and reads it back whenever it meets the name, so an
archive serves only the MLX version that wrote it (recorded in it; `seed`
leaves the caches empty for another). A process stopped while writing leaves
an entry cut short, so `merge` keeps whole ones only: a .ptx whose text ends
with the closing brace of its last function, beside its .txt.
"""

import io
import sys
import tarfile
from pathlib import Path

VERSION = "mlx-version"


def mlx_version():
    import mlx.core as mx

    return mx.__version__


def whole(ptx):
    return ptx.read_bytes().rstrip().endswith(b"}") and ptx.with_suffix(".txt").exists()


def merge(out, dirs, version):
    """Writes the archive; returns (entries kept, entries left out)."""
    kept, dropped = {}, 0
    for d in map(Path, dirs):
        for ptx in sorted(d.rglob("*.ptx")):
            rel = ptx.relative_to(d)
            if rel in kept:
                continue
            if whole(ptx):
                kept[rel] = ptx
            else:
                dropped += 1
    with tarfile.open(out, "w:xz") as tar:
        data = version.encode()
        info = tarfile.TarInfo(VERSION)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        for rel, ptx in sorted(kept.items()):
            tar.add(ptx, arcname=str(rel))
            tar.add(ptx.with_suffix(".txt"), arcname=str(rel.with_suffix(".txt")))
    return len(kept), dropped


def seed(archive, dirs, version):
    """Unpacks the archive's entries into each of `dirs`; returns how many
    entries (0 when the archive is of another MLX version)."""
    with tarfile.open(archive) as tar:
        if tar.extractfile(VERSION).read().decode() != version:
            return 0
        entries = {m.name: tar.extractfile(m).read() for m in tar.getmembers()
                   if m.isfile() and m.name != VERSION
                   and not Path(m.name).is_absolute() and ".." not in Path(m.name).parts}
    for d in map(Path, dirs):
        for name, data in entries.items():
            path = d / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    return sum(name.endswith(".ptx") for name in entries)


def main(argv):
    if len(argv) < 3 or argv[0] not in ("merge", "seed"):
        sys.exit(__doc__)
    version = mlx_version()
    if argv[0] == "merge":
        n, dropped = merge(argv[1], argv[2:], version)
        print(f"kernel cache: {n} entries written to {argv[1]}"
              + (f" ({dropped} cut short left out)" if dropped else ""))
    else:
        n = seed(argv[1], argv[2:], version)
        print(f"kernel cache: {n} entries from {argv[1]} in each of {len(argv) - 2} caches"
              if n else f"kernel cache: {argv[1]} is not of MLX {version}; caches start empty")


if __name__ == "__main__":
    main(sys.argv[1:])
