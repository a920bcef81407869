#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>

#include <ruda/autograd.h>
#include <ruda/nn/data.h>
#include <ruda/random.h>

namespace ruda::nn {

namespace fs = std::filesystem;

namespace {

[[noreturn]] void data_fail(const std::string& path, const std::string& what) { throw IOError(path + ": " + what); }

// The (decompressed) content of a gzip or plain file, up to max_bytes.
std::vector<std::uint8_t> read_maybe_gzip(const std::string& path, std::uint64_t max_bytes = ~std::uint64_t{0}) {
  if (!fs::exists(path)) data_fail(path, "no such file");
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) data_fail(path, "cannot open");
  std::vector<std::uint8_t> out;
  std::uint8_t buf[1 << 16];
  while (out.size() < max_bytes) {
    const int n = gzread(f, buf, static_cast<unsigned>(std::min<std::uint64_t>(sizeof buf, max_bytes - out.size())));
    if (n < 0) {
      int code = 0;
      const std::string message = gzerror(f, &code);
      gzclose(f);
      data_fail(path, "corrupt or truncated: " + message);
    }
    if (n == 0) break;
    out.insert(out.end(), buf, buf + n);
  }
  gzclose(f);
  return out;
}

std::uint32_t big_endian(const std::uint8_t* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) | p[3];
}

// IDX: zero, zero, type 0x08 (unsigned byte), the number of dimensions, the big-endian extents, the data.
// With `limit`, only the first `limit` items were read: the data must hold exactly those.
std::vector<std::uint32_t> idx_dims(const std::vector<std::uint8_t>& bytes, const std::string& path, int expected_dims,
                                    std::int64_t limit) {
  if (bytes.size() < 4) data_fail(path, "truncated IDX header");
  if (bytes[0] != 0 || bytes[1] != 0 || bytes[2] != 0x08 || bytes[3] != expected_dims) {
    data_fail(path, "not an IDX file of unsigned bytes with " + std::to_string(expected_dims) + " dimensions");
  }
  const std::size_t header = 4 + 4 * static_cast<std::size_t>(expected_dims);
  if (bytes.size() < header) data_fail(path, "truncated IDX header");
  std::vector<std::uint32_t> dims;
  for (int i = 0; i < expected_dims; ++i) dims.push_back(big_endian(bytes.data() + 4 + 4 * i));
  if (limit > 0 && limit < static_cast<std::int64_t>(dims[0])) dims[0] = static_cast<std::uint32_t>(limit);
  std::uint64_t count = 1;
  for (auto d : dims) count *= d;
  if (bytes.size() - header != count) {
    data_fail(path, "holds " + std::to_string(bytes.size() - header) + " data bytes, its header says " +
                        std::to_string(count));
  }
  return dims;
}

}  // namespace

ImageDataset load_idx(const std::string& images_path, const std::string& labels_path, std::int64_t limit) {
  // With a limit, read the header, then only as many bytes as `limit` items need.
  auto read = [&](const std::string& path, int dims) {
    if (limit <= 0) return read_maybe_gzip(path);
    auto head = read_maybe_gzip(path, 4 + 4 * static_cast<std::uint64_t>(dims));
    if (head.size() < 4 + 4 * static_cast<std::size_t>(dims)) data_fail(path, "truncated IDX header");
    std::uint64_t item = 1;
    for (int i = 1; i < dims; ++i) item *= big_endian(head.data() + 4 + 4 * i);
    const std::uint64_t items = std::min<std::uint64_t>(big_endian(head.data() + 4), static_cast<std::uint64_t>(limit));
    return read_maybe_gzip(path, 4 + 4 * static_cast<std::uint64_t>(dims) + items * item);
  };
  const auto images = read(images_path, 3);
  const auto labels = read(labels_path, 1);
  const auto idims = idx_dims(images, images_path, 3, limit);
  const auto ldims = idx_dims(labels, labels_path, 1, limit);
  if (idims[0] != ldims[0]) {
    data_fail(images_path,
              std::to_string(idims[0]) + " images but " + std::to_string(ldims[0]) + " labels in " + labels_path);
  }
  ImageDataset d;
  d.rows = idims[1];
  d.cols = idims[2];
  const std::int64_t n = idims[0], pixels = d.rows * d.cols;
  autograd::NoGradGuard guard;
  std::vector<float> values(static_cast<std::size_t>(n * pixels));
  const std::uint8_t* src = images.data() + 16;
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(src[i]) / 255.0f;
  d.images = from_vector(values, {n, pixels});
  std::vector<std::int64_t> y(labels.begin() + 8, labels.end());
  d.labels = from_vector(y, {n});
  return d;
}

ImageDataset load_fashion_mnist(const std::string& directory, bool train, std::int64_t limit) {
  const std::string prefix = train ? "train" : "t10k";
  auto find = [&](const std::string& stem) {
    for (const char* suffix : {".gz", ""}) {
      const fs::path p = fs::path(directory) / (stem + suffix);
      if (fs::exists(p)) return p.string();
    }
    data_fail((fs::path(directory) / (stem + ".gz")).string(),
              "no such file (install Debian's dataset-fashion-mnist, or pass the directory holding the IDX files)");
  };
  const std::string images = find(prefix + "-images-idx3-ubyte");  // images first: errors name them first
  const std::string labels = find(prefix + "-labels-idx1-ubyte");
  return load_idx(images, labels, limit);
}

std::vector<std::uint8_t> load_text_bytes(const std::string& path) {
  std::vector<std::string> files;
  if (fs::is_directory(path)) {
    for (const auto& entry : fs::directory_iterator(path)) {
      if (!entry.is_regular_file() || entry.is_symlink() || entry.path().extension() == ".dat") continue;
      files.push_back(entry.path().string());
    }
    std::sort(files.begin(), files.end());
  } else {
    if (!fs::exists(path)) data_fail(path, "no such file or directory");
    files.push_back(path);
  }
  std::vector<std::uint8_t> out;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) data_fail(f, "cannot open");
    out.insert(out.end(), std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  if (out.empty()) data_fail(path, "holds no text");
  return out;
}

BatchSampler::BatchSampler(std::int64_t dataset_size, std::int64_t global_batch, int rank, int world_size,
                           std::uint64_t seed, bool shuffle)
    : size_(dataset_size),
      global_batch_(global_batch),
      rank_(rank),
      world_size_(world_size),
      seed_(seed),
      shuffle_(shuffle) {
  if (world_size <= 0 || rank < 0 || rank >= world_size) {
    fail<ArgumentError>("BatchSampler", "rank ", rank, " of world size ", world_size);
  }
  if (global_batch <= 0 || global_batch % world_size != 0) {
    fail<ArgumentError>("BatchSampler", "global batch ", global_batch, " must be a positive multiple of the ",
                        world_size, " ranks");
  }
  if (global_batch > dataset_size) {
    fail<ArgumentError>("BatchSampler", "global batch ", global_batch, " exceeds the ", dataset_size, " samples");
  }
  batches_per_epoch_ = dataset_size / global_batch;
}

Tensor BatchSampler::indices(std::int64_t epoch, std::int64_t batch) {
  if (batch < 0 || batch >= batches_per_epoch_) {
    fail<IndexError>("BatchSampler", "batch ", batch, " of an epoch of ", batches_per_epoch_);
  }
  if (epoch != cached_epoch_) {
    order_.resize(static_cast<std::size_t>(size_));
    std::iota(order_.begin(), order_.end(), std::int64_t{0});
    if (shuffle_) {
      // Fisher-Yates with counter-based draws: the order depends on (seed, epoch) only.
      const std::uint64_t stream = seed_ ^ (0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(epoch + 1));
      for (std::int64_t i = size_ - 1; i > 0; --i) {
        const double u = random::uniform_double(stream, static_cast<std::uint64_t>(i));
        const auto j = std::min(i, static_cast<std::int64_t>(u * static_cast<double>(i + 1)));
        std::swap(order_[i], order_[j]);
      }
    }
    cached_epoch_ = epoch;
  }
  const std::int64_t local = local_batch();
  const auto first = order_.begin() + batch * global_batch_ + rank_ * local;
  return from_vector(std::vector<std::int64_t>(first, first + local), {local});
}

Tensor take_rows(const Tensor& data, const Tensor& indices) {
  if (data.ndim() < 1) fail<ShapeError>("take_rows", "needs at least one dimension, got ", data.shape());
  Shape row_shape(data.shape().begin() + 1, data.shape().end());
  const std::int64_t row = shape_numel(row_shape);
  Shape out_shape = indices.shape();
  out_shape.insert(out_shape.end(), row_shape.begin(), row_shape.end());
  if (is_floating(data.dtype())) {
    return embedding(data.reshape({data.shape()[0], row}), indices).reshape(out_shape);
  }
  // Integer and boolean rows (labels, token ids): a plain row copy. embedding takes float tables,
  // and casting a whole table to get a few rows would cost far more than the rows themselves.
  if (indices.dtype() != DType::i64) {
    fail<DTypeError>("take_rows", "indices must be i64, got ", dtype_name(indices.dtype()));
  }
  const std::int64_t rows = data.shape()[0];
  const std::size_t row_bytes = static_cast<std::size_t>(row) * dtype_size(data.dtype());
  const auto picks = indices.to_vector<std::int64_t>();
  Tensor out = empty(out_shape, data.dtype());
  const auto* src = static_cast<const std::uint8_t*>(data.data_ptr());
  auto* dst = static_cast<std::uint8_t*>(out.data_ptr());
  for (std::size_t i = 0; i < picks.size(); ++i) {
    if (picks[i] < 0 || picks[i] >= rows) {
      fail<IndexError>("take_rows", "index ", picks[i], " out of range for ", rows, " rows of ", data.shape());
    }
    std::memcpy(dst + i * row_bytes, src + static_cast<std::size_t>(picks[i]) * row_bytes, row_bytes);
  }
  return out;
}

}  // namespace ruda::nn
