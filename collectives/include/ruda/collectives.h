// Collectives: one Communicator interface over a single rank, emulated ranks (threads in one
// process) and MPI (<ruda/mpi.h>). A communicator is a value users pass around, never a global.
//
// Collectives move raw tensors and know nothing of autodiff; the differentiable gather of sharded
// parameters lives in nn (<ruda/nn/sharded.h>).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <ruda/error.h>
#include <ruda/tensor.h>

namespace ruda {

/// A collective failed. The message names the rank, the operation, the dtype and the element
/// count, and ends with the rank's last collectives.
class CollectiveError : public Error {
 public:
  using Error::Error;
};
/// Another rank failed (threw, or its process died) while this rank was in or entering a collective.
class RankFailedError : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};
/// Some ranks did not arrive at a collective within the timeout (emulated ranks).
class CollectiveTimeoutError : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};
/// The order check found ranks calling different collectives (op, dtype, count or tag) at the same point.
class CollectiveMismatchError : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};

enum class Reduction : std::uint8_t { sum, max };

/// How sums of 16-bit floats accumulate: in f32 with one final rounding (default), or in the
/// 16-bit type itself at every step.
enum class Accumulate : std::uint8_t { f32, native };

struct CollectiveOptions {
  /// Names the data in error messages and in the order check, e.g. "layers.2.weight".
  std::string tag;
  Accumulate accumulate = Accumulate::f32;
};

/// A non-blocking collective in flight. wait() returns its result (or throws its error).
class Work {
 public:
  class State {
   public:
    virtual ~State() = default;
    virtual Tensor wait() = 0;
    virtual bool ready() = 0;
  };
  Work() = default;
  explicit Work(std::unique_ptr<State> state) : state_(std::move(state)) {}
  Work(Work&&) noexcept = default;
  Work& operator=(Work&&) noexcept = default;
  /// Blocks until the collective is done; callable once.
  Tensor wait();
  bool ready() const;
  bool valid() const noexcept { return state_ != nullptr; }

 private:
  std::unique_ptr<State> state_;
};

/// One of `world_size` ranks. All ranks must call the same collectives in the same order with the
/// same dtypes and counts; turn on the order check (RUDA_CHECK_COLLECTIVES=1 or
/// set_order_check(true)) to have a mismatch raise on every rank instead of hanging.
///
/// Data movement follows axis 0: all_gather concatenates the ranks' tensors along axis 0,
/// reduce_scatter splits the (summed) tensor along axis 0 into world_size equal pieces.
/// Tensors of f32, f64, bf16, f16 and i64 are supported; results are new tensors on the input's backend.
class Communicator {
 public:
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return world_size_; }
  /// "local", "emulated" or "mpi".
  virtual std::string_view kind() const noexcept = 0;

  /// The ranks' `local` tensors (same shape and dtype on every rank) concatenated along axis 0 in rank order.
  Tensor all_gather(const Tensor& local, const CollectiveOptions& options = {});
  /// This rank's piece (along axis 0) of the element-wise sum of the ranks' `full` tensors;
  /// full.shape[0] must divide by world_size.
  Tensor reduce_scatter(const Tensor& full, const CollectiveOptions& options = {});
  /// The element-wise sum (or max) over ranks, on every rank.
  Tensor all_reduce(const Tensor& x, Reduction op = Reduction::sum, const CollectiveOptions& options = {});
  /// Rank `root`'s tensor on every rank (the others pass a tensor of the same shape and dtype).
  Tensor broadcast(const Tensor& x, int root, const CollectiveOptions& options = {});
  void barrier(const CollectiveOptions& options = {});

  /// Non-blocking forms, for prefetching the next layer's weights while this one computes. The
  /// input must stay unchanged until wait(). Collectives started on one communicator complete in
  /// the order they were started.
  Work all_gather_async(const Tensor& local, const CollectiveOptions& options = {});
  Work reduce_scatter_async(const Tensor& full, const CollectiveOptions& options = {});

  /// The debug check of collective order (off unless RUDA_CHECK_COLLECTIVES=1).
  void set_order_check(bool enabled) noexcept { order_check_ = enabled; }
  bool order_check() const noexcept { return order_check_; }
  /// The last collectives of this rank, oldest first ("#17 all_gather(f32, 8192, 'layers.3.weight')").
  std::vector<std::string> history() const;

 protected:
  Communicator(int rank, int world_size);

  // What an implementation provides: whole-buffer collectives on contiguous memory. `count` is
  // the element count each rank contributes (all_gather) or receives (reduce_scatter). They throw
  // CollectiveError (or a subclass) on failure.
  virtual void do_all_gather(const void* send, void* recv, std::int64_t count, DType dtype) = 0;
  virtual void do_reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype,
                                 Accumulate accumulate) = 0;
  virtual void do_all_reduce(const void* send, void* recv, std::int64_t count, DType dtype, Reduction op,
                             Accumulate accumulate) = 0;
  virtual void do_broadcast(void* buffer, std::int64_t count, DType dtype, int root) = 0;
  virtual void do_barrier() = 0;
  /// Non-blocking forms; the default runs the blocking one at once and returns a finished Work.
  virtual Work start_all_gather(const Tensor& local, Tensor out, std::int64_t count);
  virtual Work start_reduce_scatter(const Tensor& full, Tensor out, std::int64_t count, Accumulate accumulate);
  /// Agrees `fingerprint` across ranks for the order check; returns every rank's fingerprint
  /// (index = rank). Implementations exchange fixed-size records.
  virtual std::vector<std::string> exchange_fingerprints(const std::string& fingerprint) = 0;

 private:
  struct Call;
  Call begin(const char* op, const Tensor* data, std::int64_t count, DType dtype, const CollectiveOptions& options);
  [[noreturn]] void rethrow_with_context(const Call& call);

  int rank_;
  int world_size_;
  bool order_check_;
  std::uint64_t sequence_ = 0;
  std::vector<std::string> history_;  // ring of the last kHistory calls
  static constexpr std::size_t kHistory = 32;
};

/// World size 1: every collective is the identity (results share the input's storage).
class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator();
  std::string_view kind() const noexcept override { return "local"; }

 protected:
  void do_all_gather(const void* send, void* recv, std::int64_t count, DType dtype) override;
  void do_reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype, Accumulate accumulate) override;
  void do_all_reduce(const void* send, void* recv, std::int64_t count, DType dtype, Reduction op,
                     Accumulate accumulate) override;
  void do_broadcast(void* buffer, std::int64_t count, DType dtype, int root) override;
  void do_barrier() override;
  std::vector<std::string> exchange_fingerprints(const std::string& fingerprint) override;
};

struct EmulatedOptions {
  /// A rank that does not arrive at a collective within this time makes the others raise
  /// CollectiveTimeoutError naming the collective and the missing ranks.
  std::chrono::milliseconds timeout{60000};
  /// The collective-order check (default: RUDA_CHECK_COLLECTIVES).
  bool check_order = false;
  /// Intra-op threads per rank (0: RUDA_NUM_THREADS, else cores / ranks, at least 1).
  int threads_per_rank = 0;
};

/// Runs fn(comm) on `world_size` threads, each with its own Communicator and memory tracker
/// (ruda::memory::stats() reads the rank's own figures). Sums are taken in rank order, so
/// results are bit-reproducible. If a rank throws, every other rank's pending or next collective
/// raises RankFailedError naming it, and run_ranks rethrows the first rank's exception.
void run_ranks(int world_size, const std::function<void(Communicator&)>& fn, EmulatedOptions options = {});

/// Whether RUDA_CHECK_COLLECTIVES asks for the order check.
bool order_check_from_env();

}  // namespace ruda
