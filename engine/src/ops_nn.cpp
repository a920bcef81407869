// Neural-network primitives: embedding lookup, take_along_axis, softmax and log_softmax.
#include <algorithm>

#include "internal.h"

namespace ruda {

using autograd::GradMask;
using autograd::Saved;
using detail::make_tensor;
using detail::view_of;

namespace {

void check_indices(const char* op, const Tensor& indices, std::int64_t limit, const Shape& target) {
  if (indices.dtype() != DType::i64) {
    fail<DTypeError>(op, "indices must be i64, got ", dtype_name(indices.dtype()), " ", indices.shape());
  }
  const Tensor dense = detail::dense(indices);
  const auto* idx = dense.data<std::int64_t>();
  const std::int64_t n = indices.numel();
  if (n == 0) return;
  const auto [lo, hi] = std::minmax_element(idx, idx + n);
  if (*lo < 0 || *hi >= limit) {
    fail<IndexError>(op, "index ", *lo < 0 ? *lo : *hi, " is out of range [0, ", limit, ") for ", target);
  }
}

}  // namespace

Tensor embedding(const Tensor& table, const Tensor& indices) {
  detail::require_float("embedding", table);
  detail::require_defined("embedding", indices);
  if (table.ndim() != 2) fail<ShapeError>("embedding", "table must be [vocabulary, features], got ", table.shape());
  const std::int64_t vocabulary = table.shape()[0], features = table.shape()[1];
  check_indices("embedding", indices, vocabulary, table.shape());
  Shape out_shape = indices.shape();
  out_shape.push_back(features);
  detail::require_rank("embedding", out_shape);
  Tensor out = make_tensor(out_shape, table.dtype(), table.backend(), "embedding");
  const Tensor flat_idx = detail::dense(reshape(indices, {-1}));
  if (out.numel()) {
    table.backend().gather_rows(view_of(detail::dense(table)), view_of(flat_idx),
                                view_of(reshape(out, {-1, features})));
  }
  if (autograd::needs_grad(table)) {
    autograd::record(
        "embedding", out, {table}, {flat_idx}, [vocabulary, features](const Tensor& g, const Saved& s, GradMask) {
          Tensor gt = zeros({vocabulary, features}, Options(g.dtype(), &g.backend()));
          if (g.numel()) {
            g.backend().scatter_add_rows(view_of(reshape(g, {-1, features})), view_of(s[0].get()), view_of(gt));
          }
          return std::vector<Tensor>{gt};
        });
  }
  return out;
}

namespace {
// take_along_axis on the last axis of x viewed as [rows, cols], index [rows, picks] (its indices
// checked by the caller). `caller_index` is the index as the caller passed it: saved too, so that
// changing it in place before backward is caught under its own shape, not `index`'s (a transposed
// view or a flat position made from it).
Tensor take_along_rows(const Tensor& x, const Tensor& index, const Shape& out_shape, const Tensor& caller_index) {
  const std::int64_t cols = x.shape().back(), picks = index.shape().back();
  Tensor out = make_tensor(out_shape, x.dtype(), x.backend(), "take_along_axis");
  if (out.numel()) {
    x.backend().take_along_rows(view_of(detail::dense(reshape(x.detach(), {-1, cols}))),
                                view_of(detail::dense(reshape(index, {-1, picks}))),
                                view_of(reshape(out, {-1, picks})));
  }
  if (is_floating(x.dtype()) && autograd::needs_grad(x)) {
    autograd::record("take_along_axis", out, {x}, {caller_index, detail::dense(index)},
                     [shape = x.shape(), cols, picks](const Tensor& g, const Saved& s, GradMask) {
                       (void)s[0].get();  // the version check, first
                       Tensor gx = zeros(shape, Options(g.dtype(), &g.backend()));
                       if (g.numel()) {
                         g.backend().put_add_along_rows(view_of(reshape(g, {-1, picks})),
                                                        view_of(reshape(s[1].get(), {-1, picks})),
                                                        view_of(reshape(gx, {-1, cols})));
                       }
                       return std::vector<Tensor>{gx};
                     });
  }
  return out;
}
}  // namespace

Tensor take_along_axis(const Tensor& x, const Tensor& index, std::int64_t axis) {
  detail::require_defined("take_along_axis", x);
  detail::require_defined("take_along_axis", index);
  if (x.ndim() == 0) fail<ShapeError>("take_along_axis", "needs at least one dimension, got a scalar");
  const int a = normalize_axis(axis, x.ndim(), "take_along_axis");
  bool fits = index.ndim() == x.ndim();
  for (std::int64_t i = 0; fits && i < x.ndim(); ++i) fits = i == a || index.shape()[i] == x.shape()[i];
  if (!fits) {
    fail<ShapeError>("take_along_axis", "index ", index.shape(), " must match ", x.shape(), " off axis ", axis);
  }
  check_indices("take_along_axis", index, x.shape()[static_cast<std::size_t>(a)], x.shape());
  const int last = static_cast<int>(x.ndim()) - 1;
  if (a == last) return take_along_rows(x, index, index.shape(), index);
  const auto& dims = x.shape();
  std::int64_t outer = 1, inner = 1;
  for (int i = 0; i < a; ++i) outer *= dims[static_cast<std::size_t>(i)];
  for (int i = a + 1; i <= last; ++i) inner *= dims[static_cast<std::size_t>(i)];
  const std::int64_t n = dims[static_cast<std::size_t>(a)], picks = index.shape()[static_cast<std::size_t>(a)];
  if (picks * 2 >= n) {
    // Picking at least half as many as the axis holds (a permutation, an argsort's order), move
    // the axis last, take there and move it back, as all of them did: reading x in place, each
    // read is a cache and TLB miss where x is past the caches (consecutive elements come from
    // rows far apart: [256, 65536] on axis 0 took 1.3-2x as long), and the gradient of a leading
    // axis is one long row (4096 of [4096, 512] bf16: 30 ms against 20); the copies of x cost
    // about what the picks do.
    const Tensor moved = transpose(index, a, last);
    return transpose(take_along_rows(transpose(x, a, last), moved, moved.shape(), index), a, last).contiguous();
  }
  // x as [outer, n * inner] rows and each index as the flat position it picks in its row,
  // index * inner + i: the last axis's take on those, its result already in the caller's layout.
  // (Moving the axis last and back copies x, the index and the result, transposing: 3-4.6x
  // PyTorch's gather where the picks are few.) The row's take records the gradient, through the
  // reshape.
  Tensor flat = reshape(index, {outer, picks, inner});
  if (inner > 1) flat = flat * inner + arange(0, static_cast<double>(inner), 1, DType::i64).reshape({1, 1, inner});
  return take_along_rows(reshape(x, {outer, n * inner}), reshape(flat, {outer, picks * inner}), index.shape(), index);
}

namespace {
Tensor softmax_impl(const char* name, const Tensor& x, std::int64_t axis, bool log) {
  detail::require_float(name, x);
  if (x.ndim() == 0) {
    // A scalar along axis 0 (or -1) is a row of one (PyTorch's): softmax 1, log_softmax 0 (NaN
    // and infinities as such a row gives them), with its gradient.
    detail::check_scalar_axis(axis, name);
    return reshape(softmax_impl(name, reshape(x, {1}), 0, log), {});
  }
  const int a = normalize_axis(axis, x.ndim(), name);
  Tensor out = make_tensor(x.shape(), x.dtype(), x.backend(), name);
  if (out.numel()) x.backend().softmax(view_of(detail::dense(x)), view_of(out), a, log);
  if (autograd::needs_grad(x)) {
    autograd::record(name, out, {x}, {out}, [a, log](const Tensor& g, const Saved& s, GradMask) {
      Tensor gx = make_tensor(g.shape(), g.dtype(), g.backend(), "softmax backward");
      if (g.numel()) g.backend().softmax_backward(view_of(s[0].get()), view_of(g), view_of(gx), a, log);
      return std::vector<Tensor>{gx};
    });
  }
  return out;
}
}  // namespace

Tensor softmax(const Tensor& x, std::int64_t axis) { return softmax_impl("softmax", x, axis, false); }
Tensor log_softmax(const Tensor& x, std::int64_t axis) { return softmax_impl("log_softmax", x, axis, true); }

}  // namespace ruda
