// Launch planning of the CUDA head: plain host functions of the tuning, the
// device's attributes and the problem's shape, shared by cuda_head.cpp and the
// host tests (tests/cpp/test_plan.cpp).
#pragma once

#include <algorithm>
#include <cstdint>

#include "../tuning.h"

namespace flash_cce::cuda {

// What the planning asks of the GPU (cuDeviceGetAttribute).
struct DeviceInfo {
  int sms = 0;          // multiprocessors
  int64_t l2_bytes = 0; // L2 cache size
};

// The sizes a launch runs with, every one resolved.
struct LaunchPlan {
  int sms = 0;             // grid of the persistent kernels
  int64_t row_block = 0;   // rows per block of the chunked passes
  int64_t chunk_bytes = 0; // the [rows, chunk] 16-bit dS / P buffer's budget
  bool chunk_set = false;  // chunk_bytes came from the tuning
  int64_t vocab_chunk = 0; // upper bound on a chunk's width (0: none)
  int64_t fwd_l2_bytes = 0;
  int dh_splits = 0;
};

// Narrowest vocabulary chunk of the dW path (see vocab_chunk).
constexpr int64_t kDwChunkCols = 3072;

inline int64_t cdiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// The one heuristic: tuning fields left at 0 take these defaults.
// - row_block 4096: the fp32 [rows, H] accumulator is read and written once per
//   vocabulary chunk and a chunk holds chunk_bytes / (2 rows) columns, so that
//   traffic grows with rows^2; blocks of at most 4096 rows keep it linear in M.
// - the dS / P buffer stays under chunk_mb (48 MB); vocab_chunk only narrows chunks.
// - fwd_l2: the rows of h that a forward group re-reads for every vocabulary
//   tile must stay in L2 beside the W tiles that the splits stream: 16/50 of
//   it (16 MB of an H100's or H200's 50).
// - dh_splits 4: a tile of the last round splits into at most 4 pieces.
inline LaunchPlan plan_launch(const HeadTuning& t, const DeviceInfo& d) {
  LaunchPlan p;
  p.sms = std::max(d.sms, 1);
  p.row_block = t.row_block > 0 ? t.row_block : 4096;
  p.chunk_bytes = (t.chunk_mb > 0 ? t.chunk_mb : 48) << 20;
  p.chunk_set = t.chunk_mb > 0;
  p.vocab_chunk = t.vocab_chunk;
  p.fwd_l2_bytes = t.fwd_l2_mb > 0 ? t.fwd_l2_mb << 20
                                   : std::max<int64_t>(d.l2_bytes * 16 / 50, int64_t(1) << 20);
  p.dh_splits = t.dh_splits > 0 ? static_cast<int>(t.dh_splits) : 4;
  return p;
}

// Vocabulary splits of the forward: enough blocks for ~8 waves of one block
// per multiprocessor, while the [splits, M] partials stay under 32 MB.
inline int forward_splits(const LaunchPlan& plan, int64_t M, int64_t v_tiles, int64_t m_tiles) {
  const int64_t want = cdiv(int64_t(plan.sms) * 8, m_tiles);
  const int64_t cap = std::max<int64_t>(1, (int64_t(4) << 20) / M);
  return static_cast<int>(std::clamp<int64_t>(std::min(want, cap), 1, v_tiles));
}

// m tiles a forward group keeps in flight: their rows of h (tile_rows x H of
// elt bytes each) fit the L2 budget; each group reads all of W once.
inline int forward_group(const LaunchPlan& plan, int64_t m_tiles, int64_t tile_rows, int64_t H,
                         int64_t elt) {
  const int64_t fit = plan.fwd_l2_bytes / (tile_rows * H * elt);
  return static_cast<int>(std::clamp<int64_t>(fit, 1, m_tiles));
}

// Rows of one block of the chunked passes.
inline int64_t row_block(const LaunchPlan& plan, int64_t M) {
  return std::min(M, plan.row_block);
}

// Width of the vocabulary chunk for blocks of M rows: a multiple of `tile`
// (a multiple of every kernel's vocabulary tile), at least one tile, at most V
// rounded up to tiles.
// With `dw` (one block of every row, the dW GEMM's K) the chunk is at least
// dw_chunk_cols wide unless chunk_mb was set: a narrow chunk leaves the dW GEMM
// a few output tiles per multiprocessor and moves the fp32 [M, H] dh
// accumulator once per chunk.
inline int64_t vocab_chunk(const LaunchPlan& plan, int64_t M, int64_t V, int64_t tile,
                           bool dw = false) {
  int64_t cols = plan.chunk_bytes / (2 * M);
  if (dw && !plan.chunk_set) {
    cols = std::max(cols, kDwChunkCols);
  }
  if (plan.vocab_chunk > 0) {
    cols = std::min(cols, plan.vocab_chunk);
  }
  return std::clamp<int64_t>(cols / tile * tile, tile, cdiv(V, tile) * tile);
}

// Bytes fcce_take_rows copies at a time: the widest of 16, 4 and 2 that
// divides the row's byte width and both addresses (table and output), else 1.
inline int32_t rows_copy_unit(int64_t row_bytes, uintptr_t table, uintptr_t out) {
  for (int32_t unit : {16, 4, 2}) {
    if (row_bytes % unit == 0 && (table | out) % unit == 0) {
      return unit;
    }
  }
  return 1;
}

} // namespace flash_cce::cuda
