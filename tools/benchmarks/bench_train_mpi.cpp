// train-step-mpi (in ruda-bench-mpi, under mpiexec): one training step of the 784-1024-1024-10
// MLP at global batch 128, fully sharded over the MPI ranks: forward, backward (reduce-scatter
// of every group's gradients), AdamW on the local slices, against the dense step on the same local
// batch (what the step costs without any collective). Rank 0 reports; every rank runs the same steps.
#include <ruda/mpi.h>
#include <ruda/nn.h>

#include "bench.h"

namespace ruda::bench {
namespace {

MpiEnvironment& environment() {
  static MpiEnvironment env;  // MPI for the process (the collectives suite may have started it)
  return env;
}

// A step is as slow as its slowest rank: the largest median over the ranks (and the smallest
// min and largest max).
Stats slowest(Communicator& comm, const Stats& s) {
  const auto v =
      comm.all_reduce(from_values({s.median, -s.min, s.max}, {3}, DType::f64), Reduction::max).to_vector<double>();
  return Stats{v[0], -v[1], v[2]};
}

void run(Context& ctx) {
  MpiCommunicator comm;
  const int world = comm.world_size();
  constexpr std::int64_t kBatch = 128;
  if (kBatch % world != 0) return;
  const std::int64_t rows = kBatch / world;
  const Tensor x = rand({rows, 784}, 10 + comm.rank()), y = randint({rows}, 0, 10, 20 + comm.rank());
  // Without options: dense (the same local batch, no collective: the peer). With them: sharded,
  // in groups (a group per Linear layer) unless options->group is false.
  auto timed_step = [&](const nn::FullyShardOptions* options) {
    nn::manual_seed(1);
    nn::Sequential model({std::make_shared<nn::Linear>(784, 1024), std::make_shared<nn::ReLU>(),
                          std::make_shared<nn::Linear>(1024, 1024), std::make_shared<nn::ReLU>(),
                          std::make_shared<nn::Linear>(1024, 10)});
    if (options && options->group) {
      for (std::size_t i = 0; i < model.size(); i += 2) nn::fully_shard(*model[i], comm, *options);
    }
    if (options) nn::fully_shard(model, comm, *options);
    nn::AdamW opt(model.parameters(), {.lr = 1e-3});
    auto step = [&] {
      const Tensor loss =
          nn::cross_entropy(model.forward(x), y, {.reduction = nn::LossReduction::sum}) / static_cast<double>(kBatch);
      opt.zero_grad();
      loss.backward();
      opt.step();
    };
    // Past the automatic overlap trial (7 steps) before timing: what a training run gets after it.
    const Stats seconds = slowest(comm, measure(ctx, step, 8));
    memory::reset_peak();
    step();
    const double peak =
        comm.all_reduce(scalar(static_cast<double>(memory::stats().peak_bytes), DType::f64), Reduction::max).item();
    const nn::OverlapReport chose = nn::overlap_report(model);
    return std::tuple{seconds, peak, chose.overlapping};
  };
  const std::string ranks = std::to_string(world) + " MPI ranks";
  const auto [dense, dense_peak, unused] = timed_step(nullptr);
  (void)dense_peak;
  (void)unused;
  const nn::FullyShardOptions automatic{}, on{.overlap = nn::Overlap::on}, off{.overlap = nn::Overlap::off},
      per_parameter{.group = false};
  double peak = 0;
  for (const auto& [label, options] : {std::pair{"in groups, overlap auto", &automatic},
                                       {"in groups, overlap on", &on},
                                       {"in groups, overlap off", &off},
                                       {"per parameter", &per_parameter}}) {
    const auto [seconds, bytes, overlapping] = timed_step(options);
    std::string name = std::string("MLP b128, sharded ") + label + ", " + ranks;
    if (options == &automatic) {
      name += overlapping ? " (chose on)" : " (chose off)";
      peak = bytes;
    }
    ctx.report(Result{"train-step-mpi", name, ctx.backend, "ms", scaled(seconds, 1e3), scaled(dense, 1e3),
                      "dense step on the local batch"});
  }
  Result m;
  m.suite = "train-step-mpi";
  m.name = "peak tensor bytes per rank, sharded in groups, overlap auto, " + ranks;
  m.backend = ctx.backend;
  m.unit = "MB";
  m.value = Stats{peak / 1e6, peak / 1e6, peak / 1e6};
  ctx.report(m);
}

const bool registered = [] {
  environment();
  return register_suite("train-step-mpi", run);
}();

}  // namespace
}  // namespace ruda::bench
