// Suite "hybrid" of ruda-bench-mpi (hybrid.h says what it measures): meant for tools/bench --suite
// hybrid, which runs it across the two nodes of tools/cluster-sim, 2 ranks and one thread each,
// at 1 and 10 Gbit/s. The nodes are MPI's shared-memory nodes (cluster-sim gives each its own
// hostname); the bytes between nodes are read from each node's interface (ruda-eth0 in
// /proc/net/dev, which shows the reading process's network namespace). Without cluster-sim the
// ranks share this machine's loopback, and blocks of 2 ranks stand for the nodes (no byte rows).
#include <ruda/mpi.h>
#include <iostream>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "hybrid.h"

namespace ruda::bench {
namespace {

MpiEnvironment& environment() {
  static MpiEnvironment env;
  return env;
}

// Bytes sent by this namespace's ruda-eth0 (the cluster-sim node's interface), if it has one.
std::optional<double> node_sent_bytes() {
  std::ifstream in("/proc/net/dev");
  std::string line;
  while (std::getline(in, line)) {
    const std::size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    name.erase(0, name.find_first_not_of(' '));
    if (name != "ruda-eth0") continue;
    std::istringstream fields(line.substr(colon + 1));
    double v = 0, sent = 0;
    for (int i = 0; i < 9 && fields >> v; ++i) sent = v;  // receive: 8 fields; the 9th is bytes sent
    return sent;
  }
  return std::nullopt;
}

void run(Context& ctx) {
  // One backend is enough here: the fastest built (onednn where built), as ruda-train would use.
  if (ctx.backend != available_backends().back()) return;
  MpiCommunicator comm;
  if (comm.world_size() % 2 != 0) {
    if (comm.rank() == 0) {
      std::cerr << "ruda-bench-mpi: suite hybrid needs an even number of ranks (nodes of 2 at least; got "
                << comm.world_size() << "): nothing measured" << std::endl;
    }
    return;
  }
  ShardMesh mesh = ShardMesh::by_node(comm);
  std::string where;
  if (const char* rate = std::getenv("RUDA_LINK_RATE"); rate && *rate && mesh.nodes() > 1) {
    where = LinkModel::parse(std::string(rate) + "bit/s").describe() + " links (cluster-sim)";
  } else {
    mesh = ShardMesh::by_node(comm, 2);
    where = "this machine's loopback, blocks of 2 ranks as nodes";
  }
  const bool counters = comm.all_reduce(scalar(node_sent_bytes() ? 0.0 : 1.0)).item() == 0;
  for (overlap::Maker make : overlap::models()) {
    hybrid::measure_model(ctx, mesh, make, where, counters ? hybrid::NodeCounter(&node_sent_bytes) : nullptr);
  }
}

const bool registered = [] {
  environment();
  return register_suite("hybrid", run);
}();

}  // namespace
}  // namespace ruda::bench
