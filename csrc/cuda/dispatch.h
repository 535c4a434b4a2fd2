// Which kernels a head runs: the kernel family (Hopper wgmma, register
// operand, portable mma.sync), the names' variant suffixes, and the launch
// plan of its tuning on its GPU.
#pragma once

#include <string>
#include <string_view>

#include "../head_kernels.h"
#include "mlx/stream.h"
#include "plan.h"

namespace flash_cce::cuda {

// Tensor-core operand type: fp16 when h is fp16, else bf16 (fp32 operands are
// rounded to bf16 in the loaders; accumulation is always fp32).
bool use_f16(const HeadProblem& p);
mx::Dtype compute_dtype(const HeadProblem& p);

// Whether p runs the Hopper wgmma kernels on the GPU of s.
bool use_wgmma(const mx::Stream& s, const HeadProblem& p);
// Whether a Hopper quantized head takes W as the register operand.
bool use_rs(const HeadProblem& p);
// Whether the Hopper kernels leave the target logits to fcce_target_*.
bool gathers_targets(const mx::Stream& s, const HeadProblem& p);

// Kernel name suffix of the portable kernels: compute type and weight loader.
std::string variant(const HeadProblem& p);
// Suffix of a Hopper GEMM kernel: compute type and how B reaches shared memory.
std::string wg_variant(const HeadProblem& p);

// The GEMM kernel of `family` ("fwd", "ds", "dh", "dw", "fwd_wg", "ds_wg",
// "p_wg", "dh_wg", "dw_wg", "fwd_rs", "p_rs", "dh_rs", "target") for `variant`
// (variant() or wg_variant(); the compute type alone for dw and dw_wg), from
// the table of entries.h.
const char* kernel_name(std::string_view family, std::string_view variant);

// Width of the fused forward's row-sum tiles: the P kernel's vocabulary tile.
int64_t stats_tile_width(bool wgmma, bool rs);

// The launch sizes of p on the GPU of s.
LaunchPlan launch_plan(const mx::Stream& s, const HeadProblem& p);

} // namespace flash_cce::cuda
