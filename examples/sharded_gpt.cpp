// A GPT trained fully sharded through ruda's public headers alone: each rank holds 1/N of every
// parameter, its gradient and its AdamW state, and gathers a block's weights only while it runs.
//   sharded_gpt [RANKS] [STEPS]     ranks as threads in this process (default 2 ranks, 60 steps)
//   mpiexec -n 2 sharded_gpt        one rank per process (where ruda was built with MPI)
// The data is a learnable byte pattern (each row counts up from its own start, modulo 23); the
// program exits 0 when the loss has fallen to under half its first value.
#include <ruda/nn.h>
#ifdef RUDA_EXAMPLE_WITH_MPI
#include <ruda/mpi.h>
#endif

#include <cstdio>
#include <cstdlib>
#include <vector>

using namespace ruda;

constexpr std::int64_t kBatch = 16, kContext = 16, kPeriod = 23;

// This rank's rows of step `step`'s global batch: tokens and next-token targets.
std::pair<Tensor, Tensor> local_batch(const Communicator& comm, int step) {
  const std::int64_t rows = kBatch / comm.world_size(), first = comm.rank() * rows;
  std::vector<std::int64_t> x, y;
  for (std::int64_t r = first; r < first + rows; ++r) {
    for (std::int64_t t = 0; t < kContext; ++t) {
      x.push_back((step * 7 + r * 5 + t) % kPeriod);
      y.push_back((step * 7 + r * 5 + t + 1) % kPeriod);
    }
  }
  return {from_vector(x, {rows, kContext}, Options(DType::i64)), from_vector(y, {rows, kContext}, Options(DType::i64))};
}

// Trains and returns the global loss of the first and the last step (the same on every rank).
std::pair<double, double> train(Communicator& comm, int steps) {
  nn::manual_seed(1);
  nn::DeferredInit deferred;  // the model allocates nothing: fully_shard draws each rank's slices
  nn::GPT model({.vocabulary = 32, .context = kContext, .d_model = 64, .layers = 2, .heads = 2});
  for (auto& block : model.blocks) nn::fully_shard(*block, comm);  // a group per block, bottom-up
  nn::fully_shard(model, comm);                                    // the root: embeddings, norm, head
  nn::AdamW opt(model.parameters(), {.lr = 3e-3});
  const double tokens = nn::global_count(comm, static_cast<double>(kBatch / comm.world_size() * kContext));
  double first = 0, last = 0;
  for (int step = 0; step < steps; ++step) {
    const auto [x, y] = local_batch(comm, step);
    const Tensor loss = nn::cross_entropy(model.forward(x), y, {.reduction = nn::LossReduction::sum}) / tokens;
    opt.zero_grad();
    loss.backward();                                     // one reduce-scatter per group
    nn::clip_grad_norm(model.parameters(), 1.0, &comm);  // the global norm
    opt.step();                                          // on the local slices
    last = comm.all_reduce(loss.detach()).item();
    if (step == 0) first = last;
    if (comm.rank() == 0 && (step % 20 == 0 || step + 1 == steps)) std::printf("step %d loss %.4f\n", step, last);
  }
  return {first, last};
}

int main(int argc, char** argv) {
  try {
    const int ranks = argc > 1 ? std::atoi(argv[1]) : 2, steps = argc > 2 ? std::atoi(argv[2]) : 60;
    if (ranks < 1 || kBatch % ranks != 0 || steps < 1) {
      std::fprintf(stderr, "sharded_gpt: RANKS must divide %lld and STEPS be positive\n",
                   static_cast<long long>(kBatch));
      return 2;
    }
    std::pair<double, double> losses;
    if (launched_by_mpi()) {
#ifdef RUDA_EXAMPLE_WITH_MPI
      MpiEnvironment mpi(argc, argv);
      MpiCommunicator comm;
      losses = train(comm, steps);
      if (comm.rank() != 0) return losses.second < 0.5 * losses.first ? 0 : 1;
#else
      std::fprintf(stderr, "sharded_gpt: built without MPI; run it without mpiexec\n");
      return 2;
#endif
    } else {
      run_ranks(ranks, [&](Communicator& comm) {
        const auto l = train(comm, steps);
        if (comm.rank() == 0) losses = l;
      });
    }
    const bool learned = losses.second < 0.5 * losses.first;
    std::printf("%s: loss %.4f -> %.4f\n", learned ? "learned" : "did not learn", losses.first, losses.second);
    return learned ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sharded_gpt: %s\n", e.what());
    return 1;
  }
}
