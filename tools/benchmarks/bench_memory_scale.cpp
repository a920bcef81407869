// memory-scale: how far sharding stretches a rank's memory. The GPT's planned peak per rank
// against the measured one as the world grows, and the widest GPT whose plan fits a 256 MB per-rank
// budget at 1 and at 4 ranks (ZeRO's ideal ratio of parameter counts is 4).
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include <ruda/nn.h>

#include "bench.h"

namespace ruda::bench {
namespace {

constexpr std::int64_t kContext = 128, kBatch = 16, kLayers = 4;

// The per-rank budget the widest GPT must fit, and the largest d_model its search tries: 256 MB;
// 64 MB with --quick (a smoke run under ctest: each probe of the search measures a training step
// at its width, and at 256 MB the quick run took 270 s on 2 cores).
struct Budget {
  std::int64_t bytes, widest_tried;
};
Budget budget_of(const Context& ctx) { return ctx.quick ? Budget{64'000'000, 512} : Budget{256'000'000, 2048}; }

nn::GPTConfig gpt(std::int64_t d_model) {
  return {.vocabulary = 256, .context = kContext, .d_model = d_model, .layers = kLayers, .heads = 4};
}

// This rank's loss on `local` windows of random bytes (the data does not change the memory).
Tensor loss_of(nn::GPT& model, std::int64_t local, std::uint64_t seed) {
  const Tensor tokens = randint({local, kContext}, 0, 256, seed),
               targets = randint({local, kContext}, 0, 256, seed + 1);
  return nn::cross_entropy(model.forward(tokens), targets, {.reduction = nn::LossReduction::sum}) /
         static_cast<double>(kBatch * kContext);
}

struct Figures {
  std::int64_t predicted = 0, measured = 0, parameters = 0;
};

// The model built deferred, sharded over `world` emulated ranks, its plan measured by probe_step;
// with `steps` > 0 it also trains that many steps and records the measured peak (largest rank).
// With a budget, a model whose state alone does not fit is not materialized (predicted = state).
Figures plan_gpt(std::int64_t d_model, int world, bool checkpointing, int steps, std::int64_t budget = 0) {
  std::vector<Figures> ranks(world);
  run_ranks(world, [&](Communicator& comm) {
    Figures& f = ranks[comm.rank()];
    nn::manual_seed(1);
    nn::GPT model = [&] {
      nn::DeferredInit deferred;
      return nn::GPT(gpt(d_model));
    }();
    model.set_activation_checkpointing(checkpointing);
    f.parameters = model.parameter_count();
    const nn::MemoryPlan state = nn::plan_state(model, world, kBatch);
    if (budget > 0 && state.peak() > budget) {
      f.predicted = state.peak();
      return;
    }
    nn::fully_shard(model, comm);
    const std::uint64_t seed = 100 + static_cast<std::uint64_t>(comm.rank()) * 2;
    // As ruda-train plans: measured at 2 samples, then at the local batch unless already over.
    f.predicted = nn::plan_memory(
                      model, comm, kBatch, [&](std::int64_t b) { return loss_of(model, b, seed); }, budget)
                      .peak();
    if (steps == 0) return;
    nn::AdamW opt(model.parameters(), {.lr = 1e-3});
    memory::reset_peak();
    for (int s = 0; s < steps; ++s) {
      const Tensor loss = loss_of(model, kBatch / world, seed + 10 * static_cast<std::uint64_t>(s));
      opt.zero_grad();
      loss.backward();
      opt.step();
    }
    f.measured = memory::stats().peak_bytes;
  });
  Figures worst = ranks[0];
  for (const auto& f : ranks) {
    worst.predicted = std::max(worst.predicted, f.predicted);
    worst.measured = std::max(worst.measured, f.measured);
  }
  return worst;
}

// The widest d_model (a multiple of 32) whose plan fits the budget, by bisection.
std::int64_t widest(int world, bool checkpointing, const Budget& budget) {
  // In units of 32; lo fits, hi is taken not to (checked below, only where every width tried fit).
  const std::int64_t top = budget.widest_tried / 32;
  std::int64_t lo = 1, hi = top;
  while (hi - lo > 1) {
    const std::int64_t mid = (lo + hi) / 2;
    (plan_gpt(mid * 32, world, checkpointing, 0, budget.bytes).predicted <= budget.bytes ? lo : hi) = mid;
  }
  if (lo == top - 1 && plan_gpt(top * 32, world, checkpointing, 0, budget.bytes).predicted <= budget.bytes) {
    throw std::runtime_error("memory-scale: d_model " + std::to_string(top * 32) + " fits " +
                             std::to_string(budget.bytes) + " bytes at world " + std::to_string(world) +
                             ": the search's upper end must not (Budget::widest_tried)");
  }
  return lo * 32;
}

void report(Context& ctx, const std::string& name, const std::string& unit, double value, std::optional<double> peer,
            const std::string& peer_name) {
  Result r;
  r.suite = "memory-scale";
  r.name = name;
  r.backend = ctx.backend;
  r.unit = unit;
  r.value = Stats{value, value, value};
  if (peer) {
    r.peer = Stats{*peer, *peer, *peer};
    r.peer_name = peer_name;
  }
  ctx.report(r);
}

void memory_scale_suite(Context& ctx) {
  // One backend is enough: the bytes are the same on both (the rows agreed to the byte when both
  // ran); the fastest built, as ruda-train would use.
  if (ctx.backend != available_backends().back()) return;
  // Planned against measured (the peak over two training steps), for ruda-train's default GPT.
  const std::vector<int> worlds = ctx.quick ? std::vector<int>{1, 2} : std::vector<int>{1, 2, 4, 8};
  Figures plain;
  for (int world : worlds) {
    const Figures f = plan_gpt(256, world, false, 2);
    if (world == 1) plain = f;
    report(ctx, "GPT d256 x4, batch 16: measured peak per rank, world " + std::to_string(world) + " (peer: plan)", "MB",
           static_cast<double>(f.measured) / 1e6, static_cast<double>(f.predicted) / 1e6, "plan");
  }
  // What activation checkpointing saves: the measured peak of a training step at one rank.
  const Figures recomputed = plan_gpt(256, 1, true, 2);
  report(ctx, "GPT d256 x4, batch 16: peak with activation checkpointing, world 1 (peer: without)", "MB",
         static_cast<double>(recomputed.measured) / 1e6, static_cast<double>(plain.measured) / 1e6, "without");
  // The widest GPT within the budget, at 1 and at 4 ranks.
  const Budget budget = budget_of(ctx);
  const std::string within = "widest GPT x4 within " + std::to_string(budget.bytes / 1'000'000) + " MB/rank, world ";
  for (bool checkpointing : {false, true}) {
    const std::string how = checkpointing ? ", activation checkpointing" : "";
    std::int64_t params[2] = {0, 0};
    int i = 0;
    for (int world : {1, 4}) {
      const std::int64_t d = widest(world, checkpointing, budget);
      params[i++] = plan_gpt(d, world, checkpointing, 0, budget.bytes).parameters;
      report(ctx, within + std::to_string(world) + how + ": d_model", "", static_cast<double>(d), std::nullopt, "");
    }
    report(ctx, "its parameters at world 4 (peer: world 1)" + how, "M", static_cast<double>(params[1]) / 1e6,
           static_cast<double>(params[0]) / 1e6, "world 1");
  }
}

const bool registered = register_suite("memory-scale", memory_scale_suite);

}  // namespace
}  // namespace ruda::bench
