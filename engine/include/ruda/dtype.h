// Element types of ruda tensors and the 16-bit float formats (bit-exact, round-to-nearest-even).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace ruda {

/// Element type of a tensor. `boolean` is stored as one byte holding 0 or 1.
enum class DType : std::uint8_t { f32, f64, f16, bf16, i64, boolean };

/// Whether `dtype` is one of the enumerators (check_enum in ruda/error.h).
constexpr bool is_valid(DType dtype) noexcept {
  switch (dtype) {
    case DType::f32:
    case DType::f64:
    case DType::f16:
    case DType::bf16:
    case DType::i64:
    case DType::boolean:
      return true;
  }
  return false;
}

/// "f32", "f64", "f16", "bf16", "i64" or "bool".
std::string_view dtype_name(DType dtype) noexcept;
/// Parses a name as printed by dtype_name; throws ArgumentError for anything else.
DType parse_dtype(std::string_view name);

constexpr std::size_t dtype_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::f32:
      return 4;
    case DType::f64:
      return 8;
    case DType::f16:
    case DType::bf16:
      return 2;
    case DType::i64:
      return 8;
    case DType::boolean:
      return 1;
  }
  return 0;
}
constexpr bool is_floating(DType dtype) noexcept {
  return dtype == DType::f32 || dtype == DType::f64 || dtype == DType::f16 || dtype == DType::bf16;
}
constexpr bool is_16bit_float(DType dtype) noexcept { return dtype == DType::f16 || dtype == DType::bf16; }

/// bfloat16 storage: the upper half of an IEEE binary32.
struct bfloat16 {
  std::uint16_t bits = 0;
};
/// IEEE binary16 storage.
struct float16 {
  std::uint16_t bits = 0;
};

inline float to_float(bfloat16 value) noexcept {
  std::uint32_t u = std::uint32_t(value.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// Round to nearest, ties to even; NaN stays NaN (quiet, sign kept), infinities stay infinite.
inline bfloat16 to_bfloat16(float value) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &value, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bfloat16{std::uint16_t((u >> 16) | 0x0040u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bfloat16{std::uint16_t(u >> 16)};
}

// The two binary16 conversions compute every case and select one, without branches: written with
// them (as in F. Giesen's originals), no loop over f16 values vectorized, and f16 elementwise ops,
// casts and sums ran 6-42x PyTorch's time (which converts 8 values an instruction with F16C).
// Selects over candidates that each run floating-point arithmetic need -fno-trapping-math to be
// vectorized (ruda's build sets it); the results are the same either way.
inline float to_float(float16 value) noexcept {
  constexpr std::uint32_t shifted_exp = 0x7c00u << 13;
  std::uint32_t u = (std::uint32_t(value.bits) & 0x7fffu) << 13;
  const std::uint32_t exp = shifted_exp & u;
  u += (127u - 15u) << 23;
  // Normal, or infinity/NaN (the exponent moved to the top); zero or subnormal, renormalized
  // through a float subtraction.
  const std::uint32_t wide = exp == shifted_exp ? u + ((128u - 16u) << 23) : u;
  const std::uint32_t lifted = u + (1u << 23);
  constexpr std::uint32_t magic_bits = 113u << 23;
  float subnormal, magic;
  std::memcpy(&subnormal, &lifted, 4);
  std::memcpy(&magic, &magic_bits, 4);
  subnormal -= magic;
  std::uint32_t subnormal_bits;
  std::memcpy(&subnormal_bits, &subnormal, 4);
  std::uint32_t out = exp == 0 ? subnormal_bits : wide;
  out |= (std::uint32_t(value.bits) & 0x8000u) << 16;
  float f;
  std::memcpy(&f, &out, 4);
  return f;
}

/// Round to nearest, ties to even, with correct subnormals; overflow becomes infinity.
inline float16 to_float16(float value) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &value, 4);
  const std::uint32_t sign = u & 0x80000000u;
  u ^= sign;
  // At least 2^16: infinity, or NaN (made quiet).
  const std::uint32_t special = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  // Below 2^-14, subnormal or zero: adding 0.5f puts the value's binary16-subnormal ulp (2^-24) at
  // the float's last bit, so the FPU's own round-to-nearest-even does the rounding.
  float f;
  std::memcpy(&f, &u, 4);
  f += 0.5f;
  std::uint32_t r;
  std::memcpy(&r, &f, 4);
  const std::uint32_t subnormal = r - 0x3f000000u;
  const std::uint32_t normal = (u + (std::uint32_t(15 - 127) << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
  const std::uint32_t out = u >= ((127u + 16u) << 23) ? special : (u < (113u << 23) ? subnormal : normal);
  return float16{std::uint16_t(out | (sign >> 16))};
}

/// How a stored element becomes the value arithmetic runs on, and back: 16-bit floats compute in
/// f32 and round to nearest even on the way back; every other type computes in itself. The one
/// definition the backends' kernels and the collectives' reductions share.
template <class T>
struct ElementTraits {
  using Compute = T;
  static constexpr T load(T v) noexcept { return v; }
  static constexpr T store(T v) noexcept { return v; }
};
template <>
struct ElementTraits<bfloat16> {
  using Compute = float;
  static float load(bfloat16 v) noexcept { return to_float(v); }
  static bfloat16 store(float v) noexcept { return to_bfloat16(v); }
};
template <>
struct ElementTraits<float16> {
  using Compute = float;
  static float load(float16 v) noexcept { return to_float(v); }
  static float16 store(float v) noexcept { return to_float16(v); }
};

}  // namespace ruda
