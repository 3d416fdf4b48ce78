/*
CPU tests of the checkpoint format (llmc/checkpoint.h): the checksum, the manifest round trip, the
write/validate cycle on synthetic state, detection of truncation at many offsets and of a flipped bit in
every file, missing files, ignored .tmp directories, the choice of the newest valid checkpoint when the
newest is damaged, rotation (keep-last, keep-every, later steps left alone), and the refusal of
incompatible settings with a message naming what differs; several ranks writing one checkpoint
(concurrent writers, a missing rank, a stale part of an earlier attempt, a rank still busy with its part
when rank 0 publishes) and reading any rank's range back on another number of ranks, with damaged chunks
caught; the recorded layout read back, and re-sharding from every number of ranks to every other (with
layouts that do not tile the parameters refused by file). The GPU path (snapshot, async writer) is tested
in test_checkpoint_gpu.cu.
*/
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <stdio.h>

#include "llmc/checkpoint.h"
#include "llmc/utils.h"
#include "llmc/zero.h"
#include "test/expect_error.h"
#include "test/test_util.h"

using namespace llmc;
using llmc::test::random_bytes;
using llmc::test::random_floats;
using llmc::test::read_bytes;
using llmc::test::write_bytes;
using llmc::test::TempDir;

namespace {

constexpr size_t kSmallChunk = 1000;  // small and odd, so files have many chunks and a short last one

struct SyntheticState {
    std::vector<char> header, weights, moments;
    std::vector<uint8_t> loader;
};

SyntheticState make_state(uint64_t seed) {
    SyntheticState s;
    s.header = random_bytes(1024, seed);
    s.weights = random_bytes(12345, seed + 1);
    s.moments = random_bytes(7 * kSmallChunk, seed + 2);
    std::vector<char> l = random_bytes(61, seed + 3);
    s.loader.assign(l.begin(), l.end());
    return s;
}

std::vector<std::pair<std::string, std::string>> base_settings() {
    return {{"model", "maxT=64 V=50257 Vp=50304 L=2 NH=2 C=64"}, {"batch", "4"}, {"seq_len", "64"},
            {"train", "data/a_*.bin"}, {"max_steps", "100"}};
}

std::string write_checkpoint(const std::string& out, int64_t step, const SyntheticState& s) {
    CheckpointWriter w(out, step);
    w.add_file("model.bin", [&](File& f, const ChunkHook& hook) {
        write_chunked(f, s.header.data(), s.header.size(), hook, s.header.size());
        write_chunked(f, s.weights.data(), s.weights.size(), hook, kSmallChunk);
    });
    w.add_file("moments.bin", [&](File& f, const ChunkHook& hook) {
        write_chunked(f, s.moments.data(), s.moments.size(), hook, kSmallChunk);
    });
    CheckpointManifest m;
    m.settings = base_settings();
    m.blobs = {{"train_loader", s.loader}, {"empty", {}}};
    return w.commit(m);
}

// The newest checkpoint in out_dir that passes validate_checkpoint(deep), and why each newer one did not
// (the choice a resume makes, without its votes between ranks).
struct FoundCheckpoint {
    std::string path;  // empty: none valid
    CheckpointManifest manifest;
    std::vector<std::string> skipped;  // "<dir>: <why>"
};

FoundCheckpoint find_newest_valid(const std::string& out_dir, bool deep) {
    FoundCheckpoint found;
    for (const CheckpointEntry& e : list_checkpoints(out_dir)) {
        try {
            found.manifest = validate_checkpoint(e.path, deep);
            found.path = e.path;
            return found;
        } catch (const Error& err) {
            found.skipped.push_back(e.path + ": " + err.what());
        }
    }
    return found;
}

std::string error_of(const std::function<void()>& fn) {
    try {
        fn();
    } catch (const Error& e) {
        return e.what();
    }
    return "";
}

}  // namespace

TEST(Checksum, DetectsEveryFlippedBitAndDependsOnLength) {
    std::vector<char> data = random_bytes(203, 1);  // not a multiple of 8 or 32: exercises the tail
    const uint64_t base = checksum64(data.data(), data.size());
    EXPECT_EQ(base, checksum64(data.data(), data.size()));
    for (size_t i = 0; i < data.size(); i++) {
        for (int b = 0; b < 8; b++) {
            data[i] ^= char(1 << b);
            ASSERT_NE(checksum64(data.data(), data.size()), base) << "byte " << i << " bit " << b;
            data[i] ^= char(1 << b);
        }
    }
    std::vector<char> zeros(64, 0);
    EXPECT_NE(checksum64(zeros.data(), 63), checksum64(zeros.data(), 64)) << "trailing zeros must count";
    EXPECT_NE(checksum64(zeros.data(), 0), checksum64(zeros.data(), 1));
}

// A checkpoint an older version wrote with FP8 matmuls: its "fp8" setting or fp8_history.bin earn the note;
// a bf16 one's "fp8" of "none" (older versions recorded it) or no such setting earn none.
TEST(Manifest, OldFp8CheckpointsAreNamed) {
    CheckpointManifest m;
    EXPECT_EQ(removed_fp8_note(m), "");
    m.settings = {{"fp8", "none"}};
    EXPECT_EQ(removed_fp8_note(m), "");
    m.settings = {{"fp8", "qkv,fc"}};
    EXPECT_NE(removed_fp8_note(m).find("written with FP8 matmuls (qkv,fc)"), std::string::npos) << removed_fp8_note(m);
    m.settings = {{"fp8", "none"}};
    FileRecord f;
    f.name = kCkptFp8HistoryFile;
    m.files = {f};
    EXPECT_NE(removed_fp8_note(m).find("fp8_history.bin is ignored and the run goes on in bf16"), std::string::npos);
}

TEST(Manifest, RoundTripsAndRejectsDamage) {
    CheckpointManifest m;
    m.step = 42;
    m.settings = {{"model", "L=2 C=64"}, {"train", "data/x_*.bin,data/y_*.bin"}, {"empty", ""}};
    m.blobs = {{"loader", {0, 1, 2, 254, 255}}, {"nothing", {}}};
    FileRecord f;
    f.name = "a.bin";
    f.size = 30;
    f.chunks = {{0, 10, 0x1234}, {10, 20, 0xfedcba9876543210ull}};
    m.files = {f};
    const std::string text = encode_manifest(m);
    CheckpointManifest back = parse_manifest(text, "m");
    EXPECT_EQ(back.step, 42);
    EXPECT_EQ(back.settings, m.settings);
    EXPECT_EQ(back.blobs, m.blobs);
    ASSERT_EQ(back.files.size(), 1u);
    EXPECT_EQ(back.files[0].name, "a.bin");
    EXPECT_EQ(back.files[0].size, 30u);
    ASSERT_EQ(back.files[0].chunks.size(), 2u);
    EXPECT_EQ(back.files[0].chunks[1].sum, 0xfedcba9876543210ull);

    for (size_t cut = 0; cut < text.size(); cut++) {
        EXPECT_THROW(parse_manifest(text.substr(0, cut), "m"), Error) << "truncated at " << cut;
    }
    for (size_t i = 0; i < text.size(); i++) {
        std::string t = text;
        t[i] ^= 0x01;
        EXPECT_THROW(parse_manifest(t, "m"), Error) << "flipped bit in byte " << i;
    }
    CheckpointManifest multi_line = m;
    multi_line.settings.push_back({"bad", "two\nlines"});
    EXPECT_THROW(encode_manifest(multi_line), Error);
}

// Chunks must tile the file: from offset 0, each starting where the previous one ended, none empty,
// none past the end. Each manifest here is sealed with its own checksum (encode_manifest does not check
// the chunks), so the tiling check is the only thing that can refuse it.
TEST(Manifest, ChunksThatDoNotTileTheFileAreRefused) {
    auto manifest = [](std::vector<ChunkSum> chunks) {
        CheckpointManifest m;
        m.step = 3;
        FileRecord f;
        f.name = "w.bin";
        f.size = 30;
        f.chunks = std::move(chunks);
        m.files = {f};
        return encode_manifest(m);
    };
    const CheckpointManifest good = parse_manifest(manifest({{0, 10, 1}, {10, 12, 2}, {22, 8, 3}}), "good");
    ASSERT_EQ(good.files.size(), 1u);
    EXPECT_EQ(good.files[0].chunks.size(), 3u);
    const std::vector<std::pair<const char*, std::vector<ChunkSum>>> bad = {
        {"a gap between chunks", {{0, 10, 1}, {12, 18, 2}}},
        {"a gap at the start", {{2, 28, 1}}},
        {"a gap at the start and between", {{1, 9, 1}, {11, 19, 2}}},
        {"overlapping chunks", {{0, 10, 1}, {8, 22, 2}}},
        {"chunks out of order", {{10, 20, 1}, {0, 10, 2}}},
        {"an empty chunk", {{0, 10, 1}, {10, 0, 2}, {10, 20, 3}}},
        {"a chunk past the end", {{0, 10, 1}, {10, 21, 2}}},
        // offset + bytes wraps past 2^64 to 5, and the next chunk tiles on from there: without the check,
        // a reader would size a buffer for the 2^64 - 5 bytes (a std::length_error, not a named error).
        {"a chunk whose length wraps around", {{0, 10, 1}, {10, UINT64_MAX - 4, 2}, {5, 25, 3}}},
    };
    for (const auto& [what, chunks] : bad) {
        SCOPED_TRACE(what);
        const std::string text = manifest(chunks);
        expect_error([&] { parse_manifest(text, "bad.txt"); }, kExitData,
                     {"manifest 'bad.txt' line", "chunks must cover the file in order without gaps"});
    }
    expect_error([&] { parse_manifest(manifest({{0, 10, 1}, {10, 10, 2}}), "short.txt"); }, kExitData,
                 {"short.txt", "the chunks of 'w.bin' cover 20 of its 30 bytes"});
}

TEST(CheckpointFiles, WriteValidateAndReadBack) {
    TempDir dir("ckpt_rt");
    const std::string out = dir / "out";
    SyntheticState s = make_state(10);
    const std::string path = write_checkpoint(out, 7, s);
    EXPECT_EQ(path, out + "/ckpt_00000007");
    EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
    CheckpointManifest m = validate_checkpoint(path, /*deep=*/true);
    EXPECT_EQ(m.step, 7);
    ASSERT_NE(m.blob("train_loader"), nullptr);
    EXPECT_EQ(*m.blob("train_loader"), s.loader);
    EXPECT_EQ(m.blob("empty")->size(), 0u);
    EXPECT_EQ(*m.setting("batch"), "4");
    const FileRecord* model = m.file("model.bin");
    ASSERT_NE(model, nullptr);
    EXPECT_EQ(model->size, s.header.size() + s.weights.size());
    EXPECT_EQ(model->chunks.size(), 1u + (s.weights.size() + kSmallChunk - 1) / kSmallChunk);

    // Reading back through the verifier, chunk by chunk as written, gives the bytes.
    File f(path + "/model.bin", File::Mode::Read);
    ChunkVerifier v(*model, f.path());
    std::vector<char> header(s.header.size()), weights(s.weights.size());
    read_verified(f, header.data(), header.size(), v, *model);
    read_verified(f, weights.data(), weights.size(), v, *model);
    v.finish();
    EXPECT_EQ(header, s.header);
    EXPECT_EQ(weights, s.weights);

    // A verifier that saw only part of the file says so; one fed a different cut refuses it.
    ChunkVerifier partial(*model, f.path());
    f.seek(0);
    read_verified(f, header.data(), header.size(), partial, *model);
    EXPECT_NE(error_of([&] { partial.finish(); }).find("never checked"), std::string::npos);
    ChunkVerifier other_cut(*model, f.path());
    EXPECT_NE(error_of([&] { other_cut.check(weights.data(), 999, 1024); }).find("different chunk size"), std::string::npos);
}

TEST(CheckpointFiles, ReadsMatchTheRecordedChunksOnlyWhenCutTheSameWay) {
    TempDir dir("ckpt_plan");
    SyntheticState s = make_state(11);
    const std::string path = write_checkpoint(dir / "out", 7, s);
    const CheckpointManifest m = validate_checkpoint(path, /*deep=*/true);
    const FileRecord& model = *m.file("model.bin");
    const uint64_t h = s.header.size(), n = s.weights.size();
    // The weights were written in 1000-byte chunks after a header of its own: a reader cutting them the same
    // way matches, and so does one reading the header alone.
    EXPECT_TRUE(chunks_match_plan(model, h, n, ChunkPlanner(int64_t(h), n, kSmallChunk)));
    EXPECT_TRUE(chunks_match_plan(model, 0, h, ChunkPlanner(0, h, h)));
    EXPECT_TRUE(chunks_match_plan(model, 0, h, ChunkPlanner(0, h, h + 5)));  // one piece, the whole header
    // Another chunk size, the header and weights read as one span, a span not starting on a chunk, a span
    // ending short of the recorded last chunk, or direct I/O's aligned cut: all differ.
    EXPECT_FALSE(chunks_match_plan(model, h, n, ChunkPlanner(int64_t(h), n, 2 * kSmallChunk)));
    EXPECT_FALSE(chunks_match_plan(model, h, n, ChunkPlanner(int64_t(h), n, kSmallChunk - 1)));
    EXPECT_FALSE(chunks_match_plan(model, 0, h + n, ChunkPlanner(0, h + n, kSmallChunk)));
    EXPECT_FALSE(chunks_match_plan(model, h + 1, n - 1, ChunkPlanner(int64_t(h + 1), n - 1, kSmallChunk)));
    EXPECT_FALSE(chunks_match_plan(model, h, n - 1, ChunkPlanner(int64_t(h), n - 1, kSmallChunk)));
    EXPECT_FALSE(chunks_match_plan(model, h, n, ChunkPlanner(int64_t(h), n, 4 * kSmallChunk, 4000)));
    // A cut that meets every recorded chunk but goes on past the span is not the same cut either.
    const FileRecord& moments = *m.file("moments.bin");
    EXPECT_TRUE(chunks_match_plan(moments, 0, moments.size, ChunkPlanner(0, moments.size, kSmallChunk)));
    EXPECT_FALSE(chunks_match_plan(moments, 0, moments.size, ChunkPlanner(0, moments.size + 1, kSmallChunk)));
}

TEST(CheckpointFiles, TruncationAtManyOffsetsIsDetected) {
    TempDir dir("ckpt_trunc");
    const std::string out = dir / "out";
    const std::string path = write_checkpoint(out, 3, make_state(20));
    for (const char* name : {"model.bin", "moments.bin", "manifest.txt"}) {
        const std::string file = path + "/" + name;
        const std::vector<char> whole = read_bytes(file);
        for (size_t cut : {size_t(0), size_t(1), size_t(7), size_t(999), size_t(1000), size_t(1024), whole.size() / 2,
                           whole.size() - 1}) {
            if (cut >= whole.size()) continue;
            write_bytes(file, std::vector<char>(whole.begin(), whole.begin() + long(cut)));
            const std::string err = error_of([&] { validate_checkpoint(path, false); });
            EXPECT_FALSE(err.empty()) << name << " cut at " << cut;
            if (std::string(name) != "manifest.txt") {
                EXPECT_NE(err.find("truncated"), std::string::npos) << err;
                EXPECT_NE(err.find(name), std::string::npos) << err;
            }
        }
        write_bytes(file, whole);
        EXPECT_NO_THROW(validate_checkpoint(path, true));
    }
}

TEST(CheckpointFiles, FlippedBitInEveryFileIsDetected) {
    TempDir dir("ckpt_flip");
    const std::string out = dir / "out";
    const std::string path = write_checkpoint(out, 5, make_state(30));
    for (const char* name : {"model.bin", "moments.bin", "manifest.txt"}) {
        const std::string file = path + "/" + name;
        const std::vector<char> whole = read_bytes(file);
        for (size_t at : {size_t(0), size_t(1023), size_t(1024), whole.size() / 3, whole.size() - 1}) {
            for (int bit : {0, 7}) {
                std::vector<char> bad = whole;
                bad[at] ^= char(1 << bit);
                write_bytes(file, bad);
                const std::string err = error_of([&] { validate_checkpoint(path, true); });
                EXPECT_NE(err.find("corrupted"), std::string::npos) << name << " byte " << at << ": " << err;
            }
        }
        write_bytes(file, whole);
    }
    EXPECT_NO_THROW(validate_checkpoint(path, true));
}

TEST(CheckpointFiles, MissingFilesAreDetected) {
    TempDir dir("ckpt_missing");
    const std::string out = dir / "out";
    const std::string path = write_checkpoint(out, 5, make_state(40));
    std::filesystem::remove(path + "/moments.bin");
    EXPECT_NE(error_of([&] { validate_checkpoint(path, false); }).find("moments.bin"), std::string::npos);
    std::filesystem::remove(path + "/manifest.txt");
    EXPECT_NE(error_of([&] { validate_checkpoint(path, false); }).find("manifest.txt"), std::string::npos);
}

TEST(CheckpointDiscovery, NewestValidIsChosenAndTmpIgnored) {
    TempDir dir("ckpt_newest");
    const std::string out = dir / "out";
    EXPECT_TRUE(find_newest_valid(out, true).path.empty()) << "a missing directory has no checkpoint";
    write_checkpoint(out, 10, make_state(1));
    write_checkpoint(out, 20, make_state(2));
    const std::string newest = write_checkpoint(out, 30, make_state(3));
    // An interrupted save of a later step, and unrelated entries, are not checkpoints.
    std::filesystem::create_directories(out + "/ckpt_00000040.tmp");
    write_bytes(out + "/ckpt_00000040.tmp/model.bin", random_bytes(100, 1));
    std::filesystem::create_directories(out + "/ckpt_junk");
    write_bytes(out + "/log.jsonl", random_bytes(10, 2));

    FoundCheckpoint f = find_newest_valid(out, true);
    EXPECT_EQ(f.path, newest);
    EXPECT_EQ(f.manifest.step, 30);
    EXPECT_TRUE(f.skipped.empty());

    // Damage the newest: the one before is chosen, and the skip says why.
    std::vector<char> m = read_bytes(newest + "/moments.bin");
    m[m.size() / 2] ^= 0x10;
    write_bytes(newest + "/moments.bin", m);
    f = find_newest_valid(out, true);
    EXPECT_EQ(f.manifest.step, 20);
    ASSERT_EQ(f.skipped.size(), 1u);
    EXPECT_NE(f.skipped[0].find("ckpt_00000030"), std::string::npos);
    EXPECT_NE(f.skipped[0].find("corrupted"), std::string::npos) << f.skipped[0];
    // A shallow check does not read the data, so it takes the damaged one; the load's own checks catch it.
    EXPECT_EQ(find_newest_valid(out, false).manifest.step, 30);

    // A directory renamed to another step's name is refused.
    std::filesystem::rename(out + "/ckpt_00000020", out + "/ckpt_00000025");
    f = find_newest_valid(out, true);
    EXPECT_EQ(f.manifest.step, 10);
    EXPECT_EQ(f.skipped.size(), 2u);

    // A new save removes the stale .tmp directory.
    write_checkpoint(out, 50, make_state(5));
    EXPECT_FALSE(std::filesystem::exists(out + "/ckpt_00000040.tmp"));
}

TEST(CheckpointDiscovery, SavingTheSameStepAgainReplacesIt) {
    TempDir dir("ckpt_again");
    const std::string out = dir / "out";
    write_checkpoint(out, 8, make_state(1));
    SyntheticState s2 = make_state(2);
    const std::string path = write_checkpoint(out, 8, s2);
    EXPECT_NO_THROW(validate_checkpoint(path, true));
    EXPECT_EQ(*validate_checkpoint(path, true).blob("train_loader"), s2.loader);
    EXPECT_FALSE(std::filesystem::exists(path + ".tmp")) << "the replaced checkpoint is removed";
}

// On a file system that cannot swap two directories' names, the old checkpoint is renamed aside first and
// then removed; any other failure of the swap is an error naming both directories, and the old one stays.
TEST(CheckpointDiscovery, SameStepReplaceWithoutAnAtomicSwap) {
    TempDir dir("ckpt_again_noswap");
    const std::string out = dir / "out";
    const std::string path = write_checkpoint(out, 8, make_state(1));
    auto* const real = detail::swap_directories;
    detail::swap_directories = [](const char*, const char*) { errno = EINVAL; return -1; };
    SyntheticState s2 = make_state(2);
    EXPECT_NO_THROW(write_checkpoint(out, 8, s2));
    EXPECT_EQ(*validate_checkpoint(path, true).blob("train_loader"), s2.loader);
    EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
    EXPECT_FALSE(std::filesystem::exists(path + ".replaced.tmp")) << "the old checkpoint is removed";

    detail::swap_directories = [](const char*, const char*) { errno = EACCES; return -1; };
    const std::string err = error_of([&] { write_checkpoint(out, 8, make_state(3)); });
    detail::swap_directories = real;
    EXPECT_NE(err.find("cannot swap"), std::string::npos) << err;
    EXPECT_NE(err.find("ckpt_00000008.tmp"), std::string::npos) << err;
    EXPECT_EQ(*validate_checkpoint(path, true).blob("train_loader"), s2.loader) << "the old one stays";
    EXPECT_FALSE(std::filesystem::exists(path + ".tmp")) << "the failed save's directory is removed";
}

// While a step's checkpoint is replaced again and again, a reader never finds that step without a complete
// checkpoint (a replace that removed the old directory before the rename would leave a gap).
TEST(CheckpointDiscovery, ReplacingTheSameStepNeverLeavesItMissing) {
    TempDir dir("ckpt_again_atomic");
    const std::string out = dir / "out";
    const std::string path = write_checkpoint(out, 8, make_state(1));
    std::atomic<bool> done{false};
    std::atomic<int> checks{0}, gaps{0};
    std::string first_gap;
    std::thread reader([&] {
        while (!done.load()) {
            try {
                validate_checkpoint(path, false);
            } catch (const Error& e) {
                if (gaps++ == 0) first_gap = e.what();
            }
            checks++;
        }
    });
    for (int i = 0; i < 100; i++) write_checkpoint(out, 8, make_state(10 + i));
    done = true;
    reader.join();
    EXPECT_EQ(gaps.load(), 0) << "of " << checks.load() << " checks; first: " << first_gap;
    EXPECT_GT(checks.load(), 100);
    EXPECT_EQ(*validate_checkpoint(path, true).blob("train_loader"), make_state(109).loader);
    EXPECT_EQ(list_checkpoints(out).size(), 1u);
}

TEST(CheckpointRotation, KeepLastAndKeepEvery) {
    TempDir dir("ckpt_rotate");
    const std::string out = dir / "out";
    SyntheticState s = make_state(1);
    std::vector<std::string> removed_all;
    for (int step = 1; step <= 12; step++) {
        write_checkpoint(out, step, s);
        for (const std::string& r : rotate_checkpoints(out, /*keep_last=*/3, /*keep_every=*/5)) removed_all.push_back(r);
    }
    std::vector<int64_t> left;
    for (const CheckpointEntry& e : list_checkpoints(out)) left.push_back(e.step);
    EXPECT_EQ(left, (std::vector<int64_t>{12, 11, 10, 5}));
    EXPECT_EQ(removed_all.size(), 8u);
    // keep_last <= 0 keeps everything.
    EXPECT_TRUE(rotate_checkpoints(out, 0, 0).empty());
    EXPECT_EQ(list_checkpoints(out).size(), 4u);
    // Without keep_every, only the newest keep_last stay.
    rotate_checkpoints(out, 1, 0);
    ASSERT_EQ(list_checkpoints(out).size(), 1u);
    EXPECT_EQ(list_checkpoints(out)[0].step, 12);
}

// Checkpoints of later steps than the one just written (an earlier run that got further) neither count
// among the newest nor are removed: they must not push out what this run writes.
TEST(CheckpointRotation, LaterStepsFromAnEarlierRunDoNotPushOutNewOnes) {
    TempDir dir("ckpt_rotate_later");
    const std::string out = dir / "out";
    SyntheticState s = make_state(3);
    write_checkpoint(out, 90, s);
    write_checkpoint(out, 100, s);
    for (int step = 10; step <= 30; step += 10) {
        write_checkpoint(out, step, s);
        rotate_checkpoints(out, /*keep_last=*/2, /*keep_every=*/0, /*newest=*/step);
    }
    std::vector<int64_t> left;
    for (const CheckpointEntry& e : list_checkpoints(out)) left.push_back(e.step);
    EXPECT_EQ(left, (std::vector<int64_t>{100, 90, 30, 20}));
}

TEST(CheckpointSettings, IncompatibleSettingsAreNamedAndOthersNoted) {
    CheckpointManifest saved;
    saved.settings = base_settings();
    const std::vector<std::string> must = {"model", "batch", "seq_len", "train"};
    std::vector<std::string> notes;
    EXPECT_EQ(settings_differences(saved, base_settings(), must, &notes), "");
    EXPECT_TRUE(notes.empty());

    auto now = base_settings();
    now[0].second = "maxT=64 V=50257 Vp=50304 L=4 NH=2 C=64";
    now[1].second = "8";
    now[4].second = "200";
    const std::string err = settings_differences(saved, now, must, &notes);
    EXPECT_NE(err.find("model: checkpoint has 'maxT=64 V=50257 Vp=50304 L=2 NH=2 C=64', this run has "
                       "'maxT=64 V=50257 Vp=50304 L=4 NH=2 C=64'"), std::string::npos) << err;
    EXPECT_NE(err.find("batch: checkpoint has '4', this run has '8'"), std::string::npos) << err;
    EXPECT_EQ(err.find("max_steps"), std::string::npos) << "max_steps may change";
    ASSERT_EQ(notes.size(), 1u);
    EXPECT_NE(notes[0].find("max_steps: checkpoint has '100', this run has '200'"), std::string::npos);

    now = base_settings();
    now.push_back({"new_key", "1"});
    notes.clear();
    EXPECT_EQ(settings_differences(saved, now, {"new_key"}, &notes), "new_key: checkpoint has nothing, this run has '1'");
}

// ----------------------------------------------------------------------------------------------------
// Several ranks writing one checkpoint, and reading ranges back on another number of ranks.

namespace {

constexpr int64_t kShardedElems = 10007;  // not a multiple of any shard size or of the chunk

// Rank r's writer of a world-rank checkpoint of `state` (4-byte elements): its owned range as
// master_<r>.bin, committed (a part for r > 0, the manifest and rename for rank 0).
std::string write_rank(const std::string& out, int64_t step, int rank, int world, const std::vector<char>& state,
                       double timeout_s = 30) {
    const ZeroLayout layout = zero_layout(kShardedElems, world);
    const ShardRange own = layout.owned(rank);
    CheckpointWriter w(out, step, rank, world, timeout_s);
    w.add_file(state_shard_file(StateKind::Master, rank), [&](File& f, const ChunkHook& hook) {
        write_chunked(f, state.data() + own.begin * 4, size_t(own.size()) * 4, hook, kSmallChunk);
    });
    CheckpointManifest m;
    m.settings = base_settings();
    for (auto& kv : state_layout_settings(&layout)) m.settings.push_back(kv);
    return w.commit(m);
}

std::vector<ArraySegment> segments_of(int world) {
    const ZeroLayout layout = zero_layout(kShardedElems, world);
    std::vector<ArraySegment> segs;
    for (int r = 0; r < world; r++) {
        const ShardRange own = layout.owned(r);
        segs.push_back({state_shard_file(StateKind::Master, r), 0, own.begin, own.size()});
    }
    return segs;
}

std::vector<char> read_range(const std::string& dir, const CheckpointManifest& m, const std::vector<ArraySegment>& segs,
                             int64_t first, int64_t last) {
    std::vector<char> out(size_t(last - first) * 4, 0);
    read_array_range(dir, m, segs, 4, first, last, [&](uint64_t at, const char* p, size_t n) {
        ASSERT_LE(at + n, out.size());
        std::memcpy(out.data() + at, p, n);
    });
    return out;
}

}  // namespace

TEST(SeveralRanks, OneCheckpointFromConcurrentWritersReadBackOnOtherRankCounts) {
    TempDir tmp;
    const std::string out = tmp.path() + "/out";
    const std::vector<char> state = random_bytes(size_t(kShardedElems) * 4, 77);
    const int world = 3;
    prepare_shared_checkpoint(out, 40);  // rank 0, before the barrier
    std::vector<std::string> results(world), errors(world);
    std::vector<std::thread> ranks;
    for (int r = world - 1; r >= 0; r--) {  // rank 0 first in line to wait for the others
        ranks.emplace_back([&, r] {
            try {
                results[size_t(r)] = write_rank(out, 40, r, world, state);
            } catch (const Error& e) {
                errors[size_t(r)] = e.what();
            }
        });
    }
    for (std::thread& t : ranks) t.join();
    for (int r = 0; r < world; r++) ASSERT_EQ(errors[size_t(r)], "") << "rank " << r;
    const std::string dir = out + "/" + checkpoint_dir_name(40);
    EXPECT_EQ(results[0], dir);
    EXPECT_FALSE(std::filesystem::exists(dir + ".tmp"));
    const CheckpointManifest m = validate_checkpoint(dir, /*deep=*/true);
    ASSERT_EQ(m.files.size(), size_t(world)) << "every rank's file is in the one manifest";
    for (int r = 0; r < world; r++) EXPECT_NE(m.file(state_shard_file(StateKind::Master, r)), nullptr) << r;
    EXPECT_EQ(find_newest_valid(out, true).path, dir);
    // The manifest's layout settings give back exactly the segments the ranks wrote.
    const StateLayout saved = read_state_layout(dir, m, kShardedElems);
    ASSERT_TRUE(saved.sharded);
    ASSERT_EQ(saved.master.size(), size_t(world));
    for (int r = 0; r < world; r++) {
        EXPECT_EQ(saved.master[size_t(r)].file, segments_of(world)[size_t(r)].file);
        EXPECT_EQ(saved.master[size_t(r)].begin, segments_of(world)[size_t(r)].begin);
        EXPECT_EQ(saved.master[size_t(r)].count, segments_of(world)[size_t(r)].count);
    }

    // Every rank of every other world size gets exactly its slice; so does a range across shard borders.
    for (int new_world : {1, 2, 3, 4, 5, 8}) {
        const ZeroLayout layout = zero_layout(kShardedElems, new_world);
        for (int r = 0; r < new_world; r++) {
            const ShardRange own = layout.owned(r);
            const std::vector<char> got = read_range(dir, m, segments_of(world), own.begin, own.end);
            const std::vector<char> want(state.begin() + own.begin * 4, state.begin() + own.end * 4);
            EXPECT_TRUE(got == want) << "world " << new_world << " rank " << r;
        }
    }
    const std::vector<char> mid = read_range(dir, m, segments_of(world), 3000, 7500);
    EXPECT_TRUE(mid == std::vector<char>(state.begin() + 3000 * 4, state.begin() + 7500 * 4));

    // A range the files do not cover, and a damaged chunk: only the reads that touch it fail.
    std::vector<ArraySegment> partial = segments_of(world);
    partial.pop_back();
    EXPECT_NE(error_of([&] { read_range(dir, m, partial, 0, kShardedElems); }).find("hold"), std::string::npos);
    const std::string victim = dir + "/master_00001.bin";
    std::vector<char> bytes = read_bytes(victim);
    bytes[bytes.size() / 2] ^= 0x10;
    write_bytes(victim, bytes);
    const ShardRange own1 = zero_layout(kShardedElems, world).owned(1);
    EXPECT_NE(error_of([&] { read_range(dir, m, segments_of(world), own1.begin, own1.end); }).find("corrupted"),
              std::string::npos);
    const ShardRange own0 = zero_layout(kShardedElems, world).owned(0);
    EXPECT_EQ(error_of([&] { read_range(dir, m, segments_of(world), own0.begin, own0.end); }), "")
        << "a range that does not touch the damaged chunk still reads";
}

TEST(SeveralRanks, AMissingRankPublishesNothing) {
    TempDir tmp;
    const std::string out = tmp.path() + "/out";
    const std::vector<char> state = random_bytes(size_t(kShardedElems) * 4, 78);
    prepare_shared_checkpoint(out, 10);
    write_rank(out, 10, 1, 3, state);  // rank 2 never comes
    const std::string err = error_of([&] { write_rank(out, 10, 0, 3, state, /*timeout_s=*/0.2); });
    EXPECT_NE(err.find("rank(s) 2 did not finish"), std::string::npos) << err;
    EXPECT_TRUE(list_checkpoints(out).empty()) << "no checkpoint is published without every rank's part";
    EXPECT_FALSE(std::filesystem::exists(out + "/" + checkpoint_dir_name(10) + ".tmp")) << "rank 0 cleans up";
    // A rank whose directory was not prepared (not the shared one) says so.
    EXPECT_NE(error_of([&] { write_rank(out, 11, 1, 3, state); }).find("shared directory"), std::string::npos);
}

TEST(SeveralRanks, AStalePartOfTheSameStepIsNeverMerged) {
    TempDir tmp;
    const std::string out = tmp.path() + "/out";
    const std::vector<char> old_state = random_bytes(size_t(kShardedElems) * 4, 79);
    const std::vector<char> state = random_bytes(size_t(kShardedElems) * 4, 80);
    // An earlier attempt at step 20 died after rank 1 published its part.
    prepare_shared_checkpoint(out, 20);
    write_rank(out, 20, 1, 2, old_state);
    // The new attempt: rank 0 prepares (removing the stale directory), rank 0 then times out waiting for
    // rank 1 rather than merging the old part.
    prepare_shared_checkpoint(out, 20);
    EXPECT_NE(error_of([&] { write_rank(out, 20, 0, 2, state, 0.2); }).find("did not finish"), std::string::npos);
    prepare_shared_checkpoint(out, 20);
    write_rank(out, 20, 1, 2, state);
    write_rank(out, 20, 0, 2, state);
    const std::string dir = out + "/" + checkpoint_dir_name(20);
    const CheckpointManifest m = validate_checkpoint(dir, true);
    EXPECT_TRUE(read_range(dir, m, segments_of(2), 0, kShardedElems) == state);
}

TEST(StateLayout, SettingsRoundTripForEveryRankCountAndTheWholeLayout) {
    for (int64_t n : {int64_t(1), int64_t(127), int64_t(10007), int64_t(124475904)}) {
        for (int w = 1; w <= 8; w++) {
            const ZeroLayout layout = zero_layout(n, w);
            CheckpointManifest m;
            m.settings = state_layout_settings(&layout);
            const StateLayout got = read_state_layout("ck", m, n);
            ASSERT_TRUE(got.sharded);
            ASSERT_EQ(got.master.size(), size_t(w));
            int64_t at = 0;
            for (int r = 0; r < w; r++) {
                const ShardRange own = layout.owned(r);
                SCOPED_TRACE(format("n=%lld w=%d r=%d", (long long)n, w, r));
                for (const auto* segs : {&got.master, &got.adam_m, &got.adam_v}) {
                    EXPECT_EQ((*segs)[size_t(r)].begin, own.begin);
                    EXPECT_EQ((*segs)[size_t(r)].count, own.size());
                    EXPECT_EQ((*segs)[size_t(r)].offset, 0u);
                }
                EXPECT_EQ(got.master[size_t(r)].file, format("master_%05d.bin", r));
                EXPECT_EQ(got.adam_m[size_t(r)].file, format("adam_m_%05d.bin", r));
                EXPECT_EQ(got.adam_v[size_t(r)].file, format("adam_v_%05d.bin", r));
                EXPECT_EQ(own.begin, at) << "the ranges tile [0, n) in rank order";
                at += own.size();
            }
            EXPECT_EQ(at, n);
            EXPECT_EQ(got.params.file, "model.bin");
            EXPECT_EQ(got.params.offset, 1024u);
            EXPECT_EQ(got.params.count, n);
        }
    }
    // The whole layout, named or (checkpoints from before the setting existed) not.
    for (bool named : {true, false}) {
        CheckpointManifest m;
        if (named) m.settings = state_layout_settings(nullptr);
        const StateLayout got = read_state_layout("ck", m, 500);
        EXPECT_FALSE(got.sharded);
        ASSERT_EQ(got.master.size(), 1u);
        EXPECT_EQ(got.master[0].file, "model.bin");
        EXPECT_EQ(got.master[0].offset, 1024u);
        EXPECT_EQ(got.master[0].count, 500);
        EXPECT_EQ(got.adam_m[0].file, "adam_m.bin");
        EXPECT_EQ(got.adam_v[0].file, "adam_v.bin");
        EXPECT_EQ(got.params.file, "params_bf16.bin");
        EXPECT_EQ(got.params.offset, 0u);
    }
}

TEST(StateLayout, MalformedSettingsAreRefusedByName) {
    const ZeroLayout layout = zero_layout(1000, 3);
    auto with = [&](const std::string& key, const std::string* value) {
        CheckpointManifest m;
        for (auto& kv : state_layout_settings(&layout)) {
            if (kv.first == key) {
                if (value == nullptr) continue;  // dropped
                kv.second = *value;
            }
            m.settings.push_back(kv);
        }
        return error_of([&] { read_state_layout("ck", m, 1000); });
    };
    const std::string bad_kind = "striped", abc = "abc", zero = "0", one_number = "12", three = "0 300 7",
                      negative = "-5 10", gap = "400 300", overlap = "300 400";
    EXPECT_NE(with("state_layout", &bad_kind).find("unknown state_layout 'striped'"), std::string::npos);
    EXPECT_NE(with("state_ranks", nullptr).find("state_ranks"), std::string::npos);
    EXPECT_NE(with("state_ranks", &abc).find("state_ranks"), std::string::npos);
    EXPECT_NE(with("state_ranks", &zero).find("state_ranks"), std::string::npos);
    for (const std::string* v : {static_cast<const std::string*>(nullptr), &one_number, &three, &negative}) {
        EXPECT_NE(with("state_shard_1", v).find("rank 1's shard is missing or malformed"), std::string::npos)
            << (v ? *v : "(missing)");
    }
    EXPECT_NE(with("state_shard_1", &gap), "") << "a gap between ranks 0 and 1";
    EXPECT_NE(with("state_shard_1", &overlap), "") << "ranks 1 and 2 overlap";
    const std::string ok1 = format("%lld %lld", (long long)layout.owned(1).begin, (long long)layout.owned(1).size());
    EXPECT_EQ(with("state_shard_1", &ok1), "") << "the unchanged settings parse";
}

// ----------------------------------------------------------------------------------------------------
// Re-sharding: an optimizer array saved by one number of ranks read back, range by range, by another,
// through the layout the manifest records (read_state_layout, then read_array_range: the resume's path).

namespace {

// The sharded layout's master_<r>.bin files of `full` as `world` ranks at `alignment` save them, written
// straight into `dir` in chunks of `chunk` bytes; returns the manifest recording them (no CheckpointWriter:
// hundreds of these are made).
CheckpointManifest save_shards(const std::string& dir, const std::vector<float>& full, int world, int64_t alignment,
                               size_t chunk = kSmallChunk) {
    const ZeroLayout z = zero_layout(int64_t(full.size()), world, alignment);
    CheckpointManifest m;
    m.settings = state_layout_settings(&z);
    for (int r = 0; r < world; r++) {
        const ShardRange o = z.owned(r);
        const char* p = reinterpret_cast<const char*>(full.data() + o.begin);
        FileRecord rec;
        rec.name = state_shard_file(StateKind::Master, r);
        rec.size = uint64_t(o.size()) * sizeof(float);
        write_bytes(dir + "/" + rec.name, p, size_t(rec.size));
        for (uint64_t at = 0; at < rec.size; at += chunk) {
            const uint64_t len = std::min<uint64_t>(chunk, rec.size - at);
            rec.chunks.push_back({at, len, checksum64(p + at, size_t(len))});
        }
        m.files.push_back(rec);
    }
    return m;
}

std::vector<float> read_floats(const std::string& dir, const CheckpointManifest& m, const std::vector<ArraySegment>& segs,
                               int64_t first, int64_t last) {
    std::vector<float> out(size_t(last - first), -12345.0f);  // poison
    read_array_range(dir, m, segs, sizeof(float), first, last, [&](uint64_t at, const char* p, size_t n) {
        ASSERT_LE(at + n, out.size() * sizeof(float));
        std::memcpy(reinterpret_cast<char*>(out.data()) + at, p, n);
    });
    return out;
}

}  // namespace

TEST(Reshard, EveryWorldSizeToEveryOther) {
    for (int64_t alignment : {1, 4, 128}) {
        for (int64_t n : {1, 2, 3, 7, 8, 9, 31, 127, 128, 129, 257, 1000, 1031}) {
            const std::vector<float> full = random_floats(size_t(n), uint64_t(n) * 31 + uint64_t(alignment), 1000.0f);
            for (int w_old = 1; w_old <= 8; w_old++) {
                TempDir dir("ckpt_reshard");
                const CheckpointManifest m = save_shards(dir.path(), full, w_old, alignment);
                const StateLayout saved = read_state_layout(dir.path(), m, n);
                for (int w_new = 1; w_new <= 8; w_new++) {
                    SCOPED_TRACE("N=" + std::to_string(n) + " A=" + std::to_string(alignment) + " " +
                                 std::to_string(w_old) + "->" + std::to_string(w_new));
                    // The new run may use another alignment too: re-sharding reads the saved ranges.
                    const ZeroLayout to = zero_layout(n, w_new, alignment == 128 ? 4 : 128);
                    std::vector<float> rebuilt;
                    for (int r = 0; r < w_new; r++) {
                        const ShardRange o = to.owned(r);
                        const std::vector<float> shard = read_floats(dir.path(), m, saved.master, o.begin, o.end);
                        rebuilt.insert(rebuilt.end(), shard.begin(), shard.end());
                    }
                    ASSERT_EQ(rebuilt, full);
                }
            }
        }
    }
}

TEST(Reshard, PiecesAreMinimal) {
    // 10 elements saved by 3 ranks at alignment 1 ([0,4) [4,8) [8,10)), each file one chunk, read back by 2
    // ranks ([0,5) [5,10)): one piece per saved shard a range touches, each as long as the overlap.
    TempDir dir("ckpt_reshard_pieces");
    const std::vector<float> full = random_floats(10, 3, 1000.0f);
    const CheckpointManifest m = save_shards(dir.path(), full, 3, 1, size_t(1) << 20);
    const StateLayout saved = read_state_layout(dir.path(), m, 10);
    const ZeroLayout to = zero_layout(10, 2, 1);
    const std::vector<std::vector<std::pair<uint64_t, size_t>>> expect = {{{0, 16}, {16, 4}}, {{0, 12}, {12, 8}}};
    for (int r = 0; r < 2; r++) {
        const ShardRange o = to.owned(r);
        std::vector<std::pair<uint64_t, size_t>> pieces;
        std::vector<float> got(size_t(o.size()));
        read_array_range(dir.path(), m, saved.master, sizeof(float), o.begin, o.end,
                         [&](uint64_t at, const char* p, size_t n) {
                             pieces.push_back({at, n});
                             std::memcpy(reinterpret_cast<char*>(got.data()) + at, p, n);
                         });
        EXPECT_EQ(pieces, expect[size_t(r)]) << "rank " << r;
        EXPECT_EQ(got, std::vector<float>(full.begin() + o.begin, full.begin() + o.end)) << "rank " << r;
    }
}

TEST(Reshard, SegmentsGivenOutOfOrder) {
    TempDir dir("ckpt_reshard_order");
    const std::vector<float> full = random_floats(333, 5, 1000.0f);
    const CheckpointManifest m = save_shards(dir.path(), full, 5, 4);
    std::vector<ArraySegment> segs = read_state_layout(dir.path(), m, 333).master;
    std::swap(segs[0], segs[3]);
    EXPECT_EQ(read_floats(dir.path(), m, segs, 0, 333), full);
}

// Each way the recorded ranges can fail to tile the parameters is refused naming the shard's file.
TEST(Reshard, DamagedLayoutsAreNamed) {
    TempDir dir("ckpt_reshard_damaged");
    const CheckpointManifest good = save_shards(dir.path(), random_floats(100, 7, 1000.0f), 4, 4);
    auto with_range = [&](int rank, int64_t begin_delta, int64_t count) {
        CheckpointManifest m = good;
        const StateLayout s = read_state_layout(dir.path(), good, 100);
        for (auto& kv : m.settings) {
            if (kv.first == format("state_shard_%d", rank)) {
                kv.second = format("%lld %lld", (long long)(s.master[size_t(rank)].begin + begin_delta), (long long)count);
            }
        }
        return m;
    };
    const StateLayout s = read_state_layout(dir.path(), good, 100);
    const std::string d = dir.path();
    expect_error([&] { read_state_layout(d, with_range(2, 1, s.master[2].count - 1), 100); }, kExitData,
                 {"master_00002.bin", "a gap"});
    expect_error([&] { read_state_layout(d, with_range(1, 0, s.master[1].count + 1), 100); }, kExitData,
                 {"master_00002.bin", "overlaps"});
    expect_error([&] { read_state_layout(d, good, 101); }, kExitData, {"[0, 100)", "has 101"});
    // A range past the model (here one whose end does not fit in 64 bits) is named with its file.
    expect_error([&] { read_state_layout(d, with_range(3, 0, std::numeric_limits<int64_t>::max()), 100); }, kExitData,
                 {"master_00003.bin", "past the model's 100 parameters"});
    // Segments that leave part of a range uncovered.
    std::vector<ArraySegment> partial = s.master;
    partial.erase(partial.begin() + 1);
    expect_error([&] { read_floats(d, good, partial, 0, 100); }, kExitData, {"its files hold 72 of the 100 elements"});
}

// ----------------------------------------------------------------------------------------------------
// The publish race: once rank r renames its part into place, rank 0 may merge it, write the manifest and
// rename the directory before rank r does anything more. This binary's rename() (std::rename calls it)
// can hold the caller right after it renamed rank 1's part until the checkpoint is published: the
// widest that window can get.

namespace {

std::atomic<bool> g_hold_part_1{false};
std::atomic<bool> g_held_until_published{false};
std::string g_published;  // the final directory; set before g_hold_part_1

}  // namespace

extern "C" int rename(const char* from, const char* to) noexcept {
    const int rc = ::renameat(AT_FDCWD, from, AT_FDCWD, to);
    const std::string dest = to;
    const std::string part = "/" + checkpoint_part_name(1);
    if (rc == 0 && g_hold_part_1.load() && dest.size() > part.size() &&
        dest.compare(dest.size() - part.size(), part.size(), part) == 0) {
        for (int i = 0; i < 1000; i++) {  // at most 10 s
            std::error_code ec;
            if (std::filesystem::exists(g_published, ec)) {
                g_held_until_published = true;
                break;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
    }
    return rc;
}

TEST(SeveralRanks, ARankStillBusyWithItsPartWhenRankZeroPublishesSucceeds) {
    TempDir tmp;
    const std::string out = tmp.path() + "/out";
    const std::vector<char> state = random_bytes(size_t(kShardedElems) * 4, 81);
    prepare_shared_checkpoint(out, 30);
    const std::string dir = out + "/" + checkpoint_dir_name(30);
    g_published = dir;
    g_held_until_published = false;
    g_hold_part_1 = true;
    std::string errors[2];
    // Rank 0 first, waiting for the part; then rank 1, held after its rename until rank 0 has published.
    std::thread rank0([&] {
        try {
            write_rank(out, 30, 0, 2, state);
        } catch (const Error& e) {
            errors[0] = e.what();
        }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::thread rank1([&] {
        try {
            write_rank(out, 30, 1, 2, state);
        } catch (const Error& e) {
            errors[1] = e.what();
        }
    });
    rank0.join();
    rank1.join();
    g_hold_part_1 = false;
    EXPECT_TRUE(g_held_until_published) << "rank 1 was not held until rank 0 published: the test did not test the race";
    EXPECT_EQ(errors[0], "");
    EXPECT_EQ(errors[1], "") << "rank 1 failed although the checkpoint is complete";
    const CheckpointManifest m = validate_checkpoint(dir, /*deep=*/true);
    EXPECT_TRUE(read_range(dir, m, segments_of(2), 0, kShardedElems) == state);
}
