"""Builds and runs the C++ kernel tests so that one pytest runs everything.

Needs CMake and a C++ compiler. The tests build against GoogleTest where CMake
finds it (Debian: libgtest-dev), else against the project's own gtest-compatible
header and runner (tests/cpp/minitest); both print the summary lines read here.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "cpp-tests"


def _run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def binary():
    _run([
        "cmake", "-S", ROOT, "-B", BUILD, "-DFLASH_CCE_BUILD_TESTS=ON",
        "-DFLASH_CCE_CUDA=OFF", f"-DPython_EXECUTABLE={sys.executable}",
        "-DCMAKE_BUILD_TYPE=Release",
    ])
    _run(["cmake", "--build", BUILD, "--target", "flash_cce_cpp_tests", "-j", "2"])
    return BUILD / "tests" / "cpp" / "flash_cce_cpp_tests"


def test_cpp_kernels(binary):
    out = _run([binary])
    ran = re.search(r"\[==========\] (\d+) tests? from .* ran", out)
    passed = re.search(r"\[  PASSED  \] (\d+) tests?", out)
    assert ran and passed and int(ran.group(1)) == int(passed.group(1)) > 0, out
