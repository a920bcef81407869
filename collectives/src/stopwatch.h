// The clock of the per-call traffic figures (Traffic::seconds): begin() and finish() read it once
// each for every collective, whose own work at 4 KiB is well under a microsecond. Reading the TSC
// instead of steady_clock took what ruda adds to a 4 KiB MPI_Allgather from 81-86 to 58-61 ns
// (`mpiexec -n 1 ruda-bench-mpi --suite collectives-mpi`, Zen 4 VM). On x86-64 with an invariant
// TSC that Linux keeps time with, it reads the TSC, converted with a rate measured once per process
// against steady_clock; elsewhere steady_clock.
#pragma once

#include <chrono>
#include <cstdint>

namespace ruda::collectives_detail {

class Stopwatch {
 public:
  /// A monotonic reading, in the stopwatch's own ticks.
  static std::uint64_t now() noexcept;
  /// Seconds between two readings (to >= from).
  static double seconds(std::uint64_t from, std::uint64_t to) noexcept;
  /// The steady_clock time of a reading taken before now.
  static std::chrono::steady_clock::time_point to_steady(std::uint64_t reading) noexcept;
};

}  // namespace ruda::collectives_detail
