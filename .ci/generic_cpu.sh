#!/usr/bin/env bash
# The CPU kernels' portable code on x86-64: builds the extension and the C++
# tests with FLASH_CCE_SIMD=OFF (no AVX2 code), checks that the portable GEMM
# kernel is the one in use, and runs the C++ tests and the head's pytest suite
# on that build. Runs in the active Python environment (the README install),
# whose flash_cce it replaces.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

cmake -S . -B "$tmp/cpp" -G Ninja -DFLASH_CCE_CUDA=OFF -DFLASH_CCE_BUILD_TESTS=ON \
  -DFLASH_CCE_SIMD=OFF -DPython_EXECUTABLE="$(command -v python)" >"$tmp/configure.log" ||
  { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/cpp" -j "$(nproc)" --target flash_cce_cpp_tests >"$tmp/build.log" ||
  { tail -40 "$tmp/build.log"; exit 1; }
"$tmp/cpp/tests/cpp/flash_cce_cpp_tests" | tail -2

pip install -q --no-deps --force-reinstall --config-settings=cmake.define.FLASH_CCE_SIMD=OFF .
(cd "$tmp" && python -c "from flash_cce import _ext; k = _ext.cpu_gemm_kernel(); print('GEMM kernel:', k); assert k == 'generic', k")
python -m pytest -q tests/head/test_head.py tests/head/test_head_errors.py
