/*
Benchmark of the disk <-> GPU I/O layer against its two limits and a naive path.

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

usage: bench_device_file_io [--dir /tmp] [--sizes-gib 1,4] [--reps 3] [--chunk-mib 32]
*/
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "llmc/device_file_io.cuh"

using namespace llmc;

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
    std::string cmd = format("'%s' --probe %s --probe-file '%s' --probe-bytes %zu --chunk-mib %zu", self, which.c_str(),
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
        else fail(kExitUsage, "unknown flag '%s' (see the comment at the top of dev/bench_device_file_io.cu)", k.c_str());
    }
    if (a.chunk == 0) fail(kExitUsage, "--chunk-mib must be at least 1");
    return a;
}

int bench(int argc, char** argv) {
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
            long kib = probe_extra_kib(argv[0], a, which, path, n);
            memory.push_back(format("%.0f GiB  %-16s peak extra host memory %s", gib, which,
                                    human_bytes(double(kib) * 1024).c_str()));
        }
        std::remove(path.c_str());
    }

    std::printf("\nbench_device_file_io: dir=%s chunk=%zu MiB reps=%d (median)\n", a.dir.c_str(), a.chunk >> 20, a.reps);
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

int main(int argc, char** argv) {
    return run_main([&] { return bench(argc, argv); });
}
