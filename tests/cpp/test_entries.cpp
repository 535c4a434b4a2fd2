// The kernels' entry points: the host's table (cuda/entries.h) holds every
// kernel the dispatch can ask for, each defined once in cuda/entries.inc under
// that name.
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "cuda/entries.h"

using flash_cce::cuda::kKernelEntries;

namespace {

bool has(const std::string& family, const std::string& variant) {
  return flash_cce::cuda::find_kernel(family, variant) != nullptr;
}

} // namespace

TEST(Entries, EveryDispatchedKernelIsInTheTable) {
  for (std::string t : {"bf16", "f16"}) {
    for (std::string fam : {"fwd", "ds", "dh", "fwd_ent", "ds_ent"})
      for (std::string q : {"dense", "q4", "q8", "qany"})
        EXPECT_TRUE(has(fam, t + "_" + q)) << fam << " " << t << " " << q;
    for (std::string fam : {"fwd_wg", "ds_wg", "ds_ent_wg", "p_wg", "dh_wg", "target"})
      for (std::string q : {"dense", "q4", "q8"})
        EXPECT_TRUE(has(fam, t + "_" + q)) << fam << " " << t << " " << q;
    for (std::string fam : {"fwd_rs", "p_rs", "dh_rs"})
      for (std::string q : {"q4", "q8"})
        EXPECT_TRUE(has(fam, t + "_" + q)) << fam << " " << t << " " << q;
    EXPECT_TRUE(has("dw", t));
    EXPECT_TRUE(has("dw_wg", t));
  }
  EXPECT_FALSE(has("fwd_rs", "bf16_dense"));
}

TEST(Entries, NamesAreUniqueAndDefinedInEntriesInc) {
  std::ifstream in(FLASH_CCE_CUDA_DIR "/entries.inc");
  ASSERT_TRUE(in.good());
  std::stringstream text;
  text << in.rdbuf();
  const std::string inc = text.str();
  std::set<std::string> names;
  for (const auto& e : kKernelEntries) {
    const std::string name = e.name;
    EXPECT_EQ(name, "fcce_" + std::string(e.family) + "_" + e.variant);
    EXPECT_TRUE(names.insert(name).second) << name;
    const auto at = inc.find(" " + name + "(");
    EXPECT_NE(at, std::string::npos) << name;
    EXPECT_EQ(inc.find(" " + name + "(", at + 1), std::string::npos) << name;
  }
  // One definition a line, none beyond the table.
  size_t kernels = 0;
  for (size_t at = inc.find("__global__"); at != std::string::npos;
       at = inc.find("__global__", at + 1)) {
    ++kernels;
  }
  EXPECT_EQ(kernels, names.size());
}
