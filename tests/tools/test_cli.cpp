// ruda-train and ruda-ckpt as a user runs them: bad input gives one line naming the file or
// option and a non-zero exit; a job killed while writing a checkpoint leaves the previous one
// loadable; a short Fashion-MNIST run learns.
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string_view>
#include <system_error>

#include <nlohmann/json.hpp>

#include "helpers.h"

namespace fs = std::filesystem;

namespace {

struct Run {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Under AddressSanitizer, the environment of MPI tests asks for the slow malloc unwinder
// (fast_unwind_on_malloc=0), without which LeakSanitizer cannot trace OpenMPI's own leaks into
// the libraries its suppressions name. Only runs under mpiexec initialize MPI; the others get the
// fast unwinder back: ruda-train's memory-plan searches allocate so much that a run took 56 s
// with the slow one and 12 s without (test_tools_cli took ~410 s of an ASan CI run).
std::string fast_unwind_outside_mpiexec(const std::string& command) {
  const char* asan = std::getenv("ASAN_OPTIONS");
  if (!asan || std::string_view(asan).find("fast_unwind_on_malloc=0") == std::string_view::npos) return {};
  if (command.find("mpiexec") != std::string::npos) return {};
  return "ASAN_OPTIONS='" + std::string(asan) + ":fast_unwind_on_malloc=1'";
}

Run run(const std::string& command, const std::string& env = "") {
  Run r;
  std::string full;
  for (const std::string& part : {fast_unwind_outside_mpiexec(command), env}) {
    if (!part.empty()) full += part + " ";
  }
  full += command + " 2>&1";
  FILE* pipe = ::popen(full.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::array<char, 4096> buf;
  while (std::fgets(buf.data(), buf.size(), pipe)) r.output += buf.data();
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

std::string train(const std::string& args) { return std::string(RUDA_TRAIN_BIN) + " " + args; }
std::string ckpt(const std::string& args) { return std::string(RUDA_CKPT_BIN) + " " + args; }

using ruda::test::TempDir;

// A small, fast training configuration (a tiny hidden layer, a slice of the data).
const std::string kSmall = "--hidden 32 --limit 640 --test-limit 200 --batch 64 --log-every 0";

void one_error_line(const Run& r, const std::vector<std::string>& fragments) {
  INFO("output: " << r.output);
  CHECK(r.exit_code != 0);
  std::istringstream lines(r.output);
  std::string line, error;
  int errors = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("ruda-train: error: ", 0) == 0 || line.rfind("ruda-ckpt: error: ", 0) == 0) {
      ++errors;
      error = line;
    }
  }
  CHECK(errors == 1);
  for (const auto& f : fragments)
    CHECK_MESSAGE(error.find(f) != std::string::npos, "'" << error << "' lacks '" << f << "'");
  CHECK(r.output.find("terminate called") == std::string::npos);  // no uncaught exception, no stack trace
}

// The last JSON line of a metrics file.
nlohmann::json last_record(const std::string& metrics) {
  std::ifstream in(metrics);
  std::string line, final;
  while (std::getline(in, line)) final = line;
  return nlohmann::json::parse(final);
}

// The number that follows `key` in `text` ("final loss 5.29": number_after(text, "final loss ")).
double number_after(const std::string& text, const std::string& key) {
  const std::size_t at = text.find(key);
  REQUIRE_MESSAGE(at != std::string::npos, text);
  return std::stod(text.substr(at + key.size()));
}

// The size after `key` in memory::format_bytes' form ("312 KB", "1.23 MB"), in bytes.
double bytes_after(const std::string& text, const std::string& key) {
  const std::size_t at = text.find(key);
  REQUIRE_MESSAGE(at != std::string::npos, text);
  std::istringstream in(text.substr(at + key.size()));
  double number = 0;
  std::string unit;
  in >> number >> unit;
  const std::map<std::string, double> scale{{"B", 1}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}};
  REQUIRE_MESSAGE(scale.count(unit), text);
  return number * scale.at(unit);
}

// step -> loss from a metrics file.
std::map<std::int64_t, double> losses(const std::string& metrics) {
  std::map<std::int64_t, double> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    out[j["step"].get<std::int64_t>()] = j["loss"].get<double>();
  }
  return out;
}

}  // namespace

TEST_CASE("bad input: one line naming the file or option, and a non-zero exit") {
  TempDir tmp;
  one_error_line(run(train("mlp --data /nonexistent")), {"/nonexistent/train-images-idx3-ubyte.gz", "no such file"});
  one_error_line(run(train("lm --text /nonexistent.txt")), {"/nonexistent.txt", "no such file"});
  one_error_line(run(train("mlp --bogus 3")), {"'mlp' has no option --bogus", "ruda-train mlp --help"});
  // Another subcommand's option is named as its (CLI11 said "not expected: 3 --sample").
  one_error_line(run(train("mlp --sample 3")), {"--sample is an option of 'lm', not of 'mlp'"});
  one_error_line(run(train("lm --hidden=64")), {"--hidden is an option of 'mlp', not of 'lm'"});
  one_error_line(run(ckpt("list " + tmp / "c" + " --keep 2")), {"'list' has no option --keep"});
  one_error_line(run(train("mlp --dtype f8")), {"--dtype", "f8"});
  // A word that is no subcommand is named with the valid ones (it said "A subcommand is required").
  one_error_line(run(train("--emulate 2 mpl")), {"unknown subcommand 'mpl'", "mlp, lm"});
  one_error_line(run(ckpt("lsit " + tmp / "c")), {"unknown subcommand 'lsit'", "list, verify, consolidate, split"});
  // A global batch larger than the training set names the options (it said "BatchSampler").
  one_error_line(run(train("--emulate 2 mlp --limit 10 --batch 32 --epochs 1")),
                 {"--batch 32 (global)", "10 training images", "--limit 10"});
  one_error_line(run(train("--collective-timeout soon mlp")), {"--collective-timeout", "'soon'"});
  one_error_line(run(train("--emulate 3 mlp --batch 128 --hidden 32 --limit 640")), {"--batch 128", "3 ranks"});
  one_error_line(run(train("mlp --resume " + tmp / "none")), {tmp / "none", "does not exist"});
  // A model far past memory is refused from the arithmetic, before its modules are built (2^31
  // blocks grew without bound). A limit below the model's state is refused by the memory plan (the
  // ranks' agreement before it no longer counts against the limit, where its allocation had been
  // the first refused).
  one_error_line(run(train("lm --d-model 16 --heads 2 --context 8 --steps 1 --layers 2147483648")),
                 {"--layers 2147483648", "GB per rank", "optimizer state"});
  one_error_line(run(train("lm --d-model 16 --heads 2 --context 8 --steps 1 --memory-limit 1")),
                 {"memory plan: needs at least", "optimizer state", "limit 1 B", "fits at no world size"});
  // --hidden is one list: an empty item is refused (it was dropped), a repeat replaces (it was joined).
  for (const char* hidden : {"8,,8", ",8", "8,"}) {
    CAPTURE(hidden);
    one_error_line(run(train(std::string("mlp --hidden ") + hidden)), {"--hidden", "got ''"});
  }
  const Run twice =
      run(train("mlp --hidden 8 --hidden 4 " + std::string("--limit 64 --test-limit 10 --batch 32 --epochs 1")));
  CHECK_MESSAGE(twice.output.find("mlp 784-4-10,") != std::string::npos, twice.output);

  // A checkpoint of another model.
  const Run saved = run(train("mlp --epochs 1 " + kSmall + " --checkpoint-dir " + tmp / "a"));
  REQUIRE_MESSAGE(saved.exit_code == 0, saved.output);
  one_error_line(run(train("mlp --epochs 2 --hidden 16 --limit 640 --resume " + tmp / "a")),
                 {"holds model 'mlp 784-32-10'", "'mlp 784-16-10'"});
  // The same model fed another data stream: the resume would not continue the run.
  one_error_line(run(train("mlp --epochs 2 " + kSmall + " --seed 7 --resume " + tmp / "a")),
                 {"--seed 7 differs from the --seed 1 of", "step-00000010"});
  one_error_line(run(train("mlp --epochs 2 --hidden 32 --limit 640 --batch 32 --resume " + tmp / "a")),
                 {"--batch 32 differs from the --batch 64"});
  // A corrupt checkpoint: a rank file cut short.
  for (const auto& entry : fs::recursive_directory_iterator(tmp.path / "a")) {
    if (entry.path().extension() == ".safetensors") fs::resize_file(entry.path(), fs::file_size(entry.path()) / 2);
  }
  one_error_line(run(train("mlp --epochs 2 " + kSmall + " --resume " + tmp / "a")),
                 {"rank-00000-of-00001.safetensors"});
  one_error_line(run(ckpt("verify " + tmp / "a")), {"rank-00000-of-00001.safetensors"});
}

TEST_CASE("option bounds in words, and an option given twice takes its last value") {
  one_error_line(run(train("--unsharded-groups 0 mlp")),
                 {"--unsharded-groups: must be at least 1 (1 keeps only the computing group unsharded), got 0"});
  one_error_line(run(train("mlp --epochs 0")), {"--epochs: must be at least 1, got 0"});
  one_error_line(run(train("mlp --lr 0")), {"--lr: must be greater than 0, got 0"});
  one_error_line(run(train("mlp --lr fast")), {"--lr: must be a number, got 'fast'"});
  one_error_line(run(train("--emulate 65 mlp")), {"--emulate: must be between 1 and 64, got 65"});
  one_error_line(run(train("mlp --hidden 32,0")), {"--hidden: must be at least 1, got 0"});
  one_error_line(run(train("lm --temperature -1")), {"--temperature: must be at least 0, got -1"});
  one_error_line(run(train("--backend cuda mlp")), {"--backend: cuda not in {eigen"});
  // Said by the options, not by the layer or the loader that would meet them.
  one_error_line(run(train("lm --d-model 16 --heads 3")), {"--d-model 16 is not a multiple of --heads 3"});
  {
    TempDir tmp;
    std::ofstream(tmp / "file") << "not a folder";
    one_error_line(run(train("mlp --data " + tmp / "file")), {"--data " + tmp / "file" + ": is not a directory"});
  }
  one_error_line(run(ckpt("split x.safetensors --world 0 --out y")), {"--world: must be at least 1, got 0"});
  for (const auto& r : {run(train("mlp --epochs 0")), run(ckpt("split x.safetensors --world 0 --out y"))}) {
    CHECK_MESSAGE(r.output.find("179769313486231570814527") == std::string::npos, r.output);  // no CLI11 range text
  }
  // tools/demo passes --epochs 10 before the user's arguments: the user's value wins.
  const Run twice = run(train("mlp --epochs 10 " + kSmall + " --epochs 1"));
  CHECK_MESSAGE(twice.exit_code == 0, twice.output);
  CHECK_MESSAGE(twice.output.find("epoch 1/1 ") != std::string::npos, twice.output);
}

TEST_CASE("whole numbers: out of range, negative for an unsigned option, or not decimal are refused in words") {
  TempDir tmp;
  const std::string split = "split " + tmp / "x.safetensors" + " --out " + tmp / "y";
  // CLI11 read 99999999999999999999 as INT64_MAX (strtoll saturates): a checkpoint at step 2^63 - 1.
  one_error_line(run(ckpt(split + " --world 2 --step 99999999999999999999")),
                 {"--step: must be a whole number between -9223372036854775808 and 9223372036854775807, got "
                  "99999999999999999999"});
  one_error_line(run(ckpt(split + " --world 99999999999")),
                 {"--world: must be a whole number between -2147483648 and 2147483647, got 99999999999"});
  one_error_line(run(ckpt(split + " --world 2 --step 1.5")), {"--step: must be a whole number", "got '1.5'"});
  // ruda-train's integer options alike (each run fails on its data before training, were the option taken).
  const std::string no_data = " --data " + tmp / "none";
  one_error_line(run(train("mlp --steps 99999999999999999999" + no_data)),
                 {"--steps: must be a whole number", "got 99999999999999999999"});
  one_error_line(run(train("--seed -1 mlp" + no_data)),  // was 2^64 - 1 (strtoull wraps)
                 {"--seed: must be a whole number between 0 and 18446744073709551615, got -1"});
  one_error_line(run(train("--epochs 0x10 mlp" + no_data)), {"--epochs: must be a whole number", "'0x10'"});
  one_error_line(run(train("--epochs +-5 mlp" + no_data)), {"--epochs: must be a whole number", "'+-5'"});
  one_error_line(run(train("mlp --hidden 32,99999999999999999999" + no_data)),
                 {"--hidden: must be a whole number", "got 99999999999999999999"});
  // A leading zero is decimal: --emulate 010 ran 8 ranks (octal).
  one_error_line(run(train("--emulate 010 mlp --batch 12" + no_data)), {"--batch 12 does not divide over 10 ranks"});
  // The bounds still apply to the number read.
  one_error_line(run(train("mlp --epochs 00" + no_data)), {"--epochs: must be at least 1, got 0"});
}

TEST_CASE("ruda-ckpt list: a total of elements past int64 is printed exactly, not wrapped negative") {
  TempDir tmp;
  const fs::path step = tmp.path / "c" / "step-00000001";
  fs::create_directories(step);
  // An index alone (list reads no rank file): three parameters of 2^62 elements each.
  nlohmann::json params = nlohmann::json::object();
  const std::int64_t huge = std::int64_t{1} << 62;
  for (const char* name : {"a", "b", "c"}) {
    params[name] = {{"shape", {huge}},
                    {"dtype", "f32"},
                    {"pieces", nlohmann::json::array({{{"rank", 0}, {"offset", 0}, {"count", huge}}})}};
  }
  const nlohmann::json index = {
      {"format", "ruda-sharded-checkpoint"},          {"version", 1},    {"step", 1}, {"world_size", 1},
      {"files", {"rank-00000-of-00001.safetensors"}}, {"params", params}};
  std::ofstream(step / "index.json") << index.dump();
  const Run list = run(ckpt("list " + step.string()));
  CHECK_MESSAGE(list.exit_code == 0, list.output);
  CHECK_MESSAGE(list.output.find("  13835058055282163712 elements") != std::string::npos, list.output);
}

TEST_CASE("lm --weight-decay-2d-only: saved with its two optimizer groups, resumed with them, refused without") {
  TempDir tmp;
  const std::string lm =
      "--emulate 2 lm --d-model 32 --layers 1 --heads 2 --context 16 --eval-every 0 --weight-decay-2d-only";
  const Run saved = run(train(lm + " --steps 2 --checkpoint-dir " + tmp / "c"));
  REQUIRE_MESSAGE(saved.exit_code == 0, saved.output);
  const Run resumed = run(train(lm + " --steps 3 --resume-latest --checkpoint-dir " + tmp / "c"));
  CHECK_MESSAGE(resumed.exit_code == 0, resumed.output);
  CHECK_MESSAGE(resumed.output.find("resumed from") != std::string::npos, resumed.output);
  CHECK(resumed.output.find("nothing to train") == std::string::npos);
  // Fewer steps than the checkpoint's: said, not a silent "0 steps" (--steps 0, sampling, stays quiet).
  const Run past = run(train(lm + " --steps 1 --resume-latest --checkpoint-dir " + tmp / "c"));
  CHECK_MESSAGE(past.exit_code == 0, past.output);
  CHECK_MESSAGE(past.output.find("warning: the checkpoint is at step 3, past the run's 1 steps: nothing to train") !=
                    std::string::npos,
                past.output);
  // At the run's last step (the finished run's command again) too: it said nothing, trained 0 steps.
  const Run finished = run(train(lm + " --steps 3 --resume-latest --checkpoint-dir " + tmp / "c"));
  CHECK_MESSAGE(finished.exit_code == 0, finished.output);
  CHECK_MESSAGE(finished.output.find("warning: the checkpoint is at step 3, the run's last of 3: nothing to train") !=
                    std::string::npos,
                finished.output);
  one_error_line(run(train("--emulate 2 lm --d-model 32 --layers 1 --heads 2 --context 16 --eval-every 0 --steps 3 "
                           "--resume-latest --checkpoint-dir " +
                           tmp / "c")),
                 {"was saved with the optimizer groups decay (", "no_decay (", "this optimizer's are default ("});
}

TEST_CASE("a file-size limit: one error line naming the file and the system's reason, no temporary left") {
  // SIGXFSZ killed ruda-train and ruda-ckpt mid-write (exit 153, no message, a temporary file
  // left); the directory check said "cannot write a file there" without the system's reason.
  TempDir tmp;
  const std::string lm =
      "lm --d-model 32 --layers 1 --heads 2 --context 16 --eval-every 0 --steps 2 "
      "--checkpoint-every 2 --checkpoint-dir ";
  one_error_line(run("ulimit -f 0; " + train(lm + tmp / "probe")),
                 {"--checkpoint-dir", "cannot write a file there: File too large"});
  // 40 KB: the directory's checks pass, the first checkpoint (~100 KB) does not fit.
  one_error_line(run("ulimit -f 40; " + train(lm + tmp / "save")), {"rank-00000-of-00001", "File too large"});
  const Run saved = run(train(lm + tmp / "whole"));
  REQUIRE_MESSAGE(saved.exit_code == 0, saved.output);
  one_error_line(run("ulimit -f 40; " + ckpt("consolidate " + tmp / "whole" + " " + tmp / "model.safetensors")),
                 {"model.safetensors", "File too large"});
  CHECK_FALSE(fs::exists(tmp.path / "save" / "latest"));
  CHECK_FALSE(fs::exists(tmp.path / "model.safetensors"));
  for (const auto& entry : fs::recursive_directory_iterator(tmp.path)) {
    CHECK_MESSAGE(entry.path().filename().string().find(".tmp-") == std::string::npos, entry.path());
  }
}

TEST_CASE("lm: a text too short for the context is refused naming the fewest bytes that do") {
  TempDir tmp;
  std::string text;
  for (int i = 0; text.size() < 161; ++i) text += "line " + std::to_string(i) + "\n";
  std::ofstream(tmp / "160.txt") << text.substr(0, 160);
  std::ofstream(tmp / "161.txt") << text.substr(0, 161);
  const std::string lm = " lm --d-model 16 --layers 1 --heads 2 --context 16 --steps 1 --text ";
  one_error_line(run(train(lm + tmp / "160.txt")), {"160 bytes are too few for context 16", "at least 161"});
  const Run enough = run(train(lm + tmp / "161.txt"));
  CHECK_MESSAGE(enough.exit_code == 0, enough.output);
}

TEST_CASE("lm: a resume on another text is refused; the same text under another name resumes") {
  TempDir tmp;
  std::string text;
  for (int i = 0; i < 400; ++i) text += "line " + std::to_string(i) + " of a small corpus\n";
  std::ofstream(tmp / "a.txt") << text;
  std::ofstream(tmp / "same.txt") << text;
  std::ofstream(tmp / "b.txt") << text.substr(0, 1000) + "an edited line\n" + text.substr(1000);  // one more line
  std::ofstream(tmp / "c.txt") << "X" + text.substr(1);  // the same size, edited at its start
  const std::string lm = "lm --d-model 16 --layers 1 --heads 1 --context 16 --batch 4 --eval-every 0 --log-every 0 ";
  const Run saved = run(train(lm + "--steps 2 --text " + tmp / "a.txt" + " --checkpoint-dir " + tmp / "ck"));
  REQUIRE_MESSAGE(saved.exit_code == 0, saved.output);
  for (const char* other : {"b.txt", "c.txt"}) {
    CAPTURE(other);
    one_error_line(
        run(train(lm + "--steps 3 --resume-latest --text " + tmp / other + " --checkpoint-dir " + tmp / "ck")),
        {"--text", "differs from the --text", "would train on other samples"});
  }
  const Run resumed =
      run(train(lm + "--steps 3 --resume-latest --text " + tmp / "same.txt" + " --checkpoint-dir " + tmp / "ck"));
  CHECK_MESSAGE(resumed.exit_code == 0, resumed.output);
  CHECK_MESSAGE(resumed.output.find("resumed from") != std::string::npos, resumed.output);
}

TEST_CASE("lm: sampling a checkpoint (--steps 0 --resume) trains nothing and says so; a total below it too") {
  TempDir tmp;
  const std::string lm = "lm --d-model 16 --layers 1 --heads 1 --context 16 --batch 4 --eval-every 0 --log-every 0 ";
  const Run saved = run(train(lm + "--steps 3 --checkpoint-dir " + tmp / "ck"));
  REQUIRE_MESSAGE(saved.exit_code == 0, saved.output);
  // (It printed "-3 steps" in the banner and "done: -3 steps".)
  const Run sampled = run(train(lm + "--steps 0 --resume " + tmp / "ck" + " --sample 12 --prompt ab"));
  CHECK_MESSAGE(sampled.exit_code == 0, sampled.output);
  CHECK_MESSAGE(sampled.output.find(", 0 steps\n") != std::string::npos, sampled.output);
  CHECK_MESSAGE(sampled.output.find("done: 0 steps") != std::string::npos, sampled.output);
  CHECK_MESSAGE(sampled.output.find(" -3 steps") == std::string::npos, sampled.output);
  const Run below = run(train(lm + "--steps 2 --resume " + tmp / "ck"));
  CHECK_MESSAGE(below.exit_code == 0, below.output);
  CHECK_MESSAGE(below.output.find("done: 0 steps") != std::string::npos, below.output);
  CHECK_MESSAGE(below.output.find("saved by 1 rank, now 1)") != std::string::npos, below.output);
  // Nothing is trained, so no training sample is drawn: another --seed (the sample's seed too) or
  // --batch is no reason to refuse (it was "would train on other samples"); a run that trains is
  // still refused.
  const Run other_seed = run(train(lm + "--steps 0 --resume " + tmp / "ck" + " --sample 12 --seed 5 --batch 2"));
  CHECK_MESSAGE(other_seed.exit_code == 0, other_seed.output);
  CHECK_MESSAGE(other_seed.output.find("--- sample ---") != std::string::npos, other_seed.output);
  one_error_line(run(train(lm + "--steps 4 --resume " + tmp / "ck" + " --seed 5")),
                 {"--seed 5 differs from the --seed 1", "would train on other samples"});
}

TEST_CASE("outputs are checked before the first step, and nothing a run or ruda-ckpt writes damages a checkpoint") {
  TempDir tmp;
  const std::string lm = "lm --d-model 16 --layers 1 --heads 1 --context 16 --batch 4 --eval-every 0 --log-every 0 ";
  std::ofstream(tmp / "file") << "x";
  // Unusable outputs: refused at setup, before any training (a failed first save lost the run).
  for (const std::string& dir : {tmp / "file", std::string("/dev/null")}) {
    CAPTURE(dir);
    const Run r = run(train(lm + "--steps 2 --checkpoint-dir " + dir));
    one_error_line(r, {"--checkpoint-dir", "is not a directory"});
    CHECK(r.output.find("done:") == std::string::npos);
  }
  one_error_line(run(train(lm + "--steps 2 --metrics /dev/full")), {"--metrics", "not a regular file"});
  std::string text;
  for (int i = 0; i < 400; ++i) text += "line " + std::to_string(i) + " of a small corpus\n";
  std::ofstream(tmp / "t.txt") << text;
  one_error_line(run(train(lm + "--steps 2 --text " + tmp / "t.txt" + " --metrics " + tmp / "t.txt")),
                 {"--metrics", "an input of this run"});
  CHECK(fs::file_size(tmp / "t.txt") == text.size());  // not truncated
  // Empty values and infinite numbers are refused, not read as "not given" or as within a bound.
  for (const char* option : {"--resume", "--checkpoint-dir", "--metrics", "--text", "--backend"}) {
    CAPTURE(option);
    one_error_line(run(train(lm + "--steps 2 " + option + " ''")), {option, "empty string"});
  }
  one_error_line(run(train(lm + "--steps 2 --sample 3 --temperature inf")), {"--temperature", "finite"});
  one_error_line(run(train(lm + "--steps 2 --sample 3 --temperature 1e-31")), {"--temperature", "1e-30"});
  one_error_line(run(train(lm + "--steps 2 --clip inf")), {"--clip", "finite"});
  one_error_line(run(train(lm + "--steps 2 --lr 0x10")), {"--lr", "decimal number", "'0x10'"});

  // A run with checkpoints at steps 2 and 4.
  const std::string ck = tmp / "ck";
  REQUIRE(run(train(lm + "--steps 4 --checkpoint-every 2 --checkpoint-dir " + ck)).exit_code == 0);
  auto latest = [&] {
    std::ifstream in(ck + "/latest");
    std::string name;
    in >> name;
    return name;
  };
  REQUIRE(latest() == "step-00000004");
  // A fresh run into that directory would replace and prune its steps: refused, naming the ways on.
  one_error_line(run(train(lm + "--steps 2 --checkpoint-dir " + ck)),
                 {ck, "already holds checkpoints", "--resume-latest"});
  one_error_line(run(train(lm + "--steps 2 --metrics " + ck + "/step-00000004/index.json")),
                 {"--metrics", "step directory"});
  // A checkpoint directory in a step directory was hidden behind that step (--resume-latest
  // resumed the outer run's), and one in the data directory was read as data by the next run:
  // refused before step 1, as ruda-ckpt split's --out is.
  for (const std::string& inside : {ck + "/step-00000004", ck + "/step-00000004/nested"}) {
    CAPTURE(inside);
    one_error_line(run(train(lm + "--steps 2 --checkpoint-dir " + inside)), {"--checkpoint-dir", "step", "checkpoint"});
  }
  fs::create_directories(tmp / "corpus");
  std::ofstream(tmp / "corpus/a.txt") << text;
  one_error_line(run(train(lm + "--steps 2 --text " + tmp / "corpus" + " --checkpoint-dir " + tmp / "corpus")),
                 {"--checkpoint-dir", "the --text directory", "read as text"});
  CHECK_FALSE(fs::exists(tmp / "corpus/latest"));
  // A directory inside it is fine: the corpus is its files, not its subdirectories'.
  const Run beside = run(train(lm + "--steps 1 --text " + tmp / "corpus" + " --checkpoint-dir " + tmp / "corpus/ck"));
  CHECK_MESSAGE(beside.exit_code == 0, beside.output);
  // An update that makes the weights infinite is not saved: the good steps and latest stay.
  one_error_line(run(train(lm + "--steps 8 --checkpoint-every 1 --resume-latest --lr 1e308 --checkpoint-dir " + ck)),
                 {"not finite after step 5", "no checkpoint written"});
  CHECK(fs::exists(ck + "/step-00000002/index.json"));
  CHECK(!fs::exists(ck + "/step-00000005"));
  CHECK(latest() == "step-00000004");

  // ruda-ckpt: consolidating into another step's file, splitting over a step that holds optimizer
  // state, splitting a rank file as if it were a model.
  one_error_line(
      run(ckpt("consolidate " + ck + "/step-00000002 " + ck + "/step-00000004/rank-00000-of-00001.safetensors")),
      {"step directory", "damage"});
  REQUIRE(run(ckpt("consolidate " + ck + " " + tmp / "full.safetensors")).exit_code == 0);
  one_error_line(run(ckpt("split " + tmp / "full.safetensors" + " --world 2 --out " + ck + " --step 4")),
                 {"holds optimizer state", "--step"});
  one_error_line(run(ckpt("split " + tmp / "full.safetensors" + " --world 1 --out " + ck + "/step-00000004")),
                 {"holds an index.json", "readers take it for a checkpoint step"});
  one_error_line(
      run(ckpt("split " + ck + "/step-00000004/rank-00000-of-00001.safetensors --world 1 --out " + tmp / "s")),
      {"rank file", "consolidate"});
  const Run verified = run(ckpt("verify " + ck));
  CHECK_MESSAGE(verified.exit_code == 0, verified.output);
  // Metrics beside the steps, in the checkpoint directory resumed from, are no checkpoint's file.
  // A metrics file that went past the checkpoint (steps 5 and 6 of a run the checkpoint left, the
  // last line cut short by a kill) keeps its lines up to step 4: each step once, every line whole
  // (the resumed steps were appended beside the old ones, and the cut line ran into the next).
  {
    std::ofstream(ck + "/m.jsonl") << "{\"step\": 3, \"loss\": 9}\n{\"step\": 4, \"loss\": 9}\n"
                                   << "{\"step\": 5, \"loss\": 9}\n{\"step\": 6, \"lo";
  }
  // A link planted at the name the rewrite once used (m.jsonl.tmp, a fixed name) was followed:
  // the file it named emptied and the link renamed over the metrics file.
  std::ofstream(tmp / "victim.txt") << "someone else's file\n";
  fs::create_symlink(tmp / "victim.txt", ck + "/m.jsonl.tmp");
  // (--log-every 0: the metrics hold every step whatever the progress lines do.)
  const Run resumed = run(train(lm + "--steps 6 --log-every 0 --resume " + ck + " --checkpoint-dir " + ck +
                                " --metrics " + ck + "/m.jsonl"));
  CHECK_MESSAGE(resumed.output.find("resumed from " + ck + "/step-00000004 at step 4") != std::string::npos,
                resumed.output);
  std::vector<std::int64_t> steps;
  {
    std::ifstream in(ck + "/m.jsonl");
    std::string line;
    while (std::getline(in, line)) steps.push_back(nlohmann::json::parse(line).at("step").get<std::int64_t>());
  }
  CHECK(steps == std::vector<std::int64_t>{3, 4, 5, 6});
  CHECK(losses(ck + "/m.jsonl").at(5) != 9.0);  // the resumed run's step 5, not the abandoned one's
  CHECK(fs::is_regular_file(fs::symlink_status(ck + "/m.jsonl")));
  CHECK(ruda::test::file_text(tmp / "victim.txt") == "someone else's file\n");
  fs::remove(ck + "/m.jsonl.tmp");
}

namespace {
// A tiny Fashion-MNIST-shaped directory: `count` training images of rows x cols (and as many
// test images of test_rows x test_cols), labels i % 10 except `bad_label` at sample 3 (if >= 0).
void write_idx_set(const fs::path& dir, std::int64_t count, int rows, int cols, int test_rows, int test_cols,
                   int bad_label = -1) {
  fs::create_directories(dir);
  auto be32 = [](std::ofstream& out, std::uint32_t v) {
    const unsigned char b[4] = {static_cast<unsigned char>(v >> 24), static_cast<unsigned char>(v >> 16),
                                static_cast<unsigned char>(v >> 8), static_cast<unsigned char>(v)};
    out.write(reinterpret_cast<const char*>(b), 4);
  };
  auto write = [&](const std::string& prefix, int r, int c) {
    std::ofstream images(dir / (prefix + "-images-idx3-ubyte"), std::ios::binary);
    be32(images, 0x803);
    be32(images, static_cast<std::uint32_t>(count));
    be32(images, static_cast<std::uint32_t>(r));
    be32(images, static_cast<std::uint32_t>(c));
    for (std::int64_t i = 0; i < count * r * c; ++i) images.put(static_cast<char>(i * 7 % 256));
    std::ofstream labels(dir / (prefix + "-labels-idx1-ubyte"), std::ios::binary);
    be32(labels, 0x801);
    be32(labels, static_cast<std::uint32_t>(count));
    for (std::int64_t i = 0; i < count; ++i)
      labels.put(static_cast<char>(i == 3 && bad_label >= 0 ? bad_label : i % 10));
  };
  write("train", rows, cols);
  write("t10k", test_rows, test_cols);
}
}  // namespace

TEST_CASE("mlp: data that would fail mid-run is refused before training; a resume on other data too") {
  TempDir tmp;
  const std::string mlp = "mlp --hidden 8 --batch 16 --epochs 1 --log-every 0 --data ";
  write_idx_set(tmp.path / "mismatch", 64, 28, 28, 10, 10);
  const Run mismatch = run(train(mlp + tmp / "mismatch"));
  one_error_line(mismatch, {"test images are 10x10", "training images 28x28"});
  CHECK(mismatch.output.find("epoch 1/1") == std::string::npos);  // nothing trained first
  write_idx_set(tmp.path / "empty-images", 64, 0, 28, 0, 28);
  one_error_line(run(train(mlp + tmp / "empty-images")), {"empty-images: the training images are 0x28"});
  write_idx_set(tmp.path / "label", 64, 28, 28, 28, 28, 255);
  one_error_line(run(train(mlp + tmp / "label")), {"training labels hold 255 at sample 3", "0 to 9"});
  // Two data sets of the same shape: a checkpoint of one does not resume on the other.
  write_idx_set(tmp.path / "a", 64, 28, 28, 28, 28);
  write_idx_set(tmp.path / "b", 64, 28, 28, 28, 28, 7);
  REQUIRE(run(train(mlp + tmp / "a" + " --checkpoint-dir " + tmp / "ck")).exit_code == 0);
  one_error_line(run(train("mlp --hidden 8 --batch 16 --epochs 2 --log-every 0 --resume-latest --checkpoint-dir " +
                           tmp / "ck" + " --data " + tmp / "b")),
                 {"--data", "would train on other samples"});
  const Run same = run(train("mlp --hidden 8 --batch 16 --epochs 2 --log-every 0 --resume-latest --checkpoint-dir " +
                             tmp / "ck" + " --data " + tmp / "a"));
  CHECK_MESSAGE(same.output.find("resumed from") != std::string::npos, same.output);
}

TEST_CASE("options this run ignores are named in a warning, once, and the run goes on") {
  const Run mlp =
      run(train("--steps 3 --checkpoint-every 2 mlp --hidden 8 --limit 64 --batch 64 --test-limit 10 "
                "--epochs 1 --log-every 0"));
  CHECK_MESSAGE(mlp.exit_code == 0, mlp.output);
  CHECK(mlp.output.find("warning: --steps has no effect on mlp") != std::string::npos);
  CHECK(mlp.output.find("warning: --checkpoint-every has no effect without --checkpoint-dir") != std::string::npos);
  const Run lm =
      run(train("--epochs 2 --skip-checksums lm --d-model 16 --layers 1 --heads 1 --context 16 --batch 4 "
                "--steps 1 --eval-every 0 --log-every 0 --temperature 0.5"));
  CHECK_MESSAGE(lm.exit_code == 0, lm.output);
  for (const char* w : {"warning: --epochs has no effect on lm", "warning: --prompt and --temperature have no effect",
                        "warning: --skip-checksums has no effect"}) {
    CAPTURE(w);
    CHECK(lm.output.find(w) != std::string::npos);
  }
  // One process without mpiexec (no timeout to apply, no limit to fit to), and --steps 0 sampling
  // without a checkpoint (the random initial weights).
  const Run single =
      run(train("--collective-timeout 5m --no-auto-fit --steps 0 lm --d-model 16 --layers 1 --heads 1 "
                "--context 16 --batch 4 --eval-every 0 --log-every 0 --sample 2"));
  CHECK_MESSAGE(single.exit_code == 0, single.output);
  for (const char* w : {"warning: --collective-timeout has no effect in one process",
                        "warning: --no-auto-fit has no effect without a memory limit",
                        "warning: --sample with --steps 0 and no --resume samples the untrained model"}) {
    CAPTURE(w);
    CHECK(single.output.find(w) != std::string::npos);
  }
  // A link from RUDA_EMULATE_LINK (--emulate-link's default) is one --ranks-per-node shapes.
  const Run env_link = run(train("--emulate 2 --ranks-per-node 2 mlp --hidden 8 --limit 64 --batch 64 "
                                 "--test-limit 10 --epochs 1 --log-every 0"),
                           "RUDA_EMULATE_LINK=1GB/s");
  CHECK_MESSAGE(env_link.exit_code == 0, env_link.output);
  CHECK(env_link.output.find("--ranks-per-node has no effect") == std::string::npos);
  const Run one_rank =
      run(train("--emulate 1 --emulate-link 1GB/s mlp --hidden 8 --limit 64 --batch 64 "
                "--test-limit 10 --epochs 1 --log-every 0"));
  CHECK_MESSAGE(one_rank.exit_code == 0, one_rank.output);
  CHECK(one_rank.output.find("warning: --emulate-link has no effect with --emulate 1") != std::string::npos);
  {
    // --resume-latest into a directory without a checkpoint starts afresh: nothing to skip checks of.
    TempDir empty;
    const Run fresh = run(train("--skip-checksums --resume-latest --checkpoint-dir " + empty.path.string() +
                                " lm --d-model 16 --layers 1 --heads 1 --context 16 --batch 4 --steps 1 "
                                "--eval-every 0 --log-every 0"));
    CHECK_MESSAGE(fresh.exit_code == 0, fresh.output);
    CHECK(fresh.output.find("warning: --skip-checksums has no effect: " + empty.path.string() +
                            " holds no checkpoint") != std::string::npos);
  }
  const Run per_parameter =
      run(train("--per-parameter --overlap on --unsharded-groups 1 --no-prefetch --emulate 2 --ranks-per-node 2 "
                "--collective-timeout 5s mlp --hidden 8 --limit 64 --batch 64 --test-limit 10 "
                "--epochs 1 --log-every 0"));
  CHECK_MESSAGE(per_parameter.exit_code == 0, per_parameter.output);
  for (const char* w : {"warning: --unsharded-groups has no effect with --per-parameter",
                        "warning: --overlap has no effect with --per-parameter",
                        "warning: --no-prefetch has no effect with --per-parameter",
                        "warning: --ranks-per-node has no effect without --hybrid",
                        "warning: --collective-timeout has no effect with --emulate"}) {
    CAPTURE(w);
    CHECK(per_parameter.output.find(w) != std::string::npos);
  }
  // int8 gathers with one rank per shard group: nothing is gathered, and the weights are still rounded.
  const Run alone =
      run(train("--gather-quantization int8 lm --d-model 16 --layers 1 --heads 1 --context 16 --batch 4 "
                "--steps 1 --eval-every 0 --log-every 0"));
  CHECK_MESSAGE(alone.exit_code == 0, alone.output);
  CHECK(alone.output.find("warning: --gather-quantization int8 saves nothing with one rank per shard group") !=
        std::string::npos);
  const Run sharded =
      run(train("--emulate 2 --gather-quantization int8 lm --d-model 16 --layers 1 --heads 1 "
                "--context 16 --batch 4 --steps 1 --eval-every 0 --log-every 0"));
  CHECK_MESSAGE(sharded.exit_code == 0, sharded.output);
  CHECK(sharded.output.find("warning") == std::string::npos);
  // None where every option counts.
  const Run plain = run(train("mlp --hidden 8 --limit 64 --batch 64 --test-limit 10 --epochs 1 --log-every 0"));
  CHECK(plain.output.find("warning") == std::string::npos);
}

TEST_CASE("lm --recompute-gelu: the same losses, less memory per rank") {
  const std::string lm =
      "--emulate 2 lm --d-model 32 --layers 2 --heads 2 --context 32 --batch 8 --eval-every 0 --steps 3";
  const Run kept = run(train(lm));
  const Run recomputed = run(train(lm + " --recompute-gelu"));
  REQUIRE_MESSAGE(kept.exit_code == 0, kept.output);
  REQUIRE_MESSAGE(recomputed.exit_code == 0, recomputed.output);
  CHECK(number_after(kept.output, "final loss ") == doctest::Approx(number_after(recomputed.output, "final loss ")));
  CHECK(bytes_after(kept.output, "peak memory per rank: ") > 0);  // a small peak read "0.0 MB"
  CHECK(bytes_after(recomputed.output, "peak memory per rank: ") < bytes_after(kept.output, "peak memory per rank: "));
}

TEST_CASE("lm --dtype f16: the loss scaler skips overflowing steps, and its scale resumes with the checkpoint") {
  TempDir tmp;
  const std::string lm = "--emulate 2 lm --d-model 32 --layers 2 --heads 2 --context 32 --batch 8 --eval-every 0";
  // Started at 2^20 the scaled gradients overflow f16 for a few steps: skipped, the scale halving.
  const std::string f16 = lm + " --dtype f16 --loss-scale 1048576";
  const Run straight = run(train(f16 + " --steps 8 --metrics " + tmp / "m.jsonl"));
  REQUIRE_MESSAGE(straight.exit_code == 0, straight.output);
  const double skipped = number_after(straight.output, "loss scaling (f16): ");
  CHECK_MESSAGE(skipped >= 1, straight.output);
  CHECK_MESSAGE(skipped < 8, straight.output);
  int skipped_in_metrics = 0;
  std::ifstream metrics(tmp / "m.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const nlohmann::json record = nlohmann::json::parse(line);
    if (!record.contains("loss")) continue;
    REQUIRE(record.contains("loss_scale"));
    skipped_in_metrics += record.at("step_skipped").get<bool>() ? 1 : 0;
  }
  CHECK(skipped_in_metrics == skipped);
  // At the default scale nothing overflows here: f16 trains as f32 does (measured: the same loss to 4 digits).
  const Run f32 = run(train(lm + " --steps 8"));
  const Run f16_default = run(train(lm + " --steps 8 --dtype f16"));
  REQUIRE_MESSAGE(f32.exit_code == 0, f32.output);
  REQUIRE_MESSAGE(f16_default.exit_code == 0, f16_default.output);
  CHECK(number_after(f16_default.output, "final loss ") ==
        doctest::Approx(number_after(f32.output, "final loss ")).epsilon(2e-3));
  CHECK(f16_default.output.find("loss scaling (f16): 0 of 8 steps skipped for inf/NaN gradients, scale 65536") !=
        std::string::npos);
  // Stopped at step 4 and resumed: the same scale and losses as the run that went straight through
  // (a fresh scale of 2^20 would skip the first resumed steps again).
  const std::string dir = tmp / "c";
  REQUIRE(run(train(f16 + " --steps 4 --checkpoint-dir " + dir)).exit_code == 0);
  const Run resumed = run(train(f16 + " --steps 8 --checkpoint-dir " + dir + " --resume-latest"));
  REQUIRE_MESSAGE(resumed.exit_code == 0, resumed.output);
  CHECK(number_after(resumed.output, "final loss ") == number_after(straight.output, "final loss "));
  CHECK(number_after(resumed.output, "steps skipped for inf/NaN gradients, scale ") ==
        number_after(straight.output, "steps skipped for inf/NaN gradients, scale "));
  // --loss-scale given to a resumed run: the checkpoint's scale goes on, and the run says so.
  REQUIRE(run(train(f16 + " --steps 4 --checkpoint-dir " + tmp / "d")).exit_code == 0);
  const Run again =
      run(train(lm + " --dtype f16 --loss-scale 8 --steps 5 --checkpoint-dir " + tmp / "d" + " --resume-latest"));
  CHECK_MESSAGE(again.exit_code == 0, again.output);
  CHECK_MESSAGE(again.output.find("warning: --loss-scale has no effect on a resumed f16 run: it goes on with the "
                                  "checkpoint's scale, 131072") != std::string::npos,
                again.output);
  // The memory check waits for a step that began with the optimizer state a real step made: at
  // step 2 of a run whose first steps were skipped, it read 0.86 of the plan (no moments yet).
  const Run late = run(train(lm + " --dtype f16 --overlap off --steps 10 --loss-scale 16777216"));
  REQUIRE_MESSAGE(late.exit_code == 0, late.output);
  CHECK_MESSAGE(number_after(late.output, "loss scaling (f16): ") >= 3, late.output);
  CHECK_MESSAGE(number_after(late.output, "largest rank; ") >= 0.95, late.output);
  // A scale outside f32's normal range is refused where it is given.
  for (const std::string scale : {"1e-39", "4e38"}) {
    CAPTURE(scale);
    one_error_line(run(train(lm + " --dtype f16 --steps 1 --loss-scale " + scale)),
                   {"--loss-scale: must be ", "got " + scale});
  }
  // Not f16: nothing to scale, said once.
  const Run ignored = run(train(lm + " --steps 1 --loss-scale 8"));
  CHECK(ignored.exit_code == 0);
  CHECK(ignored.output.find("warning: --loss-scale has no effect without --dtype f16") != std::string::npos);
  CHECK(ignored.output.find("loss scaling") == std::string::npos);
}

TEST_CASE("killed while writing a checkpoint: the previous one stays loadable and resumable") {
  TempDir tmp;
  // 10 steps (640 samples / 64), a checkpoint every 5: measure what the first checkpoint writes.
  const std::string args = "--emulate 2 mlp --epochs 1 " + kSmall + " --checkpoint-every 5 --checkpoint-dir ";
  const Run full = run(train(args + tmp / "ok"));
  REQUIRE_MESSAGE(full.exit_code == 0, full.output);
  std::uintmax_t first_bytes = fs::file_size(tmp.path / "ok" / "latest");
  for (const auto& entry : fs::directory_iterator(tmp.path / "ok" / "step-00000005"))
    first_bytes += fs::file_size(entry.path());

  // The same run, killed halfway through writing the second checkpoint.
  const std::string crash = "RUDA_TEST_CRASH_AFTER_BYTES=" + std::to_string(first_bytes + first_bytes / 2);
  const Run killed = run(train(args + tmp / "k"), crash);
  CHECK_MESSAGE(killed.exit_code == 86, killed.output);
  CHECK(fs::exists(tmp.path / "k" / "step-00000010"));
  CHECK_FALSE(fs::exists(tmp.path / "k" / "step-00000010" / "index.json"));
  const Run verify = run(ckpt("verify " + tmp / "k"));
  CHECK_MESSAGE(verify.exit_code == 0, verify.output);
  CHECK(verify.output.find("step-00000005") != std::string::npos);
  const Run resumed = run(train(args + tmp / "k" + " --resume-latest"));
  CHECK_MESSAGE(resumed.exit_code == 0, resumed.output);
  CHECK(resumed.output.find("resumed from") != std::string::npos);
  CHECK(resumed.output.find("at step 5") != std::string::npos);
  // The resumed run ends exactly where the uninterrupted one did (same world size and backend).
  const std::string a = tmp / "a.safetensors", b = tmp / "b.safetensors";
  REQUIRE(run(ckpt("consolidate " + tmp / "ok" + " " + a)).exit_code == 0);
  REQUIRE(run(ckpt("consolidate " + tmp / "k" + " " + b)).exit_code == 0);
  ruda::safetensors::Reader ra(a), rb(b);
  for (const auto& t : ra.tensors()) {
    CAPTURE(t.name);
    CHECK(ra.read(t.name).to_vector<float>() == rb.read(t.name).to_vector<float>());
  }
}

namespace {
// The weights of two checkpoints, consolidated, compared bit for bit.
void same_weights(const TempDir& tmp, const std::string& a_dir, const std::string& b_dir) {
  const std::string a = tmp / (fs::path(a_dir).filename().string() + ".safetensors");
  const std::string b = tmp / (fs::path(b_dir).filename().string() + ".safetensors");
  REQUIRE(run(ckpt("consolidate " + a_dir + " " + a)).exit_code == 0);
  REQUIRE(run(ckpt("consolidate " + b_dir + " " + b)).exit_code == 0);
  ruda::safetensors::Reader ra(a), rb(b);
  REQUIRE(ra.tensors().size() == rb.tensors().size());
  for (const auto& t : ra.tensors()) {
    CAPTURE(t.name);
    CHECK(ra.read(t.name).to_vector<float>() == rb.read(t.name).to_vector<float>());
  }
}
}  // namespace

TEST_CASE("SIGINT, SIGTERM or SIGUSR1 during the steps: that step is saved, the exit is 128 + signal, it resumes") {
  // The signal is raised inside the last rank during a step (RUDA_TEST_RAISE), as one sent from
  // outside arrives; the ranks agree at the end of the step and all save it.
  TempDir tmp;
  // 10 steps (640 samples / 64), a checkpoint every 4: steps 4, 8 and 10.
  const std::string args = "--emulate 2 mlp --epochs 1 " + kSmall + " --checkpoint-every 4 --checkpoint-dir ";
  const Run full = run(train(args + tmp / "ok"));
  REQUIRE_MESSAGE(full.exit_code == 0, full.output);

  const Run stopped = run(train(args + tmp / "s"), "RUDA_TEST_RAISE=INT@6");
  CHECK_MESSAGE(stopped.exit_code == 130, stopped.output);
  CHECK_MESSAGE(stopped.output.find("stopped by SIGINT after step 6, checkpoint " + tmp / "s" + "/step-00000006") !=
                    std::string::npos,
                stopped.output);
  CHECK(stopped.output.find("done:") == std::string::npos);
  CHECK(fs::exists(tmp.path / "s" / "step-00000006" / "index.json"));
  CHECK_FALSE(fs::exists(tmp.path / "s" / "step-00000008"));
  const Run verify = run(ckpt("verify " + tmp / "s"));
  CHECK_MESSAGE(verify.exit_code == 0, verify.output);
  const Run resumed = run(train(args + tmp / "s" + " --resume-latest"));
  REQUIRE_MESSAGE(resumed.exit_code == 0, resumed.output);
  CHECK(resumed.output.find("at step 6") != std::string::npos);
  same_weights(tmp, tmp / "ok", tmp / "s");

  // A signal during a step that saves anyway (8): one checkpoint of it, not two.
  const Run at_save = run(train(args + tmp / "t"), "RUDA_TEST_RAISE=TERM@8");
  CHECK_MESSAGE(at_save.exit_code == 143, at_save.output);
  CHECK(at_save.output.find("stopped by SIGTERM after step 8 (its checkpoint is above)") != std::string::npos);
  std::size_t saves = 0;
  for (std::size_t at = at_save.output.find("/step-00000008"); at != std::string::npos;
       at = at_save.output.find("/step-00000008", at + 1))
    ++saves;
  CHECK_MESSAGE(saves == 1, at_save.output);

  // SIGUSR1 (the one mpiexec forwards without killing the ranks after) stops the same way.
  const Run usr1 = run(train(args + tmp / "v"), "RUDA_TEST_RAISE=USR1@2");
  CHECK_MESSAGE(usr1.exit_code == 138, usr1.output);
  CHECK(usr1.output.find("stopped by SIGUSR1 after step 2, checkpoint") != std::string::npos);
  CHECK(fs::exists(tmp.path / "v" / "step-00000002" / "index.json"));

  // Without a checkpoint directory there is nothing to keep: the signal ends the run as before.
  const Run unsaved = run(train("--emulate 2 mlp --epochs 1 " + kSmall), "RUDA_TEST_RAISE=TERM@3");
  CHECK_MESSAGE(unsaved.exit_code == 143, unsaved.output);
  CHECK(unsaved.output.find("stopped by") == std::string::npos);
  // A malformed hook is refused, not ignored.
  CHECK(run(train(args + tmp / "u"), "RUDA_TEST_RAISE=TERM@x").exit_code != 0);
  CHECK(run(train(args + tmp / "u"), "RUDA_TEST_RAISE=TERM@99999999999999999999").exit_code != 0);

  // A signal just after the last step's check is not swallowed: it ends the process at once, as
  // one during the final save, the sampling or the summary does (no final save, no summary).
  const Run late = run(train(args + tmp / "w"), "RUDA_TEST_RAISE=TERM@end");
  CHECK_MESSAGE(late.exit_code == 143, late.output);
  CHECK(late.output.find("done:") == std::string::npos);
  CHECK(late.output.find("stopped by") == std::string::npos);
  std::ifstream latest(tmp.path / "w" / "latest");
  std::string latest_step;
  latest >> latest_step;
  CHECK(latest_step == "step-00000008");
}

// ruda-train takes SIGINT, SIGTERM and SIGUSR1 on a thread of its own (stop.h): a signal handled
// on a thread inside oneDNN 2.6's f32 gemm:jit kernel, which points its stack pointer at a heap
// workspace when K > 84, wrote its frame over the heap (3 of ~45 runs stopped by SIGTERM aborted
// in free()). Every other thread of a running job (main, the emulated ranks, OpenMP's) has them
// blocked; the watcher ("ruda-signals") takes them, and a SIGTERM from outside still stops the run
// at the end of a step, saved. Started in the background of a script, the job ignores SIGINT (as
// the shell set it up), and still does: Linux keeps a blocked signal pending even where it is
// ignored, so a watcher that waited for it would have stopped the job.
TEST_CASE("the stop signals go to a thread of their own; one from outside stops the run, saved") {
  TempDir tmp;
  const std::string dir = tmp / "c";
  const std::string job = "OMP_NUM_THREADS=2 " + train("--emulate 2 --steps 100000 --checkpoint-dir " + dir +
                                                       " --checkpoint-every 5 --log-every 0 lm --d-model 32 --layers 1"
                                                       " --heads 2 --context 16 --eval-every 0");
  // The masks once the steps run (a checkpoint exists), an ignored SIGINT, then SIGTERM.
  std::ofstream(tmp.path / "job.sh")
      << job << " &\np=$!\nfor i in $(seq 6000); do [ -e " << dir
      << "/latest ] && break; sleep 0.01; done\n"
         "for t in /proc/$p/task/*; do\n"
         "  echo \"mask of $(cat $t/comm): $(sed -n 's/^SigBlk:[[:space:]]*//p' $t/status)\"\n"
         "done\nkill -INT $p\nsleep 0.5\nkill -TERM $p\nwait $p\n";
  const Run r = run("bash " + tmp / "job.sh");
  CHECK_MESSAGE(r.exit_code == 143, r.output);
  CHECK_MESSAGE(r.output.find("stopped by SIGTERM after step") != std::string::npos, r.output);
  constexpr unsigned long long kTaken = (1ULL << (SIGTERM - 1)) | (1ULL << (SIGUSR1 - 1));
  int threads = 0, watchers = 0;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    const std::size_t at = line.rfind(": ");
    if (line.rfind("mask of ", 0) != 0 || at == std::string::npos) continue;
    // (The watcher's own mask reads empty while it waits in sigwait, which unblocks what it waits for.)
    if (line.find("mask of ruda-signals:") == 0) {
      ++watchers;
      continue;
    }
    ++threads;
    const unsigned long long mask = std::stoull(line.substr(at + 2), nullptr, 16);
    CHECK_MESSAGE((mask & kTaken) == kTaken, line);
  }
  CHECK_MESSAGE(watchers == 1, r.output);
  CHECK_MESSAGE(threads >= 3, r.output);  // main and the two ranks (and OpenMP's)
}

TEST_CASE("ruda-ckpt lists, consolidates and splits; the split checkpoint trains on") {
  TempDir tmp;
  REQUIRE(run(train("--emulate 3 mlp --epochs 1 --hidden 32 --limit 640 --test-limit 200 --batch 66 --log-every 0"
                    " --checkpoint-dir " +
                    tmp / "c"))
              .exit_code == 0);
  const Run list = run(ckpt("list " + tmp / "c"));
  CHECK(list.exit_code == 0);
  CHECK(list.output.find("3 ranks") != std::string::npos);
  CHECK(list.output.find("0.weight  f32 [784, 32]") != std::string::npos);
  CHECK(list.output.find("model = mlp 784-32-10") != std::string::npos);
  // Consolidate and split stream: under a per-process limit just above the largest tensor (0.weight,
  // 784 x 32 f32: 100352 bytes), a checkpoint of several tensors converts all the same.
  const std::string tight = "RUDA_MEMORY_LIMIT=101000";
  const Run consolidated = run(ckpt("consolidate " + tmp / "c" + " " + tmp / "full.safetensors"), tight);
  REQUIRE_MESSAGE(consolidated.exit_code == 0, consolidated.output);
  const Run split =
      run(ckpt("split " + tmp / "full.safetensors" + " --world 2 --out " + tmp / "s" + " --step 10"), tight);
  REQUIRE_MESSAGE(split.exit_code == 0, split.output);
  ruda::safetensors::Reader full(tmp / "full.safetensors");
  CHECK(full.tensors().size() == 4);
  CHECK(run(ckpt("verify " + tmp / "s")).exit_code == 0);
  // The split checkpoint has no optimizer state: resuming it fails clearly...
  const Run no_state = run(
      train("--emulate 2 mlp --epochs 2 --hidden 32 --limit 640 --test-limit 200 --batch 66 --log-every 0 --resume " +
            tmp / "s"));
  INFO(no_state.output);
  CHECK(no_state.exit_code == 0);  // ... or, as here, starts fresh moments from the loaded weights
  CHECK(no_state.output.find("resumed from") != std::string::npos);
}

#ifdef RUDA_MPIEXEC
namespace {
// ruda-train under mpiexec on this machine: shared memory between ranks, one thread each.
std::string mpi_train(int ranks, const std::string& args) {
  return std::string(RUDA_MPIEXEC) + " -n " + std::to_string(ranks) +
         " --oversubscribe --bind-to none --mca btl self,vader -x OMP_NUM_THREADS=1 -x RUDA_NUM_THREADS=1" +
         " -x ASAN_OPTIONS -x LSAN_OPTIONS " + train(args);
}

}  // namespace

TEST_CASE("mpiexec: saved by 3 ranks, resumed by 2 and by 4, training goes on as if uninterrupted") {
  TempDir tmp;
  // 768 samples in global batches of 96: 8 steps per epoch, and 96 divides over 2, 3 and 4 ranks.
  const std::string small = "mlp --hidden 32 --limit 768 --test-limit 200 --batch 96 --log-every 1 ";
  const Run reference =
      run(mpi_train(3, small + "--epochs 2 --metrics " + tmp / "ref.jsonl --checkpoint-dir " + tmp / "ref"));
  REQUIRE_MESSAGE(reference.exit_code == 0, reference.output);
  const Run first = run(mpi_train(3, small + "--epochs 1 --checkpoint-dir " + tmp / "half"));
  REQUIRE_MESSAGE(first.exit_code == 0, first.output);
  const auto expected = losses(tmp / "ref.jsonl");
  REQUIRE(expected.size() == 16);
  REQUIRE(run(ckpt("consolidate " + tmp / "ref" + " " + tmp / "ref.safetensors")).exit_code == 0);
  ruda::safetensors::Reader final_reference(tmp / "ref.safetensors");

  for (int ranks : {2, 4}) {
    CAPTURE(ranks);
    const std::string n = std::to_string(ranks);
    const Run resumed = run(mpi_train(ranks, small + "--epochs 2 --resume " + tmp / "half" + " --metrics " +
                                                 tmp / ("r" + n + ".jsonl") + " --checkpoint-dir " + tmp / ("r" + n)));
    REQUIRE_MESSAGE(resumed.exit_code == 0, resumed.output);
    CHECK(resumed.output.find("at step 8 (saved by 3 ranks, now " + n + ")") != std::string::npos);
    const auto got = losses(tmp / ("r" + n + ".jsonl"));
    CHECK(got.size() == 8);
    for (const auto& [step, loss] : got) {
      CAPTURE(step);
      REQUIRE(expected.count(step));
      CHECK(loss == doctest::Approx(expected.at(step)).epsilon(1e-4));  // sums in another order than at 3 ranks
    }
    const std::string full = tmp / ("r" + n + ".safetensors");
    REQUIRE(run(ckpt("consolidate " + tmp / ("r" + n) + " " + full)).exit_code == 0);
    ruda::safetensors::Reader final_resumed(full);
    for (const auto& t : final_reference.tensors()) {
      CAPTURE(t.name);
      ruda::test::check_close(final_resumed.read(t.name), final_reference.read(t.name), 1e-5, 1e-3);
    }
  }
}

TEST_CASE("mpiexec --hybrid: 2 nodes x 2 ranks train like emulated nodes; a layout that does not tile is refused") {
  TempDir tmp;
  const std::string lm =
      "lm --d-model 32 --layers 2 --heads 2 --context 16 --batch 12 --steps 4 --eval-every 0 "
      "--log-every 1 --metrics ";
  const Run mpi = run(mpi_train(4, "--hybrid --ranks-per-node 2 --check-collectives " + lm + tmp / "mpi.jsonl"));
  REQUIRE_MESSAGE(mpi.exit_code == 0, mpi.output);
  CHECK(mpi.output.find("hybrid sharded over 2 nodes x 2 ranks (mpi)") != std::string::npos);
  const Run emulated = run(train("--emulate 4 --ranks-per-node 2 --hybrid " + lm + tmp / "emulated.jsonl"));
  REQUIRE_MESSAGE(emulated.exit_code == 0, emulated.output);
  const auto want = losses(tmp / "emulated.jsonl"), got = losses(tmp / "mpi.jsonl");
  REQUIRE(want.size() == 4);
  REQUIRE(got.size() == 4);
  for (const auto& [step, loss] : want) CHECK(got.at(step) == doctest::Approx(loss).epsilon(1e-6));
  // Every rank agrees on the refusal: one line, no hang.
  one_error_line(run(mpi_train(4, "--hybrid --ranks-per-node 3 " + lm + tmp / "bad.jsonl")),
                 {"--ranks-per-node 3 does not divide the 4 ranks of this job into nodes of equal size"});
}

TEST_CASE("mpiexec: one rank over its memory limit ends every rank with one error line") {
  // Rank 1 alone has a limit: below the sharded state (refused before any parameter exists), and
  // below the measured step (refused by the plan after the probe). Neither hangs the other rank.
  const std::string args = "mlp --hidden 32 --limit 640 --test-limit 64 --batch 64 --epochs 1";
  for (const char* limit : {"100kB", "406kB"}) {
    CAPTURE(limit);
    const std::string both =
        std::string(RUDA_MPIEXEC) +
        " --bind-to none --mca btl self,vader -x OMP_NUM_THREADS=1 -x ASAN_OPTIONS -x LSAN_OPTIONS" + " -n 1 " +
        train(args) + " : -n 1 -x RUDA_MEMORY_LIMIT=" + limit + " " + train(args);
    one_error_line(run(both), {"memory plan: needs", "per rank at 2 ranks", "limit"});
  }
}

TEST_CASE("mpiexec: each rank reads only its samples, about half of what one process reads") {
  TempDir tmp;
  const std::string args = "mlp --hidden 32 --limit 2048 --test-limit 1000 --batch 64 --epochs 1 --log-every 0 ";
  REQUIRE(run(train(args + "--metrics " + tmp / "one.jsonl")).exit_code == 0);
  const Run two = run(mpi_train(2, args + "--metrics " + tmp / "two.jsonl"));
  REQUIRE_MESSAGE(two.exit_code == 0, two.output);
  auto last_read = [](const std::string& metrics) {
    std::ifstream in(metrics);
    std::string line, last;
    while (std::getline(in, line)) last = line;
    return nlohmann::json::parse(last)["data_bytes_read"].get<std::vector<double>>();
  };
  // Emulated ranks too: they share the process's data set, whose reads each rank reported summed
  // over all ranks (each rank's figure was the whole job's).
  const Run emulated = run(train("--emulate 2 " + args + "--metrics " + tmp / "emulated.jsonl"));
  REQUIRE_MESSAGE(emulated.exit_code == 0, emulated.output);
  const auto one = last_read(tmp / "one.jsonl");
  REQUIRE(one.size() == 1);
  for (const char* file : {"two.jsonl", "emulated.jsonl"}) {
    CAPTURE(file);
    const auto per_rank = last_read(tmp / file);
    REQUIRE(per_rank.size() == 2);
    for (double bytes : per_rank) {
      // Half the samples, and a page-sized neighbourhood of the labels read along with them.
      CHECK(bytes / one[0] >= 0.45);
      CHECK(bytes / one[0] <= 0.6);
    }
  }
}

TEST_CASE("mpiexec: a non-finite loss stops every rank with one line naming the step and the rank") {
  one_error_line(run(mpi_train(2, "--lr 1e38 mlp --hidden 32 --limit 640 --test-limit 64 --batch 64 --epochs 1")),
                 {"loss became", "nan at step 2", "first on rank"});
}

TEST_CASE("mpiexec: bad input ends every rank with one error line and a non-zero exit") {
  one_error_line(run(mpi_train(2, "mlp --data /nonexistent")), {"/nonexistent/train-images-idx3-ubyte.gz"});
  one_error_line(run(mpi_train(3, "mlp --batch 128 --hidden 32 --limit 640")), {"--batch 128", "3 ranks"});
  one_error_line(run(mpi_train(2, "mlp --limit 640"), "RUDA_COLLECTIVE_TIMEOUT=soon"),
                 {"RUDA_COLLECTIVE_TIMEOUT", "'soon'"});
  // Every variable a run reads is agreed before any communicator reads it: these printed each
  // rank's error, then MPI_Abort's line and banner (4 lines and more).
  const std::string small = "mlp --hidden 8 --limit 64 --batch 64 --test-limit 10 --epochs 1";
  for (const auto& [variable, fragment] :
       std::vector<std::pair<std::string, std::string>>{{"RUDA_RING_MIN_BYTES=lots", "'lots' is not a size"},
                                                        {"RUDA_NUM_THREADS=abc", "'abc'"},
                                                        {"RUDA_CHECK_COLLECTIVES=maybe", "'maybe'"},
                                                        {"RUDA_MEMORY_LIMIT=huge", "'huge'"},
                                                        {"RUDA_BACKEND=bogus", "unknown backend 'bogus'"}}) {
    CAPTURE(variable);
    const std::string name = variable.substr(0, variable.find('='));
    const Run r =
        run(std::string(RUDA_MPIEXEC) + " --quiet -n 2 --oversubscribe --bind-to none --mca btl self,vader -x " + name +
                " -x OMP_NUM_THREADS=1 " + train(small),
            variable);
    one_error_line(r, {name, fragment});
    CHECK_MESSAGE(r.output.find("ruda: rank") == std::string::npos, r.output);
    CHECK_MESSAGE(r.output.find("MPI_ABORT") == std::string::npos, r.output);
  }
  // One rank's own environment (an MPMD line): that rank is named. It ended silently (exit 2).
  const std::string two = std::string(RUDA_MPIEXEC) +
                          " --quiet --bind-to none --mca btl self,vader -x OMP_NUM_THREADS=1 " + "-n 1 " +
                          train(small) + " : -n 1 -x RUDA_COLLECTIVE_TIMEOUT=soon " + train(small);
  one_error_line(run(two), {"rank 1: RUDA_COLLECTIVE_TIMEOUT", "'soon'"});
}

TEST_CASE("mpiexec: ranks started with different options or collective settings are refused in one line") {
  // MPMD lines that differ: different --epochs or --batch ended in heap corruption (the first
  // collective sized from them wrote past a buffer), a different --seed trained silently on data
  // streams the checkpoint did not record, and RUDA_CHECK_COLLECTIVES on one rank waited for the
  // collective timeout. Now one line names the rank and the setting, before any communicator.
  const std::string small = "mlp --hidden 8 --limit 64 --batch 64 --test-limit 10 --epochs 1";
  auto mpmd = [](const std::string& first, const std::string& second) {
    return std::string(RUDA_MPIEXEC) + " --quiet --bind-to none --mca btl self,vader -x OMP_NUM_THREADS=1 -n 1 " +
           first + " : -n 1 " + second;
  };
  for (const auto& [other, fragment] : std::vector<std::pair<std::string, std::string>>{
           {train(small + " --epochs 2"), "rank 1 was started with --epochs \"2\", rank 0 with --epochs \"1\""},
           {train(small + " --batch 32"), "rank 1 was started with --batch \"32\", rank 0 with --batch \"64\""},
           {train(small + " --seed 7"), "rank 1 was started with --seed \"7\", rank 0 with --seed \"1\""},
           {"-x RUDA_CHECK_COLLECTIVES=1 " + train(small),
            "rank 1 was started with RUDA_CHECK_COLLECTIVES=on, rank 0 with RUDA_CHECK_COLLECTIVES=off"},
           {"-x RUDA_RING_MIN_BYTES=1kB " + train(small),
            "RUDA_RING_MIN_BYTES=1000, rank 0 with RUDA_RING_MIN_BYTES=unset"},
           {"-x RUDA_BACKEND=eigen " + train(small), "backend in use=eigen"},
           // A value with a newline and a byte that is not ASCII, named whole on one line.
           {train(small + " --data '/nonexistent/x\ny\xff'"),
            "rank 1 was started with mlp --data \"/nonexistent/x\\ny\\xff\""}}) {
    CAPTURE(other);
    const Run r = run(mpmd(train(small), other));
    CHECK(r.exit_code == 2);
    one_error_line(r, {fragment, "every rank of a job needs the same options"});
  }
  // The same options spelled differently (--name=value, another order, a default given) agree.
  const Run same =
      run(mpmd(train(small), train("mlp --epochs=1 --test-limit 10 --batch=64 --limit 64 --hidden 8 --seed 1")));
  CHECK_MESSAGE(same.exit_code == 0, same.output);
}

TEST_CASE("mpiexec: a --checkpoint-dir that is not one directory for every rank is refused before step 1") {
  // The same relative path from two working directories, as a node-local disk gives the same
  // absolute path on two machines: rank 0's saves wrote an index that named rank 1's files it
  // could not see, `latest` pointed at it, and no resume could load it.
  TempDir dir;
  fs::create_directories(dir.path / "a");
  fs::create_directories(dir.path / "b");
  const std::string args = "mlp --hidden 8 --limit 64 --batch 64 --test-limit 10 --epochs 1 --checkpoint-dir c";
  const std::string two =
      std::string(RUDA_MPIEXEC) + " --quiet --bind-to none --mca btl self,vader -x OMP_NUM_THREADS=1" + " -n 1 -wdir " +
      (dir.path / "a").string() + " " + train(args) + " : -n 1 -wdir " + (dir.path / "b").string() + " " + train(args);
  one_error_line(run(two), {"--checkpoint-dir c", "rank 1 does not see the file rank 0 wrote there"});
  // Nothing saved, and rank 0's marker is gone.
  CHECK(fs::is_empty(dir.path / "a" / "c"));
  // One directory for both: the run saves as usual, and leaves no marker.
  const Run shared =
      run(std::string(RUDA_MPIEXEC) + " --quiet -n 2 --oversubscribe --bind-to none --mca btl self,vader" +
          " -x OMP_NUM_THREADS=1 -wdir " + (dir.path / "a").string() + " " + train(args));
  CHECK_MESSAGE(shared.exit_code == 0, shared.output);
  for (const auto& entry : fs::directory_iterator(dir.path / "a" / "c"))
    CHECK(entry.path().filename().string().rfind(".ruda-train-shared", 0) != 0);
  CHECK(fs::exists(dir.path / "a" / "c" / "latest"));
}

TEST_CASE("mpiexec: ranks whose data differ are refused in one line before step 1") {
  // One path, other files on one node (a copy that only partly arrived): a training set of 32
  // images against 64 gave rank 1 fewer steps an epoch, the ranks' collectives parted, and the job
  // ended in heap corruption (SIGABRT); an lm text that differed trained to the end on other samples.
  TempDir dir;
  write_idx_set(dir.path / "a" / "d", 64, 28, 28, 28, 28);
  write_idx_set(dir.path / "b" / "d", 32, 28, 28, 28, 28);
  std::ofstream(dir.path / "a" / "t.txt") << std::string(4000, 'a');
  std::ofstream(dir.path / "b" / "t.txt") << std::string(4000, 'b');
  auto two = [&](const std::string& args) {
    return std::string(RUDA_MPIEXEC) + " --quiet --bind-to none --mca btl self,vader -x OMP_NUM_THREADS=1" +
           " -n 1 -wdir " + (dir.path / "a").string() + " " + train(args) + " : -n 1 -wdir " +
           (dir.path / "b").string() + " " + train(args);
  };
  const Run mlp = run(two("mlp --hidden 8 --batch 16 --epochs 1 --log-every 0 --data d"));
  one_error_line(mlp, {"d: the ranks read different data", "--data: 64 images", "32 images", "on rank 1"});
  CHECK(mlp.output.find("step") == std::string::npos);
  const std::string lm = "lm --steps 2 --context 8 --d-model 8 --layers 1 --heads 1 --batch 2 --text ";
  one_error_line(run(two(lm + "t.txt")), {"t.txt: the ranks read different data (--text:", "on rank 1"});
  // A setup check that fails on some ranks only names them (it read as if it failed everywhere).
  for (const char* side : {"a", "b"}) std::ofstream(dir.path / side / "same.txt") << std::string(4000, 's');
  std::ofstream(dir.path / "b" / "ck") << "a file where the directory should be";
  one_error_line(run(two(lm + "same.txt --checkpoint-dir ck")), {"rank 1: --checkpoint-dir ck"});
}

TEST_CASE("mpiexec: --emulate under mpiexec is refused in one line, not once per rank") {
  one_error_line(run(mpi_train(2, "--emulate 2 mlp --hidden 8 --limit 64")),
                 {"--emulate", "do not launch it with mpiexec"});
}

TEST_CASE("mpiexec: a checkpoint that cannot be saved mid-run ends every rank with one error line, no abort") {
  // Step 5's directory is taken by a file: the save fails on rank 0 and every rank knows (the
  // library agrees on it); each rank used to print it and then end the job through MPI_Abort.
  TempDir tmp;
  std::filesystem::create_directories(tmp / "c");
  std::ofstream(tmp / "c/step-00000005") << "not a directory";
  const Run r = run(mpi_train(2,
                              "mlp --hidden 32 --limit 640 --test-limit 64 --batch 64 --epochs 1 --log-every 0 "
                              "--checkpoint-every 5 --checkpoint-dir " +
                                  tmp / "c"));
  one_error_line(r, {"checkpoint " + tmp / "c", "preparing the directory failed on rank 0", "is not a directory"});
  CHECK_MESSAGE(r.output.find("MPI_ABORT") == std::string::npos, r.output);
  CHECK_MESSAGE(r.output.find("ruda: rank") == std::string::npos, r.output);
}

TEST_CASE("mpiexec: SIGTERM in one rank stops every rank after the same step, saved; --resume-latest finishes") {
  TempDir tmp;
  const std::string small = "mlp --hidden 32 --limit 640 --test-limit 64 --batch 64 --epochs 1 --log-every 1 ";
  const Run reference = run(mpi_train(2, small + "--metrics " + tmp / "ref.jsonl --checkpoint-dir " + tmp / "ref"));
  REQUIRE_MESSAGE(reference.exit_code == 0, reference.output);
  // Rank 1 receives it during step 3; rank 0 learns it at the end of the step.
  const Run stopped =
      run(mpi_train(2, small + "--metrics " + tmp / "m.jsonl --checkpoint-dir " + tmp / "m"), "RUDA_TEST_RAISE=TERM@3");
  CHECK_MESSAGE(stopped.exit_code == 143, stopped.output);
  CHECK_MESSAGE(stopped.output.find("stopped by SIGTERM after step 3, checkpoint " + tmp / "m" + "/step-00000003") !=
                    std::string::npos,
                stopped.output);
  CHECK_MESSAGE(stopped.output.find("MPI_ABORT") == std::string::npos, stopped.output);
  CHECK(run(ckpt("verify " + tmp / "m")).exit_code == 0);
  CHECK(losses(tmp / "m.jsonl").size() == 3);
  const Run resumed =
      run(mpi_train(2, small + "--metrics " + tmp / "m.jsonl --checkpoint-dir " + tmp / "m" + " --resume-latest"));
  REQUIRE_MESSAGE(resumed.exit_code == 0, resumed.output);
  CHECK(resumed.output.find("at step 3") != std::string::npos);
  CHECK(losses(tmp / "m.jsonl") == losses(tmp / "ref.jsonl"));
  same_weights(tmp, tmp / "ref", tmp / "m");
}

// Run by its own ctest entry, test_tools_cli[metrics-full-disk], which shows as skipped (not as
// passed) where no mount namespace can be made.
TEST_CASE("mpiexec: a metrics file that cannot be written ends every rank with one error line, no abort" *
          doctest::skip()) {
  // A full disk under --metrics: a 4 KB tmpfs in a mount namespace of the job's own (root only).
  // Rank 0 alone writes the metrics; its failure used to end the job through MPI_Abort.
  TempDir tmp;
  const std::string small = tmp / "small";
  fs::create_directories(small);
  const std::string mount = "unshare --mount sh -c 'mount -t tmpfs -o size=4k tmpfs " + small + " && exec ";
  if (run(mount + "true'").exit_code != 0) {
    std::cout << "SKIPPED: no mount namespace or tmpfs mount here (root only)" << std::endl;
    return;
  }
  const Run r = run(mount +
                    mpi_train(2,
                              "mlp --hidden 32 --limit 640 --test-limit 64 --batch 64 --epochs 3 --log-every 1 "
                              "--metrics " +
                                  small + "/m.jsonl") +
                    "'");
  one_error_line(r, {"--metrics " + small + "/m.jsonl", "writing a line failed", "No space left on device"});
  CHECK_MESSAGE(r.output.find("MPI_ABORT") == std::string::npos, r.output);
  CHECK_MESSAGE(r.output.find("ruda: rank") == std::string::npos, r.output);
}

TEST_CASE("mpiexec: a malformed RUDA_TEST_RAISE is one error line before step 1") {
  const Run r =
      run(mpi_train(2, "mlp --hidden 32 --limit 640 --test-limit 64 --batch 64 --epochs 1"), "RUDA_TEST_RAISE=TERM@x");
  one_error_line(r, {"RUDA_TEST_RAISE=TERM@x"});
  CHECK_MESSAGE(r.output.find("MPI_ABORT") == std::string::npos, r.output);
  CHECK(r.output.find("step 1/") == std::string::npos);
}

TEST_CASE("mpiexec: a run under --collective-timeout trains as usual") {
  const Run r =
      run(mpi_train(2, "--collective-timeout 60s mlp --hidden 32 --limit 640 --test-limit 64 --batch 64 --epochs 1"));
  CHECK_MESSAGE(r.exit_code == 0, r.output);
  CHECK_MESSAGE(r.output.find("done: 10 steps") != std::string::npos, r.output);
}
#endif

TEST_CASE("the memory plan is checked after step 2, or under --overlap auto once the trial has decided") {
  // --per-parameter has no shard groups and so no trial: its check waited for a decision that
  // never comes, to the last step. Grouped under --overlap auto the trial runs 7 steps here.
  const std::string lm =
      "lm --d-model 16 --layers 1 --heads 2 --context 8 --batch 4 --steps 12 --eval-every 0 "
      "--log-every 1 ";
  const Run per_parameter = run(train("--per-parameter " + lm));
  REQUIRE_MESSAGE(per_parameter.exit_code == 0, per_parameter.output);
  // Its plan names no groups it does not have (it printed "2 unsharded groups, recompute").
  CHECK(per_parameter.output.find("unsharded group") == std::string::npos);
  CHECK(per_parameter.output.find("local batch 4; recompute)") != std::string::npos);
  const auto at = per_parameter.output.find("memory: predicted");
  REQUIRE(at != std::string::npos);
  CHECK(at < per_parameter.output.find("step 3/12"));
  const Run grouped = run(train(lm));
  REQUIRE_MESSAGE(grouped.exit_code == 0, grouped.output);
  const auto line = grouped.output.find("memory: predicted");
  REQUIRE(line != std::string::npos);
  CHECK(line > grouped.output.find("step 3/12"));
  CHECK(line < grouped.output.find("step 12/12"));
}

TEST_CASE("the memory plan printed before step 1 is within 10% of the measured peak, mlp and lm, 1 to 4 ranks") {
  TempDir tmp;
  const std::vector<std::string> models = {
      "mlp --hidden 64,64 --limit 256 --test-limit 64 --batch 32 --epochs 1",
      "lm --d-model 32 --layers 2 --heads 2 --context 32 --batch 8 --steps 3 --eval-every 0 --eval-batches 1"};
  for (const auto& model : models) {
    for (int ranks : {1, 2, 4}) {
      CAPTURE(model);
      CAPTURE(ranks);
      const std::string metrics = tmp / "plan.jsonl";
      const Run r =
          run(train("--emulate " + std::to_string(ranks) + " --log-every 1 --metrics " + metrics + " " + model));
      REQUIRE_MESSAGE(r.exit_code == 0, r.output);
      CHECK(r.output.find("memory plan per rank (" + std::to_string(ranks)) != std::string::npos);
      CHECK(r.output.find("memory: predicted") != std::string::npos);
      std::ifstream in(metrics);
      std::string line;
      bool checked = false;
      while (std::getline(in, line)) {
        const auto j = nlohmann::json::parse(line);
        if (j["step"] != 2) continue;  // the plan covers the steady state: moments made, gradients alive
        const auto peaks = j["peak_memory_bytes"].get<std::vector<double>>();
        const double measured = *std::max_element(peaks.begin(), peaks.end());
        const double predicted = j["predicted_peak_bytes"].get<double>();
        CHECK(predicted >= 0.9 * measured);
        CHECK(predicted <= 1.1 * measured);
        checked = true;
      }
      CHECK(checked);
    }
  }
}

TEST_CASE("clipping and checkpoint saves stay within the memory plan and under a limit it accepted") {
  // clip_grad_norm summed an f64 copy of each whole gradient, and each save's finite-weights check
  // an f64 copy of each whole parameter: 16 bytes an element the plan does not count (the MLP's
  // peak at 1.41x its plan; under a --memory-limit the plan accepted, the run ran out in the cast
  // at its last save and wrote no checkpoint). Both now go a block at a time.
  TempDir tmp;
  const std::string model = " mlp --limit 480 --test-limit 64 --batch 120 --epochs 1";
  for (int ranks : {1, 2}) {
    CAPTURE(ranks);
    const std::string metrics = tmp / "plan.jsonl", dir = tmp / ("c" + std::to_string(ranks));
    const std::string args = "--emulate " + std::to_string(ranks) + " --clip 1.0 --checkpoint-dir " + dir +
                             " --checkpoint-every 1 --log-every 1 --metrics " + metrics + model;
    const Run r = run(train(args));
    REQUIRE_MESSAGE(r.exit_code == 0, r.output);
    std::ifstream in(metrics);
    std::string line;
    double predicted = 0, measured = 0;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line);
      if (!j.contains("predicted_peak_bytes")) continue;
      const auto peaks = j["peak_memory_bytes"].get<std::vector<double>>();
      predicted = j["predicted_peak_bytes"].get<double>();
      measured = std::max(measured, *std::max_element(peaks.begin(), peaks.end()));
    }
    REQUIRE(predicted > 0);
    CHECK(measured <= predicted);
    // Under a limit 2% above the plan, the same run trains and saves every step.
    const std::string limit = std::to_string(static_cast<long long>(predicted * 1.02)) + "B";
    fs::remove_all(dir);
    const Run limited = run(train("--memory-limit " + limit + " " + args));
    CHECK_MESSAGE(limited.exit_code == 0, limited.output);
    CHECK(fs::exists(fs::path(dir) / "latest"));
  }
}

TEST_CASE("a limit just above a run's measured peak is not refused as below the least a step needs") {
  // The state check's lower bound added the largest layer's gathered weight and its full gradient,
  // 15.8 MB at 4 ranks where this run peaks at 15.4: a limit between them was refused before
  // step 1 ("needs at least"). The bound now adds one gathered copy, which every step makes.
  TempDir tmp;
  const std::string metrics = tmp / "peak.jsonl";
  const std::string model = " mlp --limit 480 --test-limit 64 --batch 120 --epochs 1 --log-every 1";
  const Run free = run(train("--emulate 4 --metrics " + metrics + model));
  REQUIRE_MESSAGE(free.exit_code == 0, free.output);
  std::ifstream in(metrics);
  std::string line;
  double measured = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("peak_memory_bytes")) continue;
    const auto peaks = j["peak_memory_bytes"].get<std::vector<double>>();
    measured = std::max(measured, *std::max_element(peaks.begin(), peaks.end()));
  }
  REQUIRE(measured > 0);
  const std::string limit = std::to_string(static_cast<long long>(measured * 1.01)) + "B";
  const Run limited = run(train("--emulate 4 --memory-limit " + limit + model));
  CHECK_MESSAGE(limited.exit_code == 0, limited.output);
}

TEST_CASE("--no-auto-fit: every configuration a refusal names fits when run") {
  // The hints came from the step measured at 2 samples, a line that falls short at larger local
  // batches: at 2 ranks under 6 MB the refusal named --recompute-gelu at 2 ranks, which was then
  // refused ("needs ~7.96 MB"). Each candidate is now measured at its own local batch first.
  const std::string lm =
      " --no-auto-fit --batch 16 lm --steps 1 --d-model 96 --layers 2 --heads 2 --context 48 "
      "--eval-every 0 --eval-batches 1";
  const Run refused = run(train("--emulate 2 --memory-limit 6MB" + lm));
  one_error_line(refused, {"memory plan: needs ~", "at 2 ranks", "limit 6.00 MB", "fits at "});
  std::vector<std::string> hints;  // the --emulate value and flags of each configuration named
  const std::string& text = refused.output;
  const auto world_at = text.find("; fits at ");
  REQUIRE(world_at != std::string::npos);
  hints.push_back(std::to_string(std::stoi(text.substr(world_at + 10))));
  for (auto at = text.find(", or at "); at != std::string::npos; at = text.find(", or at ", at + 1)) {
    const std::string rest = text.substr(at + 8);
    const auto with = rest.find(" with ");
    const auto end = rest.find_first_of(", (", with + 6);
    hints.push_back(rest.substr(0, with) + " " + rest.substr(with + 6, end - with - 6));
  }
  for (const std::string& hint : hints) {
    CAPTURE(hint);
    const auto space = hint.find(' ');
    const std::string world = hint.substr(0, space), flag = space == std::string::npos ? "" : hint.substr(space);
    const Run followed = run(train("--emulate " + world + " --memory-limit 6MB" + lm + flag));
    CHECK_MESSAGE(followed.exit_code == 0, followed.output);
  }
}

TEST_CASE("--memory-limit: a configuration over it is refused before step 1, saying what fits") {
  const std::string lm = " lm --d-model 64 --layers 4 --heads 2 --context 64 --batch 16 --steps 1 --eval-every 0";
  // The sharded state alone is over: refused before any parameter is allocated.
  const Run state = run(train("--memory-limit 300kB" + lm));
  one_error_line(state, {"memory plan: needs at least", "at 1 rank", "limit 300 KB", "fits at"});
  CHECK(state.output.find("memory plan per rank") == std::string::npos);
  // The measured step is over as configured: a leaner schedule that fits is chosen, said in one
  // line, planned for, and trained within the limit.
  const Run fitted = run(train("--emulate 2 --memory-limit 6MB" + lm));
  CHECK_MESSAGE(fitted.exit_code == 0, fitted.output);
  CHECK_MESSAGE(
      fitted.output.find(" MB per rank with 2 unsharded groups, recompute is over the limit of 6.00 MB; chose ") !=
          std::string::npos,
      fitted.output);
  CHECK_MESSAGE(fitted.output.find("activation checkpointing):\n") != std::string::npos, fitted.output);  // the table
  // --no-auto-fit refuses instead, naming the world size that fits, the recomputed GELU's and the
  // recomputing blocks'.
  const Run step = run(train("--emulate 2 --memory-limit 6MB --no-auto-fit" + lm));
  one_error_line(step, {"memory plan: needs ~", "at 2 ranks", "limit 6.00 MB", "; fits at ", " with --recompute-gelu",
                        ", or at 2 with --activation-checkpointing", "--no-auto-fit"});
  // ... which then runs, within the limit.
  const Run fits = run(train("--emulate 2 --memory-limit 6MB --no-auto-fit" + lm + " --activation-checkpointing"));
  CHECK_MESSAGE(fits.exit_code == 0, fits.output);
  // The lm offers its GELU recompute as a concession, after recompute and before activation
  // checkpointing; where a limit sits between the plans with and without it, it is what is chosen.
  const Run gelu = run(train("--emulate 2 --memory-limit 100MB" + lm + " --unsharded-groups 1 --recompute-gelu"));
  const Run keep = run(train("--emulate 2 --memory-limit 100MB" + lm + " --unsharded-groups 1"));
  REQUIRE_MESSAGE(gelu.exit_code == 0, gelu.output);
  REQUIRE_MESSAGE(keep.exit_code == 0, keep.output);
  CHECK_MESSAGE(gelu.output.find("; 1 unsharded group, recompute, GELU recomputed):") != std::string::npos,
                gelu.output);
  // The plans' peak rows (both in MB at this size).
  const double gelu_mb = number_after(gelu.output, "\n  peak "), keep_mb = number_after(keep.output, "\n  peak ");
  REQUIRE(gelu_mb < keep_mb);
  const std::string between = std::to_string(0.5 * (gelu_mb + keep_mb)) + "MB";
  const Run chosen = run(train("--emulate 2 --memory-limit " + between + lm + " --unsharded-groups 1"));
  CHECK_MESSAGE(chosen.exit_code == 0, chosen.output);
  CHECK_MESSAGE(chosen.output.find("; chose 1 unsharded group, recompute, GELU recomputed (~") != std::string::npos,
                chosen.output);
  // Lower, only micro-batches on top of every other concession fit.
  const Run micro = run(train("--emulate 2 --memory-limit 3MB" + lm));
  CHECK_MESSAGE(micro.exit_code == 0, micro.output);
  CHECK_MESSAGE(micro.output.find("chose 1 unsharded group, recompute, activation checkpointing, 8 micro-batches") !=
                    std::string::npos,
                micro.output);
  // Nothing fits: the refusal names the leanest schedule and what would fit with it.
  one_error_line(run(train("--emulate 2 --memory-limit 2.5MB" + lm)),
                 {"memory plan: needs ~", " MB per rank at 2 ranks", "limit 2.50 MB",
                  "no schedule fits (the leanest, 1 unsharded group, recompute, GELU recomputed, activation "
                  "checkpointing, 8 micro-batches, needs ~",
                  "; fits at 8 ranks"});
  one_error_line(run(train("--memory-limit lots mlp")), {"--memory-limit", "'lots' is not a size"});
  // The environment variable is the same limit.
  one_error_line(run(train(lm), "RUDA_MEMORY_LIMIT=300kB"), {"limit 300 KB"});
}

TEST_CASE("--resume-latest: a missing or dangling latest resumes the newest complete step; a strange one is refused") {
  TempDir tmp;
  const std::string dir = tmp / "c";
  // 640 samples in batches of 64: 10 steps an epoch, checkpoints at steps 5 and 10.
  const std::string args = "mlp " + kSmall + " --checkpoint-dir " + dir + " --checkpoint-every 5";
  REQUIRE(run(train(args + " --epochs 1")).exit_code == 0);
  const fs::path latest = fs::path(dir) / "latest";
  for (const char* pointer : {"", "step-00000099\n"}) {  // removed (a kill before it was written), dangling
    CAPTURE(pointer);
    fs::remove(latest);
    if (*pointer) std::ofstream(latest) << pointer;
    const Run resumed = run(train(args + " --epochs 1 --resume-latest"));
    CHECK_MESSAGE(resumed.output.find("resumed from " + dir + "/step-00000010 at step 10") != std::string::npos,
                  resumed.output);
  }
  fs::remove(latest);
  fs::create_symlink("latest", latest);  // a loop
  one_error_line(run(train(args + " --epochs 2 --resume-latest")), {"latest", "symbolic link", "remove it"});
  one_error_line(run(ckpt("verify " + dir)), {"latest", "symbolic link"});
  fs::remove(latest);
  fs::create_directory(latest);
  one_error_line(run(train(args + " --epochs 2 --resume-latest")), {"latest", "is a directory"});
  // Without --resume-latest, the first save refuses it before any file is written.
  one_error_line(run(train(args + " --epochs 1")), {"latest", "is a directory"});
}

TEST_CASE("resuming from a damaged file: every rank stops with the cause, nobody reports a resume") {
  TempDir tmp;
  const std::string dir = tmp / "d";
  const std::string args = "--emulate 2 mlp " + kSmall + " --checkpoint-dir " + dir;
  REQUIRE(run(train(args + " --epochs 1")).exit_code == 0);
  // One bit of rank 1's weights flipped, in the middle of its data.
  const fs::path file = fs::path(dir) / "step-00000010" / "rank-00001-of-00002.safetensors";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(fs::file_size(file) / 2));
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 1);
    f.seekp(static_cast<std::streamoff>(fs::file_size(file) / 2));
    f.write(&c, 1);
  }
  const Run damaged = run(train(args + " --epochs 2 --resume-latest"));
  one_error_line(damaged, {"rank 1", "rank-00001-of-00002.safetensors", "checksum"});
  CHECK_MESSAGE(damaged.output.find("resumed from") == std::string::npos, damaged.output);
  one_error_line(run(ckpt("verify " + dir)), {"rank-00001-of-00002.safetensors", "checksum", "damaged"});
  // The documented opt-out trusts the data.
  const Run trusted = run(train(args + " --epochs 2 --resume-latest --skip-checksums"));
  CHECK_MESSAGE(trusted.output.find("resumed from " + dir + "/step-00000010") != std::string::npos, trusted.output);
}

TEST_CASE("--emulate-link slows the collectives, not the arithmetic: the same losses") {
  const std::string args = "mlp " + kSmall + " --epochs 1";
  const Run plain = run(train("--emulate 2 " + args));
  const Run linked = run(train("--emulate 2 --emulate-link 200MB/s,50us " + args));
  REQUIRE_MESSAGE(plain.exit_code == 0, plain.output);
  REQUIRE_MESSAGE(linked.exit_code == 0, linked.output);
  auto final_line = [](const std::string& out) {
    const std::size_t at = out.find("final loss");
    return at == std::string::npos ? std::string("none") : out.substr(at, out.find('\n', at) - at);
  };
  CHECK(final_line(plain.output) == final_line(linked.output));
  // The summary says what the collectives cost per step, and how much of it the step waited for.
  const std::size_t at = linked.output.find("communication: ");
  REQUIRE_MESSAGE(at != std::string::npos, linked.output);
  double collectives = 0, ms = 0, exposed = 0;
  char size[32] = {0};
  REQUIRE(std::sscanf(linked.output.c_str() + at, "communication: %lf collectives, %31[^,], %lf ms per step; %lf ms",
                      &collectives, size, &ms, &exposed) == 4);
  CHECK(collectives > 0);
  CHECK(ms > 0);
  CHECK(exposed <= ms);
  one_error_line(run(train("--emulate 2 --emulate-link fast " + args)), {"--emulate-link", "'fast'"});
  one_error_line(run(train("--emulate 2 " + args), "RUDA_EMULATE_LINK=1GB"), {"RUDA_EMULATE_LINK", "'1GB'"});
}

TEST_CASE("a non-finite loss stops training with one line naming the step and the rank") {
  // A learning rate of 1e38 overflows the weights in the first update: the second loss is NaN.
  for (const std::string ranks : {"", "--emulate 2 "}) {
    CAPTURE(ranks);
    one_error_line(run(train(ranks + "--lr 1e38 mlp " + kSmall)), {"loss became", "nan at step 2", "rank"});
    // The last step's update made the weights NaN: only its evaluation shows it (the loss is
    // measured before the update). Without --checkpoint-dir, whose saves check the weights, the
    // run ended with exit 0 and NaN figures.
    one_error_line(run(train(ranks + "--lr 1e300 lm --d-model 16 --layers 1 --heads 2 --context 8 --steps 1")),
                   {"step 1's evaluation gave", "val_loss nan", "not finite after that step's update"});
  }
}

TEST_CASE("--hybrid: resumes bit for bit in its layout, within 1e-6 across layouts (2x2 -> 4x1 -> 1x3)") {
  TempDir tmp;
  const std::string lm = " lm --d-model 32 --layers 2 --heads 2 --context 16 --batch 12 --eval-every 0 --log-every 1";
  auto layout = [](int nodes, int per_node) {
    return "--emulate " + std::to_string(nodes * per_node) + " --hybrid --ranks-per-node " + std::to_string(per_node);
  };
  const Run reference = run(train(layout(2, 2) + " --metrics " + tmp / "ref.jsonl" + lm + " --steps 6"));
  REQUIRE_MESSAGE(reference.exit_code == 0, reference.output);
  CHECK(reference.output.find("hybrid sharded over 2 nodes x 2 ranks (emulated)") != std::string::npos);
  CHECK(reference.output.find("1/2 of each") != std::string::npos);
  const auto expected = losses(tmp / "ref.jsonl");
  REQUIRE(expected.size() == 6);
  // The same layout, stopped at step 3 and resumed: bit for bit.
  REQUIRE(run(train(layout(2, 2) + " --checkpoint-dir " + tmp / "a" + lm + " --steps 3")).exit_code == 0);
  const Run same = run(train(layout(2, 2) + " --resume-latest --checkpoint-dir " + tmp / "a" + " --metrics " +
                             tmp / "same.jsonl" + lm + " --steps 6"));
  REQUIRE_MESSAGE(same.exit_code == 0, same.output);
  for (const auto& [step, loss] : losses(tmp / "same.jsonl")) CHECK(loss == expected.at(step));
  // Across layouts: 2 x 2 to step 2, 4 nodes of 1 (plain data parallelism) to step 4, 1 node of 3 to 6.
  REQUIRE(run(train(layout(2, 2) + " --checkpoint-dir " + tmp / "b" + lm + " --steps 2")).exit_code == 0);
  const Run four = run(train(layout(4, 1) + " --resume-latest --checkpoint-dir " + tmp / "b" + " --metrics " +
                             tmp / "four.jsonl" + lm + " --steps 4"));
  REQUIRE_MESSAGE(four.exit_code == 0, four.output);
  CHECK(four.output.find("one rank per node: plain data parallelism") != std::string::npos);
  CHECK(four.output.find("(saved by 2 ranks, now 4 nodes x 1 rank)") != std::string::npos);
  const Run three = run(train(layout(1, 3) + " --resume-latest --checkpoint-dir " + tmp / "b" + " --metrics " +
                              tmp / "three.jsonl" + lm + " --steps 6"));
  REQUIRE_MESSAGE(three.exit_code == 0, three.output);
  auto across = losses(tmp / "four.jsonl");
  for (const auto& [step, loss] : losses(tmp / "three.jsonl")) across[step] = loss;
  CHECK(across.size() == 4);
  for (const auto& [step, loss] : across) {
    CAPTURE(step);
    CHECK(loss == doctest::Approx(expected.at(step)).epsilon(1e-6));
  }
  one_error_line(run(train("--emulate 4 --ranks-per-node 3 --hybrid" + lm)),
                 {"--ranks-per-node 3 does not divide --emulate 4"});
  one_error_line(run(train("--emulate 4 --hybrid --per-parameter" + lm)), {"--hybrid needs grouped parameters"});
}

TEST_CASE("--gather-quantization int8: half the bytes of the step's collectives, losses within 2%, hybrid too") {
  TempDir tmp;
  const std::string lm =
      " lm --d-model 32 --layers 2 --heads 2 --context 16 --batch 8 --steps 6 --eval-every 0 "
      "--log-every 1 --metrics ";
  const Run exact = run(train("--emulate 4" + lm + tmp / "f32.jsonl"));
  const Run int8 = run(train("--emulate 4 --gather-quantization int8" + lm + tmp / "int8.jsonl"));
  const Run hybrid =
      run(train("--emulate 4 --ranks-per-node 2 --hybrid --gather-quantization int8" + lm + tmp / "hybrid.jsonl"));
  for (const Run* r : {&exact, &int8, &hybrid}) REQUIRE_MESSAGE(r->exit_code == 0, r->output);
  CHECK(int8.output.find("int8 weight gathers") != std::string::npos);
  const auto f = last_record(tmp / "f32.jsonl"), q = last_record(tmp / "int8.jsonl"),
             h = last_record(tmp / "hybrid.jsonl");
  // A group's gathers (one, or two where the backward gathers it again) now move ~1/4 of their
  // bytes, its reduce-scatter the same: (0.25 + 1) / 2 here, where the backward takes every
  // group from the forward (2 blocks, the limit of 2, and the root).
  const double ratio = q["comm_bytes"].get<double>() / f["comm_bytes"].get<double>();
  CHECK(ratio < 0.64);
  CHECK(ratio > 0.6);
  CHECK(q["loss"].get<double>() == doctest::Approx(f["loss"].get<double>()).epsilon(0.02));
  CHECK(h["loss"].get<double>() == doctest::Approx(f["loss"].get<double>()).epsilon(0.02));
  CHECK(h["comm_bytes_inter"].get<double>() > 0);
  CHECK(h["comm_bytes_intra"].get<double>() > 0);
  one_error_line(run(train("--gather-quantization int4" + lm + tmp / "x.jsonl")), {"--gather-quantization", "int4"});
}

TEST_CASE("--grad-accum K: the losses of one batch, less activation memory; hybrid gradients cross nodes once a step") {
  TempDir tmp;
  const std::string lm =
      " lm --d-model 32 --layers 2 --heads 2 --context 16 --batch 24 --steps 4 --eval-every 0 "
      "--log-every 1 --metrics ";
  for (const std::string layout : {"--emulate 4", "--emulate 4 --ranks-per-node 2 --hybrid"}) {
    CAPTURE(layout);
    const Run one = run(train(layout + lm + tmp / "k1.jsonl"));
    const Run three = run(train(layout + " --grad-accum 3" + lm + tmp / "k3.jsonl"));
    REQUIRE_MESSAGE(one.exit_code == 0, one.output);
    REQUIRE_MESSAGE(three.exit_code == 0, three.output);
    CHECK(three.output.find("3 micro-batches per step") != std::string::npos);
    // The plan is for one micro-batch of 2 rows (of a local batch of 6), and says so.
    CHECK_MESSAGE(three.output.find("micro-batch 2; ") != std::string::npos, three.output);
    CHECK(one.output.find("local batch 6; ") != std::string::npos);
    const auto want = losses(tmp / "k1.jsonl"), got = losses(tmp / "k3.jsonl");
    REQUIRE(got.size() == 4);
    for (const auto& [step, loss] : want) CHECK(got.at(step) == doctest::Approx(loss).epsilon(1e-6));
    const auto a = last_record(tmp / "k1.jsonl"), b = last_record(tmp / "k3.jsonl");
    if (layout.find("--hybrid") != std::string::npos) {
      // One all-reduce of gradients per group whatever K, and per micro-batch one of a flag per
      // parameter (which ones the loss reached): a few hundred bytes more.
      const double inter_one = a["comm_bytes_inter"].get<double>(), inter_three = b["comm_bytes_inter"].get<double>();
      CHECK(inter_three > inter_one);
      CHECK(inter_three - inter_one < 0.01 * inter_one);
      CHECK(b["comm_bytes_intra"].get<double>() > 2 * a["comm_bytes_intra"].get<double>());  // gathers per micro-batch
    }
  }
  one_error_line(run(train("--emulate 4 --grad-accum 4" + lm + tmp / "x.jsonl")),
                 {"--grad-accum 4 does not divide the local batch of 6"});
}

TEST_CASE("--memory-limit: when no schedule of one batch fits, the plan chooses micro-batches and trains alike") {
  TempDir tmp;
  // Activations dominate (a batch of 1024 images, a layer of 64): only splitting the batch helps.
  const std::string mlp = " mlp --hidden 64 --batch 1024 --limit 4096 --test-limit 10 --epochs 1 --log-every 1";
  const Run plain = run(train("--emulate 2 --metrics " + tmp / "plain.jsonl" + mlp));
  const Run fitted = run(train("--emulate 2 --memory-limit 1.5MB --metrics " + tmp / "fitted.jsonl" + mlp));
  REQUIRE_MESSAGE(plain.exit_code == 0, plain.output);
  REQUIRE_MESSAGE(fitted.exit_code == 0, fitted.output);
  INFO(fitted.output);
  CHECK(fitted.output.find("is over the limit of 1.50 MB; chose 2 unsharded groups, recompute, 4 micro-batches") !=
        std::string::npos);
  CHECK(fitted.output.find("4 micro-batches per step") != std::string::npos);
  const auto want = losses(tmp / "plain.jsonl"), got = losses(tmp / "fitted.jsonl");
  REQUIRE(got.size() == 4);
  for (const auto& [step, loss] : want) CHECK(got.at(step) == doctest::Approx(loss).epsilon(1e-5));
  CHECK(bytes_after(fitted.output, "peak memory per rank: ") <= 1.5e6);
  // --no-auto-fit refuses instead.
  one_error_line(run(train("--emulate 2 --memory-limit 1.5MB --no-auto-fit" + mlp)), {"memory plan: needs"});
}

TEST_CASE("a short Fashion-MNIST run on a subset reaches 75% test accuracy") {
  TempDir tmp;
  const Run r =
      run(train("--emulate 2 mlp --epochs 3 --hidden 256 --limit 4000 --test-limit 2000 --batch 100 --log-every 0"
                " --metrics " +
                tmp / "m.jsonl"));
  REQUIRE_MESSAGE(r.exit_code == 0, r.output);
  std::ifstream in(tmp / "m.jsonl");
  std::string line;
  double accuracy = -1;
  int epochs_reported = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    for (const char* key : {"step", "loss", "lr", "samples_per_s", "peak_memory_bytes"}) CHECK(j.contains(key));
    if (j.contains("test_accuracy")) {
      accuracy = j["test_accuracy"].get<double>();
      ++epochs_reported;
      CHECK(j["peak_memory_bytes"].size() == 2);
    }
  }
  CHECK(epochs_reported == 3);
  CHECK(accuracy >= 0.75);
  CHECK(r.output.find("done: 120 steps") != std::string::npos);
}
