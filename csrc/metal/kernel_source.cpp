#include "kernel_source.h"

#include <stdexcept>

namespace flash_cce::metal {

namespace {

constexpr char kInstantiation[] = "template [[host_name(\"";

} // namespace

std::string select_kernels(const std::string& source, const std::set<std::string>& kernels) {
  std::string out;
  out.reserve(source.size());
  std::set<std::string> found;
  size_t pos = 0;
  while (pos < source.size()) {
    size_t end = source.find('\n', pos);
    end = end == std::string::npos ? source.size() : end + 1;
    const std::string_view line(source.data() + pos, end - pos);
    bool keep = true;
    if (line.rfind(kInstantiation, 0) == 0) {
      const size_t name0 = sizeof(kInstantiation) - 1;
      const size_t name1 = line.find('"', name0);
      const std::string name(line.substr(name0, name1 - name0));
      keep = kernels.count(name) > 0;
      if (keep) {
        found.insert(name);
      }
    }
    if (keep) {
      out.append(line);
    }
    pos = end;
  }
  std::string missing;
  for (const auto& k : kernels) {
    // Plain kernels (fcce_combine, ...) have no instantiation line.
    const bool plain = source.find("void " + k + "(") != std::string::npos;
    if (!found.count(k) && !plain) {
      missing += (missing.empty() ? "" : ", ") + k;
    }
  }
  if (!missing.empty()) {
    throw std::invalid_argument("[flash_cce] the Metal source has no kernel " + missing);
  }
  return out;
}

std::string library_name(const std::set<std::string>& kernels) {
  std::string name = "flash_cce";
  for (const auto& k : kernels) {
    name += ":" + k;
  }
  return name;
}

} // namespace flash_cce::metal
