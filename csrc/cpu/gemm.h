// A small packed GEMM (fp32 math; fp32/bf16/fp16 operands) for the CPU head: C (+)= A * B, single-threaded;
// the head parallelises over vocabulary blocks above it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "elem.h"

namespace flash_cce::cpu {

// A read-only matrix view, converted to fp32 while packing. Element (r, c) of
// the logical matrix sits at p[r * ld + c], or at p[c * ld + r] when trans is set.
struct MatView {
  const void* p;
  int64_t ld;
  bool trans = false;
  Elem elem = Elem::f32;
  // For A only: panels made once by sgemm_pack_a, used instead of p.
  const float* packed = nullptr;
};

// Per-thread packing space of sgemm_scratch_floats() floats, owned by the caller
// (the head allocates it through MLX so that it shows in MLX's memory counters).
struct GemmScratch {
  float* a;
  float* b;
};
int64_t sgemm_scratch_floats(int64_t max_n);
GemmScratch sgemm_scratch(float* base);

// C[M, N] = (accumulate ? C : 0) + A[M, K] * B[K, N]; C row-major with ldc.
void sgemm(int64_t M, int64_t N, int64_t K, MatView A, MatView B, float* C,
           int64_t ldc, bool accumulate, GemmScratch& scratch);

// A reused across many calls (the head's h) is packed once: M x K -> panels.
int64_t sgemm_packed_a_floats(int64_t M, int64_t K);
void sgemm_pack_a(const MatView& A, int64_t M, int64_t K, float* out);

// Name of the micro-kernel in use ("avx512", "avx2", "neon", "generic"): the
// best one this build has and the processor runs, chosen at load time.
const char* sgemm_kernel_name();

// The micro-kernels this build has that the processor runs, best first, and a
// switch between them (for tests and benchmarks; not thread-safe: call it while
// no GEMM runs, and repack A panels made before it). Returns false for a name
// not in sgemm_kernels().
std::vector<std::string> sgemm_kernels();
bool sgemm_select(const std::string& name);

} // namespace flash_cce::cpu
