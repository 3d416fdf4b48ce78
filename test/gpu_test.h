/*
Shared scaffolding for GPU unit tests: a GoogleTest fixture that skips (with a message) when the
machine has no CUDA GPU, so `make test` passes on CPU-only machines and runs everything on GPU ones;
and llmc::test::upload / download, synchronous copies of a host vector to a new device buffer (landed
before upload returns, so that work on any stream may read it) and of device memory back (after the whole
device has finished its work).
*/
#pragma once

#include <gtest/gtest.h>

#include <vector>

#include "llmc/cuda_utils.cuh"

namespace llmc::test {

template <class T>
DeviceBuffer<T> upload(const std::vector<T>& v) {
    DeviceBuffer<T> d(v.size());
    cudaCheck(cudaMemcpy(d.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    // A copy from pageable memory may still be in flight when cudaMemcpy returns, and non-blocking streams
    // do not wait for the legacy stream's work: wait for it here.
    cudaCheck(cudaDeviceSynchronize());
    return d;
}

template <class T>
std::vector<T> download(const T* p, size_t n) {
    cudaCheck(cudaDeviceSynchronize());
    std::vector<T> v(n);
    cudaCheck(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
}

}  // namespace llmc::test

class GpuTest : public ::testing::Test {
protected:
    void SetUp() override {
        if (llmc::cuda_device_count() == 0) GTEST_SKIP() << "skipped: no CUDA GPU on this machine";
    }
};
