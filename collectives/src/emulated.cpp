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
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <system_error>
#include <thread>
#include <tuple>

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

enum class Kind : std::uint8_t { all_gather, reduce_scatter, all_reduce, broadcast, barrier, fingerprint, split };

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
  int color = 0, key = 0;                       // split: not compared (ranks pass different ones)
  bool by_node = false;                         // split: split_by_node rather than split
  const EmulatedCommunicator* owner = nullptr;  // whose call it is, described only for messages
  std::uint64_t sequence = 0;
  // The input tensor's shape (the call's record's): equal counts of different shapes ([2, 3] and
  // [3, 2]) are different collectives. A fixed array: slots are built for every call.
  int ndim = 0;
  std::array<std::int64_t, kMaxDims> shape{};

  bool same_shape(const Slot& o) const {
    return ndim == o.ndim && std::equal(shape.begin(), shape.begin() + ndim, o.shape.begin());
  }

  // How a 16-bit sum accumulates changes its result; elsewhere (f32, f64 and i64 sums, max) the
  // option has no effect, so ranks that pass different ones still call the same collective (as
  // they do under MPI).
  bool accumulate_matters() const {
    return is_16bit_float(dtype) &&
           (kind == Kind::reduce_scatter || (kind == Kind::all_reduce && reduction == Reduction::sum));
  }
  // Everything but the shape (which messages show only where nothing else differs), then all.
  bool same_call(const Slot& o) const {
    return kind == o.kind && dtype == o.dtype && count == o.count && root == o.root && reduction == o.reduction &&
           by_node == o.by_node && (!accumulate_matters() || accumulate == o.accumulate);
  }
  bool same_collective(const Slot& o) const { return same_call(o) && same_shape(o); }
};

// What an exception says ("unknown exception" for one that is not a std::exception).
std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
  }
  return "unknown exception";
}

// Why the world stopped. Every later collective reports it instead of waiting.
enum class Broken : std::uint8_t { no, failed, timeout, finished };

class World {
 public:
  /// `members`: the run's rank (run_ranks' numbering) of each of this world's ranks, in order.
  World(std::vector<int> members, std::chrono::milliseconds timeout)
      : id_(next_id()),
        size_(static_cast<int>(members.size())),
        timeout_(timeout),
        spin_(size_ <= hardware_threads()),
        members_(std::move(members)),
        slots_(size_),
        present_(size_, 0),
        finished_(size_, 0),
        errors_(size_) {}

  int size() const noexcept { return size_; }
  /// Unique in the process: what the Fabric keys a world by (an address is reused once it is freed).
  std::uint64_t id() const noexcept { return id_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  const std::vector<int>& members() const noexcept { return members_; }
  /// This world's rank of the run's rank `run_rank`, -1 if it is not a member.
  int local_rank(int run_rank) const noexcept {
    const auto it = std::find(members_.begin(), members_.end(), run_rank);
    return it == members_.end() ? -1 : static_cast<int>(it - members_.begin());
  }

  /// A rank failed elsewhere (in the run's world or another split): every collective here that
  /// waits now or starts later raises RankFailedError with `reason`.
  void abandon(const std::string& reason) {
    {
      std::lock_guard lock(mutex_);
      if (broken_ != Broken::no) return;
      broken_ = Broken::failed;
      broken_generation_ = generation_;
      reason_ = reason;
    }
    cv_.notify_all();
  }
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
    // A timeout longer than a century waits as long as one (now + timeout in the clock's
    // nanoseconds would overflow past ~292 years and wrap into the past).
    constexpr auto kLongestWait = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::hours(24 * 36525));
    const auto deadline = Clock::now() + std::min(timeout_, kLongestWait);
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
    const std::string what = message_of(error);
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
  static std::uint64_t next_id() noexcept {
    static std::atomic<std::uint64_t> next{1};
    return next.fetch_add(1, std::memory_order_relaxed);
  }
  const std::uint64_t id_;
  const int size_;
  const std::chrono::milliseconds timeout_;
  const bool spin_;
  const std::vector<int> members_;
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

// Everything one run_ranks shares: its world, the communicators split from it (each a World of
// its own), and the simulated nodes' links. A failure anywhere breaks every world, so that no
// rank waits in a split for a rank that is gone.
class Fabric {
 public:
  Fabric(int size, std::chrono::milliseconds timeout, int ranks_per_node)
      : timeout_(timeout), ranks_per_node_(ranks_per_node), nic_free_(static_cast<std::size_t>(size / ranks_per_node)) {
    std::vector<int> all(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) all[static_cast<std::size_t>(r)] = r;
    root_ = std::make_shared<World>(std::move(all), timeout);
  }

  World& root() noexcept { return *root_; }
  const std::shared_ptr<World>& root_ptr() const noexcept { return root_; }
  int node_of(int run_rank) const noexcept { return run_rank / ranks_per_node_; }
  int ranks_per_node() const noexcept { return ranks_per_node_; }

  /// The world of split number `split` (the parent's collective number) of `parent` for `color`,
  /// made by the first of its members to ask; `members` are the run's ranks in the new order.
  /// The fabric holds splits weakly: their communicators own them, and a world whose
  /// communicators are all destroyed goes (each kept forever, a run that split every step grew by
  /// ~0.9 kB a split, 31 MB over 40000).
  std::shared_ptr<World> split(const World& parent, std::uint64_t split, int color, std::vector<int> members) {
    std::shared_ptr<World> world;
    std::vector<int> returned;  // its members whose function has returned (its local ranks)
    {
      std::lock_guard lock(mutex_);
      forget_destroyed();
      std::weak_ptr<World>& slot = splits_[{parent.id(), split, color}];
      world = slot.lock();
      if (!world) {
        world = std::make_shared<World>(std::move(members), timeout_);
        if (!failure_.empty()) world->abandon(failure_);
        for (const int run_rank : finished_) {
          if (const int local = world->local_rank(run_rank); local >= 0) returned.push_back(local);
        }
        slot = world;
      }
    }
    // A member whose function has returned never joins it (an earlier world of this split may
    // have gone with its communicators, and finish() reached that one): said now, outside the
    // fabric's lock as finish() does, or a rank waiting in it would wait out the timeout.
    for (const int local : returned) world->finish(local);
    return world;
  }

  void fail(int run_rank, std::exception_ptr error) {
    const std::string what = message_of(error);
    root_->fail(run_rank, error);
    // Numbered as run_ranks numbers it, and said so: the error's prefix numbers the split's own
    // ranks (rank 1 of a split may be the run's rank 3), and the two read as one numbering.
    const std::string reason = "rank " + std::to_string(run_rank) + " of the run failed: " + what;
    for (const auto& w : splits(reason)) w->abandon(reason);
  }

  /// run_ranks returned: a communicator split from the run and kept past it reaches no other rank
  /// (they have returned). Its collectives raise at once instead of waiting for them (its world
  /// used to be freed under it, and a call read "ranks  did not arrive").
  void end_run() {
    const std::string reason =
        "the emulated run has ended (run_ranks returned): a communicator kept past it reaches no other rank";
    for (const auto& w : splits(reason)) w->abandon(reason);
  }

  void finish(int run_rank) {
    root_->finish(run_rank);
    {
      std::lock_guard lock(mutex_);
      finished_.insert(run_rank);
    }
    for (const auto& w : splits({})) {
      if (const int local = w->local_rank(run_rank); local >= 0) w->finish(local);
    }
  }

  /// The simulated link of `node` for one instance of a collective (number `sequence` of `world`)
  /// that crosses nodes and takes `time`: the instance's first rank on the node reserves the link
  /// from `ready` (or when it is free, if later), the node's other ranks in the same instance get
  /// the same completion time.
  Clock::time_point reserve(const World& world, int node, std::uint64_t sequence, Clock::time_point ready,
                            std::chrono::nanoseconds time) {
    std::lock_guard lock(mutex_);
    auto& [last, done] = reservations_[{world.id(), node}];
    if (last == sequence) return done;
    Clock::time_point& free = nic_free_[static_cast<std::size_t>(node)];
    last = sequence;
    done = std::max(ready, free) + std::chrono::duration_cast<Clock::duration>(time);
    free = done;
    return done;
  }

 private:
  std::vector<std::shared_ptr<World>> splits(const std::string& failure) {
    std::lock_guard lock(mutex_);
    if (!failure.empty() && failure_.empty()) failure_ = failure;
    std::vector<std::shared_ptr<World>> live;
    for (const auto& [key, w] : splits_) {
      if (auto world = w.lock()) live.push_back(std::move(world));
    }
    return live;
  }

  // Under mutex_: drops the splits whose communicators are all gone, and their link reservations.
  void forget_destroyed() {
    std::erase_if(splits_, [](const auto& entry) { return entry.second.expired(); });
    std::set<std::uint64_t> live = {root_->id()};
    for (const auto& [key, w] : splits_) {
      if (const auto world = w.lock()) live.insert(world->id());
    }
    std::erase_if(reservations_, [&](const auto& entry) { return !live.count(entry.first.first); });
  }

  std::mutex mutex_;
  const std::chrono::milliseconds timeout_;
  const int ranks_per_node_;
  std::shared_ptr<World> root_;
  // Guarded by mutex_:
  // Each split's world, by (parent's id, split number, color): held by its communicators alone.
  std::map<std::tuple<std::uint64_t, std::uint64_t, int>, std::weak_ptr<World>> splits_;
  std::string failure_;
  std::set<int> finished_;                   // run ranks whose function returned
  std::vector<Clock::time_point> nic_free_;  // per node
  std::map<std::pair<std::uint64_t, int>, std::pair<std::uint64_t, Clock::time_point>> reservations_;  // by world id
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
  // The communicator shares ownership of its world and the run's fabric: a split kept past
  // run_ranks stays valid (and its collectives say the run has ended).
  EmulatedCommunicator(std::shared_ptr<World> world_ptr, int rank, LinkModel link, std::shared_ptr<Fabric> fabric_ptr)
      : Communicator(rank, world_ptr->size()),
        world_owner_(std::move(world_ptr)),
        fabric_owner_(std::move(fabric_ptr)),
        world_(*world_owner_),
        fabric_(*fabric_owner_),
        link_(link),
        node_(fabric_.node_of(world_.members()[static_cast<std::size_t>(rank)])) {
    for (const int member : world_.members()) spans_nodes_ = spans_nodes_ || fabric_.node_of(member) != node_;
  }
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
  Work start_all_reduce(const Tensor& x, Tensor out, std::int64_t count, Reduction op, Accumulate accumulate) override {
    const Clock::time_point done =
        deferred([&] { do_all_reduce(x.data_ptr(), out.data_ptr(), count, x.dtype(), op, accumulate); });
    return Work(std::make_unique<LinkedState>(std::move(out), done));
  }

  std::unique_ptr<Communicator> do_split(int color, int key) override { return split_world(color, key, false); }
  std::unique_ptr<Communicator> do_split_by_node() override { return split_world(node_, rank(), true); }

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

  // The ranks of `color` ordered by (key, rank) become a world of their own, registered with the
  // fabric under this world and this call's number, so that every member finds the same one.
  std::unique_ptr<Communicator> split_world(int color, int key, bool by_node) {
    Slot s = slot(Kind::split, DType::f32, 0);
    s.color = color;
    s.key = key;
    s.by_node = by_node;
    std::vector<int> members;
    int new_rank = -1;
    run(s, [&] {
      std::vector<std::pair<int, int>> order;  // (key, rank) of this colour
      for (int k = 0; k < world_size(); ++k) {
        if (world_.slot(k).color == color) order.emplace_back(world_.slot(k).key, k);
      }
      std::sort(order.begin(), order.end());
      for (const auto& [k, r] : order) {
        if (r == rank()) new_rank = static_cast<int>(members.size());
        members.push_back(world_.members()[static_cast<std::size_t>(r)]);
      }
    });
    return std::make_unique<EmulatedCommunicator>(fabric_.split(world_, current_sequence(), color, std::move(members)),
                                                  new_rank, link_, fabric_owner_);
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
    // (An order check's fingerprints carry the shape in their text: its slot compares none.)
    if (kind != Kind::fingerprint) {
      const Shape& shape = current_record().shape;
      s.ndim = static_cast<int>(std::min<std::size_t>(shape.size(), kMaxDims));
      std::copy(shape.begin(), shape.begin() + s.ndim, s.shape.begin());
    }
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
    // The order check is a debugging aid and a split is set-up, neither is traffic.
    if (!link_.enabled() || s.kind == Kind::fingerprint || s.kind == Kind::split) return;
    const auto bytes = static_cast<std::uint64_t>(s.count) * dtype_size(s.dtype);
    const int n = world_size();
    std::chrono::nanoseconds time{0};
    const char* op = "";
    switch (s.kind) {
      case Kind::all_gather:
        time = link_.all_gather_time(n, bytes), op = "all_gather";
        break;
      case Kind::reduce_scatter:
        time = link_.reduce_scatter_time(n, bytes), op = "reduce_scatter";
        break;
      case Kind::all_reduce:
        time = link_.all_reduce_time(n, bytes), op = "all_reduce";
        break;
      case Kind::broadcast:
        time = link_.broadcast_time(n, bytes), op = "broadcast";
        break;
      case Kind::barrier:
        time = link_.barrier_time(n), op = "barrier";
        break;
      case Kind::fingerprint:
      case Kind::split:
        break;
    }
    // A modeled time past the collective timeout would sleep through it (a 1 bit/s link slept
    // for hours, deaf to the timeout): refused, on every rank alike (the time is the same on each).
    if (time > world_.timeout()) {
      fail<ArgumentError>(op, "rank ", rank(), ": the link model (", link_.describe(), ") makes this ", bytes,
                          "-byte collective take ", static_cast<double>(time.count()) * 1e-9,
                          " s, longer than the collective timeout of ", world_.timeout().count(), " ms");
    }
    // In order after this communicator's collectives before it; traffic inside a node is free,
    // traffic across nodes waits for each node's link (shared with the node's other communicators).
    const Clock::time_point ready = std::max(link_free_, Clock::now());
    link_free_ = spans_nodes_ ? fabric_.reserve(world_, node_, s.sequence, ready, time) : ready;
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
    bool same = true, same_calls = true, same_sequence = true;
    for (int k = 1; k < world_size(); ++k) {
      same = same && world_.slot(k).same_collective(first);
      same_calls = same_calls && world_.slot(k).same_call(first);
      same_sequence = same_sequence && world_.slot(k).sequence == first.sequence;
    }
    if (same) return {};
    // The shapes are shown only where nothing else tells the calls apart.
    const bool only_shapes = same_calls && same_sequence;
    std::vector<std::string> calls;
    for (int k = 0; k < world_size(); ++k) {
      const Slot& s = world_.slot(k);
      std::string call = s.owner->current_call();
      if (only_shapes) call += " of " + to_string(Shape(s.shape.begin(), s.shape.begin() + s.ndim));
      if (s.kind == Kind::fingerprint) call = "order check of " + call;
      calls.push_back(same_sequence ? call : cd::numbered(s.sequence, call));
    }
    return cd::mismatch_message(current_sequence(), calls);
  }

  std::shared_ptr<World> world_owner_;
  std::shared_ptr<Fabric> fabric_owner_;
  World& world_;
  Fabric& fabric_;
  std::vector<const void*> sources_;
  LinkModel link_;
  int node_;                       // the simulated node of this rank
  bool spans_nodes_ = false;       // whether this communicator's ranks are on more than one node
  Clock::time_point link_free_{};  // when this rank's link has sent everything started so far
  bool deferring_ = false;
};

// More emulated ranks than this are refused (each is a thread with its own kernels' threads).
constexpr int kMaxEmulatedRanks = 4096;

int threads_per_rank(int world_size, int requested) {
  if (requested > 0) return requested;
  if (const int n = num_threads_from_env(); n > 0) return n;
  return std::max(1, hardware_threads() / world_size);
}

}  // namespace

void run_ranks(int world_size, const std::function<void(Communicator&)>& fn, EmulatedOptions options) {
  if (world_size < 1) fail<ArgumentError>("run_ranks", "world size must be positive, got ", world_size);
  if (world_size > kMaxEmulatedRanks) {
    fail<ArgumentError>("run_ranks", "world size ", world_size, " is more than the ", kMaxEmulatedRanks,
                        " ranks ruda emulates in one process (each is a thread)");
  }
  const LinkModel link = options.link ? *options.link : LinkModel::from_env();
  // A link the parser would refuse (its fields set directly).
  if (const std::string problem = cd::link_problem(link); !problem.empty()) {
    fail<ArgumentError>("run_ranks", "the link model (", link.bytes_per_second, " bytes/s, ", link.latency.count(),
                        " ns latency) has ", problem,
                        ": its bandwidth must be 0 (off) or at least 1 bit/s, its latency within [0, 1 hour]");
  }
  if (!fn) fail<ArgumentError>("run_ranks", "no function to run");
  if (options.timeout.count() <= 0) {
    fail<ArgumentError>("run_ranks", "timeout must be positive, got ", options.timeout.count(), " ms");
  }
  if (options.threads_per_rank < 0) {
    fail<ArgumentError>("run_ranks", "threads per rank must not be negative, got ", options.threads_per_rank);
  }
  if (options.ranks_per_node < 1 || world_size % options.ranks_per_node != 0) {
    fail<TopologyError>("run_ranks", "ranks per node ", options.ranks_per_node, " does not divide a world of ",
                        world_size, " ranks into nodes of equal size");
  }
  const int threads = threads_per_rank(world_size, options.threads_per_rank);
  const auto shared_fabric = std::make_shared<Fabric>(world_size, options.timeout, options.ranks_per_node);
  Fabric& fabric = *shared_fabric;
  World& world = fabric.root();
  auto body = [&](int rank) {
    try {
      memory::Scope scope;  // this rank's memory figures
      set_num_threads(threads);
      EmulatedCommunicator comm(fabric.root_ptr(), rank, link, shared_fabric);
      comm.set_order_check(options.check_order);
      fn(comm);
      fabric.finish(rank);
    } catch (...) {
      fabric.fail(rank, std::current_exception());
    }
  };
  std::vector<std::thread> ranks;
  ranks.reserve(static_cast<std::size_t>(world_size));
  std::exception_ptr start_error;
  try {
    for (int r = 0; r < world_size; ++r) ranks.emplace_back(body, r);
  } catch (const std::system_error& e) {  // the system refused a thread (limits, memory)
    start_error = std::make_exception_ptr(CollectiveError(
        detail::concat("run_ranks: cannot start rank ", ranks.size(), " of ", world_size, ": ", e.what())));
  } catch (...) {
    start_error = std::current_exception();
  }
  // The ranks already running would wait for a missing one: fail it so they stop.
  if (start_error) fabric.fail(static_cast<int>(ranks.size()), start_error);
  for (auto& t : ranks) t.join();
  fabric.end_run();
  if (start_error) std::rethrow_exception(start_error);
  world.rethrow_first_failure();
}

}  // namespace ruda
