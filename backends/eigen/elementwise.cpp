// Elementwise kernels: fill, copy, cast, unary math and its derivatives, binary ops, where.
#include <cmath>
#include <limits>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <Eigen/Core>
#include <unsupported/Eigen/SpecialFunctions>

#include "eigen_backend.h"
#include "kernel_util.h"
#include "op_descriptors.h"
#include "vector_math.h"

namespace ruda {

using namespace kernels;

namespace {

template <class T>
using ArrayMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
template <class T>
using ConstArrayMap = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;

// Values of 16-bit tensors are processed in chunks converted to f32 on the stack.
constexpr std::int64_t kChunk = 1024;

template <class S, class D>
D convert(S s) {
  if constexpr (std::is_same_v<S, D>) {
    return s;
  } else if constexpr (std::is_same_v<D, std::uint8_t>) {  // to bool: non-zero
    return static_cast<std::uint8_t>(Num<S>::load(s) != compute_t<S>(0));
  } else if constexpr (std::is_same_v<S, bfloat16> || std::is_same_v<S, float16>) {
    if constexpr (std::is_same_v<D, bfloat16> || std::is_same_v<D, float16>) {
      return Num<D>::store(Num<S>::load(s));  // f16 <-> bf16 through f32, exact for the intermediate
    } else {
      return convert<float, D>(Num<S>::load(s));
    }
  } else if constexpr (std::is_same_v<D, bfloat16> || std::is_same_v<D, float16>) {
    if constexpr (std::is_same_v<S, double>) {
      // Rounding f64 to f32 to nearest and then again to 16 bits can round twice the wrong way;
      // rounding to f32 "to odd" (truncate, then set the last bit when bits were lost) cannot.
      float f = static_cast<float>(s);
      if (std::isfinite(s) && static_cast<double>(f) != s) {
        std::uint32_t u;
        std::memcpy(&u, &f, 4);
        if (std::abs(static_cast<double>(f)) > std::abs(s)) u -= 1;  // now the truncation toward zero
        u |= 1u;
        std::memcpy(&f, &u, 4);
      }
      return Num<D>::store(f);
    } else {
      return Num<D>::store(static_cast<float>(s));
    }
  } else if constexpr (std::is_same_v<D, std::int64_t> && std::is_floating_point_v<S>) {
    // Out of range, static_cast is undefined behaviour: NaN becomes 0 and the rest saturates.
    if (std::isnan(s)) return 0;
    if (s >= static_cast<S>(9223372036854775808.0)) return std::numeric_limits<std::int64_t>::max();
    if (s <= static_cast<S>(-9223372036854775808.0)) return std::numeric_limits<std::int64_t>::min();
    return static_cast<std::int64_t>(s);
  } else {
    return static_cast<D>(s);
  }
}

}  // namespace

void EigenBackend::fill(const View& out, double value) {
  dispatch_all(out.dtype, "fill", [&](auto tag) {
    using T = decltype(tag);
    const T v = convert<double, T>(value);
    T* p = out.ptr<T>();
    const View* views[1] = {&out};
    Layout<1> layout(views);
    parallel_for(out.numel(), kElementGrain, [&](std::int64_t begin, std::int64_t end) {
      for_each_run(layout, begin, end, [&](const std::int64_t* off, std::int64_t n) {
        T* q = p + off[0];
        const std::int64_t s = layout.inner_stride(0);
        if (s == 1) {
          if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>) {
            // Through the bits: std::fill over the 16-bit float structs stored one element at a
            // time (a bf16 zero fill ran at a fifth of f32's bandwidth), over uint16_t it vectorizes.
            std::fill(reinterpret_cast<std::uint16_t*>(q), reinterpret_cast<std::uint16_t*>(q + n), v.bits);
          } else {
            std::fill(q, q + n, v);
          }
        } else {
          for (std::int64_t i = 0; i < n; ++i) q[i * s] = v;
        }
      });
    });
  });
}

namespace {
// dst[r * ldd + c] = src[c * lds + r] for a square block of B x B values in registers, B rows
// read and B written, each whole: 4-byte values in blocks of 8 (AVX2), 2-byte ones in blocks of 8
// (SSE2), 8-byte ones in blocks of 4 (AVX). register_block<T>() is 0 where the build has none.
#if defined(__AVX2__)
inline void transpose_block(const std::uint32_t* src, std::int64_t lds, std::uint32_t* dst, std::int64_t ldd) {
  const auto* s = reinterpret_cast<const float*>(src);
  auto* d = reinterpret_cast<float*>(dst);
  __m256 r[8], t[8], u[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(s + k * lds);
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
    t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
  }
  for (int k = 0; k < 8; k += 4) {
    u[k] = _mm256_shuffle_ps(t[k], t[k + 2], 0x44);
    u[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], 0xEE);
    u[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0x44);
    u[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    _mm256_storeu_ps(d + k * ldd, _mm256_permute2f128_ps(u[k], u[k + 4], 0x20));
    _mm256_storeu_ps(d + (k + 4) * ldd, _mm256_permute2f128_ps(u[k], u[k + 4], 0x31));
  }
}
#endif
#if defined(__SSE2__)
inline void transpose_block(const std::uint16_t* src, std::int64_t lds, std::uint16_t* dst, std::int64_t ldd) {
  __m128i r[8], a[8], b[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k * lds));
  for (int k = 0; k < 8; k += 2) {
    a[k] = _mm_unpacklo_epi16(r[k], r[k + 1]);
    a[k + 1] = _mm_unpackhi_epi16(r[k], r[k + 1]);
  }
  // b[0..3]: rows 0-3 interleaved by 32 bits (columns 0-1, 2-3, 4-5, 6-7); b[4..7]: rows 4-7.
  for (int h = 0; h < 8; h += 4) {
    b[h] = _mm_unpacklo_epi32(a[h], a[h + 2]);
    b[h + 1] = _mm_unpackhi_epi32(a[h], a[h + 2]);
    b[h + 2] = _mm_unpacklo_epi32(a[h + 1], a[h + 3]);
    b[h + 3] = _mm_unpackhi_epi32(a[h + 1], a[h + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * k) * ldd), _mm_unpacklo_epi64(b[k], b[k + 4]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * k + 1) * ldd), _mm_unpackhi_epi64(b[k], b[k + 4]));
  }
}
#endif
#if defined(__AVX__)
inline void transpose_block(const std::uint64_t* src, std::int64_t lds, std::uint64_t* dst, std::int64_t ldd) {
  const auto* s = reinterpret_cast<const double*>(src);
  auto* d = reinterpret_cast<double*>(dst);
  __m256d r[4];
  for (int k = 0; k < 4; ++k) r[k] = _mm256_loadu_pd(s + k * lds);
  const __m256d t0 = _mm256_unpacklo_pd(r[0], r[1]), t1 = _mm256_unpackhi_pd(r[0], r[1]);
  const __m256d t2 = _mm256_unpacklo_pd(r[2], r[3]), t3 = _mm256_unpackhi_pd(r[2], r[3]);
  _mm256_storeu_pd(d, _mm256_permute2f128_pd(t0, t2, 0x20));
  _mm256_storeu_pd(d + ldd, _mm256_permute2f128_pd(t1, t3, 0x20));
  _mm256_storeu_pd(d + 2 * ldd, _mm256_permute2f128_pd(t0, t2, 0x31));
  _mm256_storeu_pd(d + 3 * ldd, _mm256_permute2f128_pd(t1, t3, 0x31));
}
#endif

template <class T>
constexpr std::int64_t register_block() {
#if defined(__AVX2__)
  if constexpr (sizeof(T) == 4) return 8;
#endif
#if defined(__SSE2__)
  if constexpr (sizeof(T) == 2) return 8;
#endif
#if defined(__AVX__)
  if constexpr (sizeof(T) == 8) return 4;
#endif
  return 0;
}

// A tile of a transposing copy: to[i * to_row + j] = from[i + j * from_col] for i < rows, j < cols,
// in register transposes where the CPU has them, the edges element by element. Walked element
// by element, a tile read as many cache lines at once as it has columns, and where the stride is
// a multiple of 4 KiB those all fall in one set of the L1 cache, more than its ways (one thread,
// [4096, 4096] f32: 42.9 ms in 32 x 32 tiles element by element, 16.0 ms in 64 x 64 tiles of
// register transposes; [1024, 1024]: 1.86 against 0.48; a plain copy 8.4 and 0.09; scratch loop
// on a 2-core Zen 4).
template <class T>
void transpose_tile(const T* from, std::int64_t from_col, T* to, std::int64_t to_row, std::int64_t rows,
                    std::int64_t cols) {
  constexpr std::int64_t kBlock = register_block<T>();
  std::int64_t ib = 0, jb = 0;  // the part done in blocks
  if constexpr (kBlock > 0) {
    ib = rows - rows % kBlock;
    jb = cols - cols % kBlock;
    for (std::int64_t j = 0; j < jb; j += kBlock) {
      for (std::int64_t i = 0; i < ib; i += kBlock) {
        // (As raw bits of the element's size: any type of that size moves the same way.)
        using U = std::conditional_t<sizeof(T) == 2, std::uint16_t,
                                     std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>;
        transpose_block(reinterpret_cast<const U*>(from + i + j * from_col), from_col,
                        reinterpret_cast<U*>(to + i * to_row + j), to_row);
      }
    }
  }
  for (std::int64_t i = 0; i < rows; ++i) {
    const T* f = from + i;
    T* t = to + i * to_row;
    for (std::int64_t j = i < ib ? jb : 0; j < cols; ++j) t[j] = f[j * from_col];
  }
}

// A copy that transposes: dst's innermost axis reads src at a large stride while another axis of
// src is contiguous (transpose(x).contiguous(), a permute's copy). Copied in square tiles, so that
// both sides read and write whole cache lines; element by element along dst's rows, every read
// was a cache miss (a [1024, 2048] f32 transpose took 5.4 ms, 16 times a plain copy). false when
// the layout is not that.
template <class T>
bool copy_transposing(const View& src, const View& dst) {
  const int last = dst.ndim - 1;
  // 64 elements (register transposes in tiles of 64 measured fastest, against 16 and 32, at
  // [2048, 2048] and [4096, 4096] f32); 16 to 128 where the CPU has none.
  constexpr std::int64_t kTile = register_block<T>() > 0 ? 64 : std::max<std::int64_t>(16, 128 / sizeof(T));
  if (last < 1 || dst.strides[last] != 1 || src.strides[last] == 1 ||
      dst.shape[last] < std::min<std::int64_t>(kTile, 16))
    return false;
  int inner = -1;  // the axis along which src is contiguous
  for (int a = 0; a < last; ++a) {
    if (src.strides[a] == 1 && src.shape[a] >= std::min<std::int64_t>(kTile, 16)) inner = a;
  }
  if (inner < 0) return false;
  const std::int64_t rows = dst.shape[inner], cols = dst.shape[last];
  const std::int64_t src_col = src.strides[last], dst_row = dst.strides[inner];
  // The other axes index whole [rows, cols] blocks.
  std::int64_t batch = 1;
  for (int a = 0; a < last; ++a) {
    if (a != inner) batch *= dst.shape[a];
  }
  const std::int64_t row_tiles = (rows + kTile - 1) / kTile;
  const T* s = src.ptr<const T>();
  T* d = dst.ptr<T>();
  parallel_for(batch * row_tiles, std::max<std::int64_t>(1, kElementGrain / (kTile * cols)),
               [&](std::int64_t t0, std::int64_t t1) {
                 for (std::int64_t t = t0; t < t1; ++t) {
                   std::int64_t rest = t / row_tiles, so = 0, dof = 0;
                   for (int a = last - 1; a >= 0; --a) {
                     if (a == inner) continue;
                     const std::int64_t i = rest % dst.shape[a];
                     rest /= dst.shape[a];
                     so += i * src.strides[a];
                     dof += i * dst.strides[a];
                   }
                   const std::int64_t i0 = (t % row_tiles) * kTile, i1 = std::min(rows, i0 + kTile);
                   for (std::int64_t j0 = 0; j0 < cols; j0 += kTile) {
                     const std::int64_t j1 = std::min(cols, j0 + kTile);
                     transpose_tile(s + so + i0 + j0 * src_col, src_col, d + dof + i0 * dst_row + j0, dst_row, i1 - i0,
                                    j1 - j0);
                   }
                 }
               });
  return true;
}

template <class T>
void copy_typed(const View& src, const View& dst) {
  if (copy_transposing<T>(src, dst)) return;
  const View* views[2] = {&src, &dst};
  Layout<2> layout(views);
  const T* s = src.ptr<const T>();
  T* d = dst.ptr<T>();
  parallel_for(dst.numel(), kElementGrain, [&](std::int64_t begin, std::int64_t end) {
    for_each_run(layout, begin, end, [&](const std::int64_t* off, std::int64_t n) {
      const std::int64_t ss = layout.inner_stride(0), ds = layout.inner_stride(1);
      const T* a = s + off[0];
      T* b = d + off[1];
      if (ss == 1 && ds == 1) {
        std::memcpy(b, a, static_cast<std::size_t>(n) * sizeof(T));
      } else if (ss == 0 && ds == 1) {
        std::fill_n(b, n, *a);
      } else {
        for (std::int64_t i = 0; i < n; ++i) b[i * ds] = a[i * ss];
      }
    });
  });
}
}  // namespace

void EigenBackend::copy(const View& src, const View& dst) {
  dispatch_bits(dtype_size(dst.dtype), [&](auto bits) { copy_typed<decltype(bits)>(src, dst); });
}

void EigenBackend::cast(const View& src, const View& dst) {
  const std::int64_t n = dst.numel();
  dispatch_all(src.dtype, "cast", [&](auto stag) {
    using S = decltype(stag);
    dispatch_all(dst.dtype, "cast", [&](auto dtag) {
      using D = decltype(dtag);
      const S* s = src.ptr<const S>();
      D* d = dst.ptr<D>();
      parallel_for(n, kElementGrain, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t i = begin; i < end; ++i) d[i] = convert<S, D>(s[i]);
      });
    });
  });
}

// --- unary ---
//
// The formulas are the ops' descriptors (engine/src/op_descriptors.h); visit_unary picks the
// descriptor once per call, and each kernel below runs its formula on whole chunks.

namespace {

// y = f(x) on n values; 16-bit values are widened to f32 in chunks on the stack.
template <class D, class T>
void unary_range(const T* x, T* y, std::int64_t n) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    const ConstArrayMap<T> xa(x, n);
    ArrayMap<T> ya(y, n);
    D::forward(xa, ya);
  } else {
    float xs[kChunk], ys[kChunk];
    for (std::int64_t c = 0; c < n; c += kChunk) {
      const std::int64_t m = std::min(kChunk, n - c);
      for (std::int64_t i = 0; i < m; ++i) xs[i] = Num<T>::load(x[c + i]);
      unary_range<D, float>(xs, ys, m);
      for (std::int64_t i = 0; i < m; ++i) y[c + i] = Num<T>::store(ys[i]);
    }
  }
}

// gx = gy * f'(x) on n values, from `saved`: x or y as the descriptor reads (null when it reads
// neither). The formula takes only that argument, so it cannot read the other.
template <class D, class T>
void unary_backward_range(const T* saved, const T* gy, T* gx, std::int64_t n) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    const ConstArrayMap<T> ga(gy, n);
    ArrayMap<T> gxa(gx, n);
    if constexpr (D::reads == ops::Reads::nothing) {
      D::backward(ga, gxa);
    } else {
      D::backward(ConstArrayMap<T>(saved, n), ga, gxa);
    }
  } else {
    float ss[kChunk], gys[kChunk], gxs[kChunk];
    for (std::int64_t c = 0; c < n; c += kChunk) {
      const std::int64_t m = std::min(kChunk, n - c);
      for (std::int64_t i = 0; i < m; ++i) gys[i] = Num<T>::load(gy[c + i]);
      if constexpr (D::reads != ops::Reads::nothing) {
        for (std::int64_t i = 0; i < m; ++i) ss[i] = Num<T>::load(saved[c + i]);
      }
      unary_backward_range<D, float>(D::reads == ops::Reads::nothing ? nullptr : ss, gys, gxs, m);
      for (std::int64_t i = 0; i < m; ++i) gx[c + i] = Num<T>::store(gxs[i]);
    }
  }
}

}  // namespace

void EigenBackend::unary(UnaryOp op, const View& x, const View& y) {
  const std::int64_t n = x.numel();
  ops::visit_unary(op, [&]<class D>(D) {
    if (x.dtype == DType::i64) {
      if constexpr (D::domain == ops::Domain::numbers) {
        const ConstArrayMap<std::int64_t> xa(x.ptr<const std::int64_t>(), n);
        ArrayMap<std::int64_t> ya(y.ptr<std::int64_t>(), n);
        D::forward(xa, ya);
        return;
      } else {
        fail<DTypeError>(D::name, "is not defined on i64");
      }
    }
    dispatch_float(x.dtype, D::name.data(), [&](auto tag) {
      using T = decltype(tag);
      parallel_for(n, kElementGrain / 4, [&](std::int64_t begin, std::int64_t end) {
        unary_range<D, T>(x.ptr<const T>() + begin, y.ptr<T>() + begin, end - begin);
      });
    });
  });
}

void EigenBackend::unary_backward(UnaryOp op, const View& x, const View& y, const View& gy, const View& gx) {
  const std::int64_t n = gy.numel();
  ops::visit_unary(op, [&]<class D>(D) {
    const View& saved = D::reads == ops::Reads::input ? x : y;
    if (D::reads != ops::Reads::nothing && !saved.data && n > 0) {
      fail<ArgumentError>(std::string(D::name) + " backward", "needs the saved ",
                          D::reads == ops::Reads::input ? "input" : "output", " (", dtype_name(gy.dtype), " ", n,
                          " values), given none");
    }
    dispatch_float(gy.dtype, D::name.data(), [&](auto tag) {
      using T = decltype(tag);
      parallel_for(n, kElementGrain / 4, [&](std::int64_t begin, std::int64_t end) {
        const T* sp = saved.data ? saved.ptr<const T>() + begin : nullptr;
        unary_backward_range<D, T>(sp, gy.ptr<const T>() + begin, gx.ptr<T>() + begin, end - begin);
      });
    });
  });
}

namespace {

// y = f(x) and dydx = f'(x) on n values in chunks whose x is first copied (16-bit: widened) onto
// the stack, so that dydx may be x itself; f32 and f64 outputs are written in place, 16-bit ones
// through the stack.
template <class D, class T>
void unary_with_derivative_range(const T* x, T* y, T* dydx, std::int64_t n) {
  using C = compute_t<T>;
  constexpr bool wide = std::is_same_v<C, T>;
  C xs[kChunk], ys[wide ? 1 : kChunk], ds[wide ? 1 : kChunk];
  for (std::int64_t c = 0; c < n; c += kChunk) {
    const std::int64_t m = std::min(kChunk, n - c);
    for (std::int64_t i = 0; i < m; ++i) xs[i] = Num<T>::load(x[c + i]);
    const ConstArrayMap<C> xa(xs, m);
    if constexpr (wide) {
      ArrayMap<C> ya(y + c, m), da(dydx + c, m);
      D::forward_and_derivative(xa, ya, da);
    } else {
      ArrayMap<C> ya(ys, m), da(ds, m);
      D::forward_and_derivative(xa, ya, da);
      for (std::int64_t i = 0; i < m; ++i) {
        y[c + i] = Num<T>::store(ys[i]);
        dydx[c + i] = Num<T>::store(ds[i]);
      }
    }
  }
}

template <class D>
concept HasForwardAndDerivative = requires(const ConstArrayMap<float>& x, ArrayMap<float>& y) {
  D::forward_and_derivative(x, y, y);
};

}  // namespace

void EigenBackend::unary_with_derivative(UnaryOp op, const View& x, const View& y, const View& dydx) {
  ops::check_unary_with_derivative(op, x, y, dydx);
  const std::int64_t n = x.numel();
  bool fused = false;
  ops::visit_unary(op, [&]<class D>(D) {
    if constexpr (HasForwardAndDerivative<D>) {
      if (x.dtype == DType::i64) return;  // the default's unary names the refusal
      fused = true;
      dispatch_float(x.dtype, D::name.data(), [&](auto tag) {
        using T = decltype(tag);
        parallel_for(n, kElementGrain / 4, [&](std::int64_t begin, std::int64_t end) {
          unary_with_derivative_range<D, T>(x.ptr<const T>() + begin, y.ptr<T>() + begin, dydx.ptr<T>() + begin,
                                            end - begin);
        });
      });
    }
  });
  if (!fused) Backend::unary_with_derivative(op, x, y, dydx);
}

// --- binary ---

namespace {

template <class C>
inline bool is_nan(C v) {
  if constexpr (std::is_floating_point_v<C>) {
    return std::isnan(v);
  } else {
    return false;
  }
}

// i64 arithmetic wraps around on overflow (two's complement, as PyTorch's does) instead of being
// undefined behaviour: computed in uint64_t, where wrapping is defined, and converted back.
inline std::int64_t wrapped(std::uint64_t v) { return static_cast<std::int64_t>(v); }

// a^b for i64 by squaring: exact (through double it was not, past 2^53) and wrapping like the other
// ops. A negative b was refused before the kernel (EigenBackend::binary).
inline std::int64_t integer_power(std::int64_t a, std::int64_t b) {
  std::uint64_t result = 1, base = static_cast<std::uint64_t>(a);
  for (auto e = static_cast<std::uint64_t>(b); e; e >>= 1) {
    if (e & 1) result *= base;
    base *= base;
  }
  return wrapped(result);
}

template <BinaryOp Op, class C>
inline auto apply(C a, C b) {
  constexpr bool kInteger = std::is_same_v<C, std::int64_t>;
  if constexpr (Op == BinaryOp::add) {
    if constexpr (kInteger)
      return wrapped(static_cast<std::uint64_t>(a) + static_cast<std::uint64_t>(b));
    else
      return a + b;
  }
  if constexpr (Op == BinaryOp::sub) {
    if constexpr (kInteger)
      return wrapped(static_cast<std::uint64_t>(a) - static_cast<std::uint64_t>(b));
    else
      return a - b;
  }
  if constexpr (Op == BinaryOp::mul) {
    if constexpr (kInteger)
      return wrapped(static_cast<std::uint64_t>(a) * static_cast<std::uint64_t>(b));
    else
      return a * b;
  }
  if constexpr (Op == BinaryOp::div) {
    // INT64_MIN / -1 overflows (and traps on x86): it wraps to INT64_MIN, i.e. -a in uint64_t.
    if constexpr (kInteger)
      return b == -1 ? wrapped(0 - static_cast<std::uint64_t>(a)) : a / b;
    else
      return a / b;
  }
  if constexpr (Op == BinaryOp::pow) {
    if constexpr (kInteger) {
      return integer_power(a, b);
    } else if constexpr (std::is_integral_v<C>) {
      return static_cast<C>(std::pow(static_cast<double>(a), static_cast<double>(b)));
    } else {
      return std::pow(a, b);
    }
  }
  // NaN propagates; of two equal values (0 and -0) the first, as PyTorch's maximum(0, -0) is 0.
  if constexpr (Op == BinaryOp::maximum) return (a >= b || is_nan(a)) ? a : b;
  if constexpr (Op == BinaryOp::minimum) return (a <= b || is_nan(a)) ? a : b;
  if constexpr (Op == BinaryOp::eq) return std::uint8_t(a == b);
  if constexpr (Op == BinaryOp::ne) return std::uint8_t(a != b);
  if constexpr (Op == BinaryOp::lt) return std::uint8_t(a < b);
  if constexpr (Op == BinaryOp::le) return std::uint8_t(a <= b);
  if constexpr (Op == BinaryOp::gt) return std::uint8_t(a > b);
  if constexpr (Op == BinaryOp::ge) return std::uint8_t(a >= b);
}

template <BinaryOp Op, class T>
void binary_typed(const View& a, const View& b, const View& out) {
  using C = compute_t<T>;
  using O = std::conditional_t<(Op >= BinaryOp::eq), std::uint8_t, T>;
  const View* views[3] = {&a, &b, &out};
  Layout<3> layout(views);
  const T* pa = a.ptr<const T>();
  const T* pb = b.ptr<const T>();
  O* po = out.ptr<O>();
  auto store = [](auto v) -> O {
    if constexpr (std::is_same_v<O, std::uint8_t>) {
      return v;
    } else {
      return Num<T>::store(v);
    }
  };
  const std::int64_t sa = layout.inner_stride(0), sb = layout.inner_stride(1), so = layout.inner_stride(2);
  // Both operands strided along the output's rows, one of them contiguous down its columns (two
  // transposed matrices, x.T + y.T): walked row by row, each value read was a cache line of its
  // own (4096^2 f32: 6.3-6.5x PyTorch's time). Tiles of kTile x kTile are computed down their
  // columns instead, reading runs of the operands into a buffer in that order, which is then
  // transposed into the output's rows in registers (transpose_tile; written element by element,
  // a tile's rows fell in one cache set where the output's rows are a multiple of 4 KiB apart).
  // The same value for every element.
  // The last two axes form the tiles; any axes before them (a batch of transposed matrices,
  // x.transpose(1, 2) + y.transpose(1, 2)) index whole matrices (they ran the strided loop, 3.5x
  // the time of the same values as one matrix).
  const int nd = layout.ndim;
  if (nd >= 2 && so == 1 && sa != 1 && sb != 1 && (layout.strides[0][nd - 2] == 1 || layout.strides[1][nd - 2] == 1)) {
    constexpr std::int64_t kTile = 64;
    const std::int64_t rows = layout.shape[nd - 2], cols = layout.shape[nd - 1];
    const std::int64_t sa0 = layout.strides[0][nd - 2], sb0 = layout.strides[1][nd - 2],
                       so0 = layout.strides[2][nd - 2];
    const std::int64_t tile_cols = (cols + kTile - 1) / kTile, per_matrix = (rows + kTile - 1) / kTile * tile_cols;
    std::int64_t batch = 1;
    for (int d = 0; d < nd - 2; ++d) batch *= layout.shape[d];
    parallel_for(batch * per_matrix, std::max<std::int64_t>(1, kElementGrain / (kTile * kTile)),
                 [&](std::int64_t begin, std::int64_t end) {
                   Scratch<O> buffer(static_cast<std::size_t>(kTile * kTile));  // [tile column][tile row]
                   for (std::int64_t t = begin; t < end; ++t) {
                     // The matrix's offsets in each operand, from its index over the batch axes.
                     std::int64_t rest = t / per_matrix, oa = 0, ob = 0, oo = 0;
                     for (int d = nd - 3; d >= 0; --d) {
                       const std::int64_t i = rest % layout.shape[d];
                       rest /= layout.shape[d];
                       oa += i * layout.strides[0][d];
                       ob += i * layout.strides[1][d];
                       oo += i * layout.strides[2][d];
                     }
                     const std::int64_t tile = t % per_matrix;
                     const std::int64_t i0 = tile / tile_cols * kTile, j0 = tile % tile_cols * kTile;
                     const std::int64_t n_rows = std::min(rows - i0, kTile), n_cols = std::min(cols - j0, kTile);
                     for (std::int64_t j = 0; j < n_cols; ++j) {
                       const T* x = pa + oa + i0 * sa0 + (j0 + j) * sa;
                       const T* y = pb + ob + i0 * sb0 + (j0 + j) * sb;
                       O* column = buffer.data() + j * kTile;
                       for (std::int64_t i = 0; i < n_rows; ++i) {
                         column[i] = store(apply<Op, C>(Num<T>::load(x[i * sa0]), Num<T>::load(y[i * sb0])));
                       }
                     }
                     transpose_tile(buffer.data(), kTile, po + oo + i0 * so0 + j0, so0, n_rows, n_cols);
                   }
                 });
    return;
  }
  parallel_for(out.numel(), kElementGrain, [&](std::int64_t begin, std::int64_t end) {
    for_each_run(layout, begin, end, [&](const std::int64_t* off, std::int64_t n) {
      const T* x = pa + off[0];
      const T* y = pb + off[1];
      O* z = po + off[2];
      // The common cases as separate loops so the compiler vectorizes each.
      if (so == 1 && sa == 1 && sb == 1) {
        for (std::int64_t i = 0; i < n; ++i) z[i] = store(apply<Op, C>(Num<T>::load(x[i]), Num<T>::load(y[i])));
      } else if (so == 1 && sa == 1 && sb == 0) {
        const C yv = Num<T>::load(*y);
        for (std::int64_t i = 0; i < n; ++i) z[i] = store(apply<Op, C>(Num<T>::load(x[i]), yv));
      } else if (so == 1 && sa == 0 && sb == 1) {
        const C xv = Num<T>::load(*x);
        for (std::int64_t i = 0; i < n; ++i) z[i] = store(apply<Op, C>(xv, Num<T>::load(y[i])));
      } else {
        for (std::int64_t i = 0; i < n; ++i) {
          z[i * so] = store(apply<Op, C>(Num<T>::load(x[i * sa]), Num<T>::load(y[i * sb])));
        }
      }
    });
  });
}

template <class T>
void binary_dispatch(BinaryOp op, const View& a, const View& b, const View& out) {
  switch (op) {
#define RUDA_CASE(OP) \
  case BinaryOp::OP:  \
    return binary_typed<BinaryOp::OP, T>(a, b, out);
    RUDA_CASE(add)
    RUDA_CASE(sub)
    RUDA_CASE(mul)
    RUDA_CASE(div)
    RUDA_CASE(pow)
    RUDA_CASE(maximum)
    RUDA_CASE(minimum)
    RUDA_CASE(eq)
    RUDA_CASE(ne)
    RUDA_CASE(lt)
    RUDA_CASE(le)
    RUDA_CASE(gt)
    RUDA_CASE(ge)
#undef RUDA_CASE
  }
}

}  // namespace

void EigenBackend::binary(BinaryOp op, const View& a, const View& b, const View& out) {
  if (a.dtype == DType::i64 && (op == BinaryOp::div || op == BinaryOp::pow)) {
    // Integer division by zero is undefined behaviour in C++, and an integer to a negative power
    // is no integer (PyTorch refuses both too): refused like an index error.
    const View* views[1] = {&b};
    Layout<1> layout(views);
    for_each_run(layout, 0, b.numel(), [&](const std::int64_t* off, std::int64_t n) {
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t v = b.ptr<const std::int64_t>()[off[0] + i * layout.inner_stride(0)];
        if (op == BinaryOp::div && v == 0) fail<ArgumentError>("div", "integer division by zero");
        if (op == BinaryOp::pow && v < 0) {
          fail<ArgumentError>("pow", "an i64 tensor to a negative power (", v, ") is not an integer");
        }
      }
    });
  }
  dispatch_all(a.dtype, op_name(op).data(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, std::uint8_t>) {
      if (op == BinaryOp::eq) return binary_typed<BinaryOp::eq, T>(a, b, out);
      if (op == BinaryOp::ne) return binary_typed<BinaryOp::ne, T>(a, b, out);
      fail<DTypeError>(op_name(op), "is not defined on bool");
    } else {
      binary_dispatch<T>(op, a, b, out);
    }
  });
}

void EigenBackend::add_scaled(const View& x, double alpha, const View& y) {
  dispatch_float(y.dtype, "add_", [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    const View* views[2] = {&x, &y};
    Layout<2> layout(views);
    const T* px = x.ptr<const T>();
    T* py = y.ptr<T>();
    const C a = static_cast<C>(alpha);
    const std::int64_t sx = layout.inner_stride(0), sy = layout.inner_stride(1);
    parallel_for(y.numel(), kElementGrain, [&](std::int64_t begin, std::int64_t end) {
      for_each_run(layout, begin, end, [&](const std::int64_t* off, std::int64_t n) {
        const T* xs = px + off[0];
        T* ys = py + off[1];
        // One fused multiply-add in the compute type, rounded once, as PyTorch's add with an
        // alpha (its vectorized fmadd), then to the dtype.
        if (sx == 1 && sy == 1) {
          for (std::int64_t i = 0; i < n; ++i) {
            ys[i] = Num<T>::store(static_cast<C>(std::fma(Num<T>::load(xs[i]), a, Num<T>::load(ys[i]))));
          }
        } else {
          for (std::int64_t i = 0; i < n; ++i) {
            ys[i * sy] = Num<T>::store(static_cast<C>(std::fma(Num<T>::load(xs[i * sx]), a, Num<T>::load(ys[i * sy]))));
          }
        }
      });
    });
  });
}

void EigenBackend::where(const View& cond, const View& a, const View& b, const View& out) {
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const View* views[4] = {&cond, &a, &b, &out};
    Layout<4> layout(views);
    const auto* c = cond.ptr<const std::uint8_t>();
    const T* x = a.ptr<const T>();
    const T* y = b.ptr<const T>();
    T* z = out.ptr<T>();
    const std::int64_t sc = layout.inner_stride(0), sa = layout.inner_stride(1), sb = layout.inner_stride(2),
                       so = layout.inner_stride(3);
    // A select through a mask of the condition, not a branch: a branch on data-dependent
    // conditions (a mask of random values) mispredicts half the time, and the loop did not
    // vectorize (1.9 ns a value on 4M values, against 0.3 for a multiply). Unit strides get a
    // loop of their own, which the compiler vectorizes.
    auto select = [](std::uint8_t keep, T p, T q) {
      const T mask = static_cast<T>(T{0} - static_cast<T>(keep != 0));
      return static_cast<T>((p & mask) | (q & static_cast<T>(~mask)));
    };
    parallel_for(out.numel(), kElementGrain, [&](std::int64_t begin, std::int64_t end) {
      for_each_run(layout, begin, end, [&](const std::int64_t* off, std::int64_t n) {
        const std::uint8_t* cc = c + off[0];
        const T* xx = x + off[1];
        const T* yy = y + off[2];
        T* zz = z + off[3];
        if (sc == 1 && sa == 1 && sb == 1 && so == 1) {
          for (std::int64_t i = 0; i < n; ++i) zz[i] = select(cc[i], xx[i], yy[i]);
        } else {
          for (std::int64_t i = 0; i < n; ++i) zz[i * so] = select(cc[i * sc], xx[i * sa], yy[i * sb]);
        }
      });
    });
  };
  dispatch_bits(dtype_size(out.dtype), run);
}

}  // namespace ruda
