/*
Picking the next token for the trainers' samples (both trainers, so a model samples alike on either):
sample_token() is greedy at temperature 0 (the lower id on ties), else a draw from softmax(logits /
temperature) over the top_k largest (0: all), in double, one SplitMix64 number a draw. parse_token_ids()
reads --prompt-ids.
*/
#pragma once

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

#include "llmc/rand.h"
#include "llmc/utils.h"

namespace llmc {

inline uint32_t sample_token(const std::vector<float>& logits, float temperature, int top_k, SplitMix64& rng) {
    const int V = int(logits.size());
    std::vector<int> ids(static_cast<size_t>(V));
    std::iota(ids.begin(), ids.end(), 0);
    auto better = [&](int a, int b) {
        return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b);
    };
    if (temperature == 0.0f) return uint32_t(*std::min_element(ids.begin(), ids.end(), better));
    const int k = (top_k > 0 && top_k < V) ? top_k : V;
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), better);
    const double top = logits[size_t(ids[0])];
    std::vector<double> w(static_cast<size_t>(k));
    double sum = 0.0;
    for (int i = 0; i < k; i++) {
        w[size_t(i)] = std::exp((double(logits[size_t(ids[size_t(i)])]) - top) / double(temperature));
        sum += w[size_t(i)];
    }
    const double u = double(rng.next() >> 11) * 0x1.0p-53 * sum;
    double acc = 0.0;
    for (int i = 0; i < k; i++) {
        acc += w[size_t(i)];
        if (u < acc) return uint32_t(ids[size_t(i)]);
    }
    return uint32_t(ids[size_t(k - 1)]);
}

// "a,b,c" -> token ids (empty: none), each below vocab_size; `flag` names the option in errors.
inline std::vector<uint32_t> parse_token_ids(const std::string& text, int vocab_size, const char* flag) {
    std::vector<uint32_t> ids;
    if (text.empty()) return ids;
    for (const std::string& item : split(text, ',')) {
        char* end = nullptr;
        errno = 0;
        const long long v = item.empty() ? -1 : std::strtoll(item.c_str(), &end, 10);
        if (item.empty() || errno != 0 || *end != '\0' || v < 0) {
            fail(kExitUsage, "%s '%s': '%s' is not a token id (a non-negative integer)", flag, text.c_str(), item.c_str());
        }
        if (v >= vocab_size) {
            fail(kExitUsage, "%s: token %lld is outside the model's vocabulary [0, %d)", flag, v, vocab_size);
        }
        ids.push_back(uint32_t(v));
    }
    return ids;
}

}  // namespace llmc
