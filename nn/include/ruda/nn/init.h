// Seeded parameter initialization. Layers draw their seeds from a per-thread stream set by
// manual_seed, so the same construction order gives the same weights on every rank.
//
// A parameter's initial value is described by an Initializer (constant, uniform or normal draws at
// a seed, or a function of the element's index) rather than only computed: the draws are
// counter-based, so any element range can be produced alone. That is what lets a model be built
// under DeferredInit without allocating its parameters, and fully_shard materialize only this
// rank's slice, bitwise equal to the same slice of the dense initialization.
#pragma once

#include <cstdint>
#include <functional>

#include <ruda/tensor.h>

namespace ruda::nn {

/// Restarts this thread's stream of initialization seeds.
void manual_seed(std::uint64_t seed);
/// The next initialization seed of this thread's stream.
std::uint64_t next_seed();

/// How a parameter's initial values are made. Build one with the init:: functions below.
struct Initializer {
  enum class Kind {
    constant,  // every element = a
    uniform,   // U(a, b): draw offset + i of stream `seed` for flat element i
    normal,    // N(a, b^2), likewise
    by_index,  // element i = by_index(i): any range alone
    whole,     // whole(shape, dtype): only the full tensor at once (see init::whole)
  };
  Kind kind = Kind::constant;
  double a = 0.0, b = 0.0;
  std::uint64_t seed = 0, offset = 0;
  std::function<double(std::int64_t)> by_index;
  std::function<Tensor(const Shape&, DType)> whole;

  /// Whether `kind` is one of the enumerators (check_enum).
  friend constexpr bool is_valid(Kind value) noexcept {
    switch (value) {
      case Kind::constant:
      case Kind::uniform:
      case Kind::normal:
      case Kind::by_index:
      case Kind::whole:
        return true;
    }
    return false;
  }

  /// Whether range() can make a part without the whole tensor (every kind but `whole`).
  bool sliceable() const noexcept { return kind != Kind::whole; }
  /// Flat elements [begin, end) of a tensor of `shape` as a 1-D tensor of `dtype`; bitwise equal
  /// to reshape(make(shape, dtype), {-1}).slice(0, begin, end).
  Tensor range(const Shape& shape, std::int64_t begin, std::int64_t end, DType dtype) const;
  /// The whole tensor.
  Tensor make(const Shape& shape, DType dtype) const;
};

namespace init {
Initializer constant(double value);
Initializer zeros();
Initializer ones();
/// U(low, high) at `seed` (default: this thread's next initialization seed).
Initializer uniform(double low, double high, std::uint64_t seed = next_seed());
/// N(mean, std^2).
Initializer normal(double mean, double std, std::uint64_t seed = next_seed());
/// U(-bound, bound) with bound = 1/sqrt(fan_in): PyTorch's default for Linear weights and biases
/// (kaiming_uniform with a = sqrt(5)).
Initializer kaiming_uniform(std::int64_t fan_in, std::uint64_t seed = next_seed());
/// Element i (flat, row-major) = f(i). Sliceable: a rank computes only its own elements.
Initializer by_index(std::function<double(std::int64_t)> f);
/// An initializer that needs the whole tensor at once (an orthogonal matrix, a loaded array...).
/// Sharding such a parameter materializes its full value on every rank, for that one parameter
/// and only while its slice is cut: the documented exception to "no rank allocates a full
/// parameter". f must return a tensor of exactly the shape and dtype it is given.
Initializer whole(std::function<Tensor(const Shape&, DType)> f);
}  // namespace init

/// U(-bound, bound) with bound = 1/sqrt(fan_in), as a tensor.
Tensor kaiming_uniform(const Shape& shape, std::int64_t fan_in, std::uint64_t seed, DType dtype = DType::f32);

}  // namespace ruda::nn
