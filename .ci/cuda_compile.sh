#!/usr/bin/env bash
# Compile-only CUDA job (no GPU needed): builds the CUDA host code and the
# kernel fatbin against MLX's CUDA wheel, installed with --no-deps into a
# temporary directory for its headers and libmlx.so; nvcc comes from the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip install -q --no-deps --target "$tmp/site" mlx==0.32.4 mlx-cuda-13==0.32.4
PYTHONPATH="$tmp/site" cmake -S . -B "$tmp/build" -G Ninja -DFLASH_CCE_CUDA=ON \
  -DPython_EXECUTABLE="$(command -v python3)" \
  -DFLASH_CCE_CUDA_ARCHS="${FLASH_CCE_CUDA_ARCHS:-90a;80}" >"$tmp/configure.log" ||
  { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/build" -j "$(nproc)"
test -s "$tmp/build/csrc/cuda/flash_cce_kernels.fatbin"
echo "cuda compile: ok"
