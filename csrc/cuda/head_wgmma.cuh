// Hopper (sm_90a) kernels for the dense K-major logits GEMM S = h W^T that the
// forward and the dS pass share: a producer warpgroup streams 128 x 64 tiles of
// h and 256 x 64 tiles of W with the tensor copy engine into a 4-stage ring of
// 128-byte-swizzled shared memory; two consumer warpgroups each run wgmma
// m64n256k16 on 64 rows and then apply the fused epilogue to their
// accumulators.
#pragma once

#include "device.cuh"

namespace flash_cce::cuda {

namespace {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLASH_CCE_WGMMA 1
#include "wgmma_ops.inc"
#endif

constexpr int WBM = kWgTileM, WBN = kWgTileN, WBK = kWgTileK, WST = kWgStages;
constexpr int kWgABytes = WBM * WBK * 2, kWgBBytes = WBN * WBK * 2;

#ifdef FLASH_CCE_WGMMA

// add_row_sums for the rows of a persistent dh kernel's tiles t < m_tiles
// (the first column block, which meets each row once), `count` threads of
// which this is number i. Idle producer threads run it, off the consumers' path.
__device__ __forceinline__ void fold_row_sums(const DhParams& p, int m_tiles, int tile_rows,
                                              int i, int count) {
  for (int t = blockIdx.x; t < m_tiles; t += gridDim.x) {
    for (int r = i; r < tile_rows; r += count) {
      add_row_sums(p, int64_t(t) * tile_rows + r);
    }
  }
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n"
      ".reg .pred ready;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 ready, [%0], %1;\n"
      "@!ready bra WAIT;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int k,
                                         int row) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_addr(dst)),
      "l"(map), "r"(k), "r"(row), "r"(smem_addr(bar))
      : "memory");
}

// Shared-memory matrix descriptors, 128-byte swizzle. K-major: rows of 64 k
// (128 bytes), 8-row groups 1024 bytes apart. MN-major: rows of 64 m or n per
// k, 8-k groups 1024 bytes apart (SBO), 64-wide m/n blocks 8 KB apart (LBO).
__device__ __forceinline__ uint64_t wg_desc(const void* p, bool mn_major) {
  const uint64_t addr = smem_addr(p);
  const uint64_t lbo = mn_major ? (8192 >> 4) : 1;
  return ((addr & 0x3FFFF) >> 4) | (lbo << 16) | (uint64_t(1024 >> 4) << 32) |
      (uint64_t(1) << 62);
}

template <class T, bool TA, bool TB>
__device__ __forceinline__ void wgmma_tile(float* d, uint64_t da, uint64_t db, int acc) {
  constexpr bool f16 = std::is_same_v<T, __half>;
  if constexpr (!TA && !TB) {
    f16 ? wgmma_f16_00(d, da, db, acc) : wgmma_bf16_00(d, da, db, acc);
  } else if constexpr (!TA) {
    f16 ? wgmma_f16_01(d, da, db, acc) : wgmma_bf16_01(d, da, db, acc);
  } else {
    static_assert(TB, "no kernel takes an MN-major A with a K-major B");
    f16 ? wgmma_f16_11(d, da, db, acc) : wgmma_bf16_11(d, da, db, acc);
  }
}

// The pipeline shared by both kernels. Each consumer thread owns rows
// row(0) and row(1) of the tile and, per 8-column group j, columns
// j*8 + (lane%4)*2 + {0, 1}: acc[j*4 + ri*2 + e].
struct WgPipe {
  unsigned char* base;
  uint64_t* full;
  uint64_t* empty;
  int wg, tid;

  __device__ __forceinline__ unsigned char* a(int s) const {
    return base + s * kWgStageBytes;
  }
  __device__ __forceinline__ unsigned char* b(int s) const {
    return a(s) + kWgABytes;
  }
  __device__ __forceinline__ int row(int ri) const {
    return (wg - 1) * 64 + (tid >> 5) * 16 + ((tid & 31) >> 2) + ri * 8;
  }
  __device__ __forceinline__ int col(int j, int e) const {
    return j * 8 + (tid & 3) * 2 + e;
  }
};

// full_arrivals: 1 (the TMA thread's expect_tx) plus, for a quantized head,
// one per producer thread that writes dequantized weights.
__device__ __forceinline__ WgPipe wg_setup(unsigned char* smem_raw, uint64_t* full,
                                           uint64_t* empty, int full_arrivals = 1) {
  WgPipe pipe;
  pipe.base = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  pipe.full = full;
  pipe.empty = empty;
  pipe.wg = threadIdx.x / 128;
  pipe.tid = threadIdx.x % 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < WST; ++s) {
      mbar_init(&full[s], full_arrivals);
      mbar_init(&empty[s], 8); // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  return pipe;
}

// Producer: stream the k-tiles of one output tile. K-major operands come as
// one box of rows x 64 k; MN-major ones (TA / TB) as 64 x 64 boxes, one per
// 64-wide block of m or n, at k rows k_row0 + kt * 64.
template <bool TA, bool TB>
__device__ __forceinline__ void wg_produce_tile(const WgPipe& pipe, const CUtensorMap* a_map,
                                                const CUtensorMap* b_map, int a0, int b0,
                                                int k_row0, int kt0, int kt_count, int& s,
                                                int& phase) {
  for (int kt = kt0; kt < kt0 + kt_count; ++kt) {
    mbar_wait(&pipe.empty[s], phase ^ 1);
    mbar_expect_tx(&pipe.full[s], kWgABytes + kWgBBytes);
    if (TA) {
      for (int j = 0; j < WBM / 64; ++j) {
        tma_load(pipe.a(s) + j * 8192, a_map, &pipe.full[s], a0 + j * 64, kt * WBK);
      }
    } else {
      tma_load(pipe.a(s), a_map, &pipe.full[s], kt * WBK, a0);
    }
    if (TB) {
      for (int j = 0; j < WBN / 64; ++j) {
        tma_load(pipe.b(s) + j * 8192, b_map, &pipe.full[s], b0 + j * 64, k_row0 + kt * WBK);
      }
    } else {
      tma_load(pipe.b(s), b_map, &pipe.full[s], kt * WBK, b0);
    }
    if (++s == WST) {
      s = 0;
      phase ^= 1;
    }
  }
}

// Consumer: acc = A[64 rows of this warpgroup] . B[256 columns] over kt_count
// k-tiles. One k-tile of wgmma stays in flight: a stage is released once the
// next one's wgmma has been issued and the previous group has completed.
template <class T, bool TA, bool TB>
__device__ __forceinline__ void wg_consume(const WgPipe& pipe, float* acc, int kt_count, int& s,
                                           int& phase) {
  const int off = (pipe.wg - 1) * 8192; // 64 rows (K-major) or one 64-wide block (MN-major)
  int prev = -1;
  for (int kt = 0; kt < kt_count; ++kt) {
    mbar_wait(&pipe.full[s], phase);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int k = 0; k < WBK / 16; ++k) {
      const uint64_t da = wg_desc(pipe.a(s) + off + k * (TA ? 2048 : 32), TA);
      const uint64_t db = wg_desc(pipe.b(s) + k * (TB ? 2048 : 32), TB);
      wgmma_tile<T, TA, TB>(acc, da, db, kt > 0 || k > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
    if (prev >= 0 && (pipe.tid & 31) == 0) {
      mbar_arrive(&pipe.empty[prev]);
    }
    prev = s;
    if (++s == WST) {
      s = 0;
      phase ^= 1;
    }
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  if (prev >= 0 && (pipe.tid & 31) == 0) {
    mbar_arrive(&pipe.empty[prev]);
  }
}

// Registers: the producer warpgroup gives registers to the consumers, whose
// 128 accumulators and epilogue need more than the 168 a thread gets at launch.
// setmaxnreg.inc waits until the pool holds what it asks for, so the two
// counts must balance: (168 - 56) x 128 = (224 - 168) x 256. A producer that
// dequantizes (QB) keeps more: (168 - 104) x 128 = (200 - 168) x 256.
template <int QB>
__device__ __forceinline__ void wg_producer_regs() {
  if constexpr (QB == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
  } else if constexpr (QB == 4) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 104;\n");
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 120;\n");
  }
}

template <int QB>
__device__ __forceinline__ void wg_consumer_regs() {
  if constexpr (QB == 0) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n");
  } else if constexpr (QB == 4) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 200;\n");
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 192;\n");
  }
}

// A quantized head's B tile: R rows of W from row r0 and NB blocks of 64
// columns from column c0, dequantized by the 128 producer threads into the
// layout TMA writes (chunk c of row r of block b at b * R * 128 + r * 128 +
// ((c ^ (r & 7)) << 4), the 128-byte swizzle). Each thread owns kSegs row
// segments of kSeg 8-element chunks; consecutive threads take consecutive rows,
// so a quarter-warp's 16-byte stores fall in distinct banks.
// An 8-bit thread holds one tile's packed words in registers and refills each
// 16-byte vector from the next tile as soon as it is converted: the loads have
// a whole pipeline step to land, and only one tile's words are live (4-bit
// words come through shared memory instead, see stage()). Rows past V and
// columns past H load zero scales and biases, so they store zeros.

// Byte i of word, an 8-bit code q, as a float, exactly, from the bits of
// 2^23 + q (the code in the mantissa of 2^23): one byte permute and one add,
// where a conversion (I2F) runs at a quarter of the rate.
__device__ __forceinline__ float code8(uint32_t word, int i) {
  return __uint_as_float(__byte_perm(word, 0x4b000000u, 0x7440 | i)) - 8388608.0f;
}

// 4-bit codes go straight to pairs of T: a code under the exponent of 2^7
// (bfloat16) or 2^10 (float16) reads as 2^m + q exactly, so a subtraction and
// a fused multiply-add per pair give scale * q + bias rounded once, with no
// float conversions. Scales and biases are taken in T: exact when they are T
// already (mx.quantize gives them W's dtype), else rounded once more.
template <class T>
struct Pair;
template <>
struct Pair<__nv_bfloat16> {
  using V = __nv_bfloat162;
  static constexpr uint32_t kMagic = 0x43004300u;
};
template <>
struct Pair<__half> {
  using V = __half2;
  static constexpr uint32_t kMagic = 0x64006400u;
};

template <class T>
__device__ __forceinline__ uint32_t dequant_pair(uint32_t codes, uint32_t scale, uint32_t bias) {
  using V = typename Pair<T>::V;
  const uint32_t magic = Pair<T>::kMagic;
  const uint32_t biased = (codes & 0x000f000fu) | magic;
  const V q = __hsub2(*reinterpret_cast<const V*>(&biased), *reinterpret_cast<const V*>(&magic));
  const V w = __hfma2(q, *reinterpret_cast<const V*>(&scale), *reinterpret_cast<const V*>(&bias));
  return *reinterpret_cast<const uint32_t*>(&w);
}

// Eight 4-bit codes (code e at bits 4e) as four pairs (0, 1) .. (6, 7): two
// byte permutes put codes 2i and 2i + 1 in the low nibbles of the two halves.
template <class T>
__device__ __forceinline__ uint4 dequant_q4(uint32_t word, uint32_t scale, uint32_t bias) {
  const uint32_t odd = word >> 4;
  const uint32_t lo = __byte_perm(word, odd, 0x5410), hi = __byte_perm(word, odd, 0x7632);
  return make_uint4(dequant_pair<T>(lo, scale, bias), dequant_pair<T>(lo >> 8, scale, bias),
                    dequant_pair<T>(hi, scale, bias), dequant_pair<T>(hi >> 8, scale, bias));
}

template <int QB, int R, int NB>
struct QTile {
  static constexpr int kRowChunks = NB * 8;
  static constexpr int kSeg = kRowChunks < 16 ? kRowChunks : 16;
  static constexpr int kSegs = 16 / kSeg;
  static constexpr int kVecs = kSeg * 8 * QB / 128; // uint4 per segment
  static constexpr int kVecChunks = kSeg / kVecs;   // 8-element chunks per uint4
  static constexpr int kGroups = kSeg * 8 / 32;     // groups a segment spans (size >= 32)
  static_assert(R * (kRowChunks / kSeg) == 128 * kSegs, "tile must split over 128 threads");

  uint4 v[kSegs][kVecs];
  // Two sets of the scales' and biases' bits, by k-step parity: each k-step
  // loads the next tile's into one and converts the other's, loaded a k-step
  // before. Converting them as they were loaded would make the producer wait
  // for the loads.
  uint32_t scale[2][kSegs][kGroups], bias[2][kSegs][kGroups];
  // 4-bit tiles take them as a pair of T, 8-bit ones as a float.
  using Scale = std::conditional_t<QB == 4, uint32_t, float>;

  // Where segment j of thread tid starts: tile row r, absolute row and column.
  struct Seg {
    int r;
    int64_t row, col;
  };
  __device__ __forceinline__ static Seg place(int tid, int j, int64_t r0, int64_t c0) {
    const int g = tid + j * 128;
    return {g % R, r0 + g % R, c0 + (g / R) * kSeg * 8};
  }

  __device__ __forceinline__ static uint4 load_vec(const Operand& w, int64_t row, int64_t col,
                                                   int k) {
    const int64_t c = col + k * (128 / QB);
    if (row >= w.rows || c >= w.cols) {
      return make_uint4(0, 0, 0, 0);
    }
    return __ldg(reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(w.ptr) +
                                                row * (w.cols * QB / 32) + c * QB / 32));
  }

  // The scales and biases of each segment's groups for one k-step. Each lane
  // reads its own row of W, so every load is its own L1 request: the n
  // groups of a segment come in one 4- or 8-byte load when 16-bit and aligned.
  __device__ __forceinline__ static void load_groups(const Operand& w, int64_t r0, int64_t c0,
                                                     int tid, int lg,
                                                     uint32_t (&sc)[kSegs][kGroups],
                                                     uint32_t (&bi)[kSegs][kGroups]) {
    const int64_t groups = w.cols >> lg; // per row of W
    const int n = max(1, (kSeg * 8) >> lg);
    const bool wide = w.sb_kind != kF32 && n > 1 && groups % n == 0 &&
        ((reinterpret_cast<uintptr_t>(w.scales) | reinterpret_cast<uintptr_t>(w.biases)) &
         (2 * n - 1)) == 0;
#pragma unroll
    for (int j = 0; j < kSegs; ++j) {
      const Seg at = place(tid, j, r0, c0);
      if (wide) {
        uint32_t su[2] = {0, 0}, bu[2] = {0, 0};
        if (at.row < w.rows && at.col < w.cols) {
          const int64_t gi = at.row * groups + (at.col >> lg);
          const uint16_t* s16 = static_cast<const uint16_t*>(w.scales) + gi;
          const uint16_t* b16 = static_cast<const uint16_t*>(w.biases) + gi;
          if (kGroups > 2 && n > 2) {
            const uint2 sv = __ldg(reinterpret_cast<const uint2*>(s16));
            const uint2 bv = __ldg(reinterpret_cast<const uint2*>(b16));
            su[0] = sv.x, su[1] = sv.y, bu[0] = bv.x, bu[1] = bv.y;
          } else {
            su[0] = __ldg(reinterpret_cast<const uint32_t*>(s16));
            bu[0] = __ldg(reinterpret_cast<const uint32_t*>(b16));
          }
        }
#pragma unroll
        for (int k = 0; k < kGroups; ++k) {
          sc[j][k] = (su[(k >> 1) & 1] >> (16 * (k & 1))) & 0xffff;
          bi[j][k] = (bu[(k >> 1) & 1] >> (16 * (k & 1))) & 0xffff;
        }
      } else {
#pragma unroll
        for (int k = 0; k < kGroups; ++k) {
          const int64_t gcol = at.col + (int64_t(k) << lg);
          const bool ok = at.row < w.rows && (k << lg) < kSeg * 8 && gcol < w.cols;
          const int64_t gi = at.row * groups + (gcol >> lg);
          sc[j][k] = ok ? load_bits(w.scales, w.sb_kind, gi) : 0u;
          bi[j][k] = ok ? load_bits(w.biases, w.sb_kind, gi) : 0u;
        }
      }
    }
  }

  // The bits of element i of a scale or bias array (zero bits are 0 as any kind).
  __device__ __forceinline__ static uint32_t load_bits(const void* p, int kind, int64_t i) {
    return kind == kF32 ? __ldg(static_cast<const uint32_t*>(p) + i)
                        : __ldg(static_cast<const uint16_t*>(p) + i);
  }

  template <class T>
  __device__ __forceinline__ static Scale convert(uint32_t bits, int kind) {
    const float f = sb_float(bits, kind);
    if constexpr (QB == 4) {
      return pack2<T>(f, f);
    } else {
      return f;
    }
  }

  __device__ __forceinline__ void load(const Operand& w, int64_t r0, int64_t c0, int tid, int lg) {
    load_groups(w, r0, c0, tid, lg, scale[0], bias[0]);
    if constexpr (!kStaged) {
#pragma unroll
      for (int j = 0; j < kSegs; ++j) {
        const Seg at = place(tid, j, r0, c0);
#pragma unroll
        for (int k = 0; k < kVecs; ++k) {
          v[j][k] = load_vec(w, at.row, at.col, k);
        }
      }
    }
  }

  // 4-bit tiles are small enough (8 KB) to be copied into shared memory several
  // k-steps ahead (cp.async, no registers held); each thread copies and later
  // reads its own vectors, so no barrier is needed. Vector i of thread tid is
  // at i * 2048 + tid * 16: a quarter-warp's 16-byte accesses hit distinct banks.
  static constexpr bool kStaged = QB == 4;
  static_assert(!kStaged || kSegs * kVecs * 16 * 128 == kWgQStageBytes, "staging slot size");

  __device__ __forceinline__ static void stage(unsigned char* slot, const Operand& w, int64_t r0,
                                               int64_t c0, int tid) {
#pragma unroll
    for (int j = 0; j < kSegs; ++j) {
      const Seg at = place(tid, j, r0, c0);
#pragma unroll
      for (int k = 0; k < kVecs; ++k) {
        const int64_t c = at.col + k * (128 / QB);
        const bool in = at.row < w.rows && c < w.cols;
        const void* src = in ? static_cast<const uint32_t*>(w.ptr) + at.row * (w.cols * QB / 32) +
                c * QB / 32
                             : w.ptr;
        cp_async16(slot + (j * kVecs + k) * 2048 + tid * 16, src, in ? 16 : 0);
      }
    }
  }

  __device__ __forceinline__ void unstage(const unsigned char* slot, int tid) {
#pragma unroll
    for (int j = 0; j < kSegs; ++j)
#pragma unroll
      for (int k = 0; k < kVecs; ++k) {
        v[j][k] = *reinterpret_cast<const uint4*>(slot + (j * kVecs + k) * 2048 + tid * 16);
      }
  }

  // Stores the held tile (scale set P), dequantized, at dst; with `more`,
  // loads the tile at (r0n, c0n) in its place (set P ^ 1).
  template <class T, int P>
  __device__ __forceinline__ void cycle(unsigned char* dst, int tid, int lg, const Operand& w,
                                        bool more, int64_t r0n, int64_t c0n) {
    if (more) {
      load_groups(w, r0n, c0n, tid, lg, scale[P ^ 1], bias[P ^ 1]);
    }
    Scale sc_now[kSegs][kGroups], bi_now[kSegs][kGroups];
#pragma unroll
    for (int j = 0; j < kSegs; ++j)
#pragma unroll
      for (int q = 0; q < kGroups; ++q) {
        sc_now[j][q] = convert<T>(scale[P][j][q], w.sb_kind);
        bi_now[j][q] = convert<T>(bias[P][j][q], w.sb_kind);
      }
#pragma unroll
    for (int j = 0; j < kSegs; ++j) {
      const Seg next = place(tid, j, r0n, c0n);
      const int r = next.r, seg = (tid + j * 128) / R;
#pragma unroll
      for (int k = 0; k < kVecs; ++k) {
        const uint32_t* words = reinterpret_cast<const uint32_t*>(&v[j][k]);
#pragma unroll
        for (int ci = 0; ci < kVecChunks; ++ci) {
          const int i = k * kVecChunks + ci; // chunk within the segment
          const int g = (i * 8) >> lg;
          Scale sc = sc_now[j][0], bi = bi_now[j][0];
#pragma unroll
          for (int q = 1; q < kGroups; ++q) {
            sc = g == q ? sc_now[j][q] : sc;
            bi = g == q ? bi_now[j][q] : bi;
          }
          uint4 out;
          if constexpr (QB == 4) {
            out = dequant_q4<T>(words[ci], sc, bi);
          } else {
            uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const uint32_t word = words[2 * ci + (e >> 1)];
              // One byte permute: the code byte under the exponent byte of 2^23.
              const float lo = code8(word, 2 * (e & 1));
              const float hi = code8(word, 2 * (e & 1) + 1);
              o[e] = pack2<T>(fmaf(sc, lo, bi), fmaf(sc, hi, bi));
            }
          }
          const int cr = seg * kSeg + i, b = cr / 8, c = cr % 8;
          *reinterpret_cast<uint4*>(dst + b * (R * 128) + r * 128 + ((c ^ (r & 7)) << 4)) = out;
        }
        if (!kStaged && more) {
          v[j][k] = load_vec(w, next.row, next.col, k);
        }
      }
    }
  }
};

// Producer of one output tile whose B operand is a quantized W: thread 0
// streams A with TMA, all 128 producer threads dequantize B, make their
// shared-memory writes visible to the tensor cores' (async) proxy and arrive.
// TB: B is W read as [k = v][n = h] (the dh GEMM), else [n = v][k = h].
template <class T, int QB, bool TB>
__device__ __forceinline__ void wg_produce_tile_q(const WgPipe& pipe, const CUtensorMap* a_map,
                                                  const Operand& w, int a0, int b0, int k_row0,
                                                  int kt0, int kt_count, int& s, int& phase) {
  QTile<QB, TB ? WBK : WBN, TB ? WBN / 64 : 1> tile;
  const int lg = __ffs(w.group_size) - 1;
  // Origin of k-step kt0 + kt's tile of W.
  auto r0 = [&](int kt) { return TB ? k_row0 + int64_t(kt0 + kt) * WBK : int64_t(b0); };
  auto c0 = [&](int kt) { return TB ? int64_t(b0) : int64_t(kt0 + kt) * WBK; };
  using Tile = decltype(tile);
  unsigned char* ring = pipe.base + WST * kWgStageBytes;
  auto slot = [&](int kt) { return ring + (kt % kWgQDepth) * kWgQStageBytes; };
  auto step = [&](auto parity, int kt) {
    if constexpr (Tile::kStaged) {
      const int ahead = kt + kWgQDepth - 1;
      if (ahead < kt_count) {
        Tile::stage(slot(ahead), w, r0(ahead), c0(ahead), pipe.tid);
      }
      cp_async_commit();
      cp_async_wait<kWgQDepth - 1>();
      tile.unstage(slot(kt), pipe.tid);
    }
    mbar_wait(&pipe.empty[s], phase ^ 1);
    if (pipe.tid == 0) {
      mbar_expect_tx(&pipe.full[s], kWgABytes);
      tma_load(pipe.a(s), a_map, &pipe.full[s], (kt0 + kt) * WBK, a0);
    }
    tile.template cycle<T, decltype(parity)::value>(pipe.b(s), pipe.tid, lg, w,
                                                    kt + 1 < kt_count, r0(kt + 1), c0(kt + 1));
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    mbar_arrive(&pipe.full[s]);
    if (++s == WST) {
      s = 0;
      phase ^= 1;
    }
  };
  if constexpr (Tile::kStaged) {
    for (int kt = 0; kt < kWgQDepth - 1; ++kt) {
      if (kt < kt_count) {
        Tile::stage(slot(kt), w, r0(kt), c0(kt), pipe.tid);
      }
      cp_async_commit();
    }
  }
  tile.load(w, r0(0), c0(0), pipe.tid, lg);
  for (int kt = 0; kt < kt_count; kt += 2) {
    step(std::integral_constant<int, 0>{}, kt);
    if (kt + 1 < kt_count) {
      step(std::integral_constant<int, 1>{}, kt + 1);
    }
  }
}

// The producer warpgroup's work on one output tile: TMA for both operands
// from thread 0 (QB = 0), or TMA for A and dequantization of B (QB = 4, 8).
// kt0: the first k-step (a piece of a split tile starts past 0).
template <class T, int QB, bool TB>
__device__ __forceinline__ void wg_produce(const WgPipe& pipe, const CUtensorMap* a_map,
                                           const CUtensorMap* b_map, const Operand& w, int a0,
                                           int b0, int k_row0, int kt0, int kt_count, int& s,
                                           int& phase) {
  if constexpr (QB == 0) {
    if (pipe.tid == 0) {
      wg_produce_tile<false, TB>(pipe, a_map, b_map, a0, b0, k_row0, kt0, kt_count, s, phase);
    }
  } else {
    wg_produce_tile_q<T, QB, TB>(pipe, a_map, w, a0, b0, k_row0, kt0, kt_count, s, phase);
  }
}

__host__ __device__ constexpr int full_arrivals(int qb) {
  return qb ? 1 + 128 : 1;
}

// cap * tanh(x / cap) of a thread's 128 accumulators, in place.
__device__ __forceinline__ void softcap_all(float (&acc)[128], float cap) {
  const float k2 = 2.0f * kLog2e / cap;
#pragma unroll
  for (int i = 0; i < 128; ++i) {
    acc[i] = cap * tanh2(acc[i] * k2);
  }
}

// Epilogue steps shared by the forward and P kernels, on a warpgroup's 64 x
// 256 logits (acc[j * 4 + ri * 2 + e]: row pipe.row(ri), column pipe.col(j, e)).
// The softcap (a template branch: a runtime one costs a branch a logit), then
// -inf in the columns past V, which only the last tile has (-FLT_MAX with
// STATS: its weight is 0 all the same, and 0 times it stays 0 in the entropy's
// sum).
template <bool CAP, bool STATS = false>
__device__ __forceinline__ void cap_and_mask(float (&acc)[128], const WgPipe& pipe, float cap,
                                             int cols) {
  if constexpr (CAP) {
    softcap_all(acc, cap);
  }
  if (cols < WBN) {
    const float masked = STATS ? -FLT_MAX : -INFINITY;
#pragma unroll
    for (int j = 0; j < 32; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (pipe.col(j, e) >= cols) {
          acc[j * 4 + e] = masked;
          acc[j * 4 + 2 + e] = masked;
        }
  }
}

// Row ri's logit at column yc (relative to the tile) into *dst: only the lane
// that holds the column compares, so the other lanes skip 64 compares.
__device__ __forceinline__ void store_target(const float (&acc)[128], const WgPipe& pipe, int ri,
                                             int yc, int cols, float* dst) {
  if (yc >= 0 && yc < cols && ((yc >> 1) & 3) == (pipe.tid & 3)) {
#pragma unroll
    for (int j = 0; j < 32; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (pipe.col(j, e) == yc) {
          *dst = acc[j * 4 + ri * 2 + e];
        }
  }
}

// The entropy statistics' running terms of a thread's two rows (fwd_ent_wg):
// r = sum e^(s - max) (s - max), the sum of the logits, the first arg-max.
struct WgStats {
  float r[2] = {0.0f, 0.0f}, tot[2] = {0.0f, 0.0f};
  int32_t arg[2] = {INT32_MAX, INT32_MAX};
};

// Row ri's sums of a tile against the new running maximum nm, as 4 chains
// each: e^(s - nm), e^(s - nm) (s - nm) and s; MASK (the last tile) keeps the
// masked columns (-FLT_MAX) out of the sum of the logits.
template <bool MASK>
__device__ __forceinline__ void stats_row(const float (&acc)[128], const WgPipe& pipe, int ri,
                                          float nm, int cols, float (&sm)[4], float (&rs)[4],
                                          float (&zs)[4]) {
  const float nl = nm * kLog2e;
#pragma unroll
  for (int j = 0; j < 32; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float x = acc[j * 4 + ri * 2 + e];
      const float ex = ex2_ftz(fmaf(x, kLog2e, -nl));
      sm[j & 3] += ex;
      rs[j & 3] = fmaf(ex, x - nm, rs[j & 3]);
      zs[j & 3] += MASK && pipe.col(j, e) >= cols ? 0.0f : x;
    }
}

// One tile's logits into this thread's running (max, sum of exp) of its two
// rows (and with STATS its WgStats). The epilogue is issue- and latency-bound
// (it does not overlap the MMAs), so besides the two steps above, the max and
// sum run as 4 independent chains each.
template <bool CAP, bool STATS = false>
__device__ __forceinline__ void fwd_wg_tile(const FwdParams& p, const WgPipe& pipe,
                                            float (&acc)[128], int64_t m0, int v0, int cols,
                                            const int32_t (&y)[2], float (&run_max)[2],
                                            float (&run_sum)[2], WgStats& st) {
  cap_and_mask<CAP, STATS>(acc, pipe, p.cap, cols);
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    if (p.target_logit) { // else a gather pass has them
      store_target(acc, pipe, ri, y[ri] - v0, cols, p.target_logit + m0 + pipe.row(ri));
    }
    float tm[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 32; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        tm[j & 3] = fmaxf(tm[j & 3], acc[j * 4 + ri * 2 + e]);
    const float tmax = fmaxf(fmaxf(tm[0], tm[1]), fmaxf(tm[2], tm[3]));
    if (tmax == -INFINITY) {
      continue;
    }
    const float nm = fmaxf(run_max[ri], tmax);
    float sm[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if constexpr (STATS) {
      if (tmax > run_max[ri]) {
        // A new maximum (rare after the first tiles): its first column, the
        // thread's columns increasing with j and e.
        int first = INT32_MAX;
#pragma unroll
        for (int j = 31; j >= 0; --j)
#pragma unroll
          for (int e = 1; e >= 0; --e)
            if (acc[j * 4 + ri * 2 + e] == tmax) {
              first = pipe.col(j, e);
            }
        st.arg[ri] = v0 + first;
      }
      float rs[4] = {0.0f, 0.0f, 0.0f, 0.0f}, zs[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (cols < WBN) {
        stats_row<true>(acc, pipe, ri, nm, cols, sm, rs, zs);
      } else {
        stats_row<false>(acc, pipe, ri, nm, cols, sm, rs, zs);
      }
      const float scale = exp_ftz(run_max[ri] - nm);
      const float r_old =
          run_max[ri] == -INFINITY ? 0.0f : scale * fmaf(run_max[ri] - nm, run_sum[ri], st.r[ri]);
      st.r[ri] = r_old + ((rs[0] + rs[1]) + (rs[2] + rs[3]));
      st.tot[ri] += (zs[0] + zs[1]) + (zs[2] + zs[3]);
      run_sum[ri] = run_sum[ri] * scale + ((sm[0] + sm[1]) + (sm[2] + sm[3]));
      run_max[ri] = nm;
      continue;
    }
    const float nl = nm * kLog2e;
#pragma unroll
    for (int j = 0; j < 32; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        sm[j & 3] += ex2_ftz(fmaf(acc[j * 4 + ri * 2 + e], kLog2e, -nl));
    run_sum[ri] = run_sum[ri] * exp_ftz(run_max[ri] - nm) + ((sm[0] + sm[1]) + (sm[2] + sm[3]));
    run_max[ri] = nm;
  }
}
#endif // FLASH_CCE_WGMMA

// STATS (the fwd_ent_wg kernels): also the entropy statistics' partials.
template <class T, int QB, bool STATS = false>
__device__ __forceinline__ void fwd_wg_body(const WgFwdParams& P) {
#ifdef FLASH_CCE_WGMMA
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[WST], empty[WST];
  const FwdParams& p = P.p;
  const WgPipe pipe = wg_setup(smem_raw, full, empty, full_arrivals(QB));
  const auto [mt, split] = fwd_block(p, blockIdx.x);
  const int m0 = mt * WBM;
  const int t_begin = split * p.tiles_per_split;
  const int t_end = min(p.v_tiles, t_begin + p.tiles_per_split);
  const int kt_count = static_cast<int>((p.H + WBK - 1) / WBK);
  if (pipe.wg == 0) {
    wg_producer_regs<QB>();
    int s = 0, phase = 0;
    for (int vt = t_begin; vt < t_end; ++vt) {
      wg_produce<T, QB, false>(pipe, &P.h_map, &P.w_map, p.w, m0, vt * WBN, 0, 0, kt_count, s,
                               phase);
    }
    return;
  }
  wg_consumer_regs<QB>();
  int32_t y[2];
  float run_max[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    // Rows past M never match a column (their target logit is not written).
    const int64_t gm = m0 + pipe.row(ri);
    y[ri] = gm < p.M ? p.targets[gm] : INT32_MIN / 2;
  }
  float acc[128];
  WgStats st;
  int s = 0, phase = 0;
  for (int vt = t_begin; vt < t_end; ++vt) {
    wg_consume<T, false, false>(pipe, acc, kt_count, s, phase);
    // Columns relative to the tile, in 32 bits.
    const int v0 = vt * WBN;
    const int cols = static_cast<int>(min(p.V - v0, int64_t(WBN)));
    if (p.cap > 0.0f) {
      fwd_wg_tile<true, STATS>(p, pipe, acc, m0, v0, cols, y, run_max, run_sum, st);
    } else {
      fwd_wg_tile<false, STATS>(p, pipe, acc, m0, v0, cols, y, run_max, run_sum, st);
    }
  }
  // A warp holds whole rows: reduce over the 4 lanes that share one.
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      const float om = __shfl_xor_sync(0xffffffff, run_max[ri], off);
      const float ol = __shfl_xor_sync(0xffffffff, run_sum[ri], off);
      if constexpr (STATS) {
        const float o_r = __shfl_xor_sync(0xffffffff, st.r[ri], off);
        st.tot[ri] += __shfl_xor_sync(0xffffffff, st.tot[ri], off);
        merge_arg(st.arg[ri], run_max[ri], __shfl_xor_sync(0xffffffff, st.arg[ri], off), om);
        merge_ent(run_max[ri], run_sum[ri], st.r[ri], om, ol, o_r);
      } else {
        merge(run_max[ri], run_sum[ri], om, ol);
      }
    }
    const int64_t gm = m0 + pipe.row(ri);
    if ((pipe.tid & 3) == 0 && gm < p.M) {
      const int64_t i = int64_t(split) * p.M + gm;
      p.part_max[i] = run_max[ri];
      p.part_sum[i] = run_sum[ri];
      if constexpr (STATS) {
        p.part_r[i] = st.r[ri];
        p.part_tot[i] = st.tot[ri];
        p.part_arg[i] = st.arg[ri];
      }
    }
  }
#endif
}

#ifdef FLASH_CCE_WGMMA
// The fused forward's P = exp(s - r) dcap of one 128 x 256 tile (see
// p_value), in 32-bit column arithmetic: a warp holds whole rows, 4 lanes
// each, and P overwrites the logits in place. As in fwd_wg_tile, 4
// independent chains for the row's sum and max.
template <class T, bool CAP>
__device__ __forceinline__ void p_wg_tile(const DsParams& p, const WgPipe& pipe,
                                          float (&acc)[128], int m0, int64_t v0, int vt_local) {
  const int cols = static_cast<int>(min(p.V - v0, int64_t(WBN)));
  const int wcols = static_cast<int>(min(p.width - (v0 - p.v0), int64_t(WBN)));
  const float inv_cap = CAP ? 1.0f / p.cap : 0.0f;
  cap_and_mask<CAP>(acc, pipe, p.cap, cols);
  T* ds = static_cast<T*>(p.ds);
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    const int64_t gm = m0 + pipe.row(ri);
    if (p.target_logit) { // else a gather pass has them
      const int yc = gm < p.M ? p.targets[gm] - static_cast<int>(v0) : -1;
      store_target(acc, pipe, ri, yc, cols, p.target_logit + gm);
    }
    const float nr = row_ref(p, gm) * kLog2e;
    float sm[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float tm[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 32; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = acc[j * 4 + ri * 2 + e];
        tm[j & 3] = fmaxf(tm[j & 3], x);
        const float ex = ex2_ftz(fmaf(x, kLog2e, -nr));
        sm[j & 3] += ex;
        if constexpr (CAP) {
          // 1 - tanh^2, from the capped logit (masked columns are never stored).
          const float th = x * inv_cap;
          x = ex * fmaf(-th, th, 1.0f);
        } else {
          x = ex;
        }
      }
    float sum = (sm[0] + sm[1]) + (sm[2] + sm[3]);
    float tmax = fmaxf(fmaxf(tm[0], tm[1]), fmaxf(tm[2], tm[3]));
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      sum += __shfl_xor_sync(0xffffffff, sum, off);
      tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffff, tmax, off));
    }
    if (gm >= p.M) {
      continue;
    }
    if ((pipe.tid & 3) == 0) {
      put_row_stats(p, vt_local, gm, sum, tmax);
    }
    T* row = ds + gm * p.ld_ds + (v0 - p.v0);
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int c = pipe.col(j, 0);
      if (c < wcols) {
        *reinterpret_cast<uint32_t*>(row + c) =
            pack2<T>(acc[j * 4 + ri * 2], acc[j * 4 + ri * 2 + 1]);
      }
    }
  }
}

// dS (or the fused forward's P) of one 128 x 256 tile from its logits.
// FWD_P: the fused forward's P (one kernel per epilogue keeps each within the
// register budget; sharing one kernel spilled). ENT: dS with the entropy's
// share (ds_value).
template <class T, bool FWD_P, bool ENT = false>
__device__ __forceinline__ void ds_wg_epilogue(const DsParams& p, const WgPipe& pipe,
                                               float (&acc)[128], int m0, int vt,
                                               int vt_local) {
  const float inv_cap = p.cap > 0.0f ? 1.0f / p.cap : 0.0f;
  const int64_t v0 = int64_t(vt) * WBN;
  T* ds = static_cast<T*>(p.ds);
  if constexpr (FWD_P) {
    if (p.cap > 0.0f) {
      p_wg_tile<T, true>(p, pipe, acc, m0, v0, vt_local);
    } else {
      p_wg_tile<T, false>(p, pipe, acc, m0, v0, vt_local);
    }
  } else {
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      const int64_t gm = m0 + pipe.row(ri);
      if (gm >= p.M) {
        continue;
      }
      const DsRow r = ds_row<ENT>(p, gm);
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        float d[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          d[e] = ds_value<ENT>(acc[j * 4 + ri * 2 + e], v0 + pipe.col(j, e), r, p.V, p.cap,
                               inv_cap);
        }
        const int64_t c = v0 - p.v0 + pipe.col(j, 0);
        if (c < p.width) {
          *reinterpret_cast<uint32_t*>(ds + gm * p.ld_ds + c) = pack2<T>(d[0], d[1]);
        }
      }
    }
  }
}
#endif

template <class T, bool FWD_P, int QB, bool ENT = false>
__device__ __forceinline__ void ds_wg_body(const WgDsParams& P) {
#ifdef FLASH_CCE_WGMMA
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[WST], empty[WST];
  const DsParams& p = P.p;
  if (p.guard && *p.guard == 0) {
    return;
  }
  const WgPipe pipe = wg_setup(smem_raw, full, empty, full_arrivals(QB));
  // Persistent: block b takes tiles b, b + grid, ...; the vocabulary tile
  // varies fastest, so the blocks in flight share a few rows of h and the
  // chunk of W, both small enough to stay in L2.
  const int v_tiles = static_cast<int>((p.width + WBN - 1) / WBN);
  const int tiles = v_tiles * p.m_tiles;
  const int vt0 = static_cast<int>(p.v0 / WBN);
  const int kt_count = static_cast<int>((p.H + WBK - 1) / WBK);
  int s = 0, phase = 0;
  if (pipe.wg == 0) {
    wg_producer_regs<QB>();
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      const int mt = t / v_tiles, vl = t % v_tiles;
      wg_produce<T, QB, false>(pipe, &P.h_map, &P.w_map, p.w, mt * WBM, (vt0 + vl) * WBN, 0, 0,
                               kt_count, s, phase);
    }
    return;
  }
  wg_consumer_regs<QB>();
  float acc[128];
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int mt = t / v_tiles, vl = t % v_tiles;
    wg_consume<T, false, false>(pipe, acc, kt_count, s, phase);
    ds_wg_epilogue<T, FWD_P, ENT>(p, pipe, acc, mt * WBM, vt0 + vl, vl);
  }
#endif
}


// Split tiles (DhSplit): a piece waits for the tile's previous one before its
// epilogue and hands over after it. ct: the consumer thread (0..255).
__device__ __forceinline__ void dh_piece_wait(const DhSplit& sp, const DhUnit& u, int ct) {
  if (u.piece == 0) {
    return;
  }
  if (ct == 0) {
    const int32_t* flag = sp.flags + (u.tile - sp.whole);
    int v;
    do {
      asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
    } while (v != u.piece);
  }
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
}

__device__ __forceinline__ void dh_piece_done(const DhSplit& sp, const DhUnit& u, int ct) {
  if (u.pieces == 1) {
    return;
  }
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
  if (ct == 0) {
    const int next = u.piece + 1 == u.pieces ? 0 : u.piece + 1;
    asm volatile("st.release.gpu.global.s32 [%0], %1;\n" ::"l"(sp.flags + (u.tile - sp.whole)),
                 "r"(next)
                 : "memory");
  }
}

// A piece's update: the chunk's first (no old value) only for the tile's first
// piece, its last (the store in the output dtype) only for the last piece, and
// the old value's row scale only where it is read, in the first piece.
struct PieceUpdate {
  bool first, last;
  __device__ __forceinline__ float scale(const DhParams& p, const DhUnit& u, int64_t gm) const {
    return u.piece == 0 ? row_scale(p, gm) : 1.0f;
  }
};

__device__ __forceinline__ PieceUpdate piece_update(const DhParams& p, const DhUnit& u) {
  return {p.first && u.piece == 0, p.last && u.piece + 1 == u.pieces};
}

#ifdef FLASH_CCE_WGMMA
// dh_update for columns c .. c + 3 (those below H).
__device__ __forceinline__ void dh_update4(const DhParams& p, int64_t gm, int64_t c, float4 v,
                                           float f, bool first, bool last) {
  if ((p.H & 3) != 0 || c + 3 >= p.H) {
    dh_update(p, gm, c, v.x, v.y, f, first, last);
    if (c + 2 < p.H) {
      dh_update(p, gm, c + 2, v.z, v.w, f, first, last);
    }
    return;
  }
  float* a = p.acc + gm * p.H + c;
  if (!first && f == 1.0f && (!last || p.out == p.acc)) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(a), "f"(v.x), "f"(v.y),
                 "f"(v.z), "f"(v.w)
                 : "memory");
    return;
  }
  if (!first) {
    const float4 old = *reinterpret_cast<const float4*>(a);
    v = make_float4(v.x + f * old.x, v.y + f * old.y, v.z + f * old.z, v.w + f * old.w);
  }
  if (last) {
    const int64_t i = gm * p.H + c;
    store_from_float(p.out, p.out_kind, i, v.x);
    store_from_float(p.out, p.out_kind, i + 1, v.y);
    store_from_float(p.out, p.out_kind, i + 2, v.z);
    store_from_float(p.out, p.out_kind, i + 3, v.w);
  } else {
    *reinterpret_cast<float4*>(a) = v;
  }
}

// A dense dh tile's update through shared memory (the 4-bit heads' ring of
// packed words, unused by dense heads): each warp owns 16 rows of the tile and
// passes them on in pieces of 32 columns, after which a lane adds 4 adjacent
// columns of one row. Fewer, wider reductions than the fragments' column pairs
// (8 rows of 32 bytes a warp instruction). 16-byte units XOR the row, so that
// both the pair stores and the unit loads spread over the banks.
static_assert(8 * 16 * 32 * 4 <= kWgQDepth * kWgQStageBytes, "dh staging space");
__device__ __forceinline__ void dh_wg_staged_update(const DhParams& p, const DhUnit& u,
                                                    const PieceUpdate& up, const WgPipe& pipe,
                                                    const float (&acc)[128], int m0, int n0) {
  const int warp = pipe.tid >> 5, lane = pipe.tid & 31;
  float* buf = reinterpret_cast<float*>(pipe.base + WST * kWgStageBytes) +
               ((pipe.wg - 1) * 4 + warp) * 16 * 32;
  const int64_t row0 = m0 + (pipe.wg - 1) * 64 + warp * 16;
  // The lane's rows when it reads: lane / 8 + 4 i.
  float scale[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t gm = row0 + (lane >> 3) + 4 * i;
    scale[i] = gm < p.M ? up.scale(p, u, gm) : 0.0f;
  }
  auto unit = [](int r, int c) { return 32 * r + 4 * ((c >> 2) ^ (r & 7)); };
#pragma unroll
  for (int piece = 0; piece < 8; ++piece) {
#pragma unroll
    for (int jj = 0; jj < 4; ++jj)
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {
        const int j = 4 * piece + jj, r = (lane >> 2) + 8 * ri, c = 8 * jj + 2 * (lane & 3);
        *reinterpret_cast<float2*>(buf + unit(r, c) + (c & 3)) =
            make_float2(acc[j * 4 + ri * 2], acc[j * 4 + ri * 2 + 1]);
      }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = (lane >> 3) + 4 * i, k = lane & 7;
      const float4 v = *reinterpret_cast<const float4*>(buf + unit(r, 4 * k));
      const int64_t gm = row0 + r, c = n0 + 32 * piece + 4 * k;
      if (gm < p.M && c < p.H) {
        dh_update4(p, gm, c, v, scale[i], up.first, up.last);
      }
    }
    __syncwarp();
  }
}
#endif

// dh (+)= dS[:, chunk] . W[v0 : v0 + width]: A = dS (K-major), B = W rows as
// [k = v][n = h] (N-major).
template <class T, int QB>
__device__ __forceinline__ void dh_wg_body(const WgDhParams& P) {
#ifdef FLASH_CCE_WGMMA
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[WST], empty[WST];
  const DhParams& p = P.p;
  if (p.guard && *p.guard == 0) {
    return;
  }
  const WgPipe pipe = wg_setup(smem_raw, full, empty, full_arrivals(QB));
  // Persistent over the units of P.split, the row tile fastest: the blocks in
  // flight share a few column tiles of the chunk of W.
  const int units = dh_units(P.split);
  const int kt_count = static_cast<int>((P.width + WBK - 1) / WBK);
  int s = 0, phase = 0;
  if (pipe.wg == 0) {
    wg_producer_regs<QB>();
    if (QB == 0 && pipe.tid >= 32) {
      // Dense tiles need one TMA thread: warps 1-3 fold the row sums.
      fold_row_sums(p, p.m_tiles, WBM, pipe.tid - 32, 96);
      return;
    }
    for (int i = blockIdx.x; i < units; i += gridDim.x) {
      const DhUnit u = dh_unit(P.split, i, kt_count);
      wg_produce<T, QB, true>(pipe, &P.a_map, &P.b_map, p.w, (u.tile % p.m_tiles) * WBM,
                              (u.tile / p.m_tiles) * WBN, static_cast<int>(P.v0), u.kt0,
                              u.kt1 - u.kt0, s, phase);
    }
    return;
  }
  wg_consumer_regs<QB>();
  float acc[128];
  const int r = threadIdx.x - 128; // consumer threads only reach here
  for (int i = blockIdx.x; i < units; i += gridDim.x) {
    const DhUnit u = dh_unit(P.split, i, kt_count);
    const int m0 = (u.tile % p.m_tiles) * WBM, n0 = (u.tile / p.m_tiles) * WBN;
    wg_consume<T, false, true>(pipe, acc, u.kt1 - u.kt0, s, phase);
    if (QB != 0 && n0 == 0 && r < WBM && u.piece == 0) {
      add_row_sums(p, m0 + r);
    }
    dh_piece_wait(P.split, u, r);
    const PieceUpdate up = piece_update(p, u);
    if constexpr (QB == 0) {
      dh_wg_staged_update(p, u, up, pipe, acc, m0, n0);
    } else {
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {
        const int64_t gm = m0 + pipe.row(ri);
        if (gm >= p.M) {
          continue;
        }
        const float scale = up.scale(p, u, gm);
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          const int64_t c = n0 + pipe.col(j, 0);
          if (c >= p.H) {
            continue;
          }
          dh_update(p, gm, c, acc[j * 4 + ri * 2], acc[j * 4 + ri * 2 + 1], scale, up.first,
                    up.last);
        }
      }
    }
    dh_piece_done(P.split, u, r);
  }
#endif
}

// dW[v0 + 128 rows] = dS^T . h: A = dS read as [k = m][v] (M-major), B = h as
// [k = m][n = h] (N-major).
template <class T>
__device__ __forceinline__ void dw_wg_body(const WgDwParams& P) {
#ifdef FLASH_CCE_WGMMA
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[WST], empty[WST];
  const DwParams& p = P.p;
  const WgPipe pipe = wg_setup(smem_raw, full, empty);
  const int vt = blockIdx.x % p.v_tiles, nt = blockIdx.x / p.v_tiles;
  const int r0 = vt * WBM, n0 = nt * WBN;
  const int kt_count = static_cast<int>((p.M + WBK - 1) / WBK);
  int s = 0, phase = 0;
  if (pipe.wg == 0) {
    wg_producer_regs<0>();
    if (pipe.tid == 0) {
      wg_produce_tile<true, true>(pipe, &P.a_map, &P.b_map, r0, n0, 0, 0, kt_count, s, phase);
    }
    return;
  }
  wg_consumer_regs<0>();
  float acc[128];
  wg_consume<T, true, true>(pipe, acc, kt_count, s, phase);
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    const int64_t r = r0 + pipe.row(ri);
    if (r >= p.width) {
      continue;
    }
#pragma unroll
    for (int j = 0; j < 32; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t c = n0 + pipe.col(j, e);
        if (c < p.H) {
          store_from_float(p.out, p.out_kind, (p.v0 + r) * p.H + c, acc[j * 4 + ri * 2 + e]);
        }
      }
  }
#endif
}

} // namespace

} // namespace flash_cce::cuda
