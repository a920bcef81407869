// Helpers for whole-buffer kernels: dtype dispatch, 16-bit load/store, strided iteration over
// broadcast operands, and the parallel loop. Private to the backends.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include <ruda/backend.h>
#include <ruda/dtype.h>
#include <ruda/error.h>

#include "internal.h"

#ifdef RUDA_HAVE_OPENMP
#include <omp.h>
#endif

namespace ruda::kernels {

// --- element types ---

template <class T>
using Num = ElementTraits<T>;
template <class T>
using compute_t = typename Num<T>::Compute;

/// Calls f(T{}) with T the storage type of a float dtype.
template <class F>
decltype(auto) dispatch_float(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::f32:
      return f(float{});
    case DType::f64:
      return f(double{});
    case DType::bf16:
      return f(bfloat16{});
    case DType::f16:
      return f(float16{});
    default:
      fail<DTypeError>(op, "has no kernel for ", dtype_name(dtype));
  }
}

/// Calls f(T{}) for every dtype that has arithmetic (floats and i64).
template <class F>
decltype(auto) dispatch_arith(DType dtype, const char* op, F&& f) {
  if (dtype == DType::i64) return f(std::int64_t{});
  return dispatch_float(dtype, op, std::forward<F>(f));
}

/// Calls f(T{}) for every dtype (bool as std::uint8_t).
template <class F>
decltype(auto) dispatch_all(DType dtype, const char* op, F&& f) {
  if (dtype == DType::boolean) return f(std::uint8_t{});
  return dispatch_arith(dtype, op, std::forward<F>(f));
}

// --- threads ---

/// Whether the calling thread is inside an OpenMP region of more than one thread (where a nested
/// region gets one thread: libraries such as Eigen then stay single-threaded).
inline bool in_parallel_region() {
#ifdef RUDA_HAVE_OPENMP
  return omp_in_parallel() != 0;
#else
  return false;
#endif
}

/// An OutOfMemoryError for a std::bad_alloc from inside a library's code (Eigen's GEMM buffers),
/// which no ruda::Error handler (nor auto-fit) would see; `op` names the kernel.
OutOfMemoryError library_memory_refused(const char* op);

/// Runs body(begin, end) over [0, total) split into one contiguous chunk per thread, or inline
/// when the work is smaller than `grain` elements (small ops must not pay for a parallel region).
/// An exception from a chunk (a scratch allocation that fails, a kernel's own check) is rethrown
/// on the calling thread after the region: none may leave an OpenMP region, where it would end
/// the process in std::terminate. The first one thrown wins; the other chunks run to their end.
/// A std::bad_alloc arrives as library_memory_refused's OutOfMemoryError.
template <class Body>
void parallel_for(std::int64_t total, [[maybe_unused]] std::int64_t grain, Body&& body) {
  if (total <= 0) return;
#ifdef RUDA_HAVE_OPENMP
  const int threads = static_cast<int>(std::min<std::int64_t>(num_threads(), (total + grain - 1) / grain));
  if (threads > 1) {
    std::exception_ptr error;
#pragma omp parallel num_threads(threads)
    {
      const std::int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
      const std::int64_t begin = total * t / n, end = total * (t + 1) / n;
      try {
        if (begin < end) body(begin, end);
      } catch (const std::bad_alloc&) {
#pragma omp critical(ruda_parallel_for_error)
        if (!error) error = std::make_exception_ptr(library_memory_refused("parallel kernel"));
      } catch (...) {
#pragma omp critical(ruda_parallel_for_error)
        if (!error) error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
#endif
  try {
    body(std::int64_t{0}, total);
  } catch (const std::bad_alloc&) {
    throw library_memory_refused("kernel");
  }
}

/// Throws OutOfMemoryError for `bytes` of a kernel's working memory that the system refused: the
/// tracker does not count a kernel's scratch, so without this a failed allocation reached callers
/// as std::bad_alloc, which is no ruda::Error (a caller that catches OutOfMemoryError to retry
/// smaller, as auto-fit does, missed it).
[[noreturn]] void scratch_refused(std::size_t bytes);

/// A kernel's scratch memory: on 64-byte boundaries (a vectorized loop's peeling, and so its
/// summation order, then does not depend on malloc's alignment), and OutOfMemoryError when the
/// system refuses it.
template <class T>
struct ScratchAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  ScratchAllocator() = default;
  template <class U>
  ScratchAllocator(const ScratchAllocator<U>&) noexcept {}  // NOLINT: rebinding is implicit
  T* allocate(std::size_t n) {
    if (n > std::numeric_limits<std::size_t>::max() / sizeof(T))
      scratch_refused(std::numeric_limits<std::size_t>::max());
    // The non-throwing form: AddressSanitizer ends the process when the throwing one fails.
    void* p = ::operator new(n * sizeof(T), kAlign, std::nothrow);
    if (!p) scratch_refused(n * sizeof(T));
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, kAlign); }
  template <class U>
  bool operator==(const ScratchAllocator<U>&) const noexcept {
    return true;
  }
};
template <class T>
using Scratch = std::vector<T, ScratchAllocator<T>>;

/// Charges a kernel's own working memory of `n` values of `dtype` to the calling thread's rank, as a
/// tensor of that size would be (its tracker and its limit: OutOfMemoryError naming `op`), while the
/// returned charge lives: for scratch as large as a tensor or a tensor's slice (a reduction's
/// intermediate, per-thread accumulators of a whole sequence), which would otherwise pass the
/// limit unseen and be missing from the memory plan's measured step. Take it on the calling
/// thread, before any parallel region: OpenMP's threads belong to no rank.
inline detail::Charge charge_working_memory(std::int64_t n, DType dtype, const char* op) {
  return detail::Charge(static_cast<std::size_t>(n) * dtype_size(dtype), op, Shape{n}, dtype);
}

/// n f32 values charged to the calling thread's rank as a tensor of that size would be (its
/// tracker and its limit: OutOfMemoryError naming `op`), not zeroed: for working copies as large
/// as tensors, such as the f32 copies of a 16-bit product's operands, which scratch memory left
/// uncounted (a [4096, 4096] bf16 product's were 200 MB past a limit the tracker said held, and
/// the memory plan under-read a bf16 run on the Eigen backend by 118 MB).
class WideBuffer {
 public:
  WideBuffer(std::int64_t n, const char* op)
      : storage_(
            std::make_unique<detail::Storage>(static_cast<std::size_t>(n) * sizeof(float), op, Shape{n}, DType::f32)),
        size_(n) {}
  float* data() const noexcept { return static_cast<float*>(storage_->data); }
  std::int64_t size() const noexcept { return size_; }
  float& operator[](std::int64_t i) const noexcept { return data()[i]; }

 private:
  std::unique_ptr<detail::Storage> storage_;
  std::int64_t size_;
};

/// The sum of value(0 .. n) in 16 interleaved partial sums, combined pairwise: the compiler
/// vectorizes it (a plain running sum is one dependent add per element, which it may not
/// reorder), and, unlike Eigen's reductions, whose order follows each row's address alignment,
/// the order depends on n alone, so a row gives the same bits wherever it lives.
template <class S, class Value>
S lane_sum(std::int64_t n, Value&& value) {
  constexpr int kLanes = 16;
  S lanes[kLanes] = {};
  std::int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += value(j + l);
  }
  S tail = 0;
  for (; j < n; ++j) tail += value(j);
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0] + tail;
}

/// The sum of value(0 .. n) for lines of any length, in double: runs of kSumRun values by
/// lane_sum in S (vectorized), the runs' sums added in double. lane_sum alone adds n/16 values
/// into each of its partial sums, an error that grows with the line: a LayerNorm row of 1e6 f32
/// values 1000 + randn lost 58x the digits of a pairwise sum, a softmax row's total 6x. As fast,
/// and the order still depends on n alone (a row gives the same bits wherever it lives).
inline constexpr std::int64_t kSumRun = 256;
template <class S, class Value>
double sum_in_runs(std::int64_t n, Value&& value) {
  double total = 0;
  for (std::int64_t r = 0; r < n; r += kSumRun) {
    total +=
        static_cast<double>(lane_sum<S>(std::min(kSumRun, n - r), [&](std::int64_t i) -> S { return value(r + i); }));
  }
  return total;
}
/// sum_in_runs rounded to S once.
template <class S, class Value>
S long_sum(std::int64_t n, Value&& value) {
  return static_cast<S>(sum_in_runs<S>(n, std::forward<Value>(value)));
}

/// Elements per thread below which elementwise kernels stay on one thread.
inline constexpr std::int64_t kElementGrain = 32768;

/// Calls f with an unsigned integer of `size` bytes (1, 2, 4 or 8; 8 for any other): kernels
/// that move values without reading them as numbers (copies, gathers, selects) run once per
/// element size, whatever the dtype.
template <class F>
void dispatch_bits(std::size_t size, F&& f) {
  switch (size) {
    case 1:
      return f(std::uint8_t{});
    case 2:
      return f(std::uint16_t{});
    case 4:
      return f(std::uint32_t{});
    default:
      return f(std::uint64_t{});
  }
}

// --- strided iteration ---

/// K operands sharing one logical shape, with dimensions of extent 1 dropped and adjacent
/// dimensions merged wherever every operand is contiguous across them.
template <int K>
struct Layout {
  int ndim = 0;
  std::int64_t shape[kMaxDims];
  std::int64_t strides[K][kMaxDims];

  explicit Layout(const View* const (&views)[K]) {
    const View& first = *views[0];
    for (int d = 0; d < first.ndim; ++d) {
      if (first.shape[d] == 1) continue;
      const bool merge = ndim > 0 && [&] {
        for (int k = 0; k < K; ++k) {
          if (strides[k][ndim - 1] != views[k]->strides[d] * first.shape[d]) return false;
        }
        return true;
      }();
      if (merge) {
        shape[ndim - 1] *= first.shape[d];
        for (int k = 0; k < K; ++k) strides[k][ndim - 1] = views[k]->strides[d];
      } else {
        shape[ndim] = first.shape[d];
        for (int k = 0; k < K; ++k) strides[k][ndim] = views[k]->strides[d];
        ++ndim;
      }
    }
    if (ndim == 0) {  // a single element
      ndim = 1;
      shape[0] = 1;
      for (int k = 0; k < K; ++k) strides[k][0] = 1;
    }
  }
  std::int64_t inner_stride(int k) const { return strides[k][ndim - 1]; }
};

/// Calls run(offsets[K], count) for the runs along the innermost dimension that cover logical
/// elements [begin, end), where offsets are each operand's element offset of the run's start.
template <int K, class Run>
void for_each_run(const Layout<K>& layout, std::int64_t begin, std::int64_t end, Run&& run) {
  const int nd = layout.ndim;
  std::int64_t index[kMaxDims];
  std::int64_t offsets[K] = {};
  std::int64_t rest = begin;
  for (int d = nd - 1; d >= 0; --d) {
    index[d] = rest % layout.shape[d];
    rest /= layout.shape[d];
    for (int k = 0; k < K; ++k) offsets[k] += index[d] * layout.strides[k][d];
  }
  const std::int64_t inner = layout.shape[nd - 1];
  std::int64_t position = begin;
  while (position < end) {
    const std::int64_t count = std::min(inner - index[nd - 1], end - position);
    run(offsets, count);
    position += count;
    for (int k = 0; k < K; ++k) offsets[k] += count * layout.strides[k][nd - 1];
    index[nd - 1] += count;
    // Carry into outer dimensions.
    for (int d = nd - 1; d > 0 && index[d] == layout.shape[d]; --d) {
      for (int k = 0; k < K; ++k) offsets[k] -= layout.shape[d] * layout.strides[k][d];
      index[d] = 0;
      ++index[d - 1];
      for (int k = 0; k < K; ++k) offsets[k] += layout.strides[k][d - 1];
    }
  }
}

}  // namespace ruda::kernels
