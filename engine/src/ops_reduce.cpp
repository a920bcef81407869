// Reductions over axes, and sum_to (the gradient of broadcasting).
#include <algorithm>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

#include "internal.h"

namespace ruda {

using autograd::GradMask;
using autograd::Saved;
using detail::make_tensor;
using detail::view_of;

namespace {

struct Reduction {
  std::vector<bool> reduced;  // per axis of x
  Shape kept;                 // x's shape with reduced axes as 1
  Shape out;                  // the result's shape (kept, or without the reduced axes)
  std::int64_t count = 1;     // elements folded into each result
};

Reduction plan(const char* op, const Tensor& x, const Axes& axes, bool keepdim) {
  const std::int64_t nd = x.ndim();
  Reduction r;
  r.reduced.assign(static_cast<std::size_t>(nd), axes.empty());
  bool scalar_axis = false;
  for (std::int64_t a : axes) {
    if (nd == 0) {  // a scalar reduces over axis 0 or -1 to itself, as in PyTorch (once)
      if (a != 0 && a != -1) fail<IndexError>(op, "axis ", a, " is out of range for a scalar (0 or -1 allowed)");
      if (scalar_axis) fail<IndexError>(op, "axis ", a, " is listed twice for a scalar");
      scalar_axis = true;
      continue;
    }
    const int axis = normalize_axis(a, nd, op);
    if (r.reduced[axis]) fail<IndexError>(op, "axis ", a, " is listed twice for shape ", x.shape());
    r.reduced[axis] = true;
  }
  for (std::int64_t i = 0; i < nd; ++i) {
    const std::int64_t extent = x.shape()[i];
    if (r.reduced[i]) {
      r.kept.push_back(1);
      r.count *= extent;
      if (keepdim) r.out.push_back(1);
    } else {
      r.kept.push_back(extent);
      r.out.push_back(extent);
    }
  }
  return r;
}

// The order of x's axes in memory (largest stride first) where x is a permutation of a dense
// block (a transpose or a permute of a contiguous tensor); none where it is contiguous already, or
// is not dense (a slice, an expanded axis). x.permute(order) is then contiguous.
std::optional<std::vector<std::int64_t>> memory_order(const Tensor& x) {
  if (x.is_contiguous() || x.ndim() < 2) return std::nullopt;
  std::vector<std::int64_t> order(static_cast<std::size_t>(x.ndim()));
  std::iota(order.begin(), order.end(), 0);
  const Shape& strides = x.strides();
  // Axes of extent 1 last (their strides say nothing); the rest by decreasing stride, ties kept.
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    const bool a_unit = x.shape()[a] == 1, b_unit = x.shape()[b] == 1;
    if (a_unit != b_unit) return b_unit;
    return strides[a] > strides[b];
  });
  const Tensor in_memory = x.permute(order);
  if (!in_memory.is_contiguous()) return std::nullopt;
  return order;
}

Tensor reduce_forward(ReduceOp op, const char* name, const Tensor& x, const Reduction& r, DType out_dtype) {
  Tensor out = make_tensor(r.kept, out_dtype, x.backend(), name);
  if (out.numel()) {
    if (x.numel() == 0) {
      // Over no elements a sum is 0 and a logsumexp -inf (log 0), as in PyTorch; a max, min or
      // arg-search has no answer.
      if (op != ReduceOp::sum && op != ReduceOp::logsumexp) {
        fail<ShapeError>(name, "cannot reduce an empty tensor ", x.shape());
      }
      x.backend().fill(view_of(out), op == ReduceOp::sum ? 0.0 : -std::numeric_limits<double>::infinity());
    } else if (const auto order = x.dtype() == DType::f64 ? std::nullopt : memory_order(x)) {
      // A permuted dense tensor is reduced as it lies in memory, over the same axes, and the
      // (smaller) result is permuted back: copied contiguous first, a transposed [4096, 4096] f32
      // sum took the copy's 6.8 ms and a 64 MB buffer beside the reduction's 2.5 ms. The sums run
      // in another order than over a contiguous copy (the reduced axis may be the outer one
      // now), so their last bits may differ from it, as PyTorch's do; max, min and the arg ops
      // are exact either way, but for which zero a tie of -0 and +0 gives. f64 keeps the copy:
      // its sums of a view equal those of a contiguous copy bit for bit (the dtype of gradchecks
      // and references, where that matters more than the time).
      Shape kept_in_memory;
      for (std::int64_t a : *order) kept_in_memory.push_back(r.kept[static_cast<std::size_t>(a)]);
      Tensor partial = make_tensor(kept_in_memory, out_dtype, x.backend(), name);
      x.backend().reduce(op, view_of(x.permute(*order)), view_of(partial));
      std::vector<std::int64_t> inverse(order->size());
      for (std::size_t i = 0; i < order->size(); ++i)
        inverse[static_cast<std::size_t>((*order)[i])] = static_cast<std::int64_t>(i);
      x.backend().copy(view_of(partial.permute(inverse)), view_of(out));
    } else {
      x.backend().reduce(op, view_of(detail::dense(x)), view_of(out));
    }
  }
  return r.out == r.kept ? out : detail::alias(out, r.out);
}

// The gradient g of a reduced result, spread back over x's shape.
Tensor spread(const Tensor& g, const Shape& kept, const Shape& x_shape) { return expand(reshape(g, kept), x_shape); }

}  // namespace

Tensor sum(const Tensor& x, const Axes& axes, bool keepdim) {
  detail::require_defined("sum", x);
  // A bool tensor's sum counts its true entries, as an i64 tensor (PyTorch's).
  if (x.dtype() == DType::boolean) return sum(cast(x, DType::i64), axes, keepdim);
  const Reduction r = plan("sum", x, axes, keepdim);
  Tensor out = reduce_forward(ReduceOp::sum, "sum", x, r, x.dtype());
  if (autograd::needs_grad(x)) {
    autograd::record("sum", out, {x}, {}, [kept = r.kept, shape = x.shape()](const Tensor& g, const Saved&, GradMask) {
      return std::vector<Tensor>{spread(g, kept, shape)};
    });
  }
  return out;
}

Tensor mean(const Tensor& x, const Axes& axes, bool keepdim) {
  detail::require_float("mean", x);
  const Reduction r = plan("mean", x, axes, keepdim);
  // Over zero elements the mean is 0 / 0, NaN, as in PyTorch (an all-empty batch's loss).
  // 16-bit values are summed and divided in f32 and rounded once: an f16 sum or count past 65504
  // is infinite (a mean of 70000 halves read 0), and a bf16 one rounds twice.
  if (is_16bit_float(x.dtype())) {
    return cast(sum(cast(x, DType::f32), axes, keepdim) / static_cast<double>(r.count), x.dtype());
  }
  return sum(x, axes, keepdim) / static_cast<double>(r.count);
}

namespace {
Tensor extremum(ReduceOp op, const char* name, const Tensor& x, const Axes& axes, bool keepdim) {
  detail::require_defined(name, x);
  if (x.dtype() == DType::boolean) fail<DTypeError>(name, "is not defined on bool tensor ", x.shape());
  const Reduction r = plan(name, x, axes, keepdim);
  Tensor out = reduce_forward(op, name, x, r, x.dtype());
  if (autograd::needs_grad(x)) {
    autograd::record(name, out, {x}, {x, out}, [kept = r.kept](const Tensor& g, const Saved& s, GradMask) {
      // The gradient goes to the extreme elements, split evenly between ties. A row whose extreme
      // is NaN matches no element (NaN != NaN), so its share is 0/0: the whole row's gradient is
      // NaN, which keeps the NaN visible instead of silently dropping that row's gradient.
      const Tensor xv = s[0].get();
      const Tensor hits = cast(eq(xv, reshape(s[1].get(), kept)), g.dtype());
      const Tensor share = hits / sum_to(hits, kept);
      return std::vector<Tensor>{share * reshape(g, kept)};
    });
  }
  return out;
}
}  // namespace

Tensor max(const Tensor& x, const Axes& axes, bool keepdim) { return extremum(ReduceOp::max, "max", x, axes, keepdim); }
Tensor min(const Tensor& x, const Axes& axes, bool keepdim) { return extremum(ReduceOp::min, "min", x, axes, keepdim); }

Tensor logsumexp(const Tensor& x, const Axes& axes, bool keepdim) {
  detail::require_float("logsumexp", x);
  const Reduction r = plan("logsumexp", x, axes, keepdim);
  Tensor out = reduce_forward(ReduceOp::logsumexp, "logsumexp", x, r, x.dtype());
  if (autograd::needs_grad(x)) {
    autograd::record("logsumexp", out, {x}, {x, out}, [kept = r.kept](const Tensor& g, const Saved& s, GradMask) {
      const Tensor soft = exp(s[0].get() - reshape(s[1].get(), kept));
      return std::vector<Tensor>{soft * reshape(g, kept)};
    });
  }
  return out;
}

namespace {
Tensor arg_extremum(ReduceOp op, const char* name, const Tensor& x, std::int64_t axis, bool keepdim) {
  detail::require_defined(name, x);
  if (x.dtype() == DType::boolean) fail<DTypeError>(name, "is not defined on bool tensor ", x.shape());
  if (x.ndim() == 0) {
    // A scalar is its own only element along axis 0 (or -1): index 0, as PyTorch's.
    detail::check_scalar_axis(axis, name);
    return zeros({}, Options(DType::i64, &x.backend()));
  }
  const Reduction r = plan(name, x, {axis}, keepdim);
  if (r.count == 0) fail<ShapeError>(name, "cannot search an empty axis of ", x.shape());
  return reduce_forward(op, name, x, r, DType::i64);
}
}  // namespace

Tensor argmax(const Tensor& x, std::int64_t axis, bool keepdim) {
  return arg_extremum(ReduceOp::argmax, "argmax", x, axis, keepdim);
}
Tensor argmin(const Tensor& x, std::int64_t axis, bool keepdim) {
  return arg_extremum(ReduceOp::argmin, "argmin", x, axis, keepdim);
}

Tensor sum_to(const Tensor& x, const Shape& shape) {
  detail::require_defined("sum_to", x);
  if (x.shape() == shape) return x;
  const Shape& from = x.shape();
  if (shape.size() > from.size() || broadcast_shapes(shape, from, "sum_to") != from) {
    fail<ShapeError>("sum_to", "cannot sum ", from, " down to ", shape);
  }
  const std::size_t lead = from.size() - shape.size();
  Axes axes;
  for (std::size_t i = 0; i < from.size(); ++i) {
    if (i < lead || (shape[i - lead] == 1 && from[i] != 1)) axes.push_back(static_cast<std::int64_t>(i));
  }
  return reshape(sum(x, axes, /*keepdim=*/true), shape);
}

Tensor Tensor::sum(const Axes& axes, bool keepdim) const { return ruda::sum(*this, axes, keepdim); }
Tensor Tensor::mean(const Axes& axes, bool keepdim) const { return ruda::mean(*this, axes, keepdim); }
Tensor Tensor::max(const Axes& axes, bool keepdim) const { return ruda::max(*this, axes, keepdim); }
Tensor Tensor::min(const Axes& axes, bool keepdim) const { return ruda::min(*this, axes, keepdim); }
Tensor Tensor::argmax(std::int64_t axis, bool keepdim) const { return ruda::argmax(*this, axis, keepdim); }
Tensor Tensor::exp() const { return ruda::exp(*this); }
Tensor Tensor::log() const { return ruda::log(*this); }
Tensor Tensor::sqrt() const { return ruda::sqrt(*this); }
Tensor Tensor::abs() const { return ruda::abs(*this); }
Tensor Tensor::relu() const { return ruda::relu(*this); }
Tensor Tensor::tanh() const { return ruda::tanh(*this); }
Tensor Tensor::sigmoid() const { return ruda::sigmoid(*this); }
Tensor Tensor::matmul(const Tensor& other) const { return ruda::matmul(*this, other); }

}  // namespace ruda
