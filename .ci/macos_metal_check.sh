#!/usr/bin/env bash
# Compile-and-link check of the Metal host code for macOS arm64, run on Linux:
# zig's clang (PyPI ziglang) against the headers of MLX's macOS wheels, which
# are downloaded here and never committed. The head's C++ sources (CPU and
# Metal, FLASH_CCE_METAL on) become one dylib linked against the wheel's
# libmlx.dylib; an unresolved symbol fails the link. .ci/macos-stubs stands
# in for the two SDK headers metal-cpp includes and for libobjc.
#   bash .ci/macos_metal_check.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORK=${1:-${TMPDIR:-/tmp}/flash-cce-macos-metal}
MLX_VERSION=$("$PY" -c "import importlib.metadata as m; print(m.version('mlx'))" 2>/dev/null || echo 0.32.4)

mkdir -p "$WORK/wheels" "$WORK/gen" "$WORK/obj"
if [ ! -f "$WORK/mac/mlx/lib/libmlx.dylib" ]; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: --platform macosx_14_0_arm64 \
    --python-version 3.12 --implementation cp -d "$WORK/wheels" \
    "mlx==$MLX_VERSION" "mlx-metal==$MLX_VERSION"
  for whl in "$WORK"/wheels/*.whl; do
    "$PY" -m zipfile -e "$whl" "$WORK/mac"
  done
fi
"$PY" -c "import ziglang" 2>/dev/null || "$PY" -m pip install -q ziglang

MAC="$WORK/mac/mlx"
"$PY" cmake/metal_inline.py -I "$MAC/include" --cpp "$WORK/gen/flash_cce_metal_source.h" \
  metal/*.metal
CXX=("$PY" -m ziglang c++ -target aarch64-macos.14.0 -std=c++20 -O1 -Wall
     -D_METAL_ -DFLASH_CCE_METAL -Icsrc -I"$MAC/include" -I"$MAC/include/metal_cpp"
     -I"$WORK/gen" -isystem .ci/macos-stubs)
objs=()
for src in csrc/flash_cce.cpp csrc/tuning.cpp csrc/metal/*.cpp csrc/cpu/*.cpp; do
  obj="$WORK/obj/$(basename "$src" .cpp).o"
  "${CXX[@]}" -c "$src" -o "$obj"
  objs+=("$obj")
done
"$PY" -m ziglang c++ -target aarch64-macos.14.0 -shared -o "$WORK/libflash_cce_core.dylib" \
  "${objs[@]}" "$MAC/lib/libmlx.dylib" -L.ci/macos-stubs -lobjc
echo "macOS arm64 Metal host code: compiled and linked ($WORK/libflash_cce_core.dylib)"
