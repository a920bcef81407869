// Datasets and batching: IDX files written here (raw and gzip), text loading, the data-parallel
// sampler's partition of every global batch, and row gathers; the datasets read from their files at
// each request (IdxImages, TextCorpus) against the ones loaded whole, their cache and their memory.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <atomic>
#include <chrono>

#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <set>
#include <thread>

#include "helpers.h"

using namespace ruda;
using test::names_in;
using test::TempDir;

namespace {

std::vector<std::uint8_t> idx_file(const std::vector<std::uint32_t>& dims, const std::vector<std::uint8_t>& data) {
  std::vector<std::uint8_t> out = {0, 0, 0x08, static_cast<std::uint8_t>(dims.size())};
  for (auto d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<std::uint8_t>(d >> shift));
  }
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

void write_raw(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

void write_gzip(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) == static_cast<int>(bytes.size()));
  REQUIRE(gzclose(f) == Z_OK);
}

// A gzip file of `bytes` with one byte of its deflate stream overwritten.
void write_corrupt_gzip(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  write_gzip(path, bytes);
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(12);
  f.put('\xff');
}

// Three 2x2 images with pixels 0..11 and labels 7, 8, 9.
std::vector<std::uint8_t> images() {
  std::vector<std::uint8_t> pixels(12);
  for (int i = 0; i < 12; ++i) pixels[i] = static_cast<std::uint8_t>(i * 20);
  return idx_file({3, 2, 2}, pixels);
}
std::vector<std::uint8_t> labels() { return idx_file({3}, {7, 8, 9}); }

}  // namespace

TEST_CASE("IDX files, raw or gzip, whole or the first samples; errors name the file") {
  TempDir dir;
  const std::string img = dir.str() + "/train-images-idx3-ubyte", lab = dir.str() + "/train-labels-idx1-ubyte";
  write_raw(img, images());
  write_gzip(lab + ".gz", labels());  // mixed on purpose: each file is read as what it is

  const auto d = nn::load_fashion_mnist(dir.str(), true);
  CHECK(d.size() == 3);
  CHECK(d.rows == 2);
  CHECK(d.cols == 2);
  CHECK(d.labels.to_vector<std::int64_t>() == std::vector<std::int64_t>{7, 8, 9});
  CHECK_CLOSE(d.images.slice(0, 1, 2), {80 / 255.0, 100 / 255.0, 120 / 255.0, 140 / 255.0}, {1, 4});

  const auto first = nn::load_idx(img, lab + ".gz", 2);
  CHECK(first.size() == 2);
  CHECK(first.labels.to_vector<std::int64_t>() == std::vector<std::int64_t>{7, 8});

  test::check_throws<IOError>([&] { nn::load_fashion_mnist(dir.str(), false); },
                              {"t10k-images-idx3-ubyte.gz", "no such file", "dataset-fashion-mnist"});

  auto truncated = images();
  truncated.resize(truncated.size() - 1);
  write_raw(img, truncated);
  test::check_throws<IOError>([&] { nn::load_idx(img, lab + ".gz"); }, {img, "11 data bytes", "says 12"});

  write_raw(img, images());
  write_raw(lab, idx_file({2}, {1, 2}));
  test::check_throws<IOError>([&] { nn::load_idx(img, lab); }, {img, "3 images but 2 labels", lab});
  write_raw(lab, idx_file({1, 3}, {1, 2, 3}));
  test::check_throws<IOError>([&] { nn::load_idx(img, lab); }, {lab, "not an IDX file", "1 dimensions"});

  write_corrupt_gzip(lab, labels());
  CHECK_THROWS_AS(nn::load_idx(img, lab), IOError);
}

TEST_CASE("text: a file, or a directory's files in name order without .dat indexes") {
  TempDir dir;
  write_raw(dir.str() + "/b", {'B'});
  write_raw(dir.str() + "/a", {'A', '\n'});
  write_raw(dir.str() + "/a.dat", {'X'});
  const auto all = nn::load_text_bytes(dir.str());
  CHECK(std::string(all.begin(), all.end()) == "A\nB");
  const auto one = nn::load_text_bytes(dir.str() + "/b");
  CHECK(std::string(one.begin(), one.end()) == "B");
  test::check_throws<IOError>([&] { nn::load_text_bytes(dir.str() + "/missing"); }, {"missing", "no such file"});
  write_raw(dir.str() + "/empty", {});
  test::check_throws<IOError>([&] { nn::load_text_bytes(dir.str() + "/empty"); }, {"empty", "holds no text"});
}

TEST_CASE("BatchSampler: the ranks' parts of a global batch are disjoint and make up the single-rank batch") {
  const std::int64_t size = 103, batch = 12;
  nn::BatchSampler whole(size, batch, 0, 1, 5);
  CHECK(whole.batches_per_epoch() == 8);  // the incomplete last batch is dropped
  for (int world : {2, 3, 4}) {
    std::vector<nn::BatchSampler> ranks;
    for (int r = 0; r < world; ++r) ranks.emplace_back(size, batch, r, world, 5);
    for (std::int64_t epoch : {0, 1}) {
      std::set<std::int64_t> epoch_seen;
      for (std::int64_t b = 0; b < whole.batches_per_epoch(); ++b) {
        std::vector<std::int64_t> joined;
        for (auto& s : ranks) {
          const auto part = s.indices(epoch, b).to_vector<std::int64_t>();
          CHECK(part.size() == static_cast<std::size_t>(batch / world));
          joined.insert(joined.end(), part.begin(), part.end());
        }
        CHECK(joined == whole.indices(epoch, b).to_vector<std::int64_t>());
        epoch_seen.insert(joined.begin(), joined.end());
      }
      CHECK(epoch_seen.size() == static_cast<std::size_t>(8 * batch));  // no sample twice in an epoch
    }
  }
  // The order depends on (seed, epoch) only, and changes with either.
  nn::BatchSampler again(size, batch, 0, 1, 5), other_seed(size, batch, 0, 1, 6);
  CHECK(again.indices(1, 3).to_vector<std::int64_t>() == whole.indices(1, 3).to_vector<std::int64_t>());
  CHECK(whole.indices(0, 0).to_vector<std::int64_t>() != whole.indices(1, 0).to_vector<std::int64_t>());
  CHECK(other_seed.indices(0, 0).to_vector<std::int64_t>() != whole.indices(0, 0).to_vector<std::int64_t>());
  nn::BatchSampler in_order(size, batch, 1, 2, 5, false);
  CHECK(in_order.indices(0, 1).to_vector<std::int64_t>() == std::vector<std::int64_t>{18, 19, 20, 21, 22, 23});

  test::check_throws<ArgumentError>([] { nn::BatchSampler(100, 10, 0, 3, 1); }, {"global batch 10", "3 ranks"});
  test::check_throws<ArgumentError>([] { nn::BatchSampler(100, 10, 2, 2, 1); }, {"rank 2 of world size 2"});
  test::check_throws<ArgumentError>([] { nn::BatchSampler(8, 10, 0, 1, 1); }, {"exceeds the 8 samples"});
  test::check_throws<IndexError>([&] { whole.indices(0, 8); }, {"batch 8 of an epoch of 8"});
}

TEST_CASE("take_rows gathers rows of float, integer and boolean tables") {
  const Tensor idx = from_vector<std::int64_t>({2, 0, 2}, {3});
  const Tensor f = arange(0, 12, 1, DType::f32).reshape({3, 2, 2});
  CHECK_CLOSE(nn::take_rows(f, idx), {8, 9, 10, 11, 0, 1, 2, 3, 8, 9, 10, 11}, {3, 2, 2});
  const Tensor labels = from_vector<std::int64_t>({(std::int64_t{1} << 60) + 1, -4, 5}, {3});
  CHECK(nn::take_rows(labels, idx).to_vector<std::int64_t>() ==
        std::vector<std::int64_t>{5, (std::int64_t{1} << 60) + 1, 5});  // exact beyond 2^53
  const Tensor mask = from_vector<bool>({true, false, false, true, true, false}, {3, 2});
  const Tensor rows = nn::take_rows(mask, from_vector<std::int64_t>({1, 2}, {2}));
  CHECK(rows.shape() == Shape{2, 2});
  CHECK(rows.to_vector<bool>() == std::vector<bool>{false, true, true, false});
  test::check_throws<IndexError>([&] { nn::take_rows(labels, from_vector<std::int64_t>({3}, {1})); },
                                 {"take_rows", "index 3", "3 rows"});
  test::check_throws<DTypeError>([&] { nn::take_rows(labels, from_values({1}, {1})); }, {"take_rows", "f32"});
  test::check_throws<ShapeError>([&] { nn::take_rows(scalar(1.0), idx); }, {"take_rows"});
}

namespace {

// `count` images of rows x cols pixels and their labels, drawn from `seed` (every byte value occurs).
std::pair<std::vector<std::uint8_t>, std::vector<std::uint8_t>> random_idx(std::uint32_t count, std::uint64_t seed,
                                                                           std::uint32_t rows = 3,
                                                                           std::uint32_t cols = 5) {
  std::vector<std::uint8_t> pixels(count * rows * cols), labels(count);
  for (std::size_t i = 0; i < pixels.size(); ++i) {
    pixels[i] = static_cast<std::uint8_t>(random::uniform_double(seed, i) * 256);
  }
  for (std::size_t i = 0; i < labels.size(); ++i) {
    labels[i] = static_cast<std::uint8_t>(random::uniform_double(seed + 1, i) * 10);
  }
  return {idx_file({count, rows, cols}, pixels), idx_file({count}, labels)};
}

// Random indices into `size` samples, with repeats and a run of consecutive ones (read in one go).
Tensor some_indices(std::int64_t size, std::int64_t n, std::uint64_t seed) {
  std::vector<std::int64_t> picks;
  for (std::int64_t i = 0; i < n; ++i) {
    picks.push_back(static_cast<std::int64_t>(random::uniform_double(seed, static_cast<std::uint64_t>(i)) * size));
  }
  for (std::int64_t i = 0; i < 5 && i < size; ++i) picks.push_back(size - 5 + i);
  picks.push_back(picks.front());
  return from_vector(picks, {static_cast<std::int64_t>(picks.size())});
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

// The random-access dataset gives, bit for bit, the rows of the one loaded whole.
void check_same_samples(const nn::IdxImages& files, const nn::ImageDataset& loaded, const Tensor& idx) {
  REQUIRE(files.size() == loaded.size());
  CHECK(files.rows() == loaded.rows);
  CHECK(files.cols() == loaded.cols);
  CHECK(same_bits(files.images(idx), nn::take_rows(loaded.images, idx)));
  CHECK(same_bits(files.labels(idx), nn::take_rows(loaded.labels, idx)));
  const std::int64_t lo = files.size() / 3, hi = files.size() - 1;
  CHECK(same_bits(files.images(lo, hi), loaded.images.slice(0, lo, hi)));
  CHECK(same_bits(files.labels(lo, hi), loaded.labels.slice(0, lo, hi)));
}

}  // namespace

TEST_CASE("IdxImages reads the samples load_idx loads, bit for bit, from raw and gzip files") {
  TempDir dir, cache;
  const auto [img, lab] = random_idx(257, 3);
  write_raw(dir.str() + "/img", img);
  write_raw(dir.str() + "/lab", lab);
  write_gzip(dir.str() + "/img.gz", img);
  write_gzip(dir.str() + "/lab.gz", lab);
  for (const std::string suffix : {"", ".gz"}) {
    CAPTURE(suffix);
    const std::string i = dir.str() + "/img" + suffix, l = dir.str() + "/lab" + suffix;
    const nn::IdxImages files(i, l, 0, cache.str());
    check_same_samples(files, nn::load_idx(i, l), some_indices(257, 300, 11));
    // A copy shares the files; the first samples only with a limit.
    const nn::IdxImages limited(i, l, 100, cache.str()), copy = limited;
    check_same_samples(copy, nn::load_idx(i, l, 100), some_indices(100, 50, 12));
    test::check_throws<IndexError>(
        [&] {
          copy.images(from_vector<std::int64_t>({3, 100}, {2}));
        },
        {"IdxImages::images", "index 100", "100 samples", "img"});
    test::check_throws<IndexError>([&] { copy.labels(from_vector<std::int64_t>({-1}, {1})); }, {"index -1"});
    test::check_throws<DTypeError>([&] { copy.images(from_values({1}, {1})); }, {"IdxImages::images", "i64"});
    // A range past the samples is an IndexError before anything the size of the range is allocated.
    test::check_throws<IndexError>([&] { copy.images(0, std::int64_t{1} << 40); },
                                   {"IdxImages::images", "outside the 100 samples"});
    test::check_throws<IndexError>([&] { copy.labels(99, 101); }, {"IdxImages::labels", "[99, 101)"});
  }
  // An index tensor of any shape, as take_rows takes.
  const nn::IdxImages files(dir.str() + "/img.gz", dir.str() + "/lab", 0, cache.str());
  const Tensor grid = from_vector<std::int64_t>({4, 0, 256, 9}, {2, 2});
  CHECK(files.images(grid).shape() == Shape{2, 2, 15});
  CHECK(files.labels(grid).shape() == Shape{2, 2});
  CHECK(files.images(5, 5).shape() == Shape{0, 15});
}

TEST_CASE("IdxImages checks its files as load_idx does; errors name the file") {
  TempDir dir, cache;
  const std::string img = dir.str() + "/img", lab = dir.str() + "/lab";
  auto open = [&](std::int64_t limit = 0) { return nn::IdxImages(img, lab, limit, cache.str()); };
  write_raw(lab, labels());
  test::check_throws<IOError>([&] { open(); }, {img, "no such file"});

  auto truncated = images();
  truncated.resize(truncated.size() - 1);
  write_raw(img, truncated);
  test::check_throws<IOError>([&] { open(); }, {img, "11 data bytes", "says 12"});
  CHECK(open(2).size() == 2);  // as load_idx: bytes past the samples used are not asked for
  write_gzip(img, truncated);  // the same content compressed: named by the user's path, and the copy read
  test::check_throws<IOError>([&] { open(); }, {img + " (decompressed as " + cache.str(), "11 data bytes"});

  write_raw(img, images());
  write_raw(lab, idx_file({2}, {1, 2}));
  test::check_throws<IOError>([&] { open(); }, {img, "3 images but 2 labels", lab});
  // A limit no larger than both counts hid the mismatch (and a limit between them misnamed the
  // labels' count): the files' own counts are compared, with or without one.
  for (std::int64_t limit : {1, 2, 3}) {
    CAPTURE(limit);
    test::check_throws<IOError>([&] { open(limit); }, {img, "3 images but 2 labels", lab});
    test::check_throws<IOError>([&] { (void)nn::load_idx(img, lab, limit); }, {img, "3 images but 2 labels"});
  }
  // A negative limit read every sample, silently.
  write_raw(lab, labels());
  for (std::int64_t limit : {std::int64_t{-1}, std::int64_t{-1000000}}) {
    CAPTURE(limit);
    test::check_throws<ArgumentError>([&] { open(limit); }, {"IdxImages", "limit", "negative", img});
    test::check_throws<ArgumentError>([&] { (void)nn::load_idx(img, lab, limit); }, {"load_idx", "negative"});
  }
  CHECK(open(0).size() == 3);
  write_raw(lab, idx_file({1, 3}, {1, 2, 3}));
  test::check_throws<IOError>([&] { open(); }, {lab, "not an IDX file", "1 dimensions"});
  write_raw(lab, {0, 0, 8});
  test::check_throws<IOError>([&] { open(); }, {lab, "truncated IDX header"});

  write_corrupt_gzip(lab, labels());
  test::check_throws<IOError>([&] { open(); }, {lab, "corrupt or truncated"});
  std::string said;
  try {
    open();
  } catch (const IOError& e) {
    said = e.what();
  }
  CHECK_FALSE(said.empty());
  CHECK(said.find("<fd:") == std::string::npos);  // zlib's name for the file ("<fd:3>: "), not ours
  CHECK(names_in(cache.str()).size() == 1);       // the image file's copy; none for the corrupt one
}

TEST_CASE("a gzip file cut short anywhere is refused as truncated, and leaves no uncompressed copy") {
  TempDir dir, cache;
  std::vector<std::uint8_t> content(100000);
  for (std::size_t i = 0; i < content.size(); ++i) content[i] = static_cast<std::uint8_t>(i * 13 + i / 97);
  const std::string whole = dir.str() + "/whole.gz";
  write_gzip(whole, content);
  std::ifstream compressed(whole, std::ios::binary);
  const std::vector<std::uint8_t> gz{std::istreambuf_iterator<char>(compressed), std::istreambuf_iterator<char>()};
  REQUIRE(gz.size() > 40);
  // The header alone, inside the deflate stream, and without (part of) the 8-byte trailer: zlib's
  // gzread returned what it had inflated and no error, and a partial copy was cached as complete.
  for (const std::size_t keep : {std::size_t{10}, gz.size() / 2, gz.size() - 8, gz.size() - 1}) {
    CAPTURE(keep);
    const std::string cut = dir.str() + "/cut" + std::to_string(keep) + ".gz";
    write_raw(cut, std::vector<std::uint8_t>(gz.begin(), gz.begin() + static_cast<std::ptrdiff_t>(keep)));
    test::check_throws<IOError>([&] { nn::uncompressed_file(cut, cache.str()); }, {cut, "corrupt or truncated"});
  }
  CHECK(names_in(cache.str()).empty());
  CHECK(nn::load_text_bytes(nn::uncompressed_file(whole, cache.str())) == content);
}

TEST_CASE("the uncompressed copy of a gzip file is made once, atomically, and reused") {
  TempDir dir, cache;
  const std::string raw = dir.str() + "/raw", gz = dir.str() + "/data.gz";
  std::vector<std::uint8_t> content(3 << 20);  // a few MB: the racing writers below overlap
  for (std::size_t i = 0; i < content.size(); ++i) content[i] = static_cast<std::uint8_t>(i * 7 + i / 251);
  write_raw(raw, content);
  write_gzip(gz, content);
  CHECK(nn::uncompressed_file(raw, cache.str()) == raw);  // already readable anywhere

  // Threads racing to make the copy all get the same, complete one, and leave no temporary file.
  const std::string cache_dir = cache.str() + "/made/here";  // made on demand
  std::vector<std::string> got(4);
  std::vector<std::thread> racers;
  for (std::size_t t = 0; t < got.size(); ++t) {
    racers.emplace_back([&, t] { got[t] = nn::uncompressed_file(gz, cache_dir); });
  }
  for (auto& t : racers) t.join();
  for (const auto& path : got) CHECK(path == got[0]);
  CHECK(nn::load_text_bytes(got[0]) == content);
  CHECK(names_in(cache_dir) == std::set<std::string>{std::filesystem::path(got[0]).filename().string()});
  CHECK(std::filesystem::path(got[0]).filename().string().starts_with("data-"));

  // Found again: the same file, not rewritten; a leftover temporary file of a killed writer is ignored.
  struct stat before {
  }, after{};
  REQUIRE(::stat(got[0].c_str(), &before) == 0);
  write_raw(got[0] + ".tmp-1-0", {1, 2});
  CHECK(nn::uncompressed_file(gz, cache_dir) == got[0]);
  REQUIRE(::stat(got[0].c_str(), &after) == 0);
  CHECK(before.st_ino == after.st_ino);
  CHECK(before.st_mtim.tv_nsec == after.st_mtim.tv_nsec);

  // Another version of the source (size, time) gets its own copy.
  content.resize(1000);
  write_gzip(gz, content);
  const std::string changed = nn::uncompressed_file(gz, cache_dir);
  CHECK(changed != got[0]);
  CHECK(nn::load_text_bytes(changed) == content);
  test::check_throws<IOError>([&] { nn::uncompressed_file(dir.str() + "/none.gz", cache_dir); },
                              {"none.gz", "no such file"});
}

TEST_CASE("IdxImages on Debian's Fashion-MNIST gives the samples load_fashion_mnist loads") {
  // Installed by tools/setup (dataset-fashion-mnist); ruda-train's tests need it too.
  REQUIRE_MESSAGE(std::filesystem::exists(std::string(nn::kFashionMnistDir) + "/t10k-images-idx3-ubyte.gz"),
                  "Fashion-MNIST is missing: install Debian's dataset-fashion-mnist (tools/setup)");
  TempDir cache;
  for (const bool train : {false, true}) {
    CAPTURE(train);
    const nn::IdxImages files = nn::open_fashion_mnist(nn::kFashionMnistDir, train, 0, cache.str());
    const nn::ImageDataset loaded = nn::load_fashion_mnist(nn::kFashionMnistDir, train);
    CHECK(files.size() == (train ? 60000 : 10000));
    check_same_samples(files, loaded, some_indices(files.size(), 2000, train ? 21 : 22));
    CHECK(files.resident_bytes() == 0);
    CHECK(loaded.resident_bytes() == files.size() * files.sample_bytes());
  }
}

TEST_CASE("a rank of two reads, and holds, half of what one rank does") {
  TempDir dir, cache;
  const auto [img, lab] = random_idx(8000, 5, 32, 32);
  write_gzip(dir.str() + "/img.gz", img);
  write_gzip(dir.str() + "/lab.gz", lab);
  const std::int64_t batch = 128;
  // Per rank, as in separate MPI processes: its own files, its part of every global batch of an epoch.
  auto rank_epoch = [&](int rank, int world) {
    const nn::IdxImages files(dir.str() + "/img.gz", dir.str() + "/lab.gz", 0, cache.str());
    nn::BatchSampler sampler(files.size(), batch, rank, world, 9);
    memory::Scope scope;
    std::int64_t held = 0;
    for (std::int64_t b = 0; b < sampler.batches_per_epoch(); ++b) {
      const Tensor idx = sampler.indices(0, b);
      const Tensor x = files.images(idx), y = files.labels(idx);
      held = std::max(held, static_cast<std::int64_t>(x.nbytes() + y.nbytes()));
    }
    CHECK(files.resident_bytes() == 0);
    CHECK(held == sampler.local_batch() * files.sample_bytes());
    return std::make_pair(files.bytes_read(), scope.stats().peak_bytes);
  };
  const auto [one_read, one_peak] = rank_epoch(0, 1);
  // 62 whole batches of 1024 pixel bytes, plus what is read through between samples a page apart
  // (the batch's labels mostly: their whole span, 8000 bytes)
  const std::int64_t delivered = 62 * batch * 1025;
  CHECK(one_read >= delivered);
  CHECK(one_read <= delivered * 13 / 10);
  for (int rank : {0, 1}) {
    const auto [read, peak] = rank_epoch(rank, 2);
    CHECK(read * 2 >= one_read * 9 / 10);
    CHECK(read * 2 <= one_read * 12 / 10);
    CHECK(peak * 2 >= one_peak * 9 / 10);  // the batch and its index tensor, halved
    CHECK(peak * 2 <= one_peak * 11 / 10);
  }
}

TEST_CASE("TextCorpus reads the bytes of load_text_bytes at any position, across file boundaries") {
  TempDir dir;
  write_raw(dir.str() + "/c", {'C', 'c'});
  write_raw(dir.str() + "/a", {'A', '\n'});
  write_raw(dir.str() + "/b", {});  // empty: occupies no position
  write_raw(dir.str() + "/a.dat", {'X'});
  write_raw(dir.str() + "/d", {'D', 'd', 'D'});
  std::filesystem::create_symlink(dir.str() + "/a", dir.str() + "/e");  // skipped, as load_text_bytes does
  const std::string all = "A\nCcDdD";
  const auto loaded = nn::load_text_bytes(dir.str());
  CHECK(std::string(loaded.begin(), loaded.end()) == all);

  const nn::TextCorpus corpus(dir.str());
  CHECK(corpus.size() == 7);
  CHECK(corpus.files().size() == 4);
  CHECK(corpus.resident_bytes() == 0);
  for (std::int64_t pos = 0; pos <= corpus.size(); ++pos) {
    for (std::int64_t len = 0; pos + len <= corpus.size(); ++len) {
      const auto got = corpus.read(pos, len);
      CHECK(std::string(got.begin(), got.end()) == all.substr(pos, len));
    }
  }
  test::check_throws<IndexError>([&] { corpus.read(5, 3); }, {"TextCorpus::read", "[5, 8)", "7"});
  test::check_throws<IOError>([&] { nn::TextCorpus(dir.str() + "/none"); }, {"none", "no such file"});
  test::check_throws<IOError>([&] { nn::TextCorpus(dir.str() + "/b"); }, {"/b", "holds no text"});
  write_raw(dir.str() + "/d", {'D'});  // shrunk since the corpus listed it
  test::check_throws<IOError>([&] { corpus.read(4, 3); }, {dir.str() + "/d", "truncated"});
}

TEST_CASE("TextCorpus reads a gzip file's text, not its compressed bytes, also among plain files") {
  // (README: a gzip file is decompressed once into the cache; the corpus used to read the
  // compressed bytes as text.)
  TempDir dir, cache;
  const std::string text = "hello, gzip corpus\n";
  write_gzip(dir.str() + "/a.txt.gz", std::vector<std::uint8_t>(text.begin(), text.end()));
  write_raw(dir.str() + "/b", {'B'});
  const nn::TextCorpus one(dir.str() + "/a.txt.gz", cache.str());
  CHECK(one.size() == static_cast<std::int64_t>(text.size()));
  const auto got = one.read(0, one.size());
  CHECK(std::string(got.begin(), got.end()) == text);
  CHECK(one.files().front().path == dir.str() + "/a.txt.gz");
  CHECK(one.files().front().read_from != one.files().front().path);
  const nn::TextCorpus both(dir.str(), cache.str());
  const auto all = both.read(0, both.size());
  CHECK(std::string(all.begin(), all.end()) == text + "B");
  CHECK(both.resident_bytes() == 0);
  // A damaged stream is refused by name when the corpus is made, not read as text.
  write_corrupt_gzip(dir.str() + "/c.gz", std::vector<std::uint8_t>(text.begin(), text.end()));
  TempDir other_cache;
  test::check_throws<IOError>([&] { nn::TextCorpus(dir.str() + "/c.gz", other_cache.str()); }, {"c.gz"});
}

TEST_CASE("TextWindows draws every window of its range, the last byte's included; bad steps and ranks are refused") {
  TempDir dir;
  write_raw(dir.str() + "/a", {'a', 'b', 'c', 'd', 'e', 'f', 'g', 'h'});
  write_raw(dir.str() + "/b", {'i', 'j', 'k', 'l'});
  const nn::TextCorpus corpus(dir.str());
  // Context 3 over 12 bytes: windows of 4 start at 0 ... 8; the draw left 8 out, so byte 'l' was
  // never a target.
  nn::TextWindows windows(corpus, 0, 12, 3);
  std::set<std::int64_t> starts;
  for (std::int64_t step = 0; step < 400; ++step) {
    const auto [x, y] = windows.batch(9, step, 1, 0, 1);
    starts.insert(x.to_vector<std::int64_t>()[0] - 'a');
    CHECK(y.to_vector<std::int64_t>()[2] == x.to_vector<std::int64_t>()[2] + 1);
  }
  CHECK(starts == std::set<std::int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8});
  // A range of context + 2 bytes has two windows, not one drawn every time.
  nn::TextWindows tight(corpus, 0, 12, 10);
  std::set<std::int64_t> tight_starts;
  for (std::int64_t step = 0; step < 100; ++step)
    tight_starts.insert(tight.batch(9, step, 1, 0, 1).first.to_vector<std::int64_t>()[0]);
  CHECK(tight_starts.size() == 2);
  // The smallest range is context + 1 bytes, one window (context + 2 was asked for); one byte
  // fewer is refused.
  nn::TextWindows one(corpus, 0, 11, 10);
  const auto [ox, oy] = one.batch(9, 0, 2, 0, 1);
  CHECK(ox.to_vector<std::int64_t>()[0] == 'a');
  CHECK(oy.to_vector<std::int64_t>()[9] == 'a' + 10);
  test::check_throws<ArgumentError>([&] { nn::TextWindows(corpus, 0, 10, 10); },
                                    {"TextWindows", "[0, 10)", "context 10", "context + 1"});
  // A step whose stream position would overflow (undefined behaviour before), a negative one, and
  // a rank outside the world (the message spoke of a batch that does not divide) are refused.
  test::check_throws<ArgumentError>(
      [&] { (void)windows.batch(1, std::numeric_limits<std::int64_t>::max() / 2, 4, 0, 1); },
      {"TextWindows::batch", "step"});
  test::check_throws<ArgumentError>([&] { (void)windows.batch(1, -1, 4, 0, 1); }, {"TextWindows::batch", "negative"});
  test::check_throws<ArgumentError>([&] { (void)windows.batch(1, 0, 4, 2, 2); }, {"rank 2 is outside a world of 2"});
}

TEST_CASE("TextCorpus over Debian's fortunes gives the bytes of its files, concatenated in name order") {
  const std::string fortunes = "/usr/share/games/fortunes";  // ruda-train lm's default text
  REQUIRE_MESSAGE(std::filesystem::is_directory(fortunes),
                  "fortunes are missing: install Debian's fortunes (tools/setup)");
  // The reference, read independently of both: every regular file but .dat indexes and links, by name.
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(fortunes)) {
    if (e.is_regular_file() && !e.is_symlink() && e.path().extension() != ".dat") names.push_back(e.path().string());
  }
  std::sort(names.begin(), names.end());
  std::string all;
  for (const auto& name : names) {
    std::ifstream in(name, std::ios::binary);
    all.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const nn::TextCorpus corpus(fortunes);
  REQUIRE(corpus.size() == static_cast<std::int64_t>(all.size()));
  const auto loaded = nn::load_text_bytes(fortunes);
  CHECK(std::string(loaded.begin(), loaded.end()) == all);
  for (const auto& file : corpus.files()) {  // a window over every boundary
    const std::int64_t pos = std::max<std::int64_t>(0, file.offset - 64);
    const std::int64_t len = std::min<std::int64_t>(129, corpus.size() - pos);
    const auto got = corpus.read(pos, len);
    CHECK(std::string(got.begin(), got.end()) == all.substr(pos, len));
  }
}

namespace {

// Runs fn, which must not wait on `fifo` (a FIFO nobody writes to). A reader that opens it anyway
// would block forever: a watchdog then opens the FIFO for writing (which lets a blocked open
// return), again as often as needed, so that the test fails instead of hanging. Returns whether
// the watchdog had to.
template <class F>
bool blocked_on(const std::string& fifo, F&& fn) {
  std::atomic<bool> done{false}, fired{false};
  std::thread watchdog([&] {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (!done) {
      if (std::chrono::steady_clock::now() > deadline) {
        const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);  // only while a reader waits
        if (fd >= 0) {
          fired = true;
          ::close(fd);
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  try {
    fn();
  } catch (...) {
    done = true;
    watchdog.join();
    throw;
  }
  done = true;
  watchdog.join();
  return fired;
}

// Checks that fn raises an IOError naming `fifo` as a FIFO, without waiting on it.
template <class F>
void refuses_fifo(const std::string& fifo, F&& fn, const std::string& what) {
  CAPTURE(what);
  std::string message;
  const bool blocked = blocked_on(fifo, [&] {
    try {
      fn();
    } catch (const IOError& e) {
      message = e.what();
    }
  });
  CHECK_FALSE_MESSAGE(blocked, "blocked opening the FIFO");
  CHECK_MESSAGE(message.find(fifo) != std::string::npos, "'" << message << "' lacks the FIFO's path");
  CHECK_MESSAGE(message.find("FIFO") != std::string::npos, "'" << message << "' does not say FIFO");
}

}  // namespace

TEST_CASE("data readers never wait on a FIFO: each refuses it by name") {
  TempDir dir, cache;
  const std::string fifo = dir.str() + "/fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
  const std::string lab = dir.str() + "/lab";
  write_raw(lab, labels());
  refuses_fifo(
      fifo, [&] { nn::TextCorpus corpus(fifo); }, "TextCorpus");
  refuses_fifo(
      fifo, [&] { nn::load_text_bytes(fifo); }, "load_text_bytes");
  refuses_fifo(
      fifo, [&] { nn::load_idx(fifo, lab); }, "load_idx");
  refuses_fifo(
      fifo, [&] { nn::load_idx(fifo, lab, 2); }, "load_idx with a limit");
  refuses_fifo(
      fifo, [&] { nn::IdxImages(fifo, lab, 0, cache.str()); }, "IdxImages");
  refuses_fifo(
      fifo, [&] { nn::uncompressed_file(fifo, cache.str()); }, "uncompressed_file");
  // A FIFO where the decompressed copy of a gzip file goes: refused by the copy's name.
  write_gzip(dir.str() + "/img.gz", images());
  const std::string copy = nn::uncompressed_file(dir.str() + "/img.gz", cache.str());
  std::filesystem::remove(copy);
  REQUIRE(::mkfifo(copy.c_str(), 0644) == 0);
  refuses_fifo(
      copy, [&] { nn::IdxImages(dir.str() + "/img.gz", lab, 0, cache.str()); }, "IdxImages's copy");
  // A directory of text files skips it.
  write_raw(dir.str() + "/text", {'t'});
  const auto bytes = nn::load_text_bytes(dir.str());
  CHECK(std::string(bytes.begin(), bytes.end()).find('t') != std::string::npos);
}

TEST_CASE(
    "data readers: what std::filesystem refuses (a name too long, a loop of links) is an IOError naming the file") {
  TempDir dir, cache;
  const std::string lab = dir.str() + "/lab";
  write_raw(lab, labels());
  const std::string long_name = dir.str() + "/" + std::string(300, 'n');  // longer than a name may be
  std::filesystem::create_symlink("loop", dir.path / "loop");
  const std::string loop = dir.str() + "/loop/x";
  for (const std::string& bad : {long_name, loop}) {
    CAPTURE(bad);
    const std::string shown = bad.substr(0, 40);  // the start of the path, in any message
    test::check_throws<IOError>([&] { nn::TextCorpus corpus(bad); }, {shown});
    test::check_throws<IOError>([&] { nn::load_text_bytes(bad); }, {shown});
    test::check_throws<IOError>([&] { nn::load_idx(bad, lab); }, {shown});
    test::check_throws<IOError>([&] { nn::load_idx(bad, lab, 2); }, {shown});
    test::check_throws<IOError>([&] { nn::IdxImages(bad, lab, 0, cache.str()); }, {shown});
    test::check_throws<IOError>([&] { nn::uncompressed_file(bad, cache.str()); }, {shown});
    test::check_throws<IOError>([&] { nn::load_fashion_mnist(bad, true); }, {shown});
    test::check_throws<IOError>([&] { nn::open_fashion_mnist(bad, true, 0, cache.str()); }, {shown});
  }
  // A cache directory that cannot be made (a name too long in it).
  write_gzip(dir.str() + "/img.gz", images());
  test::check_throws<IOError>([&] { nn::uncompressed_file(dir.str() + "/img.gz", long_name + "/cache"); },
                              {long_name.substr(0, 40)});
  // A missing file is still "no such file".
  test::check_throws<IOError>([&] { nn::load_text_bytes(dir.str() + "/missing"); }, {"missing", "no such file"});
}

TEST_CASE("IDX: a header whose extents multiply past 64 bits is refused, not read as 0 bytes") {
  TempDir dir, cache;
  const std::string img = dir.str() + "/img", lab = dir.str() + "/lab";
  // 4 x 2^31 x 2^31 = 2^64 bytes: the product wrapped to 0, which matched an empty data part.
  write_raw(img, idx_file({4, 1u << 31, 1u << 31}, {}));
  write_raw(lab, idx_file({4}, {1, 2, 3, 4}));
  for (const std::int64_t limit : {0, 4, 2}) {
    CAPTURE(limit);
    test::check_throws<IOError>([&] { nn::load_idx(img, lab, limit); }, {img});
    test::check_throws<IOError>([&] { nn::IdxImages(img, lab, limit, cache.str()); }, {img});
  }
  test::check_throws<IOError>([&] { nn::load_idx(img, lab); }, {img, "4 x 2147483648 x 2147483648", "overflow"});
  test::check_throws<IOError>([&] { nn::IdxImages(img, lab, 0, cache.str()); }, {img, "overflow"});
  // Every extent at its largest, gzip-compressed: the same.
  write_gzip(img + ".gz", idx_file({0xffffffffu, 0xffffffffu, 0xffffffffu}, {}));
  test::check_throws<IOError>([&] { nn::load_idx(img + ".gz", lab, 3); }, {img + ".gz"});
  test::check_throws<IOError>([&] { nn::IdxImages(img + ".gz", lab, 0, cache.str()); }, {img + ".gz", "overflow"});
}

TEST_CASE("a gzip IDX file that inflates past its header's size is refused having read and written no more") {
  // 8 MiB of zeros after a header for one 4x3 image (a gzip bomb, ~8 KB compressed): load_idx read
  // the whole content into memory before comparing it with the header (2.1 GB for a 1 GiB bomb),
  // and IdxImages decompressed it whole into the cache, where the copy stayed.
  TempDir dir, cache;
  std::vector<std::uint8_t> bomb = idx_file({1, 4, 3}, std::vector<std::uint8_t>(12, 1));
  bomb.resize(bomb.size() + (8 << 20));
  write_gzip(dir.str() + "/img.gz", bomb);
  write_raw(dir.str() + "/lab", idx_file({1}, {3}));
  // One byte past the 12 the header names is read, and no more.
  test::check_throws<IOError>([&] { nn::load_idx(dir.str() + "/img.gz", dir.str() + "/lab"); },
                              {"img.gz", "holds 13 data bytes, its header says 12"});
  test::check_throws<IOError>([&] { nn::IdxImages(dir.str() + "/img.gz", dir.str() + "/lab", 0, cache.str()); },
                              {"img.gz", "13 data bytes", "says 12"});
  for (const auto& entry : std::filesystem::directory_iterator(cache.path)) CHECK(entry.file_size() <= 16 + 12 + 1);
  // A header whose items cannot fit in memory is refused before reading them.
  write_gzip(dir.str() + "/huge.gz", idx_file({60000, 65535, 65535}, {}));
  test::check_throws<OutOfMemoryError>([&] { nn::load_idx(dir.str() + "/huge.gz", dir.str() + "/lab"); },
                                       {"huge.gz", "60000 items", "memory"});
  // ... and a copy the cache's file system cannot hold, before it is written.
  test::check_throws<IOError>([&] { nn::IdxImages(dir.str() + "/huge.gz", dir.str() + "/lab", 0, cache.str()); },
                              {"huge.gz", "decompressed copy needs up to", "free in"});
}

TEST_CASE("IdxImages: samples of no bytes, and a request larger than memory, are answered, not undefined") {
  TempDir dir;
  // [10, 0, 3] images: memcpy from null (undefined behaviour; the sanitizer build aborted).
  write_raw(dir.str() + "/empty", idx_file({10, 0, 3}, {}));
  write_raw(dir.str() + "/lab", idx_file({10}, std::vector<std::uint8_t>(10, 1)));
  const nn::IdxImages empty(dir.str() + "/empty", dir.str() + "/lab");
  CHECK(empty.images(0, 10).shape() == Shape{10, 0});
  // 10^6 samples of a 4096 x 4096 image: 16 TB, a typed error (it was a raw std::bad_alloc).
  write_raw(dir.str() + "/big", idx_file({1, 4096, 4096}, std::vector<std::uint8_t>(4096 * 4096, 7)));
  write_raw(dir.str() + "/one", idx_file({1}, {1}));
  const nn::IdxImages big(dir.str() + "/big", dir.str() + "/one");
  CHECK(big.images(0, 1).shape() == Shape{1, 4096 * 4096});
  test::check_throws<OutOfMemoryError>([&] { big.images(zeros({1000000}, DType::i64)); },
                                       {"IdxImages::images", "1000000 samples", "do not fit in memory"});
}

TEST_CASE("a gzip source edited with its size and modification time kept gets a new copy; a long name works") {
  TempDir dir, cache;
  const std::string gz = dir.str() + "/text.gz";
  auto write_at = [&](char c) {
    write_gzip(gz, std::vector<std::uint8_t>(50, static_cast<std::uint8_t>(c)));
    const struct timespec times[2] = {{1577836800, 0}, {1577836800, 0}};  // 2020-01-01, as touch -d
    REQUIRE(::utimensat(AT_FDCWD, gz.c_str(), times, 0) == 0);
  };
  write_at('a');
  CHECK(nn::TextCorpus(gz, cache.str()).read(0, 5) == std::vector<std::uint8_t>(5, 'a'));
  write_at('b');  // (cp -p, rsync -t, tar x and touch -r keep the time as well)
  CHECK(nn::TextCorpus(gz, cache.str()).read(0, 5) == std::vector<std::uint8_t>(5, 'b'));
  // A 245-byte name is legal; its copy's name (with "-" and 16 hex digits) was not.
  const std::string long_name = dir.str() + "/" + std::string(245, 'L') + ".gz";
  write_gzip(long_name, std::vector<std::uint8_t>(20, 'c'));
  CHECK(nn::TextCorpus(long_name, cache.str()).read(0, 3) == std::vector<std::uint8_t>(3, 'c'));
}

TEST_CASE("the default cache directory is absolute: a relative HOME is ignored as a relative XDG_CACHE_HOME is") {
  struct Env {
    std::string name;
    std::optional<std::string> old;
    Env(std::string n, const char* value) : name(std::move(n)) {
      if (const char* v = std::getenv(name.c_str())) old = v;
      value ? ::setenv(name.c_str(), value, 1) : ::unsetenv(name.c_str());
    }
    ~Env() { old ? ::setenv(name.c_str(), old->c_str(), 1) : ::unsetenv(name.c_str()); }
  };
  TempDir temp, elsewhere, source;
  const Env xdg("XDG_CACHE_HOME", nullptr), home("HOME", "relative/home"), tmpdir("TMPDIR", temp.str().c_str());
  const std::string dir = nn::default_cache_dir();
  CHECK(std::filesystem::path(dir).is_absolute());
  CHECK(dir.find("relative") == std::string::npos);
  CHECK(dir == (temp.path / ("ruda-cache-" + std::to_string(::geteuid()))).string());
  // The temporary directory's cache must be this user's own directory: one planted there first
  // (here a link to another directory) is refused, not written into.
  const std::string gz = source.str() + "/text.gz";
  write_gzip(gz, std::vector<std::uint8_t>(20, 'x'));
  std::filesystem::create_directory_symlink(elsewhere.path, dir);
  test::check_throws<IOError>([&] { nn::uncompressed_file(gz); }, {dir, "not this user's own directory"});
  CHECK(names_in(elsewhere.str()).empty());
  std::filesystem::remove(dir);
  CHECK(nn::load_text_bytes(nn::uncompressed_file(gz)) == std::vector<std::uint8_t>(20, 'x'));
  CHECK(std::filesystem::path(nn::uncompressed_file(gz)).parent_path() == dir);
}
