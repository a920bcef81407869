// Shape ops: reshape shares storage; permute, slice (unless contiguous), concat and expand copy.
#include <numeric>

#include "internal.h"

namespace ruda {

using autograd::GradMask;
using autograd::Saved;
using detail::make_tensor;
using detail::view_of;

namespace {

// A view of the block [start, start + length) along `axis` of a contiguous tensor.
View region(const Tensor& t, int axis, std::int64_t start, std::int64_t length) {
  View v = view_of(t);
  v.data = static_cast<char*>(v.data) + start * v.strides[axis] * static_cast<std::int64_t>(dtype_size(t.dtype()));
  v.shape[axis] = length;
  return v;
}

struct Bounds {
  int axis;
  std::int64_t start, end;
};

Bounds slice_bounds(const char* op, const Tensor& x, std::int64_t axis, std::int64_t start, std::int64_t end) {
  if (x.ndim() == 0) fail<ShapeError>(op, "cannot slice a scalar");
  const int a = normalize_axis(axis, x.ndim(), op);
  const std::int64_t n = x.shape()[a];
  const std::int64_t s = start < 0 ? start + n : start;
  const std::int64_t e = end < 0 ? end + n : end;
  if (s < 0 || e > n || s > e) {
    fail<IndexError>(op, "range [", start, ", ", end, ") is out of bounds for axis ", axis, " of ", x.shape());
  }
  return {a, s, e};
}

}  // namespace

Tensor reshape(const Tensor& x, Shape shape) {
  detail::require_defined("reshape", x);
  std::int64_t known = 1;
  int infer = -1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      if (infer >= 0) fail<ShapeError>("reshape", "more than one -1 in target shape ", shape);
      infer = static_cast<int>(i);
    } else if (shape[i] < 0) {
      fail<ShapeError>("reshape", "negative extent in target shape ", shape);
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || x.numel() % known != 0) {
      fail<ShapeError>("reshape", "cannot infer -1 when reshaping ", x.shape(), " to ", shape);
    }
    shape[infer] = x.numel() / known;
  }
  detail::require_rank("reshape", shape);
  if (shape_numel(shape, "reshape") != x.numel()) {
    fail<ShapeError>("reshape", "cannot reshape ", x.shape(), " (", x.numel(), " elements) to ", shape);
  }
  if (shape == x.shape()) return x;
  Tensor out = detail::alias(x, shape);
  if (autograd::needs_grad(x)) {
    autograd::record("reshape", out, {x}, {}, [from = x.shape()](const Tensor& g, const Saved&, GradMask) {
      return std::vector<Tensor>{reshape(g, from)};
    });
  }
  return out;
}

Tensor flatten(const Tensor& x, std::int64_t start_axis, std::int64_t end_axis) {
  detail::require_defined("flatten", x);
  if (x.ndim() == 0) return reshape(x, {1});
  const int s = normalize_axis(start_axis, x.ndim(), "flatten");
  const int e = normalize_axis(end_axis, x.ndim(), "flatten");
  if (s > e)
    fail<IndexError>("flatten", "start axis ", start_axis, " comes after end axis ", end_axis, " for ", x.shape());
  Shape shape(x.shape().begin(), x.shape().begin() + s);
  shape.push_back(
      std::accumulate(x.shape().begin() + s, x.shape().begin() + e + 1, std::int64_t{1}, std::multiplies<>()));
  shape.insert(shape.end(), x.shape().begin() + e + 1, x.shape().end());
  return reshape(x, shape);
}

Tensor squeeze(const Tensor& x, std::int64_t axis) {
  detail::require_defined("squeeze", x);
  const int a = normalize_axis(axis, x.ndim(), "squeeze");
  if (x.shape()[a] != 1) fail<ShapeError>("squeeze", "axis ", axis, " of ", x.shape(), " is not of extent 1");
  Shape shape = x.shape();
  shape.erase(shape.begin() + a);
  return reshape(x, shape);
}

Tensor unsqueeze(const Tensor& x, std::int64_t axis) {
  detail::require_defined("unsqueeze", x);
  const int a = normalize_axis(axis, x.ndim() + 1, "unsqueeze");
  Shape shape = x.shape();
  shape.insert(shape.begin() + a, 1);
  return reshape(x, shape);
}

Tensor permute(const Tensor& x, const Axes& order) {
  detail::require_defined("permute", x);
  const std::int64_t nd = x.ndim();
  if (static_cast<std::int64_t>(order.size()) != nd) {
    fail<ShapeError>("permute", "order ", order, " does not list the ", nd, " axes of ", x.shape());
  }
  std::vector<int> axes(order.size());
  std::vector<bool> used(order.size(), false);
  for (std::size_t i = 0; i < order.size(); ++i) {
    const int a = normalize_axis(order[i], nd, "permute");
    if (used[a]) fail<ShapeError>("permute", "order ", order, " repeats an axis of ", x.shape());
    used[a] = true;
    axes[i] = a;
  }
  bool identity = true;
  for (std::size_t i = 0; i < axes.size(); ++i) identity = identity && axes[i] == static_cast<int>(i);
  if (identity) return x;

  const View src = view_of(x);
  View permuted = src;
  Shape shape(order.size());
  for (std::size_t i = 0; i < axes.size(); ++i) {
    permuted.shape[i] = src.shape[axes[i]];
    permuted.strides[i] = src.strides[axes[i]];
    shape[i] = src.shape[axes[i]];
  }
  Tensor out = make_tensor(shape, x.dtype(), x.backend(), "permute");
  if (out.numel()) x.backend().copy(permuted, view_of(out));
  if (autograd::needs_grad(x)) {
    Axes inverse(axes.size());
    for (std::size_t i = 0; i < axes.size(); ++i) inverse[axes[i]] = static_cast<std::int64_t>(i);
    autograd::record("permute", out, {x}, {}, [inverse](const Tensor& g, const Saved&, GradMask) {
      return std::vector<Tensor>{permute(g, inverse)};
    });
  }
  return out;
}

Tensor transpose(const Tensor& x, std::int64_t axis0, std::int64_t axis1) {
  detail::require_defined("transpose", x);
  const int a = normalize_axis(axis0, x.ndim(), "transpose");
  const int b = normalize_axis(axis1, x.ndim(), "transpose");
  Axes order(static_cast<std::size_t>(x.ndim()));
  std::iota(order.begin(), order.end(), 0);
  std::swap(order[a], order[b]);
  return permute(x, order);
}

Tensor slice(const Tensor& x, std::int64_t axis, std::int64_t start, std::int64_t end) {
  detail::require_defined("slice", x);
  const Bounds b = slice_bounds("slice", x, axis, start, end);
  if (b.start == 0 && b.end == x.shape()[b.axis]) return x;
  Shape shape = x.shape();
  shape[b.axis] = b.end - b.start;
  // A slice whose leading axes are all 1 is one contiguous block: share the storage.
  bool block = true;
  for (int i = 0; i < b.axis; ++i) block = block && x.shape()[i] == 1;
  Tensor out;
  if (block) {
    std::int64_t inner = 1;
    for (std::size_t i = b.axis + 1; i < x.shape().size(); ++i) inner *= x.shape()[i];
    out = detail::alias(x, shape, b.start * inner);
  } else {
    out = make_tensor(shape, x.dtype(), x.backend(), "slice");
    if (out.numel()) x.backend().copy(region(x, b.axis, b.start, b.end - b.start), view_of(out));
  }
  if (autograd::needs_grad(x)) {
    autograd::record("slice", out, {x}, {}, [b, from = x.shape()](const Tensor& g, const Saved&, GradMask) {
      Tensor gx = zeros(from, Options(g.dtype(), &g.backend()));
      if (g.numel()) g.backend().copy(view_of(g), region(gx, b.axis, b.start, b.end - b.start));
      return std::vector<Tensor>{gx};
    });
  }
  return out;
}

Tensor slice_assign(const Tensor& x, std::int64_t axis, std::int64_t start, std::int64_t end, const Tensor& value) {
  detail::require_defined("slice_assign", x);
  detail::require_defined("slice_assign", value);
  detail::require_same_dtype("slice_assign", x, value);
  const Bounds b = slice_bounds("slice_assign", x, axis, start, end);
  Shape target = x.shape();
  target[b.axis] = b.end - b.start;
  if (value.shape() != target) {
    fail<ShapeError>("slice_assign", "value ", value.shape(), " does not fit range [", start, ", ", end, ") of axis ",
                     axis, " of ", x.shape(), " (expected ", target, ")");
  }
  Tensor out = x.detach().clone();
  if (value.numel()) x.backend().copy(view_of(value), region(out, b.axis, b.start, b.end - b.start));
  if (autograd::needs_grad(x, value)) {
    autograd::record("slice_assign", out, {x, value}, {}, [b](const Tensor& g, const Saved&, GradMask need) {
      Tensor gx, gv;
      if (need[0]) {
        gx = g.clone();
        if (b.end > b.start) g.backend().fill(region(gx, b.axis, b.start, b.end - b.start), 0.0);
      }
      if (need[1]) gv = slice(g, b.axis, b.start, b.end).clone();
      return std::vector<Tensor>{gx, gv};
    });
  }
  return out;
}

Tensor concat(const std::vector<Tensor>& tensors, std::int64_t axis) {
  if (tensors.empty()) fail<ArgumentError>("concat", "needs at least one tensor");
  for (const Tensor& t : tensors) detail::require_defined("concat", t);
  const Tensor& first = tensors.front();
  if (first.ndim() == 0) fail<ShapeError>("concat", "cannot concatenate scalars (use stack)");
  const int a = normalize_axis(axis, first.ndim(), "concat");
  Shape shape = first.shape();
  shape[a] = 0;
  for (const Tensor& t : tensors) {
    detail::require_same_dtype("concat", first, t);
    bool fits = t.ndim() == first.ndim();
    for (std::int64_t i = 0; fits && i < t.ndim(); ++i) fits = i == a || t.shape()[i] == first.shape()[i];
    if (!fits) fail<ShapeError>("concat", "shapes ", first.shape(), " and ", t.shape(), " differ off axis ", axis);
    shape[a] += t.shape()[a];
  }
  Tensor out = make_tensor(shape, first.dtype(), first.backend(), "concat");
  std::vector<std::int64_t> offsets;
  std::int64_t offset = 0;
  for (const Tensor& t : tensors) {
    offsets.push_back(offset);
    if (t.numel()) first.backend().copy(view_of(t), region(out, a, offset, t.shape()[a]));
    offset += t.shape()[a];
  }
  if (autograd::is_grad_enabled()) {
    bool any = false;
    for (const Tensor& t : tensors) any = any || t.requires_grad();
    if (any) {
      std::vector<std::int64_t> extents;
      for (const Tensor& t : tensors) extents.push_back(t.shape()[a]);
      autograd::record("concat", out, tensors, {}, [a, offsets, extents](const Tensor& g, const Saved&, GradMask need) {
        std::vector<Tensor> grads(offsets.size());
        for (std::size_t i = 0; i < offsets.size(); ++i) {
          if (need[i]) grads[i] = slice(g, a, offsets[i], offsets[i] + extents[i]).clone();
        }
        return grads;
      });
    }
  }
  return out;
}

Tensor stack(const std::vector<Tensor>& tensors, std::int64_t axis) {
  if (tensors.empty()) fail<ArgumentError>("stack", "needs at least one tensor");
  detail::require_defined("stack", tensors.front());
  const int a = normalize_axis(axis, tensors.front().ndim() + 1, "stack");
  std::vector<Tensor> expanded;
  expanded.reserve(tensors.size());
  for (const Tensor& t : tensors) {
    detail::require_defined("stack", t);
    if (t.shape() != tensors.front().shape()) {
      fail<ShapeError>("stack", "shapes differ: ", tensors.front().shape(), " and ", t.shape());
    }
    expanded.push_back(unsqueeze(t, a));
  }
  return concat(expanded, a);
}

Tensor expand(const Tensor& x, const Shape& shape) {
  detail::require_defined("expand", x);
  if (x.shape() == shape) return x;
  if (shape.size() < x.shape().size() || broadcast_shapes(x.shape(), shape, "expand") != shape) {
    fail<ShapeError>("expand", "cannot expand ", x.shape(), " to ", shape);
  }
  detail::require_rank("expand", shape);
  Tensor out = make_tensor(shape, x.dtype(), x.backend(), "expand");
  if (out.numel()) x.backend().copy(detail::broadcast_view(x, shape), view_of(out));
  if (autograd::needs_grad(x)) {
    autograd::record("expand", out, {x}, {}, [from = x.shape()](const Tensor& g, const Saved&, GradMask) {
      return std::vector<Tensor>{sum_to(g, from)};
    });
  }
  return out;
}

Tensor Tensor::reshape(Shape shape) const { return ruda::reshape(*this, std::move(shape)); }
Tensor Tensor::flatten(std::int64_t start_axis, std::int64_t end_axis) const {
  return ruda::flatten(*this, start_axis, end_axis);
}
Tensor Tensor::squeeze(std::int64_t axis) const { return ruda::squeeze(*this, axis); }
Tensor Tensor::unsqueeze(std::int64_t axis) const { return ruda::unsqueeze(*this, axis); }
Tensor Tensor::permute(const Axes& order) const { return ruda::permute(*this, order); }
Tensor Tensor::transpose(std::int64_t axis0, std::int64_t axis1) const { return ruda::transpose(*this, axis0, axis1); }
Tensor Tensor::slice(std::int64_t axis, std::int64_t start, std::int64_t end) const {
  return ruda::slice(*this, axis, start, end);
}
Tensor Tensor::expand(const Shape& shape) const { return ruda::expand(*this, shape); }

}  // namespace ruda
