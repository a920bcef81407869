// Option bounds for ruda's command-line programs, stated in words rather than CLI11's range text.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <iostream>
#include <limits>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

namespace ruda::cli {

// An error's line: its message, or for a bare std::bad_alloc (a container's or a library's
// allocation outside ruda's allocator, whose what() says only "std::bad_alloc") what it means.
inline std::string error_text(const std::exception& e) {
  return dynamic_cast<const std::bad_alloc*>(&e) ? "out of memory: the system refused an allocation (std::bad_alloc)"
                                                 : e.what();
}

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
        // (inf passed every bound: the open upper one, kNoBound, is itself infinite.)
        if (!std::isfinite(value)) return "must be a finite number, got " + text;
        // Decimal only, as the integer options are: strtod also reads hex (--lr 0x10 was 16).
        if (text.find_first_not_of("0123456789.eE+-") != std::string::npos) {
          return "must be a decimal number, got '" + text + "'";
        }
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

// A text option whose empty value would read as "not given" (--resume "" trained from scratch,
// --checkpoint-dir "" wrote nothing, both silently): an empty value is refused instead.
inline CLI::Validator non_empty() {
  return CLI::Validator(
      [](std::string& text) -> std::string { return text.empty() ? "needs a value, got an empty string" : ""; }, "");
}

// Whole numbers as CLI11 2.1 does not read them: it converts with strtoll/strtoull in base 0, which
// saturates a number out of range (--step 99999999999999999999 became INT64_MAX), wraps a negative
// number into an unsigned option (--seed -1 became 2^64 - 1) and reads a leading 0 as octal
// (--emulate 010 ran 8 ranks). This transform, which every integer option gets (add_whole), takes
// only a decimal whole number that T holds, says so in words otherwise ("--step: must be a whole
// number between -9223372036854775808 and 9223372036854775807, got 99999999999999999999"), and
// hands CLI11 the number as it reads it (no leading zeros, no '+'). The option's bounds
// (at_least, ...) are then checked on that number.
template <class T>
CLI::Validator whole_number() {
  static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>);
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const std::string whole = "must be a whole number between " + std::to_string(std::numeric_limits<T>::min()) +
                                  " and " + std::to_string(std::numeric_limits<T>::max());
        // An optional sign, one only ('+-5' is not -5), then decimal digits.
        const char* first = text.data();
        const char* last = first + text.size();
        const bool plus = first != last && *first == '+';
        const bool negative = !plus && first != last && *first == '-';
        const char* digits = first + (plus || negative ? 1 : 0);
        if (digits == last || !std::all_of(digits, last, [](char c) { return c >= '0' && c <= '9'; }))
          return whole + ", got '" + text + "'";
        T value{};
        if (negative && std::is_unsigned_v<T>) {  // "-0" alone fits
          if (std::any_of(digits, last, [](char c) { return c != '0'; })) return whole + ", got " + text;
        } else if (std::from_chars(negative ? first : digits, last, value).ec == std::errc::result_out_of_range) {
          return whole + ", got " + text;  // (digits only: the one way from_chars can fail)
        }
        text = std::to_string(value);
        return {};
      },
      "");
}

/// For arguments left over after a subcommand's options: the first option among them named as
/// another subcommand's ("--sample is an option of 'lm', not of 'mlp'"), or as none's; "" for
/// other errors. CLI11 listed the leftovers in reverse ("not expected: 3 --sample").
inline std::string misplaced_option(CLI::App& app, const CLI::ParseError& e, const std::string& program) {
  if (!dynamic_cast<const CLI::ExtrasError*>(&e)) return {};
  const auto chosen = app.get_subcommands();
  if (chosen.empty()) return {};
  const CLI::App* sub = chosen.back();
  // (With fallthrough, what the subcommand does not take is left on the app.)
  std::vector<std::string> left = sub->remaining();
  for (const std::string& arg : app.remaining()) left.push_back(arg);
  for (const std::string& arg : left) {
    if (arg.rfind("--", 0) != 0 || arg.size() < 3) continue;
    const std::string name = arg.substr(0, arg.find('='));
    std::string owners;
    for (const CLI::App* other : app.get_subcommands([](const CLI::App*) { return true; })) {
      if (other != sub && other->get_option_no_throw(name))
        owners += (owners.empty() ? "'" : ", '") + other->get_name() + "'";
    }
    const std::string usage = " (see " + program + " " + sub->get_name() + " --help)";
    if (!owners.empty()) return name + " is an option of " + owners + ", not of '" + sub->get_name() + "'" + usage;
    return "'" + sub->get_name() + "' has no option " + name + usage;
  }
  return {};
}

/// Parses the command line as ruda's programs do: --help prints the help, a parse error prints one
/// line "PROGRAM: error: ... (see --help)" on stderr (each only where `print`: rank 0 of an MPI
/// job). Returns the exit code to leave with, 0 after the help and 2 after an error, or nothing
/// when the program goes on. (CLI11_PARSE printed CLI11's own text and exited with its internal
/// codes, 105 or 109.)
inline std::optional<int> parse(CLI::App& app, int argc, char** argv, const std::string& program, bool print = true) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    if (print) std::cout << app.help();
    return 0;
  } catch (const CLI::ParseError& e) {
    if (print) {
      // A word that is no subcommand ("ruda-ckpt lsit") is named, with the valid ones: CLI11 says
      // only "A subcommand is required" (the word went to the remaining arguments).
      const auto subcommands = app.get_subcommands([](const CLI::App*) { return true; });
      const std::vector<std::string> left = app.remaining();
      if (!subcommands.empty() && !left.empty() && !left.front().empty() && left.front()[0] != '-' &&
          app.get_subcommands().empty()) {
        std::string names;
        for (const CLI::App* sub : subcommands) names += (names.empty() ? "" : ", ") + sub->get_name();
        std::cerr << program << ": error: unknown subcommand '" << left.front() << "' (one of: " << names << ")"
                  << std::endl;
      } else if (const std::string misplaced = misplaced_option(app, e, program); !misplaced.empty()) {
        std::cerr << program << ": error: " << misplaced << std::endl;
      } else {
        std::cerr << program << ": error: " << e.what() << " (see --help)" << std::endl;
      }
    }
    return 2;
  }
  return std::nullopt;
}

/// app.add_option for an integer (or a list of integers): the same, with the whole_number transform.
template <class T>
CLI::Option* add_whole(CLI::App& app, std::string name, T& variable, std::string description) {
  return app.add_option(std::move(name), variable, std::move(description))->transform(whole_number<T>());
}
template <class T>
CLI::Option* add_whole(CLI::App& app, std::string name, std::vector<T>& variable, std::string description) {
  return app.add_option(std::move(name), variable, std::move(description))->transform(whole_number<T>());
}

}  // namespace ruda::cli
