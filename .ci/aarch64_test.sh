#!/usr/bin/env bash
# Linux aarch64 CPU path, executed on x86-64: cross-compiles the CPU kernels
# and their C++ tests with Debian's g++-aarch64-linux-gnu against libmlx.so of
# MLX's aarch64 CPU wheel (downloaded here) and runs the tests under
# qemu-user, once with the NEON GEMM kernel and once with the portable code
# only (FLASH_CCE_SIMD=OFF). Needs the Debian packages g++-aarch64-linux-gnu
# and qemu-user.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$py" -m pip install -q --target "$tmp/tools" nanobind==3.1.0
"$py" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_35_aarch64 \
  --python-version 3.12 --implementation cp -d "$tmp/wheels" mlx==0.32.4 mlx-cpu==0.32.4
for w in "$tmp"/wheels/*.whl; do
  "$py" -m zipfile -e "$w" "$tmp/site"
done

# CMake's project needs Python headers to configure; the tests do not use them.
pyinc=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['include'])")

for simd in ON OFF; do
  build="$tmp/build-$simd"
  if ! PYTHONPATH="$tmp/site:$tmp/tools" cmake -S . -B "$build" -G Ninja \
      --toolchain cmake/aarch64-linux-gnu.cmake -DPython_EXECUTABLE="$(command -v "$py")" \
      -DPython_INCLUDE_DIR="$pyinc" \
      -DFLASH_CCE_CUDA=OFF -DFLASH_CCE_BUILD_TESTS=ON -DFLASH_CCE_SIMD=$simd \
      -DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON \
      >"$tmp/configure.log" 2>&1; then
    cat "$tmp/configure.log"
    exit 1
  fi
  cmake --build "$build" -j "$(nproc)" --target flash_cce_cpp_tests
  file "$build/tests/cpp/flash_cce_cpp_tests" | grep -q "ARM aarch64"
  # The GEMM kernel the tests exercise: NEON unless the SIMD code is off.
  want=$([ $simd = ON ] && echo neon || echo generic)
  grep -q "kernel_$want" < <(aarch64-linux-gnu-nm -C "$build/tests/cpp/flash_cce_cpp_tests") ||
    { echo "no kernel_$want in the SIMD=$simd build"; exit 1; }
  echo "aarch64 C++ tests, SIMD=$simd (GEMM kernel: $want), under qemu:"
  qemu-aarch64 -L /usr/aarch64-linux-gnu "$build/tests/cpp/flash_cce_cpp_tests" | tail -3
done
echo "aarch64 tests: ok"
