// The launch plan of the Metal head: which kernels run, in which order, on
// which grid, with which buffers and parameters. Pure host code without Metal
// headers, shared by the Metal host (which encodes exactly these launches) and
// the emulation tests (which run the same launches on the CPU).
//
// Conventions a caller relies on:
// - Launches run in order on one command encoder; each reads only what earlier
//   launches (or the caller) wrote, so a memory barrier between consecutive
//   launches is enough.
// - `grid` counts threadgroups (dispatch_threadgroups), `threads` is the
//   threadgroup size. `threadgroup_bytes` is dynamic threadgroup memory at
//   index 0 (set_threadgroup_memory_length(bytes, 0)); 0 means none, which is
//   the case for every kernel today: they declare theirs (FCCE_SMEM_FLOATS(sz)).
// - `buffers` lists every device buffer of the launch as (index, role), all
//   bound at offset 0. Scratch roles name buffers of Plan::scratch, allocated
//   by the caller (contents undefined on entry: every kernel writes a scratch
//   element before any kernel reads it).
// - The FcceParams block (metal/params.h) goes to buffer `params_index` with
//   set_bytes.
// - Inputs are row-major and contiguous: h [M, H], w [V, H] (dense) or packed
//   uint32 [V, H * bits / 32], scales/biases [V, H / group_size], targets [M]
//   int32, lse/g/g_lse/logp [M] float32, gsum [M, H] float32; with stats
//   entropy/g_ent [M] float32.
// - Outputs: logp, lse [M] float32; gsum [M, H] float32; dh [M, H] in h's
//   dtype (backward) or `out` (fused_dh); dw [V, H] in w's dtype; with stats
//   entropy, mean_logit [M] float32 and is_top1 [M] bool. The launches
//   write every output element, so outputs need no zero-fill.
// - Bounded launches: in no launch does a threadgroup process more than
//   FCCE_MAX_ROUND_ROWS (8192) vocabulary rows, nor (dW) more than that many
//   rows of h, and no launch does more than kLaunchFlops of GEMM work
//   (launch_gemm_flops), so that no command runs long enough for macOS's GPU
//   watchdog. A long head is a sequence of launches ("rounds") that carry each
//   split's running statistics and partial sums from one to the next in
//   part_max / part_sum / part_acc (dW: in its float32 rows).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "../../metal/params.h"

namespace flash_cce::metal {

enum class DType { f32, f16, bf16 };

// Which primitive is evaluated.
enum class Pass {
  forward, // FlashCCEForward: logp, lse (+ gsum when fused)
  backward, // FlashCCEBackward: dh (+ dw when compute_dw)
  fused_dh, // FlashCCEFusedDh: dh from gsum, logp, lse, g, g_lse
};

struct Problem {
  int64_t M = 0, H = 0, V = 0;
  DType h = DType::f32; // dtype of h (forward, backward)
  DType w = DType::f32; // dtype of a dense w
  DType sb = DType::f32; // dtype of scales and biases (quantized)
  DType out = DType::f32; // dtype of dh for fused_dh (FlashCCEFusedDh's out_dtype)
  bool quantized = false;
  int bits = 4;
  int group_size = 64;
  float softcap = 0.0f; // 0: off
  int ignore_index = -100;
  bool fused = false; // forward: also produce gsum
  // Forward: also the entropy statistics (entropy, is_top1, mean_logit);
  // backward: dS also takes the entropy's cotangent g_ent. Not with `fused`
  // (the entropy's gradient runs the backward pass) nor fused_dh.
  bool stats = false;
  Pass pass = Pass::forward;
  bool compute_dw = false; // backward, dense only
  // Overrides, 0 = the plan's choice: at most this many vocabulary splits,
  // this many vocabulary rows per dW launch (a multiple of 32), at most this
  // many vocabulary blocks per split in one head launch, and at most this many
  // m tiles per launch (head and dW).
  int max_splits = 0;
  int dw_slab_rows = 0;
  int round_blocks = 0;
  int round_m_tiles = 0;
  // The kernels of the dh pass, the fused forward and dW: 0 the plan's choice
  // (acc_in_registers), 1 the accumulator in registers, -1 the partials in
  // device memory per group of blocks.
  int acc_registers = 0;
};

enum class Role {
  // Caller's arrays.
  h,
  w,
  scales,
  biases,
  targets,
  logp, // output of forward, input of fused_dh
  lse, // output of forward, input of backward and fused_dh
  gsum, // output of the fused forward, input of fused_dh
  g,
  g_lse,
  dh,
  dw,
  // The entropy statistics (Problem::stats), [M] each:
  entropy, // output of forward (float32), input of backward
  is_top1, // output of forward (bool)
  mean_logit, // output of forward (float32)
  g_ent, // input of backward: the entropy's cotangent (float32)
  // Scratch (Plan::scratch), float32 unless said.
  part_max, // [splits, M] per-split running row maxima
  part_sum, // [splits, M] per-split sums of exp(s - part_max)
  target_logit, // [M] the target's (softcapped) logit
  part_acc, // [splits, M, H] per-split partial dh / gsum
  dw_acc, // [dw_slab_rows, H] float32 dW rows of one slab (half-precision w)
  stage, // [threadgroups of a launch, block_count, FCCE_STAGE_FLOATS] coefficients of the register kernels
  // The entropy's scratch (Problem::stats), [splits, M] each:
  part_ent, // per-split sum_v exp(s - part_max) (s - part_max), float32
  part_lsum, // per-split sum of the logits, float32
  part_arg, // per-split first arg-max, int32
  // A quantized head's h [M, H] and scales, biases [V, H / group_size] widened
  // to float32 where their dtype is not the tile type (tile_dtype).
  h_tile,
  scales_tile,
  biases_tile,
};

const char* role_name(Role r);

struct Binding {
  int index;
  Role role;
};

struct ScratchBuffer {
  Role role;
  size_t bytes;
};

struct Launch {
  const char* kernel; // an entry of kernel_names()
  uint32_t grid[3];
  uint32_t threads[3];
  size_t threadgroup_bytes;
  std::vector<Binding> buffers;
  int params_index;
  FcceParams params;
};

struct Plan {
  std::vector<ScratchBuffer> scratch;
  std::vector<Launch> launches;
};

// The launches for one primitive evaluation. Throws std::invalid_argument
// naming the field for a problem the kernels do not cover (the argument checks
// of flash_cce.cpp run before this and reject those already).
Plan make_plan(const Problem& p);

// Every kernel name the Metal sources define (metal/*.metal), in one table.
const std::vector<std::string>& kernel_names();

// The GEMM work of one launch of a head or dW kernel, as the plan bounds it:
// 2 flops per multiply-add, one GEMM for the plain forward and two (logits and
// the coefficients times W, or dS^T h) for the others; 0 for other kernels.
// An upper bound: edge tiles count as full.
double launch_gemm_flops(const Launch& l);
constexpr double kLaunchFlops = double(int64_t(1) << 36);

// The element type of the head kernels' h and w tiles (metal/loaders.h): the
// common type of h and a dense w, or of h and a quantized w's scales, as
// MLX's quantized_matmul resolves it: their dtype where they agree, float32
// otherwise. A quantized head's kernels read h and the scales in this type
// (the plan widens the others first); a dense head's convert the operand
// that is not float32 in their loader.
DType tile_dtype(const Problem& p);

// Whether the dh pass, the fused forward and dW run the kernels with their
// accumulator in registers (metal/regs.h; dW: metal/dw.h, dw_regs_tiles),
// the plan's choice unless Problem::acc_registers is -1: the same GEMMs and
// tile loads as the grouped kernels, the partial (dW: the float32 rows)
// written once per launch instead of read and written per group of blocks
// (of m tiles), and with more than one chunk of H each block's (m tile's)
// coefficient tile (4.1 KB) staged in device memory.
bool acc_in_registers(const Problem& p);
// Chunks of FCCE_REG_COLS columns of H those kernels walk.
int64_t register_chunks(int64_t H);
// The most (m tile, split, block) units (dW: (threadgroup, m tile)) of one
// launch of those kernels when they stage (more than one chunk): the stage is
// at most 4.1 KB per unit (66 MiB).
constexpr int64_t kMaxStagedUnits = 16384;

// Threadgroup memory each kernel family declares, in bytes (under 32 KB), for
// h and w tiles of the given tile type (tile_dtype).
size_t head_threadgroup_bytes(DType tile = DType::f32);
size_t regs_threadgroup_bytes(DType tile = DType::f32);
size_t dw_threadgroup_bytes(DType tile = DType::f32);

} // namespace flash_cce::metal
