/*
Helpers shared by the tests: a temporary directory that removes itself, and deterministic random data
(bytes and token ids) from llmc's SplitMix64, so that a failing case replays exactly from its seed.

CPU-only (no CUDA, no GoogleTest), usable from .cpp and .cu tests alike. Does not provide: fixtures,
assertions, or random floats (tests that need those draw them next to the distribution they test).
*/
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include <stdlib.h>

#include "llmc/rand.h"

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

// n bytes, the same for the same seed and different for different seeds.
inline std::vector<char> random_bytes(size_t n, uint64_t seed) {
    SplitMix64 rng(seed);
    std::vector<char> v(n);
    for (char& b : v) b = static_cast<char>(rng.next() >> 56);
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

}  // namespace llmc::test
