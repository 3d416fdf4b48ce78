/*
write_token_shard(): writes llmc/shard.h's token shard format. Only the data tool, the benchmarks and the
tests write shards; the trainers only read them.
*/
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "llmc/shard.h"
#include "llmc/utils.h"

namespace llmc {

// Writes a shard of `n` tokens whole or not at all. Version 1 stores uint16 (ids <= 65535, fewer than
// 2^31 tokens), version 2 uint32. A refused shard leaves no file.
inline void write_token_shard(const std::string& path, const uint32_t* tokens, size_t n, int version) {
    if (version != 1 && version != 2) fail(kExitUsage, "shard '%s': unknown version %d (1 or 2)", path.c_str(), version);
    if (version == 1 && n > uint64_t(kShardV1MaxTokens)) {
        fail(kExitUsage, "shard '%s': %zu tokens do not fit a version 1 header (at most %lld); use version 2",
             path.c_str(), n, (long long)kShardV1MaxTokens);
    }
    // The count's low 32 bits, and for version 2 its high 32 bits.
    const int32_t header[kShardHeaderInts] = {kShardMagic, version, static_cast<int32_t>(uint32_t(n & 0xffffffffu)),
                                              version == 2 ? static_cast<int32_t>(uint32_t(uint64_t(n) >> 32)) : 0};
    std::vector<uint16_t> narrow;
    if (version == 1) {
        const uint32_t* wide = std::find_if(tokens, tokens + n, [](uint32_t t) { return t > 0xffffu; });
        if (wide != tokens + n) {
            fail(kExitUsage, "shard '%s': token %zu has id %u, which does not fit uint16; use version 2", path.c_str(),
                 size_t(wide - tokens), *wide);
        }
        narrow.assign(tokens, tokens + n);
    }
    write_file_atomically(path, [&](File& f) {
        f.write_all(header, sizeof(header));
        if (version == 2) f.write_all(tokens, n * sizeof(uint32_t));
        else f.write_all(narrow.data(), n * sizeof(uint16_t));
    });
}

}  // namespace llmc
