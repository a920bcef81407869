// Pieces of a data-parallel training job that every rank runs in step with the others: scoring a
// classifier on a test set shared out over the ranks, the data stream of a byte-level language
// model, and sampling text from one. Each is collective where a sharded model makes it so (its
// forward passes gather weights), and gives every rank the same result.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include <ruda/collectives.h>
#include <ruda/nn/data.h>
#include <ruda/nn/module.h>

namespace ruda::nn {

struct ClassifierScore {
  double accuracy = 0;  // over the whole test set
  double loss = 0;      // mean cross-entropy per sample
};

/// Scores `model` (images [N, rows * cols] to logits [N, classes]) on every sample of `test`. Each
/// rank takes an equal share, ceil(size / world) rows, in forward passes of at most `chunk` rows;
/// the share past the end of the set is zero rows that are not counted. So every rank runs the
/// same number of forward passes of the same shapes, and a sharded model's gathers stay in step.
/// Runs without gradients and returns the global figures on every rank. Collective.
ClassifierScore evaluate_classifier(UnaryModule& model, Communicator& comm, const IdxImages& test, std::int64_t chunk);

/// The windows a byte-level language model trains on: context + 1 bytes of the corpus range
/// [begin, end), window i of a step at a position drawn from stream `seed` at index
/// step * global_batch + i. Any rank can compute any window, so rank r takes windows
/// [r * local, (r + 1) * local) of each step, and a run resumed at step s reads what the
/// uninterrupted run read there.
class TextWindows {
 public:
  /// ArgumentError unless 0 <= begin, end <= corpus.size() and the range holds context + 1 bytes (one window).
  TextWindows(TextCorpus corpus, std::int64_t begin, std::int64_t end, std::int64_t context);
  /// This rank's part of step `step`'s global batch: tokens and next-byte targets, both i64
  /// [global_batch / world_size, context]. ArgumentError unless world_size divides global_batch.
  std::pair<Tensor, Tensor> batch(std::uint64_t seed, std::int64_t step, std::int64_t global_batch, int rank,
                                  int world_size);
  std::int64_t context() const noexcept { return context_; }
  /// Bytes read from the corpus by this object so far.
  std::int64_t bytes_read() const noexcept { return bytes_read_; }

 private:
  TextCorpus corpus_;
  std::int64_t begin_, end_, context_, bytes_read_ = 0;
};

/// Continues `prompt` by `count` bytes from a byte-level language model (tokens i64 [1, t] to
/// logits [1, t, 256]), feeding back at most `context` bytes: the likeliest byte at temperature 0,
/// else one drawn from the softmax at `temperature` with stream `seed`. Every rank draws the same
/// bytes from the same logits, so call it on every rank of a sharded model. Put the model in eval
/// mode first for sampling without dropout. Runs without gradients; ShapeError for other logits,
/// ArgumentError for a negative count, a NaN temperature or one in (0, 1e-30) or infinite, and
/// logits that give no probabilities: NaN ones, or (sampling) +inf. -inf logits mask their bytes.
std::string sample_bytes(UnaryModule& model, const std::string& prompt, std::int64_t count, std::int64_t context,
                         double temperature, std::uint64_t seed);

}  // namespace ruda::nn
