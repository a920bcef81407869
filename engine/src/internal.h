// Engine internals shared by the op implementations: storage, the tensor object, view helpers.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include <ruda/autograd.h>
#include <ruda/backend.h>
#include <ruda/memory.h>
#include <ruda/tensor.h>

namespace ruda::memory {
// Counters of one tracker; storages keep their tracker alive so frees are charged correctly.
class Tracker {
 public:
  /// Adds `bytes` to the live bytes unless that would take them past `limit` (> 0; 0: no limit);
  /// false when refused. The peak and the allocation count wait for commit().
  bool try_reserve(std::int64_t bytes, std::int64_t limit) noexcept;
  /// A reserved allocation was made: counts it and raises the peak to the live bytes now.
  void commit() noexcept;
  void remove(std::int64_t bytes) noexcept;
  Stats stats() const noexcept;
  void reset_peak() noexcept;
  /// The tracker of the scope this one's is nested in (null for a thread's outermost scope): an
  /// allocation is charged to it too, within the limit, so that a scope opened inside a rank's
  /// (to measure a section) neither hides its tensors from the rank nor lifts the rank's limit.
  Tracker* parent() const noexcept { return parent_.get(); }
  void set_parent(std::shared_ptr<Tracker> parent) noexcept { parent_ = std::move(parent); }
  /// `tracker`, or the nearest of its parents whose scope has not ended (null: none).
  static std::shared_ptr<Tracker> open(std::shared_ptr<Tracker> tracker) noexcept {
    while (tracker && tracker->closed_.load(std::memory_order_acquire)) tracker = tracker->parent_;
    return tracker;
  }
  /// Its scope ended (~Scope): no thread's allocations are charged to it from then on.
  void close() noexcept { closed_.store(true, std::memory_order_release); }
  bool closed() const noexcept { return closed_.load(std::memory_order_acquire); }

 private:
  std::shared_ptr<Tracker> parent_;
  std::atomic<bool> closed_{false};
  std::atomic<std::int64_t> live_{0};
  std::atomic<std::int64_t> peak_{0};
  std::atomic<std::int64_t> allocations_{0};
};
const std::shared_ptr<Tracker>& current_tracker();
Tracker& process_tracker();
}  // namespace ruda::memory

namespace ruda::detail {

class BlockCache;
/// The process's cache of freed large blocks (memory.cpp).
BlockCache& block_cache();

/// `bytes` charged, while this lives, to the calling thread's tracker (its rank's, and the scopes'
/// it is nested in, each within the limit) and to the process's, as a tensor of that size would be:
/// OutOfMemoryError (naming `op`, the shape and dtype it is for, nothing charged) past a limit.
/// Storage charges its bytes so; a kernel charges its own working memory so where that is as
/// large as a tensor's slice (per-thread accumulators of a whole sequence), which the tracker,
/// the limit and the memory plan's measured step would otherwise not see.
class Charge {
 public:
  Charge(std::size_t bytes, const char* op, const Shape& shape, DType dtype);
  ~Charge();
  Charge(const Charge&) = delete;  // (returned as a prvalue where made for a kernel: never moved)
  Charge& operator=(const Charge&) = delete;

 private:
  friend struct Storage;
  // Storage's two steps: reserve the bytes (the limits checked), allocate, then commit(): only a
  // committed charge counts as an allocation and can raise a peak.
  struct Reserve {};
  Charge(Reserve, std::size_t bytes, const char* op, const Shape& shape, DType dtype);
  void commit() noexcept;
  void release() noexcept;
  std::int64_t bytes_ = 0;                    // 0 once released
  std::shared_ptr<memory::Tracker> tracker_;  // null: the thread is in no scope (the process's alone)
};

/// 64-byte aligned host memory, charged to the allocating thread's tracker (Charge). OutOfMemoryError
/// (naming `op`, the shape and dtype it is for) past the rank's limit or when the system refuses.
struct Storage {
  void* data = nullptr;
  std::size_t bytes = 0;
  // Bumped by every in-place write, so a backward can tell that a tensor it saved has changed.
  // Atomic only so that concurrent readers of a shared storage are not a data race.
  std::atomic<std::uint64_t> version{0};
  Charge charge;
  Storage(std::size_t bytes, const char* op, const Shape& shape, DType dtype);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
};

// A tensor is storage + offset + shape + strides (in elements). Tensors made by ops are
// contiguous row-major; view ops (permute, transpose, slice, expand, and reshape where the strides
// allow) share the storage with other strides. `contiguous` caches is_contiguous(strides).
struct TensorImpl {
  std::shared_ptr<Storage> storage;
  std::int64_t offset = 0;  // in elements
  Shape shape;
  std::array<std::int64_t, kMaxDims> strides{};
  bool contiguous = true;
  std::int64_t numel = 0;
  DType dtype = DType::f32;
  Backend* backend = nullptr;

  bool requires_grad = false;
  // A view taken with grad mode off of a tensor that requires grad (or of such a view): it has no
  // graph, so an in-place write with grad mode on would change that tensor behind its gradient's
  // back; begin_inplace refuses it (PyTorch's no-grad-mode views likewise).
  bool no_grad_view_of_grad = false;
  std::shared_ptr<autograd::Node> grad_fn;
  Tensor grad;
  // The backward (autograd::backward_serial) that last added to `grad` from a node the loss
  // reached (autograd::loss_reached).
  std::uint64_t loss_gradient_serial = 0;
  // Why a backward must not add to this leaf's gradient (autograd::retire_leaf); null while it may.
  std::shared_ptr<const std::string> retired;
  std::shared_ptr<const std::function<Tensor()>> recompute;
  std::weak_ptr<const void> recompute_owner;  // set_recompute's owner

  void* data() const noexcept {
    return static_cast<char*>(storage->data) + offset * static_cast<std::int64_t>(dtype_size(dtype));
  }
};

/// The implementation behind a handle, for the engine's own files (Tensor keeps it private).
struct TensorAccess {
  static TensorImpl* impl(const Tensor& t) noexcept { return t.impl_.get(); }
  static const std::shared_ptr<TensorImpl>& impl_ptr(const Tensor& t) noexcept { return t.impl_; }
};
inline TensorImpl* impl_of(const Tensor& t) noexcept { return TensorAccess::impl(t); }
inline const std::shared_ptr<TensorImpl>& impl_ptr_of(const Tensor& t) noexcept { return TensorAccess::impl_ptr(t); }

/// A new tensor with uninitialized contents; `op` names the allocation in errors.
Tensor make_tensor(const Shape& shape, DType dtype, Backend& backend, const char* op = "tensor");
/// ruda::dropout's keep mask: 1 where draw offset + i of stream `seed` (random::uniform_float) is
/// at least p (as f32), else 0, in the float dtype `dtype` (random.cpp).
Tensor dropout_mask(const Shape& shape, double p, std::uint64_t seed, std::uint64_t offset, DType dtype,
                    Backend& backend);
/// A tensor sharing a contiguous `source`'s storage with another shape and element offset
/// (contiguous too: reshape of a contiguous tensor, a leading block).
Tensor alias(const Tensor& source, const Shape& shape, std::int64_t extra_offset = 0);
/// A view of `source`'s storage with any shape, strides and absolute element offset. Not recorded.
Tensor strided_alias(const Tensor& source, const Shape& shape, const std::int64_t* strides, std::int64_t offset);

/// The kernel view of a tensor, with its own strides (a view op's result is not contiguous).
View view_of(const Tensor& t);
/// A view of t broadcast to `shape` (t's shape must broadcast to it): stride 0 on broadcast axes,
/// t's own strides elsewhere.
View broadcast_view(const Tensor& t, const Shape& shape);
/// Contiguous row-major strides of a shape.
void contiguous_strides(const Shape& shape, std::int64_t* strides);
bool strides_are_contiguous(const Shape& shape, const std::int64_t* strides);

/// t itself when contiguous, else a contiguous copy (not recorded: for the inputs of kernels
/// whose contract is contiguous, and of raw readers). Where an op is differentiable, record the
/// op on the original tensor and hand `dense(t)` to the kernel only.
Tensor dense(const Tensor& t);
/// Whether two tensors' element ranges may overlap in memory (same storage, intersecting spans).
bool may_overlap(const Tensor& a, const Tensor& b);
/// Throws unless an in-place write to t is well defined: no two of its elements share memory
/// (an expanded view, stride 0 on an axis longer than 1: the one overlap view ops make).
void require_writable_layout(const char* op, const Tensor& t);

/// Throws DTypeError unless t is a float tensor.
void require_float(const char* op, const Tensor& t);
/// 2^63: the first double above every i64 (and -2^63 is INT64_MIN itself).
inline constexpr double kTwo63 = 9223372036854775808.0;
/// Throws DTypeError where a number would change value on its way into an integer tensor's
/// arithmetic (x * 0.5 on i64 would multiply by 0): a fraction, NaN, or a value outside i64.
/// Float tensors take any number (converted to their dtype, as documented).
void require_exact_scalar(const char* op, double value, const Tensor& like);
/// The same check for a tensor not made yet (full: checked before its memory is allocated).
void require_exact_scalar(const char* op, double value, DType dtype, const Shape& shape);
/// Throws DTypeError where a finite number becomes infinite in a float dtype (full, fill_).
void require_finite_in(const char* op, double value, DType dtype, const Shape& shape);
/// scalar() without require_finite_in: arithmetic's number operand (x * 1e39 overflows as
/// arithmetic does).
Tensor arithmetic_scalar_tensor(double value, Options options);
/// Throws DTypeError unless a and b have the same dtype.
void require_same_dtype(const char* op, const Tensor& a, const Tensor& b);
void require_defined(const char* op, const Tensor& t);
/// Throws ShapeError when a shape has more than kMaxDims axes.
void require_rank(const char* op, const Shape& shape);
/// Throws IndexError unless `axis` names a scalar's one axis (0 or -1), as PyTorch lets softmax
/// and argmax of a scalar name it (normalize_axis refuses every axis of a scalar).
inline void check_scalar_axis(std::int64_t axis, const char* op) {
  if (axis != 0 && axis != -1) {
    fail<IndexError>(op, "axis ", axis, " is out of range for a tensor with 0 dimensions (a scalar takes 0 or -1)");
  }
}

}  // namespace ruda::detail

namespace ruda::autograd {

struct Edge {
  std::shared_ptr<Node> node;                // the producer's node, or
  std::shared_ptr<detail::TensorImpl> leaf;  // the leaf to accumulate into
  bool connected() const noexcept { return node || leaf; }
};

class Node {
 public:
  Node() = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;
  // Frees the producers this node keeps alive iteratively, however they are shared: destroyed by
  // recursion through `next` and `saved`, a deep graph overflowed the stack.
  ~Node();
  const char* name = "";
  std::uint64_t sequence = 0;
  std::vector<Edge> next;
  Saved saved;
  BackwardFn backward;
  bool always_run = false;
  bool collective = false;  // RecordOptions::collective
  bool strided_grad = false;
  // Set while a backward runs: a gradient from the loss reached this node (see autograd::reached),
  // or (carries) one an unreached collective handed on, which holds other ranks' gradients.
  bool reached = false;
  bool carries = false;
  // RecordOptions::owner, and whether one was given (an empty weak_ptr reads as expired too).
  std::weak_ptr<const void> owner;
  bool has_owner = false;
  // Set by the backward that ran and freed the node; read by another thread's always-run list.
  std::atomic<bool> released{false};
  // What a zero gradient of the output looks like, for always-run nodes the loss does not reach.
  Shape out_shape;
  DType out_dtype = DType::f32;
  Backend* out_backend = nullptr;
  // The gradient accumulated for the output while a backward runs.
  Tensor pending;
  // Set by slice: the input's gradient is the output's inside [start, start + length) of `axis`
  // and zero elsewhere. backward() then adds the output gradient into that region of the input's
  // pending gradient in place, instead of summing one zero-padded full-size gradient per slice
  // (the q, k and v slices of one projection would cost three [B, T, 3C] gradients and two adds).
  struct InputRegion {
    int axis = 0;
    std::int64_t start = 0, length = 0;
  };
  std::optional<InputRegion> input_region;
  // Regions of `pending` written so far, when slices built it (add_into_region): it starts
  // uninitialized, each slice's gradient is copied into a region no other has written yet (and
  // added where one has), and whatever no slice wrote is zeroed before anything else reads it
  // (complete_pending). q, k and v of one projection then cover it whole: no zero fill at all.
  // Empty intervals with `partial` false: pending is whole (or undefined).
  struct WrittenRegions {
    bool partial = false;
    int axis = 0;
    std::vector<std::pair<std::int64_t, std::int64_t>> intervals;  // [begin, end) on axis, sorted, disjoint
  };
  WrittenRegions written;
};

}  // namespace ruda::autograd
