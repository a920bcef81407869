// Elementwise ops: arithmetic with broadcasting, comparisons, where, unary math, casts, dropout.
#include <charconv>
#include <cmath>
#include <limits>

#include "internal.h"
#include "op_descriptors.h"

namespace ruda {

using autograd::GradMask;
using autograd::Saved;
using detail::broadcast_view;
using detail::make_tensor;
using detail::view_of;

namespace {

bool is_comparison(BinaryOp op) { return op >= BinaryOp::eq; }

Tensor binary_forward(BinaryOp op, const char* name, const Tensor& a, const Tensor& b) {
  detail::require_defined(name, a);
  detail::require_defined(name, b);
  detail::require_same_dtype(name, a, b);
  if (a.dtype() == DType::boolean && !(op == BinaryOp::eq || op == BinaryOp::ne)) {
    // Ordered comparisons of bools compare them as 0 and 1 (PyTorch's False < True); arithmetic
    // on bools is refused.
    if (is_comparison(op)) return binary_forward(op, name, cast(a, DType::i64), cast(b, DType::i64));
    fail<DTypeError>(name, "is not defined on bool tensors ", a.shape(), " and ", b.shape());
  }
  const Shape shape = a.shape() == b.shape() ? a.shape() : broadcast_shapes(a.shape(), b.shape(), name);
  detail::require_rank(name, shape);
  if (a.dtype() == DType::i64 && (op == BinaryOp::div || op == BinaryOp::pow) && a.numel() && b.numel()) {
    // An integer divided by 0, or to a negative power, has no i64 result (PyTorch refuses both).
    // Checked here, where the caller's shapes are known, for the message; the Eigen kernel
    // refuses them too, for callers of the backend interface, with only the broadcast views.
    autograd::NoGradGuard guard;
    if (op == BinaryOp::div) {
      if (const double zeros = sum(eq(b, 0.0)).item(); zeros != 0) {
        fail<ArgumentError>(name, "integer division by zero: i64 ", a.shape(), " / i64 ", b.shape(),
                            ", the divisor holds ", zeros, zeros == 1 ? " zero" : " zeros");
      }
    } else if (const double lowest = min(b).item(); lowest < 0) {
      fail<ArgumentError>(name, "an i64 tensor to a negative power (", lowest, ") is not an integer: i64 ", a.shape(),
                          " ** i64 ", b.shape());
    }
  }
  Tensor out = make_tensor(shape, is_comparison(op) ? DType::boolean : a.dtype(), a.backend(), name);
  if (out.numel()) a.backend().binary(op, broadcast_view(a, shape), broadcast_view(b, shape), view_of(out));
  return out;
}

Tensor scalar_like(double value, const Tensor& like) {
  detail::require_defined("scalar", like);
  return detail::arithmetic_scalar_tensor(value, Options(like.dtype(), &like.backend()));
}

// A number for arithmetic with `like`: refused where an integer tensor could not hold it exactly.
Tensor arithmetic_scalar(const char* op, double value, const Tensor& like) {
  detail::require_defined(op, like);
  detail::require_exact_scalar(op, value, like);
  return scalar_like(value, like);
}

using detail::kTwo63;

// Whether `number` (as f32) is one of `dtype`'s values, for a 16-bit float dtype.
bool holds_exactly(DType dtype, float number) {
  const float back = dtype == DType::bf16 ? to_float(to_bfloat16(number)) : to_float(to_float16(number));
  return back == number;
}

// t * number and t / number (and number * t), as PyTorch computes them with a Python number: for
// f16 and bf16 tensors in f32 with the number as f32, rounded once to the tensor's dtype. Rounding
// the number to the tensor's dtype first made x * 1.005 in bf16 x * 1.0078125 (0.3% off, the same
// way on every element). Where the number is one of the dtype's values (0.5, 2, 0.125, 1000) the
// 16-bit kernel, which computes in f32, does exactly that; otherwise the tensor goes through f32.
// (PyTorch's + and - convert the number to the tensor's dtype first: operator+ and - below.)
Tensor with_number(Tensor (*op)(const Tensor&, const Tensor&), const char* name, const Tensor& t, double number,
                   bool number_first) {
  detail::require_defined(name, t);
  if (is_16bit_float(t.dtype()) && !holds_exactly(t.dtype(), static_cast<float>(number))) {
    const Tensor wide = cast(t, DType::f32);
    const Tensor s = detail::arithmetic_scalar_tensor(number, Options(DType::f32, &t.backend()));
    return cast(number_first ? op(s, wide) : op(wide, s), t.dtype());
  }
  const Tensor s = arithmetic_scalar(name, number, t);
  return number_first ? op(s, t) : op(t, s);
}

// a <op> b for an integer (or bool) tensor and any number, exactly: converting b to the tensor's
// dtype first would truncate it (0 < 0.5 read as 0 < 0, false). For integers x, x < b is x < ceil(b),
// x <= b is x <= floor(b), and so on; a bound outside the dtype makes the answer the same everywhere.
Tensor integer_comparison(BinaryOp op, const char* name, const Tensor& a, double b) {
  auto everywhere = [&](bool value) {
    return full(a.shape(), value ? 1.0 : 0.0, Options(DType::boolean, &a.backend()));
  };
  auto against = [&](double integral) {  // integral is a whole number within the dtype
    return binary_forward(op, name, a, scalar_like(integral, a));
  };
  const double low = a.dtype() == DType::boolean ? 0.0 : -kTwo63;
  const double high = a.dtype() == DType::boolean ? 1.0 : kTwo63 - 1024.0;  // the largest double below 2^63
  if (std::isnan(b)) return everywhere(op == BinaryOp::ne);
  switch (op) {
    case BinaryOp::eq:
    case BinaryOp::ne: {
      const bool representable = std::floor(b) == b && b >= low && b <= high;
      if (!representable) return everywhere(op == BinaryOp::ne);
      return against(b);
    }
    case BinaryOp::lt:
    case BinaryOp::ge: {  // x < b  <=>  x < ceil(b)
      const double c = std::ceil(b);
      if (c > high) return everywhere(op == BinaryOp::lt);
      if (c < low) return everywhere(op == BinaryOp::ge);
      return against(c);
    }
    case BinaryOp::le:
    case BinaryOp::gt: {  // x <= b  <=>  x <= floor(b)
      const double f = std::floor(b);
      if (f > high) return everywhere(op == BinaryOp::le);
      if (f < low) return everywhere(op == BinaryOp::gt);
      return against(f);
    }
    default:
      break;
  }
  fail<ArgumentError>(name, "is not a comparison");
}

Tensor compare_with_number(BinaryOp op, const char* name, const Tensor& a, double b) {
  detail::require_defined(name, a);
  if (is_floating(a.dtype())) return binary_forward(op, name, a, scalar_like(b, a));
  // Bools compare as 0 and 1, exactly (lt(mask, 0.5) is the mask's false entries).
  return integer_comparison(op, name, a.dtype() == DType::boolean ? cast(a, DType::i64) : a, b);
}

std::vector<Tensor> two(Tensor a, Tensor b) { return {std::move(a), std::move(b)}; }

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor out = binary_forward(BinaryOp::add, "add", a, b);
  if (autograd::needs_grad(a, b)) {
    autograd::record("add", out, {a, b}, {},
                     [sa = a.shape(), sb = b.shape()](const Tensor& g, const Saved&, GradMask need) {
                       return two(need[0] ? sum_to(g, sa) : Tensor(), need[1] ? sum_to(g, sb) : Tensor());
                     });
  }
  return out;
}

Tensor sub(const Tensor& a, const Tensor& b) {
  Tensor out = binary_forward(BinaryOp::sub, "sub", a, b);
  if (autograd::needs_grad(a, b)) {
    autograd::record("sub", out, {a, b}, {},
                     [sa = a.shape(), sb = b.shape()](const Tensor& g, const Saved&, GradMask need) {
                       return two(need[0] ? sum_to(g, sa) : Tensor(), need[1] ? sum_to(neg(g), sb) : Tensor());
                     });
  }
  return out;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = binary_forward(BinaryOp::mul, "mul", a, b);
  if (autograd::needs_grad(a, b)) {
    // Each input's gradient needs only the other input.
    const bool ga = a.requires_grad(), gb = b.requires_grad();
    autograd::record("mul", out, {a, b}, {ga ? b : Tensor(), gb ? a : Tensor()},
                     [sa = a.shape(), sb = b.shape()](const Tensor& g, const Saved& s, GradMask need) {
                       return two(need[0] ? sum_to(g * s[0].get(), sa) : Tensor(),
                                  need[1] ? sum_to(g * s[1].get(), sb) : Tensor());
                     });
  }
  return out;
}

Tensor div(const Tensor& a, const Tensor& b) {
  Tensor out = binary_forward(BinaryOp::div, "div", a, b);
  if (autograd::needs_grad(a, b)) {
    const bool gb = b.requires_grad();
    autograd::record("div", out, {a, b}, {b, gb ? out : Tensor()},
                     [sa = a.shape(), sb = b.shape()](const Tensor& g, const Saved& s, GradMask need) {
                       const Tensor bv = s[0].get();
                       // d(a/b)/db = -g ((a/b) / b), PyTorch's order: as (g / b) (a/b), g / b
                       // overflowed where b is tiny (1 / 1e-40 in f32) and a 0 quotient then gave
                       // NaN (inf * 0), or a finite gradient inf.
                       return two(need[0] ? sum_to(g / bv, sa) : Tensor(),
                                  need[1] ? sum_to(neg(g * (s[1].get() / bv)), sb) : Tensor());
                     });
  }
  return out;
}

Tensor pow(const Tensor& a, const Tensor& b) {
  Tensor out = binary_forward(BinaryOp::pow, "pow", a, b);
  if (autograd::needs_grad(a, b)) {
    autograd::record("pow", out, {a, b}, {a, b, b.requires_grad() ? out : Tensor()},
                     [sa = a.shape(), sb = b.shape()](const Tensor& g, const Saved& s, GradMask need) {
                       const Tensor av = s[0].get(), bv = s[1].get();
                       const Tensor zero = zeros({}, Options(g.dtype(), &g.backend()));
                       Tensor ga, gb;
                       // As PyTorch's pow_backward: d(a^b)/da = b * a^(b-1), exactly 0 where b == 0
                       // (0 * 0^-1 would be NaN at a == 0); d(a^b)/db = a^b * log(a), 0 where a == 0
                       // and b >= 0 (the limit), so 0^-1's is -inf.
                       // The derivative first, then g (PyTorch's order): in bf16, g * b rounded to 0
                       // where b * a^(b-1) had overflowed gave 0 * inf = NaN instead of inf.
                       if (need[0]) ga = sum_to(where(eq(bv, 0.0), zero, g * (bv * pow(av, bv - 1.0))), sa);
                       if (need[1]) {
                         const Tensor term = s[2].get() * log(av);
                         gb = sum_to(g * where(eq(av, 0.0), where(ge(bv, 0.0), zero, term), term), sb);
                       }
                       return two(std::move(ga), std::move(gb));
                     });
  }
  return out;
}

namespace {
// a^e for a number e, as PyTorch's pow with a number computes it: e = 0.5 and -0.5 as sqrt and
// rsqrt (so pow(-0, 0.5) is -0 and pow(-inf, 0.5) NaN, where std::pow gives 0 and inf), any other
// through the pow kernel, the number in a's dtype.
Tensor pow_number_value(const Tensor& a, double e) {
  autograd::NoGradGuard guard;
  // PyTorch's pow_tensor_scalar computes these exponents of a float tensor by their own formulas,
  // each operation rounded to the tensor's dtype: x * x * x for 3 (bf16 5.25^3 is 144, from
  // 27.5 * 5.25; std::pow rounded once, to 145), 1 / x for -1 (std::pow in f32 was 1 ulp off the
  // correctly rounded reciprocal), 1 / (x * x) for -2, x * x for 2, sqrt and rsqrt for 0.5 and -0.5.
  if (is_floating(a.dtype())) {
    if (e == 0.5) return sqrt(a);
    if (e == -0.5) return rsqrt(a);
    if (e == 2.0) return a * a;
    if (e == 3.0) return a * a * a;
    if (e == -1.0) return reciprocal(a);
    if (e == -2.0) return reciprocal(a * a);
  }
  return binary_forward(BinaryOp::pow, "pow", a, arithmetic_scalar("pow", e, a));
}
}  // namespace

Tensor pow(const Tensor& a, double exponent) {
  detail::require_defined("pow", a);
  Tensor out = pow_number_value(a, exponent);
  if (autograd::needs_grad(a)) {
    // PyTorch's pow_backward for a number: exponent * a^(exponent - 1) by the same rules (the
    // gradient of x^1.5 at -inf is 1.5 * sqrt(-inf), NaN; of x^-0.5 at -0, -0.5 * (-0)^-1.5,
    // -inf), and 0 where the exponent is 0.
    autograd::record("pow", out, {a}, {a}, [exponent](const Tensor& g, const Saved& s, GradMask) {
      if (exponent == 0.0) return std::vector<Tensor>{zeros_like(g)};
      const Tensor& av = s[0].get();
      // The derivative first, then g, as in pow(Tensor, Tensor).
      return std::vector<Tensor>{g * (arithmetic_scalar("pow", exponent, av) * pow_number_value(av, exponent - 1.0))};
    });
  }
  return out;
}

namespace {
Tensor extremum(BinaryOp op, const char* name, const Tensor& a, const Tensor& b) {
  Tensor out = binary_forward(op, name, a, b);
  if (autograd::needs_grad(a, b)) {
    autograd::record(name, out, {a, b}, {a, b},
                     [sa = a.shape(), sb = b.shape(), op](const Tensor& g, const Saved& s, GradMask need) {
                       const Tensor av = s[0].get(), bv = s[1].get();
                       // The winner takes the gradient; ties split it evenly (the central difference
                       // there). As PyTorch's: each side gets it unless the other wins, so where a
                       // value is NaN (neither wins, no tie) both do.
                       const Tensor a_loses = op == BinaryOp::maximum ? lt(av, bv) : gt(av, bv);
                       const Tensor b_loses = op == BinaryOp::maximum ? gt(av, bv) : lt(av, bv);
                       // (Selected, not masked by a multiply: an infinite gradient stays off the loser.)
                       const Tensor tie = eq(av, bv);
                       const Tensor zero = zeros({}, Options(g.dtype(), &g.backend()));
                       auto share = [&](const Tensor& loses) { return where(loses, zero, where(tie, g * 0.5, g)); };
                       return two(need[0] ? sum_to(share(a_loses), sa) : Tensor(),
                                  need[1] ? sum_to(share(b_loses), sb) : Tensor());
                     });
  }
  return out;
}
}  // namespace

Tensor maximum(const Tensor& a, const Tensor& b) { return extremum(BinaryOp::maximum, "maximum", a, b); }
Tensor minimum(const Tensor& a, const Tensor& b) { return extremum(BinaryOp::minimum, "minimum", a, b); }

Tensor eq(const Tensor& a, const Tensor& b) { return binary_forward(BinaryOp::eq, "eq", a, b); }
Tensor ne(const Tensor& a, const Tensor& b) { return binary_forward(BinaryOp::ne, "ne", a, b); }
Tensor lt(const Tensor& a, const Tensor& b) { return binary_forward(BinaryOp::lt, "lt", a, b); }
Tensor le(const Tensor& a, const Tensor& b) { return binary_forward(BinaryOp::le, "le", a, b); }
Tensor gt(const Tensor& a, const Tensor& b) { return binary_forward(BinaryOp::gt, "gt", a, b); }
Tensor ge(const Tensor& a, const Tensor& b) { return binary_forward(BinaryOp::ge, "ge", a, b); }

Tensor eq(const Tensor& a, double b) { return compare_with_number(BinaryOp::eq, "eq", a, b); }
Tensor ne(const Tensor& a, double b) { return compare_with_number(BinaryOp::ne, "ne", a, b); }
Tensor lt(const Tensor& a, double b) { return compare_with_number(BinaryOp::lt, "lt", a, b); }
Tensor le(const Tensor& a, double b) { return compare_with_number(BinaryOp::le, "le", a, b); }
Tensor gt(const Tensor& a, double b) { return compare_with_number(BinaryOp::gt, "gt", a, b); }
Tensor ge(const Tensor& a, double b) { return compare_with_number(BinaryOp::ge, "ge", a, b); }

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  detail::require_defined("where", cond);
  detail::require_defined("where", a);
  detail::require_defined("where", b);
  if (cond.dtype() != DType::boolean) {
    fail<DTypeError>("where", "condition must be bool, got ", dtype_name(cond.dtype()), " ", cond.shape());
  }
  detail::require_same_dtype("where", a, b);
  const Shape shape = broadcast_shapes(broadcast_shapes(cond.shape(), a.shape(), "where"), b.shape(), "where");
  detail::require_rank("where", shape);
  Tensor out = make_tensor(shape, a.dtype(), a.backend(), "where");
  if (out.numel()) {
    a.backend().where(broadcast_view(cond, shape), broadcast_view(a, shape), broadcast_view(b, shape), view_of(out));
  }
  if (autograd::needs_grad(a, b)) {
    autograd::record("where", out, {a, b}, {cond},
                     [sa = a.shape(), sb = b.shape()](const Tensor& g, const Saved& s, GradMask need) {
                       const Tensor c = s[0].get();
                       const Tensor zero = zeros({}, Options(g.dtype(), &g.backend()));
                       return two(need[0] ? sum_to(where(c, g, zero), sa) : Tensor(),
                                  need[1] ? sum_to(where(c, zero, g), sb) : Tensor());
                     });
  }
  return out;
}

Tensor clamp(const Tensor& x, double low, double high) {
  if (std::isnan(low) || std::isnan(high))
    fail<ArgumentError>("clamp", "a bound is NaN (low ", low, ", high ", high, ")");
  if (!(low <= high)) fail<ArgumentError>("clamp", "low ", low, " exceeds high ", high);
  detail::require_defined("clamp", x);
  if (x.dtype() == DType::boolean) {  // (maximum's error named maximum)
    fail<DTypeError>("clamp", "is not defined on the bool tensor ", x.shape(), " (cast to a number type first)");
  }
  if (x.dtype() == DType::i64) {
    // Integer bounds, exactly: [ceil(low), floor(high)], cut to the dtype's range (a bound beyond
    // it, such as 1e30, bounds nothing: INT64_MAX stays INT64_MAX, not the largest double below 2^63).
    const double ceil_low = std::ceil(low), floor_high = std::floor(high);
    if (ceil_low > floor_high || ceil_low >= kTwo63 || floor_high < -kTwo63) {
      fail<ArgumentError>("clamp", "no i64 value lies in [", low, ", ", high, "]");
    }
    const std::int64_t lo =
        ceil_low <= -kTwo63 ? std::numeric_limits<std::int64_t>::min() : static_cast<std::int64_t>(ceil_low);
    const std::int64_t hi =
        floor_high >= kTwo63 ? std::numeric_limits<std::int64_t>::max() : static_cast<std::int64_t>(floor_high);
    auto bound = [&](std::int64_t v) { return from_vector<std::int64_t>({v}, {}, Options(DType::i64, &x.backend())); };
    return minimum(maximum(x, bound(lo)), bound(hi));
  }
  const Tensor lo = scalar_like(low, x), hi = scalar_like(high, x);
  Tensor out;
  {
    autograd::NoGradGuard no_grad;
    out = maximum(x, lo);
    // The upper bound into the same tensor (the binary kernels allow an output that is exactly an
    // operand): no second tensor of x's size, and its pages are warm.
    if (out.numel())
      out.backend().binary(BinaryOp::minimum, view_of(out), broadcast_view(hi, out.shape()), view_of(out));
  }
  if (autograd::needs_grad(x)) {
    // The gradient passes where low <= x <= high, bounds included (PyTorch's clamp_backward; as
    // maximum and minimum it would split at a bound), and is 0 where x is NaN.
    // Selected, not multiplied by a mask: an infinite or NaN gradient outside the bounds (sqrt or
    // log of the clamped value at 0) stays out instead of becoming inf * 0 = NaN.
    autograd::record("clamp", out, {x}, {x}, [lo, hi](const Tensor& g, const Saved& s, GradMask) {
      const Tensor& xv = s[0].get();
      const Tensor zero = zeros({}, Options(g.dtype(), &g.backend()));
      return std::vector<Tensor>{where(ge(xv, lo), where(le(xv, hi), g, zero), zero)};  // (false at NaN)
    });
  }
  return out;
}

Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
// + and -: the number converted to the tensor's dtype first, then the tensor's kernel (which
// computes 16-bit dtypes in f32 and rounds once), as PyTorch's type promotion of a wrapped
// number does: bf16 0.1162109375 + 0.1 is 0.216796875 there (0.1 as bf16 0.10009765625, the sum
// a tie rounded to even), not the 0.2158203125 of 0.1 kept in f32 (1.5-4% of elements differed).
Tensor operator+(const Tensor& a, double b) { return add(a, arithmetic_scalar("add", b, a)); }
Tensor operator-(const Tensor& a, double b) { return sub(a, arithmetic_scalar("sub", b, a)); }
Tensor operator*(const Tensor& a, double b) { return with_number(mul, "mul", a, b, false); }
Tensor operator/(const Tensor& a, double b) { return with_number(div, "div", a, b, false); }
Tensor operator+(double a, const Tensor& b) { return add(arithmetic_scalar("add", a, b), b); }
// PyTorch's reflected forms, which its Python operators run: number - t is rsub, the number
// converted to t's dtype first; number / t is reciprocal(t) * number for float tensors (not one
// rounded division: the f32 results differ in the last bit).
Tensor operator-(double a, const Tensor& b) { return sub(arithmetic_scalar("sub", a, b), b); }
Tensor operator*(double a, const Tensor& b) { return with_number(mul, "mul", b, a, true); }
Tensor operator/(double a, const Tensor& b) {
  detail::require_defined("div", b);
  if (is_floating(b.dtype())) return with_number(mul, "div", reciprocal(b), a, true);
  return div(arithmetic_scalar("div", a, b), b);
}
Tensor operator-(const Tensor& a) { return neg(a); }

// --- unary ---

namespace {

// Every unary op, as its descriptor in op_descriptors.h says: the dtypes it takes, and what its
// backward saves (exactly what the derivative reads).
Tensor unary(UnaryOp op, const Tensor& x) {
  const ops::UnaryInfo info = ops::unary_info(op);
  const char* name = info.name.data();
  detail::require_defined(name, x);
  switch (info.domain) {
    case ops::Domain::numbers:
      if (x.dtype() == DType::boolean) fail<DTypeError>(name, "is not defined on bool tensor ", x.shape());
      break;
    case ops::Domain::floating:
      detail::require_float(name, x);
      break;
  }
  Tensor out = make_tensor(x.shape(), x.dtype(), x.backend(), name);
  if (out.numel()) x.backend().unary(op, view_of(detail::dense(x)), view_of(out));
  if (autograd::needs_grad(x)) {
    const bool reads_x = info.reads == ops::Reads::input, reads_y = info.reads == ops::Reads::output;
    autograd::record(name, out, {x}, {reads_x ? x : Tensor(), reads_y ? out : Tensor()},
                     [op](const Tensor& g, const Saved& s, GradMask) -> std::vector<Tensor> {
                       if (op == UnaryOp::neg) return {neg(g)};
                       const Tensor xv = s[0].get(), yv = s[1].get();  // yv is out: contiguous
                       Tensor gx = make_tensor(g.shape(), g.dtype(), g.backend(), "unary backward");
                       View none;
                       none.dtype = g.dtype();
                       g.backend().unary_backward(op, xv.defined() ? view_of(detail::dense(xv)) : none,
                                                  yv.defined() ? view_of(yv) : none, view_of(g), view_of(gx));
                       return {gx};
                     });
  }
  return out;
}

}  // namespace

Tensor neg(const Tensor& x) { return unary(UnaryOp::neg, x); }
Tensor abs(const Tensor& x) { return unary(UnaryOp::abs, x); }
Tensor exp(const Tensor& x) { return unary(UnaryOp::exp, x); }
Tensor log(const Tensor& x) { return unary(UnaryOp::log, x); }
Tensor sqrt(const Tensor& x) { return unary(UnaryOp::sqrt, x); }
Tensor rsqrt(const Tensor& x) { return unary(UnaryOp::rsqrt, x); }
Tensor square(const Tensor& x) { return unary(UnaryOp::square, x); }
Tensor reciprocal(const Tensor& x) { return unary(UnaryOp::reciprocal, x); }
Tensor tanh(const Tensor& x) { return unary(UnaryOp::tanh, x); }
Tensor sigmoid(const Tensor& x) { return unary(UnaryOp::sigmoid, x); }
Tensor relu(const Tensor& x) { return unary(UnaryOp::relu, x); }
Tensor gelu(const Tensor& x, GeluApproximation approximation) {
  check_enum(approximation, "gelu", "GeluApproximation");
  return unary(approximation == GeluApproximation::tanh ? UnaryOp::gelu_tanh : UnaryOp::gelu_erf, x);
}
Tensor silu(const Tensor& x) { return unary(UnaryOp::silu, x); }
Tensor softplus(const Tensor& x) { return unary(UnaryOp::softplus, x); }
Tensor erf(const Tensor& x) { return unary(UnaryOp::erf, x); }

Tensor cast(const Tensor& x, DType dtype) {
  detail::require_defined("cast", x);
  if (x.dtype() == dtype) return x;
  Tensor out = make_tensor(x.shape(), dtype, x.backend(), "cast");
  if (out.numel()) x.backend().cast(view_of(detail::dense(x)), view_of(out));
  if (is_floating(dtype) && autograd::needs_grad(x)) {
    autograd::record("cast", out, {x}, {}, [from = x.dtype()](const Tensor& g, const Saved&, GradMask) {
      return std::vector<Tensor>{cast(g, from)};
    });
  }
  return out;
}

Tensor dropout(const Tensor& x, double p, std::uint64_t seed, std::uint64_t offset) {
  detail::require_float("dropout", x);
  if (!(p >= 0.0 && p <= 1.0)) fail<ArgumentError>("dropout", "probability must be in [0, 1], got ", p);
  if (p == 0.0) return x;
  if (p == 1.0) return x * 0.0;  // everything dropped, as PyTorch's (a NaN stays NaN; the gradient is 0)
  // Draws in f32 whatever x's dtype (a bf16 draw has too few bits to hit p accurately): the mask
  // is 1 where rand(x.shape(), seed, offset) >= p.
  const Tensor keep = detail::dropout_mask(x.shape(), p, seed, offset, x.dtype(), x.backend());
  // PyTorch's order, input.mul(mask).mul_(scale): the scale is a number, so a 16-bit x is scaled
  // in f32 and rounded once (a mask pre-scaled in bf16 scaled by 1.109375 for p = 0.1). The mask
  // is the only tensor the backward keeps.
  return (x * keep) * (1.0 / (1.0 - p));
}

}  // namespace ruda

namespace ruda::detail {

void require_exact_scalar(const char* op, double value, DType dtype, const Shape& shape) {
  if (dtype != DType::i64) return;
  if (std::floor(value) == value && value >= -kTwo63 && value < kTwo63) return;
  fail<DTypeError>(op, "the number ", value, " is not an i64 value, and the tensor is i64 ", shape,
                   " (cast it to a float dtype first)");
}

void require_finite_in(const char* op, double value, DType dtype, const Shape& shape) {
  if (!std::isfinite(value)) return;  // infinities and NaN are values of every float dtype
  const float f = static_cast<float>(value);
  bool overflows = false;
  switch (dtype) {
    case DType::f32:
      overflows = std::isinf(f);
      break;
    case DType::bf16:
      overflows = std::isinf(to_float(to_bfloat16(f)));
      break;
    case DType::f16:
      overflows = std::isinf(to_float(to_float16(f)));
      break;
    case DType::f64:
    case DType::i64:
    case DType::boolean:
      break;
  }
  if (overflows) {
    // The shortest text that reads back as `value`: 65519.999999999993 is no 65520.
    char digits[32];
    *std::to_chars(digits, digits + sizeof digits - 1, value).ptr = '\0';
    fail<DTypeError>(op, "the number ", digits, " is beyond the largest ", dtype_name(dtype),
                     " value, and the tensor is ", dtype_name(dtype), " ", shape,
                     " (pass infinity itself for infinity)");
  }
}

void require_exact_scalar(const char* op, double value, const Tensor& like) {
  require_exact_scalar(op, value, like.dtype(), like.shape());
}

}  // namespace ruda::detail
