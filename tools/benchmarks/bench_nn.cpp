// nn suites: one training step (forward, backward, AdamW) of the 784-1024-1024-10 MLP at batch
// 128, dense in one process and fully sharded over emulated ranks; and the bytes each rank holds.
#include <functional>
#include <mutex>

#include <ruda/nn.h>

#include "bench.h"

namespace ruda::bench {
namespace {

constexpr std::int64_t kBatch = 128;
using UnaryModuleFn = std::function<Tensor(const Tensor&)>;

std::shared_ptr<nn::Sequential> make_mlp() {
  nn::manual_seed(1);
  return std::make_shared<nn::Sequential>(std::vector<std::shared_ptr<nn::UnaryModule>>{
      std::make_shared<nn::Linear>(784, 1024), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(1024, 1024),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(1024, 10)});
}

// One step on this rank's share of a global batch of kBatch samples.
void step(nn::Sequential& model, nn::Optimizer& opt, const Tensor& x, const Tensor& y, double global_batch) {
  const Tensor loss = nn::cross_entropy(model.forward(x), y, {.reduction = nn::LossReduction::sum}) / global_batch;
  opt.zero_grad();
  loss.backward();
  opt.step();
}

void train_step_suite(Context& ctx) {
  {
    auto model = make_mlp();
    nn::AdamW opt(model->parameters(), {.lr = 1e-3});
    const Tensor x = rand({kBatch, 784}, 1), y = randint({kBatch}, 0, 10, 2);
    Result r;
    r.suite = "train-step";
    r.name = "MLP 784-1024-1024-10 b128, dense";
    r.backend = ctx.backend;
    r.unit = "ms";
    r.value = scaled(measure(
                         ctx, [&] { step(*model, opt, x, y, kBatch); }, 3),
                     1e3);
    ctx.report(r);
  }
  for (int world : {2, 4}) {
    Stats rank0;
    run_ranks(world, [&](Communicator& comm) {
      auto model = make_mlp();
      nn::fully_shard(*model, comm);
      nn::AdamW opt(model->parameters(), {.lr = 1e-3});
      const std::int64_t rows = kBatch / world;
      const Tensor x = rand({rows, 784}, 10 + comm.rank()), y = randint({rows}, 0, 10, 20 + comm.rank());
      // Every rank runs the same number of steps (collectives), rank 0 keeps the timings.
      const Stats s = measure(
          ctx, [&] { step(*model, opt, x, y, kBatch); }, 3);
      if (comm.rank() == 0) rank0 = s;
    });
    Result r;
    r.suite = "train-step";
    r.name = "MLP b128, sharded, " + std::to_string(world) + " emulated ranks";
    r.backend = ctx.backend;
    r.unit = "ms";
    r.value = scaled(rank0, 1e3);
    ctx.report(r);
  }
}

void memory_suite(Context& ctx) {
  // Parameters + gradients + AdamW moments: 4 copies of the parameters.
  auto dense_model = make_mlp();
  const double params_bytes = static_cast<double>(dense_model->parameter_count()) * 4;
  const double dense_state = 4 * params_bytes;
  const double largest_layer = 1024.0 * 1024 * 4 + 1024 * 4;
  auto report = [&](const std::string& name, double value, std::optional<double> target, const char* target_name = "") {
    Result r;
    r.suite = "memory";
    r.name = name;
    r.backend = ctx.backend;
    r.unit = "MB";
    r.value = Stats{value / 1e6, value / 1e6, value / 1e6};
    if (target) {
      r.peer = Stats{*target / 1e6, *target / 1e6, *target / 1e6};
      r.peer_name = target_name;
    }
    ctx.report(r);
  };
  report("dense: params + grads + AdamW state", dense_state, std::nullopt);
  for (int world : {1, 2, 4, 8}) {
    std::vector<std::int64_t> persistent(world), peak(world);
    run_ranks(world, [&](Communicator& comm) {
      auto model = make_mlp();
      nn::fully_shard(*model, comm);
      nn::AdamW opt(model->parameters(), {.lr = 1e-3});
      const std::int64_t rows = std::max<std::int64_t>(1, kBatch / world);
      const Tensor x = rand({rows, 784}, 10 + comm.rank()), y = randint({rows}, 0, 10, 20 + comm.rank());
      step(*model, opt, x, y, kBatch);  // creates the optimizer state
      const std::int64_t inputs = static_cast<std::int64_t>(x.nbytes() + y.nbytes());
      memory::reset_peak();
      step(*model, opt, x, y, kBatch);
      persistent[comm.rank()] = memory::stats().live_bytes - inputs;
      peak[comm.rank()] = memory::stats().peak_bytes - inputs;
    });
    const double worst_persistent = static_cast<double>(*std::max_element(persistent.begin(), persistent.end()));
    const double worst_peak = static_cast<double>(*std::max_element(peak.begin(), peak.end()));
    const std::string w = std::to_string(world);
    report("world " + w + ": params + grads + AdamW state per rank", worst_persistent, dense_state / world, "dense/N");
    report("world " + w + ": peak in a step per rank (incl. activations)", worst_peak,
           dense_state / world + largest_layer, "dense/N + one gathered layer");
  }
}

// The two models of ruda-train, one process, as tools/compare-torch times them in PyTorch:
// a training step of the MLP (AdamW, batch 128) and of the small GPT (Adam, batch 16, context
// 128), in f32 and with bf16 compute (parameters stay f32).
void models_suite(Context& ctx) {
  // One timed figure per model and dtype: a step is forward, loss (in f32), backward, update.
  auto report_step = [&](const std::string& name, nn::Optimizer& opt, const Tensor& x, const Tensor& y,
                         const UnaryModuleFn& forward, int warmup) {
    auto run = [&] {
      const Tensor loss = nn::cross_entropy(cast(forward(x), DType::f32), y);
      opt.zero_grad();
      loss.backward();
      opt.step();
    };
    Result r;
    r.suite = "models";
    r.name = name;
    r.backend = ctx.backend;
    r.unit = "ms";
    r.value = scaled(measure(ctx, run, warmup), 1e3);
    ctx.report(r);
  };
  for (DType compute : {DType::f32, DType::bf16}) {
    const std::string dtype(dtype_name(compute));
    LocalCommunicator comm;
    nn::ShardPolicy policy;
    if (compute != DType::f32) policy.compute_dtype = compute;
    auto mlp = make_mlp();
    nn::fully_shard(*mlp, comm, policy);
    nn::AdamW mlp_opt(mlp->parameters(), {.lr = 1e-3});
    report_step(
        "mlp step, " + dtype, mlp_opt, rand({kBatch, 784}, 1), randint({kBatch}, 0, 10, 2),
        [&](const Tensor& x) { return mlp->forward(x); }, 3);
    nn::manual_seed(1);
    nn::GPT gpt({.vocabulary = 256, .context = 128, .d_model = 256, .layers = 4, .heads = 4});
    nn::fully_shard(gpt, comm, policy);
    nn::Adam gpt_opt(gpt.parameters(), {.lr = 3e-4});
    report_step(
        "gpt step, " + dtype, gpt_opt, randint({16, 128}, 0, 256, 3), randint({16, 128}, 0, 256, 4),
        [&](const Tensor& x) { return gpt.forward(x); }, 2);
  }
}

const bool registered = register_suite("train-step", train_step_suite) && register_suite("memory", memory_suite) &&
                        register_suite("models", models_suite);

}  // namespace
}  // namespace ruda::bench
