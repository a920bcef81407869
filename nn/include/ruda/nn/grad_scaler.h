// Dynamic loss scaling for f16 compute (PyTorch's torch.amp.GradScaler): the loss is multiplied
// by a large scale before backward, so that gradients below f16's smallest values (6e-8; 6e-5
// at full precision) survive the f16 activations, and divided out of the f32 gradients before the
// optimizer steps. A step whose gradients hold an inf or NaN (the scale was too large) is skipped
// and the scale halved; after growth_interval clean steps it doubles. bf16 has f32's range and
// needs none.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>

#include <ruda/collectives.h>
#include <ruda/nn/optim.h>

namespace ruda::nn {

struct GradScalerOptions {
  /// In [GradScaler::kMinScale, GradScaler::kMaxScale].
  double init_scale = 65536.0;
  double growth_factor = 2.0;   // > 1
  double backoff_factor = 0.5;  // in (0, 1)
  std::int64_t growth_interval = 2000;
  /// Off: scale() returns the loss, unscale_ does nothing and step() always steps (one code path
  /// for f16 and other runs, as PyTorch's enabled=False).
  bool enabled = true;
};

/// The loop, as PyTorch's:
///
///     scaler.scale(loss).backward();
///     scaler.unscale_(optimizer, &comm);            // optional: before clip_grad_norm
///     clip_grad_norm(optimizer.params(), 1.0, &comm);
///     bool stepped = scaler.step(optimizer, &comm);  // skipped where a gradient is not finite
///     scaler.update();
///
/// Sharded gradients: each rank checks its own slices, and the ranks agree (one small all-reduce
/// over each communicator the parameters are sharded over, and over `comm` when given), so that
/// every rank skips the same steps; dense gradients are the same on every rank once all-reduced.
/// Sharded parameters need a communicator (their own, set by fully_shard, or `comm`: a
/// ShardingError otherwise, as for the gradient norms). A rank that fails while unscaling (out of
/// memory) still joins the agreement: it raises its error and the others a RankFailedError, no
/// rank steps, and update() backs off. Gradients must not be f16 (a DTypeError, as PyTorch's):
/// unscaled in f16, the small values the scale kept would vanish again. Keep f32 parameters and
/// compute in f16 (ShardPolicy::compute_dtype): the gradients arrive in f32. One scaler per rank
/// (emulated ranks: per thread), used with the same optimizer objects from scale() to update().
class GradScaler {
 public:
  /// The scale stays within f32's normal range, as PyTorch's (an f32 tensor) does: there both it
  /// and its reciprocal are finite. Backoff stops at kMinScale (below it 1/scale overflowed f32,
  /// every gradient became inf or NaN, every step was skipped for good, and a scale of 0 was saved);
  /// growth stops at kMaxScale.
  static constexpr double kMinScale = 1.1754943508222875e-38;  // FLT_MIN
  static constexpr double kMaxScale = 3.4028234663852886e38;   // FLT_MAX

  explicit GradScaler(GradScalerOptions options = {});

  /// loss times the scale (a new tensor; the loss's dtype).
  Tensor scale(const Tensor& loss) const;
  /// Divides the gradients of `optimizer`'s parameters by the scale, in place, and records whether
  /// any is then inf or NaN, agreed over the ranks. Once per optimizer between update()s (an
  /// ArgumentError the second time: the gradients would be divided twice).
  void unscale_(Optimizer& optimizer, Communicator* comm = nullptr);
  /// unscale_ unless it ran, then optimizer.step() unless a gradient was inf or NaN. Returns
  /// whether it stepped. Once per optimizer between update()s. An ArgumentError, as PyTorch's, where
  /// no parameter of the optimizer has a gradient (no backward ran on the scaled loss), and where a
  /// backward ran on this thread after this optimizer's unscale_() or it holds other parameters
  /// than then (an iteration abandoned after unscale_, by an exception, say: its unscaled gradients
  /// plus the next backward's scaled ones were stepped on as if unscaled, 1024x the update at the
  /// default scale). unscale_() comes after the iteration's last backward, as PyTorch requires;
  /// end an abandoned iteration with update().
  bool step(Optimizer& optimizer, Communicator* comm = nullptr);
  /// After the iteration's step()s: halves the scale (backoff_factor) if any of them found an
  /// inf or NaN, else counts a clean step and grows it after growth_interval of them (kept if the
  /// product would not be finite). ArgumentError if no unscale_ or step ran since the last one.
  void update();

  double scale_value() const noexcept { return scale_; }
  /// Clean steps since the scale last changed.
  std::int64_t growth_tracker() const noexcept { return growth_tracker_; }
  bool enabled() const noexcept { return options_.enabled; }
  const GradScalerOptions& options() const noexcept { return options_; }

  /// The keys of state() in a checkpoint's extra state.
  static constexpr const char* kScaleKey = "grad_scaler.scale";
  static constexpr const char* kTrackerKey = "grad_scaler.growth_tracker";
  /// The scale and growth tracker as checkpoint extra state (kScaleKey, kTrackerKey; the scale
  /// written so that it reads back exactly), to merge into save_checkpoint's `extra`.
  std::map<std::string, std::string> state() const;
  /// Restores them from a checkpoint's extra state. A checkpoint without them (saved without a
  /// scaler) leaves this scaler as it is; malformed or out-of-range values are an IOError naming
  /// the key. Only between iterations (ArgumentError after an unscale_ or step not yet updated).
  void load_state(const std::map<std::string, std::string>& extra);

 private:
  enum class Stage { unscaled, stepped, failed };
  struct Seen {
    Stage stage;
    bool found_inf;
    std::uint64_t backward = 0;   // autograd::backward_serial() at unscale_
    std::vector<ParamId> params;  // the optimizer's then
  };
  Seen& unscale_once(Optimizer& optimizer, Communicator* comm, const char* op);

  GradScalerOptions options_;
  double scale_;
  std::int64_t growth_tracker_ = 0;
  std::unordered_map<const Optimizer*, Seen> seen_;  // this iteration's optimizers
};

}  // namespace ruda::nn
