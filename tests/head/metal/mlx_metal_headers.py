"""MLX's Metal kernel headers (steel, quantized.h, ...) for the emulation tests.

They ship only in the macOS wheels (`mlx-metal`), which pip downloads on any
platform. They are unpacked once into build/mlx-metal-wheel/ and used by
`#include`, never copied into the repository.
"""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

MLX_VERSION = "0.32.4"
ROOT = Path(__file__).resolve().parents[3]
CACHE = ROOT / "build" / "mlx-metal-wheel"


class HeadersUnavailable(RuntimeError):
    """The macOS wheels could not be downloaded (no network or no PyPI)."""


def include_dir(cache: Path = CACHE, version: str = MLX_VERSION) -> Path:
    """The `mlx/include` directory of the macOS wheels, downloading them if needed.

    Kernel sources include MLX's headers as
    `#include "mlx/backend/metal/kernels/steel/gemm/mma.h"` relative to it.
    """
    unpacked = cache / f"mlx-{version}"
    inc = unpacked / "mlx" / "include"
    marker = inc / "mlx" / "backend" / "metal" / "kernels" / "steel" / "gemm" / "mma.h"
    if marker.is_file():
        return inc
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--only-binary=:all:", "--platform", "macosx_14_0_arm64",
        "--python-version", "3.12", "--implementation", "cp",
        f"mlx=={version}", f"mlx-metal=={version}", "-d", str(cache),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(cache.glob(f"mlx*-{version}-*macosx*.whl"))
    if proc.returncode != 0 or len(wheels) < 2:
        raise HeadersUnavailable(
            f"cannot download the macOS wheels mlx=={version} and mlx-metal=={version} "
            f"with pip (exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
        )
    tmp = cache / f"mlx-{version}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp)
    tmp.rename(unpacked)
    if not marker.is_file():
        raise HeadersUnavailable(f"the wheels in {cache} hold no steel/gemm/mma.h")
    return inc
