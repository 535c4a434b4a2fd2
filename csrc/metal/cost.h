// A cost model of the Metal head's launch plan (plan.h): per launch its GEMM
// flops, the device bytes it reads and writes, its threadgroup memory and
// threads, and an estimated time on named Apple GPUs from their published
// peak rates and memory bandwidths. Pure host code: it runs no kernel and
// knows nothing the plan and the kernels' loops (metal/*.h) do not say.
//
// What it counts: every tile a kernel loads from or stores to device memory,
// as its loops are written (no cache: a tile read twice counts twice), the
// GEMM multiply-adds (2 flops each; edge tiles count as full, as the
// kernels compute them). What it cannot know: cache hits (W tiles shared by
// threadgroups in flight, h rows read by every split), register pressure and
// occupancy, the hardware's real GEMM efficiency for these kernels, the
// overlap of compute and memory, launch gaps and the command buffer's
// scheduling, thermal limits, other work on the GPU. Its times are a roofline
// with fixed efficiencies (kGemmEfficiency, kMemoryEfficiency): a yardstick
// for comparing plans and kernels, to be checked against a Mac's measurement
// (bench/bench_metal.py prints both), not a prediction.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "plan.h"

namespace flash_cce::metal {

// An Apple GPU's published peak rates. Sources: docs/metal.md ("Cost model").
struct AppleGpu {
  const char* name; // as mx.metal.device_info()["device_name"] reports it
  int cores; // the configuration the figures are for
  double fp32_flops; // peak FP32 flop/s (FMA = 2)
  double fp16_flops; // peak FP16 flop/s
  double bandwidth; // unified memory bandwidth, bytes/s
};

const std::vector<AppleGpu>& apple_gpus();
// The entry named exactly `device_name`; nullptr if none.
const AppleGpu* find_apple_gpu(const std::string& device_name);

// Fraction of peak a steel BlockMMA GEMM sustains: MLX's steel quantized
// GEMM measured at about 46% of an M1 Max's peak (../shared METAL notes).
constexpr double kGemmEfficiency = 0.46;
// Fraction of the published bandwidth a streaming kernel sustains (assumed).
constexpr double kMemoryEfficiency = 0.8;
// Fixed cost per launch (encoding, barrier, ramp), seconds (assumed).
constexpr double kLaunchSeconds = 10e-6;

struct LaunchCost {
  std::string kernel;
  double flops = 0; // GEMM flops (element-wise kernels: 0)
  double bytes_read = 0; // device memory
  double bytes_written = 0;
  size_t threadgroup_bytes = 0; // declared + dynamic, per threadgroup
  int64_t threadgroups = 0;
  int64_t threads = 0; // in all
  bool half_operands = false; // GEMM operands in 16-bit threadgroup tiles (FP16 rate)
};

// The cost of each launch of make_plan(p), in order.
std::vector<LaunchCost> plan_cost(const Problem& p, const Plan& plan);

// Estimated seconds of one launch: max(compute, memory) + kLaunchSeconds.
double estimate_seconds(const LaunchCost& c, const AppleGpu& gpu);

// MLX's steel quantized matmul x @ w^T (qmm_t: 32 x 32 output tiles, each
// threadgroup reading its [32, K] rows of x and of the packed w with their
// scales and biases, writing its tile of the [M, N] output in x's dtype), by
// the same counting.
LaunchCost mlx_qmm_cost(int64_t M, int64_t N, int64_t K, int x_bytes, int bits,
                        int group_size, int sb_bytes);

// Sums over launches.
struct PassCost {
  double flops = 0, bytes_read = 0, bytes_written = 0;
  double seconds = 0; // on the given GPU
  double longest_seconds = 0; // the longest single launch
  size_t launches = 0;
};
PassCost pass_cost(const std::vector<LaunchCost>& launches, const AppleGpu& gpu);

} // namespace flash_cce::metal
