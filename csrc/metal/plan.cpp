#include "plan.h"

#include <algorithm>
#include <stdexcept>

namespace flash_cce::metal {

namespace {

// Kernel names, indexed by dtype (f32, f16, bf16) and bit width. Written out
// so that a search for a name finds the table (and metal/*.metal its entry).
// [mode: fwd, fwd_fused, dh][h][w]
const char* const kHeadDense[3][3][3] = {
    {{"fcce_fwd_hf32_wf32", "fcce_fwd_hf32_wf16", "fcce_fwd_hf32_wbf16"},
     {"fcce_fwd_hf16_wf32", "fcce_fwd_hf16_wf16", "fcce_fwd_hf16_wbf16"},
     {"fcce_fwd_hbf16_wf32", "fcce_fwd_hbf16_wf16", "fcce_fwd_hbf16_wbf16"}},
    {{"fcce_fwd_fused_hf32_wf32", "fcce_fwd_fused_hf32_wf16", "fcce_fwd_fused_hf32_wbf16"},
     {"fcce_fwd_fused_hf16_wf32", "fcce_fwd_fused_hf16_wf16", "fcce_fwd_fused_hf16_wbf16"},
     {"fcce_fwd_fused_hbf16_wf32", "fcce_fwd_fused_hbf16_wf16", "fcce_fwd_fused_hbf16_wbf16"}},
    {{"fcce_dh_hf32_wf32", "fcce_dh_hf32_wf16", "fcce_dh_hf32_wbf16"},
     {"fcce_dh_hf16_wf32", "fcce_dh_hf16_wf16", "fcce_dh_hf16_wbf16"},
     {"fcce_dh_hbf16_wf32", "fcce_dh_hbf16_wf16", "fcce_dh_hbf16_wbf16"}},
};

constexpr int kBits[6] = {2, 3, 4, 5, 6, 8};

// [h][w]: the fused forward with the accumulator in registers.
const char* const kFwdRegDense[3][3] = {
    {"fcce_fwdreg_hf32_wf32", "fcce_fwdreg_hf32_wf16", "fcce_fwdreg_hf32_wbf16"},
    {"fcce_fwdreg_hf16_wf32", "fcce_fwdreg_hf16_wf16", "fcce_fwdreg_hf16_wbf16"},
    {"fcce_fwdreg_hbf16_wf32", "fcce_fwdreg_hbf16_wf16", "fcce_fwdreg_hbf16_wbf16"}};
// [h][w]: dh with the accumulator in registers (metal/regs.h).
const char* const kDhRegDense[3][3] = {
    {"fcce_dhreg_hf32_wf32", "fcce_dhreg_hf32_wf16", "fcce_dhreg_hf32_wbf16"},
    {"fcce_dhreg_hf16_wf32", "fcce_dhreg_hf16_wf16", "fcce_dhreg_hf16_wbf16"},
    {"fcce_dhreg_hbf16_wf32", "fcce_dhreg_hbf16_wf16", "fcce_dhreg_hbf16_wbf16"}};
// [h][w]: dW with the accumulator in registers (metal/dw.h, dw_regs_tiles),
// then the grouped dW.
const char* const kDwReg[3][3] = {
    {"fcce_dwreg_hf32_wf32", "fcce_dwreg_hf32_wf16", "fcce_dwreg_hf32_wbf16"},
    {"fcce_dwreg_hf16_wf32", "fcce_dwreg_hf16_wf16", "fcce_dwreg_hf16_wbf16"},
    {"fcce_dwreg_hbf16_wf32", "fcce_dwreg_hbf16_wf16", "fcce_dwreg_hbf16_wbf16"}};
const char* const kDw[3][3] = {
    {"fcce_dw_hf32_wf32", "fcce_dw_hf32_wf16", "fcce_dw_hf32_wbf16"},
    {"fcce_dw_hf16_wf32", "fcce_dw_hf16_wf16", "fcce_dw_hf16_wbf16"},
    {"fcce_dw_hbf16_wf32", "fcce_dw_hbf16_wf16", "fcce_dw_hbf16_wbf16"}};

// The entropy variants (Problem::stats): the plain forward with the entropy
// statistics, dh (accumulator in registers) and dW with the entropy's
// cotangent, and the combine that merges the statistics, [h][w] (quantized:
// quant_names()).
const char* const kFwdEntDense[3][3] = {
    {"fcce_fwd_ent_hf32_wf32", "fcce_fwd_ent_hf32_wf16", "fcce_fwd_ent_hf32_wbf16"},
    {"fcce_fwd_ent_hf16_wf32", "fcce_fwd_ent_hf16_wf16", "fcce_fwd_ent_hf16_wbf16"},
    {"fcce_fwd_ent_hbf16_wf32", "fcce_fwd_ent_hbf16_wf16", "fcce_fwd_ent_hbf16_wbf16"}};
const char* const kDhRegEntDense[3][3] = {
    {"fcce_dhreg_ent_hf32_wf32", "fcce_dhreg_ent_hf32_wf16", "fcce_dhreg_ent_hf32_wbf16"},
    {"fcce_dhreg_ent_hf16_wf32", "fcce_dhreg_ent_hf16_wf16", "fcce_dhreg_ent_hf16_wbf16"},
    {"fcce_dhreg_ent_hbf16_wf32", "fcce_dhreg_ent_hbf16_wf16", "fcce_dhreg_ent_hbf16_wbf16"}};
const char* const kDwEnt[3][3] = {
    {"fcce_dw_ent_hf32_wf32", "fcce_dw_ent_hf32_wf16", "fcce_dw_ent_hf32_wbf16"},
    {"fcce_dw_ent_hf16_wf32", "fcce_dw_ent_hf16_wf16", "fcce_dw_ent_hf16_wbf16"},
    {"fcce_dw_ent_hbf16_wf32", "fcce_dw_ent_hbf16_wf16", "fcce_dw_ent_hbf16_wbf16"}};
const char* const kCombineEnt = "fcce_combine_ent";

// Quantized heads: fcce_{mode}_h{T}_q{bits}_g{group}, T the tile type (the
// dtype of h and of the scales as the kernel reads them, after the plan's
// casts), in the order [mode: fwd, fwd_fused, dh, fwdreg, dhreg, fwd_ent,
// dhreg_ent][T][bits][group] (the last two: the entropy variants).
const char* const kQuantModes[7] = {"fwd", "fwd_fused", "dh", "fwdreg", "dhreg", "fwd_ent",
                                    "dhreg_ent"};
const char* const kDtypeNames[3] = {"f32", "f16", "bf16"};
constexpr int kGroups[3] = {32, 64, 128};

const std::vector<std::string>& quant_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const char* mode : kQuantModes)
      for (const char* t : kDtypeNames)
        for (int bits : kBits)
          for (int g : kGroups)
            n.push_back(std::string("fcce_") + mode + "_h" + t + "_q" + std::to_string(bits) +
                        "_g" + std::to_string(g));
    return n;
  }();
  return names;
}

// A quantized head's h or scales of float16 or bfloat16 widened to float32
// (index 0 unused).
const char* const kWiden[3] = {nullptr, "fcce_widen_f16", "fcce_widen_bf16"};

const char* const kCombine = "fcce_combine";
const char* const kReduceDh[3] = {"fcce_reduce_dh_f32", "fcce_reduce_dh_f16", "fcce_reduce_dh_bf16"};
const char* const kReduceGsum = "fcce_reduce_gsum";
// fp32 dW rows to the weight's half type (index 0 unused: fp32 dW needs no cast).
const char* const kCast[3] = {nullptr, "fcce_cast_f16", "fcce_cast_bf16"};

// [out][w]
const char* const kFusedDhDense[3][3] = {
    {"fcce_fused_dh_of32_wf32", "fcce_fused_dh_of32_wf16", "fcce_fused_dh_of32_wbf16"},
    {"fcce_fused_dh_of16_wf32", "fcce_fused_dh_of16_wf16", "fcce_fused_dh_of16_wbf16"},
    {"fcce_fused_dh_obf16_wf32", "fcce_fused_dh_obf16_wf16", "fcce_fused_dh_obf16_wbf16"}};
// [out]
const char* const kFusedDhQuant[3] = {
    "fcce_fused_dh_of32_q", "fcce_fused_dh_of16_q", "fcce_fused_dh_obf16_q"};

// Head threadgroups in flight: enough to fill a large Apple GPU (several per
// core); fewer when each split keeps a [BM, H] float32 partial, whose total
// is kept small for unified memory.
constexpr int64_t kTargetThreadgroups = 512;
constexpr int64_t kTargetThreadgroupsWithAcc = 256;
// Upper bound of the per-split [splits, M, H] float32 partials (dh, gsum).
constexpr int64_t kPartAccBudgetBytes = int64_t(128) << 20;
// Vocabulary rows per dW launch when dW needs a float32 staging buffer.
constexpr int64_t kDwSlabRows = 8192;
// The fewest vocabulary blocks per split a head launch is cut down to before
// it covers fewer m tiles instead (shorter rounds cost launches and state
// reloads; fewer m tiles cost threadgroups in flight).
constexpr int64_t kMinRoundBlocks = 8;

// Buffer indices, fixed per role across the kernels that use them.
constexpr int kParamsIndex = 20;

int dtype_index(DType t) {
  return static_cast<int>(t);
}

int bits_index(int bits) {
  for (int i = 0; i < 6; ++i) {
    if (kBits[i] == bits) {
      return i;
    }
  }
  throw std::invalid_argument(
      "[flash_cce] Metal head: bits must be one of 2, 3, 4, 5, 6, 8, got " +
      std::to_string(bits));
}

int64_t cdiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

uint32_t u32(int64_t v, const char* what) {
  if (v < 0 || v > INT32_MAX) {
    throw std::invalid_argument(std::string("[flash_cce] Metal head: ") + what +
                                " out of range: " + std::to_string(v));
  }
  return static_cast<uint32_t>(v);
}


void check(const Problem& p) {
  auto bad = [](const std::string& msg) {
    throw std::invalid_argument("[flash_cce] Metal head: " + msg);
  };
  if (p.M < 1 || p.H < 1 || p.V < 1) {
    bad("M, H and V must be positive, got M=" + std::to_string(p.M) +
        ", H=" + std::to_string(p.H) + ", V=" + std::to_string(p.V));
  }
  if (p.M > INT32_MAX || p.H > INT32_MAX || p.V > INT32_MAX ||
      p.M * p.H > INT32_MAX) {
    bad("M * H must stay below 2^31, got M=" + std::to_string(p.M) +
        ", H=" + std::to_string(p.H));
  }
  if (p.quantized) {
    bits_index(p.bits);
    if (p.group_size != 32 && p.group_size != 64 && p.group_size != 128) {
      bad("group_size must be 32, 64 or 128, got " + std::to_string(p.group_size));
    }
    if (p.H % p.group_size != 0) {
      bad("H=" + std::to_string(p.H) + " is not a multiple of group_size " +
          std::to_string(p.group_size));
    }
    if (p.pass == Pass::backward && p.compute_dw) {
      bad("compute_dw needs a dense w");
    }
  }
  if (p.stats && (p.pass == Pass::fused_dh || (p.pass == Pass::forward && p.fused))) {
    bad("the entropy statistics run without the fused forward (fused must be false) "
        "and have no fused_dh pass");
  }
  if (p.stats && p.pass == Pass::backward && p.acc_registers == -1) {
    bad("the entropy's backward runs the register kernels only (acc_registers must be 0 or 1)");
  }
  if (p.acc_registers < -1 || p.acc_registers > 1) {
    bad("acc_registers must be -1, 0 or 1, got " + std::to_string(p.acc_registers));
  }
  if (p.max_splits < 0) {
    bad("max_splits must be >= 0, got " + std::to_string(p.max_splits));
  }
  if (p.round_blocks < 0 || p.round_m_tiles < 0) {
    bad("round_blocks and round_m_tiles must be >= 0, got " + std::to_string(p.round_blocks) +
        " and " + std::to_string(p.round_m_tiles));
  }
  if (p.dw_slab_rows < 0 || p.dw_slab_rows % FCCE_BN != 0) {
    bad("dw_slab_rows must be a non-negative multiple of " + std::to_string(FCCE_BN) +
        ", got " + std::to_string(p.dw_slab_rows));
  }
}

FcceParams base_params(const Problem& p) {
  FcceParams q{};
  q.M = static_cast<int>(p.M);
  q.H = static_cast<int>(p.H);
  q.V = static_cast<int>(p.V);
  q.softcap = p.softcap;
  q.ignore_index = p.ignore_index;
  q.m_tiles = static_cast<int>(cdiv(p.M, FCCE_BM));
  if (p.quantized) {
    q.bits = p.bits;
    q.group_size = p.group_size;
    q.row_bytes = static_cast<int>(p.H * p.bits / 8);
    q.groups = static_cast<int>(p.H / p.group_size);
    q.sb_dtype = dtype_index(p.sb);
  }
  return q;
}

// Splits of the vocabulary: enough threadgroups in flight, the [splits, M, H]
// partials (when kept) within budget, and no empty split.
void choose_splits(const Problem& p, bool with_acc, FcceParams& q) {
  const int64_t v_blocks = cdiv(p.V, FCCE_BN);
  const int64_t target = with_acc ? kTargetThreadgroupsWithAcc : kTargetThreadgroups;
  int64_t splits = std::max<int64_t>(1, cdiv(target, q.m_tiles));
  if (with_acc) {
    splits = std::min(splits, std::max<int64_t>(1, kPartAccBudgetBytes / (p.M * p.H * 4)));
  }
  if (p.max_splits > 0) {
    splits = std::min<int64_t>(splits, p.max_splits);
  }
  splits = std::clamp<int64_t>(splits, 1, v_blocks);
  const int64_t per = cdiv(v_blocks, splits);
  q.blocks_per_split = static_cast<int>(per);
  q.splits = static_cast<int>(cdiv(v_blocks, per));
}

int group_index(int group_size) {
  for (int i = 0; i < 3; ++i) {
    if (kGroups[i] == group_size) {
      return i;
    }
  }
  throw std::invalid_argument("[flash_cce] Metal head: group_size must be 32, 64 or 128, got " +
                              std::to_string(group_size));
}

// Whether a quantized head's kernels read a float32 copy of h, or of the
// scales and biases: the ones whose dtype is not the tile type.
bool widen_h(const Problem& p) {
  return p.quantized && p.h != tile_dtype(p);
}
bool widen_sb(const Problem& p) {
  return p.quantized && p.sb != tile_dtype(p);
}

std::vector<Binding> operand_bindings(const Problem& p) {
  std::vector<Binding> b{{0, widen_h(p) ? Role::h_tile : Role::h}, {1, Role::w},
                         {4, Role::targets}};
  if (p.quantized) {
    b.push_back({2, widen_sb(p) ? Role::scales_tile : Role::scales});
    b.push_back({3, widen_sb(p) ? Role::biases_tile : Role::biases});
  }
  return b;
}

// The entropy's buffers: the forward's per-split statistics, and the
// backward's inputs (its kernels: dh and dW).
const std::vector<Binding>& ent_part_bindings() {
  static const std::vector<Binding> b{
      {17, Role::part_ent}, {18, Role::part_lsum}, {19, Role::part_arg}};
  return b;
}
const std::vector<Binding>& ent_grad_bindings() {
  static const std::vector<Binding> b{{21, Role::entropy}, {24, Role::g_ent}};
  return b;
}

const char* head_kernel(const Problem& p, int mode, bool regs) {
  if (p.quantized) {
    const int m = p.stats && mode == FCCE_MODE_FWD ? 5
        : p.stats && regs && mode == FCCE_MODE_DH ? 6
        : regs ? (mode == FCCE_MODE_DH ? 4 : 3) : mode;
    const size_t i = ((size_t(m) * 3 + dtype_index(tile_dtype(p))) * 6 + bits_index(p.bits)) * 3 +
        group_index(p.group_size);
    return quant_names()[i].c_str();
  }
  const int h = dtype_index(p.h), w = dtype_index(p.w);
  if (p.stats && mode == FCCE_MODE_FWD) {
    return kFwdEntDense[h][w];
  }
  if (p.stats && regs && mode == FCCE_MODE_DH) {
    return kDhRegEntDense[h][w];
  }
  if (regs) {
    return mode == FCCE_MODE_DH ? kDhRegDense[h][w] : kFwdRegDense[h][w];
  }
  return kHeadDense[mode][h][w];
}

Launch head_launch(const Problem& p, const FcceParams& q, int mode, bool regs) {
  Launch l{};
  l.kernel = head_kernel(p, mode, regs);
  l.grid[0] = u32(q.m_tiles, "m_tiles");
  l.grid[1] = u32(q.splits, "splits");
  l.grid[2] = 1;
  l.threads[0] = FCCE_THREADS;
  l.threads[1] = l.threads[2] = 1;
  l.threadgroup_bytes = 0; // declared in the kernel
  l.buffers = operand_bindings(p);
  if (mode == FCCE_MODE_DH) {
    l.buffers.insert(l.buffers.end(), {{5, Role::lse}, {6, Role::g}, {7, Role::g_lse}});
  } else {
    l.buffers.insert(l.buffers.end(),
                     {{8, Role::part_max}, {9, Role::part_sum}, {10, Role::target_logit}});
  }
  if (mode != FCCE_MODE_FWD) {
    l.buffers.push_back({11, Role::part_acc});
  }
  if (regs) {
    l.buffers.push_back({16, Role::stage});
  }
  if (p.stats) {
    if (mode == FCCE_MODE_DH) {
      l.buffers.insert(l.buffers.end(), ent_grad_bindings().begin(), ent_grad_bindings().end());
    } else {
      l.buffers.insert(l.buffers.end(), ent_part_bindings().begin(), ent_part_bindings().end());
    }
  }
  l.params_index = kParamsIndex;
  l.params = q;
  l.params.mode = mode;
  return l;
}

// GEMMs per vocabulary block of a head kernel: the logits, plus the
// coefficients times W where a partial sum is kept.
int head_gemms(int mode) {
  return mode == FCCE_MODE_FWD ? 1 : 2;
}

// Appends the head kernel's launches: rounds of at most `blocks` vocabulary
// blocks per split (resuming each split's state), each round in chunks of
// m tiles and of splits, so that every launch stays within
// FCCE_MAX_ROUND_BLOCKS per threadgroup and within kLaunchFlops in all (the
// latter wherever one block of one m tile is within it: H <= 2^24). Rounds
// run in order, so each split's blocks are visited in order, as the online
// statistics need.
// `regs`: the kernel with the accumulator in registers (dh or fused
// forward); where it stages coefficients (more than one chunk of H), a launch
// also holds at most kMaxStagedUnits (m tile, split, block) units. Returns the
// most units of one launch.
int64_t head_rounds(const Problem& p, const FcceParams& q, int mode, bool regs, Plan& plan) {
  const int64_t hk = cdiv(p.H, FCCE_BK) * FCCE_BK;
  double tile = 2.0 * head_gemms(mode) * FCCE_BM * FCCE_BN * double(hk);
  if (regs && register_chunks(p.H) > 1) {
    tile = std::max(tile, kLaunchFlops / double(kMaxStagedUnits));
  }
  const int64_t splits = q.splits, m_tiles = q.m_tiles;
  auto fit = [&](double per_unit, int64_t most) {
    return std::clamp<int64_t>(int64_t(kLaunchFlops / per_unit), 1, most);
  };
  int64_t blocks = std::min<int64_t>(q.blocks_per_split, FCCE_MAX_ROUND_BLOCKS);
  if (p.round_blocks > 0) {
    blocks = std::min<int64_t>(blocks, p.round_blocks);
  }
  // Shorter rounds first (down to kMinRoundBlocks), then fewer m tiles, then
  // shorter rounds again, then fewer splits: a launch keeps as many
  // threadgroups in flight as its bound allows.
  blocks = std::min(blocks, std::max(kMinRoundBlocks, fit(tile * m_tiles * splits, blocks)));
  int64_t m_chunk = fit(tile * splits * blocks, m_tiles);
  if (p.round_m_tiles > 0) {
    m_chunk = std::min<int64_t>(m_chunk, p.round_m_tiles);
  }
  blocks = fit(tile * splits * m_chunk, blocks);
  const int64_t s_chunk = fit(tile * m_chunk * blocks, splits);
  int64_t units = 0;
  for (int64_t b0 = 0; b0 < q.blocks_per_split; b0 += blocks) {
    for (int64_t mt = 0; mt < m_tiles; mt += m_chunk) {
      for (int64_t s0 = 0; s0 < splits; s0 += s_chunk) {
        FcceParams r = q;
        r.block_begin = static_cast<int>(b0);
        r.block_count = static_cast<int>(std::min<int64_t>(blocks, q.blocks_per_split - b0));
        r.m_tile_begin = static_cast<int>(mt);
        r.split_begin = static_cast<int>(s0);
        Launch l = head_launch(p, r, mode, regs);
        l.grid[0] = u32(std::min<int64_t>(m_chunk, m_tiles - mt), "m_tiles");
        l.grid[1] = u32(std::min<int64_t>(s_chunk, splits - s0), "splits");
        plan.launches.push_back(l);
        units = std::max(units, int64_t(l.grid[0]) * l.grid[1] * r.block_count);
      }
    }
  }
  return units;
}

// The register kernels' stage for launches of at most `units` (m tile, split,
// block) units: FCCE_STAGE_FLOATS per unit where H takes more than one chunk;
// with one chunk nothing is staged, but the kernel's buffer is still bound.
ScratchBuffer stage_buffer(const Problem& p, int64_t units) {
  const size_t per = size_t(FCCE_STAGE_FLOATS) * 4;
  return {Role::stage, register_chunks(p.H) > 1 ? size_t(units) * per : 16};
}

Launch elementwise(const char* kernel, int64_t count, const FcceParams& q,
                   std::vector<Binding> buffers) {
  Launch l{};
  l.kernel = kernel;
  l.grid[0] = u32(cdiv(count, FCCE_EW_THREADS), "grid");
  l.grid[1] = l.grid[2] = 1;
  l.threads[0] = FCCE_EW_THREADS;
  l.threads[1] = l.threads[2] = 1;
  l.threadgroup_bytes = 0;
  l.buffers = std::move(buffers);
  l.params_index = kParamsIndex;
  l.params = q;
  l.params.count = static_cast<int>(count);
  return l;
}

// The float32 copies of a quantized head's h, scales and biases whose dtype
// is not its tile type, and the launches that write them (before the head's).
void plan_widen(const Problem& p, const FcceParams& q, Plan& plan) {
  auto widen = [&](Role from, Role to, DType t, int64_t count) {
    plan.scratch.push_back({to, size_t(count) * 4});
    plan.launches.push_back(elementwise(kWiden[dtype_index(t)], count, q, {{17, from}, {18, to}}));
  };
  if (widen_h(p)) {
    widen(Role::h, Role::h_tile, p.h, p.M * p.H);
  }
  if (widen_sb(p)) {
    widen(Role::scales, Role::scales_tile, p.sb, p.V * (p.H / p.group_size));
    widen(Role::biases, Role::biases_tile, p.sb, p.V * (p.H / p.group_size));
  }
}

void plan_forward(const Problem& p, Plan& plan) {
  FcceParams q = base_params(p);
  choose_splits(p, p.fused, q);
  const size_t per_split = size_t(q.splits) * p.M * 4; // [splits, M] 32-bit values
  plan.scratch = {{Role::part_max, per_split}, {Role::part_sum, per_split},
                  {Role::target_logit, size_t(p.M) * 4}};
  if (p.fused) {
    plan.scratch.push_back({Role::part_acc, size_t(q.splits) * p.M * p.H * 4});
  }
  if (p.stats) {
    for (Role r : {Role::part_ent, Role::part_lsum, Role::part_arg}) {
      plan.scratch.push_back({r, per_split});
    }
  }
  plan_widen(p, q, plan);
  const bool regs = p.fused && acc_in_registers(p);
  const int64_t units =
      head_rounds(p, q, p.fused ? FCCE_MODE_FWD_FUSED : FCCE_MODE_FWD, regs, plan);
  if (regs) {
    plan.scratch.push_back(stage_buffer(p, units));
  }
  std::vector<Binding> combine{{4, Role::targets}, {8, Role::part_max}, {9, Role::part_sum},
                               {10, Role::target_logit}, {12, Role::logp}, {5, Role::lse}};
  if (p.stats) {
    combine.insert(combine.end(), ent_part_bindings().begin(), ent_part_bindings().end());
    combine.insert(combine.end(),
                   {{21, Role::entropy}, {22, Role::is_top1}, {23, Role::mean_logit}});
  }
  plan.launches.push_back(
      elementwise(p.stats ? kCombineEnt : kCombine, p.M, q, std::move(combine)));
  if (p.fused) {
    FcceParams r = q;
    r.mode = FCCE_REDUCE_GSUM;
    plan.launches.push_back(elementwise(
        kReduceGsum, p.M * p.H, r,
        {{11, Role::part_acc}, {8, Role::part_max}, {5, Role::lse}, {13, Role::gsum}}));
  }
}

// dW in launches of at most `slab` vocabulary rows (one threadgroup per 32)
// by at most `m_chunk` m tiles each threadgroup walks, within kLaunchFlops and
// FCCE_MAX_ROUND_ROWS rows of h per threadgroup. A float32 head accumulates in
// dw itself; a half-precision one in a float32 slab, cast when its last m
// chunk is done. The kernel with its accumulator in registers (the plan's
// unless Problem::acc_registers is -1) stages each m tile's dS tile where H
// takes more than one chunk, so a launch then also holds at most
// kMaxStagedUnits (threadgroup, m tile) units. Returns the most units of one
// launch (for the stage that dh's kernel shares).
int64_t plan_dw(const Problem& p, Plan& plan) {
  FcceParams q = base_params(p);
  const bool staged = p.w != DType::f32;
  const int64_t hk = cdiv(p.H, FCCE_BK) * FCCE_BK;
  int64_t slab = p.dw_slab_rows > 0 ? p.dw_slab_rows
                                    : staged ? kDwSlabRows : kTargetThreadgroups * FCCE_BN;
  slab = std::min(slab, cdiv(p.V, FCCE_BN) * FCCE_BN);
  const bool regs = acc_in_registers(p);
  double per_tile = 2.0 * 2 * FCCE_BM * FCCE_BN * double(hk);
  if (regs && register_chunks(p.H) > 1) {
    per_tile = std::max(per_tile, kLaunchFlops / double(kMaxStagedUnits));
  }
  int64_t m_chunk = std::min<int64_t>(q.m_tiles, FCCE_MAX_ROUND_ROWS / FCCE_BM);
  while (slab > FCCE_BN && double(slab / FCCE_BN) * per_tile > kLaunchFlops) {
    slab = std::max<int64_t>(FCCE_BN, slab / 2 / FCCE_BN * FCCE_BN);
  }
  m_chunk = std::min<int64_t>(
      m_chunk, std::max<int64_t>(1, int64_t(kLaunchFlops / (double(slab / FCCE_BN) * per_tile))));
  if (p.round_m_tiles > 0) {
    m_chunk = std::min<int64_t>(m_chunk, p.round_m_tiles);
  }
  slab = std::min(slab, p.V);
  if (staged) {
    plan.scratch.push_back({Role::dw_acc, size_t(slab) * p.H * 4});
  }
  int64_t units = 0;
  for (int64_t v0 = 0; v0 < p.V; v0 += slab) {
    const int64_t n = std::min(slab, p.V - v0);
    q.v_begin = static_cast<int>(v0);
    q.v_count = static_cast<int>(n);
    q.acc_row0 = staged ? 0 : static_cast<int>(v0);
    for (int64_t mt = 0; mt < q.m_tiles; mt += m_chunk) {
      Launch l{};
      l.kernel = (p.stats ? kDwEnt : regs ? kDwReg : kDw)[dtype_index(p.h)][dtype_index(p.w)];
      l.grid[0] = u32(cdiv(n, FCCE_BN), "grid");
      l.grid[1] = l.grid[2] = 1;
      l.threads[0] = FCCE_THREADS;
      l.threads[1] = l.threads[2] = 1;
      l.threadgroup_bytes = 0;
      l.buffers = {{0, Role::h}, {1, Role::w}, {4, Role::targets}, {5, Role::lse},
                   {6, Role::g}, {7, Role::g_lse}, {14, staged ? Role::dw_acc : Role::dw}};
      if (regs) {
        l.buffers.push_back({16, Role::stage});
      }
      if (p.stats) {
        l.buffers.insert(l.buffers.end(), ent_grad_bindings().begin(), ent_grad_bindings().end());
      }
      l.params_index = kParamsIndex;
      l.params = q;
      l.params.m_tile_begin = static_cast<int>(mt);
      l.params.m_tile_count = static_cast<int>(std::min<int64_t>(m_chunk, q.m_tiles - mt));
      units = std::max(units, int64_t(l.grid[0]) * l.params.m_tile_count);
      plan.launches.push_back(l);
    }
    if (staged) {
      plan.launches.push_back(elementwise(kCast[dtype_index(p.w)], n * p.H, q,
                                          {{14, Role::dw_acc}, {15, Role::dw}}));
    }
  }
  return regs ? units : 0;
}

void plan_backward(const Problem& p, Plan& plan) {
  FcceParams q = base_params(p);
  choose_splits(p, true, q);
  plan.scratch = {{Role::part_acc, size_t(q.splits) * p.M * p.H * 4}};
  plan_widen(p, q, plan);
  const bool regs = acc_in_registers(p);
  int64_t units = head_rounds(p, q, FCCE_MODE_DH, regs, plan);
  FcceParams r = q;
  r.mode = FCCE_REDUCE_SUM;
  plan.launches.push_back(elementwise(kReduceDh[dtype_index(p.h)], p.M * p.H, r,
                                      {{11, Role::part_acc}, {13, Role::dh}}));
  if (p.compute_dw) {
    // dW's register kernel stages at most FCCE_BM * FCCE_BN floats per unit,
    // within dh's FCCE_STAGE_FLOATS: one stage serves both passes.
    units = std::max(units, plan_dw(p, plan));
  }
  if (regs) {
    plan.scratch.push_back(stage_buffer(p, units));
  }
}

void plan_fused_dh(const Problem& p, Plan& plan) {
  const FcceParams q = base_params(p);
  const int o = dtype_index(p.out);
  const char* kernel = p.quantized ? kFusedDhQuant[o]
                                   : kFusedDhDense[o][dtype_index(p.w)];
  std::vector<Binding> b{{13, Role::gsum}, {1, Role::w}, {4, Role::targets},
                         {12, Role::logp}, {5, Role::lse}, {6, Role::g},
                         {7, Role::g_lse}, {15, Role::dh}};
  if (p.quantized) {
    b.push_back({2, Role::scales});
    b.push_back({3, Role::biases});
  }
  plan.launches.push_back(elementwise(kernel, p.M * p.H, q, std::move(b)));
}

} // namespace

DType tile_dtype(const Problem& p) {
  const DType other = p.quantized ? p.sb : p.w;
  return p.h == other ? p.h : DType::f32;
}

int64_t register_chunks(int64_t H) {
  return cdiv(H, FCCE_REG_COLS);
}

bool acc_in_registers(const Problem& p) {
  return p.acc_registers >= 0;
}

const char* role_name(Role r) {
  static const char* const names[] = {
      "h",       "w",          "scales",    "biases", "targets",      "logp",
      "lse",     "gsum",       "g",         "g_lse",  "dh",           "dw",
      "entropy", "is_top1",    "mean_logit", "g_ent", "part_max",     "part_sum",
      "target_logit", "part_acc", "dw_acc", "stage",  "part_ent",     "part_lsum",
      "part_arg", "h_tile",    "scales_tile", "biases_tile"};
  static_assert(sizeof(names) / sizeof(names[0]) == size_t(Role::biases_tile) + 1);
  return names[static_cast<int>(r)];
}

size_t head_threadgroup_bytes(DType tile) {
  return size_t(FCCE_SMEM_FLOATS(tile == DType::f32 ? 4 : 2)) * 4;
}

size_t regs_threadgroup_bytes(DType tile) {
  return size_t(FCCE_REG_SMEM_FLOATS(tile == DType::f32 ? 4 : 2)) * 4;
}

size_t dw_threadgroup_bytes(DType tile) {
  return head_threadgroup_bytes(tile); // the same tiles (metal/dw.h uses HeadSmem)
}

double launch_gemm_flops(const Launch& l) {
  const std::string k = l.kernel;
  const FcceParams& q = l.params;
  const double hk = double(cdiv(q.H, FCCE_BK) * FCCE_BK);
  if (k.rfind("fcce_dw_", 0) == 0 || k.rfind("fcce_dwreg_", 0) == 0) {
    return 2.0 * 2 * double(l.grid[0]) * FCCE_BN * double(q.m_tile_count) * FCCE_BM * hk;
  }
  const bool head = k.rfind("fcce_fwd_", 0) == 0 || k.rfind("fcce_dh_", 0) == 0 ||
      k.rfind("fcce_dhreg_", 0) == 0 || k.rfind("fcce_fwdreg_", 0) == 0;
  if (!head) {
    return 0.0;
  }
  return 2.0 * head_gemms(q.mode) * double(l.grid[0]) * FCCE_BM * double(l.grid[1]) *
      double(q.block_count) * FCCE_BN * hk;
}

Plan make_plan(const Problem& p) {
  check(p);
  Plan plan;
  switch (p.pass) {
    case Pass::forward:
      plan_forward(p, plan);
      break;
    case Pass::backward:
      plan_backward(p, plan);
      break;
    case Pass::fused_dh:
      plan_fused_dh(p, plan);
      break;
  }
  return plan;
}

const std::vector<std::string>& kernel_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (auto& mode : kHeadDense)
      for (auto& row : mode) n.insert(n.end(), std::begin(row), std::end(row));
    n.insert(n.end(), quant_names().begin(), quant_names().end());
    for (auto& row : kFwdRegDense) n.insert(n.end(), std::begin(row), std::end(row));
    for (auto& row : kDhRegDense) n.insert(n.end(), std::begin(row), std::end(row));
    for (auto& row : kDw) n.insert(n.end(), std::begin(row), std::end(row));
    for (auto& row : kDwReg) n.insert(n.end(), std::begin(row), std::end(row));
    n.push_back(kCombine);
    n.insert(n.end(), std::begin(kReduceDh), std::end(kReduceDh));
    n.push_back(kReduceGsum);
    n.push_back(kCast[1]);
    n.push_back(kCast[2]);
    n.push_back(kWiden[1]);
    n.push_back(kWiden[2]);
    for (auto& row : kFusedDhDense) n.insert(n.end(), std::begin(row), std::end(row));
    n.insert(n.end(), std::begin(kFusedDhQuant), std::end(kFusedDhQuant));
    for (auto* t : {&kFwdEntDense, &kDhRegEntDense, &kDwEnt})
      for (auto& row : *t) n.insert(n.end(), std::begin(row), std::end(row));
    n.push_back(kCombineEnt);
    return n;
  }();
  return names;
}

} // namespace flash_cce::metal
