// Option bounds for ruda's command-line programs, stated in words rather than CLI11's range text.
#pragma once

#include <limits>
#include <sstream>
#include <string>

#include <CLI/CLI.hpp>

namespace ruda::cli {

// Bounds stated in words, not CLI11's range text: "--unsharded-groups: must be at least 1 (1 keeps
// only the computing group unsharded), got 0". The help shows them in the option's own text.
inline std::string number_text(double value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

inline CLI::Validator bounded(double low, double high, bool low_open, std::string note = {}) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        double value = 0;
        if (!CLI::detail::lexical_cast(text, value)) return "must be a number, got '" + text + "'";
        const std::string why = note.empty() ? "" : " (" + note + ")";
        if (low_open ? !(value > low) : !(value >= low)) {
          return (low_open ? "must be greater than " : "must be at least ") + number_text(low) + why + ", got " + text;
        }
        if (value > high) {
          return "must be between " + number_text(low) + " and " + number_text(high) + why + ", got " + text;
        }
        return {};
      },
      "");
}
inline constexpr double kNoBound = std::numeric_limits<double>::infinity();
inline CLI::Validator at_least(double low, std::string note = {}) {
  return bounded(low, kNoBound, false, std::move(note));
}
inline CLI::Validator positive() { return bounded(0, kNoBound, true); }
inline CLI::Validator between(double low, double high) { return bounded(low, high, false); }

}  // namespace ruda::cli
