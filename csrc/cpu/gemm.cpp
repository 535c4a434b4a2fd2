#include "gemm.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(FLASH_CCE_NO_SIMD)
#include <immintrin.h>
#define FLASH_CCE_X86 1
#endif
#if defined(__aarch64__) && !defined(FLASH_CCE_NO_SIMD)
#include <arm_neon.h>
#define FLASH_CCE_NEON 1
#endif

namespace flash_cce::cpu {

namespace {

// Register tile MR x NR (6 x 16 for the generic, AVX2 and NEON kernels; the
// AVX-512 kernel's is larger, so the geometry is chosen with the kernel);
// cache blocks MC x KC of A (L2) and KC x NC of B (L3). MC and NC are
// multiples of every kernel's MR and NR.
constexpr int64_t MR = 6;
constexpr int64_t NR = 16;
constexpr int64_t MC = 96;
constexpr int64_t KC = 256;
constexpr int64_t NC = 512;
constexpr int64_t MAX_MR = 12;
constexpr int64_t MAX_NR = 32;

using Kernel = void (*)(int64_t kc, const float* a, const float* b, float* c,
                        int64_t ldc, bool accumulate);

// Portable kernel on the compilers' generic 4-wide vectors (SSE2, NEON, or
// scalar code where there are none): rows of the tile as 4 vectors each, so
// that the accumulators stay in registers rather than in a stack array.
typedef float f32x4 __attribute__((vector_size(16)));
constexpr int64_t NV = NR / 4;

void kernel_generic(int64_t kc, const float* a, const float* b, float* c,
                    int64_t ldc, bool accumulate) {
  f32x4 acc[MR][NV] = {};
  for (int64_t k = 0; k < kc; ++k) {
    f32x4 bv[NV];
    std::memcpy(bv, b + k * NR, sizeof(bv));
    for (int64_t r = 0; r < MR; ++r) {
      const f32x4 ar = f32x4{} + a[k * MR + r];
      for (int64_t j = 0; j < NV; ++j) {
        acc[r][j] += ar * bv[j];
      }
    }
  }
  for (int64_t r = 0; r < MR; ++r) {
    for (int64_t j = 0; j < NV; ++j) {
      f32x4 v = acc[r][j];
      if (accumulate) {
        f32x4 old;
        std::memcpy(&old, c + r * ldc + 4 * j, sizeof(old));
        v += old;
      }
      std::memcpy(c + r * ldc + 4 * j, &v, sizeof(v));
    }
  }
}

#ifdef FLASH_CCE_X86
// 6x16 AVX2/FMA kernel: 12 accumulators, 2 B vectors, 1 broadcast register.
__attribute__((target("avx2,fma"))) void kernel_avx2(
    int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
    bool accumulate) {
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
  __m256 c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
  __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
  __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
  __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps();
  __m256 c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(b);
    const __m256 b1 = _mm256_load_ps(b + 8);
    __m256 ar;
    ar = _mm256_broadcast_ss(a + 0);
    c00 = _mm256_fmadd_ps(ar, b0, c00);
    c01 = _mm256_fmadd_ps(ar, b1, c01);
    ar = _mm256_broadcast_ss(a + 1);
    c10 = _mm256_fmadd_ps(ar, b0, c10);
    c11 = _mm256_fmadd_ps(ar, b1, c11);
    ar = _mm256_broadcast_ss(a + 2);
    c20 = _mm256_fmadd_ps(ar, b0, c20);
    c21 = _mm256_fmadd_ps(ar, b1, c21);
    ar = _mm256_broadcast_ss(a + 3);
    c30 = _mm256_fmadd_ps(ar, b0, c30);
    c31 = _mm256_fmadd_ps(ar, b1, c31);
    ar = _mm256_broadcast_ss(a + 4);
    c40 = _mm256_fmadd_ps(ar, b0, c40);
    c41 = _mm256_fmadd_ps(ar, b1, c41);
    ar = _mm256_broadcast_ss(a + 5);
    c50 = _mm256_fmadd_ps(ar, b0, c50);
    c51 = _mm256_fmadd_ps(ar, b1, c51);
    a += MR;
    b += NR;
  }
  __m256 rows[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                        {c30, c31}, {c40, c41}, {c50, c51}};
  for (int64_t r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
    if (accumulate) {
      rows[r][0] = _mm256_add_ps(rows[r][0], _mm256_loadu_ps(cr));
      rows[r][1] = _mm256_add_ps(rows[r][1], _mm256_loadu_ps(cr + 8));
    }
    _mm256_storeu_ps(cr, rows[r][0]);
    _mm256_storeu_ps(cr + 8, rows[r][1]);
  }
}
// 12x32 AVX-512 kernel: 24 accumulators (two 16-float vectors per row), 2 B
// vectors and A broadcast from memory into each FMA. Twice the AVX2 kernel's
// vector width and enough independent accumulators to cover the FMA latency
// of two ports.
__attribute__((target("avx512f"))) void kernel_avx512(
    int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
    bool accumulate) {
  constexpr int R = 12;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm512_setzero_ps();
    acc[r][1] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_load_ps(b);
    const __m512 b1 = _mm512_load_ps(b + 16);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 ar = _mm512_set1_ps(a[r]);
      acc[r][0] = _mm512_fmadd_ps(ar, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(ar, b1, acc[r][1]);
    }
    a += R;
    b += 32;
  }
  for (int r = 0; r < R; ++r) {
    float* cr = c + r * ldc;
    __m512 v0 = acc[r][0], v1 = acc[r][1];
    if (accumulate) {
      v0 = _mm512_add_ps(v0, _mm512_loadu_ps(cr));
      v1 = _mm512_add_ps(v1, _mm512_loadu_ps(cr + 16));
    }
    _mm512_storeu_ps(cr, v0);
    _mm512_storeu_ps(cr + 16, v1);
  }
}
#endif

#ifdef FLASH_CCE_NEON
// 6x16 NEON kernel (every aarch64 core has NEON): 24 accumulators, 4 B
// vectors, the 6 A values of a k step in one and a half registers (by lane).
#define FLASH_CCE_NEON_ROW(r, av, lane, lanefn)        \
  c##r##0 = lanefn(c##r##0, b0, av, lane);            \
  c##r##1 = lanefn(c##r##1, b1, av, lane);            \
  c##r##2 = lanefn(c##r##2, b2, av, lane);            \
  c##r##3 = lanefn(c##r##3, b3, av, lane);

void kernel_neon(int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                 bool accumulate) {
  const float32x4_t z = vdupq_n_f32(0.0f);
  float32x4_t c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z;
  float32x4_t c20 = z, c21 = z, c22 = z, c23 = z, c30 = z, c31 = z, c32 = z, c33 = z;
  float32x4_t c40 = z, c41 = z, c42 = z, c43 = z, c50 = z, c51 = z, c52 = z, c53 = z;
  for (int64_t k = 0; k < kc; ++k) {
    const float32x4_t b0 = vld1q_f32(b), b1 = vld1q_f32(b + 4);
    const float32x4_t b2 = vld1q_f32(b + 8), b3 = vld1q_f32(b + 12);
    const float32x4_t a03 = vld1q_f32(a);
    const float32x2_t a45 = vld1_f32(a + 4);
    FLASH_CCE_NEON_ROW(0, a03, 0, vfmaq_laneq_f32)
    FLASH_CCE_NEON_ROW(1, a03, 1, vfmaq_laneq_f32)
    FLASH_CCE_NEON_ROW(2, a03, 2, vfmaq_laneq_f32)
    FLASH_CCE_NEON_ROW(3, a03, 3, vfmaq_laneq_f32)
    FLASH_CCE_NEON_ROW(4, a45, 0, vfmaq_lane_f32)
    FLASH_CCE_NEON_ROW(5, a45, 1, vfmaq_lane_f32)
    a += MR;
    b += NR;
  }
  float32x4_t rows[MR][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13},
                             {c20, c21, c22, c23}, {c30, c31, c32, c33},
                             {c40, c41, c42, c43}, {c50, c51, c52, c53}};
  for (int64_t r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
    for (int j = 0; j < 4; ++j) {
      const float32x4_t v = accumulate ? vaddq_f32(rows[r][j], vld1q_f32(cr + 4 * j)) : rows[r][j];
      vst1q_f32(cr + 4 * j, v);
    }
  }
}
#undef FLASH_CCE_NEON_ROW
#endif

// A micro-kernel and the register tile it computes.
struct Micro {
  const char* name;
  Kernel fn;
  int64_t mr, nr;
};

// The kernels this build has, best first; which of them the processor runs is
// decided at run time.
const Micro MICROS[] = {
#ifdef FLASH_CCE_X86
    {"avx512", kernel_avx512, 12, 32},
    {"avx2", kernel_avx2, MR, NR},
#endif
#ifdef FLASH_CCE_NEON
    {"neon", kernel_neon, MR, NR},
#endif
    {"generic", kernel_generic, MR, NR},
};

bool supported(const Micro& m) {
#ifdef FLASH_CCE_X86
  __builtin_cpu_init();
  if (m.fn == kernel_avx512) {
    return __builtin_cpu_supports("avx512f");
  }
  if (m.fn == kernel_avx2) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
#endif
  (void)m;
  return true;
}

const Micro* pick_micro() {
  for (const Micro& m : MICROS) {
    if (supported(m)) {
      return &m;
    }
  }
  return &MICROS[std::size(MICROS) - 1];
}

const Micro* active = pick_micro();

// Copies panels of `width` lines (rows of A, columns of B) out of a block
// [lines x kc], k-major inside a panel, zero padded. `along_k` says whether k
// is the contiguous index of the source.
template <Elem E>
void pack(const MatView& X, int64_t width, int64_t l0, int64_t n_lines, int64_t k0,
          int64_t kc, bool along_k, float* out) {
  for (int64_t p = 0; p < n_lines; p += width) {
    const int64_t lines = std::min(width, n_lines - p);
    for (int64_t k = 0; k < kc; ++k) {
      float* o = out + k * width;
      for (int64_t l = 0; l < lines; ++l) {
        const int64_t line = l0 + p + l, kk = k0 + k;
        o[l] = load<E>(X.p, along_k ? line * X.ld + kk : kk * X.ld + line);
      }
      for (int64_t l = lines; l < width; ++l) {
        o[l] = 0.0f;
      }
    }
    out += width * kc;
  }
}

#ifdef FLASH_CCE_X86
// Eight consecutive values of one line as fp32 (bf16 widens by a shift).
template <Elem E>
__attribute__((target("avx2"))) inline __m256 load8(const void* p, int64_t i) {
  if constexpr (E == Elem::f32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
        static_cast<const uint16_t*>(p) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// Panels of lines along which k is contiguous (the head's W rows as B, its
// logits tile as A) are a transpose: 8 x 8 blocks through registers, instead
// of one strided load per element. One full panel of `width` lines, a
// multiple of 4.
template <Elem E>
__attribute__((target("avx2"))) void pack_panel_t8(const MatView& X, int64_t width,
                                                   int64_t line0, int64_t k0, int64_t kc,
                                                   float* out) {
  int64_t k = 0;
  for (; k + 8 <= kc; k += 8) {
    for (int64_t lb = 0; lb < width; lb += 8) {
      // 8 lines, or the last 4 of a panel of 12 (the others zero).
      const int nl = width - lb >= 8 ? 8 : 4;
      __m256 r[8];
      for (int i = 0; i < 8; ++i) {
        r[i] = i < nl ? load8<E>(X.p, (line0 + lb + i) * X.ld + k0 + k) : _mm256_setzero_ps();
      }
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
      const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
      const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
      const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
      // Column j of the 8 x 8 block is k step k + j of lines lb .. lb + 7.
      const __m256 cols[8] = {
          _mm256_permute2f128_ps(s0, s4, 0x20), _mm256_permute2f128_ps(s1, s5, 0x20),
          _mm256_permute2f128_ps(s2, s6, 0x20), _mm256_permute2f128_ps(s3, s7, 0x20),
          _mm256_permute2f128_ps(s0, s4, 0x31), _mm256_permute2f128_ps(s1, s5, 0x31),
          _mm256_permute2f128_ps(s2, s6, 0x31), _mm256_permute2f128_ps(s3, s7, 0x31)};
      for (int j = 0; j < 8; ++j) {
        float* o = out + (k + j) * width + lb;
        if (nl == 8) {
          _mm256_storeu_ps(o, cols[j]);
        } else {
          _mm_storeu_ps(o, _mm256_castps256_ps128(cols[j]));
        }
      }
    }
  }
  for (; k < kc; ++k) {
    for (int64_t l = 0; l < width; ++l) {
      out[k * width + l] = load<E>(X.p, (line0 + l) * X.ld + k0 + k);
    }
  }
}

const bool has_avx2 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") != 0;
}();
#endif

// pack() with the transposing panels of fp32 and bf16 operands done 8 x 8
// where the processor has AVX2.
template <Elem E>
void pack_fast(const MatView& X, int64_t width, int64_t l0, int64_t n_lines, int64_t k0,
               int64_t kc, bool along_k, float* out) {
#ifdef FLASH_CCE_X86
  if constexpr (E != Elem::f16) {
    if (along_k && has_avx2 && width % 4 == 0) {
      const int64_t full = n_lines / width * width;
      for (int64_t p = 0; p < full; p += width) {
        pack_panel_t8<E>(X, width, l0 + p, k0, kc, out + p * kc);
      }
      if (full < n_lines) {
        pack<E>(X, width, l0 + full, n_lines - full, k0, kc, along_k, out + full * kc);
      }
      return;
    }
  }
#endif
  pack<E>(X, width, l0, n_lines, k0, kc, along_k, out);
}

void pack_any(const MatView& X, int64_t width, int64_t l0, int64_t n, int64_t k0,
              int64_t kc, bool along_k, float* out) {
  switch (X.elem) {
    case Elem::f32:
      return pack_fast<Elem::f32>(X, width, l0, n, k0, kc, along_k, out);
    case Elem::bf16:
      return pack_fast<Elem::bf16>(X, width, l0, n, k0, kc, along_k, out);
    case Elem::f16:
      return pack<Elem::f16>(X, width, l0, n, k0, kc, along_k, out);
  }
}

// A is [M, K]: its lines are rows, k runs along a row unless transposed.
void pack_a(const MatView& A, int64_t i0, int64_t mc, int64_t k0, int64_t kc,
            float* out) {
  pack_any(A, active->mr, i0, mc, k0, kc, !A.trans, out);
}

// B is [K, N]: its lines are columns, k runs along a column only when transposed.
void pack_b(const MatView& B, int64_t k0, int64_t kc, int64_t j0, int64_t nc,
            float* out) {
  pack_any(B, active->nr, j0, nc, k0, kc, B.trans, out);
}

int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

} // namespace

int64_t sgemm_scratch_floats(int64_t max_n) {
  // Sized for the widest panels of any kernel, so that scratch made before a
  // kernel is selected (tests) still fits.
  const int64_t nc = std::min(NC, round_up(max_n, MAX_NR));
  return MC * KC + KC * nc + 64;
}

GemmScratch sgemm_scratch(float* base) {
  // 64-byte alignment for the aligned B loads (AVX-512 vectors).
  auto align = [](float* p) {
    auto v = reinterpret_cast<uintptr_t>(p);
    return reinterpret_cast<float*>((v + 63) & ~uintptr_t(63));
  };
  float* a = align(base);
  return {a, align(a + MC * KC)};
}

int64_t sgemm_packed_a_floats(int64_t M, int64_t K) {
  return round_up(M, active->mr) * K;
}

// Block (ic, pc) of the packed A starts at pc * Mp + ic * kc: each K block
// holds all row panels, and MC is a multiple of MR.
void sgemm_pack_a(const MatView& A, int64_t M, int64_t K, float* out) {
  const int64_t Mp = round_up(M, active->mr);
  for (int64_t pc = 0; pc < K; pc += KC) {
    pack_a(A, 0, M, pc, std::min(KC, K - pc), out + pc * Mp);
  }
}

const char* sgemm_kernel_name() {
  return active->name;
}

std::vector<std::string> sgemm_kernels() {
  std::vector<std::string> names;
  for (const Micro& m : MICROS) {
    if (supported(m)) {
      names.emplace_back(m.name);
    }
  }
  return names;
}

bool sgemm_select(const std::string& name) {
  for (const Micro& m : MICROS) {
    if (name == m.name && supported(m)) {
      active = &m;
      return true;
    }
  }
  return false;
}

void sgemm(int64_t M, int64_t N, int64_t K, MatView A, MatView B, float* C,
           int64_t ldc, bool accumulate, GemmScratch& s) {
  if (M == 0 || N == 0) {
    return;
  }
  if (K == 0) {
    if (!accumulate) {
      for (int64_t i = 0; i < M; ++i) {
        std::fill(C + i * ldc, C + i * ldc + N, 0.0f);
      }
    }
    return;
  }
  const Micro& mk = *active;
  const int64_t tm = mk.mr, tn = mk.nr;
  alignas(64) float edge[MAX_MR * MAX_NR];
  const int64_t Mp = round_up(M, tm);
  for (int64_t jc = 0; jc < N; jc += NC) {
    const int64_t nc = std::min(NC, N - jc);
    for (int64_t pc = 0; pc < K; pc += KC) {
      const int64_t kc = std::min(KC, K - pc);
      const bool acc = accumulate || pc > 0;
      pack_b(B, pc, kc, jc, nc, s.b);
      for (int64_t ic = 0; ic < M; ic += MC) {
        const int64_t mc = std::min(MC, M - ic);
        const float* a_blk = A.packed ? A.packed + pc * Mp + ic * kc : s.a;
        if (!A.packed) {
          pack_a(A, ic, mc, pc, kc, s.a);
        }
        for (int64_t jr = 0; jr < nc; jr += tn) {
          const int64_t nr = std::min(tn, nc - jr);
          const float* bp = s.b + jr * kc;
          for (int64_t ir = 0; ir < mc; ir += tm) {
            const int64_t mr = std::min(tm, mc - ir);
            const float* ap = a_blk + ir * kc;
            float* c = C + (ic + ir) * ldc + jc + jr;
            if (mr == tm && nr == tn) {
              mk.fn(kc, ap, bp, c, ldc, acc);
              continue;
            }
            // Edge tile: compute the full tile aside, copy the valid part.
            mk.fn(kc, ap, bp, edge, tn, false);
            for (int64_t r = 0; r < mr; ++r) {
              for (int64_t j = 0; j < nr; ++j) {
                c[r * ldc + j] = (acc ? c[r * ldc + j] : 0.0f) + edge[r * tn + j];
              }
            }
          }
        }
      }
    }
  }
}

} // namespace flash_cce::cpu
