// Per-configuration Metal sources: the embedded source (all kernels) cut down
// to the entry points one launch plan uses, so that Metal compiles only those
// (MLX compiles its own JIT kernels the same way, one library per
// configuration, cached for the process). Pure C++: tested on any platform.
#pragma once

#include <set>
#include <string>

namespace flash_cce::metal {

// `source` with every explicit instantiation line
//   template [[host_name("NAME")]] [[kernel]] ...;
// removed unless NAME is in `kernels` (plain [[kernel]] functions stay).
// Throws std::invalid_argument naming the kernels the source lacks.
std::string select_kernels(const std::string& source, const std::set<std::string>& kernels);

// The name MLX caches the library of `kernels` under (one per kernel set).
std::string library_name(const std::set<std::string>& kernels);

} // namespace flash_cce::metal
