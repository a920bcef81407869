// 16-bit float conversions, bit-exact on edge values and against independent references.
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "helpers.h"

using namespace ruda;

namespace {
float bits_to_float(std::uint32_t u) { return std::bit_cast<float>(u); }
std::uint32_t float_bits(float f) { return std::bit_cast<std::uint32_t>(f); }

// Reference bf16 rounding by exhaustive comparison in double: the nearer of the two bf16 values
// around x, ties to the even one. Independent of the bit tricks under test.
std::uint16_t reference_bf16(float x) {
  if (std::isnan(x)) return 0;  // not used for NaN
  const std::uint32_t u = float_bits(x);
  const std::uint16_t lo = static_cast<std::uint16_t>(u >> 16);
  const std::uint16_t hi = static_cast<std::uint16_t>(lo + 1);
  const double dx = x, dlo = to_float(bfloat16{lo});
  const double dhi = (hi & 0x7f80) == 0x7f80 && (lo & 0x7fff) == 0x7f7f ? std::copysign(std::ldexp(1.0, 128), dx)
                                                                        : static_cast<double>(to_float(bfloat16{hi}));
  if ((u & 0xffff) == 0) return lo;
  const double dl = std::abs(dx - dlo), dh = std::abs(dhi - dx);
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo & 1) ? hi : lo;
}
}  // namespace

TEST_CASE("dtype names, sizes and parsing") {
  CHECK(dtype_name(DType::f32) == "f32");
  CHECK(dtype_name(DType::bf16) == "bf16");
  CHECK(dtype_name(DType::boolean) == "bool");
  CHECK(dtype_size(DType::f64) == 8);
  CHECK(dtype_size(DType::f16) == 2);
  CHECK(parse_dtype("i64") == DType::i64);
  test::check_throws<ArgumentError>([] { parse_dtype("f8"); }, {"parse_dtype", "f8"});
}

TEST_CASE("bf16 rounding edge values") {
  auto to = [](std::uint32_t u) { return to_bfloat16(bits_to_float(u)).bits; };
  CHECK(to(0x3f800000u) == 0x3f80);  // 1
  CHECK(to(0x3f808000u) == 0x3f80);  // tie, to even (down)
  CHECK(to(0x3f818000u) == 0x3f82);  // tie, to even (up)
  CHECK(to(0x3f808001u) == 0x3f81);  // just above the tie
  CHECK(to(0x3f807fffu) == 0x3f80);  // just below the tie
  CHECK(to(0x7f7fffffu) == 0x7f80);  // the largest float rounds to infinity
  CHECK(to(0xff800000u) == 0xff80);  // -inf
  CHECK(to(0x7fc00000u) == 0x7fc0);  // quiet NaN
  CHECK(to(0x7f800001u) == 0x7fc0);  // signalling NaN becomes quiet, not infinity
  CHECK(to(0xffc00001u) == 0xffc0);  // NaN keeps its sign
  CHECK(to(0x00000001u) == 0x0000);  // tiny subnormal rounds to zero
  CHECK(to(0x00018000u) == 0x0002);  // subnormal tie to even
  CHECK(to(0x80000000u) == 0x8000);  // -0
  CHECK(float_bits(to_float(bfloat16{0x0001})) == 0x00010000u);
  CHECK(std::isnan(to_float(bfloat16{0x7fc1})));
}

TEST_CASE("bf16 rounding matches an exhaustive reference") {
  // Every 4099th float bit pattern (about a million, all exponents and signs), NaNs aside.
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 4099) {
    const float x = bits_to_float(static_cast<std::uint32_t>(u));
    if (std::isnan(x)) continue;
    const std::uint16_t got = to_bfloat16(x).bits, want = reference_bf16(x);
    if (got != want) {
      FAIL("bits " << std::hex << u << ": got " << got << ", expected " << want);
    }
  }
  // Every bf16 value round-trips through f32.
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const float f = to_float(bfloat16{static_cast<std::uint16_t>(b)});
    if (std::isnan(f)) continue;
    REQUIRE(to_bfloat16(f).bits == b);
  }
}

TEST_CASE("f16 rounding edge values") {
  auto to = [](float f) { return to_float16(f).bits; };
  CHECK(to(1.0f) == 0x3c00);
  CHECK(to(65504.0f) == 0x7bff);                          // largest finite
  CHECK(to(65519.996f) == 0x7bff);                        // below the tie with infinity
  CHECK(to(65520.0f) == 0x7c00);                          // the tie rounds to even: infinity
  CHECK(to(std::ldexp(1.0f, -24)) == 0x0001);             // smallest subnormal
  CHECK(to(std::ldexp(1.0f, -25)) == 0x0000);             // tie between 0 and the smallest subnormal: even
  CHECK(to(3 * std::ldexp(1.0f, -25)) == 0x0002);         // tie between 1 and 2 ulps: even
  CHECK(to(std::ldexp(1.0f, -14)) == 0x0400);             // smallest normal
  CHECK(to(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);      // tie to even (down)
  CHECK(to(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3c02);  // tie to even (up)
  CHECK(to(-0.0f) == 0x8000);
  CHECK(to(-std::numeric_limits<float>::infinity()) == 0xfc00);
  CHECK(to(std::numeric_limits<float>::quiet_NaN()) == 0x7e00);
  CHECK(to_float(float16{0x0001}) == std::ldexp(1.0f, -24));
  CHECK(to_float(float16{0x03ff}) == 1023 * std::ldexp(1.0f, -24));
  CHECK(std::isinf(to_float(float16{0x7c00})));
  CHECK(std::isnan(to_float(float16{0x7e00})));
  CHECK(std::signbit(to_float(float16{0x8000})));
}

TEST_CASE("f16 rounding matches the compiler's _Float16") {
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 4099) {
    const float x = bits_to_float(static_cast<std::uint32_t>(u));
    if (std::isnan(x)) continue;
    const _Float16 ref = static_cast<_Float16>(x);
    std::uint16_t want;
    std::memcpy(&want, &ref, 2);
    const std::uint16_t got = to_float16(x).bits;
    if (got != want) FAIL("bits " << std::hex << u << ": got " << got << ", expected " << want);
  }
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    _Float16 ref;
    const std::uint16_t bits = static_cast<std::uint16_t>(h);
    std::memcpy(&ref, &bits, 2);
    const float want = static_cast<float>(ref), got = to_float(float16{bits});
    if (std::isnan(want)) {
      REQUIRE(std::isnan(got));
    } else {
      REQUIRE(float_bits(got) == float_bits(want));
    }
  }
}

TEST_CASE("in-place arithmetic on bf16 and f16 rounds once, as the out-of-place forms and PyTorch do") {
  // mul_ rounded its factor to 16 bits first (bf16 0.5625.mul_(0.1) gave 0.0564 for 0.05615);
  // add_ rounded an f32 operand, or the operand times alpha, to 16 bits before adding.
  for (DType dtype : {DType::bf16, DType::f16}) {
    CAPTURE(dtype_name(dtype));
    std::vector<double> values;
    for (int k = 1; k <= 256; ++k) values.push_back(k / 64.0);
    const Tensor x = from_vector(values, {256}, Options(DType::f64)).to(dtype);
    const Tensor wide_x = x.to(DType::f32);
    Tensor m = x.clone();
    m.mul_(0.1);
    CHECK(m.to_vector<double>() == (x * 0.1).to_vector<double>());
    CHECK(m.to_vector<double>() == (wide_x * 0.1).to(dtype).to_vector<double>());
    const Tensor y32 = full({256}, 0.037, Options(DType::f32));
    Tensor a = x.clone();
    a.add_(y32);
    CHECK(a.to_vector<double>() == (wide_x + y32).to(dtype).to_vector<double>());
    const Tensor y16 = full({256}, 0.3, Options(dtype));
    Tensor s = x.clone();
    s.add_(y16, 0.1);
    CHECK(s.to_vector<double>() == (wide_x + y16.to(DType::f32) * 0.1).to(dtype).to_vector<double>());
  }
  // f32 with an f64 operand: once, from the f64 sum. 1 + (2^-24 + 2^-50) lies above the midpoint
  // between 1 and the next f32; the operand rounded to f32 first (2^-24) made the sum that
  // midpoint, which rounds to even: 1.
  Tensor f = full({1}, 1.0, Options(DType::f32));
  f.add_(full({1}, 0x1p-24 + 0x1p-50, Options(DType::f64)));
  CHECK(f.item() == 1.0 + 0x1p-23);
}

TEST_CASE("cast between tensors of every dtype") {
  const Tensor x = test::values({-2.5, -1, 0, 0.5, 1, 3.75}, {2, 3});
  for (DType d : {DType::f32, DType::f64, DType::f16, DType::bf16}) {
    CAPTURE(dtype_name(d));
    test::check_close(x.to(d).to(DType::f32), x);
  }
  test::check_close(x.to(DType::i64), {-2, -1, 0, 0, 1, 3}, {2, 3});  // truncation toward zero
  test::check_close(x.to(DType::boolean), {1, 1, 0, 1, 1, 1}, {2, 3});
  test::check_close(test::values({1, 0, 1}, {3}, DType::boolean).to(DType::f32), {1, 0, 1}, {3});
  test::check_close(test::values({7, -3}, {2}, DType::i64).to(DType::bf16), {7, -3}, {2});

  // Tensor casts round to nearest even like the scalar conversions.
  const Tensor ties = from_vector<float>({1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f}, {2});
  const auto b = ties.to(DType::bf16).to_vector<bfloat16>();
  CHECK(b[0].bits == 0x3f80);
  CHECK(b[1].bits == 0x3f82);
  // f64 -> bf16 must not round twice: just above a bf16 tie, but within half an f32 ulp of it.
  const Tensor above_tie = from_vector<double>({1.0 + 0x1p-8 + 0x1p-40, -(1.0 + 0x1p-8 + 0x1p-40)}, {2});
  const auto c = above_tie.to(DType::bf16).to_vector<bfloat16>();
  CHECK(c[0].bits == 0x3f81);
  CHECK(c[1].bits == 0xbf81);
  const auto h = from_vector<double>({1.0 + 0x1p-11 + 0x1p-40}, {1}).to(DType::f16).to_vector<float16>();
  CHECK(h[0].bits == 0x3c01);
}
