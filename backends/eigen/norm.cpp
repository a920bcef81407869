// Layer normalization over the last axis, fused: one pass for statistics and output, one for the
// input gradient and the affine parameters' (per block of rows, then added across blocks). 16-bit
// x may come with f32 weight and bias (mixed precision: the statistics and the affine run in f32
// either way).
#include <cmath>
#include <vector>

#include "eigen_backend.h"
#include "kernel_util.h"

namespace ruda {

using namespace kernels;

namespace {
template <class T>
using Stat = std::conditional_t<std::is_same_v<T, double>, double, float>;

/// Calls f with the affine parameters' element type: x's own, or f32 beside 16-bit x (the mixed
/// form, whose weights and their gradients stay f32; the engine checks the pairing).
template <class T, class F>
void with_affine_type(DType weight_dtype, F&& f) {
  if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>) {
    if (weight_dtype == DType::f32) return f(float{});
  }
  f(T{});
}
}  // namespace

void EigenBackend::layer_norm(const View& x, const View& weight, const View& bias, double eps, const View& y,
                              const View& mean, const View& rstd) {
  const std::int64_t n = x.shape[x.ndim - 1], rows = x.numel() / n;
  dispatch_float(x.dtype, "layer_norm", [&](auto tag) {
    using T = decltype(tag);
    using S = Stat<T>;
    with_affine_type<T>(weight.dtype, [&](auto wtag) {
      using W = decltype(wtag);
      const T* xp = x.ptr<const T>();
      const W* w = weight.data ? weight.ptr<const W>() : nullptr;
      const W* b = bias.data ? bias.ptr<const W>() : nullptr;
      T* yp = y.ptr<T>();
      S* mp = mean.ptr<S>();
      S* rp = rstd.ptr<S>();
      parallel_for(rows, std::max<std::int64_t>(1, kElementGrain / n), [&](std::int64_t r0, std::int64_t r1) {
        for (std::int64_t r = r0; r < r1; ++r) {
          const T* row = xp + r * n;
          // Two passes (mean, then centered squares): stable where E[x^2] - E[x]^2 would cancel.
          // The mean is taken about the row's first value, x0 + mean(x - x0): exact for a
          // constant row, whose mean summed plainly was an ulp off in f32, which 1 / sqrt(eps)
          // made a 4e-5 deviation from the bias (PyTorch's is the bias exactly). A first value
          // that is not finite is no shift (the row's inf or NaN mean stays).
          const S first = static_cast<S>(Num<T>::load(row[0]));
          const S shift = std::isfinite(first) ? first : S(0);
          S mu = shift + long_sum<S>(n, [&](std::int64_t j) { return static_cast<S>(Num<T>::load(row[j])) - shift; }) /
                             static_cast<S>(n);
          if (!std::isfinite(mu)) {
            // The sum overflowed the statistics' dtype where no value is infinite (a row of f32
            // values near 3e38: its mean was inf and every output NaN): the mean of x / m, times
            // m, with m the largest |x| (a row holding inf or NaN keeps its inf or NaN mean). Not
            // a power-of-two scale: x / m sums a constant row's exact ones, so its mean is its
            // value and it normalizes to 0 (scaled by 2^-128, a row of 3e38 summed 0.88s, its mean
            // was an ulp off, and ulp-sized deviations normalized to +-1: eps is nothing there).
            S m = 0;
            for (std::int64_t j = 0; j < n; ++j) m = std::max(m, std::abs(static_cast<S>(Num<T>::load(row[j]))));
            if (std::isfinite(m) && m > 0) {
              mu = long_sum<S>(n, [&](std::int64_t j) { return static_cast<S>(Num<T>::load(row[j])) / m; }) /
                   static_cast<S>(n) * m;
            }
          }
          const S sq = long_sum<S>(n, [&](std::int64_t j) {
            const S d = static_cast<S>(Num<T>::load(row[j])) - mu;
            return d * d;
          });
          S rs = S(1) / std::sqrt(sq / static_cast<S>(n) + static_cast<S>(eps));
          if (std::isinf(sq) && std::isfinite(mu)) {
            // The squares overflowed the statistics' dtype (f32 rows of 1e20, f64 of 1e155) where
            // the deviations did not: scaled by the largest deviation m, var = m^2 q with q <= 1,
            // and rstd = 1 / (m sqrt(q + eps / m^2)). Unscaled, rstd was 0 and the row 0.
            S m = 0;
            for (std::int64_t j = 0; j < n; ++j) m = std::max(m, std::abs(static_cast<S>(Num<T>::load(row[j])) - mu));
            if (std::isfinite(m)) {
              const S q = long_sum<S>(n,
                                      [&](std::int64_t j) {
                                        const S d = (static_cast<S>(Num<T>::load(row[j])) - mu) / m;
                                        return d * d;
                                      }) /
                          static_cast<S>(n);
              rs = S(1) / (m * std::sqrt(q + static_cast<S>(eps) / m / m));
            }
          }
          mp[r] = mu;
          rp[r] = rs;
          T* out = yp + r * n;
          // One loop per affine form, so that no branch or select is left inside the loop
          // (with `if (w)` and `b ? b[j] : 0` inside, GCC vectorized it with spilled index vectors,
          // and the bf16 forward ran at a fifth of its bandwidth). An explicit fma: left to the
          // compiler, the contraction of v * w + b differed between instantiations (f32 and bf16 x),
          // and so did a few results' last bits.
          auto normalize = [&](auto&& affine) {
            for (std::int64_t j = 0; j < n; ++j) {
              const S v = (static_cast<S>(Num<T>::load(row[j])) - mu) * rs;
              out[j] = Num<T>::store(static_cast<compute_t<T>>(affine(v, j)));
            }
          };
          if (w) {  // the engine passes weight and bias together, or neither
            normalize([&](S v, std::int64_t j) {
              return std::fma(v, static_cast<S>(Num<W>::load(w[j])), static_cast<S>(Num<W>::load(b[j])));
            });
          } else {
            normalize([](S v, std::int64_t) { return v; });
          }
        }
      });
    });
  });
}

void EigenBackend::layer_norm_backward(const View& x, const View& weight, const View& mean, const View& rstd,
                                       const View& gy, const View& gx, const View& gweight, const View& gbias) {
  const std::int64_t n = x.shape[x.ndim - 1], rows = x.numel() / n;
  dispatch_float(x.dtype, "layer_norm backward", [&](auto tag) {
    using T = decltype(tag);
    using S = Stat<T>;
    with_affine_type<T>(weight.dtype, [&](auto wtag) {
      using W = decltype(wtag);
      const T* xp = x.ptr<const T>();
      const W* w = weight.data ? weight.ptr<const W>() : nullptr;
      const T* g = gy.ptr<const T>();
      const S* mp = mean.ptr<const S>();
      const S* rp = rstd.ptr<const S>();
      T* out = gx.data ? gx.ptr<T>() : nullptr;
      const bool affine = gweight.data || gbias.data;
      // The affine gradients are sums over rows, taken in the same pass as the input gradient
      // while each row is at hand (a second pass read x and gy again): each block of kBlockRows
      // rows sums into its own partials, and the blocks' partials are added in block order
      // afterwards, so the order of additions depends on the shape alone, not on the threads.
      constexpr std::int64_t kBlockRows = 32;
      const std::int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
      Scratch<S> part_w(affine ? static_cast<std::size_t>(blocks * n) : 0),
          part_b(affine ? static_cast<std::size_t>(blocks * n) : 0);
      parallel_for(
          blocks, std::max<std::int64_t>(1, kElementGrain / (kBlockRows * n)), [&](std::int64_t b0, std::int64_t b1) {
            Scratch<S> gw(static_cast<std::size_t>(n)), xhat(static_cast<std::size_t>(n));
            for (std::int64_t blk = b0; blk < b1; ++blk) {
              S* pw = affine ? part_w.data() + blk * n : nullptr;
              S* pb = affine ? part_b.data() + blk * n : nullptr;
              for (std::int64_t r = blk * kBlockRows; r < std::min(rows, (blk + 1) * kBlockRows); ++r) {
                const T* xr = xp + r * n;
                const T* gr = g + r * n;
                const S mu = mp[r], rs = rp[r];
                for (std::int64_t j = 0; j < n; ++j) xhat[j] = (static_cast<S>(Num<T>::load(xr[j])) - mu) * rs;
                if (affine) {
                  for (std::int64_t j = 0; j < n; ++j) {
                    const S gv = static_cast<S>(Num<T>::load(gr[j]));
                    pw[j] = std::fma(gv, xhat[j], pw[j]);
                    pb[j] += gv;
                  }
                }
                if (!out) continue;
                // gx = rstd * (g' - mean(g') - xhat * mean(g' * xhat)), with g' = gy * weight.
                if (w) {  // the branch outside the loops, as in the forward
                  for (std::int64_t j = 0; j < n; ++j)
                    gw[j] = static_cast<S>(Num<T>::load(gr[j])) * static_cast<S>(Num<W>::load(w[j]));
                } else {
                  for (std::int64_t j = 0; j < n; ++j) gw[j] = static_cast<S>(Num<T>::load(gr[j]));
                }
                const S sum_g = long_sum<S>(n, [&](std::int64_t j) { return gw[j]; });
                const S sum_gx = long_sum<S>(n, [&](std::int64_t j) { return gw[j] * xhat[j]; });
                const S mean_g = sum_g / static_cast<S>(n), mean_gx = sum_gx / static_cast<S>(n);
                T* o = out + r * n;
                for (std::int64_t j = 0; j < n; ++j) {
                  // Explicit fmas here and below, as in the forward: the same bits in every instantiation.
                  o[j] = Num<T>::store(static_cast<compute_t<T>>(rs * std::fma(-xhat[j], mean_gx, gw[j] - mean_g)));
                }
              }
            }
          });
      if (!affine) return;
      // The blocks' partials, in block order, in double (a column sum's error then does not grow
      // with the rows, as in the reductions).
      W* gwp = gweight.data ? gweight.ptr<W>() : nullptr;
      W* gbp = gbias.data ? gbias.ptr<W>() : nullptr;
      parallel_for(n, std::max<std::int64_t>(16, kElementGrain / std::max<std::int64_t>(1, blocks)),
                   [&](std::int64_t j0, std::int64_t j1) {
                     for (std::int64_t j = j0; j < j1; ++j) {
                       double sw = 0, sb = 0;
                       for (std::int64_t blk = 0; blk < blocks; ++blk) {
                         sw += part_w[blk * n + j];
                         sb += part_b[blk * n + j];
                       }
                       if (gwp) gwp[j] = Num<W>::store(static_cast<compute_t<W>>(sw));
                       if (gbp) gbp[j] = Num<W>::store(static_cast<compute_t<W>>(sb));
                     }
                   });
    });
  });
}

}  // namespace ruda
