// The cost model of the Metal launch plan (csrc/metal/cost.h) against closed
// forms written here from the kernels' loops: GEMM flops of every pass equal
// 2 x rows x vocabulary x H per GEMM (rounds and chunks add nothing), the
// plain forward's bytes are h's and W's tiles once per (m tile, block), the
// partials add 8 x BM x H bytes per (m tile, block), the roofline picks the
// larger of its two terms, and MLX's qmm_t model counts its own tiles.
#include <gtest/gtest.h>

#include <cmath>

#include "metal/cost.h"

using namespace flash_cce::metal;

namespace {

Problem e4b(Pass pass, int64_t M, bool fused = false) {
  Problem p;
  p.pass = pass;
  p.M = M;
  p.H = 2560;
  p.V = 262144;
  p.h = DType::bf16;
  p.quantized = true;
  p.bits = 4;
  p.group_size = 64;
  p.sb = DType::bf16;
  p.fused = fused;
  return p;
}

// A dense float32 head's backward with dW.
Problem dense_dw(int64_t M, int64_t H, int64_t V) {
  Problem p;
  p.pass = Pass::backward;
  p.M = M;
  p.H = H;
  p.V = V;
  p.compute_dw = true;
  return p;
}

double sum_flops(const std::vector<LaunchCost>& c) {
  double f = 0;
  for (const auto& x : c) f += x.flops;
  return f;
}

bool near(double a, double b) {
  return std::abs(a - b) <= 1e-9 * std::max(std::abs(a), std::abs(b));
}

} // namespace

TEST(MetalCost, GemmFlopsOfEveryPass) {
  for (int64_t M : {1, 33, 512, 8192})
    for (int kind = 0; kind < 3; ++kind) {
      Problem p = e4b(kind == 2 ? Pass::backward : Pass::forward, M, kind == 1);
      const auto c = plan_cost(p, make_plan(p));
      const double rows = double((M + 31) / 32 * 32), vocab = double((p.V + 31) / 32 * 32);
      const double gemms = kind == 0 ? 1 : 2;
      ASSERT_TRUE(near(sum_flops(c), 2 * gemms * rows * vocab * 2560)) << M << " " << kind;
    }
  // dW of a dense head: two GEMMs over every (vocabulary row, token).
  Problem d = dense_dw(100, 70, 1000);
  d.round_m_tiles = 1;
  const Plan plan = make_plan(d);
  const auto c = plan_cost(d, plan);
  double dw = 0;
  for (size_t i = 0; i < c.size(); ++i)
    if (std::string(plan.launches[i].kernel).rfind("fcce_dw", 0) == 0) dw += c[i].flops;
  ASSERT_TRUE(near(dw, 2 * 2 * 128.0 * 1024 * 96));
}

TEST(MetalCost, BytesOfTheHeadPasses) {
  const int64_t M = 512, mt = 16, blocks = 8192;
  const double h_tile = 32.0 * 2560 * 2, w_tile = 32 * (2560 * 0.5 + 40 * 2 * 2.0);
  const double part = 32.0 * 2560 * 4;
  Problem f = e4b(Pass::forward, M);
  const auto fc = plan_cost(f, make_plan(f));
  double read = 0, written = 0;
  for (const auto& x : fc)
    if (x.flops > 0) read += x.bytes_read, written += x.bytes_written;
  // Tiles once per (m tile, block), plus per-row statistics (a few bytes a row).
  const double tiles = mt * blocks * (h_tile + w_tile);
  ASSERT_GE(read, tiles);
  ASSERT_LT(read - tiles, 1e-3 * tiles);
  ASSERT_LT(written, 1e-3 * tiles);
  // The grouped dh kernel adds W's tiles again and the partials: read (but on
  // a split's first group) and written once per group of FCCE_GROUP_BLOCKS
  // blocks of a launch.
  Problem b = e4b(Pass::backward, M);
  b.acc_registers = -1; // the grouped kernel (the plan's dh: DhRegistersAtE4b)
  const Plan bp = make_plan(b);
  const auto bc = plan_cost(b, bp);
  read = written = 0;
  for (const auto& x : bc)
    if (x.flops > 0) read += x.bytes_read, written += x.bytes_written;
  const double splits = bp.launches[0].params.splits;
  double groups = 0; // per m tile and split, over the launches (rounds)
  for (const auto& l : bp.launches)
    if (l.params.block_count > 0 && std::string(l.kernel).rfind("fcce_dh_", 0) == 0)
      groups += double((l.params.block_count + FCCE_GROUP_BLOCKS - 1) / FCCE_GROUP_BLOCKS) *
          l.grid[0] * l.grid[1] / (mt * splits);
  ASSERT_GE(groups, blocks / FCCE_GROUP_BLOCKS / splits);
  const double expect = mt * blocks * (h_tile + 2 * w_tile) + mt * splits * (groups - 1) * part;
  ASSERT_GE(read, expect);
  ASSERT_LT(read - expect, 1e-3 * expect);
  ASSERT_TRUE(near(written, mt * splits * groups * part));
}

// The plan's dh at e4b (the accumulator in registers, 10 chunks of H): two
// GEMMs per block, h's tile and W's twice per (m tile, block), the staged dS
// tile (4.1 KB) written once and read by 9 later chunks, and the float32 partial
// written once per launch (read once by each resuming launch), not once per
// group of blocks.
TEST(MetalCost, DhRegistersAtE4b) {
  const int64_t M = 512, mt = 16, blocks = 8192, chunks = 10;
  const double h_tile = 32.0 * 2560 * 2, w_tile = 32 * (2560 * 0.5 + 40 * 2 * 2.0);
  const double part = 32.0 * 2560 * 4, ds = (32.0 * 32 + 32) * 4;
  Problem b = e4b(Pass::backward, M);
  const Plan bp = make_plan(b);
  const auto bc = plan_cost(b, bp);
  double read = 0, written = 0, flops = 0, parts = 0, resumed = 0;
  for (size_t i = 0; i < bc.size(); ++i) {
    if (bc[i].flops == 0) continue;
    const Launch& l = bp.launches[i];
    ASSERT_EQ(std::string(l.kernel), "fcce_dhreg_hbf16_q4_g64");
    read += bc[i].bytes_read, written += bc[i].bytes_written, flops += bc[i].flops;
    parts += double(l.grid[0]) * l.grid[1];
    resumed += l.params.block_begin > 0 ? double(l.grid[0]) * l.grid[1] : 0.0;
  }
  ASSERT_TRUE(near(flops, 2.0 * 2 * 512 * 262144 * 2560));
  ASSERT_TRUE(near(written, parts * part + mt * blocks * ds));
  const double expect = mt * blocks * (h_tile + 2 * w_tile + (chunks - 1) * ds) + resumed * part;
  ASSERT_GE(read, expect);
  ASSERT_LT(read - expect, 1e-3 * expect);
}

TEST(MetalCost, RooflineAndLaunchFields) {
  const AppleGpu& m1 = *find_apple_gpu("Apple M1");
  ASSERT_EQ(find_apple_gpu("Apple M9"), nullptr);
  LaunchCost c;
  c.flops = 1e12;
  c.bytes_read = 1e9;
  ASSERT_TRUE(near(estimate_seconds(c, m1),
                   1e12 / (m1.fp32_flops * kGemmEfficiency) + kLaunchSeconds));
  c.bytes_written = 1e12;
  ASSERT_TRUE(near(estimate_seconds(c, m1),
                   1.001e12 / (m1.bandwidth * kMemoryEfficiency) + kLaunchSeconds));
  Problem p = e4b(Pass::forward, 40);
  const Plan plan = make_plan(p);
  const auto costs = plan_cost(p, plan);
  ASSERT_EQ(costs.size(), plan.launches.size());
  for (size_t i = 0; i < costs.size(); ++i) {
    const Launch& l = plan.launches[i];
    ASSERT_EQ(costs[i].kernel, std::string(l.kernel));
    ASSERT_EQ(costs[i].threads, int64_t(l.grid[0]) * l.grid[1] * l.threads[0]);
    ASSERT_LE(costs[i].threadgroup_bytes, 32768u);
  }
  // bfloat16 h and scales: bfloat16 tiles (h and w 2,560 bytes each, not 4,608).
  ASSERT_EQ(costs[0].threadgroup_bytes, head_threadgroup_bytes(DType::bf16));
  ASSERT_EQ(head_threadgroup_bytes(DType::f32) - head_threadgroup_bytes(DType::bf16),
            size_t(2 * (4608 - 2560)));
  const PassCost t = pass_cost(costs, m1);
  ASSERT_EQ(t.launches, costs.size());
  ASSERT_GE(t.seconds, t.longest_seconds);
}

TEST(MetalCost, MlxQuantizedMatmul) {
  const LaunchCost q = mlx_qmm_cost(512, 262144, 2560, 2, 4, 64, 2);
  const double tiles = 16.0 * 8192;
  ASSERT_TRUE(near(q.flops, 2.0 * 512 * 262144 * 2560));
  ASSERT_TRUE(near(q.bytes_read, tiles * 32 * (2560 * 2 + 2560 * 0.5 + 40 * 4)));
  ASSERT_TRUE(near(q.bytes_written, 512.0 * 262144 * 2));
  ASSERT_EQ(q.threadgroup_bytes, 5120u); // MLX's 32 x 32 bf16 qmm_t tiles
}

TEST(MetalCost, DwRowsOncePerGroupOfMTiles) {
  // Nine m tiles in one launch: the float32 dW rows are written once per group
  // of FCCE_GROUP_BLOCKS m tiles (3 groups) and read by all but the first.
  Problem p = dense_dw(280, 64, 100);
  p.acc_registers = -1; // the grouped kernel
  const Plan plan = make_plan(p);
  const auto c = plan_cost(p, plan);
  double read = 0, written = 0;
  for (size_t i = 0; i < c.size(); ++i)
    if (std::string(plan.launches[i].kernel).rfind("fcce_dw_", 0) == 0)
      read += c[i].bytes_read, written += c[i].bytes_written;
  const double tgs = 4, rows = 32.0 * 64 * 4, groups = (9 + FCCE_GROUP_BLOCKS - 1) / FCCE_GROUP_BLOCKS;
  ASSERT_TRUE(near(written, tgs * groups * rows));
  const double tiles = tgs * 9 * (2 * 32.0 * 64 * 4 + 32.0 * 64 * 4 + 32 * 16);
  ASSERT_TRUE(near(read, tiles + tgs * (groups - 1) * rows));
}

TEST(MetalCost, DwRowsOncePerLaunchInRegisters) {
  // dW's register kernel at H = 300 (two chunks): nine m tiles in launches of
  // four; per (threadgroup, m tile) h's tile twice and W's rows once, the dS
  // tile (4 KB) written once and read by the second chunk; the float32 rows
  // written once per launch and read by the launches that continue them.
  Problem p = dense_dw(280, 300, 100);
  p.round_m_tiles = 4;
  const Plan plan = make_plan(p);
  const auto c = plan_cost(p, plan);
  double read = 0, written = 0, launches = 0;
  for (size_t i = 0; i < c.size(); ++i)
    if (std::string(plan.launches[i].kernel).rfind("fcce_dwreg_", 0) == 0)
      read += c[i].bytes_read, written += c[i].bytes_written, ++launches;
  ASSERT_EQ(launches, 3);
  const double tgs = 4, rows = 32.0 * 300 * 4, ds = 32.0 * 32 * 4;
  ASSERT_TRUE(near(written, tgs * (3 * rows + 9 * ds)));
  const double tiles = tgs * 9 * (2 * 32.0 * 300 * 4 + 32.0 * 300 * 4 + 32 * 16 + ds);
  ASSERT_TRUE(near(read, tiles + tgs * 2 * rows));
}
