/*
bench_checkpoint: how long a checkpoint stalls training, synchronous against asynchronous save, for a
d12-sized state (GPT-2 124M: fp32 master weights as a model file, bf16 parameters, AdamW m and v; about
1.74 GB), and the write rate of each.

  build/bench_checkpoint [output-dir (default /tmp/bench_checkpoint)] [repeats (default 3)]

Stall: the time from the save call until the compute stream may run the next step's work: for the
synchronous save, the whole write (every file fsynced, renamed); for the asynchronous one, the set-up plus
the device-to-device snapshot. Write rate: bytes over the time from the call to the rename. While the
asynchronous write runs, a memory-bound "training" kernel loop keeps the GPU busy; its time per iteration
during the write against without one shows what the background write costs the steps. Prints a table;
acceptance is async stall <= 5% of the sync stall.

Does not measure: the cost of a real training step (the trainer prints each checkpoint's stall), or cold
storage other than the output directory's.
*/
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "llmc/checkpoint.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/utils.h"

using namespace llmc;

namespace {

__global__ void fill_kernel(uint32_t* p, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
        uint32_t x = uint32_t(i) * 0x9E3779B1u + seed;
        x ^= x >> 16;
        x *= 0x85EBCA6Bu;
        x ^= x >> 13;
        p[i] = x;
    }
}

// Reads and writes `n` floats: a stand-in for a step's memory traffic.
__global__ void busy_kernel(float* p, size_t n) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
        p[i] = p[i] * 0.999f + 0.001f;
    }
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
    return run_main([&]() -> int {
        const std::string out = argc > 1 ? argv[1] : "/tmp/bench_checkpoint";
        const int repeats = argc > 2 ? std::atoi(argv[2]) : 3;
        if (repeats < 1) fail(kExitUsage, "repeats must be at least 1");
        if (cuda_device_count() == 0) fail(kExitCuda, "bench_checkpoint needs a CUDA GPU");

        const size_t P = 124475904;  // d12 parameters (Vp = 50304)
        const size_t sizes[4] = {P * 4, P * 2, P * 4, P * 4};
        const char* names[4] = {"model.bin", "params_bf16.bin", "adam_m.bin", "adam_v.bin"};
        std::vector<DeviceBuffer<char>> bufs;
        std::vector<CheckpointTensor> tensors;
        Stream compute;
        for (int i = 0; i < 4; i++) {
            bufs.emplace_back(sizes[i]);
            fill_kernel<<<1024, 256, 0, compute>>>(reinterpret_cast<uint32_t*>(bufs.back().get()), sizes[i] / 4, 17u + i);
            cudaCheckLaunch();
            tensors.push_back({names[i], i == 0 ? std::vector<char>(1024, 'h') : std::vector<char>(), bufs.back().get(), sizes[i]});
        }
        DeviceBuffer<float> work(size_t(1) << 28);  // 1 GiB the "training" loop streams through
        cudaCheck(cudaMemsetAsync(work.get(), 0, work.bytes(), compute));
        cudaCheck(cudaStreamSynchronize(compute));
        uint64_t total = 0;
        for (size_t s : sizes) total += s;
        std::printf("state: %s in 4 files (d12), output '%s', %d repeat(s) per mode\n", human_bytes(double(total)).c_str(),
                    out.c_str(), repeats);

        auto busy_iteration_ms = [&](int iters) {
            Event a(true), b(true);
            cudaCheck(cudaEventRecord(a, compute));
            for (int i = 0; i < iters; i++) busy_kernel<<<2048, 256, 0, compute>>>(work.get(), work.size());
            cudaCheckLaunch();
            cudaCheck(cudaEventRecord(b, compute));
            cudaCheck(cudaEventSynchronize(b));
            float ms = 0;
            cudaCheck(cudaEventElapsedTime(&ms, a, b));
            return double(ms) / iters;
        };
        const double idle_ms = busy_iteration_ms(50);

        struct Row {
            const char* mode;
            double stall_ms, write_s, gbps, busy_ms;
        };
        std::vector<Row> rows;
        int64_t step = 1;
        for (bool async : {false, true}) {
            Checkpointer ckpt(tensors, async);
            std::vector<double> stall, write, busy;
            for (int r = 0; r < repeats + 1; r++) {  // the first save warms up (file creation, page cache)
                cudaCheck(cudaStreamSynchronize(compute));
                const auto t0 = std::chrono::steady_clock::now();
                ckpt.save(out, step++, tensors, CheckpointManifest(), compute, /*keep_last=*/1, 0);
                cudaCheck(cudaStreamSynchronize(compute));  // the next step's work could start now
                const double st = seconds_since(t0);
                double during = 0;
                int iters = 0;
                if (async) {
                    // Train while the background write runs; stop when it is done.
                    CheckpointReport rep;
                    bool done = false;
                    while (!done) {
                        during += busy_iteration_ms(5);
                        iters++;
                        done = ckpt.poll(&rep);
                    }
                    if (r > 0) write.push_back(rep.write_seconds);
                } else {
                    CheckpointReport rep;
                    ckpt.wait();
                    if (!ckpt.poll(&rep)) fail(kExitError, "no report from a synchronous save");
                    if (r > 0) write.push_back(rep.write_seconds);
                }
                if (r > 0) {
                    stall.push_back(st);
                    if (iters > 0) busy.push_back(during / iters);
                }
            }
            ckpt.wait();
            const double w = median(write);
            rows.push_back({async ? "async" : "sync", 1e3 * median(stall), w, double(total) / w / 1e9,
                            busy.empty() ? idle_ms : median(busy)});
        }
        remove_tree(out);

        std::printf("\n| save  | stall per checkpoint | write time | write rate | busy-loop iteration during write |\n");
        std::printf("|-------|---------------------:|-----------:|-----------:|---------------------------------:|\n");
        for (const Row& r : rows) {
            std::printf("| %-5s | %17.2f ms | %8.3f s | %6.2f GB/s | %12.3f ms (idle %.3f ms) |\n", r.mode, r.stall_ms,
                        r.write_s, r.gbps, r.busy_ms, idle_ms);
        }
        const double ratio = rows[1].stall_ms / rows[0].stall_ms;
        std::printf("\nasync stall / sync stall = %.2f%% (acceptance: <= 5%%): %s\n", 100.0 * ratio,
                    ratio <= 0.05 ? "PASS" : "FAIL");
        return ratio <= 0.05 ? int(kExitOk) : int(kExitError);
    });
}
