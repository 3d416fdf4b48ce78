/*
The checkpoint, device side: the model's buffers behind the files of llmc/checkpoint.h; the Checkpointer,
which saves them synchronously or, from a spare device copy taken on a side stream, asynchronously in a
background thread; the load back into the model, every chunk checked against the manifest before its
bytes reach the device, with the optimizer state re-sharded when the number of ranks or the layout
changed; and the trained model file a run writes at the end.
*/
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "llmc/checkpoint.h"
#include "llmc/cuda_utils.cuh"
#include "llmc/device_file_io.cuh"
#include "llmc/gpt2.cuh"
#include "llmc/model_io.h"
#include "llmc/utils.h"

namespace llmc {

// ----------------------------------------------------------------------------------------------------
// Saving device memory.

struct CheckpointTensor {
    std::string file;          // file name inside the checkpoint directory
    std::vector<char> header;  // host bytes written before the tensor (may be empty)
    void* device = nullptr;    // read by a save, written by a load
    size_t bytes = 0;
};

// What one finished save did.
struct CheckpointReport {
    int64_t step = -1;
    std::string path;
    uint64_t bytes = 0;
    double stall_seconds = 0;  // the caller's time in save(): the whole write (sync) or the snapshot set-up (async)
    double write_seconds = 0;  // from the start of the save to the rename (and rotation)
    std::vector<std::string> removed;  // checkpoints rotation removed
};

// Saves checkpoints through a CheckpointWriter, every chunk checksummed in DeviceFileIO's pinned staging.
// Synchronous: from the live buffers. Asynchronous: a copy into spare device buffers on a side stream
// (compute waits only for that copy), written by a background thread. A new save waits for the previous
// one; wait() ends any save in flight and raises its error (the destructor waits too).
class Checkpointer {
public:
    // layout: the tensors every save will hold (their sizes size the spare buffers of an async one).
    Checkpointer(const std::vector<CheckpointTensor>& layout, bool async, size_t chunk_bytes = kDefaultChunkBytes)
        : Checkpointer(layout, async, 0, 1, nullptr, 600, chunk_bytes) {}
    // One of `world` ranks writing one checkpoint together: every save has rank 0 prepare the directory,
    // then a vote (`any_failed`) so no rank writes before it exists and all stop when one cannot go on.
    // `layout` is this rank's files only.
    Checkpointer(const std::vector<CheckpointTensor>& layout, bool async, int rank, int world,
                 std::function<bool(bool)> any_failed, double part_timeout_s, size_t chunk_bytes = kDefaultChunkBytes)
        : async_(async), rank_(rank), world_(world), any_failed_(std::move(any_failed)), part_timeout_s_(part_timeout_s),
          io_(chunk_bytes) {
        cudaCheck(cudaGetDevice(&device_));
        if (async_) {
            for (const CheckpointTensor& t : layout) {
                spare_.emplace_back(t.bytes);
                snapshot_bytes_ += t.bytes;
            }
        }
    }
    Checkpointer(const Checkpointer&) = delete;
    Checkpointer& operator=(const Checkpointer&) = delete;
    ~Checkpointer() {
        if (worker_.joinable()) worker_.join();
        if (error_) {
            try {
                std::rethrow_exception(error_);
            } catch (const std::exception& e) {
                std::fprintf(stderr, "error: checkpoint save failed: %s\n", e.what());
            }
        }
    }

    bool async() const { return async_; }
    size_t snapshot_device_bytes() const { return snapshot_bytes_; }

    // Saves `tensors` and meta as <out_dir>/ckpt_<step>, then rotates. The device memory is read after the
    // work queued on `compute`; the checkpoint holds the state at the time of the call.
    void save(const std::string& out_dir, int64_t step, const std::vector<CheckpointTensor>& tensors,
              CheckpointManifest meta, cudaStream_t compute, int keep_last, int keep_every) {
        std::chrono::steady_clock::time_point t0;
        if (world_ == 1) {
            wait();
            t0 = std::chrono::steady_clock::now();
        } else {
            // Every rank must know before writing whether all can (a failed previous save, a rank 0 that
            // cannot prepare the directory): then every rank stops with an error.
            std::exception_ptr error;
            try {
                wait();
                t0 = std::chrono::steady_clock::now();
                if (rank_ == 0) prepare_shared_checkpoint(out_dir, step);
            } catch (const Error&) {
                error = std::current_exception();
            }
            const bool failed = any_failed_ ? any_failed_(error != nullptr) : error != nullptr;
            if (error) std::rethrow_exception(error);
            if (failed) {
                fail(kExitIo, "checkpoint of step %lld: another rank's previous save failed or rank 0 could not prepare "
                              "the directory in '%s' (that rank's error says which); rank %d of %d writes nothing",
                     (long long)step, out_dir.c_str(), rank_, world_);
            }
        }
        if (!async_) {
            CheckpointReport r = write(out_dir, step, tensors, meta, compute, keep_last, keep_every, t0);
            r.stall_seconds = r.write_seconds;
            finished_ = std::move(r);
            has_report_ = true;
            return;
        }
        if (tensors.size() != spare_.size()) fail(kExitError, "Checkpointer: %zu tensors, the layout has %zu", tensors.size(), spare_.size());
        std::vector<CheckpointTensor> snap = tensors;
        cudaCheck(cudaEventRecord(ready_, compute));
        cudaCheck(cudaStreamWaitEvent(side_, ready_, 0));
        for (size_t i = 0; i < tensors.size(); i++) {
            if (tensors[i].bytes != spare_[i].bytes()) {
                fail(kExitError, "Checkpointer: tensor '%s' is %zu bytes, the layout has %zu", tensors[i].file.c_str(),
                     tensors[i].bytes, spare_[i].bytes());
            }
            cudaCheck(cudaMemcpyAsync(spare_[i].get(), tensors[i].device, tensors[i].bytes, cudaMemcpyDeviceToDevice, side_));
            snap[i].device = spare_[i].get();
        }
        cudaCheck(cudaEventRecord(snapshot_done_, side_));
        // Training may go on queueing work, but the GPU runs none of it before the snapshot is taken.
        cudaCheck(cudaStreamWaitEvent(compute, snapshot_done_, 0));
        const double stall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        worker_done_ = false;
        worker_ = std::thread([this, out_dir, step, snap = std::move(snap), meta = std::move(meta), keep_last, keep_every,
                               t0, stall]() mutable {
            try {
                cudaCheck(cudaSetDevice(device_));
                CheckpointReport r = write(out_dir, step, snap, meta, side_, keep_last, keep_every, t0);
                r.stall_seconds = stall;
                finished_ = std::move(r);
                has_report_ = true;
            } catch (...) {
                error_ = std::current_exception();
            }
            worker_done_ = true;
        });
    }

    // Returns once no save is in flight; raises the error of a save that failed (once).
    void wait() {
        if (worker_.joinable()) worker_.join();
        if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
    }

    // Without blocking: the report of a save finished since the last call (false if none), or its error.
    bool poll(CheckpointReport* out) {
        if (worker_.joinable()) {
            if (!worker_done_.load()) return false;
            wait();
        }
        if (!has_report_) return false;
        has_report_ = false;
        *out = finished_;
        return true;
    }

private:
    CheckpointReport write(const std::string& out_dir, int64_t step, const std::vector<CheckpointTensor>& tensors,
                           const CheckpointManifest& meta, cudaStream_t stream, int keep_last, int keep_every,
                           std::chrono::steady_clock::time_point t0) {
        CheckpointWriter w(out_dir, step, rank_, world_, part_timeout_s_);
        for (const CheckpointTensor& t : tensors) {
            w.add_file(t.file, [&](File& f, const ChunkHook& hook) {
                write_chunked(f, t.header.data(), t.header.size(), hook, std::max<size_t>(1, t.header.size()));
                io_.device_to_file(f, t.device, t.bytes, stream, hook);
            });
        }
        CheckpointReport r;
        r.step = step;
        r.path = w.commit(meta);
        r.bytes = w.bytes_written();
        if (rank_ == 0) r.removed = rotate_checkpoints(out_dir, keep_last, keep_every, step);
        r.write_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        return r;
    }

    bool async_;
    int device_ = 0;
    int rank_ = 0, world_ = 1;
    std::function<bool(bool)> any_failed_;
    double part_timeout_s_ = 600;
    DeviceFileIO io_;
    std::vector<DeviceBuffer<char>> spare_;
    size_t snapshot_bytes_ = 0;
    Stream side_;
    Event ready_, snapshot_done_;
    std::thread worker_;
    std::atomic<bool> worker_done_{false};
    std::exception_ptr error_;
    CheckpointReport finished_;
    bool has_report_ = false;
};

// ----------------------------------------------------------------------------------------------------
// Loading device memory.

// Loads elements [first, last) of a flat array held by `segments` of a checkpoint into device memory at
// dst, every chunk checked. Synchronous; for a resume on another number of ranks.
inline void load_array_range(const std::string& dir, const CheckpointManifest& m, const std::vector<ArraySegment>& segments,
                             size_t elem_bytes, int64_t first, int64_t last, void* dst, cudaStream_t stream) {
    char* out = static_cast<char*>(dst);
    read_array_range(dir, m, segments, elem_bytes, first, last, [&](uint64_t at, const char* p, size_t n) {
        cudaCheck(cudaMemcpyAsync(out + at, p, n, cudaMemcpyHostToDevice, stream));
        cudaCheck(cudaStreamSynchronize(stream));  // p is reused for the next chunk
    });
}

// Loads `tensors` from the checkpoint `dir` into device memory, each file's size and header checked and
// every chunk verified before it goes to the device. Returns once the bytes are on the device.
inline void load_checkpoint_tensors(const std::string& dir, const CheckpointManifest& m,
                                    const std::vector<CheckpointTensor>& tensors, DeviceFileIO& io, cudaStream_t stream) {
    for (const CheckpointTensor& t : tensors) {
        const std::string path = dir + "/" + t.file;
        const FileRecord* rec = m.file(t.file);
        if (!rec) fail(kExitData, "checkpoint '%s' has no file '%s'", dir.c_str(), t.file.c_str());
        const uint64_t h = t.header.size();
        if (rec->size != h + t.bytes) {
            fail(kExitData, "'%s' holds %llu bytes; this model needs %llu (a different model shape?)", path.c_str(),
                 (unsigned long long)rec->size, (unsigned long long)(h + t.bytes));
        }
        File f(path, File::Mode::Read);
        if (uint64_t(f.size()) != rec->size) {
            fail(kExitData, "'%s' is %lld bytes, the manifest records %llu (truncated?)", path.c_str(), (long long)f.size(),
                 (unsigned long long)rec->size);
        }
        std::vector<char> header(h);
        auto check_header = [&] {
            if (header != t.header) {
                fail(kExitData, "'%s': its header differs from this model's (a different model shape or format)",
                     path.c_str());
            }
        };
        const ChunkPlanner plan(int64_t(h), t.bytes, io.chunk_bytes(), io.direct() ? kDirectAlignment : 0);
        if (!chunks_match_plan(*rec, h, t.bytes, plan)) {
            // Written with another chunk size: read by its recorded chunks (each checked whole), host-staged.
            f.close();
            header = read_file_head(dir, m, t.file, h);
            load_array_range(dir, m, {{t.file, h, 0, int64_t(t.bytes)}}, 1, 0, int64_t(t.bytes), t.device, stream);
            check_header();
            continue;
        }
        ChunkVerifier v(*rec, path);
        if (h > 0) {
            read_verified(f, header.data(), header.size(), v, *rec);
            check_header();
        }
        io.file_to_device(t.device, f, t.bytes, stream, v.hook());
        v.finish();
    }
}

// ----------------------------------------------------------------------------------------------------
// GPT-2's checkpoint: the model's buffers behind the files, and the load back into the model.

namespace detail {
inline int rank_of(const GPT2& model) { return model.multi() != nullptr ? model.multi()->rank() : 0; }

// The sharded layout's model.bin: the bf16 parameters (identical on every rank) as an llm.c version 5 file.
inline CheckpointTensor bf16_model_tensor(GPT2& model) {
    return {kCkptModelFile, model_file_header(model.config(), kModelVersionBf16), model.state().params,
            size_t(model.num_parameters()) * sizeof(floatX)};
}

// Rank `rank`'s optimizer-state files in the sharded layout.
inline std::vector<CheckpointTensor> shard_tensors(GPT2& model, int rank) {
    const GPT2::State s = model.state();
    const size_t k = size_t(model.zero_layout().owned(rank).size());
    return {{state_shard_file(StateKind::Master, rank), {}, s.master, k * sizeof(float)},
            {state_shard_file(StateKind::AdamM, rank), {}, s.adam_m, k * sizeof(float)},
            {state_shard_file(StateKind::AdamV, rank), {}, s.adam_v, k * sizeof(float)}};
}
}  // namespace detail

// The device state this rank's part of a checkpoint holds, in file order.
inline std::vector<CheckpointTensor> checkpoint_tensors(GPT2& model) {
    const GPT2::State s = model.state();
    const size_t n = size_t(model.num_parameters());
    std::vector<CheckpointTensor> t;
    const int rank = detail::rank_of(model);
    if (!model.sharded()) {
        t = {{kCkptModelFile, model_file_header(model.config(), kModelVersionFp32), s.master, n * sizeof(float)},
             {kCkptParamsFile, {}, s.params, n * sizeof(floatX)},
             {kCkptAdamMFile, {}, s.adam_m, n * sizeof(float)},
             {kCkptAdamVFile, {}, s.adam_v, n * sizeof(float)}};
    } else {
        if (rank == 0) t.push_back(detail::bf16_model_tensor(model));
        for (CheckpointTensor& st : detail::shard_tensors(model, rank)) t.push_back(std::move(st));
    }
    return t;
}

// The manifest settings that describe the layout of checkpoint_tensors() across the ranks.
inline std::vector<std::pair<std::string, std::string>> checkpoint_layout_settings(const GPT2& model) {
    return state_layout_settings(model.sharded() ? &model.zero_layout() : nullptr);
}

// Restores the state a checkpoint holds, written in either layout by any number of ranks: streamed
// straight to the device when the layout and ranges are this run's, else this rank's range assembled
// from the saved files' pieces. Returns a description of what was re-sharded (empty: nothing).
inline std::string load_checkpoint(GPT2& model, const std::string& dir, const CheckpointManifest& m, DeviceFileIO& io) {
    const int64_t num_params = model.num_parameters();
    const StateLayout saved = read_state_layout(dir, m, num_params);
    const GPT2::State s = model.state();
    const ShardRange target = model.owned();
    cudaStream_t stream = model.stream();
    // The parameters are whole in both layouts.
    load_checkpoint_tensors(dir, m,
                            {saved.sharded ? detail::bf16_model_tensor(model)
                                           : CheckpointTensor{kCkptParamsFile, {}, s.params,
                                                              size_t(num_params) * sizeof(floatX)}},
                            io, stream);
    if (!saved.sharded && !model.sharded()) {
        const std::vector<CheckpointTensor> t = checkpoint_tensors(model);
        load_checkpoint_tensors(dir, m, {t[0], t[2], t[3]}, io, stream);  // model.bin, adam_m.bin, adam_v.bin
        return "";
    }
    const int rank = detail::rank_of(model);
    if (saved.sharded && model.sharded() && int(saved.master.size()) == model.zero_layout().world &&
        saved.master[size_t(rank)].begin == target.begin &&
        saved.master[size_t(rank)].begin + saved.master[size_t(rank)].count == target.end) {
        load_checkpoint_tensors(dir, m, detail::shard_tensors(model, rank), io, stream);
        return "";
    }
    // Re-shard: a whole checkpoint's model.bin header must be this model's before its weights are trusted.
    const std::vector<char> header = model_file_header(model.config(), kModelVersionFp32);
    if (!saved.sharded && read_file_head(dir, m, kCkptModelFile, header.size()) != header) {
        fail(kExitData, "'%s/%s': its header differs from this model's", dir.c_str(), kCkptModelFile);
    }
    load_array_range(dir, m, saved.master, sizeof(float), target.begin, target.end, s.master, stream);
    load_array_range(dir, m, saved.adam_m, sizeof(float), target.begin, target.end, s.adam_m, stream);
    load_array_range(dir, m, saved.adam_v, sizeof(float), target.begin, target.end, s.adam_v, stream);
    return format("optimizer state of %s re-sharded to %s",
                  saved.sharded ? format("%zu rank(s)", saved.master.size()).c_str() : "one whole copy",
                  model.sharded() ? format("rank %d of %d (parameters %lld..%lld)", rank, model.zero_layout().world,
                                           (long long)target.begin, (long long)target.end).c_str()
                                  : "one whole copy");
}

// ----------------------------------------------------------------------------------------------------
// The trained model, which a run writes at the end (not part of a checkpoint).

namespace detail {
// The fp32 master weights of all N parameters on the device: the model's own, or with ZeRO-1 (every rank
// must call) gathered into `full`.
inline const float* all_master_weights(GPT2& model, DeviceBuffer<float>& full) {
    const GPT2::State s = model.state();
    if (!model.sharded()) return s.master;
    const ZeroLayout& layout = model.zero_layout();
    MultiGpu* multi = model.multi();
    cudaStream_t stream = model.stream();
    full.allocate(size_t(layout.padded_total()));
    cudaCheck(cudaMemsetAsync(full.get(), 0, full.bytes(), stream));
    cudaCheck(cudaMemcpyAsync(full.get() + layout.shard(multi->rank()).begin, s.master,
                              size_t(layout.shard_size) * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    multi->all_gather_async(full.get(), layout, stream);
    multi->join(stream);
    return full.get();
}
}  // namespace detail

// Writes the fp32 master weights as an llm.c model file (version 3), whole or not at all. With ZeRO-1
// every rank must call it; only a rank with `write` writes.
inline void write_trained_model(GPT2& model, const std::string& path, DeviceFileIO& io, bool write = true) {
    DeviceBuffer<float> full;
    const float* master = detail::all_master_weights(model, full);
    if (model.sharded()) cudaCheck(cudaStreamSynchronize(model.stream()));
    if (!write) return;
    const std::vector<char> h = model_file_header(model.config(), kModelVersionFp32);
    write_file_atomically(path, [&](File& f) {
        f.write_all(h.data(), h.size());
        io.device_to_file(f, master, size_t(model.num_parameters()) * sizeof(float), model.stream());
    });
}

// Writes the trained model in `format` (llmc/model_io.h): fp32 formats hold the master weights (with
// ZeRO-1 every rank must call), bf16 ones the parameters the model computes with. Only `write` writes.
inline void export_trained_model(GPT2& model, const std::string& path, ModelFormat format, const SaveOptions& options,
                                 bool write = true) {
    const bool fp32 = format == ModelFormat::Llmc || format == ModelFormat::Hf;
    if (!fp32 && !write) return;
    const size_t n = size_t(model.num_parameters());
    cudaStream_t stream = model.stream();
    std::vector<float> params(n);
    if (fp32) {
        DeviceBuffer<float> full;
        const float* master = detail::all_master_weights(model, full);
        cudaCheck(cudaMemcpyAsync(params.data(), master, n * sizeof(float), cudaMemcpyDeviceToHost, stream));
        cudaCheck(cudaStreamSynchronize(stream));
    } else {
        std::vector<floatX> bf16(n);
        cudaCheck(cudaMemcpyAsync(bf16.data(), model.state().params, n * sizeof(floatX), cudaMemcpyDeviceToHost, stream));
        cudaCheck(cudaStreamSynchronize(stream));
        for (size_t i = 0; i < n; i++) params[i] = __bfloat162float(bf16[i]);
    }
    if (write) save_model(path, format, model.config(), params.data(), options);
}

}  // namespace llmc
