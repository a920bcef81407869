// Semantics of the tape: accumulation, retain_graph, detach, no_grad, explicit output gradients,
// reverse creation order, always-run nodes, recompute, independent graphs on threads, a graph
// handed between threads, and concurrent backwards through shared leaves.
#include <atomic>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <optional>
#include <thread>

#include "helpers.h"

using namespace ruda;
using test::values;

TEST_CASE("gradients accumulate across backward calls until zero_grad") {
  Tensor w = values({1, 2, 3}, {3}).set_requires_grad();
  sum(w * w).backward();
  CHECK_CLOSE(w.grad(), {2, 4, 6}, {3});
  sum(w * 3.0).backward();
  CHECK_CLOSE(w.grad(), {5, 7, 9}, {3});
  w.zero_grad();
  CHECK_FALSE(w.grad().defined());
  sum(w).backward();
  CHECK_CLOSE(w.grad(), {1, 1, 1}, {3});
}

TEST_CASE("a leaf used several times receives the sum of its gradients") {
  Tensor x = values({2}, {1}).set_requires_grad();
  Tensor y = x * x + x * 3.0 + x;  // dy/dx = 2x + 4
  y.backward();
  CHECK_CLOSE(x.grad(), {8}, {1});
}

TEST_CASE("retain_graph keeps saved state for a second backward") {
  Tensor x = values({1, 2}, {2}).set_requires_grad();
  Tensor y = sum(exp(x));
  y.backward(/*retain_graph=*/true);
  y.backward();
  CHECK_CLOSE(x.grad(), {2 * std::exp(1.0), 2 * std::exp(2.0)}, {2}, 1e-5, 1e-5);
  test::check_throws<AutogradError>([&] { y.backward(); }, {"backward", "retain_graph"});
}

TEST_CASE("detach and no_grad cut the graph") {
  Tensor x = values({1, 2}, {2}).set_requires_grad();
  Tensor d = x.detach();
  CHECK_FALSE(d.requires_grad());
  CHECK(d.shares_storage(x));
  {
    autograd::NoGradGuard guard;
    Tensor y = x * 2.0;
    CHECK_FALSE(y.requires_grad());
    CHECK(y.is_leaf());
  }
  CHECK(autograd::is_grad_enabled());
  Tensor z = autograd::no_grad([&] { return x + 1.0; });
  CHECK_FALSE(z.requires_grad());
  Tensor y = sum(x * d);  // d is a constant
  y.backward();
  CHECK_CLOSE(x.grad(), {1, 2}, {2});
}

TEST_CASE("a leaf frozen between its forward and the backward gets no gradient, as in PyTorch") {
  // PyTorch's AccumulateGrad reads requires_grad when backward reaches the leaf: w.grad stays
  // None (an earlier gradient stays as it was), while the other leaves get theirs.
  Tensor w = full({3}, 1.0).set_requires_grad(), v = full({3}, 1.0).set_requires_grad();
  (w * 2.0).sum().backward();
  REQUIRE(w.grad().defined());
  const Tensor y = (w * 5.0).sum() + (v * 3.0).sum();
  w.set_requires_grad(false);
  y.backward();
  CHECK(w.grad().to_vector<double>() == std::vector<double>{2, 2, 2});
  CHECK(v.grad().to_vector<double>() == std::vector<double>{3, 3, 3});

  Tensor u = full({2}, 1.0).set_requires_grad();
  const Tensor z = (u * 4.0).sum();
  u.set_requires_grad(false);
  z.backward();  // nothing left to receive a gradient: no error, no gradient
  CHECK_FALSE(u.grad().defined());
}

TEST_CASE("backward with an explicit output gradient") {
  Tensor x = values({1, 2, 3}, {3}).set_requires_grad();
  Tensor y = x * x;
  y.backward(values({1, 0, 2}, {3}));
  CHECK_CLOSE(x.grad(), {2, 0, 12}, {3});
  CHECK_FALSE(y.is_leaf());
  CHECK(autograd::node_name(*y.grad_fn()) == "mul");
}

TEST_CASE("integer and boolean results never require grad") {
  Tensor x = values({1, 2, 3}, {3}).set_requires_grad();
  CHECK_FALSE(gt(x, scalar(1.0)).requires_grad());
  CHECK_FALSE(argmax(x, 0).requires_grad());
  CHECK(cast(x, DType::f64).requires_grad());
  CHECK_FALSE(cast(x, DType::i64).requires_grad());
}

TEST_CASE("nodes run in reverse creation order and always-run nodes run without a gradient path") {
  std::vector<std::string> log;
  auto tracer = [&](const char* name, const Tensor& in, autograd::RecordOptions options = {}) {
    Tensor out = in.detach().clone();
    autograd::record(
        name, out, {in}, {},
        [&log, name](const Tensor& g, const autograd::Saved&, autograd::GradMask) {
          log.push_back(name);
          return std::vector<Tensor>{g};
        },
        options);
    return out;
  };
  Tensor x = values({1, 2}, {2}).set_requires_grad();
  Tensor a = tracer("a", x);
  Tensor unused = tracer("unused", x, {.always_run = true});
  Tensor b = tracer("b", a);
  Tensor c = tracer("c", x);
  CHECK(autograd::pending_always_run() == 1);
  sum(b + c).backward();
  CHECK(log == std::vector<std::string>{"c", "b", "unused", "a"});
  CHECK_CLOSE(x.grad(), {2, 2}, {2});  // the always-run node ran, and handed on nothing
  CHECK(autograd::pending_always_run() == 0);
  (void)unused;
}

TEST_CASE("an always-run node the loss does not reach hands on nothing, unless it is a collective") {
  // What each node saw from autograd::reached() while its backward ran.
  std::map<std::string, bool> seen;
  auto node = [&](const char* name, const Tensor& in, autograd::RecordOptions options = {}) {
    Tensor out = in.detach().clone();
    autograd::record(
        name, out, {in}, {},
        [&seen, name](const Tensor& g, const autograd::Saved&, autograd::GradMask) {
          seen[name] = autograd::reached();
          return std::vector<Tensor>{g * 2.0};
        },
        options);
    return out;
  };
  CHECK(autograd::reached());  // outside a backward
  SUBCASE("a plain always-run node: its input, a leaf, and what lies between get nothing") {
    Tensor w = values({1, 2}, {2}).set_requires_grad();
    Tensor other = values({3}, {1}).set_requires_grad();
    const Tensor branch = node("always", node("between", w), {.always_run = true});
    sum(other * 3.0).backward();
    CHECK(seen == std::map<std::string, bool>{{"always", false}});  // "between" never ran
    CHECK_FALSE(w.grad().defined());                                // the dense graph without the branch: no gradient
    CHECK_CLOSE(other.grad(), {3}, {1});
    (void)branch;
  }
  // What loss_reached(w) said at the end of the backward.
  std::optional<bool> w_loss_reached;
  auto ask_at_end = [&](const Tensor& w) {
    Tensor out = w.detach().clone();
    autograd::record("asks", out, {w}, {},
                     [&, w](const Tensor&, const autograd::Saved&, autograd::GradMask) {
                       autograd::at_backward_end([&, w] { w_loss_reached = autograd::loss_reached(w); });
                       return std::vector<Tensor>{Tensor()};
                     },
                     {.always_run = true});
  };
  SUBCASE("a collective passes its gradient on: what it reaches runs, though the loss did not reach it") {
    Tensor w = values({1, 2}, {2}).set_requires_grad();
    Tensor other = values({3}, {1}).set_requires_grad();
    ask_at_end(w);
    const Tensor branch = node("collective", node("between", w), {.always_run = true, .collective = true});
    sum(other * 3.0).backward();
    CHECK(seen == std::map<std::string, bool>{{"between", false}, {"collective", false}});
    CHECK_CLOSE(w.grad(), {0, 0}, {2});  // zeros here; another rank's gradient in a real reduce-scatter
    CHECK(w_loss_reached == false);      // only what the collective handed on
    (void)branch;
  }
  SUBCASE("reached through the loss: every node says so") {
    Tensor w = values({1, 2}, {2}).set_requires_grad();
    ask_at_end(w);
    sum(node("always", node("between", w), {.always_run = true})).backward();
    CHECK(w_loss_reached == true);
    CHECK_FALSE(autograd::loss_reached(w));  // outside a backward
    CHECK(seen == std::map<std::string, bool>{{"always", true}, {"between", true}});
    CHECK_CLOSE(w.grad(), {4, 4}, {2});
  }
  SUBCASE("a backward nested in an unreached node's reaches nothing either (a checkpointed block's)") {
    Tensor w = values({1, 2}, {2}).set_requires_grad();
    Tensor inner_leaf = values({5}, {1}).set_requires_grad();
    Tensor out = w.detach().clone();
    bool nested_reached = true;
    autograd::record("outer", out, {w}, {},
                     [&](const Tensor& g, const autograd::Saved&, autograd::GradMask) {
                       Tensor inner;
                       {
                         // grad mode is off in a backward; the recompute turns it on, as checkpoint does
                         autograd::set_grad_enabled(true);
                         inner = node("inner", inner_leaf, {.always_run = true}) * 1.0;
                         autograd::set_grad_enabled(false);
                       }
                       autograd::backward(inner, zeros({1}));
                       nested_reached = seen.at("inner");
                       return std::vector<Tensor>{g};
                     },
                     {.always_run = true});
    Tensor other = values({3}, {1}).set_requires_grad();
    sum(other).backward();
    CHECK_FALSE(nested_reached);
    CHECK_FALSE(inner_leaf.grad().defined());
    CHECK_FALSE(w.grad().defined());
  }
}

TEST_CASE("a retired leaf: a backward the loss reaches it through fails; zeros from an unreached node are dropped") {
  // retire_leaf is how a parameter whose data was swapped (Param::set_data, fully_shard) keeps a
  // graph recorded on the old tensor from adding a gradient nobody reads.
  SUBCASE("reached: AutogradError with the reason, through a plain node and through a slice of the leaf") {
    for (const bool sliced : {false, true}) {
      CAPTURE(sliced);
      Tensor w = values({1, 2, 3}, {3}).set_requires_grad();
      const Tensor loss = sum((sliced ? w.slice(0, 1, 3) : w) * 2.0);
      autograd::retire_leaf(w, "the holder replaced w");
      test::check_throws<AutogradError>([&] { loss.backward(); }, {"backward", "the holder replaced w"});
      CHECK_FALSE(w.grad().defined());
    }
  }
  SUBCASE("a frozen retired leaf gets nothing, as a frozen one does") {
    Tensor w = values({1, 2}, {2}).set_requires_grad();
    const Tensor loss = sum(w * 2.0);
    autograd::retire_leaf(w, "replaced");
    w.set_requires_grad(false);
    loss.backward();
    CHECK_FALSE(w.grad().defined());
  }
  SUBCASE("an unreached collective hands it zeros: dropped, no error") {
    Tensor w = values({1, 2}, {2}).set_requires_grad();
    Tensor other = values({3}, {1}).set_requires_grad();
    Tensor out = w.detach().clone();
    autograd::record("collective", out, {w}, {},
                     [](const Tensor& g, const autograd::Saved&, autograd::GradMask) { return std::vector<Tensor>{g}; },
                     {.always_run = true, .collective = true});
    autograd::retire_leaf(w, "replaced");
    sum(other * 3.0).backward();
    CHECK_FALSE(w.grad().defined());
    CHECK_CLOSE(other.grad(), {3}, {1});
  }
  SUBCASE("refuse_if_retired: only where the loss reached the running node") {
    for (const bool reach : {true, false}) {
      CAPTURE(reach);
      Tensor w = values({1, 2}, {2}).set_requires_grad();
      Tensor other = values({3}, {1}).set_requires_grad();
      autograd::retire_leaf(w, "w was swapped");
      Tensor routed = other.detach().clone();
      // A node routing its leaf's gradient elsewhere (a shard group's gather): it hands back none.
      autograd::record("routes", routed, {other}, {},
                       [w](const Tensor&, const autograd::Saved&, autograd::GradMask) {
                         autograd::refuse_if_retired(w);
                         return std::vector<Tensor>{Tensor()};
                       },
                       {.always_run = true});
      Tensor plain = values({1}, {1}).set_requires_grad();
      const Tensor loss = reach ? sum(routed) : sum(plain * 1.0);
      if (reach) {
        test::check_throws<AutogradError>([&] { loss.backward(); }, {"backward", "w was swapped"});
      } else {
        loss.backward();  // the routing node runs unreached: nothing to refuse
        CHECK_CLOSE(plain.grad(), {1}, {1});
      }
    }
    CHECK_NOTHROW(autograd::refuse_if_retired(values({1}, {1})));  // outside a backward
  }
  SUBCASE("bad arguments") {
    Tensor w = values({1, 2}, {2}).set_requires_grad();
    test::check_throws<ArgumentError>([&] { autograd::retire_leaf(Tensor(), "x"); }, {"retire_leaf"});
    test::check_throws<ArgumentError>([&] { autograd::retire_leaf(w, ""); }, {"retire_leaf", "reason"});
    test::check_throws<ArgumentError>([&] { autograd::retire_leaf(w * 2.0, "x"); },
                                      {"retire_leaf", "f32 [2]", "not a leaf"});
    test::check_throws<ArgumentError>([&] { autograd::refuse_if_retired(Tensor()); }, {"refuse_if_retired"});
  }
}

namespace {
// A copy of `in` whose node is always run (even where the loss does not reach it), passing the
// gradient through and counting its runs in *runs (when given).
Tensor always_run_copy(const Tensor& in, int* runs) {
  Tensor out = in.detach().clone();
  autograd::record("always", out, {in}, {},
                   [runs](const Tensor& g, const autograd::Saved&, autograd::GradMask) {
                     if (runs) ++*runs;
                     return std::vector<Tensor>{g};
                   },
                   {.always_run = true});
  return out;
}
}  // namespace

TEST_CASE("two forwards, then two backwards, with always-run nodes") {
  int runs = 0;
  auto always = [&](const Tensor& in) { return always_run_copy(in, &runs); };
  Tensor x = values({1, 2}, {2}).set_requires_grad();
  const Tensor l1 = sum(always(x) * 2.0);
  const Tensor l2 = sum(always(x) * 3.0);  // a second forward before the first backward
  l1.backward();
  CHECK(runs == 2);  // l2's always-run node ran too, with a zero gradient ...
  CHECK(autograd::pending_always_run() == 0);
  l2.backward();  // ... and was not freed: l2's own backward runs through it
  CHECK(runs == 3);
  CHECK_CLOSE(x.grad(), {5, 5}, {2});
}

TEST_CASE("a recomputed saved tensor is rebuilt in backward instead of kept") {
  const Tensor a = randn({256, 256}, 1).set_requires_grad();
  const Tensor b = randn({256, 256}, 2).set_requires_grad();
  // Reference: keep the intermediate. (x = a * 2 saves only the scalar 2 for its own backward, so
  // the matmul's copy is the only one of x.)
  sum(matmul(a * 2.0, b)).backward();
  const Tensor grad_a = a.grad().clone(), grad_b = b.grad().clone();
  const_cast<Tensor&>(a).zero_grad();
  const_cast<Tensor&>(b).zero_grad();

  int recomputed = 0;
  Tensor loss;
  std::int64_t kept_bytes = 0;
  {
    memory::reset_peak();
    const std::int64_t before = memory::stats().live_bytes;
    Tensor x = a * 2.0;
    autograd::set_recompute(x, [&recomputed, a] {
      ++recomputed;
      return a.detach() * 2.0;
    });
    loss = sum(matmul(x, b));
    x = Tensor();  // the only handle to exp(a) outside the graph
    kept_bytes = memory::stats().live_bytes - before;
  }
  CHECK(recomputed == 0);
  // Only the loss (and nothing of x's 256 KiB) is alive between forward and backward.
  CHECK(kept_bytes < 256 * 256 * 4);
  loss.backward();
  CHECK(recomputed == 1);
  CHECK_CLOSE(a.grad(), grad_a, 1e-4, 1e-5);
  CHECK_CLOSE(b.grad(), grad_b, 1e-4, 1e-5);
}

TEST_CASE("a recompute recipe that gives back another shape, dtype or nothing is refused in backward") {
  // Taken as is, a [1] tensor where a [3] was saved broadcast in mul's backward: w's gradient read
  // [10, 10, 10] without an error.
  const Tensor w = ones({3}, DType::f64).set_requires_grad();
  const std::vector<std::pair<std::function<Tensor()>, std::string>> recipes{
      {[] { return from_values({10}, {1}, DType::f64); }, "returned f64 [1]"},
      {[] {
         return from_values({1, 2, 3}, {3}, DType::f32);
       },
       "returned f32 [3]"},
      {[] { return Tensor(); }, "returned an undefined tensor"},
  };
  for (const auto& [recipe, said] : recipes) {
    CAPTURE(said);
    Tensor a = from_values({1, 2, 3}, {3}, DType::f64);
    autograd::set_recompute(a, recipe);
    const Tensor loss = sum(a * w);
    test::check_throws<AutogradError>([&] { loss.backward(); },
                                      {"backward", "recompute recipe", "f64 [3]", "saved by mul", said});
  }
  // The right shape and dtype pass.
  Tensor a = from_values({1, 2, 3}, {3}, DType::f64);
  autograd::set_recompute(a, [] { return from_values({1, 2, 3}, {3}, DType::f64); });
  sum(a * w).backward();
  CHECK_CLOSE(w.grad(), {1, 2, 3}, {3}, 0, 0);
}

TEST_CASE("graphs built on different threads do not interfere") {
  const Tensor w0 = randn({64, 32}, 5);
  auto train = [&](int seed) {
    Tensor w = w0.clone().set_requires_grad();
    for (int step = 0; step < 20; ++step) {
      const Tensor x = randn({16, 64}, static_cast<std::uint64_t>(seed * 100 + step));
      const Tensor loss = mean(square(tanh(matmul(x, w))));
      w.zero_grad();
      loss.backward();
      autograd::NoGradGuard guard;
      w.add_(w.grad(), -0.1);
    }
    return w;
  };
  std::vector<Tensor> expected;
  for (int i = 0; i < 4; ++i) expected.push_back(train(i));
  std::vector<Tensor> got(4);
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) threads.emplace_back([&, i] { got[i] = train(i); });
  for (auto& t : threads) t.join();
  for (int i = 0; i < 4; ++i) CHECK_CLOSE(got[i], expected[i], 0, 0);
}

TEST_CASE("a graph begun on one thread and finished on another orders its nodes across the two") {
  // Thread A records many nodes, thread B few: with a node counter per thread, B's consumer sorted
  // before A's producer, which then saw no gradient, and w got none, without an error.
  Tensor w = values({1, 2, 3, 4}, {4}).set_requires_grad();
  Tensor h;
  std::thread([&] {
    Tensor t = w;
    for (int i = 0; i < 10; ++i) t = t * 1.0;
    h = t;
  }).join();
  std::thread([&] { sum(h * 2.0).backward(); }).join();
  REQUIRE(w.grad().defined());
  CHECK_CLOSE(w.grad(), {2, 2, 2, 2}, {4}, 0, 0);
}

TEST_CASE("backward on several threads at once through shared leaves sums every contribution") {
  // Two graphs over one parameter, backpropagated at the same time: each adds exact integers into
  // w.grad, so any lost update shows as a smaller total (unguarded, whole contributions were lost).
  Tensor w = ones({256}).set_requires_grad();
  constexpr int kThreads = 4, kSteps = 50;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int step = 0; step < kSteps; ++step) sum(w * static_cast<double>(t + 1)).backward();
    });
  }
  for (auto& t : threads) t.join();
  const double expected = kSteps * (1 + 2 + 3 + 4);
  CHECK_CLOSE(w.grad(), std::vector<double>(256, expected), {256}, 0, 0);
}

TEST_CASE("an always-run node recorded on one thread and run by another thread's backward leaves no trace") {
  // A checkpointed forward on a worker, its backward on the caller: the worker's list still held
  // the node, and the worker's next backward failed on it as "freed by an earlier backward".
  Tensor x = values({1, 2}, {2}).set_requires_grad();
  int runs = 0;
  auto always = [&](const Tensor& in) { return always_run_copy(in, &runs); };
  std::promise<Tensor> made;
  std::promise<void> ran;
  std::size_t listed = 99;
  std::exception_ptr error;
  std::thread worker([&] {
    made.set_value(sum(always(x) * 3.0));
    ran.get_future().wait();
    listed = autograd::pending_always_run();  // run and freed by the other thread's backward
    try {
      sum(x * 2.0).backward();  // an unrelated backward of the worker's own
    } catch (...) {
      error = std::current_exception();
    }
  });
  made.get_future().get().backward();
  ran.set_value();
  worker.join();
  CHECK(listed == 0);
  CHECK_FALSE(error);
  CHECK(runs == 1);
  CHECK_CLOSE(x.grad(), {5, 5}, {2}, 0, 0);
}

TEST_CASE("a worker recording always-run nodes for backwards on other threads keeps a bounded list") {
  Tensor x = values({1, 2}, {2}).set_requires_grad();
  auto always = [](const Tensor& in) { return always_run_copy(in, nullptr); };
  std::size_t listed = 0;
  std::thread worker([&] {
    for (int step = 0; step < 500; ++step) {
      Tensor loss = sum(always(x));
      std::thread([&] { loss.backward(); }).join();
    }
    listed = autograd::pending_always_run();
  });
  worker.join();
  CHECK(listed == 0);
  CHECK_CLOSE(x.grad(), {500, 500}, {2}, 0, 0);
}

TEST_CASE("a graph of 220k chained ops is differentiated and freed without exhausting the stack") {
  // Freed by recursion through each node's producers, 200k chained nodes (an unrolled RNN of 70k
  // steps on a thread's 8 MB stack) overflowed it; backward itself walks the graph iteratively.
  std::int64_t grad = 0;
  bool freed = false;
  std::thread([&] {
    Tensor x = ones({2}).set_requires_grad();
    {
      Tensor y = x;
      for (int i = 0; i < 220000; ++i) y = y * 1.0;
      sum(y).backward(true);  // retained: the graph is still whole when y goes
    }
    grad = static_cast<std::int64_t>(x.grad().to_vector<double>()[0]);
    {
      Tensor y = x;
      for (int i = 0; i < 220000; ++i) y = y * 1.0;
    }  // never differentiated: freed whole
    freed = true;
  }).join();
  CHECK(grad == 1);
  CHECK(freed);
}

TEST_CASE("a deep graph whose nodes hold their producers twice is freed without exhausting the stack") {
  // y * y holds y's node through two edges and a saved input, y + f(y) through an edge and the
  // chain of f: a release that followed only producers held once recursed into the rest, and
  // 100k such levels overflowed a thread's 8 MB stack (a segfault when the graph was freed).
  double value = 0, grad = 0;
  bool freed = false;
  std::thread([&] {
    const Tensor x = ones({2}, DType::f64).set_requires_grad();
    {
      Tensor y = x;
      for (int i = 0; i < 120000; ++i) y = y * y;
    }  // never differentiated: freed whole
    const Tensor w = full({2, 2}, 0.5, Options(DType::f64));
    {
      Tensor y = x.reshape({1, 2});
      for (int i = 0; i < 120000; ++i) y = y + tanh(matmul(y, w)) * 1e-6;  // an explicit Euler loop
      sum(y).backward(true);  // retained: the graph is still whole when y goes
      value = y.to_vector<double>()[0];
    }
    grad = x.grad().to_vector<double>()[0];
    freed = true;
  }).join();
  CHECK(freed);
  // Each step adds at most 1e-6 to y and multiplies the gradient by at most 1 + 1e-6 (tanh' <= 1,
  // w's rows sum to 1), at least 1: 120k steps end within (1, e^0.12).
  CHECK(value > 1.0);
  CHECK(value < 1.128);
  CHECK(grad > 1.0);
  CHECK(grad < 1.128);
}

TEST_CASE("a node's wrong gradient for a leaf is named by the node, as for any input") {
  Tensor x = values({1, 2, 3}, {3}).set_requires_grad();
  Tensor y = x.detach() * 2.0;
  autograd::record("narrowing", y, {x}, {}, [](const Tensor& g, const autograd::Saved&, autograd::GradMask) {
    return std::vector<Tensor>{g.slice(0, 0, 2)};
  });
  test::check_throws<AutogradError>([&] { sum(y).backward(); },
                                    {"backward", "narrowing produced a gradient f32 [2]", "a leaf of f32 [3]"});
}

TEST_CASE("copy_ and add_ refuse, under grad mode, an operand that requires grad: its gradient would be lost") {
  // In-place updates are not recorded: buf.copy_(w) and a loss of buf left w's grad undefined.
  const Tensor w = values({1, 2}, {2}).set_requires_grad();
  Tensor buf = zeros({2});
  test::check_throws<AutogradError>([&] { buf.copy_(w); }, {"copy_", "f32 [2] operand requires grad", "lost"});
  test::check_throws<AutogradError>([&] { buf.add_(w); }, {"add_", "f32 [2] operand requires grad", "lost"});
  CHECK_CLOSE(buf, {0, 0}, {2}, 0, 0);  // refused before writing
  buf.copy_(w.detach());                // the values alone: fine
  {
    autograd::NoGradGuard guard;
    buf.add_(w);
  }
  CHECK_CLOSE(buf, {2, 4}, {2}, 0, 0);
}

TEST_CASE("record refuses a collective node that is not always-run") {
  // Run only where the loss reaches it, its collective would wait for ranks whose loss does not.
  Tensor x = values({1, 2}, {2}).set_requires_grad();
  Tensor out = x.detach().clone();
  auto pass = [](const Tensor& g, const autograd::Saved&, autograd::GradMask) { return std::vector<Tensor>{g}; };
  test::check_throws<ArgumentError>([&] { autograd::record("gather", out, {x}, {}, pass, {.collective = true}); },
                                    {"record", "gather", "collective", "always-run"});
  CHECK_FALSE(out.requires_grad());
}

TEST_CASE("record refuses an output that is one of its inputs") {
  // Accepted, it made a leaf stop being one and a cycle (tensor -> node -> edge -> tensor) that leaked.
  Tensor x = values({1, 2}, {2}).set_requires_grad();
  Tensor y = x;
  test::check_throws<ArgumentError>(
      [&] {
        autograd::record("ident", y, {x}, {}, [](const Tensor& g, const autograd::Saved&, autograd::GradMask) {
          return std::vector<Tensor>{g};
        });
      },
      {"record", "ident", "output is one of the inputs"});
  CHECK(x.is_leaf());
}

TEST_CASE("record refuses an output that already has a node, or is a leaf that requires grad") {
  // Accepted, the second record replaced the first node (its graph cut off without a word), and a
  // user's parameter given as the output stopped being a leaf (it never received its gradient).
  auto identity = [](const Tensor& g, const autograd::Saved&, autograd::GradMask) { return std::vector<Tensor>{g}; };
  Tensor a = values({1, 2}, {2}).set_requires_grad(), b = values({3, 4}, {2}).set_requires_grad();
  Tensor y = a * 2.0;
  test::check_throws<ArgumentError>([&] { autograd::record("again", y, {b}, {}, identity); },
                                    {"record", "again", "f32 [2]", "already has a node", "mul"});
  Tensor w = values({5, 6}, {2}).set_requires_grad();
  test::check_throws<ArgumentError>([&] { autograd::record("onto", w, {b}, {}, identity); },
                                    {"record", "onto", "f32 [2]", "leaf that requires grad"});
  CHECK(w.is_leaf());
  // Refused under no-grad too: the mistake shows on the first run, whatever the mode.
  autograd::no_grad([&] {
    test::check_throws<ArgumentError>([&] { autograd::record("onto", w, {b}, {}, identity); },
                                      {"leaf that requires grad"});
  });
  // The graph before is intact: y's gradient still reaches a.
  sum(y).backward();
  CHECK(a.grad().to_vector<float>() == std::vector<float>{2, 2});
  CHECK_FALSE(b.grad().defined());
  // A new tensor records as before.
  Tensor z = b.detach().clone();
  autograd::record("fresh", z, {b}, {}, identity);
  sum(z).backward();
  CHECK(b.grad().to_vector<float>() == std::vector<float>{1, 1});
}

TEST_CASE("an integer output of a recorded op carries no gradient, as set_requires_grad refuses it one") {
  // The node was recorded: the i64 output required grad (set_requires_grad refuses that with a
  // DTypeError), and o * o of it passed gradients into x.
  Tensor x = values({1, 2, 3}, {3}, DType::f64).set_requires_grad();
  Tensor o = values({1, 2, 3}, {3}, DType::i64);
  autograd::record("to_index", o, {x}, {}, [](const Tensor& g, const autograd::Saved&, autograd::GradMask) {
    return std::vector<Tensor>{g.to(DType::f64)};
  });
  CHECK_FALSE(o.requires_grad());
  CHECK_FALSE(o.grad_fn());
  test::check_throws<DTypeError>([] { zeros({2}, DType::i64).set_requires_grad(); }, {"i64"});
}

TEST_CASE("a view taken under no-grad of a tensor that requires grad is not written in place with grad on") {
  // It has no graph, so begin_inplace saw a tensor that requires no grad: x.slice under no-grad,
  // then fill_ with grad mode on, changed the leaf x without a word (PyTorch refuses it too).
  for (const bool through_reshape : {false, true}) {
    CAPTURE(through_reshape);
    Tensor x = values({1, 2}, {2}, DType::f64).set_requires_grad();
    Tensor v = autograd::no_grad([&] { return through_reshape ? x.reshape({2, 1}) : x.slice(0, 0, 1); });
    Tensor vv = v.transpose(0, v.ndim() - 1);  // a view of such a view, taken with grad on
    test::check_throws<AutogradError>([&] { v.fill_(0); }, {"fill_", "view taken under no-grad", "NoGradGuard"});
    test::check_throws<AutogradError>([&] { vv.mul_(2.0); }, {"mul_", "view taken under no-grad"});
    test::check_throws<AutogradError>([&] { v.copy_(zeros_like(v)); }, {"copy_", "view taken under no-grad"});
    CHECK(x.to_vector<double>() == std::vector<double>{1, 2});
    // Under no-grad the update goes through, as updates of x itself do; a detached copy of the view
    // is the user's to write.
    autograd::no_grad([&] { v.fill_(5); });
    CHECK(x.to_vector<double>()[0] == 5);
    Tensor d = v.detach();
    d.fill_(7);
    CHECK(x.to_vector<double>()[0] == 7);
  }
  // A view of a tensor that requires no grad, taken under no-grad, is written as before.
  Tensor plain = values({1, 2}, {2}, DType::f64);
  Tensor pv = autograd::no_grad([&] { return plain.slice(0, 1, 2); });
  pv.fill_(9);
  CHECK(plain.to_vector<double>() == std::vector<double>{1, 9});
}

TEST_CASE("the graph frees saved tensors after backward") {
  const std::int64_t before = memory::stats().live_bytes;
  {
    Tensor w = randn({128, 128}, 1).set_requires_grad();
    Tensor loss = sum(tanh(matmul(randn({64, 128}, 2), w)));
    loss.backward();
    w.zero_grad();
  }
  CHECK(memory::stats().live_bytes == before);
}

TEST_CASE("a saved tensor modified in place stops backward with an error naming the node") {
  Tensor x = values({1, 2}, {2}).set_requires_grad();
  Tensor y = exp(x);  // saves its output
  const std::uint64_t v = y.version();
  y.detach().reshape({1, 2}).fill_(0);  // through another handle and a view: same storage
  CHECK(y.version() == v + 1);
  test::check_throws<AutogradError>([&] { sum(y).backward(); },
                                    {"backward", "f32 [2]", "saved by exp", "modified in place", "version 0, now 1"});

  // An optimizer-style update of a weight between forward and backward is caught the same way.
  Tensor w = values({3, 4}, {2}).set_requires_grad();
  Tensor u = values({5}, {1}).set_requires_grad();
  Tensor loss = sum(u * w);  // saves w for u's gradient
  {
    autograd::NoGradGuard guard;
    w.add_(values({1, 1}, {2}), -0.1);
  }
  test::check_throws<AutogradError>([&] { loss.backward(); }, {"saved by mul", "modified in place"});

  // Writes to other storages, or before the save, are fine.
  Tensor a = values({1, 2}, {2}).set_requires_grad();
  Tensor b = values({2, 2}, {2});
  b.mul_(2);
  Tensor out = sum(a * b);
  values({0}, {1}).fill_(3);
  out.backward();
  CHECK_CLOSE(a.grad(), {4, 4}, {2});
}

// take_along_axis computes with a transposed view of its index or flat positions made from it,
// depending on the axis and how many it picks: on every path, an index changed in place before
// backward is caught under the shape the caller passed (the transposed view's shape was named,
// and the flat positions' path did not check).
TEST_CASE("take_along_axis catches its index changed in place, named by the caller's shape") {
  struct Case {
    Shape x, index;
    std::int64_t axis;
  };
  for (const Case& c : {Case{{2, 3}, {1, 3}, 0},        // half the axis or more: moved last and back
                        Case{{2, 5, 2}, {2, 1, 2}, 1},  // a few picks: flat positions
                        Case{{4, 3}, {4, 2}, 1}}) {     // the last axis
    const std::string index_shape = to_string(c.index);
    CAPTURE(index_shape);
    Tensor x = randn(c.x, 1).set_requires_grad();
    Tensor index = zeros(c.index, DType::i64);
    const Tensor y = take_along_axis(x, index, c.axis);
    index.fill_(1);
    test::check_throws<AutogradError>([&] { sum(y).backward(); },
                                      {"i64 " + index_shape, "saved by take_along_axis", "modified in place"});
  }
}

TEST_CASE("clone and a move to another backend pass gradients through") {
  Tensor x = values({1, 2}, {2}).set_requires_grad();
  Backend& eigen = get_backend("eigen");
  const Tensor moved = x.to(eigen);
  CHECK(&moved.backend() == &eigen);
  CHECK(moved.shares_storage(x));
  CHECK_FALSE(moved.is_leaf());
  sum(moved * moved + x.clone() * 3.0).backward();
  CHECK_CLOSE(x.grad(), {5, 7}, {2});
  CHECK(&x.grad().backend() == &x.backend());
  CHECK_FALSE(x.detach().clone().requires_grad());
}

// A slice's backward adds its gradient into the region of the input's pending gradient
// (autograd.cpp, add_into_region) instead of handing on a zero-padded full-size tensor.
TEST_CASE("slices of one tensor add their gradients into its regions") {
  const Tensor x = randn({6, 9}, 1).set_requires_grad();
  const Tensor a = randn({6, 3}, 2), b = randn({6, 5}, 3), c = randn({6, 3}, 4);
  // Overlapping and disjoint slices of a non-leaf, and the whole tensor once more.
  auto loss_of = [&](const Tensor& h) {
    return sum(slice(h, 1, 0, 3) * a) + sum(slice(h, 1, 2, 7) * b) + sum(slice(h, 1, 6, 9) * c) + sum(h * h);
  };
  loss_of(x * 2.0).backward();
  // Reference: the same gradient from the padded contributions written out by hand.
  const Tensor h = (x * 2.0).detach();
  Tensor expected = h * 2.0;
  expected = slice_assign(expected, 1, 0, 3, slice(expected, 1, 0, 3) + a);
  expected = slice_assign(expected, 1, 2, 7, slice(expected, 1, 2, 7) + b);
  expected = slice_assign(expected, 1, 6, 9, slice(expected, 1, 6, 9) + c);
  CHECK_CLOSE(x.grad(), expected * 2.0, 1e-6, 1e-6);
}

// When slices reach a pending gradient first, it starts uninitialized: each slice's gradient is
// copied into what no other slice wrote (added where one did), and the rest is zeroed before
// anything else reads it (autograd.cpp, write_region and complete_pending).
TEST_CASE("slices that leave gaps, overlap, cross axes or come before a whole gradient") {
  // 2048 rows: the pending gradient (72 KiB) comes from the block cache, which the run below first
  // fills with a NaN block of its size, so a region nobody zeroed reads NaN, not fresh zero pages.
  constexpr std::int64_t kRows = 2048;
  Tensor x = randn({kRows, 9}, 21).set_requires_grad();
  const Tensor a = randn({kRows, 3}, 22), b = randn({kRows, 3}, 23), c = randn({kRows, 2}, 24), e = randn({3, 9}, 25);
  auto padded = [](Tensor into, int axis, std::int64_t begin, std::int64_t end, const Tensor& part) {
    return slice_assign(into, axis, begin, end, slice(into, axis, begin, end) + part);
  };
  auto run = [&](const std::function<Tensor(const Tensor&)>& loss_of) {
    x.zero_grad();
    const Tensor loss = loss_of(x * 2.0);
    { const Tensor poison = full({kRows, 9}, std::numeric_limits<double>::quiet_NaN()); }
    loss.backward();
    return x.grad() * 0.5;  // the gradient with respect to h = 2 x
  };
  SUBCASE("a gap between slices is zero, overlaps add") {
    // Columns [0, 3) and [2, 5) overlap on column 2; [7, 9) leaves columns 5 and 6 unwritten.
    const Tensor got = run([&](const Tensor& h) {
      return sum(slice(h, 1, 0, 3) * a) + sum(slice(h, 1, 2, 5) * b) + sum(slice(h, 1, 7, 9) * c);
    });
    Tensor expected = zeros({kRows, 9});
    expected = padded(expected, 1, 0, 3, a);
    expected = padded(expected, 1, 2, 5, b);
    expected = padded(expected, 1, 7, 9, c);
    CHECK_CLOSE(got, expected, 1e-6, 1e-6);
    CHECK_CLOSE(slice(got, 1, 5, 7), zeros({kRows, 2}), 0, 0);
  }
  SUBCASE("a slice on another axis") {
    const Tensor got = run([&](const Tensor& h) { return sum(slice(h, 1, 2, 5) * b) + sum(slice(h, 0, 1, 4) * e); });
    Tensor expected = zeros({kRows, 9});
    expected = padded(expected, 0, 1, 4, e);
    expected = padded(expected, 1, 2, 5, b);
    CHECK_CLOSE(got, expected, 1e-6, 1e-6);
  }
  SUBCASE("a whole gradient after the slices") {
    // h * h comes first in the forward, so its backward runs after the slices' backwards.
    const Tensor got = run([&](const Tensor& h) { return sum(h * h) + sum(slice(h, 1, 7, 9) * c); });
    const Tensor h = (x * 2.0).detach();
    CHECK_CLOSE(got, padded(h * 2.0, 1, 7, 9, c), 1e-6, 1e-6);
  }
}

TEST_CASE("a slice's gradient never writes into a gradient another input shares") {
  // add hands one gradient to both of its inputs: h's pending gradient is w's too when the slice
  // of h (created first, so its backward runs after the add's) adds into it.
  const Tensor x1 = randn({4, 6}, 5).set_requires_grad(), x2 = randn({4, 6}, 6).set_requires_grad();
  const Tensor c = randn({4, 6}, 7), d = randn({4, 2}, 8);
  const Tensor h = x1 * 1.0, w = x2 * 1.0;
  const Tensor part = slice(h, 1, 1, 3);
  const Tensor loss = sum((h + w) * c) + sum(part * d);
  loss.backward();
  CHECK_CLOSE(x2.grad(), c, 0, 0);  // untouched by the slice's gradient
  CHECK_CLOSE(x1.grad(), slice_assign(c, 1, 1, 3, slice(c, 1, 1, 3) + d), 1e-6, 1e-6);
}

TEST_CASE("three slices of a projection cost one full-size gradient, not three") {
  // The q, k, v split of a [N, 3C] projection: the padded path held a full-size gradient, the next
  // padded one and their sum at once (at least three); the region path holds the one it adds into.
  const std::int64_t n = 256, c = 128;
  const Tensor x = randn({n, 3 * c}, 9).set_requires_grad();
  const Tensor wq = randn({n, c}, 10), wk = randn({n, c}, 11), wv = randn({n, c}, 12);
  Tensor loss;
  {
    const Tensor h = x * 2.0;
    loss = sum(slice(h, 1, 0, c) * wq) + sum(slice(h, 1, c, 2 * c) * wk) + sum(slice(h, 1, 2 * c, 3 * c) * wv);
  }
  const std::int64_t full = n * 3 * c * 4;
  memory::reset_peak();
  const std::int64_t before = memory::stats().live_bytes;
  loss.backward();
  const std::int64_t backward_peak = memory::stats().peak_bytes - before;
  // The pending [N, 3C] gradient, the mul's [N, 3C] output and one [N, C] part at a time.
  CHECK(backward_peak < full * 5 / 2);
  CHECK_CLOSE(slice(x.grad(), 1, c, 2 * c), wk * 2.0, 1e-6, 1e-6);
}

TEST_CASE("slices of a leaf add into one gradient of the leaf, not one padded gradient each") {
  // A parameter sliced directly (a fused [3C, C] projection weight split into q, k and v). The
  // padded path made a zero-padded full-size gradient per slice and added each whole.
  const std::int64_t n = 256, c = 128;
  Tensor w = randn({3 * c, n}, 9).set_requires_grad();
  const Tensor a = randn({c, n}, 10), b = randn({c, n}, 11), d = randn({2 * c, n}, 12);
  auto loss_of = [&](const Tensor& t) {  // disjoint, overlapping, and the whole once more
    return sum(slice(t, 0, 0, c) * a) + sum(slice(t, 0, c, 2 * c) * b) + sum(slice(t, 0, c, 3 * c) * d) + sum(t);
  };
  {
    // q, k and v: the leaf's gradient and one third-size part at a time (the padded path held a
    // padded full-size gradient beside the leaf's from the second slice on).
    Tensor qkv = randn({3 * c, n}, 15).set_requires_grad();
    const Tensor three =
        sum(slice(qkv, 0, 0, c) * a) + sum(slice(qkv, 0, c, 2 * c) * b) + sum(slice(qkv, 0, 2 * c, 3 * c) * a);
    const std::int64_t full = 3 * c * n * 4;
    memory::reset_peak();
    const std::int64_t before = memory::stats().live_bytes;
    three.backward();
    CHECK(memory::stats().peak_bytes - before < 2 * full);
    CHECK_CLOSE(slice(qkv.grad(), 0, c, 2 * c), b, 1e-6, 1e-6);
  }
  loss_of(w).backward();
  Tensor expected = ones({3 * c, n});
  expected = slice_assign(expected, 0, 0, c, slice(expected, 0, 0, c) + a);
  expected = slice_assign(expected, 0, c, 2 * c, slice(expected, 0, c, 2 * c) + b);
  expected = slice_assign(expected, 0, c, 3 * c, slice(expected, 0, c, 3 * c) + d);
  CHECK_CLOSE(w.grad(), expected, 1e-6, 1e-6);
  // A second backward adds to the gradient there is; a leaf frozen since its forward gets nothing.
  loss_of(w).backward();
  CHECK_CLOSE(w.grad(), expected * 2.0, 1e-6, 1e-6);
  Tensor frozen = randn({4, 3}, 13).set_requires_grad();
  const Tensor later = sum(slice(frozen, 1, 1, 2) * 3.0);
  frozen.set_requires_grad(false);
  later.backward();
  CHECK_FALSE(frozen.grad().defined());
  // Only the region a lone slice reaches is written; the rest of the gradient is zero.
  Tensor v = randn({5}, 14).set_requires_grad();
  sum(slice(v, 0, 1, 3) * 2.0).backward();
  CHECK(v.grad().to_vector<double>() == std::vector<double>{0, 2, 2, 0, 0});
}

TEST_CASE("an op of more than 64 inputs, some of which require grad, differentiates (no 64-input cap)") {
  // concat of 70 rows, the 3rd and the 67th requiring grad: the node's mask needs more than 64 bits.
  std::vector<Tensor> rows;
  for (int i = 0; i < 70; ++i) rows.push_back(full({1, 2}, static_cast<double>(i)));
  rows[2].set_requires_grad();
  rows[66].set_requires_grad();
  const Tensor weights = from_values(std::vector<double>(140, 0.0), {70, 2}) + arange(0, 140).reshape({70, 2});
  sum(concat(rows, 0) * weights).backward();
  CHECK(rows[2].grad().to_vector<float>() == std::vector<float>{4, 5});
  CHECK(rows[66].grad().to_vector<float>() == std::vector<float>{132, 133});
  CHECK_FALSE(rows[65].grad().defined());
}

TEST_CASE("gradients summed and multiplied in place never reach a tensor someone else holds") {
  // accumulate() adds into a pending gradient, and linear_gelu's backward multiplies its incoming
  // gradient by GELU's derivative, in place only where nothing else holds that gradient. A
  // caller's output gradient, one gradient handed to both inputs of add, and one a slice shares
  // must each come out unchanged, and every result must equal the out-of-place arithmetic.
  Tensor x = randn({8, 5}, 21).set_requires_grad(), w = randn({5, 6}, 22).set_requires_grad();
  Tensor b = randn({6}, 23).set_requires_grad();
  const Tensor reference = gelu(linear(x.detach(), w.detach(), b.detach()));
  const Tensor grad_out = randn({8, 6}, 24);
  const std::vector<double> grad_out_before = grad_out.to_vector<double>();
  // 1. The caller's gradient of the op's own output.
  linear_gelu(x, w, b).backward(grad_out);
  CHECK(grad_out.to_vector<double>() == grad_out_before);
  const Tensor gx = x.grad().clone(), gw = w.grad().clone();
  x.zero_grad();
  w.zero_grad();
  b.zero_grad();
  {
    const Tensor xr = x.detach().set_requires_grad(), wr = w.detach().set_requires_grad();
    gelu(linear(xr, wr, b.detach())).backward(grad_out);
    CHECK_CLOSE(gx, xr.grad(), 1e-6, 1e-6);
    CHECK_CLOSE(gw, wr.grad(), 1e-6, 1e-6);
  }
  // 2. y + y: add hands one gradient to both sides; the sum of the two is 2 g, then multiplied.
  {
    const Tensor y = linear_gelu(x, w, b);
    (y + y).backward(grad_out);
    CHECK(grad_out.to_vector<double>() == grad_out_before);
    CHECK_CLOSE(x.grad(), gx * 2.0, 1e-5, 1e-5);
  }
  x.zero_grad();
  // 3. Two consumers, one of them a slice, and the sum's operands kept alive by the test.
  {
    const Tensor y = linear_gelu(x, w, b);
    const Tensor kept = y * 1.0;
    const Tensor loss = sum(kept * grad_out) + sum(slice(y, 1, 2, 4) * slice(grad_out, 1, 2, 4)) + sum(y * grad_out);
    loss.backward();
    const Tensor twice = grad_out * 2.0;
    const Tensor expected_grad = slice_assign(twice, 1, 2, 4, slice(twice, 1, 2, 4) + slice(grad_out, 1, 2, 4));
    const Tensor xr = x.detach().set_requires_grad();
    gelu(linear(xr, w.detach(), b.detach())).backward(expected_grad);
    CHECK_CLOSE(x.grad(), xr.grad(), 1e-5, 1e-5);
    CHECK(grad_out.to_vector<double>() == grad_out_before);
  }
  // 4. add's one gradient, pending for both h1 and h2, then another term for h1 alone (its other
  // consumer was created before the add, so its backward runs after): h2's must stay as it was.
  {
    const Tensor x1 = randn({4, 6}, 25).set_requires_grad(), x2 = randn({4, 6}, 26).set_requires_grad();
    const Tensor c = randn({4, 6}, 27), e = randn({4, 6}, 28);
    const Tensor h1 = x1 * 1.0, h2 = x2 * 1.0;
    const Tensor p = h1 * e;
    const Tensor loss = sum((h1 + h2) * c) + sum(p);
    loss.backward();
    CHECK_CLOSE(x2.grad(), c, 0, 0);
    CHECK_CLOSE(x1.grad(), c + e, 1e-6, 1e-6);
  }
  CHECK_CLOSE(linear_gelu(x, w, b).detach(), reference, 1e-6, 1e-6);
}

TEST_CASE("exclusively_owned: only a lone handle on storage no view shares, outside any graph") {
  Tensor t = randn({4, 3}, 1);
  CHECK(autograd::exclusively_owned(t));
  {
    const Tensor copy = t;  // a second handle
    CHECK_FALSE(autograd::exclusively_owned(t));
  }
  CHECK(autograd::exclusively_owned(t));
  {
    const Tensor view = t.slice(0, 1, 2);  // another impl on the same storage
    CHECK_FALSE(autograd::exclusively_owned(t));
    CHECK_FALSE(autograd::exclusively_owned(view));
  }
  const Tensor detached = t.detach();  // detach shares the storage
  CHECK_FALSE(autograd::exclusively_owned(detached));
  Tensor leaf = randn({3}, 2).set_requires_grad();
  Tensor y = leaf * 2.0;  // produced by a graph
  CHECK_FALSE(autograd::exclusively_owned(y));
  CHECK(autograd::exclusively_owned(y.detach().clone()));
}
