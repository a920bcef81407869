// ruda-train's job on one rank: setup agreed across the ranks, the memory plan, resuming, the
// training loop with its evaluations, checkpoints and metrics, and the summary.
#include "job.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <random>
#include <sstream>
#include <tuple>

#include "report.h"
#include "stop.h"
#include "tasks.h"

namespace ruda::train {

namespace fs = std::filesystem;
using nlohmann::json;

// The line in one write: written in pieces (prefix, message, newline), mpiexec's banner about
// another rank's exit could land between them (test_tools_cli saw "ruda-train: error: " cut off).
void print_error(const std::string& message) { std::cerr << ("ruda-train: error: " + message + "\n") << std::flush; }
void print_warning(const std::string& message) {
  std::cerr << ("ruda-train: warning: " + message + "\n") << std::flush;
}

namespace {

// Writes `text` into a new file at `path`: empty, or the system's reason it could not (a read-only
// file system, a full disk, no permission), which a failed std::ofstream did not keep.
std::string write_small_file(const fs::path& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return std::strerror(errno);
  const ssize_t written = ::write(fd, text.data(), text.size());
  int code = written < 0 ? errno : (static_cast<std::size_t>(written) == text.size() ? 0 : ENOSPC);
  if (::close(fd) != 0 && code == 0) code = errno;
  return code ? std::strerror(code) : std::string();
}

// Runs a setup phase on every rank and agrees on its outcome: if it failed anywhere, the lowest
// failing rank's message is printed once (by rank 0) and every rank leaves with a non-zero exit
// instead of waiting in a collective.
void setup_phase(Communicator& comm, const std::function<void()>& phase) {
  const auto failures = run_agreed(comm, "setup", phase);
  if (failures.empty()) return;
  // One message where every rank failed alike (a bad option); otherwise each reason with its
  // ranks: a file missing or unwritable on one node read as if it were so everywhere.
  const bool alike = failures.size() == static_cast<std::size_t>(comm.world_size()) &&
                     std::all_of(failures.begin(), failures.end(),
                                 [&](const RankFailure& f) { return f.message == failures.front().message; });
  if (comm.rank() == 0) print_error(alike ? failures.front().message : describe(failures));
  throw Reported("setup failed on rank " + std::to_string(failures.front().rank));
}

// Every rank reads the same data: a data set that differed on one rank (a copy that only partly
// reached its node) gave the ranks epochs of other lengths, and so collectives that no longer
// matched (heap corruption where the order check was off); an lm text that differed trained on
// other samples per rank to the end. Compared before any step, naming the first value that differs.
void check_same_data(Communicator& comm, const Task& task, const std::string& input) {
  std::string mine;
  for (const auto& [name, value] : task.shared_data()) mine += name + '\t' + value + '\n';
  const std::vector<std::string> all = all_gather_text(comm, mine, "the data every rank reads");
  auto values = [](const std::string& text) {
    std::map<std::string, std::string> out;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) {
      if (const std::size_t tab = line.find('\t'); tab != std::string::npos)
        out[line.substr(0, tab)] = line.substr(tab + 1);
    }
    return out;
  };
  setup_phase(comm, [&] {  // every rank compares the same texts, so every rank fails alike
    for (std::size_t r = 1; r < all.size(); ++r) {
      if (all[r] == all[0]) continue;
      auto theirs = values(all[r]);
      std::string what;
      for (const auto& [name, value] : values(all[0])) {
        if (theirs[name] != value) {
          what = name + ": " + value + " on rank 0, " + theirs[name] + " on rank " + std::to_string(r);
          break;
        }
      }
      throw IOError(input + ": the ranks read different data (" + what +
                    "): every rank needs the same files, at the same path on every host");
    }
  });
}

// --- outputs, checked before any step ---

// Where `path` lies against `place`, compared as canonical paths (links resolved as far as they
// exist): the same file or directory, inside it (a directory), or elsewhere.
enum class Placement { elsewhere, same, inside };
Placement placement(const fs::path& path, const fs::path& place) {
  std::error_code ec;
  if (fs::exists(path, ec) && fs::exists(place, ec) && fs::equivalent(path, place, ec)) return Placement::same;
  std::error_code within_ec;
  const fs::path a = fs::weakly_canonical(path, within_ec), b = fs::weakly_canonical(place, within_ec);
  if (within_ec) return Placement::elsewhere;
  const fs::path rel = a.lexically_relative(b);
  if (rel == ".") return Placement::same;
  return !rel.empty() && *rel.begin() != ".." ? Placement::inside : Placement::elsewhere;
}

// The run's training data: --text for lm, --data for the others.
const std::string& data_input(const Config& cfg) { return cfg.model == "lm" ? cfg.text : cfg.data; }

// A --checkpoint-dir the saves could not write (a file, a device, a read-only place, a name too
// long) used to fail at the first save, after the training it was to keep. And a fresh run (no
// --resume, no --resume-latest) into a directory holding another run's checkpoints replaced their
// steps with its own and pruned among both runs' (its own newest could go, the old latest stay):
// refused, naming the ways on. Each rank probes with a file of its own (every rank writes its
// shard's file at a save).
void check_checkpoint_dir(const Config& cfg, int rank) {
  const fs::path dir(cfg.checkpoint_dir);
  std::error_code ec;
  // A step directory or a place inside one (a checkpoint there was hidden behind the step), as the
  // first save would find only after the training.
  if (const std::string conflict = nn::checkpoint_dir_conflict(cfg.checkpoint_dir); !conflict.empty())
    throw ArgumentError("--checkpoint-dir " + cfg.checkpoint_dir + ": " + conflict);
  // lm's --text directory itself: its regular files are the corpus, so the checkpoint directory's
  // own (latest, the save lock) were read as text by the next run, which then refused to resume
  // ("the resumed run would train on other samples"). Its subdirectories are not read, and the mlp
  // task opens its --data files by name.
  if (cfg.model == "lm" && !cfg.text.empty() && fs::is_directory(cfg.text, ec) &&
      placement(dir, cfg.text) == Placement::same) {
    throw ArgumentError("--checkpoint-dir " + cfg.checkpoint_dir + ": is the --text directory " + cfg.text +
                        ", whose files are the corpus: its checkpoint files would be read as text");
  }
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) {
    throw ArgumentError("--checkpoint-dir " + cfg.checkpoint_dir + ": is not a directory");
  }
  fs::create_directories(dir, ec);
  if (ec) throw IOError("--checkpoint-dir " + cfg.checkpoint_dir + ": cannot be created: " + ec.message());
  const fs::path probe = dir / (".ruda-train-probe-" + std::to_string(::getpid()) + "-" + std::to_string(rank));
  if (const std::string refused = write_small_file(probe, "probe\n"); !refused.empty()) {
    fs::remove(probe, ec);
    throw IOError("--checkpoint-dir " + cfg.checkpoint_dir + ": cannot write a file there: " + refused);
  }
  fs::remove(probe, ec);
  if (cfg.resume.empty() && !cfg.resume_latest && nn::holds_checkpoint(cfg.checkpoint_dir)) {
    throw ArgumentError("--checkpoint-dir " + cfg.checkpoint_dir + " already holds checkpoints (latest " +
                        nn::resolve_checkpoint(cfg.checkpoint_dir) +
                        "): continue that run with --resume-latest, or give another directory (a fresh run would "
                        "replace and prune its steps)");
  }
}

// Every rank must see the directory rank 0 sees: rank 0 alone writes each step's index and the
// latest pointer, for every rank's files. A directory of the same path on machines that share no
// file system (a node-local disk) saved steps "successfully" that held rank 0's file alone, with
// latest naming them, which no resume could load; and the other nodes' copies were never pruned.
// Rank 0 leaves a marker named by a random token, the token reaches every rank (one all-reduce),
// and each rank looks for that marker; rank 0 removes it whatever the outcome.
void check_shared_checkpoint_dir(const Config& cfg, Communicator& comm) {
  const fs::path dir(cfg.checkpoint_dir);
  auto marker = [&](std::int64_t token) { return dir / (".ruda-train-shared-" + std::to_string(token)); };
  std::int64_t token = 0;
  if (comm.rank() == 0) {
    std::random_device random;
    token = static_cast<std::int64_t>((std::uint64_t{random()} << 20 ^ random()) % (std::int64_t{1} << 52)) + 1;
  }
  struct Removal {
    fs::path path;
    ~Removal() {
      std::error_code ec;
      if (!path.empty()) fs::remove(path, ec);
    }
  } written;
  setup_phase(comm, [&] {
    if (comm.rank() != 0) return;
    written.path = marker(token);
    if (const std::string refused = write_small_file(
            written.path, "a ruda-train run's check that every rank sees this directory: removed when it ends\n");
        !refused.empty()) {
      throw IOError("--checkpoint-dir " + cfg.checkpoint_dir + ": cannot write a file there: " + refused);
    }
  });
  // Below 2^53: exact through the all-reduce's sum of the other ranks' zeros.
  token = static_cast<std::int64_t>(comm.all_reduce(from_values({static_cast<double>(token)}, {1}, DType::i64)).item());
  setup_phase(comm, [&] {
    std::error_code ec;
    if (comm.rank() != 0 && !fs::exists(marker(token), ec)) {
      throw IOError("--checkpoint-dir " + cfg.checkpoint_dir + ": rank " + std::to_string(comm.rank()) +
                    " does not see the file rank 0 wrote there: every rank needs the same directory (one file system "
                    "all nodes share), since rank 0 writes each checkpoint's index for every rank's files");
    }
  });
}

// The metrics file is truncated when a run starts: it must not be one of the run's inputs (the
// text, the data, the checkpoint resumed) or a checkpoint's file, and must be a regular file (a
// device swallowed every write; a FIFO blocked the run until something read it).
void check_metrics_path(const Config& cfg) {
  const fs::path path(cfg.metrics);
  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (fs::exists(status) && !fs::is_regular_file(status)) {
    throw ArgumentError("--metrics " + cfg.metrics + ": is not a regular file");
  }
  // The model's own data (a file, or a directory whose files it reads: a metrics file there would
  // be read as data next time), and the resumed checkpoint itself (a file inside its steps is a
  // checkpoint member, below; beside them, in its directory, metrics are welcome).
  for (const auto& [input, whole_directory] : {std::pair{data_input(cfg), true}, std::pair{cfg.resume, false}}) {
    if (input.empty()) continue;
    const Placement where = placement(path, input);
    const bool same = where == Placement::same, inside = whole_directory && where == Placement::inside;
    if (same || inside) {
      throw ArgumentError("--metrics " + cfg.metrics + ": is " + (same ? "" : "inside ") + input +
                          ", an input of this run (the metrics file is rewritten from the start)");
    }
  }
  if (const std::string member = nn::checkpoint_member(cfg.metrics); !member.empty()) {
    throw ArgumentError("--metrics " + cfg.metrics + ": " + member + " (writing it would damage the checkpoint)");
  }
}

// --- the memory plan ---

// A flag that would change the step's memory (set(true) turns it on, set(false) off again), with
// the step measured that way.
struct Alternative {
  std::string flag;
  std::function<void(bool)> set;
  nn::StepProbe probe;
};

// Measures the step at `samples` samples a micro-batch (collective), as probe_step does; none
// where the module does not exist yet (the state check).
using Remeasure = std::function<nn::StepProbe(std::int64_t samples)>;

// The smallest world size at which `batch` fits the step `probe` describes, each candidate measured
// again at its own local batch before it is named: the probe's line through 1 and 2 samples falls
// short beyond them (a step's peak is convex in the batch), and a refusal at 2 ranks named 4 ranks,
// or --recompute-gelu, or --activation-checkpointing, each refused in its turn. A candidate
// measured over the limit gives way to the next the new measurement names. `limit` must be the
// same on every rank (the probes are collective).
int fitting_world(Task& task, std::int64_t batch, std::optional<nn::StepProbe> probe, std::int64_t limit,
                  const nn::PlanOptions& options, const Remeasure& remeasure) {
  nn::PlanOptions full = options;  // the answer is a fully sharded world
  full.shard_ranks = 0;
  int fits = nn::smallest_fitting_world(task.module(), batch, probe, limit, options);
  while (fits > 0 && probe && remeasure) {
    const std::int64_t local = batch / fits;
    if (local <= 2) break;  // the line is exact at 1 and 2 samples
    const nn::StepProbe measured = remeasure(local);
    if (nn::plan_memory(task.module(), fits, batch, measured, full).peak() <= limit) break;
    probe = measured;
    const int next = nn::smallest_fitting_world(task.module(), batch, probe, limit, options);
    fits = next > fits ? next : 0;  // (exact at `fits` now, and over: a smaller world holds more)
  }
  return fits;
}

// "needs ~1.9 GB per rank at 1 rank; limit 256 MB; fits at 8 ranks, or at 4 with --activation-checkpointing"

std::string refusal(Task& task, const nn::MemoryPlan& plan, std::int64_t limit, std::int64_t batch,
                    const std::optional<nn::StepProbe>& probe, const std::vector<Alternative>& alternatives,
                    const nn::PlanOptions& options, const Remeasure& remeasure = {}, std::int64_t hint_limit = 0) {
  // The hints fit `hint_limit` where given (with remeasure: every rank's smallest), else `limit`.
  const std::int64_t fit_limit = hint_limit > 0 ? hint_limit : limit;
  const std::string other_ranks =
      fit_limit < limit ? " (another rank's limit, " + memory::format_bytes(fit_limit) + ", sets what fits)" : "";
  const int world = plan.world_size;
  std::string out = "memory plan: needs " + std::string(plan.measured() ? "~" : "at least ") +
                    memory::format_bytes(plan.peak()) + " per rank at " + std::to_string(world) +
                    (world == 1 ? " rank" : " ranks") +
                    (plan.measured()     ? ""
                     : plan.gathered > 0 ? " before activations (parameters, gradients, optimizer state and the "
                                           "largest layer's gathered weight)"
                                         : " before activations (parameters, gradients and optimizer state)") +
                    "; limit " + memory::format_bytes(limit) + other_ranks;
  const int fits = fitting_world(task, batch, probe, fit_limit, options, remeasure);
  out += fits > 0 ? "; " + std::string(plan.measured() ? "fits" : "that much fits") + " at " + std::to_string(fits) +
                        " ranks"
                  : "; fits at no world size with --batch " + std::to_string(batch);
  for (const Alternative& a : alternatives) {
    a.set(true);
    const int with = fitting_world(task, batch, a.probe, fit_limit, options, remeasure);
    a.set(false);
    if (with > 0 && (fits == 0 || with < fits)) out += ", or at " + std::to_string(with) + " with " + a.flag;
  }
  return out;
}

// Before any parameter exists: refuses a configuration whose sharded state alone exceeds the limit.
void check_state_fits(const Config& cfg, Communicator& comm, Task& task, const nn::PlanOptions& options) {
  const std::int64_t limit = memory::limit();
  const nn::MemoryPlan state = nn::plan_state(task.module(), comm.world_size(), cfg.batch, options);
  if (limit > 0 && state.peak() > limit) {
    throw OutOfMemoryError(refusal(task, state, limit, cfg.batch, std::nullopt, {}, options));
  }
}

// With the shards in place: measures a step on micro-batches and returns the plan, with the
// refusal of a configuration over this rank's limit naming what would fit. Unless --no-auto-fit,
// a plan over the limit tries the schedules that trade speed for memory first (nn::fit_schedule)
// and keeps the first that fits, saying so in one line. Collective: every rank runs the same
// probes whatever its own limit says, and the caller agrees on the refusal.
struct MeasuredPlan {
  nn::MemoryPlan plan;
  nn::MemorySchedule schedule;
  std::string refusal;  // empty when it fits
};

MeasuredPlan measure_plan(const Config& cfg, Communicator& comm, Task& task, const nn::MemorySchedule& configured,
                          const nn::PlanOptions& options) {
  auto step = [&](std::int64_t b) { return task.probe_loss(b); };
  const std::int64_t limit = memory::limit();
  // A step computes one micro-batch at a time: plan for that (its activations), and suggest
  // whole batches of micro-batches.
  const std::int64_t batch = cfg.batch / cfg.grad_accum;
  if (cfg.no_auto_fit) {
    nn::MemoryPlan plan = nn::plan_memory(task.module(), comm, batch, step, limit, options);
    const bool over = limit > 0 && plan.peak() > limit;
    // Whether any rank is over: then every rank probes the recomputing flags for the refusal's hints.
    if (agree_on_failure(comm, over ? "over the limit" : "", "memory plan").empty()) return {plan, configured, ""};
    std::vector<Alternative> alternatives;
    if (task.can_recompute_gelu() && !configured.recompute_gelu) {
      alternatives.push_back({"--recompute-gelu", [&task](bool on) { task.set_recompute_gelu(on); }, {}});
    }
    if (task.can_checkpoint_activations() && !configured.activation_checkpointing) {
      alternatives.push_back(
          {"--activation-checkpointing", [&task](bool on) { task.set_activation_checkpointing(on); }, {}});
    }
    for (Alternative& a : alternatives) {
      a.set(true);
      a.probe = nn::probe_step(task.module(), comm, step);
      a.set(false);
    }
    // Every rank measures the hints' candidates alike: against the smallest limit of any rank.
    const double smallest =
        -comm.all_reduce(from_values({-static_cast<double>(limit > 0 ? limit : INT64_MAX)}, {1}, DType::f64),
                         Reduction::max, {.tag = "memory plan"})
             .item();
    const auto agreed = static_cast<std::int64_t>(std::min(smallest, 9.0e18));
    const Remeasure remeasure = [&](std::int64_t samples) {
      return nn::probe_step(task.module(), comm, step, samples);
    };
    const std::string refused =
        refusal(task, plan, limit, cfg.batch, plan.probe, alternatives, options, remeasure, agreed);
    return {plan, configured, over ? refused + " (--no-auto-fit: no other schedule tried)" : ""};
  }
  nn::FitOptions fit_options;
  fit_options.plan = options;
  if (task.can_checkpoint_activations()) {
    fit_options.set_activation_checkpointing = [&task](bool on) { task.set_activation_checkpointing(on); };
  }
  if (task.can_recompute_gelu()) {
    fit_options.set_recompute_gelu = [&task](bool on) { task.set_recompute_gelu(on); };
  }
  fit_options.max_micro_batches = cfg.batch / comm.world_size();  // the last concession: any that divides
  const nn::FittedSchedule fit = nn::fit_schedule(task.module(), comm, cfg.batch, step, limit, configured, fit_options);
  const nn::MemoryPlan& first = fit.configured;
  if (fit.fits) {
    if (fit.tried.size() > 1 && comm.rank() == 0) {
      std::cout << "memory plan: ~" << memory::format_bytes(first.peak()) << " per rank with " << configured.describe()
                << " is over the limit of " << memory::format_bytes(limit) << "; chose "
                << fit.schedule.describe(!cfg.per_parameter) << " (~" << memory::format_bytes(fit.plan.peak()) << ")"
                << std::endl;
    }
    return {fit.plan, fit.schedule, ""};
  }
  // Nothing fits here; a rank over the limit says what would, with the leanest schedule.
  const bool over = limit > 0 && first.peak() > limit;
  std::string out;
  if (over) {
    const int world = comm.world_size();
    out = "memory plan: needs ~" + memory::format_bytes(first.peak()) + " per rank at " + std::to_string(world) +
          (world == 1 ? " rank" : " ranks") + "; limit " + memory::format_bytes(limit) +
          "; no schedule fits (the leanest, " + fit.schedule.describe(!cfg.per_parameter) + ", needs ~" +
          memory::format_bytes(fit.plan.peak()) + ")";
    // What fits with the leanest schedule's probe in one batch per step (more ranks, a smaller
    // batch): micro-batches could only add to that.
    const int fits = nn::smallest_fitting_world(task.module(), cfg.batch, fit.plan.probe, limit, options);
    const std::int64_t smaller =
        nn::largest_fitting_batch(task.module(), world, cfg.batch, fit.plan.probe, limit, options);
    if (fits > 0) out += "; fits at " + std::to_string(fits) + " ranks";
    if (smaller > 0) out += std::string(fits > 0 ? ", or" : ";") + " with --batch " + std::to_string(smaller);
    if (fits == 0 && smaller == 0) out += "; fits at no world size with --batch " + std::to_string(cfg.batch);
  }
  return {fit.plan, configured, out};
}

// --- the training loop ---

// " test_accuracy 84.20% test_loss 0.4412": each figure of an evaluation after `separator`.
std::string format_evaluation(const json& evaluation, const char* separator) {
  std::string out;
  for (const auto& [name, value] : evaluation.items()) {
    char buf[96];
    const bool percent = name == "test_accuracy";
    std::snprintf(buf, sizeof buf, percent ? "%s%s %.2f%%" : "%s%s %.4f", separator, name.c_str(),
                  percent ? value.get<double>() * 100 : value.get<double>());
    out += buf;
  }
  return out;
}

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

}  // namespace

int run(const Config& cfg, Communicator& comm) {
  // This rank's own memory figures (emulated ranks and MPI processes alike); the dataset shared
  // by a process is loaded outside it.
  memory::Scope rank_memory;
  if (cfg.check_collectives) comm.set_order_check(true);
  const bool main_rank = comm.rank() == 0;
  // Declared first, destroyed last: the model's groups point at its communicators.
  std::optional<ShardMesh> mesh;
  std::unique_ptr<Task> task;
  std::unique_ptr<nn::Optimizer> optimizer;
  std::int64_t start_step = 0;
  nn::CheckpointInfo resumed;
  nn::MemoryPlan plan;
  const auto begin = std::chrono::steady_clock::now();

  // Hybrid sharding: the nodes (a collective split; a layout that does not tile the world is a
  // TopologyError on every rank). The model is sharded over `shard_comm`, the data over `comm`.
  setup_phase(comm, [&] {
    if (cfg.hybrid && cfg.per_parameter) throw ArgumentError("--hybrid needs grouped parameters (not --per-parameter)");
    if (cfg.gather_quantization != "none" && cfg.per_parameter) {
      throw ArgumentError("--gather-quantization needs grouped parameters (not --per-parameter)");
    }
    // (Named by the option here: ShardMesh's own error names ShardMesh::by_node. --emulate's nodes
    // were checked before the ranks started.)
    if (cfg.hybrid && comm.kind() != "emulated" && cfg.ranks_per_node > 0 &&
        comm.world_size() % cfg.ranks_per_node != 0) {
      throw ArgumentError("--ranks-per-node " + std::to_string(cfg.ranks_per_node) + " does not divide the " +
                          std::to_string(comm.world_size()) + (comm.world_size() == 1 ? " rank" : " ranks") +
                          " of this job into nodes of equal size");
    }
    if (cfg.hybrid) mesh = ShardMesh::by_node(comm, comm.kind() == "emulated" ? 0 : cfg.ranks_per_node);
  });
  Communicator& shard_comm = mesh ? mesh->shard() : comm;
  if (cfg.check_collectives) shard_comm.set_order_check(true);
  if (mesh && cfg.check_collectives) mesh->replicate().set_order_check(true);

  nn::ShardPolicy policy;
  policy.strategy = cfg.strategy == "retain" ? nn::CheckpointStrategy::retain : nn::CheckpointStrategy::recompute;
  if (parse_dtype(cfg.dtype) != DType::f32) policy.compute_dtype = parse_dtype(cfg.dtype);
  if (cfg.gather_quantization == "int8") policy.gather_quantization = nn::GatherQuantization::int8;
  if (main_rank && cfg.gather_quantization != "none" && shard_comm.world_size() == 1) {
    // One rank per shard group (one rank, or hybrid with one per node) gathers nothing: the codes
    // would save no bytes and still round the weights every forward uses.
    print_warning("--gather-quantization " + cfg.gather_quantization +
                  " saves nothing with one rank per shard group (nothing is gathered) and still rounds the "
                  "weights the forward uses");
  }
  const nn::PlanOptions plan_options{.optimizer_states = 2,
                                     .compute_dtype = policy.compute_dtype,
                                     .shard_ranks = shard_comm.world_size(),
                                     .accumulating = cfg.grad_accum > 1};
  // Without collectives: the options, the data, the model (deferred: no parameter is allocated)
  // and whether its sharded state alone fits the limit.
  setup_phase(comm, [&] {
    if (!cfg.backend.empty()) set_default_backend(cfg.backend);
    if (cfg.batch % comm.world_size() != 0) {
      throw ArgumentError("--batch " + std::to_string(cfg.batch) + " does not divide over " +
                          std::to_string(comm.world_size()) + " ranks");
    }
    if (cfg.batch / comm.world_size() % cfg.grad_accum != 0) {
      throw ArgumentError("--grad-accum " + std::to_string(cfg.grad_accum) + " does not divide the local batch of " +
                          std::to_string(cfg.batch / comm.world_size()) + " (--batch " + std::to_string(cfg.batch) +
                          " over " + std::to_string(comm.world_size()) +
                          (comm.world_size() == 1 ? " rank)" : " ranks)"));
    }
    if (!cfg.checkpoint_dir.empty()) check_checkpoint_dir(cfg, comm.rank());
    if (!cfg.metrics.empty()) check_metrics_path(cfg);
    task = make_task(cfg, comm);
    check_state_fits(cfg, comm, *task, plan_options);
  });
  if (comm.world_size() > 1) check_same_data(comm, *task, data_input(cfg));
  if (!cfg.checkpoint_dir.empty() && comm.world_size() > 1) check_shared_checkpoint_dir(cfg, comm);
  // Each rank materializes its slices and the plan measures a step: collectives, so a failure on
  // one rank here (an allocation past the limit) ends the job rather than being agreed on.
  const nn::FullyShardOptions shard_options{.policy = policy,
                                            .group = !cfg.per_parameter,
                                            .prefetch = !cfg.no_prefetch,
                                            .overlap = cfg.overlap == "on"    ? nn::Overlap::on
                                                       : cfg.overlap == "off" ? nn::Overlap::off
                                                                              : nn::Overlap::automatic,
                                            .max_unsharded_groups = cfg.unsharded_groups};
  auto shard = [&](nn::Module& m) {
    if (mesh) {
      nn::fully_shard(m, *mesh, shard_options);
    } else {
      nn::fully_shard(m, comm, shard_options);
    }
  };
  if (!cfg.per_parameter) {
    for (nn::Module* group : task->shard_groups()) shard(*group);
  }
  shard(task->module());
  const nn::MemorySchedule configured{.max_unsharded_groups = cfg.unsharded_groups,
                                      .strategy = policy.strategy,
                                      .activation_checkpointing = cfg.activation_checkpointing,
                                      .micro_batches = cfg.grad_accum,
                                      .recompute_gelu = cfg.recompute_gelu};
  const MeasuredPlan measured = measure_plan(cfg, comm, *task, configured, plan_options);
  plan = measured.plan;
  const nn::MemorySchedule& chosen = measured.schedule;
  plan.schedule = chosen.describe(!cfg.per_parameter);  // (parameters one by one have no groups)
  task->set_micro_batches(chosen.micro_batches);
  // f16 gradients below 6e-8 vanish and sums past 65504 overflow: the loss is scaled (PyTorch's
  // GradScaler), and a step whose gradients overflowed is skipped on every rank. bf16 needs none.
  nn::GradScaler scaler({.init_scale = cfg.loss_scale, .enabled = parse_dtype(cfg.dtype) == DType::f16});
  setup_phase(comm, [&] {
    if (!measured.refusal.empty()) throw OutOfMemoryError(measured.refusal);
    const nn::AdamWOptions adamw{.lr = cfg.lr, .weight_decay = cfg.weight_decay};
    optimizer = cfg.weight_decay_2d_only ? std::make_unique<nn::AdamW>(nn::decay_2d_only(task->module()), adamw)
                                         : std::make_unique<nn::AdamW>(task->module().parameters(), adamw);
    const std::string from = cfg.resume_latest ? cfg.checkpoint_dir : cfg.resume;
    if (!from.empty()) {
      const nn::CheckpointSummary found = nn::describe_checkpoint(from);
      // A run that trains no step (it resumes at or past its total: --steps 0 --resume DIR samples
      // a checkpoint) draws no training samples: its --seed (the sample's seed too), --batch and
      // data need not be the checkpoint's (a sample of another seed was refused as "would train
      // on other samples").
      const bool trains = task->total_steps() > found.info.step;
      nn::check_resumable(found.info, task->description(),
                          trains ? task->data_stream() : std::map<std::string, std::string>{});
      resumed = nn::load_checkpoint(found.info.directory, task->module(), optimizer.get(), shard_comm,
                                    {.verify_checksums = !cfg.skip_checksums});
      if (scaler.enabled()) scaler.load_state(resumed.extra);  // none saved (an f32 or bf16 run's): afresh
      start_step = resumed.step;
    }
  });
  // Only now that every rank has loaded (the phase agreed on it) is the resume reported.
  if (main_rank && !resumed.directory.empty()) {
    // Hybrid: one replica saved it, so it was saved by the ranks of one node.
    std::cout << "resumed from " << resumed.directory << " at step " << start_step << " (saved by "
              << resumed.world_size << (resumed.world_size == 1 ? " rank" : " ranks") << ", now "
              << (mesh ? mesh->describe() : std::to_string(comm.world_size())) << ")" << std::endl;
    for (const std::string& warning : resumed.warnings) print_warning(warning);
    if (scaler.enabled() && cfg.loss_scale_given && task->total_steps() > start_step &&
        resumed.extra.contains(nn::GradScaler::kScaleKey)) {
      print_warning("--loss-scale has no effect on a resumed f16 run: it goes on with the checkpoint's scale, " +
                    resumed.extra.at(nn::GradScaler::kScaleKey));
    }
  }

  const std::int64_t total = task->total_steps();
  // The steps this run trains: none when it resumes at or past the total (--steps 0 --resume
  // DIR samples a checkpoint; a total below the checkpoint's step trains nothing more).
  const std::int64_t steps_to_train = std::max<std::int64_t>(0, total - start_step);
  if (main_rank && total > 0 && start_step >= total) {
    // --steps 0 samples a checkpoint on purpose; a positive total at or below the checkpoint's
    // step trains nothing, which a run that asked for steps should hear (a finished run's command
    // run again, with --resume-latest).
    print_warning("the checkpoint is at step " + std::to_string(start_step) +
                  (start_step > total ? ", past the run's " + std::to_string(total) + " steps"
                                      : ", the run's last of " + std::to_string(total)) +
                  ": nothing to train");
  }
  train::Metrics metrics;
  setup_phase(comm, [&] {
    if (main_rank) metrics = train::Metrics(cfg.metrics, start_step > 0 ? start_step : -1);
  });
  if (main_rank) {
    std::cout << task->description() << ", " << task->module().parameter_count() << " parameters, ";
    if (mesh) {
      std::cout << "hybrid sharded over " << mesh->describe() << " (" << comm.kind() << "): sharded within a node, "
                << "replicated across nodes"
                << (mesh->ranks_per_node() == 1 ? " (one rank per node: plain data parallelism, each rank holds "
                                                  "the whole state)"
                                                : "");
    } else {
      std::cout << "fully sharded over " << comm.world_size() << " " << comm.kind() << " rank"
                << (comm.world_size() > 1 ? "s" : "");
    }
    std::cout << ", backend " << default_backend().name() << ", compute " << cfg.dtype << ", "
              << (chosen.strategy == nn::CheckpointStrategy::retain ? "retain" : "recompute")
              << (chosen.recompute_gelu ? ", GELU recomputed" : "")
              << (chosen.activation_checkpointing ? ", activation checkpointing" : "")
              << (cfg.gather_quantization == "int8" ? ", int8 weight gathers" : "")
              << (chosen.micro_batches > 1 ? ", " + std::to_string(chosen.micro_batches) + " micro-batches per step"
                                           : "")
              << ", " << steps_to_train << (steps_to_train == 1 ? " step" : " steps") << std::endl;
    std::cout << plan.table(memory::limit()) << std::flush;
  }
  // (A run of no steps, sampling a checkpoint, has no cosine to decay along.)
  const nn::Schedule schedule = cfg.schedule == "cosine" && total > 0
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
  bool plan_checked = false;
  memory::reset_peak();
  std::string upkeep_warning;  // printed once, not at every save that meets the same entries
  std::int64_t saved_step = -1;
  auto save = [&](std::int64_t step) -> std::string {
    std::map<std::string, std::string> extra = task->data_stream();
    extra.insert(
        {{"model", task->description()}, {"dtype", cfg.dtype}, {"backend", std::string(default_backend().name())}});
    if (scaler.enabled()) extra.merge(scaler.state());
    // A failed save is known to every rank alike (save_checkpoint raises its IOErrors on every
    // rank; hybrid, the first replica writes and the others learn its outcome): rank 0 prints it
    // once and every rank leaves with a non-zero exit, as after a failed setup, instead of each
    // printing it and MPI aborting.
    auto stop = [&](const std::string& message) {
      if (comm.rank() == 0) print_error(message);
      throw Reported("checkpoint failed");
    };
    // A loss is checked before the update that follows it: an update that made the weights NaN
    // or infinite (a learning rate of 1e308) would be saved, named latest, and the older good
    // steps pruned. Every rank checks its shards; they agree before anything is written.
    // A block of each parameter at a time: an f64 copy of a whole one and its abs were 16 bytes
    // an element that the memory plan does not count (a run within its --memory-limit ran out
    // here, at its last step's save, and left no checkpoint).
    double non_finite = 0;
    constexpr std::int64_t kBlock = std::int64_t{1} << 16;
    autograd::no_grad([&] {
      for (const nn::Param& p : params) {
        const Tensor flat = p.data().reshape({-1});
        for (std::int64_t at = 0; at < flat.numel() && non_finite == 0; at += kBlock) {
          const Tensor block = flat.slice(0, at, std::min(flat.numel(), at + kBlock));
          if (!std::isfinite(sum(abs(cast(block, DType::f64))).item())) non_finite = 1;
        }
      }
    });
    if (agree_on_max(comm, {non_finite}, "finite weights")[0] != 0) {
      stop("the weights are not finite after step " + std::to_string(step) +
           "'s update: no checkpoint written (the earlier ones are kept)");
    }
    nn::CheckpointInfo info;
    try {
      info = nn::save_checkpoint(cfg.checkpoint_dir, step, task->module(), optimizer.get(), shard_comm, extra);
    } catch (const IOError& e) {
      stop(e.what());
    }  // a collective's own failure is this rank's alone: it propagates
    progress.line("checkpoint " + info.directory);
    for (const std::string& warning : info.warnings) {
      if (warning == upkeep_warning) continue;
      upkeep_warning = warning;
      print_warning(warning);
    }
    saved_step = step;
    return info.directory;
  };

  // What this rank's collectives cost: on the world's communicator, plus (hybrid) inside the node
  // and across nodes.
  auto minus = [](const Traffic& a, const Traffic& b) {
    return Traffic{a.collectives - b.collectives, a.bytes - b.bytes, a.seconds - b.seconds,
                   a.exposed_seconds - b.exposed_seconds};
  };
  auto plus = [](Traffic& a, const Traffic& b) {
    a.collectives += b.collectives;
    a.bytes += b.bytes;
    a.seconds += b.seconds;
    a.exposed_seconds += b.exposed_seconds;
  };
  auto level = [&](int which) {  // 0: all, 1: within a node, 2: across nodes (hybrid)
    Traffic out = which == 0 ? comm.traffic() : Traffic{};
    if (mesh && which != 2) plus(out, mesh->shard().traffic());
    if (mesh && which != 1) plus(out, mesh->replicate().traffic());
    return out;
  };
  Traffic comm_total;  // of the training steps alone (not evaluation or checkpoints)
  // A graceful stop (stop.h): with somewhere to save, SIGINT, SIGTERM or SIGUSR1 during the steps
  // ends the run at the end of the step, with a checkpoint of it. Outside the steps they act as before.
  std::optional<StopSignals> stop_signals;
  if (!cfg.checkpoint_dir.empty()) stop_signals.emplace();
  const RaiseForTest raise_at = raise_for_test();
  std::string metrics_error;       // rank 0's failure to write the metrics, agreed on at the end of the step
  std::int64_t skipped_steps = 0;  // by the loss scaler (f16), for gradients that overflowed
  std::int64_t steps_taken = 0;    // by the optimizer, in this run
  for (std::int64_t step = start_step; step < total; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    const Traffic traffic_before = level(0), intra_before = level(1), inter_before = level(2);
    optimizer->set_lr(schedule(step));
    Tensor loss;
    const std::int64_t micro_batches = chosen.micro_batches;  // --grad-accum, or more if the plan chose them
    if (micro_batches == 1) {
      loss = task->loss(step);
      optimizer->zero_grad();
      scaler.scale(loss).backward();
    } else {
      // Micro-batches: their gradients add up in the shards; under hybrid sharding only the last
      // backward all-reduces them across nodes.
      optimizer->zero_grad();
      for (std::int64_t micro = 0; micro < micro_batches; ++micro) {
        if (mesh) nn::set_requires_all_reduce(task->module(), micro + 1 == micro_batches);
        const Tensor part = task->micro_loss(step, micro, micro_batches);
        scaler.scale(part).backward();
        loss = loss.defined() ? loss + part.detach() : part.detach();
      }
    }
    if (raise_at.signal != 0 && raise_at.step == step + 1 && comm.rank() + 1 == comm.world_size()) {
      send_for_test(raise_at.signal);
    }
    double norm = -1;
    if (cfg.clip > 0) {
      scaler.unscale_(*optimizer, &comm);  // (disabled: does nothing)
      norm = nn::clip_grad_norm(params, cfg.clip, &shard_comm);
    }
    const std::int64_t stepped_before = steps_taken;
    const bool stepped = scaler.step(*optimizer, &comm);
    ++(stepped ? steps_taken : skipped_steps);
    scaler.update();
    last_loss = comm.all_reduce(loss.detach(), Reduction::sum, {.tag = "loss"}).item();
    if (!std::isfinite(last_loss)) stop_on_non_finite(comm, loss, last_loss, step + 1);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const Traffic step_traffic = minus(level(0), traffic_before);
    const Traffic step_intra = minus(level(1), intra_before), step_inter = minus(level(2), inter_before);
    plus(comm_total, step_traffic);
    const double current = static_cast<double>(task->samples_per_step()) / seconds;
    rate = rate == 0 ? current : 0.9 * rate + 0.1 * current;
    progress.step(step, task->where(step), last_loss, rate);
    if (!cfg.checkpoint_dir.empty() && cfg.checkpoint_every > 0 && (step + 1) % cfg.checkpoint_every == 0)
      save(step + 1);
    // Under --overlap auto the check waits for the trial, which alternates overlapping and
    // synchronous steps: the plan covers the larger of the two, and at step 2 the check read
    // it against the overlapping step's peak alone ("0.85 of predicted" where the synchronous
    // step, two steps later, needed all of it). The peak is the run's so far, both kinds by then.
    // (--per-parameter has no shard groups, so no trial: its report never decides.)
    // (The report walks the model's parameters: asked only while the check is due.)
    auto trial_running = [&] {
      return cfg.overlap == "auto" && !cfg.per_parameter && !nn::overlap_report(task->module()).decided;
    };
    // (Steps the loss scaler skipped made no optimizer state: the check waits for a step that began
    // with the state a real step made.)
    const bool state_made = !scaler.enabled() || stepped_before > 0;
    if (!plan_checked && step + 1 >= plan_check_step && (step + 1 == total || (!trial_running() && state_made))) {
      plan_checked = true;
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
    // The training loss is measured before the update that follows it: an update that made the
    // weights NaN or infinite showed only in the evaluation after it, and a run without
    // --checkpoint-dir (whose saves check the weights) ended with exit 0 and NaN weights. The
    // figures are every rank's alike (reduced over the ranks), so every rank stops here.
    std::string non_finite_figures;
    for (const auto& [name, value] : eval.items()) {
      if (value.is_number() && !std::isfinite(value.get<double>())) {
        std::ostringstream figure;
        figure << name << " " << value.get<double>();
        non_finite_figures += (non_finite_figures.empty() ? "" : ", ") + figure.str();
      }
    }
    if (!non_finite_figures.empty()) {
      if (main_rank) {
        print_error("step " + std::to_string(step + 1) + "'s evaluation gave " + non_finite_figures +
                    ": the weights are not finite after that step's update (lower --lr, or --clip)");
      }
      throw Reported("non-finite evaluation");
    }
    // One record per step (the README's promise): it was written only at --log-every's steps (10
    // lines for 1000 steps by default), a setting of the progress lines.
    if (!cfg.metrics.empty()) {
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
        if (mesh) {
          record["comm_bytes_intra"] = step_intra.bytes;
          record["comm_bytes_inter"] = step_inter.bytes;
          record["comm_exposed_seconds_intra"] = step_intra.exposed_seconds;
          record["comm_exposed_seconds_inter"] = step_inter.exposed_seconds;
        }
        if (cfg.model == "mlp") record["epoch"] = (step + 1) / (total / cfg.epochs);
        if (std::isfinite(norm) && norm >= 0) record["grad_norm"] = norm;  // (JSON has no inf: a skipped step has none)
        if (scaler.enabled()) {
          record["loss_scale"] = scaler.scale_value();  // after this step's update
          record["step_skipped"] = !stepped;
        }
        for (auto& [k, v] : eval.items()) record[k] = v;
        try {
          metrics.write(record);
        } catch (const std::exception& e) {
          metrics_error = e.what();  // every rank learns it at the end of the step
        }
      }
    }
    if (!eval.empty()) {
      last_eval = eval;
      progress.line("step " + std::to_string(step + 1) + " " + task->where(step) + format_evaluation(eval, " "));
    }
    if (stop_signals || !cfg.metrics.empty()) {
      // What the ranks agree on at the end of a step (outside its traffic: the metrics' comm_*
      // figures do not count it): whether rank 0 failed to write the metrics, and whether any rank
      // received a signal during the step. Every rank then stops after the same one.
      const auto agreed = agree_on_max(
          comm, {metrics_error.empty() ? 0.0 : 1.0, static_cast<double>(StopSignals::received())}, "end of step");
      if (agreed[0] != 0) {
        if (main_rank) print_error(metrics_error);
        throw Reported("metrics");
      }
      if (const int signal = static_cast<int>(agreed[1]); signal != 0) {
        StopSignals::acknowledge();
        const std::string directory = saved_step == step + 1 ? std::string() : save(step + 1);
        progress.line("stopped by " + signal_name(signal) + " after step " + std::to_string(step + 1) +
                      (directory.empty() ? std::string(" (its checkpoint is above)") : ", checkpoint " + directory) +
                      ": --resume-latest goes on from it");
        return 128 + signal;
      }
    }
  }
  // Past the steps a signal acts as before: at once (one that came after the last step's check is
  // raised again here).
  if (raise_at.signal != 0 && raise_at.step < 0 && comm.rank() + 1 == comm.world_size()) send_for_test(raise_at.signal);
  stop_signals.reset();
  if (!cfg.checkpoint_dir.empty() && total > start_step &&
      (cfg.checkpoint_every <= 0 || total % cfg.checkpoint_every != 0)) {
    save(total);
  }
  task->after_training();
  const auto peak = peaks();
  if (main_rank) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    std::string summary = "done: " + std::to_string(steps_to_train) + (steps_to_train == 1 ? " step" : " steps") +
                          " in " + train::duration(seconds);
    if (total > start_step) {
      char buf[64];
      std::snprintf(buf, sizeof buf, ", final loss %.4f", last_loss);
      summary += buf;
    }
    summary += format_evaluation(last_eval, ", ");
    summary += ", peak memory per rank:";
    for (double p : peak) {
      summary += ' ';  // (appended in two steps: GCC 12 warns falsely on " " + ..., bug 105329)
      // In the plan's units (a small model's peak read "0.0 MB" beside its plan's "22.7 KB").
      summary += memory::format_bytes(static_cast<std::int64_t>(p));
    }
    progress.line(summary);
    if (scaler.enabled() && steps_to_train > 0) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "loss scaling (f16): %lld of %lld steps skipped for inf/NaN gradients, scale %g",
                    static_cast<long long>(skipped_steps), static_cast<long long>(steps_to_train),
                    scaler.scale_value());
      progress.line(buf);
    }
    if (comm_total.bytes > 0) {
      // Rank 0's view: what its collectives took per step, and how much of it the step waited for.
      const double steps = static_cast<double>(std::max<std::int64_t>(1, steps_to_train));
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
  return 0;
}

}  // namespace ruda::train
