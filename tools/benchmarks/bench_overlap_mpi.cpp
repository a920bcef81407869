// Suite "overlap" of ruda-bench-mpi (overlap.h says what it measures): meant for tools/bench
// --suite overlap, which runs it across the two nodes of tools/cluster-sim, one rank and one
// thread each, at link rates below, near and above what a step computes. RUDA_LINK_RATE (which
// cluster-sim exports) names the rate in the rows; without it the ranks share this machine's
// loopback. Rank 0 prints.
#include <ruda/mpi.h>

#include <cstdlib>
#include <string>

#include "overlap.h"

namespace ruda::bench {
namespace {

MpiEnvironment& environment() {
  static MpiEnvironment env;
  return env;
}

std::string link_name(int world) {
  const char* rate = std::getenv("RUDA_LINK_RATE");  // bits per second
  if (!rate || !*rate) return "this machine's loopback";
  return LinkModel::parse(std::string(rate) + "bit/s").describe() + " link (" + std::to_string(world) +
         " cluster-sim nodes)";
}

void run(Context& ctx) {
  // One backend is enough here: the fastest built (onednn where built), as ruda-train would use.
  if (ctx.backend != available_backends().back()) return;
  MpiCommunicator comm;
  const std::string where = link_name(comm.world_size());
  for (overlap::Maker make : overlap::models()) overlap::measure_model(ctx, comm, make, where);
}

const bool registered = [] {
  environment();
  should_print = [] { return environment().world_rank() == 0; };
  return register_suite("overlap", run);
}();

}  // namespace
}  // namespace ruda::bench
