// The Metal head's launch plan (csrc/metal/plan.h) on the host: every launch
// names a known kernel, binds each index once and every scratch role it uses,
// stays within 32 KB of threadgroup memory; the splits cover the vocabulary
// blocks exactly once without an empty split, in rounds that keep every launch
// bounded; the dW slabs and m chunks tile [0, V) x [0, M); the
// element-wise grids cover their elements; and bad problems are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

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

bool is_head(const Launch& l) {
  const std::string k = l.kernel;
  return k.rfind("fcce_fwd_", 0) == 0 || k.rfind("fcce_dh_", 0) == 0 ||
      k.rfind("fcce_dhreg_", 0) == 0 || k.rfind("fcce_fwdreg_", 0) == 0;
}

bool is_dw(const Launch& l) {
  return std::string(l.kernel).rfind("fcce_dw", 0) == 0;
}

// The head kernel's launches: the splits cover the vocabulary's BN-row blocks
// exactly once without an empty split; every (m tile, split) visits its
// blocks exactly once, in order, in rounds of at most FCCE_MAX_ROUND_BLOCKS;
// every launch stays within kLaunchFlops. Returns the number of head launches.
size_t check_splits(const Problem& p, const Plan& plan) {
  const int64_t blocks = (p.V + FCCE_BN - 1) / FCCE_BN;
  const int64_t m_tiles = (p.M + FCCE_BM - 1) / FCCE_BM;
  std::vector<const Launch*> head;
  for (const auto& l : plan.launches)
    if (is_head(l)) head.push_back(&l);
  EXPECT_FALSE(head.empty());
  if (head.empty()) return 0;
  const FcceParams& q0 = head[0]->params;
  EXPECT_GE(int64_t(q0.splits) * q0.blocks_per_split, blocks);
  EXPECT_LT(int64_t(q0.splits - 1) * q0.blocks_per_split, blocks); // no empty split
  EXPECT_EQ(q0.m_tiles, m_tiles);
  if (p.max_splits > 0) {
    EXPECT_LE(q0.splits, p.max_splits);
  }
  // next[m tile][split]: the block (within the split) its next round starts at.
  std::vector<std::vector<int64_t>> next(m_tiles, std::vector<int64_t>(q0.splits, 0));
  const int64_t hk = (p.H + FCCE_BK - 1) / FCCE_BK * FCCE_BK;
  const bool flops_bounded = 2.0 * 2 * FCCE_BM * FCCE_BN * hk <= kLaunchFlops;
  // The register kernels' stage: at most kMaxStagedUnits units per launch.
  const std::string k0 = head[0]->kernel;
  const bool staged = (k0.rfind("fcce_dhreg_", 0) == 0 || k0.rfind("fcce_fwdreg_", 0) == 0) &&
      register_chunks(p.H) > 1;
  for (const Launch* l : head) {
    const FcceParams& q = l->params;
    EXPECT_EQ(std::string(l->kernel), std::string(head[0]->kernel));
    EXPECT_EQ(q.splits, q0.splits);
    EXPECT_EQ(q.blocks_per_split, q0.blocks_per_split);
    EXPECT_EQ(l->grid[2], 1u);
    if (staged) {
      EXPECT_LE(int64_t(l->grid[0]) * l->grid[1] * q.block_count, kMaxStagedUnits);
    }
    EXPECT_EQ(l->threads[0], unsigned(FCCE_THREADS));
    EXPECT_GE(q.block_count, 1);
    // The watchdog bound: vocabulary rows per threadgroup in one launch.
    EXPECT_LE(int64_t(q.block_count) * FCCE_BN, FCCE_MAX_ROUND_ROWS) << l->kernel;
    if (flops_bounded) {
      EXPECT_LE(launch_gemm_flops(*l), kLaunchFlops) << l->kernel;
    }
    if (p.round_blocks > 0) {
      EXPECT_LE(q.block_count, p.round_blocks);
    }
    for (int64_t t = q.m_tile_begin; t < q.m_tile_begin + int64_t(l->grid[0]); ++t)
      for (int64_t sp = q.split_begin; sp < q.split_begin + int64_t(l->grid[1]); ++sp) {
        EXPECT_TRUE(t < m_tiles && sp < q.splits);
        if (t >= m_tiles || sp >= q.splits) return head.size();
        EXPECT_EQ(next[t][sp], q.block_begin) << "m tile " << t << " split " << sp;
        next[t][sp] = int64_t(q.block_begin) + q.block_count;
      }
  }
  for (int64_t t = 0; t < m_tiles; ++t)
    for (int64_t sp = 0; sp < q0.splits; ++sp) {
      // Every block visited (a last round may be cut short by the split's end).
      EXPECT_GE(next[t][sp], q0.blocks_per_split);
      if (next[t][sp] < q0.blocks_per_split) return head.size();
    }
  return head.size();
}

// dW's launches add every (vocabulary row, m tile) pair exactly once, each
// row's m tiles in order, starting at m tile 0 (which writes rather than adds),
// with at most FCCE_MAX_ROUND_ROWS rows of h per threadgroup and kLaunchFlops
// per launch; a staged slab is cast after its last m tile.
void check_dw(const Problem& p, const Plan& plan) {
  const int64_t m_tiles = (p.M + FCCE_BM - 1) / FCCE_BM;
  const bool staged = p.w != DType::f32;
  std::vector<int64_t> next(p.V, 0); // next m tile per vocabulary row
  int64_t cast_next = 0;
  for (const auto& l : plan.launches) {
    const FcceParams& q = l.params;
    if (is_dw(l)) {
      EXPECT_EQ(q.acc_row0, staged ? 0 : q.v_begin);
      EXPECT_EQ(int64_t(l.grid[0]), (q.v_count + FCCE_BN - 1) / FCCE_BN);
      EXPECT_LE(int64_t(q.m_tile_count) * FCCE_BM, FCCE_MAX_ROUND_ROWS);
      EXPECT_LE(launch_gemm_flops(l), kLaunchFlops);
      EXPECT_GT(q.v_count, 0);
      for (int64_t v = q.v_begin; v < q.v_begin + q.v_count; ++v) {
        EXPECT_EQ(next[v], q.m_tile_begin) << "row " << v;
        next[v] = q.m_tile_begin + q.m_tile_count;
      }
    } else if (std::string(l.kernel).rfind("fcce_cast_", 0) == 0) {
      EXPECT_TRUE(staged);
      EXPECT_EQ(q.v_begin, cast_next);
      EXPECT_EQ(q.count, int64_t(q.v_count) * p.H);
      for (int64_t v = q.v_begin; v < q.v_begin + q.v_count; ++v) {
        EXPECT_GE(next[v], m_tiles) << "cast before dW row " << v << " is done";
      }
      cast_next += q.v_count;
    }
  }
  for (int64_t v = 0; v < p.V; ++v) {
    EXPECT_GE(next[v], m_tiles);
    if (next[v] < m_tiles) return;
  }
  EXPECT_EQ(cast_next, staged ? p.V : 0);
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
  // 5 passes x 9 dense (h, w) pairs, 5 x 3 tile types x 6 bit widths x 3 group sizes
  // quantized, 2 x 9 dW, combine, 3 reduce_dh, reduce_gsum, 2 casts, 2 widens, 12 fused dh;
  // the entropy variants: 2 x 9 dense (forward, dh), 2 x 54 quantized, 9 dW, the combine.
  ASSERT_EQ(n.size(), 45u + 270 + 2 * 9 + 1 + 3 + 1 + 2 + 2 + 12 + 18 + 108 + 9 + 1);
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
          const size_t n = check_splits(p, plan);
          ASSERT_EQ(plan.launches.size(), n + (fused ? 2u : 1u));
          ASSERT_EQ(std::string(plan.launches[n].kernel), "fcce_combine");
          const int splits = plan.launches[0].params.splits;
          ASSERT_EQ(plan.scratch[0].bytes, size_t(splits) * M * 4);
          if (fused) {
            ASSERT_EQ(std::string(plan.launches[0].kernel), "fcce_fwdreg_hf32_wf32");
            ASSERT_EQ(std::string(plan.launches[n + 1].kernel), "fcce_reduce_gsum");
            ASSERT_EQ(plan.launches[n + 1].params.mode, FCCE_REDUCE_GSUM);
          } else {
            ASSERT_EQ(std::string(plan.launches[0].kernel), "fcce_fwd_hf32_wf32");
          }
        }
}

TEST(MetalPlan, PartialsStayWithinBudget) {
  Problem p = problem(Pass::backward, 64, 4096, 262144);
  const Plan plan = make_plan(p);
  check_plan(p, plan);
  check_splits(p, plan);
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
        // The tile type is h's where the scales agree (bfloat16), else float32:
        // the float16 h, the scales of a non-bfloat16 h and their biases are
        // widened first, and the head kernel reads those copies.
        const bool same = h == DType::bf16;
        ASSERT_EQ(tile_dtype(p), same ? DType::bf16 : DType::f32);
        std::vector<std::string> widened;
        size_t head = 0;
        while (std::string(plan.launches[head].kernel).rfind("fcce_widen_", 0) == 0) {
          widened.push_back(plan.launches[head++].kernel);
        }
        std::vector<std::string> want;
        if (h == DType::f16) want.push_back("fcce_widen_f16");
        if (!same) want.insert(want.end(), {"fcce_widen_bf16", "fcce_widen_bf16"});
        ASSERT_EQ(widened, want);
        const Launch& l = plan.launches[head];
        const std::string hn = h == DType::f32 ? "f32" : h == DType::f16 ? "f16" : "bf16";
        const std::string tn = same ? "bf16" : "f32";
        ASSERT_TRUE(acc_in_registers(p));
        ASSERT_EQ(std::string(l.kernel),
                  "fcce_dhreg_h" + tn + "_q" + std::to_string(b) + "_g" + std::to_string(gs));
        ASSERT_EQ(l.params.row_bytes, 256 * b / 8);
        ASSERT_EQ(l.params.groups, 256 / gs);
        ASSERT_EQ(l.params.sb_dtype, 2);
        ASSERT_EQ(std::string(plan.launches.back().kernel), "fcce_reduce_dh_" + hn);
        std::set<Role> bound;
        for (const auto& bd : l.buffers) bound.insert(bd.role);
        ASSERT_EQ(bound.count(same ? Role::scales : Role::scales_tile), 1u);
        ASSERT_EQ(bound.count(same ? Role::biases : Role::biases_tile), 1u);
        ASSERT_EQ(bound.count(h == DType::f16 ? Role::h_tile : Role::h), 1u);
      }
}

TEST(MetalPlan, DwSlabsTileTheVocabulary) {
  for (DType w : {DType::f32, DType::f16, DType::bf16})
    for (int64_t V : {1, 33, 64, 65, 200})
      for (int slab : {0, 32, 64})
        for (int m_chunk : {0, 1, 2}) {
          Problem p = problem(Pass::backward, 70, 40, V);
          p.w = w;
          p.compute_dw = true;
          p.dw_slab_rows = slab;
          p.round_m_tiles = m_chunk;
          const Plan plan = make_plan(p);
          check_plan(p, plan);
          check_dw(p, plan);
          size_t launches = 0;
          for (const auto& l : plan.launches) launches += is_dw(l);
          const size_t chunks = m_chunk ? (3 + m_chunk - 1) / m_chunk : 1;
          const size_t slabs = slab ? (V + slab - 1) / slab : 1;
          ASSERT_EQ(launches, chunks * slabs);
        }
}

// The watchdog bound (issue: no threadgroup walks more than 8192 vocabulary
// rows, nor dW more than 8192 rows of h, in one launch; no launch beyond
// kLaunchFlops), over the shapes the CPU backend accepts up to Gemma's heads
// and awkward ones, every pass, dense and 4-bit.
// The head launches' grid: x over m tiles (dispatched fastest), y over
// splits, so that threadgroups in flight are one split's m tiles walking the
// same W blocks. At e4b M = 512 every launch of each pass carries all 16 m
// tiles of its splits.
TEST(MetalPlan, GridOrderSharesWTiles) {
  for (int pass = 0; pass < 3; ++pass) {
    Problem p = problem(pass == 2 ? Pass::backward : Pass::forward, 512, 2560, 262144);
    p.fused = pass == 1;
    p.quantized = true;
    p.h = p.sb = DType::bf16;
    const Plan plan = make_plan(p);
    int head = 0;
    for (const auto& l : plan.launches) {
      if (!is_head(l)) continue;
      ++head;
      ASSERT_EQ(l.grid[0], 16u) << l.kernel; // m tiles: 32 splits x 16 in the forward
      ASSERT_EQ(l.params.m_tile_begin, 0);
      ASSERT_LE(l.params.split_begin + int(l.grid[1]), l.params.splits) << l.kernel;
      ASSERT_GT(l.grid[1], 1u) << l.kernel;
    }
    ASSERT_GT(head, 0);
  }
}

TEST(MetalPlan, LaunchesAreBounded) {
  const int64_t shapes[][3] = {
      {512, 2560, 262144}, {8192, 2560, 262144}, {32768, 2560, 262144},
      {512, 4096, 262144}, {8192, 4096, 262144}, {32768, 4096, 262144},
      {512, 5376, 262144}, {8192, 5376, 262144}, {32768, 5376, 262144},
      {6554, 2560, 262144}, {1, 2560, 262144}, {33, 5376, 262145}, {1, 64, 8193},
      {4097, 128, 1000003}, {32768, 32768, 1000}, {3, 131072, 40000}, {1000, 2048, 65537},
      {40000, 64, 100}, {20000, 32, 4000}};
  for (const auto& s : shapes)
    for (bool quantized : {false, true})
      for (int pass = 0; pass < 6; ++pass) {
        Problem p = problem(Pass::forward, s[0], s[1], s[2]);
        // pass 3: the backward with dh's accumulator in registers at every H;
        // 4 and 5: the forward and backward with the entropy statistics.
        if (pass == 3) p.acc_registers = 1;
        p.stats = pass >= 4;
        p.quantized = quantized;
        p.group_size = 32;
        p.w = DType::bf16;
        p.h = DType::bf16;
        if (pass == 1) p.fused = true;
        if (pass >= 2 && pass != 4) {
          p.pass = Pass::backward;
          p.compute_dw = !quantized;
        }
        const Plan plan = make_plan(p);
        check_plan(p, plan);
        check_splits(p, plan);
        if (p.compute_dw) {
          check_dw(p, plan);
        }
        for (const auto& ss : plan.scratch) {
          // Rounds, not larger partials: part_acc stays within the budget or dh's size.
          if (ss.role == Role::part_acc) {
            ASSERT_LE(ss.bytes, std::max<size_t>(size_t(128) << 20, size_t(s[0]) * s[1] * 4));
          }
        }
      }
}

// Rounds and m chunks forced at a small shape (the emulation tests run such plans).
TEST(MetalPlan, ForcedRounds) {
  for (int rb : {1, 2, 3})
    for (int mc : {0, 1, 2}) {
      Problem p = problem(Pass::backward, 70, 40, 333);
      p.max_splits = 2;
      p.round_blocks = rb;
      p.round_m_tiles = mc;
      const Plan plan = make_plan(p);
      check_plan(p, plan);
      const size_t n = check_splits(p, plan);
      const size_t rounds = (6 + rb - 1) / rb; // 11 blocks in 2 splits of 6
      ASSERT_EQ(n, rounds * (mc ? (3 + mc - 1) / mc : 1));
    }
}

// The plan's dh and fused forward kernels: registers unless forced off; their
// stage sized for the largest launch where H takes more than one chunk.
TEST(MetalPlan, RegisterKernelChoice) {
  for (int64_t H : {8, 200, 256, 257, 320, 2560})
    for (int forced : {0, 1, -1})
      for (bool dh : {true, false}) {
        Problem p = problem(dh ? Pass::backward : Pass::forward, 40, H, 333);
        p.fused = !dh;
        p.acc_registers = forced;
        const Plan plan = make_plan(p);
        check_plan(p, plan);
        check_splits(p, plan);
        const bool regs = forced >= 0;
        ASSERT_EQ(acc_in_registers(p), regs) << H << " " << forced;
        const std::string kind = dh ? (regs ? "dhreg" : "dh") : (regs ? "fwdreg" : "fwd_fused");
        ASSERT_EQ(std::string(plan.launches[0].kernel), "fcce_" + kind + "_hf32_wf32");
        size_t stage = 0, units = 0;
        for (const auto& s : plan.scratch)
          if (s.role == Role::stage) stage = s.bytes;
        for (const auto& l : plan.launches)
          if (is_head(l)) units = std::max<size_t>(units, size_t(l.grid[0]) * l.grid[1] * l.params.block_count);
        ASSERT_EQ(stage, !regs ? 0 : H > FCCE_REG_COLS ? units * FCCE_STAGE_FLOATS * 4 : 16) << H;
      }
  // The plain forward keeps no partial: its kernel is the same either way.
  Problem f = problem(Pass::forward, 40, 300, 333);
  ASSERT_EQ(std::string(make_plan(f).launches[0].kernel), "fcce_fwd_hf32_wf32");
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
  q = problem(Pass::backward, 4, 64, 10);
  q.acc_registers = 2;
  EXPECT_TRUE(refuses(q, "acc_registers"));
  EXPECT_TRUE(refuses(problem(Pass::forward, 0, 64, 10), "positive"));
  EXPECT_TRUE(refuses(problem(Pass::forward, 1 << 20, 1 << 12, 10), "2^31"));
  Problem s = problem(Pass::backward, 4, 64, 10);
  s.dw_slab_rows = 40;
  EXPECT_TRUE(refuses(s, "dw_slab_rows"));
  s.dw_slab_rows = 0;
  s.round_blocks = -1;
  EXPECT_TRUE(refuses(s, "round_blocks"));
}
