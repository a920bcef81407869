// Block-wise int8 quantization of gathered weights (ZeRO++'s qwZ) and its wire format.
#include "sharding/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <ruda/autograd.h>

namespace ruda::nn {

namespace {

void check_block(const char* op, std::int64_t block) {
  if (block < 1) fail<ArgumentError>(op, "the block must hold at least 1 element, got ", block);
}

// The codes and scales of n contiguous f32 values into caller buffers (whole blocks at a time).
void quantize(const float* x, std::int64_t n, std::int64_t block, std::int8_t* codes, float* scales) {
  for (std::int64_t b = 0, begin = 0; begin < n; ++b, begin += block) {
    const std::int64_t end = std::min(n, begin + block);
    float largest = 0;
    bool finite = true;
    for (std::int64_t i = begin; i < end; ++i) {
      const float a = std::fabs(x[i]);
      finite = finite && std::isfinite(a);
      largest = std::max(largest, a);
    }
    if (!finite) {
      // NaN scale; the codes mark which elements were not finite (1) so that the receivers can
      // name the parameter that holds them.
      scales[b] = std::nanf("");
      for (std::int64_t i = begin; i < end; ++i) codes[i] = std::isfinite(x[i]) ? 0 : 1;
      continue;
    }
    float scale = largest / 127.0f;
    // Near FLT_MAX, largest / 127 rounds up so that 127 * scale is infinite: a finite weight would
    // come back as inf. The next smaller scale keeps every code's value finite (the largest
    // element's code clamps to 127).
    while (!std::isfinite(127.0f * scale)) scale = std::nextafter(scale, 0.0f);
    // Among subnormals largest / 127 rounds to a coarse value, often below it: 190 x the smallest
    // subnormal got scale 1 (not 1.5) of it and came back as 127, 126 half-scales off. The next
    // larger scale until the largest element's code is at most 127.5 keeps every element within
    // scale / 2 (below ~1.8e-43 the quotient is 0 and this makes it the smallest subnormal).
    while (static_cast<double>(largest) > 127.5 * static_cast<double>(scale)) {
      scale = std::nextafter(scale, std::numeric_limits<float>::infinity());
    }
    scales[b] = scale;
    if (scale == 0) {  // a block of zeros (padding among them) stays exactly zero
      std::fill(codes + begin, codes + end, std::int8_t{0});
      continue;
    }
    for (std::int64_t i = begin; i < end; ++i) {
      const float q = std::nearbyint(x[i] / scale);
      codes[i] = static_cast<std::int8_t>(std::clamp(q, -127.0f, 127.0f));
    }
  }
}

void dequantize(const std::int8_t* codes, const float* scales, std::int64_t n, std::int64_t block, float* out) {
  for (std::int64_t b = 0, begin = 0; begin < n; ++b, begin += block) {
    const std::int64_t end = std::min(n, begin + block);
    const float scale = scales[b];
    for (std::int64_t i = begin; i < end; ++i) out[i] = static_cast<float>(codes[i]) * scale;
  }
}

// Rounded up without n + block - 1, which overflows for a block near INT64_MAX.
std::int64_t blocks_of(std::int64_t n, std::int64_t block) { return n / block + (n % block != 0 ? 1 : 0); }

Tensor as_f32(const Tensor& x) { return cast(x.reshape({-1}), DType::f32).contiguous(); }

// Calls f(begin, end, first_block) for each slice of a part: its elements [begin, end) and the
// index of its first block among the part's scales.
template <class F>
void for_each_slice(const Int8Part& layout, F&& f) {
  std::int64_t first_block = 0;
  for (std::size_t i = 0; i < layout.offsets.size(); ++i) {
    const std::int64_t begin = layout.offsets[i];
    const std::int64_t end = i + 1 < layout.offsets.size() ? layout.offsets[i + 1] : layout.part;
    f(begin, end, first_block);
    first_block += blocks_of(end - begin, kQuantizationBlock);
  }
}

std::int64_t scales_of(const Int8Part& layout) {
  std::int64_t blocks = 0;
  for_each_slice(layout, [&](std::int64_t begin, std::int64_t end, std::int64_t) {
    blocks += blocks_of(end - begin, kQuantizationBlock);
  });
  return blocks;
}

}  // namespace

Int8Blocks quantize_int8(const Tensor& x, std::int64_t block) {
  check_block("quantize_int8", block);
  if (!x.defined() || !is_floating(x.dtype())) {
    fail<DTypeError>("quantize_int8", "needs a float tensor, got ", x.defined() ? dtype_name(x.dtype()) : "none");
  }
  autograd::NoGradGuard no_grad;
  const Tensor values = as_f32(x);
  Int8Blocks out;
  out.codes.resize(static_cast<std::size_t>(values.numel()));
  out.scales.resize(static_cast<std::size_t>(blocks_of(values.numel(), block)));
  quantize(values.data<float>(), values.numel(), block, out.codes.data(), out.scales.data());
  return out;
}

Tensor dequantize_int8(const Int8Blocks& blocks, DType dtype, std::int64_t block) {
  check_block("dequantize_int8", block);
  check_enum<DTypeError>(dtype, "dequantize_int8", "dtype");  // (it read "cast: ..." further in)
  if (!is_floating(dtype)) {
    // Dequantized values are fractions of a scale: i64 truncated them and bool made every one 1.
    fail<DTypeError>("dequantize_int8", "needs a float dtype, got ", dtype_name(dtype));
  }
  const auto n = static_cast<std::int64_t>(blocks.codes.size());
  if (static_cast<std::int64_t>(blocks.scales.size()) != blocks_of(n, block)) {
    fail<ShapeError>("dequantize_int8", n, " codes in blocks of ", block, " need ", blocks_of(n, block),
                     " scales, got ", blocks.scales.size());
  }
  Tensor out = empty({n}, Options(DType::f32));
  dequantize(blocks.codes.data(), blocks.scales.data(), n, block, out.data<float>());
  return dtype == DType::f32 ? out : cast(out, dtype);
}

std::int64_t int8_wire_words(const Int8Part& layout) { return (layout.part + 7) / 8 + (scales_of(layout) + 1) / 2; }

Tensor pack_int8(const Tensor& part, const Int8Part& layout) {
  autograd::NoGradGuard no_grad;
  const Tensor values = as_f32(part);
  const std::int64_t n = values.numel();
  Tensor words = zeros({int8_wire_words(layout)}, Options(DType::i64));
  auto* base = reinterpret_cast<std::byte*>(words.data_ptr());
  auto* codes = reinterpret_cast<std::int8_t*>(base);
  auto* scales = reinterpret_cast<float*>(base + (n + 7) / 8 * 8);
  const float* x = values.data<float>();
  for_each_slice(layout, [&](std::int64_t begin, std::int64_t end, std::int64_t first_block) {
    quantize(x + begin, end - begin, kQuantizationBlock, codes + begin, scales + first_block);
  });
  return words;
}

Tensor unpack_int8(const Tensor& words, int world, const Int8Part& layout, DType dtype, std::optional<NonFinite>* bad) {
  const std::int64_t part = layout.part, per_rank = int8_wire_words(layout);
  if (words.numel() != per_rank * world) {
    fail<ShapeError>("gather (int8)", "expected ", per_rank * world, " words from ", world, " ranks, got ",
                     words.numel());
  }
  Tensor out = empty({world * part}, Options(DType::f32));
  const auto* all = reinterpret_cast<const std::byte*>(words.data_ptr());
  for (int r = 0; r < world; ++r) {
    const std::byte* mine = all + static_cast<std::int64_t>(r) * per_rank * 8;
    const auto* codes = reinterpret_cast<const std::int8_t*>(mine);
    const auto* scales = reinterpret_cast<const float*>(mine + (part + 7) / 8 * 8);
    float* into = out.data<float>() + r * part;
    for_each_slice(layout, [&](std::int64_t begin, std::int64_t end, std::int64_t first_block) {
      const std::int64_t n = end - begin;
      for (std::int64_t b = 0; bad && !*bad && b < blocks_of(n, kQuantizationBlock); ++b) {
        if (!std::isnan(scales[first_block + b])) continue;
        // The block's first element marked non-finite (its code 1), or its last.
        std::int64_t i = begin + b * kQuantizationBlock;
        const std::int64_t last = std::min(end, i + kQuantizationBlock) - 1;
        while (i < last && codes[i] == 0) ++i;
        *bad = NonFinite{r, i};
      }
      dequantize(codes + begin, scales + first_block, n, kQuantizationBlock, into + begin);
    });
  }
  return dtype == DType::f32 ? out : cast(out, dtype);
}

}  // namespace ruda::nn
