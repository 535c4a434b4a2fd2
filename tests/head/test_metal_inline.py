"""The build-time include inliner for the Metal kernels (cmake/metal_inline.py).

Reference: the C preprocessor. Preprocessing the inlined source must give the
same tokens as preprocessing the original files with the include path, under
each set of macro definitions that switches the conditional includes.
"""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("metal_inline", ROOT / "cmake" / "metal_inline.py")
metal_inline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(metal_inline)

CXX = shutil.which("clang++") or shutil.which("g++")
SYSTEM_HEADERS = ("metal_stdlib", "metal_simdgroup", "metal_simdgroup_matrix",
                  "metal_math", "metal_logging", "metal_atomic", "metal_compute")


def _write(root, files):
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")


# A kernel tree with the cases the inliner must get right.
TREE = {
    "kern/main.metal": (
        "// Copyright \u00a9 the kernel\n"
        "#include <metal_stdlib>\n"
        '#include "local.h"\n'
        "#if defined(USE_EXTRA)\n"
        '#include "lib/extra.h"\n'
        "#endif\n"
        '#include "lib/extra.h"\n'
        '#include "lib/extra.h"\n'  # redundant after an unconditional one
        '#include "lib/plain.inc"\n'
        '#include "lib/plain.inc"\n'
        "/* a comment hiding an include:\n"
        '#include "missing.h"\n'
        "*/\n"
        'constant char url[] = "http://x//y"; // trailing \u00e9\n'
        "kernel void k() { int v = TWICE(ONCE_A) + PLAIN + EXTRA; }\n"
    ),
    "kern/local.h": (
        "#pragma once\n"
        '#include "lib/once.h"\n'
        "#define TWICE(x) (2 * (x))\n"
    ),
    "inc/lib/once.h": "#pragma once\n#define ONCE_A 3\nint once_a_defined_once;\n",
    "inc/lib/extra.h": (
        "#pragma once\n"
        '#include "once.h"\n'  # found beside extra.h, already inlined
        "#define EXTRA 5\n"
        "int extra_defined_once;\n"
    ),
    "inc/lib/plain.inc": "+ 1\n#undef PLAIN\n#define PLAIN 7\n",
}


def _inline(tmp_path, tree=TREE, root="kern/main.metal"):
    _write(tmp_path, tree)
    return metal_inline.inline_sources([str(tmp_path / root)], [str(tmp_path / "inc")])


def _preprocess(path, include_dirs, defines, tmp_path):
    sys_dir = tmp_path / "sys"
    sys_dir.mkdir(exist_ok=True)
    for h in SYSTEM_HEADERS:
        (sys_dir / h).write_text("")
    cmd = [CXX, "-E", "-P", "-x", "c++", "-std=c++17", "-isystem", str(sys_dir)]
    cmd += [f"-I{d}" for d in include_dirs] + [f"-D{d}" for d in defines] + [str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def test_no_quoted_includes_and_ascii(tmp_path):
    source, files = _inline(tmp_path)
    assert '#include "' not in source
    assert source.count("#include <metal_stdlib>") == 1
    assert source.isascii()
    assert "http://x//y" in source  # // inside a string literal is not a comment
    # Every file read is reported for the build's dependencies, the hidden one not.
    assert sorted(Path(f).name for f in files) == [
        "extra.h", "local.h", "main.metal", "once.h", "plain.inc"]
    # A header without #pragma once is inlined at each include, as cpp does.
    assert source.count("#define PLAIN 7") == 2
    # A #pragma once header's body appears once per conditional site plus once.
    assert source.count("int once_a_defined_once;") == 1
    assert source.count("int extra_defined_once;") == 2


@pytest.mark.skipif(CXX is None, reason="needs a C++ preprocessor (clang++ or g++)")
@pytest.mark.parametrize("defines", [(), ("USE_EXTRA",)])
def test_same_tokens_as_the_preprocessor(tmp_path, defines):
    source, _ = _inline(tmp_path)
    inlined = tmp_path / "inlined.metal"
    inlined.write_text(source)
    want = _preprocess(tmp_path / "kern/main.metal", [tmp_path / "inc"], defines, tmp_path)
    got = _preprocess(inlined, [], defines, tmp_path)
    assert got == want
    assert sum("once_a_defined_once" in line for line in got) == 1


def test_deterministic_and_free_of_absolute_paths(tmp_path):
    a, _ = _inline(tmp_path / "one")
    b, _ = _inline(tmp_path / "two" / "deeper")
    assert a == b
    assert str(tmp_path) not in a
    assert "// ---- lib/once.h" in a


def test_errors_name_the_file(tmp_path):
    tree = dict(TREE, **{"kern/local.h": '#include "nowhere.h"\n'})
    with pytest.raises(metal_inline.InlineError, match=r'local\.h: cannot find "nowhere\.h"'):
        _inline(tmp_path, tree)
    cyclic = {"kern/main.metal": '#include "a.h"\n', "kern/a.h": '#include "main.metal"\n'}
    with pytest.raises(metal_inline.InlineError, match="include cycle"):
        _inline(tmp_path / "c", cyclic)


def test_command_line_writes_outputs_and_fails_cleanly(tmp_path, capsys):
    _write(tmp_path, TREE)
    out, hdr, dep = tmp_path / "o.metal", tmp_path / "o.h", tmp_path / "o.d"
    args = ["-I", str(tmp_path / "inc"), "-o", str(out), "--cpp", str(hdr),
            "--depfile", str(dep), str(tmp_path / "kern/main.metal")]
    assert metal_inline.main(args) == 0
    assert "inline constexpr const char flash_cce_metal_source[]" in hdr.read_text()
    rule = dep.read_text().splitlines()
    assert rule[0] == f"{out} {hdr}: \\" and len(rule) == 6
    assert rule[-1].strip().endswith("plain.inc")
    assert metal_inline.main(["-o", str(out), str(tmp_path / "nope.metal")]) == 1
    assert "nope.metal" in capsys.readouterr().err


@pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")
def test_cpp_header_holds_the_exact_source(tmp_path):
    # Long enough to be cut into several raw-string pieces, and holding the
    # default delimiter so that the header must pick another.
    source = "".join(f"constant int v{i} = {i}; // )fcce\"\n" for i in range(3000))
    (tmp_path / "src.h").write_text(metal_inline.cpp_header(source, "the_source"))
    (tmp_path / "main.cpp").write_text(
        '#include "src.h"\n#include <cstdio>\nint main() { std::fputs(the_source, stdout); }\n')
    exe = tmp_path / "main"
    subprocess.run([CXX, "-std=c++17", str(tmp_path / "main.cpp"), "-o", str(exe)], check=True)
    assert subprocess.run([str(exe)], capture_output=True, text=True).stdout == source


def _mlx_metal_include():
    """MLX's Metal kernel headers: the installed wheel's (macOS) or a macOS
    wheel unpacked for the emulation tests."""
    import mlx

    for base in list(mlx.__path__):
        inc = Path(base) / "include"
        if (inc / "mlx/backend/metal/kernels/steel/gemm/mma.h").exists():
            return inc
    return None


@pytest.mark.skipif(CXX is None, reason="needs a C++ preprocessor")
def test_project_kernels_inline_like_the_preprocessor(tmp_path):
    sources = sorted((ROOT / "metal").glob("*.metal"))
    inc = _mlx_metal_include()
    if not sources or inc is None:
        pytest.skip("needs metal/*.metal and MLX's Metal headers (macOS wheel)")
    source, _ = metal_inline.inline_sources([str(s) for s in sources], [str(inc)])
    assert '#include "' not in source and source.isascii()
    inlined = tmp_path / "inlined.metal"
    inlined.write_text(source)
    # The sources form one translation unit, as if one file included them all.
    unit = tmp_path / "unit.metal"
    unit.write_text("".join(f'#include "{s}"\n' for s in sources))
    for defines in [(), ("__METAL_VERSION__=310", "__HAVE_BFLOAT__")]:
        want = _preprocess(unit, [inc], defines, tmp_path)
        assert _preprocess(inlined, [], defines, tmp_path) == want


def test_inlined_source_is_what_the_emulation_compiles(tmp_path):
    """The shipped source, inlined with the emulation's shadow headers in front
    (tests/head/metal/emu/shadow replaces four MLX headers that do not compile as
    C++), preprocesses exactly as the emulation preprocesses metal/*.metal: the
    kernels Metal compiles are the ones the emulation tests ran."""
    sys.path.insert(0, str(ROOT / "tests" / "head" / "metal"))
    try:
        import metal_emu
    finally:
        sys.path.pop(0)
    cxx = metal_emu.find_compiler()
    sources = sorted((ROOT / "metal").glob("*.metal"))
    inc = _mlx_metal_include()
    if cxx is None or not sources or inc is None:
        pytest.skip("needs clang++, metal/*.metal and MLX's Metal headers")
    shadow = metal_emu.EMU / "shadow"
    source, _ = metal_inline.inline_sources([str(s) for s in sources], [str(shadow), str(inc)])
    inlined = tmp_path / "inlined.metal"
    inlined.write_text(source)
    unit = tmp_path / "unit.metal"
    unit.write_text("".join(f'#include "{s}"\n' for s in sources))

    def emu_preprocess(path, include_dirs):
        cmd = [cxx, "-E", "-P", "-x", "c++", *metal_emu.FLAGS, "-I", str(shadow),
               "-I", str(metal_emu.EMU / "include"), *[f"-I{d}" for d in include_dirs], str(path)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    want = emu_preprocess(unit, [inc])
    assert emu_preprocess(inlined, []) == want
    assert any("fcce_fwd_hbf16_q4" in line for line in want)
