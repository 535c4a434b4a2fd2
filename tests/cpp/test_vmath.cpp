// The vectorised exp/tanh epilogues against libm in double precision.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "cpu/vmath.h"

using namespace flash_cce::cpu;

namespace {
const double u = std::ldexp(1.0, -24);

std::vector<float> sweep(float lo, float hi, int n) {
  std::vector<float> x(n);
  for (int i = 0; i < n; ++i) {
    x[i] = n == 1 ? lo : lo + (hi - lo) * float(i) / float(n - 1);
  }
  return x;
}
} // namespace

TEST(Vmath, ScaledExpIsWithinFourUlp) {
  auto x = sweep(-80.0f, 80.0f, 10001);
  auto y = x;
  scaled_exp_shifted(y.data(), y.size(), 1.5f, 0.75f);
  for (size_t i = 0; i < x.size(); ++i) {
    // The kernel exponentiates the fp32 difference; so does the reference.
    const double ref = 0.75 * std::exp(double(x[i] - 1.5f));
    // exp of an fp32 argument: range reduction + series + scaling, ~4 u.
    ASSERT_NEAR(y[i], ref, 4 * u * ref) << x[i];
  }
}

TEST(Vmath, SumExpMatchesDouble) {
  for (int n : {1, 7, 8, 9, 128, 1000}) {
    auto x = sweep(-20.0f, 3.0f, n);
    double ref = 0.0;
    for (float v : x) {
      ref += std::exp(double(v - 3.0f));
    }
    // n terms of ~4 u each plus n additions.
    EXPECT_NEAR(sum_exp_shifted(x.data(), n, 3.0f), ref, (n + 4) * u * ref) << n;
  }
}

TEST(Vmath, SoftcapAndDerivative) {
  const float cap = 30.0f;
  auto x = sweep(-400.0f, 400.0f, 20001);
  x.push_back(1e-6f);
  x.push_back(-3e-5f);
  auto s = x;
  std::vector<float> d(x.size());
  softcap_inplace(s.data(), d.data(), s.size(), cap);
  for (size_t i = 0; i < x.size(); ++i) {
    const double t = std::tanh(double(x[i]) / cap);
    // Relative accuracy holds near 0 too (expm1 form, no cancellation).
    ASSERT_NEAR(s[i], cap * t, 8 * u * cap * std::abs(t) + 1e-30) << x[i];
    ASSERT_NEAR(d[i], 1.0 - t * t, 8 * u) << x[i];
  }
}
