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
}  // namespace

void manual_seed(std::uint64_t seed) {
  t_base = seed;
  t_count = 0;
}

std::uint64_t next_seed() { return mix(t_base ^ mix(t_count++)); }

Tensor kaiming_uniform(const Shape& shape, std::int64_t fan_in, std::uint64_t seed, DType dtype) {
  if (fan_in <= 0) fail<ArgumentError>("kaiming_uniform", "fan_in must be positive, got ", fan_in);
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  return uniform(shape, -bound, bound, seed, 0, dtype);
}

}  // namespace ruda::nn
