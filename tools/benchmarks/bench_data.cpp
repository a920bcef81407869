// data suite: what reading a rank's samples from the files (IdxImages, TextCorpus) costs per step,
// against gathering them from the whole dataset held in memory (take_rows, a byte copy).
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <ruda/nn.h>
#include <ruda/random.h>

#include "bench.h"

namespace ruda::bench {
namespace {

namespace fs = std::filesystem;

// A directory of generated files, removed with everything in it at scope end.
struct ScratchDir {
  fs::path path = fs::temp_directory_path() / ("ruda-bench-data-" + std::to_string(::getpid()));
  ScratchDir() { fs::create_directories(path); }
  ~ScratchDir() { fs::remove_all(path); }
};

// A raw IDX file of unsigned bytes with the given extents and pseudo-random content.
void write_idx(const fs::path& path, const std::vector<std::uint32_t>& dims, std::uint64_t seed) {
  std::vector<char> bytes = {0, 0, 0x08, static_cast<char>(dims.size())};
  std::uint64_t count = 1;
  for (auto d : dims) {
    count *= d;
    for (int shift = 24; shift >= 0; shift -= 8) bytes.push_back(static_cast<char>(d >> shift));
  }
  for (std::uint64_t i = 0; i < count; ++i) bytes.push_back(static_cast<char>(random::uniform_double(seed, i) * 256));
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void report(Context& ctx, const std::string& name, const Stats& ours, const Stats& peer, const char* peer_name) {
  report_time(ctx, "data", name, ours, peer, peer_name, "us", 1e6);
}

// Fashion-MNIST's training set in size (60000 images of 28x28): a batch of 128 random samples,
// images and labels, read from the file vs gathered from the tensors load_idx fills.
void image_batch(Context& ctx, const ScratchDir& dir) {
  const fs::path images = dir.path / "images", labels = dir.path / "labels";
  write_idx(images, {60000, 28, 28}, 1);
  write_idx(labels, {60000}, 2);
  const nn::IdxImages files(images.string(), labels.string());
  const nn::ImageDataset loaded = nn::load_idx(images.string(), labels.string());
  nn::BatchSampler sampler(files.size(), 128, 0, 1, 3);
  std::int64_t b = 0;  // a new batch every call: the same rows again would be a kinder case
  auto next = [&] { return sampler.indices(0, b++ % sampler.batches_per_epoch()); };
  const Stats ours = measure(ctx, [&] {
    const Tensor idx = next();
    files.images(idx), files.labels(idx);
  });
  const Stats peer = measure(ctx, [&] {
    const Tensor idx = next();
    nn::take_rows(loaded.images, idx), nn::take_rows(loaded.labels, idx);
  });
  report(ctx, "128 random 28x28 samples of 60000: IdxImages (pread)", ours, peer, "take_rows in memory");
}

// A 2.8 MB corpus in 128 files (the size of Debian's fortunes): ruda-train lm's batch of 16 windows
// of 129 bytes at random positions, read from the files vs copied from load_text_bytes's vector.
void text_windows(Context& ctx, const ScratchDir& dir) {
  const fs::path text = dir.path / "text";
  fs::create_directories(text);
  for (int f = 0; f < 128; ++f) {
    std::ofstream(text / ("part-" + std::to_string(1000 + f))) << std::string(22000, static_cast<char>('a' + f % 26));
  }
  const nn::TextCorpus corpus(text.string());
  const std::vector<std::uint8_t> bytes = nn::load_text_bytes(text.string());
  std::vector<std::uint8_t> window(129);
  std::uint64_t call = 0;
  auto windows = [&](auto&& read) {
    for (int i = 0; i < 16; ++i, ++call) {
      read(static_cast<std::int64_t>(random::uniform_double(4, call) * static_cast<double>(bytes.size() - 129)));
    }
  };
  const Stats ours = measure(ctx, [&] { windows([&](std::int64_t pos) { corpus.read(pos, 129, window.data()); }); });
  const Stats peer =
      measure(ctx, [&] { windows([&](std::int64_t pos) { std::copy_n(bytes.begin() + pos, 129, window.begin()); }); });
  report(ctx, "16 windows of 129 bytes of 2.8 MB in 128 files: TextCorpus (open + pread)", ours, peer,
         "copy from memory");
}

void data_suite(Context& ctx) {
  const ScratchDir dir;
  image_batch(ctx, dir);
  text_windows(ctx, dir);
}

const bool registered = register_suite("data", data_suite);

}  // namespace
}  // namespace ruda::bench
