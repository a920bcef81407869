// The int8 wire format of a quantized all-gather (private to nn; GatherQuantization::int8).
//
// One rank's part of a bucket (its slices back to back, `part` elements) travels as i64 words, so
// that the gather is a plain all-gather of one buffer: first the int8 codes, 8 to a word, then the
// f32 scales of its blocks, 2 to a word. Each slice (a piece of the part, from its offset to the
// next) has blocks of its own, of kQuantizationBlock elements from the slice's start: a block
// shared by two parameters took its scale from the larger, and a bias next to its weight (or a
// norm's bias next to its gains) came back as zeros. The gathered buffer is every rank's words in
// rank order; unpacking writes every rank's part dequantized, side by side, as a non-quantized
// gather would have delivered them.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <ruda/nn/sharded.h>

namespace ruda::nn {

/// A rank's part: `part` elements, whose slices start at `offsets` (ascending, the first 0).
struct Int8Part {
  std::int64_t part = 0;
  std::vector<std::int64_t> offsets;
};
/// Words one rank's part takes.
std::int64_t int8_wire_words(const Int8Part& layout);
/// `part` (1-D, any float dtype, layout.part elements) as its wire words: an i64 tensor of
/// int8_wire_words(layout).
Tensor pack_int8(const Tensor& part, const Int8Part& layout);
/// Where a rank's slice held a NaN or an infinity: the rank and the element's offset in its part.
struct NonFinite {
  int rank = 0;
  std::int64_t offset = 0;
};
/// Every rank's part from the gathered words (world x int8_wire_words(layout)), dequantized into a
/// [world * part] tensor of `dtype`; the first non-finite block found, if any (its values are NaN).
Tensor unpack_int8(const Tensor& words, int world, const Int8Part& layout, DType dtype, std::optional<NonFinite>* bad);

}  // namespace ruda::nn
