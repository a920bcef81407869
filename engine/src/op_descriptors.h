// One descriptor per unary op: the single place that says, for each UnaryOp, its name, the dtypes
// it accepts, what its backward reads, its forward and derivative formulas, and how the oneDNN
// backend may run it. The engine (engine/src/ops_pointwise.cpp), the Eigen kernels
// (backends/eigen/elementwise.cpp) and the oneDNN kernels (backends/onednn/eltwise.cpp) all read
// it; none of them has a per-op switch of its own. docs/adding-an-op.md walks through adding one.
//
// Private to ruda_engine and ruda_backends (backends/CMakeLists.txt gives the backends engine/src), and
// free of Eigen and oneDNN headers: the formulas are templates written against Eigen's Array API,
// instantiated only in backends/eigen; oneDNN algorithms are named by DnnlAlg, which
// backends/onednn/eltwise.cpp maps to dnnl::algorithm.
#pragma once

#include <cstdint>
#include <numbers>
#include <string_view>
#include <type_traits>

#include <ruda/backend.h>
#include <ruda/error.h>

namespace ruda::ops {

/// The dtypes an op accepts: `floating` is f32, f64, f16 and bf16; `numbers` adds i64 (never bool).
enum class Domain : std::uint8_t { floating, numbers };

/// What the derivative reads besides gy: nothing, the input x, or the output y = f(x). The engine
/// saves exactly that tensor, and the backward formula takes exactly that argument.
enum class Reads : std::uint8_t { nothing, input, output };

/// The oneDNN 2.6 eltwise algorithms the descriptors use (none: oneDNN has no such kernel, so the
/// oneDNN backend runs Eigen's). The *_use_dst_for_bwd ones are backward algorithms reading y.
enum class DnnlAlg : std::uint8_t {
  none,
  linear,
  abs,
  exp,
  log,
  sqrt,
  pow,
  tanh,
  logistic,
  relu,
  gelu_tanh,
  gelu_erf,
  swish,
  soft_relu,
  square,
  exp_use_dst_for_bwd,
  sqrt_use_dst_for_bwd,
  tanh_use_dst_for_bwd,
  logistic_use_dst_for_bwd,
  relu_use_dst_for_bwd,
};

constexpr bool reads_output(DnnlAlg alg) {
  return alg == DnnlAlg::exp_use_dst_for_bwd || alg == DnnlAlg::sqrt_use_dst_for_bwd ||
         alg == DnnlAlg::tanh_use_dst_for_bwd || alg == DnnlAlg::logistic_use_dst_for_bwd ||
         alg == DnnlAlg::relu_use_dst_for_bwd;
}

struct DnnlEltwise {
  DnnlAlg alg = DnnlAlg::none;
  float alpha = 0.0f, beta = 0.0f;
};

/// Where oneDNN's kernel measured slower than Eigen's, so the oneDNN backend runs Eigen's unless
/// RUDA_ONEDNN_KERNELS=all (the measurements are in backends/onednn/kernel_policy.h).
enum class Slower : std::uint8_t { never, f32, always };

/// How the oneDNN backend runs an op. A backward algorithm reads what the op's Reads says: x, or y
/// for the *_use_dst_for_bwd ones. `avoid_*`, when not empty, is why oneDNN's kernel is never used.
struct DnnlPlan {
  DnnlEltwise forward = {}, backward = {};
  Slower forward_slower = Slower::never, backward_slower = Slower::never;
  std::string_view avoid_forward = {}, avoid_backward = {};
};

/// The run-time part of a descriptor.
struct UnaryInfo {
  std::string_view name;  // a string literal: name.data() is NUL-terminated
  Domain domain;
  Reads reads;
  DnnlPlan onednn;
};

inline constexpr std::string_view kReluNanReason = "oneDNN's relu maps NaN to 0";

/// Unary<op> has: name, domain, reads, onednn (as in UnaryInfo), and the formulas
///   forward(x, y):       y = f(x)
///   backward(gy, gx)     gx = gy * f'(x), when reads is nothing,
///   backward(x, gy, gx)  when it is input,
///   backward(y, gy, gx)  when it is output,
/// on Eigen arrays (1-D maps of the tensors; 16-bit values are widened to f32 first); optionally
///   forward_and_derivative(x, y, dydx)  y = f(x) and dydx = f'(x) in one pass (x overlaps neither),
/// which the Eigen backend's unary_with_derivative runs where it exists. An op whose
/// domain is `numbers` has a forward that compiles for std::int64_t too.
template <UnaryOp Op>
struct Unary;

template <class A>
using scalar_of = typename A::Scalar;

/// erf and tanh of an Eigen array expression, vectorized in f32 (backends/eigen/vector_math.h
/// defines them: Eigen's own .erf() and .tanh() are scalar under ruda's EIGEN_FAST_MATH=0), and
/// exp and the logistic function without Eigen's underflow clamp (Eigen's exp(-inf) is 2.9e-39 in
/// f32), log without its clamp of subnormal arguments (Eigen's log(1e-40) is log(FLT_MIN) in
/// f32), and negation keeping the sign of zero (Eigen's packet -x is 0 - x): the formulas below
/// use these, never Eigen's .exp(), .log(), .logistic() or a unary minus on an array.
template <class X>
auto vector_erf(const X& x);
template <class X>
auto vector_tanh(const X& x);
template <class X>
auto vector_exp(const X& x);
template <class X>
auto vector_log(const X& x);
template <class X>
auto vector_neg(const X& x);
template <class X>
auto vector_logistic(const X& x);

/// i64 x as uint64_t, where wrapping on overflow is defined: neg, abs and square of i64 wrap
/// (-INT64_MIN is INT64_MIN), as i64 arithmetic does, instead of being undefined behaviour.
template <class X>
constexpr bool is_i64_array = std::is_same_v<scalar_of<X>, std::int64_t>;
template <class X>
auto wrapping(const X& x) {
  return x.template cast<std::uint64_t>();
}

template <>
struct Unary<UnaryOp::neg> {
  static constexpr std::string_view name = "neg";
  static constexpr Domain domain = Domain::numbers;
  static constexpr Reads reads = Reads::nothing;
  // -1 x + (-0): the added -0 keeps neg(0) = -0 (with +0 it was +0, as -0 + 0 is).
  static constexpr DnnlPlan onednn{.forward = {DnnlAlg::linear, -1.0f, -0.0f}};
  template <class X, class Y>
  static void forward(const X& x, Y& y) {
    if constexpr (is_i64_array<X>) {
      y = (-wrapping(x)).template cast<std::int64_t>();
    } else {
      y = vector_neg(x);  // not -x: Eigen's packet negation is 0 - x, +0 for 0
    }
  }
  template <class G, class GX>
  static void backward(const G& gy, GX& gx) {
    gx = vector_neg(gy);
  }
};

template <>
struct Unary<UnaryOp::abs> {
  static constexpr std::string_view name = "abs";
  static constexpr Domain domain = Domain::numbers;
  static constexpr Reads reads = Reads::input;
  static constexpr DnnlPlan onednn{
      .forward = {DnnlAlg::abs},
      .backward = {DnnlAlg::abs},
      .avoid_backward = "oneDNN's abs backward passes the gradient at NaN (PyTorch's is 0)"};
  template <class X, class Y>
  static void forward(const X& x, Y& y) {
    if constexpr (is_i64_array<X>) {
      y = (x < std::int64_t{0}).select(-wrapping(x), wrapping(x)).template cast<std::int64_t>();
    } else {
      y = x.abs();
    }
  }
  template <class X, class G, class GX>
  static void backward(const X& x, const G& gy, GX& gx) {
    using T = scalar_of<X>;
    const T zero(0);
    gx = gy * ((x > zero).template cast<T>() - (x < zero).template cast<T>());
  }
};

template <>
struct Unary<UnaryOp::exp> {
  static constexpr std::string_view name = "exp";
  static constexpr Domain domain = Domain::floating;
  static constexpr Reads reads = Reads::output;
  static constexpr DnnlPlan onednn{.forward = {DnnlAlg::exp},
                                   .backward = {DnnlAlg::exp_use_dst_for_bwd},
                                   .avoid_forward = "oneDNN's exp maps NaN to +inf"};
  template <class X, class Y>
  static void forward(const X& x, Y& y) {
    y = vector_exp(x);
  }
  template <class Y, class G, class GX>
  static void backward(const Y& y, const G& gy, GX& gx) {
    gx = gy * y;
  }
};

template <>
struct Unary<UnaryOp::log> {
  static constexpr std::string_view name = "log";
  static constexpr Domain domain = Domain::floating;
  static constexpr Reads reads = Reads::input;
  static constexpr DnnlPlan onednn{.forward = {DnnlAlg::log},
                                   .backward = {DnnlAlg::log},
                                   .backward_slower = Slower::always,
                                   .avoid_forward = "oneDNN's bf16 log(1) is -1.4e-6, not 0"};
  template <class X, class Y>
  static void forward(const X& x, Y& y) {
    y = vector_log(x);
  }
  template <class X, class G, class GX>
  static void backward(const X& x, const G& gy, GX& gx) {
    gx = gy / x;
  }
};

template <>
struct Unary<UnaryOp::sqrt> {
  static constexpr std::string_view name = "sqrt";
  static constexpr Domain domain = Domain::floating;
  static constexpr Reads reads = Reads::output;
  static constexpr DnnlPlan onednn{
      .forward = {DnnlAlg::sqrt}, .backward = {DnnlAlg::sqrt_use_dst_for_bwd}, .backward_slower = Slower::always};
  template <class X, class Y>
  static void forward(const X& x, Y& y) {
    y = x.sqrt();
  }
  template <class Y, class G, class GX>
  static void backward(const Y& y, const G& gy, GX& gx) {
    gx = gy * scalar_of<Y>(0.5) / y;
  }
};

// rsqrt and reciprocal save y; oneDNN's pow backward needs x, so they have no oneDNN backward.
template <>
struct Unary<UnaryOp::rsqrt> {
  static constexpr std::string_view name = "rsqrt";
  static constexpr Domain domain = Domain::floating;
  static constexpr Reads reads = Reads::output;
  static constexpr DnnlPlan onednn{.forward = {DnnlAlg::pow, 1.0f, -0.5f},
                                   .forward_slower = Slower::always,
                                   .avoid_forward = "oneDNN's pow(x, -1/2) is 0 at -inf, not NaN"};
  template <class X, class Y>
  static void forward(const X& x, Y& y) {
    y = x.rsqrt();
  }
  template <class Y, class G, class GX>
  static void backward(const Y& y, const G& gy, GX& gx) {
    gx = gy * scalar_of<Y>(-0.5) * y.cube();
  }
};

template <>
struct Unary<UnaryOp::tanh> {
  static constexpr std::string_view name = "tanh";
  static constexpr Domain domain = Domain::floating;
  static constexpr Reads reads = Reads::output;
  static constexpr DnnlPlan onednn{.forward = {DnnlAlg::tanh},
                                   .backward = {DnnlAlg::tanh_use_dst_for_bwd},
                                   .forward_slower = Slower::f32,
                                   .backward_slower = Slower::always};
  template <class X, class Y>
  static void forward(const X& x, Y& y) {
    y = vector_tanh(x);
  }
  // (1 - y)(1 + y), not 1 - y^2: near |y| = 1 the latter cancels, accurate only where the compiler
  // contracted it into an FMA (f64 at x = -9.5: 5e-9 relative off at -O1, exact at -O3).
  template <class Y, class G, class GX>
  static void backward(const Y& y, const G& gy, GX& gx) {
    gx = gy * ((scalar_of<Y>(1) - y) * (scalar_of<Y>(1) + y));
  }
};

template <>
struct Unary<UnaryOp::sigmoid> {
  static constexpr std::string_view name = "sigmoid";
  static constexpr Domain domain = Domain::floating;
  static constexpr Reads reads = Reads::output;
  // f32 forward on oneDNN again (2026-12-04): Eigen's exact logistic (vector_math.h) takes 1.43 ms
  // on 4M values against oneDNN's 0.94 (a few ulp too); Eigen's rational approximation, 0.60 ms,
  // was up to 7500 ulp off below -4.
  static constexpr DnnlPlan onednn{.forward = {DnnlAlg::logistic},
                                   .backward = {DnnlAlg::logistic_use_dst_for_bwd},
                                   .backward_slower = Slower::always};
  template <class X, class Y>
  static void forward(const X& x, Y& y) {
    y = vector_logistic(x);
  }
  template <class Y, class G, class GX>
  static void backward(const Y& y, const G& gy, GX& gx) {
    gx = gy * y * (scalar_of<Y>(1) - y);
  }
};

// oneDNN 2.6's relu (a max with zero in its JIT kernels) turns NaN into 0, and its backward drops
// the gradient there: a NaN that should stop training would vanish. Eigen's relu propagates it.
template <>
struct Unary<UnaryOp::relu> {
  static constexpr std::string_view name = "relu";
  static constexpr Domain domain = Domain::floating;
  static constexpr Reads reads = Reads::output;
  static constexpr DnnlPlan onednn{.forward = {DnnlAlg::relu},
                                   .backward = {DnnlAlg::relu_use_dst_for_bwd},
                                   .backward_slower = Slower::always,
                                   .avoid_forward = kReluNanReason,
                                   .avoid_backward = kReluNanReason};
  template <class X, class Y>
  static void forward(const X& x, Y& y) {
    using T = scalar_of<X>;
    const T zero(0);
    y = (x < zero).select(zero, x);  // NaN stays NaN (x < 0 is false for it), as in PyTorch
  }
  template <class Y, class G, class GX>
  static void backward(const Y& y, const G& gy, GX& gx) {
    using T = scalar_of<Y>;
    const T zero(0);
    gx = (y <= zero).select(zero, gy);  // passes through where the output is NaN, as PyTorch's threshold_backward
  }
};

inline constexpr double kSqrt2OverPi = 0.7978845608028654;  // sqrt(2 / pi)
inline constexpr double kGeluCubic = 0.044715;

template <>
struct Unary<UnaryOp::gelu_tanh> {
  static constexpr std::string_view name = "gelu_tanh";
  static constexpr Domain domain = Domain::floating;
  static constexpr Reads reads = Reads::input;
  // oneDNN's backward is the faster one (kernel_policy.h: 0.40 against 0.54 ns a value) but NaN
  // from |x| ~1e15 on.
  static constexpr DnnlPlan onednn{
      .forward = {DnnlAlg::gelu_tanh},
      .backward = {DnnlAlg::gelu_tanh},
      .forward_slower = Slower::always,
      .avoid_backward =
          "oneDNN's gelu_tanh backward is NaN from |x| ~1e15 (its cubic overflows), where the slope is 1 "
          "or 0"};
  template <class X, class Y>
  static void forward(const X& x, Y& y) {
    using T = scalar_of<X>;
    const T half(0.5), one(1);
    y = half * x * (one + vector_tanh(T(kSqrt2OverPi) * (x + T(kGeluCubic) * x.cube())));
  }
  template <class X, class G, class GX>
  static void backward(const X& x, const G& gy, GX& gx) {
    using T = scalar_of<X>;
    const T half(0.5), one(1);
    const auto t = vector_tanh(T(kSqrt2OverPi) * (x + T(kGeluCubic) * x.cube())).eval();
    gx = gy * (half * (one + t) +
               half * x * (one - t.square()) * T(kSqrt2OverPi) * (one + T(3 * kGeluCubic) * bounded_square(x)));
  }
  /// x^2, at most 1e12: past |x| = 1e6 the tanh is +-1 exactly and 1 - tanh^2 is 0, and x^2 past
  /// the dtype's range (|x| >= 1.8e19 in f32) made that 0 * inf, a NaN gradient where GELU's slope
  /// is 1 or 0.
  template <class X>
  static auto bounded_square(const X& x) {
    return x.square().min(scalar_of<X>(1e12));
  }
  /// forward's y and backward's factor of gy from one tanh (Backend::unary_with_derivative; x
  /// overlaps neither output): y holds the tanh until its own value is written.
  template <class X, class Y, class DX>
  static void forward_and_derivative(const X& x, Y& y, DX& dydx) {
    using T = scalar_of<X>;
    const T half(0.5), one(1);
    y = vector_tanh(T(kSqrt2OverPi) * (x + T(kGeluCubic) * x.cube()));
    dydx = half * (one + y) +
           half * x * (one - y.square()) * T(kSqrt2OverPi) * (one + T(3 * kGeluCubic) * bounded_square(x));
    y = half * x * (one + y);
  }
};

template <>
struct Unary<UnaryOp::gelu_erf> {
  static constexpr std::string_view name = "gelu";
  static constexpr Domain domain = Domain::floating;
  static constexpr Reads reads = Reads::input;
  static constexpr DnnlPlan onednn{.forward = {DnnlAlg::gelu_erf},
                                   .backward = {DnnlAlg::gelu_erf},
                                   .forward_slower = Slower::always,
                                   .backward_slower = Slower::f32};
  template <class X, class Y>
  static void forward(const X& x, Y& y) {
    using T = scalar_of<X>;
    const T half(0.5), one(1);
    y = half * x * (one + vector_erf(x * T(std::numbers::sqrt2 / 2)));
  }
  template <class X, class G, class GX>
  static void backward(const X& x, const G& gy, GX& gx) {
    using T = scalar_of<X>;
    const T half(0.5), one(1), inv_sqrt_2pi(0.3989422804014327);
    gx = gy * (half * (one + vector_erf(x * T(std::numbers::sqrt2 / 2))) +
               x * inv_sqrt_2pi * vector_exp(-half * x.square()));
  }
  /// forward's y and backward's factor of gy from one erf (Backend::unary_with_derivative; x
  /// overlaps neither output): y holds the erf until its own value is written.
  template <class X, class Y, class DX>
  static void forward_and_derivative(const X& x, Y& y, DX& dydx) {
    using T = scalar_of<X>;
    const T half(0.5), one(1), inv_sqrt_2pi(0.3989422804014327);
    y = vector_erf(x * T(std::numbers::sqrt2 / 2));
    dydx = half * (one + y) + x * inv_sqrt_2pi * vector_exp(-half * x.square());
    y = half * x * (one + y);
  }
};

template <>
struct Unary<UnaryOp::silu> {
  static constexpr std::string_view name = "silu";
  static constexpr Domain domain = Domain::floating;
  static constexpr Reads reads = Reads::input;
  static constexpr DnnlPlan onednn{.forward = {DnnlAlg::swish, 1.0f},
                                   .backward = {DnnlAlg::swish, 1.0f},
                                   .forward_slower = Slower::always,
                                   .backward_slower = Slower::f32};
  template <class X, class Y>
  static void forward(const X& x, Y& y) {
    y = x * vector_logistic(x);
  }
  template <class X, class G, class GX>
  static void backward(const X& x, const G& gy, GX& gx) {
    using T = scalar_of<X>;
    const T one(1);
    const auto s = vector_logistic(x).eval();
    gx = gy * s * (one + x * (one - s));
  }
};

// oneDNN 2.6's soft_relu computes log(1 + exp(x)) directly: for x below about -15 its result is
// off by ~2e-6 in absolute terms, negative where softplus is tiny and positive.
template <>
struct Unary<UnaryOp::softplus> {
  static constexpr std::string_view name = "softplus";
  static constexpr Domain domain = Domain::floating;
  static constexpr Reads reads = Reads::input;
  static constexpr DnnlPlan onednn{
      .forward = {DnnlAlg::soft_relu},
      .backward = {DnnlAlg::soft_relu},
      .backward_slower = Slower::always,
      .avoid_forward = "oneDNN's soft_relu is inaccurate (even negative) for negative inputs",
      .avoid_backward = "oneDNN's soft_relu has no threshold (PyTorch's softplus is x past 20, its gradient 1)"};
  /// PyTorch's softplus (beta 1, threshold 20): x itself past the threshold, where log1p(exp(-x))
  /// is below 2.1e-9, and a gradient of exactly 1 there.
  static constexpr double kThreshold = 20.0;
  template <class X, class Y>
  static void forward(const X& x, Y& y) {
    using T = scalar_of<X>;
    const T zero(0);
    y = (x > T(kThreshold)).select(x, x.max(zero) + vector_exp(-x.abs()).log1p());
  }
  /// Its gradient as PyTorch's, exp(x) / (exp(x) + 1): the logistic's 1 / (1 + exp(-x)) is 0
  /// where exp(-x) overflows (x below -88.7 in f32, -709.8 in f64), where this keeps the
  /// subnormal gradient (2.7e-39 at -88.8 in f32).
  template <class X, class G, class GX>
  static void backward(const X& x, const G& gy, GX& gx) {
    using T = scalar_of<X>;
    const auto z = vector_exp(x).eval();
    gx = (x > T(kThreshold)).select(gy, gy * (z / (z + T(1))));
  }
};

template <>
struct Unary<UnaryOp::square> {
  static constexpr std::string_view name = "square";
  static constexpr Domain domain = Domain::numbers;
  static constexpr Reads reads = Reads::input;
  static constexpr DnnlPlan onednn{.forward = {DnnlAlg::square}, .backward = {DnnlAlg::square}};
  template <class X, class Y>
  static void forward(const X& x, Y& y) {
    if constexpr (is_i64_array<X>) {
      y = wrapping(x).square().template cast<std::int64_t>();
    } else {
      y = x.square();
    }
  }
  template <class X, class G, class GX>
  static void backward(const X& x, const G& gy, GX& gx) {
    // 2x first, as PyTorch's gy * (2 * x) and oneDNN's square backward: (gy * 2) * x kept a
    // finite gradient where 2x overflows (x = 3e38, gy = 0.5), so the oneDNN backend answered
    // differently below and above its size floor.
    gx = gy * (x * scalar_of<X>(2));
  }
};

template <>
struct Unary<UnaryOp::reciprocal> {
  static constexpr std::string_view name = "reciprocal";
  static constexpr Domain domain = Domain::floating;
  static constexpr Reads reads = Reads::output;
  static constexpr DnnlPlan onednn{.forward = {DnnlAlg::pow, 1.0f, -1.0f}};
  template <class X, class Y>
  static void forward(const X& x, Y& y) {
    y = x.inverse();
  }
  template <class Y, class G, class GX>
  static void backward(const Y& y, const G& gy, GX& gx) {
    gx = vector_neg(gy) * y.square();
  }
};

// oneDNN 2.6 has gelu_erf but no plain erf eltwise: its DnnlPlan is empty, so the oneDNN backend
// runs Eigen's kernel (a recorded fallback).
template <>
struct Unary<UnaryOp::erf> {
  static constexpr std::string_view name = "erf";
  static constexpr Domain domain = Domain::floating;
  static constexpr Reads reads = Reads::input;
  static constexpr DnnlPlan onednn{};
  template <class X, class Y>
  static void forward(const X& x, Y& y) {
    y = vector_erf(x);
  }
  template <class X, class G, class GX>
  static void backward(const X& x, const G& gy, GX& gx) {
    using T = scalar_of<X>;
    gx = gy * T(2 * std::numbers::inv_sqrtpi) * vector_exp(-x.square());  // d/dx erf(x) = 2 / sqrt(pi) * exp(-x^2)
  }
};

/// What every descriptor must satisfy, checked when visit_unary instantiates it.
template <UnaryOp Op, class D = Unary<Op>>
constexpr bool well_formed() {
  const DnnlAlg bwd = D::onednn.backward.alg;
  return !D::name.empty() &&
         // A *_use_dst_for_bwd algorithm reads y, the others x: what the engine saves must match.
         (bwd == DnnlAlg::none || reads_output(bwd) == (D::reads == Reads::output)) &&
         !reads_output(D::onednn.forward.alg) && (bwd != DnnlAlg::none || D::onednn.backward_slower == Slower::never);
}

template <UnaryOp Op, class F>
constexpr decltype(auto) call_with(F&& f) {
  static_assert(well_formed<Op>(), "inconsistent unary op descriptor");
  return f(Unary<Op>{});
}

/// Calls f(Unary<op>{}) — once per kernel call, never per element. A case missing here is a
/// -Wswitch error (the build sets -Werror=switch).
template <class F>
constexpr decltype(auto) visit_unary(UnaryOp op, F&& f) {
  switch (op) {
    case UnaryOp::neg:
      return call_with<UnaryOp::neg>(f);
    case UnaryOp::abs:
      return call_with<UnaryOp::abs>(f);
    case UnaryOp::exp:
      return call_with<UnaryOp::exp>(f);
    case UnaryOp::log:
      return call_with<UnaryOp::log>(f);
    case UnaryOp::sqrt:
      return call_with<UnaryOp::sqrt>(f);
    case UnaryOp::rsqrt:
      return call_with<UnaryOp::rsqrt>(f);
    case UnaryOp::tanh:
      return call_with<UnaryOp::tanh>(f);
    case UnaryOp::sigmoid:
      return call_with<UnaryOp::sigmoid>(f);
    case UnaryOp::relu:
      return call_with<UnaryOp::relu>(f);
    case UnaryOp::gelu_tanh:
      return call_with<UnaryOp::gelu_tanh>(f);
    case UnaryOp::gelu_erf:
      return call_with<UnaryOp::gelu_erf>(f);
    case UnaryOp::silu:
      return call_with<UnaryOp::silu>(f);
    case UnaryOp::softplus:
      return call_with<UnaryOp::softplus>(f);
    case UnaryOp::square:
      return call_with<UnaryOp::square>(f);
    case UnaryOp::reciprocal:
      return call_with<UnaryOp::reciprocal>(f);
    case UnaryOp::erf:
      return call_with<UnaryOp::erf>(f);
  }
  fail<ArgumentError>("unary", "unknown UnaryOp value ", static_cast<int>(op));
}

constexpr UnaryInfo unary_info(UnaryOp op) {
  return visit_unary(op, []<class D>(D) { return UnaryInfo{D::name, D::domain, D::reads, D::onednn}; });
}

/// Refuses the Views of Backend::unary_with_derivative that its contract excludes (a typed error
/// naming the op, dtypes and sizes): an unknown op; sizes or dtypes that differ; a non-contiguous
/// View; null data where there are values; y overlapping x or dydx; dydx overlapping x other than
/// being x itself. Every implementation calls it first (the default in backend_registry.cpp).
void check_unary_with_derivative(UnaryOp op, const View& x, const View& y, const View& dydx);

}  // namespace ruda::ops
