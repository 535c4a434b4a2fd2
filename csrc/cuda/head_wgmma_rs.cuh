// Hopper kernels for a 4- or 8-bit head with W as the register operand, so
// the dequantized W never goes through shared memory: the forward, and the
// fused forward's P and dh GEMMs.
// Forward and P compute the logits transposed, S^T = W h^T. Per block: 256
// rows of h (the wgmma N) against tiles of 128 rows of W, 64 per consumer
// warpgroup (the wgmma M). One producer thread streams h (128-byte swizzle,
// the B operand) and the packed words of W (swizzled rows) with TMA, and the
// producer threads copy the k-step's scales and biases into the stage; each
// consumer thread turns the packed words of its two rows straight into A
// fragments (k-step n + 1 while the tensor cores run k-step n), so no
// dequantized tile is stored. The forward's epilogue reduces each logits
// column (one row of h) over the tile's rows of W: a butterfly over the 8 lanes
// that share a column leaves each lane 8 columns, whose running (max, sum)
// live in shared memory per warp.
// dh computes dh^T = W^T dS^T with fragments from ldmatrix.trans (dh_rs_body).
#pragma once

#include "head_wgmma.cuh"

namespace flash_cce::cuda {

namespace {

#ifdef FLASH_CCE_WGMMA

constexpr int RBN = kRsTileM, RBV = kRsTileV;

template <class T>
__device__ __forceinline__ void wgmma_rs(float* d, const uint32_t* a, uint64_t db, int acc) {
  if constexpr (std::is_same_v<T, __half>) {
    wgmma_f16_rs(d, a, db, acc);
  } else {
    wgmma_bf16_rs(d, a, db, acc);
  }
}

// Scales and biases of one k-step for a thread's two rows of W, for the
// groups of its first and second 32 columns (equal unless group_size is 32):
// pairs of T for 4-bit codes, floats for 8-bit ones. They come from the stage,
// where the producer put the k-step's first two groups of 16-bit values for
// each of the tile's rows (16 bytes a row): global loads in the consumers' k
// loop would hold up the next wgmma.fence, which waits for them.
template <int QB>
struct RsScales {
  using S = std::conditional_t<QB == 4, uint32_t, float>;
  S scale[2][2], bias[2][2];

  template <class T>
  __device__ __forceinline__ void load(const unsigned char* sc, const unsigned char* bi,
                                       const int (&trow)[2], int kind, int lg) {
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      const uint32_t sv = *reinterpret_cast<const uint32_t*>(sc + trow[ri] * 16);
      const uint32_t bv = *reinterpret_cast<const uint32_t*>(bi + trow[ri] * 16);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // Columns 32 h.. are the second group only when groups are 32 wide.
        const int shift = h && lg == 5 ? 16 : 0;
        const uint32_t s16 = (sv >> shift) & 0xffff, b16 = (bv >> shift) & 0xffff;
        const float s = half_bits(s16, kind), b = half_bits(b16, kind);
        if constexpr (QB == 4) {
          scale[ri][h] = pack2<T>(s, s);
          bias[ri][h] = pack2<T>(b, b);
        } else {
          scale[ri][h] = s;
          bias[ri][h] = b;
        }
      }
    }
  }
};

// The 16 bytes at `byte` of row `row` of a packed W tile with R-byte rows.
// TMA stores those tiles with the swizzle of span R (32, 64 or 128 bytes):
// chunk c of a row lands at c ^ (address bits 7..), which puts the rows that
// a warp reads at once in different banks (plain rows at a 64- or 128-byte
// pitch would fall on the same banks and serialize up to 4 ways).
template <int R>
__device__ __forceinline__ const unsigned char* tile_at(const unsigned char* tile, int row,
                                                        int byte) {
  const int off = row * R + byte;
  return tile + (off ^ (((off >> 7) & (R / 16 - 1)) << 4));
}

template <int R, class V = uint4>
__device__ __forceinline__ V tile_load(const unsigned char* tile, int row, int byte) {
  return *reinterpret_cast<const V*>(tile_at<R>(tile, row, byte));
}

// The A fragments of one k-step (four k16 slices, four registers each) from
// the packed rows in shared memory. Fragment register r of slice kk holds the
// pair of columns 16 kk + 8 (r / 2) + 2 (lane % 4) + {0, 1} of row r % 2.
template <class T, int QB>
__device__ __forceinline__ void rs_dequant(uint32_t (&a)[4][4], const unsigned char* wtile,
                                           const int (&trow)[2], int lane,
                                           const RsScales<QB>& sc) {
  constexpr int kRowBytes = WBK * QB / 8;
  const int t = lane & 3;
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    if constexpr (QB == 4) {
      // Byte t of a word holds codes 2t and 2t + 1: one permute puts them in
      // the low nibbles of the two halves.
      const uint32_t sel = t | (t << 4) | ((4 + t) << 8) | ((4 + t) << 12);
      const uint4 lo = tile_load<kRowBytes>(wtile, trow[ri], 0);
      const uint4 hi = tile_load<kRowBytes>(wtile, trow[ri], 16);
      const uint32_t wv[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint32_t word = wv[2 * kk + half];
          a[kk][ri + 2 * half] = dequant_pair<T>(__byte_perm(word, word >> 4, sel),
                                                 sc.scale[ri][kk >> 1], sc.bias[ri][kk >> 1]);
        }
    } else {
      // Columns 2t, 2t + 1 of a 16-column slice are bytes 2 (t % 2) and
      // 2 (t % 2) + 1 of its word t / 2 (and of word 2 + t / 2 for + 8).
      const int lo = 2 * (t & 1);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint4 v = tile_load<kRowBytes>(wtile, trow[ri], 16 * kk);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint32_t word = half ? ((t & 2) ? v.w : v.z) : ((t & 2) ? v.y : v.x);
          const float s = sc.scale[ri][kk >> 1], b = sc.bias[ri][kk >> 1];
          a[kk][ri + 2 * half] =
              pack2<T>(fmaf(s, code8(word, lo), b), fmaf(s, code8(word, lo + 1), b));
        }
      }
    }
  }
}

// (max, sum of exp) pairs; maxima start at a finite floor so that merging two
// empty pairs needs no special case.
constexpr float kRsFloor = -1e30f;

__device__ __forceinline__ void rs_merge(float& m, float& s, float om, float os) {
  const float hi = fmaxf(m, om), lo = fminf(m, om);
  const float shi = m >= om ? s : os, slo = m >= om ? os : s;
  s = shi + slo * exp_ftz(lo - hi);
  m = hi;
}

// One butterfly level over the (max, sum) pairs of column c at acc[(c / 2) * 4
// + c % 2] and acc[(c / 2) * 4 + 2 + c % 2]: of the 2W live columns, a lane
// keeps the upper W if its bit (16, 8 or 4 for W = 32, 16, 8) is set, else the
// lower W, merged with the partner's copy by merge(m, sum, other_m, other_sum),
// in columns 0..W-1.
template <int W, class Merge>
__device__ __forceinline__ void rs_butterfly(float (&acc)[128], int lane, Merge&& merge) {
  const bool upper = lane & (W / 2);
#pragma unroll
  for (int i = 0; i < W; ++i) {
    float& ml = acc[(i / 2) * 4 + i % 2];
    float& sl = acc[(i / 2) * 4 + 2 + i % 2];
    const float mu = acc[((i + W) / 2) * 4 + (i + W) % 2];
    const float su = acc[((i + W) / 2) * 4 + 2 + (i + W) % 2];
    float m = upper ? mu : ml, sum = upper ? su : sl;
    const float om = __shfl_xor_sync(0xffffffff, upper ? ml : mu, W / 2);
    const float os = __shfl_xor_sync(0xffffffff, upper ? sl : su, W / 2);
    merge(m, sum, om, os);
    ml = m;
    sl = sum;
  }
}

// The three levels, over lane bits 4, 3, 2 (g bits 2, 1, 0): online (max, sum)
// pairs (the forward), or sums that add and maxima that take the max (the
// fused forward's P tiles, whose exponentials share a fixed row reference).
template <bool ONLINE>
__device__ __forceinline__ void rs_butterflies(float (&acc)[128], int lane) {
  const auto merge = [](float& m, float& s, float om, float os) {
    if constexpr (ONLINE) {
      rs_merge(m, s, om, os);
    } else {
      m = fmaxf(m, om);
      s += os;
    }
  };
  rs_butterfly<32>(acc, lane, merge);
  rs_butterfly<16>(acc, lane, merge);
  rs_butterfly<8>(acc, lane, merge);
}

// A stage of the forward and P kernels: the h tile (TMA, 128-byte swizzle),
// the W tile's packed words (8 KB at 8 bits) and its rows' scales and biases
// for the k-step (16 bytes a row).
struct RsStage {
  unsigned char* base;
  __device__ __forceinline__ unsigned char* h() const { return base; }
  __device__ __forceinline__ unsigned char* w() const { return base + RBN * WBK * 2; }
  __device__ __forceinline__ unsigned char* scales() const { return w() + RBV * WBK; }
  __device__ __forceinline__ unsigned char* biases() const { return scales() + RBV * 16; }
};

// The A fragments of one k-step of the forward and P kernels from stage st:
// the rows' scales and biases, then their packed words.
template <class T, int QB>
__device__ __forceinline__ void rs_fragments(uint32_t (&a)[4][4], const RsStage& st,
                                             const int (&trow)[2], int lane, int kind, int lg) {
  RsScales<QB> sc;
  sc.template load<T>(st.scales(), st.biases(), trow, kind, lg);
  rs_dequant<T, QB>(a, st.w(), trow, lane, sc);
}

// The 16-bit scale and bias of W row `row` for k-step kt (and the next group's
// in the high half when groups are 32 wide, two a k-step), 0 past the edges.
__device__ __forceinline__ void rs_fetch_sb(const Operand& w, int64_t row, int kt, int lg,
                                            uint32_t (&v)[2]) {
  const int64_t groups = w.cols >> lg, g0 = (int64_t(kt) * WBK) >> lg;
  const bool in = row < w.rows;
#pragma unroll
  for (int a = 0; a < 2; ++a) {
    const uint16_t* at = static_cast<const uint16_t*>(a ? w.biases : w.scales) + row * groups + g0;
    const uint32_t lo = in && g0 < groups ? __ldg(at) : 0;
    const uint32_t hi = in && lg == 5 && g0 + 1 < groups ? __ldg(at + 1) : 0;
    v[a] = lo | (hi << 16);
  }
}

// One k-step of the forward and P producers: thread 0 loads the h tile of rows
// m0.. and the packed W tile of rows vt * RBV.. with TMA; every producer thread
// stores its row's scales and biases (cur, fetched a k-step earlier), then
// takes next as cur.
template <int QB>
__device__ __forceinline__ void rs_produce(const WgPipe& pipe, const CUtensorMap* h_map,
                                           const CUtensorMap* w_map, unsigned char* stages,
                                           int m0, int vt, int kt, uint32_t (&cur)[2],
                                           const uint32_t (&next)[2], int& s, int& phase) {
  constexpr int kWBytes = RBV * WBK * QB / 8;
  const RsStage st{stages + s * kRsStageBytes};
  mbar_wait(&pipe.empty[s], phase ^ 1);
  if (pipe.tid == 0) {
    mbar_expect_tx(&pipe.full[s], RBN * WBK * 2 + kWBytes);
    tma_load(st.h(), h_map, &pipe.full[s], kt * WBK, m0);
    tma_load(st.w(), w_map, &pipe.full[s], kt * (WBK * QB / 32), vt * RBV);
  }
  *reinterpret_cast<uint32_t*>(st.scales() + pipe.tid * 16) = cur[0];
  *reinterpret_cast<uint32_t*>(st.biases() + pipe.tid * 16) = cur[1];
  mbar_arrive(&pipe.full[s]);
  cur[0] = next[0];
  cur[1] = next[1];
  if (++s == WST) {
    s = 0;
    phase ^= 1;
  }
}

// One tile's k loop in the consumers of the register-operand kernels: two
// fragment buffers by k-step parity, so that the MMAs of step kt run while
// build(f, stage) makes the fragments of kt + 1. The loop is unrolled twice
// with a guard, as a plain unroll makes ptxas serialize the MMAs. b_tile(stage)
// is that stage's B operand (128-byte swizzle). Releases every stage it used.
template <class T, class Build, class BTile>
__device__ __forceinline__ void rs_tile_mainloop(const WgPipe& pipe, float (&acc)[128],
                                                 uint32_t (&frag)[2][4][4], int kt_count,
                                                 int lane, int& s, int& phase, Build&& build,
                                                 BTile&& b_tile) {
  mbar_wait(&pipe.full[s], phase);
  build(frag[0], s);
  int prev = -1;
  auto step = [&](auto parity, int kt) {
    constexpr int PB = decltype(parity)::value;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      wgmma_rs<T>(acc, frag[PB][kk], wg_desc(b_tile(s) + kk * 32, false), kt > 0 || kk > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
    if (prev >= 0 && lane == 0) {
      mbar_arrive(&pipe.empty[prev]);
    }
    prev = s;
    if (++s == WST) {
      s = 0;
      phase ^= 1;
    }
    if (kt + 1 < kt_count) {
      mbar_wait(&pipe.full[s], phase);
      build(frag[PB ^ 1], s);
    }
  };
  for (int kt = 0; kt < kt_count; kt += 2) {
    step(std::integral_constant<int, 0>{}, kt);
    if (kt + 1 < kt_count) {
      step(std::integral_constant<int, 1>{}, kt + 1);
    }
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  if (lane == 0) {
    mbar_arrive(&pipe.empty[prev]);
  }
}

// The forward epilogue of one tile, in place: acc[j * 4 + ri * 2 + e] holds
// the logit of W row vrow0 + 8 ri and h row 8 j + 2 t + e; each (ri = 0, 1)
// pair becomes its (max, sum of exp) in slots ri = 0 and 1. The softcap is a
// template branch; the target logits come from a gather pass (target_body).
template <bool CAP>
__device__ __forceinline__ void fwd_rs_pairs(const FwdParams& p, float (&acc)[128], int vrow0) {
  const int V = static_cast<int>(p.V);
  if constexpr (CAP) {
    softcap_all(acc, p.cap);
  }
  const bool in0 = vrow0 < V, in1 = vrow0 + 8 < V;
#pragma unroll
  for (int j = 0; j < 32; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float x0 = in0 ? acc[j * 4 + e] : kRsFloor;
      const float x1 = in1 ? acc[j * 4 + 2 + e] : kRsFloor;
      // The pair's (max, sum) in place of its two logits.
      const float hi = fmaxf(x0, x1);
      acc[j * 4 + e] = hi;
      acc[j * 4 + 2 + e] = hi == kRsFloor ? 0.0f : 1.0f + exp_ftz(fminf(x0, x1) - hi);
    }
}

// The forward's producer warpgroup: thread 0 streams h and the packed words
// with TMA; thread r copies the scales and biases of row r of the W tile,
// loaded a k-step ahead.
template <int QB>
__device__ __forceinline__ void fwd_rs_produce(const WgFwdParams& P, const WgPipe& pipe, int m0, int t_begin,
                                               int t_end, int kt_count, int lg) {
  const FwdParams& p = P.p;
  uint32_t cur[2], next[2] = {0, 0};
  rs_fetch_sb(p.w, int64_t(t_begin) * RBV + pipe.tid, 0, lg, cur);
  int s = 0, phase = 0;
  for (int vt = t_begin; vt < t_end; ++vt)
    for (int kt = 0; kt < kt_count; ++kt) {
      const bool last = kt + 1 == kt_count;
      if (!(last && vt + 1 == t_end)) {
        rs_fetch_sb(p.w, int64_t(last ? vt + 1 : vt) * RBV + pipe.tid, last ? 0 : kt + 1, lg, next);
      }
      rs_produce<QB>(pipe, &P.h_map, &P.w_map, pipe.base, m0, vt, kt, cur, next, s, phase);
    }
}

// One tile's column (max, sum) from `fwd_rs_pairs` into the warp's running
// (max, sum) per column of h. Butterfly: at each level a lane keeps the half of
// its columns that its bit selects and merges in the partner's copy; slot i
// (0..7) then holds column c = 8 g + i: h row 32 g + 8 (i / 2) + 2 t + i % 2.
__device__ __forceinline__ void fwd_rs_tile_stats(float (&acc)[128], float2* stats, int warp, int lane, int t,
                                                  int g) {
  rs_butterflies<true>(acc, lane);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int col = 32 * g + 8 * (i / 2) + 2 * t + i % 2;
    float2& st = stats[warp * RBN + col];
    float m = st.x, sum = st.y;
    rs_merge(m, sum, acc[(i / 2) * 4 + i % 2], acc[(i / 2) * 4 + 2 + i % 2]);
    st = make_float2(m, sum);
  }
}

// One column per thread: the 8 warps' partials merged into part_max / part_sum.
__device__ __forceinline__ void fwd_rs_put_stats(const FwdParams& p, const float2* stats, int m0, int split,
                                                 int col) {
  float m = kRsFloor, sum = 0.0f;
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    const float2 st = stats[w * RBN + col];
    rs_merge(m, sum, st.x, st.y);
  }
  if (m0 + col < p.M) {
    p.part_max[int64_t(split) * p.M + m0 + col] = m;
    p.part_sum[int64_t(split) * p.M + m0 + col] = sum;
  }
}

template <class T, int QB>
__device__ __forceinline__ void fwd_rs_body(const WgFwdParams& P) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[WST], empty[WST];
  const FwdParams& p = P.p;
  const WgPipe pipe = wg_setup(smem_raw, full, empty, 1 + 128);
  unsigned char* stages = pipe.base;
  auto stage = [&](int s) { return RsStage{stages + s * kRsStageBytes}; };
  // Per warp and column of h: the running (max, sum) of its lanes' rows.
  float2* stats = reinterpret_cast<float2*>(stages + WST * kRsStageBytes);

  const auto [mt, split] = fwd_block(p, blockIdx.x);
  const int m0 = mt * RBN;
  const int t_begin = split * p.tiles_per_split;
  const int t_end = min(p.v_tiles, t_begin + p.tiles_per_split);
  const int kt_count = static_cast<int>((p.H + WBK - 1) / WBK);
  const int lg = __ffs(p.w.group_size) - 1;
  if (pipe.wg == 0) {
    wg_producer_regs<0>();
    fwd_rs_produce<QB>(P, pipe, m0, t_begin, t_end, kt_count, lg);
    return;
  }
  wg_consumer_regs<0>();
  const int ct = threadIdx.x - 128; // consumer thread, 0..255
  const int warp = ct >> 5, lane = ct & 31, t = lane & 3, g = lane >> 2;
  for (int i = ct; i < RBN * 8; i += 256) {
    stats[i] = make_float2(kRsFloor, 0.0f);
  }
  asm volatile("bar.sync 1, 256;\n" ::: "memory");

  // This thread's rows of the W tile: the A fragment rows g and g + 8 of its warp.
  const int trow[2] = {(pipe.wg - 1) * 64 + (lane >> 2) + (warp & 3) * 16,
                       (pipe.wg - 1) * 64 + (lane >> 2) + (warp & 3) * 16 + 8};
  float acc[128];
  // Two fragment buffers, by k-step parity: the MMAs of step kt run while the
  // fragments of kt + 1 are built.
  uint32_t frag[2][4][4];
  int s = 0, phase = 0;
  auto build = [&](uint32_t(&f)[4][4], int st) {
    rs_fragments<T, QB>(f, stage(st), trow, lane, p.w.sb_kind, lg);
  };
  for (int vt = t_begin; vt < t_end; ++vt) {
    rs_tile_mainloop<T>(pipe, acc, frag, kt_count, lane, s, phase, build,
                        [&](int st) { return stage(st).h(); });
    // Epilogue. acc[j * 4 + ri * 2 + e]: W row trow[ri], h row 8 j + 2 t + e.
    // Rows of W in 32 bits (V fits in int).
    const int vrow0 = vt * RBV + trow[0];
    if (p.cap > 0.0f) {
      fwd_rs_pairs<true>(p, acc, vrow0);
    } else {
      fwd_rs_pairs<false>(p, acc, vrow0);
    }
    fwd_rs_tile_stats(acc, stats, warp, lane, t, g);
  }
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
  fwd_rs_put_stats(p, stats, m0, split, ct);
}

// dh (+)= dS[:, chunk] . W[chunk] with W as the register operand: dh^T =
// W^T dS^T, per block 128 columns of h (64 per consumer warpgroup, the wgmma
// M) against 256 rows of dS (the wgmma N), over the chunk's rows of W in
// k-steps of 64. Thread 0 streams dS (128-byte swizzle) and the packed words of
// W (64 rows x 128 columns) with TMA; producer thread v < 64 copies the 16-bit
// scales and biases of the k-step's row v for the block's (up to 4) column
// groups into the stage, per group in the order of dh_sb_slot, so that the 16
// rows one lane's fragments need are 32 contiguous bytes.
// Row v = 16 kk + 8 half + 2 t + b of a k-step (the lanes with t = v % 8 / 2
// use it) sits at slot 16 t + 4 kk + 2 half + b of its group's 64.
__device__ __forceinline__ int dh_sb_slot(int v) {
  return 16 * ((v >> 1) & 3) + 4 * (v >> 4) + 2 * ((v >> 3) & 1) + (v & 1);
}

struct RsDhStage {
  static constexpr int kDs = RBN * WBK * 2; // dS tile, 32 KB
  static constexpr int kW = WBK * RBV;      // packed W rows, 8 KB at 8 bits
  static constexpr int kSb = 4 * WBK * 2;   // up to 4 groups of 16-bit values
  static_assert(kDs + kW + 2 * kSb <= kRsDhStageBytes, "dh stage size");
  unsigned char* base;
  __device__ __forceinline__ unsigned char* ds() const { return base; }
  __device__ __forceinline__ unsigned char* w() const { return base + kDs; }
  __device__ __forceinline__ uint16_t* scales() const {
    return reinterpret_cast<uint16_t*>(base + kDs + kW);
  }
  __device__ __forceinline__ uint16_t* biases() const { return scales() + kSb / 2; }
};

// Two 16-bit values of kind `kind` (the low one first) as a pair of T.
template <class T>
__device__ __forceinline__ uint32_t pair_as(uint32_t raw, int kind) {
  constexpr int kT = std::is_same_v<T, __half> ? kF16 : kBF16;
  if (kind == kT) {
    return raw;
  }
  return pack2<T>(half_bits(raw & 0xffff, kind), half_bits(raw >> 16, kind));
}

// The A fragments of one k-step of the dh GEMM come from ldmatrix.trans on
// the packed bytes: an 8 x 8 matrix of 16-bit units is 8 rows of W (k) by 16
// bytes, and lane (g, t) receives unit g of rows 2 t and 2 t + 1, the low
// half from the first. Fragment register r of slice kk is A row g + 8 (r % 2)
// with k rows 16 kk + 8 (r / 2) + 2 t + {0, 1}, so A rows are assigned to
// columns of h so that both of a lane's rows sit in its unit:
// - 8 bits: a unit is 2 columns, a 16-byte row the warp's 16 columns;
// - 4 bits: a unit is 4 columns, a 16-byte row 32 columns shared by warps 2i
//   and 2i + 1, the even one taking the first two columns of each unit.
// Either way a lane's two columns are adjacent (ri = 0, 1).
template <int QB>
__device__ __forceinline__ int dh_col(int warp, int g, int ri) {
  return QB == 8 ? 16 * (warp & 3) + 2 * g + ri
                 : 32 * ((warp & 3) >> 1) + 4 * g + 2 * (warp & 1) + ri;
}

template <class T, int QB>
__device__ __forceinline__ void rs_dh_dequant(uint32_t (&a)[4][4], const RsDhStage& st,
                                              int wg_col, int warp, int lane, int group,
                                              int kind) {
  constexpr int kRowBytes = RBV * QB / 8;
  const int t = lane & 3;
  // The warp's 16-byte column of the packed tile.
  const int byte0 = (wg_col + (QB == 8 ? 16 * (warp & 3) : 32 * ((warp & 3) >> 1))) * QB / 8;
  // The lane's 16 scales and biases (dh_sb_slot): word 2 kk + half holds the
  // pair of rows of fragment registers 2 half, 2 half + 1 of slice kk.
  uint32_t sw[8], bw[8];
  {
    const uint4* sp = reinterpret_cast<const uint4*>(st.scales() + group * WBK + 16 * t);
    const uint4* bp = reinterpret_cast<const uint4*>(st.biases() + group * WBK + 16 * t);
    const uint4 s0 = sp[0], s1 = sp[1], b0 = bp[0], b1 = bp[1];
    sw[0] = s0.x, sw[1] = s0.y, sw[2] = s0.z, sw[3] = s0.w;
    sw[4] = s1.x, sw[5] = s1.y, sw[6] = s1.z, sw[7] = s1.w;
    bw[0] = b0.x, bw[1] = b0.y, bw[2] = b0.z, bw[3] = b0.w;
    bw[4] = b1.x, bw[5] = b1.y, bw[6] = b1.z, bw[7] = b1.w;
  }
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    // Lane L addresses row L % 8 of matrix L / 8: slice 2 q + L / 16, rows
    // + 8 ((L / 8) % 2).
    uint32_t r[4];
    ldsm_x4_t(r, tile_at<kRowBytes>(st.w(), 32 * q + 8 * (lane >> 3) + (lane & 7), byte0));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int kk = 2 * q + i / 2, half = i % 2;
      const uint32_t sraw = sw[2 * kk + half], braw = bw[2 * kk + half];
      if constexpr (QB == 4) {
        // Nibble 2 (warp % 2) + ri of each half.
        const uint32_t sc = pair_as<T>(sraw, kind), bi = pair_as<T>(braw, kind);
        const int shift = 8 * (warp & 1);
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
          a[kk][2 * half + ri] = dequant_pair<T>(r[i] >> (shift + 4 * ri), sc, bi);
        }
      } else {
        // Bytes: (row 2t, col 2g), (2t, 2g + 1), (2t + 1, 2g), (2t + 1, 2g + 1).
        const float s0 = half_bits(sraw & 0xffff, kind), s1 = half_bits(sraw >> 16, kind);
        const float b0 = half_bits(braw & 0xffff, kind), b1 = half_bits(braw >> 16, kind);
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
          a[kk][2 * half + ri] =
              pack2<T>(fmaf(s0, code8(r[i], ri), b0), fmaf(s1, code8(r[i], 2 + ri), b1));
        }
      }
    }
  }
}

// Word of column c (of a warpgroup's 64) of row r (of a piece's 32) in an
// epilogue piece: 16-byte units XOR the row, and 8-byte halves swapped in rows
// with bit 1 set, so that the fragments' pair stores and the rows' 16-byte
// loads both spread over the banks.
constexpr int kDhPieceFloats = 32 * 64;
__device__ __forceinline__ int dh_piece_unit(int r, int c) {
  return 64 * r + 4 * ((c >> 2) ^ (r & 7));
}
__device__ __forceinline__ int dh_piece_word(int r, int c) {
  return dh_piece_unit(r, c) + ((c & 3) ^ (r & 2));
}

__device__ __forceinline__ RsDhStage rs_dh_stage(const WgPipe& pipe, int s) {
  return RsDhStage{pipe.base + s * kRsDhStageBytes};
}

// The dh kernels' producer warpgroup: thread v < WBK copies row v's scales and
// biases of each k-step (loaded a k-step ahead) into the stage and, thread 0,
// starts the TMA copies of dS and W; the others fold the row sums.
template <int QB>
__device__ __forceinline__ void dh_rs_produce(const WgDhParams& P, const WgPipe& pipe, int m_tiles,
                                              int units, int kt_count, int lg) {
  const DhParams& p = P.p;
  constexpr int kWBytes = WBK * RBV * QB / 8;
  if (pipe.tid >= WBK) {
    fold_row_sums(p, m_tiles, RBN, pipe.tid - WBK, 128 - WBK);
    return;
  }
  const int64_t groups = p.w.cols >> lg;
  const int block_groups = max(1, RBV >> lg);
  auto fetch = [&](int t, int kt, uint32_t (&v)[2][4]) {
    const int64_t row = P.v0 + int64_t(kt) * WBK + pipe.tid;
    const int64_t g0 = int64_t(t / m_tiles) * RBV >> lg;
#pragma unroll
    for (int a = 0; a < 2; ++a) {
      const uint16_t* src = static_cast<const uint16_t*>(a ? p.w.biases : p.w.scales);
#pragma unroll
      for (int gi = 0; gi < 4; ++gi) {
        const bool ok = gi < block_groups && row < p.w.rows && g0 + gi < groups;
        v[a][gi] = ok ? __ldg(src + row * groups + g0 + gi) : 0;
      }
    }
  };
  uint32_t cur[2][4], next[2][4] = {};
  int s = 0, phase = 0;
  if (int(blockIdx.x) < units) {
    const DhUnit u = dh_unit(P.split, blockIdx.x, kt_count);
    fetch(u.tile, u.kt0, cur);
  }
  for (int i = blockIdx.x; i < units; i += gridDim.x) {
    const DhUnit u = dh_unit(P.split, i, kt_count);
    const int m0 = (u.tile % m_tiles) * RBN, n0 = (u.tile / m_tiles) * RBV;
    for (int kt = u.kt0; kt < u.kt1; ++kt) {
      const bool last = kt + 1 == u.kt1;
      if (!last) {
        fetch(u.tile, kt + 1, next);
      } else if (i + int(gridDim.x) < units) {
        const DhUnit n = dh_unit(P.split, i + gridDim.x, kt_count);
        fetch(n.tile, n.kt0, next);
      }
      mbar_wait(&pipe.empty[s], phase ^ 1);
      const RsDhStage st = rs_dh_stage(pipe, s);
      if (pipe.tid == 0) {
        mbar_expect_tx(&pipe.full[s], RsDhStage::kDs + kWBytes);
        tma_load(st.ds(), &P.a_map, &pipe.full[s], kt * WBK, m0);
        tma_load(st.w(), &P.b_map, &pipe.full[s], n0 * QB / 32,
                 static_cast<int>(P.v0 + int64_t(kt) * WBK));
      }
#pragma unroll
      for (int gi = 0; gi < 4; ++gi) {
        st.scales()[gi * WBK + dh_sb_slot(pipe.tid)] = static_cast<uint16_t>(cur[0][gi]);
        st.biases()[gi * WBK + dh_sb_slot(pipe.tid)] = static_cast<uint16_t>(cur[1][gi]);
      }
      mbar_arrive(&pipe.full[s]);
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int gi = 0; gi < 4; ++gi) {
          cur[a][gi] = next[a][gi];
        }
      if (++s == WST) {
        s = 0;
        phase ^= 1;
      }
    }
  }
}

// The dh epilogue of one tile: acc[j * 4 + ri * 2 + e] is column wg_col +
// dh_col(ri) of the tile, row 8 j + 2 t + e. Through shared memory in pieces of
// 32 rows, so that each thread adds 4 adjacent columns of one row and a warp's
// updates cover whole 32-byte sectors (4-bit columns leave every other 8 bytes
// of a warp's row to the neighbouring warp, which doubled the L2's reductions).
template <int QB>
__device__ __forceinline__ void dh_rs_epilogue(const DhParams& p, const float (&acc)[128], const WgPipe& pipe,
                                               float* out_buf, const float* scales, const PieceUpdate& up,
                                               int m0, int n0, int wg_col, int ct, int warp, int t4, int g) {
  const int wgi = pipe.wg - 1, wct = ct & 127;
  const int col = dh_col<QB>(warp, g, 0);
#pragma unroll
  for (int piece = 0; piece < RBN / 32; ++piece) {
    float* buf = out_buf + (2 * wgi + (piece & 1)) * kDhPieceFloats;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = 4 * piece + jj;
        *reinterpret_cast<float2*>(buf + dh_piece_word(8 * jj + 2 * t4 + e, col)) =
            make_float2(acc[j * 4 + e], acc[j * 4 + 2 + e]);
      }
    // Two buffers: a thread writes this one again two pieces later, after
    // the next piece's barrier, which every reader of this piece passes.
    asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wgi) : "memory");
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = (128 * i + wct) >> 4, chunk = wct & 15;
      const float4 w = *reinterpret_cast<const float4*>(buf + dh_piece_unit(r, 4 * chunk));
      const bool swap = (r >> 1) & 1;
      const float4 v = swap ? make_float4(w.z, w.w, w.x, w.y) : w;
      const int64_t gm = m0 + 32 * piece + r, c = n0 + wg_col + 4 * chunk;
      if (gm < p.M && c < p.H) {
        dh_update4(p, gm, c, v, scales[32 * piece + r], up.first, up.last);
      }
    }
  }
}

template <class T, int QB>
__device__ __forceinline__ void dh_rs_body(const WgDhParams& P) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[WST], empty[WST];
  const DhParams& p = P.p;
  if (p.guard && *p.guard == 0) {
    return;
  }
  // Full: the TMA thread's expect_tx and one arrival per scale-copying thread.
  const WgPipe pipe = wg_setup(smem_raw, full, empty, 1 + WBK);
  const int m_tiles = static_cast<int>((p.M + RBN - 1) / RBN);
  const int units = dh_units(P.split);
  const int kt_count = static_cast<int>((P.width + WBK - 1) / WBK);
  const int lg = __ffs(p.w.group_size) - 1;
  if (pipe.wg == 0) {
    wg_producer_regs<0>();
    dh_rs_produce<QB>(P, pipe, m_tiles, units, kt_count, lg);
    return;
  }
  wg_consumer_regs<0>();
  const int ct = threadIdx.x - 128;
  const int warp = ct >> 5, lane = ct & 31, t4 = lane & 3, g = lane >> 2;
  const int wg_col = (pipe.wg - 1) * 64;
  // The warp's columns share one group (groups are >= 32 wide).
  const int group = (wg_col + dh_col<QB>(warp, 0, 0)) >> lg;
  // Per tile parity, the rows' old-value scales (row_scale), shared by column.
  float* scale_buf = reinterpret_cast<float*>(pipe.base + WST * kRsDhStageBytes);
  // Per warpgroup, two pieces of the epilogue (dh_piece_word).
  float* out_buf = scale_buf + 2 * RBN;
  float acc[128];
  uint32_t frag[2][4][4];
  int s = 0, phase = 0, parity = 0;
  auto build = [&](uint32_t(&f)[4][4], int st) {
    rs_dh_dequant<T, QB>(f, rs_dh_stage(pipe, st), wg_col, warp, lane, group, p.w.sb_kind);
  };
  for (int i = blockIdx.x; i < units; i += gridDim.x, parity ^= 1) {
    const DhUnit u = dh_unit(P.split, i, kt_count);
    const int m0 = (u.tile % m_tiles) * RBN, n0 = (u.tile / m_tiles) * RBV;
    const PieceUpdate up = piece_update(p, u);
    const float my_scale = m0 + ct < p.M ? up.scale(p, u, m0 + ct) : 0.0f;
    rs_tile_mainloop<T>(pipe, acc, frag, u.kt1 - u.kt0, lane, s, phase, build,
                        [&](int st) { return rs_dh_stage(pipe, st).ds(); });
    dh_piece_wait(P.split, u, ct);
    // Double-buffered by tile parity: a thread writes this buffer again only
    // after the next tile's barrier, which every reader of this tile passes.
    float* scales = scale_buf + parity * RBN;
    scales[ct] = my_scale;
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    dh_rs_epilogue<QB>(p, acc, pipe, out_buf, scales, up, m0, n0, wg_col, ct, warp, t4, g);
    dh_piece_done(P.split, u, ct);
  }
}

// The references of rows gm and gm + 1 (gm even) where they exist, else 0;
// the cap without running references.
__device__ __forceinline__ float2 row_refs2(const DsParams& p, int gm, bool ok0, bool ok1) {
  if (!p.ref) {
    return make_float2(p.cap, p.cap);
  }
  if (ok1) {
    return *reinterpret_cast<const float2*>(p.ref + gm);
  }
  return make_float2(ok0 ? p.ref[gm] : 0.0f, 0.0f);
}

// The fused forward's P = exp(s - r) dcap for the vocabulary chunk [v0, v0 +
// width) with W as the register operand: persistent over tiles of 256 rows of
// h x 128 rows of W (the chunk's tile fastest), the forward's pipeline and
// fragments. Per tile: P goes to ds[m, v - v0] in T (lanes g and g ^ 1 swap
// halves so that each stores a pair of adjacent v as one word), and the
// column statistics over the tile's 128 rows of W (sum of exp(s - r), max of
// s) reach part_sum / part_max[tile, m] through the butterfly and a per-warp
// table in shared memory. Stats tiles are 128 rows of W wide.
// The P kernel's producer warpgroup: thread v fetches the scales and biases of
// W row v a k-step ahead; `rs_produce` fills the stages.
template <int QB>
__device__ __forceinline__ void p_rs_produce(const WgDsParams& P, const WgPipe& pipe, int tiles, int v_tiles,
                                             int vt0, int kt_count, int lg) {
  const DsParams& p = P.p;
  auto fetch = [&](int tile, int kt, uint32_t (&v)[2]) {
    rs_fetch_sb(p.w, int64_t(vt0 + tile % v_tiles) * RBV + pipe.tid, kt, lg, v);
  };
  uint32_t cur[2], next[2] = {0, 0};
  if (int(blockIdx.x) < tiles) {
    fetch(blockIdx.x, 0, cur);
  }
  int s = 0, phase = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int m0 = (tile / v_tiles) * RBN, vt = vt0 + tile % v_tiles;
    for (int kt = 0; kt < kt_count; ++kt) {
      if (kt + 1 < kt_count) {
        fetch(tile, kt + 1, next);
      } else if (tile + int(gridDim.x) < tiles) {
        fetch(tile + gridDim.x, 0, next);
      }
      rs_produce<QB>(pipe, &P.h_map, &P.w_map, pipe.base, m0, vt, kt, cur, next, s, phase);
    }
  }
}

// The P epilogue of one tile. acc[j * 4 + ri * 2 + e]: W row v = vrow + 8 ri, h
// row 8 j + 2 t + e. Stores P = exp(s - r) dcap in T, transposed: even lanes
// rows (v, v + 1) of column e = 0, odd lanes rows (v - 1, v) of column e = 1, at
// prow + 8 j ld + 8 ri; leaves each column's (max, sum) over the thread's two
// rows in place of its logits. Indices in 32 bits: M, V and the chunk buffer's
// elements fit in int.
template <class T>
__device__ __forceinline__ void p_rs_store(const DsParams& p, float (&acc)[128], int m0, int vrow, int t,
                                           int g, bool capped, float inv_cap) {
  const int M = static_cast<int>(p.M), V = static_cast<int>(p.V);
  const bool even = (g & 1) == 0;
  const int odd = even ? 0 : 1;
  const int pc = vrow - static_cast<int>(p.v0) - odd;
  T* prow = static_cast<T*>(p.ds) + int64_t(m0 + 2 * t + odd) * p.ld_ds + pc;
  const int ld8 = 8 * static_cast<int>(p.ld_ds);
  const int rows_left = M - (m0 + 2 * t); // row 8 j + e exists iff 8 j + e < rows_left
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    // Running references (no softcap) of rows 8 j + 2 t + {0, 1}: one 8-byte load.
    const float2 refs =
        row_refs2(p, m0 + 8 * j + 2 * t, 8 * j < rows_left, 8 * j + 1 < rows_left);
    float pv[2][2]; // [ri][e]
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float ref = e == 0 ? refs.x : refs.y;
      float sum = 0.0f, tmax = -INFINITY;
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {
        float x = acc[j * 4 + ri * 2 + e];
        float dcap = 1.0f;
        if (capped) {
          const float th = tanh_fast(x * inv_cap);
          x = p.cap * th;
          dcap = 1.0f - th * th;
        }
        const bool in = vrow + 8 * ri < V;
        const float ex = in ? exp_ftz(x - ref) : 0.0f;
        sum += ex;
        tmax = in ? fmaxf(tmax, x) : tmax;
        pv[ri][e] = ex * dcap;
      }
      // Column (sum, max) of this thread's two rows, in place of the logits.
      acc[j * 4 + e] = tmax;
      acc[j * 4 + 2 + e] = sum;
    }
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      const float mine = even ? pv[ri][0] : pv[ri][1];
      const float other = __shfl_xor_sync(0xffffffff, even ? pv[ri][1] : pv[ri][0], 4);
      if (8 * j + odd < rows_left && pc + 8 * ri < p.width) {
        *reinterpret_cast<uint32_t*>(prow + j * ld8 + 8 * ri) =
            even ? pack2<T>(mine, other) : pack2<T>(other, mine);
      }
    }
  }
}

// The tile's column (max, sum) from `p_rs_store` through the butterfly (sums
// add, maxima take the max) and the per-warp table of this tile parity, to
// part_sum / part_max of row m0 + ct.
__device__ __forceinline__ void p_rs_column_stats(const DsParams& p, float (&acc)[128], float2* table,
                                                  int m0, int vl, int ct, int warp, int lane, int t, int g) {
  rs_butterflies<false>(acc, lane);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int col = 32 * g + 8 * (i / 2) + 2 * t + i % 2;
    table[warp * RBN + col] = make_float2(acc[(i / 2) * 4 + 2 + i % 2], acc[(i / 2) * 4 + i % 2]);
  }
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
  const int64_t gm = m0 + ct;
  if (gm < p.M) {
    float sum = 0.0f, tmax = -INFINITY;
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      const float2 st = table[w * RBN + ct];
      sum += st.x;
      tmax = fmaxf(tmax, st.y);
    }
    put_row_stats(p, vl, gm, sum, tmax);
  }
}

template <class T, int QB>
__device__ __forceinline__ void p_rs_body(const WgDsParams& P) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[WST], empty[WST];
  const DsParams& p = P.p;
  if (p.guard && *p.guard == 0) {
    return;
  }
  const WgPipe pipe = wg_setup(smem_raw, full, empty, 1 + 128);
  unsigned char* stages = pipe.base;
  auto stage = [&](int s) { return RsStage{stages + s * kRsStageBytes}; };
  // Two tables by tile parity (so one barrier a tile): per warp and column,
  // (sum, max) over the warp's rows.
  float2* red = reinterpret_cast<float2*>(stages + WST * kRsStageBytes);

  const int v_tiles = static_cast<int>((p.width + RBV - 1) / RBV);
  const int m_tiles = static_cast<int>((p.M + RBN - 1) / RBN);
  const int tiles = v_tiles * m_tiles;
  const int vt0 = static_cast<int>(p.v0 / RBV);
  const int kt_count = static_cast<int>((p.H + WBK - 1) / WBK);
  const int lg = __ffs(p.w.group_size) - 1;
  if (pipe.wg == 0) {
    wg_producer_regs<0>();
    p_rs_produce<QB>(P, pipe, tiles, v_tiles, vt0, kt_count, lg);
    return;
  }
  wg_consumer_regs<0>();
  const int ct = threadIdx.x - 128;
  const int warp = ct >> 5, lane = ct & 31, t = lane & 3, g = lane >> 2;
  const float inv_cap = p.cap > 0.0f ? 1.0f / p.cap : 0.0f;
  const bool capped = p.cap > 0.0f;
  const int trow[2] = {(pipe.wg - 1) * 64 + g + (warp & 3) * 16,
                       (pipe.wg - 1) * 64 + g + (warp & 3) * 16 + 8};
  float acc[128];
  uint32_t frag[2][4][4];
  int s = 0, phase = 0, parity = 0;
  auto build = [&](uint32_t(&f)[4][4], int st) {
    rs_fragments<T, QB>(f, stage(st), trow, lane, p.w.sb_kind, lg);
  };
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, parity ^= 1) {
    const int m0 = (tile / v_tiles) * RBN, vl = tile % v_tiles;
    rs_tile_mainloop<T>(pipe, acc, frag, kt_count, lane, s, phase, build,
                        [&](int st) { return stage(st).h(); });
    p_rs_store<T>(p, acc, m0, (vt0 + vl) * RBV + trow[0], t, g, capped, inv_cap);
    p_rs_column_stats(p, acc, red + parity * 8 * RBN, m0, vl, ct, warp, lane, t, g);
  }
}

// The Hopper forward and P kernels' target logits (gather_targets), one warp a
// row: s[m, y_m] from the values the MMA multiplies (h and a dense W in T, a
// quantized W dequantized as the fragments are), summed in fp32 in another
// order (differences ~1e-6 relative), softcapped the same way. A separate pass costs M x H reads,
// far less than looking for the targets in the 4-bit P epilogue (64 rows a thread), where every
// logit would be compared with its row's target.
template <class T, int QB>
__device__ __forceinline__ void target_body(const TargetParams& p) {
  const int lane = threadIdx.x & 31;
  const int64_t m = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (m >= p.M) {
    return;
  }
  const int32_t y = p.targets[m];
  if (y < 0 || y >= p.V) {
    return;
  }
  constexpr int kT = std::is_same_v<T, __half> ? kF16 : kBF16;
  const Operand& w = p.w;
  const T* h = static_cast<const T*>(p.h.ptr) + m * p.h.ld;
  float sum = 0.0f;
  auto dot_pair = [&](uint32_t hp, uint32_t wp) {
    sum = fmaf(half_bits(hp & 0xffff, kT), half_bits(wp & 0xffff, kT), sum);
    sum = fmaf(half_bits(hp >> 16, kT), half_bits(wp >> 16, kT), sum);
  };
  if constexpr (QB == 0) {
    const T* wr = static_cast<const T*>(w.ptr) + y * w.ld;
    for (int64_t c = 8 * lane; c < p.H; c += 256) {
      const uint4 hv = *reinterpret_cast<const uint4*>(h + c);
      const uint4 wv = *reinterpret_cast<const uint4*>(wr + c);
      dot_pair(hv.x, wv.x), dot_pair(hv.y, wv.y), dot_pair(hv.z, wv.z), dot_pair(hv.w, wv.w);
    }
  } else {
    const int lg = __ffs(w.group_size) - 1;
    const int64_t groups = w.cols >> lg;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(w.ptr) + y * (w.cols * QB / 32);
    const uint16_t* scales = static_cast<const uint16_t*>(w.scales) + y * groups;
    const uint16_t* biases = static_cast<const uint16_t*>(w.biases) + y * groups;
    constexpr int kPer = 32 / QB; // columns a word
    for (int64_t i = lane; i < p.H / kPer; i += 32) {
      const int64_t c = i * kPer, g = c >> lg;
      const float s = half_bits(scales[g], w.sb_kind), b = half_bits(biases[g], w.sb_kind);
      const uint32_t word = words[i];
      uint32_t wp[kPer / 2];
      if constexpr (QB == 4) {
        const uint4 d = dequant_q4<T>(word, pack2<T>(s, s), pack2<T>(b, b));
        wp[0] = d.x, wp[1] = d.y, wp[2] = d.z, wp[3] = d.w;
      } else {
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          wp[k] = pack2<T>(fmaf(s, code8(word, 2 * k), b), fmaf(s, code8(word, 2 * k + 1), b));
        }
      }
#pragma unroll
      for (int k = 0; k < kPer / 2; ++k) {
        dot_pair(*reinterpret_cast<const uint32_t*>(h + c + 2 * k), wp[k]);
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    sum += __shfl_xor_sync(0xffffffff, sum, o);
  }
  if (lane == 0) {
    p.target_logit[m] = p.cap > 0.0f ? p.cap * tanh_fast(sum * (1.0f / p.cap)) : sum;
  }
}

#endif // FLASH_CCE_WGMMA

template <class T, int QB>
__device__ __forceinline__ void target_entry(const TargetParams& P) {
#ifdef FLASH_CCE_WGMMA
  target_body<T, QB>(P);
#endif
}

template <class T, int QB>
__device__ __forceinline__ void p_rs_entry(const WgDsParams& P) {
#ifdef FLASH_CCE_WGMMA
  p_rs_body<T, QB>(P);
#endif
}

template <class T, int QB>
__device__ __forceinline__ void dh_rs_entry(const WgDhParams& P) {
#ifdef FLASH_CCE_WGMMA
  dh_rs_body<T, QB>(P);
#endif
}

template <class T, int QB>
__device__ __forceinline__ void fwd_rs_entry(const WgFwdParams& P) {
#ifdef FLASH_CCE_WGMMA
  fwd_rs_body<T, QB>(P);
#endif
}

} // namespace

} // namespace flash_cce::cuda
