// checkpoint suite: what checking every block against its checksum costs. A sharded checkpoint
// of a 4-layer MLP with AdamW moments (3 x 67 MB at full size) is loaded with the checksums
// checked (the default) and unchecked (LoadOptions::verify_checksums = false), at the world size
// it was saved with and resharded; `ruda-ckpt verify`'s full pass is set against reading the same
// files' bytes raw. The files stay in the page cache, so the figures are the hashing's share of
// a load from memory: the worst case for the checksums (a disk read would hide more of it).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>

#include <ruda/nn.h>

#include "bench.h"

namespace ruda::bench {
namespace {

namespace fs = std::filesystem;

struct ScratchDir {
  fs::path path = fs::temp_directory_path() / ("ruda-bench-checkpoint-" + std::to_string(::getpid()));
  ScratchDir() { fs::create_directories(path); }
  ~ScratchDir() { fs::remove_all(path); }
};

std::shared_ptr<nn::Sequential> model(std::int64_t width) {
  nn::manual_seed(1);
  auto m = std::make_shared<nn::Sequential>();
  for (int i = 0; i < 4; ++i) m->push_back(std::make_shared<nn::Linear>(width, width));
  return m;
}

// Reads every byte of every file under dir (the I/O floor of any full pass over them).
std::uint64_t read_raw(const fs::path& dir) {
  static std::vector<char> buffer(std::size_t{4} << 20);
  std::uint64_t total = 0;
  for (const auto& f : fs::recursive_directory_iterator(dir)) {
    if (!f.is_regular_file() || f.path().extension() != ".safetensors") continue;
    const int fd = ::open(f.path().c_str(), O_RDONLY | O_CLOEXEC);
    for (ssize_t n; (n = ::read(fd, buffer.data(), buffer.size())) > 0;) total += static_cast<std::uint64_t>(n);
    ::close(fd);
  }
  return total;
}

void report(Context& ctx, const std::string& name, const Stats& ours, const Stats& peer, const char* peer_name) {
  report_time(ctx, "checkpoint", name, ours, peer, peer_name, "ms", 1e3);
}

void checkpoint_suite(Context& ctx) {
  const ScratchDir dir;
  const std::int64_t width = ctx.quick ? 1024 : 2048;
  const std::string mb = std::to_string(3 * 4 * 4 * width * (width + 1) / 1000000) + " MB";
  // Saved by 2 ranks after one step, so that the AdamW moments exist.
  run_ranks(2, [&](Communicator& comm) {
    auto m = model(width);
    nn::fully_shard(*m, comm);
    nn::AdamW opt(m->parameters(), nn::AdamWOptions{});
    sum(m->forward(ones({2, width}))).backward();
    opt.step();
    nn::save_checkpoint(dir.path.string(), 1, *m, &opt, comm);
  });
  for (const int world : {2, 3}) {
    // Each run builds the model on every rank untimed, then times the load alone (between barriers).
    auto load = [&](bool verify) {
      std::vector<double> seconds;
      for (int run = 0; run < (ctx.quick ? 3 : ctx.repeats) + 1; ++run) {
        run_ranks(world, [&](Communicator& comm) {
          auto m = model(width);
          nn::fully_shard(*m, comm);
          nn::AdamW opt(m->parameters(), nn::AdamWOptions{});
          sum(m->forward(ones({1, width}))).backward();
          opt.step();
          comm.barrier();
          const auto start = std::chrono::steady_clock::now();
          nn::load_checkpoint(dir.path.string(), *m, &opt, comm, {.verify_checksums = verify});
          comm.barrier();
          const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          if (comm.rank() == 0 && run > 0) seconds.push_back(s);  // run 0 warms up
        });
      }
      std::sort(seconds.begin(), seconds.end());
      const std::size_t n = seconds.size();
      return Stats{n % 2 ? seconds[n / 2] : 0.5 * (seconds[n / 2 - 1] + seconds[n / 2]), seconds.front(),
                   seconds.back()};
    };
    const Stats checked = load(true), unchecked = load(false);
    report(ctx,
           "load " + mb + " (model + AdamW) saved by 2 ranks into " + std::to_string(world) +
               " emulated ranks, checksums checked",
           checked, unchecked, "unchecked load");
  }
  const Stats verify = measure(ctx, [&] { nn::verify_checkpoint(dir.path.string()); });
  const Stats raw = measure(ctx, [&] { read_raw(dir.path); });
  report(ctx, "ruda-ckpt verify of " + mb + ": every header, identity and block hash", verify, raw,
         "read the files' bytes");
}

const bool registered = register_suite("checkpoint", checkpoint_suite);

}  // namespace
}  // namespace ruda::bench
