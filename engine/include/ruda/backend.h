// The backend interface: whole-buffer kernels on host memory.
//
// The engine validates shapes and dtypes, allocates outputs and records gradients; a backend only
// computes. Every kernel takes whole tensors as Views (pointer, dtype, shape, strides in elements),
// so there is one virtual call per operation, never per element. Both backends use host memory,
// so a tensor can move between backends without a copy.
//
// Layouts: tensors may be strided views (permute, slice, expand), and each kernel's comment says
// what it takes. fill, copy, binary and where take any strides; gemm reads operands through
// leading dimensions and two batch strides; attention any strides but a contiguous last axis.
// The kernels marked "contiguous" get contiguous inputs: the engine copies a strided one at its
// boundary (detail::dense) before the call. Outputs the engine allocates are contiguous; an
// in-place write (fill, copy, binary into out) may target a view, whose elements never overlap.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <ruda/dtype.h>
#include <ruda/shape.h>

namespace ruda {

/// A strided window on a buffer. Strides count elements; a stride of 0 broadcasts.
struct View {
  void* data = nullptr;
  DType dtype = DType::f32;
  int ndim = 0;
  std::array<std::int64_t, kMaxDims> shape{};
  std::array<std::int64_t, kMaxDims> strides{};

  // (Indexed with std::size_t: the public headers stay free of warnings under a user's
  // -Wsign-conversion.)
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (std::size_t i = 0; i < static_cast<std::size_t>(ndim); ++i) n *= shape[i];
    return n;
  }
  bool is_contiguous() const {
    std::int64_t expected = 1;
    for (std::size_t i = static_cast<std::size_t>(ndim); i-- > 0;) {
      if (shape[i] != 1 && strides[i] != expected) return false;
      expected *= shape[i];
    }
    return true;
  }
  template <class T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

enum class UnaryOp : std::uint8_t {
  neg,
  abs,
  exp,
  log,
  sqrt,
  rsqrt,
  tanh,
  sigmoid,
  relu,
  gelu_tanh,
  gelu_erf,
  silu,
  softplus,
  square,
  reciprocal,
  erf
};
enum class BinaryOp : std::uint8_t {
  add,
  sub,
  mul,
  div,
  pow,
  maximum,
  minimum,
  eq,
  ne,
  lt,
  le,
  gt,
  ge  // comparisons write bool
};
enum class ReduceOp : std::uint8_t { sum, max, min, logsumexp, argmax, argmin };

std::string_view op_name(UnaryOp op) noexcept;
std::string_view op_name(BinaryOp op) noexcept;
std::string_view op_name(ReduceOp op) noexcept;

/// What a GEMM applies to every element of its result after the bias, as part of the same
/// kernel (oneDNN: an eltwise post-op): fc1's GELU in a transformer's MLP.
enum class GemmEpilogue : std::uint8_t { none, gelu_erf, gelu_tanh };

/// C[b] = epilogue(alpha * op(A[b]) @ op(B[b]) + beta * C[b] (+ bias broadcast over rows)), for b < batch.
/// A is [m, k] row-major per batch ([k, m] when trans_a), B is [k, n] ([n, k] when trans_b),
/// C is [m, n]. Each stored matrix's rows are ld elements apart (lda, ldb, ldc; 0 means dense:
/// its column count), so a strided view whose last or second-to-last axis is contiguous is read
/// in place. Batches run over up to two axes: batch b's matrices start at offset(b) =
/// (b / batch_inner) * batch_stride + (b % batch_inner) * inner_stride, in elements, for each
/// operand; a stride of 0 reuses one matrix along that axis. C never overlaps itself or A and B.
struct GemmDesc {
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
  const void* bias = nullptr;  // [n] of c_dtype, or null
  DType a_dtype = DType::f32, b_dtype = DType::f32, c_dtype = DType::f32;
  bool trans_a = false, trans_b = false;
  std::int64_t batch = 1, m = 0, n = 0, k = 0;
  std::int64_t batch_stride_a = 0, batch_stride_b = 0, batch_stride_c = 0;
  std::int64_t lda = 0, ldb = 0, ldc = 0;
  std::int64_t batch_inner = 1;  // extent of the inner batch axis (divides batch)
  std::int64_t inner_stride_a = 0, inner_stride_b = 0, inner_stride_c = 0;
  float alpha = 1.0f, beta = 0.0f;
  GemmEpilogue epilogue = GemmEpilogue::none;

  // Stored rows and columns of each operand, and their row strides with the dense default.
  std::int64_t rows_a() const { return trans_a ? k : m; }
  std::int64_t cols_a() const { return trans_a ? m : k; }
  std::int64_t rows_b() const { return trans_b ? n : k; }
  std::int64_t cols_b() const { return trans_b ? k : n; }
  std::int64_t ld_a() const { return lda ? lda : cols_a(); }
  std::int64_t ld_b() const { return ldb ? ldb : cols_b(); }
  std::int64_t ld_c() const { return ldc ? ldc : n; }
  std::int64_t offset_a(std::int64_t i) const { return split(i, batch_stride_a, inner_stride_a); }
  std::int64_t offset_b(std::int64_t i) const { return split(i, batch_stride_b, inner_stride_b); }
  std::int64_t offset_c(std::int64_t i) const { return split(i, batch_stride_c, inner_stride_c); }
  /// Elements from an operand's first to its last one, over every batch (strides are >= 0).
  std::int64_t span_a() const { return span(rows_a(), cols_a(), ld_a(), batch_stride_a, inner_stride_a); }
  std::int64_t span_b() const { return span(rows_b(), cols_b(), ld_b(), batch_stride_b, inner_stride_b); }
  std::int64_t span_c() const { return span(m, n, ld_c(), batch_stride_c, inner_stride_c); }
  /// Whether every operand is dense within each matrix (the layout before leading dimensions).
  bool dense_matrices() const { return ld_a() == cols_a() && ld_b() == cols_b() && ld_c() == n; }

 private:
  std::int64_t split(std::int64_t i, std::int64_t outer, std::int64_t inner) const {
    const std::int64_t in = batch_inner > 1 ? batch_inner : 1;
    return (i / in) * outer + (i % in) * inner;
  }
  std::int64_t span(std::int64_t rows, std::int64_t cols, std::int64_t ld, std::int64_t outer,
                    std::int64_t inner) const {
    if (rows == 0 || cols == 0 || batch == 0) return 0;
    const std::int64_t in = batch_inner > 1 ? batch_inner : 1;
    return (batch / in - 1) * outer + (in - 1) * inner + (rows - 1) * ld + cols;
  }
};

/// One fused Adam/AdamW step on whole contiguous buffers (param, grad, first and second moments,
/// same length). param and grad share a float dtype; the moments are f32 for an f16 or bf16
/// parameter (a 16-bit second moment underflows) and of the parameter's dtype otherwise.
/// decoupled = AdamW (weight decay on the parameter), else L2 added to the gradient.
struct AdamDesc {
  /// The moments' dtype for a parameter of `parameter` (nn::Adam::moment_dtype is this rule).
  static constexpr DType moment_dtype(DType parameter) noexcept {
    return is_16bit_float(parameter) ? DType::f32 : parameter;
  }
  View param, grad, exp_avg, exp_avg_sq;
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  std::int64_t step = 1;  // 1-based, for bias correction
  bool decoupled = true;
};

/// Fused scaled dot-product attention (flash-attention style) on whole [B, H, T, D] buffers.
/// q [B, H, Tq, D], k [B, H, Tk, D], v [B, H, Tk, Dv], out and dout [B, H, Tq, Dv], lse [B, H, Tq];
/// dq, dk, dv have the shapes of q, k, v. Every view may have any strides on its first three
/// axes (a permuted view of a [B, T, H, D] projection reads through its T stride), but its last
/// axis must be contiguous. q, k, v, out, dout and the gradients share one float dtype; lse is f32
/// (f64 for f64 inputs). `causal` masks key j for query i when j > i (top-left aligned, as in
/// PyTorch), and every query row sees at least key 0. The engine validates everything first.
struct AttentionDesc {
  View q, k, v, out, lse;
  View dout, dq, dk, dv;  // backward only; a gradient with null data is not wanted
  bool causal = false;
  double scale = 1.0;  // multiplies q k^T before the softmax
  // Dropout on the attention weights: element (b, h, i, j) of the [B, H, Tq, Tk] weights is kept
  // when draw offset + ((b * H + h) * Tq + i) * Tk + j of stream `seed` (random::uniform_float) is
  // at least `dropout`, and scaled by 1 / (1 - dropout): the mask ruda::dropout draws for that tensor.
  double dropout = 0.0;
  std::uint64_t seed = 0, offset = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;

  /// out[...] = value (converted to out's dtype); out may have any strides.
  virtual void fill(const View& out, double value) = 0;
  /// dst = src elementwise, same shape and dtype, any strides (permute, slice, concat, expand).
  virtual void copy(const View& src, const View& dst) = 0;
  /// dst = src converted (contiguous: the engine copies a strided src; same element count, any
  /// dtypes; 16-bit floats round to nearest even).
  virtual void cast(const View& src, const View& dst) = 0;
  /// y = f(x), contiguous (the engine copies a strided x), same shape and dtype.
  virtual void unary(UnaryOp op, const View& x, const View& y) = 0;
  /// gx = gy * f'(x); y = f(x) is passed too for ops whose derivative reads it. Contiguous.
  virtual void unary_backward(UnaryOp op, const View& x, const View& y, const View& gy, const View& gx) = 0;
  /// y = f(x) and dydx = f'(x) together, for ops whose derivative reads the input: a caller can
  /// then keep f'(x) for its backward (gx = gy * f'(x), one multiply) instead of x (linear_gelu
  /// does, for GELU, whose derivative costs what its forward does). Contiguous, same shape and
  /// dtype; dydx may be x itself (overwritten), y overlaps neither. Not pure: this default runs
  /// unary, then unary_backward with gy = 1; a backend overrides it with one pass.
  virtual void unary_with_derivative(UnaryOp op, const View& x, const View& y, const View& dydx);
  /// out = a (op) b; a and b are broadcast to out's shape through their strides (0 = broadcast,
  /// any other stride a view's). out may be a view too (in-place updates through a view) and may
  /// alias a or b exactly, never in part (the engine copies a partially overlapping operand).
  virtual void binary(BinaryOp op, const View& a, const View& b, const View& out) = 0;
  /// y += alpha * x in place (Tensor::add_ with an alpha): x broadcast to y's shape through its
  /// strides, y any strides, one float dtype, y aliasing x exactly or not at all. The built-in
  /// backends compute it as one fused multiply-add in the compute type (f32 for 16-bit), rounded
  /// once and then to the dtype, as PyTorch's add with an alpha does. Not pure: this default
  /// scales x into a temporary and runs binary(add) (the product and the sum each rounded); a
  /// backend overrides it with one pass that allocates nothing (an optimizer step relies on that:
  /// a parameter's update cannot then fail after its state's).
  virtual void add_scaled(const View& x, double alpha, const View& y);
  /// out = cond ? a : b, with cond (bool), a and b broadcast to out's shape through strides.
  virtual void where(const View& cond, const View& a, const View& b, const View& out) = 0;
  /// out = reduction of x over the axes where out's extent is 1 and x's is not (out keeps x's rank).
  /// argmax/argmin write i64 and reduce exactly one axis. Contiguous (a strided x is copied first).
  virtual void reduce(ReduceOp op, const View& x, const View& out) = 0;
  virtual void gemm(const GemmDesc& desc) = 0;
  /// y = softmax (or log_softmax) of x over `axis`; x and y contiguous with the same shape (the
  /// engine copies a strided x).
  virtual void softmax(const View& x, const View& y, int axis, bool log) = 0;
  /// gx from y (the forward output) and gy over `axis`.
  virtual void softmax_backward(const View& y, const View& gy, const View& gx, int axis, bool log) = 0;
  /// out[i, :] = table[index[i], :]; table [V, F], index i64 [N], out [N, F], all contiguous.
  /// Indices are checked by the engine.
  virtual void gather_rows(const View& table, const View& index, const View& out) = 0;
  /// table[index[i], :] += src[i, :] (repeated indices accumulate).
  virtual void scatter_add_rows(const View& src, const View& index, const View& table) = 0;
  /// out[r, j] = x[r, index[r, j]]; x [R, C], index i64 [R, K], out [R, K].
  virtual void take_along_rows(const View& x, const View& index, const View& out) = 0;
  /// x[r, index[r, j]] += src[r, j].
  virtual void put_add_along_rows(const View& src, const View& index, const View& x) = 0;
  virtual void adam_update(const AdamDesc& desc) = 0;
  /// Normalizes each row of x [rows, n]: y = (x - mean) * rstd (* weight + bias, when given: both
  /// [n], or both views with null data), rstd = 1 / sqrt(var + eps). Writes mean and rstd [rows] (f32, or
  /// f64 for f64 x) for the backward. Statistics accumulate in f32 at least. Contiguous (the
  /// engine copies strided x, weight and bias). weight and bias are in x's dtype, or both f32
  /// when x is f16 or bf16 (the mixed form: y in x's dtype, the affine computed in f32).
  virtual void layer_norm(const View& x, const View& weight, const View& bias, double eps, const View& y,
                          const View& mean, const View& rstd) = 0;
  /// gx from gy; gweight and gbias (sums over rows; null data when not wanted), in the weight's
  /// dtype (f32 in the mixed form).
  virtual void layer_norm_backward(const View& x, const View& weight, const View& mean, const View& rstd,
                                   const View& gy, const View& gx, const View& gweight, const View& gbias) = 0;
  /// out = softmax(scale * q k^T (masked), dropout) v, and lse = logsumexp of each row of the
  /// scaled, masked scores, without ever holding a [Tq, Tk] matrix per head (see AttentionDesc).
  virtual void attention(const AttentionDesc& desc) = 0;
  /// dq, dk and dv (those with data) from dout, recomputing the weights from q, k and lse; reads
  /// out for the softmax's row terms rowsum(dout * out). Overwrites the gradients.
  virtual void attention_backward(const AttentionDesc& desc) = 0;
};

/// Makes a backend selectable by name. The factory runs once, on first use.
void register_backend(std::string name, std::function<std::unique_ptr<Backend>()> factory);
/// The backend of that name; throws BackendError listing the available ones otherwise.
Backend& get_backend(std::string_view name);
/// Names of the registered backends, in registration order.
std::vector<std::string> available_backends();
/// The backend new tensors get: set_default_backend, else $RUDA_BACKEND, else onednn where built, else eigen.
Backend& default_backend();
void set_default_backend(std::string_view name);

/// Intra-op threads for kernels started from the calling thread: what it set, else
/// $RUDA_NUM_THREADS, else $OMP_NUM_THREADS (its leading number: "4,2" is 4, as OpenMP reads a
/// list, and "2.5" is 2, where libgomp ignores the value), else the
/// process's default (default_num_threads). A count must lie in [1, max_num_threads()]
/// (ArgumentError otherwise, naming the call or the variable).
void set_num_threads(int threads);
int num_threads();
/// The most threads set_num_threads accepts: 16 per hardware thread, at least 256 (beyond what
/// the machine can start, OpenMP ends the process instead of failing a call).
int max_num_threads();
/// $RUDA_NUM_THREADS as a thread count, 0 when unset or empty; ArgumentError when it is not a
/// whole number in [1, max_num_threads()].
int num_threads_from_env();
/// The count a thread that has set none uses when neither variable is set: the cores, unless a
/// launcher's policy changed it (ruda::share_cores_among_local_ranks, which MpiEnvironment
/// applies: ranks on one node share its cores). Threads that already ran kernels keep theirs.
void set_default_num_threads(int threads);
int default_num_threads();
/// The number of hardware threads of this machine.
int hardware_threads();

}  // namespace ruda
