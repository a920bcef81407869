// Suite "cluster-calibrate" of ruda-bench-mpi: is a simulated cluster (tools/cluster-sim) what it
// claims to be? Run it through `tools/cluster-sim calibrate`, one rank per node; rank 0 prints.
//   - raw MPI_Allgather, 64 KiB ... 64 MiB in total: the rate each node's link carried, against
//     the rate its token bucket was set to (RUDA_LINK_RATE, bits/s, which cluster-sim exports).
//     Whatever the algorithm, every node sends and receives (n - 1) / n of the total, so that
//     is the traffic per link; TCP/IP and Ethernet headers take about 4% of the wire.
//   - the latency of small collectives (a 4 KiB MPI_Allgather, an 8-byte MPI_Allreduce), which
//     OpenMPI's event polling can inflate to milliseconds between hosts (see README).
// Without RUDA_LINK_RATE (plain mpiexec on one machine) there is no link to calibrate: it says so.
#include <mpi.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <ruda/mpi.h>

#include "bench.h"

namespace ruda::bench {
namespace {

MpiEnvironment& environment() {
  static MpiEnvironment env;  // MPI for the process (another suite may have started it)
  return env;
}

void check(int code, const char* call) {
  if (code != MPI_SUCCESS) throw CollectiveError(std::string(call) + " failed in the benchmark");
}

void run(Context& ctx) {
  if (ctx.backend != available_backends().front()) return;  // raw MPI: the backend plays no part
  const char* link = std::getenv("RUDA_LINK_RATE");
  const int rank = environment().world_rank();
  if (link == nullptr || std::atof(link) <= 0) {
    if (rank == 0) {
      std::cerr << "cluster-calibrate: no RUDA_LINK_RATE, so no simulated link to calibrate (run it through "
                   "tools/cluster-sim calibrate)\n";
    }
    return;
  }
  const double link_bits = std::atof(link);
  MPI_Comm comm = MPI_COMM_NULL;
  check(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
  int n = 1;
  MPI_Comm_size(comm, &n);
  const std::string ranks = " n=" + std::to_string(n);

  // Small collectives: many per timed run, so that a run lasts long enough to time.
  {
    constexpr int kCalls = 200;
    std::vector<char> local(4096 / n), gathered(local.size() * n);
    const Stats gather = measure(ctx, [&] {
      for (int i = 0; i < kCalls; ++i) {
        check(MPI_Allgather(local.data(), static_cast<int>(local.size()), MPI_BYTE, gathered.data(),
                            static_cast<int>(local.size()), MPI_BYTE, comm),
              "MPI_Allgather");
      }
    });
    ctx.report(Result{"cluster-calibrate", "MPI_Allgather latency" + ranks + " 4KiB", ctx.backend, "ms",
                      scaled(gather, 1e3 / kCalls), std::nullopt, ""});
    double x = 1, sum = 0;
    const Stats reduce = measure(ctx, [&] {
      for (int i = 0; i < kCalls; ++i) check(MPI_Allreduce(&x, &sum, 1, MPI_DOUBLE, MPI_SUM, comm), "MPI_Allreduce");
    });
    ctx.report(Result{"cluster-calibrate", "MPI_Allreduce latency" + ranks + " 8B", ctx.backend, "ms",
                      scaled(reduce, 1e3 / kCalls), std::nullopt, ""});
  }

  const std::vector<std::int64_t> totals = ctx.quick ? std::vector<std::int64_t>{16 << 20}
                                                     : std::vector<std::int64_t>{64 << 10, 1 << 20, 16 << 20, 64 << 20};
  const Stats set{link_bits / 1e9, link_bits / 1e9, link_bits / 1e9};
  for (const std::int64_t total : totals) {
    const std::int64_t count = total / n;
    std::vector<char> local(count, 1), gathered(count * n, 0);
    // Each timed run moves at least 16 MiB, so that a token bucket's initial burst is a small part of it.
    const int calls = static_cast<int>(std::max<std::int64_t>(1, (16 << 20) / total));
    check(MPI_Barrier(comm), "MPI_Barrier");
    const Stats seconds = measure(ctx, [&] {
      for (int i = 0; i < calls; ++i) {
        check(MPI_Allgather(local.data(), static_cast<int>(count), MPI_BYTE, gathered.data(), static_cast<int>(count),
                            MPI_BYTE, comm),
              "MPI_Allgather");
      }
    });
    const double per_link_gbit = 8e-9 * static_cast<double>(total) * (n - 1) / n * calls;
    ctx.report(Result{"cluster-calibrate", "MPI_Allgather per-link rate" + ranks + " " + size_name(total), ctx.backend,
                      "Gbit/s", rate(seconds, per_link_gbit), set, "tbf rate (set)"});
  }
  MPI_Comm_free(&comm);
}

const bool registered = [] {
  environment();
  return register_suite("cluster-calibrate", run);
}();

}  // namespace
}  // namespace ruda::bench
