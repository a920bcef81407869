// The benchmark harness of tools/bench: suites register themselves, time their work with
// measure(), and report medians (with min and max) as a table row or a JSON line.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ruda::bench {

struct Stats {
  double median = 0, min = 0, max = 0;
};

/// One reported figure. `peer` is the same figure for the reference implementation measured in
/// the same run (raw Eigen, raw oneDNN, raw MPI, PyTorch); the ratio printed is value / peer.
struct Result {
  std::string suite, name, backend, unit;
  Stats value;
  std::optional<Stats> peer;
  std::string peer_name;
};

struct Context {
  std::string backend;  // the backend under test ("eigen", "onednn")
  int repeats = 15;     // timed runs per figure
  bool quick = false;   // fewer repeats (3, unless --repeats is given) and smaller sizes (smoke runs)
  bool repeats_given = false;
  int runs() const { return quick && !repeats_given ? 3 : repeats; }
  std::function<void(const Result&)> report;
};

using Suite = void (*)(Context&);
/// Registers a suite at static-initialization time: `static bool r = register_suite("gemm", run);`
bool register_suite(const char* name, Suite suite);

/// Whether this process prints results (the MPI bench prints from rank 0 only).
extern bool (*should_print)();
/// Says that a suite failed on this process (`message` names the program, suite and cause) and
/// returns the exit status. The MPI bench names the rank and ends the job (MPI_Abort): the other
/// ranks may be waiting in a collective that this one will not join.
extern int (*report_failure)(const std::string& message);

/// Seconds per call of f over ctx.repeats timed runs, after `warmup` untimed ones.
template <class F>
Stats measure(const Context& ctx, F&& f, int warmup = 2) {
  for (int i = 0; i < warmup; ++i) f();
  std::vector<double> seconds;
  const int runs = ctx.runs();
  for (int i = 0; i < runs; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(seconds.begin(), seconds.end());
  const std::size_t n = seconds.size();
  const double median = n % 2 ? seconds[n / 2] : 0.5 * (seconds[n / 2 - 1] + seconds[n / 2]);
  return Stats{median, seconds.front(), seconds.back()};
}

// Times f and g in alternation (f, g, f, g, ...) so that a change of machine load between the
// two does not bias their ratio; seconds per call of each, after `warmup` untimed rounds.
template <class F, class G>
std::pair<Stats, Stats> measure_pair(const Context& ctx, F&& f, G&& g, int warmup = 2) {
  for (int i = 0; i < warmup; ++i) {
    f();
    g();
  }
  std::vector<double> fs, gs;
  const int runs = ctx.runs();
  auto time = [](auto&& h) {
    const auto start = std::chrono::steady_clock::now();
    h();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  for (int i = 0; i < runs; ++i) {
    fs.push_back(time(f));
    gs.push_back(time(g));
  }
  auto stats = [](std::vector<double>& v) {
    std::sort(v.begin(), v.end());
    const std::size_t n = v.size();
    return Stats{n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]), v.front(), v.back()};
  };
  return {stats(fs), stats(gs)};
}

/// Converts seconds per call to a rate (work / seconds): the median of a rate is the rate of the
/// median time; min and max swap.
inline Stats rate(const Stats& seconds, double work) {
  return Stats{work / seconds.median, work / seconds.max, work / seconds.min};
}
inline Stats scaled(const Stats& s, double factor) { return Stats{s.median * factor, s.min * factor, s.max * factor}; }

/// Reports a time against its peer's, both in seconds per call, shown in `unit` ("ms": scale 1e3,
/// "us": scale 1e6).
inline void report_time(Context& ctx, const std::string& suite, const std::string& name, const Stats& ours,
                        const Stats& peer, const std::string& peer_name, const std::string& unit, double scale) {
  Result r;
  r.suite = suite;
  r.name = name;
  r.backend = ctx.backend;
  r.unit = unit;
  r.value = scaled(ours, scale);
  r.peer = scaled(peer, scale);
  r.peer_name = peer_name;
  ctx.report(r);
}

// Collective sizes, shared by the emulated-rank and the MPI collective suites.
/// The total bytes a collective moves in each measured case (4 KiB ... 64 MiB; fewer with --quick),
/// finer around 64 KiB ... 2 MiB, where MPI's reduce-scatter gives way to ruda's ring.
inline std::vector<std::int64_t> collective_totals(const Context& ctx) {
  if (ctx.quick) return {4 << 10, 1 << 20, 16 << 20};
  return {4 << 10, 16 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 16 << 20, 64 << 20};
}
inline std::string size_name(std::int64_t bytes) {
  if (bytes >= (1 << 20)) return std::to_string(bytes >> 20) + "MiB";
  return std::to_string(bytes >> 10) + "KiB";
}
/// Small collectives repeat within one timed run, so that each run lasts long enough to time.
inline int repeats_for(std::int64_t total) { return static_cast<int>(std::max<std::int64_t>(1, (4 << 20) / total)); }

}  // namespace ruda::bench
