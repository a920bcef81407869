// Counter-based random tensors (Philox 4x32-10, Salmon et al., SC'11).
#include <algorithm>
#include <cmath>
#include <numbers>

#include <ruda/random.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "internal.h"

namespace ruda {
namespace random {

void philox4x32(std::uint64_t counter, std::uint64_t seed, std::uint32_t out[4]) noexcept {
  std::uint32_t c0 = static_cast<std::uint32_t>(counter), c1 = static_cast<std::uint32_t>(counter >> 32), c2 = 0,
                c3 = 0;
  std::uint32_t k0 = static_cast<std::uint32_t>(seed), k1 = static_cast<std::uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = std::uint64_t{0xD2511F53u} * c0;
    const std::uint64_t p1 = std::uint64_t{0xCD9E8D57u} * c2;
    const std::uint32_t n0 = static_cast<std::uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const std::uint32_t n2 = static_cast<std::uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<std::uint32_t>(p1);
    c3 = static_cast<std::uint32_t>(p0);
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

// uniform_float's value of a draw's first word: its top 24 bits as a fraction in [0, 1).
static float word_to_uniform(std::uint32_t word) noexcept { return static_cast<float>(word >> 8) * 0x1p-24f; }

#if defined(__AVX2__)
// philox4x32(first + l, seed)'s first word for l in [0, 8): the same rounds on eight counters in
// the 32-bit lanes of AVX2 vectors (each 32 x 32 -> 64-bit product as two even/odd-lane
// multiplies), so the bits are philox4x32's.
static void philox_eight_first_words(std::uint64_t first, std::uint64_t seed, std::uint32_t out[8]) noexcept {
  alignas(32) std::uint32_t lo[8], hi[8];
  for (int l = 0; l < 8; ++l) {
    const std::uint64_t counter = first + static_cast<std::uint64_t>(l);
    lo[l] = static_cast<std::uint32_t>(counter);
    hi[l] = static_cast<std::uint32_t>(counter >> 32);
  }
  __m256i c0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(lo));
  __m256i c1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(hi));
  __m256i c2 = _mm256_setzero_si256(), c3 = _mm256_setzero_si256();
  std::uint32_t k0 = static_cast<std::uint32_t>(seed), k1 = static_cast<std::uint32_t>(seed >> 32);
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u)),
                m1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  // The low and high 32 bits of m * c in every 32-bit lane.
  auto product = [](__m256i m, __m256i c, __m256i& low, __m256i& high) {
    const __m256i even = _mm256_mul_epu32(m, c);  // lanes 0, 2, 4, 6 as 64-bit products
    const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(m, 32), _mm256_srli_epi64(c, 32));
    low = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    high = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  };
  for (int round = 0; round < 10; ++round) {
    __m256i p0_lo, p0_hi, p1_lo, p1_hi;
    product(m0, c0, p0_lo, p0_hi);
    product(m1, c2, p1_lo, p1_hi);
    const __m256i n0 = _mm256_xor_si256(_mm256_xor_si256(p1_hi, c1), _mm256_set1_epi32(static_cast<int>(k0)));
    const __m256i n2 = _mm256_xor_si256(_mm256_xor_si256(p0_hi, c3), _mm256_set1_epi32(static_cast<int>(k1)));
    c1 = p1_lo;
    c3 = p0_lo;
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), c0);
}
#endif

// The first word of philox4x32(first + l, seed) for l in [0, count), count <= 8: a whole block at
// once where the build has AVX2, one at a time otherwise. The f32 draws (rand, dropout's masks)
// called the scalar function once a value, ~5 ns a value a thread, most of a dropout's time.
static void philox_first_words(std::uint64_t first, std::uint64_t seed, std::uint32_t out[8],
                               std::int64_t count) noexcept {
#if defined(__AVX2__)
  if (count == 8) return philox_eight_first_words(first, seed, out);
#endif
  for (std::int64_t l = 0; l < count; ++l) {
    std::uint32_t w[4];
    philox4x32(first + static_cast<std::uint64_t>(l), seed, w);
    out[l] = w[0];
  }
}

float uniform_float(std::uint64_t seed, std::uint64_t index) noexcept {
  std::uint32_t w[4];
  philox4x32(index, seed, w);
  return word_to_uniform(w[0]);
}

void uniform_floats(std::uint64_t seed, std::uint64_t first, std::int64_t count, float* out) noexcept {
  for (std::int64_t i = 0; i < count; i += 8) {
    const std::int64_t block = std::min<std::int64_t>(8, count - i);
    std::uint32_t words[8];
    philox_first_words(first + static_cast<std::uint64_t>(i), seed, words, block);
    for (std::int64_t l = 0; l < block; ++l) out[i + l] = word_to_uniform(words[l]);
  }
}

double uniform_double(std::uint64_t seed, std::uint64_t index) noexcept {
  std::uint32_t w[4];
  philox4x32(index, seed, w);
  return static_cast<double>(((std::uint64_t{w[0]} << 32) | w[1]) >> 11) * 0x1p-53;
}

double normal_double(std::uint64_t seed, std::uint64_t index) noexcept {
  std::uint32_t w[4];
  philox4x32(index, seed, w);
  // u1 in (0, 1], so the logarithm is finite.
  const double u1 = (static_cast<double>(((std::uint64_t{w[0]} << 32) | w[1]) >> 11) + 1.0) * 0x1p-53;
  const double u2 = static_cast<double>(((std::uint64_t{w[2]} << 32) | w[3]) >> 11) * 0x1p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

}  // namespace random

namespace {

enum class Draw { uniform, normal };

// The next value of a 16-bit float format (bf16 or f16 bits, both sign and magnitude) toward
// -inf and toward +inf, for finite values.
std::uint16_t step_down(std::uint16_t bits) {
  if (bits & 0x8000u) return static_cast<std::uint16_t>(bits + 1);
  return bits == 0 ? std::uint16_t{0x8001} : static_cast<std::uint16_t>(bits - 1);
}
std::uint16_t step_up(std::uint16_t bits) {
  if (!(bits & 0x8000u)) return static_cast<std::uint16_t>(bits + 1);
  return bits == 0x8000u ? std::uint16_t{0x0001} : static_cast<std::uint16_t>(bits - 1);
}

// Keeps uniform draws of a 16-bit float dtype inside [low, high): a draw computed in f32 and
// rounded to the dtype can round up to high itself (rand in bf16 gave 1.0 for 2020 of 1e6 draws;
// uniform(0.3, 0.7) can round to 0.703125) or below low. Such draws become the dtype's last value
// below high (first value at or above low). Where the dtype has no value in [low, high), the
// rounded draws stay as they are.
template <class H>
void keep_in_range(H* p, std::int64_t n, double low, double high, H (*to_h)(float)) {
  H top = to_h(static_cast<float>(high)), bottom = to_h(static_cast<float>(low));
  while (static_cast<double>(to_float(top)) >= high) top.bits = step_down(top.bits);
  while (static_cast<double>(to_float(bottom)) < low) bottom.bits = step_up(bottom.bits);
  const float hi = to_float(top), lo = to_float(bottom);
  if (!(low < high) || lo > hi) return;
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = to_float(p[i]);
    if (v > hi) p[i] = top;
    if (v < lo) p[i] = bottom;
  }
}

// Fills a fresh f32 or f64 tensor with draws offset .. offset + n of stream seed, then converts.
Tensor draw(const char* op, const Shape& shape, Draw kind, double a, double b, std::uint64_t seed, std::uint64_t offset,
            Options options) {
  check_enum<DTypeError>(options.dtype, op, "dtype");
  if (!is_floating(options.dtype)) {
    fail<DTypeError>(op, "draws floating-point values, not ", dtype_name(options.dtype), " (use randint for integers)");
  }
  Backend& backend = options.backend ? *options.backend : default_backend();
  const DType work = options.dtype == DType::f64 ? DType::f64 : DType::f32;
  Tensor t = detail::make_tensor(shape, work, backend, op);
  const std::int64_t n = t.numel();
  if (work == DType::f64) {
    double* out = t.data<double>();
    const double below_b = a < b ? std::nextafter(b, -INFINITY) : b;  // a + (b - a) u may round to b
#ifdef RUDA_HAVE_OPENMP
#pragma omp parallel for schedule(static) num_threads(num_threads()) if (n > 65536)
#endif
    for (std::int64_t i = 0; i < n; ++i) {
      const std::uint64_t idx = offset + static_cast<std::uint64_t>(i);
      out[i] = kind == Draw::uniform ? std::min(a + (b - a) * random::uniform_double(seed, idx), below_b)
                                     : a + b * random::normal_double(seed, idx);
    }
  } else {
    float* out = t.data<float>();
    // A 16-bit dtype's uniform draws take as many random bits as its significand holds (8 for
    // bf16, 11 for f16), as PyTorch's do: [0, 1) then holds only values the dtype has.
    const int bits = options.dtype == DType::bf16 ? 8 : options.dtype == DType::f16 ? 11 : 24;
    const float grid = std::ldexp(1.0f, 24 - bits), unit = std::ldexp(1.0f, -24);
    // f32's values within [a, b): a + (b - a) u with u < 1, rounded to f32, can reach b itself or
    // fall below an a that f32 rounds down.
    float below_b = static_cast<float>(b), from_a = static_cast<float>(a);
    while (a < b && static_cast<double>(below_b) >= b) below_b = std::nextafter(below_b, -INFINITY);
    while (a < b && static_cast<double>(from_a) < a) from_a = std::nextafter(from_a, INFINITY);
    const bool clamp = a < b && from_a <= below_b;
    if (kind == Draw::uniform) {
      // uniform_float's values, their first words drawn eight at a time (philox_first_words).
      const std::int64_t blocks = (n + 7) / 8;
#ifdef RUDA_HAVE_OPENMP
#pragma omp parallel for schedule(static) num_threads(num_threads()) if (n > 65536)
#endif
      for (std::int64_t k = 0; k < blocks; ++k) {
        const std::int64_t i = k * 8, count = std::min<std::int64_t>(8, n - i);
        const std::uint64_t idx = offset + static_cast<std::uint64_t>(i);
        std::uint32_t words[8];
        random::philox_first_words(idx, seed, words, count);
        for (std::int64_t l = 0; l < count; ++l) {
          const float u = std::floor(random::word_to_uniform(words[l]) / unit / grid) * grid * unit;
          const float v = static_cast<float>(a + (b - a) * u);
          out[i + l] = clamp ? std::clamp(v, from_a, below_b) : v;
        }
      }
    } else {
#ifdef RUDA_HAVE_OPENMP
#pragma omp parallel for schedule(static) num_threads(num_threads()) if (n > 65536)
#endif
      for (std::int64_t i = 0; i < n; ++i) {
        out[i] = static_cast<float>(a + b * random::normal_double(seed, offset + static_cast<std::uint64_t>(i)));
      }
    }
  }
  if (options.dtype != work) t = t.to(options.dtype);
  if (kind == Draw::uniform && options.dtype == DType::bf16) keep_in_range(t.data<bfloat16>(), n, a, b, to_bfloat16);
  if (kind == Draw::uniform && options.dtype == DType::f16) keep_in_range(t.data<float16>(), n, a, b, to_float16);
  if (options.requires_grad) t.set_requires_grad(true);
  return t;
}

}  // namespace

// One pass from the draws' words to the mask: rand's f32 draws, a comparison into a bool tensor
// and a cast to x's dtype were three passes and two tensors more (the mask of a [2048, 1024] f32
// dropout: 8 MB of draws and 2 MB of bools written and read again).
Tensor detail::dropout_mask(const Shape& shape, double p, std::uint64_t seed, std::uint64_t offset, DType dtype,
                            Backend& backend) {
  Tensor t = detail::make_tensor(shape, dtype, backend, "dropout");
  const std::int64_t n = t.numel();
  const auto threshold = static_cast<float>(p);  // as ge(draws, p) compared them: p rounded to f32
  // The loop over blocks of eight draws is rand's (draw() above), spelled out again: shared
  // through a callback (1570f3b), the callback's captured constants could alias the values it
  // stored and were loaded again for each one: this mask took 8.0 ms on [2048, 1024] f32 against
  // 5.0, and rand 10% more.
  auto fill = [&]<class T>(T* out, T one, T zero) {
    const std::int64_t blocks = (n + 7) / 8;
#ifdef RUDA_HAVE_OPENMP
#pragma omp parallel for schedule(static) num_threads(num_threads()) if (n > 65536)
#endif
    for (std::int64_t k = 0; k < blocks; ++k) {
      const std::int64_t i = k * 8, count = std::min<std::int64_t>(8, n - i);
      std::uint32_t words[8];
      random::philox_first_words(offset + static_cast<std::uint64_t>(i), seed, words, count);
      for (std::int64_t l = 0; l < count; ++l) out[i + l] = random::word_to_uniform(words[l]) >= threshold ? one : zero;
    }
  };
  switch (dtype) {
    case DType::f32:
      fill(t.data<float>(), 1.0f, 0.0f);
      break;
    case DType::f64:
      fill(t.data<double>(), 1.0, 0.0);
      break;
    case DType::bf16:
      fill(t.data<bfloat16>(), to_bfloat16(1.0f), to_bfloat16(0.0f));
      break;
    case DType::f16:
      fill(t.data<float16>(), to_float16(1.0f), to_float16(0.0f));
      break;
    case DType::i64:
    case DType::boolean:
      fail<DTypeError>("dropout", "the mask of a float tensor, not ", dtype_name(dtype), " ", shape);
  }
  return t;
}

Tensor rand(const Shape& shape, std::uint64_t seed, std::uint64_t offset, Options options) {
  return draw("rand", shape, Draw::uniform, 0.0, 1.0, seed, offset, options);
}
Tensor randn(const Shape& shape, std::uint64_t seed, std::uint64_t offset, Options options) {
  return draw("randn", shape, Draw::normal, 0.0, 1.0, seed, offset, options);
}
Tensor uniform(const Shape& shape, double low, double high, std::uint64_t seed, std::uint64_t offset, Options options) {
  // Infinite bounds, or finite ones whose difference overflows, draw NaN or inf for every element.
  if (!std::isfinite(low) || !std::isfinite(high) || !std::isfinite(high - low)) {
    fail<ArgumentError>("uniform", "bounds must be finite with a finite difference, got ", low, " and ", high);
  }
  if (!(low <= high)) fail<ArgumentError>("uniform", "low ", low, " exceeds high ", high);
  return draw("uniform", shape, Draw::uniform, low, high, seed, offset, options);
}
Tensor normal(const Shape& shape, double mean, double std, std::uint64_t seed, std::uint64_t offset, Options options) {
  if (!std::isfinite(mean)) fail<ArgumentError>("normal", "mean must be finite, got ", mean);
  if (!(std >= 0 && std::isfinite(std))) {
    fail<ArgumentError>("normal", "standard deviation must be finite and non-negative, got ", std);
  }
  return draw("normal", shape, Draw::normal, mean, std, seed, offset, options);
}

Tensor randint(const Shape& shape, std::int64_t low, std::int64_t high, std::uint64_t seed, std::uint64_t offset) {
  if (low >= high) fail<ArgumentError>("randint", "empty range [", low, ", ", high, ")");
  Tensor t = detail::make_tensor(shape, DType::i64, default_backend(), "randint");
  auto* out = t.data<std::int64_t>();
  // The span in uint64_t: high - low overflows int64_t for ranges wider than INT64_MAX.
  const std::uint64_t span = static_cast<std::uint64_t>(high) - static_cast<std::uint64_t>(low);
  // Up to 2^53 values, a draw scales the uniform double (53 random bits); wider spans take the
  // high half of 64 random bits times the span (span < 2^64: high - low of int64s fits): scaled
  // through a double, their draws had the low 11 bits always 0 (1 value in 2048 reachable).
  constexpr std::uint64_t kDoubleSpan = std::uint64_t{1} << 53;
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const std::uint64_t index = offset + static_cast<std::uint64_t>(i);
    std::uint64_t draw;
    if (span <= kDoubleSpan) {
      const double u = random::uniform_double(seed, index);
      // u < 1, so u * span < 2^64 and converts; the min guards rounding up to span itself.
      draw = std::min(span - 1, static_cast<std::uint64_t>(u * static_cast<double>(span)));
    } else {
      std::uint32_t w[4];
      random::philox4x32(index, seed, w);
      const std::uint64_t bits = (std::uint64_t{w[0]} << 32) | w[1];
      draw = static_cast<std::uint64_t>((static_cast<unsigned __int128>(bits) * span) >> 64);  // < span
    }
    out[i] = static_cast<std::int64_t>(static_cast<std::uint64_t>(low) + draw);
  }
  return t;
}

}  // namespace ruda
