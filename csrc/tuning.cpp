#include "tuning.h"

#include <stdexcept>

namespace flash_cce {

namespace {

struct Field {
  const char* key;
  bool HeadTuning::*flag;    // kernel families
  int64_t HeadTuning::*size; // launch sizes
};

const Field kFields[] = {
    {"wgmma", &HeadTuning::wgmma, nullptr},
    {"quant_rs", &HeadTuning::quant_rs, nullptr},
    {"gather_targets", &HeadTuning::gather_targets, nullptr},
    {"row_block", nullptr, &HeadTuning::row_block},
    {"vocab_chunk", nullptr, &HeadTuning::vocab_chunk},
    {"chunk_mb", nullptr, &HeadTuning::chunk_mb},
    {"fwd_l2_mb", nullptr, &HeadTuning::fwd_l2_mb},
    {"dh_splits", nullptr, &HeadTuning::dh_splits},
    {"num_threads", nullptr, &HeadTuning::num_threads},
};

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("[flash_cce] " + msg);
}

} // namespace

const std::vector<std::string>& tuning_keys() {
  static const std::vector<std::string> keys = [] {
    std::vector<std::string> k;
    for (const auto& f : kFields) {
      k.push_back(f.key);
    }
    return k;
  }();
  return keys;
}

void set_tuning(HeadTuning& t, const std::string& key, int64_t value, bool is_bool) {
  for (const auto& f : kFields) {
    if (key != f.key) {
      continue;
    }
    if (f.flag) {
      if (!is_bool) {
        fail("tuning['" + key + "'] must be True or False, got " + std::to_string(value));
      }
      t.*f.flag = value != 0;
    } else {
      if (is_bool || value < 0) {
        fail("tuning['" + key + "'] must be an integer >= 1 (or 0 / None for the default), got " +
             (is_bool ? std::string(value ? "True" : "False") : std::to_string(value)));
      }
      t.*f.size = value;
    }
    return;
  }
  std::string allowed;
  for (const auto& k : tuning_keys()) {
    allowed += (allowed.empty() ? "" : ", ") + k;
  }
  fail("unknown tuning key '" + key + "'; allowed: " + allowed);
}

std::vector<TuningItem> tuning_items(const HeadTuning& t) {
  std::vector<TuningItem> items;
  for (const auto& f : kFields) {
    items.push_back({f.key, f.flag ? int64_t(t.*f.flag) : t.*f.size, f.flag != nullptr});
  }
  return items;
}

void check_tuning(const HeadTuning& t) {
  for (const auto& f : kFields) {
    if (f.size && t.*f.size < 0) {
      fail(std::string("tuning.") + f.key + " must be >= 0 (0: the default), got " +
           std::to_string(t.*f.size));
    }
  }
}

} // namespace flash_cce
