// Fused scaled dot-product attention: softmax(scale * q k^T, masked) v without a [T, T] matrix.
#pragma once

#include <cstdint>
#include <optional>

#include <ruda/tensor.h>

namespace ruda {

struct AttentionOptions {
  /// Masks key j for query i when j > i (top-left aligned when Tq != Tk, as PyTorch's is_causal).
  bool causal = false;
  /// Multiplies q k^T before the softmax; 1 / sqrt(D) when not given. Must be finite and positive.
  std::optional<double> scale = std::nullopt;  // (initialized: {.causal = true} is warning-free under -Wextra)
  /// Probability of zeroing each attention weight (the rest scaled by 1 / (1 - dropout)), in [0, 1).
  double dropout = 0.0;
  /// The dropout mask: weight (b, h, i, j) of the [B, H, Tq, Tk] weights is dropped as
  /// ruda::dropout(weights, dropout, seed, offset) drops that element (draw
  /// offset + ((b * H + h) * Tq + i) * Tk + j of stream seed), so a composed reference with the
  /// same seed and offset sees the same mask. A caller drawing again advances offset by B*H*Tq*Tk.
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
};

/// softmax(scale * q k^T + mask) v for q [B, H, Tq, D], k [B, H, Tk, D], v [B, H, Tk, Dv]: one
/// fused kernel (query blocks against streamed key blocks with an online softmax) whose forward
/// keeps only the output [B, H, Tq, Dv] and the logsumexp [B, H, Tq] of each query's scores, and
/// whose backward recomputes the weights block by block: memory O(T) per head, never O(T^2).
/// Float dtypes (f32, f64, bf16, f16), the same for q, k and v; statistics and accumulation in
/// f32 (f64 for f64). Differentiable in q, k and v. q, k and v may be strided views (the permuted
/// heads of a [B, T, 3, H, D] projection are read in place). The output is a view: [B, H, Tq, Dv]
/// stored as [B, Tq, H, Dv], so that permute({0, 2, 1, 3}) and reshape to [B, Tq, H * Dv], which
/// merge the heads, copy nothing. With no key (Tk = 0) the output is 0 and every gradient zero, as
/// PyTorch's SDPA gives; a head dimension of 0 is a ShapeError.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const AttentionOptions& options = {});

/// The same attention over q, k and v packed in one tensor, as a fused qkv projection makes them
/// (FlashAttention's qkvpacked form): qkv [B, T, 3, H, D], part 0 the queries, 1 the keys, 2 the
/// values (a [B, T, 3 * H * D] projection reshaped, which copies nothing). Returns [B, T, H, D]
/// (reshape to [B, T, H * D] merges the heads without a copy). Its backward writes q's, k's and
/// v's gradients into one [B, T, 3, H, D] tensor: the projection's gradient as it is, where
/// attention on three slices hands back three that must be copied into one. Results are those of
/// scaled_dot_product_attention on the three parts (the same kernel, bit for bit), dropout's mask
/// included: the weights are still addressed as [B, H, T, T].
Tensor scaled_dot_product_attention_qkvpacked(const Tensor& qkv, const AttentionOptions& options = {});

}  // namespace ruda
