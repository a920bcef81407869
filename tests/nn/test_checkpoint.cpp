// Sharded checkpoints: resume equals uninterrupted training (bitwise at the same world size),
// resharding to other world sizes, partial reads, atomicity, and clear errors on bad files.
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <csignal>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "helpers.h"
#include "index_edit.h"
#include "sharded_fixture.h"

using namespace ruda;
using test::TempDir;
namespace fs = std::filesystem;

namespace {

// Trains TinyLM fully sharded over comm for steps [from, to), optionally loading a checkpoint
// first and saving one at the end; returns every step's global loss and the final parameters.
// With `grouped`, the optimizer decays only the 2-D weights (nn::decay_2d_only).
test::TrainResult train(Communicator& comm, int from, int to, const std::string& load_from, const std::string& save_to,
                        std::uint64_t* bytes_read = nullptr, bool grouped = false) {
  nn::manual_seed(7);
  test::TinyLM model;
  nn::fully_shard(model, comm);
  auto options = test::adam_options();
  if (grouped) options.weight_decay = 0.5;  // large, so that which parameters decay shows
  nn::AdamW opt = grouped ? nn::AdamW(nn::decay_2d_only(model), options) : nn::AdamW(model.parameters(), options);
  if (!load_from.empty()) {
    const auto info = nn::load_checkpoint(load_from, model, &opt, comm);
    if (info.step != from) throw std::runtime_error("loaded step " + std::to_string(info.step));
    if (bytes_read) *bytes_read = info.bytes_read;
  }
  test::TrainResult r;
  const int world = comm.world_size();
  const double count = static_cast<double>(test::kBatch * test::kTime);
  for (int step = from; step < to; ++step) {
    const Tensor loss = model.loss_sum(test::part(test::batch_tokens(step), comm.rank(), world),
                                       test::part(test::batch_targets(step), comm.rank(), world), true) /
                        count;
    r.losses.push_back(comm.all_reduce(loss.detach()).item());
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  if (!save_to.empty()) nn::save_checkpoint(save_to, to, model, &opt, comm, {{"model", "tiny"}});
  r.params = test::snapshot(model);
  return r;
}

template <class F>
test::TrainResult rank0(int world, F fn) {
  test::TrainResult out;
  std::mutex m;
  run_ranks(world, [&](Communicator& comm) {
    auto r = fn(comm);
    if (comm.rank() == 0) {
      std::lock_guard lock(m);
      out = std::move(r);
    }
  });
  return out;
}

// Two f64 layers, and steps [from, to) of training them where the second has no gradient in step 0
// (the loss reads only the first layer then): a parameter with its own, shorter step count.
nn::Sequential two_layers(std::uint64_t seed) {
  nn::manual_seed(seed);
  return nn::Sequential({std::make_shared<nn::Linear>(4, 3, nn::LinearOptions{.dtype = DType::f64}),
                         std::make_shared<nn::Linear>(3, 2, nn::LinearOptions{.dtype = DType::f64})});
}
void train_two_layers(nn::Sequential& model, nn::Optimizer& opt, int from, int to) {
  for (int step = from; step < to; ++step) {
    opt.zero_grad();
    const Tensor h = model[0]->forward(ones({2, 4}, DType::f64));
    sum(square(step == 0 ? h : model[1]->forward(h))).backward();
    opt.step();
  }
}

// A backbone (layer 0) and a head (layer 1) for the fine-tuning tests, and steps [from, to) of
// training them on draws data_seed + step (whichever parameters require grad).
nn::Sequential backbone_and_head(std::uint64_t seed) {
  nn::manual_seed(seed);
  return nn::Sequential({std::make_shared<nn::Linear>(64, 64), std::make_shared<nn::Linear>(64, 2)});
}
void train_on_squares(nn::Sequential& m, nn::Optimizer& opt, int from, int to, std::uint64_t data_seed) {
  for (int i = from; i < to; ++i) {
    const Tensor loss = sum(square(m.forward(randn({4, 64}, data_seed + static_cast<std::uint64_t>(i)))));
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
}

test::TrainResult concat(const test::TrainResult& a, const test::TrainResult& b) {
  test::TrainResult out = b;
  out.losses.insert(out.losses.begin(), a.losses.begin(), a.losses.end());
  return out;
}

}  // namespace

TEST_CASE("a path with a NUL character is refused, shown with the NUL, and writes nothing at the cut path") {
  TempDir dir;
  const std::string cut = dir.str() + "/q";
  const std::string nul = cut + std::string("\0z", 2);
  const std::string shown = cut + "\\0z";
  // safetensors::write("/d/q\0z") wrote /d/q; save_checkpoint's errors ended at the NUL.
  test::check_throws<IOError>([&] { safetensors::write(nul, {{"a", ones({2})}}); }, {shown, "NUL character"});
  test::check_throws<IOError>([&] { safetensors::Writer(nul, {{"a", DType::f32, {2}}}); }, {shown, "NUL"});
  test::check_throws<IOError>([&] { safetensors::Reader reader(nul); }, {shown, "NUL"});
  LocalCommunicator comm;
  nn::Linear layer(2, 2);
  test::check_throws<IOError>([&] { nn::save_checkpoint(nul, 1, layer, nullptr, comm); },
                              {"checkpoint " + shown, "NUL"});
  test::check_throws<IOError>([&] { nn::load_checkpoint(nul, layer, nullptr, comm); }, {shown});
  CHECK_FALSE(std::filesystem::exists(cut));
}

TEST_CASE("the ranks must save one checkpoint: another directory, step or model on one rank is refused on all") {
  TempDir dir;
  std::atomic<int> refused{0};
  run_ranks(2, [&](Communicator& comm) {
    const int r = comm.rank();
    auto model = std::make_shared<nn::Linear>(4, r == 1 ? 3 : 2);  // rank 1's model differs below
    const auto same = std::make_shared<nn::Linear>(4, 2);
    // Each rank wrote its own directory (or step) and rank 0 published an index naming a rank 1
    // file that no rank had written.
    test::check_throws<IOError>(
        [&] { nn::save_checkpoint(dir.str() + "/r" + std::to_string(r), 1, *same, nullptr, comm); },
        {"different places", "rank 1", "every rank must save the same checkpoint"});
    test::check_throws<IOError>([&] { nn::save_checkpoint(dir.str(), 1 + r, *same, nullptr, comm); },
                                {"different places", "step"});
    // Different parameters: only rank 0's were saved.
    test::check_throws<IOError>([&] { nn::save_checkpoint(dir.str(), 1, *model, nullptr, comm); },
                                {"different models", "rank 1", "parameters"});
    ++refused;
    // Nothing was published, and the same checkpoint on both ranks still saves.
    CHECK(nn::save_checkpoint(dir.str(), 5, *same, nullptr, comm).step == 5);
  });
  CHECK(refused == 2);
  CHECK(std::filesystem::exists(dir.path / "step-00000005" / "index.json"));
  CHECK_FALSE(std::filesystem::exists(dir.path / "step-00000001"));
  CHECK_FALSE(std::filesystem::exists(dir.path / "r0"));
}

TEST_CASE("the ranks must save with one optimizer: another kind, setting, group or rate on one rank is refused") {
  // Rank 1's state was recorded as rank 0's kind, groups and rate, without a word.
  TempDir dir;
  std::atomic<int> refused{0};
  run_ranks(2, [&](Communicator& comm) {
    const int r = comm.rank();
    nn::manual_seed(5);
    nn::Sequential model({std::make_shared<nn::Linear>(4, 4), std::make_shared<nn::Linear>(4, 2)});
    nn::fully_shard(model, comm);
    nn::Adam adam(model.parameters(), {.lr = 1e-3});
    nn::AdamW adamw(model.parameters(), {.lr = 1e-3});
    nn::Adam other_beta(model.parameters(), {.lr = 1e-3, .beta2 = r == 1 ? 0.99 : 0.999});
    nn::Adam other_rate(model.parameters(), {.lr = r == 1 ? 0.5 : 1e-3});
    nn::AdamW grouped(nn::decay_2d_only(model), {.lr = 1e-3});
    nn::Optimizer* kind = r == 0 ? static_cast<nn::Optimizer*>(&adam) : &adamw;
    nn::Optimizer* groups = r == 0 ? static_cast<nn::Optimizer*>(&adamw) : &grouped;
    for (nn::Optimizer* opt :
         {kind, groups, static_cast<nn::Optimizer*>(&other_beta), static_cast<nn::Optimizer*>(&other_rate)}) {
      test::check_throws<IOError>([&] { nn::save_checkpoint(dir.str(), 1, model, opt, comm); },
                                  {"different models", "rank 1", "another optimizer", "Adam"});
    }
    ++refused;
    CHECK(nn::save_checkpoint(dir.str(), 2, model, &adam, comm).step == 2);
  });
  CHECK(refused == 2);
  CHECK_FALSE(std::filesystem::exists(dir.path / "step-00000001"));
}

TEST_CASE("a checkpoint the index shows does not fit is refused before anything is loaded, optimizer included") {
  TempDir dir;
  nn::manual_seed(1);
  nn::Sequential saved({std::make_shared<nn::Linear>(2, 4), std::make_shared<nn::Linear>(4, 2)});
  nn::AdamW saved_opt(saved.parameters());
  LocalCommunicator comm;
  saved_opt.zero_grad();
  sum(square(saved.forward(ones({2, 2})))).backward();
  saved_opt.step();  // (a parameter that has taken no step has no state to save)
  nn::save_checkpoint(dir.str(), 1, saved, &saved_opt, comm);
  // The same first layer, another second one: the first layer's values and moments were loaded
  // before the second's mismatch was found, the step count was not.
  nn::manual_seed(2);
  nn::Sequential model({std::make_shared<nn::Linear>(2, 4), std::make_shared<nn::Linear>(4, 3)});
  nn::AdamW opt(model.parameters());
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    sum(square(model.forward(ones({2, 2})))).backward();
    opt.step();
  }
  auto snapshot = [&] {
    std::vector<std::vector<double>> out;
    for (const nn::Param& p : model.parameters()) {
      out.push_back(p.data().to_vector<double>());
      for (const auto& [name, t] : opt.state(p)) out.push_back(t.to_vector<double>());
    }
    return out;
  };
  const auto before = snapshot();
  test::check_throws<IOError>([&] { nn::load_checkpoint(dir.str(), model, &opt, comm); },
                              {"parameter '1.weight'", "[4, 2] in the checkpoint but [4, 3]"});
  CHECK(snapshot() == before);
  CHECK(opt.steps() == 3);
  // A state dtype the index shows differs: refused before anything is loaded, too.
  nn::manual_seed(3);
  nn::Sequential same({std::make_shared<nn::Linear>(2, 4), std::make_shared<nn::Linear>(4, 2)});
  nn::AdamW same_opt(same.parameters());
  const auto first = same.parameters()[0].data().to_vector<double>();
  {
    const fs::path index = dir.path / "step-00000001" / "index.json";
    std::ifstream in(index);
    nlohmann::json j = nlohmann::json::parse(in);
    in.close();
    for (auto& [state, dtype] : j["params"]["1.weight"]["state_dtypes"].items()) dtype = "f64";  // the second layer's
    std::ofstream(index) << test::restamped(j).dump(1);
  }
  CHECK_THROWS_AS(nn::load_checkpoint(dir.str(), same, &same_opt, comm), IOError);
  CHECK(same.parameters()[0].data().to_vector<double>() == first);
  // A parameter more or fewer is named, as a renamed one is (it said only "holds 4 parameters,
  // the model has 3").
  nn::Sequential fewer(
      {std::make_shared<nn::Linear>(2, 4), std::make_shared<nn::Linear>(4, 2, nn::LinearOptions{.bias = false})});
  test::check_throws<IOError>([&] { nn::load_checkpoint(dir.str(), fewer, nullptr, comm); },
                              {"holds 4 parameters, the model has 3", "the model has no parameter '1.bias'"});
  nn::Sequential more(
      {std::make_shared<nn::Linear>(2, 4), std::make_shared<nn::Linear>(4, 2), std::make_shared<nn::Linear>(2, 2)});
  test::check_throws<IOError>([&] { nn::load_checkpoint(dir.str(), more, nullptr, comm); },
                              {"holds 4 parameters, the model has 6", "it has no parameter '2.weight'"});
}

TEST_CASE("one save at a time into a checkpoint directory; none into a step directory or inside one") {
  TempDir dir;
  nn::manual_seed(1);
  nn::Linear layer(3, 2);
  LocalCommunicator comm;
  // Another process saving there holds the directory's lock: refused, nothing written.
  {
    std::filesystem::create_directories(dir.path);
    const int fd = ::open((dir.path / ".ruda-save.lock").c_str(), O_RDWR | O_CREAT, 0644);
    REQUIRE(fd >= 0);
    REQUIRE(::flock(fd, LOCK_EX) == 0);
    test::check_throws<IOError>([&] { nn::save_checkpoint(dir.str(), 1, layer, nullptr, comm); },
                                {dir.str(), "another save into this checkpoint directory is running"});
    ::close(fd);
  }
  CHECK_FALSE(std::filesystem::exists(dir.path / "step-00000001"));
  CHECK(nn::save_checkpoint(dir.str(), 1, layer, nullptr, comm).step == 1);
  // Two threads saving into one directory at once: each save either completes or is refused by
  // name, and what is published loads (the saves used to remove each other's files and publish
  // indexes naming files the other had replaced).
  std::atomic<int> done{0}, busy{0};
  std::vector<std::thread> savers;
  for (int t = 0; t < 2; ++t) {
    savers.emplace_back([&, t] {
      LocalCommunicator own;
      for (int i = 0; i < 20; ++i) {
        try {
          nn::save_checkpoint(dir.str(), 10 + t * 100 + i, layer, nullptr, own);
          ++done;
        } catch (const IOError& e) {
          if (std::string(e.what()).find("another save") == std::string::npos) throw;
          ++busy;
        }
      }
    });
  }
  for (auto& s : savers) s.join();
  CHECK(done + busy == 40);
  CHECK(done > 0);
  nn::Linear back(3, 2);
  nn::load_checkpoint(dir.str(), back, nullptr, comm);
  CHECK(back.weight.data().to_vector<float>() == layer.weight.data().to_vector<float>());
  // A step directory, and any place inside one, is no checkpoint directory: a checkpoint there
  // was hidden behind the step (readers take a directory with an index.json for the step).
  const std::string step = nn::resolve_checkpoint(dir.str());
  for (const std::string& inner : {step, step + "/nested", step + "/a/b"}) {
    CAPTURE(inner);
    CHECK_THROWS_AS(nn::save_checkpoint(inner, 3, layer, nullptr, comm), IOError);
    CHECK_FALSE(std::filesystem::exists(inner + "/step-00000003"));
  }
  test::check_throws<IOError>([&] { nn::save_checkpoint(step, 3, layer, nullptr, comm); },
                              {"holds an index.json, so readers take it for a checkpoint step"});
  test::check_throws<IOError>([&] { nn::save_checkpoint(step + "/a/b", 3, layer, nullptr, comm); },
                              {"lies inside the step directory", step});
  // An index.json of a project's own higher up is no checkpoint step: nothing reads upward.
  std::filesystem::create_directories(dir.path / "project" / "runs");
  std::ofstream(dir.path / "project" / "index.json") << "{}";
  CHECK(nn::save_checkpoint((dir.path / "project" / "runs" / "ck").string(), 1, layer, nullptr, comm).step == 1);
}

TEST_CASE("the ranks must load one checkpoint: another step, model or optimizer on one rank is refused on all") {
  TempDir dir;
  std::atomic<int> refused{0};
  run_ranks(2, [&](Communicator& comm) {
    const int r = comm.rank();
    nn::manual_seed(5);
    auto layer = std::make_shared<nn::Linear>(8, 4);
    nn::fully_shard(*layer, comm);
    nn::SGD opt(layer->parameters(), {.lr = 0.1});
    nn::save_checkpoint(dir.str(), 1, *layer, &opt, comm, {}, /*keep=*/0);
    sum(layer->forward(ones({2, 8}))).backward();
    opt.step();
    nn::save_checkpoint(dir.str(), 2, *layer, &opt, comm, {}, /*keep=*/0);
    const std::vector<float> saved = layer->parameters()[0].value().to_vector<float>();
    // Rank 0 reads step 1 and rank 1 step 2 (as with `latest` read before and after a save moved
    // it): each loaded its own slices, one model of two checkpoints, without a word.
    const std::string mine = (dir.path / (r == 0 ? "step-00000001" : "step-00000002")).string();
    test::check_throws<IOError>([&] { nn::load_checkpoint(mine, *layer, &opt, comm); },
                                {"the ranks load different checkpoints", "rank 1 read step 2", "rank 0 read step 1",
                                 "every rank must load the same checkpoint"});
    // An optimizer on one rank only.
    test::check_throws<IOError>([&] { nn::load_checkpoint(dir.str(), *layer, r == 0 ? &opt : nullptr, comm); },
                                {"the ranks load into different models", "rank 1"});
    ++refused;
    // Nothing was loaded: the model is as it was, and the same checkpoint on both ranks loads,
    // also through a path of its own on each rank (the index's text decides, not the path).
    CHECK(layer->parameters()[0].value().to_vector<float>() == saved);
    const std::string own = r == 0 ? dir.str() : (dir.path / "step-00000002").string();
    CHECK(nn::load_checkpoint(own, *layer, &opt, comm).step == 2);
  });
  CHECK(refused == 2);
}

TEST_CASE("resume equals uninterrupted training, bit for bit, at the same world size") {
  TempDir dir;
  const auto whole = rank0(3, [&](Communicator& c) { return train(c, 0, 6, "", ""); });
  const auto first = rank0(3, [&](Communicator& c) { return train(c, 0, 3, "", dir.str()); });
  const auto second = rank0(3, [&](Communicator& c) { return train(c, 3, 6, dir.str(), ""); });
  const auto [score, where] = test::compare(concat(first, second), whole, 0, 0);
  CHECK_MESSAGE(score == 0, "differs at " << where);
}

TEST_CASE("optimizer groups: saved and restored, resumes continue, and a resume with other groups is refused") {
  TempDir dir;
  auto run = [&](int world, int from, int to, const std::string& load, const std::string& save, bool grouped) {
    return rank0(world, [&](Communicator& c) { return train(c, from, to, load, save, nullptr, grouped); });
  };
  const auto whole = run(3, 0, 6, "", "", true);
  const auto plain = run(3, 0, 6, "", "", false);
  CHECK(test::compare(whole, plain, 0, 0).first > 0);  // the groups change the run
  const auto first = run(3, 0, 3, "", dir.str(), true);
  // The index records each group's settings and parameters by name (logical shapes decide).
  std::ifstream in(dir.path / "step-00000003" / "index.json");
  const std::string index((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(index.find("\"no_decay\"") != std::string::npos);
  CHECK(index.find("\"block.ln1.weight\"") != std::string::npos);
  // Same world size: bit for bit; another: within the summation order's noise.
  const auto second = run(3, 3, 6, dir.str(), "", true);
  const auto [same, where] = test::compare(concat(first, second), whole, 0, 0);
  CHECK_MESSAGE(same == 0, where);
  const auto resharded = run(2, 3, 6, dir.str(), "", true);
  CHECK(test::compare(concat(first, resharded), whole, 1e-5, 1e-5).first <= 1);
  // Other groups than the checkpoint's: refused before anything is loaded.
  test::check_throws<IOError>([&] { run(3, 3, 6, dir.str(), "", false); },
                              {"step-00000003", "was saved with the optimizer groups decay (", "no_decay (",
                               "weight decay 0)", "this optimizer's are default ("});
  // A checkpoint written before groups existed holds one group of every parameter (and no
  // settings, which came later).
  nlohmann::json j = nlohmann::json::parse(index);
  j["optimizer"].erase("groups");
  j["optimizer"].erase("settings");
  std::ofstream(dir.path / "step-00000003" / "index.json") << test::restamped(j).dump(1);
  test::check_throws<IOError>([&] { run(3, 3, 6, dir.str(), "", true); },
                              {"was saved with the optimizer groups default ("});
  CHECK_NOTHROW(run(3, 3, 4, dir.str(), "", false));
  // A damaged groups entry is refused by name.
  j["optimizer"]["groups"] = nlohmann::json::array(
      {{{"name", "g"}, {"lr_scale", -1}, {"weight_decay", nullptr}, {"params", nlohmann::json::array()}}});
  std::ofstream(dir.path / "step-00000003" / "index.json") << test::restamped(j).dump(1);
  test::check_throws<IOError>([&] { run(3, 3, 4, dir.str(), "", false); }, {"optimizer group 'g'", "lr_scale"});
}

TEST_CASE("a resume whose optimizer lists the same parameters in another order loads; other members are named") {
  // Compared in order, the same two parameters given as {weight, bias} against the saved
  // {bias, weight} were refused, with two descriptions that read the same.
  TempDir dir;
  LocalCommunicator comm;
  nn::manual_seed(2);
  nn::Linear model(4, 3);
  nn::AdamW saved_by({model.bias, model.weight}, {.lr = 1e-2});
  sum(square(model.forward(randn({2, 4}, 1)))).backward();
  saved_by.step();
  (void)nn::save_checkpoint(dir.str(), 1, model, &saved_by, comm);
  nn::AdamW reordered({model.weight, model.bias}, {.lr = 1e-2});
  CHECK_NOTHROW(nn::load_checkpoint(dir.str(), model, &reordered, comm));
  CHECK(reordered.state(model.weight)[0].second.to_vector<float>() ==
        saved_by.state(model.weight)[0].second.to_vector<float>());
  // A group with another parameter is refused, naming the members.
  nn::AdamW weight_only({model.weight}, {.lr = 1e-2});
  test::check_throws<IOError>([&] { (void)nn::load_checkpoint(dir.str(), model, &weight_only, comm); },
                              {"was saved with the optimizer groups default (2 parameters: 'bias', 'weight';",
                               "this optimizer's are default (1 parameter: 'weight';"});
}

namespace {
// AdamW handing out its moments in the parameter's dtype: what Adam kept, and checkpoints hold,
// from before a 16-bit parameter's moments were f32 (Adam::moment_dtype).
class AdamWWithNarrowMoments : public nn::AdamW {
 public:
  using nn::AdamW::AdamW;
  std::vector<std::pair<std::string, Tensor>> state(const nn::Param& p) override {
    auto state = nn::AdamW::state(p);
    for (auto& [name, t] : state) t = t.to(p.data().dtype());
    return state;
  }
};

nlohmann::json read_index(const fs::path& index) {
  std::ifstream in(index);
  return nlohmann::json::parse(in);
}
}  // namespace

TEST_CASE("a bf16 parameter's moments are saved in f32, and older checkpoints' bf16 moments load widened") {
  TempDir dir;
  LocalCommunicator comm;
  nn::manual_seed(3);
  nn::Linear model(4, 3, {.dtype = DType::bf16});
  const auto train = [&model](nn::AdamW& opt) {
    for (std::uint64_t step = 0; step < 2; ++step) {
      opt.zero_grad();
      sum(square(model.forward(randn({3, 4}, 10 + step).to(DType::bf16)))).backward();
      opt.step();
    }
  };
  std::vector<Tensor> start;
  for (const nn::Param& p : model.parameters()) start.push_back(p.data().detach().clone());
  const auto restart = [&] {
    autograd::NoGradGuard no_grad;
    for (std::size_t i = 0; i < start.size(); ++i) model.parameters()[i].data().copy_(start[i]);
  };
  nn::AdamW opt(model.parameters(), {.lr = 1e-2});
  train(opt);
  const std::string now = (dir.path / "now").string(), before = (dir.path / "before").string();
  (void)nn::save_checkpoint(now, 2, model, &opt, comm);
  CHECK(read_index(dir.path / "now" / "step-00000002" / "index.json")["params"]["weight"]["state_dtypes"] ==
        nlohmann::json{{"exp_avg", "f32"}, {"exp_avg_sq", "f32"}});
  // The same two steps again, saved as before: bf16 moments.
  restart();
  AdamWWithNarrowMoments narrow(model.parameters(), {.lr = 1e-2});
  train(narrow);
  (void)nn::save_checkpoint(before, 2, model, &narrow, comm);
  const fs::path index = dir.path / "before" / "step-00000002" / "index.json";
  CHECK(read_index(index)["params"]["weight"]["state_dtypes"]["exp_avg_sq"] == "bf16");
  // Recorded as bf16 (version 5), or not recorded (version 4 and older, where every state had
  // its parameter's dtype): each loads into the f32 moments as the bf16 values widened.
  for (bool recorded : {true, false}) {
    CAPTURE(recorded);
    if (!recorded) {
      nlohmann::json j = read_index(index);
      for (auto& [name, p] : j["params"].items()) p.erase("state_dtypes");
      j["version"] = 4;
      std::ofstream(index) << test::restamped(j).dump(1);
    }
    restart();
    nn::AdamW resumed(model.parameters(), {.lr = 1e-2});
    (void)nn::load_checkpoint(before, model, &resumed, comm);
    for (const nn::Param& p : model.parameters()) {
      for (std::size_t s = 0; s < 2; ++s) {
        const Tensor loaded = resumed.state(p)[s].second, kept = opt.state(p)[s].second;
        CHECK(loaded.dtype() == DType::f32);
        CHECK(loaded.to_vector<float>() == kept.to(DType::bf16).to_vector<float>());
        CHECK(loaded.to_vector<float>() != kept.to_vector<float>());  // (rounded: not the f32 ones)
      }
    }
    CHECK(resumed.steps_of(model.weight) == 2);
  }
  // Narrowing is refused: f32 moments into an optimizer whose state is bf16.
  AdamWWithNarrowMoments narrow_again(model.parameters(), {.lr = 1e-2});
  test::check_throws<IOError>([&] { (void)nn::load_checkpoint(now, model, &narrow_again, comm); },
                              {"optimizer state 'exp_avg' of parameter", "f32 in the checkpoint but bf16"});
}

TEST_CASE("a parameter the optimizer does not update has no state: none kept or saved, fresh when unfrozen") {
  // Fine-tuning a head on a frozen backbone: saving made zero moments for the backbone, kept them
  // for the optimizer's lifetime and wrote them into every checkpoint (3x the backbone's bytes).
  TempDir dir;
  LocalCommunicator comm;
  auto make = [] { return backbone_and_head(3); };
  auto train = [](nn::Sequential& m, nn::Optimizer& opt, int from, int to) { train_on_squares(m, opt, from, to, 10); };
  nn::Sequential model = make();
  nn::AdamW head(model[1]->parameters());
  train(model, head, 0, 2);
  const std::int64_t live = memory::stats().live_bytes;
  nn::save_checkpoint(dir.str(), 2, model, &head, comm);
  CHECK(memory::stats().live_bytes == live);  // no state made for the backbone
  test::check_throws<ArgumentError>([&] { (void)head.state(model[0]->parameters()[0]); },
                                    {"Adam::state", "not one this optimizer updates"});
  std::ifstream in(dir.path / "step-00000002" / "index.json");
  const nlohmann::json index = nlohmann::json::parse(in);
  CHECK(index["params"]["0.weight"]["optimized"] == false);
  CHECK_FALSE(index["params"]["0.weight"].contains("state_dtypes"));
  CHECK(index["params"]["1.weight"].contains("state_dtypes"));
  std::set<std::string> stored;
  const safetensors::Reader file((dir.path / "step-00000002" / "rank-00000-of-00001.safetensors").string());
  for (const auto& t : file.tensors()) stored.insert(t.name);
  CHECK(stored == std::set<std::string>{"model/0.weight", "model/0.bias", "model/1.weight", "model/1.bias",
                                        "optim/1.weight/exp_avg", "optim/1.weight/exp_avg_sq", "optim/1.bias/exp_avg",
                                        "optim/1.bias/exp_avg_sq"});
  CHECK(nn::verify_checkpoint(dir.str()) > 0);
  // Resumed head-only, the run continues as it trains straight through.
  nn::Sequential straight = make();
  nn::AdamW straight_head(straight[1]->parameters());
  train(straight, straight_head, 0, 4);
  nn::Sequential resumed = make();
  nn::AdamW resumed_head(resumed[1]->parameters());
  nn::load_checkpoint(dir.str(), resumed, &resumed_head, comm);
  train(resumed, resumed_head, 2, 4);
  CHECK(test::snapshot(resumed) == test::snapshot(straight));
  // Loaded by an optimizer of every parameter (the backbone unfrozen): the backbone starts
  // afresh, with zero state and its own count at 0; the head continues.
  nn::Sequential unfrozen = make();
  nn::AdamW all(unfrozen.parameters());
  train(unfrozen, all, 0, 1);  // state of its own, which the load must reset
  nn::load_checkpoint(dir.str(), unfrozen, &all, comm);
  CHECK(all.steps_of(unfrozen[0]->parameters()[0]) == 0);
  CHECK(all.steps_of(unfrozen[1]->parameters()[0]) == 2);
  for (const auto& [name, t] : all.state(unfrozen[0]->parameters()[0])) {
    CAPTURE(name);
    CHECK(sum(abs(t)).item() == 0);
  }
  // An optimizer of a parameter the module does not hold: refused before any file is written.
  nn::Param outside(zeros({3}));
  auto params = model.parameters();
  params.push_back(outside);
  nn::AdamW stray(params);
  test::check_throws<IOError>([&] { nn::save_checkpoint(dir.str(), 3, model, &stray, comm); },
                              {"the optimizer updates a parameter [3]", "the module does not hold"});
  CHECK_FALSE(fs::exists(dir.path / "step-00000003"));
}

TEST_CASE("an optimizer of every parameter, the backbone frozen: no state made or saved for it, none before a step") {
  // PyTorch's usual fine-tuning, AdamW(model.parameters()) with the backbone's requires_grad off:
  // saving asked the optimizer for every parameter's state, which made zero moments for the
  // backbone, kept them for the optimizer's lifetime and wrote them to every checkpoint (and a
  // save before the first step made them for every parameter). PyTorch's state_dict has none.
  TempDir dir;
  LocalCommunicator comm;
  auto make = [] { return backbone_and_head(4); };
  auto freeze = [](nn::Sequential& m, bool frozen) {
    for (const nn::Param& p : m[0]->parameters()) p.data().set_requires_grad(!frozen);
  };
  auto train = [](nn::Sequential& m, nn::Optimizer& opt, int from, int to) { train_on_squares(m, opt, from, to, 20); };
  auto step_dir = [&](int step) { return (dir.path / ("step-0000000" + std::to_string(step))).string(); };
  nn::Sequential model = make();
  freeze(model, true);
  nn::AdamW opt(model.parameters());
  const nn::Param backbone = model[0]->parameters()[0], head = model[1]->parameters()[0];
  std::int64_t live = memory::stats().live_bytes;
  nn::save_checkpoint(dir.str(), 0, model, &opt, comm);  // before any step: no state at all
  CHECK(memory::stats().live_bytes == live);
  CHECK_FALSE(opt.has_state(head));
  train(model, opt, 0, 2);
  CHECK(opt.has_state(head));
  live = memory::stats().live_bytes;
  nn::save_checkpoint(dir.str(), 2, model, &opt, comm);
  CHECK(memory::stats().live_bytes == live);  // none made for the backbone
  CHECK_FALSE(opt.has_state(backbone));
  const nlohmann::json index = nlohmann::json::parse(std::ifstream(step_dir(2) + "/index.json"));
  CHECK(index["version"] == 5);
  CHECK_FALSE(index["params"]["0.weight"].contains("optimized"));  // the optimizer updates it
  CHECK_FALSE(index["params"]["0.weight"].contains("state_dtypes"));
  CHECK(index["params"]["0.weight"]["steps"] == 0);
  CHECK(index["params"]["1.weight"].contains("state_dtypes"));
  std::set<std::string> stored;
  const safetensors::Reader file(step_dir(2) + "/rank-00000-of-00001.safetensors");
  for (const auto& t : file.tensors()) stored.insert(t.name);
  CHECK(stored == std::set<std::string>{"model/0.weight", "model/0.bias", "model/1.weight", "model/1.bias",
                                        "optim/1.weight/exp_avg", "optim/1.weight/exp_avg_sq", "optim/1.bias/exp_avg",
                                        "optim/1.bias/exp_avg_sq"});
  CHECK(nn::verify_checkpoint(step_dir(2)) > 0);
  const nn::CheckpointSummary summary = nn::describe_checkpoint(step_dir(2));
  CHECK(summary.params[0].optimizer_state.empty());
  CHECK(summary.params[2].optimizer_state == std::vector<std::string>{"exp_avg", "exp_avg_sq"});
  // Resumed from either save, the run continues bit for bit, and no state is made on loading.
  nn::Sequential straight = make();
  freeze(straight, true);
  nn::AdamW straight_opt(straight.parameters());
  train(straight, straight_opt, 0, 4);
  for (int at : {0, 2}) {
    CAPTURE(at);
    nn::Sequential resumed = make();
    freeze(resumed, true);
    nn::AdamW resumed_opt(resumed.parameters());
    nn::load_checkpoint(step_dir(at), resumed, &resumed_opt, comm);
    CHECK_FALSE(resumed_opt.has_state(resumed[0]->parameters()[0]));
    train(resumed, resumed_opt, at, 4);
    CHECK(test::snapshot(resumed) == test::snapshot(straight));
  }
  // Unfrozen after the resume, the backbone takes its first step afresh (count 0, bias
  // corrections of a first step), as when it is unfrozen in a run that goes straight through.
  nn::Sequential thawed = make();
  freeze(thawed, true);
  nn::AdamW thawed_opt(thawed.parameters());
  train(thawed, thawed_opt, 0, 2);
  freeze(thawed, false);
  train(thawed, thawed_opt, 2, 4);
  nn::Sequential thawed_resumed = make();
  freeze(thawed_resumed, true);
  nn::AdamW thawed_resumed_opt(thawed_resumed.parameters());
  freeze(thawed_resumed, false);
  train(thawed_resumed, thawed_resumed_opt, 0, 1);  // backbone state of its own, which the load must reset
  CHECK(thawed_resumed_opt.has_state(thawed_resumed[0]->parameters()[0]));
  freeze(thawed_resumed, true);
  nn::load_checkpoint(step_dir(2), thawed_resumed, &thawed_resumed_opt, comm);
  freeze(thawed_resumed, false);
  train(thawed_resumed, thawed_resumed_opt, 2, 4);
  CHECK(test::snapshot(thawed_resumed) == test::snapshot(thawed));
  // Unfrozen into a group of its own with a lower rate: a group of parameters without state in the
  // checkpoint has no history to match, so it may differ from the saved one (it was refused).
  nn::Sequential regrouped = make();
  freeze(regrouped, true);
  nn::AdamW regrouped_opt(
      std::vector<nn::ParamGroup>{{.name = "default", .params = regrouped[1]->parameters()},
                                  {.name = "backbone", .params = regrouped[0]->parameters(), .lr_scale = 0.1}});
  CHECK_NOTHROW(nn::load_checkpoint(step_dir(2), regrouped, &regrouped_opt, comm));
  // The head's group must still be the saved one.
  nn::Sequential head_elsewhere = make();
  nn::AdamW head_elsewhere_opt(
      std::vector<nn::ParamGroup>{{.name = "head", .params = head_elsewhere[1]->parameters()},
                                  {.name = "default", .params = head_elsewhere[0]->parameters()}});
  test::check_throws<IOError>([&] { nn::load_checkpoint(step_dir(2), head_elsewhere, &head_elsewhere_opt, comm); },
                              {"was saved with the optimizer groups default (", "this optimizer's are head ("});
  // An index that gives such a parameter a step count is damaged: its moments are not in the files.
  nlohmann::json bad = index;
  bad["params"]["0.weight"]["steps"] = 1;
  std::ofstream(step_dir(2) + "/index.json") << test::restamped(bad).dump(1);
  nn::Sequential again = make();
  freeze(again, true);
  nn::AdamW again_opt(again.parameters());
  test::check_throws<IOError>([&] { nn::load_checkpoint(step_dir(2), again, &again_opt, comm); },
                              {"parameter '0.weight'", "no optimizer state", "taken 1 steps"});
}

TEST_CASE("ranks whose optimizers disagree on a parameter's state are refused, not written as one checkpoint") {
  TempDir dir;
  std::atomic<int> refused{0};
  run_ranks(2, [&](Communicator& comm) {
    nn::manual_seed(6);
    nn::Sequential model({std::make_shared<nn::Linear>(8, 8), std::make_shared<nn::Linear>(8, 2)});
    nn::fully_shard(model, comm);
    nn::AdamW opt(model.parameters());
    if (comm.rank() == 1) (void)opt.state(model[1]->parameters()[0]);  // made on rank 1 alone
    test::check_throws<IOError>([&] { nn::save_checkpoint(dir.str(), 1, model, &opt, comm); },
                                {"rank-00001", "parameter '1.weight'", "disagree on whether it has state"});
    ++refused;
  });
  CHECK(refused == 2);
  CHECK_FALSE(std::filesystem::exists(dir.path / "step-00000001" / "index.json"));
}

TEST_CASE("reshard: saved by 3 ranks, resumed by 2 and by 4") {
  TempDir dir;
  const auto whole = rank0(3, [&](Communicator& c) { return train(c, 0, 6, "", ""); });
  const auto first = rank0(3, [&](Communicator& c) { return train(c, 0, 3, "", dir.str()); });
  // The consolidated checkpoint is the reference for the loaded parameters.
  const std::string full = (dir.path / "full.safetensors").string();
  nn::consolidate_checkpoint(dir.str(), full);
  safetensors::Reader reference(full);
  for (int world : {2, 4}) {
    CAPTURE(world);
    std::vector<std::uint64_t> bytes(world);
    std::mutex m;
    std::vector<std::string> mismatches;
    run_ranks(world, [&](Communicator& comm) {
      nn::manual_seed(99);  // different initial values: everything must come from the checkpoint
      test::TinyLM model;
      nn::fully_shard(model, comm);
      nn::AdamW opt(model.parameters(), test::adam_options());
      const auto info = nn::load_checkpoint(dir.str(), model, &opt, comm);
      bytes[comm.rank()] = info.bytes_read;
      autograd::NoGradGuard guard;
      for (auto& [name, p] : model.named_parameters()) {
        const auto got = p.value().to_vector<double>(), want = reference.read(name).to_vector<double>();
        if (got != want) {
          std::lock_guard lock(m);
          mismatches.push_back(name);
        }
      }
    });
    CHECK(mismatches.empty());
    // Each rank read about its share (parameters and both Adam moments), never whole tensors.
    std::uint64_t param_bytes = 0;
    for (const auto& t : reference.tensors()) param_bytes += t.end - t.begin;
    for (int r = 0; r < world; ++r) {
      INFO("rank " << r << " read " << bytes[r] << " bytes; the model is " << param_bytes);
      CHECK(bytes[r] < 3 * param_bytes / world + 64 * 1024);
    }
    // Training continues with the losses of the uninterrupted run (summation order differs: f32 tolerance).
    const auto second = rank0(world, [&](Communicator& c) { return train(c, 3, 6, dir.str(), ""); });
    const auto [score, where] = test::compare(concat(first, second), whole, 1e-6, 1e-5);
    CHECK_MESSAGE(score <= 1, "differs at " << where);
  }
}

TEST_CASE("reshard reads each new rank's own share of the bytes, not whole tensors") {
  // Big enough that a whole-tensor read would stand out from the headers: 1 MiB of weight, and
  // as much again of each Adam moment.
  TempDir dir;
  auto make = [](Communicator& comm) {
    nn::manual_seed(5);
    auto layer = std::make_shared<nn::Linear>(512, 512);
    nn::fully_shard(*layer, comm);
    return layer;
  };
  run_ranks(3, [&](Communicator& comm) {
    auto layer = make(comm);
    nn::AdamW opt(layer->parameters(), test::adam_options());
    sum(layer->forward(ones({2, 512}))).backward();
    opt.step();  // creates the moments
    nn::save_checkpoint(dir.str(), 1, *layer, &opt, comm, {});
  });
  for (const bool verify : {false, true}) {
    for (int world : {2, 4}) {
      CAPTURE(verify);
      CAPTURE(world);
      std::vector<std::uint64_t> bytes(world), share(world);
      run_ranks(world, [&](Communicator& comm) {
        auto layer = make(comm);
        nn::AdamW opt(layer->parameters(), test::adam_options());
        bytes[comm.rank()] =
            nn::load_checkpoint(dir.str(), *layer, &opt, comm, {.verify_checksums = verify}).bytes_read;
        for (const auto& p : layer->parameters()) share[comm.rank()] += 3 * 4 * p.shard()->real_elements();
      });
      // Plus at most the three files' headers; checking also reads the blocks the range's two ends
      // cut, for each of the 6 tensors (weight, bias, and their two moments).
      const std::uint64_t slack = 3 * 4096 + (verify ? 6 * 2 * nn::kChecksumBlockBytes : 0);
      for (int r = 0; r < world; ++r) {
        INFO("rank " << r << " read " << bytes[r] << " bytes for a share of " << share[r]);
        CHECK(bytes[r] >= share[r]);
        CHECK(bytes[r] <= share[r] + slack);
      }
    }
  }
}

TEST_CASE("a resume keeps each parameter's own Adam step count: one that had no gradient in some steps") {
  // Four steps straight through against two, a save, a load into a fresh model and optimizer, and
  // two more. The second layer has no gradient in the first step, so its bias corrections count
  // one step fewer; the index records that count where it differs from the optimizer's.
  nn::Sequential straight = two_layers(11);
  nn::Adam straight_opt(straight.parameters(), {.lr = 0.1});
  train_two_layers(straight, straight_opt, 0, 4);

  TempDir dir;
  LocalCommunicator comm;
  {
    nn::Sequential first = two_layers(11);
    nn::Adam opt(first.parameters(), {.lr = 0.1});
    train_two_layers(first, opt, 0, 2);
    CHECK(opt.steps_of(first.parameters().back()) == 1);
    nn::save_checkpoint(dir.str(), 2, first, &opt, comm, {});
  }
  nn::Sequential resumed = two_layers(11);
  nn::Adam opt(resumed.parameters(), {.lr = 0.1});
  nn::load_checkpoint(dir.str(), resumed, &opt, comm);
  CHECK(opt.steps() == 2);
  CHECK(opt.steps_of(resumed.parameters().front()) == 2);
  CHECK(opt.steps_of(resumed.parameters().back()) == 1);
  train_two_layers(resumed, opt, 2, 4);
  CHECK(test::snapshot(straight) == test::snapshot(resumed));
  const auto b = resumed.parameters();
  // A count past the optimizer's is a damaged index, refused by name.
  test::check_throws<ArgumentError>([&] { opt.set_steps_of(b.back(), 5); }, {"set_steps_of", "[0, 4]", "5"});
  // A parameter the optimizer does not update is refused, not given a count.
  test::check_throws<ArgumentError>([&] { opt.set_steps_of(straight.parameters().back(), 1); },
                                    {"set_steps_of", "not one this optimizer updates"});
  test::check_throws<ArgumentError>([&] { (void)opt.steps_of(straight.parameters().back()); },
                                    {"steps_of", "not one this optimizer updates"});
  // An optimizer over part of the module (the rest frozen) saves and resumes as before.
  TempDir part_dir;
  nn::Sequential partial = two_layers(11);
  const auto all = partial.parameters();
  nn::Adam part_opt(std::vector<nn::Param>(all.begin(), all.begin() + 2), {.lr = 0.1});
  train_two_layers(partial, part_opt, 0, 2);
  nn::save_checkpoint(part_dir.str(), 2, partial, &part_opt, comm, {});
  nn::Sequential partial_again = two_layers(11);
  const auto again = partial_again.parameters();
  nn::Adam again_opt(std::vector<nn::Param>(again.begin(), again.begin() + 2), {.lr = 0.1});
  nn::load_checkpoint(part_dir.str(), partial_again, &again_opt, comm);
  CHECK(again_opt.steps() == 2);
  CHECK(again[0].data().to_vector<double>() == all[0].data().to_vector<double>());
}

TEST_CASE("SGD with dampening resumes as it trains straight through, from a save before a parameter's first step") {
  // PyTorch's momentum buffer starts as the first gradient, undampened. Saving asks the optimizer
  // for its state, which exists (as zeros) from then on: the saved per-parameter step count is
  // what tells the resumed optimizer that the buffer has not started. Saves at step 0 (no
  // parameter stepped) and at step 1 (the second layer not yet, as it has no gradient in step 0).
  const nn::SGDOptions options{.lr = 0.01, .momentum = 0.9, .dampening = 0.5};
  nn::Sequential straight = two_layers(12);
  nn::SGD straight_opt(straight.parameters(), options);
  train_two_layers(straight, straight_opt, 0, 3);
  LocalCommunicator comm;
  for (int at : {0, 1}) {
    CAPTURE(at);
    TempDir dir;
    {
      nn::Sequential first = two_layers(12);
      nn::SGD opt(first.parameters(), options);
      train_two_layers(first, opt, 0, at);
      nn::save_checkpoint(dir.str(), at, first, &opt, comm, {});
    }
    nn::Sequential resumed = two_layers(12);
    nn::SGD opt(resumed.parameters(), options);
    nn::load_checkpoint(dir.str(), resumed, &opt, comm);
    CHECK(opt.steps_of(resumed.parameters().back()) == 0);
    train_two_layers(resumed, opt, at, 3);
    CHECK(test::snapshot(straight) == test::snapshot(resumed));
  }
}

TEST_CASE("the latest pointer, pruning, and an incomplete step directory") {
  TempDir dir;
  run_ranks(2, [&](Communicator& comm) {
    nn::manual_seed(1);
    nn::Linear layer(4, 3);
    nn::fully_shard(layer, comm);
    for (int step : {10, 20, 30}) nn::save_checkpoint(dir.str(), step, layer, nullptr, comm, {}, /*keep=*/2);
  });
  CHECK_FALSE(fs::exists(dir.path / "step-00000010"));
  CHECK(fs::exists(dir.path / "step-00000020"));
  // An incomplete step (a crash before its index) does not count towards the two kept.
  fs::create_directories(dir.path / "step-00000035");
  // A directory that only starts with "step-" is the user's: upkeep used to remove it, contents and all.
  fs::create_directories(dir.path / "step-notes");
  std::ofstream(dir.path / "step-notes" / "precious.txt") << "keep";
  // A step whose index.json is there but no regular file is damage, not a killed save's leftover:
  // upkeep removed it with its rank files. Kept, and named in the warnings.
  fs::create_directories(dir.path / "step-00000033" / "index.json");
  std::ofstream(dir.path / "step-00000033" / "rank-00000-of-00002.safetensors") << "moments";
  std::vector<std::string> warnings;
  run_ranks(2, [&](Communicator& comm) {
    nn::manual_seed(1);
    nn::Linear layer(4, 3);
    nn::fully_shard(layer, comm);
    nn::save_checkpoint(dir.str(), 36, layer, nullptr, comm, {}, /*keep=*/2);
    // Saving a step again (a run resumed from an earlier one) replaces it whole.
    const auto info = nn::save_checkpoint(dir.str(), 36, layer, nullptr, comm, {}, /*keep=*/2);
    if (comm.rank() == 0) warnings = info.warnings;
  });
  CHECK_FALSE(fs::exists(dir.path / "step-00000035"));
  CHECK(fs::exists(dir.path / "step-00000033" / "rank-00000-of-00002.safetensors"));
  REQUIRE(warnings.size() == 1);
  CHECK(warnings[0].find("step-00000033 (its index.json is not a regular file)") != std::string::npos);
  fs::remove_all(dir.path / "step-00000033");
  CHECK(fs::exists(dir.path / "step-00000030" / "index.json"));
  CHECK(fs::exists(dir.path / "step-00000036" / "index.json"));
  CHECK_FALSE(fs::exists(dir.path / "step-00000020"));
  CHECK(fs::exists(dir.path / "step-notes" / "precious.txt"));
  fs::remove_all(dir.path / "step-notes");
  fs::remove_all(dir.path / "step-00000035");
  fs::remove_all(dir.path / "step-00000036");
  CHECK(nn::resolve_checkpoint(dir.str()) == (dir.path / "step-00000030").string());
  // A step directory without its index (a crash before the index) is never chosen.
  fs::create_directories(dir.path / "step-00000040");
  fs::remove(dir.path / "latest");
  CHECK(nn::resolve_checkpoint(dir.str()) == (dir.path / "step-00000030").string());
}

namespace {
// Forty one-element layers: the index (every parameter's every piece) is larger than either rank's
// file, so a file-size limit between the two lets every rank file through and refuses the index.
nn::Sequential many_scalars() {
  nn::manual_seed(3);
  std::vector<std::shared_ptr<nn::UnaryModule>> layers;
  for (int i = 0; i < 40; ++i) layers.push_back(std::make_shared<nn::Linear>(1, 1));
  return nn::Sequential(std::move(layers));
}
std::vector<std::string> rank_files_in(const fs::path& step) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(step)) {
    if (entry.path().filename().string().rfind("rank-", 0) == 0) names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}
// Runs fn with writes limited to `bytes` a file (SIGXFSZ ignored: a write past it fails with EFBIG).
template <class F>
void with_file_size_limit(rlim_t bytes, F&& fn) {
  rlimit before{};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &before) == 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  const rlimit limited{bytes, before.rlim_max};
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &limited) == 0);
  try {
    fn();
  } catch (...) {
    ::setrlimit(RLIMIT_FSIZE, &before);
    std::signal(SIGXFSZ, old_handler);
    throw;
  }
  ::setrlimit(RLIMIT_FSIZE, &before);
  std::signal(SIGXFSZ, old_handler);
}
}  // namespace

TEST_CASE("a save or split whose index the disk refuses removes the rank files it wrote; the step before stays") {
  // Before, the new rank files stayed in a step without an index until the next save's upkeep:
  // a checkpoint's worth of space kept on the disk that had just run out of it.
  TempDir dir;
  run_ranks(2, [&](Communicator& comm) {
    nn::Sequential model = many_scalars();
    nn::fully_shard(model, comm);
    nn::save_checkpoint(dir.str(), 1, model, nullptr, comm);
  });
  const fs::path saved = dir.path / "step-00000001";
  std::uintmax_t largest_rank_file = 0;
  for (const auto& name : rank_files_in(saved))
    largest_rank_file = std::max(largest_rank_file, fs::file_size(saved / name));
  const std::uintmax_t index_size = fs::file_size(saved / "index.json");
  REQUIRE_MESSAGE(index_size > largest_rank_file + 512, index_size, " vs ", largest_rank_file);
  const rlim_t limit = largest_rank_file + 256;

  SUBCASE("a new step") {
    with_file_size_limit(limit, [&] {
      run_ranks(2, [&](Communicator& comm) {
        nn::Sequential model = many_scalars();
        nn::fully_shard(model, comm);
        test::check_throws<IOError>([&] { nn::save_checkpoint(dir.str(), 2, model, nullptr, comm); },
                                    {"step-00000002", "publishing the index failed", "File too large"});
      });
    });
    CHECK(rank_files_in(dir.path / "step-00000002").empty());
  }
  SUBCASE("the same step saved again keeps its files and index") {
    const auto before = rank_files_in(saved);
    with_file_size_limit(limit, [&] {
      run_ranks(2, [&](Communicator& comm) {
        nn::Sequential model = many_scalars();
        nn::fully_shard(model, comm);
        test::check_throws<IOError>([&] { nn::save_checkpoint(dir.str(), 1, model, nullptr, comm); },
                                    {"publishing the index failed", "File too large"});
      });
    });
    CHECK(rank_files_in(saved) == before);
  }
  SUBCASE("a split") {
    const std::string whole = (dir.path / "whole.safetensors").string();
    nn::consolidate_checkpoint(dir.str(), whole);
    test::check_throws<IOError>(
        [&] { with_file_size_limit(limit, [&] { nn::split_checkpoint(whole, 2, dir.str(), 3); }); },
        {"File too large"});
    CHECK(rank_files_in(dir.path / "step-00000003").empty());
  }
  CHECK(nn::resolve_checkpoint(dir.str()) == saved.string());
  run_ranks(2, [&](Communicator& comm) {
    nn::Sequential model = many_scalars();
    nn::fully_shard(model, comm);
    nn::load_checkpoint(dir.str(), model, nullptr, comm);
  });
}

TEST_CASE("the same state saved twice writes the same bytes, whatever the process made before") {
  // The index recorded each parameter's process-wide id: under --emulate the ranks build their
  // models at once, and the same run wrote a different index.json every time (rank files equal).
  TempDir a, b;
  auto save = [](const TempDir& dir) {
    run_ranks(2, [&](Communicator& comm) {
      nn::Sequential model = many_scalars();
      nn::fully_shard(model, comm);
      nn::save_checkpoint(dir.str(), 1, model, nullptr, comm);
    });
  };
  save(a);
  for (int i = 0; i < 5; ++i) nn::Linear unrelated(2, 2);  // later parameters get other process-wide ids
  save(b);
  auto bytes = [](const fs::path& file) {
    std::ifstream in(file, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const fs::path step = "step-00000001";
  CHECK(bytes(a.path / step / "index.json") == bytes(b.path / step / "index.json"));
  const auto summary = nn::describe_checkpoint(a.str());
  std::set<std::uint64_t> numbers;  // the parameters' numbers in the module: 1 to 80
  for (const auto& p : summary.params) numbers.insert(p.id);
  CHECK(numbers.size() == 80);
  CHECK(*numbers.begin() == 1);
  CHECK(*numbers.rbegin() == 80);
}

TEST_CASE("a resume draws the dropout masks the uninterrupted run draws: the streams are saved and restored") {
  // The Dropouts' stream positions were not saved: a GPT with dropout resumed at step 2 read
  // 5.5625 at step 3 where the uninterrupted run read 5.5653. Restored too where the resuming
  // program made its model after other draws (its Dropouts' seeds differ).
  auto make = [](std::uint64_t seed) {
    nn::manual_seed(seed);
    auto model = std::make_unique<nn::GPT>(
        nn::GPTConfig{.vocabulary = 64, .context = 8, .d_model = 16, .layers = 2, .heads = 2, .dropout = 0.2});
    model->train(true);
    return model;
  };
  auto step = [](nn::GPT& model, nn::AdamW& opt, int s) {
    const Tensor tokens = randint({4, 9}, 0, 64, 1000 + s);
    const Tensor loss =
        nn::cross_entropy(model.forward(tokens.slice(1, 0, 8).contiguous()), tokens.slice(1, 1, 9).contiguous());
    opt.zero_grad();
    loss.backward();
    opt.step();
    return loss.item();
  };
  TempDir dir;
  LocalCommunicator comm;
  auto straight = make(7);
  nn::AdamW straight_opt(straight->parameters(), {});
  std::vector<double> expected;
  for (int s = 0; s < 4; ++s) {
    expected.push_back(step(*straight, straight_opt, s));
    if (s == 1) nn::save_checkpoint(dir.str(), 2, *straight, &straight_opt, comm);
  }
  auto resumed = make(8);
  nn::AdamW resumed_opt(resumed->parameters(), {});
  nn::load_checkpoint(dir.str(), *resumed, &resumed_opt, comm);
  for (int s = 2; s < 4; ++s) CHECK(step(*resumed, resumed_opt, s) == expected[static_cast<std::size_t>(s)]);
  // At another world size: the positions are the global stream's, so two ranks resuming the
  // dense run's checkpoint draw, between them, the masks the dense run draws.
  std::vector<double> at_two(4);
  run_ranks(2, [&](Communicator& c) {
    auto model = make(9);
    nn::fully_shard(*model, c);
    nn::AdamW opt(model->parameters(), {});
    nn::load_checkpoint(dir.str(), *model, &opt, c);
    for (int s = 2; s < 4; ++s) {
      const Tensor tokens = test::part(randint({4, 9}, 0, 64, 1000 + s), c.rank(), 2);
      const Tensor loss =
          nn::cross_entropy(model->forward(tokens.slice(1, 0, 8).contiguous()), tokens.slice(1, 1, 9).contiguous()) /
          2.0;
      const double global = c.all_reduce(loss.detach()).item();
      opt.zero_grad();
      loss.backward();
      opt.step();
      if (c.rank() == 0) at_two[static_cast<std::size_t>(s)] = global;
    }
  });
  for (std::size_t s = 2; s < 4; ++s) CHECK(at_two[s] == doctest::Approx(expected[s]).epsilon(1e-5));
  // The index names each stream by its module's path.
  const auto streams = nlohmann::json::parse(std::ifstream(dir.path / "step-00000002" / "index.json"))["streams"];
  CHECK(streams.contains("blocks.0.attn.attn_dropout"));
  CHECK(streams["blocks.0.attn.attn_dropout"]["offset"].get<std::uint64_t>() > 0);
}

TEST_CASE("steps are ordered by number, not as text: step 100000000 is newer than 99999999") {
  // step-%08lld has nine digits from 100000000 on, and "step-100000000" sorts before "step-99999999".
  TempDir dir;
  LocalCommunicator comm;
  nn::manual_seed(1);
  nn::Linear layer(4, 3);
  for (const std::int64_t step : {99999998LL, 99999999LL, 100000000LL, 100000001LL})
    nn::save_checkpoint(dir.str(), step, layer, nullptr, comm, {}, /*keep=*/2);
  // Pruning kept the two newest.
  CHECK_FALSE(fs::exists(dir.path / "step-99999998"));
  CHECK_FALSE(fs::exists(dir.path / "step-99999999"));
  CHECK(fs::exists(dir.path / "step-100000000" / "index.json"));
  CHECK(fs::exists(dir.path / "step-100000001" / "index.json"));
  CHECK(nn::resolve_checkpoint(dir.str()) == (dir.path / "step-100000001").string());
  // Without the pointer, the newest complete step by number.
  nn::save_checkpoint(dir.str(), 99999999, layer, nullptr, comm, {}, /*keep=*/0);
  fs::remove(dir.path / "latest");
  CHECK(nn::resolve_checkpoint(dir.str()) == (dir.path / "step-100000001").string());
  // The same number spelled with more zeros (another writer's) is the same step: either may win,
  // but no shorter number is taken for a longer one.
  fs::create_directories(dir.path / "step-0000000000000000000099999999");
  std::ofstream(dir.path / "step-0000000000000000000099999999" / "index.json") << "{}";
  CHECK(nn::resolve_checkpoint(dir.str()) == (dir.path / "step-100000001").string());
}

namespace {
// Makes a file impossible to remove, even for root (the immutable attribute), or says why not.
bool set_immutable(const fs::path& path, bool on) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return false;
  int flags = 0;
  bool ok = ::ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0;
  flags = on ? (flags | FS_IMMUTABLE_FL) : (flags & ~FS_IMMUTABLE_FL);
  ok = ok && ::ioctl(fd, FS_IOC_SETFLAGS, &flags) == 0;
  ::close(fd);
  return ok;
}
}  // namespace

TEST_CASE("a save beside foreign entries: upkeep skips what it cannot inspect or remove, and the save succeeds") {
  TempDir dir;
  // Entries of ruda's naming that are not ruda's: a symbolic link that loops (stat fails on it:
  // the cleaning used to die there, failing every later save), a file, a link to a directory
  // outside; and a foreign file and folder.
  fs::create_symlink("step-00000005", dir.path / "step-00000005");
  std::ofstream(dir.path / "step-00000007") << "not a step";
  TempDir outside;
  fs::create_directories(outside.path / "keep-me");
  fs::create_directory_symlink(outside.path, dir.path / "step-00000001");
  std::ofstream(dir.path / "notes.txt") << "mine";
  std::vector<std::string> warnings;
  auto save = [&](int step) {
    run_ranks(2, [&](Communicator& comm) {
      nn::manual_seed(1);
      nn::Linear layer(4, 3);
      nn::fully_shard(layer, comm);
      const auto info = nn::save_checkpoint(dir.str(), step, layer, nullptr, comm, {}, /*keep=*/1);
      if (comm.rank() == 0) warnings = info.warnings;
    });
  };
  for (int step : {10, 20}) save(step);
  CHECK(warnings.empty());  // nothing failed: the foreign entries are simply not ruda's
  CHECK(fs::exists(dir.path / "step-00000020" / "index.json"));
  CHECK_FALSE(fs::exists(dir.path / "step-00000010"));  // pruning went on past them
  CHECK(fs::is_symlink(dir.path / "step-00000005"));    // left alone
  CHECK(fs::is_regular_file(dir.path / "step-00000007"));
  CHECK(fs::exists(outside.path / "keep-me"));  // a link is never followed into
  CHECK(fs::is_regular_file(dir.path / "notes.txt"));
  CHECK(nn::resolve_checkpoint(dir.str()) == (dir.path / "step-00000020").string());

  // A leftover that cannot be removed (a killed save's directory holding an immutable file): the
  // save succeeds and names it in one warning.
  fs::create_directories(dir.path / "step-00000015");
  const fs::path stuck = dir.path / "step-00000015" / "rank-00000-of-00002.safetensors";
  std::ofstream(stuck) << "partial";
  if (set_immutable(stuck, true)) {
    save(30);
    set_immutable(stuck, false);
    REQUIRE(warnings.size() == 1);
    CHECK(warnings[0].find("skipped what it could not inspect or remove") != std::string::npos);
    CHECK(warnings[0].find("step-00000015") != std::string::npos);
    CHECK(fs::exists(dir.path / "step-00000030" / "index.json"));
    CHECK(nn::resolve_checkpoint(dir.str()) == (dir.path / "step-00000030").string());
  } else {
    MESSAGE("this file system has no immutable attribute for us: the unremovable-leftover half did not run");
    save(30);
    CHECK(fs::exists(dir.path / "step-00000030" / "index.json"));
  }
}

TEST_CASE("check_resumable: another model or another data stream is refused before loading") {
  TempDir dir;
  const test::TrainResult saved = rank0(2, [&](Communicator& comm) { return train(comm, 0, 2, "", dir.str()); });
  nn::CheckpointInfo info = nn::describe_checkpoint(dir.str()).info;
  CHECK(info.extra.at("model") == "tiny");
  nn::check_resumable(info, "tiny", {});
  info.extra["--seed"] = "1";
  nn::check_resumable(info, "tiny", {{"--seed", "1"}, {"--batch", "64"}});  // --batch was not recorded: passes
  test::check_throws<IOError>([&] { nn::check_resumable(info, "small", {}); },
                              {info.directory, "holds model 'tiny'", "this run trains 'small'"});
  test::check_throws<ArgumentError>(
      [&] {
        nn::check_resumable(info, "tiny", {{"--seed", "7"}});
      },
      {"--seed 7 differs from the --seed 1 of", info.directory, "other samples"});
  info.extra.erase("model");
  test::check_throws<IOError>([&] { nn::check_resumable(info, "tiny", {}); }, {"holds model '?'"});
  CHECK(saved.losses.size() == 2);
}

TEST_CASE("bad checkpoints raise IOError naming the problem") {
  TempDir dir;
  run_ranks(2, [&](Communicator& comm) {
    nn::manual_seed(1);
    nn::Linear layer(4, 3);
    nn::fully_shard(layer, comm);
    nn::save_checkpoint(dir.str(), 1, layer, nullptr, comm);
  });
  const fs::path step = dir.path / "step-00000001";
  auto load_into = [&](nn::Module& m) {
    LocalCommunicator local;
    nn::load_checkpoint(dir.str(), m, nullptr, local);
  };
  SUBCASE("a model of another shape") {
    nn::Linear other(4, 5);
    test::check_throws<IOError>([&] { load_into(other); }, {"weight", "[4, 3]", "[4, 5]"});
  }
  SUBCASE("a missing parameter") {
    nn::Linear other(4, 3, {.bias = false});
    test::check_throws<IOError>([&] { load_into(other); }, {"2 parameters", "1"});
  }
  SUBCASE("a truncated rank file") {
    const fs::path f = step / "rank-00001-of-00002.safetensors";
    fs::resize_file(f, fs::file_size(f) - 5);
    nn::Linear same(4, 3);
    test::check_throws<IOError>([&] { load_into(same); }, {"rank-00001-of-00002.safetensors", "outside"});
  }
  SUBCASE("a missing rank file") {
    fs::remove(step / "rank-00000-of-00002.safetensors");
    nn::Linear same(4, 3);
    test::check_throws<IOError>([&] { load_into(same); }, {"rank-00000-of-00002.safetensors", "cannot open"});
  }
  SUBCASE("an index whose pieces leave their tensor") {
    // Rank 1's piece of the [4, 3] weight moved from elements [6, 12) to [9, 15): loading,
    // verifying and consolidating must refuse it, not read or write past the tensor.
    const fs::path index = step / "index.json";
    std::stringstream text;
    text << std::ifstream(index).rdbuf();
    std::string s = text.str();
    const std::size_t at = s.find("\"offset\": 6");
    REQUIRE(at != std::string::npos);
    s.replace(at, std::string("\"offset\": 6").size(), "\"offset\": 9");
    std::ofstream(index) << test::restamped(nlohmann::json::parse(s)).dump(1);
    nn::Linear same(4, 3);
    test::check_throws<IOError>([&] { load_into(same); }, {"piece", "weight", "outside"});
    test::check_throws<IOError>([&] { nn::verify_checkpoint(dir.str()); }, {"piece", "weight"});
    test::check_throws<IOError>([&] { nn::consolidate_checkpoint(dir.str(), (dir.path / "x.safetensors").string()); },
                                {"piece", "weight"});
  }
  SUBCASE("an index whose shape has more axes than any tensor") {
    const fs::path index = step / "index.json";
    std::stringstream text;
    text << std::ifstream(index).rdbuf();
    nlohmann::json j = nlohmann::json::parse(text.str());
    j["params"]["bias"]["shape"] = nlohmann::json::array({1, 1, 1, 1, 1, 1, 1, 1, 1, 3});
    std::ofstream(index) << test::restamped(j).dump(1);
    test::check_throws<IOError>([&] { nn::verify_checkpoint(dir.str()); }, {"bias", "10 axes", "at most 8"});
  }
  SUBCASE("a corrupt index") {
    std::ofstream(step / "index.json") << "{\"format\": \"ruda-sharded-checkpoint\", \"version\": 1, \"step\": ";
    nn::Linear same(4, 3);
    test::check_throws<IOError>([&] { load_into(same); }, {"index", "JSON"});
  }
  SUBCASE("an index nested deeper than any index is") {
    // 200000 brackets overflowed the stack of every reader (printing the parsed tree recursed).
    std::stringstream text;
    text << std::ifstream(step / "index.json").rdbuf();
    std::string s = text.str();
    s.erase(s.find_last_of('}'));
    std::ofstream(step / "index.json") << s << ", \"zz\": " << std::string(200000, '[') << std::string(200000, ']')
                                       << "}";
    nn::Linear same(4, 3);
    test::check_throws<IOError>([&] { load_into(same); }, {"index.json", "nested too deeply"});
    test::check_throws<IOError>([&] { (void)nn::describe_checkpoint(dir.str()); }, {"nested too deeply"});
  }
  SUBCASE("a latest pointer that names no step") {
    // It was passed over for the newest step, which may belong to another line of steps.
    for (const std::string& damaged : {std::string("step-0000000#\n"), std::string("../other/step-00000001\n"),
                                       std::string(""), std::string("step-00000001\nmore\n")}) {
      CAPTURE(damaged);
      std::ofstream(dir.path / "latest") << damaged;
      nn::Linear same(4, 3);
      test::check_throws<IOError>([&] { load_into(same); }, {"latest", "not the name of a step"});
    }
    // A pointer to a step that is gone (a kill between saving and pruning) still falls back.
    std::ofstream(dir.path / "latest") << "step-00000009\n";
    nn::Linear same(4, 3);
    load_into(same);
  }
  SUBCASE("an output deeper inside a step, or named like a step beside the steps, is refused") {
    // step-N/export/model.safetensors was accepted, and pruning step N deleted it; a file named
    // step-N in the checkpoint directory made the save of step N fail after the training.
    fs::create_directories(step / "export");
    CHECK(nn::checkpoint_member((step / "export" / "model.safetensors").string()).find("lies inside the step") !=
          std::string::npos);
    test::check_throws<IOError>(
        [&] { nn::consolidate_checkpoint(dir.str(), (step / "export" / "model.safetensors").string()); },
        {"lies inside the step directory"});
    test::check_throws<IOError>([&] { nn::consolidate_checkpoint(dir.str(), (dir.path / "step-00000008").string()); },
                                {"named like a step"});
    // The save lock too (ruda-train --metrics took it): an atomic write would replace the file
    // two saves lock.
    CHECK(nn::checkpoint_member((dir.path / ".ruda-save.lock").string()).find("save lock") != std::string::npos);
    test::check_throws<IOError>([&] { nn::consolidate_checkpoint(dir.str(), (dir.path / ".ruda-save.lock").string()); },
                                {"is the save lock of the checkpoint directory"});
    // Beside no steps, such a name is any file's.
    TempDir elsewhere;
    nn::consolidate_checkpoint(dir.str(), (elsewhere.path / "step-00000008").string());
    CHECK(fs::is_regular_file(elsewhere.path / "step-00000008"));
  }
  SUBCASE("a directory with an index.json is a step whatever its name: no other file is written into it") {
    fs::rename(step, dir.path / "best");
    fs::copy(dir.path / "best", dir.path / "other", fs::copy_options::recursive);
    CHECK(nn::checkpoint_member((dir.path / "best" / "rank-00000-of-00002.safetensors").string())
              .find("holds an index.json") != std::string::npos);
    test::check_throws<IOError>(
        [&] {
          nn::consolidate_checkpoint((dir.path / "other").string(),
                                     (dir.path / "best" / "rank-00000-of-00002.safetensors").string());
        },
        {"best", "holds an index.json"});
    nn::verify_checkpoint((dir.path / "best").string());
  }
  SUBCASE("split does not replace a step whose index cannot be read") {
    // It took such a step for one with nothing to keep, and deleted its rank files (the optimizer
    // state a repaired index, or a newer ruda, would load).
    const std::string full = (dir.path / "full.safetensors").string();
    nn::consolidate_checkpoint(dir.str(), full);
    std::ofstream(step / "index.json", std::ios::app) << "garbage";
    test::check_throws<IOError>([&] { (void)nn::split_checkpoint(full, 2, dir.str(), 1); },
                                {"step-00000001", "cannot be read", "another --step"});
    CHECK(fs::exists(step / "rank-00000-of-00002.safetensors"));
    CHECK(fs::exists(step / "rank-00001-of-00002.safetensors"));
  }
  SUBCASE("no checkpoint at all") {
    nn::Linear same(4, 3);
    LocalCommunicator local;
    test::check_throws<IOError>([&] { nn::load_checkpoint((dir.path / "nothing").string(), same, nullptr, local); },
                                {"does not exist"});
  }
}

// Sanitizer builds reserve terabytes of address space, so a limit on it cannot be set there; the
// release build runs this.
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
TEST_CASE("an index whose parse needs more memory than the process may allocate is an IOError, not a terminate") {
  // 30 MB of [0,0,...] needs ~700 MB as a tree. Under a limit it ran out of memory inside the
  // JSON library, whose cleanup allocates in a destructor: std::terminate, not an IOError.
  TempDir dir;
  const fs::path step = dir.path / "step-00000001";
  fs::create_directories(step);
  {
    std::ofstream index(step / "index.json");
    index << "{\"format\": \"ruda-sharded-checkpoint\", \"version\": 4, \"zz\": [0";
    std::string chunk;
    for (int i = 0; i < (1 << 19); ++i) chunk += ",0";
    for (int i = 0; i < 30; ++i) index << chunk;
    index << "]}";
  }
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // 256 MB above what the process has mapped now.
    long pages = 0;
    if (FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
      std::fclose(f);
    }
    const rlim_t limit = static_cast<rlim_t>(pages) * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE)) + (256u << 20);
    const rlimit as{limit, limit};
    if (pages == 0 || ::setrlimit(RLIMIT_AS, &as) != 0) ::_exit(5);
    try {
      (void)nn::describe_checkpoint(dir.str());
      ::_exit(2);
    } catch (const IOError& e) {
      ::_exit(std::strstr(e.what(), "more than this process can allocate") ? 0 : 3);
    } catch (...) {
      ::_exit(4);
    }
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);  // 2: parsed; 3: another IOError; 4: another exception; 5: no limit set
}
#endif

namespace {

// Six 256x256 f32 weights, 256 KiB each: holding the model (1.5 MiB), or two of its tensors,
// stands out from the one-tensor bound of the streaming conversions.
constexpr std::int64_t kSide = 256, kLayers = 6;
std::shared_ptr<nn::Sequential> six_layers() {
  nn::manual_seed(11);
  auto model = std::make_shared<nn::Sequential>();
  for (int i = 0; i < kLayers; ++i)
    model->push_back(std::make_shared<nn::Linear>(kSide, kSide, nn::LinearOptions{.bias = false}));
  return model;
}

// The tracked tensor bytes fn() had alive at its peak beyond those alive before it.
template <class F>
std::int64_t peak_during(F&& fn) {
  memory::reset_peak();
  const std::int64_t before = memory::stats().live_bytes;
  fn();
  return memory::stats().peak_bytes - before;
}

// Bitwise equality of two tensors' shapes and values.
bool same_bits(const Tensor& a, const Tensor& b) {
  const auto x = a.to_vector<float>(), y = b.to_vector<float>();
  return a.shape() == b.shape() && x.size() == y.size() &&
         std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("consolidate and split stream: their tracked peak is at most one tensor, not the model") {
  TempDir dir;
  std::map<std::string, Tensor> expected;  // the dense parameters every rank starts from
  for (const auto& [name, p] : six_layers()->named_parameters()) expected[name] = p.value();
  run_ranks(3, [&](Communicator& comm) {
    auto model = six_layers();
    nn::fully_shard(*model, comm);
    nn::save_checkpoint(dir.str(), 1, *model, nullptr, comm);
  });
  const std::int64_t tensor_bytes = kSide * kSide * 4, model_bytes = kLayers * tensor_bytes;
  const std::int64_t bound = tensor_bytes + 64 * 1024;

  const std::string full = (dir.path / "full.safetensors").string();
  const std::int64_t consolidate_peak = peak_during([&] { nn::consolidate_checkpoint(dir.str(), full); });
  INFO("consolidate peak " << consolidate_peak << ", split peak below; one tensor " << tensor_bytes << ", model "
                           << model_bytes);
  CHECK(consolidate_peak <= bound);
  {
    safetensors::Reader reader(full);
    CHECK(reader.tensors().size() == expected.size());
    for (const auto& [name, want] : expected) {
      CAPTURE(name);
      CHECK(same_bits(reader.read(name), want));
    }
  }

  // Split for another world size: each rank file holds its equal slice of every tensor.
  const int world = 4;
  const fs::path split_dir = dir.path / "split";
  const std::int64_t split_peak = peak_during([&] { nn::split_checkpoint(full, world, split_dir.string(), 2); });
  CAPTURE(split_peak);
  CHECK(split_peak <= bound);
  const std::int64_t slice = (kSide * kSide + world - 1) / world;
  for (int r = 0; r < world; ++r) {
    char file[64];
    std::snprintf(file, sizeof file, "rank-%05d-of-%05d.safetensors", r, world);
    safetensors::Reader reader((split_dir / "step-00000002" / file).string());
    for (const auto& [name, want] : expected) {
      CAPTURE(r);
      CAPTURE(name);
      const std::int64_t begin = std::min(kSide * kSide, r * slice), end = std::min(kSide * kSide, begin + slice);
      CHECK(same_bits(reader.read("model/" + name), want.reshape({-1}).slice(0, begin, end)));
    }
  }
  // The split checkpoint's index puts the pieces back together: it consolidates to the same bits.
  const std::string again = (dir.path / "again.safetensors").string();
  nn::consolidate_checkpoint(split_dir.string(), again);
  safetensors::Reader reader(again);
  for (const auto& [name, want] : expected) {
    CAPTURE(name);
    CHECK(same_bits(reader.read(name), want));
  }
}

TEST_CASE("a signal in the middle of an atomic write removes its temporary where the program asked for it") {
  // A child process writes half a file and receives SIGTERM (or SIGINT): with
  // remove_temporaries_on_signals the temporary goes and the child ends by the signal; without, the
  // temporary stays (ruda-ckpt's interrupted consolidate left hundreds of MB for good).
  for (const int signal : {SIGTERM, SIGINT}) {
    for (const bool handled : {true, false}) {
      CAPTURE(signal);
      CAPTURE(handled);
      TempDir dir;
      const std::string path = (dir.path / "w.safetensors").string();
      const pid_t child = ::fork();
      REQUIRE(child >= 0);
      if (child == 0) {
        // The default action where not handled: a plain program's (doctest's own handler, inherited,
        // is no part of the test and not async-signal-safe).
        std::signal(signal, SIG_DFL);
        if (handled) safetensors::remove_temporaries_on_signals();
        const float a[4] = {1, 2, 3, 4};
        safetensors::Writer w(path, {{"a", DType::f32, {4}}});
        w.write(a, 8);
        std::raise(signal);
        ::_exit(3);  // not reached: the signal ends the process
      }
      int status = 0;
      REQUIRE(::waitpid(child, &status, 0) == child);
      CHECK(WIFSIGNALED(status));
      if (WIFSIGNALED(status)) CHECK(WTERMSIG(status) == signal);
      CHECK_FALSE(fs::exists(path));
      CHECK(test::temporaries_in(dir.path).empty() == handled);
    }
  }
}

TEST_CASE("safetensors::Writer streams data after its header and refuses a wrong byte count") {
  TempDir dir;
  const std::string path = (dir.path / "w.safetensors").string();
  const std::vector<safetensors::TensorHeader> header = {{"a", DType::f32, {2, 2}}, {"b", DType::f64, {1}}};
  const float a[4] = {1, 2, 3, 4};
  const double b = -0.5;
  {
    safetensors::Writer w(path, header, {{"k", "v"}});
    w.write(a, 8);  // in pieces of any size
    w.write(a + 2, 8);
    w.write(&b, 8);
    test::check_throws<IOError>([&] { w.write(&b, 1); }, {"w.safetensors", "past the 24 data bytes"});
    w.commit();
    test::check_throws<ArgumentError>([&] { w.write(&b, 1); }, {"w.safetensors", "written after its commit"});
    test::check_throws<ArgumentError>([&] { w.commit(); }, {"w.safetensors", "committed twice"});
  }
  // A repeated or reserved name is the caller's mistake, refused before anything is written.
  test::check_throws<ArgumentError>(
      [&] {
        safetensors::Writer(path, {{"a", DType::f32, {1}}, {"a", DType::f32, {1}}});
      },
      {"'a' repeats"});
  test::check_throws<ArgumentError>(
      [&] {
        safetensors::Writer(path, {{"__metadata__", DType::f32, {1}}});
      },
      {"'__metadata__' is reserved"});
  safetensors::Reader r(path);
  test::check_close(r.read("a"), {1, 2, 3, 4}, {2, 2});
  test::check_close(r.read("b"), from_values({-0.5}, {1}, DType::f64), 0, 0);
  CHECK(r.metadata().at("k") == "v");
  {
    safetensors::Writer short_file((dir.path / "short.safetensors").string(), header);
    short_file.write(a, 16);
    test::check_throws<IOError>([&] { short_file.commit(); }, {"short.safetensors", "16 of the header's 24"});
  }
  // Neither the short file nor its temporary is left behind.
  CHECK_FALSE(fs::exists(dir.path / "short.safetensors"));
  CHECK(test::temporaries_in(dir.path).empty());
}

TEST_CASE("safetensors: round trip, partial reads, and rejected headers") {
  TempDir dir;
  const std::string path = (dir.path / "t.safetensors").string();
  const Tensor a = arange(0, 10, 1, DType::f64).reshape({2, 5});
  const Tensor b = from_values({1.5, -2}, {2}, DType::bf16);
  safetensors::write(path, {{"a", a}, {"b", b}}, {{"note", "hi"}});
  safetensors::Reader r(path);
  CHECK(r.metadata().at("note") == "hi");
  test::check_close(r.read("a"), a, 0, 0);
  test::check_close(r.read("b"), b, 0, 0);
  const std::uint64_t before = r.bytes_read();
  test::check_close(r.read_range("a", 3, 4), {3, 4, 5, 6}, {4});
  CHECK(r.bytes_read() - before == 4 * 8);
  test::check_throws<IOError>([&] { r.read_range("a", 8, 3); }, {"outside", "'a'"});
  test::check_throws<IOError>([&] { r.read("c"); }, {"no tensor 'c'"});

  auto rejects = [&](const std::string& header, std::uint64_t data_bytes, const std::string& fragment) {
    std::vector<safetensors::TensorInfo> tensors;
    std::map<std::string, std::string> metadata;
    test::check_throws<IOError>(
        [&] { safetensors::parse_header(header, 8 + header.size() + data_bytes, tensors, metadata); }, {fragment});
  };
  rejects("[1, 2]", 0, "does not begin with '{'");
  rejects(" {}", 0, "does not begin with '{'");
  rejects("\xEF\xBB\xBF{}", 0, "does not begin with '{'");
  rejects("", 0, "does not begin with '{'");
  rejects("{\"x\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 9]}}", 8, "outside");
  rejects("{\"x\": {\"dtype\": \"F32\", \"shape\": [3], \"data_offsets\": [0, 8]}}", 8, "8 bytes for a [3]");
  rejects("{\"x\": {\"dtype\": \"Q8\", \"shape\": [1], \"data_offsets\": [0, 1]}}", 8, "unsupported dtype");
  rejects("{\"x\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 4]}}", 8, "invalid extent");
  rejects("{\"x\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296], \"data_offsets\": [0, 0]}}", 8,
          "larger than the file");
  rejects(
      "{\"x\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
      " \"y\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [2, 6]}}",
      8, "overlap");
  // A valid file (Python's safetensors reads it) whose tensor no ruda tensor can hold: said so.
  rejects("{\"x\": {\"dtype\": \"F32\", \"shape\": [1, 1, 1, 1, 1, 1, 1, 1, 1], \"data_offsets\": [0, 4]}}", 8,
          "has 9 dimensions [1,1,1,1,1,1,1,1,1], more than a ruda tensor holds (8)");
  // A parse error quotes the bytes it read: bytes that are no text are written \xNN, so that the
  // message stays UTF-8 text.
  {
    std::vector<safetensors::TensorInfo> tensors;
    std::map<std::string, std::string> metadata;
    const std::string bad = "{\"a\xff";
    try {
      safetensors::parse_header(bad, 8 + bad.size(), tensors, metadata);
      FAIL("a header that is not JSON was accepted");
    } catch (const IOError& e) {
      const std::string message = e.what();
      CHECK(message.find("not valid JSON") != std::string::npos);
      CHECK(message.find("\\xff") != std::string::npos);
      CHECK(std::none_of(message.begin(), message.end(), [](char c) { return static_cast<unsigned char>(c) >= 0x80; }));
    }
  }
  std::string deep;
  for (int i = 0; i < 40; ++i) deep += "{\"a\": ";
  rejects(deep + "1" + std::string(40, '}'), 0, "nested too deeply");
  rejects("{\"__metadata__\": {\"k\": 1}}", 0, "not a string");

  // An empty tensor owns no bytes, so its offsets may sit inside another tensor's range.
  std::vector<safetensors::TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  const std::string header =
      "{\"x\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
      " \"e\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [4, 4]}}";
  safetensors::parse_header(header, 8 + header.size() + 8, tensors, metadata);
  CHECK(tensors.size() == 2);
}

namespace {

// A safetensors file as another writer may have made it: `header` (padded to 8 bytes), then `data`.
void write_raw(const fs::path& path, std::string header, const std::string& data) {
  header.append((8 - header.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(static_cast<std::uint64_t>(header.size()) >> (8 * i)));
  out << header << data;
}

// No file and no temporary at `path`.
void check_nothing_at(const fs::path& path) {
  CHECK_FALSE(fs::exists(path));
  CHECK(test::temporaries_in(path.parent_path()).empty());
}

// A Writer of `headers` at `path` raises E with every fragment and leaves nothing there.
template <class E>
void writer_refuses(const fs::path& path, const std::vector<safetensors::TensorHeader>& headers,
                    const std::vector<std::string>& fragments,
                    const std::map<std::string, std::string>& metadata = {}) {
  test::check_throws<E>([&] { safetensors::Writer w(path.string(), headers, metadata); }, fragments);
  check_nothing_at(path);
}

}  // namespace

TEST_CASE("safetensors::Writer refuses what its Reader would reject, naming the tensor, before writing") {
  TempDir dir;
  const fs::path path = dir.path / "w.safetensors";
  // 2^61 f64 elements are 2^64 bytes: the byte count wrapped to 0 and the header said [0, 0).
  writer_refuses<ShapeError>(path, {{"a", DType::f64, {std::int64_t{1} << 61}}}, {"w.safetensors", "'a'", "F64"});
  // Each fits; together they pass what a file's offsets hold.
  writer_refuses<ShapeError>(path,
                             {{"a", DType::f32, {std::int64_t{1} << 60}}, {"b", DType::f32, {std::int64_t{1} << 60}}},
                             {"'b'", "more bytes than a file can hold"});
  writer_refuses<ShapeError>(path, {{"a", DType::f32, {0, std::int64_t{1} << 40, std::int64_t{1} << 40}}},
                             {"'a'", "overflows"});
  writer_refuses<ShapeError>(path, {{"a", DType::f32, {2, -1}}}, {"'a'", "negative extent"});
  writer_refuses<ShapeError>(path, {{"a", DType::f32, Shape(9, 1)}}, {"'a'", "9 dimensions"});
  // A number cast to DType was written as dtype "?".
  writer_refuses<DTypeError>(path, {{"a", static_cast<DType>(42), {3}}}, {"w.safetensors", "'a'", "42"});
  writer_refuses<ArgumentError>(path, {{"\xff", DType::f32, {1}}}, {"w.safetensors", "JSON"});
  writer_refuses<ArgumentError>(path, {{"a", DType::f32, {1}}}, {"header", "readers accept"},
                                {{"big", std::string((std::size_t{100} << 20) + 1, 'x')}});

  // An empty tensor's other extents may be anything whose product fits: it round-trips.
  const Shape wide = {100, 100, 100, 100, 100, 100, 100, 0};
  safetensors::write(path.string(), {{"e", zeros(wide)}, {"x", ones({2})}});
  safetensors::Reader r(path.string());
  CHECK(r.read("e").shape() == wide);
  test::check_close(r.read("x"), {1, 1}, {2});
}

TEST_CASE("a failed commit leaves no temporary behind") {
  TempDir dir;
  SUBCASE("write() whose destination is a directory") {
    const fs::path target = dir.path / "somedir";
    fs::create_directories(target / "inside");
    test::check_throws<IOError>(
        [&] {
          safetensors::write(target.string(), {{"a", ones({2})}});
        },
        {"somedir", "directory"});
    CHECK(test::temporaries_in(dir.path).empty());
    CHECK(fs::is_directory(target / "inside"));
  }
  SUBCASE("a Writer whose destination became a directory before its commit, and a second commit") {
    const fs::path target = dir.path / "empty-dir";
    safetensors::Writer w(target.string(), {{"a", DType::f32, {1}}});
    fs::create_directories(target);
    const float one = 1;
    w.write(&one, 4);
    test::check_throws<IOError>([&] { w.commit(); }, {"empty-dir", "directory"});
    CHECK(test::temporaries_in(dir.path).empty());
    test::check_throws<IOError>([&] { w.commit(); }, {"empty-dir", "after its commit"});
    CHECK(test::temporaries_in(dir.path).empty());
    CHECK(fs::is_directory(target));
  }
}

namespace {
bool is_a_fifo(const fs::path& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISFIFO(st.st_mode);
}
}  // namespace

TEST_CASE(
    "atomic writes: a link at the temporary's name is not followed; a FIFO, a device or a link at the destination is "
    "refused") {
  TempDir dir;
  const fs::path victim = dir.path / "victim.txt";
  std::ofstream(victim) << "victim";
  const fs::path out = dir.path / "out.safetensors";
  // A link planted where the temporary file was always made (out.safetensors.tmp): the write used
  // to go through it, overwriting the victim, and then renamed the link itself into place.
  fs::create_symlink(victim, out.string() + ".tmp");
  safetensors::write(out.string(), {{"a", ones({3})}});
  CHECK(test::file_text(victim) == "victim");
  CHECK(fs::is_symlink(out.string() + ".tmp"));  // not ours: left alone
  CHECK_FALSE(fs::is_symlink(out));
  test::check_close(safetensors::Reader(out.string()).read("a"), {1, 1, 1}, {3});

  // A FIFO at the destination: refused by name, and still a FIFO (it was replaced by a regular file).
  const fs::path fifo = dir.path / "fifo.safetensors";
  REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
  test::check_throws<IOError>(
      [&] {
        safetensors::write(fifo.string(), {{"a", ones({3})}});
      },
      {"fifo.safetensors", "FIFO", "not replaced"});
  CHECK(is_a_fifo(fifo));
  // A symbolic link at the destination, even to a regular file: refused; the link and its target stay.
  const fs::path link = dir.path / "link.safetensors";
  fs::create_symlink(victim, link);
  test::check_throws<IOError>(
      [&] {
        safetensors::write(link.string(), {{"a", ones({3})}});
      },
      {"link.safetensors", "symbolic link"});
  CHECK(fs::is_symlink(link));
  CHECK(test::file_text(victim) == "victim");
  // A link to a device (a FIFO of our own stands in for one): refused, the FIFO untouched.
  const fs::path to_fifo = dir.path / "to-fifo.safetensors";
  fs::create_symlink(fifo, to_fifo);
  CHECK_THROWS_AS(safetensors::write(to_fifo.string(), {{"a", ones({3})}}), IOError);
  CHECK(is_a_fifo(fifo));
  // Nothing to write to: an empty name, or a directory's.
  {
    // (From inside the temporary directory: an empty name used to write ".tmp" in the working directory.)
    const fs::path cwd = fs::current_path();
    fs::current_path(dir.path);
    CHECK_THROWS_WITH_AS(safetensors::write("", {{"a", ones({3})}}), doctest::Contains("not a file name"), IOError);
    fs::current_path(cwd);
  }
  test::check_throws<IOError>([&] { safetensors::write(dir.str() + "/", {{"a", ones({3})}}); }, {"not a file name"});
  const std::vector<std::string> left = test::temporaries_in(dir.path);
  CHECK(left == std::vector<std::string>{"out.safetensors.tmp"});  // the planted link only

  // A checkpoint's writes alike: links planted at the fixed temporary names are not followed.
  const fs::path ckpt = dir.path / "ckpt";
  fs::create_directories(ckpt / "step-00000001");
  fs::create_symlink(victim, ckpt / "latest.tmp");
  fs::create_symlink(victim, ckpt / "step-00000001" / "index.json.tmp");
  fs::create_symlink(victim, ckpt / "step-00000001" / "rank-00000-of-00001.safetensors.tmp");
  {
    LocalCommunicator comm;
    nn::manual_seed(1);
    nn::Linear layer(4, 3);
    nn::save_checkpoint(ckpt.string(), 1, layer, nullptr, comm);
  }
  CHECK(test::file_text(victim) == "victim");
  CHECK(nn::verify_checkpoint(ckpt.string()) > 0);
  // ... and consolidate refuses a FIFO as its output, leaving it a FIFO.
  test::check_throws<IOError>([&] { nn::consolidate_checkpoint(ckpt.string(), fifo.string()); },
                              {"fifo.safetensors", "FIFO"});
  CHECK(is_a_fifo(fifo));
}

TEST_CASE("atomic writes: a replaced file keeps its permissions, a new one gets 0666 less the umask") {
  // The temporary was made 0644 and renamed over the file: a 0600 file of private weights became
  // readable by every user when a save replaced it.
  TempDir dir;
  const fs::path out = dir.path / "w.safetensors";
  const mode_t mask = ::umask(0022);
  ::umask(mask);  // read back
  safetensors::write(out.string(), {{"a", ones({3})}});
  struct stat st {};
  REQUIRE(::stat(out.c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == (0666 & ~mask));
  for (const mode_t mode : {mode_t{0600}, mode_t{0640}, mode_t{0444}}) {
    CAPTURE(mode);
    REQUIRE(::chmod(out.c_str(), mode) == 0);
    safetensors::write(out.string(), {{"a", zeros({3})}});
    REQUIRE(::stat(out.c_str(), &st) == 0);
    CHECK((st.st_mode & 07777) == mode);
    test::check_close(safetensors::Reader(out.string()).read("a"), {0, 0, 0}, {3});
  }
}

TEST_CASE("atomic writes: concurrent writers of one path each write their own temporary file") {
  // They shared path.tmp: one renamed the other's half-written file into place, or found it gone.
  TempDir dir;
  const fs::path path = dir.path / "shared.safetensors";
  const std::int64_t n = 1 << 18;  // 1 MiB of f32: long enough for the writes to overlap
  std::vector<std::string> errors(2);
  std::vector<std::thread> writers;
  for (int w = 0; w < 2; ++w) {
    writers.emplace_back([&, w] {
      const Tensor t = full({n}, static_cast<double>(w + 1));
      for (int i = 0; i < 20 && errors[static_cast<std::size_t>(w)].empty(); ++i) {
        try {
          safetensors::write(path.string(), {{"t", t}});
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(w)] = e.what();
        }
      }
    });
  }
  for (auto& t : writers) t.join();
  CHECK_MESSAGE(errors[0].empty(), errors[0]);
  CHECK_MESSAGE(errors[1].empty(), errors[1]);
  // One writer's complete file.
  const auto values = safetensors::Reader(path.string()).read("t").to_vector<float>();
  REQUIRE(values.size() == static_cast<std::size_t>(n));
  CHECK((values.front() == 1.0f || values.front() == 2.0f));
  CHECK(std::all_of(values.begin(), values.end(), [&](float v) { return v == values.front(); }));
  CHECK(test::temporaries_in(dir.path).empty());
}

TEST_CASE("safetensors: BOOL bytes other than 0 and 1 are refused by every read, naming the element") {
  TempDir dir;
  const fs::path path = dir.path / "b.safetensors";
  write_raw(path,
            "{\"b\": {\"dtype\": \"BOOL\", \"shape\": [4], \"data_offsets\": [0, 4]},"
            " \"ok\": {\"dtype\": \"BOOL\", \"shape\": [2], \"data_offsets\": [4, 6]}}",
            std::string("\x02\x01\x00\xff\x01\x00", 6));
  safetensors::Reader r(path.string());  // the header is valid: the values are checked as read
  test::check_close(r.read("ok"), from_values({1, 0}, {2}, DType::boolean), 0, 0);
  test::check_throws<IOError>([&] { r.read("b"); }, {"b.safetensors", "'b'", "0x02", "element 0", "BOOL"});
  test::check_close(r.read_range("b", 1, 2), from_values({1, 0}, {2}, DType::boolean), 0, 0);
  test::check_throws<IOError>([&] { r.read_range("b", 1, 3); }, {"'b'", "0xff", "element 3"});
  char out[4];
  test::check_throws<IOError>([&] { r.read_range_into("b", 0, 1, out); }, {"'b'", "element 0"});
  test::check_throws<IOError>([&] { r.read_range_chunked("b", 2, 2, [](const char*, std::size_t) {}); },
                              {"'b'", "element 3"});
  test::check_throws<ArgumentError>([&] { r.read_range_chunked("ok", 0, 1, nullptr); },
                                    {"read_range_chunked", "'ok'", "consume function is empty"});
  safetensors::Writer copy((dir.path / "copy.safetensors").string(), {{"b", DType::boolean, {4}}});
  test::check_throws<IOError>([&] { r.copy_range("b", 0, 4, copy); }, {"'b'", "element 0"});

  // Past the first chunk, the element named is the tensor's, not the chunk's.
  const std::size_t n = safetensors::kChunkBytes + 10;
  std::string data(n, '\1');
  data[n - 3] = '\7';
  write_raw(dir.path / "long.safetensors",
            "{\"b\": {\"dtype\": \"BOOL\", \"shape\": [" + std::to_string(n) + "], \"data_offsets\": [0, " +
                std::to_string(n) + "]}}",
            data);
  safetensors::Reader long_file((dir.path / "long.safetensors").string());
  const std::string at = "element " + std::to_string(n - 3);
  test::check_throws<IOError>(
      [&] { long_file.read_range_chunked("b", 5, static_cast<std::int64_t>(n - 5), [](const char*, std::size_t) {}); },
      {"0x07", at});
  test::check_throws<IOError>([&] { long_file.read("b"); }, {"0x07", at});

  // The Writer refuses such bytes too (it committed a file its own Reader refused), naming the
  // tensor and its element across pieces and across tensors placed out of order.
  const fs::path written = dir.path / "w.safetensors";
  {
    safetensors::Writer w(written.string(), {{"x", DType::f32, {1}}, {"flags", DType::boolean, {3}}});
    const float one = 1;
    w.write(&one, sizeof one);
    w.write("\1\0", 2);
    test::check_throws<ArgumentError>([&] { w.write("\2", 1); }, {"w.safetensors", "'flags'", "0x02", "element 2"});
  }
  CHECK_FALSE(fs::exists(written));
  test::check_throws<DTypeError>([] { safetensors::format_dtype(static_cast<DType>(33)); }, {"format_dtype", "33"});
}

TEST_CASE("safetensors: a range read checks its range against the tensor before allocating") {
  TempDir dir;
  const std::string path = (dir.path / "r.safetensors").string();
  safetensors::write(path, {{"a", from_values({1, 2}, {2})}});
  safetensors::Reader r(path);
  // Was an attempt to allocate 4.4 TB (OutOfMemoryError) and a ShapeError from "empty".
  test::check_throws<IOError>([&] { r.read_range("a", 0, std::int64_t{1} << 40); },
                              {"r.safetensors", "read_range", "'a'", "of 2 elements"});
  test::check_throws<IOError>([&] { r.read_range("a", 0, -1); }, {"read_range", "'a'", "of 2 elements"});
  test::check_throws<IOError>([&] { r.read_range("a", -1, 1); }, {"read_range", "'a'"});
  test::check_throws<IOError>([&] { r.read_range("a", INT64_MAX, 1); }, {"read_range", "'a'"});
  float out[2];
  test::check_throws<IOError>([&] { r.read_range_into("a", 1, 2, out); }, {"read_range_into", "'a'", "of 2"});
  test::check_throws<IOError>([&] { r.read_range_chunked("a", 3, 0, [](const char*, std::size_t) {}); },
                              {"read_range_chunked", "'a'"});
  CHECK(r.read_range("a", 2, 0).numel() == 0);
  test::check_close(r.read_range("a", 1, 1), {2}, {1});
}

TEST_CASE("safetensors: tensors are placed aligned to their element size, whatever order they come in") {
  // In the order given, a 3-byte bool tensor first put the f32 after it at an odd offset, which
  // zero-copy readers refuse (torch.frombuffer: "storage_offset() must be divisible by 4").
  TempDir dir;
  const std::string path = (dir.path / "mixed.safetensors").string();
  const std::vector<std::pair<std::string, Tensor>> tensors = {
      {"flags", from_values({1, 0, 1}, {3}).to(DType::boolean)},
      {"f32", from_values({1.5, -2, 3}, {3})},
      {"f16", from_values({0.5, 0.25, 8, 1}, {2, 2}).to(DType::f16)},
      {"f64", from_values({1e300, -1e-300}, {2}, DType::f64)},
      {"bf16", from_values({3, 5, 7}, {3}).to(DType::bf16)},
      {"empty", zeros({0, 4})},
      {"ids", from_values({1, 2}, {2}, DType::i64)}};
  safetensors::write(path, tensors, {{"k", "v"}});
  safetensors::Reader r(path);
  for (const auto& t : r.tensors()) {
    CAPTURE(t.name);
    CHECK(t.begin % dtype_size(t.dtype) == 0);
  }
  for (const auto& [name, t] : tensors) {
    CAPTURE(name);
    const Tensor back = r.read(name);
    CHECK(back.dtype() == t.dtype());
    CHECK(back.shape() == t.shape());
    CHECK(back.to(DType::f64).to_vector<double>() == t.to(DType::f64).to_vector<double>());
  }
  // The streaming writer takes the bytes in the order given, in pieces that cross tensors.
  const std::string streamed = (dir.path / "streamed.safetensors").string();
  std::vector<safetensors::TensorHeader> header;
  std::string bytes;
  for (const auto& [name, t] : tensors) {
    header.push_back({name, t.dtype(), t.shape()});
    bytes.append(static_cast<const char*>(t.data_ptr()), t.nbytes());
  }
  {
    safetensors::Writer w(streamed, header, {{"k", "v"}});
    for (std::size_t at = 0; at < bytes.size(); at += 5)
      w.write(bytes.data() + at, std::min<std::size_t>(5, bytes.size() - at));
    w.commit();
  }
  CHECK(test::file_text(streamed) == test::file_text(path));
}

namespace {
// The tensors a header describes, in a file of that header and `data_bytes` bytes of data.
std::vector<safetensors::TensorInfo> parse(const std::string& header, std::uint64_t data_bytes) {
  std::vector<safetensors::TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  safetensors::parse_header(header, 8 + header.size() + data_bytes, tensors, metadata);
  return tensors;
}
}  // namespace

TEST_CASE("safetensors: the tensors' bytes fill the data exactly, the header has no NUL, null metadata is none") {
  // What the reference reader refuses, refused here too (a checksum over the tensors' own bytes
  // cannot notice bytes appended after them); and the null __metadata__ it accepts, accepted.
  TempDir dir;
  const std::string two =
      "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
      " \"b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [8, 12]}}";
  test::check_throws<IOError>([&] { parse(two, 12); }, {"header", "data bytes [4, 8) unused", "'b'"});
  const std::string late = "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}";
  test::check_throws<IOError>([&] { parse(late, 8); }, {"data bytes [0, 4) unused", "'a'"});
  const std::string one = "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}";
  CHECK(parse(one, 4).size() == 1);
  test::check_throws<IOError>([&] { parse(one, 7); }, {"last 3 bytes of the file unused"});
  test::check_throws<IOError>([&] { parse("{}", 1); }, {"last 1 bytes of the file unused"});
  // A file with bytes appended after its data, as a damaged copy or a concatenation leaves it.
  const std::string path = (dir.path / "appended.safetensors").string();
  safetensors::write(path, {{"a", from_values({1, 2}, {2})}});
  std::ofstream(path, std::ios::app | std::ios::binary) << "GARBAGE";
  test::check_throws<IOError>([&] { safetensors::Reader r(path); }, {"appended.safetensors", "7 bytes", "unused"});
  // Whatever follows a NUL would be ignored by this reader's JSON parser and read by others.
  test::check_throws<IOError>([&] { parse(one + std::string(1, '\0') + " {\"b\": 1}", 4); }, {"NUL byte"});
  std::vector<safetensors::TensorInfo> tensors;
  std::map<std::string, std::string> metadata{{"stale", "x"}};
  const std::string null_metadata =
      "{\"__metadata__\": null, \"a\": {\"dtype\": \"F32\", \"shape\": [1], "
      "\"data_offsets\": [0, 4]}}";
  safetensors::parse_header(null_metadata, 8 + null_metadata.size() + 4, tensors, metadata);
  CHECK(tensors.size() == 1);
  CHECK(metadata.empty());
}

TEST_CASE("safetensors: a repeated key is refused, and any zero extent makes a tensor empty") {
  TempDir dir;
  // Last one won: the file read as another than a reader keeping the first would see.
  const std::string twice =
      "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
      " \"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}";
  test::check_throws<IOError>([&] { parse(twice, 8); }, {"'a' twice"});
  write_raw(dir.path / "twice.safetensors", twice, std::string(8, '\0'));
  test::check_throws<IOError>([&] { safetensors::Reader r((dir.path / "twice.safetensors").string()); },
                              {"twice.safetensors", "'a' twice"});
  test::check_throws<IOError>(
      [&] { parse("{\"a\": {\"dtype\": \"F32\", \"dtype\": \"F64\", \"shape\": [0], \"data_offsets\": [0, 0]}}", 0); },
      {"'dtype' twice"});
  test::check_throws<IOError>([&] { parse("{\"__metadata__\": {\"k\": \"1\", \"k\": \"2\"}}", 0); }, {"'k' twice"});
  // Keys of sibling objects are their own; a repeat after many objects is still seen. (20000
  // one-byte tensors: the check ran in time quadratic in the header, 3 s here and minutes at
  // 200000, through nlohmann's callback parser; it is a SAX pass now.)
  std::string many = "{";
  for (int i = 0; i < 20000; ++i) {
    many += "\"t" + std::to_string(i) + "\": {\"dtype\": \"BOOL\", \"shape\": [1], \"data_offsets\": [" +
            std::to_string(i) + ", " + std::to_string(i + 1) + "]},";
  }
  CHECK(parse(many.substr(0, many.size() - 1) + "}", 20000).size() == 20000);
  test::check_throws<IOError>(
      [&] { parse(many + "\"t7\": {\"dtype\": \"BOOL\", \"shape\": [0], \"data_offsets\": [0, 0]}}", 20000); },
      {"'t7' twice"});

  // The zero may come last: the product before it is no element count.
  for (const char* shape :
       {"[100, 100, 100, 100, 100, 100, 100, 0]", "[0, 100, 100, 100, 100, 100, 100, 100]", "[4294967296, 0]"}) {
    CAPTURE(shape);
    const auto tensors =
        parse(std::string("{\"e\": {\"dtype\": \"F32\", \"shape\": ") + shape + ", \"data_offsets\": [0, 0]}}", 0);
    REQUIRE(tensors.size() == 1);
    CHECK(tensors[0].numel() == 0);
  }
  const std::string last = "{\"e\": {\"dtype\": \"F32\", \"shape\": [100, 100, 100, 0], \"data_offsets\": [0, 0]}}";
  write_raw(dir.path / "empty.safetensors", last, "");
  CHECK(safetensors::Reader((dir.path / "empty.safetensors").string()).read("e").shape() == Shape{100, 100, 100, 0});
  // The nonzero extents' product must still fit (strides are products of extents).
  for (const char* shape : {"[4294967296, 4294967296, 0]", "[0, 4294967296, 4294967296]", "[9223372036854775808, 0]"}) {
    CAPTURE(shape);
    test::check_throws<IOError>(
        [&] {
          parse(std::string("{\"e\": {\"dtype\": \"F32\", \"shape\": ") + shape + ", \"data_offsets\": [0, 0]}}", 8);
        },
        {"'e'", "overflows"});
  }
  test::check_throws<IOError>(
      [&] { parse("{\"x\": {\"dtype\": \"F32\", \"shape\": [3, 3], \"data_offsets\": [0, 36]}}", 8); },
      {"larger than the file"});
}

TEST_CASE("an independent reader (Python) reads the files") {
  TempDir dir;
  const std::string path = (dir.path / "x.safetensors").string();
  const Tensor f = from_values({0.25, -1, 3e5}, {3});
  const Tensor d = arange(0, 6, 1, DType::f64).reshape({3, 2});
  const Tensor i = from_values({-7, 9}, {2}, DType::i64);
  safetensors::write(path, {{"f", f}, {"d", d}, {"i", i}}, {{"who", "ruda"}});
  const std::string command = "python3 " RUDA_TEST_DATA "/read_safetensors.py " + path +
                              " 'f=F32:3:0.25,-1,300000' 'd=F64:3x2:0,1,2,3,4,5' 'i=I64:2:-7,9' 'who=ruda'";
  CHECK(std::system(command.c_str()) == 0);
}
