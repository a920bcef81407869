// train-step-mpi (in ruda-bench-mpi, under mpiexec): one training step of the 784-1024-1024-10
// MLP at global batch 128, fully sharded over the MPI ranks: forward, backward (reduce-scatter
// of every gradient), AdamW on the local slices. Rank 0 reports; every rank runs the same steps.
#include <ruda/mpi.h>
#include <ruda/nn.h>

#include "bench.h"

namespace ruda::bench {
namespace {

MpiEnvironment& environment() {
  static MpiEnvironment env;  // MPI for the process (the collectives suite may have started it)
  return env;
}

void run(Context& ctx) {
  MpiCommunicator comm;
  const int world = comm.world_size();
  constexpr std::int64_t kBatch = 128;
  if (kBatch % world != 0) return;
  nn::manual_seed(1);
  nn::Sequential model({std::make_shared<nn::Linear>(784, 1024), std::make_shared<nn::ReLU>(),
                        std::make_shared<nn::Linear>(1024, 1024), std::make_shared<nn::ReLU>(),
                        std::make_shared<nn::Linear>(1024, 10)});
  nn::fully_shard(model, comm);
  nn::AdamW opt(model.parameters(), {.lr = 1e-3});
  const std::int64_t rows = kBatch / world;
  const Tensor x = rand({rows, 784}, 10 + comm.rank()), y = randint({rows}, 0, 10, 20 + comm.rank());
  auto step = [&] {
    const Tensor loss =
        nn::cross_entropy(model.forward(x), y, {.reduction = nn::LossReduction::sum}) / static_cast<double>(kBatch);
    opt.zero_grad();
    loss.backward();
    opt.step();
  };
  const Stats seconds = measure(ctx, step, 3);
  // A step is as slow as its slowest rank: the largest median over the ranks (and the smallest
  // min and largest max).
  const auto across =
      comm.all_reduce(from_values({seconds.median, -seconds.min, seconds.max}, {3}, DType::f64), Reduction::max)
          .to_vector<double>();
  memory::reset_peak();
  step();
  const double peak =
      comm.all_reduce(scalar(static_cast<double>(memory::stats().peak_bytes), DType::f64), Reduction::max).item();
  Result r;
  r.suite = "train-step-mpi";
  r.name = "MLP b128, sharded, " + std::to_string(world) + " MPI ranks";
  r.backend = ctx.backend;
  r.unit = "ms";
  r.value = Stats{across[0] * 1e3, -across[1] * 1e3, across[2] * 1e3};
  ctx.report(r);
  Result m;
  m.suite = "train-step-mpi";
  m.name = "peak tensor bytes per rank, " + std::to_string(world) + " MPI ranks";
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
