// Which kernels a head runs on its GPU: the kernel family (Hopper wgmma,
// register operand, portable mma.sync; rules.h for the problem's part), the
// kernels by name, and the launch plan of its tuning.
#pragma once

#include <string>
#include <string_view>

#include "../head_kernels.h"
#include "mlx/stream.h"
#include "plan.h"
#include "rules.h"

namespace flash_cce::cuda {

// Whether p runs the Hopper wgmma kernels on the GPU of s: hopper_fits on an
// sm_90 GPU whose loaded image holds them.
bool use_wgmma(const mx::Stream& s, const HeadProblem& p);
// gathers_targets (rules.h) with use_wgmma.
bool gathers_targets(const mx::Stream& s, const HeadProblem& p);

// The GEMM kernel of `family` ("fwd", "ds", "dh", "dw", "fwd_ent", "ds_ent",
// "fwd_wg", "ds_wg", "ds_ent_wg", "p_wg", "dh_wg", "dw_wg", "fwd_rs", "p_rs",
// "dh_rs", "target") for `variant`
// (variant() or wg_variant(); the compute type alone for dw and dw_wg), from
// the table of entries.h.
const char* kernel_name(std::string_view family, std::string_view variant);

// Width of the fused forward's row-sum tiles: the P kernel's vocabulary tile.
int64_t stats_tile_width(bool wgmma, bool rs);

// The launch sizes of p on the GPU of s.
LaunchPlan launch_plan(const mx::Stream& s, const HeadProblem& p);

} // namespace flash_cce::cuda
