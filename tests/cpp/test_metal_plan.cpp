// The Metal head's launch plan (csrc/metal/plan.h) on the host: every launch
// names a known kernel, binds each index once and every scratch role it uses,
// stays within 32 KB of threadgroup memory; the splits cover the vocabulary
// blocks exactly once without an empty split; the dW slabs tile [0, V); the
// element-wise grids cover their elements; and bad problems are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <stdexcept>
#include <string>

#include "metal/plan.h"

using namespace flash_cce::metal;

namespace {

bool known(const char* name) {
  const auto& n = kernel_names();
  return std::find(n.begin(), n.end(), name) != n.end();
}

bool is_scratch(Role r) {
  return r >= Role::part_max;
}

// Properties every plan must have, whatever the problem.
void check_plan(const Problem& p, const Plan& plan) {
  std::set<Role> allocated;
  for (const auto& s : plan.scratch) {
    ASSERT_TRUE(allocated.insert(s.role).second) << role_name(s.role);
    ASSERT_GT(s.bytes, 0u);
  }
  ASSERT_FALSE(plan.launches.empty());
  for (const auto& l : plan.launches) {
    ASSERT_TRUE(known(l.kernel)) << l.kernel;
    ASSERT_LE(l.threadgroup_bytes, 32768u) << l.kernel;
    ASSERT_LE(head_threadgroup_bytes(), 32768u);
    ASSERT_GE(l.grid[0] * l.grid[1] * l.grid[2], 1u);
    std::set<int> indices{l.params_index};
    for (const auto& b : l.buffers) {
      ASSERT_TRUE(indices.insert(b.index).second) << l.kernel << " index " << b.index;
      if (is_scratch(b.role)) {
        ASSERT_TRUE(allocated.count(b.role)) << l.kernel << " " << role_name(b.role);
      }
    }
    const FcceParams& q = l.params;
    ASSERT_EQ(q.M, p.M);
    ASSERT_EQ(q.H, p.H);
    ASSERT_EQ(q.V, p.V);
    if (l.threads[0] == FCCE_EW_THREADS) {
      ASSERT_GE(int64_t(l.grid[0]) * FCCE_EW_THREADS, q.count) << l.kernel;
      ASSERT_LT(int64_t(l.grid[0] - 1) * FCCE_EW_THREADS, q.count) << l.kernel;
    }
  }
  for (const auto& s : plan.scratch) {
    bool used = false;
    for (const auto& l : plan.launches)
      for (const auto& b : l.buffers) used |= b.role == s.role;
    ASSERT_TRUE(used) << role_name(s.role);
  }
}

// The head launch's splits cover the vocabulary's BN-row blocks exactly once.
void check_splits(const Problem& p, const Launch& l) {
  const FcceParams& q = l.params;
  const int64_t blocks = (p.V + FCCE_BN - 1) / FCCE_BN;
  ASSERT_EQ(int64_t(l.grid[0]), q.splits);
  ASSERT_EQ(int64_t(l.grid[1]), (p.M + FCCE_BM - 1) / FCCE_BM);
  ASSERT_EQ(l.threads[0], unsigned(FCCE_THREADS));
  ASSERT_GE(int64_t(q.splits) * q.blocks_per_split, blocks);
  ASSERT_LT(int64_t(q.splits - 1) * q.blocks_per_split, blocks); // no empty split
  if (p.max_splits > 0) {
    ASSERT_LE(q.splits, p.max_splits);
  }
}

Problem problem(Pass pass, int64_t M, int64_t H, int64_t V) {
  Problem p;
  p.pass = pass;
  p.M = M;
  p.H = H;
  p.V = V;
  return p;
}

} // namespace

TEST(MetalPlan, KernelNamesAreUnique) {
  const auto& n = kernel_names();
  ASSERT_EQ(std::set<std::string>(n.begin(), n.end()).size(), n.size());
  ASSERT_EQ(n.size(), 109u);
}

TEST(MetalPlan, ForwardShapes) {
  for (int64_t M : {1, 31, 32, 33, 100})
    for (int64_t V : {1, 31, 32, 33, 1000, 100000})
      for (int max_splits : {0, 1, 3})
        for (bool fused : {false, true}) {
          Problem p = problem(Pass::forward, M, 70, V);
          p.fused = fused;
          p.max_splits = max_splits;
          const Plan plan = make_plan(p);
          check_plan(p, plan);
          ASSERT_EQ(plan.launches.size(), fused ? 3u : 2u);
          check_splits(p, plan.launches[0]);
          ASSERT_EQ(std::string(plan.launches[1].kernel), "fcce_combine");
          const int splits = plan.launches[0].params.splits;
          ASSERT_EQ(plan.scratch[0].bytes, size_t(splits) * M * 4);
          if (fused) {
            ASSERT_EQ(std::string(plan.launches[0].kernel), "fcce_fwd_fused_hf32_wf32");
            ASSERT_EQ(std::string(plan.launches[2].kernel), "fcce_reduce_gsum");
            ASSERT_EQ(plan.launches[2].params.mode, FCCE_REDUCE_GSUM);
          } else {
            ASSERT_EQ(std::string(plan.launches[0].kernel), "fcce_fwd_hf32_wf32");
          }
        }
}

TEST(MetalPlan, PartialsStayWithinBudget) {
  Problem p = problem(Pass::backward, 64, 4096, 262144);
  const Plan plan = make_plan(p);
  check_plan(p, plan);
  check_splits(p, plan.launches[0]);
  ASSERT_LE(plan.scratch[0].bytes, size_t(128) << 20);
  ASSERT_GT(plan.launches[0].params.splits, 1); // few rows: the vocabulary is split
  // Rows beyond the budget: one split, partials of dh's own size.
  Problem big = problem(Pass::backward, 32768, 4096, 1000);
  const Plan one = make_plan(big);
  ASSERT_EQ(one.launches[0].params.splits, 1);
  ASSERT_EQ(one.scratch[0].bytes, size_t(32768) * 4096 * 4);
}

TEST(MetalPlan, QuantizedKernelsAndParams) {
  const int bits[] = {2, 3, 4, 5, 6, 8};
  for (int b : bits)
    for (int gs : {32, 64, 128})
      for (DType h : {DType::f32, DType::f16, DType::bf16}) {
        Problem p = problem(Pass::backward, 9, 256, 150);
        p.quantized = true;
        p.bits = b;
        p.group_size = gs;
        p.h = h;
        p.sb = DType::bf16;
        const Plan plan = make_plan(p);
        check_plan(p, plan);
        const Launch& l = plan.launches[0];
        const std::string hn = h == DType::f32 ? "f32" : h == DType::f16 ? "f16" : "bf16";
        ASSERT_EQ(std::string(l.kernel), "fcce_dh_h" + hn + "_q" + std::to_string(b));
        ASSERT_EQ(l.params.row_bytes, 256 * b / 8);
        ASSERT_EQ(l.params.groups, 256 / gs);
        ASSERT_EQ(l.params.sb_dtype, 2);
        ASSERT_EQ(std::string(plan.launches[1].kernel), "fcce_reduce_dh_" + hn);
        bool binds_scales = false;
        for (const auto& bd : l.buffers) binds_scales |= bd.role == Role::scales;
        ASSERT_TRUE(binds_scales);
      }
}

TEST(MetalPlan, DwSlabsTileTheVocabulary) {
  for (DType w : {DType::f32, DType::f16, DType::bf16})
    for (int64_t V : {1, 33, 64, 65, 200})
      for (int slab : {0, 32, 64}) {
        Problem p = problem(Pass::backward, 5, 40, V);
        p.w = w;
        p.compute_dw = true;
        p.dw_slab_rows = slab;
        const Plan plan = make_plan(p);
        check_plan(p, plan);
        int64_t next = 0;
        for (const auto& l : plan.launches) {
          if (std::string(l.kernel).rfind("fcce_dw_", 0) != 0) continue;
          ASSERT_EQ(l.params.v_begin, next);
          ASSERT_GT(l.params.v_count, 0);
          ASSERT_EQ(int64_t(l.grid[0]), (l.params.v_count + FCCE_BN - 1) / FCCE_BN);
          next += l.params.v_count;
          if (w == DType::f32) {
            ASSERT_EQ(l.params.v_count, V); // written in place, one launch
          }
        }
        ASSERT_EQ(next, V);
      }
}

TEST(MetalPlan, FusedDh) {
  Problem p = problem(Pass::fused_dh, 3, 64, 10);
  p.out = DType::bf16;
  p.w = DType::f16;
  Plan plan = make_plan(p);
  check_plan(p, plan);
  ASSERT_EQ(plan.launches.size(), 1u);
  ASSERT_EQ(std::string(plan.launches[0].kernel), "fcce_fused_dh_obf16_wf16");
  ASSERT_EQ(plan.launches[0].params.count, 3 * 64);
  p.quantized = true;
  p.bits = 5;
  plan = make_plan(p);
  ASSERT_EQ(std::string(plan.launches[0].kernel), "fcce_fused_dh_obf16_q");
}

TEST(MetalPlan, RefusesWhatTheKernelsDoNotCover) {
  auto refuses = [](Problem p, const std::string& word) {
    try {
      make_plan(p);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what()).find(word) != std::string::npos;
    }
    return false;
  };
  Problem q = problem(Pass::forward, 4, 64, 10);
  q.quantized = true;
  q.bits = 7;
  EXPECT_TRUE(refuses(q, "bits"));
  q.bits = 4;
  q.group_size = 48;
  EXPECT_TRUE(refuses(q, "group_size"));
  q.group_size = 128;
  EXPECT_TRUE(refuses(q, "multiple of group_size"));
  q = problem(Pass::backward, 4, 64, 10);
  q.quantized = true;
  q.compute_dw = true;
  EXPECT_TRUE(refuses(q, "compute_dw"));
  EXPECT_TRUE(refuses(problem(Pass::forward, 0, 64, 10), "positive"));
  EXPECT_TRUE(refuses(problem(Pass::forward, 1 << 20, 1 << 12, 10), "2^31"));
  Problem s = problem(Pass::backward, 4, 64, 10);
  s.dw_slab_rows = 40;
  EXPECT_TRUE(refuses(s, "dw_slab_rows"));
}
