// nn's entry points refuse enum values that are none of the enumerators (a number cast to the
// enum, uninitialized memory) with a typed error naming the op, before anything runs.
#include <cmath>
#include <fstream>
#include <limits>

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
  // A pos_weight that would widen the loss's shape, or does not broadcast at all, is refused by
  // the loss (PyTorch: "output with shape [2, 3] doesn't match the broadcast shape [2, 2, 3]").
  for (const Shape& bad : {Shape{2, 2, 3}, Shape{2}, Shape{3, 3}}) {
    CAPTURE(to_string(bad));
    check_throws<ShapeError>([&] { nn::binary_cross_entropy_with_logits(x, x, nn::LossReduction::mean, ones(bad)); },
                             {"binary_cross_entropy_with_logits", "pos_weight", "[2, 3]"});
  }
  for (const Shape& good : {Shape{3}, Shape{1}, Shape{}, Shape{2, 1}, Shape{2, 3}}) {
    CAPTURE(to_string(good));
    CHECK(nn::binary_cross_entropy_with_logits(x, x, nn::LossReduction::none, ones(good)).shape() == x.shape());
  }
  check_throws<DTypeError>([&] { nn::mse_loss(x.to(DType::i64), x.to(DType::i64)); }, {"mse_loss", "floating-point"});
  check_throws<ArgumentError>([&] { nn::mse_loss(Tensor(), x); }, {"mse_loss", "undefined"});
  check_throws<DTypeError>([&] { nn::counted_targets(x, -100); }, {"counted_targets", "i64", "f32 [2, 3]"});
  CHECK(nn::counted_targets(from_vector<std::int64_t>({1, -100, 0}, {3}), -100) == 2);

  nn::manual_seed(1);
  nn::GPT gpt({.vocabulary = 16, .context = 8, .d_model = 8, .layers = 1, .heads = 2});
  check_throws<ShapeError>([&] { gpt.forward(zeros({1, 0}, DType::i64)); }, {"GPT", "1 <= time <= 8", "[1, 0]"});
}

TEST_CASE("modules and layers: a null parameter, a layer past the end, integer input to a norm layer") {
  struct Holder : nn::Module {
    Holder() { register_parameter("w", nullptr); }  // named_parameters() dereferenced it
  };
  check_throws<ArgumentError>([] { Holder h; }, {"register_parameter", "'w'", "null"});
  nn::Sequential empty;
  check_throws<IndexError>([&] { (void)empty[3]; }, {"Sequential", "layer 3 of 0"});
  // The norm layers cast to f32 and back: an i64 input came back as i64 zeros.
  const Tensor integers = zeros({2, 2}, DType::i64);
  check_throws<DTypeError>([&] { nn::LayerNorm(2, 1e-5, false).forward(integers); }, {"LayerNorm", "i64 [2, 2]"});
  check_throws<DTypeError>([&] { nn::RMSNorm(2).forward(integers); }, {"RMSNorm", "i64 [2, 2]"});
  check_throws<ArgumentError>([&] { nn::LayerNorm(2).forward(Tensor()); }, {"LayerNorm", "undefined"});
}

TEST_CASE("modules: a module that would contain itself is refused, so no walk over the tree recurses forever") {
  auto s = std::make_shared<nn::Sequential>();
  check_throws<ArgumentError>([&] { s->push_back(s); }, {"register_module", "own submodule"});
  auto a = std::make_shared<nn::Sequential>(), b = std::make_shared<nn::Sequential>();
  a->push_back(b);
  check_throws<ArgumentError>([&] { b->push_back(a); }, {"register_module", "'0'"});
  const auto shared = std::make_shared<nn::Linear>(2, 2);
  b->push_back(shared);
  a->push_back(shared);  // one submodule under two parents is no cycle
  CHECK(a->parameters().size() == 2);
  CHECK(a->forward(ones({1, 2})).shape() == Shape{1, 2});
}

TEST_CASE("modules: a parameter or submodule name used twice, or empty, is refused where it is registered") {
  // Accepted, two children of one name gave named_parameters() two 'c.weight', refused only by a
  // later save_checkpoint.
  struct Twice : nn::Module {
    explicit Twice(int what) {
      register_module("c", std::make_shared<nn::Linear>(2, 2));
      if (what == 0) register_module("c", std::make_shared<nn::Linear>(2, 2));
      if (what == 1) register_parameter("c", &p);
      if (what == 2) register_module("", std::make_shared<nn::Linear>(2, 2));
      // Through a dot: a parameter "c.weight" beside the submodule "c" (which holds "weight").
      if (what == 4) register_parameter("c.weight", &p);
      if (what == 5) register_module("c.x", std::make_shared<nn::Linear>(2, 2));
    }
    nn::Param p{ones({2})};
  };
  check_throws<ArgumentError>([] { Twice t(0); }, {"register_module", "submodule named 'c' exists already"});
  check_throws<ArgumentError>([] { Twice t(1); }, {"register_parameter", "submodule named 'c' exists already"});
  check_throws<ArgumentError>([] { Twice t(2); }, {"register_module", "name is empty"});
  check_throws<ArgumentError>([] { Twice t(4); }, {"register_parameter", "'c.weight' collides with the submodule 'c'"});
  check_throws<ArgumentError>([] { Twice t(5); }, {"register_module", "'c.x' collides with the submodule 'c'"});
  CHECK(Twice(3).named_parameters().size() == 2);
}

TEST_CASE("layers refuse integer and bool inputs, and undefined ones by their own name") {
  // Linear cast an i64 or bool input to its weights' dtype without a word (PyTorch refuses).
  nn::Linear linear(4, 3);
  for (DType dtype : {DType::i64, DType::boolean}) {
    CAPTURE(dtype_name(dtype));
    const Tensor x = zeros({1, 4}, Options(dtype));
    check_throws<DTypeError>([&] { (void)linear.forward(x); },
                             {"Linear", "floating-point input", std::string(dtype_name(dtype))});
    check_throws<DTypeError>([&] { (void)linear.forward_gelu(x); }, {"Linear", "floating-point input"});
  }
  // The seed-style sharded layers check as the dense ones, before their gathers (FullyShardedLinear
  // computed on i64 token ids cast to f32; an undefined input was named "dtype").
  LocalCommunicator comm;
  const auto sharded = nn::FullyShardedLinear::from_full(linear, 0, 1);
  for (DType dtype : {DType::i64, DType::boolean}) {
    check_throws<DTypeError>(
        [&] {
          (void)sharded->forward(zeros({1, 4}, Options(dtype)), comm);
        },
        {"FullyShardedLinear", "floating-point input", std::string(dtype_name(dtype))});
  }
  check_throws<ArgumentError>([&] { (void)sharded->forward(Tensor(), comm); }, {"FullyShardedLinear", "undefined"});
  const auto table = nn::FullyShardedEmbedding::from_full(nn::Embedding(5, 2), 0, 1);
  check_throws<ArgumentError>([&] { (void)table->forward(Tensor(), comm); }, {"FullyShardedEmbedding", "undefined"});
  nn::CausalSelfAttention attention(8, 2);
  check_throws<ArgumentError>([&] { (void)attention.forward(Tensor()); }, {"CausalSelfAttention", "undefined"});
  nn::GPT gpt({.vocabulary = 11, .context = 4, .d_model = 8, .layers = 1, .heads = 2});
  check_throws<ArgumentError>([&] { (void)gpt.forward(Tensor()); }, {"GPT", "undefined"});
}

TEST_CASE("greedy sampling refuses NaN logits (argmax returned the NaN's byte)") {
  struct NanAt65 : nn::UnaryModule {
    Tensor forward(const Tensor& tokens) override {
      std::vector<double> logits(static_cast<std::size_t>(tokens.size(1) * 256), 0.0);
      for (std::int64_t t = 0; t < tokens.size(1); ++t) logits[static_cast<std::size_t>(t * 256 + 65)] = std::nan("");
      return from_vector(logits, {1, tokens.size(1), 256}, Options(DType::f32));
    }
  } model;
  check_throws<ArgumentError>([&] { (void)nn::sample_bytes(model, "ab", 3, 8, 0.0, 1); }, {"sample_bytes", "NaN"});
  check_throws<ArgumentError>([&] { (void)nn::sample_bytes(model, "ab", 3, 8, 1e-31, 1); }, {"temperature 1e-31"});
}

TEST_CASE("memory planners: a world or a batch that is not positive is refused, and no product overflows") {
  const auto layer = std::make_shared<nn::Linear>(4, 3);
  const nn::StepProbe probe{100, 10};
  check_throws<ArgumentError>([&] { nn::plan_state(*layer, 1, 0); }, {"plan_state", "global batch must be positive"});
  check_throws<ArgumentError>([&] { nn::plan_memory(*layer, 2, -4, probe); }, {"plan_state", "-4"});
  check_throws<ArgumentError>([&] { nn::largest_fitting_batch(*layer, 0, 8, probe, 1000); },
                              {"largest_fitting_batch", "world size must be positive, got 0"});
  check_throws<ArgumentError>([&] { nn::largest_fitting_batch(*layer, -3, 8, probe, 1000); },
                              {"largest_fitting_batch", "-3"});
  check_throws<ArgumentError>([&] { nn::smallest_fitting_world(*layer, 0, std::nullopt, 1000); },
                              {"smallest_fitting_world", "global batch"});
  check_throws<ArgumentError>([&] { nn::smallest_fitting_world(*layer, 8, std::nullopt, 1000, {}, 0); },
                              {"smallest_fitting_world", "world size"});
  // A batch the world does not divide was planned for global / world rounded down; a compute
  // dtype fully_shard refuses was planned for. (A probe's fixed part may be negative: it is a
  // line fitted through two measured steps.)
  check_throws<ArgumentError>([&] { nn::plan_state(*layer, 3, 8); }, {"plan_state", "8 does not divide over 3"});
  check_throws<DTypeError>([&] { nn::plan_state(*layer, 1, 8, {.compute_dtype = DType::i64}); },
                           {"plan_state", "compute dtype i64"});
  // No world past the batch divides it: INT_MAX worlds end at the batch (++world overflowed, forever).
  CHECK(nn::smallest_fitting_world(*layer, 8, std::nullopt, 1, {}, std::numeric_limits<int>::max()) == 0);
  auto step = [&](std::int64_t b) { return sum(layer->forward(ones({b, 4}))); };
  LocalCommunicator one;
  check_throws<ArgumentError>([&] { nn::fit_schedule(*layer, one, 0, step, 0, {}, {}); }, {"fit_schedule", "batch"});
  // An empty step function: refused by name (std::bad_function_call from inside, before).
  const std::function<Tensor(std::int64_t)> no_step;
  check_throws<ArgumentError>([&] { nn::probe_step(*layer, one, no_step, 2); }, {"probe_step", "step function"});
  check_throws<ArgumentError>([&] { nn::plan_memory(*layer, one, 8, no_step, 0); }, {"plan_memory", "step function"});
  check_throws<ArgumentError>([&] { nn::fit_schedule(*layer, one, 8, no_step, 0, {}, {}); },
                              {"fit_schedule", "step function"});
  // The largest allowed doubling stops where the micro-batches stop dividing the batch (it used to
  // double until the count wrapped to 0 and divided by it).
  nn::FitOptions most;
  most.max_micro_batches = INT64_MAX;
  const nn::FittedSchedule fit = nn::fit_schedule(*layer, one, 8, step, 0, {}, most);
  CHECK(fit.fits);
  // micro_batches x world overflowing int64 does not divide the batch (it wrapped to 0, then % 0).
  run_ranks(4, [&](Communicator& comm) {
    const auto local = std::make_shared<nn::Linear>(4, 3);
    auto local_step = [&](std::int64_t b) { return sum(local->forward(ones({b, 4}))); };
    check_throws<ArgumentError>(
        [&] { nn::fit_schedule(*local, comm, 64, local_step, 0, {.micro_batches = std::int64_t{1} << 62}, {}); },
        {"fit_schedule", "do not divide"});
  });
}

TEST_CASE("norm layers check eps when made and the input's features when run") {
  for (double eps : {-1.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    CAPTURE(eps);
    check_throws<ArgumentError>([&] { nn::LayerNorm(8, eps); }, {"LayerNorm", "eps must be finite"});
    check_throws<ArgumentError>([&] { nn::RMSNorm(8, eps); }, {"RMSNorm", "eps must be finite"});
    check_throws<ArgumentError>([&] { layer_norm(ones({2, 8}), Tensor(), Tensor(), eps); }, {"layer_norm", "eps"});
  }
  nn::LayerNorm plain(8, 1e-5, false);
  nn::RMSNorm rms(8);
  // [2, 1] broadcast against RMSNorm's [8] weight into a [2, 8] result.
  check_throws<ShapeError>([&] { rms.forward(ones({2, 1})); }, {"RMSNorm", "[2, 1]", "8 features"});
  check_throws<ShapeError>([&] { plain.forward(ones({2, 3})); }, {"LayerNorm", "[2, 3]", "8 features"});
  check_throws<ShapeError>([&] { plain.forward(scalar(1.0)); }, {"LayerNorm"});
  CHECK(rms.forward(ones({2, 8})).shape() == Shape{2, 8});
}

TEST_CASE("optimizers, schedules and sampling refuse counts, rates and temperatures that would give NaN or overflow") {
  nn::Linear layer(2, 2);
  nn::Adam adam(layer.parameters(), {.lr = 1e-3});
  check_throws<ArgumentError>([&] { adam.set_steps(-1); }, {"set_steps", "-1"});
  check_throws<ArgumentError>([&] { adam.set_steps(INT64_MAX); }, {"set_steps"});
  adam.set_steps(5);
  CHECK(adam.steps() == 5);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  check_throws<ArgumentError>([&] { nn::schedules::cosine(1e-3, 1000, 0, -1e-3); }, {"schedules::cosine", "min_lr"});
  check_throws<ArgumentError>([&] { nn::schedules::linear_warmup(nan, 10); }, {"schedules::linear_warmup", "lr"});
  check_throws<ArgumentError>([&] { nn::schedules::constant(-1); }, {"schedules::constant"});
  CHECK(nn::schedules::cosine(1e-3, 10)(10) == doctest::Approx(0.0));
  // A negative step gave a negative warm-up rate; cosine over no steps, or decaying upwards.
  check_throws<ArgumentError>([] { nn::schedules::linear_warmup(1e-3, 5)(INT64_MIN); },
                              {"schedules::linear_warmup", "step must not be negative"});
  check_throws<ArgumentError>([] { nn::schedules::cosine(1e-3, 10)(-1); }, {"schedules::cosine", "step"});
  check_throws<ArgumentError>([] { nn::schedules::constant(1e-3)(-1); }, {"schedules::constant", "step"});
  CHECK(nn::schedules::constant(1e-3)(0) == 1e-3);
  check_throws<ArgumentError>([] { nn::schedules::linear_warmup(1e-3, -2); }, {"warmup_steps", "-2"});
  for (const std::int64_t total : {std::int64_t{0}, std::int64_t{-3}}) {
    check_throws<ArgumentError>([&] { nn::schedules::cosine(1e-3, total); }, {"schedules::cosine", "total_steps"});
  }
  check_throws<ArgumentError>([] { nn::schedules::cosine(1e-3, 10, -1); }, {"schedules::cosine", "warmup_steps"});
  check_throws<ArgumentError>([] { nn::schedules::cosine(1e-3, 10, 0, 1e-2); }, {"schedules::cosine", "above lr"});

  nn::manual_seed(1);
  nn::GPT gpt({.vocabulary = 256, .context = 8, .d_model = 8, .layers = 1, .heads = 2});
  gpt.eval();
  for (double t : {nan, 1e-40, std::numeric_limits<double>::infinity()}) {
    CAPTURE(t);
    check_throws<ArgumentError>([&] { nn::sample_bytes(gpt, "ab", 2, 8, t, 1); }, {"sample_bytes", "temperature"});
  }
  check_throws<ArgumentError>([&] { nn::sample_bytes(gpt, "ab", -1, 8, 0.0, 1); }, {"sample_bytes", "count -1"});
  CHECK(nn::sample_bytes(gpt, "ab", 3, 8, 0.7, 1).size() == 3);
}

TEST_CASE("GPT checks its whole configuration, naming the field, before building a layer") {
  check_throws<ArgumentError>([] { nn::GPT({.d_model = 0}); }, {"GPT", "d_model must be positive, got 0"});
  check_throws<ArgumentError>([] { nn::GPT({.heads = -2}); }, {"GPT", "heads must be positive"});
  check_throws<ArgumentError>([] { nn::GPT({.d_model = 10, .heads = 4}); }, {"GPT", "not a multiple of heads 4"});
  check_throws<ArgumentError>([] { nn::GPT({.layers = -1}); }, {"GPT", "layers must be >= 0"});
  check_throws<ArgumentError>([] { nn::GPT({.dropout = 1.0}); }, {"GPT", "dropout"});
  {
    nn::DeferredInit deferred;  // nothing is allocated: only the sizes' arithmetic is at stake
    check_throws<ShapeError>(
        [] { nn::GPT({.vocabulary = 2, .d_model = std::int64_t{1} << 61, .layers = 1, .heads = 1}); },
        {"GPT", "overflow"});
    check_throws<ShapeError>([] { nn::CausalSelfAttention(std::int64_t{1} << 62, 1); },
                             {"CausalSelfAttention", "3 * d_model overflows"});
  }
  // Each block's parameters fit, the whole model not: refused before the first block, not built
  // block by block until the system runs out of memory; deferred, its modules alone do not fit.
  check_throws<OutOfMemoryError>(
      [] { nn::GPT({.vocabulary = 4, .context = 4, .d_model = 4, .layers = 1LL << 40, .heads = 1}); },
      {"GPT", "1099511627776 layers", "f32 parameters", "DeferredInit"});
  check_throws<OutOfMemoryError>([] { nn::GPT({.d_model = 1 << 14, .layers = 1 << 16, .heads = 1}); }, {"GPT"});
  {
    nn::DeferredInit deferred;
    check_throws<OutOfMemoryError>(
        [] { nn::GPT({.vocabulary = 4, .context = 4, .d_model = 4, .layers = 1LL << 50, .heads = 1}); },
        {"GPT", "for their modules alone"});
    check_throws<ShapeError>([] { nn::GPT({.d_model = 1LL << 30, .layers = 1LL << 20, .heads = 1}); },
                             {"GPT", "more than int64 counts"});
  }
}

TEST_CASE("text: ranges and contexts whose sums would overflow are refused, before anything is allocated") {
  test::TempDir dir;
  const std::string path = dir.str() + "/text.txt";
  std::ofstream(path) << "hello, world: a few bytes of text for windows";
  const nn::TextCorpus corpus(path);
  std::vector<std::uint8_t> buffer(8);
  check_throws<IndexError>([&] { corpus.read(1, INT64_MAX, buffer.data()); }, {"TextCorpus::read", "outside"});
  check_throws<IndexError>([&] { corpus.read(0, std::int64_t{1} << 50); }, {"TextCorpus::read", "outside"});
  CHECK(corpus.read(0, 5).size() == 5);
  check_throws<ArgumentError>([&] { nn::TextWindows(corpus, 0, corpus.size(), INT64_MAX); },
                              {"TextWindows", "too few"});
  // A batch whose token count overflows is named by the call (it read "empty: shape [...] overflows").
  nn::TextWindows windows(corpus, 0, corpus.size(), 2);
  check_throws<ShapeError>([&] { windows.batch(0, 0, std::int64_t{1} << 62, 0, 1); },
                           {"TextWindows::batch", "4611686018427387904 windows"});
}

TEST_CASE("initializers and SGD refuse values that give NaN weights or an update uphill") {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  check_throws<ArgumentError>([&] { nn::init::normal(nan, 1); }, {"init::normal", "mean"});
  check_throws<ArgumentError>([&] { nn::init::normal(0, inf); }, {"init::normal", "standard deviation"});
  check_throws<ArgumentError>([&] { nn::init::uniform(-inf, inf); }, {"init::uniform", "finite"});
  check_throws<ArgumentError>([&] { nn::init::constant(nan); }, {"init::constant", "NaN"});
  // An i64 tensor made by index takes values as from_values does: no NaN made 0, no saturation.
  for (const double bad : {nan, inf, 1e19}) {
    CAPTURE(bad);
    const auto init = nn::init::by_index([bad](std::int64_t i) { return i == 1 ? bad : 2.0; });
    check_throws<DTypeError>([&] { (void)init.make({3}, DType::i64); },
                             {"init::by_index", "element 1", "not an i64 value", "[3]"});
  }
  CHECK(nn::init::by_index([](std::int64_t i) { return 2.5 * static_cast<double>(i); })
            .make({3}, DType::i64)
            .to_vector<std::int64_t>() == std::vector<std::int64_t>{0, 2, 5});  // fractions truncate
  nn::Linear layer(2, 2);
  check_throws<ArgumentError>([&] { nn::SGD(layer.parameters(), {.lr = 0.1, .momentum = 0.9, .dampening = 1.5}); },
                              {"SGD", "dampening must be <= 1"});
}

namespace {
struct TwoParams : nn::Module {
  nn::Param a, b;
  TwoParams(nn::Param first, nn::Param second) : a(std::move(first)), b(std::move(second)) {
    register_parameter("a", &a);
    register_parameter("b", &b);
  }
};
}  // namespace

TEST_CASE("sharding: a refused fully_shard changes no parameter; gathers and int8 buckets check their dtypes") {
  // b's empty extent is refused after a was checked: a used to be sliced in place by then, so the
  // module could neither be sharded again ("sharded already") nor used whole (each rank kept half).
  for (const bool group : {false, true}) {
    CAPTURE(group);
    run_ranks(2, [&](Communicator& comm) {
      TwoParams m(nn::Param(arange(0, 16, 1).reshape({4, 4})), nn::Param(zeros({0})));
      check_throws<nn::ShardingError>([&] { nn::fully_shard(m, comm, nn::FullyShardOptions{.group = group}); },
                                      {"fully_shard", "every logical extent must be positive"});
      CHECK_FALSE(m.a.is_sharded());
      CHECK(m.a.data().shape() == Shape{4, 4});
      CHECK(m.a.data().to_vector<float>() == arange(0, 16, 1).to_vector<float>());
      CHECK(m.a.data().requires_grad());
    });
  }
  // The gather's own compute dtype is checked as fully_shard's policy is (i64 truncated the weights).
  LocalCommunicator one;
  TwoParams s(nn::Param(full({4}, 2.5)), nn::Param(ones({2})));
  nn::fully_shard(s, one);
  check_throws<DTypeError>([&] { (void)nn::gather_param(s.a, one, DType::i64); },
                           {"gather", "the compute dtype must be a float, got i64"});
  check_throws<DTypeError>([&] { (void)nn::gather_param(s.a, one, static_cast<DType>(77)); },
                           {"gather", "not a valid compute dtype: 77"});
  // A module with no replicated parameter makes no broadcast, which checked the root before.
  check_throws<ArgumentError>([&] { nn::broadcast_replicated(s, one, 3); },
                              {"broadcast_replicated", "root 3 is outside a world of 1"});
  // An int8 bucket of parameters stored in different float dtypes (one compute dtype): concat
  // refused the mixed parts ("dtypes differ"); they quantize from f32 like any other.
  run_ranks(2, [](Communicator& comm) {
    TwoParams m(nn::Param(arange(0, 16, 1).reshape({4, 4}) * 0.25),
                nn::Param(from_vector<double>({1.5, -2.0, 0.5}, {3})));
    nn::FullyShardOptions options{.group = true};
    options.policy.compute_dtype = DType::f32;
    options.policy.gather_quantization = nn::GatherQuantization::int8;
    nn::fully_shard(m, comm, options);
    autograd::NoGradGuard no_grad;
    const Tensor a = m.a.value(), b = m.b.value();
    CHECK(a.dtype() == DType::f32);
    CHECK(b.dtype() == DType::f32);
    // Within half a step of each rank's part (largest |value| 2 and 3.75, / 127 / 2).
    CHECK_CLOSE(a, arange(0, 16, 1).reshape({4, 4}) * 0.25, 0.015, 0);
    CHECK_CLOSE(b, from_vector<float>({1.5f, -2.0f, 0.5f}, {3}), 0.015, 0);
  });
  // A block holding +-FLT_MAX: its scale rounded so that 127 * scale was inf, and the largest
  // finite weights came back infinite.
  const float largest = std::numeric_limits<float>::max();
  const nn::Int8Blocks extreme = nn::quantize_int8(from_vector<float>({largest, -largest, 1.0f}, {3}));
  const std::vector<float> back = nn::dequantize_int8(extreme, DType::f32).to_vector<float>();
  CHECK(std::isfinite(back[0]));
  CHECK(back[0] > 0.999f * largest);
  CHECK(back[1] == -back[0]);
  CHECK(back[2] == 0.0f);
}

TEST_CASE("memory planners: the largest fitting batch is the largest; negative options and overflowing probes") {
  const auto layer = std::make_shared<nn::Linear>(4, 3);
  const nn::StepProbe probe{100, 10};
  // It started at batch - world and skipped what the world does not divide: (4, 10) gave 0, not 8;
  // near INT64_MAX it walked down by the world size for ever.
  CHECK(nn::largest_fitting_batch(*layer, 4, 10, probe, 0) == 8);
  CHECK(nn::largest_fitting_batch(*layer, 2, (std::int64_t{1} << 31) + 1, probe, 0) == std::int64_t{1} << 31);
  CHECK(nn::largest_fitting_batch(*layer, 3, INT64_MAX, probe, 0) == (INT64_MAX - 1) / 3 * 3);
  CHECK(nn::largest_fitting_batch(*layer, 4, 4, probe, 0) == 0);  // none below the batch
  const std::int64_t limit = nn::plan_memory(*layer, 2, 40, probe).peak();
  CHECK(nn::plan_memory(*layer, 2, 42, probe).peak() > limit);
  CHECK(nn::largest_fitting_batch(*layer, 2, 100, probe, limit) == 40);
  CHECK(nn::largest_fitting_batch(*layer, 2, INT64_MAX, probe, limit) == 40);  // its step overflows: does not fit
  CHECK(nn::largest_fitting_batch(*layer, 2, 100, probe, 1) == 0);
  // A negative limit read as none, so everything "fit" it.
  check_throws<ArgumentError>([&] { nn::largest_fitting_batch(*layer, 2, 100, probe, -1); },
                              {"largest_fitting_batch", "memory limit", "-1"});
  check_throws<ArgumentError>([&] { nn::smallest_fitting_world(*layer, 8, probe, -1); },
                              {"smallest_fitting_world", "memory limit", "-1"});
  check_throws<ArgumentError>([&] { (void)nn::plan_memory(*layer, 2, 8, probe).table(-5); },
                              {"MemoryPlan::table", "-5"});
  {
    LocalCommunicator comm;
    const auto step = [&](std::int64_t samples) { return sum(layer->forward(ones({samples, 4}))); };
    check_throws<ArgumentError>([&] { nn::plan_memory(*layer, comm, 2, step, -1); }, {"plan_memory", "-1"});
    check_throws<ArgumentError>([&] { nn::fit_schedule(*layer, comm, 2, step, -1, {}); }, {"fit_schedule", "-1"});
    nn::FitOptions none;
    none.max_micro_batches = 0;
    check_throws<ArgumentError>([&] { nn::fit_schedule(*layer, comm, 2, step, 0, {}, none); },
                                {"fit_schedule", "max_micro_batches", "0"});
  }
  check_throws<ArgumentError>([&] { nn::plan_state(*layer, 2, 8, {.optimizer_states = -5}); },
                              {"plan_state", "optimizer_states must not be negative, got -5"});
  check_throws<ArgumentError>([&] { nn::plan_state(*layer, 2, 8, {.shard_ranks = -7}); },
                              {"plan_state", "shard_ranks", "-7"});
  // A probe's product saturates (it wrapped: {0, 2^40} at 2^40 samples planned a step of 0 bytes).
  CHECK(nn::StepProbe{0, std::int64_t{1} << 40}.at(std::int64_t{1} << 40) == INT64_MAX);
  CHECK(nn::plan_memory(*layer, 1, std::int64_t{1} << 40, nn::StepProbe{0, std::int64_t{1} << 40}).peak() == INT64_MAX);
}

TEST_CASE("samplers, shard layouts and int8 blocks: no read before the data, no division by 0, no wrapped sums") {
  nn::BatchSampler sampler(100, 10, 0, 1, 0);
  // -1 was the "nothing cached" mark: indices(-1, 0) read an order that was never made.
  check_throws<IndexError>([&] { sampler.indices(-1, 0); }, {"BatchSampler", "epoch -1"});
  CHECK(sampler.indices(INT64_MAX, 0).shape() == Shape{10});  // epoch + 1 no longer overflows
  nn::BatchSampler huge(std::int64_t{1} << 62, 2, 0, 1, 0);
  check_throws<OutOfMemoryError>([&] { huge.indices(0, 0); }, {"BatchSampler", "out of memory"});
  check_throws<nn::ShardingError>([] { nn::ShardInfo::layout({4, 3}, 0, 0); }, {"ShardInfo::layout", "world size"});
  check_throws<nn::ShardingError>([] { nn::ShardInfo::layout({4, 3}, 2, 2); }, {"ShardInfo::layout", "rank 2"});
  CHECK(nn::ShardInfo::layout({INT64_MAX}, 0, 2).shard_size == INT64_MAX / 2 + 1);
  const Tensor x = randn({5}, 1);
  const nn::Int8Blocks blocks = nn::quantize_int8(x, INT64_MAX);  // one block (n + block - 1 wrapped)
  CHECK(blocks.scales.size() == 1);
  CHECK_CLOSE(nn::dequantize_int8(blocks, DType::f32, INT64_MAX), x, 0.02, 0.02);
}

TEST_CASE("losses: integer log-probabilities refused, ignore_index exact past 2^53, f16 means past 65504") {
  const Tensor int_log_probs = from_vector<std::int64_t>({-3, 0, -2, 0}, {2, 2});
  check_throws<DTypeError>(
      [&] {
        (void)nn::nll_loss(int_log_probs, from_vector<std::int64_t>({0, 0}, {2}));
      },
      {"nll_loss", "floating point", "i64"});
  // ignore_index compared as an i64: INT64_MAX is a valid choice, and 2^53 + 1 masks exactly that target.
  const Tensor logits = randn({3, 4}, 1);
  const Tensor targets = from_vector<std::int64_t>({1, 2, 3}, {3});
  const double all = nn::cross_entropy(logits, targets).item();
  CHECK(nn::cross_entropy(logits, targets, {.ignore_index = std::numeric_limits<std::int64_t>::max()}).item() == all);
  const std::int64_t odd = (std::int64_t{1} << 53) + 1;
  const Tensor with_ignored = from_vector<std::int64_t>({1, odd, 3}, {3});
  const double two = nn::cross_entropy(logits, with_ignored, {.ignore_index = odd}).item();
  const double want = nn::cross_entropy(logits, from_vector<std::int64_t>({1, 0, 3}, {3}), {.ignore_index = 0}).item();
  CHECK(two == doctest::Approx(want));
  CHECK(nn::counted_targets(with_ignored, odd) == 2);
  CHECK(nn::counted_targets(with_ignored, odd - 1) == 3);
  // f16 losses averaged over more than 65504 values.
  const Tensor a = full({300, 300}, 1.5, Options(DType::f16)), b = full({300, 300}, 1.0, Options(DType::f16));
  CHECK(nn::mse_loss(a, b).item() == 0.25);
  const Tensor f16_logits = zeros({70000, 2}, Options(DType::f16));
  const double ce = nn::cross_entropy(f16_logits, zeros({70000}, Options(DType::i64))).item();
  CHECK(ce == doctest::Approx(std::log(2.0)).epsilon(1e-3));
  // Label smoothing's mean over 70000 classes of f16 log-probabilities (their f16 sum is -inf).
  const Tensor log_probs = full({2, 70000}, -10.0, Options(DType::f16));
  const double smoothed = nn::nll_loss(log_probs, zeros({2}, Options(DType::i64)), {.label_smoothing = 0.1}).item();
  CHECK(smoothed == doctest::Approx(10.0).epsilon(1e-2));
}

TEST_CASE("an undefined or invalid argument is named by the call it was given to, not by an accessor inside") {
  const Tensor none;
  nn::Linear linear(2, 3);
  check_throws<ArgumentError>([&] { linear.forward(none); }, {"Linear", "input tensor is undefined"});
  check_throws<ArgumentError>([&] { nn::Dropout(0.5).forward(none); }, {"Dropout", "undefined"});
  check_throws<ArgumentError>([&] { nn::checkpoint(linear, none); }, {"checkpoint", "undefined"});
  LocalCommunicator comm;  // (an undefined Param was "not sharded")
  check_throws<ArgumentError>([&] { nn::gather_param(nn::Param(), comm); }, {"gather", "undefined"});
  check_throws<ArgumentError>([&] { nn::take_rows(none, from_vector<std::int64_t>({0}, {1})); },
                              {"take_rows", "data tensor is undefined"});
  check_throws<IndexError>(
      [&] {
        nn::take_rows(ones({2, 2}), from_vector<std::int64_t>({5}, {1}));
      },
      {"take_rows", "5"});
  test::TempDir dir;
  check_throws<ArgumentError>(
      [&] {
        safetensors::write(dir.str() + "/a.safetensors", {{"a", none}});
      },
      {"safetensors::write", "a.safetensors", "'a' is undefined"});
  check_throws<DTypeError>([] { nn::Linear(2, 3, {.dtype = static_cast<DType>(77)}); }, {"Param", "dtype", "77"});
  check_throws<DTypeError>([] { nn::dequantize_int8(nn::quantize_int8(ones({4})), static_cast<DType>(55)); },
                           {"dequantize_int8", "dtype", "55"});
  check_throws<ArgumentError>([] { nn::clip_grad_norm({nn::Param()}, 1.0); },
                              {"clip_grad_norm", "parameter 0 of 1 is undefined"});
  check_throws<ArgumentError>([] { nn::grad_norm({nn::Param()}); }, {"grad_norm", "undefined"});
  nn::Adam adam(linear.parameters(), {.lr = 1e-3});
  check_throws<ArgumentError>([&] { adam.state(nn::Param()); }, {"Adam::state", "undefined"});
}

TEST_CASE("a communicator destroyed while its sharded model is used: a ShardingError, not a read of freed memory") {
  auto layer = std::make_shared<nn::Linear>(4, 3);
  {
    LocalCommunicator gone;
    nn::fully_shard(*layer, gone);
    CHECK(layer->forward(ones({2, 4})).shape() == Shape{2, 3});
  }
  // (It read the freed communicator: "all_gather: negative extent [-10455540544]" or worse.)
  check_throws<nn::ShardingError>([&] { layer->forward(ones({2, 4})); }, {"Param::value", "destroyed"});
  check_throws<nn::ShardingError>([&] { nn::grad_norm(layer->parameters()); }, {"grad_norm", "destroyed"});
}

TEST_CASE("a communicator or ShardMesh destroyed between forward and backward: a ShardingError, not a segfault") {
  // The shard groups and their gradient sinks held the communicators by address: a backward after
  // the mesh (which owns the node and cross-node communicators) was gone reduce-scattered through
  // freed memory (a segfault).
  EmulatedOptions two_nodes;
  two_nodes.ranks_per_node = 2;
  std::atomic<int> refused{0};
  run_ranks(
      4,
      [&](Communicator& comm) {
        auto model = std::make_shared<nn::Sequential>();
        model->push_back(std::make_shared<nn::Linear>(8, 16));
        model->push_back(std::make_shared<nn::Linear>(16, 4));
        Tensor y;
        {
          ShardMesh mesh = ShardMesh::by_node(comm);
          nn::fully_shard(*model, mesh);
          y = model->forward(ones({2, 8}));
        }
        check_throws<nn::ShardingError>([&] { sum(y).backward(); }, {"backward", "group", "destroyed", "ShardMesh"});
        check_throws<nn::ShardingError>([&] { model->forward(ones({2, 8})); }, {"destroyed"});
        ++refused;
      },
      two_nodes);
  CHECK(refused == 4);
  // Full sharding over a communicator the caller destroys (a split of the world).
  run_ranks(2, [&](Communicator& comm) {
    auto layer = std::make_shared<nn::Linear>(8, 4);
    Tensor y;
    {
      std::unique_ptr<Communicator> part = comm.split(0, comm.rank());
      nn::fully_shard(*layer, *part);
      y = layer->forward(ones({2, 8}));
    }
    check_throws<nn::ShardingError>([&] { sum(y).backward(); }, {"backward", "destroyed"});
  });
}
