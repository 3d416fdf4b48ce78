/*
CPU tests of llmc/zero.h: the ZeRO-1 shard geometry (padding, ranges, owners) for every N in a small
range and every world size 1..8 at several alignments. Re-sharding a checkpoint's optimizer state from
every old world size to every new one is tested in test_checkpoint.cpp.
*/
#include <gtest/gtest.h>

#include <string>

#include "llmc/zero.h"
#include "test/expect_error.h"

using namespace llmc;

// The rank whose shard holds element `index` of the real parameters.
int owner_of(const ZeroLayout& z, int64_t index) {
    if (index < 0 || index >= z.num_params) {
        fail(kExitError, "ZeroLayout: element %lld is outside the %lld parameters", (long long)index,
             (long long)z.num_params);
    }
    return int(index / z.shard_size);
}

TEST(ZeroLayout, GeometryForEverySmallCase) {
    for (int64_t alignment : {1, 3, 4, 128}) {
        for (int64_t n = 1; n <= 300; n++) {
            for (int w = 1; w <= 8; w++) {
                SCOPED_TRACE("N=" + std::to_string(n) + " W=" + std::to_string(w) + " A=" + std::to_string(alignment));
                const ZeroLayout z = zero_layout(n, w, alignment);
                const int64_t p = z.padded_total();
                ASSERT_EQ(z.shard_size % alignment, 0);
                ASSERT_GE(p, n);
                ASSERT_EQ(p, z.shard_size * w);
                ASSERT_EQ(z.padding(), p - n);
                // S is the smallest aligned size that fits ceil(N/W): one alignment less would not do.
                ASSERT_GE(z.shard_size * w, n);
                ASSERT_LT((z.shard_size - alignment) * w, n);
                int64_t next_shard = 0, next_owned = 0, owned_total = 0;
                for (int r = 0; r < w; r++) {
                    const ShardRange s = z.shard(r), o = z.owned(r);
                    ASSERT_EQ(s.begin, next_shard);
                    ASSERT_EQ(s.size(), z.shard_size);
                    next_shard = s.end;
                    if (o.empty()) {
                        ASSERT_EQ(o.begin, n);  // a rank past the end owns [N, N)
                        ASSERT_EQ(o.end, n);
                        ASSERT_GE(s.end, n);
                    } else {
                        ASSERT_EQ(o.begin, next_owned);
                        ASSERT_EQ(o.begin, s.begin);
                        ASSERT_LE(o.end, s.end);
                        ASSERT_LE(o.end, n);
                        next_owned = o.end;
                    }
                    owned_total += o.size();
                }
                ASSERT_EQ(next_shard, p);
                ASSERT_EQ(next_owned, n);
                ASSERT_EQ(owned_total, n);
                for (int64_t i = 0; i < n; i++) {
                    const int r = owner_of(z, i);
                    ASSERT_GE(i, z.owned(r).begin);
                    ASSERT_LT(i, z.owned(r).end);
                }
            }
        }
    }
}

TEST(ZeroLayout, KnownValues) {
    // 124M GPT-2 (padded vocabulary 50304): 124475904 parameters.
    const ZeroLayout z = zero_layout(124475904, 8);
    EXPECT_EQ(z.shard_size, 15559552);  // 124475904 / 8 = 15559488, rounded up to a multiple of 128
    EXPECT_EQ(z.padded_total(), 124476416);
    EXPECT_EQ(z.owned(7).begin, 7 * 15559552);
    EXPECT_EQ(z.owned(7).end, 124475904);
    // Fewer parameters than ranks: rank 0 owns everything, the others only padding.
    const ZeroLayout tiny = zero_layout(5, 8, 128);
    EXPECT_EQ(tiny.shard_size, 128);
    EXPECT_EQ(tiny.owned(0).size(), 5);
    for (int r = 1; r < 8; r++) EXPECT_TRUE(tiny.owned(r).empty());
    const ZeroLayout one = zero_layout(5, 8, 1);
    EXPECT_EQ(one.shard_size, 1);
    EXPECT_EQ(one.owned(4).size(), 1);
    EXPECT_TRUE(one.owned(5).empty());
}

TEST(ZeroLayout, RejectsBadInputs) {
    expect_error([] { zero_layout(0, 2); }, kExitUsage, {"0 parameters"});
    expect_error([] { zero_layout(10, 0); }, kExitUsage, {"world size 0"});
    expect_error([] { zero_layout(10, 2, 0); }, kExitUsage, {"alignment 0"});
    const ZeroLayout z = zero_layout(10, 2, 1);
    expect_error([&] { z.shard(2); }, kExitError, {"rank 2"});
    expect_error([&] { owner_of(z, 10); }, kExitError, {"element 10"});
}
