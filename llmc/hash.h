/*
Hashes of byte strings, written here once so a stored value is computed the same by every later build:
fnv1a64 (chainable; state blobs, shard lists, the ranks' settings check) and checksum64 (four
interleaved lanes at memory speed; checkpoint chunks and manifests). Not cryptographic.
*/
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace llmc {

constexpr uint64_t kFnv1a64Basis = 0xcbf29ce484222325ull;
constexpr uint64_t kFnv1a64Prime = 0x100000001b3ull;

inline uint64_t fnv1a64(const void* data, size_t n, uint64_t h = kFnv1a64Basis) {
    const unsigned char* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * kFnv1a64Prime;
    return h;
}

inline uint64_t fnv1a64(const std::string& s, uint64_t h = kFnv1a64Basis) { return fnv1a64(s.data(), s.size(), h); }

// checksum64: every step is a bijection, so any change confined to one 8-byte word changes the result.

namespace detail {
inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t fmix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 29;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 32;
    return x;
}
inline uint64_t load64(const unsigned char* p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
}
constexpr uint64_t kLaneMul = 0x9e3779b97f4a7c15ull;
constexpr uint64_t kWordMul = 0xd6e8feb86659fd93ull;
inline uint64_t lane_step(uint64_t v, uint64_t w) { return rotl64(v ^ (w * kWordMul), 29) * kLaneMul; }
}  // namespace detail

inline uint64_t checksum64(const void* data, size_t n) {
    using namespace detail;
    const unsigned char* p = static_cast<const unsigned char*>(data);
    uint64_t v[4] = {0x243f6a8885a308d3ull, 0x13198a2e03707344ull, 0xa4093822299f31d0ull, 0x082efa98ec4e6c89ull};
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        for (int k = 0; k < 4; k++) v[k] = lane_step(v[k], load64(p + i + 8 * k));
    }
    int lane = 0;
    for (; i + 8 <= n; i += 8) v[lane] = lane_step(v[lane], load64(p + i)), lane++;
    if (i < n) {
        unsigned char tail[8] = {0};
        std::memcpy(tail, p + i, n - i);
        v[lane] = lane_step(v[lane], load64(tail));
    }
    uint64_t h = uint64_t(n) * kLaneMul;
    for (int k = 0; k < 4; k++) h = rotl64(h ^ fmix64(v[k] + uint64_t(k)), 23) * kWordMul;
    return fmix64(h);
}

}  // namespace llmc
