#!/usr/bin/env bash
# Install paths: builds an sdist and, from it, a wheel (python -m build), then
# installs the sdist into a fresh virtual environment and runs .ci/smoke.py
# from outside the source tree, which fails on files missing from the sdist.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$py" -m venv "$tmp/build-env"
"$tmp/build-env/bin/python" -m pip install -q build
"$tmp/build-env/bin/python" -m build --outdir "$tmp/dist" . >"$tmp/build.log" 2>&1 ||
  { tail -40 "$tmp/build.log"; exit 1; }
sdist=$(ls "$tmp"/dist/*.tar.gz)
wheel=$(ls "$tmp"/dist/*.whl)
echo "built $(basename "$sdist") and $(basename "$wheel")"
"$py" -c "import sys, zipfile; names = zipfile.ZipFile(sys.argv[1]).namelist()
assert any(n.startswith('flash_cce/_ext') for n in names), 'the wheel has no flash_cce/_ext'" "$wheel"

"$py" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --upgrade pip
"$tmp/venv/bin/python" -m pip install -q "${sdist}[cpu,train]"
cd "$tmp"
"$tmp/venv/bin/python" "$root/.ci/smoke.py"
