/*
GPT-2's byte-level BPE tokenizer.
  - Tokenizer: the vocabulary and the end-of-text id; decode() refuses ids outside the vocabulary.
  - read_tokenizer_bin() / write_tokenizer_bin(): llm.c's tokenizer file (256 uint32 header: 20240328,
    version, vocabulary size, end-of-text id (version 1: 50256); then per token a byte count and bytes).
With LLMC_TOKENIZER_ENCODER defined before the include (PCRE2 and nlohmann-json needed):
  - load_gpt2_vocab_files(): OpenAI's encoder.json and vocab.bpe, checked against each other.
  - Gpt2Encoder: encode_ordinary() as tiktoken's "gpt2": GPT-2's pre-tokenisation pattern, a piece that
    is a token becomes it, else BPE merging the lowest-id pair (leftmost on ties). Any bytes are taken
    and decode(encode(x)) == x; a run of invalid UTF-8 is a piece of its own. "<|endoftext|>" in text
    is ordinary text. Shared read-only; each thread encodes through its own Gpt2Encoder::Context.
  - safe_split_point(): where a text can be cut so the parts encode as the whole does.
*/
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "llmc/utils.h"

namespace llmc {

constexpr uint32_t kTokenizerMagic = 20240328;
constexpr int kTokenizerHeaderInts = 256;
constexpr uint32_t kGpt2EotToken = 50256;
constexpr uint32_t kGpt2VocabSize = 50257;

class Tokenizer {
public:
    Tokenizer() = default;
    Tokenizer(std::vector<std::string> tokens, uint32_t eot) : tokens_(std::move(tokens)), eot_(eot) {
        if (eot_ >= tokens_.size()) {
            fail(kExitData, "end-of-text id %u is outside the vocabulary of %zu tokens", eot_, tokens_.size());
        }
    }

    size_t size() const { return tokens_.size(); }
    uint32_t eot() const { return eot_; }
    const std::string& token(uint32_t id) const { return tokens_.at(id); }
    const std::vector<std::string>& tokens() const { return tokens_; }

    std::string decode(const uint32_t* ids, size_t n) const {
        std::string out;
        for (size_t i = 0; i < n; i++) {
            if (ids[i] >= tokens_.size()) {
                fail(kExitData, "cannot decode token %zu: id %u is outside the vocabulary of %zu tokens", i, ids[i],
                     tokens_.size());
            }
            out += tokens_[ids[i]];
        }
        return out;
    }
    std::string decode(const std::vector<uint32_t>& ids) const { return decode(ids.data(), ids.size()); }

private:
    std::vector<std::string> tokens_;
    uint32_t eot_ = 0;
};

inline void write_tokenizer_bin(const Tokenizer& tok, const std::string& path) {
    const uint32_t header[kTokenizerHeaderInts] = {kTokenizerMagic, 2, static_cast<uint32_t>(tok.size()), tok.eot()};
    std::string body;
    for (size_t id = 0; id < tok.size(); id++) {
        const std::string& t = tok.token(static_cast<uint32_t>(id));
        if (t.empty() || t.size() > 255) {
            fail(kExitData, "cannot write '%s': token %zu is %zu bytes long; the format holds 1 to 255", path.c_str(), id,
                 t.size());
        }
        body += static_cast<char>(static_cast<uint8_t>(t.size()));
        body += t;
    }
    // Whole or not at all, so that a failed rewrite (a full disk) leaves the previous file as it was.
    write_file_atomically(path, [&](File& f) {
        f.write_all(header, sizeof(header));
        f.write_all(body.data(), body.size());
    });
}

inline Tokenizer read_tokenizer_bin(const std::string& path) {
    auto bad = [&](const std::string& what) { fail(kExitData, "tokenizer '%s': %s", path.c_str(), what.c_str()); };
    File f(path, File::Mode::Read);
    int64_t file_size = f.size();
    const int64_t header_bytes = kTokenizerHeaderInts * (int64_t)sizeof(uint32_t);
    if (file_size < header_bytes) {
        fail(kExitData, "tokenizer '%s' is %lld bytes, shorter than its %lld-byte header", path.c_str(),
             (long long)file_size, (long long)header_bytes);
    }
    std::vector<char> data(static_cast<size_t>(file_size));
    f.read_exact(data.data(), data.size());
    uint32_t header[kTokenizerHeaderInts];
    std::memcpy(header, data.data(), sizeof(header));
    if (header[0] != kTokenizerMagic) {
        bad(format("bad magic %u at offset 0 (expected %u); is this a tokenizer file?", header[0], kTokenizerMagic));
    }
    if (header[1] != 1 && header[1] != 2) bad(format("unsupported version %u at offset 4 (expected 1 or 2)", header[1]));
    uint32_t vocab_size = header[2];
    uint32_t eot = header[1] == 1 ? kGpt2EotToken : header[3];
    // Each token takes at least 2 bytes (count + one byte), which bounds a believable vocabulary size.
    if (vocab_size == 0 || (int64_t)vocab_size * 2 > file_size - header_bytes) {
        bad(format("vocabulary size %u at offset 8 does not fit a file of %lld bytes", vocab_size, (long long)file_size));
    }
    if (eot >= vocab_size) {
        bad(format("end-of-text id %u%s is outside the vocabulary of %u tokens", eot,
                   header[1] == 1 ? " (implied by version 1)" : " at offset 12", vocab_size));
    }
    std::vector<std::string> tokens(vocab_size);
    size_t pos = static_cast<size_t>(header_bytes);
    for (uint32_t id = 0; id < vocab_size; id++) {
        if (pos >= data.size()) {
            fail(kExitData, "tokenizer '%s' ends at offset %zu, before token %u of %u", path.c_str(), pos, id, vocab_size);
        }
        size_t len = static_cast<uint8_t>(data[pos]);
        if (len == 0) bad(format("token %u at offset %zu has length 0", id, pos));
        if (pos + 1 + len > data.size()) {
            bad(format("token %u at offset %zu needs %zu bytes but the file ends at %zu", id, pos, len, data.size()));
        }
        tokens[id].assign(data.data() + pos + 1, len);
        pos += 1 + len;
    }
    if (pos != data.size()) bad(format("%zu unexpected bytes after the last token at offset %zu", data.size() - pos, pos));
    return Tokenizer(std::move(tokens), eot);
}

// GPT-2 stores every byte as a printable code point: printable Latin-1 bytes as themselves, the other 68
// from 256 up.
inline const std::array<uint32_t, 256>& gpt2_byte_to_codepoint() {
    static const std::array<uint32_t, 256> table = [] {
        std::array<uint32_t, 256> t{};
        uint32_t next = 256;
        for (uint32_t b = 0; b < 256; b++) {
            bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
            t[b] = printable ? b : next++;
        }
        return t;
    }();
    return table;
}

namespace tokenizer_detail {

inline uint64_t hash_bytes(const char* p, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xFF51AFD7ED558CCDull);
    while (n >= 8) {
        uint64_t v;
        std::memcpy(&v, p, 8);
        h = (h ^ v) * 0xBF58476D1CE4E5B9ull;
        h ^= h >> 31;
        p += 8;
        n -= 8;
    }
    if (n > 0) {
        uint64_t v = 0;
        std::memcpy(&v, p, n);
        h = (h ^ v) * 0x94D049BB133111EBull;
        h ^= h >> 29;
    }
    return h ^ (h >> 32);
}

// Open-addressing map from byte strings to uint32, keys in one pool (the vocabulary, the merge pairs, the
// piece caches).
class StringMap {
public:
    explicit StringMap(size_t expected = 1024) { reset(expected); }

    void reset(size_t expected) {
        size_t cap = 16;
        while (cap < expected * 2) cap *= 2;
        slots_.assign(cap, Slot{});
        pool_.clear();
        count_ = 0;
    }
    size_t size() const { return count_; }

    const uint32_t* find(std::string_view key) const {
        const Slot& s = slots_[probe(key, hash_bytes(key.data(), key.size()))];
        return s.len == kEmpty ? nullptr : &s.value;
    }

    // Inserts or overwrites; grows when half full.
    void insert(std::string_view key, uint32_t value) {
        if ((count_ + 1) * 2 > slots_.size()) grow();
        const uint64_t h = hash_bytes(key.data(), key.size());
        Slot& s = slots_[probe(key, h)];
        if (s.len != kEmpty) {
            s.value = value;
            return;
        }
        s = Slot{h, static_cast<uint32_t>(pool_.size()), static_cast<uint32_t>(key.size()), value};
        pool_.append(key.data(), key.size());
        count_++;
    }

private:
    static constexpr uint32_t kEmpty = UINT32_MAX;
    struct Slot {
        uint64_t hash = 0;
        uint32_t offset = 0;
        uint32_t len = kEmpty;
        uint32_t value = 0;
    };
    // The slot holding key (hash h), else the empty one where it would go.
    size_t probe(std::string_view key, uint64_t h) const {
        const size_t mask = slots_.size() - 1;
        for (size_t i = h & mask;; i = (i + 1) & mask) {
            const Slot& s = slots_[i];
            if (s.len == kEmpty ||
                (s.hash == h && s.len == key.size() && std::memcmp(pool_.data() + s.offset, key.data(), key.size()) == 0)) {
                return i;
            }
        }
    }
    void grow() {
        std::vector<Slot> old = std::move(slots_);
        slots_.assign(old.size() * 2, Slot{});
        for (const Slot& s : old) {
            if (s.len != kEmpty) slots_[probe(std::string_view(pool_.data() + s.offset, s.len), s.hash)] = s;
        }
    }

    std::vector<Slot> slots_;
    std::string pool_;
    size_t count_ = 0;
};

// Open-addressing map from a pair of token ids to the token their concatenation forms (a map of its own:
// the BPE loop probes it once per candidate pair, and 8-byte integer keys are faster than StringMap's).
class PairMap {
public:
    void reset(size_t expected) {
        size_t cap = 16;
        while (cap < expected * 2) cap *= 2;
        keys_.assign(cap, kEmpty);
        values_.assign(cap, 0);
        shift_ = 64;
        for (size_t c = cap; c > 1; c >>= 1) shift_--;
    }
    void insert(uint32_t a, uint32_t b, uint32_t merged) {
        const size_t i = probe(a, b);
        keys_[i] = (uint64_t(a) << 32) | b;
        values_[i] = merged;
    }
    // The merged token, or kNone when the pair does not merge.
    uint32_t find(uint32_t a, uint32_t b) const {
        const size_t i = probe(a, b);
        return keys_[i] == kEmpty ? kNone : values_[i];
    }
    static constexpr uint32_t kNone = UINT32_MAX;

private:
    static constexpr uint64_t kEmpty = UINT64_MAX;
    // The slot holding the pair, else the empty one where it would go.
    size_t probe(uint32_t a, uint32_t b) const {
        const uint64_t key = (uint64_t(a) << 32) | b;
        const size_t mask = keys_.size() - 1;
        size_t i = static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_);
        while (keys_[i] != kEmpty && keys_[i] != key) i = (i + 1) & mask;
        return i;
    }
    std::vector<uint64_t> keys_;
    std::vector<uint32_t> values_;
    int shift_ = 64;
};

}  // namespace tokenizer_detail

}  // namespace llmc

#ifdef LLMC_TOKENIZER_ENCODER

#include <algorithm>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <nlohmann/json.hpp>

namespace llmc {

namespace tokenizer_detail {

// Frees what PCRE2 allocated, for unique_ptr.
struct Pcre2Free {
    void operator()(pcre2_code* p) const { pcre2_code_free(p); }
    void operator()(pcre2_match_data* p) const { pcre2_match_data_free(p); }
    void operator()(pcre2_jit_stack* p) const { pcre2_jit_stack_free(p); }
    void operator()(pcre2_match_context* p) const { pcre2_match_context_free(p); }
};

// Decodes a UTF-8 string of GPT-2's printable code points back into the bytes they stand for.
inline bool gpt2_printable_to_bytes(const std::string& s, std::string& out) {
    static const std::vector<int> codepoint_to_byte = [] {
        std::vector<int> v(512, -1);
        const auto& fwd = gpt2_byte_to_codepoint();
        for (int b = 0; b < 256; b++) v[fwd[b]] = b;
        return v;
    }();
    out.clear();
    for (size_t i = 0; i < s.size();) {
        uint8_t c = static_cast<uint8_t>(s[i]);
        uint32_t cp;
        if (c < 0x80) {
            cp = c;
            i += 1;
        } else if ((c & 0xE0) == 0xC0 && i + 1 < s.size()) {
            cp = ((c & 0x1Fu) << 6) | (static_cast<uint8_t>(s[i + 1]) & 0x3Fu);
            i += 2;
        } else {
            return false;  // every code point of the mapping is below U+0800
        }
        if (cp >= codepoint_to_byte.size() || codepoint_to_byte[cp] < 0) return false;
        out += static_cast<char>(codepoint_to_byte[cp]);
    }
    return true;
}

}  // namespace tokenizer_detail

// Reads OpenAI's encoder.json and vocab.bpe and checks what the encoder relies on: dense ids, every byte
// a token, merges naming existing tokens, and ids rising with the merge's line (an id is a merge rank).
inline Tokenizer load_gpt2_vocab_files(const std::string& encoder_json, const std::string& vocab_bpe) {
    using tokenizer_detail::gpt2_printable_to_bytes;
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(read_text_file(encoder_json));
    } catch (const nlohmann::json::exception& e) {
        fail(kExitData, "'%s' is not valid JSON: %s", encoder_json.c_str(), e.what());
    }
    if (!j.is_object()) fail(kExitData, "'%s': expected a JSON object of token -> id", encoder_json.c_str());
    std::vector<std::string> tokens(j.size());
    uint32_t eot = UINT32_MAX;
    tokenizer_detail::StringMap ids(j.size());
    std::string bytes;
    for (auto it = j.begin(); it != j.end(); ++it) {
        if (!it.value().is_number_unsigned() || it.value().get<uint64_t>() >= j.size()) {
            fail(kExitData, "'%s': token \"%s\" has id %s; expected an integer from 0 to %zu", encoder_json.c_str(),
                 it.key().c_str(), it.value().dump().c_str(), j.size() - 1);
        }
        uint32_t id = it.value().get<uint32_t>();
        // Every token is at least one byte, so an empty one is an id not yet given.
        if (!tokens[id].empty()) fail(kExitData, "'%s': id %u is given to two tokens", encoder_json.c_str(), id);
        if (it.key() == "<|endoftext|>") {
            eot = id;
            bytes = it.key();
        } else if (!gpt2_printable_to_bytes(it.key(), bytes) || bytes.empty()) {
            fail(kExitData, "'%s': token \"%s\" (id %u) uses characters outside GPT-2's byte alphabet",
                 encoder_json.c_str(), it.key().c_str(), id);
        } else {
            ids.insert(bytes, id);
        }
        tokens[id] = bytes;
    }
    if (eot == UINT32_MAX) fail(kExitData, "'%s' has no <|endoftext|> token", encoder_json.c_str());
    for (int b = 0; b < 256; b++) {
        if (!ids.find(std::string(1, static_cast<char>(b)))) {
            fail(kExitData, "'%s': byte 0x%02x has no token, so some texts could not be encoded", encoder_json.c_str(), b);
        }
    }

    std::istringstream merges(read_text_file(vocab_bpe));
    std::string line, left, right;
    int64_t line_no = 0, merge_count = 0;
    uint32_t last_id = 0;
    while (std::getline(merges, line)) {
        line_no++;
        if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
        size_t space = line.find(' ');
        if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
            fail(kExitData, "%s:%lld: expected two tokens separated by one space, got \"%s\"", vocab_bpe.c_str(),
                 (long long)line_no, line.c_str());
        }
        if (!gpt2_printable_to_bytes(line.substr(0, space), left) || !gpt2_printable_to_bytes(line.substr(space + 1), right)) {
            fail(kExitData, "%s:%lld: \"%s\" uses characters outside GPT-2's byte alphabet", vocab_bpe.c_str(),
                 (long long)line_no, line.c_str());
        }
        const uint32_t* merged = ids.find(left + right);
        if (!ids.find(left) || !ids.find(right) || !merged) {
            fail(kExitData, "%s:%lld: merge \"%s\" names a token that %s does not have", vocab_bpe.c_str(),
                 (long long)line_no, line.c_str(), encoder_json.c_str());
        }
        if (merge_count > 0 && *merged <= last_id) {
            fail(kExitData, "%s:%lld: merge \"%s\" forms token %u, not above the previous merge's %u; ids must follow "
                 "merge order", vocab_bpe.c_str(), (long long)line_no, line.c_str(), *merged, last_id);
        }
        last_id = *merged;
        merge_count++;
    }
    if (merge_count == 0) fail(kExitData, "'%s' lists no merges", vocab_bpe.c_str());
    return Tokenizer(std::move(tokens), eot);
}

// GPT-2's pre-tokenisation pattern,
//     's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// with its classes spelled so that PCRE2 draws the lines where tiktoken does: \s as Unicode's
// White_Space in full, \p{L} and \p{N} with Unicode 15-16's additions (test/test_tokenizer_reference.sh).
inline const std::string& gpt2_pattern() {
    static const std::string pattern = [] {
        const std::string space = R"(\t-\r \x{85}\x{a0}\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}\x{205f}\x{3000})";
        const std::string letter =
            R"(\p{L}\x{1c89}-\x{1c8a}\x{a7cb}-\x{a7cd}\x{a7da}-\x{a7dc}\x{105c0}-\x{105f3}\x{10d4a}-\x{10d65})"
            R"(\x{10d6f}-\x{10d85}\x{10ec2}-\x{10ec4}\x{1123f}-\x{11240}\x{11380}-\x{11389}\x{1138b}\x{1138e})"
            R"(\x{11390}-\x{113b5}\x{113b7}\x{113d1}\x{113d3}\x{11bc0}-\x{11be0}\x{11f02}\x{11f04}-\x{11f10})"
            R"(\x{11f12}-\x{11f33}\x{1342f}\x{13441}-\x{13446}\x{13460}-\x{143fa}\x{16100}-\x{1611d})"
            R"(\x{16d40}-\x{16d6c}\x{18cff}\x{1b132}\x{1b155}\x{1df25}-\x{1df2a}\x{1e030}-\x{1e06d})"
            R"(\x{1e4d0}-\x{1e4eb}\x{1e5d0}-\x{1e5ed}\x{1e5f0}\x{2b739}\x{2ebf0}-\x{2ee5d}\x{31350}-\x{323af})";
        const std::string digit =
            R"(\p{N}\x{10d40}-\x{10d49}\x{116d0}-\x{116e3}\x{11bf0}-\x{11bf9}\x{11f50}-\x{11f59}\x{16130}-\x{16139})"
            R"(\x{16d70}-\x{16d79}\x{1ccf0}-\x{1ccf9}\x{1d2c0}-\x{1d2d3}\x{1e4f0}-\x{1e4f9}\x{1e5f1}-\x{1e5fa})";
        return "'s|'t|'re|'ve|'m|'ll|'d| ?[" + letter + "]+| ?[" + digit + "]+| ?[^" + space + letter + digit +
               "]+|[" + space + "]+(?![^" + space + "])|[" + space + "]+";
    }();
    return pattern;
}

// Where text can be cut near `target` so the two parts encode as the whole: before a space or newline
// between two printable ASCII characters. The first such point at or after `target`, else text.size().
inline size_t safe_split_point(std::string_view text, size_t target) {
    auto printable = [](char c) { return c > ' ' && c < 0x7F; };
    for (size_t p = std::max<size_t>(target, 1); p + 1 < text.size(); p++) {
        if ((text[p] == ' ' || text[p] == '\n') && printable(text[p - 1]) && printable(text[p + 1])) return p;
    }
    return text.size();
}

class Gpt2Encoder {
public:
    // Per-thread state: PCRE2's match data and JIT stack, and a cache of pieces encoded by BPE.
    class Context {
    public:
        explicit Context(const Gpt2Encoder& enc)
            : match_data_(pcre2_match_data_create_from_pattern(enc.code_.get(), nullptr)),
              jit_stack_(pcre2_jit_stack_create(32 * 1024, 1024 * 1024, nullptr)),
              match_context_(pcre2_match_context_create(nullptr)),
              cache_(kCacheEntries) {
            if (!match_data_ || !jit_stack_ || !match_context_) fail(kExitError, "out of memory creating PCRE2 match state");
            pcre2_jit_stack_assign(match_context_.get(), nullptr, jit_stack_.get());
        }

    private:
        friend class Gpt2Encoder;
        static constexpr size_t kCacheEntries = 1 << 16;
        static constexpr size_t kCacheMaxPieceBytes = 64;
        std::unique_ptr<pcre2_match_data, tokenizer_detail::Pcre2Free> match_data_;
        std::unique_ptr<pcre2_jit_stack, tokenizer_detail::Pcre2Free> jit_stack_;
        std::unique_ptr<pcre2_match_context, tokenizer_detail::Pcre2Free> match_context_;
        tokenizer_detail::StringMap cache_;   // piece -> offset in cached_ ([count, ids...])
        std::vector<uint32_t> cached_;
        // BPE scratch: one entry per part (a linked list over the piece's bytes) and a heap of pairs.
        std::vector<uint32_t> ids_, next_, prev_;
        std::vector<std::pair<uint32_t, uint32_t>> heap_;  // (merged id = rank, left part index)
    };

    explicit Gpt2Encoder(const Tokenizer& tok) : eot_(tok.eot()), vocab_(tok.size()) {
        byte_token_.fill(kNoToken);
        for (uint32_t id = 0; id < tok.size(); id++) {
            if (id == eot_) continue;
            const std::string& t = tok.token(id);
            if (t.size() == 1) byte_token_[static_cast<uint8_t>(t[0])] = id;
            vocab_.insert(t, id);
        }
        for (int b = 0; b < 256; b++) {
            if (byte_token_[b] == kNoToken) fail(kExitData, "the vocabulary has no token for byte 0x%02x", b);
        }
        // A pair merges when its concatenation is a token, whatever the split: every split of every token.
        std::vector<std::array<uint32_t, 3>> pairs;
        for (uint32_t id = 0; id < tok.size(); id++) {
            const std::string& t = tok.token(id);
            if (id == eot_ || t.size() < 2) continue;
            for (size_t k = 1; k < t.size(); k++) {
                const uint32_t* a = vocab_.find(std::string_view(t).substr(0, k));
                const uint32_t* b = vocab_.find(std::string_view(t).substr(k));
                if (a && b) pairs.push_back({*a, *b, id});
            }
        }
        pairs_.reset(pairs.size());
        for (const auto& p : pairs) pairs_.insert(p[0], p[1], p[2]);

        int err = 0;
        PCRE2_SIZE err_offset = 0;
        const std::string& pattern = gpt2_pattern();
        code_.reset(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                  PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &err_offset, nullptr));
        if (!code_) {
            fail(kExitError, "PCRE2 cannot compile GPT-2's pattern at offset %zu: %s", (size_t)err_offset,
                 pcre2_error(err).c_str());
        }
        // Without JIT (a PCRE2 built without it) the interpreter gives the same matches, only slower.
        jit_ = pcre2_jit_compile(code_.get(), PCRE2_JIT_COMPLETE) == 0;
    }

    uint32_t eot() const { return eot_; }
    bool jit() const { return jit_; }

    // Appends the ids of `text` to `out`; see the top of this file for the rules.
    void encode_ordinary(Context& ctx, std::string_view text, std::vector<uint32_t>& out) const {
        auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
        size_t pos = 0;
        while (pos < text.size()) {
            int rc = jit_ ? pcre2_jit_match(code_.get(), subject, text.size(), pos, 0, ctx.match_data_.get(),
                                            ctx.match_context_.get())
                          : pcre2_match(code_.get(), subject, text.size(), pos, 0, ctx.match_data_.get(),
                                        ctx.match_context_.get());
            if (rc == PCRE2_ERROR_NOMATCH) {
                encode_piece(ctx, text.substr(pos), out);  // only invalid UTF-8 is left
                return;
            }
            if (rc < 0) fail(kExitError, "PCRE2 match failed at byte %zu: %s", pos, pcre2_error(rc).c_str());
            const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(ctx.match_data_.get());
            size_t start = ov[0], end = ov[1];
            if (end <= start) fail(kExitError, "PCRE2 returned an empty match at byte %zu", start);
            if (start > pos) encode_piece(ctx, text.substr(pos, start - pos), out);  // invalid UTF-8 skipped by the pattern
            encode_piece(ctx, text.substr(start, end - start), out);
            pos = end;
        }
    }

    std::vector<uint32_t> encode_ordinary(Context& ctx, std::string_view text) const {
        std::vector<uint32_t> out;
        encode_ordinary(ctx, text, out);
        return out;
    }

private:
    static constexpr uint32_t kNoToken = UINT32_MAX;

    static std::string pcre2_error(int code) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof(msg));
        return reinterpret_cast<char*>(msg);
    }

    // The token the pair (a, b) merges into, or kNoToken.
    uint32_t merge(uint32_t a, uint32_t b) const {
        const uint32_t m = pairs_.find(a, b);
        return m == tokenizer_detail::PairMap::kNone ? kNoToken : m;
    }

    void encode_piece(Context& ctx, std::string_view piece, std::vector<uint32_t>& out) const {
        if (piece.size() == 1) {
            out.push_back(byte_token_[static_cast<uint8_t>(piece[0])]);
            return;
        }
        if (const uint32_t* id = vocab_.find(piece)) {
            out.push_back(*id);
            return;
        }
        bool cacheable = piece.size() <= Context::kCacheMaxPieceBytes;
        if (cacheable) {
            if (const uint32_t* at = ctx.cache_.find(piece)) {
                const uint32_t* p = ctx.cached_.data() + *at;
                out.insert(out.end(), p + 1, p + 1 + p[0]);
                return;
            }
        }
        size_t first = out.size();
        bpe(ctx, piece, out);
        if (cacheable) {
            if (ctx.cache_.size() >= Context::kCacheEntries) {
                ctx.cache_.reset(Context::kCacheEntries);
                ctx.cached_.clear();
            }
            ctx.cache_.insert(piece, static_cast<uint32_t>(ctx.cached_.size()));
            ctx.cached_.push_back(static_cast<uint32_t>(out.size() - first));
            ctx.cached_.insert(ctx.cached_.end(), out.begin() + first, out.end());
        }
    }

    // Merges adjacent parts, lowest merged id first and leftmost among equals, until no pair merges
    // (a linked list of parts and a heap of candidate pairs, stale ones skipped). O(n log n).
    void bpe(Context& ctx, std::string_view piece, std::vector<uint32_t>& out) const {
        const uint32_t n = static_cast<uint32_t>(piece.size());
        const uint32_t kEnd = UINT32_MAX;
        auto &ids = ctx.ids_, &next = ctx.next_, &prev = ctx.prev_;
        auto& heap = ctx.heap_;
        ids.resize(n);
        next.resize(n);
        prev.resize(n);
        heap.clear();
        const auto later = std::greater<>();
        auto push = [&](uint32_t left) {
            uint32_t merged = merge(ids[left], ids[next[left]]);
            if (merged == kNoToken) return;
            heap.emplace_back(merged, left);
            std::push_heap(heap.begin(), heap.end(), later);
        };
        for (uint32_t i = 0; i < n; i++) {
            ids[i] = byte_token_[static_cast<uint8_t>(piece[i])];
            next[i] = i + 1 < n ? i + 1 : kEnd;
            prev[i] = i > 0 ? i - 1 : kEnd;
        }
        for (uint32_t i = 0; i + 1 < n; i++) push(i);
        while (!heap.empty()) {
            std::pop_heap(heap.begin(), heap.end(), later);
            auto [merged, left] = heap.back();
            heap.pop_back();
            uint32_t right = next[left];
            if (ids[left] == kNoToken || right == kEnd || merge(ids[left], ids[right]) != merged) continue;
            ids[left] = merged;
            ids[right] = kNoToken;
            next[left] = next[right];
            if (next[left] != kEnd) prev[next[left]] = left;
            if (prev[left] != kEnd) push(prev[left]);
            if (next[left] != kEnd) push(left);
        }
        for (uint32_t i = 0; i != kEnd; i = next[i]) out.push_back(ids[i]);
    }

    uint32_t eot_;
    std::array<uint32_t, 256> byte_token_;
    tokenizer_detail::StringMap vocab_;
    tokenizer_detail::PairMap pairs_;
    std::unique_ptr<pcre2_code, tokenizer_detail::Pcre2Free> code_;
    bool jit_ = false;
};

}  // namespace llmc

#endif  // LLMC_TOKENIZER_ENCODER
