// Engine suites: GEMM through ruda against Eigen called directly on the same buffers, the
// overhead of one small op with and without autodiff, and one forward+backward of an MLP.
#include <string>

#include <ruda/ruda.h>
#include <Eigen/Core>

#include "bench.h"

namespace ruda::bench {
namespace {

void gemm_suite(Context& ctx) {
  struct Shape3 {
    std::int64_t m, k, n;
  };
  std::vector<Shape3> shapes = {
      {256, 256, 256}, {512, 512, 512}, {1024, 1024, 1024}, {128, 1024, 1024}, {1024, 128, 1024}};
  if (ctx.quick) shapes.resize(2);
  for (const auto& s : shapes) {
    const Tensor a = randn({s.m, s.k}, 1), b = randn({s.k, s.n}, 2);
    Tensor c;
    const double flops = 2.0 * s.m * s.k * s.n;
    const Stats ruda_time = measure(ctx, [&] { c = matmul(a, b); });
    // The peer: Eigen's GEMM on the same row-major buffers, into a preallocated result.
    using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    Eigen::Map<const Matrix> ea(a.data<float>(), s.m, s.k), eb(b.data<float>(), s.k, s.n);
    Matrix ec(s.m, s.n);
    num_threads();  // the same intra-op thread count as ruda's kernels
    const Stats eigen_time = measure(ctx, [&] { ec.noalias() = ea * eb; });
    Result r;
    r.suite = "gemm";
    r.name = "f32 " + std::to_string(s.m) + "x" + std::to_string(s.k) + "x" + std::to_string(s.n) + " (MxKxN)";
    r.backend = ctx.backend;
    r.unit = "GFLOP/s";
    r.value = rate(ruda_time, flops * 1e-9);
    r.peer = rate(eigen_time, flops * 1e-9);
    r.peer_name = "Eigen direct";
    ctx.report(r);
  }
}

void overhead_suite(Context& ctx) {
  const Tensor a = rand({16}, 1), b = rand({16}, 2);
  const Tensor ga = a.clone().set_requires_grad(), gb = b.clone().set_requires_grad();
  constexpr int kOps = 10000;
  auto run = [&](const Tensor& x, const Tensor& y) {
    return measure(ctx, [&] {
      for (int i = 0; i < kOps; ++i) {
        Tensor z = x + y;
      }
    });
  };
  for (bool grad : {false, true}) {
    Result r;
    r.suite = "op-overhead";
    r.name = grad ? "add 16 elements, autodiff on" : "add 16 elements, autodiff off";
    r.backend = ctx.backend;
    r.unit = "ns/op";
    r.value = scaled(grad ? run(ga, gb) : run(a, b), 1e9 / kOps);
    ctx.report(r);
  }
}

void mlp_suite(Context& ctx) {
  // 784-1024-1024-10 with ReLU at batch 128: forward, cross-entropy, backward.
  const std::int64_t batch = 128;
  const Tensor x = rand({batch, 784}, 1);
  const Tensor labels = randint({batch}, 0, 10, 2);
  std::vector<Tensor> params = {randn({784, 1024}, 3) * 0.03,  zeros({1024}),
                                randn({1024, 1024}, 4) * 0.03, zeros({1024}),
                                randn({1024, 10}, 5) * 0.03,   zeros({10})};
  for (auto& p : params) p = p.detach().set_requires_grad();
  auto step = [&] {
    Tensor h = relu(linear(x, params[0], params[1]));
    h = relu(linear(h, params[2], params[3]));
    const Tensor logits = linear(h, params[4], params[5]);
    const Tensor loss = -mean(take_along_axis(log_softmax(logits, 1), labels.unsqueeze(1), 1));
    for (auto& p : params) p.zero_grad();
    loss.backward();
  };
  Result r;
  r.suite = "mlp";
  r.name = "784-1024-1024-10 fwd+bwd, batch 128";
  r.backend = ctx.backend;
  r.unit = "ms";
  r.value = scaled(measure(ctx, step, 3), 1e3);
  ctx.report(r);
}

// LayerNorm forward+backward on 16-bit activations with f32 parameters (the GPT's shape, [2048,
// 256]): layer_norm's mixed form, which nn::LayerNorm uses, against casting x to f32 and the
// result back around the f32 kernel (what nn::LayerNorm did before; the same bits, two passes
// more each way).
void layer_norm_suite(Context& ctx) {
  const std::int64_t rows = ctx.quick ? 512 : 2048, features = 256;
  const Tensor w = (randn({features}, 3) + 1.0).set_requires_grad(), b = randn({features}, 4).set_requires_grad();
  for (DType dtype : {DType::bf16, DType::f16}) {
    const Tensor x0 = randn({rows, features}, 1).to(dtype), g = randn({rows, features}, 2).to(dtype);
    auto step = [&](bool mixed) {
      const Tensor x = x0.detach().set_requires_grad();
      const Tensor y = mixed ? layer_norm(x, w, b) : layer_norm(x.to(DType::f32), w, b).to(dtype);
      y.backward(g);
    };
    const auto [with_mixed, with_casts] = measure_pair(
        ctx, [&] { step(true); }, [&] { step(false); });
    Result r;
    r.suite = "layer-norm";
    r.name = "fwd+bwd [" + std::to_string(rows) + ", " + std::to_string(features) + "] " +
             std::string(dtype_name(dtype)) + ", f32 weight and bias";
    r.backend = ctx.backend;
    r.unit = "us";
    r.value = scaled(with_mixed, 1e6);
    r.peer = scaled(with_casts, 1e6);
    r.peer_name = "x cast to f32 and the result back";
    ctx.report(r);
  }
}

// Memory-bound kernels against a copy of the same bytes in the same run (a.clone(), or for a
// reduction the sum, which reads them once): "ratio" near 1 means the kernel runs at the
// memory's speed. Two move other bytes than their peer: where reads both operands and the mask
// (13 bytes an f32 element, 7 a bf16 one, against the copy's 8 or 4: ~1.6-1.75 at memory speed),
// and fill only writes (half its peer's bytes: ~0.5 at memory speed). Rows for kernels that once ran far below it:
// where (a data-dependent branch), max (a scalar loop), logsumexp (one std::exp a value), a transposing copy (a cache
// miss a value), a bf16 fill (std::fill over 16-bit structs), LayerNorm's backward (a second pass), a softmax over the
// first axis (a line gathered at a time, against the last axis), an add of two transposed operands (a value a cache
// line, against contiguous ones); and exp, against Eigen's own exp of the same values.
void kernels_suite(Context& ctx) {
  const std::int64_t rows = ctx.quick ? 512 : 2048, cols = 1024;
  for (DType dtype : {DType::f32, DType::bf16}) {
    const std::string suffix =
        " [" + std::to_string(rows) + ", " + std::to_string(cols) + "] " + std::string(dtype_name(dtype));
    const Tensor a = randn({rows, cols}, 1).to(dtype), b = randn({rows, cols}, 2).to(dtype);
    const Tensor keep = gt(randn({rows, cols}, 3), zeros({}));  // random: a branch would mispredict
    Tensor filled = zeros({rows, cols}, dtype);
    auto row = [&](const std::string& name, auto&& kernel, auto&& peer, const std::string& peer_name) {
      const auto [ours, theirs] = measure_pair(ctx, kernel, peer);
      report_time(ctx, "kernels", name + suffix, ours, theirs, peer_name, "us", 1e6);
    };
    auto copy = [&] { (void)a.clone(); };
    auto sum_all = [&] { (void)sum(a); };
    row(
        "where", [&] { (void)where(keep, a, b); }, copy, "a copy of one operand");
    row(
        "max of all", [&] { (void)max(a); }, sum_all, "sum of all");
    row(
        "logsumexp over rows", [&] { (void)logsumexp(a, {1}); }, [&] { (void)sum(a, {1}); }, "sum over rows");
    // Over the first axis: a strided line per column, one std::exp a value, before it folded rows.
    row(
        "logsumexp over columns", [&] { (void)logsumexp(a, {0}); }, [&] { (void)sum(a, {0}); }, "sum over columns");
    row(
        "transpose to contiguous", [&] { (void)transpose(a, 0, 1).contiguous(); }, copy, "a copy");
    row(
        "fill", [&] { filled.fill_(0.0); }, [&] { filled.copy_(a); }, "a copy into the same tensor");
    // dropout's forward, its mask made in one pass from the draws' words, against the ops it
    // was composed of before (rand's f32 draws, a comparison, a cast, and the same two products).
    std::uint64_t draw = 0;
    row(
        "dropout 0.1",
        [&] {
          (void)dropout(a, 0.1, 7, draw);
          draw += static_cast<std::uint64_t>(a.numel());
        },
        [&] {
          const Tensor draws = rand(a.shape(), 7, draw);
          draw += static_cast<std::uint64_t>(a.numel());
          (void)((a * cast(ge(draws, 0.1), dtype)) * (1.0 / 0.9));
        },
        "rand, ge, cast and the products (the composed mask)");
    // add_ with an alpha (SGD's update, weight decay) in one pass, against what it did before:
    // the operand scaled into a temporary, then added.
    row(
        "add_ with an alpha", [&] { filled.add_(b, -0.01); }, [&] { filled.add_(b * -0.01); },
        "b * alpha into a temporary, then add_");
    // Softmax over the first axis (lines `cols` apart), forward and backward, against the same
    // over the last: it gathered a line at a time, a cache line a value (3.9-7.1x PyTorch's time).
    Tensor leaf = a.detach().set_requires_grad();
    auto softmax_step = [&](std::int64_t axis) {
      return [&, axis] {
        softmax(leaf, axis).backward(b);
        leaf.zero_grad();
      };
    };
    row("softmax fwd+bwd over axis 0", softmax_step(0), softmax_step(1), "the same over axis 1");
    // Two transposed operands (x.T + y.T): read a value a cache line before it went in tiles.
    const Tensor at = a.transpose(0, 1), bt = b.transpose(0, 1);
    row(
        "add of two transposed operands", [&] { (void)(at + bt); }, [&] { (void)(a + b); },
        "the same add of contiguous ones");
    // A sum over the rows of a transposed matrix: copied contiguous first, it took the copy's time
    // and a buffer of the matrix's size beside the reduction; now it reduces the columns in place.
    row(
        "sum over rows of a transposed matrix", [&] { (void)sum(at, {1}); }, [&] { (void)sum(a, {0}); },
        "the same sum over columns of the matrix itself");
  }
  // f16 against bf16, op for op, in the same run: both compute in f32, so the ratio is what the
  // f16 conversions cost beyond bf16's (a shift). They were written with branches, and no loop
  // over f16 values vectorized: relu 26x bf16's time, a sum over rows 16x, a cast from f32 8x.
  {
    const std::string shape = " [" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
    const Tensor wide = randn({rows, cols}, 9), other = randn({rows, cols}, 10);
    const Tensor h = wide.to(DType::f16), h2 = other.to(DType::f16), bf = wide.to(DType::bf16),
                 bf2 = other.to(DType::bf16);
    auto row = [&](const std::string& name, auto&& f16_kernel, auto&& bf16_kernel) {
      const auto [ours, theirs] = measure_pair(ctx, f16_kernel, bf16_kernel);
      report_time(ctx, "kernels", "f16 " + name + shape, ours, theirs, "the same in bf16", "us", 1e6);
    };
    row(
        "relu", [&] { (void)relu(h); }, [&] { (void)relu(bf); });
    row(
        "add", [&] { (void)(h + h2); }, [&] { (void)(bf + bf2); });
    row(
        "sum over rows", [&] { (void)sum(h, {1}); }, [&] { (void)sum(bf, {1}); });
    row(
        "cast from f32", [&] { (void)wide.to(DType::f16); }, [&] { (void)wide.to(DType::bf16); });
    row(
        "cast to f32", [&] { (void)h.to(DType::f32); }, [&] { (void)bf.to(DType::f32); });
  }
  // exp over f32 values (a GELU derivative's, a softmax's) against Eigen's own exp of the same
  // values into a fresh array, on as many threads, alternated: ruda's takes pexp's steps but
  // scales by 2^m in one multiply where every lane lies in [-87, 88] (Eigen's pldexp splits it
  // into four factors).
  {
    const Tensor values = randn({rows, cols}, 8);
    const float* data = values.data<float>();
    const auto n = static_cast<Eigen::Index>(values.numel());
    const int threads = num_threads();
    const auto [ours, eigen] = measure_pair(
        ctx, [&] { (void)exp(values); },
        [&] {
          Eigen::ArrayXf out(n);
#pragma omp parallel for num_threads(threads)
          for (int t = 0; t < threads; ++t) {
            const Eigen::Index begin = n * t / threads, end = n * (t + 1) / threads;
            out.segment(begin, end - begin) = Eigen::Map<const Eigen::ArrayXf>(data + begin, end - begin).exp();
          }
          volatile float first = out[0];  // (the result is used: its computation stays)
          (void)first;
        });
    report_time(ctx, "kernels", "exp [" + std::to_string(rows) + ", " + std::to_string(cols) + "] f32", ours, eigen,
                "Eigen's exp of the same values", "us", 1e6);
  }
  // LayerNorm's backward on the default GPT's shape, against a copy of what it reads (x and dy).
  const Tensor x0 = randn({rows, 256}, 4), gy = randn({rows, 256}, 5);
  Tensor w = (randn({256}, 6) + 1.0).set_requires_grad(), bias = randn({256}, 7).set_requires_grad();
  Tensor x = x0.detach().set_requires_grad();
  const auto [backward, copies] = measure_pair(
      ctx,
      [&] {
        // (Cleared, or every backward after the first added its gradients into the last ones'.)
        x.zero_grad();
        w.zero_grad();
        bias.zero_grad();
        const Tensor y = layer_norm(x, w, bias);
        y.backward(gy);
      },
      [&] {
        (void)layer_norm(x0, w.detach(), bias.detach());
        (void)x0.clone();
        (void)gy.clone();
      });
  report_time(ctx, "kernels", "layer_norm fwd+bwd [" + std::to_string(rows) + ", 256] f32", backward, copies,
              "its forward and copies of x and dy", "us", 1e6);

  // take_along_axis on a middle axis (64 of the 1024 positions of [8, 1024, 256], a token
  // selection), forward and backward, against the axis moved last, taken there and moved back
  // (three transposing copies: how ruda took a leading axis, 3-4.6x PyTorch's gather).
  for (DType dtype : {DType::f32, DType::bf16}) {
    const std::int64_t positions = ctx.quick ? 256 : 1024;
    Tensor from = randn({8, positions, 256}, 8).to(dtype).set_requires_grad();
    const Tensor picked = randint({8, 64, 256}, 0, positions, 9);
    auto step = [&](auto&& take) {
      return [&, take] {
        from.zero_grad();
        take().sum().backward();
      };
    };
    const auto [direct, moved] = measure_pair(
        ctx, step([&] { return take_along_axis(from, picked, 1); }), step([&] {
          return transpose(take_along_axis(transpose(from, 1, 2), transpose(picked, 1, 2), 2), 1, 2).contiguous();
        }));
    report_time(ctx, "kernels",
                "take_along_axis fwd+bwd axis 1, 64 of [8, " + std::to_string(positions) + ", 256] " +
                    std::string(dtype_name(dtype)),
                direct, moved, "the axis moved last and back", "us", 1e6);
  }
}

const bool registered = register_suite("gemm", gemm_suite) && register_suite("op-overhead", overhead_suite) &&
                        register_suite("mlp", mlp_suite) && register_suite("layer-norm", layer_norm_suite) &&
                        register_suite("kernels", kernels_suite);

}  // namespace
}  // namespace ruda::bench
