/*
CPU tests of the GPT-2 tokenizer (llmc/tokenizer.h) and the data preparation tool
(dev/tools/prepare_data.cpp, included here and run in-process so that these tests need no other binary).

Checks: ids fixed by tiktoken for a few texts; BPE against a plain O(n^2) transcription of tiktoken's
merge loop on single pieces (words, digit and symbol runs, long runs, non-ASCII, invalid bytes);
decode(encode(x)) == x for random bytes, random code points mixed with invalid UTF-8, and the raw
hard-cases file; <|endoftext|> as text is ordinary text; safe_split_point() cuts never change ids;
llm.c's tokenizer .bin written and read back byte for byte, version 1 accepted, and every kind of
damage refused with the file named; bad vocabulary files refused with file and line; the tool's
shards identical for 1 and 3 threads with tiny chunks, equal to the encoder's ids, cut at the shard
size, split by file and by fraction, stale shards removed; the tool's errors (missing input, bad JSON,
missing field, bad flags, unwritable output) with their exit codes and messages; and shards written
by the tool read back through the DataLoader as tiktoken's ids.

The GPT-2 vocabulary comes from .deps/gpt2 (scripts/setup.sh); tests that need it are skipped,
saying so, where it is missing.
*/
#define PREPARE_DATA_NO_MAIN
#include "dev/tools/prepare_data.cpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <random>

#include "llmc/dataloader.h"
#include "test/test_util.h"

namespace fs = std::filesystem;
using llmc::Gpt2Encoder;
using llmc::Tokenizer;
using llmc::test::read_text;
using llmc::test::TempDir;
using llmc::test::write_bytes;

namespace {

const char* kEncoderJson = ".deps/gpt2/encoder.json";
const char* kVocabBpe = ".deps/gpt2/vocab.bpe";

bool have_vocab() { return fs::exists(kEncoderJson) && fs::exists(kVocabBpe); }

#define REQUIRE_VOCAB()                                                                               \
    do {                                                                                              \
        if (!have_vocab()) GTEST_SKIP() << "skipped: GPT-2 vocabulary not in .deps/gpt2 (run scripts/setup.sh)"; \
    } while (0)

const Tokenizer& gpt2() {
    static const Tokenizer tok = llmc::load_gpt2_vocab_files(kEncoderJson, kVocabBpe);
    return tok;
}
const Gpt2Encoder& encoder() {
    static const Gpt2Encoder enc(gpt2());
    return enc;
}
std::vector<uint32_t> encode(std::string_view text) {
    Gpt2Encoder::Context ctx(encoder());
    return encoder().encode_ordinary(ctx, text);
}

// A transcription of tiktoken's byte_pair_merge for one piece: a piece that is a token is that token;
// otherwise merge the adjacent pair whose concatenation has the lowest id, leftmost first.
std::vector<uint32_t> reference_bpe(const std::string& piece) {
    static const std::map<std::string, uint32_t> ranks = [] {
        std::map<std::string, uint32_t> m;
        for (uint32_t id = 0; id < gpt2().size(); id++) {
            if (id != gpt2().eot()) m[gpt2().token(id)] = id;
        }
        return m;
    }();
    if (auto it = ranks.find(piece); it != ranks.end()) return {it->second};
    std::vector<std::string> parts;
    for (char c : piece) parts.emplace_back(1, c);
    for (;;) {
        uint32_t best = UINT32_MAX;
        size_t at = 0;
        for (size_t i = 0; i + 1 < parts.size(); i++) {
            auto it = ranks.find(parts[i] + parts[i + 1]);
            if (it != ranks.end() && it->second < best) {
                best = it->second;
                at = i;
            }
        }
        if (best == UINT32_MAX) break;
        parts[at] += parts[at + 1];
        parts.erase(parts.begin() + at + 1);
    }
    std::vector<uint32_t> ids;
    for (const std::string& p : parts) ids.push_back(ranks.at(p));
    return ids;
}

std::string utf8(uint32_t cp) {
    std::string s;
    if (cp < 0x80) {
        s += char(cp);
    } else if (cp < 0x800) {
        s += char(0xC0 | (cp >> 6));
        s += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        s += char(0xE0 | (cp >> 12));
        s += char(0x80 | ((cp >> 6) & 0x3F));
        s += char(0x80 | (cp & 0x3F));
    } else {
        s += char(0xF0 | (cp >> 18));
        s += char(0x80 | ((cp >> 12) & 0x3F));
        s += char(0x80 | ((cp >> 6) & 0x3F));
        s += char(0x80 | (cp & 0x3F));
    }
    return s;
}

// Text that stresses the pattern: words, contractions, digit runs, whitespace runs, non-ASCII letters,
// emoji, and (with `invalid`) bytes that are not UTF-8.
std::string random_text(std::mt19937_64& rng, size_t pieces, bool invalid) {
    static const char* words[] = {"the", "The", "don't", "I'M", "'s", "'ll", "hello", "world", "12345", "3.14",
                                  "  ", "   ", "\n", "\n\n", "\t", " \n ", "!!", "...", "caf\xc3\xa9", "\xe6\x97\xa5\xe6\x9c\xac",
                                  "\xf0\x9f\x98\x80", "e\xcc\x81", "\xc2\xa0", "\xe3\x80\x80", "<|endoftext|>", "a"};
    std::string s;
    for (size_t i = 0; i < pieces; i++) {
        uint64_t r = rng() % 100;
        if (r < 60) {
            s += words[rng() % (sizeof(words) / sizeof(words[0]))];
        } else if (r < 75) {
            s += ' ';
        } else if (r < 90) {
            uint32_t cp = uint32_t(rng() % 0x110000);
            if (cp >= 0xD800 && cp < 0xE000) cp = 0x41;
            s += utf8(cp);
        } else if (invalid) {
            static const char* bad[] = {"\xff", "\x80", "\xe2\x82", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xf0\x9f\x98"};
            s += bad[rng() % (sizeof(bad) / sizeof(bad[0]))];
        } else {
            s += char('a' + rng() % 26);
        }
    }
    return s;
}

// ---- encoding ----

TEST(Tokenizer, IdsFixedByTiktoken) {
    REQUIRE_VOCAB();
    EXPECT_EQ(encode("Hello world"), (std::vector<uint32_t>{15496, 995}));
    EXPECT_EQ(encode(" \xc2\x85x"), (std::vector<uint32_t>{220, 126, 227, 87}));  // U+0085 is a space
    EXPECT_EQ(encode("I'M you're"), (std::vector<uint32_t>{40, 6, 44, 345, 821}));  // contractions are lower case
    EXPECT_EQ(encode("  \n\n a"), (std::vector<uint32_t>{220, 220, 628, 257}));
    EXPECT_EQ(encode("1234567"), (std::vector<uint32_t>{10163, 2231, 3134}));
    EXPECT_EQ(encode(""), std::vector<uint32_t>{});
}

TEST(Tokenizer, EndOfTextInTextIsOrdinary) {
    REQUIRE_VOCAB();
    EXPECT_EQ(encoder().eot(), llmc::kGpt2EotToken);
    EXPECT_EQ(gpt2().eot(), llmc::kGpt2EotToken);
    EXPECT_EQ(gpt2().size(), llmc::kGpt2VocabSize);
    EXPECT_EQ(encode("<|endoftext|>"), (std::vector<uint32_t>{27, 91, 437, 1659, 5239, 91, 29}));
    std::mt19937_64 rng(7);
    std::vector<uint32_t> ids = encode(random_text(rng, 5000, true));
    EXPECT_EQ(std::count(ids.begin(), ids.end(), llmc::kGpt2EotToken), 0);
    uint32_t eot = llmc::kGpt2EotToken;
    EXPECT_EQ(gpt2().decode(&eot, 1), "<|endoftext|>");
}

TEST(Tokenizer, BpeMatchesPlainMergeLoopOnSinglePieces) {
    REQUIRE_VOCAB();
    std::mt19937_64 rng(1234);
    std::vector<std::string> pieces = {"tokenization", " antidisestablishmentarianism", "aaaaaaaaaaaaaaaaaaaaaaaaa",
                                       "abababababababababab", " Supercalifragilisticexpialidocious", "999999999",
                                       std::string(1000, ' '), std::string(777, '='), std::string(1001, 'a'),
                                       "\xff\xfe\xfd", "\xe2\x82", "\xf0\x9f\x98"};
    for (int i = 0; i < 300; i++) {
        std::string w = (i % 2) ? " " : "";
        size_t n = 1 + rng() % 40;
        int kind = i % 4;
        for (size_t k = 0; k < n; k++) {
            if (kind == 0) w += char('a' + rng() % 26);
            else if (kind == 1) w += char('0' + rng() % 10);
            else if (kind == 2) w += "!#$%&*+-/<=>?@^_|~"[rng() % 18];
            else w += utf8(0xC0 + uint32_t(rng() % 0x17F));  // Latin letters with diacritics
        }
        pieces.push_back(w);
    }
    Gpt2Encoder::Context ctx(encoder());
    for (int pass = 0; pass < 2; pass++) {  // the second pass is served by the piece cache
        for (const std::string& p : pieces) {
            ASSERT_EQ(encoder().encode_ordinary(ctx, p), reference_bpe(p)) << "piece '" << p << "' pass " << pass;
        }
    }
}

TEST(Tokenizer, InvalidUtf8RunsAreTheirOwnPieces) {
    REQUIRE_VOCAB();
    auto cat = [](std::vector<std::vector<uint32_t>> parts) {
        std::vector<uint32_t> all;
        for (auto& p : parts) all.insert(all.end(), p.begin(), p.end());
        return all;
    };
    EXPECT_EQ(encode("ab\xff" "cd"), cat({encode("ab"), reference_bpe("\xff"), encode("cd")}));
    EXPECT_EQ(encode("x \xe2\x82 y"), cat({encode("x"), encode(" "), reference_bpe("\xe2\x82"), encode(" y")}));
    EXPECT_EQ(encode("\xed\xa0\x80"), reference_bpe("\xed\xa0\x80"));
    EXPECT_EQ(encode("end\xf0\x9f\x98"), cat({encode("end"), reference_bpe("\xf0\x9f\x98")}));
    // Before a letter a space run leaves its last space to lead the word; before invalid bytes it does not.
    EXPECT_EQ(encode("a   b"), cat({encode("a"), reference_bpe("  "), encode(" b")}));
    EXPECT_EQ(encode("a   \xff"), cat({encode("a"), reference_bpe("   "), reference_bpe("\xff")}));
}

TEST(Tokenizer, RoundTripsAnyBytes) {
    REQUIRE_VOCAB();
    std::mt19937_64 rng(99);
    Gpt2Encoder::Context ctx(encoder());
    for (int i = 0; i < 400; i++) {
        std::string s;
        size_t n = (i % 50 == 0) ? 100000 + rng() % 1000 : rng() % 400;
        if (i % 3 == 0) {
            for (size_t k = 0; k < n; k++) s += char(rng() & 0xFF);  // uniform random bytes
        } else {
            s = random_text(rng, n / 4 + 1, i % 3 == 1);
        }
        std::vector<uint32_t> ids = encoder().encode_ordinary(ctx, s);
        for (uint32_t id : ids) ASSERT_LT(id, llmc::kGpt2EotToken);
        ASSERT_EQ(gpt2().decode(ids), s) << "case " << i;
    }
    std::string hard = read_text("test/data/tokenizer_hard_cases.txt");
    ASSERT_GT(hard.size(), 1000u) << "test/data/tokenizer_hard_cases.txt missing (run from the repository root)";
    ASSERT_EQ(gpt2().decode(encode(hard)), hard);
}

TEST(Tokenizer, SafeSplitPointsDoNotChangeIds) {
    REQUIRE_VOCAB();
    std::mt19937_64 rng(5);
    Gpt2Encoder::Context ctx(encoder());
    int cuts = 0;
    for (int i = 0; i < 40; i++) {
        std::string s = random_text(rng, 300, true);
        std::vector<uint32_t> whole = encoder().encode_ordinary(ctx, s);
        for (size_t p = llmc::safe_split_point(s, 0); p < s.size(); p = llmc::safe_split_point(s, p + 1)) {
            std::vector<uint32_t> parts = encoder().encode_ordinary(ctx, std::string_view(s).substr(0, p));
            encoder().encode_ordinary(ctx, std::string_view(s).substr(p), parts);
            ASSERT_EQ(parts, whole) << "cut at " << p << " of case " << i;
            cuts++;
        }
    }
    EXPECT_GT(cuts, 200);
    EXPECT_EQ(llmc::safe_split_point("a  b", 0), 4u);  // between two spaces is not safe
    EXPECT_EQ(llmc::safe_split_point("ab cd", 0), 2u);
}

TEST(Tokenizer, DecodeRefusesIdsOutsideTheVocabulary) {
    Tokenizer tok({"a", "b", "<|endoftext|>"}, 2);
    uint32_t ids[] = {0, 1, 3};
    try {
        tok.decode(ids, 3);
        FAIL() << "expected an error";
    } catch (const llmc::Error& e) {
        EXPECT_EQ(e.exit_code(), llmc::kExitData);
        EXPECT_NE(std::string(e.what()).find("id 3"), std::string::npos) << e.what();
    }
    EXPECT_EQ(tok.decode(ids, 2), "ab");
}

// ---- tokenizer .bin ----

std::string expect_error(const std::function<void()>& fn, int code) {
    try {
        fn();
    } catch (const llmc::Error& e) {
        EXPECT_EQ(e.exit_code(), code) << e.what();
        return e.what();
    }
    ADD_FAILURE() << "expected an llmc::Error";
    return "";
}

TEST(TokenizerBin, WritesLlmcLayoutAndReadsItBack) {
    REQUIRE_VOCAB();
    TempDir dir;
    std::string path = dir / "gpt2_tokenizer.bin";
    llmc::write_tokenizer_bin(gpt2(), path);
    std::string bytes = read_text(path);
    size_t expected = 1024;
    for (const std::string& t : gpt2().tokens()) expected += 1 + t.size();
    ASSERT_EQ(bytes.size(), expected);
    uint32_t header[4];
    std::memcpy(header, bytes.data(), sizeof(header));
    EXPECT_EQ(header[0], 20240328u);
    EXPECT_EQ(header[1], 2u);
    EXPECT_EQ(header[2], 50257u);
    EXPECT_EQ(header[3], 50256u);
    EXPECT_EQ(bytes[1024], 1);  // token 0 is "!"
    EXPECT_EQ(bytes[1025], '!');

    Tokenizer back = llmc::read_tokenizer_bin(path);
    EXPECT_EQ(back.tokens(), gpt2().tokens());
    EXPECT_EQ(back.eot(), gpt2().eot());
    std::string again = dir / "again.bin";
    llmc::write_tokenizer_bin(back, again);
    EXPECT_EQ(read_text(again), bytes);

    // An encoder built from the .bin alone gives the same ids.
    Gpt2Encoder from_bin(back);
    Gpt2Encoder::Context ctx(from_bin);
    std::string hard = read_text("test/data/tokenizer_hard_cases.txt");
    EXPECT_EQ(from_bin.encode_ordinary(ctx, hard), encode(hard));
}

TEST(TokenizerBin, ReadsVersion1WithImpliedEndOfText) {
    REQUIRE_VOCAB();
    TempDir dir;
    std::string path = dir / "v1.bin";
    llmc::write_tokenizer_bin(gpt2(), path);
    std::string bytes = read_text(path);
    uint32_t v1 = 1, zero = 0;
    std::memcpy(&bytes[4], &v1, 4);
    std::memcpy(&bytes[12], &zero, 4);
    write_bytes(path, bytes);
    Tokenizer t = llmc::read_tokenizer_bin(path);
    EXPECT_EQ(t.eot(), 50256u);
    EXPECT_EQ(t.tokens(), gpt2().tokens());
}

TEST(TokenizerBin, RefusesDamagedFiles) {
    TempDir dir;
    std::string good_path = dir / "good.bin";
    Tokenizer small({"a", "bc", "<|endoftext|>"}, 2);
    llmc::write_tokenizer_bin(small, good_path);
    const std::string good = read_text(good_path);
    ASSERT_EQ(good.size(), 1024u + 2 + 3 + 14);
    EXPECT_EQ(llmc::read_tokenizer_bin(good_path).tokens(), small.tokens());

    struct Case {
        const char* what;
        std::function<void(std::string&)> damage;
        const char* message;
    };
    auto put32 = [](std::string& b, size_t at, uint32_t v) { std::memcpy(&b[at], &v, 4); };
    std::vector<Case> cases = {
        {"short header", [](std::string& b) { b.resize(1000); }, "shorter than its 1024-byte header"},
        {"magic", [&](std::string& b) { put32(b, 0, 20240520); }, "bad magic 20240520 at offset 0"},
        {"version", [&](std::string& b) { put32(b, 4, 3); }, "unsupported version 3 at offset 4"},
        {"zero vocabulary", [&](std::string& b) { put32(b, 8, 0); }, "vocabulary size 0 at offset 8"},
        {"huge vocabulary", [&](std::string& b) { put32(b, 8, 1000000); }, "vocabulary size 1000000"},
        {"eot outside", [&](std::string& b) { put32(b, 12, 3); }, "end-of-text id 3 at offset 12"},
        {"truncated token", [](std::string& b) { b.resize(b.size() - 5); }, "needs 13 bytes but the file ends"},
        {"zero-length token", [](std::string& b) { b[1024] = 0; }, "token 0 at offset 1024 has length 0"},
        {"trailing bytes", [](std::string& b) { b += "xyz"; }, "3 unexpected bytes after the last token"},
        {"vocabulary larger than the tokens", [&](std::string& b) { put32(b, 8, 4); }, "before token 3 of 4"},
    };
    for (const Case& c : cases) {
        std::string bytes = good;
        c.damage(bytes);
        std::string path = dir / "damaged.bin";
        write_bytes(path, bytes);
        std::string msg = expect_error([&] { llmc::read_tokenizer_bin(path); }, llmc::kExitData);
        EXPECT_NE(msg.find(c.message), std::string::npos) << c.what << ": " << msg;
        EXPECT_NE(msg.find(path), std::string::npos) << c.what << ": " << msg;
    }
    std::string msg = expect_error([&] { llmc::read_tokenizer_bin(dir / "missing.bin"); }, llmc::kExitIo);
    EXPECT_NE(msg.find("missing.bin"), std::string::npos) << msg;
    Tokenizer long_token({std::string(256, 'x'), "<|endoftext|>"}, 1);
    msg = expect_error([&] { llmc::write_tokenizer_bin(long_token, dir / "long.bin"); }, llmc::kExitData);
    EXPECT_NE(msg.find("256 bytes long"), std::string::npos) << msg;
}

TEST(TokenizerBin, AFailedRewriteLeavesTheOldFileWhole) {
    // make data writes the tokenizer file again over the last one; a disk that fills part way through
    // must fail the write and leave the old file as it was, not a truncated one.
    TempDir dir;
    const std::string path = dir / "tokenizer.bin";
    Tokenizer small({"a", "bc", "<|endoftext|>"}, 2);
    llmc::write_tokenizer_bin(small, path);
    const std::string good = read_text(path);
    std::vector<std::string> tokens;
    for (int i = 0; i < 1000; i++) tokens.push_back(llmc::format("token%d", i));
    Tokenizer big(tokens, 999);
    std::string error;
    int code = 0;
    {
        llmc::test::FileSizeLimit limit(good.size() + 100);  // no gtest output while it holds
        try {
            llmc::write_tokenizer_bin(big, path);
        } catch (const llmc::Error& e) {
            error = e.what();
            code = e.exit_code();
        }
    }
    EXPECT_EQ(code, llmc::kExitIo) << error;
    EXPECT_NE(error.find("File too large"), std::string::npos) << error;
    EXPECT_EQ(read_text(path), good);
    EXPECT_EQ(llmc::read_tokenizer_bin(path).tokens(), small.tokens());
    EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(VocabFiles, RefusesInconsistentFiles) {
    TempDir dir;
    // A vocabulary of the 256 bytes (in GPT-2's printable alphabet), two merges and end-of-text.
    std::vector<std::string> byte_keys;
    for (int b = 0; b < 256; b++) byte_keys.push_back(utf8(llmc::gpt2_byte_to_codepoint()[b]));
    auto encoder_json = [&](const std::string& extra) {
        std::string j = "{";
        for (int b = 0; b < 256; b++) j += nlohmann::json(byte_keys[b]).dump() + ": " + std::to_string(b) + ", ";
        return j + "\"ab\": 256, \"abc\": 257" + extra + "}";
    };
    std::string enc = dir / "encoder.json", bpe = dir / "vocab.bpe";
    write_bytes(enc, encoder_json(", \"<|endoftext|>\": 258"));
    write_bytes(bpe, "#version: 0.2\na b\nab c\n");
    Tokenizer t = llmc::load_gpt2_vocab_files(enc, bpe);
    EXPECT_EQ(t.size(), 259u);
    EXPECT_EQ(t.eot(), 258u);
    EXPECT_EQ(t.token(257), "abc");
    Gpt2Encoder small(t);
    Gpt2Encoder::Context ctx(small);
    EXPECT_EQ(small.encode_ordinary(ctx, "abcab abd"),
              (std::vector<uint32_t>{257, 256, ' ', 256, 'd'}));

    std::string msg = expect_error([&] { llmc::load_gpt2_vocab_files(enc, dir / "none.bpe"); }, llmc::kExitIo);
    EXPECT_NE(msg.find("none.bpe"), std::string::npos) << msg;

    write_bytes(bpe, "#version: 0.2\na b\nab c d\n");
    msg = expect_error([&] { llmc::load_gpt2_vocab_files(enc, bpe); }, llmc::kExitData);
    EXPECT_NE(msg.find("vocab.bpe:3:"), std::string::npos) << msg;

    write_bytes(bpe, "#version: 0.2\na b\nab x\n");
    msg = expect_error([&] { llmc::load_gpt2_vocab_files(enc, bpe); }, llmc::kExitData);
    EXPECT_NE(msg.find("vocab.bpe:3: merge \"ab x\" names a token"), std::string::npos) << msg;

    write_bytes(bpe, "#version: 0.2\nab c\na b\n");
    msg = expect_error([&] { llmc::load_gpt2_vocab_files(enc, bpe); }, llmc::kExitData);
    EXPECT_NE(msg.find("ids must follow merge order"), std::string::npos) << msg;

    write_bytes(bpe, "#version: 0.2\na b\nab c\n");
    write_bytes(enc, encoder_json(""));
    msg = expect_error([&] { llmc::load_gpt2_vocab_files(enc, bpe); }, llmc::kExitData);
    EXPECT_NE(msg.find("no <|endoftext|> token"), std::string::npos) << msg;

    write_bytes(enc, encoder_json(", \"<|endoftext|>\": 257"));
    msg = expect_error([&] { llmc::load_gpt2_vocab_files(enc, bpe); }, llmc::kExitData);
    EXPECT_NE(msg.find("id 257 is given to two tokens"), std::string::npos) << msg;

    write_bytes(enc, "{\"a\": 0,");
    msg = expect_error([&] { llmc::load_gpt2_vocab_files(enc, bpe); }, llmc::kExitData);
    EXPECT_NE(msg.find("is not valid JSON"), std::string::npos) << msg;
}

// ---- the data preparation tool ----

struct ToolRun {
    int code;
    std::string out, err;
};

ToolRun run_tool(std::vector<std::string> args) {
    args.insert(args.begin(), "prepare_data");
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    testing::internal::CaptureStdout();
    testing::internal::CaptureStderr();
    int code = prepare_data_main(static_cast<int>(args.size()), argv.data());
    ToolRun r{code, testing::internal::GetCapturedStdout(), testing::internal::GetCapturedStderr()};
    return r;
}

std::vector<uint32_t> read_shard_tokens(const std::string& path) {
    llmc::File f(path, llmc::File::Mode::Read);
    llmc::ShardHeader h = llmc::read_shard_header(f);
    EXPECT_EQ(h.version, 1);
    std::vector<uint16_t> raw(static_cast<size_t>(h.num_tokens));
    f.read_exact(raw.data(), raw.size() * 2);
    return std::vector<uint32_t>(raw.begin(), raw.end());
}

std::vector<std::string> shard_files(const std::string& dir, const std::string& prefix) {
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(dir)) {
        std::string name = e.path().filename().string();
        if (name.rfind(prefix, 0) == 0 && ends_with(name, ".bin")) files.push_back(e.path().string());
    }
    std::sort(files.begin(), files.end());
    return files;
}

std::vector<uint32_t> read_split(const std::string& dir, const std::string& prefix) {
    std::vector<uint32_t> all;
    for (const std::string& f : shard_files(dir, prefix)) {
        std::vector<uint32_t> t = read_shard_tokens(f);
        all.insert(all.end(), t.begin(), t.end());
    }
    return all;
}

// Documents of a small mixed corpus, and the files that hold them: two text files (one long enough to
// be cut into many chunks), a folder with a text file, and a JSONL file with a blank line.
struct Corpus {
    std::vector<std::string> docs;
    std::vector<std::string> inputs;
};

Corpus make_corpus(const TempDir& dir) {
    std::mt19937_64 rng(2024);
    Corpus c;
    std::string long_text;
    for (int i = 0; i < 200; i++) long_text += random_text(rng, 30, false) + "\n";
    write_bytes(dir / "a_long.txt", long_text);
    std::string short_text = "A short document.\nWith two lines and 'quotes'.  ";
    write_bytes(dir / "b_short.txt", short_text);
    fs::create_directory(dir / "c_folder");
    std::string nested = "Nested \xe6\x97\xa5\xe6\x9c\xac text with invalid \xff bytes kept.";
    write_bytes(dir / "c_folder/only.txt", nested);
    std::vector<std::string> json_docs = {"First \"JSON\" document\nwith a newline.", "",
                                          "Third: caf\xc3\xa9 \xf0\x9f\x98\x80 <|endoftext|> tab\there"};
    std::string jsonl = nlohmann::json{{"text", json_docs[0]}, {"id", 1}}.dump() + "\n\n" +
                        nlohmann::json{{"meta", {{"x", 1}}}, {"text", json_docs[1]}}.dump() + "\r\n" +
                        nlohmann::json{{"text", json_docs[2]}}.dump();  // no final newline
    write_bytes(dir / "d.jsonl", jsonl);
    c.docs = {long_text, short_text, nested, json_docs[0], json_docs[1], json_docs[2]};
    c.inputs = {dir / "a_long.txt", dir / "b_short.txt", dir / "c_folder", dir / "d.jsonl"};
    return c;
}

std::vector<uint32_t> expected_ids(const std::vector<std::string>& docs) {
    std::vector<uint32_t> ids;
    for (const std::string& d : docs) {
        ids.push_back(llmc::kGpt2EotToken);
        std::vector<uint32_t> t = encode(d);
        ids.insert(ids.end(), t.begin(), t.end());
    }
    return ids;
}

std::vector<std::string> tool_args(const TempDir& dir, const std::string& out, std::vector<std::string> extra) {
    std::vector<std::string> a = {"--quiet", "--encoder-json", kEncoderJson, "--vocab-bpe", kVocabBpe, "--out", dir / out};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
}

TEST(PrepareData, ShardsAreIdenticalForAnyThreadCountAndMatchTheEncoder) {
    REQUIRE_VOCAB();
    TempDir dir;
    Corpus c = make_corpus(dir);
    std::vector<std::string> outs;
    for (int threads : {1, 3}) {
        std::string out = "out" + std::to_string(threads);
        std::vector<std::string> args = tool_args(dir, out, {"--threads", std::to_string(threads), "--chunk-bytes", "100",
                                                             "--shard-tokens", "1000", "--name", "mix"});
        args.insert(args.end(), c.inputs.begin(), c.inputs.end());
        ToolRun r = run_tool(args);
        ASSERT_EQ(r.code, 0) << r.err;
        outs.push_back(dir / out);
    }
    std::vector<std::string> one = shard_files(outs[0], "mix_train_"), three = shard_files(outs[1], "mix_train_");
    ASSERT_GE(one.size(), 3u);
    ASSERT_EQ(one.size(), three.size());
    for (size_t i = 0; i < one.size(); i++) {
        EXPECT_EQ(read_text(one[i]), read_text(three[i])) << one[i];
        if (i + 1 < one.size()) {
            EXPECT_EQ(read_shard_tokens(one[i]).size(), 1000u) << one[i];
        }
    }
    EXPECT_EQ(read_split(outs[0], "mix_train_"), expected_ids(c.docs));
    EXPECT_TRUE(shard_files(outs[0], "mix_val_").empty());
}

TEST(PrepareData, SplitsByFileAndByFraction) {
    REQUIRE_VOCAB();
    TempDir dir;
    Corpus c = make_corpus(dir);
    std::vector<std::string> args = tool_args(dir, "byfile", {"--val", c.inputs[1], "--val", c.inputs[3], c.inputs[0], c.inputs[2]});
    ToolRun r = run_tool(args);
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(read_split(dir / "byfile", "corpus_train_"), expected_ids({c.docs[0], c.docs[2]}));
    EXPECT_EQ(read_split(dir / "byfile", "corpus_val_"), expected_ids({c.docs[1], c.docs[3], c.docs[4], c.docs[5]}));

    args = tool_args(dir, "byfraction", {"--val-fraction", "0.34", "--chunk-bytes", "64"});
    args.insert(args.end(), c.inputs.begin(), c.inputs.end());
    r = run_tool(args);
    ASSERT_EQ(r.code, 0) << r.err;
    // Document k is validation when floor((k+1) * 0.34) > floor(k * 0.34): k = 2 and 5.
    EXPECT_EQ(read_split(dir / "byfraction", "corpus_train_"), expected_ids({c.docs[0], c.docs[1], c.docs[3], c.docs[4]}));
    EXPECT_EQ(read_split(dir / "byfraction", "corpus_val_"), expected_ids({c.docs[2], c.docs[5]}));
}

TEST(PrepareData, ShufflesWholeFilesBySeed) {
    REQUIRE_VOCAB();
    TempDir dir;
    Corpus c = make_corpus(dir);
    // The files as the tool lists them, and the documents each holds.
    std::vector<std::vector<std::string>> files = {{c.docs[0]}, {c.docs[1]}, {c.docs[2]}, {c.docs[3], c.docs[4], c.docs[5]}};
    auto run = [&](const std::string& out, const std::string& seed) {
        std::vector<std::string> args = tool_args(dir, out, {"--shuffle-files", seed, "--chunk-bytes", "100", "--name", "mix"});
        args.insert(args.end(), c.inputs.begin(), c.inputs.end());
        ToolRun r = run_tool(args);
        EXPECT_EQ(r.code, 0) << r.err;
        return read_split(dir / out, "mix_train_");
    };
    // The file orders as literal numbers (seeded_permutation of 4 for these seeds, also pinned in
    // test_dataloader.cpp), so that a change to the shuffle fails here rather than moving the expectation.
    const std::vector<std::pair<uint64_t, std::vector<uint32_t>>> orders = {{1, {2, 0, 3, 1}}, {1337, {1, 0, 2, 3}}};
    for (const auto& [seed, order] : orders) {
        std::vector<std::string> docs;
        for (uint32_t i : order) docs.insert(docs.end(), files[i].begin(), files[i].end());
        std::vector<uint32_t> got = run("seed" + std::to_string(seed), std::to_string(seed));
        EXPECT_EQ(got, expected_ids(docs)) << "seed " << seed;
        EXPECT_EQ(got, run("again" + std::to_string(seed), std::to_string(seed))) << "seed " << seed;
    }
    ToolRun bad = run_tool(tool_args(dir, "bad", {"--shuffle-files", "-1", c.inputs[0]}));
    EXPECT_EQ(bad.code, 2) << bad.err;
}

TEST(PrepareData, RemovesStaleShardsOfTheSameName) {
    REQUIRE_VOCAB();
    TempDir dir;
    Corpus c = make_corpus(dir);
    std::vector<std::string> args = tool_args(dir, "out", {"--shard-tokens", "500"});
    args.insert(args.end(), c.inputs.begin(), c.inputs.end());
    ASSERT_EQ(run_tool(args).code, 0);
    size_t many = shard_files(dir / "out", "corpus_train_").size();
    ASSERT_GE(many, 3u);
    write_bytes(dir / "out/other_train_000000.bin", "not ours");
    args = tool_args(dir, "out", {c.inputs[1]});
    ASSERT_EQ(run_tool(args).code, 0);
    EXPECT_EQ(shard_files(dir / "out", "corpus_train_").size(), 1u);
    EXPECT_EQ(read_split(dir / "out", "corpus_train_"), expected_ids({c.docs[1]}));
    EXPECT_TRUE(fs::exists(dir / "out/other_train_000000.bin"));
}

TEST(PrepareData, ARunThatFailsPartWayLeavesTheEarlierRunsShardsAsTheyWere) {
    // Shards are published only when the run succeeds: a run that fails after writing many leaves the
    // output folder holding the earlier run's shards, all of them and nothing else.
    REQUIRE_VOCAB();
    TempDir dir;
    Corpus c = make_corpus(dir);
    std::vector<std::string> args = tool_args(dir, "out", {"--shard-tokens", "1000", c.inputs[0]});
    ASSERT_EQ(run_tool(args).code, 0);
    const std::vector<std::string> earlier = shard_files(dir / "out", "corpus_train_");
    ASSERT_GE(earlier.size(), 2u);
    const std::vector<uint32_t> earlier_tokens = read_split(dir / "out", "corpus_train_");
    write_bytes(dir / "z_bad.jsonl", "{\"text\": \"fine\"}\n{\"text\": oops}\n");
    args = tool_args(dir, "out", {"--shard-tokens", "100", "--chunk-bytes", "64", c.inputs[0], dir / "z_bad.jsonl"});
    ToolRun r = run_tool(args);
    ASSERT_EQ(r.code, llmc::kExitData) << r.err;
    EXPECT_NE(r.err.find("z_bad.jsonl:2: not valid JSON"), std::string::npos) << r.err;
    std::vector<std::string> left;
    for (const auto& e : fs::directory_iterator(dir / "out")) left.push_back(e.path().string());
    std::sort(left.begin(), left.end());
    EXPECT_EQ(left, earlier);
    EXPECT_EQ(read_split(dir / "out", "corpus_train_"), earlier_tokens);
}

TEST(PrepareData, WritesTheTokenizerFileWithoutInputs) {
    REQUIRE_VOCAB();
    TempDir dir;
    ToolRun r = run_tool(tool_args(dir, "out", {"--write-tokenizer", dir / "tok.bin"}));
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(llmc::read_tokenizer_bin(dir / "tok.bin").tokens(), gpt2().tokens());
}

TEST(PrepareData, ReportsErrorsWithFileLineAndExitCode) {
    REQUIRE_VOCAB();
    TempDir dir;
    struct Case {
        std::string content;  // JSONL file content
        const char* message;
    };
    std::vector<Case> cases = {
        {"{\"text\": \"ok\"}\n{\"text\": \"ok\"}\n{\"text\": oops}\n", "bad.jsonl:3: not valid JSON: column 10"},
        {"{\"text\": \"ok\"}\n\n{\"title\": \"no text\"}\n", "bad.jsonl:3: expected a string field \"text\", which this object lacks"},
        {"{\"text\": 42}\n", "bad.jsonl:1: expected a string field \"text\""},
        {"[\"text\"]\n", "bad.jsonl:1: expected a JSON object with a \"text\" field, got array"},
        {"{\"text\": \"bad \xff byte\"}\n", "bad.jsonl:1: not valid JSON"},
        {"{\"text\": \"unfinished\n", "bad.jsonl:1: not valid JSON"},
    };
    for (const Case& c : cases) {
        write_bytes(dir / "bad.jsonl", c.content);
        for (const char* threads : {"1", "2"}) {
            ToolRun r = run_tool(tool_args(dir, "out", {"--threads", threads, "--chunk-bytes", "64", dir / "bad.jsonl"}));
            EXPECT_EQ(r.code, llmc::kExitData) << c.message;
            EXPECT_NE(r.err.find(c.message), std::string::npos) << r.err;
        }
    }
    ToolRun r = run_tool(tool_args(dir, "out", {dir / "missing.txt"}));
    EXPECT_EQ(r.code, llmc::kExitIo);
    EXPECT_NE(r.err.find("cannot read input '" + (dir / "missing.txt") + "'"), std::string::npos) << r.err;
    fs::create_directory(dir / "empty");
    r = run_tool(tool_args(dir, "out", {dir / "empty"}));
    EXPECT_EQ(r.code, llmc::kExitIo);
    EXPECT_NE(r.err.find("holds no files"), std::string::npos) << r.err;
    write_bytes(dir / "ok.txt", "fine");
    r = run_tool(tool_args(dir, "out", {"--out", "/proc/no_such_dir/x", dir / "ok.txt"}));
    EXPECT_EQ(r.code, llmc::kExitIo);
    EXPECT_NE(r.err.find("/proc/no_such_dir"), std::string::npos) << r.err;
    r = run_tool(tool_args(dir, "out", {"--encoder-json", dir / "none.json", dir / "ok.txt"}));
    EXPECT_EQ(r.code, llmc::kExitIo);
    EXPECT_NE(r.err.find("none.json"), std::string::npos) << r.err;

    std::vector<std::pair<std::vector<std::string>, const char*>> usage = {
        {{"--bogus", dir / "ok.txt"}, "unknown flag '--bogus'"},
        {{"--threads", "0", dir / "ok.txt"}, "--threads: '0' is not an integer from 1 to 1024"},
        {{"--shard-tokens", "12x", dir / "ok.txt"}, "--shard-tokens: '12x' is not an integer"},
        {{"--val-fraction", "1.5", dir / "ok.txt"}, "--val-fraction expects a number between 0 and 1"},
        {{"--val-fraction", "0.1", "--val", dir / "ok.txt", dir / "ok.txt"}, "not both"},
        {{"--val-fraction", "0", dir / "ok.txt"}, "--val-fraction expects a number between 0 and 1"},
        {{"--format", "csv", dir / "ok.txt"}, "--format expects auto, text or jsonl"},
        {{"--name", "a/b", dir / "ok.txt"}, "--name must be a plain file name"},
        {{"--quiet=1", dir / "ok.txt"}, "flag --quiet takes no value"},
        {{"--threads"}, "--threads needs a value"},
        {{}, "no input given"},
    };
    for (auto& [args, message] : usage) {
        std::vector<std::string> a = {"--quiet"};
        a.insert(a.end(), args.begin(), args.end());
        r = run_tool(a);
        EXPECT_EQ(r.code, llmc::kExitUsage) << message;
        EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
    }
    r = run_tool({"--help"});
    EXPECT_EQ(r.code, llmc::kExitOk);
    EXPECT_NE(r.out.find("usage: prepare_data [flags] INPUT..."), std::string::npos) << r.out;
}

TEST(PrepareData, ShardsLoadInTheDataLoaderAsTiktokensIds) {
    REQUIRE_VOCAB();
    TempDir dir;
    // tiktoken 1.0.22's ids for these texts (get_encoding("gpt2").encode_ordinary).
    std::vector<std::pair<std::string, std::vector<uint32_t>>> docs = {
        {"Hello world! It's a test of GPT-2's tokenizer: 12345 numbers,   spaces\tand tabs.\n",
         {15496, 995, 0, 632, 338, 257, 1332, 286, 402, 11571, 12, 17, 338, 11241, 7509, 25, 17031, 2231, 3146, 11, 220,
          220, 9029, 197, 392, 22524, 13, 198}},
        {"Second document \xe2\x80\x94 with Unicode: caf\xc3\xa9, \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e, emoji "
         "\xf0\x9f\x98\x80, and <|endoftext|> as text.",
         {12211, 3188, 851, 351, 34371, 25, 40304, 11, 10545, 245, 98, 17312, 105, 45739, 252, 11, 44805, 30325, 222, 11,
          290, 1279, 91, 437, 1659, 5239, 91, 29, 355, 2420, 13}},
        {"It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
         "of a wife. However little known the feelings or views of such a man may be on his first entering a "
         "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
         "as the rightful property of some one or other of their daughters.  \n\n",
         {1026, 318, 257, 3872, 26208, 10810, 11, 326, 257, 2060, 582, 287, 7797, 286, 257, 922, 15807, 11, 1276, 307,
          287, 765, 286, 257, 3656, 13, 2102, 1310, 1900, 262, 7666, 393, 5009, 286, 884, 257, 582, 743, 307, 319, 465,
          717, 8218, 257, 19495, 11, 428, 3872, 318, 523, 880, 5969, 287, 262, 9017, 286, 262, 7346, 4172, 11, 326, 339,
          318, 3177, 355, 262, 43133, 3119, 286, 617, 530, 393, 584, 286, 511, 14850, 13, 220, 220, 628}},
    };
    std::vector<uint32_t> reference;
    std::vector<std::string> args = tool_args(dir, "out", {"--shard-tokens", "50", "--name", "dl"});
    for (size_t i = 0; i < docs.size(); i++) {
        std::string path = dir / ("doc" + std::to_string(i) + ".txt");
        write_bytes(path, docs[i].first);
        args.push_back(path);
        reference.push_back(llmc::kGpt2EotToken);
        reference.insert(reference.end(), docs[i].second.begin(), docs[i].second.end());
    }
    ToolRun r = run_tool(args);
    ASSERT_EQ(r.code, 0) << r.err;
    ASSERT_EQ(read_split(dir / "out", "dl_train_"), reference);

    // Samples of T+1 tokens start at multiples of T inside each shard, shards in name order.
    const int T = 16;
    std::vector<std::vector<uint32_t>> samples;
    size_t shard_start = 0;
    for (const std::string& f : shard_files(dir / "out", "dl_train_")) {
        size_t n = read_shard_tokens(f).size();
        for (size_t s = 0; s * T + T + 1 <= n; s++) {
            auto first = reference.begin() + shard_start + s * T;
            samples.emplace_back(first, first + T + 1);
        }
        shard_start += n;
    }
    llmc::DataLoaderConfig cfg;
    cfg.pattern = dir / "out/dl_train_*.bin";
    cfg.B = 1;
    cfg.T = T;
    cfg.vocab_size = llmc::kGpt2VocabSize;
    cfg.shuffle = false;
    cfg.prefetch = 2;
    llmc::DataLoader loader(cfg);
    ASSERT_EQ(loader.schedule().samples_per_epoch(), samples.size());
    std::vector<int32_t> inputs(T), targets(T);
    for (size_t s = 0; s < samples.size(); s++) {
        std::fill(inputs.begin(), inputs.end(), -1);
        std::fill(targets.begin(), targets.end(), -1);
        loader.next_batch(inputs.data(), targets.data());
        for (int t = 0; t < T; t++) {
            ASSERT_EQ(uint32_t(inputs[t]), samples[s][t]) << "sample " << s << " token " << t;
            ASSERT_EQ(uint32_t(targets[t]), samples[s][t + 1]) << "sample " << s << " token " << t;
        }
    }
}

}  // namespace

int main(int argc, char** argv) {
    ::testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
}
