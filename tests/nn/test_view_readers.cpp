// Every reader of raw bytes outside the engine gets contiguous data from a strided view, or a
// typed error: parameters, gradients and the optimizers' fused kernels, the losses' targets,
// the data loaders' rows, safetensors files, and the communicators (emulated ranks; the MPI
// communicator shares the same entry points).
#include <ruda/collectives.h>

#include "helpers.h"

using namespace ruda;

namespace {
Tensor transposed(const Tensor& t) { return t.transpose(0, 1); }  // a [n, m] view of an [m, n] tensor
}  // namespace

TEST_CASE("a parameter made from a view holds contiguous values, and so does a gradient set from one") {
  const Tensor base = arange(0, 6).reshape({2, 3});
  nn::Param p(transposed(base));
  CHECK(p.data().is_contiguous());
  CHECK(p.data().shape() == Shape{3, 2});
  CHECK(p.data().to_vector<double>() == transposed(base).to_vector<double>());
  CHECK_FALSE(p.data().shares_storage(base));

  const Tensor g = arange(10, 16).reshape({2, 3});
  p.data().set_grad(transposed(g));
  CHECK(p.grad().is_contiguous());
  CHECK(p.grad().to_vector<double>() == transposed(g).to_vector<double>());
  // The fused Adam step then reads the right bytes: the same as with a contiguous gradient.
  nn::Param q(transposed(base).contiguous());
  q.data().set_grad(transposed(g).contiguous());
  nn::Adam a({p}, {.lr = 0.1}), b({q}, {.lr = 0.1});
  a.step();
  b.step();
  CHECK(p.data().to_vector<double>() == q.data().to_vector<double>());
}

TEST_CASE("losses read strided targets and embeddings strided indices by their logical values") {
  const Tensor logits = randn({4, 5}, 1);
  const Tensor targets = from_vector<std::int64_t>({0, 1, 2, 3, 4, 0, 1, 2}, {4, 2});
  const Tensor column = targets.slice(1, 1, 2).squeeze(1);  // [4] with stride 2: {1, 3, 0, 2}
  CHECK_FALSE(column.is_contiguous());
  CHECK(nn::cross_entropy(logits, column).item() == nn::cross_entropy(logits, column.contiguous()).item());
  CHECK(nn::nll_loss(log_softmax(logits), column).item() ==
        nn::nll_loss(log_softmax(logits), column.contiguous()).item());
  // {0, 6, 12, 3}: the first target out of range is named by its logical position.
  test::check_throws<IndexError>([&] { (void)nn::cross_entropy(logits, (targets * 3).slice(1, 0, 1).squeeze(1)); },
                                 {"cross_entropy", "target 6 at [1]"});
  const Tensor rows = from_vector<std::int64_t>({1, 2, 3, 4, 5, 6}, {3, 2});
  CHECK(nn::take_rows(transposed(rows), from_vector<std::int64_t>({1, 0}, {2})).to_vector<std::int64_t>() ==
        std::vector<std::int64_t>{2, 4, 6, 1, 3, 5});
}

TEST_CASE("safetensors writes a view's logical values") {
  test::TempDir dir;
  const std::string path = dir.str() + "/views.safetensors";
  const Tensor base = arange(0, 12).reshape({3, 4});
  safetensors::write(path,
                     {{"t", transposed(base)}, {"s", base.slice(1, 1, 3)}, {"e", base.slice(0, 0, 1).expand({2, 4})}});
  safetensors::Reader r(path);
  CHECK(r.read("t").to_vector<double>() == transposed(base).to_vector<double>());
  CHECK(r.read("t").shape() == Shape{4, 3});
  CHECK(r.read("s").to_vector<double>() == base.slice(1, 1, 3).to_vector<double>());
  CHECK(r.read("e").to_vector<double>() == std::vector<double>{0, 1, 2, 3, 0, 1, 2, 3});
}

TEST_CASE("blocking collectives gather and reduce a view's values; asynchronous ones and outputs refuse views") {
  run_ranks(2, [](Communicator& comm) {
    const double r = comm.rank();
    const Tensor base = arange(0, 8).reshape({2, 4}) + r;
    const Tensor view = transposed(base);  // [4, 2]
    const Tensor dense = view.contiguous();
    CHECK(comm.all_gather(view).to_vector<double>() == comm.all_gather(dense).to_vector<double>());
    CHECK(comm.reduce_scatter(view).to_vector<double>() == comm.reduce_scatter(dense).to_vector<double>());
    CHECK(comm.all_reduce(view).to_vector<double>() == comm.all_reduce(dense).to_vector<double>());
    CHECK(comm.broadcast(view, 1).to_vector<double>() == comm.broadcast(dense, 1).to_vector<double>());
    Tensor out = empty({8, 2});
    comm.all_gather_into(out, view);
    CHECK(out.to_vector<double>() == comm.all_gather(dense).to_vector<double>());
    test::check_throws<ShapeError>(
        [&] { (void)comm.all_gather_async(view); },
        {"all_gather_async", "rank " + std::to_string(comm.rank()), "non-contiguous", "[4, 2]"});
    test::check_throws<ShapeError>([&] { (void)comm.reduce_scatter_async(view); },
                                   {"reduce_scatter_async", "contiguous()"});
    Tensor wide = empty({8, 4});
    test::check_throws<ShapeError>([&] { comm.all_gather_into(wide.slice(1, 0, 2), dense); },
                                   {"all_gather_into", "output", "non-contiguous"});
  });
}
