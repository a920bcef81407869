// Counter-based random numbers (Philox 4x32-10): draw i of stream `seed` is a pure function of
// (seed, i), so any element range of a tensor can be generated alone and results do not depend on
// how work is split between threads or ranks.
#pragma once

#include <atomic>
#include <cstdint>

#include <ruda/tensor.h>

namespace ruda {

/// A stream and a position in it. Each call takes the next numel draws. The position moves
/// atomically: threads sharing a generator (a model's dropout run from two threads) each take
/// draws no other takes, in the order they arrive.
class Generator {
 public:
  explicit Generator(std::uint64_t seed = 0, std::uint64_t offset = 0) : seed_(seed), offset_(offset) {}
  std::uint64_t seed() const noexcept { return seed_; }
  std::uint64_t offset() const noexcept { return position().load(std::memory_order_relaxed); }
  void set_offset(std::uint64_t offset) noexcept { position().store(offset, std::memory_order_relaxed); }
  /// Reserves `count` draws and returns the offset of the first.
  std::uint64_t take(std::uint64_t count) noexcept { return position().fetch_add(count, std::memory_order_relaxed); }
  Tensor rand(const Shape& shape, Options options = {}) {
    return ruda::rand(shape, seed_, take(count(shape, "Generator::rand")), options);
  }
  Tensor randn(const Shape& shape, Options options = {}) {
    return ruda::randn(shape, seed_, take(count(shape, "Generator::randn")), options);
  }

 private:
  // A bad shape is refused here, before any draw is reserved, naming the call.
  static std::uint64_t count(const Shape& shape, const char* op) {
    return static_cast<std::uint64_t>(shape_numel(shape, op));
  }
  std::atomic_ref<std::uint64_t> position() const noexcept { return std::atomic_ref<std::uint64_t>(offset_); }
  std::uint64_t seed_;
  alignas(std::atomic_ref<std::uint64_t>::required_alignment) mutable std::uint64_t offset_;
};

namespace random {
/// The four 32-bit words of Philox4x32-10 for counter `counter` and key `seed`.
void philox4x32(std::uint64_t counter, std::uint64_t seed, std::uint32_t out[4]) noexcept;
/// Draw `index` of stream `seed` as a uniform float in [0, 1) (24 random bits).
float uniform_float(std::uint64_t seed, std::uint64_t index) noexcept;
/// uniform_float(seed, first + i) into out[i] for i in [0, count): the same bits, drawn eight
/// counters at a time on the CPU's vectors where the build has AVX2 (a mask's worth of draws for
/// a fraction of the calls' cost). The counter wraps past 2^64 as first + i does.
void uniform_floats(std::uint64_t seed, std::uint64_t first, std::int64_t count, float* out) noexcept;
/// Draw `index` as a uniform double in [0, 1) (53 random bits).
double uniform_double(std::uint64_t seed, std::uint64_t index) noexcept;
/// Draw `index` as a standard normal (Box-Muller on the draw's own words).
double normal_double(std::uint64_t seed, std::uint64_t index) noexcept;
}  // namespace random

}  // namespace ruda
