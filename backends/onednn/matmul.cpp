// GEMM on oneDNN's matmul primitive: 2-D or batched (batch strides from the GemmDesc, a stride of
// 0 as a broadcast batch dimension of 1), transposes expressed as memory-descriptor strides (no
// copies), bias fused, alpha as output scales, beta as a sum post-op. bf16 runs natively on CPUs
// with bf16 instructions (f32 accumulation, f32 or bf16 output) and is computed in f32 elsewhere.
#include <algorithm>
#include <optional>
#include <string_view>
#include <vector>

#include "context.h"
#include "eigen/kernel_util.h"
#include "onednn.h"
#include "onednn_backend.h"

namespace ruda::onednn {

using namespace detail;
using dnnl::memory;

namespace {

// A bias given with alpha != 1 goes in as a binary post-op after the scaling: oneDNN's output
// scales multiply the fused bias too (dst = alpha * (A B + bias)), while GemmDesc adds it unscaled.
bool bias_as_post_op(const GemmDesc& d) { return d.bias != nullptr && d.alpha != 1.0f; }

// Whether C's matrices do not follow one another densely (rows of ldc): a batch stride other
// than the matrix's m ldc elements (or, over two batch axes, than the inner axis' extent times that).
bool c_has_gaps(const GemmDesc& d) {
  if (d.batch <= 1) return false;
  const std::int64_t matrix = d.m * d.ld_c();
  if (d.batch_inner > 1) {
    return d.inner_stride_c != matrix || (d.batch > d.batch_inner && d.batch_stride_c != d.batch_inner * matrix);
  }
  return d.batch_stride_c != matrix;
}

int bias_arg(const GemmDesc& d) {
  if (!bias_as_post_op(d)) return DNNL_ARG_BIAS;
  return DNNL_ARG_ATTR_MULTIPLE_POST_OP(d.beta != 0.0f ? 1 : 0) | DNNL_ARG_SRC_1;
}

// A matrix-vector product (one row or one column of output: a decode step's projections, a
// batch of one) takes the gemm path in f32 and native bf16 alike: it has a GEMV kernel, brgemm
// computes a whole block of rows. Zen 4, 2 threads, the two paths alternated in a scratch survey
// (2026-12-06; median of 40 calls each): bf16 [1, 4096] x [4096, 4096] 0.60 ms against brgemm's
// 2.6-3.0 (2.1x PyTorch's time through ruda), [1, 768] x [768, 3072] 0.038-0.050 against
// 0.113-0.128, [4096, 4096] x [4096, 1] 0.37 against 3.05; f32 with B transposed, which kept
// brgemm below, 1.49 against 3.24. From 2 rows on the two paths are within 0.8-1.5x either way.
bool is_matrix_vector(const GemmDesc& d) {
  const bool f32 = d.a_dtype == DType::f32 && d.b_dtype == DType::f32 && d.c_dtype == DType::f32;
  const bool bf16 =
      d.a_dtype == DType::bf16 && d.b_dtype == DType::bf16 && (d.c_dtype == DType::bf16 || d.c_dtype == DType::f32);
  return d.batch == 1 && (d.m == 1 || d.n == 1) && (f32 || bf16);
}

// f32 2-D products run on oneDNN's gemm path (gemm:jit) rather than the brgemm path it ranks
// first, where a survey found the gemm path faster: with A and B as stored always; with A
// transposed (weight gradients) when the output has 2048 rows or columns; with B transposed (input
// gradients) when the output is wider than the inner dimension and has 512 rows or more. oneDNN
// 2.6.3's f32 brgemm with plain row-major weights collapses on some widths: [1024, 768] x
// [768, 3072] (GPT-2-small's fc1) at 179 GFLOP/s against gemm:jit's 378 on 2 threads (86 against
// 199 on one), its weight gradient x^T dy (x [1024, 768], dy [1024, 3072]) at 158 against 371,
// N = 2560 at 257 against 382; the gemm path held 350-383 on every width measured. Two scratch
// surveys on a 2-core Xeon with AMX, where oneDNN picked brg:avx512_core for f32 (2026-12-05:
// median of 6 runs of 5 products, filled buffers; 2026-12-06: the linear shapes of the three
// models of `ruda-bench --suite models` and ten others, the two paths alternated, median of 8
// runs, random buffers), gemm:jit's speed over brgemm's:
//   A and B as stored, 32 shapes from [128, 784] x [784, 1024] to [4096, 256] x [256, 1024]:
//     1.01-2.2x
//   A transposed: 2048 or more output columns 1.10-2.45x; 2048 or more rows 0.97-1.09x (1.09 on
//     GPT-2-small's fc2 h^T dy, h [1024, 3072], dy [1024, 768]); smaller outputs 0.84-1.16x (0.84
//     on the default GPT's fc2 h^T dy, h [2048, 1024], dy [2048, 256]), so those keep brgemm
//   B transposed: wider than the inner dimension with 512 rows or more 1.03-1.11x (1.11 on
//     GPT-2-small's fc2 input gradient dy w^T, dy [1024, 768], w [3072, 768]); fewer rows
//     0.90-0.98x; as wide as the inner dimension or narrower 0.79-1.03x (0.89-0.90 on the fc1
//     input gradients, dy [T, 4d], w [d, 4d]), so those keep brgemm
// Batched products (not measured) and native 16-bit ones (AMX and avx512_core_bf16 brgemm) keep
// oneDNN's first choice too, matrix-vector products aside (is_matrix_vector); bf16 products on CPUs without bf16
// instructions are computed as f32 products (gemm_bf16_in_f32 below), which this rule covers. `ruda-bench --suite
// gemm-onednn` times the two paths on such shapes, to re-check the rule on another CPU.
bool prefers_gemm_path(const GemmDesc& d) {
  if (is_matrix_vector(d)) return true;
  if (d.a_dtype != DType::f32 || d.b_dtype != DType::f32 || d.c_dtype != DType::f32 || d.batch != 1) return false;
  if (d.trans_a && d.trans_b) return false;
  if (d.trans_a) return std::max(d.m, d.n) >= 2048;
  if (d.trans_b) return d.n > d.k && d.m >= 512;
  return true;
}

std::shared_ptr<const Primitive> matmul_primitive(const GemmDesc& d) {
  const bool two_axes = d.batch_inner > 1;
  const bool batched = d.batch > 1;
  Key key;
  key << std::int64_t{1} << static_cast<std::int64_t>(d.a_dtype) << static_cast<std::int64_t>(d.b_dtype)
      << static_cast<std::int64_t>(d.c_dtype) << d.m << d.n << d.k << std::int64_t{d.trans_a} << std::int64_t{d.trans_b}
      << std::int64_t{d.bias != nullptr} << d.alpha << d.beta << static_cast<std::int64_t>(d.epilogue) << d.ld_a()
      << d.ld_b() << d.ld_c();
  if (batched) key << d.batch << d.batch_stride_a << d.batch_stride_b << d.batch_stride_c;
  if (two_axes) key << d.batch_inner << d.inner_stride_a << d.inner_stride_b << d.inner_stride_c;

  const double flops = 2.0 * static_cast<double>(d.batch) * static_cast<double>(d.m) * static_cast<double>(d.n) *
                       static_cast<double>(d.k);
  return lookup(key, threads_for_flops(flops), [&] {
    const auto at = *dnnl_type(d.a_dtype), bt = *dnnl_type(d.b_dtype), ct = *dnnl_type(d.c_dtype);
    const memory::dim m = d.m, n = d.n, k = d.k;
    // Row-major operands with their row strides; a transposed one is the same buffer read with
    // swapped strides.
    const memory::dim lda = d.ld_a(), ldb = d.ld_b(), ldc = d.ld_c();
    memory::dims a_dims{m, k}, a_strides{d.trans_a ? 1 : lda, d.trans_a ? lda : 1};
    memory::dims b_dims{k, n}, b_strides{d.trans_b ? 1 : ldb, d.trans_b ? ldb : 1};
    memory::dims c_dims{m, n}, c_strides{ldc, 1};
    memory::dims bias_dims{1, n}, bias_strides{n, 1};
    // Batch axes, outermost first: a stride of 0 is a broadcast axis of extent 1. A broadcast
    // axis still needs a stride that oneDNN accepts: that of the dense matrix block.
    auto add_axis = [](memory::dims& dims, memory::dims& strides, memory::dim extent, memory::dim stride,
                       memory::dim block) {
      dims.insert(dims.begin(), stride ? extent : 1);
      strides.insert(strides.begin(), stride ? stride : block);
    };
    if (batched) {
      const memory::dim inner = two_axes ? d.batch_inner : 1, outer = d.batch / inner;
      const memory::dim a_block = d.span_a(), b_block = d.span_b(), c_block = d.span_c();
      if (two_axes) {
        add_axis(a_dims, a_strides, inner, d.inner_stride_a, a_block);
        add_axis(b_dims, b_strides, inner, d.inner_stride_b, b_block);
        add_axis(c_dims, c_strides, inner, d.inner_stride_c, c_block);
        bias_dims.insert(bias_dims.begin(), 1);
        bias_strides.insert(bias_strides.begin(), n);
      }
      add_axis(a_dims, a_strides, outer, d.batch_stride_a, a_block);
      add_axis(b_dims, b_strides, outer, d.batch_stride_b, b_block);
      add_axis(c_dims, c_strides, outer, d.batch_stride_c, c_block);
      bias_dims.insert(bias_dims.begin(), 1);
      bias_strides.insert(bias_strides.begin(), n);
    }
    const memory::desc a_md(a_dims, at, a_strides), b_md(b_dims, bt, b_strides), c_md(c_dims, ct, c_strides);
    const memory::desc bias_md(bias_dims, ct, bias_strides);

    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (d.alpha != 1.0f) attr.set_output_scales(0, {d.alpha});
    dnnl::post_ops ops;
    if (d.beta != 0.0f) ops.append_sum(d.beta);
    if (bias_as_post_op(d)) ops.append_binary(dnnl::algorithm::binary_add, bias_md);
    switch (d.epilogue) {
      case GemmEpilogue::none:
        break;
      case GemmEpilogue::gelu_erf:
        ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_gelu_erf, 0.0f, 0.0f);
        break;
      case GemmEpilogue::gelu_tanh:
        ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_gelu_tanh, 0.0f, 0.0f);
        break;
    }
    attr.set_post_ops(ops);

    const bool fused_bias = d.bias && !bias_as_post_op(d);
    const auto desc = fused_bias ? dnnl::matmul::desc(a_md, b_md, bias_md, c_md) : dnnl::matmul::desc(a_md, b_md, c_md);
    const dnnl::matmul::primitive_desc pd = prefers_gemm_path(d)
                                                ? matmul_impl(desc, attr, "gemm:")
                                                : dnnl::matmul::primitive_desc(desc, attr, cpu_engine());
    std::vector<int> args{DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_DST};
    if (d.bias) args.push_back(bias_arg(d));
    return make_primitive(pd, args);
  });
}

// Runs d on oneDNN; false when oneDNN refuses it (the reason is noted).
bool run_matmul(const GemmDesc& d) {
  const auto p = matmul_primitive(d);
  if (p->refused()) {
    note_fallback("gemm", d.a_dtype,
                  p->refusal + " for " + std::to_string(d.batch) + " x [" + std::to_string(d.m) + ", " +
                      std::to_string(d.k) + "] @ [" + std::to_string(d.k) + ", " + std::to_string(d.n) + "]" +
                      (d.trans_a ? " (A transposed)" : "") + (d.trans_b ? " (B transposed)" : "") + " to " +
                      std::string(dtype_name(d.c_dtype)));
    return false;
  }
  if (d.bias) {
    execute(p, {{DNNL_ARG_SRC, d.a}, {DNNL_ARG_WEIGHTS, d.b}, {DNNL_ARG_DST, d.c}, {bias_arg(d), d.bias}});
  } else {
    execute(p, {{DNNL_ARG_SRC, d.a}, {DNNL_ARG_WEIGHTS, d.b}, {DNNL_ARG_DST, d.c}});
  }
  return true;
}

// n bf16 values at p as f32, in a buffer charged to this rank (kernels::WideBuffer).
kernels::WideBuffer widen_bf16(const void* p, std::int64_t n) {
  kernels::WideBuffer out(n, "gemm (bf16 operands widened to f32)");
  const auto* src = static_cast<const bfloat16*>(p);
  kernels::parallel_for(n, kernels::kElementGrain, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) out[i] = to_float(src[i]);
  });
  return out;
}

void narrow_to_bf16(const kernels::WideBuffer& src, void* p) {
  auto* dst = static_cast<bfloat16*>(p);
  kernels::parallel_for(src.size(), kernels::kElementGrain, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) dst[i] = to_bfloat16(src[i]);
  });
}

// bf16 operands on a CPU without bf16 instructions: widen to f32 (exact), multiply in f32 on
// oneDNN, round the result once to nearest even, which is what a native bf16 matmul with f32
// accumulation computes up to summation order.
void gemm_bf16_in_f32(EigenBackend& eigen, const GemmDesc& d) {
  const std::int64_t na = d.span_a(), nb = d.span_b(), nc = d.span_c();
  const kernels::WideBuffer a = widen_bf16(d.a, na), b = widen_bf16(d.b, nb);
  GemmDesc f = d;
  f.a = a.data();
  f.b = b.data();
  f.a_dtype = f.b_dtype = DType::f32;
  if (d.c_dtype == DType::f32) {
    if (!run_matmul(f)) eigen.EigenBackend::gemm(f);
    return;
  }
  // Read back when C has gaps too, so narrowing rewrites them unchanged.
  const bool read_c = d.beta != 0.0f || nc != d.batch * d.m * d.n;
  const kernels::WideBuffer c = read_c ? widen_bf16(d.c, nc) : kernels::WideBuffer(nc, "gemm (bf16 result in f32)");
  if (!read_c) std::fill(c.data(), c.data() + nc, 0.0f);
  std::optional<kernels::WideBuffer> bias;
  if (d.bias) bias.emplace(widen_bf16(d.bias, d.n));
  f.c = c.data();
  f.c_dtype = DType::f32;
  f.bias = bias ? bias->data() : nullptr;
  if (!run_matmul(f)) eigen.EigenBackend::gemm(f);
  narrow_to_bf16(c, d.c);
}

}  // namespace

void OneDnnBackend::gemm(const GemmDesc& d) {
  const bool known = dnnl_type(d.a_dtype) && dnnl_type(d.b_dtype) && dnnl_type(d.c_dtype);
  if (!known || d.a_dtype != d.b_dtype) {
    note_fallback("gemm", d.a_dtype, "oneDNN 2.6 has no CPU matmul for these dtypes");
    return EigenBackend::gemm(d);  // also raises the error for mismatched operands
  }
  if (d.m == 0 || d.n == 0) return;
  if (d.k == 0) {
    note_fallback("gemm", d.a_dtype, "an empty inner dimension (k = 0)");
    return EigenBackend::gemm(d);
  }
  if (d.batch * d.m * d.n * d.k < kMinProduct) {
    note_fallback("gemm", d.a_dtype, kSmallReason);
    return EigenBackend::gemm(d);
  }
  const bool c_shared =
      d.batch > 1 && (d.batch_inner > 1 ? (d.batch_stride_c == 0 || d.inner_stride_c == 0) : d.batch_stride_c == 0);
  // A batch axis along which both operands repeat one matrix: no matmul descriptor says that.
  const bool both_shared =
      d.batch > 1 && ((d.batch_stride_a == 0 && d.batch_stride_b == 0 && d.batch > d.batch_inner) ||
                      (d.batch_inner > 1 && d.inner_stride_a == 0 && d.inner_stride_b == 0));
  if (both_shared || c_shared) {
    // Every batch the same product, or output batches that overlap: no matmul descriptor says that.
    note_fallback("gemm", d.a_dtype,
                  "batch strides with no oneDNN layout (both operands shared, or overlapping outputs)");
    return EigenBackend::gemm(d);
  }
  if (bias_as_post_op(d) && c_has_gaps(d)) {
    // oneDNN 2.6 places a broadcast binary post-op's operand by the output's physical offset:
    // with gaps between the output matrices, every matrix after the first read the bias shifted,
    // past its end (alpha 0.5, n 8, a gap of 3: the second matrix's rows read 4 5 6 7 8 0 0 4e-43).
    note_fallback("gemm", d.a_dtype, "a bias with alpha != 1 on output matrices with gaps between them");
    return EigenBackend::gemm(d);
  }
  if (d.a_dtype == DType::bf16 && !bf16_native()) {
    note_fallback("gemm", d.a_dtype, "no native bf16 on this CPU ISA: computed in f32 by oneDNN");
    return gemm_bf16_in_f32(*this, d);
  }
  if (!run_matmul(d)) EigenBackend::gemm(d);
}

}  // namespace ruda::onednn
