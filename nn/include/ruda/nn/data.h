// Datasets and data-parallel batching: IDX image files (MNIST, Fashion-MNIST; gzip or raw), byte-
// level text, and a sampler that gives each rank its part of every global batch. Each dataset
// comes in two forms: loaded whole into memory (ImageDataset, load_text_bytes), or read from its
// files at each request (IdxImages, TextCorpus), so that an MPI process holds only the samples it
// trains and evaluates on. Both forms give the same values, bit for bit. Only regular files are
// read: a FIFO or a device given as data is refused by name, never waited on, and every problem
// with a file (missing, unreadable, a name too long, a header that does not add up) is an IOError
// naming it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ruda/tensor.h>

namespace ruda::nn {

struct ImageDataset {
  Tensor images;  // [count, rows * cols] f32 in [0, 1]
  Tensor labels;  // [count] i64
  std::int64_t rows = 0, cols = 0;
  std::int64_t size() const { return labels.numel(); }
  /// Bytes of sample data held in memory: all of it (emulated ranks of a process share them).
  std::int64_t resident_bytes() const { return static_cast<std::int64_t>(images.nbytes() + labels.nbytes()); }
};

/// Reads an IDX image file and its IDX label file (each gzip-compressed or raw): all samples, or
/// the first `limit` (> 0) only, reading no further into the files. IOError naming the file on
/// anything missing, truncated or malformed, or when the counts differ.
ImageDataset load_idx(const std::string& images_path, const std::string& labels_path, std::int64_t limit = 0);

/// Where Debian's dataset-fashion-mnist package installs the data.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";
/// The training (60000) or test (10000) part of Fashion-MNIST in `directory` (the first `limit` samples if > 0).
ImageDataset load_fashion_mnist(const std::string& directory, bool train, std::int64_t limit = 0);

/// Where uncompressed copies of gzip files go when no directory is given: $XDG_CACHE_HOME/ruda,
/// else $HOME/.cache/ruda (each only when absolute), else ruda-cache-<uid> in the system's
/// temporary directory (refused when it is not this user's own directory).
std::string default_cache_dir();

/// A file that can be read at any offset holding `path`'s content: `path` itself unless it is
/// gzip-compressed (gzip streams cannot be read from the middle); otherwise its decompressed copy
/// in `cache_dir` (default_cache_dir() if empty), named by the source's path, inode, size,
/// modification and status-change times (an edit that keeps the size and sets the modification
/// time back still gets a new copy), and made on first use. The copy is written to a temporary file and renamed into
/// place, so processes racing to make it each find a complete copy or none, and a killed one leaves none. IOError
/// naming the file when it is missing or its gzip stream is corrupt or truncated.
std::string uncompressed_file(const std::string& path, const std::string& cache_dir = "");

/// An IDX image file and its label file, read at each request rather than held: a process holds
/// only the samples it asks for (an MPI rank, its part of each batch and its share of the test
/// set). Copies share the open files; reads are positioned (pread), so threads may read at once.
class IdxImages {
 public:
  /// Opens both files and checks them as load_idx does (IOError naming the file when missing,
  /// truncated or malformed, or when the counts differ); the first `limit` (> 0) samples only.
  /// A gzip file is read through its uncompressed_file() copy in `cache_dir`, which holds at most
  /// what the file's header says and one byte more (a file inflating past it is refused).
  IdxImages(const std::string& images_path, const std::string& labels_path, std::int64_t limit = 0,
            const std::string& cache_dir = "");

  std::int64_t size() const noexcept;
  std::int64_t rows() const noexcept;
  std::int64_t cols() const noexcept;
  /// The images at i64 `indices` (shape S): f32 [S..., rows * cols] in [0, 1], bitwise equal to
  /// take_rows(load_idx(...).images, indices). IndexError for an index outside [0, size()).
  Tensor images(const Tensor& indices) const;
  /// The labels at i64 `indices` (shape S): i64 [S...].
  Tensor labels(const Tensor& indices) const;
  /// Samples [first, last), read in one pass each: a rank's share of an evaluation set.
  Tensor images(std::int64_t first, std::int64_t last) const;
  Tensor labels(std::int64_t first, std::int64_t last) const;

  /// Bytes of sample data held between requests: none (file names, extents and descriptors only).
  std::int64_t resident_bytes() const noexcept { return 0; }
  /// Bytes one requested sample takes in memory (f32 image and i64 label): a rank's data memory is
  /// the samples it holds at once, e.g. local batch * sample_bytes() while it trains.
  std::int64_t sample_bytes() const noexcept;
  /// Bytes read from the files so far, by this object and its copies (samples close to each
  /// other are read in one call, with the bytes between them: a batch's labels, for one).
  std::int64_t bytes_read() const noexcept;
  /// A copy reading the same open files whose bytes_read() counts its own reads (and its own
  /// copies'), from 0: each of the ranks sharing one data set in a process (emulated ranks).
  IdxImages counting_apart() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

/// The Fashion-MNIST part load_fashion_mnist would load, as an IdxImages.
IdxImages open_fashion_mnist(const std::string& directory, bool train, std::int64_t limit = 0,
                             const std::string& cache_dir = "");

/// The bytes of a text file, or of every regular file of a directory (sorted by name, skipping
/// the fortune program's .dat index files and symbolic links). IOError if nothing is readable.
std::vector<std::uint8_t> load_text_bytes(const std::string& path);

/// The bytes load_text_bytes(path) gives, read at each request rather than held: a rank reads only
/// its windows. The files are listed (and their sizes taken) once, at construction.
class TextCorpus {
 public:
  struct File {
    std::string path;
    std::int64_t offset = 0, size = 0;  // where the file's bytes lie in the concatenation
    std::string read_from;              // path itself, or (a gzip file) its uncompressed_file() copy
  };
  /// IOError naming the path when it is missing, a file cannot be opened, or nothing is left. A
  /// gzip file is read through its uncompressed_file() copy in `cache_dir` (its text, not its
  /// compressed bytes).
  explicit TextCorpus(const std::string& path, const std::string& cache_dir = "");

  std::int64_t size() const noexcept { return size_; }
  const std::vector<File>& files() const noexcept { return files_; }
  /// Bytes [pos, pos + len) of the concatenation into `out`, across file boundaries. IndexError
  /// outside [0, size()); IOError naming a file that has shrunk since construction.
  void read(std::int64_t pos, std::int64_t len, std::uint8_t* out) const;
  std::vector<std::uint8_t> read(std::int64_t pos, std::int64_t len) const;
  /// Bytes of text held between requests: none.
  std::int64_t resident_bytes() const noexcept { return 0; }

 private:
  std::vector<File> files_;
  std::int64_t size_ = 0;
};

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
