/*
GPU tests of the DataLoader's device side (dataloader_gpu.cuh): the prefetching streaming path and the
GPU-resident mode yield bit for bit the batches of the plain synchronous host path (read on the caller's
thread, widened on the CPU), for 16- and 32-bit tokens, several ranks, across epoch boundaries and
after a restore; a bad token id is an error naming the shard and offset in both modes.

Each batch is consumed on the compute stream by a kernel that first spins for a while and then copies
inputs and targets into the test's own buffer (poisoned beforehand), so a copy that overwrote a slot the
compute stream was still reading, or a batch never copied, shows up as a mismatch. Skipped without a GPU.
*/
#include <string>
#include <vector>

#include "llmc/dataloader_gpu.cuh"
#include "test/gpu_test.h"
#include "test/test_util.h"
#include "test/expect_error.h"

using namespace llmc;
using llmc::test::random_tokens;
using llmc::test::TempDir;
using llmc::test::write_random_shards;

namespace {

// Shards of odd sizes; versions alternate when the vocabulary allows 16-bit files.
std::string write_shards(const TempDir& dir, const std::vector<size_t>& sizes, uint32_t vocab, uint64_t seed) {
    write_random_shards(dir.path(), sizes, vocab, seed);
    return dir.file("shard_*.bin");
}

DataLoaderConfig config(const std::string& pattern, int B, int T, uint32_t vocab, int rank, int world, bool shuffle,
                        int prefetch) {
    DataLoaderConfig c;
    c.pattern = pattern;
    c.B = B;
    c.T = T;
    c.vocab_size = vocab;
    c.rank = rank;
    c.world = world;
    c.shuffle = shuffle;
    c.seed = 2024;
    c.prefetch = prefetch;
    return c;
}

// Batches [from, from + n) of the synchronous host path, as int32 inputs then targets per batch.
std::vector<int32_t> reference(DataLoaderConfig c, uint64_t from, uint64_t n) {
    c.prefetch = 0;
    DataLoader dl(c);
    dl.seek(from);
    size_t bt = size_t(c.B) * c.T;
    std::vector<int32_t> out(2 * bt * n);
    for (uint64_t k = 0; k < n; k++) dl.next_batch(&out[2 * bt * k], &out[2 * bt * k + bt]);
    return out;
}

__global__ void spin_then_copy_kernel(const int* inputs, const int* targets, int n, int* out, long long spin_cycles) {
    long long start = clock64();
    while (clock64() - start < spin_cycles) {
    }
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        out[i] = inputs[i];
        out[n + i] = targets[i];
    }
}

// Runs n batches through the GPU loader with a slow consumer and returns what the consumer saw.
// Every `sync_every` batches the host waits for the compute stream, as a trainer reading its loss does.
std::vector<int32_t> consume(GpuDataLoader& gl, cudaStream_t compute, uint64_t n, int sync_every, uint64_t first_index) {
    const DataLoaderConfig& c = gl.schedule().config();
    size_t bt = size_t(c.B) * c.T;
    DeviceBuffer<int> seen(2 * bt * n);
    cudaCheck(cudaMemsetAsync(seen.get(), 0xab, seen.bytes(), compute));
    for (uint64_t k = 0; k < n; k++) {
        DeviceBatch b = gl.next_batch();
        EXPECT_EQ(b.index, first_index + k);
        EXPECT_EQ(b.epoch, gl.schedule().first_sample(first_index + k) / gl.schedule().samples_per_epoch());
        spin_then_copy_kernel<<<4, 256, 0, compute>>>(b.inputs, b.targets, int(bt), seen.get() + 2 * bt * k,
                                                      k % 3 == 0 ? 200000 : 20000);
        cudaCheckLaunch();
        if (sync_every > 0 && k % sync_every == 0) cudaCheck(cudaStreamSynchronize(compute));
    }
    std::vector<int32_t> out(seen.size());
    cudaCheck(cudaMemcpyAsync(out.data(), seen.get(), seen.bytes(), cudaMemcpyDeviceToHost, compute));
    cudaCheck(cudaStreamSynchronize(compute));
    return out;
}

void expect_same_batches(const std::vector<int32_t>& got, const std::vector<int32_t>& want, size_t bt) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); i++) {
        if (got[i] != want[i]) {
            size_t k = i / (2 * bt), j = i % (2 * bt);
            FAIL() << "batch " << k << (j < bt ? " inputs[" : " targets[") << (j % bt) << "] = " << got[i] << ", expected "
                   << want[i];
        }
    }
}

class DataLoaderGpu : public GpuTest {};

}  // namespace

TEST_F(DataLoaderGpu, StreamingAndResidentMatchTheSynchronousPath) {
    struct Case {
        uint32_t vocab;
        int B, T, world;
    };
    for (Case cs : {Case{50257, 5, 33, 3}, Case{100003, 4, 64, 2}, Case{65536, 8, 128, 1}}) {
        SCOPED_TRACE("vocab " + std::to_string(cs.vocab));
        TempDir d;
        std::string pattern = write_shards(d, {4001, 2500, 3333, 1200, 5001}, cs.vocab, cs.vocab);
        for (int rank = 0; rank < cs.world; rank++) {
            DataLoaderConfig c = config(pattern, cs.B, cs.T, cs.vocab, rank, cs.world, true, 3);
            SampleSchedule s(c);
            uint64_t n = 2 * s.batches_per_epoch() + 3;  // crosses two epoch boundaries
            std::vector<int32_t> want = reference(c, 0, n);
            size_t bt = size_t(cs.B) * cs.T;
            Stream compute;
            for (int sync_every : {0, 1, 5}) {
                GpuDataLoader streamed(c, compute, 0);
                ASSERT_FALSE(streamed.resident());
                expect_same_batches(consume(streamed, compute, n, sync_every, 0), want, bt);
            }
            GpuDataLoader resident(c, compute, size_t(1) << 30);
            ASSERT_TRUE(resident.resident());
            expect_same_batches(consume(resident, compute, n, 0, 0), want, bt);
            // A budget one byte short of what the split needs falls back to streaming.
            GpuDataLoader tight(c, compute, resident.resident_bytes() - 1);
            EXPECT_FALSE(tight.resident());
        }
    }
}

TEST_F(DataLoaderGpu, RestoreSeekAndResetMatchTheSynchronousPath) {
    TempDir d;
    std::string pattern = write_shards(d, {3001, 2222, 4100}, 50257, 7);
    DataLoaderConfig c = config(pattern, 6, 48, 50257, 1, 2, true, 4);
    SampleSchedule s(c);
    size_t bt = size_t(c.B) * c.T;
    uint64_t cut = s.batches_per_epoch() - 1, n = s.batches_per_epoch() + 4;
    std::vector<int32_t> want = reference(c, cut, n);
    Stream compute;
    for (size_t budget : {size_t(0), size_t(1) << 30}) {
        SCOPED_TRACE(budget ? "resident" : "streaming");
        GpuDataLoader a(c, compute, budget);
        consume(a, compute, cut, 0, 0);
        std::vector<uint8_t> blob = a.state();
        EXPECT_EQ(blob, s.encode_state(cut));
        // Continue in the same loader, restore into a fresh one, and into one of the other mode.
        expect_same_batches(consume(a, compute, n, 2, cut), want, bt);
        GpuDataLoader b(c, compute, budget);
        consume(b, compute, 3, 0, 0);
        b.restore(blob);
        expect_same_batches(consume(b, compute, n, 0, cut), want, bt);
        GpuDataLoader other(c, compute, budget ? 0 : size_t(1) << 30);
        other.restore(blob);
        expect_same_batches(consume(other, compute, n, 1, cut), want, bt);
        b.reset();
        expect_same_batches(consume(b, compute, 2, 0, 0), reference(c, 0, 2), bt);
    }
}

TEST_F(DataLoaderGpu, ValidationLoaderReadsInOrderInBothModes) {
    TempDir d;
    std::string pattern = write_shards(d, {999, 1501}, 30000, 9);
    DataLoaderConfig c = config(pattern, 3, 20, 30000, 0, 1, false, 2);
    SampleSchedule s(c);
    uint64_t n = s.batches_per_epoch() + 2;
    std::vector<int32_t> want = reference(c, 0, n);
    Stream compute;
    for (size_t budget : {size_t(0), size_t(1) << 30}) {
        GpuDataLoader v(c, compute, budget);
        expect_same_batches(consume(v, compute, n, 0, 0), want, size_t(c.B) * c.T);
        v.reset();
        expect_same_batches(consume(v, compute, n, 0, 0), want, size_t(c.B) * c.T);
    }
}

TEST_F(DataLoaderGpu, BadTokenIdIsAnErrorInBothModes) {
    TempDir d;
    auto t = random_tokens(2000, 1000, 11);
    t[1234] = 1000;
    write_token_shard(d.file("bad.bin"), t.data(), t.size(), 1);
    DataLoaderConfig c = config(d.file("bad.bin"), 2, 16, 1000, 0, 1, false, 3);
    Stream compute;
    expect_error([&] { GpuDataLoader r(c, compute, size_t(1) << 30); }, kExitData,
                 {"bad.bin", "token 1234 (byte offset 3492)", "id 1000"});
    // Streaming: the batch holding token 1234 is sample 77 (tokens 1232..1248), batch 38; the batches
    // before it arrive intact, and the error comes with batch 38 itself, not a call early.
    GpuDataLoader g(c, compute, 0);
    std::vector<int32_t> want = reference(c, 0, 38);
    expect_same_batches(consume(g, compute, 38, 0, 0), want, size_t(c.B) * c.T);
    expect_error([&] { g.next_batch(); }, kExitData, {"bad.bin", "token 1234 (byte offset 3492)", "id 1000"});
    g.seek(39);
    expect_same_batches(consume(g, compute, 2, 0, 39), reference(c, 39, 2), size_t(c.B) * c.T);
}

int main(int argc, char** argv) {
    ::testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
}
