/*
prepare_eval: makes multiple-choice evaluation sets in llm.c's eval .bin format (llmc/mc_eval.h), the
files the trainers evaluate during training.

Two sources:
  --hellaswag FILE.jsonl  HellaSwag's own JSONL (hellaswag_val.jsonl), encoded as llm.c's
                          dev/data/hellaswag.py does (context as it is, each ending after a space): the
                          same items as the .bin that llm.c's script writes. A row without exactly 4
                          endings is refused, as llm.c's writer and reader refuse it.
  --heldout FILE          (repeatable) held-out text: token shards (names ending .bin, shard.h's format,
                          e.g. data/quickstart_val_000000.bin) or text files (each one document). Makes
                          --items items, each a passage of --context tokens, its true continuation of
                          --ending tokens and --choices - 1 distractors: continuations of the same
                          length from elsewhere in the text. A model that reads its context picks the
                          true one; one that does not is right 1 time in --choices.
Held-out items, the rules:
  - the inputs are read in the order given, each starting a new document, and a window never contains
    <|endoftext|>, so no passage or continuation crosses from one document into the next;
  - every ending (true or distractor) starts at a word: a token whose text begins with a space (as
    HellaSwag's endings do), so the first token alone does not give the answer away; --any-start drops
    this rule;
  - passages do not overlap one another (context and true ending), and a distractor never overlaps its
    own item's passage, nor repeats the true ending or another distractor token for token;
  - all choices are seeded (--seed; SplitMix64): which passages, in what order, the label's position and
    the distractors, so the same inputs and flags give the same file on every machine. Items are written
    in the order of their passages in the text.
The GPT-2 vocabulary files (--encoder-json, --vocab-bpe) give the encoder for HellaSwag and text inputs
and the token texts for the word-start rule.

Prints what it wrote and, unless --quiet, the first item as text. Errors name the file (and line, for
JSONL) and exit with utils.h's codes: 2 usage, 3 unreadable input or unwritable output, 4 bad input.
Does not: download HellaSwag, deduplicate, or make sets of other shapes (free-form answers, several
true endings).
*/
#define LLMC_TOKENIZER_ENCODER
#include "llmc/tokenizer.h"
#include "llmc/dataloader.h"  // SplitMix64
#include "llmc/mc_eval.h"
#include "dev/tools/jsonl.h"  // read_hellaswag_jsonl

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <unistd.h>

#include "llmc/flags.h"
#include "llmc/shard.h"
#include "llmc/utils.h"

namespace {

using namespace llmc;

struct HeldoutOptions {
    int64_t items = 1000;
    int context = 64;
    int ending = 16;
    int choices = 4;
    int64_t seed = 1;
    bool word_start = true;
};

struct Options {
    std::string hellaswag;
    std::vector<std::string> heldout;
    std::string out;
    HeldoutOptions h;
    bool any_start = false;
    std::string encoder_json = ".deps/gpt2/encoder.json";
    std::string vocab_bpe = ".deps/gpt2/vocab.bpe";
    bool quiet = false;
};

bool parse_args(int argc, char** argv, Options& o) {
    Flags flags("prepare_eval",
                "Makes a multiple-choice evaluation set (llm.c's eval .bin) from HellaSwag's JSONL or from held-out text.");
    flags.add("", "hellaswag", &o.hellaswag, "HellaSwag's JSONL file (hellaswag_val.jsonl) to encode")
        .add("", "heldout", &o.heldout, "held-out text to make items from: a token shard (.bin) or a text file; repeatable")
        .add("", "out", &o.out, "the eval .bin to write")
        .add("", "items", &o.h.items, "held-out: how many items", 1, kMcMaxExamples)
        .add("", "context", &o.h.context, "held-out: tokens of each passage", 1, 16384)
        .add("", "ending", &o.h.ending, "held-out: tokens of each ending", 1, 4096)
        .add("", "choices", &o.h.choices, "held-out: endings per item, one of them true (llm.c's trainer reads only 4)",
             2, 64)
        .add("", "seed", &o.h.seed, "held-out: seed of every random choice", 0, INT64_MAX)
        .add_switch("", "any-start", &o.any_start, "held-out: endings may start inside a word")
        .add("", "encoder-json", &o.encoder_json, "GPT-2's encoder.json")
        .add("", "vocab-bpe", &o.vocab_bpe, "GPT-2's vocab.bpe")
        .add_switch("", "quiet", &o.quiet, "print errors only");
    if (!flags.parse(argc, argv)) return false;
    o.h.word_start = !o.any_start;
    if (o.hellaswag.empty() == o.heldout.empty()) {
        fail(kExitUsage, "give either --hellaswag FILE or --heldout FILE (one or more), not both or neither (see "
             "prepare_eval --help)");
    }
    if (o.out.empty()) fail(kExitUsage, "--out FILE is needed: where to write the set (see prepare_eval --help)");
    const bool held_flag = flags.was_set("items") || flags.was_set("context") || flags.was_set("ending") ||
                           flags.was_set("choices") || flags.was_set("seed") || o.any_start;
    if (!o.hellaswag.empty() && held_flag) {
        fail(kExitUsage, "--items, --context, --ending, --choices, --seed and --any-start shape held-out sets; "
                         "HellaSwag's items are as the file gives them");
    }
    const int64_t bytes = 2 * (kMcExampleFields + o.h.context + int64_t(o.h.choices) * (1 + o.h.ending));
    if (bytes > kMcMaxExampleBytes) {
        fail(kExitUsage, "--context %d with %d endings of %d tokens makes items of %lld bytes, more than the format's "
             "%lld", o.h.context, o.h.choices, o.h.ending, (long long)bytes, (long long)kMcMaxExampleBytes);
    }
    return true;
}

bool ends_with(const std::string& s, const char* suffix) {
    const size_t n = std::strlen(suffix);
    return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

// Every input's tokens, each input after an <|endoftext|> (shards from prepare_data have one before
// each document already; a second one changes nothing, as windows never contain one).
std::vector<uint32_t> read_heldout_tokens(const std::vector<std::string>& inputs, const Tokenizer& tok,
                                          const Gpt2Encoder& enc) {
    std::vector<uint32_t> tokens;
    Gpt2Encoder::Context ctx(enc);
    for (const std::string& path : inputs) {
        tokens.push_back(tok.eot());
        if (!ends_with(path, ".bin")) {
            enc.encode_ordinary(ctx, read_text_file(path), tokens);
            continue;
        }
        File f(path, File::Mode::Read);
        const ShardHeader h = read_shard_header(f);
        const size_t at = tokens.size();
        tokens.resize(at + size_t(h.num_tokens));
        if (h.bytes_per_token == 4) {
            f.read_exact(tokens.data() + at, size_t(h.num_tokens) * 4);
        } else {
            std::vector<uint16_t> narrow(size_t(h.num_tokens));
            f.read_exact(narrow.data(), narrow.size() * 2);
            std::copy(narrow.begin(), narrow.end(), tokens.begin() + int64_t(at));
        }
        for (int64_t i = 0; i < h.num_tokens; i++) {
            const uint32_t id = tokens[at + size_t(i)];
            if (id >= tok.size()) {
                fail(kExitData, "shard '%s': token %lld (byte offset %lld) has id %u, not below the vocabulary size %zu",
                     path.c_str(), (long long)i, (long long)shard_token_byte_offset(i, h.bytes_per_token), id, tok.size());
            }
        }
    }
    return tokens;
}

// The held-out set (the file's comment has the rules). tok gives the token texts for the word-start rule.
McSet make_heldout_set(const std::vector<uint32_t>& tokens, const Tokenizer& tok, const HeldoutOptions& o,
                       const std::string& source) {
    const int64_t n = int64_t(tokens.size()), C = o.context, E = o.ending;
    std::vector<int64_t> eots(size_t(n) + 1, 0);  // <|endoftext|> tokens in tokens[0, i)
    for (int64_t i = 0; i < n; i++) eots[size_t(i) + 1] = eots[size_t(i)] + (tokens[size_t(i)] == tok.eot());
    auto clean = [&](int64_t a, int64_t b) { return eots[size_t(b)] == eots[size_t(a)]; };
    auto starts_word = [&](int64_t q) {
        const std::string& text = tok.token(tokens[size_t(q)]);
        return !o.word_start || (!text.empty() && text[0] == ' ');
    };
    std::vector<int64_t> ending_starts, passages;  // passages: where a true ending starts
    for (int64_t q = 0; q + E <= n; q++) {
        if (!clean(q, q + E) || !starts_word(q)) continue;
        ending_starts.push_back(q);
        if (q >= C && clean(q - C, q)) passages.push_back(q);
    }

    SplitMix64 rng(splitmix64_mix(uint64_t(o.seed)));
    for (size_t i = passages.size(); i > 1; i--) std::swap(passages[i - 1], passages[rng.below(i)]);
    std::vector<char> used(size_t(n), 0);
    std::vector<int64_t> chosen;
    for (int64_t p : passages) {
        if (int64_t(chosen.size()) == o.items) break;
        if (std::find(used.begin() + (p - C), used.begin() + (p + E), 1) != used.begin() + (p + E)) continue;
        std::fill(used.begin() + (p - C), used.begin() + (p + E), 1);
        chosen.push_back(p);
    }
    if (int64_t(chosen.size()) < o.items) {
        fail(kExitData,
             "%s: %lld tokens hold only %zu non-overlapping passages of %lld + %lld tokens within a document%s; ask "
             "for fewer --items, or a shorter --context or --ending", source.c_str(), (long long)n, chosen.size(),
             (long long)C, (long long)E, o.word_start ? " whose ending starts a word" : "");
    }
    std::sort(chosen.begin(), chosen.end());

    McSet set{source, {}};
    auto window = [&](int64_t q) {
        return std::vector<int32_t>(tokens.begin() + q, tokens.begin() + (q + E));
    };
    for (int64_t p : chosen) {
        McItem it;
        it.context.assign(tokens.begin() + (p - C), tokens.begin() + p);
        it.label = int(rng.below(uint64_t(o.choices)));
        std::vector<std::vector<int32_t>> picked{window(p)};
        for (int attempt = 0; int(picked.size()) < o.choices; attempt++) {
            if (attempt == 100000) {
                fail(kExitData, "%s: cannot find %d distinct distractors of %lld tokens for the passage at token %lld; "
                     "the text is too small or too repetitive for these settings", source.c_str(), o.choices - 1,
                     (long long)E, (long long)p);
            }
            const int64_t q = ending_starts[size_t(rng.below(ending_starts.size()))];
            if (q < p + E && q + E > p - C) continue;
            std::vector<int32_t> w = window(q);
            if (std::find(picked.begin(), picked.end(), w) == picked.end()) picked.push_back(std::move(w));
        }
        // The true ending moves to the label's place; the distractors keep their order around it.
        std::rotate(picked.begin(), picked.begin() + 1, picked.begin() + 1 + it.label);
        it.endings = std::move(picked);
        set.items.push_back(std::move(it));
    }
    return set;
}

std::string printable(const Tokenizer& tok, const std::vector<int32_t>& ids) {
    std::vector<uint32_t> u(ids.begin(), ids.end());
    std::string text = tok.decode(u.data(), u.size()), out;
    for (char c : text) out += c == '\n' ? std::string("\\n") : std::string(1, c);
    return out;
}

void print_summary(const Options& o, const McSet& set, const Tokenizer& tok) {
    int64_t longest_context = 0, longest_ending = 0, longest_row = 0;
    for (const McItem& it : set.items) {
        longest_context = std::max(longest_context, int64_t(it.context.size()));
        longest_ending = std::max(longest_ending, mc_longest_ending(it));
        longest_row = std::max(longest_row, int64_t(it.context.size()) + mc_longest_ending(it) - 1);
    }
    std::printf("prepare_eval: wrote %zu items to %s (contexts up to %lld tokens, endings up to %lld; the longest row "
                "is %lld positions: a shorter T cuts contexts from the left)\n", set.items.size(), o.out.c_str(),
                (long long)longest_context, (long long)longest_ending, (long long)longest_row);
    const McItem& it = set.items[0];
    std::printf("item 0 (label %d):\n  context: %s\n", it.label, printable(tok, it.context).c_str());
    for (size_t e = 0; e < it.endings.size(); e++) {
        std::printf("  %s[%zu] %s\n", int(e) == it.label ? "*" : " ", e, printable(tok, it.endings[e]).c_str());
    }
}

}  // namespace

// The whole tool, callable in-process: test/test_mc_eval.cpp includes this file with
// PREPARE_EVAL_NO_MAIN defined.
int prepare_eval_main(int argc, char** argv) {
    return run_main([&] {
        Options o;
        if (!parse_args(argc, argv, o)) return kExitOk;
        for (const std::string& f : {o.encoder_json, o.vocab_bpe}) {
            if (::access(f.c_str(), R_OK) != 0) {
                int e = errno;
                fail(kExitIo, "cannot read GPT-2's vocabulary file '%s': %s; scripts/setup.sh puts it in .deps/gpt2 (run "
                     "from the repository root), or name the files with --encoder-json and --vocab-bpe",
                     f.c_str(), std::strerror(e));
            }
        }
        const Tokenizer tok = load_gpt2_vocab_files(o.encoder_json, o.vocab_bpe);
        const Gpt2Encoder enc(tok);
        McSet set;
        if (!o.hellaswag.empty()) {
            set = read_hellaswag_jsonl(o.hellaswag, enc);
        } else {
            std::string source = o.heldout[0] + (o.heldout.size() > 1 ? format(" and %zu more", o.heldout.size() - 1) : "");
            const std::vector<uint32_t> tokens = read_heldout_tokens(o.heldout, tok, enc);
            set = make_heldout_set(tokens, tok, o.h, source);
            if (!o.quiet) {
                std::printf("prepare_eval: %lld items from %zu tokens of %s: passages of %d tokens, %d endings of %d "
                            "tokens%s, seed %lld\n", (long long)o.h.items, tokens.size(), source.c_str(), o.h.context,
                            o.h.choices, o.h.ending, o.h.word_start ? " starting a word" : "", (long long)o.h.seed);
            }
        }
        write_mc_file(o.out, set);
        if (!o.quiet) print_summary(o, set, tok);
        return kExitOk;
    });
}

#ifndef PREPARE_EVAL_NO_MAIN
int main(int argc, char** argv) { return prepare_eval_main(argc, argv); }
#endif
