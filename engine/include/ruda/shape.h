// Tensor shapes: a list of non-negative extents, row-major.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace ruda {

/// The most dimensions a tensor may have. Kernels keep shapes in fixed arrays of this size.
inline constexpr int kMaxDims = 8;

using Shape = std::vector<std::int64_t>;

/// The number of elements; throws ShapeError (naming `op`) on a negative extent or on overflow.
/// In these helpers a null `op` is named "shape".
std::int64_t shape_numel(const Shape& shape, const char* op = "shape");
/// "[2, 3]"; "[]" for a scalar.
std::string to_string(const Shape& shape);

/// The broadcast of two shapes (numpy rules); throws ShapeError naming `op` and both shapes where
/// they do not broadcast or hold a negative extent.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

/// An axis in [-ndim, ndim) made non-negative; throws IndexError naming `op` otherwise, and
/// ShapeError for an ndim outside [0, kMaxDims].
int normalize_axis(std::int64_t axis, std::int64_t ndim, const char* op);

}  // namespace ruda
