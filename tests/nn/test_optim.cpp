// Optimizers against hand-computed PyTorch-formula steps, schedules, dense clipping, and the loss scaler.
#include <cmath>
#include <limits>
#include <map>

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

TEST_CASE("SGD's weight decay rounds once, as PyTorch's grad.add(param, alpha=weight_decay)") {
  // g + p * decay rounded twice: 1 ulp off in f32 on ~9% of values, which momentum carried on.
  // PyTorch 2.15, SGD(lr=1, weight_decay=0.1), one step from p = 0.6920091509819031 with
  // gradient 0.36273640394210815 (both f32): 0.26007184386253357.
  nn::Param one(values({0.6920091509819031}, {1}, DType::f32));
  one.data().set_grad(values({0.36273640394210815}, {1}, DType::f32));
  nn::SGD({one}, {.lr = 1.0, .weight_decay = 0.1}).step();
  CHECK(one.data().item() == 0.26007184386253357);
  // Over many values: p - fma(decay, p, g), with the decay as the f32 the kernel multiplies by.
  const Tensor p0 = randn({4096}, 11), g = randn({4096}, 12);
  nn::Param p(p0.clone());
  p.data().set_grad(g);
  nn::SGD({p}, {.lr = 1.0, .weight_decay = 0.1}).step();
  const std::vector<float> before = p0.to_vector<float>(), grad = g.to_vector<float>(),
                           after = p.data().to_vector<float>();
  int differ = 0;
  for (std::size_t i = 0; i < before.size(); ++i) differ += after[i] != before[i] - std::fmaf(0.1f, before[i], grad[i]);
  CHECK(differ == 0);
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

TEST_CASE("SGD refuses a step on a parameter whose dtype changed after its momentum buffer was made") {
  // The f32 buffer was added into with a silent cast, and saved in a dtype no fresh optimizer loads.
  nn::Param p(ones({8}));
  nn::SGD opt({p}, {.lr = 0.1, .momentum = 0.9});
  p.data().set_grad(ones({8}));
  opt.step();
  p.set_data(p.data().to(DType::bf16));
  p.data().set_grad(ones({8}, DType::bf16));
  const std::vector<float> before = p.data().to_vector<float>();
  test::check_throws<DTypeError>([&] { opt.step(); },
                                 {"SGD::step", "momentum buffer is f32", "set_data", "new optimizer"});
  CHECK(p.data().to_vector<float>() == before);
  CHECK(opt.steps_of(p) == 1);
  test::check_throws<DTypeError>([&] { (void)opt.state(p); }, {"SGD::state", "momentum buffer is f32"});
  // Neither keeps state for a parameter it does not update.
  nn::Param other(ones({2}));
  test::check_throws<ArgumentError>([&] { (void)opt.state(other); }, {"SGD::state", "not one this optimizer updates"});
}

TEST_CASE("Adam refuses a step on a parameter whose dtype changed after its moments were made") {
  // set_data to another floating dtype (module.h names it) after a step: the fused kernel read the
  // f32 moments as f64, past their end (a heap corruption), or f32 ones as bf16 (silently wrong).
  // The moments a parameter's dtype needs now are what counts: f32 ones carry on for a bf16 or f16
  // parameter (Adam::moment_dtype), and f32 moments of a bf16 parameter do not fit it as f64.
  struct Change {
    DType first, later;
    bool fits;  // the moments made for `first` are the ones `later` needs
  };
  for (const Change change : {Change{DType::f32, DType::f64, false}, Change{DType::bf16, DType::f64, false},
                              Change{DType::f32, DType::bf16, true}, Change{DType::bf16, DType::f16, true}}) {
    CAPTURE(dtype_name(change.first));
    CAPTURE(dtype_name(change.later));
    nn::Param p(ones({4096}, change.first));
    nn::Adam opt({p});
    p.data().set_grad(ones({4096}, change.first));
    opt.step();
    const std::vector<float> moment = opt.state(p)[0].second.to_vector<float>();
    p.set_data(p.data().to(change.later));
    p.data().set_grad(ones({4096}, change.later));
    if (change.fits) {
      opt.step();  // the same f32 moments, one step further
      CHECK(opt.steps_of(p) == 2);
      const Tensor exp_avg = opt.state(p)[0].second;
      CHECK(exp_avg.dtype() == DType::f32);
      CHECK(exp_avg.to_vector<float>()[0] == doctest::Approx(0.9 * moment[0] + 0.1));
      continue;
    }
    test::check_throws<DTypeError>([&] { opt.step(); }, {"Adam", "moments are f32", "set_data", "new optimizer"});
    test::check_throws<DTypeError>([&] { (void)opt.state(p); }, {"Adam", "moments are f32"});
    // A new optimizer steps it.
    nn::Adam fresh({p});
    fresh.step();
    CHECK(p.data().dtype() == change.later);
  }
}

TEST_CASE("a backend's adam_update refuses moments of another dtype than AdamDesc's contract gives") {
  // An out-of-tree caller of the kernel, or a backend's engine, passing a 16-bit parameter's
  // moments in its dtype (what they were before) gets a typed error, not f32 reads of bf16 data.
  for (const std::string& name : available_backends()) {
    CAPTURE(name);
    Backend& backend = get_backend(name);
    for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
      CAPTURE(dtype_name(dtype));
      const DType wrong = dtype == DType::f32 ? DType::f64 : dtype;
      Tensor p = ones({16}, Options(dtype, &backend)), g = ones({16}, Options(dtype, &backend));
      Tensor m = zeros({16}, Options(wrong, &backend)), v = zeros({16}, Options(wrong, &backend));
      AdamDesc desc;
      desc.param = p.view();
      desc.grad = g.view();
      desc.exp_avg = m.view();
      desc.exp_avg_sq = v.view();
      test::check_throws<DTypeError>([&] { backend.adam_update(desc); },
                                     {"adam_update", std::string(dtype_name(dtype)) + " parameter's moments must be " +
                                                         std::string(dtype_name(nn::Adam::moment_dtype(dtype)))});
      CHECK(p.to_vector<float>() == std::vector<float>(16, 1.0f));
    }
  }
}

TEST_CASE("Adam keeps f32 moments for f16 and bf16 parameters: the same moments as an f32 run's") {
  // In the parameter's dtype (PyTorch's choice) an f16 second moment underflowed to 0 for |g| under
  // ~8e-3, so each step was lr * m / eps: this run's parameter went to -inf within two steps.
  // bf16's stopped growing once 1e-3 g^2 was under half its ulp. With f32 moments, a 16-bit
  // parameter's moments are the f32 run's to the bit (AdamW's moments do not read the parameter),
  // and each step is the f32 step from the same value and moments, rounded once to the dtype.
  constexpr std::int64_t n = 64;
  constexpr int steps = 300;
  for (DType dtype : {DType::f16, DType::bf16}) {
    CAPTURE(dtype_name(dtype));
    CHECK(nn::Adam::moment_dtype(dtype) == DType::f32);
    nn::Param narrow(zeros({n}, dtype)), wide(zeros({n}));
    nn::AdamW narrow_opt({narrow}, {.lr = 1e-3}), wide_opt({wide}, {.lr = 1e-3});
    for (int step = 0; step < steps; ++step) {
      CAPTURE(step);
      // Gradients of 1e-4 to 5e-3 (representable in the 16-bit dtype, so both runs see the same).
      const Tensor g = (rand({n}, 100 + static_cast<std::uint64_t>(step)) * 4.9e-3 + 1e-4).to(dtype);
      // This step in f32 from the 16-bit parameter's value and moments (its state(), copied).
      nn::Param shadow(narrow.data().to(DType::f32));
      nn::AdamW shadow_opt({shadow}, {.lr = 1e-3});
      if (step > 0) {
        const auto from = narrow_opt.state(narrow), to = shadow_opt.state(shadow);
        for (std::size_t s = 0; s < 2; ++s) Tensor(to[s].second).copy_(from[s].second);
        shadow_opt.set_steps(step);
      }
      shadow.data().set_grad(g.to(DType::f32));
      shadow_opt.step();
      narrow.data().set_grad(g);
      wide.data().set_grad(g.to(DType::f32));
      narrow_opt.step();
      wide_opt.step();
      REQUIRE(narrow.data().to_vector<float>() == shadow.data().to(dtype).to_vector<float>());
    }
    const auto narrow_state = narrow_opt.state(narrow), wide_state = wide_opt.state(wide);
    for (std::size_t s = 0; s < 2; ++s) {
      CAPTURE(narrow_state[s].first);
      CHECK(narrow_state[s].second.dtype() == DType::f32);
      CHECK(narrow_state[s].second.to_vector<float>() == wide_state[s].second.to_vector<float>());
    }
    // Each step moves the parameter by about lr (m / sqrt(v) ~ 1 for gradients of one sign):
    // about -0.3 after 300 steps in f32 and in both 16-bit dtypes (bf16's rounding of steps near
    // its ulp leaves it up to 15% apart from the f32 run).
    const std::vector<float> got = narrow.data().to_vector<float>(), want = wide.data().to_vector<float>();
    for (std::int64_t i = 0; i < n; ++i) {
      CAPTURE(i);
      CHECK((want[i] < -0.2f && want[i] > -0.4f));
      CHECK((got[i] < -0.2f && got[i] > -0.4f));
    }
  }
}

TEST_CASE("SGD's momentum buffer starts as a parameter's first gradient, even where state() made it earlier") {
  // With dampening, PyTorch's buffer is the first gradient itself, undampened; later ones enter
  // dampened. A checkpoint saved before a parameter's first step asks for its state (zeros), and
  // q has no gradient in the first step: neither may make the first update a dampened one.
  // Values from PyTorch 1.13 (torch.optim.SGD, f64, lr 0.1, momentum 0.9, dampening 0.5; loss
  // sum(p^2), plus sum(q^2 * [1, 3]) from the second step).
  for (bool state_first : {false, true}) {
    CAPTURE(state_first);
    auto p = param({1.0, -2.0}), q = param({0.5, 0.3});
    nn::SGD opt({p, q}, {.lr = 0.1, .momentum = 0.9, .dampening = 0.5});
    for (int step = 0; step < 3; ++step) {
      if (state_first) {
        (void)opt.state(p);
        (void)opt.state(q);
      }
      opt.zero_grad();
      const std::vector<double> pv = p.data().to_vector<double>(), qv = q.data().to_vector<double>();
      set_grad(p, {2 * pv[0], 2 * pv[1]});
      if (step > 0) set_grad(q, {2 * qv[0], 6 * qv[1]});
      opt.step();
    }
    CHECK(opt.steps_of(p) == 3);
    CHECK(opt.steps_of(q) == 2);
    const std::vector<double> pv = p.data().to_vector<double>(), qv = q.data().to_vector<double>();
    CHECK(pv[0] == doctest::Approx(0.252).epsilon(1e-12));
    CHECK(pv[1] == doctest::Approx(-0.504).epsilon(1e-12));
    CHECK(qv[0] == doctest::Approx(0.27).epsilon(1e-12));
    CHECK(qv[1] == doctest::Approx(-0.078).epsilon(1e-12));
  }
}

TEST_CASE("Adam counts each parameter's own steps for its bias corrections, as PyTorch's state['step']") {
  // q has no gradient in the first step (frozen, or first used later): its first update must be
  // corrected as a first step, not a second. Values from PyTorch 1.13 (torch.optim.Adam / AdamW,
  // f64, lr 0.1, zero_grad each step; loss sum(p^2), plus sum(q^2 * [1, 3]) from the second step).
  for (bool decoupled : {false, true}) {
    CAPTURE(decoupled);
    auto p = param({1.0, -2.0}), q = param({0.5, 0.3});
    nn::Adam opt({p, q}, {.lr = 0.1, .weight_decay = decoupled ? 0.1 : 0.0, .decoupled_weight_decay = decoupled});
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      const std::vector<double> pv = p.data().to_vector<double>(), qv = q.data().to_vector<double>();
      set_grad(p, {2 * pv[0], 2 * pv[1]});
      if (step > 0) set_grad(q, {2 * qv[0], 6 * qv[1]});
      opt.step();
    }
    CHECK(opt.steps() == 3);
    const std::vector<double> pv = p.data().to_vector<double>(), qv = q.data().to_vector<double>();
    const std::vector<double> want_p = decoupled ? std::vector<double>{0.6751012216400698, -1.6443686835605893}
                                                 : std::vector<double>{0.70158627294603015, -1.7006233920464651};
    const std::vector<double> want_q = decoupled ? std::vector<double>{0.29233870425507857, 0.098169135041767011}
                                                 : std::vector<double>{0.30118742165916679, 0.10296478834861994};
    for (int i = 0; i < 2; ++i) {
      CHECK(pv[i] == doctest::Approx(want_p[i]).epsilon(1e-12));
      CHECK(qv[i] == doctest::Approx(want_q[i]).epsilon(1e-12));
    }
    // set_steps (a checkpoint's resume) gives every parameter that count.
    opt.set_steps(10);
    CHECK(opt.steps() == 10);
  }
}

TEST_CASE("Adam in f32 rounds its constants as PyTorch does (1 - beta in double, its order of operations)") {
  // One step, lr 0.1, gradient [2, 1e-3]. PyTorch 1.13 (torch.optim.Adam, f32) gives
  // [0.900000036, 0.900000989]; 1 - float(0.999) (11 ulp off float(0.001)) gave [0.899999321,
  // 0.900000334]. The reference below is PyTorch's f32 arithmetic: the constants rounded from
  // double, then denom = sqrt(v) / sqrt(bc2) + eps and p -= step_size * (m / denom).
  nn::Param p(values({1, 1}, {2}));
  nn::Adam adam({p}, {.lr = 0.1});
  p.data().set_grad(values({2, 1e-3}, {2}));
  adam.step();
  const std::vector<double> got = p.data().to_vector<double>();
  for (int i = 0; i < 2; ++i) {
    const float g = i == 0 ? 2.0f : 1e-3f;
    const float m = float(1.0 - 0.9) * g, v = float(1.0 - 0.999) * g * g;
    const float denom = std::sqrt(v) / float(std::sqrt(1.0 - 0.999)) + float(1e-8);
    const float want = 1.0f - float(0.1 / (1.0 - 0.9)) * (m / denom);
    CHECK(static_cast<float>(got[static_cast<std::size_t>(i)]) == want);
  }
  CHECK(got[0] == doctest::Approx(0.900000036).epsilon(2e-8));
  CHECK(got[1] == doctest::Approx(0.900000989).epsilon(2e-8));
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
  test::check_throws<ArgumentError>([&] { nn::clip_grad_norm({a}, -1); }, {"max_norm", "-1"});
  test::check_throws<ArgumentError>([&] { nn::clip_grad_norm({a}, std::nan("")); }, {"max_norm", "nan"});
  {  // max_norm 0, as PyTorch: the norm returned, every gradient 0
    auto z = param({3, 4});
    set_grad(z, {3, 4});
    CHECK(nn::clip_grad_norm({z}, 0) == doctest::Approx(5));
    CHECK_CLOSE(z.grad(), {0, 0}, {2});
  }
  // As PyTorch 1.13 and 2.x: a NaN norm makes every gradient NaN (the step would otherwise apply
  // the finite ones and the NaN); a norm equal to max_norm scales by max_norm / (max_norm + 1e-6).
  auto c = param({3, 0}), d = param({12});
  set_grad(c, {3, std::nan("")});
  set_grad(d, {12});
  CHECK(std::isnan(nn::clip_grad_norm({c, d}, 1)));
  for (double g : c.grad().to_vector<double>()) CHECK(std::isnan(g));
  CHECK(std::isnan(d.grad().item()));
  set_grad(c, {5, 12});
  CHECK(nn::clip_grad_norm({c}, 13) == doctest::Approx(13));
  CHECK(c.grad().to_vector<double>()[1] == 12 * (13 / (13 + 1e-6)));
}

TEST_CASE("clip_grad_norm of 32- and 16-bit gradients whose squares overflow f32 scales them to max_norm") {
  // The squares sum in f64, so the norm (4.24e38) is finite; the factor max_norm / norm is below
  // f32's smallest normal number (1.2e-38): as one f32 scalar it was subnormal or 0, and zeroed
  // gradients that should read max_norm / sqrt(2) each.
  for (const DType dtype : {DType::f32, DType::bf16}) {
    for (const double max_norm : {1e-3, 1e-8, 1e-30}) {
      CAPTURE(dtype_name(dtype));
      CAPTURE(max_norm);
      const nn::Param p(zeros({2}, Options(dtype)));
      p.data().set_grad(full({2}, 3e38, Options(dtype)));
      const double grad = p.grad().to_vector<double>()[0];  // 3e38 as the dtype holds it
      const double norm = nn::clip_grad_norm({p}, max_norm);
      CHECK(norm == doctest::Approx(grad * std::sqrt(2.0)).epsilon(1e-12));
      const double rounding = dtype == DType::f32 ? 1e-6 : 1e-2;
      for (double g : p.grad().to_vector<double>()) {
        CHECK(g == doctest::Approx(grad * max_norm / (norm + 1e-6)).epsilon(rounding).scale(0));  // relative
      }
    }
  }
}

TEST_CASE("clip_grad_norm refuses a parameter listed twice, as the optimizers do (it counted and scaled twice)") {
  auto p = param({3, 4}), q = param({1});
  set_grad(p, {3, 4});
  set_grad(q, {1});
  test::check_throws<ArgumentError>(
      [&] {
        nn::clip_grad_norm({p, q, p}, 1);
      },
      {"clip_grad_norm", "given twice", "positions 0 and 2"});
  CHECK_CLOSE(p.grad(), {3, 4}, {2});  // refused before any gradient is scaled
  test::check_throws<ArgumentError>([&] { nn::grad_norm({q, q}); }, {"given twice"});
}

TEST_CASE("the step count never overflows: a step that would take it to INT64_MAX is refused, changing nothing") {
  auto p = param({1, 2});
  for (const int kind : {0, 1, 2}) {
    CAPTURE(kind);
    std::unique_ptr<nn::Optimizer> opt;
    if (kind == 0) opt = std::make_unique<nn::SGD>(std::vector<nn::Param>{p}, nn::SGDOptions{.lr = 0.1});
    if (kind == 1) opt = std::make_unique<nn::Adam>(std::vector<nn::Param>{p});
    if (kind == 2) opt = std::make_unique<nn::AdamW>(std::vector<nn::Param>{p});
    opt->set_steps(std::numeric_limits<std::int64_t>::max() - 2);
    set_grad(p, {1, 1});
    opt->step();  // to INT64_MAX - 1
    const auto before = p.data().to_vector<double>();
    test::check_throws<ArgumentError>([&] { opt->step(); }, {"::step", "9223372036854775806", "overflow"});
    CHECK(p.data().to_vector<double>() == before);
    CHECK(opt->steps() == std::numeric_limits<std::int64_t>::max() - 1);
    for (double v : before) CHECK(std::isfinite(v));
  }
}

TEST_CASE("optimizer options are validated where they are given") {
  const nn::Param p = param({1, 2, 3});
  // A parameter twice would be updated twice per step; no parameter at all is a mistake too.
  test::check_throws<ArgumentError>(
      [&] {
        nn::SGD({p, param({4}), p});
      },
      {"Optimizer", "[3]", "given twice", "positions 0 and 2"});
  test::check_throws<ArgumentError>([] { nn::AdamW(std::vector<nn::Param>{}); }, {"Optimizer", "no parameters"});
  const double nan = std::nan("");
  for (double bad : {-0.5, nan, HUGE_VAL}) {
    CAPTURE(bad);
    test::check_throws<ArgumentError>([&] { nn::SGD({p}, {.momentum = bad}); }, {"SGD", "momentum"});
    test::check_throws<ArgumentError>([&] { nn::SGD({p}, {.weight_decay = bad}); }, {"SGD", "weight_decay"});
    test::check_throws<ArgumentError>([&] { nn::SGD({p}, {.dampening = bad}); }, {"SGD", "dampening"});
    test::check_throws<ArgumentError>([&] { nn::AdamW({p}, {.weight_decay = bad}); }, {"Adam", "weight_decay"});
    test::check_throws<ArgumentError>([&] { nn::AdamW({p}, {.lr = bad}); }, {"learning rate"});
    test::check_throws<ArgumentError>([&] { nn::AdamW({p}, {.eps = bad}); }, {"Adam", "eps"});
  }
  nn::SGD sgd({p});
  test::check_throws<ArgumentError>([&] { sgd.set_lr(nan); }, {"learning rate"});
}

TEST_CASE("Param: the caller's tensor is left alone; set_data keeps the shape; wrong grads are typed") {
  const Tensor t = ones({2, 3});
  const nn::Param p(t);
  CHECK_FALSE(t.requires_grad());  // the parameter is a leaf of its own over the same storage
  CHECK(p.data().requires_grad());
  autograd::no_grad([&] { p.data().add_(ones({2, 3}), 1.0); });
  CHECK(t.to_vector<double>()[0] == 2.0);
  nn::Linear layer(5, 4);
  test::check_throws<ShapeError>(
      [&] {
        layer.weight.set_data(zeros({3, 3}));
      },
      {"Param::set_data", "[3, 3]", "[5, 4]"});
  CHECK(layer.in_features() == 5);
  layer.weight.set_data(zeros({5, 4}, DType::f64));  // another floating dtype is fine
  CHECK(layer.weight.dtype() == DType::f64);
  test::check_throws<DTypeError>([&] { layer.bias.set_data(zeros({4}, DType::i64)); }, {"Param::set_data", "i64"});
  Tensor leaf = layer.bias.data();
  test::check_throws<DTypeError>([&] { leaf.set_grad(zeros({4}, DType::f64)); }, {"set_grad", "f64", "f32"});
  test::check_throws<ShapeError>([&] { leaf.set_grad(zeros({5})); }, {"set_grad", "[5]", "[4]"});
}

TEST_CASE("set_data keeps a frozen parameter frozen, dense and sharded: no gradient, no update") {
  // PyTorch's `p.data = t` keeps requires_grad; set_data turned it back on, so that replacing a
  // frozen backbone's values (loaded weights, a cast) trained it again.
  nn::Linear layer(2, 2);
  layer.weight.data().set_requires_grad(false);
  layer.weight.set_data(ones({2, 2}));
  CHECK_FALSE(layer.weight.data().requires_grad());
  layer.weight.set_data(ones({2, 2}, DType::f64).to(DType::f32));  // from a tensor of another dtype too
  CHECK_FALSE(layer.weight.data().requires_grad());
  CHECK(layer.bias.data().requires_grad());
  layer.bias.set_data(zeros({2}));  // a trainable one stays trainable
  CHECK(layer.bias.data().requires_grad());
  sum(layer.forward(ones({1, 2}))).backward();
  CHECK_FALSE(layer.weight.grad().defined());
  CHECK(layer.bias.grad().defined());

  run_ranks(2, [](Communicator& comm) {
    nn::Linear sharded(2, 2);
    sharded.weight.data().set_requires_grad(false);
    nn::fully_shard(sharded, comm);
    REQUIRE_FALSE(sharded.weight.data().requires_grad());
    sharded.weight.set_data(sharded.weight.data().detach().clone());
    CHECK_FALSE(sharded.weight.data().requires_grad());
    const std::vector<double> before = sharded.weight.data().to_vector<double>();
    nn::SGD opt(sharded.parameters(), {.lr = 1.0});
    sum(sharded.forward(ones({1, 2}))).backward();
    opt.step();
    CHECK_FALSE(sharded.weight.grad().defined());
    CHECK(sharded.weight.data().to_vector<double>() == before);
  });
}

TEST_CASE("a parameter sharded with from_full is named in messages, or said to be unnamed") {
  run_ranks(2, [](Communicator& comm) {
    const nn::Param full = param({1, 2, 3});
    const nn::Param named = nn::ShardedParameter::from_full(full, comm.rank(), 2, "encoder.scale").param();
    CHECK(named.shard()->name == "encoder.scale");
    test::check_throws<nn::ShardingError>([&] { (void)named.value(); }, {"parameter 'encoder.scale' [3]"});
    const nn::Param other = param({4, 5});
    const nn::Param unnamed = nn::ShardedParameter::from_full(other, comm.rank(), 2).param();
    test::check_throws<nn::ShardingError>([&] { (void)unnamed.value(); }, {"an unnamed parameter [2]"});
  });
}

TEST_CASE("decay_2d_only groups by logical shape, sharded or not, and groups are validated") {
  auto names = [](const nn::Module& m, const nn::ParamGroup& g) {
    std::vector<std::string> out;
    for (const nn::Param& p : g.params) {
      for (const auto& [name, q] : m.named_parameters()) {
        if (q.id() == p.id()) out.push_back(name);
      }
    }
    return out;
  };
  nn::manual_seed(1);
  nn::TransformerBlock dense(8, 2, 16);
  const auto dense_groups = nn::decay_2d_only(dense);
  REQUIRE(dense_groups.size() == 2);
  CHECK(dense_groups[0].name == "decay");
  CHECK_FALSE(dense_groups[0].weight_decay.has_value());  // the optimizer's
  CHECK(dense_groups[1].name == "no_decay");
  CHECK(dense_groups[1].weight_decay == 0.0);
  const std::vector<std::string> decayed = {"attn.qkv.weight", "attn.proj.weight", "mlp.fc1.weight", "mlp.fc2.weight"};
  CHECK(names(dense, dense_groups[0]) == decayed);
  CHECK(names(dense, dense_groups[1]).size() == dense.parameters().size() - decayed.size());
  run_ranks(3, [&](Communicator& comm) {
    nn::manual_seed(1);
    nn::TransformerBlock block(8, 2, 16);
    nn::fully_shard(block, comm);  // every local slice is 1-D now
    const auto groups = nn::decay_2d_only(block);
    CHECK(names(block, groups[0]) == decayed);
  });
  // Groups are checked where they are given.
  nn::Param a(zeros({2})), b(zeros({2}));
  test::check_throws<ArgumentError>(
      [&] {
        nn::AdamW({{.name = "x", .params = {a}}, {.name = "x", .params = {b}}});
      },
      {"Optimizer", "two parameter groups are named 'x'"});
  test::check_throws<ArgumentError>([&] { nn::AdamW({{.name = "", .params = {a}}}); }, {"group 0 has no name"});
  test::check_throws<ArgumentError>([&] { nn::SGD({{.name = "x", .params = {a}, .lr_scale = -1}}); },
                                    {"lr_scale of group 'x'"});
  test::check_throws<ArgumentError>([&] { nn::Adam({{.name = "x", .params = {a}, .weight_decay = std::nan("")}}); },
                                    {"weight_decay of group 'x'"});
  test::check_throws<ArgumentError>(
      [&] {
        nn::AdamW({{.name = "x", .params = {a}}, {.name = "y", .params = {a}}});
      },
      {"given twice", "in groups 'x' and 'y'"});
}

TEST_CASE("a step that fails partway changes nothing and counts for no parameter; the next one counts once") {
  // Out of memory while making a momentum buffer or Adam's moments, after a parameter without a
  // gradient was passed over: neither the step nor that parameter's skip may be counted, or its
  // own count goes negative (and every later checkpoint's index refuses it).
  for (bool adam : {false, true}) {
    CAPTURE(adam);
    nn::manual_seed(3);
    nn::Sequential model({std::make_shared<nn::Linear>(4, 2), std::make_shared<nn::Linear>(512, 2048)});
    const auto params = model.parameters();
    sum(model[1]->forward(ones({1, 512}))).backward();  // the first layer gets no gradient
    // A small parameter first, that has a gradient: it was updated before the large one's state
    // ran out of memory, and updated again (as its first step) by the retry.
    nn::Param small(ones({2}));
    small.data().set_grad(ones({2}));
    std::vector<nn::Param> all{small};
    all.insert(all.end(), params.begin(), params.end());
    std::unique_ptr<nn::Optimizer> opt;
    if (adam) {
      opt = std::make_unique<nn::Adam>(all);
    } else {
      opt = std::make_unique<nn::SGD>(all, nn::SGDOptions{.lr = 0.1, .momentum = 0.9});
    }
    const std::int64_t live = memory::stats().live_bytes;
    memory::set_limit(live + 1024);
    CHECK_THROWS_AS(opt->step(), OutOfMemoryError);
    memory::set_limit(0);
    CHECK(opt->steps() == 0);
    for (const nn::Param& p : all) CHECK(opt->steps_of(p) == 0);
    CHECK(small.data().to_vector<float>() == std::vector<float>{1, 1});  // nothing changed
    // Nor is the state the pass made for the small parameter kept (it was, zeros a checkpoint
    // then saved for a parameter that had not stepped, and memory held).
    CHECK_FALSE(opt->has_state(small));
    CHECK(memory::stats().live_bytes == live);
    opt->step();
    CHECK(opt->steps() == 1);
    CHECK(opt->steps_of(params.front()) == 0);
    CHECK(opt->steps_of(params.back()) == 1);
    // One update: Adam's first step moves by lr (1e-3), SGD's by lr * g (0.1).
    CHECK(small.data().to_vector<float>()[0] == doctest::Approx(adam ? 1 - 1e-3 : 0.9).epsilon(1e-6));
  }
}

TEST_CASE("Adam out of memory between a parameter's two moments keeps neither; the retry is the step") {
  // The first moment entered the state alone, taken as whole from then on: every later step
  // failed on the missing second ("view: called on an undefined tensor"), limit lifted or not.
  for (DType dtype : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dtype));
    const auto run = [&](bool refused) {
      nn::Param p(ones({7, 5}, dtype));
      nn::AdamW opt({p});
      p.data().set_grad(full({7, 5}, 0.25, dtype));
      if (refused) {
        const std::int64_t live = memory::stats().live_bytes;
        memory::set_limit(live + 7 * 5 * 4 + 70);  // one f32 moment fits, not two
        CHECK_THROWS_AS(opt.step(), OutOfMemoryError);
        memory::set_limit(0);
        CHECK_FALSE(opt.has_state(p));
        CHECK(opt.steps_of(p) == 0);
        CHECK(memory::stats().live_bytes == live);
      }
      opt.step();
      return std::vector<float>(p.data().to_vector<float>());
    };
    CHECK(run(true) == run(false));
  }
}

TEST_CASE("SGD momentum out of memory mid-step: a parameter and its buffer both as they were, or both stepped") {
  // Nesterov's g + momentum * buffer allocated after the buffer's update (and add_ with an alpha
  // made a temporary for the parameter's): running out of memory there left the buffer a step
  // ahead of its parameter, and the retry moved it again. Now every temporary comes first.
  for (DType dtype : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dtype));
    nn::Param small(ones({2}, dtype)), large(ones({4096}, dtype));
    nn::SGD opt({small, large}, {.lr = 0.1, .momentum = 0.9, .nesterov = true});
    auto grads = [&] {
      small.data().set_grad(ones({2}, dtype));
      large.data().set_grad(ones({4096}, dtype));
    };
    grads();
    opt.step();  // buffers = g = 1; parameters 1 - 0.1 * (1 + 0.9) = 0.81
    const double after_one = cast(large.data(), DType::f64).to_vector<double>()[0];
    grads();
    memory::set_limit(memory::stats().live_bytes + 1024);
    CHECK_THROWS_AS(opt.step(), OutOfMemoryError);
    memory::set_limit(0);
    CHECK(opt.steps_of(small) == 2);
    CHECK(opt.steps_of(large) == 1);
    CHECK(cast(large.data(), DType::f64).to_vector<double>()[0] == after_one);
    CHECK(cast(opt.state(large).at(0).second, DType::f64).to_vector<double>()[0] == 1.0);  // not 0.9 + 1
    // The retry steps it once: buffer 1.9, parameter 0.81 - 0.1 * (1 + 0.9 * 1.9).
    opt.step();
    CHECK(cast(opt.state(large).at(0).second, DType::f64).to_vector<double>()[0] ==
          doctest::Approx(1.9).epsilon(dtype == DType::f32 ? 1e-6 : 1e-2));
    CHECK(cast(large.data(), DType::f64).to_vector<double>()[0] ==
          doctest::Approx(after_one - 0.1 * (1 + 0.9 * 1.9)).epsilon(dtype == DType::f32 ? 1e-6 : 1e-2));
  }
}

TEST_CASE("a step that runs out of memory while updating counts for the parameters it updated") {
  // SGD with weight decay makes g + decay * p per parameter as it updates: the large parameter's
  // runs out of memory after the small one was updated. Each count stays the updates it took.
  nn::Param small(ones({2})), large(ones({4096}));
  nn::SGD opt({small, large}, {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.1});
  auto grads = [&] {
    small.data().set_grad(ones({2}));
    large.data().set_grad(ones({4096}));
  };
  grads();
  opt.step();  // the momentum buffers exist from here: the next step's first pass makes nothing
  grads();
  memory::set_limit(memory::stats().live_bytes + 1024);
  CHECK_THROWS_AS(opt.step(), OutOfMemoryError);
  memory::set_limit(0);
  CHECK(opt.steps() == 2);
  CHECK(opt.steps_of(small) == 2);
  CHECK(opt.steps_of(large) == 1);
  CHECK(large.data().to_vector<float>()[0] == doctest::Approx(1 - 0.1 * 1.1).epsilon(1e-6));  // one update
}

// ---- GradScaler ----------------------------------------------------------------------------

namespace {
// y = mlp(x) on [4, 8] inputs; the loss is `factor` times the squared error summed over the
// rows [begin, end) of the batch, so that ranks holding halves of it sum to the whole gradient.
Tensor scaler_loss(nn::MLP& mlp, std::int64_t begin, std::int64_t end, double factor) {
  Generator data(11);
  const Tensor x = data.randn({4, 8}).slice(0, begin, end);
  const Tensor target = data.randn({4, 8}).slice(0, begin, end);
  return sum(square(cast(mlp.forward(x), DType::f32) - target)) * factor;
}
// The part of a dense gradient that `p`'s local slice holds.
Tensor own_part(const nn::Param& p, const Tensor& dense_grad) {
  const nn::ShardInfo& s = *p.shard();
  const std::int64_t begin = s.rank * s.shard_size;
  return dense_grad.reshape({-1}).slice(0, begin, begin + s.real_elements());
}
// Every parameter's local values.
std::vector<std::vector<double>> values_of(const nn::Module& module) {
  std::vector<std::vector<double>> out;
  for (const nn::Param& p : module.parameters()) out.push_back(p.data().to_vector<double>());
  return out;
}
// |a - b| / |b| over the concatenated slices.
double relative_error(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const std::vector<double> x = a[i].to_vector<double>(), y = b[i].to_vector<double>();
    for (std::size_t j = 0; j < x.size(); ++j) {
      diff += (x[j] - y[j]) * (x[j] - y[j]);
      norm += y[j] * y[j];
    }
  }
  return std::sqrt(diff / norm);
}
}  // namespace

TEST_CASE("GradScaler: under an f16 compute dtype it keeps the gradients f16 flushes to 0, within 1e-2 of f32's") {
  // A loss 1e-8 of the usual size: its gradients (~1e-8) are below f16's normal range, so the f16
  // backward of fully_shard's compute dtype flushes them to 0 or a bit or two.
  constexpr double kSmall = 1e-8;
  nn::manual_seed(5);
  nn::MLP reference(8, 16);
  sum(scaler_loss(reference, 0, 4, kSmall)).backward();
  std::vector<Tensor> dense_grads;
  for (const nn::Param& p : reference.parameters()) dense_grads.push_back(p.grad());

  std::vector<double> unscaled_error(2), scaled_error(2);
  run_ranks(2, [&](Communicator& comm) {
    for (const bool use_scaler : {false, true}) {
      nn::manual_seed(5);
      nn::MLP mlp(8, 16);
      nn::fully_shard(mlp, comm, {.policy = {.compute_dtype = DType::f16}});
      nn::SGD opt(mlp.parameters(), {.lr = 0.0});
      nn::GradScaler scaler({.enabled = use_scaler});
      const Tensor loss = scaler_loss(mlp, 2 * comm.rank(), 2 * comm.rank() + 2, kSmall);
      scaler.scale(loss).backward();
      scaler.unscale_(opt, &comm);
      std::vector<Tensor> got, want;
      const std::vector<nn::Param> params = mlp.parameters();
      for (std::size_t i = 0; i < params.size(); ++i) {
        REQUIRE(params[i].grad().dtype() == DType::f32);
        got.push_back(params[i].grad().slice(0, 0, params[i].shard()->real_elements()));
        want.push_back(own_part(params[i], dense_grads[i]));
      }
      (use_scaler ? scaled_error : unscaled_error)[comm.rank()] = relative_error(got, want);
      CHECK(scaler.step(opt, &comm));
      scaler.update();
    }
  });
  for (int rank = 0; rank < 2; ++rank) {
    CAPTURE(rank);
    CHECK(unscaled_error[rank] > 0.5);  // measured 0.89-1.06
    CHECK(scaled_error[rank] < 1e-2);   // measured 5e-4
  }
}

TEST_CASE("GradScaler: with a power-of-two scale, a step equals the unscaled step bit for bit") {
  auto train = [](bool scaled) {
    nn::manual_seed(3);
    nn::MLP mlp(8, 16);
    nn::AdamW opt(mlp.parameters(), {.lr = 1e-2});
    nn::GradScaler scaler;
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      const Tensor loss = scaler_loss(mlp, 0, 4, 0.25);
      if (scaled) {
        scaler.scale(loss).backward();
        CHECK(scaler.step(opt));
        scaler.update();
      } else {
        loss.backward();
        opt.step();
      }
    }
    return values_of(mlp);
  };
  CHECK(train(true) == train(false));
}

TEST_CASE("GradScaler: an inf on one rank's slice skips the step on every rank; the scale backs off and grows") {
  run_ranks(2, [](Communicator& comm) {
    nn::manual_seed(2);
    nn::MLP mlp(8, 16);
    nn::fully_shard(mlp, comm);
    nn::SGD opt(mlp.parameters(), {.lr = 0.1});
    nn::GradScaler scaler({.init_scale = 1024.0, .growth_interval = 2});
    auto snapshot = [&] { return values_of(mlp); };
    // Poisoned: no communicator given, the ranks agree over the one fully_shard bound.
    auto iteration = [&](bool poison) {
      opt.zero_grad();
      scaler.scale(scaler_loss(mlp, 2 * comm.rank(), 2 * comm.rank() + 2, 0.25)).backward();
      if (poison && comm.rank() == 1) {
        Tensor g = mlp.fc2->bias.grad();  // rank 1's slice only
        g.slice(0, 0, 1).fill_(std::numeric_limits<double>::infinity());
      }
      const bool stepped = poison ? scaler.step(opt) : scaler.step(opt, &comm);
      scaler.update();
      return stepped;
    };
    const auto before = snapshot();
    CHECK_FALSE(iteration(true));
    CHECK(snapshot() == before);  // on rank 0 too, whose slices were finite
    CHECK(opt.steps() == 0);
    CHECK(scaler.scale_value() == 512.0);
    CHECK(iteration(false));
    CHECK(scaler.scale_value() == 512.0);
    CHECK(scaler.growth_tracker() == 1);
    CHECK(iteration(false));
    CHECK(scaler.scale_value() == 1024.0);  // two clean steps
    CHECK(scaler.growth_tracker() == 0);
    CHECK(opt.steps() == 2);
    CHECK(snapshot() != before);
    // A NaN is found too, on rank 0's slices alone.
    opt.zero_grad();
    scaler.scale(scaler_loss(mlp, 0, 2, comm.rank() == 0 ? std::nan("") : 0.25)).backward();
    const auto nan_before = snapshot();
    CHECK_FALSE(scaler.step(opt, &comm));
    CHECK(snapshot() == nan_before);
    scaler.update();
    CHECK(scaler.scale_value() == 512.0);
  });
  // Sharded without a communicator of its own (ShardedParameter): the caller's is required.
  run_ranks(2, [](Communicator& comm) {
    const nn::Param full(from_values({1, 2, 3}, {3}));
    const nn::Param shard = nn::ShardedParameter::from_full(full, comm.rank(), 2, "w").param();
    shard.data().set_grad(ones(shard.data().shape()));
    nn::SGD opt({shard}, {.lr = 0.1});
    nn::GradScaler scaler;
    test::check_throws<nn::ShardingError>([&] { scaler.step(opt); },
                                          {"GradScaler::step", "need a communicator to agree on infinities over"});
    CHECK(shard.grad().to_vector<double>() == std::vector<double>(shard.data().numel(), 1.0));  // not divided
    CHECK(scaler.step(opt, &comm));
    CHECK(shard.grad().to_vector<double>() == std::vector<double>(shard.data().numel(), 1.0 / 65536));
  });
}

TEST_CASE("GradScaler: a rank out of memory while unscaling: every rank raises, none steps, update backs off") {
  run_ranks(2, [](Communicator& comm) {
    nn::manual_seed(2);
    nn::MLP mlp(8, 16);
    nn::fully_shard(mlp, comm);
    nn::SGD opt(mlp.parameters(), {.lr = 0.1});
    nn::GradScaler scaler;
    auto snapshot = [&] { return values_of(mlp); };
    scaler.scale(scaler_loss(mlp, 2 * comm.rank(), 2 * comm.rank() + 2, 0.25)).backward();
    const auto before = snapshot();
    // Rank 1 holds 16 MB more than the limit leaves it; rank 0 has room. (The agreements that
    // order the limit's changes are exempt from it.)
    const double live = agree_on_max(comm, {static_cast<double>(memory::stats().live_bytes)}, "live")[0];
    Tensor ballast;
    if (comm.rank() == 1) ballast = zeros({std::int64_t{4} << 20});
    agree_on_max(comm, {0}, "ballast made");
    if (comm.rank() == 0) memory::set_limit(static_cast<std::int64_t>(live) + (std::int64_t{8} << 20));
    agree_on_max(comm, {0}, "limit set");
    if (comm.rank() == 1) {
      CHECK_THROWS_AS(scaler.step(opt, &comm), OutOfMemoryError);
    } else {
      test::check_throws<RankFailedError>([&] { scaler.step(opt, &comm); },
                                          {"GradScaler::step", "another rank failed while unscaling"});
    }
    agree_on_max(comm, {0}, "step refused");
    if (comm.rank() == 0) memory::set_limit(0);
    agree_on_max(comm, {0}, "limit lifted");
    CHECK(snapshot() == before);
    CHECK(opt.steps() == 0);
    test::check_throws<ArgumentError>([&] { scaler.step(opt, &comm); }, {"unscale_() failed", "call update()"});
    scaler.update();
    CHECK(scaler.scale_value() == 32768.0);
    opt.zero_grad();
    scaler.scale(scaler_loss(mlp, 2 * comm.rank(), 2 * comm.rank() + 2, 0.25)).backward();
    CHECK(scaler.step(opt, &comm));
    CHECK(snapshot() != before);
  });
}

TEST_CASE("GradScaler: an iteration abandoned after unscale_() is not stepped on by the next one's step()") {
  // The scaler remembered the optimizer as unscaled: the next iteration's step() skipped its
  // unscale, and stepped on gradients 65536x their size (found by a lifetime probe; 1024x there).
  auto train = [](bool abandon) {
    nn::manual_seed(3);
    nn::MLP mlp(8, 16);
    nn::SGD opt(mlp.parameters(), {.lr = 0.1});
    nn::GradScaler scaler;
    if (abandon) {
      scaler.scale(scaler_loss(mlp, 0, 4, 0.25)).backward();
      scaler.unscale_(opt);  // ... then the iteration throws (a check on the gradients, say)
      opt.zero_grad();
      scaler.scale(scaler_loss(mlp, 0, 4, 0.25)).backward();
      test::check_throws<ArgumentError>([&] { (void)scaler.step(opt); },
                                        {"GradScaler::step", "a backward ran after unscale_()", "update()"});
      scaler.update();  // ends the abandoned iteration
    }
    opt.zero_grad();
    scaler.scale(scaler_loss(mlp, 0, 4, 0.25)).backward();
    CHECK(scaler.step(opt));
    scaler.update();
    return values_of(mlp);
  };
  CHECK(train(true) == train(false));  // one clean step from the same weights, bit for bit
}

TEST_CASE("GradScaler: calls out of order, f16 gradients and bad options are refused; disabled passes through") {
  nn::manual_seed(1);
  nn::MLP mlp(4, 8);
  nn::SGD opt(mlp.parameters(), {.lr = 0.1});
  nn::GradScaler scaler;
  test::check_throws<ArgumentError>([&] { scaler.update(); }, {"GradScaler::update", "no unscale_() or step()"});
  scaler.scale(sum(mlp.forward(ones({2, 4})))).backward();
  const std::vector<double> scaled = mlp.fc2->bias.grad().to_vector<double>();
  scaler.unscale_(opt);
  test::check_throws<ArgumentError>([&] { scaler.unscale_(opt); }, {"GradScaler::unscale_", "unscale_() already ran"});
  const std::vector<double> unscaled = mlp.fc2->bias.grad().to_vector<double>();
  for (std::size_t i = 0; i < scaled.size(); ++i) CHECK(unscaled[i] == scaled[i] / 65536.0);  // divided once
  test::check_throws<ArgumentError>([&] { scaler.load_state(scaler.state()); }, {"load between iterations"});
  CHECK(scaler.step(opt));
  test::check_throws<ArgumentError>([&] { scaler.step(opt); }, {"GradScaler::step", "step() already ran"});
  scaler.update();

  // f16 gradients: refused before any is divided.
  nn::manual_seed(1);
  nn::MLP half(4, 8);
  for (const nn::Param& p : half.parameters()) p.set_data(cast(p.data(), DType::f16));
  nn::SGD half_opt(half.parameters(), {.lr = 0.1});
  nn::GradScaler small({.init_scale = 4.0});  // 65536 would overflow these f16 gradients
  small.scale(sum(cast(half.forward(ones({2, 4}, DType::f16)), DType::f32))).backward();
  const std::vector<double> kept = half.fc1->weight.grad().to_vector<double>();
  test::check_throws<DTypeError>([&] { small.step(half_opt); }, {"GradScaler::step", "f16 gradient", "f32"});
  CHECK(half.fc1->weight.grad().to_vector<double>() == kept);
  test::check_throws<DTypeError>([&] { scaler.scale(ones({1}, DType::i64)); }, {"GradScaler::scale", "i64"});

  // No gradient at all (no backward on the scaled loss): refused, as PyTorch's "No inf checks".
  opt.zero_grad();
  test::check_throws<ArgumentError>([&] { scaler.step(opt); }, {"GradScaler::step", "no parameter", "has a gradient"});
  // The scale stays within f32's normal range: backoff stops at the smallest (below it 1/scale
  // overflowed f32 and every later step was skipped; 0 was saved), growth at the largest.
  nn::GradScaler low({.init_scale = 1e-37, .backoff_factor = 1e-10, .growth_interval = 1});
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    low.scale(sum(mlp.forward(ones({2, 4}))) * std::nan("")).backward();
    CHECK_FALSE(low.step(opt));
    low.update();
    CHECK(low.scale_value() == nn::GradScaler::kMinScale);
  }
  opt.zero_grad();
  low.scale(sum(mlp.forward(ones({2, 4})))).backward();
  CHECK(low.step(opt));  // a clean step steps at the smallest scale
  low.update();
  CHECK(low.scale_value() == 2 * nn::GradScaler::kMinScale);
  nn::GradScaler().load_state(low.state());  // what it saves loads
  nn::GradScaler high({.init_scale = nn::GradScaler::kMaxScale, .growth_interval = 1});
  opt.zero_grad();
  high.scale(sum(mlp.forward(ones({2, 4}))) * 0.0).backward();
  high.step(opt);
  high.update();
  CHECK(high.scale_value() == nn::GradScaler::kMaxScale);

  for (const auto& [options, fragment] : std::vector<std::pair<nn::GradScalerOptions, std::string>>{
           {{.init_scale = 1e-39}, "init_scale must be in ["},
           {{.init_scale = 1e39}, "init_scale must be in ["},
           {{.init_scale = 0}, "init_scale"},
           {{.init_scale = std::numeric_limits<double>::infinity()}, "init_scale"},
           {{.growth_factor = 1.0}, "growth_factor"},
           {{.backoff_factor = 1.0}, "backoff_factor"},
           {{.backoff_factor = std::nan("")}, "backoff_factor"},
           {{.growth_interval = 0}, "growth_interval"}}) {
    test::check_throws<ArgumentError>([&] { nn::GradScaler bad(options); }, {"GradScaler", fragment});
  }

  // Disabled: the loss as it is, every step taken, update a no-op.
  nn::GradScaler off({.enabled = false});
  const Tensor loss = sum(mlp.forward(ones({2, 4})));
  CHECK(off.scale(loss).item() == loss.item());
  for (int i = 0; i < 2; ++i) {
    opt.zero_grad();
    off.scale(sum(mlp.forward(ones({2, 4})))).backward();
    off.unscale_(opt);
    const std::int64_t before = opt.steps();
    CHECK(off.step(opt));
    CHECK(opt.steps() == before + 1);
    off.update();
  }
  off.update();  // without a step too
  CHECK(off.scale_value() == 65536.0);
}

TEST_CASE("GradScaler: its scale and growth tracker ride in a checkpoint's extra state and load back exactly") {
  test::TempDir tmp;
  run_ranks(1, [&](Communicator& comm) {
    nn::manual_seed(1);
    nn::MLP mlp(4, 8);
    nn::SGD opt(mlp.parameters(), {.lr = 0.1});
    nn::GradScaler scaler({.init_scale = 3.0e-5, .backoff_factor = 0.3, .growth_interval = 5});
    for (int i = 0; i < 4; ++i) {
      opt.zero_grad();
      scaler.scale(sum(mlp.forward(ones({2, 4}))) * (i == 0 ? std::nan("") : 1.0)).backward();
      scaler.step(opt);
      scaler.update();
    }
    REQUIRE(scaler.growth_tracker() == 3);
    REQUIRE(scaler.scale_value() == 3.0e-5 * 0.3);  // 8.999999999999999e-06: not a short decimal
    std::map<std::string, std::string> extra = {{"model", "mlp"}};
    extra.merge(scaler.state());
    nn::save_checkpoint(tmp.path.string(), 3, mlp, &opt, comm, extra);

    nn::GradScaler resumed({.growth_interval = 5});
    const nn::CheckpointInfo info = nn::load_checkpoint(tmp.path.string(), mlp, &opt, comm);
    resumed.load_state(info.extra);
    CHECK(resumed.scale_value() == scaler.scale_value());  // bit for bit
    CHECK(resumed.growth_tracker() == 3);
    nn::GradScaler untouched;
    untouched.load_state({{"model", "mlp"}});  // saved without a scaler: left as it is
    CHECK(untouched.scale_value() == 65536.0);
  });
  nn::GradScaler scaler({.growth_interval = 5});
  for (const auto& [extra, fragment] : std::vector<std::pair<std::map<std::string, std::string>, std::string>>{
           {{{"grad_scaler.scale", "1024"}}, "without grad_scaler.growth_tracker"},
           {{{"grad_scaler.scale", "-1"}, {"grad_scaler.growth_tracker", "0"}}, "'-1'"},
           {{{"grad_scaler.scale", "inf"}, {"grad_scaler.growth_tracker", "0"}}, "'inf'"},
           {{{"grad_scaler.scale", "0"}, {"grad_scaler.growth_tracker", "0"}}, "'0'"},
           {{{"grad_scaler.scale", "1e-320"}, {"grad_scaler.growth_tracker", "0"}}, "'1e-320'"},
           {{{"grad_scaler.scale", "12x"}, {"grad_scaler.growth_tracker", "0"}}, "'12x'"},
           {{{"grad_scaler.scale", "8"}, {"grad_scaler.growth_tracker", "5"}}, "growth_interval 5"},
           {{{"grad_scaler.scale", "8"}, {"grad_scaler.growth_tracker", "-1"}}, "'-1'"}}) {
    test::check_throws<IOError>([&] { scaler.load_state(extra); }, {"GradScaler::load_state", fragment});
  }
  CHECK(scaler.scale_value() == 65536.0);
}
