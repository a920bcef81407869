// oneDNN suites (run for --backend onednn only):
//   gemm-onednn     f32 and bf16 GEMM through ruda against a oneDNN matmul primitive called
//                   directly (created once, executed repeatedly on preallocated buffers); and
//                   the attention's block products on strided heads against dense copies, and
//                   with the post-ops its transposed backward fuses against without them.
//   onednn-ranks    two emulated ranks (long-lived threads) running GEMMs at once, with
//                   cores / ranks and with all cores as intra-op threads each, against one rank
//                   using the whole machine: the cost of oversubscribing the cores.
//   onednn-kernels  elementwise, softmax and reduction kernels on oneDNN against the same ops
//                   on the Eigen backend.
#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ruda/ruda.h>
#include <oneapi/dnnl/dnnl.hpp>

#include "bench.h"

namespace ruda::bench {
namespace {

struct Gemm {
  std::int64_t m, k, n;
  std::string name(DType dtype) const {
    return std::string(dtype_name(dtype)) + " " + std::to_string(m) + "x" + std::to_string(k) + "x" +
           std::to_string(n) + " (MxKxN)";
  }
  double gflop() const { return 2.0 * static_cast<double>(m) * static_cast<double>(k) * static_cast<double>(n) * 1e-9; }
};

// A oneDNN matmul C = A B on row-major buffers of one dtype, built once: the peer of ruda's matmul.
// A or B transposed reads the buffer as stored [k, m] or [n, k]. By default oneDNN's first-ranked
// implementation; with `impl`, the first whose name starts with it (the constructor throws when
// oneDNN offers none).
class DirectMatmul {
 public:
  DirectMatmul(const Gemm& g, DType dtype, const void* a, const void* b, void* c, bool trans_a = false,
               bool trans_b = false, std::string_view impl = {})
      : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {
    using dnnl::memory;
    const auto type = dtype == DType::bf16 ? memory::data_type::bf16 : memory::data_type::f32;
    const memory::desc a_md({g.m, g.k}, type, trans_a ? memory::dims{1, g.m} : memory::dims{g.k, 1});
    const memory::desc b_md({g.k, g.n}, type, trans_b ? memory::dims{1, g.k} : memory::dims{g.n, 1});
    const memory::desc c_md({g.m, g.n}, type, memory::dims{g.n, 1});
    num_threads();                                    // the same OpenMP team as ruda's kernels on this thread
    const dnnl::matmul::desc desc(a_md, b_md, c_md);  // outlives the walk: next_impl() reads it again
    dnnl::matmul::primitive_desc pd(desc, engine_);
    while (std::string_view(pd.impl_info_str()).substr(0, impl.size()) != impl) {
      if (!pd.next_impl()) throw std::runtime_error("oneDNN offers no " + std::string(impl) + " matmul here");
    }
    impl_ = pd.impl_info_str();
    matmul_ = dnnl::matmul(pd);
    a_ = memory(a_md, engine_, const_cast<void*>(a));
    b_ = memory(b_md, engine_, const_cast<void*>(b));
    c_ = memory(c_md, engine_, c);
  }
  void operator()() {
    matmul_.execute(stream_, {{DNNL_ARG_SRC, a_}, {DNNL_ARG_WEIGHTS, b_}, {DNNL_ARG_DST, c_}});
    stream_.wait();
  }
  const std::string& impl() const { return impl_; }

 private:
  dnnl::engine engine_;
  dnnl::stream stream_;
  dnnl::matmul matmul_;
  dnnl::memory a_, b_, c_;
  std::string impl_;
};

void block_product_rows(Context& ctx);
void gemm_path_rows(Context& ctx);
void epilogue_rows(Context& ctx);

void gemm_suite(Context& ctx) {
  if (ctx.backend != "onednn") return;
  std::vector<Gemm> shapes = {{256, 256, 256},   {512, 512, 512},   {1024, 1024, 1024},
                              {128, 1024, 1024}, {1024, 128, 1024}, {1024, 768, 3072}};
  if (ctx.quick) shapes.resize(2);
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (const Gemm& g : shapes) {
      const Tensor a = randn({g.m, g.k}, 1).to(dtype), b = randn({g.k, g.n}, 2).to(dtype);
      Tensor c;
      Result r;
      r.suite = "gemm-onednn";
      r.name = g.name(dtype);
      r.backend = ctx.backend;
      r.unit = "GFLOP/s";
      const auto through_ruda = [&] { c = matmul(a, b); };
      const Tensor out = empty({g.m, g.n}, dtype);
      std::optional<DirectMatmul> direct;
      try {
        direct.emplace(g, dtype, a.data_ptr(), b.data_ptr(), out.data_ptr());
      } catch (const dnnl::error&) {
        // No bf16 matmul on this ISA (ruda computes it in f32 there): no direct peer to compare.
        r.peer_name = "none: oneDNN has no bf16 matmul on this ISA";
      }
      if (direct) {
        const auto [ruda_time, direct_time] = measure_pair(ctx, through_ruda, *direct);
        r.value = rate(ruda_time, g.gflop());
        r.peer = rate(direct_time, g.gflop());
        r.peer_name = "oneDNN matmul direct (" + direct->impl() + ")";
      } else {
        r.value = rate(measure(ctx, through_ruda), g.gflop());
      }
      ctx.report(r);
    }
  }
  block_product_rows(ctx);
  gemm_path_rows(ctx);
  epilogue_rows(ctx);
}

// oneDNN's two f32 matmul paths called directly on the same buffers: gemm:jit, which ruda's 2-D
// f32 products with B as stored run on, against brgemm, which oneDNN ranks first (the rule in
// backends/onednn/matmul.cpp; "ratio" > 1: the gemm path is faster). GPT-2-small's linear layers
// (tokens 1024, d 768), forward, weight gradients (A transposed: fc1's 3072 columns and fc2's 3072
// rows take the gemm path) and input gradients (B transposed: fc1's, narrower than its inner
// dimension, keeps brgemm; fc2's takes the gemm path), the default GPT's fc1 forward, fc2 weight
// gradient (A transposed, 256 columns: brgemm kept) and fc2 input gradient (B transposed, 1024
// columns from 256: gemm), on one thread the fused attention's dV / dK block products (A
// transposed, N = 64: the rule in backends/onednn/attention.cpp), and matrix-vector products (one
// row or column of output, f32 and bf16: the gemm path's GEMV, is_matrix_vector in matmul.cpp).
void gemm_path_rows(Context& ctx) {
  struct Case {
    Gemm g;
    bool trans_a, trans_b;
    bool one_thread = false;
    DType dtype = DType::f32;
  };
  std::vector<Case> cases = {{{1024, 768, 3072}, false, false},
                             {{768, 1024, 3072}, true, false},
                             {{1024, 768, 2304}, false, false},
                             {{2048, 256, 1024}, false, false},
                             {{1024, 2048, 256}, true, false},
                             {{1024, 3072, 768}, false, true},
                             {{1024, 768, 3072}, false, true},
                             {{3072, 1024, 768}, true, false},
                             {{2048, 256, 1024}, false, true},
                             {{256, 64, 64}, true, false, true},
                             {{256, 256, 64}, true, false, true},
                             {{1, 4096, 4096}, false, true},
                             {{1, 4096, 4096}, false, false, false, DType::bf16},
                             {{1, 768, 3072}, false, false, false, DType::bf16},
                             {{4096, 4096, 1}, false, false, false, DType::bf16}};
  if (ctx.quick) cases.resize(2);
  const int threads = num_threads();
  for (const Case& c : cases) {
    set_num_threads(c.one_thread ? 1 : threads);  // a primitive keeps the team it was built with
    const Tensor a = (c.trans_a ? randn({c.g.k, c.g.m}, 1) : randn({c.g.m, c.g.k}, 1)).to(c.dtype);
    const Tensor b = (c.trans_b ? randn({c.g.n, c.g.k}, 2) : randn({c.g.k, c.g.n}, 2)).to(c.dtype);
    const Tensor out = empty({c.g.m, c.g.n}, c.dtype);
    Result r;
    r.suite = "gemm-onednn";
    r.name = c.g.name(c.dtype) + (c.trans_a ? ", A transposed" : "") + (c.trans_b ? ", B transposed" : "") +
             (c.one_thread ? ", one thread (an attention block)" : "") +
             (c.g.m == 1 || c.g.n == 1 ? " (a matrix-vector product)" : "") + ": oneDNN gemm:jit";
    r.backend = ctx.backend;
    r.unit = "GFLOP/s";
    std::optional<DirectMatmul> gemm_path;
    try {
      gemm_path.emplace(c.g, c.dtype, a.data_ptr(), b.data_ptr(), out.data_ptr(), c.trans_a, c.trans_b, "gemm:");
    } catch (const std::exception& e) {  // (dnnl::error: no bf16 matmul on this ISA)
      std::fprintf(stderr, "ruda-bench: %s: %s (a oneDNN or a CPU without it): row left out\n", r.name.c_str(),
                   e.what());
      continue;
    }
    std::optional<DirectMatmul> brgemm;
    try {
      brgemm.emplace(c.g, c.dtype, a.data_ptr(), b.data_ptr(), out.data_ptr(), c.trans_a, c.trans_b, "brg:");
    } catch (const std::exception& e) {
      r.peer_name = std::string("none: ") + e.what();  // no f32 brgemm below AVX-512: nothing to choose
    }
    if (brgemm) {
      const auto [gemm_time, brgemm_time] = measure_pair(ctx, *gemm_path, *brgemm);
      r.value = rate(gemm_time, c.g.gflop());
      r.peer = rate(brgemm_time, c.g.gflop());
      r.peer_name = "oneDNN " + brgemm->impl();
    } else {
      r.value = rate(measure(ctx, *gemm_path), c.g.gflop());
    }
    ctx.report(r);
  }
  set_num_threads(threads);
}

// The fused attention's block products as the oneDNN kernel runs them (one thread, scores
// q k^T of D = 64), on q and k read in place from a [T, 3, H, D] projection (row stride
// 3 * H * D = 768 for H = 4) against the same product on dense copies. oneDNN 2.6 takes its gemm
// path for the strided layout and brgemm for the dense one (the names say which ran): the
// measurement behind the kernel's copying q, k, v and dO blocks dense (kDenseOperands in
// backends/onednn/attention.cpp).
class BlockScores {
 public:
  BlockScores(std::int64_t rows, std::int64_t keys, std::int64_t ld, const float* q, const float* k, float* s)
      : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {
    using dnnl::memory;
    const memory::desc q_md({rows, kDim}, memory::data_type::f32, memory::dims{ld, 1});
    const memory::desc kt_md({kDim, keys}, memory::data_type::f32, memory::dims{1, ld});
    const memory::desc s_md({rows, keys}, memory::data_type::f32, memory::dims{keys, 1});
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(q_md, kt_md, s_md), engine_);
    impl_ = pd.impl_info_str();
    matmul_ = dnnl::matmul(pd);
    q_ = memory(q_md, engine_, const_cast<float*>(q));
    k_ = memory(kt_md, engine_, const_cast<float*>(k));
    s_ = memory(s_md, engine_, s);
  }
  void operator()() {
    matmul_.execute(stream_, {{DNNL_ARG_SRC, q_}, {DNNL_ARG_WEIGHTS, k_}, {DNNL_ARG_DST, s_}});
    stream_.wait();
  }
  const std::string& impl() const { return impl_; }
  static constexpr std::int64_t kDim = 64;

 private:
  dnnl::engine engine_;
  dnnl::stream stream_;
  dnnl::matmul matmul_;
  dnnl::memory q_, k_, s_;
  std::string impl_;
};

void block_product_rows(Context& ctx) {
  constexpr std::int64_t kStride = 3 * 4 * BlockScores::kDim;  // [T, 3, H, D] with H = 4
  const int threads = num_threads();
  set_num_threads(1);  // the kernel runs its products one per thread
  for (std::int64_t n : {64, 128, 256}) {
    const std::vector<float> projection(static_cast<std::size_t>(n * kStride), 0.5f);
    const std::vector<float> dense(static_cast<std::size_t>(n * BlockScores::kDim), 0.5f);
    std::vector<float> scores(static_cast<std::size_t>(n * n));
    BlockScores strided(n, n, kStride, projection.data(), projection.data() + BlockScores::kDim, scores.data());
    BlockScores copied(n, n, BlockScores::kDim, dense.data(), dense.data(), scores.data());
    const auto [in_place, on_copies] = measure_pair(ctx, strided, copied);
    const double gflop = 2e-9 * static_cast<double>(n * n * BlockScores::kDim);
    Result r;
    r.suite = "gemm-onednn";
    r.name = "f32 attention block scores q k^T " + std::to_string(n) + "x64x" + std::to_string(n) +
             ", one thread, heads read in place (" + strided.impl() + ")";
    r.backend = ctx.backend;
    r.unit = "GFLOP/s";
    r.value = rate(in_place, gflop);
    r.peer = rate(on_copies, gflop);
    r.peer_name = "dense operands (" + copied.impl() + ")";
    ctx.report(r);
  }
  set_num_threads(threads);
}

// The fused attention's transposed backward (backends/onednn/attention.cpp): its block products
// K Q^T of one key block (128 keys, D = 64) against a segment of 256 queries, one thread, with the
// post-ops it fuses, against the same product without them in the same run: what each epilogue
// costs. oneDNN's per-output-channel subtraction (the logsumexp or delta, one value a query), its
// exp, both (the recomputed weights) and the subtraction with a multiply by the weights (the
// softmax gradient); f32 and, where the CPU has bf16 instructions, bf16 (output in the operands'
// dtype, as the kernel writes it). The measurement behind f32 keeping the shared backward
// (shared_attention_backward_faster in backends/onednn/kernel_policy.h).
class EpilogueBlock {
 public:
  enum class Post { none, subtract, exp, subtract_exp, subtract_multiply };
  static constexpr std::int64_t kKeys = 128, kDim = 64, kQueries = 256;

  EpilogueBlock(Post post, DType dtype, const void* k, const void* q, void* out, const float* column, const void* p)
      : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {
    using dnnl::memory;
    const auto type = dtype == DType::bf16 ? memory::data_type::bf16 : memory::data_type::f32;
    const memory::desc k_md({kKeys, kDim}, type, memory::dims{kDim, 1});
    const memory::desc qt_md({kDim, kQueries}, type, memory::dims{1, kDim});
    const memory::desc out_md({kKeys, kQueries}, post == Post::none ? memory::data_type::f32 : type,
                              memory::dims{kQueries, 1});
    const memory::desc column_md({1, kQueries}, memory::data_type::f32, memory::dims{kQueries, 1});
    const memory::desc p_md({kKeys, kQueries}, type, memory::dims{kQueries, 1});
    dnnl::post_ops ops;
    if (post == Post::subtract || post == Post::subtract_exp || post == Post::subtract_multiply) {
      ops.append_binary(dnnl::algorithm::binary_sub, column_md);
    }
    if (post == Post::exp || post == Post::subtract_exp) ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_exp, 0, 0);
    if (post == Post::subtract_multiply) ops.append_binary(dnnl::algorithm::binary_mul, p_md);
    dnnl::primitive_attr attr;
    attr.set_post_ops(ops);
    num_threads();
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(k_md, qt_md, out_md), attr, engine_);
    impl_ = pd.impl_info_str();
    matmul_ = dnnl::matmul(pd);
    args_ = {{DNNL_ARG_SRC, memory(k_md, engine_, const_cast<void*>(k))},
             {DNNL_ARG_WEIGHTS, memory(qt_md, engine_, const_cast<void*>(q))},
             {DNNL_ARG_DST, memory(out_md, engine_, out)}};
    if (ops.len() > 0 && post != Post::exp) {
      args_[DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1] =
          memory(column_md, engine_, const_cast<float*>(column));
    }
    if (post == Post::subtract_multiply) {
      args_[DNNL_ARG_ATTR_MULTIPLE_POST_OP(1) | DNNL_ARG_SRC_1] = memory(p_md, engine_, const_cast<void*>(p));
    }
  }
  void operator()() {
    matmul_.execute(stream_, args_);
    stream_.wait();
  }
  const std::string& impl() const { return impl_; }
  static double gflop() { return 2e-9 * static_cast<double>(kKeys * kDim * kQueries); }

 private:
  dnnl::engine engine_;
  dnnl::stream stream_;
  dnnl::matmul matmul_;
  std::unordered_map<int, dnnl::memory> args_;
  std::string impl_;
};

void epilogue_rows(Context& ctx) {
  using Post = EpilogueBlock::Post;
  const int threads = num_threads();
  set_num_threads(1);  // the kernel runs its products one per thread
  const std::pair<Post, const char*> posts[] = {{Post::subtract, "a per-query subtraction"},
                                                {Post::exp, "exp"},
                                                {Post::subtract_exp, "exp(. - lse): the recomputed weights"},
                                                {Post::subtract_multiply, "P * (. - delta): the softmax gradient"}};
  for (DType dtype : {DType::f32, DType::bf16}) {
    // Filled operands (a zero-filled buffer would time the zero page), scores of a few units.
    const Tensor k = (randn({EpilogueBlock::kKeys, EpilogueBlock::kDim}, 1) * 0.3).to(dtype);
    const Tensor q = (randn({EpilogueBlock::kQueries, EpilogueBlock::kDim}, 2) * 0.3).to(dtype);
    const Tensor column = full({EpilogueBlock::kQueries}, 2.0);
    const Tensor p = rand({EpilogueBlock::kKeys, EpilogueBlock::kQueries}, 3).to(dtype);
    const Tensor plain_out = empty({EpilogueBlock::kKeys, EpilogueBlock::kQueries}, DType::f32);
    const Tensor out = empty({EpilogueBlock::kKeys, EpilogueBlock::kQueries}, dtype);
    std::optional<EpilogueBlock> plain;
    try {
      plain.emplace(Post::none, dtype, k.data_ptr(), q.data_ptr(), plain_out.data_ptr(), nullptr, nullptr);
    } catch (const dnnl::error&) {
      continue;  // no bf16 matmul on this ISA (ruda computes bf16 attention on Eigen there): no such kernel
    }
    for (const auto& [post, what] : posts) {
      EpilogueBlock fused(post, dtype, k.data_ptr(), q.data_ptr(), out.data_ptr(), column.data<float>(), p.data_ptr());
      const auto [with, without] = measure_pair(ctx, fused, *plain);
      Result r;
      r.suite = "gemm-onednn";
      r.name = std::string(dtype_name(dtype)) + " attention backward block K Q^T 128x64x256, one thread, with " + what +
               " (" + fused.impl() + ")";
      r.backend = ctx.backend;
      r.unit = "GFLOP/s";
      r.value = rate(with, EpilogueBlock::gflop());
      r.peer = rate(without, EpilogueBlock::gflop());
      r.peer_name = "the product alone (" + plain->impl() + ")";
      ctx.report(r);
    }
  }
  set_num_threads(threads);
}

// Emulated ranks: long-lived threads, each with its own intra-op thread count, that run their
// work together on every run() (the way emulated ranks run a training step).
class RankThreads {
 public:
  RankThreads(int ranks, int threads_each, std::function<void(int)> work)
      : work_(std::move(work)), start_(ranks + 1), done_(ranks + 1) {
    for (int r = 0; r < ranks; ++r) {
      threads_.emplace_back([this, r, threads_each] {
        set_num_threads(threads_each);
        for (;;) {
          start_.arrive_and_wait();
          if (stop_) return;
          work_(r);
          done_.arrive_and_wait();
        }
      });
    }
  }
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;
  ~RankThreads() {
    stop_ = true;
    start_.arrive_and_wait();
    for (auto& t : threads_) t.join();
  }
  void run() {
    start_.arrive_and_wait();
    done_.arrive_and_wait();
  }

 private:
  std::function<void(int)> work_;
  std::barrier<> start_, done_;
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

void ranks_suite(Context& ctx) {
  if (ctx.backend != "onednn") return;
  // Each rank multiplies its own 512^3 matrices, as emulated ranks do with their own shards.
  const Gemm g{512, 512, 512};
  const int ranks = 2, per_rank = ctx.quick ? 4 : 10;
  std::vector<Tensor> a, b;
  for (int r = 0; r < ranks; ++r) {
    a.push_back(randn({g.m, g.k}, 10 + r));
    b.push_back(randn({g.k, g.n}, 20 + r));
  }
  const int cores = hardware_threads();
  const double total = g.gflop() * ranks * per_rank;
  // The reference: the same total work from one rank that has the whole machine.
  RankThreads whole(1, cores, [&](int) {
    for (int i = 0; i < ranks * per_rank; ++i) Tensor c = matmul(a[i % ranks], b[i % ranks]);
  });
  for (int threads_each : {std::max(1, cores / ranks), cores}) {
    RankThreads split(ranks, threads_each, [&](int r) {
      for (int i = 0; i < per_rank; ++i) Tensor c = matmul(a[r], b[r]);
    });
    const auto [split_time, whole_time] = measure_pair(
        ctx, [&] { split.run(); }, [&] { whole.run(); });
    Result r;
    r.suite = "onednn-ranks";
    r.name = std::to_string(ranks) + " ranks x " + std::to_string(threads_each) + " threads, f32 512^3 each";
    r.backend = ctx.backend;
    r.unit = "GFLOP/s";
    r.value = rate(split_time, total);
    r.peer = rate(whole_time, total);
    r.peer_name = "1 rank x " + std::to_string(cores) + " threads";
    ctx.report(r);
  }
}

Tensor gelu_erf(const Tensor& t) { return gelu(t); }
// LayerNorm over the last axis with an affine weight and bias (both backends run Eigen's kernel).
Tensor layer_norm_affine(const Tensor& t) {
  const Options o(t.dtype(), &t.backend());
  return layer_norm(t, ones({t.shape().back()}, o), zeros({t.shape().back()}, o));
}
Tensor gelu_tanh(const Tensor& t) { return gelu(t, GeluApproximation::tanh); }

void kernels_suite(Context& ctx) {
  if (ctx.backend != "onednn") return;
  Backend& eigen = get_backend("eigen");
  Backend& dnnl = get_backend("onednn");
  const std::int64_t n = ctx.quick ? 1 << 18 : 1 << 22;
  struct Kernel {
    const char* name;
    Tensor (*run)(const Tensor&, const Tensor&);
    bool positive = false;  // the op's domain: give it |x| + 1
  };
  // Every unary op whose descriptor routes a direction by measurement (engine/src/op_descriptors.h:
  // forward_slower / backward_slower), forward alone and forward+backward: the rows kernel_policy.h's
  // table is measured with. log, sqrt and rsqrt get positive inputs (|x| + 1).
#define RUDA_UNARY_KERNEL(label, fn, positive)                               \
  {label, [](const Tensor& t, const Tensor&) { return fn(t); }, positive}, { \
    label " forward+backward",                                               \
        [](const Tensor& t, const Tensor& g) {                               \
          Tensor leaf = t.detach().set_requires_grad();                      \
          fn(leaf).backward(g);                                              \
          return leaf.grad();                                                \
        },                                                                   \
        positive                                                             \
  }
  const std::vector<Kernel> kernels = {
      RUDA_UNARY_KERNEL("relu", relu, false),
      RUDA_UNARY_KERNEL("gelu (erf)", gelu_erf, false),
      RUDA_UNARY_KERNEL("gelu (tanh)", gelu_tanh, false),
      RUDA_UNARY_KERNEL("tanh", tanh, false),
      RUDA_UNARY_KERNEL("sigmoid", sigmoid, false),
      RUDA_UNARY_KERNEL("silu", silu, false),
      RUDA_UNARY_KERNEL("softplus", softplus, false),
      RUDA_UNARY_KERNEL("exp", exp, false),
      RUDA_UNARY_KERNEL("log", log, true),
      RUDA_UNARY_KERNEL("sqrt", sqrt, true),
      RUDA_UNARY_KERNEL("rsqrt", rsqrt, true),
      RUDA_UNARY_KERNEL("layer_norm over 1024", layer_norm_affine, false),
#undef RUDA_UNARY_KERNEL
      {"add", [](const Tensor& t, const Tensor& u) { return t + u; }},
      {"mul by a row", [](const Tensor& t, const Tensor& u) { return t * u.slice(0, 0, 1); }},
      {"softmax over 1024", [](const Tensor& t, const Tensor&) { return softmax(t, 1); }},
      // Its forward runs on Eigen on both backends (oneDNN's is inexact near 0): against the
      // softmax row, what that costs.
      {"log_softmax over 1024", [](const Tensor& t, const Tensor&) { return log_softmax(t, 1); }},
      {"sum over rows (bias grad)", [](const Tensor& t, const Tensor&) { return sum(t, {0}); }},
      {"sum over columns", [](const Tensor& t, const Tensor&) { return sum(t, {1}); }},
  };
  for (DType dtype : {DType::f32, DType::bf16}) {
    const Tensor x = randn({n / 1024, 1024}, 1).to(dtype), g = randn({n / 1024, 1024}, 2).to(dtype);
    const Tensor positive = (abs(x) + 1.0).to(dtype);
    for (const Kernel& k : kernels) {
      const Tensor& in = k.positive ? positive : x;
      const Tensor xd = in.to(dnnl), gd = g.to(dnnl), xe = in.to(eigen), ge = g.to(eigen);
      const auto [on_onednn, on_eigen] = measure_pair(
          ctx, [&] { Tensor y = k.run(xd, gd); }, [&] { Tensor y = k.run(xe, ge); });
      Result r;
      r.suite = "onednn-kernels";
      r.name = std::string(k.name) + ", " + std::to_string(n >> 20) + "M " + std::string(dtype_name(dtype));
      r.backend = ctx.backend;
      r.unit = "Melem/s";
      r.value = rate(on_onednn, static_cast<double>(n) * 1e-6);
      r.peer = rate(on_eigen, static_cast<double>(n) * 1e-6);
      r.peer_name = "same op on the eigen backend";
      ctx.report(r);
    }
  }
}

const bool registered = register_suite("gemm-onednn", gemm_suite) && register_suite("onednn-ranks", ranks_suite) &&
                        register_suite("onednn-kernels", kernels_suite);

}  // namespace
}  // namespace ruda::bench
