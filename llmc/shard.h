/*
The token shard file (llm.c's layout), written by the data tool and read by the DataLoader: 256 int32
header (20240520; version 1 = uint16 tokens, 2 = uint32 (ours); token count, low 32 bits, high 32 bits
in header[3] for version 2), then the tokens: exactly 1024 + count * bytes_per_token bytes.
*/
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "llmc/llmc_header.h"
#include "llmc/utils.h"

namespace llmc {

constexpr int32_t kShardMagic = 20240520;
constexpr int kShardHeaderInts = kLlmcHeaderInts;
constexpr int64_t kShardHeaderBytes = kLlmcHeaderBytes;
constexpr int64_t kShardV1MaxTokens = INT32_MAX;

struct ShardHeader {
    int version = 0;
    int64_t num_tokens = 0;
    int bytes_per_token = 0;  // 2 for version 1, 4 for version 2
};

inline int shard_bytes_per_token(int version) { return version == 1 ? 2 : version == 2 ? 4 : 0; }

// Byte offset of token `token` in a shard whose tokens are `bytes_per_token` wide.
inline int64_t shard_token_byte_offset(int64_t token, int bytes_per_token) {
    return kShardHeaderBytes + token * bytes_per_token;
}

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

// The shard format for llmc_header.h's reader.
inline const LlmcFileSpec& shard_file_spec() {
    static const LlmcFileSpec spec{
        "shard", "a token shard", kShardMagic, {1, 2}, "1 = uint16 tokens or 2 = uint32 tokens", {}};
    return spec;
}

// Reads and validates a shard's header: magic, version, and token count against the file's length.
inline ShardHeader read_shard_header(File& f) {
    const LlmcHeader header = read_llmc_header(f, shard_file_spec());
    const int version = header.version();
    if (version == 1 && header.ints[2] < 0) {
        fail(kExitData, "shard '%s': version 1 token count %d at offset 8 is negative (expected 0..%lld)",
             header.path.c_str(), header.ints[2], (long long)kShardV1MaxTokens);
    }
    uint64_t count = static_cast<uint32_t>(header.ints[2]);
    if (version == 2) count |= uint64_t(static_cast<uint32_t>(header.ints[3])) << 32;
    check_llmc_file_size(header, shard_file_spec(), count, shard_bytes_per_token(version), "token",
                         version == 1 ? "version 1, count at offset 8" : "version 2, count at offsets 8 and 12");
    return {version, static_cast<int64_t>(count), shard_bytes_per_token(version)};
}

}  // namespace llmc
