// Vectorised row epilogues of the CPU head (exp and tanh to ~2 ulp in fp32).
#pragma once

#include <cstdint>

namespace flash_cce::cpu {

// s[j] <- cap * tanh(s[j] / cap); dcap[j] <- 1 - tanh^2 when dcap is not null.
void softcap_inplace(float* s, float* dcap, int64_t n, float cap);

// sum_j exp(s[j] - shift)
float sum_exp_shifted(const float* s, int64_t n, float shift);

// s[j] <- scale * exp(s[j] - shift)
void scaled_exp_shifted(float* s, int64_t n, float shift, float scale);

} // namespace flash_cce::cpu
