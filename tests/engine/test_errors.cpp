// Caller errors raise typed exceptions whose messages name the op, shapes and dtypes.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <ruda/gradcheck.h>

#include "helpers.h"

using namespace ruda;
using test::check_throws;

TEST_CASE("ShapeError") {
  check_throws<ShapeError>([] { zeros({2, 3}) + zeros({4}); }, {"add", "broadcast", "[2, 3]", "[4]"});
  check_throws<ShapeError>(
      [] {
        matmul(zeros({32, 784}), zeros({512, 10}));
      },
      {"matmul: inner dimensions differ: [32, 784] @ [512, 10]"});
  check_throws<ShapeError>([] { matmul(zeros({3}), zeros({3, 2})); }, {"matmul", "[3]"});
  check_throws<ShapeError>([] { zeros({2, 3}).reshape({4, 2}); }, {"reshape", "[2, 3]", "[4, 2]"});
  check_throws<ShapeError>([] { concat({zeros({2, 3}), zeros({2, 4})}, 0); }, {"concat", "[2, 3]", "[2, 4]"});
  check_throws<ShapeError>([] { linear(zeros({2, 3}), zeros({4, 5})); }, {"linear", "[2, 3]", "[4, 5]"});
  check_throws<ShapeError>([] { zeros({2}).item(); }, {"item", "[2]"});
  check_throws<ShapeError>([] { zeros({1, 2, 1, 1, 1, 1, 1, 1, 1}); }, {"more than 8"});
  check_throws<ShapeError>([] { from_values({1, 2, 3}, {2, 2}); }, {"from_values", "[2, 2]"});
  // An i64 tensor of values no i64 holds is refused, not saturated or zeroed as a cast would.
  const double inf = std::numeric_limits<double>::infinity();
  for (const double bad : {std::nan(""), inf, -inf, 9223372036854775808.0, -1e19}) {
    CAPTURE(bad);
    check_throws<DTypeError>(
        [&] {
          from_values({1, bad}, {2}, Options(DType::i64));
        },
        {"from_values", "value 1", "not an i64 value", "[2]"});
  }
  CHECK(from_values({-9223372036854775808.0, 2.9, -2.9}, {3}, Options(DType::i64)).to_vector<std::int64_t>() ==
        std::vector<std::int64_t>{INT64_MIN, 2, -2});
}

TEST_CASE("DTypeError") {
  check_throws<DTypeError>([] { zeros({2}) + zeros({2}, DType::f64); }, {"add", "f32 [2]", "f64 [2]"});
  check_throws<DTypeError>([] { log(zeros({2}, DType::i64)); }, {"log", "i64"});
  check_throws<DTypeError>([] { embedding(zeros({4, 2}), zeros({3})); }, {"embedding", "i64", "f32 [3]"});
  check_throws<DTypeError>([] { zeros({2}, DType::i64).set_requires_grad(); }, {"set_requires_grad", "i64"});
  check_throws<DTypeError>([] { where(zeros({2}), zeros({2}), zeros({2})); }, {"where", "bool"});
  check_throws<DTypeError>([] { zeros({2}).data<double>(); }, {"data", "f64", "f32"});
  check_throws<DTypeError>([] { rand({2}, 1, 0, DType::i64); }, {"rand", "i64"});
}

TEST_CASE("IndexError") {
  check_throws<IndexError>([] { sum(zeros({2, 3}), {2}); }, {"sum", "axis 2", "2 dimensions"});
  check_throws<IndexError>([] { slice(zeros({4, 3}), 0, 2, 6); }, {"slice", "[2, 6)", "[4, 3]"});
  // Inside the axis but backwards: said so, not "out of bounds".
  check_throws<IndexError>(
      [] {
        slice(zeros({4, 6}), 0, 3, 1);
      },
      {"slice", "[3, 1)", "[4, 6]", "ends before it starts"});
  check_throws<IndexError>(
      [] {
        embedding(zeros({4, 2}), from_vector<std::int64_t>({1, 4}, {2}));
      },
      {"embedding", "index 4", "[0, 4)"});
  check_throws<IndexError>(
      [] {
        take_along_axis(zeros({2, 3}), from_vector<std::int64_t>({0, -1}, {2, 1}), 1);
      },
      {"take_along_axis", "-1"});
  check_throws<IndexError>([] { zeros({2, 2}).at({0, 2}); }, {"at", "2", "[2, 2]"});
  check_throws<IndexError>([] { permute(zeros({2, 2}), {0, 5}); }, {"permute", "axis 5"});
}

TEST_CASE("ArgumentError") {
  check_throws<ArgumentError>([] { dropout(zeros({2}), 1.5, 1); }, {"dropout", "1.5"});
  check_throws<ArgumentError>([] { arange(0, 1, 0); }, {"arange", "step"});
  check_throws<ArgumentError>(
      [] {
        Tensor undefined;
        exp(undefined);
      },
      {"exp", "undefined"});
  check_throws<ArgumentError>([] { concat({}); }, {"concat"});
  check_throws<ArgumentError>([] { set_num_threads(0); }, {"set_num_threads"});
  // A unary backward without the tensor its derivative reads refuses, in every backend (oneDNN's
  // falls back to Eigen's), instead of reading another buffer in its place.
  for (const std::string& name : available_backends()) {
    CAPTURE(name);
    Backend& b = get_backend(name);
    const Tensor gy = ones({5000}, Options(DType::f32, &b)), gx = empty({5000}, Options(DType::f32, &b));
    View none;
    check_throws<ArgumentError>([&] { b.unary_backward(UnaryOp::tanh, none, none, gy.view(), gx.view()); },
                                {"tanh backward", "saved output", "f32"});
    check_throws<ArgumentError>([&] { b.unary_backward(UnaryOp::erf, none, none, gy.view(), gx.view()); },
                                {"erf backward", "saved input", "f32"});
  }
  // Backend::unary_with_derivative refuses Views outside its contract, in every backend and in the
  // base class's default, before touching memory.
  for (const std::string& name : available_backends()) {
    CAPTURE(name);
    Backend& b = get_backend(name);
    const Tensor x = ones({5000}, Options(DType::f32, &b)), y = empty({5000}, Options(DType::f32, &b)),
                 d = empty({5000}, Options(DType::f32, &b)), short_d = empty({4999}, Options(DType::f32, &b)),
                 half_d = empty({5000}, Options(DType::bf16, &b)), pairs = empty({5000, 2}, Options(DType::f32, &b));
    const View none;
    View no_data = d.view();
    no_data.data = nullptr;
    const View strided = pairs.slice(1, 0, 1).squeeze(1).view();  // stride 2
    for (bool base_default : {false, true}) {
      CAPTURE(base_default);
      auto call = [&](const View& xv, const View& yv, const View& dv) {
        if (base_default) {
          b.Backend::unary_with_derivative(UnaryOp::gelu_erf, xv, yv, dv);
        } else {
          b.unary_with_derivative(UnaryOp::gelu_erf, xv, yv, dv);
        }
      };
      check_throws<ShapeError>([&] { call(x.view(), y.view(), none); }, {"gelu with derivative", "5000"});
      check_throws<ArgumentError>([&] { call(x.view(), y.view(), no_data); }, {"gelu with derivative", "need data"});
      check_throws<ShapeError>([&] { call(x.view(), y.view(), short_d.view()); }, {"gelu with derivative", "4999"});
      check_throws<DTypeError>([&] { call(x.view(), y.view(), half_d.view()); }, {"gelu with derivative", "bf16"});
      check_throws<ShapeError>([&] { call(strided, y.view(), d.view()); }, {"gelu with derivative", "contiguous"});
      check_throws<ArgumentError>([&] { call(x.view(), x.view(), d.view()); }, {"gelu with derivative", "overlaps"});
      check_throws<ArgumentError>([&] { call(x.view(), y.view(), y.view()); }, {"gelu with derivative", "overlaps"});
    }
  }
}

TEST_CASE("AutogradError") {
  check_throws<AutogradError>([] { zeros({2}).set_requires_grad().backward(); }, {"backward", "one-element", "[2]"});
  check_throws<AutogradError>([] { zeros({1}).backward(); }, {"backward", "does not require grad"});
  check_throws<AutogradError>(
      [] {
        Tensor w = zeros({2}).set_requires_grad();
        w.add_(ones({2}));
      },
      {"add_", "requires grad", "NoGradGuard"});
  check_throws<AutogradError>(
      [] {
        Tensor w = zeros({2}).set_requires_grad();
        (w * 2.0).set_requires_grad(false);
      },
      {"set_requires_grad", "leaves", "mul"});
  check_throws<AutogradError>(
      [] {
        Tensor w = zeros({2}).set_requires_grad();
        (w * 2.0).backward(zeros({3}));
      },
      {"backward", "[3]", "[2]"});
}

TEST_CASE("BackendError") {
  check_throws<BackendError>([] { get_backend("cuda"); }, {"unknown backend 'cuda'", "eigen"});
  check_throws<BackendError>([] { set_default_backend("tpu"); }, {"tpu"});
  // An empty factory or name is refused when registered, not at the first get_backend.
  check_throws<ArgumentError>([] { register_backend("empty-factory", nullptr); },
                              {"register_backend", "'empty-factory'", "factory", "empty"});
  check_throws<ArgumentError>([] { register_backend("", [] { return std::unique_ptr<Backend>(); }); },
                              {"register_backend", "name is empty"});
  check_throws<BackendError>([] { get_backend("empty-factory"); }, {"unknown backend 'empty-factory'"});
}

TEST_CASE("impossible sizes are ShapeErrors and huge ones OutOfMemoryError, never a crash or a hang") {
  // Bytes past 2^63 cannot be addressed: a ShapeError naming the op.
  test::check_throws<ShapeError>([] { (void)zeros({1LL << 61}, DType::f64); },
                                 {"zeros: ", "f64 [2305843009213693952]", "2^63 bytes"});
  test::check_throws<ShapeError>([] { (void)full({1LL << 62}, 1.0); }, {"full", "f32 [4611686018427387904]"});
  test::check_throws<ShapeError>([] { (void)empty({1LL << 60}, DType::f64); }, {"empty"});
  test::check_throws<ShapeError>([] { (void)empty({1LL << 62}); }, {"empty"});
  test::check_throws<ShapeError>([] { (void)ones({2}).expand({1LL << 61, 2}); }, {"expand"});
  test::check_throws<ShapeError>([] { (void)zeros({1LL << 40, 1LL << 40}); }, {"overflows"});
  // Possible sizes that no machine has: the typed out-of-memory error.
  test::check_throws<OutOfMemoryError>([] { (void)empty({1LL << 58}); }, {"empty", "out of memory"});
  // An expanded view allocates nothing; its contiguous copy is what would need the memory.
  const Tensor huge_view = ones({1}).expand({1LL << 58});
  CHECK(huge_view.strides() == Shape{0});
  CHECK(huge_view.at({(1LL << 58) - 1}) == 1.0);
  test::check_throws<OutOfMemoryError>([&] { (void)huge_view.contiguous(); }, {"clone", "out of memory"});
  test::check_throws<OutOfMemoryError>([] { (void)arange(0, 1e18, 1, DType::i64); }, {"arange", "out of memory"});
  test::check_throws<ShapeError>([] { (void)arange(0, 1e300, 1, DType::f64); }, {"arange", "more than a tensor"});
  // The same through the public creation functions that take explicit element lists.
  test::check_throws<ShapeError>([] { (void)from_vector(std::vector<float>{1, 2}, {1LL << 62, 4}); }, {"overflows"});
}

TEST_CASE("an enum value that is none of its enumerators is a typed error where it enters, never a crash") {
  const auto bad_dtype = static_cast<DType>(99);
  // Every new tensor is checked where it is made: creation, casts, conversions.
  check_throws<DTypeError>([&] { zeros({2}, bad_dtype); }, {"zeros: not a valid dtype: 99"});
  check_throws<DTypeError>([&] { empty({2}, bad_dtype); }, {"not a valid dtype: 99"});
  check_throws<DTypeError>([&] { ones({2, 2}, bad_dtype); }, {"ones: not a valid dtype: 99"});
  check_throws<DTypeError>([&] { full({2}, 1.0, bad_dtype); }, {"full: not a valid dtype: 99"});
  check_throws<DTypeError>([&] { scalar(1.0, bad_dtype); }, {"scalar: not a valid dtype: 99"});
  check_throws<DTypeError>([&] { arange(0, 4, 1, bad_dtype); }, {"not a valid dtype: 99"});
  check_throws<DTypeError>([&] { rand({3}, 1, 0, bad_dtype); }, {"rand", "not a valid dtype: 99"});
  check_throws<DTypeError>([&] { randn({3}, 1, 0, bad_dtype); }, {"randn", "not a valid dtype: 99"});
  check_throws<DTypeError>([&] { from_values({1, 2}, {2}, bad_dtype); }, {"not a valid dtype: 99"});
  const float raw[2] = {1, 2};
  check_throws<DTypeError>([&] { from_buffer(raw, {2}, bad_dtype); }, {"from_buffer", "not a valid dtype: 99"});
  check_throws<DTypeError>([&] { cast(zeros({2}), bad_dtype); }, {"not a valid dtype: 99"});
  check_throws<DTypeError>([&] { zeros({2}).to(bad_dtype); }, {"not a valid dtype: 99"});
  check_throws<DTypeError>([&] { zeros({0}, bad_dtype); }, {"not a valid dtype: 99"});  // even with no element
  check_throws<ArgumentError>([] { gelu(zeros({2}), static_cast<GeluApproximation>(5)); },
                              {"gelu", "not a valid GeluApproximation: 5"});
  check_throws<ArgumentError>(
      [] {
        linear(zeros({2, 3}), zeros({3, 4}), {}, static_cast<WeightLayout>(7));
      },
      {"linear", "not a valid WeightLayout: 7"});
}

TEST_CASE("i64 arithmetic: numbers that would change value are refused, comparisons are exact, nothing traps") {
  const Tensor x = full({3}, 4, DType::i64);
  // A fraction would be truncated on its way into the tensor (x * 0.5 multiplying by 0).
  check_throws<DTypeError>([&] { (void)(x * 0.5); }, {"mul", "0.5", "i64 [3]", "cast"});
  check_throws<DTypeError>([&] { (void)(x + 0.7); }, {"add", "0.7", "i64"});
  check_throws<DTypeError>([&] { (void)(x / 0.5); }, {"div", "0.5", "i64"});
  check_throws<DTypeError>([&] { (void)(2.5 - x); }, {"sub", "2.5", "i64"});
  check_throws<DTypeError>([&] { (void)(x * 1e30); }, {"mul", "i64"});
  check_throws<DTypeError>([&] { (void)(x * std::nan("")); }, {"mul", "nan", "i64"});
  check_throws<DTypeError>([&] { (void)pow(x, 0.5); }, {"pow", "0.5", "i64"});
  check_throws<ArgumentError>([&] { (void)pow(x, -1.0); }, {"pow", "negative power (-1)", "i64 [3]"});
  Tensor y = x.clone();
  check_throws<DTypeError>([&] { y.mul_(0.5); }, {"mul_", "0.5", "i64"});
  check_throws<DTypeError>([&] { y.add_(ones({3}, DType::i64), 0.5); }, {"add_", "0.5", "i64"});
  check_throws<DTypeError>([&] { y.add_(full({3}, 1.7)); }, {"add_", "f32 [3]", "i64 [3]", "cast"});
  CHECK(y.to_vector<std::int64_t>() == std::vector<std::int64_t>{4, 4, 4});  // no refused op wrote
  // Whole numbers still work, and in place too.
  CHECK((x * 2.0 + 1.0).to_vector<std::int64_t>() == std::vector<std::int64_t>{9, 9, 9});
  y.mul_(-3);
  y.add_(ones({3}, DType::i64), 2);
  CHECK(y.to_vector<std::int64_t>() == std::vector<std::int64_t>{-10, -10, -10});
  CHECK(pow(x, 3.0).to_vector<std::int64_t>() == std::vector<std::int64_t>{64, 64, 64});
  // Exact past 2^53, where the former route through double was not: 3^39 = 4052555153018976267.
  CHECK(pow(full({1}, 3, DType::i64), 39.0).to_vector<std::int64_t>()[0] == 4052555153018976267LL);

  // Comparisons with any number are the mathematical ones (0 < 0.5 is true), also beyond i64.
  const Tensor r = arange(-2, 3, 1, DType::i64);  // -2 .. 2
  auto bits = [](const Tensor& t) { return t.to_vector<bool>(); };
  using B = std::vector<bool>;
  CHECK(bits(lt(r, 0.5)) == B{true, true, true, false, false});
  CHECK(bits(le(r, 0.5)) == B{true, true, true, false, false});
  CHECK(bits(gt(r, -0.5)) == B{false, false, true, true, true});
  CHECK(bits(ge(r, -0.5)) == B{false, false, true, true, true});
  CHECK(bits(lt(r, -1.5)) == B{true, false, false, false, false});
  CHECK(bits(eq(r, 0.5)) == B{false, false, false, false, false});
  CHECK(bits(ne(r, 0.5)) == B{true, true, true, true, true});
  CHECK(bits(eq(r, 1.0)) == B{false, false, false, true, false});
  CHECK(bits(lt(r, 1e30)) == B{true, true, true, true, true});
  CHECK(bits(gt(r, -1e30)) == B{true, true, true, true, true});
  CHECK(bits(ge(r, 1e30)) == B{false, false, false, false, false});
  CHECK(bits(le(r, std::nan(""))) == B{false, false, false, false, false});
  CHECK(bits(ne(r, std::nan(""))) == B{true, true, true, true, true});
  const Tensor flags = from_vector<bool>({true, false}, {2});
  CHECK(bits(eq(flags, 2.0)) == B{false, false});
  CHECK(bits(eq(flags, 1.0)) == B{true, false});
  // clamp takes whole bounds inside the range; a bound beyond i64 bounds nothing.
  CHECK(clamp(r, -0.5, 1.5).to_vector<std::int64_t>() == std::vector<std::int64_t>{0, 0, 0, 1, 1});
  CHECK(clamp(r, -1e30, 1e30).to_vector<std::int64_t>() == std::vector<std::int64_t>{-2, -1, 0, 1, 2});
  check_throws<ArgumentError>([&] { (void)clamp(r, 0.2, 0.8); }, {"clamp", "no i64 value", "0.2", "0.8"});
  // Bounds out of order, or NaN, are refused by what is wrong with them.
  check_throws<ArgumentError>([&] { (void)clamp(r, 6, 4); }, {"clamp", "low 6 exceeds high 4"});
  check_throws<ArgumentError>([&] { (void)clamp(r.to(DType::f32), std::nan(""), 1); }, {"clamp", "bound is NaN"});

  // Overflow wraps around (two's complement, as PyTorch's does) instead of trapping: INT64_MIN / -1
  // was a SIGFPE. Division by zero stays an error.
  constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min();
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  const Tensor lowest = from_vector<std::int64_t>({kMin, kMin}, {2});
  CHECK(div(lowest, full({2}, -1, DType::i64)).to_vector<std::int64_t>() == std::vector<std::int64_t>{kMin, kMin});
  CHECK((lowest / -1.0).to_vector<std::int64_t>() == std::vector<std::int64_t>{kMin, kMin});
  CHECK((lowest * -1.0).to_vector<std::int64_t>() == std::vector<std::int64_t>{kMin, kMin});
  CHECK((from_vector<std::int64_t>({kMax}, {1}) + 1.0).to_vector<std::int64_t>()[0] == kMin);
  CHECK(sum(from_vector<std::int64_t>({kMax, 1, 1}, {3})).to_vector<std::int64_t>()[0] == kMin + 1);
  check_throws<ArgumentError>([&] { (void)div(lowest, zeros({2}, DType::i64)); },
                              {"div", "division by zero", "i64 [2] / i64 [2]", "2 zeros"});
  // The message names the caller's shapes, before broadcasting, and numbers.
  check_throws<ArgumentError>(
      [&] {
        (void)div(zeros({2, 3}, DType::i64), from_vector<std::int64_t>({4, 0, 5}, {3}));
      },
      {"div", "division by zero", "i64 [2, 3] / i64 [3]", "1 zero"});
  check_throws<ArgumentError>([&] { (void)(lowest / 0.0); }, {"div", "division by zero", "i64 [2] / i64 []"});
  check_throws<ArgumentError>(
      [&] {
        (void)pow(full({2, 1}, 3, DType::i64), from_vector<std::int64_t>({2, -3}, {2}));
      },
      {"pow", "negative power (-3)", "i64 [2, 1] ** i64 [2]"});
  // Floats too large for i64 saturate and NaN becomes 0, where static_cast was undefined.
  const Tensor wide = from_vector<double>({1e30, -1e30, std::nan(""), -7.9}, {4});
  CHECK(cast(wide, DType::i64).to_vector<std::int64_t>() == std::vector<std::int64_t>{kMax, kMin, 0, -7});
  CHECK(cast(cast(wide, DType::bf16), DType::i64).to_vector<std::int64_t>() ==
        std::vector<std::int64_t>{kMax, kMin, 0, -7});
}

TEST_CASE("errors name the caller's tensor: a scalar's dimensions, take_along_axis's own shape") {
  test::check_throws<IndexError>([] { (void)softmax(scalar(1.0), 1); }, {"softmax", "axis 1", "with 0 dimensions"});
  test::check_throws<IndexError>([] { (void)argmax(scalar(1.0), 1); }, {"argmax", "axis 1", "with 0 dimensions"});
  test::check_throws<IndexError>([] { (void)sum(ones({3}), {2}); }, {"axis 2", "with 1 dimension"});
  // The axis is moved last internally: the message had the transposed shape [3, 0].
  test::check_throws<IndexError>(
      [] {
        (void)take_along_axis(ones({0, 3}), randint({1, 3}, 2, 3, 1), 0);
      },
      {"take_along_axis", "[0, 3]"});
}

TEST_CASE("randint over ranges wider than INT64_MAX") {
  constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min();
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  const std::vector<std::int64_t> v = randint({4000}, kMin, kMax, 7).to_vector<std::int64_t>();
  std::int64_t negative = 0;
  for (std::int64_t x : v) negative += x < 0;
  // Half of them below zero, give or take; the overflowing span gave 4000 copies of INT64_MIN.
  CHECK(negative > 1800);
  CHECK(negative < 2200);
  CHECK(std::set<std::int64_t>(v.begin(), v.end()).size() > 3990);
  // Every value reachable: drawn through a double, the low 11 bits were always 0.
  std::int64_t odd = 0;
  for (std::int64_t x : v) odd += x & 1;
  CHECK(odd > 1800);
  CHECK(odd < 2200);
  std::set<std::int64_t> low_bits;
  for (std::int64_t x : randint({4000}, 0, std::int64_t{1} << 62, 9).to_vector<std::int64_t>())
    low_bits.insert(x & 2047);
  CHECK(low_bits.size() > 1500);
  // The small ranges draw what they drew before.
  const std::vector<std::int64_t> dice = randint({1000}, 1, 7, 3).to_vector<std::int64_t>();
  CHECK(*std::min_element(dice.begin(), dice.end()) == 1);
  CHECK(*std::max_element(dice.begin(), dice.end()) == 6);
}

TEST_CASE("empty products never recurse, whatever the operands' strides") {
  // An empty tensor counts as contiguous whatever its strides, so contiguous() kept [0, 1, 0, 4, 0]
  // here and the many-batch-axes path of matmul called itself until the stack ran out.
  const Tensor a = zeros({0}).reshape({2, 0, 4, 1}).unsqueeze(1).permute({1, 3, 0, 2, 4}).expand({2, 4, 2, 0, 1});
  const Tensor out = matmul(a, ones({1, 1}));
  CHECK(out.shape() == Shape{2, 4, 2, 0, 1});
  const Tensor b = zeros({0}).reshape({2, 0, 4, 1}).unsqueeze(1).permute({1, 3, 0, 2, 4});
  CHECK(matmul(b, ones({2, 1, 2, 1, 1})).shape() == Shape{2, 4, 2, 0, 1});
  // And through autograd: the gradients of an empty product are empty too.
  Tensor w = ones({1, 3});
  w.set_requires_grad();
  sum(matmul(a, w)).backward();
  CHECK(w.grad().to_vector<float>() == std::vector<float>{0, 0, 0});
}

TEST_CASE("random draws refuse parameters that make every value NaN or inf") {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  test::check_throws<ArgumentError>([&] { uniform({3}, -inf, inf, 0); }, {"uniform", "finite"});
  test::check_throws<ArgumentError>([&] { uniform({3}, -1e308, 1e308, 0); }, {"uniform", "finite difference"});
  test::check_throws<ArgumentError>([&] { normal({3}, nan, 1, 0); }, {"normal", "mean must be finite"});
  test::check_throws<ArgumentError>([&] { normal({3}, 0, inf, 0); }, {"normal", "standard deviation"});
  CHECK(uniform({3}, -1, 1, 0).shape() == Shape{3});
}

TEST_CASE("fill_ and full on i64 refuse numbers that are no i64 value, as add_ and mul_ do") {
  Tensor x = zeros({3}, Options(DType::i64));
  test::check_throws<DTypeError>([&] { x.fill_(2.7); }, {"fill_", "2.7", "i64"});
  test::check_throws<DTypeError>([&] { full({3}, std::numeric_limits<double>::quiet_NaN(), Options(DType::i64)); },
                                 {"full", "i64"});
  test::check_throws<DTypeError>([&] { full({2}, 1e30, Options(DType::i64)); }, {"full"});
  // Refused before the 8 PiB it asks for is allocated (an OutOfMemoryError otherwise).
  test::check_throws<DTypeError>(
      [&] {
        full({1LL << 40, 1LL << 10}, 2.5, Options(DType::i64));
      },
      {"full", "2.5", "[1099511627776, 1024]"});
  CHECK(x.fill_(-4).to_vector<std::int64_t>() == std::vector<std::int64_t>{-4, -4, -4});
  CHECK(full({2}, 0.5).to_vector<float>() == std::vector<float>{0.5f, 0.5f});
}

TEST_CASE("full, scalar and fill_ refuse a finite number the float dtype cannot hold; arithmetic overflows as usual") {
  const double inf = std::numeric_limits<double>::infinity();
  test::check_throws<DTypeError>([&] { full({2}, 70000, Options(DType::f16)); }, {"full", "70000", "f16 [2]"});
  test::check_throws<DTypeError>([&] { full({2}, 65519.999999999993, Options(DType::f16)); },
                                 {"full", "65519.99999999999", "f16"});
  test::check_throws<DTypeError>([&] { full({2}, 1e39); }, {"full", "1e+39", "f32 [2]"});
  test::check_throws<DTypeError>([&] { scalar(-1e39, Options(DType::bf16)); }, {"scalar", "bf16 []"});
  Tensor h = ones({2}, Options(DType::f16));
  test::check_throws<DTypeError>([&] { h.fill_(1e6); }, {"fill_", "f16 [2]"});
  CHECK(h.to_vector<double>() == std::vector<double>{1, 1});
  // What the dtype holds, infinity itself and NaN are values; f64 takes any finite number.
  CHECK(full({1}, 65504, Options(DType::f16)).to_vector<double>() == std::vector<double>{65504});
  CHECK(std::isinf(full({1}, -inf, Options(DType::bf16)).to_vector<double>()[0]));
  CHECK(std::isnan(scalar(std::numeric_limits<double>::quiet_NaN()).item()));
  CHECK(full({1}, 1e300, Options(DType::f64)).item() == 1e300);
  // Arithmetic with a number overflows to infinity, as the products of two tensors do.
  CHECK(std::isinf((ones({2}) * 1e39).to_vector<double>()[0]));
  CHECK(std::isinf((ones({2}, Options(DType::f16)) * 70000.0).to_vector<double>()[1]));
  CHECK(std::isinf((ones({2}, Options(DType::f16)) * 1e39).to_vector<double>()[1]));  // through f32
  Tensor m = ones({2});
  CHECK(std::isinf(m.mul_(1e39).to_vector<double>()[0]));
  Tensor acc = ones({2}, Options(DType::f16));
  CHECK(std::isinf(acc.add_(ones({2}, Options(DType::f16)), 1e39).to_vector<double>()[0]));
  CHECK(clamp(test::values({3}, {1}), -1e39, 1e39).item() == 3);
}

TEST_CASE("a bool buffer holds 0 and 1 only; set_grad refuses integer tensors as set_requires_grad does") {
  const unsigned char ok[] = {0, 1, 1};
  CHECK(from_buffer(ok, {3}, DType::boolean).to_vector<bool>() == std::vector<bool>{false, true, true});
  const unsigned char bad[] = {1, 0, 255};
  test::check_throws<DTypeError>([&] { from_buffer(bad, {3}, DType::boolean); },
                                 {"from_buffer", "byte 2", "bool [3]", "255"});
  Tensor i = zeros({2}, Options(DType::i64));
  test::check_throws<DTypeError>([&] { i.set_grad(zeros({2}, Options(DType::i64))); }, {"set_grad", "i64 [2]"});
  Tensor b = zeros({2}, Options(DType::boolean));
  test::check_throws<DTypeError>([&] { b.set_grad(zeros({2}, Options(DType::boolean))); }, {"set_grad", "bool [2]"});
  i.set_grad(Tensor());  // clearing is always allowed
  // A gradient on the tensor's own storage: an in-place update of the values rewrote it.
  Tensor w = ones({2, 2}).set_requires_grad();
  test::check_throws<ArgumentError>([&] { w.set_grad(w); },
                                    {"set_grad", "f32 [2, 2]", "shares the tensor's own storage"});
  test::check_throws<ArgumentError>([&] { w.set_grad(w.detach()); }, {"set_grad", "shares the tensor's own storage"});
  w.set_grad(w.detach().clone());
  CHECK(w.grad().to_vector<float>() == std::vector<float>{1, 1, 1, 1});
  CHECK_FALSE(i.grad().defined());
}

TEST_CASE("the public shape helpers: a null op name, negative extents, an impossible number of dimensions") {
  test::check_throws<ShapeError>([&] { shape_numel({-1}, nullptr); }, {"shape:", "negative"});
  test::check_throws<ShapeError>([&] { broadcast_shapes({2}, {3}, nullptr); }, {"shape:", "[2] and [3]"});
  test::check_throws<IndexError>([&] { normalize_axis(5, 2, nullptr); }, {"shape:", "axis 5"});
  test::check_throws<ShapeError>([&] { broadcast_shapes({-2}, {-2}, "op"); }, {"op", "negative", "[-2]"});
  test::check_throws<ShapeError>([&] { broadcast_shapes({1}, {-5}, "op"); }, {"op", "negative", "[-5]"});
  test::check_throws<ShapeError>([&] { normalize_axis(-1, std::numeric_limits<std::int64_t>::max(), "op"); },
                                 {"op", "dimensions (at most 8)"});
  test::check_throws<ShapeError>([&] { normalize_axis(0, -1, "op"); }, {"op", "-1 dimensions"});
  test::check_throws<ShapeError>([&] { normalize_axis(0, std::numeric_limits<std::int64_t>::min(), "op"); }, {"op"});
  CHECK(normalize_axis(-1, 8, "op") == 7);
  CHECK(broadcast_shapes({1, 3}, {2, 1}, "op") == Shape{2, 3});
}

TEST_CASE("a Generator's bad shape names Generator::rand or randn, and reserves no draws") {
  // They said "shape: negative extent", the helper's name, where the free rand() names itself.
  Generator g(1, 10);
  test::check_throws<ShapeError>([&] { (void)g.rand({-2}); }, {"Generator::rand", "negative", "[-2]"});
  const std::int64_t big = std::int64_t{1} << 40;
  test::check_throws<ShapeError>([&] { (void)g.randn({big, big}); }, {"Generator::randn", "overflows"});
  CHECK(g.offset() == 10);
}

TEST_CASE("errors name the op the caller called: zeros_like, ones_like, stack, unsqueeze; NULs in sizes shown") {
  test::check_throws<ArgumentError>([&] { zeros_like(Tensor()); }, {"zeros_like", "undefined"});
  test::check_throws<ArgumentError>([&] { ones_like(Tensor()); }, {"ones_like", "undefined"});
  test::check_throws<DTypeError>(
      [&] {
        stack({zeros({2}), zeros({2}, Options(DType::i64))});
      },
      {"stack", "f32 [2] and i64 [2]"});
  const Tensor eight = zeros({1, 1, 1, 1, 1, 1, 1, 2});
  test::check_throws<ShapeError>([&] { stack({eight, eight}); }, {"stack", "[1, 1, 1, 1, 1, 1, 1, 2]", "8"});
  test::check_throws<ShapeError>([&] { unsqueeze(eight, 0); }, {"unsqueeze", "[1, 1, 1, 1, 1, 1, 1, 2]"});
  // An axis out of range names the input's rank and the range a new axis may take (it named the
  // result's rank as the input's: "a tensor with 3 dimensions" for a [2, 3]).
  const Tensor m = zeros({2, 3});
  for (const std::int64_t axis : {3, -4}) {
    CAPTURE(axis);
    test::check_throws<IndexError>([&] { unsqueeze(m, axis); },
                                   {"unsqueeze", "axis " + std::to_string(axis), "[-3, 2]", "[2, 3]", "2 dimensions"});
    test::check_throws<IndexError>([&] { stack({m, m}, axis); }, {"stack", "[-3, 2]", "[2, 3]", "2 dimensions"});
  }
  CHECK(unsqueeze(m, 2).shape() == Shape{2, 3, 1});
  CHECK(unsqueeze(m, -3).shape() == Shape{1, 2, 3});
  CHECK(stack({m, m}, -1).shape() == Shape{2, 3, 2});
  test::check_throws<ArgumentError>([&] { memory::parse_size(std::string("5\0MB", 4)); }, {"memory size", "5\\0MB"});
}

TEST_CASE("a refused in-place op changes nothing, its version included") {
  Tensor x = ones({2, 3});
  const std::uint64_t before = x.version();
  CHECK_THROWS_AS(x.copy_(ones({4})), ShapeError);
  CHECK_THROWS_AS(x.add_(ones({5})), ShapeError);
  Tensor i = zeros({2}, Options(DType::i64));
  const std::uint64_t i_before = i.version();
  CHECK_THROWS_AS(i.mul_(0.5), DTypeError);
  CHECK_THROWS_AS(i.fill_(0.5), DTypeError);
  // Arithmetic in place on bool: refused as add_ / mul_ (not as the kernel's "add"), before the write.
  Tensor flags = zeros({3}, Options(DType::boolean));
  const std::uint64_t flags_before = flags.version();
  check_throws<DTypeError>([&] { flags.add_(ones({3}, Options(DType::boolean))); }, {"add_", "bool", "[3]"});
  check_throws<DTypeError>([&] { i.add_(ones({2}, Options(DType::boolean))); }, {"add_", "bool [2]", "i64 [2]"});
  check_throws<DTypeError>([&] { flags.mul_(2); }, {"mul_", "bool [3]"});
  CHECK(flags.version() == flags_before);
  CHECK(x.version() == before);
  CHECK(i.version() == i_before);
  // A backward through a node that saved x still runs after the refused writes.
  Tensor w = ones({3}).set_requires_grad();
  Tensor y = sum(x * w);
  CHECK_THROWS_AS(x.copy_(ones({7})), ShapeError);
  y.backward();
  CHECK(w.grad().to_vector<float>() == std::vector<float>{2, 2, 2});
  x.fill_(3);
  CHECK(x.version() == before + 1);
}

TEST_CASE("16-bit means, shapes whose strides overflow, reshape/concat extents, flatten of a scalar") {
  // An f16 mean of more than 65504 values: summed and divided in f32, rounded once.
  CHECK(mean(full({70000}, 0.5, Options(DType::f16))).item() == 0.5);
  CHECK(mean(full({70000}, 1.0, Options(DType::f16))).item() == 1.0);
  CHECK(mean(full({2, 70000}, 1.5, Options(DType::f16)), {1}).to_vector<double>() == std::vector<double>{1.5, 1.5});
  CHECK(mean(full({70001}, 0.1, Options(DType::bf16))).item() == full({}, 0.1, Options(DType::bf16)).item());
  // Gradients through the f32 detour keep the dtype.
  const Tensor h = full({70000}, 2.0, Options(DType::f16)).set_requires_grad();
  mean(h).backward();
  CHECK(h.grad().dtype() == DType::f16);
  CHECK(h.grad().at({0}) == doctest::Approx(1.0 / 70000).epsilon(5e-3).scale(0));  // f16: 240 * 2^-24
  // No element, but extents whose strides overflow: refused as the same extents without a 0 are.
  check_throws<ShapeError>([] { (void)zeros({0, std::int64_t{1} << 62, 4}); }, {"overflows"});
  check_throws<ShapeError>([] { (void)zeros({0, std::int64_t{1} << 40, std::int64_t{1} << 40}); }, {"overflows"});
  CHECK(zeros({0, std::int64_t{1} << 40}).numel() == 0);
  // reshape's known extents and concat's summed extent, overflow-checked.
  check_throws<ShapeError>(
      [] {
        (void)zeros({4}).reshape({-1, std::numeric_limits<std::int64_t>::max(), 2});
      },
      {"reshape", "overflows"});
  const std::int64_t big = std::numeric_limits<std::int64_t>::max();
  check_throws<ShapeError>([&] { (void)concat({zeros({big, 0}), zeros({big, 0})}); }, {"concat", "int64"});
  // A scalar's only axes are 0 and -1.
  CHECK(flatten(scalar(1.0), 0, -1).shape() == Shape{1});
  check_throws<IndexError>([] { (void)flatten(scalar(1.0), 5, 7); }, {"flatten", "scalar"});
}

TEST_CASE("gradcheck fails a NaN gradient and refuses options or outputs that would make it pass blindly") {
  const Tensor x = from_values({0.5, -1.0, 2.0}, {3}, Options(DType::f64)).set_requires_grad();
  // f(x) = 2x with a hand-written backward g * factor: right for factor 2.
  auto with_backward = [](double factor) {
    return [factor](const std::vector<Tensor>& in) {
      Tensor out = in[0].detach() * 2.0;
      autograd::record("scaled", out, {in[0]}, {},
                       [factor](const Tensor& g, const autograd::Saved&, autograd::GradMask) {
                         return std::vector<Tensor>{g * factor};
                       });
      return out;
    };
  };
  CHECK(gradcheck(with_backward(2.0), {x}).ok);
  CHECK_FALSE(gradcheck(with_backward(100.0), {x}).ok);
  const GradcheckResult nan = gradcheck(with_backward(std::numeric_limits<double>::quiet_NaN()), {x});
  CHECK_FALSE(nan.ok);  // every comparison with NaN is false: it passed
  CHECK(std::isnan(nan.max_abs_error));
  CHECK(nan.message.find("analytic nan") != std::string::npos);
  const double inf = std::numeric_limits<double>::infinity(), not_a_number = std::numeric_limits<double>::quiet_NaN();
  for (const GradcheckOptions& bad : {GradcheckOptions{.eps = 0}, GradcheckOptions{.eps = -1e-6},
                                      GradcheckOptions{.eps = not_a_number}, GradcheckOptions{.eps = inf}}) {
    check_throws<ArgumentError>([&] { gradcheck(with_backward(100.0), {x}, bad); }, {"gradcheck", "eps"});
  }
  for (const GradcheckOptions& bad : {GradcheckOptions{.atol = not_a_number}, GradcheckOptions{.atol = -1},
                                      GradcheckOptions{.rtol = inf}, GradcheckOptions{.rtol = not_a_number}}) {
    check_throws<ArgumentError>([&] { gradcheck(with_backward(100.0), {x}, bad); }, {"gradcheck", "atol and rtol"});
  }
  check_throws<ArgumentError>([&] { gradcheck([](const std::vector<Tensor>&) { return Tensor(); }, {x}); },
                              {"gradcheck", "undefined"});
  check_throws<DTypeError>([&] { gradcheck([](const std::vector<Tensor>& in) { return gt(in[0], 0.0); }, {x}); },
                           {"gradcheck", "bool [3]"});
  check_throws<ArgumentError>([&] { gradcheck(nullptr, {x}); }, {"gradcheck", "empty"});
}

TEST_CASE("gradcheck: non-leaf inputs, a tensor passed twice, the inputs' gradients, constant outputs, f32") {
  Tensor leaf = from_values({0.5, -1.0, 2.0}, {3}, Options(DType::f64)).set_requires_grad();
  const Tensor non_leaf = leaf * 2.0;  // its grad() is never filled: gradcheck read zeros and failed
  auto product = [](const std::vector<Tensor>& in) { return tanh(in[0]) * in[1]; };
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return tanh(in[0]); }, {non_leaf}).ok);
  // Passed twice, both slots move together, as an in-place perturbation would: the analytic side
  // summed both uses while the numeric one had moved one slot. A leaf or a non-leaf.
  CHECK(gradcheck(product, {leaf, leaf}).ok);
  CHECK(gradcheck(product, {non_leaf, non_leaf}).ok);
  // A function closing over a leaf it is also given (a module's parameter) sees that very leaf.
  CHECK(
      gradcheck([&](const std::vector<Tensor>& in) { return tanh(in[0].shares_storage(leaf) ? leaf : in[0]); }, {leaf})
          .ok);
  // One that reads the leaf only through its closure, ignoring its argument (a module's forward
  // reading its own weight): the numeric pass perturbs the leaf itself. Built from a copy passed as
  // the argument, every numeric derivative was 0: a correct function failed, and one whose
  // gradient is lost (detached) passed.
  const Tensor x = from_values({0.3, -0.7, 1.1, 0.2, 0.9, -0.4}, {2, 3}, Options(DType::f64));
  const Tensor w = from_values({0.5, -0.25, 1.5, 0.75, -1.0, 0.125}, {3, 2}, Options(DType::f64)).set_requires_grad();
  const std::vector<double> w_before = w.to_vector<double>();
  CHECK(gradcheck([&](const std::vector<Tensor>&) { return tanh(matmul(x, w)); }, {w}).ok);
  const GradcheckResult lost = gradcheck([&](const std::vector<Tensor>&) { return tanh(matmul(x, w.detach())); }, {w});
  CHECK_FALSE(lost.ok);
  CHECK(lost.message.find("analytic 0") != std::string::npos);
  CHECK(w.to_vector<double>() == w_before);  // every perturbation put back, bit for bit
  CHECK(w.is_leaf());
  // An expanded input (one place in memory for several elements) is perturbed through a copy.
  const Tensor row = from_values({0.5, -1.5}, {1, 2}, Options(DType::f64)).set_requires_grad();
  CHECK(gradcheck([](const std::vector<Tensor>& in) { return tanh(in[0]) * in[0]; }, {row.expand({3, 2})}).ok);
  // The caller's gradients are left as they were (gradcheck wiped them, then left its own there).
  leaf.set_grad(from_values({7, 8, 9}, {3}, Options(DType::f64)));
  CHECK(gradcheck(product, {leaf, non_leaf}).ok);
  CHECK_CLOSE(leaf.grad(), {7, 8, 9}, {3}, 0, 0);
  // An output that does not depend on the inputs: zero gradients, checked (backward raised).
  const GradcheckResult constant = gradcheck([](const std::vector<Tensor>&) { return ones({2}, DType::f64); }, {leaf});
  CHECK(constant.ok);
  CHECK(constant.max_abs_error == 0);
  check_throws<ArgumentError>(
      [&] {
        gradcheck(product, {leaf.detach(), leaf.detach()});
      },
      {"gradcheck", "no input requires grad"});
  // f32: a right gradient fails at the default step (differences of 1e-6 are f32 rounding), and
  // the message says why.
  const Tensor single = leaf.detach().to(DType::f32).set_requires_grad();
  const GradcheckResult f32 = gradcheck([](const std::vector<Tensor>& in) { return tanh(in[0]); }, {single});
  CHECK_FALSE(f32.ok);
  CHECK(f32.message.find("f32 [3]") != std::string::npos);
  CHECK(f32.message.find("need f64") != std::string::npos);
}

TEST_CASE("thread counts past what the machine can start are refused, from a call or from RUDA_NUM_THREADS") {
  CHECK(max_num_threads() >= 256);
  check_throws<ArgumentError>([] { set_num_threads(max_num_threads() + 1); }, {"set_num_threads", "thread count"});
  check_throws<ArgumentError>([] { set_num_threads(std::numeric_limits<int>::max()); },
                              {"set_num_threads", "2147483647"});
  check_throws<ArgumentError>([] { set_num_threads(0); }, {"set_num_threads", "positive"});
  check_throws<ArgumentError>([] { set_default_num_threads(1 << 30); }, {"set_default_num_threads"});
  const char* previous = std::getenv("RUDA_NUM_THREADS");
  const std::string saved = previous ? previous : "";
  for (const char* bad : {"abc", "3x", "1.5", " "}) {
    CAPTURE(bad);
    ::setenv("RUDA_NUM_THREADS", bad, 1);
    check_throws<ArgumentError>([] { num_threads_from_env(); }, {"RUDA_NUM_THREADS", "not a whole number"});
  }
  for (const char* bad : {"99999999999", "99999999999999999999999", "-2", "0"}) {
    CAPTURE(bad);
    ::setenv("RUDA_NUM_THREADS", bad, 1);
    check_throws<ArgumentError>([] { num_threads_from_env(); }, {"RUDA_NUM_THREADS", "thread count", bad});
  }
  ::setenv("RUDA_NUM_THREADS", "3", 1);
  CHECK(num_threads_from_env() == 3);
  ::setenv("RUDA_NUM_THREADS", "", 1);
  CHECK(num_threads_from_env() == 0);
  if (previous) {
    ::setenv("RUDA_NUM_THREADS", saved.c_str(), 1);
  } else {
    ::unsetenv("RUDA_NUM_THREADS");
  }
}

TEST_CASE("the recording API refuses an empty backward, a missing name or output, and an empty end callback") {
  const Tensor x = ones({2}).set_requires_grad();
  const autograd::BackwardFn identity = [](const Tensor& g, const autograd::Saved&, autograd::GradMask) {
    return std::vector<Tensor>{g};
  };
  Tensor out = x.detach() * 2.0;
  check_throws<ArgumentError>([&] { autograd::record("mine", out, {x}, {}, nullptr); },
                              {"record", "mine", "backward function is empty"});
  check_throws<ArgumentError>([&] { autograd::record(nullptr, out, {x}, {}, identity); }, {"record", "no name"});
  Tensor undefined;
  check_throws<ArgumentError>([&] { autograd::record("mine", undefined, {x}, {}, identity); },
                              {"record", "mine", "undefined"});
  Tensor y = x.detach() * 1.0;
  autograd::record("ends", y, {x}, {}, [](const Tensor& g, const autograd::Saved&, autograd::GradMask) {
    autograd::at_backward_end(nullptr);
    return std::vector<Tensor>{g};
  });
  check_throws<ArgumentError>([&] { sum(y).backward(); }, {"at_backward_end", "empty"});
}
