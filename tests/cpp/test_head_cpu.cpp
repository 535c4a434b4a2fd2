// cpu::forward / cpu::backward on raw buffers: closed forms for the affine
// dequantization and the thread merge of the online logsumexp.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "head_kernels.h"

using namespace flash_cce;

namespace {

// Packs 4-bit codes LSB-first into uint32 words, as mx.quantize does.
std::vector<uint32_t> pack4(const std::vector<uint32_t>& codes) {
  std::vector<uint32_t> out((codes.size() + 7) / 8, 0);
  for (size_t i = 0; i < codes.size(); ++i) {
    out[i / 8] |= (codes[i] & 0xf) << (4 * (i % 8));
  }
  return out;
}

double lse2(double a, double b) {
  const double m = std::max(a, b);
  return m + std::log(std::exp(a - m) + std::exp(b - m));
}

} // namespace

TEST(HeadCpu, QuantizedRowsDequantizeInPlace) {
  // V = 2, H = 32, one group: W[v, i] = scale_v * code + bias_v. With h = e_k the
  // logits are exactly W[:, k], so logp(y = 0) = W0k - logsumexp(W0k, W1k).
  const int64_t H = 32;
  std::vector<uint32_t> codes(2 * H);
  for (int64_t i = 0; i < 2 * H; ++i) {
    codes[i] = (i * 7) % 16;
  }
  auto packed = pack4(codes);
  std::vector<float> scales{0.5f, -0.25f}, biases{-1.0f, 2.0f};
  for (int64_t k : {0, 5, 31}) {
    std::vector<float> h(H, 0.0f);
    h[k] = 1.0f;
    int32_t y = 0;
    HeadProblem p;
    p.M = 1, p.H = H, p.V = 2;
    p.cfg.quantized = true, p.cfg.bits = 4, p.cfg.group_size = 32;
    p.h = h.data(), p.w = packed.data(), p.scales = scales.data(),
    p.biases = biases.data(), p.targets = &y;
    float logp, lse;
    cpu::forward(p, &logp, &lse, nullptr);
    const double w0 = 0.5 * codes[k] - 1.0, w1 = -0.25 * codes[H + k] + 2.0;
    EXPECT_NEAR(lse, lse2(w0, w1), 1e-6);
    EXPECT_NEAR(logp, w0 - lse2(w0, w1), 1e-6);
  }
}

TEST(HeadCpu, ThreadCountDoesNotChangeResults) {
  const int64_t M = 5, H = 24, V = 1500; // 12 vocabulary blocks
  std::mt19937 rng(7);
  std::normal_distribution<float> dist;
  std::vector<float> h(M * H), w(V * H);
  for (auto& v : h) v = dist(rng);
  for (auto& v : w) v = 0.3f * dist(rng);
  std::vector<int32_t> y{0, 1499, 700, -100, 128};
  HeadProblem p;
  p.M = M, p.H = H, p.V = V;
  p.h = h.data(), p.w = w.data(), p.targets = y.data();
  std::vector<std::vector<float>> results;
  for (int n : {1, 3, 8}) {
    p.cfg.tuning.num_threads = n;
    std::vector<float> logp(M), lse(M), g(M, 1.0f), g_lse(M, 0.0f), dh(M * H);
    std::vector<float> gsum(M * H);
    cpu::forward(p, logp.data(), lse.data(), nullptr);
    cpu::forward(p, logp.data(), lse.data(), gsum.data()); // the fused variant
    cpu::backward(p, lse.data(), g.data(), g_lse.data(), dh.data(), nullptr);
    logp.insert(logp.end(), dh.begin(), dh.end());
    logp.insert(logp.end(), gsum.begin(), gsum.end());
    results.push_back(logp);
  }
  EXPECT_EQ(results[0][3], 0.0f); // ignored row
  for (size_t i = 0; i < results[0].size(); ++i) {
    // Different block-to-thread assignments only reorder fp32 sums.
    EXPECT_NEAR(results[1][i], results[0][i], 1e-5) << i;
    EXPECT_NEAR(results[2][i], results[0][i], 1e-5) << i;
  }
}

TEST(HeadCpu, OutOfRangeTargetIsNan) {
  std::vector<float> h{1.0f, 2.0f}, w{0.5f, -0.5f, 1.0f, 1.0f};
  std::vector<int32_t> y{2};
  HeadProblem p;
  p.M = 1, p.H = 2, p.V = 2;
  p.h = h.data(), p.w = w.data(), p.targets = y.data();
  float logp, lse;
  cpu::forward(p, &logp, &lse, nullptr);
  EXPECT_TRUE(std::isnan(logp));
  EXPECT_NEAR(lse, lse2(-0.5, 3.0), 1e-6);
}
