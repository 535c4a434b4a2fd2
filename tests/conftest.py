"""Test device switch: FLASH_CCE_TEST_DEVICE=gpu runs the suite on MLX's GPU.

On the GPU, the head's CUDA kernels multiply bf16 (or fp16) operands. The
head's own tests (test_head*.py, test_gpu_head.py) account for that. The
other tests check the training layer against fp32 computations of the same
model; on the GPU they run the head's pure-MLX fallback (fp32), so that their
fp32-rounding tolerances keep their meaning. That is the default backend
(FLASH_CCE_BACKEND) for them and for the processes they start.
"""

import os

# Parallel workers (pytest-xdist) share the cores: each takes its share for the
# thread pools of numpy's BLAS and OpenMP, which otherwise start a thread a core
# in every worker and spin on each other. Set before numpy or MLX is imported.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, _threads)

# Set before MLX is imported: it reads the graph limits when it creates its GPU
# stream, at import (TF32 at the first matmul).
DEVICE = os.environ.get("FLASH_CCE_TEST_DEVICE", "cpu")
# MLX multiplies fp32 in TF32 on NVIDIA GPUs unless told otherwise; the suite's
# fp32 tolerances mean fp32, also in the GPU parity tests that run on a CPU
# default device (the processes the tests start inherit it).
os.environ.setdefault("MLX_ENABLE_TF32", "0")
if DEVICE == "gpu":
    # MLX's CUDA backend frees a kernel's inputs only once the CUDA graph that
    # holds the kernel has run, and on Hopper closes a graph after 100 kernels or
    # 1000 MB of arrays by default: the memory tests would measure that batching, not the
    # algorithms. 1 MB closes graphs about as often as the CPU backend frees.
    os.environ.setdefault("MLX_MAX_MB_PER_BUFFER", "1")
    # MLX caches the kernels it JIT-compiles on disk and writes an entry in
    # place: parallel workers (pytest-xdist, `-n N`) keep a cache each, so
    # that none reads another's half-written entry.
    _worker = os.environ.get("PYTEST_XDIST_WORKER")
    if _worker:
        import tempfile

        os.environ.setdefault(
            "MLX_PTX_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"mlx-ptx-{_worker}")
        )

import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402

if DEVICE not in ("cpu", "gpu"):
    raise ValueError(f"FLASH_CCE_TEST_DEVICE must be cpu or gpu, got {DEVICE!r}")
if DEVICE == "gpu":
    if not mx.is_available(mx.gpu):
        raise RuntimeError("FLASH_CCE_TEST_DEVICE=gpu but this MLX has no GPU")
    mx.set_default_device(mx.gpu)


# Modules that choose the head's backend themselves (the Metal gate's tests
# drive the "auto" backend with injected kernels).
HEAD_TESTS = ("test_head", "test_head_errors", "test_gpu_head", "test_metal_gate")


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(0)


# Module scope, so that module-scoped fixtures (which pytest sets up before any
# function-scoped one) and the processes they start get the fp32 head too.
@pytest.fixture(autouse=True, scope="module")
def _fp32_head_for_training_tests(request):
    if DEVICE == "gpu" and request.module.__name__.split(".")[-1] not in HEAD_TESTS:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FLASH_CCE_BACKEND", "fallback")
            yield
    else:
        yield


# On the GPU most of the suite's time is MLX compiling kernels at first use, and
# these modules hold its longest tests: run first, they are spread over the
# parallel workers (pytest-xdist) instead of ending the run on one of them.
GPU_SLOW_FIRST = ("test_compiled", "test_cli_runs", "test_objectives", "test_trainer", "test_reference",
                  "test_checkpoint", "test_attention", "test_controller")


# Before pytest-xdist reads the groups (`--dist loadgroup`).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    if DEVICE == "gpu":
        def rank(item):
            name = item.module.__name__.split(".")[-1]
            return GPU_SLOW_FIRST.index(name) if name in GPU_SLOW_FIRST else len(GPU_SLOW_FIRST)

        items.sort(key=rank)
        for item in items:
            group = _kernel_group(item)
            if group:
                item.add_marker(pytest.mark.xdist_group(group))


def _kernel_group(item):
    """The compiled layers' tests of one model compile the same kernels whatever
    the prefix layout: under `--dist loadgroup` one worker runs them, compiling
    once, instead of each worker compiling them again."""
    params = getattr(item, "callspec", None)
    if item.module.__name__.split(".")[-1] != "test_compiled" or params is None:
        return None
    arch = params.params.get("arch")
    quantized = params.params.get("quantize", item.originalname == "test_dequantized_layers")
    return f"compiled-{arch}-{'q' if quantized else 'dense'}" if arch else None


def pytest_addoption(parser):
    parser.addoption("--fuzz-examples", type=int, default=None,
                     help="examples per property-based fuzz test of the CLI (default: the test's own, "
                          "about 1100 in all)")
