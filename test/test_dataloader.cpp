/*
CPU tests of the token shard format (shard.h) and the host DataLoader (dataloader.h): every validation
error, rank slices disjoint and complete over an epoch, seeded shuffling, the carried epoch tail, exact
resume from a state blob across shard and epoch boundaries, resume on another number of ranks, the
prefetch ring, and offsets past 4 GiB (sparse files). Shards are written into a fresh directory under /tmp that is removed afterwards; tokens
are checked against the bytes of the files, read here independently of the loader.
*/
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "llmc/dataloader.h"
#include "test/test_util.h"
#include "test/expect_error.h"

using namespace llmc;
using llmc::test::random_tokens;
using llmc::test::TempDir;
using llmc::test::write_random_shards;

namespace {

void write_raw(const std::string& path, const std::vector<int32_t>& header, const std::vector<uint8_t>& payload) {
    File f(path, File::Mode::Write);
    std::vector<int32_t> h(kShardHeaderInts, 0);
    std::copy(header.begin(), header.end(), h.begin());
    f.write_all(h.data(), h.size() * 4);
    if (!payload.empty()) f.write_all(payload.data(), payload.size());
    f.close();
}

// Reads a whole (small) shard without the code under test: the header by hand, then the tokens.
std::vector<uint32_t> read_reference(const std::string& path) {
    File f(path, File::Mode::Read);
    int32_t h[kShardHeaderInts];
    f.read_exact(h, sizeof(h));
    size_t n = uint32_t(h[2]);
    std::vector<uint32_t> out(n);
    if (h[1] == 1) {
        std::vector<uint16_t> v(n);
        f.read_exact(v.data(), n * 2);
        for (size_t i = 0; i < n; i++) out[i] = v[i];
    } else {
        f.read_exact(out.data(), n * 4);
    }
    return out;
}

uint32_t token_at(const HostBatch& b, size_t i) {
    return b.token_bytes == 2 ? static_cast<const uint16_t*>(b.tokens)[i] : static_cast<const uint32_t*>(b.tokens)[i];
}

std::vector<uint32_t> batch_tokens(const HostBatch& b) {
    std::vector<uint32_t> v(size_t(b.B) * (b.T + 1));
    for (size_t i = 0; i < v.size(); i++) v[i] = token_at(b, i);
    return v;
}

DataLoaderConfig config(const std::string& pattern, int B, int T, uint32_t vocab, bool shuffle = true, uint64_t seed = 7,
                        int rank = 0, int world = 1, int prefetch = 0) {
    DataLoaderConfig c;
    c.pattern = pattern;
    c.B = B;
    c.T = T;
    c.vocab_size = vocab;
    c.shuffle = shuffle;
    c.seed = seed;
    c.rank = rank;
    c.world = world;
    c.prefetch = prefetch;
    return c;
}

// A data set of several shards with odd sizes, both versions, random tokens.
struct DataSet {
    TempDir dir;
    std::vector<std::string> paths;
    std::vector<std::vector<uint32_t>> tokens;
    uint32_t vocab;
    DataSet(const std::vector<size_t>& sizes, uint32_t vocab_size, uint64_t seed = 1)
        : tokens(write_random_shards(dir.path(), sizes, vocab_size, seed)), vocab(vocab_size) {
        for (size_t i = 0; i < sizes.size(); i++) paths.push_back(dir.file(format("shard_%03zu.bin", i)));
    }
    std::string pattern() const { return dir.path() + "/shard_*.bin"; }
};

// Checks that every row of a batch holds the file's tokens at the sample it claims.
void expect_rows_match_files(const HostBatch& b, const SampleSchedule& s, const std::vector<std::vector<uint32_t>>& files) {
    for (int r = 0; r < b.B; r++) {
        const SampleRef& ref = b.samples[r];
        ASSERT_LT(ref.shard, files.size());
        ASSERT_EQ(ref.token_offset % b.T, 0);
        ASSERT_LE(size_t(ref.token_offset) + b.T + 1, files[ref.shard].size());
        for (int t = 0; t <= b.T; t++) {
            ASSERT_EQ(token_at(b, size_t(r) * (b.T + 1) + t), files[ref.shard][ref.token_offset + t])
                << "row " << r << " token " << t << " of batch " << b.index << " (" << s.shards()[ref.shard].path << ")";
        }
    }
}

using Key = std::tuple<uint64_t, uint32_t, int64_t>;  // epoch, shard, token offset

}  // namespace

TEST(Shard, Version1IsLlmcLayoutAndVersion2KeepsWideIds) {
    TempDir dir;
    auto t1 = random_tokens(1001, 50257, 3);
    write_token_shard(dir.file("a.bin"), t1.data(), t1.size(), 1);
    File f(dir.file("a.bin"), File::Mode::Read);
    EXPECT_EQ(f.size(), 1024 + 2 * 1001);
    int32_t h[4];
    f.read_exact(h, sizeof(h));
    EXPECT_EQ(h[0], 20240520);
    EXPECT_EQ(h[1], 1);
    EXPECT_EQ(h[2], 1001);
    EXPECT_EQ(h[3], 0);
    ShardHeader sh = read_shard_header(f);
    EXPECT_EQ(sh.version, 1);
    EXPECT_EQ(sh.num_tokens, 1001);
    EXPECT_EQ(sh.bytes_per_token, 2);
    EXPECT_EQ(read_reference(dir.file("a.bin")), t1);

    auto t2 = random_tokens(777, 200000, 4);
    write_token_shard(dir.file("b.bin"), t2.data(), t2.size(), 2);
    File g(dir.file("b.bin"), File::Mode::Read);
    EXPECT_EQ(g.size(), 1024 + 4 * 777);
    sh = read_shard_header(g);
    EXPECT_EQ(sh.version, 2);
    EXPECT_EQ(sh.num_tokens, 777);
    EXPECT_EQ(read_reference(dir.file("b.bin")), t2);

    expect_error([&] { write_token_shard(dir.file("c.bin"), t2.data(), t2.size(), 1); }, kExitUsage, {"does not fit uint16"});
    expect_error([&] { write_token_shard(dir.file("c.bin"), t2.data(), t2.size(), 3); }, kExitUsage, {"unknown version 3"});
    EXPECT_FALSE(std::filesystem::exists(dir.file("c.bin"))) << "a refused shard must leave no file";
    EXPECT_FALSE(std::filesystem::exists(dir.file("c.bin.tmp")));
}

TEST(Validation, EveryBadShardIsOneClearError) {
    TempDir dir;
    std::vector<uint8_t> payload(2 * 1000);
    for (size_t i = 0; i < payload.size(); i++) payload[i] = uint8_t(i * 7);
    auto open = [&](const std::string& name) { return [&, name] { SampleSchedule s(config(dir.file(name), 2, 8, 65536)); }; };

    write_raw(dir.file("magic.bin"), {20240521, 1, 1000}, payload);
    expect_error(open("magic.bin"), kExitData, {"magic.bin", "bad magic 20240521 at offset 0", "expected 20240520"});

    write_raw(dir.file("v3.bin"), {kShardMagic, 3, 1000}, payload);
    expect_error(open("v3.bin"), kExitData, {"v3.bin", "unsupported version 3 at offset 4"});
    write_raw(dir.file("v0.bin"), {kShardMagic, 0, 1000}, payload);
    expect_error(open("v0.bin"), kExitData, {"v0.bin", "unsupported version 0"});

    {
        File f(dir.file("short.bin"), File::Mode::Write);
        std::vector<int32_t> h(100, 0);
        h[0] = kShardMagic;
        f.write_all(h.data(), 400);
    }
    expect_error(open("short.bin"), kExitData, {"short.bin", "400 bytes, shorter than its 1024-byte header"});

    write_raw(dir.file("trunc.bin"), {kShardMagic, 1, 1001}, payload);
    expect_error(open("trunc.bin"), kExitData, {"trunc.bin", "truncated", "1001 tokens", "3024 bytes", "1000 tokens"});

    std::vector<uint8_t> longer = payload;
    longer.push_back(1);
    longer.push_back(2);
    longer.push_back(3);
    write_raw(dir.file("long.bin"), {kShardMagic, 1, 1000}, longer);
    expect_error(open("long.bin"), kExitData, {"long.bin", "says 1000 tokens", "3 unexpected bytes"});

    write_raw(dir.file("neg.bin"), {kShardMagic, 1, -5}, payload);
    expect_error(open("neg.bin"), kExitData, {"neg.bin", "negative"});

    // A corrupt high word must not overflow the size arithmetic into an accepted file.
    write_raw(dir.file("huge.bin"), {kShardMagic, 2, 500, 0x7fffffff}, payload);
    expect_error(open("huge.bin"), kExitData, {"huge.bin", "truncated"});

    auto few = random_tokens(8, 100, 5);  // 8 tokens: no sample of T+1 = 9
    write_token_shard(dir.file("few.bin"), few.data(), few.size(), 1);
    expect_error(open("few.bin"), kExitData, {"few.bin", "fewer than one sample of T+1 = 9"});

    // One good shard and one bad one: the error names the bad one.
    auto good = random_tokens(1000, 100, 6);
    write_token_shard(dir.file("good.bin"), good.data(), good.size(), 1);
    expect_error([&] { SampleSchedule s(config(dir.file("good.bin") + "," + dir.file("magic.bin"), 2, 8, 100)); }, kExitData,
                 {"magic.bin"});
}

TEST(Validation, PatternsAndGeometryErrors) {
    TempDir dir;
    expect_error([&] { SampleSchedule s(config(dir.file("*.bin"), 2, 8, 100)); }, kExitUsage,
                 {"no shard file matches", dir.file("*.bin")});
    expect_error([&] { SampleSchedule s(config("", 2, 8, 100)); }, kExitUsage, {"empty shard pattern"});
    auto t = random_tokens(1000, 100, 8);
    write_token_shard(dir.file("a.bin"), t.data(), t.size(), 1);
    expect_error([&] { SampleSchedule s(config(dir.file("a.bin") + ",", 2, 8, 100)); }, kExitUsage, {"empty item"});
    expect_error([&] { SampleSchedule s(config(dir.file("a.bin") + "," + dir.file("*.bin"), 2, 8, 100)); }, kExitUsage,
                 {"named twice", "a.bin"});
    // The same file under another name (a ./ in the path, a link) would be read twice an epoch: refused too.
    const std::string dotted = dir.path() + "/./a.bin";
    expect_error([&] { SampleSchedule s(config(dir.file("a.bin") + "," + dotted, 2, 8, 100)); }, kExitUsage,
                 {"are the same file", dir.file("a.bin"), dotted});
    std::filesystem::create_symlink(dir.file("a.bin"), dir.file("link_to_a.bin"));
    expect_error([&] { SampleSchedule s(config(dir.file("*.bin"), 2, 8, 100)); }, kExitUsage,
                 {"are the same file", "link_to_a.bin"});
    std::filesystem::remove(dir.file("link_to_a.bin"));
    expect_error([&] { SampleSchedule s(config(dir.file("a.bin") + "," + dir.file("missing.bin"), 2, 8, 100)); },
                 kExitUsage, {"no shard file matches", "missing.bin"});
    std::filesystem::create_directory(dir.file("dir.bin"));
    expect_error([&] { SampleSchedule s(config(dir.file("*.bin"), 2, 8, 100)); }, kExitData, {"dir.bin", "not a regular file"});
    // 1000 tokens at T = 8: 124 samples; a global batch of 5 * 25 = 125 does not fit.
    expect_error([&] { SampleSchedule s(config(dir.file("a.bin"), 5, 8, 100, true, 1, 0, 25)); }, kExitData,
                 {"124 samples", "fewer than one global batch", "5*25"});
    SampleSchedule ok(config(dir.file("a.bin"), 4, 8, 100, true, 1, 0, 31));
    EXPECT_EQ(ok.samples_per_epoch(), 124u);
    EXPECT_EQ(ok.batches_per_epoch(), 1u);
    expect_error([&] { SampleSchedule s(config(dir.file("a.bin"), 2, 8, 100, true, 1, 3, 3)); }, kExitUsage, {"rank 3"});
    expect_error([&] { SampleSchedule s(config(dir.file("a.bin"), 2, 8, 0)); }, kExitUsage, {"vocabulary size"});
    expect_error([&] { SampleSchedule s(config(dir.file("a.bin"), 0, 8, 100)); }, kExitUsage, {"B >= 1"});
}

TEST(Validation, GlobOrderIsSortedAndListOrderIsKept) {
    TempDir dir;
    auto t = random_tokens(100, 100, 9);
    for (const char* n : {"b.bin", "c.bin", "a.bin"}) write_token_shard(dir.file(n), t.data(), t.size(), 1);
    SampleSchedule g(config(dir.file("*.bin"), 1, 8, 100));
    ASSERT_EQ(g.shards().size(), 3u);
    EXPECT_EQ(g.shards()[0].path, dir.file("a.bin"));
    EXPECT_EQ(g.shards()[1].path, dir.file("b.bin"));
    EXPECT_EQ(g.shards()[2].path, dir.file("c.bin"));
    SampleSchedule l(config(dir.file("c.bin") + "," + dir.file("[ab].bin"), 1, 8, 100));
    EXPECT_EQ(l.shards()[0].path, dir.file("c.bin"));
    EXPECT_EQ(l.shards()[1].path, dir.file("a.bin"));
    EXPECT_EQ(l.shards()[2].path, dir.file("b.bin"));
}

TEST(Validation, TokenIdAtOrAboveVocabIsAnErrorNamingShardAndOffset) {
    for (int prefetch : {0, 3}) {
        TempDir dir;
        auto t = random_tokens(300, 1000, 10);
        t[100] = 1000;  // the first id out of range; only sample 6 (tokens 96..112) contains it
        write_token_shard(dir.file("bad.bin"), t.data(), t.size(), 1);
        DataLoader dl(config(dir.file("bad.bin"), 1, 16, 1000, false, 0, 0, 1, prefetch));
        for (int k = 0; k < 6; k++) EXPECT_EQ(dl.next().index, uint64_t(k));
        for (int again = 0; again < 2; again++) {
            expect_error([&] { dl.next(); }, kExitData,
                         {"bad.bin", "token 100 (byte offset 1224)", "id 1000", "vocabulary size 1000"});
        }
        EXPECT_EQ(dl.position(), 6u);
        dl.seek(7);
        EXPECT_EQ(dl.next().index, 7u);
    }
    // Wide ids in a version 2 shard are checked the same way.
    TempDir dir;
    auto t = random_tokens(300, 70000, 11);
    t[250] = 70000;
    write_token_shard(dir.file("wide.bin"), t.data(), t.size(), 2);
    DataLoader dl(config(dir.file("wide.bin"), 2, 16, 70000, false));
    for (int k = 0; k < 7; k++) dl.next();
    expect_error([&] { dl.next(); }, kExitData, {"wide.bin", "token 250 (byte offset 2024)", "id 70000"});
}

TEST(Geometry, UnpackShiftsTargetsByOne) {
    DataSet ds({200}, 50257);
    DataLoader dl(SampleSchedule(config(ds.pattern(), 3, 10, 50257, false)));
    const HostBatch& b = dl.next();
    EXPECT_EQ(b.token_bytes, 2);
    std::vector<int32_t> in(30), tg(30);
    unpack_batch(b, in.data(), tg.data());
    for (int r = 0; r < 3; r++) {
        for (int t = 0; t < 10; t++) {
            EXPECT_EQ(in[r * 10 + t], int32_t(ds.tokens[0][r * 10 + t]));
            EXPECT_EQ(tg[r * 10 + t], int32_t(ds.tokens[0][r * 10 + t + 1]));
        }
    }
}

// For every world size and many seeds: run all ranks over more than two epochs; within each global
// batch the ranks' samples are disjoint (a batch that straddles an epoch boundary may hold one position
// twice, once from each epoch, so a sample is its epoch, shard and offset); each epoch's samples, over
// all ranks, are every sample position exactly once; the rows hold the file's tokens; and the
// concatenated stream carries an epoch's tail into the next.
TEST(Geometry, RankSlicesAreDisjointAndCoverEachEpochExactlyOnce) {
    DataSet ds({211, 500, 96, 333, 1000, 157}, 3000);
    const int B = 3, T = 7;
    std::set<std::pair<uint32_t, int64_t>> all_positions;
    for (size_t s = 0; s < ds.tokens.size(); s++) {
        for (int64_t p = 0; p + T + 1 <= int64_t(ds.tokens[s].size()); p += T) all_positions.insert({uint32_t(s), p});
    }
    std::vector<uint64_t> seeds = {42};
    for (uint64_t seed = 1; seed <= 20; seed++) seeds.push_back(seed);
    int repeated_positions = 0;  // batches holding one position from two epochs: the case the key must allow
    for (uint64_t seed : seeds) {
        for (int W : {1, 2, 3, 8}) {
            SCOPED_TRACE("seed " + std::to_string(seed) + ", W = " + std::to_string(W));
            std::vector<std::unique_ptr<DataLoader>> ranks;
            for (int r = 0; r < W; r++) {
                const DataLoaderConfig c = config(ds.pattern(), B, T, 3000, true, seed, r, W, r % 2 ? 2 : 0);
                ranks.push_back(std::make_unique<DataLoader>(c));
            }
            const SampleSchedule& s = ranks[0]->schedule();
            ASSERT_EQ(s.samples_per_epoch(), all_positions.size());
            ASSERT_NE(s.samples_per_epoch() % (B * W), 0u) << "this test wants an epoch tail that is carried over";
            uint64_t batches = (3 * s.samples_per_epoch()) / (B * W) + 1;
            std::map<Key, int> seen;
            std::vector<Key> stream;
            for (uint64_t k = 0; k < batches; k++) {
                std::set<Key> in_batch;
                std::set<std::pair<uint32_t, int64_t>> positions;
                for (int r = 0; r < W; r++) {
                    const HostBatch& b = ranks[r]->next();
                    ASSERT_EQ(b.index, k);
                    ASSERT_EQ(b.epoch, b.samples[0].epoch);
                    expect_rows_match_files(b, s, ds.tokens);
                    for (int i = 0; i < B; i++) {
                        const SampleRef& ref = b.samples[i];
                        EXPECT_TRUE(in_batch.insert({ref.epoch, ref.shard, ref.token_offset}).second)
                            << "two ranks share a sample in batch " << k;
                        if (!positions.insert({ref.shard, ref.token_offset}).second) repeated_positions++;
                        seen[{ref.epoch, ref.shard, ref.token_offset}]++;
                        stream.push_back({ref.epoch, ref.shard, ref.token_offset});
                    }
                }
            }
            for (uint64_t e = 0; e < 3; e++) {
                size_t count = 0;
                for (const auto& [pos, n] : seen) {
                    if (std::get<0>(pos) != e) continue;
                    EXPECT_EQ(n, 1) << "epoch " << e << " shard " << std::get<1>(pos) << " offset " << std::get<2>(pos);
                    EXPECT_TRUE(all_positions.count({std::get<1>(pos), std::get<2>(pos)}));
                    count++;
                }
                EXPECT_EQ(count, all_positions.size()) << "epoch " << e << " is not covered";
            }
            // The stream is epoch 0, then epoch 1, ... with no gap: an epoch's tail is followed directly by
            // the next epoch's first samples, inside one global batch.
            for (size_t i = 0; i < stream.size(); i++) EXPECT_EQ(std::get<0>(stream[i]), i / s.samples_per_epoch());
            uint64_t straddle = s.samples_per_epoch() / (B * W);
            EXPECT_EQ(s.epoch_of_batch(straddle), 0u);
            EXPECT_EQ(s.epoch_of_batch(straddle + 1), 1u);
            EXPECT_EQ(std::get<0>(stream[straddle * B * W]), 0u);
            EXPECT_EQ(std::get<0>(stream[(straddle + 1) * B * W - 1]), 1u);
            EXPECT_EQ(ranks[0]->epoch(), stream.size() / s.samples_per_epoch());
        }
    }
    EXPECT_GT(repeated_positions, 0) << "no seed put one position of two epochs into one batch";
}

// The per-epoch sample lists that the GPU-resident mode uploads (visit_epoch), indexed the way its
// kernel indexes them, name the same samples as the streaming path.
TEST(Geometry, EpochListsMatchTheStream) {
    DataSet ds({150, 401, 222, 87}, 900);
    const int B = 4, T = 5, W = 3;
    for (int r = 0; r < W; r++) {
        DataLoader dl(config(ds.pattern(), B, T, 900, true, 77, r, W, 2));
        const SampleSchedule& s = dl.schedule();
        uint64_t S = s.samples_per_epoch();
        std::map<uint64_t, std::vector<std::pair<uint32_t, int64_t>>> lists;
        for (uint64_t e = 0; e < 4; e++) {
            s.visit_epoch(e, [&](uint32_t shard, int64_t off) { lists[e].push_back({shard, off}); });
            ASSERT_EQ(lists[e].size(), S);
        }
        for (uint64_t k = 0; k < 3 * S / (B * W); k++) {
            const HostBatch& b = dl.next();
            uint64_t first = s.first_sample(k), e0 = first / S;
            EXPECT_EQ(b.epoch, e0);
            for (int i = 0; i < B; i++) {
                uint64_t idx = first - e0 * S + i;
                auto want = idx < S ? lists[e0][idx] : lists[e0 + 1][idx - S];
                EXPECT_EQ(b.samples[i].shard, want.first) << "batch " << k << " row " << i;
                EXPECT_EQ(b.samples[i].token_offset, want.second) << "batch " << k << " row " << i;
            }
        }
    }
}

TEST(Geometry, ValidationOrderIsFileOrderAndResetRestarts) {
    DataSet ds({100, 57, 80}, 500);
    const int B = 2, T = 9, W = 2;
    for (int r = 0; r < W; r++) {
        DataLoader dl(config(ds.pattern(), B, T, 500, false, 0, r, W, 2));
        // Samples in order: shard 0 (11), shard 1 (6), shard 2 (8) = 25; global batch 4, rank r takes 2r, 2r+1.
        std::vector<std::pair<uint32_t, int64_t>> expected;
        for (uint32_t s = 0; s < 3; s++) {
            for (int64_t p = 0; p + T + 1 <= int64_t(ds.tokens[s].size()); p += T) expected.push_back({s, p});
        }
        ASSERT_EQ(expected.size(), 25u);
        std::vector<std::vector<uint32_t>> first;
        for (int k = 0; k < 6; k++) {
            const HostBatch& b = dl.next();
            first.push_back(batch_tokens(b));
            expect_rows_match_files(b, dl.schedule(), ds.tokens);
            for (int i = 0; i < B; i++) {
                auto e = expected[k * B * W + r * B + i];
                EXPECT_EQ(b.samples[i].shard, e.first);
                EXPECT_EQ(b.samples[i].token_offset, e.second);
            }
        }
        // The seventh global batch holds sample 24 and wraps to the start: the tail is carried over.
        const HostBatch& wrap = dl.next();
        EXPECT_EQ(wrap.samples[0].epoch, r == 0 ? 0u : 1u);
        dl.reset();
        for (int k = 0; k < 6; k++) EXPECT_EQ(batch_tokens(dl.next()), first[k]) << "batch " << k << " after reset";
    }
}

TEST(Shuffle, ReproducibleForASeedDifferentAcrossSeedsAndEpochs) {
    DataSet ds({400, 300, 500, 250, 350, 450}, 2000);
    const int B = 4, T = 8;
    auto run = [&](uint64_t seed, int prefetch) {
        DataLoader dl(config(ds.pattern(), B, T, 2000, true, seed, 0, 1, prefetch));
        std::vector<Key> refs;
        uint64_t n = 4 * dl.schedule().samples_per_epoch() / B;
        for (uint64_t k = 0; k < n; k++) {
            const HostBatch& b = dl.next();
            for (int i = 0; i < B; i++) refs.push_back({b.samples[i].epoch, b.samples[i].shard, b.samples[i].token_offset});
        }
        return refs;
    };
    auto a = run(123, 0), b = run(123, 4), c = run(124, 0);
    EXPECT_EQ(a, b) << "same seed, different prefetch: the sequence must not change";
    EXPECT_NE(a, c) << "different seeds gave the same sequence";

    SampleSchedule s(config(ds.pattern(), B, T, 2000, true, 123));
    uint64_t S = s.samples_per_epoch();
    std::set<std::vector<uint32_t>> orders;
    for (uint64_t e = 0; e < 4; e++) {
        std::vector<std::pair<uint32_t, int64_t>> epoch_e(S), epoch_next(S);
        for (uint64_t i = 0; i < S; i++) epoch_e[i] = {std::get<1>(a[e * S + i]), std::get<2>(a[e * S + i])};
        orders.insert(s.shard_order(e));
        if (e < 3) {
            for (uint64_t i = 0; i < S; i++) epoch_next[i] = {std::get<1>(a[(e + 1) * S + i]), std::get<2>(a[(e + 1) * S + i])};
            EXPECT_NE(epoch_e, epoch_next) << "epochs " << e << " and " << e + 1 << " have the same order";
        }
        // Within a shard the order is not the file order.
        std::vector<int64_t> first_shard;
        for (uint64_t i = 0; i < S && std::get<1>(a[e * S + i]) == std::get<1>(a[e * S]); i++) first_shard.push_back(std::get<2>(a[e * S + i]));
        EXPECT_FALSE(std::is_sorted(first_shard.begin(), first_shard.end()));
    }
    EXPECT_GT(orders.size(), 1u) << "the shard order never changed over 4 epochs";
    // Each shard's own sample order is drawn afresh every epoch.
    std::map<std::pair<uint64_t, uint32_t>, std::vector<int64_t>> per_shard;
    for (const Key& k : a) per_shard[{std::get<0>(k), std::get<1>(k)}].push_back(std::get<2>(k));
    for (uint32_t sh = 0; sh < ds.paths.size(); sh++) {
        for (uint64_t e = 0; e < 3; e++) {
            const auto& now = per_shard[std::make_pair(e, sh)];
            const auto& next = per_shard[std::make_pair(e + 1, sh)];
            EXPECT_NE(now, next) << "shard " << sh << " epochs " << e << ", " << e + 1;
        }
    }
}

TEST(Shuffle, GeneratorIsPinned) {
    // splitmix64's published first outputs for seed 0: a different build must not reorder the data.
    SplitMix64 r(0);
    EXPECT_EQ(r.next(), 0xe220a8397b1dcdafull);
    EXPECT_EQ(r.next(), 0x6e789e6aa1b965f4ull);
    EXPECT_EQ(r.next(), 0x06c45d188009454full);
    std::vector<uint32_t> p(1000);
    seeded_permutation(99, p.data(), p.size());
    std::vector<uint32_t> sorted = p;
    std::sort(sorted.begin(), sorted.end());
    for (uint32_t i = 0; i < 1000; i++) ASSERT_EQ(sorted[i], i);
    std::vector<uint32_t> q(1000);
    seeded_permutation(99, q.data(), q.size());
    EXPECT_EQ(p, q);
    seeded_permutation(100, q.data(), q.size());
    EXPECT_NE(p, q);
    // below() stays in range for awkward bounds.
    SplitMix64 g(5);
    for (uint64_t n : {1ull, 2ull, 3ull, 1000003ull, (1ull << 63) + 1}) {
        for (int i = 0; i < 100; i++) ASSERT_LT(g.below(n), n);
    }
}

// The data order itself, as literal numbers, so that any change to the shuffle (the generator, the
// Fisher-Yates walk, the seed derivation per epoch and shard, the cut into batches) fails here and not
// only in the PyTorch comparison. The same numbers come out of dev/train_gpt2_torch.py's port.
TEST(Shuffle, PermutationsArePinned) {
    struct Case {
        uint64_t seed;
        size_t n;
        std::vector<uint32_t> first;
    };
    const std::vector<Case> cases = {
        {1, 4, {2, 0, 3, 1}},
        {1337, 4, {1, 0, 2, 3}},
        {0, 10, {6, 3, 2, 9, 8, 1, 4, 7, 0, 5}},
        {1337, 10, {7, 9, 3, 6, 4, 0, 1, 8, 2, 5}},
        {~0ull, 7, {5, 4, 6, 2, 1, 3, 0}},
        {42, 1000, {650, 152, 78, 670, 854, 316, 525, 677, 361, 796}},
        {7, 1000003, {133439, 825032, 899590, 615508, 152549, 893959, 703711, 697378, 418767, 560718}},
    };
    for (const Case& c : cases) {
        std::vector<uint32_t> p(c.n);
        seeded_permutation(c.seed, p.data(), c.n);
        EXPECT_EQ(std::vector<uint32_t>(p.begin(), p.begin() + c.first.size()), c.first)
            << "seed " << c.seed << " n " << c.n;
    }
    uint32_t one = 99;
    seeded_permutation(5, &one, 1);
    EXPECT_EQ(one, 0u);
}

TEST(Shuffle, DataLoaderOrderIsPinned) {
    DataSet ds({211, 500, 96, 333, 1000, 157}, 3000);
    SampleSchedule s(config(ds.pattern(), 3, 7, 3000, true, 1337));
    ASSERT_EQ(s.samples_per_epoch(), 325u);
    EXPECT_EQ(s.shard_order(0), (std::vector<uint32_t>{3, 0, 1, 4, 5, 2}));
    EXPECT_EQ(s.shard_order(1), (std::vector<uint32_t>{1, 0, 4, 2, 3, 5}));
    EXPECT_EQ(s.shard_order(2), (std::vector<uint32_t>{1, 5, 2, 3, 4, 0}));
    EXPECT_EQ(s.shard_order(3), (std::vector<uint32_t>{1, 0, 4, 5, 3, 2}));
    EXPECT_EQ(s.shard_order(4), (std::vector<uint32_t>{3, 4, 1, 5, 2, 0}));
    EXPECT_EQ(s.shard_order(5), (std::vector<uint32_t>{2, 1, 5, 3, 0, 4}));
    EXPECT_EQ(s.shard_rng_seed(0, 0), 0xa7049b37d6e38dd2ull);
    EXPECT_EQ(s.shard_rng_seed(0, 5), 0x4ad6f1599b21e656ull);
    EXPECT_EQ(s.shard_rng_seed(1, 2), 0x7540a999afcd2057ull);
    EXPECT_EQ(s.shard_rng_seed(2, 0), 0x8d72c388f193eeb9ull);
    EXPECT_EQ(s.shard_rng_seed(3, 4), 0x2ae6502790987a88ull);
    const std::vector<std::pair<uint32_t, int64_t>> first = {{3, 119}, {3, 112}, {3, 224}, {3, 210}, {3, 308}, {3, 189},
                                                             {3, 238}, {3, 42},  {3, 301}, {3, 294}, {3, 91},  {3, 147}};
    // The global batch that holds the last sample of epoch 0 and the first ones of epoch 1, and the next.
    const std::vector<Key> boundary = {{0, 2, 42}, {1, 1, 469}, {1, 1, 413}, {1, 1, 476}, {1, 1, 196}, {1, 1, 63}};
    for (int W : {1, 2}) {
        for (int r = 0; r < W; r++) {
            SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(W));
            DataLoader dl(config(ds.pattern(), 3, 7, 3000, true, 1337, r, W, r));
            for (size_t k = 0; k < first.size() / (3 * W); k++) {
                const HostBatch& b = dl.next();
                for (int i = 0; i < 3; i++) {
                    const auto& want = first[k * 3 * W + r * 3 + i];
                    EXPECT_EQ(b.samples[i].shard, want.first) << "batch " << k << " row " << i;
                    EXPECT_EQ(b.samples[i].token_offset, want.second) << "batch " << k << " row " << i;
                }
            }
            dl.seek(324 / (3 * W));
            const HostBatch& b = dl.next();
            for (int i = 0; i < 3; i++) {
                const Key& want = boundary[r * 3 + i];
                EXPECT_EQ(b.samples[i].epoch, std::get<0>(want)) << "row " << i;
                EXPECT_EQ(b.samples[i].shard, std::get<1>(want)) << "row " << i;
                EXPECT_EQ(b.samples[i].token_offset, std::get<2>(want)) << "row " << i;
            }
        }
    }
}

// A loader restored from a state blob yields the batches of an uninterrupted one, at cut points inside
// a shard, across a shard boundary and across the epoch boundary, with and without prefetch, and on
// another rank.
TEST(State, RestoreGivesTheUninterruptedSequence) {
    DataSet ds({260, 190, 330, 175}, 4000);
    const int B = 3, T = 6, W = 2;
    for (int rank = 0; rank < W; rank++) {
        DataLoader ref(config(ds.pattern(), B, T, 4000, true, 9, rank, W, 3));
        const SampleSchedule& s = ref.schedule();
        uint64_t total = 3 * s.batches_per_epoch() + 5;
        std::vector<std::vector<uint32_t>> seq;
        std::vector<std::vector<uint32_t>> shards_of;
        for (uint64_t k = 0; k < total; k++) {
            const HostBatch& b = ref.next();
            seq.push_back(batch_tokens(b));
            std::vector<uint32_t> sh;
            for (int i = 0; i < B; i++) sh.push_back(b.samples[i].shard);
            shards_of.push_back(sh);
        }
        std::vector<uint64_t> cuts = {0, 1, 2, s.batches_per_epoch(), s.batches_per_epoch() + 1, 2 * s.batches_per_epoch() + 1};
        for (uint64_t k = 1; k < total; k++) {
            if (shards_of[k].front() != shards_of[k].back() || shards_of[k].front() != shards_of[k - 1].back()) {
                cuts.push_back(k);  // a batch that spans two shards, or the first one in a new shard
                if (cuts.size() > 12) break;
            }
        }
        for (uint64_t cut : cuts) {
            SCOPED_TRACE("rank " + std::to_string(rank) + " cut at batch " + std::to_string(cut));
            DataLoader a(config(ds.pattern(), B, T, 4000, true, 9, 0, W, cut % 2 ? 0 : 2));
            for (uint64_t k = 0; k < cut; k++) a.next();
            std::vector<uint8_t> blob = a.state();
            // The state is the same whichever rank saved it.
            EXPECT_EQ(blob, ref.state_at(cut));
            DataLoader b(config(ds.pattern(), B, T, 4000, true, 9, rank, W, cut % 2 ? 3 : 0));
            b.next();  // move away first: restore must not depend on where the loader was
            b.restore(blob);
            EXPECT_EQ(b.position(), cut);
            for (uint64_t k = cut; k < std::min(total, cut + 2 * s.batches_per_epoch() + 3); k++) {
                ASSERT_EQ(batch_tokens(b.next()), seq[k]) << "batch " << k;
            }
        }
    }
}

TEST(State, RestoreWhileBuffersAreHeldAndThreadIsAhead) {
    DataSet ds({500, 400}, 1000);
    DataLoader dl(config(ds.pattern(), 2, 5, 1000, true, 3, 0, 1, 4));
    std::vector<std::vector<uint32_t>> seq;
    for (int k = 0; k < 30; k++) seq.push_back(batch_tokens(dl.next()));
    std::vector<uint8_t> at10 = dl.state_at(10);
    dl.acquire();
    dl.acquire();
    EXPECT_EQ(dl.held(), 3);
    dl.restore(at10);
    EXPECT_EQ(dl.held(), 0);
    for (int k = 10; k < 30; k++) ASSERT_EQ(batch_tokens(dl.next()), seq[k]);
}

TEST(State, BlobsForOtherDataOrGeometryAreRefused) {
    DataSet ds({300, 200, 250}, 1000);
    DataLoader dl(config(ds.pattern(), 2, 8, 1000, true, 5, 0, 2));
    for (int k = 0; k < 7; k++) dl.next();
    std::vector<uint8_t> blob = dl.state();

    auto refused = [&](DataLoaderConfig c, const std::vector<std::string>& parts) {
        DataLoader other(c);
        expect_error([&] { other.restore(blob); }, kExitData, parts);
    };
    refused(config(ds.pattern(), 3, 8, 1000, true, 5, 0, 2), {"B=2 T=8 W=2", "B=3 T=8 W=2"});
    refused(config(ds.pattern(), 2, 9, 1000, true, 5, 0, 2), {"T=8", "T=9"});
    refused(config(ds.pattern(), 2, 8, 1000, true, 5, 0, 3), {"W=2", "W=3"});
    refused(config(ds.pattern(), 2, 8, 1000, true, 6, 0, 2), {"seed=5", "seed=6"});
    refused(config(ds.pattern(), 2, 8, 1000, false, 5, 0, 2), {"shuffle=on", "shuffle=off"});
    refused(config(ds.paths[0] + "," + ds.paths[1], 2, 8, 1000, true, 5, 0, 2), {"3 shard(s)", "gives 2 shard(s)"});
    // Same count of shards and tokens, different names (the order of the list changed).
    refused(config(ds.paths[1] + "," + ds.paths[0] + "," + ds.paths[2], 2, 8, 1000, true, 5, 0, 2), {"not the same"});

    DataLoader same(config(ds.pattern(), 2, 8, 1000, true, 5, 1, 2));
    expect_error([&] { same.restore(std::vector<uint8_t>(blob.begin(), blob.end() - 1)); }, kExitData, {"corrupt"});
    for (size_t i = 12; i < blob.size(); i += 5) {
        std::vector<uint8_t> bad = blob;
        bad[i] ^= 0x10;
        expect_error([&] { same.restore(bad); }, kExitData, {"DataLoader state"});
    }
    std::vector<uint8_t> magic = blob;
    magic[0] = 'X';
    expect_error([&] { same.restore(magic); }, kExitData, {"magic"});
    expect_error([&] { same.restore({}); }, kExitData, {"magic"});
    same.restore(blob);
    EXPECT_EQ(same.position(), 7u);
}

// Shards with the same names and the same sample count as when the state was saved, but another
// token count: the data changed (a sample's last tokens, at least), so the state must not be restored.
TEST(State, BlobForDataWithOtherTokenCountsIsRefused) {
    DataSet ds({300, 200, 250}, 1000);
    const int B = 2, T = 8;
    DataLoader dl(config(ds.pattern(), B, T, 1000, true, 5, 0, 2));
    for (int k = 0; k < 7; k++) dl.next();
    const std::vector<uint8_t> blob = dl.state();
    const uint64_t samples = dl.schedule().samples_per_epoch();
    // 300 tokens hold (300 - 1) / 8 = 37 samples; so do 297 to 304.
    for (size_t tokens : {297, 301, 304}) {
        SCOPED_TRACE(std::to_string(tokens) + " tokens in shard_000.bin");
        const std::vector<uint32_t> t = random_tokens(tokens, 1000, 77);
        write_token_shard(ds.paths[0], t.data(), t.size(), 1);
        DataLoader other(config(ds.pattern(), B, T, 1000, true, 5, 1, 2));
        ASSERT_EQ(other.schedule().samples_per_epoch(), samples);
        expect_error([&] { other.restore(blob); }, kExitData,
                     {"3 shard(s) holding 92 samples", "gives 3 shard(s) holding 92 samples", "not the same"});
    }
    write_token_shard(ds.paths[0], ds.tokens[0].data(), ds.tokens[0].size(), 1);
    DataLoader same(config(ds.pattern(), B, T, 1000, true, 5, 1, 2));
    same.restore(blob);
    EXPECT_EQ(same.position(), 7u);
}

namespace {

// One sample as a run hands it out: where it lies (epoch, shard, offset) and its T+1 tokens.
using StreamSample = std::pair<Key, std::vector<uint32_t>>;

// The next `batches` global batches of a run whose ranks are `ranks`, as one stream: rank 0's rows,
// then rank 1's, ... of each global batch in turn. Every row is checked against the files.
std::vector<StreamSample> next_samples(std::vector<std::unique_ptr<DataLoader>>& ranks, uint64_t batches,
                                       const std::vector<std::vector<uint32_t>>& files) {
    std::vector<StreamSample> out;
    for (uint64_t k = 0; k < batches; k++) {
        uint64_t index = ranks[0]->position();
        for (auto& dl : ranks) {
            const HostBatch& b = dl->next();
            EXPECT_EQ(b.index, index);
            expect_rows_match_files(b, dl->schedule(), files);
            std::vector<uint32_t> tokens = batch_tokens(b);
            for (int i = 0; i < b.B; i++) {
                auto row = tokens.begin() + ptrdiff_t(i) * (b.T + 1);
                out.push_back({{b.samples[i].epoch, b.samples[i].shard, b.samples[i].token_offset},
                               std::vector<uint32_t>(row, row + b.T + 1)});
            }
        }
    }
    return out;
}

// Rewrites a state blob's checksum (64-bit FNV-1a of every byte before it, little-endian), so that a
// test can change a field and reach the check behind the checksum.
void reseal(std::vector<uint8_t>& blob) {
    const uint64_t h = fnv1a64(blob.data(), blob.size() - 8);
    for (int i = 0; i < 8; i++) blob[blob.size() - 8 + i] = uint8_t(h >> (8 * i));
}

// Byte offsets of fields of the state blob (version 1).
constexpr size_t kBlobWorld = 20, kBlobSample = 76;

void set_u32(std::vector<uint8_t>& blob, size_t at, uint32_t v) {
    for (int i = 0; i < 4; i++) blob.at(at + i) = uint8_t(v >> (8 * i));
}

}  // namespace

// A state saved by a W=2 run, restored with allow_world_change on W' = 1, 3 and 4 ranks wherever its
// sample position is a whole number of the new global batches, continues the W=2 run's stream: the
// same samples with the same tokens in the same order, across shard and epoch boundaries, shuffled and
// in order. Where the position does not divide, the restore is refused.
TEST(State, RestoreOnAnotherWorldSizeContinuesTheSameStream) {
    DataSet ds({260, 190, 330, 175}, 4000);
    const int B = 3, T = 6, W = 2;
    for (bool shuffle : {true, false}) {
        SCOPED_TRACE(shuffle ? "shuffled" : "in order");
        auto run = [&](int world, uint64_t salt) {
            std::vector<std::unique_ptr<DataLoader>> ranks;
            for (int r = 0; r < world; r++) {
                int prefetch = (r + salt) % 2 ? 3 : 0;
                ranks.push_back(std::make_unique<DataLoader>(config(ds.pattern(), B, T, 4000, shuffle, 9, r, world, prefetch)));
            }
            return ranks;
        };
        auto ref = run(W, 0);
        const SampleSchedule& s = ref[0]->schedule();
        const uint64_t bpe = s.batches_per_epoch();
        // 60 batches of W=2 are 120 of W=1, 40 of W=3 and 30 of W=4, and reach past an epoch boundary.
        const uint64_t window = 60;
        ASSERT_GT(window * B * W, s.samples_per_epoch());
        ASSERT_NE(s.samples_per_epoch() % (B * W), 0u) << "this test wants an epoch tail that is carried over";
        uint64_t total = 2 * bpe + 3 + window;
        std::vector<StreamSample> stream = next_samples(ref, total, ds.tokens);

        // Inside the first shard, around the global batch that straddles the end of epoch 0, and around
        // the first global batches that span two shards (each with its neighbours, so every residue
        // modulo 3 and 4 occurs).
        std::vector<uint64_t> cuts = {0, 1, 2, 3, bpe - 1, bpe, bpe + 1, bpe + 2, 2 * bpe, 2 * bpe + 1};
        int spanning = 0;
        for (uint64_t k = 1; k + 1 < 2 * bpe && spanning < 3; k++) {
            uint32_t first = std::get<1>(stream[k * B * W].first), last = std::get<1>(stream[(k + 1) * B * W - 1].first);
            if (first != last) {
                cuts.insert(cuts.end(), {k - 1, k, k + 1});
                spanning++;
            }
        }
        ASSERT_EQ(spanning, 3);
        std::map<int, int> restored, refused;
        for (uint64_t cut : cuts) {
            SCOPED_TRACE("cut at W=2 batch " + std::to_string(cut));
            DataLoader saver(config(ds.pattern(), B, T, 4000, shuffle, 9, int(cut % W), W, 2));
            for (uint64_t k = 0; k < cut; k++) saver.next();
            std::vector<uint8_t> blob = saver.state();
            EXPECT_EQ(SampleSchedule::state_world(blob), uint32_t(W));
            uint64_t sample = cut * B * W;
            for (int W2 : {1, 3, 4}) {
                SCOPED_TRACE("restored on W=" + std::to_string(W2));
                auto ranks = run(W2, cut);
                if (sample % (B * W2) != 0) {
                    for (auto& dl : ranks) {
                        expect_error([&] { dl->restore(blob, true); }, kExitData,
                                     {"W=2 ranks", format("W=%d ranks", W2), format("sample %llu", (unsigned long long)sample),
                                      format("B*W = %d*%d = %d", B, W2, B * W2), "not a multiple"});
                    }
                    refused[W2]++;
                    continue;
                }
                uint64_t converted = sample / (B * W2);
                for (auto& dl : ranks) {
                    dl->next();  // move away first: restore must not depend on where the loader was
                    dl->restore(blob, true);
                    EXPECT_EQ(dl->position(), converted);
                }
                std::vector<StreamSample> got = next_samples(ranks, window * W / W2, ds.tokens);
                ASSERT_EQ(got.size(), window * B * W);
                for (size_t i = 0; i < got.size(); i++) {
                    ASSERT_EQ(got[i], stream[sample + i]) << "sample " << sample + i << " of the stream";
                }
                // The new run saves its own W, and its state goes back to W=2 at the same sample.
                std::vector<uint8_t> back = ranks[0]->schedule().encode_state(converted);
                EXPECT_EQ(SampleSchedule::state_world(back), uint32_t(W2));
                DataLoader w2(config(ds.pattern(), B, T, 4000, shuffle, 9, 1, W, 0));
                w2.restore(back, true);
                EXPECT_EQ(w2.position(), cut);
                EXPECT_EQ(w2.state(), blob);
                restored[W2]++;
            }
        }
        EXPECT_EQ(restored[1], int(cuts.size()));
        EXPECT_EQ(refused[1], 0);
        for (int W2 : {3, 4}) {
            EXPECT_GT(restored[W2], 3) << "W=" << W2;
            EXPECT_GT(refused[W2], 3) << "W=" << W2;
        }
    }
}

TEST(State, WorldChangeIsOptInAndKeepsEveryOtherCheck) {
    DataSet ds({300, 200, 250}, 1000);
    DataLoader dl(config(ds.pattern(), 2, 8, 1000, true, 5, 0, 2));
    for (int k = 0; k < 7; k++) dl.next();
    std::vector<uint8_t> blob = dl.state();  // 7 global batches of 2*2: sample 28

    // Without the opt-in another W is refused as before, by the host loader's restore and decode_state.
    for (int W2 : {1, 4, 7}) {
        DataLoader other(config(ds.pattern(), 2, 8, 1000, true, 5, 0, W2));
        std::vector<std::string> parts = {"B=2 T=8 W=2", format("B=2 T=8 W=%d", W2), "resume with the same geometry"};
        expect_error([&] { other.restore(blob); }, kExitData, parts);
        expect_error([&] { other.restore(blob, false); }, kExitData, parts);
        expect_error([&] { other.schedule().decode_state(blob); }, kExitData, parts);
    }

    // With it: 28 samples are 28 global batches of W=1 and 2 of W=7; not a whole number for W=3 or 4.
    for (auto [W2, want] : std::vector<std::pair<int, uint64_t>>{{1, 14}, {7, 2}, {2, 7}}) {
        DataLoader other(config(ds.pattern(), 2, 8, 1000, true, 5, W2 - 1, W2));
        other.restore(blob, true);
        EXPECT_EQ(other.position(), want) << "W=" << W2;
        EXPECT_EQ(other.schedule().decode_state(blob, true), want);
    }
    for (int W2 : {3, 4}) {
        DataLoader other(config(ds.pattern(), 2, 8, 1000, true, 5, 0, W2));
        other.seek(5);
        expect_error([&] { other.restore(blob, true); }, kExitData,
                     {"saved by a run on W=2 ranks after 7 global batches of B*W = 2*2 samples", "at sample 28 of the stream",
                      format("runs on W=%d ranks", W2), format("28 is not a multiple of its global batch of B*W = 2*%d = %d", W2, 2 * W2),
                      "cannot continue the stream exactly"});
        EXPECT_EQ(other.position(), 5u) << "a refused restore must leave the loader where it was";
    }

    // Every other check still holds with the opt-in.
    auto refused = [&](DataLoaderConfig c, const std::vector<std::string>& parts) {
        DataLoader other(c);
        expect_error([&] { other.restore(blob, true); }, kExitData, parts);
    };
    refused(config(ds.pattern(), 1, 8, 1000, true, 5, 0, 4), {"B=2 T=8 W=2", "B=1 T=8 W=4"});
    refused(config(ds.pattern(), 2, 9, 1000, true, 5, 0, 1), {"T=8", "T=9"});
    refused(config(ds.pattern(), 2, 8, 1000, true, 6, 0, 1), {"seed=5", "seed=6"});
    refused(config(ds.pattern(), 2, 8, 1000, false, 5, 0, 1), {"shuffle=on", "shuffle=off"});
    refused(config(ds.paths[0] + "," + ds.paths[1], 2, 8, 1000, true, 5, 0, 1), {"3 shard(s)", "gives 2 shard(s)"});
    refused(config(ds.paths[1] + "," + ds.paths[0] + "," + ds.paths[2], 2, 8, 1000, true, 5, 0, 1), {"not the same"});

    // The position cross-check runs at the converted batch: a recorded sample that disagrees (the blob
    // resealed, so that only this check can catch it) is refused on the new W as on the old one.
    std::vector<uint8_t> moved = blob;
    moved[kBlobSample] ^= 1;
    reseal(moved);
    DataLoader one(config(ds.pattern(), 2, 8, 1000, true, 5, 0, 1));
    expect_error([&] { one.restore(moved, true); }, kExitData,
                 {"state at batch 7 of a W=2 run (batch 14 of this W=1 loader) records", "incompatible build"});
    DataLoader two(config(ds.pattern(), 2, 8, 1000, true, 5, 1, 2));
    expect_error([&] { two.restore(moved, true); }, kExitData, {"state at batch 7 records", "incompatible build"});
    expect_error([&] { two.restore(moved); }, kExitData, {"state at batch 7 records", "incompatible build"});

    // A blob that claims W=0 converts to nothing: refused as a geometry mismatch.
    std::vector<uint8_t> zero = blob;
    set_u32(zero, kBlobWorld, 0);
    reseal(zero);
    expect_error([&] { one.restore(zero, true); }, kExitData, {"W=0", "resume with the same geometry"});
}

TEST(State, StateWorldReadsTheRanksAndRejectsABadBlob) {
    DataSet ds({300, 200}, 1000);
    for (int W : {1, 2, 5}) {
        DataLoader dl(config(ds.pattern(), 2, 8, 1000, true, 5, W - 1, W));
        for (int k = 0; k < 3; k++) dl.next();
        EXPECT_EQ(SampleSchedule::state_world(dl.state()), uint32_t(W));
        EXPECT_EQ(SampleSchedule::state_world(dl.state_at(0)), uint32_t(W));
    }
    DataLoader dl(config(ds.pattern(), 2, 8, 1000, true, 5, 1, 3));
    std::vector<uint8_t> blob = dl.state_at(4);
    for (size_t i = 12; i < blob.size(); i += 3) {
        std::vector<uint8_t> bad = blob;
        bad[i] ^= 0x04;
        expect_error([&] { SampleSchedule::state_world(bad); }, kExitData, {"corrupt", "checksum"});
    }
    expect_error([&] { SampleSchedule::state_world(std::vector<uint8_t>(blob.begin(), blob.end() - 1)); }, kExitData,
                 {"corrupt"});
    std::vector<uint8_t> magic = blob;
    magic[3] = 'X';
    expect_error([&] { SampleSchedule::state_world(magic); }, kExitData, {"magic"});
    expect_error([&] { SampleSchedule::state_world({}); }, kExitData, {"magic"});
    std::vector<uint8_t> version = blob;
    version[8] = 2;
    expect_error([&] { SampleSchedule::state_world(version); }, kExitData, {"version 2", "reads version 1"});
    std::vector<uint8_t> zero = blob;
    set_u32(zero, kBlobWorld, 0);
    reseal(zero);
    expect_error([&] { SampleSchedule::state_world(zero); }, kExitData, {"W=0", "corrupt"});
    // Sealed but too short to hold W: the magic and version of a real blob, then a checksum.
    std::vector<uint8_t> stub(blob.begin(), blob.begin() + 16);
    stub.resize(24);
    reseal(stub);
    expect_error([&] { SampleSchedule::state_world(stub); }, kExitData, {"truncated"});
    EXPECT_EQ(SampleSchedule::state_world(blob), 3u);
}

TEST(Prefetch, RingHandsOutInOrderAndLimitsHeldBuffers) {
    DataSet ds({1000}, 600);
    int allocations = 0, releases = 0;
    {
        DataLoaderConfig c = config(ds.pattern(), 2, 7, 600, true, 1, 0, 1, 3);
        c.allocator.allocate = [&](size_t n) {
            allocations++;
            return std::malloc(n);
        };
        c.allocator.release = [&](void* p) {
            releases++;
            std::free(p);
        };
        DataLoader dl(c);
        DataLoader sync(config(ds.pattern(), 2, 7, 600, true, 1, 0, 1, 0));
        EXPECT_EQ(allocations, 3);
        std::vector<const HostBatch*> held;
        for (int k = 0; k < 3; k++) held.push_back(&dl.acquire());
        expect_error([&] { dl.acquire(); }, kExitUsage, {"all 3 buffers are held"});
        for (int k = 0; k < 3; k++) {
            EXPECT_EQ(held[k]->index, uint64_t(k));
            EXPECT_EQ(batch_tokens(*held[k]), batch_tokens(sync.next()));
        }
        dl.release();
        EXPECT_EQ(dl.acquire().index, 3u);
        EXPECT_EQ(batch_tokens(*held[1]), [&] {
            DataLoader s(config(ds.pattern(), 2, 7, 600, true, 1, 0, 1, 0));
            s.seek(1);
            return batch_tokens(s.next());
        }()) << "a held buffer was overwritten while held";
        for (int k = 0; k < 3; k++) dl.release();
        expect_error([&] { dl.release(); }, kExitUsage, {"no batch is held"});
        EXPECT_EQ(sync.held(), 1);
        expect_error([&] { sync.acquire(); }, kExitUsage, {"still held"});
    }
    EXPECT_EQ(releases, 3);
}

// Offsets past 4 GiB: sparse shards with real tokens around the 4 GiB byte offset and at the end.
// Holes read as token 0, a valid id, so the whole file validates.
namespace {
void write_sparse_shard(const std::string& path, int version, uint64_t n, const std::vector<std::pair<int64_t, std::vector<uint32_t>>>& runs) {
    int bpt = shard_bytes_per_token(version);
    File f(path, File::Mode::Write);
    int32_t h[kShardHeaderInts] = {};
    h[0] = kShardMagic;
    h[1] = version;
    h[2] = int32_t(uint32_t(n & 0xffffffffu));
    h[3] = version == 2 ? int32_t(uint32_t(n >> 32)) : 0;
    f.write_all(h, sizeof(h));
    f.truncate(shard_token_byte_offset(int64_t(n), bpt));
    for (const auto& [at, toks] : runs) {
        f.seek(shard_token_byte_offset(at, bpt));
        if (bpt == 2) {
            std::vector<uint16_t> v(toks.begin(), toks.end());
            f.write_all(v.data(), v.size() * 2);
        } else {
            f.write_all(toks.data(), toks.size() * 4);
        }
    }
    f.close();
}
}  // namespace

TEST(LargeFiles, OffsetsPast4GiBAreReadAtTheRightPlace) {
    TempDir dir;
    struct Case {
        const char* name;
        int version;
        uint64_t n;
        int T;
    };
    // v1 at llm.c's largest count (the file ends just past 4 GiB; T = 1002 makes the last sample reach
    // past it); v2 at 6 GiB; v2 past 2^32 tokens, which needs header[3].
    std::vector<Case> cases = {{"v1_max.bin", 1, uint64_t(kShardV1MaxTokens), 1002},
                               {"v2_6g.bin", 2, 1536ull << 20, 1024},
                               {"v2_16g.bin", 2, (1ull << 32) + 5000, 1024}};
    const int64_t k4G = int64_t(1) << 32;
    for (const Case& c : cases) {
        SCOPED_TRACE(c.name);
        const int T = c.T;
        int bpt = shard_bytes_per_token(c.version);
        uint64_t samples = (c.n - 1) / T;
        uint64_t last = samples - 1;
        // The sample holding the token at byte 4 GiB, and the last sample.
        uint64_t cross = uint64_t((k4G - kShardHeaderBytes) / bpt) / T;
        ASSERT_LE(cross, last);
        std::map<uint64_t, std::vector<uint32_t>> want;
        want[cross] = random_tokens(T + 1, 60000, 21);
        want[last] = random_tokens(T + 1, 60000, 22);
        std::vector<std::pair<int64_t, std::vector<uint32_t>>> runs;
        for (const auto& [k, toks] : want) runs.push_back({int64_t(k * T), toks});
        try {
            write_sparse_shard(dir.file(c.name), c.version, c.n, runs);
        } catch (const Error& e) {
            GTEST_SKIP() << "skipped: this file system cannot hold a sparse file of that size: " << e.what();
        }
        int64_t cross_byte = shard_token_byte_offset(int64_t(cross * T), bpt);
        EXPECT_LT(cross_byte, k4G);
        EXPECT_GT(cross_byte + int64_t(T + 1) * bpt, k4G);
        EXPECT_GT(shard_token_byte_offset(int64_t(last * T + T), bpt), k4G);

        DataLoader dl(config(dir.file(c.name), 1, T, 65536, false, 0, 0, 1, 2));
        ASSERT_EQ(dl.schedule().shards()[0].num_tokens, int64_t(c.n));
        ASSERT_EQ(dl.schedule().samples_per_epoch(), samples);
        for (const auto& [k, toks] : want) {
            dl.seek(k);
            const HostBatch& b = dl.next();
            EXPECT_EQ(b.samples[0].token_offset, int64_t(k * T));
            EXPECT_EQ(batch_tokens(b), toks) << "sample " << k;
        }
        // The sample before the crossing one lies in a hole, except its last token (the target), which is
        // the first token of the crossing sample.
        std::vector<uint32_t> before(T + 1, 0);
        before[T] = want[cross][0];
        dl.seek(cross - 1);
        EXPECT_EQ(batch_tokens(dl.next()), before);
        // A state blob past 4 GiB round-trips.
        DataLoader other(config(dir.file(c.name), 1, T, 65536, false, 0, 0, 1, 0));
        other.restore(dl.state_at(last));
        EXPECT_EQ(batch_tokens(other.next()), want[last]);
        std::filesystem::remove(dir.file(c.name));
    }
}

int main(int argc, char** argv) {
    ::testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
}
