// The "overlap" measurement, shared by the MPI suite (bench_overlap_mpi.cpp: across the nodes of
// tools/cluster-sim) and the emulated one (bench_overlap_emulated.cpp: ranks as threads with the
// link model). One training step of the GPT and of the MLP, fully sharded with shard groups (a
// group per block or Linear layer, then the root's), timed four ways in the same run:
//   step        groups with prefetch and reduce-scatters in flight (Overlap::on)
//   no prefetch groups, each collective completed before the step goes on (Overlap::off)
//   compute     the same step on the same local batch, dense, with no collective
//   comm        the step's collectives alone, with the same sizes and order, no compute
// and "ratio" = step / max(compute, comm): 1.0 means communication hid entirely behind compute
// (or compute behind it), 2.0 that nothing overlapped. Each figure is the slowest rank's.
#pragma once

#include <ruda/nn.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "bench.h"

namespace ruda::bench::overlap {

// One model as the bench trains it: the modules that get groups of their own, and a step's loss.
struct Model {
  std::string name;
  std::shared_ptr<nn::Module> root;
  std::vector<nn::Module*> groups;          // sharded first, bottom-up; the root takes the rest
  std::function<Tensor(nn::Module&)> loss;  // this rank's loss, already divided by the global count
  /// Whether the first group's backward needs its weights (not when its input needs no
  /// gradient, as the MLP's first layer on the data).
  bool first_needs_weights_in_backward = true;
};

inline Model make_mlp(int world, int rank) {
  constexpr std::int64_t kBatch = 128;
  auto net = std::make_shared<nn::Sequential>(std::vector<std::shared_ptr<nn::UnaryModule>>{
      std::make_shared<nn::Linear>(784, 1024), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(1024, 1024),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(1024, 10)});
  const std::int64_t rows = kBatch / world;
  const Tensor x = rand({rows, 784}, 10 + rank), y = randint({rows}, 0, 10, 20 + rank);
  Model m{"MLP 784-1024-1024-10 b128", net, {(*net)[0].get(), (*net)[2].get(), (*net)[4].get()}, nullptr, false};
  m.loss = [x, y](nn::Module& module) {
    return nn::cross_entropy(static_cast<nn::Sequential&>(module).forward(x), y,
                             {.reduction = nn::LossReduction::sum}) /
           static_cast<double>(kBatch);
  };
  return m;
}

inline Model make_gpt(int world, int rank) {
  constexpr std::int64_t kBatch = 16, kContext = 64;
  auto gpt = std::make_shared<nn::GPT>(
      nn::GPTConfig{.vocabulary = 256, .context = kContext, .d_model = 256, .layers = 4, .heads = 4});
  const std::int64_t rows = kBatch / world;
  const Tensor x = randint({rows, kContext}, 0, 256, 30 + rank), y = randint({rows, kContext}, 0, 256, 40 + rank);
  Model m{"GPT d256 x4 b16 t64", gpt, {}, nullptr};
  for (const auto& block : gpt->blocks) m.groups.push_back(block.get());
  m.loss = [x, y](nn::Module& module) {
    return nn::cross_entropy(static_cast<nn::GPT&>(module).forward(x), y, {.reduction = nn::LossReduction::sum}) /
           static_cast<double>(kBatch * kContext);
  };
  return m;
}

using Maker = Model (*)(int, int);
inline const std::vector<Maker>& models() {
  static const std::vector<Maker> all{&make_gpt, &make_mlp};
  return all;
}

/// The slowest rank's figures: a step is as slow as its slowest rank.
inline Stats slowest(Communicator& comm, const Stats& s) {
  const auto v =
      comm.all_reduce(from_values({s.median, -s.min, s.max}, {3}, DType::f64), Reduction::max).to_vector<double>();
  return Stats{v[0], -v[1], v[2]};
}

/// A training step timed (the slowest rank's), then its peak tensor bytes (the largest rank's)
/// and what the schedule decided about overlap.
struct TrainStep {
  Stats seconds;
  double peak_bytes = 0;
  nn::OverlapReport overlap;
};

/// Times a training step, sharded with `options` (dense without: the peer) after `warmup` untimed
/// steps: in a group per module of Model::groups, then the root's, or per parameter.
inline TrainStep train_step(const Context& ctx, Communicator& comm, Maker make, const nn::FullyShardOptions* options,
                            int warmup = 2) {
  nn::manual_seed(1);
  Model m = make(comm.world_size(), comm.rank());
  if (options) {
    if (options->group) {  // per parameter: the root's call shards them all
      for (nn::Module* g : m.groups) nn::fully_shard(*g, comm, *options);
    }
    nn::fully_shard(*m.root, comm, *options);
  }
  nn::AdamW opt(m.root->parameters(), {.lr = 1e-4});
  auto step = [&] {
    const Tensor loss = m.loss(*m.root);
    opt.zero_grad();
    loss.backward();
    opt.step();
  };
  TrainStep out;
  out.seconds = slowest(comm, measure(ctx, step, warmup));
  memory::reset_peak();
  step();
  out.peak_bytes =
      comm.all_reduce(scalar(static_cast<double>(memory::stats().peak_bytes), DType::f64), Reduction::max).item();
  out.overlap = nn::overlap_report(*m.root);
  return out;
}

/// One rank's part of each group (elements), in forward order: the root's group first (what the
/// blocks did not take), then the blocks'.
inline std::vector<std::int64_t> group_parts(const Model& m, std::int64_t world) {
  std::vector<std::int64_t> parts;
  std::size_t taken = 0;
  for (nn::Module* g : m.groups) {
    std::int64_t part = 0;
    for (const auto& [name, p] : g->named_parameters()) part += (shape_numel(p.shape(), "bench") + world - 1) / world;
    parts.push_back(part);
    taken += g->named_parameters().size();
  }
  std::int64_t root = 0;
  const auto all = m.root->named_parameters();
  for (const auto& [name, p] : all) root += (shape_numel(p.shape(), "bench") + world - 1) / world;
  if (all.size() > taken)
    parts.insert(parts.begin(), root - std::accumulate(parts.begin(), parts.end(), std::int64_t{0}));
  return parts;
}

/// Which groups (as group_parts orders them) the backward gathers again with Recompute, as the
/// schedule does: not the root and the last max_unsharded_groups groups, which are still unsharded
/// when the backward begins (the backward takes their values), nor a first group whose backward
/// needs no weights.
inline std::vector<bool> gathered_in_backward(const Model& m, std::size_t parts, int max_unsharded_groups = 2) {
  const bool has_root = parts > m.groups.size();
  std::vector<bool> again(parts, false);
  const std::size_t kept_from = m.groups.size() > static_cast<std::size_t>(max_unsharded_groups)
                                    ? m.groups.size() - static_cast<std::size_t>(max_unsharded_groups)
                                    : 0;
  for (std::size_t g = 0; g < m.groups.size(); ++g) {
    again[g + (has_root ? 1 : 0)] = g < kept_from && (g > 0 || m.first_needs_weights_in_backward);
  }
  return again;
}

/// The collectives of one step with Recompute, in order and at their sizes: each group's
/// all-gather in forward, then in backward (reverse order) its all-gather again where the
/// schedule gathers it again (gathered_in_backward) and its reduce-scatter, over `gather`, the
/// ranks the model is sharded over (the model's batch is split over `world`, which also takes the
/// slowest rank's time). One collective per group (the step has one per bucket: the same bytes, a
/// few more latencies). Hybrid sharding (`across`): each reduced shard is then all-reduced over it,
/// in flight while the next group reduces. `int8`: the gathers move nn's int8 wire words (codes 8
/// to an i64, then a scale per 2048 elements, 2 to an i64), without the time to (de)quantize.
inline Stats communication_only(const Context& ctx, Communicator& world, Communicator& gather, Maker make,
                                Communicator* across = nullptr, bool int8 = false) {
  const std::int64_t n = gather.world_size();
  const Model m = make(world.world_size(), world.rank());
  const std::vector<std::int64_t> parts = group_parts(m, n);
  const std::vector<bool> again = gathered_in_backward(m, parts.size());
  std::vector<Tensor> local, gathered, full, piece;
  for (std::int64_t part : parts) {
    const std::int64_t words = (part + 7) / 8 + ((part + nn::kQuantizationBlock - 1) / nn::kQuantizationBlock + 1) / 2;
    local.push_back(int8 ? zeros({words}, DType::i64) : ones({part}));
    gathered.push_back(int8 ? zeros({words * n}, DType::i64) : zeros({part * n}));
    full.push_back(ones({part * n}));
    piece.push_back(zeros({part}));
  }
  return slowest(world, measure(ctx, [&] {
                   for (std::size_t g = 0; g < parts.size(); ++g) gather.all_gather_into(gathered[g], local[g]);
                   std::vector<Work> reducing;
                   for (std::size_t g = parts.size(); g-- > 0;) {
                     if (again[g]) gather.all_gather_into(gathered[g], local[g]);
                     gather.reduce_scatter_into(piece[g], full[g]);
                     if (across) reducing.push_back(across->all_reduce_async(piece[g]));
                   }
                   for (Work& w : reducing) w.wait();
                 }));
}

/// The four timings of one model on `comm` and their rows; `where` names the link ("1 Gbit/s
/// link between 2 cluster-sim nodes"). Collective: every rank calls it, rank 0's report prints.
inline void measure_model(Context& ctx, Communicator& comm, Maker make, const std::string& where) {
  const std::string name =
      make(comm.world_size(), comm.rank()).name + ", " + std::to_string(comm.world_size()) + " ranks, " + where;
  const nn::FullyShardOptions overlapping{.overlap = nn::Overlap::on},
      synchronous{.prefetch = false, .overlap = nn::Overlap::off};
  const Stats step = train_step(ctx, comm, make, &overlapping).seconds;
  const Stats serial = train_step(ctx, comm, make, &synchronous).seconds;
  const Stats compute = train_step(ctx, comm, make, nullptr).seconds;
  const Stats communication = communication_only(ctx, comm, comm, make);
  const Stats& bound = compute.median >= communication.median ? compute : communication;
  if (comm.rank() != 0) return;
  ctx.report(Result{"overlap", name + ": step (groups, prefetch, overlap on)", ctx.backend, "ms", scaled(step, 1e3),
                    scaled(bound, 1e3), "max(compute, communication)"});
  ctx.report(Result{"overlap", name + ": step without overlap (synchronous)", ctx.backend, "ms", scaled(serial, 1e3),
                    scaled(bound, 1e3), "max(compute, communication)"});
  ctx.report(Result{"overlap", name + ": compute only (dense, local batch)", ctx.backend, "ms", scaled(compute, 1e3),
                    std::nullopt, ""});
  ctx.report(Result{"overlap", name + ": communication only (the step's collectives)", ctx.backend, "ms",
                    scaled(communication, 1e3), std::nullopt, ""});
}

}  // namespace ruda::bench::overlap
