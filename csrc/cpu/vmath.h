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

// One pass over a row: its maximum, the first index where it sits, and the
// sum of its values.
struct RowScan {
  float max;
  int64_t arg;
  float sum;
};
RowScan scan_row(const float* s, int64_t n);

// One pass for the entropy's running terms: e_j = exp(s[j] - shift) replaces
// s[j], and rel[j] <- e_j (s[j] - shift) when rel is not null. Returns
// sum_j e_j and adds sum_j e_j (s[j] - shift) to *r.
float exp_moments(float* s, float* rel, int64_t n, float shift, float* r);

// s[j] <- exp(s[j] - shift) (coef - slope (s[j] - center)): a softmax row times
// an affine function of its own logit (the entropy's share of dS), in one pass.
void exp_affine(float* s, int64_t n, float shift, float coef, float slope, float center);

} // namespace flash_cce::cpu
