// Values of every op against hand-computed results, for each dtype that applies. Runs once per
// backend (RUDA_BACKEND): this is the conformance suite.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <numbers>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "helpers.h"

using namespace ruda;
using test::values;

namespace {
const DType kFloatTypes[] = {DType::f32, DType::f64, DType::bf16, DType::f16};
// Tolerances that fit a dtype's precision.
double tol(DType d) {
  switch (d) {
    case DType::bf16:
      return 1e-2;
    case DType::f16:
      return 2e-3;
    case DType::f32:
      return 2e-6;
    default:
      return 1e-12;
  }
}

// Element i of v, read through a volatile function pointer: a call the optimizer cannot see into,
// so the vector's stored bytes are what is compared.
template <class T>
T element_of(const std::vector<T>& v, std::size_t i) {
  return v.at(i);
}
template <class T>
T element(const std::vector<T>& v, std::size_t i) {
  T (*volatile read)(const std::vector<T>&, std::size_t) = &element_of<T>;
  return read(v, i);
}
}  // namespace

// GCC 12 stored constant initializers whose elements are all equal but the last as a broadcast of
// the first under some tunings and with AVX-512 (CMakeLists.txt chooses flags that avoid it, and
// configuring checks them): this build's own code must keep every element.
TEST_CASE("constant initializers keep every element in this build") {
  const Shape shape{100, 100, 100, 0};
  CHECK(element(shape, 0) == 100);
  CHECK(element(shape, 3) == 0);
  const std::vector<double> coefficients{1, 1, 0, 0};
  CHECK(element(coefficients, 2) == 0.0);
  const std::vector<float> mask{1, 1, 1, 1, 1, 1, 1, 0};
  CHECK(element(mask, 7) == 0.0f);
  CHECK(zeros({100, 100, 100, 0}).shape() == Shape{100, 100, 100, 0});
  CHECK(zeros({100, 100, 100, 0}).numel() == 0);
}

TEST_CASE("creation") {
  CHECK_CLOSE(zeros({2, 2}), {0, 0, 0, 0}, {2, 2});
  CHECK_CLOSE(ones({3}, DType::f64), {1, 1, 1}, {3});
  CHECK_CLOSE(full({2}, 2.5, DType::bf16), {2.5, 2.5}, {2});
  CHECK_CLOSE(arange(0, 5), {0, 1, 2, 3, 4}, {5});
  CHECK_CLOSE(arange(1, 2, 0.25, DType::f64), {1, 1.25, 1.5, 1.75}, {4});
  CHECK_CLOSE(arange(3, 0, -1, DType::i64), {3, 2, 1}, {3});
  CHECK(zeros({0, 3}).numel() == 0);
  CHECK(scalar(4.0).shape().empty());
  CHECK(scalar(4.0).item() == 4.0);
  const std::vector<float> raw = {1, 2, 3, 4, 5, 6};
  CHECK_CLOSE(from_buffer(raw.data(), {3, 2}, DType::f32), {1, 2, 3, 4, 5, 6}, {3, 2});
  CHECK(from_vector<std::int64_t>({1, 2}, {2}).dtype() == DType::i64);
  CHECK(from_vector<bool>({true, false}, {2}).to_vector<bool>() == std::vector<bool>{true, false});
  CHECK(values({1, 2, 3, 4}, {2, 2}).at({1, 0}) == 3);
  CHECK(values({1, 2, 3, 4}, {2, 2}).at({-1, -1}) == 4);
  CHECK(to_string(values({1, 2}, {2})) == "tensor(f32 [2], [1, 2])");
  CHECK(to_string(arange(0, 10, 1, DType::i64)) == "tensor(i64 [10], [0, 1, 2, ..., 7, 8, 9])");
  // Printing reads only the values it shows, along every axis, strided or not: a [2^40, 2^20]
  // expanded view prints (a copy of it all to f64 needed more than 2^63 bytes).
  CHECK(to_string(arange(0, 64, 1, DType::i64).reshape({8, 8}).transpose(0, 1)) ==
        "tensor(i64 [8, 8], [[0, 8, 16, ..., 40, 48, 56], [1, 9, 17, ..., 41, 49, 57], [2, 10, 18, ..., 42, 50, 58], "
        "..., [5, 13, 21, ..., 45, 53, 61], [6, 14, 22, ..., 46, 54, 62], [7, 15, 23, ..., 47, 55, 63]])");
  const std::string row = "[2, 2, 2, ..., 2, 2, 2]";
  CHECK(to_string(full({1, 1}, 2).expand({1LL << 40, 1LL << 20})) == "tensor(f32 [1099511627776, 1048576], [" + row +
                                                                         ", " + row + ", " + row + ", ..., " + row +
                                                                         ", " + row + ", " + row + "])");
}

TEST_CASE("random tensors are counter-based") {
  const Tensor a = rand({1000}, 42);
  const auto v = a.to_vector<float>();
  double mean = 0;
  for (float x : v) {
    CHECK(x >= 0.0f);
    CHECK(x < 1.0f);
    mean += x;
  }
  CHECK(mean / 1000 == doctest::Approx(0.5).epsilon(0.05));
  // Any element range can be produced alone: elements 100..199 of the stream.
  CHECK_CLOSE(rand({100}, 42, 100), slice(a, 0, 100, 200), 0, 0);
  CHECK_CLOSE(randn({2, 50}, 7, 50).reshape({100}), slice(randn({200}, 7), 0, 50, 150), 0, 0);
  const auto n = randn({20000}, 3).to_vector<double>();
  double m = 0, s = 0;
  for (double x : n) m += x;
  m /= n.size();
  for (double x : n) s += (x - m) * (x - m);
  CHECK(m == doctest::Approx(0).epsilon(0.03).scale(1));
  CHECK(std::sqrt(s / n.size()) == doctest::Approx(1).epsilon(0.03));
  CHECK(rand({4}, 1).to_vector<float>() != rand({4}, 2).to_vector<float>());
  const auto u = uniform({1000}, -2, 3, 9, 0, DType::f64).to_vector<double>();
  for (double x : u) CHECK((x >= -2 && x < 3));
  const auto ints = randint({1000}, 3, 7, 5).to_vector<std::int64_t>();
  for (auto x : ints) CHECK((x >= 3 && x < 7));
  CHECK(normal({4}, 10, 0, 1).to_vector<float>() == std::vector<float>{10, 10, 10, 10});
}

TEST_CASE(
    "f32 uniform draws (rand, uniform_floats) are uniform_float's values, eight at a time or one, at any offset") {
  // rand takes Philox's first words for eight counters at once (AVX2 lanes where built): each
  // value must still be random::uniform_float(seed, offset + i), across a 2^32 carry of the
  // counter, near its wrap, and for lengths that leave a partial block at either end.
  for (const std::uint64_t seed : {std::uint64_t{0}, std::uint64_t{12345678901234}, ~std::uint64_t{0}}) {
    for (const std::uint64_t offset :
         {std::uint64_t{0}, std::uint64_t{5}, (std::uint64_t{1} << 32) - 11, ~std::uint64_t{0} - 40}) {
      for (const std::int64_t n : {std::int64_t{1}, std::int64_t{8}, std::int64_t{29}, std::int64_t{70001}}) {
        CAPTURE(seed);
        CAPTURE(offset);
        CAPTURE(n);
        const std::vector<float> got = rand({n}, seed, offset).to_vector<float>();
        // The bulk draw (the attention's dropout masks) too, from an odd start within the range.
        std::vector<float> bulk(static_cast<std::size_t>(n), -1.0f);
        const std::int64_t skip = n > 3 ? 3 : 0;
        random::uniform_floats(seed, offset + skip, n - skip, bulk.data() + skip);
        int wrong = 0, wrong_bulk = 0;
        for (std::int64_t i = 0; i < n; ++i) {
          const float want = random::uniform_float(seed, offset + static_cast<std::uint64_t>(i));
          wrong += std::bit_cast<std::uint32_t>(got[static_cast<std::size_t>(i)]) != std::bit_cast<std::uint32_t>(want);
          if (i >= skip) {
            wrong_bulk +=
                std::bit_cast<std::uint32_t>(bulk[static_cast<std::size_t>(i)]) != std::bit_cast<std::uint32_t>(want);
          }
        }
        CHECK(wrong == 0);
        CHECK(wrong_bulk == 0);
        CHECK(bulk[0] == (skip ? -1.0f : random::uniform_float(seed, offset)));  // nothing written before the range
      }
    }
  }
}

TEST_CASE("broadcasting arithmetic in every float dtype") {
  for (DType d : kFloatTypes) {
    CAPTURE(dtype_name(d));
    const Tensor a = values({1, 2, 3, 4, 5, 6}, {2, 3}, d);
    const Tensor row = values({10, 20, 30}, {3}, d);
    const Tensor col = values({2, 4}, {2, 1}, d);
    CHECK_CLOSE(a + row, {11, 22, 33, 14, 25, 36}, {2, 3}, tol(d), tol(d));
    CHECK_CLOSE(a - col, {-1, 0, 1, 0, 1, 2}, {2, 3}, tol(d), tol(d));
    CHECK_CLOSE(a * col, {2, 4, 6, 16, 20, 24}, {2, 3}, tol(d), tol(d));
    CHECK_CLOSE(a / col, {0.5, 1, 1.5, 1, 1.25, 1.5}, {2, 3}, tol(d), tol(d));
    CHECK_CLOSE(row / a, {10, 10, 10, 2.5, 4, 5}, {2, 3}, tol(d), tol(d));
    CHECK_CLOSE(pow(a, 2.0), {1, 4, 9, 16, 25, 36}, {2, 3}, tol(d), tol(d));
    CHECK_CLOSE(pow(col, values({0, 1, 2}, {3}, d)), {1, 2, 4, 1, 4, 16}, {2, 3}, tol(d), tol(d));
    CHECK_CLOSE(maximum(a, values({3}, {1}, d)), {3, 3, 3, 4, 5, 6}, {2, 3}, tol(d), tol(d));
    CHECK_CLOSE(minimum(a, col), {1, 2, 2, 4, 4, 4}, {2, 3}, tol(d), tol(d));
    CHECK_CLOSE(a * 2.0 + 1.0, {3, 5, 7, 9, 11, 13}, {2, 3}, tol(d), tol(d));
    CHECK_CLOSE(1.0 - a, {0, -1, -2, -3, -4, -5}, {2, 3}, tol(d), tol(d));
    CHECK_CLOSE(12.0 / a, {12, 6, 4, 3, 2.4, 2}, {2, 3}, tol(d), tol(d));
    CHECK_CLOSE(-a, {-1, -2, -3, -4, -5, -6}, {2, 3});
    // Broadcasting on both sides: [2, 1] with [1, 3].
    CHECK_CLOSE(col + values({1, 2, 3}, {1, 3}, d), {3, 4, 5, 5, 6, 7}, {2, 3}, tol(d), tol(d));
  }
}

TEST_CASE("integer and boolean elementwise ops") {
  const Tensor a = values({1, -2, 3}, {3}, DType::i64);
  const Tensor b = values({2, 2, 2}, {3}, DType::i64);
  CHECK_CLOSE(a + b, {3, 0, 5}, {3});
  CHECK_CLOSE(a * b, {2, -4, 6}, {3});
  CHECK_CLOSE(a / b, {0, -1, 1}, {3});  // C++ integer division truncates
  CHECK_CLOSE(abs(a), {1, 2, 3}, {3});
  CHECK_CLOSE(eq(a, b), {0, 0, 0}, {3});
  CHECK_CLOSE(lt(a, b), {1, 1, 0}, {3});
  const Tensor t = values({1, 0, 1}, {3}, DType::boolean);
  CHECK_CLOSE(eq(t, values({1, 1, 1}, {3}, DType::boolean)), {1, 0, 1}, {3});
  test::check_throws<ArgumentError>([&] { a / values({0}, {1}, DType::i64); }, {"div", "zero"});
}

TEST_CASE("comparisons and where") {
  const Tensor a = values({1, 2, 3, 4}, {2, 2});
  const Tensor b = values({2}, {1});
  CHECK_CLOSE(eq(a, b), {0, 1, 0, 0}, {2, 2});
  CHECK_CLOSE(ne(a, b), {1, 0, 1, 1}, {2, 2});
  CHECK_CLOSE(lt(a, b), {1, 0, 0, 0}, {2, 2});
  CHECK_CLOSE(le(a, b), {1, 1, 0, 0}, {2, 2});
  CHECK_CLOSE(gt(a, b), {0, 0, 1, 1}, {2, 2});
  CHECK_CLOSE(ge(a, b), {0, 1, 1, 1}, {2, 2});
  CHECK(gt(a, b).dtype() == DType::boolean);
  CHECK_CLOSE(gt(a, 2.0), {0, 0, 1, 1}, {2, 2});
  CHECK_CLOSE(le(a, 2.0), {1, 1, 0, 0}, {2, 2});
  CHECK_CLOSE(eq(values({3, 7}, {2}, DType::i64), 7.0), {0, 1}, {2});
  CHECK_CLOSE(where(gt(a, b), a, zeros({1})), {0, 0, 3, 4}, {2, 2});
  CHECK_CLOSE(where(values({1, 0}, {2, 1}, DType::boolean), a, -a), {1, 2, -3, -4}, {2, 2});
  CHECK_CLOSE(clamp(a, 1.5, 3.5), {1.5, 2, 3, 3.5}, {2, 2});
}

TEST_CASE("unary math in every float dtype") {
  const std::vector<double> xs = {-2, -0.5, 0, 0.5, 1, 3};
  auto map = [&](auto f) {
    std::vector<double> out;
    for (double x : xs) out.push_back(f(x));
    return out;
  };
  const double s2 = std::numbers::sqrt2;
  for (DType d : kFloatTypes) {
    CAPTURE(dtype_name(d));
    const Tensor x = values(xs, {2, 3}, d);
    const Tensor pos = values({0.25, 1, 4, 9, 2, 0.5}, {2, 3}, d);
    const double t = tol(d) * 4;
    CHECK_CLOSE(abs(x), map([](double v) { return std::abs(v); }), {2, 3}, t, t);
    CHECK_CLOSE(exp(x), map([](double v) { return std::exp(v); }), {2, 3}, t, t);
    CHECK_CLOSE(log(pos), {std::log(0.25), 0, std::log(4), std::log(9), std::log(2), std::log(0.5)}, {2, 3}, t, t);
    CHECK_CLOSE(sqrt(pos), {0.5, 1, 2, 3, s2, std::sqrt(0.5)}, {2, 3}, t, t);
    CHECK_CLOSE(rsqrt(pos), {2, 1, 0.5, 1.0 / 3, 1 / s2, s2}, {2, 3}, t, t);
    CHECK_CLOSE(tanh(x), map([](double v) { return std::tanh(v); }), {2, 3}, t, t);
    CHECK_CLOSE(sigmoid(x), map([](double v) { return 1 / (1 + std::exp(-v)); }), {2, 3}, t, t);
    CHECK_CLOSE(relu(x), map([](double v) { return v > 0 ? v : 0; }), {2, 3}, t, t);
    CHECK_CLOSE(gelu(x), map([&](double v) { return 0.5 * v * (1 + std::erf(v / s2)); }), {2, 3}, t, t);
    CHECK_CLOSE(gelu(x, GeluApproximation::tanh), map([](double v) {
                  return 0.5 * v * (1 + std::tanh(std::sqrt(2 / std::numbers::pi) * (v + 0.044715 * v * v * v)));
                }),
                {2, 3}, t, t);
    CHECK_CLOSE(silu(x), map([](double v) { return v / (1 + std::exp(-v)); }), {2, 3}, t, t);
    CHECK_CLOSE(softplus(x), map([](double v) { return std::log1p(std::exp(v)); }), {2, 3}, t, t);
    CHECK_CLOSE(square(x), map([](double v) { return v * v; }), {2, 3}, t, t);
    CHECK_CLOSE(reciprocal(pos), {4, 1, 0.25, 1.0 / 9, 0.5, 2}, {2, 3}, t, t);
  }
  // softplus stays finite for large inputs.
  CHECK_CLOSE(softplus(values({100, -100}, {2})), {100, 0}, {2}, 1e-6, 1e-6);
  // PyTorch's threshold: x itself past 20 (log1p(exp(-20.25)) = 1.6e-9 is dropped), gradient
  // exactly 1; at 20 and below the exact value.
  const Tensor around = values({19.5, 20.0, 20.25, 30.0}, {4}, DType::f64).set_requires_grad();
  const Tensor sp = softplus(around);
  const std::vector<double> got = sp.to_vector<double>();
  CHECK(got[0] == doctest::Approx(19.5 + std::log1p(std::exp(-19.5))).epsilon(1e-15));
  CHECK(got[1] == doctest::Approx(20.0 + std::log1p(std::exp(-20.0))).epsilon(1e-15));
  CHECK(got[1] != 20.0);
  CHECK(got[2] == 20.25);
  CHECK(got[3] == 30.0);
  sum(sp).backward();
  const std::vector<double> g = around.grad().to_vector<double>();
  CHECK(g[1] < 1.0);
  CHECK(g[2] == 1.0);
  CHECK(g[3] == 1.0);
  // Its gradient is exp(x) / (exp(x) + 1), PyTorch's form, down to subnormal values: the
  // logistic 1 / (1 + exp(-x)) was 0 below -88.7 in f32 (-709.8 in f64), where exp(-x) overflows.
  for (const auto& [d, at] : {std::pair{DType::f32, std::vector<double>{-88.8, -100}},
                              std::pair{DType::f64, std::vector<double>{-710, -740}}}) {
    CAPTURE(dtype_name(d));
    const Tensor x = values(at, {2}, d).set_requires_grad();
    sum(softplus(x)).backward();
    const double unit =
        d == DType::f32 ? std::numeric_limits<float>::denorm_min() : std::numeric_limits<double>::denorm_min();
    const std::vector<double> got = x.grad().to_vector<double>(), held = x.to_vector<double>();  // x as rounded
    for (std::size_t i = 0; i < at.size(); ++i) {
      CAPTURE(at[i]);
      CHECK(got[i] > 0);
      CHECK(std::abs(got[i] - std::exp(held[i])) <= 2 * unit);
    }
  }
}

TEST_CASE("erf against std::erf, forward and backward, in every float dtype") {
  // 6001 values over [-5, 5] and the infinities: above oneDNN's minimum kernel size, so the oneDNN
  // backend takes its fallback for an op without an eltwise algorithm at a size it would run.
  std::vector<double> xs;
  for (int i = -3000; i <= 3000; ++i) xs.push_back(i / 600.0);
  xs.insert(xs.end(), {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()});
  const auto n = static_cast<std::int64_t>(xs.size());
  for (DType d : kFloatTypes) {
    CAPTURE(dtype_name(d));
    const Tensor x = values(xs, {n}, d).set_requires_grad();
    const std::vector<double> xr = x.to_vector<double>();  // as rounded to d
    std::vector<double> want_y, want_g;
    for (double v : xr) {
      want_y.push_back(std::erf(v));
      want_g.push_back(3 * 2 / std::sqrt(std::numbers::pi) * std::exp(-v * v));
    }
    const Tensor y = erf(x);
    CHECK(y.dtype() == d);
    CHECK_CLOSE(y, want_y, {n}, tol(d), tol(d));
    sum(y * 3.0).backward();
    CHECK_CLOSE(x.grad(), want_g, {n}, 4 * tol(d), 4 * tol(d));
  }
  CHECK_CLOSE(erf(values({0.5, -1}, {2}, DType::f64)), {std::erf(0.5), std::erf(-1.0)}, {2}, 1e-15, 1e-15);
  // Bounds the approximation must keep, which Eigen's f32 erf overshot by an ulp near |x| = 4:
  // |erf| <= 1, and GELU (erf form) of a negative input is never positive.
  std::vector<double> dense_xs;
  for (int i = -6000; i <= 6000; ++i) dense_xs.push_back(i / 1000.0);
  for (DType d : kFloatTypes) {
    CAPTURE(dtype_name(d));
    const Tensor x = values(dense_xs, {static_cast<std::int64_t>(dense_xs.size())}, d);
    CHECK(max(abs(erf(x))).item() <= 1.0);
    const std::vector<double> xr = x.to_vector<double>(), g = gelu(x).to_vector<double>();
    for (std::size_t i = 0; i < xr.size(); ++i) {
      if (xr[i] < 0 && g[i] > 0) {
        FAIL_CHECK("gelu(" << xr[i] << ") = " << g[i] << " > 0");
        break;
      }
    }
  }
  test::check_throws<DTypeError>([] { (void)erf(randint({3}, 0, 5, 1)); }, {"erf", "i64", "[3]"});
  test::check_throws<ArgumentError>([] { (void)erf(Tensor()); }, {"erf", "undefined"});
}

TEST_CASE("tanh and both GELUs against double references over a dense range, forward and backward") {
  // f32 runs Eigen's packet approximations (backends/eigen/vector_math.h), on both backends where
  // the policy sends the forwards to Eigen: a few ulp, bounded here by the f32 tolerance. 8001
  // values over [-10, 10], far past the clamps of the approximations, and the infinities.
  std::vector<double> xs;
  for (int i = -4000; i <= 4000; ++i) xs.push_back(i / 400.0);
  const auto n = static_cast<std::int64_t>(xs.size());
  const double c = 0.7978845608028654, k = 0.044715;
  auto gelu_ref = [](double v) { return 0.5 * v * (1 + std::erf(v / std::numbers::sqrt2)); };
  auto gelu_ref_grad = [](double v) {
    return 0.5 * (1 + std::erf(v / std::numbers::sqrt2)) + v * std::exp(-0.5 * v * v) / std::sqrt(2 * std::numbers::pi);
  };
  auto gelu_tanh_ref = [&](double v) { return 0.5 * v * (1 + std::tanh(c * (v + k * v * v * v))); };
  auto gelu_tanh_ref_grad = [&](double v) {
    const double t = std::tanh(c * (v + k * v * v * v));
    return 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * c * (1 + 3 * k * v * v);
  };
  for (DType d : kFloatTypes) {
    CAPTURE(dtype_name(d));
    struct Op {
      const char* name;
      Tensor (*f)(const Tensor&);
      double (*y)(double);
      double (*g)(double);
    };
    const Op ops[] = {
        {"tanh", [](const Tensor& x) { return tanh(x); }, [](double v) { return std::tanh(v); },
         [](double v) { return 1 - std::tanh(v) * std::tanh(v); }},
        {"gelu", [](const Tensor& x) { return gelu(x); }, +gelu_ref, +gelu_ref_grad},
    };
    for (const Op& op : ops) {
      CAPTURE(op.name);
      const Tensor x = values(xs, {n}, d).set_requires_grad();
      const std::vector<double> xr = x.to_vector<double>();  // as rounded to d
      std::vector<double> want_y, want_g;
      for (double v : xr) {
        want_y.push_back(op.y(v));
        want_g.push_back(2 * op.g(v));
      }
      const Tensor y = op.f(x);
      CHECK_CLOSE(y, want_y, {n}, tol(d), tol(d));
      sum(y * 2.0).backward();
      CHECK_CLOSE(x.grad(), want_g, {n}, 4 * tol(d), 4 * tol(d));
    }
    const Tensor x = values(xs, {n}, d).set_requires_grad();
    const std::vector<double> xr = x.to_vector<double>();
    std::vector<double> want_y, want_g;
    for (double v : xr) {
      want_y.push_back(gelu_tanh_ref(v));
      want_g.push_back(2 * gelu_tanh_ref_grad(v));
    }
    const Tensor y = gelu(x, GeluApproximation::tanh);
    CHECK_CLOSE(y, want_y, {n}, tol(d), tol(d));
    sum(y * 2.0).backward();
    CHECK_CLOSE(x.grad(), want_g, {n}, 4 * tol(d), 4 * tol(d));
  }
  // The special values, repeated so that most of them land in packets (and some in the tail).
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> specials;
  for (int r = 0; r < 17; ++r) specials.insert(specials.end(), {inf, -inf, nan, 0.0, -0.0});
  const auto m = static_cast<std::int64_t>(specials.size());
  const Tensor special = values(specials, {m}, DType::f32);
  const std::vector<double> t = tanh(special).to_vector<double>(), g = gelu(special).to_vector<double>(),
                            gt = gelu(special, GeluApproximation::tanh).to_vector<double>();
  for (std::int64_t i = 0; i < m; i += 5) {
    CAPTURE(i);
    CHECK(t[i] == 1);
    CHECK(t[i + 1] == -1);
    CHECK(std::isnan(t[i + 2]));
    CHECK((t[i + 3] == 0 && !std::signbit(t[i + 3])));
    CHECK((t[i + 4] == 0 && std::signbit(t[i + 4])));
    for (const std::vector<double>* y : {&g, &gt}) {
      CHECK((*y)[i] == inf);
      CHECK(std::isnan((*y)[i + 2]));
      CHECK(((*y)[i + 3] == 0 && !std::signbit((*y)[i + 3])));
      CHECK(((*y)[i + 4] == 0 && std::signbit((*y)[i + 4])));
    }
  }
}

namespace {
// got against want (both as rounded to the dtype): the same NaN-ness and the same infinities, an
// exact 0 of the same sign where want is 0 (exp(-inf) is 0, not Eigen's clamped 2.9e-39), else within the relative
// tolerance plus an absolute one for results that a kernel may flush to 0 (oneDNN's f32 exp does
// from about -87, its bf16 GELU backward below ~1e-19); f64 runs Eigen only, down to subnormals.
void check_special(const std::string& what, const std::vector<double>& x, const std::vector<double>& got,
                   const std::vector<double>& want, DType d, double rel, bool zero_sign = true) {
  REQUIRE(got.size() == want.size());
  const double flush = d == DType::f64 ? 2 * std::numeric_limits<double>::min() : 1e-15;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    bool ok;
    if (std::isnan(w) || std::isnan(g) || std::isinf(w) || std::isinf(g) || w == 0) {
      // A zero with its sign: neg(0) is -0 (Eigen's packet negation, 0 - x, made it +0).
      ok = (std::isnan(w) && std::isnan(g)) || (g == w && (!zero_sign || std::signbit(g) == std::signbit(w)));
    } else {
      ok = std::abs(g - w) <= flush + rel * std::abs(w);
    }
    if (!ok) {
      FAIL_CHECK(what << " at x = " << x[i] << " (element " << i << "): got " << g << ", want " << w);
      return;
    }
  }
}

double sigmoid_ref(double v) { return v >= 0 ? 1 / (1 + std::exp(-v)) : std::exp(v) / (1 + std::exp(v)); }
constexpr double kGeluC = 0.7978845608028654, kGeluK = 0.044715;
}  // namespace

TEST_CASE(
    "every unary op at the special values (infinities, NaN, signed zeros, underflow) against double "
    "references of its formula, forward and backward, at sizes oneDNN runs") {
  // The reference is the op's formula evaluated in double on the input as rounded to the dtype,
  // then rounded to the dtype: what PyTorch's kernels compute (inf * 0 in a derivative is NaN, as
  // there). 4160 values (above oneDNN's minimum kernel size), the specials repeated so that they
  // land both in packets and in the scalar tails.
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<double> specials = {inf, -inf, nan, 0.0, -0.0, -1000, -745, -709, -104, -100, -90, -88.5, -87.5,
                                        -87, -50, -20, -9.5, -1, 0.5, 1, 20, 50, 87, 88, 89, 100, 709, 710, 1000, 1e-30,
                                        -1e-30,
                                        // subnormal in f32 and bf16 (1e-40) and in f64 (1e-310)
                                        1e-40, -1e-40, 3e-39, 1e-310, -1e-310};
  std::vector<double> xs;
  while (xs.size() < 4160) xs.insert(xs.end(), specials.begin(), specials.end());
  const auto n = static_cast<std::int64_t>(xs.size());
  struct Op {
    const char* name;
    Tensor (*f)(const Tensor&);
    double (*y)(double);
    double (*g)(double x, double y);  // dy/dx (gy = 1), from x or from y as the dtype holds it
  };
  const Op ops[] = {
      {"neg", [](const Tensor& x) { return neg(x); }, [](double v) { return -v; }, [](double, double) { return -1.0; }},
      {"abs", [](const Tensor& x) { return abs(x); }, [](double v) { return std::abs(v); },
       [](double v, double) { return v > 0   ? 1.0
                                     : v < 0 ? -1.0
                                             : 0.0; }},  // 0 at NaN, as PyTorch's sign
      {"exp", [](const Tensor& x) { return exp(x); }, [](double v) { return std::exp(v); },
       [](double, double y) { return y; }},
      {"log", [](const Tensor& x) { return log(x); }, [](double v) { return std::log(v); },
       [](double v, double) { return 1 / v; }},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }, [](double v) { return std::sqrt(v); },
       [](double, double y) { return 0.5 / y; }},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, [](double v) { return 1 / std::sqrt(v); },
       [](double, double y) { return -0.5 * y * y * y; }},
      // (1 - y)(1 + y), not 1 - y * y: near |y| = 1 the latter cancels, and was accurate only
      // where the compiler happened to contract it into an FMA (this file at -O2 and above).
      {"tanh", [](const Tensor& x) { return tanh(x); }, [](double v) { return std::tanh(v); },
       [](double, double y) { return (1 - y) * (1 + y); }},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, [](double v) { return sigmoid_ref(v); },
       [](double, double y) { return y * (1 - y); }},
      {"relu", [](const Tensor& x) { return relu(x); }, [](double v) { return v < 0 ? 0.0 : v; },
       [](double, double y) { return y <= 0 ? 0.0 : 1.0; }},  // passes gy where y is NaN
      {"gelu", [](const Tensor& x) { return gelu(x); },
       [](double v) { return 0.5 * v * (1 + std::erf(v / std::numbers::sqrt2)); },
       [](double v, double) {
         return 0.5 * (1 + std::erf(v / std::numbers::sqrt2)) +
                v * std::exp(-0.5 * v * v) / std::sqrt(2 * std::numbers::pi);
       }},
      {"gelu (tanh)", [](const Tensor& x) { return gelu(x, GeluApproximation::tanh); },
       [](double v) { return 0.5 * v * (1 + std::tanh(kGeluC * (v + kGeluK * v * v * v))); },
       [](double v, double) {
         const double t = std::tanh(kGeluC * (v + kGeluK * v * v * v));
         return 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * kGeluC * (1 + 3 * kGeluK * v * v);
       }},
      {"silu", [](const Tensor& x) { return silu(x); }, [](double v) { return v * sigmoid_ref(v); },
       [](double v, double) {
         const double sv = sigmoid_ref(v);
         return sv * (1 + v * (1 - sv));
       }},
      {"softplus", [](const Tensor& x) { return softplus(x); },
       [](double v) { return std::max(v, 0.0) + std::log1p(std::exp(-std::abs(v))); },
       [](double v, double) { return sigmoid_ref(v); }},
      {"square", [](const Tensor& x) { return square(x); }, [](double v) { return v * v; },
       [](double v, double) { return 2 * v; }},
      {"reciprocal", [](const Tensor& x) { return reciprocal(x); }, [](double v) { return 1 / v; },
       [](double, double y) { return -y * y; }},
      {"erf", [](const Tensor& x) { return erf(x); }, [](double v) { return std::erf(v); },
       [](double v, double) { return 2 / std::sqrt(std::numbers::pi) * std::exp(-v * v); }},
  };
  for (DType d : kFloatTypes) {
    CAPTURE(dtype_name(d));
    auto rounded = [&](const std::vector<double>& v) { return values(v, {n}, DType::f64).to(d).to_vector<double>(); };
    const std::vector<double> xr = rounded(xs);
    // The approximations (f32 erf and tanh, Eigen's f32 logistic) are a few ulp off; 16-bit
    // values are computed in f32 and rounded once.
    const double rel = d == DType::f64 ? 1e-12 : d == DType::f32 ? 1e-5 : 2 * tol(d);
    for (const Op& op : ops) {
      const std::string name = op.name;
      CAPTURE(name);
      const Tensor x = values(xr, {n}, d).set_requires_grad();
      std::vector<double> want_y(xr.size()), want_g(xr.size());
      for (std::size_t i = 0; i < xr.size(); ++i) want_y[i] = op.y(xr[i]);
      const std::vector<double> yr = rounded(want_y);
      // The derivative of ops that read y uses y as the dtype holds it.
      for (std::size_t i = 0; i < xr.size(); ++i) want_g[i] = op.g(xr[i], yr[i]);
      const Tensor y = op.f(x);
      // oneDNN's gelu_erf kernel, which runs only when every oneDNN kernel is asked for
      // (RUDA_ONEDNN_KERNELS=all; by default Eigen's, faster, runs), gives gelu(-0) = +0.
      const char* kernels = std::getenv("RUDA_ONEDNN_KERNELS");
      const bool onednn_gelu =
          x.backend().name() == "onednn" && kernels && std::string(kernels) == "all" && name == "gelu";
      check_special(name, xr, y.to_vector<double>(), yr, d, rel, !onednn_gelu);
      sum(y).backward();
      // Not the sign of a zero here: the reference's derivatives that underflow (gelu's at -20, a
      // tiny negative in double) round to -0, where a formula evaluated in the dtype adds +0.
      check_special(name + " backward", xr, x.grad().to_vector<double>(), rounded(want_g), d, 4 * rel, false);
    }
  }
}

TEST_CASE("sigmoid, SiLU and exp over dense ranges: a few ulp of a double reference, down to subnormal results") {
  // f32: sigmoid over [-20, 20] (Eigen's rational approximation was 2.3e-4 relative off at -8.6),
  // SiLU through it. f64: exp over [-745, -700], where the unclamped exp takes over from Eigen's.
  std::vector<double> xs;
  for (int i = -8000; i <= 8000; ++i) xs.push_back(i / 400.0);
  const auto n = static_cast<std::int64_t>(xs.size());
  const Tensor x = values(xs, {n}, DType::f32);
  const std::vector<double> xr = x.to_vector<double>();
  auto ulps = [](double got, double want) {
    const auto w = static_cast<float>(want);
    const double ulp = std::max<double>(std::nextafter(std::abs(w), INFINITY) - std::abs(w), 1.4e-45);
    return std::abs(got - static_cast<double>(w)) / ulp;
  };
  double worst_sigmoid = 0, worst_silu = 0;
  const std::vector<double> s = sigmoid(x).to_vector<double>(), u = silu(x).to_vector<double>();
  for (std::size_t i = 0; i < xr.size(); ++i) {
    const double ref = 1 / (1 + std::exp(-xr[i]));
    worst_sigmoid = std::max(worst_sigmoid, ulps(s[i], ref));
    worst_silu = std::max(worst_silu, ulps(u[i], xr[i] * ref));
  }
  CHECK(worst_sigmoid <= 4);
  CHECK(worst_silu <= 5);
  std::vector<double> deep;
  for (int i = 0; i <= 4500; ++i) deep.push_back(-745.0 + i / 100.0);
  const std::vector<double> e = exp(values(deep, {4501}, DType::f64)).to_vector<double>();
  double worst_exp = 0;
  for (std::size_t i = 0; i < deep.size(); ++i) {
    const double want = std::exp(deep[i]);
    const double ulp = std::nextafter(want, INFINITY) - want;
    worst_exp = std::max(worst_exp, std::abs(e[i] - want) / ulp);
  }
  CHECK(worst_exp <= 2.5);
}

TEST_CASE("f32 exp from its underflow to its overflow: a few ulp of a double reference, NaN and infinities kept") {
  // Packets wholly in [-87, 88] take the short path (pexp with one multiply by 2^m), the others
  // Eigen's pexp or the unclamped one below -87; a dense sweep puts values of every kind in one
  // packet and in all-alike packets.
  std::vector<double> xs;
  for (int i = -105000; i <= 89000; ++i) xs.push_back(i / 1000.0);
  for (double v : {-87.0, 88.0, 88.37, 88.72, 88.7228, 88.73, 89.0, -88.72, -103.97, -103.98, -110.0}) xs.push_back(v);
  const auto n = static_cast<std::int64_t>(xs.size());
  const Tensor x = values(xs, {n}, DType::f32);
  const std::vector<double> xr = x.to_vector<double>(), e = exp(x).to_vector<double>();
  double worst = 0;
  for (std::size_t i = 0; i < xr.size(); ++i) {
    CAPTURE(xr[i]);
    const auto want = static_cast<float>(std::exp(xr[i]));
    if (std::isinf(want)) {
      CHECK(std::isinf(e[i]));
      continue;
    }
    const double ulp = std::max<double>(std::nextafter(want, INFINITY) - want, 1.4e-45);
    worst = std::max(worst, std::abs(e[i] - static_cast<double>(want)) / ulp);
  }
  CHECK(worst <= 2);
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> special = exp(values({inf, -inf, std::nan(""), 0.0}, {4}, DType::f32)).to_vector<double>();
  CHECK(special[0] == inf);
  CHECK(special[1] == 0.0);
  CHECK(std::isnan(special[2]));
  CHECK(special[3] == 1.0);
}

TEST_CASE("Backend::unary_with_derivative: unary's values and unary_backward's with gy = 1, in place or not") {
  // The suite's backend, with its fused form for the GELUs and the base class's default (unary,
  // then unary_backward) for tanh, and that default called directly on every op.
  Backend& backend = zeros({1}).backend();
  std::vector<double> xs;
  // [-7.5, 7.5], past the tails; enough values for oneDNN's kernels and for several threads.
  for (int i = -12000; i <= 12000; ++i) xs.push_back(i / 1600.0);
  const auto n = static_cast<std::int64_t>(xs.size());
  for (DType d : kFloatTypes) {
    CAPTURE(dtype_name(d));
    for (UnaryOp op : {UnaryOp::gelu_erf, UnaryOp::gelu_tanh, UnaryOp::tanh}) {
      CAPTURE(static_cast<int>(op));
      const Tensor x = values(xs, {n}, d);
      const Tensor want_y = empty({n}, Options(d)), want_d = empty({n}, Options(d));
      backend.unary(op, x.view(), want_y.view());
      backend.unary_backward(op, x.view(), want_y.view(), full({n}, 1.0, Options(d)).view(), want_d.view());
      const Tensor y = empty({n}, Options(d)), dydx = empty({n}, Options(d));
      backend.unary_with_derivative(op, x.view(), y.view(), dydx.view());
      CHECK_CLOSE(y, want_y, tol(d), tol(d));
      CHECK_CLOSE(dydx, want_d, 2 * tol(d), 2 * tol(d));
      // Written over x itself, by the backend's form and by the base class's default.
      for (bool base_default : {false, true}) {
        CAPTURE(base_default);
        const Tensor in_place = x.clone(), y2 = empty({n}, Options(d));
        if (base_default) {
          backend.Backend::unary_with_derivative(op, in_place.view(), y2.view(), in_place.view());
        } else {
          backend.unary_with_derivative(op, in_place.view(), y2.view(), in_place.view());
        }
        CHECK_CLOSE(y2, want_y, tol(d), tol(d));
        CHECK_CLOSE(in_place, want_d, 2 * tol(d), 2 * tol(d));
        if (!base_default) CHECK(in_place.to_vector<double>() == dydx.to_vector<double>());
      }
    }
  }
}

TEST_CASE("reductions") {
  for (DType d : kFloatTypes) {
    CAPTURE(dtype_name(d));
    const Tensor x = values({1, 2, 3, 4, 5, 6}, {2, 3}, d);
    const double t = tol(d) * 4;
    CHECK_CLOSE(sum(x), {21}, {});
    CHECK_CLOSE(sum(x, {0}), {5, 7, 9}, {3}, t, t);
    CHECK_CLOSE(sum(x, {1}), {6, 15}, {2}, t, t);
    CHECK_CLOSE(sum(x, {-1}, true), {6, 15}, {2, 1}, t, t);
    CHECK_CLOSE(mean(x, {0}), {2.5, 3.5, 4.5}, {3}, t, t);
    CHECK_CLOSE(mean(x), {3.5}, {}, t, t);
    CHECK_CLOSE(max(x, {1}), {3, 6}, {2}, t, t);
    CHECK_CLOSE(min(x, {0}), {1, 2, 3}, {3}, t, t);
    CHECK_CLOSE(max(x), {6}, {}, t, t);
    CHECK_CLOSE(logsumexp(x, {1}),
                {std::log(std::exp(1) + std::exp(2) + std::exp(3)), std::log(std::exp(4) + std::exp(5) + std::exp(6))},
                {2}, t, t);
    CHECK_CLOSE(argmax(x, 1), {2, 2}, {2});
    CHECK_CLOSE(argmin(x, 0, true), {0, 0, 0}, {1, 3});
  }
  // Middle, several and non-adjacent axes of a 3-D tensor.
  const Tensor y = arange(0, 24, 1, DType::f64).reshape({2, 3, 4});
  CHECK_CLOSE(sum(y, {1}), {12, 15, 18, 21, 48, 51, 54, 57}, {2, 4});
  CHECK_CLOSE(sum(y, {0, 2}), {60, 92, 124}, {3});
  CHECK_CLOSE(sum(y, {0, 1}), {60, 66, 72, 78}, {4});
  CHECK_CLOSE(max(y, {0, 2}, true), {15, 19, 23}, {1, 3, 1});
  CHECK_CLOSE(argmax(y, 1), {2, 2, 2, 2, 2, 2, 2, 2}, {2, 4}, 0, 0);
  CHECK_CLOSE(argmax(values({1, 5, 5, 2}, {4}), 0), {1}, {});  // the first of tied maxima
  CHECK_CLOSE(sum(values({1, 2, 3}, {3}, DType::i64)), {6}, {});
  // A large reduction (parallel, block-wise) is still exact enough.
  const Tensor big = ones({1 << 20}, DType::f64);
  CHECK(sum(big).item() == 1 << 20);
  CHECK(sum(ones({1 << 20})).item() == 1 << 20);
  // Empty reductions.
  CHECK_CLOSE(sum(zeros({0, 3}), {0}), {0, 0, 0}, {3});
  CHECK_CLOSE(sum_to(ones({2, 3, 4}), {3, 1}), {8, 8, 8}, {3, 1});
}

TEST_CASE("a bf16 softmax is its f64 value rounded once, as PyTorch's f32-computed one is, at sizes oneDNN runs") {
  // oneDNN 2.6's bf16 softmax rounded twice: 704 of these 4096 weights came out 1 ulp off (a
  // quarter of random lines' weights); computed in f32 and rounded once, a weight can differ
  // from the f64 value rounded once only where that value lies within f32's error of a bf16
  // rounding boundary: a few in 10^4, never by more than 1 ulp.
  std::vector<double> values(2 * 4096);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<double>(i % 64) / 16.0 - (i >= 4096 ? 3 : 0);
  const Tensor x = from_values(values, {2, 4096}, DType::bf16);
  const auto got = softmax(x, -1).to(DType::f32).to_vector<float>();
  const auto want = softmax(x.to(DType::f64), -1).to(DType::bf16).to(DType::f32).to_vector<float>();
  int off = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i] == want[i]) continue;
    ++off;
    // 1 ulp of bf16 at want[i]: 2^(exponent - 7).
    int exponent = 0;
    std::frexp(want[i], &exponent);
    CHECK_MESSAGE(std::abs(got[i] - want[i]) <= std::ldexp(1.0f, exponent - 8), "weight " << i);
  }
  CHECK_MESSAGE(off <= 8, off << " of " << got.size() << " weights are not the f64 value rounded once");
}

TEST_CASE("softmax, log_softmax and logsumexp of lines holding NaN, infinities and masks, at sizes oneDNN runs") {
  // Lines of 8 over the last axis and, transposed, over the first; 640 lines (5120 values, above
  // oneDNN's minimum kernel size), the special lines repeated. A line with a NaN or a +inf is NaN
  // throughout (its normalizer is NaN), as is a line of -infs only; a -inf beside finite values
  // is a masked slot: exactly 0 after softmax (Eigen's clamped exp left 1.5e-39 there), -inf after
  // log_softmax.
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<std::vector<double>> lines = {{0, nan, 1, 2, 0, 0, 0, 0},
                                                  {0, inf, 1, 2, 0, 0, 0, 0},
                                                  {0, -inf, 1, 2, -inf, 0, 0, 0},
                                                  {-inf, -inf, -inf, -inf, -inf, -inf, -inf, -inf},
                                                  {nan, nan, nan, nan, nan, nan, nan, nan},
                                                  {0, 1, 2, 3, 4, 5, 6, 7},
                                                  {-1000, 0, -200, 0, 0, 0, 0, 0},
                                                  {80, -80, 0, 0, 0, 0, 0, 0}};
  std::vector<double> flat;
  for (int r = 0; r < 80; ++r) {
    for (const auto& line : lines) flat.insert(flat.end(), line.begin(), line.end());
  }
  const std::int64_t count = static_cast<std::int64_t>(flat.size()) / 8;
  for (DType d : {DType::f32, DType::f64, DType::bf16}) {
    CAPTURE(dtype_name(d));
    const Tensor x = values(flat, {count, 8}, d);
    const std::vector<double> xr = x.to_vector<double>();
    for (bool transposed : {false, true}) {
      CAPTURE(transposed);
      // The same lines, laid out down the columns of an [8, count] tensor: softmax over axis 0.
      const Tensor in = transposed ? x.transpose(0, 1).contiguous() : x;
      const std::int64_t axis = transposed ? 0 : 1;
      const Tensor sm = softmax(in, axis), lsm = log_softmax(in, axis), lse = logsumexp(in, {axis});
      const std::vector<double> p = (transposed ? sm.transpose(0, 1) : sm).contiguous().to_vector<double>();
      const std::vector<double> lp = (transposed ? lsm.transpose(0, 1) : lsm).contiguous().to_vector<double>();
      const std::vector<double> l = lse.to_vector<double>();
      for (std::int64_t r = 0; r < count; ++r) {
        CAPTURE(r);
        const double* v = xr.data() + r * 8;
        bool has_nan = false, has_inf = false, all_neg_inf = true;
        double m = -inf;
        for (int i = 0; i < 8; ++i) {
          has_nan |= std::isnan(v[i]);
          has_inf |= v[i] == inf;
          all_neg_inf &= v[i] == -inf;
          if (v[i] > m) m = v[i];
        }
        // logsumexp: NaN with any NaN, +inf with a +inf, -inf when every value is.
        if (has_nan) {
          CHECK(std::isnan(l[r]));
        } else if (has_inf || all_neg_inf) {
          CHECK(l[r] == (has_inf ? inf : -inf));
        } else {
          double total = 0;
          for (int i = 0; i < 8; ++i) total += std::exp(v[i] - m);
          CHECK(l[r] == doctest::Approx(m + std::log(total)).epsilon(tol(d) * 4));
        }
        double total = 0;
        for (int i = 0; i < 8; ++i) total += std::exp(v[i] - m);
        for (int i = 0; i < 8; ++i) {
          CAPTURE(i);
          const double got = p[r * 8 + i], got_log = lp[r * 8 + i];
          if (has_nan || has_inf || all_neg_inf) {
            CHECK(std::isnan(got));
            CHECK(std::isnan(got_log));
          } else if (v[i] == -inf) {
            CHECK(got == 0);
            CHECK(got_log == -inf);
          } else {
            const double want = std::exp(v[i] - m) / total;
            CHECK(got == doctest::Approx(want).epsilon(tol(d) * 4).scale(1e-30));
            CHECK(got_log == doctest::Approx(v[i] - m - std::log(total)).epsilon(tol(d) * 4));
          }
        }
      }
    }
  }
}

TEST_CASE("softmax over a first or middle axis equals the last axis of a transposed copy, forward and backward") {
  // Lines that are not the last axis run a kernel of their own (rows swept across blocks of
  // lines, not a line gathered at a time): the same values within rounding, relative to each
  // value (probabilities down to 1e-3 of the tolerance; log-probabilities and gradients to 1),
  // long lines (more than a sum's run) and non-finite ones included, more lines than one block
  // holds (600), every float dtype.
  for (const DType d : kFloatTypes) {
    CAPTURE(dtype_name(d));
    const double t = d == DType::f64 ? 1e-12 : tol(d) * 4;
    for (const bool log : {false, true}) {
      CAPTURE(log);
      auto op = [log](const Tensor& x, std::int64_t axis) { return log ? log_softmax(x, axis) : softmax(x, axis); };
      auto same = [&](const std::vector<double>& got, const std::vector<double>& want, double floor) {
        REQUIRE(got.size() == want.size());
        for (std::size_t i = 0; i < got.size(); ++i) {
          CAPTURE(i);
          if (std::isnan(want[i])) {
            CHECK(std::isnan(got[i]));
          } else {
            CHECK(std::abs(got[i] - want[i]) <= t * std::max(std::abs(want[i]), floor));
          }
        }
      };
      // x over `axis` of `shape` against its transpose (that axis and the last swapped) over the last.
      auto compare = [&](const std::vector<double>& values, const Shape& shape, std::int64_t axis) {
        CAPTURE(shape);
        const auto last = static_cast<std::int64_t>(shape.size()) - 1;
        const Tensor x = from_values(values, shape, DType::f64).to(d).set_requires_grad();
        const Tensor xt = x.detach().transpose(axis, last).contiguous().set_requires_grad();
        const Tensor g = randn(shape, 22, 0, d);
        const Tensor y = op(x, axis), yt = op(xt, last);
        same(y.to_vector<double>(), yt.transpose(axis, last).contiguous().to_vector<double>(), log ? 1.0 : 1e-3);
        y.backward(g);
        yt.backward(g.transpose(axis, last).contiguous());
        same(x.grad().to_vector<double>(), xt.grad().transpose(axis, last).contiguous().to_vector<double>(), 1.0);
      };
      // [3, 700, 5] over axis 1, with a NaN line, an all -inf line and a +inf (NaN, as PyTorch).
      std::vector<double> v = (randn({3, 700, 5}, 21, 0, DType::f64) * 4.0).to_vector<double>();
      v[0 * 3500 + 10 * 5 + 2] = std::nan("");
      for (int i = 0; i < 700; ++i) v[1 * 3500 + i * 5 + 3] = -1.0 / 0.0;
      v[2 * 3500 + 7 * 5 + 4] = 1.0 / 0.0;
      compare(v, {3, 700, 5}, 1);
      // [300, 600] over axis 0: three blocks of lines, the last one partial.
      compare((randn({300, 600}, 23, 0, DType::f64) * 3.0).to_vector<double>(), {300, 600}, 0);
    }
  }
}

TEST_CASE("log_softmax keeps a confident row's small log-probabilities; its NaN lines' gradients are NaN") {
  // (x - max) - log(sum), as PyTorch: x - (max + log(sum)) rounded the shift first, and the small
  // log-probabilities went with it. Rows repeated past oneDNN's minimum kernel size, where
  // oneDNN's log_softmax read +1.4e-6 for a line of one value (a log-probability above 0).
  const double inf = std::numeric_limits<double>::infinity();
  auto epsilon_of = [](DType d) {
    switch (d) {
      case DType::f64:
        return 0x1p-52;
      case DType::f32:
        return 0x1p-23;
      case DType::f16:
        return 0x1p-10;
      default:
        return 0x1p-7;
    }
  };
  for (DType d : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    CAPTURE(dtype_name(d));
    const std::vector<std::pair<std::vector<double>, std::vector<double>>> rows = {
        {{10, 0}, {-std::log1p(std::exp(-10.0)), -10 - std::log1p(std::exp(-10.0))}},
        {{1e4, 1e4}, {-std::log(2.0), -std::log(2.0)}},
        {{20, -inf}, {0, -inf}},
    };
    for (const auto& [row, want] : rows) {
      CAPTURE(row[0]);
      std::vector<double> flat;
      for (int r = 0; r < 4096; ++r) flat.insert(flat.end(), row.begin(), row.end());
      const Tensor x = values(flat, {4096, 2}, d);
      const std::vector<double> got = log_softmax(x, 1).to_vector<double>();
      for (std::size_t i = 0; i < got.size(); ++i) {
        const double w = cast(values({want[i % 2]}, {1}, d), DType::f64).item();  // the exact value in d
        if (std::isinf(w)) {
          CHECK(got[i] == w);
        } else {
          // A quarter of an ulp of 1 (or of w where it is larger): f32 read 3.8e-7 off at [10, 0]
          // and 4.9e-4 at [1e4, 1e4] before, 1.9e-8 and 0 now (PyTorch's f32 error is the same).
          CHECK(std::abs(got[i] - w) <= epsilon_of(d) / 4 * std::max(1.0, std::abs(w)));
        }
      }
    }
    // A line of one value: log-probability 0 exactly, never above it; its gradient 0.
    Tensor one = zeros({4096, 1}, d);
    one.set_requires_grad(true);
    const Tensor lp = log_softmax(one, 1);
    for (const double v : lp.to_vector<double>()) CHECK(v == 0);
    sum(lp).backward();
    for (const double g : one.grad().to_vector<double>()) CHECK(g == 0);
    // The gradient of a line that is NaN throughout (one of -infs, a NaN, a +inf) is NaN, as
    // PyTorch's; oneDNN's backward read exp(NaN) as +inf and gave -inf.
    Tensor x = randn({64, 64}, 5).to(d);
    {
      autograd::NoGradGuard guard;
      x.slice(0, 0, 1).fill_(-inf);
      x.slice(0, 1, 2).slice(1, 3, 4).fill_(std::nan(""));
      x.slice(0, 2, 3).slice(1, 5, 6).fill_(inf);
    }
    x.set_requires_grad(true);
    sum(log_softmax(x, 1)).backward();
    const std::vector<double> g = x.grad().to_vector<double>();
    for (std::size_t i = 0; i < 3 * 64; ++i) CHECK(std::isnan(g[i]));
    for (std::size_t i = 3 * 64; i < g.size(); ++i) CHECK(std::isfinite(g[i]));
  }
}

TEST_CASE("add_ with an alpha is one fused multiply-add, as PyTorch's, through views and broadcasts") {
  // Backend::add_scaled: no temporary (an optimizer's update cannot fail after its state's), and
  // PyTorch's rounding (its vectorized fmadd: one rounding in the compute type, then the dtype).
  auto fused = [](const std::vector<float>& y, const std::vector<float>& x, float alpha, DType d) {
    std::vector<float> out(y.size());
    for (std::size_t i = 0; i < y.size(); ++i) out[i] = std::fma(x[i], alpha, y[i]);
    return from_vector<float>(out, {static_cast<std::int64_t>(out.size())}).to(d).to_vector<float>();
  };
  for (DType d : {DType::f32, DType::bf16, DType::f16}) {
    CAPTURE(dtype_name(d));
    const float alpha = -0.37f;
    // Contiguous, the operand itself (exact alias), a transposed self, a broadcast operand.
    Tensor y = randn({20, 50}, 1).to(d), x = randn({20, 50}, 2).to(d);
    std::vector<float> want = fused(y.to_vector<float>(), x.to_vector<float>(), alpha, d);
    y.add_(x, alpha);
    CHECK(y.to_vector<float>() == want);
    want = fused(x.to_vector<float>(), x.to_vector<float>(), alpha, d);
    x.add_(x, alpha);
    CHECK(x.to_vector<float>() == want);
    Tensor base = randn({50, 20}, 3).to(d);
    Tensor t = base.transpose(0, 1);  // a [20, 50] view with strides (1, 20)
    const Tensor src = randn({20, 50}, 4).to(d);
    want = fused(t.contiguous().to_vector<float>(), src.to_vector<float>(), alpha, d);
    t.add_(src, alpha);
    CHECK(t.contiguous().to_vector<float>() == want);
    Tensor z = randn({20, 50}, 5).to(d);
    const Tensor row = randn({1, 50}, 6).to(d);
    want = fused(z.to_vector<float>(), row.expand({20, 50}).contiguous().to_vector<float>(), alpha, d);
    z.add_(row, alpha);
    CHECK(z.to_vector<float>() == want);
    // The interface's default (a temporary and binary's add, two roundings) within one rounding.
    Tensor w = randn({1000}, 7).to(d), v = randn({1000}, 8).to(d);
    Tensor w2 = w.clone();
    w.add_(v, alpha);
    default_backend().Backend::add_scaled(v.view(), alpha, w2.view());
    test::check_close(w2, w, d == DType::f32 ? 1e-6 : 1e-2, d == DType::f32 ? 1e-6 : 1e-2);
  }
  // f64 in double.
  Tensor y = randn({300}, 9).to(DType::f64);
  const Tensor x = randn({300}, 10).to(DType::f64);
  std::vector<double> want = y.to_vector<double>();
  const std::vector<double> xs = x.to_vector<double>();
  for (std::size_t i = 0; i < want.size(); ++i) want[i] = std::fma(xs[i], 1.7, want[i]);
  y.add_(x, 1.7);
  CHECK(y.to_vector<double>() == want);
}

TEST_CASE("tanh and GELU's tanh form keep f32's tail: tanh reaches 1 at |x| = 9.01, not at Eigen's clamp of 7.9") {
  // Eigen's rational tanh read -1 from |x| = 7.9053, so 1 + tanh (gelu_tanh of x < -4.85) and 1 -
  // tanh^2 (the backward) were 0 where PyTorch's are ~1e-7.
  for (DType d : {DType::f32, DType::f64}) {
    CAPTURE(dtype_name(d));
    Tensor x = full({8192}, -8.185, d);
    x.set_requires_grad(true);
    const Tensor t = tanh(x);
    CHECK(t.to_vector<double>()[0] == doctest::Approx(std::tanh(-8.185)).epsilon(1e-7));
    CHECK(t.to_vector<double>()[0] > -1.0);
    sum(t).backward();
    CHECK(x.grad().to_vector<double>()[0] == doctest::Approx(1 - std::pow(std::tanh(-8.185), 2)).epsilon(0.2).scale(0));
    if (d == DType::f32) CHECK(tanh(full({8192}, 9.5, d)).to_vector<double>()[0] == 1.0);  // f32: rounds to 1 there
    CHECK(tanh(full({8192}, -std::numeric_limits<double>::infinity(), d)).to_vector<double>()[0] == -1.0);
    // gelu_tanh(-4.9) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): -4.45e-7 (PyTorch f32 -4.38e-7).
    const double inner = std::sqrt(2 / std::numbers::pi) * (-4.9 + 0.044715 * std::pow(-4.9, 3));
    const double want = 0.5 * -4.9 * (1 + std::tanh(inner));
    const double got = gelu(full({8192}, -4.9, d), GeluApproximation::tanh).to_vector<double>()[0];
    CHECK(got == doctest::Approx(want).epsilon(0.05).scale(0));
  }
}

TEST_CASE("both GELUs' gradients at huge finite |x| are GELU's slope there, 1 or 0, not NaN") {
  // The tanh form's derivative multiplies 1 - tanh^2 (0 there) by a polynomial in x^2, which
  // overflows from |x| ~1.8e19 in f32 (0 * inf; oneDNN's backward from ~1e15). Large enough for
  // the oneDNN backend's own kernels; every float dtype.
  const std::vector<double> values = {1e15, 2e19, 1e30, -1e15, -2e19, -1e30, 3e38, -3e38};
  for (DType d : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    for (GeluApproximation a : {GeluApproximation::tanh, GeluApproximation::erf}) {
      CAPTURE(dtype_name(d));
      CAPTURE(a == GeluApproximation::tanh);
      const bool f16 = d == DType::f16;  // holds up to 65504: the same at 6e4
      std::vector<double> v;
      for (int i = 0; i < 8192; ++i) v.push_back(f16 ? (i % 2 ? -6e4 : 6e4) : values[i % values.size()]);
      Tensor x = from_values(v, {8192}, DType::f64).to(d).set_requires_grad();
      sum(gelu(x, a)).backward();
      const std::vector<double> g = x.grad().to_vector<double>(), xs = x.to_vector<double>();
      std::size_t wrong = 0, first = 0;
      for (std::size_t i = 0; i < g.size(); ++i) {
        if (g[i] != (xs[i] > 0 ? 1.0 : 0.0) && wrong++ == 0) first = i;
      }
      CHECK_MESSAGE(wrong == 0, wrong << " wrong, the first at x " << xs[first] << ": " << g[first]);
    }
  }
}

TEST_CASE("reductions of a scalar over axis 0 or -1 give the scalar, as in PyTorch; other axes are refused") {
  const Tensor s = scalar(3.5);
  for (std::int64_t axis : {0, -1}) {
    CAPTURE(axis);
    CHECK(sum(s, {axis}).item() == 3.5);
    CHECK(mean(s, {axis}).item() == 3.5);
    CHECK(max(s, {axis}).item() == 3.5);
    CHECK(min(s, {axis}, true).item() == 3.5);
    CHECK(sum(s, {axis}, true).shape().empty());
    CHECK(logsumexp(s, {axis}).item() == 3.5);
  }
  test::check_throws<IndexError>([&] { (void)sum(s, {1}); }, {"sum", "axis 1", "scalar"});
  test::check_throws<IndexError>([&] { (void)max(s, {-2}); }, {"max", "axis -2", "scalar"});
  test::check_throws<IndexError>([&] { (void)sum(s, {0, -1}); }, {"sum", "listed twice"});
}

TEST_CASE(
    "i64 at its limits: neg, abs and square wrap; clamp to an out-of-range bound keeps INT64_MAX; printing "
    "is exact; arange is exact past 2^53 and refuses a fractional start or step") {
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max(),
                         kMin = std::numeric_limits<std::int64_t>::min();
  const Tensor x = from_vector<std::int64_t>({kMax, kMin, -1, 3037000500}, {4});
  // Two's complement wrap, as the README says of i64 arithmetic (and no UB: the sanitizer preset checks).
  CHECK(neg(x).to_vector<std::int64_t>() == std::vector<std::int64_t>{kMin + 1, kMin, 1, -3037000500});
  CHECK(abs(x).to_vector<std::int64_t>() == std::vector<std::int64_t>{kMax, kMin, 1, 3037000500});
  CHECK(square(x).to_vector<std::int64_t>() ==
        std::vector<std::int64_t>{1, 0, 1, static_cast<std::int64_t>(3037000500ULL * 3037000500ULL)});
  // Bounds beyond i64 bound nothing; inside, they are exact integers.
  CHECK(clamp(x, 0, 1e30).to_vector<std::int64_t>() == std::vector<std::int64_t>{kMax, 0, 0, 3037000500});
  CHECK(clamp(x, -1e30, 1e30).to_vector<std::int64_t>() == x.to_vector<std::int64_t>());
  CHECK(clamp(x, -0.5, 2.5).to_vector<std::int64_t>() == std::vector<std::int64_t>{2, 0, 0, 2});
  test::check_throws<ArgumentError>([&] { (void)clamp(x, 1e19, 1e20); }, {"clamp", "no i64 value"});
  test::check_throws<ArgumentError>([&] { (void)clamp(x, 0.25, 0.75); }, {"clamp", "no i64 value"});
  // Printing goes through the values' own type.
  CHECK(to_string(x) == "tensor(i64 [4], [9223372036854775807, -9223372036854775808, -1, 3037000500])");
  CHECK(to_string(from_vector<bool>({true, false}, {2})) == "tensor(bool [2], [1, 0])");
  // arange in i64: exact integers, end exclusive on the side the step points.
  CHECK(arange(9007199254740992.0, 9007199254740996.0, 1, DType::i64).to_vector<std::int64_t>() ==
        std::vector<std::int64_t>{9007199254740992, 9007199254740993, 9007199254740994, 9007199254740995});
  CHECK(arange(0, 2.5, 1, DType::i64).to_vector<std::int64_t>() == std::vector<std::int64_t>{0, 1, 2});
  CHECK(arange(3, -0.5, -2, DType::i64).to_vector<std::int64_t>() == std::vector<std::int64_t>{3, 1});
  CHECK(arange(5, 5, 1, DType::i64).numel() == 0);
  CHECK(arange(0, 3, -1, DType::i64).numel() == 0);
  CHECK(arange(-9223372036854775808.0, -9223372036854775808.0 + 4096, 2048, DType::i64).to_vector<std::int64_t>() ==
        std::vector<std::int64_t>{kMin, kMin + 2048});
  // Up to the ends of i64 (a bound cut to a double below 2^63 dropped the last 1023 values).
  const Tensor top = arange(9223372036854774784.0, 9223372036854775808.0, 1, DType::i64);
  CHECK(top.numel() == 1024);
  CHECK(top.to_vector<std::int64_t>().back() == kMax);
  CHECK(arange(9223372036854773760.0, 1e300, 1024, DType::i64).to_vector<std::int64_t>() ==
        std::vector<std::int64_t>{kMax - 2047, kMax - 1023});
  CHECK(arange(-9223372036854775808.0, -1e30, -1, DType::i64).to_vector<std::int64_t>() ==
        std::vector<std::int64_t>{kMin});
  test::check_throws<DTypeError>([] { (void)arange(0, 2, 0.5, DType::i64); }, {"arange", "step", "0.5"});
  test::check_throws<DTypeError>([] { (void)arange(0.5, 2, 1, DType::i64); }, {"arange", "start", "0.5"});
  test::check_throws<DTypeError>([] { (void)arange(1e19, 2e19, 1, DType::i64); }, {"arange", "start"});
}

TEST_CASE(
    "gradients at PyTorch's edge cases: pow at a zero exponent or base, clamp at its bounds, maximum and "
    "minimum at NaN; means and logsumexps over no elements") {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  // pow: d/da is exactly 0 where b == 0 (0 * 0^-1 was NaN at a == 0); d/db is 0 where a == 0 and
  // b >= 0, and a^b log a elsewhere (0^-1: inf * -inf = -inf).
  {
    const Tensor a = values({0, 0, 2, 0, nan}, {5}, DType::f64).set_requires_grad();
    const Tensor b = values({0, 2, 0, -1, 0}, {5}, DType::f64).set_requires_grad();
    sum(pow(a, b)).backward();
    const std::vector<double> ga = a.grad().to_vector<double>(), gb = b.grad().to_vector<double>();
    CHECK(ga[0] == 0);
    CHECK(ga[1] == 0);  // 2 * 0^1
    CHECK(ga[2] == 0);
    CHECK(ga[4] == 0);  // NaN^0 = 1 has no dependence on a
    CHECK(gb[0] == 0);
    CHECK(gb[1] == 0);
    CHECK(gb[2] == doctest::Approx(std::log(2.0)));
    CHECK(gb[3] == -inf);
    const Tensor x = values({0, 3}, {2}, DType::f64).set_requires_grad();
    sum(pow(x, 0.0)).backward();
    CHECK(x.grad().to_vector<double>() == std::vector<double>{0, 0});
  }
  // clamp passes the whole gradient at its bounds (inclusive), none outside or at NaN.
  for (DType d : {DType::f32, DType::f64}) {
    const Tensor x = values({-1, 1, 0, -2, 2, nan}, {6}, d).set_requires_grad();
    sum(clamp(x, -1, 1)).backward();
    CHECK(x.grad().to_vector<double>() == std::vector<double>{1, 1, 1, 0, 0, 0});
    const Tensor y = values({1}, {1}, d).set_requires_grad();
    sum(clamp(y, 1, 1)).backward();
    CHECK(y.grad().item() == 1);
  }
  // An infinite gradient beyond a bound stays out: sqrt's at the clamped 0 (inf * 0 was NaN).
  for (DType d : {DType::f32, DType::f64}) {
    const Tensor x = values({-1, 0.25, 4}, {3}, d).set_requires_grad();
    sum(sqrt(clamp(x, 0, 1))).backward();
    CHECK(x.grad().to_vector<double>() == std::vector<double>{0, 1, 0});
    const Tensor y = values({-1, 0.25}, {2}, d).set_requires_grad();
    sum(log(maximum(y, zeros({}, d)))).backward();
    CHECK(y.grad().to_vector<double>() == std::vector<double>{0, 4});
  }
  // maximum / minimum: the winner takes the gradient, a tie splits it, and where a value is NaN
  // neither wins, so both take it (PyTorch's masked_fill of the loser).
  for (bool is_max : {true, false}) {
    CAPTURE(is_max);
    const Tensor a = values({3, 1, 2, nan, 1}, {5}, DType::f64).set_requires_grad();
    const Tensor b = values({1, 3, 2, 1, nan}, {5}, DType::f64).set_requires_grad();
    sum(is_max ? maximum(a, b) : minimum(a, b)).backward();
    const std::vector<double> ga = a.grad().to_vector<double>(), gb = b.grad().to_vector<double>();
    CHECK(ga == std::vector<double>{is_max ? 1.0 : 0.0, is_max ? 0.0 : 1.0, 0.5, 1, 1});
    CHECK(gb == std::vector<double>{is_max ? 0.0 : 1.0, is_max ? 1.0 : 0.0, 0.5, 1, 1});
  }
  // Over no elements: the mean is NaN (0 / 0) and the logsumexp -inf (log 0); a sum is 0.
  for (DType d : {DType::f32, DType::f64, DType::bf16}) {
    CAPTURE(dtype_name(d));
    CHECK(std::isnan(mean(zeros({0}, d)).item()));
    const Tensor m = mean(zeros({3, 0}, d), {1});
    CHECK(m.shape() == Shape{3});
    for (double v : m.to_vector<double>()) CHECK(std::isnan(v));
    CHECK(logsumexp(zeros({0}, d)).item() == -inf);
    CHECK(logsumexp(zeros({2, 0}, d), {1}).to_vector<double>() == std::vector<double>{-inf, -inf});
  }
  test::check_throws<ShapeError>([] { (void)max(zeros({0})); }, {"max", "empty"});
}

TEST_CASE("reshape, permute, slice and expand share storage; concat copies, as documented") {
  const Tensor x = arange(0, 24).reshape({2, 3, 4});
  CHECK(x.reshape({6, 4}).shares_storage(x));
  CHECK(x.reshape({-1, 8}).shape() == Shape{3, 8});
  CHECK(x.flatten().shape() == Shape{24});
  CHECK(x.flatten(1).shape() == Shape{2, 12});
  CHECK(x.unsqueeze(0).shape() == Shape{1, 2, 3, 4});
  CHECK(x.unsqueeze(-1).shape() == Shape{2, 3, 4, 1});
  CHECK(x.unsqueeze(0).squeeze(0).shape() == Shape{2, 3, 4});
  CHECK_CLOSE(transpose(values({1, 2, 3, 4, 5, 6}, {2, 3}), 0, 1), {1, 4, 2, 5, 3, 6}, {3, 2});
  const Tensor p = permute(x, {2, 0, 1});
  CHECK(p.shape() == Shape{4, 2, 3});
  CHECK(p.at({1, 1, 2}) == x.at({1, 2, 1}));
  // Slices on any axis are views: leading rows stay contiguous, an inner slice is strided.
  const Tensor rows = slice(x, 0, 1, 2);
  CHECK(rows.shares_storage(x));
  CHECK(rows.is_contiguous());
  CHECK_CLOSE(rows.flatten(), arange(12, 24), 0, 0);
  const Tensor inner = slice(x, 2, 1, 3);
  CHECK(inner.shares_storage(x));
  CHECK_FALSE(inner.is_contiguous());
  CHECK(inner.shape() == Shape{2, 3, 2});
  CHECK(inner.at({1, 2, 0}) == x.at({1, 2, 1}));
  CHECK_CLOSE(slice(values({1, 2, 3, 4}, {4}), 0, -3, -1), {2, 3}, {2});
  CHECK_CLOSE(slice_assign(zeros({2, 3}), 1, 1, 3, ones({2, 2})), {0, 1, 1, 0, 1, 1}, {2, 3});
  CHECK_CLOSE(concat({values({1, 2}, {1, 2}), values({3, 4, 5, 6}, {2, 2})}, 0), {1, 2, 3, 4, 5, 6}, {3, 2});
  CHECK_CLOSE(concat({values({1, 2}, {2, 1}), values({3, 4, 5, 6}, {2, 2})}, 1), {1, 3, 4, 2, 5, 6}, {2, 3});
  CHECK_CLOSE(stack({values({1, 2}, {2}), values({3, 4}, {2})}, 1), {1, 3, 2, 4}, {2, 2});
  CHECK_CLOSE(expand(values({1, 2}, {2, 1}), {2, 3}), {1, 1, 1, 2, 2, 2}, {2, 3});
  CHECK_CLOSE(expand(values({7}, {}), {2}), {7, 7}, {2});
}

TEST_CASE("matmul: 2-D, batched, broadcast batch, in every float dtype") {
  for (DType d : kFloatTypes) {
    CAPTURE(dtype_name(d));
    const double t = tol(d) * 8;
    const Tensor a = values({1, 2, 3, 4, 5, 6}, {2, 3}, d);
    const Tensor b = values({1, 0, 0, 1, 1, 1}, {3, 2}, d);
    CHECK_CLOSE(matmul(a, b), {4, 5, 10, 11}, {2, 2}, t, t);
    // [2, 2, 3] @ [3, 2]: the batch folds into rows.
    const Tensor ab = stack({a, a * 2.0});
    CHECK_CLOSE(matmul(ab, b), {4, 5, 10, 11, 8, 10, 20, 22}, {2, 2, 2}, t, t);
    // [2, 3] @ [2, 3, 2]: a shared left operand.
    CHECK_CLOSE(matmul(a, stack({b, b * -1.0})), {4, 5, 10, 11, -4, -5, -10, -11}, {2, 2, 2}, t, t);
    // [2, 1, 2, 3] @ [1, 3, 3, 2] broadcasts to [2, 3, 2, 2].
    const Tensor lhs = stack({a, a + 1.0}).unsqueeze(1);
    const Tensor rhs = stack({b, b * 2.0, b * 3.0}).unsqueeze(0);
    const Tensor out = matmul(lhs, rhs);
    CHECK(out.shape() == Shape{2, 3, 2, 2});
    CHECK_CLOSE(slice(slice(out, 0, 1, 2), 1, 2, 3).reshape({2, 2}), matmul(a + 1.0, b * 3.0), t, t);
  }
  CHECK_CLOSE(matmul(zeros({2, 0}), zeros({0, 3})), {0, 0, 0, 0, 0, 0}, {2, 3});
  // A 1-row and a 1-column case, and a larger product against a reference sum.
  CHECK_CLOSE(matmul(values({1, 2}, {1, 2}), values({3, 4}, {2, 1})), {11}, {1, 1});
  const Tensor x = randn({33, 17}, 1, 0, DType::f64), w = randn({17, 9}, 2, 0, DType::f64);
  const Tensor ref = sum(x.unsqueeze(2) * w.unsqueeze(0), {1});
  CHECK_CLOSE(matmul(x, w), ref, 1e-12, 1e-12);
  CHECK_CLOSE(matmul(x.to(DType::f32), w.to(DType::f32)), ref, 1e-4, 1e-4);
}

TEST_CASE("linear equals matmul plus bias over leading axes") {
  const Tensor x = randn({2, 5, 7}, 1), w = randn({7, 3}, 2), b = randn({3}, 3);
  CHECK_CLOSE(linear(x, w, b), matmul(x, w) + b, 1e-5, 1e-5);
  CHECK_CLOSE(linear(x, w), matmul(x, w), 1e-5, 1e-5);
  CHECK_CLOSE(linear(x, transpose(w, 0, 1), b, WeightLayout::out_in), matmul(x, w) + b, 1e-5, 1e-5);
  CHECK_CLOSE(linear(x.to(DType::bf16), w.to(DType::bf16), b.to(DType::bf16)).to(DType::f32), matmul(x, w) + b, 0.1,
              0.05);
}

TEST_CASE("products with an inner size of 0 and several batch axes: zeros (the permuted operand recursed forever)") {
  // [4, 3, 2, 5, 0] with permuted strides: more than two batch axes survive the merge, and an
  // empty operand counts as contiguous, so making it dense changed nothing and the product called
  // itself until the stack overflowed.
  const Tensor a = zeros({2, 3, 4, 5, 6}).slice(-1, 0, 0).permute({2, 1, 0, 3, 4});
  for (const Tensor& b : {zeros({0, 7}), zeros({2, 0, 7}).expand({4, 3, 2, 0, 7}).permute({0, 1, 2, 3, 4})}) {
    CAPTURE(b.shape());
    const Tensor y = matmul(a, b);
    CHECK(y.shape() == Shape{4, 3, 2, 5, 7});
    CHECK(sum(abs(y)).item() == 0.0);
  }
  Tensor leaf = zeros({2, 3, 4, 5, 0}).set_requires_grad();
  Tensor w = ones({0, 7}).set_requires_grad();
  sum(matmul(leaf.permute({2, 1, 0, 3, 4}), w)).backward();
  CHECK(leaf.grad().shape() == leaf.shape());
  CHECK(w.grad().shape() == w.shape());
}

TEST_CASE("products whose inner or output size is 0 differentiate: zero gradients of the operands' shapes") {
  // The forward was zeros (plus the bias); the backward reshaped its gradient with an inferred -1
  // beside a 0, which cannot be inferred, and raised.
  for (auto [m, k, n] : {std::array<std::int64_t, 3>{2, 0, 3}, {2, 3, 0}, {0, 3, 2}}) {
    CAPTURE(m);
    CAPTURE(k);
    CAPTURE(n);
    Tensor a = ones({m, k}).set_requires_grad(), b = ones({k, n}).set_requires_grad();
    sum(matmul(a, b)).backward();
    CHECK_CLOSE(a.grad(), std::vector<double>(static_cast<std::size_t>(m * k), n), {m, k});
    CHECK_CLOSE(b.grad(), std::vector<double>(static_cast<std::size_t>(k * n), m), {k, n});
    Tensor batched = ones({2, m, k}).set_requires_grad();
    sum(matmul(batched, b)).backward();
    CHECK_CLOSE(batched.grad(), std::vector<double>(static_cast<std::size_t>(2 * m * k), n), {2, m, k});
    for (bool out_in : {false, true}) {
      const WeightLayout layout = out_in ? WeightLayout::out_in : WeightLayout::in_out;
      Tensor x = ones({m, k}).set_requires_grad(), bias = ones({n}).set_requires_grad();
      Tensor w = ones(out_in ? Shape{n, k} : Shape{k, n}).set_requires_grad();
      for (auto mode : {GeluBackward::keep_pre_activation, GeluBackward::recompute}) {
        x.zero_grad();
        w.zero_grad();
        bias.zero_grad();
        sum(linear_gelu(x, w, bias, GeluApproximation::erf, layout, mode)).backward();
        // d/dh gelu at h = bias = 1 (the product is 0): Phi(1) + phi(1)
        const double slope =
            0.5 * (1 + std::erf(1 / std::numbers::sqrt2)) + std::exp(-0.5) / std::sqrt(2 * std::numbers::pi);
        CHECK_CLOSE(bias.grad(), std::vector<double>(static_cast<std::size_t>(n), m * slope), {n});
        CHECK(x.grad().shape() == Shape{m, k});
        CHECK(w.grad().shape() == w.shape());
      }
      x.zero_grad();
      w.zero_grad();
      bias.zero_grad();
      sum(linear(x, w, bias, layout)).backward();
      CHECK_CLOSE(bias.grad(), std::vector<double>(static_cast<std::size_t>(n), m), {n});
      CHECK_CLOSE(x.grad(), std::vector<double>(static_cast<std::size_t>(m * k), n), {m, k});
    }
  }
}

TEST_CASE("linear_gelu equals gelu(linear(...)), forward and backward, keeping or recomputing the pre-activation") {
  for (DType dtype : {DType::f32, DType::f64, DType::bf16}) {
    CAPTURE(dtype_name(dtype));
    const double tol = dtype == DType::f64 ? 1e-12 : dtype == DType::f32 ? 1e-5 : 2e-2;
    for (auto approximation : {GeluApproximation::erf, GeluApproximation::tanh}) {
      for (auto mode : {GeluBackward::keep_pre_activation, GeluBackward::recompute}) {
        CAPTURE(static_cast<int>(mode));
        for (bool out_in : {false, true}) {
          const WeightLayout layout = out_in ? WeightLayout::out_in : WeightLayout::in_out;
          auto leaf = [&](const Shape& shape, std::uint64_t seed) {
            return randn(shape, seed, 0, DType::f64).to(dtype).set_requires_grad();
          };
          // Sizes past oneDNN's small-product threshold, so its post-op runs where it is built.
          Tensor x = leaf({3, 40, 48}, 1), w = leaf(out_in ? Shape{96, 48} : Shape{48, 96}, 2), b = leaf({96}, 3);
          const Tensor gy = randn({3, 40, 96}, 4, 0, DType::f64).to(dtype);
          const Tensor fused = linear_gelu(x, w, b, approximation, layout, mode);
          fused.backward(gy);
          const Tensor gx = x.grad(), gw = w.grad(), gb = b.grad();
          x.zero_grad();
          w.zero_grad();
          b.zero_grad();
          const Tensor composed = gelu(linear(x, w, b, layout), approximation);
          composed.backward(gy);
          auto close = [&](const Tensor& got, const Tensor& want) {
            const double scale = max(abs(want.to(DType::f64))).item();
            CHECK_CLOSE(got.to(DType::f64), want.to(DType::f64), tol * scale, tol);
          };
          close(fused, composed);
          close(gx, x.grad());
          close(gw, w.grad());
          close(gb, b.grad());
        }
      }
    }
  }
  // The forward gives the same bits with grad and without (a checkpointed block runs it without,
  // then again with grad in backward): both run the kernel unary() runs, on every backend, at
  // sizes past oneDNN's small-tensor threshold.
  for (DType dtype : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dtype));
    const Tensor x = randn({64, 96}, 11, 0, DType::f64).to(dtype).set_requires_grad();
    const Tensor w = (randn({96, 128}, 12, 0, DType::f64) * 0.2).to(dtype), b = randn({128}, 13).to(dtype);
    Tensor plain;
    {
      autograd::NoGradGuard no_grad;
      plain = linear_gelu(x, w, b);
    }
    const Tensor recorded = linear_gelu(x, w, b);
    CHECK(recorded.requires_grad());
    CHECK(recorded.to_vector<double>() == plain.to_vector<double>());
  }
  // Without a bias, and with no input feature (the bias alone, GELU applied).
  const Tensor x = randn({4, 6}, 5), w = randn({6, 3}, 6);
  CHECK_CLOSE(linear_gelu(x, w), gelu(linear(x, w)), 1e-5, 1e-5);
  const Tensor b = randn({3}, 7);
  CHECK_CLOSE(linear_gelu(zeros({4, 0}), zeros({0, 3}), b), gelu(b).expand({4, 3}), 1e-6, 1e-6);
  // What backward keeps: with recompute, x, the weight and the bias, not the [rows, out]
  // pre-activation; keeping it, one [rows, out] tensor more (GELU's derivative there, written over
  // the pre-activation), as the composed ops keep the pre-activation.
  memory::Scope scope;
  const Tensor big_x = randn({64, 32}, 8).set_requires_grad(), big_w = randn({32, 512}, 9).set_requires_grad();
  memory::reset_peak();
  const std::int64_t before = scope.stats().live_bytes;
  Tensor fused = linear_gelu(big_x, big_w, {}, GeluApproximation::erf, WeightLayout::in_out, GeluBackward::recompute);
  const std::int64_t fused_kept = scope.stats().live_bytes - before;
  fused = Tensor();
  memory::reset_peak();
  Tensor kept = linear_gelu(big_x, big_w);
  const std::int64_t kept_bytes = scope.stats().live_bytes - before;
  // The derivative takes h's memory: the output and h at the peak. Where unary_with_derivative
  // falls to the base class's default (the oneDNN backend with RUDA_ONEDNN_KERNELS=all), its
  // gy = 1 and the derivative's own buffer are transients too.
  const char* all_kernels = std::getenv("RUDA_ONEDNN_KERNELS");
  const bool base_default = big_x.backend().name() == "onednn" && all_kernels && std::string(all_kernels) == "all";
  CHECK(scope.stats().peak_bytes - before == (base_default ? 4 : 2) * 64 * 512 * 4);
  kept = Tensor();
  const Tensor composed = gelu(linear(big_x, big_w));
  const std::int64_t composed_kept = scope.stats().live_bytes - before;
  const std::int64_t activation = 64 * 512 * 4;
  CHECK(fused_kept == activation);         // the output alone
  CHECK(kept_bytes == 2 * activation);     // the output and GELU's derivative at the pre-activation
  CHECK(composed_kept == 2 * activation);  // the output and the pre-activation GELU's backward reads
  // Bad input is named as linear's is.
  CHECK_THROWS_AS(linear_gelu(zeros({2, 3}), zeros({4, 5})), ShapeError);
  CHECK_THROWS_AS(linear_gelu(zeros({2, 3}), zeros({3, 5}), {}, static_cast<GeluApproximation>(4)), ArgumentError);
  CHECK_THROWS_AS(linear_gelu(zeros({2, 3}), zeros({3, 5}), {}, GeluApproximation::erf, WeightLayout::in_out,
                              static_cast<GeluBackward>(9)),
                  ArgumentError);
}

TEST_CASE("16-bit sums over separate axes round once, as over one run of axes (and the broadcast gradient)") {
  // Folded run by run, each partial sum was rounded to 16 bits: bf16 sum over {0, 2} of
  // arange(24) * 0.7 - 5 read 1.9375 for 2. The reference: the f64 sum of the 16-bit values,
  // rounded once.
  for (const DType dtype : {DType::bf16, DType::f16}) {
    CAPTURE(dtype_name(dtype));
    const Tensor x = (arange(0, 24, 1, DType::f64) * 0.7 - 5.0).reshape({2, 3, 4}).to(dtype);
    const Tensor exact = sum(x.to(DType::f64), {0, 2}).to(dtype);
    CHECK(sum(x, {0, 2}).to_vector<double>() == exact.to_vector<double>());
    const Tensor wide = randn({4, 6, 9}, 3).to(dtype);
    for (const Axes& axes : {Axes{0, 2}, Axes{1}, Axes{0, 1, 2}}) {
      CHECK(sum(wide, axes).to_vector<double>() == sum(wide.to(DType::f64), axes).to(dtype).to_vector<double>());
    }
    const auto got = logsumexp(wide, {0, 2}).to_vector<double>();
    const auto want = logsumexp(wide.to(DType::f64), {0, 2}).to_vector<double>();
    for (std::size_t i = 0; i < want.size(); ++i) CHECK(std::abs(got[i] - want[i]) <= 8e-3 * std::abs(want[i]));
    // The gradient of a [1, 6, 1] operand broadcast against [4, 6, 9]: one rounding too.
    const Tensor b = ones({1, 6, 1}, dtype).set_requires_grad();
    sum((b * wide) * wide).backward();
    CHECK(b.grad().reshape({6}).to_vector<double>() ==
          sum(((wide * wide).to(DType::f64)), {0, 2}).to(dtype).to_vector<double>());
  }
}

TEST_CASE("take_along_axis on any axis: values and gradients against a loop, bit for bit") {
  // A leading axis with few picks reads x in place (its rows are the picks' flat positions), and
  // the gradient's scatter splits 16-bit rows fewer than the threads or sorts a long row's few
  // picks: each destination still sums its picks in pick order, in f32 for 16-bit (rounded once),
  // as the loop does.
  struct Case {
    Shape x;
    std::int64_t axis, picks;
  };
  // (Picking at least half as many as the axis holds moves the axis last instead: the first two
  // and the last; a middle axis of few picks reads in place, [4, 40, 3] and [8, 64, 16]; a 16-bit
  // leading-axis gradient of many picks in one row is split by columns, where there are threads.)
  const std::vector<Case> cases = {{{6, 5, 4}, 0, 7},   {{6, 5, 4}, 1, 9},  {{6, 5, 4}, 2, 3},  {{300, 3}, 0, 2},
                                   {{40, 1000}, 0, 19}, {{1, 4000}, 1, 3},  {{64, 2000}, 1, 2}, {{3, 40, 2}, 1, 700},
                                   {{4, 40, 3}, 1, 5},  {{8, 64, 16}, 1, 4}};
  const int threads = num_threads();
  for (const int t : {1, max_num_threads()}) {
    set_num_threads(t);
    for (const DType dtype : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
      for (const Case& c : cases) {
        CAPTURE(t);
        CAPTURE(dtype_name(dtype));
        CAPTURE(c.x);
        CAPTURE(c.axis);
        Shape index_shape = c.x;
        index_shape[static_cast<std::size_t>(c.axis)] = c.picks;
        const std::int64_t n = c.x[static_cast<std::size_t>(c.axis)];
        const Tensor x = randn(c.x, 3).to(dtype).set_requires_grad();
        const Tensor index = randint(index_shape, 0, n, 4);
        const Tensor g = randn(index_shape, 5).to(dtype);
        const Tensor out = take_along_axis(x, index, c.axis);
        (out * g).sum().backward();
        // The loop: x and the index as [outer, n or picks, inner].
        std::int64_t outer = 1, inner = 1;
        for (std::int64_t i = 0; i < c.axis; ++i) outer *= c.x[static_cast<std::size_t>(i)];
        for (std::size_t i = static_cast<std::size_t>(c.axis) + 1; i < c.x.size(); ++i) inner *= c.x[i];
        const auto xs = x.to_vector<double>(), gs = g.to_vector<double>();
        const auto is = index.to_vector<std::int64_t>();
        std::vector<double> want_out(is.size()), want_grad(xs.size(), 0.0);
        for (std::int64_t o = 0; o < outer; ++o) {
          for (std::int64_t p = 0; p < c.picks; ++p) {
            for (std::int64_t i = 0; i < inner; ++i) {
              const std::int64_t at = (o * c.picks + p) * inner + i;
              const std::int64_t from = (o * n + is[static_cast<std::size_t>(at)]) * inner + i;
              want_out[static_cast<std::size_t>(at)] = xs[static_cast<std::size_t>(from)];
              double& acc = want_grad[static_cast<std::size_t>(from)];
              // f64 adds in f64; the others in f32 (16-bit rounded once, below).
              acc = dtype == DType::f64 ? acc + gs[static_cast<std::size_t>(at)]
                                        : static_cast<double>(static_cast<float>(acc) +
                                                              static_cast<float>(gs[static_cast<std::size_t>(at)]));
            }
          }
        }
        CHECK(out.to_vector<double>() == want_out);
        CHECK(x.grad().to_vector<double>() == values(want_grad, c.x, DType::f64).to(dtype).to_vector<double>());
      }
    }
  }
  set_num_threads(threads);
}

TEST_CASE("16-bit scatter-adds (embedding and take_along_axis gradients) sum a repeated index in f32") {
  // Rounded to bf16 after every add, a destination stopped growing at 256 (256 + 1 is 256).
  for (const DType dtype : {DType::bf16, DType::f16}) {
    CAPTURE(dtype_name(dtype));
    const Tensor x = values({1, 2, 3, 4}, {1, 4}, dtype).set_requires_grad();
    sum(take_along_axis(x, zeros({1, 300}, DType::i64), 1)).backward();
    CHECK(x.grad().to_vector<double>() == std::vector<double>{300, 0, 0, 0});
    const Tensor table = zeros({3, 2}, dtype).set_requires_grad();
    Tensor index = zeros({301}, DType::i64);
    index.slice(0, 300, 301).fill_(2.0);
    sum(embedding(table, index)).backward();
    CHECK(table.grad().to_vector<double>() == std::vector<double>{300, 300, 0, 0, 1, 1});
  }
  test::check_throws<DTypeError>(
      [] {
        clamp(values({1, 0}, {2}, DType::boolean), 0, 1);
      },
      {"clamp", "bool tensor [2]"});
  test::check_throws<ShapeError>([] { from_values({1, 2}, {3}); }, {"from_values", "2 values", "[3]"});
}

TEST_CASE("pow with 2, 3, -1 and -2 computes PyTorch's formulas, each operation rounded to the dtype") {
  // PyTorch 2.15's values (std::pow rounded once: bf16 5.25^3 was 145, f32 x^-1 1 ulp off 1/x).
  CHECK(pow(full({1}, 5.25, DType::bf16), 3.0).item() == 144.0);
  CHECK(pow(full({1}, 0.4609375, DType::bf16), -2.0).item() == 4.6875);
  CHECK(pow(full({1}, -10000.0 / 997), 3.0).item() == -1009.0543212890625);
  CHECK(pow(full({1}, 4986.0 / 997), -1.0).item() == 0.1999598890542984);
  // And bit for bit the formulas on every dtype and many values.
  for (DType dtype : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    CAPTURE(dtype_name(dtype));
    const Tensor x = (randn({4096}, 41) * 3.0).to(dtype);
    test::check_close(pow(x, 2.0), x * x, 0, 0);
    test::check_close(pow(x, 3.0), x * x * x, 0, 0);
    test::check_close(pow(x, -1.0), reciprocal(x), 0, 0);
    test::check_close(pow(x, -2.0), reciprocal(x * x), 0, 0);
  }
}

TEST_CASE("an integer operand added into a 16-bit tensor in place takes the tensor's dtype first, as PyTorch's") {
  // PyTorch 2.15: bf16 1 .add_(i64 257) is 256 (257 is 256 in bf16); widened to f32 it was 258.
  Tensor x = full({1}, 1.0, DType::bf16);
  x.add_(from_vector<std::int64_t>({257}, {1}));
  CHECK(x.item() == 256.0);
  Tensor y = full({1}, 1.0, DType::f16);
  y.add_(from_vector<std::int64_t>({2049}, {1}));
  CHECK(y.item() == 2048.0);
  Tensor z = full({1}, 1.0, DType::bf16);
  z.add_(from_vector<std::int64_t>({257}, {1}), 3.0);
  CHECK(z.item() == 768.0);
  // A float operand still adds in f32 and rounds once (bf16 0.578125 + f32 0.037 is 0.61328125).
  Tensor w = full({1}, 0.578125, DType::bf16);
  w.add_(full({1}, 0.037));
  CHECK(w.item() == 0.61328125);
}

TEST_CASE("pow's gradient multiplies g by the whole derivative, as PyTorch: an overflowed one stays infinite in bf16") {
  // a = b = 1e-40 (bf16 subnormals), g = -0.125: b * a^(b-1) overflows to inf, so the gradient is
  // -inf (PyTorch's bf16 and ruda's f32 say so); computed (g * b) * a^(b-1), g * b rounded to 0 in
  // bf16 and 0 * inf gave NaN.
  const Tensor a = values({1e-40}, {1}, DType::bf16).set_requires_grad();
  const Tensor b = values({1e-40}, {1}, DType::bf16).set_requires_grad();
  const Tensor g = values({-0.125}, {1}, DType::bf16);
  pow(a, b).backward(g);
  CHECK(a.grad().to_vector<double>()[0] == -std::numeric_limits<double>::infinity());
  // The same with a number exponent.
  const Tensor x = values({1e-40}, {1}, DType::bf16).set_requires_grad();
  pow(x, 1e-40).backward(g);
  CHECK(x.grad().to_vector<double>()[0] == -std::numeric_limits<double>::infinity());
}

TEST_CASE("overflow-prone gradients and statistics, below and above the oneDNN backend's size floor") {
  // Each case at 5 and at 5000 elements: the oneDNN backend hands fewer than 4096 to the Eigen
  // kernels, and the two gave different answers (square's backward), or both the wrong one.
  for (const std::int64_t n : {5, 5000}) {
    CAPTURE(n);
    // d(a / b)/db = -g (a/b) / b: as -(g / b)(a/b), g / b overflowed for a tiny b, and gave NaN
    // (inf * 0) where a is 0, inf where the gradient is 1.4e35 (PyTorch's answers below).
    const Tensor a = full({n}, 0.0), a2 = full({n}, 1.4e-45);
    const Tensor b = full({n}, -1e-40).set_requires_grad(), b2 = full({n}, 1e-40).set_requires_grad();
    (a / b).backward(full({n}, 1.0));
    (a2 / b2).backward(full({n}, 1.0));
    const double gb = b.grad().to_vector<double>()[0], gb2 = b2.grad().to_vector<double>()[0];
    CHECK(gb == 0.0);
    CHECK(std::signbit(gb));
    CHECK(std::isfinite(gb2));
    CHECK(gb2 == doctest::Approx(-1.401298e-45 / 1e-40 / 1e-40).epsilon(1e-3));
    // square's gradient is g (2x): 2x overflows at 3e38 (PyTorch's inf), on either kernel.
    const Tensor x = full({n}, 3e38).set_requires_grad();
    square(x).backward(full({n}, 0.5));
    CHECK(x.grad().to_vector<double>()[0] == std::numeric_limits<double>::infinity());
    // A row of values near f32's largest: its sum overflows, its mean does not (it was inf, and
    // every output NaN); the row normalizes to 0.
    for (const DType d : {DType::f32, DType::bf16}) {
      const Tensor big = full({n, 103}, 3e38).to(d);
      const std::vector<double> y = layer_norm(big, Tensor(), Tensor()).to_vector<double>();
      CHECK(std::all_of(y.begin(), y.end(), [](double v) { return v == 0.0; }));
    }
    // A broadcast left operand of sub keeps the sign of a zero result: -0 - 0 is -0 and 0 - 0 is
    // +0 (oneDNN runs it with the operands swapped: as -(0 - -0) with a negating post-op it was +0).
    for (const DType d : {DType::f32, DType::bf16}) {
      CAPTURE(dtype_name(d));
      for (const double zero : {-0.0, 0.0}) {
        const std::vector<double> diff = (full({1, 103}, zero).to(d) - zeros({n, 103}).to(d)).to_vector<double>();
        CHECK(std::all_of(diff.begin(), diff.end(),
                          [&](double v) { return v == 0.0 && std::signbit(v) == std::signbit(zero); }));
      }
    }
  }
}

TEST_CASE("max and min over a non-innermost axis: NaN wherever it sits, infinities, the first of tied zeros") {
  // The column fold runs as vectorized selects: each column against a scalar fold of the same
  // rule (a NaN stays, a NaN or a strictly larger / smaller value replaces), bit for bit, with
  // -0 and +0 told apart.
  std::mt19937 gen(3);
  const double specials[] = {std::numeric_limits<double>::quiet_NaN(),
                             std::numeric_limits<double>::infinity(),
                             -std::numeric_limits<double>::infinity(),
                             0.0,
                             -0.0,
                             1.0,
                             -1.0};
  const std::int64_t rows = 37, cols = 203;
  for (const DType d : {DType::f32, DType::f64, DType::bf16}) {
    CAPTURE(dtype_name(d));
    std::vector<double> v(static_cast<std::size_t>(rows * cols));
    for (double& e : v)
      e = gen() % 5 == 0 ? specials[gen() % 7] : static_cast<double>(static_cast<int>(gen() % 13) - 6);
    const Tensor x = values(v, {rows, cols}, d);
    const std::vector<double> got_max = max(x, {0}).to_vector<double>(), got_min = min(x, {0}).to_vector<double>();
    auto same = [](double p, double q) {
      return (std::isnan(p) && std::isnan(q)) || (p == q && std::signbit(p) == std::signbit(q));
    };
    int wrong = 0;
    for (std::int64_t j = 0; j < cols; ++j) {
      double hi = v[static_cast<std::size_t>(j)], lo = hi;
      for (std::int64_t i = 1; i < rows; ++i) {
        const double e = v[static_cast<std::size_t>(i * cols + j)];
        if (!std::isnan(hi) && (std::isnan(e) || e > hi)) hi = e;
        if (!std::isnan(lo) && (std::isnan(e) || e < lo)) lo = e;
      }
      wrong += !same(got_max[static_cast<std::size_t>(j)], hi) + !same(got_min[static_cast<std::size_t>(j)], lo);
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("pow with a number: PyTorch's values and gradients at -0 and -inf (0.5 and -0.5 are sqrt and rsqrt)") {
  // PyTorch 2.15's values; std::pow gave pow(-0, 0.5) = 0 and pow(-inf, 0.5) = inf, and the
  // gradient of x^1.5 at -inf inf (PyTorch: 1.5 * sqrt(-inf), NaN).
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  struct Case {
    double exponent;
    std::vector<double> value, grad;  // at -0, -inf, 0, 4, inf, -2
  };
  const std::vector<Case> cases = {
      {0.5, {-0.0, nan, 0, 2, inf, nan}, {-inf, nan, inf, 0.25, 0, nan}},
      {-0.5, {-inf, nan, inf, 0.5, 0, nan}, {-inf, -0.0, -inf, -0.0625, -0.0, nan}},
      {1.5, {0, inf, 0, 8, inf, nan}, {-0.0, nan, 0, 3, inf, nan}},
      {2.0, {0, inf, 0, 16, inf, 4}, {-0.0, -inf, 0, 8, inf, -4}},
      {0.0, {1, 1, 1, 1, 1, 1}, {0, 0, 0, 0, 0, 0}},
  };
  auto same = [](const std::vector<double>& got, const std::vector<double>& want) {
    for (std::size_t i = 0; i < want.size(); ++i) {
      if (std::isnan(want[i]) ? !std::isnan(got[i])
                              : (got[i] != want[i] || std::signbit(got[i]) != std::signbit(want[i])))
        return false;
    }
    return true;
  };
  for (const Case& c : cases) {
    CAPTURE(c.exponent);
    const Tensor x = values({-0.0, -inf, 0, 4, inf, -2}, {6}, DType::f64).set_requires_grad();
    const Tensor y = pow(x, c.exponent);
    sum(y).backward();
    CHECK(same(y.to_vector<double>(), c.value));
    CHECK(same(x.grad().to_vector<double>(), c.grad));
  }
}

TEST_CASE("embedding, take_along_axis, softmax") {
  const Tensor table = values({0, 1, 10, 11, 20, 21}, {3, 2});
  const Tensor idx = values({2, 0, 2, 1}, {2, 2}, DType::i64);
  CHECK_CLOSE(embedding(table, idx), {20, 21, 0, 1, 20, 21, 10, 11}, {2, 2, 2});
  const Tensor x = values({1, 2, 3, 4, 5, 6}, {2, 3});
  CHECK_CLOSE(take_along_axis(x, values({2, 0, 1, 1}, {2, 2}, DType::i64), 1), {3, 1, 5, 5}, {2, 2});
  CHECK_CLOSE(take_along_axis(x, values({1, 0, 1}, {1, 3}, DType::i64), 0), {4, 2, 6}, {1, 3});
  for (DType d : kFloatTypes) {
    CAPTURE(dtype_name(d));
    const Tensor xs = values({1, 2, 3, 1, 1, 1}, {2, 3}, d);
    const double e1 = std::exp(1), e2 = std::exp(2), e3 = std::exp(3), z = e1 + e2 + e3;
    const double t = tol(d) * 4;
    CHECK_CLOSE(softmax(xs, 1), {e1 / z, e2 / z, e3 / z, 1.0 / 3, 1.0 / 3, 1.0 / 3}, {2, 3}, t, t);
    CHECK_CLOSE(log_softmax(xs, -1),
                {1 - std::log(z), 2 - std::log(z), 3 - std::log(z), -std::log(3), -std::log(3), -std::log(3)}, {2, 3},
                t, t);
    CHECK_CLOSE(softmax(xs, 0), {0.5, 1 / (1 + 1 / e1), 1 / (1 + 1 / e2), 0.5, 1 / (1 + e1), 1 / (1 + e2)}, {2, 3}, t,
                t);
  }
  // Large logits do not overflow.
  CHECK_CLOSE(softmax(values({1000, 1000}, {2})), {0.5, 0.5}, {2});
}

TEST_CASE("layer_norm equals its composite definition, every float dtype") {
  for (DType d : kFloatTypes) {
    CAPTURE(dtype_name(d));
    const Tensor x = randn({3, 4, 16}, 1, 0, d) * 3.0 + 1.0, w = randn({16}, 2, 0, d), b = randn({16}, 3, 0, d);
    const Tensor xf = x.to(DType::f64);
    const Tensor c = xf - mean(xf, {-1}, true);
    const Tensor ref = c * rsqrt(mean(square(c), {-1}, true) + 1e-5) * w.to(DType::f64) + b.to(DType::f64);
    const double t = tol(d) * 30;
    CHECK_CLOSE(layer_norm(x, w, b).to(DType::f64), ref, t, t);
    // Either parameter alone, as PyTorch's layer_norm takes them (it was refused): the other one's
    // identity, and the mixed form (f32 parameter beside 16-bit x) too.
    const Tensor scaled = c * rsqrt(mean(square(c), {-1}, true) + 1e-5) * w.to(DType::f64);
    CHECK_CLOSE(layer_norm(x, w, Tensor()).to(DType::f64), scaled, t, t);
    CHECK_CLOSE(layer_norm(x, Tensor(), b).to(DType::f64), ref - scaled + c * rsqrt(mean(square(c), {-1}, true) + 1e-5),
                t, t);
    if (is_16bit_float(d)) {
      CHECK_CLOSE(layer_norm(x, w.to(DType::f32), Tensor()).to(DType::f64), scaled, t, t);
    }
  }
  CHECK_CLOSE(layer_norm(values({1, 2, 3}, {3}), Tensor(), Tensor(), 0), {-std::sqrt(1.5), 0, std::sqrt(1.5)}, {3},
              1e-6, 1e-6);
}

TEST_CASE("layer_norm of a constant row is its bias exactly, as PyTorch's (padding tokens' rows)") {
  // The mean of equal f32 values summed plainly was an ulp off (3 x 1.8088348 / 3), and
  // 1 / sqrt(eps) made the output bias + 4e-5 * weight.
  for (DType d : kFloatTypes) {
    CAPTURE(dtype_name(d));
    for (const double v : {1.8088347911834717, -0.1, 3e4}) {
      for (std::int64_t features : {3, 7, 768}) {
        CAPTURE(v);
        CAPTURE(features);
        const Tensor x = full({2, features}, v, d), w = randn({features}, 2, 0, d), b = randn({features}, 3, 0, d);
        const std::vector<double> y = layer_norm(x, w, b).to_vector<double>(), bias = b.to_vector<double>();
        for (std::int64_t j = 0; j < 2 * features; ++j) CHECK(y[j] == bias[j % features]);
      }
    }
  }
}

TEST_CASE("layer_norm with f32 parameters beside 16-bit x: the bits of casting x to f32 and back") {
  // The mixed form (nn::LayerNorm uses it for bf16; the op takes f16 too): its forward and all
  // three gradients must be exactly what the f32 kernel between two casts gives.
  for (DType d : {DType::bf16, DType::f16}) {
    CAPTURE(dtype_name(d));
    for (std::int64_t features : {67, 256}) {
      CAPTURE(features);
      for (bool strided : {false, true}) {
        CAPTURE(strided);
        for (bool affine : {true, false}) {
          CAPTURE(affine);
          // 67 features: rows that are not a multiple of the kernel's 16 lanes. 384 rows: enough
          // values that a multiply-add the compiler contracts in one instantiation only shows.
          const Tensor base = (randn({features, 24, 16}, 4) * 2.0 + 0.5).to(d);
          const Tensor x0 = strided ? transpose(base, 0, 2) : base.reshape({16, 24, features});
          const Tensor g = randn({16, 24, features}, 5).to(d);
          const Tensor w0 = randn({features}, 6) + 1.0, b0 = randn({features}, 7);
          auto run = [&](bool mixed) {
            const Tensor x = x0.detach().set_requires_grad();
            const Tensor w = w0.detach().set_requires_grad(), b = b0.detach().set_requires_grad();
            const Tensor y =
                mixed ? (affine ? layer_norm(x, w, b) : layer_norm(x, Tensor(), Tensor()))
                      : (affine ? layer_norm(x.to(DType::f32), w, b) : layer_norm(x.to(DType::f32), Tensor(), Tensor()))
                            .to(d);
            y.backward(g);
            return std::vector<Tensor>{y, x.grad(), affine ? w.grad() : Tensor(), affine ? b.grad() : Tensor()};
          };
          const std::vector<Tensor> mixed = run(true), reference = run(false);
          CHECK(mixed[0].dtype() == d);
          CHECK(mixed[1].dtype() == d);
          CHECK_CLOSE(mixed[0], reference[0], 0, 0);
          CHECK_CLOSE(mixed[1], reference[1], 0, 0);
          if (affine) {
            CHECK(mixed[2].dtype() == DType::f32);
            CHECK(mixed[3].dtype() == DType::f32);
            CHECK_CLOSE(mixed[2], reference[2], 0, 0);
            CHECK_CLOSE(mixed[3], reference[3], 0, 0);
          }
        }
      }
    }
  }
  // Only f32 parameters beside 16-bit x; weight and bias in one dtype.
  const Tensor x16 = randn({2, 8}, 1).to(DType::bf16), w32 = ones({8}), b32 = zeros({8});
  CHECK_THROWS_AS(layer_norm(x16, w32.to(DType::f64), b32.to(DType::f64)), DTypeError);
  CHECK_THROWS_AS(layer_norm(x16, w32, b32.to(DType::bf16)), DTypeError);
  CHECK_THROWS_AS(layer_norm(x16.to(DType::f64), w32, b32), DTypeError);
  CHECK_THROWS_WITH_AS(layer_norm(x16, w32.to(DType::bf16), b32), doctest::Contains("weight and bias dtypes differ"),
                       DTypeError);
}

TEST_CASE("dropout keeps the expected fraction, scaled, reproducibly") {
  const Tensor x = ones({10000});
  const Tensor y = dropout(x, 0.25, 11);
  const auto v = y.to_vector<float>();
  int kept = 0;
  for (float e : v) {
    if (e != 0) {
      CHECK(e == doctest::Approx(1 / 0.75));
      ++kept;
    }
  }
  CHECK(kept == doctest::Approx(7500).epsilon(0.03));
  CHECK_CLOSE(dropout(x, 0.25, 11), y, 0, 0);
  CHECK(dropout(x, 0.0, 1).shares_storage(x));
}

TEST_CASE("dropout drops exactly the elements whose draw (rand at the same seed and offset) is below p") {
  // The mask is made in one pass from Philox's words (random.cpp's dropout_mask), in x's dtype:
  // it must be the comparison of rand's f32 draws with p as f32, element for element, past the
  // parallel threshold and across a 2^32 carry of the counter.
  const std::int64_t n = 70001;
  const std::uint64_t offset = (std::uint64_t{1} << 32) - 9;
  const std::vector<float> draws = rand({n}, 5, offset).to_vector<float>();
  for (DType d : kFloatTypes) {
    CAPTURE(dtype_name(d));
    const std::vector<double> y = dropout(ones({n}, Options(d)), 0.3, 5, offset).to_vector<double>();
    int wrong = 0, dropped = 0;
    for (std::size_t i = 0; i < draws.size(); ++i) {
      wrong += (y[i] == 0) != (draws[i] < 0.3f);
      dropped += y[i] == 0;
    }
    CHECK(wrong == 0);
    CHECK(dropped == doctest::Approx(0.3 * n).epsilon(0.02));
  }
}

TEST_CASE("in-place updates") {
  Tensor x = zeros({3});
  x.fill_(2);
  CHECK_CLOSE(x, {2, 2, 2}, {3});
  x.add_(values({1, 2, 3}, {3}), 0.5);
  CHECK_CLOSE(x, {2.5, 3, 3.5}, {3});
  x.mul_(2);
  CHECK_CLOSE(x, {5, 6, 7}, {3});
  x.copy_(values({1}, {1}));
  CHECK_CLOSE(x, {1, 1, 1}, {3});
  x.copy_(values({4, 5, 6}, {3}, DType::f64));
  CHECK_CLOSE(x, {4, 5, 6}, {3});
}

TEST_CASE("NaN propagates through relu, maximum, minimum, clamp and max/min reductions; compares are false") {
  // Large enough that the oneDNN backend runs its own kernels rather than Eigen's small-tensor path.
  constexpr std::int64_t kN = 3 * 30000;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> pattern(kN);
  for (std::int64_t i = 0; i < kN; ++i) pattern[i] = i % 3 == 0 ? nan : i % 3 == 1 ? -1.0 : 2.0;
  for (DType dtype : kFloatTypes) {
    CAPTURE(dtype_name(dtype));
    const Tensor x = values(pattern, {kN}, dtype);
    // Elements 0..2 of the result, as doubles: NaN, then the two finite ones.
    auto head = [](const Tensor& t) {
      const auto v = t.slice(0, 0, 3).to(DType::f64).to_vector<double>();
      return std::vector<double>(v.begin(), v.end());
    };
    auto check = [&](const char* what, const Tensor& t, double second, double third) {
      INFO(what);
      const auto v = head(t);
      CHECK(std::isnan(v[0]));
      CHECK(v[1] == second);
      CHECK(v[2] == third);
    };
    check("relu", relu(x), 0.0, 2.0);
    // Of two equal values the first, as PyTorch: maximum(0, -0) is 0 and maximum(-0, 0) is -0.
    const Tensor zero = zeros_like(x), negative_zero = neg(zero);
    for (const auto& [what, t, negative] : {std::tuple{"maximum(0, -0)", maximum(zero, negative_zero), false},
                                            std::tuple{"maximum(-0, 0)", maximum(negative_zero, zero), true},
                                            std::tuple{"minimum(0, -0)", minimum(zero, negative_zero), false},
                                            std::tuple{"minimum(-0, 0)", minimum(negative_zero, zero), true}}) {
      INFO(what);
      CHECK(std::signbit(t.to(DType::f64).to_vector<double>()[kN - 1]) == negative);
    }
    check("maximum", maximum(x, zeros_like(x)), 0.0, 2.0);
    check("minimum", minimum(x, zeros_like(x)), -1.0, 0.0);
    check("clamp", clamp(x, -0.5, 0.5), -0.5, 0.5);
    CHECK(std::isnan(max(x).item()));
    CHECK(std::isnan(min(x).item()));
    CHECK(std::isnan(max(x.reshape({kN / 3, 3}), {0}).to(DType::f64).to_vector<double>()[0]));
    CHECK(argmax(x, 0).item() == 0);  // the NaN, as in PyTorch
    // IEEE comparisons: anything compared with NaN is false, except !=.
    CHECK(head(eq(x, x).to(DType::f64)) == std::vector<double>{0, 1, 1});
    CHECK(head(ne(x, x).to(DType::f64)) == std::vector<double>{1, 0, 0});
    CHECK(head(gt(x, zeros_like(x)).to(DType::f64)) == std::vector<double>{0, 0, 1});
    // relu's gradient passes through where the input is NaN (PyTorch's threshold_backward).
    const Tensor leaf = x.clone().set_requires_grad();
    sum(relu(leaf)).backward();
    CHECK(head(leaf.grad().to(DType::f64)) == std::vector<double>{1, 0, 1});
  }
}

TEST_CASE("f32 sums and logsumexp stay accurate over millions of values, as PyTorch's cascade sums do") {
  // A float accumulator stops growing at 2^24 addends of equal size and drifts long before:
  // logsumexp of 20M zeros read log(2^24) = 16.6355 (PyTorch: log(2e7) = 16.8112), a column sum
  // of 20000 rows of 0.1 read 1999.66, a sum of 1M values of 0.1 100003.8. Each backend.
  const std::string before(default_backend().name());
  for (const std::string& backend : available_backends()) {
    CAPTURE(backend);
    set_default_backend(backend);
    CHECK(logsumexp(zeros({20'000'000}), {0}).item() == doctest::Approx(std::log(2e7)).epsilon(1e-7));
    const Tensor tenths = full({20000, 1000}, 0.1);
    for (double v : sum(tenths, {0}).to_vector<double>()) CHECK(v == doctest::Approx(2000).epsilon(1e-6));
    CHECK(sum(full({1 << 20}, 0.1)).item() == doctest::Approx(0.1f * (1 << 20)).epsilon(1e-6));
    // A strided line (the column sum of a transposed view) and bf16's widened sum alike.
    CHECK(sum(transpose(tenths, 0, 1), {1}).to_vector<double>()[7] == doctest::Approx(2000).epsilon(1e-6));
    CHECK(sum(full({1 << 20}, 0.125, DType::bf16)).item() == (1 << 17));
    // 20M of bf16's 0.1 (0.10009765625) sum to 2001953.125, whose nearest bf16 is 1998848; oneDNN's
    // f32 accumulators read 2023424, 1.5 bf16 ulps off, so long lines go to the Eigen kernel.
    CHECK(sum(full({20'000'000}, 0.1, DType::bf16)).item() == 1998848);
  }
  set_default_backend(before);
}

TEST_CASE("f32 layer_norm and softmax of long rows keep a pairwise sum's accuracy") {
  // Their row statistics were 16 running f32 sums of n/16 values each: over a row of 1e6 values
  // 1000 + randn, layer_norm's outputs were 3.9e-4 off the f64 result (a pairwise sum: 6.7e-6),
  // and a softmax row's total, which scales every probability, 6e-7 off where one rounding is 6e-8.
  const std::int64_t n = 1'000'000;
  const Tensor x64 = randn({1, n}, 41, 0, DType::f64) + 1000.0;
  const Tensor x = x64.to(DType::f32);
  const Tensor exact = layer_norm(x.to(DType::f64), Tensor(), Tensor());
  const double ln_error = max(abs(layer_norm(x, Tensor(), Tensor()).to(DType::f64) - exact)).item();
  CHECK(ln_error < 3e-5);
  // Backward: dx reads the row sums of dy and dy * xhat; against f64 on the same values.
  const Tensor gy64 = randn({1, n}, 42, 0, DType::f64) + 1.0;
  auto dx_of = [&](const Tensor& input, const Tensor& gy) {
    const Tensor leaf = input.detach().set_requires_grad();
    layer_norm(leaf, Tensor(), Tensor()).backward(gy);
    return leaf.grad();
  };
  const Tensor dx_exact = dx_of(x.to(DType::f64), gy64.to(DType::f32).to(DType::f64));
  const Tensor dx = dx_of(x, gy64.to(DType::f32)).to(DType::f64);
  CHECK(max(abs(dx - dx_exact)).item() < 3e-5 * max(abs(dx_exact)).item());
  // softmax: the probabilities of a row add up to 1 within a few roundings (in f64, of the f32
  // values), whatever the row's length.
  const Tensor logits = randn({1, n}, 43);
  CHECK(std::abs(sum(softmax(logits, 1).to(DType::f64)).item() - 1) < 2e-7);
  // Its backward subtracts the row's sum of dy * y from each dy: against f64.
  const Tensor leaf = logits.detach().set_requires_grad();
  softmax(leaf, 1).backward(gy64.to(DType::f32));
  const Tensor leaf64 = logits.to(DType::f64).set_requires_grad();
  softmax(leaf64, 1).backward(gy64.to(DType::f32).to(DType::f64));
  CHECK(max(abs(leaf.grad().to(DType::f64) - leaf64.grad())).item() < 1e-6 * max(abs(leaf64.grad())).item());
}

TEST_CASE("max and min of long contiguous lines: NaN wherever it sits, infinities, every float dtype") {
  // The vectorized paths (Eigen's NaN-propagating extremes; runs widened to f32 for 16-bit
  // dtypes) against the definition, at lengths around their runs' and packets' sizes.
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (DType d : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    for (std::int64_t n : {1, 7, 16, 255, 256, 257, 1000, 4097}) {
      CAPTURE(dtype_name(d));
      CAPTURE(n);
      std::vector<double> v(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n; ++i) v[i] = static_cast<double>((i * 37) % 101) - 50;
      v[static_cast<std::size_t>(n / 2)] = 60;   // the largest, in the middle
      v[static_cast<std::size_t>(n - 1)] = -70;  // the smallest, last
      if (n == 1) v[0] = 5;
      const Tensor x = from_values(v, {n}, d);
      CHECK(max(x).item() == (n == 1 ? 5 : 60));
      CHECK(min(x).item() == (n == 1 ? 5 : -70));
      for (std::int64_t at : {std::int64_t{0}, n / 3, n - 1}) {
        std::vector<double> w = v;
        w[static_cast<std::size_t>(at)] = nan;
        const Tensor y = from_values(w, {n}, d);
        CHECK(std::isnan(max(y).item()));
        CHECK(std::isnan(min(y).item()));
      }
      const Tensor lows = full({n}, -inf, d);
      CHECK(max(lows).item() == -inf);
      CHECK(min(from_values(v, {n}, d) * 0.0 + inf).item() == inf);
    }
  }
}

TEST_CASE("where selects elementwise, contiguous or broadcast, in every element size") {
  const Tensor c = gt(randn({3000}, 91), zeros({}));
  for (DType d : {DType::f32, DType::f64, DType::bf16, DType::i64, DType::boolean}) {
    CAPTURE(dtype_name(d));
    const Tensor a = randn({3000}, 92).to(d), b = randn({3000}, 93).to(d);
    const std::vector<double> cv = c.to_vector<double>(), av = a.to_vector<double>(), bv = b.to_vector<double>();
    const std::vector<double> got = where(c, a, b).to_vector<double>();
    const std::vector<double> with_scalar = where(c, a, zeros({}, d)).to_vector<double>();
    const std::vector<double> strided =
        where(slice(c, 0, 0, 1500), slice(a, 0, 1500, 3000), b.slice(0, 0, 1500)).to_vector<double>();
    for (std::size_t i = 0; i < 3000; ++i) {
      CHECK(got[i] == (cv[i] != 0 ? av[i] : bv[i]));
      CHECK(with_scalar[i] == (cv[i] != 0 ? av[i] : 0.0));
      if (i < 1500) CHECK(strided[i] == (cv[i] != 0 ? av[1500 + i] : bv[i]));
    }
  }
}

TEST_CASE("logsumexp of long contiguous lines against a double reference, with -inf, +inf and NaN") {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (DType d : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    for (std::int64_t n : {1, 255, 256, 257, 1000, 4097}) {
      CAPTURE(dtype_name(d));
      CAPTURE(n);
      // Values the dtype holds exactly (multiples of 1/8 in [-8, 8]), one masked slot.
      std::vector<double> v(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n; ++i) v[i] = static_cast<double>((i * 29) % 129 - 64) / 8;
      if (n > 1) v[static_cast<std::size_t>(n / 2)] = -inf;
      double m = -inf, s = 0;
      for (double x : v) m = std::max(m, x);
      for (double x : v) s += std::exp(x - m);
      const double tolerance = d == DType::f64 ? 1e-13 : d == DType::f32 ? 1e-6 : 1e-2;
      CHECK(logsumexp(from_values(v, {n}, d)).item() == doctest::Approx(m + std::log(s)).epsilon(tolerance));
      std::vector<double> w = v;
      w[static_cast<std::size_t>(n - 1)] = nan;
      CHECK(std::isnan(logsumexp(from_values(w, {n}, d)).item()));
      w[static_cast<std::size_t>(n - 1)] = inf;
      CHECK(logsumexp(from_values(w, {n}, d)).item() == inf);
      CHECK(logsumexp(full({n}, -inf, d)).item() == -inf);
    }
  }
}

TEST_CASE("PyTorch's semantics at the edges: bool comparisons and sums, a scalar's softmax and argmax") {
  const Tensor mask = values({1, 0, 1, 1}, {4}, DType::boolean);
  // Bools compare as 0 and 1 (False < True), with numbers exactly.
  CHECK(lt(mask, 0.5).to_vector<double>() == std::vector<double>{0, 1, 0, 0});
  CHECK(ge(mask, 1.0).to_vector<double>() == std::vector<double>{1, 0, 1, 1});
  CHECK(gt(mask, -3.0).to_vector<double>() == std::vector<double>{1, 1, 1, 1});
  const Tensor other = values({0, 0, 1, 0}, {4}, DType::boolean);
  CHECK(gt(mask, other).to_vector<double>() == std::vector<double>{1, 0, 0, 1});
  CHECK(lt(mask, other).dtype() == DType::boolean);
  test::check_throws<DTypeError>([&] { add(mask, other); }, {"add", "bool"});
  // A bool sum counts the true entries, in i64.
  const Tensor count = sum(mask);
  CHECK(count.dtype() == DType::i64);
  CHECK(count.item() == 3);
  CHECK(sum(reshape(mask, {2, 2}), {1}).to_vector<double>() == std::vector<double>{1, 2});
  // A scalar along axis 0 or -1 is a row of one.
  for (DType d : {DType::f32, DType::f64, DType::bf16}) {
    CAPTURE(dtype_name(d));
    const Tensor s = scalar(2.5, d).set_requires_grad();
    const Tensor p = softmax(s, 0);
    CHECK(p.shape() == Shape{});
    CHECK(p.item() == 1.0);
    CHECK(log_softmax(s, -1).item() == 0.0);
    (p * 3.0).backward();
    CHECK(s.grad().item() == 0.0);
    const Tensor i = argmax(scalar(7.0, d), 0);
    CHECK(i.dtype() == DType::i64);
    CHECK(i.shape() == Shape{});
    CHECK(i.item() == 0);
    CHECK(argmin(scalar(std::nan(""), d), -1).item() == 0);
    test::check_throws<IndexError>([&] { softmax(s, 1); }, {"softmax"});
    test::check_throws<IndexError>([&] { argmax(scalar(1.0, d), 1); }, {"argmax"});
  }
}

TEST_CASE(
    "arithmetic with a number on f16 and bf16: * and / with the number in f32, + and - in the dtype, as PyTorch") {
  // PyTorch 2.15 converts the number of + and - to the tensor's dtype (its promotion of a wrapped
  // number), then computes in f32 and rounds once: kept in f32, bf16 0.1162109375 + 0.1 gave
  // 0.2158203125 and f16 0.1 - 0.1 gave -2.44e-05 (1.5-4% of random elements differed).
  CHECK((values({0.1162109375}, {1}, DType::bf16) + 0.1).to_vector<double>() == std::vector<double>{0.216796875});
  CHECK((0.1 + values({0.1162109375}, {1}, DType::bf16)).to_vector<double>() == std::vector<double>{0.216796875});
  CHECK((values({0.1}, {1}, DType::f16) - 0.1).to_vector<double>() == std::vector<double>{0.0});
  // PyTorch 2.15's values (y * 1.005 and so on, y = [100, 3, 0.7, 1000] in the dtype): rounding
  // the number to the dtype first gave bf16 y * 1.005 = [101, 3.03125, 0.703125, 1008]. (1.005 - y
  // is PyTorch's rsub, which does convert the number: see below.)
  struct Case {
    DType dtype;
    std::vector<std::vector<double>> expected;  // y*1.005, y/1.005, y+0.001, 1.005-y, 2/y, y*0.5
  };
  const std::vector<Case> cases = {
      {DType::bf16,
       {{100.5, 3.015625, 0.703125, 1004.0},
        {99.5, 2.984375, 0.6953125, 996.0},
        {100.0, 3.0, 0.69921875, 1000.0},
        {-99.0, -1.9921875, 0.30859375, -1000.0},
        {0.02001953125, 0.66796875, 2.859375, 0.0019989013671875},
        {50.0, 1.5, 0.349609375, 500.0}}},
      {DType::f16,
       {{100.5, 3.015625, 0.70361328125, 1005.0},
        {99.5, 2.984375, 0.69677734375, 995.0},
        {100.0, 3.001953125, 0.701171875, 1000.0},
        {-99.0, -1.9951171875, 0.3046875, -999.0},
        {0.0200042724609375, 0.66650390625, 2.85546875, 0.0020008087158203125},
        {50.0, 1.5, 0.35009765625, 500.0}}},
  };
  for (const Case& c : cases) {
    CAPTURE(dtype_name(c.dtype));
    const Tensor y = values({100, 3, 0.7, 1000}, {4}, c.dtype).set_requires_grad();
    const std::vector<Tensor> got = {y * 1.005, y / 1.005, y + 0.001, 1.005 - y, 2.0 / y, y * 0.5};
    for (std::size_t i = 0; i < got.size(); ++i) {
      CAPTURE(i);
      CHECK(got[i].dtype() == c.dtype);
      CHECK(got[i].to_vector<double>() == c.expected[i]);
    }
    // The gradient flows through the f32 detour, back in the tensor's dtype.
    sum(y * 1.005).backward();
    CHECK(y.grad().dtype() == c.dtype);
    CHECK(y.grad().to_vector<double>()[0] == (c.dtype == DType::bf16 ? 1.0078125 : 1.0048828125));
  }
  // The reflected forms are PyTorch's: number - t converts the number first (1.005 - y above:
  // bf16(1.005) - 0.69921875 = 0.30859375), number / t is reciprocal(t) * number.
  const Tensor y = values({100, 3, 0.7, 1000}, {4}, DType::bf16);
  CHECK((2.3 / y).to_vector<double>() == std::vector<double>{0.0230712890625, 0.76953125, 3.28125, 0.0023040771484375});
  const Tensor z = arange(1, 2000, 1, Options(DType::f32)) * 0.37;
  CHECK((3.3 / z).to_vector<double>() == (reciprocal(z) * 3.3).to_vector<double>());
}

TEST_CASE("uniform draws stay inside [low, high) in every float dtype, as documented") {
  // rand in bf16 returned exactly 1.0 for 2020 of 1e6 draws (f16: 257): drawn in f32 and rounded to
  // the dtype, values within half an ulp of the top rounded up to it. 16-bit draws now take as many
  // random bits as the significand holds (PyTorch's), and any that rounds out of range is pulled in.
  for (DType d : {DType::bf16, DType::f16, DType::f32, DType::f64}) {
    CAPTURE(dtype_name(d));
    const std::vector<double> u = rand({1 << 20}, 9, 0, Options(d)).to_vector<double>();
    double top = 0;
    for (double x : u) top = std::max(top, x);
    CHECK(top < 1.0);
    CHECK(*std::min_element(u.begin(), u.end()) >= 0.0);
    if (d == DType::bf16) CHECK(std::set<double>(u.begin(), u.end()).size() <= 256);
    for (const auto& [low, high] : std::vector<std::pair<double, double>>{{0.3, 0.7}, {-2.5, 0.1}, {0.7, 0.71}}) {
      CAPTURE(low);
      CAPTURE(high);
      const std::vector<double> v = uniform({1 << 16}, low, high, 4, 0, Options(d)).to_vector<double>();
      for (double x : v) {
        if (!(x >= low && x < high)) {
          FAIL_CHECK("draw " << x << " outside [" << low << ", " << high << ")");
          break;
        }
      }
    }
  }
  // A range of one value draws it.
  CHECK(uniform({3}, 2.0, 2.0, 1).to_vector<double>() == std::vector<double>{2, 2, 2});
}

TEST_CASE("dropout on 16-bit tensors scales as PyTorch's, input * mask then * 1 / (1 - p) in f32") {
  // A mask pre-scaled in bf16 multiplied kept values by bf16(1 / 0.9) = 1.109375 instead of 1.111...:
  // the kept values are now x * (1 / 0.9) computed in f32 and rounded once, what the f32 op rounds.
  for (DType d : {DType::bf16, DType::f16}) {
    CAPTURE(dtype_name(d));
    const Tensor x = randn({4096}, 3, 0, Options(d)).set_requires_grad();
    const Tensor y = dropout(x, 0.1, 11, 0);
    const Tensor reference = cast(dropout(cast(x.detach(), DType::f32), 0.1, 11, 0), d);
    CHECK(y.to_vector<double>() == reference.to_vector<double>());
    sum(y).backward();
    const Tensor g_reference = cast(dropout(ones({4096}), 0.1, 11, 0), d);
    CHECK(x.grad().to_vector<double>() == g_reference.to_vector<double>());
  }
}
