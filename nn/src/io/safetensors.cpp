// safetensors reading (bounds-checked, partial) and atomic writing.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <vector>

#include <ruda/nn/safetensors.h>
#include <nlohmann/json.hpp>

#include "io/files.h"

namespace ruda::safetensors {

namespace {

constexpr std::uint64_t kMaxHeaderBytes = 100u << 20;  // as the reference implementation
constexpr int kMaxJsonDepth = 16;

[[noreturn]] void io_fail(const std::string& path, const std::string& what) {
  throw IOError("safetensors: " + path + ": " + what);
}
std::string os_error() { return std::strerror(errno); }

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "directory";
  if (S_ISFIFO(mode)) return "FIFO";
  if (S_ISSOCK(mode)) return "socket";
  if (S_ISCHR(mode)) return "character device";
  if (S_ISBLK(mode)) return "block device";
  return "special file";
}

bool dtype_from_format(const std::string& name, DType& out) {
  static const std::pair<const char*, DType> names[] = {{"F32", DType::f32}, {"F64", DType::f64},
                                                        {"F16", DType::f16}, {"BF16", DType::bf16},
                                                        {"I64", DType::i64}, {"BOOL", DType::boolean}};
  for (const auto& [n, d] : names) {
    if (name == n) {
      out = d;
      return true;
    }
  }
  return false;
}

// Rejects JSON nested deeper than kMaxJsonDepth before a recursive parser sees it.
bool nesting_within_limit(const std::string& text) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > kMaxJsonDepth) return false;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return true;
}

std::atomic<std::int64_t> g_bytes_written{0};

}  // namespace

const char* format_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "F32";
    case DType::f64:
      return "F64";
    case DType::f16:
      return "F16";
    case DType::bf16:
      return "BF16";
    case DType::i64:
      return "I64";
    case DType::boolean:
      return "BOOL";
  }
  return "?";
}

void parse_header(const std::string& header, std::uint64_t file_size, std::vector<TensorInfo>& tensors,
                  std::map<std::string, std::string>& metadata) {
  const std::string where = "header";
  if (!nesting_within_limit(header)) io_fail(where, "JSON nested too deeply");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const nlohmann::json::exception& e) {
    io_fail(where, std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object()) io_fail(where, "is not a JSON object");
  const std::uint64_t data_start = 8 + header.size();
  if (data_start > file_size) io_fail(where, "runs past the end of the file");
  const std::uint64_t data_size = file_size - data_start;
  tensors.clear();
  metadata.clear();
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) io_fail(where, "__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) io_fail(where, "__metadata__ value '" + m.key() + "' is not a string");
        metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string what = "tensor '" + name + "'";
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets")) {
      io_fail(where, what + " lacks dtype, shape or data_offsets");
    }
    TensorInfo info;
    info.name = name;
    const auto& dt = v["dtype"];
    if (!dt.is_string() || !dtype_from_format(dt.get<std::string>(), info.dtype)) {
      io_fail(where, what + " has an unsupported dtype " + dt.dump());
    }
    const auto& shape = v["shape"];
    if (!shape.is_array() || shape.size() > static_cast<std::size_t>(kMaxDims)) {
      io_fail(where, what + " has an invalid shape " + shape.dump());
    }
    // The element count, refused as soon as it exceeds the data bytes (so it cannot overflow).
    std::uint64_t numel = 1;
    bool empty = false;
    for (const auto& d : shape) {
      if (!d.is_number_unsigned()) io_fail(where, what + " has an invalid extent " + d.dump());
      const std::uint64_t e = d.get<std::uint64_t>();
      if (e > data_size && e != 0) io_fail(where, what + " has a shape larger than the file");
      info.shape.push_back(static_cast<std::int64_t>(e));
      if (e == 0) empty = true;
      if (!empty) {
        if (numel > data_size / e) io_fail(where, what + " has a shape larger than the file");
        numel *= e;
      }
    }
    if (empty) numel = 0;
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      io_fail(where, what + " has invalid data_offsets " + off.dump());
    }
    const std::uint64_t begin = off[0].get<std::uint64_t>(), end = off[1].get<std::uint64_t>();
    if (begin > end || end > data_size) {
      io_fail(where, what + " has data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                         ") outside the " + std::to_string(data_size) + " data bytes");
    }
    if (numel > (end - begin) / dtype_size(info.dtype) || numel * dtype_size(info.dtype) != end - begin) {
      io_fail(where, what + " has " + std::to_string(end - begin) + " bytes for a " + to_string(info.shape) + " " +
                         format_dtype(info.dtype) + " tensor");
    }
    info.begin = data_start + begin;
    info.end = data_start + end;
    tensors.push_back(std::move(info));
  }
  // Empty tensors own no bytes, so they cannot overlap anything, wherever their offsets point.
  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : tensors) {
    if (t.end > t.begin) by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  for (std::size_t i = 1; i < by_offset.size(); ++i) {
    if (by_offset[i]->begin < by_offset[i - 1]->end) {
      io_fail(where, "tensors '" + by_offset[i - 1]->name + "' and '" + by_offset[i]->name + "' overlap");
    }
  }
}

Reader::Reader(const std::string& path) : path_(path) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever. Only a
  // regular file is read (the flag changes nothing for one).
  fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd_ < 0) io_fail(path, "cannot open: " + os_error());
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    ::close(fd_);
    io_fail(path, "cannot stat: " + os_error());
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    io_fail(path, std::string("is not a regular file but a ") + file_kind(st.st_mode));
  }
  file_size_ = static_cast<std::uint64_t>(st.st_size);
  try {
    if (file_size_ < 8) io_fail(path, "truncated: " + std::to_string(file_size_) + " bytes, no header length");
    unsigned char len_bytes[8];
    read_bytes(0, 8, len_bytes);
    std::uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
    if (header_len > kMaxHeaderBytes)
      io_fail(path, "header length " + std::to_string(header_len) + " exceeds the limit");
    if (header_len > file_size_ - 8) {
      io_fail(path, "truncated: header of " + std::to_string(header_len) + " bytes in a file of " +
                        std::to_string(file_size_));
    }
    std::string header(header_len, '\0');
    read_bytes(8, header_len, header.data());
    try {
      parse_header(header, file_size_, tensors_, metadata_);
    } catch (const IOError& e) {
      io_fail(path, std::string(e.what()).substr(std::string("safetensors: ").size()));
    }
    for (std::size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

Reader::~Reader() {
  if (fd_ >= 0) ::close(fd_);
}

void Reader::read_bytes(std::uint64_t offset, std::uint64_t size, void* destination) const {
  if (offset > file_size_ || size > file_size_ - offset) io_fail(path_, "read beyond the end of the file");
  auto* out = static_cast<char*>(destination);
  while (size > 0) {
    const ssize_t n = ::pread(fd_, out, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      io_fail(path_, "read failed: " + os_error());
    }
    if (n == 0) io_fail(path_, "truncated while reading (the file shrank)");
    out += n;
    offset += static_cast<std::uint64_t>(n);
    size -= static_cast<std::uint64_t>(n);
    bytes_read_.fetch_add(static_cast<std::uint64_t>(n), std::memory_order_relaxed);
  }
}

bool Reader::contains(const std::string& name) const { return index_.count(name) != 0; }

const TensorInfo& Reader::info(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) io_fail(path_, "has no tensor '" + name + "'");
  return tensors_[it->second];
}

Tensor Reader::read(const std::string& name) const {
  const TensorInfo& t = info(name);
  Tensor out = empty(t.shape, t.dtype);
  if (t.end > t.begin) read_bytes(t.begin, t.end - t.begin, out.data_ptr());
  return out;
}

std::pair<std::uint64_t, std::uint64_t> Reader::byte_range(const std::string& name, std::int64_t first,
                                                           std::int64_t count) const {
  const TensorInfo& t = info(name);
  if (first < 0 || count < 0 || first > t.numel() || count > t.numel() - first) {
    io_fail(path_, "elements [" + std::to_string(first) + ", " + std::to_string(first + count) +
                       ") are outside tensor '" + name + "' of " + std::to_string(t.numel()));
  }
  const std::uint64_t size = dtype_size(t.dtype);
  return {t.begin + static_cast<std::uint64_t>(first) * size, static_cast<std::uint64_t>(count) * size};
}

void Reader::read_range_into(const std::string& name, std::int64_t first, std::int64_t count, void* destination) const {
  const auto [offset, size] = byte_range(name, first, count);
  if (size > 0) read_bytes(offset, size, destination);
}

void Reader::read_range_chunked(const std::string& name, std::int64_t first, std::int64_t count,
                                const std::function<void(const char*, std::size_t)>& consume) const {
  auto [offset, size] = byte_range(name, first, count);
  // One buffer of at most kChunkBytes, reused for every chunk: the only memory the range costs.
  std::vector<char> buffer(static_cast<std::size_t>(std::min<std::uint64_t>(size, kChunkBytes)));
  while (size > 0) {
    const std::size_t chunk = static_cast<std::size_t>(std::min<std::uint64_t>(size, buffer.size()));
    read_bytes(offset, chunk, buffer.data());
    consume(buffer.data(), chunk);
    offset += chunk;
    size -= chunk;
  }
}

Tensor Reader::read_range(const std::string& name, std::int64_t first, std::int64_t count) const {
  Tensor out = empty({count}, info(name).dtype);
  read_range_into(name, first, count, out.data_ptr());
  return out;
}

namespace testing {
std::int64_t crash_after_bytes() {
  static const std::int64_t limit = [] {
    const char* env = std::getenv("RUDA_TEST_CRASH_AFTER_BYTES");
    return env && *env ? std::atoll(env) : -1;
  }();
  return limit;
}
}  // namespace testing

namespace detail {

class AtomicFile {
 public:
  explicit AtomicFile(std::string path) : path_(std::move(path)), temp_(path_ + ".tmp") {
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) io_fail(path_, "cannot create " + temp_ + ": " + os_error());
  }
  ~AtomicFile() {
    if (fd_ >= 0) {  // not committed: leave no temporary behind
      ::close(fd_);
      ::unlink(temp_.c_str());
    }
  }
  void write(const void* data, std::size_t size) {
    const auto* p = static_cast<const char*>(data);
    const std::int64_t crash = testing::crash_after_bytes();
    while (size > 0) {
      std::size_t chunk = size;
      if (crash >= 0) {
        const std::int64_t left = crash - g_bytes_written.load();
        if (left <= 0) ::_exit(86);  // a simulated kill in the middle of a checkpoint
        chunk = std::min<std::size_t>(chunk, static_cast<std::size_t>(left));
      }
      const ssize_t n = ::write(fd_, p, chunk);
      if (n < 0) {
        if (errno == EINTR) continue;
        io_fail(path_, "write failed: " + os_error());
      }
      g_bytes_written += n;
      p += n;
      size -= static_cast<std::size_t>(n);
    }
  }
  void commit() {
    if (::fsync(fd_) != 0) io_fail(path_, "fsync failed: " + os_error());
    if (::close(fd_) != 0) {
      fd_ = -1;
      io_fail(path_, "close failed: " + os_error());
    }
    fd_ = -1;
    if (::rename(temp_.c_str(), path_.c_str()) != 0) io_fail(path_, "rename failed: " + os_error());
    // The rename itself is durable once the directory is.
    const std::string dir = std::filesystem::path(path_).parent_path().string();
    const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
  }

 private:
  std::string path_, temp_;
  int fd_ = -1;
};

}  // namespace detail

Writer::Writer(const std::string& path, const std::vector<TensorHeader>& tensors,
               const std::map<std::string, std::string>& metadata)
    : path_(path) {
  nlohmann::json header = nlohmann::json::object();
  for (const auto& t : tensors) {
    if (t.name == "__metadata__") io_fail(path, "'__metadata__' is reserved");
    if (header.contains(t.name)) io_fail(path, "tensor name '" + t.name + "' repeats");
    const std::uint64_t bytes = static_cast<std::uint64_t>(shape_numel(t.shape)) * dtype_size(t.dtype);
    header[t.name] = {
        {"dtype", format_dtype(t.dtype)}, {"shape", t.shape}, {"data_offsets", {data_bytes_, data_bytes_ + bytes}}};
    data_bytes_ += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  unsigned char len_bytes[8];
  for (int i = 0; i < 8; ++i)
    len_bytes[i] = static_cast<unsigned char>(static_cast<std::uint64_t>(text.size()) >> (8 * i));
  file_ = std::make_unique<detail::AtomicFile>(path);
  file_->write(len_bytes, 8);
  file_->write(text.data(), text.size());
}

Writer::~Writer() = default;

void Writer::write(const void* data, std::size_t size) {
  // The header fixed every offset: more bytes than it promised would shift no tensor but
  // leave a file other readers reject, so refuse them here.
  if (size > data_bytes_ - written_) {
    io_fail(path_, "write of " + std::to_string(size) + " bytes past the " + std::to_string(data_bytes_) +
                       " data bytes of the header");
  }
  file_->write(data, size);
  written_ += size;
}

void Writer::commit() {
  if (written_ != data_bytes_) {
    io_fail(path_, "only " + std::to_string(written_) + " of the header's " + std::to_string(data_bytes_) +
                       " data bytes were written");
  }
  file_->commit();
}

void Reader::copy_range(const std::string& name, std::int64_t first, std::int64_t count, Writer& out) const {
  read_range_chunked(name, first, count, [&](const char* data, std::size_t size) { out.write(data, size); });
}

void write(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
           const std::map<std::string, std::string>& metadata) {
  std::vector<TensorHeader> header;
  for (const auto& [name, t] : tensors) header.push_back({name, t.dtype(), t.shape()});
  Writer file(path, header, metadata);
  for (const auto& [name, t] : tensors) {
    // The file holds row-major values: a strided view is written from a contiguous copy.
    if (t.numel()) file.write(t.is_contiguous() ? t.data_ptr() : t.detach().contiguous().data_ptr(), t.nbytes());
  }
  file.commit();
}

void write_text_atomically(const std::string& path, const std::string& text) {
  detail::AtomicFile file(path);
  file.write(text.data(), text.size());
  file.commit();
}

std::string read_text_file(const std::string& path, std::size_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // see Reader: a FIFO never blocks
  if (fd < 0) io_fail(path, "cannot open: " + os_error());
  std::string text;
  try {
    struct stat st {};
    if (::fstat(fd, &st) != 0) io_fail(path, "cannot stat: " + os_error());
    if (!S_ISREG(st.st_mode)) io_fail(path, std::string("is not a regular file but a ") + file_kind(st.st_mode));
    if (static_cast<std::uint64_t>(st.st_size) > max_bytes) {
      io_fail(path, "is " + std::to_string(st.st_size) + " bytes, more than the " + std::to_string(max_bytes) +
                        " this file may have");
    }
    text.resize(static_cast<std::size_t>(st.st_size));
    std::size_t done = 0;
    while (done < text.size()) {
      const ssize_t n = ::read(fd, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) io_fail(path, "read failed: " + os_error());
      if (n == 0) break;  // shrank while reading
      done += static_cast<std::size_t>(n);
    }
    text.resize(done);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return text;
}

}  // namespace ruda::safetensors
