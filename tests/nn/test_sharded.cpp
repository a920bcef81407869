// Fully sharded training equals dense training, on emulated ranks (world sizes 1 to 5), and the
// sharding contract: validation, padding, tied weights, unused parameters, policies, clipping.
#include <cmath>
#include <limits>
#include <mutex>

#include "helpers.h"
#include "sharded_fixture.h"

using namespace ruda;
using test::TrainResult;

namespace {
constexpr int kSteps = 4;

// Runs fn on `world` emulated ranks and returns rank 0's result (every rank's must agree).
template <class F>
TrainResult on_ranks(int world, F fn) {
  std::vector<TrainResult> results(world);
  run_ranks(world, [&](Communicator& comm) { results[comm.rank()] = fn(comm); });
  for (int r = 1; r < world; ++r) {
    const auto [score, where] = test::compare(results[r], results[0], 0, 0);
    CHECK_MESSAGE(score == 0, "rank " << r << " differs from rank 0 at " << where);
  }
  return results[0];
}
}  // namespace

TEST_CASE("ShardInfo::layout: slices of ceil(numel / world) in rank order, the last ones short or empty") {
  // 10 elements over 4 ranks: 3, 3, 3, 1. 2 elements over 4 ranks: 1, 1, 0, 0.
  const std::vector<std::pair<std::int64_t, std::int64_t>> ten = {{0, 3}, {3, 3}, {6, 3}, {9, 1}};
  for (int r = 0; r < 4; ++r) {
    const nn::ShardInfo info = nn::ShardInfo::layout({2, 5}, r, 4);
    CHECK(info.numel == 10);
    CHECK(info.shard_size == 3);
    CHECK(info.logical_shape == Shape{2, 5});
    CHECK(info.offset() == ten[static_cast<std::size_t>(r)].first);
    CHECK(info.real_elements() == ten[static_cast<std::size_t>(r)].second);
    CHECK(nn::ShardInfo::layout({2}, r, 4).real_elements() == (r < 2 ? 1 : 0));
  }
  CHECK(nn::ShardInfo::layout({7}, 0, 1).real_elements() == 7);
}

TEST_CASE("a fully sharded model trains exactly like the dense one, world sizes 1-5") {
  for (int world = 1; world <= 5; ++world) {
    CAPTURE(world);
    const TrainResult dense = test::train_tiny_dense(world, kSteps);
    const TrainResult sharded =
        on_ranks(world, [](Communicator& comm) { return test::train_tiny_sharded(comm, kSteps); });
    const auto [score, where] = test::compare(sharded, dense, 1e-6, 1e-5);
    CHECK_MESSAGE(score <= 1.0, "world " << world << ": worst at " << where);
    // The losses really moved: training happened.
    CHECK(dense.losses.back() < dense.losses.front());
  }
}

TEST_CASE("with Adam's usual eps = 1e-8, sharded training stays with the dense one but for zero gradients") {
  // The other tests use eps = 1e-3 (see adam_options). With 1e-8, Adam moves a weight whose
  // gradient is pure rounding noise by about lr * sign(noise) per step, and the noise differs with
  // the summation order. Attention's key bias is such a weight: adding a constant to every key's
  // score leaves the softmax unchanged, so its true gradient is exactly zero. Everything else
  // must match as tightly as with eps = 1e-3; the key bias may only drift by lr per step.
  nn::AdamWOptions options = test::adam_options();
  options.eps = 1e-8;
  TrainResult dense = test::train_tiny_dense(3, kSteps, options);
  TrainResult sharded =
      on_ranks(3, [&](Communicator& comm) { return test::train_tiny_sharded(comm, kSteps, {}, options); });
  const std::int64_t d = 8;  // qkv.bias is [q | k | v], d_model each
  auto& got = sharded.params.at("block.attn.qkv.bias");
  auto& want = dense.params.at("block.attn.qkv.bias");
  for (std::int64_t i = d; i < 2 * d; ++i) {
    CHECK(std::abs(got[i] - want[i]) <= kSteps * options.lr * 1.01);
    got[i] = want[i];
  }
  const auto [score, where] = test::compare(sharded, dense, 1e-6, 1e-5);
  CHECK_MESSAGE(score <= 1.0, "worst at " << where);
}

TEST_CASE("some layers sharded, the rest replicated: broadcast once, all-reduce their gradients") {
  for (int world : {2, 3}) {
    CAPTURE(world);
    const TrainResult dense = test::train_tiny_dense(world, kSteps);
    const TrainResult mixed = on_ranks(world, [](Communicator& comm) {
      nn::manual_seed(7);
      test::TinyLM model;
      nn::fully_shard(*model.block, comm);  // the transformer block only
      if (comm.rank() != 0) {
        autograd::NoGradGuard guard;
        model.down->weight.data().fill_(0.5);  // a rank that initialized differently
      }
      // embedding.weight, down.weight and .bias, up.weight, aux.weight and .bias
      CHECK(nn::broadcast_replicated(model, comm) == 6);
      nn::AdamW opt(model.parameters(), test::adam_options());
      TrainResult r;
      const double count = nn::global_count(comm, static_cast<double>(test::kBatch / comm.world_size() * test::kTime));
      for (int step = 0; step < kSteps; ++step) {
        const Tensor tokens = test::part(test::batch_tokens(step), comm.rank(), comm.world_size());
        const Tensor targets = test::part(test::batch_targets(step), comm.rank(), comm.world_size());
        const Tensor loss = model.loss_sum(tokens, targets, test::uses_aux(comm.rank())) / count;
        r.losses.push_back(comm.all_reduce(loss.detach()).item());
        opt.zero_grad();
        loss.backward();
        CHECK(nn::all_reduce_replicated_gradients(model, comm) == 6);
        opt.step();
      }
      r.params = test::snapshot(model);
      return r;
    });
    const auto [score, where] = test::compare(mixed, dense, 1e-6, 1e-5);
    CHECK_MESSAGE(score <= 1.0, "world " << world << ": worst at " << where);
  }
}

TEST_CASE("replicated gradients: the sum over ranks, zeros from a rank without one, frozen ones left alone") {
  run_ranks(3, [](Communicator& comm) {
    nn::manual_seed(2);
    nn::Linear layer(2, 1);
    layer.bias.data().set_requires_grad(false);                            // frozen
    const double x = comm.rank() + 1.0;                                    // rank r's input: [r + 1, r + 1]
    if (comm.rank() != 2) sum(layer.forward(full({1, 2}, x))).backward();  // rank 2 has no gradient
    CHECK(nn::all_reduce_replicated_gradients(layer, comm) == 1);
    CHECK_CLOSE(layer.weight.grad(), {3, 3}, {2, 1});  // 1 + 2 + 0
    CHECK_FALSE(layer.bias.grad().defined());
  });
}

TEST_CASE("a parameter frozen between forward and backward gets no gradient, dense and sharded alike") {
  // The dense reference: both ranks' parts in one process, the first layer's weight frozen after
  // the forward (PyTorch's semantics: AccumulateGrad reads requires_grad at backward time).
  constexpr int kWorld = 2;
  const std::string frozen = "down.weight";
  auto freeze = [](nn::Module& model, const std::string& name) {
    for (auto& [n, p] : model.named_parameters()) {
      if (n == name) p.data().set_requires_grad(false);
    }
  };
  std::map<std::string, std::vector<double>> dense;
  {
    nn::manual_seed(7);
    test::TinyLM model;
    Tensor loss;
    for (int r = 0; r < kWorld; ++r) {
      const Tensor l = model.loss_sum(test::part(test::batch_tokens(0), r, kWorld),
                                      test::part(test::batch_targets(0), r, kWorld), test::uses_aux(r));
      loss = loss.defined() ? loss + l : l;
    }
    freeze(model, frozen);
    loss.backward();
    for (auto& [name, p] : model.named_parameters()) {
      if (p.grad().defined()) dense[name] = p.grad().reshape({-1}).to_vector<double>();
    }
  }
  REQUIRE_FALSE(dense.count(frozen));
  REQUIRE(dense.size() > 1);
  std::vector<std::map<std::string, std::vector<double>>> sharded(kWorld);
  run_ranks(kWorld, [&](Communicator& comm) {
    nn::manual_seed(7);
    test::TinyLM model;
    nn::fully_shard(model, comm);
    const Tensor loss =
        model.loss_sum(test::part(test::batch_tokens(0), comm.rank(), kWorld),
                       test::part(test::batch_targets(0), comm.rank(), kWorld), test::uses_aux(comm.rank()));
    freeze(model, frozen);
    loss.backward();
    autograd::NoGradGuard guard;
    for (auto& [name, p] : model.named_parameters()) {
      // Every rank takes part in each gather (collectives pair up), with zeros for no gradient.
      const bool has = p.grad().defined();
      const Tensor g = has ? p.grad() : zeros({p.shard()->shard_size}, Options(p.data().dtype()));
      const Tensor whole = comm.all_gather(g).slice(0, 0, p.shard()->numel);
      if (has) sharded[comm.rank()][name] = whole.to_vector<double>();
    }
  });
  for (int r = 0; r < kWorld; ++r) {
    CAPTURE(r);
    CHECK_FALSE(sharded[r].count(frozen));
    CHECK(sharded[r].size() == dense.size());
    for (const auto& [name, g] : dense) {
      CAPTURE(name);
      REQUIRE(sharded[r].count(name));
      const std::vector<double>& got = sharded[r].at(name);
      REQUIRE(got.size() == g.size());
      for (std::size_t i = 0; i < g.size(); ++i) CHECK(got[i] == doctest::Approx(g[i]).epsilon(1e-5).scale(1e-3));
    }
  }
}

TEST_CASE("the seed's layers name their parameters in the order check") {
  nn::manual_seed(1);
  nn::Linear fc1(4, 4), fc2(4, 4);
  std::vector<std::string> errors(2);
  std::mutex m;
  try {
    run_ranks(2,
              [&](Communicator& comm) {
                auto a = nn::FullyShardedLinear::from_full(fc1, comm.rank(), 2, {}, "blocks.0.fc1");
                auto b = nn::FullyShardedLinear::from_full(fc2, comm.rank(), 2, {}, "blocks.0.fc2");
                CHECK(a->weight().shard()->name == "blocks.0.fc1.weight");
                try {
                  (comm.rank() == 0 ? a : b)->forward(ones({1, 4}), comm);  // rank 1 runs its layers out of order
                } catch (const CollectiveError& e) {
                  std::lock_guard lock(m);
                  errors[comm.rank()] = e.what();
                  throw;
                }
              },
              {.check_order = true});
  } catch (const CollectiveError&) {
  }
  for (const auto& e : errors) {
    CAPTURE(e);
    CHECK(e.find("\"blocks.0.fc1.weight\"") != std::string::npos);
    CHECK(e.find("\"blocks.0.fc2.weight\"") != std::string::npos);
  }
}

TEST_CASE("the seed's layers (from_full, forward with a communicator) equal dense training") {
  const TrainResult dense = test::train_seed_dense(kSteps);
  for (int world = 1; world <= 5; ++world) {
    CAPTURE(world);
    const TrainResult sharded =
        on_ranks(world, [](Communicator& comm) { return test::train_seed_sharded(comm, kSteps); });
    const auto [score, where] = test::compare(sharded, dense, 1e-6, 1e-5);
    CHECK_MESSAGE(score <= 1.0, "world " << world << ": worst at " << where);
  }
}

TEST_CASE("Retain and Recompute give identical gradients") {
  for (int world : {2, 3}) {
    CAPTURE(world);
    std::vector<std::map<std::string, std::vector<double>>> grads(2);
    std::mutex mutex;
    for (int s = 0; s < 2; ++s) {
      const auto strategy = s == 0 ? nn::CheckpointStrategy::retain : nn::CheckpointStrategy::recompute;
      run_ranks(world, [&](Communicator& comm) {
        comm.set_order_check(true);  // the ranks' collective sequences must match
        nn::manual_seed(7);
        test::TinyLM model;
        nn::fully_shard(model, comm, {.strategy = strategy});
        const Tensor loss =
            model.loss_sum(test::part(test::batch_tokens(0), comm.rank(), world),
                           test::part(test::batch_targets(0), comm.rank(), world), test::uses_aux(comm.rank()));
        loss.backward();
        autograd::NoGradGuard guard;
        std::map<std::string, std::vector<double>> full;
        for (auto& [name, p] : model.named_parameters()) {
          full[name] = comm.all_gather(p.grad()).slice(0, 0, p.shard()->numel).to_vector<double>();
        }
        if (comm.rank() == 1) {
          std::lock_guard lock(mutex);
          grads[s] = full;
        }
      });
    }
    for (const auto& [name, g] : grads[1]) {
      CAPTURE(name);
      REQUIRE(grads[0].count(name));
      CHECK(g == grads[0].at(name));  // bit-identical
    }
  }
}

TEST_CASE("per-parameter path: each parameter gathered and reduce-scattered once; Recompute gathers again") {
  // Two layers: forward gathers W1, b1, W2, b2. Backward reduce-scatters each once. Recompute
  // gathers W2 again (linear needs it for the input gradient); W1 is not needed (the input needs
  // no gradient) and biases are never saved.
  for (auto strategy : {nn::CheckpointStrategy::retain, nn::CheckpointStrategy::recompute}) {
    std::vector<std::string> calls;
    run_ranks(2, [&](Communicator& comm) {
      nn::manual_seed(1);
      nn::Sequential model(
          {std::make_shared<nn::Linear>(6, 5), std::make_shared<nn::Tanh>(), std::make_shared<nn::Linear>(5, 3)});
      nn::fully_shard(model, comm, nn::FullyShardOptions{.policy = {.strategy = strategy}, .group = false});
      sum(model.forward(randn({4, 6}, 2))).backward();
      if (comm.rank() == 0) calls = comm.history();
    });
    std::vector<std::string> expected = {"all_gather(f32, 15, \"0.weight\")", "all_gather(f32, 3, \"0.bias\")",
                                         "all_gather(f32, 8, \"2.weight\")", "all_gather(f32, 2, \"2.bias\")"};
    if (strategy == nn::CheckpointStrategy::recompute) expected.push_back("all_gather(f32, 8, \"2.weight\")");
    // (a reduce-scatter's count is its full input: the gathered, padded length)
    for (const char* rs : {"reduce_scatter(f32, 4, \"2.bias\")", "reduce_scatter(f32, 16, \"2.weight\")",
                           "reduce_scatter(f32, 6, \"0.bias\")", "reduce_scatter(f32, 30, \"0.weight\")"}) {
      expected.push_back(rs);
    }
    // Then, at the backward's end, which of the 4 parameters the loss reached on any rank.
    expected.push_back("all_reduce(f32, 4, sum, \"sharded parameters: which ones the loss reached\")");
    REQUIRE(calls.size() == expected.size());
    for (std::size_t i = 0; i < calls.size(); ++i) {
      CAPTURE(i);
      CHECK_MESSAGE(calls[i].find(expected[i]) != std::string::npos, calls[i] << " is not " << expected[i]);
    }
  }
}

TEST_CASE("Recompute frees gathered weights between forward and backward: peak bytes per rank") {
  // Four 1024x1024 layers at world size 4: Retain keeps every gathered weight (4 MiB each) until
  // backward; Recompute keeps one at a time on the per-parameter path, and one group at a time
  // with groups of one layer each, at most one unsharded and no prefetch. On the per-parameter
  // path both peak in backward with one full weight gradient; Recompute's peak also holds the
  // local gradients accumulated so far (1/4 layer each). A group's transient is twice its size
  // (the all-gather's buffer while copying out, the gradient while copying in), so with groups
  // the difference shows between forward and backward.
  struct Bytes {
    std::int64_t peak = 0, after_forward = 0;
  };
  auto measure = [](nn::CheckpointStrategy strategy, bool group) {
    std::vector<Bytes> bytes(4);
    run_ranks(4, [&](Communicator& comm) {
      nn::manual_seed(3);
      nn::Sequential model;
      for (int i = 0; i < 4; ++i) {
        model.push_back(std::make_shared<nn::Linear>(1024, 1024));
        model.push_back(std::make_shared<nn::Tanh>());
      }
      const nn::FullyShardOptions options{
          .policy = {.strategy = strategy}, .group = group, .prefetch = false, .max_unsharded_groups = 1};
      if (group) {
        for (std::size_t i = 0; i < model.size(); i += 2) nn::fully_shard(*model[i], comm, options);
      }
      nn::fully_shard(model, comm, options);
      // The input needs a gradient (as after an embedding), so every layer's weight is needed in backward.
      const Tensor x = randn({8, 1024}, 5 + comm.rank()).set_requires_grad();
      memory::reset_peak();
      const Tensor loss = sum(model.forward(x)) / 32.0;
      bytes[comm.rank()].after_forward = memory::stats().live_bytes;
      loss.backward();
      bytes[comm.rank()].peak = memory::stats().peak_bytes;
    });
    Bytes most;
    for (const Bytes& b : bytes) {
      most.peak = std::max(most.peak, b.peak);
      most.after_forward = std::max(most.after_forward, b.after_forward);
    }
    return most;
  };
  const std::int64_t layer_bytes = 1024 * 1024 * 4;
  for (const bool group : {false, true}) {
    CAPTURE(group);
    const Bytes retain = measure(nn::CheckpointStrategy::retain, group);
    const Bytes recompute = measure(nn::CheckpointStrategy::recompute, group);
    INFO("bytes per rank: retain " << retain.after_forward << " after forward, " << retain.peak
                                   << " at peak; recompute " << recompute.after_forward << ", " << recompute.peak);
    CHECK(retain.after_forward - recompute.after_forward >= 3 * layer_bytes);
    if (!group) CHECK(retain.peak - recompute.peak >= 3 * layer_bytes);
  }
}

TEST_CASE("no full weight outlives an evaluation under no_grad: per parameter at once, groups after reshard") {
  // Per parameter, a layer's weight is freed when its forward returns. Groups keep up to
  // max_unsharded_groups (2) layers until the room is needed or nn::reshard gives it back.
  for (const bool group : {false, true}) {
    CAPTURE(group);
    run_ranks(2, [&](Communicator& comm) {
      nn::manual_seed(3);
      nn::Sequential model;
      for (int i = 0; i < 3; ++i) model.push_back(std::make_shared<nn::Linear>(512, 512));
      if (group) {
        for (std::size_t i = 0; i < model.size(); ++i) nn::fully_shard(*model[i], comm);
      }
      nn::fully_shard(model, comm, nn::FullyShardOptions{.group = group});
      const Tensor x = randn({4, 512}, 1);
      autograd::NoGradGuard guard;
      memory::reset_peak();
      const std::int64_t before = memory::stats().live_bytes;
      const Tensor y = model.forward(x);
      nn::reshard(model);
      const std::int64_t after = memory::stats().live_bytes;
      const std::int64_t layer = 512 * 512 * 4 + 512 * 4;
      // Only the output survives; the peak held at most one gathered layer per parameter, two
      // with groups (the one computing and the next, prefetched), plus the all-gather's buffer
      // while copying out, and small tensors.
      if (after - before != static_cast<std::int64_t>(y.nbytes())) throw std::runtime_error("eval left tensors alive");
      const std::int64_t allowed = (group ? 3 * layer : layer) + 4 * 512 * 4 * 4;
      if (memory::stats().peak_bytes - before > allowed) throw std::runtime_error("eval peak too high");
    });
  }
}

TEST_CASE("bf16 compute dtype trains within bf16 tolerance of f32") {
  const TrainResult dense = test::train_tiny_dense(2, kSteps);
  const TrainResult bf16 = on_ranks(
      2, [](Communicator& comm) { return test::train_tiny_sharded(comm, kSteps, {.compute_dtype = DType::bf16}); });
  const auto [score, where] = test::compare(bf16, dense, 2e-2, 2e-2);
  CHECK_MESSAGE(score <= 1.0, "worst at " << where);
  // Storage stays f32 even though the layers computed in bf16.
  run_ranks(2, [](Communicator& comm) {
    nn::manual_seed(7);
    test::TinyLM model;
    nn::fully_shard(model, comm, {.compute_dtype = DType::bf16});
    for (auto& p : model.parameters()) {
      if (p.data().dtype() != DType::f32) throw std::runtime_error("storage dtype changed");
    }
    if (model.embedding->weight.value().dtype() != DType::bf16) throw std::runtime_error("gather did not move bf16");
  });
}

TEST_CASE("the reduce dtype policy: f32 accumulation versus accumulation in bf16") {
  // Three ranks contribute gradients 1, 2^-8 and 2^-8 to one element. Summed in bf16 step by step,
  // 1 + 2^-8 is a tie that rounds back to 1 (twice); summed in f32, 1 + 2^-7 is exact in bf16.
  auto reduced = [](Accumulate reduce) {
    std::vector<double> out(3);
    run_ranks(3, [&](Communicator& comm) {
      nn::Param p(zeros({3}));
      auto sharded = nn::ShardedParameter::from_full(p, comm.rank(), 3);
      sharded.info().policy = {.compute_dtype = DType::bf16, .reduce = reduce};
      const Tensor full = nn::gather_param(sharded.param(), comm);
      const double g = comm.rank() == 0 ? 1.0 : 0x1p-8;
      sum(full * (ones_like(full) * g)).backward();  // the gradient reaching the gather is g everywhere
      out[comm.rank()] = sharded.param().grad().item();
    });
    return out;
  };
  const auto f32 = reduced(Accumulate::f32);
  const auto native = reduced(Accumulate::native);
  // Each rank owns one element; every element received the same three contributions.
  for (int r = 0; r < 3; ++r) {
    CHECK(f32[r] == 1.0 + 0x1p-7);
    CHECK(native[r] == 1.0);
  }
}

TEST_CASE("grad_norm refuses a communicator other than the one a parameter without its own is sharded over") {
  // A parameter sharded over 2 of 4 ranks (one node) summed over the world's 4 counted each shard
  // twice: a norm sqrt(2) too large, on every rank, silently. gather_param refuses such a
  // communicator already.
  run_ranks(4, [&](Communicator& world) {
    const std::unique_ptr<Communicator> node = world.split(world.rank() / 2, world.rank());
    nn::Param p(from_values({3, 4, 0, 0, 12, 0}, {6}));
    auto sharded = nn::ShardedParameter::from_full(p, node->rank(), node->world_size());
    sum(square(nn::gather_param(sharded.param(), *node))).backward();
    // Each of the node's 2 ranks adds its loss's 2 p: 4 p, of norm 4 x 13.
    CHECK(nn::grad_norm({sharded.param()}, node.get()) == doctest::Approx(52.0));
    test::check_throws<nn::ShardingError>([&] { (void)nn::grad_norm({sharded.param()}, &world); },
                                          {"grad_norm", "of 4", "is shard", "of 2"});
  });
}

TEST_CASE("global gradient-norm clipping equals the dense norm on every rank") {
  nn::manual_seed(7);
  test::TinyLM dense;
  const Tensor tokens = test::batch_tokens(0), targets = test::batch_targets(0);
  const double count = static_cast<double>(test::kBatch * test::kTime);
  // The dense reference with the same per-part auxiliary losses as world 5 (a superset of the rest
  // differs per world, so compute it per world).
  for (int world = 1; world <= 5; ++world) {
    CAPTURE(world);
    dense.zero_grad();
    Tensor loss;
    for (int r = 0; r < world; ++r) {
      const Tensor l =
          dense.loss_sum(test::part(tokens, r, world), test::part(targets, r, world), test::uses_aux(r)) / count;
      loss = loss.defined() ? loss + l : l;
    }
    loss.backward();
    const double want = nn::grad_norm(dense.parameters());
    std::vector<double> norms(world), after(world);
    run_ranks(world, [&](Communicator& comm) {
      nn::manual_seed(7);
      test::TinyLM model;
      nn::fully_shard(model, comm);
      const Tensor l = model.loss_sum(test::part(tokens, comm.rank(), world), test::part(targets, comm.rank(), world),
                                      test::uses_aux(comm.rank())) /
                       count;
      l.backward();
      norms[comm.rank()] = nn::clip_grad_norm(model.parameters(), want / 2);
      after[comm.rank()] = nn::grad_norm(model.parameters());
    });
    for (int r = 0; r < world; ++r) {
      CHECK(norms[r] == doctest::Approx(want).epsilon(1e-5));
      CHECK(after[r] == doctest::Approx(want / 2).epsilon(1e-4));
    }
  }
}

TEST_CASE("gradient accumulation over micro-batches equals one step on the whole batch") {
  // Each micro-batch's backward reduce-scatters into the local gradient; the normalization
  // counts every micro-batch of the global step.
  for (int world : {2, 3}) {
    CAPTURE(world);
    std::vector<std::map<std::string, std::vector<double>>> results(2);
    std::mutex mutex;
    for (int micro : {1, 2}) {
      run_ranks(world, [&](Communicator& comm) {
        nn::manual_seed(7);
        test::TinyLM model;
        nn::fully_shard(model, comm);
        const Tensor tokens = test::part(test::batch_tokens(0), comm.rank(), world);
        const Tensor targets = test::part(test::batch_targets(0), comm.rank(), world);
        const double count = nn::global_count(comm, static_cast<double>(tokens.numel()));
        const std::int64_t rows = tokens.shape()[0] / micro;
        for (int m = 0; m < micro; ++m) {
          const Tensor loss = model.loss_sum(tokens.slice(0, m * rows, (m + 1) * rows),
                                             targets.slice(0, m * rows, (m + 1) * rows), test::uses_aux(comm.rank())) /
                              count;
          loss.backward();
        }
        autograd::NoGradGuard guard;
        std::map<std::string, std::vector<double>> full;
        for (auto& [name, p] : model.named_parameters()) {
          full[name] = comm.all_gather(p.grad()).slice(0, 0, p.shard()->numel).to_vector<double>();
        }
        if (comm.rank() == 0) {
          std::lock_guard lock(mutex);
          results[micro - 1] = full;
        }
      });
    }
    for (const auto& [name, g] : results[0]) {
      CAPTURE(name);
      test::check_close(from_values(results[1].at(name), {static_cast<std::int64_t>(g.size())}, DType::f64),
                        from_values(g, {static_cast<std::int64_t>(g.size())}, DType::f64), 1e-6, 1e-5);
    }
  }
}

TEST_CASE("two forwards, then their two backwards, on sharded layers") {
  for (auto strategy : {nn::CheckpointStrategy::retain, nn::CheckpointStrategy::recompute}) {
    std::vector<std::vector<double>> separate(2), together(2);
    for (int mode = 0; mode < 2; ++mode) {
      run_ranks(2, [&](Communicator& comm) {
        nn::manual_seed(5);
        nn::Linear layer(6, 4);
        nn::fully_shard(layer, comm, {.strategy = strategy});
        const Tensor l1 = sum(tanh(layer.forward(randn({3, 6}, 1 + comm.rank()).set_requires_grad())));
        const Tensor l2 = sum(square(layer.forward(randn({3, 6}, 7 + comm.rank()))));
        if (mode == 0) {
          l1.backward();
          l2.backward();
        } else {
          (l1 + l2).backward();
        }
        if (comm.rank() == 0) (mode == 0 ? separate : together)[0] = layer.weight.grad().to_vector<double>();
      });
    }
    CHECK(separate[0].size() == together[0].size());
    for (std::size_t i = 0; i < separate[0].size(); ++i)
      CHECK(separate[0][i] == doctest::Approx(together[0][i]).epsilon(1e-5));
  }
}

TEST_CASE("a weight changed between forward and backward: Recompute refuses it as the dense backward does") {
  // Recompute gathered the slices of backward's time: after an optimizer step between a forward
  // and its backward, backward used other weights than the forward, and the gradients were wrong
  // with no error (a squared norm of 176.6 for 128.9). Dense refuses the change of a saved weight.
  auto forward_step_backward = [](nn::Module& m, nn::Linear& layer, const Tensor& x) {
    const Tensor l1 = sum(square(layer.forward(x))), l2 = sum(tanh(layer.forward(x)));
    l1.backward();
    nn::SGD(m.parameters(), {.lr = 0.1}).step();  // the weights change; l2's graph still needs them
    l2.backward();
  };
  // x requires grad: its gradient needs the weight, which the linear then saves.
  const Tensor x = randn({3, 6}, 1).set_requires_grad();
  {
    nn::manual_seed(5);
    nn::Linear dense(6, 4);
    test::check_throws<AutogradError>([&] { forward_step_backward(dense, dense, x); },
                                      {"modified in place after it was saved"});
  }
  for (bool group : {true, false}) {
    for (auto strategy : {nn::CheckpointStrategy::recompute, nn::CheckpointStrategy::retain}) {
      CAPTURE(group);
      CAPTURE(strategy == nn::CheckpointStrategy::recompute);
      run_ranks(2, [&](Communicator& comm) {
        nn::manual_seed(5);
        nn::Linear layer(6, 4);
        nn::fully_shard(layer, comm, {.policy = {.strategy = strategy}, .group = group});
        if (strategy == nn::CheckpointStrategy::recompute) {
          test::check_throws<AutogradError>([&] { forward_step_backward(layer, layer, x); },
                                            {"backward", "'weight'", "modified in place after the forward"});
        } else {
          forward_step_backward(layer, layer, x);  // the gathered weights were kept: the forward's own
        }
      });
    }
  }
  // Replaced (set_data) between forward and backward, in a group: refused too.
  run_ranks(2, [&](Communicator& comm) {
    nn::manual_seed(5);
    nn::Linear layer(6, 4);
    nn::fully_shard(layer, comm);
    const Tensor loss = sum(square(layer.forward(x)));
    layer.weight.set_data(zeros_like(layer.weight.data().detach()));
    test::check_throws<AutogradError>([&] { loss.backward(); }, {"'weight'", "was replaced (Param::set_data)"});
  });
}

TEST_CASE("tied weights: one id, one local storage, contributions of both uses summed") {
  run_ranks(3, [](Communicator& comm) {
    nn::manual_seed(1);
    nn::Embedding embedding(5, 4);
    const nn::Param& table = embedding.weight;
    auto a = nn::ShardedParameter::from_full(table, comm.rank(), 3);
    auto b = nn::ShardedParameter::from_full(table, comm.rank(), 3);  // the tied second use
    if (!a.param().same(b.param()) || a.param().id() != table.id()) throw std::runtime_error("tied shards differ");
    // Each rank's loss has d/dW = 1 + 2 = 3; the global loss sums three ranks: 9 (padding stays 0).
    const Tensor loss = sum(a.gather(comm)) + sum(b.gather(comm)) * 2.0;
    loss.backward();
    const auto g = a.param().grad().to_vector<double>();
    const std::int64_t real = a.info().real_elements();
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(g.size()); ++i) {
      if (g[i] != (i < real ? 9.0 : 0.0)) throw std::runtime_error("wrong tied gradient");
    }
  });
}

TEST_CASE("layout: equal slices, padding only at the end, zero-filled, trailing ranks with padding only") {
  // 3 elements over 5 ranks: slices of 1; ranks 3 and 4 hold padding only.
  const nn::Param p(from_values({1, 2, 3}, {3}));
  for (int rank = 0; rank < 5; ++rank) {
    auto s = nn::ShardedParameter::from_full(p, rank, 5);
    CHECK(s.param().data().shape() == Shape{1});
    CHECK(s.info().real_elements() == (rank < 3 ? 1 : 0));
    CHECK(s.param().data().item() == (rank < 3 ? rank + 1 : 0));
    CHECK(s.param().id() == p.id());
    CHECK(s.param().data().is_leaf());
    CHECK(s.param().data().requires_grad());
  }
  // 10 elements over 4 ranks: slices of 3; the last holds one element and two zeros.
  const nn::Param q(arange(1, 11).reshape({2, 5}));
  auto last = nn::ShardedParameter::from_full(q, 3, 4);
  test::check_close(last.param().data(), {10, 0, 0}, {3});
  // Gathered back whole on every world size.
  for (int world = 1; world <= 5; ++world) {
    run_ranks(world, [&](Communicator& comm) {
      auto s = nn::ShardedParameter::from_full(q, comm.rank(), world);
      const Tensor full = autograd::no_grad([&] { return s.gather(comm); });
      if (full.shape() != Shape{2, 5} || full.to_vector<float>() != q.data().to_vector<float>()) {
        throw std::runtime_error("gather did not restore the value");
      }
    });
  }
}

TEST_CASE("from_local and gather validate their input with typed errors") {
  using test::check_throws;
  const nn::Param slice2(zeros({2}));
  check_throws<nn::ShardingError>([&] { nn::ShardedParameter::from_local(slice2, {4}, 0, 0); },
                                  {"world size must be positive"});
  check_throws<nn::ShardingError>([&] { nn::ShardedParameter::from_local(slice2, {4}, 2, 2); },
                                  {"rank 2", "world size 2"});
  check_throws<nn::ShardingError>([&] { nn::ShardedParameter::from_local(slice2, {}, 0, 2); },
                                  {"at least one dimension"});
  check_throws<nn::ShardingError>(
      [&] {
        nn::ShardedParameter::from_local(slice2, {4, 0}, 0, 2);
      },
      {"positive", "[4, 0]"});
  check_throws<nn::ShardingError>(
      [&] {
        nn::ShardedParameter::from_local(slice2, {1 << 30, 1 << 30, 1 << 30}, 0, 2);
      },
      {"overflows"});
  check_throws<nn::ShardingError>([&] { nn::ShardedParameter::from_local(slice2, {5}, 0, 2); },
                                  {"[2]", "[3]", "world size 2"});
  check_throws<DTypeError>(
      [&] {
        Tensor ints = zeros({2}, DType::i64);
        nn::ShardedParameter::from_local(nn::Param(ints), {4}, 0, 2);
      },
      {"floating"});
  const auto ok = nn::ShardedParameter::from_local(nn::Param(zeros({2})), {4}, 1, 2);
  CHECK(ok.logical_shape() == Shape{4});
  LocalCommunicator local;
  check_throws<nn::ShardingError>([&] { ok.gather(local); }, {"rank 0 of 1", "shard 1 of 2"});
  run_ranks(3, [&](Communicator& comm) {
    auto p = nn::ShardedParameter::from_local(nn::Param(zeros({2})), {4}, comm.rank() % 2, 2);
    try {
      p.gather(comm);
      throw std::runtime_error("no error");
    } catch (const nn::ShardingError& e) {
      if (std::string(e.what()).find("of 3") == std::string::npos) throw;
    }
  });
}

TEST_CASE("per parameter, bottom-up: the root takes what is left, as with groups; mixing the two is refused") {
  // fully_shard(child, {.group = false}) then the root's call refused "sharded already".
  auto gradients = [](bool bottom_up) {
    std::vector<std::map<std::string, std::vector<double>>> out(2);
    run_ranks(2, [&](Communicator& comm) {
      nn::manual_seed(4);
      auto l1 = std::make_shared<nn::Linear>(4, 5), l2 = std::make_shared<nn::Linear>(5, 3);
      nn::Sequential m({l1, std::make_shared<nn::Tanh>(), l2});
      const nn::FullyShardOptions per_parameter{.group = false};
      if (bottom_up) {
        CHECK(nn::fully_shard(*l1, comm, per_parameter) == 2);
        CHECK(nn::fully_shard(*l2, comm, per_parameter) == 2);
      }
      CHECK(nn::fully_shard(m, comm, per_parameter) == (bottom_up ? 0 : 4));
      sum(square(m.forward(randn({4, 4}, 5 + comm.rank())))).backward();
      for (const auto& [name, p] : m.named_parameters()) {
        CHECK(p.shard()->name == name);  // renamed relative to the root
        out[static_cast<std::size_t>(comm.rank())][name] = p.grad().to_vector<double>();
      }
    });
    return out;
  };
  CHECK(gradients(true) == gradients(false));
  run_ranks(2, [&](Communicator& comm) {
    nn::Sequential grouped_first({std::make_shared<nn::Linear>(3, 3)});
    nn::fully_shard(*grouped_first[0], comm);
    test::check_throws<nn::ShardingError>(
        [&] { nn::fully_shard(grouped_first, comm, nn::FullyShardOptions{.group = false}); },
        {"fully_shard", "0.weight", "in a group already", "all in groups or all per parameter"});
    nn::Sequential per_parameter_first({std::make_shared<nn::Linear>(3, 3)});
    nn::fully_shard(*per_parameter_first[0], comm, nn::FullyShardOptions{.group = false});
    test::check_throws<nn::ShardingError>([&] { nn::fully_shard(per_parameter_first, comm); },
                                          {"fully_shard", "0.weight", "per parameter already"});
  });
}

TEST_CASE("global_count refuses a negative or non-finite local count on every rank") {
  // -1 on one rank and 1 on the other summed to 0: every loss divided by zero, silently.
  for (const double bad : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    CAPTURE(bad);
    std::vector<std::string> errors(2);
    run_ranks(2, [&](Communicator& comm) {
      try {
        (void)nn::global_count(comm, comm.rank() == 0 ? bad : 1.0);
      } catch (const ArgumentError& e) {
        errors[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    for (const std::string& e : errors) {
      CHECK(e.find("global_count") != std::string::npos);
      CHECK(e.find("1 rank(s) passed a local count that is negative or not finite") != std::string::npos);
    }
  }
  run_ranks(2, [&](Communicator& comm) { CHECK(nn::global_count(comm, 2.5 + comm.rank()) == 6.0); });
  // Finite counts whose sum is not: every loss was divided by inf.
  std::vector<std::string> errors(2);
  run_ranks(2, [&](Communicator& comm) {
    try {
      (void)nn::global_count(comm, 1e308);
    } catch (const ArgumentError& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const std::string& e : errors) {
    CHECK(e.find("global_count") != std::string::npos);
    CHECK(e.find("sum to inf") != std::string::npos);
  }
}

TEST_CASE("fully_shard names a parameter it cannot shard (no elements)") {
  struct Empty : nn::Module {
    nn::Param none{zeros({0, 3})};
    Empty() { register_parameter("none", &none); }
  };
  run_ranks(2, [&](Communicator& comm) {
    Empty m;
    test::check_throws<nn::ShardingError>([&] { nn::fully_shard(m, comm); },
                                          {"fully_shard", "parameter 'none'", "positive", "[0, 3]"});
  });
}

TEST_CASE("a graph recorded before fully_shard or Param::set_data fails in backward instead of losing the gradient") {
  // The graph's leaf is the parameter's old tensor; the parameter holds a new one. Before, the
  // backward added the gradient to the old tensor and the parameter silently got none.
  for (const bool group : {true, false}) {
    CAPTURE(group);
    run_ranks(2, [&](Communicator& comm) {
      nn::manual_seed(3);
      nn::Linear lin(4, 3);
      const Tensor x = randn({2, 4}, 1);
      const Tensor before = sum(lin.forward(x));  // dense
      nn::fully_shard(lin, comm, nn::FullyShardOptions{.group = group});
      test::check_throws<AutogradError>([&] { before.backward(); },
                                        {"backward", "fully_shard", "parameter '", "forward again"});
      // A forward after the sharding trains as usual.
      lin.zero_grad();
      sum(lin.forward(x)).backward();
      CHECK(lin.weight.grad().defined());
      CHECK(lin.bias.grad().defined());
      // And a sharded forward whose parameter's slice set_data replaced before its backward.
      const Tensor sharded = sum(lin.forward(x));
      lin.weight.set_data(lin.weight.data().clone());
      test::check_throws<AutogradError>([&] { sharded.backward(); }, {"backward", "Param::set_data", "forward again"});
    });
  }
  nn::Linear lin(4, 3);
  const Tensor loss = sum(lin.forward(randn({2, 4}, 1)));
  lin.weight.set_data(zeros({4, 3}));
  test::check_throws<AutogradError>([&] { loss.backward(); }, {"backward", "Param::set_data", "[4, 3]"});
  // A caller may have stored a non-leaf through data(): nothing to retire, and fully_shard shards
  // every parameter (a throw mid-way had left the module half sharded).
  lin.weight.data() = lin.weight.data() * 2.0;
  lin.bias.data() = lin.bias.data() * 2.0;
  run_ranks(2, [&](Communicator& comm) {
    nn::Linear layer(4, 3);
    layer.weight.data() = layer.weight.data() * 1.0;
    nn::fully_shard(layer, comm);
    CHECK(layer.weight.is_sharded());
    CHECK(layer.bias.is_sharded());
  });
  lin.weight.set_data(zeros({4, 3}));
  CHECK(lin.weight.data().is_leaf());
}

namespace {
// train_tiny_grouped's model and optimizer, with a step that may be abandoned: its forward runs
// (every always-run gather recorded), then the user's code throws before any backward.
struct GroupedTiny {
  bool seeded = (nn::manual_seed(7), true);  // before the model's initialization
  test::TinyLM model;
  std::unique_ptr<nn::AdamW> opt;
  double count;
  Communicator& comm;
  explicit GroupedTiny(Communicator& c) : comm(c) {
    for (nn::Module* m : std::vector<nn::Module*>{model.block.get(), model.down.get(), model.up.get(), model.aux.get()})
      nn::fully_shard(*m, comm);
    nn::fully_shard(model, comm);
    opt = std::make_unique<nn::AdamW>(model.parameters(), test::adam_options());
    count = nn::global_count(comm, static_cast<double>(test::kBatch / comm.world_size() * test::kTime));
  }
  Tensor loss(int step) {
    return model.loss_sum(test::part(test::batch_tokens(step), comm.rank(), comm.world_size()),
                          test::part(test::batch_targets(step), comm.rank(), comm.world_size()),
                          test::uses_aux(comm.rank())) /
           count;
  }
  double step(int s) {
    const Tensor l = loss(s);
    const double global = comm.all_reduce(l.detach()).item();
    opt->zero_grad();
    l.backward();
    opt->step();
    return global;
  }
};
}  // namespace

TEST_CASE("a step abandoned after its forward threw: drop_pending_always_run frees its graph, training goes on") {
  // A sharded model's gathers are always-run nodes, kept on the thread's list until a backward
  // runs them: after a forward (or the loss code) threw, each retry added the failed one's graph
  // to what stayed allocated (10 failures: 6.6 kB to 1.09 MB), and the next backward ran them
  // all, reduce-scattering zeros. drop_pending_always_run abandons them.
  constexpr int kWorld = 2;
  const TrainResult reference = on_ranks(kWorld, [](Communicator& comm) { return test::train_tiny_grouped(comm, 2); });
  const TrainResult got = on_ranks(kWorld, [](Communicator& comm) {
    GroupedTiny tiny(comm);
    test::TrainResult r;
    comm.reset_traffic();
    r.losses.push_back(tiny.step(0));
    const std::uint64_t first_step_collectives = comm.traffic().collectives;
    nn::reshard(tiny.model);
    const std::int64_t live = memory::stats().live_bytes;
    for (int attempt = 0; attempt < 3; ++attempt) {
      try {
        const Tensor l = tiny.loss(1);
        (void)nn::cross_entropy(reshape(l, {1, 1}), test::batch_targets(1));  // the user's mistake
        FAIL("the cross_entropy above should throw");
      } catch (const ShapeError&) {
      }
      CHECK(autograd::pending_always_run() > 0);
      CHECK(autograd::drop_pending_always_run() > 0);
      CHECK(autograd::pending_always_run() == 0);
      nn::reshard(tiny.model);
      CHECK(memory::stats().live_bytes == live);
    }
    // The good step runs the collectives of a step, no more: none of the failed forwards' nodes.
    comm.reset_traffic();
    r.losses.push_back(tiny.step(1));
    CHECK(comm.traffic().collectives == first_step_collectives);
    r.params = test::snapshot(tiny.model);
    return r;
  });
  CHECK(got.losses == reference.losses);
  CHECK(got.params == reference.params);
}

TEST_CASE("a retained graph's backward that threw can be run again: its always-run nodes run on every rank") {
  // The backward took the thread's always-run list and put it back for a retained graph only once
  // it finished: after a throw the retry skipped the gathers the loss does not reach on rank 1
  // (aux), which rank 0 ran, and failed with a CollectiveMismatchError.
  constexpr int kWorld = 2;
  std::vector<std::map<std::string, std::vector<double>>> clean(kWorld), retried(kWorld);
  for (const bool fail_once : {false, true}) {
    run_ranks(kWorld, [&](Communicator& comm) {
      GroupedTiny tiny(comm);
      bool thrown = false;
      const Tensor loss = tiny.loss(0);
      // A user-recorded op whose backward throws once.
      Tensor l = loss.detach().clone();
      autograd::record("flaky", l, {loss}, {}, [&](const Tensor& g, const autograd::Saved&, autograd::GradMask) {
        if (fail_once && !thrown) {
          thrown = true;
          throw std::runtime_error("flaky backward");
        }
        return std::vector<Tensor>{g};
      });
      if (fail_once) {
        CHECK_THROWS_WITH_AS(l.backward(true), doctest::Contains("flaky backward"), std::runtime_error);
        CHECK(autograd::pending_always_run() > 0);
        tiny.opt->zero_grad();
      }
      l.backward(true);
      std::map<std::string, std::vector<double>> grads;
      for (const auto& [name, p] : tiny.model.named_parameters()) grads[name] = p.data().grad().to_vector<double>();
      (fail_once ? retried : clean)[static_cast<std::size_t>(comm.rank())] = grads;
    });
  }
  CHECK(retried == clean);
}

TEST_CASE("dropout under data parallelism: each rank draws the dense model's mask for its part of the batch") {
  // Every rank drew the same mask for its own samples (the same seed and position): correlated
  // noise, and a sharded GPT with dropout 0.1 left the dense one by 0.0115 in its losses at world
  // 2. fully_shard now gives each Dropout its rank's part of the stream (residual and attention
  // dropout, the fused attention too), so the runs agree as they do without dropout.
  const nn::GPTConfig config{.vocabulary = 64, .context = 8, .d_model = 16, .layers = 2, .heads = 2, .dropout = 0.2};
  constexpr int kBatchRows = 4, kGptSteps = 3;
  auto make = [&] {
    nn::manual_seed(5);
    auto model = std::make_unique<nn::GPT>(config);
    model->train(true);
    return model;
  };
  auto tokens = [](int step) { return randint({kBatchRows, 9}, 0, 64, 500 + static_cast<std::uint64_t>(step)); };
  TrainResult dense;
  {
    auto model = make();
    nn::AdamW opt(model->parameters(), test::adam_options());
    for (int s = 0; s < kGptSteps; ++s) {
      const Tensor t = tokens(s);
      const Tensor loss =
          nn::cross_entropy(model->forward(t.slice(1, 0, 8).contiguous()), t.slice(1, 1, 9).contiguous());
      dense.losses.push_back(loss.item());
      opt.zero_grad();
      loss.backward();
      opt.step();
    }
    dense.params = test::snapshot(*model);
  }
  for (int world : {2, 4}) {
    CAPTURE(world);
    std::vector<std::vector<double>> first_masks(static_cast<std::size_t>(world));
    const TrainResult sharded = on_ranks(world, [&](Communicator& comm) {
      auto model = make();
      nn::fully_shard(*model, comm);
      nn::AdamW opt(model->parameters(), test::adam_options());
      TrainResult r;
      for (int s = 0; s < kGptSteps; ++s) {
        const Tensor t = test::part(tokens(s), comm.rank(), world);
        const Tensor loss =
            nn::cross_entropy(model->forward(t.slice(1, 0, 8).contiguous()), t.slice(1, 1, 9).contiguous()) /
            static_cast<double>(world);
        r.losses.push_back(comm.all_reduce(loss.detach()).item());
        opt.zero_grad();
        loss.backward();
        opt.step();
      }
      r.params = test::snapshot(*model);
      // The ranks' own masks differ: a Dropout standing alone, given rank r's part as fully_shard does.
      nn::Dropout alone(0.5, 99);
      alone.set_data_parallel(comm.rank(), world);
      first_masks[static_cast<std::size_t>(comm.rank())] = alone.forward(ones({64})).to_vector<double>();
      return r;
    });
    const auto [score, where] = test::compare(sharded, dense, 1e-6, 1e-5);
    CHECK_MESSAGE(score <= 1.0, "worst at " << where);
    CHECK(first_masks[0] != first_masks[1]);
    // Rank r's mask is the r-th part of one process's mask over all ranks' values.
    nn::Dropout whole(0.5, 99);
    const std::vector<double> all = whole.forward(ones({64 * world})).to_vector<double>();
    for (int r = 0; r < world; ++r) {
      CHECK(std::vector<double>(all.begin() + 64 * r, all.begin() + 64 * (r + 1)) ==
            first_masks[static_cast<std::size_t>(r)]);
    }
  }
  CHECK_THROWS_AS(nn::Dropout(0.1).set_data_parallel(2, 2), ArgumentError);
}

TEST_CASE("a communicator destroyed between forward and backward is a ShardingError on every path") {
  // The per-parameter path's backward held the communicator by a plain pointer: its
  // reduce-scatter (retain) or its recomputing gather (recompute) called into freed memory, a
  // segfault, where the grouped path raised.
  for (const bool group : {true, false}) {
    for (const auto strategy : {nn::CheckpointStrategy::recompute, nn::CheckpointStrategy::retain}) {
      CAPTURE(group);
      CAPTURE(static_cast<int>(strategy));
      run_ranks(2, [&](Communicator& comm) {
        std::unique_ptr<Communicator> mine = comm.split(0, comm.rank());
        nn::manual_seed(1);
        nn::Sequential model(
            {std::make_shared<nn::Linear>(6, 5), std::make_shared<nn::Tanh>(), std::make_shared<nn::Linear>(5, 3)});
        nn::fully_shard(model, *mine, nn::FullyShardOptions{.policy = {.strategy = strategy}, .group = group});
        const Tensor loss = sum(model.forward(randn({4, 6}, 2)));
        mine.reset();
        test::check_throws<nn::ShardingError>([&] { loss.backward(); }, {"backward", "destroyed"});
        test::check_throws<nn::ShardingError>([&] { (void)model.forward(randn({4, 6}, 2)); }, {"destroyed"});
      });
    }
  }
}

TEST_CASE("an optimizer stepped before fully_shard is refused naming fully_shard as well as set_data") {
  // Its moments are the whole parameter's, and each rank now holds a slice: the message named
  // only Param::set_data, which the user never called.
  run_ranks(2, [](Communicator& comm) {
    nn::manual_seed(1);
    nn::Linear layer(4, 6);
    nn::AdamW opt(layer.parameters(), {});
    sum(layer.forward(ones({2, 4}))).backward();
    opt.step();
    nn::fully_shard(layer, comm);
    opt.zero_grad();
    sum(layer.forward(ones({2, 4}))).backward();
    test::check_throws<DTypeError>([&] { opt.step(); }, {"moments", "fully_shard", "make a new optimizer"});
  });
}
