"""Test device switch: FLASH_CCE_TEST_DEVICE=gpu runs the suite on MLX's GPU."""

import os

import mlx.core as mx
import pytest

DEVICE = os.environ.get("FLASH_CCE_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "gpu"):
    raise ValueError(f"FLASH_CCE_TEST_DEVICE must be cpu or gpu, got {DEVICE!r}")
if DEVICE == "gpu":
    if not mx.is_available(mx.gpu):
        raise RuntimeError("FLASH_CCE_TEST_DEVICE=gpu but this MLX has no GPU")
    mx.set_default_device(mx.gpu)


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(0)
