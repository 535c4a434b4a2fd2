#include "vmath.h"

#include <algorithm>
#include <cmath>
#include <cstring>

// Compiled twice on x86-64 Linux (AVX2+FMA and baseline), picked at load time.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && \
    !defined(FLASH_CCE_NO_SIMD)
#define FLASH_CCE_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define FLASH_CCE_CLONES
#endif

namespace flash_cce::cpu {

namespace {

// x = n ln2 + r with |r| <= ln2/2; q(r) = expm1(r) by a degree-7 series
// (truncation below 1e-8 relative). Branch-free so that loops vectorise.
struct Reduced {
  float scale; // 2^n
  float q;
};

inline Reduced reduce(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float q = 1.0f / 5040.0f;
  q = q * r + 1.0f / 720.0f;
  q = q * r + 1.0f / 120.0f;
  q = q * r + 1.0f / 24.0f;
  q = q * r + 1.0f / 6.0f;
  q = q * r + 0.5f;
  q = q * r + 1.0f;
  q = q * r;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  Reduced out;
  std::memcpy(&out.scale, &bits, 4);
  out.q = q;
  return out;
}

// exp(x) = 2^n (1 + q), relative error a few ulp down to the normal range.
inline float exp_poly(float x) {
  const Reduced e = reduce(x);
  return e.scale + e.scale * e.q;
}

// expm1(x) = 2^n q + (2^n - 1): exact in the n = 0 case, so small |x| keeps
// its relative precision.
inline float expm1_poly(float x) {
  const Reduced e = reduce(x);
  return e.scale * e.q + (e.scale - 1.0f);
}

} // namespace

FLASH_CCE_CLONES void softcap_inplace(float* s, float* dcap, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  for (int64_t j = 0; j < n; ++j) {
    const float x = s[j] * inv;
    // tanh|x| = -expm1(-2|x|) / (2 + expm1(-2|x|))
    const float e = expm1_poly(-2.0f * std::fabs(x));
    const float t = std::copysign(-e / (2.0f + e), x);
    s[j] = cap * t;
    if (dcap) {
      dcap[j] = 1.0f - t * t;
    }
  }
}

FLASH_CCE_CLONES float sum_exp_shifted(const float* s, int64_t n, float shift) {
  float acc[8] = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    for (int k = 0; k < 8; ++k) {
      acc[k] += exp_poly(s[j + k] - shift);
    }
  }
  for (; j < n; ++j) {
    acc[0] += exp_poly(s[j] - shift);
  }
  float total = 0.0f;
  for (float a : acc) {
    total += a;
  }
  return total;
}

FLASH_CCE_CLONES void scaled_exp_shifted(float* s, int64_t n, float shift, float scale) {
  for (int64_t j = 0; j < n; ++j) {
    s[j] = scale * exp_poly(s[j] - shift);
  }
}

// Lane-wise partial results (8 lanes: one AVX2 vector) let the compiler keep
// the reductions in vectors; lanes are combined once at the end.
constexpr int L = 8;

FLASH_CCE_CLONES RowScan scan_row(const float* s, int64_t n) {
  float mx[L], sum[L] = {};
  int32_t arg[L];
  for (int k = 0; k < L; ++k) {
    mx[k] = -INFINITY;
    arg[k] = 0;
  }
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    for (int k = 0; k < L; ++k) {
      const float v = s[j + k];
      const bool up = v > mx[k]; // strict: a lane keeps its first maximum
      mx[k] = up ? v : mx[k];
      arg[k] = up ? static_cast<int32_t>(j + k) : arg[k];
      sum[k] += v;
    }
  }
  RowScan out{-INFINITY, 0, 0.0f};
  for (; j < n; ++j) {
    if (s[j] > out.max) {
      out.max = s[j];
      out.arg = j;
    }
    out.sum += s[j];
  }
  // The smallest index among the lanes' (and the tail's) maxima.
  for (int k = 0; k < L; ++k) {
    if (mx[k] > out.max || (mx[k] == out.max && arg[k] < out.arg)) {
      out.max = mx[k];
      out.arg = arg[k];
    }
    out.sum += sum[k];
  }
  if (n > 0 && out.max == -INFINITY) {
    out.arg = 0; // every value is -inf (or the row is NaN): the first index
  }
  return out;
}

template <bool REL>
inline float exp_moments_impl(float* s, float* rel, int64_t n, float shift, float* r) {
  float acc[L] = {}, racc[L] = {};
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    for (int k = 0; k < L; ++k) {
      const float d = s[j + k] - shift, e = exp_poly(d);
      s[j + k] = e;
      acc[k] += e;
      racc[k] += e * d;
      if constexpr (REL) {
        rel[j + k] = e * d;
      }
    }
  }
  for (; j < n; ++j) {
    const float d = s[j] - shift, e = exp_poly(d);
    s[j] = e;
    acc[0] += e;
    racc[0] += e * d;
    if constexpr (REL) {
      rel[j] = e * d;
    }
  }
  float total = 0.0f, rtotal = 0.0f;
  for (int k = 0; k < L; ++k) {
    total += acc[k];
    rtotal += racc[k];
  }
  *r += rtotal;
  return total;
}

FLASH_CCE_CLONES float exp_moments(float* s, float* rel, int64_t n, float shift, float* r) {
  return rel ? exp_moments_impl<true>(s, rel, n, shift, r)
             : exp_moments_impl<false>(s, rel, n, shift, r);
}

FLASH_CCE_CLONES void exp_affine(float* s, int64_t n, float shift, float coef, float slope,
                                 float center) {
  for (int64_t j = 0; j < n; ++j) {
    s[j] = exp_poly(s[j] - shift) * (coef - slope * (s[j] - center));
  }
}

} // namespace flash_cce::cpu
