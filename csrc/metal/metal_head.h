// Metal evaluation of the flash-CCE primitives: encodes the launches of
// plan.h with MLX's Metal command encoder (kernels in metal/*.metal).
#pragma once

#include <vector>

#include "../head_kernels.h"
#include "mlx/stream.h"

namespace flash_cce::metal {

// Inputs h, w, targets (+ scales, biases); outputs logp[M], lse[M] (float32),
// and with three outputs also the gradient state gsum[M, H]; with
// cfg.stats logp, lse, entropy, is_top1, mean_logit (roles.h).
void forward(mx::Stream s, const HeadProblem& p, const std::vector<mx::array>& inputs,
             std::vector<mx::array>& outputs);

// Inputs h, w, targets, lse, g, g_lse (+ entropy, g_ent with cfg.stats)
// (+ scales, biases); outputs dh (+ dw).
void backward(mx::Stream s, const HeadProblem& p, const std::vector<mx::array>& inputs,
              std::vector<mx::array>& outputs);

// Inputs gsum, w, targets, logp, lse, g, g_lse (+ scales, biases); output dh.
void fused_dh(mx::Stream s, const HeadProblem& p, const std::vector<mx::array>& inputs,
              std::vector<mx::array>& outputs);

// The fused forward keeps its state in float32 for every dtype of h. With the
// entropy statistics the forward is the plain one and the gradient runs the
// backward pass, whose dS takes the entropy's share (the fused state would
// need a second [M, H] sum).
inline bool supports_fused(mx::Dtype, bool stats) {
  return !stats;
}

// Finds the kernels' library once per process (the metallib installed beside
// the module if it loads, else the embedded source, compiled per kernel set at
// first use) and says which one, or why neither.
MetalLibraryStatus library_status();

// The libraries compiled from the source so far in this process.
std::vector<MetalCompile> compiled_libraries();

// Caps the vocabulary splits and the blocks per launch round of the plans
// encoded on stream `s` (0: the plan's choice); the self-check uses it to run
// long splits, and splits in several rounds, at small sizes.
void set_plan_limits(const mx::Stream& s, PlanLimits limits);

} // namespace flash_cce::metal
