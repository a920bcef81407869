// ruda-train: trains a fully sharded model across MPI ranks (mpiexec -n N ruda-train ...), across
// ranks emulated as threads (--emulate N), or alone. Models: `mlp` on Fashion-MNIST, and `lm`, a
// byte-level GPT-style language model on any text.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <mutex>
#include <numbers>
#include <optional>
#include <sstream>
#include <tuple>

#include <ruda/nn.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#ifdef RUDA_TRAIN_WITH_MPI
#include <ruda/mpi.h>
#endif

#include "report.h"

namespace {

using namespace ruda;
using nlohmann::json;
namespace fs = std::filesystem;

struct Config {
  std::string model;
  std::string backend;
  std::string dtype = "f32";
  std::string strategy = "recompute";
  bool no_prefetch = false;
  std::string overlap = "auto";
  bool per_parameter = false;
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
  // mlp
  std::string data = nn::kFashionMnistDir;
  std::vector<std::int64_t> hidden = {1024, 1024};
  std::int64_t limit = 0, test_limit = 0;
  // lm
  std::string text = "/usr/share/games/fortunes";
  std::int64_t context = 128, d_model = 256, layers = 4, heads = 4;
  bool untied = false;
  std::int64_t eval_every = 200, eval_batches = 8;
  std::int64_t sample = 0;
  std::string prompt = "\n";
  double temperature = 0.8;
};

// An error already reported to the user: exit non-zero without printing more.
struct Reported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void print_error(const std::string& message) { std::cerr << "ruda-train: error: " << message << std::endl; }

// Every rank learns whether any rank failed a setup phase; the lowest failing rank prints its
// message, and every rank leaves with a non-zero exit instead of waiting in a collective.
void agree(Communicator& comm, const std::string& error) {
  autograd::NoGradGuard guard;
  const double mine = error.empty() ? comm.world_size() : comm.rank();
  const int first =
      static_cast<int>(comm.all_reduce(scalar(-mine, DType::f64), Reduction::max, {.tag = "setup"}).item() * -1);
  if (first == comm.world_size()) return;
  if (first == comm.rank()) print_error(error);
  throw Reported("setup failed on rank " + std::to_string(first));
}

template <class F>
void setup_phase(Communicator& comm, F&& f) {
  std::string error;
  try {
    f();
  } catch (const std::exception& e) {
    error = e.what();
  }
  agree(comm, error);
}

// --- the two models ---

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
  virtual std::string where(std::int64_t step) const = 0;
  /// The options that decide which samples step k trains on: a resumed run must keep them, or it
  /// would not continue the same data stream.
  virtual std::map<std::string, std::string> data_stream() const = 0;
  /// Evaluation after `step`, or an empty object when none is due.
  virtual json evaluate(std::int64_t step, bool final) = 0;
  virtual void after_training() {}
  /// This rank's loss on `local_batch` samples of the first step, for measuring a step's memory.
  virtual Tensor probe_loss(std::int64_t local_batch) = 0;
  /// Whether the model can recompute its blocks in backward (--activation-checkpointing).
  virtual bool can_checkpoint_activations() const { return false; }
  virtual void set_activation_checkpointing(bool) {}
  /// Bytes this process has read from the data files so far (each rank reads only its samples).
  virtual std::int64_t data_bytes_read() const = 0;
};

DType compute_dtype(const Config& c) { return parse_dtype(c.dtype); }

// Fashion-MNIST, opened once per process: emulated ranks share the open files (and the one
// decompression of a gzip file into the cache). Each rank reads only the samples it uses.
struct ImageData {
  nn::IdxImages train, test;
};
ImageData datasets(const Config& cfg) {
  static std::mutex mutex;
  static std::map<std::string, ImageData> cache;
  std::lock_guard lock(mutex);
  const std::string key = cfg.data + "|" + std::to_string(cfg.limit) + "|" + std::to_string(cfg.test_limit);
  auto it = cache.find(key);
  if (it == cache.end()) {
    nn::IdxImages train = nn::open_fashion_mnist(cfg.data, true, cfg.limit);  // first: errors name it first
    nn::IdxImages test = nn::open_fashion_mnist(cfg.data, false, cfg.test_limit);
    it = cache.emplace(key, ImageData{std::move(train), std::move(test)}).first;
  }
  return it->second;
}

struct MlpTask : Task {
  const Config& cfg;
  Communicator& comm;
  nn::IdxImages train, test;
  std::shared_ptr<nn::Sequential> model;
  std::unique_ptr<nn::BatchSampler> sampler;

  MlpTask(const Config& c, Communicator& comm_) : MlpTask(c, comm_, datasets(c)) {}
  MlpTask(const Config& c, Communicator& comm_, ImageData data)
      : cfg(c), comm(comm_), train(std::move(data.train)), test(std::move(data.test)) {
    nn::manual_seed(cfg.seed);
    nn::DeferredInit deferred;  // parameters are materialized by fully_shard, each rank its slice
    model = std::make_shared<nn::Sequential>();
    std::int64_t in = train.rows() * train.cols();
    for (std::int64_t h : cfg.hidden) {
      model->push_back(std::make_shared<nn::Linear>(in, h));
      model->push_back(std::make_shared<nn::ReLU>());
      in = h;
    }
    model->push_back(std::make_shared<nn::Linear>(in, 10));
    sampler = std::make_unique<nn::BatchSampler>(train.size(), cfg.batch, comm.rank(), comm.world_size(), cfg.seed);
  }
  std::string description() const override {
    // (built with += rather than "mlp " + ...: GCC 12 warns falsely on that form, bug 105329)
    std::string d = "mlp ";
    d += std::to_string(train.rows() * train.cols());
    for (auto h : cfg.hidden) {
      d += '-';
      d += std::to_string(h);
    }
    return d + "-10";
  }
  nn::Module& module() override { return *model; }
  std::vector<nn::Module*> shard_groups() override {
    std::vector<nn::Module*> layers;
    for (std::size_t i = 0; i < model->size(); i += 2) layers.push_back((*model)[i].get());  // the Linear layers
    return layers;
  }
  std::int64_t data_bytes_read() const override { return train.bytes_read() + test.bytes_read(); }
  std::int64_t total_steps() const override { return cfg.epochs * sampler->batches_per_epoch(); }
  std::int64_t samples_per_step() const override { return cfg.batch; }
  std::map<std::string, std::string> data_stream() const override {
    return {{"--seed", std::to_string(cfg.seed)},
            {"--batch", std::to_string(cfg.batch)},
            {"--limit", std::to_string(cfg.limit)}};
  }
  std::string where(std::int64_t step) const override {
    return "epoch " + std::to_string(step / sampler->batches_per_epoch() + 1) + "/" + std::to_string(cfg.epochs);
  }
  Tensor loss(std::int64_t step) override {
    const std::int64_t per_epoch = sampler->batches_per_epoch();
    return loss_of(sampler->indices(step / per_epoch, step % per_epoch));
  }
  Tensor probe_loss(std::int64_t local_batch) override {
    return loss_of(arange(0, static_cast<double>(local_batch), 1, DType::i64));
  }
  Tensor loss_of(const Tensor& idx) {
    const Tensor logits = model->forward(train.images(idx));
    return nn::cross_entropy(cast(logits, DType::f32), train.labels(idx), {.reduction = nn::LossReduction::sum}) /
           static_cast<double>(cfg.batch);
  }
  json evaluate(std::int64_t step, bool final) override {
    const bool epoch_end = (step + 1) % sampler->batches_per_epoch() == 0;
    if (!epoch_end && !final) return {};
    // Each rank scores an equal share of the test set (padded; padding rows are not counted), so
    // every rank runs the same number of forward passes and so the same collectives. Chunks of the
    // local training batch keep evaluation within the memory a training step was planned with.
    autograd::NoGradGuard guard;
    const std::int64_t n = test.size(), world = comm.world_size();
    const std::int64_t share = (n + world - 1) / world, chunk = cfg.batch / world;
    double correct = 0, loss_sum = 0;
    for (std::int64_t first = 0; first < share; first += chunk) {
      const std::int64_t lo = std::min(n, comm.rank() * share + first);
      const std::int64_t hi = std::min(n, std::min(comm.rank() * share + share, comm.rank() * share + first + chunk));
      const std::int64_t rows = std::min(chunk, share - first);
      // Only a last, short chunk is padded (with zero rows that are not counted).
      Tensor x = hi > lo ? test.images(lo, hi) : Tensor();
      if (hi - lo < rows) {
        const Tensor padding = zeros({rows - (hi - lo), test.rows() * test.cols()});
        x = x.defined() ? concat({x, padding}, 0) : padding;
      }
      const Tensor logits = cast(model->forward(x), DType::f32);
      if (hi > lo) {
        const Tensor real = logits.slice(0, 0, hi - lo);
        const Tensor labels = test.labels(lo, hi);
        correct += sum(eq(argmax(real, 1), labels).to(DType::f64)).item();
        loss_sum += nn::cross_entropy(real, labels, {.reduction = nn::LossReduction::sum}).item();
      }
    }
    const auto totals = comm.all_reduce(from_values({correct, loss_sum}, {2}, DType::f64)).to_vector<double>();
    return {{"test_accuracy", totals[0] / static_cast<double>(n)}, {"test_loss", totals[1] / static_cast<double>(n)}};
  }
};

struct LmTask : Task {
  const Config& cfg;
  Communicator& comm;
  nn::TextCorpus corpus;  // the text's files: each rank reads only its windows
  std::int64_t train_end = 0, bytes_read = 0;
  std::shared_ptr<nn::GPT> model;

  LmTask(const Config& c, Communicator& comm_) : cfg(c), comm(comm_), corpus(c.text) {
    train_end = corpus.size() * 9 / 10;
    if (corpus.size() - train_end < cfg.context + 2 || train_end < cfg.context + 2) {
      throw IOError(cfg.text + ": " + std::to_string(corpus.size()) + " bytes are too few for context " +
                    std::to_string(cfg.context));
    }
    nn::manual_seed(cfg.seed);
    nn::DeferredInit deferred;  // parameters are materialized by fully_shard, each rank its slice
    model = std::make_shared<nn::GPT>(nn::GPTConfig{.vocabulary = 256,
                                                    .context = cfg.context,
                                                    .d_model = cfg.d_model,
                                                    .layers = cfg.layers,
                                                    .heads = cfg.heads,
                                                    .tied_head = !cfg.untied});
    model->set_activation_checkpointing(cfg.activation_checkpointing);
  }
  std::string description() const override {
    return "lm vocab=256 context=" + std::to_string(cfg.context) + " d=" + std::to_string(cfg.d_model) +
           " layers=" + std::to_string(cfg.layers) + " heads=" + std::to_string(cfg.heads) +
           (cfg.untied ? " untied" : " tied");
  }
  nn::Module& module() override { return *model; }
  std::vector<nn::Module*> shard_groups() override {
    std::vector<nn::Module*> blocks;
    for (const auto& block : model->blocks) blocks.push_back(block.get());
    return blocks;
  }
  std::int64_t data_bytes_read() const override { return bytes_read; }
  std::int64_t total_steps() const override { return cfg.steps; }
  std::int64_t samples_per_step() const override { return cfg.batch; }
  std::string where(std::int64_t) const override { return ""; }
  std::map<std::string, std::string> data_stream() const override {
    return {{"--seed", std::to_string(cfg.seed)}, {"--batch", std::to_string(cfg.batch)}};
  }

  // Windows [pos, pos + context + 1) of the given range, for this rank's part of a global batch
  // of `batch` windows drawn from stream (seed, step).
  std::pair<Tensor, Tensor> windows(std::int64_t begin, std::int64_t end, std::uint64_t stream, std::int64_t step,
                                    std::int64_t batch) {
    const std::int64_t local = batch / comm.world_size(), t = cfg.context;
    std::vector<std::int64_t> x(static_cast<std::size_t>(local * t)), y(x.size());
    std::vector<std::uint8_t> window(static_cast<std::size_t>(t + 1));
    for (std::int64_t i = 0; i < local; ++i) {
      const std::int64_t sample = step * batch + comm.rank() * local + i;
      const double u = random::uniform_double(stream, static_cast<std::uint64_t>(sample));
      const std::int64_t pos = begin + static_cast<std::int64_t>(u * static_cast<double>(end - begin - t - 1));
      corpus.read(pos, t + 1, window.data());
      bytes_read += t + 1;
      for (std::int64_t j = 0; j < t; ++j) {
        x[i * t + j] = window[j];
        y[i * t + j] = window[j + 1];
      }
    }
    return {from_vector(x, {local, t}), from_vector(y, {local, t})};
  }
  Tensor loss(std::int64_t step) override { return loss_on(step, cfg.batch); }
  Tensor probe_loss(std::int64_t local_batch) override { return loss_on(0, local_batch * comm.world_size()); }
  Tensor loss_on(std::int64_t step, std::int64_t global_batch) {
    const auto [x, y] = windows(0, train_end, cfg.seed, step, global_batch);
    const Tensor logits = model->forward(x);
    return nn::cross_entropy(cast(logits, DType::f32), y, {.reduction = nn::LossReduction::sum}) /
           static_cast<double>(cfg.batch * cfg.context);
  }
  bool can_checkpoint_activations() const override { return true; }
  void set_activation_checkpointing(bool on) override { model->set_activation_checkpointing(on); }
  json evaluate(std::int64_t step, bool final) override {
    if (!final && (cfg.eval_every <= 0 || (step + 1) % cfg.eval_every != 0)) return {};
    autograd::NoGradGuard guard;
    double loss_sum = 0;
    for (std::int64_t b = 0; b < cfg.eval_batches; ++b) {
      // Fixed validation windows (their own stream), the same at every evaluation.
      const auto [x, y] = windows(train_end, corpus.size(), cfg.seed ^ 0x5eed, b, cfg.batch);
      loss_sum +=
          nn::cross_entropy(cast(model->forward(x), DType::f32), y, {.reduction = nn::LossReduction::sum}).item();
    }
    const double total = comm.all_reduce(scalar(loss_sum, DType::f64)).item();
    const double loss = total / static_cast<double>(cfg.eval_batches * cfg.batch * cfg.context);
    return {{"val_loss", loss}, {"val_bits_per_byte", loss / std::numbers::ln2}};
  }
  void after_training() override {
    if (cfg.sample <= 0) return;
    // Every rank samples the same bytes (same logits, same draws): the model's gathers stay in step.
    autograd::NoGradGuard guard;
    model->eval();
    std::vector<std::int64_t> tokens(cfg.prompt.begin(), cfg.prompt.end());
    if (tokens.empty()) tokens.push_back('\n');
    std::string out;
    for (std::int64_t i = 0; i < cfg.sample; ++i) {
      const std::int64_t from = std::max<std::int64_t>(0, static_cast<std::int64_t>(tokens.size()) - cfg.context);
      std::vector<std::int64_t> window(tokens.begin() + from, tokens.end());
      const std::int64_t t = static_cast<std::int64_t>(window.size());
      const Tensor logits =
          cast(model->forward(from_vector(window, {1, t})), DType::f32).slice(1, t - 1, t).reshape({256});
      std::int64_t next;
      if (cfg.temperature <= 0) {
        next = static_cast<std::int64_t>(argmax(logits, 0).item());
      } else {
        const auto p = softmax(logits / cfg.temperature, 0).to_vector<double>();
        double u = random::uniform_double(cfg.seed ^ 0x5a3, static_cast<std::uint64_t>(i)), acc = 0;
        next = 255;
        for (int k = 0; k < 256; ++k) {
          acc += p[k];
          if (u < acc) {
            next = k;
            break;
          }
        }
      }
      tokens.push_back(next);
      out.push_back(static_cast<char>(next));
    }
    if (comm.rank() == 0) std::cout << "--- sample ---\n" << cfg.prompt << out << "\n--------------" << std::endl;
  }
};

// --- the memory plan ---

// "needs ~1.9 GB per rank at 1 rank; limit 256 MB; fits at 8 ranks, or at 4 with --activation-checkpointing"
std::string refusal(Task& task, const nn::MemoryPlan& plan, std::int64_t limit, std::int64_t batch,
                    const std::optional<nn::StepProbe>& probe, const std::optional<nn::StepProbe>& checkpointed,
                    const nn::PlanOptions& options) {
  const int world = plan.world_size;
  std::string out = "memory plan: needs " + std::string(plan.measured() ? "~" : "at least ") +
                    memory::format_bytes(plan.peak()) + " per rank at " + std::to_string(world) +
                    (world == 1 ? " rank" : " ranks") +
                    (plan.measured() ? "" : " before activations (parameters, gradients and optimizer state)") +
                    "; limit " + memory::format_bytes(limit);
  const int fits = nn::smallest_fitting_world(task.module(), batch, probe, limit, options);
  out += fits > 0 ? "; " + std::string(plan.measured() ? "fits" : "that much fits") + " at " + std::to_string(fits) +
                        " ranks"
                  : "; fits at no world size with --batch " + std::to_string(batch);
  if (checkpointed) {
    const int with = nn::smallest_fitting_world(task.module(), batch, checkpointed, limit, options);
    if (with > 0 && (fits == 0 || with < fits))
      out += ", or at " + std::to_string(with) + " with --activation-checkpointing";
  }
  return out;
}

// Before any parameter exists: refuses a configuration whose sharded state alone exceeds the limit.
void check_state_fits(const Config& cfg, Communicator& comm, Task& task, const nn::PlanOptions& options) {
  const std::int64_t limit = memory::limit();
  const nn::MemoryPlan state = nn::plan_state(task.module(), comm.world_size(), cfg.batch, options);
  if (limit > 0 && state.peak() > limit) {
    throw OutOfMemoryError(refusal(task, state, limit, cfg.batch, std::nullopt, std::nullopt, options));
  }
}

// With the shards in place: measures a step on micro-batches and returns the plan, with the
// refusal of a configuration over this rank's limit naming what would fit (probing the recomputing
// blocks too when that could help). Collective: every rank runs the same probes whatever its own
// limit says, and the caller agrees on the refusal.
std::pair<nn::MemoryPlan, std::string> measure_plan(const Config& cfg, Communicator& comm, Task& task,
                                                    const nn::PlanOptions& options) {
  auto step = [&](std::int64_t b) { return task.probe_loss(b); };
  const std::int64_t limit = memory::limit();
  const nn::MemoryPlan plan = nn::plan_memory(task.module(), comm, cfg.batch, step, limit, options);
  const bool over = limit > 0 && plan.peak() > limit;
  const bool any_over = autograd::no_grad([&] {
    return comm.all_reduce(scalar(over ? 1.0 : 0.0, DType::f64), Reduction::max, {.tag = "memory plan"}).item() > 0;
  });
  if (!any_over) return {plan, ""};
  std::optional<nn::StepProbe> checkpointed;
  if (task.can_checkpoint_activations() && !cfg.activation_checkpointing) {
    task.set_activation_checkpointing(true);
    checkpointed = nn::probe_step(task.module(), comm, step);
    task.set_activation_checkpointing(false);
  }
  return {plan, over ? refusal(task, plan, limit, cfg.batch, plan.probe, checkpointed, options) : ""};
}

// --- the training loop ---

// Every rank sees the same summed loss, so every rank stops here: rank 0 says at which step and
// on which rank the loss first became NaN or infinite, and all leave without an MPI abort.
[[noreturn]] void stop_on_non_finite(Communicator& comm, const Tensor& local_loss, double global, std::int64_t step) {
  const auto locals = autograd::no_grad([&] {
    return comm.all_gather(cast(local_loss.detach(), DType::f64).reshape({1}), {.tag = "non-finite loss"})
        .to_vector<double>();
  });
  const auto first = std::find_if(locals.begin(), locals.end(), [](double l) { return !std::isfinite(l); });
  if (comm.rank() == 0) {
    std::ostringstream message;
    message << "loss became " << global << " at step " << step;
    if (first != locals.end()) message << " (first on rank " << first - locals.begin() << ": " << *first << ")";
    print_error(message.str());
  }
  throw Reported("non-finite loss");
}

void run(const Config& cfg, Communicator& comm) {
  // This rank's own memory figures (emulated ranks and MPI processes alike); the dataset shared
  // by a process is loaded outside it.
  memory::Scope rank_memory;
  if (cfg.check_collectives) comm.set_order_check(true);
  const bool main_rank = comm.rank() == 0;
  std::unique_ptr<Task> task;
  std::unique_ptr<nn::Optimizer> optimizer;
  std::int64_t start_step = 0;
  nn::CheckpointInfo resumed;
  nn::MemoryPlan plan;
  const auto begin = std::chrono::steady_clock::now();

  nn::ShardPolicy policy;
  policy.strategy = cfg.strategy == "retain" ? nn::CheckpointStrategy::retain : nn::CheckpointStrategy::recompute;
  if (compute_dtype(cfg) != DType::f32) policy.compute_dtype = compute_dtype(cfg);
  const nn::PlanOptions plan_options{.optimizer_states = 2, .compute_dtype = policy.compute_dtype};
  // Without collectives: the options, the data, the model (deferred: no parameter is allocated)
  // and whether its sharded state alone fits the limit.
  setup_phase(comm, [&] {
    if (!cfg.backend.empty()) set_default_backend(cfg.backend);
    if (cfg.batch % comm.world_size() != 0) {
      throw ArgumentError("--batch " + std::to_string(cfg.batch) + " does not divide over " +
                          std::to_string(comm.world_size()) + " ranks");
    }
    task = cfg.model == "mlp" ? std::unique_ptr<Task>(std::make_unique<MlpTask>(cfg, comm))
                              : std::unique_ptr<Task>(std::make_unique<LmTask>(cfg, comm));
    check_state_fits(cfg, comm, *task, plan_options);
  });
  // Each rank materializes its slices and the plan measures a step: collectives, so a failure on
  // one rank here (an allocation past the limit) ends the job rather than being agreed on.
  const nn::FullyShardOptions shard_options{.policy = policy,
                                            .group = !cfg.per_parameter,
                                            .prefetch = !cfg.no_prefetch,
                                            .overlap = cfg.overlap == "on"    ? nn::Overlap::on
                                                       : cfg.overlap == "off" ? nn::Overlap::off
                                                                              : nn::Overlap::automatic,
                                            .max_unsharded_groups = cfg.unsharded_groups};
  if (!cfg.per_parameter) {
    for (nn::Module* group : task->shard_groups()) nn::fully_shard(*group, comm, shard_options);
  }
  nn::fully_shard(task->module(), comm, shard_options);
  std::string refused;
  std::tie(plan, refused) = measure_plan(cfg, comm, *task, plan_options);
  setup_phase(comm, [&] {
    if (!refused.empty()) throw OutOfMemoryError(refused);
    optimizer = std::make_unique<nn::AdamW>(task->module().parameters(),
                                            nn::AdamWOptions{.lr = cfg.lr, .weight_decay = cfg.weight_decay});
    const std::string from = cfg.resume_latest ? cfg.checkpoint_dir : cfg.resume;
    if (!from.empty()) {
      // The model description first: a checkpoint of another model is named as such, not as a shape mismatch.
      const nn::CheckpointSummary found = nn::describe_checkpoint(from);
      const auto model = found.info.extra.find("model");
      if (model == found.info.extra.end() || model->second != task->description()) {
        throw IOError("checkpoint " + found.info.directory + " holds model '" +
                      (model == found.info.extra.end() ? "?" : model->second) + "', this run trains '" +
                      task->description() + "'");
      }
      for (const auto& [option, value] : task->data_stream()) {
        const auto saved = found.info.extra.find(option);
        if (saved != found.info.extra.end() && saved->second != value) {
          throw ArgumentError(option + " " + value + " differs from the " + option + " " + saved->second + " of " +
                              found.info.directory + ": the resumed run would train on other samples");
        }
      }
      resumed = nn::load_checkpoint(found.info.directory, task->module(), optimizer.get(), comm,
                                    {.verify_checksums = !cfg.skip_checksums});
      start_step = resumed.step;
    }
  });
  // Only now that every rank has loaded (the phase agreed on it) is the resume reported.
  if (main_rank && !resumed.directory.empty()) {
    std::cout << "resumed from " << resumed.directory << " at step " << start_step << " (saved by "
              << resumed.world_size << " ranks, now " << comm.world_size() << ")" << std::endl;
  }

  const std::int64_t total = task->total_steps();
  train::Metrics metrics;
  setup_phase(comm, [&] {
    if (main_rank) metrics = train::Metrics(cfg.metrics, start_step > 0);
  });
  if (main_rank) {
    std::cout << task->description() << ", " << task->module().parameter_count() << " parameters, fully sharded over "
              << comm.world_size() << " " << comm.kind() << " rank" << (comm.world_size() > 1 ? "s" : "")
              << ", backend " << default_backend().name() << ", compute " << cfg.dtype << ", " << cfg.strategy
              << (cfg.activation_checkpointing ? ", activation checkpointing" : "") << ", " << total - start_step
              << " steps" << std::endl;
    std::cout << plan.table(memory::limit()) << std::flush;
  }
  const nn::Schedule schedule = cfg.schedule == "cosine"
                                    ? nn::schedules::cosine(cfg.lr, total, cfg.warmup, cfg.lr * 0.1)
                                    : nn::schedules::linear_warmup(cfg.lr, cfg.warmup);
  train::Progress progress(main_rank, total, cfg.log_every);
  progress.set_first_step(start_step);
  const auto params = task->module().parameters();
  double rate = 0, last_loss = 0;
  json last_eval;
  // Per rank: the peak tensor bytes, and the data bytes read (one all-gather for both).
  auto per_rank = [&] {
    const auto both = comm.all_gather(from_values({static_cast<double>(memory::stats().peak_bytes),
                                                   static_cast<double>(task->data_bytes_read())},
                                                  {2}, DType::f64))
                          .to_vector<double>();
    std::pair<std::vector<double>, std::vector<double>> out;
    for (std::size_t i = 0; i < both.size(); i += 2) {
      out.first.push_back(both[i]);
      out.second.push_back(both[i + 1]);
    }
    return out;
  };
  auto peaks = [&] { return per_rank().first; };
  // Predicted against measured once the state is complete (the optimizer's moments appear in the
  // first step, the gradients live on into the second).
  const std::int64_t plan_check_step = std::min(start_step + 2, total);
  memory::reset_peak();
  auto save = [&](std::int64_t step) {
    std::map<std::string, std::string> extra = task->data_stream();
    extra.insert(
        {{"model", task->description()}, {"dtype", cfg.dtype}, {"backend", std::string(default_backend().name())}});
    const auto info = nn::save_checkpoint(cfg.checkpoint_dir, step, task->module(), optimizer.get(), comm, extra);
    progress.line("checkpoint " + info.directory);
  };

  Traffic comm_total;  // of the training steps alone (not evaluation or checkpoints)
  for (std::int64_t step = start_step; step < total; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    const Traffic traffic_before = comm.traffic();
    optimizer->set_lr(schedule(step));
    const Tensor loss = task->loss(step);
    optimizer->zero_grad();
    loss.backward();
    double norm = -1;
    if (cfg.clip > 0) norm = nn::clip_grad_norm(params, cfg.clip, &comm);
    optimizer->step();
    last_loss = comm.all_reduce(loss.detach(), Reduction::sum, {.tag = "loss"}).item();
    if (!std::isfinite(last_loss)) stop_on_non_finite(comm, loss, last_loss, step + 1);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const Traffic traffic_after = comm.traffic();
    const Traffic step_traffic{
        traffic_after.collectives - traffic_before.collectives, traffic_after.bytes - traffic_before.bytes,
        traffic_after.seconds - traffic_before.seconds, traffic_after.exposed_seconds - traffic_before.exposed_seconds};
    comm_total.collectives += step_traffic.collectives;
    comm_total.bytes += step_traffic.bytes;
    comm_total.seconds += step_traffic.seconds;
    comm_total.exposed_seconds += step_traffic.exposed_seconds;
    const double current = static_cast<double>(task->samples_per_step()) / seconds;
    rate = rate == 0 ? current : 0.9 * rate + 0.1 * current;
    progress.step(step, task->where(step), last_loss, rate);
    if (!cfg.checkpoint_dir.empty() && cfg.checkpoint_every > 0 && (step + 1) % cfg.checkpoint_every == 0)
      save(step + 1);
    if (step + 1 == plan_check_step) {
      const auto peak = peaks();
      if (main_rank) {
        const double measured = *std::max_element(peak.begin(), peak.end());
        char buf[160];
        std::snprintf(buf, sizeof buf, "memory: predicted %s per rank, measured %s (largest rank; %.2f of predicted)",
                      memory::format_bytes(plan.peak()).c_str(),
                      memory::format_bytes(static_cast<std::int64_t>(measured)).c_str(),
                      measured / static_cast<double>(plan.peak()));
        progress.line(buf);
      }
    }
    const bool final = step + 1 == total;
    json eval = task->evaluate(step, final);
    if (!eval.empty()) nn::reshard(task->module());  // the evaluation's last layers' weights
    const bool log = (cfg.log_every > 0 && (step + 1) % cfg.log_every == 0) || !eval.empty() || final;
    if (log) {
      const auto [peak, data_read] = per_rank();
      if (main_rank) {
        json record = {{"step", step + 1},
                       {"loss", last_loss},
                       {"lr", optimizer->lr()},
                       {"samples_per_s", rate},
                       {"peak_memory_bytes", peak},
                       {"predicted_peak_bytes", plan.peak()},
                       {"data_bytes_read", data_read},
                       {"comm_collectives", step_traffic.collectives},
                       {"comm_bytes", step_traffic.bytes},
                       {"comm_seconds", step_traffic.seconds},
                       {"comm_exposed_seconds", step_traffic.exposed_seconds}};
        if (cfg.model == "mlp") record["epoch"] = (step + 1) / (total / cfg.epochs);
        if (norm >= 0) record["grad_norm"] = norm;
        for (auto& [k, v] : eval.items()) record[k] = v;
        metrics.write(record);
      }
    }
    if (!eval.empty()) {
      last_eval = eval;
      std::string text = "step " + std::to_string(step + 1) + " " + task->where(step);
      for (auto& [k, v] : eval.items()) {
        char buf[64];
        std::snprintf(buf, sizeof buf, k == "test_accuracy" ? " %s %.2f%%" : " %s %.4f", k.c_str(),
                      k == "test_accuracy" ? v.get<double>() * 100 : v.get<double>());
        text += buf;
      }
      progress.line(text);
    }
  }
  if (!cfg.checkpoint_dir.empty() && total > start_step &&
      (cfg.checkpoint_every <= 0 || total % cfg.checkpoint_every != 0)) {
    save(total);
  }
  task->after_training();
  const auto peak = peaks();
  if (main_rank) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    std::string summary = "done: " + std::to_string(total - start_step) + " steps in " + train::duration(seconds);
    if (total > start_step) {
      char buf[64];
      std::snprintf(buf, sizeof buf, ", final loss %.4f", last_loss);
      summary += buf;
    }
    for (auto& [k, v] : last_eval.items()) {
      char buf[64];
      std::snprintf(buf, sizeof buf, k == "test_accuracy" ? ", %s %.2f%%" : ", %s %.4f", k.c_str(),
                    k == "test_accuracy" ? v.get<double>() * 100 : v.get<double>());
      summary += buf;
    }
    summary += ", peak memory per rank:";
    for (double p : peak) summary += " " + train::megabytes(p);
    progress.line(summary);
    if (comm_total.bytes > 0) {
      // Rank 0's view: what its collectives took per step, and how much of it the step waited for.
      const double steps = static_cast<double>(total - start_step);
      char buf[200];
      std::snprintf(
          buf, sizeof buf,
          "communication: %.1f collectives, %s, %.1f ms per step; %.1f ms of it exposed (the step waited)",
          static_cast<double>(comm_total.collectives) / steps,
          memory::format_bytes(static_cast<std::int64_t>(static_cast<double>(comm_total.bytes) / steps)).c_str(),
          1e3 * comm_total.seconds / steps, 1e3 * comm_total.exposed_seconds / steps);
      progress.line(buf);
      if (const nn::OverlapReport o = nn::overlap_report(task->module()); o.decided && cfg.overlap == "auto") {
        std::snprintf(buf, sizeof buf,
                      "overlap: %s (first steps timed: %.1f ms overlapping, %.1f ms synchronous, slowest rank)",
                      o.overlapping ? "on" : "off", 1e3 * o.step_seconds_overlapping, 1e3 * o.step_seconds_synchronous);
        progress.line(buf);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  CLI::App app{
      "ruda-train: trains a fully sharded model across MPI ranks, emulated ranks, or alone.\n"
      "  mpiexec -n 2 ruda-train mlp          Fashion-MNIST MLP over two MPI processes\n"
      "  ruda-train --emulate 4 lm --steps 500 a GPT-style byte model over four threads\n"};
  app.require_subcommand(1);
  app.option_defaults()->always_capture_default();
  app.add_option("--backend", cfg.backend,
                 "Compute backend: eigen or onednn (default: RUDA_BACKEND, else onednn where built)");
  app.add_option("--dtype", cfg.dtype, "Compute dtype of the layers (parameters stay f32)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  app.add_option("--strategy", cfg.strategy,
                 "What backward keeps of gathered weights: the weights (retain) or only shards (recompute)")
      ->check(CLI::IsMember({"retain", "recompute"}));
  app.add_flag("--no-prefetch", cfg.no_prefetch,
               "Gather each layer's weights when it starts, instead of while the layer before it computes");
  app.add_option("--overlap", cfg.overlap,
                 "Overlap communication with compute (prefetch, reduce-scatters in flight): on, off, or auto "
                 "(time the first steps both ways and keep the faster)")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  app.add_flag("--per-parameter", cfg.per_parameter,
               "Gather and reduce each parameter on its own, without groups or prefetch (for comparison)");
  app.add_option("--unsharded-groups", cfg.unsharded_groups,
                 "At most this many layers hold full weights at once, besides the model's own (default 2)")
      ->check(CLI::PositiveNumber);
  app.add_option("--epochs", cfg.epochs, "Epochs (mlp)")->check(CLI::PositiveNumber);
  app.add_option("--steps", cfg.steps, "Optimizer steps (lm; default 1000)")->check(CLI::NonNegativeNumber);
  app.add_option("--batch", cfg.batch, "Global batch size, split evenly over the ranks (default: mlp 128, lm 16)")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", cfg.lr, "Peak learning rate of AdamW")->check(CLI::PositiveNumber);
  app.add_option("--weight-decay", cfg.weight_decay, "AdamW's decoupled weight decay")->check(CLI::NonNegativeNumber);
  app.add_option("--schedule", cfg.schedule, "Learning-rate schedule after --warmup steps")
      ->check(CLI::IsMember({"constant", "cosine"}));
  app.add_option("--warmup", cfg.warmup, "Linear warm-up steps")->check(CLI::NonNegativeNumber);
  app.add_option("--seed", cfg.seed, "Seed of initialization, data order and sampling");
  app.add_option("--clip", cfg.clip, "Clip the global gradient norm to this value (0: off)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--checkpoint-dir", cfg.checkpoint_dir,
                 "Directory of sharded checkpoints (written at the end, and every --checkpoint-every steps)");
  app.add_option("--checkpoint-every", cfg.checkpoint_every, "Checkpoint every N steps (0: only at the end)")
      ->check(CLI::NonNegativeNumber);
  auto* resume =
      app.add_option("--resume", cfg.resume,
                     "Resume from this checkpoint (a step directory or a checkpoint directory; any world size)");
  app.add_flag("--resume-latest", cfg.resume_latest,
               "Resume from the latest checkpoint in --checkpoint-dir, if there is one")
      ->excludes(resume);
  app.add_flag("--skip-checksums", cfg.skip_checksums,
               "Resume without checking the checkpoint's data against its checksums (faster; the files' "
               "headers and identity are still checked)");
  app.add_option(
      "--metrics", cfg.metrics,
      "Write JSON lines of metrics (step, loss, accuracy, lr, samples/s, peak memory per rank, communication) to FILE");
  auto* emulate = app.add_option("--emulate", cfg.emulate, "Run N ranks as threads in this process (no MPI)")
                      ->check(CLI::Range(1, 64));
  app.add_option("--emulate-link", cfg.emulate_link,
                 "Give the emulated ranks a simulated link, e.g. 1GB/s or 10Gbit/s,20us: each collective takes "
                 "the time a ring over it would (default: RUDA_EMULATE_LINK, else none)")
      ->needs(emulate);
  app.add_option("--log-every", cfg.log_every, "A progress line every N steps when not on a terminal")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--check-collectives", cfg.check_collectives,
               "Check that every rank calls the same collectives (debug; also RUDA_CHECK_COLLECTIVES=1)");
  app.add_option_function<std::string>(
         "--collective-timeout",
         [&](const std::string& text) {
           try {
             cfg.collective_timeout_ms = parse_collective_timeout(text, "--collective-timeout").count();
           } catch (const ArgumentError& e) {
             throw CLI::ValidationError(e.what());  // the message names the option
           }
         },
         "Under MPI, end the job when a collective has waited this long for the other ranks, naming the ranks "
         "that did not arrive: 300, 300s, 5m, 500ms or off (default: RUDA_COLLECTIVE_TIMEOUT, else 10m)")
      ->type_name("DURATION");
  app.add_option_function<std::string>(
         "--memory-limit",
         [&](const std::string& text) {
           try {
             cfg.memory_limit = memory::parse_size(text);
           } catch (const ArgumentError& e) {
             throw CLI::ValidationError("--memory-limit", e.what());
           }
         },
         "Tensor bytes per rank, e.g. 512MB, 2GiB (default: RUDA_MEMORY_LIMIT, else none). The plan printed "
         "before step 1 must fit, and an allocation past it is an error")
      ->type_name("SIZE");

  auto* mlp =
      app.add_subcommand("mlp", "A multilayer perceptron on Fashion-MNIST (reports test accuracy after every epoch)");
  mlp->fallthrough();
  mlp->add_option("--data", cfg.data, "Directory of the Fashion-MNIST IDX files (Debian: dataset-fashion-mnist)");
  mlp->add_option("--hidden", cfg.hidden, "Hidden layer sizes")->delimiter(',')->check(CLI::PositiveNumber);
  mlp->add_option("--limit", cfg.limit, "Train on the first N training images only")->check(CLI::NonNegativeNumber);
  mlp->add_option("--test-limit", cfg.test_limit, "Evaluate on the first N test images only")
      ->check(CLI::NonNegativeNumber);

  auto* lm =
      app.add_subcommand("lm", "A GPT-style byte-level language model (reports validation loss and bits per byte)");
  lm->fallthrough();
  lm->add_option("--text", cfg.text, "Text file, or a directory of text files (default: the fortunes package's texts)");
  lm->add_option("--context", cfg.context, "Context length in bytes")->check(CLI::PositiveNumber);
  lm->add_option("--d-model", cfg.d_model, "Model width")->check(CLI::PositiveNumber);
  lm->add_option("--layers", cfg.layers, "Transformer blocks")->check(CLI::PositiveNumber);
  lm->add_option("--heads", cfg.heads, "Attention heads")->check(CLI::PositiveNumber);
  lm->add_flag("--activation-checkpointing", cfg.activation_checkpointing,
               "Keep only each block's input through the forward pass and recompute the block in backward");
  lm->add_flag("--untied", cfg.untied, "Give the output head its own weights (default: tied to the token embedding)");
  lm->add_option("--eval-every", cfg.eval_every, "Validate every N steps")->check(CLI::NonNegativeNumber);
  lm->add_option("--eval-batches", cfg.eval_batches, "Validation batches")->check(CLI::PositiveNumber);
  lm->add_option("--sample", cfg.sample,
                 "After training, print N sampled bytes (with --steps 0 and --resume: sample a checkpoint)")
      ->check(CLI::NonNegativeNumber);
  lm->add_option("--prompt", cfg.prompt, "Text the sample continues");
  lm->add_option("--temperature", cfg.temperature, "Sampling temperature (0: greedy)")->check(CLI::NonNegativeNumber);

  const bool print = launcher_rank() == 0;
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    if (print) std::cout << app.help();
    return 0;
  } catch (const CLI::ParseError& e) {
    if (print) print_error(std::string(e.what()) + " (see --help)");
    return 2;
  }
  cfg.model = mlp->parsed() ? "mlp" : "lm";
  if (cfg.model == "lm") {
    if (app.get_option("--lr")->count() == 0) cfg.lr = 1e-3;
    if (cfg.steps == 0 && app.get_option("--steps")->count() == 0) cfg.steps = 1000;
  }
  if (cfg.batch == 0) cfg.batch = cfg.model == "mlp" ? 128 : 16;
  if (launched_by_mpi() && cfg.collective_timeout_ms < 0) {
    // Checked here, where one rank reports, rather than by every rank's communicator.
    try {
      (void)collective_timeout_from_env();
    } catch (const std::exception& e) {
      if (print) print_error(e.what());
      return 2;
    }
  }
  if (cfg.resume_latest && cfg.checkpoint_dir.empty()) {
    if (print) print_error("--resume-latest needs --checkpoint-dir");
    return 2;
  }
  // --resume-latest resumes from the newest complete checkpoint there (its `latest` pointer, or the
  // newest step with an index when the pointer is missing or dangling), and starts afresh only
  // when there is none. Every rank sees the same directory, so every rank decides alike.
  if (cfg.resume_latest) {
    try {
      if (!nn::holds_checkpoint(cfg.checkpoint_dir)) cfg.resume_latest = false;
    } catch (const std::exception& e) {
      if (print) print_error(e.what());
      return 1;
    }
  }

  try {
    if (cfg.memory_limit > 0) memory::set_limit(cfg.memory_limit);
    if (cfg.emulate > 0) {
      if (launched_by_mpi()) throw std::runtime_error("--emulate runs ranks as threads: do not launch it with mpiexec");
      EmulatedOptions options;
      if (!cfg.emulate_link.empty()) options.link = LinkModel::parse(cfg.emulate_link, "--emulate-link");
      run_ranks(
          cfg.emulate, [&](Communicator& comm) { run(cfg, comm); }, options);
      return 0;
    }
    if (launched_by_mpi()) {
#ifdef RUDA_TRAIN_WITH_MPI
      MpiEnvironment mpi(argc, argv);
      MpiCommunicator comm;
      if (cfg.collective_timeout_ms >= 0) comm.set_timeout(std::chrono::milliseconds(cfg.collective_timeout_ms));
      try {
        run(cfg, comm);
      } catch (const Reported&) {
        return 1;  // every rank knows; each exits by itself
      }
      return 0;
#else
      throw std::runtime_error("this ruda-train was built without MPI");
#endif
    }
    LocalCommunicator comm;
    run(cfg, comm);
    return 0;
  } catch (const Reported&) {
    return 1;
  } catch (const std::exception& e) {
    // Past the agreed setup only the failing rank reports: name it.
    print_error((launched_by_mpi() ? "rank " + std::to_string(launcher_rank()) + ": " : std::string()) + e.what());
#ifdef RUDA_TRAIN_WITH_MPI
    // A failure on one MPI rank in the middle of training: end the whole job, never a hang.
    if (launched_by_mpi() && MpiEnvironment::active()) return mpi_abort_on_exception([&]() -> int { throw; });
#endif
    return 1;
  }
}
