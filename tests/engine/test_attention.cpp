// Fused scaled dot-product attention against the composed ops (matmul, scale, -inf mask through
// where, softmax, dropout, matmul) in the same test: forward and the three gradients, in f32, f64
// and the 16-bit dtypes; kernel-level strided views; gradcheck; errors; memory. Runs once per
// backend.
//
// Tolerances are the largest absolute difference divided by the largest |value| of the reference
// (relative to max|value|): 1e-5 in f32, 1e-12 in f64, 1e-2 in bf16 and f16. The 16-bit cases
// compare with the composed ops in f32 on the same (rounded) inputs, so they measure the fused
// kernel's own rounding. Both backends run bf16 and f16 on every CPU (Eigen widens 16-bit blocks
// to f32; oneDNN multiplies bf16 natively where the CPU has bf16 instructions and falls back to the
// Eigen kernel elsewhere), so no 16-bit case is skipped; the path taken is printed once.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <thread>

#include "helpers.h"

using namespace ruda;

namespace {

Tensor composed(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& o) {
  const DType work = q.dtype() == DType::f64 ? DType::f64 : DType::f32;
  const std::int64_t tq = q.size(2), tk = k.size(2);
  const double scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
  Tensor s = cast(matmul(q, transpose(k, 2, 3)), work) * scale;
  if (o.causal) {
    const Tensor rows = arange(0, static_cast<double>(tq), 1, DType::i64).reshape({tq, 1});
    const Tensor cols = arange(0, static_cast<double>(tk), 1, DType::i64).reshape({1, tk});
    s = where(gt(cols, rows), full({}, -std::numeric_limits<double>::infinity(), work), s);
  }
  const Tensor a = dropout(softmax(s, -1), o.dropout, o.seed, o.offset);
  return matmul(cast(a, v.dtype()), v);
}

double tolerance(DType dtype) {
  switch (dtype) {
    case DType::f64:
      return 1e-12;
    case DType::f32:
      return 1e-5;
    default:
      return 1e-2;
  }
}

// The worst error seen per (dtype, quantity), printed at the end of the run.
std::map<std::pair<std::string, std::string>, double>& worst() {
  static std::map<std::pair<std::string, std::string>, double> w;
  return w;
}

DType dtype_from_name(const std::string& name) {
  for (DType d : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    if (dtype_name(d) == name) return d;
  }
  FAIL("unknown dtype " << name);
  return DType::f32;
}

// max |got - want| / max |want|.
double relative_error(const Tensor& got, const Tensor& want) {
  REQUIRE(got.defined());
  REQUIRE(want.defined());
  REQUIRE(got.shape() == want.shape());
  const auto g = got.to_vector<double>(), w = want.to_vector<double>();
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    diff = std::max(diff, std::abs(g[i] - w[i]));
    scale = std::max(scale, std::abs(w[i]));
    if (std::isnan(g[i])) diff = std::numeric_limits<double>::infinity();
  }
  return scale > 0 ? diff / scale : diff;
}

Tensor leaf(const Shape& shape, std::uint64_t seed, DType dtype) {
  return randn(shape, seed, 0, Options(dtype)).set_requires_grad();
}

struct Case {
  Shape q, k, v;
  AttentionOptions options;
};

// Fused and composed forward and gradients of one case in one dtype.
void check_case(const Case& c, DType dtype, std::uint64_t seed = 1) {
  CAPTURE(dtype_name(dtype));
  CAPTURE(to_string(c.q));
  CAPTURE(to_string(c.k));
  CAPTURE(to_string(c.v));
  CAPTURE(c.options.causal);
  CAPTURE(c.options.dropout);
  const Tensor q = leaf(c.q, seed, dtype), k = leaf(c.k, seed + 1, dtype), v = leaf(c.v, seed + 2, dtype);
  const Tensor out = scaled_dot_product_attention(q, k, v, c.options);
  REQUIRE(out.dtype() == dtype);
  REQUIRE(out.shape() == Shape{c.q[0], c.q[1], c.q[2], c.v[3]});
  const Tensor dout = randn(out.shape(), seed + 3, 0, Options(dtype));
  out.backward(dout);

  // The reference: the composed ops, in f32 on the same values for 16-bit dtypes.
  const DType ref_dtype = dtype == DType::f64 ? DType::f64 : DType::f32;
  const Tensor rq = q.detach().to(ref_dtype).set_requires_grad(), rk = k.detach().to(ref_dtype).set_requires_grad(),
               rv = v.detach().to(ref_dtype).set_requires_grad();
  const Tensor ref = composed(rq, rk, rv, c.options);
  ref.backward(dout.to(ref_dtype));

  const double tol = tolerance(dtype);
  const std::pair<const char*, std::pair<Tensor, Tensor>> checks[] = {
      {"out", {out, ref}}, {"dq", {q.grad(), rq.grad()}}, {"dk", {k.grad(), rk.grad()}}, {"dv", {v.grad(), rv.grad()}}};
  for (const auto& [what, pair] : checks) {
    const double e = relative_error(pair.first, pair.second);
    CHECK_MESSAGE(e <= tol, what << ": error " << e << " relative to max|value| exceeds " << tol);
    double& w = worst()[{std::string(dtype_name(dtype)), what}];
    w = std::max(w, e);
  }
}

const DType kDTypes[] = {DType::f32, DType::f64, DType::bf16, DType::f16};

void check_all_dtypes(const Case& c) {
  for (DType dtype : kDTypes) check_case(c, dtype);
}

// Part p of a [B, T, 3, H, D] tensor: [B, T, H, D].
Tensor select_part(const Tensor& x, std::int64_t p) { return squeeze(slice(x, 2, p, p + 1), 2); }

AttentionOptions causal() {
  AttentionOptions o;
  o.causal = true;
  return o;
}

}  // namespace

TEST_CASE("fused attention matches the composed ops: small shapes, causal and not") {
  for (bool is_causal : {false, true}) {
    AttentionOptions o;
    o.causal = is_causal;
    check_all_dtypes({{2, 3, 5, 4}, {2, 3, 5, 4}, {2, 3, 5, 4}, o});
  }
}

TEST_CASE("fused attention: lengths not a multiple of the block, T = 1, odd and unequal head dims") {
  // Block sizes are in backends/eigen/attention_kernel.h (q 64 below T = 192, kv 128 below 768).
  check_all_dtypes({{1, 2, 70, 8}, {1, 2, 70, 8}, {1, 2, 70, 8}, causal()});  // q blocks 64 + 6
  check_all_dtypes({{2, 1, 1, 4}, {2, 1, 1, 4}, {2, 1, 1, 4}, causal()});     // T = 1
  check_all_dtypes({{2, 1, 1, 4}, {2, 1, 1, 4}, {2, 1, 1, 4}, {}});
  check_all_dtypes({{1, 3, 11, 7}, {1, 3, 11, 7}, {1, 3, 11, 5}, {}});  // odd D, Dv != D
  check_all_dtypes({{1, 3, 11, 7}, {1, 3, 11, 7}, {1, 3, 11, 5}, causal()});
}

TEST_CASE("fused attention: Tq != Tk, causal top-left aligned") {
  for (bool is_causal : {false, true}) {
    AttentionOptions o;
    o.causal = is_causal;
    check_all_dtypes({{2, 2, 9, 6}, {2, 2, 17, 6}, {2, 2, 17, 3}, o});       // fewer queries than keys
    check_all_dtypes({{2, 2, 17, 6}, {2, 2, 9, 6}, {2, 2, 9, 3}, o});        // more queries: rows 9.. see every key
    check_all_dtypes({{1, 1, 40, 8}, {1, 1, 1100, 8}, {1, 1, 1100, 8}, o});  // key blocks 4 x 256 + 76
  }
  AttentionOptions scaled = causal();
  scaled.scale = 0.7;
  check_all_dtypes({{1, 2, 20, 4}, {1, 2, 30, 4}, {1, 2, 30, 4}, scaled});
}

TEST_CASE("fused attention: several query and key blocks, causal (T = 300 and T = 600: 128-row blocks)") {
  for (DType dtype : {DType::f32, DType::bf16}) {
    check_case({{1, 2, 300, 16}, {1, 2, 300, 16}, {1, 2, 300, 16}, causal()}, dtype);
    check_case({{1, 1, 600, 8}, {1, 1, 600, 8}, {1, 1, 600, 8}, causal()}, dtype);
  }
  check_case({{1, 1, 600, 8}, {1, 1, 600, 8}, {1, 1, 600, 8}, {}}, DType::f64);
}

TEST_CASE("fused attention: diagonal blocks cut into chunks, whole and partial") {
  // A causal block that crosses the diagonal is multiplied in 64-row chunks, each against the keys
  // its last row sees (attention_kernel.h, for_each_chunk). T = 968: three 256-row blocks of four
  // chunks and a last block of 200 rows (chunks 64, 64, 64, 8).
  for (DType dtype : {DType::f32, DType::f64})
    check_case({{1, 1, 968, 8}, {1, 1, 968, 8}, {1, 1, 968, 8}, causal()}, dtype);
  // 128-row query blocks against 256-key blocks (Tq != Tk): chunks see 64, 128, 192 and 256 keys.
  check_case({{1, 2, 300, 8}, {1, 2, 1100, 8}, {1, 2, 1100, 8}, causal()}, DType::f32);
  // T = 128: one block per head, two chunks (the default GPT's shape, one head).
  check_all_dtypes({{2, 1, 128, 16}, {2, 1, 128, 16}, {2, 1, 128, 16}, causal()});
}

TEST_CASE("fused attention: B x H smaller than the thread count splits heads over key blocks") {
  const int before = num_threads();
  set_num_threads(4);
  // One head, five key blocks over four threads: four items each owning its keys' dK and dV
  // (one of them two blocks), dQ summed after.
  for (bool is_causal : {false, true}) {
    AttentionOptions o;
    o.causal = is_causal;
    for (DType dtype : {DType::f32, DType::f64, DType::bf16}) {
      check_case({{1, 1, 70, 8}, {1, 1, 1100, 8}, {1, 1, 1100, 4}, o}, dtype);
      check_case({{1, 1, 1030, 4}, {1, 1, 1030, 4}, {1, 1, 1030, 4}, o}, dtype);
    }
  }
  set_num_threads(before);
}

TEST_CASE("fused attention with dropout draws the composed path's mask") {
  AttentionOptions o;
  o.dropout = 0.25;
  o.seed = 7;
  o.offset = 12345;
  for (bool is_causal : {false, true}) {
    o.causal = is_causal;
    for (DType dtype : kDTypes) check_case({{2, 2, 37, 8}, {2, 2, 45, 8}, {2, 2, 45, 5}, o}, dtype);
    check_case({{1, 1, 20, 4}, {1, 1, 1030, 4}, {1, 1, 1030, 4}, o}, DType::f32);  // across key blocks
    check_case({{1, 1, 260, 4}, {1, 1, 260, 4}, {1, 1, 260, 4}, o}, DType::f32);   // diagonal chunks
  }
  // The mask really drops: some weights are zero, so the output differs from no dropout.
  const Tensor q = randn({1, 1, 8, 4}, 1), k = randn({1, 1, 8, 4}, 2), v = randn({1, 1, 8, 4}, 3);
  const Tensor plain = scaled_dot_product_attention(q, k, v), dropped = scaled_dot_product_attention(q, k, v, o);
  CHECK(relative_error(dropped, plain) > 1e-3);
  // Another offset is another mask.
  AttentionOptions other = o;
  other.offset += 1;
  CHECK(relative_error(scaled_dot_product_attention(q, k, v, other), dropped) > 1e-3);
  // B*H = 1 with more threads: the split backward regenerates the same mask.
  const int before = num_threads();
  set_num_threads(4);
  check_case({{1, 1, 33, 4}, {1, 1, 1100, 4}, {1, 1, 1100, 4}, o}, DType::f32);
  set_num_threads(before);
}

TEST_CASE("gradients only for the inputs that require them") {
  const Tensor q = randn({1, 2, 6, 4}, 1), k = randn({1, 2, 6, 4}, 2), v = leaf({1, 2, 6, 3}, 3, DType::f32);
  const Tensor out = scaled_dot_product_attention(q, k, v, causal());
  out.backward(ones_like(out));
  CHECK_FALSE(q.grad().defined());
  CHECK_FALSE(k.grad().defined());
  const Tensor rv = v.detach().set_requires_grad();
  composed(q, k, rv, causal()).backward(ones_like(out));
  CHECK(relative_error(v.grad(), rv.grad()) <= 1e-5);
  // No input requires grad: no node.
  CHECK_FALSE(scaled_dot_product_attention(q, k, v.detach()).grad_fn());
}

TEST_CASE("a saved input modified in place stops the backward") {
  Tensor q = leaf({1, 1, 4, 2}, 1, DType::f32), k = leaf({1, 1, 4, 2}, 2, DType::f32);
  Tensor v = leaf({1, 1, 4, 2}, 3, DType::f32);
  const Tensor out = scaled_dot_product_attention(q, k, v);
  {
    autograd::NoGradGuard guard;
    k.mul_(2.0);
  }
  test::check_throws<AutogradError>([&] { sum(out).backward(); },
                                    {"saved by scaled_dot_product_attention", "modified in place"});
}

TEST_CASE("kernel level: q, k, v read through the strides of a [B, T, 3, H, D] projection") {
  // The layout a later zero-copy permute will hand the kernel: q, k, v are [B, H, T, D] views of
  // one qkv buffer with the T stride 3 * H * D; dq, dk, dv are written into such a buffer too.
  const std::int64_t B = 2, T = 70, H = 3, D = 8;
  Backend& backend = default_backend();
  for (DType dtype : {DType::f32, DType::f64, DType::bf16}) {
    for (bool is_causal : {false, true}) {
      CAPTURE(dtype_name(dtype));
      CAPTURE(is_causal);
      const Tensor qkv = randn({B, T, 3, H, D}, 5, 0, Options(dtype));
      // dO as the GPT's backward hands it: [B, H, T, D] stored as [B, T, H, D] (a strided view).
      const Tensor dout = permute(randn({B, T, H, D}, 6, 0, Options(dtype)), {0, 2, 1, 3});
      // The reference: the op on contiguous copies of the same heads (copies: the views alone would
      // take the kernel's strided path too, and compare it with itself).
      auto part = [&](std::int64_t p) {
        return permute(slice(qkv, 2, p, p + 1).reshape({B, T, H, D}), {0, 2, 1, 3}).contiguous();
      };
      const Tensor q = part(0).set_requires_grad(), k = part(1).set_requires_grad(), v = part(2).set_requires_grad();
      AttentionOptions o;
      o.causal = is_causal;
      const Tensor ref = scaled_dot_product_attention(q, k, v, o);
      ref.backward(dout);

      auto strided = [&](const Tensor& buffer, std::int64_t p) {
        View view;
        view.dtype = dtype;
        view.ndim = 4;
        view.data = static_cast<char*>(buffer.data_ptr()) + p * H * D * static_cast<std::int64_t>(dtype_size(dtype));
        view.shape = {B, H, T, D};
        view.strides = {T * 3 * H * D, D, 3 * H * D, 1};
        return view;
      };
      const Tensor out = zeros({B, H, T, D}, Options(dtype));
      const Tensor lse = zeros({B, H, T}, Options(dtype == DType::f64 ? DType::f64 : DType::f32));
      const Tensor grads = full({B, T, 3, H, D}, 99.0, Options(dtype));  // every value overwritten
      AttentionDesc d;
      d.q = strided(qkv, 0);
      d.k = strided(qkv, 1);
      d.v = strided(qkv, 2);
      d.out = out.view();
      d.lse = lse.view();
      d.causal = is_causal;
      d.scale = 1.0 / std::sqrt(static_cast<double>(D));
      backend.attention(d);
      // The same kernel on the same values; only the products' summation order may differ.
      const double tol = dtype == DType::bf16 ? 1e-2 : dtype == DType::f32 ? 1e-6 : 1e-13;
      CHECK(relative_error(out, ref) <= tol);
      d.dout = dout.view();
      d.dq = strided(grads, 0);
      d.dk = strided(grads, 1);
      d.dv = strided(grads, 2);
      backend.attention_backward(d);
      auto grad_part = [&](std::int64_t p) {
        return permute(slice(grads, 2, p, p + 1).reshape({B, T, H, D}), {0, 2, 1, 3});
      };
      CHECK(relative_error(grad_part(0), q.grad()) <= tol);
      CHECK(relative_error(grad_part(1), k.grad()) <= tol);
      CHECK(relative_error(grad_part(2), v.grad()) <= tol);
    }
  }
}

TEST_CASE("fused attention on the heads of a [B, T, 3, H, D] projection, as views, against the composed ops") {
  // The GPT's layout: q, k, v are permuted views of one projection (T stride 3 * H * D), and dO
  // arrives as [B, H, T, D] stored [B, T, H, D]; the oneDNN kernel copies them dense block by
  // block (q and dO once per head in the backward). T = 300 crosses query and key blocks (128
  // rows) and their diagonal chunks (64 rows); B = H = 1 makes the backward split the head over
  // key blocks (fewer heads than threads). The gradients reach the projection through the views.
  const std::int64_t T = 300, D = 16;
  for (const auto& [B, H] : {std::pair<std::int64_t, std::int64_t>{2, 3}, {1, 1}}) {
    for (DType dtype : {DType::f32, DType::bf16, DType::f64}) {
      for (bool is_causal : {true, false}) {
        CAPTURE(B);
        CAPTURE(H);
        CAPTURE(dtype_name(dtype));
        CAPTURE(is_causal);
        const Tensor qkv = randn({B, T, 3, H, D}, 11, 0, Options(dtype)).set_requires_grad();
        auto head = [&](const Tensor& x, std::int64_t p) {
          return permute(squeeze(slice(x, 2, p, p + 1), 2), {0, 2, 1, 3});
        };
        const Tensor q = head(qkv, 0), k = head(qkv, 1), v = head(qkv, 2);
        REQUIRE_FALSE(q.is_contiguous());
        AttentionOptions o;
        o.causal = is_causal;
        const Tensor out = scaled_dot_product_attention(q, k, v, o);
        const Tensor dout = permute(randn({B, T, H, D}, 12, 0, Options(dtype)), {0, 2, 1, 3});
        REQUIRE(dout.is_contiguous() == (H == 1));  // one head: [B, T, 1, D] is [B, 1, T, D] already
        out.backward(dout);

        const DType ref_dtype = dtype == DType::f64 ? DType::f64 : DType::f32;
        const Tensor rqkv = qkv.detach().to(ref_dtype).set_requires_grad();
        const Tensor ref =
            composed(head(rqkv, 0).contiguous(), head(rqkv, 1).contiguous(), head(rqkv, 2).contiguous(), o);
        ref.backward(dout.to(ref_dtype).contiguous());
        const double tol = tolerance(dtype);
        CHECK(relative_error(out, ref) <= tol);
        CHECK(relative_error(qkv.grad(), rqkv.grad()) <= tol);
      }
    }
  }
}

TEST_CASE("qkvpacked attention gives the three-part op's output and gradients, bit for bit") {
  // The same kernel on the same values: only where the gradients land differs (one packed
  // [B, T, 3, H, D] tensor instead of three gathered into one by the slices' backward). T = 300
  // crosses blocks and diagonal chunks; B = H = 1 splits the head over key blocks; dropout draws
  // the same [B, H, T, T] mask. The packed output is [B, T, H, D]: the permuted three-part one.
  const std::int64_t T = 300, D = 16;
  for (const auto& [B, H] : {std::pair<std::int64_t, std::int64_t>{2, 3}, {1, 1}}) {
    for (DType dtype : kDTypes) {
      for (double p : {0.0, 0.25}) {
        for (bool is_causal : {true, false}) {
          CAPTURE(B);
          CAPTURE(H);
          CAPTURE(dtype_name(dtype));
          CAPTURE(p);
          CAPTURE(is_causal);
          AttentionOptions o;
          o.causal = is_causal;
          o.dropout = p;
          o.seed = 5;
          o.offset = 17;
          const Tensor x = randn({B, T, 3, H, D}, 21, 0, Options(dtype));
          const Tensor dout = randn({B, T, H, D}, 22, 0, Options(dtype));
          const Tensor packed_in = x.clone().set_requires_grad();
          const Tensor packed = scaled_dot_product_attention_qkvpacked(packed_in, o);
          REQUIRE(packed.shape() == Shape{B, T, H, D});
          packed.backward(dout);

          const Tensor parts_in = x.clone().set_requires_grad();
          auto head = [&](std::int64_t part) {
            return permute(squeeze(slice(parts_in, 2, part, part + 1), 2), {0, 2, 1, 3});
          };
          const Tensor parts = scaled_dot_product_attention(head(0), head(1), head(2), o);
          parts.backward(permute(dout, {0, 2, 1, 3}));
          CHECK(relative_error(packed, permute(parts, {0, 2, 1, 3})) == 0.0);
          CHECK(relative_error(packed_in.grad(), parts_in.grad()) == 0.0);
        }
      }
    }
  }
}

TEST_CASE("qkvpacked attention: strided qkv and output gradient, gradcheck, typed errors, empty shapes") {
  using test::check_throws;
  // A qkv whose parts are not in the [B, T, 3, H, D] storage order (a permuted [3, B, T, H, D]
  // tensor) and a strided output gradient: the kernel reads both through their strides.
  {
    const Tensor base = randn({3, 2, 40, 2, 8}, 31).set_requires_grad();
    const Tensor qkv = permute(base, {1, 2, 0, 3, 4});
    REQUIRE_FALSE(qkv.is_contiguous());
    const Tensor out = scaled_dot_product_attention_qkvpacked(qkv, causal());
    const Tensor dout = permute(randn({2, 40, 8, 2}, 32), {0, 1, 3, 2});  // [B, T, H, D], D strided
    out.backward(dout);
    const Tensor ref_in = base.detach().clone().set_requires_grad();
    const Tensor ref_qkv = permute(ref_in, {1, 2, 0, 3, 4});
    auto head = [&](std::int64_t part) { return permute(select_part(ref_qkv, part), {0, 2, 1, 3}).contiguous(); };
    const Tensor ref = composed(head(0), head(1), head(2), causal());
    ref.backward(permute(dout, {0, 2, 1, 3}).contiguous());
    CHECK(relative_error(out, permute(ref, {0, 2, 1, 3})) <= 1e-5);
    CHECK(relative_error(base.grad(), ref_in.grad()) <= 1e-5);
  }
  // Gradcheck in f64, causal with dropout and a custom scale.
  {
    AttentionOptions o = causal();
    o.dropout = 0.3;
    o.seed = 9;
    o.scale = 0.7;
    const Tensor qkv = uniform({1, 5, 3, 2, 3}, -1.5, 1.5, 41, 0, DType::f64).set_requires_grad();
    const GradcheckResult r = gradcheck(
        [&](const std::vector<Tensor>& in) { return scaled_dot_product_attention_qkvpacked(in[0], o); }, {qkv});
    CHECK_MESSAGE(r.ok, r.message);
  }
  check_throws<ShapeError>(
      [] {
        scaled_dot_product_attention_qkvpacked(randn({2, 4, 3, 2}, 1));
      },
      {"scaled_dot_product_attention_qkvpacked", "[batch, time, 3, heads, dim]", "[2, 4, 3, 2]"});
  check_throws<ShapeError>(
      [] {
        scaled_dot_product_attention_qkvpacked(randn({2, 4, 2, 2, 8}, 1));
      },
      {"scaled_dot_product_attention_qkvpacked", "[2, 4, 2, 2, 8]"});
  check_throws<ShapeError>(
      [] {
        scaled_dot_product_attention_qkvpacked(zeros({1, 2, 3, 2, 0}));
      },
      {"scaled_dot_product_attention_qkvpacked", "head dimension", "qkv [1, 2, 3, 2, 0]"});
  check_throws<DTypeError>(
      [] {
        scaled_dot_product_attention_qkvpacked(zeros({1, 2, 3, 2, 4}, DType::i64));
      },
      {"scaled_dot_product_attention_qkvpacked", "i64", "[1, 2, 3, 2, 4]"});
  check_throws<ArgumentError>([] { scaled_dot_product_attention_qkvpacked(Tensor()); },
                              {"scaled_dot_product_attention_qkvpacked", "undefined"});
  {
    AttentionOptions o;
    o.dropout = 1.0;
    check_throws<ArgumentError>(
        [&] {
          scaled_dot_product_attention_qkvpacked(randn({1, 2, 3, 1, 4}, 1), o);
        },
        {"scaled_dot_product_attention_qkvpacked", "dropout probability"});
  }
  // An empty batch, or no heads: an empty output, and a gradient of the right shape. (With no heads
  // the parts' views carry stride 0 on their other axes; writing nothing through them is fine.)
  for (const Shape& shape : {Shape{0, 4, 3, 2, 8}, Shape{1, 4, 3, 0, 8}}) {
    CAPTURE(to_string(shape));
    const Tensor empty_in = zeros(shape).set_requires_grad();
    const Tensor out = scaled_dot_product_attention_qkvpacked(empty_in, causal());
    CHECK(out.shape() == Shape{shape[0], shape[1], shape[3], shape[4]});
    out.backward(zeros_like(out));
    CHECK(empty_in.grad().shape() == empty_in.shape());
  }
}

TEST_CASE("gradcheck in f64: causal, Tq != Tk, custom scale, dropout") {
  auto in = [](const Shape& s, std::uint64_t seed) {
    return uniform(s, -1.5, 1.5, seed, 0, DType::f64).set_requires_grad();
  };
  const Tensor q = in({1, 2, 4, 3}, 1), k = in({1, 2, 6, 3}, 2), v = in({1, 2, 6, 2}, 3);
  for (bool is_causal : {false, true}) {
    for (double p : {0.0, 0.3}) {
      AttentionOptions o;
      o.causal = is_causal;
      o.dropout = p;
      o.seed = 11;
      o.scale = is_causal ? 0.8 : std::optional<double>{};
      CAPTURE(is_causal);
      CAPTURE(p);
      const GradcheckResult r = gradcheck(
          [&](const std::vector<Tensor>& x) { return scaled_dot_product_attention(x[0], x[1], x[2], o); }, {q, k, v});
      CHECK_MESSAGE(r.ok, r.message);
    }
  }
}

TEST_CASE("fused attention with no key gives zeros, as PyTorch's SDPA, and zero gradients") {
  // It was refused ("needs at least one key"); the kernel alone would divide 0 by an empty softmax.
  for (const bool causal : {false, true}) {
    CAPTURE(causal);
    const Tensor q = randn({1, 2, 3, 4}, 1).set_requires_grad();
    const Tensor k = zeros({1, 2, 0, 4}).set_requires_grad(), v = zeros({1, 2, 0, 5}).set_requires_grad();
    AttentionOptions o;
    o.causal = causal;
    const Tensor out = scaled_dot_product_attention(q, k, v, o);
    CHECK(out.shape() == Shape{1, 2, 3, 5});
    CHECK(sum(abs(out)).item() == 0);
    sum(out * randn({1, 2, 3, 5}, 2)).backward();
    CHECK(sum(abs(q.grad())).item() == 0);
    CHECK(k.grad().shape() == Shape{1, 2, 0, 4});
    CHECK(v.grad().shape() == Shape{1, 2, 0, 5});
  }
  // Packed with time 0: an empty output and gradient.
  const Tensor qkv = zeros({1, 0, 3, 2, 4}).set_requires_grad();
  const Tensor out = scaled_dot_product_attention_qkvpacked(qkv);
  CHECK(out.shape() == Shape{1, 0, 2, 4});
  sum(out).backward();
  CHECK(qkv.grad().shape() == Shape{1, 0, 3, 2, 4});
}

TEST_CASE("fused attention refuses bad inputs with typed errors") {
  const Tensor q = randn({1, 2, 4, 3}, 1), k = randn({1, 2, 6, 3}, 2), v = randn({1, 2, 6, 5}, 3);
  using test::check_throws;
  auto sdpa = [](const Tensor& a, const Tensor& b, const Tensor& c, AttentionOptions o = {}) {
    return scaled_dot_product_attention(a, b, c, o);
  };
  check_throws<ShapeError>(
      [&] {
        sdpa(q.reshape({2, 4, 3}), k, v);
      },
      {"scaled_dot_product_attention", "q must be [batch, heads, time, dim]", "[2, 4, 3]"});
  check_throws<ShapeError>([&] { sdpa(q, k.reshape({2, 6, 3}), v); }, {"k must be", "[2, 6, 3]"});
  check_throws<ShapeError>([&] { sdpa(q, k, randn({1, 2, 6, 5, 1}, 1)); }, {"v must be", "[1, 2, 6, 5, 1]"});
  check_throws<ShapeError>([&] { sdpa(q, randn({2, 2, 6, 3}, 1), v); }, {"batch and heads differ", "[2, 2, 6, 3]"});
  check_throws<ShapeError>([&] { sdpa(q, k, randn({1, 3, 6, 5}, 1)); }, {"batch and heads differ", "[1, 3, 6, 5]"});
  check_throws<ShapeError>(
      [&] {
        sdpa(q, randn({1, 2, 6, 4}, 1), v);
      },
      {"head dimensions differ", "[1, 2, 4, 3]", "[1, 2, 6, 4]"});
  check_throws<ShapeError>([&] { sdpa(q, k, randn({1, 2, 7, 5}, 1)); }, {"lengths differ", "[1, 2, 7, 5]"});
  check_throws<ShapeError>([&] { sdpa(zeros({1, 2, 4, 0}), zeros({1, 2, 6, 0}), v); }, {"head dimension"});
  check_throws<DTypeError>([&] { sdpa(q, k.to(DType::f64), v); }, {"one dtype", "f32", "f64", "[1, 2, 6, 3]"});
  check_throws<DTypeError>([&] { sdpa(q, k, v.to(DType::bf16)); }, {"one dtype", "bf16"});
  check_throws<DTypeError>([&] { sdpa(q.to(DType::i64), k.to(DType::i64), v.to(DType::i64)); },
                           {"scaled_dot_product_attention", "floating-point", "i64"});
  check_throws<ArgumentError>([&] { sdpa(Tensor(), k, v); }, {"scaled_dot_product_attention", "undefined"});
  for (double p : {-0.1, 1.0, std::nan("")}) {
    AttentionOptions o;
    o.dropout = p;
    check_throws<ArgumentError>([&] { sdpa(q, k, v, o); }, {"dropout probability must be in [0, 1)"});
  }
  for (double s : {0.0, -1.0, std::numeric_limits<double>::infinity(), std::nan("")}) {
    AttentionOptions o;
    o.scale = s;
    check_throws<ArgumentError>([&] { sdpa(q, k, v, o); }, {"scale must be finite and positive", "[1, 2, 4, 3]"});
  }
  // Finite as a double but not as the f32 the scores are computed in: NaN outputs without a word.
  for (double s : {1e40, 1e-50}) {
    AttentionOptions o;
    o.scale = s;
    check_throws<ArgumentError>([&] { sdpa(q, k, v, o); }, {"outside f32's range", "f32 attention"});
    check_throws<ArgumentError>([&] { sdpa(q.to(DType::bf16), k.to(DType::bf16), v.to(DType::bf16), o); },
                                {"outside f32's range", "bf16 attention"});
  }
  {
    AttentionOptions o;
    o.scale = 1e40;  // f64 computes in f64, where it is a scale like any other
    const Tensor out = sdpa(q.to(DType::f64), k.to(DType::f64), v.to(DType::f64), o);
    CHECK(out.dtype() == DType::f64);
    CHECK(out.shape()[2] == q.shape()[2]);
  }
  if (available_backends().size() == 1) {
    MESSAGE("one backend built: the mixed-backend error is not reachable here");
  } else {
    Backend& other = get_backend(available_backends()[0]).name() == default_backend().name()
                         ? get_backend(available_backends()[1])
                         : get_backend(available_backends()[0]);
    check_throws<ArgumentError>([&] { sdpa(q, k.to(other), v); }, {"one backend", std::string(other.name())});
  }
}

TEST_CASE("threads running fused attention at once share no state") {
  // Independent graphs on two threads (as emulated ranks run them), each with intra-op threads of
  // its own where OpenMP is built; the TSan preset runs this without OpenMP.
  auto run = [](std::uint64_t seed) {
    AttentionOptions o = causal();
    o.dropout = 0.2;
    o.seed = seed;
    const Tensor q = leaf({2, 2, 70, 8}, seed, DType::f32), k = leaf({2, 2, 300, 8}, seed + 1, DType::f32),
                 v = leaf({2, 2, 300, 8}, seed + 2, DType::f32);
    const Tensor out = scaled_dot_product_attention(q, k, v, o);
    out.backward(ones_like(out));
    return std::vector<Tensor>{out, q.grad(), k.grad(), v.grad()};
  };
  const auto alone0 = run(10), alone1 = run(20);
  std::vector<Tensor> together0, together1;
  std::thread t0([&] { together0 = run(10); }), t1([&] { together1 = run(20); });
  t0.join();
  t1.join();
  for (std::size_t i = 0; i < alone0.size(); ++i) {
    CHECK(relative_error(together0[i], alone0[i]) == 0.0);
    CHECK(relative_error(together1[i], alone1[i]) == 0.0);
  }
}

TEST_CASE("fused attention: weights that underflow, rows of every length, and non-finite inputs") {
  // Scores hundreds apart: most weights round to 0 (the f32 softmax's exp is computed without a
  // clamp below -87); T = 37 gives rows whose visible keys end in every packet lane.
  AttentionOptions steep = causal();
  steep.scale = 40.0;
  for (bool is_causal : {true, false}) {
    steep.causal = is_causal;
    check_all_dtypes({{2, 2, 37, 8}, {2, 2, 37, 8}, {2, 2, 37, 8}, steep});
  }

  // A NaN in one query row and one key: the composed ops' NaNs, and their values elsewhere.
  for (DType dtype : {DType::f32, DType::f64, DType::bf16}) {
    CAPTURE(dtype_name(dtype));
    const Shape shape{1, 2, 20, 8};
    auto with_nan = [&](std::uint64_t seed, std::int64_t at) {
      std::vector<double> values = randn(shape, seed, 0, Options(DType::f64)).to_vector<double>();
      values[static_cast<std::size_t>(at)] = std::nan("");
      return from_vector(values, shape, Options(DType::f64)).to(dtype);
    };
    const Tensor q = with_nan(1, 5 * 8 + 3);           // head 0, query 5
    const Tensor k = with_nan(2, 20 * 8 + 7 * 8 + 1);  // head 1, key 7
    const Tensor v = randn(shape, 3, 0, Options(dtype));
    const DType ref_dtype = dtype == DType::f64 ? DType::f64 : DType::f32;
    const auto got = scaled_dot_product_attention(q, k, v, causal()).to_vector<double>();
    const auto want = composed(q.to(ref_dtype), k.to(ref_dtype), v.to(ref_dtype), causal()).to_vector<double>();
    REQUIRE(got.size() == want.size());
    std::size_t nans = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      CAPTURE(i);
      REQUIRE(std::isnan(got[i]) == std::isnan(want[i]));
      if (std::isnan(want[i])) {
        ++nans;
      } else {
        CHECK(std::abs(got[i] - want[i]) <= tolerance(dtype) * 4);
      }
    }
    // Head 0: query 5's row; head 1: every query from key 7 on (13 rows); 8 values a row.
    CHECK(nans == (1 + 13) * 8);
  }
}

TEST_CASE("empty batch or queries give empty outputs and zero gradients") {
  const Tensor q = leaf({1, 2, 0, 3}, 1, DType::f32), k = leaf({1, 2, 4, 3}, 2, DType::f32);
  const Tensor v = leaf({1, 2, 4, 2}, 3, DType::f32);
  const Tensor out = scaled_dot_product_attention(q, k, v, causal());
  CHECK(out.shape() == Shape{1, 2, 0, 2});
  out.backward(zeros_like(out));
  CHECK(k.grad().shape() == k.shape());
  CHECK(sum(abs(k.grad())).item() == 0.0);
  CHECK(sum(abs(v.grad())).item() == 0.0);
}

TEST_CASE("fused attention's memory is O(T): no [H, T, T] tensor during forward and backward") {
  const std::int64_t B = 1, H = 2, T = 512, D = 16;
  Tensor q = leaf({B, H, T, D}, 1, DType::f32), k = leaf({B, H, T, D}, 2, DType::f32),
         v = leaf({B, H, T, D}, 3, DType::f32);
  const Tensor dout = randn({B, H, T, D}, 4);
  const std::int64_t qkv_bytes = B * H * T * D * 4;  // each of q, k, v, dout and the three gradients
  const std::int64_t scores_bytes = H * T * T * 4;   // one [H, T, T] f32 tensor
  auto extra_peak = [&](auto&& run) {
    q.zero_grad();
    k.zero_grad();
    v.zero_grad();
    memory::Scope scope;
    run();
    // Gradients are allocated inside the scope; q, k, v and dout outside it.
    return scope.stats().peak_bytes - 3 * qkv_bytes;
  };
  const std::int64_t fused = extra_peak([&] { scaled_dot_product_attention(q, k, v, causal()).backward(dout); });
  const std::int64_t composed_bytes = extra_peak([&] { composed(q, k, v, causal()).backward(dout); });
  MESSAGE("peak bytes beyond q, k, v, dout and gradients: fused " << fused << ", composed " << composed_bytes
                                                                  << ", one [H, T, T] f32 tensor " << scores_bytes);
  // The fused op holds the output and the logsumexp, and little else.
  const std::int64_t out_and_lse = qkv_bytes + B * H * T * 4;
  CHECK(fused <= 2 * out_and_lse);
  CHECK(fused * 10 < scores_bytes);
  CHECK(composed_bytes >= scores_bytes);  // what the tracker sees when the weights exist
}

TEST_CASE("worst errors measured (relative to max|value|)") {
  // A report of the cases above (run in file order), each held to its dtype's tolerance again.
  MESSAGE("backend " << default_backend().name() << ": bf16 and f16 cases ran on this CPU, none skipped");
  for (const auto& [what, e] : worst()) {
    MESSAGE(default_backend().name() << " " << what.first << " " << what.second << ": " << e);
    CHECK(e <= tolerance(dtype_from_name(what.first)));
  }
}
