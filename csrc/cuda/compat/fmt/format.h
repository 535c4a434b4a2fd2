// MLX's CUDA headers include <fmt/format.h> for error messages, but the wheel
// does not ship {fmt}. This stand-in is used only when {fmt} is not installed:
// it returns the format string followed by the arguments.
#pragma once

#include <sstream>
#include <string>

namespace fmt {

template <class... Args>
std::string format(const char* pattern, const Args&... args) {
  std::ostringstream os;
  os << pattern;
  ((os << ' ' << args), ...);
  return os.str();
}

} // namespace fmt
