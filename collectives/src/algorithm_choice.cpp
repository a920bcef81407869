// The choice between MPI's collective and ruda's ring. See algorithm_choice.h.
#include "algorithm_choice.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <string>
#include <vector>

#include <ruda/error.h>
#include <ruda/memory.h>

namespace ruda::collectives_detail {

std::string_view algorithm_name(Algorithm algorithm) noexcept {
  switch (algorithm) {
    case Algorithm::undecided:
      return "unmeasured";
    case Algorithm::library:
      return "mpi";
    case Algorithm::ring:
      return "ring";
  }
  return "unmeasured";
}

int size_class(std::size_t bytes) noexcept { return bytes <= 1 ? 0 : static_cast<int>(std::bit_width(bytes - 1)); }

double median(std::span<const double> samples) {
  if (samples.empty()) return 0;
  std::vector<double> sorted(samples.begin(), samples.end());
  std::sort(sorted.begin(), sorted.end());
  const std::size_t n = sorted.size();
  return n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
}

double best(std::span<const double> samples) {
  return samples.empty() ? 0 : *std::min_element(samples.begin(), samples.end());
}

Timings agree(std::span<const Timings> per_rank) {
  Timings out;
  for (const Timings& t : per_rank) {
    out.ring = std::max(out.ring, t.ring);
    out.library = std::max(out.library, t.library);
  }
  return out;
}

Algorithm choose(const Timings& agreed) noexcept {
  auto usable = [](double s) { return std::isfinite(s) && s > 0; };
  if (!usable(agreed.ring) || !usable(agreed.library)) return Algorithm::library;
  return agreed.ring < agreed.library ? Algorithm::ring : Algorithm::library;
}

Algorithm by_threshold(std::size_t bytes, std::size_t ring_min_bytes) noexcept {
  return bytes <= ring_min_bytes ? Algorithm::library : Algorithm::ring;
}

std::optional<std::size_t> parse_ring_min_bytes(const char* text, std::string_view what) {
  if (!text || !*text) return std::nullopt;
  try {
    return static_cast<std::size_t>(memory::parse_size(text));
  } catch (const ArgumentError&) {
    throw ArgumentError(std::string(what) + ": '" + text +
                        "' is not a size (a number of bytes, or with a unit: 64KiB, 1MB)");
  }
}

std::optional<std::size_t> ring_min_bytes_from_env() {
  return parse_ring_min_bytes(std::getenv("RUDA_RING_MIN_BYTES"), "RUDA_RING_MIN_BYTES");
}

TrialPlan trial_plan(std::size_t bytes) noexcept {
  TrialPlan plan;
  // Samples of at least ~64 KiB moved (a few microseconds), at most 16 calls each.
  constexpr std::size_t kSampleBytes = std::size_t{64} << 10;
  if (bytes > 0 && bytes < kSampleBytes) plan.calls = static_cast<int>(std::min<std::size_t>(16, kSampleBytes / bytes));
  return plan;
}

void AlgorithmChoice::set_threshold(std::optional<std::size_t> ring_min_bytes) noexcept {
  ring_min_bytes_.store(ring_min_bytes.value_or(0), std::memory_order_relaxed);
  fixed_.store(ring_min_bytes.has_value(), std::memory_order_release);
}

std::optional<std::size_t> AlgorithmChoice::threshold() const noexcept {
  if (!fixed_.load(std::memory_order_acquire)) return std::nullopt;
  return static_cast<std::size_t>(ring_min_bytes_.load(std::memory_order_relaxed));
}

Algorithm AlgorithmChoice::lookup(std::size_t bytes) const noexcept {
  if (const std::optional<std::size_t> t = threshold()) return by_threshold(bytes, *t);
  return static_cast<Algorithm>(measured_[static_cast<std::size_t>(size_class(bytes))].load(std::memory_order_acquire));
}

void AlgorithmChoice::record(std::size_t bytes, Algorithm algorithm) noexcept {
  measured_[static_cast<std::size_t>(size_class(bytes))].store(static_cast<std::uint8_t>(algorithm),
                                                               std::memory_order_release);
}

void AlgorithmChoice::reset() noexcept {
  for (std::atomic<std::uint8_t>& m : measured_) m.store(static_cast<std::uint8_t>(Algorithm::undecided));
}

}  // namespace ruda::collectives_detail
