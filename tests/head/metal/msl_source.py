"""Reading and rewriting preprocessed Metal source for the emulator: the
kernels and their parameter bindings, MSL attributes removed, threadgroup
variables shared per threadgroup, MLX's inlined headers swapped for the
emulator's shadows, the entry table, the type-check build's diagnostics, and
textual mutations of a source.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

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


class CompileError(RuntimeError):
    """clang rejected the kernel source (or the driver could not parse it)."""


@dataclass
class Binding:
    kind: str  # "buffer", "threadgroup" or a builtin name
    index: int  # buffer(n) / threadgroup(n); 0 for builtins
    name: str
    space: str = ""  # address space of a buffer, as the type-check build spells it


_SPACES = {"address_space(1)": "device", "address_space(2)": "constant",
           "__emu_threadgroup": "threadgroup"}


def _space(param: str) -> str:
    return next((v for k, v in _SPACES.items() if k in param), "")


@dataclass
class Kernel:
    name: str  # entry name for Dispatch: host_name, function name or "f<args>"
    function: str  # C++ expression naming the function (with template arguments)
    bindings: list[Binding]
    max_threads: int = 0



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
            return Binding("buffer", -1, re.findall(r"[A-Za-z_]\w*", param)[-1], _space(param))
        raise CompileError(f"kernel {kernel}: parameter '{param}' has no [[...]] attribute")
    attr, arg = m.group(1).replace("__emu_threadgroup", "threadgroup"), m.group(2)
    name = re.findall(r"[A-Za-z_]\w*", param[: m.start()])[-1]
    if attr in ("buffer", "threadgroup"):
        if arg is None or not arg.strip().isdigit():
            raise CompileError(f"kernel {kernel}: parameter '{name}' needs a literal index")
        return Binding(attr, int(arg), name, _space(param[: m.start()]))
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


def strip_attributes(text: str) -> str:
    names = "|".join(MSL_ATTRIBUTES + ("__emu_threadgroup",))
    return re.sub(r"\[\[\s*(?:" + names + r")\b[^\]]*(?:\][^\]][^\]]*)*\]\]", " ", text)


_TG_VAR = re.compile(
    r"(?<![\w])__emu_threadgroup\s+((?:const\s+|volatile\s+|typename\s+)*[A-Za-z_][\w:]*"
    r"(?:\s*<[^;{}()]*?>)?(?:::[A-Za-z_]\w*)*)"
    r"\s+([A-Za-z_]\w*)\s*((?:\[[^\];]*\]\s*)*);"
)
_TG_LEFT = re.compile(r"(?<![\w])__emu_threadgroup\b([^;,)=*&{]*)([;,)={])")


def rewrite_threadgroup(text: str, typecheck: bool) -> str:
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


def use_shadows(text: str, shadow: Path) -> str:
    """In a source with MLX's headers inlined (sections `// ---- NAME` guarded
    by `#ifndef G` / `#define G` ... `#endif // G`), the sections of the
    headers that emu/shadow replaces become `#include "NAME"` again."""
    for path in sorted(shadow.rglob("*.h")):
        name = re.escape(str(path.relative_to(shadow)))
        text = re.sub(r"^// ---- " + name + r"\n#ifndef (\w+)\n#define \1\n.*?^#endif // \1$",
                      lambda m: f'#include "{path.relative_to(shadow)}"', text,
                      flags=re.S | re.M)
    return text


def entry_table(kernels: dict[str, Kernel]) -> str:
    lines = ["", "// Entry table generated by tests/head/metal/metal_emu.py", "namespace {"]
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


def kernel_argument_errors(kernels) -> list[str]:
    """MSL's rules for kernel arguments that C++ does not check: a buffer is a
    pointer or reference in the device or constant space, a [[threadgroup(n)]]
    argument a pointer in the threadgroup space. Needs the type-check build's
    preprocessed text (where the spaces are still visible)."""
    errors = []
    for k in kernels:
        for b in k.bindings:
            if b.kind == "buffer" and b.space not in ("device", "constant"):
                errors.append(f"kernel {k.name}: buffer argument '{b.name}' must be in the "
                              f"device or constant address space")
            if b.kind == "threadgroup" and b.space != "threadgroup":
                errors.append(f"kernel {k.name}: [[threadgroup({b.index})]] argument "
                              f"'{b.name}' must be in the threadgroup address space")
    return errors
