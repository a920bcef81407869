// attention suite: the fused scaled_dot_product_attention against the composed ops it replaces
// (matmul, scale, -inf mask through where, softmax, matmul: nn::CausalSelfAttention's path),
// forward + backward, causal, B 1, H 12, D 64, in f32 and bf16 (16-bit scores and softmax in f32
// in both paths). Time rows: medians, ratio fused / composed. Memory rows: the peak tensor bytes
// during forward + backward beyond q, k, v, dO and their gradients, ratio fused / composed. Then
// the fused op on heads viewed in a computed [B, T, 3, H, D] projection against the same on heads
// copied contiguous first, the qkvpacked op on that projection against the three-part op on its
// heads, and the composed path's scores on such heads read in place.
#include <cmath>
#include <limits>
#include <string>

#include <ruda/ruda.h>

#include "bench.h"

namespace ruda::bench {
void attention_exp_rows(Context& ctx);  // bench_attention_exp.cpp: the softmax's exp pass

namespace {

constexpr std::int64_t kBatch = 1, kHeads = 12, kDim = 64;

Tensor composed(const Tensor& q, const Tensor& k, const Tensor& v) {
  const DType work = q.dtype() == DType::f64 ? DType::f64 : DType::f32;
  const std::int64_t t = q.size(2);
  Tensor s = cast(matmul(q, transpose(k, 2, 3)), work) * (1.0 / std::sqrt(static_cast<double>(q.size(3))));
  const Tensor rows = arange(0, static_cast<double>(t), 1, DType::i64).reshape({t, 1});
  const Tensor cols = arange(0, static_cast<double>(t), 1, DType::i64).reshape({1, t});
  s = where(gt(cols, rows), full({}, -std::numeric_limits<double>::infinity(), work), s);
  return matmul(cast(softmax(s, -1), v.dtype()), v);
}

Tensor fused(const Tensor& q, const Tensor& k, const Tensor& v) {
  AttentionOptions o;
  o.causal = true;
  return scaled_dot_product_attention(q, k, v, o);
}

void attention_suite(Context& ctx) {
  const std::vector<std::int64_t> lengths =
      ctx.quick ? std::vector<std::int64_t>{128, 512} : std::vector<std::int64_t>{128, 512, 1024, 2048};
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (std::int64_t t : lengths) {
      const Shape shape{kBatch, kHeads, t, kDim};
      Tensor q = randn(shape, 1, 0, Options(dtype)).set_requires_grad();
      Tensor k = randn(shape, 2, 0, Options(dtype)).set_requires_grad();
      Tensor v = randn(shape, 3, 0, Options(dtype)).set_requires_grad();
      const Tensor dout = randn(shape, 4, 0, Options(dtype));
      auto step = [&](auto&& attention) {
        q.zero_grad();
        k.zero_grad();
        v.zero_grad();
        attention(q, k, v).backward(dout);
      };
      // The long composed runs take seconds each: fewer repeats there.
      Context c = ctx;
      if (t >= 2048) c.repeats = std::min(c.repeats, 5);
      const std::string name = std::string(dtype_name(dtype)) + " causal fwd+bwd B=1 H=12 D=64 T=" + std::to_string(t);
      // Alternated, so that a change of load between them does not decide the ratio.
      const auto [ours, peer] = measure_pair(
          c, [&] { step(fused); }, [&] { step(composed); }, 1);
      report_time(ctx, "attention", name, ours, peer, "composed ops", "ms", 1e3);

      // Gradients are allocated inside the scope, q, k, v and dO outside it.
      const double grads = 3.0 * static_cast<double>(q.nbytes());
      auto extra_peak = [&](auto&& attention) {
        q.zero_grad();
        k.zero_grad();
        v.zero_grad();
        memory::Scope scope;
        attention(q, k, v).backward(dout);
        return static_cast<double>(scope.stats().peak_bytes) - grads;
      };
      const double fused_bytes = extra_peak(fused), composed_bytes = extra_peak(composed);
      Result r;
      r.suite = "attention";
      r.name = std::string(dtype_name(dtype)) + " peak bytes beyond q,k,v,dO,grads T=" + std::to_string(t);
      r.backend = ctx.backend;
      r.unit = "MB";
      r.value = Stats{fused_bytes / 1e6, fused_bytes / 1e6, fused_bytes / 1e6};
      r.peer = Stats{composed_bytes / 1e6, composed_bytes / 1e6, composed_bytes / 1e6};
      r.peer_name = "composed ops";
      ctx.report(r);
    }
  }
  // The fused op on heads that are strided views of a computed [B, T, 3, H, D] projection, with
  // dO stored [B, T, H, D] (the GPT's layout; the oneDNN kernel copies each block dense for its
  // products), against the same op on heads first copied contiguous (what a kernel without
  // strides needs), forward + backward down to the projection's input in both. Shapes: the
  // default ruda-train GPT's attention (B 16, H 4, T 128) and B 1, H 12, T 1024.
  struct Heads {
    std::int64_t batch, heads, t;
  };
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (const Heads& g : {Heads{16, 4, 128}, Heads{1, 12, 1024}}) {
      if (ctx.quick && g.t > 512) continue;
      Tensor base = randn({g.batch, g.t, 3, g.heads, kDim}, 6, 0, Options(dtype)).set_requires_grad();
      const Tensor dout_packed = randn({g.batch, g.t, g.heads, kDim}, 7, 0, Options(dtype));
      const Tensor dout = dout_packed.permute({0, 2, 1, 3});
      auto head = [](const Tensor& x, std::int64_t p) { return x.slice(2, p, p + 1).squeeze(2).permute({0, 2, 1, 3}); };
      // A computed projection (as the GPT's is): its slices write their gradients into one tensor.
      auto run = [&](bool copy_heads) {
        base.zero_grad();
        const Tensor qkv = base * 1.0;
        auto h = [&](std::int64_t p) { return copy_heads ? head(qkv, p).contiguous() : head(qkv, p); };
        fused(h(0), h(1), h(2)).backward(dout);
      };
      const Stats ours = measure(ctx, [&] { run(false); });
      const Stats peer = measure(ctx, [&] { run(true); });
      report_time(ctx, "attention",
                  std::string(dtype_name(dtype)) +
                      " causal fwd+bwd on heads viewed in a [B, T, 3, H, D] projection B=" + std::to_string(g.batch) +
                      " H=" + std::to_string(g.heads) + " D=64 T=" + std::to_string(g.t),
                  ours, peer, "heads copied contiguous first", "ms", 1e3);
      // The packed op on the same projection against the three-part op on its slices (above),
      // alternated: the same kernel, but its backward writes one [B, T, 3, H, D] gradient where
      // the slices' backward copies three into the projection's.
      const auto [packed, parts] = measure_pair(
          ctx,
          [&] {
            base.zero_grad();
            AttentionOptions o;
            o.causal = true;
            scaled_dot_product_attention_qkvpacked(base * 1.0, o).backward(dout_packed);
          },
          [&] { run(false); });
      report_time(ctx, "attention",
                  std::string(dtype_name(dtype)) + " causal fwd+bwd qkvpacked on a [B, T, 3, H, D] projection B=" +
                      std::to_string(g.batch) + " H=" + std::to_string(g.heads) + " D=64 T=" + std::to_string(g.t),
                  packed, parts, "the three-part op on its heads' views", "ms", 1e3);
    }
  }
  // The fused op with dropout 0.1 on its weights against the same op without, alternated: the
  // cost of the masks, drawn (Philox) in the forward and drawn again in the backward.
  for (DType dtype : {DType::f32, DType::bf16}) {
    const std::int64_t t = ctx.quick ? 512 : 1024;
    const Shape shape{kBatch, kHeads, t, kDim};
    Tensor q = randn(shape, 1, 0, Options(dtype)).set_requires_grad();
    Tensor k = randn(shape, 2, 0, Options(dtype)).set_requires_grad();
    Tensor v = randn(shape, 3, 0, Options(dtype)).set_requires_grad();
    const Tensor dout = randn(shape, 4, 0, Options(dtype));
    auto step = [&](double dropout) {
      q.zero_grad();
      k.zero_grad();
      v.zero_grad();
      AttentionOptions o;
      o.causal = true;
      o.dropout = dropout;
      o.seed = 9;
      scaled_dot_product_attention(q, k, v, o).backward(dout);
    };
    const auto [with_dropout, without] = measure_pair(
        ctx, [&] { step(0.1); }, [&] { step(0.0); });
    report_time(
        ctx, "attention",
        std::string(dtype_name(dtype)) + " causal fwd+bwd with dropout 0.1 B=1 H=12 D=64 T=" + std::to_string(t),
        with_dropout, without, "without dropout", "ms", 1e3);
  }
  // The composed path's scores on heads that are strided views of a [B, T, 3, H, D] projection:
  // the product reads them in place (oneDNN's gemm path for that layout) against copying both
  // operands contiguous first and multiplying those (its brgemm path).
  for (std::int64_t t : lengths) {
    if (t > 1024) continue;
    const Tensor qkv = randn({4, t, 3, kHeads, kDim}, 5);
    const Tensor q = qkv.slice(2, 0, 1).squeeze(2).permute({0, 2, 1, 3});
    const Tensor kt = qkv.slice(2, 1, 2).squeeze(2).permute({0, 2, 3, 1});
    const Stats ours = measure(ctx, [&] { (void)matmul(q, kt); });
    const Stats peer = measure(ctx, [&] { (void)matmul(q.contiguous(), kt.contiguous()); });
    report_time(ctx, "attention",
                "f32 scores q k^T of permuted heads B=4 H=12 D=64 T=" + std::to_string(t) + ", read in place", ours,
                peer, "copied contiguous, then multiplied", "ms", 1e3);
  }
  // The exp pass is the shared kernel's, whichever backend: measured once.
  if (ctx.backend == available_backends().front()) attention_exp_rows(ctx);
}

const bool registered = register_suite("attention", attention_suite);

}  // namespace
}  // namespace ruda::bench
