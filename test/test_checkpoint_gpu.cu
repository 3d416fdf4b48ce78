/*
GPU tests of llmc/checkpoint.cuh: synchronous and asynchronous saves of random device tensors read back
bitwise through the verified load; the asynchronous save holds the state at the time of the call even
when the compute stream overwrites the tensors right after; sync and async saves give identical files;
a flipped bit is refused by the load; a checkpoint loads through readers of other chunk sizes; a full
disk during an asynchronous save raises a clear error on the main thread and leaves the previous
checkpoint valid; with several ranks, rank 0's failure to prepare the shared directory stops every rank.
*/
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "llmc/checkpoint.cuh"
#include "test/gpu_test.h"
#include "test/test_util.h"

using namespace llmc;
using llmc::test::random_bytes;
using llmc::test::read_bytes;
using llmc::test::write_bytes;
using llmc::test::TempDir;

namespace {

constexpr size_t kChunk = size_t(1) << 20;

struct DeviceState {
    std::vector<std::vector<char>> host;
    std::vector<DeviceBuffer<char>> dev;
    std::vector<CheckpointTensor> tensors;

    DeviceState(const std::vector<size_t>& sizes, uint64_t seed) {
        for (size_t i = 0; i < sizes.size(); i++) {
            host.push_back(random_bytes(sizes[i], seed + i));
            dev.emplace_back(sizes[i]);
            cudaCheck(cudaMemcpy(dev.back().get(), host.back().data(), sizes[i], cudaMemcpyHostToDevice));
        }
        // Pageable copies may still be in flight when cudaMemcpy returns; the checkpoint code reads the
        // tensors on its own non-blocking streams.
        cudaCheck(cudaDeviceSynchronize());
        for (size_t i = 0; i < sizes.size(); i++) {
            CheckpointTensor t;
            t.file = format("t%zu.bin", i);
            if (i == 0) t.header = random_bytes(1024, seed + 100);
            t.device = dev[i].get();
            t.bytes = sizes[i];
            tensors.push_back(t);
        }
    }
    // Poisons the device copies, loads the checkpoint into them and compares with `expect`.
    void load_and_compare(const std::string& dir, const std::vector<std::vector<char>>& expect, size_t chunk = kChunk) {
        for (auto& d : dev) cudaCheck(cudaMemset(d.get(), 0xA5, d.bytes()));
        CheckpointManifest m = validate_checkpoint(dir, /*deep=*/true);
        DeviceFileIO io(chunk);
        load_checkpoint_tensors(dir, m, tensors, io, nullptr);
        for (size_t i = 0; i < dev.size(); i++) {
            std::vector<char> back(dev[i].bytes());
            cudaCheck(cudaMemcpy(back.data(), dev[i].get(), back.size(), cudaMemcpyDeviceToHost));
            EXPECT_TRUE(back == expect[i]) << "tensor " << i << " differs after the load";
        }
    }
};

const std::vector<size_t> kSizes = {3 * kChunk + 17, 5 * kChunk - 3, 1001, kChunk};

// Flips a bit of byte `at` of tensor i's file in the checkpoint at `path`, expects a load through a reader
// of `chunk`-byte chunks to refuse it naming the file, and puts the byte back.
void expect_flipped_bit_refused(const std::string& path, const CheckpointManifest& m, DeviceState& s, size_t i,
                                size_t at, size_t chunk) {
    const std::string file = path + "/" + s.tensors[i].file;
    const std::vector<char> bytes = read_bytes(file);
    std::vector<char> bad = bytes;
    bad[at] ^= 0x04;
    write_bytes(file, bad);
    DeviceFileIO io(chunk);
    try {
        load_checkpoint_tensors(path, m, s.tensors, io, nullptr);
        ADD_FAILURE() << "a flipped bit at " << at << " of " << file << " was not detected (reader chunk " << chunk << ")";
    } catch (const Error& e) {
        EXPECT_EQ(e.exit_code(), kExitData);
        EXPECT_NE(std::string(e.what()).find("corrupted"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find(s.tensors[i].file), std::string::npos) << e.what();
    }
    write_bytes(file, bytes);
}

}  // namespace

class CheckpointGpu : public GpuTest {};

TEST_F(CheckpointGpu, SyncSaveRoundTripsBitwise) {
    TempDir dir("ckpt_gpu_sync");
    DeviceState s(kSizes, 1);
    Checkpointer c(s.tensors, /*async=*/false, kChunk);
    CheckpointManifest meta;
    meta.settings = {{"k", "v"}};
    c.save(dir / "out", 4, s.tensors, meta, nullptr, 0, 0);
    c.wait();
    CheckpointReport r;
    ASSERT_TRUE(c.poll(&r));
    EXPECT_EQ(r.step, 4);
    EXPECT_GT(r.bytes, 9 * kChunk);
    EXPECT_EQ(r.stall_seconds, r.write_seconds);
    EXPECT_FALSE(c.poll(&r));
    s.load_and_compare(r.path, s.host);
}

TEST_F(CheckpointGpu, AsyncSaveHoldsTheStateAtTheCallAndMatchesSync) {
    TempDir dir("ckpt_gpu_async");
    DeviceState s(kSizes, 2);
    Stream compute;
    Checkpointer sync(s.tensors, false, kChunk), async(s.tensors, true, kChunk);
    EXPECT_EQ(async.snapshot_device_bytes(), kSizes[0] + kSizes[1] + kSizes[2] + kSizes[3]);
    sync.save(dir / "sync", 9, s.tensors, CheckpointManifest(), compute, 0, 0);
    async.save(dir / "async", 9, s.tensors, CheckpointManifest(), compute, 0, 0);
    // Training goes on at once: overwrite every tensor on the compute stream.
    for (auto& d : s.dev) cudaCheck(cudaMemsetAsync(d.get(), 0x3C, d.bytes(), compute));
    async.wait();
    cudaCheck(cudaStreamSynchronize(compute));
    CheckpointReport r;
    ASSERT_TRUE(async.poll(&r));
    EXPECT_LE(r.stall_seconds, r.write_seconds);
    for (const CheckpointTensor& t : s.tensors) {
        EXPECT_TRUE(read_bytes(dir / ("sync/ckpt_00000009/" + t.file)) == read_bytes(dir / ("async/ckpt_00000009/" + t.file)))
            << t.file;
    }
    s.load_and_compare(r.path, s.host);

    // A second async save waits for nothing pending and holds the new state: the load above put the old
    // state back on the device, so the new one is written again, on the compute stream just before the
    // call (the snapshot must come after it).
    std::vector<std::vector<char>> now;
    for (size_t i = 0; i < kSizes.size(); i++) now.emplace_back(kSizes[i], char(0x3C));
    for (auto& d : s.dev) cudaCheck(cudaMemsetAsync(d.get(), 0x3C, d.bytes(), compute));
    async.save(dir / "async", 10, s.tensors, CheckpointManifest(), compute, 1, 0);
    async.wait();
    ASSERT_TRUE(async.poll(&r));
    ASSERT_EQ(r.removed.size(), 1u) << "keep_last=1 removes step 9";
    s.load_and_compare(r.path, now);
}

TEST_F(CheckpointGpu, FlippedBitIsRefusedByTheLoad) {
    TempDir dir("ckpt_gpu_flip");
    DeviceState s(kSizes, 3);
    Checkpointer c(s.tensors, false, kChunk);
    c.save(dir / "out", 1, s.tensors, CheckpointManifest(), nullptr, 0, 0);
    const std::string path = dir / "out/ckpt_00000001";
    CheckpointManifest m = validate_checkpoint(path, true);
    for (size_t i = 0; i < s.tensors.size(); i++) {
        expect_flipped_bit_refused(path, m, s, i, read_bytes(path + "/" + s.tensors[i].file).size() * 2 / 3, kChunk);
    }
}

// A checkpoint does not depend on the reader's chunk size: one written in 1 MiB chunks loads bitwise through
// readers of other sizes (read by its recorded chunks then), and a flipped bit is still refused on that path.
TEST_F(CheckpointGpu, CheckpointWrittenWithAnotherChunkSizeLoads) {
    TempDir dir("ckpt_gpu_chunks");
    DeviceState s(kSizes, 5);
    Checkpointer c(s.tensors, false, kChunk);
    c.save(dir / "out", 1, s.tensors, CheckpointManifest(), nullptr, 0, 0);
    const std::string path = dir / "out/ckpt_00000001";
    for (size_t chunk : {2 * kChunk, kChunk / 2, kChunk + 4096, size_t(4096)}) {
        SCOPED_TRACE(format("reader chunk %zu", chunk));
        s.load_and_compare(path, s.host, chunk);
    }
    const CheckpointManifest m = validate_checkpoint(path, true);
    for (size_t i = 0; i < s.tensors.size(); i++) {
        const size_t size = read_bytes(path + "/" + s.tensors[i].file).size();
        for (size_t at : {size_t(3), size - 1}) expect_flipped_bit_refused(path, m, s, i, at, 2 * kChunk);
    }
    s.load_and_compare(path, s.host, 2 * kChunk);
}

// Several ranks: when rank 0 cannot prepare the shared directory, it says so in the vote and raises its
// error; a rank told by the vote that another failed raises an error saying so and writes nothing; a rank
// whose previous asynchronous save failed votes so too. (Before the vote, the other ranks waited at a
// barrier for a rank that had left.)
TEST_F(CheckpointGpu, SharedSaveStopsEveryRankWhenRankZeroCannotPrepareTheDirectory) {
    TempDir dir("ckpt_gpu_vote");
    DeviceState s({4096, 1000}, 6);
    const std::string blocked = dir / "not_a_dir";
    write_bytes(blocked, std::string("a file where the output directory should be"));
    std::vector<bool> said;
    Checkpointer rank0(s.tensors, false, 0, 2, [&](bool failed) { said.push_back(failed); return failed; }, 5);
    try {
        rank0.save(blocked, 3, s.tensors, CheckpointManifest(), nullptr, 0, 0);
        ADD_FAILURE() << "rank 0 saved into a file";
    } catch (const Error& e) {
        EXPECT_EQ(e.exit_code(), kExitIo);
        EXPECT_NE(std::string(e.what()).find("not_a_dir"), std::string::npos) << e.what();
    }
    EXPECT_EQ(said, std::vector<bool>{true}) << "rank 0 votes once, that it failed";

    const std::string out = dir / "out";
    std::vector<bool> said1;
    Checkpointer rank1(s.tensors, false, 1, 2, [&](bool failed) { said1.push_back(failed); return true; }, 5);
    try {
        rank1.save(out, 3, s.tensors, CheckpointManifest(), nullptr, 0, 0);
        ADD_FAILURE() << "rank 1 wrote although rank 0 failed";
    } catch (const Error& e) {
        EXPECT_EQ(e.exit_code(), kExitIo);
        EXPECT_NE(std::string(e.what()).find("rank 0 could not prepare"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("previous save failed"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("step 3"), std::string::npos) << e.what();
    }
    EXPECT_EQ(said1, std::vector<bool>{false});
    EXPECT_FALSE(std::filesystem::exists(out)) << "rank 1 wrote nothing";

    // A rank whose asynchronous save failed (here rank 1, into a directory rank 0 never prepared) says so in
    // the next save's vote and raises that save's error.
    std::vector<bool> said2;
    Checkpointer async1(s.tensors, true, 1, 2, [&](bool failed) { said2.push_back(failed); return failed; }, 5);
    async1.save(out, 4, s.tensors, CheckpointManifest(), nullptr, 0, 0);  // the vote: false; the write fails
    try {
        async1.save(out, 5, s.tensors, CheckpointManifest(), nullptr, 0, 0);
        ADD_FAILURE() << "the failed asynchronous save was not reported";
    } catch (const Error& e) {
        EXPECT_EQ(e.exit_code(), kExitIo);
        EXPECT_NE(std::string(e.what()).find("ckpt_00000004.tmp"), std::string::npos) << e.what();
    }
    EXPECT_EQ(said2, (std::vector<bool>{false, true}));
}

TEST_F(CheckpointGpu, FullDiskDuringAsyncSaveIsReportedAndKeepsTheLastGoodCheckpoint) {
    TempDir dir("ckpt_gpu_full");
    const std::string mnt = dir / "mnt";
    // 12 MiB holds one checkpoint of ~9 MiB but not two.
    if (std::system(("mkdir -p '" + mnt + "' && mount -t tmpfs -o size=12m tmpfs '" + mnt + "' 2>/dev/null").c_str()) != 0) {
        GTEST_SKIP() << "skipped: cannot mount a tmpfs here (needs root)";
    }
    DeviceState s(kSizes, 4);
    std::string message;
    {
        Checkpointer c(s.tensors, true, kChunk);
        c.save(mnt, 1, s.tensors, CheckpointManifest(), nullptr, 0, 0);
        c.wait();
        c.save(mnt, 2, s.tensors, CheckpointManifest(), nullptr, 0, 0);
        try {
            c.wait();
        } catch (const Error& e) {
            message = e.what();
            EXPECT_EQ(e.exit_code(), kExitIo);
        }
        EXPECT_NO_THROW(c.wait()) << "an error is raised once";
    }
    EXPECT_NE(message.find("No space left on device"), std::string::npos) << message;
    EXPECT_NE(message.find("ckpt_00000002.tmp"), std::string::npos) << message;
    EXPECT_FALSE(std::filesystem::exists(mnt + "/ckpt_00000002.tmp")) << "the failed save's files are removed";
    const std::vector<CheckpointEntry> left = list_checkpoints(mnt);
    EXPECT_EQ(left.size(), 1u) << "only the first save's checkpoint is there";
    if (!left.empty()) {
        EXPECT_EQ(validate_checkpoint(left[0].path, true).step, 1);
        s.load_and_compare(left[0].path, s.host);
    }
    EXPECT_EQ(std::system(("umount '" + mnt + "'").c_str()), 0);
}
