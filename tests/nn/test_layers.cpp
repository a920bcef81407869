// Layers, modules and losses: values against hand-derived results, gradients against finite
// differences (f64), and the module contract (names, tying, modes).
#include <cmath>

#include "helpers.h"

using namespace ruda;
using test::values;

namespace {
// Gives every parameter of a module f64 storage, for gradient checks.
void to_f64(nn::Module& m) {
  for (auto& p : m.parameters()) p.set_data(p.data().to(DType::f64));
}

// Gradient check of a module's output with respect to its input and every parameter: the
// parameters' leaves are passed as inputs, and a shifted value is written into the leaf.
void check_module_gradients(nn::UnaryModule& m, const Tensor& input) {
  const auto params = m.parameters();
  std::vector<Tensor> inputs = {input};
  for (const auto& p : params) inputs.push_back(p.data());
  const auto r = gradcheck(
      [&](const std::vector<Tensor>& in) {
        std::vector<Tensor> saved;
        autograd::NoGradGuard guard_outer;
        for (std::size_t i = 0; i < params.size(); ++i) {
          if (in[i + 1].shares_storage(params[i].data())) continue;
          saved.push_back(params[i].data().clone());
          params[i].data().copy_(in[i + 1]);
        }
        autograd::set_grad_enabled(true);
        Tensor out = m.forward(in[0]);
        autograd::set_grad_enabled(false);
        std::size_t k = 0;
        for (std::size_t i = 0; i < params.size(); ++i) {
          if (!in[i + 1].shares_storage(params[i].data())) params[i].data().copy_(saved[k++]);
        }
        return out;
      },
      inputs);
  CHECK_MESSAGE(r.ok, r.message);
}
}  // namespace

TEST_CASE("Linear: x @ W + b with [in, out] weights, PyTorch's default init, seeded") {
  nn::manual_seed(1);
  nn::Linear a(4, 3);
  nn::manual_seed(1);
  nn::Linear b(4, 3);
  CHECK(a.weight.data().shape() == Shape{4, 3});
  CHECK(a.bias.data().shape() == Shape{3});
  CHECK(a.weight.data().to_vector<float>() == b.weight.data().to_vector<float>());
  CHECK(a.weight.id() != b.weight.id());
  for (float w : a.weight.data().to_vector<float>()) CHECK(std::abs(w) <= 0.5f);  // 1/sqrt(4)
  const Tensor x = randn({2, 5, 4}, 3);
  CHECK_CLOSE(a.forward(x), matmul(x, a.weight.data()) + a.bias.data(), 1e-6, 1e-6);
  nn::Linear no_bias(4, 3, {.bias = false});
  CHECK_FALSE(no_bias.bias.defined());
  CHECK(no_bias.named_parameters().size() == 1);
  to_f64(a);
  check_module_gradients(a, randn({3, 4}, 4, 0, DType::f64).set_requires_grad());
}

TEST_CASE("Embedding, LayerNorm, RMSNorm values and gradients") {
  nn::manual_seed(2);
  nn::Embedding e(50, 40, {.std = 0.02});
  const auto w = e.weight.data().to_vector<double>();
  double sq = 0;
  for (double v : w) sq += v * v;
  CHECK(std::sqrt(sq / w.size()) == doctest::Approx(0.02).epsilon(0.1));
  const Tensor rows = e.forward(values({49, 0}, {2}, DType::i64));
  CHECK_CLOSE(rows.slice(0, 0, 1).reshape({40}), e.weight.data().slice(0, 49, 50).reshape({40}), 0, 0);

  nn::LayerNorm ln(3);
  const double s = std::sqrt(2.0 / 3.0 + 1e-5);
  CHECK_CLOSE(ln.forward(values({1, 2, 3, 2, 2, 2}, {2, 3})), {-1 / s, 0, 1 / s, 0, 0, 0}, {2, 3}, 1e-5, 1e-5);
  nn::RMSNorm rms(3);
  const double r = std::sqrt(14.0 / 3.0 + 1e-6);
  CHECK_CLOSE(rms.forward(values({1, 2, 3}, {1, 3})), {1 / r, 2 / r, 3 / r}, {1, 3}, 1e-5, 1e-5);
  // bf16 input: statistics in f32, result back in bf16.
  CHECK(ln.forward(values({1, 2, 3}, {3}, DType::bf16)).dtype() == DType::bf16);

  to_f64(ln);
  // Non-trivial affine parameters for the check.
  {
    autograd::NoGradGuard guard;
    ln.weight.data().copy_(values({0.5, -1.5, 2}, {3}, DType::f64));
    ln.bias.data().copy_(values({0.1, 0.2, -0.3}, {3}, DType::f64));
  }
  check_module_gradients(ln, randn({4, 3}, 5, 0, DType::f64).set_requires_grad());
  to_f64(rms);
  check_module_gradients(rms, randn({4, 3}, 6, 0, DType::f64).set_requires_grad());

  // A weight without a bias, as PyTorch's LayerNorm(3, bias=False): one parameter, y = xhat * w.
  nn::LayerNorm no_bias(3, 1e-5, true, false);
  CHECK(no_bias.named_parameters().size() == 1);
  CHECK_FALSE(no_bias.bias.defined());
  to_f64(no_bias);
  {
    autograd::NoGradGuard guard;
    no_bias.weight.data().copy_(values({0.5, -1.5, 2}, {3}, DType::f64));
  }
  CHECK_CLOSE(no_bias.forward(values({1, 2, 3}, {1, 3}, DType::f64)), {-0.5 / s, 0, 2 / s}, {1, 3}, 1e-6, 1e-6);
  check_module_gradients(no_bias, randn({4, 3}, 7, 0, DType::f64).set_requires_grad());
}

TEST_CASE("RMSNorm: rows whose squares overflow the working dtype are normalized as rows in range are") {
  // RMSNorm is scale-invariant (eps aside): row * s normalizes to what row does, and its gradient
  // is the row's divided by s. Squares of 1e20 (f32, bf16) and 1e160 (f64) overflow: such rows
  // came out 0 with a 0 gradient. A row in range shares the batch (one overflowing row moves the
  // whole batch to the rescaled form) and keeps its values.
  const std::vector<double> base = {1, -2, 3, 4, 0.5, 0.25, -1, 2};  // rows of 4
  const Tensor upstream = values({1, -1, 2, 0.5, -3, 1, 0.5, 2}, {2, 4}, DType::f64);
  for (const auto& [dtype, scale, tolerance] : std::vector<std::tuple<DType, double, double>>{
           {DType::f32, 1e20, 1e-5}, {DType::bf16, 1e20, 2e-2}, {DType::f64, 1e160, 1e-12}}) {
    CAPTURE(dtype_name(dtype));
    nn::RMSNorm rms(4, 1e-30);  // eps negligible beside either row's mean square
    auto run = [&](double s) {
      std::vector<double> v = base;
      for (std::size_t i = 0; i < 4; ++i) v[i] *= s;  // the first row scaled
      Tensor x = values(v, {2, 4}, DType::f64).to(dtype).set_requires_grad();
      const Tensor y = rms.forward(x);
      sum(y.to(DType::f64) * upstream).backward();
      return std::pair{y.to(DType::f64), x.grad().to(DType::f64)};
    };
    const auto [y, grad] = run(scale);
    const auto [y_ref, grad_ref] = run(1);
    CHECK_CLOSE(y, y_ref.to_vector<double>(), {2, 4}, tolerance, tolerance);
    CHECK_CLOSE(grad.slice(0, 0, 1) * scale, grad_ref.slice(0, 0, 1).to_vector<double>(), {1, 4}, tolerance, tolerance);
    CHECK_CLOSE(grad.slice(0, 1, 2), grad_ref.slice(0, 1, 2).to_vector<double>(), {1, 4}, tolerance, tolerance);
  }
}

TEST_CASE("activations and Dropout modes") {
  const Tensor x = values({-1, 0, 2}, {3});
  CHECK_CLOSE(nn::ReLU().forward(x), {0, 0, 2}, {3});
  CHECK_CLOSE(nn::Tanh().forward(x), {std::tanh(-1.0), 0, std::tanh(2.0)}, {3}, 1e-6, 1e-6);
  CHECK_CLOSE(nn::Sigmoid().forward(x), {1 / (1 + std::exp(1.0)), 0.5, 1 / (1 + std::exp(-2.0))}, {3}, 1e-6, 1e-6);
  CHECK_CLOSE(nn::SiLU().forward(x), {-1 / (1 + std::exp(1.0)), 0, 2 / (1 + std::exp(-2.0))}, {3}, 1e-6, 1e-6);
  CHECK_CLOSE(nn::GELU().forward(x), {-0.15865525, 0, 1.9544997}, {3}, 1e-6, 1e-5);
  nn::Dropout drop(0.5, 9);
  const Tensor ones_in = ones({1000});
  const Tensor a = drop.forward(ones_in), b = drop.forward(ones_in);
  CHECK(a.to_vector<float>() != b.to_vector<float>());  // fresh draws each call
  drop.eval();
  CHECK(drop.forward(ones_in).shares_storage(ones_in));
  // p = 1 drops everything, as PyTorch's (its gradient is 0); beyond 1 is an error.
  nn::Dropout all(1.0, 9);
  const Tensor in = values({1, -2, 3}, {3}).set_requires_grad();
  const Tensor dropped = all.forward(in);
  CHECK(dropped.to_vector<double>() == std::vector<double>{0, -0.0, 0});
  sum(dropped).backward();
  CHECK(in.grad().to_vector<double>() == std::vector<double>{0, 0, 0});
  test::check_throws<ArgumentError>([] { nn::Dropout(1.5); }, {"Dropout", "1.5"});
  test::check_throws<ArgumentError>([] { (void)dropout(ones({2}), -0.1, 1); }, {"dropout", "[0, 1]"});
}

TEST_CASE("modules: dotted names, tied parameters once, train/eval everywhere") {
  nn::manual_seed(3);
  nn::Sequential seq(
      {std::make_shared<nn::Linear>(4, 8), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(8, 2)});
  std::vector<std::string> names;
  for (auto& [name, p] : seq.named_parameters()) names.push_back(name);
  CHECK(names == std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"});
  CHECK(seq.parameter_count() == 4 * 8 + 8 + 8 * 2 + 2);
  CHECK(seq.forward(zeros({5, 4})).shape() == Shape{5, 2});

  nn::GPT tied({.vocabulary = 16, .context = 8, .d_model = 8, .layers = 2, .heads = 2, .tied_head = true});
  nn::GPT untied({.vocabulary = 16, .context = 8, .d_model = 8, .layers = 2, .heads = 2, .tied_head = false});
  CHECK(untied.parameter_count() - tied.parameter_count() == 16 * 8);
  bool has_block_weight = false;
  for (auto& [name, p] : tied.named_parameters()) has_block_weight |= name == "blocks.1.attn.qkv.weight";
  CHECK(has_block_weight);
  const Tensor logits = tied.forward(randint({3, 5}, 0, 16, 1));
  CHECK(logits.shape() == Shape{3, 5, 16});

  // A Param assigned to two places is one parameter.
  struct Pair : nn::Module {
    nn::Param a, b;
    Pair() {
      a = nn::Param(zeros({2}));
      b = a;
      register_parameter("a", &a);
      register_parameter("b", &b);
    }
  } pair;
  CHECK(pair.named_parameters().size() == 1);
  // Two different parameters that claim one id would share optimizer state: an error.
  pair.b = nn::Param(zeros({2}), pair.a.id());
  test::check_throws<ArgumentError>([&] { pair.named_parameters(); },
                                    {"named_parameters", "'a' and 'b'", "same id " + std::to_string(pair.a.id())});

  tied.eval();
  CHECK_FALSE(tied.blocks[0]->attn->is_training());
  tied.train();
  CHECK(tied.blocks[0]->mlp->is_training());
}

TEST_CASE("a layer assigned to a composite's member is what parameters, sharding and train() see, as forward") {
  // register_module kept its own copy of each child while forward read the public members: a
  // replaced layer trained, sharded and saved the old one, silently.
  nn::manual_seed(5);
  nn::MLP mlp(4, 8);
  const auto old_fc1 = mlp.fc1;
  mlp.fc1 = std::make_shared<nn::Linear>(4, 8);
  auto holds = [](const nn::Module& m, const nn::Param& p) {
    const auto params = m.parameters();
    return std::any_of(params.begin(), params.end(), [&](const nn::Param& q) { return q.same(p); });
  };
  CHECK(holds(mlp, mlp.fc1->weight));
  CHECK_FALSE(holds(mlp, old_fc1->weight));

  nn::GPT gpt({.vocabulary = 10, .context = 4, .d_model = 4, .layers = 2, .heads = 2, .tied_head = false});
  const std::int64_t block = gpt.blocks[1]->parameter_count();
  const std::int64_t all = gpt.parameter_count();
  gpt.blocks.pop_back();
  CHECK(gpt.parameter_count() == all - block);
  for (const auto& [name, p] : gpt.named_parameters()) CHECK(name.rfind("blocks.1.", 0) != 0);
  // A new head: given to an optimizer built afterwards, it trains.
  gpt.head = std::make_shared<nn::Linear>(4, 10, nn::LinearOptions{.bias = false});
  CHECK(holds(gpt, gpt.head->weight));
  nn::AdamW opt(gpt.parameters(), {.lr = 0.1});
  const Tensor before = gpt.head->weight.data().clone();
  sum(gpt.forward(randint({2, 3}, 0, 10, 1))).backward();
  opt.step();
  CHECK(max(abs(gpt.head->weight.data() - before)).item() > 0);
  // ...and it is sharded with the rest.
  LocalCommunicator comm;
  nn::fully_shard(gpt, comm);
  CHECK(gpt.head->weight.is_sharded());
  // train()/eval() reach the new block; a null member is skipped.
  gpt.blocks.push_back(std::make_shared<nn::TransformerBlock>(4, 2, 16));
  gpt.eval();
  CHECK_FALSE(gpt.blocks[1]->mlp->is_training());
  gpt.head = nullptr;
  for (const auto& [name, p] : gpt.named_parameters()) CHECK(name.rfind("head.", 0) != 0);

  // A submodule shared by two parents is listed once, under its first name (PyTorch's too).
  auto shared = std::make_shared<nn::Linear>(3, 3);
  nn::Sequential twice({shared, shared});
  const auto modules = twice.named_modules();
  REQUIRE(modules.size() == 2);
  CHECK(modules[1].first == "0");
  // A member assigned one of its ancestors: an error naming it, not a walk that never ends.
  struct Holder : nn::Module {
    std::shared_ptr<nn::Module> inner;
    Holder() { register_module("inner", &inner); }
  };
  auto outer = std::make_shared<Holder>();
  outer->inner = std::make_shared<Holder>();
  static_cast<Holder&>(*outer->inner).inner = outer;
  test::check_throws<ArgumentError>([&] { outer->parameters(); }, {"named_modules", "'inner.inner'", "ancestors"});
  static_cast<Holder&>(*outer->inner).inner = nullptr;  // (no cycle left to leak)
}

TEST_CASE("a transformer block casts a floating input of another dtype to its layers', as Linear does") {
  nn::manual_seed(6);
  nn::TransformerBlock block(4, 2, 16);
  const Tensor x = randn({2, 3, 4}, 2);
  const Tensor want = block.forward(x);
  for (DType d : {DType::f64, DType::bf16}) {
    CAPTURE(dtype_name(d));
    const Tensor y = block.forward(x.to(d));
    CHECK(y.dtype() == DType::f32);
    // (A bf16 input's LayerNorm computes in bf16.)
    CHECK(max(abs(y - block.forward(x.to(d).to(DType::f32)))).item() < (d == DType::bf16 ? 2e-2 : 1e-5));
  }
  CHECK(max(abs(block.forward(x.to(DType::f64)) - want)).item() < 1e-6);
  test::check_throws<DTypeError>([&] { block.forward(randint({2, 3, 4}, 0, 3, 1)); }, {"TransformerBlock", "i64"});
}

TEST_CASE("causal self-attention: no information flows from the future; gradients") {
  nn::manual_seed(4);
  nn::CausalSelfAttention attn(8, 2);
  const Tensor x = randn({2, 5, 8}, 1);
  const Tensor y = attn.forward(x);
  // Change the last time step: earlier outputs must not move.
  const Tensor x2 = slice_assign(x, 1, 4, 5, randn({2, 1, 8}, 2));
  const Tensor y2 = attn.forward(x2);
  CHECK_CLOSE(y2.slice(1, 0, 4), y.slice(1, 0, 4), 0, 0);
  CHECK(y2.slice(1, 4, 5).to_vector<float>() != y.slice(1, 4, 5).to_vector<float>());
  // The first step attends to itself only: softmax over one score is 1.
  const Tensor v_first = attn.qkv->forward(x).slice(2, 16, 24).slice(1, 0, 1);
  CHECK_CLOSE(y.slice(1, 0, 1), attn.proj->forward(v_first), 1e-5, 1e-5);
  to_f64(attn);
  check_module_gradients(attn, randn({1, 3, 8}, 3, 0, DType::f64).set_requires_grad());
  nn::TransformerBlock block(8, 2, 16);
  to_f64(block);
  check_module_gradients(block, randn({1, 3, 8}, 4, 0, DType::f64).set_requires_grad());
}

TEST_CASE("losses: values") {
  const Tensor a = values({1, 2, 3}, {3}), b = values({2, 2, 5}, {3});
  CHECK(nn::mse_loss(a, b).item() == doctest::Approx(5.0 / 3));
  CHECK(nn::mse_loss(a, b, nn::LossReduction::sum).item() == doctest::Approx(5));
  CHECK(nn::l1_loss(a, b).item() == doctest::Approx(1));
  CHECK_CLOSE(nn::l1_loss(a, b, nn::LossReduction::none), {1, 0, 2}, {3});

  const Tensor logits = values({1, 2, 3, 1, 1, 1}, {2, 3});
  const Tensor targets = values({2, 0}, {2}, DType::i64);
  const double lse0 = std::log(std::exp(1) + std::exp(2) + std::exp(3)), lse1 = 1 + std::log(3.0);
  const double l0 = lse0 - 3, l1 = lse1 - 1;
  CHECK(nn::cross_entropy(logits, targets).item() == doctest::Approx((l0 + l1) / 2));
  CHECK(nn::cross_entropy(logits, targets, {.reduction = nn::LossReduction::sum}).item() == doctest::Approx(l0 + l1));
  // Ignored targets count neither in the sum nor in the mean.
  CHECK(nn::cross_entropy(logits, values({2, -100}, {2}, DType::i64)).item() == doctest::Approx(l0));
  // Class weights: the mean divides by the targets' weights.
  const Tensor w = values({2, 1, 0.5}, {3});
  CHECK(nn::cross_entropy(logits, targets, {.weight = w}).item() == doctest::Approx((0.5 * l0 + 2 * l1) / 2.5));
  // Label smoothing 0.3: 0.7 * nll + 0.3 * mean over classes of -log p.
  const double smooth0 = (3 * lse0 - 6) / 3, smooth1 = lse1 - 1;
  CHECK(nn::cross_entropy(logits, targets, {.label_smoothing = 0.3}).item() ==
        doctest::Approx((0.7 * l0 + 0.3 * smooth0 + 0.7 * l1 + 0.3 * smooth1) / 2));
  // [batch, time, classes] logits with [batch, time] targets.
  CHECK(nn::cross_entropy(logits.reshape({1, 2, 3}), targets.reshape({1, 2})).item() == doctest::Approx((l0 + l1) / 2));
  CHECK(nn::nll_loss(log_softmax(logits, 1), targets).item() == doctest::Approx((l0 + l1) / 2));
  // BCE with logits: -(t log s(x) + (1 - t) log(1 - s(x))).
  const Tensor x = values({0.5, -2, 30}, {3}), t = values({1, 0, 1}, {3});
  auto bce = [](double x, double t) {
    const double s = 1 / (1 + std::exp(-x));
    return -(t * std::log(s) + (1 - t) * std::log(1 - s));
  };
  CHECK(nn::binary_cross_entropy_with_logits(x, t).item() ==
        doctest::Approx((bce(0.5, 1) + bce(-2, 0) + bce(30, 1)) / 3));
  CHECK(nn::binary_cross_entropy_with_logits(x, t, nn::LossReduction::sum, values({3, 3, 3}, {3})).item() ==
        doctest::Approx(3 * bce(0.5, 1) + bce(-2, 0) + 3 * bce(30, 1)).epsilon(1e-5));
  test::check_throws<ShapeError>([&] { nn::cross_entropy(logits, values({1}, {1}, DType::i64)); },
                                 {"cross_entropy", "[1]", "[2, 3]"});
  // Targets outside the classes are named as the loss's own error, with the target and where it is.
  test::check_throws<IndexError>(
      [&] {
        nn::cross_entropy(logits, values({1, 3}, {2}, DType::i64));
      },
      {"cross_entropy", "target 3 at [1]", "3 classes"});
  test::check_throws<IndexError>(
      [&] {
        nn::nll_loss(logits, values({-1, 0}, {2}, DType::i64));
      },
      {"nll_loss", "target -1 at [0]"});
  CHECK(std::isfinite(nn::cross_entropy(logits, values({-100, 2}, {2}, DType::i64)).item()));  // ignore_index
  // label_smoothing in [0, 1], as PyTorch's: NaN, negative and above 1 are errors, not silently 0.
  for (double bad : {-0.1, 1.5, std::nan("")}) {
    CAPTURE(bad);
    test::check_throws<ArgumentError>(
        [&] {
          nn::cross_entropy(logits, values({1, 1}, {2}, DType::i64), {.label_smoothing = bad});
        },
        {"cross_entropy", "label_smoothing must be in [0, 1]"});
  }
  // At 1 the loss is the smoothing term alone: each row's mean of -log p over the classes.
  test::check_close(nn::cross_entropy(logits, values({1, 0}, {2}, DType::i64), {.label_smoothing = 1.0}),
                    mean(-mean(log_softmax(logits, -1), {-1})), 1e-6, 1e-6);
  test::check_throws<DTypeError>([&] { nn::cross_entropy(logits, values({1, 1}, {2})); }, {"i64", "f32"});
}

TEST_CASE("a mean loss over a batch whose every target is ignored is NaN with a zero gradient, as in PyTorch") {
  // A fully masked batch (say one of prompt tokens only): a NaN gradient would reach every
  // parameter through the optimizer.
  const Tensor targets = values({-100, -100, -100}, {3}, DType::i64);
  for (DType d : {DType::f32, DType::f64, DType::bf16}) {
    CAPTURE(dtype_name(d));
    for (const nn::CrossEntropyOptions& o : {nn::CrossEntropyOptions{}, nn::CrossEntropyOptions{.label_smoothing = 0.1},
                                             nn::CrossEntropyOptions{.weight = values({2, 1, 0.5, 1}, {4}, d)}}) {
      const Tensor logits = randn({3, 4}, 5, 0, d).set_requires_grad();
      const Tensor loss = nn::cross_entropy(logits, targets, o);
      CHECK(std::isnan(loss.item()));
      loss.backward();
      for (double g : logits.grad().to_vector<double>()) CHECK(g == 0);
      const Tensor lp = log_softmax(randn({3, 4}, 6, 0, d), -1).set_requires_grad();
      const Tensor nll = nn::nll_loss(lp, targets, o);
      CHECK(std::isnan(nll.item()));
      nll.backward();
      for (double g : lp.grad().to_vector<double>()) CHECK(g == 0);
    }
  }
  // With one target kept, the mean is over it alone (unchanged).
  const Tensor logits = values({0, 1, 2, 3, 0, 0, 0, 0}, {2, 4}, DType::f64).set_requires_grad();
  const Tensor loss = nn::cross_entropy(logits, values({3, -100}, {2}, DType::i64));
  CHECK(loss.item() == doctest::Approx(std::log(1 + std::exp(-1) + std::exp(-2) + std::exp(-3))).epsilon(1e-12));
}

namespace {
// check(dtype, bad) for each float dtype the losses take and each logit an ignored row may hold
// (-inf from a mask, NaN).
template <class Check>
void for_each_dtype_and_bad_logit(Check&& check) {
  for (DType d : {DType::f32, DType::f64, DType::bf16}) {
    CAPTURE(dtype_name(d));
    for (const double bad : {-std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
      CAPTURE(bad);
      check(d, bad);
    }
  }
}
}  // namespace

TEST_CASE("an ignored row whose logits hold -inf or NaN leaves the loss finite, as PyTorch's (it skips the row)") {
  // Logits masked with -inf in a padded batch: ignored rows were multiplied by 0, and -inf * 0
  // made every reduction NaN (label smoothing's class mean too).
  const double inf = std::numeric_limits<double>::infinity();
  const Tensor targets = values({-100, 1}, {2}, DType::i64);
  for_each_dtype_and_bad_logit([&](DType d, double bad) {
    for (const nn::CrossEntropyOptions& o : {nn::CrossEntropyOptions{}, nn::CrossEntropyOptions{.label_smoothing = 0.1},
                                             nn::CrossEntropyOptions{.weight = values({2, 1, 0.5}, {3}, d)},
                                             nn::CrossEntropyOptions{.reduction = nn::LossReduction::sum},
                                             nn::CrossEntropyOptions{.reduction = nn::LossReduction::none}}) {
      const Tensor logits = values({bad, 0, 1, 0, 1, 0}, {2, 3}, d).set_requires_grad();
      const Tensor loss = nn::cross_entropy(logits, targets, o);
      const std::vector<double> l = loss.to_vector<double>();
      for (double v : l) CHECK(std::isfinite(v));
      if (l.size() == 2) CHECK(l[0] == 0);
      // The same loss as the kept row alone.
      nn::CrossEntropyOptions alone = o;
      const Tensor reference = nn::cross_entropy(values({0, 1, 0}, {1, 3}, d), values({1}, {1}, DType::i64), alone);
      CHECK(l.back() == doctest::Approx(reference.to_vector<double>().back()).epsilon(1e-6));
      sum(loss).backward();
      const std::vector<double> g = logits.grad().to_vector<double>();
      if (bad == -inf) {
        for (int c = 0; c < 3; ++c) CHECK(g[c] == 0);  // the ignored row: no gradient
      }
      for (int c = 3; c < 6; ++c) CHECK(std::isfinite(g[c]));
      const Tensor lp = log_softmax(values({bad, 0, 1, 0, 1, 0}, {2, 3}, d), -1);
      for (double v : nn::nll_loss(lp, targets, o).to_vector<double>()) CHECK(std::isfinite(v));
    }
  });
  // The plain mean: the kept row's loss, log(2 + e) - 1 (PyTorch 2.15: 0.5514447139320511).
  const Tensor loss = nn::cross_entropy(values({-inf, 0, 1, 0, 1, 0}, {2, 3}, DType::f64), targets);
  CHECK(loss.item() == doctest::Approx(std::log(2 + std::exp(1.0)) - 1).epsilon(1e-14));
}

TEST_CASE("an ignored row of logits that are all -inf or all NaN passes no gradient (README's promise)") {
  // log_softmax's backward of such a row is 0 - NaN * 0 however the loss selects it out.
  for_each_dtype_and_bad_logit([&](DType d, double bad) {
    for (const nn::CrossEntropyOptions& o :
         {nn::CrossEntropyOptions{}, nn::CrossEntropyOptions{.label_smoothing = 0.1},
          nn::CrossEntropyOptions{.ignore_index = 2}, nn::CrossEntropyOptions{.reduction = nn::LossReduction::sum}}) {
      // (The third row is kept, a logit far below the others in it.)
      const double third = o.ignore_index == 2 ? 0 : 2;
      const Tensor targets = values({1, static_cast<double>(o.ignore_index), third}, {3}, DType::i64);
      const Tensor logits = values({0.1, 0.2, 0.3, bad, bad, bad, 0.5, -30, 0.1}, {3, 3}, d).set_requires_grad();
      const Tensor loss = nn::cross_entropy(logits, targets, o);
      CHECK(std::isfinite(loss.item()));
      loss.backward();
      const std::vector<double> g = logits.grad().to_vector<double>();
      for (int c = 3; c < 6; ++c) CHECK(g[c] == 0);
      for (int c : {0, 1, 2, 6, 8}) CHECK(std::isfinite(g[c]));
      // The kept rows' loss and gradient are those of the batch without the ignored row.
      const Tensor kept = values({0.1, 0.2, 0.3, 0.5, -30, 0.1}, {2, 3}, d).set_requires_grad();
      const Tensor reference = nn::cross_entropy(kept, values({1, third}, {2}, DType::i64), o);
      CHECK(loss.item() == doctest::Approx(reference.item()).epsilon(1e-6));
      reference.backward();
      const std::vector<double> gk = kept.grad().to_vector<double>();
      for (int c : {0, 1, 2}) CHECK(g[c] == doctest::Approx(gk[c]).epsilon(1e-6));
    }
  });
}

TEST_CASE(
    "a mean loss whose kept class weights sum to 0 over a non-zero sum is an infinity of its sign, as PyTorch's") {
  // Negative weights (1 - 2 + 1 = 0): PyTorch divides by 0 (-inf for cross_entropy, +inf for
  // nll_loss here); NaN was added to every such mean.
  const Tensor logits =
      values({.1, .2, .3, .4, .5, .1, .2, .3, .4, .5, .1, .2, .3, .4, .5, .1, .2, .3, .4, .5}, {4, 5}, DType::f64);
  const Tensor targets = values({0, 1, -100, 2}, {4}, DType::i64), w = values({1, -2, 1, 1, 1}, {5}, DType::f64);
  for (const bool through_log_softmax : {true, false}) {
    CAPTURE(through_log_softmax);
    auto loss = [&](nn::LossReduction r) {
      return through_log_softmax ? nn::cross_entropy(logits, targets, {.reduction = r, .weight = w})
                                 : nn::nll_loss(logits, targets, {.reduction = r, .weight = w});
    };
    const double total = loss(nn::LossReduction::sum).item();
    REQUIRE(total != 0);
    const double mean = loss(nn::LossReduction::mean).item();
    CHECK(std::isinf(mean));
    CHECK(std::signbit(mean) == std::signbit(total));
  }
}

TEST_CASE(
    "a mean loss whose kept targets' class weights sum to 0 is NaN, with PyTorch's NaN gradient on the kept rows") {
  // PyTorch 1.13: the kept rows' gradients are their weight times 1 / 0 (NaN at the target for
  // nll_loss, through log_softmax the whole row for cross_entropy); ignored rows get 0.
  const Tensor targets = values({0, 0, -100}, {3}, DType::i64);
  for (DType d : {DType::f32, DType::f64, DType::bf16}) {
    CAPTURE(dtype_name(d));
    const Tensor w = values({0, 1, 1, 1}, {4}, d);
    for (const double smoothing : {0.0, 0.1}) {
      CAPTURE(smoothing);
      const Tensor logits = randn({3, 4}, 5, 0, d).set_requires_grad();
      const Tensor loss = nn::cross_entropy(logits, targets, {.label_smoothing = smoothing, .weight = w});
      CHECK(std::isnan(loss.item()));
      loss.backward();
      const std::vector<double> g = logits.grad().to_vector<double>();
      for (int i = 0; i < 12; ++i) {
        CAPTURE(i);
        const bool expected = i < 8 ? std::isnan(g[i]) : g[i] == 0;
        CHECK(expected);
      }
    }
    const Tensor lp = log_softmax(randn({3, 4}, 6, 0, d), -1).set_requires_grad();
    const Tensor nll = nn::nll_loss(lp, targets, {.weight = w});
    CHECK(std::isnan(nll.item()));
    nll.backward();
    const std::vector<double> g = lp.grad().to_vector<double>();
    for (int i = 0; i < 12; ++i) {
      CAPTURE(i);
      const bool expected = i == 0 || i == 4 ? std::isnan(g[i]) : g[i] == 0;
      CHECK(expected);
    }
  }
}

TEST_CASE("losses: a class weight that is not finite for a class never kept, no classes, the BCE tail") {
  // Inverse-frequency weights give a padding class never seen an infinite weight: ignored rows
  // picked it (class 0) and multiplied it by 0, and the loss and every gradient became NaN.
  const Tensor logits = randn({4, 4}, 5, 0, DType::f64);
  const Tensor targets = values({1, 2, 0, 3}, {4}, DType::i64);
  const double inf = std::numeric_limits<double>::infinity();
  for (const auto reduction : {nn::LossReduction::mean, nn::LossReduction::sum, nn::LossReduction::none}) {
    std::vector<std::vector<double>> grads;
    std::vector<std::vector<double>> losses;
    for (const double w0 : {inf, std::nan(""), 1.0}) {
      const Tensor x = logits.detach().set_requires_grad();
      const Tensor loss = nn::cross_entropy(
          x, targets,
          {.reduction = reduction, .ignore_index = 0, .weight = values({w0, 1 / 3., 1 / 2., 1.}, {4}, DType::f64)});
      sum(loss).backward();
      losses.push_back(loss.to_vector<double>());
      grads.push_back(x.grad().to_vector<double>());
    }
    // Class 0 is never kept: its weight does not matter.
    CHECK(losses[0] == losses[2]);
    CHECK(losses[1] == losses[2]);
    CHECK(grads[0] == grads[2]);
    CHECK(grads[1] == grads[2]);
    for (const double g : grads[0]) CHECK(std::isfinite(g));
  }
  test::check_throws<DTypeError>(
      [&] {
        nn::cross_entropy(logits, targets, {.weight = values({1, 1, 1, 1}, {4}, DType::i64)});
      },
      {"cross_entropy", "class weights must be floating point", "i64"});
  test::check_throws<ArgumentError>(
      [&] { nn::cross_entropy(logits, targets, {.weight = ones({4}, DType::f64).set_requires_grad()}); },
      {"cross_entropy", "require grad", "detach"});
  test::check_throws<DTypeError>([&] { nn::cross_entropy(targets, targets); }, {"cross_entropy", "logits"});

  // No classes: every target must be ignored, as PyTorch's (mean NaN, sum 0, none zeros).
  const Tensor empty = zeros({3, 0}, DType::f64).set_requires_grad();
  const Tensor ignored = values({-100, -100, -100}, {3}, DType::i64);
  CHECK(std::isnan(nn::cross_entropy(empty, ignored).item()));
  const Tensor total = nn::cross_entropy(empty, ignored, {.reduction = nn::LossReduction::sum});
  CHECK(total.item() == 0);
  total.backward();
  CHECK(empty.grad().shape() == Shape{3, 0});
  CHECK_CLOSE(nn::cross_entropy(empty, ignored, {.reduction = nn::LossReduction::none}), {0, 0, 0}, {3}, 0, 0);
  test::check_throws<IndexError>(
      [&] {
        nn::cross_entropy(empty, values({0, -100, -100}, {3}, DType::i64));
      },
      {"cross_entropy", "outside the 0 classes"});

  // BCE with logits below -20: softplus's threshold dropped log1p(exp(x)) (0 for x = -25, t = 0).
  const Tensor x = values({-25.0, -30.0}, {2}, DType::f64).set_requires_grad();
  const Tensor t = values({0.0, 1.0}, {2}, DType::f64);
  const Tensor bce = nn::binary_cross_entropy_with_logits(x, t, nn::LossReduction::none);
  const std::vector<double> v = bce.to_vector<double>();
  CHECK(v[0] == doctest::Approx(std::log1p(std::exp(-25.0))).epsilon(1e-12));
  CHECK(v[1] == doctest::Approx(30.0 + std::log1p(std::exp(-30.0))).epsilon(1e-15));
  sum(bce).backward();
  const std::vector<double> g = x.grad().to_vector<double>();
  CHECK(g[0] == doctest::Approx(1 / (1 + std::exp(25.0))).epsilon(1e-12));  // sigmoid(x) - t
  CHECK(g[1] == doctest::Approx(1 / (1 + std::exp(30.0)) - 1).epsilon(1e-12));
}

TEST_CASE("LayerNorm of rows whose squares overflow the statistics' dtype, and attention dropout of 1") {
  // f32 rows of 1e20: the squares are inf in f32, and rstd was 0 (every output 0). The f64
  // computation of the same row is the reference.
  const Tensor row = values({1e20, -1e20, 3e20, 0}, {1, 4});
  nn::LayerNorm norm(4, 1e-5, false);
  const Tensor y = norm.forward(row);
  test::check_close(y, norm.forward(row.to(DType::f64)).to(DType::f32), 1e-6, 1e-5);
  CHECK(std::abs(y.to_vector<float>()[2] - 1.5213f) < 1e-3f);
  const Tensor big = values({1e155, -1e155, 3e155, 0}, {1, 4}, DType::f64);
  test::check_close(norm.forward(big), y.to(DType::f64), 1e-6, 1e-5);
  // The attention weights' dropout must keep some weight, refused at construction as GPT does.
  test::check_throws<ArgumentError>([] { nn::CausalSelfAttention(8, 2, 1.0); },
                                    {"CausalSelfAttention", "dropout must be in [0, 1)", "1"});
  test::check_throws<ArgumentError>([] { nn::TransformerBlock(8, 2, 16, 1.0); }, {"CausalSelfAttention"});
}

TEST_CASE("losses: gradients") {
  const Tensor targets = values({2, 0, 1, -100}, {4}, DType::i64);
  const Tensor w = values({2, 1, 0.5}, {3}, DType::f64);
  auto check = [&](const nn::CrossEntropyOptions& o) {
    const auto r = gradcheck([&](const std::vector<Tensor>& in) { return nn::cross_entropy(in[0], targets, o); },
                             {randn({4, 3}, 7, 0, DType::f64).set_requires_grad()});
    CHECK_MESSAGE(r.ok, r.message);
  };
  check({});
  check({.label_smoothing = 0.2, .weight = w});
  check({.reduction = nn::LossReduction::none});
  const auto r = gradcheck(
      [](const std::vector<Tensor>& in) {
        return nn::binary_cross_entropy_with_logits(in[0], in[1], nn::LossReduction::mean,
                                                    values({2, 2, 2}, {3}, DType::f64));
      },
      {randn({3}, 8, 0, DType::f64).set_requires_grad(), rand({3}, 9, 0, DType::f64).set_requires_grad()});
  CHECK_MESSAGE(r.ok, r.message);
}
