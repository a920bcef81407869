// Emulated ranks: world_size threads in one process, each with its own Communicator.
//
// Every collective is a rendezvous in two phases. In the first, each rank publishes a Slot (what
// it calls, and pointers to its buffers) and waits for all the others; then each rank does its
// own share of the work directly on the others' buffers (no staging copies: the rank threads
// themselves copy and reduce in parallel). In the second, the ranks wait until every one is done
// with the others' buffers, so that no rank returns (and reuses its input) while another still
// reads it. Sums run over the ranks in rank order, so results are bit-reproducible.
//
// The first phase can end in an error: another rank failed, finished, or did not come within the
// timeout. The world is then "broken" and every later collective fails at once, so no rank hangs.
// The second phase cannot fail: by then every rank is inside the collective and only copies.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include <ruda/backend.h>
#include <ruda/memory.h>

#include "internal.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace ruda {

namespace {

namespace cd = collectives_detail;
using Clock = std::chrono::steady_clock;

enum class Kind : std::uint8_t { all_gather, reduce_scatter, all_reduce, broadcast, barrier, fingerprint };

class EmulatedCommunicator;

// What a rank brings to a rendezvous. Its owner writes it before arriving; every rank reads it
// between the two phases (the world's mutex orders these accesses), so the fields need no lock.
struct Slot {
  Kind kind = Kind::barrier;
  DType dtype = DType::f32;
  std::int64_t count = 0;
  int root = 0;
  Reduction reduction = Reduction::sum;
  Accumulate accumulate = Accumulate::f32;
  const void* send = nullptr;
  void* recv = nullptr;
  const EmulatedCommunicator* owner = nullptr;  // whose call it is, described only for messages
  std::uint64_t sequence = 0;

  bool same_collective(const Slot& o) const {
    return kind == o.kind && dtype == o.dtype && count == o.count && root == o.root && reduction == o.reduction &&
           accumulate == o.accumulate;
  }
};

// Why the world stopped. Every later collective reports it instead of waiting.
enum class Broken : std::uint8_t { no, failed, timeout, finished };

class World {
 public:
  World(int size, std::chrono::milliseconds timeout)
      : size_(size),
        timeout_(timeout),
        spin_(size <= hardware_threads()),
        slots_(size),
        present_(size, 0),
        finished_(size, 0),
        errors_(size) {}

  int size() const noexcept { return size_; }
  Slot& slot(int rank) noexcept { return slots_[static_cast<std::size_t>(rank)]; }

  /// Phase one: waits until every rank has arrived. Throws RankFailedError, CollectiveTimeoutError
  /// or CollectiveMismatchError when that cannot happen; describe() names the call for the latter.
  template <class Describe>
  void arrive(int rank, Describe&& describe) {
    std::unique_lock lock(mutex_);
    if (broken_ != Broken::no) throw_broken(false);
    present_[static_cast<std::size_t>(rank)] = 1;
    const std::uint64_t generation = generation_;
    if (count_in(lock, generation)) return;
    const auto deadline = Clock::now() + timeout_;
    while (generation_ == generation) {
      if (broken_ != Broken::no) throw_broken(broken_generation_ == generation);
      if (const std::vector<int> gone = missing(true); !gone.empty()) {
        break_world(Broken::finished, rank,
                    cd::rank_list(gone) + " returned without calling collective " + describe() +
                        " (a rank skipped a collective)");
        throw_broken(true);
      }
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && generation_ == generation &&
          broken_ == Broken::no) {
        break_world(
            Broken::timeout, rank,
            cd::rank_list(missing(false)) + " did not arrive within " + std::to_string(timeout_.count()) + " ms");
        throw_broken(true);
      }
    }
  }

  /// Phase two: waits until every rank is done with the others' buffers. Cannot fail: every rank
  /// is inside the collective and only copies, so all of them come.
  void depart() {
    std::unique_lock lock(mutex_);
    const std::uint64_t generation = generation_;
    if (count_in(lock, generation)) return;
    cv_.wait(lock, [&] { return generation_ != generation; });
  }

  /// A rank's function threw: every rank waiting now or later raises RankFailedError.
  void fail(int rank, std::exception_ptr error) {
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    {
      std::lock_guard lock(mutex_);
      errors_[static_cast<std::size_t>(rank)] = std::move(error);
      failure_order_.push_back(rank);
      if (first_failure_ < 0) first_failure_ = rank;
      if (broken_ == Broken::no) {
        broken_ = Broken::failed;
        broken_generation_ = generation_;
        reason_ = "rank " + std::to_string(rank) + " failed: " + what;
      }
    }
    cv_.notify_all();
  }

  /// A rank's function returned: ranks waiting for it raise CollectiveMismatchError.
  void finish(int rank) {
    {
      std::lock_guard lock(mutex_);
      finished_[static_cast<std::size_t>(rank)] = 1;
    }
    cv_.notify_all();
  }

  /// After every thread joined: rethrows the first failure (the rank that broke the world), if any.
  void rethrow_first_failure() {
    if (first_failure_ >= 0 && errors_[static_cast<std::size_t>(first_failure_)]) {
      std::rethrow_exception(errors_[static_cast<std::size_t>(first_failure_)]);
    }
    // The rank that broke the world caught its own error; report the first rank that did fail.
    if (!failure_order_.empty()) std::rethrow_exception(errors_[static_cast<std::size_t>(failure_order_.front())]);
  }

 private:
  // Counts the calling rank into episode `generation` (lock held). True when the episode is over:
  // this rank was the last to come, or the others finished it while it spun (lock released).
  // False with the lock held again: the caller must wait on cv_.
  bool count_in(std::unique_lock<std::mutex>& lock, std::uint64_t generation) {
    if (++arrived_ == size_) {
      complete_episode();
      lock.unlock();
      cv_.notify_all();
      return true;
    }
    lock.unlock();
    if (spin_until_changed(generation)) return true;
    lock.lock();
    return false;
  }

  void complete_episode() {
    arrived_ = 0;
    std::fill(present_.begin(), present_.end(), 0);
    ++generation_;
    published_generation_.store(generation_, std::memory_order_release);
  }

  // Waiting briefly without sleeping saves the two wake-ups of a sleep for collectives that
  // complete within microseconds. Only when every rank can have a core of its own; and after a
  // few rounds the spinner yields its core at each round, in case another process holds the
  // other cores and the rank it waits for needs this one.
  bool spin_until_changed(std::uint64_t generation) const {
    if (!spin_) return false;
    const auto until = Clock::now() + std::chrono::microseconds(30);
    for (unsigned i = 1;; ++i) {
      if (published_generation_.load(std::memory_order_acquire) != generation) return true;
      if (i < 64) {
#if defined(__SSE2__)
        _mm_pause();
#endif
        continue;
      }
      if (Clock::now() > until) return false;
      std::this_thread::yield();
    }
  }

  // Ranks absent from the current episode (only those whose function returned, if `gone`).
  std::vector<int> missing(bool gone) const {
    std::vector<int> out;
    for (int r = 0; r < size_; ++r) {
      if (!present_[static_cast<std::size_t>(r)] && (!gone || finished_[static_cast<std::size_t>(r)])) out.push_back(r);
    }
    return out;
  }

  void break_world(Broken why, int rank, std::string reason) {
    broken_ = why;
    broken_generation_ = generation_;
    reason_ = std::move(reason);
    // The rank that saw the problem first is the one run_ranks reports (if its error reaches it).
    if (first_failure_ < 0) first_failure_ = rank;
    cv_.notify_all();
  }

  // Raises the world's failure. `same_episode`: this rank waited in the collective that broke it.
  [[noreturn]] void throw_broken(bool same_episode) const {
    switch (broken_) {
      case Broken::finished:
        throw CollectiveMismatchError(reason_);
      case Broken::timeout:
        if (same_episode) throw CollectiveTimeoutError(reason_);
        throw RankFailedError("an earlier collective timed out: " + reason_);
      case Broken::failed:
      case Broken::no:
        break;
    }
    throw RankFailedError(reason_);
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  const int size_;
  const std::chrono::milliseconds timeout_;
  const bool spin_;
  std::vector<Slot> slots_;
  std::atomic<std::uint64_t> published_generation_{0};  // generation_, for spinning without the lock
  // Guarded by mutex_:
  int arrived_ = 0;
  std::uint64_t generation_ = 0;  // completed episodes (two per collective)
  std::vector<char> present_;     // who arrived in the current episode
  std::vector<char> finished_;    // whose function returned
  Broken broken_ = Broken::no;
  std::uint64_t broken_generation_ = 0;
  std::string reason_;
  std::vector<std::exception_ptr> errors_;
  std::vector<int> failure_order_;
  int first_failure_ = -1;
};

// A non-blocking collective under a link model: its data moved at the start, it is done when
// the modeled link time has passed.
class LinkedState final : public Work::State {
 public:
  LinkedState(Tensor out, Clock::time_point done) : out_(std::move(out)), done_(done) {}
  Tensor wait() override {
    std::this_thread::sleep_until(done_);
    return std::move(out_);
  }
  bool ready() override { return Clock::now() >= done_; }
  std::optional<Clock::time_point> completed_at() const override { return done_; }

 private:
  Tensor out_;
  Clock::time_point done_;
};

class EmulatedCommunicator final : public Communicator {
 public:
  EmulatedCommunicator(World& world, int rank, LinkModel link)
      : Communicator(rank, world.size()), world_(world), link_(link) {}
  std::string_view kind() const noexcept override { return "emulated"; }

 protected:
  // With a link model, the non-blocking forms return at once and complete at the modeled time.
  Work start_all_gather(const Tensor& local, Tensor out, std::int64_t count) override {
    const Clock::time_point done =
        deferred([&] { do_all_gather(local.data_ptr(), out.data_ptr(), count, local.dtype()); });
    return Work(std::make_unique<LinkedState>(std::move(out), done));
  }
  Work start_reduce_scatter(const Tensor& full, Tensor out, std::int64_t count, Accumulate accumulate) override {
    const Clock::time_point done =
        deferred([&] { do_reduce_scatter(full.data_ptr(), out.data_ptr(), count, full.dtype(), accumulate); });
    return Work(std::make_unique<LinkedState>(std::move(out), done));
  }

  void do_all_gather(const void* send, void* recv, std::int64_t count, DType dtype) override {
    Slot s = slot(Kind::all_gather, dtype, count);
    s.send = send;
    s.recv = recv;
    run(s, [&] {
      const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(dtype);
      if (bytes == 0) return;
      auto* out = static_cast<std::byte*>(recv);
      const bool streaming = bytes * static_cast<std::size_t>(world_size()) >= cd::kStreamingBytes;
      for (int k = 0; k < world_size(); ++k) cd::copy(out + k * bytes, world_.slot(k).send, bytes, streaming);
    });
  }

  void do_reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype,
                         Accumulate accumulate) override {
    Slot s = slot(Kind::reduce_scatter, dtype, count);
    s.send = send;
    s.recv = recv;
    s.accumulate = accumulate;
    run(s, [&] {
      const std::size_t offset = static_cast<std::size_t>(rank()) * static_cast<std::size_t>(count) * dtype_size(dtype);
      for (int k = 0; k < world_size(); ++k) {
        sources_[static_cast<std::size_t>(k)] = static_cast<const std::byte*>(world_.slot(k).send) + offset;
      }
      cd::sum(sources_.data(), world_size(), recv, count, dtype, accumulate);
    });
  }

  void do_all_reduce(const void* send, void* recv, std::int64_t count, DType dtype, Reduction op,
                     Accumulate accumulate) override {
    Slot s = slot(Kind::all_reduce, dtype, count);
    s.send = send;
    s.recv = recv;
    s.reduction = op;
    s.accumulate = accumulate;
    run(s, [&] {
      // Each rank reduces one stretch of the elements and writes it into every rank's result.
      const int n = world_size();
      const std::int64_t lo = (count / n) * rank() + std::min<std::int64_t>(rank(), count % n);
      const std::int64_t len = count / n + (rank() < count % n ? 1 : 0);
      if (len == 0) return;
      const std::size_t size = dtype_size(dtype);
      const std::size_t offset = static_cast<std::size_t>(lo) * size;
      for (int k = 0; k < n; ++k) {
        sources_[static_cast<std::size_t>(k)] = static_cast<const std::byte*>(world_.slot(k).send) + offset;
      }
      std::byte* mine = static_cast<std::byte*>(recv) + offset;
      if (op == Reduction::max) {
        cd::max(sources_.data(), n, mine, len, dtype);
      } else {
        cd::sum(sources_.data(), n, mine, len, dtype, accumulate);
      }
      for (int k = 0; k < n; ++k) {
        if (k != rank()) std::memcpy(static_cast<std::byte*>(world_.slot(k).recv) + offset, mine, len * size);
      }
    });
  }

  void do_broadcast(const void* send, void* recv, std::int64_t count, DType dtype, int root) override {
    Slot s = slot(Kind::broadcast, dtype, count);
    s.send = send;
    s.recv = recv;
    s.root = root;
    run(s, [&] {
      const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(dtype);
      cd::copy(recv, world_.slot(root).send, bytes, bytes >= cd::kStreamingBytes);
    });
  }

  void do_barrier() override {
    run(slot(Kind::barrier, DType::f32, 0), [] {});
  }

  std::vector<std::string> exchange_fingerprints(const std::string& fingerprint) override {
    Slot s = slot(Kind::fingerprint, DType::f32, 0);
    s.send = &fingerprint;
    std::vector<std::string> all(static_cast<std::size_t>(world_size()));
    run(s, [&] {
      for (int k = 0; k < world_size(); ++k) {
        all[static_cast<std::size_t>(k)] = *static_cast<const std::string*>(world_.slot(k).send);
      }
    });
    return all;
  }

 private:
  Slot slot(Kind kind, DType dtype, std::int64_t count) {
    Slot s;
    s.kind = kind;
    s.dtype = dtype;
    s.count = count;
    s.owner = this;
    s.sequence = current_sequence();
    return s;
  }

  // One collective: publish, meet, work on the others' buffers, meet again. The ranks always
  // check that they are in the same collective with the same dtype and count (else they would
  // read past each other's buffers); the order check adds tags on top.
  template <class Task>
  void run(const Slot& mine, Task&& work) {
    world_.slot(rank()) = mine;
    sources_.resize(static_cast<std::size_t>(world_size()));
    world_.arrive(rank(), [&] { return cd::numbered(current_sequence(), current_call()); });
    // From here on every rank must reach depart(), whatever happens: the others read our buffers.
    std::string mismatch;
    std::exception_ptr error;
    try {
      mismatch = compare_slots();
      if (mismatch.empty()) work();
    } catch (...) {
      error = std::current_exception();
    }
    world_.depart();
    if (error) std::rethrow_exception(error);
    if (!mismatch.empty()) throw CollectiveMismatchError(mismatch);
    occupy_link(mine);
  }

  // The link model: the collective occupies this rank's link for its modeled time, after the
  // collectives before it. A blocking collective sleeps until it is done; a non-blocking one
  // (deferred) leaves the time to its Work.
  void occupy_link(const Slot& s) {
    if (!link_.enabled() || s.kind == Kind::fingerprint) return;  // the order check is a debugging aid, not traffic
    const auto bytes = static_cast<std::uint64_t>(s.count) * dtype_size(s.dtype);
    const int n = world_size();
    std::chrono::nanoseconds time{0};
    switch (s.kind) {
      case Kind::all_gather:
        time = link_.all_gather_time(n, bytes);
        break;
      case Kind::reduce_scatter:
        time = link_.reduce_scatter_time(n, bytes);
        break;
      case Kind::all_reduce:
        time = link_.all_reduce_time(n, bytes);
        break;
      case Kind::broadcast:
        time = link_.broadcast_time(n, bytes);
        break;
      case Kind::barrier:
        time = link_.barrier_time(n);
        break;
      case Kind::fingerprint:
        break;
    }
    link_free_ = std::max(link_free_, Clock::now()) + std::chrono::duration_cast<Clock::duration>(time);
    if (!deferring_) std::this_thread::sleep_until(link_free_);
  }

  // Runs a collective without waiting for its link time; returns when it will be done.
  template <class F>
  Clock::time_point deferred(F&& collective) {
    deferring_ = true;
    try {
      collective();
    } catch (...) {
      deferring_ = false;
      throw;
    }
    deferring_ = false;
    return link_.enabled() ? link_free_ : Clock::now();
  }

  std::string compare_slots() {
    const Slot& first = world_.slot(0);
    bool same = true, same_sequence = true;
    for (int k = 1; k < world_size(); ++k) {
      same = same && world_.slot(k).same_collective(first);
      same_sequence = same_sequence && world_.slot(k).sequence == first.sequence;
    }
    if (same) return {};
    std::vector<std::string> calls;
    for (int k = 0; k < world_size(); ++k) {
      const Slot& s = world_.slot(k);
      std::string call = s.owner->current_call();
      if (s.kind == Kind::fingerprint) call = "order check of " + call;
      calls.push_back(same_sequence ? call : cd::numbered(s.sequence, call));
    }
    return cd::mismatch_message(current_sequence(), calls);
  }

  World& world_;
  std::vector<const void*> sources_;
  LinkModel link_;
  Clock::time_point link_free_{};  // when this rank's link has sent everything started so far
  bool deferring_ = false;
};

int threads_per_rank(int world_size, int requested) {
  if (requested > 0) return requested;
  if (const char* env = std::getenv("RUDA_NUM_THREADS"); env && *env) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  return std::max(1, hardware_threads() / world_size);
}

}  // namespace

void run_ranks(int world_size, const std::function<void(Communicator&)>& fn, EmulatedOptions options) {
  if (world_size < 1) fail<ArgumentError>("run_ranks", "world size must be positive, got ", world_size);
  if (!fn) fail<ArgumentError>("run_ranks", "no function to run");
  if (options.timeout.count() <= 0) {
    fail<ArgumentError>("run_ranks", "timeout must be positive, got ", options.timeout.count(), " ms");
  }
  if (options.threads_per_rank < 0) {
    fail<ArgumentError>("run_ranks", "threads per rank must not be negative, got ", options.threads_per_rank);
  }
  const int threads = threads_per_rank(world_size, options.threads_per_rank);
  World world(world_size, options.timeout);
  auto body = [&](int rank) {
    try {
      memory::Scope scope;  // this rank's memory figures
      set_num_threads(threads);
      EmulatedCommunicator comm(world, rank, options.link);
      comm.set_order_check(options.check_order);
      fn(comm);
      world.finish(rank);
    } catch (...) {
      world.fail(rank, std::current_exception());
    }
  };
  std::vector<std::thread> ranks;
  ranks.reserve(static_cast<std::size_t>(world_size));
  try {
    for (int r = 0; r < world_size; ++r) ranks.emplace_back(body, r);
  } catch (...) {
    // The ranks already running would wait for the missing one: fail it so they stop.
    world.fail(static_cast<int>(ranks.size()), std::current_exception());
    for (auto& t : ranks) t.join();
    throw;
  }
  for (auto& t : ranks) t.join();
  world.rethrow_first_failure();
}

}  // namespace ruda
