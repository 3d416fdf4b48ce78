/*
DataLoader benchmark: how fast the loader reads, and whether a training-sized GPU workload ever waits for it.

Data: --data GLOB (page-cached first by reading every file once), or without it synthetic shards of
random tokens written to a temporary directory (--synthetic-shards x --synthetic-tokens, default 2 x 100M)
and removed at the end.

Measures:
  1. loader throughput: the host DataLoader alone (background thread, ring of buffers), and the streaming
     GpuDataLoader end to end (int32 inputs and targets on the device, no other GPU work);
  2. stall: a fixed GPU workload per step (cuBLAS bf16 GEMMs, calibrated to --step-ms, plus a kernel that
     reads every input and target), fed by (a) one fixed device-resident batch, (b) the streaming loader,
     (c) the GPU-resident loader. The host reads "the loss" one step late, as a trainer does. A step's
     time is the distance between consecutive step-start events on the compute stream, so time the GPU
     spends waiting for data or for the host counts. The modes alternate in rounds so that clock drift
     hits all of them alike; medians after warm-up.
Every step's consumer kernel folds its batch into a position-sensitive checksum, and every checksum is
compared with one computed on the host from the synchronous loader: the figures are for correct data.

Prints a table at the end. Does not measure disk reads (the data is page-cached on purpose).
*/
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <stdlib.h>

#include "llmc/dataloader_gpu.cuh"
#include "llmc/flags.h"

using namespace llmc;

namespace {

struct Options {
    std::string data;
    int64_t synthetic_shards = 2;
    int64_t synthetic_tokens = 100000000;
    int vocab = 50257;
    int B = 64;
    int T = 1024;
    int prefetch = 4;
    int64_t seed = 1337;
    int steps = 200;
    int warmup = 5;
    int rounds = 4;
    double step_ms = 60;
    int gemm = 8192;
    double resident_budget_gib = 16;
    int64_t throughput_batches = 1000;
};

// Returns false when --help was given.
bool parse_args(int argc, char** argv, Options& o) {
    Flags flags("bench_dataloader", "DataLoader throughput, and whether a GPU workload stalls waiting for it.");
    flags.add("", "data", &o.data, "shard glob (or comma-separated globs); empty: synthetic shards")
        .add("", "synthetic-shards", &o.synthetic_shards, "number of synthetic shards")
        .add("", "synthetic-tokens", &o.synthetic_tokens, "tokens per synthetic shard")
        .add("", "vocab", &o.vocab, "vocabulary size (ids are checked against it; <= 65536 ships 16-bit tokens)")
        .add("", "B", &o.B, "batch size per step")
        .add("", "T", &o.T, "sequence length")
        .add("", "prefetch", &o.prefetch, "host ring buffers filled ahead by the loader thread")
        .add("", "seed", &o.seed, "shuffle seed")
        .add("", "steps", &o.steps, "measured steps per mode (split over the rounds)")
        .add("", "warmup", &o.warmup, "unmeasured steps at the start of each mode's round")
        .add("", "rounds", &o.rounds, "rounds that alternate the modes")
        .add("", "step-ms", &o.step_ms, "GPU work per step in milliseconds (GEMM count is calibrated to it)")
        .add("", "gemm", &o.gemm, "GEMM size n (n x n x n, bf16 in, fp32 accumulate)")
        .add("", "resident-budget-gib", &o.resident_budget_gib, "device memory the resident mode may use; 0 skips that mode")
        .add("", "throughput-batches", &o.throughput_batches, "batches read for the throughput figures");
    return flags.parse(argc, argv);
}

void cublas_check(cublasStatus_t s, const char* what) {
    if (s != CUBLAS_STATUS_SUCCESS) fail(kExitCuda, "cuBLAS error %d from %s", int(s), what);
}

class TempDir {
public:
    TempDir() {
        char tmpl[] = "/tmp/llmc_bench_dataloader_XXXXXX";
        if (!mkdtemp(tmpl)) fail(kExitIo, "cannot create a temporary directory under /tmp");
        path_ = tmpl;
    }
    ~TempDir() {
        for (const std::string& f : files_) ::unlink(f.c_str());
        ::rmdir(path_.c_str());
    }
    std::string file(const std::string& name) {
        files_.push_back(path_ + "/" + name);
        return files_.back();
    }
    const std::string& path() const { return path_; }

private:
    std::string path_;
    std::vector<std::string> files_;
};

void read_whole_file(const std::string& path) {
    File f(path, File::Mode::Read);
    std::vector<char> buf(size_t(8) << 20);
    while (f.read_some(buf.data(), buf.size()) == buf.size()) {
    }
}

// Folds a batch into a checksum that depends on every value and its position.
__global__ void checksum_kernel(const int* inputs, const int* targets, int n, unsigned long long* out) {
    unsigned long long sum = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        sum += (unsigned long long)(unsigned)inputs[i] * (2ull * i + 1) + (unsigned long long)(unsigned)targets[i] * (i ^ 0x5bd1e995ull);
    }
    atomicAdd(out, sum);
}

unsigned long long host_checksum(const std::vector<int32_t>& in, const std::vector<int32_t>& tg) {
    unsigned long long sum = 0;
    for (size_t i = 0; i < in.size(); i++) {
        sum += (unsigned long long)(uint32_t)in[i] * (2ull * i + 1) + (unsigned long long)(uint32_t)tg[i] * (i ^ 0x5bd1e995ull);
    }
    return sum;
}

__global__ void fill_bf16_kernel(__nv_bfloat16* p, size_t n, uint32_t seed) {
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
        uint32_t h = uint32_t(i) * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        p[i] = __float2bfloat16((float(h & 0xffff) / 65535.0f - 0.5f) * 0.02f);
    }
}

// The stand-in for a training step's compute.
class Workload {
public:
    Workload(int n, cudaStream_t stream) : n_(n), stream_(stream) {
        size_t elems = size_t(n) * n;
        for (int i = 0; i < 3; i++) {
            m_[i].allocate(elems);
            fill_bf16_kernel<<<1024, 256, 0, stream>>>(m_[i].get(), elems, 17u + i);
            cudaCheckLaunch();
        }
        cublas_check(cublasCreate(&handle_), "cublasCreate");
        cublas_check(cublasSetStream(handle_, stream), "cublasSetStream");
    }
    ~Workload() { cublasDestroy(handle_); }

    void gemm() {
        float alpha = 1.0f, beta = 0.0f;
        cublas_check(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, n_, n_, n_, &alpha, m_[0].get(), CUDA_R_16BF, n_,
                                  m_[1].get(), CUDA_R_16BF, n_, &beta, m_[2].get(), CUDA_R_16BF, n_, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT),
                     "cublasGemmEx");
    }
    // Milliseconds per GEMM, measured with events after a warm-up.
    double calibrate() {
        Event a(true), b(true);
        for (int i = 0; i < 5; i++) gemm();
        cudaCheck(cudaEventRecord(a, stream_));
        for (int i = 0; i < 20; i++) gemm();
        cudaCheck(cudaEventRecord(b, stream_));
        cudaCheck(cudaEventSynchronize(b));
        float ms = 0;
        cudaCheck(cudaEventElapsedTime(&ms, a, b));
        return ms / 20;
    }

private:
    int n_;
    cudaStream_t stream_;
    DeviceBuffer<__nv_bfloat16> m_[3];
    cublasHandle_t handle_ = nullptr;
};

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    size_t m = v.size() / 2;
    return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

struct ModeResult {
    std::vector<double> step_ms;
    std::vector<uint64_t> batch_index;         // per measured and unmeasured step, in order
    std::vector<unsigned long long> checksum;  // what the GPU saw for that step
};

}  // namespace

int main(int argc, char** argv) {
    return run_main([&] {
        Options opt;
        if (!parse_args(argc, argv, opt)) return 0;

        DataLoaderConfig cfg;
        cfg.B = opt.B;
        cfg.T = opt.T;
        cfg.vocab_size = uint32_t(opt.vocab);
        cfg.prefetch = opt.prefetch;
        cfg.seed = uint64_t(opt.seed);
        cfg.shuffle = true;
        const size_t bt = size_t(cfg.B) * cfg.T;
        if (cuda_device_count() == 0) fail(kExitCuda, "no CUDA GPU found; this benchmark needs one");
        cudaDeviceProp prop;
        cudaCheck(cudaGetDeviceProperties(&prop, 0));

        TempDir tmp;
        std::string data = opt.data;
        if (data.empty()) {
            long long shards = opt.synthetic_shards, tokens = opt.synthetic_tokens;
            std::printf("writing %lld synthetic shards of %lld random tokens to %s\n", shards, tokens, tmp.path().c_str());
            std::vector<uint32_t> t(static_cast<size_t>(tokens));
            for (long long s = 0; s < shards; s++) {
                SplitMix64 rng(uint64_t(s) + 1);
                for (auto& x : t) x = uint32_t(rng.below(cfg.vocab_size));
                write_token_shard(tmp.file(format("synthetic_%03lld.bin", s)), t.data(), t.size(),
                                  cfg.vocab_size <= 65536 ? 1 : 2);
            }
            data = tmp.path() + "/synthetic_*.bin";
        } else {
            std::printf("reading every shard once so that it is page-cached\n");
            for (const std::string& p : expand_shard_pattern(data)) read_whole_file(p);
        }
        cfg.pattern = data;
        SampleSchedule schedule(cfg);
        std::printf("%s: %s\n", data.c_str(), schedule.describe().c_str());

        // 1a. Host loader alone.
        long long nthr = opt.throughput_batches;
        double host_tps;
        {
            DataLoader dl(schedule);
            auto t0 = std::chrono::steady_clock::now();
            for (long long k = 0; k < nthr; k++) dl.next();
            double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            host_tps = double(nthr) * bt / s;
        }
        Stream compute;
        DeviceBuffer<unsigned long long> sink(1);
        // 1b. Streaming GPU loader end to end, nothing else on the GPU.
        double gpu_tps;
        {
            GpuDataLoader gl(cfg, compute, 0);
            auto t0 = std::chrono::steady_clock::now();
            for (long long k = 0; k < nthr; k++) {
                DeviceBatch b = gl.next_batch();
                checksum_kernel<<<64, 256, 0, compute>>>(b.inputs, b.targets, int(bt), sink.get());
                cudaCheckLaunch();
            }
            cudaCheck(cudaStreamSynchronize(compute));
            double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            gpu_tps = double(nthr) * bt / s;
        }

        // 2. Stall.
        Workload work(opt.gemm, compute);
        double gemm_ms = work.calibrate();
        int gemms = std::max(1, int(opt.step_ms / gemm_ms + 0.5));
        std::printf("workload: %d bf16 GEMMs of %d^3 per step (%.3f ms each) on %s\n", gemms, opt.gemm, gemm_ms,
                    prop.name);

        std::vector<int32_t> fin(bt), ftg(bt);
        {
            DataLoaderConfig c = cfg;
            c.prefetch = 0;
            DataLoader dl(c);
            dl.next_batch(fin.data(), ftg.data());
        }
        DeviceBuffer<int> fixed_in(bt), fixed_tg(bt);
        cudaCheck(cudaMemcpy(fixed_in.get(), fin.data(), bt * sizeof(int), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(fixed_tg.get(), ftg.data(), bt * sizeof(int), cudaMemcpyHostToDevice));

        size_t budget = size_t(opt.resident_budget_gib * double(1ull << 30));
        GpuDataLoader streamed(cfg, compute, 0);
        std::unique_ptr<GpuDataLoader> resident;
        if (budget > 0) {
            resident = std::make_unique<GpuDataLoader>(cfg, compute, budget);
            if (!resident->resident()) {
                std::printf("resident mode skipped: the split needs %s, the budget is %s\n",
                            human_bytes(double(resident->resident_bytes())).c_str(), human_bytes(double(budget)).c_str());
                resident.reset();
            }
        }
        const char* names[3] = {"fixed device batch", "streaming loader", "GPU-resident loader"};
        GpuDataLoader* loaders[3] = {nullptr, &streamed, resident.get()};
        int modes = resident ? 3 : 2;
        int rounds = std::max(1, opt.rounds);
        int warmup = opt.warmup;
        int per_round = std::max(1, opt.steps / rounds);
        int steps = warmup + per_round;

        std::vector<ModeResult> results(modes);
        std::vector<std::unique_ptr<Event>> start_events, end_events;
        std::vector<cudaEvent_t> starts, ends;
        for (int i = 0; i <= steps; i++) {
            start_events.push_back(std::make_unique<Event>(true));
            end_events.push_back(std::make_unique<Event>(false));
            starts.push_back(start_events.back()->get());
            ends.push_back(end_events.back()->get());
        }
        DeviceBuffer<unsigned long long> sums(static_cast<size_t>(steps));
        std::vector<unsigned long long> host_sums(steps);
        for (int r = 0; r < rounds; r++) {
            for (int m = 0; m < modes; m++) {
                cudaCheck(cudaMemsetAsync(sums.get(), 0, sums.bytes(), compute));
                cudaCheck(cudaStreamSynchronize(compute));
                std::vector<uint64_t> index(steps);
                for (int i = 0; i <= steps; i++) {
                    cudaCheck(cudaEventRecord(starts[i], compute));
                    if (i == steps) break;
                    const int *in = fixed_in.get(), *tg = fixed_tg.get();
                    index[i] = 0;
                    if (loaders[m]) {
                        DeviceBatch b = loaders[m]->next_batch();
                        in = b.inputs;
                        tg = b.targets;
                        index[i] = b.index;
                    }
                    checksum_kernel<<<64, 256, 0, compute>>>(in, tg, int(bt), sums.get() + i);
                    cudaCheckLaunch();
                    for (int g = 0; g < gemms; g++) work.gemm();
                    cudaCheck(cudaEventRecord(ends[i], compute));
                    if (i > 0) cudaCheck(cudaEventSynchronize(ends[i - 1]));
                }
                cudaCheck(cudaEventSynchronize(starts[steps]));
                cudaCheck(cudaMemcpy(host_sums.data(), sums.get(), sums.bytes(), cudaMemcpyDeviceToHost));
                for (int i = 0; i < steps; i++) {
                    if (i >= warmup) {
                        float ms = 0;
                        cudaCheck(cudaEventElapsedTime(&ms, starts[i], starts[i + 1]));
                        results[m].step_ms.push_back(ms);
                    }
                    results[m].batch_index.push_back(index[i]);
                    results[m].checksum.push_back(host_sums[i]);
                }
            }
        }

        // Every batch the GPU consumed, checked against the synchronous host path.
        {
            DataLoaderConfig c = cfg;
            c.prefetch = 0;
            DataLoader ref(c);
            std::vector<int32_t> in(bt), tg(bt);
            std::map<uint64_t, unsigned long long> expected;
            for (int m = 0; m < modes; m++) {
                for (size_t i = 0; i < results[m].checksum.size(); i++) {
                    uint64_t k = results[m].batch_index[i];
                    if (!expected.count(k)) {
                        ref.seek(k);
                        ref.next_batch(in.data(), tg.data());
                        expected[k] = host_checksum(in, tg);
                    }
                    if (results[m].checksum[i] != expected[k]) {
                        fail(kExitError, "%s: step %zu consumed batch %llu with checksum %016llx, expected %016llx", names[m],
                             i, (unsigned long long)k, results[m].checksum[i], expected[k]);
                    }
                }
            }
            std::printf("checked: every batch consumed in the stall runs matches the synchronous loader\n");
        }

        double fixed_ms = median(results[0].step_ms);
        std::printf("\n%s, B=%d T=%d, %d measured steps per mode (%d rounds), %d GEMMs of %d^3 per step\n", prop.name,
                    cfg.B, cfg.T, per_round * rounds, rounds, gemms, opt.gemm);
        std::printf("| %-42s | %14s |\n", "measure", "value");
        std::printf("|%s|%s|\n", std::string(44, '-').c_str(), std::string(16, '-').c_str());
        std::printf("| %-42s | %14.3e |\n", "loader tokens/s, host thread only", host_tps);
        std::printf("| %-42s | %14.3e |\n", "loader tokens/s, streaming to GPU (int32)", gpu_tps);
        std::printf("| %-42s | %14.3f |\n", "median step ms, fixed device batch", fixed_ms);
        for (int m = 1; m < modes; m++) {
            double ms = median(results[m].step_ms);
            std::printf("| %-42s | %14.3f |\n", format("median step ms, %s", names[m]).c_str(), ms);
            std::printf("| %-42s | %14.4f |\n", format("stall ms, %s", names[m]).c_str(), ms - fixed_ms);
            std::printf("| %-42s | %13.3f%% |\n", format("stall %%, %s", names[m]).c_str(), 100.0 * (ms - fixed_ms) / fixed_ms);
        }
        return 0;
    });
}
