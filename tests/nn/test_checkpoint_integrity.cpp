// Checkpoints that prove their integrity: damaged, swapped, stale and non-regular files and
// damaged indexes are refused by load and verify alike, naming the file and the problem; saves
// clean what killed saves left; a failure on one rank reaches every rank with its cause.
#include <sys/stat.h>

#include <cstring>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "helpers.h"
#include "index_edit.h"

using namespace ruda;
using test::file_text;
using test::names_in;
using test::TempDir;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// A 256x256 weight (256 KiB: four checksum blocks) and its bias, sharded over the ranks.
std::shared_ptr<nn::Linear> make_layer(Communicator& comm) {
  nn::manual_seed(3);
  auto layer = std::make_shared<nn::Linear>(256, 256);
  nn::fully_shard(*layer, comm);
  return layer;
}

// Saves make_layer with AdamW moments at `step` over `world` emulated ranks.
void save_layer(const TempDir& dir, int world, std::int64_t step) {
  run_ranks(world, [&](Communicator& comm) {
    auto layer = make_layer(comm);
    nn::AdamW opt(layer->parameters(), nn::AdamWOptions{});
    sum(layer->forward(ones({2, 256}))).backward();
    opt.step();
    nn::save_checkpoint(dir.str(), step, *layer, &opt, comm, {}, /*keep=*/0);
  });
}

// Loads dir into make_layer over `world` emulated ranks; returns each rank's error ("" if none).
std::vector<std::string> load_layer(const TempDir& dir, int world, nn::LoadOptions options = {}) {
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  std::mutex m;
  run_ranks(world, [&](Communicator& comm) {
    auto layer = make_layer(comm);
    nn::AdamW opt(layer->parameters(), nn::AdamWOptions{});
    try {
      nn::load_checkpoint(dir.str(), *layer, &opt, comm, options);
    } catch (const IOError& e) {
      std::lock_guard lock(m);
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  return errors;
}

void check_contains(const std::string& text, const std::vector<std::string>& fragments) {
  for (const auto& f : fragments)
    CHECK_MESSAGE(text.find(f) != std::string::npos, "'" << text << "' lacks '" << f << "'");
}

// A rank file's name; `alternate`: the name a rewrite of a saved step writes beside it.
std::string rank_file(int rank, int world, bool alternate = false) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "rank-%05d-of-%05d%s.safetensors", rank, world, alternate ? ".b" : "");
  return buf;
}

// Flips one bit of byte `at` (from the start of tensor `tensor`'s data) in a safetensors file.
void flip_byte(const fs::path& file, const std::string& tensor, std::uint64_t at) {
  std::uint64_t begin = 0;
  {
    safetensors::Reader reader(file.string());
    begin = reader.info(tensor).begin;
  }
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(begin + at));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(static_cast<std::streamoff>(begin + at));
  f.write(&c, 1);
}

json read_json(const fs::path& path) {
  std::ifstream in(path);
  return json::parse(in);
}

}  // namespace

TEST_CASE("a flipped byte anywhere in the data is caught by verify and by load, at any world size") {
  TempDir dir;
  save_layer(dir, 2, 1);
  const fs::path step = dir.path / "step-00000001";
  CHECK(nn::describe_checkpoint(dir.str()).checksums);
  CHECK(nn::verify_checkpoint(dir.str()) > 3 * 256 * 256 * 4);
  // The weight's values in the last block of rank 1's piece, and a byte of an Adam moment.
  for (const auto& [tensor, at] : std::vector<std::pair<std::string, std::uint64_t>>{
           {"model/weight", 128 * 1024 - 1}, {"optim/weight/exp_avg_sq", 70000}, {"model/bias", 4}}) {
    CAPTURE(tensor);
    TempDir copy;
    fs::copy(dir.path, copy.path, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    const fs::path damaged = copy.path / "step-00000001" / rank_file(1, 2);
    flip_byte(damaged, tensor, at);
    test::check_throws<IOError>([&] { nn::verify_checkpoint(copy.str()); },
                                {rank_file(1, 2), tensor, "checksum", "damaged"});
    // Same world size: rank 1 reads the damaged piece and says so; rank 0 learns it from rank 1.
    const auto errors = load_layer(copy, 2);
    check_contains(errors[1], {rank_file(1, 2), tensor, "checksum"});
    check_contains(errors[0], {"loading failed on rank 1", tensor, "checksum"});
    // Resharded to 3 ranks: whichever ranks read the damaged block refuse, and every rank fails.
    for (const auto& e : load_layer(copy, 3)) CHECK_FALSE(e.empty());
    // The documented opt-out loads the damaged value without hashing.
    for (const auto& e : load_layer(copy, 2, {.verify_checksums = false})) CHECK(e.empty());
    // Consolidating checks what it copies (the model, not the optimizer's state).
    if (tensor.rfind("model/", 0) == 0) {
      test::check_throws<IOError>(
          [&] { nn::consolidate_checkpoint(copy.str(), (copy.path / "all.safetensors").string()); },
          {tensor, "checksum"});
    }
  }
  for (const auto& e : load_layer(dir, 2)) CHECK(e.empty());
  for (const auto& e : load_layer(dir, 3)) CHECK(e.empty());
}

TEST_CASE("swapped rank files and a file left from another step are refused by name") {
  TempDir dir;
  save_layer(dir, 2, 1);
  save_layer(dir, 2, 2);
  const fs::path step2 = dir.path / "step-00000002";
  SUBCASE("two ranks' files swapped") {
    fs::rename(step2 / rank_file(0, 2), dir.path / "tmp");
    fs::rename(step2 / rank_file(1, 2), step2 / rank_file(0, 2));
    fs::rename(dir.path / "tmp", step2 / rank_file(1, 2));
    test::check_throws<IOError>([&] { nn::verify_checkpoint(dir.str()); },
                                {rank_file(0, 2), "written by rank 1 of 2", "expects rank 0 of 2"});
    check_contains(load_layer(dir, 2)[0], {rank_file(0, 2), "written by rank 1"});
  }
  SUBCASE("one rank's file from the step before") {
    fs::copy_file(dir.path / "step-00000001" / rank_file(1, 2), step2 / rank_file(1, 2),
                  fs::copy_options::overwrite_existing);
    test::check_throws<IOError>([&] { nn::verify_checkpoint(dir.str()); }, {rank_file(1, 2), "at step 1", "at step 2"});
    check_contains(load_layer(dir, 2)[1], {rank_file(1, 2), "at step 1", "expects rank 1 of 2 at step 2"});
  }
  SUBCASE("a file of another world size under the right name") {
    TempDir other;
    save_layer(other, 3, 2);
    fs::copy_file(other.path / "step-00000002" / rank_file(1, 3), step2 / rank_file(1, 2),
                  fs::copy_options::overwrite_existing);
    test::check_throws<IOError>([&] { nn::verify_checkpoint(dir.str()); }, {rank_file(1, 2), "rank 1 of 3"});
  }
}

TEST_CASE("files that are not regular never block and are named") {
  TempDir dir;
  save_layer(dir, 2, 1);
  const fs::path step = dir.path / "step-00000001";
  SUBCASE("a rank file that is a FIFO") {
    fs::remove(step / rank_file(1, 2));
    REQUIRE(::mkfifo((step / rank_file(1, 2)).c_str(), 0644) == 0);
    test::check_throws<IOError>([&] { nn::verify_checkpoint(dir.str()); },
                                {rank_file(1, 2), "not a regular file", "FIFO"});
    check_contains(load_layer(dir, 2)[1], {rank_file(1, 2), "FIFO"});
  }
  SUBCASE("a directory in place of index.json") {
    fs::remove(step / "index.json");
    fs::create_directory(step / "index.json");
    for (const auto& fn : std::vector<std::function<void()>>{
             [&] { nn::verify_checkpoint(step.string()); }, [&] { nn::describe_checkpoint(step.string()); },
             [&] { nn::consolidate_checkpoint(step.string(), (dir.path / "x.safetensors").string()); }}) {
      test::check_throws<IOError>(fn, {"index.json", "not a regular file but a directory"});
    }
    check_contains(load_layer(dir, 2)[0], {"index.json"});  // the directory, not a step: no complete checkpoint
  }
  SUBCASE("an index.json that is a FIFO") {
    fs::remove(step / "index.json");
    REQUIRE(::mkfifo((step / "index.json").c_str(), 0644) == 0);
    test::check_throws<IOError>([&] { nn::verify_checkpoint(step.string()); }, {"index.json", "FIFO"});
    // The checkpoint code's error, not the safetensors reader's.
    try {
      nn::verify_checkpoint(step.string());
    } catch (const IOError& e) {
      CHECK(std::string(e.what()).rfind("checkpoint ", 0) == 0);
      CHECK(std::string(e.what()).find("safetensors") == std::string::npos);
    }
  }
}

TEST_CASE("verify, load, list and consolidate refuse the same index damage") {
  TempDir dir;
  save_layer(dir, 2, 1);
  const fs::path index_path = dir.path / "step-00000001" / "index.json";
  const json good = read_json(index_path);
  struct Damage {
    std::string what;
    std::function<void(json&)> edit;
    std::vector<std::string> fragments;  // in what verify, load and consolidate raise
    bool in_index = true;                // index.json contradicts itself: listing refuses it too
  };
  const std::vector<Damage> damages = {
      {"a world size that disagrees with the files", [](json& j) { j["world_size"] = 3; }, {"3"}},
      {"a world size that disagrees with the files' own",
       [](json& j) {
         j["world_size"] = 1;
         j["files"] = json::array({"rank-00000-of-00002.safetensors"});
         for (auto& [name, p] : j["params"].items()) {
           json pieces = p["pieces"];
           p["pieces"] = json::array();
           for (auto piece : pieces) {
             if (piece["rank"] == 0) p["pieces"].push_back(piece);
           }
           p["pieces"][0]["count"] = p["numel"];
         }
       },
       {rank_file(0, 2), "rank 0 of 2", "expects rank 0 of 1"},
       false},
      {"the step as a string", [](json& j) { j["step"] = "1"; }, {"'step' must be an integer", "\"1\""}},
      {"a negative step", [](json& j) { j["step"] = -4; }, {"'step' is -4"}},
      // A step near int64's end resumed into step + k arithmetic that overflowed (ruda-train).
      {"a step past 2^53", [](json& j) { j["step"] = INT64_MAX; }, {"'step' is 9223372036854775807"}},
      {"the optimizer's steps missing", [](json& j) { j["optimizer"].erase("steps"); }, {"'optimizer'", "no 'steps'"}},
      {"the learning rate as a string", [](json& j) { j["optimizer"]["lr"] = "0.1"; }, {"'lr'"}},
      // Was the optimizer's ArgumentError at load, naming no file.
      {"a negative learning rate", [](json& j) { j["optimizer"]["lr"] = -1; }, {"index.json", "'lr'", ">= 0"}},
      {"the optimizer's state names missing", [](json& j) { j["optimizer"].erase("state"); }, {"no 'state'"}},
      {"extra state that is not a string", [](json& j) { j["extra"]["epoch"] = 3; }, {"extra 'epoch'"}},
      {"a piece's count as a string", [](json& j) { j["params"]["weight"]["pieces"][0]["count"] = "10"; }, {"'count'"}},
      {"a shape extent as a fraction", [](json& j) { j["params"]["bias"]["shape"][0] = 2.5; }, {"bias", "extent"}},
      {"a checksum cut short",
       [](json& j) {
         auto& h = j["params"]["weight"]["pieces"][0]["xxh3"]["model/weight"];
         h = h.get<std::string>().substr(16);
       },
       {"checksums", "model/weight"},
       false},
      {"a checksum that is not hex",
       [](json& j) { j["params"]["bias"]["pieces"][0]["xxh3"]["model/bias"] = "zz"; },
       {"malformed checksums"}},
      {"a file name with a directory in it",
       [](json& j) { j["files"][1] = "../rank-00001-of-00002.safetensors"; },
       {"names file"}},
      {"an unknown version", [](json& j) { j["version"] = 99; }, {"version 99"}},
      {"an unknown dtype", [](json& j) { j["params"]["bias"]["dtype"] = "f8"; }, {"bias", "f8"}},
      // Self-consistent (the pieces still tile the tensor, each keeps its checksums) but permuted:
      // this loaded the weight's two halves swapped, and verify passed.
      {"two pieces' offsets swapped",
       [](json& j) {
         auto& pieces = j["params"]["weight"]["pieces"];
         const json first = pieces[0]["offset"];
         pieces[0]["offset"] = pieces[1]["offset"];
         pieces[1]["offset"] = first;
       },
       {"'model/weight' from element", "places that piece at element"},
       false},
  };
  for (const auto& d : damages) {
    CAPTURE(d.what);
    json j = good;
    d.edit(j);
    std::ofstream(index_path) << test::restamped(j).dump(1);
    test::check_throws<IOError>([&] { nn::verify_checkpoint(dir.str()); }, d.fragments);
    if (d.in_index) test::check_throws<IOError>([&] { nn::describe_checkpoint(dir.str()); }, d.fragments);
    test::check_throws<IOError>([&] { nn::consolidate_checkpoint(dir.str(), (dir.path / "x.safetensors").string()); },
                                d.fragments);
    for (const auto& e : load_layer(dir, 2)) check_contains(e, {d.fragments.front()});
  }
  std::ofstream(index_path) << good.dump(1);
  CHECK(nn::verify_checkpoint(dir.str()) > 0);
}

TEST_CASE("a save removes what killed saves left, and only that") {
  TempDir dir;
  save_layer(dir, 2, 1);
  // What kills leave: a temporary pointer, a temporary rank file in a complete step, and a step
  // directory without an index (killed before its index) holding a temporary file.
  // (Temporary files are name.tmp-XXXXXX; earlier versions' name.tmp are cleaned too.)
  std::ofstream(dir.path / "latest.tmp") << "step-00000009";
  std::ofstream(dir.path / "latest.tmp-a1b2c3") << "step-00000009";
  std::ofstream(dir.path / "step-00000001" / (rank_file(1, 2) + ".tmp")) << "partial";
  std::ofstream(dir.path / "step-00000001" / (rank_file(0, 2) + ".tmp-zz0099")) << "partial";
  std::ofstream(dir.path / "step-00000001" / "index.json.tmp") << "{";
  std::ofstream(dir.path / "step-00000001" / "index.json.tmp-000000") << "{";
  fs::create_directories(dir.path / "step-00000009");
  std::ofstream(dir.path / "step-00000009" / (rank_file(0, 2) + ".tmp")) << "partial";
  // Not ruda's: left alone.
  std::ofstream(dir.path / "notes.tmp") << "mine";
  std::ofstream(dir.path / "step-00000001" / "mine.tmp") << "mine";
  std::ofstream(dir.path / "step-00000001" / "mine.tmp-a1b2c3") << "mine";
  std::ofstream(dir.path / "latest.tmp-notours") << "mine";
  save_layer(dir, 2, 2);
  CHECK_FALSE(fs::exists(dir.path / "latest.tmp"));
  CHECK_FALSE(fs::exists(dir.path / "latest.tmp-a1b2c3"));
  CHECK_FALSE(fs::exists(dir.path / "step-00000001" / (rank_file(1, 2) + ".tmp")));
  CHECK_FALSE(fs::exists(dir.path / "step-00000001" / (rank_file(0, 2) + ".tmp-zz0099")));
  CHECK_FALSE(fs::exists(dir.path / "step-00000001" / "index.json.tmp"));
  CHECK_FALSE(fs::exists(dir.path / "step-00000001" / "index.json.tmp-000000"));
  CHECK(fs::exists(dir.path / "step-00000001" / "mine.tmp-a1b2c3"));
  CHECK(fs::exists(dir.path / "latest.tmp-notours"));
  CHECK_FALSE(fs::exists(dir.path / "step-00000009"));
  CHECK(fs::exists(dir.path / "notes.tmp"));
  CHECK(fs::exists(dir.path / "step-00000001" / "mine.tmp"));
  CHECK(nn::verify_checkpoint((dir.path / "step-00000001").string()) > 0);
  CHECK(nn::resolve_checkpoint(dir.str()) == (dir.path / "step-00000002").string());
  // The step saved again (a run killed while saving it, resumed from the step before, saves it
  // anew): a killed save's temporary in that very step goes too; other files stay.
  std::ofstream(dir.path / "step-00000002" / (rank_file(1, 2) + ".tmp-k1ll3d")) << "partial";
  std::ofstream(dir.path / "step-00000002" / "mine.tmp-a1b2c3") << "mine";
  save_layer(dir, 2, 2);
  CHECK_FALSE(fs::exists(dir.path / "step-00000002" / (rank_file(1, 2) + ".tmp-k1ll3d")));
  CHECK(fs::exists(dir.path / "step-00000002" / "mine.tmp-a1b2c3"));
  CHECK(nn::verify_checkpoint((dir.path / "step-00000002").string()) > 0);
  // A rewrite of step 1 killed after its new rank files were in place, before its index named
  // them (and one at another world size): rank files the index does not name. The run resumed
  // from step 1 never saves it again; the next save of another step removes them.
  const fs::path one = dir.path / "step-00000001";
  fs::copy_file(one / rank_file(0, 2), one / rank_file(0, 2, /*alternate=*/true));
  fs::copy_file(one / rank_file(1, 2), one / rank_file(1, 2, /*alternate=*/true));
  std::ofstream(one / rank_file(0, 3)) << "a killed rewrite at 3 ranks";
  save_layer(dir, 2, 3);
  CHECK_FALSE(fs::exists(one / rank_file(0, 2, true)));
  CHECK_FALSE(fs::exists(one / rank_file(1, 2, true)));
  CHECK_FALSE(fs::exists(one / rank_file(0, 3)));
  CHECK(fs::exists(one / rank_file(0, 2)));
  CHECK(fs::exists(one / "mine.tmp"));
  CHECK(nn::verify_checkpoint(one.string()) > 0);
}

TEST_CASE("a failed save names the failing rank and its cause on every rank") {
  TempDir dir;
  save_layer(dir, 2, 1);
  // Rank 1 cannot write its file: a directory is in the way.
  fs::create_directories(dir.path / "step-00000002" / rank_file(1, 2));
  std::vector<std::string> errors(2);
  std::mutex m;
  run_ranks(2, [&](Communicator& comm) {
    auto layer = make_layer(comm);
    try {
      nn::save_checkpoint(dir.str(), 2, *layer, nullptr, comm);
    } catch (const IOError& e) {
      std::lock_guard lock(m);
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const auto& e : errors)
    check_contains(e, {"step-00000002", "failed on rank 1", rank_file(1, 2), "is a directory"});
  // Nothing was published: the previous checkpoint is still the latest.
  CHECK(nn::resolve_checkpoint(dir.str()) == (dir.path / "step-00000001").string());
}

namespace {
// Rewrites a rank file with `edit` applied to its metadata (its tensors as they were).
void rewrite_metadata(const fs::path& file, const std::function<void(std::map<std::string, std::string>&)>& edit) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::map<std::string, std::string> metadata;
  {
    safetensors::Reader reader(file.string());
    for (const auto& t : reader.tensors()) tensors.emplace_back(t.name, reader.read(t.name));
    metadata = reader.metadata();
  }
  edit(metadata);
  safetensors::write(file.string(), tensors, metadata);
}
}  // namespace

TEST_CASE("rank files record where their pieces start; files written before that still load") {
  TempDir dir;
  save_layer(dir, 2, 1);
  const fs::path step = dir.path / "step-00000001";
  {
    safetensors::Reader reader((step / rank_file(1, 2)).string());
    CHECK(json::parse(reader.metadata().at("offsets")) == json{{"model/weight", 32768},
                                                               {"optim/weight/exp_avg", 32768},
                                                               {"optim/weight/exp_avg_sq", 32768},
                                                               {"model/bias", 128},
                                                               {"optim/bias/exp_avg", 128},
                                                               {"optim/bias/exp_avg_sq", 128}});
  }
  // Malformed records are refused by name, by every reader.
  for (const std::string bad : {"[1, 2]", "{\"model/weight\": -1}", "{\"model/weight\": \"0\"}", "not json"}) {
    CAPTURE(bad);
    rewrite_metadata(step / rank_file(1, 2), [&](auto& m) { m["offsets"] = bad; });
    test::check_throws<IOError>([&] { nn::verify_checkpoint(dir.str()); },
                                {rank_file(1, 2), "malformed piece offsets"});
    for (const auto& e : load_layer(dir, 2)) check_contains(e, {"malformed piece offsets"});
  }
  // A tensor the record leaves out is refused too (the record is all or nothing).
  rewrite_metadata(step / rank_file(1, 2), [](auto& m) { m["offsets"] = R"({"model/weight": 32768})"; });
  test::check_throws<IOError>([&] { nn::verify_checkpoint(dir.str()); }, {"'model/bias' without a recorded offset"});
  // A version-3 checkpoint's file without the record (its key's name damaged) is refused: it
  // would otherwise pass for an older file, with the check of its pieces' places off.
  for (int r = 0; r < 2; ++r) rewrite_metadata(step / rank_file(r, 2), [](auto& m) { m.erase("offsets"); });
  test::check_throws<IOError>([&] { nn::verify_checkpoint(dir.str()); },
                              {rank_file(0, 2), "lacks its recorded piece offsets", "version 5"});
  for (const auto& e : load_layer(dir, 2)) check_contains(e, {"lacks its recorded piece offsets"});
  // Files without the record written before it existed (format version 2) load as before, at
  // any world size.
  const fs::path index_path = step / "index.json";
  const json version_3 = read_json(index_path);
  std::ofstream(index_path) << test::before_index_checksum(version_3).dump(1);
  CHECK(nn::verify_checkpoint(dir.str()) > 0);
  for (const int world : {1, 2, 3}) {
    for (const auto& e : load_layer(dir, world)) CHECK(e.empty());
  }
}

TEST_CASE("a version 1 checkpoint (before checksums) still loads and verifies") {
  TempDir dir;
  save_layer(dir, 2, 1);
  const fs::path index_path = dir.path / "step-00000001" / "index.json";
  json j = read_json(index_path);
  for (auto& [name, p] : j["params"].items()) {
    for (auto& piece : p["pieces"]) piece.erase("xxh3");
  }
  std::ofstream(index_path) << test::before_index_checksum(j, 1).dump(1);
  const auto summary = nn::describe_checkpoint(dir.str());
  CHECK(summary.version == 1);
  CHECK_FALSE(summary.checksums);
  CHECK(nn::verify_checkpoint(dir.str()) > 0);
  for (const auto& e : load_layer(dir, 3)) CHECK(e.empty());
}

namespace {

// The error fn() raises, as IOError ("" and a failed check if none or another type).
template <class F>
std::string io_error_of(F&& fn) {
  try {
    fn();
  } catch (const IOError& e) {
    return e.what();
  }
  FAIL_CHECK("no IOError");
  return "";
}

}  // namespace

TEST_CASE("resolve and the latest pointer: messages say what the path is, as checkpoint errors") {
  TempDir dir;
  save_layer(dir, 1, 1);
  const fs::path file = dir.path / "step-00000001" / rank_file(0, 1);
  // A regular file exists: "does not exist" was wrong.
  const std::string regular = io_error_of([&] { nn::resolve_checkpoint(file.string()); });
  check_contains(regular, {rank_file(0, 1), "is a regular file", "not a checkpoint"});
  CHECK(regular.find("does not exist") == std::string::npos);
  check_contains(io_error_of([&] { nn::resolve_checkpoint((dir.path / "nothing").string()); }), {"does not exist"});
  check_contains(io_error_of([&] { nn::resolve_checkpoint((file / "below").string()); }), {"does not exist"});
  // An oversized pointer: named by the checkpoint code, not as a safetensors error.
  std::ofstream(dir.path / "latest") << std::string(5000, 's');
  const std::string oversized = io_error_of([&] { nn::resolve_checkpoint(dir.str()); });
  check_contains(oversized, {"latest", "5000 bytes"});
  CHECK(oversized.rfind("checkpoint ", 0) == 0);
  CHECK(oversized.find("safetensors") == std::string::npos);
}

TEST_CASE("index.json's own checksum: an edit that keeps the JSON valid is refused by every reader") {
  // Found by a bit-flip sweep of an index: 620 of 18,003 single flips passed verify (the
  // optimizer's lr and step count, a group's name, the extra values), and hand edits loaded: a
  // shape changed to another of the same size, a parameter dropped (consolidate wrote a file
  // without it).
  TempDir dir;
  save_layer(dir, 2, 1);
  const fs::path index_path = dir.path / "step-00000001" / "index.json";
  const json good = read_json(index_path);
  REQUIRE(good.contains("index_xxh3"));
  CHECK(good["version"] == 5);
  auto refused_everywhere = [&](const std::vector<std::string>& fragments) {
    test::check_throws<IOError>([&] { nn::verify_checkpoint(dir.str()); }, fragments);
    test::check_throws<IOError>([&] { nn::describe_checkpoint(dir.str()); }, fragments);
    test::check_throws<IOError>([&] { nn::consolidate_checkpoint(dir.str(), (dir.path / "x.safetensors").string()); },
                                fragments);
    for (const auto& e : load_layer(dir, 2)) check_contains(e, {fragments.front()});
  };
  const std::vector<std::pair<std::string, std::function<void(json&)>>> edits = {
      {"the optimizer's step count", [](json& j) { j["optimizer"]["steps"] = j["optimizer"]["steps"].get<int>() + 1; }},
      {"the learning rate", [](json& j) { j["optimizer"]["lr"] = 0.5; }},
      {"a parameter dropped", [](json& j) { j["params"].erase(j["params"].begin()); }},
      {"the format version (its digit flipped)", [](json& j) { j["version"] = 2; }},
  };
  for (const auto& [what, edit] : edits) {
    CAPTURE(what);
    json j = good;
    edit(j);
    std::ofstream(index_path) << j.dump(1);
    refused_everywhere({"index.json", "does not match its checksum", "edited or damaged"});
  }
  // The key itself damaged: a version that records a checksum must have one.
  json renamed = good;
  renamed["index_xxh2"] = renamed["index_xxh3"];
  renamed.erase("index_xxh3");
  std::ofstream(index_path) << renamed.dump(1);
  refused_everywhere({"index.json", "lacks its checksum 'index_xxh3'", "version 5"});
  // Reindented, the same content: the checksum is over the content, not the text.
  std::ofstream(index_path) << good.dump(4);
  CHECK(nn::verify_checkpoint(dir.str()) > 0);
  for (const auto& e : load_layer(dir, 2)) CHECK(e.empty());
}

TEST_CASE("a checkpoint without optimizer state loads into a run with an optimizer, and says so") {
  // ruda-ckpt split of a consolidated file is model-only: a resume from it restarted AdamW from
  // zero moments and step 0 without a word.
  TempDir model_only, full;
  save_layer(full, 2, 1);
  run_ranks(2, [&](Communicator& comm) {
    auto layer = make_layer(comm);
    nn::save_checkpoint(model_only.str(), 1, *layer, nullptr, comm, {}, 0);
  });
  std::vector<std::vector<std::string>> warnings(2), without_optimizer(2), complete(2);
  std::mutex m;
  run_ranks(2, [&](Communicator& comm) {
    auto layer = make_layer(comm);
    nn::AdamW opt(layer->parameters(), nn::AdamWOptions{});
    const auto from_model_only = nn::load_checkpoint(model_only.str(), *layer, &opt, comm).warnings;
    const auto into_no_optimizer = nn::load_checkpoint(model_only.str(), *layer, nullptr, comm).warnings;
    const auto from_full = nn::load_checkpoint(full.str(), *layer, &opt, comm).warnings;
    std::lock_guard lock(m);
    const auto r = static_cast<std::size_t>(comm.rank());
    warnings[r] = from_model_only;
    without_optimizer[r] = into_no_optimizer;
    complete[r] = from_full;
  });
  for (std::size_t r = 0; r < 2; ++r) {
    REQUIRE(warnings[r].size() == 1);
    check_contains(warnings[r][0], {"step-00000001", "no optimizer state", "starts afresh"});
    CHECK(without_optimizer[r].empty());
    CHECK(complete[r].empty());
  }
}

TEST_CASE("an index.json that repeats a key is refused") {
  TempDir dir;
  save_layer(dir, 2, 1);
  const fs::path index_path = dir.path / "step-00000001" / "index.json";
  std::string text = file_text(index_path);
  // A second "step" (the parser kept the last one).
  const std::size_t at = text.find("\"step\"");
  REQUIRE(at != std::string::npos);
  text.insert(at, "\"step\": 7, ");
  std::ofstream(index_path) << text;
  test::check_throws<IOError>([&] { nn::verify_checkpoint(dir.str()); }, {"index.json", "'step' twice"});
  for (const auto& e : load_layer(dir, 2)) check_contains(e, {"'step' twice"});
}

TEST_CASE("split and consolidate: filesystem failures are IOErrors naming the path") {
  TempDir dir;
  save_layer(dir, 2, 1);
  const std::string full = (dir.path / "full.safetensors").string();
  nn::consolidate_checkpoint(dir.str(), full);
  // out_dir is a regular file (was std::filesystem::filesystem_error).
  const fs::path file = dir.path / "a-file";
  std::ofstream(file) << "x";
  test::check_throws<IOError>([&] { nn::split_checkpoint(full, 2, file.string()); }, {"a-file", "not a directory"});
  test::check_throws<IOError>([&] { nn::split_checkpoint(full, 2, (file / "below").string()); },
                              {"a-file", "not a directory"});
  CHECK(file_text(file) == "x");
  // Its step directory is a file.
  fs::create_directories(dir.path / "out");
  std::ofstream(dir.path / "out" / "step-00000000") << "x";
  test::check_throws<IOError>([&] { nn::split_checkpoint(full, 2, (dir.path / "out").string()); },
                              {"step-00000000", "not a directory"});
  // A save into a regular file fails on every rank as IOError too.
  std::vector<std::string> errors(2);
  std::mutex m;
  run_ranks(2, [&](Communicator& comm) {
    auto layer = make_layer(comm);
    try {
      nn::save_checkpoint(file.string(), 2, *layer, nullptr, comm);
    } catch (const IOError& e) {
      std::lock_guard lock(m);
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const auto& e : errors) check_contains(e, {"a-file", "not a directory"});
  // A consolidation whose output's directory is a file.
  test::check_throws<IOError>([&] { nn::consolidate_checkpoint(dir.str(), (file / "x.safetensors").string()); },
                              {"x.safetensors", "cannot create"});
  CHECK(test::temporaries_in(dir.path).empty());
}

TEST_CASE("consolidate never writes over its own checkpoint, and split never over its input") {
  TempDir dir;
  save_layer(dir, 2, 1);
  const fs::path step = dir.path / "step-00000001";
  const std::string before = file_text(step / rank_file(0, 2));
  fs::create_directories(dir.path / "links");
  fs::create_symlink(step / rank_file(0, 2), dir.path / "links" / "symlink.safetensors");
  fs::create_hard_link(step / rank_file(1, 2), dir.path / "links" / "hardlink.safetensors");
  fs::create_symlink(step, dir.path / "links" / "step-link");
  // A link planted at the name the output's temporary file once had.
  fs::create_symlink(step / rank_file(0, 2), dir.path / "links" / "out.safetensors.tmp");
  const std::vector<fs::path> outputs = {
      step / rank_file(0, 2),  // was overwritten: the checkpoint destroyed
      step / rank_file(1, 2),
      step / "index.json",
      step / "new.safetensors",  // beside its files
      step,
      dir.path / "step-00000001" / ".." / "step-00000001" / rank_file(1, 2),
      dir.path / "links" / "symlink.safetensors",
      dir.path / "links" / "hardlink.safetensors",
      dir.path / "links" / "step-link" / rank_file(0, 2),
      dir.path / "latest",
  };
  for (const fs::path& out : outputs) {
    CAPTURE(out.string());
    test::check_throws<IOError>([&] { nn::consolidate_checkpoint(dir.str(), out.string()); },
                                {out.filename().string()});
    test::check_throws<IOError>([&] { nn::consolidate_checkpoint(step.string(), out.string()); }, {"consolidated"});
  }
  // The temporary file is a new one of its own: the link at the old fixed name is not followed.
  nn::consolidate_checkpoint(dir.str(), (dir.path / "links" / "out.safetensors").string());
  CHECK(fs::is_symlink(dir.path / "links" / "out.safetensors.tmp"));
  CHECK(file_text(step / rank_file(0, 2)) == before);
  CHECK(file_text(dir.path / "latest") == "step-00000001\n");
  CHECK(nn::verify_checkpoint(dir.str()) > 0);
  CHECK_FALSE(fs::exists(step / "new.safetensors"));
  // Beside the step directories is fine.
  const fs::path full = dir.path / "full.safetensors";
  nn::consolidate_checkpoint(dir.str(), full.string());
  CHECK(safetensors::Reader(full.string()).tensors().size() == 2);

  // Split: an input inside the step directory it writes, the pointer publishing replaces, or a
  // step directory without an index (which publishing removes) is refused before anything is written.
  const std::string full_text = file_text(full);
  const fs::path out = dir.path / "out";
  auto refused = [&](const fs::path& input, std::int64_t step_number, const std::string& fragment) {
    CAPTURE(input.string());
    fs::create_directories(input.parent_path());
    fs::copy_file(full, input, fs::copy_options::overwrite_existing);
    test::check_throws<IOError>([&] { nn::split_checkpoint(input.string(), 2, out.string(), step_number); },
                                {input.filename().string(), fragment});
    CHECK(file_text(input) == full_text);
  };
  refused(out / "step-00000003" / "model.safetensors", 3, "lies inside the step directory");
  refused(out / "step-00000003" / rank_file(0, 2), 3, "lies inside the step directory");
  refused(out / "latest", 3, "latest");
  refused(out / "step-00000009" / "model.safetensors", 3, "without an index");
  // A split beside its input, into a directory that held it in a complete step, works.
  nn::split_checkpoint(full.string(), 2, dir.str(), 4);
  CHECK(nn::verify_checkpoint(dir.str()) > 0);
  CHECK(nn::resolve_checkpoint(dir.str()) == (dir.path / "step-00000004").string());
}

namespace {

// A dense 4x3 layer (dtype `dtype`) after one step of `opt`, saved at step 5 into `dir`.
template <class MakeOptimizer>
void save_after_one_step(const TempDir& dir, MakeOptimizer make, DType dtype = DType::f32) {
  LocalCommunicator comm;
  nn::manual_seed(4);
  nn::Linear layer(4, 3, {.dtype = dtype});
  auto opt = make(layer.parameters());
  sum(layer.forward(ones({2, 4}, dtype))).backward();
  for (int i = 0; i < 5; ++i) opt->step();
  nn::save_checkpoint(dir.str(), 5, layer, opt.get(), comm, {}, /*keep=*/0);
}

// Loads `dir` into a fresh layer and the optimizer `make` gives; returns the IOError ("" if none).
template <class MakeOptimizer>
std::string load_with(const TempDir& dir, MakeOptimizer make, DType dtype = DType::f32) {
  LocalCommunicator comm;
  nn::manual_seed(4);
  nn::Linear layer(4, 3, {.dtype = dtype});
  auto opt = make(layer.parameters());
  try {
    nn::load_checkpoint(dir.str(), layer, opt.get(), comm);
  } catch (const IOError& e) {
    return e.what();
  }
  if (opt->steps() != 5) return "loaded, but the optimizer's steps are " + std::to_string(opt->steps());
  return "";
}

auto adamw = [](std::vector<nn::Param> p) { return std::make_unique<nn::AdamW>(std::move(p)); };
auto adam = [](std::vector<nn::Param> p) { return std::make_unique<nn::Adam>(std::move(p)); };
auto sgd = [](std::vector<nn::Param> p) { return std::make_unique<nn::SGD>(std::move(p)); };
auto momentum = [](std::vector<nn::Param> p) {
  return std::make_unique<nn::SGD>(std::move(p), nn::SGDOptions{.momentum = 0.9});
};

}  // namespace

TEST_CASE("the optimizer's kind and state names are checked: an Adam checkpoint no longer loads into SGD") {
  TempDir dir;
  save_after_one_step(dir, adamw);
  const json index = read_json(dir.path / "step-00000005" / "index.json");
  CHECK(index["optimizer"]["kind"] == "AdamW");
  CHECK(load_with(dir, adamw).empty());
  // SGD without momentum keeps no state: the moments were ignored and the step count set.
  check_contains(load_with(dir, sgd), {"step-00000005", "AdamW", "SGD"});
  check_contains(load_with(dir, momentum), {"AdamW", "SGD"});
  // Adam and AdamW keep the same state, but are not the same optimizer.
  check_contains(load_with(dir, adam), {"the AdamW optimizer", "loading it is Adam "});

  // A checkpoint written before the kind was recorded: the state names decide.
  json old = index;
  old["optimizer"].erase("kind");
  old["optimizer"].erase("settings");  // (recorded later than the kind)
  for (auto& [name, p] : old["params"].items()) p.erase("state_dtypes");
  std::ofstream(dir.path / "step-00000005" / "index.json") << test::before_index_checksum(old).dump(1);
  CHECK(load_with(dir, adamw).empty());
  CHECK(load_with(dir, adam).empty());
  check_contains(load_with(dir, sgd), {"exp_avg", "exp_avg_sq", "SGD"});
  check_contains(load_with(dir, momentum), {"exp_avg", "momentum_buffer"});

  // SGD with momentum into SGD without: the momentum is not dropped silently either.
  TempDir with_momentum;
  save_after_one_step(with_momentum, momentum);
  CHECK(load_with(with_momentum, momentum).empty());
  check_contains(load_with(with_momentum, sgd), {"momentum_buffer"});
  check_contains(load_with(with_momentum, adamw), {"SGD", "AdamW"});
  // A damaged kind is refused by every reader.
  json bad = read_json(with_momentum.path / "step-00000005" / "index.json");
  bad["optimizer"]["kind"] = 7;
  std::ofstream(with_momentum.path / "step-00000005" / "index.json") << test::restamped(bad).dump(1);
  test::check_throws<IOError>([&] { nn::verify_checkpoint(with_momentum.str()); }, {"'kind'"});
}

TEST_CASE("the optimizer's settings are checked: a resume continues with the saved betas, eps, decay, momentum") {
  TempDir dir;
  auto adamw_with = [](nn::AdamWOptions o) {
    return [o](std::vector<nn::Param> p) { return std::make_unique<nn::AdamW>(std::move(p), o); };
  };
  save_after_one_step(dir, adamw_with({.weight_decay = 0.1}));
  const json index = read_json(dir.path / "step-00000005" / "index.json");
  CHECK(index["optimizer"]["settings"]["weight_decay"] == 0.1);
  CHECK(index["optimizer"]["settings"]["beta2"] == 0.999);
  CHECK(load_with(dir, adamw_with({.weight_decay = 0.1})).empty());
  // Each setting that differs is refused by name, before anything is loaded (PyTorch's
  // load_state_dict would overwrite it silently; loaded without a word, the run went on with
  // the new one).
  check_contains(load_with(dir, adamw_with({.weight_decay = 0.3})),
                 {"step-00000005", "saved by AdamW with weight_decay 0.1", "this optimizer's is 0.3"});
  check_contains(load_with(dir, adamw_with({.beta2 = 0.5, .weight_decay = 0.1})), {"beta2 0.999", "is 0.5"});
  check_contains(load_with(dir, adamw_with({.eps = 1e-3, .weight_decay = 0.1})), {"eps 1e-08", "is 0.001"});
  // The decay a "decay" group takes from the optimizer (decay_2d_only) is the optimizer's setting:
  // checked too, where a group's own decay always was.
  TempDir grouped;
  auto grouped_with = [](double decay) {
    return [decay](std::vector<nn::Param> p) {
      std::vector<nn::ParamGroup> groups = {{.name = "decay", .params = {p[0]}},
                                            {.name = "no_decay", .params = {p[1]}, .weight_decay = 0.0}};
      return std::make_unique<nn::AdamW>(std::move(groups), nn::AdamWOptions{.weight_decay = decay});
    };
  };
  save_after_one_step(grouped, grouped_with(0.1));
  CHECK(load_with(grouped, grouped_with(0.1)).empty());
  check_contains(load_with(grouped, grouped_with(0.3)), {"weight_decay 0.1", "is 0.3"});
  // SGD's momentum, dampening and Nesterov.
  TempDir sgd_dir;
  auto sgd_with = [](nn::SGDOptions o) {
    return [o](std::vector<nn::Param> p) { return std::make_unique<nn::SGD>(std::move(p), o); };
  };
  save_after_one_step(sgd_dir, sgd_with({.momentum = 0.9}));
  CHECK(load_with(sgd_dir, sgd_with({.momentum = 0.9})).empty());
  check_contains(load_with(sgd_dir, sgd_with({.momentum = 0.5})), {"momentum 0.9", "is 0.5"});
  check_contains(load_with(sgd_dir, sgd_with({.momentum = 0.9, .nesterov = true})), {"nesterov 0", "is 1"});
  check_contains(load_with(sgd_dir, sgd_with({.momentum = 0.9, .dampening = 0.5})), {"dampening 0", "is 0.5"});
  // A checkpoint from before the settings were recorded loads as before; a damaged one is refused.
  json old = index;
  old["optimizer"].erase("settings");
  std::ofstream(dir.path / "step-00000005" / "index.json") << test::restamped(old).dump(1);
  CHECK(load_with(dir, adamw_with({.weight_decay = 0.3})).empty());
  json bad = index;
  bad["optimizer"]["settings"]["eps"] = "small";
  std::ofstream(dir.path / "step-00000005" / "index.json") << test::restamped(bad).dump(1);
  test::check_throws<IOError>([&] { nn::verify_checkpoint(dir.str()); }, {"optimizer setting 'eps'", "\"small\""});
  bad["optimizer"]["settings"] = json::array();
  std::ofstream(dir.path / "step-00000005" / "index.json") << test::restamped(bad).dump(1);
  test::check_throws<IOError>([&] { nn::verify_checkpoint(dir.str()); }, {"optimizer 'settings' must be an object"});
}

TEST_CASE("optimizer state is checked against its dtype: an F64 moment relabelled I64 is refused") {
  TempDir dir;
  save_after_one_step(dir, adamw, DType::f64);
  const fs::path step = dir.path / "step-00000005", file = step / rank_file(0, 1);
  // The same bytes (so the checksums still match) under another dtype of the same size.
  {
    std::vector<std::pair<std::string, Tensor>> tensors;
    std::map<std::string, std::string> metadata;
    {
      safetensors::Reader reader(file.string());
      metadata = reader.metadata();
      for (const auto& t : reader.tensors()) {
        Tensor value = reader.read(t.name);
        if (t.name == "optim/weight/exp_avg") {
          Tensor relabelled = empty(value.shape(), DType::i64);
          std::memcpy(relabelled.data_ptr(), value.data_ptr(), value.nbytes());
          value = relabelled;
        }
        tensors.emplace_back(t.name, value);
      }
    }
    fs::remove(file);
    safetensors::write(file.string(), tensors, metadata);
  }
  test::check_throws<IOError>([&] { nn::verify_checkpoint(dir.str()); },
                              {rank_file(0, 1), "optim/weight/exp_avg", "I64", "f64"});
  check_contains(load_with(dir, adamw, DType::f64), {rank_file(0, 1), "optim/weight/exp_avg", "I64", "f64"});
  // An index from before the dtypes were recorded: the load still checks against the optimizer's.
  json old = read_json(step / "index.json");
  for (auto& [name, p] : old["params"].items()) p.erase("state_dtypes");
  std::ofstream(step / "index.json") << test::before_index_checksum(old).dump(1);
  check_contains(load_with(dir, adamw, DType::f64), {"optim/weight/exp_avg", "I64", "f64"});
}

TEST_CASE("a step saved again keeps its old files until the new index replaces the old one") {
  TempDir dir;
  save_layer(dir, 2, 3);
  const fs::path step = dir.path / "step-00000003";
  const std::string old_index = file_text(step / "index.json");
  // Rank 1 fails to write its new file (a directory where it goes: the old temporary name, and the
  // name beside the old file a rewrite uses). The save used to remove the index first and rank 0
  // to replace its file: the step was lost. Now the failed save leaves it as it was.
  fs::create_directories(step / (rank_file(1, 2) + ".tmp"));
  fs::create_directories(step / "rank-00001-of-00002.b.safetensors");
  CHECK_THROWS_AS(save_layer(dir, 2, 3), IOError);
  CHECK(file_text(step / "index.json") == old_index);
  CHECK(nn::verify_checkpoint(dir.str()) > 0);
  for (const auto& e : load_layer(dir, 2)) CHECK(e.empty());
  CHECK(nn::resolve_checkpoint(dir.str()) == step.string());
  // (What the successful rank wrote is gone: no file but the index's, and the planted directories.)
  CHECK(names_in(step) == std::set<std::string>{"index.json", rank_file(0, 2), rank_file(1, 2),
                                                rank_file(1, 2) + ".tmp", "rank-00001-of-00002.b.safetensors"});
  fs::remove_all(step / (rank_file(1, 2) + ".tmp"));
  fs::remove_all(step / "rank-00001-of-00002.b.safetensors");
  // Saved again successfully: the new files, under the names the new index gives, and nothing else.
  save_layer(dir, 2, 3);
  const json index = read_json(step / "index.json");
  const std::set<std::string> listed(index["files"].begin(), index["files"].end());
  std::set<std::string> expected = listed;
  expected.insert("index.json");
  CHECK(names_in(step) == expected);
  CHECK(listed == std::set<std::string>{"rank-00000-of-00002.b.safetensors", "rank-00001-of-00002.b.safetensors"});
  CHECK(nn::verify_checkpoint(dir.str()) > 0);
  for (const auto& e : load_layer(dir, 3)) CHECK(e.empty());
  // Once more: back to the plain names. At another world size: its own names, the old files removed.
  save_layer(dir, 2, 3);
  CHECK(names_in(step) == std::set<std::string>{"index.json", rank_file(0, 2), rank_file(1, 2)});
  save_layer(dir, 3, 3);
  CHECK(names_in(step) == std::set<std::string>{"index.json", rank_file(0, 3), rank_file(1, 3), rank_file(2, 3)});
  for (const auto& e : load_layer(dir, 2)) CHECK(e.empty());
}

TEST_CASE("bad save and split arguments are refused before anything is written") {
  TempDir dir;
  save_layer(dir, 2, 1);
  const std::string before = file_text(dir.path / "latest");
  auto save_into = [&](const std::string& where, std::int64_t step, std::map<std::string, std::string> extra,
                       int keep) {
    run_ranks(2, [&](Communicator& comm) {
      auto layer = make_layer(comm);
      nn::save_checkpoint(where, step, *layer, nullptr, comm, extra, keep);
    });
  };
  auto save = [&](std::int64_t step, std::map<std::string, std::string> extra, int keep) {
    save_into(dir.str(), step, std::move(extra), keep);
  };
  const std::set<std::string> entries = names_in(dir.path);
  // A negative step (its directory, step--0000001, was written in full and never cleaned).
  test::check_throws<IOError>([&] { save(-1, {}, 2); }, {"step", "-1"});
  test::check_throws<IOError>([&] { save(INT64_MAX, {}, 2); }, {"step", "2^53", "9223372036854775807"});
  // Extra state the index cannot hold (not UTF-8): found only when the index was written, after
  // every rank file, the step's old index already removed.
  test::check_throws<IOError>([&] { save(2, {{"note", "\xff\xfe"}}, 2); }, {"extra", "note"});
  test::check_throws<IOError>([&] { save(1, {{"\xff", "x"}}, 2); }, {"extra"});
  // A negative keep (it kept every step, as 0 does: documented is 0 only).
  test::check_throws<IOError>([&] { save(2, {}, -1); }, {"keep", "-1"});
  CHECK(names_in(dir.path) == entries);
  CHECK(file_text(dir.path / "latest") == before);
  CHECK(nn::verify_checkpoint(dir.str()) > 0);
  for (const auto& e : load_layer(dir, 2)) CHECK(e.empty());

  // Split: a world size no index may have, before a single one of its files.
  const std::string full = (dir.path / "full.safetensors").string();
  nn::consolidate_checkpoint(dir.str(), full);
  const fs::path out = dir.path / "out";
  test::check_throws<IOError>([&] { nn::split_checkpoint(full, (1 << 24) + 1, out.string()); },
                              {"world size", "16777217"});
  test::check_throws<IOError>([&] { nn::split_checkpoint(full, 2, out.string(), -1); }, {"step", "-1"});
  CHECK_FALSE(fs::exists(out));

  // Empty names: refused before anything is read or written (consolidate wrote ".tmp" in the
  // working directory, then failed to rename it). Run from inside the temporary directory.
  const fs::path cwd = fs::current_path();
  TempDir here;
  fs::current_path(here.path);
  CHECK_THROWS_WITH_AS(nn::consolidate_checkpoint(dir.str(), ""), doctest::Contains("not a file name"), IOError);
  CHECK_THROWS_WITH_AS(nn::consolidate_checkpoint((dir.path / "nothing").string(), ""),
                       doctest::Contains("not a file name"), IOError);  // up front: before the checkpoint
  CHECK_THROWS_AS(nn::split_checkpoint(full, 2, ""), IOError);
  CHECK_THROWS_AS(save_into("", 2, {}, 2), IOError);
  CHECK(names_in(here.path).empty());
  fs::current_path(cwd);
}
