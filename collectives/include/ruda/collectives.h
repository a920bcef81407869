// Collectives: one Communicator interface over a single rank, emulated ranks (threads in one
// process) and MPI (<ruda/mpi.h>). A communicator is a value users pass around, never a global.
//
// Collectives move raw tensors and know nothing of autodiff; the differentiable gather of sharded
// parameters lives in nn (<ruda/nn/sharded.h>).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <ruda/error.h>
#include <ruda/tensor.h>

namespace ruda {

namespace collectives_detail {
struct Ledger;  // a communicator's Traffic and its lock (communicator.cpp)
}  // namespace collectives_detail

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
/// Some ranks did not arrive at a collective within EmulatedOptions::timeout (emulated ranks). The
/// message names the collective (op, dtype, count, tag), its number, this rank and the missing
/// ranks. Under MPI the collective timeout (RUDA_COLLECTIVE_TIMEOUT) ends the job with the same
/// facts printed instead, since a blocking MPI collective cannot be interrupted (see <ruda/mpi.h>).
class CollectiveTimeoutError : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};
/// Ranks called different collectives (op, dtype, count, or with the order check the tag) at the
/// same point, or a rank finished without calling a collective the others are in. Emulated ranks
/// always detect it; under MPI only the order check does (see Communicator).
class CollectiveMismatchError : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};
/// Communicators that do not lay the ranks out as asked: a split by node whose nodes differ in
/// size, a ranks-per-node that does not divide the world, a shard and a replicate communicator that
/// do not tile the world (ShardMesh). Raised on every rank alike, before any collective could hang.
class TopologyError : public ArgumentError {
 public:
  using ArgumentError::ArgumentError;
};

enum class Reduction : std::uint8_t { sum, max };
constexpr bool is_valid(Reduction reduction) noexcept {
  switch (reduction) {
    case Reduction::sum:
    case Reduction::max:
      return true;
  }
  return false;
}

/// How sums of 16-bit floats accumulate: in f32 with one final rounding (default), or in the
/// 16-bit type itself at every step.
enum class Accumulate : std::uint8_t { f32, native };
constexpr bool is_valid(Accumulate accumulate) noexcept {
  switch (accumulate) {
    case Accumulate::f32:
    case Accumulate::native:
      return true;
  }
  return false;
}

struct CollectiveOptions {
  /// Names the data in error messages and in the order check, e.g. "layers.2.weight".
  std::string tag = {};
  Accumulate accumulate = Accumulate::f32;
};

/// A non-blocking collective in flight. wait() returns its result (or throws its error).
/// Dropping a Work without waiting is allowed: the collective still completes (every rank takes
/// part in it), only its result is discarded. Under MPI dropping it waits for that completion, as
/// wait() would, so a rank must not drop a Work whose collective needs a peer that is itself
/// waiting for this rank elsewhere first (drop it after that exchange, or keep it until then).
/// wait() may run on another thread than the communicator's (one thread per Work at a time), also
/// while that one runs collectives: the two count traffic() under one lock.
class Work {
 public:
  class State {
   public:
    virtual ~State() = default;
    virtual Tensor wait() = 0;
    virtual bool ready() = 0;
    virtual std::optional<std::chrono::steady_clock::time_point> completed_at() const { return std::nullopt; }
  };
  Work() = default;
  explicit Work(std::unique_ptr<State> state) : state_(std::move(state)) {}
  /// A Work whose collective already completed (ran blocking), for code that takes either.
  static Work completed(Tensor result);
  Work(Work&&) noexcept = default;
  Work& operator=(Work&&) noexcept = default;
  /// Blocks until the collective is done; callable once (an ArgumentError afterwards).
  Tensor wait();
  /// Whether wait() would return at once; false once the result was taken.
  bool ready() const;
  bool valid() const noexcept { return state_ != nullptr; }
  /// After wait(): when the collective completed, where the implementation knows it.
  std::optional<std::chrono::steady_clock::time_point> completed_at() const noexcept { return completed_; }

 private:
  std::unique_ptr<State> state_;
  std::optional<std::chrono::steady_clock::time_point> completed_;
};

/// What a communicator's collectives cost this rank (Communicator::traffic()).
struct Traffic {
  std::uint64_t collectives = 0;  // completed (a non-blocking one once waited for)
  /// Bytes this rank sends in a ring implementation ("bus bytes"): all_gather and reduce_scatter
  /// (world - 1) x one rank's part, all_reduce 2 (world - 1) / world x the tensor, broadcast the
  /// tensor. What a link carries, whatever the implementation does on one machine.
  std::uint64_t bytes = 0;
  /// From each collective's start to its completion: blocking ones whole, non-blocking ones to
  /// when they completed (where the implementation knows it, else to the end of wait()).
  double seconds = 0;
  /// The part the calling thread spent waiting: blocking collectives whole, non-blocking ones
  /// inside wait(). seconds - exposed_seconds is communication hidden behind compute.
  double exposed_seconds = 0;
};

/// Whether RUDA_CHECK_COLLECTIVES asks for the order check: "1", "true", "on" or "yes" (any case)
/// turn it on; unset, empty, "0", "false", "off" or "no" leave it off; anything else is an
/// ArgumentError naming the variable (a misspelt value must not silently mean off).
bool order_check_from_env();

/// Whether an MPI launcher started this process (mpiexec/mpirun, or srun and others through PMI or
/// PMIx), read from the launcher's environment: callable before MPI is initialized, and in a
/// build without MPI (to refuse a launch it cannot serve).
bool launched_by_mpi();
/// This process's rank as its launcher numbered it (0 when no launcher started it).
int launcher_rank();
/// How many processes the launcher started on this node (1 when no launcher says).
int launcher_local_ranks();
/// Shares this node's cores among the ranks the launcher started on it: the default intra-op
/// thread count (set_default_num_threads) becomes hardware_threads() / launcher_local_ranks(), at
/// least 1, so N ranks on a node do not each start a thread per core. $RUDA_NUM_THREADS and
/// $OMP_NUM_THREADS still win. MpiEnvironment applies it; a program that starts ranks otherwise can.
void share_cores_among_local_ranks();

/// How long an MPI collective may wait for the other ranks by default: long enough for a healthy
/// gap between ranks (one rank writing a checkpoint or evaluating alone while the others already
/// wait in the next collective: that wait counts), short enough that a stalled job ends soon.
inline constexpr std::chrono::milliseconds kDefaultCollectiveTimeout = std::chrono::minutes(10);
/// A collective timeout as written in a variable or option: a number with an optional unit, "ms",
/// "s" (the default), "m"/"min" or "h" ("300", "300s", "5m", "500ms", "1.5h"); "off" or "0" for
/// none, which returns 0. At least 1 ms, at most 365 days. Anything else is an ArgumentError
/// naming `what` (the variable or option) and the text.
std::chrono::milliseconds parse_collective_timeout(std::string_view text, std::string_view what);
/// RUDA_COLLECTIVE_TIMEOUT parsed (0: off), kDefaultCollectiveTimeout when it is unset or empty.
std::chrono::milliseconds collective_timeout_from_env();
/// A timeout as messages show it: "2 s", "500 ms", "10 min", "off".
std::string format_collective_timeout(std::chrono::milliseconds timeout);

/// One of `world_size` ranks. All ranks must call the same collectives in the same order with the
/// same dtypes, counts, roots and reductions; turn on the order check (RUDA_CHECK_COLLECTIVES=1 or
/// set_order_check(true), the same on every rank) to have a mismatch raise on every rank. Without
/// it emulated ranks still raise CollectiveMismatchError, but under MPI a mismatch is undefined:
/// it may hang until the collective timeout, fail on some ranks only, or return wrong data without
/// an error (a broadcast of 2 values against 4 leaves the tail of the larger uninitialized; sum
/// against max, or bf16 against f16, complete with mixed results). Develop with the check on.
/// A communicator is used by one thread at a time: a collective begun while another thread's
/// runs on it is an ArgumentError on the second thread (two threads' calls used to interleave in
/// its records, pairing one thread's call with the other's, or crash).
///
/// Data movement follows axis 0: all_gather concatenates the ranks' tensors along axis 0 (a 0-d
/// tensor counts as one row), reduce_scatter splits the (summed) tensor along axis 0 into
/// world_size equal pieces. Tensors of f32, f64, bf16, f16 and i64 are supported (a bool tensor
/// is a DTypeError, a shape that does not fit a ShapeError, both raised before any communication);
/// results are new tensors on the input's backend. i64 sums wrap around on overflow; max
/// propagates NaN.
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
  /// Non-blocking all_reduce: `x` must stay unchanged until wait(), which returns the result (a new
  /// tensor). Completes in order with the other non-blocking collectives of this communicator; on
  /// MPI it runs on the progress thread, so communication on another communicator (a node's
  /// reduce-scatter, say) proceeds beside it.
  Work all_reduce_async(const Tensor& x, Reduction op = Reduction::sum, const CollectiveOptions& options = {});
  /// Rank `root`'s tensor on every rank (the others pass a tensor of the same shape and dtype).
  Tensor broadcast(const Tensor& x, int root, const CollectiveOptions& options = {});
  void barrier(const CollectiveOptions& options = {});

  /// all_gather and reduce_scatter into a caller's tensor (contiguous, of the result's shape and
  /// dtype, not sharing storage with the input), so a buffer can be reused from step to step.
  void all_gather_into(const Tensor& out, const Tensor& local, const CollectiveOptions& options = {});
  void reduce_scatter_into(const Tensor& out, const Tensor& full, const CollectiveOptions& options = {});

  /// Non-blocking forms, for prefetching the next layer's weights while this one computes. The
  /// input must stay unchanged until wait(). Collectives started on one communicator complete in
  /// the order they were started; a blocking collective waits for the ones in flight. With the
  /// order check on, the start itself agrees the fingerprint with the other ranks (so a mismatch
  /// raises at the call), which makes it wait for them to start it too.
  Work all_gather_async(const Tensor& local, const CollectiveOptions& options = {});
  Work reduce_scatter_async(const Tensor& full, const CollectiveOptions& options = {});
  /// Non-blocking *_into forms: `out` must stay untouched until wait(), which returns it.
  Work all_gather_into_async(const Tensor& out, const Tensor& local, const CollectiveOptions& options = {});
  Work reduce_scatter_into_async(const Tensor& out, const Tensor& full, const CollectiveOptions& options = {});

  /// The ranks of this communicator that pass the same `color` (>= 0), ranked by `key` (ties by
  /// rank here), as a communicator of their own with this one's order check. Collective over this
  /// communicator (numbered in its history as "split"); do it up front, in the same order on every rank.
  std::unique_ptr<Communicator> split(int color, int key);
  /// The ranks of this communicator on this rank's node, in rank order: MPI's shared-memory node
  /// (MPI_COMM_TYPE_SHARED), emulated ranks' EmulatedOptions::ranks_per_node, world size 1 itself.
  /// Collective.
  std::unique_ptr<Communicator> split_by_node();

  /// 0, 1, 2, ... to its callers in turn: ranks that make the same objects over their
  /// communicators in the same order (as collectives must be) get the same numbers, which name
  /// what nothing else tells apart (nn's shard groups without a module path: sibling groups).
  std::uint64_t next_ordinal() noexcept { return ordinals_++; }
  /// The debug check of collective order (off unless RUDA_CHECK_COLLECTIVES=1).
  void set_order_check(bool enabled) noexcept { order_check_ = enabled; }
  bool order_check() const noexcept { return order_check_; }
  /// The last collectives of this rank, oldest first ("#17 all_gather(f32, 8192, "layers.3.weight")").
  std::vector<std::string> history() const;
  /// What the collectives completed since construction or reset_traffic() cost this rank
  /// (world size 1 moves nothing and counts nothing).
  /// (Both take the lock the communicator's Works share: a std::mutex, whose lock throws only
  /// where the system refuses it, and then terminates here.)
  Traffic traffic() const noexcept;
  void reset_traffic() noexcept;
  /// Expires when this communicator is destroyed: what holds its address (a sharded parameter)
  /// checks it before use, and raises instead of calling into freed memory.
  std::weak_ptr<const void> liveness() const noexcept { return alive_; }

 protected:
  Communicator(int rank, int world_size);

  /// The collective being run, as in history() without the number: all_gather(f32, 8192, "w").
  /// Meaningful during a do_* call (implementations quote it in their errors); formatted on
  /// demand, so calls that succeed build no strings.
  std::string current_call() const;
  /// The 1-based number of the collective being run on this communicator.
  std::uint64_t current_sequence() const noexcept { return sequence_; }

  /// One call as histories and messages show it. Kept raw and formatted only when shown: the
  /// strings reuse their buffers from call to call (also when a Record is assigned to another),
  /// so recording allocates nothing.
  struct Record {
    std::uint64_t sequence = 0;
    const char* op = "";
    bool has_data = true;
    DType dtype = DType::f32;
    std::int64_t count = 0;
    std::string extra;  // what else defines the call: "max", "root 1", "native"
    std::string tag;
    Shape shape;  // the tensor's (the input's; the one tensor of all_reduce and broadcast); none for a barrier
    /// all_gather(f32, 8192, "w"), without the number.
    std::string text() const;
  };
  /// The collective being run (meaningful during a do_* or start_* call, like current_call()).
  const Record& current_record() const { return history_[(sequence_ - 1) % kHistory]; }
  /// True where every collective may return its input itself (world size 1 without copies).
  virtual bool pass_through() const noexcept { return false; }

  // What an implementation provides: whole-buffer collectives on contiguous memory. `count` is
  // the element count each rank contributes (all_gather), receives (reduce_scatter) or holds
  // (all_reduce, broadcast). Buffers never overlap. They throw CollectiveError (or a subclass) on
  // failure; the base class adds the rank, the call and the history to the message.
  virtual void do_all_gather(const void* send, void* recv, std::int64_t count, DType dtype) = 0;
  virtual void do_reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype,
                                 Accumulate accumulate) = 0;
  virtual void do_all_reduce(const void* send, void* recv, std::int64_t count, DType dtype, Reduction op,
                             Accumulate accumulate) = 0;
  /// recv receives root's send (send is read on the root only).
  virtual void do_broadcast(const void* send, void* recv, std::int64_t count, DType dtype, int root) = 0;
  virtual void do_barrier() = 0;
  /// Non-blocking forms; the default runs the blocking one at once and returns a finished Work.
  /// `out` is the result tensor to fill; the Work's wait() returns it.
  virtual Work start_all_gather(const Tensor& local, Tensor out, std::int64_t count);
  virtual Work start_reduce_scatter(const Tensor& full, Tensor out, std::int64_t count, Accumulate accumulate);
  virtual Work start_all_reduce(const Tensor& x, Tensor out, std::int64_t count, Reduction op, Accumulate accumulate);
  /// split and split_by_node after the base class numbered the call (and checked its order): a
  /// collective over this communicator.
  virtual std::unique_ptr<Communicator> do_split(int color, int key) = 0;
  virtual std::unique_ptr<Communicator> do_split_by_node() = 0;
  /// Agrees `fingerprint` across ranks for the order check; returns every rank's fingerprint
  /// (index = rank). Implementations may exchange fixed-size records of kFingerprintBytes:
  /// fingerprints are shorter (long tags are cut, keeping a hash of the whole tag; with the
  /// sequence number, op, count, extra and the shape, at most ~270 bytes).
  virtual std::vector<std::string> exchange_fingerprints(const std::string& fingerprint) = 0;
  static constexpr std::size_t kFingerprintBytes = 320;

 private:
  std::shared_ptr<const int> alive_ = std::make_shared<const int>(0);  // liveness()
  struct Call;
  // The operations begin() records: an enumerator, not the name's text, so that working out a
  // call's bus bytes compares no strings (a 4 KiB collective's own cost is ~60 ns).
  enum class Op : std::uint8_t { all_gather, reduce_scatter, all_reduce, broadcast, barrier, split, split_by_node };
  // Numbers and records a call (has_data: false for a barrier), and runs the order check when
  // enabled. `shape` is the input tensor's: ranks whose counts agree but whose shapes do not
  // ([2, 3] against [3, 2]) call different collectives.
  Call begin(Op op, bool has_data, std::int64_t count, DType dtype, std::string_view extra,
             const CollectiveOptions& options, const Shape* shape = nullptr);
  void check_order(const Call& call);
  // Accounts a blocking collective that completed (traffic()).
  void finish(const Call& call);
  std::string error_prefix(const Call& call) const;
  [[noreturn]] void rethrow_with_context(const Call& call);
  // The blocking collective into `out` (by reference: the *_into forms copy no Tensor handle).
  void run_all_gather(const Tensor& local, const Tensor& out, const CollectiveOptions& options);
  void run_reduce_scatter(const Tensor& full, const Tensor& out, const CollectiveOptions& options);
  Work launch_all_gather(const Tensor& local, Tensor out, const CollectiveOptions& options);
  Work launch_reduce_scatter(const Tensor& full, Tensor out, const CollectiveOptions& options);

  int rank_;
  int world_size_;
  bool order_check_;
  // "rank 3", for errors that name the rank (built once, not per call); a split communicator's
  // names the parent's too: "rank 1 (rank 3 before the split)".
  std::string rank_text_;
  void name_split_from(const Communicator& parent, const char* how);
  std::uint64_t sequence_ = 0;
  std::uint64_t ordinals_ = 0;  // next_ordinal's
  // The Traffic, and when the collectives waited for so far were complete (a collective queued
  // behind earlier ones, as a link serves them in turn, counts its seconds from then), under a
  // lock: shared with the Works of non-blocking collectives, which account for themselves when
  // waited for, even after the communicator is gone and on another thread than the one running
  // its collectives.
  std::shared_ptr<collectives_detail::Ledger> ledger_;
  std::vector<Record> history_;  // ring of the last kHistory calls; the current one is the newest
  static constexpr std::size_t kHistory = 32;
  // The thread running a collective on this communicator (none: a default id), and how deep its
  // calls nest (a collective may run another on the same communicator): begin() takes it, the
  // call releases it when it ends. Only the holding thread touches user_depth_.
  std::atomic<std::thread::id> user_{};
  int user_depth_ = 0;
  void acquire_use(const char* op);
  void release_use() noexcept;
};

/// World size 1: every collective is the identity (results share the input's storage, cut from
/// any autodiff graph). The *_into forms copy.
class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator();
  std::string_view kind() const noexcept override { return "local"; }

 protected:
  bool pass_through() const noexcept override { return true; }
  void do_all_gather(const void* send, void* recv, std::int64_t count, DType dtype) override;
  void do_reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype, Accumulate accumulate) override;
  void do_all_reduce(const void* send, void* recv, std::int64_t count, DType dtype, Reduction op,
                     Accumulate accumulate) override;
  void do_broadcast(const void* send, void* recv, std::int64_t count, DType dtype, int root) override;
  void do_barrier() override;
  std::unique_ptr<Communicator> do_split(int color, int key) override;
  std::unique_ptr<Communicator> do_split_by_node() override;
  std::vector<std::string> exchange_fingerprints(const std::string& fingerprint) override;
};

/// A simulated network link for emulated ranks, so that prefetch and overlap can be tested
/// quickly and deterministically on one machine: each collective then takes the time a ring over
/// links of this bandwidth would need, with `latency` per ring step, as a sleeping wait (no core
/// is spun). Collectives of one rank share its link in order; a non-blocking one completes that
/// long after it starts (its Work's wait() sleeps until then), so compute in between hides it.
struct LinkModel {
  double bytes_per_second = 0;          // 0: no model (collectives take only the copying time)
  std::chrono::nanoseconds latency{0};  // per message step of the ring
  bool enabled() const noexcept { return bytes_per_second > 0; }

  /// "1GB/s", "10Gbit/s", "512MiB/s", "100MB/s,20us" (bandwidth, then an optional latency in ns,
  /// us, ms or s), or "off" / "0" / "". ArgumentError naming `source` and the text otherwise.
  static LinkModel parse(const std::string& text, const std::string& source = "link model");
  /// RUDA_EMULATE_LINK (off when unset).
  static LinkModel from_env();

  /// The modeled time of a collective over `world` ranks: all_gather moves `bytes` (one rank's
  /// contribution) to every other rank, reduce_scatter the same per rank's result,
  /// all_reduce 2 (world - 1) / world of `bytes`, broadcast `bytes` once (pipelined), barrier
  /// only latencies.
  std::chrono::nanoseconds all_gather_time(int world, std::uint64_t bytes) const;
  std::chrono::nanoseconds reduce_scatter_time(int world, std::uint64_t bytes) const;
  std::chrono::nanoseconds all_reduce_time(int world, std::uint64_t bytes) const;
  std::chrono::nanoseconds broadcast_time(int world, std::uint64_t bytes) const;
  std::chrono::nanoseconds barrier_time(int world) const;
  /// "1.00 GB/s", "12.5 MB/s, 20.0 us latency", "125 B/s, 1.0 ms latency" (a unit that shows it); "off".
  std::string describe() const;
};

struct EmulatedOptions {
  /// A rank that does not arrive at a collective within this time makes the others raise
  /// CollectiveTimeoutError naming the collective and the missing ranks.
  std::chrono::milliseconds timeout{60000};
  /// The collective-order check (default: RUDA_CHECK_COLLECTIVES).
  bool check_order = order_check_from_env();
  /// Intra-op threads per rank (0: RUDA_NUM_THREADS, else cores / ranks, at least 1).
  int threads_per_rank = 0;
  /// The simulated link between the ranks; unset: RUDA_EMULATE_LINK, else none, read by run_ranks
  /// (a bad RUDA_EMULATE_LINK failed the construction of these options, even where a link was
  /// then given).
  std::optional<LinkModel> link = std::nullopt;
  /// Consecutive ranks that make one simulated node (split_by_node; must divide the world size). The
  /// link model is then one network interface per node, as in tools/cluster-sim: collectives among
  /// the ranks of one node take no link time, and those that cross nodes share each node's link
  /// (a ring collective's instance occupies it once, two of them at once take turns). 1: every rank
  /// its own node, each with a link of its own.
  int ranks_per_node = 1;
};

/// Runs fn(comm) on `world_size` threads, each with its own Communicator and memory tracker
/// (ruda::memory::stats() reads the rank's own figures). Sums are taken in rank order, so
/// results are bit-reproducible. If a rank throws, every other rank's pending or next collective
/// raises RankFailedError naming it, and run_ranks rethrows the first rank's exception. A rank
/// whose fn returns while the others wait in a collective makes them raise CollectiveMismatchError.
/// Non-blocking collectives of emulated ranks run when started (their Work is ready at once).
void run_ranks(int world_size, const std::function<void(Communicator&)>& fn, EmulatedOptions options = {});

/// The ranks as a two-level mesh for hybrid sharding (FSDP2's HSDP): parameters are sharded over
/// `shard()`, the ranks of one node, and replicated over `replicate()`, the ranks with the same
/// place on every node. Every rank is in exactly one of each; together they tile `world()`:
/// shard size x replicate size = world size, and each (replica, shard rank) pair is one rank.
class ShardMesh {
 public:
  /// Splits `world` by node. ranks_per_node 0: by the communicator's own nodes (split_by_node:
  /// MPI's shared-memory nodes, emulated ranks' EmulatedOptions::ranks_per_node); N > 0: blocks of
  /// N consecutive ranks (as `mpiexec --map-by ppr:N:node` places them), which must divide the
  /// world. Nodes of different sizes, an N that does not divide the world, or ranks passing
  /// different N are a TopologyError on every rank. Collective over `world`, which must outlive
  /// the mesh.
  static ShardMesh by_node(Communicator& world, int ranks_per_node = 0);
  /// From communicators the caller made (any split of `world`). Checks that they tile `world`
  /// (collective over all three): TopologyError on every rank otherwise, naming the layouts.
  ShardMesh(Communicator& world, std::unique_ptr<Communicator> shard, std::unique_ptr<Communicator> replicate);
  ShardMesh(ShardMesh&&) noexcept = default;
  ShardMesh& operator=(ShardMesh&&) noexcept = default;

  // Every accessor of a mesh moved from raises ArgumentError (it holds no communicators), and
  // world() of one whose world communicator was destroyed.
  Communicator& world() const;
  /// Within a node: all-gathers and reduce-scatters of the shards.
  Communicator& shard() const;
  /// Across nodes: the all-reduce of the reduced shards.
  Communicator& replicate() const;
  int ranks_per_node() const { return shard().world_size(); }
  int nodes() const { return replicate().world_size(); }
  /// This rank's node: its place in replicate() (0 is the first replica, which writes checkpoints).
  int node() const { return replicate().rank(); }
  /// "2 nodes x 2 ranks".
  std::string describe() const;

 private:
  void require_communicators(const char* what) const;
  Communicator* world_;
  std::weak_ptr<const void> world_alive_;  // world_->liveness(): world() refuses a destroyed one
  std::unique_ptr<Communicator> shard_, replicate_;
};

}  // namespace ruda

namespace ruda {

// The agreements below exchange a few bytes each, exempt from the memory limit (still counted):
// a rank at its limit must still tell the others what happened. Refused there, an agreement
// threw on that rank alone, and a checkpoint save was reported failed after it was published.

/// Every rank's `text`, in rank order, on every rank. Collective: two all_gathers (the lengths,
/// then the bytes padded to the longest), tagged with `tag` for the order check.
std::vector<std::string> all_gather_text(Communicator& comm, const std::string& text, const std::string& tag);

/// The largest of each of `values` over the ranks, on every rank (one all_reduce of f64 values):
/// the flags ranks agree on (a plan over the limit, weights not finite, a signal received).
/// Every rank passes as many values. Collective.
std::vector<double> agree_on_max(Communicator& comm, const std::vector<double>& values, const std::string& tag);

/// A rank's failure, as agree_on_failure reports it.
struct RankFailure {
  int rank = 0;
  std::string message;
};

/// Agrees on a phase's outcome: every rank passes its error ("" when it succeeded) and learns
/// every rank's, so a failure anywhere is seen everywhere with its root cause, and no rank goes
/// on to a collective the others will not join. Returns the failures in rank order (empty when
/// every rank succeeded). Collective.
std::vector<RankFailure> agree_on_failure(Communicator& comm, const std::string& error, const std::string& tag);

/// Runs `phase` on this rank and agrees on its outcome with every rank (agree_on_failure): the
/// failures in rank order, empty when it succeeded everywhere. An exception the phase throws does
/// not escape (nor does one that is not a std::exception, nor an empty phase): its message is this
/// rank's failure. For setup that every rank must finish before any
/// goes on to a collective: a rank that fails here cannot leave the others waiting. Collective.
std::vector<RankFailure> run_agreed(Communicator& comm, const std::string& tag, const std::function<void()>& phase);

/// "rank 1: <message>; rank 3: <message>" (the same message from several ranks is given once, as
/// "ranks 1, 3: <message>").
std::string describe(const std::vector<RankFailure>& failures);

}  // namespace ruda
