// The exceptions ruda raises for caller errors. Every message names the operation and the
// offending shapes or dtypes, so a failure reads like "matmul: inner dimensions differ: [32, 784] @ [512, 10]".
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace ruda {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
/// Shapes that do not fit the operation (broadcasting, matmul dims, reshape sizes, ...).
class ShapeError : public Error {
 public:
  using Error::Error;
};
/// A dtype the operation does not take, or two dtypes that differ.
class DTypeError : public Error {
 public:
  using Error::Error;
};
/// An axis, index or range outside a tensor.
class IndexError : public Error {
 public:
  using Error::Error;
};
/// Any other invalid argument (a negative probability, an unknown name, ...).
class ArgumentError : public Error {
 public:
  using Error::Error;
};
/// Misuse of automatic differentiation (backward on a non-scalar without a gradient, ...).
class AutogradError : public Error {
 public:
  using Error::Error;
};
/// A backend that is unknown, unavailable or failed.
class BackendError : public Error {
 public:
  using Error::Error;
};
/// Reading or writing files: missing, corrupt, truncated or mismatched data.
class IOError : public Error {
 public:
  using Error::Error;
};
/// An allocation that would take this rank's live tensor bytes over its memory limit
/// (RUDA_MEMORY_LIMIT, memory::set_limit), or that the system refused. The message names the op,
/// the shape and dtype, the bytes requested, the bytes live and the limit.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <class T>
void put(std::ostream& out, const T& part) {
  out << part;
}
// Shapes (and any list of extents) print as [2, 3].
inline void put(std::ostream& out, const std::vector<std::int64_t>& extents) {
  out << '[';
  for (std::size_t i = 0; i < extents.size(); ++i) out << (i ? ", " : "") << extents[i];
  out << ']';
}
/// `text` for a message, a NUL character shown as \0: the message's C string (what()) would end
/// there (paths, tags and link texts that hold one are refused, and named so).
inline std::string shown_nul(std::string_view text) {
  std::string out;
  for (const char c : text) out += c == '\0' ? std::string_view("\\0") : std::string_view(&c, 1);
  return out;
}
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (put(out, parts), ...);
  return out.str();
}
}  // namespace detail

/// Throws E with the message "op: parts...". Parts are anything with operator<< (shapes print as [2, 3]).
template <class E, class... Parts>
[[noreturn]] void fail(std::string_view op, const Parts&... parts) {
  throw E(detail::concat(op, ": ", parts...));
}

/// Enums that enter through the public API are range-checked where they enter: a value that is
/// none of the enumerators (a number cast to the enum, uninitialized memory) raises Error naming
/// the op, never a crash further in. Each checked enum has a `constexpr bool is_valid(E)` beside
/// it, a switch over every enumerator without `default:` (so -Werror=switch makes a new
/// enumerator's author add it), found by argument-dependent lookup. `where` may name the rank.
template <class Error = ArgumentError, class E>
void check_enum(E value, std::string_view op, std::string_view what, std::string_view where = {}) {
  if (!is_valid(value)) {
    fail<Error>(op, where, where.empty() ? "" : ": ", "not a valid ", what, ": ",
                static_cast<long long>(static_cast<std::underlying_type_t<E>>(value)));
  }
}

}  // namespace ruda
