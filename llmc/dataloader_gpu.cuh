/*
The DataLoader's GPU side: batches as int32 inputs[B*T] and targets[B*T] in device memory, ready before
the compute stream needs them. Streaming mode: the host DataLoader fills pinned buffers on its thread;
each next_batch() hands out the batch prepared during the previous call and queues the next (async copy
and widening kernel on a copy stream, ordered by events; two device slots alternate). GPU-resident mode:
when the split fits the budget, the shards are uploaded once and checked on the device, and a step is
one kernel that cuts the batch out. Both yield exactly the host path's batches and share its state blob.
Pointers from next_batch() are valid for work queued on the compute stream before the next call.
*/
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include <cuda_runtime.h>

#include "llmc/cuda_utils.cuh"
#include "llmc/dataloader.h"
#include "llmc/device_file_io.cuh"

namespace llmc {

// rows: B rows of T+1 tokens. inputs[b*T + t] = row b token t, targets[b*T + t] = row b token t+1.
template <class Tok>
__global__ void unpack_rows_kernel(const Tok* rows, int B, int T, int* inputs, int* targets) {
    size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= size_t(B) * T) return;
    size_t b = i / T, t = i % T;
    const Tok* row = rows + b * (T + 1);
    inputs[i] = int(row[t]);
    targets[i] = int(row[t + 1]);
}

// A resident sample-list entry: the byte offset of the sample's first token, shifted left by one, bit 0
// set for 32-bit tokens.
__host__ __device__ inline uint64_t resident_entry(uint64_t byte_offset, int bytes_per_token) {
    return (byte_offset << 1) | (bytes_per_token == 4 ? 1u : 0u);
}

// Row b of the batch is stream sample first + b: epoch list `current` while it is below S, else the
// next epoch's list. Grid: (blocks over T, B).
__global__ void cut_resident_batch_kernel(const uint8_t* data, const uint64_t* current, const uint64_t* next,
                                          uint64_t first, uint64_t S, int T, int* inputs, int* targets) {
    int b = blockIdx.y;
    uint64_t idx = first + b;
    uint64_t entry = idx < S ? current[idx] : next[idx - S];
    const uint8_t* base = data + (entry >> 1);
    bool wide = entry & 1;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < T; t += gridDim.x * blockDim.x) {
        uint32_t in, tg;
        if (wide) {
            in = reinterpret_cast<const uint32_t*>(base)[t];
            tg = reinterpret_cast<const uint32_t*>(base)[t + 1];
        } else {
            in = reinterpret_cast<const uint16_t*>(base)[t];
            tg = reinterpret_cast<const uint16_t*>(base)[t + 1];
        }
        inputs[size_t(b) * T + t] = int(in);
        targets[size_t(b) * T + t] = int(tg);
    }
}

// Lowers *first_bad to the smallest index whose token is not below vocab.
template <class Tok>
__global__ void find_bad_token_kernel(const Tok* tokens, uint64_t n, uint32_t vocab, unsigned long long* first_bad) {
    for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x) {
        if (uint32_t(tokens[i]) >= vocab) {
            atomicMin(first_bad, (unsigned long long)i);
            return;
        }
    }
}

inline HostAllocator pinned_host_allocator() {
    HostAllocator a;
    a.allocate = [](size_t n) {
        void* p = nullptr;
        cudaCheck(cudaHostAlloc(&p, n, cudaHostAllocDefault));
        return p;
    };
    a.release = [](void* p) { cudaFreeHost(p); };
    return a;
}

struct DeviceBatch {
    const int* inputs = nullptr;   // B*T token ids
    const int* targets = nullptr;  // B*T token ids, inputs shifted by one
    uint64_t index = 0;            // global batch number
    uint64_t epoch = 0;            // epoch of this rank's first sample in the batch
};

class GpuDataLoader {
public:
    // compute: the consumer's stream. resident_budget_bytes: device memory the split may take (0: stream).
    GpuDataLoader(DataLoaderConfig cfg, cudaStream_t compute, size_t resident_budget_bytes = 0)
        : schedule_(with_pinned_allocator(cfg)), compute_(compute) {
        const DataLoaderConfig& c = schedule_.config();
        size_t rows = size_t(c.B) * size_t(c.T);
        uint64_t data_bytes = 0;
        for (const ShardInfo& s : schedule_.shards()) data_bytes += aligned(uint64_t(s.num_tokens) * s.bytes_per_token);
        resident_bytes_ = data_bytes + 2 * schedule_.samples_per_epoch() * sizeof(uint64_t) + 2 * rows * sizeof(int);
        resident_ = resident_budget_bytes > 0 && resident_bytes_ <= resident_budget_bytes;
        if (resident_) {
            upload(data_bytes);
            r_inputs_.allocate(rows);
            r_targets_.allocate(rows);
            cudaCheck(cudaMemsetAsync(r_inputs_.get(), 0xff, r_inputs_.bytes(), compute_));
            cudaCheck(cudaMemsetAsync(r_targets_.get(), 0xff, r_targets_.bytes(), compute_));
            for (int i = 0; i < 2; i++) {
                lists_[i].allocate(schedule_.samples_per_epoch());
                list_host_[i].allocate(schedule_.samples_per_epoch() * sizeof(uint64_t));
            }
            cudaCheck(cudaStreamSynchronize(compute_));
        } else {
            host_ = std::make_unique<DataLoader>(schedule_);
            for (DeviceSlot& d : slots_) {
                d.packed.allocate(schedule_.batch_bytes());
                d.inputs.allocate(rows);
                d.targets.allocate(rows);
                // Poisoned, so that a batch that was never copied shows up as invalid ids, not old data.
                cudaCheck(cudaMemsetAsync(d.inputs.get(), 0xff, d.inputs.bytes(), copy_));
                cudaCheck(cudaMemsetAsync(d.targets.get(), 0xff, d.targets.bytes(), copy_));
            }
            h2d_done_ = std::vector<Event>(host_->ring_size());
        }
    }
    GpuDataLoader(const GpuDataLoader&) = delete;
    GpuDataLoader& operator=(const GpuDataLoader&) = delete;
    ~GpuDataLoader() {
        // Pinned host buffers must outlive the copies queued from them.
        cudaStreamSynchronize(copy_);
        for (const Event& e : list_uploaded_) cudaEventSynchronize(e);
    }

    DeviceBatch next_batch() { return resident_ ? next_resident() : next_streamed(); }

    bool resident() const { return resident_; }
    uint64_t resident_bytes() const { return resident_bytes_; }  // what resident mode needs (or would need)
    const SampleSchedule& schedule() const { return schedule_; }
    uint64_t position() const { return position_; }  // the index of the next batch
    uint64_t epoch() const { return schedule_.epoch_of_batch(position_); }
    std::vector<uint8_t> state() const { return schedule_.encode_state(position_); }
    // allow_world_change: accept a state saved with another number of ranks (see SampleSchedule::decode_state).
    void restore(const std::vector<uint8_t>& blob, bool allow_world_change = false) {
        seek(schedule_.decode_state(blob, allow_world_change));
    }
    void reset() { seek(0); }
    void seek(uint64_t batch) {
        if (!resident_) {
            cudaCheck(cudaStreamSynchronize(copy_));
            pending_.clear();
            host_->seek(batch);
            lookahead_ = false;
        }
        position_ = batch;
    }

private:
    struct DeviceSlot {
        DeviceBuffer<uint8_t> packed;
        DeviceBuffer<int> inputs, targets;
        Event ready;
        uint64_t index = 0, epoch = 0;
    };

    static DataLoaderConfig with_pinned_allocator(DataLoaderConfig cfg) {
        cfg.allocator = pinned_host_allocator();
        return cfg;
    }
    static uint64_t aligned(uint64_t n) { return (n + 15) / 16 * 16; }

    DeviceBatch next_streamed() {
        cudaCheck(cudaEventRecord(compute_mark_, compute_));
        if (!lookahead_) enqueue(cur_, false);
        DeviceSlot& d = slots_[cur_];
        cudaCheck(cudaStreamWaitEvent(compute_, d.ready, 0));
        DeviceBatch out{d.inputs.get(), d.targets.get(), d.index, d.epoch};
        position_++;
        cur_ ^= 1;
        lookahead_ = enqueue(cur_, true);
        return out;
    }

    // Copies the host loader's next batch into device slot `slot` and widens it there, on the copy stream.
    // A look-ahead batch's host error is left for the call that hands that batch out.
    bool enqueue(int slot, bool lookahead) {
        release_finished_copies();
        // At most ring_size buffers are out at once; past that, wait for the oldest copy (this also bounds
        // how far the host runs ahead of the GPU).
        while (pending_.size() >= h2d_done_.size()) {
            cudaCheck(cudaEventSynchronize(h2d_done_[pending_.front()]));
            host_->release();
            pending_.pop_front();
        }
        const HostBatch* hb;
        try {
            hb = &host_->acquire();
        } catch (const Error& e) {
            if (lookahead && e.exit_code() != kExitCuda) return false;
            throw;
        }
        DeviceSlot& d = slots_[slot];
        cudaCheck(cudaStreamWaitEvent(copy_, compute_mark_, 0));
        cudaCheck(cudaMemcpyAsync(d.packed.get(), hb->tokens, schedule_.batch_bytes(), cudaMemcpyHostToDevice, copy_));
        int ev = next_h2d_;
        next_h2d_ = (next_h2d_ + 1) % int(h2d_done_.size());
        cudaCheck(cudaEventRecord(h2d_done_[ev], copy_));
        pending_.push_back(ev);
        int B = hb->B, T = hb->T;
        int threads = 256;
        unsigned blocks = unsigned((size_t(B) * T + threads - 1) / threads);
        if (hb->token_bytes == 2) {
            unpack_rows_kernel<<<blocks, threads, 0, copy_>>>(reinterpret_cast<const uint16_t*>(d.packed.get()), B, T,
                                                              d.inputs.get(), d.targets.get());
        } else {
            unpack_rows_kernel<<<blocks, threads, 0, copy_>>>(reinterpret_cast<const uint32_t*>(d.packed.get()), B, T,
                                                              d.inputs.get(), d.targets.get());
        }
        cudaCheckLaunch();
        cudaCheck(cudaEventRecord(d.ready, copy_));
        d.index = hb->index;
        d.epoch = hb->epoch;
        return true;
    }

    // Gives host buffers back to the loader thread once their copies are done, oldest first.
    void release_finished_copies() {
        while (!pending_.empty()) {
            cudaError_t e = cudaEventQuery(h2d_done_[pending_.front()]);
            if (e == cudaErrorNotReady) break;
            cudaCheck(e);
            host_->release();
            pending_.pop_front();
        }
    }

    DeviceBatch next_resident() {
        const DataLoaderConfig& c = schedule_.config();
        uint64_t S = schedule_.samples_per_epoch();
        uint64_t first = schedule_.first_sample(position_);
        uint64_t e0 = first / S, e1 = (first + c.B - 1) / S;
        ensure_list(e0);
        ensure_list(e1);
        dim3 grid(unsigned((c.T + 255) / 256), unsigned(c.B));
        cut_resident_batch_kernel<<<grid, 256, 0, compute_>>>(data_.get(), lists_[e0 % 2].get(), lists_[e1 % 2].get(),
                                                              first - e0 * S, S, c.T, r_inputs_.get(), r_targets_.get());
        cudaCheckLaunch();
        DeviceBatch out{r_inputs_.get(), r_targets_.get(), position_, e0};
        position_++;
        return out;
    }

    // Makes epoch's device sample list current in slot epoch % 2, queued on the compute stream (after
    // every kernel that still reads the list it replaces).
    void ensure_list(uint64_t epoch) {
        int i = int(epoch % 2);
        if (list_valid_[i] && list_epoch_[i] == epoch) return;
        cudaCheck(cudaEventSynchronize(list_uploaded_[i]));  // the staging buffer is free again
        uint64_t* host = reinterpret_cast<uint64_t*>(list_host_[i].get());
        size_t n = 0;
        schedule_.visit_epoch(epoch, [&](uint32_t shard, int64_t token_offset) {
            int bpt = schedule_.shards()[shard].bytes_per_token;
            host[n++] = resident_entry(shard_base_[shard] + uint64_t(token_offset) * bpt, bpt);
        });
        cudaCheck(cudaMemcpyAsync(lists_[i].get(), host, n * sizeof(uint64_t), cudaMemcpyHostToDevice, compute_));
        cudaCheck(cudaEventRecord(list_uploaded_[i], compute_));
        list_epoch_[i] = epoch;
        list_valid_[i] = true;
    }

    // Reads every shard's tokens into one device array (each shard 16-byte aligned) and checks them all.
    void upload(uint64_t data_bytes) {
        data_.allocate(data_bytes);
        DeviceFileIO io;
        uint64_t at = 0;
        for (const ShardInfo& s : schedule_.shards()) {
            File f(s.path, File::Mode::Read);
            ShardHeader h = read_shard_header(f);
            if (h.num_tokens != s.num_tokens || h.version != s.version) {
                fail(kExitData, "shard '%s' changed while it was being opened (now %lld tokens, version %d)", s.path.c_str(),
                     (long long)h.num_tokens, h.version);
            }
            shard_base_.push_back(at);
            f.seek(kShardHeaderBytes);
            io.file_to_device(data_.get() + at, f, uint64_t(s.num_tokens) * s.bytes_per_token, compute_);
            at += aligned(uint64_t(s.num_tokens) * s.bytes_per_token);
        }
        DeviceBuffer<unsigned long long> first_bad(1);
        uint32_t vocab = schedule_.config().vocab_size;
        for (size_t k = 0; k < schedule_.shards().size(); k++) {
            const ShardInfo& s = schedule_.shards()[k];
            cudaCheck(cudaMemsetAsync(first_bad.get(), 0xff, sizeof(unsigned long long), compute_));
            const uint8_t* p = data_.get() + shard_base_[k];
            uint64_t n = uint64_t(s.num_tokens);
            if (s.bytes_per_token == 2) {
                find_bad_token_kernel<<<1024, 256, 0, compute_>>>(reinterpret_cast<const uint16_t*>(p), n, vocab, first_bad.get());
            } else {
                find_bad_token_kernel<<<1024, 256, 0, compute_>>>(reinterpret_cast<const uint32_t*>(p), n, vocab, first_bad.get());
            }
            cudaCheckLaunch();
            unsigned long long bad = 0;
            cudaCheck(cudaMemcpyAsync(&bad, first_bad.get(), sizeof(bad), cudaMemcpyDeviceToHost, compute_));
            cudaCheck(cudaStreamSynchronize(compute_));
            if (bad != ~0ull) {
                uint32_t id = 0;
                cudaCheck(cudaMemcpy(&id, p + bad * s.bytes_per_token, s.bytes_per_token, cudaMemcpyDeviceToHost));
                fail(kExitData, "shard '%s': token %llu (byte offset %lld) has id %u, not below the vocabulary size %u",
                     s.path.c_str(), bad, (long long)shard_token_byte_offset(int64_t(bad), s.bytes_per_token), id, vocab);
            }
        }
    }

    SampleSchedule schedule_;
    cudaStream_t compute_;
    bool resident_ = false;
    uint64_t resident_bytes_ = 0;
    uint64_t position_ = 0;

    // Streaming mode.
    std::unique_ptr<DataLoader> host_;
    Stream copy_;
    Event compute_mark_;
    DeviceSlot slots_[2];
    int cur_ = 0;              // the slot that holds (or will hold) batch position_
    bool lookahead_ = false;   // whether slots_[cur_] holds batch position_ already
    std::vector<Event> h2d_done_;
    std::deque<int> pending_;  // h2d_done_ indices of copies whose host buffers are still held, oldest first
    int next_h2d_ = 0;

    // Resident mode.
    DeviceBuffer<uint8_t> data_;
    std::vector<uint64_t> shard_base_;
    DeviceBuffer<uint64_t> lists_[2];
    PinnedBuffer list_host_[2];
    Event list_uploaded_[2];
    uint64_t list_epoch_[2] = {0, 0};
    bool list_valid_[2] = {false, false};
    DeviceBuffer<int> r_inputs_, r_targets_;
};

}  // namespace llmc
