// The emulator's runtime, seen from kernel code: the current thread's
// position, and the points where its fiber waits for others (barriers, SIMD
// exchanges). Implemented in runtime.cpp.
#pragma once

#include <cstddef>
#include <cstdint>

namespace emu {

constexpr int kSimdWidth = 32;
// Bytes one lane may publish in one SIMD exchange.
constexpr int kSimdSlot = 64;

struct ThreadPos {
  uint32_t grid[3];          // thread_position_in_grid
  uint32_t local[3];         // thread_position_in_threadgroup
  uint32_t group[3];         // threadgroup_position_in_grid
  uint32_t group_size[3];    // threads_per_threadgroup
  uint32_t groups[3];        // threadgroups_per_grid
  uint32_t grid_size[3];     // threads_per_grid
  uint32_t index;            // thread_index_in_threadgroup
  uint32_t lane;             // thread_index_in_simdgroup
  uint32_t simd_group;       // simdgroup_index_in_threadgroup
  uint32_t simd_groups;      // simdgroups_per_threadgroup
};

const ThreadPos& pos();

// A call's source location (from __builtin_FILE/__builtin_LINE as default
// arguments, so that it is the kernel's call, not the emulator's).
struct Site {
  const char* file;
  int line;
};

// Fails the run with a message naming the kernel, threadgroup and thread.
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Waits until every thread of the threadgroup reaches a threadgroup barrier,
// the same one (site and count) or the run fails as divergent. Without
// `orders_memory` (a barrier with mem_none) it orders no memory access in the
// ThreadSanitizer build.
void threadgroup_barrier(Site site, bool orders_memory = true);
// Publishes `size` bytes for this lane, waits until every active lane of the
// SIMD group has published at the same operation (site and count), and
// returns the 32 slots (kSimdSlot bytes each). Call simd_release() once done
// reading.
const unsigned char* simd_exchange(const void* data, size_t size, Site site);
void simd_release();
// Whether lane `l` of the caller's SIMD group exists and has not returned.
bool lane_active(int l);
// Lets another thread run (after an atomic operation).
void yield();

// Threadgroup memory declared inside a kernel (`threadgroup float x[64];`):
// one allocation per declaration per threadgroup, shared by its threads.
void* threadgroup_static(const void* key, size_t size, size_t align);

template <typename T, int Site>
T& threadgroup_var() {
  static const char key = 0;
  return *static_cast<T*>(threadgroup_static(&key, sizeof(T), alignof(T)));
}

}  // namespace emu
