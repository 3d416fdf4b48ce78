/*
Checkpoints of device state: the Checkpointer (synchronous or asynchronous save) and the verified load.

A checkpoint's device part is a list of CheckpointTensors: a file name, optional host bytes written
first (the model file header), and the device memory behind it. Saving writes each through the
disk <-> GPU layer (DeviceFileIO) with a chunk hook that checksums every chunk while it sits in the
pinned staging buffer; checkpoint.h turns the files into a checkpoint directory (temporary name, fsync,
one rename) and rotates old ones.

Synchronous save: the files are written from the live device buffers on the caller's stream; training
waits for the whole write. Asynchronous save: the tensors are first copied into spare device buffers
(allocated once, in the constructor: device-to-device, a few milliseconds even for large models) on a
side stream that starts after the work already queued on the compute stream, and the compute stream
waits only for that copy; a background thread then writes the spare buffers to disk while training goes
on. A new save first waits for the previous one; wait() ends any save in flight and raises its error,
if any, on the calling thread (the destructor also waits, so the program never leaves with a save in
flight). The load reads every tensor back through DeviceFileIO, checking each chunk against the manifest
before it is copied to the device, and fails (kExitData) on the first mismatch.

Does not provide: the choice of what a checkpoint holds, its settings or the resume policy (the trainer),
or host-pinned snapshots (a spare device copy is faster and the H200 has the memory).
*/
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#include "llmc/checkpoint.h"
#include "llmc/cuda_utils.cuh"
#include "llmc/device_file_io.cuh"

namespace llmc {

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

class Checkpointer {
public:
    // layout: the tensors every save will hold (their sizes size the spare buffers of an async one).
    Checkpointer(const std::vector<CheckpointTensor>& layout, bool async, size_t chunk_bytes = kDefaultChunkBytes)
        : async_(async), io_(chunk_bytes) {
        init(layout);
    }
    // One of `world` ranks writing one checkpoint together (see CheckpointWriter): every save first has rank 0
    // prepare the directory, then holds all ranks at `any_failed` (a vote of every rank, true when any rank
    // passed true: each passes whether its previous save failed or, rank 0, its preparation did), so that
    // no rank writes before the directory is there and every rank stops with an error when one cannot go
    // on, instead of waiting for a rank that left; rank 0 waits up to part_timeout_s for the others.
    // `layout` is this rank's files only.
    Checkpointer(const std::vector<CheckpointTensor>& layout, bool async, int rank, int world,
                 std::function<bool(bool)> any_failed, double part_timeout_s)
        : async_(async), rank_(rank), world_(world), any_failed_(std::move(any_failed)), part_timeout_s_(part_timeout_s),
          io_(kDefaultChunkBytes) {
        init(layout);
    }

private:
    void init(const std::vector<CheckpointTensor>& layout) {
        cudaCheck(cudaGetDevice(&device_));
        if (async_) {
            for (const CheckpointTensor& t : layout) {
                spare_.emplace_back(t.bytes);
                snapshot_bytes_ += t.bytes;
            }
        }
    }

public:
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

    // Saves `tensors` (the layout's, in order) and meta as <out_dir>/ckpt_<step>, then rotates. The device
    // memory is read after everything already queued on `compute`; the caller may queue more work at once
    // (async) and the checkpoint still holds the state at the time of the call.
    void save(const std::string& out_dir, int64_t step, const std::vector<CheckpointTensor>& tensors,
              CheckpointManifest meta, cudaStream_t compute, int keep_last, int keep_every) {
        std::chrono::steady_clock::time_point t0;
        if (world_ == 1) {
            wait();
            t0 = std::chrono::steady_clock::now();
        } else {
            // Every rank must know before writing whether all can: a rank whose previous (asynchronous) save
            // failed, or a rank 0 that cannot prepare the directory, says so in the vote, and then every
            // rank stops with an error instead of waiting in a collective for a rank that left.
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

    // Without blocking: the report of a save that finished since the last call (false if none), or the
    // error of one that failed (raised here).
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

// Loads `tensors` from the checkpoint directory `dir` (whose manifest is m) into device memory. Each file
// must have the recorded size and exactly the tensor's header plus bytes; every chunk is checked against
// its checksum in the pinned buffer before it goes to the device. Returns once the bytes are on the device.
inline void load_checkpoint_tensors(const std::string& dir, const CheckpointManifest& m,
                                    const std::vector<CheckpointTensor>& tensors, DeviceFileIO& io, cudaStream_t stream) {
    for (const CheckpointTensor& t : tensors) {
        const std::string path = dir + "/" + t.file;
        const FileRecord* rec = m.file(t.file);
        if (!rec) fail(kExitData, "checkpoint '%s' has no file '%s'", dir.c_str(), t.file.c_str());
        const uint64_t expect = t.header.size() + t.bytes;
        if (rec->size != expect) {
            fail(kExitData, "'%s' holds %llu bytes; this model needs %llu (a different model shape?)", path.c_str(),
                 (unsigned long long)rec->size, (unsigned long long)expect);
        }
        File f(path, File::Mode::Read);
        if (uint64_t(f.size()) != rec->size) {
            fail(kExitData, "'%s' is %lld bytes, the manifest records %llu (truncated?)", path.c_str(), (long long)f.size(),
                 (unsigned long long)rec->size);
        }
        const uint64_t h = t.header.size();
        const ChunkPlanner plan(int64_t(h), t.bytes, io.chunk_bytes(), io.direct() ? kDirectAlignment : 0);
        if (!chunks_match_plan(*rec, h, t.bytes, plan)) {
            // Written with another chunk size: read by its recorded chunks (each checked whole), host-staged.
            f.close();
            std::vector<char> header(h);
            char* out = static_cast<char*>(t.device);
            read_array_range(dir, m, {{t.file, 0, 0, int64_t(expect)}}, 1, 0, int64_t(expect),
                             [&](uint64_t at, const char* p, size_t len) {
                                 const size_t head = at < h ? std::min<size_t>(len, size_t(h - at)) : 0;
                                 if (head > 0) std::memcpy(header.data() + at, p, head);
                                 if (len > head) {
                                     cudaCheck(cudaMemcpyAsync(out + (at + head - h), p + head, len - head,
                                                               cudaMemcpyHostToDevice, stream));
                                     cudaCheck(cudaStreamSynchronize(stream));  // p is reused for the next chunk
                                 }
                             });
            if (header != t.header) {
                fail(kExitData, "'%s': its header differs from this model's (a different model shape or format)",
                     path.c_str());
            }
            continue;
        }
        ChunkVerifier v(*rec, path);
        if (!t.header.empty()) {
            std::vector<char> header(t.header.size());
            read_verified(f, header.data(), header.size(), v, *rec);
            if (header != t.header) {
                fail(kExitData, "'%s': its header differs from this model's (a different model shape or format)",
                     path.c_str());
            }
        }
        io.file_to_device(t.device, f, t.bytes, stream, v.hook());
        v.finish();
    }
}

// Loads elements [first, last) of a flat array held by `segments` of a checkpoint (read_array_range: every
// chunk checked) into device memory at dst. Synchronous; for a resume on a different number of ranks, where
// this rank's range is not one whole file.
inline void load_array_range(const std::string& dir, const CheckpointManifest& m, const std::vector<ArraySegment>& segments,
                             size_t elem_bytes, int64_t first, int64_t last, void* dst, cudaStream_t stream) {
    char* out = static_cast<char*>(dst);
    read_array_range(dir, m, segments, elem_bytes, first, last, [&](uint64_t at, const char* p, size_t n) {
        cudaCheck(cudaMemcpyAsync(out + at, p, n, cudaMemcpyHostToDevice, stream));
        cudaCheck(cudaStreamSynchronize(stream));  // p is reused for the next chunk
    });
}

}  // namespace llmc
