// Trains a tiny model through the installed headers and libraries, sharded over two emulated
// ranks, and checks that it learned. Exits non-zero otherwise.
#include <cstdio>
#include <mutex>

#include <ruda/nn.h>
#ifdef CONSUMER_HAS_MPI
#include <ruda/mpi.h>
#endif

int main() {
  using namespace ruda;
  const Tensor x = randn({64, 4}, 1);
  const Tensor y = gt(x.slice(1, 0, 1), 0.0).to(DType::i64).reshape({64});
  double first = 0, last = 0;
  std::mutex m;
  run_ranks(2, [&](Communicator& comm) {
    nn::manual_seed(3);
    nn::Sequential model(
        {std::make_shared<nn::Linear>(4, 16), std::make_shared<nn::Tanh>(), std::make_shared<nn::Linear>(16, 2)});
    nn::fully_shard(model, comm);
    nn::AdamW opt(model.parameters(), {.lr = 0.05});
    const Tensor xs = x.slice(0, comm.rank() * 32, comm.rank() * 32 + 32),
                 ys = y.slice(0, comm.rank() * 32, comm.rank() * 32 + 32);
    for (int step = 0; step < 60; ++step) {
      const Tensor loss = nn::cross_entropy(model.forward(xs), ys, {.reduction = nn::LossReduction::sum}) / 64.0;
      const double global = comm.all_reduce(loss.detach()).item();
      if (comm.rank() == 0) {
        std::lock_guard lock(m);
        if (step == 0) first = global;
        last = global;
      }
      opt.zero_grad();
      loss.backward();
      opt.step();
    }
  });
  std::printf("consumer: loss %.4f -> %.4f on backend %s\n", first, last,
              std::string(default_backend().name()).c_str());
  // README's attention call as written, an option struct by designated initializers: built with
  // -Wextra -Werror (AttentionOptions::scale had no initializer, so this warned).
  const Tensor q = randn({1, 2, 8, 4}, 7);
  const Tensor attended = scaled_dot_product_attention(q, q, q, {.causal = true});
  if (attended.shape() != q.shape()) return 1;
  return last < first * 0.5 ? 0 : 1;
}
