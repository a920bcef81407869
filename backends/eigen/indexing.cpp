// Row gathers and scatters (embedding, take_along_axis) and the fused Adam/AdamW update.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "eigen_backend.h"
#include "kernel_util.h"

namespace ruda {

using namespace kernels;

namespace {
template <class T>
constexpr bool kSixteenBit = std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>;

// 0 .. n-1 ordered by idx[i], stable (ascending i among equal indices): the additions into one
// destination, in the order the unsorted loop made them.
void order_by_index(const std::int64_t* idx, std::int64_t n, Scratch<std::int64_t>& order) {
  order.resize(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
  std::stable_sort(order.begin(), order.end(), [idx](std::int64_t a, std::int64_t b) { return idx[a] < idx[b]; });
}
}  // namespace

void EigenBackend::gather_rows(const View& table, const View& index, const View& out) {
  const std::int64_t rows = out.shape[0], features = out.shape[1];
  const std::size_t row_bytes = static_cast<std::size_t>(features) * dtype_size(table.dtype);
  const auto* idx = index.ptr<const std::int64_t>();
  const auto* src = static_cast<const char*>(table.data);
  auto* dst = static_cast<char*>(out.data);
  parallel_for(rows, std::max<std::int64_t>(1, kElementGrain / std::max<std::int64_t>(1, features)),
               [&](std::int64_t begin, std::int64_t end) {
                 for (std::int64_t i = begin; i < end; ++i) {
                   std::memcpy(dst + i * row_bytes, src + idx[i] * row_bytes, row_bytes);
                 }
               });
}

void EigenBackend::scatter_add_rows(const View& src, const View& index, const View& table) {
  const std::int64_t rows = src.shape[0], features = src.shape[1];
  const auto* idx = index.ptr<const std::int64_t>();
  dispatch_float(table.dtype, "embedding backward", [&](auto tag) {
    using T = decltype(tag);
    const T* s = src.ptr<const T>();
    T* t = table.ptr<T>();
    const std::int64_t grain = std::max<std::int64_t>(16, kElementGrain / std::max<std::int64_t>(1, rows));
    if constexpr (kSixteenBit<T>) {
      // 16-bit: each table row sums its source rows in f32 and is rounded once. Rounded after
      // every add, a row stopped growing (bf16 256 + 1 is 256): a token seen 300 times got 256.
      Scratch<std::int64_t> order;
      order_by_index(idx, rows, order);
      parallel_for(features, grain, [&](std::int64_t j0, std::int64_t j1) {
        Scratch<float> acc(static_cast<std::size_t>(j1 - j0));
        for (std::size_t g = 0; g < order.size();) {
          const std::int64_t target = idx[order[g]];
          T* row = t + target * features;
          for (std::int64_t j = j0; j < j1; ++j) acc[static_cast<std::size_t>(j - j0)] = Num<T>::load(row[j]);
          for (; g < order.size() && idx[order[g]] == target; ++g) {
            const T* from = s + order[g] * features;
            for (std::int64_t j = j0; j < j1; ++j) acc[static_cast<std::size_t>(j - j0)] += Num<T>::load(from[j]);
          }
          for (std::int64_t j = j0; j < j1; ++j) row[j] = Num<T>::store(acc[static_cast<std::size_t>(j - j0)]);
        }
      });
    } else {
      // Threads split the feature columns, so repeated indices never race and the order of the
      // additions (row order) is the same for any thread count.
      parallel_for(features, grain, [&](std::int64_t j0, std::int64_t j1) {
        for (std::int64_t i = 0; i < rows; ++i) {
          T* row = t + idx[i] * features;
          const T* from = s + i * features;
          for (std::int64_t j = j0; j < j1; ++j) row[j] = Num<T>::store(Num<T>::load(row[j]) + Num<T>::load(from[j]));
        }
      });
    }
  });
}

void EigenBackend::take_along_rows(const View& x, const View& index, const View& out) {
  const std::int64_t rows = x.shape[0], cols = x.shape[1], picks = index.shape[1];
  const auto* idx = index.ptr<const std::int64_t>();
  // Values moved as raw bits of their size (a memcpy of the element size a value, on one thread,
  // took 2x PyTorch's time to pick 64 of 1024 columns of 2048 rows), the picks of all rows split
  // across threads: a few long rows (take_along_axis on a leading axis is one row of every pick)
  // are split within a row.
  auto take = [&](auto bits) {
    using U = decltype(bits);
    const U* src = static_cast<const U*>(x.data);
    U* dst = static_cast<U*>(out.data);
    parallel_for(rows * picks, kElementGrain, [&](std::int64_t e0, std::int64_t e1) {
      for (std::int64_t r = e0 / picks, j = e0 % picks, e = e0; e < e1; ++r, j = 0) {
        const std::int64_t* row_idx = idx + r * picks;
        const U* row = src + r * cols;
        U* o = dst + r * picks;
        const std::int64_t stop = std::min(picks, j + (e1 - e));
        e += stop - j;
        for (; j < stop; ++j) o[j] = row[row_idx[j]];
      }
    });
  };
  if (rows * picks > 0) dispatch_bits(dtype_size(x.dtype), take);
}

void EigenBackend::put_add_along_rows(const View& src, const View& index, const View& x) {
  const std::int64_t rows = x.shape[0], cols = x.shape[1], picks = index.shape[1];
  if (rows == 0 || cols == 0 || picks == 0) return;
  const auto* idx = index.ptr<const std::int64_t>();
  // Work units of a row and a range of its destination columns: each unit adds, in pick order, the
  // picks that land in its range, so the sums are the same bits for any thread count (this ran
  // on one thread). 16-bit rows are split where they are fewer than the threads (take_along_axis
  // on a leading axis is one row of every pick), each such unit reading all of its row's picks:
  // the conversions are the work there. f32 and f64 rows are not: a random scatter's time is the
  // memory's, and two threads each scanning every pick took longer than one (2M picks into 8 MB:
  // 15-17 ms against 11-16 ms).
  const std::int64_t threads = num_threads();
  dispatch_float(x.dtype, "take_along_axis backward", [&](auto tag) {
    using T = decltype(tag);
    const T* s = src.ptr<const T>();
    T* t = x.ptr<T>();
    // (Only where the picks are many for the row: a few picks in a long row are sorted instead,
    // whatever the thread count; split, each unit copied its whole column range to f32 and back.)
    const bool many_picks = picks * 16 >= cols;
    const std::int64_t chunks =
        kSixteenBit<T> && many_picks && rows < threads ? std::min(cols, (threads + rows - 1) / rows) : std::int64_t{1};
    const std::int64_t grain = std::max<std::int64_t>(1, kElementGrain / (picks + cols / chunks));
    // The f32 copies of the columns, one per thread at most, are charged as tensors of their size
    // would be (up to twice a 16-bit gradient's bytes: the tracker and the limit count them).
    const std::int64_t wide_values =
        kSixteenBit<T> && many_picks ? std::min(threads, rows * chunks) * (cols / chunks + 2) : std::int64_t{0};
    const detail::Charge charged = charge_working_memory(wide_values, DType::f32, "take_along_axis backward");
    parallel_for(rows * chunks, grain, [&](std::int64_t u0, std::int64_t u1) {
      Scratch<std::int64_t> order;
      Scratch<float> wide;
      for (std::int64_t u = u0; u < u1; ++u) {
        const std::int64_t r = u / chunks, c0 = cols * (u % chunks) / chunks, c1 = cols * (u % chunks + 1) / chunks;
        const std::int64_t* row_idx = idx + r * picks;
        const T* from = s + r * picks;
        T* row = t + r * cols;
        if constexpr (kSixteenBit<T>) {
          // 16-bit: the picks of one destination are summed in f32, from its value on, and
          // rounded once (rounded after every add, 300 picks of one bf16 element gave 256). A
          // few picks in a long row are ordered by destination; more are summed in an f32 copy of
          // the columns (ordering 2M picks by destination took 137 ms).
          if (!many_picks) {
            order_by_index(row_idx, picks, order);
            for (std::size_t g = 0; g < order.size();) {
              const std::int64_t target = row_idx[order[g]];
              float acc = Num<T>::load(row[target]);
              for (; g < order.size() && row_idx[order[g]] == target; ++g) acc += Num<T>::load(from[order[g]]);
              row[target] = Num<T>::store(acc);
            }
            continue;
          }
          // One slot more, where the picks outside the range go: a select, not a branch (a branch
          // taken at random for half of the picks cost more than the second thread gained).
          const std::int64_t width = c1 - c0;
          wide.resize(static_cast<std::size_t>(width + 1));
          for (std::int64_t c = c0; c < c1; ++c) wide[static_cast<std::size_t>(c - c0)] = Num<T>::load(row[c]);
          for (std::int64_t j = 0; j < picks; ++j) {
            const auto offset = static_cast<std::uint64_t>(row_idx[j] - c0);  // past width when outside
            wide[offset < static_cast<std::uint64_t>(width) ? offset : static_cast<std::size_t>(width)] +=
                Num<T>::load(from[j]);
          }
          for (std::int64_t c = c0; c < c1; ++c) row[c] = Num<T>::store(wide[static_cast<std::size_t>(c - c0)]);
        } else {
          for (std::int64_t j = 0; j < picks; ++j) row[row_idx[j]] += from[j];
        }
      }
    });
  });
}

void EigenBackend::adam_update(const AdamDesc& d) {
  const std::int64_t n = d.param.numel();
  // PyTorch's formulation, so results compare with it: decay, moments, then
  // p -= ((lr / bc1) * m) / (sqrt(v) / sqrt(bc2) + eps).
  const double bc1 = 1.0 - std::pow(d.beta1, static_cast<double>(d.step));
  const double bc2 = 1.0 - std::pow(d.beta2, static_cast<double>(d.step));
  // AdamDesc's contract: the moments of a 16-bit parameter are f32, the compute type.
  const DType moments = AdamDesc::moment_dtype(d.param.dtype);
  if (d.exp_avg.dtype != moments || d.exp_avg_sq.dtype != moments) {
    fail<DTypeError>("adam_update", "a ", dtype_name(d.param.dtype), " parameter's moments must be ",
                     dtype_name(moments), ", got ", dtype_name(d.exp_avg.dtype), " and ",
                     dtype_name(d.exp_avg_sq.dtype));
  }
  dispatch_float(d.param.dtype, "adam", [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    // 1 - beta in double, then rounded, as PyTorch passes it: in f32, 1 - float(0.999) is 11 ulp
    // off float(0.001), an error in v of 1.3e-5 relative every step.
    const C b1 = C(d.beta1), b2 = C(d.beta2), eps = C(d.eps), wd = C(d.weight_decay);
    const C one_minus_b1 = C(1.0 - d.beta1), one_minus_b2 = C(1.0 - d.beta2);
    const C step_size = C(d.lr / bc1), sqrt_bc2 = C(std::sqrt(bc2));
    const C decay = d.decoupled ? C(1.0 - d.lr * d.weight_decay) : C(1);
    const bool l2 = !d.decoupled && d.weight_decay != 0.0;
    // The moments are C, read and written as they are (checked above). A 16-bit parameter and
    // its gradient are widened to C in chunks on the stack and the parameter rounded back: in one
    // loop with the conversions the compiler kept it scalar (ruda-bench --suite optimizer's bf16
    // row: 0.32-0.44x the rate of three f32 copies in the same run; staged, 1.1-1.4x).
    T* p = d.param.ptr<T>();
    const T* g = d.grad.ptr<const T>();
    C* m = d.exp_avg.ptr<C>();
    C* v = d.exp_avg_sq.ptr<C>();
    // The loop reads its constants from values of its own: read through the closure's references,
    // each store into p, m or v might have changed them, so the compiler reloaded all of them every
    // element and kept the loop scalar (vsqrtss, vdivss). As locals it vectorizes (with its own
    // check that the four arrays do not overlap).
    const auto update = [=](C* pc, const C* gc, C* mc, C* vc, std::int64_t count) {
      for (std::int64_t i = 0; i < count; ++i) {
        C pi = pc[i];
        C gi = gc[i];
        // Each operation as PyTorch's CPU kernels round it (torch 1.13's _single_tensor_adam; the
        // file is compiled without fp-contract, so only these fmas are fused): grad.add(param,
        // alpha=wd) and exp_avg.mul_(b1).add_(grad, alpha=1-b1) are fmas in its vectorized add,
        // exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1-b2) one over (value * grad) * grad,
        // denom = sqrt(v) / sqrt(bc2) + eps, and addcdiv_ p - (step_size * m) / denom. (PyTorch 2
        // lerps the first moment instead, fma(1-b1, g-m, m): 1 ulp apart on some elements; README.)
        if (l2) gi = std::fma(pi, wd, gi);
        pi *= decay;
        const C mi = std::fma(gi, one_minus_b1, mc[i] * b1);
        const C vi = std::fma(one_minus_b2 * gi, gi, vc[i] * b2);
        pi -= step_size * mi / (std::sqrt(vi) / sqrt_bc2 + eps);
        mc[i] = mi;
        vc[i] = vi;
        pc[i] = pi;
      }
    };
    parallel_for(n, kElementGrain, [update, p, g, m, v](std::int64_t begin, std::int64_t end) {
      const auto local = update;  // the constants as this thread's locals
      if constexpr (std::is_same_v<T, C>) {
        local(p + begin, g + begin, m + begin, v + begin, end - begin);
      } else {
        constexpr std::int64_t kStage = 1024;
        C ps[kStage], gs[kStage];
        for (std::int64_t c = begin; c < end; c += kStage) {
          const std::int64_t count = std::min(kStage, end - c);
          for (std::int64_t i = 0; i < count; ++i) ps[i] = Num<T>::load(p[c + i]);
          for (std::int64_t i = 0; i < count; ++i) gs[i] = Num<T>::load(g[c + i]);
          local(ps, gs, m + c, v + c, count);
          for (std::int64_t i = 0; i < count; ++i) p[c + i] = Num<T>::store(ps[i]);
        }
      }
    });
  });
}

}  // namespace ruda
