/*
Helpers shared by the tests: a temporary directory that removes itself; deterministic random data (bytes,
token ids, floats) from llmc's SplitMix64, so that a failing case replays exactly from its seed; whole-file
reads and writes; directories of token shards filled with random tokens; and a file size limit that makes
writes fail part way, as a full disk does.

CPU-only (no CUDA, no GoogleTest), usable from .cpp and .cu tests alike. Does not provide: fixtures or
assertions (expect_error.h, gpu_test.h).
*/
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>

#include "llmc/rand.h"
#include "llmc/shard.h"
#include "llmc/utils.h"

namespace llmc::test {

// A fresh directory under the system's temporary folder, removed with everything in it at the end of
// the scope. `prefix` names the test in the directory's name, which helps when one is left behind.
class TempDir {
public:
    explicit TempDir(const std::string& prefix = "llmc_test") {
        std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "_XXXXXX")).string();
        if (!::mkdtemp(tmpl.data())) throw std::runtime_error("cannot create a temporary directory " + tmpl);
        path_ = tmpl;
    }
    ~TempDir() {
        std::error_code ec;  // a destructor must not throw: a leftover directory is reported, not fatal
        std::filesystem::remove_all(path_, ec);
        if (ec) std::fprintf(stderr, "warning: cannot remove %s: %s\n", path_.c_str(), ec.message().c_str());
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;

    const std::string& path() const { return path_; }
    std::string file(const std::string& name) const { return path_ + "/" + name; }
    std::string operator/(const std::string& name) const { return file(name); }

private:
    std::string path_;
};

// n bytes, the same for the same seed and different for different seeds; eight per generator step, so
// that gigabytes take a moment.
inline std::vector<char> random_bytes(size_t n, uint64_t seed) {
    SplitMix64 rng(seed);
    std::vector<char> v(n);
    for (size_t i = 0; i < n; i += 8) {
        const uint64_t r = rng.next();
        std::memcpy(v.data() + i, &r, std::min<size_t>(8, n - i));
    }
    return v;
}

// n token ids uniform in [0, vocab), as T (uint32_t for shards, int for the model's inputs).
template <class T = uint32_t>
std::vector<T> random_tokens(size_t n, uint32_t vocab, uint64_t seed) {
    SplitMix64 rng(seed);
    std::vector<T> t(n);
    for (T& x : t) x = static_cast<T>(rng.below(vocab));
    return t;
}

// n floats uniform in [-scale, scale).
inline std::vector<float> random_floats(size_t n, uint64_t seed, float scale) {
    SplitMix64 rng(seed);
    std::vector<float> v(n);
    for (float& x : v) x = scale * (2.0f * float(double(rng.next() >> 11) * 0x1.0p-53) - 1.0f);
    return v;
}

// While in scope, a write that would take any file of this process past `bytes` fails with EFBIG (the
// soft RLIMIT_FSIZE, with SIGXFSZ ignored so that the write fails rather than the process being killed):
// a disk that fills at a known offset. The previous limit and signal action come back at the end.
class FileSizeLimit {
public:
    explicit FileSizeLimit(uint64_t bytes) {
        if (::getrlimit(RLIMIT_FSIZE, &old_limit_) != 0) throw std::runtime_error("getrlimit(RLIMIT_FSIZE) failed");
        struct sigaction ignore = {};
        ignore.sa_handler = SIG_IGN;
        if (::sigaction(SIGXFSZ, &ignore, &old_action_) != 0) throw std::runtime_error("sigaction(SIGXFSZ) failed");
        struct rlimit limit = old_limit_;
        limit.rlim_cur = bytes;
        if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) throw std::runtime_error("setrlimit(RLIMIT_FSIZE) failed");
    }
    ~FileSizeLimit() {
        ::setrlimit(RLIMIT_FSIZE, &old_limit_);
        ::sigaction(SIGXFSZ, &old_action_, nullptr);
    }
    FileSizeLimit(const FileSizeLimit&) = delete;
    FileSizeLimit& operator=(const FileSizeLimit&) = delete;

private:
    struct rlimit old_limit_;
    struct sigaction old_action_;
};

inline std::vector<char> read_bytes(const std::string& path) {
    File f(path, File::Mode::Read);
    std::vector<char> v(size_t(f.size()));
    f.read_exact(v.data(), v.size());
    return v;
}

inline std::string read_text(const std::string& path) {
    const std::vector<char> v = read_bytes(path);
    return std::string(v.begin(), v.end());
}

// Creates or replaces `path` with exactly these bytes.
inline void write_bytes(const std::string& path, const void* data, size_t n) {
    File f(path, File::Mode::Write);
    f.write_all(data, n);
    f.close();
}
inline void write_bytes(const std::string& path, const std::vector<char>& bytes) {
    write_bytes(path, bytes.data(), bytes.size());
}
inline void write_bytes(const std::string& path, const std::string& text) { write_bytes(path, text.data(), text.size()); }

// Writes dir/shard_000.bin, shard_001.bin, ... with sizes[i] random tokens below `vocab` each (seeded by
// seed * 1000 + i), alternating versions 1 and 2 where the vocabulary fits 16 bits, else all version 2.
// Returns every shard's tokens; the shards match dir + "/shard_*.bin".
inline std::vector<std::vector<uint32_t>> write_random_shards(const std::string& dir, const std::vector<size_t>& sizes,
                                                              uint32_t vocab, uint64_t seed) {
    std::vector<std::vector<uint32_t>> tokens;
    for (size_t i = 0; i < sizes.size(); i++) {
        tokens.push_back(random_tokens(sizes[i], vocab, seed * 1000 + i));
        const int version = (vocab > 65536 || i % 2 == 1) ? 2 : 1;
        write_token_shard(dir + "/" + format("shard_%03zu.bin", i), tokens.back().data(), sizes[i], version);
    }
    return tokens;
}

}  // namespace llmc::test
