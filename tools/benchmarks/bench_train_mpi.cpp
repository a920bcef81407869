// train-step-mpi (in ruda-bench-mpi, under mpiexec): one training step of the 784-1024-1024-10
// MLP at global batch 128, fully sharded over the MPI ranks: forward, backward (reduce-scatter
// of every group's gradients), AdamW on the local slices, against the dense step on the same local
// batch (what the step costs without any collective). Rank 0 reports; every rank runs the same steps.
#include <ruda/mpi.h>
#include <ruda/nn.h>
#include <iostream>

#include "overlap.h"

namespace ruda::bench {
namespace {

MpiEnvironment& environment() {
  static MpiEnvironment env;  // MPI for the process (the collectives suite may have started it)
  return env;
}

void run(Context& ctx) {
  MpiCommunicator comm;
  const int world = comm.world_size();
  if (128 % world != 0) {  // the MLP's global batch
    if (comm.rank() == 0) {
      std::cerr << "ruda-bench-mpi: suite train-step-mpi needs a rank count that divides the MLP's batch of 128 (got "
                << world << "): nothing measured" << std::endl;
    }
    return;
  }
  // Past the automatic overlap trial (7 steps) before timing: what a training run gets after it.
  constexpr int kWarmup = 8;
  const std::string ranks = std::to_string(world) + " MPI ranks";
  const Stats dense = overlap::train_step(ctx, comm, &overlap::make_mlp, nullptr, kWarmup).seconds;
  const nn::FullyShardOptions automatic{}, on{.overlap = nn::Overlap::on}, off{.overlap = nn::Overlap::off},
      per_parameter{.group = false};
  double peak = 0;
  for (const auto& [label, options] : {std::pair{"in groups, overlap auto", &automatic},
                                       {"in groups, overlap on", &on},
                                       {"in groups, overlap off", &off},
                                       {"per parameter", &per_parameter}}) {
    const overlap::TrainStep t = overlap::train_step(ctx, comm, &overlap::make_mlp, options, kWarmup);
    std::string name = std::string("MLP b128, sharded ") + label + ", " + ranks;
    if (options == &automatic) {
      name += t.overlap.overlapping ? " (chose on)" : " (chose off)";
      peak = t.peak_bytes;
    }
    ctx.report(Result{"train-step-mpi", name, ctx.backend, "ms", scaled(t.seconds, 1e3), scaled(dense, 1e3),
                      "dense step on the local batch"});
  }
  ctx.report(Result{"train-step-mpi", "peak tensor bytes per rank, sharded in groups, overlap auto, " + ranks,
                    ctx.backend, "MB", Stats{peak / 1e6, peak / 1e6, peak / 1e6}, std::nullopt, ""});
}

const bool registered = [] {
  environment();
  return register_suite("train-step-mpi", run);
}();

}  // namespace
}  // namespace ruda::bench
