// Suite "hybrid-emulated" of ruda-bench (hybrid.h says what it measures): the same rows as the MPI
// suite "hybrid" on 2 emulated nodes of 2 ranks (threads, one intra-op thread each), each node with
// one link of the link model: collectives inside a node take no link time, those across share the
// node's link. 1 Gbit/s and 10 Gbit/s (--quick: 10 Gbit/s), with 20 us per message step. No byte
// rows (no interface). tools/bench --suite hybrid runs it too.
#include <ruda/collectives.h>

#include <string>
#include <vector>

#include "hybrid.h"

namespace ruda::bench {
namespace {

void run(Context& ctx) {
  if (ctx.backend != available_backends().back()) return;
  // --quick (a smoke run, under ctest): the faster link only, whose steps take a third of the
  // slower one's time.
  const std::vector<const char*> rates =
      ctx.quick ? std::vector<const char*>{"10Gbit/s,20us"} : std::vector<const char*>{"1Gbit/s,20us", "10Gbit/s,20us"};
  for (const char* rate : rates) {
    EmulatedOptions options;
    options.threads_per_rank = 1;
    options.check_order = false;
    options.ranks_per_node = 2;
    options.link = LinkModel::parse(rate);
    const std::string where = "emulated " + options.link->describe() + " link per node";
    for (overlap::Maker make : overlap::models()) {
      run_ranks(
          4,
          [&](Communicator& comm) {
            const ShardMesh mesh = ShardMesh::by_node(comm);
            hybrid::measure_model(ctx, mesh, make, where, nullptr);
          },
          options);
    }
  }
}

const bool registered = register_suite("hybrid-emulated", run);

}  // namespace
}  // namespace ruda::bench
