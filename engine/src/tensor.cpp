// The Tensor handle: metadata, creation, element access, printing and in-place updates.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <ostream>
#include <sstream>
#include <type_traits>

#include "internal.h"

namespace ruda {
namespace detail {

Tensor make_tensor(const Shape& shape, DType dtype, Backend& backend, const char* op) {
  // Every new tensor (creation, cast, to(dtype), every op's output) is made here.
  check_enum<DTypeError>(dtype, op, "dtype");
  require_rank(op, shape);
  auto impl = std::make_shared<TensorImpl>();
  impl->numel = shape_numel(shape, op);
  const auto item = static_cast<std::int64_t>(dtype_size(dtype));
  if (impl->numel > std::numeric_limits<std::int64_t>::max() / item) {
    fail<ShapeError>(op, dtype_name(dtype), " ", shape, " needs more than 2^63 bytes");
  }
  impl->storage = std::make_shared<Storage>(static_cast<std::size_t>(impl->numel * item), op, shape, dtype);
  impl->shape = shape;
  contiguous_strides(shape, impl->strides.data());
  impl->dtype = dtype;
  impl->backend = &backend;
  return Tensor(std::move(impl));
}

Tensor strided_alias(const Tensor& source, const Shape& shape, const std::int64_t* strides, std::int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  const TensorImpl& s = *impl_of(source);
  impl->storage = s.storage;
  impl->offset = offset;
  impl->shape = shape;
  std::copy(strides, strides + shape.size(), impl->strides.begin());
  impl->contiguous = strides_are_contiguous(shape, strides);
  impl->numel = shape_numel(shape);
  impl->dtype = s.dtype;
  impl->backend = s.backend;
  return Tensor(std::move(impl));
}

Tensor alias(const Tensor& source, const Shape& shape, std::int64_t extra_offset) {
  std::int64_t strides[kMaxDims];
  contiguous_strides(shape, strides);
  return strided_alias(source, shape, strides, impl_of(source)->offset + extra_offset);
}

void contiguous_strides(const Shape& shape, std::int64_t* strides) {
  std::int64_t stride = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    strides[i] = stride;
    stride *= shape[i];
  }
}

bool strides_are_contiguous(const Shape& shape, const std::int64_t* strides) {
  std::int64_t expected = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    if (shape[i] == 0) return true;  // an empty tensor reads nothing
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

View view_of(const Tensor& t) {
  View v;
  const TensorImpl& impl = *impl_of(t);
  v.data = impl.data();
  v.dtype = impl.dtype;
  v.ndim = static_cast<int>(impl.shape.size());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = impl.shape[i];
    v.strides[i] = impl.strides[i];
  }
  return v;
}

View broadcast_view(const Tensor& t, const Shape& shape) {
  View v;
  const TensorImpl& impl = *impl_of(t);
  v.data = impl.data();
  v.dtype = impl.dtype;
  v.ndim = static_cast<int>(shape.size());
  const int lead = v.ndim - static_cast<int>(impl.shape.size());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = shape[i];
    const int j = i - lead;
    v.strides[i] = (j < 0 || impl.shape[j] == 1) ? 0 : impl.strides[j];
  }
  return v;
}

Tensor dense(const Tensor& t) {
  const TensorImpl& impl = *impl_of(t);
  if (impl.contiguous) return t;
  Tensor out = make_tensor(impl.shape, impl.dtype, *impl.backend, "contiguous");
  if (impl.numel) impl.backend->copy(view_of(t), view_of(out));
  return out;
}

namespace {
// [first, last] element offsets a tensor's elements span in its storage (numel > 0).
std::pair<std::int64_t, std::int64_t> element_span(const TensorImpl& t) {
  std::int64_t first = t.offset, last = t.offset;
  for (std::size_t d = 0; d < t.shape.size(); ++d) {
    const std::int64_t reach = (t.shape[d] - 1) * t.strides[d];
    (reach < 0 ? first : last) += reach;
  }
  return {first, last};
}
}  // namespace

bool may_overlap(const Tensor& a, const Tensor& b) {
  const TensorImpl& x = *impl_of(a);
  const TensorImpl& y = *impl_of(b);
  if (x.storage != y.storage || x.numel == 0 || y.numel == 0) return false;
  const auto [x0, x1] = element_span(x);
  const auto [y0, y1] = element_span(y);
  return x0 <= y1 && y0 <= x1;
}

void require_writable_layout(const char* op, const Tensor& t) {
  const TensorImpl& impl = *impl_of(t);
  // (An empty view writes nothing: the strides of its other axes, which reshape may leave at 0, do
  // not matter.)
  if (impl.contiguous || impl.numel == 0) return;
  // ruda's view ops keep distinct elements apart except expand, whose broadcast axes have stride
  // 0: a write through such an axis would hit one element several times.
  for (std::size_t d = 0; d < impl.shape.size(); ++d) {
    if (impl.shape[d] > 1 && impl.strides[d] == 0) {
      fail<ShapeError>(op, "cannot write in place to a ", dtype_name(impl.dtype), " ", impl.shape,
                       " view whose elements share memory (strides ", t.strides(), "; an expanded view); ",
                       "write to contiguous() or clone() instead");
    }
  }
}

void require_defined(const char* op, const Tensor& t) {
  if (!t.defined()) fail<ArgumentError>(op, "got an undefined tensor");
}

void require_float(const char* op, const Tensor& t) {
  require_defined(op, t);
  if (!is_floating(t.dtype())) {
    fail<DTypeError>(op, "expects a floating-point tensor, got ", dtype_name(t.dtype()), " ", t.shape());
  }
}

void require_same_dtype(const char* op, const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype()) {
    fail<DTypeError>(op, "dtypes differ: ", dtype_name(a.dtype()), " ", a.shape(), " and ", dtype_name(b.dtype()), " ",
                     b.shape());
  }
}

void require_rank(const char* op, const Shape& shape) {
  if (shape.size() > static_cast<std::size_t>(kMaxDims)) {
    fail<ShapeError>(op, "shape ", shape, " has more than ", kMaxDims, " dimensions");
  }
}

}  // namespace detail

using detail::impl_of;
using detail::impl_ptr_of;
using detail::TensorImpl;

namespace {
const TensorImpl& checked(const Tensor& t, const char* what) {
  if (!t.defined()) fail<ArgumentError>(what, "called on an undefined tensor");
  return *impl_of(t);
}

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::f32;
  if constexpr (std::is_same_v<T, double>) return DType::f64;
  if constexpr (std::is_same_v<T, std::int64_t>) return DType::i64;
  if constexpr (std::is_same_v<T, bool>) return DType::boolean;
  if constexpr (std::is_same_v<T, bfloat16>) return DType::bf16;
  if constexpr (std::is_same_v<T, float16>) return DType::f16;
}

double read_element(const void* data, DType dtype, std::int64_t i) {
  switch (dtype) {
    case DType::f32:
      return static_cast<const float*>(data)[i];
    case DType::f64:
      return static_cast<const double*>(data)[i];
    case DType::f16:
      return to_float(static_cast<const float16*>(data)[i]);
    case DType::bf16:
      return to_float(static_cast<const bfloat16*>(data)[i]);
    case DType::i64:
      return static_cast<double>(static_cast<const std::int64_t*>(data)[i]);
    case DType::boolean:
      return static_cast<const std::uint8_t*>(data)[i] ? 1.0 : 0.0;
  }
  return 0;
}

Backend& backend_or_default(const Options& options) { return options.backend ? *options.backend : default_backend(); }

Tensor finish(Tensor t, const Options& options) {
  if (options.requires_grad) t.set_requires_grad(true);
  return t;
}
}  // namespace

const Shape& Tensor::shape() const { return checked(*this, "shape").shape; }
std::int64_t Tensor::ndim() const { return static_cast<std::int64_t>(checked(*this, "ndim").shape.size()); }
std::int64_t Tensor::size(std::int64_t axis) const {
  const auto& s = checked(*this, "size").shape;
  return s[normalize_axis(axis, static_cast<std::int64_t>(s.size()), "size")];
}
std::int64_t Tensor::numel() const { return checked(*this, "numel").numel; }
DType Tensor::dtype() const { return checked(*this, "dtype").dtype; }
Backend& Tensor::backend() const { return *checked(*this, "backend").backend; }
std::size_t Tensor::nbytes() const {
  const auto& impl = checked(*this, "nbytes");
  return static_cast<std::size_t>(impl.numel) * dtype_size(impl.dtype);
}
namespace {
// Raw pointers are handed out only where the bytes are the tensor's values in row-major order.
const TensorImpl& require_contiguous_bytes(const Tensor& t, const char* what) {
  const TensorImpl& impl = checked(t, what);
  if (!impl.contiguous) {
    fail<ShapeError>(what, "this ", dtype_name(impl.dtype), " ", impl.shape,
                     " tensor is a non-contiguous view (strides ", t.strides(),
                     "), so its elements are not consecutive in memory; call contiguous() first, or "
                     "read it through view(), which carries the strides");
  }
  return impl;
}
}  // namespace

void* Tensor::data_ptr() const { return require_contiguous_bytes(*this, "data_ptr").data(); }
View Tensor::view() const {
  checked(*this, "view");
  return detail::view_of(*this);
}
bool Tensor::is_contiguous() const { return checked(*this, "is_contiguous").contiguous; }
Shape Tensor::strides() const {
  const auto& impl = checked(*this, "strides");
  return Shape(impl.strides.begin(), impl.strides.begin() + static_cast<std::ptrdiff_t>(impl.shape.size()));
}
std::int64_t Tensor::storage_offset() const { return checked(*this, "storage_offset").offset; }
Tensor Tensor::contiguous() const {
  if (checked(*this, "contiguous").contiguous) return *this;
  return clone();
}
bool Tensor::shares_storage(const Tensor& other) const {
  return defined() && other.defined() && impl_->storage == other.impl_->storage;
}

template <TensorElement T>
T* Tensor::data() const {
  const auto& impl = require_contiguous_bytes(*this, "data");
  if (impl.dtype != dtype_of<T>()) {
    fail<DTypeError>("data", "requested ", dtype_name(dtype_of<T>()), " elements of a ", dtype_name(impl.dtype),
                     " tensor ", impl.shape);
  }
  return static_cast<T*>(impl.data());
}

template <TensorElement T>
std::vector<T> Tensor::to_vector() const {
  const auto& impl = checked(*this, "to_vector");
  constexpr DType target = dtype_of<T>();
  const Tensor source = detail::dense(impl.dtype == target ? *this : this->detach().to(target));
  const auto* src =
      static_cast<const std::conditional_t<std::is_same_v<T, bool>, std::uint8_t, T>*>(impl_of(source)->data());
  return std::vector<T>(src, src + impl.numel);
}

#define RUDA_INSTANTIATE(T)                             \
  template T* Tensor::data<T>() const;                  \
  template std::vector<T> Tensor::to_vector<T>() const; \
  template Tensor from_vector<T>(const std::vector<T>&, const Shape&, Options);

double Tensor::item() const {
  const auto& impl = checked(*this, "item");
  if (impl.numel != 1) fail<ShapeError>("item", "expects a one-element tensor, got ", impl.shape);
  return read_element(impl.data(), impl.dtype, 0);
}

double Tensor::at(std::initializer_list<std::int64_t> index) const {
  const auto& impl = checked(*this, "at");
  if (index.size() != impl.shape.size()) {
    fail<IndexError>("at", "index has ", index.size(), " coordinates for a tensor of shape ", impl.shape);
  }
  std::int64_t flat = 0, axis = 0;
  for (std::int64_t i : index) {
    const std::int64_t extent = impl.shape[axis];
    if (i < -extent || i >= extent)
      fail<IndexError>("at", "index ", i, " is out of range for axis ", axis, " of ", impl.shape);
    flat += (i < 0 ? i + extent : i) * impl.strides[axis];
    ++axis;
  }
  return read_element(impl.data(), impl.dtype, flat);
}

bool Tensor::requires_grad() const { return checked(*this, "requires_grad").requires_grad; }

Tensor& Tensor::set_requires_grad(bool value) {
  auto& impl = const_cast<TensorImpl&>(checked(*this, "set_requires_grad"));
  if (impl.grad_fn) {
    fail<AutogradError>("set_requires_grad", "only leaves can change requires_grad; this ", impl.shape,
                        " tensor was produced by ", autograd::node_name(*impl.grad_fn), " (use detach() first)");
  }
  if (value && !is_floating(impl.dtype)) {
    fail<DTypeError>("set_requires_grad", "only floating-point tensors can require grad, got ", dtype_name(impl.dtype),
                     " ", impl.shape);
  }
  impl.requires_grad = value;
  return *this;
}

bool Tensor::is_leaf() const { return checked(*this, "is_leaf").grad_fn == nullptr; }
Tensor Tensor::grad() const { return checked(*this, "grad").grad; }
void Tensor::set_grad(const Tensor& grad) {
  auto& impl = const_cast<TensorImpl&>(checked(*this, "set_grad"));
  if (grad.defined() && !is_floating(impl.dtype)) {  // as set_requires_grad: no gradient for them
    fail<DTypeError>("set_grad", "only floating-point tensors have gradients, got ", dtype_name(impl.dtype), " ",
                     impl.shape);
  }
  if (grad.defined() && grad.dtype() != impl.dtype) {
    fail<DTypeError>("set_grad", "gradient ", dtype_name(grad.dtype()), " ", grad.shape(), " does not match tensor ",
                     dtype_name(impl.dtype), " ", impl.shape);
  }
  if (grad.defined() && grad.shape() != impl.shape) {
    fail<ShapeError>("set_grad", "gradient ", dtype_name(grad.dtype()), " ", grad.shape(), " does not match tensor ",
                     dtype_name(impl.dtype), " ", impl.shape);
  }
  // A gradient on the tensor's own storage (t.set_grad(t), or a view of it): an optimizer's update of
  // the values would rewrite the gradient it reads (PyTorch refuses it too).
  if (grad.defined() && grad.shares_storage(*this)) {
    fail<ArgumentError>("set_grad", "the gradient ", dtype_name(grad.dtype()), " ", grad.shape(),
                        " shares the tensor's own storage; pass a copy (clone())");
  }
  // Contiguous, like every gradient backward accumulates: optimizers read a gradient's bytes.
  impl.grad = grad.defined() ? detail::dense(grad) : grad;
}
void Tensor::zero_grad() { const_cast<TensorImpl&>(checked(*this, "zero_grad")).grad = Tensor(); }

void Tensor::backward(bool retain_graph) const {
  const auto& impl = checked(*this, "backward");
  if (impl.numel != 1) {
    fail<AutogradError>("backward", "implicit gradient needs a one-element output, got ", impl.shape,
                        "; pass the output gradient explicitly");
  }
  backward(ones(impl.shape, Options(impl.dtype, impl.backend)), retain_graph);
}

void Tensor::backward(const Tensor& grad, bool retain_graph) const { autograd::backward(*this, grad, retain_graph); }

Tensor Tensor::detach() const {
  const auto& impl = checked(*this, "detach");
  return detail::strided_alias(*this, impl.shape, impl.strides.data(), impl.offset);
}

const std::shared_ptr<autograd::Node>& Tensor::grad_fn() const { return checked(*this, "grad_fn").grad_fn; }

Tensor Tensor::to(DType dtype) const { return cast(*this, dtype); }

Tensor Tensor::to(Backend& backend) const {
  checked(*this, "to");
  const auto& impl = *impl_of(*this);
  Tensor out = detail::strided_alias(*this, impl.shape, impl.strides.data(), impl.offset);
  impl_of(out)->backend = &backend;
  impl_of(out)->requires_grad = false;
  if (autograd::needs_grad(*this)) {
    autograd::record("to_backend", out, {*this}, {},
                     [from = &this->backend()](const Tensor& g, const autograd::Saved&, autograd::GradMask) {
                       return std::vector<Tensor>{g.to(*from)};
                     });
  }
  return out;
}

Tensor Tensor::clone() const {
  const auto& impl = checked(*this, "clone");
  Tensor out = detail::make_tensor(impl.shape, impl.dtype, *impl.backend, "clone");
  if (impl.contiguous) {
    if (impl.numel) std::memcpy(out.data_ptr(), impl.data(), nbytes());
  } else if (impl.numel) {
    impl.backend->copy(detail::view_of(*this), detail::view_of(out));
  }
  if (autograd::needs_grad(*this)) {
    autograd::record("clone", out, {*this}, {}, [](const Tensor& g, const autograd::Saved&, autograd::GradMask) {
      return std::vector<Tensor>{g};
    });
  }
  return out;
}

namespace {
// Whether a and b are the same elements of one storage in the same order (exact aliasing).
bool same_elements(const Tensor& a, const Tensor& b) {
  const TensorImpl& x = *impl_of(a);
  const TensorImpl& y = *impl_of(b);
  return x.storage == y.storage && x.offset == y.offset && x.shape == y.shape &&
         std::equal(x.strides.begin(), x.strides.begin() + static_cast<std::ptrdiff_t>(x.shape.size()),
                    y.strides.begin());
}

// Every in-place op starts here: refuse to overwrite a tensor the graph may depend on. The write
// is marked for saved-tensor checks (bump_version) only after every other check has passed, right
// before the write: a refused call changes nothing, its version included.
void begin_inplace(const Tensor& self, const char* op) {
  if (!autograd::is_grad_enabled()) return;
  if (self.requires_grad()) {
    fail<AutogradError>(op, "in-place update of a ", self.shape(),
                        " tensor that requires grad; run it under autograd::NoGradGuard");
  }
  if (impl_of(self)->no_grad_view_of_grad) {
    fail<AutogradError>(op, "in-place update of a ", self.shape(),
                        " view taken under no-grad of a tensor that requires grad: with grad mode on it would change "
                        "that tensor outside its graph; run the update under autograd::NoGradGuard too (or take the "
                        "view with grad mode on, where the update is refused as the tensor's own)");
  }
}
// In-place updates are not recorded: under grad mode, an operand that requires grad would lose
// its gradient without a word (buf.copy_(w), then a loss of buf: w's grad stayed undefined).
void require_unrecorded_operand(const Tensor& operand, const char* op) {
  if (operand.requires_grad() && autograd::is_grad_enabled()) {
    fail<AutogradError>(op, "the ", dtype_name(operand.dtype()), " ", operand.shape(),
                        " operand requires grad, but in-place updates are not recorded: its gradient would be lost. "
                        "Use the out-of-place op, or detach() the operand (or run under autograd::NoGradGuard)");
  }
}
}  // namespace

std::uint64_t Tensor::version() const {
  return checked(*this, "version").storage->version.load(std::memory_order_relaxed);
}

void Tensor::bump_version() const {
  checked(*this, "bump_version").storage->version.fetch_add(1, std::memory_order_relaxed);
}

Tensor& Tensor::copy_(const Tensor& source) {
  checked(*this, "copy_");
  detail::require_defined("copy_", source);
  begin_inplace(*this, "copy_");
  require_unrecorded_operand(source, "copy_");
  if (broadcast_shapes(source.shape(), shape(), "copy_") != shape()) {
    fail<ShapeError>("copy_", "source ", source.shape(), " does not broadcast to ", shape());
  }
  detail::require_writable_layout("copy_", *this);
  Tensor src = source.dtype() == dtype() ? source : source.detach().to(dtype());
  bump_version();
  if (same_elements(src, *this)) return *this;  // nothing to move
  // A source that overlaps the destination otherwise (x.copy_(x.transpose(0, 1))) is read
  // whole before anything is written.
  if (detail::may_overlap(src, *this)) src = src.detach().clone();
  backend().copy(detail::broadcast_view(src, shape()), detail::view_of(*this));
  return *this;
}

Tensor& Tensor::fill_(double value) {
  checked(*this, "fill_");
  begin_inplace(*this, "fill_");
  detail::require_writable_layout("fill_", *this);
  detail::require_exact_scalar("fill_", value, *this);  // fill_(2.7) on i64 filled 2
  detail::require_finite_in("fill_", value, dtype(), shape());
  bump_version();
  backend().fill(detail::view_of(*this), value);
  return *this;
}

Tensor& Tensor::add_(const Tensor& other, double alpha) {
  checked(*this, "add_");
  detail::require_defined("add_", other);
  begin_inplace(*this, "add_");
  require_unrecorded_operand(other, "add_");
  if (broadcast_shapes(other.shape(), shape(), "add_") != shape()) {
    fail<ShapeError>("add_", "operand ", other.shape(), " does not broadcast to ", shape());
  }
  detail::require_writable_layout("add_", *this);
  if (dtype() == DType::boolean || other.dtype() == DType::boolean) {
    fail<DTypeError>("add_", "is not defined on bool: a ", dtype_name(other.dtype()), " ", other.shape(),
                     " operand into the ", dtype_name(dtype()), " ", shape(), " tensor (cast to a number type first)");
  }
  if (!is_floating(dtype()) && is_floating(other.dtype())) {
    // The sum would be truncated on its way in (x.add_(1.7) adding 1), as PyTorch refuses too.
    fail<DTypeError>("add_", "cannot add a ", dtype_name(other.dtype()), " ", other.shape(), " operand into the ",
                     dtype_name(dtype()), " ", shape(), " tensor in place (cast one of them first)");
  }
  detail::require_exact_scalar("add_", alpha, *this);
  if (is_floating(dtype()) && other.dtype() == dtype() && alpha != 1.0) {
    // x + alpha * y in one pass with no temporary (Backend::add_scaled; one fused multiply-add,
    // as PyTorch's add with an alpha, where x * alpha and an add rounded twice): SGD's and weight
    // decay's updates read each value once less, and a parameter's update cannot run out of
    // memory after its optimizer state was written.
    Tensor operand = other;
    if (detail::may_overlap(operand, *this) && !same_elements(operand, *this)) operand = operand.detach().clone();
    const View self_view = detail::view_of(*this);
    bump_version();
    backend().add_scaled(detail::broadcast_view(operand, shape()), alpha, self_view);
    return *this;
  }
  if (is_floating(dtype()) && (is_16bit_float(dtype()) || other.dtype() != dtype()) &&
      (alpha != 1.0 || other.dtype() != dtype())) {
    // As x + alpha * y computes it (and PyTorch's add_): in f32 for 16-bit tensors, in the wider
    // of the two float dtypes otherwise, rounded into this tensor once. Converting the operand to
    // this tensor's dtype first, or scaling it there, rounded twice: bf16 0.578125 plus f32 0.037
    // gave 0.6171875 (0.037 became bf16 0.037109375, and the sum a tie rounded up), not 0.61328125.
    const DType wide = other.dtype() == DType::f64 || dtype() == DType::f64 ? DType::f64 : DType::f32;
    Tensor sum;
    {
      autograd::NoGradGuard guard;
      // An integer operand takes this tensor's dtype first, as PyTorch's common dtype of a float
      // tensor and an integer one is the float's: bf16 1 plus i64 257 is 1 + 256 (bf16's value of
      // 257) = 257, rounded to 256; widened straight to f32 it gave 258.
      Tensor scaled = cast(is_floating(other.dtype()) ? other.detach() : cast(other.detach(), dtype()), wide);
      if (alpha != 1.0) scaled = scaled * alpha;
      sum = cast(detach(), wide) + scaled;
    }
    return copy_(sum);
  }
  Tensor operand = other.dtype() == dtype() ? other : other.detach().to(dtype());
  // The binary kernel allows its output to alias an input exactly, never in part.
  if (detail::may_overlap(operand, *this) && !same_elements(operand, *this)) operand = operand.detach().clone();
  if (alpha != 1.0) {
    autograd::NoGradGuard guard;
    operand = operand.detach() * alpha;
  }
  const View self_view = detail::view_of(*this);
  bump_version();
  backend().binary(BinaryOp::add, self_view, detail::broadcast_view(operand, shape()), self_view);
  return *this;
}

Tensor& Tensor::mul_(double factor) {
  checked(*this, "mul_");
  begin_inplace(*this, "mul_");
  detail::require_writable_layout("mul_", *this);
  if (dtype() == DType::boolean) {
    fail<DTypeError>("mul_", "is not defined on the bool ", shape(), " tensor (cast to a number type first)");
  }
  detail::require_exact_scalar("mul_", factor, *this);
  if (is_16bit_float(dtype())) {
    // 16-bit: in f32 and rounded once, as x * factor is (and PyTorch's mul_); the factor rounded
    // to 16 bits first made bf16 0.5625.mul_(0.1) 0.0564 (0.1 became 0.10009765625), not 0.05615.
    Tensor product;
    {
      autograd::NoGradGuard guard;
      product = detach() * factor;
    }
    return copy_(product);
  }
  const Tensor f = detail::arithmetic_scalar_tensor(factor, Options(dtype(), &backend()));
  const View self_view = detail::view_of(*this);
  bump_version();
  backend().binary(BinaryOp::mul, self_view, detail::broadcast_view(f, shape()), self_view);
  return *this;
}

// --- creation ---

Tensor empty(const Shape& shape, Options options) {
  return finish(detail::make_tensor(shape, options.dtype, backend_or_default(options), "empty"), options);
}

namespace {
// full's work, its errors named by the function the caller called (zeros, ones, scalar...).
// `checked`: a finite number the float dtype cannot hold is refused, as for i64 (full(.., 1e39)
// gave infinities); arithmetic's own scalars (x * 1e39) are not, since they overflow as arithmetic.
Tensor filled(const char* op, const Shape& shape, double value, Options options, bool checked = true) {
  check_enum<DTypeError>(options.dtype, op, "dtype");
  // Before allocating: a refused value must not first cost (or fail on) a large allocation.
  detail::require_exact_scalar(op, value, options.dtype, shape);  // full(.., 2.7, i64) gave 2, NaN gave 0
  if (checked) detail::require_finite_in(op, value, options.dtype, shape);
  Tensor t = detail::make_tensor(shape, options.dtype, backend_or_default(options), op);
  if (t.numel()) t.backend().fill(detail::view_of(t), value);
  return finish(std::move(t), options);
}
}  // namespace

Tensor full(const Shape& shape, double value, Options options) { return filled("full", shape, value, options); }
Tensor zeros(const Shape& shape, Options options) { return filled("zeros", shape, 0.0, options); }
Tensor ones(const Shape& shape, Options options) { return filled("ones", shape, 1.0, options); }
Tensor zeros_like(const Tensor& like) {
  detail::require_defined("zeros_like", like);
  return zeros(like.shape(), Options(like.dtype(), &like.backend()));
}
Tensor ones_like(const Tensor& like) {
  detail::require_defined("ones_like", like);
  return ones(like.shape(), Options(like.dtype(), &like.backend()));
}
Tensor scalar(double value, Options options) { return filled("scalar", {}, value, options); }
Tensor detail::arithmetic_scalar_tensor(double value, Options options) {
  return filled("scalar", {}, value, options, false);
}

namespace {
// arange in i64, exactly: through f64, values past 2^53 repeated (2^53, 2^53, 2^53 + 2) and a
// fractional step truncated them ([0, 0, 1, 1] for a step of 0.5). start and step must be integers
// in i64's range (a fractional one is a DTypeError, as for other numbers mixed into i64); end may
// be any finite number, and the values are start + i * step on the side of it that step points.
Tensor arange_i64(double start, double end, double step, const Options& options) {
  using detail::kTwo63;
  auto integer = [&](const char* what, double v) {
    if (v != std::floor(v) || v < -kTwo63 || v >= kTwo63) {
      fail<DTypeError>("arange", "an i64 arange needs an integer ", what, " in i64's range, got ", v);
    }
    return static_cast<std::int64_t>(v);
  };
  const std::int64_t first = integer("start", start), by = integer("step", step);
  // The integer bound that excludes the same values as end does: v < end is v < ceil(end) for an
  // integer v, and v > end is v > floor(end); beyond i64's range, just beyond it (2^63, or
  // -2^63 - 1), so that INT64_MAX and INT64_MIN themselves stay reachable. In 128 bits: 2^63
  // has no i64, and a double cut to one would drop the values above 2^63 - 1024.
  const double edge = step > 0 ? std::ceil(end) : std::floor(end);
  const __int128 last = edge >= kTwo63   ? __int128{1} << 63
                        : edge < -kTwo63 ? -(__int128{1} << 63) - 1
                                         : static_cast<__int128>(static_cast<std::int64_t>(edge));
  const __int128 span = step > 0 ? last - first : first - last, stride = step > 0 ? by : -static_cast<__int128>(by);
  const __int128 count = span <= 0 ? 0 : (span + stride - 1) / stride;
  if (count >= (__int128{1} << 62)) {
    fail<ShapeError>("arange", "[", start, ", ", end, ") in steps of ", step,
                     " has more elements than a tensor can index");
  }
  const auto n = static_cast<std::int64_t>(count);
  Tensor t = detail::make_tensor({n}, DType::i64, backend_or_default(options), "arange");
  std::int64_t* out = t.data<std::int64_t>();
  for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<std::int64_t>(first + static_cast<__int128>(i) * by);
  return t;
}
}  // namespace

Tensor arange(double start, double end, double step, Options options) {
  if (step == 0 || !std::isfinite(start) || !std::isfinite(end) || !std::isfinite(step)) {
    fail<ArgumentError>("arange", "needs finite bounds and a non-zero step, got start ", start, ", end ", end,
                        ", step ", step);
  }
  if (options.dtype == DType::i64) return finish(arange_i64(start, end, step, options), options);
  const double count = std::ceil((end - start) / step);
  if (!(count < 0x1p62)) {
    fail<ShapeError>("arange", "[", start, ", ", end, ") in steps of ", step, " has ", count,
                     " elements, more than a tensor can index");
  }
  const std::int64_t n = count > 0 ? static_cast<std::int64_t>(count) : 0;
  // Made in f64 as a tensor (so a size past memory is an OutOfMemoryError), then cast.
  Tensor t = detail::make_tensor({n}, DType::f64, backend_or_default(options), "arange");
  double* out = t.data<double>();
  for (std::int64_t i = 0; i < n; ++i) out[i] = start + static_cast<double>(i) * step;
  if (options.dtype != DType::f64) t = t.to(options.dtype);
  return finish(std::move(t), options);
}

template <TensorElement T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, Options options) {
  const std::int64_t n = shape_numel(shape, "from_vector");
  if (static_cast<std::int64_t>(values.size()) != n) {
    fail<ShapeError>("from_vector", values.size(), " values do not fill shape ", shape, " (", n, " elements)");
  }
  Tensor t = detail::make_tensor(shape, dtype_of<T>(), backend_or_default(options), "from_vector");
  if constexpr (std::is_same_v<T, bool>) {
    auto* out = static_cast<std::uint8_t*>(t.data_ptr());
    for (std::int64_t i = 0; i < n; ++i) out[i] = values[i] ? 1 : 0;
  } else if (n) {
    std::memcpy(t.data_ptr(), values.data(), static_cast<std::size_t>(n) * sizeof(T));
  }
  return finish(std::move(t), options);
}

Tensor from_values(const std::vector<double>& values, const Shape& shape, Options options) {
  const std::int64_t n = shape_numel(shape, "from_values");
  if (static_cast<std::int64_t>(values.size()) != n) {  // (from_vector's error named from_vector)
    fail<ShapeError>("from_values", values.size(), " values do not fill shape ", shape, " (", n, " elements)");
  }
  if (options.dtype == DType::i64) {
    // A cast saturates (NaN to 0), as a cast should; a constructor given a value that no i64
    // holds is given bad input, refused as full() and fill_() refuse it (and PyTorch's
    // torch.tensor does). Fractions truncate toward zero, as there.
    for (std::size_t i = 0; i < values.size(); ++i) {
      const double v = values[i];
      if (!(v >= -detail::kTwo63 && v < detail::kTwo63)) {
        fail<DTypeError>("from_values", "value ", i, " (", v, ") is not an i64 value, for an i64 tensor of shape ",
                         shape, " (cast an f64 tensor to saturate)");
      }
    }
  }
  Tensor t = from_vector(values, shape, Options(DType::f64, options.backend));
  if (options.dtype != DType::f64) t = t.to(options.dtype);
  return finish(std::move(t), options);
}

Tensor from_buffer(const void* data, const Shape& shape, DType dtype, Options options) {
  Tensor t = detail::make_tensor(shape, dtype, backend_or_default(options), "from_buffer");
  if (t.numel()) {
    if (!data) fail<ArgumentError>("from_buffer", "null data for shape ", shape);
    if (dtype == DType::boolean) {
      // A bool is one byte holding 0 or 1 (dtype.h): another byte would print as true yet sum,
      // cast and compare as its own value (as the safetensors reader refuses it too).
      const auto* bytes = static_cast<const unsigned char*>(data);
      const auto* bad = std::find_if(bytes, bytes + t.numel(), [](unsigned char b) { return b > 1; });
      if (bad != bytes + t.numel()) {
        fail<DTypeError>("from_buffer", "byte ", bad - bytes, " of a bool ", shape, " buffer is ",
                         static_cast<int>(*bad), ", not a bool (0 or 1)");
      }
    }
    std::memcpy(t.data_ptr(), data, t.nbytes());
  }
  return finish(std::move(t), options);
}

RUDA_INSTANTIATE(float)
RUDA_INSTANTIATE(double)
RUDA_INSTANTIATE(std::int64_t)
RUDA_INSTANTIATE(bfloat16)
RUDA_INSTANTIATE(float16)
template bool* Tensor::data<bool>() const;
template std::vector<bool> Tensor::to_vector<bool>() const;
template Tensor from_vector<bool>(const std::vector<bool>&, const Shape&, Options);
#undef RUDA_INSTANTIATE

// --- printing ---

namespace {
// Along an axis longer than 2 * kEdge, the first and last kEdge entries print, with "..." between.
constexpr std::int64_t kEdge = 3;

// The values that print, read without the rest: `grid` is the printed shape (each elided axis
// 2 * kEdge long), the values row-major over it. Each combination of heads and tails of the
// elided axes is one small view read on its own, so a [2^40, 2^20] expanded tensor prints from
// 36 values instead of failing to cast all of them to f64. Values are read in their own type:
// i64 through a double would round past 2^53 (and INT64_MAX, rounded up to 2^63, has no long long
// to print as).
template <class V>
std::vector<V> printed_values(const Tensor& t, Shape& grid) {
  autograd::NoGradGuard no_grad;
  const Shape& shape = t.shape();
  grid = shape;
  std::vector<std::size_t> elided;
  for (std::size_t a = 0; a < shape.size(); ++a) {
    if (shape[a] > 2 * kEdge) {
      elided.push_back(a);
      grid[a] = 2 * kEdge;
    }
  }
  std::int64_t count = 1;
  for (const std::int64_t n : grid) count *= n;
  std::vector<V> values(static_cast<std::size_t>(count));
  for (std::size_t halves = 0; halves < (std::size_t{1} << elided.size()); ++halves) {
    Tensor piece = t.detach();
    Shape first(shape.size(), 0);  // where the piece starts in the grid
    for (std::size_t k = 0; k < elided.size(); ++k) {
      const std::size_t a = elided[k];
      const bool tail = (halves >> k) & 1;
      piece = piece.slice(static_cast<std::int64_t>(a), tail ? shape[a] - kEdge : 0, tail ? shape[a] : kEdge);
      first[a] = tail ? kEdge : 0;
    }
    const std::vector<V> part = piece.to_vector<V>();
    const Shape& extent = piece.shape();
    Shape index(shape.size(), 0);  // row-major over the piece
    for (std::size_t i = 0; i < part.size(); ++i) {
      std::int64_t at = 0;
      for (std::size_t a = 0; a < shape.size(); ++a) at = at * grid[a] + first[a] + index[a];
      values[static_cast<std::size_t>(at)] = part[i];
      for (std::size_t a = shape.size(); a-- > 0;) {
        if (++index[a] < extent[a]) break;
        index[a] = 0;
      }
    }
  }
  return values;
}

template <class V>
void print_values(std::ostream& out, const std::vector<V>& values, const Shape& grid, const Shape& shape,
                  std::size_t axis, std::int64_t offset) {
  if (axis == grid.size()) {
    out << values[static_cast<std::size_t>(offset)];
    return;
  }
  std::int64_t stride = 1;
  for (std::size_t i = axis + 1; i < grid.size(); ++i) stride *= grid[i];
  out << '[';
  for (std::int64_t i = 0; i < grid[axis]; ++i) {
    if (i) out << ", ";
    if (grid[axis] != shape[axis] && i == kEdge) out << "..., ";
    print_values(out, values, grid, shape, axis + 1, offset + i * stride);
  }
  out << ']';
}

template <class V>
void print_tensor_values(std::ostream& out, const Tensor& t) {
  Shape grid;
  const std::vector<V> values = printed_values<V>(t, grid);
  print_values(out, values, grid, t.shape(), 0, 0);
}
}  // namespace

std::ostream& operator<<(std::ostream& out, const Tensor& t) {
  if (!t.defined()) return out << "tensor(undefined)";
  // The values first, into a string: an error reading them leaves the stream as it was.
  std::ostringstream body;
  body.copyfmt(out);  // the caller's precision and flags
  switch (t.dtype()) {
    case DType::i64:
      print_tensor_values<std::int64_t>(body, t);
      break;
    case DType::boolean:  // 0 and 1
      print_tensor_values<bool>(body, t);
      break;
    case DType::f32:
    case DType::f64:
    case DType::f16:
    case DType::bf16:
      print_tensor_values<double>(body, t);
      break;
  }
  out << "tensor(" << dtype_name(t.dtype()) << ' ' << to_string(t.shape()) << ", " << body.str();
  if (t.requires_grad()) out << ", requires_grad";
  return out << ')';
}

std::string to_string(const Tensor& t) {
  std::ostringstream s;
  s << t;
  return s.str();
}

}  // namespace ruda
