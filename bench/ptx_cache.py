"""The GPU suite's cache of the kernels that MLX's CUDA backend compiles at run
time (one folder per test process, `MLX_PTX_CACHE_DIR`), kept between runs as one
archive (`bench/run_gpu.sh suite` writes it; FLASH_CCE_PTX_SEED gives it back):

    python bench/ptx_cache.py merge OUT.tar.xz CACHE_DIR...
    python bench/ptx_cache.py seed ARCHIVE CACHE_DIR...
    python bench/ptx_cache.py timeline CACHE_DIR

`timeline` lists a cache's entries in the order they were written, each with
the seconds since the one before (for a cache that a single process filled
from empty, about the time that entry took to compile) and its size.

MLX names an entry after what it compiles (a compiled graph's operations, a
custom kernel's name and source hash), stores it as NAME.ptx (PTX text, or a
cubin: an ELF image, when NVRTC compiles for the device's own architecture)
and NAME.txt (the kernels' mangled names, a line each), and reads it back
whenever it meets the name, so an archive serves only the MLX version that
wrote it (recorded in it; `seed` leaves the caches empty for another). A
process stopped while writing leaves an entry cut short, so `merge` keeps whole
ones only: a cubin as long as its ELF headers say, or PTX text ending with the
closing brace of its last function, beside a names file of whole lines.
"""

import io
import struct
import sys
import tarfile
from pathlib import Path

VERSION = "mlx-version"


def mlx_version():
    import mlx.core as mx

    return mx.__version__


def _elf_length(data):
    """The length an ELF64 image's headers give it: the end of its section
    header table, program header table or furthest section with contents."""
    if len(data) < 64 or data[4] != 2 or data[5] != 1:  # ELF64, little-endian
        return None
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    end = max(phoff + phnum * phentsize, shoff + shnum * shentsize)
    if len(data) < end:
        return end
    for k in range(shnum):
        kind, _, _, offset, size = struct.unpack_from("<IQQQQ", data, shoff + k * shentsize + 4)
        if kind != 8:  # SHT_NOBITS occupies no bytes of the file
            end = max(end, offset + size)
    return end


def whole(ptx):
    data = ptx.read_bytes()
    if data.startswith(b"\x7fELF"):
        length = _elf_length(data)
        complete = length is not None and len(data) >= length
    else:  # NVRTC's PTX ends with a NUL
        complete = data.rstrip(b"\0 \t\r\n").endswith(b"}")
    names = ptx.with_suffix(".txt")
    if not complete or not names.exists():
        return False
    lines = names.read_bytes()
    return lines.endswith(b"\n") and all(b"\t" in line for line in lines.splitlines())


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


def timeline(cache):
    """(seconds since the previous entry, seconds since the first, bytes, name)
    per entry, oldest first."""
    entries = sorted((p.stat().st_mtime, p) for p in Path(cache).rglob("*.ptx"))
    t0 = entries[0][0] if entries else 0.0
    rows, prev = [], t0
    for t, p in entries:
        rows.append((t - prev, t - t0, p.stat().st_size, str(p.relative_to(cache))))
        prev = t
    return rows


def main(argv):
    if len(argv) == 2 and argv[0] == "timeline":
        rows = timeline(argv[1])
        for gap, at, size, name in rows:
            print(f"{gap:7.2f} s {at:8.2f} s {size:9d} B  {name[:160]}")
        print(f"{len(rows)} entries, {sum(r[0] for r in rows):.1f} s between the first and last")
        return
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
