"""Checks a cross-built macOS extension module without a Mac.

Reads the Mach-O file's header, load commands and symbol table and checks:
arm64, a loadable module (MH_BUNDLE, or MH_DYLIB as zig links one); every
library it loads resolves in an installed layout (SITE/flash_cce/<module>,
SITE/mlx/lib/libmlx.dylib) through its rpaths, or is a system library; no rpath
points into the build machine; libmlx.dylib is among the libraries; symbols
left to dynamic lookup are CPython's alone (everything else is bound to a
library); the module exports its PyInit function.

    python macho_check.py MODULE SITE
"""

import shutil
import struct
import sys
import tempfile
from pathlib import Path

MH_MAGIC_64 = 0xFEEDFACF
CPU_TYPE_ARM64 = 0x0100000C
FILETYPES = {6: "MH_DYLIB", 8: "MH_BUNDLE"}
LC_REQ_DYLD = 0x80000000
LC_SYMTAB = 0x2
LOAD_DYLIB = {0xC, 0x18 | LC_REQ_DYLD, 0x1F | LC_REQ_DYLD, 0x23 | LC_REQ_DYLD}
LC_RPATH = 0x1C | LC_REQ_DYLD
# Library ordinals of undefined symbols bound to no library: flat lookup
# (ld64 writes 0xFE; zig's linker writes 0).
FLAT_LOOKUP_ORDINALS = (0x00, 0xFE)
SYSTEM_PREFIXES = ("/usr/lib/", "/System/Library/")


def cstring(data, off):
    return data[off:data.index(b"\0", off)].decode()


def parse(data):
    magic, cputype, _, filetype, ncmds, _, _, _ = struct.unpack_from("<IiiIIIII", data, 0)
    if magic != MH_MAGIC_64:
        raise SystemExit(f"not a 64-bit little-endian Mach-O file (magic {magic:#x})")
    dylibs, rpaths, symbols = [], [], []
    off = 32
    for _ in range(ncmds):
        cmd, size = struct.unpack_from("<II", data, off)
        if cmd in LOAD_DYLIB:
            (name_off,) = struct.unpack_from("<I", data, off + 8)
            dylibs.append(cstring(data, off + name_off))
        elif cmd == LC_RPATH:
            (path_off,) = struct.unpack_from("<I", data, off + 8)
            rpaths.append(cstring(data, off + path_off))
        elif cmd == LC_SYMTAB:
            symoff, nsyms, stroff, _ = struct.unpack_from("<IIII", data, off + 8)
            for i in range(nsyms):
                strx, ntype, _, desc, _ = struct.unpack_from("<IBBHQ", data, symoff + 16 * i)
                symbols.append((cstring(data, stroff + strx), ntype, desc))
        off += size
    return cputype, filetype, dylibs, rpaths, symbols


def resolve(name, rpaths, loader_dir):
    """The file that dyld loads for install name `name`, or None."""
    if name.startswith(SYSTEM_PREFIXES):
        return name
    candidates = []
    if name.startswith("@rpath/"):
        for rp in rpaths:
            candidates.append(rp.replace("@loader_path", str(loader_dir)) + name[len("@rpath"):])
    elif name.startswith("@loader_path/"):
        candidates.append(name.replace("@loader_path", str(loader_dir)))
    for c in candidates:
        if Path(c).exists():
            return str(Path(c).resolve())
    return None


def main(module, site):
    module, site = Path(module), Path(site)
    data = module.read_bytes()
    cputype, filetype, dylibs, rpaths, symbols = parse(data)
    errors = []
    if cputype != CPU_TYPE_ARM64:
        errors.append(f"cpu type {cputype:#x}, not arm64")
    if filetype not in FILETYPES:
        errors.append(f"file type {filetype}, not a loadable module")
    for rp in rpaths:
        if not rp.startswith("@loader_path"):
            errors.append(f"rpath {rp!r} does not start at the module (@loader_path)")
    with tempfile.TemporaryDirectory() as tmp:
        # The installed layout: the module in SITE/flash_cce, MLX in SITE/mlx.
        pkg = Path(tmp) / "flash_cce"
        pkg.mkdir()
        shutil.copy(module, pkg / module.name)
        (Path(tmp) / "mlx").symlink_to((site / "mlx").resolve())
        resolved = {}
        for name in dylibs:
            resolved[name] = resolve(name, rpaths, pkg)
            if resolved[name] is None:
                errors.append(f"{name} does not resolve (rpaths {rpaths})")
    if not any(Path(name).name == "libmlx.dylib" for name in dylibs):
        errors.append("libmlx.dylib is not linked")
    undefined = [(n, d) for n, t, d in symbols if t & 0x0E == 0 and t & 0x01]
    lookup = [n for n, d in undefined if (d >> 8) & 0xFF in FLAT_LOOKUP_ORDINALS]
    foreign = [n for n in lookup if not n.startswith(("_Py", "__Py"))]
    if foreign:
        errors.append(f"symbols left to dynamic lookup besides CPython's: {foreign[:10]}")
    init = "_PyInit_" + module.name.split(".")[0]
    if not any(n == init and not (t & 0x0E == 0) for n, t, _ in symbols):
        errors.append(f"{init} is not defined")
    print(f"{module.name}: Mach-O arm64 {FILETYPES.get(filetype, filetype)}, {len(undefined)} "
          f"undefined symbols ({len(lookup)} CPython API by dynamic lookup), rpaths {rpaths}")
    for name in dylibs:
        print(f"  loads {name} -> {resolved[name]}")
    for e in errors:
        print(f"error: {e}")
    return 1 if errors else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
