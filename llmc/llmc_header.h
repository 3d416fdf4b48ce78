/*
llm.c's file header (256 little-endian int32: magic, version, the format's fields), the one reader for
model files and token shards: read_llmc_header() checks the length, magic and version (a retired one
with its own hint); check_llmc_file_size() the exact length the header implies (overflow-safe). Errors
name the file, the field's offset and what was expected (kExitData; kExitIo for a read error).
*/
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "llmc/utils.h"

namespace llmc {

constexpr int kLlmcHeaderInts = 256;
constexpr int64_t kLlmcHeaderBytes = kLlmcHeaderInts * int64_t(sizeof(int32_t));

// What a reader expects of a header: `kind` and `a_kind` name the file in messages ("shard", "a token
// shard"), `versions` lists what header[1] may hold and `versions_text` says it to the user.
struct LlmcFileSpec {
    const char* kind;
    const char* a_kind;
    int32_t magic;
    std::vector<int> versions;
    const char* versions_text;
    std::vector<std::pair<int, const char*>> retired;  // versions no longer read, with what to do instead
};

struct LlmcHeader {
    std::string path;
    int64_t file_size = 0;
    int32_t ints[kLlmcHeaderInts] = {};
    int version() const { return ints[1]; }
};

inline LlmcHeader read_llmc_header(File& f, const LlmcFileSpec& spec) {
    LlmcHeader h;
    h.path = f.path();
    const char* path = h.path.c_str();
    h.file_size = f.size();
    if (h.file_size < kLlmcHeaderBytes) {
        fail(kExitData, "%s '%s' is %lld bytes, shorter than its %lld-byte header (truncated, or not %s)", spec.kind,
             path, (long long)h.file_size, (long long)kLlmcHeaderBytes, spec.a_kind);
    }
    f.seek(0);
    f.read_exact(h.ints, sizeof(h.ints));
    if (h.ints[0] != spec.magic) {
        fail(kExitData, "%s '%s': bad magic %d at offset 0 (expected %d); is this %s?", spec.kind, path, h.ints[0],
             spec.magic, spec.a_kind);
    }
    for (const auto& [version, hint] : spec.retired) {
        if (h.version() == version) {
            fail(kExitData, "%s '%s': version %d at offset 4 %s", spec.kind, path, version, hint);
        }
    }
    if (std::count(spec.versions.begin(), spec.versions.end(), h.version())) return h;
    fail(kExitData, "%s '%s': unsupported version %d at offset 4 (expected %s)", spec.kind, path, h.version(),
         spec.versions_text);
}

// The file must hold the header and exactly `items` items of `item_bytes` bytes; `fields` names the
// header fields that decided the count, e.g. "version 1, count at offset 8".
inline void check_llmc_file_size(const LlmcHeader& h, const LlmcFileSpec& spec, uint64_t items, int item_bytes,
                                 const char* item_name, const std::string& fields) {
    const char* path = h.path.c_str();
    // Compared as an item count first, so that a huge corrupt count cannot overflow the byte arithmetic.
    const uint64_t room = uint64_t(h.file_size - kLlmcHeaderBytes) / uint64_t(item_bytes);
    const uint64_t max_items = (uint64_t(INT64_MAX) - uint64_t(kLlmcHeaderBytes)) / uint64_t(item_bytes);
    const std::string expected =
        items > max_items ? std::string("more than 2^63")
                          : format("%lld", (long long)(kLlmcHeaderBytes + int64_t(items) * item_bytes));
    const std::string says = format("its header (%s) says %llu %ss of %d bytes, %s bytes with the header, but the file "
                                    "is %lld bytes", fields.c_str(), (unsigned long long)items, item_name, item_bytes,
                                    expected.c_str(), (long long)h.file_size);
    if (items > room) {
        fail(kExitData, "%s '%s' is truncated: %s, room for %llu %ss", spec.kind, path, says.c_str(),
             (unsigned long long)room, item_name);
    }
    const int64_t extra = h.file_size - (kLlmcHeaderBytes + int64_t(items) * item_bytes);
    if (extra != 0) {
        fail(kExitData, "%s '%s': %s (%lld unexpected bytes after the last %s: trailing data, or a header that does "
             "not match the data)", spec.kind, path, says.c_str(), (long long)extra, item_name);
    }
}

}  // namespace llmc
