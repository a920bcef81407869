// Optimizers that work elementwise on whatever tensors they are given: on sharded parameters
// they update local slices, so their state is sharded for free (ZeRO). State is keyed by ParamId.
#pragma once

#include <cstdint>
#include <functional>
#include <unordered_map>
#include <vector>

#include <ruda/collectives.h>
#include <ruda/nn/module.h>

namespace ruda::nn {

class Optimizer {
 public:
  Optimizer(std::vector<Param> params, double lr);
  virtual ~Optimizer() = default;
  /// One update of every parameter that has a gradient.
  virtual void step() = 0;
  void zero_grad();
  double lr() const noexcept { return lr_; }
  void set_lr(double lr);
  /// Updates taken so far.
  std::int64_t steps() const noexcept { return steps_; }
  void set_steps(std::int64_t steps) noexcept { steps_ = steps; }
  const std::vector<Param>& params() const noexcept { return params_; }

  /// Per-parameter state tensors by name ("exp_avg", "momentum_buffer", ...), for checkpoints.
  /// Tensors are created on first use, so a loaded state can be written into them.
  virtual std::vector<std::pair<std::string, Tensor>> state(const Param& param) = 0;

 protected:
  std::vector<Param> params_;
  double lr_;
  std::int64_t steps_ = 0;
};

struct SGDOptions {
  double lr = 1e-2;
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  double weight_decay = 0.0;
};

/// Stochastic gradient descent with optional momentum (Nesterov) and L2 weight decay (PyTorch semantics).
class SGD : public Optimizer {
 public:
  SGD(std::vector<Param> params, SGDOptions options = {});
  void step() override;
  std::vector<std::pair<std::string, Tensor>> state(const Param& param) override;

 private:
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

/// Adam / AdamW in one fused kernel per parameter (PyTorch's formulation).
class Adam : public Optimizer {
 public:
  Adam(std::vector<Param> params, AdamOptions options = {});
  void step() override;
  std::vector<std::pair<std::string, Tensor>> state(const Param& param) override;
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
};

/// Learning-rate schedules: the rate at a 0-based step.
using Schedule = std::function<double(std::int64_t step)>;
namespace schedules {
Schedule constant(double lr);
/// Linear from lr/warmup_steps up to lr over warmup_steps, then constant.
Schedule linear_warmup(double lr, std::int64_t warmup_steps);
/// Linear warmup, then a cosine decay from lr to min_lr at total_steps (constant after).
Schedule cosine(double lr, std::int64_t total_steps, std::int64_t warmup_steps = 0, double min_lr = 0.0);
}  // namespace schedules

/// Clips the global gradient norm to max_norm (scaling every gradient by max_norm / norm when the
/// norm is larger) and returns the norm before clipping. Correct on shards: squares of sharded
/// gradients are summed over each local slice without its padding and all-reduced over `comm`
/// (required when any parameter is sharded); dense (replicated) gradients count once. Every rank
/// gets the same norm.
double clip_grad_norm(const std::vector<Param>& params, double max_norm, Communicator* comm = nullptr);
/// The same norm without clipping.
double grad_norm(const std::vector<Param>& params, Communicator* comm = nullptr);

}  // namespace ruda::nn
