#!/usr/bin/env bash
# macOS arm64 build check, no Mac needed: cross-compiles and links the
# extension module for aarch64-macos through the project's CMake build with
# zig (cmake/zig-aarch64-macos.cmake), against the headers and libmlx.dylib of
# MLX's macOS wheels (downloaded here, never committed), then checks the
# Mach-O file (.ci/macho_check.py). The module is compiled against this
# machine's Python headers: enough to type-check and link it (macOS Python
# modules leave the CPython API to the interpreter), not to ship it.
# Stub system headers in .ci/macos-stubs (if present) let Metal host code
# type-check without Apple's SDK.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$py" -m pip install -q --target "$tmp/tools" ziglang==0.17.1 nanobind==3.1.0
"$py" -m pip download -q --no-deps --only-binary=:all: --platform macosx_14_0_arm64 \
  --python-version 3.12 --implementation cp -d "$tmp/wheels" mlx==0.32.4 mlx-metal==0.32.4
for w in "$tmp"/wheels/*.whl; do
  "$py" -m zipfile -e "$w" "$tmp/site"
done

extra=()
if [ -d .ci/macos-stubs ]; then
  extra+=("-DFLASH_CCE_MACOS_STUBS=$root/.ci/macos-stubs")
fi
# MLX for the build is the macOS wheel's (found through `import mlx`); the
# module is named as CPython 3.12 on macOS names it.
if ! PYTHONPATH="$tmp/site:$tmp/tools" cmake -S . -B "$tmp/build" -G Ninja \
    --toolchain cmake/zig-aarch64-macos.cmake -DZIG_PYTHON="$(command -v "$py")" \
    -DPython_EXECUTABLE="$(command -v "$py")" -DSKBUILD_SOABI=cpython-312-darwin \
    -DFLASH_CCE_CUDA=OFF -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON "${extra[@]}" \
    >"$tmp/configure.log" 2>&1; then
  cat "$tmp/configure.log"
  exit 1
fi
PYTHONPATH="$tmp/site:$tmp/tools" cmake --build "$tmp/build" -j "$(nproc)" --target _ext
"$py" .ci/macho_check.py "$tmp"/build/_ext*.so "$tmp/site"
echo "macos compile: ok"
