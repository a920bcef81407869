#include <cmath>
#include <sstream>

#include <ruda/autograd.h>
#include <ruda/gradcheck.h>

#include "internal.h"

namespace ruda {
namespace {
// Whether a and b are views of the same elements in the same layout (one tensor passed twice).
bool same_elements(const Tensor& a, const Tensor& b) {
  return a.shares_storage(b) && a.storage_offset() == b.storage_offset() && a.shape() == b.shape() &&
         a.strides() == b.strides() && a.dtype() == b.dtype();
}

// Whether some of t's elements share a place in memory (an expanded, stride-0 axis): writing one
// in place would move the others.
bool overlaps_itself(const Tensor& t) {
  for (std::size_t d = 0; d < t.shape().size(); ++d) {
    if (t.strides()[d] == 0 && t.shape()[d] > 1) return true;
  }
  return false;
}

// Element `flat` (in row-major order) of t as a one-element view: where an in-place perturbation
// writes. (Built under no-grad by the caller: a view of a leaf that requires grad records nothing.)
Tensor element_of(const Tensor& t, std::int64_t flat) {
  const Shape& shape = t.shape();
  std::vector<std::int64_t> index(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    index[d] = flat % shape[d];
    flat /= shape[d];
  }
  Tensor e = t;
  for (std::size_t d = 0; d < shape.size(); ++d) e = e.slice(static_cast<std::int64_t>(d), index[d], index[d] + 1);
  return e;
}
}  // namespace

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
  // Analytic: d(sum(f(x) * r))/dx through backward, for a fixed random projection r. The inputs
  // are passed as they are, as PyTorch's gradcheck passes them (a function may close over a leaf
  // it is also given: a module's parameter). A non-leaf that requires grad, whose grad() is never
  // filled, is replaced by a leaf of gradcheck's own on its storage. The leaves' gradients are set
  // aside for the backward and given back after it.
  std::vector<Tensor> leaves = inputs;
  std::vector<std::pair<Tensor, Tensor>> set_aside;  // a leaf and its gradient before
  struct GiveBack {
    std::vector<std::pair<Tensor, Tensor>>& set_aside;
    ~GiveBack() {
      // Last first: a leaf passed twice was set aside twice, the second time without its gradient.
      for (auto it = set_aside.rbegin(); it != set_aside.rend(); ++it) it->first.set_grad(it->second);
    }
  } give_back{set_aside};
  bool any = false;
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    Tensor& in = leaves[i];
    if (!in.defined() || !in.requires_grad()) continue;
    any = true;
    if (in.is_leaf()) {
      set_aside.emplace_back(in, in.grad());
      in.set_grad(Tensor());
      continue;
    }
    // One replacement for every slot holding these elements, so that a non-leaf passed twice
    // collects the gradients of both uses, as a leaf passed twice does.
    std::size_t earlier = 0;
    while (earlier < i && !(inputs[earlier].defined() && same_elements(inputs[earlier], in) &&
                            inputs[earlier].requires_grad() && !inputs[earlier].is_leaf())) {
      ++earlier;
    }
    in = earlier < i ? leaves[earlier] : in.detach().set_requires_grad();
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
  std::vector<std::vector<double>> analytic(leaves.size());
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const Tensor& in = leaves[i];
    if (!in.defined() || !in.requires_grad()) continue;
    analytic[i] = (in.grad().defined() ? in.grad().to(DType::f64) : zeros(in.shape(), DType::f64)).to_vector<double>();
  }

  auto objective = [&](const std::vector<Tensor>& xs) {
    autograd::NoGradGuard guard;
    return sum(cast(f(xs), DType::f64) * cast(r, DType::f64)).item();
  };

  for (std::size_t which = 0; which < leaves.size(); ++which) {
    const Tensor& in = leaves[which];
    if (!in.defined() || !in.requires_grad()) continue;
    const std::vector<double>& grad = analytic[which];
    const std::vector<double> base = in.to_vector<double>();
    // Each element is perturbed in place and put back, as PyTorch's gradcheck does: a function
    // that reads the input through a closure (a module's parameter) rather than its argument sees
    // the perturbation too (built from a copy passed as the argument, every numeric derivative of
    // such a function was 0: a correct layer failed, and a weight whose gradient was lost passed).
    // An input with an expanded axis cannot be written in place: a copy is passed instead.
    const bool in_place = !overlaps_itself(in);
    for (std::int64_t i = 0; i < in.numel(); ++i) {
      auto shifted = [&](double delta) {
        if (in_place) {
          autograd::NoGradGuard guard;
          Tensor place = element_of(in, i);
          // Put back whatever happens in f: the original value, read as f64, is exact in its dtype.
          struct PutBack {
            Tensor& place;
            double value;
            ~PutBack() {
              autograd::NoGradGuard restoring;
              place.fill_(value);
            }
          } put_back{place, base[static_cast<std::size_t>(i)]};
          place.fill_(base[static_cast<std::size_t>(i)] + delta);
          return objective(leaves);
        }
        std::vector<double> values = base;
        values[static_cast<std::size_t>(i)] += delta;
        // Every slot holding these elements moves with this one, as an in-place perturbation would
        // move them: their gradient is the sum of their uses.
        std::vector<Tensor> xs = leaves;
        const Tensor moved = from_values(values, in.shape(), Options(in.dtype(), &in.backend()));
        for (std::size_t j = 0; j < xs.size(); ++j) {
          if (j == which || (xs[j].defined() && same_elements(xs[j], in))) xs[j] = moved;
        }
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
