// Binding a kernel's parameters to the dispatch: buffers and threadgroup
// memory by index, builtins ([[thread_position_in_grid]], ...) from the
// current thread. The driver generates one emu::Entry per kernel entry point
// with the parameters' attributes read from the source.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "emu/runtime.h"
#include "emu/vec.h"

namespace emu {

enum class Arg {
  buffer,
  threadgroup,
  thread_position_in_grid,
  thread_position_in_threadgroup,
  threadgroup_position_in_grid,
  threads_per_threadgroup,
  threadgroups_per_grid,
  threads_per_grid,
  thread_index_in_threadgroup,
  thread_index_in_simdgroup,
  simdgroup_index_in_threadgroup,
  simdgroups_per_threadgroup,
  threads_per_simdgroup,
  thread_index_in_quadgroup,
  quadgroup_index_in_threadgroup,
};

struct Binding {
  Arg kind;
  int index;  // buffer(n) / threadgroup(n)
  const char* name;
};

struct Span {
  void* data;
  size_t size;
};

// The buffer / threadgroup memory bound at `index` for the current dispatch;
// fails naming the parameter when nothing is bound there.
Span buffer_arg(int index, const char* name);
Span threadgroup_arg(int index, const char* name);

struct Entry {
  const char* name;
  void (*run)();
  const Binding* bindings;
  int num_bindings;
  int max_threads;  // [[max_total_threads_per_threadgroup]], 0 if absent
};

void builtin_value(Arg kind, uint32_t out[3]);

template <typename P>
P bind(const Binding& b) {
  using V = std::remove_cv_t<std::remove_reference_t<P>>;
  if constexpr (std::is_pointer<V>::value) {
    Span s = b.kind == Arg::threadgroup ? threadgroup_arg(b.index, b.name)
                                        : buffer_arg(b.index, b.name);
    return __builtin_bit_cast(V, s.data);
  } else if constexpr (std::is_reference<P>::value) {
    using R = std::remove_reference_t<P>;
    Span s = buffer_arg(b.index, b.name);
    if (s.size < sizeof(R))
      fail("parameter '%s' (buffer %d) needs %zu bytes, the buffer has %zu", b.name, b.index,
           sizeof(R), s.size);
    return *__builtin_bit_cast(R*, s.data);
  } else {
    uint32_t v[3];
    builtin_value(b.kind, v);
    if constexpr (is_vec<V>::value) {
      V r;
      for (int i = 0; i < V::size; i++) r[i] = typename V::value_type(v[i]);
      return r;
    } else {
      return V(v[0]);
    }
  }
}

template <typename... P, size_t... I>
void invoke_with(void (*f)(P...), const Binding* b, std::index_sequence<I...>) {
  f(bind<P>(b[I])...);
}

template <typename... P>
void invoke(void (*f)(P...), const Binding* b, int n) {
  if (n != int(sizeof...(P))) fail("entry table and kernel disagree on the parameter count");
  invoke_with(f, b, std::index_sequence_for<P...>{});
}

}  // namespace emu
