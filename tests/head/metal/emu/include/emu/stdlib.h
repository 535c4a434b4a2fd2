// The parts of MSL's metal namespace that are plain functions: type traits,
// numeric_limits, math (precise; fast:: maps to the same functions), min/max
// by value, clamp, select, as_type.
#pragma once

#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

#include "emu/vec.h"

namespace metal {

using std::bool_constant;
using std::conditional;
using std::conditional_t;
using std::decay;
using std::decay_t;
using std::enable_if;
using std::enable_if_t;
using std::false_type;
using std::integral_constant;
using std::is_const;
using std::is_convertible;
using std::is_convertible_v;
using std::is_integral;
using std::is_integral_v;
using std::is_pointer;
using std::is_pointer_v;
using std::is_same;
using std::is_same_v;
using std::is_signed;
using std::is_signed_v;
using std::is_unsigned;
using std::is_unsigned_v;
using std::make_signed;
using std::make_signed_t;
using std::make_unsigned;
using std::make_unsigned_t;
using std::remove_const;
using std::remove_const_t;
using std::remove_cv;
using std::remove_cv_t;
using std::remove_pointer;
using std::remove_pointer_t;
using std::remove_reference;
using std::remove_reference_t;
using std::remove_volatile;
using std::remove_volatile_t;
using std::true_type;
using std::declval;

template <typename T>
struct is_floating_point
    : bool_constant<std::is_floating_point<T>::value || emu::is_low_fp<remove_cv_t<T>>::value> {};
template <typename T>
constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <typename T>
struct is_arithmetic : bool_constant<std::is_integral<T>::value || is_floating_point<T>::value> {};
template <typename T>
constexpr bool is_arithmetic_v = is_arithmetic<T>::value;
template <typename T>
struct is_scalar : bool_constant<is_arithmetic<T>::value> {};
template <typename T>
constexpr bool is_scalar_v = is_scalar<T>::value;
template <typename T>
struct is_vector : emu::is_vec<remove_cv_t<T>> {};
template <typename T>
constexpr bool is_vector_v = is_vector<T>::value;

template <typename T>
struct remove_addrspace {
  using type = T;
};
#ifdef EMU_TYPECHECK
template <typename T>
struct remove_addrspace<__attribute__((address_space(1))) T> {
  using type = T;
};
template <typename T>
struct remove_addrspace<__attribute__((address_space(2))) T> {
  using type = T;
};
template <typename T>
struct remove_addrspace<__attribute__((address_space(3))) T> {
  using type = T;
};
#endif
template <typename T>
using remove_addrspace_t = typename remove_addrspace<T>::type;

template <typename T>
struct numeric_limits : std::numeric_limits<T> {};

template <typename T, uint16_t Max, uint16_t Min, uint16_t Lowest, uint16_t Eps, uint16_t Inf,
          uint16_t Nan>
struct emu_low_fp_limits {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr T max() { return emu::from_bits<T>(Max); }
  static constexpr T min() { return emu::from_bits<T>(Min); }
  static constexpr T lowest() { return emu::from_bits<T>(Lowest); }
  static constexpr T epsilon() { return emu::from_bits<T>(Eps); }
  static constexpr T infinity() { return emu::from_bits<T>(Inf); }
  static constexpr T quiet_NaN() { return emu::from_bits<T>(Nan); }
};
template <>
struct numeric_limits<half>
    : emu_low_fp_limits<half, 0x7bff, 0x0400, 0xfbff, 0x1400, 0x7c00, 0x7e00> {};
template <>
struct numeric_limits<bfloat>
    : emu_low_fp_limits<bfloat, 0x7f7f, 0x0080, 0xff7f, 0x3c00, 0x7f80, 0x7fc0> {};

template <typename T, typename U>
T as_type(const U& u) {
  static_assert(sizeof(T) == sizeof(U), "as_type: the two types differ in size");
  T t;
  std::memcpy(&t, &u, sizeof(T));
  return t;
}

// Math (only functions that MSL has: a kernel using another must fail here
// as on Apple's compiler). half and bfloat compute in float and round back; vectors elementwise.
#define EMU_MATH1(name, expr)                                                 \
  inline float name(float x) { return expr; }                                 \
  inline half name(half h) {                                                  \
    float x = float(h);                                                       \
    return half(expr);                                                        \
  }                                                                           \
  inline bfloat name(bfloat h) {                                              \
    float x = float(h);                                                       \
    return bfloat(expr);                                                      \
  }                                                                           \
  template <typename T, int N>                                                \
  vec<T, N> name(const vec<T, N>& v) {                                        \
    vec<T, N> r;                                                              \
    for (int i = 0; i < N; i++) r[i] = name(v[i]);                            \
    return r;                                                                 \
  }

EMU_MATH1(exp, std::exp(x))
EMU_MATH1(exp2, std::exp2(x))
EMU_MATH1(exp10, std::pow(10.0f, x))
EMU_MATH1(log, std::log(x))
EMU_MATH1(log2, std::log2(x))
EMU_MATH1(log10, std::log10(x))
EMU_MATH1(sqrt, std::sqrt(x))
EMU_MATH1(rsqrt, 1.0f / std::sqrt(x))
EMU_MATH1(sin, std::sin(x))
EMU_MATH1(cos, std::cos(x))
EMU_MATH1(tan, std::tan(x))
EMU_MATH1(asin, std::asin(x))
EMU_MATH1(acos, std::acos(x))
EMU_MATH1(atan, std::atan(x))
EMU_MATH1(sinh, std::sinh(x))
EMU_MATH1(cosh, std::cosh(x))
EMU_MATH1(tanh, std::tanh(x))
EMU_MATH1(asinh, std::asinh(x))
EMU_MATH1(acosh, std::acosh(x))
EMU_MATH1(atanh, std::atanh(x))
EMU_MATH1(floor, std::floor(x))
EMU_MATH1(ceil, std::ceil(x))
EMU_MATH1(round, std::round(x))
EMU_MATH1(rint, std::nearbyint(x))
EMU_MATH1(trunc, std::trunc(x))
EMU_MATH1(fabs, std::fabs(x))
EMU_MATH1(fract, x - std::floor(x))
EMU_MATH1(sign, (x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x == x ? 0.0f : x))))
#undef EMU_MATH1

#define EMU_MATH2(name, expr)                                                        \
  inline float name(float x, float y) { return expr; }                               \
  inline half name(half hx, half hy) {                                               \
    float x = float(hx), y = float(hy);                                              \
    return half(expr);                                                               \
  }                                                                                  \
  inline bfloat name(bfloat hx, bfloat hy) {                                         \
    float x = float(hx), y = float(hy);                                              \
    return bfloat(expr);                                                             \
  }                                                                                  \
  template <typename T, int N>                                                       \
  vec<T, N> name(const vec<T, N>& a, const vec<T, N>& b) {                           \
    vec<T, N> r;                                                                     \
    for (int i = 0; i < N; i++) r[i] = name(a[i], b[i]);                             \
    return r;                                                                        \
  }

EMU_MATH2(pow, std::pow(x, y))
EMU_MATH2(powr, std::pow(x, y))
EMU_MATH2(atan2, std::atan2(x, y))
EMU_MATH2(fmod, std::fmod(x, y))
EMU_MATH2(fmin, std::fmin(x, y))
EMU_MATH2(fmax, std::fmax(x, y))
EMU_MATH2(copysign, std::copysign(x, y))
EMU_MATH2(divide, x / y)
EMU_MATH2(nextafter, std::nextafter(x, y))
#undef EMU_MATH2

inline int abs(int x) { return x < 0 ? -x : x; }
inline long abs(long x) { return x < 0 ? -x : x; }
inline short abs(short x) { return short(x < 0 ? -x : x); }
inline float abs(float x) { return fabs(x); }
inline half abs(half x) { return fabs(x); }
inline bfloat abs(bfloat x) { return fabs(x); }
template <typename T, int N>
vec<T, N> abs(const vec<T, N>& v) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r[i] = abs(v[i]);
  return r;
}

// min/max/clamp by value, on one type (as MSL's, unlike std's references).
// Floating point: fmin/fmax semantics (a NaN operand yields the other).
template <typename T>
T max(T a, T b) {
  if constexpr (is_floating_point<T>::value) {
    if (a != a) return b;
    if (b != b) return a;
  }
  return a > b ? a : b;
}
template <typename T>
T min(T a, T b) {
  if constexpr (is_floating_point<T>::value) {
    if (a != a) return b;
    if (b != b) return a;
  }
  return a < b ? a : b;
}
template <typename T, int N>
vec<T, N> max(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r[i] = max(a[i], b[i]);
  return r;
}
template <typename T, int N>
vec<T, N> min(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r[i] = min(a[i], b[i]);
  return r;
}
template <typename T>
T max3(T a, T b, T c) {
  return max(max(a, b), c);
}
template <typename T>
T min3(T a, T b, T c) {
  return min(min(a, b), c);
}
template <typename T>
T clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}
template <typename T, int N>
vec<T, N> clamp(const vec<T, N>& x, const vec<T, N>& lo, const vec<T, N>& hi) {
  return min(max(x, lo), hi);
}
template <typename T, int N>
vec<T, N> clamp(const vec<T, N>& x, T lo, T hi) {
  return min(max(x, vec<T, N>(lo)), vec<T, N>(hi));
}
template <typename T>
T saturate(T x) {
  return clamp(x, T(0), T(1));
}

inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline half fma(half a, half b, half c) { return half(std::fma(float(a), float(b), float(c))); }
inline bfloat fma(bfloat a, bfloat b, bfloat c) {
  return bfloat(std::fma(float(a), float(b), float(c)));
}
template <typename T, int N>
vec<T, N> fma(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r[i] = fma(a[i], b[i], c[i]);
  return r;
}
template <typename T>
T mix(T x, T y, T a) {
  return x + (y - x) * a;
}

template <typename T>
T select(T a, T b, bool c) {
  return c ? b : a;
}
template <typename T, int N>
vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r[i] = c[i] ? b[i] : a[i];
  return r;
}

template <typename T>
bool isnan(T x) {
  return float(x) != float(x);
}
template <typename T>
bool isinf(T x) {
  return std::isinf(float(x));
}
template <typename T>
bool isfinite(T x) {
  return std::isfinite(float(x));
}
template <typename T>
bool signbit(T x) {
  return std::signbit(float(x));
}

template <typename T, int N>
T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = a[0] * b[0];
  for (int i = 1; i < N; i++) s += a[i] * b[i];
  return s;
}
template <int N>
bool all(const vec<bool, N>& v) {
  for (int i = 0; i < N; i++)
    if (!v[i]) return false;
  return true;
}
template <int N>
bool any(const vec<bool, N>& v) {
  for (int i = 0; i < N; i++)
    if (v[i]) return true;
  return false;
}
inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }

template <typename T>
T popcount(T x) {
  return T(__builtin_popcountll(static_cast<unsigned long long>(std::make_unsigned_t<T>(x))));
}
// Leading / trailing zero bits of the value's own width (the width for 0).
template <typename T>
T clz(T x) {
  using U = std::make_unsigned_t<T>;
  constexpr int bits = 8 * sizeof(T);
  if (U(x) == 0) return T(bits);
  return T(__builtin_clzll(static_cast<unsigned long long>(U(x))) - (64 - bits));
}
template <typename T>
T ctz(T x) {
  using U = std::make_unsigned_t<T>;
  return U(x) == 0 ? T(8 * sizeof(T)) : T(__builtin_ctzll(static_cast<unsigned long long>(U(x))));
}
template <typename T>
T median3(T a, T b, T c) {
  return max(min(a, b), min(max(a, b), c));
}
template <typename T>
T fmax3(T a, T b, T c) {
  return fmax(fmax(a, b), c);
}
template <typename T>
T fmin3(T a, T b, T c) {
  return fmin(fmin(a, b), c);
}
template <typename T>
T fmedian3(T a, T b, T c) {
  return median3(a, b, c);
}
template <typename T>
T step(T edge, T x) {
  return x < edge ? T(0) : T(1);
}

// Apple's fast:: variants trade accuracy for speed; the emulation uses the
// precise functions for both (fast-math accuracy is not emulated).
namespace precise {
using metal::abs;
using metal::ceil;
using metal::cos;
using metal::divide;
using metal::exp;
using metal::exp2;
using metal::fabs;
using metal::floor;
using metal::fmax;
using metal::fmin;
using metal::log;
using metal::log2;
using metal::max;
using metal::min;
using metal::pow;
using metal::rsqrt;
using metal::sin;
using metal::sqrt;
using metal::tanh;
}  // namespace precise
namespace fast {
using namespace metal::precise;
}  // namespace fast

}  // namespace metal
