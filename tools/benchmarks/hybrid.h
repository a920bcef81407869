// The "hybrid" measurement, shared by the MPI suite (bench_hybrid_mpi.cpp: across the nodes of
// tools/cluster-sim, 2 ranks each) and the emulated one (bench_hybrid_emulated.cpp: 2 x 2 ranks as
// threads, one link per node in the link model). The GPT and the MLP of overlap.h, trained
// fully sharded over every rank and hybrid sharded (within a node, replicated across nodes),
// each timed in the same run as:
//   step           a training step (groups, prefetch, overlap on)
//   communication  the step's collectives alone, at the same sizes and in the same order
//   bytes          what crossed between nodes per step, where a reader of the nodes' interface
//                  counters is given (MPI across cluster-sim nodes)
// with "ratio" = variant / full shard. Each figure is the slowest rank's (bytes: all nodes' sum).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "overlap.h"

namespace ruda::bench::hybrid {

struct Variant {
  std::string name;
  bool hybrid = false;
  bool int8 = false;  // GatherQuantization::int8
};
inline const std::vector<Variant>& variants() {
  static const std::vector<Variant> all{
      {"full shard", false, false}, {"full shard + int8 gather", false, true}, {"hybrid", true, false}};
  return all;
}

/// `make`'s model sharded as `variant` says over `mesh` (a group per block or layer, then the
/// root's), with its optimizer, and one training step of it.
struct Trainer {
  overlap::Model model;
  nn::AdamW optimizer;
  Trainer(const ShardMesh& mesh, overlap::Maker make, const Variant& variant)
      : model((nn::manual_seed(1), make(mesh.world().world_size(), mesh.world().rank()))),
        optimizer(shard(mesh, model, variant), {.lr = 1e-4}) {}
  void step() {
    const Tensor loss = model.loss(*model.root);
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
  }

 private:
  static std::vector<nn::Param> shard(const ShardMesh& mesh, overlap::Model& m, const Variant& variant) {
    nn::FullyShardOptions options{.overlap = nn::Overlap::on};
    if (variant.int8) options.policy.gather_quantization = nn::GatherQuantization::int8;
    for (nn::Module* module : m.groups) {
      variant.hybrid ? nn::fully_shard(*module, mesh, options) : nn::fully_shard(*module, mesh.world(), options);
    }
    variant.hybrid ? nn::fully_shard(*m.root, mesh, options) : nn::fully_shard(*m.root, mesh.world(), options);
    return m.root->parameters();
  }
};

/// A training step's time (the slowest rank's).
inline Stats train_step(const Context& ctx, const ShardMesh& mesh, overlap::Maker make, const Variant& variant) {
  Trainer t(mesh, make, variant);
  return overlap::slowest(mesh.world(), measure(ctx, [&] { t.step(); }));
}

/// The step's collectives alone (overlap::communication_only), over the ranks the model is
/// sharded over; hybrid adds the all-reduce of each reduced shard across nodes.
inline Stats communication_only(const Context& ctx, const ShardMesh& mesh, overlap::Maker make,
                                const Variant& variant) {
  return overlap::communication_only(ctx, mesh.world(), variant.hybrid ? mesh.shard() : mesh.world(), make,
                                     variant.hybrid ? &mesh.replicate() : nullptr, variant.int8);
}

/// Bytes this node's interface has sent so far, or nothing where there is no such counter.
using NodeCounter = std::function<std::optional<double>()>;

/// Cross-node bytes per step: every node's sent bytes over `steps` training steps, summed.
inline std::optional<double> bytes_per_step(const ShardMesh& mesh, overlap::Maker make, const Variant& variant,
                                            const NodeCounter& counter) {
  if (!counter) return std::nullopt;
  Communicator& world = mesh.world();
  Trainer t(mesh, make, variant);
  auto step = [&] { t.step(); };
  step();  // the first step's extras stay out
  constexpr int kSteps = 4;
  const bool leader = mesh.shard().rank() == 0;  // one reader per node
  world.barrier();
  const std::optional<double> before = leader ? counter() : std::optional<double>(0.0);
  for (int i = 0; i < kSteps; ++i) step();
  world.barrier();
  const std::optional<double> after = leader ? counter() : std::optional<double>(0.0);
  const double mine = before && after ? *after - *before : -1e30;
  const double total = world.all_reduce(scalar(mine, DType::f64)).item();
  if (total < 0) return std::nullopt;
  return total / kSteps;
}

/// Every variant of `make`'s model on `mesh` and their rows; `where` names the link.
inline void measure_model(Context& ctx, const ShardMesh& mesh, overlap::Maker make, const std::string& where,
                          const NodeCounter& counter) {
  Communicator& world = mesh.world();
  const std::string name = make(world.world_size(), world.rank()).name + ", " + mesh.describe() + ", " + where;
  std::vector<Stats> steps, comms;
  std::vector<std::optional<double>> bytes;
  for (const Variant& v : variants()) {
    steps.push_back(train_step(ctx, mesh, make, v));
    comms.push_back(communication_only(ctx, mesh, make, v));
    bytes.push_back(bytes_per_step(mesh, make, v, counter));
  }
  if (world.rank() != 0) return;
  for (std::size_t i = 0; i < variants().size(); ++i) {
    const bool peer = i > 0;
    const std::string label = name + ": " + variants()[i].name;
    const std::string full = "full shard over " + std::to_string(world.world_size()) + " ranks";
    ctx.report(Result{"hybrid", label + ": step", ctx.backend, "ms", scaled(steps[i], 1e3),
                      peer ? std::optional<Stats>(scaled(steps[0], 1e3)) : std::nullopt, peer ? full : ""});
    ctx.report(Result{"hybrid", label + ": communication only", ctx.backend, "ms", scaled(comms[i], 1e3),
                      peer ? std::optional<Stats>(scaled(comms[0], 1e3)) : std::nullopt, peer ? full : ""});
    if (bytes[i] && bytes[0]) {
      const double mb = *bytes[i] / 1e6, full_mb = *bytes[0] / 1e6;
      ctx.report(Result{"hybrid", label + ": bytes between nodes per step (interface counters)", ctx.backend, "MB",
                        Stats{mb, mb, mb}, peer ? std::optional<Stats>(Stats{full_mb, full_mb, full_mb}) : std::nullopt,
                        peer ? full : ""});
    }
  }
}

}  // namespace ruda::bench::hybrid
