// nn suites: one training step (forward, backward, AdamW) of the 784-1024-1024-10 MLP at batch
// 128, dense in one process and fully sharded over emulated ranks, and the GPT's sharded step
// against dense; the bytes each rank holds; and the models' steps with their fraction of the
// GEMM rate.
#include <functional>
#include <mutex>
#include <thread>

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

void sharded_gpt_row(Context& ctx);

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
  sharded_gpt_row(ctx);
}

// The sharded step's own cost: the default GPT over 2 emulated ranks without a link model (each
// rank one thread on its half of the batch) against the same step dense on the local batch with
// the same threads, two dense replicas stepping at once as the ranks do (one dense step alone
// had the machine's memory bandwidth and cache to itself, and the ratio counted two ranks
// sharing them as sharding's cost). The ratio is what sharding adds (gathers, copies into and
// out of flat buffers, reduce-scatters, bookkeeping) when the wire costs nothing.
void sharded_gpt_row(Context& ctx) {
  constexpr int kWorld = 2;
  constexpr std::int64_t kGlobal = 16, kLocal = kGlobal / kWorld;
  const nn::GPTConfig config{.vocabulary = 256, .context = 128, .d_model = 256, .layers = 4, .heads = 4};
  auto gpt_step = [](nn::GPT& gpt, nn::Optimizer& opt, const Tensor& x, const Tensor& y) {
    const Tensor loss = nn::cross_entropy(gpt.forward(x), y, {.reduction = nn::LossReduction::sum}) /
                        static_cast<double>(kGlobal * 128);
    opt.zero_grad();
    loss.backward();
    opt.step();
  };
  const int threads = std::max(1, hardware_threads() / kWorld);
  // Each rank holds both models and times their steps in alternation (sharded, dense, ...), so
  // that load changes between them do not decide the ratio; the dense steps run no collective.
  Stats rank0, dense;
  run_ranks(kWorld, [&](Communicator& comm) {
    set_num_threads(threads);
    nn::manual_seed(1);
    nn::GPT replica(config);
    nn::manual_seed(1);
    nn::GPT gpt(config);
    nn::fully_shard(gpt, comm);
    nn::Adam replica_opt(replica.parameters(), {.lr = 3e-4}), opt(gpt.parameters(), {.lr = 3e-4});
    const Tensor x = randint({kLocal, 128}, 0, 256, 3 + comm.rank()),
                 y = randint({kLocal, 128}, 0, 256, 4 + comm.rank());
    const auto [sharded, alone] = measure_pair(
        ctx, [&] { gpt_step(gpt, opt, x, y); }, [&] { gpt_step(replica, replica_opt, x, y); }, 2);
    if (comm.rank() == 0) {
      rank0 = sharded;
      dense = alone;
    }
  });
  report_time(ctx, "train-step",
              "GPT d256 L4 b16, sharded over 2 emulated ranks (no link), " + std::to_string(threads) +
                  " thread(s) each, vs dense on the local batch 8",
              rank0, dense, "dense b8, same threads, two replicas at once", "ms", 1e3);
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

// The FLOPs of the matrix products a training step needs (2 m n k each, forward and backward),
// counted from the shapes. The model's own products only: what the engine recomputes to save
// memory (the flash-attention backward's score blocks, linear_gelu's pre-activation) is work the
// step does but not work the model asks for, so it does not raise the figure.
struct StepFlops {
  double value = 0;
  // A linear of `rows` x [in, out]: forward, the weight's gradient, and the input's unless it is
  // the model's input (needs_input_grad false).
  void linear(double rows, double in, double out, bool needs_input_grad = true) {
    value += 2 * rows * in * out * (needs_input_grad ? 3 : 2);
  }
};

double mlp_flops(double batch) {
  StepFlops f;
  f.linear(batch, 784, 1024, false);
  f.linear(batch, 1024, 1024);
  f.linear(batch, 1024, 10);
  return f.value;
}

double gpt_flops(const nn::GPTConfig& c, double batch) {
  StepFlops f;
  const double tokens = batch * static_cast<double>(c.context), d = static_cast<double>(c.d_model);
  const double t = static_cast<double>(c.context);
  for (std::int64_t l = 0; l < c.layers; ++l) {
    f.linear(tokens, d, 3 * d);  // qkv
    f.linear(tokens, d, d);      // projection
    f.linear(tokens, d, 4 * d);  // fc1
    f.linear(tokens, 4 * d, d);  // fc2
    // q k^T and p v per head: 2 products of 2 T T D forward, 4 backward (dV, dP, dQ, dK);
    // causal: half the blocks.
    f.value += 0.5 * 6 * 2 * batch * t * t * d;
  }
  f.linear(tokens, d, static_cast<double>(c.vocabulary));  // the output head
  return f.value;
}

// A model's step and ruda's GEMM rate on [rows, inner] x [inner, cols] in `dtype` (FLOP/s), timed
// in alternation: a step, then kGemmCalls products, and again. Timed apart, the machine's drift
// landed on one side of the fraction (this VM's GEMM rate moved between 150 and 220 GFLOP/s from
// one run to the next).
struct StepAndGemm {
  Stats step, gemm_rate;
};
template <class Step>
StepAndGemm time_step_and_gemm(const Context& ctx, Step&& step, std::int64_t rows, std::int64_t inner,
                               std::int64_t cols, DType dtype, int warmup) {
  constexpr int kGemmCalls = 5;
  const Tensor a = randn({rows, inner}, 1).to(dtype), b = randn({inner, cols}, 2).to(dtype);
  const auto [step_seconds, gemm_seconds] = measure_pair(
      ctx, step,
      [&] {
        for (int i = 0; i < kGemmCalls; ++i) (void)matmul(a, b);
      },
      warmup);
  return {step_seconds, rate(gemm_seconds, kGemmCalls * 2.0 * static_cast<double>(rows * inner * cols))};
}

// The two models of ruda-train, one process, as tools/compare-torch times them in PyTorch:
// a training step of the MLP (AdamW, batch 128) and of the small GPT (Adam, batch 16, context
// 128), in f32 and with bf16 compute (parameters stay f32). Each step also gives a "fraction of
// GEMM" row: the model's matrix-product FLOPs per second of step (StepFlops) over ruda's GEMM
// rate on the model's characteristic product (the MLP's [128, 1024] x [1024, 1024]; the GPT's
// [tokens, d] x [d, 4d]), timed in alternation with the step, so the ratio is the fraction of the
// GEMM rate the whole step achieves. Then the GPT-2-small shape at context 1024 (batch 1): its f32
// and bf16 fractions and its memory plan's step row.
void models_suite(Context& ctx) {
  // One timed figure per model and dtype: a step is forward, loss (in f32), backward, update.
  auto step_of = [](nn::Optimizer& opt, const Tensor& x, const Tensor& y, const UnaryModuleFn& forward) {
    return [&opt, x, y, forward] {
      const Tensor loss = nn::cross_entropy(cast(forward(x), DType::f32), y);
      opt.zero_grad();
      loss.backward();
      opt.step();
    };
  };
  auto report_step = [&](const std::string& name, const Stats& seconds) {
    Result r;
    r.suite = "models";
    r.name = name;
    r.backend = ctx.backend;
    r.unit = "ms";
    r.value = scaled(seconds, 1e3);
    ctx.report(r);
  };
  auto report_fraction = [&](const std::string& name, const Stats& seconds, double flops, const Stats& gemm,
                             const std::string& gemm_name) {
    Result r;
    r.suite = "models";
    r.name = name + " fraction of GEMM";
    r.backend = ctx.backend;
    r.unit = "GFLOP/s";
    r.value = scaled(rate(seconds, flops), 1e-9);
    r.peer = scaled(gemm, 1e-9);
    r.peer_name = "ruda GEMM " + gemm_name;
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
    const StepAndGemm mlp_step =
        time_step_and_gemm(ctx,
                           step_of(mlp_opt, rand({kBatch, 784}, 1), randint({kBatch}, 0, 10, 2),
                                   [&](const Tensor& x) { return mlp->forward(x); }),
                           kBatch, 1024, 1024, compute, 3);
    report_step("mlp step, " + dtype, mlp_step.step);
    report_fraction("mlp step, " + dtype, mlp_step.step, mlp_flops(kBatch), mlp_step.gemm_rate,
                    "[128, 1024] x [1024, 1024] " + dtype);

    nn::manual_seed(1);
    const nn::GPTConfig config{.vocabulary = 256, .context = 128, .d_model = 256, .layers = 4, .heads = 4};
    nn::GPT gpt(config);
    nn::fully_shard(gpt, comm, policy);
    nn::Adam gpt_opt(gpt.parameters(), {.lr = 3e-4});
    const StepAndGemm gpt_step =
        time_step_and_gemm(ctx,
                           step_of(gpt_opt, randint({16, 128}, 0, 256, 3), randint({16, 128}, 0, 256, 4),
                                   [&](const Tensor& x) { return gpt.forward(x); }),
                           16 * 128, 256, 1024, compute, 2);
    report_step("gpt step, " + dtype, gpt_step.step);
    report_fraction("gpt step, " + dtype, gpt_step.step, gpt_flops(config, 16), gpt_step.gemm_rate,
                    "[2048, 256] x [256, 1024] " + dtype);
  }
  if (ctx.quick) return;  // GPT-2-small takes seconds per step

  // GPT-2-small: d 768, 12 layers, 12 heads, context 1024, vocabulary 256, batch 1; f32 first.
  LocalCommunicator comm;
  nn::manual_seed(1);
  const nn::GPTConfig config{.vocabulary = 256, .context = 1024, .d_model = 768, .layers = 12, .heads = 12};
  nn::GPT gpt(config);
  nn::fully_shard(gpt, comm);
  nn::Adam opt(gpt.parameters(), {.lr = 3e-4});
  const Tensor x = randint({1, 1024}, 0, 256, 5), y = randint({1, 1024}, 0, 256, 6);
  const nn::MemoryPlan plan = nn::plan_memory(
      gpt, comm, 1,
      [&](std::int64_t b) {
        return nn::cross_entropy(gpt.forward(randint({b, 1024}, 0, 256, 7)), randint({b, 1024}, 0, 256, 8));
      },
      0);
  Context few = ctx;
  few.repeats = std::min(ctx.repeats, 5);
  const StepAndGemm timed = time_step_and_gemm(few, step_of(opt, x, y, [&](const Tensor& t) { return gpt.forward(t); }),
                                               1024, 768, 3072, DType::f32, 1);
  const Stats& step = timed.step;
  report_step("gpt2-small step (d768 L12 H12 T1024 b1), f32", step);
  // The same step recomputing the MLPs' pre-activations (ruda-train lm --recompute-gelu),
  // alternated with the default step (timed apart, the two ran under different loads).
  const auto gpt_step = step_of(opt, x, y, [&](const Tensor& t) { return gpt.forward(t); });
  const auto [recomputing, keeping] = measure_pair(
      few,
      [&] {
        gpt.set_gelu_backward(GeluBackward::recompute);
        gpt_step();
      },
      [&] {
        gpt.set_gelu_backward(GeluBackward::keep_pre_activation);
        gpt_step();
      },
      1);
  gpt.set_gelu_backward(GeluBackward::recompute);
  const nn::MemoryPlan recompute_plan = nn::plan_memory(
      gpt, comm, 1,
      [&](std::int64_t b) {
        return nn::cross_entropy(gpt.forward(randint({b, 1024}, 0, 256, 7)), randint({b, 1024}, 0, 256, 8));
      },
      0);
  gpt.set_gelu_backward(GeluBackward::keep_pre_activation);
  report_time(ctx, "models", "gpt2-small step recomputing the GELU pre-activations, f32", recomputing, keeping,
              "keeping them (the default)", "ms", 1e3);
  report_fraction("gpt2-small step (d768 L12 H12 T1024 b1), f32", step, gpt_flops(config, 1), timed.gemm_rate,
                  "[1024, 768] x [768, 3072] f32");
  Result r;
  r.suite = "models";
  r.name = "gpt2-small memory plan: step row per sample (target 650 MB)";
  r.backend = ctx.backend;
  r.unit = "MB";
  const double mb = static_cast<double>(plan.step) / 1e6;
  r.value = Stats{mb, mb, mb};
  r.peer = Stats{650, 650, 650};
  r.peer_name = "target";
  ctx.report(r);
  const double recompute_mb = static_cast<double>(recompute_plan.step) / 1e6;
  r.name = "gpt2-small memory plan: step row per sample recomputing the GELU pre-activations";
  r.value = Stats{recompute_mb, recompute_mb, recompute_mb};
  ctx.report(r);

  // The same model with bf16 compute (parameters, gradients and Adam's state stay f32), against
  // the bf16 GEMM rate on its MLP product.
  nn::manual_seed(1);
  nn::GPT gpt16(config);
  nn::ShardPolicy bf16_policy;
  bf16_policy.compute_dtype = DType::bf16;
  nn::fully_shard(gpt16, comm, bf16_policy);
  nn::Adam opt16(gpt16.parameters(), {.lr = 3e-4});
  const StepAndGemm timed16 = time_step_and_gemm(
      few, step_of(opt16, x, y, [&](const Tensor& t) { return gpt16.forward(t); }), 1024, 768, 3072, DType::bf16, 1);
  report_step("gpt2-small step (d768 L12 H12 T1024 b1), bf16", timed16.step);
  report_fraction("gpt2-small step (d768 L12 H12 T1024 b1), bf16", timed16.step, gpt_flops(config, 1),
                  timed16.gemm_rate, "[1024, 768] x [768, 3072] bf16");
}

// One Adam step over a flat parameter (16M elements; 1M with --quick) against three f32 copies of
// its length in the same run: Adam reads parameter, gradient and both moments and writes three of
// them (28 bytes an f32 parameter; 22 a bf16 one, whose moments are f32), the copies read three
// and write three (24). Both as GB/s moved: a ratio near 1 or above means the fused kernel runs at
// the memory's speed (its loop compiled scalar once: 0.32 of the copies, 10 GB/s against 33 in
// one session; vectorized 1.6, 54 GB/s).
void optimizer_suite(Context& ctx) {
  const std::int64_t n = ctx.quick ? 1 << 20 : 1 << 24;
  Tensor a = zeros({n}), b = zeros({n}), c = zeros({n});
  const Tensor src = randn({n}, 3);
  for (DType dtype : {DType::f32, DType::bf16}) {
    nn::Param p(randn({n}, 1).to(dtype));
    p.value().set_grad(randn({n}, 2).to(dtype));
    nn::Adam opt(std::vector<nn::Param>{p}, {.lr = 1e-3});
    const auto [adam, copies] = measure_pair(
        ctx, [&] { opt.step(); },
        [&] {
          a.copy_(src);
          b.copy_(src);
          c.copy_(src);
        });
    const auto item = static_cast<double>(dtype_size(dtype));
    const auto moment = static_cast<double>(dtype_size(nn::Adam::moment_dtype(dtype)));
    Result r;
    r.suite = "optimizer";
    r.name = "adam step, " + std::to_string(n >> 20) + "M " + std::string(dtype_name(dtype)) + " parameters";
    r.backend = ctx.backend;
    r.unit = "GB/s";
    // The parameter read and written, its gradient read; each moment read and written.
    r.value = rate(adam, 1e-9 * (3 * item + 4 * moment) * static_cast<double>(n));
    r.peer = rate(copies, 24e-9 * static_cast<double>(n));
    r.peer_name = "three f32 copies of the same length (24 bytes a parameter)";
    ctx.report(r);
  }
}

const bool registered = register_suite("train-step", train_step_suite) && register_suite("memory", memory_suite) &&
                        register_suite("models", models_suite) && register_suite("optimizer", optimizer_suite);

}  // namespace
}  // namespace ruda::bench
