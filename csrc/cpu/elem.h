// Element types of the CPU head's operands and their conversions to and from fp32.
#pragma once

#include <cstdint>
#include <cstring>

namespace flash_cce::cpu {

enum class Elem { f32, bf16, f16 };

// IEEE binary16: _Float16, or on Arm with GCC before 13 (no _Float16 in C++)
// the equivalent __fp16 storage type.
#if defined(__aarch64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
using half = __fp16;
#else
using half = _Float16;
#endif

template <Elem E>
inline float load(const void* p, int64_t i) {
  if constexpr (E == Elem::f32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (E == Elem::bf16) {
    uint32_t bits = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  } else {
    return static_cast<float>(static_cast<const half*>(p)[i]);
  }
}

inline float load(const void* p, Elem e, int64_t i) {
  switch (e) {
    case Elem::bf16:
      return load<Elem::bf16>(p, i);
    case Elem::f16:
      return load<Elem::f16>(p, i);
    default:
      return load<Elem::f32>(p, i);
  }
}

inline void store(void* p, Elem e, int64_t i, float v) {
  switch (e) {
    case Elem::bf16: {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      bits += 0x7fff + ((bits >> 16) & 1); // round to nearest even
      static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(bits >> 16);
      break;
    }
    case Elem::f16:
      static_cast<half*>(p)[i] = static_cast<half>(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
  }
}

} // namespace flash_cce::cpu
