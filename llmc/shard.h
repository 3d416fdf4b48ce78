/*
The token shard file (llm.c's layout), written by the data tool (dev/tools/shard_write.h) and read by the
DataLoader: 256 int32 header (20240520; version 1 = uint16 tokens, 2 = uint32 (ours); token count, low 32
bits, high 32 bits in header[3] for version 2), then the tokens: exactly 1024 + count * bytes_per_token bytes.
*/
#pragma once

#include <cstdint>
#include <string>

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
