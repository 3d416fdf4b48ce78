/*
ZeRO-1 shard geometry, pure integer functions. ZeroLayout pads N parameters to P = W * S (S the smallest
multiple of the alignment >= ceil(N / W)); rank r holds [r*S, (r+1)*S) and owns its intersection with
[0, N). The padded tail exists only for NCCL's equal shards: zero in the parameter and gradient buffers,
covered by no optimizer table. A rank may own nothing; it still takes part in every collective.
*/
#pragma once

#include <algorithm>
#include <cstdint>

#include "llmc/utils.h"

namespace llmc {

// 128 elements (256 bytes of bf16): every shard starts where cudaMalloc would align a buffer.
constexpr int64_t kZeroAlignment = 128;

struct ShardRange {
    int64_t begin = 0, end = 0;
    int64_t size() const { return end - begin; }
    bool empty() const { return end <= begin; }
};

struct ZeroLayout {
    int64_t num_params = 0;  // N, the real parameters
    int world = 1;           // W
    int64_t alignment = kZeroAlignment;
    int64_t shard_size = 0;  // S, a multiple of the alignment

    int64_t padded_total() const { return shard_size * world; }
    int64_t padding() const { return padded_total() - num_params; }

    // The padded range rank r holds in the reduce-scatter and all-gather buffers.
    ShardRange shard(int rank) const {
        if (rank < 0 || rank >= world) fail(kExitError, "ZeroLayout: rank %d is outside 0..%d", rank, world - 1);
        return {int64_t(rank) * shard_size, int64_t(rank + 1) * shard_size};
    }
    // The real elements rank r updates and saves; a rank past the end owns the empty range [N, N).
    ShardRange owned(int rank) const {
        const ShardRange s = shard(rank);
        return {std::min(s.begin, num_params), std::min(s.end, num_params)};
    }
};

inline ZeroLayout zero_layout(int64_t num_params, int world, int64_t alignment = kZeroAlignment) {
    if (num_params < 1) fail(kExitUsage, "ZeRO-1: %lld parameters, need at least 1", (long long)num_params);
    if (world < 1) fail(kExitUsage, "ZeRO-1: world size %d, need at least 1", world);
    if (alignment < 1) fail(kExitUsage, "ZeRO-1: alignment %lld, need at least 1", (long long)alignment);
    const int64_t per_rank = (num_params + world - 1) / world;
    return {num_params, world, alignment, (per_rank + alignment - 1) / alignment * alignment};
}

}  // namespace llmc
