// The collective suite on MpiCommunicator, run under mpiexec (-n 2 and -n 3 from ctest), plus
// what only MPI has: sub-communicators, the progress thread, reused buffers.
//
// The order check is on for the whole run: if a check fails on one rank only and the ranks fall
// out of step, the next collective raises on every rank instead of hanging.
#define DOCTEST_CONFIG_IMPLEMENT
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

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
  while (!work.ready()) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(20ms);
  work.wait();
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const Traffic async = c.traffic();
  CHECK(async.collectives == 1);
  CHECK(async.bytes == static_cast<std::uint64_t>((n - 1) * 4 * count));
  CHECK(async.exposed_seconds < 0.020);     // the wait found it done
  CHECK(async.seconds <= elapsed - 0.015);  // not counted: the 20 ms after it was done
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
                                     : "another rank's RUDA_RING_MIN_BYTES is not a size") != std::string::npos,
                message);
  // The communicator in use is untouched.
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
