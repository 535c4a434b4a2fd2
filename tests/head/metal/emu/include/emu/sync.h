// MSL's synchronising operations on the emulator's fibers: barriers, SIMD-group
// shuffles and reductions, quad operations, simdgroup_matrix 8x8, atomics.
// Threads meeting at a barrier or SIMD operation must be at the same source
// location (default arguments EMU_AT) and have passed as many before it, so
// that one under divergent control flow is reported.
#pragma once

#include <cstring>

#include "emu/runtime.h"
#include "emu/stdlib.h"

#define EMU_AT emu::Site emu_at = {__builtin_FILE(), __builtin_LINE()}

namespace metal {

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(int(a) | int(b));
}

// A barrier whose flags name no memory (mem_none, or mem_texture alone) orders
// execution only: under ThreadSanitizer it orders no access, so that a barrier
// that needs mem_threadgroup or mem_device but says mem_none shows as a race.
// Either memory flag orders every access (device and threadgroup alike).
inline void threadgroup_barrier(mem_flags f, EMU_AT) {
  emu::threadgroup_barrier(emu_at, (int(f) & (int(mem_flags::mem_device) |
                                              int(mem_flags::mem_threadgroup))) != 0);
}
inline void simdgroup_barrier(mem_flags, EMU_AT) {
  emu::simd_exchange(nullptr, 0, emu_at);
  emu::simd_release();
}

}  // namespace metal

namespace emu {

template <typename T>
T slot(const unsigned char* slots, int lane) {
  if (!lane_active(lane))
    fail("SIMD operation reads lane %d, which is inactive or has returned", lane);
  T v;
  std::memcpy(&v, slots + lane * kSimdSlot, sizeof(T));
  return v;
}

// Calls f(slots, lane) with every active lane's published value.
template <typename T>
struct Pair {
  T a, b;
};

template <typename T, typename F>
auto simd_op(const T& v, Site at, F f) {
  static_assert(sizeof(T) <= kSimdSlot, "SIMD operand too large for the emulator's slot");
  const unsigned char* slots = simd_exchange(&v, sizeof(T), at);
  auto r = f(slots, int(pos().lane));
  simd_release();
  return r;
}

template <typename T, typename Op>
T simd_reduce(const unsigned char* slots, int first, int count, Op op) {
  bool have = false;
  T acc{};
  for (int l = first; l < first + count; l++) {
    if (!lane_active(l)) continue;
    T x = slot<T>(slots, l);
    acc = have ? op(acc, x) : x;
    have = true;
  }
  return acc;
}

}  // namespace emu

namespace metal {

#define EMU_SIMD_FN(name, body)                                            \
  template <typename T>                                                    \
  T name(T v, ushort arg, EMU_AT) {                               \
    return emu::simd_op(v, emu_at, [&](const unsigned char* s, int l) { \
      body;                                                                \
    });                                                                    \
  }

EMU_SIMD_FN(simd_shuffle, return emu::slot<T>(s, arg))
EMU_SIMD_FN(simd_broadcast, return emu::slot<T>(s, arg))
EMU_SIMD_FN(simd_shuffle_xor, return emu::slot<T>(s, l ^ arg))
// Lanes whose source would leave the SIMD group keep their own value.
EMU_SIMD_FN(simd_shuffle_down, return l + arg < emu::kSimdWidth ? emu::slot<T>(s, l + arg) : v)
EMU_SIMD_FN(simd_shuffle_up, return l >= arg ? emu::slot<T>(s, l - arg) : v)
EMU_SIMD_FN(simd_shuffle_rotate_down, return emu::slot<T>(s, (l + arg) % emu::kSimdWidth))
EMU_SIMD_FN(simd_shuffle_rotate_up,
            return emu::slot<T>(s, (l + emu::kSimdWidth - arg % emu::kSimdWidth) % emu::kSimdWidth))
EMU_SIMD_FN(quad_shuffle, return emu::slot<T>(s, (l & ~3) + (arg & 3)))
EMU_SIMD_FN(quad_broadcast, return emu::slot<T>(s, (l & ~3) + (arg & 3)))
EMU_SIMD_FN(quad_shuffle_xor, return emu::slot<T>(s, (l & ~3) + ((l ^ arg) & 3)))
EMU_SIMD_FN(quad_shuffle_down, return (l & 3) + arg < 4 ? emu::slot<T>(s, l + arg) : v)
EMU_SIMD_FN(quad_shuffle_up, return int(l & 3) >= int(arg) ? emu::slot<T>(s, l - arg) : v)
#undef EMU_SIMD_FN

// Lanes whose source leaves the SIMD group (or the `modulo` window) read `filling`.
template <typename T>
T simd_shuffle_and_fill_down(T v, T filling, ushort delta, ushort modulo = 32, EMU_AT) {
  T both[2] = {v, filling};
  return emu::simd_op(both, emu_at, [&](const unsigned char* s, int l) {
    int base = l / modulo * modulo, src = l + delta;
    using P = emu::Pair<T>;
    return src < base + modulo ? emu::slot<P>(s, src).a : emu::slot<P>(s, src - modulo).b;
  });
}
template <typename T>
T simd_shuffle_and_fill_up(T v, T filling, ushort delta, ushort modulo = 32, EMU_AT) {
  T both[2] = {v, filling};
  return emu::simd_op(both, emu_at, [&](const unsigned char* s, int l) {
    int base = l / modulo * modulo, src = l - delta;
    using P = emu::Pair<T>;
    return src >= base ? emu::slot<P>(s, src).a : emu::slot<P>(s, src + modulo).b;
  });
}

#define EMU_SIMD_REDUCE(name, width, expr)                                                   \
  template <typename T>                                                                     \
  T name(T v, EMU_AT) {                                                            \
    return emu::simd_op(v, emu_at, [&](const unsigned char* s, int l) {                  \
      return emu::simd_reduce<T>(s, l / width * width, width, [](T a, T b) { return expr; }); \
    });                                                                                     \
  }

EMU_SIMD_REDUCE(simd_sum, 32, T(a + b))
EMU_SIMD_REDUCE(simd_product, 32, T(a * b))
EMU_SIMD_REDUCE(simd_max, 32, metal::max(a, b))
EMU_SIMD_REDUCE(simd_min, 32, metal::min(a, b))
EMU_SIMD_REDUCE(simd_and, 32, T(a & b))
EMU_SIMD_REDUCE(simd_or, 32, T(a | b))
EMU_SIMD_REDUCE(simd_xor, 32, T(a ^ b))
EMU_SIMD_REDUCE(quad_sum, 4, T(a + b))
EMU_SIMD_REDUCE(quad_product, 4, T(a * b))
EMU_SIMD_REDUCE(quad_max, 4, metal::max(a, b))
EMU_SIMD_REDUCE(quad_min, 4, metal::min(a, b))
#undef EMU_SIMD_REDUCE

template <typename T>
T simd_prefix_inclusive_sum(T v, EMU_AT) {
  return emu::simd_op(v, emu_at, [&](const unsigned char* s, int l) {
    return emu::simd_reduce<T>(s, 0, l + 1, [](T a, T b) { return T(a + b); });
  });
}
template <typename T>
T simd_prefix_exclusive_sum(T v, EMU_AT) {
  return emu::simd_op(v, emu_at, [&](const unsigned char* s, int l) {
    return l == 0 ? T(0) : emu::simd_reduce<T>(s, 0, l, [](T a, T b) { return T(a + b); });
  });
}
inline bool simd_all(bool v, EMU_AT) {
  return emu::simd_op(v, emu_at, [&](const unsigned char* s, int) {
    return emu::simd_reduce<bool>(s, 0, 32, [](bool a, bool b) { return a && b; });
  });
}
inline bool simd_any(bool v, EMU_AT) {
  return emu::simd_op(v, emu_at, [&](const unsigned char* s, int) {
    return emu::simd_reduce<bool>(s, 0, 32, [](bool a, bool b) { return a || b; });
  });
}
inline bool simd_is_first(EMU_AT) {
  char c = 0;
  return emu::simd_op(c, emu_at, [&](const unsigned char*, int l) {
    for (int k = 0; k < l; k++)
      if (emu::lane_active(k)) return false;
    return true;
  });
}

// simdgroup_matrix<T, 8, 8>: lane l holds row fm, columns fn and fn + 1, in
// the layout that steel's BaseMMAFrag::get_coord reads back.
inline void simdgroup_coord(int lane, int& row, int& col) {
  const int q = lane / 4;
  row = (q & 4) + (lane / 2) % 4;
  col = (q & 2) * 2 + (lane % 2) * 2;
}

template <typename T, int Rows, int Cols>
struct simdgroup_matrix {
  static_assert(Rows == 8 && Cols == 8, "the emulator supports 8x8 simdgroup matrices only");
  vec<T, 2> e;
  simdgroup_matrix() = default;
  // Diagonal matrix, as MSL's simdgroup_matrix(T).
  explicit simdgroup_matrix(T d) {
    int r, c;
    simdgroup_coord(int(emu::pos().lane), r, c);
    e[0] = r == c ? d : T(0);
    e[1] = r == c + 1 ? d : T(0);
  }
  vec<T, 2>& thread_elements() { return e; }
  const vec<T, 2>& thread_elements() const { return e; }
};

typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <typename T, int R, int C>
simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, R, C> m;
  m.e = vec<T, 2>(value);
  return m;
}

namespace emu_detail {
template <typename T>
struct MatPair {
  vec<T, 2> a, b;
};
}  // namespace emu_detail

// D = A * B + C over the SIMD group; products and sums in double, rounded once
// to D's type (the hardware's rounding order is not emulated).
template <typename TD, typename TA, typename TB, typename TC>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d,
                                            const simdgroup_matrix<TA, 8, 8>& a,
                                            const simdgroup_matrix<TB, 8, 8>& b,
                                            const simdgroup_matrix<TC, 8, 8>& c, EMU_AT) {
  static_assert(sizeof(TA) == sizeof(TB), "mixed operand sizes are not emulated");
  emu_detail::MatPair<TA> mine{a.e, vec<TA, 2>(b.e)};
  vec<TC, 2> cm = c.e;
  const unsigned char* s = emu::simd_exchange(&mine, sizeof(mine), emu_at);
  double A[8][8], B[8][8];
  for (int l = 0; l < emu::kSimdWidth; l++) {
    auto p = emu::slot<emu_detail::MatPair<TA>>(s, l);
    int r, col;
    simdgroup_coord(l, r, col);
    for (int k = 0; k < 2; k++) {
      A[r][col + k] = double(float(p.a[k]));
      B[r][col + k] = double(float(p.b[k]));
    }
  }
  emu::simd_release();
  int r, col;
  simdgroup_coord(int(emu::pos().lane), r, col);
  for (int k = 0; k < 2; k++) {
    double acc = double(float(cm[k]));
    for (int i = 0; i < 8; i++) acc += A[r][i] * B[i][col + k];
    d.e[k] = TD(float(acc));
  }
}

template <typename TD, typename TA, typename TB>
void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                        const simdgroup_matrix<TB, 8, 8>& b, EMU_AT) {
  simdgroup_matrix<TD, 8, 8> zero = make_filled_simdgroup_matrix<TD, 8, 8>(TD(0));
  simdgroup_multiply_accumulate(d, a, b, zero, emu_at);
}

// Element (r, c) of the matrix is src[(origin.y + r) * elements_per_row +
// origin.x + c] (with transpose, r and c swap roles in the source).
template <typename T, typename P>
void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, P src, ulong elements_per_row = 8,
                             ulong2 origin = ulong2(0, 0), bool transpose = false, EMU_AT) {
  emu::simd_exchange(nullptr, 0, emu_at);
  emu::simd_release();
  int r, c;
  simdgroup_coord(int(emu::pos().lane), r, c);
  for (int k = 0; k < 2; k++) {
    ulong rr = transpose ? c + k : r, cc = transpose ? r : c + k;
    d.e[k] = T(src[(origin.y + rr) * elements_per_row + origin.x + cc]);
  }
}

template <typename T, typename P>
void simdgroup_store(const simdgroup_matrix<T, 8, 8>& m, P dst,
                              ulong elements_per_row = 8, ulong2 origin = ulong2(0, 0),
                              bool transpose = false, EMU_AT) {
  emu::simd_exchange(nullptr, 0, emu_at);
  emu::simd_release();
  int r, c;
  simdgroup_coord(int(emu::pos().lane), r, c);
  using U = std::remove_cv_t<std::remove_reference_t<decltype(dst[0])>>;
  for (int k = 0; k < 2; k++) {
    ulong rr = transpose ? c + k : r, cc = transpose ? r : c + k;
    dst[(origin.y + rr) * elements_per_row + origin.x + cc] = U(m.e[k]);
  }
}

// Atomics: fibers run one at a time, so each operation is atomic; the thread
// yields afterwards so that other threads interleave with it. The run builds
// use the compiler's relaxed atomic builtins, which ThreadSanitizer knows as
// atomic and unordered (Metal's atomics are relaxed).
enum memory_order { memory_order_relaxed, memory_order_seq_cst };

template <typename T>
struct atomic {
  T value;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;

namespace emu_detail {
#ifdef EMU_TYPECHECK
template <typename P>
auto load(P obj) {
  return obj->value;
}
template <typename P, typename T>
void store(P obj, T v) {
  obj->value = v;
}
template <typename P, typename T>
bool exchange_if(P obj, T& expected, T desired) {
  return obj->value == expected ? (obj->value = desired, true) : (expected = obj->value, false);
}
#else
template <typename P>
auto load(P obj) {
  std::remove_cv_t<decltype(obj->value)> v;
  __atomic_load(&obj->value, &v, __ATOMIC_RELAXED);
  return v;
}
template <typename P, typename T>
void store(P obj, T v) {
  __atomic_store(&obj->value, &v, __ATOMIC_RELAXED);
}
template <typename P, typename T>
bool exchange_if(P obj, T& expected, T desired) {
  return __atomic_compare_exchange(&obj->value, &expected, &desired, false, __ATOMIC_RELAXED,
                                   __ATOMIC_RELAXED);
}
#endif
}  // namespace emu_detail

#define EMU_ATOMIC_RMW(name, expr)                                  \
  template <typename P, typename U>                                 \
  auto name(P obj, U arg, memory_order) {                           \
    auto old = emu_detail::load(obj);                               \
    using T = decltype(old);                                        \
    T a = T(arg);                                                   \
    while (!emu_detail::exchange_if(obj, old, T(expr))) {           \
    }                                                               \
    emu::yield();                                                   \
    return old;                                                     \
  }
EMU_ATOMIC_RMW(atomic_fetch_add_explicit, old + a)
EMU_ATOMIC_RMW(atomic_fetch_sub_explicit, old - a)
EMU_ATOMIC_RMW(atomic_fetch_max_explicit, metal::max(old, a))
EMU_ATOMIC_RMW(atomic_fetch_min_explicit, metal::min(old, a))
EMU_ATOMIC_RMW(atomic_fetch_and_explicit, old & a)
EMU_ATOMIC_RMW(atomic_fetch_or_explicit, old | a)
EMU_ATOMIC_RMW(atomic_fetch_xor_explicit, old ^ a)
EMU_ATOMIC_RMW(atomic_exchange_explicit, a)
#undef EMU_ATOMIC_RMW

template <typename P>
auto atomic_load_explicit(P obj, memory_order) {
  auto v = emu_detail::load(obj);
  emu::yield();
  return v;
}
template <typename P, typename U>
void atomic_store_explicit(P obj, U v, memory_order) {
  emu_detail::store(obj, std::remove_cv_t<decltype(obj->value)>(v));
  emu::yield();
}
template <typename P, typename E, typename U>
bool atomic_compare_exchange_weak_explicit(P obj, E expected, U desired, memory_order,
                                           memory_order) {
  bool ok = emu_detail::exchange_if(obj, *expected, decltype(*expected + 0)(desired));
  emu::yield();
  return ok;
}

}  // namespace metal
