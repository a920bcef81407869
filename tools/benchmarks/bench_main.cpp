// ruda-bench: runs the registered suites and prints a table, or JSON lines with --json.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <ruda/backend.h>
#include <ruda/collectives.h>
#include <ruda/error.h>
#include <ruda/memory.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "../cli_bounds.h"
#include "bench.h"

namespace ruda::bench {

namespace {
std::map<std::string, Suite>& suites() {
  static std::map<std::string, Suite> s;
  return s;
}

nlohmann::json stats_json(nlohmann::json j, const Stats& s, const char* prefix) {
  j[std::string(prefix) + "median"] = s.median;
  j[std::string(prefix) + "min"] = s.min;
  j[std::string(prefix) + "max"] = s.max;
  return j;
}
}  // namespace

bool register_suite(const char* name, Suite suite) {
  suites()[name] = suite;
  return true;
}

/// Hook for builds whose suites must only report from one process (the MPI bench sets it).
bool (*should_print)() = [] { return true; };
int (*report_failure)(const std::string& message) = [](const std::string& message) {
  std::cerr << message << std::endl;
  return 1;
};

}  // namespace ruda::bench

int main(int argc, char** argv) {
  using namespace ruda::bench;
  // ruda-bench, or ruda-bench-mpi (this file's other build), whose ranks all parse the same
  // arguments: only the printing rank says what is wrong, once, under its own name.
  const std::string program = argc > 0 ? std::filesystem::path(argv[0]).filename().string() : "ruda-bench";
  CLI::App app{program + ": figures of ruda's kernels, collectives and training steps (medians of repeated runs)"};
  std::vector<std::string> selected;
  std::vector<std::string> backends;
  bool json = false, list = false;
  Context ctx;
  app.add_option("--suite", selected, "Suites to run (repeatable; default: all)");
  app.add_option("--backend", backends, "Backends to measure (repeatable; default: every built backend)");
  app.add_flag("--json", json, "One JSON object per figure instead of a table");
  CLI::Option* repeats =
      ruda::cli::add_whole(app, "--repeats", ctx.repeats, "Timed runs per figure (default 15, 3 with --quick)")
          ->check(ruda::cli::at_least(1));
  app.add_flag("--quick", ctx.quick, "Fewer runs and sizes (a smoke run)");
  app.add_flag("--list", list, "List the suites and exit");
  const bool printing = should_print();
  if (const std::optional<int> exit_code = ruda::cli::parse(app, argc, argv, program, printing)) return *exit_code;
  ctx.repeats_given = repeats->count() > 0;

  for (const auto& s : selected) {
    if (!suites().count(s)) {
      if (printing) std::cerr << program << ": error: unknown suite '" << s << "' (see --list)\n";
      return 2;
    }
  }
  if (backends.empty()) backends = ruda::available_backends();
  const std::vector<std::string> built = ruda::available_backends();
  for (const auto& b : backends) {
    if (std::find(built.begin(), built.end(), b) == built.end()) {
      std::string names;
      for (const auto& n : built) names += (names.empty() ? "" : ", ") + n;
      if (printing) std::cerr << program << ": error: unknown backend '" << b << "' (built: " << names << ")\n";
      return 2;
    }
  }
  // A backend or suite named twice is measured once.
  auto dedupe = [](std::vector<std::string>& names) {
    std::vector<std::string> once;
    for (const auto& n : names) {
      if (std::find(once.begin(), once.end(), n) == once.end()) once.push_back(n);
    }
    names = once;
  };
  dedupe(backends);
  dedupe(selected);
  if (list) {  // (after the checks above: --suite nope --list is refused too)
    if (printing) {
      for (const auto& [name, suite] : suites()) std::cout << name << "\n";
    }
    return 0;
  }
  // The environment the suites read, checked before any of them runs: a bad value is one line and
  // exit 2, not a terminate in the middle of a suite.
  try {
    (void)ruda::num_threads();
    (void)ruda::memory::limit();
    (void)ruda::LinkModel::from_env();
    if (const char* rate = std::getenv("RUDA_LINK_RATE"); rate && *rate) {
      try {
        (void)ruda::LinkModel::parse(std::string(rate) + "bit/s");
      } catch (const std::exception&) {
        throw ruda::ArgumentError(std::string("RUDA_LINK_RATE='") + rate +
                                  "' is not a rate in bits per second (tools/cluster-sim exports it)");
      }
    }
  } catch (const std::exception& e) {
    if (printing) std::cerr << program << ": error: " << e.what() << "\n";
    return 2;
  }

  bool header = false;
  ctx.report = [&](const Result& r) {
    if (!should_print()) return;
    if (json) {
      nlohmann::json j = {{"suite", r.suite}, {"name", r.name}, {"backend", r.backend}, {"unit", r.unit}};
      j = stats_json(j, r.value, "");
      if (r.peer) {
        j["peer"] = r.peer_name;
        j = stats_json(j, *r.peer, "peer_");
        j["ratio"] = r.value.median / r.peer->median;
      }
      std::cout << j.dump() << std::endl;
      return;
    }
    if (!header) {
      std::printf("%-12s %-40s %-8s %12s %12s %12s %-9s %12s %7s  %s\n", "suite", "name", "backend", "median", "min",
                  "max", "unit", "peer", "ratio", "peer is");
      header = true;
    }
    std::printf("%-12s %-40s %-8s %12.4g %12.4g %12.4g %-9s", r.suite.c_str(), r.name.c_str(), r.backend.c_str(),
                r.value.median, r.value.min, r.value.max, r.unit.c_str());
    if (r.peer) {
      std::printf(" %12.4g %7.3f  %s", r.peer->median, r.value.median / r.peer->median, r.peer_name.c_str());
    }
    std::printf("\n");
    std::fflush(stdout);
  };

  for (const auto& [name, suite] : suites()) {
    if (!selected.empty() && std::find(selected.begin(), selected.end(), name) == selected.end()) continue;
    for (const auto& backend : backends) {
      ctx.backend = backend;
      ruda::set_default_backend(backend);
      try {
        suite(ctx);
      } catch (const std::exception& e) {
        // One line naming the suite (a memory limit the suite's sizes pass, say), never a
        // terminate: what was measured before it has been printed.
        return report_failure(program + ": error: suite " + name + " (" + backend + "): " + e.what());
      }
    }
  }
  return 0;
}
