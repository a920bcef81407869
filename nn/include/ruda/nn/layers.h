// Layers: Linear, Embedding, LayerNorm, RMSNorm, Dropout, activations, and the parts of a small
// GPT-style transformer (causal self-attention, MLP, block). Every layer computes with
// Param::value(), so it works unchanged when its parameters are sharded (fully_shard).
#pragma once

#include <memory>

#include <ruda/nn/init.h>
#include <ruda/nn/module.h>
#include <ruda/random.h>

namespace ruda::nn {

struct LinearOptions {
  bool bias = true;
  DType dtype = DType::f32;
};

/// y = x @ weight + bias over any leading axes; weight is [in, out] (not PyTorch's [out, in]).
/// A floating-point x of another dtype is cast to the weight's (as FSDP's mixed precision casts
/// forward inputs to the compute dtype: under ShardPolicy::compute_dtype the gathered weights are
/// bf16 while the data stays f32), so an f64 input to an f32 layer computes in f32; PyTorch raises
/// there. An integer or bool x is a DTypeError.
class Linear : public UnaryModule {
 public:
  Linear(std::int64_t in_features, std::int64_t out_features, LinearOptions options = {});
  Tensor forward(const Tensor& x) override;
  /// gelu(forward(x)) as one op (ruda::linear_gelu): `backward` says whether one [.., out]
  /// tensor (GELU's derivative at the pre-activation) is kept for backward or the pre-activation
  /// recomputed there (one more GEMM, GELU fused into the forward's).
  Tensor forward_gelu(const Tensor& x, GeluApproximation approximation = GeluApproximation::erf,
                      GeluBackward backward = GeluBackward::keep_pre_activation);
  std::int64_t in_features() const noexcept { return in_; }
  std::int64_t out_features() const noexcept { return out_; }
  Param weight, bias;  // bias undefined when disabled

 private:
  std::int64_t in_, out_;
};

struct EmbeddingOptions {
  double std = 1.0;  // weights ~ N(0, std^2)
  DType dtype = DType::f32;
};

/// Rows of a [vocabulary, features] table by i64 indices of any shape.
class Embedding : public UnaryModule {
 public:
  Embedding(std::int64_t vocabulary, std::int64_t features, EmbeddingOptions options = {});
  Tensor forward(const Tensor& indices) override;
  Param weight;
};

/// Normalizes over the last axis: (x - mean) / sqrt(var + eps) * weight + bias. ArgumentError
/// for features <= 0 or an eps that is not finite and >= 0; forward: ShapeError when x's last
/// axis is not `features`. As PyTorch's LayerNorm(features, eps, elementwise_affine, bias):
/// `affine` false has neither parameter, `bias` false a weight alone.
class LayerNorm : public UnaryModule {
 public:
  explicit LayerNorm(std::int64_t features, double eps = 1e-5, bool affine = true, bool bias = true);
  Tensor forward(const Tensor& x) override;
  Param weight, bias;

 private:
  std::int64_t features_;
  double eps_;
};

/// x / sqrt(mean(x^2) + eps) * weight over the last axis. Checked as LayerNorm is.
class RMSNorm : public UnaryModule {
 public:
  explicit RMSNorm(std::int64_t features, double eps = 1e-6);
  Tensor forward(const Tensor& x) override;
  Param weight;

 private:
  std::int64_t features_;
  double eps_;
};

/// Zeroes elements with probability p in training mode (scaling the rest by 1/(1-p)); identity in
/// eval mode. Its draws come from its own counter-based stream (seed and position), which
/// save_checkpoint records and load_checkpoint restores, so a resumed run draws the masks the
/// uninterrupted one would.
///
/// Data-parallel ranks draw their own parts of one stream: fully_shard gives the module's
/// Dropouts their rank r and world size N, and then each call of n values takes N n draws and
/// uses those from r n on, the mask the model on one process would draw for the r-th of N equal
/// parts of the global batch (its rows in order). So sharded training with dropout equals dense
/// training as it does without, and the ranks' masks differ (each drew the same mask for its own
/// samples before: correlated noise, and a run that changed with the world size).
class Dropout : public UnaryModule {
 public:
  explicit Dropout(double p, std::uint64_t seed = next_seed());
  Tensor forward(const Tensor& x) override;
  Generator& generator() noexcept { return generator_; }
  const Generator& generator() const noexcept { return generator_; }
  double p() const noexcept { return p_; }
  /// This rank's part of the stream (fully_shard sets it): rank in [0, world). ArgumentError otherwise.
  void set_data_parallel(int rank, int world);
  /// Reserves the draws of one call of `count` values on every rank and returns the position of
  /// this rank's first (CausalSelfAttention's fused attention draws through it too).
  std::uint64_t take(std::uint64_t count) noexcept;
  /// The stream position of the next take: generator().offset(), or inside nn::checkpoint's
  /// recompute, on that thread, the position the checkpointed forward drew from.
  std::uint64_t next_draw() const noexcept;

 private:
  double p_;
  Generator generator_;
  int rank_ = 0, world_ = 1;
};

class ReLU : public UnaryModule {
 public:
  Tensor forward(const Tensor& x) override;
};
class GELU : public UnaryModule {
 public:
  explicit GELU(GeluApproximation approximation = GeluApproximation::erf) : approximation_(approximation) {
    check_enum(approximation, "GELU", "GeluApproximation");
  }
  Tensor forward(const Tensor& x) override;

 private:
  GeluApproximation approximation_;
};
class SiLU : public UnaryModule {
 public:
  Tensor forward(const Tensor& x) override;
};
class Tanh : public UnaryModule {
 public:
  Tensor forward(const Tensor& x) override;
};
class Sigmoid : public UnaryModule {
 public:
  Tensor forward(const Tensor& x) override;
};

/// Multi-head self-attention with a causal mask over x [batch, time, d_model].
class CausalSelfAttention : public UnaryModule {
 public:
  CausalSelfAttention(std::int64_t d_model, std::int64_t heads, double dropout = 0.0);
  Tensor forward(const Tensor& x) override;
  /// On (the default): ruda::scaled_dot_product_attention_qkvpacked on the qkv projection reshaped
  /// to [B, T, 3, H, head_dim], which keeps O(T) per head for backward.
  /// Off: the composed ops (scores, mask, softmax, dropout, product), which keep the [T, T]
  /// weights; both draw the same dropout mask from the same stream.
  void set_fused(bool on) noexcept { fused_ = on; }
  bool fused() const noexcept { return fused_; }
  std::shared_ptr<Linear> qkv, proj;

 private:
  std::int64_t d_model_, heads_;
  bool fused_ = true;
  std::shared_ptr<Dropout> attn_dropout_, resid_dropout_;
};

/// Linear(d, hidden) -> GELU -> Linear(hidden, d).
class MLP : public UnaryModule {
 public:
  MLP(std::int64_t d_model, std::int64_t hidden, double dropout = 0.0);
  Tensor forward(const Tensor& x) override;
  /// Whether one [.., hidden] tensor of fc1 (GELU's derivative at its pre-activation) is kept for
  /// backward (the default: faster) or the pre-activation
  /// recomputed there (one GEMM more per step, that tensor less from forward to backward).
  void set_gelu_backward(GeluBackward backward);
  std::shared_ptr<Linear> fc1, fc2;

 private:
  std::shared_ptr<Dropout> dropout_;
  GeluBackward gelu_backward_ = GeluBackward::keep_pre_activation;
};

/// Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)). A floating x of another
/// dtype is cast to the layers' (Linear's rule), the residual sum included.
///
/// The composite layers' submodule members (here, CausalSelfAttention's, MLP's and GPT's, whose
/// `blocks` too) are registered as members: assigning another layer to one (a fine-tuning head,
/// a replaced block, blocks.pop_back()) is what parameters(), fully_shard and checkpoints see, as
/// forward does. An optimizer holds the parameters it was built with: build it after the change.
class TransformerBlock : public UnaryModule {
 public:
  TransformerBlock(std::int64_t d_model, std::int64_t heads, std::int64_t mlp_hidden, double dropout = 0.0);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<LayerNorm> ln1, ln2;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<MLP> mlp;
};

struct GPTConfig {
  std::int64_t vocabulary = 256;
  std::int64_t context = 128;
  std::int64_t d_model = 256;
  std::int64_t layers = 4;
  std::int64_t heads = 4;
  double dropout = 0.0;
  /// The output head reuses the token embedding ([vocabulary, d] used as [d, vocabulary]^T).
  bool tied_head = true;
};

/// A GPT-style language model: token + position embeddings, transformer blocks, a final
/// LayerNorm, and an output head (tied to the token embedding or its own Linear).
/// forward: i64 tokens [batch, time] -> logits [batch, time, vocabulary].
class GPT : public UnaryModule {
 public:
  /// ArgumentError for a size that is not positive (layers may be 0), d_model not a multiple of
  /// heads, or dropout outside [0, 1); ShapeError where a parameter's element count overflows.
  explicit GPT(const GPTConfig& config);
  Tensor forward(const Tensor& tokens) override;
  const GPTConfig& config() const noexcept { return config_; }
  /// Runs each block through checkpoint() (<ruda/nn/recompute.h>): only the blocks' inputs stay
  /// alive between forward and backward, and each block's forward runs again in backward.
  void set_activation_checkpointing(bool on) noexcept { activation_checkpointing_ = on; }
  /// MLP::set_gelu_backward on every block.
  void set_gelu_backward(GeluBackward backward) {
    for (const auto& block : blocks) block->mlp->set_gelu_backward(backward);
  }
  /// CausalSelfAttention::set_fused on every block.
  void set_fused_attention(bool on) noexcept {
    for (const auto& block : blocks) block->attn->set_fused(on);
  }
  bool activation_checkpointing() const noexcept { return activation_checkpointing_; }
  std::shared_ptr<Embedding> token_embedding, position_embedding;
  std::vector<std::shared_ptr<TransformerBlock>> blocks;
  std::shared_ptr<LayerNorm> final_norm;
  std::shared_ptr<Linear> head;  // null when tied

 private:
  GPTConfig config_;
  bool activation_checkpointing_ = false;
};

}  // namespace ruda::nn
