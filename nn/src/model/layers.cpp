#include <cmath>
#include <limits>

#include <ruda/attention.h>
#include <ruda/autograd.h>
#include <ruda/memory.h>
#include <ruda/nn/layers.h>
#include <ruda/nn/recompute.h>

#include "io/files.h"
#include "model/layer_inputs.h"
#include "model/replay.h"

namespace ruda::nn {

namespace {
using layer_inputs::require_float_input;
using layer_inputs::require_input;
// Layers compute in the dtype of their (possibly gathered, possibly bf16) weights.
Tensor as_dtype(const Tensor& x, DType dtype) { return x.dtype() == dtype ? x : cast(x, dtype); }
}  // namespace

Linear::Linear(std::int64_t in_features, std::int64_t out_features, LinearOptions options)
    : in_(in_features), out_(out_features) {
  if (in_features <= 0 || out_features <= 0) {
    fail<ArgumentError>("Linear", "features must be positive, got ", in_features, " -> ", out_features);
  }
  weight = Param({in_features, out_features}, init::kaiming_uniform(in_features), options.dtype);
  register_parameter("weight", &weight);
  if (options.bias) {
    bias = Param({out_features}, init::kaiming_uniform(in_features), options.dtype);
    register_parameter("bias", &bias);
  }
}

Tensor Linear::forward(const Tensor& x) {
  require_float_input("Linear", x);
  const Tensor w = weight.value();
  return linear(as_dtype(x, w.dtype()), w, bias.defined() ? bias.value() : Tensor());
}

Tensor Linear::forward_gelu(const Tensor& x, GeluApproximation approximation, GeluBackward backward) {
  require_float_input("Linear", x);
  const Tensor w = weight.value();
  return linear_gelu(as_dtype(x, w.dtype()), w, bias.defined() ? bias.value() : Tensor(), approximation,
                     WeightLayout::in_out, backward);
}

Embedding::Embedding(std::int64_t vocabulary, std::int64_t features, EmbeddingOptions options) {
  if (vocabulary <= 0 || features <= 0) {
    fail<ArgumentError>("Embedding", "sizes must be positive, got ", vocabulary, " x ", features);
  }
  weight = Param({vocabulary, features}, init::normal(0.0, options.std), options.dtype);
  register_parameter("weight", &weight);
}

Tensor Embedding::forward(const Tensor& indices) { return embedding(weight.value(), indices); }

namespace {
// A norm layer's arguments (checked at construction, not at the first forward) and its input's last axis.
void check_norm_arguments(const char* layer, std::int64_t features, double eps) {
  if (features <= 0) fail<ArgumentError>(layer, "features must be positive, got ", features);
  if (!(eps >= 0 && std::isfinite(eps))) fail<ArgumentError>(layer, "eps must be finite and non-negative, got ", eps);
}
void check_norm_input(const char* layer, std::int64_t features, const Tensor& x) {
  require_input(layer, x);
  // (The layers cast to f32 and back: an i64 input came back as i64 zeros, never reaching the
  // kernels' own dtype check.)
  if (!is_floating(x.dtype())) {
    fail<DTypeError>(layer, "input ", dtype_name(x.dtype()), " ", x.shape(), " is not a floating-point tensor");
  }
  if (x.ndim() == 0 || x.shape().back() != features) {
    fail<ShapeError>(layer, "input ", x.shape(), " should end in the layer's ", features, " features");
  }
}
}  // namespace

LayerNorm::LayerNorm(std::int64_t features, double eps, bool affine, bool with_bias) : features_(features), eps_(eps) {
  check_norm_arguments("LayerNorm", features, eps);
  if (affine) {
    weight = Param({features}, init::ones());
    register_parameter("weight", &weight);
  }
  if (affine && with_bias) {
    bias = Param({features}, init::zeros());
    register_parameter("bias", &bias);
  }
}

Tensor LayerNorm::forward(const Tensor& input) {
  // Statistics and the affine in f32 at least, whatever the compute dtype. bf16 input goes to the
  // kernel as it is, beside the f32 parameters (layer_norm's mixed form: the same bits as casting
  // it to f32 and the result back, without those two passes and their gradients' two: 0.8x the
  // time at the median of `ruda-bench --suite layer-norm` runs, and no f32 copy of x kept for
  // backward). f16 is still cast: its kernel loads decode each value with branches, on every
  // pass over the row, and the mixed form measured 1.9-3x slower.
  check_norm_input("LayerNorm", features_, input);
  const DType io = input.dtype();
  const DType work = io == DType::f64 ? DType::f64 : DType::f32;
  const Tensor x = io == DType::bf16 ? input : as_dtype(input, work);
  auto affine = [&](const Param& p) { return p.defined() ? as_dtype(p.value(), work) : Tensor(); };
  const Tensor y = layer_norm(x, affine(weight), affine(bias), eps_);
  return as_dtype(y, io);
}

RMSNorm::RMSNorm(std::int64_t features, double eps) : features_(features), eps_(eps) {
  check_norm_arguments("RMSNorm", features, eps);
  weight = Param({features}, init::ones());
  register_parameter("weight", &weight);
}

Tensor RMSNorm::forward(const Tensor& input) {
  check_norm_input("RMSNorm", features_, input);
  const DType io = input.dtype();
  const DType work = io == DType::f64 ? DType::f64 : DType::f32;
  const Tensor x = as_dtype(input, work);
  const Tensor w = as_dtype(weight.value(), work);
  const Tensor mean_square = mean(square(x), {-1}, true);
  // A row whose squares (or their sum) overflow the working dtype, |x| past ~1.8e19 in f32, had
  // an infinite mean square and came out 0 ([1e20, 2e20, 3e20, 4e20] -> 0 0 0 0, gradient 0;
  // LayerNorm's kernel gets such rows right). Then the rows are divided by their largest
  // magnitude m first: x rsqrt(mean(x^2) + eps) = (x/m) rsqrt(mean((x/m)^2) + eps/m^2) for any
  // m > 0, so m is a constant of the graph (detached) and the gradient is the formula's. m is at
  // least 1 (eps/m^2 stays at most eps); only a batch with such a row pays for the second pass.
  const double finite_max =
      work == DType::f64 ? std::numeric_limits<double>::max() : static_cast<double>(std::numeric_limits<float>::max());
  if (sum(gt(mean_square.detach(), finite_max)).item() > 0) {
    const Tensor m = maximum(max(abs(x.detach()), {-1}, true), ones({}, Options(work)));
    const Tensor scaled = x / m;
    return as_dtype(scaled * rsqrt(mean(square(scaled), {-1}, true) + eps_ / square(m)) * w, io);
  }
  return as_dtype(x * rsqrt(mean_square + eps_) * w, io);
}

Dropout::Dropout(double p, std::uint64_t seed) : p_(p), generator_(seed) {
  if (!(p >= 0.0 && p <= 1.0)) fail<ArgumentError>("Dropout", "probability must be in [0, 1], got ", p);
}

void Dropout::set_data_parallel(int rank, int world) {
  if (world < 1 || rank < 0 || rank >= world) {
    fail<ArgumentError>("Dropout::set_data_parallel", "rank ", rank, " of ", world, ": needs 0 <= rank < world");
  }
  rank_ = rank;
  world_ = world;
}

std::uint64_t Dropout::take(std::uint64_t count) noexcept {
  const auto rank = static_cast<std::uint64_t>(rank_), world = static_cast<std::uint64_t>(world_);
  const std::uint64_t span = world * count;
  std::uint64_t first = 0;
  if (CheckpointReplay::Draws* replayed = CheckpointReplay::draws_of(*this)) {  // a checkpoint's recompute
    first = replayed->next();
    ++replayed->used;
  } else {
    first = generator_.take(span);
  }
  CheckpointReplay::record(*this, first, span);  // a checkpointed forward's, for its recompute
  return first + rank * count;
}

std::uint64_t Dropout::next_draw() const noexcept {
  if (const CheckpointReplay::Draws* replayed = CheckpointReplay::draws_of(*this)) return replayed->next();
  return generator_.offset();
}

Tensor Dropout::forward(const Tensor& x) {
  require_input("Dropout", x);
  if (!is_training() || p_ == 0.0) return x;
  return dropout(x, p_, generator_.seed(), take(static_cast<std::uint64_t>(x.numel())));
}

Tensor ReLU::forward(const Tensor& x) { return relu(x); }
Tensor GELU::forward(const Tensor& x) { return gelu(x, approximation_); }
Tensor SiLU::forward(const Tensor& x) { return silu(x); }
Tensor Tanh::forward(const Tensor& x) { return tanh(x); }
Tensor Sigmoid::forward(const Tensor& x) { return sigmoid(x); }

CausalSelfAttention::CausalSelfAttention(std::int64_t d_model, std::int64_t heads, double dropout)
    : d_model_(d_model), heads_(heads) {
  if (heads <= 0 || d_model <= 0 || d_model % heads != 0) {
    fail<ArgumentError>("CausalSelfAttention", "d_model ", d_model, " must be a positive multiple of heads ", heads);
  }
  if (d_model > std::numeric_limits<std::int64_t>::max() / 3) {  // the qkv projection's 3 * d_model
    fail<ShapeError>("CausalSelfAttention", "d_model ", d_model, " is too large: 3 * d_model overflows int64");
  }
  // As GPT's: the attention weights' dropout must keep some weight (the fused op refuses 1 at the
  // first forward, naming itself; the composed path returned zeros).
  if (!(dropout >= 0.0 && dropout < 1.0)) {
    fail<ArgumentError>("CausalSelfAttention", "dropout must be in [0, 1), got ", dropout);
  }
  qkv = std::make_shared<Linear>(d_model, 3 * d_model);
  proj = std::make_shared<Linear>(d_model, d_model);
  attn_dropout_ = std::make_shared<Dropout>(dropout);
  resid_dropout_ = std::make_shared<Dropout>(dropout);
  register_module("qkv", &qkv);
  register_module("proj", &proj);
  register_module("attn_dropout", &attn_dropout_);
  register_module("resid_dropout", &resid_dropout_);
}

Tensor CausalSelfAttention::forward(const Tensor& x) {
  require_input("CausalSelfAttention", x);
  if (x.ndim() != 3 || x.shape()[2] != d_model_) {
    fail<ShapeError>("CausalSelfAttention", "expects [batch, time, ", d_model_, "], got ", x.shape());
  }
  const std::int64_t batch = x.shape()[0], time = x.shape()[1], head_dim = d_model_ / heads_;
  const Tensor qkv_out = qkv->forward(x);  // [B, T, 3C]
  if (fused_) {
    AttentionOptions options;
    options.causal = true;
    if (attn_dropout_->is_training() && attn_dropout_->p() > 0) {
      // The draws the composed path's Dropout takes for the [B, H, T, T] weights: the same mask.
      options.dropout = attn_dropout_->p();
      options.seed = attn_dropout_->generator().seed();
      options.offset = attn_dropout_->take(static_cast<std::uint64_t>(batch * heads_ * time * time));
    }
    // The packed form: its backward hands the projection one [B, T, 3C] gradient, where three
    // [B, H, T, head_dim] ones would be copied into it (~1% of the default GPT's step).
    const Tensor y =
        scaled_dot_product_attention_qkvpacked(reshape(qkv_out, {batch, time, 3, heads_, head_dim}), options);
    return resid_dropout_->forward(proj->forward(reshape(y, {batch, time, d_model_})));
  }
  auto heads_of = [&](std::int64_t part) {  // [B, H, T, head_dim]
    return permute(reshape(slice(qkv_out, 2, part * d_model_, (part + 1) * d_model_), {batch, time, heads_, head_dim}),
                   {0, 2, 1, 3});
  };
  const Tensor q = heads_of(0), k = heads_of(1), v = heads_of(2);
  // Scores in f32 at least: the softmax of 16-bit scores is too coarse.
  const DType work = q.dtype() == DType::f64 ? DType::f64 : DType::f32;
  Tensor scores = as_dtype(matmul(q, transpose(k, 2, 3)), work) * (1.0 / std::sqrt(static_cast<double>(head_dim)));
  // Additive causal mask: -inf above the diagonal.
  const Tensor rows = arange(0, static_cast<double>(time), 1, DType::i64).reshape({time, 1});
  const Tensor cols = arange(0, static_cast<double>(time), 1, DType::i64).reshape({1, time});
  const Tensor mask = where(gt(cols, rows), full({}, -std::numeric_limits<double>::infinity(), work), zeros({}, work));
  const Tensor attention = attn_dropout_->forward(softmax(scores + mask, -1));
  const Tensor y = matmul(as_dtype(attention, v.dtype()), v);  // [B, H, T, head_dim]
  return resid_dropout_->forward(proj->forward(reshape(permute(y, {0, 2, 1, 3}), {batch, time, d_model_})));
}

MLP::MLP(std::int64_t d_model, std::int64_t hidden, double dropout) {
  fc1 = std::make_shared<Linear>(d_model, hidden);
  fc2 = std::make_shared<Linear>(hidden, d_model);
  dropout_ = std::make_shared<Dropout>(dropout);
  register_module("fc1", &fc1);
  register_module("fc2", &fc2);
  register_module("dropout", &dropout_);
}

// fc1 and its GELU are one op (linear_gelu); set_gelu_backward picks what it keeps for backward.
Tensor MLP::forward(const Tensor& x) {
  require_input("MLP", x);
  return dropout_->forward(fc2->forward(fc1->forward_gelu(x, GeluApproximation::erf, gelu_backward_)));
}

void MLP::set_gelu_backward(GeluBackward backward) {
  check_enum(backward, "MLP::set_gelu_backward", "GeluBackward");
  gelu_backward_ = backward;
}

TransformerBlock::TransformerBlock(std::int64_t d_model, std::int64_t heads, std::int64_t mlp_hidden, double dropout) {
  ln1 = std::make_shared<LayerNorm>(d_model);
  attn = std::make_shared<CausalSelfAttention>(d_model, heads, dropout);
  ln2 = std::make_shared<LayerNorm>(d_model);
  mlp = std::make_shared<MLP>(d_model, mlp_hidden, dropout);
  register_module("ln1", &ln1);
  register_module("attn", &attn);
  register_module("ln2", &ln2);
  register_module("mlp", &mlp);
}

Tensor TransformerBlock::forward(const Tensor& x) {
  require_float_input("TransformerBlock", x);
  // The residual stream takes the branch's dtype, the weights' (or the compute dtype's): the
  // layers cast a floating input of another dtype to theirs (Linear's rule), and the sum must too.
  // (h holds the branch only until the sum replaces it: kept apart, the branch lived through the
  // MLP, 1 MB more in GPT-2-small's planned step.)
  Tensor h = attn->forward(ln1->forward(x));
  h = (x.dtype() == h.dtype() ? x : cast(x, h.dtype())) + h;
  return h + mlp->forward(ln2->forward(h));
}

namespace {
// The whole configuration, checked before any layer is built, so that its errors name GPT and its
// field rather than a layer inside it, and so that no size below overflows on the way.
void check_gpt_config(const GPTConfig& c) {
  const std::pair<const char*, std::int64_t> positive[] = {
      {"vocabulary", c.vocabulary}, {"context", c.context}, {"d_model", c.d_model}, {"heads", c.heads}};
  for (const auto& [field, value] : positive) {
    if (value <= 0) fail<ArgumentError>("GPT", field, " must be positive, got ", value);
  }
  if (c.layers < 0) fail<ArgumentError>("GPT", "layers must be >= 0, got ", c.layers);
  if (c.d_model % c.heads != 0) {
    fail<ArgumentError>("GPT", "d_model ", c.d_model, " is not a multiple of heads ", c.heads);
  }
  if (!(c.dropout >= 0.0 && c.dropout < 1.0)) fail<ArgumentError>("GPT", "dropout must be in [0, 1), got ", c.dropout);
  // The largest parameters: [vocabulary, d], [context, d], the MLP's [d, 4d] (whose 4d, the qkv's 3d
  // and every other size are below these).
  std::int64_t hidden = 0, elements = 0;
  const bool overflows = __builtin_mul_overflow(c.d_model, std::int64_t{4}, &hidden) ||
                         __builtin_mul_overflow(c.d_model, hidden, &elements) ||
                         __builtin_mul_overflow(c.vocabulary, c.d_model, &elements) ||
                         __builtin_mul_overflow(c.context, c.d_model, &elements);
  if (overflows) {
    fail<ShapeError>("GPT", "vocabulary ", c.vocabulary, ", context ", c.context, " and d_model ", c.d_model,
                     " give parameters whose element counts overflow int64");
  }
  // The whole model, before any block is built: each block's parameters fit, so a model of 2^40
  // blocks was built block by block until the system ran out of memory (an abort in libgomp, or
  // the OOM killer), never an error. Under DeferredInit nothing is allocated (the model is to be
  // sharded), so only the count must be a number.
  const long double d = static_cast<long double>(c.d_model);
  const long double per_block = 12 * d * d + 13 * d;  // qkv, proj, fc1, fc2 with biases, two norms
  const long double total = static_cast<long double>(c.layers) * per_block +
                            (static_cast<long double>(c.vocabulary) + static_cast<long double>(c.context)) * d + 2 * d +
                            (c.tied_head ? 0 : static_cast<long double>(c.vocabulary) * d);
  if (total > static_cast<long double>(std::numeric_limits<std::int64_t>::max())) {
    fail<ShapeError>("GPT", c.layers, " layers of d_model ", c.d_model, " hold ", static_cast<double>(total),
                     " parameters, more than int64 counts");
  }
  // Deferred, each block is still a few objects (modules, parameter records): 256 bytes is far
  // below what one takes, so a model refused here could never be built.
  const bool deferred = DeferredInit::active();
  const long double bytes = deferred ? static_cast<long double>(c.layers) * 256 : total * 4;  // f32 values
  // Against memory and swap, not what is free now: a model that fits slowly is the caller's choice.
  const std::uint64_t room = safetensors::detail::memory_ceiling_bytes();
  if (bytes > static_cast<long double>(room)) {
    auto shown = [](long double b) {
      return memory::format_bytes(
          static_cast<std::int64_t>(std::min(b, static_cast<long double>(std::numeric_limits<std::int64_t>::max()))));
    };
    fail<OutOfMemoryError>("GPT", c.layers, " layers of d_model ", c.d_model, " need ", deferred ? "more than " : "",
                           shown(bytes), deferred ? " for their modules alone" : " for their f32 parameters",
                           ", more than this machine's memory and swap (", shown(static_cast<long double>(room)), ")",
                           deferred ? "" : ": build it under DeferredInit and fully_shard it");
  }
}
}  // namespace

GPT::GPT(const GPTConfig& config) : config_(config) {
  check_gpt_config(config);
  token_embedding = std::make_shared<Embedding>(config.vocabulary, config.d_model, EmbeddingOptions{.std = 0.02});
  position_embedding = std::make_shared<Embedding>(config.context, config.d_model, EmbeddingOptions{.std = 0.02});
  register_module("token_embedding", &token_embedding);
  register_module("position_embedding", &position_embedding);
  register_modules("blocks", &blocks);  // blocks.0, blocks.1, ...
  for (std::int64_t i = 0; i < config.layers; ++i) {
    blocks.push_back(
        std::make_shared<TransformerBlock>(config.d_model, config.heads, 4 * config.d_model, config.dropout));
  }
  final_norm = std::make_shared<LayerNorm>(config.d_model);
  register_module("final_norm", &final_norm);
  if (!config.tied_head) {
    head = std::make_shared<Linear>(config.d_model, config.vocabulary, LinearOptions{.bias = false});
    register_module("head", &head);
  }
}

Tensor GPT::forward(const Tensor& tokens) {
  require_input("GPT", tokens);
  if (tokens.ndim() != 2 || tokens.shape()[1] > config_.context || tokens.shape()[1] < 1) {
    fail<ShapeError>("GPT", "expects tokens [batch, 1 <= time <= ", config_.context, "], got ", tokens.shape());
  }
  const std::int64_t time = tokens.shape()[1];
  const Tensor positions = arange(0, static_cast<double>(time), 1, DType::i64);
  Tensor x = token_embedding->forward(tokens) + position_embedding->forward(positions);
  for (const auto& block : blocks) x = activation_checkpointing_ ? checkpoint(*block, x) : block->forward(x);
  x = final_norm->forward(x);
  if (head) return head->forward(x);
  // The tied head reads the [vocabulary, d] table as an [out, in] weight: no transposed copy.
  const Tensor table = token_embedding->weight.value();
  return linear(as_dtype(x, table.dtype()), table, Tensor(), WeightLayout::out_in);
}

}  // namespace ruda::nn
