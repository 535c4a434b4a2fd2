"""Builds and runs the C++ kernel tests (GoogleTest) so that one pytest runs everything.

Needs CMake and GoogleTest (Debian: libgtest-dev). Set FLASH_CCE_SKIP_CPP_TESTS=1
to skip them where GoogleTest is not installed.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "cpp-tests"

pytestmark = pytest.mark.skipif(
    os.environ.get("FLASH_CCE_SKIP_CPP_TESTS") == "1", reason="FLASH_CCE_SKIP_CPP_TESTS=1"
)


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
