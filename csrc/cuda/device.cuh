// Device helpers shared by the portable and the Hopper kernels: compute
// types, PTX wrappers, the portable tile loader and GEMM main loop, and the
// epilogue math (softcap, online max/sum, dS and P values, dh updates).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <float.h>
#include <stdint.h>

#include <type_traits>

#include "params.h"

namespace flash_cce::cuda {

namespace {

constexpr int BM = kTileM, BN = kTileN, BK = kTileK, PAD = 8;

// Compute types --------------------------------------------------------------

template <class T>
struct Ops;

template <>
struct Ops<__nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat162 pack(float a, float b) {
    return __floats2bfloat162_rn(a, b);
  }
  static __device__ __forceinline__ void mma(float* d, const uint32_t* a, const uint32_t* b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

template <>
struct Ops<__half> {
  static __device__ __forceinline__ __half2 pack(float a, float b) {
    return __floats2half2_rn(a, b);
  }
  static __device__ __forceinline__ void mma(float* d, const uint32_t* a, const uint32_t* b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

template <class T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  auto v = Ops<T>::pack(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float bf16_bits(uint32_t u16) {
  return __uint_as_float(u16 << 16);
}

__device__ __forceinline__ float f16_bits(uint32_t u16) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(u16)));
}

// A 16-bit value (scales and biases: kBF16 or kF16) as a float.
__device__ __forceinline__ float half_bits(uint32_t u16, int kind) {
  return kind == kBF16 ? bf16_bits(u16) : f16_bits(u16);
}

// A scale or bias from its bits: 16 in the low half, or a float's 32.
__device__ __forceinline__ float sb_float(uint32_t u, int kind) {
  return kind == kF32 ? __uint_as_float(u) : half_bits(u, kind);
}

__device__ __forceinline__ float load_as_float(const void* p, int kind, int64_t i) {
  switch (kind) {
    case kBF16:
      return bf16_bits(static_cast<const uint16_t*>(p)[i]);
    case kF16:
      return f16_bits(static_cast<const uint16_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ void store_from_float(void* p, int kind, int64_t i, float v) {
  switch (kind) {
    case kBF16:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
      break;
    case kF16:
      static_cast<__half*>(p)[i] = __float2half_rn(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
  }
}

// PTX wrappers -----------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
               "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// Tile loader ------------------------------------------------------------------

// Loads R x C tiles of an Operand into shared memory (row stride C + PAD) in
// chunks of 8 elements, two chunks per thread. K_COLS: the K dimension runs
// along the tile's columns (a K-major operand), else along its rows. Addresses
// and bounds are set up once per output tile (start) so that each k-step costs
// a pointer increment and a compare. fetch() starts the global reads (cp.async,
// or loads into registers); store() converts the registers and writes shared
// memory, so the conversion overlaps the tensor-core work.
// QB: 0 dense, 4 or 8 quantized with that many bits, 1 quantized, bits at run time.
template <class T, int R, int C, int QB, bool K_COLS>
struct TileLoader {
  static constexpr int kChunks = R * C / 8 / kThreads;
  static_assert(kChunks * 8 * kThreads == R * C, "tile must split into 8-element chunks");

  enum Mode : int { kZero, kAsync, kFloats, kHalves, kPacked };
  const unsigned char* ptr[kChunks]; // the chunk's first byte at k-step 0
  int64_t sb[kChunks]; // quantized: scale index at k-step 0 (without the K part)
  int krem[kChunks]; // elements along K left at k-step 0
  int kcol[kChunks]; // quantized K_COLS: the chunk's column at k-step 0
  int fixed_bytes[kChunks]; // !K_COLS: bytes of the chunk inside the columns
  int64_t step; // bytes per k-step
  int64_t sb_step; // scale entries per k-step (!K_COLS)
  int kind, bits, lg_group;
  bool vec;

  uint4 raw[kChunks][2];
  uint32_t sraw[kChunks], braw[kChunks];
  int mode[kChunks];

  __device__ __forceinline__ static int64_t clamp_int(int64_t x) {
    return x > (1 << 30) ? (1 << 30) : x;
  }

  // fixed0: the tile's origin along the non-K dimension.
  __device__ __forceinline__ void start(const Operand& op, int64_t fixed0) {
    kind = op.kind;
    vec = op.vec_ok;
    bits = QB > 1 ? QB : op.bits;
    lg_group = QB ? __ffs(op.group_size) - 1 : 0;
    const int esize = QB ? 0 : (kind == kF32 ? 4 : 2);
    const int64_t row_bytes = QB ? op.cols * bits / 8 : op.ld * esize;
    step = K_COLS ? (QB ? BK * bits / 8 : int64_t(BK) * esize) : BK * row_bytes;
    sb_step = K_COLS ? 0 : int64_t(BK) * (op.cols >> lg_group);
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int q = threadIdx.x + i * kThreads;
      const int r = q / (C / 8), c = (q % (C / 8)) * 8;
      const int64_t gr = op.row0 + (K_COLS ? fixed0 : 0) + r;
      const int64_t gc = op.col0 + (K_COLS ? 0 : fixed0) + c;
      const bool ok = K_COLS ? gr < op.rows : gc < op.cols;
      krem[i] = ok ? static_cast<int>(clamp_int(K_COLS ? op.cols - gc : op.rows - gr)) : 0;
      kcol[i] = static_cast<int>(gc);
      const int64_t left = op.cols - gc;
      fixed_bytes[i] = left >= 8 ? 16 : left > 0 ? static_cast<int>(left) * 2 : 0;
      const int64_t col_bytes = QB ? gc * bits / 8 : gc * esize;
      ptr[i] = static_cast<const unsigned char*>(op.ptr) + (ok ? gr * row_bytes + col_bytes : 0);
      sb[i] = QB ? gr * (op.cols >> lg_group) + (K_COLS ? 0 : gc >> lg_group) : 0;
    }
  }

  __device__ __forceinline__ void fetch(const Operand& op, int kt, T* tile) {
    const int kk = kt * BK;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int q = threadIdx.x + i * kThreads;
      const int r = q / (C / 8), c = (q % (C / 8)) * 8;
      const bool in = kk < krem[i];
      const unsigned char* src = ptr[i] + kt * step;
      if (QB == 0 && kind == kNative) {
        int bytes = 0;
        if (in) {
          bytes = K_COLS ? min(16, (krem[i] - kk) * 2) : fixed_bytes[i];
        }
        cp_async16(tile + r * (C + PAD) + c, in ? src : ptr[i], bytes);
        mode[i] = kAsync;
      } else if (!in) {
        mode[i] = kZero;
      } else if (QB != 0) {
        fetch_packed(op, src, kk, i);
      } else if (vec && (K_COLS ? krem[i] - kk : fixed_bytes[i] / 2) >= 8) {
        if (kind == kF32) {
          raw[i][0] = __ldg(reinterpret_cast<const uint4*>(src));
          raw[i][1] = __ldg(reinterpret_cast<const uint4*>(src) + 1);
          mode[i] = kFloats;
        } else {
          raw[i][0] = __ldg(reinterpret_cast<const uint4*>(src));
          mode[i] = kHalves;
        }
      } else {
        // Ragged edge: element by element, zero past the operand.
        const int n = K_COLS ? min(8, krem[i] - kk) : fixed_bytes[i] / 2;
        float* f = reinterpret_cast<float*>(raw[i]);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          f[j] = j < n ? load_as_float(src, kind, j) : 0.0f;
        }
        mode[i] = kFloats;
      }
    }
  }

  __device__ __forceinline__ void fetch_packed(const Operand& op, const unsigned char* src,
                                               int kk, int i) {
    if (QB == 4) {
      raw[i][0].x = __ldg(reinterpret_cast<const uint32_t*>(src));
      raw[i][0].y = 0;
    } else if (QB == 8) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(src));
      raw[i][0].x = v.x;
      raw[i][0].y = v.y;
    } else {
      uint64_t v = 0;
      for (int j = 0; j < bits; ++j) {
        v |= uint64_t(__ldg(src + j)) << (8 * j);
      }
      raw[i][0].x = static_cast<uint32_t>(v);
      raw[i][0].y = static_cast<uint32_t>(v >> 32);
    }
    const int64_t g = K_COLS ? sb[i] + ((kcol[i] + kk) >> lg_group)
                             : sb[i] + int64_t(kk / BK) * sb_step;
    if (op.sb_kind == kF32) {
      sraw[i] = __float_as_uint(__ldg(static_cast<const float*>(op.scales) + g));
      braw[i] = __float_as_uint(__ldg(static_cast<const float*>(op.biases) + g));
    } else {
      sraw[i] = __ldg(static_cast<const uint16_t*>(op.scales) + g);
      braw[i] = __ldg(static_cast<const uint16_t*>(op.biases) + g);
    }
    mode[i] = kPacked;
  }

  __device__ __forceinline__ void store(const Operand& op, T* tile) {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      if (mode[i] == kAsync) {
        continue;
      }
      const int q = threadIdx.x + i * kThreads;
      const int r = q / (C / 8), c = (q % (C / 8)) * 8;
      uint4 out = make_uint4(0, 0, 0, 0);
      if (mode[i] == kFloats) {
        const float* f = reinterpret_cast<const float*>(raw[i]);
        out = make_uint4(pack2<T>(f[0], f[1]), pack2<T>(f[2], f[3]),
                         pack2<T>(f[4], f[5]), pack2<T>(f[6], f[7]));
      } else if (mode[i] == kHalves) {
        const uint32_t* u = reinterpret_cast<const uint32_t*>(&raw[i][0]);
        uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float a = half_bits(u[j] & 0xffff, kind), b = half_bits(u[j] >> 16, kind);
          o[j] = pack2<T>(a, b);
        }
      } else if (mode[i] == kPacked) {
        const uint64_t v = uint64_t(raw[i][0].x) | (uint64_t(raw[i][0].y) << 32);
        const uint32_t mask = (1u << bits) - 1;
        const float s = sb_float(sraw[i], op.sb_kind), b = sb_float(braw[i], op.sb_kind);
        uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float q0 = static_cast<float>(uint32_t(v >> (2 * j * bits)) & mask);
          const float q1 = static_cast<float>(uint32_t(v >> ((2 * j + 1) * bits)) & mask);
          o[j] = pack2<T>(fmaf(s, q0, b), fmaf(s, q1, b));
        }
      }
      *reinterpret_cast<uint4*>(tile + r * (C + PAD) + c) = out;
    }
  }
};

// GEMM main loop ---------------------------------------------------------------

// Warps form a 2 x 4 grid; warp (wm, wn) owns rows wm*64 + [0, 64) and columns
// wn*32 + [0, 32) of the tile: 4 x 4 mma tiles of 16 x 8, acc[mi][ni][e] at
// row wm*64 + mi*16 + lane/4 + (e/2)*8, column wn*32 + ni*8 + (lane%4)*2 + e%2.
struct Frag {
  int lane, wm, wn;
  __device__ __forceinline__ Frag() {
    lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    wm = warp >> 2;
    wn = warp & 3;
  }
  __device__ __forceinline__ int row(int mi, int e) const {
    return wm * 64 + mi * 16 + (lane >> 2) + (e >> 1) * 8;
  }
  __device__ __forceinline__ int col(int ni, int e) const {
    return wn * 32 + ni * 8 + (lane & 3) * 2 + (e & 1);
  }
};

// acc = A[m0 : m0+128, 0:K] . B[n0 : n0+128, 0:K]^T. A_K: A is stored [m][k]
// (else [k][m]); likewise B_K for B. Ends with a barrier, so shared memory may
// be reused right after.
template <class T, bool A_K, bool B_K, int QB>
__device__ __forceinline__ void gemm_tile(const Operand& A, const Operand& B, int64_t m0,
                                          int64_t n0, int64_t K, float (&acc)[4][4][4],
                                          T* smem) {
  constexpr int AR = A_K ? BM : BK, AC = A_K ? BK : BM;
  constexpr int BR = B_K ? BN : BK, BC = B_K ? BK : BN;
  constexpr int kStage = kTileElems;
  T* sa = smem;
  T* sb = smem + kStages * kStage;
  const Frag f;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc[mi][ni][e] = 0.0f;

  TileLoader<T, AR, AC, 0, A_K> la;
  TileLoader<T, BR, BC, QB, B_K> lb;
  la.start(A, m0);
  lb.start(B, n0);
  const int kt_count = static_cast<int>((K + BK - 1) / BK);
  auto fetch = [&](int kt) {
    const int s = kt % kStages;
    la.fetch(A, kt, sa + s * kStage);
    lb.fetch(B, kt, sb + s * kStage);
  };
  auto store = [&](int kt) {
    const int s = kt % kStages;
    la.store(A, sa + s * kStage);
    lb.store(B, sb + s * kStage);
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < kt_count) {
      fetch(s);
      store(s);
    }
    cp_async_commit();
  }

  for (int kt = 0; kt < kt_count; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int next = kt + kStages - 1;
    const bool more = next < kt_count;
    if (more) {
      fetch(next);
    }
    cp_async_commit();

    const T* ta = sa + (kt % kStages) * kStage;
    const T* tb = sb + (kt % kStages) * kStage;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      uint32_t af[4][4], bf[4][2];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        const int mb = f.wm * 64 + mi * 16;
        if (A_K) {
          ldsm_x4(af[mi], ta + (mb + (f.lane & 15)) * (AC + PAD) + kk + (f.lane >> 4) * 8);
        } else {
          const int k = kk + (f.lane & 7) + (f.lane >> 4) * 8;
          ldsm_x4_t(af[mi], ta + k * (AC + PAD) + mb + ((f.lane >> 3) & 1) * 8);
        }
      }
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        const int nb = f.wn * 32 + np * 16;
        uint32_t r[4];
        if (B_K) {
          ldsm_x4(r, tb + (nb + (f.lane & 7) + (f.lane >> 4) * 8) * (BC + PAD) + kk +
                         ((f.lane >> 3) & 1) * 8);
        } else {
          const int k = kk + (f.lane & 7) + ((f.lane >> 3) & 1) * 8;
          ldsm_x4_t(r, tb + k * (BC + PAD) + nb + (f.lane >> 4) * 8);
        }
        bf[2 * np][0] = r[0];
        bf[2 * np][1] = r[1];
        bf[2 * np + 1][0] = r[2];
        bf[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
          Ops<T>::mma(acc[mi][ni], af[mi], bf[ni]);
    }
    if (more) {
      store(next);
    }
  }
  cp_async_wait<0>();
  __syncthreads();
}

// Epilogue helpers -----------------------------------------------------------

// e^x through ex2.approx.ftz: results below 2^-126 flush to zero, which no
// softmax sum here misses (its terms are relative to a row maximum or the
// cap), and the form without ftz costs three more instructions a call
// (range scaling around the MUFU) in epilogues that are issue-bound.
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float exp_ftz(float x) {
  return ex2_ftz(x * kLog2e);
}

__device__ __forceinline__ float rcp_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) = 1 - 2 / (e^(2x) + 1) from y = 2 log2(e) x (callers fold the
// factor into their scale): the exponential overflows to inf (tanh = 1) or
// flushes to 0 (tanh = -1) at the ends, so no clamp or sign fix is needed.
// Accurate to a few fp32 ulps of 1, i.e. of cap * tanh relative to the cap.
__device__ __forceinline__ float tanh2(float y) {
  return fmaf(-2.0f, rcp_ftz(ex2_ftz(y) + 1.0f), 1.0f);
}

__device__ __forceinline__ float tanh_fast(float x) {
  return tanh2(x * (2.0f * kLog2e));
}

// Online (max, sum-of-exp) merge; -inf maxima carry nothing.
__device__ __forceinline__ void merge(float& m, float& l, float om, float ol) {
  const float nm = fmaxf(m, om);
  if (nm == -INFINITY) {
    return;
  }
  l = l * exp_ftz(m - nm) + ol * exp_ftz(om - nm);
  m = nm;
}

// The entropy statistics' online merge: (m, l) as in merge, r = sum of
// e^(s - m) (s - m), which follows a new maximum nm as e^(m - nm) (r + (m - nm) l).
__device__ __forceinline__ void merge_ent(float& m, float& l, float& r, float om, float ol,
                                          float o_r) {
  const float nm = fmaxf(m, om);
  if (nm == -INFINITY) {
    return;
  }
  const float a = exp_ftz(m - nm), b = exp_ftz(om - nm);
  const float ra = m == -INFINITY ? 0.0f : a * fmaf(m - nm, l, r);
  const float rb = om == -INFINITY ? 0.0f : b * fmaf(om - nm, ol, o_r);
  r = ra + rb;
  l = l * a + ol * b;
  m = nm;
}

// The first arg-max of two parts with maxima m and om (ties: the smaller index,
// as the CPU kernels take it); call before the maxima merge.
__device__ __forceinline__ void merge_arg(int32_t& arg, float m, int32_t o_arg, float om) {
  if (om > m || (om == m && o_arg < arg)) {
    arg = o_arg;
  }
}

// The factor that brings acc and run_sum of row gm from ref_prev to ref_cur:
// exactly 1 when the reference stayed (ex2.approx need not give 1 at 0), which
// lets dh_update add without reading.
__device__ __forceinline__ float row_scale(const DhParams& p, int64_t gm) {
  if (!p.ref_prev || p.first) {
    return 1.0f;
  }
  const float prev = p.ref_prev[gm], cur = p.ref_cur[gm];
  return prev == cur ? 1.0f : exp_ftz(prev - cur);
}

// dh[gm, c] and dh[gm, c + 1] (when c + 1 < H) (+)= v0, v1, the old values
// scaled by f: fp32 accumulation in p.acc, and the last vocabulary chunk
// writes p.out in its dtype. first, last: p.first and p.last, or those of a
// piece of a split tile.
//
// Unscaled additions into fp32 go out as reductions (RED), which the L2
// performs: the thread does not wait for the old value, so a tile's epilogue
// does not hold up the next tile's MMA for a round trip to memory. One reduction per
// element and launch (or per piece, in order) keeps the sum deterministic.
__device__ __forceinline__ void dh_update(const DhParams& p, int64_t gm, int64_t c, float v0,
                                          float v1, float f, bool first, bool last) {
  const bool pairs = (p.H & 1) == 0;
  const int64_t i = gm * p.H + c;
  const bool two = c + 1 < p.H;
  if (!first && f == 1.0f && (!last || p.out == p.acc)) {
#if __CUDA_ARCH__ >= 900
    if (pairs) {
      asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p.acc + i), "f"(v0), "f"(v1)
                   : "memory");
      return;
    }
#endif
    atomicAdd(p.acc + i, v0);
    if (two) {
      atomicAdd(p.acc + i + 1, v1);
    }
    return;
  }
  if (!first) {
    if (pairs) {
      const float2 old = *reinterpret_cast<const float2*>(p.acc + i);
      v0 += f * old.x;
      v1 += f * old.y;
    } else {
      v0 += f * p.acc[i];
      v1 += two ? f * p.acc[i + 1] : 0.0f;
    }
  }
  if (last) {
    store_from_float(p.out, p.out_kind, i, v0);
    if (two) {
      store_from_float(p.out, p.out_kind, i + 1, v1);
    }
  } else if (pairs) {
    *reinterpret_cast<float2*>(p.acc + i) = make_float2(v0, v1);
  } else {
    p.acc[i] = v0;
    if (two) {
      p.acc[i + 1] = v1;
    }
  }
}

// The fused forward: run_sum[gm] (+)= the chunk's per-tile row sums, and the
// next chunk's reference from the row maxima.
__device__ __forceinline__ void add_row_sums(const DhParams& p, int64_t gm) {
  if (!p.part_sum || gm >= p.M) {
    return;
  }
  float s = p.first ? 0.0f : p.run_sum[gm] * row_scale(p, gm);
  const float cur = p.ref_cur ? p.ref_cur[gm] : 0.0f;
  float mx = cur;
  for (int t = 0; t < p.sum_tiles; ++t) {
    s += p.part_sum[int64_t(t) * p.M + gm];
    if (p.part_max) {
      mx = fmaxf(mx, p.part_max[int64_t(t) * p.M + gm]);
    }
  }
  p.run_sum[gm] = s;
  if (p.part_max) {
    p.ref_next[gm] = mx > cur + kRefStep ? mx : cur;
  }
}

// The per-row factors of dS: g (0 for ignored and out-of-range targets),
// coef = g_lse - g, and lse; with ENT the entropy's cotangent ge and the mean
// logit under the softmax, zbar = lse - entropy (every row, ignored ones too,
// as on the CPU).
struct DsRow {
  int32_t y;
  float g, coef, lse, ge, zbar;
};

template <bool ENT = false>
__device__ __forceinline__ DsRow ds_row(const DsParams& p, int64_t gm) {
  const int32_t y = p.targets[gm];
  const bool ok = y != p.ignore_index && y >= 0 && y < p.V;
  const float g = ok ? p.g[gm] : 0.0f;
  const float lse = p.lse[gm];
  if constexpr (ENT) {
    return {y, g, p.g_lse[gm] - g, lse, p.g_ent[gm], lse - p.entropy[gm]};
  }
  return {y, g, p.g_lse[gm] - g, lse, 0.0f, 0.0f};
}

// One element of dS = (g onehot + (g_lse - g) softmax) dcap for raw logit s at
// column v; coef = g_lse - g. With ENT the softmax's coefficient also takes
// the entropy's -ge (s - zbar). Columns at or past V give 0.
template <bool ENT = false>
__device__ __forceinline__ float ds_value(float s, int64_t v, const DsRow& r, int64_t V,
                                          float cap, float inv_cap) {
  float dcap = 1.0f;
  if (cap > 0.0f) {
    const float t = tanh_fast(s * inv_cap);
    s = cap * t;
    dcap = 1.0f - t * t;
  }
  const float coef = ENT ? fmaf(-r.ge, s - r.zbar, r.coef) : r.coef;
  float x = coef * exp_ftz(s - r.lse);
  if (v == r.y) {
    x += r.g;
  }
  return v < V ? x * dcap : 0.0f;
}

// Fused forward: P = exp(s - r) dcap for the logit s (cap tanh(x / cap) with
// a softcap, else x) against the row reference r, with exp(s - r) added to
// the row sum, s to the row maximum, and s kept as the target logit.
__device__ __forceinline__ float p_value(float x, int64_t v, int32_t y, int64_t V, float cap,
                                         float inv_cap, float ref, float* target, float& sum,
                                         float& tmax) {
  float s = x, dcap = 1.0f;
  if (cap > 0.0f) {
    const float t = tanh_fast(x * inv_cap);
    s = cap * t;
    dcap = 1.0f - t * t;
  }
  if (v >= V) {
    return 0.0f;
  }
  if (v == y) {
    *target = s;
  }
  tmax = fmaxf(tmax, s);
  const float e = exp_ftz(s - ref);
  sum += e;
  return e * dcap;
}

// The row reference of the fused forward: ref[m], or the cap itself (which
// bounds every softcapped logit from above) when ref is null.
__device__ __forceinline__ float row_ref(const DsParams& p, int64_t gm) {
  return p.ref ? (gm < p.M ? p.ref[gm] : 0.0f) : p.cap;
}

// A tile's row statistics of the fused forward, reduced over the tile.
__device__ __forceinline__ void put_row_stats(const DsParams& p, int vt, int64_t gm, float sum,
                                              float tmax) {
  p.part_sum[int64_t(vt) * p.M + gm] = sum;
  if (p.part_max) {
    p.part_max[int64_t(vt) * p.M + gm] = tmax;
    if (tmax - row_ref(p, gm) > p.gap) {
      *p.flag = 1;
    }
  }
}

} // namespace

} // namespace flash_cce::cuda
