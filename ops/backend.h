// The narrow op interface: every kernel a layer, loss or optimizer needs, once per device kind.
// ops/cpu/ implements it with Eigen; ops/cuda/ with cuDNN, cuBLAS and small kernels. A replica
// gets its backend from its device at run time (backend_for), so both live in one binary.
#pragma once
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/memory_pool.h"
#include "core/tensor.h"

namespace replica::ops {

// Geometry of a 2-D convolution on NHWC input [N,H,W,C] with KRSC filters [K,R,S,C/groups]
// giving [N,P,Q,K]. With groups G > 1 (ResNeXt), output channels [g K/G, (g+1) K/G) see only
// input channels [g C/G, (g+1) C/G), PyTorch's `groups`.
struct ConvGeom {
  int64_t N = 0, H = 0, W = 0, C = 0;
  int64_t K = 0, R = 0, S = 0;
  int64_t stride = 1, pad = 0;
  int64_t P = 0, Q = 0;
  int64_t groups = 1;
  int64_t filter_channels() const { return C / groups; }
  // Fills P and Q, validating (C and K divisible by groups); `who` names the layer in errors.
  static ConvGeom make(const Shape& x, int64_t K, int64_t R, int64_t S, int64_t stride,
                       int64_t pad, const std::string& who, int64_t groups = 1);
};

struct PoolGeom {
  int64_t N = 0, H = 0, W = 0, C = 0, window = 3, stride = 2, pad = 1, P = 0, Q = 0;
  static PoolGeom make(const Shape& x, int64_t window, int64_t stride, int64_t pad,
                       const std::string& who);
};

// Sums a float buffer across replicas in place (sync batch-norm); empty when not synchronized.
// On a GPU the sum is ordered on the compute stream (no host round trip), so the buffer may only
// be read by later work on that stream.
using AllReduceFn = std::function<void(float* data, size_t n)>;

// The flat parameter buffer's slots start on kParamChunk-element boundaries (nn::Model), so each
// chunk of kParamChunk elements belongs to one parameter: a table with one entry per chunk says
// what each element's group takes (decay or not, which trust ratio), and an optimizer updates
// every group in one pass instead of one call per group. `table` covers the whole flat buffer
// (entry c: elements [c * kParamChunk, (c + 1) * kParamChunk)); the tensors handed to an update
// start at flat element `base` (an optimizer's shard: its range_lo).
constexpr int64_t kParamChunk = 16;
struct ChunkClasses {
  Tensor table;
  int64_t base = 0;
};
// Throws ShapeError naming `who` unless `c` is undefined (allowed only when !required) or a
// `dtype` table on p's device covering the chunks of flat elements [c.base, c.base + n).
void check_chunk_classes(const ChunkClasses& c, const Tensor& p, DType dtype, bool required, const char* who);
// Throws ShapeError naming `who` unless `gate` is undefined or an f32 tensor on p's device.
void check_gate(const Tensor& gate, const Tensor& p, const char* who);
// The other arguments every backend checks the same way, each a ShapeError naming the op:
// the updates' 16-bit copy (undefined, or f16 / bf16 of p's size); scale_by's factor (an f32
// value on y's device); step_gate's indices (check_step_gate_at, below the class).
void check_copy(const Tensor& copy, const Tensor& p, const char* who);
void check_factor(const Tensor& factor, const Tensor& y, const char* who);

// A value that changes from step to step (a learning rate, a loss scale, what the step count
// decides): given as a number when the call is made, or as an f32 element in the op's device
// memory, read when the work runs. The second lets one recorded call serve every step: a CUDA
// graph replays the calls it captured with their arguments as they were, and the step's values
// are written to device memory (Backend::set_values) before each replay (train.cuda_graph).
struct StepScalar {
  float value = 0;
  Tensor at;  // f32, one element on the op's device; when defined, `value` is not read
  StepScalar() = default;
  StepScalar(float v) : value(v) {}  // NOLINT: a plain number is the common case
  StepScalar(float v, Tensor on_device) : value(v), at(std::move(on_device)) {}
};
// Throws ShapeError naming `who` unless s.at is undefined or one f32 element on y's device.
void check_step_scalar(const StepScalar& s, const Tensor& y, const char* who);
// Its value where the host can read the device's memory (the CPU backend's), after the work
// queued before it has run.
inline float host_value(const StepScalar& s) { return s.at.defined() ? s.at.data<float>()[0] : s.value; }

// Host synchronisations made by the calling thread: every Backend call that hands a device value
// to the host counts one (read_to_host, and the calls returning a loss, a norm or a verdict), on
// every backend alike, so a CPU test holds the training step to its budget of one per optimizer
// step (tests/train/test_host_syncs.cpp).
int64_t host_syncs_on_this_thread();
void note_host_sync();

// Reads the loss's labels, [N] or mixed [N,2] (Backend::softmax_xent_forward), checking the shape.
class MixedLabels {
 public:
  MixedLabels(const Tensor& labels, int64_t rows);
  bool mixed() const { return mixed_; }
  int32_t label(int64_t n) const { return p_[mixed_ ? 2 * n : n]; }
  int32_t weight_q(int64_t n) const { return mixed_ ? p_[2 * n + 1] : int32_t(1) << 24; }
  int32_t partner_label(int64_t n) const { return mixed_ ? p_[2 * (n ^ 1)] : p_[n]; }
  static double weight(int32_t q) { return static_cast<double>(q) / static_cast<double>(int32_t(1) << 24); }
  // The shape check alone (device labels): whether they are mixed.
  static bool check(const Tensor& labels, int64_t rows);

 private:
  const int32_t* p_;
  bool mixed_;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;

  // Reproducible results run to run (train.deterministic): the same inputs give the same bits.
  // The CPU backend always does. The CUDA backend's own kernels do in either mode (fixed-order
  // reductions); on, it also takes only cuDNN algorithms whose numerics are deterministic, chosen
  // by cuDNN's fixed ranking rather than by timing (which can choose differently run to run).
  virtual void set_deterministic(bool on) { (void)on; }
  virtual bool deterministic() const { return true; }
  // Changes whenever memory the backend's kernels use outside the pool moved on the calling thread
  // (the CUDA backend's scratch grew): a CUDA graph captured before holds the old address and must
  // be captured again. Constant where nothing moves.
  virtual uint64_t capture_epoch() const { return 0; }

  // Convolution. backward_filter accumulates into dw (+=) so micro-batches add up.
  virtual void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& y, const ConvGeom& g,
                              MemoryPool& ws) = 0;
  // accumulate: dx += the input gradient (cuDNN's beta = 1: a residual block's main path adds
  // into its shortcut's gradient, no separate add); otherwise dx is overwritten.
  virtual void conv2d_backward_data(const Tensor& dy, const Tensor& w, const Tensor& dx,
                                    const ConvGeom& g, MemoryPool& ws, bool accumulate) = 0;
  virtual void conv2d_backward_filter(const Tensor& x, const Tensor& dy, const Tensor& dw,
                                      const ConvGeom& g, MemoryPool& ws) = 0;

  // Batch norm over N*H*W per channel (last dim). Train: batch statistics (summed across
  // replicas by `allreduce` when given), saves mean and inverse std, updates running stats with
  // the unbiased variance (PyTorch's convention). dgamma/dbeta accumulate (+=).
  // The epilogue is fused into the same pass: y = bn(x) + residual (when residual is defined: a
  // residual block's join, cuDNN's BN_ADD_ACTIVATION), then max(., 0) when relu. The sum is
  // rounded once, to y's dtype.
  // A ReLU's backward takes the output as relu_y and masks dy with relu_y > 0 first, in place:
  // the caller hands dy over (as to an in-place ReLU), and afterwards dy holds the gradient at
  // the ReLU's input, which is also the residual's gradient. An undefined relu_y means no ReLU.
  virtual void batchnorm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                       const Tensor& y, const Tensor& save_mean,
                                       const Tensor& save_invstd, const Tensor& running_mean,
                                       const Tensor& running_var, float momentum, float eps,
                                       const AllReduceFn& allreduce, const Tensor& residual,
                                       bool relu) = 0;
  virtual void batchnorm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                      const Tensor& y, const Tensor& running_mean,
                                      const Tensor& running_var, float eps, const Tensor& residual,
                                      bool relu) = 0;
  virtual void batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                  const Tensor& save_mean, const Tensor& save_invstd,
                                  const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta,
                                  const AllReduceFn& allreduce, const Tensor& relu_y) = 0;

  // Batch norm with fixed statistics (eval-mode forward in training): dx = dy * gamma * invstd.
  virtual void batchnorm_backward_frozen(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                         const Tensor& mean, const Tensor& invstd, const Tensor& dx,
                                         const Tensor& dgamma, const Tensor& dbeta,
                                         const Tensor& relu_y) = 0;

  // Elementwise. relu_backward masks with the forward output y.
  virtual void relu_forward(const Tensor& x, const Tensor& y) = 0;
  virtual void relu_backward(const Tensor& y, const Tensor& dy, const Tensor& dx) = 0;
  virtual void add(const Tensor& a, const Tensor& b, const Tensor& y) = 0;
  // y = max(a + b, 0): a residual block's join, one pass.
  virtual void add_relu(const Tensor& a, const Tensor& b, const Tensor& y) = 0;
  // y += alpha * x
  virtual void axpy(float alpha, const Tensor& x, const Tensor& y) = 0;
  virtual void fill(const Tensor& y, float value) = 0;
  // dst (f32, at most kMaxSetValues elements) = values, in the work's order (after what was
  // queued before, before what is queued after) with no host wait; `values` may be reused once
  // this returns. How the host hands a step's StepScalars to the device.
  static constexpr int64_t kMaxSetValues = 64;
  virtual void set_values(const Tensor& dst, const float* values, int64_t n) = 0;
  virtual void scale(const Tensor& y, float alpha) = 0;
  // y *= factor[0], the factor read on the device when the work runs (f32 [1]; y f32): clipping by
  // a norm the host has not read yet.
  virtual void scale_by(const Tensor& y, const Tensor& factor) = 0;

  // Pooling. maxpool saves the argmax (i32, index into the image's H*W) for backward.
  virtual void maxpool_forward(const Tensor& x, const Tensor& y, const Tensor& argmax,
                               const PoolGeom& g) = 0;
  virtual void maxpool_backward(const Tensor& dy, const Tensor& argmax, const Tensor& dx,
                                const PoolGeom& g) = 0;
  virtual void global_avgpool_forward(const Tensor& x, const Tensor& y) = 0;  // [N,H,W,C]->[N,C]
  virtual void global_avgpool_backward(const Tensor& dy, const Tensor& dx) = 0;

  // Linear: y[N,O] = x[N,I] w[O,I]^T + b[O]. backward accumulates dw, db.
  virtual void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b,
                              const Tensor& y) = 0;
  virtual void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy,
                               const Tensor& dx, const Tensor& dw, const Tensor& db) = 0;

  // Softmax cross-entropy on f32 logits [N,K] and i32 labels [N]: writes probabilities, returns
  // the summed loss and how many labels are the first maximum (top-1) and among the 5 largest
  // logits (top-5: fewer than 5 logits larger, or equal at a lower index; every row when K <= 5).
  // Mixed batches (mixup / cutmix in pairs, data/mixing.h) give labels [N,2], N even: row n's
  // label and the weight w of it in units of 2^-24 (kMixLabelOne); the target is w onehot(label) +
  // (1 - w) onehot(label of row n ^ 1), and top-1 / top-5 count the label of the larger weight
  // (the row's own at w = 1/2). A row of weight 1 has the same bits as with labels [N].
  static constexpr int32_t kMixLabelOne = 1 << 24;  // data::kMixOne
  struct LossResult {
    double loss_sum = 0;
    int64_t correct = 0;
    int64_t correct5 = 0;
  };
  virtual LossResult softmax_xent_forward(const Tensor& logits, const Tensor& labels,
                                          const Tensor& probs) = 0;
  // The training pass's loss, leaving the results on the device for the step's one read (no host
  // wait): sums (f32 [3]) gets sums[0] += loss sum, sums[1] += correct, and sums[2] += 1 when a
  // label is outside [0, K) (a CPU backend throws at once instead, naming the sample). The loss is
  // against the smoothed target (1 - smoothing) onehot(label) + smoothing / K (PyTorch's
  // label_smoothing; 0: plain cross-entropy), summed in double per row.
  virtual void softmax_xent_accumulate(const Tensor& logits, const Tensor& labels, const Tensor& probs,
                                       const Tensor& sums, float smoothing) = 0;
  // dlogits = (probs - target) * scale, target as above.
  virtual void softmax_xent_backward(const Tensor& probs, const Tensor& labels, const StepScalar& scale,
                                     const Tensor& dlogits, float smoothing) = 0;

  // Converts between f32, f16 and bf16 (round to nearest even).
  virtual void cast(const Tensor& src, const Tensor& dst) = 0;

  // Sum of squares of a float buffer (for grad norms and checksums), in double.
  virtual double sum_squares(const Tensor& x) = 0;
  // The same for each [offset, offset + count) segment of x (LARS trust ratios), in one pass.
  virtual std::vector<double> segment_sum_squares(const Tensor& x,
                                                  const std::vector<std::pair<int64_t, int64_t>>& segments) = 0;
  // grads *= inv_scale, fused with the check; returns false if any element is inf or NaN.
  virtual bool unscale_check_finite(const Tensor& grads, float inv_scale) = 0;
  // Device-result forms of the two above (f32 [1] outputs, no host wait): out = sum of squares;
  // nonfinite = 1 if any element of grads was inf or NaN (the caller zeroes it first).
  virtual void sum_squares_into(const Tensor& x, const Tensor& out) = 0;
  virtual void unscale_check_finite_into(const Tensor& grads, const StepScalar& inv_scale,
                                         const Tensor& nonfinite) = 0;
  // The gradient norm's fixed blocks (parallel/shard_plan.h, norm_blocks), on the device:
  // out[i] = the sum of squares of segment i of x in double, rounded to f32 (out: f32, one per
  // segment); and out[0] = the sum of x's elements in index order in double, rounded to f32. The
  // two give the same bits however the blocks were spread over replicas.
  virtual void segment_sum_squares_into(const Tensor& x, const std::vector<std::pair<int64_t, int64_t>>& segments,
                                        const Tensor& out) = 0;
  virtual void sum_in_order_into(const Tensor& x, const Tensor& out) = 0;
  // Copies `src` (at most 4 KiB) to host memory once the work queued before it is done: the
  // training step's one host synchronisation. While it waits, `poll` (if set) is called now and
  // then, and may throw: the communicators' health checks, so a failed or hung collective that
  // the stream was ordered after surfaces within its time-out instead of blocking here forever.
  virtual void read_to_host(const Tensor& src, void* dst, const std::function<void()>& poll = {}) = 0;
  // The training step's verdict, on the device where the step's scalars are (no host read), so
  // the update can be queued before the host knows it: in the f32 tensor `s`,
  //   s[at.apply] = 1 if s[at.nonfinite] == 0, s[at.bad_label] == 0 and s[at.loss] is finite, else 0;
  //   s[at.clip]  = max_norm / (norm + 1e-6) in double, norm = sqrt(s[at.grad_squares]), when
  //                 max_norm > 0 and norm > max_norm; else 1 (the host's clip_grad_norm factor).
  struct StepGateAt {
    int64_t loss = 0, bad_label = 0, nonfinite = 0, grad_squares = 0, apply = 0, clip = 0;
  };
  virtual void step_gate(const Tensor& s, const StepGateAt& at, double max_norm) = 0;
  // y = 1 / sqrt(x + eps): frozen batch norm's inverse std from the running variance.
  virtual void rsqrt_eps(const Tensor& x, const Tensor& y, float eps) = 0;

  // Fused optimizer updates over f32 views of the flat buffers, every parameter group in one call;
  // optim/ owns the hyper-parameters and the schedule. The formulas (PyTorch's order of
  // operations) are in ops/cpu/optim_kernels.cpp.
  // `copy`: the 16-bit compute copy of the same elements (f16 or bf16, p's size), written in the
  // same pass with the updated parameters rounded to nearest even, the bits cast(p, copy) would
  // write after the update: one pass over the parameters instead of two. Undefined: none.
  // `classes`: what each element's parameter group takes, per kParamChunk elements of the flat
  // buffer (ChunkClasses); undefined: every element is of class 1.
  // `gate`: f32 [1] on the device (step_gate's apply), read when the work runs: 0 leaves the
  // parameters, the state and the copy as they were (a skipped step). Undefined: always update.
  // The fields that change from step to step are StepScalars (see above); first: 1 when the
  // momentum buffer starts at the gradient (the first applied step), else 0.
  struct SgdUpdate {
    StepScalar lr, decoupled_wd, first;
    float momentum = 0, coupled_wd = 0;
    bool nesterov = false;
    Tensor gate;
  };
  // classes u8: 1 = weight decay (coupled_wd / decoupled_wd), 0 = none.
  virtual void sgd_update(const Tensor& p, const Tensor& g, const Tensor& buf, const SgdUpdate& u,
                          const ChunkClasses& classes, const Tensor& copy) = 0;
  struct AdamWUpdate {
    float beta1 = 0, beta2 = 0, eps = 0;
    StepScalar decay = 1.f, step_size, inv_sqrt_bc2 = 1.f;
    Tensor gate;
  };
  // classes u8: 1 = p *= decay first, 0 = no decay.
  virtual void adamw_update(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v,
                            const AdamWUpdate& u, const ChunkClasses& classes, const Tensor& copy) = 0;
  // LARS trust ratios, left on the device (no host read): for each [offset, offset + count)
  // segment i of params and grads, ratios[i] = trust * |w| / (|g| + wd * |w| + eps) in double, or
  // 1 when either norm is 0 (ratios: f32 [segments.size()]).
  virtual void lars_trust_ratios(const Tensor& params, const Tensor& grads,
                                 const std::vector<std::pair<int64_t, int64_t>>& segments, float trust,
                                 float wd, float eps, const Tensor& ratios) = 0;
  // LARS: buf = momentum * buf + lr * ratio * (g + wd * p); p -= buf. classes i32 (required):
  // k >= 0 = adapted with ratio ratios[k] (lars_trust_ratios' output on the device; lr * ratio
  // rounds to f32 first), -1 = a plain momentum step, ratio 1 and no weight decay.
  virtual void lars_update(const Tensor& p, const Tensor& g, const Tensor& buf, const StepScalar& lr,
                           const Tensor& ratios, float momentum, float wd, const ChunkClasses& classes, const Tensor& copy,
                           const Tensor& gate) = 0;
};

// step_gate's scalars: f32, every index inside them; a ShapeError otherwise.
void check_step_gate_at(const Tensor& stats, const Backend::StepGateAt& at);

// The backend for a device (one shared instance per kind; defined in backend_choice.cpp, a floor
// above the implementations). Throws on a CUDA device when CUDA is not built.
Backend& backend_for(const Device& d);

}  // namespace replica::ops
