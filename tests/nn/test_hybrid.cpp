// Hybrid sharding (shard within a node, replicate across nodes) on emulated nodes: it trains like
// the dense model in one process, its collectives stay where they belong, each rank holds
// 1/ranks-per-node of the state, and what cannot work is refused.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "helpers.h"
#include "sharded_fixture.h"

using namespace ruda;
namespace fs = std::filesystem;

namespace {

struct Layout {
  int nodes, ranks_per_node;
  int world() const { return nodes * ranks_per_node; }
};
const std::vector<Layout> kLayouts = {{2, 2}, {2, 3}, {3, 1}, {1, 4}};

EmulatedOptions on_nodes(int ranks_per_node) {
  EmulatedOptions options;
  options.ranks_per_node = ranks_per_node;
  options.check_order = true;  // a collective out of step raises on every rank instead of hanging
  return options;
}

// TinyLM grouped bottom-up (as ruda-train shards), hybrid over mesh; each rank trains its part of
// the global batch with the loss divided by the global count.
test::TrainResult train_tiny_hybrid(const ShardMesh& mesh, int steps, nn::FullyShardOptions options = {}) {
  Communicator& world = mesh.world();
  nn::manual_seed(7);
  test::TinyLM model;
  for (nn::Module* m : std::vector<nn::Module*>{model.block.get(), model.down.get(), model.up.get(), model.aux.get()})
    nn::fully_shard(*m, mesh, options);
  nn::fully_shard(model, mesh, options);
  nn::AdamW opt(model.parameters(), test::adam_options());
  test::TrainResult r;
  const int rank = world.rank(), n = world.world_size();
  const double count = nn::global_count(world, static_cast<double>(test::kBatch / n * test::kTime));
  for (int step = 0; step < steps; ++step) {
    const Tensor tokens = test::part(test::batch_tokens(step), rank, n);
    const Tensor targets = test::part(test::batch_targets(step), rank, n);
    const Tensor loss = model.loss_sum(tokens, targets, test::uses_aux(rank)) / count;
    r.losses.push_back(world.all_reduce(loss.detach()).item());
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  r.params = test::snapshot(model);
  return r;
}

constexpr nn::GPTConfig kGpt{.vocabulary = 32, .context = 8, .d_model = 16, .layers = 2, .heads = 2};
constexpr std::int64_t kGptBatch = 12;

Tensor gpt_tokens(int step) { return randint({kGptBatch, 8}, 0, 32, 300 + step); }
Tensor gpt_targets(int step) { return randint({kGptBatch, 8}, 0, 32, 400 + step); }

// model hybrid over mesh as ruda-train shards it: each block its own group, then the root.
void shard_gpt(nn::GPT& model, const ShardMesh& mesh, const nn::FullyShardOptions& options = {}) {
  for (const auto& block : model.blocks) nn::fully_shard(*block, mesh, options);
  nn::fully_shard(model, mesh, options);
}

// The GPT dense in one process (mesh null) or hybrid over mesh, blocks first, then the root.
test::TrainResult train_gpt(const ShardMesh* mesh, int steps) {
  nn::manual_seed(5);
  nn::GPT model(kGpt);
  if (mesh) {
    shard_gpt(model, *mesh);
  }
  nn::AdamW opt(model.parameters(), test::adam_options());
  test::TrainResult r;
  const int rank = mesh ? mesh->world().rank() : 0, n = mesh ? mesh->world().world_size() : 1;
  const double count = static_cast<double>(kGptBatch * 8);
  for (int step = 0; step < steps; ++step) {
    const Tensor logits = model.forward(test::part(gpt_tokens(step), rank, n));
    const Tensor loss =
        nn::cross_entropy(logits, test::part(gpt_targets(step), rank, n), {.reduction = nn::LossReduction::sum}) /
        count;
    r.losses.push_back(mesh ? mesh->world().all_reduce(loss.detach()).item() : loss.item());
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  r.params = test::snapshot(model);
  return r;
}

void check_close(const test::TrainResult& got, const test::TrainResult& want, double tolerance) {
  REQUIRE(got.losses.size() == want.losses.size());
  for (std::size_t s = 0; s < got.losses.size(); ++s) {
    CAPTURE(s);
    CHECK(std::abs(got.losses[s] - want.losses[s]) <= tolerance * std::max(1.0, std::abs(want.losses[s])));
  }
  REQUIRE(got.params.size() == want.params.size());
  for (const auto& [name, values] : want.params) {
    CAPTURE(name);
    const auto& mine = got.params.at(name);
    REQUIRE(mine.size() == values.size());
    double worst = 0;
    for (std::size_t i = 0; i < values.size(); ++i) worst = std::max(worst, std::abs(mine[i] - values[i]));
    CHECK(worst <= tolerance);
  }
}

std::size_t count_calls(const std::vector<std::string>& history, const std::string& what) {
  return static_cast<std::size_t>(std::count_if(
      history.begin(), history.end(), [&](const std::string& h) { return h.find(what) != std::string::npos; }));
}

}  // namespace

TEST_CASE("hybrid sharding trains like dense within 1e-6 per step: TinyLM and GPT on layouts 2x2, 2x3, 3x1, 1x4") {
  for (const Layout layout : kLayouts) {
    CAPTURE(layout.nodes);
    CAPTURE(layout.ranks_per_node);
    const int n = layout.world();
    const test::TrainResult tiny_dense = test::train_tiny_dense(n, 3);
    const test::TrainResult gpt_dense = train_gpt(nullptr, 3);
    std::vector<test::TrainResult> tiny(static_cast<std::size_t>(n)), gpt(static_cast<std::size_t>(n));
    run_ranks(
        n,
        [&](Communicator& comm) {
          const ShardMesh mesh = ShardMesh::by_node(comm);
          REQUIRE(mesh.nodes() == layout.nodes);
          const auto r = static_cast<std::size_t>(comm.rank());
          tiny[r] = train_tiny_hybrid(mesh, 3);
          gpt[r] = train_gpt(&mesh, 3);
        },
        on_nodes(layout.ranks_per_node));
    check_close(tiny[0], tiny_dense, 1e-6);
    check_close(gpt[0], gpt_dense, 1e-6);
    // Every replica holds the same parameters, bit for bit (the same sums everywhere).
    for (int r = 1; r < n; ++r) {
      CAPTURE(r);
      CHECK(tiny[static_cast<std::size_t>(r)].params == tiny[0].params);
      CHECK(gpt[static_cast<std::size_t>(r)].params == gpt[0].params);
    }
  }
}

TEST_CASE("hybrid: gathers and reduce-scatters stay inside the node, each reduced shard is all-reduced across nodes") {
  for (const bool overlap : {true, false}) {
    CAPTURE(overlap);
    std::vector<std::string> shard_calls, replicate_calls, world_calls;
    run_ranks(
        4,
        [&](Communicator& comm) {
          const ShardMesh mesh = ShardMesh::by_node(comm);
          nn::manual_seed(5);
          nn::GPT model(kGpt);
          const nn::FullyShardOptions options{.overlap = overlap ? nn::Overlap::on : nn::Overlap::off};
          shard_gpt(model, mesh, options);
          // The mesh's own checks ran on all three; count from here.
          const std::size_t world_before = comm.history().size(), shard_before = mesh.shard().history().size(),
                            replicate_before = mesh.replicate().history().size();
          const Tensor loss =
              nn::cross_entropy(model.forward(gpt_tokens(0).slice(0, 0, 3)), gpt_targets(0).slice(0, 0, 3));
          loss.backward();
          if (comm.rank() == 0) {
            shard_calls = mesh.shard().history();
            shard_calls.erase(shard_calls.begin(), shard_calls.begin() + static_cast<std::ptrdiff_t>(shard_before));
            replicate_calls = mesh.replicate().history();
            replicate_calls.erase(replicate_calls.begin(),
                                  replicate_calls.begin() + static_cast<std::ptrdiff_t>(replicate_before));
            world_calls = comm.history();
            world_calls.erase(world_calls.begin(), world_calls.begin() + static_cast<std::ptrdiff_t>(world_before));
          }
          // Each rank's local slices are 1/ranks-per-node of the parameters.
          for (const auto& [name, p] : model.named_parameters()) {
            CAPTURE(name);
            CHECK(p.data().numel() == (p.shard()->numel + 1) / 2);
            CHECK(p.shard()->world_size == 2);
            CHECK(p.shard()->replicate == &mesh.replicate());
          }
        },
        on_nodes(2));
    // blocks.0, blocks.1, the root: all still unsharded at the end of the forward (2 blocks, the
    // limit), so the backward gathers nothing again.
    // Besides, one small all-reduce on each of the two per backward: which parameters the loss
    // reached on any rank.
    const std::size_t groups = 3;
    CHECK(count_calls(shard_calls, "all_gather") == groups);
    CHECK(count_calls(shard_calls, "reduce_scatter") == groups);
    CHECK(count_calls(shard_calls, "all_reduce(f32") == 1);
    CHECK(count_calls(shard_calls, "which parameters the loss reached") == 1);
    CHECK(count_calls(replicate_calls, "all_reduce(f32") == groups + 1);
    CHECK(count_calls(replicate_calls, "across nodes") == groups + 1);
    CHECK(count_calls(replicate_calls, "all_gather") == 0);
    CHECK(world_calls.empty());  // nothing of the step on the world
  }
}

TEST_CASE("hybrid: the memory plan holds 16 bytes per parameter over the ranks of a node, not the world") {
  nn::manual_seed(5);
  nn::GPT model(kGpt);
  const nn::MemoryPlan full = nn::plan_state(model, 4, 8);
  const nn::MemoryPlan hybrid = nn::plan_state(model, 4, 8, {.shard_ranks = 2});
  CHECK(hybrid.world_size == 4);
  CHECK(hybrid.shard_ranks == 2);
  CHECK(hybrid.local_batch == 2);
  CHECK(hybrid.parameters > full.parameters);
  std::int64_t expected = 0;
  for (const auto& [name, p] : model.named_parameters()) expected += (shape_numel(p.shape()) + 1) / 2 * 4;
  CHECK(hybrid.parameters == expected);
  CHECK(hybrid.optimizer == 2 * expected);
  CHECK(hybrid.table().find("hybrid: sharded over the 2 ranks of a node, replicated over 2 nodes") !=
        std::string::npos);
  CHECK_THROWS_AS(nn::plan_state(model, 4, 8, {.shard_ranks = 3}), ArgumentError);
}

TEST_CASE("hybrid: grad_norm counts each shard once whatever communicator the caller passes") {
  std::vector<double> hybrid_norm(4);
  double dense_norm = 0;
  {
    nn::manual_seed(5);
    nn::GPT model(kGpt);
    nn::cross_entropy(model.forward(gpt_tokens(0).slice(0, 0, 4)), gpt_targets(0).slice(0, 0, 4),
                      {.reduction = nn::LossReduction::sum})
        .backward();
    dense_norm = nn::grad_norm(model.parameters());
  }
  run_ranks(
      4,
      [&](Communicator& comm) {
        const ShardMesh mesh = ShardMesh::by_node(comm);
        nn::manual_seed(5);
        nn::GPT model(kGpt);
        shard_gpt(model, mesh);
        nn::cross_entropy(model.forward(gpt_tokens(0).slice(0, comm.rank(), comm.rank() + 1)),
                          gpt_targets(0).slice(0, comm.rank(), comm.rank() + 1), {.reduction = nn::LossReduction::sum})
            .backward();
        hybrid_norm[static_cast<std::size_t>(comm.rank())] = nn::grad_norm(model.parameters(), &comm);
      },
      on_nodes(2));
  for (const double norm : hybrid_norm) CHECK(norm == doctest::Approx(dense_norm).epsilon(1e-6));
}

TEST_CASE("grad_norm sums each communicator's shards over it: a fully sharded module beside a hybrid one") {
  // Before, every sharded square went into one sum, all-reduced over the communicator of whichever
  // parameter came last: 1.28 or 1.81 by the parameters' order, for a norm of 1.36, and no error.
  auto make = [] {
    nn::manual_seed(9);
    return std::pair{std::make_shared<nn::Linear>(6, 9), std::make_shared<nn::Linear>(9, 5)};
  };
  const Tensor x = randn({8, 6}, 31);
  auto loss = [&](nn::Linear& a, nn::Linear& b, const Tensor& rows) {
    (sum(square(b.forward(tanh(a.forward(rows))))) / 8.0).backward();
  };
  double dense = 0;
  {
    auto [a, b] = make();
    loss(*a, *b, x);
    dense = nn::grad_norm({a->weight, a->bias, b->weight, b->bias});
  }
  std::vector<double> forward(4), reversed(4);
  run_ranks(
      4,
      [&](Communicator& comm) {
        const ShardMesh mesh = ShardMesh::by_node(comm);
        auto [a, b] = make();
        nn::fully_shard(*a, comm);  // over the world
        nn::fully_shard(*b, mesh);  // within the node, replicated across nodes
        loss(*a, *b, x.slice(0, 2 * comm.rank(), 2 * comm.rank() + 2));
        const auto r = static_cast<std::size_t>(comm.rank());
        forward[r] = nn::grad_norm({a->weight, a->bias, b->weight, b->bias}, &comm);
        reversed[r] = nn::grad_norm({b->weight, b->bias, a->weight, a->bias}, &comm);
      },
      on_nodes(2));
  for (std::size_t r = 0; r < 4; ++r) {
    CHECK(forward[r] == doctest::Approx(dense).epsilon(1e-6));
    CHECK(reversed[r] == doctest::Approx(dense).epsilon(1e-6));
  }
}

TEST_CASE("hybrid: what cannot work is refused with a ShardingError naming it") {
  run_ranks(
      4,
      [&](Communicator& comm) {
        const ShardMesh mesh = ShardMesh::by_node(comm);
        test::TinyLM model;
        test::check_throws<nn::ShardingError>([&] { nn::fully_shard(model, mesh, {.group = false}); },
                                              {"fully_shard", "grouped parameters"});
        // A replicate communicator comes from a ShardMesh, which checked that it tiles the world with
        // the shard one. Given beside any communicator, the world replicating a node's shards (or a
        // node's communicator replicating the world's) summed gradients over ranks holding other
        // shards: wrong steps, no error. The model stays unsharded.
        for (auto [shard, replicate] : {std::pair{&mesh.shard(), &mesh.shard()}, std::pair{&mesh.shard(), &comm},
                                        std::pair{&comm, &mesh.shard()}, std::pair{&comm, &mesh.replicate()}}) {
          test::check_throws<nn::ShardingError>(
              [&] { nn::fully_shard(model, *shard, {.replicate = replicate}); },
              {"fully_shard", "fully_shard(module, mesh, options)", "tile the world"});
        }
        test::check_throws<nn::ShardingError>([&] { nn::fully_shard(model, mesh, {.replicate = &comm}); },
                                              {"fully_shard", "other than the mesh's own"});
        for (const auto& [name, p] : model.named_parameters()) CHECK_FALSE(p.is_sharded());
        // A block fully sharded, then the root hybrid: the model must be one or the other.
        nn::fully_shard(*model.block, mesh.shard());
        test::check_throws<nn::ShardingError>([&] { nn::fully_shard(model, mesh); },
                                              {"fully_shard", "fully sharded already", "all hybrid or all full"});
      },
      on_nodes(2));
}

namespace {

// The GPT's gradients after one step of kGptBatch sequences split into `micro` micro-batches
// (each loss divided by the whole batch's token count), as this rank's local slices, by name;
// under hybrid sharding with the all-reduce across nodes only on the last micro-batch. Also
// counts the all-reduces across nodes.
std::map<std::string, std::vector<double>> accumulated_gradients(Communicator& world, const ShardMesh* mesh, int micro,
                                                                 std::size_t* across = nullptr) {
  nn::manual_seed(5);
  nn::GPT model(kGpt);
  if (mesh) {
    shard_gpt(model, *mesh);
  } else if (world.world_size() > 1) {
    for (const auto& block : model.blocks) nn::fully_shard(*block, world);
    nn::fully_shard(model, world);
  }
  const Tensor tokens = test::part(gpt_tokens(0), world.rank(), world.world_size());
  const Tensor targets = test::part(gpt_targets(0), world.rank(), world.world_size());
  const std::int64_t rows = tokens.shape()[0] / micro;
  for (int k = 0; k < micro; ++k) {
    nn::set_requires_all_reduce(model, k == micro - 1);
    const Tensor logits = model.forward(tokens.slice(0, k * rows, (k + 1) * rows));
    const Tensor loss =
        nn::cross_entropy(logits, targets.slice(0, k * rows, (k + 1) * rows), {.reduction = nn::LossReduction::sum}) /
        static_cast<double>(kGptBatch * 8);
    loss.backward();
  }
  if (across) *across = count_calls(mesh->replicate().history(), "across nodes");
  std::map<std::string, std::vector<double>> out;
  for (const auto& [name, p] : model.named_parameters()) out[name] = p.grad().to_vector<double>();
  return out;
}

void check_same(const std::map<std::string, std::vector<double>>& got,
                const std::map<std::string, std::vector<double>>& want, double tolerance) {
  REQUIRE(got.size() == want.size());
  for (const auto& [name, values] : want) {
    CAPTURE(name);
    const auto& mine = got.at(name);
    REQUIRE(mine.size() == values.size());
    double worst = 0;
    for (std::size_t i = 0; i < values.size(); ++i) worst = std::max(worst, std::abs(mine[i] - values[i]));
    CHECK(worst <= tolerance);
  }
}

}  // namespace

TEST_CASE("hybrid checkpoints: every rank saves over its node's communicator and the first replica writes") {
  // As README says of hybrid runs, now in save_checkpoint itself (ruda-train alone did it): each
  // replica saving over its own node's communicator raced on one step directory (an index naming
  // files another replica had replaced, or a rename failing), and a save over the world failed
  // only at publishing, after every file was written, with "pieces overlap".
  test::TempDir dir;
  const std::string ckpt = (dir.path / "ckpt").string(), blocked = (dir.path / "a-file").string();
  { std::ofstream(blocked) << "not a directory"; }
  std::vector<std::map<std::string, std::vector<double>>> saved(4), loaded(4);
  run_ranks(
      4,
      [&](Communicator& comm) {
        const ShardMesh mesh = ShardMesh::by_node(comm);
        const auto r = static_cast<std::size_t>(comm.rank());
        nn::manual_seed(7);
        test::TinyLM model;
        nn::fully_shard(model, mesh);
        nn::AdamW opt(model.parameters(), test::adam_options());
        const Tensor loss = model.loss_sum(test::part(test::batch_tokens(0), comm.rank(), 4),
                                           test::part(test::batch_targets(0), comm.rank(), 4), true) /
                            static_cast<double>(test::kBatch * test::kTime);
        loss.backward();
        opt.step();
        saved[r] = test::snapshot(model);
        // Over the world: refused on every rank before anything is written.
        test::check_throws<nn::ShardingError>(
            [&] { nn::save_checkpoint(ckpt, 1, model, &opt, comm); },
            {"save_checkpoint", "sharded over another communicator (rank", "of 2)", "ShardMesh::shard()"});
        // The first replica fails (its directory is a file): the other replica learns it.
        test::check_throws<IOError>([&] { nn::save_checkpoint(blocked, 1, model, &opt, mesh.shard()); }, {blocked});
        const nn::CheckpointInfo info = nn::save_checkpoint(ckpt, 1, model, &opt, mesh.shard(), {{"model", "tiny"}});
        CHECK(info.step == 1);
        CHECK(info.world_size == 2);
        comm.barrier();
        // Into a fresh hybrid model and optimizer: the same parameters and moments.
        nn::manual_seed(8);
        test::TinyLM again;
        nn::fully_shard(again, mesh);
        nn::AdamW again_opt(again.parameters(), test::adam_options());
        nn::load_checkpoint(ckpt, again, &again_opt, mesh.shard());
        loaded[r] = test::snapshot(again);
        const auto params = model.parameters(), again_params = again.parameters();
        for (std::size_t i = 0; i < params.size(); ++i) {
          const auto want = opt.state(params[i]), got = again_opt.state(again_params[i]);
          REQUIRE(want.size() == got.size());
          for (std::size_t j = 0; j < want.size(); ++j)
            CHECK(want[j].second.to_vector<float>() == got[j].second.to_vector<float>());
        }
      },
      on_nodes(2));
  // The step's files: one per rank of a node, written once.
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(fs::path(ckpt) / "step-00000001")) {
    files.push_back(entry.path().filename().string());
  }
  std::sort(files.begin(), files.end());
  CHECK(files.size() == 3);  // index.json and two rank files
  // Into a dense model in this process: the hybrid model's values.
  nn::manual_seed(9);
  test::TinyLM dense;
  LocalCommunicator local;
  nn::load_checkpoint(ckpt, dense, nullptr, local);
  for (std::size_t r = 0; r < 4; ++r) {
    CHECK(loaded[r] == saved[0]);
    CHECK(saved[r] == saved[0]);
  }
  CHECK(test::snapshot(dense) == saved[0]);
}

TEST_CASE("accumulation: K = 1, 2 and 4 micro-batches give one batch's gradient, dense, fully sharded and hybrid") {
  LocalCommunicator one;
  const auto dense = accumulated_gradients(one, nullptr, 1);
  for (const int micro : {2, 4}) {
    CAPTURE(micro);
    check_same(accumulated_gradients(one, nullptr, micro), dense, 1e-6);
  }
  // Sharded: the local slices of the dense gradients.
  auto slices = [&](int rank, int world) {
    std::map<std::string, std::vector<double>> out;
    for (const auto& [name, values] : dense) {
      const auto n = static_cast<std::int64_t>(values.size());
      const std::int64_t s = (n + world - 1) / world;
      std::vector<double> mine(static_cast<std::size_t>(s), 0.0);
      for (std::int64_t i = 0; i < s && rank * s + i < n; ++i) mine[static_cast<std::size_t>(i)] = values[rank * s + i];
      out[name] = mine;
    }
    return out;
  };
  for (const int micro : {1, 3}) {  // the local batch is 3 rows at 4 ranks
    CAPTURE(micro);
    std::vector<std::map<std::string, std::vector<double>>> full(4), hybrid(4);
    std::vector<std::size_t> across(4);
    run_ranks(
        4,
        [&](Communicator& comm) {
          const auto r = static_cast<std::size_t>(comm.rank());
          full[r] = accumulated_gradients(comm, nullptr, micro);
          const ShardMesh mesh = ShardMesh::by_node(comm);
          hybrid[r] = accumulated_gradients(comm, &mesh, micro, &across[r]);
        },
        on_nodes(2));
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      check_same(full[static_cast<std::size_t>(r)], slices(r, 4), 1e-6);
      check_same(hybrid[static_cast<std::size_t>(r)], slices(r % 2, 2), 1e-6);
      // One all-reduce of gradients per group, whatever the micro-batches, and one of the reached
      // flags per micro-batch (the gradients' presence must agree across nodes at every step).
      CHECK(across[static_cast<std::size_t>(r)] == 3 + static_cast<std::size_t>(micro));
    }
  }
}

namespace {
// A module whose first micro-batches take one branch and the last another: `a`'s group has no
// backward in the last micro-batch, the one that all-reduces across nodes.
struct Branches : nn::Module {
  std::shared_ptr<nn::Linear> a = std::make_shared<nn::Linear>(5, 3), b = std::make_shared<nn::Linear>(5, 3);
  Branches() {
    register_module("a", a);
    register_module("b", b);
  }
  Tensor loss(const Tensor& x, bool last) const { return sum(square((last ? b : a)->forward(x))) / 16.0; }
};
}  // namespace

TEST_CASE("accumulation: a partial gradient (all-reduce off for every micro-batch) is refused by step and norms") {
  // Forgetting to turn the all-reduce back on for the last micro-batch left each node's partial
  // sums in the gradients: clip_grad_norm gave each node another norm and step() let the replicas
  // of one shard part. Every rank holds the same flags, so every rank raises alike.
  run_ranks(
      4,
      [&](Communicator& comm) {
        const ShardMesh mesh = ShardMesh::by_node(comm);
        nn::manual_seed(5);
        nn::GPT model(kGpt);
        shard_gpt(model, mesh);
        nn::AdamW opt(model.parameters(), nn::AdamWOptions{});
        const Tensor tokens = test::part(gpt_tokens(0), comm.rank(), comm.world_size());
        const Tensor targets = test::part(gpt_targets(0), comm.rank(), comm.world_size());
        nn::set_requires_all_reduce(model, false);
        nn::cross_entropy(model.forward(tokens), targets).backward();
        const std::vector<std::string> partial = {"holds a partial gradient", "set_requires_all_reduce"};
        test::check_throws<nn::ShardingError>([&] { opt.step(); }, partial);
        test::check_throws<nn::ShardingError>([&] { (void)nn::clip_grad_norm(model.parameters(), 1.0); }, partial);
        test::check_throws<nn::ShardingError>([&] { (void)nn::grad_norm(model.parameters()); }, partial);
        // The last micro-batch with it on completes the gradients: then both work.
        nn::set_requires_all_reduce(model, true);
        nn::cross_entropy(model.forward(tokens), targets).backward();
        CHECK(std::isfinite(nn::clip_grad_norm(model.parameters(), 1.0)));
        opt.step();
      },
      on_nodes(2));
}

TEST_CASE("accumulation: the node-partial sums cross nodes once, whatever the backwards reach and held before") {
  // Against the dense sums of the same micro-batches' losses. Backwards without the all-reduce,
  // begun on a gradient that an earlier backward had completed, all-reduced that gradient again
  // with their partial sums: it came back times the node count (on, off, on over 2 nodes gave
  // twice the first micro-batch's gradient, silently). A group the last micro-batch does not
  // reach crosses at that backward's end.
  enum Branch { a_only, b_only, both };
  struct Micro {
    bool all_reduce;
    Branch branch;
    bool zero_grad_before = false;
  };
  const std::vector<std::vector<Micro>> plans = {
      {{false, a_only}, {true, b_only}},
      {{true, a_only}, {false, a_only}, {true, a_only}},
      // b's partial sums cross in the last backward's reduction, a's at its end (not reached).
      {{true, both}, {false, a_only}, {true, b_only}},
      {{true, both}, {false, both}, {false, a_only}, {true, both}},
      // zero_grad between drops the complete gradient set aside with the partial sums.
      {{true, a_only}, {false, a_only}, {true, a_only, true}},
  };
  const Tensor x = randn({32, 5}, 78);
  auto loss = [](const Branches& m, const Tensor& rows, Branch branch) {
    return branch == a_only   ? m.loss(rows, false)
           : branch == b_only ? m.loss(rows, true)
                              : m.loss(rows, false) + m.loss(rows, true);
  };
  for (std::size_t plan = 0; plan < plans.size(); ++plan) {
    CAPTURE(plan);
    const std::vector<Micro>& micros = plans[plan];
    std::map<std::string, std::vector<double>> dense;
    {
      nn::manual_seed(9);
      Branches m;
      for (std::size_t k = 0; k < micros.size(); ++k) {
        Tensor total;
        for (int r = 0; r < 4; ++r) {
          const Tensor rows =
              test::part(x, r, 4).slice(0, 2 * static_cast<std::int64_t>(k), 2 * static_cast<std::int64_t>(k) + 2);
          const Tensor l = loss(m, rows, micros[k].branch);
          total = total.defined() ? total + l : l;
        }
        if (micros[k].zero_grad_before) m.zero_grad();
        total.backward();
      }
      // (b's parameters have no gradient where no micro-batch reaches b: an empty list.)
      for (const auto& [name, p] : m.named_parameters())
        dense[name] = p.grad().defined() ? p.grad().to_vector<double>() : std::vector<double>();
    }
    std::vector<std::map<std::string, std::vector<double>>> got(4);
    run_ranks(
        4,
        [&](Communicator& comm) {
          const ShardMesh mesh = ShardMesh::by_node(comm);
          nn::manual_seed(9);
          Branches m;
          nn::fully_shard(*m.a, mesh);
          nn::fully_shard(*m.b, mesh);
          nn::fully_shard(m, mesh);
          const Tensor mine = test::part(x, comm.rank(), 4);
          for (std::size_t k = 0; k < micros.size(); ++k) {
            if (micros[k].zero_grad_before) m.zero_grad();
            nn::set_requires_all_reduce(m, micros[k].all_reduce);
            const auto row = 2 * static_cast<std::int64_t>(k);
            loss(m, mine.slice(0, row, row + 2), micros[k].branch).backward();
          }
          for (const auto& [name, p] : m.named_parameters()) {
            got[static_cast<std::size_t>(comm.rank())][name] =
                p.grad().defined() ? p.grad().to_vector<double>() : std::vector<double>();
            CHECK_FALSE(p.shard()->gradient_partial);
            CHECK_FALSE(p.shard()->complete_gradient.defined());
          }
        },
        on_nodes(2));
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      for (const auto& [name, values] : dense) {
        CAPTURE(name);
        const auto& mine = got[static_cast<std::size_t>(r)].at(name);
        CHECK(mine.empty() == values.empty());
        const std::size_t n = mine.size(), begin = static_cast<std::size_t>(r % 2) * n;
        for (std::size_t i = 0; i < n && begin + i < values.size(); ++i) {
          CHECK(mine[i] == doctest::Approx(values[begin + i]).epsilon(1e-6));
        }
      }
    }
  }
}

TEST_CASE("hybrid: each rank of the world draws its own part of a Dropout's stream") {
  // fully_shard over a mesh gives a Dropout the world's rank and size (every rank of every node
  // has its own samples), not the node's: ranks 0 and 2, the first of their nodes, drew alike.
  std::vector<std::uint64_t> first(4), after(4);
  run_ranks(
      4,
      [&](Communicator& comm) {
        const ShardMesh mesh = ShardMesh::by_node(comm);
        nn::manual_seed(3);
        auto dropout = std::make_shared<nn::Dropout>(0.5);
        nn::Sequential model({std::make_shared<nn::Linear>(4, 4), dropout});
        nn::fully_shard(model, mesh);
        first[static_cast<std::size_t>(comm.rank())] = dropout->take(10);
        after[static_cast<std::size_t>(comm.rank())] = dropout->generator().offset();
      },
      on_nodes(2));
  CHECK(first == std::vector<std::uint64_t>{0, 10, 20, 30});
  CHECK(after == std::vector<std::uint64_t>{40, 40, 40, 40});
}
