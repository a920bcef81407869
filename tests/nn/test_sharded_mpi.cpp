// Fully sharded training equals dense training under mpiexec (run with 2 and 3 ranks): the same
// fixture as the emulated-rank tests, over MPI processes.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <ruda/mpi.h>
#include <unistd.h>

#include <filesystem>

#include "nn/sharded_fixture.h"

using namespace ruda;

namespace {
Communicator* g_comm = nullptr;
}

TEST_CASE("fully sharded TinyLM over MPI equals dense") {
  const test::TrainResult dense = test::train_tiny_dense(g_comm->world_size(), 4);
  const test::TrainResult sharded = test::train_tiny_sharded(*g_comm, 4);
  const auto [score, where] = test::compare(sharded, dense, 1e-6, 1e-5);
  CHECK_MESSAGE(score <= 1.0, "rank " << g_comm->rank() << ": worst at " << where);
}

TEST_CASE(
    "shard groups over MPI (non-blocking collectives, prefetched) equal dense; prefetch off is bitwise the same") {
  const test::TrainResult dense = test::train_tiny_dense(g_comm->world_size(), 4);
  for (auto strategy : {nn::CheckpointStrategy::recompute, nn::CheckpointStrategy::retain}) {
    const test::TrainResult grouped = test::train_tiny_grouped(*g_comm, 4, {.policy = {.strategy = strategy}});
    const auto [score, where] = test::compare(grouped, dense, 1e-6, 1e-5);
    CHECK_MESSAGE(score <= 1.0, "rank " << g_comm->rank() << ": worst at " << where);
    const test::TrainResult unprefetched =
        test::train_tiny_grouped(*g_comm, 4, {.policy = {.strategy = strategy}, .prefetch = false});
    const auto [same, at] = test::compare(unprefetched, grouped, 0, 0);
    CHECK_MESSAGE(same == 0, "rank " << g_comm->rank() << ": prefetch changed " << at);
  }
}

TEST_CASE("sharded construction over MPI equals the dense initialization's slices bitwise") {
  const std::string tiny = test::deferred_shards_mismatch(*g_comm, [] { return std::make_shared<test::TinyLM>(); });
  CHECK_MESSAGE(tiny.empty(), "differs: " << tiny);
  const std::string gpt = test::deferred_shards_mismatch(*g_comm, [] {
    return std::make_shared<nn::GPT>(
        nn::GPTConfig{.vocabulary = 11, .context = 5, .d_model = 6, .layers = 2, .heads = 2});
  });
  CHECK_MESSAGE(gpt.empty(), "differs: " << gpt);
}

TEST_CASE("the seed's layers over MPI equal dense") {
  const test::TrainResult dense = test::train_seed_dense(4);
  const test::TrainResult sharded = test::train_seed_sharded(*g_comm, 4);
  const auto [score, where] = test::compare(sharded, dense, 1e-6, 1e-5);
  CHECK_MESSAGE(score <= 1.0, "rank " << g_comm->rank() << ": worst at " << where);
}

TEST_CASE("Recompute over MPI with the order check on") {
  g_comm->set_order_check(true);
  const test::TrainResult dense = test::train_tiny_dense(g_comm->world_size(), 2);
  const test::TrainResult sharded = test::train_tiny_sharded(*g_comm, 2, {.strategy = nn::CheckpointStrategy::retain});
  const auto [score, where] = test::compare(sharded, dense, 1e-6, 1e-5);
  CHECK_MESSAGE(score <= 1.0, "rank " << g_comm->rank() << ": worst at " << where);
  g_comm->set_order_check(false);
}

TEST_CASE("a checkpoint directory that is not one directory for every rank is refused on every rank") {
  // One relative path, each rank in a working directory of its own: the ranks name the same
  // directory, as ranks on machines with node-local disks would, but rank 0 cannot see the others'
  // files. The save must fail on every rank and publish nothing (no index, no `latest`), where it
  // published a step holding rank 0's file alone.
  const int rank = g_comm->rank();
  // A base directory named by rank 0's process id, which every rank learns from one all-reduce.
  const double id =
      g_comm->all_reduce(scalar(rank == 0 ? static_cast<double>(::getpid()) : 0.0, DType::f64), Reduction::sum).item();
  const std::filesystem::path base =
      std::filesystem::temp_directory_path() / ("ruda-node-local-" + std::to_string(static_cast<long long>(id)));
  const std::filesystem::path own = base / ("rank-" + std::to_string(rank));
  std::filesystem::create_directories(own);
  const std::filesystem::path start = std::filesystem::current_path();
  std::filesystem::current_path(own);
  auto model = std::make_shared<test::TinyLM>();
  nn::fully_shard(*model, *g_comm);
  std::string error;
  try {
    nn::save_checkpoint("ckpt", 1, *model, nullptr, *g_comm);
  } catch (const IOError& e) {
    error = e.what();
  }
  std::filesystem::current_path(start);
  CHECK_MESSAGE(error.find("does not see it there") != std::string::npos, "rank " << rank << ": " << error);
  CHECK_MESSAGE(error.find("rank 1 wrote") != std::string::npos, "rank " << rank << ": " << error);
  CHECK_FALSE(std::filesystem::exists(own / "ckpt" / "latest"));
  CHECK_FALSE(std::filesystem::exists(own / "ckpt" / "step-00000001" / "index.json"));
  // Every rank has looked before any removes the base.
  g_comm->all_reduce(scalar(0.0, DType::f64), Reduction::sum);
  if (rank == 0) std::filesystem::remove_all(base);
}

int main(int argc, char** argv) {
  MpiEnvironment mpi(argc, argv);
  return mpi_abort_on_exception([&] {
    MpiCommunicator comm;
    g_comm = &comm;
    doctest::Context context(argc, argv);
    const int failed = context.run();
    // Every rank must agree on the outcome, or one rank's exit would leave the others hanging.
    const double any = comm.all_reduce(scalar(failed ? 1.0 : 0.0, DType::f64), Reduction::max).item();
    return any > 0 ? 1 : 0;
  });
}
