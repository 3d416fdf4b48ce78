/*
The sharded token DataLoader, host side: which tokens make up each batch, read into host memory ahead of
time on a background thread (the CUDA side is dataloader_gpu.cuh, which supplies pinned HostAllocators).
Data: a glob or comma-separated globs of token shards (shard.h), each item's matches sorted by name;
every shard is validated on open and token ids as they are read; errors name the file (and offset).
A sample is T+1 tokens at a multiple of T in its shard (a shard's partial tail dropped). An epoch is
every sample, shards and samples in seeded permutations (shuffle) or file order; the epochs form one
endless stream cut into global batches of B*W samples, rank r taking samples [r*B, r*B + B). An
epoch's tail is carried into the next global batch.
State: the count of global batches consumed (everything else is a function of it and the seed). The
stream does not depend on W, so with allow_world_change a blob saved on W ranks restores on W' ranks
when its sample position is a whole number of the new global batches.
*/
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <glob.h>
#include <sys/stat.h>

#include "llmc/hash.h"
#include "llmc/rand.h"
#include "llmc/shard.h"
#include "llmc/utils.h"

namespace llmc {

// Fills out[0..n) with a permutation of 0..n-1 drawn from a generator seeded with `seed`.
inline void seeded_permutation(uint64_t seed, uint32_t* out, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = static_cast<uint32_t>(i);
    SplitMix64 rng(seed);
    for (size_t i = n; i > 1; i--) std::swap(out[i - 1], out[rng.below(i)]);
}

// Where host batch buffers come from. Empty functions mean page-aligned malloc.
struct HostAllocator {
    std::function<void*(size_t)> allocate;
    std::function<void(void*)> release;
};

struct DataLoaderConfig {
    std::string pattern;   // glob, or comma-separated globs
    int B = 0;             // samples per rank per batch
    int T = 0;             // tokens per sample's inputs
    int rank = 0;
    int world = 1;
    uint32_t vocab_size = 0;  // every token id must be below this; <= 65536 ships 16-bit tokens
    bool shuffle = true;      // false: shards in list order, samples in file order (validation)
    uint64_t seed = 0;
    int prefetch = 4;         // host buffers filled ahead by a background thread; 0 reads on the caller's thread
    HostAllocator allocator;
};

struct ShardInfo {
    std::string path;
    int version = 0;
    int bytes_per_token = 0;
    int64_t num_tokens = 0;
    uint32_t num_samples = 0;
};

// One sample of a batch: its epoch, shard (index into SampleSchedule::shards()) and first token's offset.
struct SampleRef {
    uint64_t epoch = 0;
    uint32_t shard = 0;
    int64_t token_offset = 0;
};

// A rank's batch as packed tokens: B rows of T+1 tokens, each token_bytes (2 or 4) wide.
struct HostBatch {
    const void* tokens = nullptr;
    int token_bytes = 0;
    int B = 0;
    int T = 0;
    uint64_t index = 0;  // global batch number since the start of epoch 0
    uint64_t epoch = 0;  // epoch of this rank's first sample in the batch
    const SampleRef* samples = nullptr;  // B entries
};

// Splits packed rows into int32 inputs[B*T] (tokens 0..T-1 of each row) and targets[B*T] (tokens 1..T).
inline void unpack_batch(const HostBatch& b, int32_t* inputs, int32_t* targets) {
    auto token = [&](size_t i) {
        return static_cast<int32_t>(b.token_bytes == 2 ? static_cast<const uint16_t*>(b.tokens)[i]
                                                       : static_cast<const uint32_t*>(b.tokens)[i]);
    };
    for (int r = 0; r < b.B; r++) {
        for (int t = 0; t < b.T; t++) {
            const size_t i = size_t(r) * (b.T + 1) + t;
            inputs[size_t(r) * b.T + t] = token(i);
            targets[size_t(r) * b.T + t] = token(i + 1);
        }
    }
}

// Expands a glob or comma-separated globs: each item's matches in byte order, items as given. An item
// matching nothing, a non-regular file or a file listed twice is an error.
inline std::vector<std::string> expand_shard_pattern(const std::string& pattern) {
    if (pattern.empty()) fail(kExitUsage, "no data files given (empty shard pattern)");
    std::vector<std::string> paths;
    for (const std::string& item : split(pattern, ',')) {
        if (item.empty()) fail(kExitUsage, "shard pattern '%s' has an empty item between commas", pattern.c_str());
        glob_t g;
        const int rc = ::glob(item.c_str(), GLOB_NOSORT, nullptr, &g);
        const size_t first = paths.size();
        if (rc == 0) paths.insert(paths.end(), g.gl_pathv, g.gl_pathv + g.gl_pathc);
        globfree(&g);
        if (rc == GLOB_NOMATCH) fail(kExitUsage, "no shard file matches '%s'", item.c_str());
        if (rc != 0) {
            fail(kExitIo, "cannot expand shard pattern '%s' (glob error %d: unreadable directory or out of memory)",
                 item.c_str(), rc);
        }
        std::sort(paths.begin() + first, paths.end());
    }
    // A file is the same shard however it is named (a/x.bin, a/./x.bin, a link to it): device and inode.
    std::vector<std::pair<std::pair<uint64_t, uint64_t>, size_t>> ids;
    for (size_t i = 0; i < paths.size(); i++) {
        const std::string& p = paths[i];
        struct stat st;
        if (::stat(p.c_str(), &st) != 0) fail(kExitIo, "cannot stat shard '%s': %s", p.c_str(), std::strerror(errno));
        if (!S_ISREG(st.st_mode)) fail(kExitData, "shard '%s' is not a regular file", p.c_str());
        ids.push_back({{uint64_t(st.st_dev), uint64_t(st.st_ino)}, i});
    }
    std::sort(ids.begin(), ids.end());
    for (size_t k = 1; k < ids.size(); k++) {
        if (ids[k].first != ids[k - 1].first) continue;
        const std::string &a = paths[ids[k - 1].second], &b = paths[ids[k].second];  // a listed first
        if (a == b) {
            fail(kExitUsage, "shard '%s' is named twice by '%s'; each shard may appear once", a.c_str(), pattern.c_str());
        }
        fail(kExitUsage, "shards '%s' and '%s' of '%s' are the same file; each shard may appear once", a.c_str(),
             b.c_str(), pattern.c_str());
    }
    return paths;
}

// Where a position in the stream of samples lives, and everything the state blob records about it.
struct StreamPosition {
    uint64_t batches = 0;        // global batches consumed
    uint64_t epoch = 0;
    uint32_t slot = 0;           // index into the epoch's shard order
    uint32_t sample = 0;         // samples of that shard already dealt out
    uint64_t rng_state = 0;      // the seed of that shard's sample order (0 without shuffling)
    std::vector<uint32_t> shard_order;
};

// The shard list, the geometry and the mapping from stream position to (shard, token offset); immutable,
// so the consumer and the prefetch thread share it.
class SampleSchedule {
public:
    explicit SampleSchedule(const DataLoaderConfig& cfg) : cfg_(cfg) {
        check_config();
        for (const std::string& path : expand_shard_pattern(cfg.pattern)) {
            File f(path, File::Mode::Read);
            ShardHeader h = read_shard_header(f);
            if (h.num_tokens < int64_t(cfg.T) + 1) {
                fail(kExitData, "shard '%s' holds %lld tokens, fewer than one sample of T+1 = %d tokens", path.c_str(),
                     (long long)h.num_tokens, cfg.T + 1);
            }
            uint64_t samples = uint64_t(h.num_tokens - 1) / uint64_t(cfg.T);
            if (samples > UINT32_MAX) {
                fail(kExitData, "shard '%s' holds %llu samples of T = %d, more than 2^32-1; split it into smaller shards",
                     path.c_str(), (unsigned long long)samples, cfg.T);
            }
            shards_.push_back({path, h.version, h.bytes_per_token, h.num_tokens, static_cast<uint32_t>(samples)});
            samples_per_epoch_ += samples;
            total_tokens_ += uint64_t(h.num_tokens);
        }
        if (shards_.size() > UINT32_MAX) fail(kExitUsage, "'%s' names more than 2^32-1 shards", cfg.pattern.c_str());
        if (samples_per_epoch_ < global_batch()) {
            fail(kExitData,
                 "the %zu shard(s) matching '%s' hold %llu samples of T+1 = %d tokens, fewer than one global batch of "
                 "B*W = %d*%d samples",
                 shards_.size(), cfg.pattern.c_str(), (unsigned long long)samples_per_epoch_, cfg.T + 1, cfg.B,
                 cfg.world);
        }
    }

    const DataLoaderConfig& config() const { return cfg_; }
    const std::vector<ShardInfo>& shards() const { return shards_; }
    uint64_t samples_per_epoch() const { return samples_per_epoch_; }
    uint64_t total_tokens() const { return total_tokens_; }
    uint64_t global_batch() const { return uint64_t(cfg_.B) * uint64_t(cfg_.world); }
    // Global batches that lie wholly inside epoch 0 (the first one that reaches into epoch 1 not counted).
    uint64_t batches_per_epoch() const { return samples_per_epoch_ / global_batch(); }
    int token_bytes() const { return cfg_.vocab_size <= 65536u ? 2 : 4; }
    size_t batch_bytes() const { return size_t(cfg_.B) * size_t(cfg_.T + 1) * size_t(token_bytes()); }
    // Stream index of the first sample of this rank's part of global batch `batch`.
    uint64_t first_sample(uint64_t batch) const { return batch * global_batch() + uint64_t(cfg_.rank) * cfg_.B; }
    uint64_t epoch_of_batch(uint64_t batch) const { return batch * global_batch() / samples_per_epoch_; }

    std::vector<uint32_t> shard_order(uint64_t epoch) const {
        std::vector<uint32_t> order(shards_.size());
        ordering(stream_seed(epoch, 0), order);
        return order;
    }
    // Seed of the sample order of the shard at `slot` of the epoch's shard order.
    uint64_t shard_rng_seed(uint64_t epoch, uint32_t slot) const {
        return cfg_.shuffle ? stream_seed(epoch, uint64_t(slot) + 1) : 0;
    }
    // Sample indices of the shard at `slot`, in the order they are dealt out.
    void sample_order(uint64_t epoch, uint32_t slot, uint32_t shard, std::vector<uint32_t>& out) const {
        out.resize(shards_[shard].num_samples);
        ordering(shard_rng_seed(epoch, slot), out);
    }

    // Calls f(shard, token_offset) for every sample of the epoch, in stream order.
    template <class F>
    void visit_epoch(uint64_t epoch, F&& f) const {
        std::vector<uint32_t> order = shard_order(epoch), samples;
        for (uint32_t slot = 0; slot < order.size(); slot++) {
            sample_order(epoch, slot, order[slot], samples);
            for (uint32_t s : samples) f(order[slot], int64_t(s) * cfg_.T);
        }
    }

    StreamPosition position(uint64_t batches) const {
        const uint64_t sample = batches * global_batch(), epoch = sample / samples_per_epoch_;
        uint64_t i = sample % samples_per_epoch_;
        std::vector<uint32_t> order = shard_order(epoch);
        uint32_t slot = 0;
        while (i >= shards_[order[slot]].num_samples) i -= shards_[order[slot++]].num_samples;
        return {batches, epoch, slot, static_cast<uint32_t>(i), shard_rng_seed(epoch, slot), std::move(order)};
    }

    // The state blob: little-endian fields, a magic, a version and a checksum; docs/formats.md lists them.
    std::vector<uint8_t> encode_state(uint64_t batches) const {
        StreamPosition p = position(batches);
        std::vector<uint8_t> out(kStateMagic, kStateMagic + 8);
        for (uint32_t v : {kStateVersion, uint32_t(cfg_.B), uint32_t(cfg_.T), uint32_t(cfg_.world)}) put32(out, v);
        put32(out, cfg_.shuffle ? 1u : 0u);
        put64(out, cfg_.seed);
        put32(out, uint32_t(shards_.size()));
        for (uint64_t v : {samples_per_epoch_, shards_hash(), p.batches, p.epoch}) put64(out, v);
        put32(out, p.slot);
        put32(out, p.sample);
        put64(out, p.rng_state);
        for (uint32_t s : p.shard_order) put32(out, s);
        put64(out, fnv1a64(out.data(), out.size()));
        return out;
    }

    // Validates a state blob and returns its position (global batches consumed). allow_world_change:
    // convert a blob saved with another W, refused unless its sample position divides evenly.
    uint64_t decode_state(const std::vector<uint8_t>& blob, bool allow_world_change = false) const {
        Reader r = open_state(blob);
        uint32_t B = r.u32(), T = r.u32(), W = r.u32(), shuffle = r.u32();
        uint64_t seed = r.u64();
        bool world_ok = W == uint32_t(cfg_.world) || (allow_world_change && W != 0);
        if (B != uint32_t(cfg_.B) || T != uint32_t(cfg_.T) || !world_ok || shuffle != (cfg_.shuffle ? 1u : 0u) ||
            seed != cfg_.seed) {
            fail(kExitData,
                 "DataLoader state was saved with B=%u T=%u W=%u shuffle=%s seed=%llu, but this loader has B=%d T=%d W=%d "
                 "shuffle=%s seed=%llu; resume with the same geometry and seed",
                 B, T, W, shuffle ? "on" : "off", (unsigned long long)seed, cfg_.B, cfg_.T, cfg_.world,
                 cfg_.shuffle ? "on" : "off", (unsigned long long)cfg_.seed);
        }
        uint32_t nshards = r.u32();
        uint64_t samples = r.u64(), hash = r.u64();
        if (nshards != shards_.size() || samples != samples_per_epoch_ || hash != shards_hash()) {
            fail(kExitData,
                 "DataLoader state was saved for %u shard(s) holding %llu samples (list hash %016llx), but '%s' gives %zu "
                 "shard(s) holding %llu samples (hash %016llx); the data is not the same (the hash covers file names "
                 "and token counts)",
                 nshards, (unsigned long long)samples, (unsigned long long)hash, cfg_.pattern.c_str(), shards_.size(),
                 (unsigned long long)samples_per_epoch_, (unsigned long long)shards_hash());
        }
        // A braced list reads its fields in order: batches, epoch, slot, sample, rng_state.
        StreamPosition saved{r.u64(), r.u64(), r.u32(), r.u32(), r.u64(), std::vector<uint32_t>(nshards)};
        for (uint32_t& s : saved.shard_order) s = r.u32();
        if (r.at + 8 != blob.size()) fail(kExitData, "DataLoader state is %zu bytes, expected %zu", blob.size(), r.at + 8);
        uint64_t batches = saved.batches;
        std::string where = format("batch %llu", (unsigned long long)saved.batches);
        if (W != uint32_t(cfg_.world)) {
            batches = convert_batches(saved.batches, B, W);
            where = format("batch %llu of a W=%u run (batch %llu of this W=%d loader)", (unsigned long long)saved.batches,
                           W, (unsigned long long)batches, cfg_.world);
        }
        // The recorded epoch, shard and sample must agree with the converted batch's placement too.
        StreamPosition now = position(batches);
        if (now.epoch != saved.epoch || now.slot != saved.slot || now.sample != saved.sample ||
            now.rng_state != saved.rng_state || now.shard_order != saved.shard_order) {
            fail(kExitData,
                 "DataLoader state at %s records epoch %llu, shard slot %u, sample %u, but this build places that "
                 "batch at epoch %llu, slot %u, sample %u (or orders the shards differently); it was written by an "
                 "incompatible build",
                 where.c_str(), (unsigned long long)saved.epoch, saved.slot, saved.sample,
                 (unsigned long long)now.epoch, now.slot, now.sample);
        }
        return batches;
    }

    // The number of ranks a state blob was saved with (magic, version and checksum checked only).
    static uint32_t state_world(const std::vector<uint8_t>& blob) {
        Reader r = open_state(blob);
        if (r.at + 12 + 8 > blob.size()) {
            fail(kExitData, "DataLoader state is truncated: %zu bytes, too few to hold its B, T and W", blob.size());
        }
        r.at += 8;  // past B and T
        uint32_t W = r.u32();
        if (W == 0) fail(kExitData, "DataLoader state records W=0 ranks; it is corrupt");
        return W;
    }

    std::string describe() const {
        return format("%zu shard(s), %llu tokens, %llu samples of T+1 = %d per epoch, %llu global batches of B*W = %d*%d "
                      "per epoch, %s, %d-bit tokens to the GPU",
                      shards_.size(), (unsigned long long)total_tokens_, (unsigned long long)samples_per_epoch_,
                      cfg_.T + 1, (unsigned long long)batches_per_epoch(), cfg_.B, cfg_.world,
                      cfg_.shuffle ? format("shuffled with seed %llu", (unsigned long long)cfg_.seed).c_str()
                                   : "in order",
                      token_bytes() * 8);
    }

private:
    static constexpr char kStateMagic[8] = {'l', 'l', 'm', 'c', 'D', 'L', 'S', 'T'};
    static constexpr uint32_t kStateVersion = 1;

    struct Reader {
        const std::vector<uint8_t>& blob;
        size_t at;
        uint64_t take(int n) {
            if (at + n > blob.size()) fail(kExitData, "DataLoader state is truncated at byte %zu of %zu", at, blob.size());
            uint64_t v = 0;
            for (int i = 0; i < n; i++) v |= uint64_t(blob[at + i]) << (8 * i);
            at += n;
            return v;
        }
        uint32_t u32() { return static_cast<uint32_t>(take(4)); }
        uint64_t u64() { return take(8); }
    };
    // Checks a state blob's magic, version and checksum; returns a reader at the field after the version.
    static Reader open_state(const std::vector<uint8_t>& blob) {
        if (blob.size() < 12 || std::memcmp(blob.data(), kStateMagic, 8) != 0) {
            fail(kExitData, "DataLoader state (%zu bytes) does not start with the DataLoader state magic", blob.size());
        }
        Reader r{blob, 8};
        uint32_t version = r.u32();
        if (version != kStateVersion) {
            fail(kExitData, "DataLoader state has version %u; this build reads version %u", version, kStateVersion);
        }
        if (blob.size() < 20 || fnv1a64(blob.data(), blob.size() - 8) != Reader{blob, blob.size() - 8}.u64()) {
            fail(kExitData, "DataLoader state (%zu bytes) is corrupt: its checksum does not match", blob.size());
        }
        return r;
    }
    // A position of `batches` global batches of B*W samples, as this loader's global batches.
    uint64_t convert_batches(uint64_t batches, uint32_t B, uint32_t W) const {
        uint64_t saved_batch = uint64_t(B) * W;
        if (batches > UINT64_MAX / saved_batch) {
            fail(kExitData, "DataLoader state at batch %llu of B*W = %u*%u samples lies past 2^64 samples; it is corrupt",
                 (unsigned long long)batches, B, W);
        }
        uint64_t sample = batches * saved_batch;
        if (sample % global_batch() != 0) {
            fail(kExitData,
                 "DataLoader state was saved by a run on W=%u ranks after %llu global batches of B*W = %u*%u samples, "
                 "at sample %llu of the stream; this loader runs on W=%d ranks, and %llu is not a multiple of its "
                 "global batch of B*W = %d*%d = %llu samples, so no batch of this run starts there and it cannot "
                 "continue the stream exactly (resume from a state whose sample count is a multiple of %llu, or on "
                 "W=%u ranks)",
                 W, (unsigned long long)batches, B, W, (unsigned long long)sample, cfg_.world, (unsigned long long)sample,
                 cfg_.B, cfg_.world, (unsigned long long)global_batch(), (unsigned long long)global_batch(), W);
        }
        return sample / global_batch();
    }
    static void put32(std::vector<uint8_t>& out, uint32_t v) {
        for (int i = 0; i < 4; i++) out.push_back(uint8_t(v >> (8 * i)));
    }
    static void put64(std::vector<uint8_t>& out, uint64_t v) {
        for (int i = 0; i < 8; i++) out.push_back(uint8_t(v >> (8 * i)));
    }
    // File names without directories, so that moving the data keeps a saved state valid.
    uint64_t shards_hash() const {
        std::vector<uint8_t> bytes;  // per shard: its name, a NUL and its token count
        for (const ShardInfo& s : shards_) {
            const std::string name = s.path.substr(s.path.find_last_of('/') + 1);  // npos + 1 = 0: the whole path
            bytes.insert(bytes.end(), name.c_str(), name.c_str() + name.size() + 1);
            put64(bytes, uint64_t(s.num_tokens));
        }
        return fnv1a64(bytes.data(), bytes.size());
    }
    // out: a permutation drawn with `seed` when shuffling, else 0, 1, 2, ...
    void ordering(uint64_t seed, std::vector<uint32_t>& out) const {
        if (cfg_.shuffle) seeded_permutation(seed, out.data(), out.size());
        else std::iota(out.begin(), out.end(), 0u);
    }
    // One independent generator per (epoch, stream): stream 0 orders the shards, slot+1 a shard's samples.
    uint64_t stream_seed(uint64_t epoch, uint64_t stream) const {
        return splitmix64_mix(splitmix64_mix(splitmix64_mix(cfg_.seed) ^ epoch) ^ (stream * kSplitMix64Gamma));
    }
    void check_config() const {
        if (cfg_.B < 1 || cfg_.T < 1) fail(kExitUsage, "DataLoader needs B >= 1 and T >= 1 (got B=%d, T=%d)", cfg_.B, cfg_.T);
        if (cfg_.world < 1 || cfg_.rank < 0 || cfg_.rank >= cfg_.world) {
            fail(kExitUsage, "DataLoader rank %d is not in [0, %d)", cfg_.rank, cfg_.world);
        }
        if (cfg_.vocab_size == 0) fail(kExitUsage, "DataLoader needs the vocabulary size (got 0)");
        if (cfg_.prefetch < 0 || cfg_.prefetch > 64) {
            fail(kExitUsage, "DataLoader prefetch depth %d is not in [0, 64]", cfg_.prefetch);
        }
    }

    DataLoaderConfig cfg_;
    std::vector<ShardInfo> shards_;
    uint64_t samples_per_epoch_ = 0;
    uint64_t total_tokens_ = 0;
};

// Reads one rank's batches, keeping the shard order, sample order and file open between calls (a pread
// per sample). Single-threaded.
class BatchReader {
public:
    explicit BatchReader(const SampleSchedule& schedule) : s_(schedule) {}

    SampleRef locate(uint64_t stream_index) {
        uint64_t S = s_.samples_per_epoch();
        uint64_t epoch = stream_index / S, i = stream_index % S;
        if (order_.empty() || epoch != epoch_) {  // (every epoch orders at least one shard)
            order_ = s_.shard_order(epoch);
            prefix_.assign(order_.size(), 0);
            for (size_t j = 1; j < order_.size(); j++) prefix_[j] = prefix_[j - 1] + s_.shards()[order_[j - 1]].num_samples;
            epoch_ = epoch;
            samples_.clear();
        }
        uint32_t slot = uint32_t(std::upper_bound(prefix_.begin(), prefix_.end(), i) - prefix_.begin() - 1);
        if (samples_.empty() || slot != slot_) {  // (every shard holds at least one sample)
            s_.sample_order(epoch, slot, order_[slot], samples_);
            slot_ = slot;
        }
        return {epoch, order_[slot], int64_t(samples_[i - prefix_[slot]]) * s_.config().T};
    }

    // Fills `tokens` (B rows of T+1 tokens) and `refs` (B entries) with this rank's part of `batch`.
    void read(uint64_t batch, void* tokens, SampleRef* refs) {
        const DataLoaderConfig& cfg = s_.config();
        uint64_t first = s_.first_sample(batch);
        size_t row_tokens = size_t(cfg.T) + 1;
        int out_bytes = s_.token_bytes();
        for (int r = 0; r < cfg.B; r++) {
            refs[r] = locate(first + r);
            read_sample(refs[r], static_cast<char*>(tokens) + r * row_tokens * out_bytes, row_tokens, out_bytes);
        }
    }

private:
    void read_sample(const SampleRef& ref, char* dst, size_t n, int out_bytes) {
        const ShardInfo& shard = s_.shards()[ref.shard];
        if (open_shard_ != int64_t(ref.shard)) {
            file_.open(shard.path, File::Mode::Read);
            open_shard_ = ref.shard;
        }
        int in_bytes = shard.bytes_per_token;
        int64_t at = shard_token_byte_offset(ref.token_offset, in_bytes);
        file_.seek(at);
        char* raw = dst;
        if (in_bytes != out_bytes) {
            scratch_.resize(n * in_bytes);
            raw = scratch_.data();
        }
        file_.read_exact(raw, n * in_bytes);
        uint32_t vocab = s_.config().vocab_size;
        for (size_t i = 0; i < n; i++) {
            uint32_t id = 0;  // little-endian, as the shards are
            std::memcpy(&id, raw + i * in_bytes, size_t(in_bytes));
            if (id >= vocab) {
                fail(kExitData,
                     "shard '%s': token %lld (byte offset %lld) has id %u, not below the vocabulary size %u",
                     shard.path.c_str(), (long long)(ref.token_offset + int64_t(i)), (long long)(at + int64_t(i) * in_bytes),
                     id, vocab);
            }
            if (in_bytes != out_bytes) std::memcpy(dst + i * out_bytes, &id, size_t(out_bytes));
        }
    }

    const SampleSchedule& s_;
    uint64_t epoch_ = 0;  // the epoch of order_ and prefix_ (none while empty)
    uint32_t slot_ = 0;   // the slot of samples_ (none while empty)
    std::vector<uint32_t> order_;
    std::vector<uint64_t> prefix_;
    std::vector<uint32_t> samples_;
    File file_;
    int64_t open_shard_ = -1;
    std::vector<char> scratch_;
};

// Batches for one rank from a ring of host buffers, kept full by a background thread when prefetch > 0.
// acquire() hands out the oldest ready batch, release() gives back the oldest held one. A thread's error
// is raised by the acquire() that reaches that batch, and every one after it until seek() or restore().
class DataLoader {
public:
    explicit DataLoader(const DataLoaderConfig& cfg) : DataLoader(SampleSchedule(cfg)) {}
    // From a schedule already opened (and its shards validated) by the caller.
    explicit DataLoader(SampleSchedule schedule) : schedule_(std::move(schedule)), reader_(schedule_) {
        const DataLoaderConfig& cfg = schedule_.config();
        allocator_ = cfg.allocator;
        if (!allocator_.allocate) {
            allocator_.allocate = [](size_t n) { return std::aligned_alloc(4096, (n + 4095) / 4096 * 4096); };
            allocator_.release = [](void* p) { std::free(p); };
        }
        ring_.resize(std::max(cfg.prefetch, 1));
        for (Slot& s : ring_) {
            s.tokens = Buffer(allocator_.allocate(schedule_.batch_bytes()), allocator_.release);
            if (!s.tokens) fail(kExitError, "cannot allocate a %zu-byte DataLoader buffer", schedule_.batch_bytes());
            s.refs.resize(cfg.B);
        }
        start_thread();
    }
    DataLoader(const DataLoader&) = delete;
    DataLoader& operator=(const DataLoader&) = delete;
    ~DataLoader() { stop_thread(); }

    const SampleSchedule& schedule() const { return schedule_; }
    const DataLoaderConfig& config() const { return schedule_.config(); }
    bool prefetching() const { return config().prefetch > 0; }
    int ring_size() const { return int(ring_.size()); }

    // The next batch; its buffer stays valid and unchanged until the matching release().
    const HostBatch& acquire() {
        std::unique_lock<std::mutex> lock(mu_);
        if (consumed_ - released_ >= ring_.size()) {
            if (!prefetching()) {
                fail(kExitUsage, "DataLoader::acquire: the previous batch is still held; a loader without prefetch has "
                                 "one buffer, release() it first");
            }
            fail(kExitUsage, "DataLoader::acquire: all %zu buffers are held; release() one first", ring_.size());
        }
        if (!prefetching()) {  // the caller's thread reads the batch (again, after an error)
            fill(ring_[0], base_ + consumed_);
            produced_ = consumed_ + 1;
        }
        ready_cv_.wait(lock, [&] { return produced_ > consumed_; });
        Slot& s = ring_[consumed_ % ring_.size()];
        if (s.error) std::rethrow_exception(s.error);
        consumed_++;
        return s.view;
    }

    void release() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (released_ == consumed_) fail(kExitUsage, "DataLoader::release: no batch is held");
            released_++;
        }
        free_cv_.notify_all();
    }

    int held() const {
        std::lock_guard<std::mutex> lock(mu_);
        return int(consumed_ - released_);
    }

    // Releases every held batch and acquires the next one: for callers that use one batch at a time.
    const HostBatch& next() {
        while (held() > 0) release();
        return acquire();
    }

    void next_batch(int32_t* inputs, int32_t* targets) { unpack_batch(next(), inputs, targets); }

    // Global batches handed out so far, counted from the start of epoch 0: the index of the next batch.
    uint64_t position() const {
        std::lock_guard<std::mutex> lock(mu_);
        return base_ + consumed_;
    }
    // The epoch of the next sample to be handed out.
    uint64_t epoch() const { return schedule_.epoch_of_batch(position()); }

    // The position after the last acquired batch, as a blob for a checkpoint.
    std::vector<uint8_t> state() const { return schedule_.encode_state(position()); }
    std::vector<uint8_t> state_at(uint64_t batches) const { return schedule_.encode_state(batches); }

    // Continue from a saved state; buffers still held are dropped. allow_world_change: see decode_state.
    void restore(const std::vector<uint8_t>& blob, bool allow_world_change = false) {
        seek(schedule_.decode_state(blob, allow_world_change));
    }

    // Continue at global batch `batch` (0 = the start of epoch 0). Held buffers are dropped.
    void seek(uint64_t batch) {
        stop_thread();
        base_ = batch;
        produced_ = consumed_ = released_ = 0;
        for (Slot& s : ring_) s.error = nullptr;
        start_thread();
    }
    void reset() { seek(0); }

private:
    using Buffer = std::unique_ptr<void, std::function<void(void*)>>;
    struct Slot {
        Buffer tokens;
        std::vector<SampleRef> refs;
        HostBatch view;
        std::exception_ptr error;
    };

    void fill(Slot& s, uint64_t batch) {
        s.error = nullptr;
        try {
            reader_.read(batch, s.tokens.get(), s.refs.data());
            s.view = {s.tokens.get(), schedule_.token_bytes(), config().B, config().T, batch, s.refs[0].epoch,
                      s.refs.data()};
        } catch (...) {
            s.error = std::current_exception();
        }
    }

    void produce() {
        for (;;) {
            uint64_t n;
            {
                std::unique_lock<std::mutex> lock(mu_);
                free_cv_.wait(lock, [&] { return stop_ || (!failed_ && produced_ - released_ < ring_.size()); });
                if (stop_) return;
                n = produced_;
            }
            Slot& s = ring_[n % ring_.size()];
            fill(s, base_ + n);
            {
                std::lock_guard<std::mutex> lock(mu_);
                produced_++;
                if (s.error) failed_ = true;
            }
            ready_cv_.notify_all();
        }
    }

    void start_thread() {
        stop_ = false;
        failed_ = false;
        if (prefetching()) thread_ = std::thread([this] { produce(); });
    }
    void stop_thread() {
        if (!thread_.joinable()) return;
        {
            std::lock_guard<std::mutex> lock(mu_);
            stop_ = true;
        }
        free_cv_.notify_all();
        thread_.join();
    }

    SampleSchedule schedule_;
    BatchReader reader_;  // used by the prefetch thread while it runs, else by the caller
    HostAllocator allocator_;
    std::vector<Slot> ring_;
    mutable std::mutex mu_;
    std::condition_variable ready_cv_, free_cv_;
    std::thread thread_;
    bool stop_ = false, failed_ = false;
    uint64_t base_ = 0;  // global batch number of ring position 0
    uint64_t produced_ = 0, consumed_ = 0, released_ = 0;
};

}  // namespace llmc
