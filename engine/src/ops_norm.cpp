// Normalization ops with fused kernels.
#include <cmath>
#include "internal.h"

namespace ruda {

using autograd::GradMask;
using autograd::Saved;
using detail::make_tensor;
using detail::view_of;

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  detail::require_float("layer_norm", x);
  if (x.ndim() < 1) fail<ShapeError>("layer_norm", "needs at least one dimension, got a scalar");
  const std::int64_t features = x.shape().back();
  for (const Tensor* p : {&weight, &bias}) {
    if (!p->defined()) continue;
    // The affine parameters are in x's dtype, or f32 beside 16-bit x: the mixed form that keeps
    // f32 weights (and f32 gradients for them) without casting x to f32 and the result back.
    if (!(p->dtype() == DType::f32 && is_16bit_float(x.dtype()))) detail::require_same_dtype("layer_norm", x, *p);
    if (p->shape() != Shape{features}) {
      fail<ShapeError>("layer_norm", "affine parameter ", p->shape(), " does not match ", x.shape(), " (expected [",
                       features, "])");
    }
  }
  if (weight.defined() && bias.defined() && weight.dtype() != bias.dtype()) {
    fail<DTypeError>("layer_norm", "weight and bias dtypes differ: ", dtype_name(weight.dtype()), " and ",
                     dtype_name(bias.dtype()), " (x is ", dtype_name(x.dtype()), ")");
  }
  // Infinite eps would make every rstd 0 (the output the bias alone): refused with NaN and negatives.
  if (!(eps >= 0 && std::isfinite(eps)))
    fail<ArgumentError>("layer_norm", "eps must be finite and non-negative, got ", eps);
  // A weight without a bias (PyTorch's LayerNorm(bias=False)) or a bias without a weight: the
  // kernels take both or neither, so the missing one is the identity's, ones or zeros. Its
  // gradient is never asked for (it is not an input of the graph).
  Tensor w = weight, b = bias;
  if (w.defined() != b.defined()) {
    const Tensor& given = w.defined() ? w : b;
    const Options options(given.dtype(), &given.backend());
    (w.defined() ? b : w) = w.defined() ? zeros({features}, options) : ones({features}, options);
  }
  const std::int64_t rows = features == 0 ? 0 : x.numel() / features;
  const DType stat = x.dtype() == DType::f64 ? DType::f64 : DType::f32;
  Tensor out = make_tensor(x.shape(), x.dtype(), x.backend(), "layer_norm");
  Tensor mean = make_tensor({rows}, stat, x.backend(), "layer_norm"),
         rstd = make_tensor({rows}, stat, x.backend(), "layer_norm");
  View none;
  none.dtype = x.dtype();
  if (out.numel()) {
    // The kernel's contract is contiguous rows: a view is copied first.
    x.backend().layer_norm(view_of(detail::dense(x)), w.defined() ? view_of(detail::dense(w)) : none,
                           b.defined() ? view_of(detail::dense(b)) : none, eps, view_of(out), view_of(mean),
                           view_of(rstd));
  }
  if (autograd::needs_grad(x, weight, bias)) {
    autograd::record(
        "layer_norm", out, {x, weight, bias}, {x, w, mean, rstd}, [](const Tensor& g, const Saved& s, GradMask need) {
          const Tensor xv = detail::dense(s[0].get()), wv = s[1].get();
          View none;
          none.dtype = g.dtype();
          Tensor gx, gw, gb;
          if (need[0]) gx = make_tensor(g.shape(), g.dtype(), g.backend(), "layer_norm backward");
          // The affine gradients in the parameters' dtype (f32 in the mixed form).
          if (need[1]) gw = make_tensor(wv.shape(), wv.dtype(), g.backend(), "layer_norm backward");
          if (need[2]) gb = make_tensor(wv.shape(), wv.dtype(), g.backend(), "layer_norm backward");
          if (g.numel()) {
            g.backend().layer_norm_backward(view_of(xv), wv.defined() ? view_of(detail::dense(wv)) : none,
                                            view_of(s[2].get()), view_of(s[3].get()), view_of(g),
                                            gx.defined() ? view_of(gx) : none, gw.defined() ? view_of(gw) : none,
                                            gb.defined() ? view_of(gb) : none);
          } else {
            for (Tensor* t : {&gw, &gb}) {
              if (t->defined()) t->fill_(0);
            }
          }
          return std::vector<Tensor>{gx, gw, gb};
        });
  }
  return out;
}

}  // namespace ruda
