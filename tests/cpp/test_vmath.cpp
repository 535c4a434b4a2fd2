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

TEST(Vmath, ScanRowFindsFirstMaximumAndSum) {
  for (int n : {1, 5, 8, 13, 128, 131}) {
    // Values in a few levels, so that the maximum repeats across lanes and the tail.
    std::vector<float> x(n);
    for (int i = 0; i < n; ++i) {
      x[i] = float((i * 7) % 5) - 2.0f;
    }
    int64_t first = 0;
    double sum = 0.0;
    for (int i = 0; i < n; ++i) {
      first = x[i] > x[first] ? i : first;
      sum += x[i];
    }
    const RowScan s = scan_row(x.data(), n);
    EXPECT_EQ(s.max, x[first]) << n;
    EXPECT_EQ(s.arg, first) << n;
    EXPECT_EQ(s.sum, sum) << n; // small integers: every partial sum is exact
  }
  // A maximum that appears only in the tail, and one only in a late lane.
  std::vector<float> x(19, 0.0f);
  x[17] = 3.0f;
  EXPECT_EQ(scan_row(x.data(), 19).arg, 17);
  x[17] = 0.0f;
  x[6] = 2.0f;
  x[14] = 2.0f;
  EXPECT_EQ(scan_row(x.data(), 19).arg, 6);
}

TEST(Vmath, ExpMomentsMatchDouble) {
  for (int n : {1, 7, 8, 9, 128, 1000}) {
    auto x = sweep(-20.0f, 3.0f, n);
    auto e = x;
    std::vector<float> rel(n);
    double ref_sum = 0.0, ref_r = 0.0, bound_r = 0.0;
    for (float v : x) {
      const double d = double(v - 3.0f), ev = std::exp(d);
      ref_sum += ev;
      ref_r += ev * d;
      bound_r += std::abs(ev * d);
    }
    float r = 0.5f;
    const float sum = exp_moments(e.data(), rel.data(), n, 3.0f, &r);
    // As SumExpMatchesDouble; R's terms carry one product more.
    EXPECT_NEAR(sum, ref_sum, (n + 4) * u * ref_sum) << n;
    EXPECT_NEAR(r, 0.5 + ref_r, (n + 6) * u * (bound_r + 0.5)) << n;
    for (int i = 0; i < n; ++i) {
      const double d = double(x[i] - 3.0f), ev = std::exp(d);
      ASSERT_NEAR(e[i], ev, 4 * u * ev) << i;
      ASSERT_NEAR(rel[i], ev * d, 6 * u * std::abs(ev * d)) << i;
    }
    // Without rel: the same sums, to the same bounds (the compiler may
    // contract the two loops' products differently).
    auto e2 = x;
    float r2 = 0.5f;
    EXPECT_NEAR(exp_moments(e2.data(), nullptr, n, 3.0f, &r2), ref_sum, (n + 4) * u * ref_sum);
    EXPECT_NEAR(r2, 0.5 + ref_r, (n + 6) * u * (bound_r + 0.5)) << n;
  }
}

TEST(Vmath, ExpAffineMatchesDouble) {
  auto x = sweep(-30.0f, 2.0f, 1001);
  auto y = x;
  const float shift = 2.0f, coef = 0.75f, slope = -1.5f, center = -0.25f;
  exp_affine(y.data(), y.size(), shift, coef, slope, center);
  for (size_t i = 0; i < x.size(); ++i) {
    const double ev = std::exp(double(x[i] - shift));
    const double lin = coef - slope * (double(x[i]) - center);
    // exp (~4 u) times an affine term of three roundings, each relative to
    // the size of its operands.
    const double bound = 4 * u * std::abs(ev * lin) +
                         3 * u * ev * (std::abs(coef) + std::abs(slope * (x[i] - center)));
    ASSERT_NEAR(y[i], ev * lin, bound) << x[i];
  }
}
