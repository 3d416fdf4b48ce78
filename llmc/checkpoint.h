/*
The checkpoint, host side: its files on disk and how they are written, verified, published, rotated and
read back (tested without a GPU). The device side is llmc/checkpoint.cuh.
<out>/ckpt_<step, 8 digits>/ in layout `state_layout` (none: whole):
  whole:    model.bin (llm.c version 3, fp32 master weights), params_bf16.bin, adam_m.bin, adam_v.bin
  sharded:  model.bin (llm.c version 5, bf16) and per rank r master_<r>.bin, adam_m_<r>.bin, adam_v_<r>.bin
plus manifest.txt (step, settings, small blobs, every file's chunk checksums, its own checksum). Older
versions with FP8 matmuls also wrote fp8_history.bin (kCkptFp8HistoryFile): verified like any file the
manifest lists, never read back. Written as ckpt_<step>.tmp/ and renamed into place (CheckpointWriter).
*/
#pragma once

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "llmc/chunk_pipeline.h"
#include "llmc/hash.h"
#include "llmc/model_file.h"
#include "llmc/utils.h"
#include "llmc/zero.h"

namespace llmc {

constexpr int kCheckpointVersion = 1;
constexpr const char* kManifestName = "manifest.txt";
constexpr const char* kManifestMagic = "llmc-checkpoint";

// ----------------------------------------------------------------------------------------------------
// The files.

constexpr const char* kCkptModelFile = "model.bin";  // both layouts
constexpr const char* kCkptParamsFile = "params_bf16.bin";
constexpr const char* kCkptAdamMFile = "adam_m.bin";
constexpr const char* kCkptAdamVFile = "adam_v.bin";
// Written only by older versions with FP8 matmuls (--fp8 1, since removed): a resume ignores it.
constexpr const char* kCkptFp8HistoryFile = "fp8_history.bin";

// The sharded layout's optimizer-state files, one of each per rank.
enum class StateKind { Master, AdamM, AdamV };

inline std::string state_shard_file(StateKind kind, int rank) {
    const char* stem = kind == StateKind::Master ? "master" : kind == StateKind::AdamM ? "adam_m" : "adam_v";
    return format("%s_%05d.bin", stem, rank);
}

// fp8_history.bin's header (dev/tools/inspect_checkpoint.cpp reads old checkpoints): the magic, int32
// version 2, slots, entries per slot, 0; then fp32 history.
constexpr const char* kFp8HistoryMagic = "LLMCFP8H";
constexpr size_t kFp8HistoryHeaderBytes = 24;

// ----------------------------------------------------------------------------------------------------
// The manifest.

struct ChunkSum {
    uint64_t offset = 0, bytes = 0, sum = 0;
};

struct FileRecord {
    std::string name;
    uint64_t size = 0;
    std::vector<ChunkSum> chunks;  // sorted by offset, covering [0, size) without gaps
};

struct CheckpointManifest {
    int version = kCheckpointVersion;
    int64_t step = 0;
    std::vector<std::pair<std::string, std::string>> settings;    // the run's configuration, key -> value
    std::vector<std::pair<std::string, std::vector<uint8_t>>> blobs;  // small binary state (DataLoader)
    std::vector<FileRecord> files;

    const std::string* setting(const std::string& key) const {
        auto it = std::find_if(settings.begin(), settings.end(), [&](const auto& kv) { return kv.first == key; });
        return it == settings.end() ? nullptr : &it->second;
    }
    const std::vector<uint8_t>* blob(const std::string& name) const {
        auto it = std::find_if(blobs.begin(), blobs.end(), [&](const auto& b) { return b.first == name; });
        return it == blobs.end() ? nullptr : &it->second;
    }
    const FileRecord* file(const std::string& name) const {
        auto it = std::find_if(files.begin(), files.end(), [&](const FileRecord& f) { return f.name == name; });
        return it == files.end() ? nullptr : &*it;
    }
};

// A line for a checkpoint that an older version wrote with FP8 matmuls (--fp8 1, since removed: its settings'
// "fp8" other than "none", or an fp8_history.bin): nothing of it is read, the run goes on in bf16. Else empty.
inline std::string removed_fp8_note(const CheckpointManifest& m) {
    const std::string* fp8 = m.setting("fp8");
    if ((fp8 == nullptr || *fp8 == "none") && m.file(kCkptFp8HistoryFile) == nullptr) return "";
    return format("the checkpoint was written with FP8 matmuls (%s), which this version no longer has: its %s is "
                  "ignored and the run goes on in bf16", fp8 != nullptr ? fp8->c_str() : "fp8", kCkptFp8HistoryFile);
}

namespace detail {
inline bool is_token(const std::string& s) {
    return !s.empty() && std::none_of(s.begin(), s.end(), [](char c) { return c <= ' ' || c == 127; });
}
inline std::string hex64(uint64_t v) { return format("%016" PRIx64, v); }

// Swaps two directories' names atomically (renameat2 RENAME_EXCHANGE); 0, or -1 with errno. A variable
// so a test can stand in a file system that cannot swap.
inline int (*swap_directories)(const char*, const char*) = [](const char* a, const char* b) {
    return ::renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE);
};

inline void rename_or_fail(const std::string& from, const std::string& to) {
    if (std::rename(from.c_str(), to.c_str()) != 0) {
        const int e = errno;
        fail(kExitIo, "cannot rename '%s' to '%s': %s", from.c_str(), to.c_str(), std::strerror(e));
    }
}

inline void write_synced(const std::string& path, const std::string& text) {
    File f(path, File::Mode::Write);
    f.write_all(text.data(), text.size());
    f.sync();
    f.close();
}
}  // namespace detail

inline std::string encode_manifest(const CheckpointManifest& m) {
    std::string out = format("%s %d\nstep %lld\n", kManifestMagic, m.version, (long long)m.step);
    for (const auto& kv : m.settings) {
        if (!detail::is_token(kv.first) || kv.second.find('\n') != std::string::npos) {
            fail(kExitError, "checkpoint setting '%s' cannot be stored (keys are one word, values one line)",
                 kv.first.c_str());
        }
        out += "setting " + kv.first + " " + kv.second + "\n";
    }
    for (const auto& b : m.blobs) {
        if (!detail::is_token(b.first)) fail(kExitError, "checkpoint blob name '%s' is not one word", b.first.c_str());
        std::string hex;
        hex.reserve(2 * b.second.size());
        for (uint8_t byte : b.second) hex += format("%02x", byte);
        out += "blob " + b.first + " " + (hex.empty() ? "-" : hex) + "\n";
    }
    for (const FileRecord& f : m.files) {
        if (!detail::is_token(f.name) || f.name.find('/') != std::string::npos) {
            fail(kExitError, "checkpoint file name '%s' is not one plain word", f.name.c_str());
        }
        out += format("file %s %llu %zu\n", f.name.c_str(), (unsigned long long)f.size, f.chunks.size());
        for (const ChunkSum& c : f.chunks) {
            out += format("chunk %llu %llu %s\n", (unsigned long long)c.offset, (unsigned long long)c.bytes,
                          detail::hex64(c.sum).c_str());
        }
    }
    out += "end " + detail::hex64(checksum64(out.data(), out.size())) + "\n";
    return out;
}

// Parses and checks a manifest's text; `path` names it in errors. Raises kExitData on anything amiss.
inline CheckpointManifest parse_manifest(const std::string& text, const std::string& path) {
    const size_t end_at = text.rfind("end ");
    if (end_at == std::string::npos || (end_at > 0 && text[end_at - 1] != '\n') || text.empty() || text.back() != '\n') {
        fail(kExitData, "manifest '%s' (%zu bytes) has no final 'end' line: it is truncated or corrupted", path.c_str(), text.size());
    }
    const std::string end_line = text.substr(end_at + 4, text.size() - end_at - 5);
    const std::string computed = detail::hex64(checksum64(text.data(), end_at));
    if (end_line != computed) {
        fail(kExitData, "manifest '%s' is corrupted: its checksum is %s, its text checksums to %s", path.c_str(),
             end_line.c_str(), computed.c_str());
    }
    CheckpointManifest m;
    std::istringstream in(text.substr(0, end_at));
    std::string line;
    int line_no = 0;
    auto bad = [&](const char* what) {
        fail(kExitData, "manifest '%s' line %d: %s: '%s'", path.c_str(), line_no, what, line.c_str());
    };
    FileRecord* current = nullptr;
    size_t expected_chunks = 0;
    while (std::getline(in, line)) {
        line_no++;
        std::istringstream ls(line);
        std::string kind;
        ls >> kind;
        if (line_no == 1) {
            if (kind != kManifestMagic || !(ls >> m.version)) bad("not a checkpoint manifest");
            if (m.version != kCheckpointVersion) {
                fail(kExitData, "manifest '%s' has format version %d; this build reads version %d", path.c_str(),
                     m.version, kCheckpointVersion);
            }
        } else if (kind == "step") {
            long long s = -1;
            if (!(ls >> s) || s < 0) bad("bad step");
            m.step = s;
        } else if (kind == "setting") {
            std::string key;
            if (!(ls >> key)) bad("setting without a key");
            std::string value;
            std::getline(ls, value);
            if (!value.empty() && value[0] == ' ') value.erase(0, 1);
            m.settings.emplace_back(key, value);
        } else if (kind == "blob") {
            std::string name, hex;
            if (!(ls >> name >> hex)) bad("blob without a name and bytes");
            std::vector<uint8_t> bytes;
            if (hex != "-") {
                if (hex.size() % 2 != 0) bad("odd number of hex digits");
                for (size_t i = 0; i < hex.size(); i += 2) {
                    unsigned v = 0;
                    if (std::sscanf(hex.c_str() + i, "%2x", &v) != 1) bad("bad hex digit");
                    bytes.push_back(uint8_t(v));
                }
            }
            m.blobs.emplace_back(name, std::move(bytes));
        } else if (kind == "file") {
            if (current && current->chunks.size() != expected_chunks) bad("the previous file lacks chunks");
            FileRecord f;
            if (!(ls >> f.name >> f.size >> expected_chunks) || f.name.find('/') != std::string::npos) {
                bad("bad file line");
            }
            m.files.push_back(std::move(f));
            current = &m.files.back();
        } else if (kind == "chunk") {
            if (!current) bad("chunk before any file");
            ChunkSum c;
            std::string sum;
            if (!(ls >> c.offset >> c.bytes >> sum) || sum.size() != 16) bad("bad chunk line");
            c.sum = std::strtoull(sum.c_str(), nullptr, 16);
            const uint64_t expect = current->chunks.empty() ? 0 : current->chunks.back().offset + current->chunks.back().bytes;
            // expect <= size, so size - offset cannot wrap; offset + bytes could, and tile on from a small end.
            if (c.offset != expect || c.bytes == 0 || c.bytes > current->size - c.offset) {
                bad("chunks must cover the file in order without gaps");
            }
            current->chunks.push_back(c);
        } else {
            bad("unknown line");
        }
    }
    if (line_no == 0) fail(kExitData, "manifest '%s' is empty", path.c_str());
    if (current && current->chunks.size() != expected_chunks) bad("the last file lacks chunks");
    for (const FileRecord& f : m.files) {
        const uint64_t covered = f.chunks.empty() ? 0 : f.chunks.back().offset + f.chunks.back().bytes;
        if (covered != f.size) {
            fail(kExitData, "manifest '%s': the chunks of '%s' cover %llu of its %llu bytes", path.c_str(),
                 f.name.c_str(), (unsigned long long)covered, (unsigned long long)f.size);
        }
    }
    return m;
}

// ----------------------------------------------------------------------------------------------------
// Chunk checksums, taken while writing and checked while reading.

// Checks chunks against a FileRecord as a ChunkHook sees them; finish() requires every chunk seen. The
// reader must cut the file the way the writer did.
class ChunkVerifier {
public:
    ChunkVerifier(const FileRecord& record, std::string path) : rec_(record), path_(std::move(path)), seen_(record.chunks.size(), 0) {}
    ChunkHook hook() {
        return [this](const char* p, size_t n, uint64_t off) { check(p, n, off); };
    }
    void check(const char* p, size_t n, uint64_t off) {
        auto it = std::lower_bound(rec_.chunks.begin(), rec_.chunks.end(), off,
                                   [](const ChunkSum& c, uint64_t o) { return c.offset < o; });
        if (it == rec_.chunks.end() || it->offset != off || it->bytes != n) {
            fail(kExitData, "'%s': no recorded chunk of %zu bytes at offset %llu (read with a different chunk size?)",
                 path_.c_str(), n, (unsigned long long)off);
        }
        const uint64_t s = checksum64(p, n);
        if (s != it->sum) {
            fail(kExitData, "'%s' is corrupted: bytes %llu..%llu checksum to %s, the manifest records %s", path_.c_str(),
                 (unsigned long long)off, (unsigned long long)(off + n), detail::hex64(s).c_str(),
                 detail::hex64(it->sum).c_str());
        }
        std::lock_guard<std::mutex> lock(mu_);
        seen_[size_t(it - rec_.chunks.begin())] = 1;
    }
    void finish() const {
        const auto unseen = std::find(seen_.begin(), seen_.end(), 0);
        if (unseen != seen_.end()) {
            fail(kExitData, "'%s': bytes at offset %llu were never checked", path_.c_str(),
                 (unsigned long long)rec_.chunks[size_t(unseen - seen_.begin())].offset);
        }
    }

private:
    const FileRecord& rec_;
    std::string path_;
    std::mutex mu_;
    std::vector<char> seen_;
};

// Writes n host bytes at the file's position in chunks of chunk_bytes, showing each to `hook` first.
inline void write_chunked(File& f, const void* data, size_t n, const ChunkHook& hook,
                          size_t chunk_bytes = kDefaultChunkBytes) {
    const char* p = static_cast<const char*>(data);
    for (size_t at = 0; at < n; at += chunk_bytes) {
        const size_t len = std::min(chunk_bytes, n - at);
        if (hook) hook(p + at, len, uint64_t(f.tell()));
        f.write_all(p + at, len);
    }
}

// Whether the recorded chunks of [from, from + n) are exactly the pieces `plan` makes of them, so reads
// can be checked chunk by chunk; else the span is read by its recorded chunks.
inline bool chunks_match_plan(const FileRecord& rec, uint64_t from, uint64_t n, ChunkPlanner plan) {
    Chunk piece;
    uint64_t at = from;
    for (const ChunkSum& c : rec.chunks) {
        if (c.offset + c.bytes <= from) continue;
        if (c.offset >= from + n) break;
        // Both tile the span without gaps, so equal starts, one for one, mean equal pieces.
        if (!plan.next(piece) || c.offset != at || from + piece.offset != at) return false;
        at += c.bytes;
    }
    return at == from + n && !plan.next(piece);
}

// Reads n bytes at the file's position chunk by chunk as the record cut them, checking each.
inline void read_verified(File& f, void* dst, size_t n, ChunkVerifier& verifier, const FileRecord& rec) {
    char* out = static_cast<char*>(dst);
    const uint64_t start = uint64_t(f.tell());
    for (const ChunkSum& c : rec.chunks) {
        if (c.offset + c.bytes <= start || c.offset >= start + n) continue;
        if (c.offset < start || c.offset + c.bytes > start + n) {
            fail(kExitData, "'%s': the read of bytes %llu..%llu splits a recorded chunk", f.path().c_str(),
                 (unsigned long long)start, (unsigned long long)(start + n));
        }
        f.seek(int64_t(c.offset));
        f.read_exact(out + (c.offset - start), size_t(c.bytes));
        verifier.check(out + (c.offset - start), size_t(c.bytes), c.offset);
    }
    f.seek(int64_t(start + n));
}

// ----------------------------------------------------------------------------------------------------
// Finding and validating checkpoints.

inline std::string checkpoint_dir_name(int64_t step) { return format("ckpt_%08lld", (long long)step); }

// The step of a complete checkpoint's directory name, or -1 (a .tmp directory, or anything else).
inline int64_t checkpoint_step_of(const std::string& name) {
    if (name.size() < 13 || name.compare(0, 5, "ckpt_") != 0) return -1;
    int64_t step = 0;
    for (size_t i = 5; i < name.size(); i++) {
        if (name[i] < '0' || name[i] > '9' || step > (int64_t(1) << 50)) return -1;
        step = step * 10 + (name[i] - '0');
    }
    return step;
}

struct CheckpointEntry {
    int64_t step = 0;
    std::string path;
};

// Directories with a complete checkpoint's name in out_dir, newest first (none if out_dir is missing).
inline std::vector<CheckpointEntry> list_checkpoints(const std::string& out_dir) {
    std::vector<CheckpointEntry> out;
    std::error_code ec;
    if (!std::filesystem::is_directory(out_dir, ec)) return out;
    for (const auto& e : std::filesystem::directory_iterator(out_dir, ec)) {
        const std::string name = e.path().filename().string();
        const int64_t step = checkpoint_step_of(name);
        if (step >= 0 && e.is_directory(ec)) out.push_back({step, out_dir + "/" + name});
    }
    if (ec) fail(kExitIo, "cannot list directory '%s': %s", out_dir.c_str(), ec.message().c_str());
    std::sort(out.begin(), out.end(), [](const CheckpointEntry& a, const CheckpointEntry& b) { return a.step > b.step; });
    return out;
}

// Checks a checkpoint directory (manifest, step, file sizes, and with `deep` every chunk's checksum);
// returns the manifest, raises kExitData / kExitIo naming the problem.
inline CheckpointManifest validate_checkpoint(const std::string& dir, bool deep) {
    const std::string manifest_path = dir + "/" + kManifestName;
    CheckpointManifest m = parse_manifest(read_text_file(manifest_path), manifest_path);
    const int64_t named = checkpoint_step_of(std::filesystem::path(dir).filename().string());
    if (named >= 0 && named != m.step) {
        fail(kExitData, "checkpoint '%s' holds step %lld, its name says %lld", dir.c_str(), (long long)m.step,
             (long long)named);
    }
    std::vector<char> buf;
    for (const FileRecord& rec : m.files) {
        const std::string path = dir + "/" + rec.name;
        File f(path, File::Mode::Read);
        const int64_t size = f.size();
        if (uint64_t(size) != rec.size) {
            fail(kExitData, "'%s' is %lld bytes, the manifest records %llu (%s)", path.c_str(), (long long)size,
                 (unsigned long long)rec.size, uint64_t(size) < rec.size ? "truncated" : "too long");
        }
        if (!deep) continue;
        ChunkVerifier v(rec, path);
        for (const ChunkSum& c : rec.chunks) {
            buf.resize(size_t(c.bytes));
            f.read_exact_at(buf.data(), buf.size(), int64_t(c.offset));
            v.check(buf.data(), buf.size(), c.offset);
        }
        v.finish();
    }
    return m;
}

// ----------------------------------------------------------------------------------------------------
// Publishing and retention.

inline void remove_tree(const std::string& path) {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
    if (ec) fail(kExitIo, "cannot remove '%s': %s", path.c_str(), ec.message().c_str());
}

// Keeps the newest keep_last complete checkpoints (<= 0: all) and every multiple of keep_every (> 0);
// removes the rest, returning them oldest first. Only steps up to `newest` count, so a later run's
// leftovers cannot push out the ones this run just wrote.
inline std::vector<std::string> rotate_checkpoints(const std::string& out_dir, int keep_last, int keep_every,
                                                   int64_t newest = INT64_MAX) {
    std::vector<std::string> removed;
    if (keep_last <= 0) return removed;
    std::vector<CheckpointEntry> all = list_checkpoints(out_dir);
    all.erase(std::remove_if(all.begin(), all.end(), [&](const CheckpointEntry& e) { return e.step > newest; }), all.end());
    for (size_t i = all.size(); i-- > size_t(keep_last);) {
        if (keep_every > 0 && all[i].step % keep_every == 0) continue;
        remove_tree(all[i].path);
        removed.push_back(all[i].path);
    }
    if (!removed.empty()) sync_directory(out_dir);
    return removed;
}

// The name of rank r's (> 0) part file in the temporary directory; rank 0 merges them into the manifest.
inline std::string checkpoint_part_name(int rank) { return format("part_%05d.txt", rank); }

// A fresh temporary directory for `step`, after removing interrupted saves' leftovers (ckpt_*.tmp).
inline std::string create_checkpoint_temporary(const std::string& out_dir, int64_t step) {
    std::vector<std::string> stale;
    if (std::error_code ec; std::filesystem::is_directory(out_dir, ec)) {
        for (const auto& e : std::filesystem::directory_iterator(out_dir, ec)) {
            const std::string name = e.path().filename().string();
            if (name.size() > 9 && name.compare(0, 5, "ckpt_") == 0 && name.compare(name.size() - 4, 4, ".tmp") == 0) {
                stale.push_back(e.path().string());
            }
        }
    }
    for (const std::string& s : stale) remove_tree(s);
    const std::string tmp = out_dir + "/" + checkpoint_dir_name(step) + ".tmp";
    std::error_code ec;
    std::filesystem::create_directories(tmp, ec);
    if (ec) fail(kExitIo, "cannot create checkpoint directory '%s': %s", tmp.c_str(), ec.message().c_str());
    return tmp;
}

// Several ranks: rank 0 calls this before any rank writes, then the caller holds every rank at a barrier.
inline std::string prepare_shared_checkpoint(const std::string& out_dir, int64_t step) {
    const std::string tmp = create_checkpoint_temporary(out_dir, step);
    sync_directory(out_dir);
    return tmp;
}

// Builds one checkpoint in <out>/ckpt_<step>.tmp and publishes it with commit(); destroyed without a
// commit, it removes its temporary directory. With world > 1, rank r > 0 publishes its records as
// part_<r>.txt; rank 0 waits up to part_timeout_s for every part, merges them and renames the
// directory. A rank that dies first leaves no checkpoint, only a .tmp the next save removes.
class CheckpointWriter {
public:
    CheckpointWriter(std::string out_dir, int64_t step, int rank = 0, int world = 1, double part_timeout_s = 600)
        : out_dir_(std::move(out_dir)), step_(step), rank_(rank), world_(world), part_timeout_s_(part_timeout_s) {
        if (world_ < 1 || rank_ < 0 || rank_ >= world_) fail(kExitError, "CheckpointWriter: rank %d of %d", rank_, world_);
        final_ = out_dir_ + "/" + checkpoint_dir_name(step);
        tmp_ = final_ + ".tmp";
        std::error_code ec;
        if (world_ == 1) {
            create_checkpoint_temporary(out_dir_, step);
        } else if (!std::filesystem::is_directory(tmp_, ec)) {
            fail(kExitIo, "checkpoint directory '%s' does not exist on rank %d: every rank's output directory must "
                          "be the same shared directory, prepared by rank 0", tmp_.c_str(), rank_);
        }
    }
    CheckpointWriter(const CheckpointWriter&) = delete;
    CheckpointWriter& operator=(const CheckpointWriter&) = delete;
    ~CheckpointWriter() {
        if (committed_ || rank_ != 0) return;
        std::error_code ec;
        std::filesystem::remove_all(tmp_, ec);
    }

    // Creates `name` in the temporary directory; fill(file, hook) writes it, passing every byte through
    // the hook, which checksums each chunk; then the file is fsynced and its chunks recorded.
    void add_file(const std::string& name, const std::function<void(File&, const ChunkHook&)>& fill) {
        File f(tmp_ + "/" + name, File::Mode::Write);
        FileRecord rec;
        rec.name = name;
        std::mutex mu;
        fill(f, [&](const char* p, size_t n, uint64_t off) {
            const uint64_t s = checksum64(p, n);
            std::lock_guard<std::mutex> lock(mu);
            rec.chunks.push_back({off, uint64_t(n), s});
        });
        rec.size = uint64_t(f.size());
        f.sync();
        f.close();
        std::sort(rec.chunks.begin(), rec.chunks.end(), [](const ChunkSum& a, const ChunkSum& b) { return a.offset < b.offset; });
        uint64_t at = 0;
        for (const ChunkSum& c : rec.chunks) {
            if (c.offset != at) break;
            at += c.bytes;
        }
        if (at != rec.size) {
            fail(kExitError, "checkpoint file '%s': checksummed chunks cover %llu of %llu bytes (a write bypassed the hook)",
                 name.c_str(), (unsigned long long)at, (unsigned long long)rec.size);
        }
        bytes_ += rec.size;
        files_.push_back(std::move(rec));
    }

    // Rank 0: writes the manifest, syncs and renames the directory, returning the final path. Another
    // rank: publishes its part and returns the temporary path.
    std::string commit(CheckpointManifest meta) {
        if (rank_ != 0) {
            publish_part();
            return tmp_;
        }
        meta.step = step_;
        meta.version = kCheckpointVersion;
        meta.files = files_;
        for (FileRecord& f : collect_parts()) meta.files.push_back(std::move(f));
        std::set<std::string> names;
        for (const FileRecord& f : meta.files) {
            if (!names.insert(f.name).second) {
                fail(kExitError, "checkpoint '%s': two ranks wrote the file '%s'", tmp_.c_str(), f.name.c_str());
            }
        }
        const std::string text = encode_manifest(meta);
        detail::write_synced(tmp_ + "/" + kManifestName, text);
        bytes_ += text.size();
        sync_directory(tmp_);
        std::error_code ec;
        std::string replaced;  // an older checkpoint of this step, moved out of the way
        if (std::filesystem::exists(final_, ec)) {
            replaced = replace_same_step();
        } else {
            detail::rename_or_fail(tmp_, final_);
        }
        committed_ = true;
        sync_directory(out_dir_);
        // Best effort: a leftover is a .tmp directory, which no reader takes and the next save removes.
        if (!replaced.empty()) std::filesystem::remove_all(replaced, ec);
        return final_;
    }

    uint64_t bytes_written() const { return bytes_; }  // this rank's files (rank 0: and the others' too)

private:
    // A checkpoint of the same step is already there: the two directories swap names atomically (else
    // the old one is renamed aside first), so the final name always holds a complete checkpoint. Returns
    // the path the old one is now under, for the caller to remove.
    std::string replace_same_step() {
        if (detail::swap_directories(tmp_.c_str(), final_.c_str()) == 0) return tmp_;
        const int e = errno;
        if (e != EINVAL && e != ENOSYS && e != ENOTSUP) {
            fail(kExitIo, "cannot swap '%s' with the older '%s': %s", tmp_.c_str(), final_.c_str(), std::strerror(e));
        }
        const std::string aside = final_ + ".replaced.tmp";
        remove_tree(aside);
        detail::rename_or_fail(final_, aside);
        detail::rename_or_fail(tmp_, final_);
        return aside;
    }

    void publish_part() {
        const CheckpointManifest part{
            kCheckpointVersion, step_, {{"rank", format("%d", rank_)}, {"world", format("%d", world_)}}, {}, files_};
        const std::string path = tmp_ + "/" + checkpoint_part_name(rank_);
        detail::write_synced(path + ".tmp", encode_manifest(part));
        // Rank 0 may rename the directory as soon as the part appears: sync it through a descriptor.
        const int dir = ::open(tmp_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dir < 0) fail(kExitIo, "cannot open directory '%s' to sync it: %s", tmp_.c_str(), std::strerror(errno));
        const bool renamed = std::rename((path + ".tmp").c_str(), path.c_str()) == 0;
        const int rc = renamed ? ::fsync(dir) : -1;
        const int e = errno;
        ::close(dir);
        if (!renamed) fail(kExitIo, "cannot rename '%s.tmp' to '%s': %s", path.c_str(), path.c_str(), std::strerror(e));
        if (rc != 0) fail(kExitIo, "fsync of directory '%s' failed: %s", tmp_.c_str(), std::strerror(e));
        committed_ = true;
    }

    // Rank 0: waits for the parts of ranks 1..world-1 and returns their file records.
    std::vector<FileRecord> collect_parts() {
        std::vector<FileRecord> out;
        const auto t0 = std::chrono::steady_clock::now();
        for (int r = 1; r < world_; r++) {
            const std::string path = tmp_ + "/" + checkpoint_part_name(r);
            std::error_code ec;
            while (!std::filesystem::exists(path, ec)) {
                const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                if (waited > part_timeout_s_) {
                    std::string missing;
                    for (int q = r; q < world_; q++) {
                        if (!std::filesystem::exists(tmp_ + "/" + checkpoint_part_name(q), ec)) missing += format(" %d", q);
                    }
                    fail(kExitIo, "checkpoint of step %lld: rank(s)%s did not finish their part in %.0f s ('%s' has no %s); "
                                  "the checkpoint is not published",
                         (long long)step_, missing.c_str(), part_timeout_s_, tmp_.c_str(), checkpoint_part_name(r).c_str());
                }
                std::this_thread::sleep_for(std::chrono::milliseconds(5));
            }
            CheckpointManifest part = parse_manifest(read_text_file(path), path);
            const std::string* pr = part.setting("rank");
            const std::string* pw = part.setting("world");
            if (part.step != step_ || !pr || *pr != format("%d", r) || !pw || *pw != format("%d", world_)) {
                fail(kExitData, "'%s' is not rank %d's part of the %d-rank checkpoint of step %lld", path.c_str(), r,
                     world_, (long long)step_);
            }
            for (FileRecord& f : part.files) {
                bytes_ += f.size;
                out.push_back(std::move(f));
            }
        }
        return out;
    }

    std::string out_dir_, final_, tmp_;
    int64_t step_;
    int rank_ = 0, world_ = 1;
    double part_timeout_s_ = 600;
    std::vector<FileRecord> files_;
    uint64_t bytes_ = 0;
    bool committed_ = false;
};

// ----------------------------------------------------------------------------------------------------
// Reading arrays back, in either layout, on any number of ranks.

// Elements [begin, begin + count) of a flat array are stored in `file`, from byte `offset` on.
struct ArraySegment {
    std::string file;
    uint64_t offset = 0;
    int64_t begin = 0, count = 0;
};

// Reads elements [first, last) of a flat array held by `segments` of the checkpoint in `dir`. Every
// touched chunk is checked against its checksum before use; bytes go to sink(byte offset from `first`,
// pointer, length). Raises kExitData naming the file on any missing, short or corrupt data.
inline void read_array_range(const std::string& dir, const CheckpointManifest& m, const std::vector<ArraySegment>& segments,
                             size_t elem_bytes, int64_t first, int64_t last,
                             const std::function<void(uint64_t, const char*, size_t)>& sink) {
    int64_t covered = 0;
    std::vector<char> buf;
    for (const ArraySegment& seg : segments) {
        const int64_t a = std::max(first, seg.begin), b = std::min(last, seg.begin + seg.count);
        if (b <= a) continue;
        covered += b - a;
        const std::string path = dir + "/" + seg.file;
        const FileRecord* rec = m.file(seg.file);
        if (!rec) fail(kExitData, "checkpoint '%s' has no file '%s'", dir.c_str(), seg.file.c_str());
        const uint64_t lo = seg.offset + uint64_t(a - seg.begin) * elem_bytes;
        const uint64_t hi = seg.offset + uint64_t(b - seg.begin) * elem_bytes;
        if (hi > rec->size) {
            fail(kExitData, "'%s' holds %llu bytes; elements %lld..%lld need bytes up to %llu", path.c_str(),
                 (unsigned long long)rec->size, (long long)a, (long long)b, (unsigned long long)hi);
        }
        File f(path, File::Mode::Read);
        if (uint64_t(f.size()) != rec->size) {
            fail(kExitData, "'%s' is %lld bytes, the manifest records %llu (truncated?)", path.c_str(), (long long)f.size(),
                 (unsigned long long)rec->size);
        }
        ChunkVerifier v(*rec, path);
        for (const ChunkSum& c : rec->chunks) {
            if (c.offset + c.bytes <= lo || c.offset >= hi) continue;
            buf.resize(size_t(c.bytes));
            f.read_exact_at(buf.data(), buf.size(), int64_t(c.offset));
            v.check(buf.data(), buf.size(), c.offset);
            const uint64_t from = std::max(lo, c.offset), to = std::min(hi, c.offset + c.bytes);
            sink(uint64_t(a - first) * elem_bytes + (from - lo), buf.data() + (from - c.offset), size_t(to - from));
        }
    }
    if (covered != last - first) {
        fail(kExitData, "checkpoint '%s': its files hold %lld of the %lld elements %lld..%lld", dir.c_str(),
             (long long)covered, (long long)(last - first), (long long)first, (long long)last);
    }
}

// Bytes [0, n) of the checkpoint file `file` (a header), every chunk they touch checked.
inline std::vector<char> read_file_head(const std::string& dir, const CheckpointManifest& m, const std::string& file,
                                        size_t n) {
    std::vector<char> out(n);
    read_array_range(dir, m, {{file, 0, 0, int64_t(n)}}, 1, 0, int64_t(n),
                     [&](uint64_t at, const char* p, size_t len) { std::memcpy(out.data() + at, p, len); });
    return out;
}

// The settings that record a layout: a sharded one (the ranges of `layout`), or the whole one (null).
inline std::vector<std::pair<std::string, std::string>> state_layout_settings(const ZeroLayout* layout) {
    if (layout == nullptr) return {{"state_layout", "whole"}};
    std::vector<std::pair<std::string, std::string>> kv = {{"state_layout", "sharded"},
                                                            {"state_ranks", format("%d", layout->world)}};
    for (int r = 0; r < layout->world; r++) {
        const ShardRange o = layout->owned(r);
        kv.push_back({format("state_shard_%d", r), format("%lld %lld", (long long)o.begin, (long long)o.size())});
    }
    return kv;
}

// A checkpoint's layout, read back from its manifest: the files and ranges that hold each array.
struct StateLayout {
    bool sharded = false;
    std::vector<ArraySegment> master, adam_m, adam_v;  // fp32 elements; sharded: one per saved rank, in rank order
    ArraySegment params;                               // bf16 elements, all N
};

// Parses the layout of the checkpoint in `dir` for num_params parameters (no setting: whole). The ranges
// come from the manifest, not a recomputed ZeroLayout. Raises kExitData naming what is malformed.
inline StateLayout read_state_layout(const std::string& dir, const CheckpointManifest& m, int64_t num_params) {
    const std::string* kind = m.setting("state_layout");
    if (kind && *kind != "whole" && *kind != "sharded") {
        fail(kExitData, "'%s': unknown state_layout '%s'", dir.c_str(), kind->c_str());
    }
    if (!kind || *kind == "whole") {
        return {false, {{kCkptModelFile, uint64_t(kModelHeaderBytes), 0, num_params}},
                {{kCkptAdamMFile, 0, 0, num_params}}, {{kCkptAdamVFile, 0, 0, num_params}},
                {kCkptParamsFile, 0, 0, num_params}};
    }
    StateLayout out;
    out.sharded = true;
    const std::string* ranks = m.setting("state_ranks");
    char* end = nullptr;
    const long w = ranks ? std::strtol(ranks->c_str(), &end, 10) : 0;
    if (!ranks || *end != '\0' || w < 1 || w > (1 << 20)) {
        fail(kExitData, "'%s': a sharded checkpoint without a valid state_ranks setting", dir.c_str());
    }
    for (int r = 0; r < int(w); r++) {
        const std::string* range = m.setting(format("state_shard_%d", r));
        long long begin = -1, count = -1;
        char extra = 0;
        if (!range || std::sscanf(range->c_str(), "%lld %lld %c", &begin, &count, &extra) != 2 || begin < 0 ||
            count < 0) {
            fail(kExitData, "'%s': the range of rank %d's shard is missing or malformed", dir.c_str(), r);
        }
        out.master.push_back({state_shard_file(StateKind::Master, r), 0, begin, count});
        out.adam_m.push_back({state_shard_file(StateKind::AdamM, r), 0, begin, count});
        out.adam_v.push_back({state_shard_file(StateKind::AdamV, r), 0, begin, count});
    }
    auto shard = [&](int r) { return dir + "/" + out.master[size_t(r)].file; };
    for (int r = 0; r < int(w); r++) {
        const ArraySegment& s = out.master[size_t(r)];
        // Checked apart from the tiling below, where begin + count of a hostile manifest could overflow.
        if (s.count > 0 && (s.begin >= num_params || s.count > num_params - s.begin)) {
            fail(kExitData, "optimizer shard '%s' (rank %d): range begin %lld count %lld reaches past the model's %lld "
                 "parameters", shard(r).c_str(), r, (long long)s.begin, (long long)s.count, (long long)num_params);
        }
    }
    int64_t next = 0;
    for (int r = 0; r < int(w); r++) {
        const ArraySegment& s = out.master[size_t(r)];
        if (s.count == 0) continue;
        if (s.begin != next) {
            fail(kExitData, "optimizer shard '%s' (rank %d) starts at parameter %lld, expected %lld (%s)",
                 shard(r).c_str(), r, (long long)s.begin, (long long)next,
                 s.begin > next ? "a gap: parameters no shard holds" : "it overlaps the previous rank's shard");
        }
        next = s.begin + s.count;
    }
    if (next != num_params) {
        fail(kExitData, "optimizer checkpoint: the shards hold parameters [0, %lld), the model has %lld", (long long)next,
             (long long)num_params);
    }
    out.params = {kCkptModelFile, uint64_t(kModelHeaderBytes), 0, num_params};
    return out;
}

// ----------------------------------------------------------------------------------------------------
// Resume compatibility.

// Compares a checkpoint's settings with this run's: differing must_match keys make the returned message
// ("key: checkpoint has X, this run has Y" each); other differences go to *notes. Empty: compatible.
inline std::string settings_differences(const CheckpointManifest& saved,
                                        const std::vector<std::pair<std::string, std::string>>& now,
                                        const std::vector<std::string>& must_match, std::vector<std::string>* notes) {
    std::string problems;
    for (const auto& kv : now) {
        const std::string* old = saved.setting(kv.first);
        const bool strict = std::find(must_match.begin(), must_match.end(), kv.first) != must_match.end();
        if (old && *old == kv.second) continue;
        const std::string line = format("%s: checkpoint has %s, this run has '%s'", kv.first.c_str(),
                                        old ? ("'" + *old + "'").c_str() : "nothing", kv.second.c_str());
        if (strict) {
            problems += (problems.empty() ? "" : "; ") + line;
        } else if (notes) {
            notes->push_back(line);
        }
    }
    return problems;
}

}  // namespace llmc
