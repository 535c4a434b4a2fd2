// The parameter block of every flash-CCE Metal kernel, shared by the Metal
// sources and the host (csrc/metal/plan.h). Plain 32-bit ints and floats only,
// so that MSL and C++ agree on its layout; it is passed with set_bytes.
#pragma once

// Tiles of the head kernels: BM rows of h by BN vocabulary rows, reduced over
// H in steps of BK; WM x WN SIMD groups of 32 threads.
#define FCCE_BM 32
#define FCCE_BN 32
#define FCCE_BK 32
#define FCCE_WM 2
#define FCCE_WN 2
#define FCCE_THREADS 128 // FCCE_WM * FCCE_WN SIMD groups of 32 (asserted in loaders.h)
// Row stride, in elements, of the h and w tiles in threadgroup memory, whose
// element type T is the GEMM's tile type (metal/loaders.h): BK plus 16 bytes of
// padding against bank conflicts, as MLX's steel GEMMs pad theirs (36 floats
// or 40 halves). `sz` is sizeof(T).
#define FCCE_TILE_LD(sz) (FCCE_BK + 16 / (sz))
// Floats of threadgroup memory that the h and w tiles [BM, LD] and [BN, LD]
// of T take together: 2,304 (float32 tiles) or 1,280 (half or bfloat16).
#define FCCE_HW_FLOATS(sz) ((FCCE_BM + FCCE_BN) * FCCE_TILE_LD(sz) * (sz) / 4)
// Vocabulary blocks whose coefficient tiles the fused forward and dh passes
// keep in threadgroup memory, so that they read and write their [BM, H]
// partial sums once per group of blocks rather than once per block.
#define FCCE_GROUP_BLOCKS 4
// Threadgroup memory of the head and dW kernels, in floats (declared in the
// kernels; metal/head.h's HeadSmem carves it): h and w tiles of T,
// FCCE_GROUP_BLOCKS float coefficient tiles [BM, BN + 4], row factors [BM]:
// 27,776 bytes with float32 tiles, 23,680 with half or bfloat16 tiles.
#define FCCE_SMEM_FLOATS(sz) \
  (FCCE_HW_FLOATS(sz) + FCCE_GROUP_BLOCKS * FCCE_BM * (FCCE_BN + 4) + FCCE_BM)
// The dh and fused forward kernels with their accumulator in registers
// (metal/regs.h) walk H in chunks of FCCE_REG_PIECES BK-wide columns, held as
// FCCE_REG_PIECES accumulator tiles of 8 floats per thread (64 floats); their
// threadgroup memory holds the h and w tiles of T, one float coefficient tile
// and the row factors [BM]: 13,952 bytes (float32 tiles) or 9,856 (half or
// bfloat16 tiles).
#define FCCE_REG_PIECES 8
#define FCCE_REG_COLS (FCCE_REG_PIECES * FCCE_BK)
#define FCCE_REG_SMEM_FLOATS(sz) (FCCE_HW_FLOATS(sz) + FCCE_BM * (FCCE_BN + 4) + FCCE_BM)
// Floats of one staged vocabulary block of those kernels where H takes more
// than one chunk: its coefficient tile [BM, BN] and (fused forward) row factors [BM].
#define FCCE_STAGE_FLOATS (FCCE_BM * FCCE_BN + FCCE_BM)
// The most vocabulary rows (and, in dW, rows of h) one threadgroup processes
// in one launch: macOS ends a command whose work runs too long, so long heads
// are split into several launches.
#define FCCE_MAX_ROUND_ROWS 8192
#define FCCE_MAX_ROUND_BLOCKS (FCCE_MAX_ROUND_ROWS / FCCE_BN)
// Threads per threadgroup of the element-wise kernels (combine, reduce, cast, fused dh).
#define FCCE_EW_THREADS 256

// Head kernel modes (FcceParams::mode).
// FWD: per-split running (max, sum of exp) per row and the target logits.
// FWD_FUSED: FWD plus, per split, sum_v exp(s_v - max) dcap_v W_v into part_acc.
// DH: sum_v dS_v W_v into part_acc, dS = (g [v == y] + (g_lse - g) p_v) dcap_v.
#define FCCE_MODE_FWD 0
#define FCCE_MODE_FWD_FUSED 1
#define FCCE_MODE_DH 2
// Reduce kernel modes: the plain sum over splits (dh), or each split weighted
// by exp(part_max - lse) (gsum of the fused forward).
#define FCCE_REDUCE_SUM 0
#define FCCE_REDUCE_GSUM 1

struct FcceParams {
  int M; // rows of h
  int H; // hidden size
  int V; // vocabulary rows of w
  int mode; // FCCE_MODE_* (head kernel) or FCCE_REDUCE_* (reduce kernel)
  int bits; // quantized heads: bits per weight; 0 for dense heads
  int group_size; // quantized heads: weights per scale/bias
  int row_bytes; // quantized heads: bytes of one packed row (H * bits / 8)
  int groups; // quantized heads: H / group_size
  int sb_dtype; // quantized heads: dtype of scales and biases as given (0 float32, 1 float16,
               // 2 bfloat16; the fused dh reads them so; the tile loops read them in T)
  float softcap; // 0: off
  int ignore_index;
  int splits; // vocabulary splits (grid.y of the head kernel)
  int blocks_per_split; // BN-row vocabulary blocks per split
  int m_tiles; // BM-row tiles of h
  // A launch covers part of the work (bounded dispatches, csrc/metal/plan.cpp):
  int m_tile_begin; // head: m tile of grid.x 0; dW: first m tile walked
  int split_begin; // head: split of grid.y 0
  int m_tile_count; // dW: m tiles each threadgroup walks in this launch
  int block_begin; // head: first block of each split in this launch (> 0: resume)
  int block_count; // head: blocks of each split in this launch (at most FCCE_MAX_ROUND_BLOCKS)
  int v_begin; // dW and cast: first vocabulary row of this launch
  int v_count; // dW and cast: vocabulary rows of this launch
  int acc_row0; // dW: row of acc that holds vocabulary row v_begin
  int count; // element-wise kernels: elements to process
};
