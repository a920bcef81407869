// Tensor: a cheap handle over shared host storage (storage + offset + shape + strides), with a
// dtype, a backend and optional autodiff metadata. Copying a Tensor copies the handle (like a
// shared_ptr). Ops write new contiguous row-major tensors; permute, transpose, slice, expand,
// squeeze, unsqueeze and view return views of the same storage, and reshape does where the
// strides allow (it copies otherwise).
//
// Views and in-place writes: a write through a view reaches its base, and the version counter
// is the storage's, so a saved tensor overwritten through any view of it is still caught. ruda
// refuses in-place updates of tensors that require grad while grad mode is on, so PyTorch's
// rebasing of a view's autograd history after an in-place write is not needed (nor done).
#pragma once

#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include <ruda/backend.h>
#include <ruda/dtype.h>
#include <ruda/error.h>
#include <ruda/shape.h>

namespace ruda {

namespace detail {
struct TensorImpl;
struct TensorAccess;
}  // namespace detail
namespace autograd {
class Node;
}

using Axes = std::vector<std::int64_t>;

/// Where a new tensor lives and what it holds. Converts from a DType, so zeros({2}, DType::f64) works.
struct Options {
  DType dtype = DType::f32;
  Backend* backend = nullptr;  // null: default_backend()
  bool requires_grad = false;
  Options() = default;
  Options(DType dtype_, Backend* backend_ = nullptr, bool requires_grad_ = false)  // NOLINT: implicit on purpose
      : dtype(dtype_), backend(backend_), requires_grad(requires_grad_) {}
};

/// The element types of the typed accessors (data<T>, to_vector<T>, from_vector<T>): one per
/// DType. Another type is a compile error here, not an undefined reference at link time.
template <class T>
concept TensorElement = std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, std::int64_t> ||
    std::same_as<T, bfloat16> || std::same_as<T, float16> || std::same_as<T, bool>;

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<detail::TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const noexcept { return impl_ != nullptr; }
  const Shape& shape() const;
  std::int64_t ndim() const;
  /// Extent of one axis (negative axes count from the end).
  std::int64_t size(std::int64_t axis) const;
  std::int64_t numel() const;
  DType dtype() const;
  Backend& backend() const;
  std::size_t nbytes() const;

  /// First element of this tensor's data, whose elements follow in row-major order. Throws
  /// ShapeError on a non-contiguous view (call contiguous() first, or read view()'s strides):
  /// no caller reads the wrong bytes.
  void* data_ptr() const;
  /// Typed pointer; throws DTypeError if T does not match the dtype, ShapeError as data_ptr().
  template <TensorElement T>
  T* data() const;
  /// The kernel view of this tensor: pointer to its first element and its strides (any layout).
  View view() const;
  bool shares_storage(const Tensor& other) const;
  /// Whether the elements are consecutive in row-major order (every op's output is).
  bool is_contiguous() const;
  /// This tensor when contiguous, else a contiguous copy (differentiable, like clone()).
  Tensor contiguous() const;
  /// Element strides of each axis (0 on an expanded axis).
  Shape strides() const;
  /// Where the first element sits in the storage, in elements.
  std::int64_t storage_offset() const;

  /// All values converted to T (any dtype to float, double, int64_t, bool, bfloat16 or float16).
  template <TensorElement T>
  std::vector<T> to_vector() const;
  /// The value of a one-element tensor, as double.
  double item() const;
  /// One element, as double; throws IndexError outside the tensor.
  double at(std::initializer_list<std::int64_t> index) const;

  // --- autodiff ---
  bool requires_grad() const;
  /// Marks a leaf as needing a gradient; throws AutogradError on a non-leaf, DTypeError on a
  /// non-float tensor.
  Tensor& set_requires_grad(bool value = true);
  /// True for tensors that no recorded op produced (user tensors, parameters, detached tensors).
  bool is_leaf() const;
  /// The accumulated gradient of a leaf (undefined until a backward reached it).
  Tensor grad() const;
  void set_grad(const Tensor& grad);
  /// Drops the accumulated gradient.
  void zero_grad();
  /// Backpropagates from a one-element tensor.
  void backward(bool retain_graph = false) const;
  /// Backpropagates with an explicit gradient of this tensor's shape and dtype.
  void backward(const Tensor& grad, bool retain_graph = false) const;
  /// The same storage, cut from the graph.
  Tensor detach() const;
  const std::shared_ptr<autograd::Node>& grad_fn() const;

  // --- conversions ---
  Tensor to(DType dtype) const;
  /// The same storage on another backend (no copy). Differentiable: the gradient flows back to
  /// this tensor on its own backend.
  Tensor to(Backend& backend) const;
  /// A copy in fresh storage. Differentiable like an identity op; detach() first for a plain copy.
  Tensor clone() const;

  // --- in-place updates (not recorded; refused while grad mode is on on a tensor that requires
  // grad, and with an operand that requires grad, whose gradient would be lost) ---
  // Each bumps the storage's version: a backward that saved a tensor of this storage and finds
  // a newer version raises AutogradError instead of computing with the changed values.
  Tensor& copy_(const Tensor& source);
  Tensor& fill_(double value);
  Tensor& add_(const Tensor& other, double alpha = 1.0);
  Tensor& mul_(double factor);
  /// How many in-place writes this tensor's storage has seen (shared by every view of it).
  std::uint64_t version() const;
  /// Records an in-place write made some other way: through data_ptr() or a Backend kernel.
  void bump_version() const;

  // --- shape (free functions below hold the documentation) ---
  Tensor reshape(Shape shape) const;
  /// Like reshape, but never copies: ShapeError when the strides do not allow a view.
  Tensor view(Shape shape) const;
  Tensor flatten(std::int64_t start_axis = 0, std::int64_t end_axis = -1) const;
  Tensor squeeze(std::int64_t axis) const;
  Tensor unsqueeze(std::int64_t axis) const;
  Tensor permute(const Axes& order) const;
  Tensor transpose(std::int64_t axis0, std::int64_t axis1) const;
  Tensor slice(std::int64_t axis, std::int64_t start, std::int64_t end) const;
  Tensor expand(const Shape& shape) const;

  // --- math shortcuts ---
  Tensor sum(const Axes& axes = {}, bool keepdim = false) const;
  Tensor mean(const Axes& axes = {}, bool keepdim = false) const;
  Tensor max(const Axes& axes = {}, bool keepdim = false) const;
  Tensor min(const Axes& axes = {}, bool keepdim = false) const;
  Tensor argmax(std::int64_t axis, bool keepdim = false) const;
  Tensor exp() const;
  Tensor log() const;
  Tensor sqrt() const;
  Tensor abs() const;
  Tensor relu() const;
  Tensor tanh() const;
  Tensor sigmoid() const;
  Tensor matmul(const Tensor& other) const;

  /// Whether both handles refer to the same tensor (a copy of a handle is the same tensor; an
  /// equal-valued tensor made separately is not).
  bool is_same(const Tensor& other) const noexcept { return impl_ == other.impl_; }

 private:
  friend struct detail::TensorAccess;  // the engine's own files reach the implementation
  std::shared_ptr<detail::TensorImpl> impl_;
};

/// "tensor(f32 [2, 2], [[1, 2], [3, 4]])", long tensors abbreviated.
std::ostream& operator<<(std::ostream& out, const Tensor& tensor);
std::string to_string(const Tensor& tensor);

// --- creation ---
Tensor empty(const Shape& shape, Options options = {});
Tensor zeros(const Shape& shape, Options options = {});
Tensor ones(const Shape& shape, Options options = {});
Tensor full(const Shape& shape, double value, Options options = {});
Tensor zeros_like(const Tensor& like);
Tensor ones_like(const Tensor& like);
/// [start, start + step, ...) below end.
Tensor arange(double start, double end, double step = 1.0, Options options = {});
/// A copy of the values; the dtype follows T (float f32, double f64, int64_t i64, bool, bfloat16, float16).
template <TensorElement T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, Options options = {});
/// A copy of the values converted to options.dtype.
Tensor from_values(const std::vector<double>& values, const Shape& shape, Options options = {});
/// A copy of a raw buffer holding shape_numel(shape) elements of `dtype`. A bool buffer's bytes must
/// be 0 or 1 (DTypeError naming the first other one).
Tensor from_buffer(const void* data, const Shape& shape, DType dtype, Options options = {});
/// A 0-d tensor.
Tensor scalar(double value, Options options = {});

/// Uniform [0, 1), normal(0, 1), uniform [low, high) and normal(mean, std) draws from a counter-based
/// generator: element i is draw number offset + i of stream `seed`, whatever the shape, so any
/// element range of a tensor can be produced alone (sharded initialization relies on it). Uniform
/// draws of every dtype stay inside [low, high); f16 and bf16 ones take as many random bits as the
/// dtype's significand holds (bf16's [0, 1) has 256 values), as PyTorch's do.
Tensor rand(const Shape& shape, std::uint64_t seed, std::uint64_t offset = 0, Options options = {});
Tensor randn(const Shape& shape, std::uint64_t seed, std::uint64_t offset = 0, Options options = {});
Tensor uniform(const Shape& shape, double low, double high, std::uint64_t seed, std::uint64_t offset = 0,
               Options options = {});
Tensor normal(const Shape& shape, double mean, double std, std::uint64_t seed, std::uint64_t offset = 0,
              Options options = {});
/// Integers in [low, high), dtype i64: ranges of up to 2^53 values from 53 random bits a draw,
/// wider ones from 64 (every value of the range reachable).
Tensor randint(const Shape& shape, std::int64_t low, std::int64_t high, std::uint64_t seed, std::uint64_t offset = 0);

// --- elementwise, broadcasting (numpy rules) ---
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, double exponent);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
/// Comparisons with a number (converted to a float tensor's dtype; for i64 and bool tensors the
/// exact comparison: lt(x, 0.5) is x <= 0). i64 arithmetic wraps around on overflow
/// (INT64_MIN / -1 == INT64_MIN); a number it cannot hold exactly (x * 0.5, fill_(2.7), full with
/// NaN) is a DTypeError, and float-to-i64 casts saturate, NaN becoming 0.
Tensor eq(const Tensor& a, double b);
Tensor ne(const Tensor& a, double b);
Tensor lt(const Tensor& a, double b);
Tensor le(const Tensor& a, double b);
Tensor gt(const Tensor& a, double b);
Tensor ge(const Tensor& a, double b);
/// cond (bool) ? a : b, all three broadcast together.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
Tensor clamp(const Tensor& x, double low, double high);

Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, double b);
Tensor operator-(const Tensor& a, double b);
Tensor operator*(const Tensor& a, double b);
Tensor operator/(const Tensor& a, double b);
Tensor operator+(double a, const Tensor& b);
Tensor operator-(double a, const Tensor& b);
Tensor operator*(double a, const Tensor& b);
Tensor operator/(double a, const Tensor& b);
Tensor operator-(const Tensor& a);

Tensor neg(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor square(const Tensor& x);
Tensor reciprocal(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
enum class GeluApproximation { erf, tanh };
constexpr bool is_valid(GeluApproximation a) noexcept {
  switch (a) {
    case GeluApproximation::erf:
    case GeluApproximation::tanh:
      return true;
  }
  return false;
}
Tensor gelu(const Tensor& x, GeluApproximation approximation = GeluApproximation::erf);
Tensor silu(const Tensor& x);
/// log(1 + exp(x)); x itself where x > 20 (gradient 1), as PyTorch's softplus with its default
/// threshold.
Tensor softplus(const Tensor& x);
/// The error function, 2 / sqrt(pi) * integral of exp(-t^2) from 0 to x.
Tensor erf(const Tensor& x);

/// Conversion between dtypes (float to 16-bit rounds to nearest even). Differentiable between floats.
Tensor cast(const Tensor& x, DType dtype);
/// Zeroes each element with probability p and scales the rest by 1/(1-p); element i's fate is draw
/// offset + i of stream `seed`. Identity when p == 0.
Tensor dropout(const Tensor& x, double p, std::uint64_t seed, std::uint64_t offset = 0);

// --- reductions: over `axes` (all axes when empty), keeping reduced axes as 1 when keepdim ---
Tensor sum(const Tensor& x, const Axes& axes = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const Axes& axes = {}, bool keepdim = false);
/// The largest/smallest values, NaN where a reduced line holds one: PyTorch's amax/amin, gradient
/// included (split evenly among tied elements; with a NaN, NaN). torch.max(x, dim) instead gives
/// the whole gradient to the first tied element, and to the NaN: use argmax and take_along_axis.
Tensor max(const Tensor& x, const Axes& axes = {}, bool keepdim = false);
Tensor min(const Tensor& x, const Axes& axes = {}, bool keepdim = false);
Tensor logsumexp(const Tensor& x, const Axes& axes = {}, bool keepdim = false);
/// Index (i64) of the largest/smallest element along one axis (the first one on ties).
Tensor argmax(const Tensor& x, std::int64_t axis, bool keepdim = false);
Tensor argmin(const Tensor& x, std::int64_t axis, bool keepdim = false);
/// Sums a broadcast result back to `shape` (the gradient of broadcasting).
Tensor sum_to(const Tensor& x, const Shape& shape);

// --- shape ---
/// New shape with the same element count; one extent may be -1. A view of x's storage when its
/// strides allow one (always for a contiguous x), else a contiguous copy.
Tensor reshape(const Tensor& x, Shape shape);
/// reshape that never copies: ShapeError when x's strides cannot give that shape (a transposed
/// matrix flattened), as PyTorch's view.
Tensor view(const Tensor& x, Shape shape);
Tensor flatten(const Tensor& x, std::int64_t start_axis = 0, std::int64_t end_axis = -1);
Tensor squeeze(const Tensor& x, std::int64_t axis);
Tensor unsqueeze(const Tensor& x, std::int64_t axis);
/// Reorders axes (a view: the strides are permuted).
Tensor permute(const Tensor& x, const Axes& order);
Tensor transpose(const Tensor& x, std::int64_t axis0, std::int64_t axis1);
/// Elements [start, end) along an axis; negative bounds count from the end. A view on any axis.
Tensor slice(const Tensor& x, std::int64_t axis, std::int64_t start, std::int64_t end);
/// x with elements [start, end) along `axis` replaced by `value` (a new tensor; differentiable in both).
Tensor slice_assign(const Tensor& x, std::int64_t axis, std::int64_t start, std::int64_t end, const Tensor& value);
Tensor concat(const std::vector<Tensor>& tensors, std::int64_t axis = 0);
Tensor stack(const std::vector<Tensor>& tensors, std::int64_t axis = 0);
/// Broadcasts to a larger shape: a view with stride 0 on the broadcast axes. Its elements share
/// memory, so in-place writes to it are refused (write to contiguous() instead).
Tensor expand(const Tensor& x, const Shape& shape);

// --- linear algebra ---
/// Matrix product of the last two axes; leading (batch) axes broadcast. Both at least 2-D.
Tensor matmul(const Tensor& a, const Tensor& b);
/// How linear reads its weight: [in, out] (ruda's layout) or [out, in] (PyTorch's, and a tied
/// embedding table used as an output head), without copying.
enum class WeightLayout { in_out, out_in };
constexpr bool is_valid(WeightLayout layout) noexcept {
  switch (layout) {
    case WeightLayout::in_out:
    case WeightLayout::out_in:
      return true;
  }
  return false;
}
/// x @ weight + bias over any leading axes of x; bias is [out] or undefined.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = {},
              WeightLayout layout = WeightLayout::in_out);

/// What linear_gelu keeps for its backward, which needs GELU's derivative at the pre-activation:
/// keep it (one [.., out] tensor more from forward to backward: the GELU runs as its own pass
/// after the GEMM and writes the derivative over the pre-activation, so that the backward is a
/// multiply), or recompute the pre-activation from x in backward (one more GEMM of the forward's
/// size; the GELU runs as the GEMM's epilogue and the pre-activation never exists in forward).
enum class GeluBackward { keep_pre_activation, recompute };
constexpr bool is_valid(GeluBackward b) noexcept {
  switch (b) {
    case GeluBackward::keep_pre_activation:
    case GeluBackward::recompute:
      return true;
  }
  return false;
}

/// gelu(linear(x, weight, bias)) as one differentiable op; `backward` trades the pre-activation's
/// memory for a GEMM (see GeluBackward).
Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias = {},
                   GeluApproximation approximation = GeluApproximation::erf, WeightLayout layout = WeightLayout::in_out,
                   GeluBackward backward = GeluBackward::keep_pre_activation);

// --- neural-network primitives ---
/// Rows of table [V, F] picked by i64 indices of any shape: result shape indices.shape + [F].
/// The gradient scatter-adds into the table's rows.
Tensor embedding(const Tensor& table, const Tensor& indices);
/// out[..., j] = x[..., index[..., j]] along `axis` (index is i64, x's shape but for that axis).
Tensor take_along_axis(const Tensor& x, const Tensor& index, std::int64_t axis);
Tensor softmax(const Tensor& x, std::int64_t axis = -1);
/// Normalization over the last axis: (x - mean) / sqrt(var + eps) * weight + bias, one fused
/// kernel forward and backward. weight and bias ([features]) may be undefined, either one or
/// both (y = xhat * weight without a bias, as PyTorch's LayerNorm(bias=False)); they are in x's
/// dtype, or in f32 beside f16/bf16 x (mixed precision: f32 statistics and affine, a result in
/// x's dtype, f32 gradients for the parameters; the same bits as casting x to f32 and back).
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
Tensor log_softmax(const Tensor& x, std::int64_t axis = -1);

}  // namespace ruda
