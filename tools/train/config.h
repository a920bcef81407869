// ruda-train's settings: one field per command-line option (main.cpp parses them, with their
// help texts), read by the tasks and the training loop.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ruda/nn/data.h>

namespace ruda::train {

struct Config {
  std::string model;
  std::string backend;
  std::string dtype = "f32";
  double loss_scale = 65536;      // the f16 loss scaler's initial scale (PyTorch's init_scale)
  bool loss_scale_given = false;  // a resumed f16 run goes on with the checkpoint's scale: said so
  std::string strategy = "recompute";
  bool no_prefetch = false;
  std::string overlap = "auto";
  bool per_parameter = false;
  bool hybrid = false;                       // shard within a node, replicate across nodes
  std::string gather_quantization = "none";  // none or int8 (the weight all-gather)
  int ranks_per_node = 0;                    // 0: MPI's nodes (emulated: every rank its own node)
  std::int64_t grad_accum = 1;               // micro-batches per step
  int unsharded_groups = 2;
  std::int64_t epochs = 10;
  std::int64_t steps = 0;
  std::int64_t batch = 0;
  double lr = 1e-3;
  double weight_decay = 0.01;
  std::string schedule = "constant";
  std::int64_t warmup = 0;
  std::uint64_t seed = 1;
  double clip = 0;
  std::string checkpoint_dir;
  std::int64_t checkpoint_every = 0;
  std::string resume;
  bool resume_latest = false;
  bool skip_checksums = false;
  std::string emulate_link;
  std::string metrics;
  int emulate = 0;
  std::int64_t log_every = 100;
  bool check_collectives = false;
  std::int64_t collective_timeout_ms = -1;  // MPI; -1: RUDA_COLLECTIVE_TIMEOUT or its default
  std::int64_t memory_limit = 0;            // bytes per rank; 0: RUDA_MEMORY_LIMIT or none
  bool activation_checkpointing = false;
  bool recompute_gelu = false;  // the MLPs recompute fc1's pre-activation in backward
  bool no_auto_fit = false;     // refuse a plan over the limit instead of trying leaner schedules
  // mlp
  std::string data = nn::kFashionMnistDir;
  std::vector<std::int64_t> hidden = {1024, 1024};
  std::int64_t limit = 0, test_limit = 0;
  // lm
  std::string text = "/usr/share/games/fortunes";
  std::int64_t context = 128, d_model = 256, layers = 4, heads = 4;
  bool untied = false;
  bool weight_decay_2d_only = false;  // AdamW's decay on 2-D weights only, none on biases and norms
  std::int64_t eval_every = 200, eval_batches = 8;
  std::int64_t sample = 0;
  std::string prompt = "\n";
  double temperature = 0.8;
};

}  // namespace ruda::train
