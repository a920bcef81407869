// The collective suite, written once and run against every Communicator: local, emulated ranks
// and MPI. Each check builds every rank's input from a formula, so each rank computes the
// single-process reference for the whole world itself and compares its result exactly.
//
// An implementation's test file defines a runner, `void run(void (*check)(Communicator&))`, that
// calls `check` on every rank of every world it tests, and instantiates the cases with
// RUDA_COLLECTIVE_SUITE(name, run). Checks run on rank threads (emulated ranks): they use CHECK
// and FAIL_CHECK (doctest takes asserts from several threads) and name rank and world in messages.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <ruda/collectives.h>
#include <ruda/ruda.h>

namespace ruda::test::collectives {

inline const std::vector<DType>& dtypes() {
  static const std::vector<DType> all = {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i64};
  return all;
}

/// Element i of rank r's input in case `salt`. Floats are multiples of 1/2 in [-3.5, 3.5]: sums
/// over at most 8 ranks are exact in every dtype and in any order, so references are exact even
/// for MPI, whose sums do not run in rank order. i64 values need more than 32 bits.
inline double element(int rank, std::int64_t i, DType dtype, int salt) {
  const std::int64_t k = (rank * 7 + (i % 15) * 3 + salt * 5) % 15 - 7;
  if (dtype == DType::i64) return static_cast<double>(k) * 1e12 + rank;
  return 0.5 * static_cast<double>(k);
}

/// Element i of a contiguous buffer of `dtype`, as double.
inline double read(const void* data, DType dtype, std::int64_t i) {
  switch (dtype) {
    case DType::f32:
      return static_cast<const float*>(data)[i];
    case DType::f64:
      return static_cast<const double*>(data)[i];
    case DType::bf16:
      return to_float(static_cast<const bfloat16*>(data)[i]);
    case DType::f16:
      return to_float(static_cast<const float16*>(data)[i]);
    case DType::i64:
      return static_cast<double>(static_cast<const std::int64_t*>(data)[i]);
    case DType::boolean:
      return static_cast<const bool*>(data)[i];
  }
  return 0;
}

/// Rank r's input of case `salt`, written straight into the tensor (these run over MiB).
inline Tensor input(int rank, const Shape& shape, DType dtype, int salt) {
  Tensor t = empty(shape, Options(dtype));
  const std::int64_t n = t.numel();
  void* p = t.data_ptr();
  for (std::int64_t i = 0; i < n; ++i) {
    const double v = element(rank, i, dtype, salt);
    switch (dtype) {
      case DType::f32:
        static_cast<float*>(p)[i] = static_cast<float>(v);
        break;
      case DType::f64:
        static_cast<double*>(p)[i] = v;
        break;
      case DType::bf16:
        static_cast<bfloat16*>(p)[i] = to_bfloat16(static_cast<float>(v));
        break;
      case DType::f16:
        static_cast<float16*>(p)[i] = to_float16(static_cast<float>(v));
        break;
      case DType::i64:
        static_cast<std::int64_t*>(p)[i] = static_cast<std::int64_t>(v);
        break;
      case DType::boolean:
        static_cast<bool*>(p)[i] = v != 0;
        break;
    }
  }
  return t;
}

/// "rank 1/3 all_gather bf16 [1001]": who and what, for failure messages.
inline std::string where(const Communicator& c, const std::string& what, DType dtype, const Shape& shape) {
  std::ostringstream out;
  out << c.kind() << " rank " << c.rank() << "/" << c.world_size() << " " << what << " " << dtype_name(dtype) << " "
      << to_string(shape);
  return out.str();
}

/// Checks dtype, shape and every element exactly (NaN matches NaN) against want(i); reports the
/// first difference.
template <class Want>
void expect_values(const Tensor& got, DType dtype, const Shape& shape, Want&& want, const std::string& what) {
  if (!got.defined()) {
    FAIL_CHECK(what << ": undefined result");
    return;
  }
  if (got.dtype() != dtype || got.shape() != shape) {
    FAIL_CHECK(what << ": result is " << dtype_name(got.dtype()) << " " << to_string(got.shape()) << ", expected "
                    << dtype_name(dtype) << " " << to_string(shape));
    return;
  }
  const void* data = got.data_ptr();
  for (std::int64_t i = 0, n = got.numel(); i < n; ++i) {
    const double v = read(data, dtype, i);
    const double w = want(i);
    if (!(v == w || (std::isnan(v) && std::isnan(w)))) {
      FAIL_CHECK(what << ": element " << i << " is " << v << ", expected " << w);
      return;
    }
  }
}

/// The ranks' inputs (count elements each, case `salt`) one after the other: what all_gather returns.
inline std::vector<double> gathered(int world, std::int64_t count, DType dtype, int salt) {
  std::vector<double> out;
  out.reserve(static_cast<std::size_t>(world * count));
  for (int k = 0; k < world; ++k) {
    for (std::int64_t i = 0; i < count; ++i) out.push_back(element(k, i, dtype, salt));
  }
  return out;
}

/// Runs f, which must throw E with every fragment in its message.
template <class E, class F>
void expect_throw(F&& f, const std::vector<std::string>& fragments, const std::string& what) {
  try {
    f();
    FAIL_CHECK(what << ": no exception");
  } catch (const E& e) {
    const std::string message = e.what();
    for (const auto& fragment : fragments) {
      if (message.find(fragment) == std::string::npos) {
        FAIL_CHECK(what << ": message '" << message << "' lacks '" << fragment << "'");
      }
    }
  }
}

/// Element counts per rank: empty, one, odd, and a few MiB in all.
inline std::vector<std::int64_t> counts(DType dtype, int world, std::int64_t total_bytes) {
  const std::int64_t big = total_bytes / static_cast<std::int64_t>(dtype_size(dtype)) / world;
  return {0, 1, 7, 1001, big | 1};
}

// --- the checks ---

inline void all_gather(Communicator& c) {
  const int n = c.world_size();
  for (DType dtype : dtypes()) {
    for (std::int64_t count : counts(dtype, n, 2 << 20)) {
      const Shape shape{count};
      const Tensor local = input(c.rank(), shape, dtype, 1);
      const Tensor got = c.all_gather(local, {"gather." + std::to_string(count)});
      const std::vector<double> want = gathered(n, count, dtype, 1);
      expect_values(
          got, dtype, {count * n}, [&](std::int64_t i) { return want[static_cast<std::size_t>(i)]; },
          where(c, "all_gather", dtype, shape));
      CHECK(&got.backend() == &local.backend());
    }
    // Two axes: rows concatenate; a 0-d tensor gathers as one row per rank.
    const Tensor matrix = input(c.rank(), {3, 5}, dtype, 2);
    expect_values(
        c.all_gather(matrix), dtype, {3 * n, 5}, [&](std::int64_t i) { return element(int(i / 15), i % 15, dtype, 2); },
        where(c, "all_gather", dtype, {3, 5}));
    const Tensor scalar_value = input(c.rank(), {}, dtype, 3);
    expect_values(
        c.all_gather(scalar_value), dtype, {n}, [&](std::int64_t i) { return element(int(i), 0, dtype, 3); },
        where(c, "all_gather", dtype, {}));
  }
}

inline void reduce_scatter(Communicator& c) {
  const int n = c.world_size();
  for (DType dtype : dtypes()) {
    for (std::int64_t rows : counts(dtype, n, 2 << 20)) {
      const Shape shape{rows * n};
      const Tensor full = input(c.rank(), shape, dtype, 4);
      const std::int64_t offset = c.rank() * rows;
      expect_values(
          c.reduce_scatter(full, {"scatter." + std::to_string(rows)}), dtype, {rows},
          [&](std::int64_t i) {
            double s = 0;
            for (int k = 0; k < n; ++k) s += element(k, offset + i, dtype, 4);
            return s;
          },
          where(c, "reduce_scatter", dtype, shape));
    }
    const Tensor matrix = input(c.rank(), {2 * n, 3}, dtype, 5);
    expect_values(
        c.reduce_scatter(matrix), dtype, {2, 3},
        [&](std::int64_t i) {
          double s = 0;
          for (int k = 0; k < n; ++k) s += element(k, c.rank() * 6 + i, dtype, 5);
          return s;
        },
        where(c, "reduce_scatter", dtype, {2 * n, 3}));
  }
}

inline void all_reduce(Communicator& c) {
  const int n = c.world_size();
  for (DType dtype : dtypes()) {
    for (std::int64_t count : counts(dtype, 1, 1 << 20)) {
      const Shape shape{count};
      const Tensor x = input(c.rank(), shape, dtype, 6);
      expect_values(
          c.all_reduce(x, Reduction::sum, {"sum"}), dtype, shape,
          [&](std::int64_t i) {
            double s = 0;
            for (int k = 0; k < n; ++k) s += element(k, i, dtype, 6);
            return s;
          },
          where(c, "all_reduce sum", dtype, shape));
      expect_values(
          c.all_reduce(x, Reduction::max, {"max"}), dtype, shape,
          [&](std::int64_t i) {
            double m = -std::numeric_limits<double>::infinity();
            for (int k = 0; k < n; ++k) m = std::max(m, element(k, i, dtype, 6));
            return m;
          },
          where(c, "all_reduce max", dtype, shape));
    }
    const Tensor scalar_value = input(c.rank(), {}, dtype, 7);
    expect_values(
        c.all_reduce(scalar_value), dtype, {},
        [&](std::int64_t) {
          double s = 0;
          for (int k = 0; k < n; ++k) s += element(k, 0, dtype, 7);
          return s;
        },
        where(c, "all_reduce sum", dtype, {}));
    if (is_floating(dtype)) {
      // max propagates NaN from any rank, at any position of the reduction.
      std::vector<double> v = {1.0, -2.0, 3.0};
      if (c.rank() == n - 1) v[0] = std::nan("");
      if (c.rank() == 0) v[2] = std::nan("");
      expect_values(
          c.all_reduce(from_values(v, {3}, Options(dtype)), Reduction::max), dtype, {3},
          [&](std::int64_t i) { return i == 1 ? -2.0 : std::nan(""); }, where(c, "all_reduce max NaN", dtype, {3}));
    }
  }
  // i64 sums wrap around like unsigned arithmetic instead of overflowing.
  const std::int64_t big = std::numeric_limits<std::int64_t>::max();
  const Tensor wrap = from_vector<std::int64_t>({big, std::int64_t(c.rank())}, {2});
  const std::vector<std::int64_t> got = c.all_reduce(wrap).to_vector<std::int64_t>();
  std::uint64_t expected = 0;
  for (int k = 0; k < n; ++k) expected += static_cast<std::uint64_t>(big);
  CHECK(got[0] == static_cast<std::int64_t>(expected));
  CHECK(got[1] == std::int64_t(n) * (n - 1) / 2);
}

inline void broadcast_and_barrier(Communicator& c) {
  const int n = c.world_size();
  for (DType dtype : dtypes()) {
    for (int root : {0, n - 1}) {
      for (std::int64_t count : {std::int64_t(0), std::int64_t(1), std::int64_t(1001), std::int64_t(100001)}) {
        const Shape shape{count};
        const Tensor x = input(c.rank(), shape, dtype, 8 + root);
        const Tensor got = c.broadcast(x, root, {"bcast"});
        expect_values(
            got, dtype, shape, [&](std::int64_t i) { return element(root, i, dtype, 8 + root); },
            where(c, "broadcast from " + std::to_string(root), dtype, shape));
      }
    }
  }
  for (int i = 0; i < 3; ++i) c.barrier({"barrier." + std::to_string(i)});
}

inline void async_forms(Communicator& c) {
  const int n = c.world_size();
  const Tensor a = input(c.rank(), {1001}, DType::f32, 11);
  const Tensor b = input(c.rank(), {37 * n}, DType::bf16, 12);
  const Tensor d = input(c.rank(), {(1 << 16) + 1}, DType::f32, 13);
  auto expect_gather = [&](const Tensor& got, const Tensor& local, int salt, const std::string& what) {
    const std::int64_t count = local.numel();
    expect_values(
        got, local.dtype(), {count * n},
        [&](std::int64_t i) { return element(int(i / count), i % count, local.dtype(), salt); },
        where(c, what, local.dtype(), local.shape()));
  };
  auto expect_scatter = [&](const Tensor& got, const Tensor& full, int salt, const std::string& what) {
    const std::int64_t rows = full.numel() / n;
    expect_values(
        got, full.dtype(), {rows},
        [&](std::int64_t i) {
          double s = 0;
          for (int k = 0; k < n; ++k) s += element(k, c.rank() * rows + i, full.dtype(), salt);
          return s;
        },
        where(c, what, full.dtype(), full.shape()));
  };

  // Several in flight, waited for in another order than started.
  Work w1 = c.all_gather_async(a, {"a"});
  Work w2 = c.reduce_scatter_async(b, {"b"});
  Work w3 = c.all_gather_async(d, {"d"});
  CHECK(w1.valid());
  expect_gather(w3.wait(), d, 13, "all_gather_async (third)");
  expect_gather(w1.wait(), a, 11, "all_gather_async (first)");
  expect_scatter(w2.wait(), b, 12, "reduce_scatter_async");
  CHECK_FALSE(w1.valid());
  CHECK_FALSE(w1.ready());
  CHECK_THROWS_AS(w1.wait(), ArgumentError);

  // A blocking collective while one is in flight runs after it.
  Work w4 = c.reduce_scatter_async(b, {"b again"});
  const Tensor total = c.all_reduce(scalar(1.0), Reduction::sum, {"count"});
  CHECK(total.item() == n);
  expect_scatter(w4.wait(), b, 12, "reduce_scatter_async before a blocking all_reduce");

  // A dropped Work still completes; the next collectives are unaffected.
  { Work dropped = c.all_gather_async(d, {"dropped"}); }
  expect_gather(c.all_gather(a, {"after drop"}), a, 11, "all_gather after a dropped Work");

  // all_reduce_async: sum and max, in flight beside an all_gather, waited for in reverse.
  const Tensor e = input(c.rank(), {(1 << 15) + 3}, DType::f64, 14);
  Work sum = c.all_reduce_async(e, Reduction::sum, {"e sum"});
  Work gather = c.all_gather_async(a, {"a beside"});
  Work max = c.all_reduce_async(b, Reduction::max, {"b max"});
  expect_values(
      max.wait(), DType::bf16, b.shape(),
      [&](std::int64_t i) {
        double m = -std::numeric_limits<double>::infinity();
        for (int k = 0; k < n; ++k) m = std::max(m, element(k, i, DType::bf16, 12));
        return m;
      },
      where(c, "all_reduce_async max", DType::bf16, b.shape()));
  expect_gather(gather.wait(), a, 11, "all_gather_async beside all_reduce_async");
  expect_values(
      sum.wait(), DType::f64, e.shape(),
      [&](std::int64_t i) {
        double s = 0;
        for (int k = 0; k < n; ++k) s += element(k, i, DType::f64, 14);
        return s;
      },
      where(c, "all_reduce_async sum", DType::f64, e.shape()));
  expect_throw<ShapeError>(
      [&] {
        (void)c.all_reduce_async(e.slice(0, 0, 32).reshape({4, 8}).transpose(0, 1));
      },
      {"all_reduce_async", "rank " + std::to_string(c.rank()), "non-contiguous"},
      where(c, "all_reduce_async of a view", DType::f64, e.shape()));
}

/// split and split_by_node: sub-communicators run collectives among their own ranks, in the order
/// the keys give; ShardMesh lays the world out as nodes x replicas, or refuses, on every rank alike.
inline void splits(Communicator& c) {
  const int n = c.world_size(), r = c.rank();
  // Odd and even ranks, each group in reverse order of rank.
  const std::unique_ptr<Communicator> half = c.split(r % 2, -r);
  std::vector<int> members;  // world ranks of this rank's group, in its order
  for (int k = n - 1; k >= 0; --k) {
    if (k % 2 == r % 2) members.push_back(k);
  }
  REQUIRE(half->world_size() == static_cast<int>(members.size()));
  CHECK(members[static_cast<std::size_t>(half->rank())] == r);
  CHECK(half->kind() == c.kind());
  const Tensor x = input(r, {257}, DType::f32, 15);
  expect_values(
      half->all_reduce(x), DType::f32, {257},
      [&](std::int64_t i) {
        double s = 0;
        for (const int k : members) s += element(k, i, DType::f32, 15);
        return s;
      },
      where(*half, "all_reduce on split", DType::f32, {257}));
  expect_values(
      half->all_gather(x), DType::f32, {257 * static_cast<std::int64_t>(members.size())},
      [&](std::int64_t i) { return element(members[static_cast<std::size_t>(i / 257)], i % 257, DType::f32, 15); },
      where(*half, "all_gather on split", DType::f32, {257}));
  // Collectives on the parent and the split interleave freely.
  CHECK(c.all_reduce(scalar(1.0)).item() == n);
  CHECK(half->all_reduce(scalar(1.0)).item() == static_cast<double>(members.size()));
  expect_throw<ArgumentError>([&] { (void)c.split(-1, 0); }, {"split", "color"}, where(c, "split(-1)", DType::f32, {}));

  // A node: whole nodes of equal size, consecutive ranks here (emulated ranks, one machine under MPI).
  const std::unique_ptr<Communicator> node = c.split_by_node();
  REQUIRE(n % node->world_size() == 0);
  const std::vector<std::int64_t> node_ranks =
      node->all_gather(from_vector(std::vector<std::int64_t>{r}, {1})).to_vector<std::int64_t>();
  for (std::size_t i = 0; i < node_ranks.size(); ++i) {
    CHECK(node_ranks[i] == node_ranks.front() + static_cast<std::int64_t>(i));
  }

  // Meshes: every ranks-per-node that divides the world tiles it; the others are refused alike.
  for (int per_node = 1; per_node <= n + 1; ++per_node) {
    CAPTURE(per_node);
    if (n % per_node != 0) {
      expect_throw<TopologyError>([&] { (void)ShardMesh::by_node(c, per_node); },
                                  {"ShardMesh::by_node", std::to_string(per_node) + " ranks per node", "do not divide"},
                                  where(c, "ShardMesh::by_node", DType::f32, {}));
      continue;
    }
    const ShardMesh mesh = ShardMesh::by_node(c, per_node);
    CHECK(mesh.ranks_per_node() == per_node);
    CHECK(mesh.nodes() == n / per_node);
    CHECK(mesh.node() == r / per_node);
    CHECK(mesh.shard().rank() == r % per_node);
    CHECK(&mesh.world() == &c);
    // The shard sum over a node then the replicate sum is the world's sum.
    const Tensor two_level = mesh.replicate().all_reduce(mesh.shard().all_reduce(x));
    expect_values(
        two_level, DType::f32, {257},
        [&](std::int64_t i) {
          double s = 0;
          for (int k = 0; k < n; ++k) s += element(k, i, DType::f32, 15);
          return s;
        },
        where(c, "all_reduce over shard then replicate", DType::f32, {257}));
  }
  const ShardMesh own = ShardMesh::by_node(c);  // the communicator's own nodes
  CHECK(own.ranks_per_node() == node->world_size());
  if (n > 1) {
    // Two communicators that group the ranks alike do not tile the world.
    expect_throw<TopologyError>([&] { (void)ShardMesh(c, c.split(0, r), c.split(0, r)); },
                                {"ShardMesh", "do not tile the world of " + std::to_string(n)},
                                where(c, "ShardMesh of two world-sized communicators", DType::f32, {}));
  }
}

inline void into_forms(Communicator& c) {
  const int n = c.world_size();
  for (DType dtype : {DType::f32, DType::bf16, DType::i64}) {
    const Tensor local = input(c.rank(), {513}, dtype, 14);
    const Tensor out = zeros({513 * n}, Options(dtype));
    for (int repeat = 0; repeat < 2; ++repeat) {  // the same buffer, reused
      c.all_gather_into(out, local, {"into"});
      expect_values(
          out, dtype, {513 * n}, [&](std::int64_t i) { return element(int(i / 513), i % 513, dtype, 14); },
          where(c, "all_gather_into", dtype, {513}));
    }
    // The non-blocking form hands back the caller's buffer.
    const Tensor again = zeros({513 * n}, Options(dtype));
    Work pending = c.all_gather_into_async(again, local, {"into async"});
    const Tensor returned = pending.wait();
    CHECK(returned.shares_storage(again));
    expect_values(
        again, dtype, {513 * n}, [&](std::int64_t i) { return element(int(i / 513), i % 513, dtype, 14); },
        where(c, "all_gather_into_async", dtype, {513}));
    const Tensor full = input(c.rank(), {5 * n, 2}, dtype, 15);
    const Tensor piece = zeros({5, 2}, Options(dtype));
    const Tensor piece_async = zeros({5, 2}, Options(dtype));
    Work scattering = c.reduce_scatter_into_async(piece_async, full, {"into async"});
    c.reduce_scatter_into(piece, full, {"into"});
    CHECK(scattering.wait().shares_storage(piece_async));
    expect_values(
        piece_async, dtype, {5, 2},
        [&](std::int64_t i) {
          double s = 0;
          for (int k = 0; k < n; ++k) s += element(k, c.rank() * 10 + i, dtype, 15);
          return s;
        },
        where(c, "reduce_scatter_into_async", dtype, {5 * n, 2}));
    expect_values(
        piece, dtype, {5, 2},
        [&](std::int64_t i) {
          double s = 0;
          for (int k = 0; k < n; ++k) s += element(k, c.rank() * 10 + i, dtype, 15);
          return s;
        },
        where(c, "reduce_scatter_into", dtype, {5 * n, 2}));
  }
  // Wrong outputs are refused before any communication (every rank refuses alike).
  const Tensor local = input(c.rank(), {4}, DType::f32, 16);
  expect_throw<ShapeError>([&] { c.all_gather_into(zeros({4 * n + 1}), local); }, {"all_gather_into", "rank"},
                           "all_gather_into with a wrong shape");
  expect_throw<DTypeError>([&] { c.all_gather_into(zeros({4 * n}, Options(DType::f64)), local); },
                           {"all_gather_into", "f64"}, "all_gather_into with a wrong dtype");
  const Tensor whole = zeros({4 * n});
  expect_throw<ArgumentError>([&] { c.reduce_scatter_into(whole.slice(0, 0, 4), whole); }, {"shares"},
                              "reduce_scatter_into into its own input");
  expect_throw<ShapeError>([&] { (void)c.reduce_scatter_into_async(zeros({5}), whole); },
                           {"reduce_scatter_into_async", "[5]"}, "reduce_scatter_into_async with a wrong shape");
}

/// Sums of 16-bit floats: in f32 rounded once (default) or rounded at every step (native). Every
/// rank contributes the same value, so the reference holds in any summation order. Such sums
/// can only tell the modes apart from 6 ranks on (with fewer, every intermediate rounding cancels
/// out); the value is chosen so that they do. (test_emulated.cpp checks both modes against a
/// rank-order reference with random values at 5 ranks.)
inline void accumulation(Communicator& c) {
  const int n = c.world_size();
  for (DType dtype : {DType::bf16, DType::f16}) {
    auto round16 = [&](double v) { return cast(scalar(v, Options(DType::f32)), dtype).item(); };
    auto native_sum = [&](double v) {
      double s = v;
      for (int k = 1; k < n; ++k) s = round16(s + v);
      return s;
    };
    auto f32_sum = [&](double v) { return round16(v * n); };
    double v = 1.0;
    for (int step = 1; step < 1024; ++step) {  // the first value in [1, 2) that tells the modes apart
      const double candidate = round16(1.0 + step / 1024.0);
      if (native_sum(candidate) != f32_sum(candidate)) {
        v = candidate;
        break;
      }
    }
    if (n >= 6) CHECK_MESSAGE(native_sum(v) != f32_sum(v), "no value tells the modes apart for " << dtype_name(dtype));
    const double want_f32 = f32_sum(v), want_native = native_sum(v);
    const Tensor same = full({3 * n}, v, Options(dtype));
    CollectiveOptions native;
    native.accumulate = Accumulate::native;
    expect_values(
        c.reduce_scatter(same), dtype, {3}, [&](std::int64_t) { return want_f32; },
        where(c, "reduce_scatter f32-accumulated", dtype, {3 * n}));
    expect_values(
        c.reduce_scatter(same, native), dtype, {3}, [&](std::int64_t) { return want_native; },
        where(c, "reduce_scatter native", dtype, {3 * n}));
    expect_values(
        c.all_reduce(same), dtype, {3 * n}, [&](std::int64_t) { return want_f32; },
        where(c, "all_reduce f32-accumulated", dtype, {3 * n}));
    expect_values(
        c.all_reduce(same, Reduction::sum, native), dtype, {3 * n}, [&](std::int64_t) { return want_native; },
        where(c, "all_reduce native", dtype, {3 * n}));
    // Large enough for MPI's ring (the small ones above take another path there).
    const Tensor large = full({(1 << 17) * n}, v, Options(dtype));
    expect_values(
        c.reduce_scatter(large), dtype, {1 << 17}, [&](std::int64_t) { return want_f32; },
        where(c, "reduce_scatter f32-accumulated", dtype, large.shape()));
    expect_values(
        c.reduce_scatter(large, native), dtype, {1 << 17}, [&](std::int64_t) { return want_native; },
        where(c, "reduce_scatter native", dtype, large.shape()));
  }
}

inline void validation(Communicator& c) {
  const int n = c.world_size();
  const Tensor flags = zeros({4}, Options(DType::boolean));
  expect_throw<DTypeError>([&] { c.all_gather(flags); }, {"all_gather", "bool", "rank " + std::to_string(c.rank())},
                           "all_gather of bool");
  expect_throw<DTypeError>([&] { c.all_reduce(flags); }, {"all_reduce", "bool"}, "all_reduce of bool");
  expect_throw<DTypeError>([&] { (void)c.reduce_scatter_async(zeros({2 * n}, Options(DType::boolean))); },
                           {"reduce_scatter", "bool"}, "reduce_scatter_async of bool");
  expect_throw<ArgumentError>([&] { c.broadcast(zeros({2}), n); }, {"broadcast", "root"}, "broadcast from no rank");
  expect_throw<ShapeError>([&] { c.reduce_scatter(scalar(1.0)); }, {"reduce_scatter", "0-d"}, "reduce_scatter of 0-d");
  if (n > 1) {
    expect_throw<ShapeError>(
        [&] {
          c.reduce_scatter(zeros({n + 1, 2}));
        },
        {"reduce_scatter", std::string("[") + std::to_string(n + 1) + ", 2]", "f32", "equal pieces"},
        "reduce_scatter of indivisible rows");
  }
  if (n > 1) {
    // Rows times the world overflow an int64 (an empty tensor, so nothing is allocated): refused
    // with the op's name, into a caller's buffer too.
    const std::int64_t huge = std::numeric_limits<std::int64_t>::max() / 2 + 1;
    const Tensor empty_rows = zeros({huge, 0});
    expect_throw<ShapeError>([&] { c.all_gather(empty_rows); },
                             {"all_gather", "rank " + std::to_string(c.rank()), "f32", "int64"},
                             "all_gather past int64 rows");
    expect_throw<ShapeError>(
        [&] {
          c.all_gather_into(zeros({2, 0}), empty_rows);
        },
        {"all_gather"}, "all_gather_into past int64 rows");
  }
  // Refused calls are not collectives: the next one still matches on every rank.
  expect_values(
      c.all_reduce(scalar(2.0)), DType::f32, {}, [&](std::int64_t) { return 2.0 * n; },
      where(c, "all_reduce after refused calls", DType::f32, {}));
  // The history records the calls that ran, numbered, newest last.
  const std::vector<std::string> history = c.history();
  REQUIRE_FALSE(history.empty());
  CHECK(history.back().find("all_reduce(f32, 1, sum)") != std::string::npos);
  CHECK(history.size() <= 32);
}

/// The order check: ranks calling different collectives, or the same with different counts or
/// tags, all raise the two-sided message. Needs at least two ranks; rank 1 is the odd one out.
inline void order_check(Communicator& c) {
  REQUIRE(c.world_size() >= 2);
  const bool was = c.order_check();
  c.set_order_check(true);
  const bool odd = c.rank() == 1;
  const Tensor w8 = zeros({8});
  auto expect_mismatch = [&](const std::function<void()>& call, const std::string& expected, const std::string& what) {
    expect_throw<CollectiveMismatchError>(call, {"rank " + std::to_string(c.rank()) + ": ", expected, "last "},
                                          where(c, what, DType::f32, {8}));
  };
  // Different collectives: the whole two-sided message, the same on every rank.
  const int n = c.world_size();
  const std::uint64_t before = c.history().empty() ? 0 : std::stoull(c.history().back().substr(1));
  std::string others = n == 2 ? "rank 0" : "ranks 0";
  for (int r = 2; r < n; ++r) others += ", " + std::to_string(r);
  expect_mismatch(
      [&] {
        if (odd) {
          c.reduce_scatter(zeros({4 * n}, Options(DType::bf16)), {"layers.2.weight"});
        } else {
          c.all_gather(w8, {"layers.3.weight"});
        }
      },
      "collective #" + std::to_string(before + 1) + " differs: " + others +
          " all_gather(f32, 8, \"layers.3.weight\"), rank 1 reduce_scatter(bf16, " + std::to_string(4 * n) +
          ", \"layers.2.weight\")",
      "different collectives");
  // Same collective, different counts.
  expect_mismatch([&] { c.all_gather(odd ? zeros({9}) : w8, {"w"}); },
                  "collective #" + std::to_string(before + 2) + " differs: " + others +
                      " all_gather(f32, 8, \"w\"), rank 1 all_gather(f32, 9, \"w\")",
                  "different counts");
  // Same collective and count, different tags.
  expect_mismatch([&] { c.all_gather(w8, {odd ? "layers.2.weight" : "layers.3.weight"}); },
                  "collective #" + std::to_string(before + 3) + " differs: " + others +
                      " all_gather(f32, 8, \"layers.3.weight\"), rank 1 all_gather(f32, 8, \"layers.2.weight\")",
                  "different tags");
  // Tags longer than a fingerprint record that differ only past the cut still differ.
  const std::string long_tag(300, 'w');
  expect_mismatch([&] { c.all_gather(w8, {long_tag + (odd ? "b" : "a")}); },
                  "collective #" + std::to_string(before + 4) + " differs: ", "long tags");
  // Same count, different shapes ([2, 4] against [4, 2]): different collectives, whose shapes the
  // message shows since nothing else tells them apart. (Under MPI the bytes would move and each
  // rank read them in its own shape.)
  expect_mismatch(
      [&] {
        c.all_reduce(zeros(odd ? Shape{4, 2} : Shape{2, 4}), Reduction::sum, {"w"});
      },
      "collective #" + std::to_string(before + 5) + " differs: " + others +
          " all_reduce(f32, 8, sum, \"w\") of [2, 4], rank 1 all_reduce(f32, 8, sum, \"w\") of [4, 2]",
      "different shapes");
  // A tag holding the fingerprint's own separator byte still shows the shapes whole.
  const std::string odd_tag = std::string("a") + '\x1f' + "b";
  expect_mismatch(
      [&] {
        c.all_gather(zeros(odd ? Shape{3, 2} : Shape{2, 3}), {odd_tag});
      },
      "collective #" + std::to_string(before + 6) + " differs: " + others + " all_gather(f32, 6, \"" + odd_tag +
          "\") of [2, 3], rank 1 all_gather(f32, 6, \"" + odd_tag + "\") of [3, 2]",
      "a tag with the separator");
  // After mismatches the ranks are still in step.
  expect_values(
      c.all_reduce(scalar(1.0), Reduction::sum, {"after"}), DType::f32, {}, [&](std::int64_t) { return double(n); },
      where(c, "all_reduce after mismatches", DType::f32, {}));
  c.set_order_check(was);
}

/// all_gather_text, agree_on_failure and run_agreed: texts of different lengths (empty, long, with zero
/// bytes) arrive whole and in rank order; failures name their ranks, and equal messages merge.
inline void text_agreement(Communicator& c) {
  const int n = c.world_size(), r = c.rank();
  auto text_of = [](int rank) {
    std::string t(static_cast<std::size_t>(rank * 37 % 11), static_cast<char>('a' + rank));
    if (rank % 3 == 1) t += std::string(1, '\0') + "after a zero byte";
    return t;
  };
  const auto texts = all_gather_text(c, text_of(r), "texts");
  REQUIRE(texts.size() == static_cast<std::size_t>(n));
  for (int k = 0; k < n; ++k)
    CHECK_MESSAGE(texts[static_cast<std::size_t>(k)] == text_of(k),
                  "rank " << r << " of " << n << " text of rank " << k);
  CHECK(all_gather_text(c, "", "empty") == std::vector<std::string>(static_cast<std::size_t>(n)));
  CHECK(agree_on_failure(c, "", "all well").empty());
  // Every odd rank fails with the same message, the last rank with its own.
  std::string error = r % 2 == 1 ? "disk full" : "";
  if (r == n - 1 && n > 1) error = "cannot open /data/rank-" + std::to_string(r);
  const auto failures = agree_on_failure(c, error, "some failed");
  std::string expected;
  std::vector<int> odd;
  for (int k = 1; k < n - 1; k += 2) odd.push_back(k);
  if (!odd.empty()) {
    expected = odd.size() == 1 ? "rank " : "ranks ";
    for (std::size_t i = 0; i < odd.size(); ++i) expected += (i ? ", " : "") + std::to_string(odd[i]);
    expected += ": disk full";
  }
  if (n > 1)
    expected += (expected.empty() ? "" : "; ") + std::string("rank ") + std::to_string(n - 1) +
                ": cannot open /data/rank-" + std::to_string(n - 1);
  CHECK_MESSAGE(describe(failures) == expected, "rank " << r << " of " << n << ": " << describe(failures));
  CHECK(failures.size() == odd.size() + (n > 1 ? 1 : 0));

  // run_agreed: a phase that throws on the last rank only (a typed error, and one without a
  // message) is a failure every rank sees, with that rank's message; a phase that succeeds is none.
  int ran = 0;
  CHECK(run_agreed(c, "setup ok", [&] { ++ran; }).empty());
  CHECK(ran == 1);
  const auto setup = run_agreed(c, "setup", [&] {
    if (r == n - 1) throw ArgumentError("--batch 7 does not divide over " + std::to_string(n) + " ranks");
  });
  REQUIRE(setup.size() == 1);
  CHECK(setup[0].rank == n - 1);
  CHECK(setup[0].message == "--batch 7 does not divide over " + std::to_string(n) + " ranks");
  struct Silent : std::exception {
    const char* what() const noexcept override { return ""; }
  };
  const auto silent = run_agreed(c, "silent", [&] {
    if (r == 0) throw Silent();
  });
  REQUIRE(silent.size() == 1);
  CHECK(silent[0].rank == 0);
  CHECK_FALSE(silent[0].message.empty());
}

}  // namespace ruda::test::collectives

/// Instantiates the suite for one implementation: RUN(check) runs check on every rank of every
/// world the implementation tests.
#define RUDA_COLLECTIVE_SUITE(NAME, RUN)                                                              \
  TEST_CASE(NAME ": all_gather") { RUN(&ruda::test::collectives::all_gather); }                       \
  TEST_CASE(NAME ": reduce_scatter") { RUN(&ruda::test::collectives::reduce_scatter); }               \
  TEST_CASE(NAME ": all_reduce") { RUN(&ruda::test::collectives::all_reduce); }                       \
  TEST_CASE(NAME ": broadcast and barrier") { RUN(&ruda::test::collectives::broadcast_and_barrier); } \
  TEST_CASE(NAME ": non-blocking forms") { RUN(&ruda::test::collectives::async_forms); }              \
  TEST_CASE(NAME ": split, nodes and meshes") { RUN(&ruda::test::collectives::splits); }              \
  TEST_CASE(NAME ": into a caller's buffer") { RUN(&ruda::test::collectives::into_forms); }           \
  TEST_CASE(NAME ": 16-bit accumulation") { RUN(&ruda::test::collectives::accumulation); }            \
  TEST_CASE(NAME ": validation") { RUN(&ruda::test::collectives::validation); }                       \
  TEST_CASE(NAME ": text and agreement on failure") { RUN(&ruda::test::collectives::text_agreement); }
