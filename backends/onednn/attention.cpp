// Fused attention on oneDNN: the shared kernel (eigen/attention_kernel.h) with its block products
// on oneDNN matmul primitives. oneDNN 2.6 has no attention primitive (no Graph API, no SDPA
// fusion before 3.x), so the forward's online softmax and masks stay in the shared kernel; what
// oneDNN adds is native bf16 products with f32 accumulation, and, in the bf16 backward
// (backward_transposed below), products whose post-ops compute the recomputed weights and the
// softmax gradient. Each (block shape, dtype, transposes, strides, scale, accumulation, epilogue)
// is one cached primitive built for one thread (the kernel's own loop is the parallel one), and
// each thread remembers the few it used, so a block costs one execution and no cache lookup.
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

// What a block product applies to its result on the way out, as oneDNN post-ops (the
// transposed backward below). The block is [m, n] with one value per column in `column`.
enum class Epilogue : std::int64_t {
  none,         // c (f32) = alpha * op(a) op(b) (+ c)
  exp_minus,    // c (G) = exp(alpha * a b^T - column[j]): the recomputed weights
  times_minus,  // c (G) = p[i, j] * (a b^T - column[j]): the softmax's gradient
};

// One thread's block products: c (f32) = alpha * op(a) op(b) (+ c), operands of G, and the two
// products with an epilogue that the backward runs.
template <class G>
class DnnlBlockGemm {
 public:
  // oneDNN 2.6 runs its brgemm matmul only on dense operands; strided ones (the heads of a
  // [B, T, 3, H, D] projection) fall to its gemm path, slower on the kernel's small products:
  // `ruda-bench --suite gemm-onednn`, "attention block scores" rows (one thread, q k^T with D 64,
  // in place against dense copies): 0.62-0.66x the dense rate at 64 rows (the diagonal's chunks),
  // 0.93-0.95x at 128 and 256. So the kernel copies q, k, v and dO blocks dense.
  static constexpr bool kDenseOperands = true;

  // f32 products with A transposed and B as stored (the backward's dQ = dS K on transposed blocks,
  // the shared kernel's dV = P^T dO and dK = dS^T Q) run on oneDNN's gemm path, never slower than
  // the brgemm it ranks first on such blocks (one thread, N = 64; a 2-core Xeon with AMX,
  // 2026-12-05; `ruda-bench --suite gemm-onednn`, "an attention block" rows, three runs):
  // 1.15-1.17x at 256 x 256 x 64, 1.00-1.02x at 256 x 64 x 64. The other products and bf16 (AMX
  // brgemm 1.1-3.6x the gemm path's rate in a scratch survey) keep oneDNN's first choice.
  static constexpr bool prefers_gemm_path(bool ta, bool tb) { return std::is_same_v<G, float> && ta && !tb; }

  void operator()(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, const G* a, std::int64_t lda,
                  const G* b, std::int64_t ldb, float* c, std::int64_t ldc, float alpha, bool accumulate) {
    const Primitive& p = primitive({ta, tb, m, n, k, lda, ldb, ldc, bits(alpha), accumulate, 0});
    if (p.refused()) return fallback(ta, tb, m, n, k, a, lda, b, ldb, c, ldc, alpha, accumulate, p.refusal);
    execute(current_, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
  }

  // c[m, n] (row stride n) = exp(alpha * a b^T - column[j]); a [m, k], b stored [n, k].
  void exp_minus(std::int64_t m, std::int64_t n, std::int64_t k, const G* a, std::int64_t lda, const G* b,
                 std::int64_t ldb, G* c, const float* column, float alpha) {
    const Primitive& p = epilogue_primitive(Epilogue::exp_minus, m, n, k, lda, ldb, alpha);
    if (p.refused()) {
      return epilogue_fallback(Epilogue::exp_minus, m, n, k, a, lda, b, ldb, c, column, nullptr, alpha, p.refusal);
    }
    execute(current_, {{DNNL_ARG_SRC, a},
                       {DNNL_ARG_WEIGHTS, b},
                       {DNNL_ARG_DST, c},
                       {DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1, column}});
  }

  // c[m, n] (row stride n) = p[i, j] * (a b^T - column[j]); a [m, k], b stored [n, k], p [m, n].
  void times_minus(std::int64_t m, std::int64_t n, std::int64_t k, const G* a, std::int64_t lda, const G* b,
                   std::int64_t ldb, G* c, const float* column, const G* p) {
    const Primitive& prim = epilogue_primitive(Epilogue::times_minus, m, n, k, lda, ldb, 1.0f);
    if (prim.refused()) {
      return epilogue_fallback(Epilogue::times_minus, m, n, k, a, lda, b, ldb, c, column, p, 1.0f, prim.refusal);
    }
    execute(current_, {{DNNL_ARG_SRC, a},
                       {DNNL_ARG_WEIGHTS, b},
                       {DNNL_ARG_DST, c},
                       {DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1, column},
                       {DNNL_ARG_ATTR_MULTIPLE_POST_OP(1) | DNNL_ARG_SRC_1, p}});
  }

  // Whether oneDNN fuses both epilogues on this CPU (asked once per dtype, on a 64-row block): the
  // transposed backward runs only then. A product it refuses on some other shape is computed by
  // Eigen with the epilogue after it (epilogue_fallback).
  static bool fuses_epilogues() {
    static const bool fuses = [] {
      DnnlBlockGemm gemm;
      return !gemm.epilogue_primitive(Epilogue::exp_minus, 64, 64, 64, 64, 64, 0.125f).refused() &&
             !gemm.epilogue_primitive(Epilogue::times_minus, 64, 64, 64, 64, 64, 1.0f).refused();
    }();
    return fuses;
  }

 private:
  using Shape = std::array<std::int64_t, 11>;
  struct Entry {
    Shape shape;
    std::shared_ptr<const Primitive> primitive;
  };

  static std::int64_t bits(float v) {
    std::uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    return u;
  }
  static float from_bits(std::int64_t b) {
    const auto word = static_cast<std::uint32_t>(b);
    float v;
    std::memcpy(&v, &word, sizeof v);
    return v;
  }

  // Never accumulating: exp_minus and times_minus pass their post-op arguments at indices 0 and 1,
  // which a sum post-op before them would shift.
  const Primitive& epilogue_primitive(Epilogue e, std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t lda,
                                      std::int64_t ldb, float alpha) {
    return primitive({false, true, m, n, k, lda, ldb, n, bits(alpha), false, static_cast<std::int64_t>(e)});
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
      const auto [ta, tb, m, n, k, lda, ldb, ldc, alpha_bits, accumulate, epilogue_id] = s;
      const auto epilogue = static_cast<Epilogue>(epilogue_id);
      const auto gt = *dnnl_type(kDType);
      const auto f32 = memory::data_type::f32;
      const memory::desc a_md({m, k}, gt, ta ? memory::dims{1, lda} : memory::dims{lda, 1});
      const memory::desc b_md({k, n}, gt, tb ? memory::dims{1, ldb} : memory::dims{ldb, 1});
      const memory::desc c_md({m, n}, epilogue == Epilogue::none ? f32 : gt, memory::dims{ldc, 1});
      dnnl::primitive_attr attr;
      attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
      const float alpha = from_bits(alpha_bits);
      if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
      std::vector<int> arg_ids = {DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_DST};
      dnnl::post_ops ops;
      if (accumulate) ops.append_sum(1.0f);
      if (epilogue != Epilogue::none) {
        // The per-column value is oneDNN's per-output-channel broadcast, which its brgemm fuses;
        // a per-row one ({m, 1}) falls to its reference kernel.
        ops.append_binary(dnnl::algorithm::binary_sub, memory::desc({1, n}, f32, memory::dims{n, 1}));
        arg_ids.push_back(DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1);
        if (epilogue == Epilogue::exp_minus) {
          ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_exp, 0.0f, 0.0f);
        } else {
          ops.append_binary(dnnl::algorithm::binary_mul, memory::desc({m, n}, gt, memory::dims{n, 1}));
          arg_ids.push_back(DNNL_ARG_ATTR_MULTIPLE_POST_OP(1) | DNNL_ARG_SRC_1);
        }
      }
      if (ops.len() > 0) attr.set_post_ops(ops);
      const dnnl::matmul::desc desc(a_md, b_md, c_md);
      const dnnl::matmul::primitive_desc pd = prefers_gemm_path(ta, tb)
                                                  ? matmul_impl(desc, attr, "gemm:")
                                                  : dnnl::matmul::primitive_desc(desc, attr, cpu_engine());
      return make_primitive(pd, arg_ids);
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

  // The same for a product with an epilogue: the product in f32, then the epilogue value by value.
  void epilogue_fallback(Epilogue e, std::int64_t m, std::int64_t n, std::int64_t k, const G* a, std::int64_t lda,
                         const G* b, std::int64_t ldb, G* c, const float* column, const G* p, float alpha,
                         const std::string& reason) {
    wide_c_.resize(static_cast<std::size_t>(m * n));
    fallback(false, true, m, n, k, a, lda, b, ldb, wide_c_.data(), n, alpha, false, reason);
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        const float x = wide_c_[i * n + j] - column[j];
        const float y = e == Epilogue::exp_minus ? std::exp(x) : kernels::Num<G>::load(p[i * n + j]) * x;
        c[i * n + j] = kernels::Num<G>::store(y);
      }
    }
  }

  static constexpr DType kDType = std::is_same_v<G, float> ? DType::f32 : DType::bf16;
  std::vector<Entry> seen_;
  std::shared_ptr<const Primitive> current_;
  kernels::Scratch<float> wide_a_, wide_b_, wide_c_;
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

// The transposed backward's blocks: 128 keys, against the queries that see them in segments of
// 256, one product each (a segment that crosses the causal diagonal is multiplied whole and its
// hidden part zeroed, rather than cut into row chunks as the shared kernel's blocks are: fewer,
// larger products, oneDNN's fixed cost a call being ~7% of the bf16 attention by perf; longer
// segments, 512 and 1024, were slower in scratch timings). `ruda-bench --suite attention`, bf16
// fwd+bwd medians of 3 alternated runs: 256 x 128 (in 64-row chunks on the diagonal) against the
// shared kernel's 256 x 256, 0.98x (T = 128), 1.00x (512), 0.92x (1024), 0.99x (2048); then
// segments against the chunked 256 x 128, 0.99x, 0.94x, 0.98x, 0.94x, and 0.90-0.95x on the
// projection and qkvpacked rows.
constexpr std::int64_t kTransposedKeyBlock = 128;
constexpr std::int64_t kTransposedQuerySegment = 256;

// The backward on transposed blocks, where oneDNN fuses the softmax's elementwise passes into the
// block products. For a key block and a segment of queries, with the [keys, queries] layout:
//   P^T  = exp(scale * K Q^T - lse)     (lse per query: a per-column value, which oneDNN's brgemm
//                                        fuses as a post-op; per row it would not)
//   dV  += P^T dO
//   dS^T = P^T * (V dO^T - delta)       (delta per query, again per column)
//   dK  += scale * dS^T Q,   dQ += scale * (dS^T)^T K
// so that no pass of the kernel's own reads or writes the weights: the exp, the softmax gradient
// and (bf16) the conversions to the operand type all run in the products' epilogues, on the CPU's
// widest vectors. Only the diagonal's masked entries are zeroed here. In bf16 the softmax gradient
// multiplies the weights as rounded to bf16 (the shared kernel multiplies their f32 values and
// rounds dS once): one rounding of 2^-9 more in dS, dK and dQ, within bf16's tolerance (the
// suite's worst dK went from 0.0063 to 0.0068 of max|dK|, against 0.01). The shared kernel's
// backward (eigen/attention_kernel.h) remains the one with dropout, whose mask would need a pass
// of its own, and f32's by default (kernel_policy.h: the post-op exp is the slower one there;
// RUDA_ONEDNN_KERNELS=all runs this one, which the suite's [onednn-all] entries check at f32's
// tolerance). Parallel over B x H and, when that is fewer than the threads, over interleaved sets
// of key blocks, as the shared kernel is (each item owns its key rows' dK and dV; split heads'
// dQ is summed afterwards in a fixed order).
// Tried and left (2026-12-05): folding the per-column terms into the products, one more column
// each (K' = [K | 1], Q' = [Q | -lse / scale], V' = [V | 1], dO' = [dO | -delta]), which saves the
// subtraction post-op (`ruda-bench --suite gemm-onednn`, "attention backward block" rows: the f32
// product at 0.67 of its plain rate with the subtraction, 0.76 with the exp, 0.56 with both). But
// where scores are in the hundreds (test_attention's scale 40) the shifted scores round
// differently from the composed ops' and the gradients moved to 9.5e-6 of the 1e-5 tolerance
// (2-3e-5 with the scale on Q instead); bf16 would round lse itself to 8 bits.
template <class T>
void backward_transposed(const AttentionDesc& d) {
  using namespace kernels::attention;
  using namespace kernels::attention::detail;
  using G = T;
  const std::int64_t batch = d.q.shape[0], heads = d.q.shape[1], tq = d.q.shape[2], dim = d.q.shape[3];
  const std::int64_t tk = d.k.shape[2], dv = d.v.shape[3], bh_count = batch * heads;
  const std::int64_t key_block = std::max<std::int64_t>(1, std::min(kTransposedKeyBlock, tk));
  const std::int64_t segment = std::max<std::int64_t>(1, std::min(kTransposedQuerySegment, tq));
  const std::int64_t nk = (tk + key_block - 1) / key_block;
  const bool need_dq = d.dq.data != nullptr, need_dk = d.dk.data != nullptr, need_dv = d.dv.data != nullptr;
  const bool need_ds = need_dq || need_dk;
  const Rows<const T> q(d.q), k(d.k), v(d.v), out(d.out), dout(d.dout);
  const Rows<T> dq(d.dq), dk(d.dk), dv_rows(d.dv);
  const float* const lse = d.lse.ptr<const float>();
  const auto scale = static_cast<float>(d.scale);
  const std::int64_t splits = head_splits(bh_count, nk);
  const ruda::detail::Charge charged = charge_backward_memory<float, G>(
      bh_count, splits, tq, dim, dv, need_dq, stages<G, T>(tq, dim, q.st, true), stages<G, T>(tq, dv, dout.st, true));
  kernels::Scratch<float> dq_parts(need_dq && splits > 1 ? static_cast<std::size_t>(bh_count * splits * tq * dim) : 0);

  for_each_item(bh_count * splits, [&] {
    struct Worker {
      DnnlBlockGemm<G> gemm;
      kernels::Scratch<float> dq_acc, dk_acc, dv_acc, delta, lse_row;
      kernels::Scratch<G> pt, ds, qbuf, kbuf, vbuf, obuf;
    };
    auto w = std::make_shared<Worker>();
    const auto block = static_cast<std::size_t>(segment * key_block);
    w->pt.resize(block);
    w->ds.resize(need_ds ? block : 0);
    w->dk_acc.resize(static_cast<std::size_t>(key_block * dim));
    w->dv_acc.resize(static_cast<std::size_t>(key_block * dv));
    w->delta.resize(static_cast<std::size_t>(tq));
    w->lse_row.resize(static_cast<std::size_t>(tq));
    if (need_dq && splits == 1) w->dq_acc.resize(static_cast<std::size_t>(tq * dim));
    return [&, w](std::int64_t item) {
      const std::int64_t bh = item % bh_count, split = item / bh_count, b = bh / heads, h = bh % heads;
      // The head's row terms, contiguous (the epilogues read them as one value per column):
      // delta_i = dO_i . O_i, and the logsumexp (lse may be a strided view).
      for (std::int64_t i = 0; i < tq; ++i) {
        w->delta[i] = row_dot<float>(out.row(b, h, i), dout.row(b, h, i), dv);
        w->lse_row[i] = lse[d.lse.strides[0] * b + d.lse.strides[1] * h + d.lse.strides[2] * i];
      }
      float* dq_acc = nullptr;
      if (need_dq) {
        dq_acc = splits == 1 ? w->dq_acc.data() : dq_parts.data() + (bh * splits + split) * tq * dim;
        std::fill(dq_acc, dq_acc + tq * dim, 0.0f);
      }
      std::int64_t ldq = 0, ldo = 0;
      const G* q_head = stage<G>(q.row(b, h, 0), tq, dim, q.st, w->qbuf, ldq, true);
      const G* o_head = stage<G>(dout.row(b, h, 0), tq, dv, dout.st, w->obuf, ldo, true);
      for (std::int64_t kj = split; kj < nk; kj += splits) {
        const std::int64_t j0 = kj * key_block, cols = std::min(key_block, tk - j0);
        std::int64_t ldk = 0, ldv = 0;
        const G* kb = stage<G>(k.row(b, h, j0), cols, dim, k.st, w->kbuf, ldk, true);
        const G* vb = stage<G>(v.row(b, h, j0), cols, dv, v.st, w->vbuf, ldv, true);
        std::fill(w->dk_acc.begin(), w->dk_acc.end(), 0.0f);
        std::fill(w->dv_acc.begin(), w->dv_acc.end(), 0.0f);
        // The queries that see a key of this block (causal: from its first key on, top-left
        // aligned), in segments: queries [s0, s0 + ns) against the block's keys, P^T and dS^T
        // [cols, ns].
        for (std::int64_t s0 = d.causal ? j0 : 0; s0 < tq; s0 += segment) {
          const std::int64_t ns = std::min(segment, tq - s0);
          const G* qb = q_head + s0 * ldq;
          const G* ob = o_head + s0 * ldo;
          G* const pt = w->pt.data();
          w->gemm.exp_minus(cols, ns, dim, kb, ldk, qb, ldq, pt, w->lse_row.data() + s0, scale);
          if (d.causal && s0 < j0 + cols - 1) {
            // Key j0 + r is seen by queries from j0 + r on: zero the columns before.
            for (std::int64_t r = 0; r < cols; ++r) {
              const std::int64_t hidden = std::clamp<std::int64_t>(j0 + r - s0, 0, ns);
              std::fill(pt + r * ns, pt + r * ns + hidden, G{});
            }
          }
          if (need_dv) w->gemm(false, false, cols, dv, ns, pt, ns, ob, ldo, w->dv_acc.data(), dv, 1.0f, true);
          if (!need_ds) continue;
          G* const ds = w->ds.data();
          w->gemm.times_minus(cols, ns, dv, vb, ldv, ob, ldo, ds, w->delta.data() + s0, pt);
          if (need_dk) w->gemm(false, false, cols, dim, ns, ds, ns, qb, ldq, w->dk_acc.data(), dim, scale, true);
          if (need_dq) w->gemm(true, false, ns, dim, cols, ds, ns, kb, ldk, dq_acc + s0 * dim, dim, scale, true);
        }
        for (std::int64_t r = 0; r < cols; ++r) {
          if (need_dk) store_row(w->dk_acc.data() + r * dim, dk.row(b, h, j0 + r), dim);
          if (need_dv) store_row(w->dv_acc.data() + r * dv, dv_rows.row(b, h, j0 + r), dv);
        }
      }
      if (need_dq && splits == 1) {
        for (std::int64_t i = 0; i < tq; ++i) store_row(dq_acc + i * dim, dq.row(b, h, i), dim);
      }
    };
  });

  if (need_dq && splits > 1) sum_split_dq(dq, dq_parts.data(), bh_count, heads, tq, dim, splits);
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
      if (d.dropout > 0 || shared_attention_backward_faster(DType::f32) || !DnnlBlockGemm<float>::fuses_epilogues()) {
        return backward<float, float, float>(d, [] { return DnnlBlockGemm<float>{}; });
      }
      return backward_transposed<float>(d);
    case Route::dnnl_bf16:
      if (d.dropout > 0 || shared_attention_backward_faster(DType::bf16) ||
          !DnnlBlockGemm<bfloat16>::fuses_epilogues()) {
        return backward<bfloat16, bfloat16, float>(d, [] { return DnnlBlockGemm<bfloat16>{}; });
      }
      return backward_transposed<bfloat16>(d);
    case Route::eigen:
      return EigenBackend::attention_backward(d);
  }
}

}  // namespace ruda::onednn
