// The pieces of a training job in nn/training.h, sharded over emulated ranks against the same
// computation in one process: the padded evaluation of a classifier, the windows of a language
// model's data stream, and sampling.
#include <atomic>
#include <fstream>
#include <mutex>

#include "helpers.h"

using namespace ruda;
using test::TempDir;

namespace {

// Every rank's result of fn(comm), in rank order.
template <class T, class F>
std::vector<T> on_ranks(int world, F fn) {
  std::vector<T> out(static_cast<std::size_t>(world));
  std::mutex m;
  run_ranks(world, [&](Communicator& comm) {
    T r = fn(comm);
    std::lock_guard lock(m);
    out[static_cast<std::size_t>(comm.rank())] = std::move(r);
  });
  return out;
}

}  // namespace

TEST_CASE("evaluate_classifier scores the whole test set over any world size, padding what is past its end") {
  TempDir cache;
  for (const std::int64_t limit : {203, 5}) {
    const nn::IdxImages test = nn::open_fashion_mnist(nn::kFashionMnistDir, false, limit, cache.str());
    // The reference: one forward pass over every image in one process.
    nn::manual_seed(4);
    nn::Linear dense(784, 10);
    const Tensor logits = dense.forward(test.images(0, limit));
    const Tensor labels = test.labels(0, limit);
    const double accuracy = sum(eq(argmax(logits, 1), labels).to(DType::f64)).item() / static_cast<double>(limit);
    const double loss = nn::cross_entropy(logits, labels).item();
    for (const int world : {1, 3, 4}) {
      for (const std::int64_t chunk : {16, 1000}) {
        // With 5 images over 4 ranks, rank 3's share lies wholly past the end: it scores padding only.
        INFO("limit " << limit << ", world " << world << ", chunk " << chunk);
        const auto scores = on_ranks<nn::ClassifierScore>(world, [&](Communicator& comm) {
          nn::manual_seed(4);
          nn::Linear layer(784, 10);
          nn::fully_shard(layer, comm);
          return nn::evaluate_classifier(layer, comm, test, chunk);
        });
        for (const auto& s : scores) {
          CHECK(s.accuracy == doctest::Approx(accuracy).epsilon(1e-12));
          CHECK(s.loss == doctest::Approx(loss).epsilon(1e-5));
        }
      }
    }
  }
  LocalCommunicator local;
  nn::Linear layer(784, 10);
  const nn::IdxImages test = nn::open_fashion_mnist(nn::kFashionMnistDir, false, 8, cache.str());
  test::check_throws<ArgumentError>([&] { nn::evaluate_classifier(layer, local, test, 0); },
                                    {"evaluate_classifier", "chunk 0"});
}

TEST_CASE("evaluate_classifier refuses ranks holding test sets of other sizes, on every rank") {
  // Each rank took its share of its own set and divided by its own size: a different "global"
  // score on each rank, some samples counted twice and others never.
  TempDir cache;
  std::atomic<int> refused{0};
  run_ranks(2, [&](Communicator& comm) {
    const nn::IdxImages test =
        nn::open_fashion_mnist(nn::kFashionMnistDir, false, comm.rank() == 0 ? 4 : 2, cache.str());
    nn::Linear layer(784, 10);
    test::check_throws<ArgumentError>([&] { nn::evaluate_classifier(layer, comm, test, 8); },
                                      {"evaluate_classifier", "test sets differ", "rank 0 holds 4", "rank 1 2"});
    ++refused;
  });
  CHECK(refused == 2);
}

TEST_CASE("TextWindows: the ranks' parts of a step are the one-process batch, each a window of the range") {
  TempDir dir;
  {
    std::ofstream f(dir.str() + "/text", std::ios::binary);
    for (int p = 0; p < 400; ++p) f.put(static_cast<char>(p % 256));
  }
  // Positions [100, 340) hold distinct bytes, so a window's first byte tells where it starts.
  const nn::TextCorpus corpus(dir.str() + "/text");
  constexpr std::int64_t kBegin = 100, kEnd = 340, kContext = 8, kGlobal = 6;
  auto position_of = [](std::int64_t first_byte) { return first_byte >= kBegin ? first_byte : first_byte + 256; };

  nn::TextWindows whole(corpus, kBegin, kEnd, kContext);
  const auto [x, y] = whole.batch(3, 2, kGlobal, 0, 1);
  CHECK(x.shape() == Shape{kGlobal, kContext});
  CHECK(x.dtype() == DType::i64);
  CHECK(whole.bytes_read() == kGlobal * (kContext + 1));
  const auto xs = x.to_vector<std::int64_t>(), ys = y.to_vector<std::int64_t>();
  for (std::int64_t i = 0; i < kGlobal; ++i) {
    const std::int64_t pos = position_of(xs[static_cast<std::size_t>(i * kContext)]);
    CHECK(pos >= kBegin);
    CHECK(pos + kContext + 1 <= kEnd);
    for (std::int64_t j = 0; j < kContext; ++j) {
      CHECK(xs[static_cast<std::size_t>(i * kContext + j)] == (pos + j) % 256);
      CHECK(ys[static_cast<std::size_t>(i * kContext + j)] == (pos + j + 1) % 256);
    }
  }
  // Other steps and seeds draw other windows.
  CHECK(whole.batch(3, 3, kGlobal, 0, 1).first.to_vector<std::int64_t>() != xs);
  CHECK(whole.batch(4, 2, kGlobal, 0, 1).first.to_vector<std::int64_t>() != xs);
  // Three ranks, each a fresh object (a resumed run): their parts, in rank order, are the batch.
  for (const int world : {2, 3}) {
    std::vector<std::int64_t> joined;
    for (int rank = 0; rank < world; ++rank) {
      nn::TextWindows part(corpus, kBegin, kEnd, kContext);
      const auto [px, py] = part.batch(3, 2, kGlobal, rank, world);
      CHECK(px.shape() == Shape{kGlobal / world, kContext});
      const auto v = px.to_vector<std::int64_t>();
      joined.insert(joined.end(), v.begin(), v.end());
      CHECK(part.bytes_read() == kGlobal / world * (kContext + 1));
    }
    CHECK(joined == xs);
  }
  test::check_throws<ArgumentError>([&] { whole.batch(3, 0, 7, 0, 3); }, {"TextWindows::batch", "7", "3 ranks"});
  // 9 bytes hold one window of context 8 (inputs and targets); 8 do not.
  CHECK(nn::TextWindows(corpus, 0, 9, kContext).batch(3, 0, 1, 0, 1).first.shape() == Shape{1, kContext});
  test::check_throws<ArgumentError>([&] { nn::TextWindows(corpus, 0, 8, kContext); },
                                    {"TextWindows", "[0, 8)", "context 8"});
  test::check_throws<ArgumentError>([&] { nn::TextWindows(corpus, 300, 401, kContext); },
                                    {"[300, 401)", "no range", "400 bytes"});
  // Context 0 is named as the problem (it read "too few bytes for windows of context 0").
  test::check_throws<ArgumentError>([&] { nn::TextWindows(corpus, 0, 100, 0); }, {"context 0 is not positive"});
}

TEST_CASE("sample_bytes: the same bytes on every rank of a sharded model as from the dense model") {
  const nn::GPTConfig config{.vocabulary = 256, .context = 8, .d_model = 16, .layers = 1, .heads = 2};
  const std::string prompt = "caf\xc3\xa9";  // bytes past 127 are tokens 128..255, not negative
  for (const double temperature : {0.0, 0.8}) {
    nn::manual_seed(11);
    nn::GPT dense(config);
    dense.eval();
    const std::string expected = nn::sample_bytes(dense, prompt, 12, config.context, temperature, 5);
    CHECK(expected.size() == 12);
    CHECK(nn::sample_bytes(dense, prompt, 12, config.context, temperature, 5) == expected);  // deterministic
    const auto sampled = on_ranks<std::string>(2, [&](Communicator& comm) {
      nn::manual_seed(11);
      nn::GPT model(config);
      nn::fully_shard(model, comm);
      model.eval();
      return nn::sample_bytes(model, prompt, 12, config.context, temperature, 5);
    });
    for (const auto& s : sampled) CHECK(s == expected);
  }
  nn::GPT small({.vocabulary = 32, .context = 8, .d_model = 16, .layers = 1, .heads = 2});
  test::check_throws<ShapeError>([&] { nn::sample_bytes(small, "\x05", 1, 8, 0, 1); },
                                 {"sample_bytes", "[1, 1, 32]", "[1, 1, 256]"});
}

TEST_CASE(
    "the GPT with fused attention reproduces the composed GPT's losses over 20 steps, dense and sharded, "
    "keeping or recomputing the MLPs' pre-activations") {
  // Losses of 20 AdamW steps of a small GPT, with attention fused or composed, over `world`
  // emulated ranks (1: dense). Dropout on, so the shared mask is exercised too.
  auto run = [](int world, bool fused, GeluBackward gelu = GeluBackward::keep_pre_activation) {
    return on_ranks<std::vector<double>>(world, [&](Communicator& comm) {
      nn::manual_seed(11);
      auto model = std::make_shared<nn::GPT>(
          nn::GPTConfig{.vocabulary = 32, .context = 24, .d_model = 32, .layers = 2, .heads = 4, .dropout = 0.1});
      model->set_fused_attention(fused);
      model->set_gelu_backward(gelu);
      if (world > 1) {
        for (const auto& block : model->blocks) nn::fully_shard(*block, comm);
        nn::fully_shard(*model, comm);
      }
      nn::AdamW opt(model->parameters(), {.lr = 3e-3});
      std::vector<double> losses;
      constexpr std::int64_t kBatch = 4, kTime = 24;
      for (int step = 0; step < 20; ++step) {
        const Tensor tokens = randint({kBatch, kTime}, 0, 32, 100 + step);
        const Tensor targets = randint({kBatch, kTime}, 0, 32, 200 + step);
        const std::int64_t rows = kBatch / world, first = rows * comm.rank();
        const Tensor loss =
            nn::cross_entropy(model->forward(tokens.slice(0, first, first + rows)),
                              targets.slice(0, first, first + rows), {.reduction = nn::LossReduction::sum}) /
            static_cast<double>(kBatch * kTime);
        losses.push_back(comm.all_reduce(loss.detach()).item());
        opt.zero_grad();
        loss.backward();
        opt.step();
      }
      return losses;
    })[0];
  };
  for (int world : {1, 2}) {
    CAPTURE(world);
    const auto fused = run(world, true), composed = run(world, false);
    const auto recomputing = run(world, true, GeluBackward::recompute);
    REQUIRE(fused.size() == composed.size());
    REQUIRE(recomputing.size() == composed.size());
    for (std::size_t i = 0; i < fused.size(); ++i) {
      CAPTURE(i);
      CHECK(std::abs(fused[i] - composed[i]) <= 1e-5 * std::abs(composed[i]));
      CHECK(std::abs(recomputing[i] - composed[i]) <= 1e-5 * std::abs(composed[i]));
    }
    CHECK(fused.back() < fused.front());  // and it learns
  }
}
