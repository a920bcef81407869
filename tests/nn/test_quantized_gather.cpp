// The int8 weight all-gather (GatherQuantization::int8, ZeRO++'s qwZ): block-wise quantization
// within scale / 2, exact zeros and padding, a typed error for non-finite weights on every rank,
// a quarter of the gather's bytes, and training that follows the unquantized run.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "helpers.h"
#include "sharded_fixture.h"

using namespace ruda;

namespace {

nn::FullyShardOptions int8_gather() {
  nn::FullyShardOptions options;
  options.policy.gather_quantization = nn::GatherQuantization::int8;
  return options;
}

// Largest |got - want| over each block of `want`, divided by that block's scale / 2.
double worst_error_in_half_scales(const std::vector<double>& got, const std::vector<double>& want, std::int64_t block) {
  double worst = 0;
  for (std::size_t begin = 0; begin < want.size(); begin += static_cast<std::size_t>(block)) {
    const std::size_t end = std::min(want.size(), begin + static_cast<std::size_t>(block));
    double largest = 0;
    for (std::size_t i = begin; i < end; ++i) largest = std::max(largest, std::abs(want[i]));
    const double half_scale = largest / 127.0 / 2.0;
    for (std::size_t i = begin; i < end; ++i) {
      const double e = std::abs(got[i] - want[i]);
      if (half_scale == 0) {
        if (e != 0) return 1e30;
        continue;
      }
      worst = std::max(worst, e / half_scale);
    }
  }
  return worst;
}

}  // namespace

TEST_CASE("int8 blocks: within scale / 2 of every element, zero blocks and short last blocks exact in size") {
  for (const std::int64_t n :
       {std::int64_t{1}, std::int64_t{7}, std::int64_t{2048}, std::int64_t{2049}, std::int64_t{3 * 2048 + 5}}) {
    CAPTURE(n);
    // Blocks of very different magnitudes, and one block of zeros.
    Tensor x = randn({n}, 3) * 2.0;
    if (n > 2048) x.slice(0, 2048, std::min<std::int64_t>(n, 4096)).fill_(0.0);
    if (n > 4096) x.slice(0, 4096, n).mul_(1e-5);
    const nn::Int8Blocks q = nn::quantize_int8(x);
    CHECK(q.codes.size() == static_cast<std::size_t>(n));
    CHECK(q.scales.size() == static_cast<std::size_t>((n + 2047) / 2048));
    const std::vector<double> want = x.to_vector<double>();
    const Tensor back = nn::dequantize_int8(q, DType::f32);
    CHECK(back.shape() == Shape{n});
    CHECK(worst_error_in_half_scales(back.to_vector<double>(), want, 2048) <= 1.0 + 1e-5);
    if (n > 2048) CHECK(q.scales[1] == 0.0f);
    for (const std::int8_t c : q.codes) CHECK(std::abs(static_cast<int>(c)) <= 127);
  }
  // Smaller blocks, bf16 input and output.
  const Tensor x = cast(randn({100}, 4), DType::bf16);
  const nn::Int8Blocks q = nn::quantize_int8(x, 16);
  CHECK(q.scales.size() == 7);
  const Tensor back = nn::dequantize_int8(q, DType::bf16, 16);
  CHECK(back.dtype() == DType::bf16);
  CHECK(worst_error_in_half_scales(cast(back, DType::f32).to_vector<double>(), x.to_vector<double>(), 16) <=
        1.0 + 2.0 * 127 / 256.0);  // plus bf16's own rounding of the result: half an ulp of up to 127 steps
  // A block whose largest value is subnormal below 127 times the smallest one: largest / 127
  // underflowed to a 0 scale and the block came back as zeros; now within half a (subnormal) scale.
  {
    const Tensor tiny = from_values({1e-44, 5e-45, -1e-44, 0}, {4});
    const nn::Int8Blocks tq = nn::quantize_int8(tiny);
    CHECK(tq.scales[0] > 0.0f);
    const std::vector<double> got = nn::dequantize_int8(tq, DType::f32).to_vector<double>();
    const std::vector<double> want = tiny.to_vector<double>();
    for (std::size_t i = 0; i < want.size(); ++i) CHECK(std::abs(got[i] - want[i]) <= tq.scales[0] / 2);
    CHECK(got[0] != 0.0);
  }
  // Largest values among the subnormals, from 127 to 5000 times the smallest: largest / 127
  // rounded to a coarse subnormal below it, and 190 of the smallest came back as 127 of them.
  for (const double times : {127.0, 128.0, 140.0, 190.0, 300.0, 1000.0, 5000.0, 1e5}) {
    CAPTURE(times);
    const double dm = std::numeric_limits<float>::denorm_min();
    const Tensor sub = from_values({times * dm, -times / 2 * dm, dm, 0.0}, {4});
    const nn::Int8Blocks sq = nn::quantize_int8(sub);
    const std::vector<double> got = nn::dequantize_int8(sq, DType::f32).to_vector<double>();
    const std::vector<double> want = sub.to_vector<double>();
    for (std::size_t i = 0; i < want.size(); ++i) CHECK(std::abs(got[i] - want[i]) <= sq.scales[0] / 2.0);
    CHECK(sq.scales[0] <= std::ceil(times / 127) * dm);  // no coarser than max|x| / 127 rounded up
  }
  // A non-finite value marks its block with a NaN scale; the others are untouched.
  Tensor y = ones({4096});
  y.slice(0, 3000, 3001).fill_(std::nan(""));
  const nn::Int8Blocks marked = nn::quantize_int8(y);
  CHECK(marked.scales[0] == doctest::Approx(1.0 / 127));
  CHECK(std::isnan(marked.scales[1]));
  test::check_throws<DTypeError>([] { (void)nn::quantize_int8(ones({3}, DType::i64)); }, {"quantize_int8", "i64"});
  test::check_throws<ArgumentError>([] { (void)nn::quantize_int8(ones({3}), 0); }, {"quantize_int8", "block"});
  test::check_throws<ShapeError>(
      [&] {
        (void)nn::dequantize_int8(nn::Int8Blocks{q.codes, {1.0f}}, DType::f32, 16);
      },
      {"dequantize_int8", "need 7 scales"});
  // Values that are fractions of a scale have no integer or bool form (i64 truncated, bool made 1s).
  for (const DType d : {DType::i64, DType::boolean}) {
    test::check_throws<DTypeError>([&] { (void)nn::dequantize_int8(q, d, 16); },
                                   {"dequantize_int8", "float dtype", std::string(dtype_name(d))});
  }
}

TEST_CASE("int8 gather: each gathered weight is within scale / 2 of the full-precision one, at world sizes 1-4") {
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    nn::manual_seed(7);
    test::TinyLM dense;
    const auto exact = test::snapshot(dense);
    std::vector<std::map<std::string, std::vector<double>>> gathered(static_cast<std::size_t>(world));
    run_ranks(world, [&](Communicator& comm) {
      nn::manual_seed(7);
      test::TinyLM model;
      nn::fully_shard(model, comm, int8_gather());
      gathered[static_cast<std::size_t>(comm.rank())] = test::snapshot(model);
    });
    // One bucket (every parameter is small), but blocks of each parameter's slice alone: each
    // element is within half the largest |value| of its block of its parameter's slice / 127.
    // (Blocks of the rank's whole part gave a zero-mean bias the scale of its weight.)
    for (const auto& [name, values] : exact) {
      CAPTURE(name);
      for (int r = 0; r < world; ++r) CHECK(gathered[static_cast<std::size_t>(r)].at(name) == gathered[0].at(name));
      const auto n = static_cast<std::int64_t>(values.size());
      const std::int64_t slice = (n + world - 1) / world;
      auto block_of = [&](std::int64_t i) { return std::pair{i / slice, (i % slice) / nn::kQuantizationBlock}; };
      std::map<std::pair<std::int64_t, std::int64_t>, double> block_max;
      for (std::int64_t i = 0; i < n; ++i) {
        double& m = block_max[block_of(i)];
        m = std::max(m, std::abs(values[static_cast<std::size_t>(i)]));
      }
      const std::vector<double>& got = gathered[0].at(name);
      double worst = 0;  // in units of the bound
      for (std::int64_t i = 0; i < n; ++i) {
        const double bound = block_max[block_of(i)] / 127.0 / 2.0;
        const double e = std::abs(got[static_cast<std::size_t>(i)] - values[static_cast<std::size_t>(i)]);
        worst = std::max(worst, bound > 0 ? e / bound : (e == 0 ? 0.0 : 1e30));
      }
      CHECK(worst <= 1.0 + 1e-5);
      if (name == "down.weight") CHECK(worst > 0);  // quantized: not the exact values (zero biases are exact)
    }
  }
}

TEST_CASE("int8 gather: the all-gathers move about a quarter of the f32 bytes; training follows the f32 run") {
  std::vector<test::TrainResult> exact(3), quantized(3);
  std::vector<double> gather_bytes(2);
  run_ranks(3, [&](Communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    for (const bool int8 : {false, true}) {
      comm.reset_traffic();
      (int8 ? quantized : exact)[r] = test::train_tiny_grouped(comm, 5, int8 ? int8_gather() : nn::FullyShardOptions{});
      if (r == 0) gather_bytes[int8] = static_cast<double>(comm.traffic().bytes);
    }
  });
  // Everything the tiny model moves: gathers (2 of its 3 collectives) shrink to ~1/4, the
  // reduce-scatters do not.
  CHECK(gather_bytes[1] < 0.6 * gather_bytes[0]);
  for (std::size_t s = 0; s < exact[0].losses.size(); ++s) {
    CAPTURE(s);
    CHECK(quantized[0].losses[s] == doctest::Approx(exact[0].losses[s]).epsilon(0.02));
  }
  CHECK(quantized[0].losses.back() < quantized[0].losses.front());
  for (int r = 1; r < 3; ++r) CHECK(quantized[static_cast<std::size_t>(r)].params == quantized[0].params);
}

TEST_CASE("int8 gather: trains the GPT, hybrid too, close to the unquantized losses") {
  std::vector<double> exact, quantized;
  EmulatedOptions options;
  options.ranks_per_node = 2;
  run_ranks(
      4,
      [&](Communicator& comm) {
        const ShardMesh mesh = ShardMesh::by_node(comm);
        for (const bool int8 : {false, true}) {
          nn::manual_seed(5);
          nn::GPT model(nn::GPTConfig{.vocabulary = 32, .context = 8, .d_model = 16, .layers = 2, .heads = 2});
          const nn::FullyShardOptions shard = int8 ? int8_gather() : nn::FullyShardOptions{};
          for (const auto& block : model.blocks) nn::fully_shard(*block, mesh, shard);
          nn::fully_shard(model, mesh, shard);
          nn::AdamW opt(model.parameters(), test::adam_options());
          for (int step = 0; step < 8; ++step) {
            // One batch again and again: the loss falls as the model learns it.
            const Tensor tokens = test::part(randint({8, 8}, 0, 32, 50), comm.rank(), 4);
            const Tensor targets = test::part(randint({8, 8}, 0, 32, 60), comm.rank(), 4);
            const Tensor loss =
                nn::cross_entropy(model.forward(tokens), targets, {.reduction = nn::LossReduction::sum}) / 64.0;
            const double global = comm.all_reduce(loss.detach()).item();
            if (comm.rank() == 0) (int8 ? quantized : exact).push_back(global);
            opt.zero_grad();
            loss.backward();
            opt.step();
          }
        }
      },
      options);
  REQUIRE(exact.size() == 8);
  for (std::size_t s = 0; s < exact.size(); ++s) {
    CAPTURE(s);
    CHECK(quantized[s] == doctest::Approx(exact[s]).epsilon(0.02));
  }
  CHECK(exact.back() < 0.9 * exact.front());
  CHECK(quantized.back() < 0.9 * quantized.front());
}

TEST_CASE("int8 gather: a NaN in one rank's slice is a ShardingError on every rank naming the parameter") {
  std::vector<std::string> errors(3);
  run_ranks(3, [&](Communicator& comm) {
    nn::manual_seed(7);
    test::TinyLM model;
    nn::fully_shard(*model.block, comm, int8_gather());
    nn::fully_shard(model, comm, int8_gather());
    if (comm.rank() == 2) {
      autograd::NoGradGuard guard;
      model.down->weight.data().slice(0, 0, 1).fill_(std::nan(""));
    }
    try {
      (void)model.loss_sum(test::part(test::batch_tokens(0), comm.rank(), 3),
                           test::part(test::batch_targets(0), comm.rank(), 3), true);
    } catch (const nn::ShardingError& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const std::string& e : errors) {
    CHECK_MESSAGE(e.find("parameter 'down.weight'") != std::string::npos, e);
    CHECK_MESSAGE(e.find("NaN or an infinity (in rank 2's slice)") != std::string::npos, e);
  }
}

TEST_CASE("int8 gather: each parameter's slice has blocks of its own, so a bias never takes its weight's scale") {
  // w (|values| up to 100), a bias of 1e-3 and an f16 parameter of 0.25 in one bucket: blocks of
  // the rank's whole part gave the bias and the f16 parameter w's scale, and they gathered as 0.
  struct Mixed : nn::Module {
    nn::Param w{randn({6, 5}, 3) * 100.0}, b{full({5}, 1e-3)}, d{full({7}, 0.25, DType::f16)};
    Mixed() {
      register_parameter("w", &w);
      register_parameter("b", &b);
      register_parameter("d", &d);
    }
  };
  for (int world : {1, 2, 3}) {
    CAPTURE(world);
    std::vector<std::map<std::string, std::vector<double>>> got(static_cast<std::size_t>(world));
    run_ranks(world, [&](Communicator& comm) {
      Mixed m;
      nn::fully_shard(m, comm, int8_gather());
      got[static_cast<std::size_t>(comm.rank())] = test::snapshot(m);
    });
    for (const auto& values : got) {
      for (const double v : values.at("b")) CHECK(v == doctest::Approx(1e-3).epsilon(1.0 / 254).scale(0));
      for (const double v : values.at("d")) CHECK(v == 0.25);  // 127 * (0.25 / 127): exact in f16
    }
  }
}

TEST_CASE("int8 gather: an f64 value beyond f32's range is named as such on every rank") {
  std::vector<std::string> errors(2);
  run_ranks(2, [&](Communicator& comm) {
    struct Wide : nn::Module {
      nn::Param w{ones({8}, DType::f64)};
      Wide() { register_parameter("w", &w); }
    } m;
    autograd::no_grad([&] { m.w.data().slice(0, 1, 2).fill_(1e39); });
    nn::fully_shard(m, comm, int8_gather());
    try {
      (void)m.w.value();
    } catch (const nn::ShardingError& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const std::string& e : errors) {
    CHECK_MESSAGE(e.find("parameter 'w'") != std::string::npos, e);
    CHECK_MESSAGE(e.find("an f64 value beyond f32's range") != std::string::npos, e);
  }
}

TEST_CASE("int8 gather: refused where it cannot apply") {
  run_ranks(2, [&](Communicator& comm) {
    test::TinyLM model;
    nn::FullyShardOptions per_parameter = int8_gather();
    per_parameter.group = false;
    test::check_throws<nn::ShardingError>([&] { nn::fully_shard(model, comm, per_parameter); },
                                          {"fully_shard", "int8 gather needs grouped parameters"});
    nn::FullyShardOptions bad = int8_gather();
    bad.policy.gather_quantization = static_cast<nn::GatherQuantization>(9);
    test::check_throws<ArgumentError>([&] { nn::fully_shard(model, comm, bad); },
                                      {"fully_shard", "GatherQuantization"});
    // gather_param on a parameter its group gathers in int8 says so (it told the caller to group
    // parameters, which they were).
    nn::fully_shard(model, comm, int8_gather());
    const nn::Param p = model.parameters().front();
    test::check_throws<nn::ShardingError>([&] { (void)nn::gather_param(p, comm); },
                                          {"gather", "is gathered in int8 by its shard group", "Param::value()"});
  });
}
