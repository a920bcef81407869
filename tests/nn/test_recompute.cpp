// Activation checkpointing: checkpoint(block, x) keeps only x, recomputes the block in backward,
// and gives bitwise the gradients of running the block directly, dense and sharded.
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>

#include "helpers.h"
#include "sharded_fixture.h"

using namespace ruda;

namespace {
constexpr std::int64_t kBatch = 4, kTime = 6, kVocab = 17;

nn::GPTConfig small_gpt(double dropout = 0.0) {
  return {.vocabulary = kVocab, .context = kTime, .d_model = 8, .layers = 3, .heads = 2, .dropout = dropout};
}

// Gradients of every parameter (this rank's slices when sharded) after one forward and backward.
std::map<std::string, std::vector<std::uint8_t>> gradients(nn::GPT& model, Communicator* comm, bool checkpointing) {
  model.set_activation_checkpointing(checkpointing);
  const Tensor tokens = randint({kBatch, kTime}, 0, kVocab, 31), targets = randint({kBatch, kTime}, 0, kVocab, 32);
  const std::int64_t rows = comm ? kBatch / comm->world_size() : kBatch, first = comm ? comm->rank() * rows : 0;
  const Tensor logits = model.forward(tokens.slice(0, first, first + rows));
  const Tensor loss =
      nn::cross_entropy(logits, targets.slice(0, first, first + rows), {.reduction = nn::LossReduction::sum}) /
      static_cast<double>(kBatch * kTime);
  model.zero_grad();
  loss.backward();
  std::map<std::string, std::vector<std::uint8_t>> out;
  for (const auto& [name, p] : model.named_parameters()) {
    const Tensor g = p.grad();
    REQUIRE_MESSAGE(g.defined(), name << " got no gradient");
    const auto* bytes = static_cast<const std::uint8_t*>(g.data_ptr());
    out[name].assign(bytes, bytes + g.nbytes());
  }
  return out;
}

void check_same(const std::map<std::string, std::vector<std::uint8_t>>& a,
                const std::map<std::string, std::vector<std::uint8_t>>& b) {
  REQUIRE(a.size() == b.size());
  for (const auto& [name, bytes] : a) {
    CAPTURE(name);
    CHECK(b.at(name) == bytes);
  }
}
}  // namespace

TEST_CASE("checkpointed blocks give bitwise the same gradients, dense, with dropout") {
  for (double dropout : {0.0, 0.25}) {
    CAPTURE(dropout);
    nn::manual_seed(3);
    nn::GPT plain(small_gpt(dropout));
    nn::manual_seed(3);
    nn::GPT checkpointed(small_gpt(dropout));
    check_same(gradients(plain, nullptr, false), gradients(checkpointed, nullptr, true));
    // The recomputation replayed the dropout draws, and left the streams where the forward did.
    check_same(gradients(plain, nullptr, false), gradients(checkpointed, nullptr, true));
  }
}

TEST_CASE("a checkpointed forward that no backward reaches: freed with its output, dropout streams kept") {
  // Found by the nn probe: every checkpoint node was always-run, so a forward with grad mode on and
  // no backward (a validation pass) left it pending. The next backward recomputed it with a zero
  // gradient (81.7 ms instead of 3.8 for 100 of them), on the model even if it was destroyed
  // (use after free), and restored the forward's end positions of the dropout streams, so the next
  // step drew the previous step's masks again.
  const Tensor tokens = randint({2, kTime}, 0, kVocab, 5);
  {
    nn::manual_seed(3);
    nn::GPT gone(small_gpt(0.25));
    gone.set_activation_checkpointing(true);
    for (int i = 0; i < 3; ++i) (void)gone.forward(tokens);
    CHECK(autograd::pending_always_run() == 0);
  }
  Tensor w = ones({2}).set_requires_grad();
  sum(w * 2.0).backward();  // an unrelated backward after the model is gone
  CHECK(w.grad().to_vector<double>() == std::vector<double>{2, 2});
  // Sharded, the nodes stay always-run (their collectives must pair up across ranks) while the
  // model lives, and are dropped with it: a later unrelated backward raised "the group of a
  // recomputed weight was destroyed" (or read the freed block).
  LocalCommunicator comm;
  for (const auto& [checkpointing, grouped] : {std::pair{false, true}, {true, true}, {false, false}, {true, false}}) {
    CAPTURE(checkpointing);
    CAPTURE(grouped);
    {
      nn::GPT sharded(small_gpt());
      sharded.set_activation_checkpointing(checkpointing);
      nn::fully_shard(sharded, comm, nn::FullyShardOptions{.group = grouped});
      sharded.eval();
      (void)sharded.forward(tokens);
      CHECK(autograd::pending_always_run() > 0);
    }
    CHECK(autograd::pending_always_run() == 0);
    w.zero_grad();
    sum(w * 3.0).backward();
    CHECK(w.grad().to_vector<double>() == std::vector<double>{3, 3});
  }

  // Steps with and without a validation forward before them (eval mode, grad mode on) draw the
  // same masks, and consecutive steps draw different ones.
  auto steps = [&](bool validate) {
    nn::manual_seed(3);
    nn::GPT model(small_gpt(0.5));
    model.set_activation_checkpointing(true);
    if (validate) {
      model.eval();
      (void)model.forward(tokens);
      model.train();
    }
    std::vector<std::vector<double>> outputs;
    for (int step = 0; step < 3; ++step) {
      const Tensor out = model.forward(tokens);
      outputs.push_back(out.to_vector<double>());
      sum(out).backward();
    }
    return outputs;
  };
  const auto plain = steps(false), validated = steps(true);
  CHECK(plain == validated);
  CHECK(plain[1] != plain[2]);

  // Two forwards, then their backwards (micro-batches): the recomputations replay each forward's
  // masks and leave the streams after the second forward, not rewound to the first's end.
  nn::manual_seed(4);
  nn::Sequential block;
  block.push_back(std::make_shared<nn::Linear>(8, 8));
  auto dropout = std::make_shared<nn::Dropout>(0.5);
  block.push_back(dropout);
  const Tensor x = randn({4, 8}, 6).set_requires_grad();
  const Tensor first = nn::checkpoint(block, x), second = nn::checkpoint(block, x);
  const std::uint64_t after_forwards = dropout->generator().offset();
  sum(second).backward();
  sum(first).backward();
  CHECK(dropout->generator().offset() == after_forwards);
}

TEST_CASE("the input's gradient flows through a checkpointed block; no_grad runs it plainly") {
  nn::manual_seed(8);
  nn::TransformerBlock block(8, 2, 16);
  const Tensor x = randn({2, 3, 8}, 4);
  const Tensor a = x.clone().set_requires_grad(), b = x.clone().set_requires_grad();
  sum(square(block.forward(a))).backward();
  sum(square(nn::checkpoint(block, b))).backward();
  CHECK(a.grad().to_vector<double>() == b.grad().to_vector<double>());
  autograd::NoGradGuard off;
  CHECK_FALSE(nn::checkpoint(block, x).requires_grad());
}

TEST_CASE("sharded, retain and recompute: bitwise gradients and one collective sequence on every rank") {
  for (auto strategy : {nn::CheckpointStrategy::retain, nn::CheckpointStrategy::recompute}) {
    for (int world : {2, 3}) {
      CAPTURE(world);
      CAPTURE(static_cast<int>(strategy));
      std::vector<std::vector<std::string>> histories(world);
      run_ranks(world, [&](Communicator& comm) {
        comm.set_order_check(true);
        nn::manual_seed(5);
        nn::GPT plain(small_gpt());
        nn::fully_shard(plain, comm, {.strategy = strategy});
        nn::manual_seed(5);
        nn::GPT checkpointed(small_gpt());
        nn::fully_shard(checkpointed, comm, {.strategy = strategy});
        const auto want = gradients(plain, &comm, false);
        const std::size_t before = comm.history().size();
        const auto got = gradients(checkpointed, &comm, true);
        check_same(want, got);
        const auto all = comm.history();
        histories[comm.rank()].assign(all.begin() + static_cast<std::ptrdiff_t>(before), all.end());
      });
      for (int r = 1; r < world; ++r) CHECK(histories[r] == histories[0]);
    }
  }
}

TEST_CASE("a checkpointed sharded block as one group: one gather (the recomputation takes it), one reduce-scatter") {
  for (auto strategy : {nn::CheckpointStrategy::retain, nn::CheckpointStrategy::recompute}) {
    std::vector<std::string> calls;
    run_ranks(2, [&](Communicator& comm) {
      nn::manual_seed(1);
      nn::Sequential block(
          {std::make_shared<nn::Linear>(6, 5), std::make_shared<nn::Tanh>(), std::make_shared<nn::Linear>(5, 3)});
      nn::fully_shard(block, comm, {.strategy = strategy});
      sum(nn::checkpoint(block, randn({4, 6}, 2).set_requires_grad())).backward();
      if (comm.rank() == 0) calls = comm.history();
    });
    // The forward without a graph; the group is still unsharded when the backward begins, so the
    // recomputation takes its values (whatever the strategy); then the reduce-scatter. A rank's
    // part: 15 + 3 + 8 + 2 elements. Then which of the 4 parameters the loss reached on any rank.
    // (The first group made over this rank's communicator: #0.)
    const std::string group = "group 'root' #0 (0.weight, 0.bias, 2.weight, ... 4 parameters)";
    const std::vector<std::string> expected = {
        "all_gather(f32, 28, \"" + group + "\")", "reduce_scatter(f32, 56, \"" + group + "\")",
        "all_reduce(f32, 4, sum, \"shard groups: which parameters the loss reached\")"};
    REQUIRE(calls.size() == expected.size());
    for (std::size_t i = 0; i < calls.size(); ++i) {
      CAPTURE(i);
      CHECK_MESSAGE(calls[i].find(expected[i]) != std::string::npos, calls[i] << " is not " << expected[i]);
    }
  }
}

TEST_CASE("a checkpointed sharded block, per parameter: two gathers and one reduce-scatter a parameter") {
  for (auto strategy : {nn::CheckpointStrategy::retain, nn::CheckpointStrategy::recompute}) {
    std::vector<std::string> calls;
    run_ranks(2, [&](Communicator& comm) {
      nn::manual_seed(1);
      nn::Sequential block(
          {std::make_shared<nn::Linear>(6, 5), std::make_shared<nn::Tanh>(), std::make_shared<nn::Linear>(5, 3)});
      nn::fully_shard(block, comm, nn::FullyShardOptions{.policy = {.strategy = strategy}, .group = false});
      sum(nn::checkpoint(block, randn({4, 6}, 2).set_requires_grad())).backward();
      if (comm.rank() == 0) calls = comm.history();
    });
    // The forward without a graph, the recomputation (its gathers kept for the backward that
    // follows, whatever the strategy), then the reduce-scatters in reverse order.
    const std::vector<std::string> expected = {
        "all_gather(f32, 15, \"0.weight\")",
        "all_gather(f32, 3, \"0.bias\")",
        "all_gather(f32, 8, \"2.weight\")",
        "all_gather(f32, 2, \"2.bias\")",
        "all_gather(f32, 15, \"0.weight\")",
        "all_gather(f32, 3, \"0.bias\")",
        "all_gather(f32, 8, \"2.weight\")",
        "all_gather(f32, 2, \"2.bias\")",
        "reduce_scatter(f32, 4, \"2.bias\")",
        "reduce_scatter(f32, 16, \"2.weight\")",
        "reduce_scatter(f32, 6, \"0.bias\")",
        "reduce_scatter(f32, 30, \"0.weight\")",
        "all_reduce(f32, 4, sum, \"sharded parameters: which ones the loss reached\")"};
    REQUIRE(calls.size() == expected.size());
    for (std::size_t i = 0; i < calls.size(); ++i) {
      CAPTURE(i);
      CHECK_MESSAGE(calls[i].find(expected[i]) != std::string::npos, calls[i] << " is not " << expected[i]);
    }
  }
}

TEST_CASE("checkpointing lowers the GPT's activation peak by about all but one block's activations") {
  const nn::GPTConfig config{.vocabulary = 64, .context = 32, .d_model = 32, .layers = 4, .heads = 4};
  const Tensor tokens = randint({8, 32}, 0, 64, 1);
  auto peak = [&](bool checkpointing, std::int64_t layers) {
    nn::manual_seed(1);
    nn::GPTConfig c = config;
    c.layers = layers;
    nn::GPT model(c);
    model.set_activation_checkpointing(checkpointing);
    memory::Scope scope;
    const Tensor loss = nn::cross_entropy(model.forward(tokens), randint({8, 32}, 0, 64, 2));
    const std::int64_t kept = scope.stats().live_bytes;
    loss.backward();
    return std::pair{scope.stats().peak_bytes, kept};
  };
  // One block's activations: what a second block adds to the graph's saved tensors.
  const std::int64_t block = peak(false, 2).second - peak(false, 1).second;
  const auto [plain, plain_kept] = peak(false, 4);
  const auto [checkpointed, checkpointed_kept] = peak(true, 4);
  MESSAGE("one block's activations " << block << " B; peak " << plain << " B plain, " << checkpointed
                                     << " B checkpointed; kept after forward " << plain_kept << " vs "
                                     << checkpointed_kept);
  CHECK(block > 0);
  CHECK(plain - checkpointed >= (config.layers - 1) * block * 3 / 4);
}

namespace {
// A block that returns a tensor existing beside the call: x itself, its parameter, a stored
// buffer, or an integer tensor, by `kind`.
struct Returns : nn::UnaryModule {
  enum Kind { input, parameter, buffer, integer } kind;
  nn::Param weight{randn({3, 4}, 40)};
  Tensor table = randn({3, 4}, 41);
  explicit Returns(Kind k) : kind(k) { register_parameter("weight", &weight); }
  Tensor forward(const Tensor& x) override {
    switch (kind) {
      case input:
        return x;
      case parameter:
        return weight.value();
      case buffer:
        return table.slice(0, 0, x.shape()[0]);
      case integer:
        return argmax(x, 1);
    }
    return x;
  }
};
}  // namespace

TEST_CASE("checkpoint of a block that returns x, a parameter, a buffer or integers: the plain block's gradients") {
  // checkpoint recorded its node on the block's result itself: the parameter stopped being a
  // leaf, the buffer's node recomputed the buffer again and backward recursed until the stack
  // overflowed, and x (an identity block) was refused as "one of the inputs".
  for (const auto kind : {Returns::input, Returns::parameter, Returns::buffer, Returns::integer}) {
    CAPTURE(static_cast<int>(kind));
    Returns plain(kind), checkpointed(kind);
    const Tensor x0 = randn({3, 4}, 42);
    const Tensor xa = x0.clone().set_requires_grad(), xb = x0.clone().set_requires_grad();
    const Tensor ya = plain.forward(xa), yb = nn::checkpoint(checkpointed, xb);
    CHECK(yb.to_vector<double>() == ya.to_vector<double>());
    CHECK(checkpointed.weight.data().is_leaf());
    CHECK(checkpointed.table.grad_fn() == nullptr);
    if (kind == Returns::integer) {
      CHECK_FALSE(yb.requires_grad());
      continue;
    }
    // A loss that always reaches x: the block's own contribution where it has one.
    sum(ya * xa).backward();
    sum(yb * xb).backward();
    CHECK(xb.grad().to_vector<double>() == xa.grad().to_vector<double>());
    CHECK(checkpointed.weight.grad().defined() == plain.weight.grad().defined());
    if (plain.weight.grad().defined()) {
      CHECK(checkpointed.weight.grad().to_vector<double>() == plain.weight.grad().to_vector<double>());
    }
  }
}

TEST_CASE("a checkpointed block destroyed before the backward that recomputes it is an AutogradError") {
  // Its node returned no gradient: the layers before it silently got none.
  nn::Linear first(4, 4);
  Tensor y;
  {
    auto block = std::make_shared<nn::Linear>(4, 4);
    y = nn::checkpoint(*block, first.forward(randn({2, 4}, 43)));
  }
  test::check_throws<AutogradError>([&] { sum(y).backward(); }, {"checkpoint", "destroyed", "keep the block alive"});
}

namespace {
// Linear, Dropout, Tanh, Linear, Dropout, with fixed weights and dropout seeds.
std::shared_ptr<nn::Sequential> dropout_block() {
  nn::manual_seed(11);
  return std::make_shared<nn::Sequential>(std::vector<std::shared_ptr<nn::UnaryModule>>{
      std::make_shared<nn::Linear>(8, 8), std::make_shared<nn::Dropout>(0.5, 21), std::make_shared<nn::Tanh>(),
      std::make_shared<nn::Linear>(8, 8), std::make_shared<nn::Dropout>(0.5, 22)});
}

// The input's gradient and every parameter's, as bytes.
std::vector<std::vector<std::uint8_t>> all_gradients(nn::Sequential& block, const Tensor& x) {
  std::vector<std::vector<std::uint8_t>> out;
  auto bytes = [&](const Tensor& g) {
    REQUIRE(g.defined());
    const auto* b = static_cast<const std::uint8_t*>(g.data_ptr());
    out.emplace_back(b, b + g.nbytes());
  };
  bytes(x.grad());
  for (const auto& [name, p] : block.named_parameters()) bytes(p.grad());
  return out;
}
}  // namespace

TEST_CASE("a model switched between train and eval after a checkpointed forward: the forward's masks still") {
  // The recompute ran with the flags of backward time: put in eval mode between forward and
  // backward, it recomputed without the dropout masks the forward had used (gradients off by up to
  // 3.5); the other way round it drew masks the forward never used.
  for (const bool forward_training : {true, false}) {
    CAPTURE(forward_training);
    auto plain = dropout_block(), checkpointed = dropout_block();
    plain->train(forward_training);
    checkpointed->train(forward_training);
    const Tensor x0 = randn({4, 8}, 5);
    Tensor xa = x0.clone(), xb = x0.clone();
    xa.set_requires_grad(true);
    xb.set_requires_grad(true);
    const Tensor ya = plain->forward(xa), yb = nn::checkpoint(*checkpointed, xb);
    plain->train(!forward_training);
    checkpointed->train(!forward_training);
    sum(square(ya)).backward();
    sum(square(yb)).backward();
    CHECK(all_gradients(*plain, xa) == all_gradients(*checkpointed, xb));
    // The flags are the caller's again.
    for (const auto& [name, m] : checkpointed->named_modules()) CHECK(m->is_training() == !forward_training);
  }
}

namespace {
// A block that throws from its third forward on: the recompute of a checkpoint that ran twice before.
struct ThrowsOnThird : nn::UnaryModule {
  std::shared_ptr<nn::Linear> linear = std::make_shared<nn::Linear>(8, 8);
  std::shared_ptr<nn::Dropout> dropout = std::make_shared<nn::Dropout>(0.5, 23);
  int calls = 0;
  ThrowsOnThird() {
    register_module("linear", linear);
    register_module("dropout", dropout);
  }
  Tensor forward(const Tensor& x) override {
    const Tensor h = dropout->forward(linear->forward(x));
    if (++calls == 3) fail<ArgumentError>("ThrowsOnThird", "injected failure");
    return tanh(h);
  }
};
}  // namespace

TEST_CASE("a recompute that throws leaves the dropout streams and flags where it found them") {
  nn::manual_seed(12);
  ThrowsOnThird block;
  Tensor x = randn({4, 8}, 6);
  x.set_requires_grad(true);
  const Tensor y = nn::checkpoint(block, x);
  autograd::no_grad([&] { return block.forward(x); });  // a second forward: other draws
  const std::uint64_t before = block.dropout->generator().offset();
  test::check_throws<ArgumentError>([&] { sum(square(y)).backward(); }, {"injected failure"});
  CHECK(block.dropout->generator().offset() == before);  // it read the first forward's position after
  CHECK(block.is_training());
}

namespace {
// A dropout block that runs `before_dropout` once in a forward, before it draws, and
// `during_recompute` from inside its recompute (a forward in backward), after it draws.
struct CallsBackInRecompute : nn::UnaryModule {
  std::shared_ptr<nn::Dropout> dropout = std::make_shared<nn::Dropout>(0.5, 123);
  std::function<void()> before_dropout, during_recompute;
  CallsBackInRecompute() { register_module("dropout", dropout); }
  Tensor forward(const Tensor& x) override {
    if (before_dropout) std::exchange(before_dropout, nullptr)();
    const Tensor y = dropout->forward(x);
    if (autograd::in_backward() && during_recompute) during_recompute();
    return y;
  }
};
}  // namespace

TEST_CASE("a recompute on one thread neither rewinds nor repeats the draws another thread makes meanwhile") {
  // The recompute set the shared Dropout's stream back to the forward's position and restored
  // it after: a thread drawing meanwhile got the forward's mask again, and its draws were
  // rewound, so the next forward repeated them. The replayed position is now this thread's alone.
  const std::int64_t n = 1000;
  CallsBackInRecompute block;
  Tensor x = ones({n});
  x.set_requires_grad(true);
  const Tensor y = nn::checkpoint(block, x);  // draws [0, n)
  Tensor other;
  block.during_recompute = [&] {
    std::thread([&] { other = block.dropout->forward(ones({n})); }).join();
    CHECK(block.dropout->next_draw() == static_cast<std::uint64_t>(n));  // the replayed position, here
  };
  sum(y).backward();  // the recompute replays [0, n) while the other thread draws [n, 2n)
  CHECK(block.dropout->generator().offset() == static_cast<std::uint64_t>(2 * n));
  CHECK(other.to_vector<float>() == dropout(ones({n}), 0.5, 123, n).to_vector<float>());
  CHECK(x.grad().to_vector<float>() == dropout(ones({n}), 0.5, 123, 0).to_vector<float>());  // the forward's mask
  block.during_recompute = nullptr;
  CHECK(block.forward(ones({n})).to_vector<float>() == dropout(ones({n}), 0.5, 123, 2 * n).to_vector<float>());
}

TEST_CASE("threads training one shared checkpointed GPT at once: each draw taken once, flags untouched") {
  // README: graphs on different threads may run backward at once, through shared parameters.
  // The recompute set the shared modules' training flags and streams (a data race under TSan,
  // with or without dropout); it now reads the forward's on its own thread.
  nn::manual_seed(3);
  nn::GPT gpt(small_gpt(0.1));
  gpt.set_activation_checkpointing(true);
  std::vector<std::uint64_t> before;
  for (const auto& [path, m] : gpt.named_modules()) {
    if (const auto* d = dynamic_cast<const nn::Dropout*>(m)) before.push_back(d->generator().offset());
  }
  // The draws of one forward alone, per Dropout.
  const Tensor probe = randint({kBatch, kTime}, 0, kVocab, 40);
  autograd::no_grad([&] { return gpt.forward(probe); });
  std::vector<std::uint64_t> per_forward;
  std::size_t i = 0;
  for (const auto& [path, m] : gpt.named_modules()) {
    if (const auto* d = dynamic_cast<const nn::Dropout*>(m))
      per_forward.push_back(d->generator().offset() - before[i++]);
  }
  constexpr int kThreads = 3, kSteps = 2;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int s = 0; s < kSteps; ++s) {
        const Tensor tokens = randint({kBatch, kTime}, 0, kVocab, 50 + t),
                     targets = randint({kBatch, kTime}, 0, kVocab, 60 + t);
        nn::cross_entropy(gpt.forward(tokens), targets).backward();
      }
    });
  }
  for (auto& th : threads) th.join();
  // Every forward took its draws once; no recompute took or rewound any.
  i = 0;
  for (const auto& [path, m] : gpt.named_modules()) {
    if (const auto* d = dynamic_cast<const nn::Dropout*>(m)) {
      CAPTURE(path);
      CHECK(d->generator().offset() == before[i] + per_forward[i] * (1 + kThreads * kSteps));
      ++i;
    }
    CHECK(m->is_training());
  }
  for (const auto& [name, p] : gpt.named_parameters()) {
    CAPTURE(name);
    REQUIRE(p.grad().defined());
    for (const double g : p.grad().to_vector<double>()) REQUIRE(std::isfinite(g));
  }
}

TEST_CASE("another thread's draw between a checkpoint's start and its own draw: the recompute replays the forward's") {
  // The checkpoint noted the Dropout's position before its forward ran; a thread drawing from the
  // shared Dropout in between moved the forward's draw on, and the recompute replayed the noted
  // position: another mask, so wrong gradients (about half of them; races of two threads
  // training one checkpointed block hit it in a few backwards of 80). The draws the forward took
  // are recorded now.
  const std::int64_t n = 1000;
  CallsBackInRecompute block;
  const Tensor x = ones({n}).set_requires_grad();
  block.before_dropout = [&] { std::thread([&] { (void)block.forward(ones({n})); }).join(); };  // draws [0, n)
  const Tensor y = nn::checkpoint(block, x);                                                    // draws [n, 2n)
  CHECK(y.to_vector<float>() == dropout(ones({n}), 0.5, 123, n).to_vector<float>());
  sum(y).backward();
  CHECK(x.grad().to_vector<float>() == y.to_vector<float>());  // the forward's own mask
  CHECK(block.dropout->generator().offset() == static_cast<std::uint64_t>(2 * n));
}

TEST_CASE("a parameter changed in place between a checkpointed forward and its backward is an AutogradError") {
  // The plain block's backward refuses its saved weight's change; the checkpointed one recomputed
  // with the new weights and mixed them with the old upstream gradient, silently (dense, and
  // sharded with either strategy). A tensor swapped in by set_data stays allowed (README).
  auto bump = [](const nn::Module& m) {
    autograd::NoGradGuard no_grad;
    for (const nn::Param& p : m.parameters()) p.data().add_(ones_like(p.data()), 0.5);
  };
  {
    nn::manual_seed(4);
    nn::Sequential block(
        {std::make_shared<nn::Linear>(6, 5), std::make_shared<nn::Tanh>(), std::make_shared<nn::Linear>(5, 3)});
    const Tensor y = nn::checkpoint(block, randn({2, 6}, 1).set_requires_grad());
    bump(block);
    test::check_throws<AutogradError>([&] { sum(y).backward(); },
                                      {"checkpoint", "parameter '0.weight'", "modified in place", "version"});
    // Backward first, then the update: as before.
    const Tensor again = nn::checkpoint(block, randn({2, 6}, 1).set_requires_grad());
    sum(again).backward();
    bump(block);
  }
  for (const nn::CheckpointStrategy strategy : {nn::CheckpointStrategy::recompute, nn::CheckpointStrategy::retain}) {
    run_ranks(2, [&](Communicator& comm) {
      nn::manual_seed(4);
      nn::Sequential block(
          {std::make_shared<nn::Linear>(6, 5), std::make_shared<nn::Tanh>(), std::make_shared<nn::Linear>(5, 3)});
      nn::FullyShardOptions options;
      options.policy.strategy = strategy;
      nn::fully_shard(block, comm, options);
      const Tensor y = nn::checkpoint(block, randn({2, 6}, 1 + comm.rank()).set_requires_grad());
      bump(block);
      test::check_throws<AutogradError>([&] { sum(y).backward(); }, {"checkpoint", "modified in place"});
    });
  }
}

TEST_CASE("a checkpointed block reading a parameter it did not register passes it its gradient") {
  // With neither x nor the block's own parameters needing a gradient, the checkpoint recorded no
  // node, and a parameter the block reads from elsewhere (a table its parent holds) got none.
  struct ReadsOutside : nn::UnaryModule {
    Tensor outside;
    nn::Param own{randn({4, 4}, 2)};
    ReadsOutside() { register_parameter("own", &own); }
    Tensor forward(const Tensor& x) override { return matmul(x, outside) + matmul(x, own.value()); }
  };
  ReadsOutside block;
  block.own.data().set_requires_grad(false);  // frozen
  block.outside = randn({4, 4}, 3).set_requires_grad();
  const Tensor x = randn({3, 4}, 4);
  sum(square(block.forward(x))).backward();
  const std::vector<double> plain = block.outside.grad().to_vector<double>();
  block.outside.zero_grad();
  const Tensor y = nn::checkpoint(block, x);
  REQUIRE(y.requires_grad());
  sum(square(y)).backward();
  REQUIRE(block.outside.grad().defined());
  CHECK(block.outside.grad().to_vector<double>() == plain);
}
