#include "cost.h"

#include <algorithm>

namespace flash_cce::metal {

namespace {

int64_t cdiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

int dtype_bytes(DType t) {
  return t == DType::f32 ? 4 : 2;
}

bool starts_with(const std::string& s, const char* prefix) {
  return s.rfind(prefix, 0) == 0;
}

// Device bytes of one row of W over H: dense in its dtype, or packed values
// plus one scale and one bias per group, read in the tile type (plan.h's
// tile_dtype: the plan widens scales of another dtype first).
double w_row_bytes(const Problem& p) {
  if (!p.quantized) {
    return double(p.H) * dtype_bytes(p.w);
  }
  return double(p.H) * p.bits / 8.0 + double(p.H / p.group_size) * 2 * dtype_bytes(tile_dtype(p));
}

// Device bytes of one row of h as the head kernels read it: a quantized
// head's in the tile type (widened first where h's dtype is not).
double h_row_bytes(const Problem& p) {
  return double(p.H) * dtype_bytes(p.quantized ? tile_dtype(p) : p.h);
}

// Per row of the launch's threadgroups: targets and the backward's lse, g,
// g_lse (with the entropy also entropy and g_ent), or the forward's statistics
// (max and sum, with the entropy also r, the logit sum and the arg-max: read
// when resuming, written at the end).
void add_row_bytes(const FcceParams& q, bool stats, double rows, LaunchCost& c) {
  const double ent = stats ? (q.mode == FCCE_MODE_DH ? 2 : 3) : 0;
  if (q.mode == FCCE_MODE_DH) {
    c.bytes_read += rows * 4 * (4 + ent);
  } else {
    c.bytes_read += rows * 4 * (q.block_begin > 0 ? 3 + ent : 1);
    c.bytes_written += rows * 4 * (2 + ent);
  }
}

// The head kernel (metal/head.h, head_tiles): per (threadgroup, block) the
// logits tile loads h's [BM, H] rows and W's [BN, H] rows; the fused forward
// and dh modes load W's rows again (accumulate_cw) and, once per group of
// FCCE_GROUP_BLOCKS blocks, read (except on a split's first group) and write
// the float32 [BM, H] partial.
void head_cost(const Problem& p, const Launch& l, LaunchCost& c) {
  const FcceParams& q = l.params;
  const int64_t total_blocks = cdiv(p.V, FCCE_BN);
  const int64_t hk = cdiv(p.H, FCCE_BK) * FCCE_BK;
  const bool acc = q.mode != FCCE_MODE_FWD;
  // Per m tile, over the launch's splits: blocks, groups of blocks, and
  // groups that start a split (no partial to read).
  int64_t tile_blocks = 0, tile_groups = 0, first_groups = 0;
  for (int64_t s = q.split_begin; s < q.split_begin + int64_t(l.grid[1]); ++s) {
    const int64_t in_split = std::min<int64_t>(q.blocks_per_split, total_blocks - s * q.blocks_per_split);
    const int64_t n = std::clamp<int64_t>(in_split - q.block_begin, 0, q.block_count);
    tile_blocks += n;
    tile_groups += cdiv(n, FCCE_GROUP_BLOCKS);
    first_groups += (q.block_begin == 0 && n > 0) ? 1 : 0;
  }
  const double m_tiles = l.grid[0];
  const double blocks = m_tiles * double(tile_blocks);
  const double h_tile = double(FCCE_BM) * h_row_bytes(p);
  const double w_tile = double(FCCE_BN) * w_row_bytes(p);
  const double part_tile = double(FCCE_BM) * p.H * 4;
  c.flops = blocks * 2.0 * (acc ? 2 : 1) * FCCE_BM * FCCE_BN * double(hk);
  c.bytes_read = blocks * (h_tile + w_tile * (acc ? 2 : 1));
  if (acc) {
    c.bytes_read += m_tiles * double(tile_groups - first_groups) * part_tile;
    c.bytes_written += m_tiles * double(tile_groups) * part_tile;
  }
  add_row_bytes(q, p.stats, double(c.threadgroups) * FCCE_BM, c);
}

// The kernels with the accumulator in registers (metal/regs.h): per
// (threadgroup, block) the logits load h's [BM, H] rows and W's [BN, H] rows
// once, the accumulation W's rows once more (over all chunks of H), and with
// more than one chunk the block's staged coefficients (FCCE_STAGE_FLOATS) are
// written once and read by each later chunk; the float32 [BM, H] partial is
// written once per launch and read once when the launch resumes its splits
// (block_begin > 0); per row the dh pass reads targets, lse, g and g_lse, the
// fused forward targets (and its statistics when resuming) and writes them.
void regs_cost(const Problem& p, const Launch& l, LaunchCost& c) {
  const FcceParams& q = l.params;
  const int64_t total_blocks = cdiv(p.V, FCCE_BN);
  const int64_t hk = cdiv(p.H, FCCE_BK) * FCCE_BK;
  const double chunks = double(register_chunks(p.H));
  int64_t tile_blocks = 0;
  for (int64_t s = q.split_begin; s < q.split_begin + int64_t(l.grid[1]); ++s) {
    const int64_t in_split = std::min<int64_t>(q.blocks_per_split, total_blocks - s * q.blocks_per_split);
    tile_blocks += std::clamp<int64_t>(in_split - q.block_begin, 0, q.block_count);
  }
  const double blocks = double(l.grid[0]) * double(tile_blocks);
  const double h_tile = double(FCCE_BM) * h_row_bytes(p);
  const double w_tile = double(FCCE_BN) * w_row_bytes(p);
  const double staged = chunks > 1 ? double(FCCE_STAGE_FLOATS) * 4 : 0.0;
  const double rows = double(c.threadgroups) * FCCE_BM;
  const double part = rows * p.H * 4;
  c.flops = blocks * 2.0 * 2 * FCCE_BM * FCCE_BN * double(hk);
  c.bytes_read = blocks * (h_tile + 2 * w_tile + (chunks - 1) * staged) +
      (q.block_begin > 0 ? part : 0.0);
  c.bytes_written = blocks * staged + part;
  add_row_bytes(q, p.stats, rows, c);
}

// dW (metal/dw.h): per (threadgroup, m tile) the logits (h and W rows) and
// h's rows again for dS^T h; per group of FCCE_GROUP_BLOCKS m tiles the
// float32 [BN, H] rows read (but for the group at m tile 0) and written.
void dw_cost(const Problem& p, const Launch& l, LaunchCost& c) {
  const FcceParams& q = l.params;
  const int64_t m_tiles = cdiv(p.M, FCCE_BM);
  const int64_t walked = std::clamp<int64_t>(m_tiles - q.m_tile_begin, 0, q.m_tile_count);
  const int64_t hk = cdiv(p.H, FCCE_BK) * FCCE_BK;
  const double n = double(l.grid[0]) * walked;
  const double h_tile = double(FCCE_BM) * h_row_bytes(p);
  const double w_tile = double(FCCE_BN) * w_row_bytes(p);
  const double acc_tile = double(FCCE_BN) * p.H * 4;
  c.flops = n * 2.0 * 2 * FCCE_BM * FCCE_BN * double(hk);
  const double groups = double(l.grid[0]) * cdiv(walked, FCCE_GROUP_BLOCKS);
  const double first = q.m_tile_begin == 0 && walked > 0 ? double(l.grid[0]) : 0.0;
  // Per m tile its rows' targets, lse, g, g_lse (and entropy, g_ent).
  const double row_floats = p.stats ? 6 : 4;
  c.bytes_read = n * (2 * h_tile + w_tile + row_floats * FCCE_BM * 4) + (groups - first) * acc_tile;
  c.bytes_written = groups * acc_tile;
}

// dW with its accumulator in registers (metal/dw.h, dw_regs_tiles): per
// (threadgroup, m tile) as dw_cost, plus with more than one chunk of H the
// m tile's staged dS tile written once and read by each later chunk; the
// float32 [BN, H] rows written once per launch and read once when the launch
// continues them (m_tile_begin > 0).
void dw_regs_cost(const Problem& p, const Launch& l, LaunchCost& c) {
  const FcceParams& q = l.params;
  const int64_t m_tiles = cdiv(p.M, FCCE_BM);
  const int64_t walked = std::clamp<int64_t>(m_tiles - q.m_tile_begin, 0, q.m_tile_count);
  const int64_t hk = cdiv(p.H, FCCE_BK) * FCCE_BK;
  const double chunks = double(register_chunks(p.H));
  const double n = double(l.grid[0]) * walked;
  const double h_tile = double(FCCE_BM) * h_row_bytes(p);
  const double w_tile = double(FCCE_BN) * w_row_bytes(p);
  const double rows = double(l.grid[0]) * FCCE_BN * p.H * 4;
  const double staged = chunks > 1 ? double(FCCE_BM) * FCCE_BN * 4 : 0.0;
  c.flops = n * 2.0 * 2 * FCCE_BM * FCCE_BN * double(hk);
  c.bytes_read = n * (2 * h_tile + w_tile + 4.0 * FCCE_BM * 4 + (chunks - 1) * staged) +
      (q.m_tile_begin > 0 ? rows : 0.0);
  c.bytes_written = n * staged + rows;
}

// The element-wise kernels (metal/rows.h), per element as their loops read.
void elementwise_cost(const Problem& p, const Launch& l, LaunchCost& c) {
  const std::string k = l.kernel;
  const FcceParams& q = l.params;
  const double n = q.count, splits = q.splits;
  if (k == "fcce_combine") {
    c.bytes_read = n * (splits * 8 + 8);
    c.bytes_written = n * 8;
  } else if (k == "fcce_combine_ent") {
    // Five [splits, M] statistics, the target and its logit; logp, lse,
    // entropy, mean logit and the is_top1 byte.
    c.bytes_read = n * (splits * 20 + 8);
    c.bytes_written = n * 17;
  } else if (starts_with(k, "fcce_reduce_dh_")) {
    c.bytes_read = n * splits * 4;
    c.bytes_written = n * dtype_bytes(p.h);
  } else if (k == "fcce_reduce_gsum") {
    c.bytes_read = n * (splits * 8 + 4);
    c.bytes_written = n * 4;
  } else if (starts_with(k, "fcce_widen_")) {
    c.bytes_read = n * 2;
    c.bytes_written = n * 4;
  } else if (starts_with(k, "fcce_cast_")) {
    c.bytes_read = n * 4;
    c.bytes_written = n * dtype_bytes(p.w);
  } else if (starts_with(k, "fcce_fused_dh_")) {
    // gsum, the element of W_y (2 bytes and a scale and bias when quantized),
    // and the row's target, logp, lse, g, g_lse.
    const double w = p.quantized ? 2 + 2 * dtype_bytes(p.sb) : dtype_bytes(p.w);
    c.bytes_read = n * (4 + w + 20);
    c.bytes_written = n * dtype_bytes(p.out);
  }
}

} // namespace

const std::vector<AppleGpu>& apple_gpus() {
  // FP32 = cores x 128 ALUs x 2 flops x GPU clock; FP16 runs at the FP32 rate
  // on these GPUs. Bandwidths as Apple publishes them (M1: its LPDDR4X-4266 on
  // a 128-bit bus). Each figure's source: docs/metal.md, "Cost model".
  static const std::vector<AppleGpu> gpus = {
      {"Apple M1", 8, 2.617e12, 2.617e12, 68.25e9},
      {"Apple M1 Max", 32, 10.62e12, 10.62e12, 400e9},
      {"Apple M2", 10, 3.579e12, 3.579e12, 100e9},
      {"Apple M3 Pro", 18, 6.441e12, 6.441e12, 150e9},
      {"Apple M4 Max", 40, 17.18e12, 17.18e12, 546e9},
  };
  return gpus;
}

const AppleGpu* find_apple_gpu(const std::string& device_name) {
  for (const auto& g : apple_gpus()) {
    if (device_name == g.name) {
      return &g;
    }
  }
  return nullptr;
}

std::vector<LaunchCost> plan_cost(const Problem& p, const Plan& plan) {
  std::vector<LaunchCost> out;
  for (const auto& l : plan.launches) {
    LaunchCost c;
    c.kernel = l.kernel;
    c.threadgroups = int64_t(l.grid[0]) * l.grid[1] * l.grid[2];
    c.threads = c.threadgroups * int64_t(l.threads[0]) * l.threads[1] * l.threads[2];
    c.threadgroup_bytes = l.threadgroup_bytes;
    const DType tile = tile_dtype(p);
    const bool gemm = starts_with(c.kernel, "fcce_dw") || starts_with(c.kernel, "fcce_dhreg_") ||
        starts_with(c.kernel, "fcce_fwdreg_") || starts_with(c.kernel, "fcce_fwd_") ||
        starts_with(c.kernel, "fcce_dh_");
    c.half_operands = gemm && tile != DType::f32;
    if (starts_with(c.kernel, "fcce_dwreg_")) {
      c.threadgroup_bytes += regs_threadgroup_bytes(tile);
      dw_regs_cost(p, l, c);
    } else if (starts_with(c.kernel, "fcce_dw_")) {
      c.threadgroup_bytes += dw_threadgroup_bytes(tile);
      dw_cost(p, l, c);
    } else if (starts_with(c.kernel, "fcce_dhreg_") || starts_with(c.kernel, "fcce_fwdreg_")) {
      c.threadgroup_bytes += regs_threadgroup_bytes(tile);
      regs_cost(p, l, c);
    } else if (starts_with(c.kernel, "fcce_fwd_") || starts_with(c.kernel, "fcce_dh_")) {
      c.threadgroup_bytes += head_threadgroup_bytes(tile);
      head_cost(p, l, c);
    } else {
      elementwise_cost(p, l, c);
    }
    out.push_back(c);
  }
  return out;
}

double estimate_seconds(const LaunchCost& c, const AppleGpu& gpu) {
  const double rate = (c.half_operands ? gpu.fp16_flops : gpu.fp32_flops) * kGemmEfficiency;
  const double compute = c.flops / rate;
  const double memory = (c.bytes_read + c.bytes_written) / (gpu.bandwidth * kMemoryEfficiency);
  return std::max(compute, memory) + kLaunchSeconds;
}

LaunchCost mlx_qmm_cost(int64_t M, int64_t N, int64_t K, int x_bytes, int bits,
                        int group_size, int sb_bytes) {
  LaunchCost c;
  c.kernel = "mlx_qmm_t";
  const int64_t tiles = cdiv(M, 32) * cdiv(N, 32);
  c.threadgroups = tiles;
  c.threads = tiles * 128;
  // Xs and Ws tiles of [32, 32 + 16 / x_bytes] in x's dtype.
  c.threadgroup_bytes = size_t(2 * 32 * (32 + 16 / x_bytes) * x_bytes);
  c.half_operands = x_bytes == 2;
  const double w_row = double(K) * bits / 8.0 + double(K / group_size) * 2 * sb_bytes;
  c.flops = double(tiles) * 2.0 * 32 * 32 * double(cdiv(K, 32) * 32);
  c.bytes_read = double(tiles) * 32 * (double(K) * x_bytes + w_row);
  c.bytes_written = double(M) * double(N) * x_bytes;
  return c;
}

PassCost pass_cost(const std::vector<LaunchCost>& launches, const AppleGpu& gpu) {
  PassCost t;
  for (const auto& c : launches) {
    const double s = estimate_seconds(c, gpu);
    t.flops += c.flops;
    t.bytes_read += c.bytes_read;
    t.bytes_written += c.bytes_written;
    t.seconds += s;
    t.longest_seconds = std::max(t.longest_seconds, s);
    ++t.launches;
  }
  return t;
}

} // namespace flash_cce::metal
