// See exp_wide.h. The kernel mirrors ops::detail::pexp_float_normal_range (vector_math.h) and
// Eigen 3.4's AVX packet operations it is made of: pmin/pmax with their operands swapped (Eigen's
// NaN propagation), pfloor as round-to-negative-infinity, pmadd as one fused multiply-add, and
// pldexp_fast_impl's 2^m built from the clamped biased exponent, truncated to an integer.
#include "exp_wide.h"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define RUDA_EXP_WIDE 1
#include <immintrin.h>

#include <limits>
#endif

namespace ruda::kernels::attention::detail {

#ifdef RUDA_EXP_WIDE
namespace {

__attribute__((target("avx512f"))) inline __m512 exp_normal_range(__m512 x_in) {
  const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);
  const __m512 x = _mm512_max_ps(_mm512_set1_ps(-88.723f), _mm512_min_ps(_mm512_set1_ps(88.723f), x_in));
  const __m512 m = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), half),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(m, _mm512_set1_ps(-0.693359375f), x);
  r = _mm512_fmadd_ps(m, _mm512_set1_ps(2.12194440e-4f), r);
  const __m512 r2 = _mm512_mul_ps(r, r), r3 = _mm512_mul_ps(r2, r);
  __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500E-4f), r, _mm512_set1_ps(1.3981999507E-3f));
  __m512 y1 = _mm512_fmadd_ps(_mm512_set1_ps(4.1665795894E-2f), r, _mm512_set1_ps(1.6666665459E-1f));
  const __m512 y2 = _mm512_add_ps(r, one);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073E-3f));
  y1 = _mm512_fmadd_ps(y1, r, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, r3, y1);
  y = _mm512_fmadd_ps(y, r2, y2);
  // y * 2^m: the biased exponent m + 127 clamped to [0, 255] (0 gives the factor 0).
  const __m512 biased = _mm512_min_ps(_mm512_set1_ps(255.0f),
                                      _mm512_max_ps(_mm512_setzero_ps(), _mm512_add_ps(m, _mm512_set1_ps(127.0f))));
  const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvttps_epi32(biased), 23));
  return _mm512_max_ps(x_in, _mm512_mul_ps(y, scale));
}

// One 16-lane step: exp of the lanes in `mask` (the others read as -inf, giving 0), stored back,
// and added to the 8-lane sums as the 8-lane kernel adds them: the low half's packet, then the
// high half's when `both`.
__attribute__((target("avx512f"))) inline void step(float* p, __mmask16 mask, __m512 shift, bool both, __m256& sum) {
  const __m512 in = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), mask, p);
  const __m512 e = exp_normal_range(_mm512_sub_ps(in, shift));
  _mm512_mask_storeu_ps(p, mask, e);
  sum = _mm256_add_ps(sum, _mm512_castps512_ps256(e));
  if (both) sum = _mm256_add_ps(sum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
}

__attribute__((target("avx512f"))) void exp_shifted_avx512(float* row, std::int64_t n, float shift, float* partial) {
  const __m512 s = _mm512_set1_ps(shift);
  __m256 sum = _mm256_setzero_ps();
  std::int64_t c = 0;
  for (; c + 16 <= n; c += 16) step(row + c, 0xffff, s, true, sum);
  const std::int64_t left = n - c;  // 0 to 15: a whole 8-lane packet, then a padded one
  if (left >= 8) {
    step(row + c, 0x00ff, s, false, sum);
    c += 8;
  }
  if (c < n) step(row + c, static_cast<__mmask16>((1u << (n - c)) - 1), s, false, sum);
  _mm256_storeu_ps(partial, sum);
}

}  // namespace

ExpShiftedWide exp_shifted_wide() {
  static const ExpShiftedWide kernel = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? &exp_shifted_avx512 : nullptr;
  }();
  return kernel;
}
#else
ExpShiftedWide exp_shifted_wide() { return nullptr; }
#endif

}  // namespace ruda::kernels::attention::detail
