// The collective suite on LocalCommunicator (world size 1), and its copy-free results.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ruda/backend.h>
#include <ruda/collectives.h>

#include "algorithm_choice.h"
#include "progress_thread.h"
#include "stopwatch.h"
#include "suite.h"

namespace {

void run_local(void (*check)(ruda::Communicator&)) {
  ruda::LocalCommunicator comm;
  check(comm);
}

}  // namespace

RUDA_COLLECTIVE_SUITE("local", run_local)

TEST_CASE("local: collectives hand back the input's storage, cut from the graph") {
  using namespace ruda;
  LocalCommunicator comm;
  CHECK(comm.kind() == "local");
  CHECK(comm.rank() == 0);
  CHECK(comm.world_size() == 1);
  const Tensor x = ones({4, 3}).set_requires_grad();
  for (const Tensor& result :
       {comm.all_gather(x), comm.reduce_scatter(x), comm.all_reduce(x, Reduction::max), comm.broadcast(x, 0),
        comm.all_gather_async(x).wait(), comm.reduce_scatter_async(x).wait()}) {
    CHECK(result.shares_storage(x));
    CHECK(result.shape() == Shape{4, 3});
    CHECK_FALSE(result.requires_grad());
  }
  CHECK(comm.all_gather(scalar(2.0)).shape() == Shape{1});
  Work pending = comm.all_gather_async(x);
  CHECK(pending.ready());
  // The *_into forms copy into the caller's buffer.
  const Tensor out = zeros({4, 3});
  comm.all_gather_into(out, x.detach());
  CHECK_FALSE(out.shares_storage(x));
  CHECK(out.sum().item() == 12.0);
  // Every call is numbered in the history, oldest first.
  const std::vector<std::string> history = comm.history();
  REQUIRE(history.size() == 9);
  CHECK(history.front() == "#1 all_gather(f32, 12)");
  CHECK(history[2] == "#3 all_reduce(f32, 12, max)");
  CHECK(history[3] == "#4 broadcast(f32, 12, root 0)");
  CHECK(history[6] == "#7 all_gather(f32, 1)");
  CHECK(history.back() == "#9 all_gather(f32, 12)");
}

TEST_CASE("local: the history keeps the last 32 calls") {
  using namespace ruda;
  LocalCommunicator comm;
  for (int i = 1; i <= 40; ++i) comm.barrier({std::string("b") + std::to_string(i)});
  const std::vector<std::string> history = comm.history();
  REQUIRE(history.size() == 32);
  CHECK(history.front() == "#9 barrier(\"b9\")");
  CHECK(history.back() == "#40 barrier(\"b40\")");
}

TEST_CASE("local: the order check follows RUDA_CHECK_COLLECTIVES, and can be set") {
  using namespace ruda;
  LocalCommunicator comm;
  CHECK(comm.order_check() == order_check_from_env());
  comm.set_order_check(true);
  CHECK(comm.order_check());
  // One rank agrees with itself: the check passes.
  CHECK(comm.all_reduce(scalar(3.0)).item() == 3.0);
  // Its values in any case; a value that is neither on nor off is refused, not read as off.
  const char* set = std::getenv("RUDA_CHECK_COLLECTIVES");
  const std::optional<std::string> before = set ? std::optional<std::string>(set) : std::nullopt;
  for (const char* on : {"1", "true", "True", "ON", "Yes"}) {
    CAPTURE(on);
    ::setenv("RUDA_CHECK_COLLECTIVES", on, 1);
    CHECK(order_check_from_env());
    CHECK(LocalCommunicator().order_check());
  }
  for (const char* off : {"", "0", "false", "Off", "NO"}) {
    CAPTURE(off);
    ::setenv("RUDA_CHECK_COLLECTIVES", off, 1);
    CHECK_FALSE(order_check_from_env());
  }
  ::setenv("RUDA_CHECK_COLLECTIVES", "maybe", 1);
  try {
    (void)LocalCommunicator();
    FAIL("no error");
  } catch (const ArgumentError& e) {
    CHECK(std::string(e.what()).find("RUDA_CHECK_COLLECTIVES: 'maybe' is neither on") != std::string::npos);
  }
  if (before) {
    ::setenv("RUDA_CHECK_COLLECTIVES", before->c_str(), 1);
  } else {
    ::unsetenv("RUDA_CHECK_COLLECTIVES");
  }
}

TEST_CASE("collective timeouts: durations as written in RUDA_COLLECTIVE_TIMEOUT and --collective-timeout") {
  using namespace ruda;
  using std::chrono::milliseconds;
  auto parse = [](const char* text) { return parse_collective_timeout(text, "RUDA_COLLECTIVE_TIMEOUT"); };
  CHECK(parse("300") == milliseconds(300000));
  CHECK(parse("300s") == milliseconds(300000));
  CHECK(parse("5m") == milliseconds(300000));
  CHECK(parse("5min") == milliseconds(300000));
  CHECK(parse("500ms") == milliseconds(500));
  CHECK(parse("1.5h") == milliseconds(5400000));
  CHECK(parse(" 2 S ") == milliseconds(2000));
  CHECK(parse("off") == milliseconds(0));
  CHECK(parse("OFF") == milliseconds(0));
  CHECK(parse("0") == milliseconds(0));
  CHECK(parse("0ms") == milliseconds(0));
  for (const char* bad : {"", "abc", "-5", "5x", "5 minutes", "0.1ms", "1.2.3", "nan", "inf", "400d", "9000h", "1e300",
                          // strtod's grammar beyond decimals, and spaces inside the number, are not timeouts
                          "0x10", "0x1p3m", "1e3", "3 0 0", ".", "5 m s"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(parse(bad), ArgumentError);
  }
  // The error names the source and the value.
  try {
    parse_collective_timeout("5 fortnights", "--collective-timeout");
    FAIL("no error");
  } catch (const ArgumentError& e) {
    const std::string what = e.what();
    CHECK(what.find("--collective-timeout") != std::string::npos);
    CHECK(what.find("'5 fortnights'") != std::string::npos);
  }
  CHECK(format_collective_timeout(milliseconds(0)) == "off");
  CHECK(format_collective_timeout(milliseconds(2000)) == "2 s");
  CHECK(format_collective_timeout(milliseconds(1500)) == "1500 ms");
  CHECK(format_collective_timeout(kDefaultCollectiveTimeout) == "10 min");
}

TEST_CASE("collective timeouts: RUDA_COLLECTIVE_TIMEOUT, its default, and a bad value named") {
  using namespace ruda;
  const char* saved = std::getenv("RUDA_COLLECTIVE_TIMEOUT");
  const std::string before = saved ? saved : "";
  ::unsetenv("RUDA_COLLECTIVE_TIMEOUT");
  CHECK(collective_timeout_from_env() == kDefaultCollectiveTimeout);
  ::setenv("RUDA_COLLECTIVE_TIMEOUT", "90s", 1);
  CHECK(collective_timeout_from_env() == std::chrono::seconds(90));
  ::setenv("RUDA_COLLECTIVE_TIMEOUT", "off", 1);
  CHECK(collective_timeout_from_env() == std::chrono::milliseconds(0));
  ::setenv("RUDA_COLLECTIVE_TIMEOUT", "soon", 1);
  try {
    (void)collective_timeout_from_env();
    FAIL("no error");
  } catch (const ArgumentError& e) {
    const std::string what = e.what();
    CHECK(what.find("RUDA_COLLECTIVE_TIMEOUT") != std::string::npos);
    CHECK(what.find("'soon'") != std::string::npos);
  }
  if (saved) {
    ::setenv("RUDA_COLLECTIVE_TIMEOUT", before.c_str(), 1);
  } else {
    ::unsetenv("RUDA_COLLECTIVE_TIMEOUT");
  }
}

TEST_CASE("local: the launcher is read from OpenMPI's, PMI's or PMIx's variables") {
  using ruda::launched_by_mpi;
  using ruda::launcher_rank;
  const char* names[] = {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK", "PMIX_RANK"};
  std::vector<std::pair<std::string, std::string>> saved;
  for (const char* n : names) {
    if (const char* v = std::getenv(n)) saved.emplace_back(n, v);
    unsetenv(n);
  }
  CHECK_FALSE(launched_by_mpi());
  CHECK(launcher_rank() == 0);
  setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  setenv("OMPI_COMM_WORLD_RANK", "3", 1);
  CHECK(launched_by_mpi());
  CHECK(launcher_rank() == 3);
  unsetenv("OMPI_COMM_WORLD_SIZE");
  unsetenv("OMPI_COMM_WORLD_RANK");
  setenv("PMI_SIZE", "2", 1);
  setenv("PMI_RANK", "1", 1);
  CHECK(launched_by_mpi());
  CHECK(launcher_rank() == 1);
  unsetenv("PMI_SIZE");
  unsetenv("PMI_RANK");
  setenv("PMIX_RANK", "5", 1);
  CHECK(launched_by_mpi());
  CHECK(launcher_rank() == 5);
  unsetenv("PMIX_RANK");
  for (const auto& [n, v] : saved) setenv(n.c_str(), v.c_str(), 1);
}

TEST_CASE("local: ranks a launcher put on one node share its cores; the thread variables still win") {
  const char* names[] = {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", "RUDA_NUM_THREADS",
                         "OMP_NUM_THREADS"};
  std::vector<std::pair<std::string, std::string>> saved;
  for (const char* n : names) {
    if (const char* v = std::getenv(n)) saved.emplace_back(n, v);
    unsetenv(n);
  }
  // A fresh thread has set no count of its own: it reads the variables, then the default.
  auto fresh_thread_count = [] {
    int n = 0;
    std::thread([&] { n = ruda::num_threads(); }).join();
    return n;
  };
  const int cores = ruda::hardware_threads();
  CHECK(ruda::launcher_local_ranks() == 1);
  ruda::share_cores_among_local_ranks();
  CHECK(ruda::default_num_threads() == cores);
  CHECK(fresh_thread_count() == cores);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
  CHECK(ruda::launcher_local_ranks() == 2);
  ruda::share_cores_among_local_ranks();
  CHECK(ruda::default_num_threads() == std::max(1, cores / 2));
  CHECK(fresh_thread_count() == std::max(1, cores / 2));
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", std::to_string(4 * cores).c_str(), 1);  // more ranks than cores
  ruda::share_cores_among_local_ranks();
  CHECK(fresh_thread_count() == 1);
  setenv("OMP_NUM_THREADS", "3", 1);
  CHECK(fresh_thread_count() == 3);
  setenv("RUDA_NUM_THREADS", "5", 1);
  CHECK(fresh_thread_count() == 5);
  unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  setenv("MPI_LOCALNRANKS", "3", 1);
  CHECK(ruda::launcher_local_ranks() == 3);
  CHECK_THROWS_AS(ruda::set_default_num_threads(0), ruda::ArgumentError);
  ruda::set_default_num_threads(cores);
  for (const char* n : names) unsetenv(n);
  for (const auto& [n, v] : saved) setenv(n.c_str(), v.c_str(), 1);
}

TEST_CASE("the progress thread runs tasks in submission order; after a failure the rest fail unstarted") {
  using ruda::collectives_detail::ProgressThread;
  ProgressThread thread;
  CHECK(thread.idle());
  thread.drain();          // nothing submitted: returns at once
  std::vector<int> order;  // written by the progress thread only, read after drain()
  std::vector<ProgressThread::Done> done;
  for (int i = 0; i < 50; ++i) done.push_back(thread.submit([&order, i] { order.push_back(i); }));
  thread.drain();
  CHECK(thread.idle());
  REQUIRE(order.size() == 50);
  for (int i = 0; i < 50; ++i) CHECK(order[static_cast<std::size_t>(i)] == i);
  for (auto& d : done) CHECK_NOTHROW(d.get());     // every task completed, none with an error
  CHECK(done.back().get() >= done.front().get());  // completion times, in order

  // A failed task fails the ones after it without running them, and drain() reports it.
  bool ran_after = false;
  auto failing = thread.submit([] { throw ruda::CollectiveError("peer went away"); });
  auto after = thread.submit([&] { ran_after = true; });
  CHECK_THROWS_WITH_AS(failing.get(), "peer went away", ruda::CollectiveError);
  try {
    after.get();
    FAIL_CHECK("the task after a failure ran");
  } catch (const ruda::CollectiveError& e) {
    CHECK(std::string(e.what()).find("not started") != std::string::npos);
    CHECK(std::string(e.what()).find("peer went away") != std::string::npos);
  }
  CHECK_FALSE(ran_after);
  CHECK_THROWS_AS(thread.drain(), ruda::CollectiveError);
  thread.stop();
  thread.stop();  // idempotent
}

TEST_CASE("the progress thread lets go of what a task holds before its waiter learns it is done") {
  // A collective's tensors were held by the finished task until the thread got round to dropping
  // it, after wait() had returned: their memory went at a moment that depended on timing, and a
  // step's peak (the memory plan's measurement) moved from run to run under MPI.
  using ruda::collectives_detail::ProgressThread;
  for (int i = 0; i < 100; ++i) {
    ProgressThread thread;
    auto held = std::make_shared<int>(i);
    const std::weak_ptr<int> watch = held;
    auto done = thread.submit([held = std::move(held)] { (void)*held; });
    done.get();
    CHECK(watch.expired());
    auto failing = std::make_shared<int>(i);
    const std::weak_ptr<int> watch_failing = failing;
    auto failed = thread.submit([failing = std::move(failing)] { throw ruda::CollectiveError("peer went away"); });
    CHECK_THROWS_AS(failed.get(), ruda::CollectiveError);
    CHECK(watch_failing.expired());
  }
}

// --- the choice between MPI's reduce-scatter and the ring (algorithm_choice.h), without MPI ---

TEST_CASE("algorithm choice: size classes are powers of two of the total bytes") {
  using namespace ruda::collectives_detail;
  CHECK(size_class(0) == 0);
  CHECK(size_class(1) == 0);
  CHECK(size_class(2) == 1);
  CHECK(size_class(3) == 2);
  CHECK(size_class(4096) == 12);
  CHECK(size_class(4097) == 13);
  CHECK(size_class(8192) == 13);
  CHECK(size_class(std::size_t{64} << 20) == 26);
  CHECK(size_class(~std::size_t{0}) == kSizeClasses - 1);
}

TEST_CASE("algorithm choice: the agreed timings are the slowest rank's, and the faster algorithm wins") {
  using namespace ruda::collectives_detail;
  const std::vector<double> samples = {5, 1, 4, 2, 3};
  CHECK(median(samples) == 3);
  const std::vector<double> even = {4, 1, 3, 2};
  CHECK(median(even) == 2.5);
  CHECK(median(std::vector<double>{}) == 0);
  CHECK(best(samples) == 1);
  CHECK(best(std::vector<double>{}) == 0);
  // Rank 1 sees the ring faster, rank 0 MPI's: the elementwise maximum decides for everyone.
  const std::vector<Timings> ranks = {{3e-6, 2e-6}, {1e-6, 4e-6}, {2e-6, 1e-6}};
  const Timings agreed = agree(ranks);
  CHECK(agreed.ring == 3e-6);
  CHECK(agreed.library == 4e-6);
  CHECK(choose(agreed) == Algorithm::ring);
  CHECK(choose({5e-6, 4e-6}) == Algorithm::library);
  CHECK(choose({4e-6, 4e-6}) == Algorithm::library);  // a tie needs no ring buffers
  CHECK(choose({0, 4e-6}) == Algorithm::library);     // a figure that is not a time
  CHECK(choose({std::numeric_limits<double>::quiet_NaN(), 1}) == Algorithm::library);
  CHECK(choose({std::numeric_limits<double>::infinity(), 1}) == Algorithm::library);
  CHECK(algorithm_name(Algorithm::ring) == "ring");
  CHECK(algorithm_name(Algorithm::library) == "mpi");
  CHECK(algorithm_name(Algorithm::undecided) == "unmeasured");
}

TEST_CASE("algorithm choice: measured choices are cached per size class, a threshold overrides them") {
  using namespace ruda::collectives_detail;
  AlgorithmChoice choice;
  CHECK_FALSE(choice.threshold().has_value());
  CHECK(choice.lookup(4096) == Algorithm::undecided);
  choice.record(4096, Algorithm::library);
  choice.record(std::size_t{1} << 20, Algorithm::ring);
  CHECK(choice.lookup(4096) == Algorithm::library);
  CHECK(choice.lookup(3000) == Algorithm::library);  // the same class: (2 KiB, 4 KiB]
  CHECK(choice.lookup(2048) == Algorithm::undecided);
  CHECK(choice.lookup(4097) == Algorithm::undecided);
  CHECK(choice.lookup(std::size_t{1} << 20) == Algorithm::ring);
  // A threshold: MPI's up to it, the ring above, whatever was measured.
  choice.set_threshold(std::size_t{64} << 10);
  CHECK(choice.threshold() == std::optional<std::size_t>(std::size_t{64} << 10));
  CHECK(choice.lookup(std::size_t{64} << 10) == Algorithm::library);
  CHECK(choice.lookup((std::size_t{64} << 10) + 1) == Algorithm::ring);
  CHECK(choice.lookup(2048) == Algorithm::library);
  choice.set_threshold(0);
  CHECK(choice.lookup(1) == Algorithm::ring);
  CHECK(choice.lookup(4096) == Algorithm::ring);
  // Back to measuring: the measured choices are still there.
  choice.set_threshold(std::nullopt);
  CHECK(choice.lookup(4096) == Algorithm::library);
  CHECK(choice.lookup(std::size_t{1} << 20) == Algorithm::ring);
  choice.reset();
  CHECK(choice.lookup(4096) == Algorithm::undecided);
  CHECK(by_threshold(100, 100) == Algorithm::library);
  CHECK(by_threshold(101, 100) == Algorithm::ring);
}

TEST_CASE("algorithm choice: a measurement's plan stays short at every size") {
  using namespace ruda::collectives_detail;
  for (std::size_t bytes : {std::size_t{1}, std::size_t{4096}, std::size_t{64} << 10, std::size_t{1} << 20,
                            std::size_t{64} << 20, std::size_t{1} << 34}) {
    const TrialPlan plan = trial_plan(bytes);
    CAPTURE(bytes);
    CHECK(plan.warmup >= 1);
    CHECK(plan.rounds >= 3);
    CHECK(plan.calls >= 1);
    CHECK(plan.calls <= 16);
    // Every timed sample of a small size moves at least ~64 KiB, or is 16 calls long.
    if (bytes < (std::size_t{64} << 10)) CHECK((plan.calls == 16 || plan.calls * bytes >= (std::size_t{64} << 10)));
    CHECK(plan.rounds * plan.calls <= 80);  // at most ~a hundred calls in all, warm-ups included
  }
}

TEST_CASE("algorithm choice: RUDA_RING_MIN_BYTES is a size, unset means measure, anything else is typed") {
  using namespace ruda;
  using namespace ruda::collectives_detail;
  CHECK_FALSE(parse_ring_min_bytes(nullptr, "RUDA_RING_MIN_BYTES").has_value());
  CHECK_FALSE(parse_ring_min_bytes("", "RUDA_RING_MIN_BYTES").has_value());
  CHECK(parse_ring_min_bytes("0", "RUDA_RING_MIN_BYTES") == std::optional<std::size_t>(0));
  CHECK(parse_ring_min_bytes("65536", "RUDA_RING_MIN_BYTES") == std::optional<std::size_t>(65536));
  CHECK(parse_ring_min_bytes("64KiB", "RUDA_RING_MIN_BYTES") == std::optional<std::size_t>(65536));
  CHECK(parse_ring_min_bytes("1MB", "RUDA_RING_MIN_BYTES") == std::optional<std::size_t>(1000000));
  for (const char* bad : {"lots", "-1", "12 parsecs", "1.5.2KiB"}) {
    CAPTURE(bad);
    try {
      (void)parse_ring_min_bytes(bad, "RUDA_RING_MIN_BYTES");
      FAIL_CHECK("no error");
    } catch (const ArgumentError& e) {
      const std::string message = e.what();
      CHECK_MESSAGE(message.find(std::string("RUDA_RING_MIN_BYTES: '") + bad + "' is not a size") == 0, message);
    }
  }
  // From the environment.
  const char* set = std::getenv("RUDA_RING_MIN_BYTES");
  const std::string saved = set ? set : "";
  setenv("RUDA_RING_MIN_BYTES", "128KiB", 1);
  CHECK(ring_min_bytes_from_env() == std::optional<std::size_t>(std::size_t{128} << 10));
  setenv("RUDA_RING_MIN_BYTES", "", 1);
  CHECK_FALSE(ring_min_bytes_from_env().has_value());
  setenv("RUDA_RING_MIN_BYTES", "a lot", 1);
  CHECK_THROWS_AS((void)ring_min_bytes_from_env(), ArgumentError);
  unsetenv("RUDA_RING_MIN_BYTES");
  CHECK_FALSE(ring_min_bytes_from_env().has_value());
  if (set) setenv("RUDA_RING_MIN_BYTES", saved.c_str(), 1);
}

// --- the stopwatch of the traffic figures (stopwatch.h): the TSC where it is invariant ---

TEST_CASE("stopwatch: readings are monotonic and measure seconds as steady_clock does") {
  using ruda::collectives_detail::Stopwatch;
  using Steady = std::chrono::steady_clock;
  const std::uint64_t a = Stopwatch::now();
  const auto steady_a = Steady::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  const std::uint64_t b = Stopwatch::now();
  const double steady = std::chrono::duration<double>(Steady::now() - steady_a).count();
  CHECK(b >= a);
  const double seconds = Stopwatch::seconds(a, b);
  // Within 5% of steady_clock over the same 30+ ms (the calibration's own error is far smaller).
  CHECK(seconds == doctest::Approx(steady).epsilon(0.05));
  CHECK(Stopwatch::seconds(b, a) == 0.0);  // a reading before the start is no time, not negative
  // The steady_clock time of the first reading is where steady_clock was then.
  const auto converted = Stopwatch::to_steady(a);
  CHECK(std::abs(std::chrono::duration<double>(converted - steady_a).count()) <
        0.01);  // preemption between the two reads allowed
}
