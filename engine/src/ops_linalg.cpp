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

namespace {

struct LinearShape {
  std::int64_t in, out, rows;
  bool out_in;
};

LinearShape check_linear(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias,
                         WeightLayout layout) {
  check_enum(layout, op, "WeightLayout");
  detail::require_float(op, x);
  detail::require_float(op, weight);
  detail::require_same_dtype(op, x, weight);
  const bool out_in = layout == WeightLayout::out_in;
  if (weight.ndim() != 2 || x.ndim() < 1 || x.shape().back() != weight.shape()[out_in ? 1 : 0]) {
    fail<ShapeError>(op, "input features differ: x ", x.shape(), " @ weight ", weight.shape(),
                     out_in ? " (weight is [out, in])" : " (weight is [in, out])");
  }
  const std::int64_t in = weight.shape()[out_in ? 1 : 0], out_features = weight.shape()[out_in ? 0 : 1];
  if (bias.defined()) {
    detail::require_same_dtype(op, x, bias);
    if (bias.shape() != Shape{out_features}) {
      fail<ShapeError>(op, "bias ", bias.shape(), " does not match weight ", weight.shape(), " (expected [",
                       out_features, "])");
    }
  }
  return {in, out_features, in == 0 ? 0 : x.numel() / in, out_in};
}

// x @ weight + bias, then the epilogue, into a new tensor (no graph).
Tensor linear_forward(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias, const LinearShape& s,
                      GemmEpilogue epilogue) {
  Shape out_shape = x.shape();
  out_shape.back() = s.out;
  Tensor out = make_tensor(out_shape, x.dtype(), x.backend(), op);
  if (!out.numel()) return out;
  GemmDesc d;
  d.a_dtype = d.b_dtype = d.c_dtype = x.dtype();
  d.trans_b = s.out_in;
  d.m = s.rows;
  d.n = s.out;
  d.k = s.in;
  d.a = x.data_ptr();
  d.b = weight.data_ptr();
  d.c = out.data_ptr();
  d.bias = bias.defined() ? bias.data_ptr() : nullptr;
  d.epilogue = epilogue;
  if (s.in == 0) {
    // No product: the bias alone, and the epilogue on it (GELU(0) = 0).
    x.backend().fill(detail::view_of(out), 0.0);
    if (bias.defined()) out.add_(bias.detach());
    if (epilogue != GemmEpilogue::none) {
      const UnaryOp f = epilogue == GemmEpilogue::gelu_tanh ? UnaryOp::gelu_tanh : UnaryOp::gelu_erf;
      x.backend().unary(f, detail::view_of(out), detail::view_of(out));
    }
    return out;
  }
  x.backend().gemm(d);
  return out;
}

// The gradients of x @ weight + bias from the pre-activation's gradient g2 [rows, out]. x and the
// weight are fetched only where needed and dropped after: a saved weight that recomputes (a
// sharded one, gathered again) must not stay alive beside the weight gradient.
template <class GetX, class GetWeight>
std::vector<Tensor> linear_backward(const Tensor& g2, GetX&& x, GetWeight&& weight, const Shape& x_shape,
                                    const LinearShape& s, GradMask need) {
  Tensor grad_x, grad_w, grad_b;
  if (need[0]) grad_x = reshape(product("linear", g2, false, weight(), !s.out_in), x_shape);
  if (need[1]) {
    const Tensor x2 = reshape(x(), {-1, s.in});
    grad_w = s.out_in ? product("linear", g2, true, x2, false) : product("linear", x2, true, g2, false);
  }
  if (need[2]) grad_b = sum(g2, {0});
  return {grad_x, grad_w, grad_b};
}

}  // namespace

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias, WeightLayout layout) {
  const LinearShape s = check_linear("linear", x, weight, bias, layout);
  Tensor out = linear_forward("linear", x, weight, bias, s, GemmEpilogue::none);
  if (autograd::needs_grad(x, weight, bias)) {
    const bool gx = x.requires_grad(), gw = weight.requires_grad();
    autograd::record("linear", out, {x, weight, bias}, {gw ? x : Tensor(), gx ? weight : Tensor()},
                     [x_shape = x.shape(), s](const Tensor& g, const Saved& saved, GradMask need) {
                       return linear_backward(
                           reshape(g, {-1, s.out}), [&] { return saved[0].get(); }, [&] { return saved[1].get(); },
                           x_shape, s, need);
                     });
  }
  return out;
}

Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias, GeluApproximation approximation,
                   WeightLayout layout) {
  check_enum(approximation, "linear_gelu", "GeluApproximation");
  const LinearShape s = check_linear("linear_gelu", x, weight, bias, layout);
  const bool tanh = approximation == GeluApproximation::tanh;
  Tensor out =
      linear_forward("linear_gelu", x, weight, bias, s, tanh ? GemmEpilogue::gelu_tanh : GemmEpilogue::gelu_erf);
  if (autograd::needs_grad(x, weight, bias)) {
    // x, the weight and the bias, all three needed to recompute the pre-activation.
    autograd::record("linear_gelu", out, {x, weight, bias}, {x, weight, bias},
                     [x_shape = x.shape(), s, tanh](const Tensor& g, const Saved& saved, GradMask need) {
                       const Tensor xs = saved[0].get(), w = saved[1].get(), b = saved[2].get();
                       const Tensor h = linear_forward("linear_gelu backward", xs, w, b, s, GemmEpilogue::none);
                       Tensor gh = make_tensor(h.shape(), h.dtype(), h.backend(), "linear_gelu backward");
                       if (gh.numel()) {
                         const View none{};
                         h.backend().unary_backward(tanh ? UnaryOp::gelu_tanh : UnaryOp::gelu_erf, detail::view_of(h),
                                                    none, detail::view_of(g), detail::view_of(gh));
                       }
                       return linear_backward(
                           reshape(gh, {-1, s.out}), [&] { return xs; }, [&] { return w; }, x_shape, s, need);
                     });
  }
  return out;
}

}  // namespace ruda
