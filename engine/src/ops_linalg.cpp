// Matrix products: matmul with broadcast batch axes, and linear (x @ W + b) with the bias fused.
#include "internal.h"

namespace ruda {

using autograd::GradMask;
using autograd::Saved;
using detail::make_tensor;

namespace {

Shape batch_of(const Tensor& t) { return Shape(t.shape().begin(), t.shape().end() - 2); }

// op(a) @ op(b) over the last two axes, where op transposes when asked; batch axes broadcast.
// No autodiff: matmul and linear record their own nodes.
Tensor product(const char* op, const Tensor& a, bool ta, const Tensor& b, bool tb) {
  const std::int64_t ra = a.shape()[a.ndim() - 2], ca = a.shape()[a.ndim() - 1];
  const std::int64_t rb = b.shape()[b.ndim() - 2], cb = b.shape()[b.ndim() - 1];
  const std::int64_t m = ta ? ca : ra, k = ta ? ra : ca;
  const std::int64_t kb = tb ? cb : rb, n = tb ? rb : cb;
  if (k != kb) fail<ShapeError>(op, "inner dimensions differ: ", a.shape(), " @ ", b.shape());
  const Shape ba = batch_of(a), bb = batch_of(b);
  const Shape batch = ba == bb ? ba : broadcast_shapes(ba, bb, op);
  Shape out_shape = batch;
  out_shape.push_back(m);
  out_shape.push_back(n);
  detail::require_rank(op, out_shape);
  Tensor out = make_tensor(out_shape, a.dtype(), a.backend(), op);
  if (out.numel() == 0) return out;
  if (k == 0) {
    a.backend().fill(detail::view_of(out), 0.0);
    return out;
  }

  GemmDesc d;
  d.a_dtype = d.b_dtype = d.c_dtype = a.dtype();
  d.trans_a = ta;
  d.trans_b = tb;
  d.k = k;
  d.n = n;
  d.c = out.data_ptr();
  const std::int64_t batches_a = shape_numel(ba), batches_b = shape_numel(bb), batches = shape_numel(batch);
  Tensor ea = a, eb = b;
  if (batches_b == 1 && !ta) {
    // [..., m, k] @ [k, n]: the batch folds into the rows of one GEMM.
    d.m = m * batches_a;
    d.batch = 1;
  } else {
    if (batches_a != 1 && ba != batch) {
      Shape s = batch;
      s.insert(s.end(), {ra, ca});
      ea = expand(a.detach(), s);
    }
    if (batches_b != 1 && bb != batch) {
      Shape s = batch;
      s.insert(s.end(), {rb, cb});
      eb = expand(b.detach(), s);
    }
    d.m = m;
    d.batch = batches;
    d.batch_stride_a = batches_a == 1 ? 0 : ra * ca;
    d.batch_stride_b = batches_b == 1 ? 0 : rb * cb;
    d.batch_stride_c = m * n;
  }
  d.a = ea.data_ptr();
  d.b = eb.data_ptr();
  a.backend().gemm(d);
  return out;
}

void check_matmul_operands(const char* op, const Tensor& a, const Tensor& b) {
  detail::require_float(op, a);
  detail::require_float(op, b);
  detail::require_same_dtype(op, a, b);
  if (a.ndim() < 2 || b.ndim() < 2) {
    fail<ShapeError>(op, "needs operands of at least 2 dimensions, got ", a.shape(), " @ ", b.shape());
  }
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) {
  check_matmul_operands("matmul", a, b);
  Tensor out = product("matmul", a, false, b, false);
  if (autograd::needs_grad(a, b)) {
    const bool ga = a.requires_grad(), gb = b.requires_grad();
    autograd::record("matmul", out, {a, b}, {gb ? a : Tensor(), ga ? b : Tensor()},
                     [sa = a.shape(), sb = b.shape()](const Tensor& g, const Saved& s, GradMask need) {
                       Tensor grad_a, grad_b;
                       if (need[0]) grad_a = sum_to(product("matmul", g, false, s[1].get(), true), sa);
                       if (need[1]) {
                         const Tensor av = s[0].get();
                         if (sb.size() == 2) {
                           // A 2-D right operand was shared by every batch: one GEMM over all rows.
                           const std::int64_t k = sb[0], n = sb[1];
                           grad_b = product("matmul", reshape(av, {-1, k}), true, reshape(g, {-1, n}), false);
                         } else {
                           grad_b = sum_to(product("matmul", av, true, g, false), sb);
                         }
                       }
                       return std::vector<Tensor>{grad_a, grad_b};
                     });
  }
  return out;
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias, WeightLayout layout) {
  check_enum(layout, "linear", "WeightLayout");
  detail::require_float("linear", x);
  detail::require_float("linear", weight);
  detail::require_same_dtype("linear", x, weight);
  const bool out_in = layout == WeightLayout::out_in;
  if (weight.ndim() != 2 || x.ndim() < 1 || x.shape().back() != weight.shape()[out_in ? 1 : 0]) {
    fail<ShapeError>("linear", "input features differ: x ", x.shape(), " @ weight ", weight.shape(),
                     out_in ? " (weight is [out, in])" : " (weight is [in, out])");
  }
  const std::int64_t in = weight.shape()[out_in ? 1 : 0], out_features = weight.shape()[out_in ? 0 : 1];
  if (bias.defined()) {
    detail::require_same_dtype("linear", x, bias);
    if (bias.shape() != Shape{out_features}) {
      fail<ShapeError>("linear", "bias ", bias.shape(), " does not match weight ", weight.shape(), " (expected [",
                       out_features, "])");
    }
  }
  Shape out_shape = x.shape();
  out_shape.back() = out_features;
  Tensor out = make_tensor(out_shape, x.dtype(), x.backend(), "linear");
  const std::int64_t rows = in == 0 ? 0 : x.numel() / in;
  if (out.numel()) {
    if (in == 0) {
      x.backend().fill(detail::view_of(out), 0.0);
      if (bias.defined()) out.add_(bias.detach());
    } else {
      GemmDesc d;
      d.a_dtype = d.b_dtype = d.c_dtype = x.dtype();
      d.trans_b = out_in;
      d.m = rows;
      d.n = out_features;
      d.k = in;
      d.a = x.data_ptr();
      d.b = weight.data_ptr();
      d.c = out.data_ptr();
      d.bias = bias.defined() ? bias.data_ptr() : nullptr;
      x.backend().gemm(d);
    }
  }
  if (autograd::needs_grad(x, weight, bias)) {
    const bool gx = x.requires_grad(), gw = weight.requires_grad();
    autograd::record("linear", out, {x, weight, bias}, {gw ? x : Tensor(), gx ? weight : Tensor()},
                     [x_shape = x.shape(), in, out_features, out_in](const Tensor& g, const Saved& s, GradMask need) {
                       const Tensor g2 = reshape(g, {-1, out_features});
                       Tensor grad_x, grad_w, grad_b;
                       if (need[0]) grad_x = reshape(product("linear", g2, false, s[1].get(), !out_in), x_shape);
                       if (need[1]) {
                         const Tensor x2 = reshape(s[0].get(), {-1, in});
                         grad_w =
                             out_in ? product("linear", g2, true, x2, false) : product("linear", x2, true, g2, false);
                       }
                       if (need[2]) grad_b = sum(g2, {0});
                       return std::vector<Tensor>{grad_x, grad_w, grad_b};
                     });
  }
  return out;
}

}  // namespace ruda
