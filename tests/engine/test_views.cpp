// Strided views: what they share, what writes through them reach, what refuses, and the
// conformance suite, which runs every op on a transposed, a sliced and an expanded variant of its
// inputs and compares with the op on contiguous copies holding the same values, forward and
// backward, in f32, f64 and bf16. Runs once per backend.
//
// Same kernel, same values: the results must be bitwise equal. Matrix products may run another
// kernel on a strided operand (a transposed read, oneDNN's gemm instead of brgemm), so they agree
// within 1e-6 relative to max |value| in f32 (1e-12 in f64, 1e-2 in bf16); so do gradients that
// sum over an expanded axis (the sum order is the reduction's own), and f32 and 16-bit sums over a
// transposed input, which run over its memory order instead of copying it first (OpCase::sums;
// f64 copies and stays bitwise; max, min and the arg ops stay exact, but for the sign of a tie of
// zeros, which the cases' values do not hold).
#include <cmath>
#include <functional>
#include <string>

#include "helpers.h"

using namespace ruda;

namespace {

// --- variants ---

enum class Variant { transposed, sliced, expanded };
const char* name_of(Variant v) {
  switch (v) {
    case Variant::transposed:
      return "transposed";
    case Variant::sliced:
      return "sliced";
    case Variant::expanded:
      return "expanded";
  }
  return "?";
}

// A leaf holding `values` of `shape` in a fresh contiguous tensor (the reference input).
Tensor leaf(const std::vector<double>& values, const Shape& shape, DType dtype, bool grad) {
  Tensor t = from_values(values, shape, Options(dtype));
  if (grad && is_floating(dtype)) t.set_requires_grad(true);
  return t;
}

// Deterministic values in [lo, hi) for element i: distinct enough that a wrong element shows.
std::vector<double> pattern(std::int64_t n, double lo, double hi, std::uint64_t salt) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const double u = std::fmod(0.6180339887 * static_cast<double>(i + 1) * static_cast<double>(salt + 3), 1.0);
    v[static_cast<std::size_t>(i)] = lo + (hi - lo) * u;
  }
  return v;
}

// One input of an op: its shape, value range, and whether it is differentiable and may vary.
struct Input {
  Shape shape;
  double lo = -2, hi = 2;
  bool integer = false;  // i64 indices in [lo, hi): passed through unchanged except for layout
};

// An input built two ways: `base` is the leaf that owns the storage, `value` what the op reads
// (a view of base for the strided variant, base itself for the reference).
struct Built {
  Tensor base, value;
  bool plain = false;  // the variant does not apply to this shape: a contiguous copy
};

// The reference input for a variant: for `expanded`, the values repeat along the expanded axis.
Built reference(const Input& in, DType dtype, Variant variant, std::uint64_t salt, bool grad) {
  const DType d = in.integer ? DType::i64 : dtype;
  const std::int64_t n = shape_numel(in.shape);
  std::vector<double> v = pattern(n, in.lo, in.hi, salt);
  if (in.integer) {
    for (double& x : v) x = std::floor(x);
  }
  if (variant == Variant::expanded && !in.shape.empty() && in.shape[0] > 1) {
    // Repeat the first row: the value the expanded view shows.
    const std::int64_t inner = n / in.shape[0];
    for (std::int64_t i = inner; i < n; ++i) v[static_cast<std::size_t>(i)] = v[static_cast<std::size_t>(i % inner)];
  }
  Tensor t = leaf(v, in.shape, d, grad && !in.integer);
  return {t, t};
}

// The same values through a strided view of another storage.
Built strided(const Input& in, const Tensor& ref, Variant variant, bool grad) {
  const DType d = ref.dtype();
  const bool differentiable = grad && !in.integer;
  const Tensor values = ref.detach();
  const std::int64_t nd = static_cast<std::int64_t>(in.shape.size());
  switch (variant) {
    case Variant::transposed: {
      if (nd < 2) break;  // a vector has no second axis to swap with: sliced covers it
      Tensor base = values.transpose(nd - 2, nd - 1).contiguous();
      base = leaf(base.to_vector<double>(), base.shape(), d, differentiable);
      return {base, base.transpose(nd - 2, nd - 1)};
    }
    case Variant::sliced: {
      // Every other element of a tensor one axis longer: strided on every axis, offset 1.
      Shape wide = in.shape;
      wide.push_back(2);
      Tensor storage = zeros(wide, Options(d));
      storage.slice(-1, 1, 2).squeeze(-1).copy_(values);
      Tensor base = leaf(storage.to_vector<double>(), wide, d, differentiable);
      return {base, base.slice(-1, 1, 2).squeeze(-1)};
    }
    case Variant::expanded: {
      if (nd < 1 || in.shape[0] <= 1) break;
      Shape one = in.shape;
      one[0] = 1;
      Tensor base = leaf(values.slice(0, 0, 1).to_vector<double>(), one, d, differentiable);
      return {base, base.expand(in.shape)};
    }
  }
  Tensor base = leaf(values.to_vector<double>(), in.shape, d, differentiable);
  return {base, base, true};
}

// The gradient the reference input received, read back through the variant's view of the base's gradient.
Tensor grad_through(const Built& b, Variant variant, const Shape& shape) {
  const Tensor g = b.base.grad();
  if (!g.defined()) return g;
  const std::int64_t nd = static_cast<std::int64_t>(shape.size());
  if (b.plain) return g;
  switch (variant) {
    case Variant::transposed:
      return g.transpose(nd - 2, nd - 1);
    case Variant::sliced:
      return g.slice(-1, 1, 2).squeeze(-1);
    case Variant::expanded:
      return g;  // [1, ...]: compared with the reference gradient summed over axis 0
  }
  return g;
}

struct OpCase {
  std::string name;
  std::vector<Input> inputs;
  std::function<Tensor(const std::vector<Tensor>&)> f;
  bool product = false;        // a matrix product: another kernel may run on strided operands
  bool differentiable = true;  // run backward too
  bool no_bf16 = false;
  // The op documents its output as a view of this permutation of a contiguous tensor (attention:
  // [B, H, T, D] stored as [B, T, H, D]); empty: the output is contiguous.
  Axes output_storage_order = {};
  // A sum over axes (sum, mean, logsumexp, sum_to): on a transposed input it runs over the input's
  // memory order, with no copy, so its additions come in another order than on a contiguous copy.
  bool sums = false;
};

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) {
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  }
  return m;
}

void compare(const std::string& what, const Tensor& got, const Tensor& want, double rel) {
  REQUIRE_MESSAGE(got.defined() == want.defined(), what);
  if (!want.defined()) return;
  REQUIRE_MESSAGE(got.shape() == want.shape(),
                  what << ": shape " << to_string(got.shape()) << " vs " << to_string(want.shape()));
  REQUIRE_MESSAGE(got.dtype() == want.dtype(), what);
  const std::vector<double> a = got.to_vector<double>(), b = want.to_vector<double>();
  const double scale = std::max(max_abs(b), 1e-30);
  for (std::size_t i = 0; i < a.size(); ++i) {
    const bool same = a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i]));
    if (rel == 0 ? !same : !(same || std::abs(a[i] - b[i]) <= rel * scale)) {
      FAIL_CHECK(what << ": element " << i << " is " << a[i] << ", the contiguous op gives " << b[i]
                      << (rel == 0 ? " (bitwise expected)" : ""));
      return;
    }
  }
}

double product_tolerance(DType dtype) {
  switch (dtype) {
    case DType::f64:
      return 1e-12;
    case DType::bf16:
    case DType::f16:
      return 1e-2;
    default:
      return 1e-6;
  }
}

void run_case(const OpCase& c, DType dtype, Variant variant) {
  const std::string what = c.name + " " + std::string(dtype_name(dtype)) + " " + name_of(variant);
  std::vector<Built> ref, str;
  for (std::size_t i = 0; i < c.inputs.size(); ++i) {
    ref.push_back(reference(c.inputs[i], dtype, variant, i, c.differentiable));
    str.push_back(strided(c.inputs[i], ref.back().value, variant, c.differentiable));
  }
  std::vector<Tensor> ref_in, str_in;
  for (const Built& b : ref) ref_in.push_back(b.value);
  for (const Built& b : str) str_in.push_back(b.value);
  const Tensor want = c.f(ref_in);
  const Tensor got = c.f(str_in);
  bool identity = false;  // an op that returns its input as it is (a cast to the same dtype)
  for (const Built& b : str) identity = identity || got.shares_storage(b.base);
  const Tensor stored = c.output_storage_order.empty() ? got : got.permute(c.output_storage_order);
  CHECK_MESSAGE((identity || stored.is_contiguous()),
                what << ": an op's output is contiguous (in its documented layout)");
  const bool reordered = c.sums && variant == Variant::transposed && dtype != DType::f64;  // f64 copies first
  compare(what, got, want, c.product || reordered ? product_tolerance(dtype) : 0.0);
  if (!c.differentiable || !is_floating(want.dtype()) || !want.requires_grad()) return;

  // The same output gradient through both; compare each input's gradient.
  const Tensor g = from_values(pattern(want.numel(), -1, 1, 99), want.shape(), Options(want.dtype()));
  want.backward(g);
  got.backward(g);
  for (std::size_t i = 0; i < c.inputs.size(); ++i) {
    if (c.inputs[i].integer) continue;
    Tensor expected = ref[i].base.grad();
    Tensor actual = grad_through(str[i], variant, c.inputs[i].shape);
    if (!expected.defined()) {  // an input the output does not depend on differentiably
      CHECK_MESSAGE(!actual.defined(), what << ": input " << i << " got a gradient only through the view");
      continue;
    }
    const bool summed = variant == Variant::expanded && !str[i].plain;
    if (summed) expected = sum(expected, {0}, true);
    compare(what + " gradient of input " + std::to_string(i), actual, expected,
            c.product || summed || reordered ? product_tolerance(dtype) * (dtype == DType::f32 ? 10 : 1) : 0.0);
  }
}

// The sizes the cases run at: rows and columns of the matrix inputs, the products' third extent,
// the permuted input's shape and the attention inputs' [B, H, T, D].
struct Dims {
  std::int64_t rows, cols, inner;
  Shape permuted, attention;
};
// Small, and large enough that every elementwise op runs the oneDNN backend's own primitives
// (below kMinElements, 4096, it hands them to the Eigen kernels: at the small size the suite never
// reached them, and a oneDNN comparison of two alike-transposed operands wrote wrong values).
const Dims kSmall{4, 6, 5, {2, 3, 4}, {2, 2, 5, 4}};
const Dims kLarge{64, 96, 80, {8, 16, 48}, {1, 2, 150, 16}};

std::vector<OpCase> cases(const Dims& dims) {
  using V = const std::vector<Tensor>&;
  const std::int64_t r = dims.rows, c = dims.cols, k = dims.inner;
  const Shape m{r, c};
  const Input any{m}, positive{m, 0.5, 3.0};
  std::vector<OpCase> out;
  auto unary = [&](std::string name, Tensor (*fn)(const Tensor&), Input in) {
    out.push_back({std::move(name), {in}, [fn](V x) { return fn(x[0]); }});
  };
  unary("neg", neg, any);
  unary("abs", abs, any);
  unary("exp", exp, any);
  unary("log", log, positive);
  unary("sqrt", sqrt, positive);
  unary("rsqrt", rsqrt, positive);
  unary("square", square, any);
  unary("reciprocal", reciprocal, positive);
  unary("tanh", tanh, any);
  unary("sigmoid", sigmoid, any);
  unary("relu", relu, any);
  unary("silu", silu, any);
  unary("softplus", softplus, any);
  unary("erf", erf, any);
  out.push_back({"gelu erf", {any}, [](V x) { return gelu(x[0]); }});
  out.push_back({"gelu tanh", {any}, [](V x) { return gelu(x[0], GeluApproximation::tanh); }});
  out.push_back({"clamp", {any}, [](V x) { return clamp(x[0], -1, 1); }});
  out.push_back({"add", {any, any}, [](V x) { return x[0] + x[1]; }});
  out.push_back({"sub", {any, any}, [](V x) { return x[0] - x[1]; }});
  out.push_back({"mul", {any, any}, [](V x) { return x[0] * x[1]; }});
  out.push_back({"div", {any, positive}, [](V x) { return x[0] / x[1]; }});
  out.push_back({"pow", {positive, any}, [](V x) { return pow(x[0], x[1]); }});
  out.push_back({"maximum", {any, any}, [](V x) { return maximum(x[0], x[1]); }});
  out.push_back({"minimum", {any, any}, [](V x) { return minimum(x[0], x[1]); }});
  out.push_back({"add broadcast row", {any, Input{{c}}}, [](V x) { return x[0] + x[1]; }});
  out.push_back({"mul broadcast column", {any, Input{{r, 1}}}, [](V x) { return x[0] * x[1]; }});
  out.push_back({"scalar ops", {any}, [](V x) { return (x[0] * 3.0 - 1.0) / 2.0; }});
  out.push_back({"lt", {any, any}, [](V x) { return lt(x[0], x[1]); }, false, false});
  out.push_back({"ge", {any, any}, [](V x) { return ge(x[0], x[1]); }, false, false});
  out.push_back({"eq scalar", {Input{m, 0, 3, true}}, [](V x) { return eq(x[0], 1.0); }, false, false});
  out.push_back({"where", {any, any, any}, [](V x) { return where(gt(x[0], 0.0), x[1], x[2]); }});
  out.push_back({"cast f64", {any}, [](V x) { return cast(x[0], DType::f64); }});
  out.push_back({"cast bf16", {any}, [](V x) { return cast(x[0], DType::bf16); }});
  out.push_back({"cast i64", {Input{m, 0, 9, true}}, [](V x) { return cast(x[0], DType::f32); }, false, false});
  out.push_back({"dropout", {any}, [](V x) { return dropout(x[0], 0.3, 7, 11); }});
  out.push_back({"sum all", {any}, [](V x) { return sum(x[0]); }});
  out.back().sums = true;
  out.push_back({"sum rows", {any}, [](V x) { return sum(x[0], {1}); }});
  out.back().sums = true;
  out.push_back({"sum columns", {any}, [](V x) { return sum(x[0], {0}, true); }});
  out.back().sums = true;
  out.push_back({"mean", {any}, [](V x) { return mean(x[0], {1}); }});
  out.back().sums = true;
  out.push_back({"max", {any}, [](V x) { return max(x[0], {1}); }});
  out.push_back({"min", {any}, [](V x) { return min(x[0], {0}); }});
  out.push_back({"logsumexp", {any}, [](V x) { return logsumexp(x[0], {1}); }});
  out.back().sums = true;
  out.push_back({"argmax", {any}, [](V x) { return argmax(x[0], 1); }, false, false});
  out.push_back({"argmin", {any}, [](V x) { return argmin(x[0], 0); }, false, false});
  out.push_back({"softmax", {any}, [](V x) { return softmax(x[0], -1); }});
  out.push_back({"softmax axis 0", {any}, [](V x) { return softmax(x[0], 0); }});
  out.push_back({"log_softmax", {any}, [](V x) { return log_softmax(x[0], -1); }});
  out.push_back({"layer_norm", {any, Input{{c}}, Input{{c}}}, [](V x) { return layer_norm(x[0], x[1], x[2]); }});
  out.push_back({"matmul", {Input{{r, c}}, Input{{c, k}}}, [](V x) { return matmul(x[0], x[1]); }, true});
  out.push_back({"matmul batched", {Input{{3, r, c}}, Input{{3, c, k}}}, [](V x) { return matmul(x[0], x[1]); }, true});
  out.push_back({"matmul broadcast", {Input{{3, r, c}}, Input{{c, k}}}, [](V x) { return matmul(x[0], x[1]); }, true});
  out.push_back({"matmul two batch axes",
                 {Input{{2, 3, r, c}}, Input{{2, 3, c, k}}},
                 [](V x) { return matmul(x[0], x[1]); },
                 true});
  out.push_back(
      {"linear", {Input{{3, r, c}}, Input{{c, k}}, Input{{k}}}, [](V x) { return linear(x[0], x[1], x[2]); }, true});
  out.push_back({"linear out_in",
                 {Input{{r, c}}, Input{{k, c}}, Input{{k}}},
                 [](V x) { return linear(x[0], x[1], x[2], WeightLayout::out_in); },
                 true});
  out.push_back({"linear_gelu",
                 {Input{{r, c}}, Input{{c, k}}, Input{{k}}},
                 [](V x) { return linear_gelu(x[0], x[1], x[2]); },
                 true});
  out.push_back({"linear_gelu recompute",
                 {Input{{r, c}}, Input{{c, k}}, Input{{k}}},
                 [](V x) {
                   return linear_gelu(x[0], x[1], x[2], GeluApproximation::erf, WeightLayout::in_out,
                                      GeluBackward::recompute);
                 },
                 true});
  out.push_back({"reshape", {any}, [r, c](V x) { return x[0].reshape({2, r * c / 2}) * 1.0; }});
  out.push_back({"flatten", {any}, [](V x) { return x[0].flatten() * 1.0; }});
  out.push_back({"permute", {Input{dims.permuted}}, [](V x) { return x[0].permute({2, 0, 1}) * 1.0; }});
  out.push_back({"slice", {any}, [c](V x) { return x[0].slice(1, 1, c - 2) * 1.0; }});
  out.push_back({"unsqueeze", {any}, [](V x) { return x[0].unsqueeze(1) * 1.0; }});
  out.push_back({"clone", {any}, [](V x) { return x[0].clone(); }});
  out.push_back({"contiguous", {any}, [](V x) { return x[0].contiguous() * 1.0; }});
  out.push_back({"concat", {any, any}, [](V x) { return concat({x[0], x[1]}, 1); }});
  out.push_back({"stack", {any, any}, [](V x) { return stack({x[0], x[1]}, 0); }});
  out.push_back({"slice_assign", {any, Input{{r, 2}}}, [](V x) { return slice_assign(x[0], 1, 2, 4, x[1]); }});
  out.push_back({"sum_to", {any}, [c](V x) { return sum_to(x[0], {1, c}); }, true});
  out.back().sums = true;
  out.push_back({"embedding", {Input{{7, c}}, Input{{r, 3}, 0, 7, true}}, [](V x) { return embedding(x[0], x[1]); }});
  out.push_back({"take_along_axis", {any, Input{{r, 3}, 0, static_cast<double>(c), true}}, [](V x) {
                   return take_along_axis(x[0], x[1], 1);
                 }});
  out.push_back({"take_along_axis 0", {any, Input{{2, c}, 0, static_cast<double>(r), true}}, [](V x) {
                   return take_along_axis(x[0], x[1], 0);
                 }});
  out.push_back({"attention",
                 {Input{dims.attention}, Input{dims.attention}, Input{dims.attention}},
                 [](V x) {
                   AttentionOptions o;
                   o.causal = true;
                   return scaled_dot_product_attention(x[0], x[1], x[2], o);
                 },
                 true,
                 true,
                 false,
                 {0, 2, 1, 3}});
  return out;
}

// Storages allocated on this thread while f runs.
std::int64_t allocations(const std::function<void()>& f) {
  f();  // once first, so primitive caches and scratchpads exist
  const std::int64_t before = memory::stats().allocations;
  f();
  return memory::stats().allocations - before;
}

}  // namespace

TEST_CASE("conformance: every op on transposed, sliced and expanded inputs matches the op on contiguous copies") {
  MESSAGE("backend " << default_backend().name());
  int ran = 0;
  for (const Dims& dims : {kSmall, kLarge}) {
    CAPTURE(dims.rows);
    for (const OpCase& c : cases(dims)) {
      for (DType dtype : {DType::f32, DType::f64, DType::bf16}) {
        if (dtype == DType::bf16 && c.no_bf16) continue;
        for (Variant v : {Variant::transposed, Variant::sliced, Variant::expanded}) {
          CAPTURE(c.name);
          run_case(c, dtype, v);
          ++ran;
        }
      }
    }
  }
  CHECK(ran > 400);
}

TEST_CASE("view ops share storage, and writes through a view reach the base") {
  Tensor x = arange(0, 12).reshape({3, 4});
  Tensor t = x.transpose(0, 1);
  CHECK(t.shares_storage(x));
  CHECK_FALSE(t.is_contiguous());
  CHECK(t.strides() == Shape{1, 4});
  CHECK(t.at({3, 2}) == 11);
  const Tensor column = x.slice(1, 2, 3);
  CHECK(column.shares_storage(x));
  CHECK(column.storage_offset() == 2);
  CHECK(column.strides() == Shape{4, 1});
  const Tensor e = x.slice(0, 0, 1).expand({5, 4});
  CHECK(e.shares_storage(x));
  CHECK(e.strides() == Shape{0, 1});
  CHECK(x.unsqueeze(0).squeeze(0).shares_storage(x));
  CHECK(t.unsqueeze(1).shares_storage(x));
  CHECK(t.unsqueeze(1).shape() == Shape{4, 1, 3});
  CHECK(t.unsqueeze(1).strides()[0] == 1);
  CHECK(t.unsqueeze(1).strides()[2] == 4);

  column.squeeze(1).fill_(-1);
  CHECK_CLOSE(x, {0, 1, -1, 3, 4, 5, -1, 7, 8, 9, -1, 11}, {3, 4});
  t.slice(0, 0, 1).add_(ones({1, 3}));
  CHECK_CLOSE(x.slice(1, 0, 1).squeeze(1), {1, 5, 9}, {3});
  x.transpose(0, 1).slice(0, 3, 4).copy_(from_values({30, 70, 110}, {1, 3}));
  CHECK_CLOSE(x.slice(1, 3, 4).squeeze(1), {30, 70, 110}, {3});
  x.slice(1, 1, 2).mul_(10.0);
  CHECK_CLOSE(x.slice(1, 1, 2).squeeze(1), {10, 50, 90}, {3});
  const std::uint64_t before = x.version();
  t.fill_(0);
  CHECK(x.version() > before);  // one counter per storage, whichever view wrote
  CHECK(sum(x).item() == 0);
}

TEST_CASE("a view op that changes nothing still makes a new view, as PyTorch's: not a leaf, its own handle") {
  // x itself came back: set_requires_grad(false) or zero_grad() on the "view" acted on x.
  Tensor x = ones({2, 3}).set_requires_grad();
  const std::vector<std::pair<const char*, std::function<Tensor(const Tensor&)>>> ops = {
      {"reshape",
       [](const Tensor& t) {
         return t.reshape({2, 3});
       }},
      {"view",
       [](const Tensor& t) {
         return t.view({2, 3});
       }},
      {"permute",
       [](const Tensor& t) {
         return t.permute({0, 1});
       }},
      {"transpose", [](const Tensor& t) { return t.transpose(1, 1); }},
      {"slice", [](const Tensor& t) { return t.slice(1, 0, 3); }},
      {"expand",
       [](const Tensor& t) {
         return t.expand({2, 3});
       }},
  };
  for (const auto& [name, op] : ops) {
    CAPTURE(name);
    x.zero_grad();
    Tensor v = op(x);
    CHECK_FALSE(v.is_same(x));
    CHECK_FALSE(v.is_leaf());
    CHECK(v.data_ptr() == x.data_ptr());  // a view of the same storage
    sum(v * 2.0).backward();
    CHECK(x.grad().to_vector<double>() == std::vector<double>(6, 2.0));
    CHECK_FALSE(v.grad().defined());  // a non-leaf's, as PyTorch's None
    // Without grad: still a view of its own.
    Tensor plain = ones({2, 3});
    Tensor w = op(plain);
    CHECK_FALSE(w.is_same(plain));
    w.set_requires_grad(true);
    CHECK_FALSE(plain.requires_grad());
  }
  const Tensor s = scalar(2.0).set_requires_grad();
  CHECK_FALSE(s.squeeze(0).is_same(s));
  CHECK_FALSE(s.transpose(0, -1).is_same(s));
}

TEST_CASE("a saved tensor overwritten through a view is caught by backward") {
  Tensor x = arange(0, 6).reshape({2, 3});  // no grad: saved by mul for w's gradient
  Tensor w = ones({2, 3}).set_requires_grad(true);
  const Tensor y = sum(x * w);
  x.transpose(0, 1).slice(0, 1, 2).fill_(5);
  test::check_throws<AutogradError>([&] { y.backward(); }, {"mul"});
}

TEST_CASE("view() never copies: it refuses what only a copy can give; reshape copies there") {
  const Tensor x = arange(0, 12).reshape({3, 4});
  CHECK(x.view({4, 3}).shares_storage(x));
  CHECK(x.view({2, -1}).shape() == Shape{2, 6});
  const Tensor t = x.transpose(0, 1);
  CHECK(t.view({2, 2, 3}).shares_storage(x));  // splitting an axis keeps a view
  CHECK(t.view({2, 2, 3}).strides() == Shape{2, 1, 4});
  test::check_throws<ShapeError>([&] { (void)t.view({12}); }, {"view", "[4, 3]", "strides [1, 4]", "reshape"});
  test::check_throws<ShapeError>([&] { (void)x.slice(1, 0, 2).view({6}); }, {"view", "without copying"});
  const Tensor flat = t.reshape({12});
  CHECK_FALSE(flat.shares_storage(x));
  CHECK(flat.is_contiguous());
  CHECK_CLOSE(flat, {0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}, {12});
  const Tensor e = x.slice(0, 0, 1).expand({2, 4});
  CHECK_FALSE(e.reshape({8}).shares_storage(x));
  CHECK_CLOSE(e.reshape({8}), {0, 1, 2, 3, 0, 1, 2, 3}, {8});
  CHECK(e.reshape({2, 1, 4}).shares_storage(x));  // a new axis of extent 1 is still a view
}

TEST_CASE("copies whose source partially overlaps the destination read the source first") {
  Tensor x = arange(0, 9).reshape({3, 3});
  x.copy_(x.transpose(0, 1));
  CHECK_CLOSE(x, {0, 3, 6, 1, 4, 7, 2, 5, 8}, {3, 3});
  Tensor v = arange(0, 6);
  v.slice(0, 1, 6).copy_(v.slice(0, 0, 5));  // a shift by one, forwards
  CHECK_CLOSE(v, {0, 0, 1, 2, 3, 4}, {6});
  Tensor w = arange(0, 6);
  w.slice(0, 0, 5).copy_(w.slice(0, 1, 6));  // and backwards
  CHECK_CLOSE(w, {1, 2, 3, 4, 5, 5}, {6});
  Tensor a = arange(0, 4).reshape({2, 2});
  a.add_(a.transpose(0, 1));
  CHECK_CLOSE(a, {0, 3, 3, 6}, {2, 2});
  Tensor b = arange(0, 4);
  b.slice(0, 1, 4).add_(b.slice(0, 0, 3));
  CHECK_CLOSE(b, {0, 1, 3, 5}, {4});
  Tensor c = arange(0, 4);
  c.add_(c);  // exact aliasing stays in place
  CHECK_CLOSE(c, {0, 2, 4, 6}, {4});
  x.copy_(x);  // the same elements: nothing to do
  CHECK_CLOSE(x, {0, 3, 6, 1, 4, 7, 2, 5, 8}, {3, 3});
}

TEST_CASE("in-place writes to an expanded view are refused: its elements share memory") {
  Tensor x = ones({1, 3});
  Tensor e = x.expand({4, 3});
  for (auto write : std::vector<std::function<void()>>{[&] { e.fill_(2); }, [&] { e.mul_(2.0); },
                                                       [&] {
                                                         e.add_(ones({4, 3}));
                                                       },
                                                       [&] {
                                                         e.copy_(zeros({4, 3}));
                                                       }}) {
    test::check_throws<ShapeError>(write, {"in place", "[4, 3]", "share memory", "contiguous()"});
  }
  CHECK_CLOSE(x, {1, 1, 1}, {1, 3});
}

TEST_CASE("in-place writes to an empty view with stride-0 axes write nothing and are allowed") {
  // Reshaping an empty tensor may leave stride 0 on its other axes (a [1, 4, 3, 0, 8] tensor's
  // part [1, 4, 0, 8], permuted to [1, 0, 4, 8] as attention reads its heads): no element is
  // shared, so fill_, add_ and copy_ succeed.
  const Tensor base = zeros({1, 4, 3, 0, 8});
  const Tensor part = base.slice(2, 1, 2).squeeze(2).permute({0, 2, 1, 3});
  REQUIRE(part.numel() == 0);
  REQUIRE_FALSE(part.is_contiguous());
  Tensor(part).fill_(1);
  Tensor(part).add_(zeros({1, 0, 4, 8}));
  Tensor(part).copy_(zeros({1, 0, 4, 8}));
  CHECK(part.shape() == Shape{1, 0, 4, 8});
}

TEST_CASE("accessors on permuted, sliced and expanded tensors give the logical values or a typed error") {
  const Tensor x = arange(0, 24).reshape({2, 3, 4});
  const std::vector<std::pair<std::string, Tensor>> views{{"permuted", x.permute({2, 0, 1})},
                                                          {"sliced", x.slice(2, 1, 3)},
                                                          {"expanded", x.slice(0, 0, 1).expand({3, 3, 4})}};
  for (const auto& [name, v] : views) {
    CAPTURE(name);
    const Tensor copy = v.contiguous();
    CHECK(copy.is_contiguous());
    CHECK_FALSE(copy.shares_storage(x));
    CHECK(v.to_vector<double>() == copy.to_vector<double>());
    CHECK(v.to_vector<float>() == copy.to_vector<float>());
    CHECK(v.clone().to_vector<double>() == copy.to_vector<double>());
    CHECK(v.at({1, 1, 1}) == copy.at({1, 1, 1}));
    CHECK(v.at({-1, 0, 0}) == copy.at({-1, 0, 0}));
    CHECK(v.to(DType::f64).to_vector<double>() == copy.to_vector<double>());
    CHECK(to_string(v) == to_string(copy));
    test::check_throws<ShapeError>([&] { (void)v.data_ptr(); }, {"data_ptr", "non-contiguous", "contiguous()"});
    test::check_throws<ShapeError>([&] { (void)v.data<float>(); }, {"data", "contiguous()"});
    CHECK(copy.data<float>()[5] == static_cast<float>(copy.to_vector<double>()[5]));
    // view() is the strided window a kernel would get.
    const View k = v.view();
    CHECK(k.ndim == 3);
    CHECK(k.strides[0] == v.strides()[0]);
    CHECK_FALSE(k.is_contiguous());
  }
  CHECK(x.slice(0, 1, 2).slice(1, 2, 3).slice(2, 3, 4).item() == 23);
}

TEST_CASE("finite-difference gradients through every view op") {
  const Tensor a = randn({2, 3, 4}, 5, 0, Options(DType::f64)).set_requires_grad(true);
  const std::vector<std::pair<std::string, std::function<Tensor(const std::vector<Tensor>&)>>> fns{
      {"permute",
       [](const std::vector<Tensor>& x) {
         return square(x[0].permute({1, 2, 0}));
       }},
      {"transpose", [](const std::vector<Tensor>& x) { return matmul(x[0].transpose(1, 2), x[0]); }},
      {"slice", [](const std::vector<Tensor>& x) { return exp(x[0].slice(1, 1, 3)); }},
      {"expand",
       [](const std::vector<Tensor>& x) {
         return x[0].slice(0, 0, 1).expand({3, 3, 4}) * x[0].sum({0});
       }},
      {"squeeze", [](const std::vector<Tensor>& x) { return tanh(x[0].slice(1, 1, 2).squeeze(1)); }},
      {"unsqueeze", [](const std::vector<Tensor>& x) { return softmax(x[0].transpose(0, 2).unsqueeze(1), -1); }},
      {"reshape view",
       [](const std::vector<Tensor>& x) {
         return sigmoid(x[0].transpose(1, 2).reshape({2, 2, 2, 3}));
       }},
      {"reshape copy", [](const std::vector<Tensor>& x) { return square(x[0].transpose(1, 2).reshape({24})); }},
      {"view",
       [](const std::vector<Tensor>& x) {
         return x[0].slice(2, 0, 2).view({2, 3, 2, 1}) * 2.0;
       }},
      {"contiguous",
       [](const std::vector<Tensor>& x) {
         return layer_norm(x[0].permute({2, 1, 0}).contiguous(), {}, {});
       }},
  };
  for (const auto& [name, f] : fns) {
    CAPTURE(name);
    const GradcheckResult r = gradcheck(f, {a});
    CHECK_MESSAGE(r.ok, r.message);
  }
}

TEST_CASE("a matrix product reads transposed and sliced operands in place, without copying them") {
  const Tensor base = randn({64, 96}, 3);
  const Tensor w = randn({64, 48}, 4);
  for (const auto& [name, a] : std::vector<std::pair<std::string, Tensor>>{
           {"transposed", base.transpose(0, 1)}, {"column slice", base.slice(1, 16, 80).transpose(0, 1)}}) {
    CAPTURE(name);
    const Tensor dense = a.contiguous();
    const Tensor want = matmul(dense, w);
    // As many storages as the product of contiguous operands makes (its output): no copy.
    CHECK(allocations([&] { (void)matmul(a, w); }) == allocations([&] { (void)matmul(dense, w); }));
    test::check_close(matmul(a, w), want, 1e-5, 1e-5);
  }
  // The [B, T, 3, H, D] projection split into heads: q and k are permuted views, read in place.
  const std::int64_t B = 2, T = 16, H = 3, D = 8;
  const Tensor qkv = randn({B, T, 3, H, D}, 9);
  const Tensor q = qkv.slice(2, 0, 1).squeeze(2).permute({0, 2, 1, 3});
  const Tensor k = qkv.slice(2, 1, 2).squeeze(2).permute({0, 2, 1, 3});
  const Tensor qd = q.contiguous(), kd = k.transpose(2, 3).contiguous();
  const Tensor want = matmul(qd, kd);
  CHECK(allocations([&] { (void)matmul(q, k.transpose(2, 3)); }) == allocations([&] { (void)matmul(qd, kd); }));
  test::check_close(matmul(q, k.transpose(2, 3)), want, 1e-5, 1e-5);
}

TEST_CASE("attention's output merges its heads without a copy, and its backward reads the merged gradient in place") {
  const std::int64_t B = 2, T = 8, H = 3, D = 4;
  const Tensor qkv = randn({B, T, 3, H, D}, 21).set_requires_grad(true);
  auto heads = [&](std::int64_t i) { return qkv.slice(2, i, i + 1).squeeze(2).permute({0, 2, 1, 3}); };
  AttentionOptions o;
  o.causal = true;
  const Tensor y = scaled_dot_product_attention(heads(0), heads(1), heads(2), o);
  const Tensor merged = y.permute({0, 2, 1, 3}).reshape({B, T, H * D});
  CHECK(merged.shares_storage(y));
  CHECK(merged.is_contiguous());
  // The same gradients as with the heads copied first.
  const Tensor w = randn({H * D, 5}, 22);
  sum(square(matmul(merged, w))).backward();
  const Tensor g_views = qkv.grad();
  const Tensor qkv2 = qkv.detach().clone().set_requires_grad(true);
  auto copied = [&](std::int64_t i) { return qkv2.slice(2, i, i + 1).squeeze(2).permute({0, 2, 1, 3}).contiguous(); };
  const Tensor y2 = scaled_dot_product_attention(copied(0), copied(1), copied(2), o).contiguous();
  sum(square(matmul(y2.permute({0, 2, 1, 3}).contiguous().reshape({B, T, H * D}), w))).backward();
  test::check_close(g_views, qkv2.grad(), 1e-5, 1e-5);  // strided block products may round differently
}

TEST_CASE("binary ops on two transposed operands, walked in tiles: bitwise the op on contiguous copies") {
  // Both operands strided along the output's rows take a kernel of their own (tiles of 64 x 64,
  // computed down their columns, then transposed into the output's rows in registers): shapes of
  // one partial tile and of several tiles with partial ones at both edges, an operand broadcast
  // down its rows beside a transposed one, every float dtype and i64, on this backend.
  for (const DType dtype : {DType::f32, DType::f64, DType::bf16, DType::i64}) {
    for (const Shape& shape : {Shape{45, 70}, Shape{203, 131}}) {
      CAPTURE(dtype_name(dtype));
      CAPTURE(to_string(shape));
      auto make = [&](std::uint64_t seed) {
        const Tensor x = randn(shape, seed) * 100.0;
        return dtype == DType::i64 ? x.to(DType::i64) : x.to(dtype);
      };
      const Tensor a = make(61), b = make(62);
      const Tensor at = a.transpose(0, 1), bt = b.transpose(0, 1);  // strides [1, rows]
      const Tensor ac = at.contiguous(), bc = bt.contiguous();
      CHECK((at * bt + bt).to_vector<double>() == (ac * bc + bc).to_vector<double>());
      CHECK(maximum(at, bt).to_vector<double>() == maximum(ac, bc).to_vector<double>());
      CHECK(lt(at, bt).to_vector<double>() == lt(ac, bc).to_vector<double>());
      const Tensor column = make(63).slice(0, 0, 1).transpose(0, 1);  // [cols, 1], strides [1, 0] once expanded
      CHECK((at - column).to_vector<double>() == (ac - column).to_vector<double>());
    }
  }
}

TEST_CASE("binary ops of permuted operands: every pair of layouts, bitwise the op on contiguous copies") {
  // oneDNN 2.6's binary primitive wrote comparisons of two operands permuted alike in their own
  // layout, not the output's (half the values of lt wrong); [6, 50, 40] is above the size from
  // which the oneDNN backend calls it. Every pair of the six layouts, arithmetic and comparisons,
  // and an in-place add into a permuted destination.
  const Shape shape{6, 50, 40};
  const std::vector<std::vector<std::int64_t>> perms = {{0, 1, 2}, {0, 2, 1}, {1, 0, 2},
                                                        {1, 2, 0}, {2, 0, 1}, {2, 1, 0}};
  // A tensor whose permute(perm) has `shape`, with small integers from `low` (equal values are
  // common; b's are positive, so that a / b is finite).
  auto permuted = [&](const std::vector<std::int64_t>& perm, std::uint64_t seed, DType dtype, std::int64_t low) {
    Shape base(3);
    for (std::size_t i = 0; i < 3; ++i) base[static_cast<std::size_t>(perm[i])] = shape[i];
    return randint(base, low, 6, seed).to(dtype).permute(perm);
  };
  for (const DType dtype : {DType::f32, DType::bf16}) {
    for (const auto& pa : perms) {
      for (const auto& pb : perms) {
        CAPTURE(dtype_name(dtype));
        CAPTURE(pa);
        CAPTURE(pb);
        const Tensor a = permuted(pa, 71, dtype, -4), b = permuted(pb, 72, dtype, 1);
        const Tensor ac = a.contiguous(), bc = b.contiguous();
        CHECK((a - b).to_vector<double>() == (ac - bc).to_vector<double>());
        CHECK((a / b).to_vector<double>() == (ac / bc).to_vector<double>());
        CHECK(eq(a, b).to_vector<double>() == eq(ac, bc).to_vector<double>());
        CHECK(lt(a, b).to_vector<double>() == lt(ac, bc).to_vector<double>());
        CHECK(ge(a, b).to_vector<double>() == ge(ac, bc).to_vector<double>());
        Tensor into = permuted(pa, 73, dtype, -4);
        Tensor reference = into.contiguous();
        into.add_(b);
        reference.add_(bc);
        CHECK(into.to_vector<double>() == reference.to_vector<double>());
      }
    }
  }
}

TEST_CASE("contiguous() of transposes and permutes, copied in tiles: every element in place, every element size") {
  // Shapes around the tile sizes (16 to 128 elements by element size; 64 in blocks of 8 x 8 or
  // 4 x 4 where the CPU transposes in registers), batched, and a copy into a view.
  struct Case {
    Shape shape;
    std::vector<std::int64_t> perm;
  };
  const std::vector<Case> cases = {{{40, 70}, {1, 0}},
                                   {{33, 129}, {1, 0}},
                                   {{3, 37, 65}, {0, 2, 1}},
                                   {{37, 3, 65}, {2, 1, 0}},
                                   {{5, 48, 2, 33}, {2, 3, 0, 1}},
                                   {{64, 64}, {1, 0}},
                                   {{17, 16}, {1, 0}},
                                   {{130, 140}, {1, 0}},
                                   // Several 64-element tiles of 8 x 8 (4 x 4) register blocks, with partial
                                   // blocks and tiles at both edges.
                                   {{203, 266}, {1, 0}},
                                   {{2, 24, 21}, {0, 2, 1}}};
  for (DType d : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i64, DType::boolean}) {
    for (const Case& c : cases) {
      CAPTURE(dtype_name(d));
      CAPTURE(to_string(c.shape));
      const std::int64_t n = shape_numel(c.shape, "test");
      // Values that every dtype holds exactly: the flat index modulo 2 (bool) or 256.
      const std::int64_t mod = d == DType::boolean ? 2 : 256;
      std::vector<double> values(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n; ++i) values[static_cast<std::size_t>(i)] = static_cast<double>(i % mod);
      const Tensor x = from_values(values, c.shape, d);
      const Tensor y = x.permute(c.perm).contiguous();
      const std::vector<double> got = y.to_vector<double>();
      // The source index of each destination element, by its coordinates.
      std::vector<std::int64_t> src_strides(c.shape.size());
      std::int64_t stride = 1;
      for (std::size_t a = c.shape.size(); a-- > 0;) {
        src_strides[a] = stride;
        stride *= c.shape[a];
      }
      const Shape out_shape = y.shape();
      bool all = true;
      for (std::int64_t flat = 0; flat < n && all; ++flat) {
        std::int64_t rest = flat, src = 0;
        for (std::size_t a = out_shape.size(); a-- > 0;) {
          src += (rest % out_shape[a]) * src_strides[static_cast<std::size_t>(c.perm[a])];
          rest /= out_shape[a];
        }
        all = got[static_cast<std::size_t>(flat)] == static_cast<double>(src % mod);
      }
      CHECK(all);
      // Into a transposed view of another tensor: the same values through its strides.
      Tensor into = zeros(Shape(out_shape.rbegin(), out_shape.rend()), d);
      std::vector<std::int64_t> reverse(out_shape.size());
      for (std::size_t a = 0; a < reverse.size(); ++a) reverse[a] = static_cast<std::int64_t>(reverse.size() - 1 - a);
      into.permute(reverse).copy_(x.permute(c.perm));
      CHECK(into.permute(reverse).to_vector<double>() == got);
    }
  }
}

TEST_CASE("squeeze and transpose of a scalar's axis 0 or -1 return it, as PyTorch's and ruda's reductions do") {
  const Tensor s = full({}, 2.5).set_requires_grad();
  for (const std::int64_t axis : {0, -1}) {
    CHECK(s.squeeze(axis).shape() == Shape{});
    CHECK(s.transpose(axis, 0).shape() == Shape{});
    CHECK(s.squeeze(axis).item() == 2.5);
  }
  (s.squeeze(0) * 3.0 + s.transpose(0, -1)).backward();
  CHECK(s.grad().item() == 4.0);
  // Other axes are still out of range.
  test::check_throws<IndexError>([&] { s.squeeze(1); }, {"squeeze", "axis 1"});
  test::check_throws<IndexError>([&] { s.transpose(0, 1); }, {"transpose"});
}
