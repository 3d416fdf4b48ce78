/*
CPU tests of multiple-choice evaluation (llmc/mc_eval.h, cpu/mc_eval_cpu.h) and of the tool that makes
sets (dev/tools/prepare_eval.cpp, included here and run in-process).

Checks:
  - the eval .bin: a hand-made set written byte for byte as llm.c's layout says; random sets (2 to 6
    endings, lengths not multiples of anything) round-trip exactly; every damaged field of a valid file
    (size, magic, version, count both ways, delimiter, size field odd, small or past the file, index,
    candidate count, label, empty or overrunning context and ending, slack inside an example, token ids,
    the longest-example field, trailing bytes) refused with the file, the example and the byte offset
    named; a directory, a FIFO or a symlink loop refused with the system's reason; the writer refuses
    what the format cannot hold or scoring cannot use;
  - rows and batches: every row exactly once, in order, inputs/targets equal to a direct construction
    (context cut from the left by the same number of tokens for all candidates when an item is longer
    than T), B and T bounds and T's rounding, ranges of items, the rank split, the errors for an ending
    longer than T and for out-of-vocabulary tokens;
  - packed rows (the GPU's layout: a context once, its endings after it): what every scored position
    sees under the attention groups is exactly its own row's prefix (tokens, positions, target), every
    row once and in order, batches full up to their cells, an item that fits takes one row, the sums
    over packed losses bitwise mc_accumulate's over the per-candidate rows; 124 instead of 316 positions
    per item of the quick start's shape;
  - scores: acc by sum, acc_norm by mean, ties to the lowest index, margins;
  - the CPU reference: per-candidate sums equal a direct computation from the model's logits (one
    candidate per forward, log-softmax in double) within 1e-5, the batched runs identical bit for bit
    whatever the batch size, fp64 within 1e-5 of fp32;
  - HellaSwag JSONL (needs .deps/gpt2; skipped otherwise): rows in the file's exact format (with "ctx",
    with only "ctx_a"/"ctx_b", label as a string, blank lines) encoded as llm.c does, ids pinned from
    encoder.json; every malformed row (a row of other than 4 endings among them, which llm.c cannot read)
    refused with its line number;
  - prepare_eval: held-out sets obey their rules (windows within a document, word starts, no overlaps,
    distinct distractors, every label position used, seeded), also in a text of three passages, where
    a distractor that ignored its own passage would land in it; a shard and a text file in, a HellaSwag
    JSONL in (same bytes as write_mc_file of the reader's items); as a command, each error one line with
    its exit code: the command-line errors, inputs that are not files, a HellaSwag row of 3 endings, a
    shard token id equal to the vocabulary size.
PyTorch's view of the same scores is test/test_mc_eval_vs_torch.sh; the GPU's is test_mc_eval_gpu.cu.
*/
#define PREPARE_EVAL_NO_MAIN
#include "dev/tools/prepare_eval.cpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cpu/gpt2_cpu.h"
#include "cpu/mc_eval_cpu.h"
#include "llmc/gpt2_config.h"
#include "llmc/shard.h"
#include "test/expect_error.h"
#include "test/test_util.h"

namespace fs = std::filesystem;
using namespace llmc;
using llmc::test::TempDir;

namespace {

// ---- helpers ----

std::string read_file(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}
void write_file(const std::string& path, const std::string& data) {
    std::ofstream f(path, std::ios::binary);
    f << data;
}
void patch16(const std::string& path, size_t offset, uint16_t v) {
    std::string s = read_file(path);
    std::memcpy(&s[offset], &v, 2);
    write_file(path, s);
}
void patch32(const std::string& path, size_t offset, int32_t v) {
    std::string s = read_file(path);
    std::memcpy(&s[offset], &v, 4);
    write_file(path, s);
}

McSet random_set(uint64_t seed, int items, int vocab, int max_context, int max_ending, int min_k = 2, int max_k = 6) {
    SplitMix64 rng(seed);
    McSet set{"random", {}};
    for (int i = 0; i < items; i++) {
        McItem it;
        it.context = test::random_tokens<int32_t>(1 + rng.below(uint64_t(max_context)), uint32_t(vocab), rng.next());
        const int k = min_k + int(rng.below(uint64_t(max_k - min_k + 1)));
        for (int e = 0; e < k; e++) {
            it.endings.push_back(test::random_tokens<int32_t>(1 + rng.below(uint64_t(max_ending)), uint32_t(vocab),
                                                              rng.next()));
        }
        it.label = int(rng.below(uint64_t(k)));
        set.items.push_back(std::move(it));
    }
    return set;
}

void expect_same_items(const McSet& a, const McSet& b) {
    ASSERT_EQ(a.items.size(), b.items.size());
    for (size_t i = 0; i < a.items.size(); i++) {
        EXPECT_EQ(a.items[i].context, b.items[i].context) << "item " << i;
        EXPECT_EQ(a.items[i].endings, b.items[i].endings) << "item " << i;
        EXPECT_EQ(a.items[i].label, b.items[i].label) << "item " << i;
    }
}

// Three items of 28, 32 and 22 bytes: examples at offsets 1024, 1052 and 1084, the file ends at 1106.
McSet small_set() {
    McSet s{"small", {}};
    s.items.push_back({{1, 2, 3}, {{4}, {5, 6}}, 1});
    s.items.push_back({{7, 8}, {{9}, {10}, {11, 12, 13}}, 0});
    s.items.push_back({{14}, {{15}, {16}}, 0});
    return s;
}

// ---- the .bin format ----

TEST(McFile, LayoutIsLlmcs) {
    TempDir dir("mc_layout");
    McSet s{"one", {{{5, 6, 7}, {{8}, {9, 10}}, 1}}};
    write_mc_file(dir / "one.bin", s);
    std::vector<int32_t> header(256, 0);
    header[0] = 20240522;
    header[1] = 1;
    header[2] = 1;
    header[3] = 28;
    const std::vector<uint16_t> body = {65535, 28, 0, 1, 2, 3, 5, 6, 7, 1, 8, 2, 9, 10};
    std::string expected(reinterpret_cast<const char*>(header.data()), 1024);
    expected.append(reinterpret_cast<const char*>(body.data()), body.size() * 2);
    EXPECT_EQ(read_file(dir / "one.bin"), expected);
}

TEST(McFile, RandomSetsRoundTrip) {
    TempDir dir("mc_roundtrip");
    for (uint64_t seed : {1, 2, 3}) {
        McSet s = random_set(seed, 37, 50257, 300, 40);
        write_mc_file(dir / "a.bin", s);
        McSet back = read_mc_file(dir / "a.bin", 50257);
        EXPECT_EQ(back.source, dir / "a.bin");
        expect_same_items(s, back);
        write_mc_file(dir / "b.bin", back);
        EXPECT_EQ(read_file(dir / "a.bin"), read_file(dir / "b.bin"));
    }
}

class McFileDamage : public ::testing::Test {
protected:
    void SetUp() override {
        path_ = dir_ / "set.bin";
        write_mc_file(path_, small_set());
        ASSERT_EQ(fs::file_size(path_), 1106u);
        expect_same_items(read_mc_file(path_), small_set());
    }
    void expect_refused(const std::vector<std::string>& parts, int64_t vocab = kMcDelimiter) {
        std::vector<std::string> all = parts;
        all.push_back(path_);
        expect_error([&] { read_mc_file(path_, vocab); }, kExitData, all);
    }
    TempDir dir_{"mc_damage"};
    std::string path_;
};

TEST_F(McFileDamage, Header) {
    write_file(path_, read_file(path_).substr(0, 100));
    expect_refused({"is 100 bytes, shorter than its 1024-byte header"});
    SetUp();
    patch32(path_, 0, 123);
    expect_refused({"bad magic 123 at offset 0 (expected 20240522)"});
    patch32(path_, 0, 20240520);
    expect_refused({"bad magic 20240520", "token shard"});
    SetUp();
    patch32(path_, 4, 2);
    expect_refused({"unsupported version 2 at offset 4"});
    SetUp();
    patch32(path_, 8, 0);
    expect_refused({"example count 0 at offset 8 is not in 1..65535"});
    patch32(path_, 8, 70000);
    expect_refused({"example count 70000 at offset 8"});
    expect_error([&] { read_mc_file(dir_ / "missing.bin"); }, kExitIo, {"missing.bin"});
}

TEST_F(McFileDamage, Count) {
    patch32(path_, 8, 4);
    expect_refused({"example 3 at offset 1106", "ends before the example's 6 fields", "promises 4 examples"});
    SetUp();
    patch32(path_, 8, 2);
    expect_refused({"22 unexpected bytes after the last of its 2 examples (offset 1084)"});
    SetUp();
    write_file(path_, read_file(path_) + std::string(2, '\0'));
    expect_refused({"2 unexpected bytes after the last of its 3 examples (offset 1106)"});
    SetUp();
    write_file(path_, read_file(path_) + std::string(1, '\0'));
    expect_refused({"1 unexpected bytes after the last of its 3 examples (offset 1106)"});
}

TEST_F(McFileDamage, ExampleFields) {
    patch16(path_, 1052, 7);
    expect_refused({"example 1 at offset 1052: expected the delimiter 65535, found 7"});
    SetUp();
    patch16(path_, 1054, 31);
    expect_refused({"example 1 at offset 1052: its size field (offset 1054) says 31 bytes", "even"});
    patch16(path_, 1054, 20);
    expect_refused({"example 1 at offset 1052: its size field (offset 1054) says 20 bytes", "at least 22"});
    SetUp();
    patch16(path_, 1086, 40);
    expect_refused({"example 2 at offset 1084: its size field (offset 1086) says 40 bytes", "ends 22 bytes after"});
    SetUp();
    patch16(path_, 1056, 5);
    expect_refused({"example 1 at offset 1052: its index field (offset 1056) is 5"});
    SetUp();
    patch16(path_, 1060, 1);
    expect_refused({"example 1 at offset 1052: 1 candidate ending(s) (offset 1060)"});
    SetUp();
    patch16(path_, 1058, 3);
    expect_refused({"example 1 at offset 1052: label 3 (offset 1058) is not one of its 3 endings (0..2)"});
}

TEST_F(McFileDamage, Lengths) {
    patch16(path_, 1062, 0);
    expect_refused({"example 1 at offset 1052: the context is empty (length field at offset 1062)"});
    patch16(path_, 1062, 100);
    expect_refused({"example 1 at offset 1052: the context's 100 tokens (length at offset 1062) run past the "
                    "example's end at offset 1084"});
    SetUp();
    patch16(path_, 1068, 0);
    expect_refused({"example 1 at offset 1052: the ending 0 is empty (length field at offset 1068)"});
    SetUp();
    patch16(path_, 1076, 4);
    expect_refused({"example 1 at offset 1052: the ending 2's 4 tokens (length at offset 1076) run past"});
    SetUp();
    patch16(path_, 1076, 2);
    expect_refused({"example 1 at offset 1052: its size field says 32 bytes, but its fields end after 30"});
    SetUp();
    // Example 1 cut to 24 bytes and the file's examples re-packed: its third ending has no room.
    std::string s = read_file(path_);
    s.erase(1052 + 24, 8);
    write_file(path_, s);
    patch16(path_, 1054, 24);
    patch32(path_, 12, 28);
    expect_refused({"example 1 at offset 1052: ending 2's length field would be at offset 1076, past the example's end"});
}

TEST_F(McFileDamage, TokensAndLongest) {
    expect_refused({"example 1, ending 2 token 1 at offset 1080 is 12, not below the vocabulary size 12"}, 12);
    expect_refused({"example 0, context token 0 at offset 1036 is 1, not below the vocabulary size 1"}, 1);
    patch32(path_, 12, 30);
    expect_refused({"the header's longest-example field (offset 12) says 30 bytes, but the longest example takes 32"});
}

TEST(McFile, WriterRefuses) {
    TempDir dir("mc_writer");
    const std::string p = dir / "w.bin";
    expect_error([&] { write_mc_file(p, McSet{"nothing", {}}); }, kExitData, {"'nothing' holds no multiple-choice items"});
    McSet s = small_set();
    s.items[1].label = 3;
    expect_error([&] { write_mc_file(p, s); }, kExitData, {"'small': item 1 has label 3, not one of its 3 endings"});
    s = small_set();
    s.items[2].endings[1].clear();
    expect_error([&] { write_mc_file(p, s); }, kExitData, {"item 2, ending 1 is empty"});
    s = small_set();
    s.items[0].endings.resize(1);
    s.items[0].label = 0;
    expect_error([&] { write_mc_file(p, s); }, kExitData, {"item 0 has 1 candidate ending(s)"});
    s = small_set();
    s.items[0].context.clear();
    expect_error([&] { write_mc_file(p, s); }, kExitData, {"item 0 has an empty context"});
    s = small_set();
    s.items[1].endings[2][1] = 65535;
    expect_error([&] { write_mc_file(p, s); }, kExitData,
                 {"item 1, ending 2 token 1 is 65535, outside the vocabulary [0, 65535)"});
    s.items[1].endings[2][1] = -1;
    expect_error([&] { write_mc_file(p, s); }, kExitData, {"item 1, ending 2 token 1 is -1"});
    s = small_set();
    s.items[2].context.assign(40000, 1);
    expect_error([&] { write_mc_file(p, s); }, kExitUsage, {"item 2 takes 80020 bytes", "65534 per example"});
    EXPECT_FALSE(fs::exists(p));
}

// A directory, a FIFO and a symlink loop where a file belongs: cases holds (path, the system's reason).
// The FIFO is held open for writing, so that a reader that opens it anyway fails rather than waits.
class NotFiles {
public:
    explicit NotFiles(const TempDir& dir) {
        fs::create_directory(dir / "adir");
        fs::create_symlink("loop", dir / "loop");
        EXPECT_EQ(::mkfifo((dir / "fifo").c_str(), 0644), 0);
        writer_ = ::open((dir / "fifo").c_str(), O_RDWR | O_NONBLOCK);
        EXPECT_GE(writer_, 0);
        cases = {{dir / "adir", "Is a directory"},
                 {dir / "loop", "Too many levels of symbolic links"},
                 {dir / "fifo", "is a FIFO, not a regular file"}};
    }
    ~NotFiles() { ::close(writer_); }
    NotFiles(const NotFiles&) = delete;
    NotFiles& operator=(const NotFiles&) = delete;

    std::vector<std::pair<std::string, std::string>> cases;

private:
    int writer_ = -1;
};

TEST(McFile, NotAFileGivesTheSystemsReason) {
    TempDir dir("mc_not_files");
    const NotFiles not_files(dir);
    for (const auto& [path, why] : not_files.cases) {
        expect_error([&] { read_mc_file(path); }, kExitIo, {"cannot open '" + path + "' for reading: " + why});
    }
}

TEST(McFile, AFailedRewriteLeavesTheOldFileWhole) {
    // make data writes the set again over the last one; a disk that fills part way through must fail
    // the write and leave the old file as it was, not a truncated one.
    TempDir dir("mc_rewrite");
    const std::string p = dir / "set.bin";
    write_mc_file(p, small_set());
    const std::string good = read_file(p);
    std::string error;
    int code = 0;
    {
        test::FileSizeLimit limit(good.size() + 100);  // no gtest output while it holds
        try {
            write_mc_file(p, random_set(7, 50, 50257, 30, 10));
        } catch (const Error& e) {
            error = e.what();
            code = e.exit_code();
        }
    }
    EXPECT_EQ(code, kExitIo) << error;
    EXPECT_NE(error.find("File too large"), std::string::npos) << error;
    EXPECT_EQ(read_file(p), good);
    expect_same_items(read_mc_file(p), small_set());
    EXPECT_FALSE(fs::exists(p + ".tmp"));
}

// ---- rows and batches ----

struct ExpectedRow {
    std::vector<int> inputs, targets;
    int first = 0, count = 0;
};

ExpectedRow expected_row(const McItem& it, int cand, int T) {
    int64_t longest = 0;
    for (const auto& e : it.endings) longest = std::max(longest, int64_t(e.size()));
    const int64_t kept = std::min<int64_t>(int64_t(it.context.size()), T + 1 - longest);
    std::vector<int> seq(it.context.end() - kept, it.context.end());
    seq.insert(seq.end(), it.endings[size_t(cand)].begin(), it.endings[size_t(cand)].end());
    ExpectedRow r;
    r.inputs.assign(seq.begin(), seq.end() - 1);
    r.targets.assign(seq.begin() + 1, seq.end());
    r.first = int(kept) - 1;
    r.count = int(it.endings[size_t(cand)].size());
    return r;
}

// Runs a batcher over items [begin, end) and checks every batch against expected_row.
void check_batches(const McSet& set, int64_t begin, int64_t end, int max_B, int max_T, int t_multiple) {
    SCOPED_TRACE(format("items [%lld, %lld) B=%d T=%d multiple %d", (long long)begin, (long long)end, max_B, max_T,
                        t_multiple));
    const std::vector<int64_t> first_row = mc_first_rows(set);
    McBatcher batcher(set, begin, end, max_B, max_T, t_multiple, 1000);
    McBatch b;
    int64_t next_row = first_row[size_t(begin)];
    int batches = 0;
    while (batcher.next(b)) {
        batches++;
        EXPECT_GE(b.B, 1);
        EXPECT_LE(b.B, max_B);
        EXPECT_LE(b.T, max_T);
        ASSERT_EQ(b.inputs.size(), size_t(b.B) * b.T);
        ASSERT_EQ(b.targets.size(), size_t(b.B) * b.T);
        int longest = 0;
        for (int r = 0; r < b.B; r++) {
            const int64_t row = b.row[size_t(r)];
            ASSERT_EQ(row, next_row++);
            const int64_t item = std::upper_bound(first_row.begin(), first_row.end(), row) - first_row.begin() - 1;
            const ExpectedRow e = expected_row(set.items[size_t(item)], int(row - first_row[size_t(item)]), max_T);
            const int n = int(e.inputs.size());
            longest = std::max(longest, n);
            ASSERT_LE(n, b.T);
            std::vector<int> in(b.inputs.begin() + int64_t(r) * b.T, b.inputs.begin() + int64_t(r + 1) * b.T);
            std::vector<int> tg(b.targets.begin() + int64_t(r) * b.T, b.targets.begin() + int64_t(r + 1) * b.T);
            EXPECT_EQ(std::vector<int>(in.begin(), in.begin() + n), e.inputs) << "row " << row;
            EXPECT_EQ(std::vector<int>(tg.begin(), tg.begin() + n), e.targets) << "row " << row;
            EXPECT_EQ(std::vector<int>(in.begin() + n, in.end()), std::vector<int>(size_t(b.T - n), 0)) << "row " << row;
            EXPECT_EQ(std::vector<int>(tg.begin() + n, tg.end()), std::vector<int>(size_t(b.T - n), 0)) << "row " << row;
            EXPECT_EQ(b.first[size_t(r)], e.first) << "row " << row;
            EXPECT_EQ(b.count[size_t(r)], e.count) << "row " << row;
        }
        const int rounded = std::min(max_T, (longest + t_multiple - 1) / t_multiple * t_multiple);
        EXPECT_EQ(b.T, rounded);
    }
    EXPECT_EQ(next_row, first_row[size_t(end)]);
    EXPECT_FALSE(batcher.next(b));
    if (end > begin) {
        EXPECT_GE(batches, 1);
    }
}

TEST(McBatcher, RowsEqualDirectConstruction) {
    // Contexts up to 70 and endings up to 13 tokens, so T=37 cuts many items and T=200 none.
    const McSet set = random_set(7, 23, 1000, 70, 13);
    for (int B : {1, 3, 5, 64}) {
        for (int T : {13, 37, 200}) {
            for (int m : {1, 16}) check_batches(set, 0, int64_t(set.items.size()), B, T, m);
        }
    }
    check_batches(set, 5, 11, 4, 37, 1);
    check_batches(set, 9, 9, 4, 37, 1);
}

TEST(McBatcher, TruncatesTheContextAlikeForEveryCandidate) {
    McSet set{"cut", {{{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, {{21, 22, 23}, {31, 32, 33, 34, 35}}, 0}}};
    McBatcher batcher(set, 0, 1, 2, 8, 1, 100);
    McBatch b;
    ASSERT_TRUE(batcher.next(b));
    // kept = min(10, 8 + 1 - 5) = 4 context tokens: 7 8 9 10.
    EXPECT_EQ(b.T, 8);
    EXPECT_EQ(std::vector<int>(b.inputs.begin(), b.inputs.begin() + 8), (std::vector<int>{7, 8, 9, 10, 21, 22, 0, 0}));
    EXPECT_EQ(std::vector<int>(b.targets.begin(), b.targets.begin() + 8), (std::vector<int>{8, 9, 10, 21, 22, 23, 0, 0}));
    EXPECT_EQ(std::vector<int>(b.inputs.begin() + 8, b.inputs.end()), (std::vector<int>{7, 8, 9, 10, 31, 32, 33, 34}));
    EXPECT_EQ(std::vector<int>(b.targets.begin() + 8, b.targets.end()), (std::vector<int>{8, 9, 10, 31, 32, 33, 34, 35}));
    EXPECT_EQ(b.first, (std::vector<int>{3, 3}));
    EXPECT_EQ(b.count, (std::vector<int>{3, 5}));
    EXPECT_FALSE(batcher.next(b));
}

TEST(McBatcher, Errors) {
    McSet set = small_set();
    set.source = "s.bin";
    expect_error([&] { McBatcher(set, 0, 3, 4, 2, 1, 100); }, kExitData,
                 {"'s.bin': item 1 has an ending of 3 tokens, more than the 2 positions"});
    expect_error([&] { McBatcher(set, 0, 3, 4, 8, 1, 14); }, kExitData,
                 {"'s.bin': item 2, context token 0 is 14, outside the vocabulary [0, 14)"});
    expect_error([&] { McBatcher(set, 2, 4, 4, 8, 1, 100); }, kExitUsage, {"items [2, 4) of 3"});
    expect_error([&] { McBatcher(set, 0, 3, 0, 8, 1, 100); }, kExitUsage, {"B=0"});
}

TEST(McBatcher, RankSplit) {
    for (int64_t n : {0, 1, 2, 7, 10042}) {
        for (int w : {1, 2, 3, 8}) {
            int64_t next = 0, lo = n, hi = 0;
            for (int r = 0; r < w; r++) {
                auto [b, e] = mc_rank_items(n, r, w);
                EXPECT_EQ(b, next) << n << " items, rank " << r << " of " << w;
                next = e;
                lo = std::min(lo, e - b);
                hi = std::max(hi, e - b);
            }
            EXPECT_EQ(next, n);
            EXPECT_LE(hi - lo, 1);
        }
    }
}

// ---- packed rows (the GPU's layout) ----

// Runs McPackedBatcher over the whole set and checks, for every ending, that what each of its scored
// positions sees under the attention groups (the earlier positions of its row in group 0 or in its own
// group) is exactly McBatcher's row of that ending up to the same prediction: the same tokens at the
// same positions, in order, and the same target. So the packed forward computes every ending's losses
// as its own row would. Also: every set row once, in order; B x T <= max_cells and every batch but the
// last full (its next row would not have fitted); at most max_cells scored positions a batch and max_T a
// row; T rounded; with share, an item whose endings fit in max_T positions beside its context (and score
// at most max_T) takes one row; mc_accumulate_packed's sums bit for bit
// mc_accumulate's over McBatcher's rows holding the same loss values (Loss = float as the GPU returns,
// and double, whose sums depend on the order). *run_out (if given): the positions run (B x T summed).
// With several: the set must take several batches and some row must be padded (so a wrong stride shows).
template <class Loss>
void check_packed(const McSet& set, int max_T, int t_multiple, int64_t max_cells, bool share, uint64_t seed,
                  bool several = true, int64_t* run_out = nullptr, bool* more_scored_out = nullptr) {
    SCOPED_TRACE(format("T=%d multiple %d cells %lld share %d, %zu-byte losses", max_T, t_multiple,
                        (long long)max_cells, int(share), sizeof(Loss)));
    const std::vector<int64_t> first_row = mc_first_rows(set);
    const int64_t rows = first_row.back();
    // Each set row's loss at prediction j of its ending: random, shared by both layouts.
    SplitMix64 rng(seed);
    std::vector<std::vector<Loss>> value{size_t(rows)};
    for (int64_t r = 0; r < rows; r++) {
        const int64_t item = std::upper_bound(first_row.begin(), first_row.end(), r) - first_row.begin() - 1;
        for (size_t j = 0; j < set.items[size_t(item)].endings[size_t(r - first_row[size_t(item)])].size(); j++) {
            const double u = double(rng.next() >> 11) * 0x1p-53;  // 53 random bits
            value[size_t(r)].push_back(Loss(20.0 * u * u));
        }
    }
    const double unset = std::numeric_limits<double>::quiet_NaN();
    std::vector<double> packed_sum(size_t(rows), unset), full_sum(size_t(rows), unset);
    {  // McBatcher's rows, one batch of every row, with the same loss values at the ending's positions
        McBatcher per_row(set, 0, int64_t(set.items.size()), int(rows), max_T, 1, 1000);
        McBatch b;
        while (per_row.next(b)) {
            std::vector<Loss> full(size_t(b.B) * size_t(b.T), std::numeric_limits<Loss>::quiet_NaN());
            for (int r = 0; r < b.B; r++) {
                for (int j = 0; j < b.count[size_t(r)]; j++) {
                    full[size_t(r) * size_t(b.T) + size_t(b.first[size_t(r)] + j)] = value[size_t(b.row[size_t(r)])][size_t(j)];
                }
            }
            mc_accumulate(b, full.data(), full_sum);
        }
    }
    McPackedBatcher batcher(set, 0, int64_t(set.items.size()), max_T, t_multiple, 1000, max_cells, share);
    McPackedBatch b;
    int64_t next_row = 0, run = 0;
    int batches = 0;
    bool padded = false, more_scored_than_run = false;
    while (batcher.next(b)) {
        batches++;
        SCOPED_TRACE(format("batch %d", batches));
        const size_t cells = size_t(b.B) * size_t(b.T);
        run += int64_t(cells);
        EXPECT_LE(int64_t(cells), max_cells);
        EXPECT_LE(int64_t(b.scored.size()), max_cells) << "more scored positions than the classifier's rows";
        more_scored_than_run |= b.scored.size() > cells;
        EXPECT_LE(b.T, max_T);
        EXPECT_EQ(b.T % t_multiple == 0 || b.T == max_T, true) << "T=" << b.T;
        ASSERT_EQ(b.inputs.size(), cells);
        ASSERT_EQ(b.positions.size(), cells);
        ASSERT_EQ(b.groups.size(), cells);
        ASSERT_EQ(b.scored.size(), b.targets.size());
        ASSERT_EQ(b.row.size(), b.count.size());
        std::vector<Loss> losses;
        size_t at = 0;  // into scored
        int longest = 0;
        std::vector<int> endings_in_row(size_t(b.B), 0), scored_in_row(size_t(b.B), 0);
        for (size_t e = 0; e < b.row.size(); e++) {
            const int64_t row = b.row[e];
            ASSERT_EQ(row, next_row++);
            const int64_t item = std::upper_bound(first_row.begin(), first_row.end(), row) - first_row.begin() - 1;
            const int cand = int(row - first_row[size_t(item)]);
            const ExpectedRow want = expected_row(set.items[size_t(item)], cand, max_T);
            ASSERT_EQ(b.count[e], want.count) << "row " << row;
            int batch_row = -1;
            for (int j = 0; j < b.count[e]; j++, at++) {
                ASSERT_LT(at, b.scored.size());
                const int i = b.scored[at];
                ASSERT_GE(i, 0);
                ASSERT_LT(size_t(i), cells);
                const int r = i / b.T, base = r * b.T;
                if (j == 0) {
                    batch_row = r;
                    endings_in_row[size_t(r)]++;
                }
                scored_in_row[size_t(r)]++;
                ASSERT_EQ(r, batch_row) << "row " << row << ": an ending's predictions in two batch rows";
                // What position i sees: (position, token) of every visible key, in order.
                std::vector<int> seen_pos, seen_tok;
                for (int k = base; k <= i; k++) {
                    if (b.groups[size_t(k)] == 0 || b.groups[size_t(k)] == b.groups[size_t(i)]) {
                        seen_pos.push_back(b.positions[size_t(k)]);
                        seen_tok.push_back(b.inputs[size_t(k)]);
                    }
                }
                const int p = want.first + j;  // the prediction's position in McBatcher's row
                std::vector<int> want_pos(size_t(p + 1));
                for (int t = 0; t <= p; t++) want_pos[size_t(t)] = t;
                EXPECT_EQ(seen_pos, want_pos) << "row " << row << " prediction " << j;
                EXPECT_EQ(seen_tok, std::vector<int>(want.inputs.begin(), want.inputs.begin() + p + 1))
                    << "row " << row << " prediction " << j;
                EXPECT_EQ(b.targets[at], want.targets[size_t(p)]) << "row " << row << " prediction " << j;
                longest = std::max(longest, i - base + 1);
                losses.push_back(value[size_t(row)][size_t(j)]);
            }
        }
        EXPECT_EQ(at, b.scored.size());
        for (int r = 0; r < b.B; r++) {
            EXPECT_GE(endings_in_row[size_t(r)], 1) << "batch row " << r << " holds no ending";
            EXPECT_LE(scored_in_row[size_t(r)], max_T) << "batch row " << r;
            if (!share) {
                EXPECT_EQ(endings_in_row[size_t(r)], 1) << "batch row " << r;
            }
            // Padding after the row's last scored position: token 0, group -1.
            int last = b.T - 1;
            while (last >= 0 && b.groups[size_t(r * b.T + last)] == -1) last--;
            padded |= last + 1 < b.T;
            for (int t = last + 1; t < b.T; t++) EXPECT_EQ(b.inputs[size_t(r * b.T + t)], 0);
        }
        EXPECT_EQ(b.T, std::min(max_T, (longest + t_multiple - 1) / t_multiple * t_multiple));
        mc_accumulate_packed(b, losses.data(), packed_sum);
        // Full unless it is the last: the next item's next row would not have fitted.
        if (next_row < rows) {
            const int64_t item = std::upper_bound(first_row.begin(), first_row.end(), next_row) - first_row.begin() - 1;
            const McItem& it = set.items[size_t(item)];
            // The next batch row: the context, then endings from next_row's on while they fit in max_T
            // positions with at most max_T scored (one ending without share).
            int len = int(mc_kept_context(it, max_T)), next_scored = 0;
            for (size_t c = size_t(next_row - first_row[size_t(item)]), first = c; c < it.endings.size(); c++) {
                const int n = int(it.endings[c].size());
                if (c > first && (!share || len + n - 1 > max_T || next_scored + n > max_T)) break;
                len += n - 1;
                next_scored += n;
            }
            const int t = std::min(max_T, (std::max(b.T, len) + t_multiple - 1) / t_multiple * t_multiple);
            EXPECT_TRUE(int64_t(b.B + 1) * t > max_cells || int64_t(b.scored.size()) + next_scored > max_cells)
                << "batch " << batches << " could have taken row " << next_row;
        }
    }
    EXPECT_EQ(next_row, rows);
    EXPECT_FALSE(batcher.next(b));
    if (several) {
        EXPECT_GE(batches, 2);
        EXPECT_TRUE(padded) << "no row shorter than its batch: the test would not see a wrong stride";
    }
    for (int64_t r = 0; r < rows; r++) {
        EXPECT_FALSE(std::isnan(packed_sum[size_t(r)])) << "row " << r;
        uint64_t a, c;
        std::memcpy(&a, &full_sum[size_t(r)], sizeof(a));
        std::memcpy(&c, &packed_sum[size_t(r)], sizeof(c));
        EXPECT_EQ(c, a) << "row " << r << ": packed " << packed_sum[size_t(r)] << ", per row " << full_sum[size_t(r)];
    }
    if (share) {  // an item that fits beside its context in one row takes one row
        McPackedBatcher again(set, 0, int64_t(set.items.size()), max_T, t_multiple, 1000, max_cells, share);
        std::vector<std::set<int64_t>> rows_of_item(set.items.size());  // (batch, batch row) pairs, encoded
        int batch = 0;
        while (again.next(b)) {
            size_t at = 0;
            for (size_t e = 0; e < b.row.size(); e++) {
                const int64_t item = std::upper_bound(first_row.begin(), first_row.end(), b.row[e]) - first_row.begin() - 1;
                rows_of_item[size_t(item)].insert(int64_t(batch) * 1000000 + b.scored[at] / b.T);
                at += size_t(b.count[e]);
            }
            batch++;
        }
        for (size_t i = 0; i < set.items.size(); i++) {
            const McItem& it = set.items[i];
            int64_t need = mc_kept_context(it, max_T), scored = 0;
            for (const auto& e : it.endings) {
                need += int64_t(e.size()) - 1;
                scored += int64_t(e.size());
            }
            if (need <= max_T && scored <= max_T) {
                EXPECT_EQ(rows_of_item[i].size(), 1u) << "item " << i << " needs " << need << " positions, " << scored
                                                      << " scored";
            }
        }
    }
    if (run_out != nullptr) *run_out = run;
    if (more_scored_out != nullptr) *more_scored_out = more_scored_than_run;
}

TEST(McPackedBatcher, EveryEndingSeesExactlyItsOwnRow) {
    // Contexts up to 70 and endings up to 13 tokens: rows of many lengths; T=37 cuts contexts and splits
    // items over several rows, T=200 does neither.
    const McSet set = random_set(11, 23, 1000, 70, 13);
    for (bool share : {true, false}) {
        for (int m : {1, 16}) {
            check_packed<float>(set, 37, m, 3 * 37, share, 1);
            check_packed<float>(set, 200, m, 4 * 200, share, 2);
            check_packed<double>(set, 37, m, 37, share, 3, m > 1);  // one row a batch
            check_packed<double>(set, 200, m, 8 * 200, share, 4);
        }
    }
}

TEST(McPackedBatcher, ShortContextsScoreMorePositionsThanTheyRun) {
    // A 1-token context before 8 endings of 1 or 2 tokens: the context's last position is scored once
    // per ending, so a packed row scores more positions than it has; rows and batches keep the scored
    // ones within max_T and max_cells.
    McSet set{"short", {}};
    SplitMix64 rng(9);
    for (int i = 0; i < 20; i++) {
        McItem it;
        it.context = test::random_tokens<int32_t>(1, 1000, rng.next());
        for (int e = 0; e < 8; e++) it.endings.push_back(test::random_tokens<int32_t>(1 + rng.below(2), 1000, rng.next()));
        set.items.push_back(std::move(it));
    }
    bool more = false;
    check_packed<float>(set, 8, 1, 16, true, 6, true, nullptr, &more);
    EXPECT_TRUE(more) << "no batch scored more positions than it ran: the case is not exercised";
    for (int m : {1, 16}) {
        check_packed<float>(set, 8, m, 16, true, 6, m > 1);
        check_packed<double>(set, 24, m, 48, true, 7);
        check_packed<double>(set, 8, m, 8, false, 8, false);
    }
}

TEST(McPackedBatcher, SharingRunsEachContextOnce) {
    // The quick start's held-out set: 64-token contexts, four 16-token endings. One row per item of
    // 64 + 4 x 15 = 124 positions instead of four of 79.
    McSet set{"quick-start-like", {}};
    for (int i = 0; i < 32; i++) {
        McItem it;
        it.context = test::random_tokens<int32_t>(64, 1000, uint64_t(i));
        for (int e = 0; e < 4; e++) it.endings.push_back(test::random_tokens<int32_t>(16, 1000, uint64_t(100 * i + e)));
        set.items.push_back(std::move(it));
    }
    int64_t shared = 0, per_row = 0;
    check_packed<float>(set, 512, 1, 16384, true, 5, false, &shared);
    check_packed<float>(set, 512, 1, 16384, false, 5, false, &per_row);
    EXPECT_EQ(shared, 32 * 124);
    EXPECT_EQ(per_row, 32 * 4 * 79);
}

TEST(McPackedBatcher, Errors) {
    McSet set = small_set();
    set.source = "s.bin";
    expect_error([&] { McPackedBatcher(set, 0, 3, 2, 1, 100, 64, true); }, kExitData,
                 {"'s.bin': item 1 has an ending of 3 tokens, more than the 2 positions"});
    expect_error([&] { McPackedBatcher(set, 0, 3, 8, 1, 14, 64, true); }, kExitData,
                 {"'s.bin': item 2, context token 0 is 14, outside the vocabulary [0, 14)"});
    expect_error([&] { McPackedBatcher(set, 2, 4, 8, 1, 100, 64, true); }, kExitUsage, {"items [2, 4) of 3"});
    expect_error([&] { McPackedBatcher(set, 0, 3, 0, 1, 100, 64, true); }, kExitUsage, {"T=0"});
    expect_error([&] { McPackedBatcher(set, 0, 3, 8, 1, 100, 7, true); }, kExitUsage, {"max_cells 7 is below max_T 8"});
}

// ---- scores ----

TEST(McScore, SumMeanTiesAndMargins) {
    McSet set{"scores", {}};
    set.items.push_back({{1}, {{1, 1}, {1, 1, 1, 1}}, 1});        // sums 3, 5: acc picks 0; means 1.5, 1.25: norm picks 1
    set.items.push_back({{1}, {{1}, {1}, {1}}, 2});               // sums 2, 2, 2: a tie goes to candidate 0
    set.items.push_back({{1}, {{1}, {1, 1}, {1}}, 2});            // sums 4, 3, 1: both pick 2
    McResult r = mc_score(set, {3.0, 5.0, 2.0, 2.0, 2.0, 4.0, 3.0, 1.0});
    EXPECT_EQ(r.pred, (std::vector<int>{0, 0, 2}));
    EXPECT_EQ(r.pred_norm, (std::vector<int>{1, 0, 2}));
    EXPECT_EQ(r.items, 3);
    EXPECT_EQ(r.correct, 1);
    EXPECT_EQ(r.correct_norm, 2);
    EXPECT_DOUBLE_EQ(r.acc(), 1.0 / 3);
    EXPECT_DOUBLE_EQ(r.acc_norm(), 2.0 / 3);
    EXPECT_EQ(r.loss_count, (std::vector<int>{2, 4, 1, 1, 1, 1, 2, 1}));
    EXPECT_DOUBLE_EQ(mc_margin(r, 0, false), 2.0);
    EXPECT_DOUBLE_EQ(mc_margin(r, 0, true), 0.25);
    EXPECT_DOUBLE_EQ(mc_margin(r, 1, false), 0.0);
    EXPECT_DOUBLE_EQ(mc_margin(r, 2, false), 2.0);
    EXPECT_DOUBLE_EQ(mc_margin(r, 2, true), 0.5);
    expect_error([&] { mc_score(set, {1.0}); }, kExitUsage, {"1 row sums for the 8 rows of 'scores'"});
}

TEST(McScore, FingerprintSeesEveryToken) {
    const McSet a = random_set(3, 10, 1000, 20, 8);
    McSet b = a;
    EXPECT_EQ(mc_fingerprint(a), mc_fingerprint(b));
    b.items[7].endings[1].back() ^= 1;
    EXPECT_NE(mc_fingerprint(a), mc_fingerprint(b));
    b = a;
    b.items[2].label = (b.items[2].label + 1) % int(b.items[2].endings.size());
    EXPECT_NE(mc_fingerprint(a), mc_fingerprint(b));
}

// ---- the CPU reference ----

// A tiny model with larger weights than GPT-2's initialisation, so that candidates score far apart.
std::vector<float> tiny_params(const GPT2Config& c, uint64_t seed) {
    std::vector<float> p(size_t(num_parameters(c)));
    SplitMix64 rng(seed);
    const auto tensors = param_tensors(c);
    for (int i = 0; i < kNumParamTensors; i++) {
        const ParamTensorInfo& t = tensors[size_t(i)];
        const bool ln_weight = i == kLn1w || i == kLn2w || i == kLnfw;
        for (int64_t j = 0; j < t.numel; j++) {
            const double u = double(rng.next() >> 11) / double(1ull << 53) - 0.5;
            p[size_t(t.offset + j)] = float(ln_weight ? 1.0 + 0.4 * u : 0.6 * u);
        }
    }
    const int64_t C = c.channels;
    for (int64_t j = int64_t(c.vocab_size) * C; j < int64_t(c.padded_vocab_size) * C; j++) p[size_t(j)] = 0.0f;
    return p;
}

// The sum of an ending's token losses from one forward of that candidate alone: -log softmax(logits)[target]
// over the first V logits, in double.
double direct_sum(cpu::GPT2<float>& model, const McItem& it, int cand, int T) {
    const ExpectedRow e = expected_row(it, cand, T);
    const int n = int(e.inputs.size());
    model.forward(e.inputs.data(), nullptr, 1, n);
    const GPT2Config& c = model.config();
    const std::vector<float>& logits = model.activations().logits;
    double sum = 0;
    for (int t = e.first; t < e.first + e.count; t++) {
        const float* z = logits.data() + size_t(t) * size_t(c.padded_vocab_size);
        double m = -INFINITY, s = 0;
        for (int v = 0; v < c.vocab_size; v++) m = std::max(m, double(z[v]));
        for (int v = 0; v < c.vocab_size; v++) s += std::exp(double(z[v]) - m);
        sum += std::log(s) + m - double(z[e.targets[size_t(t)]]);
    }
    return sum;
}

TEST(McCpu, EqualsDirectComputation) {
    const GPT2Config c = make_config(2, 32, 4, 67, 16);
    const std::vector<float> params = tiny_params(c, 5);
    cpu::GPT2<float> model(c, params);
    // Contexts up to 24 tokens: some items do not fit T = 16 and are cut.
    McSet set = random_set(11, 9, 67, 24, 6, 2, 5);
    set.source = "tiny";
    const McResult r = mc_eval_cpu(model, set, 1, 16);
    ASSERT_EQ(r.items, 9);
    int cut = 0, decided = 0;
    for (int64_t i = 0; i < r.items; i++) {
        const McItem& it = set.items[size_t(i)];
        cut += int64_t(it.context.size()) + mc_longest_ending(it) - 1 > 16;
        std::vector<double> direct;
        for (int cand = 0; cand < int(it.endings.size()); cand++) {
            direct.push_back(direct_sum(model, it, cand, 16));
            const double got = r.loss_sum[size_t(r.first_row[size_t(i)] + cand)];
            EXPECT_NEAR(got, direct.back(), 1e-5 * std::max(1.0, std::abs(direct.back())))
                << "item " << i << " cand " << cand;
        }
        const int best = int(std::min_element(direct.begin(), direct.end()) - direct.begin());
        if (mc_margin(r, i, false) > 1e-3) {
            EXPECT_EQ(r.pred[size_t(i)], best) << "item " << i;
            decided++;
        }
    }
    EXPECT_GE(cut, 2) << "the set should exercise the truncation";
    EXPECT_GE(decided, 7) << "the candidates should score apart";

    // Batching changes nothing, bit for bit.
    for (int B : {3, 7, 64}) {
        const McResult rb = mc_eval_cpu(model, set, B, 16);
        EXPECT_EQ(rb.loss_sum, r.loss_sum) << "B=" << B;
        EXPECT_EQ(rb.pred, r.pred);
        EXPECT_EQ(rb.pred_norm, r.pred_norm);
    }
    cpu::GPT2<double> model64(c, params);
    const McResult r64 = mc_eval_cpu(model64, set, 4, 16);
    for (size_t k = 0; k < r.loss_sum.size(); k++) {
        EXPECT_NEAR(r64.loss_sum[k], r.loss_sum[k], 1e-5 * std::max(1.0, std::abs(r64.loss_sum[k])));
    }
    expect_error([&] { mc_eval_cpu(model, set, 4, 17); }, kExitUsage, {"T=17 is longer than the model's maxT=16"});
}

// ---- HellaSwag JSONL ----

const char* kEncoderJson = ".deps/gpt2/encoder.json";
const char* kVocabBpe = ".deps/gpt2/vocab.bpe";

bool have_vocab() { return fs::exists(kEncoderJson) && fs::exists(kVocabBpe); }

#define REQUIRE_VOCAB()                                                                                            \
    do {                                                                                                           \
        if (!have_vocab()) GTEST_SKIP() << "skipped: GPT-2 vocabulary not in .deps/gpt2 (run scripts/setup.sh)"; \
    } while (0)

const Tokenizer& gpt2() {
    static const Tokenizer tok = load_gpt2_vocab_files(kEncoderJson, kVocabBpe);
    return tok;
}
const Gpt2Encoder& encoder() {
    static const Gpt2Encoder enc(gpt2());
    return enc;
}
std::vector<int32_t> encode(const std::string& text) {
    Gpt2Encoder::Context ctx(encoder());
    std::vector<uint32_t> ids = encoder().encode_ordinary(ctx, text);
    return std::vector<int32_t>(ids.begin(), ids.end());
}

// llm.c's example row, verbatim, then the same with only ctx_a/ctx_b and a string label, and a row with
// an empty ctx_b; a blank line and a CRLF ending among them.
const char* kHellaswagRows =
    R"({"ind": 24, "activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he", )"
    R"("ctx": "A man is sitting on a roof. he", "split": "val", "split_type": "indomain", "label": 3, "endings": )"
    R"(["is using wrap to wrap a pair of skis.", "is ripping level tiles off.", "is holding a rubik's cube.", )"
    R"("starts pulling up roofing on a roof."], "source_id": "activitynet~v_-JhWjGDPHMY"})"
    "\n\n"
    R"({"ind": 25, "ctx_a": "A man is sitting on a roof.", "ctx_b": "he", "label": "1", "endings": ["a", "b c", "d", )"
    R"("e"]})"
    "\r\n"
    R"({"ind": 26, "ctx_a": "Cooking eggs.", "ctx_b": "", "label": 0, "endings": ["First,", "x", "y", "z"]})"
    "\n";

TEST(Hellaswag, RowsEncodedAsLlmcDoes) {
    REQUIRE_VOCAB();
    TempDir dir("hellaswag");
    write_file(dir / "val.jsonl", kHellaswagRows);
    const McSet set = read_hellaswag_jsonl(dir / "val.jsonl", encoder());
    ASSERT_EQ(set.items.size(), 3u);
    const McItem& a = set.items[0];
    EXPECT_EQ(a.label, 3);
    EXPECT_EQ(a.context, encode("A man is sitting on a roof. he"));
    // Ids straight from encoder.json: "A", " man", " is" ... " he"; the endings start with " is".
    EXPECT_EQ(a.context[0], 32);
    EXPECT_EQ(a.context[1], 582);
    EXPECT_EQ(a.context[2], 318);
    EXPECT_EQ(a.context.back(), 339);
    ASSERT_EQ(a.endings.size(), 4u);
    EXPECT_EQ(a.endings[0], encode(" is using wrap to wrap a pair of skis."));
    EXPECT_EQ(a.endings[0][0], 318);
    EXPECT_EQ(a.endings[3], encode(" starts pulling up roofing on a roof."));
    const McItem& b = set.items[1];
    EXPECT_EQ(b.context, a.context);
    EXPECT_EQ(b.label, 1);
    EXPECT_EQ(b.endings[1], encode(" b c"));
    const McItem& c = set.items[2];
    EXPECT_EQ(c.context, encode("Cooking eggs."));
    EXPECT_EQ(c.endings.size(), 4u);
}

TEST(Hellaswag, MalformedRowsNameTheLine) {
    REQUIRE_VOCAB();
    TempDir dir("hellaswag_bad");
    const std::string good = R"({"ctx": "A b", "endings": ["c", "d", "e", "f"], "label": 2})";
    auto refused = [&](const std::string& line, const std::string& message) {
        SCOPED_TRACE(line);
        write_file(dir / "bad.jsonl", good + "\n" + line + "\n");
        expect_error([&] { read_hellaswag_jsonl(dir / "bad.jsonl", encoder()); }, kExitData,
                     {dir / "bad.jsonl", "line 2", message});
    };
    refused(R"({"ctx": "A b", "endings": ["c", "d", "e", "f"], "label": 2)", "is not valid JSON");
    refused(R"(["A b"])", "expected a JSON object, found array");
    refused(R"({"endings": ["c", "d", "e", "f"], "label": 0})", "no context");
    refused(R"({"ctx": 5, "endings": ["c", "d", "e", "f"], "label": 0})", "\"ctx\" is number, expected a string");
    refused(R"({"ctx_a": "A", "ctx_b": 3, "endings": ["c", "d", "e", "f"], "label": 0})", "\"ctx_b\" is number");
    refused(R"({"ctx": "", "endings": ["c", "d", "e", "f"], "label": 0})", "the context is empty");
    refused(R"({"ctx": "A b", "label": 0})", "no \"endings\" list");
    refused(R"({"ctx": "A b", "endings": "c d", "label": 0})", "\"endings\" is string, expected a list of strings");
    // llm.c's writer and reader take 4 endings and nothing else.
    refused(R"({"ctx": "A b", "endings": ["c"], "label": 0})", "1 ending(s); HellaSwag's rows have 4");
    refused(R"({"ctx": "A b", "endings": ["c", "d", "e"], "label": 0})", "3 ending(s); HellaSwag's rows have 4");
    refused(R"({"ctx": "A b", "endings": ["c", "d", "e", "f", "g"], "label": 0})", "5 ending(s)");
    refused(R"({"ctx": "A b", "endings": ["c", 4, "e", "f"], "label": 0})", "ending 1 is number, expected a string");
    refused(R"({"ctx": "A b", "endings": ["c", "", "e", "f"], "label": 0})", "ending 1 is empty");
    refused(R"({"ctx": "A b", "endings": ["c", "d", "e", "f"]})", "no \"label\"");
    refused(R"({"ctx": "A b", "endings": ["c", "d", "e", "f"], "label": 1.5})",
            "\"label\" is 1.5, expected an integer");
    refused(R"({"ctx": "A b", "endings": ["c", "d", "e", "f"], "label": "x"})",
            "\"label\" is \"x\", expected an integer");
    refused(R"({"ctx": "A b", "endings": ["c", "d", "e", "f"], "label": 4})",
            "label 4 is not one of the 4 endings (0..3)");
    refused(R"({"ctx": "A b", "endings": ["c", "d", "e", "f"], "label": -1})", "label -1 is not one of the 4 endings");
    // Rows the eval .bin cannot hold are the input's fault: named by their line, exit code 4.
    std::string words;
    for (int i = 0; i < 33000; i++) words += " w";
    write_file(dir / "long.jsonl",
               good + "\n{\"ctx\": \"A\", \"endings\": [\"" + words + "\", \"d\", \"e\", \"f\"], \"label\": 0}\n");
    expect_error([&] { read_hellaswag_jsonl(dir / "long.jsonl", encoder()); }, kExitData,
                 {dir / "long.jsonl", "line 2", "context of 1 tokens, 4 endings", "more than the 65534"});
    std::string many;
    for (int i = 0; i < kMcMaxExamples; i++) many += good + "\n";
    write_file(dir / "many.jsonl", many + good + "\n");
    expect_error([&] { read_hellaswag_jsonl(dir / "many.jsonl", encoder()); }, kExitData,
                 {dir / "many.jsonl", "line 65536", "more than 65535 rows"});
    write_file(dir / "empty.jsonl", "\n  \n");
    expect_error([&] { read_hellaswag_jsonl(dir / "empty.jsonl", encoder()); }, kExitData, {"holds no HellaSwag rows"});
    expect_error([&] { read_hellaswag_jsonl(dir / "none.jsonl", encoder()); }, kExitIo, {"none.jsonl"});
}

// ---- prepare_eval ----

// A vocabulary of 100 tokens: even ids read " wN" (they start a word), odd ids "xN"; 99 is <|endoftext|>.
Tokenizer word_vocab() {
    std::vector<std::string> t;
    for (int i = 0; i < 100; i++) t.push_back(i % 2 == 0 ? format(" w%d", i) : format("x%d", i));
    return Tokenizer(t, 99);
}

// Documents of 40..400 random tokens, each after <|endoftext|>.
std::vector<uint32_t> word_stream(uint64_t seed, size_t n) {
    SplitMix64 rng(seed);
    std::vector<uint32_t> s;
    while (s.size() < n) {
        s.push_back(99);
        const uint64_t len = 40 + rng.below(361);
        for (uint64_t k = 0; k < len && s.size() < n; k++) s.push_back(uint32_t(rng.below(99)));
    }
    return s;
}

// Where `w` occurs in `s` (every position).
std::vector<int64_t> occurrences(const std::vector<uint32_t>& s, const std::vector<int32_t>& w) {
    std::vector<int64_t> at;
    for (size_t q = 0; q + w.size() <= s.size(); q++) {
        if (std::equal(w.begin(), w.end(), s.begin() + int64_t(q), [](int32_t a, uint32_t b) { return uint32_t(a) == b; })) {
            at.push_back(int64_t(q));
        }
    }
    return at;
}

TEST(PrepareEval, HeldoutSetFollowsItsRules) {
    const Tokenizer tok = word_vocab();
    const std::vector<uint32_t> stream = word_stream(3, 60000);
    HeldoutOptions o;
    o.items = 200;
    o.context = 23;
    o.ending = 7;
    o.choices = 4;
    o.seed = 9;
    const McSet set = make_heldout_set(stream, tok, o, "stream");
    ASSERT_EQ(set.items.size(), 200u);
    std::vector<int> labels(4, 0);
    int64_t last_passage = -1;
    for (size_t i = 0; i < set.items.size(); i++) {
        SCOPED_TRACE(format("item %zu", i));
        const McItem& it = set.items[i];
        ASSERT_EQ(it.context.size(), 23u);
        ASSERT_EQ(it.endings.size(), 4u);
        labels[size_t(it.label)]++;
        // context + true ending: one window of the stream, without <|endoftext|>, after the previous one.
        std::vector<int32_t> passage = it.context;
        passage.insert(passage.end(), it.endings[size_t(it.label)].begin(), it.endings[size_t(it.label)].end());
        const std::vector<int64_t> at = occurrences(stream, passage);
        ASSERT_EQ(at.size(), 1u);
        const int64_t p = at[0];
        EXPECT_GE(p, last_passage + 30) << "passages overlap or are out of order";
        last_passage = p;
        EXPECT_EQ(std::count(passage.begin(), passage.end(), 99), 0);
        std::set<std::vector<int32_t>> distinct;
        for (size_t e = 0; e < 4; e++) {
            const std::vector<int32_t>& end = it.endings[e];
            ASSERT_EQ(end.size(), 7u);
            EXPECT_EQ(end[0] % 2, 0) << "ending " << e << " does not start a word";
            EXPECT_EQ(std::count(end.begin(), end.end(), 99), 0);
            distinct.insert(end);
            if (int(e) == it.label) continue;
            const std::vector<int64_t> where = occurrences(stream, end);
            ASSERT_FALSE(where.empty()) << "distractor " << e << " is not from the text";
            for (int64_t q : where) EXPECT_FALSE(q < p + 30 && q + 7 > p) << "distractor overlaps its passage";
        }
        EXPECT_EQ(distinct.size(), 4u);
    }
    for (int l = 0; l < 4; l++) EXPECT_GE(labels[size_t(l)], 30) << "label " << l;

    McSet again = make_heldout_set(stream, tok, o, "stream");
    expect_same_items(set, again);
    o.seed = 10;
    McSet other = make_heldout_set(stream, tok, o, "stream");
    EXPECT_NE(mc_fingerprint(other), mc_fingerprint(set));

    o.word_start = false;
    McSet anywhere = make_heldout_set(stream, tok, o, "stream");
    int odd = 0;
    for (const McItem& it : anywhere.items) {
        for (const auto& e : it.endings) odd += e[0] % 2;
    }
    EXPECT_GT(odd, 200) << "--any-start should let endings start inside words";

    o.items = 5000;
    expect_error([&] { make_heldout_set(stream, tok, o, "stream"); }, kExitData,
                 {"stream: 60000 tokens hold only", "non-overlapping passages of 23 + 7 tokens", "fewer --items"});
}

// In a text of three documents, each holding one passage, the item's own context covers about a quarter
// of the ending starts: a distractor drawn without excluding it lands there in most of these sets.
TEST(PrepareEval, DistractorsAvoidTheirOwnPassageInAShortText) {
    const Tokenizer tok = word_vocab();
    HeldoutOptions o;
    o.items = 3;
    o.context = 40;
    o.ending = 4;
    o.choices = 4;
    for (uint64_t seed = 1; seed <= 10; seed++) {
        SCOPED_TRACE(format("seed %llu", (unsigned long long)seed));
        SplitMix64 rng(seed);
        std::vector<uint32_t> stream;
        for (int d = 0; d < 3; d++) {
            stream.push_back(99);
            for (int k = 0; k < 60; k++) stream.push_back(uint32_t(rng.below(99)));
        }
        o.seed = int64_t(seed);
        const McSet set = make_heldout_set(stream, tok, o, "short");
        for (const McItem& it : set.items) {
            std::vector<int32_t> passage = it.context;
            passage.insert(passage.end(), it.endings[size_t(it.label)].begin(), it.endings[size_t(it.label)].end());
            const std::vector<int64_t> at = occurrences(stream, passage);
            ASSERT_EQ(at.size(), 1u);
            for (size_t e = 0; e < it.endings.size(); e++) {
                if (int(e) == it.label) continue;
                for (int64_t q : occurrences(stream, it.endings[e])) {
                    EXPECT_FALSE(q < at[0] + 44 && q + 4 > at[0]) << "distractor " << e << " at token " << q
                                                                  << " overlaps its passage at " << at[0];
                }
            }
        }
    }
}

int run_tool(std::vector<std::string> args) {
    args.insert(args.begin(), "prepare_eval");
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    return prepare_eval_main(int(argv.size()), argv.data());
}

// The tool must exit with `code` after printing one line on stderr: "error: " and every part.
void expect_tool_error(const std::vector<std::string>& args, int code, const std::vector<std::string>& parts) {
    testing::internal::CaptureStderr();
    const int rc = run_tool(args);
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_EQ(rc, code) << err;
    EXPECT_EQ(err.rfind("error: ", 0), 0u) << err;
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << "expected one line, got:\n" << err;
    for (const std::string& p : parts) EXPECT_NE(err.find(p), std::string::npos) << "'" << p << "' not in: " << err;
}

TEST(PrepareEval, ToolOnShardsTextAndHellaswag) {
    REQUIRE_VOCAB();
    TempDir dir("prepare_eval");
    // A shard of GPT-2 text and a text file: word starts are real GPT-2 tokens here.
    std::string text;
    for (int d = 0; d < 300; d++) {
        text += format("Document %d tells of the whale number %d and of the ship that followed it for %d days across "
                       "the grey sea, while the crew sang songs about home and harbour lights.\n", d, d * 7, d % 13);
    }
    std::vector<int32_t> ids = encode(text);
    std::vector<uint32_t> u(ids.begin(), ids.end());
    write_token_shard(dir / "val_000000.bin", u.data(), u.size(), 1);
    write_file(dir / "more.txt", text);
    const std::vector<std::string> vocab = {"--encoder-json", kEncoderJson, "--vocab-bpe", kVocabBpe, "--quiet"};
    auto with_vocab = [&](std::vector<std::string> a) {
        a.insert(a.end(), vocab.begin(), vocab.end());
        return a;
    };
    ASSERT_EQ(run_tool(with_vocab({"--heldout", dir / "val_000000.bin", "--heldout", dir / "more.txt", "--out",
                                   dir / "mc.bin", "--items", "150", "--context", "30", "--ending", "9", "--seed", "4"})),
              0);
    const McSet set = read_mc_file(dir / "mc.bin", 50257);
    ASSERT_EQ(set.items.size(), 150u);
    for (const McItem& it : set.items) {
        EXPECT_EQ(it.context.size(), 30u);
        for (const auto& e : it.endings) {
            EXPECT_EQ(e.size(), 9u);
            EXPECT_EQ(gpt2().token(uint32_t(e[0]))[0], ' ');
        }
    }
    const std::string first = read_file(dir / "mc.bin");
    ASSERT_EQ(run_tool(with_vocab({"--heldout", dir / "val_000000.bin", "--heldout", dir / "more.txt", "--out",
                                   dir / "mc2.bin", "--items", "150", "--context", "30", "--ending", "9", "--seed", "4"})),
              0);
    EXPECT_EQ(read_file(dir / "mc2.bin"), first) << "the same flags must give the same file";

    write_file(dir / "val.jsonl", kHellaswagRows);
    ASSERT_EQ(run_tool(with_vocab({"--hellaswag", dir / "val.jsonl", "--out", dir / "hs.bin"})), 0);
    write_mc_file(dir / "hs_direct.bin", read_hellaswag_jsonl(dir / "val.jsonl", encoder()));
    EXPECT_EQ(read_file(dir / "hs.bin"), read_file(dir / "hs_direct.bin"));
}

TEST(PrepareEval, CommandLineErrors) {
    TempDir dir("prepare_eval_errors");
    // One line and a pointer to --help, not the usage text before it.
    expect_tool_error({"--out", dir / "x.bin"}, kExitUsage,
                      {"give either --hellaswag FILE or --heldout FILE", "(see prepare_eval --help)"});
    EXPECT_EQ(run_tool({"--hellaswag", "a.jsonl", "--heldout", "b.bin", "--out", dir / "x.bin"}), kExitUsage);
    EXPECT_EQ(run_tool({"--hellaswag", "a.jsonl"}), kExitUsage);
    EXPECT_EQ(run_tool({"--hellaswag", "a.jsonl", "--out", dir / "x.bin", "--items", "5"}), kExitUsage);
    EXPECT_EQ(run_tool({"--heldout", "b.bin", "--out", dir / "x.bin", "--choices", "1"}), kExitUsage);
    EXPECT_EQ(run_tool({"--heldout", "b.bin", "--out", dir / "x.bin", "--context", "16384", "--ending", "4096"}),
              kExitUsage);
    EXPECT_EQ(run_tool({"--heldout", "b.bin", "--out", dir / "x.bin", "--encoder-json", dir / "none.json"}), kExitIo);
    if (have_vocab()) {
        EXPECT_EQ(run_tool({"--heldout", dir / "none.bin", "--out", dir / "x.bin", "--quiet"}), kExitIo);
        write_token_shard(dir / "tiny.bin", std::vector<uint32_t>(50, 262).data(), 50, 1);
        EXPECT_EQ(run_tool({"--heldout", dir / "tiny.bin", "--out", dir / "x.bin", "--quiet"}), kExitData);
    }
    EXPECT_FALSE(fs::exists(dir / "x.bin"));
}

TEST(PrepareEval, InputsThatAreNotFilesGiveTheSystemsReason) {
    REQUIRE_VOCAB();
    TempDir dir("prepare_eval_not_files");
    const NotFiles not_files(dir);
    for (const auto& [path, why] : not_files.cases) {
        const std::string message = "cannot open '" + path + "' for reading: " + why;
        expect_tool_error({"--hellaswag", path, "--out", dir / "x.bin"}, kExitIo, {message});
        expect_tool_error({"--heldout", path, "--out", dir / "x.bin"}, kExitIo, {message});
    }
    EXPECT_FALSE(fs::exists(dir / "x.bin"));
}

TEST(PrepareEval, HellaswagRowsOfOtherThanFourEndingsAreRefused) {
    REQUIRE_VOCAB();
    TempDir dir("prepare_eval_endings");
    write_file(dir / "val.jsonl", R"({"ctx": "A b", "endings": ["c", "d", "e", "f"], "label": 2})"
                                  "\n"
                                  R"({"ctx": "A b", "endings": ["c", "d", "e"], "label": 2})"
                                  "\n");
    expect_tool_error({"--hellaswag", dir / "val.jsonl", "--out", dir / "x.bin"}, kExitData,
                      {"'" + dir / "val.jsonl" + "' line 2: 3 ending(s); HellaSwag's rows have 4"});
    EXPECT_FALSE(fs::exists(dir / "x.bin"));
}

// A token id equal to the vocabulary size is one past the last token: refused, in either shard version.
TEST(PrepareEval, ShardTokenAtTheVocabularySizeIsRefused) {
    REQUIRE_VOCAB();
    TempDir dir("prepare_eval_vocab");
    std::vector<uint32_t> ids(2000, 262);  // " the"
    ids[5] = 50257;
    for (int version : {1, 2}) {
        const std::string shard = dir / format("val_v%d.bin", version);
        write_token_shard(shard, ids.data(), ids.size(), version);
        expect_tool_error({"--heldout", shard, "--out", dir / "x.bin", "--items", "1"}, kExitData,
                          {format("shard '%s': token 5 (byte offset %d) has id 50257, not below the vocabulary size "
                                  "50257", shard.c_str(), 1024 + 5 * 2 * version)});
    }
    EXPECT_FALSE(fs::exists(dir / "x.bin"));
}

}  // namespace
