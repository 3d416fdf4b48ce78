/*
The GPT-2 model on the GPU, in mixed precision: parameters, gradients, optimizer state and activations,
allocated once for micro-batches of up to B x T tokens, and forward, backward and update built from the
layer kernels in llmc/. Tests, tools and train_gpt2.cu share it.

Numbers: parameters, gradients and activations bf16; LayerNorm statistics, losses, AdamW moments and
master weights fp32; matmuls accumulate in fp32 (cuBLASLt). AdamW rounds the fp32 master weights
stochastically into the bf16 parameters.

Reading order: forward() with forward_to_lnf(), and backward(), each show the layer sequence once. Every
matmul goes through linear_forward / linear_backward. Options change what runs, never the layer sequence:
the classifier's exp forward (set_classifier_exp, llmc/classifier_sm90.cuh), a second stream for weight
gradients (set_dw_stream, DwSide) and GELU recompute (-r 1). docs/design.md ("The model", "Inside the model") says how each works and why.
Some buffers deliberately hold different tensors at different points of a step (d_qkv_, d_fch_, d_ln_,
proj_, logits_ and the scratch): each use says what it holds there and why the buffer is free then.

Data parallel (llmc/multi_gpu.cuh): with a MultiGpu, backward sums the gradients over the ranks (per
layer, or one reduce-scatter with ZeRO-1, llmc/zero.h); update() divides norm and clip scale by the
ranks in fp32 (bf16 has no exact 1/W for most W). One rank through NCCL gives the single-GPU bits.

Not here: the training loop, data, logging, sampling (train_gpt2.cu); checkpoint contents (llmc/checkpoint.cuh).
*/
#pragma once

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "llmc/adamw.cuh"
#include "llmc/attention.cuh"
#include "llmc/classifier.cuh"
#include "llmc/classifier_sm90.cuh"
#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/encoder.cuh"
#include "llmc/gelu.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/gpt2_config.h"
#include "llmc/layernorm.cuh"
#include "llmc/matmul.cuh"
#include "llmc/multi_gpu.cuh"
#include "llmc/utils.h"
#include "llmc/zero.h"

namespace llmc {

// Shapes the kernels need that a GPT2Config alone does not promise.
inline std::string gpu_config_problem(const GPT2Config& c) {
    std::string problem = config_problem(c);
    if (!problem.empty()) return problem;
    if (c.channels % 8 != 0) return format("channels %d is not a multiple of 8 (16-byte vectors)", c.channels);
    if (c.head_size() % 8 != 0) return format("head size %d is not a multiple of 8", c.head_size());
    if (c.padded_vocab_size % 8 != 0) return format("padded vocabulary %d is not a multiple of 8", c.padded_vocab_size);
    return "";
}

// One transformer block's parameters, or their gradients: views into the flat buffer (file order).
template <class T>
struct BlockTensors {
    T *ln1w, *ln1b, *qkvw, *qkvb, *attprojw, *attprojb, *ln2w, *ln2b, *fcw, *fcb, *fcprojw, *fcprojb;
};
// The tensors outside the blocks: token and position embeddings (wte is also the classifier) and the
// final LayerNorm.
template <class T>
struct OuterTensors {
    T *wte, *wpe, *lnfw, *lnfb;
};
// What block l's forward keeps for its backward (B x T rows of each).
struct BlockActivations {
    floatX *ln1, *qkv, *atty, *residual2, *ln2, *fch, *fch_gelu, *residual3;
    float *ln1_mean, *ln1_rstd, *ln2_mean, *ln2_rstd;
    void* att_saved;  // attention's saved state (flash: the log-sum-exp per row)
};

// Backward's second stream for weight gradients (GPT2::set_dw_stream; docs/design.md), with a cuBLASLt
// handle (and workspace) and scratch of its own. fork(): the side waits for what the model's stream (main)
// has queued so far; mark(e): the side got this far; await(e): main waits for that.
struct DwSide {
    explicit DwSide(cudaStream_t main_stream) : main(main_stream) {}
    cudaStream_t main;
    Stream stream;
    CublasLt lt;
    // fork()'s, then: the side is done with layer l+1's fc, qkv, attproj, fcproj dW, or with all of them.
    Event ready, fc_done, qkv_done, attproj_done, fcproj_done, done;
    DeviceBuffer<char> scratch;     // the bias gradients' partial sums
    DeviceBuffer<float> qkvb_sums;  // attention's backward's column sums of dqkv

    void fork() {
        cudaCheck(cudaEventRecord(ready, main));
        cudaCheck(cudaStreamWaitEvent(stream, ready, 0));
    }
    void mark(cudaEvent_t e) { cudaCheck(cudaEventRecord(e, stream)); }
    void await(cudaEvent_t e) { cudaCheck(cudaStreamWaitEvent(main, e, 0)); }
};

class GPT2 {
public:
    // Device memory by kind, for the start-up table.
    struct Memory {
        size_t params = 0, grads = 0, optimizer = 0, activations = 0, activation_grads = 0, scratch = 0;
        size_t total() const { return params + grads + optimizer + activations + activation_grads + scratch; }
    };

    // Everything is allocated here, for micro-batches of up to B x T tokens; nothing is allocated later.
    // With `multi` the gradients are summed over its ranks (zero_stage 1: ZeRO-1); without it, one GPU, no
    // NCCL. recompute_gelu (-r 1): one GELU output buffer for all layers, recomputed in backward.
    GPT2(const GPT2Config& config, int B, int T, cudaStream_t stream, MultiGpu* multi = nullptr, int zero_stage = 0,
         bool recompute_gelu = false)
        : config_(config), B_(B), T_(T), stream_(stream), tensors_(param_tensors(config)),
          adamw_table_(adamw_tensors(tensors_)), multi_(multi), zero_stage_(multi != nullptr ? zero_stage : 0),
          recompute_gelu_(recompute_gelu) {
        std::string problem = gpu_config_problem(config);
        if (!problem.empty()) fail(kExitUsage, "GPT2: %s (%s)", problem.c_str(), describe(config).c_str());
        if (B < 1 || T < 1 || T > config.max_seq_len) {
            fail(kExitUsage, "GPT2: B=%d T=%d, need B >= 1 and 1 <= T <= maxT=%d", B, T, config.max_seq_len);
        }
        num_params_ = llmc::num_parameters(config);
        size_t n = size_t(num_params_), state = n;
        if (sharded()) {
            // Parameters and gradients padded to W equal shards (the tail stays zero: nothing writes it);
            // master weights and moments for this rank's shard only.
            layout_ = llmc::zero_layout(num_params_, multi_->world());
            owned_ = layout_.owned(multi_->rank());
            shard_table_ = restrict_tensors(adamw_table_, owned_.begin, owned_.end);
            n = size_t(layout_.padded_total());
            state = size_t(layout_.shard_size);
        }
        params_.allocate(n);
        grads_.allocate(n);
        master_.allocate(state);
        adam_m_.allocate(state);
        adam_v_.allocate(state);
        cudaCheck(cudaMemsetAsync(params_.get(), 0, params_.bytes(), stream_));
        cudaCheck(cudaMemsetAsync(grads_.get(), 0, grads_.bytes(), stream_));
        cudaCheck(cudaMemsetAsync(master_.get(), 0, master_.bytes(), stream_));
        cudaCheck(cudaMemsetAsync(adam_m_.get(), 0, adam_m_.bytes(), stream_));
        cudaCheck(cudaMemsetAsync(adam_v_.get(), 0, adam_v_.bytes(), stream_));
        allocate_activations();
        scalars_.allocate(4);
        cudaCheck(cudaStreamSynchronize(stream_));
    }
    GPT2(const GPT2&) = delete;
    GPT2& operator=(const GPT2&) = delete;

    const GPT2Config& config() const { return config_; }
    int max_B() const { return B_; }
    int max_T() const { return T_; }
    int64_t num_parameters() const { return num_params_; }
    const ParamTensorInfo& tensor(int i) const { return tensors_[size_t(i)]; }
    Memory memory() const { return memory_; }
    cudaStream_t stream() const { return stream_; }
    // cuBLASLt algorithm tuning (llmc/matmul.cuh): the same bits either way, faster matmuls with it.
    void set_gemm_tuning(bool on) { lt_.set_tuning(on); }
    bool gemm_tuning() const { return lt_.tuning(); }
    const CublasLt& cublas() const { return lt_; }
    // Backward's weight gradients on a second stream (docs/design.md): 0 one stream, 1 dwte, fc's and qkv's,
    // 2 also attproj's and fcproj's (activation_grads grows by B x T x C). Only on one GPU without recompute.
    // The first call asking for a level allocates (synchronising); elsewhere backward runs on one stream
    // (dw_stream_applies() says which).
    void set_dw_stream(int level) {
        if (level < 0 || level > 2) fail(kExitUsage, "GPT2: weight-gradient stream level %d, need 0, 1 or 2", level);
        dw_level_ = level;
        if (!dw_stream_possible()) return;
        if (level > 0 && dw_ == nullptr) {
            cudaCheck(cudaStreamSynchronize(stream_));
            dw_ = std::make_unique<DwSide>(stream_);
            const int64_t N = int64_t(n_), C = config_.channels;
            dw_->scratch.allocate(std::max(matmul_backward_scratch_bytes(N, int(4 * C)), size_t(1)));
            dw_->qkvb_sums.allocate(size_t(N / kAttentionSumRows + 1) * size_t(3 * C));
            memory_.scratch += dw_->scratch.bytes() + dw_->qkvb_sums.bytes() + dw_->lt.workspace_bytes();
        }
        if (level > 1 && dres2_.get() == nullptr) {
            cudaCheck(cudaStreamSynchronize(stream_));
            dres2_.allocate(nc_);
            cudaCheck(cudaMemsetAsync(dres2_.get(), 0xff, dres2_.bytes(), stream_));  // poisoned, as act_grads_
            memory_.activation_grads += dres2_.bytes();
        }
    }
    int dw_stream() const { return dw_level_; }
    // The classifier's exp forward (docs/design.md) for bf16 training forwards where it applies; turning
    // it on allocates its per-row scratch (memory().scratch grows by about N x 200 floats at GPT-2's Vp).
    void set_classifier_exp(bool on) {
        classifier_exp_ = on;
        if (!on || !classifier90_available() || cls90_sums_.get() != nullptr) return;
        cudaCheck(cudaStreamSynchronize(stream_));
        const int64_t N = int64_t(n_);
        cls90_c_.allocate(size_t(N));
        cls90_sums_.allocate(size_t(N));
        cls90_partial_.allocate(classifier90_partial_count(N, config_.padded_vocab_size));
        memory_.scratch += cls90_c_.bytes() + cls90_sums_.bytes() + cls90_partial_.bytes();
    }
    bool classifier_exp() const { return classifier_exp_; }
    // Whether a training forward of N rows runs the classifier's exp forward, as the model is set now.
    bool classifier_exp_applies(int64_t N) const {
        return classifier_exp_ && cls90_sums_.get() != nullptr && N <= int64_t(n_) &&
               classifier90_applies(N, config_.channels, config_.padded_vocab_size);
    }
    // The level backward runs at, as the model is set now (0: one stream).
    int dw_stream_applies() const {
        if (!dw_stream_possible() || dw_ == nullptr) return 0;
        return dw_level_ >= 2 && dres2_.get() == nullptr ? 1 : dw_level_;
    }
    const floatX* params() const { return params_.get(); }
    const floatX* grads() const { return grads_.get(); }  // with several ranks, after backward: their sum
    MultiGpu* multi() const { return multi_; }
    bool sharded() const { return multi_ != nullptr && zero_stage_ == 1; }
    // ZeRO-1: how the parameters are split over the ranks. owned(): the parameters whose master weights
    // and moments this rank holds (all of them without ZeRO-1).
    const ZeroLayout& zero_layout() const { return layout_; }
    ShardRange owned() const { return sharded() ? owned_ : ShardRange{0, num_params_}; }
    // The device buffers a checkpoint saves (llmc/checkpoint.cuh): bf16 parameters (all of them, in
    // every layout), and the master weights and AdamW moments of owned().
    struct State {
        floatX* params;
        float *master, *adam_m, *adam_v;
    };
    State state() {
        return {params_.get(), master_.get(), adam_m_.get(), adam_v_.get()};
    }

    // (B,T,Vp) of the last forward (dlogits after a training one, or Y after the classifier's exp forward:
    // set_classifier_exp); (M,Vp) after forward_scored.
    const floatX* logits() const { return logits_; }
    const float* losses() const { return losses_; }  // (B,T) of the last forward with targets; (M) after forward_scored
    const float* mean_loss() const { return scalars_.get(); }
    const float* grad_norm() const { return scalars_.get() + 1; }
    // The last update's gradient scale (clipping), NaN when the step guard skipped it.
    const float* grad_scale() const { return scalars_.get() + 2; }

    // Whether every bf16 parameter is finite (their sum of squares is; the master weights round to these,
    // so they are too). Synchronises: it runs before a checkpoint or model file is written, not in a step.
    bool parameters_finite() {
        float* sumsq = scalars_.get() + 3;
        global_norm_sumsq(sumsq, params_.get(), num_params_, reinterpret_cast<float*>(scratch_.get()), scratch_.bytes(),
                          stream_);
        float host = 0.0f;
        cudaCheck(cudaMemcpyAsync(&host, sumsq, sizeof(float), cudaMemcpyDeviceToHost, stream_));
        cudaCheck(cudaStreamSynchronize(stream_));
        return std::isfinite(host);
    }

    // The fp32 parameters (file order) become the master weights, and rounded to nearest the bf16 ones;
    // the optimizer state starts from zero.
    void set_parameters(const std::vector<float>& host) {
        if (int64_t(host.size()) != num_params_) {
            fail(kExitUsage, "GPT2: %zu parameters given, the shape %s needs %lld", host.size(),
                 describe(config_).c_str(), (long long)num_params_);
        }
        if (sharded()) {
            DeviceBuffer<float> full{size_t(num_params_)};
            cudaCheck(cudaMemcpyAsync(full.get(), host.data(), full.bytes(), cudaMemcpyHostToDevice, stream_));
            convert_to_bf16(params_.get(), full.get(), num_params_, stream_);
            cudaCheck(cudaMemsetAsync(master_.get(), 0, master_.bytes(), stream_));
            cudaCheck(cudaMemcpyAsync(master_.get(), full.get() + owned_.begin, size_t(owned_.size()) * sizeof(float),
                                      cudaMemcpyDeviceToDevice, stream_));
            cudaCheck(cudaStreamSynchronize(stream_));  // `full` goes away at the return
        } else {
            cudaCheck(cudaMemcpyAsync(master_.get(), host.data(), master_.bytes(), cudaMemcpyHostToDevice, stream_));
            convert_to_bf16(params_.get(), master_.get(), num_params_, stream_);
        }
        cudaCheck(cudaMemsetAsync(adam_m_.get(), 0, adam_m_.bytes(), stream_));
        cudaCheck(cudaMemsetAsync(adam_v_.get(), 0, adam_v_.bytes(), stream_));
        cudaCheck(cudaStreamSynchronize(stream_));  // host memory may go away after the return
    }

    // Runs the model on inputs (B,T) (device int32) into the logits (B,T,Vp). With targets, also the
    // per-position losses and their mean, written to *mean_out (a device float; the model's own slot
    // mean_loss() when null). With dloss > 0 (training) the logits are replaced by dloss * d(loss)/d(logits),
    // ready for backward(); dloss is each position's weight in the step's loss, 1 / (B * T * micro-steps).
    void forward(const int* inputs, const int* targets, int B, int T, float* mean_out = nullptr, float dloss = 0.0f) {
        check_batch(B, T, "forward");
        const GPT2Config& c = config_;
        const int C = c.channels, Vp = c.padded_vocab_size;
        const int64_t N = int64_t(B) * T;
        const bool exp_head = targets != nullptr && dloss > 0.0f && classifier_exp_applies(N);
        const floatX* wte = outer(params_.get()).wte;
        cls90_rows_ = 0;
        forward_to_lnf(inputs, B, T);
        // The classifier: our exp forward, or one matmul.
        if (exp_head) {
            classifier90_exp_forward(logits_, losses_, lnf_, wte, targets, dloss, N, C, c.vocab_size, Vp,
                                     {cls90_c_.get(), cls90_partial_.get(), cls90_sums_.get()}, stream_);
            cls90_rows_ = N;
            cls90_dloss_ = dloss;
        } else {
            linear_forward(logits_, lnf_, wte, nullptr, N, C, Vp);
        }
        if (targets == nullptr) return;
        if (!exp_head) {
            fused_classifier(logits_, losses_, targets, dloss, N, c.vocab_size, Vp, dloss > 0.0f, stream_);
        }
        llmc::mean_loss(mean_out != nullptr ? mean_out : scalars_.get(), losses_, N, stream_);
    }

    // Rows packing several sequences that share a prefix (llmc/mc_eval.h McPackedBatch), for forward_scored,
    // both (B,T) device int32: positions, each input's position-embedding row (below maxT; the caller's to
    // check); groups, its attention group (llmc/attention.cuh: group 0 is seen by every later position of its
    // row, any other group only by itself).
    struct PackedRows {
        const int* positions;
        const int* groups;
    };

    // forward() up to the final LayerNorm, then the classifier at M of the B*T positions only (evaluation).
    // scored (M, device int32): indices into the B*T positions, in [0, B*T) (the caller's to check), any
    // order, repeats allowed (M up to the allocated B x T); targets (M): their next tokens. Those lnf rows are
    // gathered into a compact (M,C) buffer: logits() holds their (M,Vp) logits, losses() their M losses in
    // order, *mean_out (mean_loss() when null) their mean. The losses match forward()'s closely, not always
    // bitwise (cuBLASLt may pick another algorithm for M rows). With packed, positions and attention groups
    // come from PackedRows and attention takes the cuBLASLt path (buffers: reserve_packed; growing them
    // synchronises); a sequence's losses match those of it alone in a row to within bf16 rounding.
    // No backward() may follow (the logits are no gradient; packed rows save nothing).
    void forward_scored(const int* inputs, int B, int T, const int* scored, const int* targets, int64_t M,
                        float* mean_out = nullptr, const PackedRows* packed = nullptr) {
        check_batch(B, T, "forward_scored");
        const int64_t allocated = int64_t(B_) * T_;
        if (M < 1 || M > allocated) {
            fail(kExitUsage, "GPT2 forward_scored: M=%lld scored positions for B=%d T=%d, need 1 <= M <= the allocated "
                 "B x T = %lld", (long long)M, B, T, (long long)allocated);
        }
        if (packed != nullptr && (packed->positions == nullptr || packed->groups == nullptr)) {
            fail(kExitUsage, "GPT2 forward_scored: packed rows need both positions and groups");
        }
        const GPT2Config& c = config_;
        const int C = c.channels, Vp = c.padded_vocab_size;
        cls90_rows_ = 0;
        forward_to_lnf(inputs, B, T, packed);
        // proj_ (rows for the allocated B x T, at least M) is free after the forward.
        gather_positions(proj_, lnf_, scored, M, C, stream_);
        matmul_forward(lt_, logits_, proj_, outer(params_.get()).wte, nullptr, M, C, Vp, stream_);
        fused_classifier(logits_, losses_, targets, 0.0f, M, c.vocab_size, Vp, false, stream_);
        llmc::mean_loss(mean_out != nullptr ? mean_out : scalars_.get(), losses_, M, stream_);
    }

    // The device memory forward_scored's packed rows need beyond the model's allocation for a B x T batch
    // (the cuBLASLt attention's probabilities and scratch, one layer at a time), and reserving it ahead so
    // nothing is allocated in a step: the buffers grow to the largest asked for, never shrink.
    struct PackedBytes {
        size_t att = 0, scratch = 0;
    };
    PackedBytes packed_bytes(int B, int T) const {
        const int NH = config_.num_heads, HS = config_.channels / config_.num_heads;
        return {attention_cublaslt_saved_bytes(B, NH, T), attention_cublaslt_scratch_bytes(B, NH, T, HS)};
    }
    void reserve_packed(PackedBytes need) {
        if (packed_att_.bytes() >= need.att && packed_scratch_.bytes() >= need.scratch) return;
        cudaCheck(cudaStreamSynchronize(stream_));  // an earlier forward may still read the old ones
        if (packed_att_.bytes() < need.att) packed_att_.allocate(need.att);
        if (packed_scratch_.bytes() < need.scratch) packed_scratch_.allocate(need.scratch);
    }
    size_t packed_reserved_bytes() const { return packed_att_.bytes() + packed_scratch_.bytes(); }

    // Sets every parameter gradient to zero (the start of an optimizer step).
    void zero_grad() { cudaCheck(cudaMemsetAsync(grads_.get(), 0, grads_.bytes(), stream_)); }

    // Adds the gradient of the last training forward's loss (made with dloss > 0, on these inputs) to
    // the parameter gradients, so that micro-batches accumulate. With several ranks, `last_micro` (the
    // step's last micro-batch) also queues the gradients' sum over the ranks: -z 0 per layer as backward leaves
    // it, -z 1 one reduce-scatter at the end; update() waits for them.
    void backward(const int* inputs, int B, int T, bool last_micro = false) {
        const bool per_layer = multi_ != nullptr && last_micro && zero_stage_ == 0;
        check_batch(B, T, "backward");
        const GPT2Config& c = config_;
        const int L = c.num_layers, C = c.channels, NH = c.num_heads, Vp = c.padded_vocab_size;
        const int64_t N = int64_t(B) * T;
        const floatX* p = params_.get();
        floatX* g = grads_.get();
        const OuterTensors<const floatX> w = outer(p);
        const OuterTensors<floatX> gw = outer(g);
        float* fscratch = reinterpret_cast<float*>(scratch_.get());
        const size_t sbytes = scratch_.bytes();
        // The weight gradients' side stream (set_dw_stream; dw = 0: everything on stream_). The residual
        // stream's gradient is res[cur]: at level 2 each LayerNorm backward reads it from one buffer and
        // writes the sum to the other (the side's attproj and fcproj dW still read the old one).
        const int dw = dw_stream_applies();
        floatX* res[2] = {d_residual_, dw >= 2 ? dres2_.get() : d_residual_};
        int cur = 0;

        // The classifier shares wte with the embedding: its part of dwte is added here, the rest below. After
        // the exp forward, logits_ holds Y and lnf_ the rows scaled by dloss / s: dwte as usual, d(lnf) = Y wte
        // scaled by the rows' dloss / s.
        const int64_t head_rows = cls90_rows_;
        if (head_rows != 0 && head_rows != N) {
            fail(kExitUsage, "GPT2 backward: B x T = %lld rows, but the training forward before it had %lld",
                 (long long)N, (long long)head_rows);
        }
        linear_backward(d_ln_, gw.wte, nullptr, logits_, lnf_, w.wte, N, C, Vp, nullptr, 1, nullptr);
        if (cls90_rows_ != 0) classifier90_scale_rows(d_ln_, cls90_sums_.get(), cls90_dloss_, N, C, stream_);
        // d_residual_ carries the residual stream's gradient down the layers; LayerNorm backward adds into it, so
        // it starts at zero. Each LayerNorm backward also adds the column sums of the gradient it leaves into the
        // bias gradient of the projection it flows into next (fcproj, attproj): bit for bit what matmul_backward_dw
        // would add, without another pass.
        cudaCheck(cudaMemsetAsync(d_residual_, 0, size_t(N) * C * sizeof(floatX), stream_));
        layernorm_backward(d_residual_, gw.lnfw, gw.lnfb, d_ln_, acts(L - 1).residual3, w.lnfw, lnf_mean_, lnf_rstd_, N,
                           C, fscratch, sbytes, stream_, block(g, L - 1).fcprojb);
        for (int l = L - 1; l >= 0; l--) {
            const BlockTensors<const floatX> b = block(p, l);
            const BlockTensors<floatX> gb = block(g, l);
            const BlockActivations a = acts(l);
            const floatX* residual = l == 0 ? encoded_ : acts(l - 1).residual3;
            // residual3 = residual2 + fcproj(GELU(fch)): the GELU's backward is fused into fcproj's dX. With
            // recompute, the one GELU buffer holds the last layer's forward output: recompute layer l's.
            if (gelu_shared()) gelu_forward(a.fch_gelu, a.fch, N * 4 * C, stream_);
            if (dw > 0 && l < L - 1) dw_->await(dw_->fc_done);  // layer l+1's fc dW reads d_fch_
            linear_backward(d_fch_, gb.fcprojw, nullptr, res[cur], a.fch_gelu, b.fcprojw, N, 4 * C, C, a.fch, 2,
                            &DwSide::fcproj_done);
            // fch = ln2 fcw^T + fcb.
            linear_backward(d_ln_, gb.fcw, gb.fcb, d_fch_, a.ln2, b.fcw, N, C, 4 * C, nullptr, 1, &DwSide::fc_done);
            if (dw >= 2) {
                if (l < L - 1) dw_->await(dw_->attproj_done);  // layer l+1's attproj dW reads the other buffer
                cur = 1 - cur;
            }
            layernorm_backward(res[cur], gb.ln2w, gb.ln2b, d_ln_, a.residual2, b.ln2w, a.ln2_mean, a.ln2_rstd, N, C,
                               fscratch, sbytes, stream_, gb.attprojb, dw >= 2 ? res[1 - cur] : nullptr);
            // residual2 = residual + attproj(atty) (attprojb: ln2's backward).
            linear_backward(d_atty_, gb.attprojw, nullptr, res[cur], a.atty, b.attprojw, N, C, C, nullptr, 2,
                            &DwSide::attproj_done);
            // qkv's bias gradient in bf16: where the wgmma kernels run, attention's backward adds up each 64-row
            // block's column sums of dqkv as it stores it (no pass over dqkv for them), in d_fch_'s last bytes
            // (layer l's fc gradient is spent), or with the side stream
            // (whose fc dW may still read d_fch_) in a buffer of their own.
            float* qkvb_sums = nullptr;
            if (attention_backward_sums_available(B, T, C, NH)) {
                qkvb_sums = dw > 0 ? dw_->qkvb_sums.get()
                                   : reinterpret_cast<float*>(d_fch_ + N * 4 * C) - (N / kAttentionSumRows) * 3 * C;
            }
            if (dw > 0 && l < L - 1) dw_->await(dw_->qkv_done);  // layer l+1's qkv dW reads d_qkv_ and the sums
            // Attention's backward: dqkv, the gradient qkv's backward reads, in d_qkv_.
            attention_backward(lt_, d_qkv_, d_atty_, a.qkv, a.atty, a.att_saved, att_saved_bytes_, B, T, C, NH,
                               scratch_.get(), scratch_.bytes(), stream_, qkvb_sums);
            linear_backward(d_ln_, gb.qkvw, qkvb_sums != nullptr ? nullptr : gb.qkvb, d_qkv_, a.ln1, b.qkvw, N, C, 3 * C,
                            nullptr, 1, nullptr);  // qkv_done is marked below, after the side's bias sums
            if (qkvb_sums != nullptr) {
                bias_grad_from_partials(gb.qkvb, qkvb_sums, N / kAttentionSumRows, 3 * C, dw > 0 ? dw_->stream.get() : stream_);
            }
            if (dw > 0) dw_->mark(dw_->qkv_done);
            if (dw >= 2) {
                dw_->await(dw_->fcproj_done);  // this layer's fcproj dW reads the other buffer
                cur = 1 - cur;
            }
            layernorm_backward(res[cur], gb.ln1w, gb.ln1b, d_ln_, residual, b.ln1w, a.ln1_mean, a.ln1_rstd, N, C,
                               fscratch, sbytes, stream_, l > 0 ? block(g, l - 1).fcprojb : nullptr,
                               dw >= 2 ? res[1 - cur] : nullptr);
            // Layer l's gradients are final: sum them over the ranks while backward goes on below.
            if (per_layer) multi_->all_reduce_sum_async(g, layer_ranges(l), stream_);
        }
        if (dw > 0) {  // every weight gradient is in (the encoder's backward adds to dwte too)
            dw_->mark(dw_->done);
            dw_->await(dw_->done);
        }
        encoder_backward(gw.wte, gw.wpe, res[cur], inputs, B, T, C, Vp, scratch_.get(), sbytes, stream_);
        if (per_layer) {
            std::vector<ShardRange> rest;
            for (int i : {int(kWte), int(kWpe), int(kLnfw), int(kLnfb)}) rest.push_back(tensor_range(i, 0, 1));
            multi_->all_reduce_sum_async(g, rest, stream_);
        } else if (multi_ != nullptr && last_micro) {
            multi_->reduce_scatter_sum_async(g, g + layout_.shard(multi_->rank()).begin, layout_, stream_);
        }
    }

    // Gradient norm, clip factor (grad_clip <= 0: none) and one AdamW step (step from 1), all on the device;
    // the norm lands in *norm_out (grad_norm()'s slot when null); `seed` keys the bf16 stochastic rounding.
    // With several ranks it waits for backward's sums; with ZeRO-1 the norm sums the ranks' shards, each rank
    // updates its shard and the bf16 parameters are all-gathered before the stream reads them again.
    // Step guard (adamw_guard): the update is skipped, all state unchanged, when the norm or any of the
    // n_losses device losses (the micro-batch means) is not finite, or their mean is above loss_limit.
    void update(const AdamWSettings& settings, float grad_clip, int step, uint64_t seed, float* norm_out = nullptr,
                const float* losses = nullptr, int n_losses = 0, float loss_limit = INFINITY) {
        float* norm = norm_out != nullptr ? norm_out : scalars_.get() + 1;
        float* scale = scalars_.get() + 2;
        float* fscratch = reinterpret_cast<float*>(scratch_.get());
        // Summed over W ranks: dividing the norm and the clip scale by W in fp32 gives AdamW the mean gradient.
        const int ranks = multi_ != nullptr ? multi_->world() : 1;
        if (multi_ != nullptr) multi_->join(stream_);
        if (!sharded()) {
            global_norm(norm, scale, grads_.get(), num_params_, grad_clip, fscratch, scratch_.bytes(), stream_, ranks);
            adamw_guard(scale, norm, losses, n_losses, loss_limit, stream_);
            adamw_update(params_.get(), master_.get(), adam_m_.get(), adam_v_.get(), grads_.get(), adamw_table_,
                         settings, step, seed, scale, stream_);
            return;
        }
        float* sumsq = scalars_.get() + 3;
        const ShardRange shard = layout_.shard(multi_->rank());
        global_norm_sumsq(sumsq, grads_.get() + shard.begin, owned_.size(), fscratch, scratch_.bytes(), stream_);
        multi_->all_reduce_sum_async(sumsq, 1, stream_);
        multi_->join(stream_);
        global_norm_finish(norm, scale, sumsq, grad_clip, stream_, ranks);
        adamw_guard(scale, norm, losses, n_losses, loss_limit, stream_);
        adamw_update(params_.get(), master_.get(), adam_m_.get(), adam_v_.get(), grads_.get(), shard_table_, settings,
                     step, seed, scale, stream_, owned_.begin);
        multi_->all_gather_async(params_.get(), layout_, stream_);
        multi_->join(stream_);
    }

private:
    // Flat range of tensor i's slices [first, first + count) along its leading (layer) dimension; a
    // tensor without a layer dimension is one slice.
    ShardRange tensor_range(int i, int first, int count) const {
        const ParamTensorInfo& t = tensors_[size_t(i)];
        const int64_t slices = (i >= kLn1w && i <= kFcprojb) ? config_.num_layers : 1;
        const int64_t per = t.numel / slices;
        return {t.offset + first * per, t.offset + (first + count) * per};
    }
    std::vector<ShardRange> layer_ranges(int l) const {
        std::vector<ShardRange> r;
        for (int i = kLn1w; i <= kFcprojb; i++) r.push_back(tensor_range(i, l, 1));
        return r;
    }

    void check_batch(int B, int T, const char* what) const {
        // Every activation and scratch buffer is sized by B x T tokens (attention's also by T), so a batch of
        // more, shorter rows fits too (the multiple-choice evaluation packs its rows this way).
        if (B < 1 || T < 1 || T > T_ || int64_t(B) * T > int64_t(B_) * T_) {
            fail(kExitUsage, "GPT2 %s: B=%d T=%d, the model was allocated for B x T <= %d x %d tokens and T <= %d",
                 what, B, T, B_, T_, T_);
        }
    }

    // The embedding, the L blocks and the final LayerNorm of forward() and forward_scored(): inputs (B,T)
    // (device int32, B and T already checked) into lnf_ (B*T rows of C), keeping every activation backward
    // reads (but for packed rows: forward_scored's comment).
    void forward_to_lnf(const int* inputs, int B, int T, const PackedRows* packed = nullptr) {
        const GPT2Config& c = config_;
        const int L = c.num_layers, C = c.channels, NH = c.num_heads;
        const int64_t N = int64_t(B) * T;
        const floatX* p = params_.get();
        const OuterTensors<const floatX> w = outer(p);
        if (packed != nullptr) reserve_packed(packed_bytes(B, T));
        encoder_forward(encoded_, inputs, w.wte, w.wpe, B, T, C, stream_, packed != nullptr ? packed->positions : nullptr);
        layernorm_at(0, false, N);
        for (int l = 0; l < L; l++) {
            const BlockTensors<const floatX> b = block(p, l);
            const BlockActivations a = acts(l);
            const floatX* residual = l == 0 ? encoded_ : acts(l - 1).residual3;
            linear_forward(a.qkv, a.ln1, b.qkvw, b.qkvb, N, C, 3 * C);
            if (packed != nullptr) {
                attention_forward_cublaslt(lt_, a.atty, reinterpret_cast<floatX*>(packed_att_.get()), a.qkv, B, T, C,
                                           NH, packed_scratch_.get(), packed_scratch_.bytes(), stream_, packed->groups);
            } else {
                attention_forward(lt_, a.atty, a.att_saved, att_saved_bytes_, a.qkv, B, T, C, NH, scratch_.get(),
                                  scratch_.bytes(), stream_);
            }
            // residual2 = residual + attproj(atty), the add in the matmul's epilogue.
            linear_forward(a.residual2, a.atty, b.attprojw, b.attprojb, N, C, C, nullptr, residual);
            layernorm_at(l, true, N);
            // The GELU output (GELU in the matmul's epilogue, keeping its input fch).
            linear_forward(a.fch_gelu, a.ln2, b.fcw, b.fcb, N, C, 4 * C, a.fch, nullptr);
            // residual3 = residual2 + fcproj(GELU output), the add in the matmul's epilogue.
            linear_forward(a.residual3, a.fch_gelu, b.fcprojw, b.fcprojb, N, 4 * C, C, nullptr, a.residual2);
            // The next block's ln1, or the final LayerNorm.
            layernorm_at(l + 1, false, N);
        }
    }

    // The LayerNorm before layer l's qkv (ln1; l = L: the final one, into lnf_) or fc (ln2 = true).
    void layernorm_at(int l, bool ln2, int64_t N) {
        const int L = config_.num_layers, C = config_.channels;
        const floatX* p = params_.get();
        const BlockActivations a = acts(std::min(l, L - 1)), prev = acts(std::max(l - 1, 0));
        const bool final = l == L;
        const floatX* w = final ? outer(p).lnfw : ln2 ? block(p, l).ln2w : block(p, l).ln1w;
        const floatX* bias = final ? outer(p).lnfb : ln2 ? block(p, l).ln2b : block(p, l).ln1b;
        float* mean = final ? lnf_mean_ : ln2 ? a.ln2_mean : a.ln1_mean;
        float* rstd = final ? lnf_rstd_ : ln2 ? a.ln2_rstd : a.ln1_rstd;
        floatX* out = final ? lnf_ : ln2 ? a.ln2 : a.ln1;
        if (ln2) {
            layernorm_forward(out, mean, rstd, a.residual2, w, bias, N, C, stream_);
        } else if (l == 0) {
            layernorm_forward(out, mean, rstd, encoded_, w, bias, N, C, stream_);
        } else {
            layernorm_forward(out, mean, rstd, prev.residual3, w, bias, N, C, stream_);
        }
    }

    // A linear layer's forward: out (N x cout) = in (N x cin) W^T (+ bias).
    // pre_gelu: GELU in the epilogue, its input kept there; residual: out = residual + that (bf16).
    void linear_forward(floatX* out, const floatX* in, const floatX* w, const floatX* bias, int64_t N, int cin, int cout,
                        floatX* pre_gelu = nullptr, const floatX* residual = nullptr) {
        matmul_forward(lt_, out, in, w, bias, N, cin, cout, stream_, pre_gelu, residual);
    }

    // A linear layer's backward (in (N x cin) -> out (N x cout) through w; dout: out's gradient). dinp = dout W
    // (times GELU'(pre_gelu) where given: the GELU's backward fused), skipped where dinp is null; dweight +=
    // dout^T in; dbias += dout's column sums where given. dW on the side stream where set_dw_stream's level is
    // side_level or above: after fork(), marking `done` there after it, dX on stream_ beside it.
    void linear_backward(floatX* dinp, floatX* dweight, floatX* dbias, const floatX* dout, const floatX* in,
                         const floatX* w, int64_t N, int cin, int cout, const floatX* pre_gelu, int side_level,
                         Event DwSide::*done) {
        DwSide* side = dw_stream_applies() >= side_level ? dw_.get() : nullptr;
        if (side != nullptr) {
            side->fork();
            matmul_backward_dw(side->lt, dweight, dbias, dout, in, N, cin, cout,
                               reinterpret_cast<float*>(side->scratch.get()), side->scratch.bytes(), side->stream);
            if (done != nullptr) side->mark(side->*done);
        }
        if (dinp != nullptr) matmul_backward_dx(lt_, dinp, dout, w, N, cin, cout, stream_, pre_gelu);
        if (side != nullptr) return;
        matmul_backward_dw(lt_, dweight, dbias, dout, in, N, cin, cout, reinterpret_cast<float*>(scratch_.get()),
                           scratch_.bytes(), stream_);
    }

    // Whether backward's weight gradients can run on a second stream (set_dw_stream): bf16, one GPU, no recompute.
    bool dw_stream_possible() const { return multi_ == nullptr && !gelu_shared(); }
    // Whether the layers share one GELU buffer (recompute).
    bool gelu_shared() const { return recompute_gelu_; }

    // Carves every activation, activation gradient and the shared scratch out of three allocations.
    // Per-layer tensors are strided by the allocated B x T, so smaller batches use a prefix of each.
    void allocate_activations() {
        const GPT2Config& c = config_;
        const size_t C = size_t(c.channels);
        const size_t N = size_t(B_) * size_t(T_);
        nc_ = N * C;
        n_ = N;
        // What attention saves for backward (flash: lse; other head sizes: the probabilities), per layer.
        att_saved_bytes_ = align256(attention_saved_bytes(B_, c.num_heads, T_, c.channels / c.num_heads));
        carve_activations();
        const size_t X = sizeof(floatX);
        const Slot act_grads[] = {
            {reinterpret_cast<void**>(&d_residual_), N * C * X},
            {reinterpret_cast<void**>(&d_ln_), N * C * X},
            {reinterpret_cast<void**>(&d_atty_), N * C * X},
            {reinterpret_cast<void**>(&d_qkv_), N * 3 * C * X},
            {reinterpret_cast<void**>(&d_fch_), N * 4 * C * X},
        };
        memory_.activation_grads = carve(act_grads_, act_grads, sizeof(act_grads) / sizeof(act_grads[0]));
        // Poisoned (NaN in bf16 and fp32), so that reading something no kernel wrote shows up at once.
        cudaCheck(cudaMemsetAsync(act_grads_.get(), 0xff, act_grads_.bytes(), stream_));

        // One scratch buffer serves every kernel that needs one: they run one after another on one stream.
        const int64_t n = int64_t(N);
        size_t scratch = attention_scratch_bytes(B_, c.num_heads, T_, c.channels / c.num_heads);
        scratch = std::max(scratch, encoder_backward_scratch_bytes(B_, T_, c.padded_vocab_size));
        scratch = std::max(scratch, layernorm_backward_scratch_bytes(n, c.channels));
        scratch = std::max(scratch, matmul_backward_scratch_bytes(n, 4 * c.channels));
        scratch = std::max(scratch, kGlobalNormScratchBytes);
        scratch_.allocate(scratch);
        memory_.scratch = scratch_.bytes() + lt_.workspace_bytes();
        memory_.params = params_.bytes();
        memory_.grads = grads_.bytes();
        memory_.optimizer = master_.bytes() + adam_m_.bytes() + adam_v_.bytes();
    }

    // The activations backward reads (acts_, poisoned).
    void carve_activations() {
        const GPT2Config& c = config_;
        const size_t L = size_t(c.num_layers), C = size_t(c.channels), Vp = size_t(c.padded_vocab_size);
        const size_t N = n_;
        const size_t X = sizeof(floatX), F = sizeof(float);
        const Slot acts[] = {
            {reinterpret_cast<void**>(&encoded_), N * C * X},
            {reinterpret_cast<void**>(&ln1_), L * N * C * X},
            {reinterpret_cast<void**>(&ln1_mean_), L * N * F},
            {reinterpret_cast<void**>(&ln1_rstd_), L * N * F},
            {reinterpret_cast<void**>(&qkv_), L * N * 3 * C * X},
            {reinterpret_cast<void**>(&atty_), L * N * C * X},
            {reinterpret_cast<void**>(&att_saved_), L * att_saved_bytes_},
            {reinterpret_cast<void**>(&proj_), N * C * X},
            {reinterpret_cast<void**>(&residual2_), L * N * C * X},
            {reinterpret_cast<void**>(&ln2_), L * N * C * X},
            {reinterpret_cast<void**>(&ln2_mean_), L * N * F},
            {reinterpret_cast<void**>(&ln2_rstd_), L * N * F},
            {reinterpret_cast<void**>(&fch_), L * N * 4 * C * X},
            {reinterpret_cast<void**>(&fch_gelu_), (gelu_shared() ? 1 : L) * N * 4 * C * X},
            {reinterpret_cast<void**>(&residual3_), L * N * C * X},
            {reinterpret_cast<void**>(&lnf_), N * C * X},
            {reinterpret_cast<void**>(&lnf_mean_), N * F},
            {reinterpret_cast<void**>(&lnf_rstd_), N * F},
            {reinterpret_cast<void**>(&logits_), N * Vp * X},
            {reinterpret_cast<void**>(&losses_), N * F},
        };
        memory_.activations = carve(acts_, acts, sizeof(acts) / sizeof(acts[0]));
        cudaCheck(cudaMemsetAsync(acts_.get(), 0xff, acts_.bytes(), stream_));
    }

    struct Slot {
        void** ptr;
        size_t bytes;  // 0: the pointer is null
    };
    // One allocation for the slots, each at a 256-byte boundary.
    static size_t carve(DeviceBuffer<char>& buf, const Slot* slots, size_t count) {
        size_t total = 0;
        for (size_t i = 0; i < count; i++) total += align256(slots[i].bytes);
        buf.allocate(total);
        size_t at = 0;
        for (size_t i = 0; i < count; i++) {
            *slots[i].ptr = slots[i].bytes > 0 ? buf.get() + at : nullptr;
            at += align256(slots[i].bytes);
        }
        return total;
    }

    template <class T>
    OuterTensors<T> outer(T* base) const {
        auto at = [&](int i) { return base + tensors_[size_t(i)].offset; };
        return {at(kWte), at(kWpe), at(kLnfw), at(kLnfb)};
    }
    template <class T>
    BlockTensors<T> block(T* base, int l) const {
        auto at = [&](int i) { return base + tensor_range(i, l, 1).begin; };
        return {at(kLn1w), at(kLn1b), at(kQkvw),  at(kQkvb), at(kAttprojw), at(kAttprojb),
                at(kLn2w), at(kLn2b), at(kFcw),   at(kFcb),  at(kFcprojw),  at(kFcprojb)};
    }
    BlockActivations acts(int l) const {
        const size_t L = size_t(l);
        BlockActivations a;
        a.ln1 = ln1_ + L * nc_;
        a.ln1_mean = ln1_mean_ + L * n_;
        a.ln1_rstd = ln1_rstd_ + L * n_;
        a.qkv = qkv_ + L * 3 * nc_;
        a.atty = atty_ + L * nc_;
        a.att_saved = att_saved_ + L * att_saved_bytes_;
        a.residual2 = residual2_ + L * nc_;
        a.ln2 = ln2_ + L * nc_;
        a.ln2_mean = ln2_mean_ + L * n_;
        a.ln2_rstd = ln2_rstd_ + L * n_;
        a.fch = fch_ + L * 4 * nc_;
        a.fch_gelu = fch_gelu_ + (gelu_shared() ? 0 : L * 4 * nc_);
        a.residual3 = residual3_ + L * nc_;
        return a;
    }

    GPT2Config config_;
    int B_, T_;
    cudaStream_t stream_;
    std::array<ParamTensorInfo, kNumParamTensors> tensors_;
    AdamWTensors adamw_table_;
    MultiGpu* multi_ = nullptr;
    int zero_stage_ = 0;
    bool recompute_gelu_ = false;
    ZeroLayout layout_;        // ZeRO-1 only
    ShardRange owned_;         // ZeRO-1: the parameters this rank updates
    AdamWTensors shard_table_; // ZeRO-1: adamw_table_ cut to owned_
    int64_t num_params_ = 0;
    Memory memory_;
    CublasLt lt_;

    DeviceBuffer<floatX> params_, grads_;
    DeviceBuffer<float> master_, adam_m_, adam_v_;
    DeviceBuffer<float> scalars_;  // mean loss, grad norm, clip scale, ZeRO-1's sum of squares

    DeviceBuffer<char> acts_, act_grads_, scratch_;
    DeviceBuffer<char> packed_att_, packed_scratch_;  // forward_scored's packed rows: attention's, one layer at a time
    // The classifier's exp forward (set_classifier_exp): on, its scratch, and the rows and dloss of the
    // training forward that ran it (0: the last forward did not).
    bool classifier_exp_ = false;
    DeviceBuffer<float> cls90_c_, cls90_sums_, cls90_partial_;
    int64_t cls90_rows_ = 0;
    float cls90_dloss_ = 0.0f;
    size_t nc_ = 0, n_ = 0, att_saved_bytes_ = 0;
    // Activations of the last forward (layer-major where per layer).
    floatX *encoded_ = nullptr, *ln1_ = nullptr, *qkv_ = nullptr, *atty_ = nullptr;
    char* att_saved_ = nullptr;  // attention's saved state, att_saved_bytes_ per layer
    // forward_scored's gathered lnf rows.
    floatX *proj_ = nullptr;
    floatX *residual2_ = nullptr, *ln2_ = nullptr, *fch_ = nullptr, *fch_gelu_ = nullptr, *residual3_ = nullptr;
    floatX *lnf_ = nullptr, *logits_ = nullptr;
    float *ln1_mean_ = nullptr, *ln1_rstd_ = nullptr, *ln2_mean_ = nullptr, *ln2_rstd_ = nullptr;
    float *lnf_mean_ = nullptr, *lnf_rstd_ = nullptr, *losses_ = nullptr;
    // Gradients of activations: one layer's worth, reused as backward walks down the layers.
    floatX *d_residual_ = nullptr, *d_ln_ = nullptr, *d_atty_ = nullptr, *d_qkv_ = nullptr, *d_fch_ = nullptr;
    // The weight gradients' stream (set_dw_stream); dres2_: the residual stream's gradient's second buffer
    // (level 2).
    std::unique_ptr<DwSide> dw_;
    int dw_level_ = 0;
    DeviceBuffer<floatX> dres2_;
};

}  // namespace llmc
