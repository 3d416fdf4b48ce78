/*
GPU tests of llmc/multi_gpu.cuh with one rank through NCCL (the one-GPU path of the trainer): the
all-reduce mean of fp32 and bf16 buffers, whole and by ranges, ZeRO-1's reduce-scatter and in-place
all-gather over zero.h's padded geometry, and the event ordering between the compute stream and the
communication stream (a collective must see what a slow kernel queued before it wrote). With one rank a
mean is the identity, so every result must equal its input bit for bit; receive buffers are poisoned
first. Skipped without a GPU.
*/
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "llmc/cuda_common.cuh"
#include "llmc/multi_gpu.cuh"
#include "test/gpu_test.h"
#include "test/test_util.h"

using namespace llmc;

namespace {

std::vector<float> random_floats(size_t n, uint64_t seed) {
    SplitMix64 rng(seed);
    std::vector<float> v(n);
    for (float& x : v) x = float(int64_t(rng.below(2000001)) - 1000000) * 1.37e-4f;
    return v;
}

template <class T>
std::vector<T> to_host(const DeviceBuffer<T>& d) {
    std::vector<T> h(d.size());
    cudaCheck(cudaMemcpy(h.data(), d.get(), d.bytes(), cudaMemcpyDeviceToHost));
    return h;
}

template <class T>
void upload(DeviceBuffer<T>& d, const std::vector<T>& h) {
    ASSERT_EQ(d.size(), h.size());
    cudaCheck(cudaMemcpy(d.get(), h.data(), d.bytes(), cudaMemcpyHostToDevice));
}

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Spins for about `cycles` clock ticks, then writes value into x[0, n): a producer the communication
// stream must wait for.
__global__ void slow_fill(float* x, int64_t n, float value, long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        x[i] = value + float(i % 1000);
    }
}

class MultiGpuTest : public GpuTest {
protected:
    void SetUp() override {
        GpuTest::SetUp();
        if (IsSkipped()) return;
        mg_ = std::make_unique<MultiGpu>(RankInfo{}, MultiGpuOptions{});
        stream_ = std::make_unique<Stream>();  // after the MultiGpu has chosen the device
        compute_ = stream_->get();
    }
    std::unique_ptr<MultiGpu> mg_;
    std::unique_ptr<Stream> stream_;
    cudaStream_t compute_ = nullptr;
};

}  // namespace

TEST_F(MultiGpuTest, OneRankContext) {
    EXPECT_EQ(mg_->rank(), 0);
    EXPECT_EQ(mg_->world(), 1);
    EXPECT_TRUE(mg_->is_root());
    EXPECT_EQ(mg_->device(), 0);
    int current = -1;
    cudaCheck(cudaGetDevice(&current));
    EXPECT_EQ(current, 0);
}

TEST_F(MultiGpuTest, AllReduceMeanFp32AndBf16) {
    for (size_t n : {size_t(1), size_t(7), size_t(1000003)}) {
        const std::vector<float> h = random_floats(n, n);
        DeviceBuffer<float> d(n);
        upload(d, h);
        mg_->all_reduce_mean_async(d.get(), n, compute_);
        mg_->all_reduce_sum_async(d.get(), n, compute_);
        mg_->join(compute_);
        cudaCheck(cudaStreamSynchronize(compute_));
        EXPECT_TRUE(bitwise_equal(to_host(d), h)) << "n=" << n;

        std::vector<floatX> hb(n);
        for (size_t i = 0; i < n; i++) hb[i] = __float2bfloat16(h[i]);
        DeviceBuffer<floatX> db(n);
        upload(db, hb);
        mg_->all_reduce_mean_async(db.get(), n, compute_);
        mg_->join(compute_);
        cudaCheck(cudaStreamSynchronize(compute_));
        EXPECT_TRUE(bitwise_equal(to_host(db), hb)) << "n=" << n;
    }
}

TEST_F(MultiGpuTest, AllReduceRangesTouchOnlyTheirRanges) {
    const size_t n = 100003;
    const std::vector<float> h = random_floats(n, 11);
    DeviceBuffer<float> d(n);
    upload(d, h);
    const std::vector<ShardRange> ranges = {{0, 17}, {17, 17}, {500, 9001}, {n - 3, int64_t(n)}};
    mg_->all_reduce_mean_async(d.get(), ranges, compute_);
    mg_->join(compute_);
    cudaCheck(cudaStreamSynchronize(compute_));
    EXPECT_TRUE(bitwise_equal(to_host(d), h));
}

TEST_F(MultiGpuTest, ZeroReduceScatterAllGatherRoundTrip) {
    for (int64_t n : {int64_t(1), int64_t(129), int64_t(124439)}) {
        const ZeroLayout z = zero_layout(n, mg_->world());
        const size_t p = size_t(z.padded_total());
        ASSERT_GE(int64_t(p), n);
        // The parameter and gradient buffers hold the padded total, the tail zeroed once.
        std::vector<floatX> grads(p, __float2bfloat16(0.0f));
        const std::vector<float> g = random_floats(size_t(n), uint64_t(n) + 3);
        for (int64_t i = 0; i < n; i++) grads[size_t(i)] = __float2bfloat16(g[size_t(i)]);
        DeviceBuffer<floatX> full(p), shard(size_t(z.shard_size));
        upload(full, grads);
        cudaCheck(cudaMemset(shard.get(), 0xff, shard.bytes()));  // poison: NaN in bf16
        mg_->reduce_scatter_mean_async(full.get(), shard.get(), z, compute_);
        mg_->join(compute_);
        cudaCheck(cudaStreamSynchronize(compute_));
        const std::vector<floatX> mine = to_host(shard);
        const ShardRange s = z.shard(mg_->rank());
        EXPECT_TRUE(bitwise_equal(mine, std::vector<floatX>(grads.begin() + s.begin, grads.begin() + s.end))) << n;

        // An "update" writes new values into this rank's slice; the all-gather spreads them in place.
        std::vector<floatX> updated = grads;
        for (int64_t i = s.begin; i < std::min(s.end, n); i++) {
            updated[size_t(i)] = __float2bfloat16(2.0f * g[size_t(i)] + 1.0f);
        }
        DeviceBuffer<floatX> params(p);
        cudaCheck(cudaMemset(params.get(), 0xff, params.bytes()));
        cudaCheck(cudaMemcpy(params.get() + s.begin, updated.data() + s.begin, size_t(s.size()) * sizeof(floatX),
                             cudaMemcpyHostToDevice));
        mg_->all_gather_async(params.get(), z, compute_);
        mg_->join(compute_);
        cudaCheck(cudaStreamSynchronize(compute_));
        EXPECT_TRUE(bitwise_equal(to_host(params), updated)) << n;
    }
}

TEST_F(MultiGpuTest, CollectivesWaitForTheComputeStream) {
    const int64_t n = 1 << 20;
    const ZeroLayout z = zero_layout(n, mg_->world());
    DeviceBuffer<float> full(size_t(z.padded_total())), shard(size_t(z.shard_size));
    cudaCheck(cudaMemset(full.get(), 0, full.bytes()));
    cudaCheck(cudaMemset(shard.get(), 0xff, shard.bytes()));
    cudaCheck(cudaDeviceSynchronize());
    // About 50 ms of spinning before the write: a reduce-scatter that did not wait would copy zeros.
    slow_fill<<<64, 256, 0, compute_>>>(full.get(), n, 3.0f, 100000000LL);
    cudaCheckLaunch();
    mg_->reduce_scatter_mean_async(full.get(), shard.get(), z, compute_);
    mg_->join(compute_);
    cudaCheck(cudaStreamSynchronize(compute_));
    const std::vector<float> got = to_host(shard);
    for (int64_t i = 0; i < n; i++) ASSERT_EQ(got[size_t(i)], 3.0f + float(i % 1000)) << i;
    for (int64_t i = n; i < z.shard_size; i++) ASSERT_EQ(got[size_t(i)], 0.0f) << i;
}

TEST_F(MultiGpuTest, ScalarsForTheLog) {
    DeviceBuffer<float> d(2);
    const std::vector<float> h = {3.2671f, 0.4413f};  // loss, grad norm
    upload(d, h);
    mg_->all_reduce_mean_async(d.get(), 2, compute_);
    mg_->join(compute_);
    cudaCheck(cudaStreamSynchronize(compute_));
    EXPECT_TRUE(bitwise_equal(to_host(d), h));
}

TEST_F(MultiGpuTest, BroadcastBarrierAndAgreement) {
    const std::vector<int32_t> h = {7, -3, 123456789};
    DeviceBuffer<int32_t> d(h.size());
    upload(d, h);
    mg_->broadcast_async(d.get(), h.size(), 0, compute_);
    mg_->join(compute_);
    cudaCheck(cudaStreamSynchronize(compute_));
    EXPECT_EQ(to_host(d), h);
    mg_->barrier();
    mg_->check_same(0x9e3779b97f4a7c15ull, "the parameter count");  // one rank always agrees with itself
}

TEST_F(MultiGpuTest, WrongLayoutIsRefused) {
    const ZeroLayout z = zero_layout(1000, 2);
    DeviceBuffer<float> full(size_t(z.padded_total()));
    try {
        mg_->all_gather_async(full.get(), z, compute_);
        ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("layout for 2 ranks used with 1"), std::string::npos) << e.what();
    }
}

TEST_F(GpuTest, LocalRankBeyondTheGpusIsAUsageError) {
    RankInfo r;
    r.local_rank = 99;
    try {
        MultiGpu mg(r, MultiGpuOptions{});
        ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
        EXPECT_EQ(e.exit_code(), kExitUsage);
        EXPECT_NE(std::string(e.what()).find("local rank 99"), std::string::npos) << e.what();
    }
}
