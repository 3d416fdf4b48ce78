/*
CPU tests of the small headers everything else stands on: the random numbers (rand.h) and hashes
(hash.h), pinned to literal values so that a change to any bit of a data order, an initialisation, a
rounding or a stored checksum fails here; the filesystem helpers of utils.h; and the reader of llm.c's
256-int32 file header (llmc_header.h). The literals were computed by an independent Python
implementation of the same definitions (and, for SplitMix64 and FNV-1a, agree with published values).
*/
#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "llmc/hash.h"
#include "llmc/llmc_header.h"
#include "llmc/rand.h"
#include "llmc/utils.h"
#include "test/expect_error.h"
#include "test/test_util.h"

using namespace llmc;
using llmc::test::random_bytes;
using llmc::test::read_text;
using llmc::test::write_bytes;
using llmc::test::TempDir;

TEST(Rand, SplitMix64IsTheReferenceGenerator) {
    // Seed 0 gives SplitMix64's published first outputs.
    SplitMix64 r(0);
    EXPECT_EQ(r.next(), 0xe220a8397b1dcdafull);
    EXPECT_EQ(r.next(), 0x6e789e6aa1b965f4ull);
    EXPECT_EQ(r.next(), 0x06c45d188009454full);
    SplitMix64 s(42);
    EXPECT_EQ(s.next(), 0xbdd732262feb6e95ull);
    EXPECT_EQ(s.next(), 0x28efe333b266f103ull);
    EXPECT_EQ(s.state(), 42 + 2 * kSplitMix64Gamma);
}

TEST(Rand, MixerAndCounterHashArePinned) {
    EXPECT_EQ(splitmix64_mix(0), 0u);
    EXPECT_EQ(splitmix64_mix(1), 0x5692161d100b05e5ull);
    EXPECT_EQ(splitmix64_mix(0x123456789abcdef0ull), 0x9629f58e8ec5b906ull);
    EXPECT_EQ(splitmix64_hash(0), 0xe220a8397b1dcdafull) << "the first output of a generator of state 0";
    EXPECT_EQ(splitmix64_hash(1), 0x910a2dec89025cc1ull);
    EXPECT_EQ(splitmix64_hash(0x123456789abcdef0ull), 0x161922c645ce50e8ull);
    for (uint64_t z : {3ull, 99ull, ~0ull}) {
        SplitMix64 g(z);
        EXPECT_EQ(g.next(), splitmix64_hash(z));
    }
}

// The words of the GPU's stochastic rounding, computed here on the host with the same functions.
TEST(Rand, CounterGeneratorIsPinned) {
    struct Case {
        uint64_t seed, stream, key;
        uint32_t words[3];  // indices 0, 1, 12345678901
    };
    const Case cases[] = {
        {0, 0, 0xf2253e3606a0bf0full, {0x41ca75f8u, 0x625ff432u, 0x8d230c2eu}},
        {0, 5, 0x72b14ede91ae95cdull, {0xe9485042u, 0x9de09bdcu, 0x6504470bu}},
        {1, 77, 0x7954fe2c81fc8144ull, {0x49613641u, 0x47eaf1b1u, 0x6ded28d3u}},
        {1234, 0, 0x04ee0dd96a819fe6ull, {0xbc6ad861u, 0x1d2b8b0cu, 0xc9e297feu}},
        {1234, 77, 0x47ed19fc40837f08ull, {0x126a5f1bu, 0x01a117d8u, 0x4d8e4041u}},
    };
    for (const Case& c : cases) {
        const uint64_t key = rng_key(c.seed, c.stream);
        EXPECT_EQ(key, c.key) << "seed " << c.seed << " stream " << c.stream;
        EXPECT_EQ(rng_u32(key, 0), c.words[0]);
        EXPECT_EQ(rng_u32(key, 1), c.words[1]);
        EXPECT_EQ(rng_u32(key, 12345678901ull), c.words[2]);
    }
}

TEST(Rand, CounterNormalIsPinnedAndLooksNormal) {
    const double want[3][3] = {{-0.1964174268771277, 1.1216932492631078, 0.7777488736662874},
                               {-0.6094235551552644, 1.1626782663908586, -1.0056407014874253},
                               {0.7246501710299916, -1.8377569797358868, 0.11448033589105092}};
    const uint64_t streams[3] = {0, 1, 5}, indices[3] = {0, 1, 999};
    for (int s = 0; s < 3; s++) {
        for (int i = 0; i < 3; i++) {
            EXPECT_NEAR(counter_normal(3, streams[s], indices[i]), want[s][i], 1e-15)
                << "stream " << streams[s] << " index " << indices[i];
        }
    }
    double sum = 0, sq = 0;
    const int n = 200001;
    for (int i = 0; i < n; i++) {
        const double x = counter_normal(17, 4, uint64_t(i));
        sum += x;
        sq += x * x;
    }
    EXPECT_NEAR(sum / n, 0.0, 0.01);
    EXPECT_NEAR(sq / n, 1.0, 0.01);
}

TEST(Hash, Fnv1aMatchesThePublishedValuesAndChains) {
    EXPECT_EQ(fnv1a64("", 0), 0xcbf29ce484222325ull);
    EXPECT_EQ(fnv1a64(std::string("a")), 0xaf63dc4c8601ec8cull);
    EXPECT_EQ(fnv1a64(std::string("foobar")), 0x85944171f73967e8ull);
    EXPECT_EQ(fnv1a64(std::string("bar"), fnv1a64(std::string("foo"))), 0x85944171f73967e8ull)
        << "hashing in pieces must equal hashing the whole";
    const std::string with_nul("a\0b", 3);
    EXPECT_NE(fnv1a64(with_nul), fnv1a64(std::string("ab"))) << "the string overload must hash every byte";
}

// checksum64 values are stored in checkpoint manifests: they must never change.
TEST(Hash, Checksum64IsPinned) {
    const std::string s = "hello world, a checksum over a string of odd length!";
    const uint64_t want[] = {0x43ea00053f62bc8bull, 0x74e11e0163510b65ull, 0x2d9e36404998e8eaull,
                             0xbf293263a501f864ull, 0xe9fbfcc9a2d67d56ull, 0x1ca91e7208c925c7ull,
                             0xd2cd4602a15efe44ull, 0x4b3d98233f191fa0ull};
    for (size_t k = 0; k < 8; k++) EXPECT_EQ(checksum64(s.data(), 7 * k), want[k]) << 7 * k << " bytes";
}

TEST(Errors, WhatAFileHoldsCannotBreakTheMessagesLine) {
    // A reader quotes names from the file it refuses; a newline or another control byte among them would
    // split the one "error: ..." line the README promises.
    try {
        llmc::fail(llmc::kExitData, "token '%s' in '%s'", "a\nb\r\x01\x7f", "f\tg");
        FAIL() << "fail() returned";
    } catch (const llmc::Error& e) {
        EXPECT_EQ(std::string(e.what()), "token 'a\\nb\\r\\x01\\x7f' in 'f\tg'");
        EXPECT_EQ(e.exit_code(), llmc::kExitData);
    }
}

TEST(Filesystem, KindsOfPaths) {
    TempDir dir("fs_kinds");
    write_bytes(dir / "file", "x");
    ASSERT_TRUE(std::filesystem::create_directory(dir / "sub"));
    std::filesystem::create_symlink(dir / "file", dir / "to_file");
    std::filesystem::create_symlink(dir / "sub", dir / "to_sub");
    std::filesystem::create_symlink(dir / "missing", dir / "dangling");
    EXPECT_TRUE(regular_file_exists(dir / "file"));
    EXPECT_TRUE(regular_file_exists(dir / "to_file"));
    EXPECT_FALSE(regular_file_exists(dir / "sub"));
    EXPECT_FALSE(regular_file_exists(dir / "dangling"));
    EXPECT_FALSE(regular_file_exists(dir / "missing"));
    EXPECT_FALSE(regular_file_exists(""));
    EXPECT_TRUE(directory_exists(dir / "sub"));
    EXPECT_TRUE(directory_exists(dir / "to_sub"));
    EXPECT_TRUE(directory_exists(dir.path()));
    EXPECT_FALSE(directory_exists(dir / "file"));
    EXPECT_FALSE(directory_exists(dir / "missing"));
    EXPECT_FALSE(directory_exists(dir / "file/x"));

    EXPECT_EQ(parent_directory("a"), ".");
    EXPECT_EQ(parent_directory("a/b"), "a");
    EXPECT_EQ(parent_directory("a//b"), "a");
    EXPECT_EQ(parent_directory("/a"), "/");
    EXPECT_EQ(parent_directory("/a/b/c"), "/a/b");
}

TEST(Filesystem, MakeDirectoriesCreatesParentsAndAcceptsExisting) {
    TempDir dir("fs_mkdir");
    const std::string deep = dir / "a/b/c/d";
    make_directories(deep);
    EXPECT_TRUE(directory_exists(deep));
    make_directories(deep);  // again: nothing to do
    make_directories(dir / "a/b");
    make_directories(dir / "x//y/");  // doubled and trailing slashes
    EXPECT_TRUE(directory_exists(dir / "x/y"));
    std::filesystem::create_symlink(dir / "a", dir / "link");
    make_directories(dir / "link/b/e");  // through a symbolic link to a directory
    EXPECT_TRUE(directory_exists(dir / "a/b/e"));
    make_directories("/");
    make_directories(".");

    // Several threads creating overlapping trees at once all succeed.
    std::vector<std::thread> threads;
    std::atomic<int> errors{0};
    for (int t = 0; t < 8; t++) {
        threads.emplace_back([&, t] {
            try {
                make_directories(dir / ("race/p/q/r" + std::to_string(t % 3)));
            } catch (const Error&) {
                errors++;
            }
        });
    }
    for (std::thread& t : threads) t.join();
    EXPECT_EQ(errors.load(), 0);
    for (int k = 0; k < 3; k++) EXPECT_TRUE(directory_exists(dir / ("race/p/q/r" + std::to_string(k))));
}

TEST(Filesystem, MakeDirectoriesNamesWhatIsInTheWay) {
    TempDir dir("fs_mkdir_err");
    write_bytes(dir / "file", "x");
    expect_error([&] { make_directories(dir / "file"); }, kExitIo,
                 {"cannot create directory '" + dir / "file" + "'", "is not a directory"});
    expect_error([&] { make_directories(dir / "file/sub/deeper"); }, kExitIo,
                 {dir / "file/sub/deeper", "'" + dir / "file" + "' exists and is not a directory"});
    const std::string long_name(300, 'n');  // longer than any file system's name limit
    expect_error([&] { make_directories(dir / (long_name + "/x")); }, kExitIo,
                 {"cannot create directory '" + dir / long_name + "'", "(for '" + dir / (long_name + "/x") + "')",
                  std::strerror(ENAMETOOLONG)});
    expect_error([&] { make_directories(""); }, kExitIo, {"empty name"});
    EXPECT_FALSE(directory_exists(dir / "file/sub"));
}

TEST(Filesystem, WriteFileAtomicallyReplacesWholeOrNotAtAll) {
    TempDir dir("fs_atomic");
    const std::string path = dir / "out.bin";
    const std::vector<char> first = random_bytes(10000, 1), second = random_bytes(333, 2);
    write_file_atomically(path, [&](File& f) { f.write_all(first.data(), first.size()); });
    EXPECT_EQ(read_text(path), std::string(first.begin(), first.end()));
    write_file_atomically(path, [&](File& f) { f.write_all(second.data(), second.size()); });
    EXPECT_EQ(read_text(path), std::string(second.begin(), second.end()));
    EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

    // A writer that fails half way leaves the old file and no temporary behind.
    expect_error(
        [&] {
            write_file_atomically(path, [&](File& f) {
                f.write_all(first.data(), 100);
                fail(kExitData, "the writer gave up");
            });
        },
        kExitData, {"the writer gave up"});
    EXPECT_EQ(read_text(path), std::string(second.begin(), second.end()));
    EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

    // The rename cannot replace a non-empty directory: an error naming both, and no temporary left.
    make_directories(dir / "taken/inside");
    expect_error([&] { write_file_atomically(dir / "taken", [](File& f) { f.write_all("x", 1); }); }, kExitIo,
                 {"cannot rename '" + dir / "taken.tmp" + "' to '" + dir / "taken" + "'"});
    EXPECT_FALSE(std::filesystem::exists(dir / "taken.tmp"));
    EXPECT_TRUE(directory_exists(dir / "taken/inside"));

    expect_error([&] { write_file_atomically(dir / "no/such/dir/f", [](File& f) { f.write_all("x", 1); }); }, kExitIo,
                 {"cannot open '" + dir / "no/such/dir/f.tmp" + "'"});

    // A bare file name lands in the working directory, whose sync must work too.
    const std::filesystem::path cwd = std::filesystem::current_path();
    std::filesystem::current_path(dir.path());
    write_file_atomically("bare.txt", [](File& f) { f.write_all("bare", 4); });
    std::filesystem::current_path(cwd);
    EXPECT_EQ(read_text(dir / "bare.txt"), "bare");
}

namespace {

const LlmcFileSpec kTestSpec{"test file", "a test file", 1234567, {2, 7}, "2 or 7", {{1, "is retired; convert it"}}};

// A file of the test format: the header (magic, version, then `fields`) and `payload` bytes after it.
std::string write_llmc(const TempDir& dir, const std::string& name, int32_t magic, int32_t version, size_t payload,
                       std::vector<int32_t> fields = {}) {
    std::vector<int32_t> h(kLlmcHeaderInts, 0);
    h[0] = magic;
    h[1] = version;
    for (size_t i = 0; i < fields.size(); i++) h[2 + i] = fields[i];
    const std::vector<char> bytes = random_bytes(payload, uint64_t(payload) + 5);
    File f(dir / name, File::Mode::Write);
    f.write_all(h.data(), h.size() * 4);
    f.write_all(bytes.data(), bytes.size());
    f.close();
    return dir / name;
}

}  // namespace

TEST(LlmcHeader, ReadsAndChecksMagicVersionAndLength) {
    TempDir dir("llmc_header");
    const std::string good = write_llmc(dir, "good.bin", 1234567, 7, 3 * 333, {333, -9});
    File f(good, File::Mode::Read);
    const LlmcHeader h = read_llmc_header(f, kTestSpec);
    EXPECT_EQ(h.path, good);
    EXPECT_EQ(h.file_size, 1024 + 999);
    EXPECT_EQ(h.version(), 7);
    EXPECT_EQ(h.ints[2], 333);
    EXPECT_EQ(h.ints[3], -9);
    EXPECT_EQ(f.tell(), 1024) << "the payload is read next";
    check_llmc_file_size(h, kTestSpec, 333, 3, "item", "count at offset 8");
    expect_error([&] { check_llmc_file_size(h, kTestSpec, 334, 3, "item", "count at offset 8"); }, kExitData,
                 {"test file '" + good + "' is truncated", "its header (count at offset 8) says 334 items of 3 bytes",
                  "2026 bytes with the header", "the file is 2023 bytes", "room for 333 items"});
    expect_error([&] { check_llmc_file_size(h, kTestSpec, 332, 3, "item", "count at offset 8"); }, kExitData,
                 {good, "says 332 items", "3 unexpected bytes after the last item", "trailing data"});
    expect_error([&] { check_llmc_file_size(h, kTestSpec, 0, 3, "item", "count"); }, kExitData,
                 {"999 unexpected bytes"});
    // A corrupt count near 2^64 must not wrap around into an accepted size.
    for (uint64_t huge : {~0ull, ~0ull / 3, (~0ull / 3) + 1, 0x7fffffffffffffffull}) {
        expect_error([&] { check_llmc_file_size(h, kTestSpec, huge, 3, "item", "count"); }, kExitData,
                     {"is truncated", "room for 333 items"});
    }

    const std::string empty = write_llmc(dir, "empty.bin", 1234567, 2, 0);
    File e(empty, File::Mode::Read);
    check_llmc_file_size(read_llmc_header(e, kTestSpec), kTestSpec, 0, 4, "item", "count");

    auto read = [&](const std::string& path) {
        return [path] {
            File g(path, File::Mode::Read);
            read_llmc_header(g, kTestSpec);
        };
    };
    expect_error(read(write_llmc(dir, "magic.bin", 7654321, 2, 10)), kExitData,
                 {"test file '" + dir / "magic.bin" + "'", "bad magic 7654321 at offset 0", "expected 1234567",
                  "is this a test file?"});
    for (int32_t v : {0, 3, 6, 8, -2, INT32_MAX}) {
        expect_error(read(write_llmc(dir, "version.bin", 1234567, v, 10)), kExitData,
                     {"version.bin", format("unsupported version %d at offset 4", v), "expected 2 or 7"});
    }
    expect_error(read(write_llmc(dir, "retired.bin", 1234567, 1, 10)), kExitData,
                 {"retired.bin", "version 1 at offset 4 is retired; convert it"});
    {
        File s(dir / "short.bin", File::Mode::Write);
        s.write_all(random_bytes(1023, 3).data(), 1023);
    }
    expect_error(read(dir / "short.bin"), kExitData,
                 {"short.bin", "is 1023 bytes, shorter than its 1024-byte header", "not a test file"});
    expect_error(read(dir / "missing.bin"), kExitIo, {"missing.bin"});
}
