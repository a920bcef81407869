// Forward and backward values of layers, losses and a short training run against values PyTorch
// computed (tests/data/golden.json, made by tests/data/make_golden.py).
#include <fstream>

#include <nlohmann/json.hpp>

#include "helpers.h"

using namespace ruda;

namespace {
const nlohmann::json& golden() {
  static const nlohmann::json data = [] {
    std::ifstream in(RUDA_TEST_DATA "/golden.json");
    if (!in) throw std::runtime_error("cannot open " RUDA_TEST_DATA "/golden.json");
    return nlohmann::json::parse(in);
  }();
  return data;
}

Tensor load(const nlohmann::json& entry, DType dtype = DType::f64) {
  return from_values(entry.at("values").get<std::vector<double>>(), entry.at("shape").get<Shape>(), dtype);
}
Tensor load(const char* group, const char* name, DType dtype = DType::f64) {
  return load(golden().at(group).at(name), dtype);
}
Tensor param(const char* group, const char* name) { return load(group, name).set_requires_grad(); }

void check(const Tensor& got, const char* group, const char* name, double tol = 1e-10) {
  INFO(group << "." << name);
  test::check_close(got, load(group, name), tol, tol);
}
}  // namespace

TEST_CASE("Linear forward and backward match PyTorch") {
  Tensor x = param("linear", "x"), w = param("linear", "w"), b = param("linear", "b");
  const Tensor y = linear(x, w, b);
  check(y, "linear", "y");
  sum(y * load("linear", "r")).backward();
  check(x.grad(), "linear", "grad_x");
  check(w.grad(), "linear", "grad_w");
  check(b.grad(), "linear", "grad_b");
}

TEST_CASE("LayerNorm forward and backward match PyTorch") {
  nn::LayerNorm ln(6);
  ln.weight.set_data(load("layer_norm", "weight"));
  ln.bias.set_data(load("layer_norm", "bias"));
  Tensor x = param("layer_norm", "x");
  const Tensor y = ln.forward(x);
  check(y, "layer_norm", "y");
  sum(y * load("layer_norm", "r")).backward();
  check(x.grad(), "layer_norm", "grad_x");
  check(ln.weight.grad(), "layer_norm", "grad_weight");
  check(ln.bias.grad(), "layer_norm", "grad_bias");
}

TEST_CASE("activations match PyTorch") {
  const std::vector<std::pair<std::string, std::function<Tensor(const Tensor&)>>> acts = {
      {"act_gelu", [](const Tensor& v) { return gelu(v); }},
      {"act_gelu_tanh", [](const Tensor& v) { return gelu(v, GeluApproximation::tanh); }},
      {"act_silu", [](const Tensor& v) { return silu(v); }},
      {"act_softplus", [](const Tensor& v) { return softplus(v); }},
      {"act_sigmoid", [](const Tensor& v) { return sigmoid(v); }},
      {"act_tanh", [](const Tensor& v) { return tanh(v); }}};
  for (const auto& [name, f] : acts) {
    Tensor x = param(name.c_str(), "x");
    const Tensor y = f(x);
    check(y, name.c_str(), "y", 1e-9);
    sum(y).backward();
    check(x.grad(), name.c_str(), "grad_x", 1e-9);
  }
}

TEST_CASE("cross-entropy with ignore_index, class weights and label smoothing matches PyTorch") {
  Tensor logits = param("cross_entropy", "logits");
  const Tensor targets = load("cross_entropy", "targets").to(DType::i64);
  const Tensor loss = nn::cross_entropy(
      logits, targets, {.ignore_index = -100, .label_smoothing = 0.1, .weight = load("cross_entropy", "weight")});
  check(loss.reshape({1}), "cross_entropy", "loss");
  loss.backward();
  check(logits.grad(), "cross_entropy", "grad_logits");
}

TEST_CASE("causal self-attention matches PyTorch") {
  nn::CausalSelfAttention attn(6, 2);
  attn.qkv->weight.set_data(load("attention", "wqkv"));
  attn.qkv->bias.set_data(load("attention", "bqkv"));
  attn.proj->weight.set_data(load("attention", "wproj"));
  attn.proj->bias.set_data(load("attention", "bproj"));
  Tensor x = param("attention", "x");
  const Tensor y = attn.forward(x);
  check(y, "attention", "y");
  sum(y * load("attention", "r")).backward();
  check(x.grad(), "attention", "grad_x");
  check(attn.qkv->weight.grad(), "attention", "grad_wqkv");
  check(attn.proj->weight.grad(), "attention", "grad_wproj");
}

TEST_CASE("an AdamW training run matches PyTorch step by step") {
  const auto& g = golden().at("training");
  const Tensor x = load(g.at("X"), DType::f32);
  const Tensor y = load(g.at("Y"), DType::i64);
  nn::Param w1(load(g.at("init_w1"), DType::f32)), b1(load(g.at("init_b1"), DType::f32)),
      w2(load(g.at("init_w2"), DType::f32)), b2(load(g.at("init_b2"), DType::f32));
  nn::AdamW opt({w1, b1, w2, b2}, {.lr = 0.01, .weight_decay = 0.01});
  const auto want = g.at("losses").at("values").get<std::vector<double>>();
  for (std::size_t step = 0; step < want.size(); ++step) {
    const Tensor loss = nn::cross_entropy(linear(relu(linear(x, w1.value(), b1.value())), w2.value(), b2.value()), y);
    CHECK(loss.item() == doctest::Approx(want[step]).epsilon(1e-5));
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  test::check_close(w1.data(), load(g.at("final_w1")), 1e-5, 1e-4);
  test::check_close(b1.data(), load(g.at("final_b1")), 1e-5, 1e-4);
  test::check_close(w2.data(), load(g.at("final_w2")), 1e-5, 1e-4);
  test::check_close(b2.data(), load(g.at("final_b2")), 1e-5, 1e-4);
}

TEST_CASE("parameter groups (own weight decay and learning rate) match PyTorch's param_groups: AdamW, Adam, SGD") {
  const auto& g = golden().at("training");
  const Tensor x = load(g.at("X"), DType::f32);
  const Tensor y = load(g.at("Y"), DType::i64);
  for (const char* kind : {"adamw", "adam", "sgd"}) {
    CAPTURE(kind);
    const auto& want = golden().at("param_groups").at(kind);
    nn::Param w1(load(g.at("init_w1"), DType::f32)), b1(load(g.at("init_b1"), DType::f32)),
        w2(load(g.at("init_w2"), DType::f32)), b2(load(g.at("init_b2"), DType::f32));
    // The weights decay; the biases do not, at half the base rate.
    auto groups = [&](double decay) {
      return std::vector<nn::ParamGroup>{{.name = "weights", .params = {w1, w2}, .weight_decay = decay},
                                         {.name = "biases", .params = {b1, b2}, .lr_scale = 0.5, .weight_decay = 0.0}};
    };
    std::unique_ptr<nn::Optimizer> opt;
    if (std::string(kind) == "adamw") opt = std::make_unique<nn::AdamW>(groups(0.1), nn::AdamWOptions{.lr = 0.01});
    if (std::string(kind) == "adam") opt = std::make_unique<nn::Adam>(groups(0.05), nn::AdamOptions{.lr = 0.01});
    if (std::string(kind) == "sgd") {
      opt = std::make_unique<nn::SGD>(groups(0.05), nn::SGDOptions{.lr = 0.01, .momentum = 0.9});
    }
    REQUIRE(opt);
    const auto losses = want.at("losses").at("values").get<std::vector<double>>();
    for (double expected : losses) {
      const Tensor loss = nn::cross_entropy(linear(relu(linear(x, w1.value(), b1.value())), w2.value(), b2.value()), y);
      CHECK(loss.item() == doctest::Approx(expected).epsilon(1e-5));
      opt->zero_grad();
      loss.backward();
      opt->step();
    }
    test::check_close(w1.data(), load(want.at("final_w1")), 1e-5, 1e-4);
    test::check_close(b1.data(), load(want.at("final_b1")), 1e-5, 1e-4);
    test::check_close(w2.data(), load(want.at("final_w2")), 1e-5, 1e-4);
    test::check_close(b2.data(), load(want.at("final_b2")), 1e-5, 1e-4);
  }
}

TEST_CASE("Adam and AdamW in f32 match PyTorch's f32 steps, each parameter counting its own steps") {
  // 4096 values through three steps at lr 0.1, and a parameter whose first gradient comes in the
  // second step. Within four ulps of the update size (~0.1: 3e-8, three steps of rounding) plus two of the value: the
  // rest is rounding order (the compiler may fuse a multiply-add PyTorch rounds twice). 1 - float(0.999) for 1 - beta2
  // (11 ulp off) moved values by ~7e-7, and one optimizer-wide step count corrected the late parameter as if it had
  // taken three steps (~1e-2).
  for (const bool decoupled : {false, true}) {
    CAPTURE(decoupled);
    const auto& c = golden().at("adam_f32").at(decoupled ? "adamw" : "adam");
    nn::Param p(load(c.at("p0"), DType::f32)), q(load(c.at("q0"), DType::f32));
    nn::Adam opt({p, q}, {.lr = 0.1, .weight_decay = decoupled ? 0.1 : 0.01, .decoupled_weight_decay = decoupled});
    const char* const grads[] = {"g0", "g1", "g2"};
    const char* const q_grads[] = {nullptr, "qg1", "qg2"};
    for (int i = 0; i < 3; ++i) {
      opt.zero_grad();
      p.data().set_grad(load(c.at(grads[i]), DType::f32));
      if (q_grads[i]) q.data().set_grad(load(c.at(q_grads[i]), DType::f32));
      opt.step();
    }
    test::check_close(p.data(), load(c.at("p3")), 0, 0);
    test::check_close(q.data(), load(c.at("q3")), 0, 0);
  }
}
