#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <numeric>

#include <ruda/autograd.h>
#include <ruda/memory.h>
#include <ruda/nn/data.h>
#include <ruda/random.h>

#include "io/files.h"

namespace ruda::nn {

namespace fs = std::filesystem;

namespace {

[[noreturn]] void data_fail(const std::string& path, const std::string& what) { throw IOError(path + ": " + what); }

// Opens `path`, a regular file, for reading: a missing one is "no such file"; a FIFO is refused by
// name, never waited on, as anything else that is not a regular file
// (safetensors::open_regular_file). The filesystem calls of this file all take error codes, so
// that what goes wrong (a name too long, a directory that cannot be read) is an IOError naming
// the file, never a std::filesystem::filesystem_error.
int open_data_file(const std::string& path) {
  try {
    return safetensors::open_regular_file(path, "");
  } catch (const IOError&) {
    std::error_code ec;  // (another reason, a name too long say, is the one open gave)
    if (fs::status(path, ec).type() == fs::file_type::not_found) data_fail(path, "no such file");
    throw;
  }
}

// zlib's message for f, without the "<fd:3>: " it names a gzdopen'ed file by (the caller names the path).
std::string zlib_message(gzFile f, int* code) {
  std::string message = gzerror(f, code);
  if (message.rfind("<fd:", 0) == 0) {
    const std::size_t colon = message.find(">: ");
    if (colon != std::string::npos) message.erase(0, colon + 3);
  }
  return message;
}

// Streams the (decompressed) content of a gzip or plain file, up to max_bytes, to `sink` in pieces.
void read_gzip_stream(const std::string& path, std::uint64_t max_bytes,
                      const std::function<void(const std::uint8_t*, std::size_t)>& sink) {
  const int fd = open_data_file(path);
  gzFile f = gzdopen(fd, "rb");  // owns fd from here
  if (!f) {
    ::close(fd);
    data_fail(path, "cannot open");
  }
  std::uint8_t buf[1 << 16];
  std::uint64_t done = 0;
  while (done < max_bytes) {
    const int n = gzread(f, buf, static_cast<unsigned>(std::min<std::uint64_t>(sizeof buf, max_bytes - done)));
    if (n < 0) {
      int code = 0;
      const std::string message = zlib_message(f, &code);
      gzclose(f);
      data_fail(path, "corrupt or truncated: " + message);
    }
    if (n == 0) {
      // The end of the input: zlib's gzread returns what it inflated and reports a stream cut
      // short (no end block, no trailer) only through gzerror's Z_BUF_ERROR.
      int code = Z_OK;
      const std::string message = zlib_message(f, &code);
      if (code != Z_OK) {
        gzclose(f);
        data_fail(path, "corrupt or truncated: " +
                            (code == Z_BUF_ERROR ? std::string("the compressed stream ends early") : message));
      }
      break;
    }
    try {
      sink(buf, static_cast<std::size_t>(n));
    } catch (...) {
      gzclose(f);
      throw;
    }
    done += static_cast<std::uint64_t>(n);
  }
  gzclose(f);
}

// The (decompressed) content of a gzip or plain file, up to max_bytes; OutOfMemoryError naming
// the file where it does not fit in memory.
std::vector<std::uint8_t> read_maybe_gzip(const std::string& path, std::uint64_t max_bytes = ~std::uint64_t{0}) {
  std::vector<std::uint8_t> out;
  try {
    read_gzip_stream(path, max_bytes, [&](const std::uint8_t* p, std::size_t n) { out.insert(out.end(), p, p + n); });
  } catch (const std::bad_alloc&) {
    fail<OutOfMemoryError>("load_idx", path, ": its content (", out.size(),
                           " bytes read so far) does not fit in memory");
  }
  return out;
}

std::uint32_t big_endian(const std::uint8_t* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) | p[3];
}

// The extents of an IDX header (`head`: the file's first bytes), checked: the magic, the number
// of dimensions, and the product of the extents (the data's bytes) within int64 with room for the
// f32 samples made of them, zeros left out (as for a safetensors shape: an empty data set's other
// extents still size its samples), so that no count computed from them wraps: 4 x 2^31 x 2^31
// wrapped to 0, which an empty data part then matched.
std::vector<std::uint32_t> header_dims(const std::vector<std::uint8_t>& head, const std::string& path,
                                       int expected_dims) {
  if (head.size() < 4) data_fail(path, "truncated IDX header");
  if (head[0] != 0 || head[1] != 0 || head[2] != 0x08 || head[3] != expected_dims) {
    data_fail(path, "not an IDX file of unsigned bytes with " + std::to_string(expected_dims) + " dimensions");
  }
  const std::size_t header = 4 + 4 * static_cast<std::size_t>(expected_dims);
  if (head.size() < header) data_fail(path, "truncated IDX header");
  std::vector<std::uint32_t> dims;
  for (int i = 0; i < expected_dims; ++i) dims.push_back(big_endian(head.data() + 4 + 4 * i));
  constexpr std::uint64_t kMaxProduct = std::numeric_limits<std::int64_t>::max() / 8;
  std::uint64_t product = 1;
  bool overflows = false;
  for (const std::uint64_t d : dims) {
    if (d == 0) continue;
    overflows = overflows || __builtin_mul_overflow(product, d, &product) || product > kMaxProduct;
  }
  if (overflows) {
    std::string extents;
    for (const auto d : dims) extents += (extents.empty() ? "" : " x ") + std::to_string(d);
    data_fail(path, "its IDX header's extents " + extents + " make more bytes than 64 bits count (overflow)");
  }
  return dims;
}

// IDX: zero, zero, type 0x08 (unsigned byte), the number of dimensions, the big-endian extents, the data.
// `head` holds the file's first bytes (at least the header, unless the file is shorter), `file_bytes`
// its size. With `limit`, only the first `limit` items are used: the data must hold at least those.
std::vector<std::uint32_t> idx_dims(const std::vector<std::uint8_t>& head, std::uint64_t file_bytes,
                                    const std::string& path, int expected_dims, std::int64_t limit) {
  std::vector<std::uint32_t> dims = header_dims(head, path, expected_dims);
  const std::size_t header = 4 + 4 * static_cast<std::size_t>(expected_dims);
  if (limit > 0 && limit < static_cast<std::int64_t>(dims[0])) dims[0] = static_cast<std::uint32_t>(limit);
  std::uint64_t count = 1;
  for (auto d : dims) count *= d;  // at most the header's own product: no overflow
  // (With a limit, bytes past the items used are never read, so they are not counted either.)
  const std::uint64_t data = limit > 0 ? std::min(file_bytes - header, count) : file_bytes - header;
  if (data != count) {
    data_fail(path, "holds " + std::to_string(data) + " data bytes, its header says " + std::to_string(count));
  }
  return dims;
}

std::vector<std::uint32_t> idx_dims(const std::vector<std::uint8_t>& bytes, const std::string& path, int expected_dims,
                                    std::int64_t limit) {
  return idx_dims(bytes, bytes.size(), path, expected_dims, limit);
}

// A file open for positioned reads, closed with its last owner. pread leaves no shared file
// position behind, so threads (emulated ranks) can read through one descriptor at once.
class ReadFile {
 public:
  explicit ReadFile(const std::string& path) : path_(path), fd_(open_data_file(path)) {}
  ~ReadFile() { ::close(fd_); }
  ReadFile(const ReadFile&) = delete;
  ReadFile& operator=(const ReadFile&) = delete;

  std::uint64_t size() const {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) data_fail(path_, std::string("cannot stat: ") + std::strerror(errno));
    return static_cast<std::uint64_t>(st.st_size);
  }
  // Exactly `n` bytes at `offset`, or an IOError naming `label` (the file as the user knows it).
  void read(std::uint64_t offset, std::size_t n, std::uint8_t* out, const std::string& label) const {
    std::size_t done = 0;
    while (done < n) {
      const ssize_t got = ::pread(fd_, out + done, n - done, static_cast<off_t>(offset + done));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) data_fail(label, std::string("read failed: ") + std::strerror(errno));
      if (got == 0) {
        data_fail(label,
                  "truncated: ends before byte " + std::to_string(offset + n) + " (changed since it was opened?)");
      }
      done += static_cast<std::size_t>(got);
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
};

// One IDX file open for reads of any item: its extents (dims[0] is the items used) and layout.
struct IdxFile {
  std::shared_ptr<ReadFile> file;
  std::string label;                   // the name errors give: the user's path, and the cache copy read for it
  std::vector<std::uint32_t> dims;     // with the limit applied to dims[0]
  std::uint32_t items_in_file = 0;     // the header's own count, for comparing images with labels
  std::uint64_t header = 0, item = 1;  // bytes before the first item, and bytes per item
};

bool is_gzip(const std::string& path);
std::string uncompressed_copy(const std::string& path, const std::string& cache_dir, std::uint64_t max_bytes);

IdxFile open_idx(const std::string& path, int expected_dims, std::int64_t limit, const std::string& cache_dir) {
  IdxFile f;
  f.header = 4 + 4 * static_cast<std::uint64_t>(expected_dims);
  // A gzip file's copy holds at most what its header says and one byte more (which shows that it
  // holds more than it says): a gzip bomb inflated to disk whole, and its copy stayed.
  std::uint64_t most = ~std::uint64_t{0};
  if (is_gzip(path)) {
    const auto extents = header_dims(read_maybe_gzip(path, f.header), path, expected_dims);
    std::uint64_t data = 1;
    for (const std::uint64_t d : extents) data *= d;  // checked by header_dims: no overflow
    most = f.header + data + 1;
  }
  const std::string raw = uncompressed_copy(path, cache_dir, most);
  f.label = raw == path ? path : path + " (decompressed as " + raw + ")";
  f.file = std::make_shared<ReadFile>(raw);
  const std::uint64_t bytes = f.file->size();
  std::vector<std::uint8_t> head(static_cast<std::size_t>(std::min(bytes, f.header)));
  f.file->read(0, head.size(), head.data(), f.label);
  f.dims = idx_dims(head, bytes, f.label, expected_dims, limit);
  f.items_in_file = header_dims(head, f.label, expected_dims)[0];
  for (std::size_t i = 1; i < f.dims.size(); ++i) f.item *= f.dims[i];
  return f;
}

// Items less than a page apart are read in one call, with the bytes between them: the kernel
// copies whole pages anyway, and a call costs a few microseconds (3 us on the 2-core VM). So a
// batch's 1-byte labels take one read, where 28x28 images take one each. A group stops at
// kMaxGroupBytes, which bounds the transient buffer.
constexpr std::uint64_t kMaxGapBytes = 4 << 10, kMaxGroupBytes = 256 << 10;

std::vector<std::uint8_t> read_items(const IdxFile& f, const std::vector<std::int64_t>& picks, const char* op,
                                     std::atomic<std::int64_t>& read) {
  const std::int64_t count = f.dims[0];
  for (const std::int64_t i : picks) {
    if (i < 0 || i >= count) fail<IndexError>(op, "index ", i, " out of range for ", count, " samples of ", f.label);
  }
  std::vector<std::size_t> order(picks.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return picks[a] < picks[b]; });
  const auto item = static_cast<std::size_t>(f.item);
  std::vector<std::uint8_t> out, group;
  if (item == 0) return out;  // (empty items: nothing to read, and memcpy may not take null)
  std::size_t bytes = 0;
  // Beyond memory and swap it is refused before allocating (AddressSanitizer's operator new
  // aborts where the system's throws std::bad_alloc, caught below for what still fails).
  if (__builtin_mul_overflow(picks.size(), item, &bytes) || bytes > safetensors::detail::memory_ceiling_bytes()) {
    fail<OutOfMemoryError>(op, picks.size(), " samples of ", item, " bytes from ", f.label,
                           " do not fit in memory (more than its memory and swap)");
  }
  try {
    out.resize(bytes);
  } catch (const std::bad_alloc&) {
    fail<OutOfMemoryError>(op, picks.size(), " samples of ", item, " bytes from ", f.label, " (",
                           memory::format_bytes(static_cast<std::int64_t>(std::min<std::size_t>(bytes, INT64_MAX))),
                           ") do not fit in memory");
  }
  for (std::size_t first = 0, last; first < order.size(); first = last) {
    const std::int64_t lo = picks[order[first]];
    for (last = first + 1; last < order.size(); ++last) {
      const std::int64_t gap = picks[order[last]] - picks[order[last - 1]] - 1;  // -1 for a repeat
      const std::int64_t span = picks[order[last]] - lo + 1;
      if (gap > 0 && static_cast<std::uint64_t>(gap) * item > kMaxGapBytes) break;
      if (static_cast<std::uint64_t>(span) * item > kMaxGroupBytes) break;
    }
    group.resize(static_cast<std::size_t>(picks[order[last - 1]] - lo + 1) * item);
    f.file->read(f.header + static_cast<std::uint64_t>(lo) * item, group.size(), group.data(), f.label);
    read += static_cast<std::int64_t>(group.size());
    for (std::size_t k = first; k < last; ++k) {
      std::memcpy(out.data() + order[k] * item, group.data() + static_cast<std::size_t>(picks[order[k]] - lo) * item,
                  item);
    }
  }
  return out;
}

std::vector<std::int64_t> index_values(const Tensor& indices, const char* op) {
  if (!indices.defined()) fail<ArgumentError>(op, "the indices tensor is undefined");
  if (indices.dtype() != DType::i64) fail<DTypeError>(op, "indices must be i64, got ", dtype_name(indices.dtype()));
  return indices.to_vector<std::int64_t>();
}

std::vector<std::int64_t> index_range(std::int64_t first, std::int64_t last, std::int64_t size, const char* op) {
  if (first < 0 || last < first) fail<IndexError>(op, "range [", first, ", ", last, ") is not a range of samples");
  // Before the allocation the range sizes: a range past the dataset is refused here, not by a failed allocation.
  if (last > size) fail<IndexError>(op, "range [", first, ", ", last, ") is outside the ", size, " samples");
  std::vector<std::int64_t> picks(static_cast<std::size_t>(last - first));
  std::iota(picks.begin(), picks.end(), first);
  return picks;
}

// Pixels as load_idx converts them, so that both paths give the same floats bit for bit.
Tensor pixels_to_f32(const std::uint8_t* pixels, const Shape& shape) {
  autograd::NoGradGuard guard;
  Tensor out = empty(shape, DType::f32);
  auto* dst = static_cast<float*>(out.data_ptr());
  const std::int64_t n = out.numel();  // (an out-of-line call: in the loop's condition it kept it scalar)
  for (std::int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(pixels[i]) / 255.0f;
  return out;
}

Tensor labels_to_i64(const std::vector<std::uint8_t>& labels, const Shape& shape) {
  autograd::NoGradGuard guard;
  return from_vector(std::vector<std::int64_t>(labels.begin(), labels.end()), shape);
}

// A 64-bit FNV-1a hash: stable across runs and builds (std::hash is not), as cache names must be.
std::uint64_t fnv1a(const std::string& text) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const unsigned char c : text) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

bool is_gzip(const std::string& path) {
  ReadFile f(path);
  std::uint8_t magic[2] = {0, 0};
  if (f.size() < 2) return false;
  f.read(0, 2, magic, path);
  return magic[0] == 0x1f && magic[1] == 0x8b;
}

// The cache copy's name: the source's name without .gz (its first 128 bytes: a legal 250-byte
// name made one past NAME_MAX), and a hash of what identifies this version of it: its absolute
// path, device and inode, size, and modification and status-change times. The status-change time
// is what no one sets: an edit that kept the size and set the modification time back (cp -p,
// rsync -t, tar x, touch -r) was read from the old copy.
std::string cache_name(const std::string& path) {
  std::error_code ec;
  fs::path source = fs::absolute(path, ec);
  if (!ec) source = fs::weakly_canonical(source, ec);
  if (ec) data_fail(path, "cannot be identified for its decompressed copy: " + ec.message());
  struct stat st {};
  if (::stat(source.c_str(), &st) != 0)
    data_fail(path, std::string("cannot be identified for its decompressed copy: ") + std::strerror(errno));
  std::string key = source.string();
  for (const long long part :
       {static_cast<long long>(st.st_dev), static_cast<long long>(st.st_ino), static_cast<long long>(st.st_size),
        static_cast<long long>(st.st_mtim.tv_sec), static_cast<long long>(st.st_mtim.tv_nsec),
        static_cast<long long>(st.st_ctim.tv_sec), static_cast<long long>(st.st_ctim.tv_nsec)})
    key.append("|").append(std::to_string(part));
  char hash[17];
  std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(fnv1a(key)));
  const fs::path name = source.filename();
  const std::string stem = name.extension() == ".gz" ? name.stem().string() : name.string();
  return stem.substr(0, 128) + "-" + hash;
}

// Decompresses `source` into `target` atomically: a temporary file of its own beside it, flushed
// and renamed into place (AtomicFile, as every file nn writes), so processes and threads racing to
// make the copy each rename a complete one, and a killed one leaves none.
// At most max_bytes are written (an IDX file's header says how many it may hold).
void decompress_to(const std::string& source, const std::string& target, std::uint64_t max_bytes) {
  safetensors::detail::AtomicFile file(target, "", /*crash_simulation=*/false);
  read_gzip_stream(source, max_bytes, [&](const std::uint8_t* p, std::size_t n) { file.write(p, n); });
  file.commit();
}

std::vector<std::string> text_files(const std::string& path) {
  std::vector<std::string> files;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (status.type() == fs::file_type::not_found) data_fail(path, "no such file or directory");
  if (fs::is_directory(status)) {
    // Regular files only, not through links (a FIFO would block, a link may lead anywhere).
    fs::directory_iterator it(path, ec);
    for (const fs::directory_iterator end; !ec && it != end; it.increment(ec)) {
      std::error_code probing;
      if (it->symlink_status(probing).type() != fs::file_type::regular || probing || it->path().extension() == ".dat")
        continue;
      files.push_back(it->path().string());
    }
    if (ec) data_fail(path, "cannot list the directory: " + ec.message());
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);  // whatever it is: opening it says what is wrong with it
  }
  return files;
}

std::pair<std::string, std::string> fashion_mnist_files(const std::string& directory, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  auto find = [&](const std::string& stem) {
    for (const char* suffix : {".gz", ""}) {
      const fs::path p = fs::path(directory) / (stem + suffix);
      std::error_code ec;
      if (fs::exists(p, ec)) return p.string();
      if (ec) data_fail(p.string(), "cannot be inspected: " + ec.message());
    }
    data_fail((fs::path(directory) / (stem + ".gz")).string(),
              "no such file (install Debian's dataset-fashion-mnist, or pass the directory holding the IDX files)");
  };
  std::string images = find(prefix + "-images-idx3-ubyte");  // images first: errors name them first
  return {std::move(images), find(prefix + "-labels-idx1-ubyte")};
}

void check_counts(const std::string& images_path, std::uint32_t images, const std::string& labels_path,
                  std::uint32_t labels) {
  if (images != labels) {
    data_fail(images_path,
              std::to_string(images) + " images but " + std::to_string(labels) + " labels in " + labels_path);
  }
}

}  // namespace

namespace {
ImageDataset load_idx_files(const std::string& images_path, const std::string& labels_path, std::int64_t limit) {
  // The header first, then only as many bytes as the items used need: with a limit, `limit`
  // items; without, the header's count and one byte more, which shows that the file holds more
  // than it says. Read whole first, a gzip bomb (1 MB inflating to 1 GiB past its header) took
  // 2.1 GB before its size was refused.
  auto read = [&](const std::string& path, int dims) {
    const std::uint64_t header = 4 + 4 * static_cast<std::uint64_t>(dims);
    auto head = read_maybe_gzip(path, header);
    const auto extents = header_dims(head, path, dims);  // checked: the products below do not overflow
    std::uint64_t item = 1;
    for (int i = 1; i < dims; ++i) item *= extents[static_cast<std::size_t>(i)];
    const std::uint64_t items =
        limit > 0 ? std::min<std::uint64_t>(extents[0], static_cast<std::uint64_t>(limit)) : extents[0];
    const std::uint64_t want = header + items * item;
    if (want > safetensors::detail::memory_ceiling_bytes()) {
      fail<OutOfMemoryError>("load_idx", path, ": its header's ", items, " items of ", item, " bytes need ",
                             memory::format_bytes(static_cast<std::int64_t>(want)),
                             ", more than this machine's memory and swap");
    }
    return read_maybe_gzip(path, limit > 0 ? want : want + 1);
  };
  const auto images = read(images_path, 3);
  const auto labels = read(labels_path, 1);
  const auto idims = idx_dims(images, images_path, 3, limit);
  const auto ldims = idx_dims(labels, labels_path, 1, limit);
  // The files' own counts, not the limited ones: a limit hid 10 images against 12 labels (and a
  // limit of 11 named 11 labels, not the file's 12).
  check_counts(images_path, header_dims(images, images_path, 3)[0], labels_path,
               header_dims(labels, labels_path, 1)[0]);
  ImageDataset d;
  d.rows = idims[1];
  d.cols = idims[2];
  const std::int64_t n = idims[0];
  d.images = pixels_to_f32(images.data() + 16, {n, d.rows * d.cols});
  d.labels = labels_to_i64(std::vector<std::uint8_t>(labels.begin() + 8, labels.end()), {n});
  return d;
}
}  // namespace

namespace {
// 0 (every sample) or a positive count: a negative one read every sample, silently.
void check_limit(const char* op, std::int64_t limit, const std::string& images_path) {
  if (limit < 0) {
    throw ArgumentError(std::string(op) + ": limit " + std::to_string(limit) + " for " + images_path +
                        " is negative (0 takes every sample, a positive count the first ones)");
  }
}
}  // namespace

ImageDataset load_idx(const std::string& images_path, const std::string& labels_path, std::int64_t limit) {
  check_limit("load_idx", limit, images_path);
  return load_idx_files(images_path, labels_path, limit);
}

ImageDataset load_fashion_mnist(const std::string& directory, bool train, std::int64_t limit) {
  const auto [images, labels] = fashion_mnist_files(directory, train);
  return load_idx(images, labels, limit);
}

namespace {
// The cache directory in the shared temporary directory: one of this user's own, checked where it
// is used (another user could otherwise make it first and plant copies in it).
fs::path temp_cache_dir() {
  std::error_code ec;
  const fs::path temp = fs::temp_directory_path(ec);
  return (ec ? fs::path("/tmp") : temp) / ("ruda-cache-" + std::to_string(::geteuid()));
}
}  // namespace

std::string default_cache_dir() {
  // Absolute paths only: the XDG spec ignores a relative XDG_CACHE_HOME, and a relative HOME
  // made the cache relative to the working directory.
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  if (xdg && *xdg == '/') return (fs::path(xdg) / "ruda").string();
  const char* home = std::getenv("HOME");
  if (home && *home == '/') return (fs::path(home) / ".cache" / "ruda").string();
  return temp_cache_dir().string();
}

namespace {
// uncompressed_file, writing at most max_bytes (an IDX file's header bounds its content).
std::string uncompressed_copy(const std::string& path, const std::string& cache_dir, std::uint64_t max_bytes) {
  if (!is_gzip(path)) return path;
  if (cache_dir.find('\0') != std::string::npos) data_fail(path, "the cache directory's name holds a NUL byte");
  const fs::path dir = cache_dir.empty() ? default_cache_dir() : cache_dir;
  const fs::path target = dir / cache_name(path);
  // Only a rename puts a file at `target`, so one found there is complete (and whatever else is
  // there, a FIFO say, is refused by name when it is opened).
  std::error_code error;
  const fs::file_status found = fs::symlink_status(target, error);
  if (!error && found.type() != fs::file_type::not_found) return target.string();
  if (error && found.type() != fs::file_type::not_found)
    data_fail(target.string(), "cannot be inspected: " + error.message());
  fs::create_directories(dir, error);  // (another process may make it at the same time: that is fine)
  std::error_code probing;
  if (!fs::is_directory(dir, probing))
    data_fail(dir.string(), "cannot create the cache directory: " + (error ? error : probing).message());
  struct stat st {};
  if (dir == temp_cache_dir() && (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid())) {
    data_fail(dir.string(),
              "the cache directory in the temporary directory is not this user's own directory "
              "(pass a cache directory, or set XDG_CACHE_HOME)");
  }
  // A copy the file system cannot hold is refused before it is written.
  const fs::space_info space = fs::space(dir, probing);
  if (max_bytes != ~std::uint64_t{0} && !probing && max_bytes > space.available) {
    data_fail(path, "its decompressed copy needs up to " + memory::format_bytes(static_cast<std::int64_t>(max_bytes)) +
                        ", more than the " + memory::format_bytes(static_cast<std::int64_t>(space.available)) +
                        " free in " + dir.string());
  }
  // An identical copy renamed over by a racing writer replaces nothing anyone reads, since readers
  // open the final name only once it is complete.
  decompress_to(path, target.string(), max_bytes);
  return target.string();
}
}  // namespace

std::string uncompressed_file(const std::string& path, const std::string& cache_dir) {
  return uncompressed_copy(path, cache_dir, ~std::uint64_t{0});
}

struct IdxImages::State {
  IdxFile images, labels;
  std::atomic<std::int64_t> bytes_read{0};
};

IdxImages::IdxImages(const std::string& images_path, const std::string& labels_path, std::int64_t limit,
                     const std::string& cache_dir)
    : state_(std::make_shared<State>()) {
  check_limit("IdxImages", limit, images_path);
  state_->images = open_idx(images_path, 3, limit, cache_dir);  // images first: errors name them first
  state_->labels = open_idx(labels_path, 1, limit, cache_dir);
  check_counts(images_path, state_->images.items_in_file, labels_path, state_->labels.items_in_file);
}

std::int64_t IdxImages::size() const noexcept { return state_->images.dims[0]; }
std::int64_t IdxImages::rows() const noexcept { return state_->images.dims[1]; }
std::int64_t IdxImages::cols() const noexcept { return state_->images.dims[2]; }
std::int64_t IdxImages::sample_bytes() const noexcept {
  return rows() * cols() * static_cast<std::int64_t>(sizeof(float)) + static_cast<std::int64_t>(sizeof(std::int64_t));
}
std::int64_t IdxImages::bytes_read() const noexcept { return state_->bytes_read.load(); }

IdxImages IdxImages::counting_apart() const {
  IdxImages out = *this;
  out.state_ = std::make_shared<State>();
  out.state_->images = state_->images;
  out.state_->labels = state_->labels;
  return out;
}

Tensor IdxImages::images(const Tensor& indices) const {
  const auto pixels =
      read_items(state_->images, index_values(indices, "IdxImages::images"), "IdxImages::images", state_->bytes_read);
  Shape shape = indices.shape();
  shape.push_back(rows() * cols());
  return pixels_to_f32(pixels.data(), shape);
}

Tensor IdxImages::labels(const Tensor& indices) const {
  const auto labels =
      read_items(state_->labels, index_values(indices, "IdxImages::labels"), "IdxImages::labels", state_->bytes_read);
  return labels_to_i64(labels, indices.shape());
}

Tensor IdxImages::images(std::int64_t first, std::int64_t last) const {
  const auto picks = index_range(first, last, size(), "IdxImages::images");
  return images(from_vector(picks, {last - first}));
}

Tensor IdxImages::labels(std::int64_t first, std::int64_t last) const {
  const auto picks = index_range(first, last, size(), "IdxImages::labels");
  return labels(from_vector(picks, {last - first}));
}

IdxImages open_fashion_mnist(const std::string& directory, bool train, std::int64_t limit,
                             const std::string& cache_dir) {
  const auto [images, labels] = fashion_mnist_files(directory, train);
  return IdxImages(images, labels, limit, cache_dir);
}

TextCorpus::TextCorpus(const std::string& path, const std::string& cache_dir) {
  for (auto& name : text_files(path)) {
    // (Opening it fails early on what is wrong with it. A gzip stream cannot be read from the
    // middle, and its compressed bytes are no text: it is read from its decompressed copy.)
    std::string read_from = uncompressed_file(name, cache_dir);
    const std::int64_t bytes = static_cast<std::int64_t>(ReadFile(read_from).size());
    files_.push_back({std::move(name), size_, bytes, std::move(read_from)});
    size_ += bytes;
  }
  if (size_ == 0) data_fail(path, "holds no text");
}

namespace {
// Bytes [pos, pos + len) of a corpus of `size`, compared without forming pos + len (it may overflow).
void check_corpus_range(std::int64_t pos, std::int64_t len, std::int64_t size) {
  if (pos < 0 || len < 0 || pos > size || len > size - pos) {
    std::int64_t end = 0;
    const std::string end_text = __builtin_add_overflow(pos, len, &end)
                                     ? std::to_string(pos) + " + " + std::to_string(len)
                                     : std::to_string(end);
    fail<IndexError>("TextCorpus::read", "bytes [", pos, ", ", end_text, ") outside the ", size, " of the corpus");
  }
}
}  // namespace

void TextCorpus::read(std::int64_t pos, std::int64_t len, std::uint8_t* out) const {
  check_corpus_range(pos, len, size_);
  // The last file starting at or before `pos` holds it (empty files there come before it).
  auto file =
      std::upper_bound(files_.begin(), files_.end(), pos, [](std::int64_t p, const File& f) { return p < f.offset; }) -
      1;
  for (; len > 0; ++file) {
    const std::int64_t n = std::min(len, file->offset + file->size - pos);
    if (n <= 0) continue;
    ReadFile(file->read_from)
        .read(static_cast<std::uint64_t>(pos - file->offset), static_cast<std::size_t>(n), out, file->path);
    out += n;
    pos += n;
    len -= n;
  }
}

std::vector<std::uint8_t> TextCorpus::read(std::int64_t pos, std::int64_t len) const {
  check_corpus_range(pos, len, size_);  // before the allocation the range sizes
  std::vector<std::uint8_t> out(static_cast<std::size_t>(len));
  read(pos, len, out.data());
  return out;
}

std::vector<std::uint8_t> load_text_bytes(const std::string& path) {
  const TextCorpus corpus(path);
  return corpus.read(0, corpus.size());
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
  if (dataset_size < 0)
    fail<ArgumentError>("BatchSampler", "the data set's size must not be negative, got ", dataset_size);
  if (global_batch > dataset_size) {
    fail<ArgumentError>("BatchSampler", "global batch ", global_batch, " exceeds the ", dataset_size, " samples");
  }
  batches_per_epoch_ = dataset_size / global_batch;
}

Tensor BatchSampler::indices(std::int64_t epoch, std::int64_t batch) {
  if (batch < 0 || batch >= batches_per_epoch_) {
    fail<IndexError>("BatchSampler", "batch ", batch, " of an epoch of ", batches_per_epoch_);
  }
  // A negative epoch is none (and -1, the "nothing cached" mark, read the order before it existed).
  if (epoch < 0) fail<IndexError>("BatchSampler", "epoch ", epoch, " is negative");
  if (epoch != cached_epoch_) {
    try {
      order_.resize(static_cast<std::size_t>(size_));
    } catch (const std::exception&) {  // bad_alloc, length_error: a dataset size no memory holds
      fail<OutOfMemoryError>("BatchSampler", "out of memory: the order of ", size_,
                             " samples (8 bytes each) cannot be allocated");
    }
    std::iota(order_.begin(), order_.end(), std::int64_t{0});
    if (shuffle_) {
      // Fisher-Yates with counter-based draws: the order depends on (seed, epoch) only.
      const std::uint64_t stream = seed_ ^ (0x9e3779b97f4a7c15ull * (static_cast<std::uint64_t>(epoch) + 1));
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
  if (!data.defined() || !indices.defined()) {
    fail<ArgumentError>("take_rows", "the ", data.defined() ? "indices" : "data", " tensor is undefined");
  }
  if (data.ndim() < 1) fail<ShapeError>("take_rows", "needs at least one dimension, got ", data.shape());
  Shape row_shape(data.shape().begin() + 1, data.shape().end());
  const std::int64_t row = shape_numel(row_shape);
  Shape out_shape = indices.shape();
  out_shape.insert(out_shape.end(), row_shape.begin(), row_shape.end());
  if (is_floating(data.dtype())) {
    // Float rows through embedding: its errors, named as this call's.
    try {
      return embedding(data.reshape({data.shape()[0], row}), indices).reshape(out_shape);
    } catch (const IndexError& e) {
      throw IndexError(std::string("take_rows: ") + e.what());
    } catch (const DTypeError& e) {
      throw DTypeError(std::string("take_rows: ") + e.what());
    }
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
  const Tensor rows_data = data.contiguous();  // rows of a strided view, in row-major order
  const auto* src = static_cast<const std::uint8_t*>(rows_data.data_ptr());
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
