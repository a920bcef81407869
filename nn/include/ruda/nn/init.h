// Seeded parameter initialization. Layers draw their seeds from a per-thread stream set by
// manual_seed, so the same construction order gives the same weights on every rank; draws are
// counter-based, so one rank can produce its own slice of a weight alone.
#pragma once

#include <cstdint>

#include <ruda/tensor.h>

namespace ruda::nn {

/// Restarts this thread's stream of initialization seeds.
void manual_seed(std::uint64_t seed);
/// The next initialization seed of this thread's stream.
std::uint64_t next_seed();

/// U(-bound, bound) with bound = 1/sqrt(fan_in): PyTorch's default for Linear weights and biases
/// (kaiming_uniform with a = sqrt(5)).
Tensor kaiming_uniform(const Shape& shape, std::int64_t fan_in, std::uint64_t seed, DType dtype = DType::f32);

}  // namespace ruda::nn
