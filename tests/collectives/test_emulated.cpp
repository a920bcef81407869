// The collective suite on emulated ranks (world sizes 1 to 8), and what only threads can show
// cheaply: failures, timeouts and skipped collectives turned into errors, bit-reproducible sums,
// per-rank memory and threads.
#include <unistd.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <thread>

#include <ruda/collectives.h>
#include <ruda/memory.h>

#include "sanitized.h"
#include "suite.h"

namespace {

using namespace ruda;
using namespace std::chrono_literals;
using ruda::test::collectives::expect_throw;

void run_emulated(void (*check)(Communicator&)) {
  for (int n = 1; n <= 8; ++n) {
    EmulatedOptions options;
    // Odd worlds also run the order check's fingerprint exchange before every collective.
    options.check_order = n % 2 == 1;
    INFO("world size ", n);
    run_ranks(
        n, [&](Communicator& comm) { check(comm); }, options);
  }
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

bool contains(const std::string& text, const std::string& fragment) { return text.find(fragment) != std::string::npos; }

}  // namespace

RUDA_COLLECTIVE_SUITE("emulated", run_emulated)

TEST_CASE("emulated: the order check shows both sides on every rank") {
  for (int n = 2; n <= 8; ++n) {
    INFO("world size ", n);
    run_ranks(n, [](Communicator& comm) { ruda::test::collectives::order_check(comm); });
  }
}

TEST_CASE("emulated: ranks calling different collectives or counts raise even without the order check") {
  EmulatedOptions options;
  options.check_order = false;
  std::vector<std::string> messages(3);
  run_ranks(
      3,
      [&](Communicator& comm) {
        comm.all_gather(zeros({8}));
        try {
          if (comm.rank() == 1) {
            comm.reduce_scatter(zeros({24}));  // skipped the all_gather the others are in
          } else {
            comm.all_gather(zeros({8}));
          }
        } catch (const CollectiveMismatchError& e) {
          messages[static_cast<std::size_t>(comm.rank())] = e.what();
        }
        expect_throw<CollectiveMismatchError>(
            [&] { comm.all_gather(zeros({comm.rank() == 2 ? 9 : 8})); },
            {"collective #3 differs: ranks 0, 1 all_gather(f32, 8), rank 2 all_gather(f32, 9)"}, "different counts");
        // Equal counts of different shapes are different collectives too (each rank would read the
        // gathered rows in its own shape), shown with their shapes.
        expect_throw<CollectiveMismatchError>(
            [&] {
              comm.all_gather(zeros(comm.rank() == 2 ? Shape{3, 2} : Shape{2, 3}));
            },
            {"collective #4 differs: ranks 0, 1 all_gather(f32, 6) of [2, 3], rank 2 all_gather(f32, 6) of [3, 2]"},
            "different shapes");
        // Tags are compared by the order check only.
        CHECK(comm.all_gather(ones({2}), {comm.rank() == 0 ? "a" : "b"}).sum().item() == 6.0);
      },
      options);
  for (int r = 0; r < 3; ++r) {
    CHECK_MESSAGE(
        contains(messages[static_cast<std::size_t>(r)],
                 "rank " + std::to_string(r) +
                     ": collective #2 differs: ranks 0, 2 all_gather(f32, 8), rank 1 reduce_scatter(f32, 24)"),
        messages[static_cast<std::size_t>(r)]);
    CHECK(contains(messages[static_cast<std::size_t>(r)], "last 2 collectives of rank " + std::to_string(r)));
  }
}

TEST_CASE("emulated: a rank that throws fails the others' pending and next collectives, and run_ranks rethrows it") {
  const int n = 4;
  std::vector<std::string> pending(n), next(n);
  std::vector<double> waited(n, 0.0);
  const auto start = std::chrono::steady_clock::now();
  try {
    run_ranks(n, [&](Communicator& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      comm.all_gather(ones({16}), {"step 1"});
      if (comm.rank() == 2) {
        std::this_thread::sleep_for(50ms);  // the others are waiting in the next collective by now
        throw std::logic_error("injected failure");
      }
      const auto entered = std::chrono::steady_clock::now();
      try {
        comm.all_gather(ones({16}), {"step 2"});
      } catch (const RankFailedError& e) {
        pending[r] = e.what();
        waited[r] = seconds_since(entered);
      }
      try {
        comm.barrier();
      } catch (const RankFailedError& e) {
        next[r] = e.what();
      }
    });
    FAIL("run_ranks did not rethrow");
  } catch (const std::logic_error& e) {
    CHECK(std::string(e.what()) == "injected failure");
  }
  CHECK(seconds_since(start) < 10.0);  // nobody waited for the 60 s timeout
  for (int r : {0, 1, 3}) {
    const auto i = static_cast<std::size_t>(r);
    INFO("rank ", r, ": ", pending[i], " / ", next[i]);
    CHECK(contains(pending[i], "rank " + std::to_string(r) + ": all_gather(f32, 16, \"step 2\") #2: "));
    CHECK(contains(pending[i], "rank 2 failed: injected failure"));
    CHECK(contains(pending[i], "last 2 collectives of rank " + std::to_string(r) +
                                   " (oldest first):\n  #1 "
                                   "all_gather(f32, 16, \"step 1\")\n  #2 all_gather(f32, 16, \"step 2\")"));
    CHECK(waited[i] < 5.0);
    CHECK(contains(next[i], "barrier() #3: rank 2 failed: injected failure"));
  }
}

TEST_CASE("emulated: a rank that fails before any collective, with a non-standard exception") {
  std::atomic<int> failed_ranks{0};
  try {
    run_ranks(3, [&](Communicator& comm) {
      if (comm.rank() == 0) throw 42;
      try {
        comm.broadcast(zeros({3}), 0);
      } catch (const RankFailedError& e) {
        if (contains(e.what(), "rank 0 failed: unknown exception")) ++failed_ranks;
        throw;
      }
    });
    FAIL("run_ranks did not rethrow");
  } catch (int value) {
    CHECK(value == 42);
  }
  CHECK(failed_ranks == 2);
}

TEST_CASE("emulated: a timeout of centuries (milliseconds::max()) waits, instead of expiring at once") {
  // now + timeout overflowed the clock's nanoseconds and wrapped into the past: every rank that had
  // to wait for another timed out at its first collective.
  EmulatedOptions options;
  options.timeout = std::chrono::milliseconds::max();
  std::vector<double> sums(2, 0.0);
  run_ranks(
      2,
      [&](Communicator& comm) {
        if (comm.rank() == 1) std::this_thread::sleep_for(50ms);  // rank 0 waits for it
        sums[static_cast<std::size_t>(comm.rank())] = comm.all_reduce(ones({1})).item();
      },
      options);
  CHECK(sums == std::vector<double>{2.0, 2.0});
}

TEST_CASE("emulated: a rank that never arrives times out the others, naming the collective and the missing rank") {
  EmulatedOptions options;
  options.timeout = 200ms;
  std::vector<std::string> messages(3);
  std::vector<double> waited(3, 0.0);
  std::string late;
  try {
    run_ranks(
        3,
        [&](Communicator& comm) {
          if (comm.rank() == 1) {
            std::this_thread::sleep_for(1000ms);
            try {
              comm.all_gather(ones({4}), {"late"});
            } catch (const RankFailedError& e) {
              late = e.what();
            }
            return;
          }
          const auto entered = std::chrono::steady_clock::now();
          try {
            comm.all_gather(ones({4}), {"late"});
          } catch (const CollectiveTimeoutError& e) {
            messages[static_cast<std::size_t>(comm.rank())] = e.what();
            waited[static_cast<std::size_t>(comm.rank())] = seconds_since(entered);
            throw;
          }
        },
        options);
    FAIL("run_ranks did not rethrow");
  } catch (const CollectiveTimeoutError& e) {
    CHECK(contains(e.what(), "rank 1 did not arrive within 200 ms"));
  }
  for (int r : {0, 2}) {
    const auto i = static_cast<std::size_t>(r);
    INFO(messages[i]);
    CHECK(contains(messages[i], "rank " + std::to_string(r) +
                                    ": all_gather(f32, 4, \"late\") #1: rank 1 did not "
                                    "arrive within 200 ms"));
    CHECK(waited[i] >= 0.19);
    CHECK(waited[i] < 0.9);  // not held until the late rank came
  }
  CHECK(contains(late, "an earlier collective timed out: rank 1 did not arrive within 200 ms"));
}

TEST_CASE("emulated: a rank that returns without a collective the others are in") {
  std::vector<std::string> messages(3);
  const auto start = std::chrono::steady_clock::now();
  run_ranks(3, [&](Communicator& comm) {
    comm.all_reduce(ones({2}));
    if (comm.rank() == 1) return;  // skips the all_gather
    try {
      comm.all_gather(ones({5}), {"skipped"});
    } catch (const CollectiveMismatchError& e) {
      messages[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  CHECK(seconds_since(start) < 10.0);  // at once, not after the timeout
  for (int r : {0, 2}) {
    INFO(messages[static_cast<std::size_t>(r)]);
    CHECK(contains(messages[static_cast<std::size_t>(r)],
                   "rank 1 returned without calling collective #2 all_gather(f32, 5, \"skipped\")"));
  }
}

TEST_CASE("emulated: sums run in rank order, bit for bit, run after run") {
  const int n = 5;
  const std::int64_t rows = 4099;
  // Random inputs, so that the order of additions shows in the low bits.
  auto data = [&](int rank, DType dtype) {
    return cast(randn({rows * n}, 1234, std::uint64_t(rank) * rows * n), dtype);
  };
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    for (Accumulate accumulate : {Accumulate::f32, Accumulate::native}) {
      INFO(dtype_name(dtype), accumulate == Accumulate::native ? " native" : " f32");
      // The single-process reference: rank 0 + rank 1 + ... in f32, rounded once or at every step.
      std::vector<std::vector<float>> inputs;
      for (int k = 0; k < n; ++k) inputs.push_back(data(k, dtype).to_vector<float>());
      auto round16 = [&](float v) {
        return dtype == DType::bf16 ? to_float(to_bfloat16(v)) : dtype == DType::f16 ? to_float(to_float16(v)) : v;
      };
      std::vector<float> expected(static_cast<std::size_t>(rows * n));
      for (std::size_t i = 0; i < expected.size(); ++i) {
        float s = inputs[0][i];
        for (int k = 1; k < n; ++k) {
          s = s + inputs[static_cast<std::size_t>(k)][i];
          if (accumulate == Accumulate::native) s = round16(s);
        }
        expected[i] = round16(s);
      }
      std::vector<std::vector<float>> first(n);
      for (int run = 0; run < 2; ++run) {
        run_ranks(n, [&](Communicator& comm) {
          const auto r = static_cast<std::size_t>(comm.rank());
          CollectiveOptions options;
          options.accumulate = accumulate;
          const std::vector<float> piece = comm.reduce_scatter(data(comm.rank(), dtype), options).to_vector<float>();
          const std::vector<float> whole =
              comm.all_reduce(data(comm.rank(), dtype), Reduction::sum, options).to_vector<float>();
          bool same = true;
          for (std::int64_t i = 0; i < rows; ++i) {
            same = same && piece[static_cast<std::size_t>(i)] == expected[r * rows + static_cast<std::size_t>(i)];
          }
          for (std::size_t i = 0; i < whole.size(); ++i) same = same && whole[i] == expected[i];
          CHECK_MESSAGE(same, "rank ", r, " differs from the rank-order reference");
          if (run == 0) {
            first[r] = whole;
          } else {
            CHECK(first[r] == whole);
          }
        });
      }
    }
  }
}

TEST_CASE("emulated: each rank has its own memory figures and intra-op threads") {
  EmulatedOptions options;
  options.threads_per_rank = 2;
  run_ranks(
      3,
      [](Communicator& comm) {
        CHECK(num_threads() == 2);
        CHECK(memory::stats().live_bytes == 0);
        const Tensor mine = zeros({(comm.rank() + 1) * 1000});
        comm.barrier();  // every rank has allocated
        CHECK(memory::stats().live_bytes == mine.nbytes());
        const Tensor local = ones({100});
        const Tensor gathered = comm.all_gather(local);
        CHECK(memory::stats().live_bytes == mine.nbytes() + local.nbytes() + gathered.nbytes());
      },
      options);
  run_ranks(4, [](Communicator&) {
    const char* env = std::getenv("RUDA_NUM_THREADS");
    const int expected = env && std::atoi(env) > 0 ? std::atoi(env) : std::max(1, hardware_threads() / 4);
    CHECK(num_threads() == expected);
  });
}

TEST_CASE("emulated: many small collectives in a row stay in step") {
  run_ranks(8, [](Communicator& comm) {
    for (int i = 0; i < 200; ++i) {
      const Tensor x = full({3}, comm.rank() + i, Options(DType::i64));
      const std::vector<std::int64_t> sum = comm.all_reduce(x).to_vector<std::int64_t>();
      const std::int64_t expected = 28 + 8 * i;
      CHECK(sum == std::vector<std::int64_t>{expected, expected, expected});
      if (i % 50 == 0) comm.barrier();
    }
  });
}

TEST_CASE("emulated: run_ranks refuses bad arguments") {
  auto nothing = [](Communicator&) {};
  CHECK_THROWS_AS(run_ranks(0, nothing), ArgumentError);
  CHECK_THROWS_AS(run_ranks(2, {}), ArgumentError);
  EmulatedOptions options;
  options.timeout = 0ms;
  CHECK_THROWS_AS(run_ranks(2, nothing, options), ArgumentError);
  options.timeout = 1000ms;
  options.threads_per_rank = -1;
  CHECK_THROWS_AS(run_ranks(2, nothing, options), ArgumentError);
  run_ranks(1, [](Communicator& comm) {
    CHECK(comm.kind() == "emulated");
    CHECK(comm.world_size() == 1);
  });
}

TEST_CASE("emulated: ranks_per_node makes nodes of consecutive ranks, or is refused when it does not divide") {
  EmulatedOptions options;
  options.ranks_per_node = 2;
  std::vector<int> node_size(6), node_first(6), nodes(6);
  run_ranks(
      6,
      [&](Communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        const auto node = comm.split_by_node();
        node_size[r] = node->world_size();
        node_first[r] = static_cast<int>(node->all_reduce(scalar(comm.rank()), Reduction::max).item()) - 1;
        const ShardMesh mesh = ShardMesh::by_node(comm);
        nodes[r] = mesh.nodes();
      },
      options);
  for (int r = 0; r < 6; ++r) {
    CAPTURE(r);
    CHECK(node_size[static_cast<std::size_t>(r)] == 2);
    CHECK(node_first[static_cast<std::size_t>(r)] == r / 2 * 2);
    CHECK(nodes[static_cast<std::size_t>(r)] == 3);
  }
  for (const int bad : {0, 4, -1}) {
    options.ranks_per_node = bad;
    CAPTURE(bad);
    expect_throw<TopologyError>(
        [&] {
          run_ranks(
              6, [](Communicator&) {}, options);
        },
        {"run_ranks", "ranks per node " + std::to_string(bad), "world of 6"}, "run_ranks with a bad ranks_per_node");
  }
}

TEST_CASE("emulated: a ShardMesh whose communicators one rank passes swapped is refused on every rank") {
  // Found by the MPI probe: the places gathered over the two communicators paired rank 0's gather
  // on one with the others' on the other, the check passed, and the mesh's collectives then mixed
  // the groups (rank 0's shard sum held rank 2's replicate contribution) without an error.
  std::vector<std::string> errors(4);
  run_ranks(4, [&](Communicator& world) {
    const int r = world.rank();
    auto by_block = world.split(r / 2, r);  // {0, 1} {2, 3}
    auto by_place = world.split(r % 2, r);  // {0, 2} {1, 3}
    try {
      const ShardMesh mesh = r == 0 ? ShardMesh(world, std::move(by_place), std::move(by_block))
                                    : ShardMesh(world, std::move(by_block), std::move(by_place));
    } catch (const TopologyError& e) {
      errors[static_cast<std::size_t>(r)] = e.what();
    }
  });
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    const std::string& e = errors[static_cast<std::size_t>(r)];
    CHECK_MESSAGE(e.find("do not tile the world of 4 ranks") != std::string::npos, e);
    CHECK_MESSAGE(e.find("of another replica") != std::string::npos, e);
  }
  // The same communicators in the same order on every rank still make a mesh.
  run_ranks(4, [&](Communicator& world) {
    const int r = world.rank();
    const ShardMesh mesh(world, world.split(r / 2, r), world.split(r % 2, r));
    CHECK(mesh.shard().all_reduce(full({1}, 1 << r)).item() == (r < 2 ? 3 : 12));
  });
}

TEST_CASE("emulated: with nodes, a link model is one link per node: free inside it, shared by what crosses it") {
  EmulatedOptions options;
  // Little data on a slow link: the modeled times dwarf the copying, even under sanitizers.
  options.link = LinkModel::parse("100kB/s");
  options.ranks_per_node = 2;
  const std::int64_t count = 10000;  // f32: 40 kB per rank: 400 ms between two ranks
  const double world_time = std::chrono::duration<double>(options.link->all_gather_time(4, 4 * count)).count();
  const double pair_time = std::chrono::duration<double>(options.link->all_gather_time(2, 4 * count)).count();
  std::vector<double> intra(4), world(4), across(4);
  run_ranks(
      4,
      [&](Communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        const ShardMesh mesh = ShardMesh::by_node(comm);
        const Tensor mine = full({count}, static_cast<double>(comm.rank()));
        comm.barrier();
        auto start = std::chrono::steady_clock::now();
        CHECK(mesh.shard().all_gather(mine).numel() == 2 * count);
        intra[r] = seconds_since(start);
        start = std::chrono::steady_clock::now();
        CHECK(comm.all_gather(mine).numel() == 4 * count);
        world[r] = seconds_since(start);
        comm.barrier();
        // Both replicate communicators at once: each node's link carries both.
        start = std::chrono::steady_clock::now();
        CHECK(mesh.replicate().all_gather(mine).numel() == 2 * count);
        across[r] = seconds_since(start);
      },
      options);
  const double slowest_across = *std::max_element(across.begin(), across.end());
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    const auto i = static_cast<std::size_t>(r);
    CHECK(intra[i] < pair_time / 4);       // inside a node: no link time
    CHECK(world[i] >= 0.95 * world_time);  // the world's ring crosses each node's link once...
    CHECK(world[i] < 1.6 * world_time);    // ...not once per rank of the node
    CHECK(across[i] >= 0.95 * pair_time);  // (a rank that starts its clock late measures a little less)
  }
  CHECK(slowest_across >= 1.9 * pair_time);  // the second replicate all_gather waited for the first
}

TEST_CASE("emulated: a rank that fails makes the ranks waiting in a split communicator raise, never hang") {
  EmulatedOptions options;
  options.ranks_per_node = 2;
  std::vector<std::string> errors(4);
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(run_ranks(
                      4,
                      [&](Communicator& comm) {
                        const ShardMesh mesh = ShardMesh::by_node(comm);
                        if (comm.rank() == 3) {
                          std::this_thread::sleep_for(50ms);
                          throw std::logic_error("injected failure");
                        }
                        try {
                          // Ranks 0 and 1 in their own node (complete), then everyone across nodes.
                          mesh.shard().all_gather(ones({4}), {"node"});
                          mesh.replicate().all_gather(ones({4}), {"across"});
                          mesh.shard().barrier();
                        } catch (const CollectiveError& e) {
                          // Rethrown: a rank that returned instead would make its partners raise
                          // a mismatch (it skipped their collective) rather than the failure.
                          errors[static_cast<std::size_t>(comm.rank())] = e.what();
                          throw;
                        }
                      },
                      options),
                  std::logic_error);
  CHECK(seconds_since(start) < 10.0);
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    // Rank 3 of the run, which is rank 1 of its node's split: the cause says which numbering.
    CHECK(contains(errors[static_cast<std::size_t>(r)], "rank 3 of the run failed: injected failure"));
  }
}

TEST_CASE("emulated: a link model is parsed from text and names its source when wrong") {
  CHECK(LinkModel::parse("1GB/s").bytes_per_second == 1e9);
  CHECK(LinkModel::parse("10Gbit/s").bytes_per_second == 1.25e9);
  CHECK(LinkModel::parse("512MiB/s").bytes_per_second == 512.0 * 1048576);
  const LinkModel both = LinkModel::parse("100MB/s,20us");
  CHECK(both.bytes_per_second == 1e8);
  CHECK(both.latency == 20us);
  for (const char* off : {"", "off", "0", " off "}) CHECK_FALSE(LinkModel::parse(off).enabled());
  // Spaces around the parts, lower-case units and tc's spellings (tools/cluster-sim's rates).
  CHECK(LinkModel::parse(" 1GB/s, 20us ").latency == 20us);
  CHECK(LinkModel::parse("300mbit").bytes_per_second == 300e6 / 8);
  CHECK(LinkModel::parse("1gbit/s").bytes_per_second == 1e9 / 8);
  CHECK(LinkModel::parse("100kbit").bytes_per_second == 100e3 / 8);
  // Described in a unit that shows the rate (a slow link was "0.0 MB/s" in the errors naming it).
  CHECK(LinkModel::parse("1GB/s").describe() == "1.00 GB/s");
  CHECK(LinkModel::parse("100Mbit/s,20us").describe() == "12.5 MB/s, 20.0 us latency");
  CHECK(LinkModel::parse("1kB/s,2ms").describe() == "1.0 kB/s, 2.0 ms latency");
  CHECK(LinkModel::parse("8bit/s,5ns").describe() == "1 B/s, 5 ns latency");
  expect_throw<ArgumentError>([] { LinkModel::parse("1e308GB/s", "RUDA_EMULATE_LINK"); },
                              {"RUDA_EMULATE_LINK", "not finite"}, "infinite bandwidth");
  for (const char* bad : {"fast", "1GB", "1 furlongs/s", "-1GB/s", "0GB/s", "1GB/s,20", "1GB/s,x"}) {
    CAPTURE(bad);
    expect_throw<ArgumentError>([&] { LinkModel::parse(bad, "RUDA_EMULATE_LINK"); },
                                {"RUDA_EMULATE_LINK", std::string("'") + bad + "'"}, bad);
  }
  // A ring over 4 ranks: all_gather sends 3 messages of the contribution, all_reduce 6 of a quarter.
  const LinkModel link = LinkModel::parse("1GB/s,10us");
  CHECK(link.all_gather_time(4, 1000000) == 3ms + 30us);
  CHECK(link.all_reduce_time(4, 4000000) == 6ms + 60us);
  CHECK(link.all_gather_time(1, 1000000) == 0ns);
  // Values whose modeled times overflowed int64 nanoseconds into the past (a latency of 1e20 s
  // read as INT64_MIN ns, a 1e-300 B/s link's all_gather as INT64_MIN) are refused when parsed...
  expect_throw<ArgumentError>([] { LinkModel::parse("1GB/s,1e20s", "RUDA_EMULATE_LINK"); },
                              {"RUDA_EMULATE_LINK", "a latency above 1 hour"}, "huge latency");
  expect_throw<ArgumentError>([] { LinkModel::parse("1e-300B/s", "RUDA_EMULATE_LINK"); },
                              {"RUDA_EMULATE_LINK", "a bandwidth below 1 bit/s"}, "tiny bandwidth");
  CHECK(LinkModel::parse("1GB/s,3600s").latency == 1h);
  // ... and saturate (at ~31 years) where the fields are set directly.
  LinkModel slow;
  slow.bytes_per_second = 1e-300;
  CHECK(slow.all_gather_time(16, 1) == std::chrono::nanoseconds(1000000000000000000));
  LinkModel late;
  late.bytes_per_second = 1e9;
  late.latency = std::chrono::nanoseconds(INT64_MAX / 2);
  CHECK(late.all_gather_time(16, 1) == std::chrono::nanoseconds(1000000000000000000));
  CHECK(late.broadcast_time(16, 1) == std::chrono::nanoseconds(1000000000000000000));
}

TEST_CASE("emulated: a link or world that would sleep past the timeout or exhaust threads is refused up front") {
  // Hexadecimal numbers and NUL characters are no link models (strtod read "0x10GB/s" as 16 GB/s;
  // a NUL ended the text early and the rest went unread).
  for (const std::string& bad : {std::string("0x10GB/s"), std::string("1GB/s\0junk", 10), std::string("1GB/s,0x5us")}) {
    expect_throw<ArgumentError>([&] { LinkModel::parse(bad, "RUDA_EMULATE_LINK"); }, {"RUDA_EMULATE_LINK"}, "bad text");
  }
  EmulatedOptions slow;
  slow.link = LinkModel{};
  slow.link->bytes_per_second = 1e-300;  // as parse refuses it: the modeled sleep ignored the timeout
  expect_throw<ArgumentError>(
      [&] {
        run_ranks(
            2, [](Communicator&) {}, slow);
      },
      {"run_ranks", "at least 1 bit/s"}, "tiny bandwidth");
  EmulatedOptions backwards;
  backwards.link = LinkModel{1e9, std::chrono::nanoseconds(-5)};
  expect_throw<ArgumentError>(
      [&] {
        run_ranks(
            2, [](Communicator&) {}, backwards);
      },
      {"run_ranks", "latency"}, "negative latency");
  // A modeled time longer than the collective timeout raises on every rank instead of sleeping it.
  EmulatedOptions tight;
  tight.link = LinkModel::parse("1kB/s");
  tight.timeout = 200ms;
  std::atomic<int> refused{0};
  run_ranks(
      2,
      [&](Communicator& comm) {
        expect_throw<ArgumentError>([&] { (void)comm.all_reduce(ones({1024}), Reduction::sum); },
                                    {"all_reduce", "link model", "longer than the collective timeout of 200 ms"},
                                    "modeled past the timeout");
        ++refused;
      },
      tight);
  CHECK(refused == 2);
  expect_throw<ArgumentError>([] { run_ranks(1 << 20, [](Communicator&) {}); }, {"run_ranks", "world size 1048576"},
                              "a million ranks");
}

TEST_CASE("emulated: a split kept past run_ranks raises at once, and a tag with a NUL is refused") {
  // Its world was freed with the run, and a collective read "ranks  did not arrive" after the timeout.
  std::unique_ptr<Communicator> kept;
  EmulatedOptions options;
  options.timeout = 30s;  // not waited for
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto mine = comm.split(0, comm.rank());
        if (comm.rank() == 0) kept = std::move(mine);
        expect_throw<ArgumentError>(
            [&] { (void)comm.all_reduce(ones({2}), Reduction::sum, {.tag = std::string("a\0b", 3)}); },
            {"all_reduce", "rank ", "'a\\0b'", "NUL"}, "tag with a NUL");
      },
      options);
  REQUIRE(kept);
  const auto start = std::chrono::steady_clock::now();
  expect_throw<RankFailedError>([&] { (void)kept->all_reduce(ones({2}), Reduction::sum); },
                                {"all_reduce", "the emulated run has ended"}, "kept split");
  CHECK(std::chrono::steady_clock::now() - start < 10s);
}

namespace {
// Resident pages of this process (Linux).
long resident_bytes() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return resident * ::sysconf(_SC_PAGESIZE);
}
}  // namespace

TEST_CASE("emulated: a split whose communicators are gone is freed, not kept until run_ranks returns") {
  // Every split's world was kept for the run: one that split every step grew ~0.9 kB a split
  // (18 MB resident over 20000), while MPI's stayed flat.
#ifdef RUDA_TEST_SANITIZED
  // A sanitizer's allocator holds freed memory back (ASan's quarantine), so resident size grows
  // by what was freed: the splits run (their races are checked), the growth is not.
  constexpr int kSplits = 2000;
#else
  constexpr int kSplits = 20000;
#endif
  long growth = 0;
  run_ranks(2, [&](Communicator& comm) {
    for (int i = 0; i < 200; ++i) comm.split(0, comm.rank())->barrier();  // warm: allocator, first worlds
    comm.barrier();
    const long before = comm.rank() == 0 ? resident_bytes() : 0;
    for (int i = 0; i < kSplits; ++i) comm.split(0, comm.rank())->barrier();
    comm.barrier();
    if (comm.rank() == 0) growth = resident_bytes() - before;
  });
#ifdef RUDA_TEST_SANITIZED
  MESSAGE("resident growth not checked under a sanitizer (" << growth << " bytes after " << kSplits << " splits)");
#else
  CHECK_MESSAGE(growth < (6l << 20), growth, " bytes more resident after 20000 splits");
#endif
}

TEST_CASE("emulated: a rank waiting in a split whose other member has returned raises at once") {
  // Rank 0 splits and returns, its communicator gone with it, before rank 1 splits: rank 1's
  // world is made anew, and finish() had reached only rank 0's, so rank 1's barrier waited out
  // the timeout instead of raising.
  EmulatedOptions options;
  options.timeout = 30s;
  const auto start = std::chrono::steady_clock::now();
  std::string error;
  try {
    run_ranks(
        2,
        [&](Communicator& comm) {
          if (comm.rank() == 0) {
            (void)comm.split(0, 0);
            return;
          }
          std::this_thread::sleep_for(200ms);
          comm.split(0, 1)->barrier();
        },
        options);
  } catch (const Error& e) {
    error = e.what();
  }
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  CHECK_MESSAGE(!error.empty(), "rank 1's barrier should have failed");
}

TEST_CASE("emulated: a split communicator's errors name the rank it was split from as well as its own") {
  // "rank 0: ..." from a node's communicator did not say which process of the run it was.
  EmulatedOptions options;
  options.check_order = true;
  options.ranks_per_node = 2;
  std::vector<std::string> errors(4);
  run_ranks(
      4,
      [&](Communicator& comm) {
        auto odd_even = comm.split(comm.rank() % 2, comm.rank());
        auto node = comm.split_by_node();
        const auto r = static_cast<std::size_t>(comm.rank());
        expect_throw<ShapeError>([&] { (void)odd_even->reduce_scatter(ones({3})); },
                                 {"reduce_scatter", "rank " + std::to_string(comm.rank() / 2) + " (rank " +
                                                        std::to_string(comm.rank()) + " before the split)"},
                                 "local check");
        try {
          (void)node->all_gather(ones({comm.rank() == 3 ? 3 : 2}), {.tag = "x"});
        } catch (const CollectiveMismatchError& e) {
          errors[r] = e.what();
        }
      },
      options);
  // Node 1 (ranks 2 and 3) disagree; each names itself in both communicators.
  CHECK(errors[0].empty());
  CHECK(errors[1].empty());
  CHECK(errors[2].find("rank 0 (rank 2 before the split_by_node)") != std::string::npos);
  CHECK(errors[3].find("rank 1 (rank 3 before the split_by_node)") != std::string::npos);
}

TEST_CASE("emulated: run_agreed lets nothing escape, an exception of any type or an empty phase alike") {
  run_ranks(2, [](Communicator& comm) {
    const auto thrown = run_agreed(comm, "odd", [&] {
      if (comm.rank() == 1) throw 42;  // not a std::exception: it escaped on rank 1 alone
    });
    REQUIRE(thrown.size() == 1);
    CHECK(thrown[0].rank == 1);
    CHECK(thrown[0].message.find("not a std::exception") != std::string::npos);
    const auto empty = run_agreed(comm, "empty", std::function<void()>());
    REQUIRE(empty.size() == 2);
    CHECK(empty[0].message.find("phase function is empty") != std::string::npos);
  });
}

TEST_CASE("emulated: ranks at their memory limit still agree: the agreement's bytes are exempt from it") {
  // Refused there, the agreement threw OutOfMemoryError instead of reporting: a checkpoint's
  // publishing phase then reported a save as failed after its index and latest pointer were written.
  const std::int64_t saved = memory::limit();
  memory::set_limit(1);
  std::vector<std::vector<RankFailure>> seen(2);
  std::vector<std::vector<double>> flags(2);
  run_ranks(2, [&](Communicator& comm) {
    seen[static_cast<std::size_t>(comm.rank())] = run_agreed(comm, "at the limit", [&] {
      if (comm.rank() == 1) (void)zeros({16});  // this one is refused, as the limit says
    });
    flags[static_cast<std::size_t>(comm.rank())] =
        agree_on_max(comm, {static_cast<double>(comm.rank()), 1.0 - comm.rank()}, "flags at the limit");
  });
  memory::set_limit(saved);
  for (const auto& failures : seen) {
    REQUIRE(failures.size() == 1);
    CHECK(failures[0].rank == 1);
    CHECK(failures[0].message.find("out of memory") != std::string::npos);
  }
  for (const auto& f : flags) CHECK(f == std::vector<double>{1.0, 1.0});
}

TEST_CASE("emulated: a ShardMesh moved from raises ArgumentError from every accessor, instead of a null dereference") {
  run_ranks(2, [](Communicator& comm) {
    ShardMesh mesh = ShardMesh::by_node(comm, 1);
    const ShardMesh moved = std::move(mesh);
    CHECK(moved.describe() == "2 nodes x 1 rank");
    expect_throw<ArgumentError>([&] { (void)mesh.describe(); }, {"ShardMesh::", "moved from"}, "describe");
    expect_throw<ArgumentError>([&] { (void)mesh.shard(); }, {"ShardMesh::shard", "moved from"}, "shard");
    expect_throw<ArgumentError>([&] { (void)mesh.replicate(); }, {"ShardMesh::replicate"}, "replicate");
    expect_throw<ArgumentError>([&] { (void)mesh.world(); }, {"ShardMesh::world"}, "world");
  });
}

TEST_CASE("emulated: a ShardMesh's destroyed world and ranks asking for other node sizes are typed errors") {
  // world() of a mesh whose world communicator was destroyed dereferenced it (a segfault).
  run_ranks(2, [](Communicator& comm) {
    auto world = comm.split(0, comm.rank());
    const ShardMesh mesh = ShardMesh::by_node(*world, 1);
    world.reset();
    expect_throw<ArgumentError>([&] { (void)mesh.world(); }, {"ShardMesh::world", "destroyed"}, "world");
    CHECK(mesh.shard().world_size() == 1);  // its own communicators are still there
  });
  // Ranks passing other counts: a layout rank 0 did not ask for, silently (both counts valid), or
  // the ranks whose count was valid waiting in split() until the timeout (under MPI).
  for (const int other : {1, 3}) {
    run_ranks(2, [other](Communicator& comm) {
      expect_throw<TopologyError>(
          [&] { (void)ShardMesh::by_node(comm, comm.rank() == 0 ? 2 : other); },
          {"ShardMesh::by_node", "different ranks per node", "rank 0 for 2", "rank 1 for " + std::to_string(other)},
          "by_node");
      CHECK(ShardMesh::by_node(comm, 2).describe() == "1 node x 2 ranks");  // agreed: fine
    });
  }
}

TEST_CASE("emulated: a collective begun while another thread's runs on the communicator is refused, not a crash") {
  // Two threads' calls interleaved in the communicator's records (one thread's call paired with
  // the other's) or crashed. Rank 0's helper thread waits in an all_reduce that rank 1 joins only
  // after rank 0's main thread was refused.
  std::atomic<bool> refused{false}, helper_started{false};
  run_ranks(2, [&](Communicator& comm) {
    if (comm.rank() == 1) {
      while (!refused) std::this_thread::sleep_for(1ms);
      CHECK(comm.all_reduce(ones({2})).sum().item() == 4.0);
      comm.barrier();
      return;
    }
    std::thread helper([&] {
      helper_started = true;
      CHECK(comm.all_reduce(ones({2})).sum().item() == 4.0);
    });
    while (!helper_started) std::this_thread::sleep_for(1ms);
    std::this_thread::sleep_for(200ms);  // the helper is inside its all_reduce, waiting for rank 1
    expect_throw<ArgumentError>([&] { comm.barrier(); },
                                {"barrier", "rank 0", "another thread", "one thread at a time"}, "barrier");
    refused = true;
    helper.join();
    comm.barrier();  // one thread at a time again: fine, from any thread
  });
}

TEST_CASE("emulated: an Accumulate that changes nothing is no mismatch; split against split_by_node is one") {
  run_ranks(2, [](Communicator& comm) {
    const Accumulate mine = comm.rank() == 0 ? Accumulate::f32 : Accumulate::native;
    // A max and f32 sums ignore the option, as under MPI: the ranks call the same collective (this
    // was a CollectiveMismatchError whose two sides read the same).
    const Tensor x = from_vector<float>({1.0f, comm.rank() == 0 ? 5.0f : 2.0f}, {2}).to(DType::bf16);
    CHECK(comm.all_reduce(x, Reduction::max, {.accumulate = mine}).to_vector<float>() == std::vector<float>{1, 5});
    CHECK(comm.all_reduce(ones({2}), Reduction::sum, {.accumulate = mine}).sum().item() == 4.0);
    CHECK(comm.reduce_scatter(ones({4}), {.accumulate = mine}).sum().item() == 4.0);
    // A 16-bit sum's result depends on it: a mismatch still.
    expect_throw<CollectiveMismatchError>(
        [&] { (void)comm.all_reduce(ones({2}, DType::bf16), Reduction::sum, {.accumulate = mine}); },
        {"differs", "native"}, "a 16-bit sum accumulated two ways");
  });
  // split and split_by_node used to meet as one collective: each rank got a communicator of its own.
  run_ranks(2, [](Communicator& comm) {
    expect_throw<CollectiveMismatchError>([&] { (void)(comm.rank() == 0 ? comm.split(0, 0) : comm.split_by_node()); },
                                          {"differs", "split_by_node"}, "split against split_by_node");
  });
}

TEST_CASE("emulated: under a link model a collective takes its modeled time, and compute hides a non-blocking one") {
  EmulatedOptions options;
  // Small data on a slow link: the modeled time dwarfs the copying, even under sanitizers.
  options.link = LinkModel::parse("10MB/s");  // 400 kB per rank over 2 ranks: 40 ms
  const std::int64_t count = 100000;          // f32: 400 kB
  const auto modeled = options.link->all_gather_time(2, 4 * count);
  REQUIRE(modeled == 40ms);
  std::vector<double> blocking(2), waited(2), queued(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        const Tensor mine = full({count}, static_cast<double>(comm.rank()));
        auto start = std::chrono::steady_clock::now();
        const Tensor gathered = comm.all_gather(mine);
        blocking[r] = seconds_since(start);
        CHECK(gathered.slice(0, count, 2 * count).to_vector<float>()[0] == 1.0f);
        // Non-blocking: the start returns at once; compute that lasts the modeled time hides it,
        // so wait() returns at once (the link was done by the time compute ended).
        Work work = comm.all_gather_async(mine);
        std::this_thread::sleep_for(modeled);
        start = std::chrono::steady_clock::now();
        CHECK(work.wait().numel() == 2 * count);
        waited[r] = seconds_since(start);
        // Two started back to back share the link: the second is done only after both times.
        start = std::chrono::steady_clock::now();
        Work first = comm.all_gather_async(mine), second = comm.all_gather_async(mine);
        second.wait();
        queued[r] = seconds_since(start);
        first.wait();
      },
      options);
  const double t = std::chrono::duration<double>(modeled).count();
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(blocking[r] >= t);
    CHECK(blocking[r] < t + 2.0);  // generous: the copy itself, and a loaded machine
    CHECK(waited[r] < t / 2);
    CHECK(queued[r] >= 2 * t);
  }
}

TEST_CASE("emulated: traffic() counts bus bytes, the time collectives took, and the part the caller waited") {
  EmulatedOptions options;
  // Small data on a slow link: the modeled time dwarfs the copying, even under sanitizers.
  options.link = LinkModel::parse("4MB/s");
  const std::int64_t count = 100000;  // f32: 400 kB, 100 ms a message over the link
  std::vector<Traffic> blocking(3), hidden(3);
  run_ranks(
      3,
      [&](Communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        comm.reset_traffic();
        comm.all_gather(ones({count}));          // 2 messages of 400 kB
        comm.reduce_scatter(ones({3 * count}));  // 2 messages of 400 kB
        comm.all_reduce(ones({3 * count}));      // 4 messages of 400 kB
        comm.broadcast(ones({count}), 0);        // 400 kB
        comm.barrier();
        blocking[r] = comm.traffic();
        comm.reset_traffic();
        Work work = comm.all_gather_async(ones({count}));
        std::this_thread::sleep_for(options.link->all_gather_time(3, 4 * count));  // compute that hides it
        work.wait();
        hidden[r] = comm.traffic();
      },
      options);
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    const Traffic& b = blocking[static_cast<std::size_t>(r)];
    CHECK(b.collectives == 5);
    CHECK(b.bytes == 2 * 400000 + 2 * 400000 + 4 * 400000 + 400000);
    CHECK(b.seconds >= 0.100 * 9);  // the modeled link time of 9 messages
    CHECK(b.exposed_seconds == b.seconds);
    const Traffic& h = hidden[static_cast<std::size_t>(r)];
    CHECK(h.collectives == 1);
    CHECK(h.bytes == 2 * 400000);
    CHECK(h.seconds >= 0.200);
    CHECK(h.exposed_seconds < h.seconds / 2);
  }
}

TEST_CASE("emulated: a Work waited for on another thread counts its traffic beside the rank's own collectives") {
  // The Work's accounting and the communicator's (traffic, and when the collectives before were
  // done) share one ledger under a lock: a Work waited for on a thread of the caller's while the
  // rank's thread ran collectives raced on both (found by ThreadSanitizer, which the tsan preset
  // runs this suite under; counts could be lost, which a plain run rarely shows).
  EmulatedOptions options;
  options.link = LinkModel::parse("100MB/s,200us");
  std::vector<Traffic> traffic(2);
  std::vector<double> reduced(2);
  run_ranks(
      2,
      [&](Communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        comm.reset_traffic();
        Work pending = comm.all_reduce_async(ones({1024}));
        Tensor sum;
        std::exception_ptr failed;  // raised on the rank's thread (an exception ending a thread terminates)
        std::thread waiter([&] {
          try {
            sum = pending.wait();
          } catch (...) {
            failed = std::current_exception();
          }
        });
        for (int i = 0; i < 3; ++i) (void)comm.all_reduce(ones({16}));
        waiter.join();
        if (failed) std::rethrow_exception(failed);
        reduced[r] = sum.to_vector<double>().front();
        traffic[r] = comm.traffic();
      },
      options);
  for (std::size_t r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(reduced[r] == 2.0);
    CHECK(traffic[r].collectives == 4);
    CHECK(traffic[r].bytes == 4096 + 3 * 64);  // all_reduce over 2 ranks: 2 (world - 1) / world x the tensor
    CHECK(traffic[r].seconds > 0);
  }
}

TEST_CASE("emulated: collectives queued on one link count their own time, not the wait in the queue as hidden") {
  // Two non-blocking gathers started together take turns on the link (200 ms each here): the
  // second's 200 ms in the queue were counted as its own communication, hidden behind compute
  // that never ran (600 ms counted, 400 ms waited, in 400 ms of link time).
  EmulatedOptions options;
  options.link = LinkModel::parse("4MB/s");
  const std::int64_t count = 100000;  // f32: 400 kB per rank, 2 messages of 100 ms over 3 ranks
  std::vector<Traffic> queued(3);
  std::vector<double> first_start(3), second_start(3);
  run_ranks(
      3,
      [&](Communicator& comm) {
        const Tensor first_input = ones({count}), second_input = ones({count});
        comm.reset_traffic();
        const auto begin = std::chrono::steady_clock::now();
        Work first = comm.all_gather_async(first_input);
        const auto before = std::chrono::steady_clock::now();
        Work second = comm.all_gather_async(second_input);
        const auto after = std::chrono::steady_clock::now();
        first_start[static_cast<std::size_t>(comm.rank())] = std::chrono::duration<double>(before - begin).count();
        second_start[static_cast<std::size_t>(comm.rank())] = std::chrono::duration<double>(after - before).count();
        first.wait();
        second.wait();
        queued[static_cast<std::size_t>(comm.rank())] = comm.traffic();
      },
      options);
  const double link = 2 * std::chrono::duration<double>(options.link->all_gather_time(3, 4 * count)).count();
  for (std::size_t r = 0; r < 3; ++r) {
    const Traffic& t = queued[r];
    CHECK(t.collectives == 2);
    CHECK(t.seconds >= link * 0.95);
    // The link's time and the starts' copying (slow under sanitizers), not the queue again.
    CHECK(t.seconds < link * 1.1 + first_start[r] + second_start[r]);
    // Only the second's start (its copy: work of the caller's, slow under sanitizers) ran beside
    // the first's link time: hidden behind it, and nothing more.
    CHECK(t.seconds - t.exposed_seconds < second_start[r] + 0.05 * link);
  }
}

TEST_CASE("emulated: a world of one rank counts no traffic; a link set in code wins over a bad environment") {
  run_ranks(1, [](Communicator& comm) {
    comm.all_reduce(ones({4}));
    comm.barrier();
    comm.all_gather_async(ones({4})).wait();
    CHECK(comm.traffic().collectives == 0);
    CHECK(comm.traffic().seconds == 0);
  });
  // A bad RUDA_EMULATE_LINK failed the options' construction, even where the code then set the
  // link itself (ruda-train's --emulate-link); now it is read only where none is set.
  ::setenv("RUDA_EMULATE_LINK", "bogus", 1);
  EmulatedOptions options;
  options.link = LinkModel{};
  bool ran = false;
  run_ranks(
      1, [&](Communicator&) { ran = true; }, options);
  CHECK(ran);
  expect_throw<ArgumentError>([] { run_ranks(1, [](Communicator&) {}); }, {"RUDA_EMULATE_LINK", "bogus"},
                              "the environment's link, where the options set none");
  ::unsetenv("RUDA_EMULATE_LINK");
}

TEST_CASE("emulated: an enum value that is none of its enumerators fails on every rank, naming it, never a hang") {
  for (int world : {1, 3}) {
    CAPTURE(world);
    std::vector<std::string> messages(static_cast<std::size_t>(world));
    run_ranks(world, [&](Communicator& comm) {
      const Tensor x = ones({4});
      const CollectiveOptions bad{.tag = "x", .accumulate = static_cast<Accumulate>(9)};
      auto expect = [&](const std::function<void()>& call, const std::string& fragment) {
        try {
          call();
          FAIL_CHECK("no exception thrown");
        } catch (const ArgumentError& e) {
          const std::string message = e.what();
          CHECK_MESSAGE(message.find(fragment) != std::string::npos, message);
          CHECK_MESSAGE(message.find("rank " + std::to_string(comm.rank())) != std::string::npos, message);
          messages[static_cast<std::size_t>(comm.rank())] = message;
        }
      };
      expect([&] { comm.all_reduce(x, static_cast<Reduction>(4)); }, "all_reduce: rank");
      expect([&] { comm.all_reduce(x, Reduction::sum, bad); }, "not a valid Accumulate: 9");
      expect([&] { comm.all_gather(x, bad); }, "all_gather");
      expect([&] { comm.reduce_scatter(ones({4 * comm.world_size()}), bad); }, "reduce_scatter");
      expect([&] { comm.reduce_scatter_async(ones({4 * comm.world_size()}), bad).wait(); }, "reduce_scatter");
      // The communicator is still in step: a good collective after the refused ones.
      CHECK(comm.all_reduce(x).to_vector<float>()[0] == static_cast<float>(comm.world_size()));
    });
    for (const auto& m : messages) CHECK_FALSE(m.empty());
  }
}
