// The on-disk format of sharded checkpoints: names, block checksums, the index parser and the
// rank files (see checkpoint_format.h).
#include "io/checkpoint_format.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <string_view>

#include <nlohmann/json.hpp>

#include "io/files.h"

// xxHash (Debian's libxxhash-dev), compiled in: no library to link or install beside ruda.
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace ruda::nn::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;

void fail(const std::string& where, const std::string& what) {
  throw IOError("checkpoint " + ruda::detail::shown_nul(where) + ": " + what);
}

std::uint64_t fingerprint(std::string_view text) {
  std::uint64_t h = 14695981039346656037ull;
  for (const char c : text) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

std::string step_name(std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::string rank_file(int rank, int world, bool alternate) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "rank-%05d-of-%05d%s.safetensors", rank, world, alternate ? ".b" : "");
  return buf;
}

bool is_rank_file_name(const std::string& name) {
  // rank-<digits>-of-<digits>[.b].safetensors
  auto digits = [&](std::size_t& at) {
    const std::size_t from = at;
    while (at < name.size() && name[at] >= '0' && name[at] <= '9') ++at;
    return at > from;
  };
  auto literal = [&](std::size_t& at, std::string_view text) {
    if (name.compare(at, text.size(), text) != 0) return false;
    at += text.size();
    return true;
  };
  std::size_t at = 0;
  if (!literal(at, "rank-") || !digits(at) || !literal(at, "-of-") || !digits(at)) return false;
  literal(at, ".b");
  return literal(at, ".safetensors") && at == name.size();
}

std::map<std::string, std::string> rank_file_metadata(int rank, int world, std::int64_t step,
                                                      const std::map<std::string, std::int64_t>& offsets) {
  return {{"format", kFormat},
          {"rank", std::to_string(rank)},
          {"world_size", std::to_string(world)},
          {"step", std::to_string(step)},
          {"offsets", json(offsets).dump()}};
}

// --- checksums ---

namespace {

std::size_t block_count(std::uint64_t bytes) {
  return static_cast<std::size_t>((bytes + kChecksumBlock - 1) / kChecksumBlock);
}

// Block `block` of a piece, `bytes` long at `data`, against its hash in `hashes`.
void check_block(const std::string& file, const std::string& tensor, const std::string& hashes, std::size_t block,
                 const void* data, std::size_t bytes) {
  std::uint64_t want = 0;
  const char* hex = hashes.data() + block * kHashDigits;
  std::from_chars(hex, hex + kHashDigits, want, 16);  // validated as hex by parse_index
  if (XXH3_64bits(data, bytes) != want) {
    const std::uint64_t first = block * kChecksumBlock;
    fail(file, "tensor '" + tensor + "' does not match its checksum in bytes [" + std::to_string(first) + ", " +
                   std::to_string(first + bytes) + ") of its piece: the file is damaged");
  }
}

}  // namespace

void append_block_hashes(std::string& out, const void* data, std::size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  for (std::size_t at = 0; at < bytes; at += kChecksumBlock) {
    char hex[kHashDigits + 1];
    const auto hash = XXH3_64bits(p + at, std::min(kChecksumBlock, bytes - at));
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(hash));
    out.append(hex, kHashDigits);
  }
}

// --- the index ---

namespace {

constexpr std::size_t kMaxIndexBytes = std::size_t{1} << 30;
constexpr std::size_t kMaxIndexDepth = 16;

// Typed access to index.json's values: a missing key or a value of the wrong kind or range is an
// IOError naming the file, where in it, and what it holds.
class IndexParser {
 public:
  explicit IndexParser(std::string path) : path_(std::move(path)) {}
  [[noreturn]] void fail(const std::string& what) const { ckpt::fail(path_, what); }

  const json& member(const json& object, const std::string& key, const std::string& where) const {
    if (!object.is_object()) fail(where + " is not an object");
    const auto it = object.find(key);
    if (it == object.end()) fail(where + " has no '" + key + "'");
    return *it;
  }
  // `v`, called `what` in messages, as an integer in [lo, hi] (a string or a fraction is refused).
  std::int64_t integer(const json& v, const std::string& what, std::int64_t lo, std::int64_t hi) const {
    const bool fits = v.is_number_integer() &&
                      !(v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX));
    if (!fits) fail(what + " must be an integer, not " + v.dump());
    const auto x = v.get<std::int64_t>();
    if (x < lo || x > hi) {
      fail(what + " is " + std::to_string(x) + ", outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
    return x;
  }
  std::int64_t integer(const json& object, const std::string& key, const std::string& where, std::int64_t lo,
                       std::int64_t hi) const {
    return integer(member(object, key, where), where + "'s '" + key + "'", lo, hi);
  }
  std::string string(const json& object, const std::string& key, const std::string& where) const {
    const json& v = member(object, key, where);
    if (!v.is_string()) fail(where + "'s '" + key + "' must be a string, not " + v.dump());
    return v.get<std::string>();
  }
  std::vector<std::string> strings(const json& v, const std::string& where) const {
    if (!v.is_array()) fail(where + " must be an array of strings, not " + v.dump());
    std::vector<std::string> out;
    for (const json& s : v) {
      if (!s.is_string()) fail(where + " must be an array of strings; it holds " + s.dump());
      out.push_back(s.get<std::string>());
    }
    return out;
  }

  Index parse(const json& j, const std::string& dir) const;

 private:
  IndexParam parse_param(const std::string& name, const json& jp, const Index& index) const;
  std::vector<IndexGroup> parse_groups(const json& v) const;
  std::string path_;
};

Index IndexParser::parse(const json& j, const std::string& dir) const {
  Index index;
  index.dir = dir;
  index.path = path_;
  if (!j.is_object() || !j.contains("format") || j["format"] != kFormat) fail("is not a ruda checkpoint index");
  index.version = static_cast<int>(integer(j, "version", "index.json", 0, INT32_MAX));
  if (index.version < 1 || index.version > kVersion) {
    fail("has format version " + std::to_string(index.version) + ", this build reads 1 to " + std::to_string(kVersion));
  }
  // The index's own checksum, before anything it says is believed: an edit or a flipped bit that
  // keeps the JSON valid (a shape of the same size, a step count, a dropped parameter) was taken
  // at its word. Present: checked, whatever the version says (a flipped version digit); absent
  // from a version that writes it (a flipped key): refused. Versions 1 and 2 have none.
  if (j.contains(kIndexChecksumKey)) {
    const json& recorded = j[kIndexChecksumKey];
    const json expected = with_index_checksum(j)[kIndexChecksumKey];
    if (recorded != expected) {
      fail("does not match its checksum (" + recorded.dump() + ", its content gives " + expected.dump() +
           "): index.json was edited or damaged");
    }
  } else if (index.version >= 3) {
    fail(std::string("lacks its checksum '") + kIndexChecksumKey + "' (format version " +
         std::to_string(index.version) + " records one): index.json was edited or damaged");
  }
  index.step = integer(j, "step", "index.json", 0, kMaxStep);
  index.world_size = static_cast<int>(integer(j, "world_size", "index.json", 1, kMaxWorldSize));
  index.files = strings(member(j, "files", "index.json"), "index.json's 'files'");
  if (static_cast<std::int64_t>(index.files.size()) != index.world_size) {
    fail("lists " + std::to_string(index.files.size()) + " files for world size " + std::to_string(index.world_size));
  }
  std::set<std::string> seen;
  for (const auto& f : index.files) {
    if (f.empty() || f == "." || f == ".." || f.find('/') != std::string::npos || !seen.insert(f).second)
      fail("names file '" + f + "' (file names must be plain, distinct names in the step directory)");
  }
  if (j.contains("optimizer")) {
    const json& o = j["optimizer"];
    index.has_optimizer = true;
    index.optimizer_steps = integer(o, "steps", "index.json's 'optimizer'", 0, INT64_MAX - 1);  // as set_steps
    const json& lr = member(o, "lr", "index.json's 'optimizer'");
    // The optimizer's own range: a rate it would refuse is the index's fault, not the caller's.
    if (!lr.is_number() || !std::isfinite(lr.get<double>()) || lr.get<double>() < 0)
      fail("index.json's optimizer 'lr' must be a finite number >= 0, not " + lr.dump());
    index.lr = lr.get<double>();
    index.optimizer_state = strings(member(o, "state", "index.json's 'optimizer'"), "index.json's optimizer 'state'");
    if (std::set<std::string>(index.optimizer_state.begin(), index.optimizer_state.end()).size() !=
        index.optimizer_state.size())
      fail("index.json's optimizer 'state' names a state twice");
    if (o.contains("kind")) {
      index.optimizer_kind = string(o, "kind", "index.json's 'optimizer'");
      if (index.optimizer_kind->empty()) fail("index.json's optimizer 'kind' is empty");
    }
    if (o.contains("groups")) index.optimizer_groups = parse_groups(o["groups"]);
    if (o.contains("settings")) {
      const json& settings = o["settings"];
      if (!settings.is_object()) fail("index.json's optimizer 'settings' must be an object, not " + settings.dump());
      for (auto it = settings.begin(); it != settings.end(); ++it) {
        if (!it.value().is_number() || !std::isfinite(it.value().get<double>()))
          fail("index.json's optimizer setting '" + it.key() + "' must be a finite number, not " + it.value().dump());
        index.optimizer_settings[it.key()] = it.value().get<double>();
      }
    }
  }
  if (j.contains("streams")) {
    const json& s = j["streams"];
    if (!s.is_object()) fail("index.json's 'streams' must be an object");
    for (auto it = s.begin(); it != s.end(); ++it) {
      const std::string where = "index.json's stream '" + it.key() + "'";
      // Full 64-bit words (a seed is a hash).
      auto word = [&](const char* key) {
        const json& v = member(it.value(), key, where);
        if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<std::int64_t>() >= 0))
          fail(where + "'s '" + key + "' must be a non-negative integer, not " + v.dump());
        return v.get<std::uint64_t>();
      };
      index.streams[it.key()] = {word("seed"), word("offset")};
    }
  }
  if (j.contains("extra")) {
    const json& e = j["extra"];
    if (!e.is_object()) fail("index.json's 'extra' must be an object of strings");
    for (auto it = e.begin(); it != e.end(); ++it) {
      if (!it.value().is_string())
        fail("index.json's extra '" + it.key() + "' must be a string, not " + it.value().dump());
      index.extra[it.key()] = it.value().get<std::string>();
    }
  }
  const json& params = member(j, "params", "index.json");
  if (!params.is_object()) fail("index.json's 'params' must be an object");
  for (auto it = params.begin(); it != params.end(); ++it)
    index.params.push_back(parse_param(it.key(), it.value(), index));
  if (index.optimizer_groups) {
    // Every parameter of the groups is one of the index's, and in one group only.
    std::set<std::string> known, grouped, not_optimized;
    for (const auto& p : index.params) {
      known.insert(p.name);
      if (!p.optimized) not_optimized.insert(p.name);
    }
    for (const IndexGroup& g : *index.optimizer_groups) {
      for (const auto& name : g.params) {
        if (!known.count(name)) fail("index.json's optimizer group '" + g.name + "' names no parameter '" + name + "'");
        if (not_optimized.count(name)) {
          fail("index.json's optimizer group '" + g.name + "' names parameter '" + name +
               "', which the index marks as not optimized");
        }
        if (!grouped.insert(name).second) fail("index.json's optimizer groups list parameter '" + name + "' twice");
      }
    }
  }
  return index;
}

std::vector<IndexGroup> IndexParser::parse_groups(const json& v) const {
  const std::string where = "index.json's optimizer 'groups'";
  if (!v.is_array()) fail(where + " must be an array, not " + v.dump());
  std::vector<IndexGroup> groups;
  std::set<std::string> names;
  for (const json& jg : v) {
    IndexGroup g;
    g.name = string(jg, "name", where + " entry");
    if (g.name.empty() || !names.insert(g.name).second) fail(where + " has an empty or repeated name '" + g.name + "'");
    const std::string of = "optimizer group '" + g.name + "'";
    auto non_negative = [&](const json& x, const char* what) {
      if (!x.is_number() || !std::isfinite(x.get<double>()) || x.get<double>() < 0)
        fail(of + "'s '" + what + "' must be a finite number >= 0, not " + x.dump());
      return x.get<double>();
    };
    g.lr_scale = non_negative(member(jg, "lr_scale", of), "lr_scale");
    const json& decay = member(jg, "weight_decay", of);
    if (!decay.is_null()) g.weight_decay = non_negative(decay, "weight_decay");
    g.params = strings(member(jg, "params", of), of + "'s 'params'");
    groups.push_back(std::move(g));
  }
  return groups;
}

IndexParam IndexParser::parse_param(const std::string& name, const json& jp, const Index& index) const {
  const std::string where = "parameter '" + name + "'";
  IndexParam p;
  p.name = name;
  const json& shape = member(jp, "shape", where);
  if (!shape.is_array()) fail(where + "'s 'shape' must be an array, not " + shape.dump());
  // No tensor has more axes: such an index passed list and verify, and consolidate failed on it
  // naming its output file.
  if (shape.size() > static_cast<std::size_t>(kMaxDims))
    fail(where + "'s shape has " + std::to_string(shape.size()) + " axes; tensors have at most " +
         std::to_string(kMaxDims));
  for (std::size_t d = 0; d < shape.size(); ++d) {
    p.shape.push_back(integer(shape[d], where + "'s extent " + std::to_string(d), 0, INT64_MAX));
  }
  try {
    p.numel = shape_numel(p.shape, "checkpoint");
  } catch (const ShapeError&) {
    fail(where + " has the invalid shape " + to_string(p.shape));
  }
  if (jp.contains("numel") && integer(jp, "numel", where, 0, INT64_MAX) != p.numel)
    fail(where + "'s 'numel' disagrees with its shape " + to_string(p.shape));
  const std::string dtype = string(jp, "dtype", where);
  try {
    p.dtype = parse_dtype(dtype);
  } catch (const ArgumentError&) {
    fail(where + " has the unknown dtype '" + dtype + "'");
  }
  if (jp.contains("id")) {
    if (!jp["id"].is_number_unsigned()) fail(where + "'s 'id' must be a non-negative integer, not " + jp["id"].dump());
    p.id = jp["id"].get<std::uint64_t>();
  }
  if (jp.contains("sharded")) {
    if (!jp["sharded"].is_boolean()) fail(where + "'s 'sharded' must be true or false, not " + jp["sharded"].dump());
    p.sharded = jp["sharded"].get<bool>();
  }
  if (jp.contains("optimized")) {
    if (!index.has_optimizer) fail(where + " has an 'optimized' flag but the index holds no optimizer state");
    if (!jp["optimized"].is_boolean())
      fail(where + "'s 'optimized' must be true or false, not " + jp["optimized"].dump());
    p.optimized = jp["optimized"].get<bool>();
    if (!p.optimized && (jp.contains("state_dtypes") || jp.contains("steps")))
      fail(where + " is not optimized but records optimizer state dtypes or a step count");
  }
  if (jp.contains("state_dtypes")) {
    // One dtype for each optimizer state the index names, and none other.
    const json& dtypes = jp["state_dtypes"];
    if (!dtypes.is_object() || dtypes.size() != index.optimizer_state.size())
      fail(where + "'s 'state_dtypes' must give the dtype of each optimizer state, not " + dtypes.dump());
    for (const auto& state : index.optimizer_state) {
      const std::string d = string(dtypes, state, where + "'s 'state_dtypes'");
      try {
        p.state_dtypes[state] = parse_dtype(d);
      } catch (const ArgumentError&) {
        fail(where + "'s optimizer state '" + state + "' has the unknown dtype '" + d + "'");
      }
    }
  }
  if (jp.contains("steps")) {
    if (!index.has_optimizer) fail(where + " has a 'steps' count but the index holds no optimizer state");
    p.steps = integer(jp, "steps", where, 0, index.optimizer_steps);
  }
  if (index.has_optimizer && p.optimized && index.version >= 5 && !jp.contains("state_dtypes")) {
    // Version 5 on, an optimized parameter without state dtypes has no state: one that took no
    // step. With a count above 0 a resume would take its moments as zeros after that many steps.
    p.stateless = true;
    if (const std::int64_t own = p.steps.value_or(index.optimizer_steps); own != 0)
      fail(where + " has no optimizer state ('state_dtypes') but has taken " + std::to_string(own) + " steps");
  }
  const json& pieces = member(jp, "pieces", where);
  if (!pieces.is_array()) fail(where + "'s 'pieces' must be an array");
  for (const json& jpiece : pieces) {
    const std::string at = where + "'s piece " + jpiece.dump().substr(0, 80);
    IndexPiece piece;
    piece.rank = static_cast<int>(integer(jpiece, "rank", at, 0, index.world_size - 1));
    piece.offset = integer(jpiece, "offset", at, 0, p.numel);
    piece.count = integer(jpiece, "count", at, 1, p.numel - piece.offset);
    if (index.has_checksums()) {
      const json& hashes = member(jpiece, "xxh3", at);
      for (const auto& tensor : index.tensors(p)) {
        const std::string h = string(hashes, tensor, at + "'s 'xxh3'");
        const bool hex =
            std::all_of(h.begin(), h.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
        if (h.empty() || h.size() % kHashDigits != 0 || !hex)
          fail(at + " has malformed checksums for '" + tensor + "'");
        piece.hashes[tensor] = h;
      }
    }
    p.pieces.push_back(std::move(piece));
  }
  std::sort(p.pieces.begin(), p.pieces.end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
  std::int64_t next = 0;
  for (const auto& piece : p.pieces) {
    if (piece.offset != next) {
      fail(where + "'s pieces " + (piece.offset < next ? "overlap" : "leave a gap") + " at element " +
           std::to_string(std::min(piece.offset, next)));
    }
    next = piece.offset + piece.count;
  }
  if (next != p.numel) fail(where + "'s pieces do not cover its " + std::to_string(p.numel) + " elements");
  return p;
}

}  // namespace

json with_index_checksum(json index) {
  index.erase(kIndexChecksumKey);
  // The compact dump of nlohmann's ordered-by-key objects: one text for one content, however the
  // file was indented. Its numbers print as they parse back (shortest round-trip form).
  const std::string text = index.dump();
  char hex[kHashDigits + 1];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(XXH3_64bits(text.data(), text.size())));
  index[kIndexChecksumKey] = hex;
  return index;
}

Index parse_index(const json& j, const std::string& path, const std::string& dir) {
  return IndexParser(path).parse(j, dir);
}

Index read_index(const std::string& dir) {
  const std::string path = (fs::path(dir) / "index.json").string();
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec))) fail(dir, "no index.json (not a checkpoint, or an incomplete one)");
  const std::string text = safetensors::read_text_file(path, kMaxIndexBytes);
  // An index nests 4 levels deep; 200000 brackets overflowed the stack of every reader.
  if (const auto refusal = safetensors::json_refusal(text, kMaxIndexDepth)) fail(path, *refusal);
  json j;
  std::string duplicate;
  try {
    j = safetensors::parse_distinct_keys(text, duplicate);
  } catch (const json::exception& e) {
    fail(path, "is not valid JSON: " + safetensors::printable_error(e));
  }
  if (!duplicate.empty()) fail(path, "names '" + duplicate + "' twice in one object");
  Index index = parse_index(j, path, dir);
  index.text_fingerprint = fingerprint(text);
  return index;
}

namespace {
// A rank file's recorded piece offsets: {"tensor": element offset, ...}.
std::map<std::string, std::int64_t> parse_offsets(const std::string& file, const std::string& text) {
  if (const auto refusal = safetensors::json_refusal(text, 4)) fail(file, "piece offsets: " + *refusal);
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  std::map<std::string, std::int64_t> out;
  bool ok = j.is_object();
  for (auto it = j.begin(); ok && it != j.end(); ++it) {
    ok = it->is_number_integer() && !(it->is_number_unsigned() && it->get<std::uint64_t>() > INT64_MAX) &&
         it->get<std::int64_t>() >= 0;
    if (ok) out[it.key()] = it->get<std::int64_t>();
  }
  if (!ok) fail(file, "has malformed piece offsets in its metadata: " + text.substr(0, 80));
  return out;
}
}  // namespace

RankFiles::RankFiles(const Index& index) : index_(index), readers_(index.files.size()), offsets_(index.files.size()) {}
RankFiles::~RankFiles() = default;

safetensors::Reader& RankFiles::open(int rank) {
  auto& slot = readers_.at(static_cast<std::size_t>(rank));
  if (!slot) {
    auto reader = std::make_unique<safetensors::Reader>(
        (fs::path(index_.dir) / index_.files[static_cast<std::size_t>(rank)]).string());
    check_identity(*reader, rank);
    const auto& m = reader->metadata();
    if (const auto recorded = m.find("offsets"); recorded != m.end()) {
      offsets_.at(static_cast<std::size_t>(rank)) = parse_offsets(reader->path(), recorded->second);
    } else if (index_.version >= 3) {
      // Every version-3 rank file records them: without, one flipped bit in the key's name made
      // the file pass for an older one and turned the check of its pieces' places off.
      fail(reader->path(), "lacks its recorded piece offsets ('offsets' metadata, which format version " +
                               std::to_string(index_.version) + " records): the file is damaged");
    }
    slot = std::move(reader);
  }
  return *slot;
}

const safetensors::TensorInfo& RankFiles::tensor(int rank, const std::string& name, std::int64_t count,
                                                 std::optional<DType> dtype, const IndexPiece& piece) {
  safetensors::Reader& file = open(rank);
  const auto& t = file.info(name);
  if (t.numel() != count || (dtype && t.dtype != *dtype)) {
    fail(file.path(), "tensor '" + name + "' is " + safetensors::format_dtype(t.dtype) + " " + to_string(t.shape) +
                          ", the index says " + (dtype ? std::string(dtype_name(*dtype)) + " " : "") + "[" +
                          std::to_string(count) + "]");
  }
  if (const auto& offsets = offsets_.at(static_cast<std::size_t>(rank))) {
    const auto recorded = offsets->find(name);
    if (recorded == offsets->end() || recorded->second != piece.offset) {
      fail(file.path(), "holds tensor '" + name + "' " +
                            (recorded == offsets->end() ? std::string("without a recorded offset")
                                                        : "from element " + std::to_string(recorded->second)) +
                            ", but the index places that piece at element " + std::to_string(piece.offset) +
                            ": an edited index, or one of another checkpoint");
    }
  }
  if (index_.has_checksums()) {
    const std::size_t blocks = block_count(t.end - t.begin);
    if (piece.hashes.at(name).size() != blocks * kHashDigits) {
      fail(index_.path, "has " + std::to_string(piece.hashes.at(name).size() / kHashDigits) +
                            " checksums for tensor '" + name + "' of " + file.path() + ", which has " +
                            std::to_string(blocks) + " blocks");
    }
  }
  return t;
}

std::uint64_t RankFiles::bytes_read() const {
  std::uint64_t total = 0;
  for (const auto& r : readers_) total += r ? r->bytes_read() : 0;
  return total;
}

void RankFiles::check_identity(const safetensors::Reader& file, int rank) const {
  const auto& m = file.metadata();
  auto get = [&](const char* key) {
    const auto it = m.find(key);
    return it == m.end() ? std::string("?") : it->second;
  };
  if (get("format") != kFormat) fail(file.path(), "is not a ruda checkpoint file");
  const bool with_step = index_.version >= 2;
  if (get("rank") != std::to_string(rank) || get("world_size") != std::to_string(index_.world_size) ||
      (with_step && get("step") != std::to_string(index_.step))) {
    fail(file.path(), "was written by rank " + get("rank") + " of " + get("world_size") +
                          (with_step ? " at step " + get("step") : "") + ", but the index expects rank " +
                          std::to_string(rank) + " of " + std::to_string(index_.world_size) +
                          (with_step ? " at step " + std::to_string(index_.step) : "") +
                          ": a file swapped with another or left from another checkpoint");
  }
}

void read_checked(const safetensors::Reader& file, const std::string& name, std::size_t elem, const std::string* hashes,
                  std::int64_t first, std::int64_t count, char* out) {
  if (!hashes) {
    file.read_range_into(name, first, count, out);
    return;
  }
  const auto& t = file.info(name);
  const std::uint64_t total = t.end - t.begin;
  const std::uint64_t lo = static_cast<std::uint64_t>(first) * elem, hi = lo + static_cast<std::uint64_t>(count) * elem;
  std::vector<char> scratch;
  for (std::uint64_t b = lo / kChecksumBlock * kChecksumBlock; b < hi; b += kChecksumBlock) {
    const std::uint64_t e = std::min<std::uint64_t>(b + kChecksumBlock, total);
    const bool inside = b >= lo && e <= hi;
    if (!inside) scratch.resize(kChecksumBlock);
    char* block = inside ? out + (b - lo) : scratch.data();
    file.read_range_into(name, static_cast<std::int64_t>(b / elem), static_cast<std::int64_t>((e - b) / elem), block);
    check_block(file.path(), name, *hashes, static_cast<std::size_t>(b / kChecksumBlock), block,
                static_cast<std::size_t>(e - b));
    if (!inside) {
      const std::uint64_t from = std::max(b, lo), to = std::min(e, hi);
      std::memcpy(out + (from - lo), block + (from - b), static_cast<std::size_t>(to - from));
    }
  }
}

void stream_checked(const safetensors::Reader& file, const std::string& name, std::int64_t count,
                    const std::string* hashes, const std::function<void(const char*, std::size_t)>& consume) {
  std::uint64_t at = 0;  // chunks start at multiples of kChunkBytes, so on block boundaries
  file.read_range_chunked(name, 0, count, [&](const char* data, std::size_t bytes) {
    if (hashes) {
      for (std::size_t b = 0; b < bytes; b += kChecksumBlock) {
        check_block(file.path(), name, *hashes, static_cast<std::size_t>((at + b) / kChecksumBlock), data + b,
                    std::min(kChecksumBlock, bytes - b));
      }
    }
    at += bytes;
    consume(data, bytes);
  });
}

}  // namespace ruda::nn::ckpt
