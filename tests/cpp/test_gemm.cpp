// sgemm against a double-precision triple loop, over edge tiles, transposes,
// operand dtypes and accumulation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/gemm.h"

using namespace flash_cce::cpu;

namespace {

uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>(b >> 16); // truncation: exact value kept below
}

float from_bf16(uint16_t v) {
  uint32_t b = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

struct Case {
  int64_t M, N, K;
  bool ta, tb;
  Elem ea, eb;
  bool accumulate;
  bool prepack = false;
};

// Storage for a logical [rows, cols] matrix in the requested layout and dtype;
// `exact` holds the values it represents.
struct Operand {
  std::vector<float> f32;
  std::vector<uint16_t> half;
  std::vector<double> exact; // row-major logical
  MatView view;
};

Operand make(int64_t rows, int64_t cols, bool trans, Elem e, std::mt19937& rng) {
  std::normal_distribution<float> dist;
  Operand o;
  o.exact.resize(rows * cols);
  const int64_t ld = trans ? rows : cols;
  o.f32.resize(rows * cols);
  o.half.resize(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t at = trans ? c * ld + r : r * ld + c;
      float v = dist(rng);
      if (e == Elem::bf16) {
        o.half[at] = to_bf16(v);
        v = from_bf16(o.half[at]);
      } else if (e == Elem::f16) {
        half hv = static_cast<half>(v);
        std::memcpy(&o.half[at], &hv, 2);
        v = static_cast<float>(hv);
      }
      o.f32[at] = v;
      o.exact[r * cols + c] = v;
    }
  }
  const void* p = e == Elem::f32 ? static_cast<const void*>(o.f32.data())
                                 : static_cast<const void*>(o.half.data());
  o.view = {p, ld, trans, e};
  return o;
}

void run_one(const Case& c, const std::string& kernel) {
  std::mt19937 rng(1234);
  auto A = make(c.M, c.K, c.ta, c.ea, rng);
  auto B = make(c.K, c.N, c.tb, c.eb, rng);
  const int64_t ldc = c.N + 3; // C need not be packed
  std::vector<float> C(c.M * ldc, 0.5f);
  std::vector<float> scratch(sgemm_scratch_floats(c.N));
  auto s = sgemm_scratch(scratch.data());
  std::vector<float> packed;
  if (c.prepack) {
    packed.resize(sgemm_packed_a_floats(c.M, c.K));
    sgemm_pack_a(A.view, c.M, c.K, packed.data());
    A.view.packed = packed.data();
  }
  sgemm(c.M, c.N, c.K, A.view, B.view, C.data(), ldc, c.accumulate, s);
  for (int64_t i = 0; i < c.M; ++i) {
    for (int64_t j = 0; j < c.N; ++j) {
      double ref = c.accumulate ? 0.5 : 0.0, bound = std::abs(ref);
      for (int64_t k = 0; k < c.K; ++k) {
        ref += A.exact[i * c.K + k] * B.exact[k * c.N + j];
        bound += std::abs(A.exact[i * c.K + k] * B.exact[k * c.N + j]);
      }
      // fp32 summation of K + 1 terms: |err| <= (K + 1) u sum|terms|.
      const double tol = (c.K + 1) * std::ldexp(1.0, -24) * bound + 1e-30;
      ASSERT_NEAR(C[i * ldc + j], ref, tol) << kernel << " at " << i << "," << j;
    }
    for (int64_t j = c.N; j < ldc; ++j) {
      ASSERT_EQ(C[i * ldc + j], 0.5f) << kernel << " wrote past N";
    }
  }
}

// Every micro-kernel this build has and the processor runs (AVX-512, AVX2,
// NEON, generic), restoring the one chosen at load time.
void run(const Case& c) {
  const std::string chosen = sgemm_kernel_name();
  for (const std::string& name : sgemm_kernels()) {
    ASSERT_TRUE(sgemm_select(name)) << name;
    run_one(c, name);
  }
  ASSERT_TRUE(sgemm_select(chosen));
}

} // namespace

TEST(Sgemm, KernelChoice) {
  const auto names = sgemm_kernels();
  ASSERT_FALSE(names.empty());
  // The best kernel the processor runs is the one in use; generic is always there.
  EXPECT_EQ(names.front(), sgemm_kernel_name());
  EXPECT_EQ(names.back(), "generic");
#if defined(__x86_64__) || defined(_M_X64)
  // A FLASH_CCE_SIMD=OFF build has the generic kernel alone (the tests do not
  // see that build's definition); any other build picks AVX-512 where it runs.
  __builtin_cpu_init();
  if (names.size() > 1 && __builtin_cpu_supports("avx512f")) {
    EXPECT_EQ(names.front(), "avx512");
  }
#endif
  EXPECT_FALSE(sgemm_select("no-such-kernel"));
  EXPECT_EQ(names.front(), sgemm_kernel_name());
}

TEST(Sgemm, EdgeTilesAndTransposes) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (auto [M, N, K] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1},
                             {6, 16, 7},
                             {12, 32, 9},
                             {7, 17, 300},
                             {25, 65, 513},
                             {101, 33, 257},
                             {13, 1041, 19}}) {
        run({M, N, K, ta, tb, Elem::f32, Elem::f32, false});
        run({M, N, K, ta, tb, Elem::f32, Elem::f32, true});
      }
    }
  }
}

TEST(Sgemm, HalfOperands) {
  for (Elem e : {Elem::bf16, Elem::f16}) {
    run({23, 45, 130, false, true, e, e, false});
    run({23, 45, 130, true, false, Elem::f32, e, true});
  }
}

TEST(Sgemm, PrepackedA) {
  // K spans several KC blocks and M several MC blocks plus an edge panel.
  run({203, 40, 700, false, true, Elem::bf16, Elem::f32, false, true});
  run({7, 33, 5, true, false, Elem::f32, Elem::f32, true, true});
}

TEST(Sgemm, EmptyK) {
  std::vector<float> C(6, 2.0f);
  std::vector<float> scratch(sgemm_scratch_floats(3));
  auto s = sgemm_scratch(scratch.data());
  float dummy = 0;
  sgemm(2, 3, 0, {&dummy, 1}, {&dummy, 3}, C.data(), 3, false, s);
  for (float v : C) {
    EXPECT_EQ(v, 0.0f);
  }
}
