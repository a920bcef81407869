#include "tasks.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <limits>
#include <mutex>
#include <numbers>
#include <optional>

namespace ruda::train {
namespace {

// A data set's fingerprint as a resume compares it: FNV-1a over the bytes mixed in, as 16 hex digits.
class Fingerprint {
 public:
  void mix(const void* data, std::size_t bytes) {
    for (std::size_t i = 0; i < bytes; ++i)
      hash_ = (hash_ ^ static_cast<const unsigned char*>(data)[i]) * 1099511628211ull;
  }
  std::string hex() const {
    char out[17];
    std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(hash_));
    return out;
  }

 private:
  std::uint64_t hash_ = 14695981039346656037ull;
};

// Before any step, what would otherwise stop the run later: test images of another size than
// the training ones (the first evaluation, after an epoch's training, failed in a linear layer)
// and labels outside the ten classes (cross_entropy failed at the batch that held one, mid-run,
// without naming the file). Returns the training set's identity as a resume compares it (lm's
// --text has the same): its size and a hash of its first 4096 labels and first image. The files
// are read through copies opened for this, so that the run's own data_bytes_read counts what
// training reads.
std::string check_and_identify(const Config& cfg, const nn::IdxImages& train, const nn::IdxImages& test) {
  // (Named here: images of no pixels failed in the first Linear, an empty test set at the first
  // evaluation, neither naming the data.)
  if (train.rows() == 0 || train.cols() == 0) {
    throw IOError(cfg.data + ": the training images are " + std::to_string(train.rows()) + "x" +
                  std::to_string(train.cols()) + ": images without pixels");
  }
  if (test.size() == 0) throw IOError(cfg.data + ": the test set holds no images");
  if (train.rows() != test.rows() || train.cols() != test.cols()) {
    throw IOError(cfg.data + ": the test images are " + std::to_string(test.rows()) + "x" +
                  std::to_string(test.cols()) + ", the training images " + std::to_string(train.rows()) + "x" +
                  std::to_string(train.cols()));
  }
  Fingerprint fingerprint;
  for (const bool is_train : {true, false}) {
    const nn::IdxImages copy = nn::open_fashion_mnist(cfg.data, is_train, is_train ? cfg.limit : cfg.test_limit);
    const auto labels = copy.labels(0, copy.size()).to_vector<std::int64_t>();
    const auto bad = std::find_if(labels.begin(), labels.end(), [](std::int64_t l) { return l < 0 || l >= 10; });
    if (bad != labels.end()) {
      throw IOError(cfg.data + ": the " + (is_train ? "training" : "test") + " labels hold " + std::to_string(*bad) +
                    " at sample " + std::to_string(bad - labels.begin()) + "; Fashion-MNIST's classes are 0 to 9");
    }
    if (is_train) {
      fingerprint.mix(labels.data(), std::min<std::size_t>(labels.size(), 4096) * sizeof(std::int64_t));
      if (copy.size() > 0) {
        const auto image = copy.images(0, 1).to_vector<float>();
        fingerprint.mix(image.data(), image.size() * sizeof(float));
      }
    }
  }
  return std::to_string(train.size()) + " images " + std::to_string(train.rows()) + "x" + std::to_string(train.cols()) +
         ", hash " + fingerprint.hex();
}

// Fashion-MNIST, opened, checked and identified once per process: emulated ranks share the open
// files (and the one decompression of a gzip file into the cache). Each rank reads only the
// samples it uses.
struct ImageData {
  nn::IdxImages train, test;
  std::string identity;  // check_and_identify's
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
    std::string identity = check_and_identify(cfg, train, test);
    it = cache.emplace(key, ImageData{std::move(train), std::move(test), std::move(identity)}).first;
  }
  return it->second;
}

struct MlpTask : Task {
  const Config& cfg;
  Communicator& comm;
  nn::IdxImages train, test;
  std::string data_identity;  // the training set in the data stream a checkpoint records
  std::shared_ptr<nn::Sequential> model;
  std::unique_ptr<nn::BatchSampler> sampler;

  MlpTask(const Config& c, Communicator& comm_) : MlpTask(c, comm_, datasets(c)) {}
  MlpTask(const Config& c, Communicator& comm_, ImageData data)
      : cfg(c),
        comm(comm_),
        // Each rank counts its own reads (emulated ranks share the process's data set, whose
        // counter summed every rank's: each rank's data_bytes_read was the whole job's).
        train(data.train.counting_apart()),
        test(data.test.counting_apart()),
        data_identity(std::move(data.identity)) {
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
    if (cfg.batch > train.size()) {
      // Named by the options, not by the sampler that would refuse it.
      throw ArgumentError("--batch " + std::to_string(cfg.batch) + " (global) exceeds the " +
                          std::to_string(train.size()) + " training images" +
                          (cfg.limit > 0 ? " that --limit " + std::to_string(cfg.limit) + " keeps" : std::string()));
    }
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
  std::int64_t total_steps() const override {
    std::int64_t steps = 0;
    if (__builtin_mul_overflow(cfg.epochs, sampler->batches_per_epoch(), &steps)) {
      throw ArgumentError("mlp: --epochs " + std::to_string(cfg.epochs) + " of " +
                          std::to_string(sampler->batches_per_epoch()) + " steps each overflow a step count");
    }
    return steps;
  }
  std::int64_t samples_per_step() const override { return cfg.batch; }
  std::map<std::string, std::string> data_stream() const override {
    return {{"--seed", std::to_string(cfg.seed)},
            {"--batch", std::to_string(cfg.batch)},
            {"--limit", std::to_string(cfg.limit)},
            {"--data", data_identity}};
  }
  std::map<std::string, std::string> shared_data() const override {
    auto shared = data_stream();
    shared["the test set"] = std::to_string(test.size()) + " images";  // (evaluation divides it among the ranks)
    return shared;
  }
  std::string where(std::int64_t step) const override {
    return "epoch " + std::to_string(step / sampler->batches_per_epoch() + 1) + "/" + std::to_string(cfg.epochs);
  }
  Tensor loss(std::int64_t step) override {
    const std::int64_t per_epoch = sampler->batches_per_epoch();
    return loss_of(sampler->indices(step / per_epoch, step % per_epoch));
  }
  Tensor micro_loss(std::int64_t step, std::int64_t micro, std::int64_t micro_batches) override {
    const std::int64_t per_epoch = sampler->batches_per_epoch();
    const Tensor idx = sampler->indices(step / per_epoch, step % per_epoch);
    const std::int64_t rows = idx.numel() / micro_batches;
    return loss_of(idx.slice(0, micro * rows, (micro + 1) * rows));
  }
  Tensor probe_loss(std::int64_t local_batch) override {
    return loss_of(arange(0, static_cast<double>(local_batch), 1, DType::i64));
  }
  Tensor loss_of(const Tensor& idx) {
    const Tensor logits = model->forward(train.images(idx));
    return nn::cross_entropy(cast(logits, DType::f32), train.labels(idx), {.reduction = nn::LossReduction::sum}) /
           static_cast<double>(cfg.batch);
  }
  nlohmann::json evaluate(std::int64_t step, bool final) override {
    const bool epoch_end = (step + 1) % sampler->batches_per_epoch() == 0;
    if (!epoch_end && !final) return {};
    // Chunks of the local training batch keep evaluation within the memory a step was planned with.
    const nn::ClassifierScore score =
        nn::evaluate_classifier(*model, comm, test, cfg.batch / comm.world_size() / micro_batches);
    return {{"test_accuracy", score.accuracy}, {"test_loss", score.loss}};
  }
};

// Before the model is built: a configuration whose parameters, gradients and AdamW moments (16
// bytes a parameter, sharded over the ranks) exceed this machine's memory is refused from the
// arithmetic (--layers 2147483648 grew without bound while its modules were built). Sizes this
// machine could hold are left to the memory plan, which weighs them against --memory-limit and
// says what would fit.
void check_model_size(const Config& cfg, int world) {
  const long double d = static_cast<long double>(cfg.d_model), vocabulary = 256;
  const long double per_block = 12 * d * d + 13 * d;  // qkv, projection, fc1, fc2, two norms
  const long double parameters = static_cast<long double>(cfg.layers) * per_block + (vocabulary + cfg.context) * d +
                                 2 * d + (cfg.untied ? vocabulary * d + vocabulary : 0);
  const long double state = 16 * parameters / world;
  const long double machine =
      static_cast<long double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<long double>(::sysconf(_SC_PAGESIZE));
  if (machine > 0 && state > machine) {
    char needed[64], has[64];
    std::snprintf(needed, sizeof needed, "%.3Lg", state / 1e9);
    std::snprintf(has, sizeof has, "%.3Lg", machine / 1e9);
    throw OutOfMemoryError(
        "lm: --layers " + std::to_string(cfg.layers) + " of --d-model " + std::to_string(cfg.d_model) + " needs ~" +
        needed + " GB per rank for parameters, gradients and optimizer state alone; this machine has " + has + " GB");
  }
}

struct LmTask : Task {
  const Config& cfg;
  Communicator& comm;
  std::shared_ptr<nn::GPT> model;
  // The text's first 9/10 trains, the rest validates; each rank reads only its own windows.
  std::optional<nn::TextWindows> train, validation;
  std::string text_identity;  // the corpus in the data stream a checkpoint records

  LmTask(const Config& c, Communicator& comm_) : cfg(c), comm(comm_) {
    const nn::TextCorpus corpus(c.text);
    text_identity = identity_of(corpus);
    // The first 9/10 of n bytes train, the rest validates; each part must hold a window of
    // context + 1 bytes. "- 1 < context", not "< context + 1", which wraps for a context near
    // INT64_MAX.
    auto holds_windows = [&](std::int64_t n) {
      const std::int64_t train_bytes = n * 9 / 10;
      return n - train_bytes - 1 >= cfg.context && train_bytes - 1 >= cfg.context;
    };
    if (!holds_windows(corpus.size())) {
      // The fewest bytes that do (about 10 x (context + 1)), said so that a user need not guess.
      std::string fewest;
      if (cfg.context <= std::numeric_limits<std::int64_t>::max() / 100) {
        std::int64_t n = 10 * cfg.context;
        while (!holds_windows(n)) ++n;
        fewest = " (it needs at least " + std::to_string(n) +
                 ": the last tenth validates, and each part holds a window of context + 1 bytes)";
      }
      throw IOError(cfg.text + ": " + std::to_string(corpus.size()) + " bytes are too few for context " +
                    std::to_string(cfg.context) + fewest);
    }
    const std::int64_t train_end = corpus.size() * 9 / 10;
    train.emplace(corpus, 0, train_end, cfg.context);
    validation.emplace(corpus, train_end, corpus.size(), cfg.context);
    check_model_size(cfg, comm.world_size());
    nn::manual_seed(cfg.seed);
    nn::DeferredInit deferred;  // parameters are materialized by fully_shard, each rank its slice
    model = std::make_shared<nn::GPT>(nn::GPTConfig{.vocabulary = 256,
                                                    .context = cfg.context,
                                                    .d_model = cfg.d_model,
                                                    .layers = cfg.layers,
                                                    .heads = cfg.heads,
                                                    .tied_head = !cfg.untied});
    model->set_activation_checkpointing(cfg.activation_checkpointing);
    if (cfg.recompute_gelu) model->set_gelu_backward(GeluBackward::recompute);
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
  std::int64_t data_bytes_read() const override { return train->bytes_read() + validation->bytes_read(); }
  std::int64_t total_steps() const override { return cfg.steps; }
  std::int64_t samples_per_step() const override { return cfg.batch; }
  std::string where(std::int64_t) const override { return ""; }
  std::map<std::string, std::string> data_stream() const override {
    return {{"--seed", std::to_string(cfg.seed)}, {"--batch", std::to_string(cfg.batch)}, {"--text", text_identity}};
  }
  // The text as a resume compares it: its size and a hash of its first 4 KiB (another file, or
  // the same one grown or edited at its start, is other samples), without reading all of it.
  static std::string identity_of(const nn::TextCorpus& corpus) {
    const std::vector<std::uint8_t> head = corpus.read(0, std::min<std::int64_t>(corpus.size(), 4096));
    Fingerprint fingerprint;
    fingerprint.mix(head.data(), head.size());
    return std::to_string(corpus.size()) + " bytes, first 4 KiB " + fingerprint.hex();
  }
  Tensor loss(std::int64_t step) override { return loss_on(step, cfg.batch); }
  Tensor micro_loss(std::int64_t step, std::int64_t micro, std::int64_t micro_batches) override {
    const auto [x, y] = train->batch(cfg.seed, step, cfg.batch, comm.rank(), comm.world_size());
    const std::int64_t rows = x.shape()[0] / micro_batches;
    // Copies of the micro-batch's rows, not views: the graph keeps the indices and targets it
    // read through backward, and a view kept the whole local batch's (more than the memory plan,
    // which measures a micro-batch's own step, counted: runs at a limit set to the plan failed).
    const Tensor xs = x.slice(0, micro * rows, (micro + 1) * rows).clone();
    const Tensor ys = y.slice(0, micro * rows, (micro + 1) * rows).clone();
    return nn::cross_entropy(cast(model->forward(xs), DType::f32), ys, {.reduction = nn::LossReduction::sum}) /
           static_cast<double>(cfg.batch * cfg.context);
  }
  Tensor probe_loss(std::int64_t local_batch) override { return loss_on(0, local_batch * comm.world_size()); }
  Tensor loss_on(std::int64_t step, std::int64_t global_batch) {
    const auto [x, y] = train->batch(cfg.seed, step, global_batch, comm.rank(), comm.world_size());
    return nn::cross_entropy(cast(model->forward(x), DType::f32), y, {.reduction = nn::LossReduction::sum}) /
           static_cast<double>(cfg.batch * cfg.context);
  }
  bool can_checkpoint_activations() const override { return true; }
  void set_activation_checkpointing(bool on) override { model->set_activation_checkpointing(on); }
  bool can_recompute_gelu() const override { return true; }
  void set_recompute_gelu(bool on) override {
    model->set_gelu_backward(on ? GeluBackward::recompute : GeluBackward::keep_pre_activation);
  }
  nlohmann::json evaluate(std::int64_t step, bool final) override {
    if (!final && (cfg.eval_every <= 0 || (step + 1) % cfg.eval_every != 0)) return {};
    autograd::NoGradGuard guard;
    double loss_sum = 0;
    for (std::int64_t b = 0; b < cfg.eval_batches; ++b) {
      // Fixed validation windows (their own stream), the same at every evaluation.
      const auto [x, y] = validation->batch(cfg.seed ^ 0x5eed, b, cfg.batch, comm.rank(), comm.world_size());
      const std::int64_t rows = x.shape()[0] / micro_batches;
      for (std::int64_t m = 0; m < micro_batches; ++m) {
        const Tensor logits = model->forward(x.slice(0, m * rows, (m + 1) * rows));
        loss_sum += nn::cross_entropy(cast(logits, DType::f32), y.slice(0, m * rows, (m + 1) * rows),
                                      {.reduction = nn::LossReduction::sum})
                        .item();
      }
    }
    const double total = comm.all_reduce(scalar(loss_sum, DType::f64)).item();
    const double loss = total / static_cast<double>(cfg.eval_batches * cfg.batch * cfg.context);
    return {{"val_loss", loss}, {"val_bits_per_byte", loss / std::numbers::ln2}};
  }
  void after_training() override {
    if (cfg.sample <= 0) return;
    model->eval();
    const std::string out =
        nn::sample_bytes(*model, cfg.prompt, cfg.sample, cfg.context, cfg.temperature, cfg.seed ^ 0x5a3);
    if (comm.rank() == 0) std::cout << "--- sample ---\n" << cfg.prompt << out << "\n--------------" << std::endl;
  }
};

}  // namespace

std::unique_ptr<Task> make_task(const Config& cfg, Communicator& comm) {
  if (cfg.model == "mlp") return std::make_unique<MlpTask>(cfg, comm);
  return std::make_unique<LmTask>(cfg, comm);
}

}  // namespace ruda::train
