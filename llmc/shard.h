/*
The token shard file format, shared by the data preparation tool (writer) and the DataLoader (reader).

A shard is llm.c's layout: a header of 256 int32 values, then the tokens.
    header[0] = 20240520 (magic)
    header[1] = version: 1 = uint16 tokens (llm.c's format, vocabularies up to 65,536 ids)
                         2 = uint32 tokens (our extension, for larger vocabularies)
    header[2] = number of tokens (low 32 bits; header[3] holds the high 32 bits when version 2 needs them)
The rest of the header is zero. Token i sits at byte 1024 + i * bytes_per_token.

Provides: the constants, write_token_shard() and read_shard_header() that validates a shard's header
against its file length. Does not provide: reading tokens in batches (dataloader.h does that).
*/
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "llmc/utils.h"

namespace llmc {

constexpr int32_t kShardMagic = 20240520;
constexpr int kShardHeaderInts = 256;
constexpr int64_t kShardHeaderBytes = kShardHeaderInts * (int64_t)sizeof(int32_t);

struct ShardHeader {
    int version = 0;
    int64_t num_tokens = 0;
    int bytes_per_token = 0;  // 2 for version 1, 4 for version 2
};

inline int shard_bytes_per_token(int version) { return version == 1 ? 2 : version == 2 ? 4 : 0; }

// Writes a shard of `n` tokens. Version 1 stores uint16 and refuses ids above 65535; version 2 stores uint32.
inline void write_token_shard(const std::string& path, const uint32_t* tokens, size_t n, int version) {
    if (version != 1 && version != 2) fail(kExitUsage, "shard '%s': unknown version %d (1 or 2)", path.c_str(), version);
    if (version == 1 && n > UINT32_MAX) {
        fail(kExitUsage, "shard '%s': %zu tokens do not fit a version 1 header; use version 2", path.c_str(), n);
    }
    int32_t header[kShardHeaderInts] = {};
    header[0] = kShardMagic;
    header[1] = version;
    header[2] = static_cast<int32_t>(static_cast<uint32_t>(n & 0xffffffffu));
    if (version == 2) header[3] = static_cast<int32_t>(static_cast<uint32_t>(uint64_t(n) >> 32));
    File f(path, File::Mode::Write);
    f.write_all(header, sizeof(header));
    if (version == 2) {
        f.write_all(tokens, n * sizeof(uint32_t));
    } else {
        std::vector<uint16_t> narrow(n);
        for (size_t i = 0; i < n; i++) {
            if (tokens[i] > 0xffffu) {
                fail(kExitUsage, "shard '%s': token %zu has id %u, which does not fit uint16; use version 2", path.c_str(),
                     i, tokens[i]);
            }
            narrow[i] = static_cast<uint16_t>(tokens[i]);
        }
        f.write_all(narrow.data(), n * sizeof(uint16_t));
    }
    f.close();
}

// Reads and validates a shard's header: magic, version, and token count against the file's length.
inline ShardHeader read_shard_header(File& f) {
    int64_t file_size = f.size();
    if (file_size < kShardHeaderBytes) {
        fail(kExitData, "shard '%s' is %lld bytes, shorter than its %lld-byte header", f.path().c_str(),
             (long long)file_size, (long long)kShardHeaderBytes);
    }
    int32_t header[kShardHeaderInts];
    f.seek(0);
    f.read_exact(header, sizeof(header));
    if (header[0] != kShardMagic) {
        fail(kExitData, "shard '%s': bad magic %d at offset 0 (expected %d); is this a token shard?", f.path().c_str(),
             header[0], kShardMagic);
    }
    ShardHeader h;
    h.version = header[1];
    h.bytes_per_token = shard_bytes_per_token(h.version);
    if (h.bytes_per_token == 0) {
        fail(kExitData, "shard '%s': unsupported version %d at offset 4 (expected 1 or 2)", f.path().c_str(), h.version);
    }
    uint64_t count = static_cast<uint32_t>(header[2]);
    if (h.version == 2) count |= uint64_t(static_cast<uint32_t>(header[3])) << 32;
    h.num_tokens = static_cast<int64_t>(count);
    int64_t expected = kShardHeaderBytes + h.num_tokens * h.bytes_per_token;
    if (expected != file_size) {
        fail(kExitData, "shard '%s': header says %lld tokens (%lld bytes in all) but the file is %lld bytes",
             f.path().c_str(), (long long)h.num_tokens, (long long)expected, (long long)file_size);
    }
    return h;
}

}  // namespace llmc
