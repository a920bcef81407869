// The int8 wire format of a quantized all-gather (private to nn; GatherQuantization::int8).
//
// One rank's part of a bucket (its slices back to back, `part` elements) travels as i64 words, so
// that the gather is a plain all-gather of one buffer: first the int8 codes, 8 to a word, then the
// f32 scales of its blocks of kQuantizationBlock elements, 2 to a word. The gathered buffer is
// every rank's words in rank order; unpacking writes every rank's part dequantized, side by side,
// as a non-quantized gather would have delivered them.
#pragma once

#include <cstdint>
#include <optional>

#include <ruda/nn/sharded.h>

namespace ruda::nn {

/// Words one rank's part of `part` elements takes.
std::int64_t int8_wire_words(std::int64_t part);
/// `part` (1-D, any float dtype) as its wire words: an i64 tensor of int8_wire_words(numel).
Tensor pack_int8(const Tensor& part);
/// Where a rank's slice held a NaN or an infinity: the rank and the element's offset in its part.
struct NonFinite {
  int rank = 0;
  std::int64_t offset = 0;
};
/// Every rank's part from the gathered words (world x int8_wire_words(part)), dequantized into a
/// [world * part] tensor of `dtype`; the first non-finite block found, if any (its values are NaN).
Tensor unpack_int8(const Tensor& words, int world, std::int64_t part, DType dtype, std::optional<NonFinite>* bad);

}  // namespace ruda::nn
