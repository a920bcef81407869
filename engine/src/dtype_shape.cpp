#include <limits>
#include <sstream>

#include <ruda/backend.h>
#include <ruda/dtype.h>
#include <ruda/error.h>
#include <ruda/shape.h>

#include "op_descriptors.h"

namespace ruda {

std::string_view dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::f32:
      return "f32";
    case DType::f64:
      return "f64";
    case DType::f16:
      return "f16";
    case DType::bf16:
      return "bf16";
    case DType::i64:
      return "i64";
    case DType::boolean:
      return "bool";
  }
  return "?";
}

DType parse_dtype(std::string_view name) {
  for (DType d : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i64, DType::boolean}) {
    if (dtype_name(d) == name) return d;
  }
  fail<ArgumentError>("parse_dtype", "unknown dtype '", name, "' (expected f32, f64, f16, bf16, i64 or bool)");
}

namespace {
// The public helpers take the caller's op name as a C string: a null one reads as "shape".
const char* op_or_shape(const char* op) noexcept { return op ? op : "shape"; }
}  // namespace

std::int64_t shape_numel(const Shape& shape, const char* op) {
  op = op_or_shape(op);
  // `span`, the product of the extents with 0 counted as 1, is what contiguous strides and
  // flattened extents multiply to even when the shape holds no element: it must fit too.
  std::int64_t n = 1, span = 1;
  for (std::int64_t d : shape) {
    if (d < 0) fail<ShapeError>(op, "negative extent in shape ", shape);
    const std::int64_t e = d == 0 ? 1 : d;
    if (span > std::numeric_limits<std::int64_t>::max() / e) fail<ShapeError>(op, "shape ", shape, " overflows");
    span *= e;
    n = d == 0 ? 0 : n * d;  // n <= span: no overflow
  }
  return n;
}

std::string to_string(const Shape& shape) { return detail::concat(shape); }

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  op = op_or_shape(op);
  for (const Shape* s : {&a, &b}) {
    if (std::any_of(s->begin(), s->end(), [](std::int64_t d) { return d < 0; }))
      fail<ShapeError>(op, "negative extent in shape ", *s, " (broadcasting ", a, " and ", b, ")");
  }
  const std::size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const std::int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (da != db && da != 1 && db != 1) fail<ShapeError>(op, "shapes do not broadcast: ", a, " and ", b);
    out[i] = da == 1 ? db : da;
  }
  return out;
}

int normalize_axis(std::int64_t axis, std::int64_t ndim, const char* op) {
  op = op_or_shape(op);
  if (ndim < 0 || ndim > kMaxDims)
    fail<ShapeError>(op, "a tensor of ", ndim, " dimensions (at most ", kMaxDims, ") has no axis ", axis);
  if (axis < -ndim || axis >= ndim) {
    fail<IndexError>(op, "axis ", axis, " is out of range for a tensor with ", ndim,
                     ndim == 1 ? " dimension" : " dimensions");
  }
  return static_cast<int>(axis < 0 ? axis + ndim : axis);
}

std::string_view op_name(UnaryOp op) noexcept {
  try {
    return ops::unary_info(op).name;  // from the op's descriptor
  } catch (const ArgumentError&) {
    return "?";  // not an enumerator of UnaryOp
  }
}

std::string_view op_name(BinaryOp op) noexcept {
  switch (op) {
    case BinaryOp::add:
      return "add";
    case BinaryOp::sub:
      return "sub";
    case BinaryOp::mul:
      return "mul";
    case BinaryOp::div:
      return "div";
    case BinaryOp::pow:
      return "pow";
    case BinaryOp::maximum:
      return "maximum";
    case BinaryOp::minimum:
      return "minimum";
    case BinaryOp::eq:
      return "eq";
    case BinaryOp::ne:
      return "ne";
    case BinaryOp::lt:
      return "lt";
    case BinaryOp::le:
      return "le";
    case BinaryOp::gt:
      return "gt";
    case BinaryOp::ge:
      return "ge";
  }
  return "?";
}

std::string_view op_name(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::max:
      return "max";
    case ReduceOp::min:
      return "min";
    case ReduceOp::logsumexp:
      return "logsumexp";
    case ReduceOp::argmax:
      return "argmax";
    case ReduceOp::argmin:
      return "argmin";
  }
  return "?";
}

}  // namespace ruda
