// The collective suite on LocalCommunicator (world size 1), and its copy-free results.
#include <ruda/collectives.h>

#include "suite.h"

namespace {

void run_local(void (*check)(ruda::Communicator&)) {
  ruda::LocalCommunicator comm;
  check(comm);
}

}  // namespace

RUDA_COLLECTIVE_SUITE("local", run_local)

TEST_CASE("local: collectives hand back the input's storage, cut from the graph") {
  using namespace ruda;
  LocalCommunicator comm;
  CHECK(comm.kind() == "local");
  CHECK(comm.rank() == 0);
  CHECK(comm.world_size() == 1);
  const Tensor x = ones({4, 3}).set_requires_grad();
  for (const Tensor& result :
       {comm.all_gather(x), comm.reduce_scatter(x), comm.all_reduce(x, Reduction::max), comm.broadcast(x, 0),
        comm.all_gather_async(x).wait(), comm.reduce_scatter_async(x).wait()}) {
    CHECK(result.shares_storage(x));
    CHECK(result.shape() == Shape{4, 3});
    CHECK_FALSE(result.requires_grad());
  }
  CHECK(comm.all_gather(scalar(2.0)).shape() == Shape{1});
  Work pending = comm.all_gather_async(x);
  CHECK(pending.ready());
  // The *_into forms copy into the caller's buffer.
  const Tensor out = zeros({4, 3});
  comm.all_gather_into(out, x.detach());
  CHECK_FALSE(out.shares_storage(x));
  CHECK(out.sum().item() == 12.0);
  // Every call is numbered in the history, oldest first.
  const std::vector<std::string> history = comm.history();
  REQUIRE(history.size() == 9);
  CHECK(history.front() == "#1 all_gather(f32, 12)");
  CHECK(history[2] == "#3 all_reduce(f32, 12, max)");
  CHECK(history[3] == "#4 broadcast(f32, 12, root 0)");
  CHECK(history[6] == "#7 all_gather(f32, 1)");
  CHECK(history.back() == "#9 all_gather(f32, 12)");
}

TEST_CASE("local: the history keeps the last 32 calls") {
  using namespace ruda;
  LocalCommunicator comm;
  for (int i = 1; i <= 40; ++i) comm.barrier({std::string("b") + std::to_string(i)});
  const std::vector<std::string> history = comm.history();
  REQUIRE(history.size() == 32);
  CHECK(history.front() == "#9 barrier(\"b9\")");
  CHECK(history.back() == "#40 barrier(\"b40\")");
}

TEST_CASE("local: the order check follows RUDA_CHECK_COLLECTIVES, and can be set") {
  using namespace ruda;
  LocalCommunicator comm;
  CHECK(comm.order_check() == order_check_from_env());
  comm.set_order_check(true);
  CHECK(comm.order_check());
  // One rank agrees with itself: the check passes.
  CHECK(comm.all_reduce(scalar(3.0)).item() == 3.0);
}
