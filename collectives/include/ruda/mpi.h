// The MPI communicator (library ruda::mpi, built where MPI is found). <mpi.h> stays out of this
// header, so code that uses it compiles without MPI's include paths.
//
//   int main(int argc, char** argv) {
//     ruda::MpiEnvironment mpi(argc, argv);
//     return ruda::mpi_abort_on_exception([&] {
//       ruda::MpiCommunicator comm;
//       train(comm);
//       return 0;
//     });
//   }
//
// Launch: see collectives/README.md (mpiexec lines for a cluster and for one machine).
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ruda/collectives.h>

namespace ruda {

/// MPI for the life of the object: MPI_Init_thread with MPI_THREAD_MULTIPLE (the progress thread
/// of non-blocking collectives calls MPI) and MPI_Finalize at the end. If MPI is already
/// initialized (by the application), the object only checks the thread level and leaves
/// finalization to whoever initialized it. Errors on MPI_COMM_WORLD return instead of aborting.
/// It also shares the node's cores among the ranks started on it (share_cores_among_local_ranks).
///
/// Destroyed by an exception (during stack unwinding), it does not finalize: MPI_Finalize waits
/// for the other ranks, which may be blocked in a collective with this one forever. MPI stays
/// active, so a handler can still call mpi_abort_on_exception; a process that exits without
/// finalizing makes mpiexec end the whole job with a non-zero exit.
class MpiEnvironment {
 public:
  MpiEnvironment();
  MpiEnvironment(int& argc, char**& argv);
  ~MpiEnvironment();
  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;

  /// Rank and size of this process in MPI_COMM_WORLD.
  int world_rank() const;
  int world_size() const;
  /// Whether MPI is initialized and not yet finalized.
  static bool active();

 private:
  void init(int* argc, char*** argv);
  bool owns_ = false;
  int uncaught_ = 0;  // exceptions in flight at construction, to tell unwinding from a normal end
};

/// A communicator over MPI processes. The constructor duplicates MPI_COMM_WORLD (two
/// duplicates: one for data, one for the order check's fingerprints, so the check never runs
/// inside a collective on the data communicator). Creating and splitting communicators are
/// collective: do it up front, on one thread, in the same order on every process. With the order
/// check on, destroying one is collective too (a last fingerprint exchange, so that a rank that
/// skipped the final collectives is reported instead of leaving the others waiting), except
/// during stack unwinding.
///
/// all_gather, all_reduce and broadcast map to MPI_Allgather, MPI_Allreduce and MPI_Bcast
/// (16-bit floats travel as raw 16-bit words; their sums accumulate in f32 unless asked for
/// native accumulation, and max propagates NaN through ruda's own MPI operations).
/// reduce_scatter is either MPI_Reduce_scatter_block or ruda's own pipelined ring on
/// point-to-point messages with buffers reused from call to call (MPI_Reduce_scatter_block
/// allocates a temporary per call). Which one is measured, not assumed: the first reduce_scatter
/// of each size class (total bytes over all ranks, in powers of two: (2^(k-1), 2^k]) times both
/// on its own buffers (a run of each: a warm-up and 5 samples, small sizes repeating the call up
/// to 16 times a sample), the ranks agree on the slowest rank's best sample of each (one
/// MPI_Allreduce), so every rank picks the same one, and the communicator keeps the choice for the
/// size class (reduce_scatter_algorithm() tells it). That first call costs about a dozen calls'
/// time (small sizes more calls, still well under a millisecond). RUDA_RING_MIN_BYTES (a size: 64KiB, 1MB; 0 for the
/// ring at every size) or set_ring_min_bytes() fixes it instead: MPI's up to that many bytes in all, the ring above.
/// The ring's sums run around it (deterministic, but not in rank order), MPI's in its own order: with the choice
/// measured, a size near the crossover may take either from run to run and round differently; fix the threshold for
/// bit-identical runs. all_gather has one algorithm, MPI_Allgather (a ring of ruda's would gain nothing: it is one
/// message per rank pair either way). Non-blocking collectives run in order on one progress thread per communicator; a
/// blocking collective first waits for those in flight, so two threads are never inside a collective on the same MPI
/// communicator. MPI errors become CollectiveError naming rank, op, dtype and count.
///
/// The collective timeout (RUDA_COLLECTIVE_TIMEOUT, set_timeout; 10 min by default): a watchdog
/// thread per communicator notes which collective each of the rank's threads is in (blocking,
/// non-blocking on the progress thread, or the order check's exchange). One that has not
/// completed within the timeout ends the job: the watchdog asks the other ranks where they are
/// (their watchdogs answer even while they compute), prints
///   ruda: rank 0 of 3 failed: rank 0: all_gather(f32, 1024, "step 2") #3: not complete after the
///   collective timeout of 2 s (RUDA_COLLECTIVE_TIMEOUT): rank 2 did not answer within 1 s, so
///   whether it arrived at collective #3 is not known (a rank that does not answer may have exited
///   or ended this communicator, be stopped or frozen, or be on an unreachable node); rank 1 arrived
/// and calls MPI_Abort. Time in which this rank's own process did not run (SIGSTOP, a paused VM) is
/// not counted against the timeout. Nothing is thrown: a blocking MPI collective cannot be interrupted, and
/// MPI's non-blocking collectives, which could be abandoned, are 1.3-3x slower here. A rank that
/// is busy outside collectives answers and is named as behind: "rank 2 did not arrive at
/// collective #3; rank 2 is not in a collective (busy since #2 ... ended 600.0 s ago)". Splits are watched; the
/// constructor (MPI_Comm_dup of MPI_COMM_WORLD, before a watchdog exists) is not.
class MpiCommunicator final : public Communicator {
 public:
  /// All processes of the job. The timeout comes from RUDA_COLLECTIVE_TIMEOUT (10 min when unset;
  /// an invalid value is an ArgumentError naming the variable).
  MpiCommunicator();
  ~MpiCommunicator() override;

  /// The processes of this communicator that pass the same `color` (>= 0), ranked by `key`
  /// (ties by rank here): MPI_Comm_split. Collective over this communicator, and watched like a
  /// collective (a rank that does not come ends the job after the timeout). The new one has this
  /// one's timeout and order check.
  std::unique_ptr<MpiCommunicator> split(int color, int key);
  /// The processes on this one's node (MPI_Comm_split_type with MPI_COMM_TYPE_SHARED), as split.
  std::unique_ptr<MpiCommunicator> split_by_node();

  /// How long a collective may wait before the watchdog ends the job (see above); 0: forever.
  /// Collectives that start afterwards, and those in flight, are measured against it. Negative:
  /// ArgumentError.
  void set_timeout(std::chrono::milliseconds timeout);
  std::chrono::milliseconds timeout() const noexcept;

  std::string_view kind() const noexcept override { return "mpi"; }

  /// Which algorithm reduce_scatter uses for a tensor of `bytes` in all (every rank's input, not
  /// its piece): "mpi" (MPI_Reduce_scatter_block), "ring", "unmeasured" before the first
  /// reduce_scatter of its size class has measured it, or "copy" (world size 1, or no bytes). The
  /// same on every rank.
  std::string_view reduce_scatter_algorithm(std::size_t bytes) const;
  /// Fixes reduce_scatter's algorithm by size: MPI_Reduce_scatter_block up to `bytes` in all, the
  /// ring above (0: the ring at every size); nullopt goes back to measuring (the choices measured
  /// before are kept). Overrides RUDA_RING_MIN_BYTES. Collective: every rank must pass the same
  /// value, else an ArgumentError on every rank naming the values. Waits for the non-blocking
  /// collectives in flight.
  void set_ring_min_bytes(std::optional<std::size_t> bytes);
  /// The fixed threshold (RUDA_RING_MIN_BYTES or set_ring_min_bytes), nullopt when measuring.
  std::optional<std::size_t> ring_min_bytes() const;

  /// Bytes held by the reusable buffers of reduce_scatter and 16-bit all_reduce (not counted in
  /// ruda::memory). release_buffers() frees them; they grow again on demand.
  std::size_t buffer_bytes() const;
  void release_buffers();

 protected:
  void do_all_gather(const void* send, void* recv, std::int64_t count, DType dtype) override;
  void do_reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype, Accumulate accumulate) override;
  void do_all_reduce(const void* send, void* recv, std::int64_t count, DType dtype, Reduction op,
                     Accumulate accumulate) override;
  void do_broadcast(const void* send, void* recv, std::int64_t count, DType dtype, int root) override;
  void do_barrier() override;
  Work start_all_gather(const Tensor& local, Tensor out, std::int64_t count) override;
  Work start_reduce_scatter(const Tensor& full, Tensor out, std::int64_t count, Accumulate accumulate) override;
  Work start_all_reduce(const Tensor& x, Tensor out, std::int64_t count, Reduction op, Accumulate accumulate) override;
  std::unique_ptr<Communicator> do_split(int color, int key) override;
  std::unique_ptr<Communicator> do_split_by_node() override;
  std::vector<std::string> exchange_fingerprints(const std::string& fingerprint) override;

 private:
  struct Impl;
  explicit MpiCommunicator(std::unique_ptr<Impl> impl);
  // MPI_Comm handles are ints or pointers by implementation: `split` receives an MPI_Comm* as void*.
  std::unique_ptr<MpiCommunicator> make_split(const std::function<int(void*)>& split, const char* call);
  std::unique_ptr<Impl> impl_;
};

/// RUDA_RING_MIN_BYTES as MpiCommunicator reads it (nullopt when unset or empty); an
/// ArgumentError naming the variable when it is not a size. For a program's own startup check.
std::optional<std::size_t> ring_min_bytes_from_env();

/// Every process's `error` ("" when it has none) on every process, before any communicator
/// exists: a program's startup checks (its environment, its options), agreed so that a problem on
/// any rank stops every rank alike, each returning from main (MpiEnvironment then finalizes)
/// instead of one aborting the job and the others printing it again. Returns the failures in rank
/// order (empty when every process is fine). Collective over MPI_COMM_WORLD (a duplicate of it);
/// MPI must be initialized (MpiEnvironment).
std::vector<RankFailure> agree_on_startup(const std::string& error);

/// The most bytes of text a process gives gather_on_startup.
inline constexpr std::size_t kMaxStartupText = std::size_t{1} << 20;

/// Every process's `text` on every process, in rank order, before any communicator exists: what
/// a program compares across its ranks at startup (its options, the environment its collectives
/// read), which must agree before the first collective sizes a buffer from them. Collective over
/// MPI_COMM_WORLD (a duplicate of it), as agree_on_startup; ArgumentError for a text over
/// kMaxStartupText bytes (raised before the collective: give every rank a text within it).
std::vector<std::string> gather_on_startup(const std::string& text);

/// Runs fn and returns its result. If fn throws, prints "ruda: rank R of N failed: <message>" to
/// stderr and calls MPI_Abort, so the whole job ends with a non-zero exit instead of leaving the
/// other ranks waiting in a collective forever. Use it around the body of main().
int mpi_abort_on_exception(const std::function<int()>& fn);

}  // namespace ruda
