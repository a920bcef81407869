// Sums over the innermost axis on oneDNN's reduction primitive, and softmax / log_softmax
// forward and backward on its softmax (v2) primitives.
#include <algorithm>
#include <atomic>
#include <vector>

#include "context.h"
#include "eigen/kernel_util.h"
#include "kernel_policy.h"
#include "onednn_backend.h"

namespace ruda::onednn {

using namespace detail;
using dnnl::algorithm;
using dnnl::memory;

namespace {

// The longest line oneDNN sums in a dtype. Its f32 accumulators take up to line / 16 additions
// each: for 2^16 bf16 or f16 values ~2.4e-4 relative, well inside their rounding (bf16's half ulp
// is 3.9e-3); f32 (which runs there only with RUDA_ONEDNN_KERNELS=all) keeps to 2^12, where 20000
// values of 0.1 already read 1999.98.
std::int64_t longest_accurate_sum(DType dtype) {
  return dtype == DType::f32 ? std::int64_t{1} << 12 : std::int64_t{1} << 16;
}
// Longer lines go to the Eigen kernels. The same accumulators sum a softmax line (its normalizer,
// its backward's sum of dy * y): over a line of 1e6 f32 values the probabilities added up to
// 1 + 2.3e-6 (Eigen's kernel: within 1e-7).
constexpr const char* kLongLineReason = "a line longer than oneDNN's f32 accumulation keeps to the dtype's precision";

const char* unsupported_reduction(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return nullptr;
    case ReduceOp::max:
    case ReduceOp::min:
      return "oneDNN's max/min reductions do not propagate NaN";
    case ReduceOp::logsumexp:
      return "oneDNN 2.6 has no logsumexp reduction";
    case ReduceOp::argmax:
    case ReduceOp::argmin:
      return "oneDNN 2.6 has no index-returning reduction";
  }
  return "unknown reduction";
}

memory::dims dense_strides(const memory::dims& dims) {
  memory::dims strides(dims.size());
  memory::dim s = 1;
  for (std::size_t i = dims.size(); i-- > 0;) {
    strides[i] = s;
    s *= dims[i];
  }
  return strides;
}

}  // namespace

void OneDnnBackend::reduce(ReduceOp op, const View& x, const View& out) {
  if (const char* why = unsupported_reduction(op)) {
    note_fallback(op_name(op), x.dtype, why);
    return EigenBackend::reduce(op, x, out);
  }
  const auto type = dnnl_type(x.dtype);
  if (!type || x.dtype != out.dtype) {
    note_fallback(op_name(op), x.dtype, "oneDNN 2.6 has no reduction for this dtype");
    return EigenBackend::reduce(op, x, out);
  }
  if (x.numel() < kMinElements) {
    note_fallback(op_name(op), x.dtype, kSmallReason);
    return EigenBackend::reduce(op, x, out);
  }
  if (!x.is_contiguous() || !out.is_contiguous()) {
    note_fallback(op_name(op), x.dtype, "a strided reduction operand");
    return EigenBackend::reduce(op, x, out);
  }
  // Both contiguous: drop extent-1 axes and merge neighbouring axes that are all reduced or all
  // kept ([8, 16, 32] over axis 0 is [8, 512] over axis 0).
  std::vector<std::int64_t> extents;
  std::vector<bool> reduced;
  for (int d = 0; d < x.ndim; ++d) {
    if (x.shape[d] == 1) continue;
    const bool r = out.shape[d] == 1;
    if (!reduced.empty() && reduced.back() == r) {
      extents.back() *= x.shape[d];
    } else {
      extents.push_back(x.shape[d]);
      reduced.push_back(r);
    }
  }
  const auto runs = std::count(reduced.begin(), reduced.end(), true);
  if (runs != 1) {
    // None: nothing folds, a plain copy. Several: the Eigen backend folds one run at a time and
    // calls back into this function for each, so every fold still runs on oneDNN.
    return EigenBackend::reduce(op, x, out);
  }
  // One run of reduced axes: x is [outer, r, inner].
  std::int64_t outer = 1, r = 1, inner = 1;
  bool seen = false;
  for (std::size_t i = 0; i < extents.size(); ++i) {
    if (reduced[i]) {
      r = extents[i];
      seen = true;
    } else {
      (seen ? inner : outer) *= extents[i];
    }
  }
  if (inner > 1) {
    // oneDNN 2.6 has only its reference kernel for sums over any axis but the innermost. A
    // product with a row of ones ([1, r] @ [r, inner]) was measured too: 0.4-0.9x of the Eigen
    // kernel's speed for typical widths (1024 and more), so Eigen keeps these.
    note_fallback(op_name(op), x.dtype, "oneDNN 2.6 sums only the innermost axis with a jit kernel");
    return EigenBackend::reduce(op, x, out);
  }
  if (eigen_faster_innermost_sum(x.dtype)) {
    note_fallback(op_name(op), x.dtype, kEigenFasterReason);
    return EigenBackend::reduce(op, x, out);
  }
  if (r > longest_accurate_sum(x.dtype)) {
    // oneDNN's f32 accumulators drift on long lines: 20M bf16 values of 0.1 summed 1.5 bf16 ulps
    // off (2023424 for 2001953, where 1998848 is the nearest bf16); Eigen's kernel sums in double.
    note_fallback(op_name(op), x.dtype, kLongLineReason);
    return EigenBackend::reduce(op, x, out);
  }
  const memory::dims src_dims = outer == 1 ? memory::dims{r} : memory::dims{outer, r};
  const memory::dims dst_dims = outer == 1 ? memory::dims{1} : memory::dims{outer, 1};
  Key key;
  key << std::int64_t{5} << static_cast<std::int64_t>(x.dtype) << outer << r;
  const auto p = lookup(key, threads_for(x.numel()), [&] {
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::reduction::desc desc(algorithm::reduction_sum, memory::desc(src_dims, *type, dense_strides(src_dims)),
                                     memory::desc(dst_dims, *type, dense_strides(dst_dims)), 0.0f, 0.0f);
    return make_primitive(dnnl::reduction::primitive_desc(desc, attr, cpu_engine()), {DNNL_ARG_SRC, DNNL_ARG_DST});
  });
  if (p->refused()) {
    note_fallback(op_name(op), x.dtype, p->refusal + " for " + dims_string(src_dims) + " to " + dims_string(dst_dims));
    return EigenBackend::reduce(op, x, out);
  }
  execute(p, {{DNNL_ARG_SRC, x.data}, {DNNL_ARG_DST, out.data}});
}

// --- softmax ---

namespace {

// x as [outer, n, inner] over its middle axis ([outer, n] when the axis is the last one).
memory::desc softmax_desc(const View& x, int axis, memory::data_type type) {
  std::int64_t outer = 1, inner = 1;
  for (int d = 0; d < axis; ++d) outer *= x.shape[d];
  for (int d = axis + 1; d < x.ndim; ++d) inner *= x.shape[d];
  const memory::dims dims = inner == 1 ? memory::dims{outer, x.shape[axis]} : memory::dims{outer, x.shape[axis], inner};
  return memory::desc(dims, type, dense_strides(dims));
}

Key softmax_key(std::int64_t kind, const View& x, int axis, bool log) {
  std::int64_t outer = 1, inner = 1;
  for (int d = 0; d < axis; ++d) outer *= x.shape[d];
  for (int d = axis + 1; d < x.ndim; ++d) inner *= x.shape[d];
  Key key;
  key << kind << std::int64_t{log} << static_cast<std::int64_t>(x.dtype) << outer << x.shape[axis] << inner;
  return key;
}

algorithm softmax_algorithm(bool log) { return log ? algorithm::softmax_log : algorithm::softmax_accurate; }

// oneDNN 2.6's softmax turns a line holding NaN or +inf into [0, NaN, 0, ...] ([-inf, NaN, ...]
// for log_softmax), where the softmax of such a line is NaN throughout: its normalizer is NaN
// (inf - inf), as PyTorch and the Eigen kernel have it. A NaN in y marks such a line, and only
// such a line (a finite line has no NaN in oneDNN's result, nor one of -infs only, which it
// makes NaN throughout already), so lines with a NaN become all NaN. The check reads y once, as
// integers (a NaN's magnitude bits are above the infinity's), in a loop the compiler vectorizes.
template <class Bits>
bool any_nan(const Bits* p, std::int64_t n, Bits infinity) {
  constexpr Bits kMagnitude = static_cast<Bits>(static_cast<Bits>(~Bits{0}) >> 1);  // (~ promotes to int)
  unsigned found = 0;
  for (std::int64_t i = 0; i < n; ++i) found |= static_cast<unsigned>((p[i] & kMagnitude) > infinity);
  return found != 0;
}

// Lines of `marks` (y) holding a NaN become NaN throughout in `p` (y itself, or the gradient of
// such a line: log_softmax's backward, gy - exp(y) sum(gy), read oneDNN's exp(NaN) as +inf and
// gave -inf where PyTorch and the Eigen kernel give NaN).
template <class Bits>
void nan_lines_to_nan(const Bits* marks, Bits* p, const View& y, int axis, Bits infinity) {
  std::int64_t outer = 1, inner = 1;
  for (int d = 0; d < axis; ++d) outer *= y.shape[d];
  for (int d = axis + 1; d < y.ndim; ++d) inner *= y.shape[d];
  const std::int64_t n = y.shape[axis];
  std::atomic<bool> any{false};
  kernels::parallel_for(y.numel(), kernels::kElementGrain, [&](std::int64_t begin, std::int64_t end) {
    if (any_nan(marks + begin, end - begin, infinity)) any.store(true, std::memory_order_relaxed);
  });
  if (!any.load(std::memory_order_relaxed)) return;
  const Bits nan = static_cast<Bits>(infinity | (infinity >> 1));  // the quiet NaN: exponent and top fraction bit
  for (std::int64_t o = 0; o < outer; ++o) {
    for (std::int64_t j = 0; j < inner; ++j) {
      const std::int64_t first = o * n * inner + j;
      bool found = false;
      for (std::int64_t i = 0; i < n && !found; ++i) found = any_nan(marks + first + i * inner, 1, infinity);
      if (found) {
        for (std::int64_t i = 0; i < n; ++i) p[first + i * inner] = nan;
      }
    }
  }
}

void nan_lines_to_nan(const View& marks, const View& out, int axis) {
  switch (out.dtype) {
    case DType::f32:
      return nan_lines_to_nan(marks.ptr<const std::uint32_t>(), out.ptr<std::uint32_t>(), out, axis,
                              std::uint32_t{0x7f800000});
    case DType::bf16:
      return nan_lines_to_nan(marks.ptr<const std::uint16_t>(), out.ptr<std::uint16_t>(), out, axis,
                              std::uint16_t{0x7f80});
    case DType::f16:
      return nan_lines_to_nan(marks.ptr<const std::uint16_t>(), out.ptr<std::uint16_t>(), out, axis,
                              std::uint16_t{0x7c00});
    case DType::f64:
    case DType::i64:
    case DType::boolean:
      fail<DTypeError>("softmax", "no oneDNN softmax for ", dtype_name(out.dtype));
  }
}

}  // namespace

void OneDnnBackend::softmax(const View& x, const View& y, int axis, bool log) {
  const char* name = log ? "log_softmax" : "softmax";
  if (log) {
    // Not overridden by RUDA_ONEDNN_KERNELS=all (like the log and exp forwards): oneDNN 2.6's
    // log_softmax is inexact near 0 (a line of one value read +1.4e-6, a log-probability above
    // 0, and most lines of two f32 values were off by more than PyTorch's error).
    note_fallback(name, x.dtype, "oneDNN 2.6's log_softmax is inexact near 0 (a line of one value gave +1.4e-6)");
    return EigenBackend::softmax(x, y, axis, log);
  }
  const auto type = dnnl_type(x.dtype);
  if (!type) {
    note_fallback(name, x.dtype, "oneDNN 2.6 has no softmax for this dtype");
    return EigenBackend::softmax(x, y, axis, log);
  }
  if (x.numel() < kMinElements) {
    note_fallback(name, x.dtype, kSmallReason);
    return EigenBackend::softmax(x, y, axis, log);
  }
  if (x.dtype == DType::bf16) {
    // Not overridden by RUDA_ONEDNN_KERNELS=all either: oneDNN 2.6's bf16 softmax rounds twice
    // (1 ulp off the once-rounded value on about a quarter of the weights of random lines, up to
    // 0.86 of bf16's epsilon; PyTorch and the Eigen kernel compute in f32 and round once).
    note_fallback(name, x.dtype, "oneDNN 2.6's bf16 softmax rounds twice (1 ulp off on ~1/4 of the values)");
    return EigenBackend::softmax(x, y, axis, log);
  }
  if (eigen_faster_softmax(x.dtype)) {
    note_fallback(name, x.dtype, kEigenFasterReason);
    return EigenBackend::softmax(x, y, axis, log);
  }
  if (x.shape[axis] > longest_accurate_sum(x.dtype)) {
    note_fallback(name, x.dtype, kLongLineReason);
    return EigenBackend::softmax(x, y, axis, log);
  }
  const auto p = lookup(softmax_key(6, x, axis, log), threads_for(x.numel()), [&] {
    const memory::desc md = softmax_desc(x, axis, *type);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::softmax_v2_forward::desc desc(dnnl::prop_kind::forward_training, softmax_algorithm(log), md, md, 1);
    return make_primitive(dnnl::softmax_v2_forward::primitive_desc(desc, attr, cpu_engine()),
                          {DNNL_ARG_SRC, DNNL_ARG_DST});
  });
  if (p->refused()) {
    note_fallback(name, x.dtype,
                  p->refusal + " for " + dims_string(softmax_desc(x, axis, *type).dims()) + " over axis 1");
    return EigenBackend::softmax(x, y, axis, log);
  }
  execute(p, {{DNNL_ARG_SRC, x.data}, {DNNL_ARG_DST, y.data}});
  nan_lines_to_nan(y, y, axis);
}

void OneDnnBackend::softmax_backward(const View& y, const View& gy, const View& gx, int axis, bool log) {
  const char* name = log ? "log_softmax backward" : "softmax backward";
  const auto type = dnnl_type(y.dtype);
  if (!type) {
    note_fallback(name, y.dtype, "oneDNN 2.6 has no softmax backward for this dtype");
    return EigenBackend::softmax_backward(y, gy, gx, axis, log);
  }
  if (y.numel() < kMinElements) {
    note_fallback(name, y.dtype, kSmallReason);
    return EigenBackend::softmax_backward(y, gy, gx, axis, log);
  }
  if (y.dtype == DType::bf16) {
    // As the forward: the Eigen kernel computes a bf16 line in f32 and rounds once (oneDNN's had
    // 1.4x PyTorch's count of gradients more than 1 ulp off an f64 reference).
    note_fallback(name, y.dtype, "oneDNN 2.6's bf16 softmax backward rounds more than once");
    return EigenBackend::softmax_backward(y, gy, gx, axis, log);
  }
  if (y.shape[axis] > longest_accurate_sum(y.dtype)) {
    note_fallback(name, y.dtype, kLongLineReason);
    return EigenBackend::softmax_backward(y, gy, gx, axis, log);
  }
  const auto p = lookup(softmax_key(7, y, axis, log), threads_for(y.numel()), [&] {
    const memory::desc md = softmax_desc(y, axis, *type);
    const dnnl::softmax_v2_forward::primitive_desc hint(
        dnnl::softmax_v2_forward::desc(dnnl::prop_kind::forward_training, softmax_algorithm(log), md, md, 1),
        cpu_engine());
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::softmax_v2_backward::desc desc(softmax_algorithm(log), md, md, md, 1);
    return make_primitive(dnnl::softmax_v2_backward::primitive_desc(desc, attr, cpu_engine(), hint),
                          {DNNL_ARG_DST, DNNL_ARG_DIFF_DST, DNNL_ARG_DIFF_SRC});
  });
  if (p->refused()) {
    note_fallback(name, y.dtype,
                  p->refusal + " for " + dims_string(softmax_desc(y, axis, *type).dims()) + " over axis 1");
    return EigenBackend::softmax_backward(y, gy, gx, axis, log);
  }
  execute(p, {{DNNL_ARG_DST, y.data}, {DNNL_ARG_DIFF_DST, gy.data}, {DNNL_ARG_DIFF_SRC, gx.data}});
  if (log) nan_lines_to_nan(y, gx, axis);
}

}  // namespace ruda::onednn
