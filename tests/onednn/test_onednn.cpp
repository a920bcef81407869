// The oneDNN backend against the Eigen backend: every kernel it runs on oneDNN gives Eigen's
// results within dtype tolerance, runs as a oneDNN primitive where it should (counted), falls
// back visibly where it cannot, builds no primitive again once warm, and is safe from threads.
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include <ruda/collectives.h>

#include "helpers.h"
#include "onednn/onednn.h"

using namespace ruda;

namespace {

Backend& dnnl() { return get_backend("onednn"); }
Backend& eigen() { return get_backend("eigen"); }

Tensor gaussian(const Shape& shape, std::uint64_t seed, DType dtype = DType::f32, double scale = 1.0) {
  return (randn(shape, seed, 0, Options(DType::f32, &eigen())) * scale).to(dtype);
}

// oneDNN primitive executions while f runs.
template <class F>
std::int64_t executions_of(F&& f) {
  const std::int64_t before = onednn::stats().executions;
  f();
  return onednn::stats().executions - before;
}

bool has_fallback(const std::string& op, const std::string& dtype, const std::string& reason_part = "") {
  for (const auto& f : onednn::fallbacks()) {
    if (f.op == op && f.dtype == dtype && f.reason.find(reason_part) != std::string::npos) return true;
  }
  return false;
}

// A kernel call ran as exactly one oneDNN primitive, or on Eigen with a recorded reason.
void check_routed(std::int64_t runs, const std::string& op, DType dtype) {
  if (runs == 0) {
    CHECK_MESSAGE(has_fallback(op, std::string(dtype_name(dtype))), op << " ran on Eigen without a recorded reason");
  } else {
    CHECK(runs == 1);
  }
}

bool capped_to_avx2() {
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  return cap && std::string(cap) == "AVX2";
}

// Tolerances for comparing two implementations of the same math: f32 differs by summation order
// and oneDNN's polynomial approximations; bf16 results may differ by one rounding (2^-8 relative).
double atol_of(DType t) { return t == DType::bf16 ? 1e-2 : 1e-5; }
double rtol_of(DType t) { return t == DType::bf16 ? 1e-2 : 1e-5; }

}  // namespace

TEST_CASE("the onednn backend is registered and reports its ISA") {
  const auto names = available_backends();
  CHECK(std::find(names.begin(), names.end(), "onednn") != names.end());
  CHECK(dnnl().name() == "onednn");
  const std::string isa = onednn::cpu_isa();
  MESSAGE("oneDNN ISA: " << isa << ", native bf16: " << onednn::bf16_native());
  CHECK(isa != "unknown");
  if (capped_to_avx2()) {
    CHECK(isa == "avx2");
    CHECK_FALSE(onednn::bf16_native());
  }
}

TEST_CASE("matmul values and gradients agree with Eigen on varied shapes") {
  struct Case {
    Shape a, b;
    bool native = true;  // large enough for oneDNN (tiny products stay on Eigen)
  };
  const std::vector<Case> cases = {
      {{1, 512}, {512, 33}},             // one row
      {{65, 512}, {512, 1}},             // one column
      {{1, 1}, {1, 1}, false},           // 1x1x1
      {{37, 129}, {129, 65}},            // non-square, odd sizes
      {{128, 256}, {256, 64}},           // larger
      {{4, 17, 32}, {4, 32, 9}},         // batched
      {{4, 17, 32}, {32, 9}},            // batch folded into rows
      {{17, 32}, {3, 32, 9}},            // left operand shared by every batch (batch stride 0)
      {{2, 1, 20, 16}, {1, 3, 16, 24}},  // both batch axes broadcast
  };
  std::uint64_t seed = 100;
  for (const Case& c : cases) {
    CAPTURE(to_string(c.a));
    CAPTURE(to_string(c.b));
    const Tensor a = gaussian(c.a, ++seed), b = gaussian(c.b, ++seed);
    const Tensor w = gaussian(matmul(a, b).shape(), ++seed);
    Tensor ae = a.clone().set_requires_grad(), be = b.clone().set_requires_grad();
    const Tensor ye = matmul(ae, be);
    sum(ye * w).backward();

    Tensor ad = a.clone().to(dnnl()).set_requires_grad(), bd = b.clone().to(dnnl()).set_requires_grad();
    Tensor yd;
    const std::int64_t runs = executions_of([&] {
      yd = matmul(ad, bd);
      sum(yd * w.to(dnnl())).backward();
    });
    if (c.native) CHECK(runs >= 3);  // forward and both gradients are oneDNN matmuls
    const double tol = 1e-4;
    test::check_close(yd, ye, tol, tol);
    test::check_close(ad.grad(), ae.grad(), tol, tol);
    test::check_close(bd.grad(), be.grad(), tol, tol);
  }
}

TEST_CASE("linear fuses its bias and agrees with Eigen") {
  const Tensor x = gaussian({3, 40, 96}, 1), w = gaussian({96, 72}, 2, DType::f32, 0.1), bias = gaussian({72}, 3);
  const Tensor expected = linear(x, w, bias);
  Tensor got;
  // One primitive execution: the bias is part of the matmul, not a separate add.
  CHECK(executions_of([&] { got = linear(x.to(dnnl()), w.to(dnnl()), bias.to(dnnl())); }) == 1);
  test::check_close(got, expected, 1e-4, 1e-4);
}

TEST_CASE("gemm descriptors: transposes, batch strides, bias, alpha and beta") {
  const std::int64_t m = 37, n = 29, k = 23, batch = 3;
  struct Scale {
    float alpha, beta;
  };
  const std::vector<Scale> scales = {{1, 0}, {0.5f, 0}, {1, 1}, {2, -0.5f}};
  std::uint64_t seed = 300;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      for (int layout = 0; layout < 4; ++layout) {  // 0: one matrix; 1: batched; 2: A shared; 3: B shared
        for (int with_bias = 0; with_bias < 2; ++with_bias) {
          for (const Scale& s : scales) {
            CAPTURE(ta);
            CAPTURE(tb);
            CAPTURE(layout);
            CAPTURE(with_bias);
            CAPTURE(s.alpha);
            CAPTURE(s.beta);
            const std::int64_t nb = layout == 0 ? 1 : batch;
            const Tensor a = gaussian({layout == 2 ? 1 : nb, ta ? k : m, ta ? m : k}, ++seed);
            const Tensor b = gaussian({layout == 3 ? 1 : nb, tb ? n : k, tb ? k : n}, ++seed);
            const Tensor bias = gaussian({n}, ++seed);
            const Tensor c0 = gaussian({nb, m, n}, ++seed);
            GemmDesc d;
            d.a = a.data_ptr();
            d.b = b.data_ptr();
            d.bias = with_bias ? bias.data_ptr() : nullptr;
            d.trans_a = ta;
            d.trans_b = tb;
            d.batch = nb;
            d.m = m;
            d.n = n;
            d.k = k;
            d.batch_stride_a = layout == 2 ? 0 : m * k;
            d.batch_stride_b = layout == 3 ? 0 : k * n;
            d.batch_stride_c = m * n;
            d.alpha = s.alpha;
            d.beta = s.beta;
            const Tensor ce = c0.clone(), cd = c0.clone();
            d.c = ce.data_ptr();
            eigen().gemm(d);
            d.c = cd.data_ptr();
            CHECK(executions_of([&] { dnnl().gemm(d); }) == 1);
            test::check_close(cd, ce, 1e-5, 1e-5);
          }
        }
      }
    }
  }
}

// Primitives built so far with a oneDNN implementation whose name starts with `prefix` (any
// primitive kind): "gemm:" is oneDNN's gemm path, gemm:jit in Debian's build.
std::int64_t built_with(const std::string& prefix) {
  std::int64_t n = 0;
  for (const auto& i : onednn::implementations()) {
    if (i.implementation.rfind(prefix, 0) == 0) n += i.built;
  }
  return n;
}

TEST_CASE("f32 2-D products reading B as stored run on oneDNN's gemm path, fused bias and GELU included") {
  // oneDNN 2.6 ranks its f32 brgemm first, which ran 2x slower on GPT-2-small's fc1 shape
  // (backends/onednn/matmul.cpp). Fresh shapes, so that each call builds its primitive. (The
  // products the rule leaves to brgemm keep oneDNN's first choice, which is the gemm path itself
  // where brgemm is missing: not asserted.)
  const Tensor x = gaussian({72, 88}, 31), w = gaussian({88, 136}, 32), b = gaussian({136}, 33);
  const std::int64_t before = built_with("gemm:");
  test::check_close(matmul(x.to(dnnl()), w.to(dnnl())), matmul(x, w), 1e-5, 1e-5);
  CHECK(built_with("gemm:") == before + 1);
  test::check_close(linear(x.to(dnnl()), w.to(dnnl()), b.to(dnnl())), linear(x, w, b), 1e-5, 1e-5);
  CHECK(built_with("gemm:") == before + 2);
  test::check_close(linear_gelu(x.to(dnnl()), w.to(dnnl()), b.to(dnnl()), GeluApproximation::erf, WeightLayout::in_out,
                                GeluBackward::recompute),
                    linear_gelu(x, w, b, GeluApproximation::erf, WeightLayout::in_out, GeluBackward::recompute), 1e-5,
                    1e-5);
  CHECK(built_with("gemm:") == before + 3);
  // A transposed (a weight gradient's x^T dy, read in place) with at least 2048 output columns.
  const Tensor xt = gaussian({40, 24}, 34), dy = gaussian({40, 2048}, 35);
  test::check_close(matmul(xt.to(dnnl()).transpose(0, 1), dy.to(dnnl())), matmul(xt.transpose(0, 1), dy), 1e-5, 1e-5);
  CHECK(built_with("gemm:") == before + 4);
  // A transposed with at least 2048 output rows (GPT-2-small's fc2 weight gradient h^T dy).
  const Tensor ht = gaussian({40, 2048}, 40), dy2 = gaussian({40, 24}, 41);
  test::check_close(matmul(ht.to(dnnl()).transpose(0, 1), dy2.to(dnnl())), matmul(ht.transpose(0, 1), dy2), 1e-5, 1e-5);
  CHECK(built_with("gemm:") == before + 5);
  // B transposed, wider than the inner dimension, with 512 rows (an input gradient dy w^T of a
  // layer that narrows: GPT-2-small's fc2).
  const Tensor dy3 = gaussian({512, 24}, 42), w3 = gaussian({56, 24}, 43);
  test::check_close(matmul(dy3.to(dnnl()), w3.to(dnnl()).transpose(0, 1)), matmul(dy3, w3.transpose(0, 1)), 1e-5, 1e-5);
  CHECK(built_with("gemm:") == before + 6);
  // Multi-threaded (past 4 MFLOP a product runs on every thread), with every GemmDesc feature the
  // gemm path's post-processing handles: rows of A and B read with leading dimensions past their
  // lengths, alpha (the bias then a binary post-op after the scale), beta (a sum post-op).
  {
    const std::int64_t m = 192, k = 160, n = 256, lda = k + 7, ldb = n + 5;
    const Tensor a = gaussian({m, lda}, 36), b = gaussian({k, ldb}, 37), bias = gaussian({n}, 38);
    const Tensor c0 = gaussian({m, n}, 39);
    GemmDesc d;
    d.a = a.data_ptr();
    d.b = b.data_ptr();
    d.bias = bias.data_ptr();
    d.m = m;
    d.n = n;
    d.k = k;
    d.lda = lda;
    d.ldb = ldb;
    d.alpha = 2.0f;
    d.beta = -0.5f;
    const Tensor expected = c0.clone(), got = c0.clone();
    d.c = expected.data_ptr();
    eigen().gemm(d);
    d.c = got.data_ptr();
    const std::int64_t gemm_path = built_with("gemm:");
    CHECK(executions_of([&] { dnnl().gemm(d); }) == 1);
    CHECK(built_with("gemm:") == gemm_path + 1);
    test::check_close(got, expected, 1e-4, 1e-4);
  }
  // Every primitive built is listed once per (kind, implementation), with a positive count.
  std::int64_t listed = 0;
  for (const auto& i : onednn::implementations()) {
    CHECK_FALSE(i.primitive.empty());
    CHECK_FALSE(i.implementation.empty());
    CHECK(i.built > 0);
    listed += i.built;
  }
  CHECK(listed == onednn::stats().primitives_created);
}

namespace {
std::atomic<long> g_handled{0};
extern "C" void count_signal(int) { g_handled.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

// oneDNN 2.6's f32 gemm:jit kernel points its stack pointer at a heap workspace when K > 84
// (oneDNN issue 4845, fixed in 3.11): a signal handled on a thread inside it wrote the handler's
// frame over the heap, and the next free() aborted ("munmap_chunk(): invalid pointer"; ruda-train
// stopped by SIGTERM did, 3 runs in ~45). The backend blocks asynchronous signals on the threads
// that run oneDNN's kernels while they do (context.cpp): a handler still runs, after the product.
// Here a thread signals the computing thread every 20 us for 1.5 s of products with K = 256 (in
// a scratch run, such a storm aborted the old code within a few hundred products).
TEST_CASE("a signal handled while f32 products run leaves memory and results intact") {
  struct sigaction action {
  }, previous{};
  action.sa_handler = count_signal;
  sigemptyset(&action.sa_mask);
  REQUIRE(sigaction(SIGUSR2, &action, &previous) == 0);
  const Tensor a = gaussian({64, 256}, 41).to(dnnl()), b = gaussian({256, 96}, 42).to(dnnl());
  const std::vector<float> want = matmul(a, b).to_vector<float>();
  const pthread_t computing = pthread_self();
  std::atomic<bool> done{false};
  std::thread storm([&] {
    while (!done.load()) {
      pthread_kill(computing, SIGUSR2);
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  });
  long products = 0, wrong = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  while (std::chrono::steady_clock::now() < end) {
    wrong += matmul(a, b).to_vector<float>() != want;
    ++products;
  }
  done.store(true);
  storm.join();
  sigaction(SIGUSR2, &previous, nullptr);
  CHECK(wrong == 0);
  CHECK(products > 100);
  CHECK(g_handled.load() > 0);  // the signals were handled, between the products
}

TEST_CASE("matrix-vector products run on oneDNN's gemm path, f32 and bf16, with B as stored or transposed") {
  // brgemm computes a block of rows where the product has one: a bf16 [1, 4096] x [4096, 4096]
  // took 2.6-3.0 ms there against the gemm path's GEMV at 0.6 (backends/onednn/matmul.cpp).
  // Fresh shapes, so that each call builds its primitive.
  const std::vector<DType> dtypes =
      onednn::bf16_native() ? std::vector<DType>{DType::f32, DType::bf16} : std::vector<DType>{DType::f32};
  std::uint64_t seed = 50;
  for (const DType dtype : dtypes) {
    CAPTURE(dtype_name(dtype));
    const double tol = dtype == DType::bf16 ? 2e-2 : 1e-5;
    for (const bool trans_b : {false, true}) {
      CAPTURE(trans_b);
      const std::int64_t k = 152 + (trans_b ? 8 : 0) + (dtype == DType::bf16 ? 16 : 0);
      const Tensor row = gaussian({1, k}, seed++).to(dtype), w = gaussian({k, 104}, seed++).to(dtype);
      const Tensor wt = gaussian({104, k}, seed++).to(dtype);
      const std::int64_t before = built_with("gemm:");
      const Tensor got =
          trans_b ? matmul(row.to(dnnl()), wt.to(dnnl()).transpose(0, 1)) : matmul(row.to(dnnl()), w.to(dnnl()));
      const Tensor expected = trans_b ? matmul(row.to(DType::f64), wt.to(DType::f64).transpose(0, 1))
                                      : matmul(row.to(DType::f64), w.to(DType::f64));
      test::check_close(got.to(DType::f64), expected, tol, tol);
      CHECK(built_with("gemm:") == before + 1);
      // One output column: a matrix times a vector (B transposed: a [1, k] row read as [k, 1]).
      const Tensor col =
          trans_b ? gaussian({1, k}, seed++).to(dtype).transpose(0, 1) : gaussian({k, 1}, seed++).to(dtype);
      const Tensor a = gaussian({96, k}, seed++).to(dtype);
      const std::int64_t before_column = built_with("gemm:");
      test::check_close(matmul(a.to(dnnl()), col.to(dnnl())).to(DType::f64),
                        matmul(a.to(DType::f64), col.to(DType::f64)), tol, tol);
      CHECK(built_with("gemm:") == before_column + 1);
    }
  }
}

TEST_CASE("gemm on random shapes, layouts and dtypes agrees with Eigen") {
  std::uint64_t state = 12345;
  auto next = [&](std::int64_t lo, std::int64_t hi) {  // uniform in [lo, hi]
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return lo + static_cast<std::int64_t>((state >> 33) % static_cast<std::uint64_t>(hi - lo + 1));
  };
  int on_onednn = 0;
  constexpr int kCases = 40;
  for (int i = 0; i < kCases; ++i) {
    const std::int64_t m = next(1, 160), n = next(1, 160), k = next(1, 160), batch = next(1, 4);
    const bool ta = next(0, 1), tb = next(0, 1), with_bias = next(0, 1);
    const int layout = static_cast<int>(next(0, 2));  // 0: all batched; 1: A shared; 2: B shared
    const DType in = next(0, 2) == 0 ? DType::bf16 : DType::f32;
    const DType out = in == DType::bf16 && next(0, 1) ? DType::f32 : in;
    CAPTURE(m);
    CAPTURE(n);
    CAPTURE(k);
    CAPTURE(batch);
    CAPTURE(ta);
    CAPTURE(tb);
    CAPTURE(layout);
    CAPTURE(dtype_name(in));
    CAPTURE(dtype_name(out));
    const Tensor a = gaussian({batch > 1 && layout == 1 ? 1 : batch, ta ? k : m, ta ? m : k}, 500 + i, in);
    const Tensor b = gaussian({batch > 1 && layout == 2 ? 1 : batch, tb ? n : k, tb ? k : n}, 600 + i, in);
    const Tensor bias = gaussian({n}, 700 + i, out);
    GemmDesc d;
    d.a = a.data_ptr();
    d.b = b.data_ptr();
    d.bias = with_bias ? bias.data_ptr() : nullptr;
    d.a_dtype = d.b_dtype = in;
    d.c_dtype = out;
    d.trans_a = ta;
    d.trans_b = tb;
    d.batch = batch;
    d.m = m;
    d.n = n;
    d.k = k;
    d.batch_stride_a = a.size(0) == 1 ? 0 : m * k;
    d.batch_stride_b = b.size(0) == 1 ? 0 : k * n;
    d.batch_stride_c = m * n;
    const Tensor ce = empty({batch, m, n}, out), cd = empty({batch, m, n}, out);
    d.c = ce.data_ptr();
    eigen().gemm(d);
    d.c = cd.data_ptr();
    on_onednn += executions_of([&] { dnnl().gemm(d); }) > 0;
    const double tol = out == DType::bf16 ? 8e-3 : (in == DType::bf16 ? 1e-4 : 1e-5);
    test::check_close(cd, ce, tol * std::sqrt(static_cast<double>(k)), tol);
  }
  MESSAGE(on_onednn << " of " << kCases << " random products ran on oneDNN (the rest were tiny)");
  CHECK(on_onednn > kCases / 2);
}

TEST_CASE("gemm with alpha != 1 and a bias on output matrices with gaps between them agrees with Eigen") {
  // oneDNN 2.6 placed the bias (a binary post-op where alpha != 1) by the output's physical
  // offset: with a gap after each matrix the second read the bias shifted, past its end (alpha
  // 0.5, n 8, gap 3: 4 5 6 7 8 0 0 4e-43 where every row is 1..8). Gaps are left as they were.
  const std::int64_t m = 4, n = 8, k = 512;
  for (const float alpha : {1.0f, 0.5f}) {
    for (const std::int64_t gap : {0, 1, 3, 8}) {
      for (const std::int64_t ldc : {n, n + 2}) {
        for (const bool two_axes : {false, true}) {
          CAPTURE(alpha);
          CAPTURE(gap);
          CAPTURE(ldc);
          CAPTURE(two_axes);
          const std::int64_t batch = two_axes ? 4 : 3, matrix = m * ldc + gap;
          const Tensor a = gaussian({batch, m, k}, 801), b = gaussian({batch, k, n}, 802), bias = gaussian({n}, 803);
          GemmDesc d;
          d.a = a.data_ptr();
          d.b = b.data_ptr();
          d.bias = bias.data_ptr();
          d.batch = batch;
          d.m = m;
          d.n = n;
          d.k = k;
          d.ldc = ldc;
          d.alpha = alpha;
          d.batch_stride_a = m * k;
          d.batch_stride_b = k * n;
          d.batch_stride_c = matrix;
          if (two_axes) {
            d.batch_inner = 2;
            d.inner_stride_a = m * k;
            d.inner_stride_b = k * n;
            d.inner_stride_c = matrix;
            d.batch_stride_a = 2 * m * k;
            d.batch_stride_b = 2 * k * n;
            d.batch_stride_c = 2 * matrix;
          }
          const Tensor c0 = gaussian({d.span_c()}, 804);
          const Tensor ce = c0.clone(), cd = c0.clone();
          d.c = ce.data_ptr();
          eigen().gemm(d);
          d.c = cd.data_ptr();
          dnnl().gemm(d);
          test::check_close(cd, ce, 1e-4, 1e-5);
        }
      }
    }
  }
}

TEST_CASE("bf16 matmul accumulates in f32, with f32 or bf16 output") {
  const std::int64_t m = 64, n = 80, k = 96;
  const Tensor a = gaussian({2, m, k}, 11, DType::bf16), b = gaussian({2, k, n}, 12, DType::bf16);
  for (DType out : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(out));
    const Tensor bias = gaussian({n}, 13, out);
    const Tensor c0 = gaussian({2, m, n}, 14, out);
    GemmDesc d;
    d.a = a.data_ptr();
    d.b = b.data_ptr();
    d.bias = bias.data_ptr();
    d.a_dtype = d.b_dtype = DType::bf16;
    d.c_dtype = out;
    d.batch = 2;
    d.m = m;
    d.n = n;
    d.k = k;
    d.batch_stride_a = m * k;
    d.batch_stride_b = k * n;
    d.batch_stride_c = m * n;
    d.beta = 0.5f;
    const Tensor ce = c0.clone(), cd = c0.clone();
    d.c = ce.data_ptr();
    eigen().gemm(d);  // widens to f32, multiplies in f32, rounds once
    d.c = cd.data_ptr();
    // Natively one bf16 primitive; without bf16 instructions an f32 oneDNN matmul on widened copies.
    CHECK(executions_of([&] { dnnl().gemm(d); }) == 1);
    if (out == DType::f32) {
      test::check_close(cd, ce, 1e-4, 1e-4);
    } else {
      test::check_close(cd, ce, 1e-2, 8e-3);  // at most one bf16 rounding apart
    }
  }
  // Through the engine: bf16 tensors give a bf16 product.
  const Tensor x = gaussian({3, 50, 70}, 15, DType::bf16), w = gaussian({70, 40}, 16, DType::bf16);
  const Tensor got = matmul(x.to(dnnl()), w.to(dnnl()));
  CHECK(got.dtype() == DType::bf16);
  test::check_close(got, matmul(x, w), 2e-2, 8e-3);
  if (onednn::bf16_native()) {
    CHECK_FALSE(has_fallback("gemm", "bf16"));
  } else {
    CHECK(has_fallback("gemm", "bf16", "computed in f32"));
  }
}

TEST_CASE("linear_gelu recomputing: one oneDNN matmul with the GELU as its post-op, agreeing with Eigen") {
  for (auto approximation : {GeluApproximation::erf, GeluApproximation::tanh}) {
    const Tensor x = gaussian({2, 64, 96}, 21, DType::f32), w = gaussian({96, 128}, 22, DType::f32),
                 b = gaussian({128}, 23, DType::f32);
    Tensor got;
    // The product, its bias and the GELU in one primitive execution: no separate eltwise pass.
    CHECK(executions_of([&] {
            got = linear_gelu(x.to(dnnl()), w.to(dnnl()), b.to(dnnl()), approximation, WeightLayout::in_out,
                              GeluBackward::recompute);
          }) == 1);
    test::check_close(got, linear_gelu(x, w, b, approximation, WeightLayout::in_out, GeluBackward::recompute), 1e-5,
                      1e-5);
    // Keeping the pre-activation: the product writes it, the GELU runs as its own pass.
    const Tensor kept = linear_gelu(x.to(dnnl()), w.to(dnnl()), b.to(dnnl()), approximation);
    test::check_close(kept, got, 1e-5, 1e-5);
  }
}

TEST_CASE("eltwise forward and backward agree with Eigen") {
  const std::vector<UnaryOp> ops = {UnaryOp::neg,      UnaryOp::abs,       UnaryOp::exp,        UnaryOp::log,
                                    UnaryOp::sqrt,     UnaryOp::rsqrt,     UnaryOp::tanh,       UnaryOp::sigmoid,
                                    UnaryOp::relu,     UnaryOp::gelu_tanh, UnaryOp::gelu_erf,   UnaryOp::silu,
                                    UnaryOp::softplus, UnaryOp::square,    UnaryOp::reciprocal, UnaryOp::erf};
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (std::int64_t n : {5000, 70000}) {  // one thread, and a team of threads
      const bool native_dtype = dtype == DType::f32 || onednn::bf16_native();
      for (UnaryOp op : ops) {
        CAPTURE(dtype_name(dtype));
        CAPTURE(n);
        CAPTURE(op_name(op));
        const bool positive =
            op == UnaryOp::log || op == UnaryOp::sqrt || op == UnaryOp::rsqrt || op == UnaryOp::reciprocal;
        const Tensor x = positive ? (abs(gaussian({n}, 20)) + 0.05).to(dtype) : gaussian({n}, 21, dtype, 3.0);
        const Tensor ye = empty({n}, Options(dtype, &eigen())), yd = empty({n}, Options(dtype, &dnnl()));
        eigen().unary(op, x.view(), ye.view());
        const std::int64_t forward_runs = executions_of([&] { dnnl().unary(op, x.view(), yd.view()); });
        check_routed(forward_runs, std::string(op_name(op)), dtype);
        // RUDA_ONEDNN_KERNELS=all: everything runs there but what oneDNN 2.6 gets wrong: softplus
        // (inaccurate), relu (NaN becomes 0), exp (NaN becomes +inf), log (bf16 log(1) is not 0),
        // rsqrt (0 at -inf). erf has no oneDNN 2.6 eltwise algorithm at all.
        const bool kept_on_eigen = op == UnaryOp::softplus || op == UnaryOp::relu || op == UnaryOp::erf ||
                                   op == UnaryOp::exp || op == UnaryOp::log || op == UnaryOp::rsqrt;
        if (native_dtype && onednn::all_kernels()) CHECK(forward_runs == (kept_on_eigen ? 0 : 1));
        test::check_close(yd, ye, atol_of(dtype), rtol_of(dtype));

        // Backward with both x and y available: each backend reads what its formula needs.
        const Tensor gy = gaussian({n}, 22, dtype);
        const Tensor ge = empty({n}, Options(dtype, &eigen())), gd = empty({n}, Options(dtype, &dnnl()));
        eigen().unary_backward(op, x.view(), ye.view(), gy.view(), ge.view());
        const std::int64_t backward_runs =
            executions_of([&] { dnnl().unary_backward(op, x.view(), ye.view(), gy.view(), gd.view()); });
        // (abs: oneDNN's passes the gradient at NaN, where it is 0; softplus: oneDNN's has no
        // threshold, where PyTorch's gradient is exactly 1 past 20; gelu_tanh: oneDNN's is NaN
        // from |x| ~1e15.)
        const bool has_backward = op != UnaryOp::neg && op != UnaryOp::rsqrt && op != UnaryOp::reciprocal &&
                                  op != UnaryOp::relu && op != UnaryOp::erf && op != UnaryOp::abs &&
                                  op != UnaryOp::softplus && op != UnaryOp::gelu_tanh;
        check_routed(backward_runs, std::string(op_name(op)) + " backward", dtype);
        if (native_dtype && onednn::all_kernels()) CHECK(backward_runs == (has_backward ? 1 : 0));
        // Derivatives through y = f(x) rounded to bf16 amplify its rounding (e.g. sqrt: 0.5 / y).
        test::check_close(gd, ge, 2 * atol_of(dtype), 2 * rtol_of(dtype));
      }
    }
  }
  CHECK(has_fallback("rsqrt backward", "f32", "no oneDNN eltwise backward"));
  for (const char* dtype : {"f32", "bf16"}) {
    CHECK(has_fallback("erf", dtype, "no eltwise algorithm for this op"));
    CHECK(has_fallback("erf backward", dtype, "no oneDNN eltwise backward for this op"));
  }
}

TEST_CASE("eltwise special values follow IEEE evaluation of the formulas") {
  // Against the formulas in double precision (not the Eigen backend, whose fast vectorized sqrt
  // returns NaN for +inf). Infinities are left out where the formula evaluates inf * 0 (gelu,
  // silu), whose limits the two implementations need not agree on.
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> finite = {0.0, -0.0, 1e-30, -1e-30, 1e-3, -1e-3, 0.7,  -0.7, 3,
                                      -3,  20,   -20,   50,     -50,  100,   -100, 1e4,  -1e4};
  struct Case {
    UnaryOp op;
    double (*f)(double);
    bool infinities;
  };
  const std::vector<Case> cases = {
      {UnaryOp::neg, [](double x) { return -x; }, true},
      {UnaryOp::abs, [](double x) { return std::abs(x); }, true},
      {UnaryOp::exp, [](double x) { return std::exp(x); }, true},
      {UnaryOp::log, [](double x) { return std::log(x); }, true},
      {UnaryOp::sqrt, [](double x) { return std::sqrt(x); }, true},
      {UnaryOp::tanh, [](double x) { return std::tanh(x); }, true},
      {UnaryOp::sigmoid, [](double x) { return 1 / (1 + std::exp(-x)); }, true},
      {UnaryOp::relu, [](double x) { return x > 0 ? x : 0.0; }, true},
      {UnaryOp::gelu_tanh,
       [](double x) { return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }, false},
      {UnaryOp::gelu_erf, [](double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); }, false},
      {UnaryOp::silu, [](double x) { return x / (1 + std::exp(-x)); }, false},
      {UnaryOp::square, [](double x) { return x * x; }, true},
  };
  for (const Case& c : cases) {
    CAPTURE(op_name(c.op));
    std::vector<double> values = finite;
    if (c.infinities) values.insert(values.end(), {inf, -inf});
    // Repeated up to kernel size (small tensors stay on Eigen), as floats, so that the reference
    // sees the values the kernel sees.
    std::vector<double> in;
    while (in.size() < 4096) {
      for (double v : values) in.push_back(static_cast<float>(v));
    }
    std::vector<double> want;
    for (double v : in) want.push_back(static_cast<float>(c.f(v)));
    const Tensor x = from_values(in, {static_cast<std::int64_t>(in.size())}, Options(DType::f32, &dnnl()));
    const Tensor y = empty(x.shape(), Options(DType::f32, &dnnl()));
    const std::int64_t runs = executions_of([&] { dnnl().unary(c.op, x.view(), y.view()); });
    check_routed(runs, std::string(op_name(c.op)), DType::f32);
    if (onednn::all_kernels() && c.op != UnaryOp::relu && c.op != UnaryOp::exp && c.op != UnaryOp::log) {
      CHECK(runs == 1);  // (relu, exp and log stay on Eigen: see the test above)
    }
    test::check_close(y, want, x.shape(), 1e-6, 1e-5);
  }
}

TEST_CASE("softmax and log_softmax forward and backward agree with Eigen") {
  struct Case {
    Shape shape;
    int axis;
    bool native;  // oneDNN 2.6 has jit kernels over the last axis only
  };
  const std::vector<Case> cases = {{{512, 10}, 1, true},
                                   {{64, 1000}, 1, true},
                                   {{30, 7, 33}, 2, true},
                                   {{80, 60}, 0, false},
                                   {{16, 20, 30}, 1, false}};
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (const Case& c : cases) {
      for (bool log : {false, true}) {
        CAPTURE(dtype_name(dtype));
        CAPTURE(to_string(c.shape));
        CAPTURE(log);
        // Large offsets: a kernel that skips the max subtraction overflows.
        const Tensor x = (gaussian(c.shape, 30, DType::f32, 5.0) + 1000.0).to(dtype);
        const Tensor ye = empty(c.shape, Options(dtype, &eigen())), yd = empty(c.shape, Options(dtype, &dnnl()));
        eigen().softmax(x.view(), ye.view(), c.axis, log);
        const std::int64_t runs = executions_of([&] { dnnl().softmax(x.view(), yd.view(), c.axis, log); });
        // bf16 runs on Eigen always, forward and backward (oneDNN 2.6's rounds twice), saying so.
        const bool native = c.native && dtype == DType::f32;
        // f32 runs Eigen's faster kernel by default (kernel_policy.h), oneDNN's under
        // RUDA_ONEDNN_KERNELS=all; log_softmax's forward runs on Eigen always (oneDNN's is
        // inexact near 0), saying so.
        const bool eigen_faster = dtype == DType::f32 && !onednn::all_kernels();
        if (native && !eigen_faster && !log) CHECK(runs == 1);
        if (eigen_faster || log || dtype == DType::bf16) CHECK(runs == 0);
        if (log) CHECK(has_fallback("log_softmax", std::string(dtype_name(dtype))));
        if (dtype == DType::bf16 && !log) CHECK(has_fallback("softmax", "bf16", "rounds twice"));
        // log_softmax with x near 1000: the kernels round at that scale (f32 ulp 6e-5; the bf16
        // inputs themselves are 4 apart).
        const double atol = log ? (dtype == DType::bf16 ? 8e-2 : 1.5e-4) : atol_of(dtype);
        test::check_close(yd, ye, atol, rtol_of(dtype));

        const Tensor gy = gaussian(c.shape, 31, dtype);
        const Tensor ge = empty(c.shape, Options(dtype, &eigen())), gd = empty(c.shape, Options(dtype, &dnnl()));
        eigen().softmax_backward(ye.view(), gy.view(), ge.view(), c.axis, log);
        const std::int64_t back =
            executions_of([&] { dnnl().softmax_backward(ye.view(), gy.view(), gd.view(), c.axis, log); });
        if (native && !capped_to_avx2()) CHECK(back == 1);  // oneDNN 2.6 has no AVX2 jit softmax backward
        if (back == 0)
          CHECK(has_fallback(log ? "log_softmax backward" : "softmax backward", std::string(dtype_name(dtype))));
        test::check_close(gd, ge, 2 * atol_of(dtype), 2 * rtol_of(dtype));
      }
    }
  }
  CHECK(has_fallback("softmax", "f32", onednn::all_kernels() ? "reference kernel" : "Eigen's kernel is faster"));
}

TEST_CASE("binary ops broadcast through strides and agree with Eigen") {
  struct Case {
    Shape a, b;
    bool native;  // add, sub and mul expected as one oneDNN primitive
  };
  const std::vector<Case> cases = {
      {{64, 300}, {64, 300}, true},     // same shape
      {{64, 300}, {300}, true},         // a bias row
      {{64, 300}, {64, 1}, true},       // a column
      {{64, 300}, {}, true},            // a scalar
      {{300}, {64, 300}, true},         // the left operand broadcasts: the sides swap
      {{8, 16, 32}, {8, 1, 32}, true},  // a middle axis
      {{64, 1}, {1, 300}, false},       // both broadcast: no oneDNN form
  };
  using Fn = Tensor (*)(const Tensor&, const Tensor&);
  struct Op {
    const char* name;
    Fn fn;
    bool arithmetic;
  };
  const std::vector<Op> ops = {{"add", add, true}, {"sub", sub, true}, {"mul", mul, true}, {"div", div, true},
                               {"eq", eq, false},  {"ne", ne, false},  {"lt", lt, false},  {"le", le, false},
                               {"gt", gt, false},  {"ge", ge, false}};
  // Values on a coarse grid so that comparisons meet ties, plus NaN and infinities.
  auto grid_values = [](const Shape& shape, std::uint64_t seed, DType dtype) {
    const std::int64_t n = shape_numel(shape);
    std::vector<double> v(static_cast<std::size_t>(n));
    std::uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
    for (auto& x : v) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      x = static_cast<double>(static_cast<std::int64_t>(state >> 60) - 8) / 4.0;
    }
    if (n > 3) {
      v[1] = std::numeric_limits<double>::quiet_NaN();
      v[2] = std::numeric_limits<double>::infinity();
    }
    return from_values(v, shape, Options(dtype, &eigen()));
  };
  std::uint64_t seed = 40;
  for (DType dtype : {DType::f32, DType::bf16}) {
    const bool native_dtype = dtype == DType::f32 || onednn::bf16_native();
    for (const Case& c : cases) {
      const Tensor a = grid_values(c.a, ++seed, dtype), b = grid_values(c.b, ++seed, dtype);
      for (const Op& op : ops) {
        CAPTURE(dtype_name(dtype));
        CAPTURE(to_string(c.a));
        CAPTURE(to_string(c.b));
        CAPTURE(std::string(op.name));
        const Tensor expected = op.fn(a, b);
        Tensor got;
        const std::int64_t runs = executions_of([&] { got = op.fn(a.to(dnnl()), b.to(dnnl())); });
        // div has no mirrored form (sub runs as (-b) + a, the -1 a scale on oneDNN's first source).
        const bool swapped_unmirrored = std::string(op.name) == "div" && c.a.size() < c.b.size();
        check_routed(runs, op.name, dtype);
        // Same shapes always run on oneDNN; broadcasts do in bf16, or in f32 with RUDA_ONEDNN_KERNELS=all.
        const bool routed = c.a == c.b || dtype == DType::bf16 || onednn::all_kernels();
        if (native_dtype && routed && c.native && op.arithmetic && !swapped_unmirrored) CHECK(runs == 1);
        if (native_dtype && !op.arithmetic && c.a == c.b) CHECK(runs == 1);  // comparisons, gt/ge as lt/le
        if (!c.native) CHECK(runs == 0);
        // The same IEEE operations rounded the same way: equal up to oneDNN flushing bf16 subnormals.
        test::check_close(got, expected, 1e-30, 0);
      }
    }
  }
  // In place: out is a (the kernel contract allows out to alias an operand exactly).
  const Tensor a = gaussian({64, 300}, 50), b = gaussian({64, 300}, 51);
  const Tensor expected = a + b;
  Tensor inplace = a.clone().to(dnnl());
  CHECK(executions_of([&] { dnnl().binary(BinaryOp::add, inplace.view(), b.view(), inplace.view()); }) == 1);
  test::check_close(inplace, expected, 0, 0);
  CHECK(has_fallback("add", "f32", "both operands broadcast"));
  CHECK(has_fallback("div", "bf16", "no mirrored oneDNN form"));
  CHECK(has_fallback("gt", "bf16", "true for NaN"));
}

TEST_CASE("sum reductions agree with Eigen") {
  struct Case {
    Shape shape;
    Axes axes;
    // The length of the fold over the innermost axis (the one oneDNN runs with a jit kernel), 0
    // when there is none. oneDNN takes lines of up to 2^12 f32 or 2^16 bf16 values; longer ones go
    // to Eigen's kernel, which sums in double.
    std::int64_t line;
    // Separate runs of axes: a 16-bit sum folds them in f32 (rounded once), so its folds take
    // f32's route.
    bool separate_runs = false;
  };
  const std::vector<Case> cases = {
      {{128, 1024}, {0}, 0},            // bias gradients: a leading axis
      {{128, 1024}, {1}, 1024},         // the innermost axis
      {{1 << 20}, {}, 1 << 20},         // everything: too long a line for oneDNN's f32 accumulators
      {{1 << 16}, {}, 1 << 16},         // everything, the longest bf16 line oneDNN sums
      {{8, 64, 32}, {1}, 0},            // a middle axis
      {{8, 64, 32}, {0, 2}, 32, true},  // two separate runs, folded one after the other
      {{16, 20, 30}, {}, 16 * 600},     // everything, from several axes
      {{1, 4096, 1}, {1}, 4096},        // extent-1 axes around
      {{4, 5, 6}, {2}, 0},              // small: Eigen
  };
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (const Case& c : cases) {
      const DType fold = c.separate_runs ? DType::f32 : dtype;
      const std::int64_t longest = fold == DType::f32 ? 1 << 12 : 1 << 16;
      CAPTURE(dtype_name(dtype));
      CAPTURE(to_string(c.shape));
      CAPTURE(c.axes.size());
      const Tensor x = gaussian(c.shape, 60, dtype);
      const Tensor expected = sum(x, c.axes, true);
      Tensor got;
      const std::int64_t runs = executions_of([&] { got = sum(x.to(dnnl()), c.axes, true); });
      if (runs == 0) CHECK(has_fallback("sum", std::string(dtype_name(dtype))));
      // Innermost sums run on oneDNN in bf16 (in f32 Eigen's kernel is faster), or with
      // RUDA_ONEDNN_KERNELS=all; other axes only have oneDNN's reference kernel.
      const bool fits = c.line > 0 && c.line <= longest;
      const bool routed = fits && (fold == DType::bf16 || onednn::all_kernels());
      if (routed && (fold == DType::f32 || onednn::bf16_native())) CHECK(runs >= 1);
      if (!fits) CHECK(runs == 0);
      // Sums of up to 2^20 normal values (magnitude ~1000) in another order.
      test::check_close(got, expected, dtype == DType::bf16 ? 0.1 : 1e-3, dtype == DType::bf16 ? 1e-2 : 1e-5);
    }
  }
  CHECK(has_fallback("sum", "f32", "innermost"));
  if (onednn::bf16_native()) CHECK(has_fallback("sum", "bf16", "line longer"));
}

TEST_CASE("small tensors stay on Eigen, visibly") {
  const Tensor x = gaussian({100}, 85), y = gaussian({100}, 86);
  Tensor r, s, p;
  CHECK(executions_of([&] {
          r = relu(x.to(dnnl()));
          s = x.to(dnnl()) + y.to(dnnl());
          p = matmul(x.reshape({10, 10}).to(dnnl()), y.reshape({10, 10}).to(dnnl()));
        }) == 0);
  test::check_close(r, relu(x), 0, 0);
  test::check_close(s, x + y, 0, 0);
  test::check_close(p, matmul(x.reshape({10, 10}), y.reshape({10, 10})), 0, 0);
  CHECK(has_fallback("relu", "f32", "small tensor"));
  CHECK(has_fallback("add", "f32", "small tensor"));
  CHECK(has_fallback("gemm", "f32", "small tensor"));
}

TEST_CASE("fallbacks give Eigen's results and are recorded") {
  // i64 arithmetic, f64 products, NaN-propagating maximum, where, argmax, logsumexp, pow, casts.
  const Tensor i = randint({50, 40}, -5, 5, 70), j = randint({50, 40}, -5, 5, 71);
  test::check_close((i.to(dnnl()) + j.to(dnnl())), i + j, 0, 0);
  const Tensor d1 = gaussian({30, 20}, 72, DType::f64), d2 = gaussian({20, 10}, 73, DType::f64);
  test::check_close(matmul(d1.to(dnnl()), d2.to(dnnl())), matmul(d1, d2), 0, 0);
  const Tensor x = gaussian({100, 50}, 74), y = gaussian({100, 50}, 75);
  const Tensor xn = x.clone();
  xn.data<float>()[7] = std::numeric_limits<float>::quiet_NaN();
  test::check_close(maximum(xn.to(dnnl()), y.to(dnnl())), maximum(xn, y), 0, 0);
  test::check_close(where(gt(x, y).to(dnnl()), x.to(dnnl()), y.to(dnnl())), where(gt(x, y), x, y), 0, 0);
  test::check_close(argmax(x.to(dnnl()), 1), argmax(x, 1), 0, 0);
  test::check_close(logsumexp(x.to(dnnl()), {1}), logsumexp(x, {1}), 0, 0);
  test::check_close(pow(abs(x).to(dnnl()), y.to(dnnl())), pow(abs(x), y), 0, 0);
  test::check_close(cast(x.to(dnnl()), DType::bf16), cast(x, DType::bf16), 0, 0);
  CHECK(has_fallback("add", "i64"));
  CHECK(has_fallback("gemm", "f64"));
  CHECK(has_fallback("maximum", "f32", "NaN"));
  CHECK(has_fallback("where", "f32"));
  CHECK(has_fallback("argmax", "f32"));
  CHECK(has_fallback("logsumexp", "f32"));
  CHECK(has_fallback("pow", "f32"));
  CHECK(has_fallback("cast", "f32"));
  // Each distinct (op, dtype, reason) is recorded once however often it happens.
  const auto count = onednn::fallbacks().size();
  for (int k = 0; k < 3; ++k) (void)(i.to(dnnl()) + j.to(dnnl()));
  CHECK(onednn::fallbacks().size() == count);
}

TEST_CASE("RUDA_LOG=debug prints each fallback once") {
  // Run with RUDA_LOG=debug by its own ctest entry, which matches the printed line.
  const Tensor c = gt(gaussian({10}, 80), gaussian({10}, 81));
  (void)where(c.to(dnnl()), gaussian({10}, 82).to(dnnl()), gaussian({10}, 83).to(dnnl()));
  CHECK(has_fallback("where", "f32"));
  // An op without a oneDNN kernel (erf) runs Eigen's, with Eigen's values, and says so once.
  const Tensor x = gaussian({5000}, 84);
  for (int k = 0; k < 2; ++k) test::check_close(erf(x.to(dnnl())), erf(x), 0, 0);
  const auto seen = onednn::fallbacks();
  CHECK(std::count_if(seen.begin(), seen.end(), [](const auto& f) { return f.op == "erf" && f.dtype == "f32"; }) == 1);
}

namespace {
// A small MLP step in the shape of a training loop: linear, relu, linear, log_softmax, pick the
// labels' log-probabilities, mean, backward, SGD update.
double mlp_step(std::vector<Tensor>& params, const Tensor& x, const Tensor& labels) {
  Tensor& w1 = params[0];
  Tensor& b1 = params[1];
  Tensor& w2 = params[2];
  Tensor& b2 = params[3];
  const Tensor logits = linear(gelu(linear(x, w1, b1)), w2, b2);
  const Tensor loss = -mean(take_along_axis(log_softmax(logits, 1), labels.unsqueeze(1), 1));
  for (Tensor& p : params) p.zero_grad();
  loss.backward();
  autograd::NoGradGuard guard;
  for (Tensor& p : params) p.add_(p.grad(), -0.1);
  return loss.item();
}
}  // namespace

TEST_CASE("after one training step no primitive is created again") {
  Backend& b = dnnl();
  const Tensor x = gaussian({64, 96}, 90).to(b);
  const Tensor labels = randint({64}, 0, 10, 91);
  std::vector<Tensor> params = {
      (gaussian({96, 128}, 92) * 0.1).to(b).set_requires_grad(), zeros({128}, Options(DType::f32, &b, true)),
      (gaussian({128, 10}, 93) * 0.1).to(b).set_requires_grad(), zeros({10}, Options(DType::f32, &b, true))};
  const std::int64_t before = onednn::primitives_created();
  const double first = mlp_step(params, x, labels);
  const onednn::Stats warm = onednn::stats();
  CHECK(warm.primitives_created > before);  // the step did build primitives (unless an earlier test did)
  double last = first;
  for (int step = 0; step < 3; ++step) last = mlp_step(params, x, labels);
  const onednn::Stats after = onednn::stats();
  CHECK(after.primitives_created == warm.primitives_created);
  CHECK(after.refusals == warm.refusals);
  CHECK(after.cache_hits > warm.cache_hits);
  CHECK(after.executions > warm.executions);
  INFO("loss " << first << " -> " << last);
  CHECK(last < first);
}

TEST_CASE("the cache keeps at most its capacity and rebuilds what it evicted") {
  const std::size_t own = onednn::cache_capacity();
  onednn::set_cache_capacity(4);
  CHECK(onednn::stats().cached <= 4);
  std::vector<Tensor> inputs;
  for (int i = 0; i < 10; ++i) inputs.push_back(gaussian({64, 64 + i}, 120 + i));
  for (int round = 0; round < 2; ++round) {
    for (const Tensor& x : inputs) {
      Tensor y;
      CHECK(executions_of([&] { y = square(x.to(dnnl())); }) == 1);
      CHECK(onednn::stats().cached <= 4);
      test::check_close(y, square(x.to(eigen())), 1e-6, 1e-6);
    }
  }
  onednn::set_cache_capacity(own);
  CHECK(onednn::cache_capacity() == own);
  CHECK_THROWS_AS(onednn::set_cache_capacity(0), ArgumentError);
}

TEST_CASE("a primitive is built per intra-op thread count") {
  const int own = num_threads();
  const Tensor a = gaussian({256, 256}, 95), w = gaussian({256, 256}, 96);
  set_num_threads(1);
  (void)matmul(a.to(dnnl()), w.to(dnnl()));
  const std::int64_t one = onednn::primitives_created();
  set_num_threads(2);
  const Tensor two_threads = matmul(a.to(dnnl()), w.to(dnnl()));
  // brgemm matmuls fix their thread partition when built: a 2-thread primitive is another one.
  CHECK(onednn::primitives_created() == one + 1);
  (void)matmul(a.to(dnnl()), w.to(dnnl()));
  CHECK(onednn::primitives_created() == one + 1);
  set_num_threads(own);
  test::check_close(two_threads, matmul(a, w), 1e-4, 1e-4);
}

TEST_CASE("emulated ranks run oneDNN kernels with their own intra-op thread count") {
  // The main thread multiplies with 2 threads; ranks with 1 thread each must not reuse that
  // primitive (its 2-thread partition would put 2 x 2 threads on the cores): they build their own.
  const int own = num_threads();
  set_num_threads(2);
  const Tensor a = gaussian({320, 288}, 130), w = gaussian({288, 256}, 131);
  const Tensor expected = matmul(a.to(dnnl()), w.to(dnnl()));
  set_num_threads(own);
  const std::int64_t before = onednn::primitives_created();
  std::atomic<int> failures{0}, threads_seen{0};
  EmulatedOptions options;
  options.threads_per_rank = 1;
  run_ranks(
      2,
      [&](Communicator& comm) {
        threads_seen += num_threads();
        const Tensor mine = matmul(a.to(dnnl()), w.to(dnnl()));
        const auto got = mine.to_vector<float>(), want = expected.to_vector<float>();
        for (std::size_t i = 0; i < got.size(); ++i) {
          if (std::abs(got[i] - want[i]) > 1e-4f * (1 + std::abs(want[i]))) {
            failures.fetch_add(1);
            break;
          }
        }
        comm.barrier();
      },
      options);
  CHECK(threads_seen.load() == 2);
  CHECK(failures.load() == 0);
  CHECK(onednn::primitives_created() > before);
}

TEST_CASE("threads run primitives concurrently with correct results") {
  // Emulated ranks: several threads, each with its own intra-op thread count, share the cache and
  // build the same primitives at the same time.
  const Tensor a = gaussian({96, 128}, 100), w = gaussian({128, 64}, 101), bias = gaussian({64}, 102);
  const Tensor expected_linear = linear(a, w, bias);
  const Tensor expected_softmax = softmax(expected_linear, 1);
  const Tensor expected_gelu = gelu(expected_linear);
  constexpr int kThreads = 4, kIterations = 25;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      set_num_threads(1 + t % 2);
      Backend& b = dnnl();
      for (int it = 0; it < kIterations; ++it) {
        const Tensor y = linear(a.to(b), w.to(b), bias.to(b));
        const Tensor s = softmax(y, 1);
        const Tensor g = gelu(y);
        const auto close = [](const Tensor& got, const Tensor& want, double tol) {
          const auto x = got.to_vector<float>(), e = want.to_vector<float>();
          for (std::size_t i = 0; i < x.size(); ++i) {
            if (std::abs(x[i] - e[i]) > tol * (1 + std::abs(e[i]))) return false;
          }
          return true;
        };
        if (!close(y, expected_linear, 1e-4) || !close(s, expected_softmax, 1e-5) || !close(g, expected_gelu, 1e-4)) {
          failures.fetch_add(1);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(failures.load() == 0);
}

TEST_CASE("fused attention runs its block products on oneDNN, agrees with Eigen, and builds no primitive when warm") {
  // f32 always runs on oneDNN matmuls; bf16 where the ISA has bf16 instructions; f64 (and bf16
  // elsewhere) on the Eigen kernel, recorded.
  for (DType dtype : {DType::f32, DType::bf16, DType::f64}) {
    CAPTURE(dtype_name(dtype));
    for (bool causal : {false, true}) {
      CAPTURE(causal);
      AttentionOptions o;
      o.causal = causal;
      o.dropout = 0.1;
      o.seed = 3;
      // Several query and key blocks, the last of each partial: every block shape of the kernel.
      const Tensor q = gaussian({2, 2, 200, 16}, 1, dtype), k = gaussian({2, 2, 600, 16}, 2, dtype),
                   v = gaussian({2, 2, 600, 8}, 3, dtype), g = gaussian({2, 2, 200, 8}, 4, dtype);
      auto run = [&](Backend& b) {
        const Tensor qb = q.to(b).detach().set_requires_grad(), kb = k.to(b).detach().set_requires_grad(),
                     vb = v.to(b).detach().set_requires_grad();
        const Tensor out = scaled_dot_product_attention(qb, kb, vb, o);
        out.backward(g.to(b));
        return std::vector<Tensor>{out, qb.grad(), kb.grad(), vb.grad()};
      };
      const auto want = run(eigen());
      run(dnnl());  // warms the cache
      const std::int64_t created = onednn::primitives_created();
      std::vector<Tensor> got;
      const std::int64_t runs = executions_of([&] { got = run(dnnl()); });
      CHECK(onednn::primitives_created() == created);
      const bool native = dtype == DType::f32 || (dtype == DType::bf16 && onednn::bf16_native());
      if (native) {
        CHECK(runs > 0);
      } else {
        CHECK(runs == 0);
        CHECK(has_fallback("scaled_dot_product_attention", std::string(dtype_name(dtype))));
      }
      for (std::size_t i = 0; i < got.size(); ++i) {
        CAPTURE(i);
        CHECK_CLOSE(got[i], want[i], atol_of(dtype), dtype == DType::bf16 ? 2e-2 : 1e-5);
      }
    }
  }
}

TEST_CASE("RUDA_ONEDNN_CACHE_CAPACITY: a whole number of entries; anything else keeps the default") {
  // (atol read "abc" as 0, silently the default, and "1e3" as a cache of one entry.)
  CHECK(onednn::cache_capacity_from(nullptr) == 4096);
  CHECK(onednn::cache_capacity_from("") == 4096);
  CHECK(onednn::cache_capacity_from("100") == 100);
  for (const char* bad : {"abc", "1e3", "-5", "0", "12x", " 7", "99999999999999999999999"}) {
    CAPTURE(bad);
    CHECK(onednn::cache_capacity_from(bad) == 4096);
  }
}

// Last in this file: it fills the process's fallback log, which the cases above read.
TEST_CASE("the fallback log is bounded: a program whose refused shapes keep changing does not grow it forever") {
  // A transposed operand of a product by elements: oneDNN offers only its reference kernel, and
  // the reason names the shapes, so each new shape was a new entry (0.74 KB each, without end).
  for (std::int64_t n = 1; static_cast<std::size_t>(n) <= onednn::kMaxFallbacks + 8; ++n) {
    const Tensor a = ones({n + 64, 65}, Options(DType::f32, &dnnl())).transpose(0, 1);
    const Tensor b = ones({65, n + 64}, Options(DType::f32, &dnnl()));
    CHECK((a * b).at({0, 0}) == 1.0);
  }
  const std::vector<onednn::Fallback> log = onednn::fallbacks();
  REQUIRE(log.size() == onednn::kMaxFallbacks + 1);
  CHECK(log.back().reason.find("the log is full") != std::string::npos);
}
