/*
CUDA error checking (cudaCheck, cudaCheckLaunch: an llmc::Error with kExitCuda naming the call, location
and CUDA's text), cuda_device_count() (0 without a GPU or driver), and move-only owners for device
memory, pinned memory, streams and events.
*/
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "llmc/utils.h"

namespace llmc {

inline void cuda_check(cudaError_t err, const char* call, const char* file, int line) {
    if (err != cudaSuccess) {
        fail(kExitCuda, "CUDA error %s (%s) from %s at %s:%d", cudaGetErrorName(err), cudaGetErrorString(err), call,
             file, line);
    }
}

#define cudaCheck(call) ::llmc::cuda_check((call), #call, __FILE__, __LINE__)
#define cudaCheckLaunch() ::llmc::cuda_check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

// Number of usable CUDA devices; 0 when there is no GPU or no driver.
inline int cuda_device_count() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();  // clear the sticky "no device" error so later checks are not confused
        return 0;
    }
    return n;
}

// Whether n elements from a and n from b overlap without being the same (a != b): the aliasing a kernel
// reading one and writing the other cannot tolerate.
template <class T>
inline bool overlaps_partly(const T* a, const T* b, int64_t n) {
    return a != b && a < b + n && b < a + n;
}

template <class T>
class DeviceBuffer {
public:
    DeviceBuffer() = default;
    explicit DeviceBuffer(size_t count) { allocate(count); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), count_(std::exchange(o.count_, 0)) {}
    DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
        if (this != &o) {
            release();
            ptr_ = std::exchange(o.ptr_, nullptr);
            count_ = std::exchange(o.count_, 0);
        }
        return *this;
    }
    ~DeviceBuffer() { release(); }

    void allocate(size_t count) {
        release();
        if (count == 0) return;
        void* p = nullptr;
        cudaError_t err = cudaMalloc(&p, count * sizeof(T));
        if (err != cudaSuccess) {
            fail(kExitCuda, "cudaMalloc of %s failed: %s", human_bytes(double(count * sizeof(T))).c_str(),
                 cudaGetErrorString(err));
        }
        ptr_ = static_cast<T*>(p);
        count_ = count;
    }
    T* get() const { return ptr_; }
    size_t size() const { return count_; }
    size_t bytes() const { return count_ * sizeof(T); }

private:
    void release() noexcept {
        if (ptr_) cudaFree(ptr_);
        ptr_ = nullptr;
        count_ = 0;
    }
    T* ptr_ = nullptr;
    size_t count_ = 0;
};

// Page-locked host memory. flags are cudaHostAlloc's (cudaHostAllocWriteCombined suits buffers the host
// only writes and the GPU only reads).
class PinnedBuffer {
public:
    PinnedBuffer() = default;
    PinnedBuffer(size_t bytes, unsigned flags = cudaHostAllocDefault) { allocate(bytes, flags); }
    PinnedBuffer(const PinnedBuffer&) = delete;
    PinnedBuffer& operator=(const PinnedBuffer&) = delete;
    PinnedBuffer(PinnedBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
    PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
        if (this != &o) {
            release();
            ptr_ = std::exchange(o.ptr_, nullptr);
            bytes_ = std::exchange(o.bytes_, 0);
        }
        return *this;
    }
    ~PinnedBuffer() { release(); }

    void allocate(size_t bytes, unsigned flags = cudaHostAllocDefault) {
        release();
        if (bytes == 0) return;
        void* p = nullptr;
        cudaError_t err = cudaHostAlloc(&p, bytes, flags);
        if (err != cudaSuccess) {
            fail(kExitCuda, "cudaHostAlloc of %s of pinned memory failed: %s", human_bytes(double(bytes)).c_str(),
                 cudaGetErrorString(err));
        }
        ptr_ = static_cast<char*>(p);
        bytes_ = bytes;
    }
    char* get() const { return ptr_; }
    size_t bytes() const { return bytes_; }

private:
    void release() noexcept {
        if (ptr_) cudaFreeHost(ptr_);
        ptr_ = nullptr;
        bytes_ = 0;
    }
    char* ptr_ = nullptr;
    size_t bytes_ = 0;
};

class Stream {
public:
    Stream() { cudaCheck(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;
    ~Stream() {
        if (s_) cudaStreamDestroy(s_);
    }
    cudaStream_t get() const { return s_; }
    operator cudaStream_t() const { return s_; }

private:
    cudaStream_t s_ = nullptr;
};

class Event {
public:
    explicit Event(bool timing = false) {
        cudaCheck(cudaEventCreateWithFlags(&e_, timing ? cudaEventDefault : cudaEventDisableTiming));
    }
    Event(const Event&) = delete;
    Event& operator=(const Event&) = delete;
    ~Event() {
        if (e_) cudaEventDestroy(e_);
    }
    cudaEvent_t get() const { return e_; }
    operator cudaEvent_t() const { return e_; }

private:
    cudaEvent_t e_ = nullptr;
};

}  // namespace llmc
