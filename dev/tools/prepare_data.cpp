/*
prepare_data: turns text into GPT-2 token shards that the DataLoader reads.

Inputs are plain text files (each file is one document, its bytes as they are), JSONL files (names
ending .jsonl, or any with --format jsonl: one JSON object per line and document, its text in a string
field, "text" by default; blank lines are skipped), or folders (every file below them, in byte order of
the path). Every document is preceded by <|endoftext|> (50256); an empty text file is no document.
Documents go to the train split, or to the validation split when their input was named with --val, or,
with --val-fraction F, when they are among the fraction F of documents picked evenly through the input
order (document k is validation when floor((k+1)F) > floor(kF)). Each split is cut into shards of
--shard-tokens tokens (the last one shorter), written as OUT/NAME_train_000000.bin, ... and
OUT/NAME_val_000000.bin, ... in shard.h's format, version 1 (uint16 tokens). Files are read in the order
above, or with --shuffle-files SEED in a seeded permutation of that order (the DataLoader's splitmix64
permutation, the same on every machine), so that each shard mixes documents of every source. A folder
below an input that leads back to a folder it is in (a link such as sub/up -> ..) is skipped with a
warning.

The output is all or nothing: shards are written into OUT/.NAME.partial (the same file system) and moved
into OUT only when every input has been encoded, replacing every shard of the same name an earlier run
left there, so that a glob never mixes two runs. A run that fails (bad input, a full disk) or is stopped
by SIGINT or SIGTERM removes that folder and leaves OUT as it was; a folder left by a killed run is
removed by the next run of the same name. While a run lasts, both sets take disk space.

Work is spread over --threads threads (default: one per core). The main thread reads the inputs into
chunks of about 1 MiB of whole documents (a longer text document is cut where tokenizer.h's
safe_split_point() allows), workers encode chunks, and the main thread writes results in input order.
Chunks do not depend on the thread count, so the shards are byte-identical whatever it is.

Also writes llm.c's tokenizer file (--write-tokenizer), which the trainer loads for decoding: whole or
not at all, and with inputs only once they have been encoded, just before the shards are published.

Before any work the output folder is created if missing and proven writable (a small file written,
synced and removed), and so is the folder of --write-tokenizer, so that a read-only or full disk fails
at once, not after the encoding. Warns (stderr) about an input that yields no document (an empty text
file, a JSONL file of blank lines) and about a text input whose bytes are mostly not UTF-8 text (more
than a quarter invalid UTF-8 or control characters: a binary file, or text in another encoding); it
encodes them all the same.

Errors name the file (and line, for JSONL; for a path that is no regular file, such as a FIFO or a link
loop, the system's reason) and exit with utils.h's codes: 2 usage, 3 unreadable input or unwritable
output, 4 bad JSON or vocabulary files; a run stopped by a signal prints its error line and then ends by
that signal. Does not: deduplicate, filter, shuffle, or
know any special token but <|endoftext|>; --shuffle-files moves whole files, not the lines of a JSONL
file or the parts of a text.
*/
#define LLMC_TOKENIZER_ENCODER
#include "llmc/tokenizer.h"
#include "llmc/dataloader.h"  // seeded_permutation

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dev/tools/jsonl.h"
#include "llmc/flags.h"
#include "llmc/shard.h"
#include "llmc/utils.h"

namespace {

using namespace llmc;

enum class Format { Auto, Text, Jsonl };

struct Options {
    std::vector<std::string> train_inputs;
    std::vector<std::string> val_inputs;
    double val_fraction = 0.0;
    std::string out_dir = "data";
    std::string name = "corpus";
    Format format = Format::Auto;
    std::string text_field = "text";
    int64_t shard_tokens = 100000000;
    int threads = static_cast<int>(std::min(1024u, std::max(1u, std::thread::hardware_concurrency())));
    int64_t chunk_bytes = 1 << 20;
    std::string encoder_json = ".deps/gpt2/encoder.json";
    std::string vocab_bpe = ".deps/gpt2/vocab.bpe";
    std::string write_tokenizer;
    bool quiet = false;
    bool shuffle_files = false;
    int64_t shuffle_seed = 0;
};

// Returns false when --help was given. Checks what one flag's type and range cannot say.
bool parse_args(int argc, char** argv, Options& o) {
    std::string format = "auto";
    Flags flags("prepare_data", "Encodes text files, JSONL files or folders of them with GPT-2's tokenizer into token shards.");
    flags.positional("INPUT", &o.train_inputs, "inputs (files or folders) whose documents go to the train split")
        .add("", "val", &o.val_inputs, "an input (file or folder) whose documents all go to the validation split; repeatable")
        .add("", "val-fraction", &o.val_fraction, "send this fraction of the documents (above 0, below 1; picked evenly) to validation")
        .add("", "out", &o.out_dir, "folder for the shards (created if missing)")
        .add("", "name", &o.name, "shard name prefix: OUT/NAME_train_000000.bin")
        .add("", "format", &format, "how to read inputs: auto (.jsonl files are JSONL, others text), text or jsonl")
        .add("", "text-field", &o.text_field, "the JSONL field that holds a document's text")
        .add("", "shard-tokens", &o.shard_tokens, "tokens per shard", 1, kShardV1MaxTokens)
        .add("", "threads", &o.threads, "encoding threads; the default is one per core", 1, 1024)
        .add("", "chunk-bytes", &o.chunk_bytes, "bytes of text per unit of work; shards depend on it, not on --threads", 64,
             1LL << 30)
        .add("", "encoder-json", &o.encoder_json, "GPT-2's encoder.json")
        .add("", "vocab-bpe", &o.vocab_bpe, "GPT-2's vocab.bpe")
        .add("", "write-tokenizer", &o.write_tokenizer, "also write llm.c's tokenizer file (version 2) for decoding; inputs are optional then")
        .add("", "shuffle-files", &o.shuffle_seed,
             "read the input files in an order shuffled with this seed (a whole file moves), so shards mix the sources", 0,
             INT64_MAX)
        .add_switch("", "quiet", &o.quiet, "print errors only");
    if (!flags.parse(argc, argv)) return false;
    o.shuffle_files = flags.was_set("shuffle-files");

    if (flags.was_set("val-fraction") && !(o.val_fraction > 0.0 && o.val_fraction < 1.0)) {
        fail(kExitUsage, "--val-fraction expects a number between 0 and 1 (exclusive), got %g", o.val_fraction);
    }
    if (o.name.empty() || o.name.find('/') != std::string::npos) {
        fail(kExitUsage, "--name must be a plain file name, got '%s'", o.name.c_str());
    }
    if (format == "auto") o.format = Format::Auto;
    else if (format == "text") o.format = Format::Text;
    else if (format == "jsonl") o.format = Format::Jsonl;
    else fail(kExitUsage, "--format expects auto, text or jsonl, got '%s'", format.c_str());
    if (o.val_fraction > 0 && !o.val_inputs.empty()) {
        fail(kExitUsage, "choose the validation split either by file (--val) or by fraction (--val-fraction), not both");
    }
    if (o.train_inputs.empty() && o.val_inputs.empty() && o.write_tokenizer.empty()) {
        fail(kExitUsage, "no input given (see --help)");
    }
    return true;
}

// ---- inputs ----

enum Split { kTrain = 0, kVal = 1 };
const char* split_name(int s) { return s == kTrain ? "train" : "val"; }

struct Input {
    std::string path;
    Split split;
    bool jsonl;
    int64_t bytes;
};

// A folder being walked, to recognise a link that leads back to it.
struct WalkedFolder {
    dev_t device;
    ino_t inode;
    std::string path;
};

// Appends the regular files at or below `path` (with their sizes), in byte order of the path. `walking`
// holds the folders above `path`: a folder that is one of them is a loop, skipped with a warning.
void list_files(const std::string& path, std::vector<std::pair<std::string, int64_t>>& out,
                std::vector<WalkedFolder>& walking) {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0 || !(S_ISREG(st.st_mode) || S_ISDIR(st.st_mode))) {
        fail(kExitIo, "cannot read input '%s': %s", path.c_str(), why_not_regular_file(path).c_str());
    }
    if (S_ISREG(st.st_mode)) {
        out.emplace_back(path, static_cast<int64_t>(st.st_size));
        return;
    }
    for (const WalkedFolder& f : walking) {
        if (f.device == st.st_dev && f.inode == st.st_ino) {
            std::fprintf(stderr, "warning: skipping '%s': it leads back to '%s', a folder it is in\n", path.c_str(),
                         f.path.c_str());
            return;
        }
    }
    DIR* dir = ::opendir(path.c_str());
    if (!dir) {
        int e = errno;
        fail(kExitIo, "cannot list folder '%s': %s", path.c_str(), std::strerror(e));
    }
    std::vector<std::string> names;
    while (dirent* d = ::readdir(dir)) {
        std::string n = d->d_name;
        if (n != "." && n != "..") names.push_back(n);
    }
    ::closedir(dir);
    std::sort(names.begin(), names.end());
    std::string prefix = path.back() == '/' ? path : path + "/";
    walking.push_back({st.st_dev, st.st_ino, path});
    for (const std::string& n : names) list_files(prefix + n, out, walking);
    walking.pop_back();
}

bool ends_with(const std::string& s, const char* suffix) {
    size_t n = std::strlen(suffix);
    return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

std::vector<Input> resolve_inputs(const Options& o) {
    std::vector<Input> inputs;
    auto add = [&](const std::vector<std::string>& paths, Split split) {
        for (const std::string& p : paths) {
            std::vector<std::pair<std::string, int64_t>> files;
            std::vector<WalkedFolder> walking;
            list_files(p, files, walking);
            if (files.empty()) fail(kExitIo, "folder '%s' holds no files", p.c_str());
            for (const auto& [f, bytes] : files) {
                bool jsonl = o.format == Format::Jsonl || (o.format == Format::Auto && ends_with(f, ".jsonl"));
                inputs.push_back({f, split, jsonl, bytes});
            }
        }
    };
    add(o.train_inputs, kTrain);
    add(o.val_inputs, kVal);
    if (o.shuffle_files) {
        std::vector<uint32_t> order(inputs.size());
        seeded_permutation(static_cast<uint64_t>(o.shuffle_seed), order.data(), order.size());
        std::vector<Input> shuffled;
        shuffled.reserve(inputs.size());
        for (uint32_t i : order) shuffled.push_back(inputs[i]);
        inputs.swap(shuffled);
    }
    return inputs;
}

// ---- work items ----

// A run of bytes from one input: a whole text document, a part of one, or whole JSONL lines.
struct Segment {
    size_t begin = 0, end = 0;  // into Chunk::bytes
    uint32_t input = 0;
    bool starts_document = false;  // text only: the first part of its document
    int64_t first_line = 0;        // JSONL only: line number of the first line
};

struct Chunk {
    uint64_t seq = 0;
    std::string bytes;
    std::vector<Segment> segments;
};

// A document's tokens (or the tokens of a part of one) inside an EncodedChunk.
struct DocPart {
    size_t token_end = 0;
    uint32_t input = 0;
    bool starts_document = false;
    int64_t not_text_bytes = 0;  // text inputs: bytes of invalid UTF-8 or control characters
};

struct EncodedChunk {
    std::vector<uint32_t> tokens;
    std::vector<DocPart> parts;
    size_t bytes = 0;
    std::exception_ptr error;
};

// Reads the inputs in order and cuts them into chunks of about chunk_bytes of whole documents.
class ChunkReader {
public:
    ChunkReader(const std::vector<Input>& inputs, size_t chunk_bytes) : inputs_(inputs), chunk_bytes_(chunk_bytes) {}

    // Fills `chunk` and returns true, or returns false when every input has been read.
    bool next(Chunk& chunk) {
        chunk.bytes.clear();
        chunk.segments.clear();
        chunk.seq = seq_++;
        while (chunk.bytes.size() < chunk_bytes_) {
            if (!file_.is_open()) {
                if (input_ == inputs_.size()) break;
                file_.open(inputs_[input_].path, File::Mode::Read);
                pending_.clear();
                eof_ = false;
                started_document_ = false;
                line_ = 1;
            }
            const Input& in = inputs_[input_];
            size_t room = chunk_bytes_ - chunk.bytes.size();
            if (!eof_ && pending_.size() < room) fill(room - pending_.size());
            if (eof_ && pending_.empty()) {  // an empty file has no document; a finished one is done
                file_.close();
                input_++;
                continue;
            }
            size_t take = eof_ ? pending_.size() : cut(in, room);
            if (take == 0 && !chunk.segments.empty()) break;  // does not fit; next chunk
            if (take == 0) {
                fill(std::max(pending_.size(), chunk_bytes_));  // a document longer than a chunk: read on
                continue;
            }
            Segment s;
            s.begin = chunk.bytes.size();
            s.end = s.begin + take;
            s.input = static_cast<uint32_t>(input_);
            s.starts_document = !started_document_;
            s.first_line = line_;
            chunk.bytes.append(pending_, 0, take);
            chunk.segments.push_back(s);
            if (in.jsonl) line_ += std::count(pending_.begin(), pending_.begin() + take, '\n');
            started_document_ = true;
            pending_.erase(0, take);
        }
        return !chunk.segments.empty();
    }

private:
    void fill(size_t want) {
        size_t old = pending_.size();
        pending_.resize(old + want);
        size_t got = file_.read_some(pending_.data() + old, want);
        pending_.resize(old + got);
        if (got < want) eof_ = true;
    }

    // How many pending bytes (at most `room`, more only when nothing fits) form whole units: lines
    // for JSONL, a safe split for text. 0 when none is complete yet.
    size_t cut(const Input& in, size_t room) {
        std::string_view p(pending_);
        if (in.jsonl) {
            size_t nl = p.rfind('\n', std::min(room, p.size()) - 1);
            if (nl != std::string_view::npos) return nl + 1;
            nl = p.find('\n');
            return nl == std::string_view::npos ? 0 : nl + 1;
        }
        // The last split point that fits: look in a window before the limit, widening it if needed.
        size_t limit = std::min(room, p.size());
        for (size_t window = 4096; limit > 0; window *= 16) {
            size_t from = limit > window ? limit - window : 0;
            size_t at = safe_split_point(p.substr(0, limit), from);
            while (at < limit) {
                size_t later = safe_split_point(p.substr(0, limit), at + 1);
                if (later >= limit) return at;
                at = later;
            }
            if (from == 0) break;
        }
        size_t at = safe_split_point(p, limit);
        return at < p.size() ? at : 0;
    }

    const std::vector<Input>& inputs_;
    size_t chunk_bytes_;
    size_t input_ = 0;
    File file_;
    std::string pending_;
    bool eof_ = false;
    bool started_document_ = false;
    int64_t line_ = 1;
    uint64_t seq_ = 0;
};

// Bytes of `s` that are not UTF-8 text: bytes outside a well-formed UTF-8 sequence (overlong forms and
// surrogates included), and control characters other than tab, line feed, form feed and carriage return.
int64_t count_not_text(std::string_view s) {
    int64_t bad = 0;
    const size_t n = s.size();
    for (size_t i = 0; i < n;) {
        const unsigned char c = static_cast<unsigned char>(s[i]);
        if (c < 0x80) {
            if ((c < 0x20 && c != '\t' && c != '\n' && c != '\f' && c != '\r') || c == 0x7F) bad++;
            i++;
            continue;
        }
        // The allowed range of the second byte depends on the first (RFC 3629's table).
        int more = 0;
        unsigned char lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) more = 1;
        else if (c == 0xE0) more = 2, lo = 0xA0;
        else if (c == 0xED) more = 2, hi = 0x9F;
        else if (c >= 0xE1 && c <= 0xEF) more = 2;
        else if (c == 0xF0) more = 3, lo = 0x90;
        else if (c == 0xF4) more = 3, hi = 0x8F;
        else if (c >= 0xF1 && c <= 0xF3) more = 3;
        int ok = 0;
        if (more > 0 && i + 1 < n) {
            const unsigned char c1 = static_cast<unsigned char>(s[i + 1]);
            if (c1 >= lo && c1 <= hi) {
                ok = 1;
                while (ok < more && i + 1 + ok < n && (static_cast<unsigned char>(s[i + 1 + ok]) & 0xC0) == 0x80) ok++;
            }
        }
        if (more > 0 && ok == more) {
            i += 1 + more;
        } else {
            bad++;  // the lead byte; its stray continuation bytes are counted as they come
            i++;
        }
    }
    return bad;
}

void encode_chunk(const Gpt2Encoder& enc, Gpt2Encoder::Context& ctx, const std::vector<Input>& inputs,
                  const std::string& text_field, const Chunk& chunk, EncodedChunk& out) {
    out.tokens.clear();
    out.parts.clear();
    out.bytes = chunk.bytes.size();
    out.error = nullptr;
    std::string_view all(chunk.bytes);
    for (const Segment& s : chunk.segments) {
        const Input& in = inputs[s.input];
        std::string_view seg = all.substr(s.begin, s.end - s.begin);
        if (!in.jsonl) {
            if (s.starts_document) out.tokens.push_back(enc.eot());
            enc.encode_ordinary(ctx, seg, out.tokens);
            out.parts.push_back({out.tokens.size(), s.input, s.starts_document, count_not_text(seg)});
            continue;
        }
        int64_t line_no = s.first_line;
        for (size_t pos = 0; pos < seg.size(); line_no++) {
            size_t nl = seg.find('\n', pos);
            size_t end = nl == std::string_view::npos ? seg.size() : nl;
            std::string_view line = seg.substr(pos, end - pos);
            pos = end + 1;
            if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
            const std::string text = jsonl_document_text(line, in.path, line_no, text_field);
            out.tokens.push_back(enc.eot());
            enc.encode_ordinary(ctx, text, out.tokens);
            out.parts.push_back({out.tokens.size(), s.input, true, 0});
        }
    }
}

// ---- output ----

std::string shard_path(const std::string& dir, const std::string& name, int split, int64_t index) {
    return format("%s/%s_%s_%06lld.bin", dir.c_str(), name.c_str(), split_name(split), (long long)index);
}

// The folder inside OUT that holds this run's shards until they are published, and afterwards the
// earlier run's shards they replaced (in replaced/); removed with its contents when the run ends.
class Staging {
public:
    explicit Staging(const Options& o) : dir_(o.out_dir + "/." + o.name + ".partial") {
        std::error_code e;
        std::filesystem::remove_all(dir_, e);  // left by a killed run
        if (e) fail(kExitIo, "cannot remove '%s', left by an earlier run: %s", dir_.c_str(), e.message().c_str());
        make_directories(replaced());
    }
    ~Staging() {
        std::error_code e;
        std::filesystem::remove_all(dir_, e);
    }
    const std::string& dir() const { return dir_; }
    std::string replaced() const { return dir_ + "/replaced"; }

private:
    std::string dir_;
};

class ShardWriter {
public:
    ShardWriter(const Options& o, const std::string& dir, int split, int version)
        : o_(o), dir_(dir), split_(split), version_(version) {}

    void append(const uint32_t* tokens, size_t n) {
        while (n > 0) {
            size_t take = std::min(n, static_cast<size_t>(o_.shard_tokens) - buffer_.size());
            buffer_.insert(buffer_.end(), tokens, tokens + take);
            tokens += take;
            n -= take;
            total_ += take;
            if (buffer_.size() == static_cast<size_t>(o_.shard_tokens)) flush();
        }
    }
    void finish() {
        if (!buffer_.empty()) flush();
    }
    int64_t shards() const { return shards_; }
    int64_t tokens() const { return total_; }

private:
    void flush() {
        write_token_shard(shard_path(dir_, o_.name, split_, shards_), buffer_.data(), buffer_.size(), version_);
        shards_++;
        buffer_.clear();
    }

    const Options& o_;
    std::string dir_;
    int split_;
    int version_;
    std::vector<uint32_t> buffer_;
    int64_t shards_ = 0;
    int64_t total_ = 0;
};

// Moves the staged shards into OUT in place of every shard of this name an earlier run left there (numbered
// from 0 up), which move into the staging folder. A rename that fails undoes those before it, so that OUT
// holds one set or the other, whole. Returns how many earlier shards were replaced.
int64_t publish_shards(const Options& o, const Staging& staging, const ShardWriter* const writers[2]) {
    std::vector<std::pair<std::string, std::string>> moves;
    for (int s : {kTrain, kVal}) {
        for (int64_t i = 0; regular_file_exists(shard_path(o.out_dir, o.name, s, i)); i++) {
            moves.emplace_back(shard_path(o.out_dir, o.name, s, i), shard_path(staging.replaced(), o.name, s, i));
        }
    }
    const int64_t replaced = static_cast<int64_t>(moves.size());
    for (int s : {kTrain, kVal}) {
        for (int64_t i = 0; i < writers[s]->shards(); i++) {
            moves.emplace_back(shard_path(staging.dir(), o.name, s, i), shard_path(o.out_dir, o.name, s, i));
        }
    }
    size_t done = 0;
    try {
        for (; done < moves.size(); done++) {
            const auto& [from, to] = moves[done];
            if (std::rename(from.c_str(), to.c_str()) != 0) {
                int e = errno;
                fail(kExitIo, "cannot move '%s' to '%s': %s", from.c_str(), to.c_str(), std::strerror(e));
            }
        }
        sync_directory(o.out_dir);
    } catch (...) {
        while (done > 0) {
            done--;
            std::rename(moves[done].second.c_str(), moves[done].first.c_str());
        }
        throw;
    }
    return replaced;
}

// The signal (SIGINT, SIGTERM) that asked the run to stop, or 0. The run checks it between chunks and
// before publishing, and stops as a failed run does, leaving OUT as it was.
volatile std::sig_atomic_t g_stop_signal = 0;

void stop_if_asked(const Options& o) {
    if (g_stop_signal != 0) {
        fail(kExitError, "stopped by a signal (%s): nothing was published, '%s' is as it was", strsignal(g_stop_signal),
             o.out_dir.c_str());
    }
}

// The folder of --write-tokenizer must exist already (it is not created) and be writable, and the path
// name a regular file or nothing.
void check_tokenizer_path(const std::string& path) {
    struct stat st;
    if (::stat(path.c_str(), &st) == 0 ? !S_ISREG(st.st_mode) : errno != ENOENT) {
        fail(kExitIo, "--write-tokenizer '%s': %s", path.c_str(), why_not_regular_file(path).c_str());
    }
    const std::string dir = parent_directory(path);
    if (!directory_exists(dir)) {
        fail(kExitIo, "--write-tokenizer '%s': the folder '%s' does not exist", path.c_str(), dir.c_str());
    }
    require_writable_directory(dir, "the folder of --write-tokenizer");
}

// ---- progress ----

class Progress {
public:
    Progress(int64_t total_bytes, bool quiet)
        : total_(total_bytes), quiet_(quiet), tty_(::isatty(2)), start_(Clock::now()), last_(start_) {}

    void update(int64_t bytes, int64_t tokens) {
        auto now = Clock::now();
        double since_last = seconds(last_, now);
        if (quiet_ || seconds(start_, now) < 2.0 || since_last < (tty_ ? 0.5 : 10.0)) return;
        last_ = now;
        print(bytes, tokens, tty_ ? "\r" : "", tty_ ? "" : "\n");
        shown_ = true;
    }
    void done(int64_t bytes, int64_t tokens) {
        if (shown_ && tty_) print(bytes, tokens, "\r", "\n");
    }
    double elapsed() const { return seconds(start_, Clock::now()); }

private:
    using Clock = std::chrono::steady_clock;
    static double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }
    void print(int64_t bytes, int64_t tokens, const char* pre, const char* post) {
        double t = elapsed();
        double rate = bytes / 1e6 / std::max(t, 1e-9);
        double eta = rate > 0 ? (total_ - bytes) / 1e6 / rate : 0;
        std::fprintf(stderr, "%s%9.1f / %.1f MB  %7.1f MB/s  %12lld tokens  ETA %d:%02d   %s", pre, bytes / 1e6,
                     total_ / 1e6, rate, (long long)tokens, (int)eta / 60, (int)eta % 60, post);
        std::fflush(stderr);
    }
    int64_t total_;
    bool quiet_;
    bool tty_;
    Clock::time_point start_, last_;
    bool shown_ = false;
};

// ---- the pipeline ----

struct RunStats {
    int64_t documents[2] = {0, 0};
    int64_t bytes = 0;
    double encode_seconds = 0;
    std::vector<int64_t> input_documents, input_not_text;  // per input
};

// The main thread reads chunks and writes results in order; `threads` workers encode. At most
// 2 * threads + 2 chunks are in flight, which bounds memory.
RunStats run_pipeline(const Options& o, const Gpt2Encoder& enc, const std::vector<Input>& inputs,
                      ShardWriter* writers[2]) {
    struct Slot {
        Chunk chunk;
        EncodedChunk result;
        bool done = false;
    };
    std::mutex mu;
    std::condition_variable work_cv, done_cv;
    std::deque<Slot*> queue;
    std::map<uint64_t, std::unique_ptr<Slot>> in_flight;
    std::vector<std::unique_ptr<Slot>> free_slots;  // reused, so their buffers are not faulted in anew
    bool closing = false;

    std::vector<std::thread> workers;
    for (int t = 0; t < o.threads; t++) {
        workers.emplace_back([&] {
            Gpt2Encoder::Context ctx(enc);
            for (;;) {
                Slot* slot;
                {
                    std::unique_lock<std::mutex> lock(mu);
                    work_cv.wait(lock, [&] { return closing || !queue.empty(); });
                    if (queue.empty()) return;
                    slot = queue.front();
                    queue.pop_front();
                }
                try {
                    encode_chunk(enc, ctx, inputs, o.text_field, slot->chunk, slot->result);
                } catch (...) {
                    slot->result.error = std::current_exception();
                }
                {
                    std::lock_guard<std::mutex> lock(mu);
                    slot->done = true;
                }
                done_cv.notify_all();
            }
        });
    }
    auto stop_workers = [&] {
        {
            std::lock_guard<std::mutex> lock(mu);
            closing = true;
            queue.clear();
        }
        work_cv.notify_all();
        for (std::thread& w : workers) w.join();
        workers.clear();
    };

    int64_t total_bytes = 0;
    for (const Input& in : inputs) total_bytes += in.bytes;
    Progress progress(total_bytes, o.quiet);
    RunStats stats;
    stats.input_documents.assign(inputs.size(), 0);
    stats.input_not_text.assign(inputs.size(), 0);
    int64_t tokens_written = 0;
    uint64_t next_to_write = 0;
    int current_split = kTrain;
    int64_t doc_index = 0;
    const size_t max_in_flight = 2 * static_cast<size_t>(o.threads) + 2;

    auto write_result = [&](const EncodedChunk& r) {
        if (r.error) std::rethrow_exception(r.error);
        size_t begin = 0;
        for (const DocPart& part : r.parts) {
            if (part.starts_document) {
                if (o.val_fraction > 0) {
                    double f = o.val_fraction;
                    current_split = std::floor((doc_index + 1) * f) > std::floor(doc_index * f) ? kVal : kTrain;
                } else {
                    current_split = inputs[part.input].split;
                }
                doc_index++;
                stats.documents[current_split]++;
                stats.input_documents[part.input]++;
            }
            stats.input_not_text[part.input] += part.not_text_bytes;
            writers[current_split]->append(r.tokens.data() + begin, part.token_end - begin);
            begin = part.token_end;
        }
        tokens_written += static_cast<int64_t>(r.tokens.size());
        stats.bytes += static_cast<int64_t>(r.bytes);
        progress.update(stats.bytes, tokens_written);
    };
    // Writes every finished result at the head of the order; with `wait`, first waits for the head.
    auto drain = [&](bool wait) {
        for (;;) {
            std::unique_ptr<Slot> slot;
            {
                std::unique_lock<std::mutex> lock(mu);
                auto head = in_flight.find(next_to_write);
                if (head == in_flight.end()) return;
                if (!head->second->done) {
                    if (!wait) return;
                    done_cv.wait(lock, [&] { return head->second->done; });
                }
                slot = std::move(head->second);
                in_flight.erase(head);
            }
            next_to_write++;
            write_result(slot->result);
            free_slots.push_back(std::move(slot));
            wait = false;
        }
    };

    try {
        ChunkReader reader(inputs, static_cast<size_t>(o.chunk_bytes));
        for (;;) {
            stop_if_asked(o);
            std::unique_ptr<Slot> slot;
            if (free_slots.empty()) {
                slot = std::make_unique<Slot>();
            } else {
                slot = std::move(free_slots.back());
                free_slots.pop_back();
                slot->done = false;
            }
            if (!reader.next(slot->chunk)) break;
            {
                std::lock_guard<std::mutex> lock(mu);
                queue.push_back(slot.get());
                in_flight.emplace(slot->chunk.seq, std::move(slot));
            }
            work_cv.notify_one();
            drain(false);
            while (true) {
                size_t n;
                {
                    std::lock_guard<std::mutex> lock(mu);
                    n = in_flight.size();
                }
                if (n < max_in_flight) break;
                drain(true);
            }
        }
        for (;;) {
            {
                std::lock_guard<std::mutex> lock(mu);
                if (in_flight.empty()) break;
            }
            drain(true);
        }
    } catch (...) {
        stop_workers();
        throw;
    }
    stop_workers();
    stats.encode_seconds = progress.elapsed();
    progress.done(stats.bytes, tokens_written);
    return stats;
}

// One line per input that yields no document or is mostly not UTF-8 text (at most kMaxLines of each,
// then a count), on stderr.
void warn_about_inputs(const std::vector<Input>& inputs, const RunStats& stats) {
    constexpr int kMaxLines = 10;
    int empty = 0, binary = 0;
    for (size_t i = 0; i < inputs.size(); i++) {
        const Input& in = inputs[i];
        if (stats.input_documents[i] == 0 && ++empty <= kMaxLines) {
            std::fprintf(stderr, "warning: input '%s' yields no documents (%s)\n", in.path.c_str(),
                         in.jsonl ? "no JSON lines, only blank ones" : "an empty file");
        }
        if (!in.jsonl && in.bytes > 0 && stats.input_not_text[i] * 4 > in.bytes && ++binary <= kMaxLines) {
            std::fprintf(stderr, "warning: input '%s': %.0f%% of its %lld bytes are not UTF-8 text (invalid UTF-8 or "
                         "control characters); is it a binary file, or text in another encoding?\n", in.path.c_str(),
                         100.0 * double(stats.input_not_text[i]) / double(in.bytes), (long long)in.bytes);
        }
    }
    if (empty > kMaxLines) std::fprintf(stderr, "warning: %d more inputs yield no documents\n", empty - kMaxLines);
    if (binary > kMaxLines) std::fprintf(stderr, "warning: %d more inputs are mostly not UTF-8 text\n", binary - kMaxLines);
}

void write_tokenizer(const Options& o, const Tokenizer& tok) {
    write_tokenizer_bin(tok, o.write_tokenizer);
    if (!o.quiet) std::printf("wrote %s (%zu tokens, end-of-text %u)\n", o.write_tokenizer.c_str(), tok.size(), tok.eot());
}

}  // namespace

// The whole tool, callable in-process: test/test_tokenizer.cpp includes this file with
// PREPARE_DATA_NO_MAIN defined and runs it on its own inputs.
int prepare_data_main(int argc, char** argv) {
    return run_main([&] {
        Options o;
        if (!parse_args(argc, argv, o)) return kExitOk;
        std::vector<Input> inputs = resolve_inputs(o);
        if (!inputs.empty()) {
            require_writable_directory(o.out_dir, "output folder");
        }
        if (!o.write_tokenizer.empty()) check_tokenizer_path(o.write_tokenizer);

        auto t0 = std::chrono::steady_clock::now();
        for (const std::string& f : {o.encoder_json, o.vocab_bpe}) {
            const std::string why = why_not_regular_file(f);
            if (!why.empty()) {
                fail(kExitIo, "cannot read GPT-2's vocabulary file '%s': %s; scripts/setup.sh puts it in .deps/gpt2 (run "
                     "from the repository root), or name the files with --encoder-json and --vocab-bpe",
                     f.c_str(), why.c_str());
            }
        }
        Tokenizer tok = load_gpt2_vocab_files(o.encoder_json, o.vocab_bpe);
        if (inputs.empty()) {
            write_tokenizer(o, tok);
            return kExitOk;
        }
        Gpt2Encoder enc(tok);
        double load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

        int64_t total_bytes = 0;
        for (const Input& in : inputs) total_bytes += in.bytes;
        if (!o.quiet) {
            std::printf("prepare_data: %zu files, %.1f MB, %d threads, vocabulary of %zu tokens loaded in %.2f s%s\n",
                        inputs.size(), total_bytes / 1e6, o.threads, tok.size(), load_seconds,
                        enc.jit() ? "" : " (PCRE2 without JIT: slower)");
        }
        int version = tok.size() <= 65536 ? 1 : 2;
        Staging staging(o);
        ShardWriter train(o, staging.dir(), kTrain, version), val(o, staging.dir(), kVal, version);
        ShardWriter* writers[2] = {&train, &val};
        RunStats stats = run_pipeline(o, enc, inputs, writers);
        train.finish();
        val.finish();
        stop_if_asked(o);
        if (!o.write_tokenizer.empty()) write_tokenizer(o, tok);
        int64_t replaced = publish_shards(o, staging, writers);

        warn_about_inputs(inputs, stats);
        if (!o.quiet) {
            for (int s : {kTrain, kVal}) {
                const ShardWriter& w = *writers[s];
                if (w.shards() == 0) {
                    std::printf("  %-5s no documents\n", split_name(s));
                    continue;
                }
                std::printf("  %-5s %8lld documents %12lld tokens in %lld shard%s: %s%s\n", split_name(s),
                            (long long)stats.documents[s], (long long)w.tokens(), (long long)w.shards(),
                            w.shards() == 1 ? "" : "s", shard_path(o.out_dir, o.name, s, 0).c_str(),
                            w.shards() > 1 ? " ..." : "");
            }
            if (replaced > 0) {
                std::printf("  replaced %lld shard%s of an earlier run\n", (long long)replaced, replaced == 1 ? "" : "s");
            }
            std::printf("  %.1f MB in %.2f s: %.1f MB/s, %.0f tokens/s\n", stats.bytes / 1e6, stats.encode_seconds,
                        stats.bytes / 1e6 / std::max(stats.encode_seconds, 1e-9),
                        (train.tokens() + val.tokens()) / std::max(stats.encode_seconds, 1e-9));
        }
        if (o.val_fraction > 0 && val.shards() == 0) {
            std::fprintf(stderr, "warning: --val-fraction %g picked no document out of %lld; the validation split is empty\n",
                         o.val_fraction, (long long)stats.documents[kTrain]);
        }
        return kExitOk;
    });
}

#ifndef PREPARE_DATA_NO_MAIN
int main(int argc, char** argv) {
    for (int sig : {SIGINT, SIGTERM}) {
        struct sigaction sa = {}, old = {};
        sa.sa_handler = [](int s) { g_stop_signal = s; };
        sa.sa_flags = SA_RESETHAND;  // a second signal stops the process at once
        ::sigaction(sig, nullptr, &old);
        if (old.sa_handler != SIG_IGN) ::sigaction(sig, &sa, nullptr);  // as nohup and `cmd &` leave it
    }
    int code = prepare_data_main(argc, argv);
    // Having cleaned up, end as the signal would have, so that a calling shell or script sees it.
    if (code != kExitOk && g_stop_signal != 0) std::raise(g_stop_signal);
    return code;
}
#endif
