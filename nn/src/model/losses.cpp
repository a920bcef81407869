#include <cmath>
#include <limits>

#include <ruda/autograd.h>
#include <ruda/nn/losses.h>

namespace ruda::nn {

namespace {

Tensor reduce(const Tensor& loss, LossReduction reduction) {
  switch (reduction) {
    case LossReduction::mean:
      return mean(loss);
    case LossReduction::sum:
      return sum(loss);
    case LossReduction::none:
      return loss;
  }
  return loss;
}

// An elementwise loss's input and target: float, one dtype, one shape, named as the loss (not as
// the sub or mul inside it that would otherwise refuse them).
void check_same_shape(const char* op, const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined()) fail<ArgumentError>(op, "got an undefined tensor");
  if (!is_floating(a.dtype()) || b.dtype() != a.dtype()) {
    fail<DTypeError>(op, "input and target must share one floating-point dtype, got input ", dtype_name(a.dtype()), " ",
                     a.shape(), " and target ", dtype_name(b.dtype()), " ", b.shape());
  }
  if (a.shape() != b.shape()) fail<ShapeError>(op, "input ", a.shape(), " and target ", b.shape(), " differ");
}

}  // namespace

Tensor mse_loss(const Tensor& input, const Tensor& target, LossReduction reduction) {
  check_enum(reduction, "mse_loss", "LossReduction");
  check_same_shape("mse_loss", input, target);
  return reduce(square(input - target), reduction);
}

Tensor l1_loss(const Tensor& input, const Tensor& target, LossReduction reduction) {
  check_enum(reduction, "l1_loss", "LossReduction");
  check_same_shape("l1_loss", input, target);
  return reduce(abs(input - target), reduction);
}

namespace {
// Every target is a class index in [0, classes) or the ignore_index: found here, named as the
// caller's op, rather than as an index error deep in take_along_axis.
void check_targets(const char* op, const Tensor& targets, std::int64_t classes, std::int64_t ignore_index) {
  const Tensor logical = targets.contiguous();  // a strided view's values in row-major order
  const std::int64_t* t = logical.data<std::int64_t>();
  for (std::int64_t i = 0; i < targets.numel(); ++i) {
    if (t[i] == ignore_index || (t[i] >= 0 && t[i] < classes)) continue;
    Shape at(targets.shape().size());
    for (std::int64_t rest = i, d = static_cast<std::int64_t>(at.size()) - 1; d >= 0; --d) {
      at[d] = rest % targets.shape()[d];
      rest /= targets.shape()[d];
    }
    fail<IndexError>(op, "target ", t[i], " at ", at, " of targets ", targets.shape(), " is outside the ", classes,
                     " classes [0, ", classes, ") (ignore_index is ", ignore_index, ")");
  }
}

// ignore_index as an i64 scalar, exactly (through a double, indices past 2^53 round, and
// INT64_MAX is refused as no i64 value).
Tensor ignore_scalar(std::int64_t ignore_index) {
  return from_vector<std::int64_t>({ignore_index}, {}, Options(DType::i64));
}

// `input` names what the caller passed (cross_entropy's logits, nll_loss's log-probabilities).
Tensor nll(const char* op, const char* input, const Tensor& log_probs, const Tensor& targets,
           const CrossEntropyOptions& options) {
  if (!log_probs.defined() || !targets.defined()) fail<ArgumentError>(op, "got an undefined tensor");
  check_enum(options.reduction, op, "LossReduction");
  // 1 included, as PyTorch's: the loss is then the smoothing term alone.
  if (!(options.label_smoothing >= 0.0 && options.label_smoothing <= 1.0)) {
    fail<ArgumentError>(op, "label_smoothing must be in [0, 1], got ", options.label_smoothing);
  }
  if (targets.dtype() != DType::i64) {
    fail<DTypeError>(op, "targets must be i64 class indices, got ", dtype_name(targets.dtype()), " ", targets.shape());
  }
  if (!is_floating(log_probs.dtype())) {
    fail<DTypeError>(op, input, " must be floating point, got ", dtype_name(log_probs.dtype()), " ", log_probs.shape());
  }
  if (log_probs.ndim() < 1) fail<ShapeError>(op, input, " need a class axis (the last), got ", log_probs.shape());
  const Shape expected(log_probs.shape().begin(), log_probs.shape().end() - 1);
  if (targets.shape() != expected) {
    fail<ShapeError>(op, "targets ", targets.shape(), " do not match ", input, " ", log_probs.shape(), " (expected ",
                     expected, ")");
  }
  if (options.weight.defined() && !is_floating(options.weight.dtype())) {
    fail<DTypeError>(op, "class weights must be floating point, got ", dtype_name(options.weight.dtype()), " ",
                     options.weight.shape());
  }
  if (options.weight.defined() && options.weight.requires_grad() && autograd::is_grad_enabled()) {
    // They are constants of the loss: a gradient for them would be silently missing.
    fail<ArgumentError>(op, "class weights ", options.weight.shape(),
                        " require grad, but the loss takes no gradient for them; pass weight.detach()");
  }
  const std::int64_t classes = log_probs.shape().back();
  check_targets(op, targets, classes, options.ignore_index);
  const DType dtype = log_probs.dtype();
  Options like(dtype, &log_probs.backend());

  // Ignored targets pick class 0 and are selected out. With no class at all, every target is
  // ignored (check_targets refused any other), and there is no class 0 to pick: the picked value
  // is the empty sum, 0, which keeps the graph to log_probs (a [N, 0] gradient).
  const Tensor keep = ne(targets, ignore_scalar(options.ignore_index));
  const Tensor safe = where(keep, targets, zeros({}, DType::i64));
  const Tensor keep_f = cast(keep, dtype);
  const Tensor none = zeros({}, like);
  if (options.weight.defined() && options.weight.shape() != Shape{classes}) {
    fail<ShapeError>(op, "class weights ", options.weight.shape(), " do not match ", classes, " classes");
  }
  // The ignored rows' weight is selected out too, not multiplied by 0: class 0's weight may be inf
  // or NaN (an inverse frequency of a padding class never seen), and inf * 0 made the loss NaN.
  const Tensor target_weight =
      options.weight.defined() && classes > 0
          ? where(
                keep,
                reshape(embedding(reshape(cast(options.weight, dtype).detach(), {classes, 1}), safe), targets.shape()),
                none)
          : keep_f;
  // Ignored rows are selected out, never multiplied by 0: their log-probabilities may be -inf or
  // NaN (logits masked with -inf in a padded batch), and -inf * 0 made the whole loss NaN where
  // PyTorch's (which skips them) is finite. The selection also passes them no gradient.
  const Tensor picked =
      classes > 0 ? squeeze(take_along_axis(log_probs, unsqueeze(safe, -1), -1), -1) : sum(log_probs, {-1});
  const Tensor nll_rows = where(keep, -(picked * target_weight), none);
  Tensor loss = nll_rows, smooth;
  if (options.label_smoothing > 0.0) {
    const Tensor class_weight = options.weight.defined() ? cast(options.weight, dtype).detach() : ones({classes}, like);
    // The classes' mean in f32 for 16-bit log-probabilities (an f16 sum over many classes is
    // infinite), as the mean reduction below.
    const Tensor weighted = log_probs * class_weight;
    const Tensor class_mean = is_16bit_float(dtype)
                                  ? cast(sum(cast(weighted, DType::f32), {-1}) / static_cast<double>(classes), dtype)
                                  : sum(weighted, {-1}) / static_cast<double>(classes);
    smooth = where(keep, -class_mean, none);
    loss = loss * (1.0 - options.label_smoothing) + smooth * options.label_smoothing;
  }
  switch (options.reduction) {
    case LossReduction::none:
      return loss;
    case LossReduction::sum:
      return sum(loss);
    case LossReduction::mean: {
      // 16-bit losses are summed and divided in f32, then rounded once (an f16 sum or count
      // past 65504 is infinite).
      const DType acc = is_16bit_float(dtype) ? DType::f32 : dtype;
      const Tensor total = sum(cast(target_weight, acc)).detach();
      Tensor mean_loss;
      if (total.item() != 0) {
        mean_loss = sum(cast(loss, acc)) / total;
      } else if (sum(keep_f).item() == 0) {
        // Every target ignored: the loss is NaN (0 / 0) as in PyTorch, but its gradient must be 0,
        // as PyTorch's, not 1 / 0 times the mask's 0s (NaN), which an optimizer step would spread
        // over every parameter: the sum times 0, plus a NaN that carries no gradient.
        mean_loss = sum(cast(loss, acc)) * 0.0 + std::numeric_limits<double>::quiet_NaN();
      } else {
        // Kept targets whose class weights sum to 0 (negative weights): PyTorch divides by 0, so
        // its loss is NaN where the sum is 0 too and an infinity of the sum's sign otherwise, and
        // with label smoothing it divides the two terms' sums apart (inf - inf is NaN). Its
        // gradient is NaN or infinite on the kept rows (their weight times 1 / 0) and 0 on the
        // ignored ones: the select that made `loss` keeps the ignored rows' 1 / 0 from reaching them.
        mean_loss = smooth.defined() ? sum(cast(nll_rows, acc)) * (1.0 - options.label_smoothing) / total +
                                           sum(cast(smooth, acc)) * options.label_smoothing / total
                                     : sum(cast(loss, acc)) / total;
      }
      return acc == dtype ? mean_loss : cast(mean_loss, dtype);
    }
  }
  return loss;
}

}  // namespace

Tensor nll_loss(const Tensor& log_probs, const Tensor& targets, const CrossEntropyOptions& options) {
  return nll("nll_loss", "log-probabilities", log_probs, targets, options);
}

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, const CrossEntropyOptions& options) {
  if (!logits.defined()) fail<ArgumentError>("cross_entropy", "got an undefined tensor");
  if (!is_floating(logits.dtype())) {
    fail<DTypeError>("cross_entropy", "logits must be floating-point, got ", dtype_name(logits.dtype()), " ",
                     logits.shape());
  }
  // An ignored row passes no gradient, as README promises for padded batches, even one that is
  // all -inf or NaN: log_softmax's backward of such a row is 0 - NaN * 0 however the loss selects
  // it out (PyTorch's is NaN there). Such rows are zeroed before it, a pass over the logits taken
  // only when some target is ignored (and when the targets are valid: nll checks them first).
  if (logits.ndim() >= 1 && logits.shape().back() > 0 && targets.defined() && targets.dtype() == DType::i64 &&
      targets.shape() == Shape(logits.shape().begin(), logits.shape().end() - 1)) {
    const Tensor ignored = eq(targets, ignore_scalar(options.ignore_index));
    if (sum(cast(ignored, DType::i64)).item() > 0) {
      check_targets("cross_entropy", targets, logits.shape().back(), options.ignore_index);
      return nll(
          "cross_entropy", "logits",
          log_softmax(where(unsqueeze(ignored, -1), zeros({}, Options(logits.dtype(), &logits.backend())), logits), -1),
          targets, options);
    }
  }
  return nll("cross_entropy", "logits", log_softmax(logits, -1), targets, options);
}

namespace {
// Whether a tensor of shape `from` broadcasts to `to` without widening it (numpy's rules, one way).
bool broadcasts_to(const Shape& from, const Shape& to) {
  if (from.size() > to.size()) return false;
  for (std::size_t i = 1; i <= from.size(); ++i) {
    const std::int64_t f = from[from.size() - i], t = to[to.size() - i];
    if (f != t && f != 1) return false;
  }
  return true;
}
}  // namespace

Tensor binary_cross_entropy_with_logits(const Tensor& logits, const Tensor& targets, LossReduction reduction,
                                        const Tensor& pos_weight) {
  check_enum(reduction, "binary_cross_entropy_with_logits", "LossReduction");
  check_same_shape("binary_cross_entropy_with_logits", logits, targets);
  // (1 - t) x + w_t softplus(-x), with w_t = 1 + (pos_weight - 1) t: stable for any logit. The
  // softplus without its threshold (PyTorch's softplus is z past 20, which dropped the
  // log1p(exp(x)) tail below x = -20: a loss of 0 for x = -25, t = 0, not 1.4e-11): z + log1p(e^-z)
  // above 0, log1p(e^z) at and below, neither near a threshold.
  Tensor log_weight = ones({}, Options(logits.dtype(), &logits.backend()));
  if (pos_weight.defined()) {
    if (pos_weight.dtype() != logits.dtype()) {
      fail<DTypeError>("binary_cross_entropy_with_logits", "pos_weight ", dtype_name(pos_weight.dtype()), " ",
                       pos_weight.shape(), " must have the logits' dtype ", dtype_name(logits.dtype()));
    }
    // It weighs the logits' elements: it must broadcast to their shape, not widen it ([2, 2, 4]
    // against [2, 4] logits would turn the loss into [2, 2, 4] and its mean into one over 16).
    if (!broadcasts_to(pos_weight.shape(), logits.shape())) {
      fail<ShapeError>("binary_cross_entropy_with_logits", "pos_weight ", pos_weight.shape(),
                       " does not broadcast to the logits' shape ", logits.shape());
    }
    log_weight = (pos_weight - 1.0) * targets + 1.0;
  }
  const Tensor z = -logits;
  const Tensor softplus_z = where(gt(z, 0.0), z + softplus(-z), softplus(z));
  const Tensor loss = (1.0 - targets) * logits + log_weight * softplus_z;
  return reduce(loss, reduction);
}

double global_count(Communicator& comm, double local) {
  autograd::NoGradGuard guard;
  // A count below zero or not finite would divide every rank's loss by a wrong total (-1 on one
  // rank and 1 on another: by 0). Its flag travels with the counts, so every rank raises alike
  // instead of the others waiting in the collective for the one that raised.
  const bool bad = !std::isfinite(local) || local < 0;
  const std::vector<double> both = comm.all_reduce(from_values({bad ? 0.0 : local, bad ? 1.0 : 0.0}, {2}, DType::f64),
                                                   Reduction::sum, {.tag = "global_count"})
                                       .to_vector<double>();
  if (both[1] > 0) {
    fail<ArgumentError>("global_count", "rank ", comm.rank(), ": ", static_cast<std::int64_t>(both[1]),
                        " rank(s) passed a local count that is negative or not finite (this rank: ", local, ")");
  }
  // Finite counts whose sum is not (1e308 on two ranks): the loss would be divided by inf. Every
  // rank holds the same sum, so every rank raises alike.
  if (!std::isfinite(both[0])) {
    fail<ArgumentError>("global_count", "rank ", comm.rank(), ": the ranks' local counts (this rank: ", local,
                        ") sum to ", both[0]);
  }
  return both[0];
}

std::int64_t counted_targets(const Tensor& targets, std::int64_t ignore_index) {
  if (!targets.defined()) fail<ArgumentError>("counted_targets", "got an undefined tensor");
  if (targets.dtype() != DType::i64) {
    fail<DTypeError>("counted_targets", "targets must be i64 class indices, got ", dtype_name(targets.dtype()), " ",
                     targets.shape());
  }
  autograd::NoGradGuard guard;
  return static_cast<std::int64_t>(sum(ne(targets, ignore_scalar(ignore_index)).to(DType::i64)).item());
}

}  // namespace ruda::nn
