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

inline float to_float(float16 value) noexcept {
  constexpr std::uint32_t shifted_exp = 0x7c00u << 13;
  std::uint32_t u = (std::uint32_t(value.bits) & 0x7fffu) << 13;
  const std::uint32_t exp = shifted_exp & u;
  u += (127u - 15u) << 23;
  float f;
  if (exp == shifted_exp) {  // inf or NaN
    u += (128u - 16u) << 23;
    std::memcpy(&f, &u, 4);
  } else if (exp == 0) {  // zero or subnormal: renormalize through a float subtraction
    u += 1u << 23;
    std::memcpy(&f, &u, 4);
    constexpr std::uint32_t magic_bits = 113u << 23;
    float magic;
    std::memcpy(&magic, &magic_bits, 4);
    f -= magic;
  } else {
    std::memcpy(&f, &u, 4);
  }
  std::uint32_t out;
  std::memcpy(&out, &f, 4);
  out |= (std::uint32_t(value.bits) & 0x8000u) << 16;
  std::memcpy(&f, &out, 4);
  return f;
}

/// Round to nearest, ties to even, with correct subnormals; overflow becomes infinity.
inline float16 to_float16(float value) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &value, 4);
  const std::uint32_t sign = u & 0x80000000u;
  u ^= sign;
  std::uint32_t out;
  if (u >= ((127u + 16u) << 23)) {  // at least 2^16: infinity, or NaN (made quiet)
    out = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (u < (113u << 23)) {  // below 2^-14: the result is subnormal or zero
    // Adding 0.5f puts the value's binary16-subnormal ulp (2^-24) at the float's last bit, so the
    // FPU's own round-to-nearest-even does the rounding.
    float f;
    std::memcpy(&f, &u, 4);
    f += 0.5f;
    std::uint32_t r;
    std::memcpy(&r, &f, 4);
    out = r - 0x3f000000u;
  } else {
    const std::uint32_t mantissa_odd = (u >> 13) & 1u;
    u += (std::uint32_t(15 - 127) << 23) + 0xfffu + mantissa_odd;
    out = u >> 13;
  }
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
