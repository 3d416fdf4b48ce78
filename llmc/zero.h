/*
ZeRO-1 shard geometry and the re-sharding of optimizer state between GPU counts: pure functions over
integers and host buffers, so every case can be checked on a CPU.

Provides: ZeroLayout, which pads the flat parameter array of N elements to P = W * S, with the shard
size S the smallest multiple of the alignment that is at least ceil(N / W); rank r holds the padded
range [r*S, (r+1)*S) and owns the real elements of it (its intersection with [0, N)), which is what
its AdamW update touches and what its checkpoint shard stores. The padded tail [N, P) exists only so
that NCCL's reduce-scatter and all-gather see equal shards: it is zero in the parameter and gradient
buffers (allocate P elements and zero them once; backward never writes there, a sum of zeros stays
zero) and no optimizer table covers it. A rank can own nothing (N < W, or N small against the
alignment); it still takes part in every collective.

Also: SavedShard (what one rank wrote: its rank, the world size and the [begin, begin+count) range it
owned), check_saved_shards() that the ranges of a checkpoint tile [0, N) exactly, and reshard_plan() /
reshard() that assemble a new rank's owned range from the pieces of the old shards, for any old and
new world sizes. The ranges come from the files, not from a recomputed layout, so a change of
alignment between runs cannot misplace state.

Does not provide: the file format of the shards (the checkpoint code), or anything CUDA or NCCL
(multi_gpu.cuh).
*/
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "llmc/utils.h"

namespace llmc {

// 128 elements: 256 bytes of bf16, 512 of fp32, so every shard starts where cudaMalloc's own alignment
// would put a buffer, and vectorised kernels can run over a shard without a ragged head.
constexpr int64_t kZeroAlignment = 128;

struct ShardRange {
    int64_t begin = 0, end = 0;
    int64_t size() const { return end - begin; }
    bool empty() const { return end <= begin; }
};

inline ShardRange intersect(ShardRange a, ShardRange b) {
    ShardRange r{std::max(a.begin, b.begin), std::min(a.end, b.end)};
    if (r.end < r.begin) r.end = r.begin;
    return r;
}

struct ZeroLayout {
    int64_t num_params = 0;  // N, the real parameters
    int world = 1;           // W
    int64_t alignment = kZeroAlignment;
    int64_t shard_size = 0;  // S, a multiple of the alignment

    int64_t padded_total() const { return shard_size * world; }
    int64_t padding() const { return padded_total() - num_params; }

    // The padded range rank r holds in the reduce-scatter and all-gather buffers.
    ShardRange shard(int rank) const {
        check_rank(rank);
        return {int64_t(rank) * shard_size, int64_t(rank + 1) * shard_size};
    }
    // The real elements rank r updates and saves; a rank past the end owns the empty range [N, N).
    ShardRange owned(int rank) const {
        const ShardRange r = intersect(shard(rank), {0, num_params});
        return r.empty() ? ShardRange{num_params, num_params} : r;
    }
    int owner_of(int64_t index) const {
        if (index < 0 || index >= num_params) {
            fail(kExitError, "ZeroLayout: element %lld is outside the %lld parameters", (long long)index,
                 (long long)num_params);
        }
        return int(index / shard_size);
    }

private:
    void check_rank(int rank) const {
        if (rank < 0 || rank >= world) fail(kExitError, "ZeroLayout: rank %d is outside 0..%d", rank, world - 1);
    }
};

inline ZeroLayout zero_layout(int64_t num_params, int world, int64_t alignment = kZeroAlignment) {
    if (num_params < 1) fail(kExitUsage, "ZeRO-1: %lld parameters, need at least 1", (long long)num_params);
    if (world < 1) fail(kExitUsage, "ZeRO-1: world size %d, need at least 1", world);
    if (alignment < 1) fail(kExitUsage, "ZeRO-1: alignment %lld, need at least 1", (long long)alignment);
    ZeroLayout z;
    z.num_params = num_params;
    z.world = world;
    z.alignment = alignment;
    const int64_t per_rank = (num_params + world - 1) / world;
    z.shard_size = (per_rank + alignment - 1) / alignment * alignment;
    return z;
}

// One optimizer-state shard as a checkpoint recorded it.
struct SavedShard {
    std::string path;  // for messages
    int rank = 0;
    int world = 1;
    int64_t begin = 0;  // first parameter it holds
    int64_t count = 0;  // how many (0 for a rank that owned nothing)
    ShardRange range() const { return {begin, begin + count}; }
};

// The shard a rank of `layout` would write: its owned range.
inline SavedShard saved_shard(const ZeroLayout& layout, int rank, std::string path = std::string()) {
    const ShardRange r = layout.owned(rank);
    SavedShard s;
    s.path = std::move(path);
    s.rank = rank;
    s.world = layout.world;
    s.begin = r.begin;
    s.count = r.size();
    return s;
}

// A checkpoint's shards must be exactly one per rank 0..W-1 of one world size W, and their ranges,
// taken in rank order, must tile [0, num_params) with no gap and no overlap. Anything else is a damaged
// or mixed-up checkpoint (kExitData), named by file.
inline void check_saved_shards(const std::vector<SavedShard>& shards, int64_t num_params) {
    if (shards.empty()) fail(kExitData, "optimizer checkpoint: no shard files found");
    const int world = shards[0].world;
    if (world < 1) fail(kExitData, "optimizer shard '%s': world size %d", shards[0].path.c_str(), world);
    if (int(shards.size()) != world) {
        fail(kExitData, "optimizer checkpoint: %zu shard files, but '%s' says the run had %d ranks", shards.size(),
             shards[0].path.c_str(), world);
    }
    std::vector<const SavedShard*> by_rank(size_t(world), nullptr);
    for (const SavedShard& s : shards) {
        if (s.world != world) {
            fail(kExitData, "optimizer shard '%s' is from a run of %d ranks, '%s' from one of %d", s.path.c_str(),
                 s.world, shards[0].path.c_str(), world);
        }
        if (s.rank < 0 || s.rank >= world) {
            fail(kExitData, "optimizer shard '%s': rank %d is outside 0..%d", s.path.c_str(), s.rank, world - 1);
        }
        if (by_rank[size_t(s.rank)] != nullptr) {
            fail(kExitData, "optimizer shards '%s' and '%s' both claim rank %d", by_rank[size_t(s.rank)]->path.c_str(),
                 s.path.c_str(), s.rank);
        }
        if (s.begin < 0 || s.count < 0) {
            fail(kExitData, "optimizer shard '%s': range begin %lld count %lld", s.path.c_str(), (long long)s.begin,
                 (long long)s.count);
        }
        // Checked apart from the tiling below, where begin + count of a hostile file could overflow.
        if (s.count > 0 && (s.begin >= num_params || s.count > num_params - s.begin)) {
            fail(kExitData, "optimizer shard '%s' (rank %d): range begin %lld count %lld reaches past the model's %lld "
                 "parameters", s.path.c_str(), s.rank, (long long)s.begin, (long long)s.count, (long long)num_params);
        }
        by_rank[size_t(s.rank)] = &s;
    }
    int64_t next = 0;
    for (const SavedShard* s : by_rank) {
        if (s->count == 0) continue;
        if (s->begin != next) {
            fail(kExitData, "optimizer shard '%s' (rank %d) starts at parameter %lld, expected %lld (%s)",
                 s->path.c_str(), s->rank, (long long)s->begin, (long long)next,
                 s->begin > next ? "a gap: parameters no shard holds" : "it overlaps the previous rank's shard");
        }
        next = s->begin + s->count;
    }
    if (next != num_params) {
        fail(kExitData, "optimizer checkpoint: the shards hold parameters [0, %lld), the model has %lld", (long long)next,
             (long long)num_params);
    }
}

// One contiguous copy: `count` elements from position `src_offset` of saved shard number `source` (an
// index into the vector given to reshard_plan) to position `dst_offset` of the new owned range.
struct ShardPiece {
    int source = 0;
    int64_t src_offset = 0;
    int64_t dst_offset = 0;
    int64_t count = 0;
};

// The copies that fill `target` (a new rank's owned range) from the saved shards, in ascending order
// of destination. check_saved_shards() first, so that every element has exactly one source.
inline std::vector<ShardPiece> reshard_plan(const std::vector<SavedShard>& saved, ShardRange target) {
    std::vector<ShardPiece> pieces;
    for (size_t i = 0; i < saved.size(); i++) {
        const ShardRange common = intersect(saved[i].range(), target);
        if (common.empty()) continue;
        pieces.push_back({int(i), common.begin - saved[i].begin, common.begin - target.begin, common.size()});
    }
    std::sort(pieces.begin(), pieces.end(),
              [](const ShardPiece& a, const ShardPiece& b) { return a.dst_offset < b.dst_offset; });
    int64_t covered = 0;
    for (const ShardPiece& p : pieces) {
        if (p.dst_offset != covered) break;
        covered += p.count;
    }
    if (covered != target.size()) {
        fail(kExitData, "optimizer checkpoint: the shards do not cover parameters [%lld, %lld) (run check_saved_shards)",
             (long long)target.begin, (long long)target.end);
    }
    return pieces;
}

// Fills a new rank's shard of one optimizer array (S = to.shard_size elements of T) from the saved
// shards: `read(piece, dst)` copies piece.count elements of the old shard piece.source, starting at
// piece.src_offset, to dst (a file read in the checkpoint code, a memcpy in tests). The padding after
// the owned elements is zeroed, so a re-sharded state never carries stale values into the tail.
template <class T, class ReadPiece>
void reshard(const std::vector<SavedShard>& saved, const ZeroLayout& to, int new_rank, T* out, ReadPiece&& read) {
    const ShardRange target = to.owned(new_rank);
    for (const ShardPiece& p : reshard_plan(saved, target)) read(p, out + p.dst_offset);
    std::fill(out + target.size(), out + to.shard_size, T(0));
}

// The same over host buffers: old[i] holds saved[i].count elements.
template <class T>
void reshard(const std::vector<SavedShard>& saved, const std::vector<const T*>& old, const ZeroLayout& to,
             int new_rank, T* out) {
    if (old.size() != saved.size()) {
        fail(kExitError, "reshard: %zu buffers for %zu saved shards", old.size(), saved.size());
    }
    reshard(saved, to, new_rank, out, [&](const ShardPiece& p, T* dst) {
        std::memcpy(dst, old[size_t(p.source)] + p.src_offset, size_t(p.count) * sizeof(T));
    });
}

}  // namespace llmc
