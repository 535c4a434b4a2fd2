// MSL vector types (float2, half4, uint3, ...) as structs: constructible like
// MSL (`int2(a, b)`, `float4(v2, z, w)`, broadcast from a scalar), with
// elementwise operators and MSL's size and alignment (a 3-vector takes 4 slots).
#pragma once

#include "emu/scalar.h"

namespace metal {

template <typename T, int N>
struct vec;

}  // namespace metal

namespace emu {

template <typename T, int N>
struct alignas(sizeof(T) * (N == 3 ? 4 : N)) vec_storage;
template <typename T>
struct alignas(sizeof(T) * 2) vec_storage<T, 2> {
  T x, y;
};
template <typename T>
struct alignas(sizeof(T) * 4) vec_storage<T, 3> {
  T x, y, z;
};
template <typename T>
struct alignas(sizeof(T) * 4) vec_storage<T, 4> {
  T x, y, z, w;
};

template <typename T>
struct is_vec : std::false_type {};
template <typename T, int N>
struct is_vec<metal::vec<T, N>> : std::true_type {};

template <typename T>
struct vec_size : std::integral_constant<int, 1> {};
template <typename T, int N>
struct vec_size<metal::vec<T, N>> : std::integral_constant<int, N> {};

template <typename T>
constexpr bool is_scalar_v = std::is_arithmetic<T>::value || is_low_fp<T>::value;

}  // namespace emu

namespace metal {

template <typename T, int N>
struct vec : emu::vec_storage<T, N> {
  using value_type = T;
  static constexpr int size = N;

  vec() = default;
  // Broadcast, as `float4(0)` or `float4 v = 0.0f`.
  template <typename U, typename = std::enable_if_t<emu::is_scalar_v<U>>>
  constexpr vec(U s) {
    for (int i = 0; i < N; i++) (*this)[i] = T(s);
  }
  // Components from scalars and shorter vectors: `int2(a, b)`, `float4(v2, z, w)`.
  template <typename A, typename B, typename... R>
  constexpr vec(A a, B b, R... r) {
    static_assert(emu::vec_size<A>::value + emu::vec_size<B>::value +
                          (0 + ... + emu::vec_size<R>::value) ==
                      N,
                  "vector constructor: component count differs from the vector size");
    int i = 0;
    put(i, a);
    put(i, b);
    (put(i, r), ...);
  }
  // Conversion between element types is explicit in MSL.
  template <typename U>
  constexpr explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; i++) (*this)[i] = T(o[i]);
  }

  constexpr T& operator[](int i) { return (&this->x)[i]; }
  constexpr const T& operator[](int i) const { return (&this->x)[i]; }

 private:
  template <typename U>
  constexpr void put(int& i, const U& u) {
    if constexpr (emu::is_vec<U>::value) {
      for (int k = 0; k < U::size; k++) (*this)[i++] = T(u[k]);
    } else {
      (*this)[i++] = T(u);
    }
  }
};

}  // namespace metal

namespace emu {

template <typename T, int N, typename F>
constexpr auto vec_map(F f, const metal::vec<T, N>& a) {
  metal::vec<decltype(f(a[0])), N> r;
  for (int i = 0; i < N; i++) r[i] = f(a[i]);
  return r;
}

template <typename V, typename S>
struct vec_operand {
  static constexpr bool ok = is_vec<V>::value && is_scalar_v<S>;
};

}  // namespace emu

// Arithmetic keeps the element type (short2 - short2 is a short2, unlike
// C++'s promotion of short); comparisons give bool vectors.
#define EMU_VEC_BINOP(op, R)                                                                \
  template <typename T, int N>                                                              \
  constexpr metal::vec<R, N> operator op(const metal::vec<T, N>& a,                         \
                                         const metal::vec<T, N>& b) {                       \
    metal::vec<R, N> r;                                                                     \
    for (int i = 0; i < N; i++) r[i] = R(a[i] op b[i]);                                     \
    return r;                                                                               \
  }                                                                                         \
  template <typename T, int N, typename S, typename = std::enable_if_t<emu::is_scalar_v<S>>> \
  constexpr metal::vec<R, N> operator op(const metal::vec<T, N>& a, S s) {                  \
    metal::vec<R, N> r;                                                                     \
    for (int i = 0; i < N; i++) r[i] = R(a[i] op T(s));                                     \
    return r;                                                                               \
  }                                                                                         \
  template <typename T, int N, typename S, typename = std::enable_if_t<emu::is_scalar_v<S>>> \
  constexpr metal::vec<R, N> operator op(S s, const metal::vec<T, N>& a) {                  \
    metal::vec<R, N> r;                                                                     \
    for (int i = 0; i < N; i++) r[i] = R(T(s) op a[i]);                                     \
    return r;                                                                               \
  }

#define EMU_VEC_ASSIGN(op)                                                        \
  template <typename T, int N, typename U>                                        \
  constexpr metal::vec<T, N>& operator op##=(metal::vec<T, N>& a, const U& b) {   \
    a = metal::vec<T, N>(a op b);                                                 \
    return a;                                                                     \
  }

EMU_VEC_BINOP(+, T)
EMU_VEC_BINOP(-, T)
EMU_VEC_BINOP(*, T)
EMU_VEC_BINOP(/, T)
EMU_VEC_BINOP(%, T)
EMU_VEC_BINOP(&, T)
EMU_VEC_BINOP(|, T)
EMU_VEC_BINOP(^, T)
EMU_VEC_BINOP(<<, T)
EMU_VEC_BINOP(>>, T)
EMU_VEC_BINOP(==, bool)
EMU_VEC_BINOP(!=, bool)
EMU_VEC_BINOP(<, bool)
EMU_VEC_BINOP(<=, bool)
EMU_VEC_BINOP(>, bool)
EMU_VEC_BINOP(>=, bool)
EMU_VEC_BINOP(&&, bool)
EMU_VEC_BINOP(||, bool)
EMU_VEC_ASSIGN(+)
EMU_VEC_ASSIGN(-)
EMU_VEC_ASSIGN(*)
EMU_VEC_ASSIGN(/)
EMU_VEC_ASSIGN(%)
EMU_VEC_ASSIGN(&)
EMU_VEC_ASSIGN(|)
EMU_VEC_ASSIGN(^)
EMU_VEC_ASSIGN(<<)
EMU_VEC_ASSIGN(>>)
#undef EMU_VEC_BINOP
#undef EMU_VEC_ASSIGN

template <typename T, int N>
constexpr metal::vec<T, N> operator-(const metal::vec<T, N>& a) {
  return emu::vec_map([](T v) { return T(-v); }, a);
}
template <typename T, int N>
constexpr metal::vec<T, N> operator+(const metal::vec<T, N>& a) {
  return a;
}
template <typename T, int N>
constexpr metal::vec<bool, N> operator!(const metal::vec<T, N>& a) {
  return emu::vec_map([](T v) { return !v; }, a);
}
template <typename T, int N>
constexpr metal::vec<T, N> operator~(const metal::vec<T, N>& a) {
  return emu::vec_map([](T v) { return T(~v); }, a);
}

#define EMU_VEC_NAMES(T, name)             \
  typedef metal::vec<T, 2> name##2;        \
  typedef metal::vec<T, 3> name##3;        \
  typedef metal::vec<T, 4> name##4;        \
  namespace metal {                        \
  using ::name##2;                         \
  using ::name##3;                         \
  using ::name##4;                         \
  }
EMU_VEC_NAMES(float, float)
EMU_VEC_NAMES(half, half)
EMU_VEC_NAMES(bfloat, bfloat)
EMU_VEC_NAMES(int, int)
EMU_VEC_NAMES(uint, uint)
EMU_VEC_NAMES(short, short)
EMU_VEC_NAMES(ushort, ushort)
EMU_VEC_NAMES(char, char)
EMU_VEC_NAMES(uchar, uchar)
EMU_VEC_NAMES(bool, bool)
EMU_VEC_NAMES(long, long)
EMU_VEC_NAMES(ulong, ulong)
#undef EMU_VEC_NAMES
