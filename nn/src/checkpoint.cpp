// Sharded checkpoints: each rank writes its slices, rank 0 the index; loading reshards by
// reading only the element ranges each rank needs.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <ruda/autograd.h>
#include <ruda/nn/checkpoint.h>
#include <ruda/nn/safetensors.h>
#include <ruda/nn/sharded.h>
#include <nlohmann/json.hpp>

namespace ruda::nn {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kFormat = "ruda-sharded-checkpoint";
constexpr int kVersion = 1;

[[noreturn]] void ckpt_fail(const std::string& where, const std::string& what) {
  throw IOError("checkpoint " + where + ": " + what);
}

std::string step_name(std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::string rank_file(int rank, int world) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "rank-%05d-of-%05d.safetensors", rank, world);
  return buf;
}

// The element range of a parameter this rank holds in a checkpoint: its slice without padding,
// or the whole tensor on rank 0 for a dense parameter.
struct Piece {
  std::int64_t offset = 0, count = 0;
};
Piece piece_of(const Param& p, int rank) {
  if (p.is_sharded()) return {p.shard()->offset(), p.shard()->real_elements()};
  return rank == 0 ? Piece{0, p.data().numel()} : Piece{0, 0};
}

// Elements [offset, offset + count) of a flattened tensor of `numel` elements that `rank` holds
// when cut in slices of `slice_size`: fully_shard's layout (the last slices short or empty).
Piece slice_of(std::int64_t numel, std::int64_t slice_size, int rank) {
  const std::int64_t offset = std::min<std::int64_t>(numel, static_cast<std::int64_t>(rank) * slice_size);
  return {offset, std::max<std::int64_t>(0, std::min<std::int64_t>(numel, offset + slice_size) - offset)};
}

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// Agrees a success flag across ranks: a failure anywhere fails everywhere (no rank left waiting).
bool all_ok(Communicator& comm, bool ok) {
  autograd::NoGradGuard guard;
  return comm.all_reduce(scalar(ok ? 0.0 : 1.0, DType::f64), Reduction::max, {.tag = "checkpoint status"}).item() ==
         0.0;
}

json read_index(const std::string& dir) {
  const std::string path = (fs::path(dir) / "index.json").string();
  std::ifstream in(path);
  if (!in) ckpt_fail(dir, "no index.json (not a checkpoint, or an incomplete one)");
  json index;
  try {
    index = json::parse(in);
  } catch (const json::exception& e) {
    ckpt_fail(path, std::string("index is not valid JSON: ") + e.what());
  }
  if (!index.is_object() || index.value("format", "") != kFormat) ckpt_fail(path, "is not a ruda checkpoint index");
  if (index.value("version", 0) != kVersion) {
    ckpt_fail(path, "has format version " + index.value("version", json(0)).dump() + ", this build reads " +
                        std::to_string(kVersion));
  }
  return index;
}

// A piece of a parameter: elements [offset, offset + count) of the flattened tensor in `rank`'s file.
struct IndexedPiece {
  int rank = 0;
  std::int64_t offset = 0, count = 0;
};

// The element count of a shape from an index, refused (IOError) when negative or overflowing.
std::int64_t index_numel(const std::string& dir, const std::string& name, const Shape& shape) {
  try {
    return shape_numel(shape, "checkpoint");
  } catch (const ShapeError&) {
    ckpt_fail(dir, "index.json gives parameter '" + name + "' the invalid shape " + to_string(shape));
  }
}

// A parameter's pieces as the index lists them, checked to tile [0, numel) exactly, each in a
// file of the checkpoint: nothing an index says can send a read or a write outside a tensor.
std::vector<IndexedPiece> checked_pieces(const std::string& dir, const std::string& name, const json& pieces,
                                         int world_size, std::int64_t numel) {
  std::vector<IndexedPiece> out;
  for (const json& piece : pieces) {
    IndexedPiece p{piece.at("rank").get<int>(), piece.at("offset").get<std::int64_t>(),
                   piece.at("count").get<std::int64_t>()};
    if (p.rank < 0 || p.rank >= world_size || p.offset < 0 || p.count <= 0 || p.offset > numel ||
        p.count > numel - p.offset) {
      ckpt_fail(dir, "index.json has a piece of '" + name + "' (rank " + std::to_string(p.rank) + ", elements [" +
                         std::to_string(p.offset) + ", +" + std::to_string(p.count) + ")) outside its " +
                         std::to_string(numel) + " elements or ranks");
    }
    out.push_back(p);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
  std::int64_t next = 0;
  for (const auto& p : out) {
    if (p.offset != next) {
      ckpt_fail(dir, "index.json's pieces of '" + name + "' " + (p.offset < next ? "overlap" : "leave a gap") +
                         " at element " + std::to_string(std::min(p.offset, next)));
    }
    next = p.offset + p.count;
  }
  if (next != numel)
    ckpt_fail(dir, "index.json's pieces of '" + name + "' do not cover its " + std::to_string(numel) + " elements");
  return out;
}

// Runs fn, reporting what a malformed index.json makes it throw (a missing key, a value of the
// wrong type, an unknown dtype) as the IOError every checkpoint problem is.
template <class F>
auto with_index_errors(const std::string& dir, F&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const json::exception& e) {
    ckpt_fail(dir, std::string("index.json is malformed: ") + e.what());
  } catch (const ArgumentError& e) {
    ckpt_fail(dir, std::string("index.json is malformed: ") + e.what());
  }
}

}  // namespace

namespace {
// The newest step directory of `dir` that has an index ("" when none): what a checkpoint
// directory holds when its `latest` pointer is missing or points at nothing (a kill between a
// step's index and its pointer leaves exactly that).
std::string newest_complete_step(const fs::path& dir) {
  std::error_code ec;
  std::string best;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (n.rfind("step-", 0) == 0 && fs::is_regular_file(it->path() / "index.json", ec) && n > best) best = n;
  }
  return best;
}

// `latest` is ruda's pointer file or absent; anything else (a directory, a FIFO, a symbolic link
// that loops or points elsewhere) is refused by name rather than followed.
void check_latest_pointer(const fs::path& dir) {
  std::error_code ec;
  const fs::path latest = dir / "latest";
  const fs::file_status status = fs::symlink_status(latest, ec);
  if (ec || status.type() == fs::file_type::not_found || status.type() == fs::file_type::regular) return;
  ckpt_fail(latest.string(), std::string("is a ") +
                                 (status.type() == fs::file_type::directory ? "directory"
                                  : status.type() == fs::file_type::symlink ? "symbolic link"
                                                                            : "special file") +
                                 ", not ruda's pointer file: remove it");
}
}  // namespace

std::string resolve_checkpoint(const std::string& path) {
  std::error_code ec;
  if (fs::is_regular_file(fs::path(path) / "index.json", ec)) return path;
  if (!fs::is_directory(path, ec)) ckpt_fail(path, "does not exist");
  // The latest pointer, else the newest complete step directory.
  check_latest_pointer(path);
  std::ifstream latest(fs::path(path) / "latest");
  std::string name;
  if (latest && std::getline(latest, name) && !name.empty() && name.find('/') == std::string::npos &&
      fs::is_regular_file(fs::path(path) / name / "index.json", ec)) {
    return (fs::path(path) / name).string();
  }
  const std::string best = newest_complete_step(path);
  if (best.empty()) ckpt_fail(path, "holds no complete checkpoint");
  return (fs::path(path) / best).string();
}

bool holds_checkpoint(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return false;
  check_latest_pointer(dir);
  return !newest_complete_step(dir).empty();
}

CheckpointInfo save_checkpoint(const std::string& dir, std::int64_t step, const Module& module, Optimizer* optimizer,
                               Communicator& comm, const std::map<std::string, std::string>& extra, int keep) {
  autograd::NoGradGuard guard;
  const int rank = comm.rank(), world = comm.world_size();
  const std::string step_dir = (fs::path(dir) / step_name(step)).string();
  const auto params = module.named_parameters();

  // 0. A step directory written before (a run resumed from an earlier step reaches it again)
  // stops being a checkpoint before any of its files is replaced: rank 0 removes its index, and
  // no rank writes until that is done, so a kill from here on never leaves old and new files
  // under a complete-looking index.
  std::string error;
  if (rank == 0) {
    try {
      check_latest_pointer(dir);  // a pointer that cannot be replaced would fail only after every file is written
      fs::create_directories(step_dir);
      if (fs::remove(fs::path(step_dir) / "index.json")) sync_directory(step_dir);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  if (!all_ok(comm, error.empty()))
    ckpt_fail(step_dir, error.empty() ? "rank 0 could not prepare the directory" : error);

  // 1. Every rank writes its file.
  try {
    fs::create_directories(step_dir);
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const auto& [name, p] : params) {
      const Piece piece = piece_of(p, rank);
      const Tensor flat = p.data().reshape({-1});
      tensors.emplace_back("model/" + name, flat.slice(0, 0, piece.count));
      if (optimizer) {
        for (const auto& [state_name, t] : optimizer->state(p)) {
          tensors.emplace_back("optim/" + name + "/" + state_name, t.reshape({-1}).slice(0, 0, piece.count));
        }
      }
    }
    safetensors::write((fs::path(step_dir) / rank_file(rank, world)).string(), tensors,
                       {{"format", kFormat}, {"rank", std::to_string(rank)}, {"world_size", std::to_string(world)}});
  } catch (const std::exception& e) {
    error = e.what();
  }
  // 2. Only when every file is complete does rank 0 write the index, then the latest pointer.
  if (!all_ok(comm, error.empty())) {
    ckpt_fail(step_dir, error.empty() ? "another rank failed to write its file" : error);
  }
  CheckpointInfo info{step_dir, step, world, extra};
  if (rank == 0) {
    json index = {{"format", kFormat}, {"version", kVersion}, {"step", step}, {"world_size", world}};
    json files = json::array();
    for (int r = 0; r < world; ++r) files.push_back(rank_file(r, world));
    index["files"] = files;
    json jparams = json::object();
    for (const auto& [name, p] : params) {
      const bool sharded = p.is_sharded();
      const std::int64_t numel = shape_numel(p.shape());
      json pieces = json::array();
      for (int r = 0; r < world; ++r) {
        // Where each rank's piece lies: computed as each rank computed it.
        Piece piece;
        if (sharded) {
          piece = slice_of(numel, p.shard()->shard_size, r);
        } else if (r == 0) {
          piece.count = numel;
        }
        if (piece.count > 0) pieces.push_back({{"rank", r}, {"offset", piece.offset}, {"count", piece.count}});
      }
      jparams[name] = {{"id", p.id()},   {"shape", p.shape()}, {"dtype", dtype_name(p.data().dtype())},
                       {"numel", numel}, {"sharded", sharded}, {"pieces", pieces}};
    }
    index["params"] = jparams;
    if (optimizer) {
      json states = json::array();
      if (!params.empty()) {
        for (const auto& [state_name, t] : optimizer->state(params.front().second)) states.push_back(state_name);
      }
      index["optimizer"] = {{"steps", optimizer->steps()}, {"lr", optimizer->lr()}, {"state", states}};
    }
    index["extra"] = extra;
    error.clear();
    try {
      safetensors::write_text_atomically((fs::path(step_dir) / "index.json").string(), index.dump(1));
      safetensors::write_text_atomically((fs::path(dir) / "latest").string(), step_name(step) + "\n");
      if (keep > 0) {
        // Only complete checkpoints count: a crashed, incomplete step must not push out a good one.
        std::vector<std::string> steps;
        for (const auto& entry : fs::directory_iterator(dir)) {
          const std::string n = entry.path().filename().string();
          if (n.rfind("step-", 0) == 0 && entry.is_directory() && fs::exists(entry.path() / "index.json")) {
            steps.push_back(n);
          }
        }
        std::sort(steps.begin(), steps.end());
        for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < steps.size(); ++i) {
          if (steps[i] != step_name(step)) fs::remove_all(fs::path(dir) / steps[i]);
        }
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  if (!all_ok(comm, error.empty())) ckpt_fail(step_dir, error.empty() ? "rank 0 failed to write the index" : error);
  return info;
}

namespace {
CheckpointInfo load_from(const std::string& dir, const json& index, Module& module, Optimizer* optimizer) {
  CheckpointInfo info;
  info.directory = dir;
  info.step = index.at("step").get<std::int64_t>();
  info.world_size = index.at("world_size").get<int>();
  info.extra = index.value("extra", json::object()).get<std::map<std::string, std::string>>();
  const json& files = index.at("files");
  if (!files.is_array() || static_cast<int>(files.size()) != info.world_size || info.world_size <= 0) {
    ckpt_fail(dir, "index.json lists " + std::to_string(files.size()) + " files for world size " +
                       std::to_string(info.world_size));
  }
  const json& jparams = index.at("params");
  const auto params = module.named_parameters();
  if (jparams.size() != params.size()) {
    ckpt_fail(
        dir, "holds " + std::to_string(jparams.size()) + " parameters, the model has " + std::to_string(params.size()));
  }
  // Files are opened (and their headers validated) only when a range is needed from them.
  std::map<int, std::unique_ptr<safetensors::Reader>> readers;
  auto reader = [&](int r) -> safetensors::Reader& {
    auto& slot = readers[r];
    if (!slot) {
      const json& f = files.at(static_cast<std::size_t>(r));
      if (!f.is_string()) ckpt_fail(dir, "index.json has a file name that is not a string");
      const std::string name = f.get<std::string>();
      if (name.find('/') != std::string::npos || name == ".." || name.empty())
        ckpt_fail(dir, "index.json names file '" + name + "'");
      slot = std::make_unique<safetensors::Reader>((fs::path(dir) / name).string());
    }
    return *slot;
  };
  // Fills [want.offset, want.offset + want.count) of a parameter's flattened tensor into `out`
  // from the pieces that overlap it: the resharding read.
  auto gather_range = [&](const std::vector<IndexedPiece>& pieces, const std::string& tensor_prefix, Piece want,
                          DType dtype, void* out) {
    const std::size_t elem = dtype_size(dtype);
    for (const IndexedPiece& piece : pieces) {
      const int r = piece.rank;
      const std::int64_t offset = piece.offset, count = piece.count;
      const std::int64_t lo = std::max(offset, want.offset), hi = std::min(offset + count, want.offset + want.count);
      if (lo >= hi) continue;
      safetensors::Reader& file = reader(r);
      const std::string tensor = tensor_prefix;
      const auto& t = file.info(tensor);
      if (t.dtype != dtype || t.numel() != count) {
        ckpt_fail(file.path(), "tensor '" + tensor + "' is " + safetensors::format_dtype(t.dtype) + " " +
                                   to_string(t.shape) + ", the index says " + std::string(dtype_name(dtype)) + " [" +
                                   std::to_string(count) + "]");
      }
      file.read_range_into(tensor, lo - offset, hi - lo, static_cast<char*>(out) + (lo - want.offset) * elem);
    }
  };

  for (const auto& [name, p] : params) {
    if (!jparams.contains(name)) ckpt_fail(dir, "has no parameter '" + name + "'");
    const json& jp = jparams.at(name);
    const Shape shape = jp.at("shape").get<Shape>();
    if (shape != p.shape()) {
      ckpt_fail(dir, "parameter '" + name + "' is " + to_string(shape) + " in the checkpoint but " +
                         to_string(p.shape()) + " in the model");
    }
    const DType dtype = parse_dtype(jp.at("dtype").get<std::string>());
    if (dtype != p.data().dtype()) {
      ckpt_fail(dir, "parameter '" + name + "' is " + std::string(dtype_name(dtype)) + " in the checkpoint but " +
                         std::string(dtype_name(p.data().dtype())) + " in the model");
    }
    const Piece want =
        p.is_sharded() ? Piece{p.shard()->offset(), p.shard()->real_elements()} : Piece{0, p.data().numel()};
    // Padding stays zero: fill the whole local tensor, then the real part from the files.
    Tensor& data = p.data();
    Tensor staged = zeros({data.numel()}, Options(dtype, &data.backend()));
    const auto pieces = checked_pieces(dir, name, jp.at("pieces"), info.world_size, index_numel(dir, name, shape));
    gather_range(pieces, "model/" + name, want, dtype, staged.data_ptr());
    data.detach().reshape({-1}).copy_(staged);
    if (optimizer && index.contains("optimizer")) {
      for (auto& [state_name, t] : optimizer->state(p)) {
        Tensor staged_state = zeros({t.numel()}, Options(t.dtype(), &t.backend()));
        gather_range(pieces, "optim/" + name + "/" + state_name, want, t.dtype(), staged_state.data_ptr());
        t.reshape({-1}).copy_(staged_state);
      }
    }
  }
  if (optimizer && index.contains("optimizer")) {
    optimizer->set_steps(index["optimizer"].at("steps").get<std::int64_t>());
    optimizer->set_lr(index["optimizer"].at("lr").get<double>());
  }
  for (const auto& [r, file] : readers) info.bytes_read += file->bytes_read();
  return info;
}
}  // namespace

CheckpointInfo load_checkpoint(const std::string& path, Module& module, Optimizer* optimizer, Communicator& comm) {
  autograd::NoGradGuard guard;
  (void)comm;  // every rank reads its own ranges; no communication is needed
  const std::string dir = resolve_checkpoint(path);
  const json index = read_index(dir);
  return with_index_errors(dir, [&] { return load_from(dir, index, module, optimizer); });
}

CheckpointSummary describe_checkpoint(const std::string& path) {
  const std::string dir = resolve_checkpoint(path);
  const json index = read_index(dir);
  CheckpointSummary out;
  with_index_errors(dir, [&] {
    out.info.directory = dir;
    out.info.step = index.at("step").get<std::int64_t>();
    out.info.world_size = index.at("world_size").get<int>();
    out.info.extra = index.value("extra", json::object()).get<std::map<std::string, std::string>>();
    out.files = index.at("files").get<std::vector<std::string>>();
    std::vector<std::string> states;
    if (index.contains("optimizer")) {
      out.optimizer_steps = index["optimizer"].at("steps").get<std::int64_t>();
      states = index["optimizer"].value("state", json::array()).get<std::vector<std::string>>();
    }
    for (auto it = index.at("params").begin(); it != index.at("params").end(); ++it) {
      CheckpointEntry e;
      e.name = it.key();
      e.shape = it.value().at("shape").get<Shape>();
      e.dtype = parse_dtype(it.value().at("dtype").get<std::string>());
      e.id = it.value().value("id", std::uint64_t{0});
      e.sharded = it.value().value("sharded", false);
      e.optimizer_state = states;
      out.params.push_back(std::move(e));
    }
  });
  return out;
}

namespace {
// Calls visit(file, tensor name, piece offset, piece count) for every piece of every tensor
// (parameters and optimizer state) of a checkpoint, with the files opened and validated.
template <class Visit>
void for_each_piece(const std::string& dir, const json& index, Visit&& visit) {
  const auto files = index.at("files").get<std::vector<std::string>>();
  std::vector<std::unique_ptr<safetensors::Reader>> readers(files.size());
  std::vector<std::string> states;
  if (index.contains("optimizer"))
    states = index["optimizer"].value("state", json::array()).get<std::vector<std::string>>();
  for (auto it = index.at("params").begin(); it != index.at("params").end(); ++it) {
    const DType dtype = parse_dtype(it.value().at("dtype").get<std::string>());
    const std::int64_t numel = index_numel(dir, it.key(), it.value().at("shape").get<Shape>());
    for (const IndexedPiece& piece :
         checked_pieces(dir, it.key(), it.value().at("pieces"), static_cast<int>(files.size()), numel)) {
      const auto r = static_cast<std::size_t>(piece.rank);
      if (files[r].find('/') != std::string::npos) ckpt_fail(dir, "index.json names file '" + files[r] + "'");
      if (!readers[r]) readers[r] = std::make_unique<safetensors::Reader>((fs::path(dir) / files[r]).string());
      const std::int64_t offset = piece.offset, count = piece.count;
      std::vector<std::string> tensors = {"model/" + it.key()};
      for (const auto& s : states) tensors.push_back("optim/" + it.key() + "/" + s);
      for (const auto& name : tensors) {
        const auto& t = readers[r]->info(name);
        if (t.numel() != count || (name.rfind("model/", 0) == 0 && t.dtype != dtype)) {
          ckpt_fail(readers[r]->path(), "tensor '" + name + "' does not match its index entry");
        }
        visit(*readers[r], name, it.key(), dtype, offset, count);
      }
    }
  }
}
}  // namespace

std::uint64_t verify_checkpoint(const std::string& path) {
  const std::string dir = resolve_checkpoint(path);
  const json index = read_index(dir);
  std::uint64_t bytes = 0;
  // Chunked: checking a file of any size holds at most safetensors::kChunkBytes of it.
  with_index_errors(dir, [&] {
    for_each_piece(dir, index,
                   [&](safetensors::Reader& file, const std::string& tensor, const std::string&, DType, std::int64_t,
                       std::int64_t count) {
                     file.read_range_chunked(tensor, 0, count, [&](const char*, std::size_t n) { bytes += n; });
                   });
  });
  return bytes;
}

namespace {
// The consolidated file's header, from the index alone: every parameter at its logical shape,
// in the order for_each_piece visits them, so that the data can follow piece by piece.
std::vector<safetensors::TensorHeader> consolidated_header(const std::string& dir, const json& index) {
  std::vector<safetensors::TensorHeader> out;
  for (auto it = index.at("params").begin(); it != index.at("params").end(); ++it) {
    const Shape shape = it.value().at("shape").get<Shape>();
    index_numel(dir, it.key(), shape);  // an invalid shape fails here, as an IOError naming it
    out.push_back({it.key(), parse_dtype(it.value().at("dtype").get<std::string>()), shape});
  }
  return out;
}

std::map<std::string, std::string> consolidated_metadata(const std::string& dir, const json& index) {
  auto metadata = index.value("extra", json::object()).get<std::map<std::string, std::string>>();
  metadata["step"] = std::to_string(index.at("step").get<std::int64_t>());
  metadata["source"] = dir;
  return metadata;
}
}  // namespace

void consolidate_checkpoint(const std::string& path, const std::string& output_file) {
  const std::string dir = resolve_checkpoint(path);
  const json index = read_index(dir);
  // Streamed: the header first (the index gives every shape), then each parameter's pieces in
  // offset order, copied from the rank files through one bounded buffer. No tensor is held, so
  // a model of any size consolidates in safetensors::kChunkBytes of memory.
  with_index_errors(dir, [&] {
    safetensors::Writer out(output_file, consolidated_header(dir, index), consolidated_metadata(dir, index));
    for_each_piece(dir, index,
                   [&](safetensors::Reader& file, const std::string& tensor, const std::string&, DType, std::int64_t,
                       std::int64_t count) {
                     // Optimizer state is not part of a consolidated model.
                     if (tensor.rfind("model/", 0) == 0) file.copy_range(tensor, 0, count, out);
                   });
    out.commit();
  });
}

namespace {
// Where `rank` of `world` holds a tensor of `numel` elements in a split checkpoint: equal slices.
Piece split_piece(std::int64_t numel, int world, int rank) {
  return slice_of(numel, (numel + world - 1) / world, rank);
}

// A split tensor's index entry: its shape and every rank's piece.
json split_entry(const safetensors::TensorInfo& t, int world) {
  json pieces = json::array();
  for (int r = 0; r < world; ++r) {
    const Piece p = split_piece(t.numel(), world, r);
    if (p.count > 0) pieces.push_back({{"rank", r}, {"offset", p.offset}, {"count", p.count}});
  }
  return {{"id", 0},         {"shape", t.shape}, {"dtype", dtype_name(t.dtype)}, {"numel", t.numel()},
          {"sharded", true}, {"pieces", pieces}};
}

// Writes `rank`'s file of a split checkpoint: its slice of every input tensor, laid out as
// fully_shard lays it out, streamed from the input's byte ranges (no slice is held whole).
void write_split_rank(const safetensors::Reader& input, int rank, int world, const std::string& path) {
  std::vector<safetensors::TensorHeader> header;
  for (const auto& t : input.tensors())
    header.push_back({"model/" + t.name, t.dtype, {split_piece(t.numel(), world, rank).count}});
  safetensors::Writer out(path, header,
                          {{"format", kFormat}, {"rank", std::to_string(rank)}, {"world_size", std::to_string(world)}});
  for (const auto& t : input.tensors()) {
    const Piece p = split_piece(t.numel(), world, rank);
    input.copy_range(t.name, p.offset, p.count, out);
  }
  out.commit();
}
}  // namespace

CheckpointInfo split_checkpoint(const std::string& input_file, int world_size, const std::string& out_dir,
                                std::int64_t step) {
  if (world_size <= 0) ckpt_fail(out_dir, "world size must be positive, got " + std::to_string(world_size));
  safetensors::Reader input(input_file);
  for (const auto& t : input.tensors()) {
    if (!is_floating(t.dtype)) ckpt_fail(input_file, "tensor '" + t.name + "' is not floating-point");
  }
  std::map<std::string, std::string> extra = input.metadata();
  extra.erase("step");
  extra.erase("source");
  const std::string step_dir = (fs::path(out_dir) / step_name(step)).string();
  fs::create_directories(step_dir);
  for (int rank = 0; rank < world_size; ++rank)
    write_split_rank(input, rank, world_size, (fs::path(step_dir) / rank_file(rank, world_size)).string());
  // The index last, once every rank file is complete; then the latest pointer.
  json files = json::array(), jparams = json::object();
  for (int r = 0; r < world_size; ++r) files.push_back(rank_file(r, world_size));
  for (const auto& t : input.tensors()) jparams[t.name] = split_entry(t, world_size);
  const json index = {{"format", kFormat}, {"version", kVersion}, {"step", step},  {"world_size", world_size},
                      {"files", files},    {"params", jparams},   {"extra", extra}};
  safetensors::write_text_atomically((fs::path(step_dir) / "index.json").string(), index.dump(1));
  safetensors::write_text_atomically((fs::path(out_dir) / "latest").string(), step_name(step) + "\n");
  return CheckpointInfo{step_dir, step, world_size, extra};
}

}  // namespace ruda::nn
