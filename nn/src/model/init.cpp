#include <cmath>

#include <ruda/nn/init.h>

namespace ruda::nn {

namespace {
thread_local std::uint64_t t_base = 0;
thread_local std::uint64_t t_count = 0;

// SplitMix64: decorrelates consecutive seeds.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The elements [begin, end) of `shape` that `init` describes, as a tensor of `out_shape` (the
// range's [n] or the whole shape): the one place every kind is turned into values.
Tensor produce(const Initializer& init, const Shape& shape, std::int64_t begin, std::int64_t end,
               const Shape& out_shape, DType dtype) {
  check_enum(init.kind, "Initializer", "Initializer::Kind");
  const auto offset = init.offset + static_cast<std::uint64_t>(begin);
  switch (init.kind) {
    case Initializer::Kind::constant:
      return full(out_shape, init.a, dtype);
    case Initializer::Kind::uniform:
      return uniform(out_shape, init.a, init.b, init.seed, offset, dtype);
    case Initializer::Kind::normal:
      return normal(out_shape, init.a, init.b, init.seed, offset, dtype);
    case Initializer::Kind::by_index: {
      Tensor values = empty(out_shape, DType::f64);
      double* out = values.data<double>();
      for (std::int64_t i = begin; i < end; ++i) {
        out[i - begin] = init.by_index(i);
        // An integer tensor takes the values as from_values does (fractions truncate); a value
        // no i64 holds is refused, as full() refuses one (the cast made NaN 0 and saturated).
        if (dtype == DType::i64 && !(out[i - begin] >= -0x1p63 && out[i - begin] < 0x1p63)) {
          fail<DTypeError>("init::by_index", "element ", i, "'s value ", out[i - begin],
                           " is not an i64 value, for an i64 tensor of shape ", shape);
        }
      }
      return values.to(dtype);
    }
    case Initializer::Kind::whole: {
      Tensor all = init.whole(shape, dtype);
      if (!all.defined() || all.shape() != shape || all.dtype() != dtype) {
        fail<ShapeError>("init::whole", "the function must return ", dtype_name(dtype), " ", shape, ", got ",
                         all.defined() ? dtype_name(all.dtype()) : "an undefined tensor", " ",
                         all.defined() ? all.shape() : Shape{});
      }
      if (out_shape == shape) return all;
      return all.reshape({-1}).slice(0, begin, end).clone();
    }
  }
  fail<ArgumentError>("Initializer", "unknown kind ", static_cast<int>(init.kind));
}
}  // namespace

void manual_seed(std::uint64_t seed) {
  t_base = seed;
  t_count = 0;
}

std::uint64_t next_seed() { return mix(t_base ^ mix(t_count++)); }

Tensor Initializer::range(const Shape& shape, std::int64_t begin, std::int64_t end, DType dtype) const {
  const std::int64_t numel = shape_numel(shape, "Initializer::range");
  if (begin < 0 || begin > end || end > numel) {
    fail<IndexError>("Initializer::range", "elements [", begin, ", ", end, ") are outside ", shape);
  }
  return produce(*this, shape, begin, end, {end - begin}, dtype);
}

Tensor Initializer::make(const Shape& shape, DType dtype) const {
  return produce(*this, shape, 0, shape_numel(shape, "Initializer::make"), shape, dtype);
}

namespace init {
// Every field set by name (designated initializers would leave the functions unnamed, which -Wextra flags).
Initializer make(Initializer::Kind kind, double a = 0.0, double b = 0.0, std::uint64_t seed = 0) {
  Initializer init;
  init.kind = kind;
  init.a = a;
  init.b = b;
  init.seed = seed;
  return init;
}
Initializer constant(double value) {
  if (std::isnan(value)) fail<ArgumentError>("init::constant", "value is NaN");
  return make(Initializer::Kind::constant, value);
}
Initializer zeros() { return constant(0.0); }
Initializer ones() { return constant(1.0); }
Initializer uniform(double low, double high, std::uint64_t seed) {
  // Infinite bounds draw NaN or inf weights, as NaN bounds do.
  if (!std::isfinite(low) || !std::isfinite(high)) {
    fail<ArgumentError>("init::uniform", "bounds must be finite, got ", low, " and ", high);
  }
  if (!(low <= high)) fail<ArgumentError>("init::uniform", "low ", low, " exceeds high ", high);
  return make(Initializer::Kind::uniform, low, high, seed);
}
Initializer normal(double mean, double std, std::uint64_t seed) {
  if (!std::isfinite(mean)) fail<ArgumentError>("init::normal", "mean must be finite, got ", mean);
  if (!(std >= 0 && std::isfinite(std))) {
    fail<ArgumentError>("init::normal", "standard deviation must be finite and non-negative, got ", std);
  }
  return make(Initializer::Kind::normal, mean, std, seed);
}
Initializer kaiming_uniform(std::int64_t fan_in, std::uint64_t seed) {
  if (fan_in <= 0) fail<ArgumentError>("kaiming_uniform", "fan_in must be positive, got ", fan_in);
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  return uniform(-bound, bound, seed);
}
Initializer by_index(std::function<double(std::int64_t)> f) {
  if (!f) fail<ArgumentError>("init::by_index", "needs a function");
  Initializer init = make(Initializer::Kind::by_index);
  init.by_index = std::move(f);
  return init;
}
Initializer whole(std::function<Tensor(const Shape&, DType)> f) {
  if (!f) fail<ArgumentError>("init::whole", "needs a function");
  Initializer init = make(Initializer::Kind::whole);
  init.whole = std::move(f);
  return init;
}
}  // namespace init

Tensor kaiming_uniform(const Shape& shape, std::int64_t fan_in, std::uint64_t seed, DType dtype) {
  return init::kaiming_uniform(fan_in, seed).make(shape, dtype);
}

}  // namespace ruda::nn
