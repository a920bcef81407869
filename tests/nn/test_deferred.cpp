// Sharded construction: a model built under DeferredInit allocates no parameter, and fully_shard
// (or the seed's from_full) materializes only each rank's slice, bitwise equal to the same slice
// of the dense initialization with the same seed.
#include <cmath>

#include "helpers.h"
#include "sharded_fixture.h"

using namespace ruda;

namespace {
// A user's own module: parameters from initializers ruda does not ship.
struct UserModule : nn::Module {
  nn::Param scale{{7, 5}, nn::init::by_index([](std::int64_t i) { return std::sin(0.1 * static_cast<double>(i)); })};
  nn::Param gate{{9}, nn::init::uniform(-2.0, 3.0), DType::bf16};
  nn::Param table{{4, 3}, nn::init::normal(1.0, 0.5), DType::f64};
  nn::Param whole{{3, 2}, nn::init::whole([](const Shape& shape, DType dtype) {
                    return arange(0, 6, 1, dtype).reshape(shape) * 2.0;
                  })};
  std::shared_ptr<nn::Linear> half = std::make_shared<nn::Linear>(5, 3, nn::LinearOptions{.dtype = DType::f16});
  UserModule() {
    register_parameter("scale", &scale);
    register_parameter("gate", &gate);
    register_parameter("table", &table);
    register_parameter("whole", &whole);
    register_module("half", half);
  }
};

std::shared_ptr<nn::Module> make_gpt() {
  return std::make_shared<nn::GPT>(
      nn::GPTConfig{.vocabulary = 11, .context = 5, .d_model = 6, .layers = 2, .heads = 2});
}
std::shared_ptr<nn::Module> make_tied_gpt() {
  return std::make_shared<nn::GPT>(
      nn::GPTConfig{.vocabulary = 7, .context = 3, .d_model = 4, .layers = 1, .heads = 1, .tied_head = false});
}
}  // namespace

TEST_CASE("a deferred parameter holds shape, dtype and initializer, and no bytes") {
  memory::Scope rank;
  nn::manual_seed(5);
  nn::DeferredInit scope;
  nn::Linear layer(300, 200);
  CHECK(rank.stats().live_bytes == 0);
  CHECK(layer.weight.is_deferred());
  CHECK(layer.weight.shape() == Shape{300, 200});
  CHECK(layer.weight.dtype() == DType::f32);
  CHECK(layer.parameter_count() == 300 * 200 + 200);
  CHECK_FALSE(layer.weight.grad().defined());
  layer.zero_grad();  // nothing to clear, and no error
  test::check_throws<ArgumentError>([&] { (void)layer.weight.data(); },
                                    {"Param::data", "f32 [300, 200]", "deferred", "fully_shard", "materialize"});
  test::check_throws<ArgumentError>([&] { (void)layer.forward(ones({1, 300})); }, {"Param::value", "deferred"});
  // A tensor made whole cannot be deferred: the allocation already happened.
  test::check_throws<ArgumentError>([] { nn::Param p(zeros({4})); }, {"DeferredInit", "Param(shape, initializer)"});
}

TEST_CASE("materialize() gives the dense initialization, bitwise") {
  nn::manual_seed(9);
  nn::GPT dense({.vocabulary = 11, .context = 5, .d_model = 6, .layers = 2, .heads = 2});
  nn::manual_seed(9);
  std::unique_ptr<nn::GPT> deferred;
  {
    nn::DeferredInit scope;
    deferred =
        std::make_unique<nn::GPT>(nn::GPTConfig{.vocabulary = 11, .context = 5, .d_model = 6, .layers = 2, .heads = 2});
  }
  deferred->materialize();
  const auto a = dense.named_parameters(), b = deferred->named_parameters();
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CAPTURE(a[i].first);
    CHECK(a[i].second.data().to_vector<double>() == b[i].second.data().to_vector<double>());
    CHECK(b[i].second.data().requires_grad());
  }
}

TEST_CASE("sharded construction equals the dense initialization's slices bitwise, world sizes 1-5") {
  const std::vector<std::pair<const char*, std::function<std::shared_ptr<nn::Module>()>>> models = {
      {"Linear", [] { return std::make_shared<nn::Linear>(7, 5); }},
      {"Embedding", [] { return std::make_shared<nn::Embedding>(13, 6); }},
      {"LayerNorm", [] { return std::make_shared<nn::LayerNorm>(9); }},
      {"GPT", make_gpt},
      {"GPT, untied head", make_tied_gpt},
      {"TinyLM", [] { return std::make_shared<test::TinyLM>(); }},
      {"a user's module", [] { return std::make_shared<UserModule>(); }},
  };
  for (int world = 1; world <= 5; ++world) {
    for (const auto& [what, make] : models) {
      CAPTURE(world);
      CAPTURE(what);
      std::vector<std::string> mismatches(world);
      run_ranks(world,
                [&](Communicator& comm) { mismatches[comm.rank()] = test::deferred_shards_mismatch(comm, make); });
      for (const auto& m : mismatches) CHECK_MESSAGE(m.empty(), "differs: " << m);
    }
  }
}

TEST_CASE("the seed's from_full takes a deferred layer and draws only the slice") {
  run_ranks(3, [](Communicator& comm) {
    nn::manual_seed(4);
    nn::Linear dense(10, 7);
    nn::manual_seed(4);
    std::unique_ptr<nn::Linear> deferred;
    {
      nn::DeferredInit scope;
      deferred = std::make_unique<nn::Linear>(10, 7);
    }
    auto a = nn::FullyShardedLinear::from_full(dense, comm.rank(), 3, {}, "fc");
    auto b = nn::FullyShardedLinear::from_full(*deferred, comm.rank(), 3, {}, "fc");
    CHECK(a->weight().data().to_vector<double>() == b->weight().data().to_vector<double>());
    CHECK(a->bias().data().to_vector<double>() == b->bias().data().to_vector<double>());
    CHECK(b->weight().shard()->name == "fc.weight");
    // The deferred layer trains like any sharded one.
    const Tensor y = b->forward(ones({2, 10}), comm);
    CHECK(y.shape() == Shape{2, 7});
  });
}

TEST_CASE("constructing and sharding 8 layers of 1024x1024 at world 4 never holds more than the shards") {
  constexpr int kWorld = 4, kLayers = 8;
  constexpr std::int64_t kShardBytes = kLayers * (1024 * 1024 + 1024) / kWorld * 4;
  std::vector<std::int64_t> peaks(kWorld), lives(kWorld);
  run_ranks(kWorld, [&](Communicator& comm) {
    memory::reset_peak();
    nn::manual_seed(2);
    nn::Sequential model;
    {
      nn::DeferredInit scope;
      for (int i = 0; i < kLayers; ++i) model.push_back(std::make_shared<nn::Linear>(1024, 1024));
    }
    CHECK(memory::stats().live_bytes == 0);
    nn::fully_shard(model, comm);
    lives[comm.rank()] = memory::stats().live_bytes;
    peaks[comm.rank()] = memory::stats().peak_bytes;
  });
  for (int r = 0; r < kWorld; ++r) {
    CAPTURE(r);
    CHECK(lives[r] == kShardBytes);
    // The shards, and at most one extra slice of one parameter in flight: far below one full layer (4 MiB).
    CHECK(peaks[r] <= kShardBytes + 64 * 1024);
  }
  // The dense way holds every full layer first.
  memory::Scope dense_scope;
  nn::Sequential dense;
  for (int i = 0; i < kLayers; ++i) dense.push_back(std::make_shared<nn::Linear>(1024, 1024));
  CHECK(dense_scope.stats().peak_bytes >= kWorld * kShardBytes);
}

TEST_CASE("a whole-tensor initializer is the documented exception; a wrong result is an error") {
  run_ranks(2, [](Communicator& comm) {
    nn::Param bad;
    {
      nn::DeferredInit scope;
      bad = nn::Param({2, 2}, nn::init::whole([](const Shape&, DType) { return zeros({3}); }));
    }
    struct Holder : nn::Module {
      nn::Param p;
      explicit Holder(nn::Param q) : p(std::move(q)) { register_parameter("p", &p); }
    } holder(bad);
    test::check_throws<ShapeError>([&] { nn::fully_shard(holder, comm); }, {"init::whole", "f32 [2, 2]", "[3]"});
  });
}
