// Reductions over axes, and softmax / log_softmax with their backward.
#include <cmath>
#include <limits>
#include <vector>

#include <Eigen/Core>

#include "eigen_backend.h"
#include "kernel_util.h"
#include "vector_math.h"

namespace ruda {

using namespace kernels;

namespace {

// x viewed as [outer, reduce, inner] (contiguous), reducing the middle axis.
struct Block {
  std::int64_t outer = 1, reduce = 1, inner = 1;
};

// Extents of x (extent-1 axes dropped) in runs of axes that are all reduced or all kept.
struct Runs {
  std::vector<std::int64_t> extent;
  std::vector<bool> reduced;
};

Runs runs_of(const View& x, const View& out) {
  Runs r;
  for (int d = 0; d < x.ndim; ++d) {
    if (x.shape[d] == 1) continue;
    const bool red = out.shape[d] == 1;
    if (!r.extent.empty() && r.reduced.back() == red) {
      r.extent.back() *= x.shape[d];
    } else {
      r.extent.push_back(x.shape[d]);
      r.reduced.push_back(red);
    }
  }
  return r;
}

template <class T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double,
                               std::conditional_t<std::is_same_v<T, std::int64_t>, std::int64_t, float>>;

// What sums accumulate in: double for every float dtype. A float accumulator stops growing once
// the sum is 2^24 times the addends (logsumexp of 20M zeros read log(2^24)), and a column sum over
// 20000 rows of 0.1 was 1.7e-4 off; PyTorch's cascade sums are within a few ulp there. The values
// themselves are still read and, where a kernel vectorizes, added in their own type in short runs.
template <class T>
using SumAcc = std::conditional_t<std::is_same_v<T, std::int64_t>, std::int64_t, double>;

// a += v, wrapping around for i64 (in uint64_t, where overflow is defined) as the elementwise add does.
template <class A>
void accumulate(A& a, A v) {
  if constexpr (std::is_same_v<A, std::int64_t>) {
    a = static_cast<std::int64_t>(static_cast<std::uint64_t>(a) + static_cast<std::uint64_t>(v));
  } else {
    a += v;
  }
}

template <class T>
bool nan_of(T v) {
  if constexpr (std::is_floating_point_v<T>) {
    return std::isnan(v);
  } else {
    return false;
  }
}

// The values of a contiguous line are taken kLineRun at a time, as sum_in_runs takes them: their
// extremes and exps.
constexpr std::int64_t kLineRun = kSumRun;

// The sum of n elements at p, p + stride, ... in SumAcc<T>. A contiguous line of floats goes to
// sum_in_runs (runs summed in the values' compute type, vectorized, and added in double): the
// speed of a float sum, an error that does not grow with the line, and the same bits whatever the
// line's address.
template <class T>
SumAcc<T> line_sum(const T* p, std::int64_t n, std::int64_t stride) {
  using C = compute_t<T>;
  SumAcc<T> total = 0;
  if constexpr (std::is_floating_point_v<C>) {
    if (stride == 1) return sum_in_runs<C>(n, [&](std::int64_t i) { return C(Num<T>::load(p[i])); });
  }
  for (std::int64_t i = 0; i < n; ++i) accumulate<SumAcc<T>>(total, Num<T>::load(p[i * stride]));
  return total;
}

// Runs of a contiguous line of float values as C, kLineRun at a time: f(run, length) on the values
// themselves, or on a copy widened to f32 for 16-bit ones.
template <class T, class F>
void for_each_run_of(const T* p, std::int64_t n, F&& f) {
  using C = compute_t<T>;
  alignas(64) C wide[std::is_same_v<T, C> ? 1 : kLineRun];
  for (std::int64_t r = 0; r < n; r += kLineRun) {
    const std::int64_t len = std::min(kLineRun, n - r);
    if constexpr (std::is_same_v<T, C>) {
      f(p + r, len);
    } else {
      for (std::int64_t i = 0; i < len; ++i) wide[i] = Num<T>::load(p[r + i]);
      f(static_cast<const C*>(wide), len);
    }
  }
}

// The largest (or smallest) of a contiguous line of n > 0 float values, NaN where one is: Eigen's
// vectorized NaN-propagating extremes, run by run (the element loop, with its branch and its
// early exit at a NaN, ran at a twentieth of a sum's speed).
template <class T>
compute_t<T> contiguous_extreme(const T* p, std::int64_t n, bool is_max) {
  using C = compute_t<T>;
  auto extreme = [is_max](const C* run, std::int64_t len) {
    const Eigen::Map<const Eigen::Array<C, Eigen::Dynamic, 1>> line(run, len);
    return is_max ? line.template maxCoeff<Eigen::PropagateNaN>() : line.template minCoeff<Eigen::PropagateNaN>();
  };
  if constexpr (std::is_same_v<T, C>) return extreme(p, n);  // f32, f64: the line at once
  C best = is_max ? -std::numeric_limits<C>::infinity() : std::numeric_limits<C>::infinity();
  for_each_run_of(p, n, [&](const C* run, std::int64_t len) {
    if (std::isnan(best)) return;
    const C e = extreme(run, len);
    if (std::isnan(e) || (is_max ? e > best : e < best)) best = e;
  });
  return best;
}

// logsumexp of a contiguous line of n > 0 float values: the maximum, then exp(x - max) a run at a
// time through the vectorized exp, the runs' sums in double (one std::exp a value took 2 ns).
template <class T>
compute_t<T> contiguous_logsumexp(const T* p, std::int64_t n) {
  using C = compute_t<T>;
  const C m = contiguous_extreme(p, n, true);
  if (!std::isfinite(m)) return m;  // NaN, +inf (the sum is infinite) or -inf (every value is)
  alignas(64) C exps[kLineRun];
  double s = 0;
  for_each_run_of(p, n, [&](const C* run, std::int64_t len) {
    Eigen::Map<Eigen::Array<C, Eigen::Dynamic, 1>>(exps, len) =
        ops::vector_exp(Eigen::Map<const Eigen::Array<C, Eigen::Dynamic, 1>>(run, len) - m);
    s += line_sum(exps, len, 1);
  });
  return static_cast<C>(m + std::log(s));
}

// One reduction of n elements at p, p + stride, ...
template <class T>
void reduce_line(ReduceOp op, const T* p, std::int64_t n, std::int64_t stride, T* out_value, std::int64_t* out_index) {
  using A = Acc<T>;
  switch (op) {
    case ReduceOp::sum: {
      *out_value = Num<T>::store(static_cast<compute_t<T>>(line_sum(p, n, stride)));
      return;
    }
    case ReduceOp::max:
    case ReduceOp::min: {
      const bool is_max = op == ReduceOp::max;
      if constexpr (std::is_floating_point_v<compute_t<T>>) {
        if (stride == 1) {
          *out_value = Num<T>::store(contiguous_extreme(p, n, is_max));
          return;
        }
      }
      A best = Num<T>::load(p[0]);
      for (std::int64_t i = 1; i < n && !nan_of(best); ++i) {
        const A v = Num<T>::load(p[i * stride]);
        if (nan_of(v) || (is_max ? v > best : v < best)) best = v;
      }
      *out_value = Num<T>::store(static_cast<compute_t<T>>(best));
      return;
    }
    case ReduceOp::argmax:
    case ReduceOp::argmin: {
      const bool is_max = op == ReduceOp::argmax;
      A best = Num<T>::load(p[0]);
      std::int64_t where = 0;
      for (std::int64_t i = 1; i < n && !nan_of(best); ++i) {
        const A v = Num<T>::load(p[i * stride]);
        if (nan_of(v) || (is_max ? v > best : v < best)) {
          best = v;
          where = i;
        }
      }
      *out_index = where;
      return;
    }
    case ReduceOp::logsumexp: {
      if constexpr (std::is_same_v<T, std::int64_t>) {
        fail<DTypeError>("logsumexp", "is not defined on i64");
      } else {
        using C = compute_t<T>;
        if (stride == 1 && n > 0) {
          *out_value = Num<T>::store(contiguous_logsumexp(p, n));
          return;
        }
        // The maximum, NaN once any value is NaN (std::max would skip it: an all-NaN line read -inf).
        C m = -std::numeric_limits<C>::infinity();
        for (std::int64_t i = 0; i < n && !std::isnan(m); ++i) {
          const C v = Num<T>::load(p[i * stride]);
          if (std::isnan(v) || v > m) m = v;
        }
        if (!std::isfinite(m)) {  // NaN, +inf (the sum is infinite) or -inf (every value is)
          *out_value = Num<T>::store(m);
          return;
        }
        double s = 0;
        for (std::int64_t i = 0; i < n; ++i) s += std::exp(Num<T>::load(p[i * stride]) - m);
        *out_value = Num<T>::store(static_cast<C>(m + std::log(s)));
      }
      return;
    }
  }
}

// Sum/max/min/logsumexp over the middle axis of [outer, reduce, inner] by accumulating whole rows,
// which keeps memory access sequential (bias gradients reduce [rows, features] over rows).
template <class T>
void reduce_rows_into(ReduceOp op, const T* x, const Block& b, T* out, std::int64_t j0, std::int64_t j1,
                      std::int64_t o) {
  using A = Acc<T>;
  Scratch<A> acc(static_cast<std::size_t>(j1 - j0));
  const T* base = x + o * b.reduce * b.inner;
  T* dst = out + o * b.inner;
  if (op == ReduceOp::sum) {
    // Runs of kRun rows summed in A (vectorized across the columns), each run's sums then added
    // into SumAcc: the rounding of a float column sum no longer grows with the row count.
    constexpr std::int64_t kRun = 32;
    Scratch<SumAcc<T>> total(static_cast<std::size_t>(j1 - j0));
    for (std::int64_t i0 = 0; i0 < b.reduce; i0 += kRun) {
      for (std::int64_t j = j0; j < j1; ++j) acc[j - j0] = Num<T>::load(base[i0 * b.inner + j]);
      for (std::int64_t i = i0 + 1; i < std::min(b.reduce, i0 + kRun); ++i) {
        const T* row = base + i * b.inner;
        for (std::int64_t j = j0; j < j1; ++j) accumulate<A>(acc[j - j0], Num<T>::load(row[j]));
      }
      for (std::int64_t j = j0; j < j1; ++j) accumulate<SumAcc<T>>(total[j - j0], acc[j - j0]);
    }
    for (std::int64_t j = j0; j < j1; ++j) dst[j] = Num<T>::store(static_cast<compute_t<T>>(total[j - j0]));
    return;
  }
  for (std::int64_t j = j0; j < j1; ++j) acc[j - j0] = Num<T>::load(base[j]);
  // A NaN stays; else a NaN or a larger (smaller) value replaces the running one, the first of
  // equal ones kept. One loop per direction, as selects, so that the compiler vectorizes them
  // (with the direction and the branches inside, a column max of [2048, 1024] f32 took 1.9x
  // PyTorch's time).
  auto fold = [&](auto better) {
    for (std::int64_t i = 1; i < b.reduce; ++i) {
      const T* row = base + i * b.inner;
      A* a = acc.data();
      for (std::int64_t j = j0; j < j1; ++j) {
        const A v = Num<T>::load(row[j]);
        const A current = a[j - j0];
        a[j - j0] = (nan_of(current) || !(nan_of(v) || better(v, current))) ? current : v;
      }
    }
  };
  if (op == ReduceOp::min) {
    fold([](A v, A current) { return v < current; });
  } else {
    fold([](A v, A current) { return v > current; });
  }
  if constexpr (std::is_floating_point_v<A>) {
    if (op == ReduceOp::logsumexp) {
      // The columns' maxima above, then exp(row - max) a row at a time through the vectorized
      // exp, summed in double: a column at a time (a strided line, one std::exp a value, a cache
      // line a value) took 2.7-5.4x PyTorch's time.
      using C = compute_t<T>;
      const std::int64_t width = j1 - j0;
      Scratch<C> widened(static_cast<std::size_t>(std::is_same_v<T, C> ? 0 : width)),
          exps(static_cast<std::size_t>(width));
      Scratch<double> total(static_cast<std::size_t>(width));
      for (std::int64_t j = 0; j < width; ++j) total[j] = 0;
      // Columns whose maximum is not finite (NaN, +inf, or -inf: every value is) are that maximum;
      // the others subtract it (a 0 in place of a non-finite one keeps their exps finite).
      Scratch<C> shift(static_cast<std::size_t>(width));
      for (std::int64_t j = 0; j < width; ++j) shift[j] = std::isfinite(acc[j]) ? static_cast<C>(acc[j]) : C(0);
      using Array = Eigen::Array<C, Eigen::Dynamic, 1>;
      for (std::int64_t i = 0; i < b.reduce; ++i) {
        const T* row = base + i * b.inner + j0;
        const C* values = nullptr;
        if constexpr (std::is_same_v<T, C>) {
          values = row;
        } else {
          for (std::int64_t j = 0; j < width; ++j) widened[j] = Num<T>::load(row[j]);
          values = widened.data();
        }
        Eigen::Map<Array>(exps.data(), width) =
            ops::vector_exp(Eigen::Map<const Array>(values, width) - Eigen::Map<const Array>(shift.data(), width));
        for (std::int64_t j = 0; j < width; ++j) total[j] += exps[j];
      }
      for (std::int64_t j = 0; j < width; ++j) {
        const C m = static_cast<C>(acc[j]);
        dst[j0 + j] = Num<T>::store(std::isfinite(m) ? static_cast<C>(m + std::log(total[j])) : m);
      }
      return;
    }
  }
  for (std::int64_t j = j0; j < j1; ++j) dst[j] = Num<T>::store(static_cast<compute_t<T>>(acc[j - j0]));
}

template <class T>
void reduce_block(ReduceOp op, const T* x, const Block& b, void* out) {
  const bool arg = op == ReduceOp::argmax || op == ReduceOp::argmin;
  T* values = arg ? nullptr : static_cast<T*>(out);
  auto* indices = arg ? static_cast<std::int64_t*>(out) : nullptr;
  if (b.inner == 1) {
    // Contiguous rows. One long row (a full reduction) is summed in fixed blocks so the result
    // does not depend on the thread count.
    if (b.outer == 1 && op == ReduceOp::sum && b.reduce > 4 * kElementGrain) {
      constexpr std::int64_t kBlock = 1 << 16;
      const std::int64_t blocks = (b.reduce + kBlock - 1) / kBlock;
      Scratch<SumAcc<T>> partial(static_cast<std::size_t>(blocks));
      parallel_for(blocks, 1, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t k = begin; k < end; ++k)
          partial[k] = line_sum(x + k * kBlock, std::min(kBlock, b.reduce - k * kBlock), 1);
      });
      SumAcc<T> total = 0;
      for (const SumAcc<T> v : partial) accumulate<SumAcc<T>>(total, v);
      values[0] = Num<T>::store(static_cast<compute_t<T>>(total));
      return;
    }
    parallel_for(b.outer, std::max<std::int64_t>(1, kElementGrain / b.reduce),
                 [&](std::int64_t begin, std::int64_t end) {
                   for (std::int64_t o = begin; o < end; ++o) {
                     reduce_line<T>(op, x + o * b.reduce, b.reduce, 1, values ? values + o : nullptr,
                                    indices ? indices + o : nullptr);
                   }
                 });
    return;
  }
  const bool rows_fold = op == ReduceOp::sum || op == ReduceOp::max || op == ReduceOp::min ||
                         (op == ReduceOp::logsumexp && !std::is_same_v<T, std::int64_t>);
  if (rows_fold) {
    for (std::int64_t o = 0; o < b.outer; ++o) {
      parallel_for(b.inner, std::max<std::int64_t>(64, kElementGrain / b.reduce),
                   [&](std::int64_t j0, std::int64_t j1) { reduce_rows_into<T>(op, x, b, values, j0, j1, o); });
    }
    return;
  }
  // argmax/argmin across rows (and i64's logsumexp, refused): one strided line per output.
  parallel_for(b.outer * b.inner, std::max<std::int64_t>(1, kElementGrain / b.reduce),
               [&](std::int64_t begin, std::int64_t end) {
                 for (std::int64_t flat = begin; flat < end; ++flat) {
                   const std::int64_t o = flat / b.inner, j = flat % b.inner;
                   reduce_line<T>(op, x + o * b.reduce * b.inner + j, b.reduce, b.inner,
                                  values ? values + flat : nullptr, indices ? indices + flat : nullptr);
                 }
               });
}

}  // namespace

void EigenBackend::reduce(ReduceOp op, const View& x, const View& out) {
  const Runs r = runs_of(x, out);
  std::size_t reduced_runs = 0;
  for (bool red : r.reduced) reduced_runs += red;
  if (reduced_runs == 0) {  // nothing to fold: a copy (or, for arg ops, index 0)
    if (op == ReduceOp::argmax || op == ReduceOp::argmin) {
      fill(out, 0.0);
    } else {
      copy(x, out);
    }
    return;
  }
  if (reduced_runs > 1 && is_16bit_float(x.dtype) && (op == ReduceOp::sum || op == ReduceOp::logsumexp)) {
    // A 16-bit sum folded run by run rounded each partial sum to 16 bits (bf16 sum over axes
    // {0, 2} of [2, 3, 4] read 1.9375 for 2): the folds run in f32, rounded once at the end, as a
    // single run's sum is (max and min compose exactly and stay 16-bit).
    auto dense_f32 = [](const View& like, Scratch<float>& storage) {
      View v = like;
      v.dtype = DType::f32;
      storage.resize(static_cast<std::size_t>(like.numel()));
      v.data = storage.data();
      std::int64_t stride = 1;
      for (int d = like.ndim - 1; d >= 0; --d) {
        v.strides[d] = stride;
        stride *= like.shape[d];
      }
      return v;
    };
    const detail::Charge charged = charge_working_memory(x.numel() + out.numel(), DType::f32, op_name(op).data());
    Scratch<float> wide_x, wide_out;
    const View x32 = dense_f32(x, wide_x), out32 = dense_f32(out, wide_out);
    cast(x, x32);
    reduce(op, x32, out32);
    cast(out32, out);
    return;
  }
  if (reduced_runs > 1) {
    // Several separate reduced runs: fold the last one, then the rest (sum, max, min and
    // logsumexp all compose this way; arg ops reduce one axis only).
    View partial = x;
    int last_reduced = -1;
    for (int d = 0; d < x.ndim; ++d) {
      if (x.shape[d] != 1 && out.shape[d] == 1) last_reduced = d;
    }
    // Reduce every axis of the last run: walk back while the axes stay reduced (or are 1).
    int first = last_reduced;
    while (first > 0 && (x.shape[first - 1] == 1 || out.shape[first - 1] == 1)) --first;
    std::int64_t count = 1;
    for (int d = first; d <= last_reduced; ++d) {
      partial.shape[d] = 1;
    }
    for (int d = 0; d < x.ndim; ++d) count *= partial.shape[d];
    const std::size_t elem = dtype_size(x.dtype);
    // As large as the input over the last run's extent: charged as a tensor would be.
    const detail::Charge charged = charge_working_memory(count, x.dtype, op_name(op).data());
    Scratch<std::uint8_t> buffer(static_cast<std::size_t>(count) * elem);  // on 64-byte boundaries
    partial.data = buffer.data();
    std::int64_t stride = 1;
    for (int d = x.ndim - 1; d >= 0; --d) {
      partial.strides[d] = stride;
      stride *= partial.shape[d];
    }
    reduce(op, x, partial);
    reduce(op, partial, out);
    return;
  }
  Block b;
  std::size_t i = 0;
  for (; i < r.extent.size() && !r.reduced[i]; ++i) b.outer *= r.extent[i];
  b.reduce = r.extent[i++];
  for (; i < r.extent.size(); ++i) b.inner *= r.extent[i];
  dispatch_arith(x.dtype, op_name(op).data(), [&](auto tag) {
    using T = decltype(tag);
    reduce_block<T>(op, x.ptr<const T>(), b, out.data);
  });
}

// --- softmax ---

namespace {

Block softmax_block(const View& x, int axis) {
  Block b;
  for (int d = 0; d < axis; ++d) b.outer *= x.shape[d];
  b.reduce = x.shape[axis];
  for (int d = axis + 1; d < x.ndim; ++d) b.inner *= x.shape[d];
  return b;
}

// Softmax (or log-softmax) of n contiguous values of f32 or f64, vectorized. The log form is
// (x - max) - log(sum), as PyTorch's: x - (max + log(sum)) rounded max + log(sum) first, and lost
// the small log-probabilities of a confident row (log_softmax([10, 0]) read -4.578e-5 for
// -4.540e-5; a row of two 1e8 read 0 and 0 for -log 2) and their gradients with them.
template <class C>
void dense_softmax(const C* x, C* y, std::int64_t n, bool log) {
  if (n == 0) return;
  Eigen::Map<const Eigen::Array<C, Eigen::Dynamic, 1>> in(x, n);
  Eigen::Map<Eigen::Array<C, Eigen::Dynamic, 1>> out(y, n);
  const C m = in.maxCoeff();
  out = ops::vector_exp(in - m);
  const C total = long_sum<C>(n, [&](std::int64_t i) { return out[i]; });
  if (log) {
    out = (in - m) - std::log(total);
  } else {
    out *= C(1) / total;
  }
}

template <class C>
void dense_softmax_backward(const C* y, const C* gy, C* gx, std::int64_t n, bool log) {
  Eigen::Map<const Eigen::Array<C, Eigen::Dynamic, 1>> yv(y, n), g(gy, n);
  Eigen::Map<Eigen::Array<C, Eigen::Dynamic, 1>> out(gx, n);
  if (log) {
    out = g - ops::vector_exp(yv) * long_sum<C>(n, [&](std::int64_t i) { return g[i]; });
  } else {
    out = yv * (g - long_sum<C>(n, [&](std::int64_t i) { return g[i] * yv[i]; }));
  }
}

// Three line buffers of n values of the compute type, one after another: this thread's, reused
// from line to line, for lines of up to kKeptLine values; `own`, freed after the line, for longer
// ones (a thread-local buffer kept the longest line a thread ever saw, uncounted by the memory
// tracker, for the life of the process: 24 GB after one bf16 softmax over a line of 2^31).
constexpr std::int64_t kKeptLine = std::int64_t{1} << 16;
template <class C>
C* line_buffers(std::int64_t n, Scratch<C>& own) {
  if (n > kKeptLine) {
    own.resize(3 * static_cast<std::size_t>(n));
    return own.data();
  }
  thread_local Scratch<C> kept(3 * static_cast<std::size_t>(kKeptLine));
  return kept.data();
}

// One softmax line of n contiguous values (lines over another axis than the last take
// softmax_columns). A 16-bit line is widened into the compute type, runs the same vectorized
// kernel and is rounded back once: it ran one scalar std::exp a value before (bf16 at a tenth of
// f32's rate).
template <class T>
void softmax_line(const T* x, T* y, std::int64_t n, bool log) {
  using C = compute_t<T>;
  if constexpr (std::is_same_v<T, C>) {
    dense_softmax(x, y, n, log);
  } else {
    Scratch<C> own;
    C* const in = line_buffers<C>(n, own);
    C* const out = in + n;
    for (std::int64_t i = 0; i < n; ++i) in[i] = Num<T>::load(x[i]);
    dense_softmax(in, out, n, log);
    for (std::int64_t i = 0; i < n; ++i) y[i] = Num<T>::store(out[i]);
  }
}

template <class T>
void softmax_backward_line(const T* y, const T* gy, T* gx, std::int64_t n, bool log) {
  using C = compute_t<T>;
  if constexpr (std::is_same_v<T, C>) {
    dense_softmax_backward(y, gy, gx, n, log);
  } else {
    Scratch<C> own;
    C* const yc = line_buffers<C>(n, own);
    C* const gc = yc + n;
    C* const out = gc + n;
    for (std::int64_t i = 0; i < n; ++i) {
      yc[i] = Num<T>::load(y[i]);
      gc[i] = Num<T>::load(gy[i]);
    }
    dense_softmax_backward(yc, gc, out, n, log);
    for (std::int64_t i = 0; i < n; ++i) gx[i] = Num<T>::store(out[i]);
  }
}

// Softmax over an axis that is not the last, [outer, n, inner] with inner > 1: a line's values
// are `inner` apart. Gathered a line at a time, each value was a cache line (and, for inner 1024,
// a page) of its own: over axis 0 of [4096, 1024], forward and backward took 6.9-7.1x PyTorch's
// time. Here a block of kColumns lines side by side is swept row by row instead (each row a run of
// contiguous values, vectorized across the lines): the maximum, then the exponentials and their
// sum, then the normalization. Each line's sum adds runs of kColumnRun rows in the compute type
// into a double: as accurate as long_sum's runs of 16 lanes (a run of 256 rows added in the
// compute type would be ~13x looser), though not the same bits as the last axis of a transposed
// copy. Blocks narrow (to 16 lines) where there are fewer than the threads.
constexpr std::int64_t kColumns = 256;
constexpr std::int64_t kColumnRun = 16;

template <class T>
using ColumnArray = Eigen::Array<compute_t<T>, Eigen::Dynamic, 1>;

// Row i of lines [j0, j0 + w) of the block starting at `base`, widened into `row` (the values
// themselves where T is the compute type).
template <class T>
Eigen::Map<const ColumnArray<T>> load_row(const T* base, const Block& b, std::int64_t i, std::int64_t j0,
                                          std::int64_t w, ColumnArray<T>& row) {
  const T* src = base + i * b.inner + j0;
  if constexpr (std::is_same_v<T, compute_t<T>>) {
    return Eigen::Map<const ColumnArray<T>>(src, w);
  } else {
    for (std::int64_t c = 0; c < w; ++c) row[c] = Num<T>::load(src[c]);
    return Eigen::Map<const ColumnArray<T>>(row.data(), w);
  }
}

template <class T>
void store_row(T* base, const Block& b, std::int64_t i, std::int64_t j0, const ColumnArray<T>& row, std::int64_t w) {
  T* dst = base + i * b.inner + j0;
  for (std::int64_t c = 0; c < w; ++c) dst[c] = Num<T>::store(row[c]);
}

// Column sums over the block's n rows ([w] arrays): add(i, run) adds row i's values into `run`;
// runs of kColumnRun rows in the compute type, the runs added in double.
template <class T, class Add>
ColumnArray<T> column_sums(std::int64_t n, std::int64_t w, Add&& add) {
  using C = compute_t<T>;
  Eigen::ArrayXd total = Eigen::ArrayXd::Zero(w);
  ColumnArray<T> run(w);
  for (std::int64_t r = 0; r < n; r += kColumnRun) {
    run.setZero();
    for (std::int64_t i = r; i < std::min(n, r + kColumnRun); ++i) add(i, run);
    total += run.template cast<double>();
  }
  return total.cast<C>();
}

template <class Body>
void for_each_column_block(const Block& b, Body&& body) {
  // Blocks of kColumns lines, or narrower (multiples of 16) where that would leave threads idle.
  const std::int64_t threads = num_threads();
  std::int64_t width = kColumns;
  if (b.outer * ((b.inner + width - 1) / width) < threads) {
    const std::int64_t per_thread = (b.inner + threads - 1) / threads;
    width = std::clamp<std::int64_t>((per_thread + 15) / 16 * 16, 16, kColumns);
  }
  const std::int64_t blocks = (b.inner + width - 1) / width;
  parallel_for(b.outer * blocks, std::max<std::int64_t>(1, kElementGrain / (b.reduce * width)),
               [&](std::int64_t begin, std::int64_t end) {
                 for (std::int64_t flat = begin; flat < end; ++flat) {
                   const std::int64_t o = flat / blocks, j0 = flat % blocks * width;
                   body(o * b.reduce * b.inner, j0, std::min(width, b.inner - j0));
                 }
               });
}

template <class T>
void softmax_columns(const T* x, T* y, const Block& b, bool log) {
  using C = compute_t<T>;
  const std::int64_t n = b.reduce;
  for_each_column_block(b, [&](std::int64_t offset, std::int64_t j0, std::int64_t w) {
    const T* xb = x + offset;
    T* yb = y + offset;
    ColumnArray<T> row(w), out(w);
    ColumnArray<T> m = ColumnArray<T>::Constant(w, -std::numeric_limits<C>::infinity());
    for (std::int64_t i = 0; i < n; ++i) m = m.max(load_row(xb, b, i, j0, w, row));
    // In f32 and f64 the softmax keeps each row's exponentials in y, to be scaled there (16-bit y
    // would round them: they are computed again for the last pass instead).
    constexpr bool wide = std::is_same_v<T, C>;
    auto y_row = [&](std::int64_t i) {  // (f32 and f64 only: a discarded branch elsewhere)
      if constexpr (wide) return Eigen::Map<ColumnArray<T>>(yb + i * b.inner + j0, w);
    };
    const ColumnArray<T> total = column_sums<T>(n, w, [&](std::int64_t i, ColumnArray<T>& run) {
      if constexpr (wide) {
        if (!log) {
          auto e = y_row(i);
          e = ops::vector_exp(load_row(xb, b, i, j0, w, row) - m);
          run += e;
          return;
        }
      }
      run += ops::vector_exp(load_row(xb, b, i, j0, w, row) - m);
    });
    if (log) {
      const ColumnArray<T> shift = total.log();
      for (std::int64_t i = 0; i < n; ++i) {
        out = (load_row(xb, b, i, j0, w, row) - m) - shift;
        store_row(yb, b, i, j0, out, w);
      }
    } else {
      const ColumnArray<T> inv = total.inverse();
      for (std::int64_t i = 0; i < n; ++i) {
        if constexpr (wide) {
          y_row(i) *= inv;
        } else {
          out = ops::vector_exp(load_row(xb, b, i, j0, w, row) - m) * inv;
          store_row(yb, b, i, j0, out, w);
        }
      }
    }
  });
}

template <class T>
void softmax_backward_columns(const T* y, const T* gy, T* gx, const Block& b, bool log) {
  const std::int64_t n = b.reduce;
  for_each_column_block(b, [&](std::int64_t offset, std::int64_t j0, std::int64_t w) {
    const T *yb = y + offset, *gb = gy + offset;
    T* out_b = gx + offset;
    ColumnArray<T> yr(w), gr(w), out(w);
    if (log) {
      // gx = g - exp(y) * sum(g)
      const ColumnArray<T> sum_g =
          column_sums<T>(n, w, [&](std::int64_t i, ColumnArray<T>& run) { run += load_row(gb, b, i, j0, w, gr); });
      for (std::int64_t i = 0; i < n; ++i) {
        out = load_row(gb, b, i, j0, w, gr) - ops::vector_exp(load_row(yb, b, i, j0, w, yr)) * sum_g;
        store_row(out_b, b, i, j0, out, w);
      }
    } else {
      // gx = y * (g - sum(g * y))
      const ColumnArray<T> dot = column_sums<T>(n, w, [&](std::int64_t i, ColumnArray<T>& run) {
        run += load_row(gb, b, i, j0, w, gr) * load_row(yb, b, i, j0, w, yr);
      });
      for (std::int64_t i = 0; i < n; ++i) {
        out = load_row(yb, b, i, j0, w, yr) * (load_row(gb, b, i, j0, w, gr) - dot);
        store_row(out_b, b, i, j0, out, w);
      }
    }
  });
}

}  // namespace

void EigenBackend::softmax(const View& x, const View& y, int axis, bool log) {
  const Block b = softmax_block(x, axis);
  dispatch_float(x.dtype, log ? "log_softmax" : "softmax", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.ptr<const T>();
    T* yp = y.ptr<T>();
    if (b.inner > 1) return softmax_columns<T>(xp, yp, b, log);
    parallel_for(b.outer, std::max<std::int64_t>(1, kElementGrain / b.reduce),
                 [&](std::int64_t begin, std::int64_t end) {
                   for (std::int64_t o = begin; o < end; ++o)
                     softmax_line<T>(xp + o * b.reduce, yp + o * b.reduce, b.reduce, log);
                 });
  });
}

void EigenBackend::softmax_backward(const View& y, const View& gy, const View& gx, int axis, bool log) {
  const Block b = softmax_block(y, axis);
  dispatch_float(y.dtype, log ? "log_softmax backward" : "softmax backward", [&](auto tag) {
    using T = decltype(tag);
    const T* yp = y.ptr<const T>();
    const T* gp = gy.ptr<const T>();
    T* out = gx.ptr<T>();
    if (b.inner > 1) return softmax_backward_columns<T>(yp, gp, out, b, log);
    parallel_for(b.outer, std::max<std::int64_t>(1, kElementGrain / b.reduce),
                 [&](std::int64_t begin, std::int64_t end) {
                   for (std::int64_t o = begin; o < end; ++o) {
                     const std::int64_t at = o * b.reduce;
                     softmax_backward_line<T>(yp + at, gp + at, out + at, b.reduce, log);
                   }
                 });
  });
}

}  // namespace ruda
