/*
Random numbers built on SplitMix64, written here so their bits are the same on every machine and
compiler: splitmix64_mix (a bijection), splitmix64_hash (a counter's hash), SplitMix64 (the stateful
generator), rng_key / rng_u32 (the GPU's counter-based generator: any element's number recomputed alone,
whatever the launch) and counter_normal (the initialisation). __host__ __device__ under nvcc.
*/
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define LLMC_HOST_DEVICE __host__ __device__
#else
#define LLMC_HOST_DEVICE
#endif

namespace llmc {

// SplitMix64's increment, 2^64 / golden ratio, odd: consecutive states never repeat within 2^64 steps.
constexpr uint64_t kSplitMix64Gamma = 0x9e3779b97f4a7c15ull;

LLMC_HOST_DEVICE inline uint64_t splitmix64_mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

LLMC_HOST_DEVICE inline uint64_t splitmix64_hash(uint64_t z) { return splitmix64_mix(z + kSplitMix64Gamma); }

// A 64-bit counter passed through the finaliser. Small, seedable, and fully specified here.
class SplitMix64 {
public:
    explicit SplitMix64(uint64_t state) : state_(state) {}
    uint64_t next() {
        state_ += kSplitMix64Gamma;
        return splitmix64_mix(state_);
    }
    // Uniform in [0, n): rejection keeps it unbiased (the modulo alone would favour small values).
    uint64_t below(uint64_t n) {
        uint64_t threshold = (0 - n) % n;
        for (;;) {
            uint64_t r = next();
            if (r >= threshold) return r % n;
        }
    }
    uint64_t state() const { return state_; }

private:
    uint64_t state_;
};

// One key per (seed, stream), e.g. stream = optimizer step; computed on the host once per launch.
LLMC_HOST_DEVICE inline uint64_t rng_key(uint64_t seed, uint64_t stream) {
    return splitmix64_hash(splitmix64_hash(seed) ^ splitmix64_hash(stream + 0x632be59bd9b4e019ull));
}

// The hash of (key + index * odd constant): independent-looking words for consecutive indices.
LLMC_HOST_DEVICE inline uint32_t rng_u32(uint64_t key, uint64_t index) {
    return uint32_t(splitmix64_hash(key + index * 0xd1b54a32d192ed03ull) >> 32);
}

// Box-Muller on two counter hashes, in double, so initialisation is the same whatever the thread count
// and any tensor can be regenerated alone.
inline double counter_normal(uint64_t seed, uint64_t stream, uint64_t index) {
    uint64_t key = splitmix64_hash(splitmix64_hash(seed) ^ (stream * 0xd1b54a32d192ed03ull));
    uint64_t a = splitmix64_hash(key ^ splitmix64_hash(2 * index));
    uint64_t b = splitmix64_hash(key ^ splitmix64_hash(2 * index + 1));
    double u1 = double((a >> 11) + 1) * 0x1.0p-53;  // (0, 1], so the log is finite
    double u2 = double(b >> 11) * 0x1.0p-53;        // [0, 1)
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

}  // namespace llmc
