// Memory accounting: live and peak bytes, per process and per thread scope.
#include <limits>
#include <memory>
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

// --- the per-rank memory limit ---

namespace {
// Restores the process's limit when a test ends, whatever it set.
struct LimitGuard {
  std::int64_t saved = memory::limit();
  ~LimitGuard() { memory::set_limit(saved); }
};
}  // namespace

TEST_CASE("the block cache, full of sizes no longer used, makes room for the sizes in use") {
  // Filled once by other sizes (a large first model, an evaluation), it kept them for good and
  // every block of the sizes in use afterwards was allocated and page-faulted afresh each step.
  memory::release_cached();
  const bool caching = [] {
    { (void)empty({std::int64_t{1} << 16}); }
    return memory::cached_bytes() > 0;
  }();
  memory::release_cached();
  if (!caching) {  // sanitizer builds and RUDA_CACHE_BYTES=0 keep nothing
    CHECK(memory::cached_bytes() == 0);
    return;
  }
  {
    // ~1 GiB of one size, freed: the cache is full of it (never touched, so never paged in).
    std::vector<Tensor> stale;
    for (int i = 0; i < 16; ++i) stale.push_back(empty({std::int64_t{16} << 20}, DType::f32));
  }
  const std::int64_t full = memory::cached_bytes();
  CHECK(full >= (std::int64_t{15} << 26));
  const std::int64_t in_use_bytes = std::int64_t{3} << 20;  // another size class (12 MiB)
  { (void)empty({in_use_bytes}, DType::f32); }
  const std::int64_t with_new = memory::cached_bytes();
  {
    const Tensor again = empty({in_use_bytes}, DType::f32);
    CHECK(memory::cached_bytes() == with_new - 4 * in_use_bytes);
  }
  CHECK(with_new <= full);  // a stale block made room, within the limit
  memory::release_cached();
}

TEST_CASE("sizes parse in decimal and binary units") {
  CHECK(memory::parse_size("1048576") == 1048576);
  CHECK(memory::parse_size("512MB") == 512'000'000);
  CHECK(memory::parse_size("512mb") == 512'000'000);
  CHECK(memory::parse_size("2GiB") == 2LL << 30);
  CHECK(memory::parse_size("1.5GB") == 1'500'000'000);
  CHECK(memory::parse_size("64k") == 64'000);
  CHECK(memory::parse_size("256 MiB") == 256LL << 20);
  CHECK(memory::parse_size("9223372036854775807") == std::numeric_limits<std::int64_t>::max());  // exactly
  // A byte count with a fraction, or a size below one byte: "0.4" read as 0, which is no limit.
  for (const char* fraction : {"0.4", "1.5", "1.5B", "2.0 b"}) {
    CAPTURE(fraction);
    test::check_throws<ArgumentError>([&] { memory::parse_size(fraction); }, {fraction, "not a whole number of bytes"});
  }
  test::check_throws<ArgumentError>([&] { memory::parse_size("0.0001KB"); }, {"0.0001KB", "less than one byte"});
  CHECK(memory::parse_size("0") == 0);
  CHECK(memory::parse_size("0.5KB") == 500);
  CHECK(memory::parse_size("1.3GiB") == 1395864371);  // rounded to a whole byte
  // Three significant digits, rounded before the unit is chosen (999999 B printed "1000 KB").
  CHECK(memory::format_bytes(999) == "999 B");
  CHECK(memory::format_bytes(999999) == "1.00 MB");
  CHECK(memory::format_bytes(99950) == "100 KB");
  CHECK(memory::format_bytes(9996) == "10.0 KB");
  CHECK(memory::format_bytes(1234567) == "1.23 MB");
  CHECK(memory::format_bytes(-999999) == "-1.00 MB");
  CHECK(memory::format_bytes(std::numeric_limits<std::int64_t>::max()) == "9223 PB");
  for (const char* huge : {"9223372036854775808", "99999999999999999999", "10000000TB"}) {
    CAPTURE(huge);
    test::check_throws<ArgumentError>([&] { memory::parse_size(huge); }, {"more bytes than an int64 holds"});
  }
  // Not strtod's grammar: hexadecimal and exponents are refused, not read as 16 and 1000.
  for (const char* bad :
       {"", "MB", "-1MB", "12 parsecs", "1e30", "nan", "inf", " 5", "0x10", "1e3", "1.2.3MB", "5.MB."}) {
    CAPTURE(bad);
    test::check_throws<ArgumentError>([&] { memory::parse_size(bad); }, {"is not a size"});
  }
  CHECK(memory::format_bytes(512'000'000) == "512 MB");
  CHECK(memory::format_bytes(1'234'567) == "1.23 MB");
  CHECK(memory::format_bytes(17) == "17 B");
}

TEST_CASE("an allocation past the limit raises OutOfMemoryError naming op, shape, dtype and bytes") {
  LimitGuard restore;
  memory::Scope rank;
  memory::set_limit(1'000'000);
  const Tensor kept = zeros({240'000});                   // 960 KB of the 1 MB
  const Tensor a = ones({100, 10}), b = ones({10, 100});  // 8 KB more
  test::check_throws<OutOfMemoryError>(
      [&] { (void)matmul(a, b); },
      {"matmul", "out of memory", "f32 [100, 100]", "40000 bytes", "968 KB", "limit of 1.00 MB", "memory::set_limit)"});
  // The limit's source as its setter names it (a program's option), not the variable it did not read.
  memory::set_limit(1'000'000, "--memory-limit");
  test::check_throws<OutOfMemoryError>([&] { (void)matmul(a, b); }, {"limit of 1.00 MB", "--memory-limit)"});
  // Nothing was charged by the refused allocation, and smaller ones still fit.
  CHECK(rank.stats().live_bytes == 968'000);
  CHECK(zeros({1000}).numel() == 1000);
  test::check_throws<OutOfMemoryError>([] { (void)full({100, 1000}, 2.0, DType::f64); }, {"full", "f64 [100, 1000]"});
  memory::set_limit(0);
  CHECK(full({100, 1000}, 2.0, DType::f64).numel() == 100'000);
}

TEST_CASE("outside any scope the limit is the process's, and the refusal says so") {
  LimitGuard restore;
  memory::set_limit(memory::process_stats().live_bytes + 1'000'000);
  const Tensor kept = zeros({200'000});
  test::check_throws<OutOfMemoryError>(
      [] { (void)zeros({100'000}); },
      {"zeros", "live in this process (this thread is in no memory::Scope)", "over the limit of"});
}

TEST_CASE("a scope opened inside a rank's counts toward the rank: its figures and its limit") {
  // A nested scope started a fresh tracker that the limit was checked against alone: a section
  // measured in its own scope could hold a whole limit more than the rank's, and its tensors
  // were missing from the rank's figures while they lived.
  LimitGuard restore;
  memory::Scope rank;
  memory::set_limit(1'000'000);
  const Tensor kept = zeros({200'000});  // 800 KB of the rank's 1 MB
  {
    memory::Scope section;
    const Tensor small = zeros({25'000});  // 100 KB: fits the rank's budget too
    CHECK(section.stats().live_bytes == 100'000);
    CHECK(rank.stats().live_bytes == 900'000);
    test::check_throws<OutOfMemoryError>([] { (void)zeros({100'000}); }, {"zeros", "400000 bytes", "limit of 1.00 MB"});
    // The refusal charged nothing to either scope: not its bytes, and neither a peak nor an
    // allocation count (the section had counted the refused request as its peak).
    CHECK(section.stats().live_bytes == 100'000);
    CHECK(section.stats().peak_bytes == 100'000);
    CHECK(section.stats().allocations == 1);
    CHECK(rank.stats().live_bytes == 900'000);
    CHECK(rank.stats().peak_bytes == 900'000);
  }
  CHECK(rank.stats().live_bytes == 800'000);
  CHECK(rank.stats().peak_bytes == 900'000);
  // A tensor made in a section and kept after it is the rank's as long as it lives.
  Tensor outlives;
  {
    memory::Scope section;
    outlives = zeros({25'000});
  }
  CHECK(rank.stats().live_bytes == 900'000);
  outlives = Tensor();
  CHECK(rank.stats().live_bytes == 800'000);
}

TEST_CASE("a scope ended out of order or on another thread: the thread goes on in the nearest open scope") {
  // Ending restored the scope's own predecessor: the thread was left on a tracker that had ended
  // (an outer scope ended before an inner one), or on one another thread had ended, and its
  // allocations were read from, and limited by, a tracker nobody else saw (found by a probe).
  memory::Scope outer;
  const Tensor before = zeros({500});  // the outer scope's own: 2000 bytes only it counts
  auto first = std::make_unique<memory::Scope>();
  auto inner = std::make_unique<memory::Scope>();
  first.reset();  // out of order
  inner.reset();
  const Tensor t = zeros({1000});
  CHECK(outer.stats().live_bytes == 6000);
  CHECK(memory::stats().live_bytes == outer.stats().live_bytes);  // the thread's scope is outer
  auto elsewhere = std::make_unique<memory::Scope>();
  std::thread([&] { elsewhere.reset(); }).join();  // ended on another thread
  const Tensor u = zeros({1000});
  CHECK(outer.stats().live_bytes == 10000);
  CHECK(memory::stats().live_bytes == outer.stats().live_bytes);
}

TEST_CASE("a 16-bit product's f32 working copies count toward the rank and its limit, on every path that makes them") {
  // The Eigen backend (and oneDNN's on CPUs without bf16 instructions) multiplies 16-bit operands
  // as f32 copies, each twice its operand's size: uncounted scratch before, so a [4096, 4096]
  // bf16 product went 200 MB past a limit the tracker said held.
  LimitGuard restore;
  memory::Scope rank;
  const Options eigen(DType::bf16, &get_backend("eigen"));
  const Tensor a = ones({256, 256}, eigen), b = ones({256, 256}, eigen);  // 128 KB each
  const std::int64_t before = rank.stats().live_bytes;
  memory::reset_peak();
  const Tensor c = matmul(a, b);
  CHECK(c.at({0, 0}) == 256.0);
  // The 128 KB result, and the f32 copies of a, b and the result (256 KB each) while it ran.
  CHECK(rank.stats().peak_bytes - before >= 128 * 1024 + 3 * 256 * 1024);
  CHECK(rank.stats().live_bytes - before == 128 * 1024);
  memory::set_limit(rank.stats().live_bytes + 128 * 1024 + 1000);
  test::check_throws<OutOfMemoryError>([&] { (void)matmul(a, b); },
                                       {"gemm (16-bit operands widened to f32)", "f32 [65536]", "limit"});
  CHECK(rank.stats().live_bytes - before == 128 * 1024);
}

TEST_CASE("a 16-bit sum over several axes and a reduction's partial result count toward the rank and its limit") {
  // Both are working memory as large as tensors that the kernels kept in uncounted scratch: a bf16
  // [64, 1024, 256] summed over {0, 2} went 66 MB past a 40 MB limit the tracker said held.
  LimitGuard restore;
  memory::Scope rank;
  for (const std::string& name : available_backends()) {
    CAPTURE(name);
    Backend* backend = &get_backend(name);
    const Tensor x = ones({8, 64, 32}, Options(DType::bf16, backend));  // 32 KB
    std::int64_t before = rank.stats().live_bytes;
    memory::reset_peak();
    CHECK(sum(x, {0, 2}).at({0}) == 256.0);
    // x and the result as f32 copies (64 KB + 256 B) while the sum ran.
    CHECK(rank.stats().peak_bytes - before >= 64 * 1024 + 256);
    memory::set_limit(rank.stats().live_bytes + 32 * 1024);
    test::check_throws<OutOfMemoryError>([&] { (void)sum(x, {0, 2}); }, {"sum", "f32", "limit"});
    test::check_throws<OutOfMemoryError>([&] { (void)logsumexp(x, {0, 2}); }, {"logsumexp", "f32", "limit"});
    memory::set_limit(0);
    CHECK(rank.stats().live_bytes == before);
    // An f32 sum over separate axes keeps the first fold's result, here [8, 1024, 1].
    const Tensor y = ones({8, 1024, 2}, Options(DType::f32, backend));
    before = rank.stats().live_bytes;
    memory::reset_peak();
    CHECK(sum(y, {0, 2}).at({0}) == 16.0);
    CHECK(rank.stats().peak_bytes - before >= 8 * 1024 * 4 + 1024 * 4);
  }
}

TEST_CASE("the attention backward's working memory counts toward the rank") {
  // Each worker's dQ accumulator ([T, D] f32), or the split heads' partial sums, were uncounted
  // scratch: q [1, 1, 16384, 128] went 8.4 MB a thread past the tracker.
  memory::Scope rank;
  for (const std::string& name : available_backends()) {
    CAPTURE(name);
    Backend* backend = &get_backend(name);
    const std::int64_t t = 512, d = 32, head = t * d * 4;
    const Options o(DType::f32, backend);
    Tensor q = randn({1, 1, t, d}, 1, 0, o), k = randn({1, 1, t, d}, 2, 0, o), v = randn({1, 1, t, d}, 3, 0, o);
    for (Tensor* x : {&q, &k, &v}) x->set_requires_grad(true);
    const Tensor out = scaled_dot_product_attention(q, k, v, {.causal = true});
    const Tensor grad = ones_like(out);
    const std::int64_t before = rank.stats().live_bytes;
    memory::reset_peak();
    out.backward(grad);
    // dq, dk and dv, and at least one [T, D] f32 accumulator of dQ.
    CHECK(rank.stats().peak_bytes - before >= 4 * head);
    CHECK(rank.stats().live_bytes - before <= 3 * head);  // the working memory given back (and the saved lse)
  }
}

TEST_CASE("each emulated rank's scope has its own budget under the one limit") {
  LimitGuard restore;
  memory::set_limit(1'000'000);
  bool second_failed = false;
  std::thread a([&] {
    memory::Scope rank;
    const Tensor big = zeros({200'000});  // 800 KB on this rank
    std::thread b([&] {
      memory::Scope other;
      const Tensor also = zeros({200'000});  // fits: another rank's 800 KB
      try {
        (void)zeros({100'000});
      } catch (const OutOfMemoryError&) {
        second_failed = true;
      }
    });
    b.join();
  });
  a.join();
  CHECK(second_failed);
}

TEST_CASE("sizes the system cannot give become OutOfMemoryError; impossible ones ShapeError") {
  memory::Scope rank;
  const Tensor kept = zeros({1000});
  memory::reset_peak();
  const memory::Stats rank_before = rank.stats(), process_before = memory::process_stats();
  // 2^60 bytes: a valid size no machine has. The system allocator refuses it.
  test::check_throws<OutOfMemoryError>([] { (void)empty({1LL << 58}, DType::f32); },
                                       {"empty", "f32 [288230376151711744]", "the system refused"});
  // A request that was never allocated is in no figure: the peaks read 1 PB after it before, so a
  // caller who caught the error to retry smaller measured nonsense afterwards.
  CHECK(rank.stats().live_bytes == rank_before.live_bytes);
  CHECK(rank.stats().peak_bytes == rank_before.peak_bytes);
  CHECK(rank.stats().allocations == rank_before.allocations);
  CHECK(memory::process_stats().peak_bytes < process_before.peak_bytes + (1LL << 40));
  test::check_throws<ShapeError>([] { (void)empty({1LL << 61}, DType::f64); }, {"empty", "2^63 bytes"});
  test::check_throws<ShapeError>([] { (void)zeros({1LL << 62, 4}); }, {"overflows"});
}

// Run by the ctest entry test_engine_memory_bad_env, with RUDA_MEMORY_LIMIT=not-a-size in its
// environment (skipped in the plain run: the variable is read once per process).
TEST_CASE("RUDA_MEMORY_LIMIT that is no size: a typed error naming it, until set_limit replaces it" * doctest::skip()) {
  REQUIRE(std::string(std::getenv("RUDA_MEMORY_LIMIT") ? std::getenv("RUDA_MEMORY_LIMIT") : "") == "not-a-size");
  for (int attempt = 0; attempt < 2; ++attempt) {  // the same error each time, parsed once
    CHECK_THROWS_WITH_AS((void)zeros({4}), doctest::Contains("RUDA_MEMORY_LIMIT: "), ArgumentError);
    CHECK_THROWS_WITH_AS((void)memory::limit(), doctest::Contains("not-a-size"), ArgumentError);
  }
  memory::set_limit(0);  // recovers: no limit
  CHECK(zeros({4}).numel() == 4);
  memory::set_limit(1 << 20);
  CHECK(memory::limit() == 1 << 20);
  memory::set_limit(0);
}
