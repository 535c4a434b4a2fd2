// Replaces MLX's complex.h, whose per-address-space overloads collide once
// the address spaces are empty macros. The emulation supports no complex
// kernels; steel only names complex64_t in type comparisons.
#pragma once

#include <metal_stdlib>

template <typename T>
struct complex_t {
  T real;
  T imag;
  constexpr complex_t(T r, T i) : real(r), imag(i) {}
};

typedef complex_t<float> complex64_t;
