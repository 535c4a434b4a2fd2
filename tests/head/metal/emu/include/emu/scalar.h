// MSL scalar types on the CPU: half and bfloat as 16-bit storage structs that
// round every operation's float result back to their own precision (as a GPU
// does for half arithmetic), plus MSL's short integer type names.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef uint64_t ulong;

namespace emu {

// float <-> IEEE binary16 bits, round to nearest even (constexpr: MLX's
// Limits<half> are constexpr members).
constexpr uint16_t float_to_half_bits(float f) {
  uint32_t x = __builtin_bit_cast(uint32_t, f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t exp = (x >> 23) & 0xffu;
  uint32_t man = x & 0x7fffffu;
  if (exp == 0xffu)  // inf or nan (nan keeps a payload bit)
    return uint16_t(sign | 0x7c00u | (man ? 0x200u | (man >> 13) : 0u));
  int e = int(exp) - 127 + 15;
  if (e >= 31) return uint16_t(sign | 0x7c00u);
  if (e <= 0) {  // subnormal half or zero
    if (e < -10) return uint16_t(sign);
    man |= 0x800000u;
    int shift = 14 - e;
    uint32_t h = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1u);
    uint32_t half_way = 1u << (shift - 1);
    if (rem > half_way || (rem == half_way && (h & 1u))) h++;
    return uint16_t(sign | h);
  }
  uint32_t h = (uint32_t(e) << 10) | (man >> 13);
  uint32_t rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;  // may carry into inf
  return uint16_t(sign | h);
}

constexpr float half_bits_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return __builtin_bit_cast(float, sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return __builtin_bit_cast(float, sign);
    float v = float(man) * (1.0f / 16777216.0f);  // man * 2^-24
    return sign ? -v : v;
  }
  return __builtin_bit_cast(float, sign | ((exp + 112u) << 23) | (man << 13));
}

constexpr uint16_t float_to_bfloat_bits(float f) {
  uint32_t x = __builtin_bit_cast(uint32_t, f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);  // nan
  x += 0x7fffu + ((x >> 16) & 1u);
  return uint16_t(x >> 16);
}

constexpr float bfloat_bits_to_float(uint16_t b) {
  return __builtin_bit_cast(float, uint32_t(b) << 16);
}

template <typename T>
constexpr T from_bits(uint16_t b) {
  return __builtin_bit_cast(T, b);
}

}  // namespace emu

#if defined(EMU_TYPECHECK) && __clang_major__ >= 15
// The type-check build (compiled, never run) uses clang's own 16-bit types, so
// that values of them in device or threadgroup memory behave as scalars.
typedef _Float16 half;
typedef __bf16 bfloat;
#else
// MSL lets float and integers convert implicitly to half.
struct half {
  uint16_t bits;
  half() = default;
  constexpr half(float f) : bits(emu::float_to_half_bits(f)) {}
  template <typename U, typename = std::enable_if_t<std::is_arithmetic<U>::value>>
  constexpr half(U u) : bits(emu::float_to_half_bits(float(u))) {}
  constexpr operator float() const { return emu::half_bits_to_float(bits); }
};

// MSL: "neither float nor half can be implicitly converted to bfloat"; the
// constructor is explicit so that the emulation rejects what Apple's compiler
// rejects.
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  template <typename U, typename = std::enable_if_t<std::is_arithmetic<U>::value>>
  constexpr explicit bfloat(U u) : bits(emu::float_to_bfloat_bits(float(u))) {}
  constexpr explicit bfloat(half h) : bfloat(float(h)) {}
  constexpr operator float() const { return emu::bfloat_bits_to_float(bits); }
};

#endif

namespace emu {

template <typename T>
struct is_low_fp : std::false_type {};
template <>
struct is_low_fp<half> : std::true_type {};
template <>
struct is_low_fp<bfloat> : std::true_type {};

// Result type of a binary operation with at least one half/bfloat operand:
// an integer operand converts to the 16-bit type, a float/double operand wins.
template <typename A, typename B, typename = void>
struct low_fp_result {};
template <typename A>
struct low_fp_result<A, A, std::enable_if_t<is_low_fp<A>::value>> {
  using type = A;
};
template <typename A, typename B>
struct low_fp_result<A, B, std::enable_if_t<is_low_fp<A>::value && std::is_integral<B>::value>> {
  using type = A;
};
template <typename A, typename B>
struct low_fp_result<A, B, std::enable_if_t<std::is_integral<A>::value && is_low_fp<B>::value>> {
  using type = B;
};
template <typename A, typename B>
struct low_fp_result<A, B,
                     std::enable_if_t<is_low_fp<A>::value && std::is_floating_point<B>::value>> {
  using type = B;
};
template <typename A, typename B>
struct low_fp_result<A, B,
                     std::enable_if_t<std::is_floating_point<A>::value && is_low_fp<B>::value>> {
  using type = A;
};
template <typename A, typename B>
using low_fp_result_t = typename low_fp_result<A, B>::type;

template <typename T>
constexpr auto widen(T v) {
  if constexpr (is_low_fp<T>::value)
    return float(v);
  else
    return v;
}

}  // namespace emu

#if !(defined(EMU_TYPECHECK) && __clang_major__ >= 15)
#define EMU_LOW_FP_BINOP(op)                                                        \
  template <typename A, typename B, typename R = emu::low_fp_result_t<A, B>>        \
  constexpr R operator op(A a, B b) {                                               \
    return R(emu::widen(a) op emu::widen(b));                                       \
  }                                                                                 \
  template <typename A, typename B, typename = std::enable_if_t<emu::is_low_fp<A>::value>, \
            typename = emu::low_fp_result_t<A, B>>                                  \
  constexpr A& operator op##=(A & a, B b) {                                         \
    a = A(emu::widen(a) op emu::widen(b));                                          \
    return a;                                                                       \
  }
EMU_LOW_FP_BINOP(+)
EMU_LOW_FP_BINOP(-)
EMU_LOW_FP_BINOP(*)
EMU_LOW_FP_BINOP(/)
#undef EMU_LOW_FP_BINOP

#define EMU_LOW_FP_CMP(op)                                                   \
  template <typename A, typename B, typename = emu::low_fp_result_t<A, B>>   \
  constexpr bool operator op(A a, B b) {                                     \
    return emu::widen(a) op emu::widen(b);                                   \
  }
EMU_LOW_FP_CMP(==)
EMU_LOW_FP_CMP(!=)
EMU_LOW_FP_CMP(<)
EMU_LOW_FP_CMP(<=)
EMU_LOW_FP_CMP(>)
EMU_LOW_FP_CMP(>=)
#undef EMU_LOW_FP_CMP

template <typename A, typename = std::enable_if_t<emu::is_low_fp<A>::value>>
constexpr A operator-(A a) {
  return emu::from_bits<A>(uint16_t(a.bits ^ 0x8000u));
}
template <typename A, typename = std::enable_if_t<emu::is_low_fp<A>::value>>
constexpr A operator+(A a) {
  return a;
}
template <typename A, typename = std::enable_if_t<emu::is_low_fp<A>::value>>
constexpr A& operator++(A& a) {
  return a += 1;
}
template <typename A, typename = std::enable_if_t<emu::is_low_fp<A>::value>>
constexpr A& operator--(A& a) {
  return a -= 1;
}

#endif

// MSL's literal suffixes: 1.0h (half), 1.0bf (bfloat).
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wuser-defined-literals"
constexpr half operator"" h(long double v) { return half(float(v)); }
constexpr half operator"" h(unsigned long long v) { return half(float(v)); }
constexpr bfloat operator"" bf(long double v) { return bfloat(float(v)); }
constexpr bfloat operator"" bf(unsigned long long v) { return bfloat(float(v)); }
#pragma clang diagnostic pop
