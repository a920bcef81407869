#include "stopwatch.h"

#include <fstream>
#include <string>

#if defined(__x86_64__)
#include <cpuid.h>
#include <x86intrin.h>
#endif

namespace ruda::collectives_detail {

namespace {

using Steady = std::chrono::steady_clock;

std::uint64_t steady_ns() noexcept {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Steady::now().time_since_epoch()).count());
}

#if defined(__x86_64__)
// Whether Linux keeps time with the TSC itself: it does only where it found the TSC in step
// across CPUs (a VM whose virtual CPUs' TSCs drift apart gets another clocksource).
bool kernel_trusts_tsc() {
  std::ifstream in("/sys/devices/system/clocksource/clocksource0/current_clocksource");
  std::string source;
  return static_cast<bool>(in >> source) && source == "tsc";
}

// A TSC reading and the steady_clock time it was taken at, from two steady_clock reads at most
// 1 us apart around it: a thread preempted between the reads (a loaded machine) tries again, so
// that no descheduled gap enters the rate. false after 1000 tries.
bool paired_reading(std::uint64_t& ns, std::uint64_t& ticks) noexcept {
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const std::uint64_t before = steady_ns();
    ticks = __rdtsc();
    const std::uint64_t after = steady_ns();
    if (after - before <= 1000) {
      ns = before + (after - before) / 2;
      return true;
    }
  }
  return false;
}
#endif

// The TSC when it ticks at one rate whatever the core's frequency and power state (CPUID
// 0x80000007 EDX bit 8, "invariant TSC") and the kernel keeps time with it, and its rate: ticks
// over ~2 ms of steady_clock between two paired readings (error within 0.1%).
struct Tsc {
  bool usable = false;
  double seconds_per_tick = 0;
  Tsc() {
#if defined(__x86_64__)
    if (!kernel_trusts_tsc()) return;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_max(0x80000000, nullptr) < 0x80000007) return;
    __get_cpuid(0x80000007, &eax, &ebx, &ecx, &edx);
    if (!(edx & (1u << 8))) return;
    std::uint64_t ns0 = 0, t0 = 0, ns1 = 0, t1 = 0;
    if (!paired_reading(ns0, t0)) return;
    while (steady_ns() - ns0 < 2'000'000) {
    }
    if (!paired_reading(ns1, t1) || t1 <= t0 || ns1 <= ns0) return;
    seconds_per_tick = static_cast<double>(ns1 - ns0) * 1e-9 / static_cast<double>(t1 - t0);
    usable = true;
#endif
  }
};

const Tsc& tsc() noexcept {
  static const Tsc calibrated;
  return calibrated;
}

}  // namespace

std::uint64_t Stopwatch::now() noexcept {
#if defined(__x86_64__)
  if (tsc().usable) return __rdtsc();
#endif
  return steady_ns();
}

double Stopwatch::seconds(std::uint64_t from, std::uint64_t to) noexcept {
  const double ticks = to > from ? static_cast<double>(to - from) : 0.0;
  return tsc().usable ? ticks * tsc().seconds_per_tick : ticks * 1e-9;
}

Steady::time_point Stopwatch::to_steady(std::uint64_t reading) noexcept {
  const std::uint64_t now_reading = now();
  const auto since = std::chrono::duration<double>(seconds(reading, now_reading));
  return Steady::now() - std::chrono::duration_cast<Steady::duration>(since);
}

}  // namespace ruda::collectives_detail
