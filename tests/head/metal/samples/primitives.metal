// One kernel per group of emulated MSL operations, for test_emu_primitives.py.
#include <metal_stdlib>
using namespace metal;

// Row k of out [16, threads] is the k-th SIMD-group operation applied to x.
[[kernel]] void simd_ops(
    const device int* x [[buffer(0)]],
    device int* out [[buffer(1)]],
    uint tid [[thread_index_in_threadgroup]],
    uint tsize [[threads_per_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]]) {
  const int v = x[tid];
  int k = 0;
  out[tsize * k++ + tid] = simd_shuffle(v, ushort((lane * 7 + 3) % 32));
  out[tsize * k++ + tid] = simd_shuffle_xor(v, ushort(5));
  out[tsize * k++ + tid] = simd_shuffle_down(v, ushort(3));
  out[tsize * k++ + tid] = simd_shuffle_up(v, ushort(3));
  out[tsize * k++ + tid] = simd_broadcast(v, ushort(9));
  out[tsize * k++ + tid] = simd_sum(v);
  out[tsize * k++ + tid] = simd_max(v);
  out[tsize * k++ + tid] = simd_min(v);
  out[tsize * k++ + tid] = simd_prefix_inclusive_sum(v);
  out[tsize * k++ + tid] = simd_prefix_exclusive_sum(v);
  out[tsize * k++ + tid] = quad_shuffle_xor(v, ushort(1));
  out[tsize * k++ + tid] = quad_sum(v);
  out[tsize * k++ + tid] = quad_broadcast(v, ushort(2));
  out[tsize * k++ + tid] = simd_shuffle_rotate_down(v, ushort(5));
  out[tsize * k++ + tid] = simd_shuffle_and_fill_down(v, -v, ushort(4));
  out[tsize * k++ + tid] = simd_shuffle_and_fill_up(v, -v, ushort(4));
}

// d = a @ b + c for 8x8 float matrices through simdgroup_matrix; e = a^T
// loaded transposed and stored back.
[[kernel]] void matrix_ops(
    const device float* a [[buffer(0)]],
    const device float* b [[buffer(1)]],
    const device float* c [[buffer(2)]],
    device float* d [[buffer(3)]],
    device float* e [[buffer(4)]]) {
  simdgroup_float8x8 A, B, C, D, T;
  simdgroup_load(A, a, 8);
  simdgroup_load(B, b, 8);
  simdgroup_load(C, c, 8);
  simdgroup_multiply_accumulate(D, A, B, C);
  simdgroup_store(D, d, 8);
  simdgroup_load(T, a, 8, ulong2(0, 0), true);
  simdgroup_store(T, e, 8);
}

// Conversions to half and bfloat, and half arithmetic rounded per operation.
[[kernel]] void convert(
    const device float* x [[buffer(0)]],
    device half* h [[buffer(1)]],
    device bfloat* bf [[buffer(2)]],
    device half* prod [[buffer(3)]],
    device float* back [[buffer(4)]],
    uint i [[thread_position_in_grid]]) {
  h[i] = static_cast<half>(x[i]);
  bf[i] = static_cast<bfloat>(x[i]);
  const half a = static_cast<half>(x[i]);
  const half b = static_cast<half>(x[(i + 1) % 64]);
  const half c = static_cast<half>(x[(i + 2) % 64]);
  prod[i] = a * b + c;
  back[i] = static_cast<float>(h[i]) + static_cast<float>(bf[i]);
}

// Every thread of every threadgroup adds its index to a device counter and
// counts itself in a threadgroup counter.
[[kernel]] void atomics(
    device atomic_int* total [[buffer(0)]],
    device int* per_group [[buffer(1)]],
    uint tid [[thread_index_in_threadgroup]],
    uint gid [[threadgroup_position_in_grid]]) {
  threadgroup atomic_int count;
  if (tid == 0) {
    atomic_store_explicit(&count, 0, memory_order_relaxed);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_fetch_add_explicit(total, int(tid), memory_order_relaxed);
  atomic_fetch_add_explicit(&count, 1, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    per_group[gid] = atomic_load_explicit(&count, memory_order_relaxed);
  }
}

// Reverses each threadgroup's slice of x through [[threadgroup(0)]] memory.
[[kernel]] void reverse_groups(
    const device float* x [[buffer(0)]],
    device float* y [[buffer(1)]],
    threadgroup float* buf [[threadgroup(0)]],
    uint gid [[thread_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint2 tsize [[threads_per_threadgroup]]) {
  buf[tid] = x[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[gid] = buf[tsize.x - 1 - tid];
}

// Writes thread and threadgroup positions: out [threads, 4] per threadgroup.
[[kernel]] void positions(
    device uint4* out [[buffer(0)]],
    uint3 grid [[thread_position_in_grid]],
    ushort3 local [[thread_position_in_threadgroup]],
    uint3 group [[threadgroup_position_in_grid]],
    uint3 groups [[threadgroups_per_grid]],
    uint index [[thread_index_in_threadgroup]],
    uint3 size [[threads_per_threadgroup]]) {
  const uint g = (group.z * groups.y + group.y) * groups.x + group.x;
  const uint n = size.x * size.y * size.z;
  out[g * n + index] = uint4(grid.x, grid.y, uint(local.x) + 10 * local.y + 100 * local.z, g);
}

template <typename T>
[[kernel]] void fill(device T* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = T(i);
}

// Waits for a flag nobody sets.
[[kernel]] void spin(device atomic_int* flag [[buffer(0)]]) {
  while (atomic_load_explicit(flag, memory_order_relaxed) == 0) {
  }
}

// Lanes from `live` on return first; the others reduce and shuffle.
[[kernel]] void early_exit(
    device int* out [[buffer(0)]],
    constant int2& live_mask [[buffer(1)]],
    ushort lane [[thread_index_in_simdgroup]]) {
  if (lane >= live_mask.x) {
    return;
  }
  out[lane] = simd_sum(int(lane));
  out[32 + lane] = simd_shuffle_xor(int(lane), ushort(live_mask.y));
}

// Integer bit counts and three-way min/max/median, one row per function.
[[kernel]] void scalar_ops(
    const device int* x [[buffer(0)]],
    const device float* f [[buffer(1)]],
    device int* out [[buffer(2)]],
    device float* fout [[buffer(3)]],
    uint i [[thread_position_in_grid]],
    uint n [[threads_per_grid]]) {
  out[i] = clz(x[i]);
  out[n + i] = ctz(x[i]);
  out[2 * n + i] = popcount(x[i]);
  out[3 * n + i] = clz(ushort(x[i]));
  const float a = f[i], b = f[(i + 1) % n], c = f[(i + 2) % n];
  fout[i] = fmax3(a, b, c);
  fout[n + i] = fmin3(a, b, c);
  fout[2 * n + i] = fmedian3(a, b, c);
  fout[3 * n + i] = step(b, a);
}
