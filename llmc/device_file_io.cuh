/*
Disk <-> GPU transfers through a DeviceFileIO: two pinned staging buffers, allocated once. Each call works
at the file's current position and advances it, runs its copies on the caller's stream (after the work
queued there) and returns once the bytes are in the file (not fsynced) or on the device. Optional
O_DIRECT for the aligned part (docs/design.md). The schedule is chunk_pipeline.h.
*/
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "llmc/chunk_pipeline.h"
#include "llmc/cuda_utils.cuh"

namespace llmc {

class DeviceFileIO {
public:
    // readers: threads reading the file in file_to_device (1 or 2; chunk_pipeline.h says why 2).
    explicit DeviceFileIO(size_t chunk_bytes = kDefaultChunkBytes, bool direct = false, int readers = 2)
        : copier_(chunk_bytes, direct ? kDirectAlignment : 1), direct_(direct), readers_(readers) {
        if (readers < 1 || readers > 2) fail(kExitUsage, "DeviceFileIO takes 1 or 2 readers (got %d)", readers);
        if (direct && chunk_bytes % kDirectAlignment != 0) {
            fail(kExitUsage, "direct I/O needs a chunk size that is a multiple of %zu bytes (got %zu)", kDirectAlignment,
                 chunk_bytes);
        }
    }

    // hook (optional) sees each chunk in the pinned buffer before it is written (chunk_pipeline.h).
    void device_to_file(File& file, const void* device_src, uint64_t nbytes, cudaStream_t stream,
                        const ChunkHook& hook = nullptr) {
        copier_.stream = stream;
        pipelined_device_to_file(copier_, file, device_src, nbytes, direct_ ? kDirectAlignment : 0, hook);
    }

    // hook (optional) sees each chunk in the pinned buffer before it is copied to the device; with two
    // readers it is called from two threads.
    void file_to_device(void* device_dst, File& file, uint64_t nbytes, cudaStream_t stream,
                        const ChunkHook& hook = nullptr) {
        copier_.stream = stream;
        pipelined_file_to_device(copier_, device_dst, file, nbytes, direct_ ? kDirectAlignment : 0, readers_, hook);
    }

    size_t chunk_bytes() const { return copier_.chunk_bytes(); }
    size_t pinned_bytes() const { return copier_.pinned_bytes(); }
    bool direct() const { return direct_; }

private:
    class CudaCopier final : public StagingCopier {
    public:
        CudaCopier(size_t chunk_bytes, size_t alignment) : chunk_bytes_(chunk_bytes) {
            if (chunk_bytes == 0) fail(kExitUsage, "chunk size must be at least 1 byte");
            cudaCheck(cudaGetDevice(&device_));
            // Each slot starts on an aligned address so O_DIRECT can read and write it.
            slot_stride_ = (chunk_bytes + alignment - 1) / alignment * alignment;
            buffer_.allocate(2 * slot_stride_ + alignment);
            uintptr_t base = reinterpret_cast<uintptr_t>(buffer_.get());
            base = (base + alignment - 1) / alignment * alignment;
            base_ = reinterpret_cast<char*>(base);
            for (auto& e : events_) {
                cudaCheck(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync));
            }
        }
        ~CudaCopier() override {
            drain();
            for (auto e : events_) cudaEventDestroy(e);
        }
        size_t chunk_bytes() const override { return chunk_bytes_; }
        size_t pinned_bytes() const { return buffer_.bytes(); }
        char* staging(int slot) override { return base_ + slot * slot_stride_; }
        void to_host_async(int slot, const void* device_src, size_t n) override {
            cudaCheck(cudaMemcpyAsync(staging(slot), device_src, n, cudaMemcpyDeviceToHost, stream));
            cudaCheck(cudaEventRecord(events_[slot], stream));
        }
        void to_device_async(void* device_dst, int slot, size_t n) override {
            cudaCheck(cudaMemcpyAsync(device_dst, staging(slot), n, cudaMemcpyHostToDevice, stream));
            cudaCheck(cudaEventRecord(events_[slot], stream));
        }
        void wait(int slot) override { cudaCheck(cudaEventSynchronize(events_[slot])); }
        void bind_thread() override { cudaCheck(cudaSetDevice(device_)); }
        void drain() noexcept override {
            for (auto e : events_) cudaEventSynchronize(e);
        }

        cudaStream_t stream = nullptr;

    private:
        int device_ = 0;
        size_t chunk_bytes_;
        size_t slot_stride_ = 0;
        PinnedBuffer buffer_;
        char* base_ = nullptr;
        cudaEvent_t events_[2] = {nullptr, nullptr};
    };

    CudaCopier copier_;
    bool direct_;
    int readers_;
};

}  // namespace llmc
