// Shard groups: one all-gather and one reduce-scatter per group, prefetched in the recorded order,
// train bitwise like the per-parameter path, on emulated ranks (world sizes 1 to 5).
#include <algorithm>
#include <mutex>

#include "helpers.h"
#include "sharded_fixture.h"

using namespace ruda;

namespace {

// Three layers with sizes that do not divide by most world sizes, and a LayerNorm.
struct Stack : nn::Module {
  std::shared_ptr<nn::Linear> fc1 = std::make_shared<nn::Linear>(7, 5);
  std::shared_ptr<nn::LayerNorm> norm = std::make_shared<nn::LayerNorm>(5);
  std::shared_ptr<nn::Linear> fc2 = std::make_shared<nn::Linear>(5, 4);
  std::shared_ptr<nn::Linear> fc3 = std::make_shared<nn::Linear>(4, 3, nn::LinearOptions{.bias = false});
  Stack() {
    register_module("fc1", fc1);
    register_module("norm", norm);
    register_module("fc2", fc2);
    register_module("fc3", fc3);
  }
  Tensor forward(const Tensor& x) { return fc3->forward(tanh(fc2->forward(norm->forward(tanh(fc1->forward(x)))))); }
};

struct Run {
  std::vector<double> losses;
  std::map<std::string, std::vector<std::uint8_t>> params;  // bytes: compared bitwise
};

// The collectives of a history without their numbers: what was called, in order, at what size.
std::vector<std::string> calls_only(const std::vector<std::string>& history) {
  std::vector<std::string> out;
  for (const std::string& h : history) out.push_back(h.substr(h.find(' ') + 1));
  return out;
}

// Trains Stack for `steps` steps on this rank's part of a batch of 60 rows: per parameter, or with
// a group per layer (fc1, fc2, fc3) and the root taking the norm. Records the last step's
// collectives and what the schedule decided about overlap.
struct StackRun : Run {
  std::vector<std::string> last_step;
  nn::OverlapReport overlap;
};
StackRun train_stack(Communicator& comm, const nn::FullyShardOptions& options, int steps = 3) {
  nn::manual_seed(11);
  Stack model;
  if (options.group) {
    for (nn::Module* m : std::vector<nn::Module*>{model.fc1.get(), model.fc2.get(), model.fc3.get()})
      nn::fully_shard(*m, comm, options);
  }
  nn::fully_shard(model, comm, options);
  nn::AdamW opt(model.parameters(), test::adam_options());
  StackRun r;
  for (int step = 0; step < steps; ++step) {
    const std::uint64_t before = comm.history().empty() ? 0 : std::stoull(comm.history().back().substr(1));
    // An input that wants its gradient: fc1's backward needs fc1's weight, so Recompute gathers it again.
    const Tensor x = test::part(randn({60, 7}, 100 + step), comm.rank(), comm.world_size()).set_requires_grad();
    const Tensor loss = sum(square(model.forward(x))) / 60.0;
    r.losses.push_back(comm.all_reduce(loss.detach()).item());
    opt.zero_grad();
    loss.backward();
    opt.step();
    r.last_step.clear();
    for (const std::string& h : comm.history()) {
      if (std::stoull(h.substr(1)) > before) r.last_step.push_back(h);
    }
  }
  r.last_step = calls_only(r.last_step);
  r.overlap = nn::overlap_report(model);
  autograd::NoGradGuard guard;
  for (const auto& [name, p] : model.named_parameters()) {
    const Tensor v = p.value();
    const auto* bytes = static_cast<const std::uint8_t*>(v.data_ptr());
    r.params[name].assign(bytes, bytes + v.nbytes());
  }
  return r;
}

// The collectives of rank 0 after its `skip` first ones.
std::vector<std::string> after(const std::vector<std::string>& history, std::uint64_t skip) {
  std::vector<std::string> out;
  for (const std::string& h : history) {
    if (std::stoull(h.substr(1)) > skip) out.push_back(h);
  }
  return out;
}

std::uint64_t last_number(const Communicator& comm) {
  const auto h = comm.history();
  return h.empty() ? 0 : std::stoull(h.back().substr(1));
}

std::size_t calls_of(const std::vector<std::string>& calls, const std::string& what) {
  return static_cast<std::size_t>(std::count_if(
      calls.begin(), calls.end(), [&](const std::string& c) { return c.find(what) != std::string::npos; }));
}

}  // namespace

TEST_CASE("groups train bitwise like the per-parameter path, world sizes 1-5, prefetch on and off") {
  for (auto strategy : {nn::CheckpointStrategy::retain, nn::CheckpointStrategy::recompute}) {
    for (int world = 1; world <= 5; ++world) {
      CAPTURE(world);
      CAPTURE(static_cast<int>(strategy));
      const nn::ShardPolicy policy{.strategy = strategy};
      std::vector<Run> per_parameter(world), grouped(world), unprefetched(world), one_at_a_time(world);
      run_ranks(world, [&](Communicator& comm) {
        per_parameter[comm.rank()] = train_stack(comm, {.policy = policy, .group = false});
        grouped[comm.rank()] = train_stack(comm, {.policy = policy});
        unprefetched[comm.rank()] = train_stack(comm, {.policy = policy, .prefetch = false});
        one_at_a_time[comm.rank()] = train_stack(comm, {.policy = policy, .max_unsharded_groups = 1});
      });
      CHECK(grouped[0].losses == per_parameter[0].losses);
      CHECK(grouped[0].params == per_parameter[0].params);
      CHECK(unprefetched[0].losses == grouped[0].losses);
      CHECK(unprefetched[0].params == grouped[0].params);
      CHECK(one_at_a_time[0].params == grouped[0].params);
      for (int r = 1; r < world; ++r) CHECK(grouped[r].params == grouped[0].params);
    }
  }
}

TEST_CASE("overlap: off never prefetches, auto times both ways and agrees on every rank, all train alike") {
  // Recompute: the backward gathers fc1 again (fc2 and fc3 are still unsharded from the forward),
  // and prefetching issues it before fc2's reduce-scatter.
  const nn::ShardPolicy policy{.strategy = nn::CheckpointStrategy::recompute};
  constexpr int kSteps = 9;  // the trial: the 6 steps between the first 7 backward ends
  for (int world : {2, 3}) {
    CAPTURE(world);
    std::vector<StackRun> on(world), off(world), unprefetched(world), automatic(world);
    run_ranks(world, [&](Communicator& comm) {
      on[comm.rank()] = train_stack(comm, {.policy = policy, .overlap = nn::Overlap::on}, kSteps);
      off[comm.rank()] = train_stack(comm, {.policy = policy, .overlap = nn::Overlap::off}, kSteps);
      unprefetched[comm.rank()] = train_stack(comm, {.policy = policy, .prefetch = false}, kSteps);
      automatic[comm.rank()] = train_stack(comm, {.policy = policy}, kSteps);
    });
    // Off issues the collectives of a schedule without prefetch, in the same order; on does not.
    CHECK(off[0].last_step == unprefetched[0].last_step);
    CHECK(on[0].last_step != off[0].last_step);
    CHECK(on[0].last_step.size() == off[0].last_step.size());
    // on and off are decided from the start; auto after its trial, the same on every rank.
    CHECK(on[0].overlap.decided);
    CHECK(on[0].overlap.overlapping);
    CHECK(off[0].overlap.decided);
    CHECK_FALSE(off[0].overlap.overlapping);
    const nn::OverlapReport& chose = automatic[0].overlap;
    REQUIRE(chose.decided);
    CHECK(chose.step_seconds_overlapping > 0);
    CHECK(chose.step_seconds_synchronous > 0);
    CHECK(chose.overlapping == (chose.step_seconds_overlapping <= chose.step_seconds_synchronous));
    for (int r = 1; r < world; ++r) {
      CHECK(automatic[r].overlap.overlapping == chose.overlapping);
      CHECK(automatic[r].overlap.step_seconds_overlapping == chose.step_seconds_overlapping);
    }
    // After the trial, auto runs the schedule it chose.
    CHECK(automatic[0].last_step == (chose.overlapping ? on : off)[0].last_step);
    // Whatever the schedule, the same values.
    for (const auto* other : {&off, &unprefetched, &automatic}) {
      CHECK((*other)[0].losses == on[0].losses);
      CHECK((*other)[0].params == on[0].params);
    }
  }
}

TEST_CASE("overlap: the memory plan's probe steps do not count in the trial and measure the overlapping schedule") {
  const nn::ShardPolicy policy{.strategy = nn::CheckpointStrategy::recompute};
  for (const int world : {2, 3}) {
    CAPTURE(world);
    std::vector<nn::StepProbe> probe_auto(world), probe_on(world), probe_off(world);
    std::vector<std::vector<bool>> decided(world);
    run_ranks(world, [&](Communicator& comm) {
      auto build_and_probe = [&](nn::Overlap overlap, nn::StepProbe& out) {
        nn::manual_seed(11);
        auto model = std::make_shared<Stack>();
        for (nn::Module* m : std::vector<nn::Module*>{model->fc1.get(), model->fc2.get(), model->fc3.get()})
          nn::fully_shard(*m, comm, {.policy = policy, .overlap = overlap});
        nn::fully_shard(*model, comm, {.policy = policy, .overlap = overlap});
        out = nn::probe_step(
            *model, comm,
            [&](std::int64_t rows) {
              return sum(square(model->forward(randn({rows, 7}, 7)))) / 60.0;
            },
            4);
        return model;
      };
      build_and_probe(nn::Overlap::on, probe_on[comm.rank()]);
      build_and_probe(nn::Overlap::off, probe_off[comm.rank()]);
      const auto model = build_and_probe(nn::Overlap::automatic, probe_auto[comm.rank()]);
      // The probe ran three backwards; the trial decides at the 7th backward end of training.
      nn::SGD opt(model->parameters(), {.lr = 0.01});
      for (int step = 0; step < 7; ++step) {
        const Tensor loss =
            sum(square(model->forward(test::part(randn({60, 7}, 200 + step), comm.rank(), world)))) / 60.0;
        opt.zero_grad();
        loss.backward();
        opt.step();
        decided[comm.rank()].push_back(nn::overlap_report(*model).decided);
      }
    });
    CHECK(probe_auto[0].fixed == probe_on[0].fixed);
    CHECK(probe_auto[0].per_sample == probe_on[0].per_sample);
    CHECK(probe_off[0].fixed <= probe_on[0].fixed);
    CHECK(decided[0] == std::vector<bool>{false, false, false, false, false, false, true});
  }
}

TEST_CASE("a parameter of 256 KiB or more is a collective of its own; the small ones of a group share one") {
  // A Linear and a LayerNorm in one group. A 260 x 256 f32 weight (266 KB in all) is a bucket of
  // its own beside the bias and the norm's vectors: two all-gathers and two reduce-scatters. A
  // 250 x 256 one (256,008 bytes, padding included, at 3 ranks) is not: one of each. Either way
  // the group trains bitwise like the per-parameter path.
  struct Wide : nn::Module {
    std::shared_ptr<nn::Linear> fc;
    std::shared_ptr<nn::LayerNorm> norm = std::make_shared<nn::LayerNorm>(256);
    explicit Wide(std::int64_t in) : fc(std::make_shared<nn::Linear>(in, 256)) {
      register_module("fc", fc);
      register_module("norm", norm);
    }
  };
  for (const std::int64_t in : {260, 250}) {
    CAPTURE(in);
    const nn::ShardPolicy policy{.strategy = nn::CheckpointStrategy::retain};
    std::vector<std::vector<double>> losses(2);  // grouped, per parameter
    std::vector<std::string> step;
    run_ranks(3, [&](Communicator& comm) {
      for (const bool group : {true, false}) {
        nn::manual_seed(5);
        Wide model(in);
        nn::fully_shard(model, comm, {.policy = policy, .group = group});
        nn::SGD opt(model.parameters(), {.lr = 0.1});
        for (int i = 0; i < 2; ++i) {
          const std::uint64_t before = last_number(comm);
          const Tensor x = test::part(randn({6, in}, 50 + i), comm.rank(), 3);
          const Tensor loss = sum(square(model.norm->forward(model.fc->forward(x)))) / 6.0;
          opt.zero_grad();
          loss.backward();
          opt.step();
          if (comm.rank() == 0 && group && i == 1) step = after(comm.history(), before);
          const double total = comm.all_reduce(loss.detach()).item();
          if (comm.rank() == 0) losses[group ? 0 : 1].push_back(total);
        }
      }
    });
    const std::size_t buckets = in == 260 ? 2 : 1;
    CHECK(calls_of(step, "all_gather") == buckets);
    CHECK(calls_of(step, "reduce_scatter") == buckets);
    CHECK(losses[0] == losses[1]);
  }
}

TEST_CASE("groups: a tied table, an unused branch on one rank and bf16 compute still train like dense") {
  // TinyLM: the block, down, up and aux each a group, the root the embedding (tied to the head).
  for (auto policy : {nn::ShardPolicy{}, nn::ShardPolicy{.strategy = nn::CheckpointStrategy::retain}}) {
    const test::TrainResult dense = test::train_tiny_dense(3, 4);
    std::vector<test::TrainResult> results(3);
    run_ranks(3, [&](Communicator& comm) {
      nn::manual_seed(7);
      test::TinyLM model;
      for (nn::Module* m :
           std::vector<nn::Module*>{model.block.get(), model.down.get(), model.up.get(), model.aux.get()})
        nn::fully_shard(*m, comm, policy);
      nn::fully_shard(model, comm, policy);
      nn::AdamW opt(model.parameters(), test::adam_options());
      const double count = nn::global_count(comm, static_cast<double>(test::kBatch / 3 * test::kTime));
      test::TrainResult& r = results[comm.rank()];
      for (int step = 0; step < 4; ++step) {
        const Tensor tokens = test::part(test::batch_tokens(step), comm.rank(), 3);
        const Tensor targets = test::part(test::batch_targets(step), comm.rank(), 3);
        const std::uint64_t before = last_number(comm);
        const Tensor loss = model.loss_sum(tokens, targets, test::uses_aux(comm.rank())) / count;
        // The tied table is gathered once: one all-gather per group in forward (5 groups).
        if (step > 0) CHECK(calls_of(after(comm.history(), before), "all_gather") == 5);
        r.losses.push_back(comm.all_reduce(loss.detach()).item());
        opt.zero_grad();
        loss.backward();
        opt.step();
      }
      r.params = test::snapshot(model);
    });
    const auto [score, where] = test::compare(results[0], dense, 1e-5, 1e-6);
    CHECK_MESSAGE(score <= 1, "groups differ from dense at " << where);
    const auto [ranks, at] = test::compare(results[1], results[0], 0, 0);
    CHECK_MESSAGE(ranks == 0, "rank 1 differs from rank 0 at " << at);
  }
}

TEST_CASE("collectives per step: 2 x groups with Retain, 3 x groups less those still unsharded with Recompute") {
  for (auto strategy : {nn::CheckpointStrategy::retain, nn::CheckpointStrategy::recompute}) {
    CAPTURE(static_cast<int>(strategy));
    std::vector<std::string> step2;
    run_ranks(2, [&](Communicator& comm) {
      nn::manual_seed(3);
      nn::GPT model(nn::GPTConfig{.vocabulary = 32, .context = 8, .d_model = 16, .layers = 4, .heads = 2});
      for (const auto& block : model.blocks) nn::fully_shard(*block, comm, {.strategy = strategy});
      nn::fully_shard(model, comm, {.strategy = strategy});
      for (int step = 0; step < 2; ++step) {
        const std::uint64_t before = last_number(comm);
        const Tensor tokens = randint({2, 8}, 0, 32, 10 + step);
        nn::cross_entropy(model.forward(tokens), randint({2, 8}, 0, 32, 20 + step)).backward();
        if (comm.rank() == 0 && step == 1) step2 = after(comm.history(), before);
      }
    });
    // Five groups: blocks.0-3 and the root (embeddings, final norm, tied head). At the end of the
    // forward the root and the last two blocks (the limit of 2) are still unsharded: the backward
    // takes their values, and gathers only blocks.1 and blocks.0 again.
    const std::size_t groups = 5, still_unsharded = 3;
    const bool retain = strategy == nn::CheckpointStrategy::retain;
    CHECK(calls_of(step2, "all_gather") == (retain ? groups : 2 * groups - still_unsharded));
    CHECK(calls_of(step2, "reduce_scatter") == groups);
    CHECK(calls_of(step2,
                   "group 'blocks.0' (blocks.0.ln1.weight, blocks.0.ln1.bias, blocks.0.attn.qkv.weight, ... 12 "
                   "parameters)") == (retain ? 2 : 3));
    CHECK(calls_of(step2, "group 'blocks.3' (") == 2);
    // (The root's tag has its number among the communicator's groups: "group 'root' #N (".)
    CHECK(calls_of(step2,
                   "(token_embedding.weight, position_embedding.weight, final_norm.weight, ... 4 "
                   "parameters)") == 2);
    // And one small all-reduce per backward: which parameters the loss reached on any rank.
    CHECK(calls_of(step2, "all_reduce(f32, 52, sum, \"shard groups: which parameters the loss reached\")") == 1);
    CHECK(step2.size() == calls_of(step2, "group '") + 1);
  }
}

TEST_CASE("the order check names the group and its parameters when ranks disagree") {
  std::vector<std::string> errors(2);
  std::mutex m;
  try {
    run_ranks(2,
              [&](Communicator& comm) {
                nn::manual_seed(3);
                Stack model;
                nn::fully_shard(*model.fc1, comm);
                nn::fully_shard(*model.fc2, comm);
                nn::fully_shard(model, comm);
                try {
                  // Rank 1 runs fc2 first: its group's gather meets rank 0's gather of fc1's group.
                  if (comm.rank() == 0) {
                    model.fc1->forward(randn({2, 7}, 1));
                  } else {
                    model.fc2->forward(randn({2, 5}, 1));
                  }
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
    CHECK(e.find("group 'fc1' (fc1.weight, fc1.bias)") != std::string::npos);
    CHECK(e.find("group 'fc2' (fc2.weight, fc2.bias)") != std::string::npos);
  }
}

TEST_CASE("set_forward_order: the backward prefetches from the first step; a module without a group is refused") {
  for (const bool fixed : {false, true}) {
    CAPTURE(fixed);
    std::vector<std::string> calls;
    run_ranks(2, [&](Communicator& comm) {
      nn::manual_seed(3);
      Stack model;
      for (nn::Module* m : std::vector<nn::Module*>{model.fc1.get(), model.fc2.get(), model.fc3.get()})
        nn::fully_shard(*m, comm);
      nn::fully_shard(model, comm);
      if (fixed) nn::set_forward_order({&model, model.fc1.get(), model.fc2.get(), model.fc3.get()});
      const Tensor x = randn({4, 7}, 1).set_requires_grad();
      sum(model.forward(x)).backward();
      if (comm.rank() == 0) calls = comm.history();
    });
    auto position = [&](const char* op, const char* group, bool last) -> std::ptrdiff_t {
      auto is = [&](const std::string& c) {
        return c.find(op) != std::string::npos && c.find(group) != std::string::npos;
      };
      if (last) {
        const auto it = std::find_if(calls.rbegin(), calls.rend(), is);
        REQUIRE(it != calls.rend());
        return calls.rend() - it - 1;
      }
      const auto it = std::find_if(calls.begin(), calls.end(), is);
      REQUIRE(it != calls.end());
      return it - calls.begin();
    };
    // fc2 and fc3 are still unsharded when the backward begins and gather nothing; Recompute
    // gathers fc1 again. With the order known, that gather is issued when fc3's backward is done
    // (before fc2's reduce-scatter); recorded in this first step, only when fc1's turn comes.
    const auto fc2_reduced = position("reduce_scatter", "'fc2'", false);
    const auto fc1_again = position("all_gather", "'fc1'", true);
    CHECK(fc1_again > position("all_gather", "'fc1'", false));  // a second gather
    CHECK((fc1_again < fc2_reduced) == fixed);
  }
  run_ranks(1, [](Communicator& comm) {
    Stack model;
    nn::fully_shard(*model.fc1, comm);
    nn::fully_shard(model, comm);
    test::check_throws<nn::ShardingError>(
        [&] {
          nn::set_forward_order({model.fc1.get(), model.fc2.get()});
        },
        {"set_forward_order", "no group of its own"});
  });
}

TEST_CASE("fully_shard again on a sharded module with another policy is refused: it would shard nothing") {
  // The second call found every parameter sharded, sharded none and returned 0: the bf16 compute
  // dtype it was given applied to nothing, and the model went on computing in f32.
  run_ranks(2, [](Communicator& comm) {
    for (const bool grouped : {true, false}) {
      CAPTURE(grouped);
      nn::manual_seed(3);
      Stack model;
      const Tensor x = randn({4, 7}, 1);
      CHECK(nn::fully_shard(model, comm, {.group = grouped}) == 7);
      const std::vector<float> before = model.forward(x).to_vector<float>();
      test::check_throws<nn::ShardingError>(
          [&] { (void)nn::fully_shard(model, comm, {.policy = {.compute_dtype = DType::bf16}, .group = grouped}); },
          {"fully_shard", "shards no parameter", "sharded already", "compute dtype none, this call's bf16"});
      test::check_throws<nn::ShardingError>(
          [&] { (void)nn::fully_shard(model, comm, {.policy = {.reduce = Accumulate::native}, .group = grouped}); },
          {"reduce accumulation f32, this call's native"});
      // Nothing changed (names included); the same policy again is the no-op it always was, also
      // after set_checkpoint_strategy changed the strategy (which fit_schedule does too).
      for (const nn::Param& p : model.parameters()) CHECK_FALSE(p.shard()->policy.compute_dtype.has_value());
      CHECK(model.parameters().front().shard()->name == "fc1.weight");
      CHECK(nn::fully_shard(model, comm, {.group = grouped}) == 0);
      nn::set_checkpoint_strategy(model, nn::CheckpointStrategy::retain);
      CHECK(nn::fully_shard(model, comm, {.group = grouped}) == 0);
      CHECK(model.forward(x).to_vector<float>() == before);
    }
    // Bottom-up with the blocks in bf16 and a root holding no parameter of its own, called with
    // the default policy: that call shards nothing and is still the root over the blocks (their
    // names relative to it), in groups or per parameter.
    for (const bool grouped : {true, false}) {
      CAPTURE(grouped);
      nn::manual_seed(3);
      nn::Sequential blocks({std::make_shared<nn::Linear>(7, 5), std::make_shared<nn::Linear>(5, 3)});
      for (std::size_t i = 0; i < blocks.size(); ++i)
        nn::fully_shard(*blocks[i], comm, {.policy = {.compute_dtype = DType::bf16}, .group = grouped});
      CHECK(nn::fully_shard(blocks, comm, {.group = grouped}) == 0);
      CHECK(blocks.parameters().front().shard()->name == "0.weight");
      CHECK(blocks.forward(randn({4, 7}, 1)).dtype() == DType::bf16);  // as the blocks' calls said
    }
  });
}

TEST_CASE("a sharded parameter's gradient is a slice of its bucket's sum, never storage another gradient shares") {
  // y = (a + b) * e: the add hands one gradient tensor to both a and b. a and b are 256 KiB each,
  // buckets of their own: at world size 1 the reduce-scatter hands back that one tensor, so each
  // gradient must be a copy, or scaling one (clipping, a user's edit) would scale the other.
  // c and d are small and share a bucket whose sum is the sink's own: their gradients are
  // disjoint slices of it. At 2 ranks every sum is a new tensor. Values against the dense step
  // (each rank's loss is halved, so the reduce-scatter's sum is the dense gradient exactly).
  struct Pair : nn::Module {
    nn::Param a{randn({65536}, 1)}, b{randn({65536}, 2)}, c{randn({8}, 3)}, d{randn({8}, 4)};
    Tensor e = randn({65536}, 5);
    Pair() {
      register_parameter("a", &a);
      register_parameter("b", &b);
      register_parameter("c", &c);
      register_parameter("d", &d);
    }
    Tensor loss() { return sum((a.value() + b.value()) * e) + sum(square(c.value()) + c.value() * d.value()); }
  };
  Pair dense;
  dense.loss().backward();
  // World size 1 as a single process runs it (LocalCommunicator: collectives return their input),
  // then 2 emulated ranks.
  for (const int world : {1, 2}) {
    CAPTURE(world);
    auto body = [&](Communicator& comm) {
      Pair model;
      nn::fully_shard(model, comm);
      for (int step = 0; step < 2; ++step) {  // the second backward adds to the gradients the first left
        (model.loss() / world).backward();
        const nn::Param ps[] = {model.a, model.b, model.c, model.d};
        const nn::Param dense_ps[] = {dense.a, dense.b, dense.c, dense.d};
        for (int i = 0; i < 4; ++i) {
          const Tensor expected = test::part(dense_ps[i].grad() * (step + 1.0), comm.rank(), world);
          CHECK(ps[i].grad().to_vector<float>() == expected.to_vector<float>());
        }
        CHECK_FALSE(model.a.grad().shares_storage(model.b.grad()));
        if (world == 1 && step == 0) CHECK(model.c.grad().shares_storage(model.d.grad()));
      }
      Tensor ga = model.a.grad(), gb = model.b.grad(), gc = model.c.grad(), gd = model.d.grad();
      const Tensor b_before = gb.clone(), d_before = gd.clone(), c_before = gc.clone();  // step 2's: 2x dense
      ga.mul_(0.5);
      gc.mul_(0.5);
      CHECK(gb.to_vector<float>() == b_before.to_vector<float>());
      CHECK(gd.to_vector<float>() == d_before.to_vector<float>());
      CHECK(gc.to_vector<float>() == (c_before * 0.5).to_vector<float>());
    };
    if (world == 1) {
      LocalCommunicator local;
      body(local);
    } else {
      run_ranks(world, body);
    }
  }
}

TEST_CASE("at world size 1 a sharded parameter's fresh gradient becomes its gradient without a copy") {
  // loss = sum(x w): matmul's backward makes w's gradient x^T g, a tensor autograd alone holds,
  // which the reduce-scatter of one rank hands back as it is. With synchronous collectives the
  // sink finished inside that gradient's deposit, while autograd still held it, and cloned it:
  // the backward held two [512, 128] gradients at once, a copy of a gradient at every step (~2%
  // of the MLP's f32 step at world size 1). Now its peak holds one (g itself is [1, 128]).
  struct One : nn::Module {
    nn::Param w{randn({512, 128}, 1)};
    Tensor x = randn({1, 512}, 2);
    One() { register_parameter("w", &w); }
    Tensor loss() { return sum(matmul(x, w.value())); }
  };
  LocalCommunicator local;
  One model;
  // Synchronous collectives: each reduce-scatter finishes inside the deposit that completes it;
  // the weight retained from the forward: the backward gathers nothing, so that its peak is the
  // gradient's.
  nn::fully_shard(model, local, {.policy = {.strategy = nn::CheckpointStrategy::retain}, .overlap = nn::Overlap::off});
  const std::int64_t gradient_bytes = 512 * 128 * 4;
  const Tensor expected = matmul(transpose(model.x, 0, 1), ones({1, 128}));
  for (int step = 0; step < 2; ++step) {
    model.zero_grad();
    const Tensor loss = model.loss();
    const std::int64_t before = memory::stats().live_bytes;
    memory::reset_peak();
    loss.backward();
    CHECK(memory::stats().peak_bytes - before < gradient_bytes * 3 / 2);
    CHECK(model.w.grad().to_vector<float>() == expected.reshape({-1}).to_vector<float>());
  }
  // A second backward adds into that gradient in place; nothing else shares its storage.
  model.loss().backward();
  CHECK(model.w.grad().to_vector<float>() == (expected * 2.0).reshape({-1}).to_vector<float>());
}

namespace {

// A trunk and two heads; the spare head runs on every rank (plainly or checkpointed), and the
// loss adds it only on the ranks `reaches` names.
struct Heads : nn::Module {
  std::shared_ptr<nn::Linear> trunk = std::make_shared<nn::Linear>(5, 4);
  std::shared_ptr<nn::Linear> used = std::make_shared<nn::Linear>(4, 3);
  std::shared_ptr<nn::Linear> spare = std::make_shared<nn::Linear>(4, 2);
  Heads() {
    register_module("trunk", trunk);
    register_module("used", used);
    register_module("spare", spare);
  }
  Tensor loss(const Tensor& x, bool with_spare, bool checkpointed) {
    const Tensor h = tanh(trunk->forward(x));
    Tensor l = sum(square(used->forward(h)));
    const Tensor s = checkpointed ? nn::checkpoint(*spare, h) : spare->forward(h);
    if (with_spare) l = l + sum(square(s)) * 0.5;
    return l / 16.0;
  }
};

// Each parameter's full gradient (nullopt: none) and full value after one AdamW step.
struct HeadsResult {
  std::map<std::string, std::optional<std::vector<double>>> grads;
  std::map<std::string, std::vector<double>> after;
};

}  // namespace

TEST_CASE("a parameter no rank's loss reaches gets no gradient and no optimizer step, dense and sharded alike") {
  // The dense model leaves such a parameter without a gradient, and AdamW skips it (no weight
  // decay, its own step count). Sharded, every rank reduce-scatters every bucket with zeros for
  // what its loss did not reach: the zeros became a gradient, and the step decayed the weights.
  const Tensor x = randn({12, 5}, 31);
  const nn::AdamWOptions adam{.lr = 1e-2, .weight_decay = 0.1};
  enum class Layout { grouped, one_group, hybrid, replicated, per_parameter };
  // With `penalty`, an L2 term on the spare head's weight, recorded before the forward: on each
  // rank's local slice (once, on rank 0, where the weight is replicated), so that the loss does
  // reach that slice though no head output does. Its gradient must stay beside the zeros.
  for (const bool any_rank : {false, true}) {        // rank 0's loss takes the spare head, or none does
    for (const bool checkpointed : {false, true}) {  // the spare head through nn::checkpoint
      for (const bool penalty : {false, true}) {
        for (const Layout layout :
             {Layout::grouped, Layout::one_group, Layout::hybrid, Layout::replicated, Layout::per_parameter}) {
          CAPTURE(any_rank);
          CAPTURE(checkpointed);
          CAPTURE(penalty);
          CAPTURE(static_cast<int>(layout));
          const int world = layout == Layout::hybrid ? 4 : 3;
          HeadsResult dense;
          {
            nn::manual_seed(9);
            Heads m;
            nn::AdamW opt(m.parameters(), adam);
            Tensor total = penalty ? sum(square(m.spare->weight.data())) * 0.05 : Tensor();
            for (int r = 0; r < world; ++r) {
              const Tensor l = m.loss(test::part(x, r, world), any_rank && r == 0, checkpointed);
              total = total.defined() ? total + l : l;
            }
            total.backward();
            for (const auto& [name, p] : m.named_parameters()) {
              dense.grads[name] = p.grad().defined() ? std::optional(p.grad().to_vector<double>()) : std::nullopt;
            }
            opt.step();
            dense.after = test::snapshot(m);
          }
          REQUIRE(dense.grads.at("spare.weight").has_value() == (any_rank || penalty));
          REQUIRE(dense.grads.at("spare.bias").has_value() == any_rank);
          std::vector<HeadsResult> got(static_cast<std::size_t>(world));
          EmulatedOptions options;
          options.check_order = true;  // a collective out of step raises instead of hanging
          if (layout == Layout::hybrid) options.ranks_per_node = 2;
          run_ranks(
              world,
              [&](Communicator& comm) {
                const std::optional<ShardMesh> mesh =
                    layout == Layout::hybrid ? std::optional(ShardMesh::by_node(comm)) : std::nullopt;
                nn::manual_seed(9);
                Heads m;
                auto shard = [&](nn::Module& module) {
                  if (mesh) {
                    nn::fully_shard(module, *mesh);
                  } else {
                    nn::fully_shard(module, comm, nn::FullyShardOptions{.group = layout != Layout::per_parameter});
                  }
                };
                if (layout == Layout::replicated) {
                  shard(*m.used);  // the trunk and the spare head stay replicated
                } else if (layout == Layout::one_group || layout == Layout::per_parameter) {
                  shard(m);
                } else {
                  for (nn::Module* sub : std::vector<nn::Module*>{m.trunk.get(), m.used.get(), m.spare.get()})
                    shard(*sub);
                  shard(m);
                }
                nn::AdamW opt(m.parameters(), adam);
                const bool adds_penalty = penalty && (layout != Layout::replicated || comm.rank() == 0);
                const Tensor l2 = adds_penalty ? sum(square(m.spare->weight.data())) * 0.05 : Tensor();
                const Tensor loss =
                    m.loss(test::part(x, comm.rank(), world), any_rank && comm.rank() == 0, checkpointed);
                (l2.defined() ? loss + l2 : loss).backward();
                if (layout == Layout::replicated) nn::all_reduce_replicated_gradients(m, comm);
                HeadsResult& mine = got[static_cast<std::size_t>(comm.rank())];
                for (const auto& [name, p] : m.named_parameters()) {
                  const bool has = p.grad().defined();
                  if (!p.is_sharded()) {
                    mine.grads[name] = has ? std::optional(p.grad().to_vector<double>()) : std::nullopt;
                    continue;
                  }
                  // Every rank takes part in each gather (collectives pair up), with zeros for none.
                  autograd::NoGradGuard guard;
                  const Tensor g = has ? p.grad() : zeros({p.shard()->shard_size}, Options(p.data().dtype()));
                  const Tensor whole = p.shard()->comm->all_gather(g).slice(0, 0, p.shard()->numel);
                  mine.grads[name] = has ? std::optional(whole.to_vector<double>()) : std::nullopt;
                }
                opt.step();
                mine.after = test::snapshot(m);
              },
              options);
          for (int r = 0; r < world; ++r) {
            CAPTURE(r);
            const HeadsResult& mine = got[static_cast<std::size_t>(r)];
            REQUIRE(mine.grads.size() == dense.grads.size());
            for (const auto& [name, want] : dense.grads) {
              CAPTURE(name);
              const auto& have = mine.grads.at(name);
              REQUIRE(have.has_value() == want.has_value());
              if (!want) continue;
              REQUIRE(have->size() == want->size());
              for (std::size_t i = 0; i < want->size(); ++i)
                CHECK((*have)[i] == doctest::Approx((*want)[i]).epsilon(1e-6));
            }
            for (const auto& [name, want] : dense.after) {
              CAPTURE(name);
              const std::vector<double>& have = mine.after.at(name);
              REQUIRE(have.size() == want.size());
              for (std::size_t i = 0; i < want.size(); ++i) CHECK(have[i] == doctest::Approx(want[i]).epsilon(1e-6));
            }
          }
        }
      }
    }
  }
}

TEST_CASE("sibling groups sharded without their parent are told apart: ranks running them in another order raise") {
  // Two children of one layout, each fully_shard-ed, their parent not: both groups were tagged
  // "group 'root' (weight, bias)", so that rank 0 running a then c and rank 1 c then a joined a's
  // slices with c's, forward and backward, with wrong values and no error (even with the order
  // check). Each group's tag now carries its number among its communicator's groups.
  struct Pair : nn::Module {
    std::shared_ptr<nn::Linear> a = std::make_shared<nn::Linear>(5, 5), c = std::make_shared<nn::Linear>(5, 5);
    Pair() {
      register_module("a", a);
      register_module("c", c);
    }
  };
  std::vector<std::string> errors(2);
  EmulatedOptions checked;
  checked.check_order = true;  // (same op, dtype and count: only the tags differ)
  run_ranks(
      2,
      [&](Communicator& comm) {
        Pair m;
        nn::fully_shard(*m.a, comm);
        nn::fully_shard(*m.c, comm);
        const Tensor x = randn({4, 5}, 5);
        try {
          const Tensor y = comm.rank() == 0 ? m.c->forward(m.a->forward(x)) : m.a->forward(m.c->forward(x));
          sum(y).backward();
        } catch (const CollectiveError& e) {
          errors[static_cast<std::size_t>(comm.rank())] = e.what();
        }
      },
      checked);
  for (const std::string& e : errors) {
    CHECK_MESSAGE(e.find("group 'root' #0 (weight, bias)") != std::string::npos, e);
    CHECK_MESSAGE(e.find("group 'root' #1 (weight, bias)") != std::string::npos, e);
  }
}

TEST_CASE("a forward with grad mode on that no backward takes, then a step: the next backward trains as dense") {
  // A metric computed with grad mode on between backward and step left its gathers' nodes for
  // the next backward, which runs them with zeros (the ranks' collectives pair up): their
  // recomputed weights were checked against the step's update and the training backward failed
  // ("modified in place after the forward that used it"), grouped and per parameter. Nothing is
  // computed from them where the loss did not reach them.
  const nn::AdamWOptions adam{.lr = 1e-2};
  auto loss = [](Heads& m, const Tensor& x) { return m.loss(x, true, false); };
  auto train = [&](Heads& m, nn::Optimizer& opt, const Tensor& x, const Tensor& val) {
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      loss(m, x).backward();
      (void)loss(m, val).item();  // the metric: grad mode on, no backward
      opt.step();
    }
  };
  const Tensor x = randn({8, 5}, 41), val = randn({8, 5}, 42);
  std::map<std::string, std::vector<double>> dense;
  {
    nn::manual_seed(9);
    Heads m;
    nn::AdamW opt(m.parameters(), adam);
    // The same loss as two ranks' halves summed: each rank's loss covers its half of x.
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      (loss(m, test::part(x, 0, 2)) + loss(m, test::part(x, 1, 2))).backward();
      (void)loss(m, val).item();
      opt.step();
    }
    dense = test::snapshot(m);
  }
  for (const bool grouped : {true, false}) {
    CAPTURE(grouped);
    std::map<std::string, std::vector<double>> got;
    run_ranks(2, [&](Communicator& comm) {
      nn::manual_seed(9);
      Heads m;
      nn::fully_shard(m, comm, nn::FullyShardOptions{.group = grouped});
      nn::AdamW opt(m.parameters(), adam);
      train(m, opt, test::part(x, comm.rank(), 2), val);
      const auto values = test::snapshot(m);
      if (comm.rank() == 0) got = values;
    });
    for (const auto& [name, want] : dense) {
      CAPTURE(name);
      const auto& mine = got.at(name);
      REQUIRE(mine.size() == want.size());
      for (std::size_t i = 0; i < want.size(); ++i) CHECK(mine[i] == doctest::Approx(want[i]).epsilon(1e-5));
    }
  }
}

TEST_CASE("a head replaced after fully_shard on its root (the root's group destroyed): the blocks train on") {
  // The blocks' groups named the root's group as their parent by a raw pointer; the root's group
  // is owned by the head's parameters and died with the old head, and every later forward (and a
  // second fully_shard for the new head) read it after free (found by an ASan probe).
  struct Model : nn::Module {
    std::shared_ptr<nn::Linear> a = std::make_shared<nn::Linear>(8, 8), b = std::make_shared<nn::Linear>(8, 8);
    std::shared_ptr<nn::Linear> head = std::make_shared<nn::Linear>(8, 2);
    Model() {
      register_module("a", &a);
      register_module("b", &b);
      register_module("head", &head);  // the member: a new head is what parameters() sees
    }
    Tensor loss(const Tensor& x) { return sum(square(head->forward(tanh(b->forward(tanh(a->forward(x))))))) / 16.0; }
  };
  const nn::AdamWOptions adam{.lr = 1e-2};
  const Tensor x = randn({16, 8}, 51);
  // Two steps; a new head (seeded) and the loss with it (forward and backward); with the new head
  // sharded too, two more steps with a new optimizer. (A head left dense is replicated: each rank
  // would step it on its own gradient, so only its first loss is compared.)
  struct Trace {
    double loss = 0;
    std::map<std::string, std::vector<double>> params;
  };
  auto train = [&](Model& m, const std::function<Tensor(Model&)>& loss, const std::function<void(Model&)>& reshard,
                   bool more_steps) {
    auto step = [&](nn::Optimizer& opt) {
      opt.zero_grad();
      loss(m).backward();
      opt.step();
    };
    Trace t;
    {  // (its state holds the old head's parameters, and with them the root's group)
      nn::AdamW first(m.parameters(), adam);
      for (int i = 0; i < 2; ++i) step(first);
    }
    nn::manual_seed(6);
    m.head = std::make_shared<nn::Linear>(8, 3);
    reshard(m);
    nn::AdamW second(m.parameters(), adam);
    second.zero_grad();
    const Tensor l = loss(m);
    l.backward();
    t.loss = l.item();
    if (more_steps) {
      for (int i = 0; i < 2; ++i) step(second);
    }
    t.params = test::snapshot(m);
    return t;
  };
  for (const bool shard_new_head : {false, true}) {
    CAPTURE(shard_new_head);
    nn::manual_seed(5);
    Model dense_model;
    const Trace dense = train(
        dense_model, [&](Model& model) { return model.loss(test::part(x, 0, 2)) + model.loss(test::part(x, 1, 2)); },
        [](Model&) {}, shard_new_head);
    std::vector<Trace> got(2);
    run_ranks(2, [&](Communicator& comm) {
      nn::manual_seed(5);
      Model m;
      nn::fully_shard(*m.a, comm);
      nn::fully_shard(*m.b, comm);
      nn::fully_shard(m, comm);
      const Tensor mine = test::part(x, comm.rank(), 2);
      got[static_cast<std::size_t>(comm.rank())] = train(
          m, [&](Model& model) { return model.loss(mine); },
          [&](Model& model) {
            if (shard_new_head) nn::fully_shard(model, comm);
          },
          shard_new_head);
    });
    CHECK(got[0].loss + got[1].loss == doctest::Approx(dense.loss).epsilon(1e-5));
    if (!shard_new_head) continue;
    REQUIRE(got[0].params.size() == dense.params.size());
    CHECK(got[0].params.at("head.weight").size() == 8 * 3);  // the new head's
    for (const auto& [name, want] : dense.params) {
      CAPTURE(name);
      const auto& have = got[0].params.at(name);
      REQUIRE(have.size() == want.size());
      for (std::size_t i = 0; i < want.size(); ++i) CHECK(have[i] == doctest::Approx(want[i]).epsilon(1e-5));
    }
  }
}
