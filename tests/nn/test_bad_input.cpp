// nn's entry points refuse enum values that are none of the enumerators (a number cast to the
// enum, uninitialized memory) with a typed error naming the op, before anything runs.
#include "helpers.h"

using namespace ruda;
using test::check_throws;

TEST_CASE("losses and layers: a bad LossReduction or GeluApproximation") {
  const auto bad = static_cast<nn::LossReduction>(8);
  const Tensor x = zeros({2, 3}), targets = from_vector<std::int64_t>({0, 2}, {2});
  check_throws<ArgumentError>([&] { nn::mse_loss(x, x, bad); }, {"mse_loss", "not a valid LossReduction: 8"});
  check_throws<ArgumentError>([&] { nn::l1_loss(x, x, bad); }, {"l1_loss", "not a valid LossReduction: 8"});
  check_throws<ArgumentError>([&] { nn::cross_entropy(x, targets, {.reduction = bad}); },
                              {"cross_entropy", "not a valid LossReduction: 8"});
  check_throws<ArgumentError>([&] { nn::nll_loss(log_softmax(x), targets, {.reduction = bad}); },
                              {"nll_loss", "not a valid LossReduction: 8"});
  check_throws<ArgumentError>([&] { nn::binary_cross_entropy_with_logits(x, x, bad); },
                              {"binary_cross_entropy_with_logits", "not a valid LossReduction: 8"});
  check_throws<ArgumentError>([] { nn::GELU(static_cast<GeluApproximation>(3)); },
                              {"GELU", "not a valid GeluApproximation: 3"});
}

TEST_CASE("parameters: a bad dtype or initializer kind is refused when the parameter is made, deferred or not") {
  nn::Initializer strange = nn::init::zeros();
  strange.kind = static_cast<nn::Initializer::Kind>(42);
  check_throws<ArgumentError>([&] { nn::Param({2, 2}, strange); }, {"Param", "not a valid Initializer::Kind: 42"});
  {
    nn::DeferredInit deferred;
    check_throws<ArgumentError>([&] { nn::Param({2, 2}, strange); }, {"Param", "Initializer::Kind"});
    check_throws<DTypeError>([&] { nn::Param({2, 2}, nn::init::zeros(), static_cast<DType>(77)); }, {"Param"});
  }
  check_throws<ArgumentError>([&] { strange.make({2}, DType::f32); }, {"Initializer", "Initializer::Kind: 42"});
}

TEST_CASE("sharding: bad strategies, accumulations, compute dtypes and overlap modes are refused up front") {
  LocalCommunicator comm;
  auto fresh = [] { return std::make_shared<nn::Linear>(4, 3); };
  auto shard = [&](nn::FullyShardOptions options) {
    auto layer = fresh();
    nn::fully_shard(*layer, comm, options);
  };
  check_throws<ArgumentError>([&] { shard({.policy = {.strategy = static_cast<nn::CheckpointStrategy>(5)}}); },
                              {"fully_shard", "not a valid CheckpointStrategy: 5"});
  check_throws<ArgumentError>([&] { shard({.policy = {.reduce = static_cast<Accumulate>(6)}}); },
                              {"fully_shard", "not a valid Accumulate: 6"});
  check_throws<DTypeError>([&] { shard({.policy = {.compute_dtype = static_cast<DType>(50)}}); },
                           {"fully_shard", "not a valid compute dtype: 50"});
  check_throws<DTypeError>([&] { shard({.policy = {.compute_dtype = DType::i64}}); }, {"fully_shard", "i64"});
  check_throws<ArgumentError>([&] { shard({.overlap = static_cast<nn::Overlap>(9)}); },
                              {"fully_shard", "not a valid Overlap: 9"});
  const nn::Linear dense(4, 3);
  check_throws<ArgumentError>(
      [&] { nn::FullyShardedLinear::from_full(dense, 0, 1, {.strategy = static_cast<nn::CheckpointStrategy>(5)}); },
      {"from_full", "CheckpointStrategy"});
  auto layer = fresh();
  nn::fully_shard(*layer, comm);
  check_throws<ArgumentError>([&] { nn::set_checkpoint_strategy(*layer, static_cast<nn::CheckpointStrategy>(2)); },
                              {"set_checkpoint_strategy", "CheckpointStrategy: 2"});
  check_throws<DTypeError>([&] { nn::plan_state(*layer, 1, 8, {.compute_dtype = static_cast<DType>(33)}); },
                           {"plan_state", "compute dtype: 33"});
}

TEST_CASE("losses name themselves when input and target disagree on dtype; GPT refuses an empty sequence") {
  const Tensor x = zeros({2, 3});
  // The sub or mul inside the loss used to be the one to refuse ("mul: dtypes differ").
  check_throws<DTypeError>([&] { nn::mse_loss(x, x.to(DType::f64)); }, {"mse_loss", "f32 [2, 3]", "f64 [2, 3]"});
  check_throws<DTypeError>([&] { nn::l1_loss(x, x.to(DType::i64)); }, {"l1_loss", "i64"});
  check_throws<DTypeError>([&] { nn::binary_cross_entropy_with_logits(x, x.to(DType::i64)); },
                           {"binary_cross_entropy_with_logits", "f32 [2, 3]", "i64 [2, 3]"});
  check_throws<DTypeError>(
      [&] { nn::binary_cross_entropy_with_logits(x, x, nn::LossReduction::mean, ones({3}, DType::f64)); },
      {"binary_cross_entropy_with_logits", "pos_weight", "f64"});
  check_throws<DTypeError>([&] { nn::mse_loss(x.to(DType::i64), x.to(DType::i64)); }, {"mse_loss", "floating-point"});
  check_throws<ArgumentError>([&] { nn::mse_loss(Tensor(), x); }, {"mse_loss", "undefined"});
  check_throws<DTypeError>([&] { nn::counted_targets(x, -100); }, {"counted_targets", "i64", "f32 [2, 3]"});
  CHECK(nn::counted_targets(from_vector<std::int64_t>({1, -100, 0}, {3}), -100) == 2);

  nn::manual_seed(1);
  nn::GPT gpt({.vocabulary = 16, .context = 8, .d_model = 8, .layers = 1, .heads = 2});
  check_throws<ShapeError>([&] { gpt.forward(zeros({1, 0}, DType::i64)); }, {"GPT", "1 <= time <= 8", "[1, 0]"});
}
