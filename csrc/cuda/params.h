// Kernel parameter blocks shared by the host code and the CUDA kernels. Plain
// structs passed by value, so both compilers must agree on their layout.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "raster.h"

namespace flash_cce::cuda {

// How a loader reads an operand: straight copies of the compute type, a
// conversion from another float type, or MLX affine dequantization.
enum SrcKind : int32_t { kNative = 0, kF32 = 1, kBF16 = 2, kF16 = 3, kQuant = 4 };

// A row-major matrix read tile by tile; element (r, c) of the view is
// ptr[(row0 + r) * ld + col0 + c]. Reads at or past (rows, cols) give zero.
struct Operand {
  const void* ptr;
  int64_t ld;
  int64_t row0, col0;
  int64_t rows, cols; // absolute bounds
  int32_t kind;
  int32_t vec_ok; // 8-element chunks may be read as aligned vectors
  // Quantized only: [rows, cols / group_size] scales and biases.
  const void* scales;
  const void* biases;
  int32_t sb_kind; // kF32, kBF16 or kF16
  int32_t group_size;
  int32_t bits;
  int32_t pad_;
};

struct FwdParams {
  Operand h, w;
  const int32_t* targets;
  float* part_max; // [splits, M]
  float* part_sum; // [splits, M]
  float* target_logit; // [M]; null: the targets come from a gather pass
  // The entropy statistics' partials ([splits, M] each; fwd_ent kernels only):
  // sum of e^(s - max) (s - max), sum of s, and the first arg-max.
  float* part_r;
  float* part_tot;
  int32_t* part_arg;
  int64_t M, V, H;
  int32_t m_tiles, v_tiles, splits, tiles_per_split;
  float cap;
  int32_t m_group; // m tiles in flight together (see fwd_block)
};

// With entropy set (the fwd_ent partials part_r, part_tot, part_arg) also the
// entropy, whether the target is the first arg-max, and the mean logit.
struct CombineParams {
  const float* part_max;
  const float* part_sum;
  const float* target_logit;
  const float* part_r;
  const float* part_tot;
  const int32_t* part_arg;
  const int32_t* targets;
  float* logp;
  float* lse;
  float* entropy;
  bool* top1;
  float* mean;
  int64_t M, V;
  int32_t splits, ignore_index;
};

// dS for the vocabulary chunk [v0, v0 + width): written to ds[M, ld_ds] in the
// compute type. With part_sum set (the fused forward) the kernel writes
// P = exp(s - r) dcap instead, with the row reference r = ref[m] (cap when ref
// is null), the per-tile row sums of exp(s - r) to part_sum[tile, M], the
// target logits (unless target_logit is null: a gather pass has them, as it
// always has for the 4/8-bit kernel), and with part_max set the per-tile row
// maxima of s (flag = 1 where one exceeds r by more than gap); lse, g and
// g_lse are unused.
// The ds_ent kernels add the entropy's share of dS, -g_ent p (s - (lse - entropy)) dcap.
// A kernel whose guard is set and reads 0 does nothing.
struct DsParams {
  Operand h, w;
  const int32_t* targets;
  const float* lse;
  const float* g;
  const float* g_lse;
  const float* entropy;
  const float* g_ent;
  void* ds;
  float* part_sum;
  float* target_logit;
  const float* ref;
  float* part_max;
  int32_t* flag;
  const int32_t* guard;
  int64_t M, V, H, v0, width, ld_ds;
  int32_t m_tiles, ignore_index;
  float cap;
  float gap; // the fused forward's largest s - r that P holds
};

// Softcaps up to this use the cap as the fixed row reference: the weights
// exp(s - cap) then span [e^-2cap, 1], normal floats in bf16 and fp32.
constexpr float kMaxFixedCap = 40.0f;

// exp(s - r) stays below e^64 in P (bf16 holds up to ~e^88, and the fp32 sums
// over a chunk keep the headroom).
constexpr float kMaxRefGap = 64.0f;

// The same for fp16 P, whose largest value is 65504 (e^11.09): e^11 = 59874.
constexpr float kMaxRefGapF16 = 11.0f;

// The running reference moves up only when a chunk's row maximum passes it by
// more than this (the weights then stay below e^16): a row whose reference
// stays needs no rescaling, and its dh update is a plain addition.
constexpr float kRefStep = 16.0f;

// dh (+)= dS @ W[v0 : v0 + width]; fp32 accumulation in acc, the last chunk
// writes out in out_kind. With part_sum set (the fused forward), the blocks of
// the first column tile also add the chunk's sum_tiles row sums to run_sum
// (first: assign). With ref_prev set, acc and run_sum were relative to
// ref_prev and are rescaled to ref_cur before adding; with part_max set those
// blocks also write ref_next = max(ref_cur, the chunk's row maxima).
struct DhParams {
  Operand ds, w;
  float* acc; // [M, H]
  void* out; // [M, H]
  const float* part_sum; // [sum_tiles, M]
  float* run_sum; // [M]
  const float* ref_prev;
  const float* ref_cur;
  float* ref_next;
  const float* part_max; // [sum_tiles, M]
  const int32_t* guard;
  int64_t M, H;
  int32_t m_tiles, out_kind, first, last;
  int32_t sum_tiles, pad_;
};

// The Hopper kernels' target logits (fcce_target_*, gather_targets): h rows of
// T, W of T or 4/8-bit.
struct TargetParams {
  Operand h, w;
  const int32_t* targets;
  float* target_logit;
  int64_t M, V, H;
  float cap;
  int32_t pad_;
};

// End of the fused forward: lse = r + log(run_sum), logp, and the gradient
// state gsum[M, H] rescaled from exp(s - r) to softmax weights; r = cap when
// ref is null, else ref[m], or ref_exact[m] when there is a flag and it is
// set (the pass was redone against the exact row maxima).
struct FinishParams {
  const float* run_sum;
  const float* target_logit;
  const int32_t* targets;
  const float* ref;
  const float* ref_exact;
  const int32_t* flag;
  float* logp;
  float* lse;
  float* gsum;
  int64_t M, V, H;
  float cap;
  int32_t ignore_index;
};

// ref[m] = max over splits of part_max[split, m] (with raise: and of ref[m]
// itself); block 0 clears the flag when there is one. A launch whose guard is
// set and reads 0 does nothing.
struct RowMaxParams {
  const float* part_max;
  float* ref;
  int32_t* flag;
  const int32_t* guard;
  int64_t M;
  int32_t splits, raise;
};

// dW[v0 : v0 + width] = dS^T @ h, written in out_kind.
struct DwParams {
  Operand ds, h;
  void* out; // [V, H]
  int64_t M, H, v0, width;
  int32_t v_tiles, out_kind;
};

// dh = g dcap_y W_y + (g_lse - g) gsum, one block per row. w: the head, dense
// rows read as their own type (kNative only for fp32) or dequantized.
struct FusedDhParams {
  Operand w;
  const int32_t* targets;
  const float* gsum;
  const float* logp;
  const float* lse;
  const float* g;
  const float* g_lse;
  void* out;
  int64_t M, V, H;
  float cap;
  int32_t ignore_index, out_kind, pad_;
};

constexpr int kThreads = 256;
constexpr int kTileM = 128, kTileN = 128, kTileK = 32, kStages = 4;

// Dynamic shared memory of the GEMM kernels: the operand pipeline, each tile
// row padded by 8 elements against ldmatrix bank conflicts.
constexpr int kTileElems = 128 * (32 + 8) > 32 * (128 + 8) ? 128 * (32 + 8) : 32 * (128 + 8);
constexpr int kSmemBytes = kStages * 2 * kTileElems * 2;

// Hopper path (sm_90a) for the dense K-major GEMMs of fwd and ds: TMA loads of
// 128 x 64 tiles of h and 256 x 64 tiles of W (128-byte swizzle), wgmma
// m64n256k16 from two consumer warpgroups, one producer warpgroup.
constexpr int kWgThreads = 384;
constexpr int kWgTileM = 128, kWgTileN = 256, kWgTileK = 64, kWgStages = 4;
constexpr int kWgStageBytes = (kWgTileM + kWgTileN) * kWgTileK * 2;
// A 4-bit head's packed W tiles (8 KB a k-step) pass through a ring of their
// own, kWgQDepth k-steps ahead of the dequantizing producer.
constexpr int kWgQStageBytes = 8192, kWgQDepth = 3;
constexpr int kWgSmemBytes =
    kWgStages * kWgStageBytes + kWgQDepth * kWgQStageBytes + 1024; // + alignment slack

// Forward of a 4- or 8-bit head with W as the register operand (S^T = W h^T):
// 256 rows of h a block, tiles of 128 rows of W; a stage holds the h tile, the
// W tile's packed words (8 KB at 8 bits) and the k-step's scales and biases
// (16 bytes a row); then per-warp column statistics (8 x 256 float2).
constexpr int kRsTileM = 256, kRsTileV = 128;
constexpr int kRsStageBytes = kRsTileM * kWgTileK * 2 + kRsTileV * kWgTileK + 2 * kRsTileV * 16;
constexpr int kRsSmemBytes = kWgStages * kRsStageBytes + 8 * kRsTileM * 8 + 1024;
// Its dh GEMM (dh^T = W^T dS^T): 128 columns of h against 256 rows of dS a
// tile; a stage holds the dS tile, 64 rows x 128 columns of packed W and
// their scales and biases (up to 4 groups); after the stages, the rows'
// old-value scales by tile parity (2 x 256 floats) and two epilogue pieces of
// 32 x 64 floats per consumer warpgroup.
constexpr int kRsDhStageBytes = kRsTileM * kWgTileK * 2 + kWgTileK * kRsTileV + 1024;
constexpr int kRsDhSmemBytes =
    kWgStages * kRsDhStageBytes + 2 * kRsTileM * 4 + 4 * 32 * 64 * 4 + 1024;
// The fused forward's P kernel in that form: the forward's stages, then two
// per-warp column tables (8 x 256 float2 each).
constexpr int kRsPSmemBytes = kWgStages * kRsStageBytes + 2 * 8 * kRsTileM * 8 + 1024;

struct WgFwdParams {
  CUtensorMap h_map, w_map;
  FwdParams p;
};

struct WgDsParams {
  CUtensorMap h_map, w_map;
  DsParams p;
};

// Work units of a persistent dh kernel. One block per multiprocessor walks
// whole tiles, units [0, whole); when the tiles leave a last round that would
// keep few blocks busy, its `tail` tiles are split along K (the chunk) into
// `splits` pieces each, unit whole + s * tail + i being piece s of tile whole
// + i. The pieces of a tile add into the accumulator in order of s (the
// result does not depend on timing): piece s waits until flags[i] == s and
// sets it to s + 1, the last piece back to 0 for the next launch.
struct DhSplit {
  int32_t* flags; // [tail], zero before the first launch
  int32_t whole, tail, splits, pad_;
};

struct ZeroParams {
  int32_t* data;
  int32_t n, pad_;
};

// out[i] = table[ids[i]], a zero row for an id outside [0, rows); each row is
// row_bytes bytes, copied `unit` bytes at a time (16, 4, 2 or 1: what the row
// width and both addresses allow).
struct RowsParams {
  const void* table;
  const int32_t* ids;
  void* out;
  int64_t n, rows, row_bytes;
  int32_t unit, pad_;
};

// a_map: dS [M, width] in 64 x 128 boxes; b_map: W [V, H] in 64 x 64 boxes.
struct WgDhParams {
  CUtensorMap a_map, b_map;
  DhParams p;
  int64_t v0, width;
  DhSplit split;
};

// a_map: dS [M, width] and b_map: h [M, H], both in 64 x 64 boxes.
struct WgDwParams {
  CUtensorMap a_map, b_map;
  DwParams p;
};

} // namespace flash_cce::cuda
