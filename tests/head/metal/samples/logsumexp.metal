// logsumexp of each row of x [rows, n]: an online (max, sum) per thread,
// combined across the SIMD group with simd_shuffle_xor, then across SIMD
// groups in threadgroup memory. A finite sentinel stands for -inf.
#include <metal_stdlib>
using namespace metal;

METAL_FUNC void combine(thread float& m, thread float& s, float om, float os) {
  const float nm = max(m, om);
  s = s * metal::fast::exp(m - nm) + os * metal::precise::exp(om - nm);
  m = nm;
}

template <typename T>
[[kernel]] void row_logsumexp(
    const device T* x [[buffer(0)]],
    device float* lse [[buffer(1)]],
    constant int& n [[buffer(2)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint tsize [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float maxes[32];
  threadgroup float sums[32];
  float m = -numeric_limits<float>::max();
  float s = 0.0f;
  for (int i = tid; i < n; i += tsize) {
    combine(m, s, static_cast<float>(x[row * n + i]), 1.0f);
  }
  for (ushort mask = 16; mask > 0; mask /= 2) {
    const float om = simd_shuffle_xor(m, mask);
    const float os = simd_shuffle_xor(s, mask);
    combine(m, s, om, os);
  }
  if (lane == 0) {
    maxes[sg] = m;
    sums[sg] = s;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    for (uint g = 1; g < nsg; g++) {
      combine(m, s, maxes[g], sums[g]);
    }
    lse[row] = m + log(s);
  }
}

template [[host_name("row_logsumexp_float")]] [[kernel]] decltype(row_logsumexp<float>) row_logsumexp<float>;
template [[host_name("row_logsumexp_half")]] [[kernel]] decltype(row_logsumexp<half>) row_logsumexp<half>;
template [[host_name("row_logsumexp_bfloat")]] [[kernel]] decltype(row_logsumexp<bfloat>) row_logsumexp<bfloat>;
