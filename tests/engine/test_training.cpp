// End to end: a two-layer MLP trained with plain SGD on a synthetic problem reaches a low loss.
#include "helpers.h"

using namespace ruda;

namespace {
// Cross-entropy of logits [N, C] against i64 labels [N], averaged.
Tensor cross_entropy(const Tensor& logits, const Tensor& labels) {
  return -mean(take_along_axis(log_softmax(logits, 1), labels.unsqueeze(1), 1));
}
}  // namespace

TEST_CASE("two-layer MLP with SGD learns a nonlinear classification") {
  // Three classes by the sign pattern of a random quadratic form of 2-D points (not linearly separable).
  const std::int64_t n = 512;
  const Tensor x = uniform({n, 2}, -1, 1, 1);
  const Tensor r = (x.slice(1, 0, 1) * x.slice(1, 1, 2)).reshape({n});
  const Tensor norm = sum(square(x), {1});
  const Tensor labels =
      where(gt(r, scalar(0.05)), scalar(2.0), where(gt(norm, scalar(0.6)), scalar(1.0), scalar(0.0))).to(DType::i64);

  Tensor w1 = (randn({2, 64}, 2) * 0.7).set_requires_grad();
  Tensor b1 = zeros({64}, Options(DType::f32, nullptr, true));
  Tensor w2 = (randn({64, 3}, 3) * 0.15).set_requires_grad();
  Tensor b2 = zeros({3}, Options(DType::f32, nullptr, true));
  std::vector<Tensor*> params = {&w1, &b1, &w2, &b2};

  double first = 0, last = 0;
  for (int step = 0; step < 1500; ++step) {
    const Tensor loss = cross_entropy(linear(tanh(linear(x, w1, b1)), w2, b2), labels);
    if (step == 0) first = loss.item();
    last = loss.item();
    for (Tensor* p : params) p->zero_grad();
    loss.backward();
    autograd::NoGradGuard guard;
    for (Tensor* p : params) p->add_(p->grad(), -0.5);
  }
  INFO("first loss " << first << ", last loss " << last);
  CHECK(first > 0.9);
  CHECK(last < 0.25);
  const Tensor predicted = argmax(linear(tanh(linear(x, w1, b1)), w2, b2), 1);
  const double accuracy = mean(eq(predicted, labels).to(DType::f32)).item();
  CHECK(accuracy > 0.9);
}
