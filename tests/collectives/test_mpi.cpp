// The collective suite on MpiCommunicator, run under mpiexec (-n 2 and -n 3 from ctest), plus
// what only MPI has: sub-communicators, the progress thread, reused buffers.
//
// The order check is on for the whole run: if a check fails on one rank only and the ranks fall
// out of step, the next collective raises on every rank instead of hanging.
#define DOCTEST_CONFIG_IMPLEMENT
#include <chrono>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <thread>

#include <ruda/memory.h>
#include <ruda/mpi.h>

#include "suite.h"

namespace {

using namespace ruda;
using namespace std::chrono_literals;

MpiCommunicator* g_comm = nullptr;

void run_mpi(void (*check)(Communicator&)) {
  REQUIRE(g_comm != nullptr);
  check(*g_comm);
}

}  // namespace

RUDA_COLLECTIVE_SUITE("mpi", run_mpi)

TEST_CASE("mpi: traffic() counts bus bytes, and a non-blocking collective's time runs to its completion") {
  MpiCommunicator& c = *g_comm;
  const int n = c.world_size();
  const std::int64_t count = 1 << 16;  // f32: 256 kB per rank
  c.reset_traffic();
  c.all_gather(ones({count}));
  const Traffic blocking = c.traffic();
  CHECK(blocking.collectives == 1);
  CHECK(blocking.bytes == static_cast<std::uint64_t>((n - 1) * 4 * count));
  CHECK(blocking.exposed_seconds == blocking.seconds);
  c.reset_traffic();
  const Tensor full = ones({n * count});
  const auto start = std::chrono::steady_clock::now();
  Work work = c.reduce_scatter_async(full);
  // Whatever this rank does meanwhile, the collective's time ends when the progress thread finished it.
  // (200 ms, not 20: the sanitizer builds on 2 loaded cores once took 24 ms to return from a wait
  // that found the work done.)
  while (!work.ready()) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(200ms);
  work.wait();
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const Traffic async = c.traffic();
  CHECK(async.collectives == 1);
  CHECK(async.bytes == static_cast<std::uint64_t>((n - 1) * 4 * count));
  CHECK(async.exposed_seconds < 0.100);     // the wait found it done
  CHECK(async.seconds <= elapsed - 0.150);  // not counted: the 200 ms after it was done
}

TEST_CASE("mpi: the order check shows both sides on every rank") {
  REQUIRE(g_comm->world_size() >= 2);
  run_mpi(&ruda::test::collectives::order_check);
}

TEST_CASE("mpi: a split communicator runs the suite's collectives on its own ranks") {
  MpiCommunicator& world = *g_comm;
  const int color = world.rank() % 2;
  std::unique_ptr<MpiCommunicator> part = world.split(color, world.rank());
  REQUIRE(part);
  CHECK(part->world_size() == (world.world_size() + 1 - color) / 2);
  CHECK(part->rank() == world.rank() / 2);
  CHECK(part->order_check() == world.order_check());
  ruda::test::collectives::all_gather(*part);
  ruda::test::collectives::reduce_scatter(*part);
  // The world communicator still works beside it.
  CHECK(world.all_reduce(scalar(1.0)).item() == world.world_size());
  CHECK_THROWS_AS(world.split(-1, 0), ArgumentError);
}

TEST_CASE("mpi: a non-blocking collective returns at once and completes on the progress thread") {
  MpiCommunicator& comm = *g_comm;
  // With the order check on, the start itself agrees fingerprints with the other ranks.
  comm.set_order_check(false);
  const Tensor local = ones({1 << 16});
  if (comm.rank() == 0) {
    const auto start = std::chrono::steady_clock::now();
    Work work = comm.all_gather_async(local, {"late partner"});
    const double started = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(started < 0.15);  // the other ranks join 300 ms later
    CHECK_FALSE(work.ready());
    const Tensor gathered = work.wait();
    CHECK(gathered.sum().item() == double(comm.world_size() << 16));
  } else {
    std::this_thread::sleep_for(300ms);
    CHECK(comm.all_gather(local, {"late partner"}).numel() == comm.world_size() << 16);
  }
  comm.set_order_check(true);
}

TEST_CASE("mpi: a non-blocking collective's buffers go at wait(), or when its Work is dropped, never later") {
  // They went whenever the progress thread finished with them: a step's peak memory (and the memory
  // plan measuring it) moved from run to run, 12-28% low at times, and runs the plan said fit
  // under --memory-limit ran out of memory.
  MpiCommunicator& comm = *g_comm;
  comm.set_order_check(false);
  const std::int64_t before = memory::stats().live_bytes;
  for (int i = 0; i < 20; ++i) {
    {
      Tensor local = ones({1 << 14});
      Work work = comm.all_gather_async(local, {"held until wait"});
      local = Tensor();
      const Tensor gathered = work.wait();
      CHECK(gathered.numel() == comm.world_size() << 14);
    }
    CHECK(memory::stats().live_bytes == before);
    { Work dropped = comm.reduce_scatter_async(ones({comm.world_size() << 14}), {"dropped"}); }
    CHECK(memory::stats().live_bytes == before);  // the dropped Work waited for its collective
  }
  comm.set_order_check(true);
}

TEST_CASE("mpi: reduce_scatter reuses its buffers from call to call") {
  MpiCommunicator& comm = *g_comm;
  const int n = comm.world_size();
  const Tensor full = ones({(1 << 20) * n}, Options(DType::bf16));
  comm.reduce_scatter(full);
  const std::size_t after_first = comm.buffer_bytes();
  CHECK(after_first > 0);
  comm.reduce_scatter(full);
  CHECK(comm.buffer_bytes() == after_first);
  comm.release_buffers();
  CHECK(comm.buffer_bytes() == 0);
  CHECK(comm.reduce_scatter(full).sum().item() == double(n << 20));
}

TEST_CASE("mpi: the collective timeout is set, checked, inherited by split, and spares a healthy lag") {
  MpiCommunicator& comm = *g_comm;
  const std::chrono::milliseconds before = comm.timeout();
  // From RUDA_COLLECTIVE_TIMEOUT, else the default.
  CHECK(before == collective_timeout_from_env());
  CHECK_THROWS_AS(comm.set_timeout(std::chrono::milliseconds(-1)), ArgumentError);
  CHECK(comm.timeout() == before);
  comm.set_timeout(0ms);
  CHECK(comm.timeout() == 0ms);
  comm.set_timeout(2000ms);
  std::unique_ptr<MpiCommunicator> part = comm.split(0, comm.rank());
  CHECK(part->timeout() == 2000ms);
  // One rank arrives 300 ms late, well within the timeout: the collective completes, correctly.
  // (A rank that arrives after the timeout ends the job: see test_collectives_mpi_timeout_*.)
  if (comm.rank() == 0) std::this_thread::sleep_for(300ms);
  CHECK(part->all_reduce(scalar(double(comm.rank() + 1))).item() ==
        double(comm.world_size() * (comm.world_size() + 1) / 2));
  Work gathered =
      part->all_gather_async(full({2}, double(comm.rank()), Options(DType::f64)), {"async under the timeout"});
  const std::vector<double> values = gathered.wait().to_vector<double>();
  REQUIRE(values.size() == std::size_t(2 * comm.world_size()));
  for (int r = 0; r < comm.world_size(); ++r) CHECK(values[std::size_t(2 * r)] == double(r));
  part.reset();
  comm.set_timeout(before);
}

TEST_CASE("mpi: under mpiexec the launcher is detected and numbers this process as MPI does") {
  CHECK(launched_by_mpi());
  CHECK(launcher_rank() == g_comm->rank());
}

TEST_CASE("mpi: RUDA_RING_MIN_BYTES that is not a size on one rank is an ArgumentError on every rank") {
  MpiCommunicator& comm = *g_comm;
  const char* set = std::getenv("RUDA_RING_MIN_BYTES");
  const std::string saved = set ? set : "";
  const bool odd_one = comm.rank() == comm.world_size() - 1;
  if (odd_one) setenv("RUDA_RING_MIN_BYTES", "lots", 1);
  std::string message;
  try {
    MpiCommunicator other;
  } catch (const ArgumentError& e) {
    message = e.what();
  }
  if (set) {
    setenv("RUDA_RING_MIN_BYTES", saved.c_str(), 1);
  } else {
    unsetenv("RUDA_RING_MIN_BYTES");
  }
  CHECK_MESSAGE(message.find("MpiCommunicator: rank " + std::to_string(comm.rank()) + " of ") == 0, message);
  CHECK_MESSAGE(message.find(odd_one ? "RUDA_RING_MIN_BYTES: 'lots' is not a size"
                                     : "another rank's RUDA_RING_MIN_BYTES, RUDA_COLLECTIVE_TIMEOUT or "
                                       "RUDA_CHECK_COLLECTIVES is not valid") != std::string::npos,
                message);
  // The communicator in use is untouched.
  CHECK(comm.all_reduce(scalar(1.0)).item() == double(comm.world_size()));
}

namespace {

// The choice every rank made for `bytes`, checked to be the same everywhere (all_gather_text).
std::string agreed_algorithm(MpiCommunicator& comm, std::size_t bytes) {
  const std::string mine(comm.reduce_scatter_algorithm(bytes));
  const std::vector<std::string> all = all_gather_text(comm, mine, "algorithm of " + std::to_string(bytes));
  for (int r = 0; r < comm.world_size(); ++r) {
    CHECK_MESSAGE(all[static_cast<std::size_t>(r)] == mine, "rank ", comm.rank(), " chose ", mine, " for ", bytes,
                  " bytes, rank ", r, " ", all[static_cast<std::size_t>(r)]);
  }
  return mine;
}

// reduce_scatter of f32 (and bf16 summed in f32) rows against the single-process reference.
void check_scatter(MpiCommunicator& comm, std::int64_t total_bytes, DType dtype, const std::string& what) {
  using ruda::test::collectives::element;
  const int n = comm.world_size();
  const std::int64_t rows = std::max<std::int64_t>(1, total_bytes / static_cast<std::int64_t>(dtype_size(dtype)) / n);
  const Tensor full = ruda::test::collectives::input(comm.rank(), {rows * n}, dtype, 9);
  const std::int64_t offset = comm.rank() * rows;
  ruda::test::collectives::expect_values(
      comm.reduce_scatter(full, {"choice " + what}), dtype, {rows},
      [&](std::int64_t i) {
        double s = 0;
        for (int k = 0; k < n; ++k) s += element(k, offset + i, dtype, 9);
        return s;
      },
      ruda::test::collectives::where(comm, "reduce_scatter (" + what + ")", dtype, {rows * n}));
}

}  // namespace

TEST_CASE(
    "mpi: reduce_scatter measures its algorithm per size class, the same on every rank, and is right either way") {
  MpiCommunicator& comm = *g_comm;
  const int n = comm.world_size();
  const std::optional<std::size_t> env = comm.ring_min_bytes();  // RUDA_RING_MIN_BYTES of this ctest entry
  // Sizes that are not yet measured on this communicator (the suite before used others; a fresh
  // split communicator has measured nothing).
  std::unique_ptr<MpiCommunicator> fresh = comm.split(0, comm.rank());
  CHECK(fresh->ring_min_bytes() == env);  // the environment's, as every communicator's
  fresh->set_ring_min_bytes(std::nullopt);
  CHECK_FALSE(fresh->ring_min_bytes().has_value());
  const std::vector<std::int64_t> sizes = {4 << 10, 48 << 10, 256 << 10, 3 << 20};
  for (const std::int64_t total : sizes) {
    const std::int64_t rows = total / 4 / n;
    const std::size_t bytes = static_cast<std::size_t>(rows * n * 4);
    CHECK(agreed_algorithm(*fresh, bytes) == "unmeasured");
    check_scatter(*fresh, total, DType::f32, "measured " + std::to_string(total));
    const std::string chosen = agreed_algorithm(*fresh, bytes);
    CHECK((chosen == "ring" || chosen == "mpi"));
    // Cached: the next call of the size class uses it and is right too.
    check_scatter(*fresh, total, DType::f32, "cached " + std::to_string(total));
    CHECK(agreed_algorithm(*fresh, bytes) == chosen);
    // 16-bit data summed in f32 at a size of its own class.
    check_scatter(*fresh, total / 4, DType::bf16, "bf16 " + std::to_string(total));
    CHECK(agreed_algorithm(*fresh, bytes / 4) != "unmeasured");
  }
  // Both sides of the choice, fixed by the override, at every size: each algorithm is right.
  for (const std::size_t threshold : {std::size_t{0}, std::size_t{1} << 30}) {
    fresh->set_ring_min_bytes(threshold);
    CHECK(fresh->ring_min_bytes() == std::optional<std::size_t>(threshold));
    for (const std::int64_t total : sizes) {
      const std::size_t bytes = static_cast<std::size_t>(total / 4 / n * n * 4);
      CHECK(agreed_algorithm(*fresh, bytes) == (threshold == 0 ? "ring" : "mpi"));
      for (DType dtype : {DType::f32, DType::f64, DType::bf16, DType::i64}) {
        check_scatter(*fresh, total, dtype, "threshold " + std::to_string(threshold));
      }
    }
  }
  fresh->set_ring_min_bytes(std::nullopt);
  CHECK(agreed_algorithm(*fresh, 4 << 10) != "unmeasured");  // measured choices were kept
  fresh.reset();
  CHECK(comm.reduce_scatter_algorithm(0) == "copy");
  comm.set_ring_min_bytes(env);
  CHECK(comm.ring_min_bytes() == env);
}

TEST_CASE("mpi: set_ring_min_bytes with different values on the ranks is an ArgumentError on every rank") {
  MpiCommunicator& comm = *g_comm;
  const std::optional<std::size_t> before = comm.ring_min_bytes();
  const std::optional<std::size_t> mine =
      comm.rank() == 0 ? std::optional<std::size_t>(0) : std::optional<std::size_t>(std::size_t{1} << 20);
  std::string message;
  try {
    comm.set_ring_min_bytes(mine);
  } catch (const ArgumentError& e) {
    message = e.what();
  }
  CHECK_MESSAGE(message.find("MpiCommunicator::set_ring_min_bytes: rank " + std::to_string(comm.rank()) + " of ") == 0,
                message);
  CHECK_MESSAGE(message.find("the ranks passed different thresholds (this rank " + std::to_string(*mine) +
                             ", the smallest 0, the largest 1048576)") != std::string::npos,
                message);
  CHECK(comm.ring_min_bytes() == before);  // unchanged
  // None on one rank, a value on the others: refused too.
  const std::optional<std::size_t> some = comm.rank() == 0 ? std::nullopt : std::optional<std::size_t>(4096);
  CHECK_THROWS_AS(comm.set_ring_min_bytes(some), ArgumentError);
  CHECK(comm.ring_min_bytes() == before);
  // The largest size against none: no size may read as "none" (SIZE_MAX did, and the ranks then
  // ran different reduce-scatter algorithms).
  const std::optional<std::size_t> largest =
      comm.rank() == 0 ? std::optional<std::size_t>(std::numeric_limits<std::size_t>::max()) : std::nullopt;
  std::string largest_message;
  try {
    comm.set_ring_min_bytes(largest);
  } catch (const ArgumentError& e) {
    largest_message = e.what();
  }
  CHECK_MESSAGE(
      largest_message.find("some ranks passed none (measure), others a size (the largest " +
                           std::to_string(std::numeric_limits<std::size_t>::max()) + ")") != std::string::npos,
      largest_message);
  CHECK(comm.ring_min_bytes() == before);
  CHECK(comm.all_reduce(scalar(1.0)).item() == double(comm.world_size()));
}

int main(int argc, char** argv) {
  ruda::MpiEnvironment mpi(argc, argv);
  return ruda::mpi_abort_on_exception([&] {
    ruda::MpiCommunicator comm;
    comm.set_order_check(true);
    g_comm = &comm;
    doctest::Context context(argc, argv);
    const int failed = context.run() != 0 ? 1 : 0;
    g_comm = nullptr;
    // Every rank exits with the job's verdict.
    return static_cast<int>(comm.all_reduce(scalar(failed), ruda::Reduction::max).item());
  });
}
