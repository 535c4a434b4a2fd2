// Runner of the tests registered through minitest's gtest.h: runs them in
// registration order and prints GoogleTest's progress and summary lines.
// `--gtest_filter=Suite.Name` (or a prefix ending in `*`) selects tests.
#include <chrono>
#include <cstdio>
#include <exception>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace testing {
namespace {

struct Entry {
  std::string suite, name;
  void (*body)();
  std::string full() const { return suite + "." + name; }
};

std::vector<Entry>& registry() {
  static std::vector<Entry> tests;
  return tests;
}

bool g_failed = false;

bool selected(const std::string& name, const std::string& filter) {
  if (filter.empty() || filter == "*") {
    return true;
  }
  if (filter.back() == '*') {
    return name.compare(0, filter.size() - 1, filter, 0, filter.size() - 1) == 0;
  }
  return name == filter;
}

const char* plural(size_t n, const char* one, const char* many) {
  return n == 1 ? one : many;
}

} // namespace

int register_test(const char* suite, const char* name, void (*body)()) {
  registry().push_back({suite, name, body});
  return 0;
}

void internal::Failure::operator=(const Message& m) const {
  g_failed = true;
  const std::string extra = m.str();
  std::printf("%s:%d: Failure\n%s%s%s\n", file_, line_, what_.c_str(),
              extra.empty() ? "" : "\n", extra.c_str());
}

} // namespace testing

int main(int argc, char** argv) {
  using clock = std::chrono::steady_clock;
  std::string filter;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const std::string key = "--gtest_filter=";
    if (arg.compare(0, key.size(), key) == 0) {
      filter = arg.substr(key.size());
    }
  }
  std::vector<testing::Entry> run;
  std::set<std::string> suites;
  for (const auto& t : testing::registry()) {
    if (testing::selected(t.full(), filter)) {
      run.push_back(t);
      suites.insert(t.suite);
    }
  }
  std::printf("[==========] Running %zu %s from %zu test %s.\n", run.size(),
              testing::plural(run.size(), "test", "tests"), suites.size(),
              testing::plural(suites.size(), "suite", "suites"));
  std::vector<std::string> failed;
  const auto start = clock::now();
  for (const auto& t : run) {
    std::printf("[ RUN      ] %s\n", t.full().c_str());
    std::fflush(stdout);
    testing::g_failed = false;
    const auto t0 = clock::now();
    try {
      t.body();
    } catch (const std::exception& e) {
      testing::g_failed = true;
      std::printf("uncaught exception: %s\n", e.what());
    } catch (...) {
      testing::g_failed = true;
      std::printf("uncaught exception of unknown type\n");
    }
    const long long ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(clock::now() - t0).count();
    std::printf("%s %s (%lld ms)\n", testing::g_failed ? "[  FAILED  ]" : "[       OK ]",
                t.full().c_str(), ms);
    if (testing::g_failed) {
      failed.push_back(t.full());
    }
  }
  const long long total =
      std::chrono::duration_cast<std::chrono::milliseconds>(clock::now() - start).count();
  std::printf("[==========] %zu %s from %zu test %s ran. (%lld ms total)\n", run.size(),
              testing::plural(run.size(), "test", "tests"), suites.size(),
              testing::plural(suites.size(), "suite", "suites"), total);
  const size_t passed = run.size() - failed.size();
  std::printf("[  PASSED  ] %zu %s.\n", passed, testing::plural(passed, "test", "tests"));
  if (!failed.empty()) {
    std::printf("[  FAILED  ] %zu %s, listed below:\n", failed.size(),
                testing::plural(failed.size(), "test", "tests"));
    for (const auto& f : failed) {
      std::printf("[  FAILED  ] %s\n", f.c_str());
    }
  }
  return failed.empty() ? 0 : 1;
}
