// Models trained dense in one process and fully sharded over a communicator, for comparing the
// two. Used by the emulated-rank tests and by the mpiexec tests.
#pragma once

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <ruda/nn.h>

namespace ruda::test {

/// Losses of every step (the global loss) and the final parameters, consolidated, by name.
struct TrainResult {
  std::vector<double> losses;
  std::map<std::string, std::vector<double>> params;
};

// The global batch: 60 sequences of 4 tokens (60 divides by every world size from 1 to 5).
constexpr std::int64_t kBatch = 60, kTime = 4, kVocab = 13;

inline Tensor batch_tokens(int step) { return randint({kBatch, kTime}, 0, kVocab, 1000 + step); }
inline Tensor batch_targets(int step) { return randint({kBatch, kTime}, 0, kVocab, 2000 + step); }
/// The rows of a global batch that `rank` of `world` trains on.
inline Tensor part(const Tensor& t, int rank, int world) {
  const std::int64_t rows = t.shape()[0] / world;
  return t.slice(0, rank * rows, (rank + 1) * rows);
}

/// A small language model exercising every sharding edge: an embedding whose table is tied to the
/// output head, a transformer block (attention, LayerNorm, MLP), a Linear without bias, a bias of
/// 3 elements (fewer than 4 or 5 ranks), sizes not divisible by the world size, and an auxiliary
/// head unused on rank 1.
struct TinyLM : nn::Module {
  std::shared_ptr<nn::Embedding> embedding =
      std::make_shared<nn::Embedding>(kVocab, 8, nn::EmbeddingOptions{.std = 0.5});
  std::shared_ptr<nn::TransformerBlock> block = std::make_shared<nn::TransformerBlock>(8, 2, 12);
  std::shared_ptr<nn::Linear> down = std::make_shared<nn::Linear>(8, 3);
  std::shared_ptr<nn::Linear> up = std::make_shared<nn::Linear>(3, 8, nn::LinearOptions{.bias = false});
  std::shared_ptr<nn::Linear> aux = std::make_shared<nn::Linear>(8, 1);
  TinyLM() {
    register_module("embedding", embedding);
    register_module("block", block);
    register_module("down", down);
    register_module("up", up);
    register_module("aux", aux);
  }
  /// The sum (not mean) of this part's losses; the caller divides by the global token count.
  Tensor loss_sum(const Tensor& tokens, const Tensor& targets, bool use_aux) {
    Tensor h = block->forward(embedding->forward(tokens));
    h = h + up->forward(tanh(down->forward(h)));
    const Tensor table = embedding->weight.value();  // tied head: a second gather of the same table
    const Tensor logits =
        linear(h.dtype() == table.dtype() ? h : cast(h, table.dtype()), table, Tensor(), WeightLayout::out_in);
    Tensor loss = nn::cross_entropy(cast(logits, DType::f32), targets, {.reduction = nn::LossReduction::sum});
    // The auxiliary head runs on every rank, but only some ranks' losses use it.
    const Tensor extra = sum(square(cast(aux->forward(h), DType::f32)));
    if (use_aux) loss = loss + extra * 0.1;
    return loss;
  }
};

struct SeedModel : nn::Module {
  std::shared_ptr<nn::Embedding> embedding = std::make_shared<nn::Embedding>(kVocab, 6);
  std::shared_ptr<nn::Linear> fc1 = std::make_shared<nn::Linear>(6, 3);
  std::shared_ptr<nn::Linear> fc2 = std::make_shared<nn::Linear>(3, kVocab, nn::LinearOptions{.bias = false});
  SeedModel() {
    register_module("embedding", embedding);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
};

inline nn::AdamWOptions adam_options() {
  // A large eps keeps the first steps continuous in the gradient, so summation-order noise in
  // near-zero gradients cannot flip an update's sign.
  return nn::AdamWOptions{.lr = 1e-2, .eps = 1e-3, .weight_decay = 1e-2};
}

inline bool uses_aux(int rank) { return rank != 1; }

inline std::map<std::string, std::vector<double>> snapshot(const nn::Module& model) {
  std::map<std::string, std::vector<double>> out;
  autograd::NoGradGuard guard;
  for (const auto& [name, p] : model.named_parameters()) out[name] = p.value().to_vector<double>();
  return out;
}

/// The dense reference in one process: the global batch, with the auxiliary loss on the parts
/// that rank r != 1 of `world` would train.
inline TrainResult train_tiny_dense(int world, int steps, nn::AdamWOptions options = adam_options()) {
  nn::manual_seed(7);
  TinyLM model;
  nn::AdamW opt(model.parameters(), options);
  TrainResult r;
  const double count = static_cast<double>(kBatch * kTime);
  for (int step = 0; step < steps; ++step) {
    const Tensor tokens = batch_tokens(step), targets = batch_targets(step);
    Tensor loss;
    for (int rank = 0; rank < world; ++rank) {
      const Tensor l = model.loss_sum(part(tokens, rank, world), part(targets, rank, world), uses_aux(rank)) / count;
      loss = loss.defined() ? loss + l : l;
    }
    r.losses.push_back(loss.item());
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  r.params = snapshot(model);
  return r;
}

/// The same training fully sharded over comm: each rank trains its part of every batch.
inline TrainResult train_tiny_sharded(Communicator& comm, int steps, nn::ShardPolicy policy = {},
                                      nn::AdamWOptions options = adam_options()) {
  nn::manual_seed(7);
  TinyLM model;
  nn::fully_shard(model, comm, policy);
  nn::AdamW opt(model.parameters(), options);
  TrainResult r;
  const double count = nn::global_count(comm, static_cast<double>(kBatch / comm.world_size() * kTime));
  for (int step = 0; step < steps; ++step) {
    const Tensor tokens = part(batch_tokens(step), comm.rank(), comm.world_size());
    const Tensor targets = part(batch_targets(step), comm.rank(), comm.world_size());
    const Tensor loss = model.loss_sum(tokens, targets, uses_aux(comm.rank())) / count;
    r.losses.push_back(comm.all_reduce(loss.detach()).item());
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  r.params = snapshot(model);
  return r;
}

/// The same with a group per submodule (block, down, up, aux), then the root's (the tied
/// embedding), as fully_shard is meant to be applied: bottom-up.
inline TrainResult train_tiny_grouped(Communicator& comm, int steps, const nn::FullyShardOptions& options = {}) {
  nn::manual_seed(7);
  TinyLM model;
  for (nn::Module* m : std::vector<nn::Module*>{model.block.get(), model.down.get(), model.up.get(), model.aux.get()})
    nn::fully_shard(*m, comm, options);
  nn::fully_shard(model, comm, options);
  nn::AdamW opt(model.parameters(), adam_options());
  TrainResult r;
  const double count = nn::global_count(comm, static_cast<double>(kBatch / comm.world_size() * kTime));
  for (int step = 0; step < steps; ++step) {
    const Tensor tokens = part(batch_tokens(step), comm.rank(), comm.world_size());
    const Tensor targets = part(batch_targets(step), comm.rank(), comm.world_size());
    const Tensor loss = model.loss_sum(tokens, targets, uses_aux(comm.rank())) / count;
    r.losses.push_back(comm.all_reduce(loss.detach()).item());
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  r.params = snapshot(model);
  return r;
}

/// The seed's layers (FullyShardedEmbedding -> FullyShardedLinear -> tanh -> FullyShardedLinear), dense.
inline TrainResult train_seed_dense(int steps) {
  nn::manual_seed(11);
  SeedModel model;
  nn::AdamW opt(model.parameters(), adam_options());
  TrainResult r;
  for (int step = 0; step < steps; ++step) {
    const Tensor h = tanh(model.fc1->forward(model.embedding->forward(batch_tokens(step))));
    const Tensor loss = nn::cross_entropy(model.fc2->forward(h), batch_targets(step));
    r.losses.push_back(loss.item());
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  r.params = snapshot(model);
  return r;
}

/// The same with the seed's API: from_full conversions and forward(x, comm).
inline TrainResult train_seed_sharded(Communicator& comm, int steps) {
  nn::manual_seed(11);
  SeedModel dense;
  const int rank = comm.rank(), world = comm.world_size();
  auto embedding = nn::FullyShardedEmbedding::from_full(*dense.embedding, rank, world, {}, "embedding");
  auto fc1 = nn::FullyShardedLinear::from_full(*dense.fc1, rank, world, {}, "fc1");
  auto fc2 = nn::FullyShardedLinear::from_full(*dense.fc2, rank, world, {}, "fc2");
  std::vector<nn::Param> params;
  for (nn::Module* m : std::initializer_list<nn::Module*>{embedding.get(), fc1.get(), fc2.get()}) {
    for (auto& p : m->parameters()) params.push_back(p);
  }
  nn::AdamW opt(params, adam_options());
  TrainResult r;
  const double count = nn::global_count(comm, static_cast<double>(kBatch / world * kTime));
  for (int step = 0; step < steps; ++step) {
    const Tensor tokens = part(batch_tokens(step), rank, world), targets = part(batch_targets(step), rank, world);
    const Tensor h = tanh(fc1->forward(embedding->forward(tokens, comm), comm));
    const Tensor loss =
        nn::cross_entropy(fc2->forward(h, comm), targets, {.reduction = nn::LossReduction::sum}) / count;
    r.losses.push_back(comm.all_reduce(loss.detach()).item());
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  autograd::NoGradGuard guard;
  const std::vector<std::pair<std::string, const nn::Param*>> named = {{"embedding.weight", &embedding->weight()},
                                                                       {"fc1.weight", &fc1->weight()},
                                                                       {"fc1.bias", &fc1->bias()},
                                                                       {"fc2.weight", &fc2->weight()}};
  for (const auto& [name, p] : named) r.params[name] = nn::gather_param(*p, comm).to_vector<double>();
  return r;
}

/// Builds a module twice with the same seed, densely and under DeferredInit, shards both over comm
/// and returns the first parameter whose local slices differ in any bit ("" when all are equal).
template <class MakeModule>
std::string deferred_shards_mismatch(Communicator& comm, MakeModule make) {
  nn::manual_seed(21);
  std::shared_ptr<nn::Module> dense = make();
  nn::manual_seed(21);
  std::shared_ptr<nn::Module> deferred;
  {
    nn::DeferredInit scope;
    deferred = make();
  }
  for (const auto& [name, p] : deferred->named_parameters()) {
    if (!p.is_deferred()) return name + " was allocated during deferred construction";
  }
  nn::fully_shard(*dense, comm);
  nn::fully_shard(*deferred, comm);
  const auto a = dense->named_parameters(), b = deferred->named_parameters();
  if (a.size() != b.size()) return "the parameter lists differ";
  for (std::size_t i = 0; i < a.size(); ++i) {
    const Tensor& x = a[i].second.data();
    const Tensor& y = b[i].second.data();
    if (a[i].first != b[i].first || x.shape() != y.shape() || x.dtype() != y.dtype() || y.requires_grad() != true ||
        std::memcmp(x.data_ptr(), y.data_ptr(), static_cast<std::size_t>(x.nbytes())) != 0) {
      return a[i].first + " on rank " + std::to_string(comm.rank());
    }
  }
  return "";
}

/// Largest |a - b| / (atol + rtol |b|) over two results (<= 1 means within tolerance), with the place.
inline std::pair<double, std::string> compare(const TrainResult& got, const TrainResult& want, double atol,
                                              double rtol) {
  double worst = 0;
  std::string where;
  auto visit = [&](const std::string& name, const std::vector<double>& a, const std::vector<double>& b) {
    if (a.size() != b.size()) {
      worst = 1e300;
      where = name + " sizes differ";
      return;
    }
    for (std::size_t i = 0; i < a.size(); ++i) {
      const double score = std::abs(a[i] - b[i]) / (atol + rtol * std::abs(b[i]));
      if (score > worst) {
        worst = score;
        where = name + "[" + std::to_string(i) + "]: " + std::to_string(a[i]) + " vs " + std::to_string(b[i]);
      }
    }
  };
  visit("loss", got.losses, want.losses);
  if (got.params.size() != want.params.size()) return {1e300, "parameter sets differ"};
  for (const auto& [name, values] : want.params) {
    auto it = got.params.find(name);
    if (it == got.params.end()) return {1e300, "missing parameter " + name};
    visit(name, it->second, values);
  }
  return {worst, where};
}

}  // namespace ruda::test
