#include <algorithm>
#include <cmath>
#include <sstream>

#include <ruda/autograd.h>
#include <ruda/nn/losses.h>
#include <ruda/nn/training.h>
#include <ruda/random.h>
#include <ruda/ruda.h>

namespace ruda::nn {

ClassifierScore evaluate_classifier(UnaryModule& model, Communicator& comm, const IdxImages& test, std::int64_t chunk) {
  if (chunk <= 0) throw ArgumentError("evaluate_classifier: chunk " + std::to_string(chunk) + " is not positive");
  autograd::NoGradGuard guard;
  const std::int64_t n = test.size(), world = comm.world_size(), features = test.rows() * test.cols();
  // Every rank must hold the same set: each took its share of its own size and divided by it, so
  // sets of other sizes gave each rank another "global" score (samples counted twice or never).
  // Sizes agreed first (an all-gather), so that all raise alike.
  const auto sizes =
      comm.all_gather(from_vector<std::int64_t>({n}, {1}), {.tag = "evaluate_classifier: test set sizes"})
          .to_vector<std::int64_t>();
  for (std::size_t r = 0; r < sizes.size(); ++r) {
    if (sizes[r] != sizes[0]) {
      throw ArgumentError("evaluate_classifier: rank " + std::to_string(comm.rank()) +
                          ": the ranks' test sets differ: rank 0 holds " + std::to_string(sizes[0]) +
                          " samples, rank " + std::to_string(r) + " " + std::to_string(sizes[r]) +
                          " (every rank passes the whole test set; each scores its share)");
    }
  }
  // (Every rank holds the same set: all raise alike.) The scores divided by 0 were NaN.
  if (n == 0) throw ArgumentError("evaluate_classifier: the test set is empty");
  const std::int64_t share = (n + world - 1) / world, mine = comm.rank() * share;
  double correct = 0, loss_sum = 0;
  for (std::int64_t first = 0; first < share; first += chunk) {
    const std::int64_t rows = std::min(chunk, share - first);
    // This pass's rows of the set: [lo, hi), fewer than `rows` (or none) at its end.
    const std::int64_t lo = std::min(n, mine + first), hi = std::min(n, mine + first + rows);
    Tensor x = hi > lo ? test.images(lo, hi) : Tensor();
    if (hi - lo < rows) {
      const Tensor padding = zeros({rows - (hi - lo), features});
      x = x.defined() ? concat({x, padding}, 0) : padding;
    }
    const Tensor logits = cast(model.forward(x), DType::f32);
    if (logits.ndim() != 2 || logits.shape()[0] != rows) {
      throw ShapeError("evaluate_classifier: the model gave " + to_string(logits.shape()) + " for " +
                       std::to_string(rows) + " samples, not logits [" + std::to_string(rows) + ", classes]");
    }
    if (hi > lo) {
      const Tensor real = logits.slice(0, 0, hi - lo);
      const Tensor labels = test.labels(lo, hi);
      correct += sum(eq(argmax(real, 1), labels).to(DType::f64)).item();
      loss_sum += cross_entropy(real, labels, {.reduction = LossReduction::sum}).item();
    }
  }
  const auto totals = comm.all_reduce(from_values({correct, loss_sum}, {2}, DType::f64)).to_vector<double>();
  return {totals[0] / static_cast<double>(n), totals[1] / static_cast<double>(n)};
}

TextWindows::TextWindows(TextCorpus corpus, std::int64_t begin, std::int64_t end, std::int64_t context)
    : corpus_(std::move(corpus)), begin_(begin), end_(end), context_(context) {
  // One window needs context + 1 bytes (its inputs and, shifted by one, its targets); it asked
  // for context + 2, one byte more than any window reads. end - begin - 1 < context, not
  // end - begin < context + 1: a context near INT64_MAX would wrap.
  // Each refusal says its own reason ("too few bytes for windows of context 0" named the bytes
  // for a context that was the problem).
  const std::string range = "bytes [" + std::to_string(begin) + ", " + std::to_string(end) + ")";
  if (context <= 0) throw ArgumentError("TextWindows: context " + std::to_string(context) + " is not positive");
  if (begin < 0 || end > corpus_.size() || end < begin) {
    throw ArgumentError("TextWindows: " + range + " is no range of the corpus's " + std::to_string(corpus_.size()) +
                        " bytes");
  }
  if (end - begin - 1 < context) {
    throw ArgumentError("TextWindows: " + range + " of " + std::to_string(corpus_.size()) +
                        " are too few for windows of context " + std::to_string(context) + " (it needs context + 1)");
  }
}

std::pair<Tensor, Tensor> TextWindows::batch(std::uint64_t seed, std::int64_t step, std::int64_t global_batch, int rank,
                                             int world_size) {
  if (world_size <= 0 || global_batch <= 0 || global_batch % world_size != 0) {
    throw ArgumentError("TextWindows::batch: a global batch of " + std::to_string(global_batch) +
                        " windows does not divide over " + std::to_string(world_size) + " ranks");
  }
  if (rank < 0 || rank >= world_size) {
    throw ArgumentError("TextWindows::batch: rank " + std::to_string(rank) + " is outside a world of " +
                        std::to_string(world_size));
  }
  // The windows' stream positions step * global_batch + rank * local + i, counted without overflow
  // (signed overflow is undefined: a large step gave whatever the compiler made of it).
  std::int64_t first = 0;
  if (step < 0 || __builtin_mul_overflow(step, global_batch, &first) ||
      __builtin_add_overflow(first, global_batch, &first)) {
    throw ArgumentError("TextWindows::batch: step " + std::to_string(step) + " of " + std::to_string(global_batch) +
                        " windows is negative or past the stream's 2^63 positions");
  }
  first -= global_batch;
  const std::int64_t local = global_batch / world_size, t = context_;
  std::int64_t tokens = 0;
  if (__builtin_mul_overflow(local, t + 1, &tokens)) {
    throw ShapeError("TextWindows::batch: a local batch of " + std::to_string(local) + " windows of " +
                     std::to_string(t) + " bytes has more tokens than int64 counts");
  }
  // The batch's tokens as tensors from the start: sized and counted by the tensor allocator (a
  // typed error, under any memory limit, for a batch too large), not a std::vector's bad_alloc.
  Tensor x = empty({local, t}, DType::i64), y = empty({local, t}, DType::i64);
  auto* xp = static_cast<std::int64_t*>(x.data_ptr());
  auto* yp = static_cast<std::int64_t*>(y.data_ptr());
  std::vector<std::uint8_t> window(static_cast<std::size_t>(t + 1));
  for (std::int64_t i = 0; i < local; ++i) {
    const std::int64_t index = first + rank * local + i;
    const double u = random::uniform_double(seed, static_cast<std::uint64_t>(index));
    // Any start whose t + 1 bytes lie in [begin, end): end - begin - t of them (the last byte was
    // never read when the draw left one start out, and a range of context + 2 gave one window).
    const std::int64_t starts = end_ - begin_ - t;
    // (min: a u just below 1 may round the product up to `starts` itself.)
    const std::int64_t pos = begin_ + std::min(starts - 1, static_cast<std::int64_t>(u * static_cast<double>(starts)));
    corpus_.read(pos, t + 1, window.data());
    bytes_read_ += t + 1;
    std::copy(window.begin(), window.end() - 1, xp + i * t);
    std::copy(window.begin() + 1, window.end(), yp + i * t);
  }
  return {x, y};
}

std::string sample_bytes(UnaryModule& model, const std::string& prompt, std::int64_t count, std::int64_t context,
                         double temperature, std::uint64_t seed) {
  if (context <= 0) throw ArgumentError("sample_bytes: context " + std::to_string(context) + " is not positive");
  if (count < 0) throw ArgumentError("sample_bytes: count " + std::to_string(count) + " is negative");
  // 0 (or less) samples greedily; otherwise the logits are divided by it in f32, so it must be a
  // finite number whose quotient stays finite (NaN, or 1e-40 rounding to 0 in f32, gave NaN
  // probabilities and a text of 0xFF bytes).
  if (std::isnan(temperature) || (temperature > 0 && !(temperature >= 1e-30 && std::isfinite(temperature)))) {
    std::ostringstream shown;  // (std::to_string printed 1e-31 as 0.000000)
    shown << temperature;
    throw ArgumentError("sample_bytes: temperature " + shown.str() +
                        " is not a finite number >= 1e-30 (or <= 0 for greedy sampling)");
  }
  autograd::NoGradGuard guard;
  std::vector<std::int64_t> tokens;
  for (char c : prompt) tokens.push_back(static_cast<unsigned char>(c));
  if (tokens.empty()) tokens.push_back('\n');
  std::string out;
  for (std::int64_t i = 0; i < count; ++i) {
    const std::int64_t from = std::max<std::int64_t>(0, static_cast<std::int64_t>(tokens.size()) - context);
    const std::vector<std::int64_t> window(tokens.begin() + from, tokens.end());
    const std::int64_t t = static_cast<std::int64_t>(window.size());
    const Tensor all = model.forward(from_vector(window, {1, t}));
    if (all.shape() != Shape{1, t, 256}) {
      throw ShapeError("sample_bytes: the model gave logits " + to_string(all.shape()) + " for tokens [1, " +
                       std::to_string(t) + "], not [1, " + std::to_string(t) + ", 256]");
    }
    const Tensor logits = cast(all, DType::f32).slice(1, t - 1, t).reshape({256});
    std::int64_t next = 255;
    if (temperature <= 0) {
      // Greedy takes the largest logit; a NaN among them (which argmax returns) is no choice.
      const auto l = logits.to_vector<double>();
      if (std::any_of(l.begin(), l.end(), [](double v) { return std::isnan(v); })) {
        throw ArgumentError("sample_bytes: the model's logits hold NaN at byte " + std::to_string(i));
      }
      next = static_cast<std::int64_t>(argmax(logits, 0).item());
    } else {
      const auto p = softmax(logits / temperature, 0).to_vector<double>();
      if (!std::all_of(p.begin(), p.end(), [](double v) { return std::isfinite(v); })) {  // NaN or inf logits
        throw ArgumentError("sample_bytes: the model's logits give no probabilities (not finite) at byte " +
                            std::to_string(i));
      }
      const double u = random::uniform_double(seed, static_cast<std::uint64_t>(i));
      double acc = 0;
      for (int k = 0; k < 256; ++k) {
        acc += p[static_cast<std::size_t>(k)];
        if (u < acc) {
          next = k;
          break;
        }
      }
    }
    tokens.push_back(next);
    out.push_back(static_cast<char>(next));
  }
  return out;
}

}  // namespace ruda::nn
