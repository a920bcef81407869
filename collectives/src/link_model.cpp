// The simulated link of emulated ranks: parsing "1GB/s,20us" and the ring's time per collective.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include <ruda/collectives.h>

#include "internal.h"

namespace ruda {

namespace {

[[noreturn]] void bad_link(const std::string& source, const std::string& text, const std::string& why) {
  throw ArgumentError(source + ": '" + text + "' is not a link model (" + why +
                      "; e.g. 1GB/s, 10Gbit/s, 512MiB/s, 100MB/s,20us, or off)");
}

// A number and its unit: "10Gbit/s" -> {10, "Gbit/s"}.
std::pair<double, std::string> number_and_unit(const std::string& text, const std::string& source,
                                               const std::string& whole) {
  // A decimal number (digits, at most one point, an optional exponent): not strtod's whole
  // grammar, which read "0x10GB/s" as 16 GB/s.
  auto digit = [&](std::size_t i) { return i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])); };
  std::size_t used = 0;
  while (digit(used) || (used < text.size() && text[used] == '.')) ++used;
  if (used < text.size() && (text[used] == 'e' || text[used] == 'E')) {
    std::size_t e = used + 1;
    if (e < text.size() && (text[e] == '+' || text[e] == '-')) ++e;
    if (digit(e)) {
      while (digit(e)) ++e;
      used = e;
    }
  }
  const std::string digits = text.substr(0, used);
  if (digits.empty() || !std::isdigit(static_cast<unsigned char>(digits[0])) ||
      std::count(digits.begin(), digits.end(), '.') > 1) {
    bad_link(source, whole, "no non-negative number");
  }
  const double value = std::strtod(digits.c_str(), nullptr);
  if (!std::isfinite(value)) bad_link(source, whole, "no non-negative number");
  std::string unit = text.substr(used);
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.front()))) unit.erase(0, 1);
  return {value, unit};
}

double bandwidth_unit(const std::string& unit) {
  struct Unit {
    const char* name;
    double bytes_per_second;
  };
  static constexpr Unit units[] = {
      {"B/s", 1},
      {"kB/s", 1e3},
      {"KB/s", 1e3},
      {"MB/s", 1e6},
      {"GB/s", 1e9},
      {"KiB/s", 1024.0},
      {"MiB/s", 1048576.0},
      {"GiB/s", 1073741824.0},
      {"bit/s", 1.0 / 8},
      {"kbit/s", 1e3 / 8},
      {"Kbit/s", 1e3 / 8},
      {"Mbit/s", 1e6 / 8},
      {"Gbit/s", 1e9 / 8},
      // Lower case, and tc's own spellings without "/s", as tools/cluster-sim's rates are written
      // (RUDA_OVERLAP_RATES=300mbit,1gbit): the same rate reads the same in both.
      {"mbit/s", 1e6 / 8},
      {"gbit/s", 1e9 / 8},
      {"kbit", 1e3 / 8},
      {"mbit", 1e6 / 8},
      {"gbit", 1e9 / 8},
  };
  for (const auto& u : units) {
    if (unit == u.name) return u.bytes_per_second;
  }
  return 0;
}

double latency_unit(const std::string& unit) {
  if (unit == "ns") return 1;
  if (unit == "us") return 1e3;
  if (unit == "ms") return 1e6;
  if (unit == "s") return 1e9;
  return 0;
}

// Modeled times saturate at ~31 years: a product of a huge size, a slow link and many steps must
// not overflow int64 nanoseconds (llround out of range, or a signed multiply) into the past.
constexpr double kLongestModeledNs = 1e18;

std::chrono::nanoseconds nanoseconds(double seconds) {
  const double ns = std::min(seconds * 1e9, kLongestModeledNs);
  return std::chrono::nanoseconds(static_cast<std::int64_t>(std::llround(std::max(ns, 0.0))));
}

}  // namespace

// `text` without the spaces around it.
static std::string trimmed(const std::string& text) {
  const auto space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  std::size_t begin = 0, end = text.size();
  while (begin < end && space(text[begin])) ++begin;
  while (end > begin && space(text[end - 1])) --end;
  return text.substr(begin, end - begin);
}

LinkModel LinkModel::parse(const std::string& given, const std::string& source) {
  if (given.find('\0') != std::string::npos) bad_link(source, detail::shown_nul(given), "a NUL character inside");
  const std::string text = trimmed(given);  // (" 1GB/s" and "1GB/s, 20us" were refused)
  if (text.empty() || text == "off" || text == "0") return {};
  const std::size_t comma = text.find(',');
  const auto [rate, rate_unit] = number_and_unit(trimmed(text.substr(0, comma)), source, text);
  const double scale = bandwidth_unit(rate_unit);
  if (scale == 0) bad_link(source, text, "unknown bandwidth unit '" + rate_unit + "'");
  if (rate == 0) bad_link(source, text, "a bandwidth of 0 (say 'off' for no link model)");
  LinkModel link;
  link.bytes_per_second = rate * scale;
  if (comma != std::string::npos) {
    const auto [lat, lat_unit] = number_and_unit(trimmed(text.substr(comma + 1)), source, text);
    const double ns = latency_unit(lat_unit);
    if (ns == 0) bad_link(source, text, "unknown latency unit '" + lat_unit + "' (ns, us, ms or s)");
    link.latency = nanoseconds(lat * ns * 1e-9);  // (saturating: 1e20 s reads as ~31 years)
  }
  if (const std::string problem = collectives_detail::link_problem(link); !problem.empty()) {
    bad_link(source, text, problem);
  }
  return link;
}

namespace collectives_detail {
std::string link_problem(const LinkModel& link) {
  if (link.bytes_per_second != 0 && !std::isfinite(link.bytes_per_second)) return "a bandwidth that is not finite";
  if (link.bytes_per_second != 0 && !(link.bytes_per_second >= 1.0 / 8)) return "a bandwidth below 1 bit/s";
  if (link.latency.count() < 0) return "a negative latency";
  if (link.latency > std::chrono::hours(1)) return "a latency above 1 hour";
  return {};
}
}  // namespace collectives_detail

LinkModel LinkModel::from_env() {
  const char* env = std::getenv("RUDA_EMULATE_LINK");
  return env ? parse(env, "RUDA_EMULATE_LINK") : LinkModel{};
}

// A ring of `world` ranks: each of the world - 1 steps sends one message of `step_bytes` per
// link, all links at once.
static std::chrono::nanoseconds ring(const LinkModel& link, int world, int steps_per_rank, double step_bytes) {
  if (!link.enabled() || world <= 1) return std::chrono::nanoseconds(0);
  const double steps = static_cast<double>(steps_per_rank) * (world - 1);
  return nanoseconds(steps * step_bytes / link.bytes_per_second +
                     steps * static_cast<double>(link.latency.count()) * 1e-9);
}

std::chrono::nanoseconds LinkModel::all_gather_time(int world, std::uint64_t bytes) const {
  return ring(*this, world, 1, static_cast<double>(bytes));
}
std::chrono::nanoseconds LinkModel::reduce_scatter_time(int world, std::uint64_t bytes) const {
  return ring(*this, world, 1, static_cast<double>(bytes));
}
std::chrono::nanoseconds LinkModel::all_reduce_time(int world, std::uint64_t bytes) const {
  return ring(*this, world, 2, static_cast<double>(bytes) / std::max(world, 1));
}
std::chrono::nanoseconds LinkModel::broadcast_time(int world, std::uint64_t bytes) const {
  if (!enabled() || world <= 1) return std::chrono::nanoseconds(0);
  return nanoseconds(static_cast<double>(bytes) / bytes_per_second +
                     static_cast<double>(world - 1) * static_cast<double>(latency.count()) * 1e-9);
}
std::chrono::nanoseconds LinkModel::barrier_time(int world) const { return ring(*this, world, 1, 0); }

std::string LinkModel::describe() const {
  if (!enabled()) return "off";
  // In the unit that shows the rate (a slow link read "0.0 MB/s" in the errors that name it).
  char buf[96];
  const double b = bytes_per_second;
  if (b >= 1e15) {
    std::snprintf(buf, sizeof buf, "%.3g GB/s", b / 1e9);
  } else if (b >= 1e9) {
    std::snprintf(buf, sizeof buf, "%.2f GB/s", b / 1e9);
  } else if (b >= 1e6) {
    std::snprintf(buf, sizeof buf, "%.1f MB/s", b / 1e6);
  } else if (b >= 1e3) {
    std::snprintf(buf, sizeof buf, "%.1f kB/s", b / 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.3g B/s", b);
  }
  std::string out = buf;
  const double ns = static_cast<double>(latency.count());
  if (ns >= 1e6) {
    std::snprintf(buf, sizeof buf, ", %.1f ms latency", ns / 1e6);
    out += buf;
  } else if (ns >= 1e3) {
    std::snprintf(buf, sizeof buf, ", %.1f us latency", ns / 1e3);
    out += buf;
  } else if (ns > 0) {
    std::snprintf(buf, sizeof buf, ", %.0f ns latency", ns);
    out += buf;
  }
  return out;
}

}  // namespace ruda
