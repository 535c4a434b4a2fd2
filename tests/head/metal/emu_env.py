"""What the emulation tests need: clang++ and MLX's Metal headers.

Tests skip, with the reason, only when clang++ is missing or the macOS wheels
cannot be downloaded (CI has both: see .ci/run).
"""

import functools

import pytest

import metal_emu
import mlx_metal_headers


@functools.lru_cache(maxsize=None)
def _include():
    try:
        return mlx_metal_headers.include_dir(), None
    except mlx_metal_headers.HeadersUnavailable as e:
        return None, str(e)


def mlx_include():
    """The mlx-metal wheel's include directory, or a skip naming the reason."""
    if metal_emu.find_compiler() is None:
        pytest.skip("no clang++ on PATH (apt-get install clang)")
    inc, why = _include()
    if inc is None:
        pytest.skip(why)
    return inc


def build(source, mode="run", **kw):
    """metal_emu.build with MLX's headers on the include path."""
    return metal_emu.build(source, include_dirs=[mlx_include(), *kw.pop("include_dirs", ())],
                           mode=mode, **kw)
