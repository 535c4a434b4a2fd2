// Sum of each row of x [rows, n] into out [rows]: one threadgroup per row,
// a strided partial sum per thread, SIMD-group sums, then a tree over the
// SIMD groups' partials in threadgroup memory.
#include <metal_stdlib>
using namespace metal;

template <typename T>
[[kernel]] void row_sum(
    const device T* x [[buffer(0)]],
    device float* out [[buffer(1)]],
    constant int& n [[buffer(2)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint tsize [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float partial[32];
  float acc = 0.0f;
  for (int i = tid; i < n; i += tsize) {
    acc += static_cast<float>(x[row * n + i]);
  }
  acc = simd_sum(acc);
  if (lane == 0) {
    partial[sg] = acc;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Tree over the SIMD groups' partials, in threadgroup memory.
  for (uint stride = 16; stride > 0; stride /= 2) {
    if (tid < stride && tid + stride < nsg) {
      partial[tid] += partial[tid + stride];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (tid == 0) {
    out[row] = partial[0];
  }
}

template [[host_name("row_sum_float")]] [[kernel]] decltype(row_sum<float>) row_sum<float>;
template [[host_name("row_sum_half")]] [[kernel]] decltype(row_sum<half>) row_sum<half>;
template [[host_name("row_sum_bfloat")]] [[kernel]] decltype(row_sum<bfloat>) row_sum<bfloat>;
