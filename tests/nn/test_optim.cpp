// Optimizers against hand-computed PyTorch-formula steps, schedules, and dense clipping.
#include <cmath>

#include "helpers.h"

using namespace ruda;
using test::values;

namespace {
nn::Param param(std::vector<double> v) {
  return nn::Param(from_values(v, {static_cast<std::int64_t>(v.size())}, DType::f64));
}
void set_grad(const nn::Param& p, std::vector<double> g) {
  p.data().set_grad(from_values(g, {static_cast<std::int64_t>(g.size())}, DType::f64));
}
}  // namespace

TEST_CASE("SGD: plain, momentum, Nesterov, weight decay") {
  auto p = param({1.0, -2.0});
  nn::SGD plain({p}, {.lr = 0.1});
  set_grad(p, {2, 4});
  plain.step();
  CHECK_CLOSE(p.data(), {0.8, -2.4}, {2}, 1e-12, 0);

  auto q = param({1.0});
  nn::SGD momentum({q}, {.lr = 0.1, .momentum = 0.9});
  set_grad(q, {1});
  momentum.step();  // buffer = 1: q = 0.9
  set_grad(q, {1});
  momentum.step();  // buffer = 0.9 + 1 = 1.9: q = 0.71
  CHECK(q.data().item() == doctest::Approx(0.71).epsilon(1e-12));

  auto r = param({1.0});
  nn::SGD nesterov({r}, {.lr = 0.1, .momentum = 0.9, .nesterov = true, .weight_decay = 0.5});
  set_grad(r, {1});
  nesterov.step();  // g = 1 + 0.5 = 1.5, buffer = 1.5, update = 1.5 + 0.9 * 1.5 = 2.85
  CHECK(r.data().item() == doctest::Approx(1 - 0.285).epsilon(1e-12));
  CHECK(nesterov.state(r).at(0).first == "momentum_buffer");
}

TEST_CASE("Adam and AdamW follow PyTorch's formulas") {
  const double lr = 0.1, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1;
  auto reference = [&](bool decoupled) {
    double p = 1.0, m = 0, v = 0;
    const double grads[] = {0.5, -1.5, 2.0};
    for (int t = 1; t <= 3; ++t) {
      double g = grads[t - 1];
      if (!decoupled) g += wd * p;
      if (decoupled) p *= 1 - lr * wd;
      m = b1 * m + (1 - b1) * g;
      v = b2 * v + (1 - b2) * g * g;
      const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
      p -= lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + eps);
    }
    return p;
  };
  for (bool decoupled : {false, true}) {
    CAPTURE(decoupled);
    auto p = param({1.0});
    nn::Adam opt(
        {p}, {.lr = lr, .beta1 = b1, .beta2 = b2, .eps = eps, .weight_decay = wd, .decoupled_weight_decay = decoupled});
    for (double g : {0.5, -1.5, 2.0}) {
      set_grad(p, {g});
      opt.step();
    }
    CHECK(p.data().item() == doctest::Approx(reference(decoupled)).epsilon(1e-12));
    CHECK(opt.steps() == 3);
    CHECK(opt.state(p).size() == 2);
  }
  // f32 parameters through the same kernel.
  nn::Param f(values({1, 2, 3}, {3}));
  nn::AdamW adamw({f}, {.lr = 0.01});
  f.data().set_grad(values({1, -1, 0}, {3}));
  adamw.step();
  CHECK_CLOSE(f.data(), {1 * (1 - 1e-4) - 0.01, 2 * (1 - 1e-4) + 0.01, 3 * (1 - 1e-4)}, {3}, 1e-6, 1e-6);
  // A parameter without a gradient is left alone.
  nn::Param untouched(values({5}, {1}));
  nn::AdamW skip({untouched});
  skip.step();
  CHECK(untouched.data().item() == 5);
}

TEST_CASE("learning-rate schedules") {
  CHECK(nn::schedules::constant(0.1)(100) == 0.1);
  const auto warm = nn::schedules::linear_warmup(1.0, 4);
  CHECK(warm(0) == 0.25);
  CHECK(warm(3) == 1.0);
  CHECK(warm(10) == 1.0);
  const auto cos = nn::schedules::cosine(1.0, 10, 2, 0.1);
  CHECK(cos(0) == 0.5);
  CHECK(cos(2) == doctest::Approx(1.0));
  CHECK(cos(6) == doctest::Approx(0.55));
  CHECK(cos(10) == doctest::Approx(0.1));
  CHECK(cos(50) == doctest::Approx(0.1));
}

TEST_CASE("clip_grad_norm on dense parameters") {
  auto a = param({3, 0}), b = param({0, 4});
  set_grad(a, {3, 0});
  set_grad(b, {0, 4});
  CHECK(nn::clip_grad_norm({a, b}, 10) == doctest::Approx(5));
  CHECK_CLOSE(a.grad(), {3, 0}, {2});  // below the limit: unchanged
  CHECK(nn::clip_grad_norm({a, b}, 1) == doctest::Approx(5));
  CHECK_CLOSE(a.grad(), {0.6, 0}, {2}, 1e-6, 1e-6);
  CHECK_CLOSE(b.grad(), {0, 0.8}, {2}, 1e-6, 1e-6);
  test::check_throws<ArgumentError>([&] { nn::clip_grad_norm({a}, 0); }, {"max_norm"});
}
