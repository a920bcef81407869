// erf and tanh of Eigen array expressions, vectorized in f32; exp and the logistic function
// without Eigen's underflow clamp; log without its clamp of subnormal arguments; negation that
// keeps the sign of zero.
//
// ruda compiles its Eigen kernels with EIGEN_FAST_MATH=0 (backends/CMakeLists.txt: Eigen's
// fast-math psqrt returns NaN for +inf). That switch also turns off Eigen's packet erf and tanh
// (HasErf and HasTanh follow EIGEN_FAST_MATH), so .erf() and .tanh() ran one value at a time:
// f32 erf ~2.8 ns a value and tanh ~10 ns under AVX2. Their packet forms are Eigen's own
// rational approximations (generic_fast_erf_float, generic_fast_tanh_float, a few ulp), applied
// here through a packet functor without the fast-math sqrt. f64 keeps Eigen's exact scalar erf
// and tanh.
//
// Eigen 3.4's packet exp clamps its argument at -88.723 (f32) and -709.784 (f64), so exp(-inf)
// read 2.9e-39 (f32) or 5.6e-309 (f64), not 0: a softmax's masked (-inf) slots held that instead
// of 0, and exp(-100) in f32 was 2.9e-39, not 3.8e-44. vector_exp computes exp(x) below the clamp
// from exp(x + k) * exp(-k) (ExpWithoutClamp), down to where exp(x) rounds to 0; above it the values
// are Eigen's own, bit for bit. The logistic function is built on it. Private to the Eigen
// backend; op_descriptors.h declares the functions.
#pragma once

#include <limits>
#include <type_traits>

#include <Eigen/Core>
#include <unsupported/Eigen/SpecialFunctions>

#include "op_descriptors.h"

namespace ruda::ops::detail {

// Eigen 3.4's packet approximations, as functors over packets. Eigen's erf overshoots its bounds
// by an ulp near |x| = 4 (erf(-3.9951453) was -1.00000012, and gelu of some negative inputs came
// out positive): the result is clamped to [-1, 1].
struct ErfApproximation {
  template <class Packet>
  Packet operator()(const Packet& x) const {
    using namespace Eigen::internal;
    const Packet one = pset1<Packet>(1.0f);
    return pmax(pmin(generic_fast_erf_float(x), one), pnegate(one));
  }
};

// log(x) for every x: Eigen 3.4's packet log clamps its argument to the smallest normal number,
// so the log of a subnormal value (log(1e-40) in f32 = -92.1) read log(FLT_MIN) = -87.34 in full
// packets and the true value only in a range's scalar tail. Subnormal lanes are scaled by 2^k
// into the normal range (exactly: a power of two) and k ln 2 is subtracted after; elsewhere the
// values are Eigen's own, bit for bit.
struct LogWithSubnormals {
  template <class Packet>
  Packet operator()(const Packet& x) const {
    using namespace Eigen::internal;
    using S = typename unpacket_traits<Packet>::type;
    constexpr bool f32 = std::is_same_v<S, float>;
    constexpr S kSmallestNormal = std::numeric_limits<S>::min();
    constexpr S kScale = f32 ? S(16777216.0) : S(18014398509481984.0);        // 2^24, 2^54
    constexpr S kShift = f32 ? S(16.635532333438686) : S(37.42994775023704);  // 24 ln 2, 54 ln 2
    const Packet subnormal = pand(pcmp_lt(pzero(x), x), pcmp_lt(x, pset1<Packet>(kSmallestNormal)));
    if (!predux_any(subnormal)) return plog(x);
    const Packet l = plog(pselect(subnormal, pmul(x, pset1<Packet>(kScale)), x));
    return pselect(subnormal, psub(l, pset1<Packet>(kShift)), l);
  }
};
// Eigen's rational tanh is clamped at |x| = 7.9053 and reads +-1 from there, where f32's tanh is
// 1 - 6e-8 to 1 - 2.4e-7 up to |x| = 9.011: 1 + tanh (GELU's tanh form in the negative tail) and
// 1 - tanh^2 (the backward) read 0 there, where PyTorch's read 1.8e-7 (gelu_tanh(-4.9) was -0,
// not -4.4e-7). Lanes from the clamp on take 1 - 2 / (exp(2|x|) + 1), with x's sign; a packet
// without such a lane costs one comparison more.
struct TanhApproximation {
  template <class Packet>
  Packet operator()(const Packet& x) const {
    using namespace Eigen::internal;
    const Packet r = generic_fast_tanh_float(x);
    const Packet ax = pabs(x);
    const Packet tail = pcmp_le(pset1<Packet>(7.90531110763549805f), ax);
    if (!predux_any(tail)) return r;
    const Packet one = pset1<Packet>(1.0f);
    const Packet t = psub(one, pdiv(pset1<Packet>(2.0f), padd(pexp(padd(ax, ax)), one)));
    return pselect(tail, pselect(pcmp_lt(x, pzero(x)), pnegate(t), t), r);
  }
};

// Eigen 3.4's pexp_float (GenericPacketMathFunctions.h) operation for operation, but for its last
// step: 2^m * exp(r) by one multiply with 2^m built from its exponent bits, where Eigen's pldexp
// splits 2^m into four factors so as to reach every exponent (about half of pexp's operations).
// For x in [-87, 88], m lies in [-126, 127], where 2^m is a normal float and the one multiply
// rounds exactly as pldexp's last one does: the same bits as pexp, at 0.76x its time (`ruda-bench
// --suite kernels --backend eigen`, the exp row: ruda's exp against Eigen's on the same values).
template <class Packet>
Packet pexp_float_normal_range(const Packet& x_in) {
  using namespace Eigen::internal;
  const Packet one = pset1<Packet>(1.0f), half = pset1<Packet>(0.5f);
  const Packet x = pmax(pmin(x_in, pset1<Packet>(88.723f)), pset1<Packet>(-88.723f));
  const Packet m = pfloor(pmadd(x, pset1<Packet>(1.44269504088896341f), half));
  Packet r = pmadd(m, pset1<Packet>(-0.693359375f), x);
  r = pmadd(m, pset1<Packet>(2.12194440e-4f), r);
  const Packet r2 = pmul(r, r), r3 = pmul(r2, r);
  Packet y = pmadd(pset1<Packet>(1.9875691500E-4f), r, pset1<Packet>(1.3981999507E-3f));
  Packet y1 = pmadd(pset1<Packet>(4.1665795894E-2f), r, pset1<Packet>(1.6666665459E-1f));
  const Packet y2 = padd(r, one);
  y = pmadd(y, r, pset1<Packet>(8.3334519073E-3f));
  y1 = pmadd(y1, r, pset1<Packet>(5.0000001201E-1f));
  y = pmadd(y, r3, y1);
  y = pmadd(y, r2, y2);
  return pmax(pldexp_fast_impl<Packet>::run(y, m), x_in);
}

// exp(x) for every x, Eigen's pexp where it does not clamp: below kLow, exp(x + k) * exp(-k).
// The shift k is an integer, so x + k is exact (x's spacing there is no finer than the sum's); the
// only roundings are pexp's, the constant exp(-k)'s (half an ulp) and the product's, which is the
// single rounding into the subnormal range: 2 ulp at most where a multiple of ln 2 as the shift
// (itself rounded, then added to x with a rounding) lost up to 39 ulp in f64.
struct ExpWithoutClamp {
  template <class Packet>
  Packet operator()(const Packet& x) const {
    using namespace Eigen::internal;
    using S = typename unpacket_traits<Packet>::type;
    constexpr bool f32 = std::is_same_v<S, float>;
    // Eigen's clamp is at -88.723 (f32) / -709.784 (f64); shifted by k, the smallest x whose exp
    // is not 0 (-103.98 / -745.14) lands above it.
    constexpr S kLow = f32 ? S(-87) : S(-708);
    constexpr S kShift = f32 ? S(32) : S(64);
    constexpr S kScale = f32 ? S(1.2664165549094176e-14) : S(1.6038108905486379e-28);  // exp(-32), exp(-64)
    if constexpr (f32) {
      // Every lane in [kLow, 88] (a NaN is in no range): pexp's bits, sooner.
      const Packet in_range = pand(pcmp_le(pset1<Packet>(kLow), x), pcmp_le(x, pset1<Packet>(S(88))));
      if (!predux_any(pandnot(ptrue(x), in_range))) return pexp_float_normal_range(x);
    }
    const Packet low = pcmp_lt(x, pset1<Packet>(kLow));
    if (!predux_any(low)) return pexp(x);
    const Packet e = pexp(pselect(low, padd(x, pset1<Packet>(kShift)), x));
    return pselect(low, pmul(e, pset1<Packet>(kScale)), e);
  }
};

// The logistic function as PyTorch computes it, 1 / (1 + exp(-x)) with an exp of its own accuracy:
// a few ulp everywhere, 0 where exp(-x) overflows (x below -88.7 in f32, -709.8 in f64: the true
// values are subnormal), 1 at +inf, 0 at -inf. (Eigen's f32 logistic, a rational approximation
// with exp(x) below -9, was 2.3e-4 relative off at -8.6 and clamped.)
struct Logistic {
  template <class Packet>
  Packet operator()(const Packet& x) const {
    using namespace Eigen::internal;
    using S = typename unpacket_traits<Packet>::type;
    const Packet one = pset1<Packet>(S(1));
    return pdiv(one, padd(one, ExpWithoutClamp{}(pnegate(x))));
  }
};

// -x by flipping the sign bit, as IEEE negation is. Eigen 3.4's packet negation (pnegate) is
// 0 - x, which makes -(0) +0: neg of a zero tensor was +0 in full packets and -0 only in a range's
// scalar tail (PyTorch's neg(0) is -0).
struct SignFlip {
  template <class Packet>
  Packet operator()(const Packet& x) const {
    using namespace Eigen::internal;
    using S = typename unpacket_traits<Packet>::type;
    return pxor(x, pset1<Packet>(S(-0.0)));
  }
};

// An approximation as an Eigen unary functor. The scalar form runs the packet code on a broadcast
// value and takes one lane, so that a value rounds the same whether it lands in a packet or in a
// range's scalar tail (which depends on the chunking, and so on the thread count).
template <class Approximation, class Scalar = float>
struct PacketFunction {
  Scalar operator()(Scalar x) const {
    using Packet = typename Eigen::internal::packet_traits<Scalar>::type;
    return Eigen::internal::pfirst(Approximation{}(Eigen::internal::pset1<Packet>(x)));
  }
  template <class Packet>
  Packet packetOp(const Packet& x) const {
    return Approximation{}(x);
  }
};

}  // namespace ruda::ops::detail

// generic_fast_erf_float and generic_fast_tanh_float are Eigen 3.4's internal API (Debian's
// libeigen3-dev); another Eigen may rename them, which this check makes a build error to look at.
static_assert(EIGEN_WORLD_VERSION == 3 && EIGEN_MAJOR_VERSION == 4, "vector_math.h uses Eigen 3.4 internals");

namespace Eigen::internal {
// The approximations use min, max, abs, multiply-add, division, exp and log on packets.
template <class Approximation>
struct functor_traits<ruda::ops::detail::PacketFunction<Approximation, float>> {
  enum {
    Cost = 30,
    PacketAccess = packet_traits<float>::HasDiv && packet_traits<float>::HasMin && packet_traits<float>::HasMax &&
                   packet_traits<float>::HasAbs && packet_traits<float>::HasExp && packet_traits<float>::HasLog
  };
};
// exp, log and the logistic use compares, selects, add, multiply and division beside pexp / plog.
template <class Approximation>
struct functor_traits<ruda::ops::detail::PacketFunction<Approximation, double>> {
  enum {
    Cost = 30,
    PacketAccess = packet_traits<double>::HasExp && packet_traits<double>::HasCmp && packet_traits<double>::HasDiv &&
                   packet_traits<double>::HasLog
  };
};
}  // namespace Eigen::internal

namespace ruda::ops {

template <class X>
auto vector_erf(const X& x) {
  if constexpr (std::is_same_v<typename X::Scalar, float>) {
    return x.unaryExpr(detail::PacketFunction<detail::ErfApproximation>{});
  } else {
    return x.erf();
  }
}

namespace detail {
// x with Approximation applied to each packet, for f32 and f64 arrays.
template <class Approximation, class X>
auto packet_map(const X& x) {
  using S = typename X::Scalar;
  static_assert(std::is_same_v<S, float> || std::is_same_v<S, double>, "ruda's vector functions: f32 or f64 arrays");
  return x.unaryExpr(PacketFunction<Approximation, S>{});
}
}  // namespace detail

template <class X>
auto vector_exp(const X& x) {
  return detail::packet_map<detail::ExpWithoutClamp>(x);
}

template <class X>
auto vector_neg(const X& x) {
  return detail::packet_map<detail::SignFlip>(x);
}

template <class X>
auto vector_log(const X& x) {
  return detail::packet_map<detail::LogWithSubnormals>(x);
}

template <class X>
auto vector_logistic(const X& x) {
  return detail::packet_map<detail::Logistic>(x);
}

template <class X>
auto vector_tanh(const X& x) {
  if constexpr (std::is_same_v<typename X::Scalar, float>) {
    return x.unaryExpr(detail::PacketFunction<detail::TanhApproximation>{});
  } else {
    return x.tanh();
  }
}

}  // namespace ruda::ops
