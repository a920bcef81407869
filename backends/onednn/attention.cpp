// Fused attention on oneDNN: the shared kernel (eigen/attention_kernel.h) with its block products
// on oneDNN matmul primitives. oneDNN 2.6 has no attention primitive (no Graph API, no SDPA
// fusion before 3.x), so the online softmax and the masks stay in the shared kernel; what oneDNN
// adds is native bf16 products with f32 accumulation. Each (block shape, dtype, transposes,
// strides, scale) is one cached primitive built for one thread (the kernel's own loop is the
// parallel one), and each thread remembers the few it used, so a block costs one execution and
// no cache lookup.
#include <array>
#include <cstring>
#include <memory>
#include <vector>

#include "context.h"
#include "eigen/attention_kernel.h"
#include "kernel_policy.h"
#include "onednn.h"
#include "onednn_backend.h"

namespace ruda::onednn {

using namespace detail;
using dnnl::memory;

namespace {

// One thread's block products: c (f32) = alpha * op(a) op(b) (+ c), operands of G.
template <class G>
class DnnlBlockGemm {
 public:
  // oneDNN 2.6 runs its brgemm matmul only on dense operands; strided ones (the heads of a
  // [B, T, 3, H, D] projection) fall to its gemm path, slower on the kernel's small products:
  // `ruda-bench --suite gemm-onednn`, "attention block scores" rows (one thread, q k^T with D 64,
  // in place against dense copies): 0.62-0.66x the dense rate at 64 rows (the diagonal's chunks),
  // 0.93-0.95x at 128 and 256. So the kernel copies q, k, v and dO blocks dense.
  static constexpr bool kDenseOperands = true;

  // f32 products with A transposed and B as stored (the backward's dV = P^T dO and dK = dS^T Q) run
  // on oneDNN's gemm path, never slower than the brgemm it ranks first on such blocks (one thread,
  // N = 64; a 2-core Xeon with AMX, 2026-12-05; `ruda-bench --suite gemm-onednn`, "an attention
  // block" rows, three runs): 1.15-1.17x at 256 x 256 x 64, 1.00-1.02x at 256 x 64 x 64. The
  // other products and bf16 (AMX brgemm 1.1-3.6x the gemm path's rate in a scratch survey) keep
  // oneDNN's first choice.
  static constexpr bool prefers_gemm_path(bool ta, bool tb) { return std::is_same_v<G, float> && ta && !tb; }

  void operator()(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, const G* a, std::int64_t lda,
                  const G* b, std::int64_t ldb, float* c, std::int64_t ldc, float alpha, bool accumulate) {
    const Primitive& p = primitive({ta, tb, m, n, k, lda, ldb, ldc, bits(alpha), accumulate});
    if (p.refused()) return fallback(ta, tb, m, n, k, a, lda, b, ldb, c, ldc, alpha, accumulate, p.refusal);
    execute(current_, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
  }

 private:
  using Shape = std::array<std::int64_t, 10>;
  struct Entry {
    Shape shape;
    std::shared_ptr<const Primitive> primitive;
  };

  static std::int64_t bits(float v) {
    std::uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    return u;
  }

  const Primitive& primitive(const Shape& s) {
    for (const Entry& e : seen_) {
      if (e.shape == s) {
        current_ = e.primitive;
        return *current_;
      }
    }
    Key key;
    key << std::int64_t{40} << static_cast<std::int64_t>(kDType);
    for (std::int64_t v : s) key << v;
    current_ = lookup(key, 1, [&] {
      const auto [ta, tb, m, n, k, lda, ldb, ldc, alpha_bits, accumulate] = s;
      const auto gt = *dnnl_type(kDType);
      const memory::desc a_md({m, k}, gt, ta ? memory::dims{1, lda} : memory::dims{lda, 1});
      const memory::desc b_md({k, n}, gt, tb ? memory::dims{1, ldb} : memory::dims{ldb, 1});
      const memory::desc c_md({m, n}, memory::data_type::f32, memory::dims{ldc, 1});
      dnnl::primitive_attr attr;
      attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
      float alpha;
      const auto alpha_word = static_cast<std::uint32_t>(alpha_bits);
      std::memcpy(&alpha, &alpha_word, sizeof alpha);
      if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
      if (accumulate) {
        dnnl::post_ops ops;
        ops.append_sum(1.0f);
        attr.set_post_ops(ops);
      }
      const dnnl::matmul::desc desc(a_md, b_md, c_md);
      const dnnl::matmul::primitive_desc pd = prefers_gemm_path(ta, tb)
                                                  ? matmul_impl(desc, attr, "gemm:")
                                                  : dnnl::matmul::primitive_desc(desc, attr, cpu_engine());
      return make_primitive(pd, {DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_DST});
    });
    seen_.push_back({s, current_});
    return *current_;
  }

  // A configuration oneDNN refuses: widened to f32 and multiplied by Eigen, noted once.
  void fallback(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, const G* a, std::int64_t lda,
                const G* b, std::int64_t ldb, float* c, std::int64_t ldc, float alpha, bool accumulate,
                const std::string& reason) {
    note_fallback("scaled_dot_product_attention block product", kDType, reason);
    const kernels::attention::EigenBlockGemm<float> eigen;
    if constexpr (std::is_same_v<G, float>) {
      eigen(ta, tb, m, n, k, a, lda, b, ldb, c, ldc, alpha, accumulate);
    } else {
      const std::int64_t a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
      std::int64_t la = 0, lb = 0;
      const float* wa = kernels::attention::detail::stage<float>(a, a_rows, a_cols, lda, wide_a_, la);
      const float* wb = kernels::attention::detail::stage<float>(b, b_rows, b_cols, ldb, wide_b_, lb);
      eigen(ta, tb, m, n, k, wa, la, wb, lb, c, ldc, alpha, accumulate);
    }
  }

  static constexpr DType kDType = std::is_same_v<G, float> ? DType::f32 : DType::bf16;
  std::vector<Entry> seen_;
  std::shared_ptr<const Primitive> current_;
  kernels::attention::detail::Scratch<float> wide_a_, wide_b_;
};

// Where the kernel runs: oneDNN's block products for f32 and for bf16 on CPUs with bf16
// instructions; the Eigen kernel otherwise (f64, f16, bf16 without native support), noted.
enum class Route { dnnl_f32, dnnl_bf16, eigen };

Route route(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return Route::dnnl_f32;
    case DType::bf16:
      if (bf16_native()) return Route::dnnl_bf16;
      note_fallback("scaled_dot_product_attention", dtype,
                    "no native bf16 on this CPU ISA: the Eigen kernel computes the blocks in f32");
      return Route::eigen;
    case DType::f64:
      note_fallback("scaled_dot_product_attention", dtype, "oneDNN 2.6 has no f64 matmul");
      return Route::eigen;
    case DType::f16:
      note_fallback("scaled_dot_product_attention", dtype,
                    "f16 block products stay on the Eigen kernel (oneDNN 2.6 has f16 matmuls on few CPUs)");
      return Route::eigen;
    default:  // not a float dtype: the Eigen kernel raises the DTypeError
      return Route::eigen;
  }
}

}  // namespace

void OneDnnBackend::attention(const AttentionDesc& d) {
  using namespace kernels::attention;
  switch (route(d.q.dtype)) {
    case Route::dnnl_f32:
      return forward<float, float, float>(d, [] { return DnnlBlockGemm<float>{}; });
    case Route::dnnl_bf16:
      return forward<bfloat16, bfloat16, float>(d, [] { return DnnlBlockGemm<bfloat16>{}; });
    case Route::eigen:
      return EigenBackend::attention(d);
  }
}

void OneDnnBackend::attention_backward(const AttentionDesc& d) {
  using namespace kernels::attention;
  switch (route(d.q.dtype)) {
    case Route::dnnl_f32:
      return backward<float, float, float>(d, [] { return DnnlBlockGemm<float>{}; });
    case Route::dnnl_bf16:
      return backward<bfloat16, bfloat16, float>(d, [] { return DnnlBlockGemm<bfloat16>{}; });
    case Route::eigen:
      return EigenBackend::attention_backward(d);
  }
}

}  // namespace ruda::onednn
