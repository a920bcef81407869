// Caller errors raise typed exceptions whose messages name the op, shapes and dtypes.
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
  check_throws<ShapeError>([] { from_values({1, 2, 3}, {2, 2}); }, {"from_vector", "[2, 2]"});
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
}

TEST_CASE("impossible sizes are ShapeErrors and huge ones OutOfMemoryError, never a crash or a hang") {
  // Bytes past 2^63 cannot be addressed: a ShapeError naming the op.
  test::check_throws<ShapeError>([] { (void)zeros({1LL << 61}, DType::f64); },
                                 {"full", "f64 [2305843009213693952]", "2^63 bytes"});
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
  check_throws<DTypeError>([&] { zeros({2}, bad_dtype); }, {"not a valid dtype: 99"});
  check_throws<DTypeError>([&] { empty({2}, bad_dtype); }, {"not a valid dtype: 99"});
  check_throws<DTypeError>([&] { ones({2, 2}, bad_dtype); }, {"not a valid dtype: 99"});
  check_throws<DTypeError>([&] { full({2}, 1.0, bad_dtype); }, {"not a valid dtype: 99"});
  check_throws<DTypeError>([&] { scalar(1.0, bad_dtype); }, {"not a valid dtype: 99"});
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
