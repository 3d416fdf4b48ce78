/*
Multiple-choice evaluation (HellaSwag and sets like it) with the GPU model of llmc/gpt2.cuh: the items,
rows, scores and rules of llmc/mc_eval.h, run through model.forward_scored().

McEvalGpu(model) allocates, once, what a run needs beside the model: a device buffer for a batch's inputs,
positions, attention groups, scored positions and their targets, a device slot for the forward's mean
loss (so the model's own mean_loss() is left as the trainer set it), and two pinned host buffers each for
tokens and losses.
run(set) then:
  - takes this rank's items (mc_rank_items: a contiguous share; all of them on one GPU) and lays them out
    in packed rows (McPackedBatcher): an item's context once, then its endings, each attending to the
    context and to itself only (attention groups) with the positions it has in a row of its own; batches
    of at most the model's B x T positions, each batch's T its longest row rounded up to kTMultiple. The
    quick start's held-out set has contexts of ~64 tokens and four endings of ~16: 124 positions per item
    instead of 316 in four rows (McEvalGpu(model, false) runs those: one ending per row, plain causal
    attention, for comparisons);
  - per batch: the inputs, positions and groups (n = B' x T' each) and the M scored positions (every
    ending's predictions) with their targets to the GPU in one copy; forward_scored, which runs the
    transformer on all n positions but the classifier (the lm_head matmul and the softmax over Vp
    columns) on the M scored ones only; the M losses back. While the GPU runs one batch, the host fills
    the next and sums the ending losses of the one before (mc_accumulate_packed: the same sums, in the same
    order, as mc_accumulate over the rows of McBatcher);
  - with several ranks (model.multi() non-null): checks that every rank holds the same items, then
    shares the per-row loss sums with one all-reduce sum of their bit patterns (each row is summed by
    exactly one rank and the others contribute zero bits, so the sum is an exact gather), and every rank
    scores every item from the same numbers. The single-GPU path makes no NCCL call.
The result (mc_score) holds the counts and every item's predictions and row scores, on every rank. The
scores equal the CPU reference's (mc_eval_cpu: one row per ending) to within the GPU's bf16 rounding.

Memory: the packed rows' attention keeps a batch's (B', NH, T', T') probabilities and scores (the
cuBLASLt path) one layer at a time, in buffers the model grows to the largest batch: for the quick
start's d12 (B x T = 32 x 512, rows of 124 positions) ~0.4 GB. reserve(set) allocates them ahead (the
trainer does, before its first step).

The model's cuBLASLt tuning (GPT2::set_gemm_tuning) is off during a run and restored after it: the evaluation's
shapes (B' x T' and M differ from training's) are run a few dozen times per evaluation and a run has few
evaluations, so tuning them at their first call (timing up to 8 candidates several times each) costs more
than it could save. The heuristic's first choice, run instead, is deterministic for a given shape, GPU and
library, so runs stay reproducible.

The run overwrites the model's activations, logits and losses (not its parameters, gradients or
optimizer state): call it between optimizer steps, not between a forward and its backward.

Does not provide: the schedule (which steps evaluate) or logging (the trainers), loading items
(mc_eval.h), or several evaluations in flight at once (one McEvalGpu runs one set at a time).
*/
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "llmc/cuda_utils.cuh"
#include "llmc/gpt2.cuh"
#include "llmc/mc_eval.h"
#include "llmc/multi_gpu.cuh"
#include "llmc/utils.h"

namespace llmc {

class McEvalGpu {
public:
    // A batch's T is rounded up to a multiple of this (at most the model's T).
    static constexpr int kTMultiple = 16;

    // A batch's n inputs, positions and groups, its M scored positions and their M targets (n and M at
    // most the model's B x T): at most 5 x B x T ints. share: the packed layout (the file's comment); false: one ending per row.
    explicit McEvalGpu(GPT2& model, bool share = true)
        : model_(model), share_(share), tokens_(size_t(5) * cells()), mean_(1),
          host_tokens_{PinnedBuffer(5 * cells() * sizeof(int), cudaHostAllocWriteCombined),
                       PinnedBuffer(5 * cells() * sizeof(int), cudaHostAllocWriteCombined)},
          host_losses_{PinnedBuffer(cells() * sizeof(float)), PinnedBuffer(cells() * sizeof(float))} {}
    McEvalGpu(const McEvalGpu&) = delete;
    McEvalGpu& operator=(const McEvalGpu&) = delete;

    // Allocates, ahead, the model's buffers for the packed rows of every batch run(set) will make on this
    // rank (GPT2::reserve_packed: the attention's (B', NH, T', T') probabilities and scratch), so that a
    // run allocates nothing. Returns their bytes. A no-op without sharing (one ending per row runs the
    // model's own attention).
    size_t reserve(const McSet& set) {
        if (!share_) return model_.packed_reserved_bytes();
        McPackedBatcher batcher = rank_batcher(set);
        GPT2::PackedBytes most;
        McPackedBatch b;
        while (batcher.next(b)) {
            const GPT2::PackedBytes need = model_.packed_bytes(b.B, b.T);
            most.att = std::max(most.att, need.att);
            most.scratch = std::max(most.scratch, need.scratch);
        }
        model_.reserve_packed(most);
        return model_.packed_reserved_bytes();
    }

    // Positions the last run() put through the transformer (its batches' B x T, padding included), and
    // of those the scored ones: what the layout saves shows here.
    int64_t positions_run() const { return positions_run_; }
    int64_t positions_scored() const { return positions_scored_; }

    // Every rank calls it with the same set; every rank gets the whole result.
    McResult run(const McSet& set) {
        MultiGpu* multi = model_.multi();
        const cudaStream_t stream = model_.stream();
        const GemmTuningOff no_tuning(model_);  // the file's comment
        McPackedBatcher batcher = rank_batcher(set);
        if (multi != nullptr) multi->check_same(mc_fingerprint(set), "the multiple-choice items");
        std::vector<double> loss_sum(size_t(mc_first_rows(set).back()), 0.0);
        positions_run_ = positions_scored_ = 0;

        // Two slots: the host fills slot k while the GPU may still run the batch in slot 1 - k.
        McPackedBatch batch[2];
        bool pending[2] = {false, false};
        int k = 0;
        auto finish = [&](int slot) {
            cudaCheck(cudaEventSynchronize(done_[slot]));
            mc_accumulate_packed(batch[slot], reinterpret_cast<const float*>(host_losses_[slot].get()), loss_sum);
            pending[slot] = false;
        };
        while (batcher.next(batch[k])) {
            const McPackedBatch& b = batch[k];
            const size_t n = size_t(b.B) * size_t(b.T), m = b.scored.size();
            if (n > cells() || m > cells() || b.targets.size() != m) {
                fail(kExitUsage, "McEvalGpu: a batch of %zu positions, %zu of them scored (%zu targets), for buffers "
                     "of %zu", n, m, b.targets.size(), cells());
            }
            positions_run_ += int64_t(n);
            positions_scored_ += int64_t(m);
            // inputs, positions, groups (n each), scored, targets (m each): one copy.
            int* host = reinterpret_cast<int*>(host_tokens_[k].get());
            const std::vector<int>* parts[5] = {&b.inputs, &b.positions, &b.groups, &b.scored, &b.targets};
            size_t at = 0;
            int* dev[5];
            for (int i = 0; i < 5; i++) {
                std::memcpy(host + at, parts[i]->data(), parts[i]->size() * sizeof(int));
                dev[i] = tokens_.get() + at;
                at += parts[i]->size();
            }
            cudaCheck(cudaMemcpyAsync(tokens_.get(), host, at * sizeof(int), cudaMemcpyHostToDevice, stream));
            const GPT2::PackedRows packed{dev[1], dev[2]};
            model_.forward_scored(dev[0], b.B, b.T, dev[3], dev[4], int64_t(m), mean_.get(), share_ ? &packed : nullptr);
            cudaCheck(cudaMemcpyAsync(host_losses_[k].get(), model_.losses(), m * sizeof(float),
                                      cudaMemcpyDeviceToHost, stream));
            cudaCheck(cudaEventRecord(done_[k], stream));
            pending[k] = true;
            k = 1 - k;
            if (pending[k]) finish(k);
            if (multi != nullptr) multi->heartbeat();
        }
        for (int slot = 0; slot < 2; slot++) {
            if (pending[slot]) finish(slot);
        }
        if (multi != nullptr) gather_rows(*multi, loss_sum, stream);
        return mc_score(set, std::move(loss_sum));
    }

private:
    // Turns the model's cuBLASLt tuning off for its lifetime and then restores the setting it found, also
    // when the run ends with an exception.
    class GemmTuningOff {
    public:
        explicit GemmTuningOff(GPT2& model) : model_(model), was_(model.gemm_tuning()) {
            model_.set_gemm_tuning(false);
        }
        ~GemmTuningOff() { model_.set_gemm_tuning(was_); }
        GemmTuningOff(const GemmTuningOff&) = delete;
        GemmTuningOff& operator=(const GemmTuningOff&) = delete;

    private:
        GPT2& model_;
        bool was_;
    };

    size_t cells() const { return size_t(model_.max_B()) * size_t(model_.max_T()); }

    // This rank's items (mc_rank_items) in the batches run() makes of them.
    McPackedBatcher rank_batcher(const McSet& set) const {
        const MultiGpu* multi = model_.multi();
        const std::pair<int64_t, int64_t> range = mc_rank_items(int64_t(set.items.size()), multi ? multi->rank() : 0,
                                                                multi ? multi->world() : 1);
        return McPackedBatcher(set, range.first, range.second, model_.max_T(), kTMultiple, model_.config().vocab_size,
                               int64_t(cells()), share_);
    }

    // Rows this rank did not run are +0.0, whose bits are zero: the sum of the bit patterns over ranks is
    // the one rank's value, exactly.
    void gather_rows(MultiGpu& multi, std::vector<double>& loss_sum, cudaStream_t stream) {
        static_assert(sizeof(double) == sizeof(uint64_t), "a double travels as a uint64");
        const size_t n = loss_sum.size(), bytes = n * sizeof(uint64_t);
        if (rows_.size() < n) rows_.allocate(n);
        cudaCheck(cudaMemcpyAsync(rows_.get(), loss_sum.data(), bytes, cudaMemcpyHostToDevice, stream));
        multi.all_reduce_sum_async(rows_.get(), n, stream);
        multi.join(stream);
        cudaCheck(cudaMemcpyAsync(loss_sum.data(), rows_.get(), bytes, cudaMemcpyDeviceToHost, stream));
        cudaCheck(cudaStreamSynchronize(stream));
    }

    GPT2& model_;
    bool share_;
    int64_t positions_run_ = 0, positions_scored_ = 0;
    DeviceBuffer<int> tokens_;  // inputs, positions, groups, scored positions, their targets: the batch in flight
    DeviceBuffer<float> mean_;
    PinnedBuffer host_tokens_[2], host_losses_[2];
    Event done_[2];
    DeviceBuffer<uint64_t> rows_;  // several ranks: the row sums being shared (kept for the next run)
};

}  // namespace llmc
