// ruda-ckpt: lists, verifies, consolidates and splits ruda's sharded safetensors checkpoints.
#include <csignal>
#include <iostream>
#include <string>

#include <ruda/nn.h>
#include <CLI/CLI.hpp>

#include "../cli_bounds.h"

namespace {
std::string decimal(unsigned __int128 value) {
  std::string digits;
  do {
    digits.insert(digits.begin(), static_cast<char>('0' + static_cast<int>(value % 10)));
    value /= 10;
  } while (value != 0);
  return digits;
}
}  // namespace

int main(int argc, char** argv) {
  using namespace ruda;
  // A file-size limit (ulimit -f) then fails a write with EFBIG, reported and cleaned up like a full
  // disk (one error line, no temporary file left), instead of SIGXFSZ ending the process mid-write.
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"ruda-ckpt: inspect and convert ruda's sharded checkpoints"};
  app.require_subcommand(1);
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  std::string path, output;
  int world = 0;
  std::int64_t step = 0;
  auto* list = app.add_subcommand("list", "Print a checkpoint's parameters, shapes, world size and extra state");
  list->add_option("checkpoint", path, "A checkpoint directory (its latest step) or a step directory")->required();
  auto* verify = app.add_subcommand(
      "verify", "Check the index, every file's header and identity, and every block of data against its checksum");
  verify->add_option("checkpoint", path, "A checkpoint directory or a step directory")->required();
  auto* consolidate = app.add_subcommand("consolidate", "Write one full safetensors file of the model's parameters");
  consolidate->add_option("checkpoint", path, "A checkpoint directory or a step directory")->required();
  consolidate->add_option("output", output, "The .safetensors file to write")->required();
  auto* split = app.add_subcommand("split", "Cut a full safetensors file into a sharded checkpoint");
  split->add_option("input", path, "A full .safetensors file (e.g. from consolidate)")->required();
  ruda::cli::add_whole(*split, "--world", world, "Number of ranks")->required()->check(ruda::cli::at_least(1));
  split
      ->add_option("--out", output,
                   "Checkpoint directory to write the step into (created if missing; an existing one gets the "
                   "step beside its others, and its latest pointer names it)")
      ->required();
  ruda::cli::add_whole(*split, "--step", step, "Step number of the new checkpoint")->check(ruda::cli::at_least(0));
  if (const std::optional<int> exit_code = ruda::cli::parse(app, argc, argv, "ruda-ckpt")) return *exit_code;
  // Ctrl-C or a kill's SIGTERM in the middle of a consolidate or a split removes the temporary
  // file being written (a consolidate left one of hundreds of MB for good), then ends as it would.
  ruda::safetensors::remove_temporaries_on_signals();
  try {
    if (list->parsed()) {
      const nn::CheckpointSummary s = nn::describe_checkpoint(path);
      std::cout << s.info.directory << ": step " << s.info.step << ", " << s.info.world_size
                << (s.info.world_size == 1 ? " rank, " : " ranks, ") << s.params.size()
                << (s.params.size() == 1 ? " parameter" : " parameters")
                << (s.checksums ? "" : ", no checksums (format version 1)");
      if (s.optimizer_steps >= 0)
        std::cout << ", optimizer state after " << s.optimizer_steps << (s.optimizer_steps == 1 ? " step" : " steps");
      std::cout << "\n";
      // Each parameter's count fits int64 (the index is validated), their sum need not: counted in
      // 128 bits, it is exact for any index (it wrapped negative in int64).
      unsigned __int128 total = 0;
      for (const auto& p : s.params) {
        std::cout << "  " << p.name << "  " << dtype_name(p.dtype) << " " << to_string(p.shape)
                  << (p.sharded ? "" : "  (dense)");
        for (const auto& st : p.optimizer_state) std::cout << "  +" << st;
        std::cout << "\n";
        total += static_cast<unsigned __int128>(shape_numel(p.shape));
      }
      std::cout << "  " << decimal(total) << " elements\n";
      for (const auto& [k, v] : s.info.extra) std::cout << "  " << k << " = " << v << "\n";
    } else if (verify->parsed()) {
      const std::uint64_t bytes = nn::verify_checkpoint(path);
      const nn::CheckpointSummary s = nn::describe_checkpoint(path);
      std::cout << s.info.directory << ": ok, " << bytes << " bytes of tensor data read, "
                << (s.checksums ? "every block matches its checksum"
                                : "no checksums to check (format version 1: only the structure was checked)")
                << "\n";
    } else if (consolidate->parsed()) {
      nn::consolidate_checkpoint(path, output);
      std::cout << "wrote " << output << "\n";
    } else if (split->parsed()) {
      const nn::CheckpointInfo info = nn::split_checkpoint(path, world, output, step);
      std::cout << "wrote " << info.directory << " for " << world << (world == 1 ? " rank\n" : " ranks\n");
    }
  } catch (const std::exception& e) {
    std::cerr << ("ruda-ckpt: error: " + ruda::cli::error_text(e) + "\n") << std::flush;  // one write
    return 1;
  }
  return 0;
}
