// The safetensors format: 8-byte little-endian header length, a JSON header, raw little-endian
// data. Readable by the wider ecosystem. The reader validates the whole header before anything
// is read and never reads outside the file, whatever the header claims.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ruda/tensor.h>

namespace ruda::safetensors {

/// The format's dtype names: F32, F64, F16, BF16, I64, BOOL; DTypeError for a value that is no
/// DType.
const char* format_dtype(DType dtype);

/// The most file bytes a chunked read holds at once (Reader::read_range_chunked): converting a
/// file of any size costs this much memory, outside tensor storage. A multiple of every dtype's
/// size, so chunks hold whole elements.
inline constexpr std::size_t kChunkBytes = std::size_t{4} << 20;

class Writer;

struct TensorInfo {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  std::uint64_t begin = 0, end = 0;  // absolute byte offsets in the file
  std::int64_t numel() const { return shape_numel(shape); }
};

class Reader {
 public:
  /// Opens and validates a file; throws IOError naming the file and the problem (missing,
  /// truncated, header too large or not JSON, a key repeated in one object, unknown dtype, more
  /// dimensions than a tensor holds (kMaxDims, 8), offsets outside the file or not matching the
  /// shape, overlapping tensors). Every read below refuses
  /// elements outside the tensor (IOError naming the call, the tensor and its size) before it
  /// allocates anything, and BOOL bytes other than 0 and 1 (IOError naming the element).
  explicit Reader(const std::string& path);
  ~Reader();
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  const std::string& path() const noexcept { return path_; }
  const std::vector<TensorInfo>& tensors() const noexcept { return tensors_; }
  const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }
  bool contains(const std::string& name) const;
  /// IOError if absent.
  const TensorInfo& info(const std::string& name) const;
  /// A whole tensor.
  Tensor read(const std::string& name) const;
  /// Elements [first, first + count) of the flattened tensor, as a 1-D tensor: only those bytes are read.
  Tensor read_range(const std::string& name, std::int64_t first, std::int64_t count) const;
  /// The same into caller memory (count elements of the tensor's dtype).
  void read_range_into(const std::string& name, std::int64_t first, std::int64_t count, void* destination) const;
  /// The same range in consecutive pieces of at most kChunkBytes, each passed to consume(data,
  /// bytes) and then overwritten: for ranges too large to hold, whatever their size.
  void read_range_chunked(const std::string& name, std::int64_t first, std::int64_t count,
                          const std::function<void(const char*, std::size_t)>& consume) const;
  /// The same range appended to `out`'s data, chunk by chunk: copies between files never hold a tensor.
  void copy_range(const std::string& name, std::int64_t first, std::int64_t count, Writer& out) const;
  /// Bytes read from the file so far (header included), for tests that check partial reads.
  /// Reading is thread-safe: several threads may read from one Reader.
  std::uint64_t bytes_read() const noexcept { return bytes_read_.load(std::memory_order_relaxed); }

 private:
  void read_bytes(std::uint64_t offset, std::uint64_t size, void* destination) const;
  /// The absolute byte offset and size of elements [first, first + count); IOError naming `op`
  /// outside the tensor.
  std::pair<std::uint64_t, std::uint64_t> byte_range(const char* op, const std::string& name, std::int64_t first,
                                                     std::int64_t count) const;
  /// Elements [first, first + count) into `destination`, BOOL values checked.
  void read_elements(const char* op, const std::string& name, std::int64_t first, std::int64_t count,
                     void* destination) const;
  std::string path_;
  int fd_ = -1;
  std::uint64_t file_size_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
  mutable std::atomic<std::uint64_t> bytes_read_{0};
};

/// Validates a header and its tensors against a file of `file_size` bytes: the reader's parser,
/// exposed for fuzzing. Throws IOError on anything malformed.
void parse_header(const std::string& header, std::uint64_t file_size, std::vector<TensorInfo>& tensors,
                  std::map<std::string, std::string>& metadata);

/// A tensor of a file whose header is written before its data (Writer).
struct TensorHeader {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
};

namespace detail {
class AtomicFile;
}

/// Writes a safetensors file without holding its tensors: the header (every name, dtype, shape
/// and offset) at construction, then the tensors' bytes in the order the tensors were given, in
/// pieces of any size. The file places them by element size, largest first (the given order among
/// equal sizes; the reference writer orders those by dtype, then name: readers go by the offsets),
/// so that each starts aligned to its element size.
/// Atomic as write(): nothing appears at `path` before commit(), and a Writer destroyed without
/// commit() (an exception while streaming) or whose commit failed leaves no temporary file behind.
/// The constructor refuses what no reader would accept, naming the tensor: a dtype that is no
/// DType (DTypeError), a negative extent, more than kMaxDims dimensions or a size whose bytes
/// overflow (ShapeError), a header over the readers' limit or not UTF-8, a repeated tensor name or
/// the reserved name __metadata__ (ArgumentError). write() refuses a BOOL tensor's byte other than
/// 0 or 1 (ArgumentError naming the tensor and element), which every reader refuses.
class Writer {
 public:
  Writer(const std::string& path, const std::vector<TensorHeader>& tensors,
         const std::map<std::string, std::string>& metadata = {});
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;
  /// Appends the next `size` data bytes; IOError past the end of the last tensor, ArgumentError
  /// after commit().
  void write(const void* data, std::size_t size);
  /// Flushes and renames into place; IOError if fewer bytes came than the header promises,
  /// ArgumentError the second time.
  void commit();

 private:
  struct Place {
    std::uint64_t offset = 0, bytes = 0;  // in the data
    std::string name;
    bool boolean = false;  // a BOOL tensor, whose bytes write() checks
  };
  std::string path_;
  std::unique_ptr<detail::AtomicFile> file_;
  std::vector<Place> places_;  // of each tensor, in the order given
  std::uint64_t data_bytes_ = 0, written_ = 0, data_start_ = 0, position_ = 0, within_ = 0;
  std::size_t current_ = 0;
  bool committed_ = false;
};

/// Writes tensors (contiguous; any dtype) and string metadata. Atomic: the data goes to a
/// temporary file of its own beside `path` (a new name, never an existing file or link), is
/// flushed to disk, and then renamed over `path`, so `path` always holds either the old complete
/// file or the new complete file. `path` must be missing or a regular file: a directory, a FIFO, a
/// device or a symbolic link there is refused (IOError naming it), never replaced.
void write(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
           const std::map<std::string, std::string>& metadata = {});

/// Installs handlers of SIGINT, SIGTERM and SIGHUP that remove the temporary files of the atomic
/// writes in flight (write, checkpoint saves, consolidate, split) and then end the process as the
/// signal would: a program's choice, for one whose writes a user may interrupt (ruda-ckpt; Ctrl-C
/// during a consolidate left its temporary, hundreds of MB, for good). A program with handlers
/// of its own (ruda-train's graceful stop) does not call it. Up to 16 writes at once are covered.
void remove_temporaries_on_signals();

}  // namespace ruda::safetensors
