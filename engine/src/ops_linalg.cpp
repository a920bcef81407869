// Matrix products: matmul with broadcast batch axes, and linear (x @ W + b) with the bias fused.
#include <algorithm>
#include <optional>

#include "internal.h"

namespace ruda {

using autograd::GradMask;
using autograd::Saved;
using detail::make_tensor;

namespace {

Shape batch_of(const Tensor& t) { return Shape(t.shape().begin(), t.shape().end() - 2); }

// t [..., n] as rows [product of the leading axes, n]; a view where t's strides allow. Spelled
// out, not reshape(t, {-1, n}): with n = 0 (a product whose inner or output size is 0) the -1
// cannot be inferred, and the backward of such a product failed where its forward had worked.
Tensor as_rows(const Tensor& t) {
  const Shape& shape = t.shape();
  return reshape(t, {shape_numel(Shape(shape.begin(), shape.end() - 1)), shape.back()});
}

// How a product reads an operand's last two axes in place: as a row-major matrix with row
// stride ld, or as the transpose of one (its second-to-last axis is the contiguous one).
struct MatrixRead {
  bool transposed = false;
  std::int64_t ld = 0;
};

std::optional<MatrixRead> read_in_place(const detail::TensorImpl& t) {
  const std::size_t nd = t.shape.size();
  const std::int64_t rows = t.shape[nd - 2], cols = t.shape[nd - 1];
  if (rows == 0 || cols == 0) return MatrixRead{false, std::max<std::int64_t>(cols, 1)};  // reads nothing
  const std::int64_t row_stride = rows == 1 ? cols : t.strides[nd - 2];
  const std::int64_t col_stride = cols == 1 ? 1 : t.strides[nd - 1];
  if (col_stride == 1 && row_stride >= cols && row_stride > 0) return MatrixRead{false, row_stride};
  // Column-major: the transpose of a row-major [cols, rows] matrix whose rows are col_stride apart.
  const std::int64_t transposed_ld = cols == 1 ? rows : col_stride;
  if ((rows == 1 || t.strides[nd - 2] == 1) && transposed_ld >= rows && transposed_ld > 0) {
    return MatrixRead{true, transposed_ld};
  }
  return std::nullopt;  // neither of the last two axes is contiguous: the caller copies
}

// One batch axis of the product with each operand's stride (0: that operand repeats).
struct BatchAxis {
  std::int64_t extent;
  std::int64_t stride[3];  // a, b, c
};

// op(a) @ op(b) over the last two axes, where op transposes when asked; batch axes broadcast.
// Operands whose last or second-to-last axis is contiguous are read in place through their
// strides (over up to two merged batch axes); others are copied first. No autodiff: matmul and
// linear record their own nodes.
Tensor product(const char* op, const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& bias = {},
               GemmEpilogue epilogue = GemmEpilogue::none) {
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
  // An empty product has nothing to read. Decided before any layout work: an empty tensor counts
  // as contiguous whatever its strides, so contiguous() would not normalize them and the
  // many-batch-axes path below would call itself on the same layout forever.
  if (shape_numel(out_shape, op) == 0) return make_tensor(out_shape, a.dtype(), a.backend(), op);
  if (k == 0) {
    // No product, and nothing to read (empty operands: the same reason as above, with a non-empty
    // output; [4, 3, 2, 5, 0] permuted @ [0, 7] recursed until the stack overflowed): the bias
    // alone (or zeros), and the epilogue on it (GELU(0) = 0).
    Tensor out = make_tensor(out_shape, a.dtype(), a.backend(), op);
    a.backend().fill(detail::view_of(out), 0.0);
    if (bias.defined()) out.add_(bias.detach());
    if (epilogue != GemmEpilogue::none) {
      const UnaryOp f = epilogue == GemmEpilogue::gelu_tanh ? UnaryOp::gelu_tanh : UnaryOp::gelu_erf;
      a.backend().unary(f, detail::view_of(out), detail::view_of(out));
    }
    return out;
  }

  Tensor ea = a, eb = b;
  std::optional<MatrixRead> read_a = read_in_place(*detail::impl_of(ea));
  if (!read_a) read_a = read_in_place(*detail::impl_of(ea = detail::dense(a)));
  std::optional<MatrixRead> read_b = read_in_place(*detail::impl_of(eb));
  if (!read_b) read_b = read_in_place(*detail::impl_of(eb = detail::dense(b)));
  if (!read_a || !read_b) {  // a contiguous matrix always reads in place
    fail<BackendError>(op, "internal error: no GEMM layout for ", a.shape(), " @ ", b.shape());
  }

  // The batch axes, extent-1 ones dropped and neighbours merged where all three operands step
  // evenly across them (a contiguous batch is one axis).
  const auto& ia = *detail::impl_of(ea);
  const auto& ib = *detail::impl_of(eb);
  std::int64_t c_strides[kMaxDims];
  detail::contiguous_strides(out_shape, c_strides);
  std::vector<BatchAxis> axes;
  const std::size_t nb = batch.size();
  auto stride_of = [&](const detail::TensorImpl& t, std::size_t axis) -> std::int64_t {
    const std::size_t lead = nb - (t.shape.size() - 2);
    if (axis < lead || t.shape[axis - lead] == 1) return 0;
    return t.strides[axis - lead];
  };
  for (std::size_t i = 0; i < nb; ++i) {
    if (batch[i] == 1) continue;
    const BatchAxis next{batch[i], {stride_of(ia, i), stride_of(ib, i), c_strides[i]}};
    if (!axes.empty()) {
      BatchAxis& last = axes.back();
      bool merge = true;
      for (int o = 0; o < 3; ++o) merge = merge && last.stride[o] == next.stride[o] * next.extent;
      if (merge) {
        last.extent *= next.extent;
        for (int o = 0; o < 3; ++o) last.stride[o] = next.stride[o];
        continue;
      }
    }
    axes.push_back(next);
  }
  if (axes.size() > 2) {
    // More than two batch axes survive the merge (several broadcasts, or a permuted batch):
    // give both operands the full batch, densely, which merges into one axis.
    auto full = [&](const Tensor& t, std::int64_t r, std::int64_t c) {
      Shape s = batch;
      s.insert(s.end(), {r, c});
      return expand(t.detach(), s).contiguous();
    };
    return product(op, full(a, ra, ca), ta, full(b, rb, cb), tb, bias, epilogue);
  }

  Tensor out = make_tensor(out_shape, a.dtype(), a.backend(), op);
  GemmDesc d;
  d.a_dtype = d.b_dtype = d.c_dtype = a.dtype();
  d.trans_a = ta != read_a->transposed;
  d.trans_b = tb != read_b->transposed;
  d.lda = read_a->ld;
  d.ldb = read_b->ld;
  d.m = m;
  d.k = k;
  d.n = n;
  d.a = ia.data();
  d.b = ib.data();
  d.c = out.data_ptr();
  d.epilogue = epilogue;
  const Tensor bias_dense = bias.defined() ? detail::dense(bias) : Tensor();  // kept alive for the kernel
  if (bias_dense.defined()) d.bias = bias_dense.data_ptr();
  if (axes.size() == 1 && axes[0].stride[1] == 0 && !d.trans_a && axes[0].stride[0] == m * d.lda) {
    // [..., m, k] @ [k, n] with a's rows evenly spaced across the batch: one GEMM over all rows.
    d.m = m * axes[0].extent;
  } else if (!axes.empty()) {
    const BatchAxis& outer = axes[0];
    d.batch = outer.extent;
    d.batch_stride_a = outer.stride[0];
    d.batch_stride_b = outer.stride[1];
    d.batch_stride_c = outer.stride[2];
    if (axes.size() == 2) {
      const BatchAxis& inner = axes[1];
      d.batch *= inner.extent;
      d.batch_inner = inner.extent;
      d.inner_stride_a = inner.stride[0];
      d.inner_stride_b = inner.stride[1];
      d.inner_stride_c = inner.stride[2];
    }
  }
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
                           grad_b = product("matmul", as_rows(av), true, as_rows(g), false);
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
  // The leading axes of x are the GEMM's rows: a view of them where x's strides allow.
  const Tensor rows = reshape(x.detach(), {shape_numel(Shape(x.shape().begin(), x.shape().end() - 1)), s.in});
  return reshape(
      product(op, rows, false, weight.detach(), s.out_in, bias.defined() ? bias.detach() : Tensor(), epilogue),
      out_shape);
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
    const Tensor x2 = as_rows(x());
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
                           as_rows(g), [&] { return saved[0].get(); }, [&] { return saved[1].get(); }, x_shape, s,
                           need);
                     });
  }
  return out;
}

Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias, GeluApproximation approximation,
                   WeightLayout layout, GeluBackward backward) {
  check_enum(approximation, "linear_gelu", "GeluApproximation");
  check_enum(backward, "linear_gelu", "GeluBackward");
  const LinearShape s = check_linear("linear_gelu", x, weight, bias, layout);
  const bool tanh = approximation == GeluApproximation::tanh;
  const UnaryOp gelu_op = tanh ? UnaryOp::gelu_tanh : UnaryOp::gelu_erf;
  // GELU's derivative at the pre-activation h, times g (both [.., out], contiguous).
  auto gelu_grad = [gelu_op](const Tensor& h, const Tensor& g) {
    Tensor gh = make_tensor(h.shape(), h.dtype(), h.backend(), "linear_gelu backward");
    if (gh.numel()) {
      const View none{};
      h.backend().unary_backward(gelu_op, detail::view_of(h), none, detail::view_of(g), detail::view_of(gh));
    }
    return gh;
  };
  if (backward == GeluBackward::keep_pre_activation) {
    const Tensor h = linear_forward("linear_gelu", x, weight, bias, s, GemmEpilogue::none);
    Tensor out = make_tensor(h.shape(), h.dtype(), h.backend(), "linear_gelu");
    if (!autograd::needs_grad(x, weight, bias)) {
      if (out.numel()) h.backend().unary(gelu_op, detail::view_of(h), detail::view_of(out));
      return out;
    }
    // What the backward needs of the pre-activation is GELU's derivative there: computed in the
    // GELU's own pass (one erf or tanh for both) and written over h, whose memory it takes, so
    // that the backward is one multiply instead of a second evaluation of the GELU's formula.
    // Measured in the default GPT's bf16 step (oneDNN backend, 2 threads, fc1 [2048, 1024]): its
    // GELU forward and backward took ~17 ms a step (DNNL_VERBOSE: 0.75 ms forward, 3.0-3.6 ms
    // backward a layer); the one pass and the multiply ~10 (perf's share, DNNL_VERBOSE). Alone,
    // on warm buffers, the two are even. `ruda-bench --suite models --quick`, 8 runs alternated
    // with the previous library: the bf16 GPT's fraction of GEMM 0.642 -> 0.674 at the median,
    // f32 unchanged (0.784 -> 0.78: Eigen's GELU backward was already the formula's one pass).
    if (out.numel()) {
      h.backend().unary_with_derivative(gelu_op, detail::view_of(h), detail::view_of(out), detail::view_of(h));
    }
    const Tensor& derivative = h;
    const bool gx = x.requires_grad(), gw = weight.requires_grad();
    autograd::record(
        "linear_gelu", out, {x, weight, bias}, {gw ? x : Tensor(), gx ? weight : Tensor(), derivative},
        [x_shape = x.shape(), s](const Tensor& g, const Saved& saved, GradMask need) {
          const Tensor d = saved[2].get();
          // Into g itself where it is ours alone (fc2's input gradient, as a rule):
          // no [rows, 4d] buffer, and the product reads and writes the same lines.
          const bool in_place = autograd::exclusively_owned(g) && g.is_contiguous();
          Tensor gh = in_place ? g : make_tensor(d.shape(), d.dtype(), d.backend(), "linear_gelu backward");
          if (gh.numel()) {
            d.backend().binary(BinaryOp::mul, detail::view_of(g), detail::view_of(d), detail::view_of(gh));
          }
          return linear_backward(
              as_rows(gh), [&] { return saved[0].get(); }, [&] { return saved[1].get(); }, x_shape, s, need);
        });
    return out;
  }
  Tensor out =
      linear_forward("linear_gelu", x, weight, bias, s, tanh ? GemmEpilogue::gelu_tanh : GemmEpilogue::gelu_erf);
  if (autograd::needs_grad(x, weight, bias)) {
    // x, the weight and the bias, all three needed to recompute the pre-activation.
    autograd::record("linear_gelu", out, {x, weight, bias}, {x, weight, bias},
                     [x_shape = x.shape(), s, gelu_grad](const Tensor& g, const Saved& saved, GradMask need) {
                       const Tensor xs = saved[0].get(), w = saved[1].get(), b = saved[2].get();
                       const Tensor h = linear_forward("linear_gelu backward", xs, w, b, s, GemmEpilogue::none);
                       const Tensor gh = gelu_grad(h, g);
                       return linear_backward(
                           as_rows(gh), [&] { return xs; }, [&] { return w; }, x_shape, s, need);
                     });
  }
  return out;
}

}  // namespace ruda
