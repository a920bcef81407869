#include <cmath>
#include <sstream>

#include <ruda/autograd.h>
#include <ruda/gradcheck.h>

#include "internal.h"

namespace ruda {

GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f, const std::vector<Tensor>& inputs,
                          GradcheckOptions options) {
  GradcheckResult result;
  // A step or tolerance that is NaN, infinite or (for the step) not positive would make every
  // comparison below false, and the check pass whatever the gradients are.
  if (!std::isfinite(options.eps) || options.eps <= 0) {
    fail<ArgumentError>("gradcheck", "eps must be finite and positive, got ", options.eps);
  }
  if (!std::isfinite(options.atol) || options.atol < 0 || !std::isfinite(options.rtol) || options.rtol < 0) {
    fail<ArgumentError>("gradcheck", "atol and rtol must be finite and non-negative, got atol ", options.atol,
                        ", rtol ", options.rtol);
  }
  if (!f) fail<ArgumentError>("gradcheck", "the function to check is empty");
  // Analytic: d(sum(f(x) * r))/dx through backward, for a fixed random projection r, taken on
  // leaves of gradcheck's own that share each input's storage. So an input may be any tensor that
  // requires grad (a non-leaf's grad() is never filled), the callers' gradients are left as they
  // were, and a tensor passed twice is two inputs, each perturbed alone as its gradient is taken.
  std::vector<Tensor> leaves = inputs;
  bool any = false;
  for (Tensor& in : leaves) {
    if (!in.defined() || !in.requires_grad()) continue;
    in = in.detach().set_requires_grad();
    any = true;
  }
  if (!any) fail<ArgumentError>("gradcheck", "no input requires grad: there is no gradient to check");
  const Tensor out = f(leaves);
  if (!out.defined()) fail<ArgumentError>("gradcheck", "the function returned an undefined tensor");
  if (!is_floating(out.dtype())) {
    fail<DTypeError>("gradcheck", "the function returned ", dtype_name(out.dtype()), " ", out.shape(),
                     ", not a floating-point tensor (nothing to differentiate)");
  }
  const Tensor r = rand(out.shape(), options.seed, 0, Options(out.dtype(), &out.backend())) + 0.5;
  // An output that does not depend on the inputs has zero gradients (checked numerically below).
  if (out.requires_grad()) sum(out * r).backward();

  auto objective = [&](const std::vector<Tensor>& xs) {
    autograd::NoGradGuard guard;
    return sum(cast(f(xs), DType::f64) * cast(r, DType::f64)).item();
  };

  for (std::size_t which = 0; which < leaves.size(); ++which) {
    const Tensor& in = leaves[which];
    if (!in.defined() || !in.requires_grad()) continue;
    const Tensor analytic = in.grad().defined() ? in.grad().to(DType::f64) : zeros(in.shape(), DType::f64);
    const std::vector<double> grad = analytic.to_vector<double>();
    const std::vector<double> base = in.to_vector<double>();
    for (std::int64_t i = 0; i < in.numel(); ++i) {
      auto shifted = [&](double delta) {
        std::vector<double> values = base;
        values[static_cast<std::size_t>(i)] += delta;
        std::vector<Tensor> xs = leaves;
        xs[which] = from_values(values, in.shape(), Options(in.dtype(), &in.backend()));
        return objective(xs);
      };
      const double numeric = (shifted(options.eps) - shifted(-options.eps)) / (2 * options.eps);
      // A NaN on either side is a mismatch (and the largest error), never a pass.
      const double error = std::abs(numeric - grad[static_cast<std::size_t>(i)]);
      if (std::isnan(error) || error > result.max_abs_error) result.max_abs_error = error;
      if (!(error <= options.atol + options.rtol * std::abs(numeric)) && result.ok) {
        result.ok = false;
        std::ostringstream msg;
        msg << "input " << which << " " << dtype_name(in.dtype()) << " " << to_string(in.shape()) << " element " << i
            << ": analytic " << grad[static_cast<std::size_t>(i)] << ", numeric " << numeric;
        // The step is below a narrower float's resolution: its differences are rounding noise.
        if (in.dtype() != DType::f64) msg << " (central differences need f64 inputs)";
        result.message = msg.str();
      }
    }
  }
  return result;
}

}  // namespace ruda
