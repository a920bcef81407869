// safetensors reading (bounds-checked, partial) and atomic writing.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ruda/nn/safetensors.h>
#include <nlohmann/json.hpp>

#include "io/files.h"

namespace ruda::safetensors {

namespace {

constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;  // the reference implementation's MAX_HEADER_SIZE
constexpr int kMaxJsonDepth = 16;

// Errors of this file's operations read "safetensors: <path>: <what>".
constexpr const char* kSafetensors = "safetensors: ";

template <class E = IOError>
[[noreturn]] void io_fail(const std::string& path, const std::string& what) {
  throw E(kSafetensors + path + ": " + what);
}
std::string os_error() { return std::strerror(errno); }

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

// What a JSON text's tree would take, counted by nlohmann's SAX parser: its nesting, and bytes at
// about what nlohmann's tree spends (a 16-byte value, doubled for a growing array's copies; a map
// node and its key per object member; a string's own bytes). Measured: 120 MB of "[0,0,...]" peaked
// at 2.6 GB (43 bytes a value).
struct JsonCost {
  std::size_t max_depth;
  std::size_t depth = 0;
  bool too_deep = false;
  std::uint64_t bytes = 0;

  bool value() {
    bytes += 48;
    return true;
  }
  bool null() { return value(); }
  bool boolean(bool) { return value(); }
  bool number_integer(std::int64_t) { return value(); }
  bool number_unsigned(std::uint64_t) { return value(); }
  bool number_float(double, const std::string&) { return value(); }
  bool string(std::string& s) {
    bytes += 32 + s.size();
    return value();
  }
  bool binary(std::vector<std::uint8_t>& b) {
    bytes += 32 + b.size();
    return value();
  }
  bool open() {
    value();
    if (++depth <= max_depth) return true;
    too_deep = true;
    return false;  // stops the pass
  }
  bool start_object(std::size_t) { return open(); }
  bool start_array(std::size_t) { return open(); }
  bool end_object() {
    --depth;
    return true;
  }
  bool end_array() { return end_object(); }
  bool key(std::string& k) {
    bytes += 64 + k.size();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) {
    return false;  // the tree's own parse reports it
  }
};

}  // namespace

std::optional<std::string> json_refusal(const std::string& text, std::size_t max_depth) {
  JsonCost cost{max_depth};
  (void)nlohmann::json::sax_parse(text, &cost, nlohmann::json::input_format_t::json, /*strict=*/false);
  if (cost.too_deep) return "JSON nested too deeply (more than " + std::to_string(max_depth) + " levels)";
  const std::uint64_t room = detail::allocatable_bytes();
  if (cost.bytes > room) {
    return "holds JSON of " + std::to_string(text.size() >> 20) + " MB whose parse needs about " +
           std::to_string(cost.bytes >> 20) + " MB, more than this process can allocate (" +
           std::to_string(room >> 20) + " MB)";
  }
  return std::nullopt;
}

namespace {

// BOOL bytes other than 0 and 1 are no value of the dtype (the kernels would compare and cast them
// inconsistently): refused as they are read (IOError) or written (Writer: ArgumentError), naming
// the first one. `first` is the element of data[0].
template <class E = IOError>
void check_bools(const std::string& path, const std::string& tensor, const char* data, std::size_t bytes,
                 std::uint64_t first) {
  const auto* p = reinterpret_cast<const unsigned char*>(data);
  const auto* bad = std::find_if(p, p + bytes, [](unsigned char b) { return b > 1; });
  if (bad == p + bytes) return;
  char hex[8];
  std::snprintf(hex, sizeof hex, "0x%02x", *bad);
  io_fail<E>(path, "tensor '" + tensor + "' holds the byte " + hex + " at element " +
                       std::to_string(first + static_cast<std::uint64_t>(bad - p)) + ", not a BOOL (0 or 1)");
}

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
  fail<DTypeError>("safetensors::format_dtype", "not a valid dtype: ", static_cast<int>(dtype));
}

void parse_header(const std::string& header, std::uint64_t file_size, std::vector<TensorInfo>& tensors,
                  std::map<std::string, std::string>& metadata) {
  const std::string where = "header";
  // A NUL ends nlohmann's input early: what follows it would be ignored here and read by others.
  if (header.find('\0') != std::string::npos) io_fail(where, "contains a NUL byte");
  // The format's header begins with '{' (0x7B), as the reference reader checks: whitespace or a
  // byte-order mark before it is no safetensors file, though a JSON parser would skip it.
  if (header.empty() || header.front() != '{') io_fail(where, "does not begin with '{'");
  if (const auto refusal = json_refusal(header, kMaxJsonDepth)) io_fail(where, *refusal);
  nlohmann::json j;
  std::string duplicate;
  try {
    j = parse_distinct_keys(header, duplicate);
  } catch (const nlohmann::json::exception& e) {
    io_fail(where, "not valid JSON: " + printable_error(e));
  }
  if (!duplicate.empty()) io_fail(where, "names '" + duplicate + "' twice in one object");
  const std::uint64_t data_start = 8 + header.size();
  if (data_start > file_size) io_fail(where, "runs past the end of the file");
  const std::uint64_t data_size = file_size - data_start;
  tensors.clear();
  metadata.clear();
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      if (v.is_null()) continue;  // as the reference reads it: no metadata
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
    if (!shape.is_array()) io_fail(where, what + " has an invalid shape " + shape.dump());
    if (shape.size() > static_cast<std::size_t>(kMaxDims)) {  // valid safetensors, but no ruda tensor
      io_fail(where, what + " has " + std::to_string(shape.size()) + " dimensions " + shape.dump() +
                         ", more than a ruda tensor holds (" + std::to_string(kMaxDims) + ")");
    }
    // A zero extent anywhere makes the tensor empty, whatever the others are; the product of the
    // nonzero extents is refused as soon as it passes the data bytes (a tensor with elements) or
    // int64 (an empty one, whose strides are still products of its extents), so it cannot overflow.
    bool empty = false;
    for (const auto& d : shape) {
      if (!d.is_number_unsigned()) io_fail(where, what + " has an invalid extent " + d.dump());
      if (d.get<std::uint64_t>() == 0) empty = true;
    }
    const std::uint64_t limit =
        empty ? static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) : data_size;
    std::uint64_t product = 1;
    for (const auto& d : shape) {
      const std::uint64_t e = d.get<std::uint64_t>();
      if (e != 0) {
        if (product > limit / e)
          io_fail(where, what + (empty ? " has extents whose product overflows" : " has a shape larger than the file"));
        product *= e;
      }
      info.shape.push_back(static_cast<std::int64_t>(e));
    }
    const std::uint64_t numel = empty ? 0 : product;
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
  // The tensors' bytes must fill the data exactly, as the reference reader requires (it refuses
  // the file otherwise): bytes no tensor owns, between tensors or after the last, are a damaged
  // or appended-to file, which a checksum over the tensors' own bytes cannot notice.
  std::uint64_t at = data_start;
  for (const TensorInfo* t : by_offset) {
    if (t->begin != at) {
      io_fail(where, "leaves data bytes [" + std::to_string(at - data_start) + ", " +
                         std::to_string(t->begin - data_start) + ") unused, before tensor '" + t->name + "'");
    }
    at = t->end;
  }
  if (at != file_size) {
    io_fail(where, "leaves the last " + std::to_string(file_size - at) +
                       " bytes of the file unused (bytes after the last tensor's data)");
  }
}

Reader::Reader(const std::string& path) : path_(path) {
  // Only a regular file is read; a FIFO is refused, never waited on (open_regular_file).
  fd_ = open_regular_file(path, kSafetensors, &file_size_);
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
  read_elements("read", name, 0, t.numel(), out.data_ptr());
  return out;
}

std::pair<std::uint64_t, std::uint64_t> Reader::byte_range(const char* op, const std::string& name, std::int64_t first,
                                                           std::int64_t count) const {
  const TensorInfo& t = info(name);
  if (first < 0 || count < 0 || first > t.numel() || count > t.numel() - first) {
    // Not first + count: it may overflow.
    io_fail(path_, std::string(op) + " of " + std::to_string(count) + " elements from element " +
                       std::to_string(first) + " is outside tensor '" + name + "' of " + std::to_string(t.numel()) +
                       " elements");
  }
  const std::uint64_t size = dtype_size(t.dtype);
  return {t.begin + static_cast<std::uint64_t>(first) * size, static_cast<std::uint64_t>(count) * size};
}

void Reader::read_elements(const char* op, const std::string& name, std::int64_t first, std::int64_t count,
                           void* destination) const {
  const auto [offset, size] = byte_range(op, name, first, count);
  if (size == 0) return;
  read_bytes(offset, size, destination);
  if (info(name).dtype == DType::boolean) {
    check_bools(path_, name, static_cast<const char*>(destination), static_cast<std::size_t>(size),
                static_cast<std::uint64_t>(first));
  }
}

void Reader::read_range_into(const std::string& name, std::int64_t first, std::int64_t count, void* destination) const {
  read_elements("read_range_into", name, first, count, destination);
}

void Reader::read_range_chunked(const std::string& name, std::int64_t first, std::int64_t count,
                                const std::function<void(const char*, std::size_t)>& consume) const {
  if (!consume) fail<ArgumentError>("read_range_chunked", "tensor '", name, "': the consume function is empty");
  auto [offset, size] = byte_range("read_range_chunked", name, first, count);
  const bool bools = info(name).dtype == DType::boolean;
  const std::uint64_t begin = offset, elem = dtype_size(info(name).dtype);
  // One buffer of at most kChunkBytes, reused for every chunk: the only memory the range costs.
  std::vector<char> buffer(static_cast<std::size_t>(std::min<std::uint64_t>(size, kChunkBytes)));
  while (size > 0) {
    const std::size_t chunk = static_cast<std::size_t>(std::min<std::uint64_t>(size, buffer.size()));
    read_bytes(offset, chunk, buffer.data());
    if (bools)
      check_bools(path_, name, buffer.data(), chunk, static_cast<std::uint64_t>(first) + (offset - begin) / elem);
    consume(buffer.data(), chunk);
    offset += chunk;
    size -= chunk;
  }
}

Tensor Reader::read_range(const std::string& name, std::int64_t first, std::int64_t count) const {
  byte_range("read_range", name, first, count);  // before the allocation the range sizes
  Tensor out = empty({count}, info(name).dtype);
  read_elements("read_range", name, first, count, out.data_ptr());
  return out;
}

namespace {
// The keys of each object being read, through nlohmann's SAX interface: it reports the first key
// an object repeats. (A parse with a callback found them too, but nlohmann 3.11's callback parser
// scans its whole parent container at the end of every object: a 15 MB header of 200000 small
// tensors took minutes, an index with 240000 empty objects appended 12 s.)
class DuplicateKeys : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit DuplicateKeys(std::string& duplicate) : duplicate_(duplicate) {}
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    keys_.emplace_back();
    return true;
  }
  bool key(string_t& key) override {
    if (!keys_.empty() && !keys_.back().insert(key).second && duplicate_.empty()) duplicate_ = key;
    return true;
  }
  bool end_object() override {
    if (!keys_.empty()) keys_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  // Stops here: the parse that follows reports the error.
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }

 private:
  std::string& duplicate_;
  std::vector<std::set<std::string>> keys_;
};
}  // namespace

std::string printable_error(const std::exception& e) {
  std::string out;
  for (const char c : std::string_view(e.what())) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7F) {
      out += c;
    } else {
      constexpr char kHex[] = "0123456789abcdef";
      out += {'\\', 'x', kHex[byte >> 4], kHex[byte & 15]};
    }
  }
  return out;
}

// The library keeps the last of a repeated key; a reader that keeps the first would see another
// file, so a repeated key is reported instead of resolved. Two passes, each linear in the text:
// the keys (SAX), then the tree.
nlohmann::json parse_distinct_keys(const std::string& text, std::string& duplicate) {
  DuplicateKeys keys(duplicate);
  nlohmann::json::sax_parse(text, &keys);
  return nlohmann::json::parse(text);
}

Writer::Writer(const std::string& path, const std::vector<TensorHeader>& tensors,
               const std::map<std::string, std::string>& metadata)
    : path_(path) {
  // Everything a reader would refuse is refused here, before any byte is written: a file this
  // Writer commits is one the Reader accepts.
  constexpr std::uint64_t kMaxBytes = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  nlohmann::json header = nlohmann::json::object();
  std::vector<std::uint64_t> sizes;  // bytes of each tensor, in the order given
  for (const auto& t : tensors) {
    const std::string what = "tensor '" + t.name + "'";
    // The caller's mistakes, as an invalid dtype or shape below is.
    if (t.name == "__metadata__") io_fail<ArgumentError>(path, "'__metadata__' is reserved (not a tensor name)");
    if (header.contains(t.name)) io_fail<ArgumentError>(path, "tensor name '" + t.name + "' repeats");
    if (!is_valid(t.dtype)) {
      io_fail<DTypeError>(
          path, what + " has the invalid dtype " + std::to_string(static_cast<int>(t.dtype)) + " (not a DType)");
    }
    if (t.shape.size() > static_cast<std::size_t>(kMaxDims)) {
      io_fail<ShapeError>(
          path, what + " has " + std::to_string(t.shape.size()) + " dimensions, more than " + std::to_string(kMaxDims));
    }
    // As the reader counts: no negative extent, a product of the nonzero extents within int64, and
    // a byte count that does not overflow the file's offsets (it would wrap to a wrong header).
    bool empty = false;
    std::uint64_t product = 1;
    for (const std::int64_t e : t.shape) {
      if (e < 0) io_fail<ShapeError>(path, what + " has a negative extent in its shape " + to_string(t.shape));
      if (e == 0) {
        empty = true;
        continue;
      }
      if (product > kMaxBytes / static_cast<std::uint64_t>(e))
        io_fail<ShapeError>(path, what + " has the shape " + to_string(t.shape) + ", whose size overflows");
      product *= static_cast<std::uint64_t>(e);
    }
    const std::uint64_t numel = empty ? 0 : product, size = dtype_size(t.dtype);
    if (numel > (kMaxBytes - data_bytes_) / size) {
      io_fail<ShapeError>(path, what + " (" + format_dtype(t.dtype) + " " + to_string(t.shape) +
                                    ") takes more bytes than a file can hold after the tensors before it");
    }
    const std::uint64_t bytes = numel * size;
    header[t.name] = {{"dtype", format_dtype(t.dtype)}, {"shape", t.shape}};
    sizes.push_back(bytes);
    data_bytes_ += bytes;
  }
  // Placed by element size, largest first (the order given among equal sizes), as the reference
  // writer places them: with the data 8-byte aligned, every tensor then starts on a multiple of
  // its element size, which zero-copy readers need (torch.frombuffer refuses an f32 view at an odd
  // offset). In the order given, an odd-length bf16 or bool tensor first left the rest unaligned.
  // The data still comes in the order given (write()): each tensor's bytes go to its place.
  std::vector<std::size_t> order(tensors.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return dtype_size(tensors[a].dtype) > dtype_size(tensors[b].dtype);
  });
  places_.resize(tensors.size());
  std::uint64_t at = 0;
  for (const std::size_t i : order) {
    places_[i] = {at, sizes[i], tensors[i].name, tensors[i].dtype == DType::boolean};
    header[tensors[i].name]["data_offsets"] = {at, at + sizes[i]};
    at += sizes[i];
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {  // a name or metadata string that is not UTF-8
    io_fail<ArgumentError>(path, std::string("the header cannot be written as JSON: ") + e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  if (text.size() > kMaxHeaderBytes) {
    io_fail<ArgumentError>(path, "the header takes " + std::to_string(text.size()) + " bytes, more than the " +
                                     std::to_string(kMaxHeaderBytes) + " readers accept");
  }
  if (data_bytes_ > kMaxBytes - 8 - text.size())
    io_fail<ShapeError>(path, "the tensors take more bytes than a file can hold");
  unsigned char len_bytes[8];
  for (int i = 0; i < 8; ++i)
    len_bytes[i] = static_cast<unsigned char>(static_cast<std::uint64_t>(text.size()) >> (8 * i));
  file_ = std::make_unique<detail::AtomicFile>(path, kSafetensors);
  file_->write(len_bytes, 8);
  file_->write(text.data(), text.size());
  data_start_ = position_ = 8 + text.size();
}

Writer::~Writer() = default;

void Writer::write(const void* data, std::size_t size) {
  if (committed_) io_fail<ArgumentError>(path_, "written after its commit");
  // The header fixed every offset: more bytes than it promised would shift no tensor but
  // leave a file other readers reject, so refuse them here.
  if (size > data_bytes_ - written_) {
    io_fail(path_, "write of " + std::to_string(size) + " bytes past the " + std::to_string(data_bytes_) +
                       " data bytes of the header");
  }
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    while (within_ == places_[current_].bytes) {  // the current tensor is complete (or empty)
      ++current_;
      within_ = 0;
    }
    const Place& place = places_[current_];
    const std::uint64_t n = std::min<std::uint64_t>(size, place.bytes - within_);
    // A BOOL byte other than 0 or 1 made a file its readers refuse (this Reader included).
    if (place.boolean) check_bools<ArgumentError>(path_, place.name, p, static_cast<std::size_t>(n), within_);
    const std::uint64_t target = data_start_ + place.offset + within_;
    if (target != position_) file_->seek(target);  // only where placement reordered the tensors
    file_->write(p, static_cast<std::size_t>(n));
    position_ = target + n;
    within_ += n;
    written_ += n;
    p += n;
    size -= static_cast<std::size_t>(n);
  }
}

void Writer::commit() {
  if (committed_) io_fail<ArgumentError>(path_, "committed twice");
  if (written_ != data_bytes_) {
    io_fail(path_, "only " + std::to_string(written_) + " of the header's " + std::to_string(data_bytes_) +
                       " data bytes were written");
  }
  file_->commit();
  committed_ = true;
}

void Reader::copy_range(const std::string& name, std::int64_t first, std::int64_t count, Writer& out) const {
  read_range_chunked(name, first, count, [&](const char* data, std::size_t size) { out.write(data, size); });
}

void write(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
           const std::map<std::string, std::string>& metadata) {
  std::vector<TensorHeader> header;
  for (const auto& [name, t] : tensors) {
    if (!t.defined())
      fail<ArgumentError>("safetensors::write", ruda::detail::shown_nul(path), ": tensor '", name, "' is undefined");
    header.push_back({name, t.dtype(), t.shape()});
  }
  Writer file(path, header, metadata);
  for (const auto& [name, t] : tensors) {
    // The file holds row-major values: a strided view is written from a contiguous copy.
    if (t.numel()) file.write(t.is_contiguous() ? t.data_ptr() : t.detach().contiguous().data_ptr(), t.nbytes());
  }
  file.commit();
}

}  // namespace ruda::safetensors
