// Memory accounting: live and peak bytes, per process and per thread scope.
#include <thread>

#include "helpers.h"

using namespace ruda;

TEST_CASE("live and peak bytes follow allocations") {
  memory::Scope scope;
  CHECK(scope.stats().live_bytes == 0);
  {
    Tensor a = zeros({1024});  // 4 KiB
    CHECK(memory::stats().live_bytes == 4096);
    Tensor b = zeros({256}, DType::f64);  // 2 KiB
    CHECK(memory::stats().live_bytes == 6144);
    Tensor view = a.reshape({32, 32});  // shares storage: no new bytes
    CHECK(memory::stats().live_bytes == 6144);
  }
  CHECK(memory::stats().live_bytes == 0);
  CHECK(memory::stats().peak_bytes == 6144);
  memory::reset_peak();
  CHECK(memory::stats().peak_bytes == 0);
  CHECK(memory::stats().allocations == 2);
}

TEST_CASE("each thread's scope counts its own allocations; frees return to the allocator's scope") {
  memory::Scope outer;
  Tensor made_elsewhere;
  std::int64_t inner_live = -1;
  std::thread worker([&] {
    memory::Scope rank;
    made_elsewhere = zeros({512});
    inner_live = rank.stats().live_bytes;
  });
  worker.join();
  CHECK(inner_live == 2048);
  CHECK(outer.stats().live_bytes == 0);  // another thread's scope was charged
  const std::int64_t process_before = memory::process_stats().live_bytes;
  made_elsewhere = Tensor();
  CHECK(memory::process_stats().live_bytes == process_before - 2048);
}
