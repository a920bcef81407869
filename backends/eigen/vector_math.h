// erf and tanh of Eigen array expressions, vectorized in f32.
//
// ruda compiles its Eigen kernels with EIGEN_FAST_MATH=0 (backends/CMakeLists.txt: Eigen's
// fast-math psqrt returns NaN for +inf). That switch also turns off Eigen's packet erf and tanh
// (HasErf and HasTanh follow EIGEN_FAST_MATH), so .erf() and .tanh() ran one value at a time:
// f32 erf ~2.8 ns a value and tanh ~10 ns under AVX2. Their packet forms are Eigen's own
// rational approximations (generic_fast_erf_float, generic_fast_tanh_float, a few ulp), applied
// here through a packet functor without the fast-math sqrt. f64 keeps Eigen's exact scalar erf
// and tanh. Private to the Eigen backend; op_descriptors.h declares the two functions.
#pragma once

#include <type_traits>

#include <Eigen/Core>
#include <unsupported/Eigen/SpecialFunctions>

#include "op_descriptors.h"

namespace ruda::ops::detail {

// Eigen 3.4's packet approximations, as functors over packets.
struct ErfApproximation {
  template <class Packet>
  Packet operator()(const Packet& x) const {
    return Eigen::internal::generic_fast_erf_float(x);
  }
};
struct TanhApproximation {
  template <class Packet>
  Packet operator()(const Packet& x) const {
    return Eigen::internal::generic_fast_tanh_float(x);
  }
};

// An approximation as an Eigen unary functor. The scalar form runs the packet code on a broadcast
// value and takes one lane, so that a value rounds the same whether it lands in a packet or in a
// range's scalar tail (which depends on the chunking, and so on the thread count).
template <class Approximation>
struct PacketFunction {
  float operator()(float x) const {
    using Packet = typename Eigen::internal::packet_traits<float>::type;
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
// The approximations use min, max, abs, multiply-add and division on packets.
template <class Approximation>
struct functor_traits<ruda::ops::detail::PacketFunction<Approximation>> {
  enum {
    Cost = 30,
    PacketAccess = packet_traits<float>::HasDiv && packet_traits<float>::HasMin && packet_traits<float>::HasMax &&
                   packet_traits<float>::HasAbs
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

template <class X>
auto vector_tanh(const X& x) {
  if constexpr (std::is_same_v<typename X::Scalar, float>) {
    return x.unaryExpr(detail::PacketFunction<detail::TanhApproximation>{});
  } else {
    return x.tanh();
  }
}

}  // namespace ruda::ops
