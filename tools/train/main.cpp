// ruda-train: trains a fully sharded model across MPI ranks (mpiexec -n N ruda-train ...), across
// ranks emulated as threads (--emulate N), or alone. Models: `mlp` on Fashion-MNIST, and `lm`, a
// byte-level GPT-style language model on any text. This file parses the options and picks the
// communicator; job.cpp runs the job on each rank, tasks.cpp holds the two models.
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>

#include <ruda/nn.h>
#include <CLI/CLI.hpp>
#ifdef RUDA_TRAIN_WITH_MPI
#include <ruda/mpi.h>
#endif

#include "../cli_bounds.h"
#include "config.h"
#include "job.h"
#include "stop.h"

using namespace ruda;
using namespace ruda::train;
using namespace ruda::cli;

#ifdef RUDA_TRAIN_WITH_MPI
namespace {
// The first problem with the environment variables this rank's run reads ("" when there is
// none), each through the reader that would raise it later, on its own rank, in the middle of
// setting up: RUDA_NUM_THREADS (and an OMP_NUM_THREADS past what can start), RUDA_CHECK_COLLECTIVES,
// RUDA_COLLECTIVE_TIMEOUT (unless --collective-timeout), RUDA_RING_MIN_BYTES, RUDA_MEMORY_LIMIT
// (unless --memory-limit) and RUDA_BACKEND (unless --backend).
std::string environment_problem(const Config& cfg) {
  try {
    (void)num_threads();
    (void)order_check_from_env();
    if (cfg.collective_timeout_ms < 0) (void)collective_timeout_from_env();
    (void)ring_min_bytes_from_env();
    (void)memory::limit();
    if (cfg.backend.empty()) (void)default_backend();
    (void)raise_for_test();
  } catch (const std::exception& e) {
    return *e.what() ? e.what() : "a startup check failed";
  }
  return {};
}

// `text` with every byte that is not printable ASCII, and the backslash and quote, escaped (\n,
// \xNN): a value as one line, fit for an error message (a --prompt holds newlines and any bytes).
std::string escaped(const std::string& text) {
  std::string out;
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (byte < 0x20 || byte >= 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", byte);
      out += hex;
    } else {
      out += c;
    }
  }
  return out;
}

// The options of `app` and of its subcommands as parsed, one `[subcommand ]--name "value"` a line:
// the values given (`--seed=1` and `--seed 1` alike; the last of an option given twice), else the
// defaults.
void append_options(const CLI::App& app, const std::string& prefix, std::string& text) {
  for (const CLI::Option* option : app.get_options()) {
    std::string value;
    if (option->count() > 0) {
      // As the option's policy reduces them (an option given twice takes its last value).
      for (const std::string& result : option->reduced_results()) value += (value.empty() ? "" : " ") + result;
    } else {
      value = option->get_default_str();
    }
    text += prefix + option->get_name() + " \"" + escaped(value) + "\"\n";
  }
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    append_options(*sub, prefix + sub->get_name() + " ", text);
  }
}

// What every rank of one job must share, one line each: the options as parsed, then the
// environment that decides which collectives run (RUDA_CHECK_COLLECTIVES adds an exchange to every
// collective, RUDA_RING_MIN_BYTES picks their algorithm) and the backend a checkpoint records.
// Ranks that differ in any of it run different collectives: the first one sized from them wrote
// past a buffer (MPMD lines with different --epochs or --batch ended in heap corruption), a
// different --seed trained silently on streams the checkpoint did not record, and one rank's
// RUDA_CHECK_COLLECTIVES waited for an exchange the others never started.
std::string launch_fingerprint(const CLI::App& app, const Config& cfg) {
  std::string text;
  append_options(app, "", text);
  text += std::string("RUDA_CHECK_COLLECTIVES=") + (order_check_from_env() ? "on" : "off") + "\n";
  const std::optional<std::size_t> ring = ring_min_bytes_from_env();
  text += "RUDA_RING_MIN_BYTES=" + (ring ? std::to_string(*ring) : std::string("unset")) + "\n";
  text += "backend in use=" + (cfg.backend.empty() ? std::string(default_backend().name()) : cfg.backend) + "\n";
  return text;
}

// The first line in which a rank's fingerprint differs from rank 0's, as a message ("" when every
// rank's is rank 0's): the same on every rank, which all hold every fingerprint.
std::string launch_difference(const std::vector<std::string>& fingerprints) {
  auto lines = [](const std::string& text) {
    std::vector<std::string> out;
    std::size_t at = 0;
    while (at < text.size()) {
      const std::size_t end = std::min(text.find('\n', at), text.size());
      out.push_back(text.substr(at, end - at));
      at = end + 1;
    }
    return out;
  };
  const std::vector<std::string> first = lines(fingerprints.front());
  for (std::size_t r = 1; r < fingerprints.size(); ++r) {
    if (fingerprints[r] == fingerprints.front()) continue;
    const std::vector<std::string> mine = lines(fingerprints[r]);
    std::size_t i = 0;
    while (i < first.size() && i < mine.size() && first[i] == mine[i]) ++i;
    const std::string theirs = i < mine.size() ? mine[i] : "(nothing)";
    const std::string ours = i < first.size() ? first[i] : "(nothing)";
    return "rank " + std::to_string(r) + " was started with " + theirs + ", rank 0 with " + ours +
           ": every rank of a job needs the same options, RUDA_CHECK_COLLECTIVES, RUDA_RING_MIN_BYTES and backend "
           "(see mpiexec's -x and its per-rank command lines)";
  }
  return {};
}
}  // namespace
#endif

int main(int argc, char** argv) {
  // Before any thread exists: SIGINT, SIGTERM and SIGUSR1 go to a thread of their own (stop.h).
  ruda::train::watch_stop_signals();
  Config cfg;
  // A file-size limit (ulimit -f) then fails a write with EFBIG, reported and cleaned up like a full
  // disk (one error line, no temporary file left), instead of SIGXFSZ ending the process mid-write.
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{
      "ruda-train: trains a fully sharded model across MPI ranks, emulated ranks, or alone.\n"
      "  mpiexec -n 2 ruda-train mlp          Fashion-MNIST MLP over two MPI processes\n"
      "  ruda-train --emulate 4 lm --steps 500 a GPT-style byte model over four threads\n"};
  app.require_subcommand(1);
  // An option given twice takes its last value, so that a script's defaults can be overridden
  // from its own command line (tools/demo --epochs 3).
  app.option_defaults()->always_capture_default()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--backend", cfg.backend,
                 "Compute backend: eigen or onednn (default: RUDA_BACKEND, else onednn where built)")
      ->check(non_empty())
      ->check(CLI::IsMember(available_backends()));  // (an unknown one was named by get_backend)
  app.add_option("--dtype", cfg.dtype,
                 "Compute dtype of the layers (parameters stay f32); f16 scales the loss dynamically "
                 "(GradScaler), skipping steps whose gradients overflow")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}));
  app.add_option("--loss-scale", cfg.loss_scale,
                 "The f16 loss scaler's initial scale; it halves at each step skipped and doubles after 2000 "
                 "clean ones")
      ->check(between(nn::GradScaler::kMinScale, nn::GradScaler::kMaxScale));
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
  app.add_flag("--hybrid", cfg.hybrid,
               "Hybrid sharding: shard the model within each node and replicate it across nodes (every all-gather "
               "stays inside a node; gradient shards are all-reduced across nodes)");
  app.add_option("--gather-quantization", cfg.gather_quantization,
                 "Move the weight all-gathers as int8 codes with a scale per 2048 elements (int8: about a quarter "
                 "of the bytes; weights, gradients and optimizer state stay full precision) or as they are (none)")
      ->check(CLI::IsMember({"none", "int8"}));
  add_whole(app, "--grad-accum", cfg.grad_accum,
            "Split each rank's batch into K micro-batches and accumulate their gradients (less activation "
            "memory; the same gradient). With --hybrid only the last one all-reduces across nodes")
      ->check(at_least(1));
  add_whole(app, "--ranks-per-node", cfg.ranks_per_node,
            "Ranks that make one node: under MPI, blocks of N consecutive ranks (default: MPI's own nodes); "
            "with --emulate, N consecutive threads share one simulated link (default 1: a node per rank)")
      ->check(at_least(1, "a node holds at least one rank"))
      ->default_str("");  // (its unset value, 0, is no value a user may give)
  add_whole(app, "--unsharded-groups", cfg.unsharded_groups,
            "At most this many layers hold full weights at once, besides the model's own (default 2)")
      ->check(at_least(1, "1 keeps only the computing group unsharded"));
  app.add_flag("--no-auto-fit", cfg.no_auto_fit,
               "Refuse a memory plan over --memory-limit instead of trying leaner schedules (fewer unsharded "
               "groups, recompute, activation checkpointing) and training with the first that fits");
  add_whole(app, "--epochs", cfg.epochs, "Epochs (mlp)")->check(at_least(1));
  add_whole(app, "--steps", cfg.steps, "Optimizer steps (lm; default 1000)")->check(at_least(0))->default_str("");
  add_whole(app, "--batch", cfg.batch, "Global batch size, split evenly over the ranks (default: mlp 128, lm 16)")
      ->check(at_least(1))
      ->default_str("");
  app.add_option("--lr", cfg.lr, "Peak learning rate of AdamW")->check(positive());
  app.add_option("--weight-decay", cfg.weight_decay, "AdamW's decoupled weight decay")->check(at_least(0));
  app.add_option("--schedule", cfg.schedule, "Learning-rate schedule after --warmup steps")
      ->check(CLI::IsMember({"constant", "cosine"}));
  add_whole(app, "--warmup", cfg.warmup, "Linear warm-up steps")->check(at_least(0));
  add_whole(app, "--seed", cfg.seed, "Seed of initialization, data order and sampling");
  app.add_option("--clip", cfg.clip, "Clip the global gradient norm to this value (0: off)")->check(at_least(0));
  app.add_option("--checkpoint-dir", cfg.checkpoint_dir,
                 "Directory of sharded checkpoints (written at the end, and every --checkpoint-every steps)")
      ->check(non_empty());
  add_whole(app, "--checkpoint-every", cfg.checkpoint_every, "Checkpoint every N steps (0: only at the end)")
      ->check(at_least(0));
  auto* resume =
      app.add_option("--resume", cfg.resume,
                     "Resume from this checkpoint (a step directory or a checkpoint directory; any world size)")
          ->check(non_empty());
  app.add_flag("--resume-latest", cfg.resume_latest,
               "Resume from the latest checkpoint in --checkpoint-dir, if there is one")
      ->excludes(resume);
  app.add_flag("--skip-checksums", cfg.skip_checksums,
               "Resume without checking the checkpoint's data against its checksums (faster; the files' "
               "headers and identity are still checked)");
  app.add_option("--metrics", cfg.metrics,
                 "Write JSON lines of metrics (step, loss, accuracy, lr, samples/s, peak memory per "
                 "rank, communication) to FILE")
      ->check(non_empty());
  auto* emulate = add_whole(app, "--emulate", cfg.emulate, "Run N ranks as threads in this process (no MPI)")
                      ->check(between(1, 64));
  app.add_option("--emulate-link", cfg.emulate_link,
                 "Give the emulated ranks a simulated link, e.g. 1GB/s or 10Gbit/s,20us: each collective takes "
                 "the time a ring over it would (default: RUDA_EMULATE_LINK, else none)")
      ->check(non_empty())
      ->needs(emulate);
  add_whole(app, "--log-every", cfg.log_every, "A progress line every N steps when not on a terminal (0: none)")
      ->check(at_least(0));
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
         "Under MPI, end the job when a collective has waited this long for the other ranks, naming the "
         "ranks "
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
           // The library reads a limit of 0 as none: a typo (0, 0.4) must not silently lift it.
           if (cfg.memory_limit == 0) {
             throw CLI::ValidationError("--memory-limit",
                                        "'" + text + "' is 0 bytes; leave the option out for no limit");
           }
         },
         "Tensor bytes per rank, e.g. 512MB, 2GiB (default: RUDA_MEMORY_LIMIT, else none). The plan "
         "printed "
         "before step 1 must fit, and an allocation past it is an error")
      ->type_name("SIZE");

  auto* mlp =
      app.add_subcommand("mlp", "A multilayer perceptron on Fashion-MNIST (reports test accuracy after every epoch)");
  mlp->fallthrough();
  mlp->add_option("--data", cfg.data, "Directory of the Fashion-MNIST IDX files (Debian: dataset-fashion-mnist)")
      ->check(non_empty());
  // One comma-separated list, read here: CLI11's delimiter dropped empty items (--hidden 8,,8 was
  // 8-8) and joined repeated options (--hidden 8 --hidden 4 was 8-4, not the last value).
  mlp->add_option_function<std::string>(
         "--hidden",
         [&](const std::string& text) {
           std::vector<std::int64_t> sizes;
           std::size_t start = 0;
           while (true) {
             const std::size_t comma = text.find(',', start);
             std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
             const std::string whole = whole_number<std::int64_t>()(item);
             if (!whole.empty()) throw CLI::ValidationError("--hidden", whole);
             const std::string bound = at_least(1)(item);
             if (!bound.empty()) throw CLI::ValidationError("--hidden", bound);
             sizes.push_back(std::stoll(item));
             if (comma == std::string::npos) break;
             start = comma + 1;
           }
           cfg.hidden = std::move(sizes);
         },
         "Hidden layer sizes, comma-separated (default 1024,1024)")
      ->type_name("N[,N...]");
  add_whole(*mlp, "--limit", cfg.limit, "Train on the first N training images only")->check(at_least(0));
  add_whole(*mlp, "--test-limit", cfg.test_limit, "Evaluate on the first N test images only")->check(at_least(0));

  auto* lm =
      app.add_subcommand("lm", "A GPT-style byte-level language model (reports validation loss and bits per byte)");
  lm->fallthrough();
  lm->add_option("--text", cfg.text, "Text file, or a directory of text files (default: the fortunes package's texts)")
      ->check(non_empty());
  add_whole(*lm, "--context", cfg.context, "Context length in bytes")->check(at_least(1));
  add_whole(*lm, "--d-model", cfg.d_model, "Model width")->check(at_least(1));
  add_whole(*lm, "--layers", cfg.layers, "Transformer blocks")->check(at_least(1));
  add_whole(*lm, "--heads", cfg.heads, "Attention heads")->check(at_least(1));
  lm->add_flag("--activation-checkpointing", cfg.activation_checkpointing,
               "Keep only each block's input through the forward pass and recompute the block in backward");
  lm->add_flag("--recompute-gelu", cfg.recompute_gelu,
               "Recompute each MLP's [tokens, 4 d] pre-activation in backward (one GEMM more per block, that "
               "tensor less per block from forward to backward; GELU runs as fc1's GEMM epilogue)");
  lm->add_flag("--weight-decay-2d-only", cfg.weight_decay_2d_only,
               "Decay only the 2-D weights (linear layers, embeddings), not biases and norms, as GPT recipes do "
               "(two optimizer groups, saved in checkpoints)");
  lm->add_flag("--untied", cfg.untied, "Give the output head its own weights (default: tied to the token embedding)");
  add_whole(*lm, "--eval-every", cfg.eval_every, "Validate every N steps")->check(at_least(0));
  add_whole(*lm, "--eval-batches", cfg.eval_batches, "Validation batches")->check(at_least(1));
  add_whole(*lm, "--sample", cfg.sample,
            "After training, print N sampled bytes (with --steps 0 and --resume: sample a checkpoint)")
      ->check(at_least(0));
  // The default is a newline, which the help would print raw (breaking its columns).
  lm->add_option("--prompt", cfg.prompt, "Text the sample continues (default: a newline)")->option_text("TEXT");
  // 0 is greedy; a positive temperature divides the logits, so it must be a normal number (what
  // nn::sample_bytes takes), which is said here rather than after the training.
  lm->add_option("--temperature", cfg.temperature, "Sampling temperature (0: greedy)")
      ->check(at_least(0))
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            double t = 0;
            if (!CLI::detail::lexical_cast(text, t)) return "must be a number, got '" + text + "'";
            return t == 0 || t >= 1e-30 ? "" : "must be 0 (greedy) or at least 1e-30, got " + text;
          },
          ""));

  const bool print = launcher_rank() == 0;
  if (const std::optional<int> exit_code = parse(app, argc, argv, "ruda-train", print)) return *exit_code;
  cfg.model = mlp->parsed() ? "mlp" : "lm";
  if (cfg.model == "lm") {
    if (app.get_option("--lr")->count() == 0) cfg.lr = 1e-3;
    if (cfg.steps == 0 && app.get_option("--steps")->count() == 0) cfg.steps = 1000;
  }
  if (cfg.batch == 0) cfg.batch = cfg.model == "mlp" ? 128 : 16;
  // Option errors that the model or the data loader would name by their own terms ("GPT: d_model
  // 16 is not a multiple of heads 3"; a --data file read as "FILE/train-images-idx3-ubyte.gz: no
  // such file"), said by the options.
  {
    std::string wrong;
    std::error_code ec;
    if (cfg.model == "lm" && cfg.d_model % cfg.heads != 0) {
      wrong = "--d-model " + std::to_string(cfg.d_model) + " is not a multiple of --heads " + std::to_string(cfg.heads);
    } else if (cfg.model == "mlp" && std::filesystem::exists(cfg.data, ec) &&
               !std::filesystem::is_directory(cfg.data, ec)) {
      wrong = "--data " + cfg.data + ": is not a directory (the folder of the Fashion-MNIST IDX files)";
    }
    if (!wrong.empty()) {
      if (print) print_error(wrong);
      return 2;
    }
  }
  cfg.loss_scale_given = app.get_option("--loss-scale")->count() > 0;
  // Options that this run would ignore: said once, on rank 0 (a run is not refused for them).
  if (print) {
    auto given = [&](CLI::App& on, const char* name) { return on.get_option(name)->count() > 0; };
    auto ignored = [](const std::string& what) { print_warning(what); };
    if (cfg.model == "mlp" && given(app, "--steps")) ignored("--steps has no effect on mlp, which trains --epochs");
    if (cfg.model == "lm" && given(app, "--epochs")) ignored("--epochs has no effect on lm, which trains --steps");
    if (cfg.dtype != "f16" && given(app, "--loss-scale")) ignored("--loss-scale has no effect without --dtype f16");
    if (cfg.model == "lm" && cfg.sample == 0 && (given(*lm, "--prompt") || given(*lm, "--temperature")))
      ignored("--prompt and --temperature have no effect without --sample N");
    if (cfg.checkpoint_dir.empty() && given(app, "--checkpoint-every"))
      ignored("--checkpoint-every has no effect without --checkpoint-dir");
    if (cfg.skip_checksums && cfg.resume.empty() && !cfg.resume_latest)
      ignored("--skip-checksums has no effect without --resume or --resume-latest");
    if (cfg.per_parameter) {
      for (const char* name : {"--unsharded-groups", "--overlap", "--no-prefetch"}) {
        if (given(app, name))
          ignored(std::string(name) + " has no effect with --per-parameter (it shapes the groups' schedule)");
      }
    }
    // Nodes shape the hybrid mesh, and an emulated link's sharing; nothing else reads them.
    const char* env_link = std::getenv("RUDA_EMULATE_LINK");  // --emulate-link's default
    const bool emulated_link = !cfg.emulate_link.empty() || (env_link && *env_link);
    if (given(app, "--ranks-per-node") && !cfg.hybrid && (cfg.emulate == 0 || !emulated_link))
      ignored("--ranks-per-node has no effect without --hybrid (or, with --emulate, --emulate-link)");
    if (cfg.emulate > 0 && given(app, "--collective-timeout"))
      ignored("--collective-timeout has no effect with --emulate (emulated ranks time out after 60 s)");
    if (cfg.emulate == 0 && !launched_by_mpi() && given(app, "--collective-timeout"))
      ignored("--collective-timeout has no effect in one process without mpiexec (no rank waits for another)");
    if (cfg.emulate == 1 && given(app, "--emulate-link"))
      ignored("--emulate-link has no effect with --emulate 1 (one rank sends nothing)");
    const char* env_limit = std::getenv("RUDA_MEMORY_LIMIT");
    if (cfg.no_auto_fit && cfg.memory_limit <= 0 && !(env_limit && *env_limit && std::string(env_limit) != "0"))
      ignored("--no-auto-fit has no effect without a memory limit (--memory-limit or RUDA_MEMORY_LIMIT)");
    if (cfg.model == "lm" && cfg.sample > 0 && cfg.steps == 0 && cfg.resume.empty() && !cfg.resume_latest)
      ignored("--sample with --steps 0 and no --resume samples the untrained model (its random initial weights)");
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
      if (!nn::holds_checkpoint(cfg.checkpoint_dir)) {
        cfg.resume_latest = false;
        // (Checked here: the warnings above ran before it was known that nothing is resumed.)
        if (print && cfg.skip_checksums && cfg.resume.empty())
          print_warning("--skip-checksums has no effect: " + cfg.checkpoint_dir +
                        " holds no checkpoint to resume, so this run starts afresh");
      }
    } catch (const std::exception& e) {
      if (print) print_error(e.what());
      return 1;
    }
  }

  try {
    if (cfg.memory_limit > 0) memory::set_limit(cfg.memory_limit, "--memory-limit");
    if (cfg.emulate > 0) {
      if (launched_by_mpi()) {
        // Said once, by the launcher's rank 0: every rank would print it otherwise, interleaved.
        if (print) print_error("--emulate runs ranks as threads: do not launch it with mpiexec");
        return 2;
      }
      EmulatedOptions options;
      if (!cfg.emulate_link.empty()) options.link = LinkModel::parse(cfg.emulate_link, "--emulate-link");
      if (cfg.ranks_per_node > 0) {
        if (cfg.emulate % cfg.ranks_per_node != 0) {
          throw ArgumentError("--ranks-per-node " + std::to_string(cfg.ranks_per_node) + " does not divide --emulate " +
                              std::to_string(cfg.emulate) + " into nodes of equal size");
        }
        options.ranks_per_node = cfg.ranks_per_node;
      }
      std::atomic<int> status{0};  // every rank returns the same
      run_ranks(
          cfg.emulate, [&](Communicator& comm) { status.store(run(cfg, comm)); }, options);
      return status.load();
    }
    if (launched_by_mpi()) {
#ifdef RUDA_TRAIN_WITH_MPI
      MpiEnvironment mpi(argc, argv);
      // The environment each rank reads, agreed before any communicator reads it: a bad value on
      // any rank (mpiexec -x applies to every rank; MPMD lines may differ) is one line from rank 0
      // and a non-zero exit everywhere, not each rank's error, an MPI_Abort and its banner.
      if (const auto failures = agree_on_startup(environment_problem(cfg)); !failures.empty()) {
        if (mpi.world_rank() == 0) {
          const RankFailure& first = failures.front();
          print_error(static_cast<int>(failures.size()) == mpi.world_size()
                          ? first.message
                          : "rank " + std::to_string(first.rank) + ": " + first.message);
        }
        return 2;
      }
      if (const std::string difference = launch_difference(gather_on_startup(launch_fingerprint(app, cfg)));
          !difference.empty()) {
        if (mpi.world_rank() == 0) print_error(difference);
        return 2;
      }
      MpiCommunicator comm;
      if (cfg.collective_timeout_ms >= 0) comm.set_timeout(std::chrono::milliseconds(cfg.collective_timeout_ms));
      try {
        return run(cfg, comm);
      } catch (const Reported&) {
        return 1;  // every rank knows; each exits by itself
      }
#else
      throw std::runtime_error("this ruda-train was built without MPI");
#endif
    }
    LocalCommunicator comm;
    return run(cfg, comm);
  } catch (const Reported&) {
    return 1;
  } catch (const std::exception& e) {
    // Past the agreed setup only the failing rank reports: name it.
    print_error((launched_by_mpi() ? "rank " + std::to_string(launcher_rank()) + ": " : std::string()) +
                ruda::cli::error_text(e));
#ifdef RUDA_TRAIN_WITH_MPI
    // A failure on one MPI rank in the middle of training: end the whole job, never a hang.
    if (launched_by_mpi() && MpiEnvironment::active()) return mpi_abort_on_exception([&]() -> int { throw; });
#endif
    return 1;
  }
}
