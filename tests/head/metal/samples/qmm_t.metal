// y [M, N] = x [M, K] @ dequantize(w)^T through MLX's own qmm_t_impl
// (steel BlockLoader for x, QuantizedBlockLoader for w, BlockMMA), with the
// threadgroup tiles declared here as MLX's affine_qmm_t kernel does.
#include <metal_stdlib>
#include "mlx/backend/metal/kernels/utils.h"
#include "mlx/backend/metal/kernels/steel/gemm/gemm.h"
#include "mlx/backend/metal/kernels/quantized_utils.h"
#include "mlx/backend/metal/kernels/quantized.h"

using namespace metal;

template <typename T, int group_size, int bits>
[[kernel]] void qmm_t_sample(
    const device uint32_t* w [[buffer(0)]],
    const device T* scales [[buffer(1)]],
    const device T* biases [[buffer(2)]],
    const device T* x [[buffer(3)]],
    device T* y [[buffer(4)]],
    const constant int& K [[buffer(5)]],
    const constant int& N [[buffer(6)]],
    const constant int& M [[buffer(7)]],
    uint3 tid [[threadgroup_position_in_grid]],
    uint lid [[thread_index_in_threadgroup]],
    uint simd_gid [[simdgroup_index_in_threadgroup]],
    uint simd_lid [[thread_index_in_simdgroup]]) {
  constexpr int BM = 32, BK = 32, BN = 32;
  constexpr int BK_padded = BK + 16 / sizeof(T);
  threadgroup T Xs[BM * BK_padded];
  threadgroup T Ws[BN * BK_padded];
  qmm_t_impl<T, group_size, bits, false, T, BM, BK, BN>(
      w, scales, biases, x, y, Xs, Ws, K, N, M, K, tid, lid, simd_gid, simd_lid);
}

#define QMM(name, T, gs, b) \
  template [[host_name(name)]] [[kernel]] decltype(qmm_t_sample<T, gs, b>) qmm_t_sample<T, gs, b>;

QMM("qmm_t_float_64_2", float, 64, 2)
QMM("qmm_t_float_64_3", float, 64, 3)
QMM("qmm_t_float_64_4", float, 64, 4)
QMM("qmm_t_float_64_5", float, 64, 5)
QMM("qmm_t_float_64_6", float, 64, 6)
QMM("qmm_t_float_64_8", float, 64, 8)
QMM("qmm_t_float_32_4", float, 32, 4)
QMM("qmm_t_float_128_4", float, 128, 4)
QMM("qmm_t_half_64_4", half, 64, 4)
QMM("qmm_t_bfloat_64_4", bfloat, 64, 4)
