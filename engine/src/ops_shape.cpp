// Shape ops. permute, transpose, slice, expand, squeeze and unsqueeze return views that share
// storage; reshape does too where the strides allow, and copies otherwise; concat and stack copy.
#include <limits>
#include <numeric>

#include "internal.h"

namespace ruda {

using autograd::GradMask;
using autograd::Saved;
using detail::make_tensor;
using detail::view_of;

namespace {

// A view of the block [start, start + length) along `axis` of a tensor.
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
  if (s < 0 || e > n) {
    fail<IndexError>(op, "range [", start, ", ", end, ") is out of bounds for axis ", axis, " of ", x.shape());
  }
  if (s > e) {  // (inside the axis: "out of bounds" misled)
    fail<IndexError>(op, "range [", start, ", ", end, ") of axis ", axis, " of ", x.shape(),
                     " ends before it starts (PyTorch's x[", start, ":", end, "] is empty; ruda refuses it)");
  }
  return {a, s, e};
}

}  // namespace

namespace {

// The strides that give `to` the elements of a tensor of shape `from` and strides `strides` in
// the same row-major order, when some do (PyTorch's rule: each run of target axes must cover a
// run of source axes that is contiguous within itself). False when only a copy can.
bool view_strides(const Shape& from, const std::int64_t* strides, const Shape& to, std::int64_t* out) {
  if (shape_numel(from) == 0 || from.empty()) {
    detail::contiguous_strides(to, out);
    return true;
  }
  int view_d = static_cast<int>(to.size()) - 1;
  std::int64_t chunk_base_stride = strides[from.size() - 1];
  std::int64_t tensor_numel = 1, view_numel = 1;
  for (int d = static_cast<int>(from.size()) - 1; d >= 0; --d) {
    tensor_numel *= from[d];
    if (d == 0 || (from[d - 1] != 1 && strides[d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || to[view_d] == 1)) {
        out[view_d] = view_numel * chunk_base_stride;
        view_numel *= to[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return false;
      if (d > 0) {
        chunk_base_stride = strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  return view_d == -1;
}

Shape checked_target(const char* op, const Tensor& x, Shape shape) {
  std::int64_t known = 1;
  int infer = -1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      if (infer >= 0) fail<ShapeError>(op, "more than one -1 in target shape ", shape);
      infer = static_cast<int>(i);
    } else if (shape[i] < 0) {
      fail<ShapeError>(op, "negative extent in target shape ", shape);
    } else if (__builtin_mul_overflow(known, shape[i], &known)) {
      fail<ShapeError>(op, "target shape ", shape, " overflows (reshaping ", x.shape(), ")");
    }
  }
  if (infer >= 0) {
    if (known == 0 || x.numel() % known != 0) {
      fail<ShapeError>(op, "cannot infer -1 when reshaping ", x.shape(), " to ", shape);
    }
    shape[infer] = x.numel() / known;
  }
  detail::require_rank(op, shape);
  if (shape_numel(shape, op) != x.numel()) {
    fail<ShapeError>(op, "cannot reshape ", x.shape(), " (", x.numel(), " elements) to ", shape);
  }
  return shape;
}

// A view of x with another shape, strides and offset (relative to x's), whose gradient is
// `backward(g)`. Every view op ends here.
template <class Backward>
Tensor make_view(const char* op, const Tensor& x, const Shape& shape, const std::int64_t* strides,
                 std::int64_t extra_offset, Backward backward) {
  // A view allocates nothing, but its element count must still be one a tensor can hold.
  const std::int64_t numel = shape_numel(shape, op);
  if (numel > std::numeric_limits<std::int64_t>::max() / static_cast<std::int64_t>(dtype_size(x.dtype()))) {
    fail<ShapeError>(op, dtype_name(x.dtype()), " ", shape, " would hold more than 2^63 bytes");
  }
  Tensor out = detail::strided_alias(x, shape, strides, detail::impl_of(x)->offset + extra_offset);
  detail::impl_of(out)->no_grad_view_of_grad =
      detail::impl_of(x)->no_grad_view_of_grad || (x.requires_grad() && !autograd::is_grad_enabled());
  if (autograd::needs_grad(x)) {
    // A view's backward is a view op (or a copy/reduction that reads strides): it takes the
    // gradient as it comes, so a chain of views passes a permuted gradient on without copying.
    autograd::record(op, out, {x}, {},
                     [backward = std::move(backward)](const Tensor& g, const Saved&, GradMask) {
                       return std::vector<Tensor>{backward(g)};
                     },
                     {.strided_grad = true});
  }
  return out;
}

// A view op that changes nothing (reshape or view to the same shape, the identity permutation, a
// full slice, expand to the same shape, squeezing or transposing a scalar's own axis) still
// makes a new view, as PyTorch's do: x itself came back, so set_requires_grad(false) or
// zero_grad() on the "view" acted on x, and its grad() was x's.
Tensor unchanged_view(const char* op, const Tensor& x) {
  return make_view(op, x, x.shape(), detail::impl_of(x)->strides.data(), 0, [](const Tensor& g) { return g; });
}

// The view of x with a new shape (reshape, view); `strides` from view_strides.
Tensor reshaped_view(const char* op, const Tensor& x, const Shape& shape, const std::int64_t* strides) {
  return make_view(op, x, shape, strides, 0, [from = x.shape()](const Tensor& g) { return reshape(g, from); });
}

}  // namespace

Tensor reshape(const Tensor& x, Shape shape) {
  detail::require_defined("reshape", x);
  shape = checked_target("reshape", x, std::move(shape));
  if (shape == x.shape()) return unchanged_view("reshape", x);
  std::int64_t strides[kMaxDims];
  const auto& impl = *detail::impl_of(x);
  if (view_strides(impl.shape, impl.strides.data(), shape, strides)) return reshaped_view("reshape", x, shape, strides);
  // The strides do not allow a view (a transposed matrix flattened): copy, then view the copy.
  Tensor copy = x.contiguous();
  detail::contiguous_strides(shape, strides);
  return reshaped_view("reshape", copy, shape, strides);
}

Tensor view(const Tensor& x, Shape shape) {
  detail::require_defined("view", x);
  shape = checked_target("view", x, std::move(shape));
  if (shape == x.shape()) return unchanged_view("view", x);
  std::int64_t strides[kMaxDims];
  const auto& impl = *detail::impl_of(x);
  if (!view_strides(impl.shape, impl.strides.data(), shape, strides)) {
    fail<ShapeError>("view", "a ", x.shape(), " tensor with strides ", x.strides(), " cannot be viewed as ", shape,
                     " without copying (its elements are not evenly spaced across the merged axes); use reshape(), "
                     "which copies, or contiguous() first");
  }
  return reshaped_view("view", x, shape, strides);
}

Tensor flatten(const Tensor& x, std::int64_t start_axis, std::int64_t end_axis) {
  detail::require_defined("flatten", x);
  if (x.ndim() == 0) {
    // A scalar flattens to [1]; its only axes are 0 and -1, as PyTorch's.
    for (const std::int64_t axis : {start_axis, end_axis}) {
      if (axis != 0 && axis != -1) {
        fail<IndexError>("flatten", "axis ", axis, " is out of range for a scalar (0 or -1)");
      }
    }
    return reshape(x, {1});
  }
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

// A scalar's axis 0 or -1 names the scalar itself, as in PyTorch (whose dims wrap as for one
// dimension there) and as ruda's reductions take it.
namespace {
bool scalar_axis(const Tensor& x, std::int64_t axis) { return x.ndim() == 0 && (axis == 0 || axis == -1); }
}  // namespace

Tensor squeeze(const Tensor& x, std::int64_t axis) {
  detail::require_defined("squeeze", x);
  if (scalar_axis(x, axis)) return unchanged_view("squeeze", x);
  const int a = normalize_axis(axis, x.ndim(), "squeeze");
  if (x.shape()[a] != 1) fail<ShapeError>("squeeze", "axis ", axis, " of ", x.shape(), " is not of extent 1");
  Shape shape = x.shape();
  shape.erase(shape.begin() + a);
  return reshape(x, shape);
}

namespace {
// unsqueeze and stack add an axis: named here, not by the reshape that would refuse the result.
void require_room_for_an_axis(const char* op, const Tensor& x) {
  if (x.ndim() >= kMaxDims) {
    fail<ShapeError>(op, "a ", dtype_name(x.dtype()), " ", x.shape(), " tensor has ", x.ndim(),
                     " dimensions: one more exceeds the ", kMaxDims, " a tensor may have");
  }
}

// Where the new axis goes, in [-(ndim + 1), ndim]. Checked here rather than as an axis of the
// result (normalize_axis with ndim + 1), whose message named the result's rank as the input's.
int new_axis_position(const char* op, const Tensor& x, std::int64_t axis) {
  const std::int64_t nd = x.ndim();
  if (axis < -(nd + 1) || axis > nd) {
    fail<IndexError>(op, "axis ", axis, " is out of range [", -(nd + 1), ", ", nd, "] for a new axis of a ",
                     dtype_name(x.dtype()), " ", x.shape(), " tensor (", nd, nd == 1 ? " dimension)" : " dimensions)");
  }
  return static_cast<int>(axis < 0 ? axis + nd + 1 : axis);
}
}  // namespace

Tensor unsqueeze(const Tensor& x, std::int64_t axis) {
  detail::require_defined("unsqueeze", x);
  require_room_for_an_axis("unsqueeze", x);
  const int a = new_axis_position("unsqueeze", x, axis);
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
  if (identity) return unchanged_view("permute", x);

  const auto& impl = *detail::impl_of(x);
  Shape shape(order.size());
  std::int64_t strides[kMaxDims];
  for (std::size_t i = 0; i < axes.size(); ++i) {
    shape[i] = impl.shape[axes[i]];
    strides[i] = impl.strides[axes[i]];
  }
  Axes inverse(axes.size());
  for (std::size_t i = 0; i < axes.size(); ++i) inverse[axes[i]] = static_cast<std::int64_t>(i);
  return make_view("permute", x, shape, strides, 0, [inverse](const Tensor& g) { return permute(g, inverse); });
}

Tensor transpose(const Tensor& x, std::int64_t axis0, std::int64_t axis1) {
  detail::require_defined("transpose", x);
  if (scalar_axis(x, axis0) && scalar_axis(x, axis1)) return unchanged_view("transpose", x);
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
  if (b.start == 0 && b.end == x.shape()[b.axis]) return unchanged_view("slice", x);
  Shape shape = x.shape();
  shape[b.axis] = b.end - b.start;
  const auto& impl = *detail::impl_of(x);
  Tensor out = make_view("slice", x, shape, impl.strides.data(), b.start * impl.strides[b.axis],
                         [b, from = x.shape()](const Tensor& g) {
                           Tensor gx = zeros(from, Options(g.dtype(), &g.backend()));
                           if (g.numel()) g.backend().copy(view_of(g), region(gx, b.axis, b.start, b.end - b.start));
                           return gx;
                         });
  // Backward adds into the region of the input's gradient instead (autograd.cpp, add_into_region).
  if (const auto& node = detail::impl_of(out)->grad_fn) {
    node->input_region = autograd::Node::InputRegion{b.axis, b.start, b.end - b.start};
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
    if (__builtin_add_overflow(shape[a], t.shape()[a], &shape[a])) {
      fail<ShapeError>("concat", "the extents along axis ", axis, " of ", tensors.size(), " tensors shaped like ",
                       first.shape(), " add up past an int64");
    }
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
  require_room_for_an_axis("stack", tensors.front());
  const int a = new_axis_position("stack", tensors.front(), axis);
  std::vector<Tensor> expanded;
  expanded.reserve(tensors.size());
  for (const Tensor& t : tensors) {
    detail::require_defined("stack", t);
    if (t.shape() != tensors.front().shape()) {
      fail<ShapeError>("stack", "shapes differ: ", tensors.front().shape(), " and ", t.shape());
    }
    if (t.dtype() != tensors.front().dtype()) {
      fail<DTypeError>("stack", "dtypes differ: ", dtype_name(tensors.front().dtype()), " ", tensors.front().shape(),
                       " and ", dtype_name(t.dtype()), " ", t.shape());
    }
    expanded.push_back(unsqueeze(t, a));
  }
  return concat(expanded, a);
}

Tensor expand(const Tensor& x, const Shape& shape) {
  detail::require_defined("expand", x);
  if (x.shape() == shape) return unchanged_view("expand", x);
  if (shape.size() < x.shape().size() || broadcast_shapes(x.shape(), shape, "expand") != shape) {
    fail<ShapeError>("expand", "cannot expand ", x.shape(), " to ", shape);
  }
  detail::require_rank("expand", shape);
  const View v = detail::broadcast_view(x, shape);  // stride 0 on the broadcast axes
  return make_view("expand", x, shape, v.strides.data(), 0,
                   [from = x.shape()](const Tensor& g) { return sum_to(g, from); });
}

Tensor Tensor::reshape(Shape shape) const { return ruda::reshape(*this, std::move(shape)); }
Tensor Tensor::view(Shape shape) const { return ruda::view(*this, std::move(shape)); }
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
