/*
CPU tests of llmc/zero.h: the ZeRO-1 shard geometry (padding, ranges, owners) for every N in a small
range and every world size 1..8 at several alignments, and the re-sharding of optimizer state from
every old world size to every new one, checked element by element against the unsharded array.
*/
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "llmc/zero.h"
#include "test/test_util.h"
#include "test/expect_error.h"

using namespace llmc;
using llmc::test::random_floats;

namespace {

// The saved shards and their contents for a run of `world` ranks over `full`.
struct Saved {
    std::vector<SavedShard> shards;
    std::vector<std::vector<float>> data;
};

Saved save(const std::vector<float>& full, int world, int64_t alignment) {
    const ZeroLayout z = zero_layout(int64_t(full.size()), world, alignment);
    Saved s;
    for (int r = 0; r < world; r++) {
        s.shards.push_back(saved_shard(z, r, "state_rank" + std::to_string(r) + ".bin"));
        const ShardRange o = z.owned(r);
        s.data.emplace_back(full.begin() + o.begin, full.begin() + o.end);
    }
    return s;
}

}  // namespace

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
                    const int r = z.owner_of(i);
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
    expect_error([&] { z.owner_of(10); }, kExitError, {"element 10"});
}

TEST(ZeroReshard, EveryWorldSizeToEveryOther) {
    for (int64_t alignment : {1, 4, 128}) {
        for (int64_t n : {1, 2, 3, 7, 8, 9, 31, 127, 128, 129, 257, 1000, 1031}) {
            const std::vector<float> full = random_floats(size_t(n), uint64_t(n) * 31 + uint64_t(alignment), 1000.0f);
            for (int w_old = 1; w_old <= 8; w_old++) {
                const Saved saved = save(full, w_old, alignment);
                check_saved_shards(saved.shards, n);
                std::vector<const float*> old;
                for (const auto& d : saved.data) old.push_back(d.data());
                for (int w_new = 1; w_new <= 8; w_new++) {
                    SCOPED_TRACE("N=" + std::to_string(n) + " A=" + std::to_string(alignment) + " " +
                                 std::to_string(w_old) + "->" + std::to_string(w_new));
                    // The new run may use another alignment too: re-sharding reads the saved ranges.
                    const ZeroLayout to = zero_layout(n, w_new, alignment == 128 ? 4 : 128);
                    std::vector<float> rebuilt;
                    for (int r = 0; r < w_new; r++) {
                        std::vector<float> shard(size_t(to.shard_size), -12345.0f);  // poison
                        reshard(saved.shards, old, to, r, shard.data());
                        const ShardRange o = to.owned(r);
                        for (int64_t i = o.size(); i < to.shard_size; i++) ASSERT_EQ(shard[size_t(i)], 0.0f) << i;
                        rebuilt.insert(rebuilt.end(), shard.begin(), shard.begin() + o.size());
                    }
                    ASSERT_EQ(rebuilt, full);
                }
            }
        }
    }
}

TEST(ZeroReshard, PlanPiecesAreMinimal) {
    // 10 elements saved by 3 ranks at alignment 1 ([0,4) [4,8) [8,10)), read back by 2 ranks ([0,5) [5,10)).
    const ZeroLayout from = zero_layout(10, 3, 1);
    std::vector<SavedShard> saved;
    for (int r = 0; r < 3; r++) saved.push_back(saved_shard(from, r));
    const ZeroLayout to = zero_layout(10, 2, 1);
    const std::vector<ShardPiece> a = reshard_plan(saved, to.owned(0));
    ASSERT_EQ(a.size(), 2u);
    EXPECT_EQ(a[0].source, 0);
    EXPECT_EQ(a[0].src_offset, 0);
    EXPECT_EQ(a[0].dst_offset, 0);
    EXPECT_EQ(a[0].count, 4);
    EXPECT_EQ(a[1].source, 1);
    EXPECT_EQ(a[1].src_offset, 0);
    EXPECT_EQ(a[1].dst_offset, 4);
    EXPECT_EQ(a[1].count, 1);
    const std::vector<ShardPiece> b = reshard_plan(saved, to.owned(1));
    ASSERT_EQ(b.size(), 2u);
    EXPECT_EQ(b[0].source, 1);
    EXPECT_EQ(b[0].src_offset, 1);
    EXPECT_EQ(b[0].count, 3);
    EXPECT_EQ(b[1].source, 2);
    EXPECT_EQ(b[1].dst_offset, 3);
    EXPECT_EQ(b[1].count, 2);
}

TEST(ZeroReshard, ShardsGivenOutOfOrder) {
    const std::vector<float> full = random_floats(333, 5, 1000.0f);
    Saved saved = save(full, 5, 4);
    std::swap(saved.shards[0], saved.shards[3]);
    std::swap(saved.data[0], saved.data[3]);
    check_saved_shards(saved.shards, 333);
    std::vector<const float*> old;
    for (const auto& d : saved.data) old.push_back(d.data());
    const ZeroLayout to = zero_layout(333, 1, 128);
    std::vector<float> shard(size_t(to.shard_size), -1.0f);
    reshard(saved.shards, old, to, 0, shard.data());
    EXPECT_EQ(std::vector<float>(shard.begin(), shard.begin() + 333), full);
}

TEST(ZeroReshard, DamagedCheckpointsAreNamed) {
    const ZeroLayout z = zero_layout(100, 4, 4);
    auto shards = [&] {
        std::vector<SavedShard> s;
        for (int r = 0; r < 4; r++) s.push_back(saved_shard(z, r, "opt_" + std::to_string(r) + ".bin"));
        return s;
    };
    expect_error([&] { check_saved_shards({}, 100); }, kExitData, {"no shard files"});
    {
        auto s = shards();
        s.pop_back();
        expect_error([&] { check_saved_shards(s, 100); }, kExitData, {"3 shard files", "4 ranks"});
    }
    {
        auto s = shards();
        s[2].world = 5;
        expect_error([&] { check_saved_shards(s, 100); }, kExitData, {"opt_2.bin", "5 ranks"});
    }
    {
        auto s = shards();
        s[3].rank = 1;
        expect_error([&] { check_saved_shards(s, 100); }, kExitData, {"opt_1.bin", "opt_3.bin", "both claim rank 1"});
    }
    {
        auto s = shards();
        s[2].begin += 1;
        s[2].count -= 1;
        expect_error([&] { check_saved_shards(s, 100); }, kExitData, {"opt_2.bin", "a gap"});
    }
    {
        auto s = shards();
        s[1].count += 1;
        expect_error([&] { check_saved_shards(s, 100); }, kExitData, {"opt_2.bin", "overlaps"});
    }
    expect_error([&] { check_saved_shards(shards(), 101); }, kExitData, {"[0, 100)", "has 101"});
    {
        // A range past the model (here one whose end does not fit in 64 bits) is named with its file.
        auto s = shards();
        s[3].count = std::numeric_limits<int64_t>::max();
        expect_error([&] { check_saved_shards(s, 100); }, kExitData, {"opt_3.bin", "past the model's 100 parameters"});
    }
    {
        auto s = shards();
        s.erase(s.begin() + 1);
        expect_error([&] { reshard_plan(s, {0, 100}); }, kExitData, {"do not cover"});
    }
}
