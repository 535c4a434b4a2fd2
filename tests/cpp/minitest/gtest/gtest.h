// The subset of GoogleTest's interface that the C++ kernel tests use (TEST,
// EXPECT_* / ASSERT_* with streamed messages), with a runner that prints
// GoogleTest's summary lines. Built in place of GoogleTest when CMake does not
// find it, so that the kernel tests run on a machine with only a compiler.
#pragma once

#include <cmath>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

namespace testing {

// Registers a test body under "Suite.Name"; returns a dummy for static init.
int register_test(const char* suite, const char* name, void (*body)());

namespace internal {

// The message streamed after an assertion (`EXPECT_EQ(a, b) << "at " << i`).
class Message {
 public:
  template <class T>
  Message& operator<<(const T& v) {
    out_ << v;
    return *this;
  }
  std::string str() const { return out_.str(); }

 private:
  std::ostringstream out_;
};

// A failed check: reported (and the running test marked failed) once the
// streamed message is attached by operator=.
class Failure {
 public:
  Failure(const char* file, int line, std::string what)
      : file_(file), line_(line), what_(std::move(what)) {}
  void operator=(const Message& m) const;

 private:
  const char* file_;
  int line_;
  std::string what_;
};

// Outcome of a comparison; `text` describes a failure.
struct Result {
  bool ok;
  std::string text;
  explicit operator bool() const { return ok; }
};

template <class T>
std::string show(const T& v) {
  std::ostringstream s;
  s.precision(std::is_floating_point_v<T> ? 9 : 6);
  if constexpr (std::is_same_v<T, bool>) {
    s << (v ? "true" : "false");
  } else if constexpr (std::is_enum_v<T>) {
    s << static_cast<long long>(v);
  } else if constexpr (requires { v.begin(); v.end(); } && !std::is_convertible_v<T, std::string>) {
    // containers, as GoogleTest prints them: { a, b }
    s << "{ ";
    bool first = true;
    for (const auto& x : v) {
      s << (first ? "" : ", ") << show(x);
      first = false;
    }
    s << " }";
  } else {
    s << v;
  }
  return s.str();
}

template <class A, class B, class Op>
Result compare(const char* op_text, const char* a_text, const char* b_text, const A& a,
               const B& b, Op op) {
  if (op(a, b)) {
    return {true, {}};
  }
  return {false, std::string("expected ") + a_text + " " + op_text + " " + b_text +
                     ", got " + show(a) + " vs " + show(b)};
}

inline Result near(const char* a_text, const char* b_text, const char* tol_text, double a,
                   double b, double tol) {
  const double diff = std::fabs(a - b);
  if (diff <= tol) { // false for NaN
    return {true, {}};
  }
  std::ostringstream s;
  s.precision(9);
  s << "|" << a_text << " - " << b_text << "| = " << diff << " exceeds " << tol_text << " = "
    << tol << " (" << a << " vs " << b << ")";
  return {false, s.str()};
}

inline Result truth(const char* text, bool value, bool expected) {
  if (value == expected) {
    return {true, {}};
  }
  return {false, std::string("expected ") + text + " to be " + (expected ? "true" : "false")};
}

} // namespace internal
} // namespace testing

#define FLASH_CCE_TEST_NAME_(suite, name) suite##_##name##_Test

#define TEST(suite, name)                                                               \
  static void FLASH_CCE_TEST_NAME_(suite, name)();                                      \
  [[maybe_unused]] static const int FLASH_CCE_TEST_NAME_(suite, name##_registered) =    \
      ::testing::register_test(#suite, #name, &FLASH_CCE_TEST_NAME_(suite, name));      \
  static void FLASH_CCE_TEST_NAME_(suite, name)()

// `on_fail` is empty for EXPECT_* (the test goes on) and `return` for ASSERT_*
// (the enclosing void function ends). The switch keeps a following `else`
// from binding to the hidden if.
#define FLASH_CCE_CHECK_(result, on_fail)                                               \
  switch (0)                                                                            \
  case 0:                                                                               \
  default:                                                                              \
    if (const ::testing::internal::Result flash_cce_r_ = (result)) {                    \
    } else                                                                              \
      on_fail ::testing::internal::Failure(__FILE__, __LINE__, flash_cce_r_.text) =     \
          ::testing::internal::Message()

#define FLASH_CCE_CMP_(op, a, b, on_fail)                                               \
  FLASH_CCE_CHECK_(::testing::internal::compare(                                        \
                       #op, #a, #b, (a), (b),                                           \
                       [](const auto& x, const auto& y) { return x op y; }),            \
                   on_fail)

#define EXPECT_EQ(a, b) FLASH_CCE_CMP_(==, a, b, )
#define EXPECT_NE(a, b) FLASH_CCE_CMP_(!=, a, b, )
#define EXPECT_LT(a, b) FLASH_CCE_CMP_(<, a, b, )
#define EXPECT_LE(a, b) FLASH_CCE_CMP_(<=, a, b, )
#define EXPECT_GT(a, b) FLASH_CCE_CMP_(>, a, b, )
#define EXPECT_GE(a, b) FLASH_CCE_CMP_(>=, a, b, )
#define ASSERT_EQ(a, b) FLASH_CCE_CMP_(==, a, b, return)
#define ASSERT_NE(a, b) FLASH_CCE_CMP_(!=, a, b, return)
#define ASSERT_LT(a, b) FLASH_CCE_CMP_(<, a, b, return)
#define ASSERT_LE(a, b) FLASH_CCE_CMP_(<=, a, b, return)
#define ASSERT_GT(a, b) FLASH_CCE_CMP_(>, a, b, return)
#define ASSERT_GE(a, b) FLASH_CCE_CMP_(>=, a, b, return)

#define EXPECT_NEAR(a, b, tol) \
  FLASH_CCE_CHECK_(::testing::internal::near(#a, #b, #tol, (a), (b), (tol)), )
#define ASSERT_NEAR(a, b, tol) \
  FLASH_CCE_CHECK_(::testing::internal::near(#a, #b, #tol, (a), (b), (tol)), return)

#define EXPECT_TRUE(c) FLASH_CCE_CHECK_(::testing::internal::truth(#c, static_cast<bool>(c), true), )
#define EXPECT_FALSE(c) \
  FLASH_CCE_CHECK_(::testing::internal::truth(#c, static_cast<bool>(c), false), )
#define ASSERT_TRUE(c) \
  FLASH_CCE_CHECK_(::testing::internal::truth(#c, static_cast<bool>(c), true), return)
#define ASSERT_FALSE(c) \
  FLASH_CCE_CHECK_(::testing::internal::truth(#c, static_cast<bool>(c), false), return)
