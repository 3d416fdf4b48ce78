/*
CPU tests of the disk <-> device transfer schedule (llmc/chunk_pipeline.h) and of the checked file layer
(llmc/utils.h). The "device" here is host memory behind a copier whose copies only happen when the
pipeline waits for them, so a pipeline that touches a staging buffer before its copy is finished, or
reuses a buffer still in flight, produces wrong bytes or a recorded violation.
*/
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <mutex>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "llmc/chunk_pipeline.h"
#include "llmc/utils.h"
#include "test/test_util.h"

using namespace llmc;
using llmc::test::random_bytes;
using llmc::test::read_bytes;
using llmc::test::TempDir;

namespace {

// A copier whose copies are deferred until wait(): stale or overwritten staging data shows up as wrong bytes.
class LazyHostCopier final : public StagingCopier {
public:
    explicit LazyHostCopier(size_t chunk_bytes, size_t alignment = 4096) : chunk_(chunk_bytes) {
        stride_ = (chunk_bytes + alignment - 1) / alignment * alignment;
        mem_ = static_cast<char*>(std::aligned_alloc(alignment, 2 * stride_));
        std::memset(mem_, 0x5A, 2 * stride_);
    }
    ~LazyHostCopier() override { std::free(mem_); }
    size_t chunk_bytes() const override { return chunk_; }
    char* staging(int slot) override {
        std::lock_guard<std::mutex> lock(mu_);
        if (pending_[slot].active) violations++;  // the pipeline looked at a buffer whose copy is still in flight
        return mem_ + slot * stride_;
    }
    void to_host_async(int slot, const void* src, size_t n) override { start(slot, {true, true, src, nullptr, n}); }
    void to_device_async(void* dst, int slot, size_t n) override { start(slot, {true, false, nullptr, dst, n}); }
    void bind_thread() override { bound_threads++; }
    void wait(int slot) override {
        std::lock_guard<std::mutex> lock(mu_);
        Op& op = pending_[slot];
        if (!op.active) return;
        char* buf = mem_ + slot * stride_;
        if (op.to_host) {
            std::memcpy(buf, op.src, op.n);
        } else {
            std::memcpy(op.dst, buf, op.n);
            std::memset(buf, 0x5A, op.n);  // poison, so a later read of this buffer without a refill is visible
        }
        op.active = false;
        in_flight--;
    }
    void drain() noexcept override {
        wait(0);
        wait(1);
    }

    // Two reader threads may drive the copier at once, so its books are kept under a lock.
    int violations = 0;
    int in_flight = 0;
    int max_in_flight = 0;
    int copies = 0;
    std::atomic<int> bound_threads{0};

private:
    struct Op {
        bool active = false;
        bool to_host = false;
        const void* src = nullptr;
        void* dst = nullptr;
        size_t n = 0;
    };
    void start(int slot, Op op) {
        std::lock_guard<std::mutex> lock(mu_);
        if (op.n > chunk_) violations++;
        if (pending_[slot].active) violations++;  // reusing a buffer whose copy has not finished
        pending_[slot] = op;
        copies++;
        in_flight++;
        max_in_flight = std::max(max_in_flight, in_flight);
    }
    size_t chunk_, stride_;
    char* mem_;
    Op pending_[2];
    std::mutex mu_;
};

bool direct_io_supported(const std::string& dir) {
    std::string p = dir + "/direct_probe";
    int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_DIRECT, 0644);
    if (fd < 0) return false;
    ::close(fd);
    ::unlink(p.c_str());
    return true;
}

// Writes header + payload + trailer with one chunk size, reads the payload back with another, and checks
// every byte, the file layout, and that the pipeline never had more than two copies in flight.
void round_trip(const TempDir& dir, size_t n, size_t write_chunk, size_t read_chunk, size_t header_bytes,
                size_t direct_alignment, uint64_t seed, int readers = 2) {
    SCOPED_TRACE(format("n=%zu write_chunk=%zu read_chunk=%zu header=%zu direct=%zu readers=%d", n, write_chunk,
                        read_chunk, header_bytes, direct_alignment, readers));
    std::vector<char> header = random_bytes(header_bytes, seed + 1);
    std::vector<char> payload = random_bytes(n, seed + 2);
    std::vector<char> trailer = random_bytes(37, seed + 3);
    std::string path = dir.file("rt.bin");
    {
        File f(path, File::Mode::Write);
        f.write_all(header.data(), header.size());
        LazyHostCopier w(write_chunk);
        pipelined_device_to_file(w, f, payload.data(), n, direct_alignment);
        EXPECT_EQ(w.violations, 0);
        EXPECT_EQ(f.tell(), int64_t(header_bytes + n));
        size_t expected_chunks = direct_alignment ? 0 : (n + write_chunk - 1) / write_chunk;
        if (!direct_alignment) {
            EXPECT_EQ(size_t(w.copies), expected_chunks);
        }
        if (expected_chunks >= 2) {
            EXPECT_EQ(w.max_in_flight, 2) << "the next chunk's copy should overlap the write";
        }
        EXPECT_LE(w.max_in_flight, 2);
        f.write_all(trailer.data(), trailer.size());
        f.close();
    }
    std::vector<char> whole = read_bytes(path);
    ASSERT_EQ(whole.size(), header_bytes + n + trailer.size());
    EXPECT_EQ(0, std::memcmp(whole.data(), header.data(), header_bytes));
    EXPECT_EQ(0, std::memcmp(whole.data() + header_bytes, payload.data(), n));
    EXPECT_EQ(0, std::memcmp(whole.data() + header_bytes + n, trailer.data(), trailer.size()));

    std::vector<char> back(n + 2, 'P');  // guard bytes on each side of the destination
    File f(path, File::Mode::Read);
    f.seek(int64_t(header_bytes));
    LazyHostCopier r(read_chunk);
    pipelined_file_to_device(r, back.data() + 1, f, n, direct_alignment, readers);
    EXPECT_EQ(r.violations, 0);
    EXPECT_EQ(r.bound_threads.load(), readers == 2 && n > read_chunk ? 1 : 0) << "the second reader must bind its thread";
    EXPECT_EQ(r.in_flight, 0) << "file_to_device must return with every copy finished";
    EXPECT_LE(r.max_in_flight, 2);
    EXPECT_EQ(f.tell(), int64_t(header_bytes + n));
    EXPECT_EQ(back.front(), 'P');
    EXPECT_EQ(back.back(), 'P');
    EXPECT_EQ(0, std::memcmp(back.data() + 1, payload.data(), n));
}

}  // namespace

TEST(ChunkPlanner, CoversTheRangeExactlyWithAlignedDirectSpan) {
    for (int64_t start : {0, 1, 511, 4095, 4096, 4097, 10000}) {
        for (uint64_t n : {0ull, 1ull, 100ull, 4095ull, 4096ull, 4097ull, 8191ull, 20000ull, 100000ull}) {
            for (size_t chunk : {size_t(1) << 12, size_t(3) << 12, size_t(1) << 16}) {
                for (size_t align : {size_t(0), size_t(4096)}) {
                    ChunkPlanner p(start, n, chunk, align);
                    Chunk c;
                    uint64_t expect_offset = 0, direct_bytes = 0;
                    bool seen_direct = false, left_direct = false;
                    while (p.next(c)) {
                        ASSERT_EQ(c.offset, expect_offset);
                        ASSERT_GT(c.bytes, 0u);
                        ASSERT_LE(c.bytes, chunk);
                        if (c.direct) {
                            ASSERT_NE(align, 0u);
                            ASSERT_FALSE(left_direct) << "the direct span must be contiguous";
                            ASSERT_EQ((uint64_t(start) + c.offset) % align, 0u);
                            ASSERT_EQ(c.bytes % align, 0u);
                            seen_direct = true;
                            direct_bytes += c.bytes;
                        } else if (seen_direct) {
                            left_direct = true;
                        }
                        expect_offset += c.bytes;
                    }
                    ASSERT_EQ(expect_offset, n);
                    if (align) {
                        // The direct span must be the largest aligned one inside the range.
                        uint64_t b = (uint64_t(start) + align - 1) / align * align;
                        uint64_t e = (uint64_t(start) + n) / align * align;
                        ASSERT_EQ(direct_bytes, e > b ? e - b : 0) << "start=" << start << " n=" << n;
                    }
                }
            }
        }
    }
}

TEST(ChunkPlanner, RejectsZeroChunk) { EXPECT_THROW(ChunkPlanner(0, 10, 0), Error); }

TEST(Pipeline, RoundTripSizesAroundTheChunk) {
    TempDir dir;
    const size_t chunk = 4096;
    uint64_t seed = 1;
    for (size_t n : {size_t(0), size_t(1), size_t(31), chunk - 1, chunk, chunk + 1, chunk * 7 / 2, chunk * 40 + 3}) {
        round_trip(dir, n, chunk, chunk, 0, 0, seed++);
        round_trip(dir, n, chunk, chunk, 1024, 0, seed++);
        round_trip(dir, n, chunk, chunk, 1024, 0, seed++, /*readers=*/1);
    }
}

TEST(Pipeline, RoundTripDifferentReadAndWriteChunks) {
    TempDir dir;
    uint64_t seed = 100;
    for (size_t n : {size_t(1), size_t(997), size_t(65537), size_t(300007)}) {
        round_trip(dir, n, 1000, 777, 13, 0, seed++);
        round_trip(dir, n, 65536, 4095, 1024, 0, seed++);
        round_trip(dir, n, 7, 65536, 3, 0, seed++);
    }
}

TEST(Pipeline, RoundTripTinyChunks) {
    TempDir dir;
    round_trip(dir, 1000, 1, 1, 5, 0, 7);
    round_trip(dir, 1001, 1, 3, 0, 0, 8);
    round_trip(dir, 999, 2, 1, 4096, 0, 9);
    round_trip(dir, 999, 2, 1, 4096, 0, 10, /*readers=*/1);
}

TEST(Pipeline, RoundTripDirectIO) {
    TempDir dir;
    if (!direct_io_supported(dir.path())) GTEST_SKIP() << "skipped: O_DIRECT is not supported on " << dir.path();
    uint64_t seed = 200;
    for (size_t header : {size_t(0), size_t(1024), size_t(4096), size_t(5000)}) {
        for (size_t n : {size_t(1), size_t(4095), size_t(4096), size_t(12289), size_t(1 << 20) + 5}) {
            round_trip(dir, n, 16384, 8192, header, 4096, seed++);
            round_trip(dir, n, 16384, 8192, header, 4096, seed++, /*readers=*/1);
        }
    }
}

TEST(Pipeline, ShortFileIsAnErrorBeforeAnyCopy) {
    TempDir dir;
    std::string path = dir.file("short.bin");
    std::vector<char> data = random_bytes(5000, 3);
    {
        File f(path, File::Mode::Write);
        f.write_all(data.data(), data.size());
        f.close();
    }
    File f(path, File::Mode::Read);
    f.seek(1000);
    std::vector<char> dst(8000, 'P');
    LazyHostCopier c(1024);
    try {
        pipelined_file_to_device(c, dst.data(), f, 4001);
        FAIL() << "expected an error";
    } catch (const Error& e) {
        EXPECT_EQ(e.exit_code(), kExitIo);
        std::string m = e.what();
        EXPECT_NE(m.find(path), std::string::npos) << m;
        EXPECT_NE(m.find("offset 1000"), std::string::npos) << m;
        EXPECT_NE(m.find("4001 bytes"), std::string::npos) << m;
    }
    EXPECT_EQ(c.copies, 0);
    EXPECT_EQ(dst[0], 'P');
}

TEST(Pipeline, ErrorMidTransferLeavesNoCopyInFlight) {
    // A file that is long enough at the check but shrinks before the read: the transfer fails part way and
    // must not leave a copy pending on a staging buffer.
    TempDir dir;
    std::string path = dir.file("shrinks.bin");
    std::vector<char> data = random_bytes(10000, 4);
    {
        File f(path, File::Mode::Write);
        f.write_all(data.data(), data.size());
        f.close();
    }
    class ShrinkingCopier final : public StagingCopier {
    public:
        ShrinkingCopier(LazyHostCopier& inner, std::string path) : inner_(inner), path_(std::move(path)) {}
        size_t chunk_bytes() const override { return inner_.chunk_bytes(); }
        char* staging(int slot) override { return inner_.staging(slot); }
        void to_host_async(int slot, const void* s, size_t n) override { inner_.to_host_async(slot, s, n); }
        void to_device_async(void* d, int slot, size_t n) override {
            inner_.to_device_async(d, slot, n);
            if (truncate(path_.c_str(), 3000) != 0) std::abort();
        }
        void wait(int slot) override { inner_.wait(slot); }
        void bind_thread() override { inner_.bind_thread(); }
        void drain() noexcept override { inner_.drain(); }

    private:
        LazyHostCopier& inner_;
        std::string path_;
    };
    LazyHostCopier inner(2048);
    ShrinkingCopier c(inner, path);
    File f(path, File::Mode::Read);
    std::vector<char> dst(10000);
    EXPECT_THROW(pipelined_file_to_device(c, dst.data(), f, 10000), Error);
    EXPECT_EQ(inner.in_flight, 0);
}

// Error paths as a user sees them: a message on stderr and the documented exit code (3, I/O error).
namespace {
int write_through_pipeline(const std::string& path, size_t n) {
    return run_main([&] {
        std::vector<char> data = random_bytes(n, 5);
        File f(path, File::Mode::Write);
        LazyHostCopier c(1 << 16);
        pipelined_device_to_file(c, f, data.data(), n);
        f.sync();
        f.close();
        return 0;
    });
}
}  // namespace

TEST(PipelineErrors, UnwritablePath) {
    EXPECT_EXIT(std::exit(write_through_pipeline("/nonexistent_dir_llmc/x.bin", 100)), ::testing::ExitedWithCode(kExitIo),
                "error: cannot open '/nonexistent_dir_llmc/x.bin' for writing: No such file or directory");
}

TEST(PipelineErrors, ReadOnlyFileIsNotWritable) {
    TempDir dir;
    std::string path = dir.file("ro.bin");
    {
        File f(path, File::Mode::Write);
        f.close();
    }
    File ro(path, File::Mode::Read);
    std::vector<char> data = random_bytes(100, 1);
    LazyHostCopier c(64);
    try {
        pipelined_device_to_file(c, ro, data.data(), data.size());
        FAIL() << "expected an error";
    } catch (const Error& e) {
        EXPECT_EQ(e.exit_code(), kExitIo);
        EXPECT_NE(std::string(e.what()).find("at offset 0 failed: Bad file descriptor"), std::string::npos) << e.what();
    }
    EXPECT_EQ(c.in_flight, 0);
}

TEST(PipelineErrors, FullDisk) {
    // /dev/full answers every write with ENOSPC, as a full disk does.
    EXPECT_EXIT(std::exit(write_through_pipeline("/dev/full", 200000)), ::testing::ExitedWithCode(kExitIo),
                "error: write of 65536 bytes to '/dev/full' at offset 0 failed: No space left on device \\(is the disk "
                "full");
}

TEST(PipelineErrors, FileSizeLimit) {
    TempDir dir;
    std::string path = dir.file("limited.bin");
    auto write_over_limit = [&] {
        std::signal(SIGXFSZ, SIG_IGN);  // otherwise the kernel kills the process instead of failing the write
        struct rlimit lim;
        lim.rlim_cur = lim.rlim_max = 100000;
        setrlimit(RLIMIT_FSIZE, &lim);
        std::exit(write_through_pipeline(path, 300000));
    };
    EXPECT_EXIT(write_over_limit(), ::testing::ExitedWithCode(kExitIo),
                "error: write of [0-9]+ bytes to '.*limited.bin' at offset [0-9]+ failed: File too large");
}

TEST(FileErrors, ReadExactNamesFileOffsetAndSize) {
    TempDir dir;
    std::string path = dir.file("f.bin");
    {
        File f(path, File::Mode::Write);
        f.write_all("0123456789", 10);
        f.close();
    }
    File f(path, File::Mode::Read);
    f.seek(4);
    char buf[16];
    try {
        f.read_exact(buf, 16);
        FAIL();
    } catch (const Error& e) {
        EXPECT_EQ(e.exit_code(), kExitIo);
        EXPECT_EQ(std::string(e.what()), "'" + path + "' is too short: expected 16 bytes at offset 4, the file ends after 6 (size 10)");
    }
}

TEST(FileErrors, OpenMissingFile) {
    try {
        File f("/nonexistent_llmc_file", File::Mode::Read);
        FAIL();
    } catch (const Error& e) {
        EXPECT_EQ(e.exit_code(), kExitIo);
        EXPECT_STREQ(e.what(), "cannot open '/nonexistent_llmc_file' for reading: No such file or directory");
    }
}

int main(int argc, char** argv) {
    ::testing::InitGoogleTest(&argc, argv);
    ::testing::FLAGS_gtest_death_test_style = "threadsafe";
    return RUN_ALL_TESTS();
}

// The per-chunk hook sees every chunk exactly once, at its file offset, with the bytes that go to (or came
// from) the file, while the chunk sits in a staging buffer; a hook that throws abandons the transfer.
namespace {
struct SeenChunk {
    uint64_t offset;
    std::vector<char> bytes;
    bool in_staging;
};
}  // namespace

TEST(ChunkHook, SeesEveryChunkInStagingWritingAndReading) {
    TempDir dir("chunk_hook");
    for (int readers : {1, 2}) {
        const size_t n = 10 * 1000 + 17, chunk = 1000, header = 123;
        std::vector<char> payload = random_bytes(n, 99 + readers);
        std::vector<char> head = random_bytes(header, 7);
        LazyHostCopier w(chunk);
        std::mutex mu;
        std::vector<SeenChunk> seen;
        // Staging addresses taken before any copy is in flight (asking later would count as a violation).
        auto staging_of = [](LazyHostCopier& c) { return std::make_pair<const char*, const char*>(c.staging(0), c.staging(1)); };
        auto in_staging = [](std::pair<const char*, const char*> s, const char* p) {
            return (p >= s.first && p < s.first + 4096) || (p >= s.second && p < s.second + 4096);
        };
        const auto w_staging = staging_of(w);
        ChunkHook write_hook = [&](const char* p, size_t bytes, uint64_t off) {
            std::lock_guard<std::mutex> lock(mu);
            seen.push_back({off, std::vector<char>(p, p + bytes), in_staging(w_staging, p)});
        };
        std::string path = dir.file(format("hook%d.bin", readers));
        {
            File f(path, File::Mode::Write);
            f.write_all(head.data(), head.size());
            pipelined_device_to_file(w, f, payload.data(), n, 0, write_hook);
            f.close();
        }
        auto check = [&](const char* what) {
            SCOPED_TRACE(format("%s readers=%d", what, readers));
            std::sort(seen.begin(), seen.end(), [](const SeenChunk& a, const SeenChunk& b) { return a.offset < b.offset; });
            ASSERT_EQ(seen.size(), (n + chunk - 1) / chunk);
            uint64_t expect = header;
            for (const SeenChunk& s : seen) {
                EXPECT_EQ(s.offset, expect);
                EXPECT_TRUE(s.in_staging);
                EXPECT_EQ(0, std::memcmp(s.bytes.data(), payload.data() + (s.offset - header), s.bytes.size()));
                expect += s.bytes.size();
            }
            EXPECT_EQ(expect, header + n);
        };
        check("write");
        seen.clear();
        EXPECT_EQ(w.violations, 0);
        LazyHostCopier r(chunk);
        const auto r_staging = staging_of(r);
        ChunkHook read_hook = [&](const char* p, size_t bytes, uint64_t off) {
            std::lock_guard<std::mutex> lock(mu);
            seen.push_back({off, std::vector<char>(p, p + bytes), in_staging(r_staging, p)});
        };
        std::vector<char> back(n);
        File f(path, File::Mode::Read);
        f.seek(header);
        pipelined_file_to_device(r, back.data(), f, n, 0, readers, read_hook);
        check("read");
        EXPECT_EQ(back, payload);
        EXPECT_EQ(r.violations, 0);
    }
}

TEST(ChunkHook, ThrowingHookAbandonsTheTransferWithNoCopyInFlight) {
    TempDir dir("chunk_hook_throw");
    const size_t n = 5000;
    std::vector<char> payload = random_bytes(n, 5);
    std::string path = dir.file("t.bin");
    LazyHostCopier w(512);
    int calls = 0;
    ChunkHook hook = [&](const char*, size_t, uint64_t off) {
        if (++calls == 3) fail(kExitData, "checksum mismatch at %llu", (unsigned long long)off);
    };
    File f(path, File::Mode::Write);
    try {
        pipelined_device_to_file(w, f, payload.data(), n, 0, hook);
        FAIL() << "the hook's error must propagate";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("checksum mismatch at 1024"), std::string::npos) << e.what();
    }
    EXPECT_EQ(w.in_flight, 0);
    EXPECT_EQ(f.size(), 1024) << "nothing after the failing chunk is written";
}
