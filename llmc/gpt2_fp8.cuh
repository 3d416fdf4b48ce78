/*
The GPT-2 model's FP8 state (llmc/gpt2.cuh owns one; docs/design.md, "Inside the model", says what runs in
FP8 and why): the choice of matmuls (Fp8Matmuls; --fp8 1 = fp8_recipe(true)), the weights' E4M3 copies, the
amax and descale slots, delayed scaling (scales, the amax history a checkpoint holds, the first step's
measuring), the FP8 operands the model's matmuls read (LinearIn, LinearGrad, LinearOut8), and the FP8
classifier (forward and most of its backward, a chunk of rows at a time).

Slots: every FP8 tensor's amax and descale sit in 16-byte slots (cuBLASLt wants its scale pointers
aligned): one per weight copy (kind-major, then layer; the classifier's after them), one per kept
LayerNorm output (ln1 of each layer, then ln2), then the classifier's input (kFp8Act, E4M3), the gradient's
(kFp8Grad, E5M2), each reused by one matmul after another, and the classifier's dlogits (kFp8Dlogits, E5M2).
Delayed scaling has slots of its own, each an amax, a scale and a descale: layer l's GELU output at l, its
GELU gradient at dgelu_slot(l), its kept ln1 and ln2 at ln1_delayed_slot(l) and ln2_delayed_slot(l), and
with qkv.grad.delayed its dqkv at dqkv_slot(l).

The model's buffers it writes into (staging in d_qkv_, d_fch_ and d_ln_, the classifier's in the logits)
are passed in by the model, which says why each is free there (llmc/gpt2.cuh). Does not provide: the FP8
kernels and matmuls themselves (llmc/fp8.cuh), or the model's forward and backward.
*/
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "llmc/attention.cuh"
#include "llmc/classifier.cuh"
#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/fp8.cuh"
#include "llmc/gpt2_config.h"
#include "llmc/layernorm.cuh"
#include "llmc/matmul.cuh"
#include "llmc/multi_gpu.cuh"
#include "llmc/utils.h"

namespace llmc {

// Which matmuls run with FP8 operands (--fp8 1: all, fp8_recipe()); the rest stay bf16. Named apart because
// a shape or setting can keep some in bf16 (rows not a multiple of 16, recompute, no FP8 attention kernels).
struct Fp8Matmuls {
    bool qkv = false, fc = false, lm_head = false;  // forward
    bool attproj_dx = false, fcproj_dx = false;     // backward, the input gradient
    bool lm_head_grad = false;                      // the classifier's backward, both matmuls
    bool qkv_grad = false;                          // qkv's backward, dX and dW
    bool fcproj = false;                            // fcproj's forward and dW (the GELU output in E4M3)
    bool fc_grad = false;                           // fc's backward, fcproj's dX (the GELU gradient)
    bool qkv_grad_delayed = false;  // dqkv at a delayed scale, written in FP8 by attention's backward itself
    bool any() const {
        return qkv || fc || lm_head || attproj_dx || fcproj_dx || lm_head_grad || qkv_grad || fcproj || fc_grad;
    }
    std::string describe() const {
        std::string s;
        auto add = [&](bool on, const char* name) {
            if (on) s += (s.empty() ? "" : ",") + std::string(name);
        };
        add(qkv, "qkv");
        add(fc, "fc");
        add(lm_head, "lm_head");
        add(attproj_dx, "attproj.dx");
        add(fcproj_dx, "fcproj.dx");
        add(lm_head_grad, "lm_head.grad");
        add(qkv_grad, "qkv.grad");
        add(fcproj, "fcproj");
        add(fc_grad, "fc.grad");
        add(qkv_grad_delayed, "qkv.grad.delayed");
        return s.empty() ? "none" : s;
    }
};

// --fp8 1: every matmul above in FP8 (docs/performance.md measures it against bf16).
inline Fp8Matmuls fp8_recipe(bool on) {
    Fp8Matmuls m;
    m.qkv = m.fc = m.lm_head = m.attproj_dx = m.fcproj_dx = m.lm_head_grad = m.qkv_grad = m.fcproj = m.fc_grad = on;
    m.qkv_grad_delayed = on;
    return m;
}

// Delayed scaling's state for a checkpoint (GPT2::fp8_history): device (null without FP8 fcproj) holds
// slots x len floats, newest first, then the count of training forwards they cover (a float, at most
// len) and padding.
struct Fp8History {
    float* device;
    size_t bytes;
    int slots, len;
};

// A matmul's input (N x cin): bf16 x; where an FP8 matmul reads it, E4M3 q at descale, and for an FP8
// weight gradient qt, its transpose (cin x N; made from q by linear_backward where q is given).
struct LinearIn {
    const floatX* x = nullptr;
    const __nv_fp8_e4m3* q = nullptr;
    const float* descale = nullptr;
    __nv_fp8_e4m3* qt = nullptr;
};
// An FP8 matmul's E4M3 output at a (delayed) scale, recording its amax.
struct LinearOut8 {
    __nv_fp8_e4m3* q = nullptr;
    const float* scale = nullptr;
    float* amax = nullptr;
};
// A linear layer's output gradient (N x cout): bf16 x; where FP8 matmuls read it, E5M2 q (for dX) and
// qt (transposed, for dW) at descale, with the partial column sums its cast made (ceil(N / 64) x cout).
struct LinearGrad {
    const floatX* x = nullptr;
    const __nv_fp8_e5m2* q = nullptr;
    const __nv_fp8_e5m2* qt = nullptr;
    const float* descale = nullptr;
    const float* sums = nullptr;
};

// Forward FP8 matmuls accumulate with Hopper's fast (less often promoted) accumulation, as Transformer
// Engine does for the forward; the backward ones promote as usual.
constexpr bool kFp8FastAccumForward = true;
// The weights' copies: forward W as it is (qkv, fc, fcproj), dX W^T (the *T kinds), the classifier's wte
// (kFp8Wte, layer 0, with wte^T after it for lm_head.grad).
constexpr int kFp8Qkv = 0, kFp8Fc = 1, kFp8AttprojT = 2, kFp8FcprojT = 3, kFp8QkvT = 4, kFp8Fcproj = 5, kFp8FcT = 6,
              kFp8WeightKinds = 7, kFp8Wte = kFp8WeightKinds;
constexpr int kFp8SlotStride = 4;
constexpr int kFp8Act = -1, kFp8Grad = -2, kFp8Dlogits = -3;  // resolved by GPT2Fp8::slot()
// Delayed scaling: the training steps each scale looks back on. The dqkv slots are a fifth kind only with
// qkv.grad.delayed, so that the other modes' checkpoints keep their history's shape.
constexpr int kFp8HistoryLen = 16;
constexpr int kFp8DelayedKinds = 4;

// The model's FP8 state: the choice (on), the weights' copies, the slots, the history. Every cast and
// matmul runs on the model's stream.
class GPT2Fp8 {
public:
    Fp8Matmuls on;  // reset(): which matmuls run in FP8

    GPT2Fp8(const GPT2Config& config, bool recompute_gelu, cudaStream_t stream)
        : config_(config), recompute_gelu_(recompute_gelu), stream_(stream) {}

    // The amax and descale slots (tiny: allocated with the model, FP8 or not); nc: the model's B x T x C.
    void allocate_slots(size_t nc) {
        nc_ = nc;
        amax_.allocate(size_t(kFp8SlotStride) * size_t(slot(kFp8Dlogits) + 1));
        descale_.allocate(amax_.size());
        cudaCheck(cudaMemsetAsync(amax_.get(), 0, amax_.bytes(), stream_));
        cudaCheck(cudaMemsetAsync(descale_.get(), 0, descale_.bytes(), stream_));
    }
    // GPT2::set_fp8 in three steps (the model lays its activations out again between the second and the
    // third): fails on a GPU without FP8 tensor cores; the new choice, every FP8 buffer freed; the shapes
    // checked and the buffers for the choice allocated. Returns their bytes (memory().fp8; 0 without FP8).
    static void check_supported(const Fp8Matmuls& m) {
        if (m.any() && !fp8_supported()) {
            fail(kExitUsage, "FP8 matmuls (%s) need a GPU with FP8 tensor cores (compute capability 8.9 or higher)",
                 m.describe().c_str());
        }
    }
    void reset(const Fp8Matmuls& m) {
        on = m;
        weights_.allocate(0);
        amax_jobs_.allocate(0);
        delayed_.allocate(0);
        history_.allocate(0);
        grad_.allocate(0);
        history_count_ = 0;
        stale_ = true;
    }
    size_t allocate() {
        const Fp8Matmuls& m = on;
        if (!m.any()) return 0;
        const GPT2Config& c = config_;
        if (c.channels % 16 != 0) fail(kExitUsage, "FP8 matmuls need channels a multiple of 16, not %d", c.channels);
        if (m.lm_head && c.padded_vocab_size % 16 != 0) {
            fail(kExitUsage, "FP8 lm_head needs the padded vocabulary a multiple of 16, not %d", c.padded_vocab_size);
        }
        if (m.lm_head_grad && !m.lm_head) fail(kExitUsage, "FP8 lm_head.grad needs lm_head too (%s)", m.describe().c_str());
        if (m.qkv_grad && !m.qkv) fail(kExitUsage, "FP8 qkv.grad needs qkv too (%s)", m.describe().c_str());
        if (m.fcproj && !m.fc) fail(kExitUsage, "FP8 fcproj needs fc too (%s)", m.describe().c_str());
        if (m.fc_grad && !m.fcproj) fail(kExitUsage, "FP8 fc.grad needs fcproj too (%s)", m.describe().c_str());
        if (m.qkv_grad_delayed && !(m.qkv_grad && m.fcproj)) {
            fail(kExitUsage, "FP8 qkv.grad.delayed needs qkv.grad and fcproj (%s)", m.describe().c_str());
        }
        const size_t L = size_t(c.num_layers), C = size_t(c.channels);
        const bool kinds[kFp8WeightKinds] = {m.qkv, m.fc, m.attproj_dx, m.fcproj_dx || m.fc_grad, m.qkv_grad, m.fcproj,
                                          m.fc_grad};
        size_t at = 0;
        for (int k = 0; k < kFp8WeightKinds; k++) {
            weight_at_[k] = at;
            if (kinds[k]) at += L * layer_weight_size(k);
        }
        weight_at_[kFp8WeightKinds] = at;
        if (m.lm_head) at += size_t(c.padded_vocab_size) * C;
        if (m.lm_head_grad) at += size_t(c.padded_vocab_size) * C;  // wte^T, for the classifier's dX
        weights_.allocate(at);
        if (m.fcproj) {
            // Delayed scaling: per slot an amax, a scale and a descale (16-byte slots), then the outgrown()
            // count; then the history, its count after it.
            delayed_.allocate(3 * delayed_slots() * kFp8SlotStride + kFp8SlotStride);
            history_.allocate(delayed_slots() * kFp8HistoryLen + kFp8SlotStride);
            cudaCheck(cudaMemsetAsync(delayed_.get(), 0, delayed_.bytes(), stream_));
            cudaCheck(cudaMemsetAsync(history_.get(), 0, history_.bytes(), stream_));
        }
        // fc.grad: the GELU's gradient in E5M2, row-major (N, 4C) and transposed (4C, N).
        if (m.fc_grad) grad_.allocate(8 * nc_);
        return weights_.bytes() + amax_.bytes() + descale_.bytes() + delayed_.bytes() + history_.bytes() +
               grad_.bytes();
    }

    // FP8 matmuls take rows in multiples of 16 (and C, 3C, 4C, Vp are: allocate() checks).
    static bool rows(int64_t N) { return N % 16 == 0; }
    // Whether a call of N rows runs fcproj in FP8 (else bf16: a bf16 GELU output in the shared buffer),
    // and with it delayed scaling.
    bool fcproj_on(int64_t N) const { return on.fcproj && on.fc && rows(N) && !recompute_gelu_; }

    // The weights changed (an update, a load): the copies are cast again before the next forward.
    void weights_changed() { stale_ = true; }
    // The FP8 copies of the weights `on` chose (forward: W as it is; dX: W^T), each scaled by its own amax
    // (all of them measured first, in one launch: amax_jobs_, built at the first cast), where stale.
    // block(l) gives layer l's weights (BlockTensors), wte the classifier's.
    template <class BlockOf>
    void cast_weights(BlockOf&& block, const floatX* wte) {
        if (!on.any() || !stale_) return;
        const int L = config_.num_layers, C = config_.channels, Vp = config_.padded_vocab_size;
        bool first = amax_jobs_.size() == 0;  // collecting the jobs
        std::vector<Fp8AmaxJob> jobs;
        auto cast = [&](int kind, int l, const floatX* w, int64_t rows, int64_t cols, bool transposed) {
            const int s = weight_slot(kind, l);
            __nv_fp8_e4m3* q = const_cast<__nv_fp8_e4m3*>(weight(kind, l));
            if (first) {
                jobs.push_back({w, rows * cols, amax_slot(s)});
                return;
            }
            if (transposed) {
                fp8_cast_transposed(q, w, rows, cols, amax_slot(s), descale(s), stream_);
            } else {
                fp8_cast(q, w, rows * cols, amax_slot(s), descale(s), stream_);
            }
        };
        auto cast_all = [&]() {
            for (int l = 0; l < L; l++) {
                const auto b = block(l);
                if (on.qkv) cast(kFp8Qkv, l, b.qkvw, 3 * C, C, false);
                if (on.fc) cast(kFp8Fc, l, b.fcw, 4 * C, C, false);
                if (on.attproj_dx) cast(kFp8AttprojT, l, b.attprojw, C, C, true);
                if (on.fcproj_dx || on.fc_grad) cast(kFp8FcprojT, l, b.fcprojw, C, 4 * C, true);
                if (on.qkv_grad) cast(kFp8QkvT, l, b.qkvw, 3 * C, C, true);
                if (on.fcproj) cast(kFp8Fcproj, l, b.fcprojw, C, 4 * C, false);
                if (on.fc_grad) cast(kFp8FcT, l, b.fcw, 4 * C, C, true);
            }
            if (on.lm_head) cast(kFp8Wte, 0, wte, Vp, C, false);
            if (on.lm_head_grad && !first) {  // the same scale as wte's copy (its amax is in the slot now)
                const int s = weight_slot(kFp8Wte, 0);
                fp8_cast_transposed(wte_transposed(), wte, Vp, C, amax_slot(s), descale(s), stream_);
            }
        };
        if (first) {
            cast_all();
            amax_blocks_ = fp8_amax_batch_plan(jobs);
            amax_jobs_.allocate(jobs.size());
            if (!jobs.empty()) {
                // On the stream, before the kernel that reads it (from pageable memory: staged before it returns).
                cudaCheck(cudaMemcpyAsync(amax_jobs_.get(), jobs.data(), jobs.size() * sizeof(Fp8AmaxJob),
                                          cudaMemcpyHostToDevice, stream_));
            }
            first = false;
        }
        // The weights' slots (kind-major, then layer, then wte's) are the first ones.
        cudaCheck(cudaMemsetAsync(amax_.get(), 0, size_t(weight_slot(kFp8Wte, 0) + 1) * kFp8SlotStride * sizeof(unsigned int),
                                  stream_));
        fp8_amax_batch(amax_jobs_.get(), int(amax_jobs_.size()), amax_blocks_, stream_);
        cast_all();
        stale_ = false;
    }
    // One layer's weight copy of a kind (kFp8Wte: the classifier's, l = 0) and its slot.
    const __nv_fp8_e4m3* weight(int kind, int l) const {
        const size_t layer = kind < kFp8WeightKinds ? size_t(l) * layer_weight_size(kind) : 0;
        return weights_.get() + weight_at_[kind] + layer;
    }
    int weight_slot(int kind, int l) const { return kind * config_.num_layers + l; }
    const float* weight_descale(int kind, int l) const { return descale(weight_slot(kind, l)); }
    // wte^T (C, Vp), after wte's copy; its descale is wte's.
    __nv_fp8_e4m3* wte_transposed() const {
        return weights_.get() + weight_at_[kFp8WeightKinds] + size_t(config_.padded_vocab_size) * config_.channels;
    }

    // The slots of layer l's kept ln1 and ln2 (cast, not delayed), and of kFp8Act, kFp8Grad, kFp8Dlogits.
    int ln1_slot(int l) const { return kFp8WeightKinds * config_.num_layers + 1 + l; }
    int ln2_slot(int l) const { return (kFp8WeightKinds + 1) * config_.num_layers + 1 + l; }
    int slot(int s) const {
        const int act = (kFp8WeightKinds + 2) * config_.num_layers + 1;
        return s < 0 ? act - 1 - s : s;
    }
    unsigned int* amax_slot(int s) const { return amax_.get() + kFp8SlotStride * slot(s); }
    float* descale(int s) const { return descale_.get() + kFp8SlotStride * slot(s); }
    // Zeroes the slot's amax (for the kernel about to write the tensor to record it) and returns it.
    unsigned int* reset_amax(int s) {
        unsigned int* a = amax_slot(s);
        cudaCheck(cudaMemsetAsync(a, 0, sizeof(unsigned int), stream_));
        return a;
    }
    // x (n bf16 values, its amax recorded in the slot) cast into q, the slot's descale set; returns q.
    template <class Fp8>
    const Fp8* cast(void* q, const floatX* x, int64_t n, int s) {
        Fp8* out = reinterpret_cast<Fp8*>(q);
        fp8_cast(out, x, n, amax_slot(s), descale(s), stream_);
        return out;
    }
    // A kept FP8 LayerNorm output (n values, its descale given) back in bf16, in `into`.
    const floatX* dequantized(floatX* into, const __nv_fp8_e4m3* q, int64_t n, const float* descale) {
        fp8_dequantize(into, q, n, descale, stream_);
        return into;
    }

    // Delayed scaling's slots (the file's comment).
    int delayed_kinds() const { return kFp8DelayedKinds + (on.qkv_grad_delayed ? 1 : 0); }
    int dgelu_slot(int l) const { return config_.num_layers + l; }
    int ln1_delayed_slot(int l) const { return 2 * config_.num_layers + l; }
    int ln2_delayed_slot(int l) const { return 3 * config_.num_layers + l; }
    int dqkv_slot(int l) const { return kFp8DelayedKinds * config_.num_layers + l; }
    size_t delayed_slots() const { return size_t(delayed_kinds()) * size_t(config_.num_layers); }
    float* delayed_amax(int s) const { return delayed_.get() + size_t(s) * kFp8SlotStride; }
    float* delayed_scale(int s) const { return delayed_.get() + (delayed_slots() + size_t(s)) * kFp8SlotStride; }
    float* delayed_descale(int s) const { return delayed_.get() + (2 * delayed_slots() + size_t(s)) * kFp8SlotStride; }
    // The descale of layer l's kept E4M3 ln1 (ln2) in a call of N rows: its delayed slot's where the
    // LayerNorm wrote it at a delayed scale (fcproj_on), else the cast's slot.
    const float* ln1_descale(int l, int64_t N) const {
        return fcproj_on(N) ? delayed_descale(ln1_delayed_slot(l)) : descale(ln1_slot(l));
    }
    const float* ln2_descale(int l, int64_t N) const {
        return fcproj_on(N) ? delayed_descale(ln2_delayed_slot(l)) : descale(ln2_slot(l));
    }
    // Whether a training forward and backward must measure before they write (no history yet: the first).
    bool measuring() const { return history_count_ == 0; }
    // The delayed scales from the history, at the start of a forward with fcproj_on.
    void set_delayed_scales() {
        const int L = config_.num_layers;
        fp8_delayed_scales<__nv_fp8_e4m3>(history_.get(), L, kFp8HistoryLen, delayed_scale(0), delayed_descale(0),
                                          kFp8SlotStride, stream_);
        fp8_delayed_scales<__nv_fp8_e5m2>(history_.get() + size_t(L) * kFp8HistoryLen, L, kFp8HistoryLen,
                                          delayed_scale(dgelu_slot(0)), delayed_descale(dgelu_slot(0)), kFp8SlotStride,
                                          stream_);
        // ln1's and ln2's slots, one after the other.
        const int ln_slots = ln1_delayed_slot(0);
        fp8_delayed_scales<__nv_fp8_e4m3>(history_.get() + size_t(ln_slots) * kFp8HistoryLen, 2 * L, kFp8HistoryLen,
                                          delayed_scale(ln_slots), delayed_descale(ln_slots), kFp8SlotStride, stream_);
        if (on.qkv_grad_delayed) {
            fp8_delayed_scales<__nv_fp8_e5m2>(history_.get() + size_t(dqkv_slot(0)) * kFp8HistoryLen, L, kFp8HistoryLen,
                                              delayed_scale(dqkv_slot(0)), delayed_descale(dqkv_slot(0)),
                                              kFp8SlotStride, stream_);
        }
    }
    // Runs write(), which writes the slot's tensor at its delayed scale and records its amax; with measure (no
    // history yet) twice, the first time only to measure the amax and take the scale from it.
    template <class Fp8, class Write>
    void run_delayed(int s, bool measure, Write&& write) {
        if (measure) {
            write();
            fp8_delayed_scales<Fp8>(delayed_amax(s), 1, 1, delayed_scale(s), delayed_descale(s), 1, stream_);
        }
        write();
    }
    // At the end of a training backward with fcproj_on: the amaxes this forward and backward measured join
    // the history (with several ranks, their largest, so that every rank's history, and scales, stay equal).
    void push_history(MultiGpu* multi) {
        const int slots = int(delayed_slots());
        if (multi != nullptr) {
            multi->all_reduce_max_async(delayed_amax(0), size_t(slots) * kFp8SlotStride, stream_);
            multi->join(stream_);
        }
        fp8_history_push(history_.get(), slots, kFp8HistoryLen, delayed_amax(0), kFp8SlotStride,
                         history_.get() + history_count_at(), stream_, outgrown());
        history_count_ = std::min(history_count_ + 1, kFp8HistoryLen);
    }
    // The history for a checkpoint (GPT2::fp8_history and the calls after it).
    Fp8History history() { return {history_.get(), history_.bytes(), int(delayed_slots()), kFp8HistoryLen}; }
    void history_reset() {
        if (history_.get() == nullptr) return;
        cudaCheck(cudaMemsetAsync(history_.get(), 0, history_.bytes(), stream_));
        history_count_ = 0;
    }
    void history_loaded() {
        if (history_.get() == nullptr) return;
        float count = 0.0f;
        cudaCheck(cudaMemcpyAsync(&count, history_.get() + history_count_at(), sizeof(float), cudaMemcpyDeviceToHost,
                                  stream_));
        cudaCheck(cudaStreamSynchronize(stream_));
        if (!(count >= 0.0f && count <= float(kFp8HistoryLen))) {
            fail(kExitData, "FP8 amax history: its count %g is not in [0, %d]", count, kFp8HistoryLen);
        }
        history_count_ = int(count);
    }
    // The count of tensors whose amax outgrew their history (a device float, null without delayed scaling):
    // fp8_history_push adds to it after each training backward; nothing resets it.
    float* outgrown() const {
        return delayed_.get() == nullptr ? nullptr : delayed_.get() + 3 * delayed_slots() * kFp8SlotStride;
    }

    // The FP8 operands of the model's matmuls (llmc/gpt2.cuh's linear_forward and linear_backward read them),
    // each in a buffer of the model's the caller says is free (stage).
    // A LayerNorm output a matmul reads (ln1, ln2; run(out, amax, f) runs the LayerNorm): written in bf16 to
    // out where the model keeps it so (amax: its amax recorded there), else kept in E4M3 only, in q. With
    // delayed scaling (delayed) the LayerNorm writes it so itself at delayed_slot's scale, recording the amax
    // for the history (measure: twice, the first time to measure); otherwise it writes it in bf16 to stage (a
    // call in bf16 reads it there) with its amax, and a cast makes q (slot).
    template <class Run>
    void layernorm_out(floatX* out, unsigned int* amax, __nv_fp8_e4m3* q, int slot, int delayed_slot, bool delayed,
                       bool measure, floatX* stage, int64_t n, Run&& run) {
        if (out != nullptr) {
            run(out, amax, LayerNormFp8Out{});
        } else if (!delayed) {
            run(stage, reset_amax(slot), LayerNormFp8Out{});
            cast<__nv_fp8_e4m3>(q, stage, n, slot);
        } else {
            auto* a = reinterpret_cast<unsigned int*>(delayed_amax(delayed_slot));
            run_delayed<__nv_fp8_e4m3>(delayed_slot, measure, [&]() {
                cudaCheck(cudaMemsetAsync(a, 0, sizeof(unsigned int), stream_));
                run(nullptr, a, LayerNormFp8Out{q, delayed_scale(delayed_slot)});
            });
        }
    }
    // A LayerNorm output a weight gradient reads (ln1, ln2): bf16 x as kept; kept in E4M3 only (q, at descale):
    // for an FP8 dW its byte transpose into stage, for a bf16 one back in bf16 there.
    LinearIn dw_input(const floatX* x, const __nv_fp8_e4m3* q, const float* descale, bool fp8, void* stage, int64_t N) {
        if (fp8) {
            auto* qt = reinterpret_cast<__nv_fp8_e4m3*>(stage);
            fp8_transpose(qt, N, q, N, config_.channels, stream_);
            return {nullptr, nullptr, descale, qt};
        }
        return {x != nullptr ? x : dequantized(reinterpret_cast<floatX*>(stage), q, N * config_.channels, descale)};
    }
    // A bf16 gradient x (N x C; its amax in kFp8Grad's slot, recorded by the kernel that wrote it) for an FP8
    // dX (dx): E5M2 in stage; with pair also transposed nc_ bytes on, for an FP8 dW (one pass, which sums its
    // columns into sums for the bias gradient).
    LinearGrad grad(const floatX* x, int64_t N, int C, void* stage, bool dx, bool pair, float* sums) {
        auto* q = reinterpret_cast<__nv_fp8_e5m2*>(stage);
        if (pair) {
            fp8_cast_pair(dx ? q : nullptr, q + nc_, N, x, N, C, amax_slot(kFp8Grad), descale(kFp8Grad), stream_, sums);
            return {x, dx ? q : nullptr, q + nc_, descale(kFp8Grad), sums};
        }
        if (!dx) return {x};
        return {x, cast<__nv_fp8_e5m2>(q, x, N * C, kFp8Grad), nullptr, descale(kFp8Grad)};
    }
    // fc.grad: fc's gradient, dfch * GELU'(fch) (N x 4C), cast in E5M2 both ways (in grad_) at layer l's delayed
    // scale (its amax measured for the next; measure: a first pass measures it), its column sums in sums
    // (the model's d_ln_, free until fc's dX) added to fc's bias gradient dbias at once.
    LinearGrad dgelu_grad(const floatX* dfch, const floatX* fch, int64_t N, int l, bool measure, float* sums,
                          floatX* dbias) {
        const int C = config_.channels, s = dgelu_slot(l);
        auto* amax = reinterpret_cast<unsigned int*>(delayed_amax(s));
        auto* q = reinterpret_cast<__nv_fp8_e5m2*>(grad_.get());
        __nv_fp8_e5m2* qt = q + 4 * nc_;
        run_delayed<__nv_fp8_e5m2>(s, measure, [&]() {
            cudaCheck(cudaMemsetAsync(amax, 0, sizeof(unsigned int), stream_));
            fp8_dgelu_cast_pair(q, qt, N, dfch, fch, N, 4 * C, delayed_scale(s), amax, stream_, sums);
        });
        bias_grad_from_partials(dbias, sums, ceil_div<int64_t>(N, kFp8CastPairRows), 4 * C, stream_);
        return {dfch, q, qt, delayed_descale(s)};
    }
    // qkv.grad's dqkv (N x 3C) in E5M2 in stage (the model's d_fch_): row-major, transposed, room for ln1^T (N x
    // C), then the bias gradient's partial sums (ceil(N/64) x 3C floats). Without fused, cast from bf16 (its
    // amax recorded by attention's backward, and with delayed_slot >= 0 kept for that slot's history too);
    // with fused, what attention_backward_fp8 is to write at delayed_slot's scale (its amax zeroed first).
    LinearGrad dqkv(const floatX* bf16, void* stage, int64_t N, int delayed_slot, Flash90Fp8Out* fused) {
        static_assert(flash90_detail::kRows == kFp8CastPairRows,
                      "attention's FP8 column sums and the cast's must cover the same 64-row blocks");
        const int C = config_.channels;
        auto* q = reinterpret_cast<__nv_fp8_e5m2*>(stage);
        __nv_fp8_e5m2* qt = q + N * 3 * C;
        auto* sums = reinterpret_cast<float*>(qt + N * 3 * C + N * C);
        auto* amax = delayed_slot >= 0 ? reinterpret_cast<unsigned int*>(delayed_amax(delayed_slot)) : nullptr;
        if (fused == nullptr) {
            if (delayed_slot >= 0) {
                cudaCheck(cudaMemcpyAsync(amax, amax_slot(kFp8Grad), sizeof(unsigned int), cudaMemcpyDeviceToDevice,
                                          stream_));
            }
            fp8_cast_pair(q, qt, N, bf16, N, 3 * C, amax_slot(kFp8Grad), descale(kFp8Grad), stream_, sums);
            return {bf16, q, qt, descale(kFp8Grad), sums};
        }
        cudaCheck(cudaMemsetAsync(amax, 0, sizeof(unsigned int), stream_));
        fused->q = reinterpret_cast<uint8_t*>(q);
        fused->qt = reinterpret_cast<uint8_t*>(qt);
        fused->sums = sums;
        fused->scale = delayed_scale(delayed_slot);
        fused->amax_bits = amax;
        return {nullptr, q, qt, delayed_descale(delayed_slot), sums};
    }

    // The classifier with FP8 lm_head.grad, `chunk` rows at a time (classifier_chunk), in the model's
    // buffers (Head); with targets the losses, and in training (dloss > 0) also the classifier's backward
    // but for dwte: d(lnf) into dlnf (the model's d_ln_, free until backward reads it there), dlogits^T (Vp,
    // N) in E5M2 in logits and lnf^T (C, N) in E4M3 in stage (d_qkv_: untouched until backward has used
    // them, its first matmul). A training forward puts each chunk's logits at the start of logits, then its
    // dlogits in E5M2 (classifier_chunk sizes the chunks so that the three fit with dlogits^T in logits' 2 N
    // Vp bytes); any other forward leaves all N rows of logits in logits. Both run the same matmul shapes,
    // so their logits and losses are equal. Returns the rows whose backward it ran (0: none).
    struct Head {
        const floatX* lnf;
        floatX* logits;
        float* losses;
        floatX* dlnf;
        void* stage;  // N x C values of E4M3, then lnf^T
        size_t nc;    // lnf^T's offset in stage, in bytes
    };
    int64_t classifier_chunks(const CublasLt& lt, const Head& h, const int* targets, int64_t N, int64_t chunk,
                              float dloss) {
        const int C = config_.channels, V = config_.vocab_size, Vp = config_.padded_vocab_size;
        const bool train = targets != nullptr && dloss > 0.0f;
        const __nv_fp8_e4m3* x = cast<__nv_fp8_e4m3>(h.stage, h.lnf, N * C, kFp8Act);
        const int wslot = weight_slot(kFp8Wte, 0);
        auto* dlogits = reinterpret_cast<__nv_fp8_e5m2*>(reinterpret_cast<uint8_t*>(h.logits) + 2 * chunk * Vp);
        __nv_fp8_e5m2* dlogits_t = dlogits_transposed(h.logits, N);
        for (int64_t r0 = 0; r0 < N; r0 += chunk) {
            const int64_t n = std::min(chunk, N - r0);
            floatX* out = train ? h.logits : h.logits + r0 * Vp;
            fp8_matmul(lt, stream_, n, Vp, C, x + r0 * C, weight(kFp8Wte, 0), descale(kFp8Act), descale(wslot), out,
                       Fp8Epilogue{}, kFp8FastAccumForward);
            if (targets == nullptr) continue;
            if (!train) {
                fused_classifier(out, h.losses + r0, targets + r0, 0.0f, n, V, Vp, false, stream_);
                continue;
            }
            fused_classifier_fp8(out, h.losses + r0, targets + r0, dloss, n, V, Vp, dlogits, descale(kFp8Dlogits),
                                 stream_);
            fp8_transpose(dlogits_t + r0, N, dlogits, n, Vp, stream_);
            // d(lnf) rows r0.. = dlogits (n, Vp) wte (Vp, C): P dlogits, Q wte^T (C, Vp).
            fp8_matmul(lt, stream_, n, C, Vp, dlogits, wte_transposed(), descale(kFp8Dlogits), descale(wslot),
                       h.dlnf + r0 * C);
        }
        if (!train) return 0;
        fp8_cast_transposed(lnf_transposed(h.stage, h.nc), h.lnf, N, C, amax_slot(kFp8Act), descale(kFp8Act), stream_);
        return N;
    }
    // The rows per chunk of classifier_chunks for N rows (a multiple of 16): about N / 4, a multiple of 16,
    // or 0 (no chunks: the classifier in one piece, its backward in bf16) without lm_head.grad or where a
    // chunk's 3 chunk Vp bytes and dlogits^T's N Vp would not fit in logits' 2 N Vp (N < 48).
    int64_t classifier_chunk(int64_t N) const {
        if (!on.lm_head_grad) return 0;
        const int64_t chunk = ceil_div<int64_t>(ceil_div<int64_t>(N, 4), 16) * 16;
        return 3 * chunk <= N ? chunk : 0;
    }
    __nv_fp8_e5m2* dlogits_transposed(floatX* logits, int64_t N) const {
        const int64_t chunk = classifier_chunk(N);
        return reinterpret_cast<__nv_fp8_e5m2*>(reinterpret_cast<uint8_t*>(logits) + 3 * chunk * config_.padded_vocab_size);
    }
    // After the classifier's E4M3 input (N x C values) in stage.
    static __nv_fp8_e4m3* lnf_transposed(void* stage, size_t nc) {
        return reinterpret_cast<__nv_fp8_e4m3*>(reinterpret_cast<uint8_t*>(stage) + nc);
    }

private:
    // One layer's FP8 weight copy of a kind (qkv, fc, attproj^T, fcproj^T, qkv^T, fcproj, fc^T), in values.
    size_t layer_weight_size(int kind) const {
        const size_t C = size_t(config_.channels);
        const size_t size[kFp8WeightKinds] = {3 * C * C, 4 * C * C, C * C, 4 * C * C, 3 * C * C, 4 * C * C, 4 * C * C};
        return size[kind];
    }
    size_t history_count_at() const { return delayed_slots() * kFp8HistoryLen; }

    GPT2Config config_;
    bool recompute_gelu_;
    cudaStream_t stream_;
    size_t nc_ = 0;  // the model's B x T x C
    DeviceBuffer<__nv_fp8_e4m3> weights_;     // the copies; weight_at_: where each kind starts, wte's last
    size_t weight_at_[kFp8WeightKinds + 1] = {};
    bool stale_ = true;
    DeviceBuffer<unsigned int> amax_;
    DeviceBuffer<float> descale_;
    DeviceBuffer<Fp8AmaxJob> amax_jobs_;  // the weights' amaxes (cast_weights), built at its first call
    int64_t amax_blocks_ = 0;             // amax_jobs_'s launch (fp8_amax_batch_plan)
    // Delayed scaling: the slots (amax, scale, descale; the outgrown count), the history and how many
    // training forwards it covers (mirrors the count stored after it).
    DeviceBuffer<float> delayed_, history_;
    int history_count_ = 0;
    DeviceBuffer<uint8_t> grad_;  // fc.grad: the GELU gradient in E5M2, row-major (N, 4C) and transposed
};

}  // namespace llmc
