/*
bench_io: how fast the trainer's transfers between disk, host and GPU go on this machine, and what they
cost a training step. One program, one sub-command per measure (each as it was when it had a program of
its own; docs/performance.md quotes their figures):

  build/bench_io file-io [--dir /tmp] [--sizes-gib 1,4] [--reps 3] [--chunk-mib 32]
  build/bench_io dataloader [--data GLOB] [--B 64] [--T 1024] ...        (build/bench_io dataloader --help)
  build/bench_io checkpoint [output-dir (default /tmp/bench_checkpoint)] [repeats (default 3)]

Each needs a CUDA GPU. bash dev/gpu_runs.sh bench-io dataloader bench-checkpoint runs all three.

---- file-io: llmc/device_file_io.cuh
The disk <-> GPU I/O layer against its two limits and a naive path.

For each size it times (wall clock, median of --reps runs):
  disk alone      the same bytes written from / read into host memory with plain write/read (+ fsync)
  pcie alone      one pinned cudaMemcpy of the whole buffer, each direction
  pipelined       device_to_file + fsync, file_to_device from a cold and a warm page cache (two reader
                  threads, the default, and one)
  naive           whole-buffer pageable cudaMemcpy + fwrite (+ fsync) / fread + cudaMemcpy
and the same disk and pipelined runs with O_DIRECT. Cold means the file's pages were dropped from the page
cache first (posix_fadvise DONTNEED, and /proc/sys/vm/drop_caches when we are root).
Peak extra host memory (VmHWM minus the RSS before the transfer) of the pipelined and the naive path is
measured in child processes, one per path, so that one does not hide the other.

---- dataloader: llmc/dataloader.h, llmc/dataloader_gpu.cuh
How fast the loader reads, and whether a training-sized GPU workload ever waits for it.

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

---- checkpoint: llmc/checkpoint.cuh
How long a checkpoint stalls training, synchronous against asynchronous save, for a d12-sized state
(GPT-2 124M: fp32 master weights as a model file, bf16 parameters, AdamW m and v; about 1.74 GB), and
the write rate of each.

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
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include "llmc/shard.h"
#include "llmc/checkpoint.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/dataloader_gpu.cuh"
#include "llmc/device_file_io.cuh"
#include "llmc/flags.h"
#include "llmc/utils.h"

using namespace llmc;

// ---- file-io
namespace bench_file_io {
namespace {

struct Args {
    std::string dir = "/tmp";
    std::vector<double> sizes_gib = {1, 4};
    int reps = 3;
    size_t chunk = kDefaultChunkBytes;
    // child mode: measure the peak host memory of one path
    std::string probe;
    std::string probe_file;
    size_t probe_bytes = 0;
};

double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

long status_kib(const char* key) {
    FILE* f = std::fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long v = -1;
    size_t klen = std::strlen(key);
    while (std::fgets(line, sizeof(line), f)) {
        if (std::strncmp(line, key, klen) == 0) v = std::atol(line + klen);
    }
    std::fclose(f);
    return v;
}

void drop_page_cache(const std::string& path) {
    {
        File f(path, File::Mode::Read);
        f.sync();
        posix_fadvise(f.fd(), 0, 0, POSIX_FADV_DONTNEED);
    }
    if (geteuid() == 0) {
        ::sync();
        FILE* d = std::fopen("/proc/sys/vm/drop_caches", "w");
        if (d) {
            std::fputs("1", d);
            std::fclose(d);
        }
    }
}

__global__ void fill_kernel(uint64_t* out, size_t n, uint64_t seed) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
        uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
        x ^= x >> 31;
        x *= 0xBF58476D1CE4E5B9ull;
        x ^= x >> 29;
        out[i] = x;
    }
}

void host_write(const std::string& path, const char* data, size_t n, bool direct) {
    File f(path, File::Mode::Write, direct);
    f.write_all(data, n);
    f.sync();
    f.close();
}

void host_read(const std::string& path, char* data, size_t n, bool direct) {
    File f(path, File::Mode::Read, direct);
    f.read_exact(data, n);
}

void naive_write(const std::string& path, const void* dev, size_t n) {
    std::vector<char> host(n);
    cudaCheck(cudaMemcpy(host.data(), dev, n, cudaMemcpyDeviceToHost));
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f) fail(kExitIo, "cannot open '%s'", path.c_str());
    if (std::fwrite(host.data(), 1, n, f) != n) fail(kExitIo, "fwrite to '%s' failed", path.c_str());
    if (std::fflush(f) != 0 || fsync(fileno(f)) != 0) fail(kExitIo, "flush of '%s' failed", path.c_str());
    std::fclose(f);
}

void naive_read(const std::string& path, void* dev, size_t n) {
    std::vector<char> host(n);
    FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) fail(kExitIo, "cannot open '%s'", path.c_str());
    if (std::fread(host.data(), 1, n, f) != n) fail(kExitIo, "fread from '%s' failed", path.c_str());
    std::fclose(f);
    cudaCheck(cudaMemcpy(dev, host.data(), n, cudaMemcpyHostToDevice));
}

// Child process: one transfer, then print the peak extra host memory in KiB.
int run_probe(const Args& a) {
    cudaCheck(cudaFree(nullptr));
    DeviceBuffer<char> dev(a.probe_bytes);
    cudaCheck(cudaMemset(dev.get(), 3, a.probe_bytes));
    cudaCheck(cudaDeviceSynchronize());
    long base = status_kib("VmRSS:");
    if (a.probe == "pipelined-write") {
        DeviceFileIO io(a.chunk);
        File f(a.probe_file, File::Mode::Write);
        io.device_to_file(f, dev.get(), a.probe_bytes, nullptr);
        f.sync();
    } else if (a.probe == "pipelined-read") {
        DeviceFileIO io(a.chunk);
        File f(a.probe_file, File::Mode::Read);
        io.file_to_device(dev.get(), f, a.probe_bytes, nullptr);
    } else if (a.probe == "naive-write") {
        naive_write(a.probe_file, dev.get(), a.probe_bytes);
    } else if (a.probe == "naive-read") {
        naive_read(a.probe_file, dev.get(), a.probe_bytes);
    } else {
        fail(kExitUsage, "unknown probe '%s'", a.probe.c_str());
    }
    long peak = status_kib("VmHWM:");
    std::printf("extra_kib %ld\n", peak - base);
    return 0;
}

long probe_extra_kib(const char* self, const Args& a, const std::string& which, const std::string& path, size_t n) {
    std::string cmd = format("'%s' file-io --probe %s --probe-file '%s' --probe-bytes %zu --chunk-mib %zu", self, which.c_str(),
                             path.c_str(), n, a.chunk >> 20);
    FILE* p = popen(cmd.c_str(), "r");
    if (!p) fail(kExitError, "cannot run '%s'", cmd.c_str());
    long kib = -1;
    char line[256];
    while (std::fgets(line, sizeof(line), p)) std::sscanf(line, "extra_kib %ld", &kib);
    if (pclose(p) != 0 || kib < 0) fail(kExitError, "memory probe '%s' failed", cmd.c_str());
    return kib;
}

struct Row {
    std::string what;
    double gib;
    double seconds;
    size_t bytes;
};

Args parse(int argc, char** argv) {
    Args a;
    for (int i = 1; i < argc; i++) {
        std::string k = argv[i];
        auto val = [&]() -> std::string {
            if (i + 1 >= argc) fail(kExitUsage, "%s needs a value", k.c_str());
            return argv[++i];
        };
        if (k == "--dir") a.dir = val();
        else if (k == "--reps") a.reps = std::max(1, std::atoi(val().c_str()));
        else if (k == "--chunk-mib") a.chunk = size_t(std::atol(val().c_str())) << 20;
        else if (k == "--sizes-gib") {
            a.sizes_gib.clear();
            std::string s = val();
            size_t pos = 0;
            while (pos < s.size()) {
                size_t c = s.find(',', pos);
                if (c == std::string::npos) c = s.size();
                a.sizes_gib.push_back(std::atof(s.substr(pos, c - pos).c_str()));
                pos = c + 1;
            }
        } else if (k == "--probe") a.probe = val();
        else if (k == "--probe-file") a.probe_file = val();
        else if (k == "--probe-bytes") a.probe_bytes = std::strtoull(val().c_str(), nullptr, 10);
        else fail(kExitUsage, "unknown flag '%s' (see the comment at the top of dev/bench_io.cu)", k.c_str());
    }
    if (a.chunk == 0) fail(kExitUsage, "--chunk-mib must be at least 1");
    return a;
}

int bench(const char* self, int argc, char** argv) {
    Args a = parse(argc, argv);
    if (!a.probe.empty()) return run_probe(a);
    if (cuda_device_count() == 0) fail(kExitCuda, "no CUDA GPU: this benchmark needs one");
    std::string path = a.dir + "/bench_device_file_io.bin";
    std::vector<Row> rows;
    std::vector<std::string> checks;
    std::vector<std::string> memory;

    for (double gib : a.sizes_gib) {
        size_t n = size_t(gib * double(size_t(1) << 30));
        n = n / 4096 * 4096;  // whole pages, so the O_DIRECT variants move the same bytes
        std::fprintf(stderr, "== %.2f GiB\n", gib);
        DeviceBuffer<char> dev(n), dev2(n);
        fill_kernel<<<1024, 256>>>(reinterpret_cast<uint64_t*>(dev.get()), n / 8, 42);
        cudaCheckLaunch();
        char* host = static_cast<char*>(std::aligned_alloc(4096, n));
        if (!host) fail(kExitError, "out of host memory");
        cudaCheck(cudaMemcpy(host, dev.get(), n, cudaMemcpyDeviceToHost));
        DeviceFileIO io(a.chunk), io_direct(a.chunk, true), io_one_reader(a.chunk, false, 1);
        Stream stream;

        // Operations are timed in rounds (A B C, A B C, ...) so that a drift in the disk's speed during the run
        // lands on every operation alike; each row is the median over the rounds.
        struct Op {
            std::string what;
            bool cold;  // drop the file from the page cache before each run
            std::function<void()> run;
            std::vector<double> t;
        };
        auto time_group = [&](std::vector<Op> ops) {
            for (int r = 0; r < a.reps; r++) {
                for (Op& op : ops) {
                    if (op.cold) drop_page_cache(path);
                    double t0 = now_s();
                    op.run();
                    op.t.push_back(now_s() - t0);
                }
            }
            std::vector<double> medians;
            for (Op& op : ops) {
                double m = median(op.t);
                rows.push_back({op.what, gib, m, n});
                auto [lo, hi] = std::minmax_element(op.t.begin(), op.t.end());
                std::fprintf(stderr, "  %-34s %8.3f s  %6.2f GB/s  (runs %.3f..%.3f s)\n", op.what.c_str(), m, n / 1e9 / m,
                             *lo, *hi);
                medians.push_back(m);
            }
            return medians;
        };
        auto pipelined_write = [&](DeviceFileIO& io_) {
            File f(path, File::Mode::Write);
            io_.device_to_file(f, dev.get(), n, stream);
            f.sync();
        };
        auto pipelined_read = [&](DeviceFileIO& io_) {
            File f(path, File::Mode::Read);
            io_.file_to_device(dev2.get(), f, n, stream);
        };

        // Writes (each ends with fsync, so the bytes are on disk).
        std::vector<double> w = time_group({
            {"disk alone: write+fsync", false, [&] { host_write(path, host, n, false); }, {}},
            {"device_to_file+fsync", false, [&] { pipelined_write(io); }, {}},
            {"disk alone: write+fsync O_DIRECT", false, [&] { host_write(path, host, n, true); }, {}},
            {"device_to_file+fsync O_DIRECT", false, [&] { pipelined_write(io_direct); }, {}},
            {"naive: memcpy+fwrite+fsync", false, [&] { naive_write(path, dev.get(), n); }, {}},
        });
        double disk_w = w[0], pipe_w = w[1];
        // The file now holds the buffer's bytes; the reads are checked once at the end.
        std::vector<double> rc = time_group({
            {"disk alone: read cold", true, [&] { host_read(path, host, n, false); }, {}},
            {"file_to_device cold", true, [&] { pipelined_read(io); }, {}},
            {"file_to_device cold, 1 reader", true, [&] { pipelined_read(io_one_reader); }, {}},
            {"disk alone: read O_DIRECT", true, [&] { host_read(path, host, n, true); }, {}},
            {"file_to_device O_DIRECT", true, [&] { pipelined_read(io_direct); }, {}},
            {"naive: fread+memcpy cold", true, [&] { naive_read(path, dev2.get(), n); }, {}},
        });
        double disk_r_cold = rc[0], pipe_r_cold = rc[1];
        std::vector<double> rw = time_group({
            {"disk alone: read warm", false, [&] { host_read(path, host, n, false); }, {}},
            {"file_to_device warm", false, [&] { pipelined_read(io); }, {}},
            {"file_to_device warm, 1 reader", false, [&] { pipelined_read(io_one_reader); }, {}},
        });
        double disk_r_warm = rw[0], pipe_r_warm = rw[1];
        {
            PinnedBuffer pinned(n);
            time_group({
                {"pcie alone: pinned H2D", false,
                 [&] { cudaCheck(cudaMemcpy(dev2.get(), pinned.get(), n, cudaMemcpyHostToDevice)); }, {}},
                {"pcie alone: pinned D2H", false,
                 [&] { cudaCheck(cudaMemcpy(pinned.get(), dev.get(), n, cudaMemcpyDeviceToHost)); }, {}},
            });
        }

        // What came back must be what was written.
        {
            File f(path, File::Mode::Read);
            io.file_to_device(dev2.get(), f, n, stream);
            std::vector<char> back(n);
            cudaCheck(cudaMemcpy(back.data(), dev2.get(), n, cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(host, dev.get(), n, cudaMemcpyDeviceToHost));
            if (std::memcmp(back.data(), host, n) != 0) fail(kExitError, "round trip through '%s' changed bytes", path.c_str());
        }
        std::free(host);

        checks.push_back(format("%.0f GiB  device_to_file+fsync / disk write+fsync = %.3f  (target <= 1.10) %s", gib,
                                pipe_w / disk_w, pipe_w / disk_w <= 1.10 ? "PASS" : "FAIL"));
        checks.push_back(format("%.0f GiB  file_to_device cold / disk read cold   = %.3f  (target <= 1.10) %s", gib,
                                pipe_r_cold / disk_r_cold, pipe_r_cold / disk_r_cold <= 1.10 ? "PASS" : "FAIL"));
        checks.push_back(format("%.0f GiB  file_to_device warm / disk read warm   = %.3f  (target <= 1.10) %s", gib,
                                pipe_r_warm / disk_r_warm, pipe_r_warm / disk_r_warm <= 1.10 ? "PASS" : "FAIL"));

        for (const char* which : {"pipelined-write", "pipelined-read", "naive-write", "naive-read"}) {
            long kib = probe_extra_kib(self, a, which, path, n);
            memory.push_back(format("%.0f GiB  %-16s peak extra host memory %s", gib, which,
                                    human_bytes(double(kib) * 1024).c_str()));
        }
        std::remove(path.c_str());
    }

    std::printf("\nbench_io file-io: dir=%s chunk=%zu MiB reps=%d (median)\n", a.dir.c_str(), a.chunk >> 20, a.reps);
    std::printf("| size | operation | seconds | GB/s |\n|---|---|---|---|\n");
    for (const Row& r : rows) {
        std::printf("| %.0f GiB | %s | %.3f | %.2f |\n", r.gib, r.what.c_str(), r.seconds, r.bytes / 1e9 / r.seconds);
    }
    std::printf("\n");
    for (const auto& m : memory) std::printf("%s\n", m.c_str());
    for (const auto& c : checks) std::printf("%s\n", c.c_str());
    return 0;
}

}  // namespace

int run(const char* self, int argc, char** argv) {
    return run_main([&] { return bench(self, argc, argv); });
}
}  // namespace bench_file_io

// ---- dataloader
namespace bench_dataloader {
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
    Flags flags("bench_io dataloader", "DataLoader throughput, and whether a GPU workload stalls waiting for it.");
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

int run(int argc, char** argv) {
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
}  // namespace bench_dataloader

// ---- checkpoint
namespace bench_checkpoint {
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

int run(int argc, char** argv) {
    return run_main([&]() -> int {
        const std::string out = argc > 1 ? argv[1] : "/tmp/bench_checkpoint";
        const int repeats = argc > 2 ? std::atoi(argv[2]) : 3;
        if (repeats < 1) fail(kExitUsage, "repeats must be at least 1");
        if (cuda_device_count() == 0) fail(kExitCuda, "bench_io checkpoint needs a CUDA GPU");

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
}  // namespace bench_checkpoint

int main(int argc, char** argv) {
    const std::string command = argc > 1 ? argv[1] : "";
    // Each sub-command reads its own arguments with the sub-command's name as argv[0].
    if (command == "file-io") return bench_file_io::run(argv[0], argc - 1, argv + 1);
    if (command == "dataloader") return bench_dataloader::run(argc - 1, argv + 1);
    if (command == "checkpoint") return bench_checkpoint::run(argc - 1, argv + 1);
    std::fprintf(stderr, "usage: %s file-io|dataloader|checkpoint [ARGS...] (see the comment at the top of dev/bench_io.cu)\n",
                 argv[0]);
    return command == "--help" || command == "-h" ? 0 : 2;
}
