// Host side of the CUDA flash-CCE head: the passes of the forward, the
// backward and the fused dh, recorded as launches on MLX's command encoder
// (kernels from loader.h, chosen in dispatch.h, sized by plan.h).
#include "cuda_head.h"

#include <cuda.h>

#include <algorithm>
#include <string>

#include "dispatch.h"
#include "loader.h"
#include "mlx/backend/cuda/device.h"
#include "mlx/backend/cuda/utils.h"
#include "params.h"
#include "plan.h"
#include "tma.h"

namespace flash_cce::cuda {

namespace {

int32_t src_kind(mx::Dtype t) {
  return t == mx::bfloat16 ? kBF16 : t == mx::float16 ? kF16 : kF32;
}

// A row-major [rows, cols] operand of dtype t, read natively when it already
// is the compute type and rows are 16-byte aligned.
Operand dense(const void* ptr, mx::Dtype t, int64_t rows, int64_t cols, int64_t ld,
              mx::Dtype compute) {
  Operand o{};
  o.ptr = ptr;
  o.ld = ld;
  o.rows = rows;
  o.cols = cols;
  const int64_t esize = t == mx::float32 ? 4 : 2;
  const bool aligned = (ld * esize) % 16 == 0 && reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
  o.kind = (t == compute && aligned) ? kNative : src_kind(t);
  o.vec_ok = aligned;
  return o;
}

Operand weight(const HeadProblem& p, mx::Dtype compute) {
  if (!p.cfg.quantized) {
    return dense(p.w, p.w_dtype, p.V, p.H, p.H, compute);
  }
  Operand o{};
  o.ptr = p.w;
  o.ld = p.H;
  o.rows = p.V;
  o.cols = p.H;
  o.kind = kQuant;
  o.scales = p.scales;
  o.biases = p.biases;
  o.sb_kind = src_kind(p.sb_dtype);
  o.group_size = p.cfg.group_size;
  o.bits = p.cfg.bits;
  return o;
}

mx::array scratch(mx::cu::CommandEncoder& enc, mx::Shape shape, mx::Dtype t) {
  mx::array a(std::move(shape), t, nullptr, {});
  a.set_data(mx::allocator::malloc(a.nbytes()));
  enc.add_temporary(a);
  return a;
}

void alloc(std::vector<mx::array>& outputs) {
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
  }
}

// Records one kernel on the encoder (1-D grids: no y/z limits to respect).
struct Launch {
  mx::cu::CommandEncoder& enc;
  int ordinal;
  template <class P>
  void operator()(const std::string& name, int64_t blocks, uint32_t smem, P& params,
                  int threads = kThreads) {
    CUfunction fn = kernel_function(name, ordinal, std::max<int>(smem, 1));
    enc.add_kernel_node_ex(fn, dim3(static_cast<unsigned>(blocks)), dim3(threads), dim3(1),
                           smem, params);
  }
};

void set_pointers(HeadProblem& p, const std::vector<mx::array>& in, size_t scales_at) {
  p.h = mx::gpu_ptr<void>(in[0]);
  p.w = mx::gpu_ptr<void>(in[1]);
  p.targets = mx::gpu_ptr<int32_t>(in[2]);
  if (p.cfg.quantized) {
    p.scales = mx::gpu_ptr<void>(in[scales_at]);
    p.biases = mx::gpu_ptr<void>(in[scales_at + 1]);
    p.sb_dtype = in[scales_at].dtype();
  }
}

// The encoder of s with its device current; fills p's device pointers and
// allocates the outputs.
mx::cu::CommandEncoder& begin(mx::Stream s, HeadProblem& p, const std::vector<mx::array>& inputs,
                              std::vector<mx::array>& outputs, size_t scales_at) {
  auto& enc = mx::cu::get_command_encoder(s);
  mx::cu::device(s.device).make_current();
  set_pointers(p, inputs, scales_at);
  alloc(outputs);
  return enc;
}

// Width of the vocabulary chunk of the backward and the fused forward for
// blocks of M rows, a multiple of every tile width.
int64_t backward_chunk(const LaunchPlan& plan, int64_t M, int64_t V, bool dw = false) {
  return vocab_chunk(plan, M, V, kWgTileN, dw);
}

// target_logit[m] = the (softcapped) logit of row m's target, for p's rows;
// `out` is the array that holds target_logit.
void gather_targets(mx::cu::CommandEncoder& enc, Launch& launch, const HeadProblem& p,
                    const std::vector<mx::array>& inputs, const mx::array& out,
                    float* target_logit) {
  TargetParams tp{};
  tp.h = dense(p.h, p.h_dtype, p.M, p.H, p.H, compute_dtype(p));
  tp.w = weight(p, compute_dtype(p));
  tp.targets = p.targets;
  tp.target_logit = target_logit;
  tp.M = p.M;
  tp.V = p.V;
  tp.H = p.H;
  tp.cap = p.cfg.softcap;
  for (auto& a : inputs) {
    enc.set_input_array(a);
  }
  enc.set_output_array(out);
  launch(kernel_name("target", wg_variant(p)), cdiv(p.M, kThreads / 32), 0, tp);
}

// The forward GEMM over the vocabulary [0, V_used): per-split row partials
// (max, sum of exp) and, unless gathers_targets, the target logits, in
// parts[2 * splits + 1, M]; with cfg.stats then the entropy partials (r,
// sum of logits, arg-max: 3 splits more rows).
std::pair<mx::array, FwdParams> lse_partials(mx::Stream s, const HeadProblem& p,
                                             const std::vector<mx::array>& inputs,
                                             int64_t V_used) {
  auto& enc = mx::cu::get_command_encoder(s);
  const auto ct = compute_dtype(p);
  const bool wg = use_wgmma(s, p);
  const int tile_n = wg ? kWgTileN : kTileN;
  FwdParams fp{};
  fp.h = dense(p.h, p.h_dtype, p.M, p.H, p.H, ct);
  fp.w = weight(p, ct);
  fp.targets = p.targets;
  fp.M = p.M;
  fp.V = V_used;
  fp.H = p.H;
  // The entropy statistics have no register-operand epilogue: 4/8-bit heads
  // take the dequantizing producer for them.
  const bool rs = wg && use_rs(p) && !p.cfg.stats;
  const int tile_rows = rs ? kRsTileM : kTileM;
  fp.m_tiles = static_cast<int>(cdiv(p.M, tile_rows));
  fp.v_tiles = static_cast<int>(cdiv(V_used, rs ? kRsTileV : tile_n));
  const LaunchPlan plan = launch_plan(s, p);
  fp.splits = forward_splits(plan, p.M, fp.v_tiles, fp.m_tiles);
  fp.tiles_per_split = static_cast<int>(cdiv(fp.v_tiles, fp.splits));
  fp.splits = static_cast<int>(cdiv(fp.v_tiles, fp.tiles_per_split));
  fp.m_group = forward_group(plan, fp.m_tiles, tile_rows, p.H, mx::size_of(p.h_dtype));
  fp.cap = p.cfg.softcap;

  const int stats_rows = p.cfg.stats ? 3 * fp.splits : 0;
  auto parts =
      scratch(enc, {2 * fp.splits + 1 + stats_rows, static_cast<int>(p.M)}, mx::float32);
  fp.part_max = mx::gpu_ptr<float>(parts);
  fp.part_sum = fp.part_max + int64_t(fp.splits) * p.M;
  fp.target_logit = fp.part_sum + int64_t(fp.splits) * p.M;
  if (p.cfg.stats) {
    fp.part_r = fp.target_logit + p.M;
    fp.part_tot = fp.part_r + int64_t(fp.splits) * p.M;
    fp.part_arg = reinterpret_cast<int32_t*>(fp.part_tot + int64_t(fp.splits) * p.M);
  }

  Launch launch{enc, s.device.index};
  for (auto& a : inputs) {
    enc.set_input_array(a);
  }
  enc.set_output_array(parts);
  // Kernels whose targets come from gather_targets (forward) find none here.
  FwdParams kp = fp;
  if (gathers_targets(wg, p)) {
    kp.target_logit = nullptr;
  }
  if (rs) {
    WgFwdParams wp{};
    wp.h_map = tensor_map(p.h, p.h_dtype, p.M, p.H, kRsTileM);
    wp.w_map = packed_map(p, kRsTileV, kWgTileK);
    wp.p = kp;
    launch(kernel_name("fwd_rs", wg_variant(p)), int64_t(fp.m_tiles) * fp.splits, kRsSmemBytes, wp,
           kWgThreads);
  } else if (wg) {
    WgFwdParams wp{};
    wp.h_map = tensor_map(p.h, p.h_dtype, p.M, p.H, kWgTileM);
    if (!p.cfg.quantized) {
      wp.w_map = tensor_map(p.w, p.w_dtype, p.V, p.H, kWgTileN);
    }
    wp.p = kp;
    launch(kernel_name(p.cfg.stats ? "fwd_ent_wg" : "fwd_wg", wg_variant(p)),
           int64_t(fp.m_tiles) * fp.splits, kWgSmemBytes, wp, kWgThreads);
  } else {
    launch(kernel_name(p.cfg.stats ? "fwd_ent" : "fwd", variant(p)),
           int64_t(fp.m_tiles) * fp.splits, kSmemBytes, fp);
  }
  return {parts, fp};
}

// Rows [r0, r0 + rows) of p as a problem of their own.
HeadProblem row_slice(const HeadProblem& p, int64_t r0, int64_t rows) {
  HeadProblem q = p;
  q.M = rows;
  q.h = static_cast<const char*>(p.h) + r0 * p.H * mx::size_of(p.h_dtype);
  q.targets = p.targets + r0;
  return q;
}

// The dh kernels' DhSplit flags (at most one per multiprocessor), zeroed once
// per call: each split tile's last piece sets its flag back to 0.
mx::array split_flags(mx::Stream s, mx::cu::CommandEncoder& enc, const HeadProblem& p) {
  if (!use_wgmma(s, p)) {
    return mx::array(0);
  }
  const int n = device_info(s.device.index).sms;
  auto flags = scratch(enc, {n}, mx::int32);
  ZeroParams z{mx::gpu_ptr<int32_t>(flags), n};
  enc.set_output_array(flags);
  Launch{enc, s.device.index}("fcce_zero", 1, 0, z);
  return flags;
}

// The vocabulary-chunked passes of the backward and of the fused forward: per
// chunk, one kernel writes dS (or P) of the chunk to an [M, chunk] buffer and
// a second adds buffer @ W[chunk] into the fp32 [M, H] accumulator.
class ChunkPasses {
 public:
  // p: the rows of this block; acc: the fp32 accumulator, whose row 0 for this
  // block is at float acc_at; buf: an [at least p.M, chunk] buffer; flags:
  // from split_flags.
  ChunkPasses(mx::Stream s, mx::cu::CommandEncoder& enc, const HeadProblem& p,
              const std::vector<mx::array>& inputs, mx::array acc, int64_t acc_at,
              mx::array buf, int64_t chunk, mx::array flags)
      : enc_(enc), launch_{enc, s.device.index}, p_(p), inputs_(inputs), acc_(std::move(acc)),
        buf_(std::move(buf)), flags_(std::move(flags)) {
    const auto ct = compute_dtype(p);
    M_ = p.M;
    chunk_ = chunk;
    wg_ = use_wgmma(s, p);
    plan_ = launch_plan(s, p);
    sms_ = plan_.sms;
    m_tiles_ = static_cast<int>(cdiv(M_, kTileM));

    ds_.h = dense(p.h, p.h_dtype, M_, p.H, p.H, ct);
    ds_.w = weight(p, ct);
    ds_.targets = p.targets;
    ds_.ds = mx::gpu_ptr<void>(buf_);
    ds_.M = M_;
    ds_.V = p.V;
    ds_.H = p.H;
    ds_.ld_ds = chunk_;
    ds_.m_tiles = m_tiles_;
    ds_.ignore_index = p.cfg.ignore_index;
    ds_.cap = p.cfg.softcap;
    ds_.gap = ct == mx::float16 ? kMaxRefGapF16 : kMaxRefGap;

    dh_.ds = dense(ds_.ds, ct, M_, 0, chunk_, ct);
    dh_.w = weight(p, ct);
    dh_.acc = mx::gpu_ptr<float>(acc_) + acc_at;
    dh_.M = M_;
    dh_.H = p.H;
    dh_.m_tiles = m_tiles_;
    if (wg_) {
      wg_ds_.h_map = tensor_map(p.h, p.h_dtype, M_, p.H, kWgTileM);
      if (!p.cfg.quantized) {  // else the producers dequantize W
        wg_ds_.w_map = tensor_map(p.w, p.w_dtype, p.V, p.H, kWgTileN);
        wg_dh_.b_map = tensor_map(p.w, p.w_dtype, p.V, p.H, 64);
      }
      rs_ = use_rs(p);
      if (rs_) {
        wg_dh_.b_map = packed_map(p, kWgTileK, kRsTileV);
        rs_p_.h_map = tensor_map(p.h, p.h_dtype, M_, p.H, kRsTileM);
        rs_p_.w_map = packed_map(p, kRsTileV, kWgTileK);
      }
    }
  }

  DsParams& ds() { return ds_; }
  DhParams& dh() { return dh_; }
  Launch& launch() { return launch_; }
  bool wgmma() const { return wg_; }
  // Vocabulary tiles of the first kernel in one chunk (its row-sum partials).
  int64_t tiles(int64_t width) const { return cdiv(width, stats_tile_width(wg_, rs_)); }

  // The first kernel on chunk [v0, v0 + width): dS, or P in the fused forward.
  void first(int64_t v0, int64_t width, const std::vector<mx::array>& outs) {
    ds_.v0 = v0;
    ds_.width = width;
    for (auto& a : inputs_) {
      enc_.set_input_array(a);
    }
    enc_.set_output_array(buf_);
    for (auto& a : outs) {
      enc_.set_output_array(a);
    }
    if (rs_ && ds_.part_sum) {
      rs_p_.p = ds_;
      launch_(kernel_name("p_rs", wg_variant(p_)),
              std::min<int64_t>(cdiv(M_, kRsTileM) * cdiv(width, kRsTileV), sms_), kRsPSmemBytes,
              rs_p_, kWgThreads);
    } else if (wg_) {
      wg_ds_.p = ds_;
      const char* family = ds_.part_sum ? "p_wg" : ds_.g_ent ? "ds_ent_wg" : "ds_wg";
      launch_(kernel_name(family, wg_variant(p_)), std::min<int64_t>(m_tiles_ * tiles(width), sms_),
              kWgSmemBytes, wg_ds_, kWgThreads);
    } else {
      launch_(kernel_name(ds_.g_ent ? "ds_ent" : "ds", variant(p_)), m_tiles_ * tiles(width),
              kSmemBytes, ds_);
    }
  }

  // acc (+)= buffer @ W[v0 : v0 + width]: the weight rows are the K dimension.
  void second(int64_t v0, int64_t width, const std::vector<mx::array>& outs) {
    dh_.ds.cols = width;
    dh_.w.row0 = v0;
    dh_.first = v0 == 0;
    enc_.set_input_array(inputs_[1]);
    if (p_.cfg.quantized) {
      enc_.set_input_array(inputs_[inputs_.size() - 2]);
      enc_.set_input_array(inputs_.back());
    }
    // The next chunk overwrites the buffer: mark it written here so that the
    // graph orders that write after this read.
    enc_.set_output_array(buf_);
    enc_.set_output_array(acc_);
    for (auto& a : outs) {
      enc_.set_output_array(a);
    }
    if (wg_) {
      const int64_t tile_rows = rs_ ? kRsTileM : kWgTileM;
      const int64_t tiles = cdiv(M_, tile_rows) * cdiv(p_.H, rs_ ? kRsTileV : kWgTileN);
      enc_.set_output_array(flags_);
      wg_dh_.a_map = tensor_map(ds_.ds, compute_dtype(p_), M_, width, tile_rows, chunk_);
      wg_dh_.p = dh_;
      wg_dh_.v0 = v0;
      wg_dh_.width = width;
      wg_dh_.split = dh_split(tiles, width);
      launch_(kernel_name(rs_ ? "dh_rs" : "dh_wg", wg_variant(p_)),
              std::min<int64_t>(dh_units(wg_dh_.split), sms_),
              rs_ ? kRsDhSmemBytes : kWgSmemBytes, wg_dh_, kWgThreads);
    } else {
      launch_(kernel_name("dh", variant(p_)), int64_t(m_tiles_) * cdiv(p_.H, kTileN), kSmemBytes,
              dh_);
    }
  }

 private:
  // The split of the last round of a dh launch over `tiles` output tiles.
  // plan_.dh_splits caps the pieces a tile (1: none).
  DhSplit dh_split(int64_t tiles, int64_t width) {
    DhSplit sp{};
    sp.flags = mx::gpu_ptr<int32_t>(flags_);
    plan_dh_split(sp, static_cast<int>(tiles), sms_, static_cast<int>(cdiv(width, kWgTileK)),
                  plan_.dh_splits, 4);
    return sp;
  }

  mx::cu::CommandEncoder& enc_;
  Launch launch_;
  HeadProblem p_;
  LaunchPlan plan_;
  const std::vector<mx::array>& inputs_;
  mx::array acc_;
  mx::array buf_;
  mx::array flags_;
  int64_t M_ = 0, chunk_ = 0;
  int m_tiles_ = 0, sms_ = 0;
  bool wg_ = false, rs_ = false;
  DsParams ds_{};
  DhParams dh_{};
  WgDsParams wg_ds_{}, rs_p_{};
  WgDhParams wg_dh_{};
};

// The fused forward: per vocabulary chunk, P = exp(s - r) dcap and the row
// sums of exp(s - r), then gsum (+)= P @ W[chunk]; fcce_finish turns the sums
// into lse and logp and rescales gsum to softmax weights. Two GEMMs for
// forward + backward, where the plain forward + backward takes three.
//
// The row reference r: with a softcap <= kMaxFixedCap, the cap itself (an
// upper bound of every logit). Otherwise a running one: the exact row maxima
// of the first chunk (one extra chunk-wide GEMM), raised to the maximum of the
// chunks seen so far when that passes it by more than kRefStep, with acc and
// the sums rescaled then. A chunk whose logits outrun their reference by more
// than kMaxRefGap raises a flag, and a second pass, which does nothing unless
// the flag is set, redoes the chunks against the exact row maxima.
//
// fp16 P holds only e^-17 to e^11 around its reference, too little for the
// cap as reference or for a flag one per row block: fp16 heads always take the
// running reference, and each chunk has a flag of its own. A chunk that sets
// its flag raises its rows' reference to their maxima in that chunk and runs
// its P kernel again (both launches exit at once unless the flag is set)
// before its P @ W, so only that chunk is computed twice.
void forward_fused(mx::Stream s, const HeadProblem& p, const std::vector<mx::array>& inputs,
                   std::vector<mx::array>& outputs) {
  auto& enc = mx::cu::get_command_encoder(s);
  const LaunchPlan plan = launch_plan(s, p);
  const int64_t H = p.H, block = row_block(plan, p.M), chunk = backward_chunk(plan, block, p.V);
  const bool wg = use_wgmma(s, p);
  const int64_t tiles = cdiv(chunk, stats_tile_width(wg, wg && use_rs(p)));
  const bool per_chunk = compute_dtype(p) == mx::float16;
  const bool fixed = !per_chunk && p.cfg.softcap > 0.0f && p.cfg.softcap <= kMaxFixedCap;
  const int chunks = static_cast<int>(cdiv(p.V, chunk));
  auto chunk_flags = per_chunk ? scratch(enc, {chunks}, mx::int32) : mx::array(0);
  auto buf = scratch(enc, {static_cast<int>(block), static_cast<int>(chunk)}, compute_dtype(p));
  // Per row block: part_sum[tiles, rows], run_sum[rows], target_logit[rows];
  // running reference only: part_max[tiles, rows], three rotating ref[rows]
  // and the flag.
  const int64_t stats = tiles + 2 + (fixed ? 0 : tiles + 7);
  auto sums = scratch(enc, {static_cast<int>(stats), static_cast<int>(block)}, mx::float32);
  auto flags = split_flags(s, enc, p);
  const bool gather = gathers_targets(s, p);
  for (int64_t r0 = 0; r0 < p.M; r0 += block) {
    const int64_t M = std::min(block, p.M - r0);
    const HeadProblem pr = row_slice(p, r0, M);
    ChunkPasses passes(s, enc, pr, inputs, outputs[2], r0 * H, buf, chunk, flags);
    float* part_sum = mx::gpu_ptr<float>(sums);
    float* run_sum = part_sum + tiles * M;
    float* target_logit = run_sum + M;
    float* part_max = fixed ? nullptr : target_logit + M;
    float* ref[3] = {nullptr, nullptr, nullptr};
    int32_t* flag = nullptr;
    if (!fixed) {
      // References at an even offset and stride (part_max + tiles M is
      // part_sum + 2 (tiles + 1) M): the 4/8-bit P epilogue loads two rows'
      // at once. Three spare rows of `stats` keep the flag inside for odd M.
      const int64_t stride = M + (M & 1);
      for (int i = 0; i < 3; ++i) {
        ref[i] = part_max + tiles * M + i * stride;
      }
      flag = reinterpret_cast<int32_t*>(part_max + tiles * M + 3 * stride);
      // The first chunk's exact row maxima.
      auto [pre, fp] = lse_partials(s, pr, inputs, std::min(chunk, p.V));
      RowMaxParams rp{};
      rp.part_max = fp.part_max;
      rp.ref = ref[0];
      rp.flag = flag;
      rp.M = M;
      rp.splits = fp.splits;
      enc.set_input_array(pre);
      enc.set_output_array(sums);
      passes.launch()("fcce_row_max", cdiv(M, kThreads), 0, rp);
    }
    if (gather) {
      gather_targets(enc, passes.launch(), pr, inputs, sums, target_logit);
    }
    if (per_chunk) {
      ZeroParams z{mx::gpu_ptr<int32_t>(chunk_flags), chunks};
      enc.set_output_array(chunk_flags);
      passes.launch()("fcce_zero", 1, 0, z);
    }
    auto& ds = passes.ds();
    auto& dh = passes.dh();
    ds.part_sum = part_sum;
    ds.target_logit = gather ? nullptr : target_logit;
    ds.part_max = part_max;
    ds.flag = flag;
    dh.part_sum = part_sum;
    dh.run_sum = run_sum;
    dh.part_max = part_max;
    int k = 0;
    for (int64_t v0 = 0; v0 < p.V; v0 += chunk, ++k) {
      const int64_t width = std::min(chunk, p.V - v0);
      ds.ref = ref[k % 3];
      dh.ref_prev = ref[(k + 2) % 3];
      dh.ref_cur = ref[k % 3];
      dh.ref_next = ref[(k + 1) % 3];
      dh.sum_tiles = static_cast<int>(passes.tiles(width));
      if (per_chunk) {
        int32_t* own = mx::gpu_ptr<int32_t>(chunk_flags) + k;
        ds.flag = own;
        passes.first(v0, width, {sums, chunk_flags});
        RowMaxParams rp{};
        rp.part_max = part_max;
        rp.ref = ref[k % 3];
        rp.guard = own;
        rp.raise = 1;
        rp.M = M;
        rp.splits = dh.sum_tiles;
        enc.set_input_array(chunk_flags);
        enc.set_output_array(sums);
        passes.launch()("fcce_row_max", cdiv(M, kThreads), 0, rp);
        ds.guard = own;
        passes.first(v0, width, {sums, chunk_flags});
        ds.guard = nullptr;
      } else {
        passes.first(v0, width, {sums});
      }
      passes.second(v0, width, {sums});
    }
    const float* last_ref = ref[(k + 2) % 3];
    const float* exact = ref[k % 3];
    if (!fixed && !per_chunk) {
      ds.ref = exact;
      ds.part_max = nullptr;
      ds.guard = flag;
      dh.ref_prev = nullptr;
      dh.part_max = nullptr;
      dh.guard = flag;
      for (int64_t v0 = 0; v0 < p.V; v0 += chunk) {
        const int64_t width = std::min(chunk, p.V - v0);
        dh.sum_tiles = static_cast<int>(passes.tiles(width));
        passes.first(v0, width, {sums});
        passes.second(v0, width, {sums});
      }
    }

    FinishParams fp{};
    fp.run_sum = run_sum;
    fp.target_logit = target_logit;
    fp.targets = pr.targets;
    fp.ref = last_ref;
    fp.ref_exact = exact;
    fp.flag = per_chunk ? nullptr : flag;
    fp.logp = mx::gpu_ptr<float>(outputs[0]) + r0;
    fp.lse = mx::gpu_ptr<float>(outputs[1]) + r0;
    fp.gsum = mx::gpu_ptr<float>(outputs[2]) + r0 * H;
    fp.M = M;
    fp.V = p.V;
    fp.H = H;
    fp.cap = p.cfg.softcap;
    fp.ignore_index = p.cfg.ignore_index;
    enc.set_input_array(sums);
    enc.set_input_array(inputs[2]);
    enc.set_output_array(sums);  // the next row block reuses it
    for (auto& o : outputs) {
      enc.set_output_array(o);
    }
    passes.launch()("fcce_finish", M, 0, fp);
  }
}

} // namespace

void forward(mx::Stream s, const HeadProblem& prob, const std::vector<mx::array>& inputs,
             std::vector<mx::array>& outputs) {
  HeadProblem p = prob;
  auto& enc = begin(s, p, inputs, outputs, 3);
  if (p.cfg.fused) {
    forward_fused(s, p, inputs, outputs);
    return;
  }
  auto [parts, fp] = lse_partials(s, p, inputs, p.V);
  Launch launch{enc, s.device.index};
  if (gathers_targets(s, p)) {
    gather_targets(enc, launch, p, inputs, parts, fp.target_logit);
  }

  CombineParams cp{};
  cp.part_max = fp.part_max;
  cp.part_sum = fp.part_sum;
  cp.target_logit = fp.target_logit;
  cp.targets = p.targets;
  cp.logp = mx::gpu_ptr<float>(outputs[0]);
  cp.lse = mx::gpu_ptr<float>(outputs[1]);
  cp.M = p.M;
  cp.V = p.V;
  cp.splits = fp.splits;
  cp.ignore_index = p.cfg.ignore_index;
  if (p.cfg.stats) {
    cp.part_r = fp.part_r;
    cp.part_tot = fp.part_tot;
    cp.part_arg = fp.part_arg;
    cp.entropy = mx::gpu_ptr<float>(outputs[2]);
    cp.top1 = mx::gpu_ptr<bool>(outputs[3]);
    cp.mean = mx::gpu_ptr<float>(outputs[4]);
  }
  enc.set_input_array(parts);
  enc.set_input_array(inputs[2]);
  for (auto& o : outputs) {
    enc.set_output_array(o);
  }
  launch("fcce_combine", cdiv(p.M, kThreads), 0, cp);
}

void backward(mx::Stream s, const HeadProblem& prob, const std::vector<mx::array>& inputs,
              std::vector<mx::array>& outputs) {
  HeadProblem p = prob;
  auto& enc = begin(s, p, inputs, outputs, p.cfg.stats ? 8 : 6);
  const bool want_dw = outputs.size() > 1;
  const auto ct = compute_dtype(p);
  const int64_t H = p.H, V = p.V;
  // dW sums over every row per chunk: one block of all rows then.
  const LaunchPlan plan = launch_plan(s, p);
  const int64_t block = want_dw ? p.M : row_block(plan, p.M);
  const int64_t chunk = backward_chunk(plan, block, V, want_dw);
  auto buf = scratch(enc, {static_cast<int>(block), static_cast<int>(chunk)}, ct);
  // fp32 dh accumulates in the output itself; other dtypes need an fp32 buffer
  // (one row block's, reused).
  const bool acc_in_out = p.h_dtype == mx::float32;
  mx::array acc = acc_in_out
      ? outputs[0]
      : scratch(enc, {static_cast<int>(block), static_cast<int>(H)}, mx::float32);
  const std::string t = use_f16(p) ? "f16" : "bf16";
  auto flags = split_flags(s, enc, p);
  for (int64_t r0 = 0; r0 < p.M; r0 += block) {
    const int64_t M = std::min(block, p.M - r0);
    const HeadProblem pr = row_slice(p, r0, M);
    ChunkPasses passes(s, enc, pr, inputs, acc, acc_in_out ? r0 * H : 0, buf, chunk, flags);
    passes.ds().lse = mx::gpu_ptr<float>(inputs[3]) + r0;
    passes.ds().g = mx::gpu_ptr<float>(inputs[4]) + r0;
    passes.ds().g_lse = mx::gpu_ptr<float>(inputs[5]) + r0;
    if (p.cfg.stats) {
      passes.ds().entropy = mx::gpu_ptr<float>(inputs[6]) + r0;
      passes.ds().g_ent = mx::gpu_ptr<float>(inputs[7]) + r0;
    }
    passes.dh().out =
        static_cast<char*>(mx::gpu_ptr<void>(outputs[0])) + r0 * H * mx::size_of(p.h_dtype);
    passes.dh().out_kind = src_kind(p.h_dtype);

    DwParams wp{};
    WgDwParams wwp{};
    if (want_dw) {
      wp.ds = dense(mx::gpu_ptr<void>(buf), ct, M, 0, chunk, ct);
      wp.h = dense(pr.h, p.h_dtype, M, H, H, ct);
      wp.out = mx::gpu_ptr<void>(outputs[1]);
      wp.M = M;
      wp.H = H;
      wp.out_kind = src_kind(p.w_dtype);
      if (passes.wgmma()) {
        wwp.b_map = tensor_map(pr.h, p.h_dtype, M, H, 64);
      }
    }
    for (int64_t v0 = 0; v0 < V; v0 += chunk) {
      const int64_t width = std::min(chunk, V - v0);
      passes.first(v0, width, {});
      passes.dh().last = v0 + width >= V;
      passes.second(v0, width, {outputs[0]});
      if (!want_dw) {
        continue;
      }
      // dS^T: the dS buffer read as [k = m][v], h as [k = m][h].
      const int64_t v_tiles = cdiv(width, kTileN);
      wp.ds.cols = width;
      wp.v0 = v0;
      wp.width = width;
      wp.v_tiles = static_cast<int>(v_tiles);
      enc.set_input_array(inputs[0]);
      enc.set_output_array(buf);
      enc.set_output_array(outputs[1]);
      if (passes.wgmma()) {
        wwp.a_map = tensor_map(wp.ds.ptr, ct, M, width, 64, chunk);
        wwp.p = wp;
        passes.launch()(kernel_name("dw_wg", t), v_tiles * cdiv(H, kWgTileN), kWgSmemBytes, wwp,
                        kWgThreads);
      } else {
        passes.launch()(kernel_name("dw", t), v_tiles * cdiv(H, kTileN), kSmemBytes, wp);
      }
    }
  }
}

void fused_dh(mx::Stream s, const HeadProblem& prob, const std::vector<mx::array>& inputs,
              std::vector<mx::array>& outputs) {
  HeadProblem p = prob;
  auto& enc = begin(s, p, inputs, outputs, 7);
  FusedDhParams fp{};
  fp.w = weight(p, mx::float32); // fp32 compute type: every dense kind reads as itself
  fp.targets = p.targets;
  fp.gsum = mx::gpu_ptr<float>(inputs[0]);
  fp.logp = mx::gpu_ptr<float>(inputs[3]);
  fp.lse = mx::gpu_ptr<float>(inputs[4]);
  fp.g = mx::gpu_ptr<float>(inputs[5]);
  fp.g_lse = mx::gpu_ptr<float>(inputs[6]);
  fp.out = mx::gpu_ptr<void>(outputs[0]);
  fp.M = p.M;
  fp.V = p.V;
  fp.H = p.H;
  fp.cap = p.cfg.softcap;
  fp.ignore_index = p.cfg.ignore_index;
  fp.out_kind = src_kind(p.h_dtype);
  for (auto& a : inputs) {
    enc.set_input_array(a);
  }
  enc.set_output_array(outputs[0]);
  Launch{enc, s.device.index}("fcce_fused_dh", p.M, 0, fp);
}

} // namespace flash_cce::cuda
