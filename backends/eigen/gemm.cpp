// Matrix products through Eigen's GEMM (f32 and f64; 16-bit floats computed in f32).
#include <optional>
#include <vector>

#include <Eigen/Core>

#include "eigen_backend.h"
#include "kernel_util.h"

namespace ruda {

using namespace kernels;

namespace {

template <class T>
using RowMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

template <class T>
using StridedMap = Eigen::Map<const RowMatrix<T>, 0, Eigen::OuterStride<>>;

// Rows [r0, r0 + rows) and columns [c0, c0 + cols) of one product C = alpha * op(A) op(B) +
// beta * C (+ bias), all row-major with row strides.
template <class T>
void gemm_block(const GemmDesc& d, const T* a, const T* b, T* c, const T* bias, Eigen::Index r0, Eigen::Index rows,
                Eigen::Index c0, Eigen::Index cols) {
  const Eigen::Index k = d.k;
  // op(A)'s rows r0.. are stored rows of A, or its columns when A is transposed; op(B)'s columns
  // c0.. likewise.
  StridedMap<T> A(d.trans_a ? a + r0 : a + r0 * d.ld_a(), d.trans_a ? k : rows, d.trans_a ? rows : k,
                  Eigen::OuterStride<>(d.ld_a()));
  StridedMap<T> B(d.trans_b ? b + c0 * d.ld_b() : b + c0, d.trans_b ? cols : k, d.trans_b ? k : cols,
                  Eigen::OuterStride<>(d.ld_b()));
  Eigen::Map<RowMatrix<T>, 0, Eigen::OuterStride<>> C(c + r0 * d.ld_c() + c0, rows, cols,
                                                      Eigen::OuterStride<>(d.ld_c()));
  const T alpha(d.alpha), beta(d.beta);
  auto product = [&](auto&& lhs, auto&& rhs) {
    if (beta == T(0)) {
      C.noalias() = alpha * (lhs * rhs);
    } else {
      if (beta != T(1)) C *= beta;
      C.noalias() += alpha * (lhs * rhs);
    }
  };
  try {
    if (d.trans_a && d.trans_b) {
      product(A.transpose(), B.transpose());
    } else if (d.trans_a) {
      product(A.transpose(), B);
    } else if (d.trans_b) {
      product(A, B.transpose());
    } else {
      product(A, B);
    }
  } catch (const std::bad_alloc&) {
    throw library_memory_refused("gemm");  // Eigen's packing buffers
  }
  if (bias) C.rowwise() += Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(bias + c0, cols);
}

// One product. Eigen's own parallel GEMM allocates each thread's packing buffer inside its OpenMP
// region, where a refused allocation (an address-space limit: ulimit -v, a batch system's h_vmem)
// is a std::bad_alloc no handler can catch: std::terminate ended the process. A product Eigen
// would parallelize (2 x 50000 multiply-adds or more, its rule) is split here instead, into
// panels of C's rows (or columns, when it has more) on ruda's threads, whose parallel_for
// rethrows on the caller; inside that region Eigen stays single-threaded. (Eigen's threads are
// ruda's: set_num_threads sets OpenMP's count.) Each panel packs its own copy of the other
// operand, a k x n pass beside the panel's m/threads x n x k product.
template <class T>
void gemm_one(const GemmDesc& d, const T* a, const T* b, T* c, const T* bias) {
  const Eigen::Index m = d.m, n = d.n;
  const double work = static_cast<double>(d.m) * static_cast<double>(d.n) * static_cast<double>(d.k);
  const bool parallel = work >= 2 * 50000.0 && num_threads() > 1 && !in_parallel_region();
  if (!parallel) {
    gemm_block<T>(d, a, b, c, bias, 0, m, 0, n);
  } else if (m >= n) {
    parallel_for(
        m, 8, [&](std::int64_t begin, std::int64_t end) { gemm_block<T>(d, a, b, c, bias, begin, end - begin, 0, n); });
  } else {
    parallel_for(
        n, 8, [&](std::int64_t begin, std::int64_t end) { gemm_block<T>(d, a, b, c, bias, 0, m, begin, end - begin); });
  }
}

template <class T>
void gemm_batched(const GemmDesc& d, const T* a, const T* b, T* c, const T* bias) {
  // Many small products: one per thread (Eigen then stays single-threaded inside each). Few or
  // large ones: one after another, each split over the threads by gemm_one.
  const bool small = d.m * d.n * d.k < (std::int64_t{1} << 21);
  if (d.batch > 1 && small) {
    parallel_for(d.batch, 1, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) {
        gemm_one<T>(d, a + d.offset_a(i), b + d.offset_b(i), c + d.offset_c(i), bias);
      }
    });
    return;
  }
  for (std::int64_t i = 0; i < d.batch; ++i) {
    gemm_one<T>(d, a + d.offset_a(i), b + d.offset_b(i), c + d.offset_c(i), bias);
  }
}

// n values at p, as f32 in a buffer charged to this rank.
template <class T>
WideBuffer widen(const void* p, std::int64_t n) {
  WideBuffer out(n, "gemm (16-bit operands widened to f32)");
  const T* src = static_cast<const T*>(p);
  for (std::int64_t i = 0; i < n; ++i) out[i] = Num<T>::load(src[i]);
  return out;
}

}  // namespace

// The epilogue over every result matrix, with the backend's own elementwise kernel (in place).
void EigenBackend::apply_epilogue(const GemmDesc& d, void* c, DType dtype) {
  UnaryOp f = UnaryOp::gelu_erf;
  switch (d.epilogue) {
    case GemmEpilogue::none:
      return;
    case GemmEpilogue::gelu_erf:
      f = UnaryOp::gelu_erf;
      break;
    case GemmEpilogue::gelu_tanh:
      f = UnaryOp::gelu_tanh;
      break;
  }
  if (d.ld_c() == d.n && d.batch_inner <= 1 && (d.batch == 1 || d.batch_stride_c == d.m * d.n)) {
    // One dense block: one kernel call over every batch.
    View v;
    v.data = c;
    v.dtype = dtype;
    v.ndim = 1;
    v.shape = {d.batch * d.m * d.n};
    v.strides = {1};
    unary(f, v, v);
    return;
  }
  // Otherwise one dense run at a time (the unary kernel's contract is contiguous).
  const bool dense_rows = d.ld_c() == d.n;
  const auto item = static_cast<std::int64_t>(dtype_size(dtype));
  for (std::int64_t i = 0; i < d.batch; ++i) {
    for (std::int64_t r = 0; r < (dense_rows ? 1 : d.m); ++r) {
      View v;
      v.data = static_cast<char*>(c) + (d.offset_c(i) + r * d.ld_c()) * item;
      v.dtype = dtype;
      v.ndim = 1;
      v.shape = {dense_rows ? d.m * d.n : d.n};
      v.strides = {1};
      unary(f, v, v);
    }
  }
}

void EigenBackend::gemm(const GemmDesc& d) {
  if (d.a_dtype != d.b_dtype)
    fail<DTypeError>("gemm", "operand dtypes differ: ", dtype_name(d.a_dtype), " and ", dtype_name(d.b_dtype));
  num_threads();  // applies this thread's intra-op thread count before Eigen reads it
  if (d.a_dtype == d.c_dtype && (d.a_dtype == DType::f32 || d.a_dtype == DType::f64)) {
    if (d.a_dtype == DType::f32) {
      gemm_batched<float>(d, static_cast<const float*>(d.a), static_cast<const float*>(d.b), static_cast<float*>(d.c),
                          static_cast<const float*>(d.bias));
    } else {
      gemm_batched<double>(d, static_cast<const double*>(d.a), static_cast<const double*>(d.b),
                           static_cast<double*>(d.c), static_cast<const double*>(d.bias));
    }
    apply_epilogue(d, d.c, d.c_dtype);
    return;
  }
  // 16-bit operands (or a 16-bit result): compute in f32, round the result once.
  const std::int64_t na = d.span_a(), nb = d.span_b(), nc = d.span_c();
  auto widen_any = [](DType t, const void* p, std::int64_t n) {
    return dispatch_float(t, "gemm", [&](auto tag) { return widen<decltype(tag)>(p, n); });
  };
  const WideBuffer a = widen_any(d.a_dtype, d.a, na);
  const WideBuffer b = widen_any(d.b_dtype, d.b, nb);
  // Read back when C has gaps too, so the rounding pass below rewrites them unchanged.
  const bool read_c = d.beta != 0.0f || nc != d.batch * d.m * d.n;
  const WideBuffer c = read_c ? widen_any(d.c_dtype, d.c, nc) : WideBuffer(nc, "gemm (16-bit result in f32)");
  if (!read_c) std::fill(c.data(), c.data() + nc, 0.0f);
  std::optional<WideBuffer> bias;
  if (d.bias) bias.emplace(widen_any(d.c_dtype, d.bias, d.n));
  gemm_batched<float>(d, a.data(), b.data(), c.data(), bias ? bias->data() : nullptr);
  apply_epilogue(d, c.data(), DType::f32);  // in f32, before the one rounding
  dispatch_float(d.c_dtype, "gemm", [&](auto tag) {
    using T = decltype(tag);
    T* out = static_cast<T*>(d.c);
    for (std::int64_t i = 0; i < nc; ++i) out[i] = Num<T>::store(c[i]);
  });
}

}  // namespace ruda
