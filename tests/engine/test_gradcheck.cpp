// Every differentiable op against central finite differences in f64, including broadcasting
// and non-last axes. Runs once per backend.
#include "helpers.h"

using namespace ruda;

namespace {
using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

Tensor input(const Shape& shape, std::uint64_t seed, double low = -1.5, double high = 1.5) {
  return uniform(shape, low, high, seed, 0, DType::f64).set_requires_grad();
}
// Values away from 0, where abs/relu kinks would defeat finite differences.
Tensor away_from_zero(const Shape& shape, std::uint64_t seed) {
  const Tensor u = uniform(shape, 0.2, 1.5, seed, 0, DType::f64);
  const Tensor sign = where(gt(rand(shape, seed + 1, 0, DType::f64), scalar(0.5, DType::f64)), scalar(1.0, DType::f64),
                            scalar(-1.0, DType::f64));
  return (u * sign).detach().set_requires_grad();
}

void check(const char* what, const Fn& f, const std::vector<Tensor>& inputs, GradcheckOptions options = {}) {
  CAPTURE(what);
  const GradcheckResult r = gradcheck(f, inputs, options);
  CHECK_MESSAGE(r.ok, what << ": " << r.message);
}
}  // namespace

TEST_CASE("arithmetic with broadcasting") {
  const Tensor a = input({2, 3}, 1), b = input({3}, 2), c = input({2, 1}, 3);
  check("add", [](auto& x) { return x[0] + x[1]; }, {a, b});
  check("sub", [](auto& x) { return x[0] - x[1]; }, {a, c});
  check("mul", [](auto& x) { return x[0] * x[1]; }, {a, c});
  check("div", [](auto& x) { return x[0] / x[1]; }, {a, away_from_zero({3}, 4)});
  check("pow", [](auto& x) { return pow(x[0], x[1]); }, {input({2, 3}, 5, 0.5, 2.0), b});
  check("pow scalar", [](auto& x) { return pow(x[0], 3.0); }, {a});
  check("maximum", [](auto& x) { return maximum(x[0], x[1]); }, {a, b});
  check("minimum", [](auto& x) { return minimum(x[0], x[1]); }, {a, c});
  check("where", [](auto& x) { return where(gt(x[0], scalar(0.0, DType::f64)), x[0] * 2.0, x[1]); }, {a, b});
  check("clamp", [](auto& x) { return clamp(x[0], -0.7, 0.9); }, {input({4, 3}, 6)});
  check("scalar ops", [](auto& x) { return (2.0 - x[0]) * 3.0 / (x[0] * x[0] + 1.0); }, {a});
}

TEST_CASE("unary functions") {
  const Tensor x = input({3, 4}, 10), pos = input({3, 4}, 11, 0.3, 2.0), nz = away_from_zero({3, 4}, 12);
  check("neg", [](auto& v) { return neg(v[0]); }, {x});
  check("abs", [](auto& v) { return abs(v[0]); }, {nz});
  check("exp", [](auto& v) { return exp(v[0]); }, {x});
  check("log", [](auto& v) { return log(v[0]); }, {pos});
  check("sqrt", [](auto& v) { return sqrt(v[0]); }, {pos});
  check("rsqrt", [](auto& v) { return rsqrt(v[0]); }, {pos});
  check("square", [](auto& v) { return square(v[0]); }, {x});
  check("reciprocal", [](auto& v) { return reciprocal(v[0]); }, {nz});
  check("tanh", [](auto& v) { return tanh(v[0]); }, {x});
  check("sigmoid", [](auto& v) { return sigmoid(v[0]); }, {x});
  check("relu", [](auto& v) { return relu(v[0]); }, {nz});
  check("gelu erf", [](auto& v) { return gelu(v[0]); }, {x});
  check("gelu tanh", [](auto& v) { return gelu(v[0], GeluApproximation::tanh); }, {x});
  check("silu", [](auto& v) { return silu(v[0]); }, {x});
  check("softplus", [](auto& v) { return softplus(v[0]); }, {x});
  check("erf", [](auto& v) { return erf(v[0]); }, {x});
  check("erf, large inputs", [](auto& v) { return erf(v[0]); }, {input({3, 4}, 13, -3.0, 3.0)});
  check("dropout", [](auto& v) { return dropout(v[0], 0.3, 99); }, {x});
}

TEST_CASE("reductions over one, several and non-last axes") {
  const Tensor x = input({2, 3, 4}, 20);
  check("sum all", [](auto& v) { return sum(v[0]); }, {x});
  check("sum axis 1", [](auto& v) { return sum(v[0], {1}); }, {x});
  check("sum axes 0,2 keepdim", [](auto& v) { return sum(v[0], {0, 2}, true); }, {x});
  check("mean axis 0", [](auto& v) { return mean(v[0], {0}); }, {x});
  check("max axis 2", [](auto& v) { return max(v[0], {2}); }, {x});
  check("min axes 0,1", [](auto& v) { return min(v[0], {0, 1}); }, {x});
  check("max all", [](auto& v) { return max(v[0]); }, {x});
  check("logsumexp axis 1", [](auto& v) { return logsumexp(v[0], {1}); }, {x});
  check("logsumexp axes 0,2", [](auto& v) { return logsumexp(v[0], {0, 2}, true); }, {x});
  check("sum_to", [](auto& v) { return sum_to(v[0], {3, 1}); }, {x});
}

TEST_CASE("shape ops") {
  const Tensor x = input({2, 3, 4}, 30);
  check("reshape", [](auto& v) { return reshape(v[0], {4, 6}) * arange(0, 6, 1, DType::f64); }, {x});
  check("permute", [](auto& v) { return permute(v[0], {2, 0, 1}) * arange(0, 3, 1, DType::f64); }, {x});
  check("transpose", [](auto& v) { return transpose(v[0], 0, 2); }, {x});
  check("slice inner axis", [](auto& v) { return slice(v[0], 2, 1, 3); }, {x});
  check("slice rows", [](auto& v) { return slice(v[0], 0, 1, 2); }, {x});
  check("slice_assign", [](auto& v) { return slice_assign(v[0], 1, 0, 2, v[1]); }, {x, input({2, 2, 4}, 31)});
  check("concat axis 2", [](auto& v) { return concat({v[0], v[1]}, 2); }, {x, input({2, 3, 2}, 32)});
  check("stack", [](auto& v) { return stack({v[0], v[1] * 2.0}, 1); }, {input({3, 2}, 33), input({3, 2}, 34)});
  check("expand", [](auto& v) { return expand(v[0], {3, 2, 4}); }, {input({2, 1}, 35)});
  check("squeeze and flatten", [](auto& v) { return flatten(squeeze(v[0], 1)); }, {input({2, 1, 3}, 36)});
}

TEST_CASE("matmul, linear, embedding, take_along_axis, softmax") {
  check("matmul 2-D", [](auto& v) { return matmul(v[0], v[1]); }, {input({3, 4}, 40), input({4, 2}, 41)});
  check("matmul batch x 2-D", [](auto& v) { return matmul(v[0], v[1]); }, {input({2, 3, 4}, 42), input({4, 2}, 43)});
  check("matmul 2-D x batch", [](auto& v) { return matmul(v[0], v[1]); }, {input({3, 4}, 44), input({2, 4, 2}, 45)});
  check("matmul broadcast batch", [](auto& v) { return matmul(v[0], v[1]); },
        {input({2, 1, 3, 4}, 46), input({1, 3, 4, 2}, 47)});
  check("linear", [](auto& v) { return linear(v[0], v[1], v[2]); },
        {input({2, 3, 4}, 48), input({4, 5}, 49), input({5}, 50)});
  check("linear, [out, in] weight", [](auto& v) { return linear(v[0], v[1], v[2], WeightLayout::out_in); },
        {input({2, 3, 4}, 58), input({5, 4}, 59), input({5}, 60)});
  check("linear_gelu", [](auto& v) { return linear_gelu(v[0], v[1], v[2]); },
        {input({2, 3, 4}, 61), input({4, 5}, 62), input({5}, 63)});
  check("linear_gelu recomputing",
        [](auto& v) {
          return linear_gelu(v[0], v[1], v[2], GeluApproximation::erf, WeightLayout::in_out, GeluBackward::recompute);
        },
        {input({2, 3, 4}, 66), input({4, 5}, 67), input({5}, 68)});
  check("linear_gelu tanh, [out, in], no bias",
        [](auto& v) { return linear_gelu(v[0], v[1], Tensor(), GeluApproximation::tanh, WeightLayout::out_in); },
        {input({3, 4}, 64), input({5, 4}, 65)});
  const Tensor idx = from_vector<std::int64_t>({3, 0, 3, 1, 4, 3}, {2, 3});
  check("embedding", [idx](auto& v) { return embedding(v[0], idx); }, {input({5, 2}, 51)});
  const Tensor picks = from_vector<std::int64_t>({2, 0, 0, 1, 1, 1}, {3, 2});
  check("take_along_axis last", [picks](auto& v) { return take_along_axis(v[0], picks, 1); }, {input({3, 4}, 52)});
  check("take_along_axis first", [picks](auto& v) { return take_along_axis(v[0], picks.slice(0, 0, 1), 0); },
        {input({3, 2}, 53)});
  check("softmax last", [](auto& v) { return softmax(v[0], -1); }, {input({3, 5}, 54)});
  check("softmax axis 0", [](auto& v) { return softmax(v[0], 0); }, {input({3, 5}, 55)});
  check("log_softmax middle", [](auto& v) { return log_softmax(v[0], 1); }, {input({2, 3, 4}, 56)});
  // Through f32 the function is only f32-accurate: a wider step and tolerance.
  check(
      "cast round trip", [](auto& v) { return cast(cast(v[0], DType::f32), DType::f64); }, {input({3}, 57)},
      GradcheckOptions{.eps = 1e-3, .atol = 1e-3, .rtol = 1e-3});
}

TEST_CASE("fused layer_norm") {
  check("layer_norm affine", [](auto& v) { return layer_norm(v[0], v[1], v[2]); },
        {input({3, 2, 6}, 63), input({6}, 64), input({6}, 65)});
  check("layer_norm plain", [](auto& v) { return layer_norm(v[0], Tensor(), Tensor(), 1e-3); }, {input({4, 5}, 66)});
  check("layer_norm weight only", [](auto& v) { return layer_norm(v[0], v[1], Tensor()); },
        {input({3, 6}, 67), input({6}, 68)});
  check("layer_norm bias only", [](auto& v) { return layer_norm(v[0], Tensor(), v[1]); },
        {input({3, 6}, 69), input({6}, 70)});
}

TEST_CASE("a composite: layer normalization") {
  auto layer_norm = [](auto& v) {
    const Tensor mu = mean(v[0], {-1}, true);
    const Tensor centered = v[0] - mu;
    const Tensor var = mean(centered * centered, {-1}, true);
    return centered * rsqrt(var + 1e-5) * v[1] + v[2];
  };
  check("layer norm", layer_norm, {input({4, 6}, 60), input({6}, 61), input({6}, 62)});
}
