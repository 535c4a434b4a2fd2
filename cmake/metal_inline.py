"""Inline the quoted #includes of Metal sources into one self-contained source.

Metal compiles a source string at run time without a file system, so the head's
kernels (metal/*.metal) and the MLX headers they include by name are joined at
build time into one translation unit. Angle-bracket includes (<metal_stdlib>)
stay: the Metal compiler provides them.

    python metal_inline.py -I <mlx include dir> -o head.metal [--cpp head_src.h]
                           metal/a.metal metal/b.metal

Semantics follow the C preprocessor where it matters:
- a quoted name is looked up beside the including file, then in each -I dir;
- a file with `#pragma once` is inlined once: the pragma becomes an include
  guard, so a copy inlined inside an `#if` is still correct if the condition is
  false, and the first copy at unconditional nesting makes later ones redundant;
- a file without it is inlined at every include, as the preprocessor would.
Comments are removed (MLX's headers carry non-ASCII characters and MLX hands
the source to Metal as ASCII) and the output names no absolute path, so the
same inputs give the same bytes on every machine.
"""

import argparse
import hashlib
import os
import re
import sys

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"\s*$')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$")
_IF_OPEN = re.compile(r"^\s*#\s*if(n?def)?\b")
_IF_CLOSE = re.compile(r"^\s*#\s*endif\b")


class InlineError(Exception):
    """A quoted include that cannot be resolved, or a malformed input."""


def strip_comments(text):
    """Removes // and /* */ comments outside string and character literals.

    A block comment becomes one space (or its newlines, to keep line structure);
    a line comment ends before its newline. Backslash-newline continues a line
    comment, as in C.
    """
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                if text[j] == "\\":
                    j += 1
                elif text[j] == "\n":
                    break  # an apostrophe in a stray place; not a literal
                j += 1
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = i
            while j < n and text[j] != "\n":
                j += 2 if text.startswith("\\\n", j) else 1
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise InlineError("unterminated /* comment")
            body = text[i:j + 2]
            out.append("\n" * body.count("\n") if "\n" in body else " ")
            i = j + 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _rel_name(path, roots):
    """The shortest name of `path` relative to one of `roots` (no absolute paths)."""
    names = [os.path.relpath(path, r) for r in roots]
    names = [s for s in names if not s.startswith("..")]
    return min(names, key=len) if names else os.path.basename(path)


class Inliner:
    def __init__(self, include_dirs, source_roots):
        self.include_dirs = [os.path.abspath(d) for d in include_dirs]
        self.roots = self.include_dirs + [os.path.abspath(d) for d in source_roots]
        self.done = set()  # `#pragma once` files inlined at unconditional nesting
        self.files = []  # every file read, for the build's dependency list

    def resolve(self, name, including_dir, including_name):
        for d in [including_dir] + self.include_dirs:
            path = os.path.join(d, name)
            if os.path.isfile(path):
                return os.path.realpath(path)
        raise InlineError(
            f'{including_name}: cannot find "{name}" beside it or in the include '
            f"directories {self.include_dirs}"
        )

    def inline(self, path, depth=0, stack=()):
        """Source of `path` with its quoted includes inlined; `depth` counts
        the #if blocks that enclose the include site."""
        path = os.path.realpath(path)
        name = _rel_name(path, self.roots)
        if path in stack:
            raise InlineError(f"include cycle: {' -> '.join(stack)} -> {path}")
        with open(path, encoding="utf-8") as f:
            text = strip_comments(f.read())
        if path not in self.files:
            self.files.append(path)
        lines = text.split("\n")
        once = any(_PRAGMA_ONCE.match(line) for line in lines)
        if once and path in self.done:
            return ""
        if once and depth == 0:
            self.done.add(path)
        out = [f"// ---- {name}"]
        guard = None
        if once:
            guard = "FLASH_CCE_INLINED_" + hashlib.sha1(name.encode()).hexdigest()[:12]
            out += [f"#ifndef {guard}", f"#define {guard}"]
        nesting = 0
        for line in lines:
            if _PRAGMA_ONCE.match(line):
                continue
            m = _INCLUDE.match(line)
            if m:
                child = self.resolve(m.group(1), os.path.dirname(path), name)
                out.append(self.inline(child, depth + nesting, stack + (path,)))
                continue
            if _IF_OPEN.match(line):
                nesting += 1
            elif _IF_CLOSE.match(line):
                nesting -= 1
            out.append(line.rstrip())
        if guard:
            out.append(f"#endif // {guard}")
        return "\n".join(out)


def _squeeze_blank_lines(text):
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n") + "\n"


def inline_sources(sources, include_dirs):
    """(source, files read): one self-contained source from `sources` in order."""
    inl = Inliner(include_dirs, [os.path.dirname(os.path.abspath(s)) for s in sources])
    parts = [inl.inline(s) for s in sources]
    text = _squeeze_blank_lines("\n".join(parts))
    bad = [(i + 1, line) for i, line in enumerate(text.split("\n")) if not line.isascii()]
    if bad:
        line_no, line = bad[0]
        raise InlineError(f"non-ASCII character outside comments at line {line_no}: {line!r}")
    return text, inl.files


def cpp_header(source, symbol):
    """A C++ header defining `inline constexpr const char symbol[]` = source.

    Raw string pieces of at most ~16 KB (compilers bound one literal's length),
    cut at line ends, with a delimiter the source does not contain.
    """
    delim = "fcce"
    while f"){delim}\"" in source:
        delim += "_"
    pieces, cur, size = [], [], 0
    for line in source.splitlines(keepends=True):
        if size + len(line) > 16000 and cur:
            pieces.append("".join(cur))
            cur, size = [], 0
        cur.append(line)
        size += len(line)
    pieces.append("".join(cur))
    body = "\n".join(f'R"{delim}({p}){delim}"' for p in pieces)
    return (
        "// Generated by cmake/metal_inline.py from metal/*.metal; do not edit.\n"
        "#pragma once\n\n"
        f"inline constexpr const char {symbol}[] =\n{body};\n"
    )


def _write_if_changed(path, text):
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+", help=".metal files, in order")
    ap.add_argument("-I", dest="include_dirs", action="append", default=[],
                    help="directory to search for quoted includes")
    ap.add_argument("-o", "--output", help="write the inlined Metal source here")
    ap.add_argument("--cpp", help="write a C++ header embedding the source here")
    ap.add_argument("--symbol", default="flash_cce_metal_source",
                    help="name of the C++ string (with --cpp)")
    ap.add_argument("--depfile", help="write a Makefile rule: the outputs depend on the files read")
    args = ap.parse_args(argv)
    if not (args.output or args.cpp):
        ap.error("give -o and/or --cpp")
    try:
        source, files = inline_sources(args.sources, args.include_dirs)
    except (InlineError, OSError) as err:
        print(f"metal_inline: {err}", file=sys.stderr)
        return 1
    if args.output:
        _write_if_changed(args.output, source)
    if args.cpp:
        _write_if_changed(args.cpp, cpp_header(source, args.symbol))
    if args.depfile:
        esc = lambda path: path.replace("\\", "/").replace(" ", "\\ ")  # noqa: E731
        targets = " ".join(esc(os.path.abspath(t)) for t in (args.output, args.cpp) if t)
        deps = "".join(f" \\\n  {esc(f)}" for f in files)
        _write_if_changed(args.depfile, f"{targets}:{deps}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
