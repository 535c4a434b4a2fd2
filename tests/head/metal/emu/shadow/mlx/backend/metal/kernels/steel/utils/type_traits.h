// Replaces steel's type_traits.h: its pointer_element specialisations, one
// per address space, become duplicates when the address spaces are empty
// macros (the run build).
#pragma once

#include <metal_stdlib>

namespace metal {

template <typename T>
struct is_empty : metal::bool_constant<__is_empty(T)> {};
template <typename T>
constexpr bool is_empty_v = is_empty<T>::value;

template <typename... Ts>
struct make_void {
  typedef void type;
};
template <typename... Ts>
using void_t = typename make_void<Ts...>::type;

template <class T>
struct is_static : metal::bool_constant<is_empty<remove_cv_t<T>>::value> {};

template <typename T>
struct pointer_element {};
template <typename T>
struct pointer_element<T*> {
  using type = remove_cv_t<T>;
};
#ifdef EMU_TYPECHECK
template <typename T>
struct pointer_element<device T*> {
  using type = remove_cv_t<T>;
};
template <typename T>
struct pointer_element<constant T*> {
  using type = remove_cv_t<T>;
};
template <typename T>
struct pointer_element<threadgroup T*> {
  using type = remove_cv_t<T>;
};
#endif

template <typename T>
using pointer_element_t = typename pointer_element<remove_cv_t<T>>::type;

}  // namespace metal
