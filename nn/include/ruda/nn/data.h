// Datasets and data-parallel batching: IDX image files (MNIST, Fashion-MNIST; gzip or raw), byte-
// level text, and a sampler that gives each rank its part of every global batch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ruda/tensor.h>

namespace ruda::nn {

struct ImageDataset {
  Tensor images;  // [count, rows * cols] f32 in [0, 1]
  Tensor labels;  // [count] i64
  std::int64_t rows = 0, cols = 0;
  std::int64_t size() const { return labels.numel(); }
};

/// Reads an IDX image file and its IDX label file (each gzip-compressed or raw): all samples, or
/// the first `limit` (> 0) only, reading no further into the files. IOError naming the file on
/// anything missing, truncated or malformed, or when the counts differ.
ImageDataset load_idx(const std::string& images_path, const std::string& labels_path, std::int64_t limit = 0);

/// Where Debian's dataset-fashion-mnist package installs the data.
inline const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";
/// The training (60000) or test (10000) part of Fashion-MNIST in `directory` (the first `limit` samples if > 0).
ImageDataset load_fashion_mnist(const std::string& directory, bool train, std::int64_t limit = 0);

/// The bytes of a text file, or of every regular file of a directory (sorted by name, skipping
/// the fortune program's .dat index files and symbolic links). IOError if nothing is readable.
std::vector<std::uint8_t> load_text_bytes(const std::string& path);

/// Samples of a data-parallel step: epoch e's order is a permutation seeded by (seed, e); global
/// batch b takes positions [b * batch, (b + 1) * batch) of it, and rank r its r-th equal part.
/// The last incomplete batch of an epoch is dropped, so every rank always has the same count.
class BatchSampler {
 public:
  BatchSampler(std::int64_t dataset_size, std::int64_t global_batch, int rank, int world_size, std::uint64_t seed,
               bool shuffle = true);
  std::int64_t batches_per_epoch() const noexcept { return batches_per_epoch_; }
  std::int64_t local_batch() const noexcept { return global_batch_ / world_size_; }
  /// This rank's sample indices (i64 [local_batch]) of batch `batch` of epoch `epoch`.
  Tensor indices(std::int64_t epoch, std::int64_t batch);

 private:
  std::int64_t size_, global_batch_, batches_per_epoch_;
  int rank_, world_size_;
  std::uint64_t seed_;
  bool shuffle_;
  std::int64_t cached_epoch_ = -1;
  std::vector<std::int64_t> order_;
};

/// Rows of `data` (any shape [N, ...]) at i64 `indices`: data[indices[i], ...].
Tensor take_rows(const Tensor& data, const Tensor& indices);

}  // namespace ruda::nn
