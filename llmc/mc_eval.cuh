/*
Multiple-choice evaluation (HellaSwag and sets like it) with the GPU model of llmc/gpt2.cuh: the items,
rows, scores and rules of llmc/mc_eval.h, run through model.forward_scored().
run(set) takes this rank's items, lays them out in packed rows (McPackedBatcher: an item's context once,
its endings after it, attention groups), and per batch copies inputs, positions, groups and scored
positions in one copy, runs the transformer on all positions but the classifier on the scored ones, and
sums the ending losses of the previous batch while the GPU runs. Several ranks share the per-row sums
through one all-reduce of their bit patterns (an exact gather); every rank scores every item. Scores
equal the CPU reference's within bf16 rounding.
reserve(set) allocates the packed attention's buffers ahead. cuBLASLt tuning is off during a run (its
shapes are too few calls to repay it). A run overwrites the model's activations, logits and losses:
call it between optimizer steps.
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

    // A batch's inputs, positions, groups, scored positions and targets: at most 5 x B x T ints. share: the
    // packed layout; false: one ending per row.
    explicit McEvalGpu(GPT2& model, bool share = true)
        : model_(model), share_(share), tokens_(size_t(5) * cells()), mean_(1),
          host_tokens_{PinnedBuffer(5 * cells() * sizeof(int), cudaHostAllocWriteCombined),
                       PinnedBuffer(5 * cells() * sizeof(int), cudaHostAllocWriteCombined)},
          host_losses_{PinnedBuffer(cells() * sizeof(float)), PinnedBuffer(cells() * sizeof(float))} {}
    McEvalGpu(const McEvalGpu&) = delete;
    McEvalGpu& operator=(const McEvalGpu&) = delete;

    // Allocates ahead the model's buffers for every packed batch run(set) will make on this rank, so a run
    // allocates nothing; returns their bytes. A no-op without sharing.
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

    // Positions the last run() put through the transformer (padding included), and the scored ones.
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
    // Turns the model's cuBLASLt tuning off for its lifetime, then restores it (exceptions included).
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

    // Rows this rank did not run are +0.0 (zero bits): the sum of bit patterns is the one rank's value.
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
