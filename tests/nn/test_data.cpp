// Datasets and batching: IDX files written here (raw and gzip), text loading, the data-parallel
// sampler's partition of every global batch, and row gathers.
#include <zlib.h>

#include <fstream>
#include <set>

#include "helpers.h"

using namespace ruda;
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

  auto corrupt = labels();
  write_gzip(lab, corrupt);
  std::fstream f(lab, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(12);
  f.put('\xff');  // inside the deflate stream
  f.close();
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
