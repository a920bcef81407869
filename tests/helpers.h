// Shared test helpers: building tensors from values and comparing them.
#pragma once

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include <doctest/doctest.h>
#include <ruda/nn.h>
#include <ruda/ruda.h>

namespace ruda::test {

inline Tensor values(const std::vector<double>& v, const Shape& shape, DType dtype = DType::f32) {
  return from_values(v, shape, Options(dtype));
}

/// Checks shape and every element within atol + rtol * |expected|; reports the first mismatch.
inline void check_close(const Tensor& actual, const std::vector<double>& expected, const Shape& shape,
                        double atol = 1e-6, double rtol = 1e-5) {
  REQUIRE(actual.defined());
  CHECK_MESSAGE(actual.shape() == shape, "shape " << to_string(actual.shape()) << " != " << to_string(shape));
  const std::vector<double> got = actual.to_vector<double>();
  REQUIRE(got.size() == expected.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    const bool same_nan = std::isnan(got[i]) && std::isnan(expected[i]);
    const bool close =
        same_nan || got[i] == expected[i] || std::abs(got[i] - expected[i]) <= atol + rtol * std::abs(expected[i]);
    if (!close) {
      FAIL_CHECK("element " << i << ": got " << got[i] << ", expected " << expected[i]);
      return;
    }
  }
}

inline void check_close(const Tensor& actual, const Tensor& expected, double atol = 1e-6, double rtol = 1e-5) {
  check_close(actual, expected.to_vector<double>(), expected.shape(), atol, rtol);
}

/// Runs f and checks that it throws E whose message contains every fragment.
template <class E, class F>
void check_throws(F&& f, const std::vector<std::string>& fragments) {
  try {
    f();
    FAIL_CHECK("no exception thrown");
  } catch (const E& e) {
    const std::string message = e.what();
    for (const auto& fragment : fragments) {
      CHECK_MESSAGE(message.find(fragment) != std::string::npos,
                    "message '" << message << "' lacks '" << fragment << "'");
    }
  }
}

/// A fresh directory under the system temp directory, removed with everything in it at scope end.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    path = std::filesystem::temp_directory_path() /
           ("ruda-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  // Never throws: a destructor that threw while a failed check unwound (a file left read-only,
  // say) would end the whole test binary and lose the failure's report.
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  static int& counter() {
    static int c = 0;
    return c;
  }
  std::string str() const { return path.string(); }
  /// The path of `name` in the directory, as a string (for command lines).
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

/// The names in `dir` that are temporary files of an atomic write (name.tmp-XXXXXX, or the fixed
/// name.tmp of earlier versions): none should outlive a write, failed or not.
inline std::vector<std::string> temporaries_in(const std::filesystem::path& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.find(".tmp") != std::string::npos) out.push_back(name);
  }
  return out;
}

/// The whole content of a file ("" if it cannot be read).
inline std::string file_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

/// The names of the entries of `dir`.
inline std::set<std::string> names_in(const std::filesystem::path& dir) {
  std::set<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) names.insert(e.path().filename().string());
  return names;
}

}  // namespace ruda::test

/// check_close that reports the caller's line on failure.
#define CHECK_CLOSE(...)                      \
  do {                                        \
    INFO("CHECK_CLOSE at line " << __LINE__); \
    ::ruda::test::check_close(__VA_ARGS__);   \
  } while (0)
