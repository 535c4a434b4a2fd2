// The flash-CCE head's Metal kernels: entry points and their instantiations.
// MLX's steel GEMM and quantization headers come from the installed MLX
// (include path: the directory holding mlx/backend/metal/kernels).
// Buffer indices follow csrc/metal/plan.cpp, which lists each launch. Each
// kernel declares the threadgroup size the plan launches it with, so that the
// compiler keeps its registers within what that size needs.
#include <metal_stdlib>

#include "mlx/backend/metal/kernels/utils.h"
#include "mlx/backend/metal/kernels/steel/gemm/gemm.h"
#include "mlx/backend/metal/kernels/quantized_utils.h"
#include "mlx/backend/metal/kernels/quantized.h"

#include "params.h"
#include "loaders.h"
#include "head.h"
#include "regs.h"
#include "dw.h"
#include "rows.h"

using namespace metal;

// Forward: per-split row statistics and target logits.
template <typename HT, typename WT>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_THREADS)]] void head_fwd(
    const device HT* h [[buffer(0)]],
    const device WT* w [[buffer(1)]],
    const device int* targets [[buffer(4)]],
    device float* part_max [[buffer(8)]],
    device float* part_sum [[buffer(9)]],
    device float* target_logit [[buffer(10)]],
    constant FcceParams& p [[buffer(20)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  using T = typename fcce::TileOf<HT, WT>::type;
  threadgroup float smem[FCCE_SMEM_FLOATS(sizeof(T))];
  const fcce::DenseWeight<WT, T> wt{w};
  fcce::head_tiles<FCCE_MODE_FWD>(h, wt, targets, nullptr, nullptr, nullptr, part_max,
      part_sum, target_logit, nullptr, p, smem, group, tid, sgid, lane);
}

template <typename T, int bits, int group_size>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_THREADS)]] void head_fwd_q(
    const device T* h [[buffer(0)]],
    const device uint8_t* w [[buffer(1)]],
    const device T* scales [[buffer(2)]],
    const device T* biases [[buffer(3)]],
    const device int* targets [[buffer(4)]],
    device float* part_max [[buffer(8)]],
    device float* part_sum [[buffer(9)]],
    device float* target_logit [[buffer(10)]],
    constant FcceParams& p [[buffer(20)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float smem[FCCE_SMEM_FLOATS(sizeof(T))];
  const fcce::QuantWeight<T, bits, group_size> wt{w, scales, biases};
  fcce::head_tiles<FCCE_MODE_FWD>(h, wt, targets, nullptr, nullptr, nullptr, part_max,
      part_sum, target_logit, nullptr, p, smem, group, tid, sgid, lane);
}

// Forward with the entropy statistics: per-split row statistics, target
// logits and each split's entropy terms (head.h's RowEnt).
template <typename HT, typename WT>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_THREADS)]] void head_fwd_ent(
    const device HT* h [[buffer(0)]],
    const device WT* w [[buffer(1)]],
    const device int* targets [[buffer(4)]],
    device float* part_max [[buffer(8)]],
    device float* part_sum [[buffer(9)]],
    device float* target_logit [[buffer(10)]],
    device float* part_ent [[buffer(17)]],
    device float* part_lsum [[buffer(18)]],
    device int* part_arg [[buffer(19)]],
    constant FcceParams& p [[buffer(20)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  using T = typename fcce::TileOf<HT, WT>::type;
  threadgroup float smem[FCCE_SMEM_FLOATS(sizeof(T))];
  const fcce::DenseWeight<WT, T> wt{w};
  fcce::head_tiles<FCCE_MODE_FWD, true>(h, wt, targets, nullptr, nullptr, nullptr, part_max,
      part_sum, target_logit, nullptr, p, smem, group, tid, sgid, lane,
      fcce::EntParts{part_ent, part_lsum, part_arg});
}

template <typename T, int bits, int group_size>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_THREADS)]] void head_fwd_ent_q(
    const device T* h [[buffer(0)]],
    const device uint8_t* w [[buffer(1)]],
    const device T* scales [[buffer(2)]],
    const device T* biases [[buffer(3)]],
    const device int* targets [[buffer(4)]],
    device float* part_max [[buffer(8)]],
    device float* part_sum [[buffer(9)]],
    device float* target_logit [[buffer(10)]],
    device float* part_ent [[buffer(17)]],
    device float* part_lsum [[buffer(18)]],
    device int* part_arg [[buffer(19)]],
    constant FcceParams& p [[buffer(20)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float smem[FCCE_SMEM_FLOATS(sizeof(T))];
  const fcce::QuantWeight<T, bits, group_size> wt{w, scales, biases};
  fcce::head_tiles<FCCE_MODE_FWD, true>(h, wt, targets, nullptr, nullptr, nullptr, part_max,
      part_sum, target_logit, nullptr, p, smem, group, tid, sgid, lane,
      fcce::EntParts{part_ent, part_lsum, part_arg});
}

// Fused forward: the statistics plus the splits' partial gsum.
template <typename HT, typename WT>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_THREADS)]] void head_fwd_fused(
    const device HT* h [[buffer(0)]],
    const device WT* w [[buffer(1)]],
    const device int* targets [[buffer(4)]],
    device float* part_max [[buffer(8)]],
    device float* part_sum [[buffer(9)]],
    device float* target_logit [[buffer(10)]],
    device float* part_acc [[buffer(11)]],
    constant FcceParams& p [[buffer(20)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  using T = typename fcce::TileOf<HT, WT>::type;
  threadgroup float smem[FCCE_SMEM_FLOATS(sizeof(T))];
  const fcce::DenseWeight<WT, T> wt{w};
  fcce::head_tiles<FCCE_MODE_FWD_FUSED>(h, wt, targets, nullptr, nullptr, nullptr,
      part_max, part_sum, target_logit, part_acc, p, smem, group, tid, sgid, lane);
}

template <typename T, int bits, int group_size>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_THREADS)]] void head_fwd_fused_q(
    const device T* h [[buffer(0)]],
    const device uint8_t* w [[buffer(1)]],
    const device T* scales [[buffer(2)]],
    const device T* biases [[buffer(3)]],
    const device int* targets [[buffer(4)]],
    device float* part_max [[buffer(8)]],
    device float* part_sum [[buffer(9)]],
    device float* target_logit [[buffer(10)]],
    device float* part_acc [[buffer(11)]],
    constant FcceParams& p [[buffer(20)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float smem[FCCE_SMEM_FLOATS(sizeof(T))];
  const fcce::QuantWeight<T, bits, group_size> wt{w, scales, biases};
  fcce::head_tiles<FCCE_MODE_FWD_FUSED>(h, wt, targets, nullptr, nullptr, nullptr,
      part_max, part_sum, target_logit, part_acc, p, smem, group, tid, sgid, lane);
}

// Backward for h: the splits' partial dh.
template <typename HT, typename WT>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_THREADS)]] void head_dh(
    const device HT* h [[buffer(0)]],
    const device WT* w [[buffer(1)]],
    const device int* targets [[buffer(4)]],
    const device float* lse [[buffer(5)]],
    const device float* g [[buffer(6)]],
    const device float* g_lse [[buffer(7)]],
    device float* part_acc [[buffer(11)]],
    constant FcceParams& p [[buffer(20)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  using T = typename fcce::TileOf<HT, WT>::type;
  threadgroup float smem[FCCE_SMEM_FLOATS(sizeof(T))];
  const fcce::DenseWeight<WT, T> wt{w};
  fcce::head_tiles<FCCE_MODE_DH>(h, wt, targets, lse, g, g_lse, nullptr, nullptr,
      nullptr, part_acc, p, smem, group, tid, sgid, lane);
}

template <typename T, int bits, int group_size>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_THREADS)]] void head_dh_q(
    const device T* h [[buffer(0)]],
    const device uint8_t* w [[buffer(1)]],
    const device T* scales [[buffer(2)]],
    const device T* biases [[buffer(3)]],
    const device int* targets [[buffer(4)]],
    const device float* lse [[buffer(5)]],
    const device float* g [[buffer(6)]],
    const device float* g_lse [[buffer(7)]],
    device float* part_acc [[buffer(11)]],
    constant FcceParams& p [[buffer(20)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float smem[FCCE_SMEM_FLOATS(sizeof(T))];
  const fcce::QuantWeight<T, bits, group_size> wt{w, scales, biases};
  fcce::head_tiles<FCCE_MODE_DH>(h, wt, targets, lse, g, g_lse, nullptr, nullptr,
      nullptr, part_acc, p, smem, group, tid, sgid, lane);
}

// The fused forward (statistics and partial gsum) and the backward for h
// (partial dh) with the accumulator in registers (metal/regs.h).
template <typename HT, typename WT>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_THREADS)]] void head_fwd_fused_regs(
    const device HT* h [[buffer(0)]],
    const device WT* w [[buffer(1)]],
    const device int* targets [[buffer(4)]],
    device float* part_max [[buffer(8)]],
    device float* part_sum [[buffer(9)]],
    device float* target_logit [[buffer(10)]],
    device float* part_acc [[buffer(11)]],
    device float* stage [[buffer(16)]],
    constant FcceParams& p [[buffer(20)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint3 groups [[threadgroups_per_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  using T = typename fcce::TileOf<HT, WT>::type;
  threadgroup float smem[FCCE_REG_SMEM_FLOATS(sizeof(T))];
  const fcce::DenseWeight<WT, T> wt{w};
  fcce::regs_tiles<FCCE_MODE_FWD_FUSED>(h, wt, targets, nullptr, nullptr, nullptr, part_max,
      part_sum, target_logit, part_acc, stage, p, smem, group, groups, tid, sgid, lane);
}

template <typename T, int bits, int group_size>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_THREADS)]] void head_fwd_fused_regs_q(
    const device T* h [[buffer(0)]],
    const device uint8_t* w [[buffer(1)]],
    const device T* scales [[buffer(2)]],
    const device T* biases [[buffer(3)]],
    const device int* targets [[buffer(4)]],
    device float* part_max [[buffer(8)]],
    device float* part_sum [[buffer(9)]],
    device float* target_logit [[buffer(10)]],
    device float* part_acc [[buffer(11)]],
    device float* stage [[buffer(16)]],
    constant FcceParams& p [[buffer(20)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint3 groups [[threadgroups_per_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float smem[FCCE_REG_SMEM_FLOATS(sizeof(T))];
  const fcce::QuantWeight<T, bits, group_size> wt{w, scales, biases};
  fcce::regs_tiles<FCCE_MODE_FWD_FUSED>(h, wt, targets, nullptr, nullptr, nullptr, part_max,
      part_sum, target_logit, part_acc, stage, p, smem, group, groups, tid, sgid, lane);
}

template <typename HT, typename WT>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_THREADS)]] void head_dh_regs(
    const device HT* h [[buffer(0)]],
    const device WT* w [[buffer(1)]],
    const device int* targets [[buffer(4)]],
    const device float* lse [[buffer(5)]],
    const device float* g [[buffer(6)]],
    const device float* g_lse [[buffer(7)]],
    device float* part_acc [[buffer(11)]],
    device float* stage [[buffer(16)]],
    constant FcceParams& p [[buffer(20)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint3 groups [[threadgroups_per_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  using T = typename fcce::TileOf<HT, WT>::type;
  threadgroup float smem[FCCE_REG_SMEM_FLOATS(sizeof(T))];
  const fcce::DenseWeight<WT, T> wt{w};
  fcce::regs_tiles<FCCE_MODE_DH>(h, wt, targets, lse, g, g_lse, nullptr, nullptr, nullptr,
      part_acc, stage, p, smem, group, groups, tid, sgid, lane);
}

template <typename T, int bits, int group_size>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_THREADS)]] void head_dh_regs_q(
    const device T* h [[buffer(0)]],
    const device uint8_t* w [[buffer(1)]],
    const device T* scales [[buffer(2)]],
    const device T* biases [[buffer(3)]],
    const device int* targets [[buffer(4)]],
    const device float* lse [[buffer(5)]],
    const device float* g [[buffer(6)]],
    const device float* g_lse [[buffer(7)]],
    device float* part_acc [[buffer(11)]],
    device float* stage [[buffer(16)]],
    constant FcceParams& p [[buffer(20)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint3 groups [[threadgroups_per_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float smem[FCCE_REG_SMEM_FLOATS(sizeof(T))];
  const fcce::QuantWeight<T, bits, group_size> wt{w, scales, biases};
  fcce::regs_tiles<FCCE_MODE_DH>(h, wt, targets, lse, g, g_lse, nullptr, nullptr, nullptr,
      part_acc, stage, p, smem, group, groups, tid, sgid, lane);
}

// dh with the entropy's cotangent (accumulator in registers): dS also takes
// -g_ent p_v (s_v - (lse - entropy)) dcap_v.
template <typename HT, typename WT>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_THREADS)]] void head_dh_regs_ent(
    const device HT* h [[buffer(0)]],
    const device WT* w [[buffer(1)]],
    const device int* targets [[buffer(4)]],
    const device float* lse [[buffer(5)]],
    const device float* g [[buffer(6)]],
    const device float* g_lse [[buffer(7)]],
    device float* part_acc [[buffer(11)]],
    device float* stage [[buffer(16)]],
    const device float* entropy [[buffer(21)]],
    const device float* g_ent [[buffer(24)]],
    constant FcceParams& p [[buffer(20)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint3 groups [[threadgroups_per_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  using T = typename fcce::TileOf<HT, WT>::type;
  threadgroup float smem[FCCE_REG_SMEM_FLOATS(sizeof(T))];
  const fcce::DenseWeight<WT, T> wt{w};
  fcce::regs_tiles<FCCE_MODE_DH, true>(h, wt, targets, lse, g, g_lse, nullptr, nullptr,
      nullptr, part_acc, stage, p, smem, group, groups, tid, sgid, lane,
      fcce::EntGrad{entropy, g_ent});
}

template <typename T, int bits, int group_size>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_THREADS)]] void head_dh_regs_ent_q(
    const device T* h [[buffer(0)]],
    const device uint8_t* w [[buffer(1)]],
    const device T* scales [[buffer(2)]],
    const device T* biases [[buffer(3)]],
    const device int* targets [[buffer(4)]],
    const device float* lse [[buffer(5)]],
    const device float* g [[buffer(6)]],
    const device float* g_lse [[buffer(7)]],
    device float* part_acc [[buffer(11)]],
    device float* stage [[buffer(16)]],
    const device float* entropy [[buffer(21)]],
    const device float* g_ent [[buffer(24)]],
    constant FcceParams& p [[buffer(20)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint3 groups [[threadgroups_per_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float smem[FCCE_REG_SMEM_FLOATS(sizeof(T))];
  const fcce::QuantWeight<T, bits, group_size> wt{w, scales, biases};
  fcce::regs_tiles<FCCE_MODE_DH, true>(h, wt, targets, lse, g, g_lse, nullptr, nullptr,
      nullptr, part_acc, stage, p, smem, group, groups, tid, sgid, lane,
      fcce::EntGrad{entropy, g_ent});
}

// Backward for a dense w: float32 dW rows of the launch's slab.
template <typename HT, typename WT>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_THREADS)]] void head_dw(
    const device HT* h [[buffer(0)]],
    const device WT* w [[buffer(1)]],
    const device int* targets [[buffer(4)]],
    const device float* lse [[buffer(5)]],
    const device float* g [[buffer(6)]],
    const device float* g_lse [[buffer(7)]],
    device float* acc [[buffer(14)]],
    constant FcceParams& p [[buffer(20)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  using T = typename fcce::TileOf<HT, WT>::type;
  threadgroup float smem[FCCE_SMEM_FLOATS(sizeof(T))];
  const fcce::DenseWeight<WT, T> wt{w};
  fcce::dw_tiles(h, wt, targets, lse, g, g_lse, acc, p, smem, group, tid, sgid, lane);
}

// dW with its accumulator in registers (metal/dw.h, dw_regs_tiles).
template <typename HT, typename WT>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_THREADS)]] void head_dw_regs(
    const device HT* h [[buffer(0)]],
    const device WT* w [[buffer(1)]],
    const device int* targets [[buffer(4)]],
    const device float* lse [[buffer(5)]],
    const device float* g [[buffer(6)]],
    const device float* g_lse [[buffer(7)]],
    device float* acc [[buffer(14)]],
    device float* stage [[buffer(16)]],
    constant FcceParams& p [[buffer(20)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  using T = typename fcce::TileOf<HT, WT>::type;
  threadgroup float smem[FCCE_REG_SMEM_FLOATS(sizeof(T))];
  const fcce::DenseWeight<WT, T> wt{w};
  fcce::dw_regs_tiles(h, wt, targets, lse, g, g_lse, acc, stage, p, smem, group, tid, sgid,
                      lane);
}

// dW with the entropy's cotangent (accumulator in registers).
template <typename HT, typename WT>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_THREADS)]] void head_dw_ent(
    const device HT* h [[buffer(0)]],
    const device WT* w [[buffer(1)]],
    const device int* targets [[buffer(4)]],
    const device float* lse [[buffer(5)]],
    const device float* g [[buffer(6)]],
    const device float* g_lse [[buffer(7)]],
    device float* acc [[buffer(14)]],
    device float* stage [[buffer(16)]],
    const device float* entropy [[buffer(21)]],
    const device float* g_ent [[buffer(24)]],
    constant FcceParams& p [[buffer(20)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  using T = typename fcce::TileOf<HT, WT>::type;
  threadgroup float smem[FCCE_REG_SMEM_FLOATS(sizeof(T))];
  const fcce::DenseWeight<WT, T> wt{w};
  fcce::dw_regs_tiles<true>(h, wt, targets, lse, g, g_lse, acc, stage, p, smem, group, tid, sgid,
                            lane, fcce::EntGrad{entropy, g_ent});
}

[[kernel]] [[max_total_threads_per_threadgroup(FCCE_EW_THREADS)]] void fcce_combine(
    const device int* targets [[buffer(4)]],
    device float* lse [[buffer(5)]],
    const device float* part_max [[buffer(8)]],
    const device float* part_sum [[buffer(9)]],
    const device float* target_logit [[buffer(10)]],
    device float* logp [[buffer(12)]],
    constant FcceParams& p [[buffer(20)]],
    uint i [[thread_position_in_grid]]) {
  fcce::combine_row(targets, part_max, part_sum, target_logit, logp, lse, p, i);
}

// The combine with the entropy statistics. A template (one instantiation), so
// that only the plans that use it compile it: a per-configuration source
// keeps every plain kernel.
template <typename OutT>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_EW_THREADS)]] void combine_ent(
    const device int* targets [[buffer(4)]],
    device float* lse [[buffer(5)]],
    const device float* part_max [[buffer(8)]],
    const device float* part_sum [[buffer(9)]],
    const device float* target_logit [[buffer(10)]],
    device float* logp [[buffer(12)]],
    device float* part_ent [[buffer(17)]],
    device float* part_lsum [[buffer(18)]],
    device int* part_arg [[buffer(19)]],
    device OutT* entropy [[buffer(21)]],
    device bool* is_top1 [[buffer(22)]],
    device OutT* mean_logit [[buffer(23)]],
    constant FcceParams& p [[buffer(20)]],
    uint i [[thread_position_in_grid]]) {
  fcce::combine_row<true>(targets, part_max, part_sum, target_logit, logp, lse, p, i,
      fcce::EntParts{part_ent, part_lsum, part_arg},
      fcce::EntOut{entropy, is_top1, mean_logit});
}

template <typename OutT>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_EW_THREADS)]] void reduce_dh(
    const device float* part_acc [[buffer(11)]],
    device OutT* out [[buffer(13)]],
    constant FcceParams& p [[buffer(20)]],
    uint i [[thread_position_in_grid]]) {
  fcce::reduce_splits<FCCE_REDUCE_SUM>(part_acc, nullptr, nullptr, out, p, i);
}

[[kernel]] [[max_total_threads_per_threadgroup(FCCE_EW_THREADS)]] void fcce_reduce_gsum(
    const device float* lse [[buffer(5)]],
    const device float* part_max [[buffer(8)]],
    const device float* part_acc [[buffer(11)]],
    device float* out [[buffer(13)]],
    constant FcceParams& p [[buffer(20)]],
    uint i [[thread_position_in_grid]]) {
  fcce::reduce_splits<FCCE_REDUCE_GSUM>(part_acc, part_max, lse, out, p, i);
}

template <typename OutT>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_EW_THREADS)]] void cast_dw(
    const device float* acc [[buffer(14)]],
    device OutT* dw [[buffer(15)]],
    constant FcceParams& p [[buffer(20)]],
    uint i [[thread_position_in_grid]]) {
  fcce::cast_rows(acc, dw, p, i);
}

// A quantized head's h, or its scales and biases, widened from half or
// bfloat16 to float where the head's tile type is float (plan.cpp).
template <typename InT>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_EW_THREADS)]] void widen(
    const device InT* src [[buffer(17)]],
    device float* dst [[buffer(18)]],
    constant FcceParams& p [[buffer(20)]],
    uint i [[thread_position_in_grid]]) {
  if (int(i) < p.count) {
    dst[i] = float(src[i]);
  }
}

template <typename OutT, typename WT>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_EW_THREADS)]] void fused_dh(
    const device WT* w [[buffer(1)]],
    const device int* targets [[buffer(4)]],
    const device float* lse [[buffer(5)]],
    const device float* g [[buffer(6)]],
    const device float* g_lse [[buffer(7)]],
    const device float* logp [[buffer(12)]],
    const device float* gsum [[buffer(13)]],
    device OutT* dh [[buffer(15)]],
    constant FcceParams& p [[buffer(20)]],
    uint i [[thread_position_in_grid]]) {
  const fcce::DenseElement<WT> wt{w};
  fcce::fused_dh_element(gsum, wt, targets, logp, lse, g, g_lse, dh, p, i);
}

template <typename OutT>
[[kernel]] [[max_total_threads_per_threadgroup(FCCE_EW_THREADS)]] void fused_dh_q(
    const device uint8_t* w [[buffer(1)]],
    const device uint8_t* scales [[buffer(2)]],
    const device uint8_t* biases [[buffer(3)]],
    const device int* targets [[buffer(4)]],
    const device float* lse [[buffer(5)]],
    const device float* g [[buffer(6)]],
    const device float* g_lse [[buffer(7)]],
    const device float* logp [[buffer(12)]],
    const device float* gsum [[buffer(13)]],
    device OutT* dh [[buffer(15)]],
    constant FcceParams& p [[buffer(20)]],
    uint i [[thread_position_in_grid]]) {
  const fcce::QuantElement wt{w, scales, biases};
  fcce::fused_dh_element(gsum, wt, targets, logp, lse, g, g_lse, dh, p, i);
}

// One line per template entry point: its name (as csrc/metal/plan.cpp lists
// it) and the instantiation. fcce_combine and fcce_reduce_gsum are plain kernels.

// fwd: dense heads
template [[host_name("fcce_fwd_hf32_wf32")]] [[kernel]] decltype(head_fwd<float, float>) head_fwd<float, float>;
template [[host_name("fcce_fwd_hf32_wf16")]] [[kernel]] decltype(head_fwd<float, half>) head_fwd<float, half>;
template [[host_name("fcce_fwd_hf32_wbf16")]] [[kernel]] decltype(head_fwd<float, bfloat16_t>) head_fwd<float, bfloat16_t>;
template [[host_name("fcce_fwd_hf16_wf32")]] [[kernel]] decltype(head_fwd<half, float>) head_fwd<half, float>;
template [[host_name("fcce_fwd_hf16_wf16")]] [[kernel]] decltype(head_fwd<half, half>) head_fwd<half, half>;
template [[host_name("fcce_fwd_hf16_wbf16")]] [[kernel]] decltype(head_fwd<half, bfloat16_t>) head_fwd<half, bfloat16_t>;
template [[host_name("fcce_fwd_hbf16_wf32")]] [[kernel]] decltype(head_fwd<bfloat16_t, float>) head_fwd<bfloat16_t, float>;
template [[host_name("fcce_fwd_hbf16_wf16")]] [[kernel]] decltype(head_fwd<bfloat16_t, half>) head_fwd<bfloat16_t, half>;
template [[host_name("fcce_fwd_hbf16_wbf16")]] [[kernel]] decltype(head_fwd<bfloat16_t, bfloat16_t>) head_fwd<bfloat16_t, bfloat16_t>;
// fwd: quantized heads
template [[host_name("fcce_fwd_hf32_q2_g32")]] [[kernel]] decltype(head_fwd_q<float, 2, 32>) head_fwd_q<float, 2, 32>;
template [[host_name("fcce_fwd_hf32_q2_g64")]] [[kernel]] decltype(head_fwd_q<float, 2, 64>) head_fwd_q<float, 2, 64>;
template [[host_name("fcce_fwd_hf32_q2_g128")]] [[kernel]] decltype(head_fwd_q<float, 2, 128>) head_fwd_q<float, 2, 128>;
template [[host_name("fcce_fwd_hf32_q3_g32")]] [[kernel]] decltype(head_fwd_q<float, 3, 32>) head_fwd_q<float, 3, 32>;
template [[host_name("fcce_fwd_hf32_q3_g64")]] [[kernel]] decltype(head_fwd_q<float, 3, 64>) head_fwd_q<float, 3, 64>;
template [[host_name("fcce_fwd_hf32_q3_g128")]] [[kernel]] decltype(head_fwd_q<float, 3, 128>) head_fwd_q<float, 3, 128>;
template [[host_name("fcce_fwd_hf32_q4_g32")]] [[kernel]] decltype(head_fwd_q<float, 4, 32>) head_fwd_q<float, 4, 32>;
template [[host_name("fcce_fwd_hf32_q4_g64")]] [[kernel]] decltype(head_fwd_q<float, 4, 64>) head_fwd_q<float, 4, 64>;
template [[host_name("fcce_fwd_hf32_q4_g128")]] [[kernel]] decltype(head_fwd_q<float, 4, 128>) head_fwd_q<float, 4, 128>;
template [[host_name("fcce_fwd_hf32_q5_g32")]] [[kernel]] decltype(head_fwd_q<float, 5, 32>) head_fwd_q<float, 5, 32>;
template [[host_name("fcce_fwd_hf32_q5_g64")]] [[kernel]] decltype(head_fwd_q<float, 5, 64>) head_fwd_q<float, 5, 64>;
template [[host_name("fcce_fwd_hf32_q5_g128")]] [[kernel]] decltype(head_fwd_q<float, 5, 128>) head_fwd_q<float, 5, 128>;
template [[host_name("fcce_fwd_hf32_q6_g32")]] [[kernel]] decltype(head_fwd_q<float, 6, 32>) head_fwd_q<float, 6, 32>;
template [[host_name("fcce_fwd_hf32_q6_g64")]] [[kernel]] decltype(head_fwd_q<float, 6, 64>) head_fwd_q<float, 6, 64>;
template [[host_name("fcce_fwd_hf32_q6_g128")]] [[kernel]] decltype(head_fwd_q<float, 6, 128>) head_fwd_q<float, 6, 128>;
template [[host_name("fcce_fwd_hf32_q8_g32")]] [[kernel]] decltype(head_fwd_q<float, 8, 32>) head_fwd_q<float, 8, 32>;
template [[host_name("fcce_fwd_hf32_q8_g64")]] [[kernel]] decltype(head_fwd_q<float, 8, 64>) head_fwd_q<float, 8, 64>;
template [[host_name("fcce_fwd_hf32_q8_g128")]] [[kernel]] decltype(head_fwd_q<float, 8, 128>) head_fwd_q<float, 8, 128>;
template [[host_name("fcce_fwd_hf16_q2_g32")]] [[kernel]] decltype(head_fwd_q<half, 2, 32>) head_fwd_q<half, 2, 32>;
template [[host_name("fcce_fwd_hf16_q2_g64")]] [[kernel]] decltype(head_fwd_q<half, 2, 64>) head_fwd_q<half, 2, 64>;
template [[host_name("fcce_fwd_hf16_q2_g128")]] [[kernel]] decltype(head_fwd_q<half, 2, 128>) head_fwd_q<half, 2, 128>;
template [[host_name("fcce_fwd_hf16_q3_g32")]] [[kernel]] decltype(head_fwd_q<half, 3, 32>) head_fwd_q<half, 3, 32>;
template [[host_name("fcce_fwd_hf16_q3_g64")]] [[kernel]] decltype(head_fwd_q<half, 3, 64>) head_fwd_q<half, 3, 64>;
template [[host_name("fcce_fwd_hf16_q3_g128")]] [[kernel]] decltype(head_fwd_q<half, 3, 128>) head_fwd_q<half, 3, 128>;
template [[host_name("fcce_fwd_hf16_q4_g32")]] [[kernel]] decltype(head_fwd_q<half, 4, 32>) head_fwd_q<half, 4, 32>;
template [[host_name("fcce_fwd_hf16_q4_g64")]] [[kernel]] decltype(head_fwd_q<half, 4, 64>) head_fwd_q<half, 4, 64>;
template [[host_name("fcce_fwd_hf16_q4_g128")]] [[kernel]] decltype(head_fwd_q<half, 4, 128>) head_fwd_q<half, 4, 128>;
template [[host_name("fcce_fwd_hf16_q5_g32")]] [[kernel]] decltype(head_fwd_q<half, 5, 32>) head_fwd_q<half, 5, 32>;
template [[host_name("fcce_fwd_hf16_q5_g64")]] [[kernel]] decltype(head_fwd_q<half, 5, 64>) head_fwd_q<half, 5, 64>;
template [[host_name("fcce_fwd_hf16_q5_g128")]] [[kernel]] decltype(head_fwd_q<half, 5, 128>) head_fwd_q<half, 5, 128>;
template [[host_name("fcce_fwd_hf16_q6_g32")]] [[kernel]] decltype(head_fwd_q<half, 6, 32>) head_fwd_q<half, 6, 32>;
template [[host_name("fcce_fwd_hf16_q6_g64")]] [[kernel]] decltype(head_fwd_q<half, 6, 64>) head_fwd_q<half, 6, 64>;
template [[host_name("fcce_fwd_hf16_q6_g128")]] [[kernel]] decltype(head_fwd_q<half, 6, 128>) head_fwd_q<half, 6, 128>;
template [[host_name("fcce_fwd_hf16_q8_g32")]] [[kernel]] decltype(head_fwd_q<half, 8, 32>) head_fwd_q<half, 8, 32>;
template [[host_name("fcce_fwd_hf16_q8_g64")]] [[kernel]] decltype(head_fwd_q<half, 8, 64>) head_fwd_q<half, 8, 64>;
template [[host_name("fcce_fwd_hf16_q8_g128")]] [[kernel]] decltype(head_fwd_q<half, 8, 128>) head_fwd_q<half, 8, 128>;
template [[host_name("fcce_fwd_hbf16_q2_g32")]] [[kernel]] decltype(head_fwd_q<bfloat16_t, 2, 32>) head_fwd_q<bfloat16_t, 2, 32>;
template [[host_name("fcce_fwd_hbf16_q2_g64")]] [[kernel]] decltype(head_fwd_q<bfloat16_t, 2, 64>) head_fwd_q<bfloat16_t, 2, 64>;
template [[host_name("fcce_fwd_hbf16_q2_g128")]] [[kernel]] decltype(head_fwd_q<bfloat16_t, 2, 128>) head_fwd_q<bfloat16_t, 2, 128>;
template [[host_name("fcce_fwd_hbf16_q3_g32")]] [[kernel]] decltype(head_fwd_q<bfloat16_t, 3, 32>) head_fwd_q<bfloat16_t, 3, 32>;
template [[host_name("fcce_fwd_hbf16_q3_g64")]] [[kernel]] decltype(head_fwd_q<bfloat16_t, 3, 64>) head_fwd_q<bfloat16_t, 3, 64>;
template [[host_name("fcce_fwd_hbf16_q3_g128")]] [[kernel]] decltype(head_fwd_q<bfloat16_t, 3, 128>) head_fwd_q<bfloat16_t, 3, 128>;
template [[host_name("fcce_fwd_hbf16_q4_g32")]] [[kernel]] decltype(head_fwd_q<bfloat16_t, 4, 32>) head_fwd_q<bfloat16_t, 4, 32>;
template [[host_name("fcce_fwd_hbf16_q4_g64")]] [[kernel]] decltype(head_fwd_q<bfloat16_t, 4, 64>) head_fwd_q<bfloat16_t, 4, 64>;
template [[host_name("fcce_fwd_hbf16_q4_g128")]] [[kernel]] decltype(head_fwd_q<bfloat16_t, 4, 128>) head_fwd_q<bfloat16_t, 4, 128>;
template [[host_name("fcce_fwd_hbf16_q5_g32")]] [[kernel]] decltype(head_fwd_q<bfloat16_t, 5, 32>) head_fwd_q<bfloat16_t, 5, 32>;
template [[host_name("fcce_fwd_hbf16_q5_g64")]] [[kernel]] decltype(head_fwd_q<bfloat16_t, 5, 64>) head_fwd_q<bfloat16_t, 5, 64>;
template [[host_name("fcce_fwd_hbf16_q5_g128")]] [[kernel]] decltype(head_fwd_q<bfloat16_t, 5, 128>) head_fwd_q<bfloat16_t, 5, 128>;
template [[host_name("fcce_fwd_hbf16_q6_g32")]] [[kernel]] decltype(head_fwd_q<bfloat16_t, 6, 32>) head_fwd_q<bfloat16_t, 6, 32>;
template [[host_name("fcce_fwd_hbf16_q6_g64")]] [[kernel]] decltype(head_fwd_q<bfloat16_t, 6, 64>) head_fwd_q<bfloat16_t, 6, 64>;
template [[host_name("fcce_fwd_hbf16_q6_g128")]] [[kernel]] decltype(head_fwd_q<bfloat16_t, 6, 128>) head_fwd_q<bfloat16_t, 6, 128>;
template [[host_name("fcce_fwd_hbf16_q8_g32")]] [[kernel]] decltype(head_fwd_q<bfloat16_t, 8, 32>) head_fwd_q<bfloat16_t, 8, 32>;
template [[host_name("fcce_fwd_hbf16_q8_g64")]] [[kernel]] decltype(head_fwd_q<bfloat16_t, 8, 64>) head_fwd_q<bfloat16_t, 8, 64>;
template [[host_name("fcce_fwd_hbf16_q8_g128")]] [[kernel]] decltype(head_fwd_q<bfloat16_t, 8, 128>) head_fwd_q<bfloat16_t, 8, 128>;
// fwd_fused: dense heads
template [[host_name("fcce_fwd_fused_hf32_wf32")]] [[kernel]] decltype(head_fwd_fused<float, float>) head_fwd_fused<float, float>;
template [[host_name("fcce_fwd_fused_hf32_wf16")]] [[kernel]] decltype(head_fwd_fused<float, half>) head_fwd_fused<float, half>;
template [[host_name("fcce_fwd_fused_hf32_wbf16")]] [[kernel]] decltype(head_fwd_fused<float, bfloat16_t>) head_fwd_fused<float, bfloat16_t>;
template [[host_name("fcce_fwd_fused_hf16_wf32")]] [[kernel]] decltype(head_fwd_fused<half, float>) head_fwd_fused<half, float>;
template [[host_name("fcce_fwd_fused_hf16_wf16")]] [[kernel]] decltype(head_fwd_fused<half, half>) head_fwd_fused<half, half>;
template [[host_name("fcce_fwd_fused_hf16_wbf16")]] [[kernel]] decltype(head_fwd_fused<half, bfloat16_t>) head_fwd_fused<half, bfloat16_t>;
template [[host_name("fcce_fwd_fused_hbf16_wf32")]] [[kernel]] decltype(head_fwd_fused<bfloat16_t, float>) head_fwd_fused<bfloat16_t, float>;
template [[host_name("fcce_fwd_fused_hbf16_wf16")]] [[kernel]] decltype(head_fwd_fused<bfloat16_t, half>) head_fwd_fused<bfloat16_t, half>;
template [[host_name("fcce_fwd_fused_hbf16_wbf16")]] [[kernel]] decltype(head_fwd_fused<bfloat16_t, bfloat16_t>) head_fwd_fused<bfloat16_t, bfloat16_t>;
// fwd_fused: quantized heads
template [[host_name("fcce_fwd_fused_hf32_q2_g32")]] [[kernel]] decltype(head_fwd_fused_q<float, 2, 32>) head_fwd_fused_q<float, 2, 32>;
template [[host_name("fcce_fwd_fused_hf32_q2_g64")]] [[kernel]] decltype(head_fwd_fused_q<float, 2, 64>) head_fwd_fused_q<float, 2, 64>;
template [[host_name("fcce_fwd_fused_hf32_q2_g128")]] [[kernel]] decltype(head_fwd_fused_q<float, 2, 128>) head_fwd_fused_q<float, 2, 128>;
template [[host_name("fcce_fwd_fused_hf32_q3_g32")]] [[kernel]] decltype(head_fwd_fused_q<float, 3, 32>) head_fwd_fused_q<float, 3, 32>;
template [[host_name("fcce_fwd_fused_hf32_q3_g64")]] [[kernel]] decltype(head_fwd_fused_q<float, 3, 64>) head_fwd_fused_q<float, 3, 64>;
template [[host_name("fcce_fwd_fused_hf32_q3_g128")]] [[kernel]] decltype(head_fwd_fused_q<float, 3, 128>) head_fwd_fused_q<float, 3, 128>;
template [[host_name("fcce_fwd_fused_hf32_q4_g32")]] [[kernel]] decltype(head_fwd_fused_q<float, 4, 32>) head_fwd_fused_q<float, 4, 32>;
template [[host_name("fcce_fwd_fused_hf32_q4_g64")]] [[kernel]] decltype(head_fwd_fused_q<float, 4, 64>) head_fwd_fused_q<float, 4, 64>;
template [[host_name("fcce_fwd_fused_hf32_q4_g128")]] [[kernel]] decltype(head_fwd_fused_q<float, 4, 128>) head_fwd_fused_q<float, 4, 128>;
template [[host_name("fcce_fwd_fused_hf32_q5_g32")]] [[kernel]] decltype(head_fwd_fused_q<float, 5, 32>) head_fwd_fused_q<float, 5, 32>;
template [[host_name("fcce_fwd_fused_hf32_q5_g64")]] [[kernel]] decltype(head_fwd_fused_q<float, 5, 64>) head_fwd_fused_q<float, 5, 64>;
template [[host_name("fcce_fwd_fused_hf32_q5_g128")]] [[kernel]] decltype(head_fwd_fused_q<float, 5, 128>) head_fwd_fused_q<float, 5, 128>;
template [[host_name("fcce_fwd_fused_hf32_q6_g32")]] [[kernel]] decltype(head_fwd_fused_q<float, 6, 32>) head_fwd_fused_q<float, 6, 32>;
template [[host_name("fcce_fwd_fused_hf32_q6_g64")]] [[kernel]] decltype(head_fwd_fused_q<float, 6, 64>) head_fwd_fused_q<float, 6, 64>;
template [[host_name("fcce_fwd_fused_hf32_q6_g128")]] [[kernel]] decltype(head_fwd_fused_q<float, 6, 128>) head_fwd_fused_q<float, 6, 128>;
template [[host_name("fcce_fwd_fused_hf32_q8_g32")]] [[kernel]] decltype(head_fwd_fused_q<float, 8, 32>) head_fwd_fused_q<float, 8, 32>;
template [[host_name("fcce_fwd_fused_hf32_q8_g64")]] [[kernel]] decltype(head_fwd_fused_q<float, 8, 64>) head_fwd_fused_q<float, 8, 64>;
template [[host_name("fcce_fwd_fused_hf32_q8_g128")]] [[kernel]] decltype(head_fwd_fused_q<float, 8, 128>) head_fwd_fused_q<float, 8, 128>;
template [[host_name("fcce_fwd_fused_hf16_q2_g32")]] [[kernel]] decltype(head_fwd_fused_q<half, 2, 32>) head_fwd_fused_q<half, 2, 32>;
template [[host_name("fcce_fwd_fused_hf16_q2_g64")]] [[kernel]] decltype(head_fwd_fused_q<half, 2, 64>) head_fwd_fused_q<half, 2, 64>;
template [[host_name("fcce_fwd_fused_hf16_q2_g128")]] [[kernel]] decltype(head_fwd_fused_q<half, 2, 128>) head_fwd_fused_q<half, 2, 128>;
template [[host_name("fcce_fwd_fused_hf16_q3_g32")]] [[kernel]] decltype(head_fwd_fused_q<half, 3, 32>) head_fwd_fused_q<half, 3, 32>;
template [[host_name("fcce_fwd_fused_hf16_q3_g64")]] [[kernel]] decltype(head_fwd_fused_q<half, 3, 64>) head_fwd_fused_q<half, 3, 64>;
template [[host_name("fcce_fwd_fused_hf16_q3_g128")]] [[kernel]] decltype(head_fwd_fused_q<half, 3, 128>) head_fwd_fused_q<half, 3, 128>;
template [[host_name("fcce_fwd_fused_hf16_q4_g32")]] [[kernel]] decltype(head_fwd_fused_q<half, 4, 32>) head_fwd_fused_q<half, 4, 32>;
template [[host_name("fcce_fwd_fused_hf16_q4_g64")]] [[kernel]] decltype(head_fwd_fused_q<half, 4, 64>) head_fwd_fused_q<half, 4, 64>;
template [[host_name("fcce_fwd_fused_hf16_q4_g128")]] [[kernel]] decltype(head_fwd_fused_q<half, 4, 128>) head_fwd_fused_q<half, 4, 128>;
template [[host_name("fcce_fwd_fused_hf16_q5_g32")]] [[kernel]] decltype(head_fwd_fused_q<half, 5, 32>) head_fwd_fused_q<half, 5, 32>;
template [[host_name("fcce_fwd_fused_hf16_q5_g64")]] [[kernel]] decltype(head_fwd_fused_q<half, 5, 64>) head_fwd_fused_q<half, 5, 64>;
template [[host_name("fcce_fwd_fused_hf16_q5_g128")]] [[kernel]] decltype(head_fwd_fused_q<half, 5, 128>) head_fwd_fused_q<half, 5, 128>;
template [[host_name("fcce_fwd_fused_hf16_q6_g32")]] [[kernel]] decltype(head_fwd_fused_q<half, 6, 32>) head_fwd_fused_q<half, 6, 32>;
template [[host_name("fcce_fwd_fused_hf16_q6_g64")]] [[kernel]] decltype(head_fwd_fused_q<half, 6, 64>) head_fwd_fused_q<half, 6, 64>;
template [[host_name("fcce_fwd_fused_hf16_q6_g128")]] [[kernel]] decltype(head_fwd_fused_q<half, 6, 128>) head_fwd_fused_q<half, 6, 128>;
template [[host_name("fcce_fwd_fused_hf16_q8_g32")]] [[kernel]] decltype(head_fwd_fused_q<half, 8, 32>) head_fwd_fused_q<half, 8, 32>;
template [[host_name("fcce_fwd_fused_hf16_q8_g64")]] [[kernel]] decltype(head_fwd_fused_q<half, 8, 64>) head_fwd_fused_q<half, 8, 64>;
template [[host_name("fcce_fwd_fused_hf16_q8_g128")]] [[kernel]] decltype(head_fwd_fused_q<half, 8, 128>) head_fwd_fused_q<half, 8, 128>;
template [[host_name("fcce_fwd_fused_hbf16_q2_g32")]] [[kernel]] decltype(head_fwd_fused_q<bfloat16_t, 2, 32>) head_fwd_fused_q<bfloat16_t, 2, 32>;
template [[host_name("fcce_fwd_fused_hbf16_q2_g64")]] [[kernel]] decltype(head_fwd_fused_q<bfloat16_t, 2, 64>) head_fwd_fused_q<bfloat16_t, 2, 64>;
template [[host_name("fcce_fwd_fused_hbf16_q2_g128")]] [[kernel]] decltype(head_fwd_fused_q<bfloat16_t, 2, 128>) head_fwd_fused_q<bfloat16_t, 2, 128>;
template [[host_name("fcce_fwd_fused_hbf16_q3_g32")]] [[kernel]] decltype(head_fwd_fused_q<bfloat16_t, 3, 32>) head_fwd_fused_q<bfloat16_t, 3, 32>;
template [[host_name("fcce_fwd_fused_hbf16_q3_g64")]] [[kernel]] decltype(head_fwd_fused_q<bfloat16_t, 3, 64>) head_fwd_fused_q<bfloat16_t, 3, 64>;
template [[host_name("fcce_fwd_fused_hbf16_q3_g128")]] [[kernel]] decltype(head_fwd_fused_q<bfloat16_t, 3, 128>) head_fwd_fused_q<bfloat16_t, 3, 128>;
template [[host_name("fcce_fwd_fused_hbf16_q4_g32")]] [[kernel]] decltype(head_fwd_fused_q<bfloat16_t, 4, 32>) head_fwd_fused_q<bfloat16_t, 4, 32>;
template [[host_name("fcce_fwd_fused_hbf16_q4_g64")]] [[kernel]] decltype(head_fwd_fused_q<bfloat16_t, 4, 64>) head_fwd_fused_q<bfloat16_t, 4, 64>;
template [[host_name("fcce_fwd_fused_hbf16_q4_g128")]] [[kernel]] decltype(head_fwd_fused_q<bfloat16_t, 4, 128>) head_fwd_fused_q<bfloat16_t, 4, 128>;
template [[host_name("fcce_fwd_fused_hbf16_q5_g32")]] [[kernel]] decltype(head_fwd_fused_q<bfloat16_t, 5, 32>) head_fwd_fused_q<bfloat16_t, 5, 32>;
template [[host_name("fcce_fwd_fused_hbf16_q5_g64")]] [[kernel]] decltype(head_fwd_fused_q<bfloat16_t, 5, 64>) head_fwd_fused_q<bfloat16_t, 5, 64>;
template [[host_name("fcce_fwd_fused_hbf16_q5_g128")]] [[kernel]] decltype(head_fwd_fused_q<bfloat16_t, 5, 128>) head_fwd_fused_q<bfloat16_t, 5, 128>;
template [[host_name("fcce_fwd_fused_hbf16_q6_g32")]] [[kernel]] decltype(head_fwd_fused_q<bfloat16_t, 6, 32>) head_fwd_fused_q<bfloat16_t, 6, 32>;
template [[host_name("fcce_fwd_fused_hbf16_q6_g64")]] [[kernel]] decltype(head_fwd_fused_q<bfloat16_t, 6, 64>) head_fwd_fused_q<bfloat16_t, 6, 64>;
template [[host_name("fcce_fwd_fused_hbf16_q6_g128")]] [[kernel]] decltype(head_fwd_fused_q<bfloat16_t, 6, 128>) head_fwd_fused_q<bfloat16_t, 6, 128>;
template [[host_name("fcce_fwd_fused_hbf16_q8_g32")]] [[kernel]] decltype(head_fwd_fused_q<bfloat16_t, 8, 32>) head_fwd_fused_q<bfloat16_t, 8, 32>;
template [[host_name("fcce_fwd_fused_hbf16_q8_g64")]] [[kernel]] decltype(head_fwd_fused_q<bfloat16_t, 8, 64>) head_fwd_fused_q<bfloat16_t, 8, 64>;
template [[host_name("fcce_fwd_fused_hbf16_q8_g128")]] [[kernel]] decltype(head_fwd_fused_q<bfloat16_t, 8, 128>) head_fwd_fused_q<bfloat16_t, 8, 128>;
// dh: dense heads
template [[host_name("fcce_dh_hf32_wf32")]] [[kernel]] decltype(head_dh<float, float>) head_dh<float, float>;
template [[host_name("fcce_dh_hf32_wf16")]] [[kernel]] decltype(head_dh<float, half>) head_dh<float, half>;
template [[host_name("fcce_dh_hf32_wbf16")]] [[kernel]] decltype(head_dh<float, bfloat16_t>) head_dh<float, bfloat16_t>;
template [[host_name("fcce_dh_hf16_wf32")]] [[kernel]] decltype(head_dh<half, float>) head_dh<half, float>;
template [[host_name("fcce_dh_hf16_wf16")]] [[kernel]] decltype(head_dh<half, half>) head_dh<half, half>;
template [[host_name("fcce_dh_hf16_wbf16")]] [[kernel]] decltype(head_dh<half, bfloat16_t>) head_dh<half, bfloat16_t>;
template [[host_name("fcce_dh_hbf16_wf32")]] [[kernel]] decltype(head_dh<bfloat16_t, float>) head_dh<bfloat16_t, float>;
template [[host_name("fcce_dh_hbf16_wf16")]] [[kernel]] decltype(head_dh<bfloat16_t, half>) head_dh<bfloat16_t, half>;
template [[host_name("fcce_dh_hbf16_wbf16")]] [[kernel]] decltype(head_dh<bfloat16_t, bfloat16_t>) head_dh<bfloat16_t, bfloat16_t>;
// dh: quantized heads
template [[host_name("fcce_dh_hf32_q2_g32")]] [[kernel]] decltype(head_dh_q<float, 2, 32>) head_dh_q<float, 2, 32>;
template [[host_name("fcce_dh_hf32_q2_g64")]] [[kernel]] decltype(head_dh_q<float, 2, 64>) head_dh_q<float, 2, 64>;
template [[host_name("fcce_dh_hf32_q2_g128")]] [[kernel]] decltype(head_dh_q<float, 2, 128>) head_dh_q<float, 2, 128>;
template [[host_name("fcce_dh_hf32_q3_g32")]] [[kernel]] decltype(head_dh_q<float, 3, 32>) head_dh_q<float, 3, 32>;
template [[host_name("fcce_dh_hf32_q3_g64")]] [[kernel]] decltype(head_dh_q<float, 3, 64>) head_dh_q<float, 3, 64>;
template [[host_name("fcce_dh_hf32_q3_g128")]] [[kernel]] decltype(head_dh_q<float, 3, 128>) head_dh_q<float, 3, 128>;
template [[host_name("fcce_dh_hf32_q4_g32")]] [[kernel]] decltype(head_dh_q<float, 4, 32>) head_dh_q<float, 4, 32>;
template [[host_name("fcce_dh_hf32_q4_g64")]] [[kernel]] decltype(head_dh_q<float, 4, 64>) head_dh_q<float, 4, 64>;
template [[host_name("fcce_dh_hf32_q4_g128")]] [[kernel]] decltype(head_dh_q<float, 4, 128>) head_dh_q<float, 4, 128>;
template [[host_name("fcce_dh_hf32_q5_g32")]] [[kernel]] decltype(head_dh_q<float, 5, 32>) head_dh_q<float, 5, 32>;
template [[host_name("fcce_dh_hf32_q5_g64")]] [[kernel]] decltype(head_dh_q<float, 5, 64>) head_dh_q<float, 5, 64>;
template [[host_name("fcce_dh_hf32_q5_g128")]] [[kernel]] decltype(head_dh_q<float, 5, 128>) head_dh_q<float, 5, 128>;
template [[host_name("fcce_dh_hf32_q6_g32")]] [[kernel]] decltype(head_dh_q<float, 6, 32>) head_dh_q<float, 6, 32>;
template [[host_name("fcce_dh_hf32_q6_g64")]] [[kernel]] decltype(head_dh_q<float, 6, 64>) head_dh_q<float, 6, 64>;
template [[host_name("fcce_dh_hf32_q6_g128")]] [[kernel]] decltype(head_dh_q<float, 6, 128>) head_dh_q<float, 6, 128>;
template [[host_name("fcce_dh_hf32_q8_g32")]] [[kernel]] decltype(head_dh_q<float, 8, 32>) head_dh_q<float, 8, 32>;
template [[host_name("fcce_dh_hf32_q8_g64")]] [[kernel]] decltype(head_dh_q<float, 8, 64>) head_dh_q<float, 8, 64>;
template [[host_name("fcce_dh_hf32_q8_g128")]] [[kernel]] decltype(head_dh_q<float, 8, 128>) head_dh_q<float, 8, 128>;
template [[host_name("fcce_dh_hf16_q2_g32")]] [[kernel]] decltype(head_dh_q<half, 2, 32>) head_dh_q<half, 2, 32>;
template [[host_name("fcce_dh_hf16_q2_g64")]] [[kernel]] decltype(head_dh_q<half, 2, 64>) head_dh_q<half, 2, 64>;
template [[host_name("fcce_dh_hf16_q2_g128")]] [[kernel]] decltype(head_dh_q<half, 2, 128>) head_dh_q<half, 2, 128>;
template [[host_name("fcce_dh_hf16_q3_g32")]] [[kernel]] decltype(head_dh_q<half, 3, 32>) head_dh_q<half, 3, 32>;
template [[host_name("fcce_dh_hf16_q3_g64")]] [[kernel]] decltype(head_dh_q<half, 3, 64>) head_dh_q<half, 3, 64>;
template [[host_name("fcce_dh_hf16_q3_g128")]] [[kernel]] decltype(head_dh_q<half, 3, 128>) head_dh_q<half, 3, 128>;
template [[host_name("fcce_dh_hf16_q4_g32")]] [[kernel]] decltype(head_dh_q<half, 4, 32>) head_dh_q<half, 4, 32>;
template [[host_name("fcce_dh_hf16_q4_g64")]] [[kernel]] decltype(head_dh_q<half, 4, 64>) head_dh_q<half, 4, 64>;
template [[host_name("fcce_dh_hf16_q4_g128")]] [[kernel]] decltype(head_dh_q<half, 4, 128>) head_dh_q<half, 4, 128>;
template [[host_name("fcce_dh_hf16_q5_g32")]] [[kernel]] decltype(head_dh_q<half, 5, 32>) head_dh_q<half, 5, 32>;
template [[host_name("fcce_dh_hf16_q5_g64")]] [[kernel]] decltype(head_dh_q<half, 5, 64>) head_dh_q<half, 5, 64>;
template [[host_name("fcce_dh_hf16_q5_g128")]] [[kernel]] decltype(head_dh_q<half, 5, 128>) head_dh_q<half, 5, 128>;
template [[host_name("fcce_dh_hf16_q6_g32")]] [[kernel]] decltype(head_dh_q<half, 6, 32>) head_dh_q<half, 6, 32>;
template [[host_name("fcce_dh_hf16_q6_g64")]] [[kernel]] decltype(head_dh_q<half, 6, 64>) head_dh_q<half, 6, 64>;
template [[host_name("fcce_dh_hf16_q6_g128")]] [[kernel]] decltype(head_dh_q<half, 6, 128>) head_dh_q<half, 6, 128>;
template [[host_name("fcce_dh_hf16_q8_g32")]] [[kernel]] decltype(head_dh_q<half, 8, 32>) head_dh_q<half, 8, 32>;
template [[host_name("fcce_dh_hf16_q8_g64")]] [[kernel]] decltype(head_dh_q<half, 8, 64>) head_dh_q<half, 8, 64>;
template [[host_name("fcce_dh_hf16_q8_g128")]] [[kernel]] decltype(head_dh_q<half, 8, 128>) head_dh_q<half, 8, 128>;
template [[host_name("fcce_dh_hbf16_q2_g32")]] [[kernel]] decltype(head_dh_q<bfloat16_t, 2, 32>) head_dh_q<bfloat16_t, 2, 32>;
template [[host_name("fcce_dh_hbf16_q2_g64")]] [[kernel]] decltype(head_dh_q<bfloat16_t, 2, 64>) head_dh_q<bfloat16_t, 2, 64>;
template [[host_name("fcce_dh_hbf16_q2_g128")]] [[kernel]] decltype(head_dh_q<bfloat16_t, 2, 128>) head_dh_q<bfloat16_t, 2, 128>;
template [[host_name("fcce_dh_hbf16_q3_g32")]] [[kernel]] decltype(head_dh_q<bfloat16_t, 3, 32>) head_dh_q<bfloat16_t, 3, 32>;
template [[host_name("fcce_dh_hbf16_q3_g64")]] [[kernel]] decltype(head_dh_q<bfloat16_t, 3, 64>) head_dh_q<bfloat16_t, 3, 64>;
template [[host_name("fcce_dh_hbf16_q3_g128")]] [[kernel]] decltype(head_dh_q<bfloat16_t, 3, 128>) head_dh_q<bfloat16_t, 3, 128>;
template [[host_name("fcce_dh_hbf16_q4_g32")]] [[kernel]] decltype(head_dh_q<bfloat16_t, 4, 32>) head_dh_q<bfloat16_t, 4, 32>;
template [[host_name("fcce_dh_hbf16_q4_g64")]] [[kernel]] decltype(head_dh_q<bfloat16_t, 4, 64>) head_dh_q<bfloat16_t, 4, 64>;
template [[host_name("fcce_dh_hbf16_q4_g128")]] [[kernel]] decltype(head_dh_q<bfloat16_t, 4, 128>) head_dh_q<bfloat16_t, 4, 128>;
template [[host_name("fcce_dh_hbf16_q5_g32")]] [[kernel]] decltype(head_dh_q<bfloat16_t, 5, 32>) head_dh_q<bfloat16_t, 5, 32>;
template [[host_name("fcce_dh_hbf16_q5_g64")]] [[kernel]] decltype(head_dh_q<bfloat16_t, 5, 64>) head_dh_q<bfloat16_t, 5, 64>;
template [[host_name("fcce_dh_hbf16_q5_g128")]] [[kernel]] decltype(head_dh_q<bfloat16_t, 5, 128>) head_dh_q<bfloat16_t, 5, 128>;
template [[host_name("fcce_dh_hbf16_q6_g32")]] [[kernel]] decltype(head_dh_q<bfloat16_t, 6, 32>) head_dh_q<bfloat16_t, 6, 32>;
template [[host_name("fcce_dh_hbf16_q6_g64")]] [[kernel]] decltype(head_dh_q<bfloat16_t, 6, 64>) head_dh_q<bfloat16_t, 6, 64>;
template [[host_name("fcce_dh_hbf16_q6_g128")]] [[kernel]] decltype(head_dh_q<bfloat16_t, 6, 128>) head_dh_q<bfloat16_t, 6, 128>;
template [[host_name("fcce_dh_hbf16_q8_g32")]] [[kernel]] decltype(head_dh_q<bfloat16_t, 8, 32>) head_dh_q<bfloat16_t, 8, 32>;
template [[host_name("fcce_dh_hbf16_q8_g64")]] [[kernel]] decltype(head_dh_q<bfloat16_t, 8, 64>) head_dh_q<bfloat16_t, 8, 64>;
template [[host_name("fcce_dh_hbf16_q8_g128")]] [[kernel]] decltype(head_dh_q<bfloat16_t, 8, 128>) head_dh_q<bfloat16_t, 8, 128>;
// fused forward with the accumulator in registers: dense heads
template [[host_name("fcce_fwdreg_hf32_wf32")]] [[kernel]] decltype(head_fwd_fused_regs<float, float>) head_fwd_fused_regs<float, float>;
template [[host_name("fcce_fwdreg_hf32_wf16")]] [[kernel]] decltype(head_fwd_fused_regs<float, half>) head_fwd_fused_regs<float, half>;
template [[host_name("fcce_fwdreg_hf32_wbf16")]] [[kernel]] decltype(head_fwd_fused_regs<float, bfloat16_t>) head_fwd_fused_regs<float, bfloat16_t>;
template [[host_name("fcce_fwdreg_hf16_wf32")]] [[kernel]] decltype(head_fwd_fused_regs<half, float>) head_fwd_fused_regs<half, float>;
template [[host_name("fcce_fwdreg_hf16_wf16")]] [[kernel]] decltype(head_fwd_fused_regs<half, half>) head_fwd_fused_regs<half, half>;
template [[host_name("fcce_fwdreg_hf16_wbf16")]] [[kernel]] decltype(head_fwd_fused_regs<half, bfloat16_t>) head_fwd_fused_regs<half, bfloat16_t>;
template [[host_name("fcce_fwdreg_hbf16_wf32")]] [[kernel]] decltype(head_fwd_fused_regs<bfloat16_t, float>) head_fwd_fused_regs<bfloat16_t, float>;
template [[host_name("fcce_fwdreg_hbf16_wf16")]] [[kernel]] decltype(head_fwd_fused_regs<bfloat16_t, half>) head_fwd_fused_regs<bfloat16_t, half>;
template [[host_name("fcce_fwdreg_hbf16_wbf16")]] [[kernel]] decltype(head_fwd_fused_regs<bfloat16_t, bfloat16_t>) head_fwd_fused_regs<bfloat16_t, bfloat16_t>;
// fused forward with the accumulator in registers: quantized heads
template [[host_name("fcce_fwdreg_hf32_q2_g32")]] [[kernel]] decltype(head_fwd_fused_regs_q<float, 2, 32>) head_fwd_fused_regs_q<float, 2, 32>;
template [[host_name("fcce_fwdreg_hf32_q2_g64")]] [[kernel]] decltype(head_fwd_fused_regs_q<float, 2, 64>) head_fwd_fused_regs_q<float, 2, 64>;
template [[host_name("fcce_fwdreg_hf32_q2_g128")]] [[kernel]] decltype(head_fwd_fused_regs_q<float, 2, 128>) head_fwd_fused_regs_q<float, 2, 128>;
template [[host_name("fcce_fwdreg_hf32_q3_g32")]] [[kernel]] decltype(head_fwd_fused_regs_q<float, 3, 32>) head_fwd_fused_regs_q<float, 3, 32>;
template [[host_name("fcce_fwdreg_hf32_q3_g64")]] [[kernel]] decltype(head_fwd_fused_regs_q<float, 3, 64>) head_fwd_fused_regs_q<float, 3, 64>;
template [[host_name("fcce_fwdreg_hf32_q3_g128")]] [[kernel]] decltype(head_fwd_fused_regs_q<float, 3, 128>) head_fwd_fused_regs_q<float, 3, 128>;
template [[host_name("fcce_fwdreg_hf32_q4_g32")]] [[kernel]] decltype(head_fwd_fused_regs_q<float, 4, 32>) head_fwd_fused_regs_q<float, 4, 32>;
template [[host_name("fcce_fwdreg_hf32_q4_g64")]] [[kernel]] decltype(head_fwd_fused_regs_q<float, 4, 64>) head_fwd_fused_regs_q<float, 4, 64>;
template [[host_name("fcce_fwdreg_hf32_q4_g128")]] [[kernel]] decltype(head_fwd_fused_regs_q<float, 4, 128>) head_fwd_fused_regs_q<float, 4, 128>;
template [[host_name("fcce_fwdreg_hf32_q5_g32")]] [[kernel]] decltype(head_fwd_fused_regs_q<float, 5, 32>) head_fwd_fused_regs_q<float, 5, 32>;
template [[host_name("fcce_fwdreg_hf32_q5_g64")]] [[kernel]] decltype(head_fwd_fused_regs_q<float, 5, 64>) head_fwd_fused_regs_q<float, 5, 64>;
template [[host_name("fcce_fwdreg_hf32_q5_g128")]] [[kernel]] decltype(head_fwd_fused_regs_q<float, 5, 128>) head_fwd_fused_regs_q<float, 5, 128>;
template [[host_name("fcce_fwdreg_hf32_q6_g32")]] [[kernel]] decltype(head_fwd_fused_regs_q<float, 6, 32>) head_fwd_fused_regs_q<float, 6, 32>;
template [[host_name("fcce_fwdreg_hf32_q6_g64")]] [[kernel]] decltype(head_fwd_fused_regs_q<float, 6, 64>) head_fwd_fused_regs_q<float, 6, 64>;
template [[host_name("fcce_fwdreg_hf32_q6_g128")]] [[kernel]] decltype(head_fwd_fused_regs_q<float, 6, 128>) head_fwd_fused_regs_q<float, 6, 128>;
template [[host_name("fcce_fwdreg_hf32_q8_g32")]] [[kernel]] decltype(head_fwd_fused_regs_q<float, 8, 32>) head_fwd_fused_regs_q<float, 8, 32>;
template [[host_name("fcce_fwdreg_hf32_q8_g64")]] [[kernel]] decltype(head_fwd_fused_regs_q<float, 8, 64>) head_fwd_fused_regs_q<float, 8, 64>;
template [[host_name("fcce_fwdreg_hf32_q8_g128")]] [[kernel]] decltype(head_fwd_fused_regs_q<float, 8, 128>) head_fwd_fused_regs_q<float, 8, 128>;
template [[host_name("fcce_fwdreg_hf16_q2_g32")]] [[kernel]] decltype(head_fwd_fused_regs_q<half, 2, 32>) head_fwd_fused_regs_q<half, 2, 32>;
template [[host_name("fcce_fwdreg_hf16_q2_g64")]] [[kernel]] decltype(head_fwd_fused_regs_q<half, 2, 64>) head_fwd_fused_regs_q<half, 2, 64>;
template [[host_name("fcce_fwdreg_hf16_q2_g128")]] [[kernel]] decltype(head_fwd_fused_regs_q<half, 2, 128>) head_fwd_fused_regs_q<half, 2, 128>;
template [[host_name("fcce_fwdreg_hf16_q3_g32")]] [[kernel]] decltype(head_fwd_fused_regs_q<half, 3, 32>) head_fwd_fused_regs_q<half, 3, 32>;
template [[host_name("fcce_fwdreg_hf16_q3_g64")]] [[kernel]] decltype(head_fwd_fused_regs_q<half, 3, 64>) head_fwd_fused_regs_q<half, 3, 64>;
template [[host_name("fcce_fwdreg_hf16_q3_g128")]] [[kernel]] decltype(head_fwd_fused_regs_q<half, 3, 128>) head_fwd_fused_regs_q<half, 3, 128>;
template [[host_name("fcce_fwdreg_hf16_q4_g32")]] [[kernel]] decltype(head_fwd_fused_regs_q<half, 4, 32>) head_fwd_fused_regs_q<half, 4, 32>;
template [[host_name("fcce_fwdreg_hf16_q4_g64")]] [[kernel]] decltype(head_fwd_fused_regs_q<half, 4, 64>) head_fwd_fused_regs_q<half, 4, 64>;
template [[host_name("fcce_fwdreg_hf16_q4_g128")]] [[kernel]] decltype(head_fwd_fused_regs_q<half, 4, 128>) head_fwd_fused_regs_q<half, 4, 128>;
template [[host_name("fcce_fwdreg_hf16_q5_g32")]] [[kernel]] decltype(head_fwd_fused_regs_q<half, 5, 32>) head_fwd_fused_regs_q<half, 5, 32>;
template [[host_name("fcce_fwdreg_hf16_q5_g64")]] [[kernel]] decltype(head_fwd_fused_regs_q<half, 5, 64>) head_fwd_fused_regs_q<half, 5, 64>;
template [[host_name("fcce_fwdreg_hf16_q5_g128")]] [[kernel]] decltype(head_fwd_fused_regs_q<half, 5, 128>) head_fwd_fused_regs_q<half, 5, 128>;
template [[host_name("fcce_fwdreg_hf16_q6_g32")]] [[kernel]] decltype(head_fwd_fused_regs_q<half, 6, 32>) head_fwd_fused_regs_q<half, 6, 32>;
template [[host_name("fcce_fwdreg_hf16_q6_g64")]] [[kernel]] decltype(head_fwd_fused_regs_q<half, 6, 64>) head_fwd_fused_regs_q<half, 6, 64>;
template [[host_name("fcce_fwdreg_hf16_q6_g128")]] [[kernel]] decltype(head_fwd_fused_regs_q<half, 6, 128>) head_fwd_fused_regs_q<half, 6, 128>;
template [[host_name("fcce_fwdreg_hf16_q8_g32")]] [[kernel]] decltype(head_fwd_fused_regs_q<half, 8, 32>) head_fwd_fused_regs_q<half, 8, 32>;
template [[host_name("fcce_fwdreg_hf16_q8_g64")]] [[kernel]] decltype(head_fwd_fused_regs_q<half, 8, 64>) head_fwd_fused_regs_q<half, 8, 64>;
template [[host_name("fcce_fwdreg_hf16_q8_g128")]] [[kernel]] decltype(head_fwd_fused_regs_q<half, 8, 128>) head_fwd_fused_regs_q<half, 8, 128>;
template [[host_name("fcce_fwdreg_hbf16_q2_g32")]] [[kernel]] decltype(head_fwd_fused_regs_q<bfloat16_t, 2, 32>) head_fwd_fused_regs_q<bfloat16_t, 2, 32>;
template [[host_name("fcce_fwdreg_hbf16_q2_g64")]] [[kernel]] decltype(head_fwd_fused_regs_q<bfloat16_t, 2, 64>) head_fwd_fused_regs_q<bfloat16_t, 2, 64>;
template [[host_name("fcce_fwdreg_hbf16_q2_g128")]] [[kernel]] decltype(head_fwd_fused_regs_q<bfloat16_t, 2, 128>) head_fwd_fused_regs_q<bfloat16_t, 2, 128>;
template [[host_name("fcce_fwdreg_hbf16_q3_g32")]] [[kernel]] decltype(head_fwd_fused_regs_q<bfloat16_t, 3, 32>) head_fwd_fused_regs_q<bfloat16_t, 3, 32>;
template [[host_name("fcce_fwdreg_hbf16_q3_g64")]] [[kernel]] decltype(head_fwd_fused_regs_q<bfloat16_t, 3, 64>) head_fwd_fused_regs_q<bfloat16_t, 3, 64>;
template [[host_name("fcce_fwdreg_hbf16_q3_g128")]] [[kernel]] decltype(head_fwd_fused_regs_q<bfloat16_t, 3, 128>) head_fwd_fused_regs_q<bfloat16_t, 3, 128>;
template [[host_name("fcce_fwdreg_hbf16_q4_g32")]] [[kernel]] decltype(head_fwd_fused_regs_q<bfloat16_t, 4, 32>) head_fwd_fused_regs_q<bfloat16_t, 4, 32>;
template [[host_name("fcce_fwdreg_hbf16_q4_g64")]] [[kernel]] decltype(head_fwd_fused_regs_q<bfloat16_t, 4, 64>) head_fwd_fused_regs_q<bfloat16_t, 4, 64>;
template [[host_name("fcce_fwdreg_hbf16_q4_g128")]] [[kernel]] decltype(head_fwd_fused_regs_q<bfloat16_t, 4, 128>) head_fwd_fused_regs_q<bfloat16_t, 4, 128>;
template [[host_name("fcce_fwdreg_hbf16_q5_g32")]] [[kernel]] decltype(head_fwd_fused_regs_q<bfloat16_t, 5, 32>) head_fwd_fused_regs_q<bfloat16_t, 5, 32>;
template [[host_name("fcce_fwdreg_hbf16_q5_g64")]] [[kernel]] decltype(head_fwd_fused_regs_q<bfloat16_t, 5, 64>) head_fwd_fused_regs_q<bfloat16_t, 5, 64>;
template [[host_name("fcce_fwdreg_hbf16_q5_g128")]] [[kernel]] decltype(head_fwd_fused_regs_q<bfloat16_t, 5, 128>) head_fwd_fused_regs_q<bfloat16_t, 5, 128>;
template [[host_name("fcce_fwdreg_hbf16_q6_g32")]] [[kernel]] decltype(head_fwd_fused_regs_q<bfloat16_t, 6, 32>) head_fwd_fused_regs_q<bfloat16_t, 6, 32>;
template [[host_name("fcce_fwdreg_hbf16_q6_g64")]] [[kernel]] decltype(head_fwd_fused_regs_q<bfloat16_t, 6, 64>) head_fwd_fused_regs_q<bfloat16_t, 6, 64>;
template [[host_name("fcce_fwdreg_hbf16_q6_g128")]] [[kernel]] decltype(head_fwd_fused_regs_q<bfloat16_t, 6, 128>) head_fwd_fused_regs_q<bfloat16_t, 6, 128>;
template [[host_name("fcce_fwdreg_hbf16_q8_g32")]] [[kernel]] decltype(head_fwd_fused_regs_q<bfloat16_t, 8, 32>) head_fwd_fused_regs_q<bfloat16_t, 8, 32>;
template [[host_name("fcce_fwdreg_hbf16_q8_g64")]] [[kernel]] decltype(head_fwd_fused_regs_q<bfloat16_t, 8, 64>) head_fwd_fused_regs_q<bfloat16_t, 8, 64>;
template [[host_name("fcce_fwdreg_hbf16_q8_g128")]] [[kernel]] decltype(head_fwd_fused_regs_q<bfloat16_t, 8, 128>) head_fwd_fused_regs_q<bfloat16_t, 8, 128>;
// dh with the accumulator in registers: dense heads
template [[host_name("fcce_dhreg_hf32_wf32")]] [[kernel]] decltype(head_dh_regs<float, float>) head_dh_regs<float, float>;
template [[host_name("fcce_dhreg_hf32_wf16")]] [[kernel]] decltype(head_dh_regs<float, half>) head_dh_regs<float, half>;
template [[host_name("fcce_dhreg_hf32_wbf16")]] [[kernel]] decltype(head_dh_regs<float, bfloat16_t>) head_dh_regs<float, bfloat16_t>;
template [[host_name("fcce_dhreg_hf16_wf32")]] [[kernel]] decltype(head_dh_regs<half, float>) head_dh_regs<half, float>;
template [[host_name("fcce_dhreg_hf16_wf16")]] [[kernel]] decltype(head_dh_regs<half, half>) head_dh_regs<half, half>;
template [[host_name("fcce_dhreg_hf16_wbf16")]] [[kernel]] decltype(head_dh_regs<half, bfloat16_t>) head_dh_regs<half, bfloat16_t>;
template [[host_name("fcce_dhreg_hbf16_wf32")]] [[kernel]] decltype(head_dh_regs<bfloat16_t, float>) head_dh_regs<bfloat16_t, float>;
template [[host_name("fcce_dhreg_hbf16_wf16")]] [[kernel]] decltype(head_dh_regs<bfloat16_t, half>) head_dh_regs<bfloat16_t, half>;
template [[host_name("fcce_dhreg_hbf16_wbf16")]] [[kernel]] decltype(head_dh_regs<bfloat16_t, bfloat16_t>) head_dh_regs<bfloat16_t, bfloat16_t>;
// dh with the accumulator in registers: quantized heads
template [[host_name("fcce_dhreg_hf32_q2_g32")]] [[kernel]] decltype(head_dh_regs_q<float, 2, 32>) head_dh_regs_q<float, 2, 32>;
template [[host_name("fcce_dhreg_hf32_q2_g64")]] [[kernel]] decltype(head_dh_regs_q<float, 2, 64>) head_dh_regs_q<float, 2, 64>;
template [[host_name("fcce_dhreg_hf32_q2_g128")]] [[kernel]] decltype(head_dh_regs_q<float, 2, 128>) head_dh_regs_q<float, 2, 128>;
template [[host_name("fcce_dhreg_hf32_q3_g32")]] [[kernel]] decltype(head_dh_regs_q<float, 3, 32>) head_dh_regs_q<float, 3, 32>;
template [[host_name("fcce_dhreg_hf32_q3_g64")]] [[kernel]] decltype(head_dh_regs_q<float, 3, 64>) head_dh_regs_q<float, 3, 64>;
template [[host_name("fcce_dhreg_hf32_q3_g128")]] [[kernel]] decltype(head_dh_regs_q<float, 3, 128>) head_dh_regs_q<float, 3, 128>;
template [[host_name("fcce_dhreg_hf32_q4_g32")]] [[kernel]] decltype(head_dh_regs_q<float, 4, 32>) head_dh_regs_q<float, 4, 32>;
template [[host_name("fcce_dhreg_hf32_q4_g64")]] [[kernel]] decltype(head_dh_regs_q<float, 4, 64>) head_dh_regs_q<float, 4, 64>;
template [[host_name("fcce_dhreg_hf32_q4_g128")]] [[kernel]] decltype(head_dh_regs_q<float, 4, 128>) head_dh_regs_q<float, 4, 128>;
template [[host_name("fcce_dhreg_hf32_q5_g32")]] [[kernel]] decltype(head_dh_regs_q<float, 5, 32>) head_dh_regs_q<float, 5, 32>;
template [[host_name("fcce_dhreg_hf32_q5_g64")]] [[kernel]] decltype(head_dh_regs_q<float, 5, 64>) head_dh_regs_q<float, 5, 64>;
template [[host_name("fcce_dhreg_hf32_q5_g128")]] [[kernel]] decltype(head_dh_regs_q<float, 5, 128>) head_dh_regs_q<float, 5, 128>;
template [[host_name("fcce_dhreg_hf32_q6_g32")]] [[kernel]] decltype(head_dh_regs_q<float, 6, 32>) head_dh_regs_q<float, 6, 32>;
template [[host_name("fcce_dhreg_hf32_q6_g64")]] [[kernel]] decltype(head_dh_regs_q<float, 6, 64>) head_dh_regs_q<float, 6, 64>;
template [[host_name("fcce_dhreg_hf32_q6_g128")]] [[kernel]] decltype(head_dh_regs_q<float, 6, 128>) head_dh_regs_q<float, 6, 128>;
template [[host_name("fcce_dhreg_hf32_q8_g32")]] [[kernel]] decltype(head_dh_regs_q<float, 8, 32>) head_dh_regs_q<float, 8, 32>;
template [[host_name("fcce_dhreg_hf32_q8_g64")]] [[kernel]] decltype(head_dh_regs_q<float, 8, 64>) head_dh_regs_q<float, 8, 64>;
template [[host_name("fcce_dhreg_hf32_q8_g128")]] [[kernel]] decltype(head_dh_regs_q<float, 8, 128>) head_dh_regs_q<float, 8, 128>;
template [[host_name("fcce_dhreg_hf16_q2_g32")]] [[kernel]] decltype(head_dh_regs_q<half, 2, 32>) head_dh_regs_q<half, 2, 32>;
template [[host_name("fcce_dhreg_hf16_q2_g64")]] [[kernel]] decltype(head_dh_regs_q<half, 2, 64>) head_dh_regs_q<half, 2, 64>;
template [[host_name("fcce_dhreg_hf16_q2_g128")]] [[kernel]] decltype(head_dh_regs_q<half, 2, 128>) head_dh_regs_q<half, 2, 128>;
template [[host_name("fcce_dhreg_hf16_q3_g32")]] [[kernel]] decltype(head_dh_regs_q<half, 3, 32>) head_dh_regs_q<half, 3, 32>;
template [[host_name("fcce_dhreg_hf16_q3_g64")]] [[kernel]] decltype(head_dh_regs_q<half, 3, 64>) head_dh_regs_q<half, 3, 64>;
template [[host_name("fcce_dhreg_hf16_q3_g128")]] [[kernel]] decltype(head_dh_regs_q<half, 3, 128>) head_dh_regs_q<half, 3, 128>;
template [[host_name("fcce_dhreg_hf16_q4_g32")]] [[kernel]] decltype(head_dh_regs_q<half, 4, 32>) head_dh_regs_q<half, 4, 32>;
template [[host_name("fcce_dhreg_hf16_q4_g64")]] [[kernel]] decltype(head_dh_regs_q<half, 4, 64>) head_dh_regs_q<half, 4, 64>;
template [[host_name("fcce_dhreg_hf16_q4_g128")]] [[kernel]] decltype(head_dh_regs_q<half, 4, 128>) head_dh_regs_q<half, 4, 128>;
template [[host_name("fcce_dhreg_hf16_q5_g32")]] [[kernel]] decltype(head_dh_regs_q<half, 5, 32>) head_dh_regs_q<half, 5, 32>;
template [[host_name("fcce_dhreg_hf16_q5_g64")]] [[kernel]] decltype(head_dh_regs_q<half, 5, 64>) head_dh_regs_q<half, 5, 64>;
template [[host_name("fcce_dhreg_hf16_q5_g128")]] [[kernel]] decltype(head_dh_regs_q<half, 5, 128>) head_dh_regs_q<half, 5, 128>;
template [[host_name("fcce_dhreg_hf16_q6_g32")]] [[kernel]] decltype(head_dh_regs_q<half, 6, 32>) head_dh_regs_q<half, 6, 32>;
template [[host_name("fcce_dhreg_hf16_q6_g64")]] [[kernel]] decltype(head_dh_regs_q<half, 6, 64>) head_dh_regs_q<half, 6, 64>;
template [[host_name("fcce_dhreg_hf16_q6_g128")]] [[kernel]] decltype(head_dh_regs_q<half, 6, 128>) head_dh_regs_q<half, 6, 128>;
template [[host_name("fcce_dhreg_hf16_q8_g32")]] [[kernel]] decltype(head_dh_regs_q<half, 8, 32>) head_dh_regs_q<half, 8, 32>;
template [[host_name("fcce_dhreg_hf16_q8_g64")]] [[kernel]] decltype(head_dh_regs_q<half, 8, 64>) head_dh_regs_q<half, 8, 64>;
template [[host_name("fcce_dhreg_hf16_q8_g128")]] [[kernel]] decltype(head_dh_regs_q<half, 8, 128>) head_dh_regs_q<half, 8, 128>;
template [[host_name("fcce_dhreg_hbf16_q2_g32")]] [[kernel]] decltype(head_dh_regs_q<bfloat16_t, 2, 32>) head_dh_regs_q<bfloat16_t, 2, 32>;
template [[host_name("fcce_dhreg_hbf16_q2_g64")]] [[kernel]] decltype(head_dh_regs_q<bfloat16_t, 2, 64>) head_dh_regs_q<bfloat16_t, 2, 64>;
template [[host_name("fcce_dhreg_hbf16_q2_g128")]] [[kernel]] decltype(head_dh_regs_q<bfloat16_t, 2, 128>) head_dh_regs_q<bfloat16_t, 2, 128>;
template [[host_name("fcce_dhreg_hbf16_q3_g32")]] [[kernel]] decltype(head_dh_regs_q<bfloat16_t, 3, 32>) head_dh_regs_q<bfloat16_t, 3, 32>;
template [[host_name("fcce_dhreg_hbf16_q3_g64")]] [[kernel]] decltype(head_dh_regs_q<bfloat16_t, 3, 64>) head_dh_regs_q<bfloat16_t, 3, 64>;
template [[host_name("fcce_dhreg_hbf16_q3_g128")]] [[kernel]] decltype(head_dh_regs_q<bfloat16_t, 3, 128>) head_dh_regs_q<bfloat16_t, 3, 128>;
template [[host_name("fcce_dhreg_hbf16_q4_g32")]] [[kernel]] decltype(head_dh_regs_q<bfloat16_t, 4, 32>) head_dh_regs_q<bfloat16_t, 4, 32>;
template [[host_name("fcce_dhreg_hbf16_q4_g64")]] [[kernel]] decltype(head_dh_regs_q<bfloat16_t, 4, 64>) head_dh_regs_q<bfloat16_t, 4, 64>;
template [[host_name("fcce_dhreg_hbf16_q4_g128")]] [[kernel]] decltype(head_dh_regs_q<bfloat16_t, 4, 128>) head_dh_regs_q<bfloat16_t, 4, 128>;
template [[host_name("fcce_dhreg_hbf16_q5_g32")]] [[kernel]] decltype(head_dh_regs_q<bfloat16_t, 5, 32>) head_dh_regs_q<bfloat16_t, 5, 32>;
template [[host_name("fcce_dhreg_hbf16_q5_g64")]] [[kernel]] decltype(head_dh_regs_q<bfloat16_t, 5, 64>) head_dh_regs_q<bfloat16_t, 5, 64>;
template [[host_name("fcce_dhreg_hbf16_q5_g128")]] [[kernel]] decltype(head_dh_regs_q<bfloat16_t, 5, 128>) head_dh_regs_q<bfloat16_t, 5, 128>;
template [[host_name("fcce_dhreg_hbf16_q6_g32")]] [[kernel]] decltype(head_dh_regs_q<bfloat16_t, 6, 32>) head_dh_regs_q<bfloat16_t, 6, 32>;
template [[host_name("fcce_dhreg_hbf16_q6_g64")]] [[kernel]] decltype(head_dh_regs_q<bfloat16_t, 6, 64>) head_dh_regs_q<bfloat16_t, 6, 64>;
template [[host_name("fcce_dhreg_hbf16_q6_g128")]] [[kernel]] decltype(head_dh_regs_q<bfloat16_t, 6, 128>) head_dh_regs_q<bfloat16_t, 6, 128>;
template [[host_name("fcce_dhreg_hbf16_q8_g32")]] [[kernel]] decltype(head_dh_regs_q<bfloat16_t, 8, 32>) head_dh_regs_q<bfloat16_t, 8, 32>;
template [[host_name("fcce_dhreg_hbf16_q8_g64")]] [[kernel]] decltype(head_dh_regs_q<bfloat16_t, 8, 64>) head_dh_regs_q<bfloat16_t, 8, 64>;
template [[host_name("fcce_dhreg_hbf16_q8_g128")]] [[kernel]] decltype(head_dh_regs_q<bfloat16_t, 8, 128>) head_dh_regs_q<bfloat16_t, 8, 128>;
// dW (dense heads)
template [[host_name("fcce_dw_hf32_wf32")]] [[kernel]] decltype(head_dw<float, float>) head_dw<float, float>;
template [[host_name("fcce_dw_hf32_wf16")]] [[kernel]] decltype(head_dw<float, half>) head_dw<float, half>;
template [[host_name("fcce_dw_hf32_wbf16")]] [[kernel]] decltype(head_dw<float, bfloat16_t>) head_dw<float, bfloat16_t>;
template [[host_name("fcce_dw_hf16_wf32")]] [[kernel]] decltype(head_dw<half, float>) head_dw<half, float>;
template [[host_name("fcce_dw_hf16_wf16")]] [[kernel]] decltype(head_dw<half, half>) head_dw<half, half>;
template [[host_name("fcce_dw_hf16_wbf16")]] [[kernel]] decltype(head_dw<half, bfloat16_t>) head_dw<half, bfloat16_t>;
template [[host_name("fcce_dw_hbf16_wf32")]] [[kernel]] decltype(head_dw<bfloat16_t, float>) head_dw<bfloat16_t, float>;
template [[host_name("fcce_dw_hbf16_wf16")]] [[kernel]] decltype(head_dw<bfloat16_t, half>) head_dw<bfloat16_t, half>;
template [[host_name("fcce_dw_hbf16_wbf16")]] [[kernel]] decltype(head_dw<bfloat16_t, bfloat16_t>) head_dw<bfloat16_t, bfloat16_t>;
// dW with the accumulator in registers (dense heads)
template [[host_name("fcce_dwreg_hf32_wf32")]] [[kernel]] decltype(head_dw_regs<float, float>) head_dw_regs<float, float>;
template [[host_name("fcce_dwreg_hf32_wf16")]] [[kernel]] decltype(head_dw_regs<float, half>) head_dw_regs<float, half>;
template [[host_name("fcce_dwreg_hf32_wbf16")]] [[kernel]] decltype(head_dw_regs<float, bfloat16_t>) head_dw_regs<float, bfloat16_t>;
template [[host_name("fcce_dwreg_hf16_wf32")]] [[kernel]] decltype(head_dw_regs<half, float>) head_dw_regs<half, float>;
template [[host_name("fcce_dwreg_hf16_wf16")]] [[kernel]] decltype(head_dw_regs<half, half>) head_dw_regs<half, half>;
template [[host_name("fcce_dwreg_hf16_wbf16")]] [[kernel]] decltype(head_dw_regs<half, bfloat16_t>) head_dw_regs<half, bfloat16_t>;
template [[host_name("fcce_dwreg_hbf16_wf32")]] [[kernel]] decltype(head_dw_regs<bfloat16_t, float>) head_dw_regs<bfloat16_t, float>;
template [[host_name("fcce_dwreg_hbf16_wf16")]] [[kernel]] decltype(head_dw_regs<bfloat16_t, half>) head_dw_regs<bfloat16_t, half>;
template [[host_name("fcce_dwreg_hbf16_wbf16")]] [[kernel]] decltype(head_dw_regs<bfloat16_t, bfloat16_t>) head_dw_regs<bfloat16_t, bfloat16_t>;
// Element-wise passes
template [[host_name("fcce_reduce_dh_f32")]] [[kernel]] decltype(reduce_dh<float>) reduce_dh<float>;
template [[host_name("fcce_reduce_dh_f16")]] [[kernel]] decltype(reduce_dh<half>) reduce_dh<half>;
template [[host_name("fcce_reduce_dh_bf16")]] [[kernel]] decltype(reduce_dh<bfloat16_t>) reduce_dh<bfloat16_t>;
template [[host_name("fcce_cast_f16")]] [[kernel]] decltype(cast_dw<half>) cast_dw<half>;
template [[host_name("fcce_cast_bf16")]] [[kernel]] decltype(cast_dw<bfloat16_t>) cast_dw<bfloat16_t>;
template [[host_name("fcce_widen_f16")]] [[kernel]] decltype(widen<half>) widen<half>;
template [[host_name("fcce_widen_bf16")]] [[kernel]] decltype(widen<bfloat16_t>) widen<bfloat16_t>;
template [[host_name("fcce_fused_dh_of32_wf32")]] [[kernel]] decltype(fused_dh<float, float>) fused_dh<float, float>;
template [[host_name("fcce_fused_dh_of32_wf16")]] [[kernel]] decltype(fused_dh<float, half>) fused_dh<float, half>;
template [[host_name("fcce_fused_dh_of32_wbf16")]] [[kernel]] decltype(fused_dh<float, bfloat16_t>) fused_dh<float, bfloat16_t>;
template [[host_name("fcce_fused_dh_of16_wf32")]] [[kernel]] decltype(fused_dh<half, float>) fused_dh<half, float>;
template [[host_name("fcce_fused_dh_of16_wf16")]] [[kernel]] decltype(fused_dh<half, half>) fused_dh<half, half>;
template [[host_name("fcce_fused_dh_of16_wbf16")]] [[kernel]] decltype(fused_dh<half, bfloat16_t>) fused_dh<half, bfloat16_t>;
template [[host_name("fcce_fused_dh_obf16_wf32")]] [[kernel]] decltype(fused_dh<bfloat16_t, float>) fused_dh<bfloat16_t, float>;
template [[host_name("fcce_fused_dh_obf16_wf16")]] [[kernel]] decltype(fused_dh<bfloat16_t, half>) fused_dh<bfloat16_t, half>;
template [[host_name("fcce_fused_dh_obf16_wbf16")]] [[kernel]] decltype(fused_dh<bfloat16_t, bfloat16_t>) fused_dh<bfloat16_t, bfloat16_t>;
template [[host_name("fcce_fused_dh_of32_q")]] [[kernel]] decltype(fused_dh_q<float>) fused_dh_q<float>;
template [[host_name("fcce_fused_dh_of16_q")]] [[kernel]] decltype(fused_dh_q<half>) fused_dh_q<half>;
template [[host_name("fcce_fused_dh_obf16_q")]] [[kernel]] decltype(fused_dh_q<bfloat16_t>) fused_dh_q<bfloat16_t>;
// Entropy variants (compiled only for calls that ask for the entropy statistics)
// fwd_ent: dense heads
template [[host_name("fcce_fwd_ent_hf32_wf32")]] [[kernel]] decltype(head_fwd_ent<float, float>) head_fwd_ent<float, float>;
template [[host_name("fcce_fwd_ent_hf32_wf16")]] [[kernel]] decltype(head_fwd_ent<float, half>) head_fwd_ent<float, half>;
template [[host_name("fcce_fwd_ent_hf32_wbf16")]] [[kernel]] decltype(head_fwd_ent<float, bfloat16_t>) head_fwd_ent<float, bfloat16_t>;
template [[host_name("fcce_fwd_ent_hf16_wf32")]] [[kernel]] decltype(head_fwd_ent<half, float>) head_fwd_ent<half, float>;
template [[host_name("fcce_fwd_ent_hf16_wf16")]] [[kernel]] decltype(head_fwd_ent<half, half>) head_fwd_ent<half, half>;
template [[host_name("fcce_fwd_ent_hf16_wbf16")]] [[kernel]] decltype(head_fwd_ent<half, bfloat16_t>) head_fwd_ent<half, bfloat16_t>;
template [[host_name("fcce_fwd_ent_hbf16_wf32")]] [[kernel]] decltype(head_fwd_ent<bfloat16_t, float>) head_fwd_ent<bfloat16_t, float>;
template [[host_name("fcce_fwd_ent_hbf16_wf16")]] [[kernel]] decltype(head_fwd_ent<bfloat16_t, half>) head_fwd_ent<bfloat16_t, half>;
template [[host_name("fcce_fwd_ent_hbf16_wbf16")]] [[kernel]] decltype(head_fwd_ent<bfloat16_t, bfloat16_t>) head_fwd_ent<bfloat16_t, bfloat16_t>;
// fwd_ent: quantized heads (h, scales and biases in the tile type)
template [[host_name("fcce_fwd_ent_hf32_q2_g32")]] [[kernel]] decltype(head_fwd_ent_q<float, 2, 32>) head_fwd_ent_q<float, 2, 32>;
template [[host_name("fcce_fwd_ent_hf32_q2_g64")]] [[kernel]] decltype(head_fwd_ent_q<float, 2, 64>) head_fwd_ent_q<float, 2, 64>;
template [[host_name("fcce_fwd_ent_hf32_q2_g128")]] [[kernel]] decltype(head_fwd_ent_q<float, 2, 128>) head_fwd_ent_q<float, 2, 128>;
template [[host_name("fcce_fwd_ent_hf32_q3_g32")]] [[kernel]] decltype(head_fwd_ent_q<float, 3, 32>) head_fwd_ent_q<float, 3, 32>;
template [[host_name("fcce_fwd_ent_hf32_q3_g64")]] [[kernel]] decltype(head_fwd_ent_q<float, 3, 64>) head_fwd_ent_q<float, 3, 64>;
template [[host_name("fcce_fwd_ent_hf32_q3_g128")]] [[kernel]] decltype(head_fwd_ent_q<float, 3, 128>) head_fwd_ent_q<float, 3, 128>;
template [[host_name("fcce_fwd_ent_hf32_q4_g32")]] [[kernel]] decltype(head_fwd_ent_q<float, 4, 32>) head_fwd_ent_q<float, 4, 32>;
template [[host_name("fcce_fwd_ent_hf32_q4_g64")]] [[kernel]] decltype(head_fwd_ent_q<float, 4, 64>) head_fwd_ent_q<float, 4, 64>;
template [[host_name("fcce_fwd_ent_hf32_q4_g128")]] [[kernel]] decltype(head_fwd_ent_q<float, 4, 128>) head_fwd_ent_q<float, 4, 128>;
template [[host_name("fcce_fwd_ent_hf32_q5_g32")]] [[kernel]] decltype(head_fwd_ent_q<float, 5, 32>) head_fwd_ent_q<float, 5, 32>;
template [[host_name("fcce_fwd_ent_hf32_q5_g64")]] [[kernel]] decltype(head_fwd_ent_q<float, 5, 64>) head_fwd_ent_q<float, 5, 64>;
template [[host_name("fcce_fwd_ent_hf32_q5_g128")]] [[kernel]] decltype(head_fwd_ent_q<float, 5, 128>) head_fwd_ent_q<float, 5, 128>;
template [[host_name("fcce_fwd_ent_hf32_q6_g32")]] [[kernel]] decltype(head_fwd_ent_q<float, 6, 32>) head_fwd_ent_q<float, 6, 32>;
template [[host_name("fcce_fwd_ent_hf32_q6_g64")]] [[kernel]] decltype(head_fwd_ent_q<float, 6, 64>) head_fwd_ent_q<float, 6, 64>;
template [[host_name("fcce_fwd_ent_hf32_q6_g128")]] [[kernel]] decltype(head_fwd_ent_q<float, 6, 128>) head_fwd_ent_q<float, 6, 128>;
template [[host_name("fcce_fwd_ent_hf32_q8_g32")]] [[kernel]] decltype(head_fwd_ent_q<float, 8, 32>) head_fwd_ent_q<float, 8, 32>;
template [[host_name("fcce_fwd_ent_hf32_q8_g64")]] [[kernel]] decltype(head_fwd_ent_q<float, 8, 64>) head_fwd_ent_q<float, 8, 64>;
template [[host_name("fcce_fwd_ent_hf32_q8_g128")]] [[kernel]] decltype(head_fwd_ent_q<float, 8, 128>) head_fwd_ent_q<float, 8, 128>;
template [[host_name("fcce_fwd_ent_hf16_q2_g32")]] [[kernel]] decltype(head_fwd_ent_q<half, 2, 32>) head_fwd_ent_q<half, 2, 32>;
template [[host_name("fcce_fwd_ent_hf16_q2_g64")]] [[kernel]] decltype(head_fwd_ent_q<half, 2, 64>) head_fwd_ent_q<half, 2, 64>;
template [[host_name("fcce_fwd_ent_hf16_q2_g128")]] [[kernel]] decltype(head_fwd_ent_q<half, 2, 128>) head_fwd_ent_q<half, 2, 128>;
template [[host_name("fcce_fwd_ent_hf16_q3_g32")]] [[kernel]] decltype(head_fwd_ent_q<half, 3, 32>) head_fwd_ent_q<half, 3, 32>;
template [[host_name("fcce_fwd_ent_hf16_q3_g64")]] [[kernel]] decltype(head_fwd_ent_q<half, 3, 64>) head_fwd_ent_q<half, 3, 64>;
template [[host_name("fcce_fwd_ent_hf16_q3_g128")]] [[kernel]] decltype(head_fwd_ent_q<half, 3, 128>) head_fwd_ent_q<half, 3, 128>;
template [[host_name("fcce_fwd_ent_hf16_q4_g32")]] [[kernel]] decltype(head_fwd_ent_q<half, 4, 32>) head_fwd_ent_q<half, 4, 32>;
template [[host_name("fcce_fwd_ent_hf16_q4_g64")]] [[kernel]] decltype(head_fwd_ent_q<half, 4, 64>) head_fwd_ent_q<half, 4, 64>;
template [[host_name("fcce_fwd_ent_hf16_q4_g128")]] [[kernel]] decltype(head_fwd_ent_q<half, 4, 128>) head_fwd_ent_q<half, 4, 128>;
template [[host_name("fcce_fwd_ent_hf16_q5_g32")]] [[kernel]] decltype(head_fwd_ent_q<half, 5, 32>) head_fwd_ent_q<half, 5, 32>;
template [[host_name("fcce_fwd_ent_hf16_q5_g64")]] [[kernel]] decltype(head_fwd_ent_q<half, 5, 64>) head_fwd_ent_q<half, 5, 64>;
template [[host_name("fcce_fwd_ent_hf16_q5_g128")]] [[kernel]] decltype(head_fwd_ent_q<half, 5, 128>) head_fwd_ent_q<half, 5, 128>;
template [[host_name("fcce_fwd_ent_hf16_q6_g32")]] [[kernel]] decltype(head_fwd_ent_q<half, 6, 32>) head_fwd_ent_q<half, 6, 32>;
template [[host_name("fcce_fwd_ent_hf16_q6_g64")]] [[kernel]] decltype(head_fwd_ent_q<half, 6, 64>) head_fwd_ent_q<half, 6, 64>;
template [[host_name("fcce_fwd_ent_hf16_q6_g128")]] [[kernel]] decltype(head_fwd_ent_q<half, 6, 128>) head_fwd_ent_q<half, 6, 128>;
template [[host_name("fcce_fwd_ent_hf16_q8_g32")]] [[kernel]] decltype(head_fwd_ent_q<half, 8, 32>) head_fwd_ent_q<half, 8, 32>;
template [[host_name("fcce_fwd_ent_hf16_q8_g64")]] [[kernel]] decltype(head_fwd_ent_q<half, 8, 64>) head_fwd_ent_q<half, 8, 64>;
template [[host_name("fcce_fwd_ent_hf16_q8_g128")]] [[kernel]] decltype(head_fwd_ent_q<half, 8, 128>) head_fwd_ent_q<half, 8, 128>;
template [[host_name("fcce_fwd_ent_hbf16_q2_g32")]] [[kernel]] decltype(head_fwd_ent_q<bfloat16_t, 2, 32>) head_fwd_ent_q<bfloat16_t, 2, 32>;
template [[host_name("fcce_fwd_ent_hbf16_q2_g64")]] [[kernel]] decltype(head_fwd_ent_q<bfloat16_t, 2, 64>) head_fwd_ent_q<bfloat16_t, 2, 64>;
template [[host_name("fcce_fwd_ent_hbf16_q2_g128")]] [[kernel]] decltype(head_fwd_ent_q<bfloat16_t, 2, 128>) head_fwd_ent_q<bfloat16_t, 2, 128>;
template [[host_name("fcce_fwd_ent_hbf16_q3_g32")]] [[kernel]] decltype(head_fwd_ent_q<bfloat16_t, 3, 32>) head_fwd_ent_q<bfloat16_t, 3, 32>;
template [[host_name("fcce_fwd_ent_hbf16_q3_g64")]] [[kernel]] decltype(head_fwd_ent_q<bfloat16_t, 3, 64>) head_fwd_ent_q<bfloat16_t, 3, 64>;
template [[host_name("fcce_fwd_ent_hbf16_q3_g128")]] [[kernel]] decltype(head_fwd_ent_q<bfloat16_t, 3, 128>) head_fwd_ent_q<bfloat16_t, 3, 128>;
template [[host_name("fcce_fwd_ent_hbf16_q4_g32")]] [[kernel]] decltype(head_fwd_ent_q<bfloat16_t, 4, 32>) head_fwd_ent_q<bfloat16_t, 4, 32>;
template [[host_name("fcce_fwd_ent_hbf16_q4_g64")]] [[kernel]] decltype(head_fwd_ent_q<bfloat16_t, 4, 64>) head_fwd_ent_q<bfloat16_t, 4, 64>;
template [[host_name("fcce_fwd_ent_hbf16_q4_g128")]] [[kernel]] decltype(head_fwd_ent_q<bfloat16_t, 4, 128>) head_fwd_ent_q<bfloat16_t, 4, 128>;
template [[host_name("fcce_fwd_ent_hbf16_q5_g32")]] [[kernel]] decltype(head_fwd_ent_q<bfloat16_t, 5, 32>) head_fwd_ent_q<bfloat16_t, 5, 32>;
template [[host_name("fcce_fwd_ent_hbf16_q5_g64")]] [[kernel]] decltype(head_fwd_ent_q<bfloat16_t, 5, 64>) head_fwd_ent_q<bfloat16_t, 5, 64>;
template [[host_name("fcce_fwd_ent_hbf16_q5_g128")]] [[kernel]] decltype(head_fwd_ent_q<bfloat16_t, 5, 128>) head_fwd_ent_q<bfloat16_t, 5, 128>;
template [[host_name("fcce_fwd_ent_hbf16_q6_g32")]] [[kernel]] decltype(head_fwd_ent_q<bfloat16_t, 6, 32>) head_fwd_ent_q<bfloat16_t, 6, 32>;
template [[host_name("fcce_fwd_ent_hbf16_q6_g64")]] [[kernel]] decltype(head_fwd_ent_q<bfloat16_t, 6, 64>) head_fwd_ent_q<bfloat16_t, 6, 64>;
template [[host_name("fcce_fwd_ent_hbf16_q6_g128")]] [[kernel]] decltype(head_fwd_ent_q<bfloat16_t, 6, 128>) head_fwd_ent_q<bfloat16_t, 6, 128>;
template [[host_name("fcce_fwd_ent_hbf16_q8_g32")]] [[kernel]] decltype(head_fwd_ent_q<bfloat16_t, 8, 32>) head_fwd_ent_q<bfloat16_t, 8, 32>;
template [[host_name("fcce_fwd_ent_hbf16_q8_g64")]] [[kernel]] decltype(head_fwd_ent_q<bfloat16_t, 8, 64>) head_fwd_ent_q<bfloat16_t, 8, 64>;
template [[host_name("fcce_fwd_ent_hbf16_q8_g128")]] [[kernel]] decltype(head_fwd_ent_q<bfloat16_t, 8, 128>) head_fwd_ent_q<bfloat16_t, 8, 128>;
// dh with the entropy's cotangent (accumulator in registers): dense heads
template [[host_name("fcce_dhreg_ent_hf32_wf32")]] [[kernel]] decltype(head_dh_regs_ent<float, float>) head_dh_regs_ent<float, float>;
template [[host_name("fcce_dhreg_ent_hf32_wf16")]] [[kernel]] decltype(head_dh_regs_ent<float, half>) head_dh_regs_ent<float, half>;
template [[host_name("fcce_dhreg_ent_hf32_wbf16")]] [[kernel]] decltype(head_dh_regs_ent<float, bfloat16_t>) head_dh_regs_ent<float, bfloat16_t>;
template [[host_name("fcce_dhreg_ent_hf16_wf32")]] [[kernel]] decltype(head_dh_regs_ent<half, float>) head_dh_regs_ent<half, float>;
template [[host_name("fcce_dhreg_ent_hf16_wf16")]] [[kernel]] decltype(head_dh_regs_ent<half, half>) head_dh_regs_ent<half, half>;
template [[host_name("fcce_dhreg_ent_hf16_wbf16")]] [[kernel]] decltype(head_dh_regs_ent<half, bfloat16_t>) head_dh_regs_ent<half, bfloat16_t>;
template [[host_name("fcce_dhreg_ent_hbf16_wf32")]] [[kernel]] decltype(head_dh_regs_ent<bfloat16_t, float>) head_dh_regs_ent<bfloat16_t, float>;
template [[host_name("fcce_dhreg_ent_hbf16_wf16")]] [[kernel]] decltype(head_dh_regs_ent<bfloat16_t, half>) head_dh_regs_ent<bfloat16_t, half>;
template [[host_name("fcce_dhreg_ent_hbf16_wbf16")]] [[kernel]] decltype(head_dh_regs_ent<bfloat16_t, bfloat16_t>) head_dh_regs_ent<bfloat16_t, bfloat16_t>;
// dh with the entropy's cotangent (accumulator in registers): quantized heads
template [[host_name("fcce_dhreg_ent_hf32_q2_g32")]] [[kernel]] decltype(head_dh_regs_ent_q<float, 2, 32>) head_dh_regs_ent_q<float, 2, 32>;
template [[host_name("fcce_dhreg_ent_hf32_q2_g64")]] [[kernel]] decltype(head_dh_regs_ent_q<float, 2, 64>) head_dh_regs_ent_q<float, 2, 64>;
template [[host_name("fcce_dhreg_ent_hf32_q2_g128")]] [[kernel]] decltype(head_dh_regs_ent_q<float, 2, 128>) head_dh_regs_ent_q<float, 2, 128>;
template [[host_name("fcce_dhreg_ent_hf32_q3_g32")]] [[kernel]] decltype(head_dh_regs_ent_q<float, 3, 32>) head_dh_regs_ent_q<float, 3, 32>;
template [[host_name("fcce_dhreg_ent_hf32_q3_g64")]] [[kernel]] decltype(head_dh_regs_ent_q<float, 3, 64>) head_dh_regs_ent_q<float, 3, 64>;
template [[host_name("fcce_dhreg_ent_hf32_q3_g128")]] [[kernel]] decltype(head_dh_regs_ent_q<float, 3, 128>) head_dh_regs_ent_q<float, 3, 128>;
template [[host_name("fcce_dhreg_ent_hf32_q4_g32")]] [[kernel]] decltype(head_dh_regs_ent_q<float, 4, 32>) head_dh_regs_ent_q<float, 4, 32>;
template [[host_name("fcce_dhreg_ent_hf32_q4_g64")]] [[kernel]] decltype(head_dh_regs_ent_q<float, 4, 64>) head_dh_regs_ent_q<float, 4, 64>;
template [[host_name("fcce_dhreg_ent_hf32_q4_g128")]] [[kernel]] decltype(head_dh_regs_ent_q<float, 4, 128>) head_dh_regs_ent_q<float, 4, 128>;
template [[host_name("fcce_dhreg_ent_hf32_q5_g32")]] [[kernel]] decltype(head_dh_regs_ent_q<float, 5, 32>) head_dh_regs_ent_q<float, 5, 32>;
template [[host_name("fcce_dhreg_ent_hf32_q5_g64")]] [[kernel]] decltype(head_dh_regs_ent_q<float, 5, 64>) head_dh_regs_ent_q<float, 5, 64>;
template [[host_name("fcce_dhreg_ent_hf32_q5_g128")]] [[kernel]] decltype(head_dh_regs_ent_q<float, 5, 128>) head_dh_regs_ent_q<float, 5, 128>;
template [[host_name("fcce_dhreg_ent_hf32_q6_g32")]] [[kernel]] decltype(head_dh_regs_ent_q<float, 6, 32>) head_dh_regs_ent_q<float, 6, 32>;
template [[host_name("fcce_dhreg_ent_hf32_q6_g64")]] [[kernel]] decltype(head_dh_regs_ent_q<float, 6, 64>) head_dh_regs_ent_q<float, 6, 64>;
template [[host_name("fcce_dhreg_ent_hf32_q6_g128")]] [[kernel]] decltype(head_dh_regs_ent_q<float, 6, 128>) head_dh_regs_ent_q<float, 6, 128>;
template [[host_name("fcce_dhreg_ent_hf32_q8_g32")]] [[kernel]] decltype(head_dh_regs_ent_q<float, 8, 32>) head_dh_regs_ent_q<float, 8, 32>;
template [[host_name("fcce_dhreg_ent_hf32_q8_g64")]] [[kernel]] decltype(head_dh_regs_ent_q<float, 8, 64>) head_dh_regs_ent_q<float, 8, 64>;
template [[host_name("fcce_dhreg_ent_hf32_q8_g128")]] [[kernel]] decltype(head_dh_regs_ent_q<float, 8, 128>) head_dh_regs_ent_q<float, 8, 128>;
template [[host_name("fcce_dhreg_ent_hf16_q2_g32")]] [[kernel]] decltype(head_dh_regs_ent_q<half, 2, 32>) head_dh_regs_ent_q<half, 2, 32>;
template [[host_name("fcce_dhreg_ent_hf16_q2_g64")]] [[kernel]] decltype(head_dh_regs_ent_q<half, 2, 64>) head_dh_regs_ent_q<half, 2, 64>;
template [[host_name("fcce_dhreg_ent_hf16_q2_g128")]] [[kernel]] decltype(head_dh_regs_ent_q<half, 2, 128>) head_dh_regs_ent_q<half, 2, 128>;
template [[host_name("fcce_dhreg_ent_hf16_q3_g32")]] [[kernel]] decltype(head_dh_regs_ent_q<half, 3, 32>) head_dh_regs_ent_q<half, 3, 32>;
template [[host_name("fcce_dhreg_ent_hf16_q3_g64")]] [[kernel]] decltype(head_dh_regs_ent_q<half, 3, 64>) head_dh_regs_ent_q<half, 3, 64>;
template [[host_name("fcce_dhreg_ent_hf16_q3_g128")]] [[kernel]] decltype(head_dh_regs_ent_q<half, 3, 128>) head_dh_regs_ent_q<half, 3, 128>;
template [[host_name("fcce_dhreg_ent_hf16_q4_g32")]] [[kernel]] decltype(head_dh_regs_ent_q<half, 4, 32>) head_dh_regs_ent_q<half, 4, 32>;
template [[host_name("fcce_dhreg_ent_hf16_q4_g64")]] [[kernel]] decltype(head_dh_regs_ent_q<half, 4, 64>) head_dh_regs_ent_q<half, 4, 64>;
template [[host_name("fcce_dhreg_ent_hf16_q4_g128")]] [[kernel]] decltype(head_dh_regs_ent_q<half, 4, 128>) head_dh_regs_ent_q<half, 4, 128>;
template [[host_name("fcce_dhreg_ent_hf16_q5_g32")]] [[kernel]] decltype(head_dh_regs_ent_q<half, 5, 32>) head_dh_regs_ent_q<half, 5, 32>;
template [[host_name("fcce_dhreg_ent_hf16_q5_g64")]] [[kernel]] decltype(head_dh_regs_ent_q<half, 5, 64>) head_dh_regs_ent_q<half, 5, 64>;
template [[host_name("fcce_dhreg_ent_hf16_q5_g128")]] [[kernel]] decltype(head_dh_regs_ent_q<half, 5, 128>) head_dh_regs_ent_q<half, 5, 128>;
template [[host_name("fcce_dhreg_ent_hf16_q6_g32")]] [[kernel]] decltype(head_dh_regs_ent_q<half, 6, 32>) head_dh_regs_ent_q<half, 6, 32>;
template [[host_name("fcce_dhreg_ent_hf16_q6_g64")]] [[kernel]] decltype(head_dh_regs_ent_q<half, 6, 64>) head_dh_regs_ent_q<half, 6, 64>;
template [[host_name("fcce_dhreg_ent_hf16_q6_g128")]] [[kernel]] decltype(head_dh_regs_ent_q<half, 6, 128>) head_dh_regs_ent_q<half, 6, 128>;
template [[host_name("fcce_dhreg_ent_hf16_q8_g32")]] [[kernel]] decltype(head_dh_regs_ent_q<half, 8, 32>) head_dh_regs_ent_q<half, 8, 32>;
template [[host_name("fcce_dhreg_ent_hf16_q8_g64")]] [[kernel]] decltype(head_dh_regs_ent_q<half, 8, 64>) head_dh_regs_ent_q<half, 8, 64>;
template [[host_name("fcce_dhreg_ent_hf16_q8_g128")]] [[kernel]] decltype(head_dh_regs_ent_q<half, 8, 128>) head_dh_regs_ent_q<half, 8, 128>;
template [[host_name("fcce_dhreg_ent_hbf16_q2_g32")]] [[kernel]] decltype(head_dh_regs_ent_q<bfloat16_t, 2, 32>) head_dh_regs_ent_q<bfloat16_t, 2, 32>;
template [[host_name("fcce_dhreg_ent_hbf16_q2_g64")]] [[kernel]] decltype(head_dh_regs_ent_q<bfloat16_t, 2, 64>) head_dh_regs_ent_q<bfloat16_t, 2, 64>;
template [[host_name("fcce_dhreg_ent_hbf16_q2_g128")]] [[kernel]] decltype(head_dh_regs_ent_q<bfloat16_t, 2, 128>) head_dh_regs_ent_q<bfloat16_t, 2, 128>;
template [[host_name("fcce_dhreg_ent_hbf16_q3_g32")]] [[kernel]] decltype(head_dh_regs_ent_q<bfloat16_t, 3, 32>) head_dh_regs_ent_q<bfloat16_t, 3, 32>;
template [[host_name("fcce_dhreg_ent_hbf16_q3_g64")]] [[kernel]] decltype(head_dh_regs_ent_q<bfloat16_t, 3, 64>) head_dh_regs_ent_q<bfloat16_t, 3, 64>;
template [[host_name("fcce_dhreg_ent_hbf16_q3_g128")]] [[kernel]] decltype(head_dh_regs_ent_q<bfloat16_t, 3, 128>) head_dh_regs_ent_q<bfloat16_t, 3, 128>;
template [[host_name("fcce_dhreg_ent_hbf16_q4_g32")]] [[kernel]] decltype(head_dh_regs_ent_q<bfloat16_t, 4, 32>) head_dh_regs_ent_q<bfloat16_t, 4, 32>;
template [[host_name("fcce_dhreg_ent_hbf16_q4_g64")]] [[kernel]] decltype(head_dh_regs_ent_q<bfloat16_t, 4, 64>) head_dh_regs_ent_q<bfloat16_t, 4, 64>;
template [[host_name("fcce_dhreg_ent_hbf16_q4_g128")]] [[kernel]] decltype(head_dh_regs_ent_q<bfloat16_t, 4, 128>) head_dh_regs_ent_q<bfloat16_t, 4, 128>;
template [[host_name("fcce_dhreg_ent_hbf16_q5_g32")]] [[kernel]] decltype(head_dh_regs_ent_q<bfloat16_t, 5, 32>) head_dh_regs_ent_q<bfloat16_t, 5, 32>;
template [[host_name("fcce_dhreg_ent_hbf16_q5_g64")]] [[kernel]] decltype(head_dh_regs_ent_q<bfloat16_t, 5, 64>) head_dh_regs_ent_q<bfloat16_t, 5, 64>;
template [[host_name("fcce_dhreg_ent_hbf16_q5_g128")]] [[kernel]] decltype(head_dh_regs_ent_q<bfloat16_t, 5, 128>) head_dh_regs_ent_q<bfloat16_t, 5, 128>;
template [[host_name("fcce_dhreg_ent_hbf16_q6_g32")]] [[kernel]] decltype(head_dh_regs_ent_q<bfloat16_t, 6, 32>) head_dh_regs_ent_q<bfloat16_t, 6, 32>;
template [[host_name("fcce_dhreg_ent_hbf16_q6_g64")]] [[kernel]] decltype(head_dh_regs_ent_q<bfloat16_t, 6, 64>) head_dh_regs_ent_q<bfloat16_t, 6, 64>;
template [[host_name("fcce_dhreg_ent_hbf16_q6_g128")]] [[kernel]] decltype(head_dh_regs_ent_q<bfloat16_t, 6, 128>) head_dh_regs_ent_q<bfloat16_t, 6, 128>;
template [[host_name("fcce_dhreg_ent_hbf16_q8_g32")]] [[kernel]] decltype(head_dh_regs_ent_q<bfloat16_t, 8, 32>) head_dh_regs_ent_q<bfloat16_t, 8, 32>;
template [[host_name("fcce_dhreg_ent_hbf16_q8_g64")]] [[kernel]] decltype(head_dh_regs_ent_q<bfloat16_t, 8, 64>) head_dh_regs_ent_q<bfloat16_t, 8, 64>;
template [[host_name("fcce_dhreg_ent_hbf16_q8_g128")]] [[kernel]] decltype(head_dh_regs_ent_q<bfloat16_t, 8, 128>) head_dh_regs_ent_q<bfloat16_t, 8, 128>;
// dW with the entropy's cotangent (dense heads)
template [[host_name("fcce_dw_ent_hf32_wf32")]] [[kernel]] decltype(head_dw_ent<float, float>) head_dw_ent<float, float>;
template [[host_name("fcce_dw_ent_hf32_wf16")]] [[kernel]] decltype(head_dw_ent<float, half>) head_dw_ent<float, half>;
template [[host_name("fcce_dw_ent_hf32_wbf16")]] [[kernel]] decltype(head_dw_ent<float, bfloat16_t>) head_dw_ent<float, bfloat16_t>;
template [[host_name("fcce_dw_ent_hf16_wf32")]] [[kernel]] decltype(head_dw_ent<half, float>) head_dw_ent<half, float>;
template [[host_name("fcce_dw_ent_hf16_wf16")]] [[kernel]] decltype(head_dw_ent<half, half>) head_dw_ent<half, half>;
template [[host_name("fcce_dw_ent_hf16_wbf16")]] [[kernel]] decltype(head_dw_ent<half, bfloat16_t>) head_dw_ent<half, bfloat16_t>;
template [[host_name("fcce_dw_ent_hbf16_wf32")]] [[kernel]] decltype(head_dw_ent<bfloat16_t, float>) head_dw_ent<bfloat16_t, float>;
template [[host_name("fcce_dw_ent_hbf16_wf16")]] [[kernel]] decltype(head_dw_ent<bfloat16_t, half>) head_dw_ent<bfloat16_t, half>;
template [[host_name("fcce_dw_ent_hbf16_wbf16")]] [[kernel]] decltype(head_dw_ent<bfloat16_t, bfloat16_t>) head_dw_ent<bfloat16_t, bfloat16_t>;
template [[host_name("fcce_combine_ent")]] [[kernel]] decltype(combine_ent<float>) combine_ent<float>;
