"""Compile Metal kernel sources as C++ against the emulation in emu/ and run them.

    prog = metal_emu.build("metal/head.metal", include_dirs=[mlx_include])
    out = np.zeros(n, np.float32)
    prog.run(metal_emu.Dispatch("head_fwd_float", {0: x, 1: out, 2: np.int32(n)},
                                threadgroups=(g, 1, 1), threads=(256, 1, 1)))

See tests/metal/README.md for how entry points are bound and what each build
mode catches.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
EMU = HERE / "emu"
ROOT = HERE.parents[1]
CACHE = ROOT / "build" / "metal-emu"
MODES = ("run", "asan", "typecheck")

# Builtin parameter attributes the runtime can supply.
BUILTINS = (
    "thread_position_in_grid", "thread_position_in_threadgroup", "threadgroup_position_in_grid",
    "threads_per_threadgroup", "threadgroups_per_grid", "threads_per_grid",
    "thread_index_in_threadgroup", "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup", "simdgroups_per_threadgroup", "threads_per_simdgroup",
    "thread_index_in_quadgroup", "quadgroup_index_in_threadgroup",
)
# MSL attributes removed before the C++ compiler sees them.
MSL_ATTRIBUTES = BUILTINS + (
    "kernel", "host_name", "buffer", "threadgroup", "max_total_threads_per_threadgroup",
    "function_constant", "texture", "sampler", "user", "thread_execution_width",
)

FLAGS = ["-std=c++17", "-fno-fast-math", "-U_FORTIFY_SOURCE", "-Wno-unknown-attributes", "-Wno-unknown-pragmas",
         "-Wno-pass-failed", "-Wno-ignored-attributes", "-Wno-unused-value"]
MODE_FLAGS = {
    "run": ["-O1"],
    "asan": ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
             "-fno-omit-frame-pointer"],
    "typecheck": ["-DEMU_TYPECHECK", "-fsyntax-only", "-ferror-limit=0"],
}


class CompileError(RuntimeError):
    """clang rejected the kernel source (or the driver could not parse it)."""


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


@dataclass
class Binding:
    kind: str  # "buffer", "threadgroup" or a builtin name
    index: int  # buffer(n) / threadgroup(n); 0 for builtins
    name: str


@dataclass
class Kernel:
    name: str  # entry name for Dispatch: host_name, function name or "f<args>"
    function: str  # C++ expression naming the function (with template arguments)
    bindings: list[Binding]
    max_threads: int = 0


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


# --- Source parsing ---------------------------------------------------------

_KERNEL = re.compile(r"\[\[\s*kernel\s*\]\]")
_INSTANTIATION = re.compile(
    r"template\s*\[\[\s*host_name\(\s*\"([^\"]+)\"\s*\)\s*\]\]\s*\[\[\s*kernel\s*\]\]\s*"
    r"decltype\s*\(\s*([A-Za-z_][\w:]*)\s*<"
)
_MAX_THREADS = re.compile(r"\[\[\s*max_total_threads_per_threadgroup\(\s*(\d+)\s*\)\s*\]\]")
_ATTR = re.compile(r"\[\[\s*(\w+)\s*(?:\(\s*([^)\]]*)\s*\))?\s*\]\]\s*$")


def _balanced(text: str, start: int, open_: str, close: str) -> int:
    """Index just past the bracket closing the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    raise CompileError(f"unbalanced {open_!r} in kernel source")


def _split_params(params: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in params:
        if ch in "(<[{":
            depth += 1
        elif ch in ")>]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur))
    return [p.strip() for p in out]


def _param_binding(param: str, kernel: str) -> Binding:
    m = _ATTR.search(param)
    if not m:
        # MSL numbers buffer parameters without an attribute in order.
        if "*" in param or "&" in param:
            return Binding("buffer", -1, re.findall(r"[A-Za-z_]\w*", param)[-1])
        raise CompileError(f"kernel {kernel}: parameter '{param}' has no [[...]] attribute")
    attr, arg = m.group(1).replace("__emu_threadgroup", "threadgroup"), m.group(2)
    name = re.findall(r"[A-Za-z_]\w*", param[: m.start()])[-1]
    if attr in ("buffer", "threadgroup"):
        if arg is None or not arg.strip().isdigit():
            raise CompileError(f"kernel {kernel}: parameter '{name}' needs a literal index")
        return Binding(attr, int(arg), name)
    if attr in BUILTINS:
        return Binding(attr, 0, name)
    raise CompileError(f"kernel {kernel}: parameter '{name}' has attribute [[{attr}]], "
                       f"which the emulator does not support")


def _bindings(params: str, kernel: str) -> list[Binding]:
    bindings = [_param_binding(p, kernel) for p in _split_params(params)]
    used = {b.index for b in bindings if b.kind == "buffer"}
    nxt = 0
    for b in bindings:
        if b.kind == "buffer" and b.index < 0:
            while nxt in used:
                nxt += 1
            b.index = nxt
            used.add(nxt)
    return bindings


def parse_kernels(text: str) -> tuple[dict[str, Kernel], dict[str, Kernel]]:
    """(entry points, template kernels) in preprocessed MSL: entry points are
    the host_name instantiations and plain kernel functions."""
    functions: dict[str, tuple[list[Binding], int]] = {}
    templated: set[str] = set()
    for m in _KERNEL.finditer(text):
        rest = text[m.end():]
        d = re.match(r"\s*(?:\[\[[^\]]*\]\]\s*)*void\s+([A-Za-z_]\w*)\s*\(", rest)
        if not d:
            continue  # an instantiation; handled below
        open_at = m.end() + d.end() - 1
        params = text[open_at + 1: _balanced(text, open_at, "(", ")") - 1]
        name = d.group(1)
        if text[: m.start()].rstrip().endswith(">"):
            templated.add(name)
        around = text[max(0, m.start() - 200): m.end() + d.end()]
        mt = _MAX_THREADS.search(around)
        try:
            bindings = _bindings(params, name)
        except CompileError as e:
            bindings = e  # raised only if the kernel is instantiated
        functions[name] = (bindings, int(mt.group(1)) if mt else 0)
    kernels, templates = {}, {}
    for name, (bindings, mt) in functions.items():
        if isinstance(bindings, CompileError) and name not in templated:
            raise bindings
        if name not in templated:
            kernels[name] = Kernel(name, name, bindings, mt)
        elif not isinstance(bindings, CompileError):
            templates[name] = Kernel(name, name, bindings, mt)
    for m in _INSTANTIATION.finditer(text):
        host, func = m.group(1), m.group(2)
        lt = m.end() - 1
        args = text[lt: _balanced(text, lt, "<", ">")]
        if func not in functions:
            raise CompileError(f"host_name {host!r} instantiates {func}, which is not a kernel")
        bindings, mt = functions[func]
        if isinstance(bindings, CompileError):
            raise bindings
        kernels[host] = Kernel(host, func + args, bindings, mt)
    return kernels, templates


def _strip_attributes(text: str) -> str:
    names = "|".join(MSL_ATTRIBUTES + ("__emu_threadgroup",))
    return re.sub(r"\[\[\s*(?:" + names + r")\b[^\]]*(?:\][^\]][^\]]*)*\]\]", " ", text)


_TG_VAR = re.compile(
    r"(?<![\w])__emu_threadgroup\s+((?:const\s+|volatile\s+|typename\s+)*[A-Za-z_][\w:]*"
    r"(?:\s*<[^;{}()]*?>)?(?:::[A-Za-z_]\w*)*)"
    r"\s+([A-Za-z_]\w*)\s*((?:\[[^\];]*\]\s*)*);"
)
_TG_LEFT = re.compile(r"(?<![\w])__emu_threadgroup\b([^;,)=*&{]*)([;,)={])")


def _rewrite_threadgroup(text: str, typecheck: bool) -> str:
    """Threadgroup variables become one allocation per threadgroup."""
    counter = iter(range(1, 1 << 30))

    def repl(m: re.Match) -> str:
        before = text[max(0, m.start() - 12): m.start()]
        if re.search(r"typedef\s*$", before):
            return m.group(0)
        type_, name, dims = m.group(1), m.group(2), m.group(3).strip()
        if typecheck:
            return f"static __attribute__((address_space(3))) {type_} {name}{dims};"
        return f"auto& {name} = ::emu::threadgroup_var<{type_}{dims}, {next(counter)}>();"

    text = _TG_VAR.sub(repl, text)
    for m in _TG_LEFT.finditer(text):
        # Not a pointer or reference, and not rewritten above: a threadgroup
        # object that would silently become one copy per thread.
        line = text[: m.start()].count("\n") + 1
        raise CompileError(f"cannot rewrite the threadgroup declaration "
                           f"'threadgroup{m.group(1)}{m.group(2)}' (line {line} of the "
                           f"preprocessed source); declare it as `threadgroup T name[N];`")
    space = "__attribute__((address_space(3)))" if typecheck else ""
    text = re.sub(r"\b__emu_threadgroup\b", space, text)
    if typecheck:
        # `constant int64_t strides[2]` parameters: clang refuses an address
        # space on an array parameter, MSL means a pointer.
        text = _ARRAY_PARAM.sub(r"\1* \2", text)
    return text


# Struct copies between address spaces, and threadgroup variables of struct
# type, are legal MSL, but clang's C++ address spaces reject them (implicit
# special members work on the generic space only). The type-check build
# excuses exactly those diagnostics.
_STRUCT_COPY = re.compile(r"'this' object is in address space|cannot bind reference in address "
                          r"space|binding reference .*address space|cannot be used to construct "
                          r"an object in address space")


def address_space_errors(stderr: str) -> list[str]:
    """The errors of a type-check compile, without the excused struct copies."""
    blocks, cur = [], None
    for line in stderr.splitlines():
        if re.search(r": (error|warning|fatal error): ", line):
            cur = [line]
            blocks.append(cur)
        elif cur is not None:
            cur.append(line)
    out = []
    for b in blocks:
        if not re.search(r": (fatal )?error: ", b[0]):
            continue
        notes = [ln for ln in b if ": note: " in ln and "candidate" in ln]
        if notes and all(_STRUCT_COPY.search(n) or "requires" in n or "template ignored" in n
                         for n in notes) and any(_STRUCT_COPY.search(n) for n in notes):
            continue
        out.append("\n".join(b[:12]))
    return out


_ARRAY_PARAM = re.compile(
    r"(__attribute__\(\(address_space\(\d\)\)\)\s+(?:const\s+)?[A-Za-z_][\w:]*(?:\s+const)?)"
    r"\s+([A-Za-z_]\w*)\s*\[[^\]]*\]\s*(?=[,)])")


def _use_shadows(text: str) -> str:
    """In a source with MLX's headers inlined (sections `// ---- NAME` guarded
    by `#ifndef G` / `#define G` ... `#endif // G`), the sections of the
    headers that emu/shadow replaces become `#include "NAME"` again."""
    for path in sorted((EMU / "shadow").rglob("*.h")):
        name = re.escape(str(path.relative_to(EMU / "shadow")))
        text = re.sub(r"^// ---- " + name + r"\n#ifndef (\w+)\n#define \1\n.*?^#endif // \1$",
                      lambda m: f'#include "{path.relative_to(EMU / "shadow")}"', text,
                      flags=re.S | re.M)
    return text


def _entry_table(kernels: dict[str, Kernel]) -> str:
    lines = ["", "// Entry table generated by tests/metal/metal_emu.py", "namespace {"]
    rows = []
    for i, k in enumerate(kernels.values()):
        b = ", ".join(f'{{emu::Arg::{x.kind}, {x.index}, "{x.name}"}}' for x in k.bindings)
        lines.append(f"const emu::Binding emu_b{i}[] = {{{b}}};" if b else
                     f"const emu::Binding* emu_b{i} = nullptr;")
        lines.append(f"void emu_r{i}() {{ emu::invoke(&{k.function}, emu_b{i}, "
                     f"{len(k.bindings)}); }}")
        rows.append(f'{{"{k.name}", emu_r{i}, emu_b{i}, {len(k.bindings)}, {k.max_threads}}}')
    lines.append("}  // namespace")
    lines.append("extern const emu::Entry emu_entries[] = {" + ", ".join(rows) + "};")
    lines.append(f"extern const int emu_entry_count = {len(rows)};")
    return "\n".join(lines) + "\n"


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
                   Path(__file__).read_bytes())


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
        _run([cxx, *FLAGS, *MODE_FLAGS[mode], "-I", str(EMU / "include"), "-c",
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
            env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0")
            try:
                proc = subprocess.run([str(self.exe), str(tmp / "job")], capture_output=True,
                                      text=True, timeout=timeout, env=env)
            except subprocess.TimeoutExpired:
                raise EmulationError(f"the kernels did not finish within {timeout} s (a loop "
                                     f"that never ends, or a problem too large to emulate)")
            if proc.returncode != 0:
                raise EmulationError(_error_message(proc.stderr, proc.returncode))
            for bid, arr in arrays.items():
                arr[...] = np.frombuffer((tmp / f"out{bid}").read_bytes(),
                                         dtype=arr.dtype).reshape(arr.shape)


def _error_message(stderr: str, rc: int) -> str:
    for line in stderr.splitlines():
        if line.startswith("emu error:"):
            return line
    lines = stderr.splitlines()
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
    mode: "run", "asan" (AddressSanitizer, buffers allocated to their exact
    size) or "typecheck" (address spaces as clang address spaces; compile only).
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
    text = _use_shadows(text)
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
    body = _rewrite_threadgroup(_strip_attributes(pre), typecheck=mode == "typecheck")
    if mode == "typecheck":
        # Compile only: instantiating the explicit entries is enough.
        tail = "".join(f"\ntemplate decltype({e}) {e};" for e in entries) + "\n"
    else:
        tail = _entry_table(kernels)
    (work / "kernel.ii").write_text(body + tail)
    compile_flags = [cxx, "-x", "c++-cpp-output", *FLAGS, *mode_flags, str(work / "kernel.ii")]
    if mode == "typecheck":
        proc = subprocess.run(compile_flags, capture_output=True, text=True)
        errors = address_space_errors(proc.stderr)
        if errors or (proc.returncode != 0 and "error:" not in proc.stderr):
            raise CompileError("type-check compile failed:\n" + ("\n\n".join(errors)
                                                                 or proc.stderr[-6000:]))
    else:
        _run([*compile_flags, "-c", "-o", str(work / "kernel.o")], "compiling the kernel")
        san = ["-fsanitize=address,undefined"] if mode == "asan" else []
        _run([cxx, *san, str(work / "kernel.o"), str(_runtime_object(cxx, mode)), "-o",
              str(work / "kernel")], "linking")
    _save_kernels(work / "kernels.txt", kernels)
    (work / "done").write_text("")
    shutil.rmtree(out, ignore_errors=True)
    work.rename(out)
    return Program(exe, kernels, mode)


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


# --- Mutations --------------------------------------------------------------

def mutate(source: str, old: str, new: str, occurrence: int | None = None) -> str:
    """The source with `old` replaced by `new`: the one occurrence of `old`, or
    its `occurrence`-th (0-based) when it occurs several times. Raises when the
    text is not found, so that a mutation test cannot silently test nothing.
    """
    count = source.count(old)
    if count == 0:
        raise ValueError(f"mutation: {old!r} does not occur in the source")
    if occurrence is None:
        if count != 1:
            raise ValueError(f"mutation: {old!r} occurs {count} times; pass occurrence=")
        occurrence = 0
    if not 0 <= occurrence < count:
        raise ValueError(f"mutation: occurrence {occurrence} of {old!r} out of {count}")
    start = -1
    for _ in range(occurrence + 1):
        start = source.index(old, start + 1)
    return source[:start] + new + source[start + len(old):]
