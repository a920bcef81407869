// Finite-difference gradient check: compares backward() with central differences, for testing ops
// and layers (use f64 inputs).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <ruda/tensor.h>

namespace ruda {

struct GradcheckOptions {
  double eps = 1e-6;   // the central difference's step: finite and positive
  double atol = 1e-6;  // the tolerances: finite and non-negative (else ArgumentError)
  double rtol = 1e-5;
  std::uint64_t seed = 1234;  // of the random projection of a non-scalar output
};

struct GradcheckResult {
  bool ok = true;
  double max_abs_error = 0;  // NaN when an analytic or numeric value was NaN (a mismatch)
  /// The first mismatch: input, element, analytic and numeric values.
  std::string message;
};

/// Checks d(sum(f(inputs) * r))/d(input) for a fixed random r against central differences, for
/// every input that requires grad (at least one, else ArgumentError). The inputs are passed to f
/// as they are, and each element is perturbed in place (and put back, bit for bit), as PyTorch's
/// gradcheck does, so f may read a leaf it is also given through a closure (a module's
/// parameter) instead of its argument; an input with an expanded (stride-0) axis is perturbed
/// through a copy passed as the argument instead. A non-leaf input is replaced by a leaf on its
/// storage. The leaves' grad() are as they were afterwards. Inputs holding the same elements (one
/// tensor passed twice) move together: their gradient is the sum of their uses. f must return a defined
/// floating-point tensor; one that does not depend on the inputs has zero gradients. Inputs other
/// than f64 fail for rounding at the default eps; the message says so.
GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f, const std::vector<Tensor>& inputs,
                          GradcheckOptions options = {});

}  // namespace ruda
