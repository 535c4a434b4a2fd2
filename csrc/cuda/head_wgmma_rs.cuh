// Hopper forward for a 4- or 8-bit head with W as the register operand: the
// logits are computed transposed, S^T = W h^T, so the dequantized W never goes
// through shared memory. Per block: 256 rows of h (the wgmma N) against tiles
// of 128 rows of W, 64 per consumer warpgroup (the wgmma M). One producer
// thread streams h (128-byte swizzle, the B operand) and the packed words of W
// (plain rows) with TMA, and the producer threads copy the k-step's scales and
// biases into the stage; each consumer thread turns the packed words of its
// two rows straight into A fragments (k-step n + 1 while the tensor cores run
// k-step n), so no dequantized tile is stored.
// The epilogue reduces each logits column (one row of h) over the tile's rows
// of W: a butterfly over the 8 lanes that share a column leaves each lane 8
// columns, whose running (max, sum) live in shared memory per warp.
// Included by head_kernels.cu after head_wgmma.cuh.
#pragma once

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
// loop would hold up the next wgmma.fence, which waits for them (4-bit forward
// at 8192 x 2560 x 262144 on an H200: 28.9 ms with them, 22.8 with the copies).
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
    const uint32_t* words = reinterpret_cast<const uint32_t*>(wtile + trow[ri] * kRowBytes);
    if constexpr (QB == 4) {
      // Byte t of a word holds codes 2t and 2t + 1: one permute puts them in
      // the low nibbles of the two halves.
      const uint32_t sel = t | (t << 4) | ((4 + t) << 8) | ((4 + t) << 12);
      const uint4 lo = *reinterpret_cast<const uint4*>(words);
      const uint4 hi = *reinterpret_cast<const uint4*>(words + 4);
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
      const uint32_t s0 = 0x7440 + 2 * (t & 1), s1 = s0 + 1;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint4 v = *reinterpret_cast<const uint4*>(words + 4 * kk);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint32_t word = half ? ((t & 2) ? v.w : v.z) : ((t & 2) ? v.y : v.x);
          const float s = sc.scale[ri][kk >> 1], b = sc.bias[ri][kk >> 1];
          a[kk][ri + 2 * half] = pack2<T>(fmaf(s, code_f32(__byte_perm(word, kTwo23, s0)), b),
                                          fmaf(s, code_f32(__byte_perm(word, kTwo23, s1)), b));
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
  s = shi + slo * __expf(lo - hi);
  m = hi;
}

// One butterfly level over the (max, sum) pairs of column c at acc[(c / 2) * 4
// + c % 2] and acc[(c / 2) * 4 + 2 + c % 2]: of the 2W live columns, a lane
// keeps the upper W if its bit (16, 8 or 4 for W = 32, 16, 8) is set, else the
// lower W, merged with the partner's copy, in columns 0..W-1.
template <int W>
__device__ __forceinline__ void rs_butterfly(float (&acc)[128], int lane) {
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
    rs_merge(m, sum, om, os);
    ml = m;
    sl = sum;
  }
}

template <class T, int QB>
__device__ __forceinline__ void fwd_rs_body(const WgFwdParams& P) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[WST], empty[WST];
  const FwdParams& p = P.p;
  const WgPipe pipe = wg_setup(smem_raw, full, empty, 1 + 128);
  constexpr int kWBytes = RBV * WBK * QB / 8;
  unsigned char* stages = pipe.base;
  auto h_tile = [&](int s) { return stages + s * kRsStageBytes; };
  auto w_tile = [&](int s) { return h_tile(s) + RBN * WBK * 2; };
  auto s_tile = [&](int s) { return w_tile(s) + RBV * WBK; }; // 8 KB: the 8-bit size
  auto b_tile = [&](int s) { return s_tile(s) + RBV * 16; };
  // Per warp and column of h: the running (max, sum) of its lanes' rows.
  float2* stats = reinterpret_cast<float2*>(stages + WST * kRsStageBytes);
  int32_t* ys = reinterpret_cast<int32_t*>(stats + 8 * RBN);

  const int mt = blockIdx.x % p.m_tiles, split = blockIdx.x / p.m_tiles;
  const int m0 = mt * RBN;
  const int t_begin = split * p.tiles_per_split;
  const int t_end = min(p.v_tiles, t_begin + p.tiles_per_split);
  const int kt_count = static_cast<int>((p.H + WBK - 1) / WBK);
  const int lg = __ffs(p.w.group_size) - 1;
  if (pipe.wg == 0) {
    // Thread 0 streams h and the packed words with TMA; producer thread r
    // copies the scales and biases of row r of the W tile, loaded a k-step ahead.
    wg_producer_regs<0>();
    const int64_t groups = p.w.cols >> lg;
    auto fetch = [&](int vt, int kt, uint32_t (&v)[2]) {
      const int64_t row = int64_t(vt) * RBV + pipe.tid, g0 = (int64_t(kt) * WBK) >> lg;
#pragma unroll
      for (int a = 0; a < 2; ++a) {
        const uint16_t* src = static_cast<const uint16_t*>(a ? p.w.biases : p.w.scales);
        const uint16_t* at = src + row * groups + g0;
        const bool in = row < p.w.rows;
        // The second group only when groups are 32 wide (two per k-step).
        const uint32_t lo = in && g0 < groups ? __ldg(at) : 0;
        const uint32_t hi = in && lg == 5 && g0 + 1 < groups ? __ldg(at + 1) : 0;
        v[a] = lo | (hi << 16);
      }
    };
    uint32_t cur[2], next[2] = {0, 0};
    fetch(t_begin, 0, cur);
    int s = 0, phase = 0;
    for (int vt = t_begin; vt < t_end; ++vt)
      for (int kt = 0; kt < kt_count; ++kt) {
        const bool last = kt + 1 == kt_count;
        if (!(last && vt + 1 == t_end)) {
          fetch(last ? vt + 1 : vt, last ? 0 : kt + 1, next);
        }
        mbar_wait(&pipe.empty[s], phase ^ 1);
        if (pipe.tid == 0) {
          mbar_expect_tx(&pipe.full[s], RBN * WBK * 2 + kWBytes);
          tma_load(h_tile(s), &P.h_map, &pipe.full[s], kt * WBK, m0);
          tma_load(w_tile(s), &P.w_map, &pipe.full[s], kt * (WBK * QB / 32), vt * RBV);
        }
        *reinterpret_cast<uint32_t*>(s_tile(s) + pipe.tid * 16) = cur[0];
        *reinterpret_cast<uint32_t*>(b_tile(s) + pipe.tid * 16) = cur[1];
        mbar_arrive(&pipe.full[s]);
        cur[0] = next[0];
        cur[1] = next[1];
        if (++s == WST) {
          s = 0;
          phase ^= 1;
        }
      }
    return;
  }
  wg_consumer_regs<0>();
  const int ct = threadIdx.x - 128; // consumer thread, 0..255
  const int warp = ct >> 5, lane = ct & 31, t = lane & 3, g = lane >> 2;
  for (int i = ct; i < RBN * 8; i += 256) {
    stats[i] = make_float2(kRsFloor, 0.0f);
  }
  for (int i = ct; i < RBN; i += 256) {
    ys[i] = m0 + i < p.M ? p.targets[m0 + i] : INT32_MIN / 2;
  }
  asm volatile("bar.sync 1, 256;\n" ::: "memory");

  const float inv_cap = p.cap > 0.0f ? 1.0f / p.cap : 0.0f;
  // This thread's rows of the W tile: the A fragment rows g and g + 8 of its warp.
  const int trow[2] = {(pipe.wg - 1) * 64 + (lane >> 2) + (warp & 3) * 16,
                       (pipe.wg - 1) * 64 + (lane >> 2) + (warp & 3) * 16 + 8};
  float acc[128];
  // Two fragment buffers, by k-step parity: the MMAs of step kt run while the
  // fragments of kt + 1 are built.
  uint32_t frag[2][4][4];
  int s = 0, phase = 0;
  auto build = [&](uint32_t(&f)[4][4], int stage) {
    RsScales<QB> sc;
    sc.template load<T>(s_tile(stage), b_tile(stage), trow, p.w.sb_kind, lg);
    rs_dequant<T, QB>(f, w_tile(stage), trow, lane, sc);
  };
  for (int vt = t_begin; vt < t_end; ++vt) {
    mbar_wait(&pipe.full[s], phase);
    build(frag[0], s);
    int prev = -1;
    auto step = [&](auto parity, int kt) {
      constexpr int P = decltype(parity)::value;
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        wgmma_rs<T>(acc, frag[P][kk], wg_desc(h_tile(s) + kk * 32, false), kt > 0 || kk > 0);
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
        build(frag[P ^ 1], s);
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

    // Epilogue. acc[j * 4 + ri * 2 + e]: W row trow[ri], h row 8 j + 2 t + e.
    const int64_t vrow0 = int64_t(vt) * RBV + trow[0];
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int2 y = *reinterpret_cast<const int2*>(ys + 8 * j + 2 * t);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float x[2];
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
          x[ri] = acc[j * 4 + ri * 2 + e];
          if (p.cap > 0.0f) {
            x[ri] = p.cap * tanh_fast(x[ri] * inv_cap);
          }
          const int64_t v = vrow0 + 8 * ri;
          if (v >= p.V) {
            x[ri] = kRsFloor;
          } else if (v == (e ? y.y : y.x)) {
            p.target_logit[m0 + 8 * j + 2 * t + e] = x[ri];
          }
        }
        // The pair's (max, sum) in place of its two logits.
        const float hi = fmaxf(x[0], x[1]);
        acc[j * 4 + e] = hi;
        acc[j * 4 + 2 + e] = hi == kRsFloor ? 0.0f : 1.0f + __expf(fminf(x[0], x[1]) - hi);
      }
    }
    // Butterfly over lane bits 4, 3, 2 (g bits 2, 1, 0): at each level a lane
    // keeps the half of its columns that its bit selects and merges in the
    // partner's copy.
    rs_butterfly<32>(acc, lane);
    rs_butterfly<16>(acc, lane);
    rs_butterfly<8>(acc, lane);
    // Slot i (0..7) now holds column c = 8 g + i: h row 32 g + 8 (i / 2) + 2 t + i % 2.
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int col = 32 * g + 8 * (i / 2) + 2 * t + i % 2;
      float2& st = stats[warp * RBN + col];
      float m = st.x, sum = st.y;
      rs_merge(m, sum, acc[(i / 2) * 4 + i % 2], acc[(i / 2) * 4 + 2 + i % 2]);
      st = make_float2(m, sum);
    }
  }
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
  // One column per thread: merge the 8 warps' partials.
  const int col = ct;
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

#endif // FLASH_CCE_WGMMA

template <class T, int QB>
__device__ __forceinline__ void fwd_rs_entry(const WgFwdParams& P) {
#ifdef FLASH_CCE_WGMMA
  fwd_rs_body<T, QB>(P);
#endif
}
