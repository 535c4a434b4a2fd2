// The interface every backend implements: raw pointers plus the problem shape.
#pragma once

#include <cstdint>

#include "flash_cce.h"

namespace flash_cce {

struct HeadProblem {
  int64_t M = 0, H = 0, V = 0;
  HeadConfig cfg;
  const void* h = nullptr; // [M, H] row-major
  mx::Dtype h_dtype = mx::float32;
  const void* w = nullptr; // [V, H], or packed uint32 [V, H * bits / 32]
  mx::Dtype w_dtype = mx::float32;
  const void* scales = nullptr; // [V, H / group_size] when quantized
  const void* biases = nullptr;
  mx::Dtype sb_dtype = mx::float32;
  const int32_t* targets = nullptr; // [M]
};

// The forward's entropy statistics (cfg.stats), each [M]: the entropy of the
// softmax, whether the target is the first arg-max, the mean logit; with
// cfg.fused also gsum_ent[M, H] = sum_v p_v (s_v - sum_u p_u s_u) dcap_v W_v,
// the entropy's share of the fused backward.
struct StatsOut {
  float* entropy = nullptr;
  bool* top1 = nullptr;
  float* mean = nullptr;
  float* gsum_ent = nullptr;
};

// The entropy's cotangent in the backward: entropy[M] (the forward's) and
// g_ent[M]; null pointers when it takes none.
struct EntropyGrad {
  const float* entropy = nullptr;
  const float* g_ent = nullptr;
};

namespace cpu {
// logp[M], lse[M] (float32). Out-of-range targets give NaN. When gsum is not
// null it receives sum_v softmax_v * dcap_v * W_v per row, [M, H] float32.
void forward(const HeadProblem& p, float* logp, float* lse, float* gsum,
             const StatsOut& stats = {});
// dh[M, H] in h_dtype; dw[V, H] in w_dtype when not null (dense weights only).
void backward(const HeadProblem& p, const float* lse, const float* g,
              const float* g_lse, void* dh, void* dw, const EntropyGrad& ent = {});
// dh[M, H] (in p.h_dtype) = g dcap_y W_y + (g_lse - g) gsum - g_ent gsum_ent for
// each row (gsum_ent and g_ent only with cfg.stats); p.h is unused.
void fused_dh(const HeadProblem& p, const float* gsum, const float* logp, const float* lse,
              const float* g, const float* g_lse, void* dh, const float* gsum_ent = nullptr,
              const float* g_ent = nullptr);
} // namespace cpu

} // namespace flash_cce
