// Optimizers that work elementwise on whatever tensors they are given: on sharded parameters
// they update local slices, so their state is sharded for free (ZeRO). State is keyed by ParamId.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ruda/collectives.h>
#include <ruda/nn/module.h>

namespace ruda::nn {

/// Parameters that share a learning-rate scale and a weight decay (PyTorch's param_groups): the
/// usual use is no weight decay for biases and norms. A group's rate is the optimizer's lr()
/// times lr_scale, so a schedule moves every group together; its weight_decay, when set,
/// replaces the optimizer's. Checkpoints save the groups and refuse a resume whose groups differ.
struct ParamGroup {
  std::string name = {};
  std::vector<Param> params = {};
  double lr_scale = 1.0;
  std::optional<double> weight_decay = std::nullopt;
};

/// GPT-style groups of `module`'s parameters: "decay", those of two or more logical dimensions
/// (the weights of linear layers and embedding tables), with the optimizer's weight decay, and
/// "no_decay" (biases, the norms' scales and shifts) with none. On sharded parameters the logical
/// shape decides, not the 1-D local slice.
std::vector<ParamGroup> decay_2d_only(const Module& module);

/// An optimizer over parameter groups. A subclass implements step() and state(): its step()
/// updates every parameter that has a gradient, collecting the indices of those without one, and
/// calls finish_step(them) last, which keeps the per-parameter step counts (steps_of) that
/// checkpoints record. nn's optimizers check every gradient and make every state a step needs
/// before they update anything: a step refused for a dtype or size, or out of memory while making
/// state, changes nothing and counts for no parameter.
class Optimizer {
 public:
  /// One group ("default") of every parameter.
  Optimizer(std::vector<Param> params, double lr);
  Optimizer(std::vector<ParamGroup> groups, double lr);
  virtual ~Optimizer() = default;
  /// One update of every parameter that has a gradient.
  virtual void step() = 0;
  /// Drops every parameter's gradient (PyTorch 2's default, set_to_none=True): a parameter that
  /// gets none in the next backward is skipped by step(), not updated with zeros.
  void zero_grad();
  double lr() const noexcept { return lr_; }
  void set_lr(double lr);
  /// Updates taken so far.
  std::int64_t steps() const noexcept { return steps_; }
  /// ArgumentError for a negative count (Adam's bias corrections would divide by 0 or turn the
  /// update around) or INT64_MAX (the next step's count would overflow). Every parameter then
  /// counts that many steps.
  void set_steps(std::int64_t steps);
  /// The steps `param` itself has taken: those it had a gradient in (PyTorch keeps this per
  /// parameter as well: Adam's bias corrections use it, and SGD's momentum buffer starts as the
  /// first gradient). Checkpoints record it where it differs from steps().
  std::int64_t steps_of(const Param& param) const;
  /// Sets it after set_steps (a checkpoint's resume): ArgumentError outside [0, steps()].
  void set_steps_of(const Param& param, std::int64_t steps);
  /// Every parameter, group by group.
  const std::vector<Param>& params() const noexcept { return params_; }
  /// Whether `param` is one of params().
  bool updates(const Param& param) const { return param.defined() && position_.contains(param.id()); }
  const std::vector<ParamGroup>& groups() const noexcept { return groups_; }

  /// Per-parameter state tensors by name ("exp_avg", "momentum_buffer", ...), for checkpoints.
  /// Tensors are created on first use, so a loaded state can be written into them. ArgumentError
  /// for a parameter this optimizer does not update (it would get state it never uses).
  virtual std::vector<std::pair<std::string, Tensor>> state(const Param& param) = 0;
  /// Whether `param`'s state tensors exist already, so that state(param) makes none (true where
  /// there are none to make). False for a parameter that has taken no step yet: a frozen one given
  /// to the optimizer with the rest of its module (PyTorch's usual AdamW(model.parameters()) on a
  /// frozen backbone), or one that has had no gradient so far. Checkpoints save no state for such
  /// a parameter, and make none (as PyTorch's state_dict has none for it): it resumes afresh. The
  /// default, true for every parameter it updates, is for an optimizer that does not say: each
  /// one's state is made and saved, as before this existed.
  virtual bool has_state(const Param& param) const;

 protected:
  /// The rate and weight decay params()[i] is updated with (`decay`: the optimizer's own).
  double lr_of(std::size_t i) const noexcept { return lr_ * groups_[group_of_[i]].lr_scale; }
  double weight_decay_of(std::size_t i, double decay) const noexcept {
    return groups_[group_of_[i]].weight_decay.value_or(decay);
  }

  /// ArgumentError naming `op` unless `param` is one of params().
  void require_own(const char* op, const Param& param) const;
  /// ArgumentError naming `op` where the step count cannot grow (a step would take it to
  /// INT64_MAX, which set_steps refuses: the step after would overflow). step() calls it first.
  void require_step_room(const char* op) const;
  /// steps_of without the membership check: the steps `param` completed.
  std::int64_t own_steps(const Param& param) const;
  /// Counts a completed step: for every parameter but params()[i], i in without_gradient. step()
  /// calls it after its updates, so that a step that throws before any (out of memory while
  /// making state, say) counts for no parameter.
  void finish_step(const std::vector<std::size_t>& without_gradient);
  /// Counts a step that threw after updating params()[0, updated): for those that had a
  /// gradient, so that each one's count stays the number of updates it took.
  void finish_partial(const std::vector<std::size_t>& without_gradient, std::size_t updated);

  std::vector<ParamGroup> groups_;
  std::vector<Param> params_;
  std::vector<std::size_t> group_of_;  // params_[i] is in groups_[group_of_[i]]
  double lr_;
  std::int64_t steps_ = 0;

 private:
  std::unordered_map<ParamId, std::size_t> position_;  // params_[position_[id]] has that id
  // Steps a parameter had no gradient in (since the last set_steps): its own count is steps_ less these.
  std::unordered_map<ParamId, std::int64_t> skipped_;
};

struct SGDOptions {
  double lr = 1e-2;
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  double weight_decay = 0.0;
};

/// Stochastic gradient descent with optional momentum (Nesterov) and L2 weight decay (PyTorch
/// semantics: the momentum buffer starts as a parameter's first gradient, undampened).
class SGD : public Optimizer {
 public:
  SGD(std::vector<Param> params, SGDOptions options = {});
  SGD(std::vector<ParamGroup> groups, SGDOptions options = {});
  void step() override;
  std::vector<std::pair<std::string, Tensor>> state(const Param& param) override;
  bool has_state(const Param& param) const override;
  const SGDOptions& options() const noexcept { return options_; }

 private:
  /// The parameter's buffer (zeros when new); DTypeError naming `op` if the parameter changed
  /// dtype or size since it was made.
  Tensor& momentum_of(const Param& param, const char* op);

  SGDOptions options_;
  std::unordered_map<ParamId, Tensor> momentum_;
};

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  /// true: AdamW (decay applied to the parameter); false: Adam (L2 added to the gradient).
  bool decoupled_weight_decay = false;
};

/// Adam / AdamW in one fused kernel per parameter (PyTorch's formulation). As PyTorch's, each
/// parameter counts its own steps for the bias corrections: the steps it had a gradient in (a
/// parameter frozen for a while, or first used late, is not corrected as if it had taken all).
/// The moments of an f16 or bf16 parameter are f32 (moment_dtype), unlike PyTorch's. As in
/// PyTorch, the second moment is in the moments' dtype: a gradient element whose (1 - beta2) g^2
/// overflows it (|g| past ~5.8e20 in f32 at the default beta2) makes that moment inf and its
/// update 0 (m / inf), so such an element does not move (clip_grad_norm first sees its norm).
class Adam : public Optimizer {
 public:
  Adam(std::vector<Param> params, AdamOptions options = {});
  Adam(std::vector<ParamGroup> groups, AdamOptions options = {});
  /// The dtype of a parameter's moments: f32 for a 16-bit float parameter, else its own. The
  /// second moment is a running mean of squares, beta2 = 0.999 weighing each new one at 1e-3: in
  /// f16 it underflows to 0 below |g| ~8e-3 (the step becomes lr * m / eps) and overflows past
  /// ~8e3, and in bf16 it stops growing once 1e-3 g^2 is under half its ulp. 8 bytes a
  /// parameter instead of 4; the parameter itself is still rounded once per step to its dtype.
  static DType moment_dtype(DType parameter) noexcept;
  void step() override;
  std::vector<std::pair<std::string, Tensor>> state(const Param& param) override;
  bool has_state(const Param& param) const override;
  const AdamOptions& options() const noexcept { return options_; }

 private:
  struct Moments {
    Tensor exp_avg, exp_avg_sq;
  };
  Moments& moments(const Param& param);

  AdamOptions options_;
  std::unordered_map<ParamId, Moments> moments_;
};

/// AdamW's options: Adam's, with PyTorch AdamW's default weight decay.
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

/// Adam with decoupled weight decay.
class AdamW : public Adam {
 public:
  AdamW(std::vector<Param> params, AdamWOptions options = {});
  AdamW(std::vector<ParamGroup> groups, AdamWOptions options = {});
};

/// Learning-rate schedules: the rate at a 0-based step. Each refuses (ArgumentError) a rate that is
/// not finite and >= 0 when it is made, and a negative step when called.
using Schedule = std::function<double(std::int64_t step)>;
namespace schedules {
Schedule constant(double lr);
/// Linear from lr/warmup_steps up to lr over warmup_steps, then constant.
Schedule linear_warmup(double lr, std::int64_t warmup_steps);
/// Linear warmup (steps 0 to warmup_steps - 1 reach lr), then a cosine decay from lr at step
/// warmup_steps to min_lr at total_steps (constant after). total_steps positive, warmup_steps >= 0
/// (a warmup of total_steps or more: lr at step warmup_steps too, min_lr from the step after),
/// 0 <= min_lr <= lr; the schedule refuses a negative step.
Schedule cosine(double lr, std::int64_t total_steps, std::int64_t warmup_steps = 0, double min_lr = 0.0);
}  // namespace schedules

/// Clips the global gradient norm to max_norm (scaling every gradient by max_norm / (norm + 1e-6)
/// where that is below 1, as PyTorch's; a NaN norm makes every gradient NaN; max_norm 0 zeroes
/// them; a negative or NaN max_norm is an ArgumentError) and returns the norm before clipping. The
/// squares are summed in f64 whatever the gradients' dtype: where their sum overflows f32 (an
/// element of 2e19 or more) the norm is still finite and the gradients are scaled to it, where
/// PyTorch (summing in the gradients' dtype) returns inf and zeroes them (f64 gradients whose
/// squares overflow f64, 1.3e154 or more, give an infinite norm and are zeroed, as there). Correct on shards:
/// squares of sharded gradients are summed over each local slice without its padding and all-reduced over the
/// communicator fully_shard sharded them over (under hybrid sharding the node's, where one replica's shards make the
/// whole), or over `comm` for parameters sharded without one (ShardedParameter; then required, and the one they
/// are sharded over: a ShardingError if its rank or world size differ), one all-reduce per
/// communicator (modules sharded over different ones may be mixed); dense (replicated) gradients count once. Every
/// rank gets the same norm.
double clip_grad_norm(const std::vector<Param>& params, double max_norm, Communicator* comm = nullptr);
/// The same norm without clipping.
double grad_norm(const std::vector<Param>& params, Communicator* comm = nullptr);

}  // namespace ruda::nn
