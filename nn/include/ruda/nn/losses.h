// Losses. Each reduces with `mean` (the default), `sum`, or `none` (per element).
//
// Sharded (data-parallel) training: each rank computes its loss on its own samples, and the
// global loss is the SUM of the ranks' losses. Take `sum` locally and divide by global_count(...)
// of the samples/tokens of the whole step (all ranks, all micro-batches) before backward.
#pragma once

#include <optional>

#include <ruda/collectives.h>
#include <ruda/tensor.h>

namespace ruda::nn {

enum class LossReduction { mean, sum, none };
constexpr bool is_valid(LossReduction reduction) noexcept {
  switch (reduction) {
    case LossReduction::mean:
    case LossReduction::sum:
    case LossReduction::none:
      return true;
  }
  return false;
}

Tensor mse_loss(const Tensor& input, const Tensor& target, LossReduction reduction = LossReduction::mean);
Tensor l1_loss(const Tensor& input, const Tensor& target, LossReduction reduction = LossReduction::mean);

struct CrossEntropyOptions {
  LossReduction reduction = LossReduction::mean;
  /// Targets equal to this contribute nothing (and do not count in the mean).
  std::int64_t ignore_index = -100;
  /// Mixes the one-hot target with the uniform distribution: (1 - s) * onehot + s / classes.
  double label_smoothing = 0.0;
  /// Per-class weights [classes]; the mean divides by the summed weights of the targets.
  Tensor weight = {};
};

/// Cross-entropy of logits [..., classes] against i64 class targets [...] (PyTorch semantics).
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, const CrossEntropyOptions& options = {});
/// Negative log-likelihood of log-probabilities [..., classes] against i64 targets [...].
Tensor nll_loss(const Tensor& log_probs, const Tensor& targets, const CrossEntropyOptions& options = {});
/// Binary cross-entropy on logits (numerically stable), targets in [0, 1] of the same shape.
Tensor binary_cross_entropy_with_logits(const Tensor& logits, const Tensor& targets,
                                        LossReduction reduction = LossReduction::mean, const Tensor& pos_weight = {});

/// The number of samples/tokens in the whole step: `local` summed over the ranks of `comm`
/// (collective). A local count that is negative or not finite is an ArgumentError on every rank.
double global_count(Communicator& comm, double local);
/// How many targets of `targets` count in a cross-entropy (those not equal to ignore_index).
std::int64_t counted_targets(const Tensor& targets, std::int64_t ignore_index = -100);

}  // namespace ruda::nn
