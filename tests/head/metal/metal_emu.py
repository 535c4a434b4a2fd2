"""Compile Metal kernel sources as C++ against the emulation in emu/ and run them.

    prog = metal_emu.build("metal/head.metal", include_dirs=[mlx_include])
    out = np.zeros(n, np.float32)
    prog.run(metal_emu.Dispatch("head_fwd_float", {0: x, 1: out, 2: np.int32(n)},
                                threadgroups=(g, 1, 1), threads=(256, 1, 1)))

See tests/head/metal/README.md for how entry points are bound and what each build
mode catches.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from msl_source import (
    Binding, CompileError, Kernel, address_space_errors, entry_table, kernel_argument_errors,
    mutate, parse_kernels, rewrite_threadgroup, strip_attributes, use_shadows,
)

__all__ = ["CompileError", "Dispatch", "EmulationError", "Program", "Window", "build",
           "find_compiler", "mutate"]

HERE = Path(__file__).resolve().parent
EMU = HERE / "emu"
ROOT = HERE.parents[2]
CACHE = ROOT / "build" / "metal-emu"
MODES = ("run", "asan", "tsan", "typecheck")

FLAGS = ["-std=c++17", "-fno-fast-math", "-U_FORTIFY_SOURCE", "-Wno-unknown-attributes",
         "-Wno-unknown-pragmas", "-Wno-pass-failed", "-Wno-ignored-attributes", "-Wno-unused-value"]
MODE_FLAGS = {
    "run": ["-O1"],
    "asan": ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
             "-fno-omit-frame-pointer"],
    "tsan": ["-O1", "-g", "-fsanitize=thread"],
    "typecheck": ["-DEMU_TYPECHECK", "-fsyntax-only", "-ferror-limit=0"],
}
# The runtime itself is not instrumented under ThreadSanitizer: it only
# annotates what orders the kernels' threads.
RUNTIME_FLAGS = {**MODE_FLAGS, "tsan": ["-O1", "-g", "-DEMU_TSAN"]}
LINK_FLAGS = {"run": [], "asan": ["-fsanitize=address,undefined"], "tsan": ["-fsanitize=thread"]}
# Threads per dispatch up to which ThreadSanitizer was seen to keep every
# thread's accesses apart (it recycles thread slots beyond about 240).
TSAN_THREADS = 256
SANITIZER_ENV = {"ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0",
                 "TSAN_OPTIONS": "halt_on_error=1:report_thread_leaks=0:report_signal_unsafe=0"}


class EmulationError(RuntimeError):
    """The emulated kernel failed: divergent barrier, unbound buffer, AddressSanitizer, ..."""


def find_compiler() -> str | None:
    """The newest clang++ on PATH (14 or later; the type-check build wants 15 or
    later for clang's 16-bit float types), or None."""
    for name in (*(f"clang++-{v}" for v in range(21, 13, -1)), "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass(eq=False)
class Window:
    """A device buffer of `nbytes` (mapped lazily: untouched pages cost no
    memory) whose bytes [offset, offset + array.nbytes) are `array`'s, updated
    in place after a run. For offsets beyond 32 bits without the memory."""

    array: np.ndarray
    nbytes: int
    offset: int


@dataclass
class Dispatch:
    """One dispatch_threadgroups call.

    buffers: index -> numpy array (device buffer, updated in place after the
    run; the same array object in several dispatches is the same buffer), or
    bytes / numpy scalar (set_bytes). threadgroup_memory: index -> bytes for
    [[threadgroup(n)]] parameters (set_threadgroup_memory_length).
    """

    entry: str
    buffers: dict
    threadgroups: tuple = (1, 1, 1)
    threads: tuple = (32, 1, 1)
    threadgroup_memory: dict = field(default_factory=dict)


# --- Building ---------------------------------------------------------------

def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def _emu_files_digest() -> str:
    files = sorted(p for p in EMU.rglob("*") if p.is_file())
    return _digest(*[(str(p.relative_to(EMU)), p.read_bytes()) for p in files],
                   Path(__file__).read_bytes(), (HERE / "msl_source.py").read_bytes())


def _run(cmd: list[str], what: str, cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if proc.returncode != 0:
        raise CompileError(f"{what} failed:\n{' '.join(cmd)}\n{proc.stderr[-6000:]}")
    return proc.stdout


def _runtime_object(cxx: str, mode: str) -> Path:
    key = _digest(cxx, mode, _emu_files_digest())
    obj = CACHE / f"runtime-{mode}-{key}.o"
    if not obj.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = obj.with_suffix(f".{os.getpid()}.tmp")
        _run([cxx, *FLAGS, *RUNTIME_FLAGS[mode], "-I", str(EMU / "include"), "-c",
              str(EMU / "runtime.cpp"), "-o", str(tmp)], "compiling the emulator runtime")
        tmp.rename(obj)
    return obj


@dataclass
class Program:
    """A compiled kernel source: run dispatches with run()."""

    exe: Path | None
    kernels: dict[str, Kernel]
    mode: str

    def run(self, *dispatches: Dispatch, seed: int = 0, shuffle_groups: bool = True,
            timeout: float = 600) -> None:
        """Runs the dispatches in order in one process; arrays are updated in place.

        seed drives the random thread schedule (and the threadgroup order when
        shuffle_groups). Raises EmulationError when the kernel fails.
        """
        if self.exe is None:
            raise ValueError(f"a {self.mode!r} build compiles only; build with mode='run' "
                             f"or 'asan' to run kernels")
        for d in dispatches:
            total = int(np.prod(d.threadgroups)) * int(np.prod(d.threads))
            if self.mode == "tsan" and total > TSAN_THREADS:
                warnings.warn(f"{d.entry}: ThreadSanitizer keeps about {TSAN_THREADS} threads "
                              f"apart; races among this dispatch's {total} threads may go "
                              f"unreported", stacklevel=2)
            if d.entry not in self.kernels:
                raise ValueError(f"entry {d.entry!r} is not in this build; entries: "
                                 f"{sorted(self.kernels)}")
            if len(d.threadgroups) != 3 or len(d.threads) != 3:
                raise ValueError("threadgroups and threads must be 3-tuples")
        with tempfile.TemporaryDirectory(prefix="metal-emu-") as tmp:
            tmp = Path(tmp)
            ids: dict[int, int] = {}
            arrays: dict[int, np.ndarray] = {}
            job = []

            def buffer_id(value) -> int:
                key = id(value)
                if key in ids:
                    return ids[key]
                bid = len(ids)
                ids[key] = bid
                if isinstance(value, Window):
                    if value.offset < 0 or value.offset + value.array.nbytes > value.nbytes:
                        raise ValueError("the window's array does not fit its virtual buffer")
                    arrays[bid] = value.array
                    data = value.array.tobytes()
                    (tmp / f"in{bid}").write_bytes(data)
                    job.append(f"buffer {bid} {len(data)} {tmp / f'in{bid}'} {value.nbytes} "
                               f"{value.offset}")
                    return bid
                if isinstance(value, np.ndarray):
                    if not value.flags.c_contiguous:
                        raise ValueError("buffers must be C-contiguous arrays")
                    arrays[bid] = value
                    data = value.tobytes()
                elif isinstance(value, (bytes, bytearray)):
                    data = bytes(value)
                elif isinstance(value, np.generic):
                    data = value.tobytes()
                else:
                    raise TypeError(f"buffer values are numpy arrays, numpy scalars or bytes, "
                                    f"not {type(value).__name__}")
                (tmp / f"in{bid}").write_bytes(data)
                job.append(f"buffer {bid} {len(data)} {tmp / f'in{bid}'}")
                return bid

            for n, d in enumerate(dispatches):
                binds = [(int(i), buffer_id(v)) for i, v in sorted(d.buffers.items())]
                tgm = sorted((int(i), int(v)) for i, v in d.threadgroup_memory.items())
                job.append(" ".join(map(str, [
                    "run", d.entry, *d.threadgroups, *d.threads, seed + 3 * n,
                    int(shuffle_groups), len(binds), *[x for b in binds for x in b],
                    len(tgm), *[x for t in tgm for x in t]])))
            for bid in arrays:
                job.append(f"save {bid} {tmp / f'out{bid}'}")
            (tmp / "job").write_text("\n".join(job) + "\n")
            env = dict(os.environ, **SANITIZER_ENV)
            try:
                proc = subprocess.run([str(self.exe), str(tmp / "job")], capture_output=True,
                                      text=True, timeout=timeout, env=env)
            except subprocess.TimeoutExpired:
                raise EmulationError(f"the kernels did not finish within {timeout} s (a loop "
                                     f"that never ends, or a problem too large to emulate)")
            if proc.returncode != 0:
                raise EmulationError(_error_message(proc.stderr, proc.returncode))
            for bid, arr in arrays.items():
                data = (tmp / f"out{bid}").read_bytes()
                if data == arr.tobytes():
                    continue
                if not arr.flags.writeable:
                    raise EmulationError(f"a kernel wrote into buffer id {bid}, a read-only array")
                arr[...] = np.frombuffer(data, dtype=arr.dtype).reshape(arr.shape)


def _error_message(stderr: str, rc: int) -> str:
    for line in stderr.splitlines():
        if line.startswith("emu error:"):
            return line
    lines = stderr.splitlines()
    if any("ThreadSanitizer: data race" in ln for ln in lines):
        # The two accesses: the first frame of each stack.
        keep = [ln.strip() for ln in lines if "ThreadSanitizer: data race" in ln
                or re.match(r"\s*(Read|Write|Atomic|Previous)", ln) or re.match(r"\s*#0 ", ln)]
        return "ThreadSanitizer: " + " | ".join(keep[:5]) + "\n" + stderr[-3000:]
    ubsan = [ln for ln in lines if "runtime error:" in ln]
    if ubsan:
        return "UndefinedBehaviorSanitizer: " + ubsan[0] + "\n" + stderr[-3000:]
    asan = [ln for ln in lines if "AddressSanitizer" in ln and "WARNING" not in ln]
    if asan:
        return "AddressSanitizer: " + " | ".join(asan[:2]) + "\n" + stderr[-3000:]
    return f"the emulator exited with status {rc}:\n{stderr[-3000:]}"


def build(source: str | Path, *, include_dirs=(), defines: dict | None = None,
          entries=(), mode: str = "run", cxx: str | None = None) -> Program:
    """Compiles a Metal source (a path, or the source text) for the emulator.

    include_dirs: searched for `#include "..."` (e.g. the mlx-metal wheel's
    mlx/include); a path source's own directory comes first. defines: -D
    macros. entries: extra template entry points to bind, as "func<args>"
    (host_name instantiations and plain kernels are bound automatically).
    mode: "run", "asan" (AddressSanitizer and UndefinedBehaviorSanitizer,
    buffers allocated to their exact size), "tsan" (ThreadSanitizer: accesses
    that no barrier or dispatch boundary orders are races, whatever the
    schedule) or "typecheck" (address spaces as clang address spaces; compile
    only).
    The result is cached under build/metal-emu/ by a hash of everything that
    goes into it.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    cxx = cxx or find_compiler()
    if cxx is None:
        raise CompileError("no clang++ found (install clang)")
    if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source
                                     and source.endswith(".metal")):
        path = Path(source).resolve()
        text, incs = path.read_text(), [path.parent, *map(Path, include_dirs)]
    else:
        text, incs = str(source), list(map(Path, include_dirs))
    text = use_shadows(text, EMU / "shadow")
    defines = dict(defines or {})
    inc_flags = ["-I", str(EMU / "shadow"), "-I", str(EMU / "include")]
    for p in incs:
        inc_flags += ["-I", str(p)]
    def_flags = [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in defines.items()]
    mode_flags = MODE_FLAGS[mode]
    # The cache key hashes the preprocessed text, so that a change in any
    # included file rebuilds.
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".metal", dir=CACHE) as src:
        src.write(text)
        src.flush()
        pre = _run([cxx, "-E", "-x", "c++", *FLAGS, *[f for f in mode_flags if f.startswith("-D")],
                    *inc_flags, *def_flags, src.name], "preprocessing")
    pre = pre.replace(src.name, "source.metal")
    key = _digest(pre, list(entries), mode, cxx, _emu_files_digest())
    out = CACHE / key
    kernels_file = out / "kernels.txt"
    exe = out / "kernel" if mode != "typecheck" else None
    if (out / "done").exists():
        (out / "done").touch()  # recently used: kept by _prune
        return Program(exe, _load_kernels(kernels_file), mode)

    work = CACHE / f"{key}.{os.getpid()}.tmp"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    kernels, templates = parse_kernels(pre)
    for e in entries:
        func = e.split("<")[0].strip()
        if func not in templates:
            raise CompileError(f"entry {e!r}: no [[kernel]] function {func!r} in the source")
        name = re.sub(r"\s+", "", e)
        kernels[name] = Kernel(name, e, templates[func].bindings, templates[func].max_threads)
    if not kernels:
        raise CompileError("no [[kernel]] entry points found in the source")
    body = rewrite_threadgroup(strip_attributes(pre), typecheck=mode == "typecheck")
    if mode == "typecheck":
        # Compile only: instantiating the explicit entries is enough.
        tail = "".join(f"\ntemplate decltype({e}) {e};" for e in entries) + "\n"
    else:
        tail = entry_table(kernels)
    (work / "kernel.ii").write_text(body + tail)
    compile_flags = [cxx, "-x", "c++-cpp-output", *FLAGS, *mode_flags, str(work / "kernel.ii")]
    if mode == "typecheck":
        proc = subprocess.run(compile_flags, capture_output=True, text=True)
        errors = kernel_argument_errors([*kernels.values(), *templates.values()])
        errors += address_space_errors(proc.stderr)
        if errors or (proc.returncode != 0 and "error:" not in proc.stderr):
            raise CompileError("type-check compile failed:\n" + ("\n\n".join(errors)
                                                                 or proc.stderr[-6000:]))
    else:
        _run([*compile_flags, "-c", "-o", str(work / "kernel.o")], "compiling the kernel")
        _run([cxx, *LINK_FLAGS[mode], str(work / "kernel.o"), str(_runtime_object(cxx, mode)), "-o",
              str(work / "kernel")], "linking")
        (work / "kernel.o").unlink()
    _save_kernels(work / "kernels.txt", kernels)
    (work / "done").write_text("")
    shutil.rmtree(out, ignore_errors=True)
    work.rename(out)
    _prune()
    return Program(exe, kernels, mode)


def _prune(keep: int = 200) -> None:
    """Removes all but the `keep` most recently used builds from the cache."""
    builds = sorted(((d / "done").stat().st_mtime, d) for d in CACHE.iterdir()
                    if (d / "done").exists())
    for _, d in builds[:-keep]:
        shutil.rmtree(d, ignore_errors=True)


def _save_kernels(path: Path, kernels: dict[str, Kernel]) -> None:
    lines = []
    for k in kernels.values():
        b = " ".join(f"{x.kind}:{x.index}:{x.name}" for x in k.bindings)
        lines.append(f"{k.name}\t{k.function}\t{k.max_threads}\t{b}")
    path.write_text("\n".join(lines) + "\n")


def _load_kernels(path: Path) -> dict[str, Kernel]:
    kernels = {}
    for line in path.read_text().splitlines():
        name, func, mt, b = line.split("\t")
        binds = [Binding(k, int(i), n) for k, i, n in (x.split(":") for x in b.split())]
        kernels[name] = Kernel(name, func, binds, int(mt))
    return kernels
