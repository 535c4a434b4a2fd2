#!/usr/bin/env bash
# Builds the extension with its CUDA kernels against the MLX found on
# PYTHONPATH, then runs the requested stages on the GPU:
#   test      GPU-vs-CPU parity tests (tests/head/test_gpu_*.py)
#   select K  the parity tests whose names match pytest's -k expression K
#   ptx F     the parity tests with the kernels of fatbin F (e.g. one holding
#             only PTX), the loaded image and its kernels in the log
#   suite     the whole pytest suite with FLASH_CCE_TEST_DEVICE=gpu, in
#             FLASH_CCE_SUITE_WORKERS parallel processes (pytest-xdist; default 15),
#             each test's result streamed to $OUT/suite_times.txt and
#             suite_failures.txt (bench/suite_log.py); the kernels MLX compiled at
#             run time go to $OUT/mlx-ptx-cache.tar.xz, and FLASH_CCE_PTX_SEED
#             (such an archive from an earlier run) fills the workers' caches first
#   sanitize  compute-sanitizer memcheck and racecheck on a small shape
#   bench ARGS...  bench/bench_head.py ARGS (must come last)
#   grpo ARGS...   bench/bench_grpo.py ARGS (must come last): the rollouts
#             (flash_cce, mlx-lm) in one process, then each update provider
#             (flash_cce, mlx-lm-lora, trl, and trl-liger when FLASH_CCE_GRPO_LIGER=1)
#             in a process of its own, each under FLASH_CCE_GRPO_TIMEOUT s (default
#             100) and writing $OUT/grpo_<part>.json: a peer that hangs or fails
#             loses only its own rows
# Logs and results go to $OUT (default runs/gpu). FLASH_CCE_PREBUILT_FATBIN
# skips nvcc with a fatbin built elsewhere from the same sources;
# FLASH_CCE_WHEELS names a folder of wheels (e.g. the torch peers of bench_head.py) to put
# on PYTHONPATH first, for machines without a package index.
set -uo pipefail
out=${OUT:-runs/gpu}
mkdir -p "$out"
if [ -n "${FLASH_CCE_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/flash-cce-wheels \
    "$FLASH_CCE_WHEELS"/*.whl >"$out/wheels.log" 2>&1 || { cat "$out/wheels.log"; exit 1; }
  export PYTHONPATH="/tmp/flash-cce-wheels${PYTHONPATH:+:$PYTHONPATH}"
fi
extra=()
if [ -n "${FLASH_CCE_PREBUILT_FATBIN:-}" ]; then
  extra+=("-DFLASH_CCE_PREBUILT_FATBIN=$FLASH_CCE_PREBUILT_FATBIN")
fi
build_start=$SECONDS
if ! { cmake -S . -B build/gpu -G Ninja -DFLASH_CCE_CUDA=ON \
        -DPython_EXECUTABLE="$(command -v python3)" -DCMAKE_BUILD_TYPE=${FLASH_CCE_BUILD_TYPE:-Release} "${extra[@]}" &&
      cmake --build build/gpu -j; } >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi
echo "build: $((SECONDS - build_start)) s"
cp build/gpu/_ext*.so build/gpu/csrc/cuda/flash_cce_kernels.fatbin python/flash_cce/
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv >"$out/gpu.txt" 2>&1

status=0
while [ $# -gt 0 ]; do
  stage=$1
  shift
  case $stage in
    test)
      # 300 s: the row tests compare with MLX's gather, whose kernels MLX compiles at run time.
      timeout 300 python3 -m pytest -q tests/head/test_gpu_*.py 2>&1 | tee "$out/test_gpu.log" | tail -15 || status=1 ;;
    select)
      timeout ${FLASH_CCE_TEST_TIMEOUT:-300} python3 -m pytest -q -x tests/head/test_gpu_*.py -k "$1" 2>&1 |
        tee "$out/select_gpu.log" | tail -15 || status=1
      shift ;;
    ptx)
      FLASH_CCE_FATBIN="$(realpath "$1")" timeout 300 python3 -m pytest -q -rA tests/head/test_gpu_*.py 2>&1 |
        tee "$out/ptx_gpu.log" | grep -E "flash_cce CUDA kernels|passed|failed|error" | tail -5 || status=1
      shift ;;
    suite)
      start=$SECONDS
      # Tests that compile the same kernels run on one worker (tests/conftest.py
      # marks their groups), the others go one at a time to the free workers.
      # A test that hangs fails after FLASH_CCE_PER_TEST_TIMEOUT s with its stack
      # (pytest-timeout, where installed) instead of holding its worker's queue.
      opts=(--dist loadgroup)
      help=$(python3 -m pytest --help 2>/dev/null)
      if grep -q -- "--timeout=" <<<"$help"; then
        opts+=(--timeout "${FLASH_CCE_PER_TEST_TIMEOUT:-240}")
      fi
      # Each worker keeps its own cache of the kernels MLX compiles at run time
      # (tests/conftest.py: MLX writes an entry in place, so workers must not
      # share one while they run); filled from FLASH_CCE_PTX_SEED where given.
      workers=${FLASH_CCE_SUITE_WORKERS:-15}
      tmp=$(python3 -c "import tempfile; print(tempfile.gettempdir())")
      caches=()
      for ((i = 0; i < workers; i++)); do
        caches+=("$tmp/mlx-ptx-gw$i")
      done
      if [ -n "${FLASH_CCE_PTX_SEED:-}" ]; then
        python3 bench/ptx_cache.py seed "$FLASH_CCE_PTX_SEED" "${caches[@]}"
      fi
      # One BLAS / OpenMP thread per worker: the workers share the cores.
      FLASH_CCE_TEST_DEVICE=gpu SUITE_LOG_DIR="$out" PYTHONPATH="$PWD/bench:$PYTHONPATH" \
        OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 \
        timeout ${FLASH_CCE_SUITE_TIMEOUT:-470} python3 -m pytest -q -rfE -p suite_log -p suite_schedule \
        -n "$workers" "${opts[@]}" --durations=25 tests 2>&1 |
        grep -v -e PytestBenchmarkWarning -e 'warner(' | tee "$out/suite_gpu.log" | tail -45 || status=1
      echo "suite: $((SECONDS - start)) s"
      python3 bench/ptx_cache.py merge "$out/mlx-ptx-cache.tar.xz" "${caches[@]}" ;;
    sanitize)
      for tool in memcheck racecheck; do
        timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 9 python3 bench/sanitize_head.py \
          >"$out/sanitize_$tool.log" 2>&1
        echo "compute-sanitizer $tool: exit $? ($(grep -c 'ERROR SUMMARY' "$out/sanitize_$tool.log") summaries)"
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$out/sanitize_$tool.log" | tail -3
      done ;;
    bench)
      python3 bench/bench_head.py --json "$out/bench_head.json" "$@" 2>&1 | tee "$out/bench.log" | tail -80
      break ;;
    grpo)
      limit=${FLASH_CCE_GRPO_TIMEOUT:-100}
      parts=("rollout flash_cce mlx-lm" "update flash_cce" "update trl" "update mlx-lm-lora")
      if [ "${FLASH_CCE_GRPO_LIGER:-0}" = 1 ]; then
        parts+=("update trl-liger")
      fi
      for part in "${parts[@]}"; do
        read -r phase providers <<<"$part"
        name="${phase}_${providers// /_}"
        start=$SECONDS
        timeout -k 10 "$limit" python3 bench/bench_grpo.py --phases "$phase" --providers $providers \
          --json "$out/grpo_$name.json" "$@" >"$out/grpo_$name.log" 2>&1
        echo "grpo $name: exit $? in $((SECONDS - start)) s"
        grep -E '^\{|^trl|rror' "$out/grpo_$name.log" | tail -6
      done
      break ;;
    *)
      echo "unknown stage $stage" >&2
      exit 2 ;;
  esac
done
exit $status
