/*
GPU tests of device_to_file / file_to_device (llmc/device_file_io.cuh): bit-exact round trips of random
data for sizes around the chunk size and past 1 GiB, different read and write chunk sizes, payloads
between a header and a trailer, direct I/O, stream ordering and independence from other streams, and the
error paths a user can hit (short file, unwritable path, full disk, file size limit) with their exit code.
Device destinations are poisoned before every read and guarded on both sides.
*/
#include <gtest/gtest.h>

#include <algorithm>
#include <csignal>
#include <mutex>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include "llmc/device_file_io.cuh"
#include "test/gpu_test.h"
#include "test/test_util.h"

using namespace llmc;
using llmc::test::random_bytes;

namespace {

class DeviceFileIOTest : public GpuTest {
protected:
    void SetUp() override {
        GpuTest::SetUp();
        if (IsSkipped()) return;
        tmp_ = std::make_unique<test::TempDir>("llmc_dfio");
        dir_ = tmp_->path();
    }
    std::string file(const std::string& name) const { return dir_ + "/" + name; }

    // header | payload | trailer written with one I/O context, payload read back with another.
    void round_trip(size_t n, size_t write_chunk, size_t read_chunk, size_t header_bytes, bool direct, uint64_t seed,
                    cudaStream_t stream, int readers = 2) {
        SCOPED_TRACE(format("n=%zu write_chunk=%zu read_chunk=%zu header=%zu direct=%d readers=%d", n, write_chunk,
                            read_chunk, header_bytes, int(direct), readers));
        const size_t guard = 64;
        std::vector<char> header = random_bytes(header_bytes, seed + 1);
        std::vector<char> payload = random_bytes(n, seed + 2);
        std::vector<char> trailer = random_bytes(4099, seed + 3);
        DeviceBuffer<char> src(n + 1), dst(n + 2 * guard);
        if (n) cudaCheck(cudaMemcpy(src.get(), payload.data(), n, cudaMemcpyHostToDevice));
        // A copy from pageable memory may still be in flight when cudaMemcpy returns, and `stream` may be a
        // non-blocking one, which does not wait for the legacy stream: the copy lands before the write reads.
        cudaCheck(cudaDeviceSynchronize());
        std::string path = file("rt.bin");
        {
            DeviceFileIO io(write_chunk, direct);
            File f(path, File::Mode::Write);
            f.write_all(header.data(), header.size());
            io.device_to_file(f, src.get(), n, stream);
            ASSERT_EQ(f.tell(), int64_t(header_bytes + n));
            f.write_all(trailer.data(), trailer.size());
            f.sync();
            f.close();
        }
        {
            File f(path, File::Mode::Read);
            ASSERT_EQ(f.size(), int64_t(header_bytes + n + trailer.size()));
            std::vector<char> h(header_bytes), t(trailer.size());
            f.read_exact(h.data(), h.size());
            EXPECT_EQ(h, header) << "header changed";
            f.seek(int64_t(header_bytes + n));
            f.read_exact(t.data(), t.size());
            EXPECT_EQ(t, trailer) << "trailer changed";
        }
        // Poisoned on the transfer's stream: file_to_device's copies are ordered after the work queued there.
        // (A cudaMemset would run on the legacy default stream, which a non-blocking stream does not wait
        // for: on a busy GPU the poison could land after the copies.)
        cudaCheck(cudaMemsetAsync(dst.get(), 0xA5, dst.bytes(), stream));
        DeviceFileIO io(read_chunk, direct, readers);
        File f(path, File::Mode::Read);
        f.seek(int64_t(header_bytes));
        io.file_to_device(dst.get() + guard, f, n, stream);
        EXPECT_EQ(f.tell(), int64_t(header_bytes + n));
        std::vector<char> back(dst.bytes());
        cudaCheck(cudaMemcpy(back.data(), dst.get(), back.size(), cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < guard; i++) {
            ASSERT_EQ(uint8_t(back[i]), 0xA5) << "byte before the destination written";
            ASSERT_EQ(uint8_t(back[guard + n + i]), 0xA5) << "byte after the destination written";
        }
        if (n) {
            int diff = std::memcmp(back.data() + guard, payload.data(), n);
            if (diff != 0) {
                size_t first = 0;
                while (back[guard + first] == payload[first]) first++;
                FAIL() << "payload differs, first at byte " << first;
            }
        }
    }

    std::unique_ptr<test::TempDir> tmp_;
    std::string dir_;
};

constexpr size_t kChunk = kDefaultChunkBytes;

}  // namespace

TEST_F(DeviceFileIOTest, SizesAroundTheChunk) {
    Stream s;
    uint64_t seed = 10;
    for (size_t n : {size_t(0), size_t(1), size_t(31), kChunk - 1, kChunk, kChunk + 1, kChunk * 7 / 2}) {
        round_trip(n, kChunk, kChunk, 0, false, seed++, s);
        round_trip(n, kChunk, kChunk, 1024, false, seed++, s, /*readers=*/1);
    }
}

TEST_F(DeviceFileIOTest, OneGiBPlusSeven) {
    Stream s;
    round_trip((size_t(1) << 30) + 7, kChunk, kChunk, 1024, false, 77, s);
}

TEST_F(DeviceFileIOTest, DifferentChunkSizesThatDoNotDivideTheSize) {
    Stream s;
    const size_t n = size_t(100) * 1000 * 1000 + 3;  // 100 MB + 3
    round_trip(n, (size_t(5) << 20) + 1, (size_t(3) << 20) - 7, 1024, false, 1, s);
    round_trip(n, 999999, kChunk, 1, false, 2, s);
    round_trip(12345, 1, 7, 3, false, 3, s);  // one-byte chunks
}

TEST_F(DeviceFileIOTest, HeaderAndTrailerUntouchedAtOddOffsets) {
    Stream s;
    uint64_t seed = 40;
    for (size_t header : {size_t(1), size_t(1024), size_t(4097)}) {
        round_trip(kChunk * 2 + 5, kChunk, size_t(1) << 20, header, false, seed++, s);
    }
}

TEST_F(DeviceFileIOTest, DirectIO) {
    int fd = ::open(file("probe").c_str(), O_WRONLY | O_CREAT | O_DIRECT, 0644);
    if (fd < 0) GTEST_SKIP() << "skipped: O_DIRECT is not supported in " << dir_;
    ::close(fd);
    Stream s;
    uint64_t seed = 50;
    for (size_t header : {size_t(0), size_t(1024), size_t(4096)}) {
        for (size_t n : {size_t(1), size_t(4096), kChunk + 4095, size_t(300) << 20}) {
            round_trip(n, kChunk, size_t(8) << 20, header, true, seed++, s);
        }
    }
}

TEST_F(DeviceFileIOTest, DefaultStream) { round_trip(kChunk + 17, kChunk, kChunk, 1024, false, 60, nullptr); }

namespace {
__global__ void spin_kernel(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
__global__ void fill_kernel(uint32_t* out, size_t n, uint32_t salt) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
        out[i] = uint32_t(i) * 2654435761u ^ salt;
    }
}
}  // namespace

TEST_F(DeviceFileIOTest, OrderedAfterWorkOnItsStreamAndIndependentOfOtherStreams) {
    Stream io_stream, busy_stream;
    int clock_khz = 0;
    cudaCheck(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    // Everything is allocated before the spin starts: cudaMalloc and cudaHostAlloc may synchronise the device,
    // which is why an I/O context is made once at start-up, never inside a step.
    const size_t words = (size_t(96) << 20) / 4 + 3;
    DeviceBuffer<uint32_t> buf(words), back(words);
    DeviceFileIO io;
    // Launch the fill kernel once first: with lazy module loading (CUDA's default) a kernel's first launch
    // loads it, and that waits for work running on the device, which is not what this test is about.
    fill_kernel<<<1, 32, 0, io_stream>>>(buf.get(), 1, 0);
    cudaCheckLaunch();
    cudaCheck(cudaDeviceSynchronize());
    // Keep another stream busy for about 3 s while the transfer runs.
    spin_kernel<<<1, 1, 0, busy_stream>>>(3LL * clock_khz * 1000);
    cudaCheckLaunch();
    // The kernel that produces the data is queued just before the write, on the same stream, with no sync:
    // device_to_file must wait for it through stream order.
    fill_kernel<<<264, 256, 0, io_stream>>>(buf.get(), words, 0xC0FFEEu);
    cudaCheckLaunch();
    std::string path = file("ordered.bin");
    File w(path, File::Mode::Write);
    io.device_to_file(w, buf.get(), words * 4, io_stream);
    w.close();
    cudaCheck(cudaMemsetAsync(back.get(), 0xFF, words * 4, io_stream));
    File r(path, File::Mode::Read);
    io.file_to_device(back.get(), r, words * 4, io_stream);
    EXPECT_EQ(cudaStreamQuery(busy_stream), cudaErrorNotReady)
        << "the transfer waited for an unrelated stream (or the spin kernel was too short)";
    std::vector<uint32_t> host(words);
    cudaCheck(cudaMemcpy(host.data(), back.get(), words * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < words; i++) {
        ASSERT_EQ(host[i], uint32_t(i) * 2654435761u ^ 0xC0FFEEu) << "word " << i;
    }
    cudaCheck(cudaStreamSynchronize(busy_stream));
}

TEST_F(DeviceFileIOTest, PinnedMemoryIsTwoChunksAndReused) {
    DeviceFileIO io(size_t(4) << 20);
    EXPECT_GE(io.pinned_bytes(), size_t(8) << 20);
    EXPECT_LE(io.pinned_bytes(), (size_t(8) << 20) + 4096);
    Stream s;
    DeviceBuffer<char> d(size_t(20) << 20);
    cudaCheck(cudaMemsetAsync(d.get(), 1, d.bytes(), s));  // on the stream the writes below read it on
    for (int i = 0; i < 3; i++) {
        File f(file("reuse.bin"), File::Mode::Write);
        io.device_to_file(f, d.get(), d.bytes(), s);
    }
    EXPECT_LE(io.pinned_bytes(), (size_t(8) << 20) + 4096);
}

TEST_F(DeviceFileIOTest, ShortFileIsAnError) {
    std::string path = file("short.bin");
    std::vector<char> data = random_bytes(1000, 9);
    {
        File f(path, File::Mode::Write);
        f.write_all(data.data(), data.size());
    }
    DeviceBuffer<char> d(4096);
    cudaCheck(cudaMemset(d.get(), 0xA5, 4096));
    DeviceFileIO io(256);
    File f(path, File::Mode::Read);
    f.seek(100);
    try {
        io.file_to_device(d.get(), f, 901, nullptr);
        FAIL() << "expected an error";
    } catch (const Error& e) {
        EXPECT_EQ(e.exit_code(), kExitIo);
        EXPECT_EQ(std::string(e.what()),
                  "'" + path + "' is too short: expected 901 bytes at offset 100, but the file is 1000 bytes");
    }
    std::vector<char> back(4096);
    cudaCheck(cudaMemcpy(back.data(), d.get(), 4096, cudaMemcpyDeviceToHost));
    for (char c : back) ASSERT_EQ(uint8_t(c), 0xA5) << "nothing may be copied from a short file";
}

namespace {
// Runs a device_to_file of n bytes to `path` as a program would, returning its exit code.
int write_program(const std::string& path, size_t n) {
    return run_main([&] {
        DeviceBuffer<char> d(n);
        cudaCheck(cudaMemset(d.get(), 7, n));
        DeviceFileIO io(size_t(1) << 20);
        File f(path, File::Mode::Write);
        io.device_to_file(f, d.get(), n, nullptr);
        f.sync();
        f.close();
        return 0;
    });
}
int read_program(const std::string& path, size_t n) {
    return run_main([&] {
        DeviceBuffer<char> d(n);
        DeviceFileIO io;
        File f(path, File::Mode::Read);
        io.file_to_device(d.get(), f, n, nullptr);
        return 0;
    });
}
void write_over_size_limit(const std::string& path) {
    std::signal(SIGXFSZ, SIG_IGN);  // otherwise the kernel kills the process instead of failing the write
    struct rlimit lim;
    lim.rlim_cur = lim.rlim_max = 3 << 20;
    setrlimit(RLIMIT_FSIZE, &lim);
    std::exit(write_program(path, size_t(8) << 20));
}
}  // namespace

TEST_F(DeviceFileIOTest, ErrorExitCodes) {
    EXPECT_EXIT(std::exit(write_program("/nonexistent_llmc_dir/ckpt.bin", 1000)), ::testing::ExitedWithCode(kExitIo),
                "error: cannot open '/nonexistent_llmc_dir/ckpt.bin' for writing: No such file or directory");
    EXPECT_EXIT(std::exit(write_program("/dev/full", size_t(4) << 20)), ::testing::ExitedWithCode(kExitIo),
                "error: write of 1048576 bytes to '/dev/full' at offset 0 failed: No space left on device");
    std::string limited = file("limited.bin");
    EXPECT_EXIT(write_over_size_limit(limited), ::testing::ExitedWithCode(kExitIo),
                "error: write of [0-9]+ bytes to '.*limited.bin' at offset 3145728 failed: File too large");
    std::string shorty = file("short.bin");
    {
        File f(shorty, File::Mode::Write);
        f.write_all("abc", 3);
    }
    EXPECT_EXIT(std::exit(read_program(shorty, 10)), ::testing::ExitedWithCode(kExitIo),
                "error: '.*short.bin' is too short: expected 10 bytes at offset 0, but the file is 3 bytes");
}

TEST_F(DeviceFileIOTest, FullTmpfs) {
    // A real full file system, where this machine lets us mount a small tmpfs (root on the GPU machine).
    std::string mnt = file("mnt");
    if (std::system(("mkdir -p '" + mnt + "' && mount -t tmpfs -o size=4m tmpfs '" + mnt + "' 2>/dev/null").c_str()) != 0) {
        GTEST_SKIP() << "skipped: cannot mount a tmpfs here (needs root)";
    }
    ::testing::internal::CaptureStderr();
    int code = write_program(mnt + "/ckpt.bin", size_t(16) << 20);
    std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(std::system(("umount '" + mnt + "'").c_str()), 0);
    EXPECT_EQ(code, kExitIo);
    EXPECT_NE(err.find("ckpt.bin' at offset"), std::string::npos) << err;
    EXPECT_NE(err.find("No space left on device (is the disk full"), std::string::npos) << err;
}

// The chunk hook sees each chunk in the pinned staging buffer, with the bytes that go to the file (after the
// device copy has landed) and that came from it (before the copy to the device), at their file offsets.
TEST_F(DeviceFileIOTest, ChunkHookSeesPinnedChunksAtTheirOffsets) {
    const size_t chunk = 1 << 20, n = 5 * chunk + 12345, header = 100;
    std::vector<char> payload = random_bytes(n, 77);
    DeviceBuffer<char> d(n), back(n);
    cudaCheck(cudaMemcpy(d.get(), payload.data(), n, cudaMemcpyHostToDevice));
    DeviceFileIO io(chunk);
    std::mutex mu;
    std::vector<std::pair<uint64_t, size_t>> seen;
    bool all_pinned = true, all_equal = true;
    auto hook = [&](const char* p, size_t bytes, uint64_t off) {
        cudaPointerAttributes attr{};
        const bool pinned = cudaPointerGetAttributes(&attr, p) == cudaSuccess && attr.type == cudaMemoryTypeHost;
        const bool equal = off >= header && off - header + bytes <= n && std::memcmp(p, payload.data() + (off - header), bytes) == 0;
        std::lock_guard<std::mutex> lock(mu);
        seen.emplace_back(off, bytes);
        all_pinned = all_pinned && pinned;
        all_equal = all_equal && equal;
    };
    auto check = [&](const char* what) {
        SCOPED_TRACE(what);
        std::sort(seen.begin(), seen.end());
        ASSERT_EQ(seen.size(), (n + chunk - 1) / chunk);
        uint64_t at = header;
        for (auto& s : seen) {
            EXPECT_EQ(s.first, at);
            at += s.second;
        }
        EXPECT_EQ(at, header + n);
        EXPECT_TRUE(all_pinned);
        EXPECT_TRUE(all_equal);
        seen.clear();
    };
    const std::string path = file("hook.bin");
    {
        File f(path, File::Mode::Write);
        f.write_all(std::string(header, 'h').data(), header);
        io.device_to_file(f, d.get(), n, nullptr, hook);
        f.close();
    }
    check("write");
    cudaCheck(cudaMemset(back.get(), 0xAB, n));
    File f(path, File::Mode::Read);
    f.seek(header);
    io.file_to_device(back.get(), f, n, nullptr, hook);
    check("read");
    std::vector<char> host(n);
    cudaCheck(cudaMemcpy(host.data(), back.get(), n, cudaMemcpyDeviceToHost));
    EXPECT_EQ(host, payload);
}

int main(int argc, char** argv) {
    ::testing::InitGoogleTest(&argc, argv);
    ::testing::FLAGS_gtest_death_test_style = "threadsafe";
    return RUN_ALL_TESTS();
}
