/*
ZeRO-1's device arithmetic on one GPU, without NCCL: each rank's part of the optimizer step, run one
rank after another, must give exactly the bits of the unsharded step, which is what lets several GPUs
hold identical parameters and one rank through NCCL match the single-GPU trainer.

Checks: restrict_tensors() cuts an AdamW table to a range exactly (every element of the range once,
nothing outside, decay flags kept); adamw_update() with a state offset, over the shards of world sizes
1, 2, 3, 5 and 64 (the last leaves ranks owning nothing) on odd-sized tensors, three steps with a clip
scale: each rank's master weights, moments and bf16 parameters are bitwise the unsharded ones on its
range, and it writes nothing outside it; global_norm_sumsq() + global_norm_finish() give global_norm()'s
bits, and the shard sums of squares add up to the whole norm; adamw_update()'s 4-wide path (aligned buffers)
gives the elementwise path's bits, a tail of 3 included.

Does not check: the collectives (test_multi_gpu) or the trainer end to end (test_multi_gpu_trainer.sh).
*/
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "llmc/adamw.cuh"
#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/utils.h"
#include "llmc/zero.h"
#include "test/gpu_test.h"
#include "test/test_util.h"

using namespace llmc;
using llmc::test::random_floats;
using llmc::test::upload;

namespace {

// bf16 copy of v (round to nearest), padded with `pad` zeros.
DeviceBuffer<floatX> upload_bf16(const std::vector<float>& v, size_t pad = 0) {
    auto f = upload(v);
    DeviceBuffer<floatX> d(v.size() + pad);
    cudaCheck(cudaMemset(d.get(), 0, d.bytes()));
    convert_to_bf16(d.get(), f.get(), int64_t(v.size()), nullptr);
    cudaCheck(cudaDeviceSynchronize());
    return d;
}

template <class T>
std::vector<unsigned char> bytes_of(const T* p, size_t n) {
    std::vector<unsigned char> out(n * sizeof(T));
    if (n > 0) cudaCheck(cudaMemcpy(out.data(), p, out.size(), cudaMemcpyDeviceToHost));
    return out;
}

size_t differing(const std::vector<unsigned char>& a, const std::vector<unsigned char>& b) {
    size_t d = a.size() > b.size() ? a.size() - b.size() : b.size() - a.size();
    for (size_t i = 0; i < std::min(a.size(), b.size()); i++) d += a[i] != b[i];
    return d;
}

class ZeroUpdateTest : public GpuTest {};

AdamWTensors odd_table(int64_t* total) {
    const int64_t sizes[] = {1000, 7, 130, 5001, 1, 333, 4096, 77};
    AdamWTensors t;
    int64_t at = 0;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        t.add(at, sizes[i], i % 2 == 0);
        at += sizes[i];
    }
    *total = at;
    return t;
}

}  // namespace

TEST(ZeroTable, RestrictTensorsCoversTheRangeExactly) {
    int64_t n = 0;
    const AdamWTensors all = odd_table(&n);
    for (int64_t begin : {int64_t(0), int64_t(1), int64_t(999), int64_t(1007), int64_t(6000), n}) {
        for (int64_t end : {begin, begin + 1, begin + 130, begin + 5000, n}) {
            if (end < begin || end > n) continue;
            const AdamWTensors t = restrict_tensors(all, begin, end);
            std::vector<int> seen(size_t(n), 0);
            for (int i = 0; i < t.count; i++) {
                ASSERT_GT(t.numel[i], 0);
                for (int64_t k = t.offset[i]; k < t.offset[i] + t.numel[i]; k++) {
                    seen[size_t(k)]++;
                    int owner = 0;
                    while (!(k >= all.offset[owner] && k < all.offset[owner] + all.numel[owner])) owner++;
                    EXPECT_EQ(t.decayed[i], all.decayed[owner]) << "element " << k;
                }
            }
            for (int64_t k = 0; k < n; k++) {
                ASSERT_EQ(seen[size_t(k)], (k >= begin && k < end) ? 1 : 0)
                    << "element " << k << " of range [" << begin << ", " << end << ")";
            }
        }
    }
}

TEST_F(ZeroUpdateTest, ShardedAdamWIsBitwiseTheWholeUpdate) {
    int64_t n = 0;
    const AdamWTensors table = odd_table(&n);
    const size_t N = size_t(n);
    const auto master0 = random_floats(N, 11, 0.5f);
    const int steps = 3;
    std::vector<DeviceBuffer<floatX>> grads;
    for (int k = 0; k < steps; k++) grads.push_back(upload_bf16(random_floats(N, 20 + uint64_t(k), 0.05f)));
    const float clip = 0.7f;
    auto d_clip = upload(std::vector<float>{clip});
    AdamWSettings s;
    s.learning_rate = 1e-2f;
    s.weight_decay = 0.1f;
    const uint64_t seed = 1234;

    // The whole update.
    auto master = upload(master0);
    auto params = upload_bf16(master0);
    DeviceBuffer<float> m(N), v(N);
    cudaCheck(cudaMemset(m.get(), 0, m.bytes()));
    cudaCheck(cudaMemset(v.get(), 0, v.bytes()));
    for (int k = 0; k < steps; k++) {
        adamw_update(params.get(), master.get(), m.get(), v.get(), grads[size_t(k)].get(), table, s, k + 1, seed,
                     k == 1 ? nullptr : d_clip.get(), nullptr);
    }
    cudaCheck(cudaDeviceSynchronize());
    const auto want_params = bytes_of(params.get(), N), want_master = bytes_of(master.get(), N);
    const auto want_m = bytes_of(m.get(), N), want_v = bytes_of(v.get(), N);
    const auto start_params = bytes_of(upload_bf16(master0).get(), N);
    ASSERT_GT(differing(want_params, start_params), N / 2) << "the update barely changed the parameters";

    for (int world : {1, 2, 3, 5, 64}) {
        const ZeroLayout layout = zero_layout(n, world);
        for (int rank = 0; rank < world; rank++) {
            SCOPED_TRACE(format("world %d rank %d", world, rank));
            const ShardRange own = layout.owned(rank);
            const size_t S = size_t(layout.shard_size), count = size_t(own.size());
            const AdamWTensors mine = restrict_tensors(table, own.begin, own.end);
            auto p = upload_bf16(master0, size_t(layout.padding()));
            std::vector<float> shard0(S, 0.0f);
            std::copy(master0.begin() + own.begin, master0.begin() + own.end, shard0.begin());
            auto ms = upload(shard0);
            DeviceBuffer<float> mm(S), vv(S);
            cudaCheck(cudaMemset(mm.get(), 0, mm.bytes()));
            cudaCheck(cudaMemset(vv.get(), 0, vv.bytes()));
            for (int k = 0; k < steps; k++) {
                adamw_update(p.get(), ms.get(), mm.get(), vv.get(), grads[size_t(k)].get(), mine, s, k + 1, seed,
                             k == 1 ? nullptr : d_clip.get(), nullptr, own.begin);
            }
            cudaCheck(cudaDeviceSynchronize());
            const auto got_params = bytes_of(p.get(), N);
            const size_t X = sizeof(floatX), F = sizeof(float);
            auto range = [](const std::vector<unsigned char>& b, size_t from, size_t to) {
                return std::vector<unsigned char>(b.begin() + from, b.begin() + to);
            };
            EXPECT_EQ(differing(range(got_params, own.begin * X, own.end * X),
                                range(want_params, own.begin * X, own.end * X)), 0u) << "bf16 parameters";
            EXPECT_EQ(differing(range(got_params, 0, own.begin * X), range(start_params, 0, own.begin * X)), 0u)
                << "wrote parameters before its range";
            EXPECT_EQ(differing(range(got_params, own.end * X, N * X), range(start_params, own.end * X, N * X)), 0u)
                << "wrote parameters after its range";
            EXPECT_EQ(differing(bytes_of(ms.get(), count), range(want_master, own.begin * F, own.end * F)), 0u)
                << "master weights";
            EXPECT_EQ(differing(bytes_of(mm.get(), count), range(want_m, own.begin * F, own.end * F)), 0u) << "m";
            EXPECT_EQ(differing(bytes_of(vv.get(), count), range(want_v, own.begin * F, own.end * F)), 0u) << "v";
            const std::vector<float> zeros(S - count, 0.0f);
            EXPECT_EQ(differing(bytes_of(ms.get() + count, S - count),
                                std::vector<unsigned char>(reinterpret_cast<const unsigned char*>(zeros.data()),
                                                           reinterpret_cast<const unsigned char*>(zeros.data()) +
                                                               zeros.size() * F)),
                      0u)
                << "wrote master weights past its owned elements";
        }
    }
}

// adamw_update() takes 4 elements per thread when every offset is a multiple of 4 and the buffers are
// 16-byte aligned (the trainer's case), else one: both must give the same bits. The same table runs on
// aligned buffers and on buffers one element in (not 16-byte aligned, so elementwise); the last tensor's
// size leaves a tail of 3 for the 4-wide path.
TEST_F(ZeroUpdateTest, FourWideAdamWIsBitwiseTheElementwiseUpdate) {
    AdamWTensors table;
    table.add(0, 4096, true);
    table.add(4096, 12, false);
    table.add(4108, 65536 + 3, true);
    const size_t N = 4108 + 65536 + 3;
    const auto master0 = random_floats(N, 31, 0.5f);
    AdamWSettings s;
    s.learning_rate = 1e-2f;
    s.weight_decay = 0.1f;
    auto d_clip = upload(std::vector<float>{0.5f});
    std::vector<std::vector<float>> grads;
    for (int k = 0; k < 3; k++) grads.push_back(random_floats(N, 40 + uint64_t(k), 0.05f));
    std::vector<unsigned char> want[4];
    for (int shift : {0, 1}) {
        SCOPED_TRACE(shift == 0 ? "aligned (4 wide)" : "one element in (elementwise)");
        // Every buffer holds its N elements from index `shift` on.
        auto shifted = [&](const std::vector<float>& x) {
            std::vector<float> out(N + 1, 0.0f);
            std::copy(x.begin(), x.end(), out.begin() + shift);
            return out;
        };
        const std::vector<float> padded = shifted(master0);
        auto master = upload(padded);
        auto params = upload_bf16(padded);
        DeviceBuffer<float> m(N + 1), v(N + 1);
        cudaCheck(cudaMemset(m.get(), 0, m.bytes()));
        cudaCheck(cudaMemset(v.get(), 0, v.bytes()));
        for (int k = 0; k < 3; k++) {
            auto g = upload_bf16(shifted(grads[size_t(k)]));
            ASSERT_EQ(adamw_four_wide(params.get() + shift, master.get() + shift, m.get() + shift, v.get() + shift,
                                      g.get() + shift, table),
                      shift == 0);
            adamw_update(params.get() + shift, master.get() + shift, m.get() + shift, v.get() + shift, g.get() + shift,
                         table, s, k + 1, 77, k == 1 ? nullptr : d_clip.get(), nullptr);
        }
        cudaCheck(cudaDeviceSynchronize());
        const size_t X = sizeof(floatX), F = sizeof(float);
        auto part = [&](const std::vector<unsigned char>& b, size_t size) {
            return std::vector<unsigned char>(b.begin() + shift * size, b.begin() + (shift + N) * size);
        };
        const std::vector<unsigned char> got[4] = {part(bytes_of(params.get(), N + 1), X),
                                                   part(bytes_of(master.get(), N + 1), F),
                                                   part(bytes_of(m.get(), N + 1), F),
                                                   part(bytes_of(v.get(), N + 1), F)};
        if (shift == 0) {
            for (int i = 0; i < 4; i++) want[i] = got[i];
            ASSERT_GT(differing(got[0], part(bytes_of(upload_bf16(padded).get(), N + 1), X)), N / 2)
                << "the update barely changed the parameters";
            continue;
        }
        const char* names[4] = {"bf16 parameters", "master weights", "m", "v"};
        for (int i = 0; i < 4; i++) EXPECT_EQ(differing(got[i], want[i]), 0u) << names[i];
    }
}

TEST_F(ZeroUpdateTest, SplitNormIsBitwiseAndShardsAddUp) {
    const int64_t n = 100003;
    const auto g = random_floats(size_t(n), 5, 0.02f);
    DeviceBuffer<float> scratch(kGlobalNormScratchBytes / sizeof(float)), out(4);
    for (float max_norm : {0.0f, 1e-3f, 1e3f}) {
        SCOPED_TRACE(format("max_norm %g", double(max_norm)));
        auto d_g = upload_bf16(g);
        cudaCheck(cudaMemset(out.get(), 0xff, out.bytes()));
        global_norm(out.get(), out.get() + 1, d_g.get(), n, max_norm, scratch.get(), scratch.bytes(), nullptr);
        global_norm_sumsq(out.get() + 3, d_g.get(), n, scratch.get(), scratch.bytes(), nullptr);
        const auto whole = bytes_of(out.get(), 2);
        cudaCheck(cudaMemset(out.get(), 0xff, 2 * sizeof(float)));
        global_norm_finish(out.get(), out.get() + 1, out.get() + 3, max_norm, nullptr);
        EXPECT_EQ(differing(bytes_of(out.get(), 2), whole), 0u) << "sumsq + finish differs from global_norm";

        const ZeroLayout layout = zero_layout(n, 3);
        auto padded = upload_bf16(g, size_t(layout.padding()));
        float total = 0.0f;
        for (int r = 0; r < 3; r++) {
            global_norm_sumsq(out.get() + 3, padded.get() + layout.shard(r).begin, layout.owned(r).size(), scratch.get(),
                              scratch.bytes(), nullptr);
            float part = 0;
            cudaCheck(cudaMemcpy(&part, out.get() + 3, sizeof(float), cudaMemcpyDeviceToHost));
            total += part;
        }
        float norm = 0;
        std::memcpy(&norm, whole.data(), sizeof(float));
        EXPECT_NEAR(std::sqrt(total), norm, 1e-5 * norm);
    }
}
