// Which of two algorithms a collective uses at a size: MPI's own or ruda's ring, chosen by timing
// both at the first use of each size class and cached per communicator, unless a threshold
// (RUDA_RING_MIN_BYTES, MpiCommunicator::set_ring_min_bytes) fixes it. The decision logic, without
// MPI: the MPI communicator times the calls and agrees on the timings across ranks (the slowest
// rank's best sample of each algorithm, so every rank reads the same figures and picks the same
// algorithm; ranks that picked differently would wait for each other forever). Internal; it lives
// in ruda_collectives so that tests without MPI (and the ThreadSanitizer build) cover it.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

namespace ruda::collectives_detail {

enum class Algorithm : std::uint8_t {
  undecided,  // not measured yet
  library,    // the MPI library's own collective (MPI_Reduce_scatter_block)
  ring,       // ruda's pipelined ring on point-to-point messages
};
/// "unmeasured", "mpi", "ring".
std::string_view algorithm_name(Algorithm algorithm) noexcept;

/// The size classes: class k holds the sizes in (2^(k-1), 2^k] bytes (0 and 1 byte: class 0), so
/// each power of two is the top of its own class.
inline constexpr int kSizeClasses = 65;
int size_class(std::size_t bytes) noexcept;

/// The median of samples (the mean of the middle two for an even count); 0 for none.
double median(std::span<const double> samples);
/// What a rank reports for one algorithm: the best (smallest) of its samples. On a shared machine
/// load only ever adds time, and with three to five samples a median still moved with it here
/// (MPI's algorithm won at 16 MiB on one run in two); the fastest sample is the algorithm's own cost.
double best(std::span<const double> samples);

/// What both algorithms cost: seconds per call (a rank's best samples, or the agreed figures).
struct Timings {
  double ring = 0;
  double library = 0;
};
/// The figures every rank uses: the largest (slowest rank's) of each, elementwise. Over MPI this
/// is one MPI_Allreduce(MPI_MAX) of the two numbers.
Timings agree(std::span<const Timings> per_rank);
/// The ring where it is faster on the agreed figures, else MPI's own (ties, and figures that are
/// not finite and positive, go to MPI's, which needs no buffers of ruda's).
Algorithm choose(const Timings& agreed) noexcept;

/// The fixed choice of a threshold: MPI's own up to `ring_min_bytes` in all, the ring above.
Algorithm by_threshold(std::size_t bytes, std::size_t ring_min_bytes) noexcept;

/// A threshold as RUDA_RING_MIN_BYTES writes it (memory::parse_size's format: 65536, 64KiB, 1MB,
/// 0 for the ring at every size); nullopt for an unset (null) or empty text, which means
/// "measure". Anything else is an ArgumentError naming `what` and the text.
std::optional<std::size_t> parse_ring_min_bytes(const char* text, std::string_view what);
/// RUDA_RING_MIN_BYTES, parsed as above.
std::optional<std::size_t> ring_min_bytes_from_env();

/// How many calls of each algorithm a measurement times at a size: `warmup` untimed rounds (the
/// ring's buffers, MPI's first-call setup), then `rounds` timed ones, each of `calls` calls in a
/// row (small collectives last microseconds: several make a sample that a clock reads well).
/// Bounded so that the first use of a large size costs a few calls, not seconds.
struct TrialPlan {
  int warmup = 1;
  int rounds = 5;
  int calls = 1;
};
TrialPlan trial_plan(std::size_t bytes) noexcept;

/// One collective's choices per size class, and the threshold that overrides them. Read by any
/// thread (query), written by the one running the collective: entries are atomics.
class AlgorithmChoice {
 public:
  AlgorithmChoice() { reset(); }
  AlgorithmChoice(const AlgorithmChoice&) = delete;
  AlgorithmChoice& operator=(const AlgorithmChoice&) = delete;

  /// A fixed threshold (nullopt: measure). Measured choices stay cached for when it is removed.
  void set_threshold(std::optional<std::size_t> ring_min_bytes) noexcept;
  std::optional<std::size_t> threshold() const noexcept;
  /// The algorithm for a collective of `bytes` in all: the threshold's, else the measured one of
  /// its size class, else undecided (to be measured now, by every rank at once).
  Algorithm lookup(std::size_t bytes) const noexcept;
  /// Caches the measured choice of `bytes`'s size class.
  void record(std::size_t bytes, Algorithm algorithm) noexcept;
  /// Forgets the measured choices (the threshold stays).
  void reset() noexcept;

 private:
  std::array<std::atomic<std::uint8_t>, kSizeClasses> measured_;
  std::atomic<bool> fixed_{false};
  std::atomic<std::uint64_t> ring_min_bytes_{0};
};

}  // namespace ruda::collectives_detail
