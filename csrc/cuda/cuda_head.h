// CUDA evaluation of the flash-CCE primitives (kernels in kernels.cu and its headers).
#pragma once

#include <string>
#include <vector>

#include "../head_kernels.h"
#include "mlx/stream.h"

namespace flash_cce::cuda {

// Inputs h, w, targets (+ scales, biases); outputs logp[M], lse[M] (float32),
// with cfg.stats entropy[M], is_top1[M] (bool), mean_logit[M], and with
// cfg.fused (never with cfg.stats) the gradient state gsum[M, H].
void forward(mx::Stream s, const HeadProblem& p, const std::vector<mx::array>& inputs,
             std::vector<mx::array>& outputs);

// Inputs h, w, targets, lse, g, g_lse (+ entropy, g_entropy with cfg.stats)
// (+ scales, biases); outputs dh (+ dw).
void backward(mx::Stream s, const HeadProblem& p, const std::vector<mx::array>& inputs,
              std::vector<mx::array>& outputs);

// Inputs gsum, w, targets, logp, lse, g, g_lse (+ scales, biases); output dh.
void fused_dh(mx::Stream s, const HeadProblem& p, const std::vector<mx::array>& inputs,
              std::vector<mx::array>& outputs);

// Which fatbin image the driver loaded for GPU `ordinal` and which kernels it
// routes to, e.g. "device sm_90, image sm_90a SASS, Hopper kernels".
std::string kernel_image(int ordinal);

// The device attributes of GPU `ordinal` and the launch sizes `tuning`
// resolves to there (plan.h), as (name, value) pairs.
std::vector<std::pair<std::string, int64_t>> launch_plan_items(int ordinal,
                                                               const HeadTuning& tuning);

} // namespace flash_cce::cuda
