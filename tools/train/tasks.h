// The two models ruda-train trains, behind one interface the training loop (job.cpp) drives:
// `mlp`, a multilayer perceptron on Fashion-MNIST, and `lm`, a byte-level GPT on any text.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ruda/nn.h>
#include <nlohmann/json.hpp>

#include "config.h"

namespace ruda::train {

struct Task {
  virtual ~Task() = default;
  virtual std::string description() const = 0;
  virtual nn::Module& module() = 0;
  /// The submodules sharded as groups of their own, before the root takes what is left: each
  /// unshards with one all-gather while the next one's travels.
  virtual std::vector<nn::Module*> shard_groups() = 0;
  virtual std::int64_t total_steps() const = 0;
  virtual std::int64_t samples_per_step() const = 0;
  /// This rank's loss for global step `step`, already divided by the step's global count.
  virtual Tensor loss(std::int64_t step) = 0;
  /// The same on micro-batch `micro` of `micro_batches` (consecutive equal parts of this rank's
  /// samples of the step), still divided by the step's global count: the micro-batches' gradients
  /// add up to the step's.
  virtual Tensor micro_loss(std::int64_t step, std::int64_t micro, std::int64_t micro_batches) = 0;
  virtual std::string where(std::int64_t step) const = 0;
  /// The options that decide which samples step k trains on: a resumed run must keep them, or it
  /// would not continue the same data stream.
  virtual std::map<std::string, std::string> data_stream() const = 0;
  /// What every rank must read alike, as named values (the data sets' identities): compared
  /// across ranks before step 1. By default the data stream.
  virtual std::map<std::string, std::string> shared_data() const { return data_stream(); }
  /// Evaluation after `step`, or an empty object when none is due. It runs in chunks of one
  /// micro-batch (set_micro_batches), within the memory a step was planned with.
  virtual nlohmann::json evaluate(std::int64_t step, bool final) = 0;
  /// The micro-batches a training step runs (the memory plan's choice).
  void set_micro_batches(std::int64_t m) { micro_batches = m; }
  std::int64_t micro_batches = 1;
  virtual void after_training() {}
  /// This rank's loss on `local_batch` samples of the first step, for measuring a step's memory.
  virtual Tensor probe_loss(std::int64_t local_batch) = 0;
  /// Whether the model can recompute its blocks in backward (--activation-checkpointing).
  virtual bool can_checkpoint_activations() const { return false; }
  virtual void set_activation_checkpointing(bool) {}
  /// Whether the model's MLPs can recompute their GELU pre-activations in backward (--recompute-gelu).
  virtual bool can_recompute_gelu() const { return false; }
  virtual void set_recompute_gelu(bool) {}
  /// Bytes this process has read from the data files so far (each rank reads only its samples).
  virtual std::int64_t data_bytes_read() const = 0;
};

/// The task `cfg.model` names, its model built deferred (no parameter allocated: fully_shard
/// materializes each rank's slices). Errors (a missing data file, too little text) name the file.
std::unique_ptr<Task> make_task(const Config& cfg, Communicator& comm);

}  // namespace ruda::train
