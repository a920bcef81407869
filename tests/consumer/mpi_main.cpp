// Under mpiexec -n N, built against an installed ruda: each rank trains its part of a batch with a
// sharded Linear layer over MpiCommunicator, and every rank checks its result against the same
// model trained densely on the whole batch in this process. Exits non-zero on any difference.
#include <cmath>
#include <cstdio>

#include <ruda/mpi.h>
#include <ruda/nn.h>

int main(int argc, char** argv) {
  using namespace ruda;
  MpiEnvironment mpi(argc, argv);
  return mpi_abort_on_exception([&] {
    MpiCommunicator comm;
    const int world = comm.world_size(), rank = comm.rank();
    const Tensor x = randn({12 * world, 5}, 1), y = randn({12 * world, 3}, 2);
    auto train = [&](nn::Linear& layer, const Tensor& xs, const Tensor& ys) {
      nn::SGD opt(layer.parameters(), {.lr = 0.1});
      for (int step = 0; step < 5; ++step) {
        const Tensor loss = sum(square(layer.forward(xs) - ys)) / static_cast<double>(x.shape()[0]);
        opt.zero_grad();
        loss.backward();
        opt.step();
      }
    };
    nn::manual_seed(4);
    nn::Linear dense(5, 3);
    train(dense, x, y);
    nn::manual_seed(4);
    nn::Linear sharded(5, 3);
    nn::fully_shard(sharded, comm);
    train(sharded, x.slice(0, rank * 12, rank * 12 + 12), y.slice(0, rank * 12, rank * 12 + 12));
    double worst = 0;
    const auto a = dense.weight.value().to_vector<double>();
    const auto b = autograd::no_grad([&] { return sharded.weight.value(); }).to_vector<double>();
    for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
    std::printf("consumer_mpi: rank %d of %d, largest difference from dense %.3g\n", rank, world, worst);
    return worst < 1e-5 ? 0 : 1;
  });
}
