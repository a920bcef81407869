// The MPI communicator: MPI collectives where they are good, a ring of ruda's own for
// reduce_scatter (mpi_ring.cpp), a progress thread for the non-blocking forms
// (progress_thread.cpp), typed errors throughout, and a watchdog that ends the job when a
// collective waits longer than the collective timeout.
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <future>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <vector>

#include <ruda/memory.h>
#include <ruda/mpi.h>

#include "algorithm_choice.h"
#include "internal.h"
#include "mpi_ring.h"
#include "mpi_support.h"
#include "progress_thread.h"

namespace ruda {

namespace {

namespace cd = collectives_detail;

// The line a rank prints when a wait no watchdog covers (the start-up collectives, MPI_Init,
// MPI_Finalize) ran past the timeout; `who` is "rank 0 of 3 failed" or, before MPI runs, "rank 0".
void print_unwatched_timeout(const std::string& who, const char* what, std::chrono::milliseconds limit) {
  std::fprintf(stderr,
               "ruda: %s: %s: not complete after the collective timeout of %s (RUDA_COLLECTIVE_TIMEOUT): another "
               "rank did not arrive (no watchdog runs here to name it: its process is stopped, frozen or has "
               "exited, or its node is unreachable)\n",
               who.c_str(), what, format_collective_timeout(limit).c_str());
  std::fflush(stderr);
}

// The job's start-up collectives (agree_on_startup, a communicator's creation) run before any
// watchdog exists: blocking, a rank stopped or frozen there hung every other rank forever, whatever
// RUDA_COLLECTIVE_TIMEOUT said. They run non-blocking instead, waited for here: past `limit` (0:
// none) this rank reports and ends the job as the watchdog does.
void wait_unwatched(MPI_Request& request, std::chrono::milliseconds limit, const char* what) {
  const auto start = std::chrono::steady_clock::now();
  auto pause = std::chrono::microseconds(50);
  for (;;) {
    int done = 0;
    mpi_detail::check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), what);
    if (done) return;
    if (limit.count() > 0 && std::chrono::steady_clock::now() - start > limit) {
      int rank = -1, size = 0;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      MPI_Comm_size(MPI_COMM_WORLD, &size);
      print_unwatched_timeout("rank " + std::to_string(rank) + " of " + std::to_string(size) + " failed", what, limit);
      MPI_Abort(MPI_COMM_WORLD, 1);
      std::abort();  // MPI_Abort does not return
    }
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(10));
  }
}

// RUDA_COLLECTIVE_TIMEOUT for the start-up waits; the default where it is not valid (whose error
// the communicator's own agreement reports on every rank).
std::chrono::milliseconds startup_timeout() {
  try {
    return collective_timeout_from_env();
  } catch (const ArgumentError&) {
    return kDefaultCollectiveTimeout;
  }
}
using mpi_detail::Buffer;
using mpi_detail::check;
using mpi_detail::int_count;
using mpi_detail::kMaxCount;
using mpi_detail::mpi_type;

// User-defined MPI operations: inout = in (op) inout, on ruda's kernels (NaN-propagating max,
// 16-bit sums rounded at every step).
template <DType D>
void max_op(void* in, void* inout, int* len, MPI_Datatype*) {
  const void* sources[2] = {inout, in};
  cd::max(sources, 2, inout, *len, D);
}
template <DType D>
void native_sum_op(void* in, void* inout, int* len, MPI_Datatype*) {
  const void* sources[2] = {inout, in};
  cd::sum(sources, 2, inout, *len, D, Accumulate::native);
}

// The watchdog. Blocking MPI collectives cannot be interrupted, and their non-blocking forms
// (libnbc here) are 1.3-3x slower, so collectives keep running as they are and a thread per
// communicator watches them: it notes which collective each of the rank's threads is in and
// since when, and answers the other ranks' queries ("which collective are you in?") even while
// the rank computes. When a collective has waited longer than the timeout, the watchdog asks the
// other ranks where they are, prints who did not arrive and ends the job with MPI_Abort.
// Queries and answers are point-to-point messages on the control communicator, sent and received
// by the watchdog threads only.
constexpr int kQueryTag = 7101;   // "which collective are you in?"
constexpr int kAnswerTag = 7102;  // the answer
struct Note {
  std::uint64_t id = 0;           // a query's number, echoed by its answers
  std::uint64_t sequence = 0;     // query: the asker's collective; answer: the one the rank is in, or finished last
  std::int64_t milliseconds = 0;  // answer: for how long it has been in it, or since it finished
  std::int32_t waiting = 0;       // answer: 1 if the rank is in collective `sequence` now
  char op[36] = {};               // answer: that collective's operation
};
using Clock = std::chrono::steady_clock;
// How often the watchdog looks at the collectives in flight and answers queries.
constexpr auto kWatchPeriod = std::chrono::milliseconds(50);
// How long a rank whose collective timed out waits for the others' answers (at most the timeout).
constexpr auto kGrace = std::chrono::milliseconds(1000);
// A gap between two of the watchdog's looks longer than this means this rank's own process did
// not run meanwhile (SIGSTOP, a paused VM, swapping, a starved thread): the watchdog sleeps
// kWatchPeriod between looks and does nothing that blocks, so a look normally follows the previous
// one after ~kWatchPeriod, a few scheduler time slices late at worst on a loaded machine. Such a
// gap, less one kWatchPeriod, is not counted against the collective timeout: the rank could not
// tell whether its peers were late meanwhile, and the peers that waited for it have timed out
// themselves. Without this, a rank stopped for longer than the timeout blamed a peer when it was
// resumed (mpiexec sends SIGCONT when it ends the job): "rank 0 did not arrive at collective #497"
// of a rank that had passed #497 and exited. steady_clock (CLOCK_MONOTONIC) runs on while the
// process is stopped, which is what shows the gap; it stops only while the whole machine
// suspends, when no rank waits either. Neither the process's CPU time (a rank blocked in MPI uses
// little or much, depending on how MPI waits) nor CLOCK_BOOTTIME (it differs from
// CLOCK_MONOTONIC only across a suspend) tells a stopped process apart.
constexpr auto kStallGap = std::chrono::milliseconds(500);

std::int64_t millis_since(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

std::string seconds_text(std::int64_t ms) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", static_cast<double>(ms) / 1000.0);
  return text;
}

}  // namespace

// --- MpiEnvironment ---

namespace {
// MPI_Init and MPI_Finalize wait for every rank (their fences) and no watchdog can run inside
// them: a rank stopped or frozen before either hung the others there forever. While one runs, a
// timer thread waits out RUDA_COLLECTIVE_TIMEOUT (0: none) and then ends this process with a
// message and a non-zero exit, which makes mpiexec end the job (MPI_Abort needs MPI running).
class StartOrEndDeadline {
 public:
  explicit StartOrEndDeadline(const char* what) noexcept {
    const std::chrono::milliseconds limit = startup_timeout();
    if (limit.count() == 0) return;
    try {
      timer_ = std::thread([this, limit, what] {
        std::unique_lock lock(mutex_);
        if (done_.wait_for(lock, limit, [this] { return finished_; })) return;
        const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");  // MPI is not running: the launcher's
        print_unwatched_timeout(std::string("rank ") + (rank ? rank : "?"), what, limit);
        std::_Exit(1);
      });
    } catch (...) {  // no thread: the call runs unwatched, as before
    }
  }
  ~StartOrEndDeadline() {
    if (!timer_.joinable()) return;
    {
      const std::lock_guard lock(mutex_);
      finished_ = true;
    }
    done_.notify_all();
    timer_.join();
  }
  StartOrEndDeadline(const StartOrEndDeadline&) = delete;
  StartOrEndDeadline& operator=(const StartOrEndDeadline&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable done_;
  bool finished_ = false;
  std::thread timer_;
};
}  // namespace

MpiEnvironment::MpiEnvironment() { init(nullptr, nullptr); }
MpiEnvironment::MpiEnvironment(int& argc, char**& argv) { init(&argc, &argv); }

void MpiEnvironment::init(int* argc, char*** argv) {
  uncaught_ = std::uncaught_exceptions();
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) throw CollectiveError("MpiEnvironment: MPI was finalized already and cannot start again");
  int provided = MPI_THREAD_SINGLE;
  if (initialized) {
    MPI_Query_thread(&provided);
  } else {
    const StartOrEndDeadline deadline("MPI_Init_thread");
    check(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    owns_ = true;
  }
  if (provided < MPI_THREAD_MULTIPLE) {
    if (owns_) MPI_Finalize();
    owns_ = false;
    throw CollectiveError("MpiEnvironment: MPI provides thread level " + std::to_string(provided) +
                          ", ruda needs MPI_THREAD_MULTIPLE (" + std::to_string(MPI_THREAD_MULTIPLE) +
                          ") for its progress thread");
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  share_cores_among_local_ranks();  // ranks on one node must not each take every core
}

MpiEnvironment::~MpiEnvironment() {
  if (std::uncaught_exceptions() > uncaught_) return;  // unwinding: see the class comment
  if (owns_ && active()) {
    const StartOrEndDeadline deadline("MPI_Finalize");
    MPI_Finalize();
  }
}

bool MpiEnvironment::active() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

int MpiEnvironment::world_rank() const {
  int rank = 0;
  check(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  return rank;
}

int MpiEnvironment::world_size() const {
  int size = 0;
  check(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size");
  return size;
}

// --- MpiCommunicator::Impl ---

struct MpiCommunicator::Impl {
  MPI_Comm data = MPI_COMM_NULL;     // collectives and the ring's messages
  MPI_Comm control = MPI_COMM_NULL;  // the order check's fingerprints, the watchdogs' notes
  int rank = 0, size = 1;
  // reduce_scatter: MPI_Reduce_scatter_block or the ring, by size class (measured at first use,
  // or fixed by RUDA_RING_MIN_BYTES / set_ring_min_bytes).
  cd::AlgorithmChoice scatter_choice;
  MPI_Op max_f32 = MPI_OP_NULL, max_f64 = MPI_OP_NULL, max_bf16 = MPI_OP_NULL, max_f16 = MPI_OP_NULL;
  MPI_Op sum_bf16 = MPI_OP_NULL, sum_f16 = MPI_OP_NULL;
  mpi_detail::RingScratch ring;
  Buffer wide;                         // 16-bit data widened to f32
  cd::ProgressThread progress_thread;  // the non-blocking collectives, in the order started
  // The order check saw ranks at different calls (every rank sees it, in the same exchange): the
  // ranks' sequences have parted, and the destructor's final exchange is skipped. A rank that
  // caught the CollectiveMismatchError and returned normally waited there for a rank that had
  // already left (the job stalled until the collective timeout).
  bool order_parted = false;

  // What this rank's threads are in, for the watchdog: the calling thread (blocking collectives
  // and the order check) and the progress thread. Guarded by slot_lock, a spin lock: taken twice
  // per collective and held for a few stores, it costs less than a mutex (the watchdog takes it
  // every kWatchPeriod, just as briefly). Entering and leaving a collective reads no clock (here a clock read costs ~60
  // ns, a 4 KiB all_gather ~2 us): the watchdog notes the time when it first sees an activation, so it measures a wait
  // from at most one kWatchPeriod after the wait began.
  struct Slot {
    bool active = false;
    std::uint64_t activations = 0;
    const Record* call = nullptr;  // the base's history entry, or a queued task's copy: neither
                                   // changes while the slot is active
    const char* stage = "";        // "order check" while agreeing the call's fingerprint
    // The watchdog's own: the activation it saw last, when it first saw it, and for how long since
    // then this process did not run (not counted against the timeout; see kStallGap).
    std::uint64_t seen = 0;
    Clock::time_point seen_since;
    Clock::duration not_running{};
  };
  // A stalled collective as the watchdog reports it.
  struct Stalled {
    Record call;
    std::string stage;
    Clock::duration not_running{};
    std::string text() const {
      std::string out = call.text() + " #" + std::to_string(call.sequence);
      if (!stage.empty()) out += " (" + stage + ")";
      return out;
    }
  };
  std::atomic<std::int64_t> timeout_ms{0};  // 0: off
  // Where timeout_ms came from, for the watchdog's message: RUDA_COLLECTIVE_TIMEOUT, the
  // constructor's argument, or set_timeout (0, 1, 2).
  std::atomic<int> timeout_source{0};
  std::mutex watch_mutex;  // watch_stop, and the watchdog's sleep
  std::condition_variable watch_wake;
  bool watch_stop = false;
  mpi_detail::SpinLock slot_lock;  // the slots and last_*
  Slot caller, progress;
  std::uint64_t last_sequence = 0;  // the last collective finished
  const char* last_op = "";
  std::uint64_t last_seen = 0;  // the watchdog's: the last_sequence it saw last, and when first
  Clock::time_point last_seen_since = Clock::now();
  std::thread watchdog;
  // The watchdog thread's own: the posted receive for queries, and its sends in flight.
  MPI_Request query = MPI_REQUEST_NULL;
  Note query_note;
  std::uint64_t queries_sent = 0;
  struct Outgoing {
    MPI_Request request = MPI_REQUEST_NULL;
    Note note;
  };
  std::vector<std::unique_ptr<Outgoing>> outgoing;  // MPI holds the notes' addresses until sent

  // Marks a slot as in `call` for its lifetime; `call` must not change meanwhile.
  class Watch {
   public:
    Watch(Impl& impl, Slot& slot, const Record& call, const char* stage = "") : impl_(impl), slot_(slot) {
      // Every collective starts here (blocking ones on the caller, queued ones on the progress
      // thread): after MPI_Finalize an MPI call aborts the whole process, so refuse it first.
      if (!MpiEnvironment::active()) {
        throw CollectiveError(std::string("MpiCommunicator: ") + call.op +
                              ": MPI is finalized (its MpiEnvironment has ended): no collective can run");
      }
      std::lock_guard lock(impl.slot_lock);
      slot.call = &call;
      slot.stage = stage;
      slot.active = true;
      ++slot.activations;
    }
    ~Watch() {
      std::lock_guard lock(impl_.slot_lock);
      slot_.active = false;
      if (slot_.call->sequence >= impl_.last_sequence) {
        impl_.last_sequence = slot_.call->sequence;
        impl_.last_op = slot_.call->op;
      }
    }
    Watch(const Watch&) = delete;
    Watch& operator=(const Watch&) = delete;

   private:
    Impl& impl_;
    Slot& slot_;
  };

  // `timeout` empty: RUDA_COLLECTIVE_TIMEOUT's, read in create() where the ranks agree on it.
  Impl(MPI_Comm parent, std::optional<std::chrono::milliseconds> timeout)
      : timeout_ms(timeout ? timeout->count() : 0), timeout_source(timeout ? 1 : 0) {
    if (!MpiEnvironment::active()) {
      throw CollectiveError("MpiCommunicator: MPI is not initialized (create a ruda::MpiEnvironment first)");
    }
    try {
      create(parent, !timeout);
    } catch (...) {
      release();
      throw;
    }
  }

  ~Impl() {
    progress_thread.stop();  // before the watchdog and MPI's objects go
    {
      std::lock_guard lock(watch_mutex);
      watch_stop = true;
    }
    watch_wake.notify_all();
    if (watchdog.joinable()) watchdog.join();
    release();
  }

  void create(MPI_Comm parent, bool timeout_from_env) {
    // Before the watchdog starts (below): waited for under the timeout by wait_unwatched.
    const std::chrono::milliseconds limit =
        timeout_from_env ? startup_timeout() : std::chrono::milliseconds(timeout_ms.load(std::memory_order_relaxed));
    MPI_Request request = MPI_REQUEST_NULL;
    check(MPI_Comm_idup(parent, &data, &request), "MPI_Comm_idup");
    wait_unwatched(request, limit, "MPI_Comm_idup (creating a communicator)");
    check(MPI_Comm_idup(parent, &control, &request), "MPI_Comm_idup");
    wait_unwatched(request, limit, "MPI_Comm_idup (creating a communicator)");
    MPI_Comm_set_errhandler(data, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(control, MPI_ERRORS_RETURN);
    check(MPI_Comm_rank(data, &rank), "MPI_Comm_rank");
    check(MPI_Comm_size(data, &size), "MPI_Comm_size");
    // Every rank must pick the same algorithm for a size, or the ring would wait for ranks in MPI's.
    // RUDA_RING_MIN_BYTES where any rank sets it (the largest value wins, for ranks whose
    // environment lacks it too), else measured per size class. A rank whose value is not a size
    // still takes part (so that every rank learns of it) and then every rank throws. The same for
    // the other variables a communicator reads, RUDA_COLLECTIVE_TIMEOUT and RUDA_CHECK_COLLECTIVES:
    // read before this agreement (or, for the second, by the Communicator after it), a bad value
    // on one rank threw there while the others waited in MPI_Comm_dup or in their first
    // collective, unwatched.
    std::string refused;
    unsigned long long agreed[3] = {0, 0, 0};  // refused, set, value: each the largest over the ranks
    try {
      if (const std::optional<std::size_t> bytes = cd::ring_min_bytes_from_env()) {
        agreed[1] = 1;
        agreed[2] = *bytes;
      }
      if (timeout_from_env) timeout_ms.store(collective_timeout_from_env().count(), std::memory_order_relaxed);
      (void)order_check_from_env();
    } catch (const ArgumentError& e) {
      refused = e.what();
      agreed[0] = 1;
    }
    check(MPI_Iallreduce(MPI_IN_PLACE, agreed, 3, MPI_UNSIGNED_LONG_LONG, MPI_MAX, control, &request),
          "MPI_Iallreduce");
    wait_unwatched(request, limit, "MPI_Iallreduce (a new communicator's agreement on the RUDA_ variables)");
    if (agreed[0]) {
      throw ArgumentError("MpiCommunicator: rank " + std::to_string(rank) + " of " + std::to_string(size) + ": " +
                          (refused.empty() ? "another rank's RUDA_RING_MIN_BYTES, RUDA_COLLECTIVE_TIMEOUT or "
                                             "RUDA_CHECK_COLLECTIVES is not valid"
                                           : refused));
    }
    if (agreed[1]) scatter_choice.set_threshold(static_cast<std::size_t>(agreed[2]));
    check(MPI_Op_create(&max_op<DType::f32>, 1, &max_f32), "MPI_Op_create");
    check(MPI_Op_create(&max_op<DType::f64>, 1, &max_f64), "MPI_Op_create");
    check(MPI_Op_create(&max_op<DType::bf16>, 1, &max_bf16), "MPI_Op_create");
    check(MPI_Op_create(&max_op<DType::f16>, 1, &max_f16), "MPI_Op_create");
    check(MPI_Op_create(&native_sum_op<DType::bf16>, 1, &sum_bf16), "MPI_Op_create");
    check(MPI_Op_create(&native_sum_op<DType::f16>, 1, &sum_f16), "MPI_Op_create");
    check(post_query_receive(), "MPI_Irecv (watchdog)");
    watchdog = std::thread([this] { watch(); });
  }

  void release() noexcept {
    if (!MpiEnvironment::active()) return;  // finalized: MPI freed everything
    if (query != MPI_REQUEST_NULL) {
      MPI_Cancel(&query);
      MPI_Wait(&query, MPI_STATUS_IGNORE);
    }
    for (std::unique_ptr<Outgoing>& o : outgoing) {
      int done = 0;
      MPI_Test(&o->request, &done, MPI_STATUS_IGNORE);
      if (!done) {
        // To a rank that stopped: MPI may still read the note, so it stays allocated.
        MPI_Request_free(&o->request);
        (void)o.release();
      }
    }
    outgoing.clear();
    for (MPI_Op* op : {&max_f32, &max_f64, &max_bf16, &max_f16, &sum_bf16, &sum_f16}) {
      if (*op != MPI_OP_NULL) MPI_Op_free(op);
    }
    if (data != MPI_COMM_NULL) MPI_Comm_free(&data);
    if (control != MPI_COMM_NULL) MPI_Comm_free(&control);
  }

  // --- the watchdog (its own thread; the only one that touches `query` and `outgoing`) ---

  void watch() {
    Clock::time_point previous = Clock::now();
    for (;;) {
      {
        std::unique_lock lock(watch_mutex);
        watch_wake.wait_for(lock, kWatchPeriod, [&] { return watch_stop; });
        if (watch_stop) return;
      }
      // One clock read for the whole look: a stop after it shows as the next look's gap.
      const Clock::time_point now = Clock::now();
      const Clock::duration gap = now - previous;
      previous = now;
      const Clock::duration not_running = gap > kStallGap ? gap - kWatchPeriod : Clock::duration::zero();
      const std::int64_t limit = timeout_ms.load(std::memory_order_relaxed);
      bool late = false;
      Stalled stalled;
      {
        std::lock_guard lock(slot_lock);
        observe(now, not_running);
        const Slot* oldest = nullptr;
        for (const Slot* slot : {&caller, &progress}) {
          if (limit <= 0 || !slot->active) continue;
          const Clock::duration waited = now - slot->seen_since - slot->not_running;  // while this process ran
          if (waited >= std::chrono::milliseconds(limit) &&
              (!oldest || slot->call->sequence < oldest->call->sequence)) {
            oldest = slot;
          }
        }
        if (oldest) {
          late = true;
          stalled = Stalled{*oldest->call, oldest->stage, oldest->not_running};
        }
      }
      if (!MpiEnvironment::active()) return;
      answer_queries();
      if (late) fire(stalled, std::chrono::milliseconds(limit));
    }
  }

  // Notes the time of activations and of the last collective's end that the watchdog had not
  // seen yet, and adds `not_running` (this process did not run: kStallGap) to the waits it had
  // seen before. The caller holds slot_lock.
  void observe(Clock::time_point now = Clock::now(), Clock::duration not_running = {}) {
    for (Slot* slot : {&caller, &progress}) {
      if (slot->active && slot->seen != slot->activations) {
        slot->seen = slot->activations;
        slot->seen_since = now;
        slot->not_running = {};
      } else if (slot->active) {
        slot->not_running += not_running;
      }
    }
    if (last_seen != last_sequence) {
      last_seen = last_sequence;
      last_seen_since = now;
    }
  }

  int post_query_receive() {
    const int code = MPI_Irecv(&query_note, sizeof(Note), MPI_BYTE, MPI_ANY_SOURCE, kQueryTag, control, &query);
    if (code != MPI_SUCCESS) query = MPI_REQUEST_NULL;
    return code;
  }

  // Sends a note without waiting (best effort: a failed send leaves a query unanswered).
  void send_note(const Note& note, int to, int tag) {
    auto out = std::make_unique<Outgoing>();
    out->note = note;
    if (MPI_Isend(&out->note, sizeof(Note), MPI_BYTE, to, tag, control, &out->request) == MPI_SUCCESS) {
      outgoing.push_back(std::move(out));
    }
    std::erase_if(outgoing, [](std::unique_ptr<Outgoing>& o) {
      int done = 0;
      MPI_Test(&o->request, &done, MPI_STATUS_IGNORE);
      return done != 0;
    });
  }

  // Where this rank is: the oldest collective one of its threads is in, else the last it finished.
  Note where() {
    std::lock_guard lock(slot_lock);
    observe();
    Note note;
    const Slot* in = nullptr;
    for (const Slot* slot : {&caller, &progress}) {
      if (slot->active && (!in || slot->call->sequence < in->call->sequence)) in = slot;
    }
    std::string op;
    if (in) {
      note.waiting = 1;
      note.sequence = in->call->sequence;
      note.milliseconds = millis_since(in->seen_since);
      op = in->call->op;
      if (*in->stage) op += std::string(" (") + in->stage + ")";
    } else {
      note.sequence = last_sequence;
      note.milliseconds = millis_since(last_seen_since);
      op = last_op;
    }
    std::strncpy(note.op, op.c_str(), sizeof note.op - 1);
    return note;
  }

  void answer_queries() {
    for (;;) {
      int arrived = 0;
      MPI_Status status;
      if (query == MPI_REQUEST_NULL || MPI_Test(&query, &arrived, &status) != MPI_SUCCESS || !arrived) return;
      Note answer = where();
      answer.id = query_note.id;
      send_note(answer, status.MPI_SOURCE, kAnswerTag);
      post_query_receive();
    }
  }

  // Asks every other rank where it is and waits up to `grace` for the answers. Returns who did not
  // arrive at collective #sequence and where they are, as far as their answers tell.
  std::string inspect(std::uint64_t sequence, const char* my_op, std::chrono::milliseconds grace) {
    Note ask;
    ask.id = ++queries_sent;
    ask.sequence = sequence;
    for (int r = 0; r < size; ++r) {
      if (r != rank) send_note(ask, r, kQueryTag);
    }
    std::vector<Note> answers(static_cast<std::size_t>(size));
    std::vector<bool> answered(static_cast<std::size_t>(size), false);
    int pending = size - 1;
    Note answer;
    MPI_Request receive = MPI_REQUEST_NULL;
    const Clock::time_point deadline = Clock::now() + grace;
    while (pending > 0 && Clock::now() < deadline) {
      if (receive == MPI_REQUEST_NULL &&
          MPI_Irecv(&answer, sizeof(Note), MPI_BYTE, MPI_ANY_SOURCE, kAnswerTag, control, &receive) != MPI_SUCCESS) {
        receive = MPI_REQUEST_NULL;
        break;
      }
      int arrived = 0;
      MPI_Status status;
      if (MPI_Test(&receive, &arrived, &status) != MPI_SUCCESS) break;
      if (arrived) {  // MPI_Test made `receive` MPI_REQUEST_NULL again
        const int from = status.MPI_SOURCE;
        if (answer.id == ask.id && from >= 0 && from < size && !answered[static_cast<std::size_t>(from)]) {
          answers[static_cast<std::size_t>(from)] = answer;
          answered[static_cast<std::size_t>(from)] = true;
          --pending;
        }
        continue;
      }
      answer_queries();  // the other ranks whose collective timed out ask too
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (receive != MPI_REQUEST_NULL) {
      MPI_Cancel(&receive);
      MPI_Wait(&receive, MPI_STATUS_IGNORE);
    }

    // A rank that answered with an earlier collective is known to be behind; one that did not
    // answer may be anywhere (it may even have passed this collective and exited since), so it is
    // named as silent, not as missing.
    std::vector<int> missing, silent, arrived;
    std::string where_they_are, other_collectives;
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      const auto i = static_cast<std::size_t>(r);
      const Note& a = answers[i];
      if (!answered[i]) {
        silent.push_back(r);
        continue;
      }
      const std::string op(a.op, strnlen(a.op, sizeof a.op));
      if (a.sequence >= sequence) {
        arrived.push_back(r);
        // Arrived at another operation of the same number (the order check, which would have
        // said so at once, is off): the likeliest cause of the hang, so named.
        if (a.sequence == sequence && a.waiting && op.substr(0, op.find(" (")) != my_op) {
          other_collectives += "; rank " + std::to_string(r) + " is in " + op + " #" + std::to_string(sequence);
        }
        continue;
      }
      where_they_are += "; rank " + std::to_string(r);
      if (a.waiting) {
        where_they_are +=
            " is in collective #" + std::to_string(a.sequence) + " " + op + " since " + seconds_text(a.milliseconds);
      } else if (a.sequence == 0) {
        where_they_are +=
            " is not in a collective and has finished none (busy for " + seconds_text(a.milliseconds) + ")";
      } else {
        where_they_are += " is not in a collective (busy since #" + std::to_string(a.sequence) + " " + op + " ended " +
                          seconds_text(a.milliseconds) + " ago)";
      }
      missing.push_back(r);
    }
    const std::string number = "collective #" + std::to_string(sequence);
    std::string out;
    if (!missing.empty()) out = cd::rank_list(missing) + " did not arrive at " + number + where_they_are;
    if (!silent.empty()) {
      out += std::string(out.empty() ? "" : "; ") + cd::rank_list(silent) + " did not answer within " +
             format_collective_timeout(grace) + ", so whether " + (silent.size() == 1 ? "it" : "they") +
             " arrived at " + number +
             " is not known (a rank that does not answer may have exited or ended this communicator, be stopped or "
             "frozen, or be on an unreachable node)";
    }
    if (out.empty() && !other_collectives.empty()) {
      return "the ranks called different collectives as " + number + ": this rank " + my_op + other_collectives +
             " (RUDA_CHECK_COLLECTIVES=1 refuses such a mismatch at once)";
    }
    if (out.empty()) return "every rank arrived at " + number + ", but it did not complete";
    if (!arrived.empty()) out += "; " + cd::rank_list(arrived) + " arrived";
    return out;
  }

  // What the message adds when this rank's own process did not run for part of the wait (kStallGap).
  std::string not_running_text(Clock::duration not_running) const {
    if (not_running <= Clock::duration::zero()) return "";
    return "; rank " + std::to_string(rank) + "'s own process did not run for " +
           seconds_text(std::chrono::duration_cast<std::chrono::milliseconds>(not_running).count()) +
           " of the wait (stopped, paused or swapped out), which the timeout does not count";
  }

  // A collective of this rank waited longer than the timeout: report and end the job. (A blocking
  // MPI collective cannot be interrupted, so there is nothing to throw into.)
  [[noreturn]] void fire(const Stalled& stalled, std::chrono::milliseconds limit) {
    const std::string verdict = inspect(stalled.call.sequence, stalled.call.op, std::min(limit, kGrace));
    static constexpr const char* kSources[] = {"RUDA_COLLECTIVE_TIMEOUT", "the communicator's constructor",
                                               "set_timeout"};
    const std::string message = "rank " + std::to_string(rank) + ": " + stalled.text() +
                                ": not complete after the collective timeout of " + format_collective_timeout(limit) +
                                " (" + kSources[timeout_source.load(std::memory_order_relaxed)] + "): " + verdict +
                                not_running_text(stalled.not_running);
    int world_rank = -1, world_size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    std::fprintf(stderr, "ruda: rank %d of %d failed: %s\n", world_rank, world_size, message.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::abort();  // MPI_Abort does not return
  }

  // --- collectives (run by the calling thread after drain(), or by the worker) ---

  void all_gather(const void* send, void* recv, std::int64_t count, DType dtype) {
    const int n = int_count(count, "MPI_Allgather");
    const MPI_Datatype type = mpi_type(dtype);
    check(MPI_Allgather(send, n, type, recv, n, type, data), "MPI_Allgather");
  }

  // MPI_Reduce_scatter_block or ruda's ring, whichever the size class chose (see measure_reduce_scatter).
  void reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype, Accumulate accumulate) {
    const std::size_t esize = dtype_size(dtype);
    if (size == 1 || count == 0) {
      if (count > 0) std::memcpy(recv, send, static_cast<std::size_t>(count) * esize);
      return;
    }
    const std::size_t bytes = static_cast<std::size_t>(count) * static_cast<std::size_t>(size) * esize;
    cd::Algorithm algorithm = scatter_choice.lookup(bytes);
    if (algorithm == cd::Algorithm::undecided) {
      algorithm = measure_reduce_scatter(send, recv, count, dtype, accumulate, bytes);
    }
    if (algorithm == cd::Algorithm::library) {
      small_reduce_scatter(send, recv, count, dtype, accumulate);
    } else {
      mpi_detail::ring_reduce_scatter(data, rank, size, send, recv, count, dtype, accumulate, ring);
    }
  }

  // The first reduce_scatter of a size class on this communicator (every rank's first at once:
  // the ranks call the same collectives with the same sizes) times both algorithms on the call's
  // own buffers, each sample started by a barrier so that every rank times the same calls: first
  // a run of ring calls, then a run of MPI's, each with a warm-up, as each would run call after
  // call once chosen. (Not alternated: MPI_Reduce_scatter_block allocates and frees a temporary
  // of the whole size per call, and the transfers right after that ran up to 4x slower here, which
  // made the ring lose at 16-64 MiB when it followed MPI's call.) The ranks then agree on the
  // slowest rank's best sample of each (one MPI_Allreduce), so all of them pick the same algorithm;
  // the choice is cached for the size class. The call's result then comes from the chosen
  // algorithm, as every later call's will.
  cd::Algorithm measure_reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype,
                                       Accumulate accumulate, std::size_t bytes) {
    const cd::TrialPlan plan = cd::trial_plan(bytes);
    auto timed = [&](bool use_ring) {
      check(MPI_Barrier(data), "MPI_Barrier (timing reduce_scatter's algorithms)");
      const Clock::time_point start = Clock::now();
      for (int i = 0; i < plan.calls; ++i) {
        if (use_ring) {
          mpi_detail::ring_reduce_scatter(data, rank, size, send, recv, count, dtype, accumulate, ring);
        } else {
          small_reduce_scatter(send, recv, count, dtype, accumulate);
        }
      }
      return std::chrono::duration<double>(Clock::now() - start).count() / plan.calls;
    };
    std::vector<double> ring_seconds, library_seconds;
    for (const bool use_ring : {true, false}) {
      std::vector<double>& seconds = use_ring ? ring_seconds : library_seconds;
      for (int round = 0; round < plan.warmup + plan.rounds; ++round) {
        const double s = timed(use_ring);
        if (round >= plan.warmup) seconds.push_back(s);
      }
    }
    double agreed[2] = {cd::best(ring_seconds), cd::best(library_seconds)};
    check(MPI_Allreduce(MPI_IN_PLACE, agreed, 2, MPI_DOUBLE, MPI_MAX, data),
          "MPI_Allreduce (agreeing on reduce_scatter's algorithm)");
    const cd::Algorithm chosen = cd::choose(cd::Timings{agreed[0], agreed[1]});
    scatter_choice.record(bytes, chosen);
    return chosen;
  }

  // Small reductions are bound by latency, not bandwidth: MPI's own algorithm needs fewer rounds
  // than the ring's size - 1, and its temporary costs little at this size. 16-bit data
  // accumulated in f32 is widened first.
  void small_reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype, Accumulate accumulate) {
    const int n = int_count(count, "MPI_Reduce_scatter_block");
    if (is_16bit_float(dtype) && accumulate == Accumulate::f32) {
      const std::size_t total = static_cast<std::size_t>(count) * static_cast<std::size_t>(size);
      float* w = reinterpret_cast<float*>(wide.get((total + static_cast<std::size_t>(count)) * sizeof(float)));
      cd::convert(send, dtype, w, DType::f32, static_cast<std::int64_t>(total));
      check(MPI_Reduce_scatter_block(w, w + total, n, MPI_FLOAT, MPI_SUM, data), "MPI_Reduce_scatter_block");
      cd::convert(w + total, DType::f32, recv, dtype, count);
      return;
    }
    MPI_Op op = MPI_SUM;
    if (dtype == DType::bf16) op = sum_bf16;
    if (dtype == DType::f16) op = sum_f16;
    check(MPI_Reduce_scatter_block(send, recv, n, mpi_type(dtype), op, data), "MPI_Reduce_scatter_block");
  }

  void all_reduce(const void* send, void* recv, std::int64_t count, DType dtype, Reduction op, Accumulate accumulate) {
    const bool half = is_16bit_float(dtype);
    if (half && op == Reduction::sum && accumulate == Accumulate::f32) {
      // Sum in f32 and round once: widen, reduce the f32 values, narrow.
      float* w = reinterpret_cast<float*>(wide.get(static_cast<std::size_t>(count) * sizeof(float)));
      cd::convert(send, dtype, w, DType::f32, count);
      allreduce_pieces(MPI_IN_PLACE, w, count, DType::f32, MPI_FLOAT, MPI_SUM);
      cd::convert(w, DType::f32, recv, dtype, count);
      return;
    }
    MPI_Op mpi_op = MPI_SUM;
    if (op == Reduction::max) {
      switch (dtype) {
        case DType::f32:
          mpi_op = max_f32;
          break;
        case DType::f64:
          mpi_op = max_f64;
          break;
        case DType::bf16:
          mpi_op = max_bf16;
          break;
        case DType::f16:
          mpi_op = max_f16;
          break;
        default:
          mpi_op = MPI_MAX;
          break;
      }
    } else if (half) {
      mpi_op = dtype == DType::bf16 ? sum_bf16 : sum_f16;
    }
    allreduce_pieces(send, recv, count, dtype, mpi_type(dtype), mpi_op);
  }

  void allreduce_pieces(const void* send, void* recv, std::int64_t count, DType dtype, MPI_Datatype type, MPI_Op op) {
    const std::size_t esize = dtype_size(dtype);
    for (std::int64_t offset = 0; offset < count || (count == 0 && offset == 0); offset += kMaxCount) {
      const int n = static_cast<int>(std::min(kMaxCount, count - offset));
      const void* s = send == MPI_IN_PLACE
                          ? MPI_IN_PLACE
                          : static_cast<const std::byte*>(send) + static_cast<std::size_t>(offset) * esize;
      check(
          MPI_Allreduce(s, static_cast<std::byte*>(recv) + static_cast<std::size_t>(offset) * esize, n, type, op, data),
          "MPI_Allreduce");
      if (count == 0) break;
    }
  }

  void broadcast(const void* send, void* recv, std::int64_t count, DType dtype, int root) {
    const std::size_t esize = dtype_size(dtype);
    if (rank == root && count > 0) std::memcpy(recv, send, static_cast<std::size_t>(count) * esize);
    for (std::int64_t offset = 0; offset < count || (count == 0 && offset == 0); offset += kMaxCount) {
      const int n = static_cast<int>(std::min(kMaxCount, count - offset));
      check(MPI_Bcast(static_cast<std::byte*>(recv) + static_cast<std::size_t>(offset) * esize, n, mpi_type(dtype),
                      root, data),
            "MPI_Bcast");
      if (count == 0) break;
    }
  }

  std::vector<std::string> exchange(const std::string& fingerprint) {
    constexpr std::size_t kRecordBytes = MpiCommunicator::kFingerprintBytes;
    std::vector<char> mine(kRecordBytes, '\0');
    std::memcpy(mine.data(), fingerprint.data(), std::min(fingerprint.size(), kRecordBytes - 1));
    std::vector<char> all(kRecordBytes * static_cast<std::size_t>(size));
    check(MPI_Allgather(mine.data(), static_cast<int>(kRecordBytes), MPI_CHAR, all.data(),
                        static_cast<int>(kRecordBytes), MPI_CHAR, control),
          "MPI_Allgather (order check)");
    std::vector<std::string> out;
    for (int r = 0; r < size; ++r) {
      const char* record = all.data() + static_cast<std::size_t>(r) * kRecordBytes;
      out.emplace_back(record, strnlen(record, kRecordBytes));
    }
    return out;
  }
};

// A non-blocking collective queued on the progress thread. It holds the input and the output,
// so both stay alive until the collective is done even if the caller drops the Work.
// A collective queued on the progress thread. It holds the input until wait(), not only until
// the progress thread is done with it: when the input was freed depended on how fast the
// collective completed, so a step's peak memory (and the memory plan that measures it) moved from
// run to run under MPI (a plan 12-28% below the step it planned, which then ran out of memory
// under --memory-limit). Until wait() is the upper bound, the same at every run.
class QueuedState final : public Work::State {
 public:
  QueuedState(std::shared_future<std::chrono::steady_clock::time_point> done, Tensor out, Tensor input)
      : done_(std::move(done)), out_(std::move(out)), input_(std::move(input)) {}
  // A Work dropped without wait() (a prefetch the step did not use): its collective still runs on
  // every rank, and is waited for here, so that its buffers go now and not whenever the progress
  // thread finishes it. Not while unwinding: the other ranks may never join it.
  ~QueuedState() override {
    if (done_.valid() && !completed_ && std::uncaught_exceptions() == 0) done_.wait();
  }
  QueuedState(const QueuedState&) = delete;
  QueuedState& operator=(const QueuedState&) = delete;
  Tensor wait() override {
    completed_ = done_.get();  // rethrows the collective's error
    input_ = Tensor();
    return std::move(out_);
  }
  bool ready() override { return done_.wait_for(std::chrono::seconds(0)) == std::future_status::ready; }
  std::optional<std::chrono::steady_clock::time_point> completed_at() const override { return completed_; }

 private:
  std::shared_future<std::chrono::steady_clock::time_point> done_;
  Tensor out_, input_;
  std::optional<std::chrono::steady_clock::time_point> completed_;
};

// --- MpiCommunicator ---

MpiCommunicator::MpiCommunicator() : MpiCommunicator(std::make_unique<Impl>(MPI_COMM_WORLD, std::nullopt)) {}

MpiCommunicator::MpiCommunicator(std::unique_ptr<Impl> impl)
    : Communicator(impl->rank, impl->size), impl_(std::move(impl)) {}

MpiCommunicator::~MpiCommunicator() {
  if (!impl_) return;
  if (std::uncaught_exceptions() > 0) {
    // Unwinding after an error: the other ranks may be anywhere, so neither wait for the
    // collectives in flight nor run the final order check, either could hang. With work still
    // in flight the communicator cannot be freed safely; leave it (the process is about to end:
    // mpi_abort_on_exception aborts the job).
    if (!impl_->progress_thread.idle()) (void)impl_.release();
    return;
  }
  try {
    impl_->progress_thread.drain();
  } catch (const std::exception&) {
    // Its error was reported to whoever waited for it.
  }
  if (order_check() && MpiEnvironment::active() && !impl_->order_parted) {
    // A last fingerprint: a rank that skipped the final collectives meets the others here, and
    // both sides learn of it instead of waiting forever.
    const std::string end = cd::numbered(current_sequence() + 1, "end of communicator");
    Record last;
    last.sequence = current_sequence() + 1;
    last.op = "end of communicator";
    last.has_data = false;
    try {
      const Impl::Watch watch(*impl_, impl_->caller, last, "order check");
      const std::vector<std::string> all = impl_->exchange(end);
      if (std::any_of(all.begin(), all.end(), [&](const std::string& f) { return f != end; })) {
        std::vector<std::string> calls;
        for (const auto& f : all) {
          const std::string call = cd::without_shape(f);
          auto [n, text] = cd::split_fingerprint(call);
          calls.push_back(n == current_sequence() + 1 ? text : call);
        }
        std::fprintf(stderr, "ruda: rank %d: %s\n", rank(),
                     cd::mismatch_message(current_sequence() + 1, calls).c_str());
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ruda: rank %d: final order check failed: %s\n", rank(), e.what());
    }
  }
}

std::unique_ptr<MpiCommunicator> MpiCommunicator::split(int color, int key) {
  return std::unique_ptr<MpiCommunicator>(static_cast<MpiCommunicator*>(Communicator::split(color, key).release()));
}

std::unique_ptr<MpiCommunicator> MpiCommunicator::split_by_node() {
  return std::unique_ptr<MpiCommunicator>(static_cast<MpiCommunicator*>(Communicator::split_by_node().release()));
}

// The new communicator of a split: watched like a collective (a rank that never comes to the
// split would leave the others in it forever), with this one's timeout.
std::unique_ptr<MpiCommunicator> MpiCommunicator::make_split(const std::function<int(void*)>& split, const char* call) {
  impl_->progress_thread.drain();
  MPI_Comm part = MPI_COMM_NULL;
  {
    const Impl::Watch watch(*impl_, impl_->caller, current_record());
    check(split(static_cast<void*>(&part)), call);
  }
  try {
    auto impl = std::make_unique<Impl>(part, timeout());
    MPI_Comm_free(&part);
    return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(std::move(impl)));
  } catch (...) {
    if (part != MPI_COMM_NULL) MPI_Comm_free(&part);
    throw;
  }
}

std::unique_ptr<Communicator> MpiCommunicator::do_split(int color, int key) {
  return make_split([&](void* part) { return MPI_Comm_split(impl_->data, color, key, static_cast<MPI_Comm*>(part)); },
                    "MPI_Comm_split");
}

std::unique_ptr<Communicator> MpiCommunicator::do_split_by_node() {
  return make_split(
      [&](void* part) {
        return MPI_Comm_split_type(impl_->data, MPI_COMM_TYPE_SHARED, rank(), MPI_INFO_NULL,
                                   static_cast<MPI_Comm*>(part));
      },
      "MPI_Comm_split_type (MPI_COMM_TYPE_SHARED)");
}

void MpiCommunicator::set_timeout(std::chrono::milliseconds timeout) {
  if (timeout.count() < 0) {
    fail<ArgumentError>("MpiCommunicator::set_timeout", "rank ", rank(),
                        ": the timeout must be 0 (off) or positive, got ", timeout.count(), " ms");
  }
  impl_->timeout_ms.store(timeout.count(), std::memory_order_relaxed);
  impl_->timeout_source.store(2, std::memory_order_relaxed);
}

std::chrono::milliseconds MpiCommunicator::timeout() const noexcept {
  return std::chrono::milliseconds(impl_->timeout_ms.load(std::memory_order_relaxed));
}

std::string_view MpiCommunicator::reduce_scatter_algorithm(std::size_t bytes) const {
  if (world_size() == 1 || bytes == 0) return "copy";
  return cd::algorithm_name(impl_->scatter_choice.lookup(bytes));
}

void MpiCommunicator::set_ring_min_bytes(std::optional<std::size_t> bytes) {
  // Collective: every rank must choose alike. The ranks gather whether a value was passed and
  // which (its bits as an i64: no size, SIZE_MAX included, may read as "none"), so that a
  // disagreement raises on every rank instead of hanging later. Through all_gather, numbered and
  // watched as every collective: a raw MPI_Allreduce here escaped the collective timeout (a rank
  // that never called it left the others waiting for ever) and the order check.
  const std::uint64_t mine = bytes ? static_cast<std::uint64_t>(*bytes) : 0;
  const std::vector<std::int64_t> all =
      all_gather(from_vector(std::vector<std::int64_t>{bytes ? 1 : 0, std::bit_cast<std::int64_t>(mine)}, {2}),
                 {.tag = "set_ring_min_bytes"})
          .to_vector<std::int64_t>();
  bool some_none = false, some_size = false;
  std::uint64_t smallest = std::numeric_limits<std::uint64_t>::max(), largest = 0;
  for (std::size_t r = 0; r + 1 < all.size(); r += 2) {
    if (all[r] == 0) {
      some_none = true;
      continue;
    }
    some_size = true;
    const auto v = std::bit_cast<std::uint64_t>(all[r + 1]);
    smallest = std::min(smallest, v);
    largest = std::max(largest, v);
  }
  if ((some_none && some_size) || smallest < largest) {
    const std::string self = bytes ? std::to_string(mine) : std::string("none (measure)");
    const std::string others =
        some_none && some_size
            ? "some ranks passed none (measure), others a size (the largest " + std::to_string(largest) + ")"
            : "the smallest " + std::to_string(smallest) + ", the largest " + std::to_string(largest);
    fail<ArgumentError>("MpiCommunicator::set_ring_min_bytes", "rank ", rank(), " of ", world_size(),
                        ": the ranks passed different thresholds (this rank ", self, ", ", others,
                        "); every rank must pass the same");
  }
  impl_->scatter_choice.set_threshold(bytes);
}

std::optional<std::size_t> MpiCommunicator::ring_min_bytes() const { return impl_->scatter_choice.threshold(); }

std::size_t MpiCommunicator::buffer_bytes() const { return impl_->ring.bytes() + impl_->wide.size(); }

void MpiCommunicator::release_buffers() {
  impl_->progress_thread.drain();
  impl_->ring.release();
  impl_->wide.release();
}

void MpiCommunicator::do_all_gather(const void* send, void* recv, std::int64_t count, DType dtype) {
  impl_->progress_thread.drain();
  const Impl::Watch watch(*impl_, impl_->caller, current_record());
  impl_->all_gather(send, recv, count, dtype);
}

void MpiCommunicator::do_reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype,
                                        Accumulate accumulate) {
  impl_->progress_thread.drain();
  const Impl::Watch watch(*impl_, impl_->caller, current_record());
  impl_->reduce_scatter(send, recv, count, dtype, accumulate);
}

void MpiCommunicator::do_all_reduce(const void* send, void* recv, std::int64_t count, DType dtype, Reduction op,
                                    Accumulate accumulate) {
  impl_->progress_thread.drain();
  const Impl::Watch watch(*impl_, impl_->caller, current_record());
  impl_->all_reduce(send, recv, count, dtype, op, accumulate);
}

void MpiCommunicator::do_broadcast(const void* send, void* recv, std::int64_t count, DType dtype, int root) {
  impl_->progress_thread.drain();
  const Impl::Watch watch(*impl_, impl_->caller, current_record());
  impl_->broadcast(send, recv, count, dtype, root);
}

void MpiCommunicator::do_barrier() {
  impl_->progress_thread.drain();
  const Impl::Watch watch(*impl_, impl_->caller, current_record());
  check(MPI_Barrier(impl_->data), "MPI_Barrier");
}

Work MpiCommunicator::start_all_gather(const Tensor& local, Tensor out, std::int64_t count) {
  int_count(count, "MPI_Allgather");  // fail now, not at wait()
  Impl* impl = impl_.get();
  auto future = impl->progress_thread.submit([impl, local, out, count, call = current_record()] {
    const Impl::Watch watch(*impl, impl->progress, call);
    impl->all_gather(local.data_ptr(), out.data_ptr(), count, local.dtype());
  });
  return Work(std::make_unique<QueuedState>(std::move(future), std::move(out), local));
}

Work MpiCommunicator::start_reduce_scatter(const Tensor& full, Tensor out, std::int64_t count, Accumulate accumulate) {
  Impl* impl = impl_.get();
  auto future = impl->progress_thread.submit([impl, full, out, count, accumulate, call = current_record()] {
    const Impl::Watch watch(*impl, impl->progress, call);
    impl->reduce_scatter(full.data_ptr(), out.data_ptr(), count, full.dtype(), accumulate);
  });
  return Work(std::make_unique<QueuedState>(std::move(future), std::move(out), full));
}

Work MpiCommunicator::start_all_reduce(const Tensor& x, Tensor out, std::int64_t count, Reduction op,
                                       Accumulate accumulate) {
  int_count(count, "MPI_Allreduce");  // fail now, not at wait()
  Impl* impl = impl_.get();
  auto future = impl->progress_thread.submit([impl, x, out, count, op, accumulate, call = current_record()] {
    const Impl::Watch watch(*impl, impl->progress, call);
    impl->all_reduce(x.data_ptr(), out.data_ptr(), count, x.dtype(), op, accumulate);
  });
  return Work(std::make_unique<QueuedState>(std::move(future), std::move(out), x));
}

std::vector<std::string> MpiCommunicator::exchange_fingerprints(const std::string& fingerprint) {
  // On the control communicator, from the calling thread: it may run while the progress thread
  // is inside a collective on the data communicator.
  const Impl::Watch watch(*impl_, impl_->caller, current_record(), "order check");
  std::vector<std::string> all = impl_->exchange(fingerprint);
  if (std::any_of(all.begin(), all.end(), [&](const std::string& f) { return f != fingerprint; })) {
    impl_->order_parted = true;
  }
  return all;
}

std::optional<std::size_t> ring_min_bytes_from_env() { return cd::ring_min_bytes_from_env(); }

namespace {
// gather_on_startup's collective, its waits named after `op` (the public function called).
std::vector<std::string> gather_startup_texts(const std::string& text, const std::string& op) {
  if (!MpiEnvironment::active()) {
    throw CollectiveError(op + ": MPI is not initialized (create a ruda::MpiEnvironment first)");
  }
  if (text.size() > kMaxStartupText) {
    throw ArgumentError(op + ": a text of " + std::to_string(text.size()) + " bytes is over the " +
                        std::to_string(kMaxStartupText) + " a process may give");
  }
  const std::chrono::milliseconds limit = startup_timeout();
  MPI_Comm world = MPI_COMM_NULL;
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Comm_idup(MPI_COMM_WORLD, &world, &request), ("MPI_Comm_idup (" + op + ")").c_str());
  wait_unwatched(request, limit, (op + " (MPI_Comm_idup)").c_str());
  MPI_Comm_set_errhandler(world, MPI_ERRORS_RETURN);
  int size = 0;
  MPI_Comm_size(world, &size);
  const int length = static_cast<int>(text.size());
  std::vector<int> lengths(static_cast<std::size_t>(size)), offsets(static_cast<std::size_t>(size));
  int code = MPI_Iallgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, world, &request);
  if (code == MPI_SUCCESS) wait_unwatched(request, limit, (op + " (MPI_Iallgather)").c_str());
  // Each length as given (at most kMaxStartupText, so the total fits an int for any world MPI has).
  std::int64_t total = 0;
  for (int r = 0; r < size; ++r) {
    offsets[static_cast<std::size_t>(r)] = static_cast<int>(total);
    total += lengths[static_cast<std::size_t>(r)];
  }
  std::vector<char> all(static_cast<std::size_t>(std::max<std::int64_t>(total, 1)));
  if (code == MPI_SUCCESS) {
    code = MPI_Iallgatherv(text.data(), length, MPI_CHAR, all.data(), lengths.data(), offsets.data(), MPI_CHAR, world,
                           &request);
    if (code == MPI_SUCCESS) wait_unwatched(request, limit, (op + " (MPI_Iallgatherv)").c_str());
  }
  MPI_Comm_free(&world);
  check(code, ("MPI_Allgather (" + op + ")").c_str());
  std::vector<std::string> texts;
  for (int r = 0; r < size; ++r) {
    const auto i = static_cast<std::size_t>(r);
    texts.emplace_back(all.data() + offsets[i], static_cast<std::size_t>(lengths[i]));
  }
  return texts;
}
}  // namespace

std::vector<std::string> gather_on_startup(const std::string& text) {
  return gather_startup_texts(text, "gather_on_startup");
}

std::vector<RankFailure> agree_on_startup(const std::string& error) {
  const std::vector<std::string> errors =
      gather_startup_texts(error.substr(0, 4096), "agree_on_startup");  // "" is no failure
  std::vector<RankFailure> failures;
  for (std::size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r].empty()) failures.push_back({static_cast<int>(r), errors[r]});
  }
  return failures;
}

int mpi_abort_on_exception(const std::function<int()>& fn) {
  std::string what;
  try {
    return fn();
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    what = "unknown exception";
  }
  int rank = -1, size = 0;
  const bool active = MpiEnvironment::active();
  if (active) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
  }
  std::fprintf(stderr, "ruda: rank %d of %d failed: %s\n", rank, size, what.c_str());
  std::fflush(stderr);
  if (active) MPI_Abort(MPI_COMM_WORLD, 1);
  return 1;
}

}  // namespace ruda
