// C [M, N] (float) = A [M, K] @ B [N, K]^T with steel's BlockLoader and
// BlockMMA: 32x32 output tiles, K in steps of 16, 2x2 SIMD groups. Any M, N,
// K (edges through load_safe / store_result_safe).
#include <metal_stdlib>
#include "mlx/backend/metal/kernels/utils.h"
#include "mlx/backend/metal/kernels/steel/gemm/loader.h"
#include "mlx/backend/metal/kernels/steel/gemm/mma.h"

using namespace metal;
using namespace mlx::steel;

constant constexpr int BM = 32;
constant constexpr int BN = 32;
constant constexpr int BK = 16;
constant constexpr int WM = 2;
constant constexpr int WN = 2;

template <typename T>
[[kernel]] void gemm_nt(
    const device T* A [[buffer(0)]],
    const device T* B [[buffer(1)]],
    device float* C [[buffer(2)]],
    constant int3& mnk [[buffer(3)]],
    uint3 tid [[threadgroup_position_in_grid]],
    ushort sg [[simdgroup_index_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]]) {
  constexpr short ld = BK + 16 / sizeof(T);
  threadgroup T As[BM * ld];
  threadgroup T Bs[BN * ld];
  using loader_a = BlockLoader<T, BM, BK, ld, true, WM * WN * 32>;
  using loader_b = BlockLoader<T, BN, BK, ld, true, WM * WN * 32>;
  using mma_t = BlockMMA<T, float, BM, BN, BK, WM, WN, false, true, ld, ld>;

  const int M = mnk.x, N = mnk.y, K = mnk.z;
  const int row0 = tid.y * BM, col0 = tid.x * BN;
  const short rows = min(BM, M - row0), cols = min(BN, N - col0);
  loader_a la(A + row0 * K, K, As, sg, lane);
  loader_b lb(B + col0 * K, K, Bs, sg, lane);
  mma_t mma(sg, lane);
  for (int k = 0; k < K; k += BK) {
    const short kk = min(BK, K - k);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    la.load_safe(short2(kk, rows));
    lb.load_safe(short2(kk, cols));
    threadgroup_barrier(mem_flags::mem_threadgroup);
    mma.mma(As, Bs);
    la.next();
    lb.next();
  }
  mma.store_result_safe(C + row0 * N + col0, N, short2(cols, rows));
}

template [[host_name("gemm_nt_float")]] [[kernel]] decltype(gemm_nt<float>) gemm_nt<float>;
template [[host_name("gemm_nt_half")]] [[kernel]] decltype(gemm_nt<half>) gemm_nt<half>;
template [[host_name("gemm_nt_bfloat")]] [[kernel]] decltype(gemm_nt<bfloat>) gemm_nt<bfloat>;
