// Reduction kernels of the collectives: sums and maxima over several buffers, and the ring step.
// Loops are plain and free of calls so the compiler vectorizes them (-march is set project-wide).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "internal.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace ruda::collectives_detail {

namespace {

// Element traits (ruda/dtype.h's), except that i64 sums in unsigned arithmetic, which wraps on
// overflow where signed would be undefined.
template <class T>
struct Elem : ElementTraits<T> {
  using Value = typename ElementTraits<T>::Compute;
};
template <>
struct Elem<std::int64_t> {
  using Value = std::uint64_t;
  static std::uint64_t load(std::int64_t x) { return static_cast<std::uint64_t>(x); }
  static std::int64_t store(std::uint64_t v) { return static_cast<std::int64_t>(v); }
};

template <class T>
constexpr bool is_16bit = std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>;

// Rounds a float to T's precision and back (the per-step rounding of native 16-bit sums).
template <class T>
inline float round_to(float v) {
  return Elem<T>::load(Elem<T>::store(v));
}

// Work in blocks small enough for the accumulator to stay in L1 while every source streams by.
constexpr std::int64_t kBlock = 1024;

template <class T, bool kRoundEachStep>
void sum_typed(const void* const* sources, int n, void* dst_raw, std::int64_t count) {
  using V = typename Elem<T>::Value;
  T* dst = static_cast<T*>(dst_raw);
  V acc[kBlock];
  for (std::int64_t base = 0; base < count; base += kBlock) {
    const std::int64_t m = std::min(kBlock, count - base);
    const T* first = static_cast<const T*>(sources[0]) + base;
    for (std::int64_t j = 0; j < m; ++j) acc[j] = Elem<T>::load(first[j]);
    for (int k = 1; k < n; ++k) {
      const T* src = static_cast<const T*>(sources[k]) + base;
      if constexpr (kRoundEachStep) {
        for (std::int64_t j = 0; j < m; ++j) acc[j] = round_to<T>(acc[j] + Elem<T>::load(src[j]));
      } else {
        for (std::int64_t j = 0; j < m; ++j) acc[j] = acc[j] + Elem<T>::load(src[j]);
      }
    }
    for (std::int64_t j = 0; j < m; ++j) dst[base + j] = Elem<T>::store(acc[j]);
  }
}

// The larger value; a NaN in either place wins (the first one seen keeps its payload).
template <class V>
inline V max_nan(V a, V b) {
  if constexpr (std::is_floating_point_v<V>) {
    if (a != a) return a;
    if (b != b) return b;
  }
  return b > a ? b : a;
}

template <class T>
void max_typed(const void* const* sources, int n, void* dst_raw, std::int64_t count) {
  // i64 compares as signed: Elem<int64_t> loads unsigned (for wrapping sums), so bypass it here.
  using V = std::conditional_t<std::is_same_v<T, std::int64_t>, std::int64_t, typename Elem<T>::Value>;
  auto load = [](T x) -> V {
    if constexpr (std::is_same_v<T, std::int64_t>) {
      return x;
    } else {
      return Elem<T>::load(x);
    }
  };
  auto store = [](V v) -> T {
    if constexpr (std::is_same_v<T, std::int64_t>) {
      return v;
    } else {
      return Elem<T>::store(v);
    }
  };
  T* dst = static_cast<T*>(dst_raw);
  V acc[kBlock];
  for (std::int64_t base = 0; base < count; base += kBlock) {
    const std::int64_t m = std::min(kBlock, count - base);
    const T* first = static_cast<const T*>(sources[0]) + base;
    for (std::int64_t j = 0; j < m; ++j) acc[j] = load(first[j]);
    for (int k = 1; k < n; ++k) {
      const T* src = static_cast<const T*>(sources[k]) + base;
      for (std::int64_t j = 0; j < m; ++j) acc[j] = max_nan(acc[j], load(src[j]));
    }
    for (std::int64_t j = 0; j < m; ++j) dst[base + j] = store(acc[j]);
  }
}

// dst = partial + own. P is the partial's element type, T the data's, D the destination's; all
// arithmetic runs in T's value type (float for 16-bit data). No __restrict: dst may be partial.
template <class P, class T, class D>
void add_typed(const void* partial_raw, const void* own_raw, void* dst_raw, std::int64_t count) {
  const P* partial = static_cast<const P*>(partial_raw);
  const T* own = static_cast<const T*>(own_raw);
  D* dst = static_cast<D*>(dst_raw);
  for (std::int64_t i = 0; i < count; ++i) dst[i] = Elem<D>::store(Elem<P>::load(partial[i]) + Elem<T>::load(own[i]));
}

template <class F, class T>
void convert_typed(const void* src_raw, void* dst_raw, std::int64_t count) {
  const F* src = static_cast<const F*>(src_raw);
  T* dst = static_cast<T*>(dst_raw);
  for (std::int64_t i = 0; i < count; ++i) dst[i] = Elem<T>::store(Elem<F>::load(src[i]));
}

[[noreturn]] void unsupported(const char* what, DType dtype) {
  fail<DTypeError>(what, "dtype ", dtype_name(dtype), " is not supported");
}

}  // namespace

void sum(const void* const* sources, int n, void* dst, std::int64_t count, DType dtype, Accumulate accumulate) {
  const bool native = accumulate == Accumulate::native;
  switch (dtype) {
    case DType::f32:
      return sum_typed<float, false>(sources, n, dst, count);
    case DType::f64:
      return sum_typed<double, false>(sources, n, dst, count);
    case DType::i64:
      return sum_typed<std::int64_t, false>(sources, n, dst, count);
    case DType::bf16:
      return native ? sum_typed<bfloat16, true>(sources, n, dst, count)
                    : sum_typed<bfloat16, false>(sources, n, dst, count);
    case DType::f16:
      return native ? sum_typed<float16, true>(sources, n, dst, count)
                    : sum_typed<float16, false>(sources, n, dst, count);
    case DType::boolean:
      break;
  }
  unsupported("sum", dtype);
}

void max(const void* const* sources, int n, void* dst, std::int64_t count, DType dtype) {
  switch (dtype) {
    case DType::f32:
      return max_typed<float>(sources, n, dst, count);
    case DType::f64:
      return max_typed<double>(sources, n, dst, count);
    case DType::i64:
      return max_typed<std::int64_t>(sources, n, dst, count);
    case DType::bf16:
      return max_typed<bfloat16>(sources, n, dst, count);
    case DType::f16:
      return max_typed<float16>(sources, n, dst, count);
    case DType::boolean:
      break;
  }
  unsupported("max", dtype);
}

void copy(void* dst, const void* src, std::size_t bytes, bool streaming) {
#if defined(__SSE2__)
  if (streaming && bytes >= 4096) {
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    // Stream stores need an aligned destination: copy the head up to the next 64 bytes plainly.
    const std::size_t head = std::min(bytes, (64 - reinterpret_cast<std::uintptr_t>(d) % 64) % 64);
    std::memcpy(d, s, head);
    d += head;
    s += head;
    bytes -= head;
    const std::size_t body = bytes & ~std::size_t(63);
    for (std::size_t i = 0; i < body; i += 64) {
#if defined(__AVX__)
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
#else
      for (std::size_t j = 0; j < 64; j += 16) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + j),
                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + j)));
      }
#endif
    }
    // Streaming stores are weakly ordered: fence them before anyone is told the data is there.
    _mm_sfence();
    std::memcpy(d + body, s + body, bytes - body);
    return;
  }
#endif
  (void)streaming;
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

DType partial_type(DType dtype, Accumulate accumulate) {
  return is_16bit_float(dtype) && accumulate == Accumulate::f32 ? DType::f32 : dtype;
}

void add_partial(const void* partial, const void* own, void* dst, DType dst_type, std::int64_t count, DType dtype,
                 Accumulate accumulate) {
  const DType p = partial_type(dtype, accumulate);
  if (dst_type != p && dst_type != dtype) unsupported("add_partial", dst_type);
  switch (dtype) {
    case DType::f32:
      return add_typed<float, float, float>(partial, own, dst, count);
    case DType::f64:
      return add_typed<double, double, double>(partial, own, dst, count);
    case DType::i64:
      return add_typed<std::int64_t, std::int64_t, std::int64_t>(partial, own, dst, count);
    case DType::bf16:
      if (p == DType::bf16) return add_typed<bfloat16, bfloat16, bfloat16>(partial, own, dst, count);
      if (dst_type == DType::f32) return add_typed<float, bfloat16, float>(partial, own, dst, count);
      return add_typed<float, bfloat16, bfloat16>(partial, own, dst, count);
    case DType::f16:
      if (p == DType::f16) return add_typed<float16, float16, float16>(partial, own, dst, count);
      if (dst_type == DType::f32) return add_typed<float, float16, float>(partial, own, dst, count);
      return add_typed<float, float16, float16>(partial, own, dst, count);
    case DType::boolean:
      break;
  }
  unsupported("add_partial", dtype);
}

void convert(const void* src, DType from, void* dst, DType to, std::int64_t count) {
  if (from == to) {
    if (count > 0) std::memcpy(dst, src, static_cast<std::size_t>(count) * dtype_size(from));
    return;
  }
  if (from == DType::bf16 && to == DType::f32) return convert_typed<bfloat16, float>(src, dst, count);
  if (from == DType::f16 && to == DType::f32) return convert_typed<float16, float>(src, dst, count);
  if (from == DType::f32 && to == DType::bf16) return convert_typed<float, bfloat16>(src, dst, count);
  if (from == DType::f32 && to == DType::f16) return convert_typed<float, float16>(src, dst, count);
  fail<DTypeError>("convert", "no conversion from ", dtype_name(from), " to ", dtype_name(to));
}

std::string describe(const char* op, DType dtype, std::int64_t count, const std::string& extra,
                     const std::string& tag) {
  // Runs for every collective: plain appends, no stream.
  std::string out = op;
  out += '(';
  out += dtype_name(dtype);
  out += ", ";
  out += std::to_string(count);
  if (!extra.empty()) {
    out += ", ";
    out += extra;
  }
  if (!tag.empty()) {
    out += ", \"";
    out += tag;
    out += '"';
  }
  out += ')';
  return out;
}

std::string numbered(std::uint64_t sequence, const std::string& call) {
  // Built by appending: GCC 12 warns falsely (-Wrestrict) on "#" + std::string temporaries.
  std::string out = "#";
  out += std::to_string(sequence);
  out += ' ';
  out += call;
  return out;
}

namespace {
constexpr char kShapeSeparator = '\x1f';  // ASCII unit separator: in no op, dtype, count or shape text
}  // namespace

std::string with_shape(std::string fingerprint, const std::string& shape) {
  fingerprint += kShapeSeparator;  // always, even with no shape: the last separator is this one
  fingerprint += shape;
  return fingerprint;
}

// The last separator: the shape comes last, and a tag (user text) may hold the byte itself.
std::string without_shape(const std::string& fingerprint) {
  return fingerprint.substr(0, fingerprint.rfind(kShapeSeparator));
}

std::string shape_shown(const std::string& fingerprint) {
  const std::size_t at = fingerprint.rfind(kShapeSeparator);
  if (at == std::string::npos || at + 1 == fingerprint.size()) return fingerprint.substr(0, at);
  return fingerprint.substr(0, at) + " of " + fingerprint.substr(at + 1);
}

std::pair<std::uint64_t, std::string> split_fingerprint(const std::string& fingerprint) {
  if (fingerprint.size() > 1 && fingerprint[0] == '#') {
    const std::size_t space = fingerprint.find(' ');
    if (space != std::string::npos) {
      char* end = nullptr;
      const unsigned long long n = std::strtoull(fingerprint.c_str() + 1, &end, 10);
      if (end == fingerprint.c_str() + space) return {n, fingerprint.substr(space + 1)};
    }
  }
  return {0, fingerprint};
}

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream out;
  out << (ranks.size() == 1 ? "rank " : "ranks ");
  for (std::size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  return out.str();
}

std::string mismatch_message(std::uint64_t sequence, const std::vector<std::string>& calls) {
  // Group ranks by call, in order of each group's first rank, so every rank prints the same text.
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int r = 0; r < static_cast<int>(calls.size()); ++r) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == calls[r]; });
    if (it == groups.end()) {
      groups.push_back({calls[r], {r}});
    } else {
      it->second.push_back(r);
    }
  }
  std::ostringstream out;
  out << "collective #" << sequence << " differs: ";
  for (std::size_t g = 0; g < groups.size(); ++g) {
    out << (g ? ", " : "") << rank_list(groups[g].second) << ' ' << groups[g].first;
  }
  return out.str();
}

}  // namespace ruda::collectives_detail
